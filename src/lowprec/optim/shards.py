"""DTensor parameters (FSDP2's ``fully_shard``, tensor parallelism): the step runs on local shards.

DTensor dispatch breaks the step's elementwise bit work (``view`` to another dtype, random bits
beside a DTensor and ``_foreach`` copies fail, or give a split master wrong values), so
``local_shards`` hands the step each DTensor's local tensor, gradient and state, and keeps the
state as DTensors placed as the parameter. A loss scaler's inf/NaN finding and LAMB's sums are
combined over the ranks holding a parameter's shards. What a shard cannot do alone is refused
before anything is written (``_refusal``, ``_check_seeds``).
"""

from __future__ import annotations

import contextlib
import warnings
from collections import defaultdict
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, cast

import torch

from lowprec.optim import core, qstate
from lowprec.optim.dtensor import flat_offset, is_dtensor, local, mark_blocks, wrap_state
from lowprec.optim.storage import resolve_master

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Placement

    from lowprec.optim.core import Stepped
    from lowprec.optim.storage import MasterStorage

class _Shard:
    """A DTensor parameter's step data, kept while it, its local tensor and placements stay: its
    local state dict (kept so its bucket holds), its first element's flat index (stochastic
    rounding's key) and the process groups its shards span."""

    __slots__ = ("even", "groups", "local", "lstate", "offset", "p", "placements", "verdict")

    def __init__(self, p: DTensor, lp: torch.Tensor) -> None:
        self.p, self.local = p, lp
        self.lstate: dict[str, Any] = {}
        mark_blocks(p)
        self.placements: tuple[Placement, ...] = tuple(p.placements)
        self.offset = flat_offset(p) if qstate.block_sharded(p) else None
        mesh = p.device_mesh
        self.groups = [mesh.get_group(d) for d, pl in enumerate(self.placements)
                       if not pl.is_replicate()]
        self.even = even_shards(p)
        # (options checked, the error a step must raise or None, whether it rounds randomly)
        self.verdict: tuple[Any, ...] | None = None

    def current(self, p: DTensor) -> bool:
        return self.p is p and self.local is local(p) and tuple(p.placements) == self.placements


def _refusal(
    where: str, shard: _Shard, storage: MasterStorage, eight_bit: bool, whole: str | None = None
) -> NotImplementedError | None:
    """The error a step of this shard must raise under these options, or None. ``whole``: the
    optimizer's name where its rule needs whole tensors (``_whole``)."""
    placements = shard.placements
    if whole and tuple(shard.local.shape) != tuple(shard.p.shape):
        return NotImplementedError(
            f"{where}: lowprec.{whole} needs each parameter whole (Muon orthogonalizes the "
            "whole matrix, Adafactor takes means over its rows and columns), and this rank "
            f"holds a shard of it ({placements}). Step sharded parameters with an elementwise "
            "optimizer (lowprec.AdamW, Adam, Lion, StableAdamW), or keep these parameters "
            "replicated (e.g. out of fully_shard's modules)."
        )
    if eight_bit and qstate.qualifies(shard.p) and not shard.local.is_contiguous():
        return NotImplementedError(
            f"{where}: this rank's shard of the parameter is not contiguous, and 8-bit state "
            "(state_dtype='8bit') steps a shard's blocks as runs of its memory. Shard it as "
            "FSDP2 does (contiguous local tensors), or pass another state_dtype for it."
        )
    if storage.needs_random_bits and shard.offset is None:
        return NotImplementedError(
            f"{where}: stochastic rounding keys its random bits by the element's index in the "
            f"whole parameter, and the shards of this parameter ({placements}) are not blocks "
            "of it. Shard such parameters along their first dimension only (FSDP2 does), or "
            "choose another master."
        )
    return None


def _check_grad(where: str, p: DTensor) -> None:
    g = p.grad
    if g is not None and (not is_dtensor(g) or tuple(g.placements) != tuple(p.placements)):
        got = tuple(g.placements) if is_dtensor(g) else "a plain tensor"
        raise ValueError(
            f"{where}: a DTensor parameter placed as {tuple(p.placements)} has a gradient placed "
            f"as {got}; the step updates each rank's shard with its own gradient, so the "
            "gradient must be placed as the parameter (FSDP2 and DTensor's backward do so)."
        )


def _check_seeds(opt: Stepped, rounding: list[tuple[int, _Shard]]) -> None:
    """Refuse stochastic rounding with seeds that differ between a mesh's ranks (``seed=None`` is
    each rank's ``torch.initial_seed()``). A collective per mesh, on the first step of each set
    of seeds, which every rank takes alike."""
    seeds: dict[DeviceMesh, dict[int, int]] = {}
    for gi, shard in rounding:
        seeds.setdefault(shard.p.device_mesh, {})[gi] = opt.param_groups[gi]["seed"]
    key = tuple((id(mesh), tuple(sorted(d.items()))) for mesh, d in seeds.items())
    if not key or core.stages(opt).seeds_checked == key:
        return
    for mesh, d in seeds.items():
        halves = [v for seed in d.values() for v in (seed & 0xFFFFFFFF, seed >> 32)]
        mine = torch.tensor(halves + [-v for v in halves], dtype=torch.int64,
                            device=mesh.device_type)
        both = mine.clone()
        for dim in range(mesh.ndim):  # (MAX over every dimension: over the whole mesh)
            torch.distributed.all_reduce(both, op=torch.distributed.ReduceOp.MAX,
                                         group=mesh.get_group(dim))
        n = len(halves)
        if not torch.equal(both[:n], -both[n:]):
            differ = sorted({gi for j, gi in enumerate(g for g in d for _ in (0, 1))
                             if both[j] != -both[n + j]})
            raise ValueError(
                f"parameter group(s) {differ}: the ranks of a device mesh round their DTensor "
                "parameters stochastically with different seeds (seed=None takes "
                "torch.initial_seed(), which differs between ranks not seeded alike), so "
                "replicas would drift apart. Pass the same seed= on every rank, or call "
                "torch.manual_seed with the same value on every rank before creating the "
                "optimizer."
            )
    core.stages(opt).seeds_checked = key


@contextlib.contextmanager
def local_shards(opt: Stepped) -> Iterator[None]:
    """For a step: each DTensor parameter in ``opt.param_groups`` as its local tensor with its
    local gradient, ``opt.state`` holding local views of its state (kept across steps, so buckets
    hold); afterwards the state is DTensors again. Nothing changes if a check fails."""
    groups = opt.param_groups
    old: dict[int, _Shard] = core.stages(opt).shards
    shards: dict[int, _Shard] = {}  # (only the current parameters: dropped ones are let go)
    work = []
    for gi, group in enumerate(groups):
        for pi, p in enumerate(group["params"]):
            if not is_dtensor(p):
                continue
            shard = old.get(id(p))
            if shard is None or not shard.current(p):
                shard = _Shard(p, local(p))
            shards[id(p)] = shard
            where = f"parameter group {gi}, parameter {pi}"
            _check_grad(where, p)
            options = (id(group), group["master"], p.dtype, group["state_dtype"])
            if shard.verdict is None or shard.verdict[0] != options:
                core.validate_options(opt, group, gi)
                storage = resolve_master(group["master"], p.dtype)
                eight_bit = group["state_dtype"] == qstate.EIGHT_BIT
                whole = type(opt).__name__ if opt.rule(group).whole else None
                shard.verdict = (options, _refusal(where, shard, storage, eight_bit, whole),
                                 storage.needs_random_bits)
            if shard.verdict[1] is not None:
                raise shard.verdict[1]
            work.append((gi, pi, shard))
    _check_seeds(opt, [(gi, shard) for gi, _, shard in work
                       if cast("tuple[Any, ...]", shard.verdict)[2]])
    core.stages(opt).shards = shards
    saved_state = opt.state
    saved_params = [group["params"] for group in groups]
    state: defaultdict[Any, dict[str, Any]] = defaultdict(dict)
    for k, v in saved_state.items():
        if not is_dtensor(k):
            state[k] = v
    params = [list(ps) for ps in saved_params]
    offsets: dict[int, int] = {}
    even: set[int] = set()
    groups_of: dict[int, list[ProcessGroup]] = {}
    reduce: dict[int, ProcessGroup] = {}
    for gi, pi, shard in work:
        p, lp, lstate = shard.p, shard.local, shard.lstate
        dstate = saved_state.get(p, {})
        for k in [k for k in lstate if k not in dstate]:
            del lstate[k]
        for k, v in dstate.items():
            v = local(v)
            if not _aliases(lstate.get(k), v):
                lstate[k] = v
        state[lp] = lstate
        params[gi][pi] = lp
        offsets[id(lp)] = shard.offset or 0
        if shard.even:
            even.add(id(lp))
        if shard.groups:
            groups_of[id(lp)] = shard.groups
        for group in shard.groups:  # (a loss scaler's skip must agree over these)
            reduce.setdefault(id(group), group)
    try:
        for _, _, shard in work:
            g = shard.p.grad
            shard.local.grad = None if g is None else local(g)
        for group, ps in zip(groups, params, strict=True):
            group["params"] = ps
        opt.state = state
        st = core.stages(opt)
        st.shard_offsets, st.shard_reduce, st.shard_groups = (offsets, list(reduce.values()),
                                                               groups_of)
        st.shard_even = even
        yield
    finally:
        for group, ps in zip(groups, saved_params, strict=True):
            group["params"] = ps
        opt.state = saved_state
        st = core.stages(opt)
        st.shard_offsets = st.shard_reduce = st.shard_groups = st.shard_even = None
        for k, v in state.items():
            if v and id(k) not in offsets and k not in saved_state:
                saved_state[k] = v  # (state a plain parameter got in this step)
        for _, _, shard in work:
            p, lp, lstate = shard.p, shard.local, shard.lstate
            lp.grad = None
            if not lstate:
                continue
            dstate = saved_state[p]
            for k, v in list(lstate.items()):
                d = dstate.get(k)
                if is_dtensor(d) and _aliases(v, local(d)):
                    continue
                dstate[k] = wrap_state(k, v, lp, p)


def even_shards(p: DTensor) -> bool:
    """Whether every rank's shard of ``p`` has one shape (each sharded dimension divides evenly
    over its mesh dimensions); from shape and placements alone, alike on every rank. Such shards'
    whole-tensor sums may be added over the ranks a piece at a time: every rank cuts the same
    pieces (``driver._kind``)."""
    from torch.distributed.tensor import Replicate, Shard

    sizes = list(p.shape)
    for i, pl in enumerate(p.placements):
        if isinstance(pl, Replicate):
            continue
        # (a strided or partial placement: not known alike everywhere, so alone)
        if type(pl) is not Shard or sizes[pl.dim] % p.device_mesh.size(i):
            return False
        sizes[pl.dim] //= p.device_mesh.size(i)
    return True


def _aliases(a: Any, b: torch.Tensor) -> bool:
    """Whether ``a`` is ``b``, or a tensor viewing the same elements of the same memory (as the
    new view ``DTensor.from_local`` wraps does)."""
    return a is b or (
        isinstance(a, torch.Tensor) and a.data_ptr() == b.data_ptr() and a.dtype == b.dtype
        and a.shape == b.shape and a.stride() == b.stride() and a.device == b.device
    )


def reduce_groups(opt: Stepped, p: torch.Tensor) -> list[ProcessGroup]:
    """The process groups over which a step of local tensor ``p`` (a DTensor's shard) adds its
    whole-tensor sums (LAMB's norms): the mesh dimensions the parameter is sharded along."""
    groups = core.stages(opt).shard_groups
    return groups.get(id(p), []) if groups else []


def all_reduce_sums(sums: torch.Tensor, groups: Iterable[ProcessGroup]) -> torch.Tensor:
    """``sums`` (a shard's FP64 sums of squares) added over ``groups``: the whole tensor's."""
    for group in groups:
        torch.distributed.all_reduce(sums, op=torch.distributed.ReduceOp.SUM, group=group)
    return sums


def check_loaded_state(state: dict[str, Any], p: DTensor, where: str) -> None:
    """A DTensor parameter's loaded state must be sharded as the parameter: each rank steps its
    own shard of every buffer."""
    for k, v in state.items():
        if k == "step" or not isinstance(v, torch.Tensor):
            continue
        if not (is_dtensor(v) and v.device_mesh == p.device_mesh
                and tuple(v.placements) == tuple(p.placements)):
            got = f"placed as {tuple(v.placements)}" if is_dtensor(v) else "a plain tensor"
            raise ValueError(
                f"{where}: state {k!r} of a DTensor parameter placed as {tuple(p.placements)} is "
                f"{got}; load a checkpoint saved from parameters sharded alike (this optimizer's "
                "state_dict() on each rank, or torch.distributed.checkpoint with get_state_dict "
                "and set_state_dict, which reshards), or distribute the tensor first "
                "(torch.distributed.tensor.distribute_tensor)."
            )


def warn_fp32_shards(group: dict[str, Any], index: int) -> None:
    """Under ``state_dtype="8bit"``, warn which large DTensor parameters keep FP32 state (their
    shards are not whole rows of whole blocks)."""
    if group["state_dtype"] != qstate.EIGHT_BIT:
        return
    big = [tuple(p.shape) for p in group["params"]
           if is_dtensor(p) and p.numel() >= qstate.MIN_NUMEL and not qstate.qualifies(p)]
    if big:
        shown = ", ".join(map(str, big[:4])) + (f" and {len(big) - 4} more" if len(big) > 4 else "")
        warnings.warn(
            f"parameter group {index}: state_dtype='8bit' keeps FP32 state for {len(big)} "
            f"DTensor parameter(s) of {qstate.MIN_NUMEL} elements or more ({shown}): a sharded "
            f"parameter gets 8-bit state when it is sharded along its first dimension only and "
            f"its rows are a multiple of {qstate.BLOCK} elements, so that each rank's blocks "
            "are the whole parameter's.",
            RuntimeWarning, stacklevel=4,
        )
