"""The step as a pipeline: what ``step()`` does after its closure.

``step()`` (``base``) makes a ``StepContext`` of the loss scaler's inputs and calls ``run``,
which hands it to three stages in turn; the first that takes the step ends it:

1. ``buckets.step_buckets``: the parameters laid out in flat buffers, a few compiled calls per
   group of tensors (``compiled.run_fused``), whatever their count;
2. ``replay.redo``: the step the last full step recorded, redone where nothing it relied on
   changed (the rules and layouts buckets do not take: Adafactor, Muon, DTensor shards...);
3. ``full_step``: validate, check the gradients under a loss scaler, step each parameter
   (``param_step.step_param``: compiled or eager) and the small ones in batches
   (``batches.step_small``), and record the step; ``buckets.flatten`` then lays the buckets out
   for the next one.

A stage that declines has written nothing. Each stage is a function of the optimizer and the
context (``full_step`` here, the others in their modules); below them, ``param_step`` (one parameter's step and the step's
numbers), ``compiled`` (the kernels), ``update`` (the arithmetic), ``loss_scale`` (the scaler's
check). The update inside backward (``in_backward``) ends its step here too, and a DTensor's
parameters are stepped as their local shards (``shards.local_shards``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

# (called through their modules: tests replace these functions and loss_scale._host_counts)
from lowprec.optim import batches, buckets, loss_scale, param_step, replay
from lowprec.optim.batches import _by_size
from lowprec.optim.loss_scale import _Scaling
from lowprec.optim.plan import _Plan
from lowprec.optim.shards import local_shards

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from lowprec.optim._typing import Memo, WorkItem
    from lowprec.optim.base import LowPrecisionOptimizer


@dataclass(frozen=True)
class StepContext:
    """What one ``step()`` hands its stages: the loss scaler's inputs (``torch.amp.GradScaler``'s
    contract, ``LowPrecisionOptimizer.step``) and how the kernels take them (``scaled``:
    ``"unscale"`` with a scale, ``"skip"`` with ``found_inf`` alone, False without either;
    ``loss_scale._Scaling.mode``). Each stage keeps its own working numbers (a ``memo``, a
    ``_Scaling``): one that declines leaves none behind."""

    grad_scale: torch.Tensor | float | None = None
    found_inf: torch.Tensor | None = None

    @property
    def scaled(self) -> str | bool:
        if self.grad_scale is not None:
            return "unscale"
        return "skip" if self.found_inf is not None else False


def run(opt: LowPrecisionOptimizer, ctx: StepContext) -> None:
    """``step()`` after its closure: the pipeline."""
    in_backward = opt.__dict__.get("_in_backward")
    # (lowprec.step_in_backward: this call ends its step, and steps only what it left)
    if in_backward is not None and not in_backward._end_step(ctx.grad_scale, ctx.found_inf):
        return
    if opt.__dict__.get("_has_dtensors"):
        with local_shards(opt):
            stages(opt, ctx)
    else:
        stages(opt, ctx)


def stages(opt: LowPrecisionOptimizer, ctx: StepContext) -> None:
    """The three stages in turn, until one takes the step."""
    if buckets.step_buckets(opt, ctx) or replay.redo(opt, ctx):
        return
    full_step(opt, ctx)
    buckets.flatten(opt)


def full_step(opt: LowPrecisionOptimizer, ctx: StepContext) -> None:
    """The step that always applies: validate every parameter (``_collect``, raising before
    anything is written), check the gradients under a loss scaler, create the buffers an option
    turned on (``param_step.step_late``), step the large parameters one by one
    (``param_step.step_param``) and the small ones in batches (``batches.step_small``), and
    record what was done (``plan._Plan``) for ``replay.redo``."""
    opt._step_plan = None
    late: list[WorkItem] = []
    work = opt._collect(late)
    memo: Memo = {}
    scaling = None
    if ctx.scaled:
        scaling = _Scaling.prepare(
            work, ctx.grad_scale, ctx.found_inf, opt.__dict__.get("_shard_reduce")
        )
        counted = [(g, p, i, s, opt.state[p]) for g, p, i, s in work
                   if "step" in opt.state.get(p, ()) and not loss_scale._host_counts(p.device)]
        if counted:  # (every parameter's numbers at once, per group: not one by one)
            param_step.scaled_numbers_many(opt, counted, scaling, memo)
    if late:  # (rare: a step that creates buffers is not recorded)
        param_step.step_late(opt, late, scaling)
        ids = {id(p) for _, p, _, _ in late}
        work = [item for item in work if id(item[1]) not in ids]
        plan = None
    else:
        plan = _Plan(opt, ctx.scaled)  # (for the next steps to redo: replay.redo)
    memo["plan"] = plan
    large, small = _by_size(work)
    for group, p, index, storage in large:
        param_step.step_param(opt, group, p, index, storage, scaling, memo)
    small = batches.step_small(opt, small, memo, scaling)
    for group, p, index, storage in small:
        param_step.step_param(opt, group, p, index, storage, scaling, memo)
    opt._step_plan = plan
