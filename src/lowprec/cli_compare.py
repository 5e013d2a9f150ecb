"""``lowprec compare`` as a command: options into a ``CompareConfig``, progress, the table, the
recommendation, the notes under it, JSON and the plot (``lowprec.compare`` measures and prints
nothing; ``lowprec.cli`` dispatches here).
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Sequence
from typing import Any

from lowprec import config
from lowprec.cli import (
    _EXTRA_HINT,
    UsageError,
    _check_output,
    _console,
    _environment,
    _fmt,
    _import_rich,
    _resolve_device,
    _write_json,
)
from lowprec.plot import plot_losses


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
