"""The first steps' time of a GPT-2-small-sized model's optimizer (148 tensors, 124M parameters):
what compiling the default step costs, with an empty Inductor cache and with a warm one.

Issue 53's bound: a cold first step of these 148 tensors in at most 15 s on a 2-core CPU, a warm
one in at most 2 s (issue 39's: 60 and 10 s). The first step lays the buckets out and runs
their kernels; the later steps run them again. Each
measurement runs in a new process (Dynamo's in-memory caches empty), the cold one with a new
``TORCHINDUCTOR_CACHE_DIR``, the warm one with the folder the cold run filled. Per row it
prints the wall time of steps 1, 2 and 3 and of a later step. A third run, ``loaded``, is warm
in a process that compiled a one-line function first, as one that compiles its model has: what
any first compile in a process costs (Inductor's imports, its vector-ISA probes, which start six
Python processes) is paid there, and the first step shows lowprec's own share.

    python benchmarks/compile_time.py                     # every row: AdamW plain, scaled, 8-bit; LAMB
    python benchmarks/compile_time.py --rows adamw-kahan  # one row
    python benchmarks/compile_time.py --rows lamb-kahan   # LAMB: its buckets' rows kernels

``adamw-kahan-groups`` puts the parameters in the two groups Hugging Face's Trainer makes
(weight decay on the matrices, none on the biases and norms): one kernel for both since weight
decay became a coefficient, two before. ``adamw-stochastic``: stochastic rounding, whose
kernel hashes each element's index for its random bits (the largest kernel of the step: its
Inductor settings, ``optim.compiled._compiled_kernel``).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
ROWS = ("adamw-kahan", "adamw-kahan-groups", "adamw-kahan-scaled", "adamw-kahan-8bit",
        "adamw-stochastic", "lamb-kahan")


def gpt2_small_shapes() -> list[tuple[int, ...]]:
    """GPT-2 small's parameter shapes (Hugging Face's layout: Conv1D weights in x out)."""
    d, layers, vocab, ctx = 768, 12, 50257, 1024
    block = [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,),
             (4 * d, d), (d,)]
    return [(vocab, d), (ctx, d), *block * layers, (d,), (d,)]


def child(row: str, steps: int, loaded: bool) -> None:
    """One row's first steps in this process: prints their wall times as JSON."""
    import torch

    sys.path.insert(0, str(ROOT / "src"))
    import lowprec

    torch.set_num_threads(2)
    if loaded:  # (a process's first compile: what the "loaded" run leaves out)
        torch.compile(lambda x: x * 2)(torch.ones(4))
    gen = torch.Generator().manual_seed(0)
    params = [(torch.randn(s, generator=gen) * 0.02).to(torch.bfloat16).requires_grad_()
              for s in gpt2_small_shapes()]
    kw = {"state_dtype": "8bit"} if row.endswith("8bit") else {}
    cls = lowprec.Lamb if row.startswith("lamb") else lowprec.AdamW
    groups: list = params
    if row.endswith("groups"):  # (Hugging Face Trainer's groups: no decay on biases and norms)
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.01},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    opt = cls(groups, lr=1e-4, master=row.split("-")[1], **kw)
    scaled = row.endswith("scaled")
    times = []
    for _ in range(steps):
        for p in params:
            p.grad = (torch.randn(p.shape, generator=gen) * 1e-3).to(torch.bfloat16)
        start = time.perf_counter()
        if scaled:
            opt.step(grad_scale=torch.ones(()), found_inf=torch.zeros(()))
        else:
            opt.step()
        times.append(time.perf_counter() - start)
    print(json.dumps({"row": row, "tensors": len(params),
                      "params": sum(p.numel() for p in params), "times": times}))


def run(row: str, steps: int, cache: str, which: str) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
    out = subprocess.run([sys.executable, __file__, "--child", row, "--steps", str(steps),
                          *(["--loaded"] if which == "loaded" else [])],
                         env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--loaded", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.steps, args.loaded)
        return
    rows = args.rows.split(",")
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        ap.error(f"unknown rows {unknown}; choose from {', '.join(ROWS)}")
    cpu = subprocess.run(["bash", str(ROOT / ".ci" / "cpu.sh"), sys.executable],
                         capture_output=True, text=True).stdout.strip()
    print(cpu)
    print(f"{'row':20s} {'cache':6s} {'step 1 s':>9s} {'step 2 s':>9s} {'step 3 s':>9s} "
          f"{'last ms':>8s}")
    for row in rows:
        with tempfile.TemporaryDirectory(prefix="lowprec-inductor-") as cache:
            for which in ("cold", "warm", "loaded"):
                r = run(row, args.steps, cache, which)
                t = r["times"]
                print(f"{row:20s} {which:6s} {t[0]:9.1f} {t[1]:9.1f} {t[2]:9.1f} "
                      f"{t[-1] * 1e3:8.0f}", flush=True)
    print(f"({r['tensors']} tensors, {r['params'] / 1e6:.0f}M parameters, BF16, 2 threads)")


if __name__ == "__main__":
    main()
