"""A BF16 model sharded with FSDP2 (``fully_shard``), trained by a lowprec optimizer.

Run it with torchrun, one process per rank::

    torchrun --nproc-per-node 2 examples/fsdp2_bf16.py --strategy kahan
    torchrun --nproc-per-node 2 examples/fsdp2_bf16.py --strategy split --checkpoint ckpt
    torchrun --nproc-per-node 2 examples/fsdp2_bf16.py --strategy split --resume ckpt --steps 400
    torchrun --nproc-per-node 2 examples/fsdp2_bf16.py --strategy kahan --resume ckpt --steps 400
    torchrun --nproc-per-node 2 examples/fsdp2_bf16.py --strategy kahan --state-dtype 8bit

(on one machine, ``--master-addr 127.0.0.1`` keeps the traffic on loopback). ``--device auto``
(the default) trains on CUDA with NCCL where the node has a GPU for each of its ranks (rank
``LOCAL_RANK`` on GPU ``LOCAL_RANK``), and on the CPU with gloo otherwise (2 ranks on a 1-GPU
machine: the CPU); ``--device cpu`` or ``cuda`` chooses. The first line printed says which.

The parameters are BF16 DTensors, each rank holding a shard of every layer; the optimizer steps
each rank's shards and keeps its state sharded alike (``master="kahan"``: a BF16 compensation,
``"split"``: a 16-bit trail, ``"stochastic"``: no extra state, ``"none"``: plain BF16, which loses
small updates). ``--checkpoint`` saves model and optimizer with ``torch.distributed.checkpoint``
(a directory of shards, written by every rank); ``--resume`` loads it and continues, bit for bit
with the same number of processes (and, for the elementwise state lowprec keeps, with another).
Resumed with another ``--strategy`` (start exact with split, go on lean with kahan), the
optimizer's state is converted: the FP32 master rebuilt from the saved one and stored the new
way, exactly into ``fp32`` and ``split``, to 16 significant bits into ``kahan``.
``--state-dtype 8bit`` keeps AdamW's moments as 8-bit codes on the shards of the layers whose
rows are whole blocks of 256 (the middle one; the others keep FP32 moments); resumed with
another ``--state-dtype``, the moments are encoded or decoded.
The task is a small MLP regressing a fixed random teacher network; each rank draws its own
batches.
"""

from __future__ import annotations

import argparse
import gc
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import lowprec
from lowprec.optim.storage import MASTER_CHOICES


def teacher_batch(n: int, *, seed: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` samples of the teacher task: the same teacher for every seed, new inputs per seed."""
    teacher = torch.Generator().manual_seed(12345)
    w1 = torch.randn(32, 64, generator=teacher) / 32**0.5
    w2 = torch.randn(64, 8, generator=teacher) / 8
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 32, generator=g)
    y = torch.tanh(x @ w1) @ w2
    return x.to(device), y.to(device)


def choose_device(want: str) -> tuple[torch.device, str, str]:
    """This rank's device and the process group's backend, and why: with ``want="auto"`` CUDA and
    NCCL where this node has a GPU for each of its ranks (torchrun's ``LOCAL_WORLD_SIZE``; rank
    ``LOCAL_RANK`` takes that GPU), else the CPU and gloo, so that 2 ranks on a 1-GPU machine
    train on the CPU instead of failing on a device ordinal that does not exist. ``"cpu"`` and
    ``"cuda"`` choose; ``"cuda"`` without a GPU per rank (or without NCCL) is refused."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", 1)))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    nccl = dist.is_available() and dist.is_nccl_available()
    seen = f"{gpus} GPU(s) for {local_world} rank(s) on this node" + ("" if nccl else ", no NCCL")
    why = f"--device {want}: {seen}"
    enough = nccl and gpus >= local_world
    if want == "cuda" and not enough:
        raise SystemExit(f"--device cuda needs NCCL and a GPU per rank on each node ({seen}): "
                         "use --device cpu (gloo), or fewer ranks per node")
    if want == "cuda" or (want == "auto" and enough):
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank), "nccl", why
    return torch.device("cpu"), "gloo", why


STATE_DTYPES = {"auto": None, "bf16": torch.bfloat16, "8bit": "8bit"}


def saved_options(path: Path) -> dict[str, str]:
    """The ``--strategy`` and ``--state-dtype`` a checkpoint was saved with (those it holds)."""
    entry = {"strategy": "", "state_dtype": ""}
    dcp.load(entry, checkpoint_id=str(path), planner=DefaultLoadPlanner(allow_partial_load=True))
    return {k: v for k, v in entry.items() if v}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300, help="last step to train to (default: 300)")
    p.add_argument("--batch", type=int, default=32, help="samples per rank and step (default: 32)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default: 3e-3)")
    p.add_argument("--hidden", type=int, default=256, help="MLP width (default: 256)")
    p.add_argument("--strategy", default="kahan", choices=MASTER_CHOICES,
                   help="the optimizer's master= strategy for the BF16 weights (default: kahan)")
    p.add_argument("--state-dtype", default="auto", choices=list(STATE_DTYPES),
                   help="AdamW's moments: auto (the strategy's), bf16, or 8bit codes with a "
                        "scale per block of 256 (default: auto)")
    p.add_argument("--fused", action=argparse.BooleanOptionalAction, default=None,
                   help="compiled optimizer step (torch.compile), or --no-fused for the eager one "
                        "(default: lowprec's, compiled where a compiler is found)")
    p.add_argument("--checkpoint", type=Path, help="save a DCP checkpoint (a directory) at the end")
    p.add_argument("--resume", type=Path, help="resume from this DCP checkpoint")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="auto: CUDA with NCCL where this node has a GPU per rank, else the CPU "
                        "with gloo; cpu or cuda to choose (default: auto)")
    p.add_argument("--log-every", type=int, default=50, help="steps between log lines (default: 50)")
    p.add_argument("--seed", type=int, default=0, help="initialisation and data seed (default: 0)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> float:
    args = parse_args(argv)
    if "RANK" not in os.environ:
        raise SystemExit("run me with torchrun, e.g. torchrun --nproc-per-node 2 " + __file__)
    device, backend, why = choose_device(args.device)
    dist.init_process_group(backend, timeout=timedelta(seconds=300))
    if dist.get_rank() == 0:
        print(f"device: {device.type}, backend {backend} ({why})", flush=True)
    try:
        return train(args, device)
    finally:
        # FSDP2's modules hold reference cycles: collected only here, before the process group
        # goes, they no longer abort the interpreter's teardown on gloo (seen in 3 of 8 runs).
        gc.collect()
        dist.destroy_process_group()


def train(args: argparse.Namespace, device: torch.device) -> float:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)  # the same initial model, and the same rounding seed, everywhere
    model = nn.Sequential(nn.Linear(32, args.hidden), nn.ReLU(), nn.Linear(args.hidden, args.hidden),
                          nn.ReLU(), nn.Linear(args.hidden, 8)).to(device, torch.bfloat16)
    # The mesh on this run's device: without one, fully_shard makes a CUDA mesh wherever CUDA is
    # visible, and would move a gloo run's model onto the GPU.
    mesh = init_device_mesh(device.type, (world,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    def optimizer(strategy: str, state_dtype: str) -> lowprec.optim.AdamW:
        return lowprec.optim.AdamW(model.parameters(), lr=args.lr, master=strategy,
                                   state_dtype=STATE_DTYPES[state_dtype], fused=args.fused)

    mine = {"strategy": args.strategy, "state_dtype": args.state_dtype}
    opt, start = optimizer(**mine), 0
    if args.resume is not None:
        # DCP loads into tensors shaped as this optimizer's state: under the strategy the
        # checkpoint was saved with. Under another, the state is loaded as saved, then handed
        # to this run's optimizer, whose load_state_dict converts each rank's shards (the FP32
        # master rebuilt, then kept the new way: exact into fp32 and split; the moments cast,
        # encoded to 8-bit codes or decoded).
        # (a checkpoint without the entry was saved before --state-dtype existed: "auto")
        saved = {**mine, "state_dtype": "auto", **saved_options(args.resume)}
        loader = opt if saved == mine else optimizer(**saved)
        model_sd, opt_sd = get_state_dict(model, loader)
        state = {"model": model_sd, "optim": opt_sd, "step": torch.zeros((), dtype=torch.int64)}
        dcp.load(state, checkpoint_id=str(args.resume))
        set_state_dict(model, loader, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        start = int(state["step"])
        if loader is not opt:
            opt.load_state_dict(loader.state_dict())
            del loader
            if rank == 0:
                print(f"resumed a master {saved['strategy']} checkpoint as master "
                      f"{args.strategy}" + (f" (moments {saved['state_dtype']} as "
                                            f"{args.state_dtype})" if saved["state_dtype"]
                                            != args.state_dtype else ""), flush=True)

    t0, loss = time.perf_counter(), torch.zeros(())
    for step in range(start, args.steps):
        x, y = teacher_batch(args.batch, seed=(args.seed * 7919 + step) * 131 + rank,
                             device=device)
        loss = nn.functional.mse_loss(model(x.to(torch.bfloat16)).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if rank == 0 and (step + 1) % args.log_every == 0:
            print(f"step {step + 1:5d}  loss {loss.item():.5f}", flush=True)

    x, y = teacher_batch(4096, seed=999_999, device=device)
    with torch.no_grad():
        eval_loss = nn.functional.mse_loss(model(x.to(torch.bfloat16)).float(), y).item()
    if args.checkpoint is not None:
        model_sd, opt_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": opt_sd, "step": torch.tensor(args.steps),
                 "strategy": args.strategy, "state_dtype": args.state_dtype}
        dcp.save(state, checkpoint_id=str(args.checkpoint))  # every rank writes its shards
    if rank == 0:
        print(f"done: {world} ranks, {args.steps - start} steps in "
              f"{time.perf_counter() - t0:.1f} s, master {args.strategy}, moments "
              f"{args.state_dtype}, eval loss {eval_loss:.8g}")
        if args.checkpoint is not None:
            print(f"checkpoint: {args.checkpoint}")
    return eval_loss


if __name__ == "__main__":
    main()
