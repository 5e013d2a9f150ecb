"""The demos' numbers against computations in plain Python floats (``struct`` rounding)."""

from __future__ import annotations

import math
import statistics
import struct

import pytest
import torch

from lowprec.cli import demos


def f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


def f16(x: float) -> float:
    """Round a float64 to FP16, nearest with ties to even (``struct``'s ``e`` format)."""
    return struct.unpack("<e", struct.pack("<e", x))[0]


def _bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def _from_bits(b: int) -> float:
    return struct.unpack("<f", struct.pack("<I", b))[0]


def bf16_even(x: float) -> float:
    b = _bits(x)
    return _from_bits((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000)


def bf16_away(x: float) -> float:
    return _from_bits((_bits(x) + 0x8000) & 0xFFFF0000)


def bf16_ulp(x: float) -> float:
    """BF16's spacing in the binade of ``x`` (normal ``x``)."""
    return math.ldexp(1.0, math.frexp(abs(x))[1] - 8)


# ------------------------------------------------------------------ swamping

SWAMPING_CASES = [  # (big, small, steps): small below half a BF16 ulp of big
    (1.0, 1e-4, 1000),
    (256.0, 0.25, 200),
    (-3.0, 2.0**-9 * 0.7, 300),
    (1e-3, 1e-7, 500),
]


def _reference(big: float, small: float, steps: int) -> dict[str, tuple[float, float]]:
    """(final, stored) of each deterministic method, one FP32 rounding per operation."""
    inc = f32(small)
    x = f32(big)
    fp32 = x
    for _ in range(steps):
        fp32 = f32(fp32 + inc)
    b = bf16_even(x)
    for _ in range(steps):
        b = bf16_even(f32(b + inc))
    p = bf16_even(x)
    c = bf16_even(f32(x - p))
    for _ in range(steps):
        new = f32(f32(p + c) + inc)
        p = bf16_even(new)
        c = bf16_even(f32(new - p))
    return {
        "fp32": (fp32, fp32),
        "bf16": (b, b),
        "bf16-kahan": (f32(p + c), p),
        "bf16-split": (fp32, bf16_away(fp32)),  # the split master is the FP32 sum, exactly
    }


@pytest.mark.parametrize("big, small, steps", SWAMPING_CASES)
def test_swamping_matches_a_float_by_float_run(big, small, steps):
    out = demos.swamping(big=big, small=small, steps=steps)
    exact = big + steps * small
    assert out["exact"] == exact and (out["big"], out["small"], out["steps"]) == (big, small, steps)
    for name, (final, stored) in _reference(big, small, steps).items():
        m = out["methods"][name]
        assert (m["final"], m["stored"]) == (final, stored), name
        assert m["abs_error"] == abs(final - exact)
        assert m["relative_error"] == abs(final - exact) / abs(exact)


@pytest.mark.parametrize("big, small, steps", SWAMPING_CASES)
def test_swamping_facts(big, small, steps):
    out = demos.swamping(big=big, small=small, steps=steps)
    m = out["methods"]
    exact = out["exact"]
    assert m["bf16"]["final"] == bf16_even(f32(big))  # swamped: not one addition counted
    assert m["bf16-split"]["relative_error"] < 1e-3
    assert m["bf16-split"]["final"] == m["fp32"]["final"]
    # Kahan keeps each addition up to the rounding of the BF16 compensation, at most half its
    # ulp: |c| <= half a BF16 ulp of the value, so 2**-9 of that ulp per step (plus FP32 slack).
    ulp = bf16_ulp(max(abs(big), abs(exact)))
    assert m["bf16-kahan"]["abs_error"] <= steps * (ulp * 2.0**-9 + 4 * ulp * 2.0**-16)
    assert m["bf16-kahan"]["relative_error"] < m["bf16"]["relative_error"] / 20
    # Stochastic rounding is unbiased: the mean over trials is near the exact sum. Each step
    # rounds up with probability q = small / ulp, a variance of q (1 - q) ulp**2.
    sr = m["bf16-sr"]
    q = abs(small) / ulp
    sigma = math.sqrt(steps * q * (1 - q)) * ulp / math.sqrt(sr["trials"])
    assert abs(sr["mean_final"] - exact) < 5 * sigma + steps * ulp * 2.0**-16
    assert sr["mean_relative_error"] == abs(sr["mean_final"] - exact) / abs(exact)


def test_swamping_defaults_kahan_and_split_are_close_bf16_is_stuck():
    m = demos.swamping()["methods"]
    assert m["bf16"]["final"] == 1.0 and m["bf16"]["stored"] == 1.0
    assert m["bf16-split"]["relative_error"] < 1e-4
    # BF16 Kahan at these defaults: about 2.5e-3 relative, the compensation's own rounding
    # (see the bound above); within 1e-2, thirty times better than plain BF16's 9e-2.
    assert m["bf16-kahan"]["relative_error"] < 1e-2
    assert m["bf16-sr"]["mean_relative_error"] < 1e-2


def test_stochastic_rounding_is_reproducible_by_seed():
    a = demos.swamping(seed=3, sr_trials=8)["methods"]["bf16-sr"]
    b = demos.swamping(seed=3, sr_trials=8)["methods"]["bf16-sr"]
    c = demos.swamping(seed=4, sr_trials=8)["methods"]["bf16-sr"]
    assert a == b and a["mean_final"] != c["mean_final"]


def test_swamping_with_zero_steps_is_exact():
    out = demos.swamping(steps=0)
    assert all(m["abs_error"] == 0.0 for m in out["methods"].values())


# ------------------------------------------------------------------ FP16 underflow


def _sample(seed: int, n: int, low: float, high: float) -> list[float]:
    # The documented sample: log2-uniform in float64, then rounded to FP32.
    gen = torch.Generator().manual_seed(seed)
    e = torch.empty(n, dtype=torch.float64).uniform_(math.log2(low), math.log2(high), generator=gen)
    return [f32(v) for v in torch.exp2(e).tolist()]


def test_fp16_underflow_matches_a_value_by_value_cast():
    scales = (1, 2.0**8, 2.0**16, 3.0)
    out = demos.fp16_underflow(scales=scales, seed=1, n=5000)
    g = _sample(1, 5000, 2.0**-34, 2.0**-4)
    assert [r["scale"] for r in out["rows"]] == list(scales)
    for row, scale in zip(out["rows"], scales, strict=True):
        h = [f16(f32(v * scale)) for v in g]
        rel = [abs(x / scale - v) / v for x, v in zip(h, g, strict=True)]
        n = len(g)
        assert row["flushed"] == sum(x == 0 for x in h) / n
        assert row["subnormal"] == sum(0 < x < 2.0**-14 for x in h) / n
        assert row["overflow"] == 0.0
        assert row["mean_relative_error"] == pytest.approx(statistics.fmean(rel), rel=1e-12)
        assert row["max_relative_error"] == max(rel)
        # thresholds in exact arithmetic: below half the smallest subnormal flushes
        assert row["flushed"] == sum(v * scale <= 2.0**-25 for v in g) / n


def test_loss_scaling_fixes_the_flush():
    rows = demos.fp16_underflow()["rows"]
    flushed = [r["flushed"] for r in rows]
    # log2-uniform over [-34, -4]: the part below -25 flushes unscaled, 9/30 of the sample
    assert flushed[0] == pytest.approx(9 / 30, abs=0.01)
    assert flushed[1] == pytest.approx(1 / 30, abs=0.005)
    assert flushed[2] == 0.0
    assert rows[2]["mean_relative_error"] < rows[0]["mean_relative_error"] / 100
    assert rows[2]["max_relative_error"] < 2.0**-6  # 2**-18 * 2**16 = 2**-2 is a coarse subnormal


def test_fp16_overflow_is_counted():
    (row,) = demos.fp16_underflow(scales=(2.0**24,), n=2000)["rows"]
    g = _sample(0, 2000, 2.0**-34, 2.0**-4)
    assert row["overflow"] == sum(f32(v * 2.0**24) >= 65520 for v in g) / 2000 > 0


# ------------------------------------------------------------------ DFP-16


def test_dfp16_errors_against_float64_rounding():
    out = demos.dfp16_errors(n=4000, seed=2)
    x = torch.randn(4000, generator=torch.Generator().manual_seed(2)).double()
    # E_s = E_fmax - 14: the largest magnitude lands in [2**14, 2**15)
    exponent = math.frexp(float(x.abs().max()))[1] - 1 - 14
    assert out["exponent"] == exponent and out["bits"] == 16
    u = x / 2.0**exponent  # exact
    reference = {
        "nearest": torch.round(u),  # ties to even
        "biased": torch.floor(u + 0.5),
        "floor": torch.floor(u),
    }
    assert set(reference) < set(out["modes"])
    for mode, q in reference.items():
        err = q.clamp(-32767, 32767) - u
        got = out["modes"][mode]
        assert got["max_abs_error"] == pytest.approx(float(err.abs().max()), rel=1e-12)
        assert got["mean_error"] == pytest.approx(float(err.mean()), rel=1e-9, abs=1e-15)
        assert got["mean_abs_error"] == pytest.approx(float(err.abs().mean()), rel=1e-9)
    s = out["modes"]["stochastic"]
    assert s["max_abs_error"] < 1 and abs(s["mean_error"]) < 5 * 0.5 / math.sqrt(4000)


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: demos.swamping(steps=-1), ValueError, "steps must be an int >= 0"),
        (lambda: demos.swamping(big=math.inf), ValueError, "big must be finite"),
        (lambda: demos.swamping(small="x"), TypeError, "small must be a number"),
        (lambda: demos.swamping(sr_trials=0), ValueError, "sr_trials must be an int >= 1"),
        (lambda: demos.fp16_underflow(scales=()), ValueError, "at least one loss scale"),
        (lambda: demos.fp16_underflow(scales=(0,)), ValueError, "scale must be finite and > 0"),
        (lambda: demos.fp16_underflow(low=1.0, high=0.5), ValueError, "low must be below high"),
        (lambda: demos.fp16_underflow(n=0), ValueError, "n must be an int >= 1"),
        (lambda: demos.dfp16_errors(n=0), ValueError, "n must be an int >= 1"),
    ],
)
def test_bad_input(call, error, match):
    with pytest.raises(error, match=match):
        call()
