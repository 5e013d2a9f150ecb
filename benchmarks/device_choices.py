"""The figures behind the optimizers' device-specific choices, on the CPU or a GPU.

Each choice is made per device type in the module that owns it, the CPU's and CUDA's side by
side (docs/architecture.md, "Device choices"). The CPU ones were measured on CPUs; the CUDA ones
were reasoned, not yet measured, and this script measures them (``benchmarks/gpu_check.sh`` runs
it on a GPU):

* ``chunks``: the eager step's piece size (``update._EAGER_CHUNKS``: 2**16 elements on the CPU,
  2**22 on CUDA) against 2**16, 2**22 and whole tensors: time and the step's peak of temporaries;
* ``rows``: rows of 256 per compiled call of a parameter with 8-bit state (``compiled._QROWS``:
  2048 on the CPU, 32768 on CUDA) against 2048, 32768 and the whole tensor;
* ``transfers`` (CUDA): what a fused step sends to the GPU and waits for. The coefficients and
  random keys go to the kernels as CPU 0-d tensors, which Inductor passes as scalar arguments: a
  step should copy nothing to the device and never synchronize (counted with torch.profiler);
* ``sqrt``: compiled code takes the FP32 square root directly (``numerics.sqrt_rn``), the eager
  step through FP64; the count of roots that differ, over 2**24 random values and the edges.

Batching small parameters is ``benchmarks/fast_path.py --device cuda``'s ``batches`` column.

    python benchmarks/device_choices.py --device cuda
    python benchmarks/device_choices.py --quick        # a smoke run on the CPU
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

import lowprec
from lowprec.numerics import COMPILED_AS_EAGER, sqrt_rn
from lowprec.optim import compiled, update


@contextlib.contextmanager
def _setting(module: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


def _timed(step: Callable[[], Any], device: torch.device, steps: int) -> dict[str, float]:
    """Median wall time of ``step`` (synchronized on CUDA) and the peak of what it allocated
    beyond what was allocated before it (CUDA's allocator; None on the CPU)."""
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    step()  # (warm: state, compilation)
    times = []
    for _ in range(steps):
        sync()
        t = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t)
    peak = None
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        step()
        sync()
        peak = (torch.cuda.max_memory_allocated(device) - before) / 2**20
    return {"ms": 1e3 * statistics.median(times), "peak_mib": peak}


def _adamw(numel: int, device: torch.device, **kw: Any) -> Callable[[], Any]:
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(numel, generator=gen).mul_(0.02).to(device, torch.bfloat16).requires_grad_()
    p.grad = torch.randn(numel, generator=gen).mul_(1e-3).to(device, torch.bfloat16)
    return lowprec.AdamW([p], lr=1e-3, master="kahan", **kw).step


def chunks(numel: int, device: torch.device, steps: int) -> list[dict[str, Any]]:
    rows = []
    for chunk in (1 << 16, 1 << 22, numel):
        with _setting(update, "_EAGER_CHUNKS", {"cpu": chunk, "cuda": chunk}):
            r = _timed(_adamw(numel, device, fused=False), device, steps)
        rows.append({"chunk": chunk, **r,
                     "chosen": chunk == update._eager_chunk(device)})
    return rows


def qrows(numel: int, device: torch.device, steps: int) -> list[dict[str, Any]]:
    rows, blocks = [], numel // 256
    chosen = compiled._QROWS.get(device.type, compiled._QROWS["cuda"])
    for n in (2048, 1 << 15, blocks):
        with _setting(compiled, "_QROWS", {"cpu": n, "cuda": n}):
            r = _timed(_adamw(numel, device, fused=True, state_dtype="8bit"), device, steps)
        rows.append({"rows": n, **r, "chosen": n == chosen})
    return rows


def transfers(device: torch.device) -> dict[str, Any]:
    """Copies to the device and synchronizations in a redone fused step (plain and scaled) of
    a few large and small BF16 parameters."""
    from torch.profiler import ProfilerActivity, profile

    gen = torch.Generator().manual_seed(0)
    shapes = [(1024, 1024), (4096, 256), (1024,), (256,), (1024,)]
    params = [torch.randn(s, generator=gen).to(device, torch.bfloat16).requires_grad_()
              for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt = lowprec.AdamW(params, lr=1e-3, master="kahan", fused=True)
    scale = torch.tensor(1024.0, device=device)
    found = torch.zeros((), device=device)
    out = {}
    for name, step in (("plain", opt.step),
                       ("scaled", lambda: opt.step(grad_scale=scale, found_inf=found))):
        for _ in range(3):  # (compiled, recorded, redone)
            step()
        torch.cuda.synchronize(device)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize(device)
        events = [e.name for e in prof.events()]
        out[name] = {
            "host_to_device_copies": sum("HtoD" in e or e == "cudaMemcpyAsync" for e in events),
            "synchronizations": sum(e in ("cudaStreamSynchronize", "cudaDeviceSynchronize")
                                    for e in events) - 1,  # (less the profiler's own)
            "kernels": sum(e.startswith(("triton_", "void ")) for e in events),
        }
    return out


def sqrt_check(device: torch.device, n: int) -> dict[str, Any]:
    """Roots of FP32 values taken as the compiled step takes them, and eagerly in FP32, each
    against the correctly rounded root (FP64, rounded once)."""
    gen = torch.Generator().manual_seed(0)
    bits = torch.randint(0, 0x7F800000, (n,), generator=gen, dtype=torch.int32)  # finite, >= 0
    edges = torch.tensor([0.0, 1e-45, 1.1754942e-38, 1.17549435e-38, 1.0, 2.0, 3.4028235e38,
                          float("inf")], dtype=torch.float32)
    x = torch.cat([bits.view(torch.float32), edges]).to(device)
    exact = sqrt_rn(x)  # (eager: through FP64)
    fn = torch.compile(sqrt_rn, dynamic=True, fullgraph=True,
                       options={"emulate_precision_casts": True, **COMPILED_AS_EAGER})
    differ = lambda y: int((y.view(torch.int32) != exact.view(torch.int32)).sum())  # noqa: E731
    return {"values": x.numel(), "compiled_differs": differ(fn(x)),
            "eager_fp32_differs": differ(torch.sqrt(x))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="auto", help="auto (CUDA where available), cpu, cuda[:N]")
    ap.add_argument("--millions", type=float, default=None,
                    help="elements of the stepped parameter (default: 64 on CUDA, 8 on the CPU)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per row (default: 10)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default: 2)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 1M elements, 2 steps")
    ap.add_argument("--json", type=pathlib.Path, help="also write the results here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    spec = "cuda" if args.device == "auto" and torch.cuda.is_available() else args.device
    device = torch.device("cpu" if spec == "auto" else spec)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: this torch sees no CUDA device")
    millions = args.millions or (64.0 if device.type == "cuda" else 8.0)
    if args.quick:
        millions, args.steps = 1.0, 2
    numel = max(256, int(millions * 2**20) // 256 * 256)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device choices on {where}: torch {torch.__version__}, AdamW BF16 + Kahan, "
          f"{numel / 2**20:g}M elements, {args.steps} timed steps per row")
    results: dict[str, Any] = {"device": where, "torch": torch.__version__, "numel": numel}
    results["chunks"] = chunks(numel, device, args.steps)
    print("eager step, elements per piece (update._EAGER_CHUNKS):")
    for r in results["chunks"]:
        peak = "" if r["peak_mib"] is None else f", temporaries {r['peak_mib']:.0f} MiB"
        print(f"  {r['chunk']:>10}: {r['ms']:8.2f} ms{peak}{'  <- chosen' if r['chosen'] else ''}")
    results["rows"] = qrows(numel, device, args.steps)
    print("fused step with 8-bit state, rows per compiled call (compiled._QROWS):")
    for r in results["rows"]:
        peak = "" if r["peak_mib"] is None else f", temporaries {r['peak_mib']:.0f} MiB"
        print(f"  {r['rows']:>10}: {r['ms']:8.2f} ms{peak}{'  <- chosen' if r['chosen'] else ''}")
    if device.type == "cuda":
        results["transfers"] = transfers(device)
        print("a redone fused step's copies to the device and synchronizations (want 0 and 0):")
        for name, r in results["transfers"].items():
            print(f"  {name:>6}: {r['host_to_device_copies']} copies, {r['synchronizations']} "
                  f"synchronizations, {r['kernels']} kernels")
    results["sqrt"] = sqrt_check(device, 1 << (16 if args.quick else 24))
    s = results["sqrt"]
    print(f"FP32 square roots differing from the correctly rounded ones, of {s['values']}: "
          f"compiled {s['compiled_differs']} (want 0), eager FP32 {s['eager_fp32_differs']}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
        print(f"wrote {args.json}")
    return 1 if s["compiled_differs"] else 0


if __name__ == "__main__":
    sys.exit(main())
