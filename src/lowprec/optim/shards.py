"""DTensor parameters (FSDP2's ``fully_shard``, tensor parallelism): the step runs on local shards.

lowprec's update rules and storage strategies work element by element on plain tensors: bit
operations on the stored words, views as pairs, compiled kernels over flat memory. A DTensor's
operators are dispatched shard by shard, and several of those (``view`` to another dtype, a plain
tensor of random bits beside a DTensor, ``_foreach`` copies) either fail or, for a split master,
gave wrong values. So a step over DTensor parameters runs on each rank's local shards instead:
``local_shards`` hands the step the local tensor of every DTensor parameter (with its local
gradient) and local views of its state, and afterwards keeps the state as DTensors of the
parameter's placements, as ``torch.optim`` keeps it, so that ``state_dict`` and distributed
checkpointing see sharded state. Under a loss scaler, the check of the gradients for inf/NaN is
combined over the ranks holding a parameter's shards, so that every rank skips the same steps.

What a shard cannot do alone is refused before anything is written:

* a rule with whole-tensor norms (LAMB's trust ratio) on a sharded parameter: its norms would be
  the shard's;
* stochastic rounding on a shard that is not one block of the parameter's flattened elements
  (e.g. sharded along a dimension other than the first): its random bits are keyed by the
  element's index in the whole parameter, so that a sharded run rounds as an unsharded one.
"""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # pragma: no cover
    from lowprec.optim.base import LowPrecisionOptimizer

try:
    from torch.distributed.tensor import DTensor, Replicate
except ImportError:  # pragma: no cover - torch built without distributed
    DTensor = Replicate = None  # type: ignore[assignment,misc]


def is_dtensor(t: Any) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor holding this rank's elements of DTensor ``t``: the same object every call (the
    step writes into it in place). ``to_local()`` hands a parameter a fresh view each time, so a
    parameter's own local tensor is taken as DTensor's no-grad ``to_local`` takes it."""
    lt = getattr(t, "_local_tensor", None)
    if isinstance(lt, torch.Tensor):
        return lt
    with torch.no_grad():  # pragma: no cover - a DTensor without the attribute
        return t.to_local()


def wrap_like(t: torch.Tensor, p: Any) -> Any:
    """Local tensor ``t`` (shaped as ``p``'s shard) as a DTensor of ``p``'s mesh and placements."""
    with torch.no_grad():
        return DTensor.from_local(
            t, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
        )


def flat_offset(p: Any) -> int | None:
    """Index, in ``p`` flattened, of the first element of this rank's shard, where the shard is
    one block of consecutive elements (replicated, or sharded along the first dimension only);
    else None."""
    if all(isinstance(pl, Replicate) for pl in p.placements):
        return 0
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError:  # pragma: no cover
        return None
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    if tuple(shape[1:]) != tuple(p.shape[1:]) or any(offset[1:]):
        return None
    return int(offset[0]) * math.prod(p.shape[1:]) if p.dim() else 0


def _check(opt: LowPrecisionOptimizer, gi: int, pi: int, p: Any, storage: Any) -> None:
    where = f"parameter group {gi}, parameter {pi}"
    g = p.grad
    if g is not None and (not is_dtensor(g) or tuple(g.placements) != tuple(p.placements)):
        got = tuple(g.placements) if is_dtensor(g) else "a plain tensor"
        raise ValueError(
            f"{where}: a DTensor parameter placed as {tuple(p.placements)} has a gradient placed "
            f"as {got}; the step updates each rank's shard with its own gradient, so the "
            "gradient must be placed as the parameter (FSDP2 and DTensor's backward do so)."
        )
    sharded = not all(isinstance(pl, Replicate) for pl in p.placements)
    if sharded and opt._norm_terms is not None:
        raise NotImplementedError(
            f"{where}: {type(opt).__name__} needs norms over the whole tensor, and this DTensor "
            f"parameter is sharded ({tuple(p.placements)}): each rank holds only its shard. Keep "
            "such parameters replicated, or use an elementwise optimizer (SGD, AdamW, Adagrad)."
        )
    if storage.needs_random_bits and flat_offset(p) is None:
        raise NotImplementedError(
            f"{where}: stochastic rounding keys its random bits by the element's index in the "
            f"whole parameter, and this shard ({tuple(p.placements)}) is not one block of it. "
            "Shard such parameters along their first dimension (FSDP2 does), or choose another "
            "master."
        )


@contextlib.contextmanager
def local_shards(opt: LowPrecisionOptimizer) -> Iterator[None]:
    """For the length of a step: every DTensor parameter replaced, in ``opt.param_groups``, by its
    local tensor carrying its local gradient, and ``opt.state`` by a map whose entries for those
    tensors hold local views of the DTensor state (the other entries are the optimizer's own
    dicts). The state dicts of the local tensors are kept from step to step, so that a recorded
    step (``_replay``) is redone as for plain parameters. Afterwards every parameter-shaped state
    tensor is a DTensor of the parameter's placements. Nothing is changed if a check fails."""
    groups = opt.param_groups
    work = []
    for gi, group in enumerate(groups):
        storages = opt._validate_group(group, gi)
        for pi, (p, storage) in enumerate(zip(group["params"], storages, strict=True)):
            if is_dtensor(p):
                _check(opt, gi, pi, p, storage)
                work.append((gi, pi, p))
    saved_state = opt.state
    saved_params = [group["params"] for group in groups]
    cache: dict[int, tuple[Any, torch.Tensor, dict[str, Any]]] = opt.__dict__.setdefault(
        "_shard_states", {}
    )
    offsets: dict[int, int] = {}
    # Process groups over which a shard's inf/NaN check must agree (a loss scaler's skip):
    # every mesh dimension a parameter is sharded along.
    reduce: dict[int, Any] = {}
    for _, _, p in work:
        for dim, pl in enumerate(p.placements):
            if not isinstance(pl, Replicate):
                group = p.device_mesh.get_group(dim)
                reduce.setdefault(id(group), group)
    state: defaultdict[Any, dict[str, Any]] = defaultdict(dict)
    for k, v in saved_state.items():
        if not is_dtensor(k):
            state[k] = v
    swapped = []
    params = [list(ps) for ps in saved_params]
    for gi, pi, p in work:
        lp = local(p)
        entry = cache.get(id(p))
        if entry is None or entry[0] is not p or entry[1] is not lp:
            entry = cache[id(p)] = (p, lp, {})
        lstate = entry[2]
        dstate = saved_state.get(p, {})
        for k in [k for k in lstate if k not in dstate]:
            del lstate[k]
        for k, v in dstate.items():
            v = local(v) if is_dtensor(v) else v
            if lstate.get(k) is not v:
                lstate[k] = v
        state[lp] = lstate
        params[gi][pi] = lp
        offsets[id(lp)] = flat_offset(p) or 0
        swapped.append((p, lp, lstate))
    try:
        for p, lp, _ in swapped:
            lp.grad = None if p.grad is None else local(p.grad)
        for group, ps in zip(groups, params, strict=True):
            group["params"] = ps
        opt.state = state
        opt._shard_offsets = offsets
        opt._shard_reduce = list(reduce.values())
        yield
    finally:
        for group, ps in zip(groups, saved_params, strict=True):
            group["params"] = ps
        opt.state = saved_state
        opt._shard_offsets = opt._shard_reduce = None
        shards = {id(lp) for _, lp, _ in swapped}
        for k, v in state.items():
            if v and id(k) not in shards and k not in saved_state:
                saved_state[k] = v  # (state a plain parameter got in this step)
        for p, lp, lstate in swapped:
            lp.grad = None
            if not lstate:
                continue
            dstate = saved_state[p]
            for k, v in list(lstate.items()):
                if isinstance(v, torch.Tensor) and k != "step" and v.shape == lp.shape:
                    d = dstate.get(k)
                    if not (is_dtensor(d) and local(d) is v):
                        d = dstate[k] = wrap_like(v, p)
                        lstate[k] = local(d)
                else:
                    dstate[k] = v


def init_state_local(opt: LowPrecisionOptimizer, group: dict[str, Any], p: Any, storage: Any):
    """``opt._init_state`` for DTensor ``p``: computed on its shard, kept as DTensors."""
    lp = local(p)
    st = opt._init_state(group, lp, storage)
    return {
        k: wrap_like(v, p) if isinstance(v, torch.Tensor) and k != "step" and v.shape == lp.shape
        else v
        for k, v in st.items()
    }
