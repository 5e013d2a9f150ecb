"""A griffe extension: an attribute's ``#:`` comment is its docstring.

lowprec documents its module constants the way Sphinx reads them, with ``#:`` comment lines just
above the assignment (``#: Values accepted by the optimizers' master= argument.``). griffe reads
docstrings only, so without this the API reference would list ``MASTER_CHOICES`` and the other
constants bare. mkdocs.yml loads it for mkdocstrings, and tests/test_docs.py loads it to check
that every public name has a description.
"""

from __future__ import annotations

from typing import Any

import griffe


def comment_above(lines: list[str], lineno: int) -> str | None:
    """The ``#:`` comment block right above line ``lineno`` (1-based), without the markers."""
    block: list[str] = []
    i = lineno - 2
    while i >= 0 and lines[i].lstrip().startswith("#:"):
        block.append(lines[i].lstrip()[2:].strip())
        i -= 1
    return "\n".join(reversed(block)) or None


class CommentDocstrings(griffe.Extension):
    """Give an attribute without a docstring the ``#:`` comment above its assignment."""

    def on_attribute_instance(self, *, attr: griffe.Attribute, **kwargs: Any) -> None:
        if attr.docstring is not None or attr.lineno is None or attr.filepath is None:
            return
        try:
            lines = attr.lines_collection[attr.filepath]
        except KeyError:
            return
        text = comment_above(list(lines), attr.lineno)
        if text:
            attr.docstring = griffe.Docstring(text, lineno=attr.lineno, parent=attr)
