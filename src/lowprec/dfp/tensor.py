"""DFP tensors: integer mantissas that share one exponent, and the conversions into them.

A DFP-P tensor is ``<I, E_s>``: an integer tensor ``I`` of width P (int16 for DFP-16, int32 for
DFP-32) and one Python int ``E_s``; element ``n`` stands for ``I[n] * 2**E_s``.

**Where the shared exponent goes.** ``quantize`` sets ``E_s = E_fmax - (P - 2)``, where ``E_fmax``
is the exponent of the largest magnitude ``f`` (``2**E_fmax <= |f| < 2**(E_fmax + 1)``). The largest
value then scales to ``[2**(P-2), 2**(P-1))``: its top bit sits just below the sign bit. Rounding
can carry it up to ``2**(P-1)``, one past the largest positive integer; such values saturate.

**Saturation is symmetric**, to ``[-(2**(P-1) - 1), 2**(P-1) - 1]`` (±32767 for DFP-16): the most
negative integer (-32768) is never produced. With ``"nearest"``, quantizing ``-x`` then gives
exactly ``-quantize(x)``, and every product of two produced DFP-16 values stays below ``2**30``, so
two of them always fit an INT32 accumulator (see ``ops.matmul``).
A ``DFPTensor`` built by hand may still hold -32768; every operation handles it.

**Rounding.** Every conversion to fewer bits is a right shift by ``r`` bits with one of four rules
(``ROUNDING_MODES``), applied to the exact value ``v = i / 2**r``:

- ``"nearest"``: the nearest integer, ties to the even one (IEEE roundTiesToEven, the DSP
  literature's "convergent" or "unbiased" rounding). Error at most half a unit; no bias at ties.
- ``"biased"``: the nearest integer, ties up toward +inf: ``floor(v + 1/2)``, what adding half a
  unit and truncating gives in two's complement (the DSP literature's "biased" or "two's-complement"
  rounding). Error at most half a unit; every tie moves up by half a unit, so over residues
  uniformly distributed on ``r`` dropped bits the mean error is ``+2**-(r+1)`` units.
- ``"stochastic"``: ``floor(v)`` or ``floor(v) + 1``, the latter with probability
  ``v - floor(v)``; unbiased (the mean over draws is ``v``), error below one unit.
- ``"floor"``: ``floor(v)``, the bare arithmetic shift ``i >> r`` of the paper's formulas. Error in
  ``[0, 1)`` unit below ``v``; mean error ``-(1 - 2**-r) / 2`` units over uniform residues.

**All-zero and empty tensors** get the exponent ``ZERO_EXPONENT``, far below any exponent a finite
nonzero FP32 tensor can have (``>= -179``), so that in ``add`` the other operand's exponent always
wins and nothing of it is shifted away. No logarithm of zero is taken. **inf and NaN** have no DFP
encoding and raise ``ValueError``.

The exponent is not limited to the paper's 8 bits: FP32's whole range, subnormals included, maps
to DFP-16 exponents in ``[-163, 113]``.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Literal, SupportsIndex, cast

import torch

from lowprec.numerics import _generator_kwargs

__all__ = [
    "ROUNDING_MODES",
    "ZERO_EXPONENT",
    "DFPTensor",
    "Rounding",
    "down_convert",
    "quantize",
    "shared_exponent",
    "shift_right",
]

#: The rounding modes of every conversion to fewer bits, as a type (see the module docstring).
Rounding = Literal["nearest", "stochastic", "biased", "floor"]
#: The rounding modes, as a tuple of names (see the module docstring).
ROUNDING_MODES: tuple[str, ...] = ("nearest", "stochastic", "biased", "floor")

#: The exponent of an all-zero or empty DFP tensor (see the module docstring).
ZERO_EXPONENT = -(1 << 16)

_MANTISSA_DTYPES = {16: torch.int16, 32: torch.int32}
_BITS_OF = {torch.int16: 16, torch.int32: 32}
_FLOAT_INPUTS = (torch.float32, torch.float16, torch.bfloat16)
# Longest right shift done literally: 1 << 62 and twice a 62-bit remainder still fit in int64.
_MAX_SHIFT = 62
# Longest left shift needed: any nonzero FP32 significand (< 2**24) shifted by 32 exceeds 2**31,
# the largest DFP-32 magnitude, so a longer shift saturates exactly as this one does.
_MAX_LEFT_SHIFT = 32


def _check_bits(bits: int, fn: str) -> None:
    if isinstance(bits, bool) or bits not in _MANTISSA_DTYPES:
        raise ValueError(
            f"{fn}(): bits must be 16 (DFP-16, int16) or 32 (DFP-32, int32), got {bits!r}."
        )


def _check_rounding(rounding: str, fn: str) -> None:
    if rounding not in ROUNDING_MODES:
        raise ValueError(
            f"{fn}(): unknown rounding {rounding!r}; use one of {', '.join(map(repr, ROUNDING_MODES))}."
        )


def _as_exponent(value: object, fn: str) -> int:
    """Validate a shared exponent: an int (or anything with ``__index__``) in the int32 range."""
    if isinstance(value, bool):
        raise TypeError(f"{fn}: the exponent must be an int, got a bool.")
    try:
        exponent = operator.index(cast(SupportsIndex, value))  # (TypeError if not: below)
    except TypeError:
        raise TypeError(f"{fn}: the exponent must be an int, got {type(value).__name__}.") from None
    if not -(1 << 31) <= exponent < (1 << 31):
        raise ValueError(f"{fn}: the exponent {exponent} is outside the signed 32-bit range.")
    return exponent


def _limit(bits: int) -> int:
    """Largest magnitude a DFP-``bits`` mantissa gets from a conversion (symmetric saturation)."""
    return (1 << (bits - 1)) - 1


def _times_pow2(t: torch.Tensor, exponent: int) -> torch.Tensor:
    """``t * 2**exponent`` for a float64 tensor of integers below ``2**63``, rounded once.

    Two power-of-two factors, so that each is an FP64 number: ``t * 2**e1`` with ``|e1| <= 960``
    is exact (it stays inside FP64's normal range), and the second product is the single
    correctly rounded step (to a subnormal, 0 or inf where the exact value lies there). A second
    factor clamped to ``2**1023`` keeps ``0 * 2**exponent`` at 0 instead of ``0 * inf = nan``; one
    below ``2**-1074`` is 0, and every product it stands for is below FP64's smallest subnormal.
    """
    e1 = max(min(exponent, 960), -960)
    e2 = max(min(exponent - e1, 1023), -1100)
    return t * math.ldexp(1.0, e1) * math.ldexp(1.0, e2)


@dataclass(frozen=True, eq=False)
class DFPTensor:
    """A dynamic fixed point tensor: integer mantissas with one shared exponent.

    Element ``n`` stands for ``mantissa[n] * 2**exponent``, exactly.

    Attributes:
        mantissa: int16 (DFP-16) or int32 (DFP-32) tensor, any shape and device.
        exponent: The shared exponent, a Python int in the signed 32-bit range.
    """

    mantissa: torch.Tensor
    exponent: int

    def __post_init__(self) -> None:
        if not isinstance(self.mantissa, torch.Tensor) or self.mantissa.dtype not in _BITS_OF:
            got = (
                self.mantissa.dtype
                if isinstance(self.mantissa, torch.Tensor)
                else type(self.mantissa)
            )
            raise TypeError(
                f"DFPTensor mantissa must be an int16 (DFP-16) or int32 (DFP-32) tensor, got {got}; "
                "make one from floats with lowprec.dfp.quantize()."
            )
        object.__setattr__(self, "exponent", _as_exponent(self.exponent, "DFPTensor"))

    @property
    def bits(self) -> int:
        """Mantissa width: 16 or 32."""
        return _BITS_OF[self.mantissa.dtype]

    @property
    def shape(self) -> torch.Size:
        return self.mantissa.shape

    @property
    def device(self) -> torch.device:
        return self.mantissa.device

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The values ``mantissa * 2**exponent`` as floats.

        Args:
            dtype: ``torch.float32`` or ``torch.float64`` (default: float32). The exact value is
                rounded once to ``dtype`` (to nearest, ties to even); a DFP-16 value is exact in
                FP32 unless it falls outside FP32's normal range, and every value that fits FP64 is
                exact there.

        Returns:
            A tensor of ``dtype`` and the mantissa's shape and device.
        """
        if dtype not in (torch.float32, torch.float64):
            raise ValueError(f"dequantize(): dtype must be float32 or float64, got {dtype}.")
        # The mantissa (|i| <= 2**31) is exact in FP64 and scaling by a power of two is exact
        # wherever FP64 holds the result, so for FP32 .to(dtype) is the only rounding that
        # matters (FP64 rounds only far below FP32's smallest subnormal).
        return _times_pow2(self.mantissa.to(torch.float64), self.exponent).to(dtype)

    def __repr__(self) -> str:
        return f"DFPTensor(bits={self.bits}, exponent={self.exponent}, mantissa={self.mantissa!r})"


# ---------------------------------------------------------------------------------------------
# Rounding right shift: the one place every conversion rounds
# ---------------------------------------------------------------------------------------------


def shift_right(
    values: torch.Tensor,
    shift: int | torch.Tensor,
    *,
    rounding: Rounding = "nearest",
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Divide integers by ``2**shift`` and round to an integer.

    Args:
        values: An integer tensor with magnitudes below ``2**61``.
        shift: Non-negative shift, a Python int or an integer tensor broadcastable to ``values``.
        rounding: One of ``ROUNDING_MODES`` (default: ``"nearest"``); see the module docstring.
        generator: Random source for ``"stochastic"`` (default: PyTorch's default generator for
            ``values``' device); ignored otherwise.

    Returns:
        An int64 tensor. Shifts above 62 are done as 62. For the deterministic modes that changes
        nothing (with ``|i| < 2**61`` the result is 0, or -1 by ``"floor"`` for negative ``i``,
        either way); for ``"stochastic"`` the probability of a nonzero result becomes
        ``|i| * 2**-62`` instead of ``|i| * 2**-shift``, both below one half.
    """
    _check_rounding(rounding, "shift_right")
    i = values.to(torch.int64)
    if isinstance(shift, torch.Tensor):
        r = shift.to(device=i.device, dtype=torch.int64).clamp(0, _MAX_SHIFT)
    else:
        if shift < 0:
            raise ValueError(f"shift_right(): shift must be >= 0, got {shift}.")
        r = min(int(shift), _MAX_SHIFT)
    q = i >> r  # arithmetic shift: floor(i / 2**r), also for negative i
    if rounding == "floor":
        return q
    rem = i - (q << r)  # the dropped low bits as a value in [0, 2**r): i == q * 2**r + rem
    if rounding == "stochastic":
        u = torch.randint(
            0, 1 << _MAX_SHIFT, i.shape, dtype=torch.int64, device=i.device,
            **_generator_kwargs(generator),
        )
        # The top r of u's 62 uniform bits form a uniform integer t in [0, 2**r); t < rem has
        # probability exactly rem / 2**r, the fraction of the way from q to q + 1 (t is 0 for r = 0,
        # where rem is 0 too, so nothing rounds up).
        up = (u >> (_MAX_SHIFT - r)) < rem
        return q + up.to(torch.int64)
    twice = rem << 1  # 2 * rem < 2**63: compare rem with half a unit without dividing
    one = (torch.ones_like(i) if isinstance(r, torch.Tensor) else 1) << r  # a unit: 2**r
    if rounding == "biased":
        # rem >= half a unit: ties go up (toward +inf); never for r = 0, where 0 >= 1 is false.
        return q + (twice >= one).to(torch.int64)
    # nearest: up past half a unit, and at a tie only from an odd q (so the result is even).
    up = (twice > one) | ((twice == one) & ((q & 1) == 1))
    return q + up.to(torch.int64)


# ---------------------------------------------------------------------------------------------
# FP32 -> DFP
# ---------------------------------------------------------------------------------------------


def shared_exponent(max_abs: float, bits: int = 16) -> int:
    """The shared exponent ``E_s = E_fmax - (bits - 2)`` for a tensor whose largest magnitude is
    ``max_abs`` (``ZERO_EXPONENT`` for 0).

    ``E_fmax`` is the exponent of ``max_abs`` as a binary float, ``2**E_fmax <= max_abs <
    2**(E_fmax + 1)``, taken exactly with ``math.frexp`` (subnormals included).

    Args:
        max_abs: The tensor's largest magnitude, finite and >= 0.
        bits: Mantissa width: 16 or 32 (default: 16).

    Raises:
        ValueError: ``max_abs`` is negative or not finite, or ``bits`` is not 16 or 32.

    Examples:
        >>> from lowprec.dfp import shared_exponent
        >>> shared_exponent(1.5)  # 1.5 = 2**0 * 1.5: E_s = 0 - 14
        -14
    """
    _check_bits(bits, "shared_exponent")
    if not math.isfinite(max_abs) or max_abs < 0:
        raise ValueError(f"shared_exponent(): max_abs must be finite and >= 0, got {max_abs}.")
    if max_abs == 0:
        return ZERO_EXPONENT
    _, e = math.frexp(max_abs)  # max_abs = m * 2**e with m in [0.5, 1), so E_fmax = e - 1
    return (e - 1) - (bits - 2)


def _nonfinite_error(fn: str, x: torch.Tensor) -> ValueError:
    bad = (~torch.isfinite(x)).sum().item()
    return ValueError(
        f"{fn}(): the tensor holds {bad} inf/NaN value(s) of {x.numel()}; DFP has no encoding for "
        "them. Find the step that produced them (for gradients: lower the learning rate, or scale "
        "the loss and skip overflowing steps), or replace them first, e.g. with torch.nan_to_num()."
    )


def quantize(
    x: torch.Tensor,
    *,
    bits: int = 16,
    rounding: Rounding = "nearest",
    generator: torch.Generator | None = None,
    exponent: int | None = None,
) -> DFPTensor:
    """Convert floats to a DFP tensor with one shared exponent.

    Each element becomes ``round(x / 2**E_s)`` with the chosen rounding, computed exactly on the
    integer significand of ``x`` (no intermediate float rounding), then saturated to
    ``±(2**(bits-1) - 1)``. With the default exponent only the largest magnitude can saturate, and
    only when rounding carries it up to ``2**(bits-1)``.

    Args:
        x: A float32, float16 or bfloat16 tensor (the narrow formats convert to FP32 exactly).
        bits: Mantissa width: 16 (int16) or 32 (int32) (default: 16).
        rounding: One of ``ROUNDING_MODES`` (default: ``"nearest"``); see the module docstring.
        generator: Random source for ``"stochastic"`` (default: PyTorch's default generator for
            ``x``'s device); ignored otherwise.
        exponent: Use this shared exponent instead of ``E_fmax - (bits - 2)`` (default: None);
            values too large for it saturate.

    Returns:
        A ``DFPTensor``; all-zero and empty tensors get ``ZERO_EXPONENT``.

    Raises:
        TypeError: ``x`` is not a float32/float16/bfloat16 tensor.
        ValueError: ``x`` holds inf or NaN, or an argument is out of range.

    Reading the largest magnitude (which also detects inf/NaN) waits for the device once.
    """
    _check_bits(bits, "quantize")
    _check_rounding(rounding, "quantize")
    if not isinstance(x, torch.Tensor) or x.dtype not in _FLOAT_INPUTS:
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(
            f"quantize() takes a float32, float16 or bfloat16 tensor, got {got}; convert with "
            "x.float() (float64 values are then rounded to FP32 once)."
        )
    x32 = x.detach().to(torch.float32).contiguous()
    if exponent is None:
        max_abs = x32.abs().amax().item() if x32.numel() else 0.0  # NaN or inf if any element is
        if not math.isfinite(max_abs):
            raise _nonfinite_error("quantize", x32)
        exponent = shared_exponent(max_abs, bits)
    else:
        exponent = _as_exponent(exponent, "quantize()")
        if x32.numel() and not bool(torch.isfinite(x32).all()):
            raise _nonfinite_error("quantize", x32)

    # Exact integer decomposition |x| = sig * 2**e2 of every FP32 value, from its bit pattern.
    b = x32.view(torch.int32).to(torch.int64)
    field = (b >> 23) & 0xFF  # biased exponent field (b >> 23 keeps the sign; & 0xFF drops it)
    frac = b & 0x7FFFFF  # the 23 stored fraction bits
    normal = field > 0
    sig = torch.where(normal, frac | 0x800000, frac)  # normals have an implicit leading 1 (bit 23)
    # value = sig * 2**(field - 127 - 23) for normals; subnormals use field 1 without the implicit 1.
    e2 = torch.where(normal, field, torch.ones_like(field)) - 150
    m = torch.where(b < 0, -sig, sig)  # signed significand; the sign bit is bit 31 of the pattern
    # x / 2**E_s = m * 2**(e2 - E_s): a right shift by r = E_s - e2 when r > 0, else a left shift.
    r = exponent - e2
    left = m << (-r).clamp(0, _MAX_LEFT_SHIFT)  # exact; oversized results saturate below
    right = shift_right(m, r.clamp_min(0), rounding=rounding, generator=generator)
    q = torch.where(r > 0, right, left)
    lim = _limit(bits)
    q = q.clamp(-lim, lim)
    return DFPTensor(q.to(_MANTISSA_DTYPES[bits]).reshape(x.shape), exponent)


# ---------------------------------------------------------------------------------------------
# DFP-32 -> DFP-16
# ---------------------------------------------------------------------------------------------


def down_convert(
    t: DFPTensor,
    *,
    bits: int = 16,
    rounding: Rounding = "nearest",
    generator: torch.Generator | None = None,
) -> DFPTensor:
    """Re-normalize a DFP tensor (typically DFP-32) into DFP-``bits``.

    Shifts right by ``R_s = P - LZC(max |i|)`` and adds ``R_s`` to the exponent. Here ``LZC`` counts
    the leading zeros of the INT32 magnitude *below the sign bit* (``31 - bit_length``), so the
    largest magnitude lands in ``[2**(P-2), 2**(P-1))``, the position ``quantize`` gives it: for
    ``max |i| = 2**30`` (LZC 0) DFP-16 shifts by 16. A negative ``R_s`` (small mantissas) is an exact
    left shift. The largest magnitude can round up to ``2**(P-1)`` and then saturates to
    ``2**(P-1) - 1``.

    Args:
        t: A ``DFPTensor`` (DFP-16 or DFP-32).
        bits: Target width: 16 or 32 (default: 16).
        rounding: One of ``ROUNDING_MODES`` (default: ``"nearest"``).
        generator: Random source for ``"stochastic"`` (default: PyTorch's default generator);
            ignored otherwise.

    Returns:
        A DFP-``bits`` tensor; all-zero and empty inputs give ``ZERO_EXPONENT``.

    Reading ``max |i|`` waits for the device once.
    """
    if not isinstance(t, DFPTensor):
        raise TypeError(f"down_convert() takes a DFPTensor, got {type(t).__name__}.")
    _check_bits(bits, "down_convert")
    _check_rounding(rounding, "down_convert")
    i = t.mantissa.to(torch.int64)  # int64: |-2**31| fits
    max_abs = int(i.abs().max().item()) if i.numel() else 0
    dtype = _MANTISSA_DTYPES[bits]
    if max_abs == 0:
        return DFPTensor(torch.zeros_like(i, dtype=dtype), ZERO_EXPONENT)
    lzc = 31 - max_abs.bit_length()  # leading zeros of the 31 magnitude bits below the sign bit
    r_s = bits - lzc  # = bit_length - (bits - 1): the shift that leaves bit_length == bits - 1
    # r_s <= 0: an exact left shift (the result stays below 2**(bits-1)).
    q = shift_right(i, r_s, rounding=rounding, generator=generator) if r_s > 0 else i << -r_s
    lim = _limit(bits)
    return DFPTensor(q.clamp(-lim, lim).to(dtype), t.exponent + r_s)
