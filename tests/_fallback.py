"""Test helper: a compiled (fused) step that quietly became eager, made an error.

A step whose compilation fails steps eagerly, with the same bits and a warning, so a test of
"fused equals eager" passes with no compiled kernel run (CUDA without Triton, an Inductor option
this torch lacks, a recompile limit). ``fallbacks_are_errors()`` makes each way a compiled step can
become eager raise instead:

* the fallback warnings (``FALLBACK_WARNING``: ``compiled._disable_fused``, the 1-bit hook's
  ``stages.run``, and ``compiled._fused_enabled``'s "no compiler" warning for ``fused=None``)
  raise as ``RuntimeWarning`` exceptions;
* the "no compiler" warning, which lowprec gives once per process, is given again inside.

tests/conftest.py applies it to every test marked ``fused`` (not ``fallback``); the multi-process
workers apply it to their fused runs (tests/_shard_workers.py).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

#: The start of every warning lowprec gives where a compiled step does not run, as a regular
#: expression matched at the start of the message (a warnings filter's way; tests/test_fused.py
#: checks it against the messages themselves).
FALLBACK_WARNING = (
    r"lowprec: (the fused \(torch\.compile\)|no C\+\+ compiler|Triton is not installed"
    r"|no fused step)"
)


@contextlib.contextmanager
def fallbacks_are_errors() -> Iterator[None]:
    """Inside, a compiled step that falls back to eager raises (see the module's docstring)."""
    from lowprec.optim import compiled

    saved = compiled._WARNED
    compiled._WARNED = set()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("error", FALLBACK_WARNING, RuntimeWarning)
            yield
    finally:
        compiled._WARNED = saved
