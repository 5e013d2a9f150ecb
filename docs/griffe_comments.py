"""griffe extensions: an attribute's ``#:`` comment is its docstring; the optimizers' shared
arguments read their one text.

lowprec documents its module constants the way Sphinx reads them, with ``#:`` comment lines just
above the assignment (``#: Values accepted by the optimizers' master= argument.``). griffe reads
docstrings only, so without this the API reference would list ``MASTER_CHOICES`` and the other
constants bare. The optimizers' docstrings name the arguments they share as ``{master}``,
``{capturable}``, ...: ``lowprec.optim.options.fill_docs`` puts the text in (as the classes do
for ``help()``). mkdocs.yml loads this file for mkdocstrings, and tests/test_docs.py loads it to
check that every public name has a description.
"""

from __future__ import annotations

import importlib.util
import pathlib
from typing import Any

import griffe

_OPTIONS = pathlib.Path(__file__).parents[1] / "src" / "lowprec" / "optim" / "options.py"


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


class SharedArgDocs(griffe.Extension):
    """Put ``options.ARG_DOCS`` into the docstrings of classes that name its arguments."""

    def __init__(self) -> None:
        super().__init__()
        spec = importlib.util.spec_from_file_location("_lowprec_options", _OPTIONS)
        assert spec is not None and spec.loader is not None
        self.options = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(self.options)

    def on_class_instance(self, *, cls: griffe.Class, **kwargs: Any) -> None:
        if cls.docstring is not None:
            cls.docstring.value = self.options.fill_docs(cls.docstring.value)
