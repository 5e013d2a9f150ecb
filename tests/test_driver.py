"""The step (``lowprec.optim.driver``): ``step()`` hands a ``StepContext`` to ``driver.run``, and
every step, the first included, goes through the buckets (``driver.step_buckets``), laid out
once the state exists; ``driver.full_step`` takes only what they decline. These tests watch what
took each step; what it computes is compared with every parameter's full step bit for bit in
``test_buckets.py``."""

from __future__ import annotations

import pytest
import torch

from lowprec.optim import SGD, Adafactor, AdamW, core, driver

# (fused: a compiled step that falls back to eager fails the test, tests/_fallback.py)
pytestmark = pytest.mark.fused


def _watch(monkeypatch) -> list[tuple[str, bool | str]]:
    """Record, per call of the buckets' step that took a step or of the full step, its name and
    what the context said of the loss scaler."""
    taken: list[tuple[str, bool | str]] = []
    for module, name in [(driver, "step_buckets"), (driver, "full_step")]:
        real = getattr(module, name)

        def spy(opt, ctx, *args, real=real, name=name):
            done = real(opt, ctx, *args)
            if done is not False:  # (full_step returns None: it always takes the step)
                taken.append((name, ctx.scaled))
            return done

        monkeypatch.setattr(module, name, spy)
    return taken


def _params() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=gen).bfloat16().requires_grad_()
            for s in [(64, 32), (64,), (32, 16)]]


def _step(opt, params, **scaler) -> None:
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step(**scaler)


@pytest.mark.parametrize("make", [
    lambda ps: AdamW(ps, lr=1e-2, master="kahan", fused=True),
    lambda ps: Adafactor(ps, lr=1e-2, master="kahan", fused=False),
], ids=["adamw-buckets", "adafactor-whole-tensors"])
def test_every_step_goes_through_the_buckets(make, monkeypatch):
    """From the first step on, in buckets where the rule allows them (AdamW), else each
    parameter by its own step within the same layout (Adafactor, which needs each tensor
    whole); the state is laid out once, before the first step."""
    taken = _watch(monkeypatch)
    laid = []
    real = driver.flatten
    monkeypatch.setattr(driver, "flatten", lambda opt, fresh=None: laid.append(1) or real(opt, fresh))
    params = _params()
    opt = make(params)
    for _ in range(3):
        _step(opt, params)
    assert taken == [("step_buckets", False)] * 3
    assert laid == [1]


def test_a_context_says_how_the_kernels_take_the_scalers_inputs(monkeypatch):
    """``grad_scale`` (with or without ``found_inf``) means unscale, ``found_inf`` alone skip
    only, neither plain; the buckets take every mode."""
    taken = _watch(monkeypatch)
    params = _params()
    opt = Adafactor(params, lr=1e-2, master="kahan", fused=False)  # (eager: no compiling)
    scale = {"grad_scale": torch.tensor(4.0), "found_inf": torch.zeros(())}
    _step(opt, params, **scale)
    _step(opt, params, **scale)
    _step(opt, params, found_inf=torch.zeros(()))
    _step(opt, params)
    assert taken == [("step_buckets", "unscale"), ("step_buckets", "unscale"),
                     ("step_buckets", "skip"), ("step_buckets", False)]
    assert driver.StepContext(grad_scale=2.0).scaled == "unscale"
    assert driver.StepContext(found_inf=torch.zeros(())).scaled == "skip"
    assert driver.StepContext().scaled is False


def test_a_buffer_an_option_turns_on_takes_the_full_step_once(monkeypatch):
    """SGD's momentum turned on after the first steps: its buffer is created by the full step
    (``param_step.step_param``'s ``first_use``, as torch.optim creates it), and the buckets take
    the next steps again, laid out with it."""
    taken = _watch(monkeypatch)
    params = _params()
    opt = SGD(params, lr=1e-2, momentum=0.0, master="kahan", fused=False)
    _step(opt, params)
    opt.param_groups[0]["momentum"] = 0.9
    _step(opt, params)
    _step(opt, params)
    assert taken == [("step_buckets", False), ("full_step", False), ("step_buckets", False)]
    assert "momentum_buffer" in core.stages(opt).buckets.buckets[0].names
