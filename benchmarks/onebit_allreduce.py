"""Time an FP32 all-reduce of a model's gradients against the 1-bit hook, on gloo processes.

**Two ways to start it.** Without ``--rank`` (and without torchrun's ``RANK``), the script spawns
``--world`` processes (default 2) that join a gloo group on 127.0.0.1 (loopback). With ``--rank R
--world-size W --master-addr A --master-port P`` (or torchrun's ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``; the options win over the variables) this process is one rank,
started by whatever starts the others: ``benchmarks/linksim.sh`` (one network namespace per rank
behind a shaped link), torchrun, or a shell on each host. ``--ifname`` sets
``GLOO_SOCKET_IFNAME``, the interface gloo's connections use. Rank 0 prints the table and writes
``--json``.

Each rank holds ``--values-millions`` million FP32 gradient values (default 25), as ``1024 x 1024``
weights cut into DDP-sized buckets of ``--bucket-mb`` MB (default 25; 0 puts everything in one
bucket). First a **link check**: rank 0 sends ``--link-mb`` MB (default 25) to rank 1 and gets them
back, ``--link-reps`` times (default 5, after an untimed one); the median round trip gives the
one-way rate in Gbit/s, which shows what rate the link (shaped or not) actually carries. Then per
iteration, after a barrier, each rank times:

* ``fp32 all_reduce (1 call)``: ``dist.all_reduce`` of all values in one tensor;
* ``fp32 all_reduce (buckets)``: one ``all_reduce`` per bucket, as DDP's default hook does;
* ``bf16_compress_hook``: PyTorch's ``default_hooks.bf16_compress_hook`` per bucket (cast to
  BF16, all-reduce, cast back), waited for;
* ``1-bit collectives``: only the hook's messages, per bucket one ``all_to_all_single`` and one
  ``all_gather_single`` of the chunk size the hook uses (packed codes + two floats per column);
* ``1-bit hook, fused`` and ``1-bit hook, eager``: ``onebit_hook`` per bucket (quantize with
  error feedback, the two collectives, requantize, dequantize), waited for, with residuals carried
  over from the last iteration as in training; ``OneBitState(fused=True)`` (the quantizer compiled
  by ``torch.compile``, compiled before timing; ``"range"`` rule only) and ``fused=False``;
* ``memory floor``: no communication, only the memory traffic any error-feedback hook needs per
  value (read gradient and residual, write residual and result: ``r += g; g.copy_(r)``), the
  physical lower bound of the hook's own work on this machine;
* ``ddp step, fp32 all-reduce`` and ``ddp step, 1-bit hook``: one whole training step (zero the
  gradients, forward, MSE loss, backward, ``torch.optim.SGD`` step) of an MLP of about
  ``--ddp-millions`` million parameters (default 25: ``2048 -> 2048 -> 4096 -> 2048 -> 2048``,
  25.2M parameters in 8 tensors) in ``torch.nn.parallel.DistributedDataParallel`` on the gloo
  group, once with DDP's default FP32 all-reduce and once, on a copy of the model in a second DDP
  wrapper, with ``register_comm_hook(OneBitState(model, warmup_steps=0), onebit_hook)`` (fused as
  the fused row unless ``--no-fused``). The batch is ``--ddp-batch`` rows (default 32) of random
  data: small, so that the step is communication-bound, as data-parallel training is on a slow
  link. Which of the two goes first alternates per iteration. ``--no-ddp`` skips them.

The rows of one iteration run one after the other, so a swing of the machine or the link hits
them all. A row's time per iteration is the slowest rank's; the table gives the median, the
interquartile range and the minimum over ``--iters`` iterations after ``--warmup`` untimed ones
(the hooks and the DDP models also take two untimed steps before those: layouts, compilation,
DDP's bucket rebuild). Bytes are per rank and iteration: what a ring all-reduce sends
(``2 (W - 1) / W`` of the buffer) and what the hook's byte counters recorded. The header gives
each hook's ``state.compiled`` (whether its compiled quantizer ran); the JSON also has each hook's
``state.messages()`` (per bucket layout: values, columns, chunk bytes, bytes per step).

Loopback moves bytes at memory speed, so there the hook's quantization costs more than the bytes it
saves; the collectives row shows what the wire would carry. Across a slower link the FP32 rows grow
with the bytes (a ring all-reduce sends and receives ``2 (W - 1) / W`` of the buffer at once on
each full-duplex link: 25M values are 100 MB, about 0.8 s at 1 Gbit/s and 80 ms at 10 Gbit/s for a
ring of two) and the collectives row with 1/30 of them.

The ``1-bit hook, fused, no overlap`` row runs the compiled hook one bucket at a time
(``state.flush()`` after each call), to show what the hook's overlap of buckets buys. Below the
table, rank 0's main-thread CPU time per iteration (``time.thread_time``) for each hook row and the
memory floor: the quantizer's own work per value, without gloo's threads or waiting.

Examples::

    python benchmarks/onebit_allreduce.py                 # 25M values, 2 processes on loopback
    python benchmarks/onebit_allreduce.py --quick         # smoke run: tiny sizes, a few seconds
    python benchmarks/onebit_allreduce.py --bits 2 --json /tmp/onebit.json
    bash benchmarks/linksim.sh --rate 1gbit -- --values-millions 2 --iters 5   # shaped link
    torchrun --nnodes 2 --nproc-per-node 1 --node-rank N --master-addr HOST0 --master-port 29500 \\
        benchmarks/onebit_allreduce.py --ifname eth0      # on host N of 2: one rank per host
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

from _onebit_rows import (
    Bucket,
    DDPPair,
    buckets,
    flat_model,
    link_check,
    mlp_width,
    summary,
    timed,
)
from lowprec.distributed import DEFAULT_RULE, OneBitState, onebit_hook

ROWS = ("fp32 all_reduce (1 call)", "fp32 all_reduce (buckets)", "bf16_compress_hook",
        "1-bit collectives", "1-bit hook, fused", "1-bit hook, fused, no overlap",
        "1-bit hook, eager", "memory floor")
FP32, FP32_BUCKETS, BF16, COLLECTIVES, FUSED, NO_OVERLAP, EAGER, FLOOR = ROWS
DDP_ROWS = ("ddp step, fp32 all-reduce", "ddp step, 1-bit hook")
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


# ------------------------------------------------------------------------------ the processes


def _init(rank: int, world: int, opts: dict[str, Any]) -> None:
    """Join the gloo group: ``opts["master_addr"]:opts["master_port"]`` through ``env://``, which
    also honours torchrun's agent store (``TORCHELASTIC_USE_AGENT_STORE``)."""
    os.environ["OMP_NUM_THREADS"] = str(opts["threads"])
    torch.set_num_threads(opts["threads"])
    if opts["ifname"]:
        os.environ["GLOO_SOCKET_IFNAME"] = opts["ifname"]
    os.environ.update(MASTER_ADDR=opts["master_addr"], MASTER_PORT=str(opts["master_port"]),
                      RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world,
                            timeout=timedelta(seconds=opts["timeout"]))


def _worker(rank: int, world: int, opts: dict[str, Any], out: str | None) -> None:
    """One rank: join the group, run the rows, and on rank 0 write the result to ``out``."""
    _init(rank, world, opts)
    try:
        result = _bench(rank, world, opts)
        if rank == 0 and out:
            Path(out).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------- the rows


def _bench(rank: int, world: int, opts: dict[str, Any]) -> dict[str, Any]:
    """Run every row on this rank; rank 0 returns the result (the other ranks an empty dict)."""
    link = link_check(int(opts["link_mb"] * 1e6), opts["link_reps"]) if opts["link_reps"] else None
    model = flat_model(int(opts["values_millions"] * 1e6))
    params = list(model.parameters())
    groups = buckets(params, int(opts["bucket_mb"] * 1024 * 1024))
    gen = torch.Generator().manual_seed(rank)
    grads = [torch.randn(sum(p.numel() for p in g), generator=gen) for g in groups]
    flat = torch.cat(grads)
    buffers = [g.clone() for g in grads]
    quant = {"bits": opts["bits"], "rule": opts["rule"]}
    hooks: dict[str, OneBitState] = {}  # row -> its state; the first one's counters are reported
    if opts["fused"]:
        hooks[FUSED] = OneBitState(model, warmup_steps=0, fused=True, **quant)
        hooks[NO_OVERLAP] = OneBitState(model, warmup_steps=0, fused=True, **quant)
    if not opts["no_eager"]:
        hooks[EAGER] = OneBitState(model, warmup_steps=0, fused=False, **quant)
    counted = next(iter(hooks.values()))
    floor = [torch.zeros_like(b) for b in buffers]

    def bucket_list() -> list[Bucket]:
        return [Bucket(i, g, b, i == len(groups) - 1)
                for i, (g, b) in enumerate(zip(groups, buffers, strict=True))]

    def run_hook(st: OneBitState) -> None:
        if st is hooks.get(NO_OVERLAP):  # each bucket finished before the next one starts
            for b in bucket_list():
                onebit_hook(st, b)
                st.flush()
            return
        for f in [onebit_hook(st, b) for b in bucket_list()]:
            f.wait()

    def run_bf16() -> None:
        for f in [default_hooks.bf16_compress_hook(None, b) for b in bucket_list()]:
            f.wait()

    def run_floor() -> None:
        for r, b in zip(floor, buffers, strict=True):
            r.add_(b)
            b.copy_(r)

    def reset() -> None:
        for b, g in zip(buffers, grads, strict=True):
            b.copy_(g)

    for st in hooks.values():  # layouts (and compilation); the chunk sizes give the collectives
        run_hook(st)
        run_hook(st)
        reset()
    chunks = [m["chunk_bytes"] for m in counted.messages()]
    sends = [torch.zeros(world * c, dtype=torch.uint8) for c in chunks]
    recvs = [torch.empty_like(s) for s in sends]
    gathered = [torch.empty_like(s) for s in sends]

    def collectives() -> None:
        for send, recv, gath, c in zip(sends, recvs, gathered, chunks, strict=True):
            dist.all_to_all_single(recv, send)
            _all_gather_single(gath, send[:c])

    pair = None
    if not opts["no_ddp"]:
        pair = DDPPair(opts["ddp_width"], opts["ddp_batch"], opts["bucket_mb"], rank,
                       {"fused": opts["fused"], **quant})
        for _ in range(2):  # DDP rebuilds its buckets after the first step; the hook compiles
            pair.step(pair.plain)
            pair.step(pair.onebit)

    samples: dict[str, list[float]] = {r: [] for r in ROWS + DDP_ROWS}
    # CPU time of this rank's main thread per row (the hook's own work: quantizing, packing,
    # issuing collectives; not gloo's threads), to set against the memory floor's.
    cpu: dict[str, list[float]] = {r: [] for r in (*hooks, FLOOR)}
    before = counted.counters()
    ddp_before = pair.state.counters() if pair else None
    for it in range(opts["warmup"] + opts["iters"]):
        if it == opts["warmup"]:
            before = counted.counters()
            ddp_before = pair.state.counters() if pair else None
        copy = flat.clone()
        times = {FP32: timed(lambda copy=copy: dist.all_reduce(copy))}
        reset()
        times[FP32_BUCKETS] = timed(lambda: [dist.all_reduce(b) for b in buffers])
        reset()
        times[BF16] = timed(run_bf16)
        times[COLLECTIVES] = timed(collectives)
        for row, st in hooks.items():
            reset()
            cpu0 = time.thread_time()
            times[row] = timed(lambda st=st: run_hook(st))
            cpu[row].append(time.thread_time() - cpu0)
        cpu[FLOOR].append(-time.thread_time())
        times[FLOOR] = timed(run_floor)
        cpu[FLOOR][-1] += time.thread_time()
        if pair:
            order = [(DDP_ROWS[0], pair.plain), (DDP_ROWS[1], pair.onebit)]
            for row, ddp in order if it % 2 == 0 else order[::-1]:
                times[row] = timed(lambda ddp=ddp: pair.step(ddp))
        if it >= opts["warmup"]:
            for k, v in times.items():
                samples[k].append(v)
    after = counted.counters()
    if rank != 0:
        return {}
    n, iters = flat.numel(), opts["iters"]
    result: dict[str, Any] = {
        "options": opts,
        "world": world,
        "values": n,
        "buckets": [sum(p.numel() for p in g) for g in groups],
        "chunk_bytes": chunks,
        "messages": counted.messages(),
        "compiled": {row: st.compiled for row, st in hooks.items()},
        "link_check": link,
        "bytes_per_iteration": {
            "fp32_ring": 2 * (world - 1) * 4 * n // world,
            "bf16_ring": 2 * (world - 1) * 2 * n // world,
            "onebit_sent": (after["bytes_sent"] - before["bytes_sent"]) // iters,
            "onebit_received": (after["bytes_received"] - before["bytes_received"]) // iters,
        },
        "samples_s": {k: v for k, v in samples.items() if v},
        "cpu_s": {k: v[opts["warmup"]:] for k, v in cpu.items()},
        "fused": opts["fused"],
        "torch": torch.__version__,
        "hostname": socket.gethostname(),
    }
    if pair:
        ddp_after = pair.state.counters()
        result["ddp"] = {
            "width": pair.width,
            "params": pair.params,
            "batch": pair.batch,
            "compiled": pair.state.compiled,
            "messages": pair.state.messages(),
            "bytes_per_step": {
                "fp32_ring": 2 * (world - 1) * 4 * pair.params // world,
                "onebit_sent": (ddp_after["bytes_sent"] - ddp_before["bytes_sent"]) // iters,
            },
        }
    return result


# ---------------------------------------------------------------------------------- the table


def _loadavg() -> float | None:
    """The 1-minute load average (Linux), to tell a busy machine's numbers apart."""
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _row_line(name: str, s: dict[str, float], base: float) -> str:
    return (f"{name:28s} {1e3 * s['median']:10.1f} {1e3 * s['q1']:7.1f}-{1e3 * s['q3']:<7.1f} "
            f"{1e3 * s['min']:8.1f} {s['median'] / base:14.3f}")


def _report(result: dict[str, Any]) -> str:
    """The table rank 0 prints."""
    opts, b, world = result["options"], result["bytes_per_iteration"], result["world"]
    where = ("on 127.0.0.1" if opts["mode"] == "loopback" else
             f"(one per rank), master {opts['master_addr']}:{opts['master_port']}"
             + (f", GLOO_SOCKET_IFNAME={opts['ifname']}" if opts["ifname"] else ""))
    lines = [
        f"{world} gloo processes {where}, {result['values'] / 1e6:.1f}M FP32 values in "
        f"{len(result['buckets'])} bucket(s), {opts['bits']}-bit {opts['rule']!r}, torch "
        f"{result['torch']}, {opts['iters']} timed iterations, {os.cpu_count()} CPUs on rank 0's "
        f"host",
    ]
    load = result.get("loadavg")
    if load and None not in load:
        lines.append(f"load average before/after: {load[0]:.2f}/{load[1]:.2f} (the benchmark's "
                     f"own processes add about {world} where they share the host; more means "
                     "others were busy)")
    link = result.get("link_check")
    if link:
        s = summary(link["samples_s"])
        rate = 16 * link["bytes"] / 1e9
        lines.append(f"link check, rank 0 <-> rank 1: {link['gbit_s']:.2f} Gbit/s one way "
                     f"(median of {link['reps']} round trips of {link['bytes'] / 1e6:.0f} MB each "
                     f"way; IQR {rate / s['q3']:.2f}-{rate / s['q1']:.2f} Gbit/s)")
    hooks = ", ".join(f"{row.removeprefix('1-bit hook, ')} {flag}"
                      for row, flag in result["compiled"].items())
    lines.append(f"1-bit hook rows, state.compiled: {hooks}"
                 + (f"; ddp hook {result['ddp']['compiled']}" if "ddp" in result else ""))
    samples = result["samples_s"]
    base = summary(samples[FP32])["median"]
    lines += ["", f"{'':28s} {'median ms':>10s} {'IQR ms':>15s} {'min ms':>8s} "
                  f"{'x fp32 1 call':>14s}"]
    lines += [_row_line(row, summary(samples[row]), base) for row in ROWS if row in samples]
    cpu = {k: statistics.median(v) for k, v in result.get("cpu_s", {}).items() if v}
    if FLOOR in cpu and len(cpu) > 1:
        n = result["values"]
        lines += ["", "CPU time of rank 0's main thread per iteration (the hook's own work, not "
                      "gloo's threads), median:"]
        lines += [f"  {row:34s} {1e3 * t:7.1f} ms {1e9 * t / n:6.2f} ns/value "
                  f"{t / cpu[FLOOR]:5.2f}x the floor" for row, t in cpu.items()]
    lines += [
        "",
        f"bytes sent per rank and iteration: fp32 ring all-reduce {b['fp32_ring']:,}, "
        f"1-bit hook {b['onebit_sent']:,} (received {b['onebit_received']:,}): "
        f"{b['fp32_ring'] / max(b['onebit_sent'], 1):.1f}x fewer; bf16_compress_hook "
        f"{b['bf16_ring']:,}",
    ]
    if "ddp" in result:
        d = result["ddp"]
        db = d["bytes_per_step"]
        base = summary(samples[DDP_ROWS[0]])["median"]
        lines += ["", f"DDP training step: MLP {d['width']}->{d['width']}->{2 * d['width']}->"
                      f"{d['width']}->{d['width']} ({d['params'] / 1e6:.1f}M parameters), batch "
                      f"{d['batch']}, SGD",
                  f"{'':28s} {'median ms':>10s} {'IQR ms':>15s} {'min ms':>8s} "
                  f"{'x fp32 step':>14s}"]
        lines += [_row_line(row, summary(samples[row]), base) for row in DDP_ROWS]
        lines.append(f"bytes sent per rank and step: fp32 ring all-reduce {db['fp32_ring']:,}, "
                     f"1-bit hook {db['onebit_sent']:,}: "
                     f"{db['fp32_ring'] / max(db['onebit_sent'], 1):.1f}x fewer")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ command line


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise SystemExit(f"onebit_allreduce.py: {name}={value!r} is not an integer") from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options, with the per-rank settings resolved from the environment (torchrun)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--values-millions", type=float, default=25.0,
        help="gradient values per rank, in millions (default: 25)")
    add("--bucket-mb", type=float, default=25.0,
        help="bucket size in MB, as DDP's bucket_cap_mb; 0: one bucket (default: 25)")
    add("--world", "--world-size", dest="world", type=int,
        help="processes (default: 2 on loopback; WORLD_SIZE with --rank or RANK)")
    add("--rank", type=int, help="run as this one rank (default: RANK; unset: spawn on loopback)")
    add("--master-addr", help="rank 0's address (default: MASTER_ADDR)")
    add("--master-port", type=int, help="rank 0's port (default: MASTER_PORT)")
    add("--ifname", help="GLOO_SOCKET_IFNAME for this rank (default: 'lo' for a loopback "
                         "master address, else gloo's own choice)")
    add("--timeout", type=float, default=300.0,
        help="seconds a collective waits for the other ranks (default: 300)")
    add("--bits", type=int, default=1, help="bits per value (default: 1)")
    add("--rule", default=DEFAULT_RULE, help=f"quantization rule (default: {DEFAULT_RULE!r})")
    add("--iters", type=int, default=15, help="timed iterations (default: 15)")
    add("--warmup", type=int, default=2, help="untimed iterations (default: 2)")
    add("--threads", type=int, default=1, help="intra-op threads per process (default: 1)")
    add("--link-mb", type=float, default=25.0,
        help="MB each way in a link-check round trip (default: 25)")
    add("--link-reps", type=int, default=5, help="timed link-check round trips; 0: no link check "
                                                 "(default: 5)")
    add("--no-ddp", action="store_true", help="skip the DDP training-step rows")
    add("--ddp-millions", type=float, default=25.0,
        help="parameters of the DDP rows' MLP, in millions (default: 25, width 2048)")
    add("--ddp-batch", type=int, default=32, help="batch of the DDP rows (default: 32)")
    add("--quick", action="store_true", help="smoke run: 1M values, a 1M-parameter MLP, a 2 MB "
                                             "link check, 3 timed iterations, 1 untimed")
    add("--no-eager", action="store_true", help="skip the eager hook's row (the slowest)")
    add("--no-fused", action="store_true",
        help="skip the fused hook's row (its compilation) and run the DDP hook eagerly")
    add("--json", type=Path, help="also write the samples and bytes here (rank 0)")
    args = parser.parse_args(argv)
    if args.quick:
        args.values_millions, args.iters, args.warmup = 1.0, 3, 1
        args.ddp_millions, args.link_mb = 1.0, 2.0
    args.rank = args.rank if args.rank is not None else _env_int("RANK")
    if args.rank is None:
        args.mode = "loopback"
        args.world = args.world if args.world is not None else 2
        args.master_addr, args.master_port = "127.0.0.1", _free_port()
        args.ifname = args.ifname or ("lo" if sys.platform.startswith("linux") else None)
    else:
        args.mode = "per-rank"
        args.world = args.world if args.world is not None else _env_int("WORLD_SIZE")
        args.master_addr = args.master_addr or os.environ.get("MASTER_ADDR")
        if args.master_port is None:
            args.master_port = _env_int("MASTER_PORT")
        missing = [flag for flag, v in (("--world-size (or WORLD_SIZE)", args.world),
                                        ("--master-addr (or MASTER_ADDR)", args.master_addr),
                                        ("--master-port (or MASTER_PORT)", args.master_port))
                   if v is None]
        if missing:
            parser.error(f"running as rank {args.rank} needs " + ", ".join(missing))
        if not 0 <= args.rank < args.world:
            parser.error(f"--rank {args.rank} is not in 0..{args.world - 1} (--world-size "
                         f"{args.world})")
        if not args.ifname and args.master_addr in ("127.0.0.1", "localhost", "::1"):
            args.ifname = "lo" if sys.platform.startswith("linux") else None
    if (args.world < 1 or args.iters < 1 or args.warmup < 0 or args.values_millions * 1e6 < 1024
            or args.link_reps < 0 or args.ddp_batch < 1 or args.ddp_millions <= 0):
        parser.error("need --world >= 1, --iters >= 1, --warmup >= 0, at least 1024 values, "
                     "--link-reps >= 0, --ddp-batch >= 1 and --ddp-millions > 0")
    args.fused = args.rule == "range" and not args.no_fused
    if not args.fused and args.no_eager:
        parser.error("--no-eager leaves no hook row: the fused row needs --rule range and no "
                     "--no-fused")
    args.ddp_width = mlp_width(args.ddp_millions)
    return args


_OPTS = ("mode", "values_millions", "bucket_mb", "bits", "rule", "iters", "warmup", "threads",
         "no_eager", "fused", "no_ddp", "ddp_width", "ddp_batch", "link_mb", "link_reps",
         "master_addr", "master_port", "ifname", "timeout")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; return rank 0's result (an empty dict on the other ranks)."""
    args = parse_args(argv)
    opts = {k: getattr(args, k) for k in _OPTS}
    OneBitState(torch.nn.Linear(1, 1), bits=args.bits, rule=args.rule)  # check bits and rule
    load_before = _loadavg()
    if args.mode == "per-rank":
        result = {}
        _init(args.rank, args.world, opts)
        try:
            result = _bench(args.rank, args.world, opts)
        finally:
            dist.destroy_process_group()
        if args.rank != 0:
            return result
    else:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "result.json"
            mp.spawn(_worker, args=(args.world, opts, str(out)), nprocs=args.world)
            result = json.loads(out.read_text())
    result["loadavg"] = [load_before, _loadavg()]
    print(_report(result), flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
