"""A step's host calls and time against the number of tensors: lowprec's buckets, the step without
them, and torch's fused FP32 optimizers, measured in the same run.

Per layout and row it prints

* ``calls``: the operator calls and compiled-region calls one ``step()`` makes from Python
  (torch.profiler events not inside another operator or compiled region; on a GPU each is at
  least a launch or a host round trip);
* ``events``: every profiler event of the step, nested ones too (torch's CPU fused AdamW loops
  over its tensors inside one operator: one call, seven events per tensor);
* ``ms``: the median wall time of a step, and ``x torch``: the median of the per-round ratios to
  torch's fused FP32 optimizer of the same family, timed in the same round (rows interleaved,
  one step each per round: these machines are shared, and their speed drifts within seconds).

Layouts: ``N x E`` is N tensors of E elements; ``25M`` is ``optimizer_step.py``'s transformer
layout. Rows: ``buckets`` is lowprec's default step (``lowprec.optim.buckets``), ``per-tensor``
the same optimizer with buckets turned off (every parameter's full step, eager per tensor: what
takes the step where the buckets decline, a buffer an option turned on; before issue 53 a
compiled call per tensor, and the recorded step, batches and shared calls), ``eager`` the default step without
``torch.compile``, ``scaled`` the default step under the loss-scaler contract (``grad_scale`` and
``found_inf`` set as GradScaler sets them), ``8bit`` with 8-bit moments; ``lamb`` and
``stable-adamw`` (rules with whole-tensor sums, in buckets as rows of equal-sized parameters)
against torch's fused AdamW, the nearest torch has.

    python benchmarks/step_calls.py                       # 16 x 4096, 512 x 4096, 25M
    python benchmarks/step_calls.py --layouts 512x4096 --rounds 40
    python benchmarks/step_calls.py --device cuda --layouts 128x781250   # issue 39's GPU row
    python benchmarks/step_calls.py --gpu-shape --layouts 16x4096,512x4096  # a GPU's calls, here

``--gpu-shape`` steps on the CPU as a GPU does (no pairs kernel, and a scaled step's inf/NaN
check on the device: ``tests/test_gpu_shape.py``'s switches), to count the calls a GPU's step would make;
its times are not a GPU's.
"""

from __future__ import annotations

import argparse
import contextlib
import pathlib
import statistics
import subprocess
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "src"))
import lowprec
from lowprec.optim import driver
from optimizer_step import layout


def _adamw_kahan(**kw):
    return lambda ps: lowprec.AdamW(ps, lr=1e-3, master="kahan", **kw)


# name -> (family, parameter dtype, factory, buckets on, under a loss scaler)
ROWS = {
    "torch-adamw-fp32": ("adamw", torch.float32,
                         lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True), True, False),
    "adamw-kahan": ("adamw", torch.bfloat16, _adamw_kahan(fused=True), True, False),
    "adamw-kahan-per-tensor": ("adamw", torch.bfloat16, _adamw_kahan(fused=True), False, False),
    "adamw-kahan-eager": ("adamw", torch.bfloat16, _adamw_kahan(fused=False), True, False),
    "adamw-kahan-scaled": ("adamw", torch.bfloat16, _adamw_kahan(fused=True), True, True),
    "adamw-kahan-scaled-per-tensor": ("adamw", torch.bfloat16, _adamw_kahan(fused=True), False,
                                      True),
    "adamw-kahan-8bit": ("adamw", torch.bfloat16, _adamw_kahan(fused=True, state_dtype="8bit"),
                         True, False),
    "adamw-kahan-8bit-per-tensor": ("adamw", torch.bfloat16,
                                    _adamw_kahan(fused=True, state_dtype="8bit"), False, False),
    "adamw-stochastic": ("adamw", torch.bfloat16,
                         lambda ps: lowprec.AdamW(ps, lr=1e-3, master="stochastic", fused=True),
                         True, False),
    "lamb-kahan": ("adamw", torch.bfloat16,
                   lambda ps: lowprec.Lamb(ps, lr=1e-3, master="kahan", fused=True), True, False),
    "lamb-kahan-per-tensor": ("adamw", torch.bfloat16,
                              lambda ps: lowprec.Lamb(ps, lr=1e-3, master="kahan", fused=True),
                              False, False),
    "stable-adamw-kahan": ("adamw", torch.bfloat16,
                           lambda ps: lowprec.StableAdamW(ps, lr=1e-3, master="kahan", fused=True),
                           True, False),
    "torch-sgd-fp32": ("sgd", torch.float32,
                       lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9, fused=True), True,
                       False),
    "sgd-split": ("sgd", torch.bfloat16,
                  lambda ps: lowprec.SGD(ps, lr=1e-3, momentum=0.9, master="split", fused=True),
                  True, False),
    "sgd-split-per-tensor": ("sgd", torch.bfloat16,
                             lambda ps: lowprec.SGD(ps, lr=1e-3, momentum=0.9, master="split",
                                                    fused=True), False, False),
}
REFERENCE = {"adamw": "torch-adamw-fp32", "sgd": "torch-sgd-fp32"}


def shapes_of(name: str) -> list[tuple[int, ...]]:
    if name.upper().endswith("M"):
        return [s for _, s in layout(float(name[:-1]))[2]]
    n, e = name.lower().split("x")
    return [(int(e),)] * int(n)


@contextlib.contextmanager
def buckets_off(off: bool):
    """The step without buckets (``driver.step_buckets`` declining, ``flatten`` a no-op)."""
    if not off:
        yield
        return
    real = driver.step_buckets, driver.flatten
    driver.step_buckets, driver.flatten = (lambda opt, *ctx: False), (lambda opt, *fresh: None)
    try:
        yield
    finally:
        driver.step_buckets, driver.flatten = real


def host_calls(step) -> tuple[int, int]:
    """(calls, events) of one ``step()``: see the module docstring."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    events = prof.events()

    def counted(e):
        return e.name.startswith("aten::") or "Compiled" in e.name

    def nested(e):
        q = e.cpu_parent
        while q is not None:
            if counted(q):
                return True
            q = q.cpu_parent
        return False

    return sum(1 for e in events if counted(e) and not nested(e)), len(events)


def run_layout(name: str, rows: list[str], rounds: int, warmup: int, device: str) -> None:
    shapes = shapes_of(name)
    gen = torch.Generator().manual_seed(0)
    values = [(torch.randn(s, generator=gen) * 0.02).to(device) for s in shapes]
    grads = [(torch.randn(s, generator=gen) * 1e-3).to(device) for s in shapes]
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    made = {}
    for row in rows:
        _, dtype, factory, on, scaled = ROWS[row]
        params = [v.to(dtype, copy=True).requires_grad_() for v in values]
        for p, g in zip(params, grads, strict=True):
            p.grad = g.to(dtype)
        opt = factory(params)
        if scaled:  # (the loss-scaler contract's inputs, as GradScaler sets them)
            opt.grad_scale = torch.ones((), device=device)
            opt.found_inf = torch.zeros((), device=device)
        with buckets_off(not on):
            for _ in range(warmup):  # (state, compiled kernels, buckets laid out)
                opt.step()
            calls = host_calls(opt.step)
        made[row] = (opt, on, calls)
    times: dict[str, list[float]] = {row: [] for row in rows}
    for _ in range(rounds):  # (interleaved: a step of every row per round)
        for row in rows:
            opt, on, _ = made[row]
            with buckets_off(not on):
                sync()
                start = time.perf_counter()
                opt.step()
                sync()
                times[row].append(time.perf_counter() - start)
    n = sum(v.numel() for v in values)
    print(f"\n{name}: {len(shapes)} tensors, {n / 1e6:.2f}M parameters")
    print(f"{'row':24s} {'calls':>6s} {'events':>7s} {'ms':>8s} {'x torch':>8s}")
    for row in rows:
        ref = REFERENCE[ROWS[row][0]]
        ratio = (statistics.median(a / b for a, b in zip(times[row], times[ref], strict=True))
                 if ref in times else float("nan"))
        calls, events = made[row][2]
        print(f"{row:24s} {calls:6d} {events:7d} {statistics.median(times[row]) * 1e3:8.2f} "
              f"{ratio:8.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layouts", default="16x4096,512x4096,25M")
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    ap.add_argument("--gpu-shape", action="store_true",
                    help="on the CPU, step as a GPU does (no pairs kernel, no host check)")
    args = ap.parse_args()
    if args.gpu_shape:
        from lowprec.optim import compiled

        compiled.pairs_device = lambda device: False
        driver.skipped_on_host = lambda *args, **kwargs: None
    torch.set_num_threads(args.threads)
    rows = args.rows.split(",")
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        ap.error(f"unknown rows {unknown}; choose from {', '.join(ROWS)}")
    # (the CPU's model, family and vector ISA: CI's own line)
    cpu = pathlib.Path(__file__).resolve().parents[1] / ".ci" / "cpu.sh"
    print(subprocess.run(["bash", str(cpu), sys.executable], capture_output=True,
                         text=True).stdout.strip(), f"; torch {torch.__version__}")
    for name in args.layouts.split(","):
        run_layout(name, rows, args.rounds, args.warmup, args.device)


if __name__ == "__main__":
    main()
