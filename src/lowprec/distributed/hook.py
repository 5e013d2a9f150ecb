"""1-bit SGD as a ``DistributedDataParallel`` communication hook: ``OneBitState`` + ``onebit_hook``.

**Striped aggregation** (CNTK's scheme), for a bucket on a group of ``W`` ranks, whose columns are
cut into ``W`` stripes (``lowprec.distributed.layout``); the stages are
``lowprec.distributed.stages``:

1. every rank adds its local residual to its gradient, quantizes every column, keeps the error as
   its new local residual, and sends stripe ``r`` (codes packed ``8 // bits`` per byte, plus two
   FP32 stats per column) to rank ``r``: one ``all_to_all_single``;
2. rank ``r`` dequantizes the ``W`` copies of stripe ``r`` it received, sums them in rank order,
   divides by ``W``, adds its stripe residual, requantizes, and keeps that error as its new stripe
   residual;
3. every rank gathers every requantized stripe (one ``all_gather_single``) and dequantizes them
   into the bucket: the averaged gradient, bit-identical on every rank.

Each step's messages are padded to one chunk size per bucket layout, ``S`` bytes, so the two
collectives move ``2 (W - 1) S`` bytes in and out of each rank, against about ``2 (W - 1) / W``
times the bucket's bytes for a ring all-reduce: about 30x less for 1 bit and long columns. Only
PyTorch's collectives are used (gloo on CPU, NCCL on GPU; gloo has both). Not ``reduce_scatter``:
it sums what is on the wire, and codes scaled by each rank's own column stats cannot be summed in
transit, so it would have to carry dequantized FP32 values, which is what we avoid.

**Overlap.** The hook returns at once with a future, leaving its bucket's collective in flight:
while bucket ``i``'s all-to-all is on the wire, DDP's backward pass goes on and bucket ``i + 1``
is quantized. Each call starts its own bucket's stage 1, then moves the older buckets on: every
all-to-all but the newest to stage 2 (which starts its all-gather), then every all-gather but the
newest to stage 3 (which completes its future). The iteration's last bucket (``is_last()``)
finishes everything, so every future is complete when the hook returns for it, before
DDP waits for any. Every stage runs in the hook's own thread, in bucket order, so the collectives
are issued in the same order on every rank (a collective started from a gloo callback thread could
interleave differently on different ranks), and no compute competes with the backward pass from a
communication thread. The results are those of running the stages one bucket at a time: the same
operations on the same values, only their order in time differs.

**Residuals survive bucket rebuilds.** DDP rebuilds its buckets after the first iteration (and a
fresh DDP object starts from its initial buckets again). Residual memory is per bucket layout, so
the hot path adds it with one operation, but it is indexed by parameter name: when a bucket with a
new set of parameters appears, each parameter's local residual is copied from the layout that
held it, and the stripe residuals of its values, which may have been owned by another rank under
the old stripes, are moved to their new owners by one all-reduce (every value is held by at most
one rank; the others contribute ``-0.0``, the identity of FP32 addition, so the sum is exact).
Since columns do not depend on the bucket, the compressed steps' results do not depend on how DDP
bucketed them: a resumed run with fresh buckets continues bit for bit (given deterministic
reductions, e.g. one intra-op thread on CPU; the ``"range"`` rule's min/max are exact under any
threading). Uncompressed steps (warm-up, fallback) add up as the backend's all-reduce does.

**Non-finite gradients.** If any rank's bucket (plus residual) has a NaN or an infinity in some
column, every rank learns it from a flag byte in the all-to-all; all ranks then all-reduce that
bucket uncompressed, exactly as DDP's default hook would (so a loss scaler still sees the inf), and
nobody keeps that step's local residuals. If the averaged stripe overflows FP32 in step 2 (finite
inputs near ``3e38``), its owner keeps its old stripe residual and the stripe arrives non-finite.

**Compute.** The per-block work (quantize with error feedback, requantize a stripe, dequantize,
pack, unpack) lives in ``lowprec.distributed.kernels``; by default (``fused=None``) it runs
compiled by ``torch.compile`` wherever a compiler exists (a C++ compiler on CPU, Triton on CUDA;
``LOWPREC_FUSED=0`` keeps it eager), with bit-identical results, ``"range"`` rule only.

**Checkpoints** (``lowprec.distributed.checkpoint``). ``state_dict()`` is a collective: every
rank's residuals and counters are gathered into one dict, which any rank may save;
``load_state_dict()`` on every rank takes its own part. The process group is not saved.
"""

# No ``from __future__ import annotations`` here: DDP's register_comm_hook compares the hook's
# annotations with the real dist.GradBucket and Future[Tensor] objects, not with strings.
import math
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from lowprec.distributed import checkpoint, stages
from lowprec.distributed.checkpoint import COUNTERS
from lowprec.distributed.layout import _Layout, column_runs
from lowprec.distributed.quantize import DEFAULT_RULE, check_quantizer
from lowprec.optim.compiled import _default_compiles as default_compiles
from lowprec.optim.options import _default_mode as default_mode

__all__ = ["DEFAULT_WARMUP_STEPS", "OneBitState", "column_runs", "onebit_hook"]

#: Uncompressed iterations before compression starts (``OneBitState(warmup_steps=...)``).
DEFAULT_WARMUP_STEPS = 100

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class OneBitState:
    """State of ``onebit_hook``: settings, per-rank residuals, iteration and byte counters.

    Register with ``ddp_model.register_comm_hook(OneBitState(model), onebit_hook)``. Residuals
    are kept per parameter name (taken from ``module``), so that they survive DDP's bucket rebuilds
    and go into checkpoints.

    Attributes:
        iter: Iterations seen (counted at each iteration's last bucket).
        bytes_sent: Bytes this rank sent to other ranks: ``(W - 1)`` chunks for an all-to-all or
            an all-gather, ``2 (W - 1) / W`` of the tensor for an all-reduce (as a ring does it).
        bytes_received: Bytes this rank received; equal to ``bytes_sent`` for these collectives.
        uncompressed_bytes: Bytes a ring all-reduce of the same buckets, in their own dtype, would
            have sent: ``uncompressed_bytes / bytes_sent`` is the compression ratio.
        compressed_buckets: Buckets sent compressed.
        fallback_buckets: Buckets all-reduced uncompressed because some rank's had a NaN or inf.
        uncompressed_buckets: Buckets all-reduced during warm-up.

    Args:
        module: The model DDP wraps (or the ``DistributedDataParallel`` wrapper itself); only its
            parameter names are used.
        process_group: The group to communicate in (default: None, the default group).
        bits: Bits per value: 1, 2, 4 or 8 (default: 1).
        rule: ``"range"`` or ``"zero-threshold"`` (1 bit only) (default: ``"range"``, see
            ``DEFAULT_RULE``); the rules are described in ``lowprec.distributed.quantize``.
        warmup_steps: Iterations all-reduced uncompressed before compression starts; 0 compresses
            from the first (default: ``DEFAULT_WARMUP_STEPS``, 100).
        column_size: Longest column cut from a flat parameter (default: 1024).
        min_column_size: Shortest output unit of a weight that is its own column; weights with
            shorter ones are cut like flat parameters (default: 32).
        fused: Run the quantizer as compiled kernels (``torch.compile``: C++ on CPU, Triton on
            GPU), with the same results as the eager code bit for bit; ``"range"`` rule only
            (default: None, meaning compiled with the ``"range"`` rule wherever a compiler exists,
            unless the environment sets ``LOWPREC_FUSED=0``, eager otherwise). The first
            compressed step compiles (seconds to a minute; cached on disk for later runs).
            ``state.compiled`` says which path runs.
        loss_scaler: The loss scaler the training scales its loss with, ``lowprec.LossScaler``
            or ``torch.amp.GradScaler`` (default: None, no scaling). Residuals are in units of
            the gradient the hook sees, the scaled one: when the scale changes (dynamic scaling
            grows or backs off, or a run resumes with another scale or none) the hook multiplies
            them by new scale / old scale at the next compressed iteration, exactly for the
            powers of two scalers use. Without it, a run with a changing scale carries residuals
            in stale units (the error feedback then over- or under-corrects by that factor).

    Raises:
        TypeError: ``module`` is not an ``nn.Module``, or an option has the wrong type.
        ValueError: An option out of range (see ``check_quantizer`` for ``bits`` and ``rule``).
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        process_group: dist.ProcessGroup | None = None,
        bits: int = 1,
        rule: str = DEFAULT_RULE,
        warmup_steps: int = DEFAULT_WARMUP_STEPS,
        column_size: int = 1024,
        min_column_size: int = 32,
        fused: bool | None = None,
        loss_scaler: Any = None,
    ) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(
                f"OneBitState needs the model (an nn.Module) for parameter names, got "
                f"{type(module).__name__}: pass OneBitState(model, ...)."
            )
        check_quantizer(bits=bits, rule=rule)
        for name, value, least in (
            ("warmup_steps", warmup_steps, 0),
            ("column_size", column_size, 1),
            ("min_column_size", min_column_size, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}.")
            if value < least:
                raise ValueError(f"{name}={value} is out of range: must be >= {least}.")
        if fused is not None and not isinstance(fused, bool):
            raise TypeError(f"fused must be True, False or None, got {type(fused).__name__}.")
        if loss_scaler is not None and not callable(getattr(loss_scaler, "get_scale", None)):
            raise TypeError(
                f"loss_scaler must be the training's loss scaler (lowprec.LossScaler or "
                f"torch.amp.GradScaler: something with get_scale()), got "
                f"{type(loss_scaler).__name__}."
            )
        if fused is None:
            default_mode()  # an unknown LOWPREC_FUSED is refused here, not inside backward()
        if fused and rule != "range":
            raise ValueError(
                f"fused=True compiles the 'range' rule only (a compiled column sum would not "
                f"match the eager one bit for bit); with rule={rule!r} pass fused=None or False."
            )
        if isinstance(module, nn.parallel.DistributedDataParallel):
            module = module.module
        named = list(module.named_parameters())
        self._names = {id(p): n for n, p in named}
        self._numels = {n: p.numel() for n, p in named}
        self._params = [p for _, p in named]  # keeps the ids above unique while we hold them
        self.process_group = process_group
        self.bits = bits
        self.rule = rule
        self.warmup_steps = warmup_steps
        self.column_size = column_size
        self.min_column_size = min_column_size
        self.fused = fused
        self.loss_scaler = loss_scaler
        # The loss scale the residuals are in (None: none made yet, or unknown), and the iteration
        # at which the scale was last read.
        self._residual_scale: float | None = None
        self._scale_iter: int | None = None
        # Decided at the first compressed bucket (None: not yet), False for good after a failed
        # compilation.
        self._fused_active: bool | None = None if fused is None else fused
        self._spares: dict[tuple[int, torch.device], list[torch.Tensor]] = {}
        self.iter = 0
        self.bytes_sent = 0
        self.bytes_received = 0
        self.uncompressed_bytes = 0
        self.compressed_buckets = 0
        self.fallback_buckets = 0
        self.uncompressed_buckets = 0
        self._layouts: dict[tuple[Any, ...], _Layout] = {}
        self._home: dict[str, _Layout] = {}  # the layout holding a parameter's residuals now
        self._pending_local: dict[str, torch.Tensor] = {}  # loaded, not yet in a layout
        self._pending_stripe: dict[str, tuple[int, torch.Tensor]] = {}
        # Parameters whose stripe residuals some rank may hold (the same set on every rank).
        self._carry: set[str] = set()
        self._inflight: list[stages.InFlight] = []  # compressed buckets between stages, in order

    # ------------------------------------------------------------------------------- helpers

    def _group(self) -> dist.ProcessGroup:
        if not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialized: call dist.init_process_group() before "
                "training with onebit_hook or calling state_dict()/load_state_dict()."
            )
        # (initialized: WORLD is the default group)
        return (self.process_group if self.process_group is not None
                else cast(dist.ProcessGroup, dist.group.WORLD))

    def config(self) -> dict[str, Any]:
        """The settings, as plain values (also stored in ``state_dict()``)."""
        return {
            "bits": self.bits,
            "rule": self.rule,
            "column_size": self.column_size,
            "min_column_size": self.min_column_size,
            "warmup_steps": self.warmup_steps,
        }

    def counters(self) -> dict[str, int]:
        """This rank's counters (see the class attributes), as a dict of ints."""
        return {"iter": self.iter, **{k: getattr(self, k) for k in COUNTERS}}

    @property
    def compiled(self) -> bool | None:
        """Whether the compiled quantizer runs: None until the first compressed bucket decides
        (``fused=None``), False for good after a compilation failed (with a warning)."""
        return self._fused_active

    def messages(self) -> list[dict[str, Any]]:
        """One dict per bucket layout compressed so far, in the order they appeared.

        Each has ``"parameters"`` (names, in bucket order), ``"values"``, ``"dtype"`` (of the
        bucket), ``"columns"``, ``"stripes"`` (values per rank's stripe), ``"chunk_bytes"`` (one
        message chunk, ``S``), ``"bytes_per_step"`` (what this rank sends per compressed step of
        the bucket: ``2 (W - 1) S``; it receives as much) and ``"uncompressed_bytes_per_step"``
        (what a ring all-reduce of the bucket in its own dtype would send).
        """
        out = []
        for (_, dtype, _device), layout in self._layouts.items():
            world = len(layout.stripes)
            size = torch.empty(0, dtype=dtype).element_size()
            out.append({
                "parameters": list(layout.keys),
                "values": layout.numel,
                "dtype": str(dtype).replace("torch.", ""),
                "columns": sum(s.ncols for s in layout.stripes),
                "stripes": [s.numel for s in layout.stripes],
                "chunk_bytes": layout.chunk_bytes,
                "bytes_per_step": 2 * (world - 1) * layout.chunk_bytes,
                "uncompressed_bytes_per_step": 2 * (world - 1) * layout.numel * size // world,
            })
        return out

    def _count_allreduce(self, nbytes: int, world: int) -> None:
        ring = 2 * (world - 1) * nbytes // world
        self.bytes_sent += ring
        self.bytes_received += ring

    def _allreduce(
        self, buffer: torch.Tensor, group: dist.ProcessGroup
    ) -> torch.futures.Future[torch.Tensor]:
        """DDP's default: divide by the world size, then sum, asynchronously."""
        work: dist.Work = self._start_allreduce(buffer, group)
        fut = work.get_future()
        return fut.then(lambda f: f.value()[0])

    def _layout_for(self, bucket: dist.GradBucket, buffer: torch.Tensor,
                    group: dist.ProcessGroup) -> _Layout:
        params = bucket.parameters()
        keys = []
        for p in params:
            name = self._names.get(id(p))
            if name is None:
                raise ValueError(
                    f"a DDP bucket holds a parameter of shape {tuple(p.shape)} that is not a "
                    "parameter of the module given to OneBitState: build the state with the model "
                    "DDP wraps, after any parameter replacement (OneBitState(ddp_model) works too)."
                )
            keys.append(name)
        cache_key = (tuple(keys), buffer.dtype, buffer.device)
        layout = self._layouts.get(cache_key)
        if layout is None:
            if any(key in self._home for key in keys):
                # A rebuilt bucket takes residuals from the old ones: let those finish first.
                self.flush()
            layout = self._new_layout(tuple(keys), [tuple(p.shape) for p in params], buffer, group)
            self._layouts[cache_key] = layout
        return layout

    def _new_layout(self, keys: tuple[str, ...], shapes: list[tuple[int, ...]],
                    buffer: torch.Tensor, group: dist.ProcessGroup) -> _Layout:
        world, rank = group.size(), dist.get_rank(group)
        layout = _Layout(keys, shapes, world_size=world, rank=rank, bits=self.bits,
                         column_size=self.column_size, min_column_size=self.min_column_size)
        if layout.numel != buffer.numel():
            raise RuntimeError(
                f"a DDP bucket of {buffer.numel()} values holds parameters of {layout.numel} "
                "values in all; onebit_hook expects DDP's flat bucket layout (no padding)."
            )
        fp32: dict[str, Any] = {"dtype": torch.float32, "device": buffer.device}
        keyset = set(keys)
        # DDP rebuilt its buckets: forget the layouts this one replaces (their residuals stay
        # alive, through _home, until every parameter has moved to its new layout).
        for k, old in list(self._layouts.items()):
            if keyset.intersection(old.keys):
                del self._layouts[k]
        layout.local = torch.zeros(layout.numel, **fp32)
        for key in keys:
            lo, hi = layout.span(key)
            src = self._pending_local.pop(key, None)
            home = self._home.get(key)
            if src is None and home is not None:
                a, b = home.span(key)
                src = home.local[a:b]
            if src is not None:
                layout.local[lo:hi].copy_(src)
        own = layout.stripes[rank]
        if keyset & self._carry:
            # Move the stripe residuals to their owners under the new stripes. Every value is held
            # by at most one rank and the others add -0.0 (x + -0.0 == x for every x, +0.0
            # included), so the sum is exactly the held value, whichever order the sum takes.
            full = torch.full((layout.numel,), -0.0, **fp32)
            for key in keys:
                piece = self._pending_stripe.pop(key, None)
                home = self._home.get(key)
                if piece is None and home is not None:
                    piece = home.own_piece(key)
                if piece is not None:
                    start, values = piece
                    lo = layout.span(key)[0] + start
                    full[lo : lo + values.numel()].copy_(values)
            self._count_allreduce(layout.numel * 4, world)
            dist.all_reduce(full, group=group)
            layout.stripe_residual = full[own.start : own.end].clone()
        else:
            layout.stripe_residual = torch.zeros(own.numel, **fp32)
        for key in keys:
            self._home[key] = layout
        self._carry |= keyset
        return layout

    def _spare(self, numel: int, device: torch.device) -> torch.Tensor:
        """An FP32 buffer of ``numel`` values for new residuals (reused: see ``_give_back``)."""
        pool = self._spares.get((numel, device))
        return pool.pop() if pool else torch.empty(numel, dtype=torch.float32, device=device)

    def _give_back(self, t: torch.Tensor) -> None:
        self._spares.setdefault((t.numel(), t.device), []).append(t)

    def _start_allreduce(self, buffer: torch.Tensor, group: dist.ProcessGroup) -> Any:
        """DDP's default, started: divide by the world size, then sum; returns the work."""
        world = group.size()
        self._count_allreduce(buffer.numel() * buffer.element_size(), world)
        buffer.div_(world)
        return dist.all_reduce(buffer, group=group, async_op=True)

    # ------------------------------------------------------------------------------ pipeline

    def _compressed(self, bucket: dist.GradBucket, buffer: torch.Tensor,
                    group: dist.ProcessGroup) -> torch.futures.Future[torch.Tensor]:
        """Stage 1 of this bucket, then the older buckets moved on (see the module docstring)."""
        if self._fused_active is None:
            self._fused_active = self.rule == "range" and default_compiles(buffer.device.type)
        self._follow_loss_scale()
        layout = self._layout_for(bucket, buffer, group)
        if any(item.layout is layout for item in self._inflight):
            self.flush()  # its last step never saw a last bucket: finish it before reusing it
        try:
            item = stages.start(self, layout, buffer, group)
            self._inflight.append(item)
            if bucket.is_last():
                self.flush()
            else:
                self._advance()
        except BaseException as error:
            self._abort(error)
            raise
        return item.future

    def _follow_loss_scale(self) -> None:
        """Once per iteration: read the loss scale (1 without a scaler) and, where it differs
        from the scale the residuals were made at, rescale every residual to it."""
        if self._scale_iter == self.iter:
            return
        self._scale_iter = self.iter
        scale = 1.0 if self.loss_scaler is None else float(self.loss_scaler.get_scale())
        old, self._residual_scale = self._residual_scale, scale
        if old is None or old == scale or not (math.isfinite(old) and old > 0):
            return
        self.flush()  # (nothing is in flight at an iteration's first bucket; by hand, maybe)
        factor = scale / old
        for layout in {id(layout): layout for layout in self._home.values()}.values():
            layout.local.mul_(factor)
            layout.stripe_residual.mul_(factor)
        for values in self._pending_local.values():
            values.mul_(factor)
        for _, values in self._pending_stripe.values():
            values.mul_(factor)

    def _advance(self) -> None:
        """Every all-to-all but the newest on to stage 2 (starting its all-gather), then every
        all-gather but the newest finished: at most one of each stays in flight."""
        for item in self._inflight[:-1]:
            if item.stage == 1:
                stages.exchange(self, item)
        gathering = [item for item in self._inflight if item.stage == 2]
        for item in gathering[:-1]:
            stages.finish(self, item)
        self._inflight = [item for item in self._inflight if not item.done]

    def flush(self) -> None:
        """Finish every bucket still in flight, completing its future.

        ``onebit_hook`` leaves up to two buckets in flight between calls, and finishes them at
        the iteration's last bucket (``bucket.is_last()``), before DDP waits for any future. Call
        this only when driving the hook by hand and waiting for a future before the last bucket;
        ``state_dict()`` and ``load_state_dict()`` call it themselves.
        """
        try:
            # The all-gathers started before this call have had time on the wire: finish them
            # first; then start every remaining all-gather, then finish those, so that each
            # wait overlaps the next bucket's compute or its collective.
            for item in [item for item in self._inflight if item.stage == 2]:
                stages.finish(self, item)
            for item in self._inflight:
                if item.stage == 1:
                    stages.exchange(self, item)
            for item in self._inflight:
                if not item.done:
                    stages.finish(self, item)
            self._inflight = []
        except BaseException as error:
            self._abort(error)
            raise

    def _abort(self, error: BaseException) -> None:
        """A stage raised: fail every future still in flight (so nobody waits for ever)."""
        for item in self._inflight:
            if not item.future.done():
                # (torch annotates set_exception's argument as the future's value type)
                item.future.set_exception(error)  # type: ignore[arg-type]
        self._inflight = []

    # ---------------------------------------------------------------------------- checkpoints

    def state_dict(self) -> dict[str, Any]:
        """Every rank's residuals and counters, the settings and the iteration, on every rank.

        A collective over the state's process group: call it on **every** rank (then save the
        result on one). The process group itself is not saved. See
        ``lowprec.distributed.checkpoint.state_dict`` for the format.

        Returns:
            ``{"format", "version", "world_size", "iter", "config", "ranks"}``; ``ranks[r]`` holds
            rank ``r``'s ``"local"`` residuals (name -> FP32 CPU tensor of the parameter's size),
            ``"stripe"`` residuals (name -> ``{"offset", "residual"}``, the values of the stripe
            it aggregates) and ``"counters"``.

        Raises:
            RuntimeError: The ranks' states were built on models with different parameters.
        """
        self.flush()
        return checkpoint.state_dict(self)

    def load_state_dict(self, state_dict: dict[str, Any], *, strict: bool = True) -> None:
        """Restore residuals, counters and the iteration from ``state_dict()``; call on every rank.

        Each rank takes its own part; residuals are placed when their parameters' buckets next
        appear. Loading replaces all residuals this state holds.

        Args:
            state_dict: A dict from ``state_dict()``, saved with the same world size.
            strict: Also require the same ``bits``, ``rule``, ``column_size`` and
                ``min_column_size``, and only names of this module's parameters (default: True).
                With ``strict=False`` residuals of unknown names are dropped and other settings
                accepted (residuals are per value, so they still carry the error, but the run no
                longer resumes bit for bit). The state keeps its own settings either way.

        Raises:
            TypeError: ``state_dict`` is not a dict from ``OneBitState.state_dict()``.
            ValueError: A different world size, a parameter of another size, or (``strict``) other
                settings or unknown parameter names.
        """
        self.flush()
        checkpoint.load_state_dict(self, state_dict, strict=strict)


def onebit_hook(state: OneBitState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average a DDP gradient bucket over the ranks with 1-bit SGD (error feedback, stripes).

    For ``state.warmup_steps`` iterations the bucket is all-reduced uncompressed (as DDP's default
    hook does); after that it is quantized, exchanged in stripes and dequantized as the module
    docstring describes. Every rank gets the same averaged gradient.

    Args:
        state: The hook's ``OneBitState``.
        bucket: The bucket DDP passes in.

    Returns:
        A future of the bucket's buffer, holding the averaged gradient.

    Raises:
        TypeError: ``state`` is not a ``OneBitState``, or the bucket's dtype is not FP32, FP16 or
            BF16.

    Examples:
        On every rank, after ``torch.distributed.init_process_group``:

        ```python
        ddp_model = DistributedDataParallel(model)
        state = OneBitState(model, warmup_steps=100)
        ddp_model.register_comm_hook(state, onebit_hook)
        ```
    """
    if not isinstance(state, OneBitState):
        raise TypeError(
            f"onebit_hook needs a OneBitState, got {type(state).__name__}: register it with "
            "ddp_model.register_comm_hook(OneBitState(model), onebit_hook)."
        )
    buffer = bucket.buffer()
    if buffer.dtype not in _DTYPES:
        raise TypeError(
            f"onebit_hook compresses float32, float16 and bfloat16 gradients, got {buffer.dtype}; "
            "keep DDP's default all-reduce for this model."
        )
    group = state._group()
    try:
        if state.iter < state.warmup_steps or buffer.numel() == 0:
            state.uncompressed_buckets += 1
            state.uncompressed_bytes += (
                2 * (group.size() - 1) * buffer.numel() * buffer.element_size() // group.size()
            )
            return state._allreduce(buffer, group)
        return state._compressed(bucket, buffer, group)
    finally:
        if bucket.is_last():
            state.iter += 1
