"""The step driver (``_FullStep``, a mixin of ``LowPrecisionOptimizer``): ``step()`` after its closure.

``_step_all`` first steps through the buckets (``buckets.step_buckets``: a few calls per group
of tensors) where they hold, then redoes the recorded step (``replay``) where
nothing it relied on changed. Otherwise it validates everything (``_collect``), checks the
gradients under a loss scaler (``loss_scale._Scaling``), creates the buffers an option turned on
(``_step_late``), steps the large parameters one by one and the small ones in batches
(``batches``), records what it did (``plan._Plan``) for the next step to redo, and lays the
buckets out (``buckets.flatten``). ``_step_param`` is one parameter's step: compiled
(``compiled``: ``_prepare_fused``, ``_run_fused``) where enabled and possible, else eager, in
chunks on a large tensor; both run ``update._param_update``. The step's numbers (flags,
coefficients and their 0-d tensors, random keys; on the device, under a loss scaler off the CPU)
are made once per group and step number and shared through a ``memo``; ``_advance`` advances a
parameter's count once it is stepped.

A mixin, as every stage (``base`` says why): it calls the other stages' methods through ``self``.
"""

from __future__ import annotations

from typing import Any

import torch

from lowprec.numerics import stream_key, stream_key_halves

# (tests replace loss_scale._host_counts and update._INT32_MAX: read through their modules)
from lowprec.optim import buckets, compiled, loss_scale, qstate, update
from lowprec.optim.batches import _by_size
from lowprec.optim.compiled import _COMPILE_ERRORS, _disable_fused, _fused_enabled
from lowprec.optim.loss_scale import _mode, _Scaling
from lowprec.optim.plan import _Entry, _Plan
from lowprec.optim.shards import all_reduce_sums, reduce_groups
from lowprec.optim.storage import MasterStorage
from lowprec.optim.update import _param_sums, _param_update


def _block_slice(sl: slice, per: int | None = None) -> slice:
    """The blocks' scales of the elements ``sl`` (which start on a block, or are all of them);
    ``per`` 2: the bytes of their packed 4-bit codes (a block's elements are its bytes')."""
    if sl.start is None:
        return sl
    per = per or qstate.BLOCK
    return slice(sl.start // per, -(-sl.stop // per))


def _same_number(a: Any, b: Any) -> bool:
    """Whether host numbers ``a`` and ``b`` are the same value, bit for bit (-0.0 is not 0.0)."""
    if type(a) is not type(b) or not isinstance(a, (int, float)):
        return False
    return a.hex() == b.hex() if isinstance(a, float) else a == b


def _aligned_views(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The elements of 1-d ``t`` as 0-d views 16 bytes apart (a copy of ``t`` padded)."""
    per = max(1, 16 // t.element_size())
    padded = t.new_zeros((t.numel(), per))
    padded[:, 0] = t
    return padded[:, 0].unbind()


class _FullStep:
    """``LowPrecisionOptimizer``'s step driver: the full step, one parameter's step, and the
    step's numbers."""

    def _step_all(self, grad_scale: Any, found_inf: Any) -> None:
        """``step()`` after the closure: redo the recorded step, or take a full one."""
        # (how the kernels take the scaler's inputs: _Scaling.mode)
        scaled = "unscale" if grad_scale is not None else "skip" if found_inf is not None else False
        if buckets.step_buckets(self, grad_scale, found_inf):
            return
        plan = self.__dict__.get("_step_plan")
        if plan is not None and plan.scaled == scaled and self._replay(plan, grad_scale, found_inf):
            return
        self._step_plan = None
        late: list[Any] = []
        work = self._collect(late)
        memo: dict[Any, Any] = {}
        scaling = None
        if scaled:
            scaling = _Scaling.prepare(
                work, grad_scale, found_inf, self.__dict__.get("_shard_reduce")
            )
            counted = [(g, p, i, s, self.state[p]) for g, p, i, s in work
                       if "step" in self.state.get(p, ()) and not loss_scale._host_counts(p.device)]
            if counted:  # (every parameter's numbers at once, per group: not one by one)
                self._scaled_numbers_many(counted, scaling, memo)
        if late:  # (rare: a step that creates buffers is not recorded)
            self._step_late(late, scaling)
            ids = {id(p) for _, p, _, _ in late}
            work = [item for item in work if id(item[1]) not in ids]
            plan = None
        else:
            # The step is recorded, for the next steps to redo (_replay).
            plan = _Plan(self, scaled)
        memo["plan"] = plan
        large, small = _by_size(work)
        for group, p, index, storage in large:
            self._step_param(group, p, index, storage, scaling, memo)
        small = self._step_small_fused(small, memo, scaling)
        for group, p, index, storage in small:
            self._step_param(group, p, index, storage, scaling, memo)
        self._step_plan = plan
        buckets.flatten(self)

    def _step_late(self, late: list, scaling: _Scaling | None) -> None:
        """Step the parameters whose state lacks buffers the rule now keeps (``_collect``):
        create them, then take an eager step with the coefficients of their first use."""
        for group, p, index, storage in late:
            state = self.state[p]
            dtype = self._state_dtype(group, p, storage)
            for name in self._math_buffers(group, p):
                if state.get(name, None) is None:
                    state.update(self._new_math_buffer(group, p, name, dtype))
            self._step_param(group, p, index, storage, scaling, {}, first_use=True)

    def _group_flags(self, group: dict[str, Any], memo: dict[Any, Any]) -> dict[str, bool]:
        key = ("flags", id(group))
        flags = memo.get(key)
        if flags is None:
            flags = memo[key] = self._flags(group)
        return flags

    def _step_coefficients(self, group, step, memo, tensors: bool = True) -> tuple[dict, Any]:
        """The group's coefficients at ``step`` on the host, and (``tensors``) as 0-d FP32 tensors
        for the compiled kernels; computed once per group and step number in a ``step()``."""
        key = ("coeffs", id(group), step)
        cached = memo.get(key)
        if cached is None or (tensors and cached[1] is None):
            host = self._coefficients(group, step) if cached is None else cached[0]
            c32 = self._coefficient_tensors(group, host) if tensors else None
            cached = memo[key] = (host, c32)
        return cached

    def _coefficient_tensors(self, group, host: dict[str, Any]) -> dict[str, torch.Tensor]:
        """``host`` as 0-d FP32 tensors for the compiled kernels, reusing the group's tensor from
        the previous step for every value that did not change (lr, betas, weight decay... most
        of them), so that a step creates few (each costs microseconds of host time)."""
        cache = self.__dict__.setdefault("_coefficient_cache", {})
        prev = cache.get(id(group))
        old_host, old = (prev[1], prev[2]) if prev is not None and prev[0] is group else ({}, {})
        c32 = {
            k: old[k] if k in old_host and _same_number(v, old_host[k])
            else torch.as_tensor(v, dtype=torch.float32)
            for k, v in host.items()
        }
        cache[id(group)] = (group, host, c32)
        return c32

    def _kernel_coefficients(self, group, step, coeffs, memo) -> tuple[dict, Any]:
        """A compiled call's coefficients: on the host and as 0-d FP32 tensors, shared by the
        group's parameters at a host step number (``_step_coefficients``); for a step counted
        on the device (``_scaled_numbers``' tensors) made from ``coeffs``."""
        if isinstance(step, int):
            return self._step_coefficients(group, step, memo)
        return coeffs, {k: torch.as_tensor(v, dtype=torch.float32) for k, v in coeffs.items()}

    def _scaled_numbers(self, group, p, index, storage, state, scaling: _Scaling, memo) -> tuple:
        """A parameter's step under a loss scaler: its step number (FP64), random key halves,
        FP32 coefficients and the scaler's tensors, all on its device. The step count lives there
        and advances only when the step is taken, so everything that depends on it is computed
        there too. The coefficients that do not depend on it (lr, weight decay...) are the same
        tensors for the group's parameters within a ``step()``."""
        done = memo.get(("scaled", id(p)))
        if done is None:  # (not made with its group's others: e.g. its state is new this step)
            self._scaled_numbers_many([(group, p, index, storage, state)], scaling, memo)
            done = memo[("scaled", id(p))]
        return done

    def _scaled_numbers_many(self, items: list, scaling: _Scaling, memo) -> None:
        """``_scaled_numbers`` for many parameters at once, kept in ``memo`` for it to return:
        per group and device the step counts are stacked and every number is computed for all of
        them by one vector operation each (a dozen kernels per group, not a dozen per parameter,
        which on a GPU were most of a step), each parameter's share a view. ``items``: (group,
        p, index, storage, state) of parameters whose counts are kept on their devices.

        The views lie 16 bytes apart, as a tensor of their own would begin: a compiled kernel
        may take an input it was compiled for aligned only after copying it."""
        sets: dict[Any, tuple[dict, list]] = {}
        for group, p, index, storage, state in items:
            if state["step"].device != p.device:
                state["step"] = state["step"].to(p.device)
            sets.setdefault((id(group), p.device), (group, []))[1].append((p, index, storage))
        for (_, device), (group, members) in sets.items():
            step = torch.stack([self.state[p]["step"] for p, _, _ in members]).double() + 1
            steps = _aligned_views(step)
            if any(storage.needs_random_bits for _, _, storage in members):
                # (kept: a host list copied to a GPU waits for the work queued before it)
                indices = tuple(i for _, i, _ in members)
                cache = self.__dict__.setdefault("_index_tensors", {})
                index = cache.get((device, indices))
                if index is None:
                    index = cache[device, indices] = torch.tensor(indices, dtype=torch.int64,
                                                                  device=device)
                los, his = map(_aligned_views,
                               stream_key_halves(group["seed"], step.long(), index))
            shared = memo.setdefault(("constants", id(group), device), {})
            per: dict[str, Any] = {}  # (in _coefficients' order: a compiled call's key)
            for k, v in self._coefficients(group, step).items():
                if isinstance(v, torch.Tensor):
                    per[k] = _aligned_views(torch.as_tensor(v, dtype=torch.float32, device=device))
                else:
                    if k not in shared:
                        shared[k] = torch.as_tensor(v, dtype=torch.float32, device=device)
                    per[k] = None
            extra = scaling.kernel_args(device)
            for i, (p, _, storage) in enumerate(members):
                coeffs = {k: shared[k] if v is None else v[i] for k, v in per.items()}
                lo_i, hi_i = (los[i], his[i]) if storage.needs_random_bits else (0, 0)
                memo[("scaled", id(p))] = (steps[i], lo_i, hi_i, coeffs, extra)

    @staticmethod
    def _keys(group, storage: MasterStorage, step: int, index: int) -> tuple[int, int]:
        """The halves of a parameter's random key at ``step`` (zeros where none is needed)."""
        if not storage.needs_random_bits:
            return 0, 0
        key = stream_key(group["seed"], step, index)
        return key & 0xFFFFFFFF, key >> 32

    def _step_param(
        self, group, p, index, storage: MasterStorage, scaling=None, memo=None,
        first_use: bool = False,
    ) -> None:
        """One parameter's step. ``memo`` caches, for one ``step()`` call, what every parameter of a
        group shares (flags, coefficients and their tensors for a given step number), so that a
        model of many small tensors does not pay for them per tensor; its ``"plan"`` records the
        step for ``_replay``. ``first_use``: the first step of buffers created late
        (``_step_late``), eager, with ``_first_use_coefficients``."""
        memo = {} if memo is None else memo
        state = self.state[p]
        if not state:
            state.update(self._init_state(group, p, storage))
        sbufs = {k: state[k] for k in storage.buffers(p)}
        mbufs = self._mbufs(group, state, p)
        quantized = self._qstate(group, state, p)  # (codes: rows of qstate.BLOCK elements)
        qkw = {"qstate": quantized} if quantized else {}
        flags = self._group_flags(group, memo)
        if scaling is None or loss_scale._host_counts(p.device):
            step = int(state["step"].item()) + 1
            lo, hi = self._keys(group, storage, step, index)
            coeffs, _ = self._step_coefficients(group, step, memo, tensors=False)
            extra = {} if scaling is None else scaling.kernel_args(p.device)
        else:
            step, lo, hi, coeffs, extra = self._scaled_numbers(
                group, p, index, storage, state, scaling, memo
            )
        if first_use:
            coeffs = self._first_use_coefficients(group, step)
        plan = memo.get("plan")
        # A DTensor's shard (lowprec.optim.shards): whole-tensor sums add every rank's shard.
        shards = reduce_groups(self, p) if not self._elementwise else ()
        # A DTensor's shard (lowprec.optim.shards): its random bits are keyed by its elements'
        # indices in the whole parameter, from `start` on (the compiled kernels take it as a
        # tensor, `base`; on bfloat16 pairs it must fall on a pair boundary).
        start = 0
        offsets = self.__dict__.get("_shard_offsets")
        if offsets and storage.needs_random_bits:
            start = offsets.get(id(p), 0)
        fusable = not start or (
            start + p.numel() <= update._INT32_MAX and (start % 2 == 0 or p.dtype != torch.bfloat16)
        )
        tensors = (p, p.grad, *sbufs.values(), *mbufs.values())
        # Flattening must give views for the in-place writes to land: both the fused kernel and
        # the chunked eager step need contiguous tensors.
        contiguous = all(t.is_contiguous() for t in tensors)
        per = {qstate.scale_key(k): qstate.BLOCK for k, _ in quantized}  # (elements per entry)
        per.update({k: 2 for k, f in quantized if f.endswith("4")})  # (4-bit codes: 2 a byte)

        def flat(d, sl=slice(None)):
            """Flat views of ``d``'s tensors, elements ``sl`` (the blocks' scales of them, the
            bytes of their 4-bit codes)."""
            return {k: v.view(-1)[_block_slice(sl, per[k]) if k in per else sl]
                    for k, v in d.items()}

        if self._whole(group):  # (one call in the parameter's shape: Muon, Adafactor)
            if not (self._whole_compiles and not quantized and not first_use and contiguous
                    and p.numel() > 1 and _fused_enabled(self, group, p)
                    and self._step_whole_fused(group, p, storage, flags, sbufs, mbufs, step,
                                               coeffs, lo, hi, extra, scaling, memo)):
                shape = {"shape": p.shape} if quantized else {}
                _param_update(p, p.grad, sbufs, mbufs, coeffs, lo, hi, storage=storage,
                              math=self._math, flags=flags, offset=start, **extra, **qkw,
                              **shape)
            self._advance(state, step, scaling, p.device)
            if plan is not None:
                plan.add(_Entry(group, p, index, storage, state, None))
            return
        if (p.numel() > 1 and contiguous and fusable and not first_use
                and _fused_enabled(self, group, p)):
            coeffs, c32 = self._kernel_coefficients(group, step, coeffs, memo)
            try:
                fused = self._prepare_fused(
                    storage, flags, p, p.grad, sbufs, mbufs, scaled=_mode(scaling),
                    start=start, shards=shards, qstate=quantized,
                )
                self._run_fused(fused, p.grad, coeffs, c32, lo, hi, extra)
            except _COMPILE_ERRORS as e:  # compilation failed before anything was written
                _disable_fused(self, e)
            else:
                self._advance(state, step, scaling, p.device)
                if plan is not None:
                    plan.add(_Entry(group, p, index, storage, state, fused))
                return
        chunkable = self._elementwise or self._norm_terms is not None
        chunk = update._eager_chunk(p.device)
        if chunkable and contiguous and p.numel() > chunk:
            # Eager on a large tensor: go in chunks so the temporaries stay in cache (full-size
            # temporaries are fresh allocations that page-fault on every step) and the step's
            # peak memory stays a few MB over what it keeps. Elementwise rules and index-offset
            # random bits make this bit-identical to one pass.
            pieces = [
                (p.view(-1)[sl], p.grad.view(-1)[sl], flat(sbufs, sl), flat(mbufs, sl),
                 start + sl.start)
                for sl in (slice(i, i + chunk) for i in range(0, p.numel(), chunk))
            ]
        elif quantized:  # (codes: flat, their scales one per block)
            pieces = [(p.view(-1), p.grad.view(-1), flat(sbufs), flat(mbufs), start)]
        else:
            pieces = [(p, p.grad, sbufs, mbufs, start)]
        if self._norm_terms is not None and not self._elementwise and (len(pieces) > 1 or shards):
            # First pass: the rule's whole-tensor sums (FP64), read-only.
            sums = None
            for piece_p, piece_g, piece_s, piece_m, _ in pieces:
                part = _param_sums(
                    piece_p, piece_g, piece_s, piece_m, coeffs, storage=storage,
                    norm_terms=self._norm_terms, flags=flags, inv_scale=extra.get("inv_scale"),
                    **qkw,
                )
                sums = part if sums is None else sums + part
            coeffs = {**coeffs, "sums": all_reduce_sums(sums, shards)}
        for piece_p, piece_g, piece_s, piece_m, offset in pieces:
            _param_update(piece_p, piece_g, piece_s, piece_m, coeffs, lo, hi, storage=storage,
                          math=self._math, flags=flags, offset=offset, **extra, **qkw)
        self._advance(state, step, scaling, p.device)
        if plan is not None:
            plan.add(_Entry(group, p, index, storage, state, None))

    def _step_whole_fused(self, group, p, storage, flags, sbufs, mbufs, step, coeffs, lo, hi,
                          extra, scaling, memo) -> bool:
        """A whole-tensor rule's step compiled as one graph in the parameter's shape (one
        kernel per optimizer variant and number of dimensions, sizes dynamic); False, having
        written nothing, where it failed to compile (the eager call then takes it)."""
        if storage.name == "kahan" and compiled._round_trips_dropped(p):
            return False  # (this torch's C++ code would drop Kahan's round trip: eager)
        coeffs, c32 = self._kernel_coefficients(group, step, coeffs, memo)
        try:
            kernel = compiled._compiled_kernel(
                type(self), storage, flags, scaled=_mode(scaling),
                extra_key=(("whole", p.dim()),),
                signature=compiled._signature(p, p.grad, sbufs, mbufs),
                fullgraph=not self._whole_graph_breaks,
            )
            # (a new view of the parameter: handed the leaf itself, Inductor fails to compile)
            kernel(p.view(p.shape), p.grad.view(p.shape), sbufs, mbufs, c32,
                   *compiled._key_tensors(lo, hi), storage=storage, math=self._math,
                   flags=flags, **extra)
        except _COMPILE_ERRORS as e:  # compilation failed before anything was written
            _disable_fused(self, e)
            return False
        return True

    @staticmethod
    def _advance(state, step, scaling, device) -> None:
        if scaling is None:
            state["step"].fill_(step)
        else:  # one more step unless this one was skipped, decided on the device
            state["step"].add_(scaling.taken_on(device))
