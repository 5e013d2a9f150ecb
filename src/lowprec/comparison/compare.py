"""Train a task's model under several recipes and measure what each costs.

``compare`` runs every recipe with the same seed, the same initial weights and the same batches,
and returns one record per recipe and seed: eval loss before and after, final train loss, gap to
FP32 and share of FP32's loss drop, median step time and speed-up over FP32 (with their
interquartile ranges), bytes per parameter by buffer (measured from the tensors), the fraction
of updates lost to rounding (``diagnostics.UpdateMonitor``) and the loss curve. The recipes take
their steps in turn, so a machine whose load changes during the run slows them alike, and the
background load is measured. ``lowprec.comparison.summary`` turns the records into one row per recipe
over the seeds, the noise floor and the recommendation. The CLI (``lowprec compare``) prints,
plots and saves them; nothing here prints.

The task is a ``task.Task`` (``compare``'s ``task``: a user's, from ``lowprec.compare`` or
``lowprec compare --task FILE:NAME``), or one of the two built-in tasks (``CompareConfig.task``):
``pretrain`` trains from seeded random weights on the
standard library's sources; ``finetune`` starts every recipe and seed from one model pretrained
in FP32 (``lowprec.comparison.pretrained``, cached on disk; each recipe casts it, keeping the FP32
values for its master: ``CompareConfig.fp32_values``), and trains it on the
prose of ``pydoc_data.topics`` at a fine-tuning rate. A recipe's run, its data and its device are
``lowprec.comparison.run``'s (re-exported here: ``task_data``, ``run_recipe``, ``resolve_device``, ...).
"""

from __future__ import annotations

import itertools
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any, cast

import torch

from lowprec.comparison.config import DEFAULT_RECIPES, DEFAULT_TOLERANCE, OPTIMIZERS, CompareConfig
from lowprec.comparison.pretrained import pretrained
from lowprec.comparison.run import (
    _Run,
    builtin_task,
    check_start,
    device_info,
    resolve_device,
    run_recipe,
    task_data,
    task_loss,
)
from lowprec.comparison.summary import add_relative, noise_floor, recommend, summarize
from lowprec.comparison.task import Task

__all__ = ["DEFAULT_RECIPES", "DEFAULT_TOLERANCE", "OPTIMIZERS", "CompareConfig", "add_relative",
           "compare", "device_info", "noise_floor", "recommend", "resolve_device", "run_recipe",
           "summarize", "task_data", "task_loss"]


def compare(
    cfg: CompareConfig,
    *,
    on_start: Callable[[str], None] | None = None,
    on_step: Callable[[str, int, float], None] | None = None,
    on_done: Callable[[dict[str, Any]], None] | None = None,
    records: list[dict[str, Any]] | None = None,
    load: dict[str, Any] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    on_pretrain: Callable[[int, int, float], None] | None = None,
    on_note: Callable[[str], None] | None = None,
    info: dict[str, Any] | None = None,
    task: Task | None = None,
) -> list[dict[str, Any]]:
    """Train every recipe of ``cfg`` over ``cfg.seed_list`` and return their records (one per
    recipe and seed, seed by seed), with gaps and speed-ups vs FP32 of the same seed.

    Within a seed the recipes take their steps in turn, one step each per round, on the round's
    batch (the round's first recipe rotates), so that a load which comes and goes on the machine
    slows every recipe alike instead of the ones that happened to run meanwhile; a recipe's
    speed-up is the median over the rounds of FP32's step time over its own in the same round.
    The seeds run one after another (one seed's models at a time in memory). The background load
    (cores that other processes kept busy, from ``/proc/stat``) is measured per round and
    summarised in ``load`` (if given): see ``_Load``.

    The ``finetune`` task first gets its pretrained model (``lowprec.comparison.pretrained.pretrained``:
    from ``cache_dir`` where a valid one is there, else trained, calling ``on_pretrain(step,
    total, loss)``, and saved there); ``on_note(text)`` hears what the cache did, and ``info``
    (if given) gets ``{"pretrained": ...}``, where it came from and what it cost.

    ``task``: the task to train (default: None, the built-in ``cfg.task``, as
    ``run.builtin_task`` makes it). ``on_start(name)`` is called for every recipe before the first step, ``on_step(name, step,
    loss)`` after each step (``step`` counts on over the seeds: ``seeds * steps`` in all),
    ``on_done(record)`` for each record at the end. On Ctrl-C (``KeyboardInterrupt``) the
    records of the steps taken so far are put in ``records`` (if given), then the interrupt is
    raised again.
    """
    cfg.validate()
    # (set, as validate() checked: __post_init__ replaced a None with the task's)
    steps, recipe_names = cast(int, cfg.steps), cast("Sequence[str]", cfg.recipes)
    device = resolve_device(cfg.device)
    if device.type == "cpu":  # (the CPU kernels' threads: a GPU run leaves torch's own)
        torch.set_num_threads(cfg.threads)
    out = records if records is not None else []
    if task is None:
        weights = None
        if cfg.task == "finetune":
            weights, about = pretrained(cfg, device, cache_dir=cache_dir, on_step=on_pretrain,
                                        on_note=on_note)
            if info is not None:
                info["pretrained"] = about
        task = builtin_task(cfg, device, pretrained=weights)
    meter = _Load()
    for index, seed in enumerate(cfg.seed_list):
        start = task.model(seed)
        batches = seed_batches(task, seed, steps)
        check_start(task, start, batches[0], device)  # (a task's mistake: before any step)
        runs = []
        for name in recipe_names:
            if on_start is not None and index == 0:
                on_start(name)
            runs.append(_Run(name, cfg, start, task, seed))
        del start
        try:
            for step, batch in enumerate(batches):
                first = step % len(runs)
                meter.start()
                for run in runs[first:] + runs[:first]:
                    loss = run.step(batch)
                    if on_step is not None:
                        on_step(run.name, index * steps + step, loss)
                meter.stop()
        except KeyboardInterrupt:
            out.extend(run.record() for run in runs if run.losses)
            add_relative(out)
            if load is not None:
                load.update(meter.summary())
            raise
        out.extend(run.record() for run in runs)
        del runs
    add_relative(out)
    if load is not None:
        load.update(meter.summary())
    if on_done is not None:
        for record in out:
            on_done(record)
    return out


def seed_batches(task: Task, seed: int, steps: int) -> list[Any]:
    """The first ``steps`` training batches of ``task`` for ``seed``, drawn before any step so
    that every recipe takes the same ones and a task short of batches is refused at once.

    Raises:
        ValueError: ``task.train(seed)`` gives fewer than ``steps`` batches.
    """
    batches = list(itertools.islice(task.train(seed), steps))
    if len(batches) < steps:
        raise ValueError(
            f"the training batches ran out after {len(batches)} of the {steps} steps (seed "
            f"{seed}): give at least {steps} batches (a longer iterable, or a function of the "
            "seed that draws them), or fewer steps."
        )
    return batches


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
        busy0, cpu0, wall0 = cast("tuple[float | None, float, float]", self._mark)  # (start's)
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


def config_dict(cfg: CompareConfig) -> dict[str, Any]:
    """``cfg`` as plain JSON-ready values."""
    d = asdict(cfg)
    d["recipes"] = list(cast("Sequence[str]", cfg.recipes))  # (set by __post_init__)
    d["lr"] = cfg.peak_lr
    d["schedule"] = cfg.lr_schedule
    d["seed_list"] = cfg.seed_list
    return d
