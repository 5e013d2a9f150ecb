"""Bit casts in Inductor's vectorized C++ loops, while lowprec's kernels compile.

``Tensor.view(dtype)`` between dtypes of one size (an ``int32`` word read as ``float32``, and
back) is Inductor's ``to_dtype_bitcast``. Its C++ backend has no vector form of it: inside a
vectorized loop it stores the vector to an array on the stack, casts element by element with
``c10::bit_cast``, and loads the result back (``CppVecOverrides._scalarize``). That is the same
on every vector ISA. The step on pairs of BF16 elements (``update._param_update_pairs``) needs
20 to 40 such casts per loop iteration (unpacking words into two FP32 values, rounding on the
FP32 bits, packing them back). gcc removes the stack round trips in a small kernel, but not in
these: the loop body of BF16 AdamW with ``master="none"`` compiled to 3128 instructions, 761 of
them loads and stores on the stack (AVX-512; 890 under AVX2), and to 896 instructions with 13
stack accesses once the casts are vector casts. A vector load of what several narrower stores
have just written cannot be forwarded from the store buffer, so on CPUs where that stall is
long each cast waits for its stores to reach the cache (issue 29 measured a kernel of such casts
1.8x slower under AVX-512 than under AVX2 on a Sapphire Rapids machine).

``vector_casts()`` is a context in which Inductor writes a cast between 32-bit (or 64-bit)
integers and floats as ``at::vec::cast``, ATen's reinterpretation of a vector's bits (one
register move, or none), for each of the vectors the loop holds. Other casts keep Inductor's own
code. It changes how the C++ is written, never what it computes: the fused steps still equal
the eager ones bit for bit (``tests/test_fused.py``), and ``tests/test_vector_casts.py`` checks
the generated code. Where this version of torch has no such class or method, the context
changes nothing. It is entered around every call of a compiled kernel (``compiled._Kernel``),
since a later call can recompile, and leaves Inductor as it was afterwards, so the user's own
``torch.compile`` calls are not touched.
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

