"""What ``step()`` does after its closure: one grouping, the buckets, from the first step on.

``step()`` (``base``) makes a ``StepContext`` of the loss scaler's inputs and calls ``run``. A
group's parameters are laid out in buckets (``buckets.flatten``) as soon as their state exists,
so every step, the first included, goes through ``buckets.step_buckets``: a few calls per bucket
whatever the number of tensors, and the parameters no bucket takes (whole-tensor rules, odd
sizes, ...) each by its own step, prepared once and kept (``param_step._Entry``). The first step,
or one after something the buckets were made for changed (a parameter rebound, state loaded),
validates every parameter (``_collect``, raising before anything is written), creates the
missing state, lays the buckets out again and steps through them. ``full_step``, every parameter
on its own, is left for what the buckets decline: buffers an option turned on since a
parameter's last step (``param_step.step_late``), and a step under a loss scaler on a GPU whose
bucket counts differ. Nothing is recorded and replayed: a bucket keeps its compiled calls, and
that is the whole cache.

The update inside backward (``in_backward``) ends its step here too, and a DTensor's parameters
are stepped as their local shards (``shards.local_shards``), in buckets of their own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

# (called through their modules: tests replace these functions)
from lowprec.optim import buckets, param_step
from lowprec.optim.loss_scale import _Scaling
from lowprec.optim.options import in_step
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
    """``step()`` after its closure."""
    in_backward = opt.__dict__.get("_in_backward")
    # (lowprec.step_in_backward: this call ends its step, and steps only what it left)
    if in_backward is not None and not in_backward._end_step(ctx.grad_scale, ctx.found_inf):
        return
    with in_step():  # (a tensor hyperparameter's value is not read on the host)
        if opt.__dict__.get("_has_dtensors"):
            with local_shards(opt):
                stages(opt, ctx)
        else:
            stages(opt, ctx)


def stages(opt: LowPrecisionOptimizer, ctx: StepContext) -> None:
    """The buckets' step; where they decline (the first step, or something they were made for
    changed), validate, create the missing state, lay them out and try again; ``full_step``
    only for what they still decline."""
    if buckets.step_buckets(opt, ctx):
        return
    late: list[WorkItem] = []
    work = opt._collect(late)  # (raises before anything is written)
    if not late:
        for group, p, _, storage in work:
            state = opt.state[p]
            if not state:  # (lazily, with only the buffers its strategy needs)
                state.update(opt._init_state(group, p, storage))
        buckets.flatten(opt)
        if buckets.step_buckets(opt, ctx):
            return
    full_step(opt, ctx, work, late)
    buckets.flatten(opt)


def full_step(
    opt: LowPrecisionOptimizer, ctx: StepContext, work: list[WorkItem], late: list[WorkItem]
) -> None:
    """Every parameter of ``work`` (validated by ``_collect``) on its own: check the gradients
    under a loss scaler, create the buffers an option turned on (``late``:
    ``param_step.step_late``), step the others (``param_step.step_param``)."""
    memo: Memo = {}
    scaling = None
    if ctx.scaled:
        scaling = _Scaling.prepare(
            work, ctx.grad_scale, ctx.found_inf, opt.__dict__.get("_shard_reduce")
        )
    counted = [(g, p, i, s, opt.state[p]) for g, p, i, s in work
               if "step" in opt.state.get(p, ()) and not param_step.host_counts(opt, p.device)]
    if counted:  # (every parameter's numbers at once, per group: not one by one)
        param_step.scaled_numbers_many(opt, counted, scaling, memo)
    if late:
        param_step.step_late(opt, late, scaling)
        ids = {id(p) for _, p, _, _ in late}
        work = [item for item in work if id(item[1]) not in ids]
    for group, p, index, storage in work:
        param_step.step_param(opt, group, p, index, storage, scaling, memo)
