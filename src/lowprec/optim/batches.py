"""Small parameters batched: a full step's parameters of up to ``_SMALL`` elements, a compiled call
per batch.

``_by_size`` orders a step's work: parameters of up to ``_SMALL`` elements come last, for
``step_small`` to step them in batches of up to ``_SMALL_BATCH`` elements, one compiled call
per batch, since the per-call cost of a compiled kernel is most of a small tensor's step.
``small_buckets`` decides the batches (per group, strategy, step number and gradient dtype; on
pairs where random keys are per parameter), ``plan._Batch`` holds one (its state buffers laid
out flat, ``plan._flat_state``, where possible), and ``run_batch`` steps it through the compiled
step (``compiled``), giving each parameter its own random bits. Only elementwise rules batch:
LAMB's per-parameter norms made its batches slower than a call per parameter
(``benchmarks/fast_path.py``), so its small parameters take their own calls. A
recorded step (``replay``) redoes the batches with ``run_batch``; ``checkpoint`` lays loaded
state out as ``small_buckets`` would batch it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch

from lowprec.numerics import stream_key
from lowprec.optim import compiled, loss_scale, param_step, qstate
from lowprec.optim.compiled import _COMPILE_ERRORS, _disable_fused, _fused_enabled
from lowprec.optim.loss_scale import _advance_counts, _mode, _Scaling
from lowprec.optim.plan import _Batch, _Entry, _flat

if TYPE_CHECKING:  # pragma: no cover
    from lowprec.optim._typing import Memo, WorkItem
    from lowprec.optim.base import LowPrecisionOptimizer
    from lowprec.optim.storage import MasterStorage

# Fused steps of parameters up to _SMALL elements are batched, up to _SMALL_BATCH elements per
# compiled call (the concatenated copies are the batch's only temporaries: a few MB at most).
_SMALL = 1 << 16
_SMALL_BATCH = 1 << 18
_UNSET = object()


def _by_size(work: list[WorkItem]) -> tuple[list[WorkItem], list[WorkItem]]:
    """``step()``'s order of its work list: the large parameters, largest first, then the small
    ones (up to ``_SMALL`` elements, batched). Parameters are independent (the random key is a
    parameter's index, not its position here), so only the batches depend on this order."""
    large: list[WorkItem] = []
    small: list[WorkItem] = []
    for item in sorted(work, key=lambda item: -item[1].numel()):
        (large if item[1].numel() > _SMALL or _eight_bit(item) else small).append(item)
    return large, small


def _batches_on(device: torch.device, storage: MasterStorage, dtype: torch.dtype) -> bool:
    """Whether small parameters of ``dtype`` on ``device`` under ``storage`` batch, per device
    type. Deterministic strategies batch on the CPU and on CUDA: a compiled call costs ~30-60 us
    of host work (Dynamo's guards and wrappers) on either, most of a small tensor's step, while a
    batch adds a concatenation and a ``_foreach_copy_`` (two launches on CUDA; not yet measured
    on a GPU: benchmarks/fast_path.py --device cuda). Stochastic rounding batches only on the
    CPU, on pairs of BF16 elements (its per-word keys: ``run_batch``), a CPU layout."""
    if device.type == "cpu":
        return not storage.needs_random_bits or storage.pairs_ok(dtype)
    return device.type == "cuda" and not storage.needs_random_bits


def _eight_bit(item: WorkItem) -> bool:
    """Whether a work item's buffers are 8-bit or 4-bit codes (``qstate``): stepped one by one,
    with their blocks' scales (a batch concatenates flat state)."""
    return item[0]["state_dtype"] in qstate.BITS and qstate.qualifies(item[1])


def step_small(
    opt: LowPrecisionOptimizer,
    items: list[WorkItem],
    memo: Memo,
    scaling: _Scaling | None = None,
) -> list[WorkItem]:
    """Fused steps of small parameters batched per group: one compiled call per batch.

    The per-call cost of a compiled kernel (~30-60 us, Dynamo's guards and wrappers) is most of
    a small tensor's step, and models have many (biases, norms). For deterministic
    elementwise strategies the batch's parameters and gradients are concatenated, stepped in
    one call with the group's coefficients (the state buffers in place where ``_flat_state``
    laid them out), and copied back: the same operations on every element, so the same bits.
    Stochastic rounding batches too, on pairs of elements (bfloat16 parameters of even
    length): each word of the batch is hashed with its own parameter's key and its index
    within that parameter, so it gets the random bits of the parameter's own step. Returns
    the items it did not take (stepped one by one as before).

    Under a loss scaler (``scaling``) the batch's call unscales and skips as a parameter's
    own does, on the CPU only, where reading the step counts on the host costs no
    synchronisation, so the coefficients are the group's host numbers as in a plain step
    (on CUDA a scaled step keeps its counts on the device: such parameters take their own
    calls). Which devices and strategies batch: ``_batches_on``.
    """
    held: list[WorkItem] = []
    if scaling is not None:  # (off the CPU the counts are on the device: never read here)
        held = [item for item in items if not loss_scale._host_counts(item[1].device)]
        items = [item for item in items if loss_scale._host_counts(item[1].device)]
    batches, rest = _small_batches(opt, items)
    rest.extend(held)
    plan = memo.get("plan")
    for batch in batches:
        if getattr(opt, "_fused_broken", False) or not run_batch(
            opt, batch, batch.step, memo, scaling
        ):
            rest.extend(batch.items)
        elif plan is not None:
            batch.entries = [
                _Entry(group, p, index, storage, opt.state[p], None)
                for group, p, index, storage in batch.items
            ]
            plan.add(batch)
    return rest


def _small_batches(
    opt: LowPrecisionOptimizer, items: list[WorkItem]
) -> tuple[list[_Batch], list[WorkItem]]:
    """``step_small``'s batches of ``items`` (two or more parameters each, creating
    their state), and the items left out."""
    fresh: set[int] = set()  # ids of the parameters whose state is created here
    buckets, rest = small_buckets(opt, items, fresh)
    batches = [_Batch(opt, batch, step, fresh) for step, batch in buckets]
    return batches, rest


def small_buckets(
    opt: LowPrecisionOptimizer, items: list[WorkItem], fresh: set[int] | None
) -> tuple[list[tuple[int, list[WorkItem]]], list[WorkItem]]:
    """How ``items`` (small parameters, in step order) fall into batches: ``(step, items)`` per
    batch of two or more, and the items left out.

    Per parameter this does only what must be redone each step (the host work here is most of a
    small tensor's cost): the state buffers' dtypes were checked by ``_collect``, so a batch is
    keyed by group, strategy, step and gradient dtype alone. With ``fresh`` a set, missing state is
    created (its parameters' ids added to ``fresh``); with None (a checkpoint being laid out,
    ``checkpoint._lay_out_loaded``) parameters without state are left out and each gradient is taken
    to be like its parameter, as ``backward`` makes it.
    """
    if getattr(opt, "_fused_broken", False) or not opt._elementwise:
        return [], items
    # Per-word random keys need every word within one parameter: such batches are on pairs,
    # of parameters of even length.
    rest: list[WorkItem] = []
    buckets: dict[Any, list[list[WorkItem]]] = {}
    filled_of: dict[Any, int] = {}
    names_of: dict[Any, Any] = {}  # per (group, strategy, dtype): buffer names, or None
    shard_offsets = opt.__dict__.get("_shard_offsets")
    for item in items:
        group, p, _index, storage = item
        ck = (id(group), storage.name, p.dtype)
        names = names_of.get(ck, _UNSET)
        if names is _UNSET:
            names = names_of[ck] = (
                (*storage.buffers(p), *opt._math_buffers(group, p))
                if _batches_on(p.device, storage, p.dtype) and not opt._whole(group)
                and _fused_enabled(opt, group, p)
                else None
            )
        g = cast(torch.Tensor, p.grad) if fresh is not None else p  # (a work item's: present)
        n = p.numel()
        if names is None or n < 2 or (n % 2 and storage.needs_random_bits) or (
            storage.needs_random_bits and shard_offsets and shard_offsets.get(id(p))
        ):
            # (a shard's random bits start at its offset: param_step.step_param)
            rest.append(item)
            continue
        state = opt.state[p]
        if not state:
            if fresh is None:
                rest.append(item)
                continue
            state.update(opt._init_state(group, p, storage))
            if not (shard_offsets and id(p) in shard_offsets):
                # (a DTensor's shard keeps its own state tensors: a DTensor made from a
                # view into a batch's flat tensor could not be saved or copied)
                fresh.add(id(p))
        if not (p.is_contiguous() and g.is_contiguous()) or not all(
            state[k].is_contiguous() for k in names
        ):
            rest.append(item)
            continue
        step = int(state["step"].item()) + 1
        key = (ck, step, g.dtype)
        bucket = buckets.get(key)
        if bucket is None:
            bucket = buckets[key] = [[]]
        filled = filled_of.get(key, 0)  # elements in the bucket's last batch
        if filled + n > _SMALL_BATCH:
            bucket.append([])
            filled = 0
        bucket[-1].append(item)
        filled_of[key] = filled + n
    batches = []
    for key, bucket in buckets.items():
        for batch in bucket:
            if len(batch) == 1:
                rest.extend(batch)
            else:
                batches.append((key[1], batch))
    return batches, rest


def run_batch(
    opt: LowPrecisionOptimizer,
    batch: _Batch,
    step: int,
    memo: Memo,
    scaling: _Scaling | None = None,
) -> bool:
    """One compiled step of ``batch`` at ``step`` (under ``scaling``, if given); False (nothing
    written) where it cannot run fused, for its parameters to be stepped one by one."""
    group, storage = batch.group, batch.storage
    flags = param_step.group_flags(opt, group, memo)
    coeffs, c32 = param_step.step_coefficients(opt, group, step, memo)
    params = torch.cat(batch.dst)
    grad = torch.cat([_flat(cast(torch.Tensor, p.grad)) for p in batch.ps])  # (stepped: present)
    # A state buffer laid out flat is stepped in place, the others concatenated.
    bufs = {k: torch.cat(batch.views[k]) if b is None else b for k, b in batch.bufs.items()}
    sbufs = {k: bufs[k] for k in batch.names_s}
    mbufs = {k: bufs[k] for k in batch.names_m}
    lo: Any = 0
    hi: Any = 0
    extra: dict[str, Any] = {}
    if scaling is not None:
        extra = scaling.kernel_args(params.device)
    keyed = storage.needs_random_bits
    if keyed:
        if compiled.pairs_plan(opt, storage, params, grad, sbufs, mbufs) is None:
            return False
        keys = [stream_key(group["seed"], step, i) for _, _, i, _ in batch.items]
        lo = torch.tensor([k & 0xFFFFFFFF for k in keys], dtype=torch.int64)
        hi = torch.tensor([k >> 32 for k in keys], dtype=torch.int64)
        extra["owner"], extra["idx"] = batch_layout(opt, batch.words)
    try:
        fused = compiled.prepare_fused(
            opt, storage, flags, params, grad, sbufs, mbufs, scaled=_mode(scaling), keyed=keyed,
        )
        compiled.run_fused(opt, fused, grad, coeffs, c32, lo, hi, extra)
    except _COMPILE_ERRORS as e:  # nothing of the parameters was written
        _disable_fused(opt, e)
        return False
    torch._foreach_copy_(batch.dst, params.split(batch.sizes))
    if "inv_scale" in extra:  # (the kernel unscaled the batch's copy of the gradients)
        torch._foreach_copy_([_flat(cast(torch.Tensor, p.grad)) for p in batch.ps],
                             grad.split(batch.sizes))
    for k, b in batch.bufs.items():
        if b is None:
            torch._foreach_copy_(batch.views[k], bufs[k].split(batch.sizes))
    _advance_counts(batch.counts, scaling)  # (each held step - 1, the batch's key)
    return True


def batch_layout(
    opt: LowPrecisionOptimizer, words: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """For a batch on pairs of parameters of ``words`` words each: every word's parameter (its
    position in the batch) and its index within that parameter (int32 each), for
    ``_param_update_pairs``'s per-word random keys. Kept per batch composition, which stays
    the same from step to step."""
    layouts = opt.__dict__.setdefault("_batch_layouts", {})
    layout = layouts.get(words)
    if layout is None:
        counts = torch.tensor(words, dtype=torch.int64)
        total = sum(words)
        owner = torch.repeat_interleave(
            torch.arange(len(words), dtype=torch.int64), counts, output_size=total
        )
        starts = torch.cumsum(counts, 0) - counts
        idx = torch.arange(total, dtype=torch.int64) - starts[owner]
        if len(layouts) >= 64:  # (a model whose batches keep changing: keep it bounded)
            layouts.clear()
        layout = layouts[words] = (owner.to(torch.int32), idx.to(torch.int32))
    return layout
