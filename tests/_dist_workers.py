"""Worker processes for tests/test_distributed.py (importable, so that spawned children find them).

``launch(fn, world_size, out_dir, *args)`` starts ``world_size`` processes with gloo on 127.0.0.1
(a port the OS picked), one intra-op thread each, and runs ``fn(rank, world_size, out_dir,
*args)`` in each; workers save their results with ``torch.save`` under ``out_dir``, their tensors
moved to the CPU (``to_cpu``). ``launch(..., backend="nccl")`` starts them with NCCL instead, rank
``r`` on GPU ``r``; the 1-bit SGD workers put their models and data on ``device()``, the rank's
GPU under NCCL and the CPU under gloo.
"""

from __future__ import annotations

import io
import math
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

from lowprec.distributed import OneBitState, kernels, onebit_hook

TIMEOUT_S = 90


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Any, world_size: int, port: int, out_dir: str, args: tuple,
           backend: str = "gloo") -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # stay on loopback
        if backend == "nccl":
            os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)  # one GPU per rank
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=TIMEOUT_S),
    )
    try:
        fn(rank, world_size, Path(out_dir), *args)
    finally:
        dist.destroy_process_group()


def launch(fn: Any, world_size: int, out_dir: str | Path, *args: Any,
           backend: str = "gloo") -> None:
    """Run ``fn(rank, world_size, out_dir, *args)`` in ``world_size`` processes of a ``backend``
    process group (gloo, or NCCL with one GPU per rank); re-raise. NCCL with fewer GPUs than ranks
    is refused here, not left to a rank's "invalid device ordinal"."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "nccl" and world_size > gpus:
        raise ValueError(f"{world_size} NCCL ranks need a GPU each; {gpus} visible")
    mp.spawn(_entry, args=(fn, world_size, free_port(), str(out_dir), args, backend),
             nprocs=world_size, join=True)


def device() -> torch.device:
    """Where this rank's tensors go: its GPU in an NCCL process group, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _ddp(model: nn.Module, **kw: Any) -> DDP:
    """``DDP(model)`` on ``model``'s device (a GPU needs ``device_ids``)."""
    dev = next(model.parameters()).device
    return DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None, **kw)


def to_cpu(obj: Any) -> Any:
    """``obj`` with every tensor in it (in dicts, lists and tuples) on the CPU: what a worker
    saves for the test process, which compares it with references computed on the CPU."""
    if isinstance(obj, torch.Tensor):
        return obj.cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


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
#: Edge cases, one bucket each with a tiny bucket_cap_mb: an empty parameter, one value, odd sizes.
TINY_SHAPES = {"empty": (0, 5), "one": (), "odd": (7,), "w": (3, 41), "single": (1,),
               "three": (3,)}
MODELS = {"synth": (SYNTH_SHAPES, SYNTH_USE_ORDER), "big": (BIG_SHAPES, None),
          "tiny": (TINY_SHAPES, ("w", "three", "one", "empty", "single", "odd"))}


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
    shapes, order = MODELS[cfg.get("model", "synth")]
    dtype = getattr(torch, cfg.get("dtype", "float32"))
    dev = device()
    model = SynthModel(shapes, order).to(dtype).to(dev)
    ddp = _ddp(model, bucket_cap_mb=cfg.get("bucket_cap_mb", 25))
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
        grads = {n: g.to(dtype).to(dev) for n, g in
                 synthetic_grads(shapes, step=t, rank=rank, seed=cfg.get("seed", 0)).items()}
        for step, bad_rank, name, idx in cfg.get("nonfinite", ()):
            if step == t and bad_rank == rank:
                grads[name].view(-1)[idx] = float("nan") if idx % 2 == 0 else float("inf")
        ddp.zero_grad(set_to_none=True)
        ddp(grads).backward()
        outputs.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        counters.append(state.counters())
    return {"outputs": outputs, "layouts": layouts, "counters": counters,
            "state": state.state_dict(), "chunk_bytes": _chunk_sizes(state),
            "compiled": state.compiled,
            "kernels": sorted({key[:2] for key in kernels._COMPILED})}  # (name, bits) so far


def _chunk_sizes(state: OneBitState) -> list[int]:
    return sorted(m["chunk_bytes"] for m in state.messages())


class FakeBucket:
    """The part of ``dist.GradBucket`` that ``onebit_hook`` uses, for buckets DDP never makes."""

    def __init__(self, params: list[nn.Parameter], buffer: torch.Tensor) -> None:
        self._params, self._buffer = params, buffer

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def parameters(self) -> list[nn.Parameter]:
        return self._params

    last: bool = True

    def is_last(self) -> bool:
        return self.last


def direct_edge_buckets(rank: int) -> dict[str, torch.Tensor]:
    """``onebit_hook`` called directly (compressing from the first step) on a bucket of no values
    (DDP folds empty parameters into others) and on a one-value bucket."""
    dev = device()
    model = nn.ParameterDict({"empty": nn.Parameter(torch.zeros(0)),
                              "one": nn.Parameter(torch.zeros(1))}).to(dev)
    state = OneBitState(model, warmup_steps=0)
    empty = onebit_hook(state, FakeBucket([model["empty"]], torch.zeros(0, device=dev))).wait()
    one = onebit_hook(state, FakeBucket([model["one"]], torch.tensor([rank + 1.5], device=dev)))
    one = one.wait()
    return {"empty": empty, "one": one, "counters": state.counters(),
            "pipeline": pipelined_buckets(rank), "scaled": loss_scaled_steps(rank)}


class FakeScaler:
    """What ``OneBitState(loss_scaler=...)`` reads of a loss scaler: its current scale."""

    def __init__(self) -> None:
        self.scale = 1.0

    def get_scale(self) -> float:
        return self.scale


def loss_scaled_steps(rank: int) -> dict[str, Any]:
    """Four compressed steps on two buckets: once with gradients multiplied by a changing loss
    scale (a state that follows the scaler), once unscaled (a state without one); the outputs,
    the residual scale across a checkpoint, and the residuals of both."""
    dev = device()
    shapes = {"a": (64, 48), "b": (300,)}
    model = nn.ParameterDict({k: nn.Parameter(torch.zeros(s)) for k, s in shapes.items()}).to(dev)
    scales = [4.0, 32.0, 32.0, 0.5]
    scaler = FakeScaler()
    runs = {"scaled": OneBitState(model, warmup_steps=0, loss_scaler=scaler),
            "plain": OneBitState(model, warmup_steps=0)}
    out: dict[str, Any] = {"scales": scales}
    for name, state in runs.items():
        outputs = []
        for step, scale in enumerate(scales):
            scaler.scale = scale
            factor = scale if name == "scaled" else 1.0
            futures = []
            for i, (k, s) in enumerate(shapes.items()):
                g = torch.randn(math.prod(s), generator=torch.Generator().manual_seed(
                    100 * step + 10 * rank + i)).to(dev) * factor
                bucket = FakeBucket([model[k]], g)
                bucket.last = i == len(shapes) - 1
                futures.append(onebit_hook(state, bucket))
            outputs.append([f.wait().clone() for f in futures])
        out[name] = {"outputs": outputs, "state": state.state_dict()}
    # A checkpoint carries the scale its residuals are in; a state without a scaler that loads it
    # rescales them to 1 at its next compressed step.
    resumed = OneBitState(model, warmup_steps=0)
    resumed.load_state_dict(out["scaled"]["state"])
    g = [torch.zeros(math.prod(s), device=dev) for s in shapes.values()]
    futures = []
    for i, k in enumerate(shapes):
        bucket = FakeBucket([model[k]], g[i])
        bucket.last = i == len(shapes) - 1
        futures.append(onebit_hook(resumed, bucket))
    out["resumed_output"] = [f.wait().clone() for f in futures]
    runs["plain"].load_state_dict(out["plain"]["state"])
    g = [torch.zeros(math.prod(s), device=dev) for s in shapes.values()]
    futures = []
    for i, k in enumerate(shapes):
        bucket = FakeBucket([model[k]], g[i])
        bucket.last = i == len(shapes) - 1
        futures.append(onebit_hook(runs["plain"], bucket))
    out["plain_next_output"] = [f.wait().clone() for f in futures]
    return out


def pipelined_buckets(rank: int) -> dict[str, Any]:
    """Three buckets per step, two steps, ``onebit_hook`` called directly: through the pipeline
    (only the third bucket is last), and one bucket at a time (each flushed before the next).
    Records which futures were complete after each call, the results and the residuals."""
    dev = device()
    shapes = {"a": (64, 48), "b": (40, 96), "c": (300,)}
    model = nn.ParameterDict({k: nn.Parameter(torch.zeros(s)) for k, s in shapes.items()}).to(dev)
    out: dict[str, Any] = {}
    for mode in ("pipelined", "one-by-one"):
        state = OneBitState(model, warmup_steps=0)
        done_after, results = [], []
        for step in range(2):
            grads = {k: torch.randn(math.prod(s), generator=torch.Generator().manual_seed(
                100 * step + 10 * rank + i)).to(dev) for i, (k, s) in enumerate(shapes.items())}
            futures = []
            for i, k in enumerate(shapes):
                bucket = FakeBucket([model[k]], grads[k])
                bucket.last = i == len(shapes) - 1
                futures.append(onebit_hook(state, bucket))
                if mode == "one-by-one":
                    state.flush()
                done_after.append([f.done() for f in futures])
            results.append([f.wait().clone() for f in futures])
        out[mode] = {"done_after": done_after, "results": results,
                     "state": state.state_dict(), "counters": state.counters(),
                     "messages": state.messages(), "compiled": state.compiled}
    return out


def worker_synthetic(rank: int, world: int, out: Path, configs: list[dict[str, Any]]) -> None:
    results = [run_synthetic(rank, world, cfg) for cfg in configs]
    results.append(direct_edge_buckets(rank))
    torch.save(to_cpu(results), out / f"synthetic-{rank}.pt")


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
    dev = device()
    torch.manual_seed(seed)  # same init on every rank (DDP also broadcasts rank 0's)
    model = MLP().to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    state = OneBitState(model, **hook) if hook is not None else None
    if checkpoint is not None:
        ck = torch.load(io.BytesIO(checkpoint), weights_only=False, map_location=dev)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        if state is not None:
            state.load_state_dict(ck["onebit"])
    ddp = _ddp(model, bucket_cap_mb=bucket_cap_mb)
    if state is not None:
        ddp.register_comm_hook(state, onebit_hook)
    losses, saved, saved_state = [], None, None
    for t in range(start, steps):
        x, y = (v.to(dev) for v in teacher_data(batch, seed=(seed * 7919 + t) * 131 + rank))
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
    x, y = (v.to(dev) for v in teacher_data(4096, seed=999_999))
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
    torch.save(to_cpu(results), out / f"converge-{rank}.pt")


# ---------------------------------------------------------------- checkpoints and bad loads


def _bad_loads(sd: dict[str, Any]) -> dict[str, Any]:
    """Mutated copies of a good state dict (keys are the case names of the test's table)."""
    def changed(**kw: Any) -> dict[str, Any]:
        return {**sd, **kw}

    first = next(iter(sd["ranks"][0]["local"]))
    zeros = sd["ranks"][0]["local"][first].new_zeros(3)  # (on the residuals' device)
    other_model = {**sd["ranks"][0], "local": {"not.a.param": zeros}}
    wrong_size = {**sd["ranks"][0], "local": {first: zeros}}
    return {
        "world_size": changed(world_size=4, ranks=sd["ranks"] * 2),
        "bits": changed(config={**sd["config"], "bits": 2, "rule": "range"}),
        "unknown_name": changed(ranks=[other_model, *sd["ranks"][1:]]),
        "wrong_size": changed(ranks=[wrong_size, *sd["ranks"][1:]]),
        "not_a_state_dict": {"ranks": []},
        "version": changed(version=99),
    }


def worker_trained(rank: int, world: int, out: Path, hooks: dict[str, dict[str, Any]],
                   steps: int, save_at: int, converge: dict[str, dict[str, Any]],
                   scaler_run: dict[str, Any]) -> None:
    """Resume each hook configuration from a checkpoint, try bad loads, run convergence, and
    train with a loss scaler through a NaN on one rank."""
    resume: dict[str, Any] = {}
    for name, hook in hooks.items():
        full = train(rank, hook=hook, steps=steps, save_at=save_at, bucket_cap_mb=0.03)
        resumed = train(rank, hook=hook, steps=steps, start=save_at,
                        checkpoint=full.pop("checkpoint"), bucket_cap_mb=0.03)
        resume[name] = {"full": full, "resumed": resumed, "state_dict": full["state_dict"]}
    # Bad loads, each on every rank (the checks are the same everywhere, so no rank is left
    # waiting in a collective).
    first = next(iter(hooks))
    state = OneBitState(MLP().to(device()), **hooks[first])
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
    scaled = train_with_scaler(rank, **scaler_run)
    torch.save(to_cpu({"resume": resume, "errors": errors, "converge": results, "scaler": scaled}),
               out / f"trained-{rank}.pt")


# ------------------------------------------------------------- a NaN on one rank, loss scaler


def train_with_scaler(rank: int, *, steps: int, poison_step: int, poison_rank: int,
                      poison_param: str, warmup_steps: int) -> dict[str, Any]:
    """Train the MLP with DDP, onebit_hook and lowprec.LossScaler; at ``poison_step`` rank
    ``poison_rank`` makes ``poison_param``'s gradient NaN (a tensor hook, before DDP sees it).

    Returns per step whether the scaler stepped, the scale, the parameters and the local
    residuals (from ``state_dict()``) after the step, and the final counters."""
    from lowprec import LossScaler

    dev = device()
    torch.manual_seed(0)
    model = MLP().to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = LossScaler(init_scale=2.0**10)
    state = OneBitState(model, warmup_steps=warmup_steps)
    ddp = _ddp(model, bucket_cap_mb=0.03)  # several buckets: the poisoned one falls back alone
    ddp.register_comm_hook(state, onebit_hook)
    step_now = [0]

    def poison(grad: torch.Tensor) -> torch.Tensor:
        if rank == poison_rank and step_now[0] == poison_step:
            return torch.full_like(grad, float("nan"))
        return grad

    dict(model.named_parameters())[poison_param].register_hook(poison)
    stepped, scales, params, residuals = [], [], [], []
    for t in range(steps):
        step_now[0] = t
        x, y = (v.to(dev) for v in teacher_data(16, seed=t * 131 + rank))
        opt.zero_grad(set_to_none=True)
        scaler.scale(nn.functional.mse_loss(ddp(x), y)).backward()
        stepped.append(bool(scaler.step(opt)))
        scaler.update()
        scales.append(scaler.get_scale())
        params.append({n: p.detach().clone() for n, p in model.named_parameters()})
        residuals.append(state.state_dict()["ranks"][rank]["local"])
    return {"stepped": stepped, "scales": scales, "params": params, "residuals": residuals,
            "counters": state.counters()}


# ------------------------------------------------------------------------- a rank that dies


def dying_rank(rank: int, world: int, port: int, out: str, mode: str, timeout_s: float,
               die_after: int) -> None:
    """Rank 1 is killed (``mode="kill"``: SIGKILL) or stalls (``"stall"``: sleeps) after
    ``die_after`` steps; the others keep training and record what they raised and when."""
    import signal
    import time

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=timeout_s))
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ddp = DDP(model)
    ddp.register_comm_hook(OneBitState(model, warmup_steps=1), onebit_hook)
    result: dict[str, Any] = {"error": None, "steps": 0}
    t0 = time.monotonic()
    try:
        for t in range(die_after + 50):
            if rank == 1 and t == die_after:
                if mode == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(600)  # stall: never reach the next collective (killed)
            x, y = teacher_data(16, seed=t * 131 + rank)
            opt.zero_grad(set_to_none=True)
            t0 = time.monotonic()
            nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
            result["steps"] = t + 1
    except Exception as e:  # the test checks type, message and time
        result["error"] = (type(e).__name__, [c.__name__ for c in type(e).__mro__], str(e))
    result["seconds"] = time.monotonic() - t0
    torch.save(result, Path(out) / f"dying-{rank}.pt")
    os._exit(0)  # no destroy_process_group: it would wait for the dead rank


def run_dying(world: int, out: Path, mode: str, *, timeout_s: float, die_after: int,
              wait_s: float) -> int | None:
    """Start ``dying_rank`` in ``world`` processes and wait up to ``wait_s`` seconds for rank 0;
    return its exit code (None: still running, i.e. hung). Every process left is then killed."""
    import time

    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=dying_rank, args=(r, world, port, str(out), mode, timeout_s,
                                                  die_after)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + wait_s
    try:
        for p in procs[:1] + procs[2:]:  # the survivors (rank 1 is the one that dies)
            p.join(max(0.0, deadline - time.monotonic()))
        return procs[0].exitcode
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()


# ---------------------------------------------------------------- gradient accumulation


def worker_accumulate(rank: int, world: int, out: Path, _: Any) -> None:
    """``lowprec.accumulate`` under DDP: 7 micro-batches in ``no_sync()``, an 8th synced. Saves
    how many elements of this rank's compensated sum (read just before DDP reduces it) are the
    exact sum rounded once, how many of the reduced gradient are the mean of the ranks' sums as
    one BF16 addition gives it, and the error that gradient_as_bucket_view=True raises."""
    import copy

    from lowprec import accumulate
    from tests.test_accumulate import _batches, _exact, _loss, _model, _ulps

    model = _model()
    batches = _batches(8 * world)[8 * rank:8 * (rank + 1)]
    exact = _exact(model, batches)
    ddp = DDP(copy.deepcopy(model))
    accumulate(ddp.module)
    local: dict[str, torch.Tensor] = {}
    for n, p in ddp.module.named_parameters():  # (after accumulate's: sees the compensated sum)
        p.register_post_accumulate_grad_hook(lambda p, n=n: local.__setitem__(n, p.grad.clone()))
    with ddp.no_sync():
        for x, y in batches[:-1]:
            _loss(ddp, x, y).backward()
    _loss(ddp, *batches[-1]).backward()
    names = list(exact)
    ulps = torch.cat([_ulps(local[n], exact[n]).view(-1) for n in names])
    gathered = [None] * world
    dist.all_gather_object(gathered, local)
    same = []
    for n, p in ddp.module.named_parameters():
        mean = (sum(g[n].float() for g in gathered) / world).to(p.dtype)
        same.append((p.grad == mean).view(-1))
    result = {"local_ok": (ulps <= 0.5 + 1e-6).float().mean().item(),
              "synced_ok": torch.cat(same).float().mean().item(), "view_error": ""}
    viewed = DDP(copy.deepcopy(model), gradient_as_bucket_view=True)
    accumulate(viewed.module)
    try:
        for x, y in batches[:2]:  # (the synced backward makes the gradients bucket views)
            _loss(viewed, x, y).backward()
    except RuntimeError as e:
        result["view_error"] = str(e)
    torch.save(result, out / f"accumulate-{rank}.pt")
