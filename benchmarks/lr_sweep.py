"""The learning rates behind ``lowprec.comparison.config.DEFAULT_LR``: each optimizer's FP32 run of
``lowprec compare``'s built-in task at several peak rates, its eval loss per rate.

    python benchmarks/lr_sweep.py                         # every optimizer, the rates below
    python benchmarks/lr_sweep.py --optimizer lion --lrs 3e-5,1e-4 --task finetune

One FP32 run per rate (the task's steps, schedule, seed and model), the rows in the order run,
the best rate of each optimizer marked. A rate whose run diverges shows its eval loss as nan.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from lowprec.comparison.compare import compare
from lowprec.comparison.config import CompareConfig

# The rates tried per optimizer: around the value its authors or torch use for a small
# transformer, a factor of 2 or 3 apart.
RATES = {
    "adam": (2.5e-4, 5e-4, 1e-3),
    "radam": (5e-4, 1e-3, 2e-3),
    "lion": (2.5e-5, 5e-5, 1e-4, 2e-4),
    "stableadamw": (5e-4, 1e-3, 2e-3),
    "adafactor": (3e-3, 1e-2, 3e-2),
    "muon": (1e-2, 2e-2, 4e-2),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--optimizer", default=None, help="one optimizer (default: every one above)")
    ap.add_argument("--lrs", default=None, help="comma-separated rates (default: RATES)")
    ap.add_argument("--task", default="pretrain", choices=("pretrain", "finetune"))
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args(argv)
    names = [args.optimizer] if args.optimizer else list(RATES)
    rows = []
    for name in names:
        lrs = [float(x) for x in args.lrs.split(",")] if args.lrs else RATES[name]
        for lr in lrs:
            cfg = CompareConfig(task=args.task, optimizer=name, lr=lr, recipes=("fp32",),
                                steps=args.steps)
            start = time.perf_counter()
            rec = compare(cfg, cache_dir="out/pretrained")[0]
            rows.append({"optimizer": name, "lr": lr, "eval_loss": rec["eval_loss"],
                         "seconds": round(time.perf_counter() - start, 1)})
            print(f"{name:12s} lr {lr:<8g} eval {rec['eval_loss']:.4f}  "
                  f"({rows[-1]['seconds']} s)", flush=True)
    print("\nbest per optimizer:")
    for name in names:
        mine = [r for r in rows if r["optimizer"] == name and r["eval_loss"] == r["eval_loss"]]
        if mine:
            best = min(mine, key=lambda r: r["eval_loss"])
            print(f"  {name:12s} lr {best['lr']:g} eval {best['eval_loss']:.4f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
