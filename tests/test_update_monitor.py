"""UpdateMonitor against element-by-element simulations in plain Python floats.

The references round with ``struct`` (FP32) and bit arithmetic on FP32 patterns (BF16, nearest
even or ties away), independent of torch's casts and of the optimizers' code. A power-of-two
learning rate makes ``lr * g`` exact, so each step's FP32 update rounds exactly once.
"""

from __future__ import annotations

import copy
import math
import struct

import pytest
import torch
from torch import nn

from lowprec import LossScaler
from lowprec.diagnostics import UpdateMonitor
from lowprec.optim import SGD, Adagrad, AdamW, Lamb

LR = 2.0**-10
STEPS = 4
N = 192


# ------------------------------------------------------------------ a reference in plain floats


def f32(x: float) -> float:
    """Round a float64 to the nearest FP32 (ties to even)."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def _bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def _from_bits(b: int) -> float:
    return struct.unpack("<f", struct.pack("<I", b))[0]


def bf16_even(x: float) -> float:
    """An FP32 value rounded to BF16, nearest with ties to even (torch's cast)."""
    b = _bits(x)
    return _from_bits((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000)


def bf16_away(x: float) -> float:
    """An FP32 value rounded to BF16, nearest with ties away from zero (the split rule)."""
    return _from_bits((_bits(x) + 0x8000) & 0xFFFF0000)


def simulate(master: str, w0: list[float], grads: list[list[float]]) -> dict[str, float]:
    """SGD (no momentum) on BF16 weights, one element at a time; the monitor's figures."""
    updated = lost = master_lost = 0
    err_sq = master_err_sq = ref_sq = 0.0
    for i, w_init in enumerate(w0):
        p, c, m = w_init, 0.0, w_init  # stored value, Kahan compensation, FP32 master
        for g_step in grads:
            g = g_step[i]
            w = {"none": p, "kahan": f32(p + c)}.get(master, m)  # storage.load
            new = f32(w - g * LR)
            if master == "none":
                p_new, master_new = bf16_even(new), bf16_even(new)
            elif master == "kahan":
                p_new = bf16_even(new)
                c = bf16_even(f32(new - p_new))
                master_new = f32(p_new + c)
            else:  # "fp32" or "split": an exact FP32 master
                p_new = bf16_away(new) if master == "split" else bf16_even(new)
                master_new = m = new
            if new != w:
                updated += 1
                lost += p_new == p
                master_lost += master_new == w
            ref_sq += (new - w) ** 2
            err_sq += ((p_new - p) - (new - w)) ** 2
            master_err_sq += ((master_new - w) - (new - w)) ** 2
            p = p_new
    return {
        "updated": updated,
        "lost": lost,
        "master_lost": master_lost,
        "relative_error": math.sqrt(err_sq / ref_sq),
        "master_relative_error": math.sqrt(master_err_sq / ref_sq),
    }


def _data(seed: int = 0):
    """BF16 weights in [1, 2) and BF16 gradients around the swamping threshold, some zero."""
    gen = torch.Generator().manual_seed(seed)
    w = (1 + torch.rand(N, generator=gen)).to(torch.bfloat16)
    grads = []
    for _ in range(STEPS):
        # |lr * g| from 2**-14 to 2**-4 against half a BF16 ulp of 2**-8 at [1, 2)
        mag = torch.exp2(torch.empty(N).uniform_(-4, 6, generator=gen))
        sign = torch.randint(0, 2, (N,), generator=gen) * 2 - 1
        g = (mag * sign).to(torch.bfloat16)
        g[torch.rand(N, generator=gen) < 0.1] = 0
        grads.append(g)
    return w, grads


def _run(master: str, w: torch.Tensor, grads: list[torch.Tensor], **monitor_options):
    model = nn.Module()
    model.weight = nn.Parameter(w.clone())
    opt = SGD(model.parameters(), lr=LR, master=master)
    monitor = UpdateMonitor(model, opt, **monitor_options)
    for g in grads:
        model.weight.grad = g.clone()
        with monitor.step():
            opt.step()
    return monitor, model, opt


# ------------------------------------------------------------------ the counts


@pytest.mark.parametrize("master", ["none", "kahan", "split", "fp32"])
def test_counts_match_an_element_by_element_simulation(master):
    w, grads = _data()
    monitor, _, _ = _run(master, w, grads)
    ref = simulate(master, w.float().tolist(), [g.float().tolist() for g in grads])
    r = monitor.report()
    (p,) = r.params
    assert (p.name, p.master, p.dtype, p.steps) == ("weight", master, "bfloat16", STEPS)
    assert (p.updated, p.lost, p.master_lost) == (ref["updated"], ref["lost"], ref["master_lost"])
    assert p.lost_fraction == ref["lost"] / ref["updated"]
    assert monitor.lost_update_fraction == ref["lost"] / ref["updated"]
    assert monitor.master_lost_fraction == ref["master_lost"] / ref["updated"]
    assert p.relative_error == pytest.approx(ref["relative_error"], rel=1e-9)
    assert p.master_relative_error == pytest.approx(ref["master_relative_error"], rel=1e-9, abs=0)
    # The data straddle the threshold: some updates survive, some are lost.
    assert 0.1 < ref["lost"] / ref["updated"] < 0.9


@pytest.mark.parametrize(
    "master, master_lost",
    [
        ("none", "== lost"),  # the parameter is its own master
        ("split", "zero"),  # an exact FP32 master: nothing is lost
        ("fp32", "zero"),
        ("kahan", "small"),  # only what the BF16 compensation itself cannot hold
    ],
)
def test_what_each_strategy_loses(master, master_lost):
    w, grads = _data(seed=1)
    monitor, _, _ = _run(master, w, grads)
    (p,) = monitor.report().params
    if master_lost == "== lost":
        assert p.master_lost == p.lost and p.master_lost_fraction == p.lost_fraction
    elif master_lost == "zero":
        assert p.master_lost == 0 and p.master_relative_error == 0.0
        assert p.lost > 0  # the stored BF16 value lags all the same
    else:
        assert p.master_lost_fraction < 0.01 < p.lost_fraction
        assert p.master_relative_error < 0.01


def test_fp32_parameters_lose_nothing():
    model = nn.Linear(16, 8)
    opt = SGD(model.parameters(), lr=1e-2, momentum=0.9, master="none")
    monitor = UpdateMonitor(model, opt)
    for _ in range(3):
        model.weight.grad = torch.randn_like(model.weight)
        model.bias.grad = torch.randn_like(model.bias)
        with monitor.step():
            opt.step()
    r = monitor.report()
    assert r.lost == 0 and r.updated == 3 * (16 * 8 + 8)
    assert r.relative_error == 0.0 and r.master_lost_fraction == 0.0
    assert "No layer loses more than 1.00%" in monitor.summary()


# ------------------------------------------------------------------ the preview is the step


def _sgd(ps, **kw):
    return SGD(ps, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=1e-2, **kw)


@pytest.mark.parametrize(
    "make",
    [
        _sgd,
        # (maximize: the step's flag, which the preview applies as the step does)
        lambda ps, **kw: AdamW(ps, lr=1e-3, amsgrad=True, maximize=True, **kw),
        lambda ps, **kw: Adagrad(ps, lr=1e-2, lr_decay=0.1, weight_decay=1e-3, **kw),
        lambda ps, **kw: Lamb(ps, lr=1e-2, weight_decay=1e-2, **kw),
    ],
    ids=["sgd", "adamw", "adagrad", "lamb"],
)
@pytest.mark.parametrize(
    "dtype, master, scale",
    [
        (torch.float32, "none", None),  # the stored value is the intended value
        (torch.bfloat16, "split", None),  # the master is the intended value exactly
        (torch.float32, "none", 3.0),  # a loss scale that is not a power of two
        (torch.bfloat16, "fp32", 2.0**10),
    ],
)
def test_preview_equals_the_step(make, dtype, master, scale):
    # With an exact master, any difference between the preview and the step would show as a
    # nonzero error: the intended value must be what the step computes, bit for bit.
    model = nn.Sequential(nn.Linear(12, 6), nn.Linear(6, 3)).to(dtype)
    opt = make(list(model.parameters()), master=master)
    monitor = UpdateMonitor(model, opt, scaler=scale)
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        for p in model.parameters():
            g = torch.randn(p.shape, generator=gen) * (scale or 1.0)
            p.grad = g.to(dtype)
        with monitor.step():
            opt.step(grad_scale=scale)
    r = monitor.report()
    assert r.steps_monitored == 3 and r.steps_skipped == 0
    for p in r.params:
        assert p.steps == 3 and p.master_lost == 0 and p.master_relative_error == 0.0
        if dtype == torch.float32:
            assert p.lost == 0 and p.relative_error == 0.0


def test_preview_writes_nothing():
    model = nn.Linear(4, 3).to(torch.bfloat16)
    opt = AdamW(model.parameters(), master="kahan")
    monitor = UpdateMonitor(model, opt)
    for step in range(2):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        params = [p.detach().clone() for p in model.parameters()]
        state = {p: copy.deepcopy(st) for p, st in opt.state.items()}  # keyed by the params
        monitor.before_step()
        if step == 0:
            assert len(opt.state) == 0  # the first step's state is built aside, not stored
        for p, q in zip(model.parameters(), params, strict=True):
            assert torch.equal(p, q)
        for p, st in state.items():
            for name, t in st.items():
                assert not isinstance(t, torch.Tensor) or torch.equal(opt.state[p][name], t)
        opt.step()
        monitor.after_step()
    monitor.before_step()
    monitor.after_step()  # no optimizer step between: recorded as skipped
    assert monitor.report().steps_skipped == 1


# ------------------------------------------------------------------ loss scaling and skipping


def _bf16_model():
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)).to(torch.bfloat16)


def _train(model, opt, monitor, scaler=None, *, unscale=False, steps=3, inject_inf_at=None):
    gen = torch.Generator().manual_seed(4)
    for i in range(steps):
        opt.zero_grad()
        x = torch.randn(5, 8, generator=gen).to(torch.bfloat16)
        loss = model(x).float().square().mean() * 1e-3
        (scaler.scale(loss) if scaler else loss).backward()
        if i == inject_inf_at:
            model[0].weight.grad[0, 0] = float("inf")
        if unscale:
            scaler.unscale_(opt)
        with monitor.step():
            if scaler:
                scaler.step(opt)
            else:
                opt.step()
        if scaler:
            scaler.update()


@pytest.mark.parametrize("unscale", [False, True], ids=["scaled", "unscaled-first"])
def test_scaled_steps_give_the_unscaled_figures(unscale):
    plain = _bf16_model()
    opt = SGD(plain.parameters(), lr=1e-2, master="kahan")
    ref = UpdateMonitor(plain, opt)
    _train(plain, opt, ref)
    model = _bf16_model()
    opt = SGD(model.parameters(), lr=1e-2, master="kahan")
    scaler = LossScaler(init_scale=2.0**12)
    monitor = UpdateMonitor(model, opt, scaler=scaler)
    _train(model, opt, monitor, scaler, unscale=unscale)
    assert monitor.report().params == ref.report().params
    assert monitor.report().updated > 0


@pytest.mark.parametrize("lowprec", [True, False], ids=["lowprec", "torch.optim"])
def test_a_skipped_step_records_nothing(lowprec):
    model = _bf16_model()
    opt = (SGD(model.parameters(), lr=1e-2, master="none") if lowprec
           else torch.optim.SGD(model.parameters(), lr=1e-2))
    scaler = LossScaler(init_scale=2.0**8)
    monitor = UpdateMonitor(model, opt, scaler=scaler)
    _train(model, opt, monitor, scaler, steps=3, inject_inf_at=1)
    r = monitor.report()
    assert (r.steps_seen, r.steps_monitored, r.steps_skipped) == (3, 3, 1)
    assert all(p.steps == 2 for p in r.params)


def test_every_kth_step():
    w, grads = _data()
    grads = grads + grads[:3]  # 7 steps: monitored are the 1st, 4th and 7th
    monitor, _, _ = _run("none", w, grads, every=3)
    r = monitor.report()
    assert (r.every, r.steps_seen, r.steps_monitored, r.params[0].steps) == (3, 7, 3, 3)
    every_step = _run("none", w, grads)[0].report()
    assert 0 < r.updated < every_step.updated and every_step.params[0].steps == 7


def _one(w, grads):
    model = nn.Module()
    model.weight = nn.Parameter(w.clone())
    return model, SGD(model.parameters(), lr=LR, master="none")


# ------------------------------------------------------------------ other optimizers


def test_torch_optimizer_counts_nonzero_gradients_left_unchanged():
    w, grads = _data(seed=5)
    model, twin = nn.Module(), nn.Module()
    model.weight = nn.Parameter(w.clone())
    twin.weight = nn.Parameter(w.clone())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=LR)
    monitor = UpdateMonitor(model, opt)
    updated = lost = 0
    for g in grads:
        model.weight.grad, twin.weight.grad = g.clone(), g.clone()
        before = twin.weight.detach().clone()
        twin_opt.step()
        nonzero = g != 0
        updated += int(nonzero.sum())
        lost += int((nonzero & (twin.weight.detach() == before)).sum())
        with monitor.step():
            opt.step()
    (p,) = monitor.report().params
    assert (p.master, p.updated, p.lost) == (None, updated, lost)
    assert p.master_lost is None and p.relative_error is None and p.master_relative_error is None
    assert monitor.master_lost_fraction is None
    assert "weight" in monitor.summary() and "kahan/split/stochastic" in monitor.summary()


# ------------------------------------------------------------------ API


def test_before_and_after_equal_the_context_manager():
    w, grads = _data()
    a, _, _ = _run("kahan", w, grads)
    model, opt = _one(w, [])
    opt = SGD(model.parameters(), lr=LR, master="kahan")
    b = UpdateMonitor(model, opt)
    for g in grads:
        model.weight.grad = g.clone()
        b.before_step()
        opt.step()
        b.after_step()
    assert a.report() == b.report()


def test_an_exception_in_the_block_records_nothing():
    w, grads = _data()
    monitor, model, opt = _run("none", w, grads[:1])
    with pytest.raises(ZeroDivisionError), monitor.step():
        1 / 0  # noqa: B018
    assert monitor.report().steps_monitored == 1
    model.weight.grad = grads[1].clone()
    with monitor.step():
        opt.step()
    assert monitor.report().steps_monitored == 2


def test_summary_names_the_layers_that_lose_updates():
    w, grads = _data()
    for master, flagged in [("none", True), ("split", False), ("kahan", False)]:
        monitor, _, _ = _run(master, w, grads)
        text = monitor.summary()
        r = monitor.report()
        assert ("weight" in r.flagged) is flagged
        if flagged:
            assert "needs compensation (kahan/split/stochastic) or FP32" in text
        else:
            assert "No layer loses more than 1.00%" in text
            assert "Stored value lags" in text and f"master={master}" in text
    assert monitor.report(threshold=1.0).flagged == {}


def test_reset_and_close():
    w, grads = _data()
    monitor, _, _ = _run("none", w, grads)
    monitor.reset()
    assert monitor.report().steps_seen == 0 and monitor.lost_update_fraction == 0.0
    monitor.close()
    assert "No update recorded yet" in monitor.summary()


def _other_params():
    return SGD([nn.Parameter(torch.zeros(2))], lr=0.1)


@pytest.mark.parametrize(
    "args, kwargs, error, match",
    [
        (("model", "opt"), {}, TypeError, "takes an nn.Module"),
        ((nn.Linear(2, 2), "opt"), {}, TypeError, "takes a torch.optim.Optimizer"),
        ((None, None), {"every": 0}, ValueError, "every must be an int >= 1"),
        ((None, None), {"every": 1.5}, ValueError, "every must be an int >= 1"),
        ((None, None), {"scaler": "x"}, TypeError, "scaler must be a loss scaler"),
        ((None, None), {"scaler": -2.0}, ValueError, "finite and > 0"),
        ((nn.Linear(2, 2), _other_params()), {}, ValueError, "updates none of the model's"),
    ],
)
def test_bad_arguments(args, kwargs, error, match):
    if args == (None, None):
        model = nn.Linear(2, 2)
        args = (model, SGD(model.parameters(), lr=0.1))
    with pytest.raises(error, match=match):
        UpdateMonitor(*args, **kwargs)


def test_misuse_of_the_step_calls():
    model = nn.Linear(2, 2)
    monitor = UpdateMonitor(model, SGD(model.parameters(), lr=0.1))
    with pytest.raises(RuntimeError, match="without before_step"):
        monitor.after_step()
    monitor.before_step()
    with pytest.raises(RuntimeError, match="called twice"):
        monitor.before_step()
    with pytest.raises(ValueError, match="threshold must be"):
        monitor.report(threshold=2)


def _record(master, dtype="bfloat16", lost=0.5, master_lost=0.5):
    from lowprec.diagnostics import ParamUpdates

    return ParamUpdates(
        name="w", shape=(4,), dtype=dtype, master=master, numel=4, steps=1, updated=100,
        lost=int(100 * lost), lost_fraction=lost,
        master_lost=None if master is None else int(100 * master_lost),
        master_lost_fraction=None if master is None else master_lost,
        relative_error=None, master_relative_error=None,
    )


@pytest.mark.parametrize(
    "record, advice",
    [
        (_record("none"), "needs compensation"),
        (_record("none", lost=0.005, master_lost=0.005), None),
        (_record(None), "needs compensation"),
        (_record(None, dtype="float32"), "below half an ulp"),
        (_record("kahan", master_lost=0.0), None),
        (_record("kahan", master_lost=0.2), "use split or an FP32 master"),
        (_record("split", master_lost=0.0), None),
        (_record("fp32", master_lost=0.0), None),
        (_record("stochastic"), None),  # unbiased in expectation
    ],
)
def test_advice_table(record, advice):
    got = record.advice()
    assert got is None if advice is None else advice in got


def test_monitor_inside_a_compiled_function_counts_what_eager_counts():
    # The monitor wrapped around the optimizer's step inside a function compiled with
    # torch.compile: its own work runs outside the traced graph (traced, it failed to compile)
    # and counts the same lost updates as the eager loop.
    def run(compiled):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8)).bfloat16()
        opt = AdamW(model.parameters(), lr=1e-4, master="none")
        monitor = UpdateMonitor(model, opt)
        x = torch.randn(16, 32).bfloat16()

        def update():  # (the forward stays eager: the same gradients either way)
            with monitor.step():
                opt.step()
            opt.zero_grad()

        step = torch.compile(update) if compiled else update
        for _ in range(4):
            model(x).float().pow(2).mean().backward()
            step()
        return monitor, [p.detach().clone() for p in model.parameters()]

    (ma, pa), (mb, pb) = run(False), run(True)
    assert ma.lost_update_fraction > 0.1  # (the counts below are not all zeros)
    assert mb.lost_update_fraction == ma.lost_update_fraction
    assert mb._steps_monitored == ma._steps_monitored == 4
    assert all(torch.equal(a, b) for a, b in zip(pa, pb, strict=True))
