"""The ``lowprec`` command: ``compare``, ``memory`` and ``numerics``.

The numbers come from ``lowprec.compare``, ``lowprec.memory`` and ``lowprec.demos``, which print
nothing; ``lowprec.cli_parser`` holds the options (argparse, torch-free), ``lowprec.cli_compare``
the compare command's progress, table and notes, and this module the rest: the shared output
helpers, ``memory``, ``numerics`` and ``main`` (rich for tables; ``lowprec.plot`` draws the
picture, matplotlib, headless). A user mistake (an unknown recipe, a
negative step count) ends with one ``lowprec: error: ...`` line and exit status 2, never a
traceback; Ctrl-C during ``compare`` prints the recipes measured so far, saves them, and exits
with status 130.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lowprec import __version__, config
from lowprec.cli_parser import build_parser

# torch, and every lowprec module that needs it, is imported inside the commands: `--help`, the
# version and a mistyped option answer without the seconds an import of torch takes.

__all__ = ["main"]

_EXTRA_HINT = 'the lowprec command needs its extras: pip install "lowprec[cli]" ({})'


class UsageError(Exception):
    """A mistake in the command line: printed as one line, exit status 2."""


def _import_rich():
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError as exc:  # pragma: no cover - the cli extra installs rich
        raise UsageError(_EXTRA_HINT.format(exc)) from None
    return Console, Table


def _console():
    """A rich console; wide enough for the tables (compare's 14 columns, 16 when fine-tuning)
    when the output is a file or a pipe."""
    Console, _ = _import_rich()
    console = Console()
    if not console.is_terminal:
        console = Console(width=240)
    return console


# ---------------------------------------------------------------------------------- output


def _fmt(value: Any, spec: str, *, scale: float = 1.0, unit: str = "") -> str:
    """``value * scale`` formatted with ``spec`` and ``unit``; "-" for a missing or NaN value."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value * scale, spec) + unit


def _json_ready(obj: Any) -> Any:
    """``obj`` with inf and NaN (a diverged run's losses) as null: strict JSON has neither."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _json_ready(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_ready(v) for v in obj]
    return obj


def _write_json(path: Path, payload: dict[str, Any]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(_json_ready(payload), indent=2, allow_nan=False) + "\n")
    except OSError as exc:
        raise UsageError(f"cannot write {path}: {exc.strerror or exc}") from None


def _check_output(path: Path, option: str) -> None:
    """Make sure ``path`` can be written before any work is done: its folder is created (as the
    write would create it) and a scratch file written and removed there. A mistake (a file where a
    folder must be, a folder where the file goes, no permission, a read-only file system) is a
    ``UsageError`` naming ``option``, instead of a failure after minutes of training."""
    import tempfile

    if path.is_dir():
        raise UsageError(f"{option} {path} is a folder: name a file inside it, e.g. "
                         f"{path / ('compare' + (path.suffix or '.json'))}")
    for parent in (path.parent, *path.parent.parents):
        if parent.exists():
            if not parent.is_dir():
                raise UsageError(f"cannot write {path} ({option}): {parent} is a file, not a "
                                 "folder; choose another path")
            break
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=".lowprec-check-"):
            pass
    except OSError as exc:
        raise UsageError(f"cannot write {path} ({option}): {exc.strerror or exc}") from None


def _environment() -> dict[str, Any]:
    import torch

    return {
        "lowprec": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "cpu_count": os.cpu_count(),
        "bf16_matmul_isa": torch.backends.cpu.get_cpu_capability(),
    }


def _resolve_device(name: str) -> dict[str, Any]:
    """``compare.device_info`` of the device ``name`` names here; a ``UsageError`` where there
    is none (``--device cuda`` without CUDA), before any work."""
    from lowprec.compare import device_info, resolve_device

    try:
        return device_info(resolve_device(name))
    except ValueError as exc:
        raise UsageError(f"--device {name}: {exc}") from None



# ---------------------------------------------------------------------------------- memory


def _cmd_memory(args: argparse.Namespace) -> int:
    model_cfg, batch_size = config.sized(args.size, batch_size=args.batch_size)
    if args.json is not None:
        _check_output(args.json, "--json")
    import torch

    from lowprec import memory
    from lowprec.compare import task_loss
    from lowprec.task import CharTransformer

    _, Table = _import_rich()
    console = _console()
    device = _resolve_device(args.device)
    torch.manual_seed(0)
    model = CharTransformer(model_cfg).to(device["device"])
    cuda = device["type"] == "cuda"
    loss_fn = task_loss(model_cfg, batch_size, device["device"]) if cuda else None
    rows = memory.table(args.optimizer, model=model, keep_fp32=(), accumulate=args.accumulate,
                        loss_fn=loss_fn)
    numel = sum(p.numel() for p in model.parameters())
    table = Table(
        title=f"Bytes per parameter, {args.optimizer} (measured: the built-in model, size "
              f"{args.size}, {numel:,} parameters, every layer converted, after one step, on "
              f"{device['device']} ({device['name']}))",
        title_justify="left",
    )
    accum = ("accumulation",) if args.accumulate else ()
    peak = ("held MiB", "peak MiB") if cuda else ()
    for col in ("recipe", "weights", "grads", "state", "master", *accum, "total", "measured",
                "agrees", *peak):
        table.add_column(col, justify="left" if col == "recipe" else "right")
    all_agree = True
    # (Muon's and Adafactor's state on a whole model is not their per-element figure)
    mixed = memory.MIXED_STATE.get(args.optimizer)
    skip = ("other", "optimizer_state") if mixed else ("other",)
    for row in rows:
        e, m = row["expected"], row["measured"]
        # The measured total also holds the per-tensor step counters (a few bytes per tensor).
        agrees = all(abs(e[k] - m[k]) < 1e-9 for k in memory.CATEGORIES if k not in skip)
        all_agree &= agrees
        table.add_row(row["recipe"], f"{e['weights']:g}", f"{e['grads']:g}",
                      f"{e['optimizer_state']:.3g}", f"{e['master']:g}",
                      *(f"{e['accumulation']:g}" for _ in accum), f"[bold]{e['total']:.3g}",
                      f"{m['total']:.3f}", "yes" if agrees else "[red]NO",
                      *(f"{row['cuda_peak'][k] / 2**20:.1f}" for k in ("held", "peak") if cuda))
    console.print(table)
    if cuda:
        console.print(f"held / peak MiB: the CUDA allocator's bytes for a real training step at "
                      f"batch {batch_size}x{model_cfg.context} (the recipe's autocast, backward "
                      "and step; no accumulation buffers): held between steps (weights, "
                      "gradients, state), and the peak during the second step "
                      "(torch.cuda.max_memory_allocated: activations and temporaries too).",
                      style="dim")
    console.print("weights/grads/state/master/total: derived from the optimizer each recipe "
                  "builds (8-bit state: one byte and 4/256 for the scales per element of the "
                  "parameters of at least 4096 elements, FP32 for the others); measured: counted "
                  "from the actual tensors (the remainder is the per-tensor step counters).",
                  style="dim")
    if mixed:
        console.print(f"{mixed}; agrees compares the other columns.", style="dim")
    if args.json is not None:
        _write_json(args.json, {"command": "memory", "optimizer": args.optimizer,
                                "size": args.size, "batch_size": batch_size, "numel": numel,
                                "device": device, "rows": rows, "environment": _environment()})
        console.print(f"JSON: {args.json}")
    return 0 if all_agree else 1


# ---------------------------------------------------------------------------------- numerics


def _cmd_numerics(args: argparse.Namespace) -> int:
    if args.json is not None:
        _check_output(args.json, "--json")
    from lowprec import demos

    _, Table = _import_rich()
    console = _console()
    try:
        swamp = demos.swamping(big=args.big, small=args.small, steps=args.steps, seed=args.seed)
        under = demos.fp16_underflow(seed=args.seed)
        dfp = demos.dfp16_errors(seed=args.seed)
    except (TypeError, ValueError) as exc:
        raise UsageError(str(exc)) from None

    t = Table(title=f"Swamping: {swamp['big']:g} + {swamp['steps']} x {swamp['small']:g} "
                    f"(exact {swamp['exact']:.6g})", title_justify="left")
    for col in ("storage", "master value", "stored weight", "relative error"):
        t.add_column(col, justify="left" if col == "storage" else "right")
    for name, r in swamp["methods"].items():
        err = r["relative_error"]
        extra = ""
        if "mean_final" in r:
            extra = f" (mean of {r['trials']} runs: {r['mean_relative_error']:.2e})"
        t.add_row(name, f"{r['final']:.7g}", f"{r['stored']:.7g}", f"{err:.2e}{extra}")
    console.print(t)

    t = Table(title=f"FP16 underflow: {under['n']:,} gradient magnitudes, log-uniform in "
                    f"[{under['low']:.1e}, {under['high']:.1e}]", title_justify="left")
    for col in ("loss scale", "flushed to 0", "subnormal", "overflow", "median rel. error"):
        t.add_column(col, justify="right")
    for r in under["rows"]:
        t.add_row(f"{r['scale']:g}", f"{100 * r['flushed']:.1f}%", f"{100 * r['subnormal']:.1f}%",
                  f"{100 * r['overflow']:.1f}%", f"{r['median_relative_error']:.2e}")
    console.print(t)

    t = Table(title=f"DFP-16 quantization of {dfp['n']:,} N(0,1) values: error in units of "
                    f"the shared exponent (2^{dfp['exponent']})", title_justify="left")
    for col in ("rounding", "max |error|", "mean error (bias)", "mean |error|"):
        t.add_column(col, justify="left" if col == "rounding" else "right")
    for mode, r in dfp["modes"].items():
        t.add_row(mode, f"{r['max_abs_error']:.4f}", f"{r['mean_error']:+.2e}",
                  f"{r['mean_abs_error']:.4f}")
    console.print(t)
    if args.json is not None:
        _write_json(args.json, {"command": "numerics", "swamping": swamp, "fp16_underflow": under,
                                "dfp16": dfp})
        console.print(f"JSON: {args.json}")
    return 0


# ---------------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``lowprec`` command; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "command", None) is None:
        parser.print_help()
        return 2
    if args.command == "compare":
        from lowprec.cli_compare import _cmd_compare as run
    else:
        run = _cmd_memory if args.command == "memory" else _cmd_numerics
    try:
        return run(args)
    except UsageError as exc:
        print(f"lowprec: error: {exc}", file=sys.stderr)
        return 2


def entry_point() -> None:  # pragma: no cover - the console script
    sys.exit(main())
