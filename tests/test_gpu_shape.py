"""The step as a GPU takes it, shown on the CPU (``_as_a_gpu``: the CPU's two shortcuts off, the
pairs kernel and the loss scaler's check read on the host; every step already makes its numbers
on the device), so that what only a GPU would run is run here, against the eager step bit for
bit. No GPU has run the step since buckets: on one, a
group of small BF16 parameters with stochastic rounding raised "per-word random keys need the
fused step on pairs" at its first step, which ``test_every_configuration_steps_as_a_gpu_would``
showed on the CPU at once.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from lowprec import step_in_backward
from lowprec.optim import AdamW, Lamb, buckets, compiled, core, driver
from tests._cases import kernel_families
from tests._host import no_host_reads
from tests._same import assert_same
from tests._steps import full_steps

# (fused: a compiled step that falls back to eager fails the test, tests/_fallback.py)
pytestmark = pytest.mark.fused


def _as_a_gpu(monkeypatch):
    monkeypatch.setattr(compiled, "pairs_device", lambda device: False)
    monkeypatch.setattr(driver, "skipped_on_host", lambda *args, **kwargs: None)


def _adamw_kahan(params, **kw):
    return AdamW(params, lr=1e-2, weight_decay=0.1, master="kahan", fused=True, seed=3, **kw)


FAMILIES = kernel_families()
# Small matrices and vectors (gathered pieces), a matrix of whole blocks (8-bit codes, and a
# piece of its own: _GATHERED lowered to 4096 below), odd sizes (buckets of one).
SHAPES = [(64, 32)] * 3 + [(128,)] * 3 + [(64, 128), (7,), (33, 3)]


@pytest.mark.parametrize("name", list(FAMILIES.OPTIMIZERS))
def test_every_configuration_steps_as_a_gpu_would(name, monkeypatch):
    """Every master (kahan, split, stochastic) and state format (its own, 8-bit), plain and
    under a loss scaler, three steps under a learning-rate schedule, the GPU's way: the step
    through the buckets' prepared calls (pieces, views, numbers and keys made on the device)
    equals the eager step bit for bit. ``torch.compile`` is replaced by the function it
    compiles (the compiled kernels' own bits are ``tests/test_fused.py``'s): this is the
    step's plumbing, in seconds."""
    _as_a_gpu(monkeypatch)
    monkeypatch.setattr(torch, "compile", lambda fn, **_: fn)
    monkeypatch.setattr(compiled, "_KERNELS", {})
    monkeypatch.setitem(buckets._GATHERED, "cpu", 4096)
    cls, options = FAMILIES.OPTIMIZERS[name]
    for master in FAMILIES.MASTERS:
        for state in FAMILIES.STATES:
            for scaled in (False, True):
                runs = []
                for fused in (False, True):
                    gen = torch.Generator().manual_seed(0)
                    params = [(torch.randn(s, generator=gen) * 0.1).bfloat16().requires_grad_()
                              for s in SHAPES]
                    groups = params
                    if name == "muon":
                        groups = [{"params": [p for p in params if p.dim() == 2]},
                                  {"params": [p for p in params if p.dim() != 2],
                                   "use_muon": False}]
                    opt = cls(groups, master=master, state_dtype=state, fused=fused, seed=1,
                              **options)
                    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
                    for step in range(3):
                        for p in params:
                            p.grad = (torch.randn(p.shape, generator=gen)
                                      * (256 if scaled else 1)).bfloat16()
                        if scaled:  # (the second step sees an inf: skipped)
                            opt.step(grad_scale=torch.tensor(256.0),
                                     found_inf=torch.tensor(float(step == 1)))
                        else:
                            opt.step()
                        sched.step()
                    runs.append((params, opt))
                assert compiled._KERNELS, (master, state, scaled)  # (the fused run's)
                assert_same(*runs[0], *runs[1])


@pytest.mark.parametrize("master", FAMILIES.MASTERS)
def test_the_update_inside_backward_steps_as_a_gpu_would(master, monkeypatch):
    """The update inside backward, the GPU's way, for every optimizer: each large parameter's
    hook steps its piece with its own count's numbers made on the device, the small ones at
    the end of backward, bit for bit the normal step (``torch.compile`` replaced as above)."""
    from tests.test_in_backward import OPTIMIZERS, _train

    _as_a_gpu(monkeypatch)
    monkeypatch.setattr(torch, "compile", lambda fn, **_: fn)
    monkeypatch.setattr(compiled, "_KERNELS", {})
    for name in sorted(OPTIMIZERS):
        ref = _train(name, False, master=master, fused=True)
        got = _train(name, True, master=master, fused=True)
        assert_same(*got, *ref)


def test_the_update_inside_backward_gathers_the_small_parameters_on_the_device(monkeypatch):
    """The GPU's way, the small parameters the end of backward steps share their bucket with the
    large ones their hooks stepped: the bucket knows their counts are still equal (its marks)
    and gathers them, a call for each run of them (here the two on either side of the large
    one), where it made a call per parameter while it could only ask whether every count was
    the same. No value is read on the host after the first step."""
    from tests.test_in_backward import _model, _optimizer

    model = _model()
    opt = _optimizer("adamw", model, master="kahan", fused=True, capturable=True)
    step_in_backward(model, opt)
    pieces = []
    real = buckets._Bucket._run
    monkeypatch.setattr(buckets._Bucket, "_run", lambda self, o, a, b, *rest: (
        pieces.append(b - a), real(self, o, a, b, *rest))[1])
    for step in range(3):
        pieces.clear()
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(step)).bfloat16()
        with contextlib.nullcontext() if step == 0 else no_host_reads():
            model(x).float().square().mean().backward()
            opt.step()
    (bucket,) = core.stages(opt).buckets.buckets
    assert len(bucket.params) == 8 and bucket.sizes[2] == 300 * 256
    assert pieces == [1, 2, 5], pieces  # (the hook's; the end's two runs)


def test_a_bucket_on_the_device_steps_each_parameter_where_counts_differ(monkeypatch):
    """The GPU's way under a loss scaler (``_as_a_gpu``), a step where a parameter has no gradient and the steps after it, whose counts differ, go
    through the bucket as it was laid out, each run of equal counts with its first count's
    numbers: no full step and no layout again, the counts read on the host only at the first
    step (which counts are equal is then kept from the steps: ``_Bucket.count_marks``), skipped steps
    included, and the bits of the full step."""
    _as_a_gpu(monkeypatch)
    calls = {"flatten": 0, "full_step": 0}
    for name in calls:
        real = getattr(driver, name)
        monkeypatch.setattr(driver, name, lambda *a, _n=name, _f=real: (
            calls.__setitem__(_n, calls[_n] + 1), _f(*a))[1])
    runs = []
    for use in (False, True):
        gen = torch.Generator().manual_seed(0)
        params = [torch.randn(s, generator=gen).bfloat16().requires_grad_()
                  for s in [(32, 4), (64,), (16, 6)]]
        opt = _adamw_kahan(params, capturable=True)
        for step in range(6):
            for k, p in enumerate(params):
                p.grad = (None if step == 1 and k == 1
                          else torch.randn(p.shape, generator=gen).bfloat16() * 4)
            kw = {"grad_scale": torch.tensor(4.0), "found_inf": torch.tensor(float(step == 4))}
            if not use:
                with full_steps():
                    opt.step(**kw)
                continue
            if step == 1:
                calls.update(flatten=0, full_step=0)
            with contextlib.nullcontext() if step == 0 else no_host_reads():
                opt.step(**kw)
        runs.append((params, opt))
    assert calls == {"flatten": 0, "full_step": 0}, calls
    (bucket,) = core.stages(runs[1][1]).buckets.buckets
    assert len(bucket.params) == 3 and bucket.runs([p.grad for p in bucket.params],
                                                    bucket.count_marks()) == [(0, 1), (1, 2), (2, 3)]
    assert [float(runs[1][1].state[p]["step"]) for p in runs[1][0]] == [5, 4, 5]
    assert_same(*runs[0], *runs[1])


@pytest.mark.parametrize("make", [
    lambda ps, fused: AdamW(ps, lr=1e-2, master="stochastic", fused=fused, seed=5),
    lambda ps, fused: Lamb(ps, lr=1e-2, master="stochastic", fused=fused, seed=5),
], ids=["adamw", "lamb"])
def test_stochastic_rounding_off_the_cpu_gathers_small_parameters(make, monkeypatch):
    """Off the CPU there is no pairs kernel (``compiled.pairs_device``, patched off here): a gathered piece's per-word random keys go into the
    elementwise kernel (``update._random_bits``' ``owner`` and ``idx``; such a piece raised a
    ValueError before), bit for bit the eager step, and the step's calls stay a few per
    bucket (LAMB's as rows of one size)."""
    _as_a_gpu(monkeypatch)
    runs = []
    for fused in (False, True):
        gen = torch.Generator().manual_seed(0)
        params = [torch.randn(s, generator=gen).bfloat16().requires_grad_()
                  for s in [(32, 4), (64,), (16, 8), (8, 8)]]
        opt = make(params, fused)
        for _ in range(3):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen).bfloat16()
            opt.step()
        runs.append((params, opt))
    assert [len(b.params) for b in core.stages(runs[1][1]).buckets.buckets] == [4]
    assert_same(*runs[0], *runs[1])
