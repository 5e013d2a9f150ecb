"""One parameter's step and the step's numbers.

``step_param`` steps a parameter no bucket takes: a whole-tensor rule compiled in its shape
(``_step_whole_fused``) where it can, else eagerly (``eager_step``, which the buckets' eager pieces
run too: in chunks, a rule's whole-tensor sums first); with ``first_use``, it creates the buffers an
option turned on and takes their first step. Every step makes its numbers (coefficients, random keys, the
loss scaler's inputs) on the parameters' device from the step counts kept there, for many
parameters at once (``step_numbers_many``), and reads no value on the host; a ``Memo`` shares
them within one ``step()``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import torch

# (tests replace update._INT32_MAX: read through its module)
from lowprec.optim import compiled, core, qstate, update
from lowprec.optim.compiled import _COMPILE_ERRORS, _disable_fused, _fused_enabled
from lowprec.optim.loss_scale import _mode, _Scaling
from lowprec.optim.shards import all_reduce_sums, reduce_groups
from lowprec.optim.storage import MasterStorage
from lowprec.optim.update import _param_sums, _param_update

if TYPE_CHECKING:  # pragma: no cover
    from lowprec.optim.core import Rule, Stepped

#: A parameter's numbers for a step, made on its device (``step_numbers``): its step number,
#: random key halves, coefficients and the kernels' loss-scaler arguments.
_StepNumbers = tuple[torch.Tensor, "int | torch.Tensor", "int | torch.Tensor",
                     dict[str, torch.Tensor], dict[str, torch.Tensor]]


class Memo:
    """What one ``step()`` makes once and shares between its parameters."""

    __slots__ = ("numbers", "rules")

    def __init__(self) -> None:
        self.rules: dict[int, Rule] = {}
        self.numbers: dict[int, _StepNumbers] = {}


def _per(quantized: tuple[tuple[str, str], ...]) -> dict[str, int]:
    """Elements of a parameter per element of each of its quantized buffers (1 where absent):
    its blocks' scales, and 4-bit codes (two a byte)."""
    per = {qstate.scale_key(k): qstate.BLOCK for k, _ in quantized}
    per.update({k: 2 for k, f in quantized if f.endswith("4")})
    return per


def cut(d: dict[str, torch.Tensor], sl: slice, per: dict[str, int]) -> dict[str, torch.Tensor]:
    """Flat buffers ``d``'s entries for elements ``sl`` (starting on a block where quantized):
    ``per``, elements per entry (``_per``)."""
    if sl.start is None:
        return d
    return {k: v[sl.start // per.get(k, 1):-(-sl.stop // per.get(k, 1))] for k, v in d.items()}


def _constant(opt: Stepped, group: dict[str, Any], device: torch.device, name: str,
              value: float) -> torch.Tensor:
    """A coefficient that does not depend on the count as a 0-d FP32 tensor on ``device``, the
    same tensor from step to step while its value stays (no tensor made from a host number in a
    step a CUDA graph captures, and none of their host cost)."""
    kept = core.stages(opt).constants.setdefault((id(group), device), {})
    # (the value's bits: -0.0 is not 0.0, and a NaN is its own)
    bits = value.hex() if isinstance(value, float) else (type(value), value)
    old = kept.get(name)
    if old is None or old[0] != bits:
        old = kept[name] = (bits, torch.tensor(value, dtype=torch.float32, device=device))
    return old[1]


def _aligned_views(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The elements of 1-d ``t`` as 0-d views 16 bytes apart (a padded copy; one element: its
    own tensor, aligned as any), detached: no view, so that the kernels need not detach them
    at each call (``compiled._unviewed``)."""
    if t.numel() == 1:
        return (t.view(()).detach(),)
    per = max(1, 16 // t.element_size())
    padded = t.new_zeros((t.numel(), per))
    padded[:, 0] = t
    return tuple(v.detach() for v in padded[:, 0].unbind())


def group_rule(opt: Stepped, group: dict[str, Any], memo: Memo) -> Rule:
    """The group's rule (``Stepped.rule``), made once per ``step()``."""
    rule = memo.rules.get(id(group))
    if rule is None:
        rule = memo.rules[id(group)] = opt.rule(group)
    return rule


def step_numbers(
    opt: Stepped,
    group: dict[str, Any],
    p: torch.Tensor,
    index: int,
    storage: MasterStorage,
    state: dict[str, Any],
    scaling: _Scaling | None,
    memo: Memo,
    keys: bool = True,
) -> _StepNumbers:
    """A parameter's numbers for a step, made on its device from its count: its step number
    (FP64), random key halves (``keys`` False: zeros), FP32 coefficients and the loss scaler's
    tensors."""
    done = memo.numbers.get(id(p))
    if done is None:  # (not made with its group's others: e.g. its state is new this step)
        step_numbers_many(opt, [(group, p, index, storage, state)], scaling, memo, keys)
        done = memo.numbers[id(p)]
    return done


def step_numbers_many(
    opt: Stepped,
    items: list[tuple[dict[str, Any], torch.Tensor, int, MasterStorage, dict[str, Any]]],
    scaling: _Scaling | None,
    memo: Memo,
    keys: bool = True,
) -> None:
    """``step_numbers`` for many parameters at once, kept in ``memo``: per group and device the
    counts are stacked and each number made by one vector operation for all of them, each
    parameter's share a view 16 bytes apart (a compiled kernel may copy a misaligned input).
    ``keys`` False: zeros for the random keys (a bucket makes its pieces' own)."""
    sets: dict[Any, tuple[dict[str, Any], list[tuple[torch.Tensor, int, MasterStorage]]]] = {}
    for group, p, index, storage, state in items:
        if state["step"].device != p.device:
            state["step"] = state["step"].to(p.device)
        sets.setdefault((id(group), p.device), (group, []))[1].append((p, index, storage))
    for (_, device), (group, members) in sets.items():
        counts = torch.stack([opt.state[p]["step"] for p, _, _ in members])
        step = counts.double() + 1
        steps = _aligned_views(step)
        keyed = keys and any(storage.needs_random_bits for _, _, storage in members)
        if keyed:
            index = index_tensor(opt, device, tuple(i for _, i, _ in members))
            los, his = map(_aligned_views,
                           compiled.step_keys(opt, group, members[0][0], counts, index))
        per: dict[str, Any] = {}  # (in _coefficients' order: a compiled call's key)
        for k, v in group_rule(opt, group, memo).coefficients(step).items():
            if isinstance(v, torch.Tensor):  # (of the counts, or a tensor lr's: one for all)
                t = torch.as_tensor(v, dtype=torch.float32, device=device)
                per[k] = _aligned_views(t.expand(step.shape) if t.dim() == 0 else t)
            else:
                per[k] = [_constant(opt, group, device, k, v)] * len(members)
        extra = {} if scaling is None else scaling.kernel_args(device)
        for i, (p, _, storage) in enumerate(members):
            coeffs = {k: v[i] for k, v in per.items()}
            lo_i, hi_i = (los[i], his[i]) if keyed and storage.needs_random_bits else (0, 0)
            memo.numbers[id(p)] = (steps[i], lo_i, hi_i, coeffs, extra)


def index_tensor(opt: Stepped, device: torch.device, indices: tuple[int, ...]) -> torch.Tensor:
    """Parameters' ``indices`` (stochastic rounding's keys) as an int64 tensor on ``device``, kept:
    a host list copied to a GPU waits for the work queued before it."""
    cache = core.stages(opt).index_tensors
    index = cache.get((device, indices))
    if index is None:
        index = cache[device, indices] = torch.tensor(indices, dtype=torch.int64, device=device)
    return index


def step_param(
    opt: Stepped,
    group: dict[str, Any],
    p: torch.Tensor,
    index: int,
    storage: MasterStorage,
    scaling: _Scaling | None,
    memo: Memo,
    first_use: bool = False,
) -> None:
    """One parameter's step: a whole-tensor rule compiled (``_step_whole_fused``), else eager
    (``eager_step``). ``first_use``: the buffers an option turned on since its last step are
    created here and take the coefficients of their first use."""
    grad = cast(torch.Tensor, p.grad)  # (present: a work item's parameter)
    rule = group_rule(opt, group, memo)
    state = opt.state[p]
    if first_use:
        dtype = core.state_dtype(group, p, storage)
        for name in rule.buffers(p):
            if state.get(name) is None:
                state.update(core.new_buffer(rule, group, p, name, dtype))
    sbufs = {k: state[k] for k in storage.buffers(p)}
    mbufs = core.state_tensors(rule, state, p)
    quantized = core.qformats(rule, group, state, p)  # (codes: rows of qstate.BLOCK elements)
    step, lo, hi, coeffs, numbers_extra = step_numbers(opt, group, p, index, storage, state,
                                                       scaling, memo)
    extra: dict[str, Any] = numbers_extra
    if first_use:
        coeffs = rule.first_use(step)
    # (a DTensor's shard: its whole-tensor sums add every rank's; its random bits are keyed
    # by its elements' indices in the whole parameter, from `start` on)
    shards = reduce_groups(opt, p) if rule.norms else ()
    start = 0
    offsets = core.stages(opt).shard_offsets
    if offsets and storage.needs_random_bits:
        start = offsets.get(id(p), 0)
    # (flat views, where the writes land, need contiguous tensors)
    contiguous = all(t.is_contiguous() for t in (p, grad, *sbufs.values(), *mbufs.values()))
    if rule.whole:  # (one call in the parameter's shape: Muon, Adafactor)
        if not (rule.compiles and not quantized and not first_use and contiguous
                and p.numel() > 1 and _fused_enabled(opt, group, p)
                and _step_whole_fused(opt, rule, p, storage, sbufs, mbufs, coeffs, lo, hi,
                                      extra, scaling)):
            kw: dict[str, Any] = {"qstate": quantized, "shape": p.shape} if quantized else {}
            _param_update(p, grad, sbufs, mbufs, coeffs, lo, hi, storage=storage,
                          math=rule.math, flags=rule.flags, offset=start, **extra, **kw)
    # (flat where it is cut in chunks or holds codes; else the tensors as they are: one pass)
    elif contiguous and (quantized or p.numel() > update._eager_chunk(p.device)):
        flat = {k: v.view(-1) for k, v in sbufs.items()}, {k: v.view(-1) for k, v in mbufs.items()}
        eager_step(rule, storage, p.view(-1), grad.view(-1), *flat, coeffs, lo, hi, extra,
                   quantized, offset=start, shards=shards)
    else:
        eager_step(rule, storage, p, grad, sbufs, mbufs, coeffs, lo, hi, extra, quantized,
                   offset=start, shards=shards)
    state["step"].add_(1 if scaling is None else scaling.taken_on(p.device))


def eager_step(
    rule: Rule,
    storage: MasterStorage,
    p: torch.Tensor,
    grad: torch.Tensor,
    sbufs: dict[str, torch.Tensor],
    mbufs: dict[str, torch.Tensor],
    coeffs: dict[str, Any],
    lo: int | torch.Tensor,
    hi: int | torch.Tensor,
    extra: dict[str, Any],
    quantized: tuple[tuple[str, str], ...] = (),
    *,
    offset: int = 0,
    shards: Sequence[Any] = (),
) -> None:
    """The eager step of ``p`` (a parameter, or a bucket's piece). Flat and longer than
    ``update._eager_chunk``, it goes in chunks (their temporaries stay in cache, the peak memory a
    few MB over what the step keeps): bit-identical to one pass, since the rules are elementwise and
    the random bits keyed by index (``offset``: ``p``'s first element's). A rule with norms first
    takes its whole-tensor sums (FP64) in a read-only pass, added over ``shards``' ranks."""
    per = _per(quantized)
    qkw: dict[str, Any] = {"qstate": quantized} if quantized else {}
    n, chunk = p.numel(), update._eager_chunk(p.device)
    Piece = tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor],
                  int]

    def at(sl: slice) -> Piece:
        """Elements ``sl``, their state and the first one's index."""
        return p[sl], grad[sl], cut(sbufs, sl, per), cut(mbufs, sl, per), offset + sl.start

    pieces: list[Piece] = ([at(slice(i, min(i + chunk, n))) for i in range(0, n, chunk)]
                           if p.dim() == 1 and n > chunk
                           else [(p, grad, sbufs, mbufs, offset)])
    flags = rule.flags
    if rule.norm_terms is not None and (len(pieces) > 1 or shards):
        sums = sum(_param_sums(*piece[:4], coeffs, storage=storage, norm_terms=rule.norm_terms,
                               flags=flags, inv_scale=extra.get("inv_scale"), **qkw)
                   for piece in pieces)
        coeffs = {**coeffs, "sums": all_reduce_sums(cast(torch.Tensor, sums), shards)}
    for piece_p, piece_g, piece_s, piece_m, first in pieces:
        _param_update(piece_p, piece_g, piece_s, piece_m, coeffs, lo, hi, storage=storage,
                      math=rule.math, flags=flags, offset=first, **extra, **qkw)


def _step_whole_fused(
    opt: Stepped,
    rule: Rule,
    p: torch.Tensor,
    storage: MasterStorage,
    sbufs: dict[str, torch.Tensor],
    mbufs: dict[str, torch.Tensor],
    coeffs: dict[str, torch.Tensor],
    lo: int | torch.Tensor,
    hi: int | torch.Tensor,
    extra: dict[str, Any],
    scaling: _Scaling | None,
) -> bool:
    """A whole-tensor rule's step compiled as one graph in the parameter's shape; False, having
    written nothing, where it does not compile (the eager step then takes it)."""
    if storage.name == "kahan" and compiled._round_trips_dropped(p):
        return False  # (this torch's C++ code would drop Kahan's round trip: eager)
    grad = cast(torch.Tensor, p.grad)  # (present: a work item's parameter)
    try:
        kernel = compiled._compiled_kernel(
            rule, storage, rule.flags, scaled=_mode(scaling),
            extra_key=(("whole", p.dim()),),
            signature=compiled._signature(p, grad, sbufs, mbufs),
            fullgraph=not rule.graph_breaks,
        )
        # (a new view, detached: see compiled._step_view)
        kernel(p.detach().view(p.shape), grad.view(p.shape), sbufs, mbufs, coeffs,
               *compiled._key_tensors(lo, hi), storage=storage, math=rule.math,
               flags=rule.flags, **extra)
    except _COMPILE_ERRORS as e:  # compilation failed before anything was written
        _disable_fused(opt, e)
        return False
    return True
