"""Bits and rounding: the numerical ground floor of lowprec.

This module knows tensors and bit patterns only; it has no optimizers and no modules.

**Split representation.** An FP32 value ``x`` is stored as two 16-bit halves: ``top``, a bfloat16
that forward and backward use directly, and ``trail``, an int16. ``top`` is ``x`` rounded to the
nearest bfloat16 with **ties away from zero**, and ``trail`` is exactly the low 16 bits of ``x``
reinterpreted as a signed int16. Rounding happens when bit 15 of ``x`` (the highest bit that
bfloat16 drops) is set, and bit 15 is also the sign bit of ``trail``; so ``join`` knows whether
``top`` was rounded up from the trail's sign alone, and the pair is an exact, bijective encoding of
all 2**32 FP32 bit patterns. Ties away from zero (rather than IEEE ties-to-even) is forced: with
ties-to-even the low half of a tie could lie a full half-ulp on either side of ``top``, which needs a
17th bit. The two rules differ only for values exactly halfway between two bfloat16 numbers.

Consequences at the edges, all exact under ``join``: finite values above the largest bfloat16
(``|x| >= 0x7F7F8000`` as bits, about 3.3961e38) have ``top = ±inf``, as IEEE rounding gives; NaNs
whose payload sits only in the low 16 bits have ``top = ±inf``; and NaNs whose upper half is
``0x7FFF``/``0xFFFF`` with bit 15 set (patterns no arithmetic produces; a canonical NaN is
``0x7FC00000``) wrap to ``top = ∓0``. A counting argument shows some NaN must map to a non-NaN top
in any exact 16+16-bit encoding whose top is the rounded value.

**Stochastic rounding** rounds up with probability equal to the fraction of the gap to the next
representable value, so it is unbiased: the mean over many draws equals the input. The random bits
come either from a ``torch.Generator`` (``round_stochastic``) or from a counter-based hash of a key
and the element index (``counter_bits``), which is reproducible, identical on every rank and device,
and needs no generator state in a checkpoint.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, cast

import torch

__all__ = [
    "FormatInfo",
    "counter_bits",
    "format_info",
    "hash_bits",
    "join",
    "plus_l2",
    "round_nearest_split",
    "round_stochastic",
    "round_stochastic_with_bits",
    "split",
    "sqrt_rn",
    "stream_key",
    "stream_key_halves",
    "sum_squares",
    "sum_squares_pairs",
    "ulp",
]

_LOW_PRECISION = (torch.bfloat16, torch.float16)

#: Inductor settings under which lowprec compiles its kernels (the optimizers' fused step, the
#: 1-bit hook's quantizer) so that they round as the eager code does: Triton otherwise divides
#: approximately and flushes subnormals to zero, which eager CUDA does not (the C++ backend
#: rounds as eager either way).
COMPILED_AS_EAGER: dict[str, Any] = {
    "eager_numerics.division_rounding": True, "eager_numerics.disable_ftz": True,
}
#: Every Inductor option the optimizers' compiled step is built with (``COMPILED_AS_EAGER``, plus
#: ``emulate_precision_casts``, ``cpp.dynamic_threads`` and, for stochastic rounding,
#: ``realize_opcount_threshold``: ``optim.compiled._compiled_kernel`` says why). Inductor refuses
#: an option it does not know, so the default step compiles only where the installed torch has
#: all of them (``optim.compiled.inductor_options``; torch>=2.11).
INDUCTOR_OPTIONS = ("emulate_precision_casts", "cpp.dynamic_threads", "realize_opcount_threshold",
                    *COMPILED_AS_EAGER)


def split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Split FP32 values into a rounded bfloat16 top half and an int16 trail.

    Args:
        x: A float32 tensor.

    Returns:
        ``(top, trail)``: ``top`` (bfloat16) is ``x`` rounded to the nearest bfloat16, ties away
        from zero; ``trail`` (int16) is the low 16 bits of ``x``. ``join(top, trail)`` gives back
        ``x`` bit for bit, for every FP32 bit pattern (see the module docstring for the edges).

    Raises:
        TypeError: ``x`` is not float32.

    Examples:
        >>> import torch
        >>> from lowprec.numerics import join, split
        >>> x = torch.tensor([1.0 + 2**-20, -3.14159])
        >>> top, trail = split(x)
        >>> top.dtype, trail.dtype
        (torch.bfloat16, torch.int16)
        >>> torch.equal(join(top, trail), x)  # bit for bit
        True
    """
    if x.dtype != torch.float32:
        raise TypeError(f"split() takes a float32 tensor, got {x.dtype}; convert with x.float().")
    bits = x.contiguous().view(torch.int32)
    # int32 -> int16 keeps the low 16 bits (modulo 2**16, which only the NaN case needs).
    top = _split_top_bits(bits).to(torch.int16).view(torch.bfloat16)
    trail = bits.to(torch.int16)  # the low half: int32 -> int16 keeps the low 16 bits
    return top, trail


def _split_top_bits(bits: torch.Tensor) -> torch.Tensor:
    """``split``'s top half as an int32 whose low 16 bits are the bfloat16 pattern."""
    # Rounding up adds bit 15 (the highest bit bfloat16 drops: the dropped half is >= half a
    # bfloat16 ulp) to the upper half's bit pattern, which increases the magnitude by one ulp
    # (the sign is bit 15 of the half, untouched unless the magnitude was already all ones, i.e.
    # a NaN). The arithmetic shift keeps the sum in [-2**15, 2**15].
    return (bits >> 16) + ((bits >> 15) & 1)


def join(top: torch.Tensor, trail: torch.Tensor) -> torch.Tensor:
    """Rebuild the FP32 values from a bfloat16 top half and an int16 trail (inverse of ``split``).

    Args:
        top: A bfloat16 tensor.
        trail: An int16 tensor of the same shape.

    Returns:
        The float32 tensor ``x`` with ``split(x) == (top, trail)``.

    Raises:
        TypeError: wrong dtypes.
        ValueError: shapes differ.
    """
    if top.dtype != torch.bfloat16 or trail.dtype != torch.int16:
        raise TypeError(
            f"join() takes (bfloat16, int16) tensors, got ({top.dtype}, {trail.dtype}); "
            "the pair must come from lowprec.numerics.split()."
        )
    if top.shape != trail.shape:
        raise ValueError(f"join(): top has shape {tuple(top.shape)} but trail {tuple(trail.shape)}.")
    t = top.contiguous().view(torch.int16).to(torch.int32)  # the upper half, sign-extended
    # t * 2**16 is in [-2**31, 2**31 - 2**16]. Adding the sign-extended trail adds its low 16 bits
    # and, when its bit 15 is set (split() rounded the upper half up), subtracts 2**16: one unit
    # off the upper half. int32 wraps modulo 2**32, so the NaN wrap-around case inverts too.
    return (t * 65536 + trail.to(torch.int32)).view(torch.float32)


def sqrt_rn(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded FP32 square root, the same on every backend.

    PyTorch's eager CPU ``sqrt`` on FP32 is not always correctly rounded (it can be one ulp off),
    while compiled code is; taking the root in FP64 and rounding once is exact in both (the FP64
    root of an FP32 value rounds to the correctly rounded FP32 root), so the eager and the fused
    optimizer steps agree bit for bit. Compiled CPU and CUDA code take the FP32 root directly,
    which is correctly rounded there; the fused-vs-eager tests check that the two agree.

    Args:
        x: A float32 tensor.

    Returns:
        Its square root, float32, correctly rounded.
    """
    if torch.compiler.is_compiling() and x.device.type in ("cpu", "cuda"):
        # Compiled code takes a correctly rounded FP32 root: Inductor's CPU code the IEEE vector
        # sqrt (vsqrtps), its Triton code tl.sqrt_rn (PTX sqrt.rn.f32). The same values as below,
        # without the FP64 round trip (about 30% of a fused AdamW step on CPU; FP64 runs at 1/64
        # of FP32's rate on consumer GPUs). The eager step keeps FP64 on every device (the
        # reference); benchmarks/device_choices.py checks the FP32 roots on a GPU.
        return torch.sqrt(x)
    return x.to(torch.float64, copy=True).sqrt_().to(x.dtype)  # in place: one FP64 temporary


def plus_l2(g: torch.Tensor, w: torch.Tensor, weight_decay: float | torch.Tensor) -> torch.Tensor:
    """``g + weight_decay * w`` (an L2 penalty's gradient), and ``g`` itself, bit for bit, where
    ``weight_decay`` is the number 0: ``0 * w`` is not always +0 (-0.0 for a negative ``w``, NaN
    for an infinite one), so the sum would change ``g``'s zeros and infinities. A tensor
    ``weight_decay`` (a compiled step's coefficient) is always added: the optimizers' rules call
    this only where their group decays (their static ``l2`` flag), since a select on the
    coefficient's value made every element's update dearer.

    Args:
        g: The FP32 gradient.
        w: The FP32 weight.
        weight_decay: The penalty's coefficient: a number, or a 0-d FP32 tensor.

    Returns:
        The penalized gradient, FP32.
    """
    if isinstance(weight_decay, torch.Tensor) or weight_decay:
        return g + w * weight_decay
    return g


def round_nearest_split(x: torch.Tensor) -> torch.Tensor:
    """Round FP32 to bfloat16 with the split rule (nearest, ties away from zero).

    Args:
        x: A float32 tensor.

    Returns:
        The bfloat16 tensor that ``split(x)`` gives as its top half.
    """
    return split(x)[0]


# ---------------------------------------------------------------------------------------------
# Counter-based random bits
# ---------------------------------------------------------------------------------------------

_M32 = 0xFFFFFFFF
# Constants of the "lowbias32" integer hash (Chris Wellons' hash-prospector), a well-mixed
# 32-bit permutation: xor-shift, multiply, xor-shift, multiply, xor-shift.
_H1 = 0x7FEB352D
_H2 = 0x846CA68B
_GOLDEN = 0x9E3779B9


def _mix32_py(x: int) -> int:
    x &= _M32
    x ^= x >> 16
    x = (x * _H1) & _M32
    x ^= x >> 15
    x = (x * _H2) & _M32
    x ^= x >> 16
    return x


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``(x * c) mod 2**32`` for int64 ``x`` in [0, 2**32), without signed overflow."""
    # Split c into 16-bit halves: x*c = x*c_lo + (x*c_hi << 16); each product is < 2**48.
    c_lo, c_hi = c & 0xFFFF, c >> 16
    return (x * c_lo + (((x * c_hi) & 0xFFFF) << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """``lowbias32`` on int64 values in [0, 2**32) (the 0-d key arithmetic of ``stream_key_halves``)."""
    x = x ^ (x >> 16)
    x = _mul32(x, _H1)
    x = x ^ (x >> 15)
    x = _mul32(x, _H2)
    return x ^ (x >> 16)


def _as_int32_bits(v: int) -> int:
    """The signed int32 value with the same 32-bit pattern as ``v mod 2**32``."""
    return ((v & _M32) ^ 0x80000000) - 0x80000000


def _to_int32_bits(t: torch.Tensor) -> torch.Tensor:
    """``_as_int32_bits`` for an int64 tensor: an int32 tensor holding the low 32 bits of ``t``."""
    # (t mod 2**32) is in [0, 2**32); flipping bit 31 and subtracting 2**31 maps [0, 2**31) to
    # itself and [2**31, 2**32) to [-2**31, 0): the two's-complement reading, which fits int32.
    return (((t & _M32) ^ 0x80000000) - 0x80000000).to(torch.int32)


def _mix32_i32(x: torch.Tensor) -> torch.Tensor:
    """``lowbias32`` on int32 tensors holding 32-bit patterns; bit for bit the same as ``_mix32``.

    int32 products wrap modulo 2**32 (a single vector multiply, where the int64 form needs four
    64-bit ones), which is exactly the hash's ``(x * c) mod 2**32``. ``>>`` on int32 is an
    arithmetic shift that copies the sign bit into the top ``k`` bits; masking them off gives the
    logical shift the hash needs.
    """
    x = x ^ ((x >> 16) & 0xFFFF)  # x ^= x >>> 16
    x = x * _H1  # fits int32: 0x7FEB352D < 2**31
    x = x ^ ((x >> 15) & 0x1FFFF)  # x ^= x >>> 15
    x = x * _as_int32_bits(_H2)  # 0x846CA68B as the int32 with the same bits (negative)
    return x ^ ((x >> 16) & 0xFFFF)  # x ^= x >>> 16


def stream_key(seed: int, *counters: int) -> int:
    """Fold a seed and counters (step, parameter index, ...) into a 64-bit key for ``counter_bits``.

    Pure Python integer arithmetic, so every process computes the same key.

    Args:
        seed: The stream's seed, an int.
        *counters: Ints that select the stream (step, parameter index, ...).

    Returns:
        The key, an int below ``2**64``.
    """
    lo, hi = stream_key_halves(seed, *counters)
    return cast(int, (hi << 32) | lo)  # (int counters: int halves)


def stream_key_halves(seed: int, *counters: Any) -> tuple[Any, Any]:
    """``stream_key`` as its low and high 32 bits; counters may be ints or int64 tensors.

    With a 0-d int64 tensor counter (a step count kept on the device) the halves are 0-d int64
    tensors equal to what the integers would give, computed without reading the tensor on the
    host.

    Args:
        seed: The stream's seed, an int.
        *counters: Ints, or 0-d int64 tensors.

    Returns:
        ``(low, high)``: ints, or 0-d int64 tensors where a counter is a tensor.
    """
    return _fold_counters(*_seed_halves(seed), *counters)


def _seed_halves(seed: int) -> tuple[int, int]:
    """The key halves of ``seed`` alone, into which ``_fold_counters`` folds the counters."""
    return _mix32_py(seed & _M32), _mix32_py((seed >> 32) ^ _GOLDEN)


def _fold_counters(lo: Any, hi: Any, *counters: Any) -> tuple[Any, Any]:
    """``stream_key_halves`` from the seed's halves: ints, or int64 tensors (a compiled step's
    keys: ``optim.compiled.step_keys``)."""

    def mix(x: Any) -> Any:
        return _mix32(x & _M32) if isinstance(x, torch.Tensor) else _mix32_py(x)

    for c in counters:
        lo = mix(lo ^ mix((c & _M32) + _GOLDEN))
        hi = mix(hi + lo + (c >> 32))
    return lo, hi


def hash_bits(
    idx: torch.Tensor, key_lo: int | torch.Tensor, key_hi: int | torch.Tensor
) -> torch.Tensor:
    """The counter-based hash behind ``counter_bits``: 32 random bits per element index.

    Args:
        idx: Element indices, int32 or int64 (any value; only ``(idx + key_lo) mod 2**32``
            matters). int32 indices are the fast path; pass int64 ones where an index can
            exceed ``2**31 - 1``.
        key_lo: The low 32 bits of the key, an int or a 0-d int64 tensor (a compiled optimizer
            step passes tensors so that a new key each step does not recompile).
        key_hi: The high 32 bits of the key, likewise.

    Returns:
        An int32 tensor of ``idx``'s shape holding the 32 hash bits as a two's-complement
        pattern: ``counter_bits`` gives the same bits as values in ``[0, 2**32)``, and
        ``h & 0xFFFF`` (or any mask below bit 31) reads the same low bits from either.
    """
    lo, hi = (
        _to_int32_bits(k) if isinstance(k, torch.Tensor) else _as_int32_bits(k)
        for k in (key_lo, key_hi)
    )
    # (idx + key_lo) mod 2**32 as int32 bits: int32 addition wraps modulo 2**32; int64 indices
    # are summed in int64 and then keep their low 32 bits.
    x = idx + lo if idx.dtype == torch.int32 else _to_int32_bits(idx + key_lo)
    return _mix32_i32(_mix32_i32(x) ^ hi)


def counter_bits(
    numel: int, key: int, *, device: torch.device | str | None = None, offset: int = 0
) -> torch.Tensor:
    """32 random bits per element from a counter-based hash of ``(key, element index)``.

    Args:
        numel: How many values.
        key: A 64-bit key, typically ``stream_key(seed, step, param_index)``.
        device: Where to make them (default: CPU).
        offset: Index of the first element (default: 0), so a tensor can be processed in pieces.

    Returns:
        An int64 tensor of ``numel`` values in ``[0, 2**32)``, the same for the same arguments on
        every device, process and PyTorch build.
    """
    idx = torch.arange(offset, offset + numel, dtype=torch.int64, device=device)
    return hash_bits(idx, key & _M32, (key >> 32) & _M32).to(torch.int64) & _M32


# ---------------------------------------------------------------------------------------------
# Stochastic rounding
# ---------------------------------------------------------------------------------------------


def _generator_kwargs(generator: torch.Generator | None) -> dict[str, Any]:
    """``{"generator": generator}`` for torch's random functions, or nothing for None.

    ``torch.randint(..., generator=None)`` fails inside ``torch.compile`` (Dynamo cannot run it on
    fake tensors) where leaving the argument out draws from the default generator as eager does.
    """
    return {} if generator is None else {"generator": generator}


def _check_sr_args(x: torch.Tensor, dtype: torch.dtype) -> None:
    if x.dtype != torch.float32:
        raise TypeError(
            f"stochastic rounding takes a float32 tensor, got {x.dtype}; convert with x.float()."
        )
    if dtype not in _LOW_PRECISION:
        raise ValueError(
            f"stochastic rounding targets torch.bfloat16 or torch.float16, got {dtype}."
        )


def round_stochastic_with_bits(
    x: torch.Tensor, bits: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Stochastically round FP32 to ``dtype`` using caller-supplied random bits.

    Args:
        x: A float32 tensor.
        bits: An integer tensor of ``x``'s shape (or numel) holding at least 24 uniformly random
            low bits per element, e.g. from ``counter_bits``.
        dtype: ``torch.bfloat16`` or ``torch.float16`` (default: bfloat16).

    Returns:
        A tensor of ``dtype``: each value is one of the two representable neighbours of ``x``,
        the upper one with probability proportional to ``x``'s distance from the lower one. Exact
        values stay exact; NaN and inf pass through; a finite ``x`` within the format's range never
        becomes inf.
    """
    _check_sr_args(x, dtype)
    bits = bits.reshape(x.shape)
    if dtype == torch.bfloat16:
        xb = x.contiguous().view(torch.int32)
        noise = (bits & 0xFFFF).to(torch.int32)  # 16 uniform bits: the width bfloat16 drops
        # Low half zero: converts to bfloat16 exactly. A NaN converts as x.to(bfloat16) would
        # (to a NaN of the conversion's choosing).
        return _sr_bf16_bits(xb, noise).view(torch.float32).to(dtype)
    finfo = torch.finfo(dtype)
    nearest = x.to(dtype)
    near32 = nearest.float()
    # The other neighbour lies on the far side of x from the nearest value: one unit in the last
    # place further from zero where |x| is larger, nearer to zero where it is smaller. On the
    # bit pattern (sign and magnitude) that is the magnitude plus or minus 1 (from the largest
    # finite value up to inf, from -0 down to -2**-24, as nextafter gives). Integer arithmetic,
    # not torch.nextafter: compiled CPU code returned nextafter's float16 input unchanged, which
    # made every fused FP16 stochastic step round to nearest.
    step = torch.where(x.abs() > near32.abs(), 1, -1).to(torch.int32)
    other = (nearest.view(torch.int16).to(torch.int32) + step).to(torch.int16).view(dtype)
    lo = torch.minimum(nearest, other).float()
    hi = torch.maximum(nearest, other).float()
    # x - lo is exact (Sterbenz) and hi - lo a power of two, so p is exact up to FP32 range.
    p = (x - lo) / (hi - lo)
    u = (bits & 0xFFFFFF).to(torch.float32) * (1.0 / 16777216.0)  # 24-bit uniform in [0, 1)
    rounded = torch.where(u < p, hi, lo).to(dtype)
    rounded = torch.where(near32 == x, nearest, rounded)  # exact values (and ±inf) stay
    nan = torch.isnan(x)
    # Never produce inf from a finite value inside the format's range: saturate instead.
    in_range = x.abs() <= finfo.max
    rounded = torch.where(
        torch.isinf(rounded) & in_range, torch.sign(x).to(dtype) * finfo.max, rounded
    )
    return torch.where(nan, x.to(dtype), rounded)


def _sr_bf16_bits(xb: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Stochastic rounding to bfloat16 on FP32 bit patterns ``xb`` (int32) with 16-bit ``noise``.

    Returns int32 patterns whose upper half is the rounded bfloat16 and whose lower half is zero
    (NaNs keep their own bits). Integer and comparison ops only, which compiled CPU code
    vectorizes (torch.isnan, torch.isinf and sign() become per-element loops there).
    """
    nan = (xb & 0x7FFFFFFF) > 0x7F800000  # exponent all ones and a nonzero fraction
    # Adding noise in [0, 2**16) to the bit pattern carries into the kept half exactly when
    # noise >= 2**16 - (dropped bits), i.e. with probability (dropped bits) / 2**16: an
    # unbiased round of the magnitude (the sign bit is separate). The sum cannot overflow
    # for non-NaNs (magnitude <= 0x7F800000); a NaN's all-ones magnitude could, so NaNs
    # add nothing and keep their own bits. No saturation is needed: a finite |x| <= bfloat16's
    # max (0x7F7F0000) plus less than 2**16 stays below 0x7F800000, so stochastic rounding
    # never makes inf from it.
    up = (xb + torch.where(nan, 0, noise)) & -65536
    return torch.where(nan, xb, up)


# ---------------------------------------------------------------------------------------------
# Pairs: two 16-bit values in one int32 word, two FP32 values in one int64 word
# ---------------------------------------------------------------------------------------------
#
# Compiled CPU code (Inductor's C++ backend) vectorizes int32/int64/float/bfloat16 loops but not
# int16 ones, so a step that loads or stores an int16 tensor (split's trail) runs one element at
# a time. Viewing every 16-bit tensor as int32 words (elements 2j and 2j+1 in word j, the even
# one in the low half: little-endian, as every platform torch runs on) and every 32-bit tensor
# as int64 words lets the compiled step go through pairs of elements with vector integer ops
# only. The helpers below convert between those words and the FP32 values of the even and odd
# elements, exactly (no rounding anywhere).


def _unpack_bf16_pairs(u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int32 words holding two bfloat16 patterns -> the FP32 values (even, odd), exactly."""
    # A bfloat16 is the upper half of the FP32 with the same value: the even one moves up, the
    # odd one is already there and loses the even one below it.
    return (u << 16).view(torch.float32), (u & -65536).view(torch.float32)


def _pack_16_pairs(even: torch.Tensor, odd: torch.Tensor) -> torch.Tensor:
    """int32 words from the low 16 bits of ``even`` and of ``odd`` (int32 tensors)."""
    return (even & 0xFFFF) | (odd << 16)


def _pack_bf16_upper_pairs(even: torch.Tensor, odd: torch.Tensor) -> torch.Tensor:
    """int32 words from the upper 16 bits of ``even`` and of ``odd`` (int32 FP32 patterns)."""
    return ((even >> 16) & 0xFFFF) | (odd & -65536)


def _nearest_bf16_upper(x: torch.Tensor) -> torch.Tensor:
    """FP32 ``x`` rounded to the nearest bfloat16 (ties to even) as int32 FP32 patterns whose
    lower half is zero: the bits of ``x.to(torch.bfloat16).float()``, NaNs made the quiet NaN
    0x7FC0 (torch's scalar conversion; its vector one gives 0xFFFF: either way a NaN).

    Integer ops only. Compiled CPU code otherwise converts to 16-bit lanes and back for every
    ``to(bfloat16).float()``, a third of the instructions of a fused BF16 AdamW step.
    """
    b = x.view(torch.int32)
    # Adding 0x7FFF plus the kept half's lowest bit carries into the kept half exactly when the
    # dropped half is above the midpoint, or at it with an odd kept half: round to nearest even,
    # on the magnitude (the sign bit is separate). The largest finite magnitude plus the bias
    # gives inf's pattern, as rounding does; inf stays inf. No int32 overflow for non-NaNs.
    up = (b + (0x7FFF + ((b >> 16) & 1))) & -65536
    return torch.where(x != x, 0x7FC00000, up)


def _pack_rounded_bf16_pairs(
    even: torch.Tensor, odd: torch.Tensor, add_even: torch.Tensor, add_odd: torch.Tensor
) -> torch.Tensor:
    """int32 words of the bfloat16 halves of ``even`` and ``odd`` (FP32) after adding ``add_even``
    and ``add_odd`` (int32, below 2**16) to their bit patterns: the carry into the kept half is
    the rounding (a nearest-even bias, or stochastic noise). NaNs become the quiet NaN 0x7FC0; a
    NaN's sum may wrap and is discarded.

    The even half's sum is shifted down (the arithmetic shift's sign copies masked off) before
    its NaN is chosen, so neither half is masked twice: ~10% fewer instructions in a fused AdamW
    step, which is compute-bound on one thread.
    """
    e, o = even.view(torch.int32), odd.view(torch.int32)
    low = ((e + add_even) >> 16) & 0xFFFF
    high = (o + add_odd) & -65536
    return torch.where(even != even, 0x7FC0, low) | torch.where(odd != odd, 0x7FC00000, high)


def _pack_nearest_bf16_pairs(even: torch.Tensor, odd: torch.Tensor) -> torch.Tensor:
    """int32 words holding ``even`` and ``odd`` (FP32) rounded to nearest bfloat16, as ``to()``."""
    # _nearest_bf16_upper's bias on each half, packed as _pack_bf16_upper_pairs would.
    e, o = even.view(torch.int32), odd.view(torch.int32)
    return _pack_rounded_bf16_pairs(
        even, odd, 0x7FFF + ((e >> 16) & 1), 0x7FFF + ((o >> 16) & 1)
    )


def _unpack_f32_pairs(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 words holding two FP32 patterns -> the FP32 values (even, odd), exactly."""
    # int64 -> int32 keeps the low 32 bits.
    return q.to(torch.int32).view(torch.float32), (q >> 32).to(torch.int32).view(torch.float32)


def _pack_f32_pairs(even: torch.Tensor, odd: torch.Tensor) -> torch.Tensor:
    """int64 words from two FP32 tensors (even in the low half), exactly."""
    lo = even.view(torch.int32).to(torch.int64) & 0xFFFFFFFF  # sign extension masked off
    return lo | (odd.view(torch.int32).to(torch.int64) << 32)


def sum_squares(x: torch.Tensor) -> torch.Tensor:
    """The sum of the squares of ``x``'s elements (FP32 values) as a 0-d FP64 tensor.

    Each square is exact in FP64 (an FP32 significand has 24 bits) and the sum is FP64, so the
    order in which eager ATen, a chunked loop, compiled code or pairs of elements add them
    changes the result only in its last FP64 bits, which the FP32 norm built from it does not
    see (LAMB's fused and eager steps agree bit for bit on that).

    Args:
        x: A float32 tensor.

    Returns:
        A 0-d float64 tensor.
    """
    return x.double().square().sum()


def sum_squares_pairs(even: torch.Tensor, odd: torch.Tensor) -> torch.Tensor:
    """``sum_squares`` of a tensor given as its even and odd elements (FP32).

    Args:
        even: The tensor's even elements, float32.
        odd: Its odd elements, float32.

    Returns:
        A 0-d float64 tensor.
    """
    return sum_squares(even) + sum_squares(odd)


def round_stochastic(
    x: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Round FP32 to bfloat16 or float16 stochastically (unbiased).

    Args:
        x: A float32 tensor.
        dtype: ``torch.bfloat16`` or ``torch.float16`` (default: bfloat16).
        generator: Source of randomness (default: PyTorch's default generator for ``x``'s device).
            The same seed gives the same result, on every rank.

    Returns:
        A tensor of ``dtype`` whose expectation over draws equals ``x``.
    """
    _check_sr_args(x, dtype)
    bits = torch.randint(
        0, 1 << 24, x.shape, dtype=torch.int32, device=x.device, **_generator_kwargs(generator)
    )
    return round_stochastic_with_bits(x, bits, dtype)


# ---------------------------------------------------------------------------------------------
# Format facts
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FormatInfo:
    """Facts about a floating-point format.

    Attributes:
        dtype: The torch dtype.
        bits: Total width in bits.
        mantissa_bits: Explicitly stored fraction bits (7 for bfloat16, 10 for float16).
        exponent_bits: Exponent field width.
        eps: Gap between 1.0 and the next larger value (2**-mantissa_bits).
        max: Largest finite value.
        smallest_normal: Smallest positive normal value.
        smallest_subnormal: Smallest positive subnormal value.
    """

    dtype: torch.dtype
    bits: int
    mantissa_bits: int
    exponent_bits: int
    eps: float
    max: float
    smallest_normal: float
    smallest_subnormal: float


def format_info(dtype: torch.dtype) -> FormatInfo:
    """Facts about ``dtype`` (float16, bfloat16, float32 or float64).

    Args:
        dtype: The floating-point format.

    Returns:
        Its ``FormatInfo``.

    Examples:
        >>> import torch
        >>> from lowprec.numerics import format_info
        >>> info = format_info(torch.bfloat16)
        >>> info.mantissa_bits, info.eps
        (7, 0.0078125)
    """
    if not dtype.is_floating_point or dtype.is_complex:
        raise ValueError(f"format_info() needs a real floating-point dtype, got {dtype}.")
    fi = torch.finfo(dtype)
    mant = round(-math.log2(fi.eps))
    return FormatInfo(
        dtype=dtype,
        bits=fi.bits,
        mantissa_bits=mant,
        exponent_bits=fi.bits - 1 - mant,
        eps=fi.eps,
        max=fi.max,
        smallest_normal=fi.smallest_normal,
        smallest_subnormal=fi.smallest_normal * fi.eps,
    )


def ulp(x: torch.Tensor | float, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The unit in the last place of ``dtype`` at the magnitude of ``x``.

    The spacing of ``dtype``'s representable numbers in the binade ``[2**e, 2**(e+1))`` that holds
    ``|x|`` (``smallest_subnormal`` for zero and subnormal magnitudes). An update smaller than half
    this value is lost when added to ``x`` stored in ``dtype`` with round-to-nearest.

    Args:
        x: Values (any float dtype; computed in float64).
        dtype: The format (default: bfloat16).

    Returns:
        A float64 tensor of ``x``'s shape; NaN where ``x`` is not finite.
    """
    info = format_info(dtype)
    t = torch.as_tensor(x, dtype=torch.float64)
    _, e = torch.frexp(t.abs())  # |x| = m * 2**e with m in [0.5, 1)
    spacing = torch.ldexp(torch.full_like(t, info.eps), (e - 1).to(torch.int32))
    spacing = torch.where(t == 0, info.smallest_subnormal, spacing)  # frexp(0) gives e = 0
    spacing = torch.clamp(spacing, min=info.smallest_subnormal)
    return torch.where(torch.isfinite(t), spacing, torch.full_like(t, math.nan))
