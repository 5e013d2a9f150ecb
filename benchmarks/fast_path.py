"""What each mechanism of the fused step's fast path buys: the step with all of them against the
step with one switched off, on the benchmark's 25M-parameter layout and on ``lowprec compare``'s
model.

The mechanisms (``docs/architecture.md``, "The fused step"):

* ``buckets``: from the first step, a group's tensors in flat buffers, a few compiled calls per
  group whatever their number (``driver.step_buckets``); off, every parameter by its own full
  step (``driver.full_step``), as before buckets;
* ``pairs``: on CPU, 16-bit tensors stepped as 32-bit words of two elements (vectorized C++);
  off, the elementwise kernel (``compiled.pairs_plan`` returns None).

Each is switched off by patching its module during the switched-off optimizer's step alone
(``SWITCHES``). ``lamb-8bit`` and ``adafactor`` are rules whose parameters no bucket gathers
(8-bit codes with whole-tensor sums: each a bucket of one, its call kept; whole tensors: each
by its own step).

The optimizers stepped with and without a mechanism are alive side by side and stepped in turn
(which goes first alternates), each with its own parameters and the same fixed gradients; a
mechanism's figure is the median over the steps of (step without it) / (step with all), so a
load that comes and goes slows both alike. ``saves`` is 1 - with / without: the fraction of the
step without the mechanism that the mechanism removes. The issue's bar: a mechanism that saves
under 3% on every workload is not worth its lines.

    python benchmarks/fast_path.py                 # both workloads, 6 optimizer configurations
    python benchmarks/fast_path.py --quick         # a smoke run
    python benchmarks/fast_path.py --device cuda   # on a GPU (gpu_check.sh runs it)
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import pathlib
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any
from unittest import mock

import torch

import lowprec
from lowprec.comparison.task import CharTransformer, ModelConfig
from lowprec.optim import compiled, driver

CONFIGS = {  # name -> (optimizer class, keywords)
    "adamw-kahan": (lowprec.AdamW, {"lr": 1e-3, "master": "kahan"}),
    "adamw-stochastic": (lowprec.AdamW, {"lr": 1e-3, "master": "stochastic"}),
    "sgd-split": (lowprec.SGD, {"lr": 1e-2, "momentum": 0.9, "master": "split"}),
    "lamb-kahan": (lowprec.Lamb, {"lr": 1e-3, "master": "kahan"}),
    "lamb-8bit": (lowprec.Lamb, {"lr": 1e-3, "master": "kahan", "state_dtype": "8bit"}),
    "adafactor": (lowprec.Adafactor, {"lr": 1e-3, "master": "kahan"}),
}


_never = lambda *args, **kwargs: False  # noqa: E731
_kind = driver._kind


def _kind_off_pairs(opt, rule, group, p, storage):
    """``driver._kind`` without pairs: stochastic rounding's parameters left out of buckets (a
    gathered piece's per-word random keys need the pairs kernel), each stepped on its own."""
    return None if storage.needs_random_bits else _kind(opt, rule, group, p, storage)

# What switches a mechanism off, patched into its module for the switched-off optimizer's step
# alone.
SWITCHES: dict[str, list[tuple[Any, str, Any]]] = {
    "buckets": [(driver, "step_buckets", _never), (driver, "flatten", lambda opt: None)],
    "pairs": [(compiled, "pairs_plan", lambda *args, **kwargs: None),
              (driver, "_kind", _kind_off_pairs)],
}


def _switch_off(opt: torch.optim.Optimizer, mechanism: str) -> Callable[[], Any]:
    """``opt``'s step with ``mechanism`` switched off (during its steps alone)."""
    switches = SWITCHES[mechanism]

    def step() -> Any:
        with contextlib.ExitStack() as stack:
            for module, name, value in switches:
                stack.enter_context(mock.patch.object(module, name, value))
            return opt.step()
    return step


MECHANISMS = tuple(SWITCHES)


def benchmark_shapes(params_millions: float) -> list[tuple[int, ...]]:
    """The parameter shapes of ``benchmarks/optimizer_step.py``'s transformer-like layout."""
    path = pathlib.Path(__file__).with_name("optimizer_step.py")
    spec = importlib.util.spec_from_file_location("optimizer_step", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["optimizer_step"] = module  # (its dataclasses resolve their module)
    spec.loader.exec_module(module)
    return [shape for _, shape in module.layout(params_millions)[2]]


def compare_shapes() -> list[tuple[int, ...]]:
    """The parameter shapes of ``lowprec compare``'s default model."""
    return [tuple(p.shape) for p in CharTransformer(ModelConfig()).parameters()]


def measure(shapes, config: str, *, steps: int, warmup: int,
            device: torch.device | str = "cpu") -> dict[str, Any]:
    """Step time with every mechanism, and the median ratio of each one switched off."""
    cls, kw = CONFIGS[config]
    device = torch.device(device)
    gen = torch.Generator().manual_seed(0)
    values = [torch.randn(s, generator=gen).mul_(0.02).to(device, torch.bfloat16) for s in shapes]
    grads = [torch.randn(s, generator=gen).mul_(1e-3).to(device, torch.bfloat16) for s in shapes]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def make() -> tuple[torch.optim.Optimizer, list[torch.Tensor]]:
        params = [v.clone().requires_grad_() for v in values]
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        return cls(params, fused=True, seed=1, **kw), params

    on, _ = make()
    offs = {}
    for m in MECHANISMS:
        opt, _ = make()
        offs[m] = _switch_off(opt, m)
    for _ in range(warmup):  # state, compilation, records
        on.step()
        for step in offs.values():
            step()

    def timed(step: Callable[[], Any]) -> float:
        sync()
        start = time.perf_counter()
        step()
        sync()  # (on CUDA the kernels' time, not their launches')
        return time.perf_counter() - start

    with_all: list[float] = []
    ratios: dict[str, list[float]] = {m: [] for m in MECHANISMS}
    without: dict[str, list[float]] = {m: [] for m in MECHANISMS}
    for i in range(steps):
        for m in MECHANISMS:
            if i % 2:
                t_off, t_on = timed(offs[m]), timed(on.step)
            else:
                t_on, t_off = timed(on.step), timed(offs[m])
            with_all.append(t_on)
            without[m].append(t_off)
            ratios[m].append(t_off / t_on)
    out = {"config": config, "params": sum(math.prod(s) for s in shapes),
           "tensors": len(shapes), "step_ms": 1e3 * statistics.median(with_all), "off": {}}
    for m in MECHANISMS:
        r = statistics.median(ratios[m])
        q = statistics.quantiles(ratios[m], n=4) if len(ratios[m]) > 1 else [r, r, r]
        out["off"][m] = {"step_ms": 1e3 * statistics.median(without[m]), "ratio": r,
                         "ratio_iqr": [q[0], q[2]], "saves": 1 - 1 / r}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params-millions", type=float, default=25.0,
                    help="size of the benchmark layout (default: 25)")
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help=f"comma-separated, of {', '.join(CONFIGS)} (default: all)")
    ap.add_argument("--steps", type=int, default=15, help="timed steps per mechanism (default: 15)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps (default: 3)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default: 2)")
    ap.add_argument("--device", default="cpu",
                    help="where the parameters live: cpu or cuda[:N] (default: cpu); on CUDA "
                         "the pairs mechanism does not apply (a CPU layout), the others do")
    ap.add_argument("--quick", action="store_true", help="2M parameters, 3 steps")
    ap.add_argument("--json", type=pathlib.Path, help="also write the results here")
    args = ap.parse_args(argv)
    if args.quick:
        args.params_millions, args.steps = 2.0, 3
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: this torch sees no CUDA device")
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        ap.error(f"unknown --configs {', '.join(unknown)}; choose from {', '.join(CONFIGS)}")
    workloads = {"benchmark": benchmark_shapes(args.params_millions), "compare": compare_shapes()}
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"fast-path mechanisms on {where}: torch {torch.__version__}, {args.threads} threads, "
          f"{args.steps} timed steps per mechanism, BF16 parameters, fused=True")
    print("saves: the share of the step without the mechanism that it removes (median of paired "
          "steps; IQR of the ratio without/with in brackets)")
    header = f"{'workload':<10} {'config':<17} {'params':>7} {'ms':>7}  " + "  ".join(
        f"{m:>22}" for m in MECHANISMS)
    print(header)
    results = []
    for wname, shapes in workloads.items():
        for config in configs:
            r = measure(shapes, config, steps=args.steps, warmup=args.warmup, device=device)
            r["workload"], r["device"] = wname, where
            results.append(r)
            cells = "  ".join(
                f"{o['saves']:>+7.1%} [{o['ratio_iqr'][0]:.2f}-{o['ratio_iqr'][1]:.2f}x]"
                .rjust(22) for o in r["off"].values())
            print(f"{wname:<10} {config:<17} {r['params'] / 1e6:>6.1f}M {r['step_ms']:>7.2f}  "
                  f"{cells}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
