"""The ``lowprec`` command: ``compare``, ``memory`` and ``numerics``.

The numbers come from ``lowprec.comparison.compare``, ``lowprec.memory`` and ``lowprec.cli.demos``,
which print nothing; ``lowprec.cli.parser`` holds the options (argparse, torch-free),
``lowprec.cli.compare_cmd`` the compare command's progress, table and notes,
``lowprec.cli.common`` the helpers the commands share (output, errors), and this module the
rest: ``memory``, ``numerics`` and ``main`` (rich for tables; ``lowprec.comparison.plot`` draws the
picture, matplotlib, headless). A user mistake (an unknown recipe, a
negative step count) ends with one ``lowprec: error: ...`` line and exit status 2, never a
traceback; Ctrl-C during ``compare`` prints the recipes measured so far, saves them, and exits
with status 130.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from lowprec.cli.common import (
    UsageError,
    _check_output,
    _console,
    _environment,
    _fmt,
    _import_rich,
    _resolve_device,
    _write_json,
)
from lowprec.cli.compare_cmd import _cmd_compare
from lowprec.cli.parser import build_parser
from lowprec.comparison import config

if TYPE_CHECKING:  # (rich is imported when a command prints: the start stays light)
    from rich.console import Console

# torch, and every lowprec module that needs it, is imported inside the commands: `--help`, the
# version and a mistyped option answer without the seconds an import of torch takes.

__all__ = ["main"]


# ---------------------------------------------------------------------------------- memory


def _cmd_memory(args: argparse.Namespace) -> int:
    model_cfg, batch_size = config.sized(args.size, batch_size=args.batch_size)
    if args.json is not None:
        _check_output(args.json, "--json")
    if args.params is not None:
        if args.measure_peak:
            raise UsageError("--params plans for a model of that size and --measure-peak "
                             "measures the probe model: run them one at a time")
        return _memory_plan(args)
    import torch

    from lowprec import memory
    from lowprec.comparison.run import task_loss
    from lowprec.comparison.task import CharTransformer

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
    peak = _memory_peak(args, console, device) if args.measure_peak else None
    if args.json is not None:
        _write_json(args.json, {"command": "memory", "optimizer": args.optimizer,
                                "size": args.size, "batch_size": batch_size, "numel": numel,
                                "device": device, "rows": rows, "peak": peak,
                                "environment": _environment()})
        console.print(f"JSON: {args.json}")
    met = peak is None or all(t["passed"] for t in peak["targets"])
    return 0 if all_agree and met else 1


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _memory_peak(args: argparse.Namespace, console: Console,
                 device: dict[str, Any]) -> dict[str, Any]:
    """``--measure-peak``: every recipe's step, without and with step_in_backward, measured in
    fresh processes (``memory_peak.peak_table``), its table and the issue's targets."""
    from lowprec.cli import memory_peak

    _, Table = _import_rich()
    probe = {"depth": args.probe_depth, "width": args.probe_width, "batch": args.probe_batch}
    with console.status("") as status:
        def progress(recipe: str, mode: bool) -> None:
            status.update(f"measuring {recipe}, step_in_backward {_yes(mode)} (a fresh process)")

        rows = memory_peak.peak_table(args.optimizer, device=str(device["device"]),
                                      progress=progress, **probe)
    cuda = device["type"] == "cuda"
    how = "the CUDA allocator's peak" if cuda else "peak resident memory (VmHWM)"
    numel = next((r["numel"] for r in rows if "numel" in r), None)
    title = (f"Peak of a training step, {args.optimizer}: {args.probe_depth} x Linear("
             f"{args.probe_width}, {args.probe_width}), no bias"
             + (f" ({numel:,} parameters)" if numel else "")
             + f", batch {args.probe_batch}, after 2 warm-up steps, one fresh process each, "
               f"on {device['device']}")
    table = Table(title=title, title_justify="left")
    for col in ("recipe", "in backward", "weights", "grads", "state", "master", "B/param",
                "accounted MiB", "grads MiB", "measured MiB", "saved MiB"):
        table.add_column(col, justify="left" if col in ("recipe", "in backward") else "right")
    notes: set[str] = set()
    errors: dict[str, int] = {}  # (each error's text once, below the table)
    for r in rows:
        mode = _yes(r["in_backward"]) + (" (recipe)" if r["in_backward"] and
                                         r.get("recipe_in_backward") else "")
        if "error" in r:
            n = errors.setdefault(r["error"], len(errors) + 1)
            table.add_row(r["recipe"], mode, f"[red]failed ({n})", *("",) * 8)
            continue
        per, acc, meas = r["accounted_per_param"], r["accounted"], r["measured"]
        if "note" in meas:
            notes.add(meas["note"])
        saved = r.get("saved")
        table.add_row(r["recipe"], mode, f"{per['weights']:g}", f"{per['grads']:.3g}",
                      f"{per['optimizer_state']:.3g}", f"{per['master']:g}",
                      f"[bold]{per['total']:.3f}", f"{acc['total'] / 2**20:.1f}",
                      f"{acc['grads'] / 2**20:.1f}", f"{meas['over_baseline'] / 2**20:.1f}",
                      _fmt(saved, ".1f", scale=2**-20))
    console.print(table)
    console.print(
        "weights .. B/param: the tensors at the peak of the measured step, per parameter "
        "(grads: the most gradient bytes alive at once, after any accumulation or at "
        "optimizer.step(); the rest counted by lowprec.memory.measure); accounted MiB: their "
        f"sum; measured MiB: {how} during the step over what the process held before it "
        "(gradients, activations, the step's temporaries; "
        + ("torch.cuda.max_memory_allocated" if cuda else
           f"glibc made to unmap freed tensors, MALLOC_MMAP_THRESHOLD_="
           f"{memory_peak.MMAP_THRESHOLD}")
        + "); saved: the measured MiB without step_in_backward minus with it.", style="dim")
    for note in sorted(notes):
        console.print(f"note: {note}", style="yellow")
    for error, n in errors.items():
        console.print(f"({n}) {error}", style="red")
    checks = memory_peak.targets(rows)
    for t in checks:
        mark = "[green]met" if t["passed"] else "[red]NOT MET"
        console.print(f"target {t['name']}: {t['detail']}: {mark}")
    return {"probe": probe, "rows": rows, "targets": checks}


def _fit(gib: float, card: int) -> str:
    """"fits", "tight" (over 90% of the card: activations and the context may not fit) or
    "no"."""
    return "fits" if gib <= 0.9 * card else "[yellow]tight" if gib <= card else "[red]no"


def _memory_plan(args: argparse.Namespace) -> int:
    """``--params``: the GiB each recipe needs for a model of that size (``memory_plan``)."""
    from lowprec import memory
    from lowprec.cli import memory_plan

    _, Table = _import_rich()
    console = _console()
    size = args.params
    rows = memory_plan.plan(size, args.optimizer)
    largest = (f", largest parameter {size.largest:,}" if size.largest else "")
    table = Table(title=f"GiB of tensors at a step's peak, {args.optimizer}: {size.numel:,} "
                        f"parameters ({size.source}{largest})", title_justify="left")
    cards = memory_plan.CARDS
    for col in ("recipe", "in backward", "B/param", "weights", "grads", "state", "master",
                "total", *(f"{c} GiB" for c in cards)):
        table.add_column(col, justify="left" if col in ("recipe", "in backward") else "right")
    refusals: dict[str, int] = {}
    for r in rows:
        g = r["gib"]
        mode = _yes(r["in_backward"]) + (" (recipe)" if r["in_backward"] and
                                         r["recipe_in_backward"] else "")
        if r["refused"] is not None:
            n = refusals.setdefault(r["refused"], len(refusals) + 1)
            table.add_row(r["recipe"], mode, f"refused ({n})", *("-",) * (5 + len(cards)))
            continue
        per = g["total"] * 2**30 / size.numel
        table.add_row(r["recipe"], mode, f"{per:.3g}", *(f"{g[k]:.1f}" for k in
                      ("weights", "grads", "optimizer_state", "master")),
                      f"[bold]{g['total']:.1f}",
                      *(_fit(g["total"], c) for c in cards))
    console.print(table)
    grads = ("the largest parameter's gradient, stepped as soon as it is made" if size.largest
             else "0: each parameter's gradient is freed once it is stepped (one parameter's "
                  "at a time; give a config.json to count it)")
    console.print(
        "From lowprec.memory.expected per element (every parameter in the recipe's weight dtype "
        f"and large enough for 8-bit state). In backward: step_in_backward, gradients {grads}. "
        "The tensors only: activations, temporaries, the CUDA context and the allocator's slack "
        "come on top (tight: over 90% of the card).", style="dim")
    for refused, n in refusals.items():
        console.print(f"({n}) {refused}", style="dim")
    mixed = memory.MIXED_STATE.get(args.optimizer)
    if mixed:
        console.print(f"{mixed}.", style="dim")
    if args.json is not None:
        _write_json(args.json, {"command": "memory", "optimizer": args.optimizer,
                                "params": size.as_dict(), "cards_gib": list(cards),
                                "plan": [{**r, "fits": r["fits"] and {str(c): v for c, v in
                                                                      r["fits"].items()}}
                                         for r in rows]})
        console.print(f"JSON: {args.json}")
    return 0


# ---------------------------------------------------------------------------------- numerics


def _cmd_numerics(args: argparse.Namespace) -> int:
    if args.json is not None:
        _check_output(args.json, "--json")
    from lowprec.cli import demos

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
    run = {"compare": _cmd_compare, "memory": _cmd_memory}.get(args.command, _cmd_numerics)
    try:
        return run(args)
    except UsageError as exc:
        print(f"lowprec: error: {exc}", file=sys.stderr)
        return 2


def entry_point() -> None:  # pragma: no cover - the console script
    sys.exit(main())
