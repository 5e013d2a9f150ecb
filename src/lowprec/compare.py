"""Train the built-in model under several recipes and measure what each costs.

``compare`` runs every recipe with the same seed, the same initial weights and the same batches,
and returns one record per recipe: final train loss, eval loss and gap to FP32, median step time
and speed-up over FP32 (with their interquartile ranges), bytes per parameter by buffer
(measured from the tensors), the fraction of updates lost to rounding
(``diagnostics.UpdateMonitor``) and the loss curve. The recipes take their steps in turn, so a
machine whose load changes during the run slows them alike, and the background load is
measured. The CLI (``lowprec compare``) prints, plots and saves these records; nothing here
prints.

Everything runs on ``cfg.device`` (``resolve_device``: ``"auto"`` is CUDA where torch finds it):
the models (built on the CPU from one seeded FP32 state, so every device starts from the same
weights, then moved), the batches and the eval batches; each recipe's autocast is entered for
that device's type, and its loss scaler lives where its loss does. On CUDA a step's time is read
after ``torch.cuda.synchronize``, so it is the step's run time, not the time its kernels took to
be queued.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

import torch
import torch.nn.functional as F

from lowprec import recipes as recipes_mod
from lowprec.config import (
    DEFAULT_RECIPES,
    DEFAULT_TOLERANCE,
    OPTIMIZERS,
    CompareConfig,
    ModelConfig,
    check_device,
)
from lowprec.task import Batches, CharTransformer, load_text

__all__ = ["DEFAULT_RECIPES", "DEFAULT_TOLERANCE", "OPTIMIZERS", "CompareConfig", "compare",
           "device_info", "recommend", "resolve_device", "run_recipe", "task_loss"]


def resolve_device(device: str = "auto") -> torch.device:
    """The ``torch.device`` that ``device`` (``CompareConfig.device``) names on this machine.

    ``"auto"`` is the current CUDA device where ``torch.cuda.is_available()``, else the CPU.

    Raises:
        ValueError: A spelling ``config.check_device`` refuses, CUDA asked for where torch finds
            none, or a GPU index this machine does not have.
    """
    check_device(device)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type != "cuda":
        return dev
    if not torch.cuda.is_available():
        why = ("this torch is a CPU-only build" if torch.version.cuda is None
               else "torch finds no CUDA GPU")
        raise ValueError(f"no CUDA device: {why} (torch {torch.__version__}); train on the CPU "
                         "(--device cpu, or auto, which picks CUDA only where there is one), "
                         "or on a machine with a GPU and a CUDA build of torch.")
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        raise ValueError(f"no CUDA device {dev.index}: this machine has {count} CUDA "
                         f"device(s): choose cuda:0 to cuda:{count - 1}.")
    return torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)


def device_info(device: torch.device) -> dict[str, Any]:
    """What ran the steps, for the JSON and the header: ``{"device": "cuda:0", "type": "cuda",
    "name": the GPU's name (``torch.cuda.get_device_name``) or the CPU's model}``, and for a GPU
    its memory, compute capability and torch's CUDA version."""
    info: dict[str, Any] = {"device": str(device), "type": device.type}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(name=torch.cuda.get_device_name(device), total_memory=props.total_memory,
                    capability=f"{props.major}.{props.minor}", cuda=torch.version.cuda)
    else:
        info["name"] = _cpu_name()
    return info


def _cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``, else ``platform.processor()``), or "CPU"."""
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "CPU"


def _schedule(cfg: CompareConfig) -> Callable[[int], float]:
    warm = max(1, int(cfg.warmup * cfg.steps))

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        progress = (step - warm) / max(1, cfg.steps - warm)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x).float()
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), y.reshape(-1))


def task_loss(model: ModelConfig, batch_size: int, device: torch.device | str,
              seed: int = 0) -> Callable[[torch.nn.Module], torch.Tensor]:
    """``loss_fn(model)``: the built-in task's loss on one fixed batch of random bytes on
    ``device``, for ``memory.cuda_peak`` (a step's memory does not depend on which bytes)."""
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, 256, (batch_size, model.context + 1), generator=gen).to(device)
    x, y = idx[:, :-1], idx[:, 1:]
    return lambda m: _loss(m, x, y)


@torch.no_grad()
def _evaluate(model, recipe, batches, device: torch.device) -> float:
    model.eval()
    try:
        with recipe.autocast(device.type):
            return statistics.fmean(float(_loss(model, x.to(device), y.to(device)))
                                    for x, y in batches)
    finally:
        model.train()


class _Run:
    """One recipe's training run, stepped one batch at a time (``compare`` takes the recipes'
    steps in turn; ``run_recipe`` runs one alone)."""

    def __init__(self, name: str, cfg: CompareConfig, initial: dict[str, torch.Tensor]) -> None:
        from lowprec import diagnostics

        self.name, self.cfg = name, cfg
        self.device = resolve_device(cfg.device)
        self.recipe = recipe = recipes_mod.get(name)
        model = CharTransformer(cfg.model)
        model.load_state_dict(initial)
        self.model = model = recipe.convert(model.to(self.device))
        hp: dict[str, Any] = {"lr": cfg.peak_lr, "fused": cfg.fused}
        if cfg.optimizer == "sgd":
            hp["momentum"] = 0.9
        if cfg.optimizer in ("adamw", "lamb"):
            hp["weight_decay"] = 0.01
        self.opt = recipe.optimizer(cfg.optimizer, model.parameters(), seed=cfg.seed, **hp)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, _schedule(cfg))
        self.monitor = None
        if cfg.monitor_every:
            self.monitor = diagnostics.UpdateMonitor(
                model, self.opt, every=cfg.monitor_every, scaler=recipe.scaler
            )
        self.losses: list[float] = []
        self.times: list[float] = []
        self.skipped = 0

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """One training step on batch ``(x, y)``; returns its loss (NaN for inf or NaN)."""
        recipe, model, opt, monitor = self.recipe, self.model, self.opt, self.monitor
        x, y = x.to(self.device), y.to(self.device)  # (no copy where they are there already)
        start = self._clock()
        opt.zero_grad(set_to_none=True)
        with recipe.autocast(self.device.type):
            loss = _loss(model, x, y)
        recipe.backward(loss)
        with monitor.step() if monitor is not None else contextlib.nullcontext():
            stepped = recipe.step(opt)
        if stepped:
            self.sched.step()
        else:
            self.skipped += 1
        self.times.append(self._clock() - start)
        value = float(loss.detach())
        value = value if math.isfinite(value) else float("nan")
        self.losses.append(value)
        return value

    def _clock(self) -> float:
        """``time.perf_counter()`` once the device has finished the work queued on it (on CUDA
        the calls return when the kernels are queued, not run)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def record(self, batches: Batches) -> dict[str, Any]:
        """The run's record (the steps taken so far), with its eval loss and memory."""
        from lowprec import memory

        cfg, monitor = self.cfg, self.monitor
        losses, times = self.losses, self.times
        tail = [v for v in losses[-max(1, len(losses) // 10):] if math.isfinite(v)]
        mem = memory.measure(self.model, self.opt)
        lost = None
        if monitor is not None:
            # What the training trajectory loses: updates that left the master value unchanged
            # (for Kahan, split and an FP32 copy the stored BF16/FP16 weight may lag while the
            # master keeps the update).
            lost = monitor.master_lost_fraction
            if lost is None:
                lost = monitor.lost_update_fraction
            monitor.close()
        steady = _steady(times)
        median = statistics.median(steady)
        return {
            "recipe": self.name,
            "final_loss": statistics.fmean(tail) if tail else float("nan"),
            "eval_loss": _evaluate(self.model, self.recipe, batches.eval_batches(cfg.eval_batches),
                                   self.device),
            "step_time_s": median,
            "step_time_iqr_s": _quartiles(steady),
            # What the first steps took beyond two steady ones: the fused step's compilation.
            "warmup_s": max(0.0, sum(times[:WARMUP_STEPS]) - median * len(times[:WARMUP_STEPS])),
            "step_times_s": times,
            "bytes_per_param": mem.bytes_per_param,
            "lost_update_fraction": lost,
            "stored_unchanged_fraction": (
                monitor.lost_update_fraction if monitor is not None else None
            ),
            "skipped_steps": self.skipped,
            "losses": losses,
            "description": self.recipe.description,
        }


def run_recipe(
    name: str,
    cfg: CompareConfig,
    batches: Batches,
    initial: dict[str, torch.Tensor],
    *,
    on_step: Callable[[int, float], None] | None = None,
) -> dict[str, Any]:
    """Train one recipe alone from the ``initial`` FP32 weights and return its record."""
    run = _Run(name, cfg, initial)
    for step, (x, y) in enumerate(batches.train_batches(cfg.steps)):
        loss = run.step(x, y)
        if on_step is not None:
            on_step(step, loss)
    return run.record(batches)


def compare(
    cfg: CompareConfig,
    *,
    on_start: Callable[[str], None] | None = None,
    on_step: Callable[[str, int, float], None] | None = None,
    on_done: Callable[[dict[str, Any]], None] | None = None,
    records: list[dict[str, Any]] | None = None,
    load: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Train every recipe of ``cfg`` and return their records, with gaps and speed-ups vs FP32.

    The recipes take their steps in turn, one step each per round, on the round's batch (the
    round's first recipe rotates), so that a load which comes and goes on the machine slows
    every recipe alike instead of the ones that happened to run meanwhile; a recipe's speed-up
    is the median over the rounds of FP32's step time over its own in the same round. The
    background load (cores that other processes kept busy, from ``/proc/stat``) is measured
    per round and summarised in ``load`` (if given): see ``_Load``.

    ``on_start(name)`` is called for every recipe before the first step, ``on_step(name, step,
    loss)`` after each step, ``on_done(record)`` for each record at the end. On Ctrl-C
    (``KeyboardInterrupt``) the records of the steps taken so far are put in ``records`` (if
    given), then the interrupt is raised again.
    """
    cfg.validate()
    device = resolve_device(cfg.device)
    if device.type == "cpu":  # (the CPU kernels' threads: a GPU run leaves torch's own)
        torch.set_num_threads(cfg.threads)
    out = records if records is not None else []
    text = load_text(cfg.text_bytes)
    batches = Batches(text, context=cfg.model.context, batch_size=cfg.batch_size, seed=cfg.seed,
                      device=device)
    torch.manual_seed(cfg.seed)
    initial = copy.deepcopy(CharTransformer(cfg.model).state_dict())
    runs = []
    for name in cfg.recipes:
        if on_start is not None:
            on_start(name)
        runs.append(_Run(name, cfg, initial))
    meter = _Load()
    try:
        for step, (x, y) in enumerate(batches.train_batches(cfg.steps)):
            first = step % len(runs)
            meter.start()
            for run in runs[first:] + runs[:first]:
                loss = run.step(x, y)
                if on_step is not None:
                    on_step(run.name, step, loss)
            meter.stop()
    except KeyboardInterrupt:
        out.extend(run.record(batches) for run in runs if run.losses)
        add_relative(out)
        if load is not None:
            load.update(meter.summary())
        raise
    out.extend(run.record(batches) for run in runs)
    add_relative(out)
    if load is not None:
        load.update(meter.summary())
    if on_done is not None:
        for record in out:
            on_done(record)
    return out


#: Background load (cores other processes kept busy) above which a round counts as contended:
#: with 2 threads on 2 cores, another process on one core slows a step by several times.
CONTENDED_CORES = 0.5


def machine_busy_s() -> float | None:
    """Seconds of CPU time the whole machine has been busy (every process), from ``/proc/stat``;
    None where it cannot be read (not Linux)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    # user nice system idle iowait irq softirq steal: all but idle and iowait are busy.
    ticks = [int(v) for v in fields[1:9]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


class _Load:
    """The machine's background load per round: cores that other processes kept busy (the
    machine's busy time from ``/proc/stat`` minus this process's CPU time, over the wall time).
    None where ``/proc/stat`` cannot be read (not Linux)."""

    def __init__(self) -> None:
        self.rounds: list[float | None] = []
        self._mark: tuple[float | None, float, float] | None = None

    def start(self) -> None:
        self._mark = (machine_busy_s(), time.process_time(), time.perf_counter())

    def stop(self) -> None:
        busy0, cpu0, wall0 = self._mark
        busy1, cpu1, wall1 = machine_busy_s(), time.process_time(), time.perf_counter()
        if busy0 is None or busy1 is None or wall1 <= wall0:
            self.rounds.append(None)
        else:
            self.rounds.append(max(0.0, (busy1 - busy0) - (cpu1 - cpu0)) / (wall1 - wall0))

    def summary(self) -> dict[str, Any]:
        """``background_cores``: the median over the rounds; ``contended_fraction``: the share
        of rounds above ``CONTENDED_CORES``; ``max_cores``; None where it was not measured."""
        known = [b for b in self.rounds if b is not None]
        if not known:
            return {"background_cores": None, "max_cores": None, "contended_fraction": None,
                    "rounds": len(self.rounds)}
        return {
            "background_cores": statistics.median(known),
            "max_cores": max(known),
            "contended_fraction": sum(b > CONTENDED_CORES for b in known) / len(known),
            "rounds": len(self.rounds),
        }


#: Steps left out of the step times: the fused step compiles its kernels in the first step and
#: the calls a redone step shares between parameters in the second.
WARMUP_STEPS = 2


def _steady(xs: Sequence[Any]) -> list[Any]:
    """``xs`` without the first ``WARMUP_STEPS`` steps (the last one where no other is left)."""
    return list(xs[WARMUP_STEPS:]) if len(xs) > WARMUP_STEPS else list(xs[-1:])


def _quartiles(xs: Sequence[float]) -> list[float] | None:
    """The 25th and 75th percentiles of ``xs`` (None for fewer than two values)."""
    if len(xs) < 2:
        return None
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return [q[0], q[2]]


def add_relative(records: list[dict[str, Any]]) -> None:
    """Fill ``eval_gap``, ``speedup`` and its ``speedup_iqr`` against the FP32 record, where there
    is one. The speed-up is the median over the steps of FP32's step time over the recipe's at
    the same step (the same round of ``compare``), the first ``WARMUP_STEPS`` left out."""
    ref = next((r for r in records if r["recipe"] == "fp32"), None)
    for r in records:
        if ref is None:
            r["eval_gap"], r["speedup"], r["speedup_iqr"] = None, None, None
            continue
        r["eval_gap"] = (r["eval_loss"] - ref["eval_loss"]) / ref["eval_loss"]
        pairs = list(zip(ref["step_times_s"], r["step_times_s"], strict=False))
        ratios = [a / b for a, b in _steady(pairs)]
        r["speedup"] = statistics.median(ratios)
        r["speedup_iqr"] = _quartiles(ratios)


def recommend(records: list[dict[str, Any]], tolerance: float = DEFAULT_TOLERANCE
              ) -> dict[str, Any]:
    """The cheapest recipe that trains as well as FP32 on this run, and why each other lost.

    A recipe qualifies when its eval loss is finite and at most ``tolerance`` (a fraction) above
    FP32's (``eval_gap``); among those the fewest bytes per parameter wins, then the shorter
    median step. Needs the records' relative fields (``add_relative``).

    Returns:
        ``{"recipe": name or None, "tolerance", "reason", "others": {name: why not}}``;
        ``recipe`` is None (with the reason) where there is no FP32 record or none qualifies.
    """
    out: dict[str, Any] = {"recipe": None, "tolerance": tolerance, "others": {}}
    if not any(r["recipe"] == "fp32" for r in records):
        out["reason"] = "no fp32 run to compare with: add fp32 to --recipes"
        return out

    def fits(r: dict[str, Any]) -> bool:
        gap = r.get("eval_gap")
        return gap is not None and math.isfinite(gap) and gap <= tolerance

    fitting = sorted((r for r in records if fits(r)),
                     key=lambda r: (r["bytes_per_param"]["total"], r["step_time_s"]))
    if not fitting:
        out["reason"] = f"no recipe ended within {tolerance:.1%} of fp32's eval loss"
    else:
        best = fitting[0]
        b, t = best["bytes_per_param"]["total"], best["step_time_s"]
        out["recipe"] = best["recipe"]
        out["reason"] = (f"eval loss {best['eval_gap']:+.2%} vs fp32 (within {tolerance:.1%}), "
                         f"{b:.1f} B/param, {1e3 * t:.0f} ms/step")
    for r in records:
        if r is (fitting[0] if fitting else None):
            continue
        gap = r.get("eval_gap")
        if gap is None or not math.isfinite(gap):
            why = "diverged"
        elif gap > tolerance:
            why = f"eval loss {gap:+.2%} vs fp32, beyond the {tolerance:.1%} tolerance"
        elif r["bytes_per_param"]["total"] > b:
            why = f"{r['bytes_per_param']['total']:.1f} B/param against {b:.1f}"
        else:
            why = f"as lean, but slower: {1e3 * r['step_time_s']:.0f} against {1e3 * t:.0f} ms/step"
        out["others"][r["recipe"]] = why
    return out


def config_dict(cfg: CompareConfig) -> dict[str, Any]:
    """``cfg`` as plain JSON-ready values."""
    d = asdict(cfg)
    d["recipes"] = list(cfg.recipes)
    d["lr"] = cfg.peak_lr
    return d
