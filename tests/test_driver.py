"""The step as a pipeline (``lowprec.optim.driver``): ``step()`` hands a ``StepContext`` to
``driver.run``, whose stages (``buckets.step_buckets``, ``replay.redo``, ``driver.full_step``)
are tried in turn until one takes the step. These tests watch which stage took each step; what
each stage computes is compared with the others bit for bit in ``test_buckets.py`` and
``test_replay.py``."""

from __future__ import annotations

import pytest
import torch

from lowprec.optim import Adafactor, AdamW, buckets, driver, replay

# (fused: a compiled step that falls back to eager fails the test, tests/_fallback.py)
pytestmark = pytest.mark.fused

STAGES = [(buckets, "step_buckets"), (replay, "redo"), (driver, "full_step")]


def _watch(monkeypatch) -> list[tuple[str, bool | str]]:
    """Record, per stage called, its name and what the context said of the loss scaler."""
    taken: list[tuple[str, bool | str]] = []
    for module, name in STAGES:
        real = getattr(module, name)

        def spy(opt, ctx, real=real, name=name):
            done = real(opt, ctx)
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


@pytest.mark.parametrize(("make", "later"), [
    (lambda ps: AdamW(ps, lr=1e-2, master="kahan", fused=True), "step_buckets"),
    (lambda ps: Adafactor(ps, lr=1e-2, master="kahan", fused=False), "redo"),
], ids=["adamw-buckets", "adafactor-recorded"])
def test_each_step_is_taken_by_one_stage(make, later, monkeypatch):
    """The first step is a full one; the next ones go through buckets where the rule allows them
    (AdamW), else redo the recorded step (Adafactor, which needs each tensor whole)."""
    taken = _watch(monkeypatch)
    params = _params()
    opt = make(params)
    for _ in range(3):
        _step(opt, params)
    assert taken == [("full_step", False), (later, False), (later, False)]


def test_a_context_says_how_the_kernels_take_the_scalers_inputs(monkeypatch):
    """``grad_scale`` (with or without ``found_inf``) means unscale, ``found_inf`` alone skip
    only, neither plain; a recorded step is redone only under the same mode, so a plain step
    after scaled ones is a full step (where no bucket takes it)."""
    taken = _watch(monkeypatch)
    params = _params()
    opt = Adafactor(params, lr=1e-2, master="kahan", fused=False)  # (eager: no compiling)
    scale = {"grad_scale": torch.tensor(4.0), "found_inf": torch.zeros(())}
    _step(opt, params, **scale)
    _step(opt, params, **scale)
    _step(opt, params, found_inf=torch.zeros(()))
    _step(opt, params)
    assert taken == [("full_step", "unscale"), ("redo", "unscale"), ("full_step", "skip"),
                     ("full_step", False)]
    assert driver.StepContext(grad_scale=2.0).scaled == "unscale"
