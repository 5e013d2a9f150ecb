"""lowprec.distributed against references.

* The quantizer against a brute-force, value-by-value reference of each rule, plus the error
  feedback invariant and the bit packing layout.
* The DDP hook, run by 2 and 3 gloo processes on synthetic gradients, against ``simulate()``: a
  single-process model of the same algorithm, column by column, that knows nothing of buckets,
  stripes or packing. They must agree bit for bit at every step, on every rank, through DDP's bucket
  rebuild, warm-up and a non-finite fallback, and so must the final residuals.
* Training an MLP with DDP: the 1-bit run's loss beside the uncompressed run's (both rules), and a
  checkpoint resumed bit for bit.

The multi-process scenarios run once per module, in process groups of 1, 2 and 3 ranks (fixture
``synthetic``) and of 2 ranks (fixture ``trained``); the tests read their results. They run once
per backend of ``DIST_BACKENDS`` (fixture ``backend``): gloo on the CPU, and NCCL, rank ``r`` on
GPU ``r``, where two GPUs exist (scenarios of more ranks than GPUs are skipped there). The
single-process tests of the quantizer run on each device present (the ``device`` fixture).
"""

from __future__ import annotations

import itertools
import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lowprec.distributed import (
    BITS,
    DEFAULT_RULE,
    OneBitState,
    column_runs,
    columns_finite,
    dequantize_columns,
    kernels,
    onebit_hook,
    pack_codes,
    packed_size,
    quantize_columns,
    quantize_with_feedback_,
    unpack_codes,
)
from lowprec.distributed.layout import _Layout
from tests import _dist_workers as workers
from tests._devices import DEVICES, DIST_BACKENDS, cuda_count

QUANTIZERS = [(1, "zero-threshold"), (1, "range"), (2, "range"), (4, "range"), (8, "range")]
EPS32 = torch.finfo(torch.float32).eps


# ---------------------------------------------------------------- brute-force reference quantizer


def f32(v: float) -> float:
    """Round a Python float to FP32 (the reference computes in FP32, one operation at a time)."""
    return torch.tensor(v, dtype=torch.float32).item()


def ref_quantize_column(values: list[float], *, bits: int, rule: str):
    """One column, value by value: (codes, (stat0, stat1), reconstruction).

    zero-threshold: code 1 for v >= 0; stats are the exact means of each group (0 for an empty
    one), rounded once to FP32. range: the bin of [min, max] cut in 2**bits, with the library's
    FP32 operation order, so codes and reconstruction are exact.
    """
    if rule == "zero-threshold":
        up = [v for v in values if v >= 0]
        down = [v for v in values if v < 0]
        mean_up = f32(math.fsum(up) / len(up)) if up else 0.0
        mean_down = f32(math.fsum(down) / len(down)) if down else 0.0
        codes = [1 if v >= 0 else 0 for v in values]
        return codes, (mean_down, mean_up), [mean_up if c else mean_down for c in codes]
    lo, hi = min(values), max(values)
    step = f32(f32(hi - lo) / 2**bits)
    codes = []
    for v in values:
        q = math.floor(f32(f32(v - lo) / step)) if step > 0 else 0
        codes.append(min(max(q, 0), 2**bits - 1))
    recon = [f32(f32(f32(q + 0.5) * step) + lo) for q in codes]
    return codes, (lo, hi), recon


def random_columns(ncols: int, length: int, *, seed: int) -> torch.Tensor:
    """Columns with their own scale and offset; some all-positive, one constant, one with zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(ncols, length, generator=g) * torch.exp(torch.randn(ncols, 1, generator=g))
    x += 0.7 * torch.randn(ncols, 1, generator=g)
    x[0] = x[0].abs() + 0.1  # all positive
    x[1] = 0.25  # constant
    x[2, ::3] = 0.0  # exact zeros (they belong to the non-negative group)
    x[3, 0] = -0.0
    return x


@pytest.mark.parametrize("length", [1, 5, 32, 257])
@pytest.mark.parametrize(("bits", "rule"), QUANTIZERS)
def test_quantizer_matches_brute_force_reference(bits, rule, length, device):
    x = random_columns(8, length, seed=length)
    codes, stats = quantize_columns(x.to(device), bits=bits, rule=rule)
    recon = dequantize_columns(codes, stats, bits=bits, rule=rule).cpu()
    codes, stats = codes.cpu(), stats.cpu()
    assert codes.dtype == torch.uint8 and codes.shape == x.shape and stats.shape == (8, 2)
    for i in range(x.shape[0]):
        ref_codes, ref_stats, ref_recon = ref_quantize_column(x[i].tolist(), bits=bits, rule=rule)
        assert codes[i].tolist() == ref_codes, f"column {i}"
        if rule == "range":
            assert stats[i].tolist() == list(ref_stats)
            assert recon[i].tolist() == ref_recon, f"column {i}"
        else:
            # FP32 group sums vs exact means: within a few ulps at this length.
            torch.testing.assert_close(stats[i], torch.tensor(ref_stats), rtol=4 * EPS32,
                                       atol=0.0)
            # The reconstruction is exactly one of the column's two stats, chosen by the code.
            assert torch.equal(recon[i], stats[i][codes[i].long()])


@pytest.mark.parametrize(("bits", "rule"), QUANTIZERS)
def test_quantizer_properties(bits, rule, device):
    x = random_columns(16, 100, seed=7).to(device)
    codes, stats = quantize_columns(x, bits=bits, rule=rule)
    recon = dequantize_columns(codes, stats, bits=bits, rule=rule)
    assert int(codes.max()) < 2**bits
    if rule == "range":
        lo, hi = stats[:, :1], stats[:, 1:]
        assert torch.equal(lo[:, 0], x.amin(1)) and torch.equal(hi[:, 0], x.amax(1))
        assert bool(((recon >= lo) & (recon <= hi)).all())
        # Nearest level: within half a bin of the value, plus FP32 rounding at the column's scale.
        half_bin = (hi - lo) / 2 ** (bits + 1)
        rounding = 8 * EPS32 * torch.maximum(lo.abs(), hi.abs())
        assert bool(((x - recon).abs() <= half_bin + rounding).all())
        assert torch.equal(recon[1], x[1])  # a constant column is exact
    else:
        assert torch.equal(codes.bool(), x >= 0)
        # The group means keep each column's sum.
        torch.testing.assert_close(recon.double().sum(1), x.double().sum(1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("bits", "rule"), QUANTIZERS)
def test_error_feedback_invariant_and_unbiased_over_time(bits, rule, device):
    """x + old residual == reconstruction + new residual (to FP32 rounding), and over many steps
    what was sent adds up to what came in, minus the last residual."""
    g = torch.Generator().manual_seed(3)
    residual = torch.zeros(12, 64, device=device)
    sent = torch.zeros(12, 64, dtype=torch.float64, device=device)
    total = torch.zeros(12, 64, dtype=torch.float64, device=device)
    for _ in range(30):
        grad = (torch.randn(12, 64, generator=g) * torch.rand(12, 1, generator=g)).to(device)
        x = grad + residual
        old = residual.clone()
        codes, stats = quantize_with_feedback_(x, bits=bits, rule=rule)
        recon = dequantize_columns(codes, stats, bits=bits, rule=rule)
        residual = x
        lhs = grad.double() + old.double()
        rhs = recon.double() + residual.double()
        bound = EPS32 * ((grad + old).abs() + residual.abs()).double()
        assert bool(((lhs - rhs).abs() <= bound).all())
        sent += recon.double()
        total += grad.double()
    torch.testing.assert_close(sent + residual.double(), total, rtol=0, atol=1e-4)
    if rule == "range":  # the residual never exceeds half a bin of the column it came from
        assert float(residual.abs().max()) < 4.0 / 2**bits


@pytest.mark.parametrize(
    ("column", "finite"),
    [
        ([1.0, -2.0, 3.0], True),
        ([1.0, float("nan"), 3.0], False),
        ([float("inf"), 1.0, 2.0], False),
        ([-float("inf"), 1.0, 2.0], False),
        ([3e38, -3e38, 1.0], None),  # range: max - min overflows; zero-threshold: fine
        ([3e38, 3e38, 3e38], None),  # zero-threshold: the sum overflows; range: fine
    ],
)
@pytest.mark.parametrize(("bits", "rule"), [(1, "zero-threshold"), (1, "range"), (4, "range")])
def test_non_finite_columns_are_flagged(bits, rule, column, finite, device):
    x = torch.tensor([column, [0.5, -0.5, 0.25]], dtype=torch.float32, device=device)
    _, stats = quantize_columns(x, bits=bits, rule=rule)
    flags = columns_finite(stats, rule=rule)
    if finite is None:
        finite = (rule == "range") == (column[1] > 0)
    assert flags.tolist() == [finite, True]


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=60, deadline=None)
@given(st.sampled_from([1, 2, 4, 8]), st.integers(0, 70), st.integers(0, 2**31 - 1))
def test_pack_round_trip_and_layout(device, bits, n, seed):
    codes = torch.randint(0, 2**bits, (n,), dtype=torch.uint8,
                          generator=torch.Generator().manual_seed(seed)).to(device)
    packed = pack_codes(codes, bits=bits)
    assert packed.dtype == torch.uint8 and packed.numel() == packed_size(n, bits) == -(-n * bits // 8)
    assert torch.equal(unpack_codes(packed, n, bits=bits), codes)
    per = 8 // bits
    for i, c in enumerate(codes.tolist()):  # code i at byte i // per, bits from bits * (i % per)
        assert (int(packed[i // per]) >> (bits * (i % per))) & (2**bits - 1) == c
    if n % per:  # unused slots of the last byte are zero
        assert int(packed[-1]) >> (bits * (n % per)) == 0
    # The hook's two packers (eager byte loops; integer views for the compiler), run eagerly here
    # (compiled in the fused scenarios), on the codes padded to whole bytes as the hook pads them
    # (the hook never packs an empty stripe).
    if n == 0:
        return
    padded = torch.cat([codes, codes.new_zeros(packed.numel() * per - n)])
    for pack, unpack in ((kernels.pack, kernels.unpack), (kernels.pack_wide, kernels.unpack_wide)):
        out = torch.empty_like(packed)
        pack(padded, out, bits)
        assert torch.equal(out, packed)
        rows = torch.empty(2, padded.numel(), dtype=torch.uint8, device=device)
        unpack(torch.stack([packed, packed]), rows, bits)
        assert torch.equal(rows[0], padded) and torch.equal(rows[1], padded)


@pytest.mark.parametrize("bits", BITS)
def test_wide_unpacking_of_every_byte(bits):
    """``unpack_wide`` (integer shifts and masks) gives every one of the 256 byte values the
    codes the byte loop gives."""
    packed = torch.arange(256, dtype=torch.int64).to(torch.uint8)[None]
    expected = torch.empty(1, 256 * (8 // bits), dtype=torch.uint8)
    got = torch.empty_like(expected)
    kernels.unpack(packed, expected, bits)
    kernels.unpack_wide(packed, got, bits)
    assert torch.equal(got, expected)


@pytest.mark.parametrize(
    ("shapes", "options", "runs"),
    [
        ([(64, 48)], {}, [(0, 64, 48)]),  # one column per output unit
        ([(64,)], {}, [(0, 1, 64)]),
        ([(2500,)], {}, [(0, 1, 834), (834, 2, 833)]),  # flat: ceil(2500/1024) near-equal columns
        ([(3000,)], {"column_size": 1000}, [(0, 3, 1000)]),
        ([(8, 3, 3, 3)], {}, [(0, 1, 216)]),  # 27 values per output unit < 32: cut flat
        ([(8, 3, 3, 3)], {"min_column_size": 27}, [(0, 8, 27)]),
        ([()], {}, [(0, 1, 1)]),  # a scalar
        ([(0, 5), (3, 40)], {}, [(0, 3, 40)]),  # empty parameters take no columns
        ([(4, 40), (10,), (2, 2, 20)], {}, [(0, 4, 40), (160, 1, 10), (170, 2, 40)]),
    ],
)
def test_column_runs(shapes, options, runs):
    assert column_runs(shapes, **options) == runs


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
@pytest.mark.parametrize(
    "shapes", [[(64, 48), (64,), (33, 100), (2500,), ()], [(3, 40)], [(5,)], [(1000, 32)]]
)
def test_stripes_cover_the_bucket_between_columns(shapes, world):
    layout = _Layout(tuple(f"p{i}" for i in range(len(shapes))), shapes, world_size=world, rank=0,
                     bits=1, column_size=1024, min_column_size=32)
    runs = column_runs(shapes)
    boundaries = {s + i * n for s, c, n in runs for i in range(c + 1)}
    longest = max(n for _, _, n in runs)
    assert layout.stripes[0].start == 0 and layout.stripes[-1].end == layout.numel
    for r, stripe in enumerate(layout.stripes):
        assert stripe.start in boundaries and stripe.end in boundaries
        if r:
            assert stripe.start == layout.stripes[r - 1].end
        # About numel / world each: off by less than one column at either end.
        assert abs(stripe.numel - layout.numel / world) <= longest
        assert sum(b.ncols * b.length for b in stripe.blocks) == stripe.numel
        assert sum(b.ncols for b in stripe.blocks) == stripe.ncols
    assert layout.chunk_bytes % 4 == 0


BAD_OPTIONS = [
    ({"bits": 3}, ValueError, r"bits=3 is not supported: use 1, 2, 4 or 8"),
    ({"bits": 1.0}, TypeError, r"bits must be an int"),
    ({"bits": True}, TypeError, r"bits must be an int"),
    ({"rule": "sign"}, ValueError, r"unknown rule 'sign'"),
    ({"bits": 2, "rule": "zero-threshold"}, ValueError, r"1-bit rule .* use rule='range'"),
    ({"warmup_steps": -1}, ValueError, r"warmup_steps=-1 is out of range: must be >= 0"),
    ({"warmup_steps": 1.5}, TypeError, r"warmup_steps must be an int"),
    ({"column_size": 0}, ValueError, r"column_size=0 is out of range: must be >= 1"),
    ({"min_column_size": 0}, ValueError, r"min_column_size=0 is out of range"),
]


@pytest.mark.parametrize(("options", "error", "message"), BAD_OPTIONS)
def test_bad_options_raise(options, error, message):
    with pytest.raises(error, match=message):
        OneBitState(torch.nn.Linear(2, 2), **options)


def test_bad_arguments_raise():
    with pytest.raises(TypeError, match=r"needs the model \(an nn.Module\)"):
        OneBitState([torch.nn.Parameter(torch.zeros(2))])
    with pytest.raises(TypeError, match=r"onebit_hook needs a OneBitState, got NoneType"):
        onebit_hook(None, None)
    with pytest.raises(ValueError, match=r"must be 2-D \[columns, length\]"):
        quantize_columns(torch.zeros(4))
    with pytest.raises(TypeError, match=r"must be float32, got torch.float16"):
        quantize_columns(torch.zeros(2, 2, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"at least 1 bytes for 8 codes"):
        unpack_codes(torch.zeros(0, dtype=torch.uint8), 8)


# --------------------------------------------------- single-process simulation of the algorithm


def column_lengths(shape: tuple[int, ...], *, column_size: int = 1024,
                   min_column_size: int = 32) -> list[int]:
    """The spec of the columns, written out again: output units, or near-equal flat slices."""
    numel = math.prod(shape)
    if numel == 0:
        return []
    if len(shape) >= 2 and numel // shape[0] >= min_column_size:
        return [numel // shape[0]] * shape[0]
    ncols = -(-numel // column_size)
    short, extra = divmod(numel, ncols)
    return [short + 1] * extra + [short] * (ncols - extra)


def quantize_by_column(x: torch.Tensor, lengths: list[int], *, bits: int, rule: str):
    """(reconstruction, all finite) of flat ``x``, quantizing column by column (each run of
    equal-length columns as the rows of one matrix: rows are independent, one thread)."""
    recon, finite, at = torch.empty_like(x), True, 0
    for n, run in itertools.groupby(lengths):
        k = len(list(run))
        codes, stats = quantize_columns(x[at : at + k * n].view(k, n), bits=bits, rule=rule)
        recon[at : at + k * n] = dequantize_columns(codes, stats, bits=bits, rule=rule).view(-1)
        finite = finite and bool(columns_finite(stats, rule=rule).all())
        at += k * n
    return recon, finite


def all_reduce(step_grads, names, world):
    """DDP's default average: divide by the world size, then sum (in rank order)."""
    out = {}
    for n in names:
        out[n] = step_grads[0][n].reshape(-1) / world
        for k in range(1, world):
            out[n] = out[n] + step_grads[k][n].reshape(-1) / world
    return out


def simulate(grads, buckets, shapes, *, world, warmup_steps, bits=1, rule=DEFAULT_RULE,
             column_size=1024,
             min_column_size=32, drop_residuals_at=None, fused=None):
    """1-bit SGD with error feedback, for all ranks at once, one column at a time.

    ``grads[t][k][name]`` is rank k's gradient at step t; ``buckets[t]`` the names per bucket
    (used only to decide which parameters fall back together when one is not finite). Returns
    the averaged gradients per step, the local residuals per rank, the aggregation residuals, and
    the (step, name) pairs that were all-reduced uncompressed (warm-up or fallback).
    ``drop_residuals_at`` zeroes every residual before that step (what losing them would do).
    """
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the hook's processes also run one thread: same reductions
    try:
        lengths = {n: column_lengths(s, column_size=column_size, min_column_size=min_column_size)
                   for n, s in shapes.items()}
        local = [{n: torch.zeros(math.prod(s)) for n, s in shapes.items()} for _ in range(world)]
        agg = {n: torch.zeros(math.prod(s)) for n, s in shapes.items()}
        outputs, reduced = [], set()
        for t, step_buckets in enumerate(buckets):
            if t == drop_residuals_at:
                for d in [*local, agg]:
                    for n in d:
                        d[n] = torch.zeros_like(d[n])
            out = {}
            for names in step_buckets:
                if t < warmup_steps:
                    out.update(all_reduce(grads[t], names, world))
                    reduced.update((t, n) for n in names)
                    continue
                recon, new_local, finite = {}, {}, True
                for k in range(world):
                    for n in names:
                        x = grads[t][k][n].reshape(-1) + local[k][n]
                        recon[k, n], ok = quantize_by_column(x, lengths[n], bits=bits, rule=rule)
                        new_local[k, n] = x - recon[k, n]
                        finite = finite and ok
                if not finite:
                    out.update(all_reduce(grads[t], names, world))
                    reduced.update((t, n) for n in names)
                    continue
                for (k, n), r in new_local.items():
                    local[k][n] = r
                for n in names:
                    total = recon[0, n]
                    for k in range(1, world):
                        total = total + recon[k, n]
                    x = total / world + agg[n]
                    out[n], ok = quantize_by_column(x, lengths[n], bits=bits, rule=rule)
                    assert ok
                    agg[n] = x - out[n]
            outputs.append(out)
        return outputs, local, agg, reduced
    finally:
        torch.set_num_threads(prev_threads)


# ------------------------------------------------------------------- the multi-process scenarios

NAN, INF = 4, 7  # indices: synthetic_grads puts a NaN at an even index, an inf at an odd one

#: Synthetic scenarios: name -> (world size, configuration for workers.run_synthetic).
SYNTHETIC = {
    "w1-1bit": (1, {"state": {"warmup_steps": 0}, "steps": 3, "bucket_cap_mb": 0.02,
                    "nonfinite": [(2, 0, "w2", NAN)]}),
    "w2-1bit-zero": (2, {"state": {"rule": "zero-threshold", "warmup_steps": 0,
                                   "column_size": 1000}, "steps": 6, "bucket_cap_mb": 0.02,
                         "nonfinite": [(3, 1, "w2", NAN), (4, 0, "long", INF)]}),
    "w2-1bit-range-warmup": (2, {"state": {"rule": "range", "warmup_steps": 2}, "steps": 5,
                                 "bucket_cap_mb": 0.02}),
    "w2-2bit-range": (2, {"state": {"bits": 2, "rule": "range", "warmup_steps": 0}, "steps": 3,
                          "bucket_cap_mb": 0.02}),
    "w2-4bit-range": (2, {"state": {"bits": 4, "rule": "range", "warmup_steps": 0,
                                    "min_column_size": 8}, "steps": 3, "bucket_cap_mb": 0.02}),
    "w2-8bit-range": (2, {"state": {"bits": 8, "rule": "range", "warmup_steps": 0}, "steps": 3,
                          "bucket_cap_mb": 0.02}),
    "w2-big-1bit": (2, {"model": "big", "state": {"rule": "zero-threshold", "warmup_steps": 0},
                        "steps": 4}),
    "w2-big-2bit": (2, {"model": "big", "state": {"bits": 2, "rule": "range", "warmup_steps": 0},
                        "steps": 3}),
    "w2-big-8bit": (2, {"model": "big", "state": {"bits": 8, "rule": "range", "warmup_steps": 0},
                        "steps": 3}),
    "w2-bf16": (2, {"dtype": "bfloat16", "state": {"warmup_steps": 0}, "steps": 3,
                    "bucket_cap_mb": 0.02}),
    "w3-1bit-zero": (3, {"state": {"rule": "zero-threshold", "warmup_steps": 0},
                         "steps": 4, "bucket_cap_mb": 0.02,
                         "nonfinite": [(2, 2, "emb", NAN)]}),
    "w3-1bit-range-warmup": (3, {"state": {"rule": "range", "warmup_steps": 1}, "steps": 4,
                                 "bucket_cap_mb": 0.02}),
    "w3-big-1bit": (3, {"model": "big", "state": {"rule": "zero-threshold", "warmup_steps": 0},
                        "steps": 3}),
    # The compiled kernels (fused=True, on CPU: Inductor's C++) against the same simulation.
    "w2-fused-1bit": (2, {"state": {"warmup_steps": 1, "fused": True}, "steps": 4,
                          "bucket_cap_mb": 0.02, "nonfinite": [(3, 0, "w1", NAN)]}),
    # (BF16 buckets and 2 bits in one scenario: each new dtype or width compiles new kernels.)
    "w2-fused-bf16-2bit": (2, {"dtype": "bfloat16", "state": {"bits": 2, "warmup_steps": 0,
                                                              "fused": True},
                               "steps": 3, "bucket_cap_mb": 0.02}),
    # One parameter per bucket: an empty one, single values, odd sizes, a 3-value bucket on 3
    # ranks (one value per stripe) and a 1-value bucket (stripes of 0 values on all but one rank).
    "w2-tiny": (2, {"model": "tiny", "state": {"warmup_steps": 0}, "steps": 3,
                    "bucket_cap_mb": 1e-6}),
    "w3-tiny": (3, {"model": "tiny", "state": {"rule": "zero-threshold", "warmup_steps": 0},
                    "steps": 3, "bucket_cap_mb": 1e-6, "nonfinite": [(2, 1, "w", NAN)]}),
}

#: Resume scenarios (2 ranks): a run checkpointed after step SAVE_AT and resumed in fresh DDP
#: objects must end with the same parameters, bit for bit.
RESUME_HOOKS = {
    "zero-threshold": {"rule": "zero-threshold", "warmup_steps": 2},
    "range-2bit": {"rule": "range", "bits": 2, "warmup_steps": 2},
}
RESUME_STEPS, SAVE_AT = 8, 4

#: A NaN on one rank under a loss scaler (2 ranks, several buckets): rank 1 poisons the first
#: layer's weight gradient at step 4, after 2 uncompressed steps.
SCALER_RUN = {"steps": 7, "poison_step": 4, "poison_rank": 1, "poison_param": "net.0.weight",
              "warmup_steps": 2}

#: Bad checkpoints (built in workers._bad_loads): case -> (exception, message regex); None: loads.
BAD_LOADS = {
    "world_size": ("ValueError", r"saved by 4 ranks but this process group has 2: .* cannot be "
                                 r"re-split\. Resume with 4 ranks"),
    "bits": ("ValueError", r"other settings \(bits: saved 2, here 1; rule: saved 'range', here "
                           r"'zero-threshold'\): build the state with the saved settings"),
    "unknown_name": ("ValueError", r"residuals for 'not.a.param' \(rank 0\), which is not a "
                                   r"parameter of this module"),
    "wrong_size": ("ValueError", r"does not fit the parameter's \d+ values"),
    "not_a_state_dict": ("TypeError", r"not a OneBitState.state_dict\(\)"),
    "version": ("ValueError", r"version 99 is not supported"),
    "unknown_name_not_strict": None,
}

#: Convergence: an MLP regression, 2 ranks x batch 32, SGD(lr=0.02, momentum=0.9), 400 steps, the
#: first 10 uncompressed. Over seeds 0-5 the 1-bit runs' final eval loss was above the uncompressed
#: run's by 0.10 % on average (0.13 % at most) for "range" and 0.78 % (1.07 %) for
#: "zero-threshold" (docs/distributed.md); the issue's target, and the test's bound, is 2 %.
CONVERGE_TRAIN = {"steps": 400, "lr": 0.02, "batch": 32}
CONVERGE_WARMUP = 10
CONVERGE_RTOL = 0.02
CONVERGE_RUNS = {
    "fp32": {"hook": None},
    "zero-threshold": {"hook": {"rule": "zero-threshold", "warmup_steps": CONVERGE_WARMUP}},
    "range": {"hook": {"rule": "range", "warmup_steps": CONVERGE_WARMUP}},
}


def _launch(world, tmp_path_factory, fn, *args, backend="gloo"):
    out = tmp_path_factory.mktemp(f"{fn.__name__}-{backend}")
    workers.launch(fn, world, out, *args, backend=backend)
    return out


@pytest.fixture(scope="module", params=DIST_BACKENDS)
def backend(request):
    """The process groups' backend: "gloo" (CPU), and "nccl" (rank r on GPU r) where two GPUs
    exist (tests/_devices.py)."""
    return request.param


def _fits(world, backend):
    """Whether ``backend`` can run ``world`` ranks here (NCCL: one GPU per rank)."""
    return backend != "nccl" or world <= cuda_count()


#: The SYNTHETIC scenarios this session has run, per backend: ``{backend: {name: per rank}}``
#: (``"direct-w<world>"``: the direct calls of each launch). tests/test_floor.py runs some of them
#: through ``run_synthetic`` too: whichever module comes first runs a scenario, the other reads
#: its results (the same deterministic scenario in the same torch: rerunning it proved nothing
#: more); under the floor's torch only the floor's run.
_RUN: dict[str, dict[str, list]] = {}


def run_synthetic(names, backend, tmp_path_factory):
    """SYNTHETIC's scenarios ``names`` on ``backend`` (those it can run here), each launched
    once per session, one launch per world size: ``{name: per rank}``."""
    done = _RUN.setdefault(backend, {})
    for world in sorted({SYNTHETIC[n][0] for n in names}):
        todo = [n for n in names if SYNTHETIC[n][0] == world and n not in done]
        if not todo or not _fits(world, backend):
            continue
        out = _launch(world, tmp_path_factory, workers.worker_synthetic,
                      [SYNTHETIC[n][1] for n in todo], backend=backend)
        per_rank = [torch.load(out / f"synthetic-{r}.pt", weights_only=False)
                    for r in range(world)]
        for i, n in enumerate(todo):
            done[n] = [per_rank[r][i] for r in range(world)]
        done[f"direct-w{world}"] = [per_rank[r][-1] for r in range(world)]
    return {n: done[n] for n in done if n in names or n.startswith("direct-")}


@pytest.fixture(scope="module")
def synthetic(backend, tmp_path_factory):
    """Every SYNTHETIC scenario that ``backend`` can run here: results[name][rank]."""
    return run_synthetic(list(SYNTHETIC), backend, tmp_path_factory)


@pytest.fixture(scope="module")
def trained(backend, tmp_path_factory):
    """Resume scenarios, bad loads and convergence runs, in one 2-process group."""
    out = _launch(2, tmp_path_factory, workers.worker_trained, RESUME_HOOKS, RESUME_STEPS,
                  SAVE_AT, {n: {**kw, **CONVERGE_TRAIN} for n, kw in CONVERGE_RUNS.items()},
                  SCALER_RUN, backend=backend)
    return [torch.load(out / f"trained-{r}.pt", weights_only=False) for r in range(2)]


def _ranks(synthetic, name):
    """Scenario ``name``'s results per rank; a skip where the backend could not run it."""
    if name not in synthetic:
        pytest.skip(f"{name}: more ranks than GPUs for NCCL")
    return synthetic[name]


def _inputs(name):
    world, cfg = SYNTHETIC[name]
    shapes = workers.MODELS[cfg.get("model", "synth")][0]
    grads = []
    for t in range(cfg["steps"]):
        step = []
        for k in range(world):
            g = workers.synthetic_grads(shapes, step=t, rank=k, seed=cfg.get("seed", 0))
            g = {n: v.to(getattr(torch, cfg.get("dtype", "float32"))).float() for n, v in g.items()}
            for s, bad_rank, n, idx in cfg.get("nonfinite", ()):
                if (s, bad_rank) == (t, k):
                    g[n].view(-1)[idx] = float("nan") if idx % 2 == 0 else float("inf")
            step.append({f"params.{n}": v for n, v in g.items()})
        grads.append(step)
    return world, cfg, {f"params.{n}": s for n, s in shapes.items()}, grads


def assert_all_reduced(got, step_grads, name, world):
    """``got`` is the average of the ranks' ``name`` gradients, summed in any order: within FP32
    rounding of the sum of magnitudes (gloo orders a sum of 3 or more ranks its own way)."""
    terms = [step_grads[k][name].reshape(-1) / world for k in range(world)]
    want = all_reduce(step_grads, [name], world)[name]
    slack = 2 * EPS32 * sum(t.abs() for t in terms)
    assert torch.equal(got.isnan(), want.isnan())
    ok = want.isnan() | ((got - want).abs() <= slack) | (got == want)  # (inf == inf)
    assert bool(ok.all()), name


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise-equal values, NaNs in the same places."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


def _stripe_residuals(state_dict, shapes):
    """The aggregation residual of every parameter, assembled from every rank's pieces."""
    full = {n: torch.zeros(math.prod(s)) for n, s in shapes.items()}
    for part in state_dict["ranks"]:
        for n, piece in part["stripe"].items():
            full[n][piece["offset"] : piece["offset"] + piece["residual"].numel()] = piece["residual"]
    return full


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(SYNTHETIC))
def test_hook_matches_simulation_bit_for_bit(synthetic, name, backend):
    world, cfg, shapes, grads = _inputs(name)
    ranks = _ranks(synthetic, name)
    if backend == "nccl" and cfg["state"].get("rule", DEFAULT_RULE) == "zero-threshold":
        # Its column means are sums, which CUDA adds in another order than the simulation's
        # one CPU thread: not bit for bit (the other tests of the scenario still run).
        pytest.skip("zero-threshold's column sums: CUDA's order differs from the simulation's")
    buckets = ranks[0]["layouts"]
    assert len(buckets) == cfg["steps"]
    assert all(r["layouts"] == buckets for r in ranks)  # DDP buckets alike on every rank
    outputs, local, agg, reduced = simulate(grads, buckets, shapes, world=world, **cfg["state"])
    for t in range(cfg["steps"]):
        for k in range(world):
            for n in shapes:
                got = ranks[k]["outputs"][t][n].reshape(-1)
                want = outputs[t][n].to(got.dtype)  # a BF16 bucket gets the FP32 result rounded
                if (t, n) in reduced and world > 2:
                    # gloo sums 3 ranks in its own order; the compressed path fixes the order.
                    assert_all_reduced(got, grads[t], n, world)
                else:
                    assert _same(got, want), f"step {t}, rank {k}, {n}"
    state = ranks[0]["state"]
    assert state["world_size"] == world and len(state["ranks"]) == world
    for k in range(world):
        saved = state["ranks"][k]["local"]
        assert set(saved) == set(shapes)
        for n, v in saved.items():
            assert torch.equal(v, local[k][n]), f"local residual, rank {k}, {n}"
    for n, v in _stripe_residuals(state, shapes).items():
        assert torch.equal(v, agg[n]), f"aggregation residual {n}"


@pytest.mark.multiprocess
def test_bucket_rebuild_keeps_residuals(synthetic, backend):
    """DDP's rebuild after iteration 0 regroups the parameters; the residuals follow them. Losing
    them (the simulation with drop_residuals_at=1) would change the outputs, so the bit-for-bit
    agreement above is proof that nothing was lost."""
    # (NCCL: a "range" scenario, bit for bit on CUDA too; zero-threshold's sums are not.)
    name = "w2-1bit-zero" if backend == "gloo" else "w2-2bit-range"
    world, cfg, shapes, grads = _inputs(name)
    buckets = synthetic[name][0]["layouts"]
    assert buckets[0] != buckets[1] and len(buckets[1]) > 1, "no rebuild happened"
    assert buckets[1:] == [buckets[1]] * (len(buckets) - 1)
    outputs, *_ = simulate(grads, buckets, shapes, world=world, **cfg["state"])
    dropped, *_ = simulate(grads, buckets, shapes, world=world, **cfg["state"],
                             drop_residuals_at=1)
    got = synthetic[name][0]["outputs"][1]
    assert all(_same(got[n].reshape(-1), outputs[1][n]) for n in shapes)
    assert not all(_same(got[n].reshape(-1), dropped[1][n]) for n in shapes)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["w1-1bit", "w2-1bit-zero", "w3-1bit-zero"])
def test_non_finite_bucket_falls_back_to_plain_all_reduce(synthetic, name):
    world, cfg, _, grads = _inputs(name)
    ranks = _ranks(synthetic, name)
    buckets = ranks[0]["layouts"]
    for step, _, param, idx in cfg["nonfinite"]:
        bucket = next(b for b in buckets[step] if f"params.{param}" in b)
        for k in range(world):
            out = ranks[k]["outputs"][step]
            for n in bucket:  # DDP's default result, NaN/inf included
                assert_all_reduced(out[n].reshape(-1), grads[step], n, world)
            assert not math.isfinite(out[f"params.{param}"].reshape(-1)[idx])
    counters = ranks[0]["counters"][-1]
    assert counters["fallback_buckets"] == len(cfg["nonfinite"])
    assert counters["compressed_buckets"] == sum(map(len, buckets)) - len(cfg["nonfinite"])


def _chunk_bytes(layout_shapes, world, bits):
    """Bytes per chunk, from the format: 2 FP32 per column + packed codes + 1 flag, to x4.
    (For columns of one length: the largest stripe then has ceil(columns / world) of them.)"""
    lengths = [n for s in layout_shapes for n in column_lengths(s)]
    assert len(set(lengths)) == 1
    cols = -(-len(lengths) // world)
    return -(-(8 * cols + packed_size(cols * lengths[0], bits) + 1) // 4) * 4


@pytest.mark.multiprocess
@pytest.mark.parametrize(("name", "bits", "least_ratio"),
                         [("w2-big-1bit", 1, 30.0), ("w2-big-2bit", 2, 15.4),
                          ("w2-big-8bit", 8, 3.9), ("w3-big-1bit", 1, 30.0)])
def test_byte_counters(synthetic, name, bits, least_ratio):
    """Counters match the message format, and the ratio to an FP32 ring all-reduce is about
    32 / (bits + 64 / 1024) for columns of 1024 values."""
    world, _, shapes, _ = _inputs(name)
    ranks = _ranks(synthetic, name)
    chunk = _chunk_bytes(list(shapes.values()), world, bits)
    assert ranks[0]["chunk_bytes"] == [chunk]
    fp32_ring = 2 * (world - 1) * 4 * sum(math.prod(s) for s in shapes.values()) // world
    for k in range(world):
        counters = ranks[k]["counters"]
        # Step 1 also moves the aggregation residuals to the rebuilt bucket's stripes: from step 2
        # on, a step is exactly one all-to-all and one all-gather of (world - 1) chunks each.
        for before, after in itertools.pairwise(counters[1:]):
            assert after["bytes_sent"] - before["bytes_sent"] == 2 * (world - 1) * chunk
            assert after["bytes_received"] - before["bytes_received"] == 2 * (world - 1) * chunk
            assert after["uncompressed_bytes"] - before["uncompressed_bytes"] == fp32_ring
        ratio = fp32_ring / (2 * (world - 1) * chunk)
        assert least_ratio <= ratio <= 32 / bits
        assert counters[0]["bytes_sent"] == 2 * (world - 1) * chunk  # step 0: no extra traffic


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(RESUME_HOOKS))
def test_checkpoint_resumes_bit_for_bit(trained, name):
    for k, rank in enumerate(trained):
        full, resumed = rank["resume"][name]["full"], rank["resume"][name]["resumed"]
        assert resumed["losses"] == full["losses"][SAVE_AT:], f"rank {k}"
        for n, p in full["params"].items():
            assert torch.equal(resumed["params"][n], p), f"rank {k}, {n}"
        sd = rank["resume"][name]["state_dict"]
        # Counters continue from the checkpoint (bucket counts differ: a fresh DDP starts with
        # its initial buckets again, and the new layouts add a residual move to the bytes).
        saved = sd["ranks"][k]["counters"]
        assert resumed["counters"]["iter"] == full["counters"]["iter"] == RESUME_STEPS
        assert resumed["counters"]["uncompressed_buckets"] == saved["uncompressed_buckets"] > 0
        assert resumed["counters"]["compressed_buckets"] > saved["compressed_buckets"] > 0
        assert resumed["counters"]["uncompressed_bytes"] == full["counters"]["uncompressed_bytes"]
        assert sd["iter"] == SAVE_AT and sd["world_size"] == 2
        assert all(part["local"] and part["stripe"] for part in sd["ranks"])  # every rank's
    # Both ranks hold the same model.
    for n, p in trained[0]["resume"][name]["full"]["params"].items():
        assert torch.equal(trained[1]["resume"][name]["full"]["params"][n], p)


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", list(BAD_LOADS))
def test_bad_checkpoints_raise(trained, case):
    for rank in trained:
        got = rank["errors"][case]
        if BAD_LOADS[case] is None:
            assert got is None
        else:
            error, message = BAD_LOADS[case]
            assert got is not None, f"{case} loaded without error"
            assert got[0] == error and re.search(message, got[1]), got


@pytest.mark.multiprocess
@pytest.mark.parametrize("rule", ["zero-threshold", "range"])
def test_convergence_close_to_uncompressed(trained, rule):
    """A 2-process MLP regression (CONVERGE_TRAIN): 1-bit SGD ends within CONVERGE_RTOL of the
    uncompressed run's eval loss, far below where it started."""
    runs = trained[0]["converge"]
    base, ours = runs["fp32"], runs[rule]
    assert ours["eval_loss"] <= (1 + CONVERGE_RTOL) * base["eval_loss"], (ours["eval_loss"],
                                                                          base["eval_loss"])
    assert ours["eval_loss"] < 0.2 * ours["losses"][0]
    counters = ours["counters"]
    assert counters["uncompressed_buckets"] > 0 and counters["compressed_buckets"] > 0
    assert counters["fallback_buckets"] == 0


@pytest.mark.multiprocess
def test_edge_buckets_exist(synthetic):
    """The tiny scenarios (checked bit for bit above) really have buckets of 1 value and of odd
    sizes on 2 and 3 ranks, and an empty parameter; DDP never makes an empty bucket, so the hook
    is also called directly on one (and on a one-value bucket, compressed: exact)."""
    shapes = workers.TINY_SHAPES
    for name in ("w2-tiny", "w3-tiny"):
        if name not in synthetic:  # (NCCL: more ranks than GPUs)
            continue
        buckets = [b for step in synthetic[name][0]["layouts"] for b in step]
        sizes = {sum(math.prod(shapes[n.removeprefix("params.")]) for n in b) for b in buckets}
        assert {1, 3, 7, 123} <= sizes, (name, sizes)
        assert any("params.empty" in b for b in buckets)
        assert synthetic[name][0]["counters"][-1]["compressed_buckets"] > 0
    for world in (1, 2, 3):
        for rank in synthetic.get(f"direct-w{world}", ()):  # (NCCL: up to one rank per GPU)
            assert rank["empty"].shape == (0,)
            assert rank["one"].tolist() == [sum(k + 1.5 for k in range(world)) / world]
            assert rank["counters"]["compressed_buckets"] == 1


def test_unknown_fused_setting_is_refused_at_construction(monkeypatch):
    """``LOWPREC_FUSED`` decides what ``fused=None`` means; a value it does not know is refused
    when the state is built, not at the first compressed bucket inside ``backward()``."""
    monkeypatch.setenv("LOWPREC_FUSED", "sometimes")
    with pytest.raises(ValueError, match="LOWPREC_FUSED='sometimes'"):
        OneBitState(torch.nn.Linear(2, 2))
    OneBitState(torch.nn.Linear(2, 2), fused=False)  # an explicit choice does not read it


@pytest.mark.multiprocess
def test_fused_scenarios_ran_both_block_kinds(synthetic):
    """The compiled scenarios (equal to the simulation above) read blocks whose codes fill whole
    bytes straight from the packed bytes, and unpacked the others: both kinds ran, at 1 and 2
    bits (columns of 100 values fill whole bytes at 2 bits, not at 1; 35 values at neither)."""
    for name, bits in (("w2-fused-1bit", 1), ("w2-fused-bf16-2bit", 2)):
        ran_anywhere = set()
        for rank in _ranks(synthetic, name):
            assert rank["compiled"] is True
            ran = {kernel for kernel, b in rank["kernels"] if b == bits}
            assert {"encode", "pack_wide", "reaggregate_packed", "decode_packed", "unpack_wide",
                    "decode"} <= ran, ran
            ran_anywhere |= ran
        assert "reaggregate" in ran_anywhere  # a stripe with a block off byte boundaries


@pytest.mark.multiprocess
def test_pipelined_buckets_equal_one_at_a_time(synthetic):
    """The hook leaves its bucket in flight and moves the older ones on: after the first call of
    a step no future is complete, after the second none either (bucket 0's all-gather is still in
    flight), and the last bucket completes all three. Results, residuals and counters equal those
    of one bucket at a time, bit for bit; ``messages()`` describes the three layouts."""
    for world in (1, 2, 3):
        for rank in synthetic.get(f"direct-w{world}", ()):
            piped, single = rank["pipeline"]["pipelined"], rank["pipeline"]["one-by-one"]
            assert piped["done_after"] == [[False], [False, False], [True, True, True]] * 2
            assert single["done_after"] == [[True], [True, True], [True, True, True]] * 2
            for a, b in zip(piped["results"], single["results"], strict=True):
                assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
            _assert_same_state(piped["state"], single["state"])
            assert piped["counters"] == single["counters"]
            assert piped["compiled"] is False  # conftest: LOWPREC_FUSED=0
            messages = piped["messages"]
            assert [m["parameters"] for m in messages] == [["a"], ["b"], ["c"]]
            assert [m["values"] for m in messages] == [64 * 48, 40 * 96, 300]
            for m in messages:
                assert sum(m["stripes"]) == m["values"] and len(m["stripes"]) == world
                assert m["bytes_per_step"] == 2 * (world - 1) * m["chunk_bytes"]
                ring = 2 * (world - 1) * 4 * m["values"] // world
                assert m["uncompressed_bytes_per_step"] == ring
            sent = sum(m["bytes_per_step"] for m in messages)
            assert piped["counters"]["bytes_sent"] == 2 * sent  # two steps, all compressed


@pytest.mark.multiprocess
def test_residuals_follow_the_loss_scale(synthetic):
    """With ``loss_scaler=``, residuals are rescaled when the scale changes: gradients scaled by
    4, 32, 32, 0.5 give exactly the scaled outputs of the unscaled run (the quantizer commutes
    with powers of two), and the residuals end at 0.5x the unscaled run's. A state without a
    scaler that loads the scaled checkpoint rescales its residuals to 1: its next step equals the
    unscaled run's next step."""
    for world in (1, 2, 3):
        for rank in synthetic.get(f"direct-w{world}", ()):
            got = rank["scaled"]
            for scale, scaled, plain in zip(got["scales"], got["scaled"]["outputs"],
                                            got["plain"]["outputs"], strict=True):
                for a, b in zip(scaled, plain, strict=True):
                    assert torch.equal(a, b * scale)
            assert got["scaled"]["state"]["residual_scale"] == 0.5
            assert got["plain"]["state"]["residual_scale"] == 1.0
            for ra, rb in zip(got["scaled"]["state"]["ranks"], got["plain"]["state"]["ranks"],
                              strict=True):
                assert all(torch.equal(ra["local"][k], rb["local"][k] * 0.5) for k in ra["local"])
            for a, b in zip(got["resumed_output"], got["plain_next_output"], strict=True):
                assert torch.equal(a, b)


def _assert_same_state(a, b):
    for ra, rb in zip(a["ranks"], b["ranks"], strict=True):
        assert ra["local"].keys() == rb["local"].keys()
        assert all(torch.equal(ra["local"][k], rb["local"][k]) for k in ra["local"])
        assert ra["stripe"].keys() == rb["stripe"].keys()
        for k in ra["stripe"]:
            assert ra["stripe"][k]["offset"] == rb["stripe"][k]["offset"]
            assert torch.equal(ra["stripe"][k]["residual"], rb["stripe"][k]["residual"])


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["w2-1bit-zero", "w2-1bit-range-warmup", "w3-1bit-zero",
                                  "w2-big-2bit", "w3-tiny"])
def test_telescoping_identity(synthetic, name):
    """What was applied over all steps, plus the final residuals (the aggregation residual and
    the ranks' mean local residual), equals the sum of the true averaged gradients, to FP32
    rounding: error feedback loses nothing."""
    world, cfg, shapes, grads = _inputs(name)
    ranks = _ranks(synthetic, name)
    state = ranks[0]["state"]
    agg = _stripe_residuals(state, shapes)
    largest = 0.0
    for n in shapes:
        applied = sum(ranks[0]["outputs"][t][n].reshape(-1).double() for t in range(cfg["steps"]))
        local = sum(state["ranks"][k]["local"][n].double() for k in range(world)) / world
        true = sum(grads[t][k][n].reshape(-1).double() / world
                   for t in range(cfg["steps"]) for k in range(world))
        # Each step rounds a handful of FP32 operations on values about the size of the gradients.
        size = sum(grads[t][k][n].reshape(-1).double().abs() / world
                   for t in range(cfg["steps"]) for k in range(world))
        size = size + sum(ranks[0]["outputs"][t][n].reshape(-1).double().abs()
                          for t in range(cfg["steps"]))
        bound = 8 * world * EPS32 * size
        ok = ~true.isfinite() | ((applied + agg[n].double() + local - true).abs() <= bound)
        assert bool(ok.all()), (n, float((applied + agg[n].double() + local - true).abs().max()))
        if local.numel():
            largest = max(largest, float((agg[n].abs() + local.abs()).max()))
    assert largest > 0  # the residuals are not trivially zero


@pytest.mark.multiprocess
def test_nan_on_one_rank_skips_the_step_on_every_rank(trained):
    """Rank 1's NaN gradient in one bucket: that bucket is all-reduced uncompressed, so the loss
    scaler sees the NaN on every rank, every rank skips the step and backs off, the models stay
    identical, and the poisoned parameter's residuals are kept as they were."""
    step, param = SCALER_RUN["poison_step"], SCALER_RUN["poison_param"]
    a, b = (rank["scaler"] for rank in trained)
    expected = [t != step for t in range(SCALER_RUN["steps"])]
    assert a["stepped"] == expected and b["stepped"] == expected
    assert a["scales"][step] == a["scales"][step - 1] / 2 == b["scales"][step]
    for t in range(SCALER_RUN["steps"]):
        for n, p in a["params"][t].items():
            assert torch.equal(p, b["params"][t][n]), (t, n)
            if t == step:  # skipped: nothing moved
                assert torch.equal(p, a["params"][t - 1][n]), n
    for rank in (a, b):
        assert torch.equal(rank["residuals"][step][param], rank["residuals"][step - 1][param])
        moved = [n for n in rank["residuals"][step] if n != param and not torch.equal(
            rank["residuals"][step][n], rank["residuals"][step - 1][n])]
        assert moved, "the other buckets were compressed as usual"
        assert rank["counters"]["fallback_buckets"] == 1
        assert all(torch.isfinite(v).all() for v in rank["residuals"][-1].values())


@pytest.mark.multiprocess
@pytest.mark.parametrize(("mode", "message"),
                         [("kill", r"Connection reset|Connection closed|Timed out"),
                          ("stall", r"Timed out")])
def test_dead_rank_raises_on_the_others_not_hangs(tmp_path, mode, message):
    """Rank 1 of 3 is SIGKILLed (or stalls) after 3 steps; ranks 0 and 2 raise from backward()
    (gloo's error, or its timeout) within the group's timeout instead of hanging. (gloo only:
    the errors and timeouts checked are gloo's.)"""
    timeout_s = 4.0
    code = workers.run_dying(3, tmp_path, mode, timeout_s=timeout_s, die_after=3, wait_s=120)
    assert code == 0, "rank 0 hung or crashed"
    for r in (0, 2):
        got = torch.load(tmp_path / f"dying-{r}.pt", weights_only=False)
        assert got["steps"] == 3 and got["error"] is not None, got
        assert "RuntimeError" in got["error"][1] and re.search(message, got["error"][2]), got
        assert got["seconds"] < timeout_s + 3, got


@pytest.mark.multiprocess
def test_example_runs_under_torchrun(tmp_path, backend):
    """examples/ddp_onebit.py with ``torchrun --nproc-per-node 2`` on 127.0.0.1: trains with the
    hook and the loss scaler, saves a checkpoint, and resumes from it both ways: with the loss
    scaler, and without one (issue 22: the residuals, in units of the scaled gradient, drove that
    run to NaN). Rescaled by a power of two, the second resume ends where the first does. The
    example chooses its device itself (``--device auto``: NCCL only with a GPU per rank), so the
    gloo run leaves the choice to it where fewer than 2 GPUs are visible (a 1-GPU machine
    included) and asks for the CPU where 2 are; it says what it chose."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "examples" / "ddp_onebit.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    choice = "cpu" if backend == "gloo" and cuda_count() >= 2 else "auto"
    device = {"gloo": "cpu", "nccl": "cuda"}[backend]
    ckpt = tmp_path / "ckpt.pt"

    def torchrun(*args: str, scaler: bool = True) -> str:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
               "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(workers.free_port()), str(script), "--log-every", "5",
               "--warmup-steps", "3", "--device", choice, *(["--loss-scaler"] if scaler else []),
               *args]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, done.stdout + done.stderr
        assert f"device: {device}, backend {backend} (--device {choice}: " in done.stdout, (
            done.stdout)
        return done.stdout

    first = torchrun("--steps", "10", "--checkpoint", str(ckpt))
    assert re.search(r"done: 2 ranks, 10 steps .* skipped 0", first), first
    assert re.search(r"7 buckets compressed, 3 uncompressed, 0 fell back", first), first
    saved = torch.load(ckpt, weights_only=False)
    assert saved["step"] == 10 and saved["onebit"]["world_size"] == 2
    assert all(part["local"] for part in saved["onebit"]["ranks"])
    second = torchrun("--steps", "14", "--resume", str(ckpt))
    assert re.search(r"done: 2 ranks, 4 steps", second), second
    assert re.search(r"11 buckets compressed, 3 uncompressed", second), second
    unscaled = torchrun("--steps", "14", "--resume", str(ckpt), scaler=False)
    assert "saved with --loss-scaler and this run is without" in unscaled, unscaled
    eval_loss = re.compile(r"eval loss (\S+),")
    assert eval_loss.search(unscaled)[1] == eval_loss.search(second)[1], (second, unscaled)


def _example(name: str):
    """The module of ``examples/<name>.py``, imported from its file."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("example", ["ddp_onebit", "fsdp2_bf16"])
@pytest.mark.parametrize(
    ("gpus", "nccl", "env", "want", "expected"),
    [
        (1, True, {"LOCAL_WORLD_SIZE": "2"}, "auto", ("cpu", "gloo")),  # (2 ranks, 1 GPU)
        (2, True, {"LOCAL_WORLD_SIZE": "2"}, "auto", ("cuda:1", "nccl")),
        (8, True, {"LOCAL_WORLD_SIZE": "2"}, "auto", ("cuda:1", "nccl")),
        (0, True, {"LOCAL_WORLD_SIZE": "2"}, "auto", ("cpu", "gloo")),
        (2, False, {"LOCAL_WORLD_SIZE": "2"}, "auto", ("cpu", "gloo")),  # (no NCCL)
        (2, True, {"LOCAL_WORLD_SIZE": "2"}, "cpu", ("cpu", "gloo")),
        (2, True, {"LOCAL_WORLD_SIZE": "2"}, "cuda", ("cuda:1", "nccl")),
        (1, True, {"WORLD_SIZE": "2"}, "auto", ("cpu", "gloo")),  # (no LOCAL_WORLD_SIZE)
        (1, True, {"LOCAL_WORLD_SIZE": "2"}, "cuda", "a GPU per rank"),
        (0, True, {"LOCAL_WORLD_SIZE": "2"}, "cuda", "a GPU per rank"),
    ],
)
def test_examples_take_cuda_only_with_a_gpu_per_rank(example, gpus, nccl, env, want, expected,
                                                     monkeypatch):
    """The examples' device choice (``choose_device``) for rank 1 of 2 on a node, as the GPUs
    seen make it: NCCL and the rank's own GPU only where each rank has one (and NCCL exists),
    else gloo on the CPU (2 ranks on a 1-GPU machine: rank 1's GPU would not exist); ``--device
    cuda`` where the GPUs do not suffice is refused with the fix."""
    module = _example(example)
    for name in ("LOCAL_WORLD_SIZE", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LOCAL_RANK", "1")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: nccl)
    chosen = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    if isinstance(expected, str):
        with pytest.raises(SystemExit, match=expected):
            module.choose_device(want)
        assert not chosen
        return
    device, backend, why = module.choose_device(want)
    assert (str(device), backend) == expected
    assert chosen == ([1] if backend == "nccl" else [])
    assert why.startswith(f"--device {want}: {gpus} GPU(s) for 2 rank(s) on this node"), why
