"""What ``step()`` does after its closure: one grouping, the buckets, from the first step on.

``run`` steps through the buckets (``step_buckets``). Where they decline (the first step, or
something they were laid out for changed) ``stages`` validates every parameter (``core.collect``,
raising before anything is written), creates the missing state in the buckets' flat buffers
(``new_state``), lays them out (``flatten``) and steps through them. ``full_step``, every parameter
on its own and eager, takes only buffers an option turned on since a parameter's last step. The
update inside backward and DTensor shards go through the same buckets. docs/architecture.md, "How a
step flows", tells the whole path.
"""

from __future__ import annotations

import contextlib
import math
import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch

# (called through their modules: tests replace these functions)
from lowprec.optim import core, param_step, qstate, update
from lowprec.optim.buckets import _Bucket, _gathered
from lowprec.optim.compiled import _PAIR_DTYPES
from lowprec.optim.loss_scale import _Scaling, skipped_on_host
from lowprec.optim.options import in_step
from lowprec.optim.param_step import Memo
from lowprec.optim.shards import local_shards, reduce_groups

if TYPE_CHECKING:  # pragma: no cover
    from lowprec.optim._typing import WorkItem
    from lowprec.optim.core import Rule, Stepped
    from lowprec.optim.storage import MasterStorage


@dataclass(frozen=True)
class StepContext:
    """What one ``step()`` hands its stages: the loss scaler's inputs and how the kernels take them
    (``scaled``: ``"unscale"`` with a scale, ``"skip"`` with ``found_inf`` alone, else False)."""

    grad_scale: torch.Tensor | float | None = None
    found_inf: torch.Tensor | None = None

    @property
    def scaled(self) -> str | bool:
        if self.grad_scale is not None:
            return "unscale"
        return "skip" if self.found_inf is not None else False


def run(opt: Stepped, ctx: StepContext) -> None:
    """``step()`` after its closure."""
    in_backward = core.stages(opt).in_backward
    # (lowprec.step_in_backward: this call ends its step, and steps only what it left)
    if in_backward is not None and not in_backward._end_step(ctx.grad_scale, ctx.found_inf):
        return
    shards = local_shards(opt) if core.stages(opt).has_dtensors else contextlib.nullcontext()
    with in_step(), shards:  # (a tensor hyperparameter's value is not read on the host)
        stages(opt, ctx)


def stages(opt: Stepped, ctx: StepContext) -> None:
    """The buckets' step; where they decline, validate, create the missing state, lay them out and
    try again; ``full_step`` only for what they still decline."""
    if step_buckets(opt, ctx):
        return
    late: list[WorkItem] = []
    work = core.collect(opt, late)  # (raises before anything is written)
    fresh = new_state(opt, [item for item in work if not opt.state[item[1]]])
    if not late:
        flatten(opt, fresh)
        if step_buckets(opt, ctx):
            return
    full_step(opt, ctx, work, late)
    flatten(opt, fresh)


def new_state(opt: Stepped, work: list[WorkItem]) -> set[int]:
    """Create the state of ``work``'s parameters (which have none) where the buckets will keep it:
    one flat buffer per group, dtype, strategy and state tensor, each parameter's share a view, in
    ``flatten``'s order, so a bucket takes its run of views as its flat buffer. A parameter no
    bucket gathers gets tensors of its own. Returns the flat buffers' ids, for ``flatten``."""
    shards = core.stages(opt).shard_offsets or {}
    rules = {id(group): opt.rule(group) for group in opt.param_groups}
    need: dict[Any, list[tuple[int, str, tuple[int, ...]]]] = {}
    for group, p, _, storage in sorted(work, key=lambda item: (
            id(item[0]), *_order(item[1], rules[id(item[0])].norms))):
        if _own_step(rules[id(group)], p) or p.numel() % 2 or id(p) in shards:
            continue
        rule = rules[id(group)]
        expected = core._expected_state(rule, group, p, storage)
        # (keyed as a bucket is, so that a bucket takes its run of views whole)
        for name, (dtype, shape) in core.state_layout(rule, group, p, expected).items():
            need.setdefault((id(group), p.dtype, storage.name, name, dtype, p.device), []).append(
                (id(p), name, shape))
    out: dict[int, dict[str, torch.Tensor]] = {}
    for (*_, dtype, device), members in need.items():
        sizes = [math.prod(shape) for _, _, shape in members]
        flat = torch.empty(sum(sizes), dtype=dtype, device=device)
        for (pid, name, shape), view in zip(members, flat.split(sizes), strict=True):
            out.setdefault(pid, {})[name] = view.view(shape)
    for group, p, _, storage in work:
        opt.state[p].update(core.init_state(rules[id(group)], group, p, storage,
                                            out=out.get(id(p))))
    return {id(t._base) for views in out.values() for t in views.values()}


def full_step(
    opt: Stepped, ctx: StepContext, work: list[WorkItem], late: list[WorkItem]
) -> None:
    """Every parameter of ``work`` on its own, eager (the reference the buckets are tested
    against); those in ``late`` create the buffers an option turned on (``first_use``)."""
    memo = Memo()
    got = _scaling(opt, ctx, work)
    if got is True:
        return
    late_ids = {id(p) for _, p, _, _ in late}
    for group, p, index, storage in work:
        param_step.step_param(opt, group, p, index, storage, got or None, memo,
                              first_use=id(p) in late_ids)


def _scaling(opt: Stepped, ctx: StepContext, work: list[WorkItem]) -> _Scaling | bool:
    """How ``work``'s step takes the loss scaler, decided before anything is written: True, skipped;
    False, the plain step (no scaler, or gradients unscaled in place on the host:
    ``loss_scale.skipped_on_host``); else the kernels take its inputs (``_Scaling``)."""
    if not ctx.scaled:
        return False
    reduce = core.stages(opt).shard_reduce
    if not core.stages(opt).capturable:  # (reads the finding on the host, on the CPU alone)
        skipped = skipped_on_host(work, ctx.grad_scale, ctx.found_inf, reduce)
        if skipped is not None:
            return skipped
    return _Scaling.prepare(work, ctx.grad_scale, ctx.found_inf, reduce)


def _kind(
    opt: Stepped, rule: Rule, group: dict[str, Any], p: torch.Tensor,
    storage: MasterStorage,
) -> tuple[Any, ...] | None:
    """``p``'s bucket key (device, dtypes, strategy, its state's layout; ``id(p)`` last where it
    must be a bucket of one), or None where it is stepped on its own."""
    state = opt.state.get(p)
    if _own_step(rule, p) or not state:
        return None
    keyed = storage.needs_random_bits
    # (a DTensor's shard keeps its state in tensors of its own: torch 2.13 cannot deep-copy a
    # DTensor over a view of a flat buffer, as copy.deepcopy(opt.state_dict()) does)
    st = core.stages(opt)
    offsets = st.shard_offsets or {}
    start = offsets.get(id(p), 0)
    # (a shard whose sums add every rank's: in buckets of its mesh's groups alone)
    groups = reduce_groups(opt, p) if rule.norms else []
    shard = ("shard", *map(id, groups)) if id(p) in offsets else False
    # A bucket of one: an odd size (the next tensor's words off their pair boundary); random
    # bits keyed per word without BF16 pairs; a shard keyed from an odd offset (its words are
    # not its parameter's) or past int32 indices, or whose sums add every rank's where its
    # shards' shapes differ between ranks (each would cut other pieces); codes with random keys
    # or norms (never on pairs, nor rows).
    alone = (p.numel() % 2 or (keyed and not storage.pairs_ok(p.dtype))
             or (shard and keyed and (start % 2 or start + p.numel() > update._INT32_MAX))
             or (groups and id(p) not in (st.shard_even or ())))
    step = state.get("step")  # (on the CPU, or on the parameter's device after a scaled step)
    if (not isinstance(step, torch.Tensor) or step.dim() != 0
            or (step.device.type != "cpu" and step.device != p.device)):
        return None
    # (codes: a byte per element, or per two; scales: one per block. A parameter with codes
    # is whole blocks, so its scales' share of a flat buffer starts where its elements' would.)
    per: dict[str, int] = {}
    for name, f in core.qformats(rule, group, state, p):
        per[name], per[qstate.scale_key(name)] = 1 + f.endswith("4"), qstate.BLOCK
    alone = alone or bool(per and (keyed or rule.norms))
    maths = rule.buffers(p)
    names = (*storage.buffers(p), *maths, *(k for k in map(qstate.scale_key, maths) if k in per))
    layout: list[tuple[str, torch.dtype, int]] = []
    for name in names:
        t, n = state.get(name), per.get(name, 1)
        if (not isinstance(t, torch.Tensor) or not t.is_contiguous() or t.device != p.device
                or (t.shape != p.shape if n == 1 else t.numel() * n != p.numel())
                or rule.buffer_shape(name, p) is not None
                or t.is_shared()):  # (another process reads it: never moved)
            return None
        alone = alone or (keyed and t.dtype not in _PAIR_DTYPES)  # (pairs: compiled.pairs_plan)
        layout.append((name, t.dtype, n))
    return (p.device, p.dtype, storage.name, step.dtype, step.device, shard, tuple(layout),
            id(p) if alone else None)


def _own_step(rule: Rule, p: torch.Tensor) -> bool:
    """Whether ``p`` is in no bucket: a whole-tensor ``rule``, one element, or not contiguous."""
    return rule.whole or p.numel() < 2 or not p.is_contiguous()


def _order(p: torch.Tensor, norms: bool) -> tuple[bool, int]:
    """Where ``p`` goes in its bucket: the large parameters first, each a piece of its own, then the
    small ones, gathered; for a rule with norms, equal sizes side by side."""
    return p.numel() < _gathered(p.device), p.numel() if norms else 0


class _Layout:
    """An optimizer's buckets and what they were made for: its groups, their parameters and options
    (``core.step_options``); the parameters stepped on their own (``rest``: group, position, index);
    each bucketed parameter's bucket and position (``where``)."""

    __slots__ = ("buckets", "groups", "rest", "where")

    def __init__(self, opt: Stepped) -> None:
        self.groups = [(g, list(g["params"]), core.step_options(opt, g))
                       for g in opt.param_groups]
        self.buckets: list[_Bucket] = []
        self.rest: list[tuple[int, int, int]] = []
        self.where: dict[int, tuple[_Bucket, int]] = {}

    def same_groups(self, opt: Stepped) -> bool:
        groups = opt.param_groups
        return len(groups) == len(self.groups) and all(
            group is ref and len(group["params"]) == len(params)
            and all(map(operator.is_, group["params"], params))
            for group, (ref, params, _) in zip(groups, self.groups, strict=True)
        )

    def same_options(self, opt: Stepped) -> bool:
        """Whether each group's options are those its buckets were made for."""
        return all(core.step_options(opt, g) == options for g, _, options in self.groups)


def buckets_of(opt: Stepped) -> _Layout | None:
    """The buckets ``flatten`` laid out last (``core.Stages.buckets``)."""
    return cast("_Layout | None", core.stages(opt).buckets)


def flatten(opt: Stepped, fresh: set[int] | None = None) -> None:
    """Lay the buckets out (the first step, and after a change), keeping those that still hold.
    ``fresh``: the flat buffers ``new_state`` made for this step's new state."""
    old = buckets_of(opt)
    kept: dict[Any, _Bucket] = {}
    if old is not None and old.same_groups(opt):
        # (a bucket is kept only where its group's options and flags are the same)
        same = {id(g) for g, _, options in old.groups if core.step_options(opt, g) == options}
        kept = {(b.kind, *map(id, b.params)): b for b in old.buckets
                if id(b.group) in same and b.current(opt)}
    layout = _Layout(opt)
    index = -1
    for gi, group in enumerate(opt.param_groups):
        storages = core.validate_group(opt, group, gi)
        kinds: dict[Any, list[tuple[torch.Tensor, int, int, MasterStorage]]] = {}
        rule = opt.rule(group)
        for pi, (p, storage) in enumerate(zip(group["params"], storages, strict=True)):
            index += 1
            kind = _kind(opt, rule, group, p, storage)
            if kind is None:
                layout.rest.append((gi, pi, index))
            else:
                kinds.setdefault(kind, []).append((p, index, pi, storage))
        for kind, members in kinds.items():
            members.sort(key=lambda m: _order(m[0], rule.norms))
            bucket = kept.pop((kind, *(id(p) for p, *_ in members)), None)
            if bucket is None:
                bucket = _Bucket(opt, group, kind, [(p, i) for p, i, _, _ in members],
                                 members[0][3], fresh)
            layout.buckets.append(bucket)
            layout.where.update((id(p), (bucket, k)) for k, p in enumerate(bucket.params))
    layout.rest.sort()
    core.stages(opt).buckets = layout


def laid_out(opt: Stepped) -> bool:
    """Whether the buckets still hold: the same groups, parameters, options and state."""
    layout = buckets_of(opt)
    return (layout is not None and layout.same_groups(opt) and layout.same_options(opt)
            and all(b.current(opt) for b in layout.buckets))


def step_buckets(opt: Stepped, ctx: StepContext) -> bool:
    """A step through the buckets: validate as the full step does, check the loss scaler's gradients
    first (``_scaling``), make the numbers of every run's first count at once, per group, on the
    device, then step each bucket and each parameter stepped on its own, in the parameters' order
    (every rank makes its all-reduces in one order). False, having written nothing, where anything
    the buckets rely on changed."""
    layout = buckets_of(opt)
    if layout is None or not layout.same_groups(opt):
        return False
    # (every group validated first: raises as the full step would)
    storages = [core.validate_group(opt, group, gi) for gi, group in enumerate(opt.param_groups)]
    if not layout.same_options(opt):
        return False
    grads: list[tuple[list[torch.Tensor | None], bool]] = []
    for bucket in layout.buckets:
        got = bucket.gradients() if bucket.current(opt) else None
        if got is None:
            return False
        grads.append(got)
    rest: list[WorkItem] = []
    expected: dict[Any, dict[str, torch.dtype]] = {}
    memo = Memo()
    for gi, pi, index in layout.rest:
        group = opt.param_groups[gi]
        p = group["params"][pi]
        if p.grad is None:
            continue
        if not opt.state.get(p):
            return False  # (its first gradient: its state is made where a bucket takes it)
        storage = storages[gi][pi]
        rule = param_step.group_rule(opt, group, memo)
        if core.check_param(opt, rule, group, p, storage, (gi, pi), expected):
            return False  # (buffers to create: the full step's first_use)
        rest.append((group, p, index, storage))
    scaling: _Scaling | None = None
    counted = [(group, p, index, storage, opt.state[p]) for group, p, index, storage in rest]
    firsts: list[tuple[dict[str, Any], torch.Tensor, int, MasterStorage, dict[str, Any]]] = []
    if ctx.scaled:
        work = [(b.group, p, i, b.storage) for b, (gs, _) in zip(layout.buckets, grads, strict=True)
                for p, i, g in zip(b.params, b.indices, gs, strict=True) if g is not None]
        got = _scaling(opt, ctx, work + rest)
        if got is True:
            return True
        scaling = got or None
    runs: list[list[tuple[int, int]]] = []  # (per bucket: its runs of equal counts)
    for bucket, (gs, _) in zip(layout.buckets, grads, strict=True):
        runs.append([])
        if any(g is not None for g in gs):  # (each run's first count)
            bucket.place_counts()
            # (read on the CPU, where it is free, so that a count written through .data is seen)
            read = bucket.counts.device.type == "cpu" and not core.stages(opt).capturable
            runs[-1] = bucket.runs(gs, bucket.count_marks(read))
            firsts += [(bucket.group, bucket.params[i], bucket.indices[i], bucket.storage,
                        bucket.states[i]) for i, _ in runs[-1]]
    for items, keys in ((counted, True), (firsts, False)):  # (on the device, at once per group;
        if items:  # a bucket makes its pieces' random keys itself)
            param_step.step_numbers_many(opt, items, scaling, memo, keys)
    # (in the parameters' order, the same on every rank: the all-reduces of shards' sums)
    order: list[tuple[int, _Bucket | WorkItem, Any]] = [
        (b.indices[0], b, (gs, alone, rs))
        for b, (gs, alone), rs in zip(layout.buckets, grads, runs, strict=True)]
    order += [(item[2], item, None) for item in rest]
    for _, what, got in sorted(order, key=operator.itemgetter(0)):
        if isinstance(what, _Bucket):
            what.step(opt, got[0], memo, scaling, got[1], got[2])
        else:
            param_step.step_param(opt, *what, scaling, memo)
    return True
