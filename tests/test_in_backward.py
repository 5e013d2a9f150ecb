"""lowprec.step_in_backward: each parameter stepped in its post-accumulate-grad hook, its gradient
freed at once; the same bits as the normal step, and what cannot work refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lowprec
import lowprec.optim as lo
from lowprec.optim import compiled, in_backward, param_step
from tests._same import assert_same

OPTIMIZERS = {  # name: (class, options)
    "sgd": (lo.SGD, dict(lr=1e-2, momentum=0.9, weight_decay=0.1)),
    "adagrad": (lo.Adagrad, dict(lr=1e-2, weight_decay=0.1)),
    "lamb": (lo.Lamb, dict(lr=1e-2, weight_decay=0.1)),
    "adamw": (lo.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "adam": (lo.Adam, dict(lr=1e-2, weight_decay=0.1)),
    "radam": (lo.RAdam, dict(lr=1e-2, weight_decay=0.1)),
    "lion": (lo.Lion, dict(lr=1e-3, weight_decay=0.1)),
    "stableadamw": (lo.StableAdamW, dict(lr=1e-2, weight_decay=0.1)),
    "adafactor": (lo.Adafactor, dict(lr=1e-2, weight_decay=0.1)),
    "muon": (lo.Muon, dict(lr=1e-2, weight_decay=0.1)),
}
STRATEGIES = ["none", "fp32", "split", "kahan", "stochastic"]


def _model(dtype=torch.bfloat16, device="cpu") -> nn.Module:
    # A large matrix (> in_backward._SMALL elements: stepped in its hook), small ones and vectors
    # (stepped together at the end of backward), a norm.
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 300), nn.GELU(), nn.Linear(300, 256), nn.LayerNorm(256),
                         nn.Linear(256, 16)).to(device=device, dtype=dtype)


def _optimizer(name, model, **kw):
    cls, options = OPTIMIZERS[name]
    params = lo.muon_param_groups(model) if name == "muon" else model.parameters()
    return cls(params, **{**options, **kw})


def _train(name, inside: bool, steps=3, dtype=torch.bfloat16, model=None, opt=None, start=0,
           sched=None, device="cpu", **kw):
    model = _model(dtype, device) if model is None else model
    opt = _optimizer(name, model, **kw) if opt is None else opt
    schedule = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.7)
    if sched is not None:  # (a resumed run: the scheduler's saved state)
        schedule.load_state_dict(sched)
    handle = lowprec.step_in_backward(model, opt) if inside else None
    for step in range(start, start + steps):
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(step))
        x = x.to(device=device, dtype=dtype)
        model(x).float().square().mean().backward()
        if inside:
            assert all(p.grad is None for p in model.parameters())
        opt.step()
        schedule.step()
        opt.zero_grad()
    if handle is not None:
        handle.remove()
    opt.schedule = schedule  # (for a checkpoint)
    return list(model.parameters()), opt


@pytest.mark.parametrize("master", STRATEGIES)
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_inside_backward_equals_the_normal_step(name, master):
    # (eager: the suite's default, tests/conftest.py; the compiled step below)
    ref = _train(name, False, master=master)
    got = _train(name, True, master=master)
    assert_same(*got, *ref)


COMPILED = [(name, "kahan") for name in sorted(OPTIMIZERS)] + [
    ("adamw", master) for master in STRATEGIES if master != "kahan"]


@pytest.mark.fused
@pytest.mark.parametrize(("name", "master"), COMPILED)
def test_inside_backward_equals_the_normal_step_compiled(name, master, device):
    # The default path (fused=None compiles where it can): large parameters redo their prepared
    # compiled step in their hooks from the second step on, small ones the buckets at the end.
    # (On CUDA the hooks run on autograd's device thread.)
    ref = _train(name, False, master=master, fused=True, device=device)
    got = _train(name, True, master=master, fused=True, device=device)
    assert_same(*got, *ref)


@pytest.mark.fused
@pytest.mark.parametrize("name", ["adamw", "lamb", "sgd", "muon"])
def test_inside_backward_with_8bit_state_and_eager_and_fp32(name):
    for dtype, kw in [(torch.bfloat16, dict(master="kahan", state_dtype="8bit", fused=True)),
                      (torch.bfloat16, dict(master="stochastic", fused=False)),
                      (torch.bfloat16, dict(master="kahan", fused=False)),
                      (torch.float32, dict(fused=True))]:
        ref = _train(name, False, dtype=dtype, **kw)
        got = _train(name, True, dtype=dtype, **kw)
        assert_same(*got, *ref)


@pytest.mark.fused
def test_checkpoint_resumes_bit_for_bit():
    ref_params, ref_opt = _train("adamw", True, steps=4, master="kahan", fused=True)
    model = _model()
    opt = _optimizer("adamw", model, master="kahan", fused=True)
    _train("adamw", True, steps=2, model=model, opt=opt)
    saved = (model.state_dict(), opt.state_dict(), opt.schedule.state_dict())
    model2 = _model()
    model2.load_state_dict(saved[0])
    opt2 = _optimizer("adamw", model2, master="kahan", fused=True)
    opt2.load_state_dict(saved[1])
    params, opt2 = _train("adamw", True, steps=2, model=model2, opt=opt2, start=2,
                          sched=saved[2])
    assert_same(params, opt2, ref_params, ref_opt)


def test_no_full_set_of_gradients_exists():
    model = nn.Sequential(*[nn.Linear(300, 300) for _ in range(6)]).to(torch.bfloat16)
    opt = lo.AdamW(model.parameters(), lr=1e-3)
    alive = []
    for p in model.parameters():  # (registered first: runs before the step, sees the others)
        p.register_post_accumulate_grad_hook(
            lambda _p: alive.append(sum(q.grad is not None for q in model.parameters())))
    lowprec.step_in_backward(model, opt)
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.randn(4, 300).bfloat16()).float().sum().backward()
    # the weights are freed in their own hook; the 6 biases wait for the end of backward
    assert max(alive) <= 1 + 6
    assert all(p.grad is None for p in model.parameters())
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    after = _snapshot(model)
    opt.step()  # (nothing left to step)
    assert all(torch.equal(a, b) for a, b in zip(after, model.parameters(), strict=True))


def test_remove_restores_the_normal_step():
    model = _model()
    opt = _optimizer("adamw", model, master="kahan")
    lowprec.step_in_backward(model, opt).remove()
    assert not any(hasattr(p, in_backward.MARK) for p in model.parameters())
    model(torch.randn(2, 32).bfloat16()).float().sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    opt.step()
    lowprec.step_in_backward(model, opt.zero_grad() or opt)  # (may be registered again)


def test_option_turned_on_later_creates_its_buffer_as_the_normal_step():
    def run(inside):
        model = _model()
        opt = lo.SGD(model.parameters(), lr=1e-2, momentum=0.0, master="kahan")
        handle = lowprec.step_in_backward(model, opt) if inside else None
        for step in range(3):
            if step == 1:
                opt.param_groups[0]["momentum"] = 0.9
            model(torch.ones(2, 32).bfloat16() * (step + 1)).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
        if handle:
            handle.remove()
        return list(model.parameters()), opt

    assert_same(*run(True), *run(False))


# ---------------------------------------------------------------------------------- refusals


def _snapshot(model):
    return [p.detach().clone() for p in model.parameters()]


def test_second_backward_before_step_is_refused_and_writes_nothing():
    model = _model()
    opt = _optimizer("adamw", model)
    lowprec.step_in_backward(model, opt)
    model(torch.randn(2, 32).bfloat16()).float().sum().backward()
    after_first = _snapshot(model)
    with pytest.raises(RuntimeError, match="micro-batches"):
        model(torch.randn(2, 32).bfloat16()).float().sum().backward()
    assert all(torch.equal(a, b) for a, b in zip(after_first, model.parameters(), strict=True))


@pytest.mark.parametrize(("name", "buffer"), [("adamw", "exp_avg"), ("adafactor", "row_var")])
def test_bad_state_raises_before_any_parameter_moves(name, buffer):
    """A state tensor replaced by one that does not fit: the first hook of the next backward
    raises, whether the parameter is in a bucket (AdamW) or stepped on its own (Adafactor)."""
    model = _model()
    opt = _optimizer(name, model, master="kahan")
    lowprec.step_in_backward(model, opt)
    model(torch.randn(2, 32).bfloat16()).float().sum().backward()
    opt.step()
    first = next(iter(model.parameters()))  # (its hook runs last: backward goes from the end)
    opt.state[first][buffer] = torch.zeros(3)
    before = _snapshot(model)
    with pytest.raises(ValueError, match=buffer):
        model(torch.randn(2, 32).bfloat16()).float().sum().backward()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_loss_scaler_is_refused():
    model = _model(torch.float32)
    opt = _optimizer("adamw", model)
    lowprec.step_in_backward(model, opt)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(model(torch.randn(2, 32)).sum()).backward()
    with pytest.raises(RuntimeError, match="loss scaler"):
        scaler.step(opt)


@pytest.mark.parametrize("case", ["fp16", "accumulate", "grad", "torch", "foreign", "twice",
                                  "ddp"])
def test_refused_at_registration(case):
    model = _model(torch.float16 if case == "fp16" else torch.bfloat16)
    opt = _optimizer("adamw", model)
    expected = {"fp16": "FP16", "accumulate": "accumulate", "grad": "zero_grad",
                "torch": "lowprec optimizer", "foreign": "not a parameter of the model",
                "twice": "already steps", "ddp": "DistributedDataParallel"}[case]
    error = TypeError if case == "torch" else ValueError
    if case == "accumulate":
        lowprec.accumulate(model)
    elif case == "grad":
        model(torch.randn(2, 32).bfloat16()).float().sum().backward()
    elif case == "torch":
        opt = torch.optim.AdamW(model.parameters())
    elif case == "foreign":
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))]})
    elif case == "twice":
        lowprec.step_in_backward(model, opt)
    elif case == "ddp":
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29571", rank=0,
                                world_size=1)
        try:
            model = nn.parallel.DistributedDataParallel(model)
            with pytest.raises(error, match=expected):
                lowprec.step_in_backward(model, opt)
        finally:
            dist.destroy_process_group()
        return
    with pytest.raises(error, match=expected):
        lowprec.step_in_backward(model, opt)


def test_accumulate_refuses_parameters_stepped_inside_backward():
    model = _model()
    lowprec.step_in_backward(model, _optimizer("adamw", model))
    with pytest.raises(ValueError, match="step_in_backward"):
        lowprec.accumulate(model)


def test_update_monitor_refuses_a_step_inside_backward():
    model = _model()
    opt = _optimizer("adamw", model)
    lowprec.step_in_backward(model, opt)
    with pytest.raises(ValueError, match="inside backward"):
        lowprec.diagnostics.UpdateMonitor(model, opt)


@pytest.mark.fused
def test_later_steps_run_the_bucket_s_prepared_call_and_notice_changes(monkeypatch):
    # A large parameter's hook steps it through its bucket, as a piece of its own: its compiled
    # call prepared at the first step and run again from then on, prepared anew only where
    # something it relied on changed (a state tensor replaced: the buckets laid out again);
    # either way the bits of the normal step.
    model = _model()
    opt = _optimizer("adamw", model, master="kahan", fused=True)
    ref_model = _model()
    ref = _optimizer("adamw", ref_model, master="kahan", fused=True)
    lowprec.step_in_backward(model, opt)
    large = model[2].weight
    prepared = []
    real = compiled.prepare_fused
    monkeypatch.setattr(compiled, "prepare_fused",
                        lambda rule, storage, p, *a, **k:
                        prepared.append(p.data_ptr()) or real(rule, storage, p, *a, **k))
    full = []
    real_step = param_step.step_param
    monkeypatch.setattr(param_step, "step_param",
                        lambda o, *a, **k: (o is opt and full.append(a[1].shape))
                        or real_step(o, *a, **k))
    for step in range(4):
        prepared.clear()
        if step == 2:  # (a state tensor replaced: that parameter's bucket laid out again)
            opt.state[large]["exp_avg"] = opt.state[large]["exp_avg"].clone()
            ref.state[ref_model[2].weight]["exp_avg"] = (
                ref.state[ref_model[2].weight]["exp_avg"].clone())
        for m, o in ((model, opt), (ref_model, ref)):
            x = torch.randn(8, 32, generator=torch.Generator().manual_seed(step)).bfloat16()
            m(x).float().square().mean().backward()
            o.step()
            o.zero_grad()
            if o is opt:
                mine = prepared.count(large.data_ptr())
        assert mine == (1 if step in (0, 2) else 0), (step, prepared)
    assert not full  # (every parameter in a bucket)
    assert_same(list(model.parameters()), opt, list(ref_model.parameters()), ref)


def test_each_hook_makes_stochastic_roundings_keys_once(monkeypatch):
    """A parameter stepped in its hook through its bucket makes its random keys once, in the
    bucket (``_Bucket._keys``): its step's other numbers are made without keys. Before, every hook
    made them twice, one of them unused (an extra compiled call per parameter and step)."""
    model = nn.Sequential(nn.Linear(256, 512, bias=False), nn.Linear(512, 256, bias=False))
    model = model.bfloat16()
    opt = lowprec.AdamW(model.parameters(), lr=1e-3, master="stochastic", seed=1)
    lowprec.step_in_backward(model, opt)
    calls = []
    real = compiled.step_keys
    monkeypatch.setattr(compiled, "step_keys", lambda *a, **k: calls.append(1) or real(*a, **k))
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    for _ in range(2):
        calls.clear()
        model(x).float().square().mean().backward()
        opt.step()
        assert len(calls) == 2  # (one per parameter, each above in_backward._SMALL elements)
