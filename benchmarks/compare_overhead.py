"""What ``lowprec compare``'s own work costs: the lost-update monitor and the records, against a
training step, on the built-in default task.

The same comparison (the default model, ``--recipes``, ``--steps``) runs with the monitor on
(``--monitor-every``, default 10, the command's default) and off (0), alternating
``--repeats`` times in one process so that a load which comes and goes falls on both. For each
recipe it prints the mean step time (the monitored steps included: the mean, not the median,
which would leave them out) with and without the monitor, their ratio, and the wall time of the
records (``_Run.record``: memory, eval, the monitor's report). Target (issue 54): the monitor
and the records at most 15% of a training step.

    python benchmarks/compare_overhead.py            # AdamW, 80 steps, 3 repeats
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lowprec.comparison import compare as engine
from lowprec.comparison.config import CompareConfig
from lowprec.comparison.run import _Run, builtin_task, resolve_device


def one(cfg: CompareConfig) -> dict[str, tuple[float, float]]:
    """Each recipe's (mean step seconds, seconds its record took)."""
    device = resolve_device(cfg.device)
    task = builtin_task(cfg, device)
    start = task.model(cfg.seed)
    batches = engine.seed_batches(task, cfg.seed, int(cfg.steps or 0))
    runs = [_Run(name, cfg, start, task, cfg.seed) for name in cfg.recipes or ()]
    for step, batch in enumerate(batches):
        first = step % len(runs)
        for run in runs[first:] + runs[:first]:
            run.step(batch)
    out = {}
    for run in runs:
        began = time.perf_counter()
        run.record()
        # (the first two steps compile: left out of both)
        out[run.name] = (statistics.fmean(run.times[2:]), time.perf_counter() - began)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipes", default="fp32,bf16,bf16-kahan,bf16-split")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--monitor-every", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(2)
    recipes = tuple(args.recipes.split(","))
    on: dict[str, list[tuple[float, float]]] = {r: [] for r in recipes}
    off: dict[str, list[tuple[float, float]]] = {r: [] for r in recipes}
    for _ in range(args.repeats):
        for every, into in ((args.monitor_every, on), (0, off)):
            cfg = CompareConfig(recipes=recipes, steps=args.steps, monitor_every=every,
                                device="cpu")
            for name, value in one(cfg).items():
                into[name].append(value)
    print(f"{'recipe':12s} {'step ms, monitor':>16s} {'without':>8s} {'ratio':>6s} "
          f"{'record s':>8s} {'without':>8s}")
    for name in recipes:
        a = statistics.median(v[0] for v in on[name])
        b = statistics.median(v[0] for v in off[name])
        ra = statistics.median(v[1] for v in on[name])
        rb = statistics.median(v[1] for v in off[name])
        print(f"{name:12s} {1e3 * a:16.1f} {1e3 * b:8.1f} {a / b:6.3f} {ra:8.2f} {rb:8.2f}")


if __name__ == "__main__":
    main()
