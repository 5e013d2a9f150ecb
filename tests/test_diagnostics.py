"""gradient_range against counts made value by value, and against actual FP16/BF16 casts."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lowprec.diagnostics import gradient_range


def _param_with_grad(values, dtype=torch.float32):
    p = nn.Parameter(torch.zeros(len(values), dtype=dtype))
    p.grad = torch.tensor(values, dtype=torch.float64).to(dtype)
    return p


def test_counts_match_a_value_by_value_reference():
    gen = torch.Generator().manual_seed(0)
    # log-uniform magnitudes from 2**-140 to 2**20, random signs, some zeros
    mags = torch.exp2(torch.empty(4000, dtype=torch.float64).uniform_(-140, 20, generator=gen))
    vals = (mags * torch.randint(0, 2, (4000,), generator=gen).mul(2).sub(1)).tolist()
    vals[:50] = [0.0] * 50
    p = _param_with_grad(vals)
    scale = 2.0**10
    r = gradient_range([p], scale=scale)
    g = [abs(float(v)) for v in p.grad.tolist()]
    n = len(g)
    assert r.numel == n
    assert r.zero == sum(v == 0 for v in g) / n
    assert r.fp16_underflow == sum(0 < v < 2**-24 for v in g) / n
    assert r.fp16_subnormal == sum(2**-24 <= v < 2**-14 for v in g) / n
    assert r.bf16_underflow == sum(0 < v < 2**-133 for v in g) / n
    assert r.fp16_overflow_at_scale == sum(v * scale > 65504 for v in g) / n
    assert r.fp16_underflow_at_scale == sum(0 < v * scale < 2**-24 for v in g) / n
    assert r.max_abs == max(g)
    assert r.recommended_scale == 2.0 ** math.floor(math.log2(65504 / 2 / max(g)))


def test_underflow_fraction_agrees_with_an_actual_fp16_cast():
    # values strictly between 2**-25 and 2**-24 round up to the smallest subnormal: the
    # reported fraction (below 2**-24) bounds what a cast actually flushes from above.
    gen = torch.Generator().manual_seed(1)
    g = torch.exp2(torch.empty(10000).uniform_(-40, 0, generator=gen))
    p = _param_with_grad(g.tolist())
    r = gradient_range(p)
    flushed = float((p.grad.half() == 0).double().mean())
    assert flushed <= r.fp16_underflow <= flushed + float(
        ((g >= 2**-25) & (g < 2**-24)).double().mean()
    )


def test_recommended_scale_keeps_the_largest_gradient_finite_in_fp16():
    p = _param_with_grad([3e-3, -7.5e-2, 1e-9])
    r = gradient_range(p)
    scaled = p.grad * r.recommended_scale
    assert torch.isfinite(scaled.half()).all()
    assert float(scaled.abs().max()) <= 65504 / 2
    assert float(scaled.abs().max()) * 2 > 65504 / 2 / 2  # the largest such power of two


def test_module_input_nonfinite_and_all_zero():
    model = nn.Linear(3, 2)
    model.weight.grad = torch.tensor([[0.0, float("inf"), 1.0], [float("nan"), 0.0, 0.0]])
    model.bias.grad = torch.zeros(2)
    r = gradient_range(model)
    assert r.numel == 8 and r.nonfinite == 2 / 8 and r.max_abs == 1.0
    model.weight.grad.zero_()
    assert gradient_range(model).recommended_scale == 1.0


@pytest.mark.parametrize(
    "source, kwargs, error, match",
    [
        (nn.Linear(2, 2), {}, ValueError, "call loss.backward"),
        (3, {}, TypeError, "takes a module"),
        ([torch.zeros(2)], {"scale": 0}, ValueError, "scale must be"),
        ([torch.zeros(2)], {"headroom": 0.5}, ValueError, "headroom must be"),
    ],
)
def test_bad_input(source, kwargs, error, match):
    with pytest.raises(error, match=match):
        gradient_range(source, **kwargs)
