"""Time an FP32 all-reduce of a model's gradients against the 1-bit hook, on gloo processes.

``--world`` processes (default 2) join a gloo group on 127.0.0.1 (loopback) and each holds
``--values-millions`` million FP32 gradient values (default 25), as ``1024 x 1024`` weights cut into
DDP-sized buckets of ``--bucket-mb`` MB (default 25; 0 puts everything in one bucket). Per
iteration, after a barrier, each rank times:

* ``fp32 all_reduce (1 call)``: ``dist.all_reduce`` of all values in one tensor;
* ``fp32 all_reduce (buckets)``: one ``all_reduce`` per bucket, as DDP's default hook does;
* ``1-bit collectives``: only the hook's messages, per bucket one ``all_to_all_single`` and one
  ``all_gather_single`` of the chunk size the hook uses (packed codes + two floats per column);
* ``bf16_compress_hook``: PyTorch's ``default_hooks.bf16_compress_hook`` per bucket (cast to
  BF16, all-reduce, cast back), waited for;
* ``1-bit hook, fused`` and ``1-bit hook, eager``: ``onebit_hook`` per bucket (quantize with
  error feedback, the two collectives, requantize, dequantize), waited for, with residuals carried
  over from the last iteration as in training; ``OneBitState(fused=True)`` (the quantizer compiled
  by ``torch.compile``, compiled before timing) and ``fused=False``;
* ``memory floor``: no communication, only the memory traffic any error-feedback hook needs per
  value (read gradient and residual, write residual and result: ``r += g; g.copy_(r)``), the
  physical lower bound of the hook's own work on this machine.

A row's time per iteration is the slowest rank's; the table gives the median, the interquartile
range and the minimum over ``--iters`` iterations after ``--warmup`` untimed ones. Bytes are per
rank and iteration: what a ring all-reduce sends (``2 (W - 1) / W`` of the buffer) and what the
hook's byte counters recorded.

Loopback moves bytes at memory speed, so here the hook's quantization costs more than the bytes it
saves; the collectives row shows what the wire would carry. Across machines the FP32 row grows with
the bytes (25M values are 100 MB: about 0.16 s at 10 Gbit/s for a ring of two) and the collectives
row with 1/30 of them.

Examples::

    python benchmarks/onebit_allreduce.py                 # 25M values, 2 processes
    python benchmarks/onebit_allreduce.py --quick         # smoke run: 1M values, a few seconds
    python benchmarks/onebit_allreduce.py --bits 2 --json /tmp/onebit.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from lowprec.distributed import DEFAULT_RULE, OneBitState, onebit_hook

ROWS = ("fp32 all_reduce (1 call)", "fp32 all_reduce (buckets)", "bf16_compress_hook",
        "1-bit collectives", "1-bit hook, fused", "1-bit hook, eager", "memory floor")
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _Bucket:
    """The part of ``dist.GradBucket`` that ``onebit_hook`` uses."""

    def __init__(self, index: int, params: list[torch.nn.Parameter], buffer: torch.Tensor,
                 last: bool) -> None:
        self._index, self._params, self._buffer, self._last = index, params, buffer, last

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def parameters(self) -> list[torch.nn.Parameter]:
        return self._params

    def gradients(self) -> list[torch.Tensor]:
        out, at = [], 0
        for p in self._params:
            out.append(self._buffer[at : at + p.numel()].view_as(p))
            at += p.numel()
        return out

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._last


def _model(values: int) -> torch.nn.ParameterList:
    full, rest = divmod(values, 1024 * 1024)
    shapes = [(1024, 1024)] * full + ([(rest // 1024, 1024)] if rest >= 1024 else [])
    return torch.nn.ParameterList([torch.nn.Parameter(torch.empty(s)) for s in shapes])


def _buckets(params: list[torch.nn.Parameter], bucket_bytes: int) -> list[list[torch.nn.Parameter]]:
    groups: list[list[torch.nn.Parameter]] = [[]]
    size = 0
    for p in params:
        if groups[-1] and bucket_bytes and size + 4 * p.numel() > bucket_bytes:
            groups.append([])
            size = 0
        groups[-1].append(p)
        size += 4 * p.numel()
    return groups


def _timed(fn: Any, group_max: bool = True) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    if group_max:
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # the slowest rank's time
    return dt.item()


def _worker(rank: int, world: int, port: int, opts: dict[str, Any], out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = str(opts["threads"])
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(opts["threads"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=300))
    try:
        _bench(rank, world, opts, out)
    finally:
        dist.destroy_process_group()


def _bench(rank: int, world: int, opts: dict[str, Any], out: str) -> None:
    model = _model(int(opts["values_millions"] * 1e6))
    params = list(model.parameters())
    groups = _buckets(params, int(opts["bucket_mb"] * 1024 * 1024))
    gen = torch.Generator().manual_seed(rank)
    grads = [torch.randn(sum(p.numel() for p in g), generator=gen) for g in groups]
    flat = torch.cat(grads)
    buffers = [g.clone() for g in grads]
    fused = opts["rule"] == "range"
    state = OneBitState(model, bits=opts["bits"], rule=opts["rule"], warmup_steps=0,
                        fused=fused)
    eager = OneBitState(model, bits=opts["bits"], rule=opts["rule"], warmup_steps=0, fused=False)
    floor = [torch.zeros_like(b) for b in buffers]

    def run_hook(st: OneBitState = state) -> None:
        futs = [onebit_hook(st, _Bucket(i, g, b, i == len(groups) - 1))
                for i, (g, b) in enumerate(zip(groups, buffers, strict=True))]
        for f in futs:
            f.wait()

    def run_bf16() -> None:
        futs = [default_hooks.bf16_compress_hook(None, _Bucket(i, g, b, i == len(groups) - 1))
                for i, (g, b) in enumerate(zip(groups, buffers, strict=True))]
        for f in futs:
            f.wait()

    def run_floor() -> None:
        for r, b in zip(floor, buffers, strict=True):
            r.add_(b)
            b.copy_(r)

    run_hook()  # builds the layouts (and compiles); their chunk sizes give the collectives row
    run_hook()  # its messages
    chunks = [layout.chunk_bytes for layout in state._layouts.values()]
    sends = [torch.zeros(world * c, dtype=torch.uint8) for c in chunks]
    recvs = [torch.empty_like(s) for s in sends]
    gathered = [torch.empty_like(s) for s in sends]

    def collectives() -> None:
        for send, recv, gath, c in zip(sends, recvs, gathered, chunks, strict=True):
            dist.all_to_all_single(recv, send)
            _all_gather_single(gath, send[:c])

    def reset() -> None:
        for b, g in zip(buffers, grads, strict=True):
            b.copy_(g)

    samples: dict[str, list[float]] = {r: [] for r in ROWS}
    before = state.counters()
    for it in range(opts["warmup"] + opts["iters"]):
        copy = flat.clone()
        times = {ROWS[0]: _timed(lambda copy=copy: dist.all_reduce(copy))}
        reset()
        times[ROWS[1]] = _timed(lambda: [dist.all_reduce(b) for b in buffers])
        reset()
        times[ROWS[2]] = _timed(run_bf16)
        times[ROWS[3]] = _timed(collectives)
        reset()
        if it == opts["warmup"]:
            before = state.counters()
        times[ROWS[4]] = _timed(run_hook)
        reset()
        if not opts["no_eager"]:
            times[ROWS[5]] = _timed(lambda: run_hook(eager))
            reset()
        times[ROWS[6]] = _timed(run_floor)
        if it >= opts["warmup"]:
            for k, v in times.items():
                samples[k].append(v)
    after = state.counters()
    if rank == 0:
        n = flat.numel()
        result = {
            "options": opts,
            "world": world,
            "values": n,
            "buckets": [sum(p.numel() for p in g) for g in groups],
            "chunk_bytes": chunks,
            "bytes_per_iteration": {
                "fp32_ring": 2 * (world - 1) * 4 * n // world,
                "bf16_ring": 2 * (world - 1) * 2 * n // world,
                "onebit_sent": (after["bytes_sent"] - before["bytes_sent"]) // opts["iters"],
                "onebit_received": (after["bytes_received"] - before["bytes_received"])
                // opts["iters"],
            },
            "samples_s": {k: v for k, v in samples.items() if v},
            "fused": fused,
            "torch": torch.__version__,
        }
        Path(out).write_text(json.dumps(result))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _loadavg() -> float | None:
    """The 1-minute load average (Linux), to tell a busy machine's numbers apart."""
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _report(result: dict[str, Any]) -> str:
    b = result["bytes_per_iteration"]
    load = result.get("loadavg")
    lines = [
        f"{result['world']} gloo processes on 127.0.0.1, {result['values'] / 1e6:.1f}M FP32 values"
        f" in {len(result['buckets'])} bucket(s), {result['options']['bits']}-bit "
        f"{result['options']['rule']!r}, torch {result['torch']}, "
        f"{result['options']['iters']} timed iterations, {os.cpu_count()} CPUs",
    ]
    if load and None not in load:
        lines.append(f"load average before/after: {load[0]:.2f}/{load[1]:.2f} (the benchmark's "
                     f"own processes add about {result['world']}; more means others were busy)")
    lines += [
        "",
        f"{'':28s} {'median ms':>10s} {'IQR ms':>15s} {'min ms':>8s} {'x fp32 1 call':>14s}",
    ]
    base = statistics.median(result["samples_s"][ROWS[0]])
    for row in ROWS:
        if row not in result["samples_s"]:
            continue
        s = sorted(result["samples_s"][row])
        q = statistics.quantiles(s, n=4) if len(s) > 1 else [s[0], s[0], s[0]]
        med = statistics.median(s)
        lines.append(f"{row:28s} {1e3 * med:10.1f} {1e3 * q[0]:7.1f}-{1e3 * q[2]:<7.1f} "
                     f"{1e3 * s[0]:8.1f} {med / base:14.3f}")
    lines += [
        "",
        f"bytes sent per rank and iteration: fp32 ring all-reduce {b['fp32_ring']:,}, "
        f"1-bit hook {b['onebit_sent']:,} (received {b['onebit_received']:,}): "
        f"{b['fp32_ring'] / max(b['onebit_sent'], 1):.1f}x fewer; bf16_compress_hook "
        f"{b['bf16_ring']:,}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--values-millions", type=float, default=25.0,
                        help="gradient values per rank, in millions (default: 25)")
    parser.add_argument("--bucket-mb", type=float, default=25.0,
                        help="bucket size in MB, as DDP's bucket_cap_mb; 0: one bucket "
                             "(default: 25)")
    parser.add_argument("--world", type=int, default=2, help="processes (default: 2)")
    parser.add_argument("--bits", type=int, default=1, help="bits per value (default: 1)")
    parser.add_argument("--rule", default=DEFAULT_RULE,
                        help=f"quantization rule (default: {DEFAULT_RULE!r})")
    parser.add_argument("--iters", type=int, default=15, help="timed iterations (default: 15)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed iterations (default: 2)")
    parser.add_argument("--threads", type=int, default=1,
                        help="intra-op threads per process (default: 1)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 1M values, 3 timed iterations, 1 untimed")
    parser.add_argument("--no-eager", action="store_true",
                        help="skip the eager hook's row (the slowest)")
    parser.add_argument("--json", type=Path, help="also write the samples and bytes here")
    args = parser.parse_args(argv)
    if args.quick:
        args.values_millions, args.iters, args.warmup = 1.0, 3, 1
    if args.world < 1 or args.iters < 1 or args.warmup < 0 or args.values_millions * 1e6 < 1024:
        parser.error("need --world >= 1, --iters >= 1, --warmup >= 0 and at least 1024 values")
    opts = {k: getattr(args, k) for k in ("values_millions", "bucket_mb", "bits", "rule",
                                          "iters", "warmup", "threads", "no_eager")}
    OneBitState(torch.nn.Linear(1, 1), bits=args.bits, rule=args.rule)  # check bits and rule
    load_before = _loadavg()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        mp.spawn(_worker, args=(args.world, _free_port(), opts, str(out)), nprocs=args.world)
        result = json.loads(out.read_text())
    result["loadavg"] = [load_before, _loadavg()]
    print(_report(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
