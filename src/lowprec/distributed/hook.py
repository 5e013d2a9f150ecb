"""1-bit SGD as a ``DistributedDataParallel`` communication hook: ``OneBitState`` + ``onebit_hook``.

**Columns.** A DDP bucket is a flat concatenation of parameter gradients. Each parameter is cut
into columns (the unit that shares two floats): a weight with two or more dimensions, in PyTorch's
``[out, in, ...]`` layout, gives one column per output unit, ``w[i]`` (``w[i].numel()`` values,
contiguous), as long as that is at least ``min_column_size`` values; every other parameter (biases,
norms, scalars, weights with tiny output units) is cut into ``ceil(numel / column_size)`` columns of
consecutive values, as equal in length as possible. So a column never spans two parameters, and
the columns of a parameter do not depend on which bucket it sits in.

**Striped aggregation** (CNTK's scheme), for a bucket on a group of ``W`` ranks. The bucket's
columns are cut into ``W`` stripes of about equal size (cuts fall between columns). Then:

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
times the bucket's bytes for a ring all-reduce: about 32x less for 1 bit and long columns. Only
PyTorch's collectives are used (gloo on CPU, NCCL on GPU; gloo has both). Not ``reduce_scatter``:
it sums what is on the wire, and codes scaled by each rank's own column stats cannot be summed in
transit, so it would have to carry dequantized FP32 values, which is what we avoid.

**Hook contract.** The all-to-all is waited for inside the hook (its result decides the next
collective), then the all-gather is started and the returned future's ``then`` callback
dequantizes into the bucket. On GPU that overlaps with the rest of the backward pass (NCCL waits
only order streams); on CPU the hook waits for the all-gather first, so the callback runs at once
in the hook's thread rather than on gloo's, where it would compete with the backward pass for the
cores. All collectives are issued from the thread that runs the hook, in bucket order, so they
match across ranks: a collective started from a gloo callback thread could interleave differently
on different ranks.

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
pack, unpack) lives in ``lowprec.distributed.kernels``; ``fused=True`` (default on CUDA, ``"range"``
rule only) runs it through ``torch.compile`` with bit-identical results. New residuals are written
to pooled spare buffers and swapped in only when every rank was finite.

**Checkpoints.** ``state_dict()`` is a collective: every rank's residuals and counters are gathered
into one dict, which any rank may save (tensor collectives only: no pickling, no numpy);
``load_state_dict()`` on every rank takes its own part. The process group is not saved.
"""

# No ``from __future__ import annotations`` here: DDP's register_comm_hook compares the hook's
# annotations with the real dist.GradBucket and Future[Tensor] objects, not with strings.
import itertools
import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lowprec.distributed import kernels
from lowprec.distributed.quantize import DEFAULT_RULE, check_quantizer, packed_size

__all__ = ["DEFAULT_WARMUP_STEPS", "OneBitState", "column_runs", "onebit_hook"]

#: Uncompressed iterations before compression starts (``OneBitState(warmup_steps=...)``).
DEFAULT_WARMUP_STEPS = 100

_FORMAT = "lowprec.distributed.OneBitState"
_VERSION = 1
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_COUNTERS = (
    "bytes_sent",
    "bytes_received",
    "uncompressed_bytes",
    "compressed_buckets",
    "fallback_buckets",
    "uncompressed_buckets",
)
# Settings that change the numbers; a checkpoint made with other values does not resume bit for bit.
_NUMERIC_CONFIG = ("bits", "rule", "column_size", "min_column_size")

# torch 2.13 deprecates all_gather_into_tensor in favour of all_gather_single; older releases (the
# project supports torch >= 2.4) only have the former.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def column_runs(
    shapes: list[tuple[int, ...]] | tuple[tuple[int, ...], ...],
    *,
    column_size: int = 1024,
    min_column_size: int = 32,
) -> list[tuple[int, int, int]]:
    """The columns of tensors of ``shapes`` laid end to end, as runs of equal-length columns.

    Args:
        shapes: Parameter shapes, in bucket order.
        column_size: Longest column cut from a flat parameter (default: 1024).
        min_column_size: Shortest output unit that is a column of its own (default: 32).

    Returns:
        ``(start, columns, length)`` triples: ``columns`` columns of ``length`` values each,
        starting at flat offset ``start``; together they cover every value once, in order.
    """
    runs: list[tuple[int, int, int]] = []
    offset = 0
    for shape in shapes:
        numel = math.prod(shape)
        if numel == 0:
            continue
        if len(shape) >= 2 and numel // shape[0] >= min_column_size:
            runs.append((offset, shape[0], numel // shape[0]))  # one column per output unit
        else:
            ncols = -(-numel // column_size)
            short, extra = divmod(numel, ncols)  # `extra` columns of short + 1, the rest of short
            if extra:
                runs.append((offset, extra, short + 1))
            runs.append((offset + extra * (short + 1), ncols - extra, short))
        offset += numel
    return runs


@dataclass(frozen=True)
class _Block:
    """``ncols`` columns of ``length`` values, contiguous, inside a stripe."""

    start: int  # first value, counted from the stripe's start
    ncols: int
    length: int
    col: int  # first column, counted from the stripe's first column


@dataclass(frozen=True)
class _Stripe:
    start: int  # first value in the bucket
    end: int
    ncols: int
    blocks: tuple[_Block, ...]

    @property
    def numel(self) -> int:
        return self.end - self.start


class _Layout:
    """One bucket's parameters, columns, stripes and chunk size, and this rank's residuals for it.

    ``local`` is this rank's residual for the whole bucket; ``stripe_residual`` the residual of
    the stripe this rank aggregates (``stripes[rank]``). Both are FP32, on the bucket's device.
    """

    def __init__(
        self,
        keys: tuple[str, ...],
        shapes: list[tuple[int, ...]],
        *,
        world_size: int,
        rank: int,
        bits: int,
        column_size: int,
        min_column_size: int,
    ) -> None:
        self.keys = keys
        self.rank = rank
        self.numels = [math.prod(s) for s in shapes]
        self.offsets = [0]
        for n in self.numels:
            self.offsets.append(self.offsets[-1] + n)
        self.numel = self.offsets[-1]
        self.index = {k: i for i, k in enumerate(keys)}
        runs = column_runs(shapes, column_size=column_size, min_column_size=min_column_size)
        bounds = [0]
        for r in range(1, world_size):
            target = r * self.numel // world_size
            bounds.append(max(bounds[-1], _nearest_column_boundary(runs, target)))
        bounds.append(self.numel)
        self.stripes = [_stripe(runs, a, b) for a, b in itertools.pairwise(bounds)]
        max_cols = max(s.ncols for s in self.stripes)
        max_vals = max(s.numel for s in self.stripes)
        # Chunk: [stats: 2 FP32 per column][packed codes][pad][flag byte]. The size is a multiple
        # of 4 so that every chunk of a [W, S] uint8 buffer can be viewed as FP32 at its start.
        self.codes_at = 8 * max_cols
        self.chunk_bytes = -(-(self.codes_at + packed_size(max_vals, bits) + 1) // 4) * 4
        self.local = torch.empty(0)
        self.stripe_residual = torch.empty(0)
        # Scratch for unpacked codes, made at the first compressed step ("meta": not yet).
        self.codes = torch.empty(0, device="meta")
        self.all_codes = torch.empty(0, device="meta")

    def span(self, key: str) -> tuple[int, int]:
        i = self.index[key]
        return self.offsets[i], self.offsets[i + 1]

    def own_piece(self, key: str) -> tuple[int, torch.Tensor] | None:
        """This rank's stripe residual for ``key``: (first value within the parameter, values)."""
        lo, hi = self.span(key)
        own = self.stripes[self.rank]
        a, b = max(lo, own.start), min(hi, own.end)
        if a >= b:
            return None
        return a - lo, self.stripe_residual[a - own.start : b - own.start]


def _nearest_column_boundary(runs: list[tuple[int, int, int]], target: int) -> int:
    for start, ncols, length in runs:
        if start <= target < start + ncols * length:
            return start + (target - start + length // 2) // length * length
    return target


def _stripe(runs: list[tuple[int, int, int]], a: int, b: int) -> _Stripe:
    blocks, col = [], 0
    for start, ncols, length in runs:
        lo, hi = max(a, start), min(b, start + ncols * length)
        if lo < hi:  # stripe bounds fall between columns, so (hi - lo) is whole columns
            blocks.append(_Block(lo - a, (hi - lo) // length, length, col))
            col += (hi - lo) // length
    return _Stripe(a, b, col, tuple(blocks))


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
            (default: None, meaning fused on CUDA with the ``"range"`` rule, eager otherwise).
            The first compressed step compiles (seconds to a minute).

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

    # ------------------------------------------------------------------------------- helpers

    def _group(self) -> dist.ProcessGroup:
        if not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialized: call dist.init_process_group() before "
                "training with onebit_hook or calling state_dict()/load_state_dict()."
            )
        return self.process_group if self.process_group is not None else dist.group.WORLD

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
        return {"iter": self.iter, **{k: getattr(self, k) for k in _COUNTERS}}

    def _count_allreduce(self, nbytes: int, world: int) -> None:
        ring = 2 * (world - 1) * nbytes // world
        self.bytes_sent += ring
        self.bytes_received += ring

    def _allreduce(self, buffer: torch.Tensor, group: dist.ProcessGroup) -> torch.futures.Future:
        """DDP's default: divide by the world size, then sum, asynchronously."""
        world = group.size()
        self._count_allreduce(buffer.numel() * buffer.element_size(), world)
        buffer.div_(world)
        fut = dist.all_reduce(buffer, group=group, async_op=True).get_future()
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
        fp32 = {"dtype": torch.float32, "device": buffer.device}
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

    def _kernel(self, name: str, *args: Any, fused_name: str | None = None) -> Any:
        """Run ``kernels.<name>(*args)`` (``kernels.<fused_name>`` on the fused path, compiled),
        or if compiling fails, a warning and eagerly for good. Same results either way."""
        if self._fused_active:
            try:
                variant = (self.bits, self.rule, args[0].dtype, args[0].dim())
                with kernels.compile_settings():
                    return kernels.compiled(fused_name or name, *variant)(*args)
            except kernels.COMPILE_ERRORS as error:
                self._fused_active = False
                warnings.warn(
                    "lowprec: the fused (torch.compile) 1-bit hook is unavailable here "
                    f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
                    "); continuing eagerly, with the same results, more slowly. Install a C++ "
                    "compiler (CPU) or Triton (GPU), or pass fused=False to silence this.",
                    RuntimeWarning,
                    stacklevel=2,
                )
        return getattr(kernels, name)(*args)

    def _spare(self, numel: int, device: torch.device) -> torch.Tensor:
        """An FP32 buffer of ``numel`` values for new residuals (reused: see ``_give_back``)."""
        pool = self._spares.get((numel, device))
        return pool.pop() if pool else torch.empty(numel, dtype=torch.float32, device=device)

    def _give_back(self, t: torch.Tensor) -> None:
        self._spares.setdefault((t.numel(), t.device), []).append(t)

    def _encode_stripe(self, kernel: str, stripe: _Stripe, layout: _Layout, chunk: torch.Tensor,
                       codes: torch.Tensor, inputs: tuple[torch.Tensor, ...],
                       res_out: torch.Tensor) -> list[torch.Tensor]:
        """Quantize a stripe block by block with ``kernel`` into ``chunk`` (stats, packed codes)
        and ``res_out`` (new residual); ``inputs[i]`` are flat over the stripe (the senders' codes
        and stats for ``"reaggregate"``: ``[W, values]`` and ``[W, columns, 2]``). Returns the
        blocks' "all columns finite" flags."""
        stats = chunk[: 8 * stripe.ncols].view(torch.float32).view(stripe.ncols, 2)
        flags = []
        for b in stripe.blocks:
            n, shape = b.ncols * b.length, (b.ncols, b.length)
            if kernel == "encode":
                g, res = inputs
                args = (g[b.start : b.start + n].view(shape), res[b.start : b.start + n].view(shape))
            else:
                all_codes, all_stats, res = inputs
                args = (all_codes[:, b.start : b.start + n].view(-1, *shape),
                        all_stats[:, b.col : b.col + b.ncols], res[b.start : b.start + n].view(shape))
            flags.append(self._kernel(kernel, *args, res_out[b.start : b.start + n].view(shape),
                                      codes[b.start : b.start + n].view(shape),
                                      stats[b.col : b.col + b.ncols], self.bits, self.rule))
        m = packed_size(stripe.numel, self.bits)
        codes[stripe.numel : m * (8 // self.bits)].zero_()  # the last byte's unused slots
        self._kernel("pack", codes[: m * (8 // self.bits)],
                     chunk[layout.codes_at : layout.codes_at + m], self.bits,
                     fused_name="pack_wide")
        return flags

    def _decode_stripe(self, chunk: torch.Tensor, stripe: _Stripe, layout: _Layout,
                       codes: torch.Tensor, out: torch.Tensor) -> None:
        """Dequantize ``chunk`` (a stripe's stats and packed codes) into ``out``, block by block."""
        m = packed_size(stripe.numel, self.bits)
        self._kernel("unpack", chunk[None, layout.codes_at : layout.codes_at + m],
                     codes[None, : m * (8 // self.bits)], self.bits, fused_name="unpack_wide")
        stats = chunk[: 8 * stripe.ncols].view(torch.float32).view(stripe.ncols, 2)
        for b in stripe.blocks:
            n = b.ncols * b.length
            self._kernel("decode", codes[b.start : b.start + n].view(b.ncols, b.length),
                         stats[b.col : b.col + b.ncols],
                         out[b.start : b.start + n].view(b.ncols, b.length), self.bits, self.rule)

    def _compressed(self, bucket: dist.GradBucket, buffer: torch.Tensor,
                    group: dist.ProcessGroup) -> torch.futures.Future:
        if self._fused_active is None:
            self._fused_active = buffer.device.type == "cuda" and self.rule == "range"
        layout = self._layout_for(bucket, buffer, group)
        world, rank, size = group.size(), dist.get_rank(group), layout.chunk_bytes
        device, per = buffer.device, 8 // self.bits
        # Unpacked codes of one stripe at a time (padded to whole bytes), reused by every stage
        # and every step: allocating it afresh costs page faults on CPU.
        if layout.codes.device != device:
            longest = max(s.numel for s in layout.stripes)
            layout.codes = torch.empty(packed_size(longest, self.bits) * per, dtype=torch.uint8,
                                       device=device)
            own = layout.stripes[rank]
            layout.all_codes = torch.empty(world, packed_size(own.numel, self.bits) * per,
                                           dtype=torch.uint8, device=device)
        codes = layout.codes
        # Stage 1: local error feedback (the new residual goes to a spare buffer, so that the
        # old one survives a fallback), then stripe r of every rank to rank r.
        local = self._spare(layout.numel, device)
        send = torch.zeros(world, size, dtype=torch.uint8, device=device)
        flags: list[torch.Tensor] = []
        for j, stripe in enumerate(layout.stripes):
            if stripe.ncols:
                part = slice(stripe.start, stripe.end)
                flags += self._encode_stripe("encode", stripe, layout, send[j], codes,
                                             (buffer[part], layout.local[part]), local[part])
        if flags:  # every receiver learns whether we are finite
            send[:, size - 1] = (~torch.stack(flags).all()).to(torch.uint8)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv.view(-1), send.view(-1), group=group)
        self.bytes_sent += (world - 1) * size
        self.bytes_received += (world - 1) * size
        self.uncompressed_bytes += 2 * (world - 1) * buffer.numel() * buffer.element_size() // world
        if bool(recv[:, size - 1].any()):  # some rank is not finite: all ranks fall back together
            self._give_back(local)
            self.fallback_buckets += 1
            return self._allreduce(buffer, group)
        self._give_back(layout.local)
        layout.local = local  # gradient + old residual - reconstruction
        # Stage 2: sum this rank's stripe over all senders, average, requantize.
        own = layout.stripes[rank]
        send2 = torch.zeros(size, dtype=torch.uint8, device=device)
        if own.ncols:
            m = packed_size(own.numel, self.bits)
            all_codes = layout.all_codes
            self._kernel("unpack", recv[:, layout.codes_at : layout.codes_at + m], all_codes,
                         self.bits, fused_name="unpack_wide")
            all_stats = recv[:, : 8 * own.ncols].view(torch.float32).view(world, own.ncols, 2)
            residual = self._spare(own.numel, device)
            flags = self._encode_stripe("reaggregate", own, layout, send2, codes,
                                        (all_codes, all_stats, layout.stripe_residual), residual)
            if bool(torch.stack(flags).all()):
                self._give_back(layout.stripe_residual)
                layout.stripe_residual = residual
            else:  # the average overflowed: keep the old stripe residual, flag the stripe
                self._give_back(residual)
                send2[size - 1] = 1
        # Stage 3: every rank gets every requantized stripe.
        gathered = torch.empty(world, size, dtype=torch.uint8, device=device)
        work = _all_gather_single(gathered.view(-1), send2, group=group, async_op=True)
        self.bytes_sent += (world - 1) * size
        self.bytes_received += (world - 1) * size
        self.compressed_buckets += 1
        stripes = layout.stripes

        def decompress(fut: torch.futures.Future) -> torch.Tensor:
            fut.wait()
            for j, stripe in enumerate(stripes):
                if stripe.ncols:
                    self._decode_stripe(gathered[j], stripe, layout, codes,
                                        buffer[stripe.start : stripe.end])
            return buffer

        if device.type == "cpu":
            # Finish here, so that `then` runs decompress at once in this thread: from gloo's
            # thread it would compete with the backward pass for the cores (2x slower measured
            # with 2 processes on 2 cores). On GPU the chain stays asynchronous.
            work.wait()
        return work.get_future().then(decompress)

    # ---------------------------------------------------------------------------- checkpoints

    def _own_residuals(self) -> dict[str, Any]:
        local: dict[str, torch.Tensor] = {}
        stripe: dict[str, dict[str, Any]] = {}
        for key in sorted(set(self._home) | set(self._pending_local) | set(self._pending_stripe)):
            home = self._home.get(key)
            src = self._pending_local.get(key)
            if src is None and home is not None:
                a, b = home.span(key)
                src = home.local[a:b]
            if src is not None:
                local[key] = src.detach().to("cpu", torch.float32, copy=True)
            piece = self._pending_stripe.get(key)
            if piece is None and home is not None:
                piece = home.own_piece(key)
            if piece is not None:
                stripe[key] = {"offset": piece[0],
                               "residual": piece[1].detach().to("cpu", torch.float32, copy=True)}
        return {"local": local, "stripe": stripe, "counters": self.counters()}

    def _comm_device(self, group: dist.ProcessGroup) -> torch.device:
        """Where the checkpoint collectives' tensors live: CUDA for an NCCL-only group, else CPU."""
        if dist.get_backend(group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def state_dict(self) -> dict[str, Any]:
        """Every rank's residuals and counters, the settings and the iteration, on every rank.

        A collective over the state's process group: call it on **every** rank (then save the
        result on one). The process group itself is not saved. Only tensor collectives are used
        (no pickling through ``all_gather_object``): an int64 header per rank (counters, and per
        parameter the length of its local residual and the offset and length of its stripe
        piece), then every rank's residuals as one flat FP32 tensor, padded to the longest.

        Returns:
            ``{"format", "version", "world_size", "iter", "config", "ranks"}``; ``ranks[r]`` holds
            rank ``r``'s ``"local"`` residuals (name -> FP32 CPU tensor of the parameter's size),
            ``"stripe"`` residuals (name -> ``{"offset", "residual"}``, the values of the stripe
            it aggregates) and ``"counters"``.

        Raises:
            RuntimeError: The ranks' states were built on models with different parameters.
        """
        group = self._group()
        world = group.size()
        device = self._comm_device(group)
        own = self._own_residuals()
        names = list(self._numels)  # the module's parameters, in order: the same on every rank
        counters = own["counters"]
        header = [counters["iter"], *(counters[k] for k in _COUNTERS)]
        payload: list[torch.Tensor] = []
        for name in names:
            local = own["local"].get(name)
            piece = own["stripe"].get(name)
            header.append(-1 if local is None else local.numel())
            header += [-1, -1] if piece is None else [piece["offset"], piece["residual"].numel()]
            if local is not None:
                payload.append(local)
            if piece is not None:
                payload.append(piece["residual"])
        flat = torch.cat(payload) if payload else torch.zeros(0)
        # 1. Sizes: the header's length names the model (the same on every rank, else nobody can
        # decode the others' headers), the payload's length sets the padding.
        sizes = torch.tensor([len(header), flat.numel(), sum(self._numels.values())],
                             dtype=torch.int64, device=device)
        all_sizes = torch.empty(world, 3, dtype=torch.int64, device=device)
        _all_gather_single(all_sizes.view(-1), sizes, group=group)
        all_sizes = all_sizes.cpu()
        if not bool((all_sizes[:, [0, 2]] == all_sizes[0, [0, 2]]).all()):
            raise RuntimeError(
                "OneBitState.state_dict(): the ranks' states were built on different models "
                f"(parameters per rank: {(all_sizes[:, 0] - 1 - len(_COUNTERS)) // 3}, values "
                f"per rank: {all_sizes[:, 2].tolist()}); build every rank's state on the same "
                "model DDP wraps."
            )
        # 2. Headers (now known to have one length) and 3. payloads, padded to the longest.
        headers = torch.empty(world, len(header), dtype=torch.int64, device=device)
        _all_gather_single(headers.view(-1), torch.tensor(header, dtype=torch.int64,
                                                           device=device), group=group)
        headers = headers.cpu()
        longest = int(all_sizes[:, 1].max())
        send = torch.zeros(longest, dtype=torch.float32, device=device)
        send[: flat.numel()] = flat
        payloads = torch.empty(world, longest, dtype=torch.float32, device=device)
        if longest:
            _all_gather_single(payloads.view(-1), send, group=group)
        payloads = payloads.cpu()
        ranks = [self._decode_rank(names, headers[r].tolist(), payloads[r]) for r in range(world)]
        return {
            "format": _FORMAT,
            "version": _VERSION,
            "world_size": world,
            "iter": self.iter,
            "config": self.config(),
            "ranks": ranks,
        }

    @staticmethod
    def _decode_rank(names: list[str], header: list[int], payload: torch.Tensor) -> dict[str, Any]:
        """One rank's part of ``state_dict()`` from its header and payload (see there)."""
        counters = {"iter": header[0], **dict(zip(_COUNTERS, header[1 : 1 + len(_COUNTERS)],
                                                  strict=True))}
        local: dict[str, torch.Tensor] = {}
        stripe: dict[str, dict[str, Any]] = {}
        at, h = 0, 1 + len(_COUNTERS)
        for name in names:
            n_local, offset, n_stripe = header[h : h + 3]
            h += 3
            if n_local >= 0:
                local[name] = payload[at : at + n_local].clone()
                at += n_local
            if n_stripe >= 0:
                stripe[name] = {"offset": offset, "residual": payload[at : at + n_stripe].clone()}
                at += n_stripe
        return {"local": dict(sorted(local.items())), "stripe": dict(sorted(stripe.items())),
                "counters": counters}

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
        if not isinstance(state_dict, dict) or state_dict.get("format") != _FORMAT:
            raise TypeError(
                "state_dict is not a OneBitState.state_dict() (no format "
                f"{_FORMAT!r}); pass the dict that state.state_dict() returned."
            )
        if state_dict.get("version") != _VERSION:
            raise ValueError(
                f"OneBitState checkpoint version {state_dict.get('version')!r} is not supported "
                f"(this lowprec reads version {_VERSION})."
            )
        group = self._group()
        world, rank = group.size(), dist.get_rank(group)
        saved_world = state_dict["world_size"]
        if saved_world != world or len(state_dict["ranks"]) != world:
            raise ValueError(
                f"the OneBitState checkpoint was saved by {saved_world} ranks but this process "
                f"group has {world}: residuals are per rank and cannot be re-split. Resume with "
                f"{saved_world} ranks, or start this state afresh (skip load_state_dict)."
            )
        if strict:
            diff = [f"{k}: saved {state_dict['config'].get(k)!r}, here {getattr(self, k)!r}"
                    for k in _NUMERIC_CONFIG if state_dict["config"].get(k) != getattr(self, k)]
            if diff:
                raise ValueError(
                    "the OneBitState checkpoint was made with other settings (" + "; ".join(diff)
                    + "): build the state with the saved settings to resume bit for bit, or "
                    "pass strict=False to carry the residuals over anyway."
                )
        for r, part in enumerate(state_dict["ranks"]):
            for key in set(part["local"]) | set(part["stripe"]):
                if key not in self._numels:
                    if strict:
                        raise ValueError(
                            f"the OneBitState checkpoint has residuals for {key!r} (rank {r}), "
                            "which is not a parameter of this module; load into a state built "
                            "on the same model, or pass strict=False to drop them."
                        )
                    continue
                numel = self._numels[key]
                local = part["local"].get(key)
                piece = part["stripe"].get(key)
                if (local is not None and local.numel() != numel) or (
                    piece is not None and piece["offset"] + piece["residual"].numel() > numel
                ):
                    raise ValueError(
                        f"the OneBitState checkpoint's residual for {key!r} (rank {r}) does not "
                        f"fit the parameter's {numel} values: it was saved for another model."
                    )
        mine = state_dict["ranks"][rank]
        self._layouts.clear()
        self._home.clear()
        self._pending_local = {
            k: v.detach().to(torch.float32).reshape(-1).clone()
            for k, v in mine["local"].items() if k in self._numels
        }
        self._pending_stripe = {
            k: (int(v["offset"]), v["residual"].detach().to(torch.float32).reshape(-1).clone())
            for k, v in mine["stripe"].items() if k in self._numels
        }
        self._carry = {k for part in state_dict["ranks"] for k in part["stripe"]
                       if k in self._numels}
        self.iter = int(state_dict["iter"])
        for k in _COUNTERS:
            setattr(self, k, int(mine["counters"].get(k, 0)))


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

    Example::

        >>> state = OneBitState(model, warmup_steps=100)
        >>> ddp_model.register_comm_hook(state, onebit_hook)
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
