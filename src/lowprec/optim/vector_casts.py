"""Bit casts in Inductor's vectorized C++ loops, while lowprec's kernels compile.

Inductor's C++ backend has no vector form of ``to_dtype_bitcast`` (``Tensor.view(dtype)``): in a
vectorized loop it casts element by element through a stack array, which stalls on store
forwarding (the pairs step has 20-40 casts an iteration). ``vector_casts()`` makes it write
``at::vec::cast`` for same-size integer/float casts: the C++ changes, never the results. It is
entered around every compiled kernel call (a call may recompile) and restores Inductor after, so
users' ``torch.compile`` is untouched. Measurements: docs/architecture.md, "Bit casts".
"""

from __future__ import annotations

import contextlib
from typing import Any, cast

import torch

#: The C++ element types of the dtypes whose bit casts become vector casts.
_WORDS = {torch.float32: "float", torch.int32: "int32_t",
          torch.float64: "double", torch.int64: "int64_t"}


def _target() -> tuple[Any, Any, Any] | None:
    """Inductor's vector overrides class, its own ``to_dtype_bitcast`` and the ``V`` handle of
    the kernel being written, or None where this torch lacks any of them."""
    try:
        from torch._inductor.codegen.cpp import CppVecKernel, CppVecOverrides
        from torch._inductor.virtualized import V
    except Exception:  # (no Inductor C++ backend in this torch)
        return None
    own = CppVecOverrides.__dict__.get("to_dtype_bitcast")
    if not isinstance(own, staticmethod) or not hasattr(CppVecKernel, "_get_num_vectors"):
        return None
    return CppVecOverrides, own, V


_TARGET = _target()


def _vector_bitcast(x: Any, dtype: torch.dtype, src_dtype: torch.dtype) -> Any:
    """``to_dtype_bitcast`` for a vector ``x``: ``at::vec::cast`` for 4- and 8-byte words of
    the same size, vector by vector where the loop holds several; Inductor's own code
    otherwise."""
    _, own, v = cast("tuple[Any, Any, Any]", _TARGET)  # (installed only where it is set)
    kernel = v.kernel
    dst = _WORDS.get(dtype)
    n = kernel._get_num_vectors(dtype)
    if (dst is None or src_dtype not in _WORDS or dtype.itemsize != src_dtype.itemsize
            or getattr(x, "dtype", None) != src_dtype or n != kernel._get_num_vectors(src_dtype)):
        return own.__func__(x, dtype, src_dtype)
    if n == 1:
        return f"at::vec::cast<{dst}>({x})"
    # (a VectorizedN, e.g. 64-bit words in a loop of 16 floats: its vectors one by one)
    return (f"[&]() {{ at::vec::VectorizedN<{dst}, {n}> r; "
            f"for (int j = 0; j < {n}; j++) r[j] = at::vec::cast<{dst}>({x}[j]); return r; }}()")


class _VectorCasts:
    """The context of ``vector_casts``, re-entrant (a kernel called from another's compilation
    keeps it on until the outermost exits)."""

    depth = 0

    def __enter__(self) -> None:
        if _TARGET is not None:
            if _VectorCasts.depth == 0:
                _TARGET[0].to_dtype_bitcast = staticmethod(_vector_bitcast)
            _VectorCasts.depth += 1

    def __exit__(self, *exc: object) -> None:
        if _TARGET is not None:
            _VectorCasts.depth -= 1
            if _VectorCasts.depth == 0:
                _TARGET[0].to_dtype_bitcast = _TARGET[1]


_CONTEXT = _VectorCasts()


def vector_casts() -> contextlib.AbstractContextManager[None]:
    """A context in which Inductor's C++ backend writes same-size bit casts between integers and
    floats as vector casts (the module's docstring says why)."""
    return _CONTEXT


def available() -> bool:
    """Whether this torch's Inductor has what ``vector_casts`` changes."""
    return _TARGET is not None

