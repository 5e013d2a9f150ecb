"""The compiled kernels one configuration of the step asks for: optimizer x master x state
format x loss-scaler mode, over a model of many shapes (small tensors gathered into a bucket's
pieces, one large enough for a call of its own, odd and even sizes, matrices and vectors) and a
few steps under a learning-rate schedule.

A scaled configuration is counted twice: as the CPU takes it (the gradients unscaled in place on
the host, then the plain step: ``loss_scale.skipped_on_host``, so the plain step's kernels) and
as a GPU or ``capturable=True`` takes it (the scaler's inputs in the kernels: kernels of their
own).

Each distinct ``compiled._compiled_kernel`` key is a graph Inductor compiles (its shapes are
dynamic: one graph serves every size, but for Inductor's specialisation on a length that is a
multiple of its vector width, which ``tests/test_fused.py`` bounds). Here ``torch.compile`` is
replaced by the function itself, so the whole matrix runs in seconds and counts the kernels'
keys, not their compile times; ``benchmarks/compile_time.py`` times the compiles.

    python benchmarks/kernel_families.py             # the table, and the families' totals
    python benchmarks/kernel_families.py --max 2     # exit 1 where a configuration asks for more
    python benchmarks/kernel_families.py --optimizers adamw,lamb

``tests/test_fused.py`` checks the counts per kind of rule (``expected``).
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "src"))
import lowprec
from lowprec.optim import compiled

#: (class, keywords): every optimizer; Muon's vectors take AdamW's rule (a group of their own).
OPTIMIZERS = {
    "sgd": (lowprec.SGD, {"lr": 1e-2, "momentum": 0.9}),
    "adamw": (lowprec.AdamW, {"lr": 1e-3}),
    "adam": (lowprec.Adam, {"lr": 1e-3}),
    "radam": (lowprec.RAdam, {"lr": 1e-3}),
    "adagrad": (lowprec.Adagrad, {"lr": 1e-2}),
    "lion": (lowprec.Lion, {"lr": 1e-4}),
    "lamb": (lowprec.Lamb, {"lr": 1e-3}),
    "stable_adamw": (lowprec.StableAdamW, {"lr": 1e-3}),
    "adafactor": (lowprec.Adafactor, {"lr": 1e-2}),
    "muon": (lowprec.Muon, {"lr": 1e-2}),
}
MASTERS = ("kahan", "split", "stochastic")
STATES = (None, "8bit")
#: Many small matrices and vectors (one bucket's gathered pieces), two equal-sized ones, one of
#: 2^21 elements (a piece of its own), odd sizes (stepped on their own).
SHAPES = [(64, 32)] * 6 + [(128,)] * 6 + [(256, 256)] * 2 + [(2048, 1024), (7,), (33, 3)]


def _optimizer(name: str, params: list[torch.Tensor], master: str, state: str | None,
               capturable: bool = False):
    cls, options = OPTIMIZERS[name]
    groups: object = params
    if name == "muon":
        groups = [{"params": [p for p in params if p.dim() == 2]},
                  {"params": [p for p in params if p.dim() != 2], "use_muon": False}]
    return cls(groups, master=master, state_dtype=state, fused=True, seed=1,
               capturable=capturable, **options)


def expected(name: str, master: str, state: str | None) -> int:
    """The kernels one configuration asks for, by its kind of rule: an elementwise rule one (the
    elementwise kernel, or the pairs kernel for split and stochastic rounding), and stochastic
    rounding a second for the gathered pieces' per-word keys; a rule with norms twice as many
    (a sums pass and an update pass), each for a parameter alone and for a piece's rows;
    8-bit state one more per pass (the codes' rows); Adafactor one per number of dimensions;
    Muon its whole-tensor graph and its AdamW group's. Plain and scaled alike (a scaled step
    with its counts on the device has kernels of its own; on the CPU it takes the plain ones)."""
    if name == "adafactor":
        return 2
    keyed = master == "stochastic"
    if name == "muon":
        return 2 + keyed
    if name in ("lamb", "stable_adamw"):
        return 4 + 2 * (state is not None)
    return 1 + keyed + (state is not None)


def census(name: str, master: str, state: str | None, scaled: bool, steps: int = 3,
           capturable: bool = False):
    """The kernels' names one configuration asks for in ``steps`` steps (``torch.compile``
    replaced by the function itself: see ``main``); ``capturable``: a scaled step's inputs in the
    kernels, as on a GPU."""
    compiled._KERNELS.clear()
    gen = torch.Generator().manual_seed(0)
    params = [(torch.randn(s, generator=gen) * 0.1).bfloat16().requires_grad_() for s in SHAPES]
    opt = _optimizer(name, params, master, state, capturable)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    for _ in range(steps):
        for p in params:
            p.grad = (torch.randn(p.shape, generator=gen) * (256 if scaled else 1)).bfloat16()
        if scaled:
            opt.step(grad_scale=torch.tensor(256.0), found_inf=torch.zeros(()))
        else:
            opt.step()
        sched.step()
    return sorted(k.name for k in compiled._KERNELS.values())


#: (scaled, capturable, the table's label): plain; scaled on the CPU; scaled as on a GPU.
MODES = ((False, False, "no"), (True, False, "host"), (True, True, "device"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max", type=int, default=0,
                    help="exit 1 where a configuration asks for more kernels than this")
    ap.add_argument("--optimizers", default=",".join(OPTIMIZERS),
                    help="comma-separated, of: " + ", ".join(OPTIMIZERS))
    args = ap.parse_args()
    torch.compile = lambda fn, **_: fn  # (the kernels' keys are counted, nothing compiled)
    families: collections.Counter[str] = collections.Counter()
    over = []
    print(f"{'optimizer':<13} {'master':<11} {'state':<5} {'scaled':<6} kernels  names")
    for name in args.optimizers.split(","):
        for master in MASTERS:
            for state in STATES:
                for scaled, capturable, mode in MODES:
                    names = census(name, master, state, scaled, capturable=capturable)
                    short = [n.split(f"_{master}", 1)[-1].lstrip("_") for n in names]
                    families.update(short)
                    print(f"{name:<13} {master:<11} {state or '-':<5} {mode:<6} "
                          f"{len(names):>7}  {' '.join(short)}")
                    if args.max and len(names) > args.max:
                        over.append((name, master, state, scaled, len(names)))
    print(f"\n{sum(families.values())} kernels in all; by family:")
    for fam, n in families.most_common():
        print(f"  {n:>4}  {fam}")
    if over:
        print(f"\n{len(over)} configurations ask for more than {args.max}:")
        for row in over:
            print("  ", *row)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
