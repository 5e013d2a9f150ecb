"""Worker processes for tests/test_dtensor.py: lowprec's optimizers on DTensor parameters.

Each configuration steps parameters that ``distribute_tensor`` shards over a 1-D CPU mesh (gloo
ranks started by ``tests._dist_workers.launch``), with gradients placed as the parameters and
the same full values on every rank, so that the unsharded run in the test process is the
reference: the same steps on the same full tensors. The runs that ask for the fused step take it
under ``tests._fallback.fallbacks_are_errors``: a compiled step that falls back to eager is an
error there (recorded in the run's results, or the worker's failure), not eager bits that pass.
"""

from __future__ import annotations

import contextlib
import copy
import io
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import lowprec
from tests._fallback import fallbacks_are_errors

#: First dimensions that 2 or 3 ranks split unevenly, an odd flat length, a parameter above the
#: fused step's small-parameter batch size (65536 elements), one kept replicated, and two of one
#: shape that 2, 3 and 4 ranks split evenly (a rule's sums over the ranks, gathered: sq, sq2).
SHAPES = {"w": (5, 12), "b": (7,), "big": (300, 256), "emb": (9, 33), "rep": (6, 4),
          "sq": (6, 8), "sq2": (6, 8)}
REPLICATED = ("rep",)
STEPS = 4


def full_params(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {n: (torch.randn(s, generator=g) * 0.1).to(dtype) for n, s in SHAPES.items()}


def full_grads(step: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    # (updates of ~1e-3 of the weights: many below half a BF16 unit, where the masters differ)
    return {n: (torch.randn(s, generator=g) * 1e-2).to(dtype) for n, s in SHAPES.items()}


def grads_for(cfg: dict[str, Any], step: int) -> dict[str, torch.Tensor]:
    """The full gradients of ``step``; at ``cfg["inf_step"]`` one inf in the last row of ``w``,
    which only the last rank's shard holds."""
    grads = full_grads(step, cfg["dtype"])
    if cfg.get("inf_step") == step:
        grads["w"][-1, -1] = float("inf")
    return grads


def grads_for_step(cfg: dict[str, Any], step: int, scaler: Any) -> dict[str, torch.Tensor]:
    """``grads_for``, times the loss scaler's scale where there is one (a power of two: exact)."""
    grads = grads_for(cfg, step)
    if scaler is not None:
        scale = float(scaler.scale(torch.ones(())))
        grads = {n: (g.float() * scale).to(g.dtype) for n, g in grads.items()}
    return grads


def opt_step(opt: Any, cfg: dict[str, Any], scaler: Any = None) -> Any:
    """One step; under ``cfg["scaled"]`` with a loss scale and a found-inf flag (returned); under
    ``cfg["scaler"]`` through ``scaler`` (a LossScaler), with ``unscale_`` first: its
    (found-inf, scale) after the step."""
    if cfg.get("scaler"):
        scaler.unscale_(opt)
        stepped = scaler.step(opt)
        scaler.update()
        return bool(stepped), float(scaler.scale(torch.ones(())))
    if not cfg.get("scaled"):
        opt.step()
        return None
    found = torch.zeros(())
    opt.step(grad_scale=torch.tensor(4.0), found_inf=found)
    return found.item()


def new_scaler(cfg: dict[str, Any]) -> Any:
    return lowprec.LossScaler(init_scale=8.0, growth_interval=2) if cfg.get("scaler") else None


@contextlib.contextmanager
def _prepared_calls() -> Any:
    """Inside, the compiled calls the step prepares (``compiled.prepare_fused``: the buckets'
    and those of the parameters stepped on their own), listed as they are made."""
    from lowprec.optim import compiled

    made: list[Any] = []
    real = compiled.prepare_fused

    def spy(*args: Any, **kwargs: Any) -> Any:
        made.append(real(*args, **kwargs))
        return made[-1]

    compiled.prepare_fused = spy
    try:
        yield made
    finally:
        compiled.prepare_fused = real


def compiled_calls(made: list[Any], layout: Any) -> tuple[int, int]:
    """How the steps ran: (compiled calls prepared, those whose random bits start past index 0
    of a larger parameter: a shard's ``base`` where it is stepped alone, or the compiled pieces of
    a bucket of shards whose words carry their indices in their parameters)."""
    gathered = sum(len(b.prepared) for b in (layout.buckets if layout else ())
                   if len(b.params) > 1 and any(b.starts))
    return len(made), sum(f.base is not None for f in made) + gathered


def _compiled_only(fused: Any) -> contextlib.AbstractContextManager[None]:
    """A run that asks for the fused step (``fused=True``) may not fall back to eager."""
    return fallbacks_are_errors() if fused else contextlib.nullcontext()


def make(cfg: dict[str, Any], params: list[torch.Tensor]) -> lowprec.optim.SGD:
    cls = getattr(lowprec.optim, cfg["cls"])
    return cls(params, **cfg["kw"])


def _placements(name: str, shard_dim: int, ndim: int, mesh_dims: int = 1) -> list[Any]:
    """One placement per mesh dimension: a 2-D mesh (HSDP) replicates along its first and shards
    along its second."""
    last = Replicate() if name in REPLICATED else Shard(shard_dim if shard_dim < ndim else 0)
    return [Replicate()] * (mesh_dims - 1) + [last]


def _full(t: DTensor) -> torch.Tensor:
    """The whole of ``t`` on every rank (gloo gathers no int16: a split trail goes as bf16)."""
    if t.dtype != torch.int16:
        return t.full_tensor()
    as_bf16 = DTensor.from_local(t.to_local().view(torch.bfloat16), t.device_mesh, t.placements,
                                 run_check=False, shape=t.shape, stride=t.stride())
    return as_bf16.full_tensor().view(torch.int16)


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()


def run_config(mesh: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    """Steps of ``cfg`` on sharded parameters: full parameters, masters and state after them, and
    the placements the state tensors have (as seen on this rank)."""
    dtype = cfg["dtype"]
    plain = cfg.get("plain", ())  # (names kept as plain tensors, beside the DTensors)
    params = {
        n: nn.Parameter(
            t if n in plain
            else distribute_tensor(
                t, mesh, _placements(n, cfg.get("shard_dim", 0), t.dim(), mesh.ndim)
            )
        )
        for n, t in full_params(dtype).items()
    }
    if cfg.get("rank_seed"):  # (seed=None then differs between the ranks)
        torch.manual_seed(1000 + dist.get_rank())
    opt = make(cfg, list(params.values()))
    scaler = new_scaler(cfg)
    out: dict[str, Any] = {}
    with _compiled_only(cfg["kw"].get("fused")), _prepared_calls() as made:
        try:
            for step in range(STEPS):
                for n, g in grads_for_step(cfg, step, scaler).items():
                    params[n].grad = g if n in plain else distribute_tensor(
                        g, mesh, params[n].placements
                    )
                out.setdefault("found", []).append(opt_step(opt, cfg, scaler))
                layout = lowprec.optim.core.stages(opt).buckets  # (shards in buckets: their state gathered)
                out["compiled"] = compiled_calls(made, layout)
                out.setdefault("prepared", []).append(len(made))
                out["bucketed"] = sum(len(b.params) for b in layout.buckets) if layout else 0
                out["gathered_shards"] = sum(len(b.params) for b in layout.buckets
                                             if len(b.params) > 1 and b.gather_state
                                             ) if layout else 0
                if step == 1 and cfg.get("resume"):
                    # A checkpoint in the middle: copied, saved to bytes and loaded back (as each
                    # rank's torch.save and torch.load would), into a new optimizer.
                    saved = copy.deepcopy(opt.state_dict())
                    buf = io.BytesIO()
                    torch.save(saved, buf)
                    buf.seek(0)
                    opt = make(cfg, list(params.values()))
                    opt.load_state_dict(torch.load(buf))
            if cfg.get("load_plain"):  # a checkpoint of the full tensors, not sharded
                plain = opt.state_dict()
                plain["state"] = {
                    i: {k: _full(v) if isinstance(v, DTensor) else v for k, v in st.items()}
                    for i, st in plain["state"].items()
                }
                fresh = make(cfg, list(params.values()))
                try:
                    fresh.load_state_dict(plain)
                except ValueError as e:
                    out["load_error"] = str(e)
                out["load_left_state"] = bool(fresh.state)
        except Exception as e:  # (the test checks the message and that nothing changed)
            out["error"] = f"{type(e).__name__}: {e}"
    out["params"] = {n: _whole(p) for n, p in params.items()}
    out["masters"] = {n: _whole(opt.master_weight(p)) for n, p in params.items()}
    state: dict[str, dict[str, Any]] = {}
    placements: dict[str, dict[str, Any]] = {}
    for n, p in params.items():
        st = opt.state.get(p, {})
        state[n] = {k: _full(v) if isinstance(v, DTensor) else v for k, v in st.items()}
        if n in plain:  # (state as the parameter's: plain, unless it is a DTensor)
            placements[n] = {k: None for k, v in st.items() if isinstance(v, torch.Tensor)}
            continue
        placements[n] = {k: tuple(v.placements) if isinstance(v, DTensor) else None
                         for k, v in st.items() if isinstance(v, torch.Tensor)}
    out["state"], out["placements"] = state, placements
    out["param_placements"] = {n: tuple(p.placements) if isinstance(p, DTensor) else None
                               for n, p in params.items()}
    return out


def _exit_now() -> None:
    """Leave the worker once its results are saved, skipping the interpreter's teardown: a
    process that used DTensors or FSDP2 on gloo aborts there about half the time ("terminate
    called without an active exception"; the same with torch.optim.AdamW, 5 of 10 runs)."""
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def worker_sharded(rank: int, world: int, out: Path, configs: dict[str, dict[str, Any]],
                   mesh_shape: tuple[int, ...] | None = None) -> None:
    mesh = init_device_mesh("cpu", mesh_shape or (world,))
    results = {name: run_config(mesh, cfg) for name, cfg in configs.items()}
    torch.save(results, out / f"rank{rank}.pt")
    _exit_now()


#: The meshes of ``worker_meshes``' 4 processes: a 2 x 2 mesh (HSDP: replicated along its first
#: dimension, sharded along its second), whose rows are two 2-rank meshes side by side, and a
#: 3-rank mesh of ranks 0, 1 and 3 (rank 2 sits it out). Ranks 1 and 3 hold the second shard of
#: the 2-rank meshes and the second and third of the 3-rank one: the ranks whose stochastic
#: rounding keys its bits past index 0 (compiled kernels of their own) are the same processes in
#: every mesh, so each compiles its kernels once.
GRID = [[0, 1], [2, 3]]
THREE = [0, 1, 3]


def worker_meshes(rank: int, world: int, out: Path,
                  phases: list[tuple[str, str, dict[str, dict[str, Any]]]]) -> None:
    """Every phase ``(key, mesh, configs)`` in turn, in the same 4 processes: ``mesh`` is
    ``"pairs"`` (the rows of ``GRID``: two 2-rank meshes, each running ``configs``), ``"three"``
    (``THREE``) or ``"grid"`` (``GRID``, 2-D). One launch instead of one per mesh: a process
    compiles each fused variant once (``lowprec.optim.compiled``'s kernels live as long as the
    process), where each launch's processes compiled (or loaded from Inductor's cache) all of
    them again. Saves ``{key: {name: run_config(...)}}`` for the phases this rank is in."""
    # (every rank builds every mesh: a mesh's process groups are made by all ranks together)
    grid = DeviceMesh("cpu", GRID, mesh_dim_names=("replicate", "shard"))
    meshes = {"pairs": grid["shard"], "three": DeviceMesh("cpu", THREE), "grid": grid}
    results: dict[str, dict[str, Any]] = {}
    for key, which, configs in phases:
        mesh = meshes[which]
        if mesh.get_coordinate() is None:  # (not in this mesh)
            continue
        results.setdefault(key, {}).update(
            (name, run_config(mesh, cfg)) for name, cfg in configs.items())
    torch.save(results, out / f"rank{rank}.pt")
    _exit_now()


def _mlp(wide: bool = False) -> nn.Module:
    """A small BF16 MLP. ``wide``: one more layer, whose weight ``"4.weight"`` (64 x 256) is the
    only one with 8-bit state under ``state_dtype="8bit"``, sharded or not: its rows are whole
    blocks (``lowprec.optim.qstate``), and the other weights are under 4096 elements."""
    torch.manual_seed(0)
    head = (nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 256)) if wide else (nn.Linear(16, 64),)
    return nn.Sequential(*head, nn.ReLU(), nn.Linear(256 if wide else 64, 64), nn.ReLU(),
                         nn.Linear(64, 4)).to(torch.bfloat16)


def _fully_shard(model: nn.Module, world: int) -> None:
    """FSDP2's ``fully_shard`` on each linear layer of ``model`` and on the whole, over a CPU mesh
    of the gloo ranks: without a mesh it makes a CUDA one wherever CUDA is visible, and moves the
    model to the GPU (on a 1-GPU machine, both ranks' to GPU 0, over gloo)."""
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def train_mlp(runs: dict[str, dict[str, Any]], *, world: int,
              rank: int, steps: int = 3) -> dict[str, dict[str, dict[str, torch.Tensor]]]:
    """``steps`` of a small BF16 MLP under FSDP2's ``fully_shard`` on a fixed batch split over
    the ranks, per run; beside it an unsharded copy of the model and optimizer stepped with the
    gradients FSDP2 reduced (gathered whole), the reference for the sharded steps. The full
    parameters of both after the steps."""
    out = {}
    for name, run in runs.items():
        kw = {k: v for k, v in run.items() if k not in ("wide", "monitor")}
        model, replica = _mlp(run.get("wide", False)), _mlp(run.get("wide", False))
        _fully_shard(model, world)
        opt = lowprec.optim.AdamW(model.parameters(), lr=1e-2, seed=11, **kw)
        ref = lowprec.optim.AdamW(replica.parameters(), lr=1e-2, seed=11, **kw)
        twins = dict(replica.named_parameters())
        monitors = []
        if run.get("monitor"):  # (UpdateMonitor on both: the shards' counts added over ranks)
            from lowprec.updates import UpdateMonitor

            monitors = [UpdateMonitor(model, opt), UpdateMonitor(replica, ref)]
        for step in range(steps):
            g = torch.Generator().manual_seed(step)
            x = torch.randn(12, 16, generator=g).to(torch.bfloat16)
            y = torch.randn(12, 4, generator=g)
            xs, ys = x.chunk(world)[rank], y.chunk(world)[rank]
            (model(xs).float() - ys).pow(2).mean().backward()
            for n, p in model.named_parameters():
                twins[n].grad = p.grad.full_tensor()
            for mon, o in zip(monitors or (None, None), (opt, ref), strict=True):
                with (mon.step() if mon is not None else contextlib.nullcontext(),
                      _compiled_only(run.get("fused"))):
                    o.step()
                o.zero_grad()
        out[name] = {
            "sharded": {n: p.full_tensor() for n, p in model.named_parameters()},
            "unsharded": {n: p.detach().clone() for n, p in replica.named_parameters()},
            "state_dtypes": {n: opt.state[p]["exp_avg"].dtype
                             for n, p in model.named_parameters()},
            "reports": [m.report().as_dict() for m in monitors],
        }
    return out


def worker_fsdp2(rank: int, world: int, out: Path, runs: dict[str, dict[str, Any]],
                 dcp_runs: dict[str, dict[str, Any]]) -> None:
    """``train_mlp(runs)`` and ``dcp_resumes(dcp_runs)`` in the same processes (one launch: the
    second finds the kernels the first compiled); saves ``{"fsdp2": ..., "dcp": ...}``."""
    fsdp2 = train_mlp(runs, world=world, rank=rank)
    torch.save({"fsdp2": fsdp2, "dcp": dcp_resumes(rank, world, out, dcp_runs)},
               out / f"rank{rank}.pt")
    _exit_now()


def dcp_resumes(rank: int, world: int, out: Path,
                runs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """FSDP2 + torch.distributed.checkpoint: 4 steps straight, and 2 steps, a DCP save, a new
    model and optimizer loaded from it (``get_state_dict``/``set_state_dict``), 2 more steps.
    A run with ``"resume_as"`` (options) hands the loaded optimizer's sharded state to an
    optimizer built with those options (another ``master=``) before the last 2 steps."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def build(kw: dict[str, Any]) -> tuple[nn.Module, Any]:
        model = _mlp(wide)
        _fully_shard(model, world)
        return model, lowprec.optim.AdamW(model.parameters(), lr=1e-2, seed=3, **kw)

    def train(model: nn.Module, opt: Any, steps: range) -> None:
        for step in steps:
            g = torch.Generator().manual_seed(step)
            x = torch.randn(12, 16, generator=g).to(torch.bfloat16)
            model(x.chunk(world)[rank]).float().pow(2).mean().backward()
            with _compiled_only(opt.defaults.get("fused")):
                opt.step()
            opt.zero_grad()

    def masters(opt: Any) -> dict[str, torch.Tensor]:
        return {n: opt.master_weight(p).full_tensor() for n, p in model.named_parameters()}

    results = {}
    for name, run in runs.items():
        kw = {k: v for k, v in run.items() if k not in ("resume_as", "wide")}
        wide = run.get("wide", False)
        model, opt = build(kw)
        train(model, opt, range(4))
        straight = {n: p.full_tensor() for n, p in model.named_parameters()}
        straight_masters = masters(opt)
        model, opt = build(kw)
        train(model, opt, range(2))
        msd, osd = get_state_dict(model, opt)
        where = str(out / f"ckpt-{name}")
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=where)
        model, opt = build(kw)
        msd, osd = get_state_dict(model, opt)
        loaded = {"model": msd, "optim": osd}
        dcp.load(loaded, checkpoint_id=where)
        set_state_dict(model, opt, model_state_dict=loaded["model"],
                       optim_state_dict=loaded["optim"])
        conversion = {}
        if "resume_as" in run:
            converted = lowprec.optim.AdamW(model.parameters(), lr=1e-2, seed=3,
                                            **{**kw, **run["resume_as"]})
            conversion["loaded"] = masters(opt)
            converted.load_state_dict(opt.state_dict())
            opt = converted
            conversion["converted"] = masters(opt)
        train(model, opt, range(2, 4))
        resumed = {n: p.full_tensor() for n, p in model.named_parameters()}
        results[name] = {"straight": straight, "resumed": resumed,
                         "straight_masters": straight_masters, "resumed_masters": masters(opt),
                         "resumed_state": {n: opt.state[p]["master"]
                                           for n, p in model.named_parameters()},
                         "resumed_dtypes": {n: opt.state[p]["exp_avg"].dtype
                                            for n, p in model.named_parameters()},
                         **conversion}
    return results
