"""DFP arithmetic, emulating INT16/INT32 hardware exactly.

Products: ``multiply`` (DFP-16 x DFP-16 -> DFP-32, exponents add). Sums: ``add`` (DFP-16 + DFP-16
-> DFP-32 at the larger exponent, the other operand aligned by a right shift) and ``add_fp32``
(DFP-32 + DFP-32 -> FP32). Contractions: ``matmul``, INT16 x INT16 products summed in INT32 over
chunks short enough that the accumulator cannot overflow, the chunk sums then summed in FP32.

**Overflow management.** An INT16 product reaches ``(-2**15)**2 = 2**30``, so two such products
already sum to ``2**31``, one past INT32's largest value: with arbitrary INT16 operands no INT32
accumulation of two or more terms is safe. ``matmul`` therefore sizes its chunks from the operands'
actual largest magnitudes ``A = max |a|``, ``B = max |b|`` (which the shared-exponent format keeps
near ``2**14..2**15``): every product lies in ``[-A*B, A*B]``, so every partial sum of ``n`` of them
lies in ``[-n*A*B, n*A*B]``, inside ``[-2**31, 2**31 - 1]`` whenever ``n * A * B <= 2**31 - 1``.
``safe_chunk(A, B) = (2**31 - 1) // (A * B)`` is the longest such ``n``: 2 for two DFP-16 tensors
from ``quantize`` at their worst (``A = B = 32767``), up to 7 when both maxima sit at ``2**14``,
and 1 only when a hand-made tensor holds -32768 on both sides. A caller may fix the chunk length
instead; then an accumulator that leaves the INT32 range wraps modulo ``2**32``, as the
non-saturating VNNI instruction (``vpdpwssd``) does, and the emulation reproduces that too.

**Exact emulation.** Chunk sums are computed by a float64 batched matmul of the integer mantissas:
every product (below ``2**30`` in magnitude) and every partial sum (below ``n * 2**30 <= 2**53``
for the allowed chunk lengths) is an integer that FP64 holds exactly, so any summation order,
blocking or FMA gives the exact integer sum, which is the INT32 accumulator's value (wrapped modulo
``2**32`` where it overflows). FP64 rather than int64 because integer matmul is not available on
every device (CUDA has none). The FP32 part follows one documented order: for output element
``(m, n)`` with chunk sums ``S_0 .. S_{C-1}``::

    acc = fp32(S_0); acc = fp32(acc + fp32(S_1)); ...; acc = fp32(acc + fp32(S_{C-1}))
    result = fp32(acc * 2**(E_a + E_b))

where ``fp32()`` rounds to nearest, ties to even (what ``vcvtdq2ps`` and ``vaddps`` do), and the
last step is one rounding (``vscalefps``), exact unless the result leaves FP32's normal range.
Summing unscaled chunk sums then scaling once equals scaling each chunk sum first, whenever no
intermediate is subnormal; the accumulator itself cannot overflow FP32 (``|acc| <= K * 2**30``).
"""

from __future__ import annotations

import torch

from lowprec.dfp.tensor import (
    DFPTensor,
    Rounding,
    _check_rounding,
    _times_pow2,
    shift_right,
)

__all__ = ["INT32_MAX", "add", "add_fp32", "matmul", "multiply", "safe_chunk"]

#: The largest INT32 value, ``2**31 - 1``: the bound every partial sum of ``matmul`` keeps.
INT32_MAX = (1 << 31) - 1
# Fixed chunks must keep exact FP64 chunk sums: chunk * 2**30 <= 2**53.
_MAX_CHUNK = 1 << 23
# Chunk sums computed per batched matmul call: 2 MiB of FP64 scratch stays in cache (a 256 x 1024
# x 256 product ran 4.5x faster on one CPU thread than with 32 MiB blocks).
_BLOCK_ELEMENTS = 1 << 18


def _require(t: object, bits: int, fn: str, name: str) -> DFPTensor:
    if not isinstance(t, DFPTensor):
        raise TypeError(f"{fn}(): {name} must be a DFPTensor, got {type(t).__name__}.")
    if t.bits != bits:
        hint = (
            " Convert it with lowprec.dfp.down_convert()."
            if bits == 16
            else " Widen it with DFPTensor(t.mantissa.int(), t.exponent)."
        )
        raise ValueError(f"{fn}(): {name} must be DFP-{bits}, got DFP-{t.bits}.{hint}")
    return t


def multiply(a: DFPTensor, b: DFPTensor) -> DFPTensor:
    """Elementwise product of two DFP-16 tensors, as DFP-32: ``i_a * i_b`` at ``E_a + E_b``.

    Exact: ``|i_a * i_b| <= 2**30`` fits INT32. Shapes broadcast.

    Args:
        a: A DFP-16 tensor.
        b: A DFP-16 tensor.

    Returns:
        The DFP-32 product.

    Examples:
        >>> import torch
        >>> from lowprec.dfp import multiply, quantize
        >>> a = quantize(torch.tensor([0.5, -1.5]))
        >>> p = multiply(a, a)
        >>> p.bits, p.dequantize().tolist()
        (32, [0.25, 2.25])
    """
    a = _require(a, 16, "multiply", "a")
    b = _require(b, 16, "multiply", "b")
    product = a.mantissa.to(torch.int32) * b.mantissa.to(torch.int32)
    return DFPTensor(product, a.exponent + b.exponent)


def add(
    a: DFPTensor,
    b: DFPTensor,
    *,
    rounding: Rounding = "floor",
    generator: torch.Generator | None = None,
) -> DFPTensor:
    """Elementwise sum of two DFP-16 tensors, as DFP-32 at the larger exponent.

    The operand with the smaller exponent is shifted right by the difference (rounded with
    ``rounding``) and added: ``i_a + (i_b >> (E_a - E_b))`` when ``E_a > E_b``. The sum is at most
    ``2**16`` in magnitude, so it is exact in INT32. Shapes broadcast.

    Args:
        a: DFP-16 tensor.
        b: DFP-16 tensor.
        rounding: How the aligned operand is rounded (default: ``"floor"``, the bare arithmetic
            shift of the DFP-16 addition rule); any of ``ROUNDING_MODES``.
        generator: Random source for ``"stochastic"`` (default: PyTorch's default generator).

    Returns:
        A DFP-32 tensor with exponent ``max(E_a, E_b)``.
    """
    a = _require(a, 16, "add", "a")
    b = _require(b, 16, "add", "b")
    _check_rounding(rounding, "add")
    exponent = max(a.exponent, b.exponent)
    ia, ib = a.mantissa, b.mantissa
    if a.exponent < exponent:
        ia = shift_right(ia, exponent - a.exponent, rounding=rounding, generator=generator)
    if b.exponent < exponent:
        ib = shift_right(ib, exponent - b.exponent, rounding=rounding, generator=generator)
    return DFPTensor((ia.to(torch.int32) + ib.to(torch.int32)), exponent)


def add_fp32(a: DFPTensor, b: DFPTensor) -> torch.Tensor:
    """Elementwise sum of two DFP-32 tensors (DFP-16 also accepted), in FP32.

    Each operand is converted to FP32 (one rounding, to nearest even) and the two are added in FP32
    (a second rounding): the conversion-then-add a processor does. Shapes broadcast.

    Args:
        a: A DFP tensor.
        b: A DFP tensor.

    Returns:
        The FP32 sum.
    """
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, DFPTensor):
            raise TypeError(f"add_fp32(): {name} must be a DFPTensor, got {type(t).__name__}.")
    return a.dequantize() + b.dequantize()


def _max_abs(i: torch.Tensor) -> int:
    """``max |i|`` as a Python int (not ``i.abs()``: int16 ``abs(-32768)`` wraps to -32768)."""
    lo, hi = torch.aminmax(i)
    return int(torch.maximum(-lo.to(torch.int64), hi.to(torch.int64)).item())  # one host read


def safe_chunk(max_abs_a: int, max_abs_b: int) -> int:
    """The longest run of products ``a_k * b_k`` with ``|a_k| <= max_abs_a``, ``|b_k| <=
    max_abs_b`` whose every partial sum fits INT32: ``(2**31 - 1) // (max_abs_a * max_abs_b)``.

    Returns ``INT32_MAX`` when either bound is 0 (the products are all zero). See the module
    docstring for the proof.

    Args:
        max_abs_a: The largest ``|a_k|``, an int >= 0.
        max_abs_b: The largest ``|b_k|``, an int >= 0.

    Raises:
        ValueError: A negative bound.
    """
    if max_abs_a < 0 or max_abs_b < 0:
        raise ValueError(f"safe_chunk(): bounds must be >= 0, got {max_abs_a}, {max_abs_b}.")
    bound = max_abs_a * max_abs_b
    return INT32_MAX if bound == 0 else max(1, INT32_MAX // bound)


def matmul(a: DFPTensor, b: DFPTensor, *, chunk: int | None = None) -> torch.Tensor:
    """``a @ b`` for DFP-16 matrices, with INT32 chunk accumulation and FP32 accumulation of chunks.

    Args:
        a: DFP-16 tensor of shape ``(M, K)``.
        b: DFP-16 tensor of shape ``(K, N)``, on ``a``'s device.
        chunk: Products summed per INT32 accumulator (default: None, the longest chunk that
            cannot overflow for these operands, ``safe_chunk(max |a|, max |b|)``). A fixed length
            may overflow; the accumulator then wraps modulo ``2**32`` as INT32 hardware does.

    Returns:
        The FP32 ``(M, N)`` result, bit for bit what a kernel with that chunk length and the
        accumulation order in the module docstring produces.

    Raises:
        TypeError: an operand is not a DFPTensor.
        ValueError: an operand is not DFP-16 or 2-D, the shapes do not match, or ``chunk`` is
            not a positive int.
    """
    a = _require(a, 16, "matmul", "a")
    b = _require(b, 16, "matmul", "b")
    if a.mantissa.dim() != 2 or b.mantissa.dim() != 2:
        raise ValueError(
            f"matmul(): operands must be 2-D, got shapes {tuple(a.shape)} and {tuple(b.shape)}; "
            "flatten leading dimensions first."
        )
    (m, k), (k2, n) = a.shape, b.shape
    if k != k2:
        raise ValueError(f"matmul(): shapes {tuple(a.shape)} and {tuple(b.shape)} do not match.")
    if a.device != b.device:
        raise ValueError(f"matmul(): operands are on {a.device} and {b.device}; move one.")
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"matmul(): chunk must be a positive int or None, got {chunk!r}.")
    if chunk is not None and chunk > _MAX_CHUNK:
        raise ValueError(f"matmul(): chunk must be at most {_MAX_CHUNK}, got {chunk}.")

    acc = torch.zeros(m, n, dtype=torch.float32, device=a.device)
    if m == 0 or n == 0 or k == 0:
        return acc
    longest = safe_chunk(_max_abs(a.mantissa), _max_abs(b.mantissa))
    size = min(chunk or longest, k)
    wraps = size > longest  # only a fixed chunk can overflow INT32

    count = -(-k // size)  # ceil(k / size) chunks; the last is padded with zero products
    pad = count * size - k
    A = a.mantissa.to(torch.float64)  # exact: |i| <= 2**15
    B = b.mantissa.to(torch.float64)
    if pad:
        A = torch.nn.functional.pad(A, (0, pad))
        B = torch.nn.functional.pad(B, (0, 0, 0, pad))
    A = A.reshape(m, count, size).transpose(0, 1)  # (count, m, size): chunk c's columns of a
    B = B.reshape(count, size, n)  # (count, size, n): chunk c's rows of b

    block = max(1, _BLOCK_ELEMENTS // (m * n))
    for start in range(0, count, block):
        sums = torch.bmm(A[start : start + block], B[start : start + block])  # exact integers
        if wraps:
            s = sums.to(torch.int64)
            # Two's complement wrap into [-2**31, 2**31): offset to [0, 2**32), keep the low 32
            # bits, offset back. The INT32 accumulator's final value is the exact sum modulo 2**32
            # whatever the order of its adds, so wrapping the exact sum reproduces it.
            sums = (((s + (1 << 31)) & 0xFFFFFFFF) - (1 << 31)).to(torch.float64)
        sums32 = sums.to(torch.float32)  # INT32 -> FP32, to nearest even (exact below 2**24)
        for s32 in sums32:  # the documented sequential FP32 order, one chunk at a time
            acc = acc + s32
    # One rounding: acc * 2**(E_a + E_b) is exact in FP64 (power-of-two scale), then to FP32.
    return _times_pow2(acc.to(torch.float64), a.exponent + b.exponent).to(torch.float32)
