"""Compensated gradient accumulation (``lowprec.accumulate``) against the exact sum.

The reference: each micro-batch's BF16 gradient computed on its own (what autograd hands the
accumulation), summed in FP64. Autograd's own accumulation rounds the running sum every time.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import lowprec
from lowprec import accumulate
from tests import _dist_workers as workers

MICRO = 16


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 32)).to(torch.bfloat16)


def _batches(n: int = MICRO) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [((torch.randn(8, 64, generator=g) * torch.exp(torch.randn(1, generator=g)))
             .bfloat16(), torch.randn(8, 32, generator=g)) for _ in range(n)]


def _loss(model, x, y):
    return (model(x).float() - y).pow(2).mean()


def _exact(model, batches) -> dict[str, torch.Tensor]:
    """Each micro-batch's gradient on its own (as autograd makes it), summed in FP64."""
    total: dict[str, torch.Tensor] = {}
    for x, y in batches:
        m = copy.deepcopy(model)
        _loss(m, x, y).backward()
        for n, p in m.named_parameters():
            total[n] = total.get(n, 0) + p.grad.double()
    return total


def _accumulated(model, batches, how=None) -> dict[str, torch.Tensor]:
    m = copy.deepcopy(model)
    handle = accumulate(m, how=how) if how else None
    for x, y in batches:
        _loss(m, x, y).backward()
    if handle is not None:
        handle.remove()
    return {n: p.grad.clone() for n, p in m.named_parameters()}


def _ulps(got: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """|got - exact| in units of the BF16 spacing at ``exact`` (8 significant bits)."""
    mag = exact.abs().clamp_min(2.0 ** -126)
    spacing = 2.0 ** (torch.floor(torch.log2(mag)) - 7)
    return (got.double() - exact).abs() / spacing


def test_sixteen_micro_batches_end_within_one_bf16_rounding_of_the_exact_sum():
    model, batches = _model(), _batches()
    exact = _exact(model, batches)
    errors = {}
    for how in (None, "kahan", "fp32"):
        got = _accumulated(model, batches, how)
        ulps = torch.cat([_ulps(got[n], exact[n]).view(-1) for n in exact])
        rel = torch.cat([((got[n].double() - exact[n]).abs() / exact[n].abs()).view(-1)
                         for n in exact])
        errors[how or "plain"] = (rel.median().item(), (ulps <= 0.5 + 1e-6).float().mean().item())
    # Measured: autograd's own accumulation (plain) has a median relative error of ~4e-3 and
    # rounds ~60% of the elements away from the correctly rounded sum; the FP32 accumulator
    # gives the exact sum rounded once (FP32's own rounding of 16 terms is far below BF16's);
    # Kahan with a BF16 compensation matches it on all but a few elements whose sum cancels.
    plain_median, plain_ok = errors["plain"]
    assert plain_median > 1e-3 and plain_ok < 0.6, errors
    fp32_median, fp32_ok = errors["fp32"]
    assert fp32_ok == 1.0 and fp32_median < plain_median / 2, errors
    kahan_median, kahan_ok = errors["kahan"]
    assert kahan_ok > 0.995 and kahan_median < plain_median / 2, errors


@pytest.mark.parametrize("how", ["fp32", "kahan"])
def test_zero_grad_either_way_starts_a_new_sum(how):
    model, batches = _model(), _batches(6)
    m = copy.deepcopy(model)
    handle = accumulate(m, how=how)
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    for set_to_none in (True, False):
        for x, y in batches[:3]:
            _loss(m, x, y).backward()
        opt.zero_grad(set_to_none=set_to_none)
        for x, y in batches[3:]:
            _loss(m, x, y).backward()
        exact = _exact(model, batches[3:])
        for n, p in m.named_parameters():
            assert (_ulps(p.grad, exact[n]) <= 0.5 + 1e-6).float().mean() > 0.99, (how, n)
        opt.zero_grad()
    assert handle.bytes() == sum(p.numel() for p in m.parameters()) * (4 if how == "fp32" else 2)


def test_under_a_loss_scaler_and_the_optimizer_step():
    # Scaled micro-batches accumulate as the scaled sum; the step unscales it (lowprec's
    # optimizer writes the unscaled gradient back, a new sum then starts); a one-step-per-
    # micro-batch loop is unchanged by it.
    model, batches = _model(), _batches(4)
    exact = _exact(model, batches)
    m = copy.deepcopy(model)
    accumulate(m)
    opt = lowprec.AdamW(m.parameters(), lr=0.0, master="kahan")
    scaler = lowprec.LossScaler(init_scale=2.0 ** 10)
    for x, y in batches:
        scaler.scale(_loss(m, x, y)).backward()
    for n, p in m.named_parameters():
        scaled = exact[n] * 2.0 ** 10
        assert (_ulps(p.grad, scaled) <= 0.5 + 1e-6).all(), n
    scaler.step(opt)
    scaler.update()
    for n, p in m.named_parameters():  # (unscaled by the step: by a power of two, exactly)
        assert (_ulps(p.grad, exact[n]) <= 0.5 + 1e-6).all(), n
    opt.zero_grad()
    x, y = batches[0]
    scaler.scale(_loss(m, x, y)).backward()
    one = _exact(m, [batches[0]])
    for n, p in m.named_parameters():
        assert torch.equal(p.grad.double(), one[n] * scaler.get_scale()), n


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="how must be one of 'fp32', 'kahan'"):
        accumulate(_model(), how="fp16")
    with pytest.raises(ValueError, match="no BF16 or FP16 parameter"):
        accumulate(nn.Linear(3, 3))
    with pytest.raises(TypeError, match="takes a module or tensors"):
        accumulate([1.0])


def test_memory_reports_the_accumulation_buffers():
    from lowprec import memory

    m = _model()
    handle = accumulate(m, how="kahan")
    report = memory.measure(m, accumulator=handle, assume_grads=True)
    assert report.bytes_per_param["accumulation"] == 2.0
    assert report.bytes_per_param["total"] == pytest.approx(6.0)


@pytest.mark.multiprocess
def test_ddp_no_sync_all_reduces_the_compensated_sum(tmp_path):
    """2 gloo ranks, DDP with ``no_sync()`` for 7 micro-batches and a synced 8th: the
    all-reduced gradient is the mean of the ranks' compensated sums (each within one BF16
    rounding of its exact sum), and gradient_as_bucket_view=True is refused clearly."""
    workers.launch(workers.worker_accumulate, 2, tmp_path, {})
    for r in range(2):
        got = torch.load(tmp_path / f"accumulate-{r}.pt", weights_only=False)
        assert got["local_ok"] == 1.0, got
        assert got["synced_ok"] == 1.0, got
        assert "gradient_as_bucket_view=False" in got["view_error"], got
