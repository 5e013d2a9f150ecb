"""Fused equals eager, bit for bit, on one device: every optimizer x master strategy x dtype.

For each variant (optimizer, ``master=``, parameter dtype, and 8-bit or 4-bit state or a loss
scaler's contract where named) the script steps one optimizer with ``fused=False`` and one with
``fused=True`` from the same parameters and the same gradients, a few steps (a gradient left out
at one step, so that the recorded step is dropped and redone), and compares the parameters, the
gradients and every state tensor bit for bit; then it saves the fused optimizer's
``state_dict``, loads it into a new eager and a new fused optimizer and compares again after a few
more steps. A variant is:

* ``equal``: every bit the same, and the fused runs called compiled kernels, each of which
  compiled and ran (``compiled._Kernel.warm``);
* ``DIFFERS (n of N elements: where)``: some bits differ;
* ``FALLBACK (why)``: a compiled step became eager (tests/_fallback.py's ``fallbacks_are_errors``
  makes each way it can do so raise), or no compiled kernel ran at all. The bits would have
  matched, so this is a failure here, never a pass;
* ``ERROR (exception)``: a step raised;
* ``SKIPPED (why)``: not run within ``--budget-s``.

The exit status is 1 if any variant ran and was not equal (2 for bad arguments), else 0.

On CUDA the kernels are Triton's; on the CPU Inductor's C++ (the pairs path for BF16). The
parameters (``shapes``) reach the step's paths: small and large tensors, shared calls, 8-bit
blocks, more than one compiled call of 8-bit rows. The CPU compiles more slowly, so ``--quick``
(two variants, small tensors only) is what CI runs there. ``--jobs N`` checks
the variants in N processes (each compiles its own kernels; a GPU machine's cores compile in
parallel), ``benchmarks/gpu_check.sh`` runs it so.

    python benchmarks/fused_check.py --device cuda --jobs 4 --json fused.json
    python benchmarks/fused_check.py --quick                 # the CPU, a few variants
    python benchmarks/fused_check.py --list                  # the variants, in the order run
    python benchmarks/fused_check.py --only AdamW/kahan      # those whose name contains it
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
# tests/_fallback.py (what a fallback is: one definition, shared with the test suite) is
# imported from the repository's root; lowprec from src/ where it is not installed.
sys.path.insert(0, str(ROOT))
try:
    import lowprec  # noqa: F401
except ImportError:
    sys.path.insert(0, str(ROOT / "src"))

from tests._fallback import fallbacks_are_errors  # noqa: E402

from lowprec.optim import (  # noqa: E402
    SGD,
    Adafactor,
    Adagrad,
    Adam,
    AdamW,
    Lamb,
    Lion,
    Muon,
    RAdam,
    StableAdamW,
    compiled,
)

#: Optimizer -> (class, keywords): every flag that changes the compiled code on, as
#: tests/test_fused.py steps them.
OPTIMIZERS: dict[str, tuple[type, dict[str, Any]]] = {
    "SGD": (SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)),
    "AdamW": (AdamW, dict(lr=1e-3, amsgrad=True, weight_decay=0.1)),
    "Adagrad": (Adagrad, dict(lr=0.01, weight_decay=0.1, lr_decay=0.01)),
    "Lamb": (Lamb, dict(lr=1e-3, weight_decay=0.01)),
    "Adam": (Adam, dict(lr=1e-3, amsgrad=True, weight_decay=0.1)),
    "RAdam": (RAdam, dict(lr=1e-3, weight_decay=0.1, decoupled_weight_decay=True)),
    "Lion": (Lion, dict(lr=1e-4, weight_decay=0.1)),
    "StableAdamW": (StableAdamW, dict(lr=1e-3, weight_decay=0.01)),
    "Adafactor": (Adafactor, dict(lr=1e-2, weight_decay=0.01)),
    "Muon": (lambda params, **kw: _muon(params, **kw), dict(lr=2e-2, weight_decay=0.1)),
}


def _muon(params: list[torch.Tensor], **kw: Any) -> Muon:
    """Muon for the matrices (compiled around its eager matmuls), AdamW for the rest."""
    return Muon([{"params": [p for p in params if p.dim() == 2]},
                 {"params": [p for p in params if p.dim() != 2], "use_muon": False}], **kw)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MASTERS = ("none", "fp32", "split", "kahan", "stochastic")


@dataclasses.dataclass(frozen=True)
class Variant:
    optimizer: str
    master: str
    dtype: str
    state: str = ""  # "8bit" or "4bit": that state_dtype
    scaled: bool = False  # stepped under a loss scaler's contract (grad_scale, found_inf)

    @property
    def name(self) -> str:
        return "/".join([self.optimizer, self.master, self.dtype,
                         *([self.state] if self.state else []), *(["scaled"] if self.scaled else [])])


def variants() -> list[Variant]:
    """Every variant, most informative first (a run cut short by its budget loses the last):
    each optimizer's BF16 + Kahan (the default for BF16), split, stochastic rounding, 8-bit and
    4-bit state, then the other strategies and FP16, then the loss scaler's kernels."""
    first = [Variant(o, m, "bf16", s) for m, s in (("kahan", ""), ("split", ""),
                                                   ("stochastic", ""), ("kahan", "8bit"),
                                                   ("kahan", "4bit"))
             for o in ("AdamW", "SGD", "Lamb", "Adagrad")]
    first += [Variant(o, "kahan", "bf16") for o in OPTIMIZERS if Variant(o, "kahan", "bf16")
              not in first]
    rest = [Variant(o, m, d) for o in OPTIMIZERS for m in MASTERS for d in ("bf16", "fp16")
            if not (m == "split" and d == "fp16")]  # (split refuses FP16: storage.resolve_master)
    rest += [Variant(o, "none", "fp32") for o in OPTIMIZERS]
    rest += [Variant(o, "split", "bf16", "8bit") for o in OPTIMIZERS]
    rest += [Variant(o, m, "bf16", "4bit") for o in OPTIMIZERS for m in ("kahan", "stochastic")]
    rest += [Variant("AdamW", "kahan", d, scaled=True) for d in ("bf16", "fp16")]
    return first + [v for v in dict.fromkeys(rest) if v not in first]


#: --quick (CI's CPU run, on a cold Inductor cache): the default for BF16 parameters (Kahan
#: AdamW) and the split trail (SGD).
QUICK = ("AdamW/kahan/bf16", "SGD/split/bf16")


def shapes(device: torch.device, quick: bool) -> list[tuple[int, ...]]:
    """Small tensors (gathered in a bucket's pieces): two that 8-bit state quantizes (>= 4096
    elements, whole blocks of 256), an odd length, a 3-d one, one element (stepped eagerly), an
    empty one. Without --quick also large ones: two past 64K elements, and on CUDA one of 33280
    rows of 256, past the 32768 rows of an 8-bit call (``compiled._QROWS``) and several eager
    pieces; on the CPU one of 2112 rows, past its 2048."""
    out = [(128, 72), (64, 144), (33,), (2, 3, 5), (1,), (0,)]
    if not quick:
        out += [(272, 256), (256, 288), (4160, 2048) if device.type == "cuda" else (2112, 256)]
    return out


#: The parameter whose gradient is None at step 1 (the recorded step then no longer applies).
NO_GRAD = (2, 1)
STEPS, RESUMED_STEPS = 4, 3
#: The loss scale of the scaled variants (a power of two: unscaling is exact); at step 2 one
#: gradient holds an inf, so that step is skipped.
SCALE, INF_STEP = 1024.0, 2


def _int_view(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bits as integers of its width, flat (NaN payloads and signed zeros compare)."""
    t = t.detach().reshape(-1)
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _differing(a: Any, b: Any) -> int | str | None:
    """How many elements of ``a`` and ``b`` differ in their bits (0: none), or why they cannot
    be compared (a str); None where neither is a tensor and they are equal."""
    if isinstance(a, torch.Tensor) != isinstance(b, torch.Tensor):
        return "a tensor on one side only"
    if not isinstance(a, torch.Tensor):
        return None if a == b else f"{a!r} != {b!r}"
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"{a.dtype}{tuple(a.shape)} != {b.dtype}{tuple(b.shape)}"
    if a.device != b.device:
        return f"on {a.device} and {b.device}"
    return int((_int_view(a) != _int_view(b)).sum())


def compare(pa: list[torch.Tensor], oa: Any, pb: list[torch.Tensor], ob: Any) -> dict[str, Any]:
    """Parameters, gradients and state of two runs, bit for bit: ``{"elements": N, "differ": n,
    "where": [...]}`` (where: "param 3", "grad 0", "exp_avg of 2", ... with its count)."""
    where: list[str] = []
    total = bad = 0
    for i, (a, b) in enumerate(zip(pa, pb, strict=True)):
        pairs = [(f"param {i}", a, b)]
        if a.grad is not None or b.grad is not None:
            pairs.append((f"grad {i}", a.grad, b.grad))
        sa, sb = oa.state.get(a, {}), ob.state.get(b, {})
        if sa.keys() != sb.keys():
            where.append(f"state keys of {i}: {sorted(sa)} != {sorted(sb)}")
        pairs += [(f"{k} of {i}", sa[k], sb[k]) for k in sa if k in sb]
        for label, x, y in pairs:
            d = _differing(x, y)
            if isinstance(x, torch.Tensor):
                total += x.numel()
            if isinstance(d, str):
                where.append(f"{label}: {d}")
            elif d:
                bad += d
                where.append(f"{label}: {d}")
    return {"elements": total, "differ": bad, "where": where}


@contextlib.contextmanager
def kernels_called() -> Iterator[list[Any]]:
    """Every ``compiled._Kernel`` called inside (one entry per call)."""
    called: list[Any] = []
    real = compiled._Kernel.__call__

    def spy(self, *args, **kwargs):
        called.append(self)
        return real(self, *args, **kwargs)

    compiled._Kernel.__call__ = spy
    try:
        yield called
    finally:
        compiled._Kernel.__call__ = real


def _run(v: Variant, device: torch.device, fused: bool, init: list[torch.Tensor], steps: int,
         seed: int, state: dict | None = None) -> tuple[list[torch.Tensor], Any]:
    """``steps`` steps of ``v`` from ``init`` (and ``state``, a state_dict), with gradients drawn
    on the device from ``seed``."""
    cls, kw = OPTIMIZERS[v.optimizer]
    dtype = DTYPES[v.dtype]
    params = [x.clone().requires_grad_() for x in init]
    opt = cls(params, master=v.master, fused=fused, seed=7, **kw,
              **({"state_dtype": v.state} if v.state else {}))
    if state is not None:
        opt.load_state_dict(copy.deepcopy(state))
        for group in opt.param_groups:  # (the checkpoint's groups bring the saver's "fused")
            group["fused"] = fused
    gen = torch.Generator(device=device).manual_seed(seed)
    scale = SCALE if v.scaled else 1.0
    for step in range(steps):
        for i, p in enumerate(params):
            g = torch.randn(p.shape, generator=gen, device=device).mul_(scale).to(dtype)
            p.grad = None if (i, step) == NO_GRAD else g
        if v.scaled:
            opt.grad_scale = torch.full((), SCALE, device=device)
            opt.found_inf = torch.zeros((), device=device)
            if step == INF_STEP and state is None:
                params[0].grad.view(-1)[5] = float("inf")
        opt.step()
    return params, opt


def check(v: Variant, device: torch.device, quick: bool) -> dict[str, Any]:
    """One variant: ``{"variant", "result", "detail", "seconds", "kernels"}``."""
    t0 = time.perf_counter()
    gen = torch.Generator(device=device).manual_seed(0)
    dtype = DTYPES[v.dtype]
    init = [torch.randn(s, generator=gen, device=device).to(dtype) for s in shapes(device, quick)]
    out: dict[str, Any] = {"variant": v.name, "result": "equal", "detail": "", "kernels": []}
    calls: dict[tuple[str, bool], list[Any]] = {}  # (phase, fused) -> the kernels it called

    def run(phase, fused, *args, **kwargs):
        with kernels_called() as called:
            result = _run(v, device, fused, *args, **kwargs)
        calls[phase, fused] = called
        return result

    try:
        with fallbacks_are_errors():
            runs = [run("first", fused, init, STEPS, seed=1) for fused in (False, True)]
            first = compare(*runs[0], *runs[1])
            # Save the fused run's state, resume both ways from its parameters.
            state = runs[1][1].state_dict()
            mid = [p.detach().clone() for p in runs[1][0]]
            resumed = [run("resumed", fused, mid, RESUMED_STEPS, seed=2, state=state)
                       for fused in (False, True)]
            second = compare(*resumed[0], *resumed[1])
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        fused_calls = calls["first", True] + calls["resumed", True]
        out["kernels"] = sorted({k.name for k in fused_calls})
        cold = sorted({k.name for k in fused_calls if not k.warm})
        if first["differ"] or second["differ"] or first["where"] or second["where"]:
            n = first["differ"] + second["differ"]
            where = [f"after {STEPS} steps: {w}" for w in first["where"]] + [
                f"resumed: {w}" for w in second["where"]]
            out["result"] = "DIFFERS"
            out["detail"] = (f"{n} of {first['elements'] + second['elements']} elements: "
                             + "; ".join(where[:6]) + ("; ..." if len(where) > 6 else ""))
        elif calls["first", False] or calls["resumed", False]:
            # (the comparison would hold compiled code against itself)
            out["result"] = "ERROR"
            out["detail"] = "the eager reference ran compiled kernels"
        elif not calls["first", True] or not calls["resumed", True]:
            out["result"] = "FALLBACK"
            out["detail"] = "no compiled kernel ran in the " + " and the ".join(
                f"{phase} fused run" for phase in ("first", "resumed") if not calls[phase, True])
        elif cold:
            out["result"] = "FALLBACK"
            out["detail"] = f"kernels that never finished a call: {', '.join(cold)}"
    except RuntimeWarning as e:  # (a fallback warning, raised by fallbacks_are_errors)
        out["result"], out["detail"] = "FALLBACK", _first_line(e)
    except AssertionError as e:
        out["result"] = "FALLBACK" if "compiled call" in str(e) else "ERROR"
        out["detail"] = _first_line(e)
    except Exception as e:
        out["result"], out["detail"] = "ERROR", f"{type(e).__name__}: {_first_line(e)}"
    out["seconds"] = round(time.perf_counter() - t0, 2)
    return out


def _first_line(e: BaseException) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return " ".join(lines[:2])[:300] if lines else type(e).__name__


def _cell(r: dict[str, Any]) -> str:
    return r["result"] + (f" ({r['detail']})" if r["detail"] else "")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto",
                   help="auto (CUDA where available, else the CPU), cpu, cuda or cuda:N "
                        "(default: auto)")
    p.add_argument("--quick", action="store_true",
                   help=f"only {', '.join(QUICK)}, without the large tensor")
    p.add_argument("--only", default="",
                   help="comma-separated substrings: only the variants whose name contains one")
    p.add_argument("--jobs", type=int, default=1,
                   help="check the variants in this many processes (default: 1)")
    p.add_argument("--budget-s", type=float, default=float("inf"),
                   help="start no variant after this many seconds; the rest are SKIPPED "
                        "(default: no limit)")
    p.add_argument("--json", metavar="PATH", help="also write the results here")
    p.add_argument("--list", action="store_true", help="print the variants and exit")
    p.add_argument("--shard", help=argparse.SUPPRESS)  # I/N: a --jobs worker's share
    args = p.parse_args(argv)
    if args.jobs < 1:
        p.error("--jobs must be >= 1")
    return args


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _selected(args: argparse.Namespace) -> list[Variant]:
    vs = variants()
    if args.quick:
        vs = [v for v in vs if v.name in QUICK]
    if args.only:
        wanted = [s for s in args.only.split(",") if s]
        vs = [v for v in vs if any(s in v.name for s in wanted)]
    return vs


def _in_workers(args: argparse.Namespace, deadline: float) -> list[dict]:
    """The variants checked by ``args.jobs`` processes of this script (``--shard I/N``), each
    writing its results as JSON; a worker that dies leaves its variants as ERROR."""
    cpus = os.cpu_count() or 1
    env = dict(os.environ)
    # Inductor's compile pool: the cores shared among the workers, not each taking them all.
    env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(max(1, cpus // args.jobs)))
    budget = max(0.0, deadline - time.monotonic())
    base = ["--device", args.device, "--only", args.only, *(["--quick"] if args.quick else [])]
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for i in range(args.jobs):
            out = pathlib.Path(tmp, f"{i}.json")
            cmd = [sys.executable, __file__, *base, "--shard", f"{i}/{args.jobs}",
                   "--budget-s", str(budget), "--json", str(out)]
            procs.append((subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL), out))
        results: dict[str, dict] = {}
        for proc, out in procs:
            proc.wait()
            if out.exists():
                for r in json.loads(out.read_text())["results"]:
                    results[r["variant"]] = r
    return [results.get(v.name) or {"variant": v.name, "result": "ERROR", "seconds": 0.0,
                                    "detail": "its worker process died (see its stderr above)",
                                    "kernels": []} for v in _selected(args)]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.monotonic()
    deadline = start + args.budget_s
    device = _device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"--device {args.device}: this torch sees no CUDA device", file=sys.stderr)
        return 2
    todo = _selected(args)
    if args.list:
        print("\n".join(v.name for v in todo))
        return 0
    if not todo:
        print("no variant matches --only", file=sys.stderr)
        return 2
    worker = args.shard is not None
    if not worker:
        what = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        print(f"fused == eager, bit for bit: {len(todo)} variants on {device} ({what}), torch "
              f"{torch.__version__}, {args.jobs} process(es); {STEPS} steps, state_dict, "
              f"{RESUMED_STEPS} more", flush=True)
    if args.jobs > 1:
        results = _in_workers(args, deadline)
    else:
        if worker:
            i, n = (int(x) for x in args.shard.split("/"))
            todo = todo[i::n]
        results = []
        for v in todo:
            if time.monotonic() > deadline:
                results.append({"variant": v.name, "result": "SKIPPED", "seconds": 0.0,
                                "detail": f"past the budget of {args.budget_s:g} s",
                                "kernels": []})
                continue
            r = check(v, device, args.quick)
            results.append(r)
            # Progress as it goes (stderr): a run killed by a timeout still shows what it did.
            print(f"  {v.name}: {_cell(r)} [{r['seconds']:.1f} s]", file=sys.stderr, flush=True)
    counts = {k: sum(r["result"] == k for r in results)
              for k in ("equal", "DIFFERS", "FALLBACK", "ERROR", "SKIPPED")}
    if not worker:
        width = max(len(r["variant"]) for r in results)
        print(f"{'optimizer/master/dtype':<{width}}  {'s':>6}  result")
        for r in results:
            print(f"{r['variant']:<{width}}  {r['seconds']:>6.1f}  {_cell(r)}")
        print(f"fused check on {device}: " + ", ".join(f"{n} {k}" for k, n in counts.items() if n)
              + f" of {len(results)} ({time.monotonic() - start:.0f} s)")
    if args.json:
        payload = {"device": str(device), "torch": torch.__version__, "counts": counts,
                   "results": results, "seconds": time.monotonic() - start}
        pathlib.Path(args.json).write_text(json.dumps(payload, indent=1))
    bad = counts["DIFFERS"] + counts["FALLBACK"] + counts["ERROR"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
