"""Steps with a change between two of them, for the tests that compare the buckets' step with
every parameter's full step (``tests/test_buckets.py``).

``run`` takes the same steps from the same start (fresh random gradients, ``change`` before step
``CHANGE_AT``, optionally through the loss-scaler contract), with the buckets (the default step)
or with every parameter's full step taken anew at each step (``full_steps``), and says how many
steps the buckets took as they were laid out.
"""

from __future__ import annotations

import contextlib
import copy
from unittest import mock

import torch

from lowprec.optim import AdamW, driver

# One parameter of 2**16 elements or more, small ones, an odd-length one (its last element takes
# the eager step) and a one-element one (eager).
SHAPES = [(300, 256), (64,), (32, 4), (7,), (1,)]
CHANGE_AT = 3
STEPS = 6


@contextlib.contextmanager
def full_steps():
    """Every parameter stepped on its own by its full step (``driver.full_step``:
    ``param_step.step_param``, eager but for whole-tensor rules) at every step: no bucket and
    no kept call, the reference of the
    buckets' step (and ``tests/conftest.py``'s ``no_buckets``)."""
    with mock.patch.object(driver, "step_buckets", lambda *args: False), \
            mock.patch.object(driver, "flatten", lambda opt, fresh=None: None):
        yield


def run(make, change, *, use_buckets=True, steps=STEPS, scaled=None, shapes=None):
    """Steps with fresh random gradients (the same for every run); ``change(params, opt, saved)``
    runs before step CHANGE_AT, ``saved`` being a state_dict taken after the first step.
    ``scaled(step)``: whether that step goes through the loss-scaler contract (gradients scaled by
    256, passed as grad_scale with a found_inf flag; at step CHANGE_AT + 1 one gradient holds an
    inf, so that step is skipped). Returns the parameters, the optimizer and how many steps the
    buckets took as they were laid out (without laying them out again). ``shapes``: the
    parameters' (the first one 2-d)."""
    gen = torch.Generator().manual_seed(0)
    params = [
        (torch.randn(s, generator=gen) * 0.1).to(torch.bfloat16).requires_grad_()
        for s in (SHAPES if shapes is None else shapes)  # (SHAPES read now: tests replace it)
    ]
    opt = make(params)
    taken = 0
    real = driver.step_buckets
    first = [True]

    def spy(o, ctx):  # (the first try of each step: the buckets as they were)
        nonlocal taken
        done = real(o, ctx)
        if o is opt and first[0]:
            taken += done
            first[0] = False
        return done

    saved = None
    with (mock.patch.object(driver, "step_buckets", spy) if use_buckets
          else full_steps()):
        for step in range(steps):
            first[0] = True
            _step(params, opt, gen, change, step, scaled, saved)
            if step == 0:
                saved = copy.deepcopy(opt.state_dict())
    return params, opt, taken


def _step(params, opt, gen, change, step, scaled, saved):
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(torch.bfloat16)
    if step == CHANGE_AT:
        change(params, opt, saved)
    if scaled is not None and scaled(step):
        for p in params:
            if p.grad is not None:
                p.grad.mul_(256)
        if step == CHANGE_AT + 1:
            params[0].grad[0, 0] = float("inf")
        opt.step(grad_scale=torch.tensor(256.0), found_inf=torch.zeros(()))
    else:
        opt.step()


def _adamw_kahan(params):
    return AdamW(params, lr=1e-2, weight_decay=0.1, master="kahan", fused=True, seed=3)


def _set_grads(values):
    def change(params, opt, saved):
        for p, g in zip(params, values(params), strict=True):
            if g.dtype != p.dtype:
                p.grad_dtype = None  # allow an FP32 gradient on a BF16 parameter
            p.grad = g
    return change


CHANGES = {
    "nothing": lambda params, opt, saved: None,
    # In-place changes to state the step reads: the buckets' views see them.
    "momentum_in_place": lambda params, opt, saved: opt.state[params[0]]["exp_avg"].mul_(-3),
    "lr_and_betas": lambda params, opt, saved: opt.param_groups[0].update(
        lr=5e-3, betas=(0.5, 0.9)),
    # Changes that the buckets must notice (and lay themselves out again for).
    "step_count_written": lambda params, opt, saved: opt.state[params[1]]["step"].fill_(50),
    # FP32 counts stop at 2**24 (a step reads back what it stored).
    "step_counts_past_2_24": lambda params, opt, saved: [
        opt.state[p]["step"].fill_(2**24 - 2) for p in params],
    # Writes that leave the version counter as it was: the counts are read every step.
    "step_counts_written_through_data": lambda params, opt, saved: [
        opt.state[p]["step"].data.fill_(40 + i) for i, p in enumerate(params[:2])],
    "state_tensor_replaced": lambda params, opt, saved: opt.state[params[0]].update(
        exp_avg_sq=torch.ones_like(opt.state[params[0]]["exp_avg_sq"])),
    "batched_state_tensor_replaced": lambda params, opt, saved: opt.state[params[2]].update(
        exp_avg=torch.full_like(opt.state[params[2]]["exp_avg"], 0.5)),
    "state_loaded": lambda params, opt, saved: opt.load_state_dict(saved),
    "param_data_replaced": lambda params, opt, saved: [
        setattr(p, "data", p.data.clone() + 1) for p in params[:2]],
    "a_grad_missing": lambda params, opt, saved: [
        setattr(p, "grad", None) for p in params[1::2]],
    "grads_in_fp32": _set_grads(lambda params: [p.grad.float() for p in params]),
    # (gradients of two dtypes in one bucket: each parameter a piece of its own)
    "a_grad_in_fp32": _set_grads(lambda params: [
        p.grad.float() if i == 2 else p.grad for i, p in enumerate(params)]),
    "grad_non_contiguous": _set_grads(lambda params: [
        p.grad.t().contiguous().t() if p.dim() == 2 else p.grad for p in params]),
    "weight_decay_off": lambda params, opt, saved: opt.param_groups[0].update(weight_decay=0.0),
    # A flag of the rule's code (its kernels are compiled for it) that adds no buffer.
    "maximize_on": lambda params, opt, saved: opt.param_groups[0].update(maximize=True),
    "master_changed_on_a_new_group": lambda params, opt, saved: opt.add_param_group(
        {"params": [torch.zeros(6, dtype=torch.bfloat16, requires_grad=True)],
         "master": "split"}),
}


