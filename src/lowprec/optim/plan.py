"""The record of a step, for the next to redo (``replay``): ``_Plan`` and its runs.

A full step (``driver``) records per parameter an ``_Entry`` (what ``replay.redo`` checks before
redoing it, and its prepared compiled step, ``compiled._Fused``, or None for an eager one) and per
batch of small parameters a ``_Batch`` (``batches``), in the order they ran. ``_Plan.read_counts``
reads the step counts as the full step reads them; ``_Plan.merged`` replaces entries that can
share a compiled call by ``_Many`` calls (``update._update_many``), within a budget of size
patterns per kernel variant (``_MANY_*``). ``_flat_state`` lays a batch's state out as one flat
tensor per buffer name, which its call updates in place. Plain classes, given the optimizer as an
argument where they read it; tests replace ``_MANY_*``, read only here.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any, cast

import torch

# (compiled._compiled_kernel and loss_scale._host_counts are read through their modules: tests
# replace them)
from lowprec.optim import compiled, loss_scale
from lowprec.optim.update import _update_many

if TYPE_CHECKING:  # pragma: no cover
    from lowprec.optim._typing import WorkItem
    from lowprec.optim.base import LowPrecisionOptimizer
    from lowprec.optim.compiled import _Fused, _Kernel
    from lowprec.optim.storage import MasterStorage


def _flat(t: torch.Tensor) -> torch.Tensor:
    """Contiguous ``t`` as a 1-d view (``t`` itself when it is one)."""
    return t if t.dim() == 1 else t.view(-1)


def _grad_kind(g: torch.Tensor) -> tuple[Any, ...]:
    """What a step's path depends on in a gradient besides its shape."""
    return g.dtype, g.device, g.layout, g.is_contiguous(), g.storage_offset() % 2


class _Entry:
    """One parameter of a recorded step: what ``replay.redo`` checks before redoing it (the
    parameter, the layout of its gradient, its state tensors) and its prepared compiled step (None:
    it took ``param_step.step_param``, redone as such). It holds no gradient, so that a gradient the
    training loop drops is freed. ``step`` is its step count as ``_Plan.read_counts`` last read
    it."""

    __slots__ = ("count", "dtype", "fused", "gkind", "group", "index", "names", "p", "ptr",
                 "shape", "size", "state", "step", "storage", "stride", "tensors")

    count: torch.Tensor
    step: int

    def __init__(
        self,
        group: dict[str, Any],
        p: torch.Tensor,
        index: int,
        storage: MasterStorage,
        state: dict[str, Any],
        fused: _Fused | None,
    ) -> None:
        self.group, self.p, self.index, self.storage, self.fused = group, p, index, storage, fused
        self.state, self.count, self.step = state, state["step"], 0
        self.names = tuple(k for k, v in state.items() if isinstance(v, torch.Tensor))
        self.tensors = tuple(state[k] for k in self.names)
        self.size = len(state)
        self.ptr, self.dtype, self.shape, self.stride = p.data_ptr(), p.dtype, p.shape, p.stride()
        self.gkind = _grad_kind(cast(torch.Tensor, p.grad))  # (a stepped parameter's)

    def current(self, state: dict[Any, Any]) -> bool:
        p = self.p
        g = p.grad  # (checked every step: a record that held it would keep it alive)
        if g is None or g.shape != self.shape or _grad_kind(g) != self.gkind:
            return False
        st = state.get(p)
        return (
            st is self.state and p.data_ptr() == self.ptr and p.dtype == self.dtype
            and p.shape == self.shape and p.stride() == self.stride and len(st) == self.size
            and all(map(operator.is_, map(st.get, self.names), self.tensors))
        )


class _Recorder:
    """``memo["plan"]`` for ``param_step.step_param``: keeps each parameter's ``_Entry`` (its
    prepared compiled step) in ``entries`` by the parameter's id, for the next step to redo
    (``replay.redo_run``): the update inside backward's hooks, and the buckets' stage for the
    parameters outside buckets."""

    def __init__(self, entries: dict[int, _Entry]) -> None:
        self.entries = entries

    def add(self, entry: Any) -> None:
        if isinstance(entry, _Entry):
            self.entries[id(entry.p)] = entry


class _Batch:
    """Small parameters stepped together by one compiled call (``batches.step_small``): their
    flattened views, to concatenate and copy back, and per state buffer name the one flat tensor
    holding every parameter's buffer in turn where there is one (``_flat_state``), which the call
    updates in place, else None (those buffers are concatenated and copied back too)."""

    __slots__ = ("bufs", "counts", "dst", "entries", "group", "items", "names_m", "names_s", "ps",
                 "sizes", "step", "storage", "views", "words")

    entries: list[_Entry]

    def __init__(
        self, opt: LowPrecisionOptimizer, items: list[WorkItem], step: int, fresh: set[int]
    ) -> None:
        self.items, self.step, self.entries = items, step, []
        self.group, _, _, self.storage = items[0]
        self.ps = [p for _, p, _, _ in items]
        states = [opt.state[p] for p in self.ps]
        self.names_s = tuple(self.storage.buffers(self.ps[0]))
        self.names_m = tuple(opt._math_buffers(self.group))
        self.dst = [_flat(p) for p in self.ps]
        self.sizes = [p.numel() for p in self.ps]
        new = all(id(p) in fresh for p in self.ps)
        self.bufs = {k: _flat_state(states, k, self.sizes, new)
                     for k in (*self.names_s, *self.names_m)}
        self.views = {k: [_flat(st[k]) for st in states] for k in self.bufs}
        self.words = tuple(n // 2 for n in self.sizes)
        self.counts = [st["step"] for st in states]


def _flat_state(
    states: list[dict[str, Any]], name: str, sizes: list[int], new: bool
) -> torch.Tensor | None:
    """The flat tensor whose consecutive views are ``state[name]`` of each of ``states`` (contiguous
    tensors of ``sizes`` elements, one dtype), or None. ``new``: the states were just created
    (nothing outside the optimizer holds their tensors yet), so they are moved into a new flat
    tensor; existing state tensors are never replaced (a caller may hold them, or have put them in
    shared memory), only recognised when already laid out so (e.g. by an earlier step)."""
    ts: list[torch.Tensor] = [st[name] for st in states]
    base = ts[0]._base
    total = sum(sizes)
    # (an odd total is padded by an element: Inductor's functionalization views a kernel's
    # input's whole storage as the kernel's words of pairs, and fails to compile on a storage
    # that is not a whole number of them)
    padded = total + total % 2
    if base is not None and base.dim() == 1 and base.numel() == padded:
        ptr, width, at = base.data_ptr(), base.element_size(), 0
        for t, n in zip(ts, sizes, strict=True):
            if t._base is not base or t.data_ptr() != ptr + at * width or t.dtype != base.dtype:
                break
            at += n
        else:
            return base[:total]
    if not new:
        return None
    buf = torch.empty(padded, dtype=ts[0].dtype, device=ts[0].device)
    torch.cat([t.reshape(-1) for t in ts], out=buf[:total])
    for st, t, view in zip(states, ts, buf[:total].split(sizes), strict=True):
        st[name] = view.view(t.shape)
    return buf[:total]


# Recorded parameters of one kernel variant are redone by shared compiled calls (``_Many``). Dynamo
# compiles such a call for each number of parameters and pattern of sizes, so a variant takes at
# most _MANY_PATTERNS of them (well below Dynamo's own recompile limit of 8, past which it would
# run the function uncompiled); further ones are stepped one call per parameter, as before.
_MANY_PATTERNS = 4
_MANY_MAX = 4  # parameters per shared call (more compile longer: _one_cpp_kernel_per_loop)
_MANY_SEEN: dict[Any, set[tuple[int, ...]]] = {}  # per variant: the size patterns compiled
_MANY_BROKEN: set[Any] = set()  # variants whose call failed to compile
# Inductor fuses loops that read nothing in common but a few bytes (here the step's 0-d
# coefficients, shared by every parameter of a call) when they share at least
# score_fusion_memory_threshold bytes (10 by default). It then ran the sums passes of all of a
# shared call's parameters as one loop before any update, and the updates read everything back
# from memory: LAMB's shared calls were 1.07x slower than a call per pass and parameter. Loops
# over different parameters of a call share only those scalars (under 100 bytes), so this
# threshold keeps them apart. Loops of one parameter share its tensors' bytes: far more than the
# threshold for the large parameters these calls are for; a parameter of under ~1000 elements
# (shared calls take small ones where they do not batch, e.g. FP32 LAMB) may then take its two
# sums in two loops instead of one: the same bits, a few KB read twice.
_MANY_OPTIONS = {"score_fusion_memory_threshold": 4096}


class _Many:
    """Recorded parameters redone by one compiled call (``replay.run_many``): their prepared steps
    (``_Fused``) share a kernel variant, a group and a device, and none has an odd last element.
    Their updates are independent, so one call gives each the bits its own call would; a rule
    with whole-tensor norms (LAMB) takes each parameter's sums pass, then its update, in turn.
    Per-parameter calls cost ~20-35 us each of Dynamo guards and wrappers, more with the caches
    cold after backward: a 25M-parameter model has a dozen (two dozen with norms)."""

    __slots__ = ("entries", "fn", "kernel", "mvs", "pattern", "sums_fn", "svs")

    kernel: _Kernel

    def __init__(
        self, opt: LowPrecisionOptimizer, entries: list[_Entry], scaled: str | bool
    ) -> None:
        f = cast("_Fused", entries[0].fused)  # (entries with a compiled step: merge)
        self.entries = entries
        self.fn, self.sums_fn = f.update_fn, f.sums_fn
        # (One compiled function per variant, cached by _compiled_kernel: it is the variant's key
        # in _MANY_SEEN and _MANY_BROKEN.)
        self.kernel = compiled._compiled_kernel(
            type(opt), f.storage, f.flags, scaled=scaled, fn=_update_many,
            extra_key=(("many", self.fn.__name__.strip("_")), *(f.pairs or ()),
                       *((("sums", "sums"),) if self.sums_fn is not None else ())),
            options=_MANY_OPTIONS, signature=f.signature,
        )
        self.svs = [cast("_Fused", e.fused).views[0] for e in entries]
        self.mvs = [cast("_Fused", e.fused).views[1] for e in entries]
        # Dynamo's guards on the sizes (dynamic shapes) are which of them are equal, not their
        # values: the pattern is each size's first position among them.
        sizes = [e.p.numel() for e in entries]
        self.pattern = tuple(sizes.index(n) for n in sizes)

    def usable(self) -> bool:
        """Whether the call may be compiled (or was) for this pattern of sizes."""
        if self.kernel in _MANY_BROKEN:
            return False
        seen = _MANY_SEEN.setdefault(self.kernel, set())
        if self.pattern not in seen:
            if len(seen) >= _MANY_PATTERNS:
                return False
            seen.add(self.pattern)
        return True

    def broken(self) -> None:
        _MANY_BROKEN.add(self.kernel)

    @staticmethod
    def merge(
        opt: LowPrecisionOptimizer, runs: list[Any], scaled: str | bool
    ) -> list[_Entry | _Batch | _Many]:
        """``runs`` with the entries that can share a call replaced, where two or more can, by
        ``_Many`` calls (of at most ``_MANY_MAX`` each) at the place of the smallest."""
        together: dict[Any, list[_Entry]] = {}
        for run in runs:
            f = getattr(run, "fused", None)
            if (
                f is not None and (f.pairs is None or f.n == run.p.numel()) and f.base is None
                and not f.shards and not f.qkw  # (8-bit state: calls per piece already)
                and (not scaled or loss_scale._host_counts(run.p.device))
            ):
                # (Their step counts as last read: the coefficients are shared. Counts that stop
                # agreeing later, written by a caller, make replay.run_many step them one by one.)
                key = (id(f.kernel), id(run.group), run.p.device, run.step)
                together.setdefault(key, []).append(run)
        # Sorted by size and cut into calls of at most _MANY_MAX: a call's compile time grows
        # with its parameters, and calls of equal sizes share one compilation (one pattern).
        first: dict[int, list[_Entry | _Many]] = {}
        for es in together.values():
            if len(es) > 1:
                es = sorted(es, key=lambda e: e.p.numel())
                first[id(es[0])] = [
                    _Many(opt, part, scaled) if len(part) > 1 else part[0]
                    for part in (es[i:i + _MANY_MAX] for i in range(0, len(es), _MANY_MAX))
                ]
        rest = {id(e) for calls in first.values() for c in calls
                for e in (c.entries if isinstance(c, _Many) else [c])}
        merged: list[_Entry | _Batch | _Many] = []
        for run in runs:
            if id(run) in first:
                merged.extend(first[id(run)])
            elif id(run) not in rest:
                merged.append(run)
        return merged


class _Plan:
    """A step recorded for ``replay.redo``: per group its options and flags, the parameters that had
    no gradient (with their dtype and device), and the work (``_Entry`` or ``_Batch``) in the order
    it ran."""

    __slots__ = ("batches", "counts", "entries", "groups", "idle", "many", "runs", "scaled")

    def __init__(self, opt: LowPrecisionOptimizer, scaled: str | bool) -> None:
        self.scaled = scaled  # (recorded under a loss scaler: redone only under one)
        groups = opt.param_groups
        self.groups = [
            (g, tuple(g["params"]), opt._plan_options(g), opt._flags(g)) for g in groups
        ]
        self.idle = tuple(
            (p, p.dtype, p.device) for g in groups for p in g["params"] if p.grad is None
        )
        self.runs: list[_Entry | _Batch] = []
        self.entries: list[_Entry] = []
        self.batches: list[_Batch] = []
        self.counts: list[tuple[list[_Entry], list[torch.Tensor]]] | None = None
        self.many: list[_Entry | _Batch | _Many] | None = None

    def merged(self, opt: LowPrecisionOptimizer) -> list[_Entry | _Batch | _Many]:
        """The runs to redo, entries sharing a compiled call merged (``_Many.merge``)."""
        if self.many is None:
            self.many = _Many.merge(opt, self.runs, self.scaled)
        return self.many

    def add(self, run: _Entry | _Batch) -> None:
        self.runs.append(run)
        if isinstance(run, _Batch):
            self.batches.append(run)
            self.entries.extend(run.entries)
        else:
            self.entries.append(run)

    def read_counts(self) -> bool:
        """Read every entry's step count into ``entry.step``, as the full step reads them (one
        transfer per dtype and device; a count can change without its version counter showing
        it, e.g. by a collective or through ``.data``). False where the record cannot be redone
        at these counts: one that is not a whole number, or a batch whose counts differ.

        A step under a loss scaler reads only the counts of its batches and of parameters on the CPU
        (``_host_counts``): the others are read on their devices (``param_step.scaled_numbers``),
        with no host synchronisation."""
        if self.counts is None:
            sets: dict[Any, tuple[list[_Entry], list[torch.Tensor]]] = {}
            batched = {id(e) for b in self.batches for e in b.entries}
            read = [e for e in self.entries if not self.scaled or id(e) in batched
                    or loss_scale._host_counts(e.p.device)]
            for e in read:
                entries, counts = sets.setdefault((e.count.dtype, e.count.device), ([], []))
                entries.append(e)
                counts.append(e.count)
            self.counts = list(sets.values())
        for entries, counts in self.counts:
            for e, value in zip(entries, torch.stack(counts).tolist(), strict=True):
                if not float(value).is_integer():
                    return False
                e.step = int(value)
        return all(all(e.step == b.entries[0].step for e in b.entries) for b in self.batches)
