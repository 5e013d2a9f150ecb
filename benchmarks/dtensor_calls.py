"""A step's host calls on DTensor parameters (FSDP2's layout) against the number of tensors.

Issue 53's target: a step of N tensors sharded over 2 gloo ranks makes at most twice the calls
from Python at 512 tensors that it makes at 16 (before buckets took DTensor shards: 47 at 16,
609 at 512, AdamW + Kahan on 64 x 64 BF16 tensors). Each row starts 2 CPU processes, shards
N tensors of 64 x 64 BF16 along their first dimension (``distribute_tensor`` over a 1-D mesh, as
``fully_shard`` places them) and, on rank 0, counts the operator and compiled-region calls one
``step()`` makes from Python (as ``step_calls.py`` counts them) and times the median step.

    python benchmarks/dtensor_calls.py                    # 16 and 512 tensors, every row
    python benchmarks/dtensor_calls.py --tensors 16,128 --rows adamw-kahan
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import lowprec
from step_calls import host_calls

ROWS = {
    "adamw-kahan": lambda ps: lowprec.AdamW(ps, lr=1e-3, master="kahan", fused=True),
    "adamw-stochastic": lambda ps: lowprec.AdamW(ps, lr=1e-3, master="stochastic", fused=True,
                                                      seed=3),
    "lamb-kahan": lambda ps: lowprec.Lamb(ps, lr=1e-3, master="kahan", fused=True),
}


def worker(rank: int, world: int, init: str, rows: list[str], tensors: list[int],
           rounds: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    lines = []
    for n in tensors:
        for row in rows:
            gen = torch.Generator().manual_seed(0)
            params = [torch.nn.Parameter(distribute_tensor(
                (torch.randn(64, 64, generator=gen) * 0.02).bfloat16(), mesh, [Shard(0)]))
                for _ in range(n)]
            for p in params:
                p.grad = distribute_tensor(torch.randn(64, 64, generator=gen).bfloat16() * 1e-3,
                                           mesh, [Shard(0)])
            opt = ROWS[row](params)
            for _ in range(3):
                opt.step()
            times = []
            for _ in range(rounds):
                dist.barrier()
                t = time.perf_counter()
                opt.step()
                times.append(time.perf_counter() - t)
            calls, _ = host_calls(opt.step)
            lines.append(f"{n:>7}  {row:<18} {calls:>6} {statistics.median(times) * 1e3:>8.2f}")
    if rank == 0:
        pathlib.Path(out).write_text("\n".join(lines) + "\n")
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tensors", default="16,512")
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    rows = args.rows.split(",")
    tensors = [int(t) for t in args.tensors.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.txt")
        init = "file://" + os.path.join(tmp, "rendezvous")
        mp.spawn(worker, args=(2, init, rows, tensors, args.rounds, out), nprocs=2)
        print(f"2 gloo ranks, N tensors of 64 x 64 BF16 sharded along dim 0; torch "
              f"{torch.__version__}\ntensors  row                 calls  ms/step")
        print(pathlib.Path(out).read_text(), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
