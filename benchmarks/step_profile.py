"""Where an optimizer step's time goes: the host's launch time, the device's kernel time and the
kernels themselves, for lowprec's step beside torch's fused AdamW, on the benchmark's layout.

``optimizer_step.py`` says how fast a step is; this says why. Per configuration it prints

* ``wall``: a step from launch to the device's end (synchronized), median of the timed steps;
* ``host``: the time ``step()`` takes to return, unsynchronized (on a GPU: the host's work of
  launching; where it is close to ``wall`` the step is bound by the host, not the device);
* ``kernels`` and ``device``: kernels per step and their summed time (torch.profiler);
* ``GB/s``: the bytes a step must move (parameters, gradients and state, read and written)
  over the device time, beside the copy bandwidth measured in the same run;

then each configuration's costliest operations (torch.profiler's table). On the CPU it runs too
(the device column is then the operators' own time).

    python benchmarks/step_profile.py --device cuda                # 100M parameters
    python benchmarks/step_profile.py --params-millions 2 --steps 3  # a smoke run on the CPU
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "src"))
import lowprec
from optimizer_step import BaseTensors, layout

# name -> (parameter dtype, factory, bytes per element a step reads and writes)
CONFIGS = {
    "torch-fp32-fused": (torch.float32, lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
                         4 + 4 + 4 + 4 * 4),  # grad read; param, m, v read and written
    "torch-bf16-fused": (torch.bfloat16, lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
                         2 + 2 * 2 + 2 * 2 * 2),
    "lowprec-kahan": (torch.bfloat16, lambda ps: lowprec.AdamW(ps, lr=1e-3, master="kahan"),
                      2 + 2 * 2 + 2 * 2 + 4 * 4),  # grad; param, compensation; m, v
    "lowprec-kahan-eager": (torch.bfloat16,
                            lambda ps: lowprec.AdamW(ps, lr=1e-3, master="kahan", fused=False),
                            2 + 2 * 2 + 2 * 2 + 4 * 4),
    "lowprec-kahan-scaled": (torch.bfloat16, "scaled", 2 * 2 + 2 * 2 + 2 * 2 + 4 * 4),
}


def _make(name: str, params: list[torch.Tensor], device: str) -> torch.optim.Optimizer:
    factory = CONFIGS[name][1]
    if factory == "scaled":  # (GradScaler's contract: gradients unscaled in the step, written back)
        opt = lowprec.AdamW(params, lr=1e-3, master="kahan")
        opt.grad_scale = torch.ones((), device=device)
        opt.found_inf = torch.zeros((), device=device)
        return opt
    return factory(params)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _attr(e, *names: str) -> float:
    for n in names:
        v = getattr(e, n, None)
        if v is not None:
            return float(v)
    return 0.0


def measure(name: str, base: BaseTensors, device: str, steps: int, top: int, warmup: int,
            n_prof: int) -> dict:
    dtype = CONFIGS[name][0]
    params = base.params(dtype)
    opt = _make(name, params, device)
    for _ in range(warmup):  # (compiles the buckets' kernels)
        opt.step()
    _sync(device)
    walls, hosts = [], []
    for _ in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        opt.step()
        t1 = time.perf_counter()
        _sync(device)
        t2 = time.perf_counter()
        hosts.append(t1 - t0)
        walls.append(t2 - t0)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(n_prof):
            opt.step()
        _sync(device)
    avgs = prof.key_averages()
    if device == "cuda":
        # (the device's kernels and copies: not the annotations the profiler also places on
        # the device's timeline, such as "Optimizer.step#AdamW.step", which span the others)
        kernels = [e for e in prof.events()
                   if str(getattr(e, "device_type", "")).endswith("CUDA")
                   and not getattr(e, "is_user_annotation", False)
                   and not e.name.startswith(("Optimizer.", "ProfilerStep"))]
        device_us = sum(_attr(e, "device_time", "cuda_time") for e in kernels) / n_prof
        n_kernels = len(kernels) / n_prof
        sort = "self_device_time_total" if hasattr(avgs[0], "self_device_time_total") \
            else "self_cuda_time_total"
    else:
        device_us = sum(_attr(e, "self_cpu_time_total") for e in avgs) / n_prof
        n_kernels = sum(e.count for e in avgs) / n_prof
        sort = "self_cpu_time_total"
    numel = sum(p.numel() for p in params)
    gbs = numel * CONFIGS[name][2] / (device_us * 1e-6) / 1e9 if device_us else float("nan")
    table = avgs.table(sort_by=sort, row_limit=top, max_name_column_width=70)
    del opt, params
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"name": name, "wall_ms": 1e3 * statistics.median(walls),
            "host_ms": 1e3 * statistics.median(hosts), "kernels": n_kernels,
            "device_ms": device_us / 1e3, "gbs": gbs, "table": table}


def copy_bandwidth(device: str, n: int) -> float:
    a = torch.empty(n, device=device)
    b = torch.empty(n, device=device)
    for _ in range(3):
        b.copy_(a)
    _sync(device)
    t = []
    for _ in range(10):
        t0 = time.perf_counter()
        b.copy_(a)
        _sync(device)
        t.append(time.perf_counter() - t0)
    return 2 * 4 * n / statistics.median(t) / 1e9


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--params-millions", type=float, default=100.0)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3,
                    help="untimed steps first (the compiled step compiles)")
    ap.add_argument("--profile-steps", type=int, default=3, help="steps under torch.profiler")
    ap.add_argument("--top", type=int, default=12, help="rows of each profiler table")
    args = ap.parse_args(argv)
    torch.set_default_device(None)
    d, blocks, shapes = layout(args.params_millions)
    base = BaseTensors.make(shapes)
    import optimizer_step
    optimizer_step.DEVICE = args.device  # (BaseTensors.params puts them there)
    names = [c for c in args.configs.split(",") if c]
    unknown = [c for c in names if c not in CONFIGS]
    if unknown:
        ap.error(f"unknown configs {unknown}; choose from {', '.join(CONFIGS)}")
    dev = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    n = sum(v.numel() for v in base.values)
    bw = copy_bandwidth(args.device, 1 << 26)
    print(f"step profile on {dev}, torch {torch.__version__}: {n / 1e6:.1f}M parameters in "
          f"{len(shapes)} tensors (d_model {d}, {blocks} blocks); copy {bw:.0f} GB/s")
    results = []
    for name in names:
        try:
            results.append(measure(name, base, args.device, args.steps, args.top, args.warmup,
                                   args.profile_steps))
        except Exception as e:  # (one configuration's failure is reported, the rest run)
            print(f"{name}: FAILED {type(e).__name__}: {str(e)[:300]}")
    print(f"{'config':24} {'wall ms':>8} {'host ms':>8} {'kernels':>8} {'device ms':>9} "
          f"{'GB/s':>7}")
    for r in results:
        print(f"{r['name']:24} {r['wall_ms']:8.2f} {r['host_ms']:8.2f} {r['kernels']:8.0f} "
              f"{r['device_ms']:9.2f} {r['gbs']:7.0f}")
    for r in results:
        print(f"\n== {r['name']}\n{r['table']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
