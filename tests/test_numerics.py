"""lowprec.numerics against trusted references.

References: torch's own casts (``x.to(torch.bfloat16)`` rounds to nearest even) and
``torch.nextafter``, brute-force Python integer arithmetic on bit patterns, and statistics (means
of many stochastic draws compared with the input, with the standard error in the message).

Tests that take ``device`` run lowprec's functions there (the CPU, and CUDA where present: the
``device`` fixture) and compare the results, moved to the CPU, with references computed on the
CPU; rounding, splitting and the counter-based hash are elementwise, so they are exact on every
device. The helpers of the pairs of elements are the CPU fused step's (``compiled.pairs_plan``
takes pairs on the CPU only), so their tests stay on the CPU.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from lowprec import numerics
from lowprec.numerics import (
    _nearest_bf16_upper,
    _pack_16_pairs,
    _pack_bf16_upper_pairs,
    _pack_f32_pairs,
    _pack_nearest_bf16_pairs,
    _sr_bf16_bits,
    _unpack_bf16_pairs,
    _unpack_f32_pairs,
    counter_bits,
    format_info,
    hash_bits,
    join,
    round_nearest_split,
    round_stochastic,
    round_stochastic_with_bits,
    split,
    stream_key,
    ulp,
)
from tests._devices import DEVICES

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
INF = math.inf
Z = 5.0  # statistical bounds are Z standard errors (two-sided p ~ 6e-7 per check)

# --------------------------------------------------------------------------------- bit helpers


def u32_to_f32(values) -> torch.Tensor:
    """Unsigned 32-bit patterns (ints or an int64 tensor) -> float32 tensor with those bits."""
    v = torch.as_tensor(values, dtype=torch.int64) & 0xFFFFFFFF
    v = torch.where(v >= 2**31, v - 2**32, v)
    return v.to(torch.int32).view(FP32)


def f32_to_u32(x: torch.Tensor) -> torch.Tensor:
    """float32 tensor -> its bit patterns as unsigned values in an int64 tensor."""
    return x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def h16_to_u16(t: torch.Tensor) -> torch.Tensor:
    """bfloat16/float16 tensor -> its bit patterns as unsigned values in an int64 tensor."""
    return t.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF


def u16_to_h16(values, dtype) -> torch.Tensor:
    v = torch.as_tensor(values, dtype=torch.int64) & 0xFFFF
    return torch.where(v >= 2**15, v - 2**16, v).to(torch.int16).view(dtype)


def full_like_inf(t: torch.Tensor, sign) -> torch.Tensor:
    """±inf in t's dtype; ``sign`` is a scalar or a tensor broadcastable to t."""
    return torch.copysign(torch.full_like(t, INF), torch.as_tensor(sign, dtype=t.dtype))


def assert_top_as_documented(x: torch.Tensor, top: torch.Tensor) -> None:
    """Check ``top`` for every float32 pattern in ``x`` against the documented rule.

    Finite values: nearest bfloat16, ties away from zero. Reference: torch's RNE cast where the
    low half is not exactly 0x8000; at exact ties, the bfloat16 neighbour of larger magnitude,
    ``nextafter(truncated, ±inf)``. ±inf: unchanged. NaN: NaN top of the same sign, except a
    payload only in the low half (upper magnitude 0x7F80, bit 15 clear) gives ±inf, and upper
    magnitude 0x7FFF with bit 15 set wraps to ∓0.
    """
    x, top = x.reshape(-1), top.reshape(-1)
    u = f32_to_u32(x)
    tb = h16_to_u16(top)
    low = u & 0xFFFF
    upper = u >> 16
    sign = upper >> 15
    mag_upper = upper & 0x7FFF
    bit15 = (u >> 15) & 1
    finite = torch.isfinite(x)
    tie = finite & (low == 0x8000)
    plain = finite & ~tie

    cast = h16_to_u16(x.to(BF16))
    bad = plain & (tb != cast)
    assert not bad.any(), f"top != RNE cast at {f32_to_u32(x[bad])[:5].tolist()}"

    truncated = u32_to_f32(u & 0xFFFF0000).to(BF16)  # exact: low half zero
    away = h16_to_u16(torch.nextafter(truncated, full_like_inf(truncated, torch.sign(x))))
    bad = tie & (tb != away)
    assert not bad.any(), f"tie not rounded away from zero at {u[bad][:5].tolist()}"
    # At ties the result has the larger magnitude of the two neighbours.
    assert (top[tie].float().abs() > x[tie].abs()).all()

    inf = torch.isinf(x)
    assert torch.equal(tb[inf], cast[inf])

    nan = torch.isnan(x)
    to_inf = nan & (mag_upper == 0x7F80) & (bit15 == 0)
    to_zero = nan & (mag_upper == 0x7FFF) & (bit15 == 1)
    stays_nan = nan & ~to_inf & ~to_zero
    assert torch.equal(tb[to_inf], upper[to_inf])  # ±inf with x's sign
    assert torch.equal(tb[to_zero], (sign[to_zero] ^ 1) << 15)  # ∓0
    assert torch.isnan(top[stays_nan]).all()
    assert torch.equal(tb[stays_nan] >> 15, sign[stays_nan])


def assert_roundtrip(x: torch.Tensor, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """split and join ``x`` (a CPU tensor) on ``device``; returns the halves, on the CPU."""
    top, trail = split(x.to(device))
    assert top.dtype == BF16 and trail.dtype == torch.int16
    assert top.shape == x.shape == trail.shape
    back = join(top, trail).cpu()
    assert back.dtype == FP32 and back.shape == x.shape
    assert torch.equal(back.view(torch.int32), x.view(torch.int32)), "join(*split(x)) != x"
    return top.cpu(), trail.cpu()


# ------------------------------------------------------------------------------- split / join


@pytest.mark.parametrize("device", DEVICES)
@settings(deadline=None, max_examples=200)
@given(st.lists(st.integers(-(2**31), 2**31 - 1), min_size=1, max_size=500))
def test_split_join_roundtrip_every_pattern(device, patterns):
    x = torch.tensor(patterns, dtype=torch.int32).view(FP32)  # includes NaN payloads, subnormals
    top, _ = assert_roundtrip(x, device)
    assert_top_as_documented(x, top)


# (name, float32 bits, documented top bits)
EDGES = [
    ("+0", 0x00000000, 0x0000),
    ("-0", 0x80000000, 0x8000),
    ("smallest subnormal", 0x00000001, 0x0000),
    ("-smallest subnormal", 0x80000001, 0x8000),
    ("largest subnormal", 0x007FFFFF, 0x0080),  # rounds up to the smallest normal
    ("smallest normal", 0x00800000, 0x0080),
    ("1.0", 0x3F800000, 0x3F80),
    ("-1.0", 0xBF800000, 0xBF80),
    ("1.0 + just under half ulp", 0x3F807FFF, 0x3F80),
    ("tie above 1.0 (even below)", 0x3F808000, 0x3F81),  # RNE would give 0x3F80
    ("tie (odd below)", 0x3F818000, 0x3F82),
    ("-tie", 0xBF808000, 0xBF81),
    ("largest bf16", 0x7F7F0000, 0x7F7F),
    ("just under overflow", 0x7F7F7FFF, 0x7F7F),
    ("overflow tie", 0x7F7F8000, 0x7F80),
    ("largest finite", 0x7F7FFFFF, 0x7F80),
    ("-largest finite", 0xFF7FFFFF, 0xFF80),
    ("+inf", 0x7F800000, 0x7F80),
    ("-inf", 0xFF800000, 0xFF80),
    ("canonical NaN", 0x7FC00000, 0x7FC0),
    ("-canonical NaN", 0xFFC00000, 0xFFC0),
    ("NaN, low payload", 0x7F800001, 0x7F80),  # top = +inf
    ("-NaN, low payload", 0xFF800001, 0xFF80),
    ("NaN, bit 15 payload", 0x7F808000, 0x7F81),
    ("NaN all ones", 0x7FFFFFFF, 0x8000),  # wraps to -0
    ("-NaN all ones", 0xFFFFFFFF, 0x0000),  # wraps to +0
    ("NaN 0x7FFF7FFF", 0x7FFF7FFF, 0x7FFF),
]


# ------------------------------------------------------------------------- pairs of elements

EVEN_PATTERNS = st.lists(st.integers(-(2**31), 2**31 - 1), min_size=2, max_size=400).map(
    lambda v: v[: len(v) & ~1]
)


# (The pairs' helpers and storages serve the CPU fused step only: these tests stay on the CPU.)
@settings(deadline=None, max_examples=200)
@given(EVEN_PATTERNS)
def test_pairs_unpack_and_pack_exactly_for_every_pattern(patterns):
    """Pair words <-> element values, bit for bit, NaN and subnormal patterns included."""
    x = torch.tensor(patterns, dtype=torch.int32)
    f = x.view(FP32)
    even, odd = _unpack_f32_pairs(f.view(torch.int64))
    assert torch.equal(even.view(torch.int32), x[0::2]) and torch.equal(odd.view(torch.int32), x[1::2])
    assert torch.equal(_pack_f32_pairs(even, odd), f.view(torch.int64))
    h = x.to(torch.int16)  # low halves: arbitrary 16-bit patterns
    even, odd = _unpack_bf16_pairs(h.view(torch.int32))
    as_f32 = h.to(torch.int32) * 65536  # a bfloat16 pattern as the FP32 it is, exactly
    assert torch.equal(even.view(torch.int32), as_f32[0::2])
    assert torch.equal(odd.view(torch.int32), as_f32[1::2])
    assert torch.equal(_pack_16_pairs(x[0::2], x[1::2]), h.view(torch.int32))
    assert torch.equal(_pack_bf16_upper_pairs(x[0::2], x[1::2]), (x >> 16).to(torch.int16).view(torch.int32))


def _nearest_bf16_cases() -> torch.Tensor:
    """FP32 patterns: 2**20 random ones, every upper half with the lower halves around the
    midpoint (ties to even both ways) and at its ends, and the special values."""
    gen = torch.Generator().manual_seed(0)
    rand = torch.randint(-(2**31), 2**31, (1 << 20,), dtype=torch.int64, generator=gen)
    lows = torch.tensor([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF])
    ties = (torch.arange(1 << 16)[:, None] * 65536 + lows).view(-1)
    special = torch.tensor([0x7F7FFFFF, 0x7F7F7FFF, 0x7F7F8000, 0xFF7F8000, 0x7F800000,
                            0xFF800000, 0x00008000, 0x00018000, 0x7FC00000, 0x7F800001])
    bits = torch.cat([rand, ties, special])
    return ((bits + 2**31) % 2**32 - 2**31).to(torch.int32).view(FP32)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_nearest_bf16_bits_equal_torch_rounding(compiled):
    """The integer rounding of the pairs' stores equals ``to(bfloat16)`` on every non-NaN
    pattern (subnormals, ties, overflow to inf), compiled or not; NaNs stay NaNs."""
    x = _nearest_bf16_cases()
    fn = torch.compile(_nearest_bf16_upper, dynamic=True) if compiled else _nearest_bf16_upper
    got = fn(x)
    ref = x.to(BF16).float().view(torch.int32)
    nan = x != x
    assert int(nan.sum()) > 1000 and int((~nan).sum()) > 1_000_000
    assert torch.equal(got[~nan], ref[~nan])
    assert bool(got[nan].view(FP32).isnan().all())
    pack = torch.compile(_pack_nearest_bf16_pairs, dynamic=True) if compiled else (
        _pack_nearest_bf16_pairs)
    words = pack(x[0::2], x[1::2]).view(BF16)
    for half in (0, 1):  # each half on its own: a NaN beside it changes nothing
        got_h, x_h, nan_h = words[half::2], x[half::2], nan[half::2]
        assert torch.equal(got_h[~nan_h].view(torch.int16), x_h[~nan_h].to(BF16).view(torch.int16))
        assert bool(got_h[nan_h].isnan().all())


@settings(deadline=None, max_examples=200)
@given(EVEN_PATTERNS)
def test_split_storage_on_pairs_equals_split_and_join(patterns):
    """The fused step's pair form of the split strategy gives split()/join()'s bits exactly."""
    from lowprec.optim.storage import STORAGES

    s = STORAGES["split"]
    x = torch.tensor(patterns, dtype=torch.int32).view(FP32)
    top, trail = split(x)
    words, bufs = s.store_pairs(x[0::2], x[1::2], None, {}, None)
    assert torch.equal(words, top.view(torch.int32))
    assert torch.equal(bufs["trail"], trail.view(torch.int32))
    even, odd = s.load_pairs(top.view(torch.int32), {"trail": trail.view(torch.int32)})
    back = join(top, trail).view(torch.int32)
    assert torch.equal(even.view(torch.int32), back[0::2])
    assert torch.equal(odd.view(torch.int32), back[1::2])


# NaNs whose payload lies only in the lower half (their upper half alone reads as +-inf), the
# largest NaN patterns (their sums with the noise wrap) and the quiet NaN.
_LOW_PAYLOAD_NANS = [0x7F800001, 0x7F80FFFF, -8388607, 0x7FFFFFFF, -1, 0x7FC00000]


@settings(deadline=None, max_examples=100)
@given(EVEN_PATTERNS, st.integers(0, 2**32 - 1))
@example(_LOW_PAYLOAD_NANS, 0)
@example(_LOW_PAYLOAD_NANS, 2**32 - 1)
def test_stochastic_storage_on_pairs_equals_elementwise_rounding(patterns, seed):
    """Pair-form stochastic rounding: the elementwise result, with one hash's halves per pair."""
    from lowprec.optim.storage import STORAGES

    s = STORAGES["stochastic"]
    x = torch.tensor(patterns, dtype=torch.int32).view(FP32)
    h = hash_bits(torch.arange(x.numel() // 2, dtype=torch.int32), seed, 7)
    noise = torch.stack([h & 0xFFFF, (h >> 16) & 0xFFFF], dim=1).reshape(-1)
    words, _ = s.store_pairs(x[0::2], x[1::2], None, {}, h)
    got = words.view(torch.int16).view(BF16)
    want = round_stochastic_with_bits(x, noise, BF16)
    nan = torch.isnan(x)  # NaNs stay NaN (the payload may differ from the conversion's)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(h16_to_u16(got[~nan]), h16_to_u16(want[~nan]))
    expect = _sr_bf16_bits(x.view(torch.int32), noise) >> 16
    assert torch.equal(h16_to_u16(got[~nan]), expect[~nan] & 0xFFFF)


@pytest.mark.parametrize(("name", "bits", "top_bits"), EDGES, ids=[e[0] for e in EDGES])
def test_split_edges(name, bits, top_bits, device):
    x = u32_to_f32([bits])
    top, trail = assert_roundtrip(x, device)
    assert h16_to_u16(top).item() == top_bits, f"{name}: top {h16_to_u16(top).item():#06x}"
    low = bits & 0xFFFF
    assert trail.item() == (low - 65536 if low >= 32768 else low)
    assert_top_as_documented(x, top)
    if bits == 0x7FC00000:
        assert torch.isnan(top).all()


def test_top_matches_torch_cast_on_random_finite_values(device):
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-(2**31), 2**31, (1_000_000,), dtype=torch.int64, generator=g)
    x = bits.to(torch.int32).view(FP32)
    x = x[torch.isfinite(x)]
    top, _ = assert_roundtrip(x, device)
    assert torch.equal(top, round_nearest_split(x.to(device)).cpu())
    tie = (f32_to_u32(x) & 0xFFFF) == 0x8000
    cast = x.to(BF16)
    assert torch.equal(h16_to_u16(top[~tie]), h16_to_u16(cast[~tie]))
    # At exact ties, top is the neighbour of larger magnitude (RNE may pick either).
    t, c, xt = (v[tie].double().abs() for v in (top, cast, x))
    assert tie.sum() > 0 and (t > xt).all() and (t >= c).all()
    # ...and x lies exactly halfway between it and the truncated value (the other neighbour).
    below = u32_to_f32(f32_to_u32(x[tie]) & 0xFFFF0000).double().abs()
    ok = torch.isinf(t) | (t - xt == xt - below)
    assert ok.all()


def test_trail_is_low_half_as_int16_bruteforce(device):
    g = torch.Generator().manual_seed(1)
    bits = torch.randint(-(2**31), 2**31, (20_000,), dtype=torch.int64, generator=g)
    x = bits.to(torch.int32).view(FP32)
    _, trail = split(x.to(device))
    expected = []
    for b in bits.tolist():
        low = (b % 2**32) & 0xFFFF
        expected.append(low - 65536 if low & 0x8000 else low)
    assert trail.tolist() == expected


@pytest.mark.parametrize("low", [0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF])
def test_split_exhaustive_upper_halves(low, device):
    upper = torch.arange(65536, dtype=torch.int64)
    x = u32_to_f32((upper << 16) | low)
    top, trail = assert_roundtrip(x, device)
    assert_top_as_documented(x, top)
    assert (trail == (low - 65536 if low >= 32768 else low)).all()
    # Brute force: top's pattern is the upper half plus bit 15 of x, modulo 2**16.
    assert torch.equal(h16_to_u16(top), (upper + (low >> 15)) & 0xFFFF)


@pytest.mark.parametrize("dtype", [FP16, BF16, torch.float64, torch.int32])
def test_split_rejects_non_float32(dtype, device):
    with pytest.raises(TypeError):
        split(torch.zeros(4, dtype=dtype, device=device))


JOIN_BAD_DTYPES = [
    (FP32, torch.int16),
    (FP16, torch.int16),
    (BF16, torch.int32),
    (BF16, BF16),
    (torch.int16, torch.int16),
]


@pytest.mark.parametrize(("top_dtype", "trail_dtype"), JOIN_BAD_DTYPES)
def test_join_rejects_wrong_dtypes(top_dtype, trail_dtype, device):
    with pytest.raises(TypeError):
        join(torch.zeros(4, dtype=top_dtype, device=device),
             torch.zeros(4, dtype=trail_dtype, device=device))


@pytest.mark.parametrize(
    ("top_shape", "trail_shape"), [((3,), (4,)), ((2, 3), (3, 2)), ((6,), (2, 3))]
)
def test_join_rejects_shape_mismatch(top_shape, trail_shape, device):
    with pytest.raises(ValueError):
        join(torch.zeros(top_shape, dtype=BF16, device=device),
             torch.zeros(trail_shape, dtype=torch.int16, device=device))


def test_split_join_non_contiguous(device):
    x = torch.randn(7, 5).to(device).t()
    assert not x.is_contiguous()
    top, trail = split(x)
    assert top.shape == trail.shape == (5, 7)
    ref_top, ref_trail = split(x.contiguous())
    assert torch.equal(h16_to_u16(top), h16_to_u16(ref_top)) and torch.equal(trail, ref_trail)
    back = join(top.t().contiguous().t(), trail.t().contiguous().t())  # non-contiguous halves
    assert torch.equal(back.view(torch.int32), x.contiguous().view(torch.int32))


def test_split_join_scalar_and_empty(device):
    for x in (torch.tensor(1.25), torch.empty(0, 3)):
        assert_roundtrip(x, device)


# ------------------------------------------------------------------------ stochastic rounding


def neighbours(x: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Floor and ceiling of float32 ``x`` in ``dtype`` (equal where x is representable)."""
    nearest = x.to(dtype)
    near32 = nearest.float()
    down = torch.nextafter(nearest, full_like_inf(nearest, -1.0))
    up = torch.nextafter(nearest, full_like_inf(nearest, 1.0))
    lo = torch.where(near32 > x, down, nearest)
    hi = torch.where(near32 < x, up, nearest)
    return lo, hi


def sr_draws(x: float, dtype, n: int, source: str, seed: int, device="cpu") -> torch.Tensor:
    """``n`` stochastic roundings of ``x`` made on ``device`` (a generator of that device's, or
    the counter-based bits), returned on the CPU."""
    xs = torch.full((n,), x, dtype=FP32, device=device)
    if source == "generator":
        gen = torch.Generator(device).manual_seed(seed)
        return round_stochastic(xs, dtype, generator=gen).cpu()
    bits = counter_bits(n, stream_key(seed, 7), device=device)
    return round_stochastic_with_bits(xs, bits, dtype).cpu()


def check_unbiased(x32: float, dtype, n: int, source: str, seed: int, device="cpu") -> None:
    x = torch.tensor([x32], dtype=FP32)
    lo, hi = neighbours(x, dtype)
    lo64, hi64, xv = lo.double().item(), hi.double().item(), x.double().item()
    r = sr_draws(xv, dtype, n, source, seed, device)
    assert ((r == lo) | (r == hi)).all(), "a draw is not one of the two neighbours"
    mean = r.double().mean().item()
    if lo64 == hi64:
        assert mean == xv
        return
    gap = hi64 - lo64
    p = (xv - lo64) / gap
    se = gap * math.sqrt(p * (1 - p) / n)
    tol = Z * se + gap / n  # + one draw's worth, for the discreteness of the count
    assert abs(mean - xv) <= tol, (
        f"x={xv!r} ({dtype}, {source}): mean of {n} draws {mean!r} differs by {mean - xv:.3e}; "
        f"bound {Z} SE + 1/n gap = {tol:.3e} (SE {se:.3e}, p={p:.4f})"
    )


MEAN_CASES = [
    (BF16, 1 + 2**-9),  # p = 1/4
    (BF16, 1 + 3 * 2**-10),  # p = 3/8
    (BF16, -2.7182817),
    (BF16, 1e-3),
    (BF16, 1e-3 + 1e-9),
    (BF16, 1e-3 - 3e-10),
    (BF16, 3e-39),  # bfloat16 (and float32) subnormal range
    (BF16, -3e-39),
    (BF16, 3.3e38),  # just below the largest bfloat16
    (BF16, 12345.678),
    (FP16, 1 + 2**-11),  # p = 1/2
    (FP16, 1 + 3 * 2**-12),
    (FP16, -2.7182817),
    (FP16, 1e-3),
    (FP16, 1e-3 + 1e-9),
    (FP16, 1e-3 - 3e-10),
    (FP16, 1e-6),  # float16 subnormal
    (FP16, -1e-6),
    (FP16, 2e-8),  # below the smallest float16 subnormal: rounds to 0 or 2**-24
    (FP16, 65503.9),
]


@pytest.mark.parametrize("source", ["generator", "counter"])
@pytest.mark.parametrize(("dtype", "x"), MEAN_CASES)
def test_stochastic_rounding_is_unbiased(dtype, x, source, device):
    lo, hi = neighbours(torch.tensor([x], dtype=FP32), dtype)
    assert lo.item() != hi.item(), "table values must not be representable"
    check_unbiased(x, dtype, 200_000, source, seed=11, device=device)


# (dtype, x, exact number of the 2**24 low-bit patterns that must round x up, to the ceiling):
# p has a resolution finer than 2**-16 here (for float16), so an implementation that used fewer
# than 24 random bits, or rounded up on u == p, would miss the count.
EXACT_COUNT_CASES = [
    # Negative: the magnitude rounds up (to the floor) for 0x4001 of every 2**16 dropped halves.
    (BF16, -(1 + 2**-9 + 2**-23), 2**24 - 0x4001 * 2**8),
    (FP16, 2**-24 * (5.75 + 2**-19), 2**24 * 3 // 4 + 2**5),  # subnormal, p = 3/4 + 2**-19
]


@pytest.mark.parametrize(("dtype", "x", "count"), EXACT_COUNT_CASES, ids=["bf16", "fp16"])
def test_stochastic_exactly_unbiased_over_all_bit_patterns(dtype, x, count, device):
    """Over every value of the 24 low random bits, x rounds up exactly p * 2**24 times."""
    n = 2**24
    xs = torch.full((n,), x, dtype=FP32)
    assert xs[0].item() == x
    lo, hi = neighbours(xs[:1], dtype)
    p = (x - lo.double().item()) / (hi.double().item() - lo.double().item())
    assert p * n == count  # the table is consistent with the neighbours
    bits = torch.arange(n, dtype=torch.int32, device=device)
    r = round_stochastic_with_bits(xs.to(device), bits, dtype).cpu()
    ups = (r == hi).sum().item()
    assert ups == count and (r == lo).sum().item() == n - count, f"{ups} of 2**24 up, want {count}"


@st.composite
def float_and_dtype(draw):
    dtype = draw(st.sampled_from([BF16, FP16]))
    m = torch.finfo(dtype).max
    x = draw(st.floats(-m, m, width=32, allow_nan=False, allow_infinity=False))
    return dtype, x


@pytest.mark.parametrize("device", DEVICES)
@settings(deadline=None, max_examples=30, derandomize=True)
@given(float_and_dtype(), st.integers(0, 2**16))
def test_stochastic_rounding_unbiased_random_floats(device, case, seed):
    dtype, x = case
    check_unbiased(x, dtype, 20_000, "generator", seed, device)


def log_uniform_sample(dtype, n=50_000, seed=3) -> torch.Tensor:
    """Float32 values of both signs spread over the whole range of ``dtype``, subnormals included."""
    g = torch.Generator().manual_seed(seed)
    info = format_info(dtype)
    lo_e, hi_e = math.log2(info.smallest_subnormal) - 2, math.log2(info.max)
    e = lo_e + (hi_e - lo_e) * torch.rand(n, generator=g, dtype=torch.float64)
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()
    x = (sign * torch.exp2(e)).float()
    return x[x.abs() <= info.max]


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_stochastic_result_is_a_neighbour(dtype, device):
    x = log_uniform_sample(dtype)
    lo, hi = neighbours(x, dtype)
    xd = x.to(device)
    g = torch.Generator(device).manual_seed(5)
    for k in range(4):
        bits = counter_bits(x.numel(), stream_key(5, k), device=device)
        for r in (
            round_stochastic(xd, dtype, generator=g).cpu(),
            round_stochastic_with_bits(xd, bits, dtype).cpu(),
        ):
            assert r.dtype == dtype and r.shape == x.shape
            bad = (r != lo) & (r != hi)
            assert not bad.any(), f"not a neighbour: x={x[bad][:5].tolist()} -> {r[bad][:5]}"
            assert torch.equal(torch.signbit(r), torch.signbit(x)), "sign changed"


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_stochastic_keeps_every_representable_value(dtype, device):
    exact = u16_to_h16(torch.arange(65536), dtype)
    x = exact.float()  # exact widening
    finite_or_inf = ~torch.isnan(exact)
    g = torch.Generator(device).manual_seed(9)
    for bits in (
        torch.zeros(65536, dtype=torch.int64),
        torch.full((65536,), 2**32 - 1, dtype=torch.int64),
        counter_bits(65536, stream_key(9)),
        None,
    ):
        if bits is None:
            r = round_stochastic(x.to(device), dtype, generator=g).cpu()
        else:
            r = round_stochastic_with_bits(x.to(device), bits.to(device), dtype).cpu()
        assert torch.equal(h16_to_u16(r)[finite_or_inf], h16_to_u16(exact)[finite_or_inf])
        assert torch.isnan(r[~finite_or_inf]).all()


@pytest.mark.parametrize("dtype", [BF16, FP16])
@pytest.mark.parametrize(
    "value", [INF, -INF, math.nan, 0.0, -0.0], ids=["inf", "-inf", "nan", "+0", "-0"]
)
def test_stochastic_special_values_pass_through(dtype, value, device):
    x = torch.full((1000,), value, dtype=FP32, device=device)
    for r in (
        round_stochastic(x, dtype, generator=torch.Generator(device).manual_seed(0)),
        round_stochastic_with_bits(x, torch.full((1000,), 2**32 - 1, device=device), dtype),
        round_stochastic_with_bits(x, torch.zeros(1000, dtype=torch.int64, device=device), dtype),
    ):
        if math.isnan(value):
            assert torch.isnan(r).all()
        else:
            assert (r.float() == value).all()
            negative = math.copysign(1.0, value) < 0
            assert (torch.signbit(r) == negative).all()


def just_below(v: float, k: int) -> list[float]:
    """v and the k float32 values just below it."""
    t = torch.tensor([v], dtype=FP32)
    out = [t.item()]
    for _ in range(k):
        t = torch.nextafter(t, torch.tensor([-INF]))
        out.append(t.item())
    return out


BF16_MAX = torch.finfo(BF16).max
NEAR_MAX = [
    (BF16, [*just_below(BF16_MAX, 5), 3.3890e38, 3.38e38]),
    (FP16, [65504.0, 65503.9, 65503.99, 65490.0, 65473.0]),
]


@pytest.mark.parametrize(("dtype", "values"), NEAR_MAX, ids=["bf16", "fp16"])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_stochastic_never_overflows_within_range(dtype, values, sign, device):
    n = 20_000
    x = (sign * torch.tensor(values, dtype=FP32)).repeat_interleave(n).to(device)
    assert (x.abs() <= torch.finfo(dtype).max).all()
    outs = [
        round_stochastic(x, dtype, generator=torch.Generator(device).manual_seed(2)),
        round_stochastic_with_bits(x, counter_bits(x.numel(), 3, device=device), dtype),
        # The extreme bit patterns force rounding up (bfloat16: all ones; float16: zero).
        round_stochastic_with_bits(x, torch.full_like(x, 2**32 - 1, dtype=torch.int64), dtype),
        round_stochastic_with_bits(x, torch.zeros_like(x, dtype=torch.int64), dtype),
    ]
    for r in outs:
        assert torch.isfinite(r).all(), f"inf from finite in-range input ({dtype})"
        assert (r.float().abs() <= torch.finfo(dtype).max).all()


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_stochastic_reproducible_with_seed(dtype, device):
    x = (torch.randn(10_000) * 3).to(device)
    a = round_stochastic(x, dtype, generator=torch.Generator(device).manual_seed(42))
    b = round_stochastic(x, dtype, generator=torch.Generator(device).manual_seed(42))
    c = round_stochastic(x, dtype, generator=torch.Generator(device).manual_seed(43))
    assert torch.equal(h16_to_u16(a), h16_to_u16(b))
    assert not torch.equal(a, c)
    # Disagreements are common: most values are inexact, each an independent coin.
    assert (a != c).float().mean() > 0.1


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_stochastic_non_contiguous_input(dtype, device):
    x = (torch.randn(30, 20) * 10).to(device).t()
    assert not x.is_contiguous()
    bits = counter_bits(x.numel(), stream_key(4), device=device).reshape(x.shape)
    r = round_stochastic_with_bits(x, bits, dtype)
    assert r.shape == (20, 30)
    assert torch.equal(
        h16_to_u16(r), h16_to_u16(round_stochastic_with_bits(x.contiguous(), bits, dtype))
    )
    x, r = x.cpu(), r.cpu()
    lo, hi = neighbours(x, dtype)
    assert ((r == lo) | (r == hi)).all()


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_stochastic_with_bits_deterministic(dtype, device):
    x = (torch.randn(4, 2500) * 100).to(device)
    bits = counter_bits(x.numel(), stream_key(1, 2, 3), device=device)
    a = round_stochastic_with_bits(x, bits, dtype)  # flat bits of x's numel are accepted
    b = round_stochastic_with_bits(x, bits.reshape(4, 2500).clone(), dtype)
    assert a.shape == x.shape
    assert torch.equal(h16_to_u16(a), h16_to_u16(b))
    other_bits = counter_bits(x.numel(), stream_key(1, 2, 4), device=device)
    other = round_stochastic_with_bits(x, other_bits, dtype)
    assert (a != other).float().mean() > 0.1


# --- counter_bits / stream_key


def lowbias32(v: int) -> int:
    """Wellons' lowbias32 hash, in plain Python integers (reference for counter_bits)."""
    v &= 0xFFFFFFFF
    v ^= v >> 16
    v = (v * 0x7FEB352D) & 0xFFFFFFFF
    v ^= v >> 15
    v = (v * 0x846CA68B) & 0xFFFFFFFF
    return v ^ (v >> 16)


@pytest.mark.parametrize("key", [0, 1, 2**32 - 1, 2**32, 2**64 - 1, 0x0123456789ABCDEF])
def test_counter_bits_matches_integer_reference(key, device):
    # The stream is part of what a checkpoint depends on: pin it against exact integer arithmetic.
    offset = 2**32 - 300  # index + key wraps modulo 2**32 inside this range for some keys
    got = counter_bits(600, key, offset=offset, device=device).tolist()
    lo, hi = key & 0xFFFFFFFF, key >> 32 & 0xFFFFFFFF
    want = [lowbias32(lowbias32(i + lo) ^ hi) for i in range(offset, offset + 600)]
    assert got == want


@pytest.mark.parametrize("key", [0, 2**32 - 1, 0x0123456789ABCDEF, 0xFFFFFFFF00000001])
@pytest.mark.parametrize("start", [0, 2**31 - 300, 2**32 - 300, 5 * 2**32 + 7])
@pytest.mark.parametrize("as_tensor", [False, True])
def test_hash_bits_int32_and_int64_indices_match_the_reference(key, start, as_tensor, device):
    # The compiled step hashes int32 indices in int32 arithmetic (wrapping multiplies, masked
    # arithmetic shifts); int64 indices are reduced to their low 32 bits first. Both must give
    # lowbias32's bits exactly, with the key as ints or as 0-d int64 tensors (on the device, as
    # a step keeps them).
    lo, hi = key & 0xFFFFFFFF, key >> 32
    k = (torch.tensor(lo, device=device), torch.tensor(hi, device=device)) if as_tensor else (
        lo, hi)
    want = [lowbias32(lowbias32(i + lo) ^ hi) for i in range(start, start + 600)]
    idx64 = torch.arange(start, start + 600, dtype=torch.int64, device=device)
    got64 = hash_bits(idx64, *k)
    assert got64.dtype == torch.int32
    assert (got64.to(torch.int64) & 0xFFFFFFFF).tolist() == want
    if start + 600 <= 2**31:
        got32 = hash_bits(idx64.to(torch.int32), *k)
        assert got32.dtype == torch.int32 and torch.equal(got32, got64)


def test_counter_bits_deterministic_and_in_range(device):
    k = stream_key(123, 4, 5)
    a, b = counter_bits(10_000, k, device=device), counter_bits(10_000, k, device=device)
    assert a.dtype == torch.int64 and a.shape == (10_000,)
    assert torch.equal(a, b)
    assert torch.equal(a.cpu(), counter_bits(10_000, k))  # the same bits on every device
    assert a.min() >= 0 and a.max() < 2**32
    c = counter_bits(10_000, k + 1, device=device)
    d = counter_bits(10_000, k ^ (1 << 40), device=device)  # differs only in the high word
    for other in (c, d):
        assert (a == other).sum() <= 2  # chance agreement ~ 2**-32 per element


@pytest.mark.parametrize(("numel", "offset", "total"), [(10, 5, 15), (1, 0, 1), (100, 900, 1000)])
def test_counter_bits_offset_is_a_slice(numel, offset, total, device):
    k = stream_key(8, 9)
    assert torch.equal(counter_bits(numel, k, offset=offset, device=device),
                       counter_bits(total, k, device=device)[offset:])


def test_counter_bits_uniform(device):
    n = 1_000_000
    raw = counter_bits(n, stream_key(2024, 1), device=device).cpu()
    se = math.sqrt((2**64 - 1) / 12 / n)  # uniform on {0, ..., 2**32 - 1}
    mean, want = raw.double().mean().item(), 2**31 - 0.5
    assert abs(mean - want) <= Z * se, f"mean {mean} vs {want}, bound {Z} SE = {Z * se:.4g}"
    low = (raw & 0xFFFF).double().mean().item()  # the bits bfloat16 rounding uses
    se16 = math.sqrt((2**32 - 1) / 12 / n)
    assert abs(low - 32767.5) <= Z * se16, f"low-16 mean {low}, bound {Z} SE = {Z * se16:.4g}"
    se_bit = 0.5 / math.sqrt(n)
    for b in range(32):
        f = ((raw >> b) & 1).sum().item() / n
        assert abs(f - 0.5) <= Z * se_bit, (
            f"bit {b}: frequency {f}, bound {Z} SE = {Z * se_bit:.2e}"
        )


STREAM_KEY_PAIRS = [
    ((0,), (1,)),
    ((0,), (2**32,)),  # seed differs only above 32 bits
    ((0, 1), (0, 2)),
    ((0, 1), (0, 1 + 2**32)),  # counter differs only above 32 bits
    ((0, 1, 2), (0, 1, 3)),
    ((0, 1, 2), (0, 2, 2)),
    ((0, 1, 2), (0, 2, 1)),  # order matters
    ((5, 0), (5,)),
    ((5, 0), (5, 0, 0)),
]


@pytest.mark.parametrize(("a", "b"), STREAM_KEY_PAIRS)
def test_stream_key_differs(a, b):
    ka, kb = stream_key(*a), stream_key(*b)
    assert ka != kb
    assert 0 <= ka < 2**64 and 0 <= kb < 2**64
    assert stream_key(*a) == ka  # deterministic


def test_stream_key_grid_distinct():
    keys = {stream_key(77, step, idx) for step in range(64) for idx in range(64)}
    assert len(keys) == 64 * 64
    assert stream_key(77, 3, 4) == stream_key(77, 3, 4)


SR_BAD_INPUT = [FP16, BF16, torch.float64, torch.int32]


@pytest.mark.parametrize("in_dtype", SR_BAD_INPUT)
def test_stochastic_rejects_non_float32(in_dtype, device):
    x = torch.zeros(8, dtype=in_dtype, device=device)
    with pytest.raises(TypeError):
        round_stochastic(x, BF16)
    with pytest.raises(TypeError):
        round_stochastic_with_bits(x, torch.zeros(8, dtype=torch.int64, device=device), FP16)


@pytest.mark.parametrize("target", [FP32, torch.float64, torch.int16])
def test_stochastic_rejects_bad_target(target, device):
    x = torch.zeros(8, device=device)
    with pytest.raises(ValueError):
        round_stochastic(x, target)
    with pytest.raises(ValueError):
        round_stochastic_with_bits(x, torch.zeros(8, dtype=torch.int64, device=device), target)


# ------------------------------------------------------------------------------- format facts

# (dtype, bits, mantissa bits, exponent bits, max, smallest normal, smallest subnormal)
FORMATS = [
    (BF16, 16, 7, 8, (2 - 2**-7) * 2.0**127, 2.0**-126, 2.0**-133),
    (FP16, 16, 10, 5, 65504.0, 2.0**-14, 2.0**-24),
    (FP32, 32, 23, 8, (2 - 2**-23) * 2.0**127, 2.0**-126, 2.0**-149),
]


@pytest.mark.parametrize(("dtype", "bits", "mant", "expo", "vmax", "normal", "sub"), FORMATS)
def test_format_info(dtype, bits, mant, expo, vmax, normal, sub):
    info = format_info(dtype)
    assert info.dtype == dtype
    assert (info.bits, info.mantissa_bits, info.exponent_bits) == (bits, mant, expo)
    assert info.eps == 2.0**-mant
    assert (info.max, info.smallest_normal, info.smallest_subnormal) == (vmax, normal, sub)
    # Brute force against the format itself.
    m = torch.tensor([info.max], dtype=torch.float64).to(dtype)
    assert m.double().item() == info.max
    assert torch.isinf(torch.nextafter(m, torch.full_like(m, INF))).all()
    s = torch.tensor([info.smallest_subnormal, info.smallest_subnormal / 2], dtype=torch.float64)
    s = s.to(dtype)
    assert s[0].item() == info.smallest_subnormal != 0
    assert s[1].item() == 0  # half of the smallest subnormal rounds (to even) to zero
    zero = torch.zeros(1, dtype=dtype)
    assert torch.nextafter(zero, torch.ones_like(zero)).item() == info.smallest_subnormal


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.bool, torch.complex64])
def test_format_info_rejects_non_real_float(dtype):
    with pytest.raises(ValueError):
        format_info(dtype)


def ulp_reference(x: float, dtype) -> float:
    """nextafter(|x| rounded down into dtype, +inf) - that value, by brute force."""
    a = abs(x)
    r = torch.tensor([a], dtype=torch.float64).to(dtype)
    if r.double().item() > a:
        r = torch.nextafter(r, torch.zeros_like(r))
    assert r.double().item() <= a
    nxt = torch.nextafter(r, torch.full_like(r, INF))
    return nxt.double().item() - r.double().item()


ULP_VALUES = [1.0, 1.5, 2.0, 1000.0, -3.0, 0.1, -0.7, 1.999, 12345.6, 1e-5, 0.0, -0.0]
# (dtype, extra values for that format: subnormals, near the top)
ULP_EXTRA = {
    BF16: [1e-39, 2.0**-133, 3 * 2.0**-133, 2.0**-126, 2.0**-127, 1e30, 3e38],
    FP16: [1e-6, 2.0**-24, 2.0**-14, 2.0**-15 * 1.5, 6e-5, 60000.0, -40000.0],
    FP32: [1e-40, 2.0**-149, 2.0**-126, 1e30, 3e38],
}
ULP_CASES = [(d, v) for d in (BF16, FP16, FP32) for v in ULP_VALUES + ULP_EXTRA[d]]


# (ulp of a Python float computes on the CPU; test_ulp_tensor_shape_and_non_finite takes tensors
# on each device.)
@pytest.mark.parametrize(("dtype", "x"), ULP_CASES)
def test_ulp_matches_bruteforce(dtype, x):
    got = ulp(x, dtype)
    assert got.dtype == torch.float64 and got.shape == ()
    want = ulp_reference(x, dtype)
    assert got.item() == want, f"ulp({x!r}, {dtype}) = {got.item()!r}, brute force {want!r}"


@pytest.mark.parametrize(
    ("dtype", "x", "want"),
    [
        (BF16, 1.0, 2.0**-7),
        (FP16, 1.0, 2.0**-10),
        (FP32, 1.0, 2.0**-23),
        (BF16, 1.5, 2.0**-7),
        (BF16, 2.0, 2.0**-6),
        (BF16, 1000.0, 4.0),
        (FP16, 1000.0, 0.5),
        (BF16, 0.0, 2.0**-133),
        (FP16, 0.0, 2.0**-24),
        (FP32, 0.0, 2.0**-149),
        (FP16, 1e-6, 2.0**-24),
    ],
)
def test_ulp_known_values(dtype, x, want):
    assert ulp(x, dtype).item() == want


def test_ulp_tensor_shape_and_non_finite(device):
    x = torch.tensor([[1.0, INF], [-INF, math.nan]], dtype=FP32, device=device)
    u = ulp(x, BF16)
    assert u.shape == (2, 2) and u.dtype == torch.float64 and u.device == x.device
    assert u[0, 0].item() == 2.0**-7
    assert torch.isnan(u.flatten()[1:]).all()
    assert ulp(1.0).item() == 2.0**-7  # default dtype is bfloat16
    with pytest.raises(ValueError):
        ulp(1.0, torch.int32)


@pytest.mark.parametrize("v", [1.0, 3.0, -5.5, 256.0, 1e-3, -1e30, 7e-39])
def test_swamping_below_half_ulp(v, device):
    """An update under half an ulp vanishes when added to a bfloat16 value; just over it does not."""
    w = torch.tensor([v], dtype=FP32).to(BF16).to(device)  # a bfloat16 value
    u = ulp(w.float(), BF16).item()
    s = math.copysign(1.0, v)  # move away from zero: the ulp above |w| is the one that counts
    small = torch.tensor([s * 0.49 * u], dtype=FP32, device=device)
    big = torch.tensor([s * 0.51 * u], dtype=FP32, device=device)
    assert torch.equal((w.float() + small).to(BF16), w), "sub-half-ulp update was not lost"
    moved = (w.float() + big).to(BF16)
    assert moved.double().item() == w.double().item() + s * u, "over-half-ulp update was lost"
    # The same in native bfloat16 arithmetic (updates chosen representable in bfloat16).
    small16 = torch.tensor([s * 0.375 * u], dtype=torch.float64).to(BF16).to(device)
    big16 = torch.tensor([s * (0.5 + 2**-6) * u], dtype=torch.float64).to(BF16).to(device)
    assert torch.equal(w + small16, w)
    assert not torch.equal(w + big16, w)
    # Stochastic rounding keeps the small update in expectation (it is not always lost).
    xs = (w.float() + small).expand(4000).contiguous()
    r = round_stochastic(xs, BF16, generator=torch.Generator(device).manual_seed(0))
    assert (r != w).any()


@pytest.mark.parametrize("n", [0, 1, 7, 4096, 3 * 65536 + 777])
def test_sum_squares_is_exact_squares_summed_in_fp64_in_any_order(n, device):
    """sum_squares against the correctly rounded sum of the exact squares (math.fsum): whole, in
    chunks, on pairs and compiled, to FP64's rounding, and the same FP32 norm every way (the
    claim covers any order of the sum, so CUDA's, and Triton's, too)."""
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3
    ref = math.fsum(v * v for v in x.double().tolist())  # FP32 squares are exact in FP64
    xd = x.to(device)
    chunks = math.fsum(numerics.sum_squares(xd[i:i + 4096]).item() for i in range(0, n, 4096))
    values = [numerics.sum_squares(xd).item(), chunks]
    if n % 2 == 0:
        values.append(numerics.sum_squares_pairs(xd[0::2], xd[1::2]).item())
    if n > 1:
        values.append(torch.compile(numerics.sum_squares, dynamic=True)(xd).item())
    for value in values:
        assert value == pytest.approx(ref, rel=1e-12, abs=0)
        assert torch.tensor(value).sqrt().float() == torch.tensor(ref).sqrt().float()
    # An FP32 accumulation is further off than FP64's reordering could ever be.
    if n > 4096:
        fp32 = x.square().sum().item()
        assert abs(fp32 - ref) / ref > 1e-12


def test_round_stochastic_inside_torch_compile_draws_what_eager_draws(device):
    # torch.randint(..., generator=None) failed to trace; without a generator the compiled call
    # draws from the default one (the device's), the same bits as eager under fallback_random.
    import torch._inductor.config

    x = (torch.randn(1000) * 3).to(device)
    compiled = torch.compile(numerics.round_stochastic, dynamic=True)

    @torch._inductor.config.patch(fallback_random=True)
    def draw(fn):
        torch.manual_seed(4)
        return fn(x)

    assert torch.equal(draw(numerics.round_stochastic), draw(compiled))


@pytest.mark.parametrize("compiled", [False, True])
def test_plus_l2_leaves_the_gradient_bit_for_bit_without_decay(compiled):
    # g + 0 * w would turn a -0.0 gradient of a positive weight into +0.0 and any gradient of an
    # infinite weight into NaN; the number 0 (a group without decay, whose rule leaves the term
    # out: its l2 flag) leaves g as it is. A 0-d tensor (a compiled step's coefficient, passed
    # only where the group decays) is always added, with no select on its value.
    g = torch.tensor([-0.0, -0.0, 1.5, -2.0, math.inf, 3.0])
    w = torch.tensor([1.0, -1.0, 2.0, math.inf, 1.0, -math.inf])
    fn = torch.compile(numerics.plus_l2, dynamic=True) if compiled else numerics.plus_l2
    assert torch.equal(fn(g, w, 0.0).view(torch.int32), g.view(torch.int32))
    for wd in (0.25, torch.tensor(0.25), torch.tensor(0.0)):
        torch.testing.assert_close(fn(g, w, wd), g + w * float(wd), rtol=0, atol=0,
                                   equal_nan=True)
