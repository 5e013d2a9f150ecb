"""A whole training step (forward, backward, step) with the update inside backward
(``lowprec.step_in_backward``) against the same step with ``optimizer.step()`` after backward.

Two copies of one model, each with its own optimizer, are trained on the same batches in turn
(which goes first alternates), so that a load that comes and goes slows both alike; the figure
per configuration is the median over the steps of each, and the median of the per-step ratios
(inside / normal: below 1 is faster). The first ``--warmup`` steps (compilation, lazy state)
are left out. Both copies take the same bits at every step (checked at the end).

    python benchmarks/step_in_backward.py                  # the built-in transformer, medium
    python benchmarks/step_in_backward.py --model mlp      # a deep MLP (32 x 1024^2)
    python benchmarks/step_in_backward.py --quick          # a smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from torch import nn

import lowprec
from lowprec.comparison.task import CharTransformer, ModelConfig

CONFIGS = {  # name -> (optimizer class, keywords)
    "adamw-kahan": (lowprec.AdamW, {"lr": 1e-4, "master": "kahan"}),
    "adamw-kahan-8bit": (lowprec.AdamW, {"lr": 1e-4, "master": "kahan", "state_dtype": "8bit"}),
    "adamw-stochastic": (lowprec.AdamW, {"lr": 1e-4, "master": "stochastic"}),
    "adafactor-kahan": (lowprec.Adafactor, {"lr": 1e-3, "master": "kahan"}),
}


def _model(kind: str, quick: bool) -> tuple[nn.Module, callable]:
    torch.manual_seed(0)
    if kind == "mlp":
        width, depth = (256, 4) if quick else (1024, 32)
        layers = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.ReLU()]
        model = nn.Sequential(*layers)

        def batch(i):
            g = torch.Generator().manual_seed(i)
            return torch.randn(64, width, generator=g).bfloat16()

        def loss(m, x):
            return m(x).float().square().mean()
        return model.bfloat16(), batch, loss
    cfg = ModelConfig(d_model=128, n_layer=2) if quick else ModelConfig(d_model=384, n_layer=6)
    model = CharTransformer(cfg).bfloat16()

    def batch(i):
        g = torch.Generator().manual_seed(i)
        return torch.randint(0, 256, (16, cfg.context + 1), generator=g)

    def loss(m, x):
        out = m(x[:, :-1]).float()
        return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), x[:, 1:].reshape(-1))
    return model, batch, loss


def _step(model, opt, loss_fn, x) -> float:
    t0 = time.perf_counter()
    loss_fn(model, x).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def run(kind: str, config: str, steps: int, warmup: int, quick: bool) -> dict:
    cls, kw = CONFIGS[config]
    model, batch, loss_fn = _model(kind, quick)
    inside_model, _, _ = _model(kind, quick)
    normal = cls(model.parameters(), **kw)
    inside = cls(inside_model.parameters(), **kw)
    lowprec.step_in_backward(inside_model, inside)
    times = {"normal": [], "inside": []}
    for i in range(warmup + steps):
        x = batch(i)
        order = [("normal", model, normal), ("inside", inside_model, inside)]
        if i % 2:
            order.reverse()
        for name, m, o in order:
            t = _step(m, o, loss_fn, x)
            if i >= warmup:
                times[name].append(t)
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(),
                                                 inside_model.parameters(), strict=True))
    ratios = [b / a for a, b in zip(times["normal"], times["inside"], strict=True)]
    return {
        "model": kind, "config": config,
        "params": sum(p.numel() for p in model.parameters()),
        "normal_ms": 1e3 * statistics.median(times["normal"]),
        "inside_ms": 1e3 * statistics.median(times["inside"]),
        "ratio": statistics.median(ratios), "same_bits": same,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=["transformer", "mlp"], default="transformer")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    steps = 3 if args.quick else args.steps
    rows = []
    print(f"{'model':<12} {'config':<18} {'params':>10} {'normal ms':>10} {'inside ms':>10} "
          f"{'inside/normal':>14} same bits")
    for config in args.configs.split(","):
        r = run(args.model, config, steps, 1 if args.quick else args.warmup, args.quick)
        rows.append(r)
        print(f"{r['model']:<12} {r['config']:<18} {r['params']:>10,} {r['normal_ms']:>10.1f} "
              f"{r['inside_ms']:>10.1f} {r['ratio']:>13.3f}x {r['same_bits']}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if all(r["same_bits"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
