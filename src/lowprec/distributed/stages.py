"""A compressed bucket's three stages, each ending in a collective that runs while others compute.

``start`` (stage 1) adds the local residual, quantizes every column into ``W`` chunks and starts
the all-to-all. ``exchange`` (stage 2) waits for it, and either sums, averages and requantizes this
rank's stripe and starts the all-gather, or, if any rank had a NaN or an infinity, starts DDP's
uncompressed all-reduce instead. ``finish`` (stage 3) waits for that and dequantizes every stripe
into the bucket, then completes the bucket's future. ``OneBitState`` runs them as a pipeline over
the buckets of an iteration (see ``lowprec.distributed.hook``): while one bucket's messages are on
the wire, the next bucket is quantized and the backward pass goes on.

The per-block work is ``lowprec.distributed.kernels``, compiled or eager (``run``); new residuals
go to pooled spare buffers and replace the old ones only when every rank was finite.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist

from lowprec.distributed import kernels
from lowprec.distributed.checkpoint import all_gather_single
from lowprec.distributed.layout import _Layout, _Stripe
from lowprec.distributed.quantize import packed_size


class OneBitState(Protocol):
    """What the stages read and count of ``hook.OneBitState`` (typed here, so that the stages
    import nothing of the hook that runs them)."""

    bits: int
    rule: str
    _fused_active: bool | None
    bytes_sent: int
    bytes_received: int
    uncompressed_bytes: int
    compressed_buckets: int
    fallback_buckets: int

    def _spare(self, numel: int, device: torch.device) -> torch.Tensor: ...

    def _give_back(self, t: torch.Tensor) -> None: ...

    def _start_allreduce(self, buffer: torch.Tensor, group: dist.ProcessGroup) -> Any: ...


@dataclass(eq=False)
class InFlight:
    """A compressed bucket between its stages: what the next stage needs, and its future."""

    layout: _Layout
    buffer: torch.Tensor
    group: dist.ProcessGroup
    future: torch.futures.Future[torch.Tensor]
    work: Any  # the collective in flight
    recv: torch.Tensor  # stage 1: the all-to-all's result; stage 2: the all-gather's
    local: torch.Tensor | None  # the new local residual, kept if every rank was finite
    stage: int = 1  # 1: all-to-all in flight; 2: all-gather (or fallback all-reduce) in flight
    fallback: bool = False
    done: bool = False


def run(state: OneBitState, name: str, *args: Any, fused_name: str | None = None) -> Any:
    """Run ``kernels.<name>(*args)`` (``kernels.<fused_name>`` on the compiled path), or if
    compiling fails, a warning and eagerly for good. Same results either way."""
    if state._fused_active:
        try:
            variant = (state.bits, state.rule, args[0].dtype, args[0].dim())
            with kernels.compile_settings():
                return kernels.compiled(fused_name or name, *variant)(*args)
        except kernels.COMPILE_ERRORS as error:
            state._fused_active = False
            warnings.warn(
                "lowprec: the fused (torch.compile) 1-bit hook is unavailable here "
                f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
                "); continuing eagerly, with the same results, more slowly. Install a C++ "
                "compiler (CPU) or Triton (GPU), or pass fused=False to silence this.",
                RuntimeWarning,
                stacklevel=2,
            )
    return getattr(kernels, name)(*args)


def _packed(state: OneBitState, stripe: _Stripe) -> list[bool]:
    """Per block of ``stripe``, whether stages 2 and 3 read its codes straight from the packed
    bytes (``kernels.reaggregate_packed``, ``decode_packed``): on the compiled path, for blocks
    whose codes start and end on byte boundaries (columns a multiple of ``8 // bits`` long)."""
    per = 8 // state.bits
    return [bool(state._fused_active) and b.start % per == 0 and b.length % per == 0
            for b in stripe.blocks]


def _encode_stripe(state: OneBitState, kernel: str, stripe: _Stripe, layout: _Layout,
                   chunk: torch.Tensor, inputs: tuple[torch.Tensor, ...],
                   res_out: torch.Tensor) -> list[torch.Tensor]:
    """Quantize a stripe block by block with ``kernel`` into ``chunk`` (stats, packed codes) and
    ``res_out`` (new residual); ``inputs[i]`` are flat over the stripe (for ``"reaggregate"``: the
    senders' unpacked codes ``[W, values]``, their packed bytes ``[W, bytes]``, their stats ``[W,
    columns, 2]`` and the stripe residual). Returns the blocks' "all columns finite" flags."""
    codes, bits, per = layout.codes, state.bits, 8 // state.bits
    stats = chunk[: 8 * stripe.ncols].view(torch.float32).view(stripe.ncols, 2)
    flags = []
    packed = _packed(state, stripe) if kernel == "reaggregate" else [False] * len(stripe.blocks)
    for b, from_bytes in zip(stripe.blocks, packed, strict=True):
        n = b.ncols * b.length
        shape = (b.ncols, b.length // per, per) if from_bytes else (b.ncols, b.length)
        if kernel == "encode":
            g, res = inputs
            args = (g[b.start : b.start + n].view(shape), res[b.start : b.start + n].view(shape))
            name = kernel
        elif from_bytes:
            _, all_bytes, all_stats, res = inputs
            args = (all_bytes[:, b.start // per : (b.start + n) // per].view(-1, *shape[:2]),
                    all_stats[:, b.col : b.col + b.ncols], res[b.start : b.start + n].view(shape))
            name = "reaggregate_packed"
        else:
            all_codes, _, all_stats, res = inputs
            args = (all_codes[:, b.start : b.start + n].view(-1, *shape),
                    all_stats[:, b.col : b.col + b.ncols], res[b.start : b.start + n].view(shape))
            name = kernel
        flags.append(run(state, name, *args, res_out[b.start : b.start + n].view(shape),
                         codes[b.start : b.start + n].view(shape),
                         stats[b.col : b.col + b.ncols], bits, state.rule))
    m = packed_size(stripe.numel, bits)
    codes[stripe.numel : m * (8 // bits)].zero_()  # the last byte's unused slots
    run(state, "pack", codes[: m * (8 // bits)], chunk[layout.codes_at : layout.codes_at + m],
        bits, fused_name="pack_wide")
    return flags


def _decode_stripe(state: OneBitState, chunk: torch.Tensor, stripe: _Stripe, layout: _Layout,
                   out: torch.Tensor) -> None:
    """Dequantize ``chunk`` (a stripe's stats and packed codes) into ``out``, block by block."""
    codes, bits, per = layout.codes, state.bits, 8 // state.bits
    m = packed_size(stripe.numel, bits)
    data = chunk[layout.codes_at : layout.codes_at + m]
    packed = _packed(state, stripe)
    if not all(packed):
        run(state, "unpack", data[None], codes[None, : m * per], bits, fused_name="unpack_wide")
    stats = chunk[: 8 * stripe.ncols].view(torch.float32).view(stripe.ncols, 2)
    for b, from_bytes in zip(stripe.blocks, packed, strict=True):
        n = b.ncols * b.length
        if from_bytes:
            run(state, "decode_packed", data[b.start // per : (b.start + n) // per].view(
                b.ncols, -1), stats[b.col : b.col + b.ncols],
                out[b.start : b.start + n].view(b.ncols, -1, per), bits, state.rule)
        else:
            run(state, "decode", codes[b.start : b.start + n].view(b.ncols, b.length),
                stats[b.col : b.col + b.ncols], out[b.start : b.start + n].view(b.ncols, b.length),
                bits, state.rule)


def _scratch(state: OneBitState, layout: _Layout, world: int, device: torch.device) -> None:
    """Make ``layout``'s unpacked-code buffers (padded to whole bytes) on first use: reused by
    every stage and step, since allocating them afresh costs page faults on CPU."""
    if layout.codes.device == device:
        return
    per = 8 // state.bits
    longest = max(s.numel for s in layout.stripes)
    layout.codes = torch.empty(packed_size(longest, state.bits) * per, dtype=torch.uint8,
                               device=device)
    own = layout.stripes[layout.rank]
    layout.all_codes = torch.empty(world, packed_size(own.numel, state.bits) * per,
                                   dtype=torch.uint8, device=device)


def start(state: OneBitState, layout: _Layout, buffer: torch.Tensor,
          group: dist.ProcessGroup) -> InFlight:
    """Stage 1: local error feedback (the new residual goes to a spare buffer, so that the old one
    survives a fallback), then stripe ``r`` of every rank to rank ``r``, started."""
    world, size, device = group.size(), layout.chunk_bytes, buffer.device
    _scratch(state, layout, world, device)
    local = state._spare(layout.numel, device)
    send = torch.zeros(world, size, dtype=torch.uint8, device=device)
    flags: list[torch.Tensor] = []
    for j, stripe in enumerate(layout.stripes):
        if stripe.ncols:
            part = slice(stripe.start, stripe.end)
            flags += _encode_stripe(state, "encode", stripe, layout, send[j],
                                    (buffer[part], layout.local[part]), local[part])
    if flags:  # every receiver learns whether we are finite
        send[:, size - 1] = (~torch.stack(flags).all()).to(torch.uint8)
    recv = torch.empty_like(send)
    work = dist.all_to_all_single(recv.view(-1), send.view(-1), group=group, async_op=True)
    state.bytes_sent += (world - 1) * size
    state.bytes_received += (world - 1) * size
    state.uncompressed_bytes += 2 * (world - 1) * buffer.numel() * buffer.element_size() // world
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future(
        devices=[device] if device.type == "cuda" else None)
    return InFlight(layout, buffer, group, future, work, recv, local)


def exchange(state: OneBitState, item: InFlight) -> None:
    """Stage 2: wait for the all-to-all; then this rank's stripe summed over the senders,
    averaged and requantized, and the all-gather started; or, if some rank was not finite, the
    uncompressed all-reduce started instead, by every rank alike."""
    layout, group, recv = item.layout, item.group, item.recv
    world, rank, size = group.size(), dist.get_rank(group), layout.chunk_bytes
    device = item.buffer.device
    item.work.wait()
    item.stage = 2
    # (stage 1 made the new local residual)
    new_local = cast(torch.Tensor, item.local)
    if bool(recv[:, size - 1].any()):  # some rank is not finite: all ranks fall back together
        state._give_back(new_local)
        item.local = None
        state.fallback_buckets += 1
        item.fallback = True
        item.work = state._start_allreduce(item.buffer, group)
        return
    state._give_back(layout.local)
    layout.local = new_local  # gradient + old residual - reconstruction
    item.local = None
    own = layout.stripes[rank]
    send2 = torch.zeros(size, dtype=torch.uint8, device=device)
    if own.ncols:
        m = packed_size(own.numel, state.bits)
        all_codes, all_bytes = layout.all_codes, recv[:, layout.codes_at : layout.codes_at + m]
        if not all(_packed(state, own)):
            for k in range(world):  # one contiguous row at a time: the fast form of the kernel
                run(state, "unpack", all_bytes[k : k + 1], all_codes[k : k + 1], state.bits,
                    fused_name="unpack_wide")
        all_stats = recv[:, : 8 * own.ncols].view(torch.float32).view(world, own.ncols, 2)
        residual = state._spare(own.numel, device)
        flags = _encode_stripe(state, "reaggregate", own, layout, send2,
                               (all_codes, all_bytes, all_stats, layout.stripe_residual), residual)
        if bool(torch.stack(flags).all()):
            state._give_back(layout.stripe_residual)
            layout.stripe_residual = residual
        else:  # the average overflowed: keep the old stripe residual, flag the stripe
            state._give_back(residual)
            send2[size - 1] = 1
    # Stage 3's collective: every rank gets every requantized stripe.
    gathered = torch.empty(world, size, dtype=torch.uint8, device=device)
    item.work = all_gather_single(gathered.view(-1), send2, group=group, async_op=True)
    item.recv = gathered
    state.bytes_sent += (world - 1) * size
    state.bytes_received += (world - 1) * size
    state.compressed_buckets += 1


def finish(state: OneBitState, item: InFlight) -> None:
    """Stage 3: wait for the all-gather (or the fallback all-reduce), dequantize every stripe into
    the bucket, and complete the bucket's future."""
    item.work.wait()
    if not item.fallback:
        for j, stripe in enumerate(item.layout.stripes):
            if stripe.ncols:
                _decode_stripe(state, item.recv[j], stripe, item.layout,
                               item.buffer[stripe.start : stripe.end])
    item.done = True
    item.future.set_result(item.buffer)
