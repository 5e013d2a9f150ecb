"""Recorded steps redone: the pipeline's second stage (``driver``).

A full step (``driver.full_step``) records what it did in a ``plan._Plan``. Where the buckets did
not take the next step, ``redo`` checks the record against the optimizer (the same groups, options,
flags, parameters, gradient layouts and state tensors; the step counts read as the full step reads
them) and, where nothing differs, redoes it with this step's numbers: each entry's prepared compiled
call (``compiled.run_fused``), each batch (``batches.run_batch``), and the entries that can share a
compiled call by one call (``plan._Many``, ``run_many``); the rest by ``param_step.step_param``.
Where anything differs it returns False, having written nothing, and the full step runs.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any, cast

# (loss_scale._host_counts is read through its module: tests replace it)
from lowprec.optim import batches, compiled, loss_scale, param_step
from lowprec.optim.compiled import (
    _COMPILE_ERRORS,
    _ZERO_KEY,
    _disable_fused,
    _key_tensors,
    _one_cpp_kernel_per_loop,
    _step_view,
)
from lowprec.optim.loss_scale import _advance_counts, _Scaling
from lowprec.optim.plan import _Batch, _Entry, _Many

if TYPE_CHECKING:
    import torch

    from lowprec.optim._typing import Memo
    from lowprec.optim.base import LowPrecisionOptimizer
    from lowprec.optim.compiled import _Fused
    from lowprec.optim.driver import StepContext


def redo(opt: LowPrecisionOptimizer, ctx: StepContext) -> bool:
    """Redo the step the last full step recorded (``opt._step_plan``) with this step's numbers,
    if nothing it relied on changed.

    A step re-derives, per parameter, what rarely changes between steps: its strategy, the
    state's layout, flattened views, kernel variants, batches of small tensors. That host
    work is a large share of a fused step (more so with the caches cold after backward), so
    the previous step's outcome is kept and checked instead: the same groups, options and
    flags, the same parameter, gradient and state tensors (gradients may be new tensors of the
    same layout); the step counts are read as the full step reads them. Returns False, having
    written nothing, when anything differs; the full step then runs (and records anew).
    Options are validated as the full step validates them. A step under a loss scaler
    (``plan.scaled``) checks the gradients for inf/NaN first, as the full step does, and
    computes each parameter's numbers on its device from its step count.
    """
    plan = opt.__dict__.get("_step_plan")
    if (plan is None or plan.scaled != ctx.scaled or getattr(opt, "_fused_broken", False)
            or len(opt.param_groups) != len(plan.groups)):
        return False
    memo: dict[Any, Any] = {}
    for gi, (group, (ref, params, options, flags)) in enumerate(
        zip(opt.param_groups, plan.groups, strict=True)
    ):
        now = group["params"]
        if (group is not ref or len(now) != len(params)
                or not all(map(operator.is_, now, params))):
            return False
        opt._validate_options(group, gi)  # (raises as the full step would)
        if opt._plan_options(group) != options or opt._flags(group) != flags:
            return False
        memo[("flags", id(group))] = flags
    if any(p.grad is not None or p.dtype != dtype or p.device != device
           for p, dtype, device in plan.idle):
        return False  # (the full step validates every parameter, with a gradient or not)
    state = opt.state
    if not all(e.current(state) for e in plan.entries):
        return False
    if not plan.read_counts():  # (before the scaler's check, which writes found_inf)
        return False
    scaling = None
    if plan.scaled:  # (off the CPU the counts are read on the device: param_step.scaled_numbers)
        scaling = _Scaling.prepare(
            [(e.group, e.p, e.index, e.storage) for e in plan.entries], ctx.grad_scale,
            ctx.found_inf,
            opt.__dict__.get("_shard_reduce"),
        )
        on_device = [(e.group, e.p, e.index, e.storage, e.state) for e in plan.entries
                     if not loss_scale._host_counts(e.p.device)]
        if on_device:  # (every parameter's numbers at once, per group: not one by one)
            param_step.scaled_numbers_many(opt, on_device, scaling, memo)
    fused: list[_Entry] = []  # stepped by a compiled call here: their counts advance below
    try:
        for run in plan.merged(opt):
            if isinstance(run, _Many):
                if run_many(opt, run, memo, scaling):
                    fused.extend(run.entries)
                    continue
                runs = run.entries  # (not compiled: each by its own call, below)
            else:
                runs = [run]
            for run in runs:
                redo_run(opt, run, memo, scaling, fused)
    finally:
        if fused:  # (also when a later parameter raised: these were stepped)
            _advance_counts([e.state["step"] for e in fused], scaling)
    return True


def redo_entry(
    opt: LowPrecisionOptimizer,
    e: _Entry | None,
    memo: Memo,
    scaling: _Scaling | None,
    fused: list[_Entry],
) -> bool:
    """A parameter's compiled step as prepared at its last step (its ``_Entry``, kept by a
    ``plan._Recorder``), redone by ``redo_run`` if nothing it relied on changed; False, having
    written nothing, otherwise. ``fused`` collects it where its count is the caller's to advance."""
    if e is None or e.fused is None or not e.current(opt.state):
        return False
    if scaling is None or loss_scale._host_counts(e.p.device):
        e.step = int(e.count.item())  # (elsewhere: param_step.scaled_numbers)
    redo_run(opt, e, memo, scaling, fused)
    return True


def redo_run(
    opt: LowPrecisionOptimizer,
    run: _Entry | _Batch,
    memo: Memo,
    scaling: _Scaling | None,
    fused: list[_Entry],
) -> None:
    """Redo one recorded run (a batch or a parameter); ``fused`` collects the entries whose
    counts ``redo`` advances."""
    if isinstance(run, _Batch):
        if not batches.run_batch(opt, run, run.entries[0].step + 1, memo, scaling):
            opt._step_plan = None
            for group, p, index, storage in run.items:
                param_step.step_param(opt, group, p, index, storage, scaling, memo)
        return
    e = run
    if e.fused is not None:
        host = scaling is None or loss_scale._host_counts(e.p.device)
        grad = cast("torch.Tensor", e.p.grad)  # (present: checked by e.current)
        try:
            if host:
                step = e.step + 1
                compiled.run_fused(
                    opt, e.fused, grad, *param_step.step_coefficients(opt, e.group, step, memo),
                    *param_step.random_keys(e.group, e.storage, step, e.index),
                    {} if scaling is None else scaling.kernel_args(e.p.device),
                )
            else:
                _, lo, hi, coeffs, extra = param_step.scaled_numbers(
                    opt, e.group, e.p, e.index, e.storage, e.state,
                    cast(_Scaling, scaling), memo,  # (not host: a scaler's step)
                )
                compiled.run_fused(opt, e.fused, grad, coeffs, coeffs, lo, hi, extra)
        except _COMPILE_ERRORS as err:  # compilation failed before anything was written
            _disable_fused(opt, err)
            opt._step_plan = None
        else:
            fused.append(e)  # (its count advances with the others': _advance_counts)
            return
    param_step.step_param(opt, e.group, e.p, e.index, e.storage, scaling, memo)


def run_many(
    opt: LowPrecisionOptimizer, many: _Many, memo: Memo, scaling: _Scaling | None
) -> bool:
    """Redo ``many``'s parameters with one compiled call (``_update_many``); False, having
    written nothing, where they must go one by one instead: their step counts differ (the
    coefficients are shared), or the call cannot be compiled."""
    entries = many.entries
    step = entries[0].step + 1
    if any(e.step + 1 != step for e in entries) or not many.usable():
        return False
    e0 = entries[0]
    group, storage = e0.group, e0.storage
    _, c32 = param_step.step_coefficients(opt, group, step, memo)
    if storage.needs_random_bits:
        keys = [_key_tensors(*param_step.random_keys(group, storage, step, e.index))
                for e in entries]
        los, his = [lo for lo, _ in keys], [hi for _, hi in keys]
    else:
        los = his = [_ZERO_KEY] * len(entries)
    # (cast: a _Many's entries have their compiled step, and their parameters gradients)
    pvs = [_step_view(cast("_Fused", e.fused), e.p) for e in entries]
    gvs = [_step_view(cast("_Fused", e.fused), cast("torch.Tensor", e.p.grad))
           for e in entries]
    kw: dict[str, Any] = {} if scaling is None else scaling.kernel_args(e0.p.device)
    f = cast("_Fused", e0.fused)
    if f.pairs is not None:
        kw["dtypes"] = f.pairs
    kw.update(f.qkw)
    if f.sums_kernel is not None:
        kw["sums_fn"], kw["norm_terms"] = many.sums_fn, opt._norm_terms
    try:
        with _one_cpp_kernel_per_loop():
            many.kernel(pvs, gvs, many.svs, many.mvs, c32, los, his, fn=many.fn,
                        storage=storage, math=opt._math, flags=f.flags, **kw)
    except _COMPILE_ERRORS:  # (compilation failed before anything was written)
        many.broken()
        return False
    return True
