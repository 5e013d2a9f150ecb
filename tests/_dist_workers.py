"""Worker processes for tests/test_distributed.py (importable, so that spawned children find them).

``launch(fn, world_size, out_dir, *args)`` starts ``world_size`` processes with gloo on 127.0.0.1
(a port the OS picked), one intra-op thread each, and runs ``fn(rank, world_size, out_dir,
*args)`` in each; workers save their results with ``torch.save`` under ``out_dir``.
"""

from __future__ import annotations

import io
import os
import socket
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lowprec.distributed import OneBitState, onebit_hook

TIMEOUT_S = 90


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Any, world_size: int, port: int, out_dir: str, args: tuple) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # stay on loopback
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=TIMEOUT_S),
    )
    try:
        fn(rank, world_size, Path(out_dir), *args)
    finally:
        dist.destroy_process_group()


def launch(fn: Any, world_size: int, out_dir: str | Path, *args: Any) -> None:
    """Run ``fn(rank, world_size, out_dir, *args)`` in ``world_size`` gloo processes; re-raise."""
    mp.spawn(_entry, args=(fn, world_size, free_port(), str(out_dir), args), nprocs=world_size,
             join=True)


# ------------------------------------------------------------------------ synthetic gradients

#: Parameters of the synthetic model: 2-D weights with long and short output units, a conv
#: weight (27 values per output unit: cut flat), flat vectors longer than a column, a scalar.
SYNTH_SHAPES = {
    "w1": (64, 48),
    "b1": (64,),
    "w2": (33, 100),
    "emb": (20, 256),
    "conv": (8, 3, 3, 3),
    "tiny": (5, 7),
    "long": (2500,),
    "scalar": (),
    "w3": (16, 512),
}
#: The order the loss uses them in (not the registration order, so that DDP's rebuild after the
#: first iteration changes the buckets).
SYNTH_USE_ORDER = ("emb", "w1", "scalar", "b1", "long", "w3", "tiny", "conv", "w2")
#: 4 x 256 output units of 1024 values: long columns, one bucket, for the byte counts.
BIG_SHAPES = {f"w{i}": (256, 1024) for i in range(4)}


def synthetic_grad(shape: tuple[int, ...], *, step: int, rank: int, index: int,
                   seed: int = 0) -> torch.Tensor:
    """A gradient with per-row scale and offset (so columns differ), reproducible anywhere."""
    g = torch.Generator().manual_seed(((seed * 1009 + step) * 101 + rank) * 1013 + index)
    v = torch.randn(shape, generator=g)
    if len(shape) >= 1:
        rows = (shape[0],) + (1,) * (len(shape) - 1)
        v = v * torch.exp(torch.randn(rows, generator=g)) + 0.5 * torch.randn(rows, generator=g)
    return v


def synthetic_grads(shapes: dict[str, tuple[int, ...]], *, step: int, rank: int,
                    seed: int = 0) -> dict[str, torch.Tensor]:
    return {n: synthetic_grad(s, step=step, rank=rank, index=i, seed=seed)
            for i, (n, s) in enumerate(shapes.items())}


class SynthModel(nn.Module):
    """``forward(grads)`` returns ``sum(p * grads[name])``, whose gradient is exactly ``grads``."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], order: tuple[str, ...] | None = None):
        super().__init__()
        self.params = nn.ParameterDict({n: nn.Parameter(torch.zeros(s)) for n, s in shapes.items()})
        self.order = order or tuple(shapes)

    def forward(self, grads: dict[str, torch.Tensor]) -> torch.Tensor:
        return sum((self.params[n] * grads[n]).sum() for n in self.order)


def _names(module: nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in module.named_parameters()}


def run_synthetic(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Feed synthetic gradients through DDP + onebit_hook; record outputs, layouts, counters."""
    shapes = BIG_SHAPES if cfg.get("model") == "big" else SYNTH_SHAPES
    order = None if cfg.get("model") == "big" else SYNTH_USE_ORDER
    dtype = getattr(torch, cfg.get("dtype", "float32"))
    model = SynthModel(shapes, order).to(dtype)
    ddp = DDP(model, bucket_cap_mb=cfg.get("bucket_cap_mb", 25))
    state = OneBitState(model, **cfg["state"])
    names = _names(model)
    layouts: list[list[list[str]]] = []

    def recording_hook(st, bucket):  # no annotations: DDP compares them with the real types
        if bucket.index() == 0 or not layouts:
            layouts.append([])
        layouts[-1].append([names[id(p)] for p in bucket.parameters()])
        return onebit_hook(st, bucket)

    ddp.register_comm_hook(state, recording_hook)
    outputs, counters = [], []
    for t in range(cfg["steps"]):
        grads = {n: g.to(dtype) for n, g in
                 synthetic_grads(shapes, step=t, rank=rank, seed=cfg.get("seed", 0)).items()}
        for step, bad_rank, name, idx in cfg.get("nonfinite", ()):
            if step == t and bad_rank == rank:
                grads[name].view(-1)[idx] = float("nan") if idx % 2 == 0 else float("inf")
        ddp.zero_grad(set_to_none=True)
        ddp(grads).backward()
        outputs.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        counters.append(state.counters())
    return {"outputs": outputs, "layouts": layouts, "counters": counters,
            "state": state.state_dict(), "chunk_bytes": _chunk_sizes(state)}


def _chunk_sizes(state: OneBitState) -> list[int]:
    return sorted(layout.chunk_bytes for layout in state._layouts.values())


def worker_synthetic(rank: int, world: int, out: Path, configs: list[dict[str, Any]]) -> None:
    results = [run_synthetic(rank, world, cfg) for cfg in configs]
    torch.save(results, out / f"synthetic-{rank}.pt")


# ----------------------------------------------------------------------- a real small model


class MLP(nn.Module):
    def __init__(self, d_in: int = 32, hidden: int = 128, d_out: int = 8):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, hidden),
                                 nn.ReLU(), nn.Linear(hidden, d_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def teacher_data(n: int, *, seed: int, d_in: int = 32, d_out: int = 8) -> tuple[torch.Tensor,
                                                                                 torch.Tensor]:
    """Regression targets of a fixed random teacher network, plus noise."""
    teacher_gen = torch.Generator().manual_seed(12345)
    w1 = torch.randn(d_in, 64, generator=teacher_gen) / d_in**0.5
    w2 = torch.randn(64, d_out, generator=teacher_gen) / 8
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=g)
    y = torch.tanh(x @ w1) @ w2 + 0.01 * torch.randn(n, d_out, generator=g)
    return x, y


def train(rank: int, *, hook: dict[str, Any] | None, steps: int, start: int = 0,
          checkpoint: bytes | None = None, save_at: int | None = None, batch: int = 16,
          lr: float = 0.05, seed: int = 0, bucket_cap_mb: float = 25) -> dict[str, Any]:
    """Train the MLP with DDP (+ onebit_hook when ``hook`` is given) from ``start`` to ``steps``.

    Rank ``r``'s batch at step ``t`` depends only on (seed, r, t), so a resumed run sees the same
    data. Returns the losses, the final parameters, the eval loss and a checkpoint taken after
    step ``save_at`` (bytes), when asked.
    """
    torch.manual_seed(seed)  # same init on every rank (DDP also broadcasts rank 0's)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    state = OneBitState(model, **hook) if hook is not None else None
    if checkpoint is not None:
        ck = torch.load(io.BytesIO(checkpoint), weights_only=False)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        if state is not None:
            state.load_state_dict(ck["onebit"])
    ddp = DDP(model, bucket_cap_mb=bucket_cap_mb)
    if state is not None:
        ddp.register_comm_hook(state, onebit_hook)
    losses, saved, saved_state = [], None, None
    for t in range(start, steps):
        x, y = teacher_data(batch, seed=(seed * 7919 + t) * 131 + rank)
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if save_at is not None and t + 1 == save_at:
            buf = io.BytesIO()
            onebit = state.state_dict() if state is not None else None
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "onebit": onebit},
                       buf)
            saved, saved_state = buf.getvalue(), onebit
    x, y = teacher_data(4096, seed=999_999)
    with torch.no_grad():
        eval_loss = nn.functional.mse_loss(model(x), y).item()
    return {"losses": losses, "eval_loss": eval_loss, "checkpoint": saved,
            "state_dict": saved_state,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "counters": state.counters() if state is not None else None}


def worker_converge(rank: int, world: int, out: Path, runs: dict[str, dict[str, Any]]) -> None:
    results = {name: train(rank, **kw) for name, kw in runs.items()}
    for r in results.values():
        r.pop("params")
    torch.save(results, out / f"converge-{rank}.pt")


# ---------------------------------------------------------------- checkpoints and bad loads


def _bad_loads(sd: dict[str, Any]) -> dict[str, Any]:
    """Mutated copies of a good state dict (keys are the case names of the test's table)."""
    def changed(**kw: Any) -> dict[str, Any]:
        return {**sd, **kw}

    first = next(iter(sd["ranks"][0]["local"]))
    other_model = {**sd["ranks"][0], "local": {"not.a.param": torch.zeros(3)}}
    wrong_size = {**sd["ranks"][0], "local": {first: torch.zeros(3)}}
    return {
        "world_size": changed(world_size=4, ranks=sd["ranks"] * 2),
        "bits": changed(config={**sd["config"], "bits": 2, "rule": "range"}),
        "unknown_name": changed(ranks=[other_model, *sd["ranks"][1:]]),
        "wrong_size": changed(ranks=[wrong_size, *sd["ranks"][1:]]),
        "not_a_state_dict": {"ranks": []},
        "version": changed(version=99),
    }


def worker_trained(rank: int, world: int, out: Path, hooks: dict[str, dict[str, Any]],
                   steps: int, save_at: int, converge: dict[str, dict[str, Any]]) -> None:
    """Resume each hook configuration from a checkpoint, try bad loads, run convergence."""
    resume: dict[str, Any] = {}
    for name, hook in hooks.items():
        full = train(rank, hook=hook, steps=steps, save_at=save_at, bucket_cap_mb=0.03)
        resumed = train(rank, hook=hook, steps=steps, start=save_at,
                        checkpoint=full.pop("checkpoint"), bucket_cap_mb=0.03)
        resume[name] = {"full": full, "resumed": resumed, "state_dict": full["state_dict"]}
    # Bad loads, each on every rank (the checks are the same everywhere, so no rank is left
    # waiting in a collective).
    first = next(iter(hooks))
    state = OneBitState(MLP(), **hooks[first])
    errors: dict[str, Any] = {}
    cases = _bad_loads(resume[first]["state_dict"])
    for case, bad in [*cases.items(), ("unknown_name_not_strict", cases["unknown_name"])]:
        try:
            state.load_state_dict(bad, strict=not case.endswith("not_strict"))
            errors[case] = None
        except Exception as e:  # the test checks type and message
            errors[case] = (type(e).__name__, str(e))
    results = {name: train(rank, **kw) for name, kw in converge.items()}
    for r in results.values():
        r.pop("params")
        r.pop("checkpoint")
    torch.save({"resume": resume, "errors": errors, "converge": results},
               out / f"trained-{rank}.pt")
