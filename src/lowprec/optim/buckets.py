"""Buckets: a group's optimizer state as views of flat buffers, stepped a few calls at a time.

Once the state exists, a group's parameters of one device, dtype, strategy and state layout
(``driver._kind``) form a ``_Bucket``: each state buffer is one flat buffer (``state[p][name]`` a
view of it), the step counts one tensor (``state[p]["step"]`` its 0-d views). A step takes, per
piece (``_pieces``), one gathering of the gradients and of the parameters, one compiled call on the
flat buffers (the kernel a single tensor's step runs, so the bits are the same), one copy back into
the parameters, and one write of a run's counts, whatever the number of tensors. The parameters keep
their own storage (Accelerate's checkpoints drop tensors that share one). DTensor shards' state
stays in tensors of their own (``gather_state``), gathered per piece. A rule with whole-tensor sums
steps a piece's parameters, all of one size, as rows. Where the counts live on the device each run
of equal counts makes its numbers there (``count_marks`` knows the runs without reading the counts).
The bucket checks each step that what it relies on holds (``current``, ``gradients``), else
``driver.step_buckets`` declines having written nothing. docs/architecture.md, "How a step flows"
("Buckets"), has the whole design and its figures.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch

from lowprec.optim import compiled, core, param_step, update
from lowprec.optim.compiled import _COMPILE_ERRORS, _disable_fused, _fused_enabled
from lowprec.optim.loss_scale import _mode, _Scaling
from lowprec.optim.shards import reduce_groups

if TYPE_CHECKING:
    from lowprec.optim.compiled import _Fused
    from lowprec.optim.core import Stepped
    from lowprec.optim.param_step import Memo
    from lowprec.optim.storage import MasterStorage


# Elements per compiled call of a bucket's gathered small parameters; a larger parameter takes
# a call of its own, in place (docs/architecture.md, "Device choices").
_GATHERED = {"cpu": 1 << 20, "cuda": 1 << 26}


def _gathered(device: torch.device) -> int:
    return _GATHERED.get(device.type, _GATHERED["cuda"])


_GRAD, _SHAPE, _DTYPE, _LAYOUT = map(operator.attrgetter, ("grad", "shape", "dtype", "layout"))


def _joined(ts: list[torch.Tensor], fresh: set[int]) -> torch.Tensor | None:
    """The flat view ``ts`` are consecutive pieces of, in order, where they view one of the
    ``fresh`` buffers; else None."""
    base = ts[0]._base
    start = ts[0].storage_offset()
    end = start
    for t in ts:
        if t._base is not base or t.storage_offset() != end or not t.is_contiguous():
            return None
        end += t.numel()
    if base is None or id(base) not in fresh:
        return None
    return base[start - base.storage_offset():end - base.storage_offset()]


class _Bucket:
    """One group's parameters of one kind (``driver._kind``): their state and step counts laid out
    in flat buffers, the state entries views of them; the parameters keep their storage."""

    __slots__ = (
        "counts", "device_index", "entries", "flat_params", "flat_state", "flats", "gather_state",
        "group", "indices", "keyed", "kind", "layouts", "made", "marks", "names",
        "norms", "offsets", "params", "per", "prepared", "ptrs", "qstate", "run", "run_keys",
        "sbufs", "scratch", "shapes", "shards", "sizes", "split_views", "starts", "states", "steps",
        "storage", "version", "views"
    )

    #: The counts' version when ``marks`` was last made (None: not yet)
    version: int | None

    def __init__(self, opt: Stepped, group: dict[str, Any], kind: tuple[Any, ...],
                 members: list[tuple[torch.Tensor, int]], storage: MasterStorage,
                 fresh: set[int] | None = None) -> None:
        self.group, self.kind, self.storage = group, kind, storage
        self.params = [p for p, _ in members]
        self.indices = [i for _, i in members]
        p0 = self.params[0]
        self.sbufs = tuple(storage.buffers(p0))
        *_, shard, layout, _ = kind
        self.names = tuple(name for name, _, _ in layout)
        # (elements of a parameter per element of each buffer: 1, or the codes' and scales')
        self.per = {name: n for name, _, n in layout}
        self.states = [opt.state[p] for p in self.params]
        self.qstate = core.qformats(opt.rule(group), group, self.states[0], p0)
        self.sizes = [p.numel() for p in self.params]
        self.offsets = [0]
        for n in self.sizes:
            self.offsets.append(self.offsets[-1] + n)
        # (each buffer copied into a flat one and the entries rebound to views of it, a buffer
        # at a time; new state made as consecutive views of a ``fresh`` buffer taken as it is)
        self.flats: dict[str, torch.Tensor] = {}
        self.views: dict[str, list[torch.Tensor]] = {}
        self.gather_state = bool(shard)
        self.flat_state: dict[str, list[torch.Tensor]] = {}  # (gather_state: flat views, kept)
        for name in self.names:
            src = [st[name] for st in self.states]
            n = self.per[name]
            if self.gather_state:  # (each its own tensor: _state gathers a piece's)
                self.views[name] = src
                self.flat_state[name] = [t.view(-1) for t in src]
                continue
            if len(src) == 1:  # (a bucket of one: its own tensors, flat)
                self.flats[name], self.views[name] = src[0].view(-1), src
                continue
            joined = _joined(src, fresh or set())
            if joined is not None:
                self.flats[name], self.views[name] = joined, src
                continue
            flat = torch.empty(self.offsets[-1] // n, dtype=src[0].dtype, device=p0.device)
            views = [flat[a // n:b // n].view(t.shape)
                     for t, a, b in zip(src, self.offsets, self.offsets[1:], strict=False)]
            torch._foreach_copy_(views, src)
            for st, view in zip(self.states, views, strict=True):
                st[name] = view
            self.flats[name], self.views[name] = flat, views
        # (flat views of the parameters, which the step's new values are copied into)
        self.flat_params = [p.view(-1) for p in self.params]
        self.counts = torch.stack([st["step"] for st in self.states])
        self.steps = list(self.counts.unbind())
        for st, view in zip(self.states, self.steps, strict=True):
            st["step"] = view
        self.ptrs = [p.data_ptr() for p in self.params]
        self.device_index = p0.get_device()  # (-1 on the CPU)
        self.keyed = storage.needs_random_bits  # (stochastic rounding: _keys)
        self.norms = opt.rule(group).norms  # (whole-tensor sums: pieces of one size)
        # (DTensor shards: their random bits keyed by their elements' indices in the parameters)
        offsets = (core.stages(opt).shard_offsets or {}) if self.keyed and shard else {}
        self.starts = [offsets.get(id(p), 0) for p in self.params]
        # (a DTensor's shard whose sums add every rank's: stepped in the parameters' order)
        self.shards = tuple(reduce_groups(opt, p0)) if shard and self.norms else ()
        # (current: every state entry the bucket made, per parameter in this order)
        self.entries: Callable[[Any], tuple[Any, ...]] = (
            operator.itemgetter("step", *self.names) if self.names
            else lambda st: (st["step"],))  # (one key: itemgetter gives no tuple)
        self.made = self._made()
        self.marks: list[int] = []
        self.version = None  # (count_marks: not read yet)
        self.shapes = [p.shape for p in self.params]
        self.prepared: dict[Any, _Fused] = {}
        self.layouts: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        # (the run being stepped, and its parameters' random keys: _keys)
        self.run: tuple[int, int] = (0, 0)
        self.run_keys: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.scratch: dict[Any, torch.Tensor] = {}
        self.split_views: dict[Any, list[torch.Tensor]] = {}

    def current(self, opt: Stepped) -> bool:
        """Whether the parameters and state entries are still this bucket's (a list at a time)."""
        if list(map(torch.Tensor.data_ptr, self.params)) != self.ptrs:
            return False
        states = list(map(opt.state.get, self.params))
        if not all(map(operator.is_, states, self.states)):
            return False
        try:  # (every entry of every state in one pass: 2.5x faster than a pass per name)
            return all(map(operator.is_, itertools.chain.from_iterable(map(self.entries, states)),
                           self.made))
        except KeyError:  # (an entry deleted)
            return False

    def gradients(self) -> tuple[list[torch.Tensor | None], bool] | None:
        """The parameters' gradients, and whether each parameter takes a piece of its own (dtypes
        differ, or random keys per word without BF16/FP32 pairs); None where one does not fit the
        step (strided, shaped as its parameter, on its device): the full validation then raises."""
        grads = list(map(_GRAD, self.params))
        present, shapes = grads, self.shapes
        if any(map(operator.is_, grads, itertools.repeat(None))):  # (`None in` compares tensors)
            present = [g for g in grads if g is not None]
            shapes = [s for g, s in zip(grads, shapes, strict=True) if g is not None]
        if not present:  # (a frozen bucket: nothing to step)
            return grads, False
        # (the device by its index: ~3x cheaper than reading each tensor's device)
        if (list(map(_SHAPE, present)) != shapes
                or set(map(_LAYOUT, present)) != {torch.strided}
                or set(map(torch.Tensor.get_device, present)) != {self.device_index}):
            return None
        dtypes = set(map(_DTYPE, present))
        alone = len(grads) > 1 and (len(dtypes) != 1 or (
            self.keyed and not dtypes <= set(compiled._PAIR_DTYPES)))
        return grads, alone

    def step(
        self,
        opt: Stepped,
        grads: list[torch.Tensor | None],
        memo: Memo,
        scaling: _Scaling | None,
        alone: bool = False,
        runs: list[tuple[int, int]] | None = None,
    ) -> None:
        """Step the parameters that have a gradient: per run of consecutive ones with one count
        (``runs``, as the driver made them, or made here: which counts are equal, ``count_marks``
        knows without reading them), the numbers made on the device from the run's first count,
        a compiled call per piece (one per parameter where ``alone``) and one write of the counts
        (by ``1 - skip`` under a loss scaler, decided on the device)."""
        moved: list[tuple[int, int]] = []
        try:
            for i, j in self.runs(grads, self.count_marks()) if runs is None else runs:
                # (the numbers made on the counts' device from the run's first count; the
                # random keys the bucket makes itself: _keys)
                step = param_step.step_numbers(opt, self.group, self.params[i], self.indices[i],
                                               self.storage, self.states[i], None, memo,
                                               keys=False)[3]
                self.run, self.run_keys = (i, j), {}
                done = i
                try:
                    for a, b in ([(k, k + 1) for k in range(i, j)] if alone
                                 else self._pieces(i, j)):
                        self._run(opt, a, b, grads, step, memo, scaling)
                        done = b
                finally:  # (one write per run, over the pieces stepped)
                    if done > i:
                        self.counts[i:done].add_(1 if scaling is None
                                                 else scaling.taken_on(self.counts.device))
                        moved.append((i, done))
        finally:
            self._moved(moved)

    @staticmethod
    def runs(grads: list[torch.Tensor | None], counts: list[Any]) -> list[tuple[int, int]]:
        """The runs of consecutive parameters with a gradient and equal ``counts`` (or marks)."""
        out: list[tuple[int, int]] = []
        i, n = 0, len(grads)
        while i < n:
            if grads[i] is None:
                i += 1
                continue
            j = i + 1
            while j < n and grads[j] is not None and counts[j] == counts[i]:
                j += 1
            out.append((i, j))
            i = j
        return out

    def step_one(self, opt: Stepped, k: int, memo: Memo) -> None:
        """Parameter ``k`` alone, its count advanced (the update inside backward)."""
        grads: list[torch.Tensor | None] = [None] * len(self.params)
        grads[k] = self.params[k].grad
        self.step(opt, grads, memo, None, alone=True)

    def place_counts(self) -> None:
        """The counts moved to the parameters' device (a checkpoint's load on the CPU)."""
        device = self.params[0].device
        if self.counts.device == device:
            return
        self.counts = self.counts.to(device)
        self.steps = list(self.counts.unbind())
        for st, view in zip(self.states, self.steps, strict=True):
            st["step"] = view
        self.made = self._made()
        self.layouts.clear()
        self.version = None

    def _made(self) -> list[torch.Tensor]:
        """Every state entry the bucket made, per parameter in ``entries``' order."""
        return [t for ts in zip(self.steps, *(self.views[k] for k in self.names), strict=True)
                for t in ts]

    def count_marks(self, read: bool = False) -> list[int]:
        """The counts as marks, equal where the counts are: read on the host where ``read`` (the
        CPU, where it is free) or after something else wrote them (their version counter; a
        write through ``.data`` is not seen), else kept from this bucket's own steps
        (``_moved``)."""
        if read or self.version != self.counts._version:
            values = self.counts.tolist()
            ids = {v: k for k, v in enumerate(dict.fromkeys(values))}
            self.marks = [ids[v] for v in values]
            self.version = self.counts._version
        return self.marks

    def _moved(self, spans: list[tuple[int, int]]) -> None:
        """The marks of the parameters in ``spans``, advanced alike, part from the others'."""
        if sum(b - a for a, b in spans) < len(self.marks):  # (all moved alike: the same marks)
            top = max(self.marks) + 1
            fresh: dict[int, int] = {}
            for a, b in spans:
                for k in range(a, b):
                    self.marks[k] = fresh.setdefault(self.marks[k], top + len(fresh))
        self.version = self.counts._version

    def _pieces(self, i: int, j: int) -> list[tuple[int, int]]:
        """Parameters ``i`` to ``j`` in pieces of a compiled call each: a parameter of
        ``_gathered(device)`` elements or more alone, in place; the others gathered, up to that many
        elements; for a rule with norms, each piece of one size (its parameters as rows)."""
        limit = _gathered(self.params[0].device)
        offsets, sizes = self.offsets, self.sizes
        pieces: list[tuple[int, int]] = []
        a = i
        for k in range(i, j):
            if sizes[k] >= limit:
                if a < k:
                    pieces.append((a, k))
                pieces.append((k, k + 1))
                a = k + 1
            elif offsets[k + 1] - offsets[a] > limit or (self.norms and sizes[k] != sizes[a]):
                pieces.append((a, k))
                a = k
        if a < j:
            pieces.append((a, j))
        return pieces

    def _run(self, opt: Stepped, a: int, b: int, grads: list[torch.Tensor | None],
             step: dict[str, torch.Tensor], memo: Memo, scaling: _Scaling | None) -> None:
        """Parameters ``a`` to ``b`` stepped on flat buffers (parameters and gradients gathered
        where several): one compiled call where the step is fused, else eagerly in chunks."""
        group, storage = self.group, self.storage
        lo, hi = self.offsets[a], self.offsets[b]
        one = b - a == 1
        p, g = self.flat_params[a], cast(torch.Tensor, grads[a])  # (a run's first: present)
        if not one:
            p = self._gather(self.flat_params[a:b], hi - lo, "param")
        gathered = not one or not g.is_contiguous() or g.storage_offset() % 2
        if gathered:
            g = self._gather(cast("list[torch.Tensor]", grads[a:b]), hi - lo, "grad")
        g = g.view(-1)
        rule = param_step.group_rule(opt, group, memo)
        names = (self.sbufs, self.names[len(self.sbufs):])
        per = self.per
        state = self._state(a, b)  # (the piece's state, flat: lo to hi)
        mode = _mode(scaling)
        extra: dict[str, Any] = {} if scaling is None else scaling.kernel_args(p.device)
        rows = b - a if self.norms and not one else 0  # (parameters of one size: _pieces)
        keys: tuple[Any, Any] = (0, 0)
        if self.keyed:
            keys, owner = self._keys(opt, a, b)
            extra.update({k: v.view(rows, -1) for k, v in owner.items()} if rows else owner)
        done = False
        # (a shard's first element's index; a gathered piece's words carry theirs: _keys)
        start = self.starts[a] if one else 0
        if _fused_enabled(opt, group, self.params[0]) and (not start or (
                start + hi - lo <= update._INT32_MAX
                and (start % 2 == 0 or p.dtype != torch.bfloat16))):
            try:
                key = (a, b, g.dtype, mode)
                if self.gather_state:  # (where the gathered state lies: the scratch, or new)
                    key += tuple(t.data_ptr() for t in state.values())
                fused = self.prepared.get(key)
                if fused is None:
                    fused = self.prepared[key] = compiled.prepare_fused(
                        rule, storage, p, g, *({k: state[k] for k in ks} for ks in names),
                        scaled=mode, qstate=self.qstate, keyed=self.keyed and not one, rows=rows,
                        start=start, shards=self.shards,
                    )
                fused.p = p  # (this step's parameters: the scratch, a new buffer or the parameter)
                compiled.run_fused(fused, g, step, step, *keys, extra)
                done = True
            except _COMPILE_ERRORS as e:  # (compilation failed before anything was written)
                _disable_fused(opt, e)
        if not done:  # (eager: the piece, or each parameter with random bits or sums)
            extra = {k: v for k, v in extra.items() if k not in ("owner", "idx")}
            spans = ([(self.offsets[k] - lo, self.offsets[k + 1] - lo, k) for k in range(a, b)]
                     if self.keyed or self.norms else [(0, hi - lo, -1)])
            for first, last, k in spans:
                sl = slice(first, last)
                sb, mb = (param_step.cut({n: state[n] for n in ns}, sl, self.per) for ns in names)
                key_lo, key_hi = self._keys(opt, k, k + 1)[0] if self.keyed else (0, 0)
                param_step.eager_step(rule, storage, p[sl], g[sl], sb, mb, step, key_lo, key_hi,
                                      extra, self.qstate, offset=self.starts[k] if k >= 0 else 0,
                                      shards=self.shards)
        if not one:
            torch._foreach_copy_(self.flat_params[a:b], self._split(p, a, b))
            if self.gather_state:  # (the new state back into each shard's own tensors)
                for k, flat in state.items():
                    torch._foreach_copy_(self.flat_state[k][a:b],
                                         list(flat.split([n // per[k] for n in self.sizes[a:b]])))
        if gathered and mode == "unscale":  # (the kernel wrote the gradients back unscaled)
            views = [g.view(self.shapes[a])] if one else self._split(g, a, b, shaped=True)
            torch._foreach_copy_(cast("list[torch.Tensor]", grads[a:b]), views)

    def _keys(self, opt: Stepped, a: int, b: int
              ) -> tuple[tuple[Any, Any], dict[str, torch.Tensor]]:
        """Stochastic rounding's keys for parameters ``a`` to ``b`` of the run being stepped,
        made once per run on the device from its count: one parameter's key halves (0-d views);
        for a gathered piece, a key half per parameter and each word's parameter and index within
        it (``owner``, ``idx``), so that every element gets the bits of a step of its own."""
        i, j = self.run
        if not self.run_keys:
            # (the run's counts are equal: its own slice, the keys' kernel's shape)
            lo, hi = compiled.step_keys(opt, self.group, self.params[i], self.counts[i:j],
                                        param_step.index_tensor(opt, self.counts.device,
                                                                tuple(self.indices[i:j])))
            self.run_keys = {-1: (lo, hi)}
        if b - a == 1:
            if a not in self.run_keys:
                lo, hi = map(param_step._aligned_views, self.run_keys[-1])
                self.run_keys.update((k, (lo[k - i], hi[k - i])) for k in range(i, j))
            return self.run_keys[a], {}
        lo, hi = self.run_keys[-1]
        device = self.counts.device
        layout = self.layouts.get((a, b))
        if layout is None:
            owner, idx = _word_owners(tuple(n // 2 for n in self.sizes[a:b]),
                                      tuple(s // 2 for s in self.starts[a:b]))
            layout = self.layouts[a, b] = (owner.to(device), idx.to(device))
        return (lo[a - i:b - i], hi[a - i:b - i]), {"owner": layout[0], "idx": layout[1]}

    def _state(self, a: int, b: int) -> dict[str, torch.Tensor]:
        """The state of parameters ``a`` to ``b``, one flat tensor per buffer: views of the flat
        buffers, or (``gather_state``) a parameter's own tensors, or the piece's gathered."""
        lo, hi, per = self.offsets[a], self.offsets[b], self.per
        if not self.gather_state:
            return {k: self.flats[k][lo // per[k]:hi // per[k]] for k in self.names}
        if b - a == 1:
            return {k: self.flat_state[k][a] for k in self.names}
        return {k: self._gather(self.flat_state[k][a:b], (hi - lo) // per[k], f"state:{k}")
                for k in self.names}

    def _gather(self, tensors: list[torch.Tensor], n: int, role: str) -> torch.Tensor:
        """``tensors`` (``n`` elements) in one flat buffer: on the CPU the bucket's reused scratch
        (a fresh buffer of megabytes page-faults every step), elsewhere a new one."""
        t0 = tensors[0]
        if t0.device.type == "cpu" and n <= _gathered(t0.device):  # (else: one large gradient)
            key = (role, t0.dtype)
            buf = self.scratch.get(key)
            if buf is None:
                buf = self.scratch[key] = torch.empty(_gathered(t0.device), dtype=t0.dtype)
            out = buf[:n]
        else:
            out = torch.empty(n, dtype=t0.dtype, device=t0.device)
        if role != "grad":  # (kept flat views: torch.cat is 2x faster than _chunk_cat here)
            torch.cat(tensors, out=out)
        else:  # (gradients: new tensors of any shape every step, which _chunk_cat flattens)
            torch._chunk_cat(tensors, 0, 1, out=out.view(1, -1))
        return out

    def _split(self, flat: torch.Tensor, a: int, b: int, shaped: bool = False
               ) -> list[torch.Tensor]:
        """``flat`` (parameters ``a`` to ``b``) as a view per parameter (flat, or ``shaped``), kept
        where ``flat`` is the scratch (a split of hundreds of views costs ~0.4 ms)."""
        key = (a, b, flat.data_ptr(), shaped)
        views = self.split_views.get(key)
        if views is None:
            views = list(flat.split(self.sizes[a:b]))
            if shaped:
                views = [v.view(s) for v, s in zip(views, self.shapes[a:b], strict=True)]
            if flat.device.type == "cpu":
                self.split_views[key] = views
        return views


def _word_owners(words: tuple[int, ...], first: tuple[int, ...]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """For a piece of BF16 parameters of ``words`` words each, whose first words are word
    ``first`` of their whole parameters (a DTensor's shard's; else 0): every word's parameter (its
    place in the piece) and index within its whole parameter, int32 each (per-word random keys)."""
    counts = torch.tensor(words, dtype=torch.int64)
    total = sum(words)
    owner = torch.repeat_interleave(torch.arange(len(words), dtype=torch.int64), counts,
                                    output_size=total)
    starts = torch.cumsum(counts, 0) - counts - torch.tensor(first, dtype=torch.int64)
    idx = torch.arange(total, dtype=torch.int64) - starts[owner]
    return owner.to(torch.int32), idx.to(torch.int32)
