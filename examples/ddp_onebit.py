"""Data-parallel training with 1-bit SGD: DDP + ``lowprec.distributed.onebit_hook``.

Run it with torchrun, one process per rank::

    torchrun --nproc-per-node 2 examples/ddp_onebit.py
    torchrun --nproc-per-node 2 examples/ddp_onebit.py --loss-scaler --checkpoint ckpt.pt
    torchrun --nproc-per-node 2 examples/ddp_onebit.py --resume ckpt.pt --steps 400

(on one machine, ``--master-addr 127.0.0.1`` keeps the traffic on loopback). ``--device auto``
(the default) trains on CUDA with NCCL where the node has a GPU for each of its ranks (rank
``LOCAL_RANK`` on GPU ``LOCAL_RANK``), and on the CPU with gloo otherwise (2 ranks on a 1-GPU
machine: the CPU); ``--device cpu`` or ``cuda`` chooses. The first line printed says which.

The task is a small MLP regressing a fixed random teacher network; each rank draws its own batches.
The gradients are averaged by the 1-bit hook after ``--warmup-steps`` uncompressed steps. With
``--loss-scaler`` the loss goes through ``lowprec.LossScaler``, which skips a step whose gradients
hold an inf or NaN: the hook all-reduces such a bucket uncompressed, so every rank sees the
overflow and skips together. ``--checkpoint`` saves model, optimizer, scaler and the hook's
residuals (``OneBitState.state_dict()`` is a collective: every rank calls it, rank 0 writes);
``--resume`` continues from such a file bit for bit, with the same number of processes and the
same options; resumed with or without ``--loss-scaler`` where the checkpoint was not, it continues
correctly too (``OneBitState(loss_scaler=...)`` rescales the residuals to the new loss scale).
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import lowprec
from lowprec.distributed import DEFAULT_RULE, OneBitState, onebit_hook


def teacher_batch(n: int, *, seed: int, device: torch.device, d_in: int = 32,
                  d_out: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` samples of the teacher task: the same teacher for every seed, new inputs per seed."""
    teacher = torch.Generator().manual_seed(12345)
    w1 = torch.randn(d_in, 64, generator=teacher) / d_in**0.5
    w2 = torch.randn(64, d_out, generator=teacher) / 8
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=g)
    y = torch.tanh(x @ w1) @ w2 + 0.01 * torch.randn(n, d_out, generator=g)
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300, help="last step to train to (default: 300)")
    p.add_argument("--batch", type=int, default=32, help="samples per rank and step (default: 32)")
    p.add_argument("--lr", type=float, default=0.02, help="SGD learning rate (default: 0.02)")
    p.add_argument("--hidden", type=int, default=128, help="MLP width (default: 128)")
    p.add_argument("--bits", type=int, default=1, help="bits per value: 1, 2, 4, 8 (default: 1)")
    p.add_argument("--rule", default=DEFAULT_RULE, help=f"quantizer (default: {DEFAULT_RULE!r})")
    p.add_argument("--warmup-steps", type=int, default=10,
                   help="uncompressed steps before 1-bit starts (default: 10)")
    p.add_argument("--no-fused", action="store_true",
                   help="keep the quantizer eager (by default it is compiled by torch.compile "
                        "wherever a compiler exists; the results are the same bit for bit)")
    p.add_argument("--no-hook", action="store_true",
                   help="plain DDP all-reduce, for comparison")
    p.add_argument("--loss-scaler", action="store_true", help="use lowprec.LossScaler")
    p.add_argument("--checkpoint", type=Path, help="save a checkpoint here at the end")
    p.add_argument("--resume", type=Path, help="resume from this checkpoint")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="auto: CUDA with NCCL where this node has a GPU per rank, else the CPU "
                        "with gloo; cpu or cuda to choose (default: auto)")
    p.add_argument("--log-every", type=int, default=50, help="steps between log lines (default: 50)")
    p.add_argument("--seed", type=int, default=0, help="initialisation and data seed (default: 0)")
    p.add_argument("--timeout-s", type=float, default=300.0,
                   help="collective timeout: a dead rank makes the others fail after this")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> float:
    args = parse_args(argv)
    if "RANK" not in os.environ:
        raise SystemExit("run me with torchrun, e.g. torchrun --nproc-per-node 2 " + __file__)
    device, backend, why = choose_device(args.device)
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout_s))
    if dist.get_rank() == 0:
        print(f"device: {device.type}, backend {backend} ({why})", flush=True)
    try:
        return train(args, device)
    finally:
        dist.destroy_process_group()


def train(args: argparse.Namespace, device: torch.device) -> float:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)  # the same initial model on every rank
    model = nn.Sequential(nn.Linear(32, args.hidden), nn.ReLU(), nn.Linear(args.hidden, args.hidden),
                          nn.ReLU(), nn.Linear(args.hidden, 8)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    scaler = lowprec.LossScaler() if args.loss_scaler else None
    # The hook follows the loss scale, so that its residuals (in units of the scaled gradient)
    # stay right when the scale changes, within the run or across a resume.
    state = None if args.no_hook else OneBitState(model, bits=args.bits, rule=args.rule,
                                                  warmup_steps=args.warmup_steps,
                                                  fused=False if args.no_fused else None,
                                                  loss_scaler=scaler)
    start = 0
    if args.resume is not None:
        ckpt = torch.load(args.resume, map_location=device, weights_only=False)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        if scaler is not None and ckpt.get("scaler") is not None:
            scaler.load_state_dict(ckpt["scaler"])
        elif rank == 0 and (scaler is None) != (ckpt.get("scaler") is None):
            saved, now = ("with", "without") if scaler is None else ("without", "with")
            print(f"note: the checkpoint was saved {saved} --loss-scaler and this run is {now}; "
                  "the 1-bit residuals are rescaled to this run's loss scale", flush=True)
        if state is not None:
            state.load_state_dict(ckpt["onebit"])  # this rank's residuals
        start = ckpt["step"]
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    if state is not None:
        ddp.register_comm_hook(state, onebit_hook)

    skipped, t0, loss = 0, time.perf_counter(), torch.zeros(())
    for step in range(start, args.steps):
        x, y = teacher_batch(args.batch, seed=(args.seed * 7919 + step) * 131 + rank,
                             device=device)
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(ddp(x), y)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            skipped += int(not scaler.step(opt))  # a host read, fine for a log
            scaler.update()
        if rank == 0 and (step + 1) % args.log_every == 0:
            print(f"step {step + 1:5d}  loss {loss.item():.5f}", flush=True)

    x, y = teacher_batch(4096, seed=999_999, device=device)
    with torch.no_grad():
        eval_loss = nn.functional.mse_loss(model(x), y).item()
    if args.checkpoint is not None:
        onebit = state.state_dict() if state is not None else None  # collective: every rank
        if rank == 0:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                        "scaler": scaler.state_dict() if scaler is not None else None,
                        "onebit": onebit, "step": args.steps}, args.checkpoint)
        dist.barrier()  # the file is complete before any rank exits
    if rank == 0:
        print(f"done: {world} ranks, {args.steps - start} steps in "
              f"{time.perf_counter() - t0:.1f} s, eval loss {eval_loss:.5f}, skipped {skipped}")
        if state is not None:
            c = state.counters()
            ratio = c["uncompressed_bytes"] / max(c["bytes_sent"], 1)
            print(f"1-bit hook: {c['compressed_buckets']} buckets compressed, "
                  f"{c['uncompressed_buckets']} uncompressed, {c['fallback_buckets']} fell back; "
                  f"sent {c['bytes_sent']:,} bytes, {ratio:.1f}x fewer than all-reduce")
        if args.checkpoint is not None:
            print(f"checkpoint: {args.checkpoint}")
    return eval_loss


if __name__ == "__main__":
    main()
