"""The loss-scaler contract of the optimizer step: ``grad_scale`` and ``found_inf`` as tensors.

A scaled step must give the same bits as an unscaled step on the unscaled gradients (the scales
are powers of two, so unscaling is exact), a step with an inf/NaN anywhere must leave every
parameter and state tensor bit-identical, and none of it may read a value on the host.

Tests that take ``device`` run there (the CPU, and CUDA where present: the ``device`` fixture),
with the scaler's tensors on that device too. Every step keeps its counts on the device and makes
its numbers there, as a GPU's does.
"""

from __future__ import annotations

import sys

import pytest
import torch

from lowprec.optim import SGD, Adagrad, AdamW, Lamb, core
from tests._cases import axes
from tests._host import no_host_reads
from tests._steps import full_steps

# A compiled step that falls back to eager fails these tests (tests/_fallback.py).
pytestmark = [pytest.mark.fused]

OPTIMIZERS = {
    "sgd": (SGD, dict(lr=0.05, momentum=0.9, weight_decay=1e-3)),
    "adamw": (AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "adagrad": (Adagrad, dict(lr=0.05, lr_decay=1e-2)),
    "lamb": (Lamb, dict(lr=1e-2, weight_decay=0.01)),
}
MASTERS = ["none", "fp32", "split", "kahan", "stochastic"]
SHAPES = [(33, 17), (5,), (0,), (1,)]


def _params(dtype, device="cpu"):
    torch.manual_seed(7)
    return [torch.randn(s, dtype=torch.float32).to(dtype).to(device).requires_grad_()
            for s in SHAPES]


def _snapshot(params, opt):
    out = [p.detach().clone() for p in params]
    for p in params:
        for _k, v in sorted(opt.state[p].items()):
            out.append(v.clone() if isinstance(v, torch.Tensor) else v)
    return out


def _assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y)
        else:
            assert x == y


def _grads(step, dtype, device="cpu"):
    gen = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(s, generator=gen).to(dtype).to(device) for s in SHAPES]


def _run(name, master, *, fused, scaled, steps=8, bad_steps=(), as_kwargs=True, device="cpu"):
    cls, hp = OPTIMIZERS[name]
    dtype = torch.float32 if master in ("none",) else torch.bfloat16
    params = _params(dtype, device)
    opt = cls(params, master=master, fused=fused, seed=3, **hp)
    found_log = []
    for step in range(steps):
        scale = 2.0 ** (4 + step % 5)
        grads = _grads(step, dtype, device)
        for p, g in zip(params, grads, strict=True):
            p.grad = (g.float() * scale).to(dtype) if scaled else g
        if not scaled:
            opt.step()
            continue
        # A bad step: inject inf/NaN in some gradient and check nothing changes.
        if step in bad_steps:
            params[step % 2].grad.view(-1)[3] = float("nan") if step % 3 else float("inf")
            before = _snapshot(params, opt)
        found = torch.zeros((), device=device)
        if as_kwargs:
            opt.step(grad_scale=torch.tensor(scale, device=device), found_inf=found)
        else:  # the attributes torch.amp.GradScaler sets
            opt.grad_scale, opt.found_inf = torch.tensor(scale, device=device), found
            opt.step()
            del opt.grad_scale, opt.found_inf
        found_log.append(float(found))
        if step in bad_steps:
            _assert_same(_snapshot(params, opt), before)
            # and the same gradients, clean, are stepped normally below
            for p, g in zip(params, grads, strict=True):
                p.grad = (g.float() * scale).to(dtype)
            opt.step(grad_scale=torch.tensor(scale, device=device),
                     found_inf=torch.zeros((), device=device))
    return params, opt, found_log


@pytest.mark.parametrize("master", MASTERS)
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_scaled_step_equals_unscaled_bitwise_and_skips_cleanly(name, master, device):
    ref_params, ref_opt, _ = _run(name, master, fused=False, scaled=False, device=device)
    params, opt, found = _run(name, master, fused=False, scaled=True, bad_steps=(2, 5),
                              device=device)
    assert found == [1.0 if s in (2, 5) else 0.0 for s in range(8)]
    _assert_same(_snapshot(params, opt), _snapshot(ref_params, ref_opt))


@pytest.mark.slow
@pytest.mark.parametrize("master", ["split", "kahan", "stochastic"])
@pytest.mark.parametrize("name", ["sgd", "adamw", "lamb"])
def test_fused_scaled_step_equals_eager(name, master, device):
    eager_params, eager_opt, f1 = _run(name, master, fused=False, scaled=True, bad_steps=(3,),
                                       device=device)
    params, opt, f2 = _run(name, master, fused=True, scaled=True, bad_steps=(3,), device=device)
    assert f1 == f2
    _assert_same(_snapshot(params, opt), _snapshot(eager_params, eager_opt))


@pytest.mark.parametrize(("name", "master"),
                         axes(sorted(OPTIMIZERS), MASTERS, at=("adamw", "stochastic")))
def test_scaled_buckets_of_small_parameters_step_as_each_alone(name, master, monkeypatch):
    # Small parameters share a bucket's compiled call under a loss scaler too (parameters of
    # even length, so that stochastic rounding takes them as well; LAMB's as rows); each by its
    # own full step (full_steps) is the reference. Skipped steps included, the bits agree.
    # Every optimizer with stochastic rounding (each parameter's own random bits inside the
    # shared call) and AdamW with every master (tests/_cases.py: axes).
    monkeypatch.setattr(sys.modules[__name__], "SHAPES", [(32, 18), (6,), (4, 4), (0,), (1,)])
    params, opt, found = _run(name, master, fused=True, scaled=True, bad_steps=(2, 5))
    assert core.stages(opt).buckets.buckets
    with full_steps():
        alone_params, alone_opt, alone_found = _run(
            name, master, fused=True, scaled=True, bad_steps=(2, 5)
        )
    assert found == alone_found == [1.0 if s in (2, 5) else 0.0 for s in range(8)]
    _assert_same(_snapshot(params, opt), _snapshot(alone_params, alone_opt))


def test_attributes_set_by_grad_scaler_work_like_keywords(device):
    a, oa, fa = _run("adamw", "kahan", fused=False, scaled=True, bad_steps=(1,), device=device)
    b, ob, fb = _run("adamw", "kahan", fused=False, scaled=True, bad_steps=(1,), as_kwargs=False,
                     device=device)
    assert fa == fb
    _assert_same(_snapshot(a, oa), _snapshot(b, ob))


def test_found_inf_already_set_skips_without_looking(device):
    params = _params(torch.bfloat16, device)
    opt = AdamW(params, master="kahan")
    for p in params:
        p.grad = torch.ones_like(p)
    before = _snapshot(params, opt)
    found = torch.ones((), device=device)
    opt.step(found_inf=found)
    assert float(found) == 1.0
    after = _snapshot(params, opt)
    # state was created (zeros, step 0) but every parameter is unchanged and no step counted
    assert all(torch.equal(x, y) for x, y in zip(before, after[: len(params)], strict=False))
    assert all(float(opt.state[p]["step"]) == 0 for p in params)


def test_grad_scale_alone_unscales_and_checks(device):
    p = torch.zeros(4, device=device, requires_grad=True)
    opt = SGD([p], lr=1.0, master="none")
    p.grad = torch.full((4,), 8.0, device=device)
    opt.step(grad_scale=8.0)
    assert torch.equal(p.detach().cpu(), torch.full((4,), -1.0))
    p.grad = torch.tensor([1.0, float("-inf"), 0.0, 0.0], device=device)
    opt.step(grad_scale=torch.tensor(2.0, device=device))
    assert torch.equal(p.detach().cpu(), torch.full((4,), -1.0))
    assert float(opt.state[p]["step"]) == 1


def _torch_scaler_run(make_opt, *, unscale_and_clip, dtype=torch.float32, device="cpu"):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    model.to(dtype).to(device)
    opt = make_opt(model.parameters())
    scaler = torch.amp.GradScaler(device, init_scale=2.0**14, growth_interval=3)
    scales = []
    for i in range(14):
        x = torch.randn(16, 8, dtype=dtype).to(device)
        loss = model(x).float().pow(2).mean()
        if i in (4, 5, 10):
            loss = loss * float("inf")
        opt.zero_grad()
        scaler.scale(loss).backward()
        if unscale_and_clip:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales, [p.detach().float().cpu() for p in model.parameters()]


@pytest.mark.parametrize("unscale_and_clip", [False, True])
@pytest.mark.parametrize(
    "ours, theirs",
    [
        (lambda ps: AdamW(ps, lr=1e-2, master="none"),
         lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False)),
        (
            lambda ps: SGD(ps, lr=0.1, momentum=0.9, master="none"),
            lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=False),
        ),
    ],
    ids=["adamw", "sgd"],
)
def test_torch_grad_scaler_drives_lowprec_like_torch_optim(ours, theirs, unscale_and_clip,
                                                           device):
    s1, p1 = _torch_scaler_run(theirs, unscale_and_clip=unscale_and_clip, device=device)
    s2, p2 = _torch_scaler_run(ours, unscale_and_clip=unscale_and_clip, device=device)
    assert s1 == s2  # the same steps were skipped
    for a, b in zip(p1, p2, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_torch_grad_scaler_with_fp16_weights_and_fp32_master(device):
    # torch.amp.GradScaler refuses to unscale FP16 gradients for torch optimizers; through the
    # contract the lowprec optimizer unscales inside its FP32 update instead.
    scales, params = _torch_scaler_run(
        lambda ps: AdamW(ps, lr=1e-2, master="fp32"), unscale_and_clip=False, dtype=torch.float16,
        device=device,
    )
    assert scales[4] < scales[3] and all(torch.isfinite(p).all() for p in params)




@pytest.mark.parametrize(
    "fused", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "fused"]
)
@pytest.mark.parametrize("master", ["kahan", "stochastic", "split"])
def test_scaled_step_never_reads_a_value_on_the_host(master, fused, monkeypatch, device):
    # What a GPU step does: step counts read and used on the device, the buckets' numbers made
    # there from their one count. (On the CPU, where a host read is no synchronisation, the
    # default step reads the counts and the inf/NaN finding there; capturable reads neither.)
    params = _params(torch.bfloat16, device)
    opt = AdamW(params, master=master, fused=fused, capturable=True)
    for step in range(3):
        for p, g in zip(params, _grads(step, torch.bfloat16, device), strict=True):
            p.grad = g * 64
        scale, found = torch.tensor(64.0, device=device), torch.zeros((), device=device)
        if step == 0:  # warm up: state creation and compilation may read shapes, not values
            opt.step(grad_scale=scale, found_inf=found)
            continue
        with no_host_reads():
            opt.step(grad_scale=scale, found_inf=found)
    assert all(float(opt.state[p]["step"]) == 3 for p in params if p.numel())


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(grad_scale=torch.ones(2)), TypeError, "grad_scale must be a one-element"),
        (dict(grad_scale=torch.ones((), dtype=torch.int64)), TypeError, "grad_scale"),
        (dict(grad_scale=-2.0), ValueError, "positive and finite"),
        (dict(grad_scale=float("inf")), ValueError, "positive and finite"),
        (dict(grad_scale="2"), TypeError, "grad_scale must be a number"),
        (dict(found_inf=torch.zeros((), dtype=torch.int32)), TypeError, "found_inf must be"),
        (dict(found_inf=torch.zeros(3)), TypeError, "found_inf must be"),
    ],
)
def test_bad_scaler_inputs_raise_and_change_nothing(kwargs, error, match, device):
    params = _params(torch.bfloat16, device)
    opt = AdamW(params, master="kahan")
    for p, g in zip(params, _grads(0, torch.bfloat16, device), strict=True):
        p.grad = g
    opt.step()
    before = _snapshot(params, opt)
    kwargs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    with pytest.raises(error, match=match):
        opt.step(**kwargs)
    _assert_same(_snapshot(params, opt), before)


def test_scaled_run_resumes_from_a_checkpoint_bitwise(device):
    full_params, full_opt, _ = _run("adamw", "stochastic", fused=False, scaled=True, steps=6,
                                    device=device)
    params, opt, _ = _run("adamw", "stochastic", fused=False, scaled=True, steps=3, device=device)
    saved_p = [p.detach().clone() for p in params]
    saved = opt.state_dict()
    fresh = [p.clone().detach().requires_grad_() for p in saved_p]
    cls, hp = OPTIMIZERS["adamw"]
    opt2 = cls(fresh, master="stochastic", seed=3, **hp)
    opt2.load_state_dict(saved)
    for step in range(3, 6):
        scale = 2.0 ** (4 + step % 5)
        for p, g in zip(fresh, _grads(step, torch.bfloat16, device), strict=True):
            p.grad = (g.float() * scale).bfloat16()
        opt2.step(grad_scale=torch.tensor(scale, device=device),
                  found_inf=torch.zeros((), device=device))
    _assert_same(_snapshot(fresh, opt2), _snapshot(full_params, full_opt))


FAMILY = {  # the optimizers beside the four above, under the loss-scaler contract
    "adam": ("Adam", dict(lr=1e-2, weight_decay=0.1)),
    "radam": ("RAdam", dict(lr=1e-2, weight_decay=0.1)),
    "lion": ("Lion", dict(lr=1e-3, weight_decay=0.1)),
    "stableadamw": ("StableAdamW", dict(lr=1e-2, weight_decay=0.1)),
    "adafactor": ("Adafactor", dict(lr=1e-2, weight_decay=0.1)),
    "muon": ("Muon", dict(lr=1e-2, weight_decay=0.1)),
}


@pytest.mark.parametrize(("name", "master"), [
    (name, ("kahan", "stochastic")[i % 2]) for i, name in enumerate(sorted(FAMILY))])
def test_family_scaled_step_with_counts_on_the_device_equals_unscaled(name, master, monkeypatch,
                                                                      device):
    # The GPU's way for the six: each group's numbers made at once from its parameters' counts
    # on the device (param_step.step_numbers_many), on the default (compiled) path. The numbers
    # are the rule's, whatever the master: each optimizer takes one of the two, in turn.
    import lowprec.optim as lo

    monkeypatch.setitem(OPTIMIZERS, name, (getattr(lo, FAMILY[name][0]), FAMILY[name][1]))
    if name == "muon":  # (matrices only)
        monkeypatch.setattr(sys.modules[__name__], "SHAPES", [(33, 17), (6, 5)])
    ref_params, ref_opt, _ = _run(name, master, fused=True, scaled=False, device=device)
    params, opt, found = _run(name, master, fused=True, scaled=True, bad_steps=(2, 5),
                              device=device)
    assert found == [1.0 if s in (2, 5) else 0.0 for s in range(8)]
    _assert_same(_snapshot(params, opt), _snapshot(ref_params, ref_opt))


@pytest.mark.parametrize("fused", [False, True])
def test_scaled_step_makes_each_groups_numbers_once(fused, monkeypatch, device):
    # With the counts on the device, a step's numbers are made per group (one vector operation
    # per number for all its parameters), not once per parameter: on a GPU each of those
    # operations is a kernel launch, and per parameter they were most of the step. Through
    # buckets: from each bucket's one count, per group: the first group's bucket of three
    # parameters, the second group's two buckets of one (an odd size, and a size alone).
    torch.manual_seed(0)
    params = [torch.randn(s, device=device, dtype=torch.bfloat16, requires_grad=True)
              for s in [(16, 8), (8,), (4, 4), (3,), (300,)]]
    opt = AdamW([{"params": params[:3]}, {"params": params[3:], "lr": 1e-3}], lr=1e-2,
                master="kahan", fused=fused)
    calls = []
    real = opt._coefficients

    def counted(group, step):
        calls.append(tuple(step.shape) if isinstance(step, torch.Tensor) else step)
        return real(group, step)

    opt._coefficients = counted
    for step in range(4):
        for p in params:
            p.grad = torch.full_like(p, 0.01 * (step + 1))
        calls.clear()
        opt.step(grad_scale=torch.tensor(2.0, device=device),
                 found_inf=torch.zeros((), device=device))
        if step > 0:  # (the first step creates the state: its numbers come one by one)
            assert sorted(calls) == [(1,), (2,)], calls
    assert all(float(opt.state[p]["step"]) == 4 for p in params)


@pytest.mark.parametrize(("dtype", "scale", "in_kernels"), [
    (torch.bfloat16, 256.0, False), (torch.float32, 2.0**-3, False),
    (torch.bfloat16, 3.0, True), (torch.float16, 256.0, True),
], ids=["bf16-pow2", "fp32-pow2", "bf16-three", "fp16-pow2"])
def test_cpu_scaled_steps_unscale_in_place_only_where_that_is_exact(dtype, scale, in_kernels,
                                                                    monkeypatch):
    """On the CPU a scaled step whose unscaled gradients are exact in their own dtype (BF16 or
    FP32 and a power-of-two scale) is the plain step on gradients unscaled in place
    (loss_scale.skipped_on_host: the plain step's kernels); a scale of 3, or FP16 gradients
    (which would lose what only the scale kept), take the kernels that unscale in FP32. Either
    way the gradients come back as GradScaler's unscale_ leaves them, and a skipped step writes
    nothing. (Kernels' names counted, nothing compiled: the bits are the tests' above.)"""
    from lowprec.optim import compiled

    monkeypatch.setattr(torch, "compile", lambda fn, **_: fn)
    monkeypatch.setattr(compiled, "_KERNELS", {})
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(64, 32, generator=gen).to(dtype).requires_grad_()
    opt = AdamW([p], lr=1e-2, master="kahan" if dtype != torch.float32 else "none", fused=True)
    inv = torch.tensor(scale, dtype=torch.float64).reciprocal().float()
    for bad in (False, True):
        p.grad = (torch.randn(64, 32, generator=gen) * scale).to(dtype)
        if bad:
            p.grad[3, 4] = float("inf")
        expected = (p.grad.float() * inv).to(dtype)
        before = (p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()
                                       if isinstance(v, torch.Tensor)})
        found = torch.zeros(())
        opt.step(grad_scale=torch.tensor(scale), found_inf=found)
        assert torch.equal(p.grad, expected) and float(found) == float(bad)
        if bad:  # (nothing written, the count included)
            assert torch.equal(p, before[0])
            assert all(torch.equal(v, opt.state[p][k]) for k, v in before[1].items())
    names = [k.name for k in compiled._KERNELS.values()]
    assert names and all(("_unscale_" in n) == in_kernels for n in names), names
