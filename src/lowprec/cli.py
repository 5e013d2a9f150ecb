"""The ``lowprec`` command: ``compare``, ``memory`` and ``numerics``.

The numbers come from ``lowprec.compare``, ``lowprec.memory`` and ``lowprec.demos``, which print
nothing; this module parses options (argparse) and shows progress and tables (rich);
``lowprec.plot`` draws the picture (matplotlib, headless). A user mistake (an unknown recipe, a
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
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lowprec import __version__, config
from lowprec.plot import plot_losses

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
    """A rich console; wide enough for the tables (compare's 14 columns) when the output is a
    file or a pipe."""
    Console, _ = _import_rich()
    console = Console()
    if not console.is_terminal:
        console = Console(width=200)
    return console


# ---------------------------------------------------------------------------------- parsing


def _whole(minimum: int):
    """An argparse type: a whole number of at least ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


_positive_int, _nonnegative_int = _whole(1), _whole(0)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text}")
    return value


def _recipe_list(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    valid = config.RECIPES
    if not names:
        raise argparse.ArgumentTypeError(f"no recipe given; choose from {', '.join(valid)}")
    for name in names:
        if name not in valid:
            raise argparse.ArgumentTypeError(
                f"unknown recipe {name!r}; choose from {', '.join(valid)}"
            )
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError("a recipe is listed twice; list each once")
    return names


def _optimizer(text: str) -> str:
    key = text.strip().lower()
    if key not in config.OPTIMIZERS:
        raise argparse.ArgumentTypeError(
            f"unknown optimizer {text!r}; choose from {', '.join(config.OPTIMIZERS)}"
        )
    return key


def _device(text: str) -> str:
    try:
        return config.check_device(text.strip().lower())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).rstrip(".")) from None


def _sizes_help() -> str:
    """The presets with their parameter counts and batch sizes, for ``--size``'s help."""
    return ", ".join(f"{name} ({s.model.num_parameters / 1e6:.1f}M parameters: d_model "
                     f"{s.model.d_model} x {s.model.n_layer} layers, {s.model.n_head} heads, "
                     f"context {s.model.context}, batch {s.batch_size})"
                     for name, s in config.SIZES.items())


def _add_device_and_size(p: argparse.ArgumentParser, overrides: str) -> None:
    p.add_argument("--device", type=_device, default="auto",
                   help="where to train: auto (CUDA where torch finds a GPU, else the CPU), "
                        "cpu, cuda or cuda:N (default: auto)")
    p.add_argument("--size", choices=tuple(config.SIZES), default="default", metavar="SIZE",
                   help=f"model size preset: {_sizes_help()}; {overrides} (default: default)")


def build_parser() -> argparse.ArgumentParser:
    from lowprec.config import (
        DEFAULT_LR,
        DEFAULT_RECIPES,
        DEFAULT_TOLERANCE,
        RECIPES,
        CompareConfig,
    )

    cfg, (model, batch) = CompareConfig(), config.sized("default")
    parser = argparse.ArgumentParser(
        prog="lowprec",
        description="Compare low-precision training recipes: loss, speed, memory, lost updates.",
    )
    parser.add_argument("--version", action="version", version=f"lowprec {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    c = sub.add_parser(
        "compare",
        help="train the built-in model under each recipe and compare (the main job)",
        description=(
            "Train a byte-level transformer language model on Python's own standard-library "
            "sources under each recipe, from the same initial weights and batches, and report "
            "the final train and eval loss and gap to FP32, the median step time and speed-up, "
            "the bytes per parameter by buffer, and the fraction of updates lost to rounding. "
            "Writes a JSON file with every number and a PNG of the loss curves. Runs on the "
            "GPU where torch finds one (--device), and --size picks a model for it."
        ),
    )
    c.add_argument("--recipes", type=_recipe_list, default=DEFAULT_RECIPES,
                   help=f"comma-separated recipes (default: {','.join(DEFAULT_RECIPES)}; "
                        f"all: {','.join(RECIPES)})")
    c.add_argument("--optimizer", type=_optimizer, default=cfg.optimizer,
                   help=f"sgd, adagrad, lamb or adamw (default: {cfg.optimizer})")
    c.add_argument("--steps", type=_positive_int, default=cfg.steps,
                   help=f"training steps per recipe (default: {cfg.steps})")
    c.add_argument("--lr", type=_positive_float, default=None,
                   help="peak learning rate (default: per optimizer, adamw "
                        f"{DEFAULT_LR['adamw']:g})")
    c.add_argument("--seed", type=_nonnegative_int, default=cfg.seed,
                   help=f"seed of the initial weights and the batches (default: {cfg.seed})")
    _add_device_and_size(c, "--d-model, --n-layer, --n-head, --context and --batch-size "
                            "override its parts")
    c.add_argument("--batch-size", type=_positive_int, default=None,
                   help=f"sequences per batch (default: the size's, {batch} for default)")
    c.add_argument("--d-model", type=_positive_int, default=None,
                   help=f"model width (default: the size's, {model.d_model} for default)")
    c.add_argument("--n-layer", type=_positive_int, default=None,
                   help=f"transformer blocks (default: the size's, {model.n_layer} for default)")
    c.add_argument("--n-head", type=_positive_int, default=None,
                   help=f"attention heads (default: the size's, {model.n_head} for default)")
    c.add_argument("--context", type=_positive_int, default=None,
                   help="sequence length in bytes (default: the size's, "
                        f"{model.context} for default)")
    c.add_argument("--threads", type=_positive_int, default=cfg.threads,
                   help=f"torch threads, on the CPU only (default: {cfg.threads})")
    c.add_argument("--eval-batches", type=_positive_int, default=cfg.eval_batches,
                   help=f"held-out batches for the eval loss (default: {cfg.eval_batches})")
    c.add_argument("--monitor-every", type=_nonnegative_int, default=cfg.monitor_every,
                   help="count lost updates every k steps, 0 for never "
                        f"(default: {cfg.monitor_every})")
    c.add_argument("--fused", action=argparse.BooleanOptionalAction, default=None,
                   help="compile the optimizer step with torch.compile, or --no-fused for the "
                        "eager step (default: the library's, compiled where a C++ compiler or "
                        "Triton is found)")
    c.add_argument("--tolerance", type=_positive_float, default=100 * DEFAULT_TOLERANCE,
                   help="recommend the cheapest recipe whose eval loss is at most this many "
                        f"percent above fp32's (default: {100 * DEFAULT_TOLERANCE:g})")
    c.add_argument("--out", type=Path, default=Path("lowprec-out"),
                   help="folder for compare.json and compare.png (default: lowprec-out)")
    c.add_argument("--json", type=Path, default=None,
                   help="where to write the JSON (default: OUT/compare.json)")
    c.add_argument("--plot", type=Path, default=None,
                   help="where to write the loss-curve PNG (default: OUT/compare.png)")
    c.add_argument("--no-plot", action="store_true", help="do not draw the PNG")
    c.add_argument("--no-progress", action="store_true", help="no progress bars")
    c.set_defaults(func=_cmd_compare)

    m = sub.add_parser(
        "memory",
        help="bytes per parameter of each recipe, expected and measured",
        description=(
            "Bytes per parameter element (weights, gradients, optimizer state, master copy / "
            "trail / compensation) of each recipe with one optimizer: derived from the "
            "optimizer's own choices, and measured from the tensors of the built-in model "
            "after one step (every layer converted, so the two must agree). On CUDA it adds "
            "the allocator's bytes of a real training step: held between steps, and the peak "
            "during one (torch.cuda.max_memory_allocated)."
        ),
    )
    m.add_argument("--optimizer", type=_optimizer, default="adamw",
                   help="sgd, adagrad, lamb or adamw (default: adamw)")
    _add_device_and_size(m, "--batch-size overrides its batch")
    m.add_argument("--batch-size", type=_positive_int, default=None,
                   help="sequences per batch of the CUDA peak's step (default: the size's)")
    m.add_argument("--accumulate", choices=("fp32", "kahan"), default=None,
                   help="add lowprec.accumulate's buffers (gradient accumulation without "
                        "rounding loss) to the recipes with BF16/FP16 weights")
    m.add_argument("--json", type=Path, default=None, help="also write the table as JSON")
    m.set_defaults(func=_cmd_memory)

    n = sub.add_parser(
        "numerics",
        help="the precision problems made visible: swamping, FP16 underflow, DFP-16 rounding",
        description=(
            "Three small experiments: a small number added many times to a large one in FP32, "
            "BF16, BF16 + Kahan, split and stochastic rounding (swamping); gradient-sized "
            "values cast to FP16 with and without loss scaling (underflow); and the DFP-16 "
            "quantization error of each rounding mode."
        ),
    )
    n.add_argument("--big", type=float, default=1.0, help="the large value (default: 1.0)")
    n.add_argument("--small", type=float, default=1e-4, help="the increment (default: 1e-4)")
    n.add_argument("--steps", type=_nonnegative_int, default=1000,
                   help="number of additions (default: 1000)")
    n.add_argument("--seed", type=_nonnegative_int, default=0, help="seed (default: 0)")
    n.add_argument("--json", type=Path, default=None, help="also write the results as JSON")
    n.set_defaults(func=_cmd_numerics)
    return parser


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


# ---------------------------------------------------------------------------------- compare


def compare_table(records: Sequence[dict[str, Any]], *, title: str | None = None):
    """The comparison as a rich ``Table``."""
    _, Table = _import_rich()
    table = Table(title=title, title_justify="left")
    for name, justify in (
        ("recipe", "left"), ("train loss (last 10%)", "right"), ("eval loss", "right"),
        ("gap vs fp32", "right"), ("step ms", "right"), ("speed-up", "right"),
        ("speed-up IQR", "right"),
        ("B/param", "right"), ("weights", "right"), ("grads", "right"), ("state", "right"),
        ("master", "right"), ("lost updates", "right"), ("skipped", "right"),
    ):
        # (the recipe's name whole: "bf16-kahan-8bit" is cut short before other columns shrink)
        width = max((len(r["recipe"]) for r in records), default=6) if name == "recipe" else None
        table.add_column(name, justify=justify, no_wrap=True, min_width=width)
    for r in records:
        b = r["bytes_per_param"]
        gap = r.get("eval_gap")
        table.add_row(
            r["recipe"],
            _fmt(r["final_loss"], ".4f"),
            _fmt(r["eval_loss"], ".4f"),
            _fmt(gap, "+.2f", scale=100, unit="%"),
            _fmt(r["step_time_s"], ".1f", scale=1e3),
            _fmt(r.get("speedup"), ".2f", unit="x"),
            _spread(r.get("speedup_iqr")),
            _fmt(b["total"], ".1f"),
            _fmt(b["weights"], ".1f"),
            _fmt(b["grads"], ".1f"),
            _fmt(b["optimizer_state"], ".1f"),
            _fmt(b["master"], ".1f"),
            _fmt(r["lost_update_fraction"], ".2f", scale=100, unit="%"),
            str(r["skipped_steps"]),
        )
    return table


def _spread(iqr: Sequence[float] | None) -> str:
    """An interquartile range of speed-ups, e.g. "1.95-2.30x"; "-" where there is none."""
    if not iqr or not all(math.isfinite(v) for v in iqr):
        return "-"
    return f"{iqr[0]:.2f}-{iqr[1]:.2f}x"


def _cmd_compare(args: argparse.Namespace) -> int:
    from lowprec.config import CompareConfig

    console = _console()
    try:
        model, batch_size = config.sized(args.size, batch_size=args.batch_size,
                                         d_model=args.d_model, n_layer=args.n_layer,
                                         n_head=args.n_head, context=args.context)
        cfg = CompareConfig(
            recipes=args.recipes, optimizer=args.optimizer, steps=args.steps, lr=args.lr,
            seed=args.seed, batch_size=batch_size, model=model, threads=args.threads,
            eval_batches=args.eval_batches, monitor_every=args.monitor_every,
            fused=args.fused, device=args.device,
        )
        cfg.validate()
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    json_path = args.json or args.out / "compare.json"
    plot_path = None if args.no_plot else (args.plot or args.out / "compare.png")
    # Checked before training, so that a mistake costs seconds, not the run.
    _check_output(json_path, "--json" if args.json else "--out")
    if plot_path is not None:
        _check_output(plot_path, "--plot" if args.plot else "--out")
    from lowprec.compare import compare, config_dict, recommend  # (torch: after the checks)

    device = _resolve_device(args.device)
    cfg.device = device["device"]  # (what auto chose: the runs and the JSON say the same)
    title = (f"{cfg.optimizer}, {cfg.steps} steps, d_model {model.d_model} x {model.n_layer} "
             f"layers ({model.num_parameters:,} parameters), batch "
             f"{cfg.batch_size}x{model.context}, {_device_label(device, cfg.threads)}")

    records: list[dict[str, Any]] = []
    load: dict[str, Any] = {}
    current: dict[str, Any] = {}
    started = time.perf_counter()
    progress = None
    # Where stdout is not a terminal (a log file, CI, nohup, a notebook) rich draws no bars: plain
    # lines instead, about ten per recipe, each with the elapsed time and an estimate of the rest.
    every = max(1, cfg.steps // 10)
    plain = not args.no_progress and not console.is_terminal
    if not args.no_progress and console.is_terminal:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        progress = Progress(
            TextColumn("[bold]{task.description:<12}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("last-step loss {task.fields[loss]}"), TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=console, transient=False,
        )
    tasks: dict[str, Any] = {}

    def on_start(name: str) -> None:
        if progress is not None:
            tasks[name] = progress.add_task(name, total=cfg.steps, loss="-")

    def on_step(name: str, step: int, loss: float) -> None:
        current["step"] = step + 1  # (the recipes take their steps in turn: one round each)
        if progress is not None:
            progress.update(tasks[name], advance=1, loss=f"{loss:.4f}")
        elif plain and ((step + 1) % every == 0 or step + 1 == cfg.steps):
            elapsed = time.perf_counter() - started
            left = elapsed * (cfg.steps - step - 1) / (step + 1)
            console.print(f"{name:<12} step {step + 1:>{len(str(cfg.steps))}}/{cfg.steps}  "
                          f"loss {loss:.4f} (this step)  elapsed {elapsed:.0f} s, "
                          f"about {left:.0f} s left", markup=False, highlight=False)

    console.print(f"[bold]lowprec compare[/bold]: {title}; recipes {', '.join(cfg.recipes)}")
    interrupted = False
    try:
        if progress is not None:
            progress.start()
        try:
            compare(cfg, on_start=on_start, on_step=on_step, records=records, load=load)
        finally:
            if progress is not None:
                progress.stop()
    except KeyboardInterrupt:
        interrupted = True
        console.print(f"[yellow]Interrupted[/yellow] at step {current.get('step', 0)} of "
                      f"{cfg.steps}: the records hold the steps each recipe took.")

    payload = {
        "command": "compare",
        "interrupted": interrupted,
        "wall_time_s": time.perf_counter() - started,
        "config": {**config_dict(cfg), "size": args.size,
                   "parameters": model.num_parameters},
        "device": device,
        "environment": _environment(),
        "background_load": load or None,
        "records": records,
    }
    if records:
        payload["recommendation"] = recommend(records, args.tolerance / 100)
        console.print(compare_table(records, title=f"lowprec compare: {title}"))
        _notes(console, records)
        _load_note(console, load, cfg.threads, device)
        _recommendation(console, payload["recommendation"])
    else:
        console.print("No recipe finished: nothing to report.")
    _write_json(json_path, payload)
    console.print(f"JSON: {json_path}")
    if plot_path is not None and records:
        try:
            plot_losses(records, plot_path, title=title)
        except ImportError as exc:  # pragma: no cover - the cli extra installs matplotlib
            raise UsageError(_EXTRA_HINT.format(exc)) from None
        except OSError as exc:
            raise UsageError(f"cannot write {plot_path}: {exc.strerror or exc}") from None
        console.print(f"Plot: {plot_path}")
    console.print(f"Total {payload['wall_time_s']:.0f} s.")
    return 130 if interrupted else 0


def _recommendation(console: Any, rec: dict[str, Any]) -> None:
    """One line for the recipe to use, and one reason for each other."""
    if rec["recipe"] is None:
        console.print(f"[bold]No recommendation[/bold]: {rec['reason']}.")
    else:
        console.print(f"[bold]Recommended: {rec['recipe']}[/bold], the cheapest recipe within "
                      f"{rec['tolerance']:.1%} of fp32's eval loss on this run: {rec['reason']}.")
    if rec["others"]:
        console.print("Not chosen: " + "; ".join(f"{k}: {v}" for k, v in rec["others"].items())
                      + ".", highlight=False)


def _resolve_device(name: str) -> dict[str, Any]:
    """``compare.device_info`` of the device ``name`` names here; a ``UsageError`` where there
    is none (``--device cuda`` without CUDA), before any work."""
    from lowprec.compare import device_info, resolve_device

    try:
        return device_info(resolve_device(name))
    except ValueError as exc:
        raise UsageError(f"--device {name}: {exc}") from None


def _device_label(device: dict[str, Any], threads: int) -> str:
    """"cuda:0 (NVIDIA H100 80GB HBM3)" or "cpu (<model>), 2 threads": what ran the steps."""
    label = f"{device['device']} ({device['name']})"
    return label if device["type"] != "cpu" else f"{label}, {threads} threads"


def _load_note(console: Any, load: dict[str, Any], threads: int,
               device: dict[str, Any] | None = None) -> None:
    """Say how busy the machine was while the steps were timed, plainly when it was contended.
    The load is the CPU's (``/proc/stat``): on a GPU it slows only the host's share of a step
    (launches, the optimizer's host logic), and the GPU's own load is not measured."""
    from lowprec.compare import CONTENDED_CORES

    bg, share = load.get("background_cores"), load.get("contended_fraction")
    if bg is None:
        console.print("Background load: not measured here (no /proc/stat).", style="dim")
        return
    if device is not None and device["type"] != "cpu":
        console.print(
            f"Background CPU load: {bg:.2f} cores (median over the rounds; over "
            f"{CONTENDED_CORES:g} core in {share:.0%} of them, peak {load['max_cores']:.2f}). "
            f"The steps ran on {device['device']}: CPU load slows only their host side (kernel "
            "launches, the optimizer's host logic); other work on the GPU is not measured.",
            style="yellow" if share > 0.1 else "dim")
        return
    if share > 0.1:
        console.print(
            f"[yellow]The machine was contended[/yellow]: other processes kept more than "
            f"{CONTENDED_CORES:g} core busy in {share:.0%} of the rounds (median {bg:.2f} "
            f"cores, peak {load['max_cores']:.2f}). Step times are slower than on an idle "
            f"machine ({threads} threads share the cores); the speed-ups compare the recipes "
            "step by step under the same load, but a busy core slows some kinds of step more "
            "than others: rerun on an idle machine for figures to quote."
        )
    else:
        console.print(f"Background load: {bg:.2f} cores (median over the rounds; contended in "
                      f"{share:.0%} of them).", style="dim")


def _notes(console: Any, records: Sequence[dict[str, Any]]) -> None:
    """Reading help under the table, and a warning for each run that diverged."""
    for r in records:
        if not math.isfinite(r["eval_loss"]):
            console.print(f"[yellow]{r['recipe']} diverged[/yellow] (its loss became inf or "
                          "NaN): try a smaller --lr.")
    console.print(
        "train loss: the mean over the last 10% of steps (the progress shows each step's "
        "own); eval loss: on held-out batches after training; gap: eval loss relative to "
        "fp32's; speed-up: the median over the steps (the first two "
        "left out) of fp32's step time over the recipe's (the recipes take their steps in "
        "turn), IQR its interquartile range; B/param: bytes per parameter measured from the "
        "tensors (state = moments, master = FP32 copy / trail / compensation); lost updates: "
        "updates that left the (master) weight unchanged; skipped: steps skipped on inf/NaN by "
        "the loss scaler.",
        style="dim",
    )
    warmup = sum(r.get("warmup_s") or 0.0 for r in records)
    if warmup >= 1.0:
        console.print(
            f"The first two steps took {warmup:.0f} s beyond steady ones in all recipes together: "
            "the compiled optimizer step's compilation (Inductor's on-disk cache makes a later "
            "run's shorter; --no-fused steps eagerly, without it).",
            style="dim",
        )


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
    for row in rows:
        e, m = row["expected"], row["measured"]
        # The measured total also holds the per-tensor step counters (a few bytes per tensor).
        agrees = all(abs(e[k] - m[k]) < 1e-9 for k in memory.CATEGORIES if k != "other")
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
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except UsageError as exc:
        print(f"lowprec: error: {exc}", file=sys.stderr)
        return 2


def entry_point() -> None:  # pragma: no cover - the console script
    sys.exit(main())
