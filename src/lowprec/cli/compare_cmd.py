"""``lowprec compare`` as a command: options into a ``CompareConfig``, progress, the table, the
recommendation, the notes under it, JSON and the plot (``lowprec.comparison.compare`` measures and prints
nothing; ``lowprec.cli.main`` dispatches here; ``lowprec.cli.common`` holds what the commands
share).
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

from lowprec.cli.common import (
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
from lowprec.comparison import config
from lowprec.comparison.plot import plot_losses

if TYPE_CHECKING:  # (rich is imported when the command prints: the start stays light)
    from rich.console import Console
    from rich.table import Table


def compare_table(records: Sequence[dict[str, Any]], *, title: str | None = None,
                  finetune: bool = False) -> Table:
    """The comparison as a rich ``Table``: one row per record, or per recipe of ``summarize``'s
    rows (their spreads over the seeds as "mean ± sd"). ``finetune`` adds the eval loss before
    training and the share of FP32's loss drop."""
    _, Table = _import_rich()
    table = Table(title=title, title_justify="left")
    extra = (("eval before", "right"),) if finetune else ()
    share = (("share of fp32's drop", "right"),) if finetune else ()
    for name, justify in (
        ("recipe", "left"), ("train loss (last 10%)", "right"), *extra, ("eval loss", "right"),
        ("gap vs fp32", "right"), *share, ("step ms", "right"), ("speed-up", "right"),
        ("speed-up IQR", "right"),
        ("B/param", "right"), ("weights", "right"), ("grads", "right"), ("state", "right"),
        ("master", "right"), ("lost updates", "right"), ("skipped", "right"),
    ):
        # (the recipe's name whole: "bf16-kahan-8bit" is cut short before other columns shrink)
        width = max((len(r["recipe"]) for r in records), default=6) if name == "recipe" else None
        table.add_column(name, justify=justify, no_wrap=True, min_width=width)
    for r in records:
        b = r["bytes_per_param"]
        # (a mark on the speed cells of a row whose BF16 products were computed in FP32: not
        # BF16 hardware's times; _products_note says so under the table)
        mark = EMULATED_MARK if r.get("products_in_fp32") == "bfloat16" else ""
        table.add_row(
            r["recipe"],
            _fmt(r["final_loss"], ".4f"),
            *((_fmt(r.get("eval_before"), ".4f"),) if finetune else ()),
            _fmt(r["eval_loss"], ".4f"),
            _spread_of(r, "eval_gap", "+.2f", scale=100, unit="%"),
            *((_spread_of(r, "drop_share", ".2f"),) if finetune else ()),
            _fmt(r["step_time_s"], ".1f", scale=1e3) + mark,
            _fmt(r.get("speedup"), ".2f", unit="x") + mark,
            _spread(r.get("speedup_iqr")) + mark,
            _fmt(b["total"], ".1f"),
            _fmt(b["weights"], ".1f"),
            _fmt(b["grads"], ".1f"),
            _fmt(b["optimizer_state"], ".1f"),
            _fmt(b["master"], ".1f"),
            _fmt(r["lost_update_fraction"], ".2f", scale=100, unit="%"),
            str(r["skipped_steps"]),
        )
    return table


def lost_table(where: dict[str, Any], rows: Sequence[dict[str, Any]]) -> Table:
    """``summary.lost_by_parameter``'s parameters as a rich ``Table``: each parameter's share of
    the model's elements and the fraction of its updates each recipe lost, with a note on the
    parameters no recipe's master keeps (keep them in FP32)."""
    _, Table = _import_rich()
    # (the recipes with 16-bit weights: FP32 weights lose nothing to their own rounding here)
    names = [r["recipe"] for r in rows if r["recipe"] in where["parameters"][0]["lost"]
             and r.get("weights") != "float32"]
    keep = set(where["keep_fp32"])
    caption = None
    if keep:
        caption = (f"* lost over {config.LOST_UPDATES_LIMIT:.0%} under every recipe with a "
                   "master: keep it in FP32 (a recipe's keep_fp32 takes module types or names)")
    table = Table(title=f"Where the updates are lost (most under {where['baseline']} first)",
                  title_justify="left", caption=caption, caption_justify="left")
    table.add_column("parameter", no_wrap=True)
    table.add_column("share of elements", justify="right")
    for name in names:
        table.add_column(f"{name} lost", justify="right", no_wrap=True)
    for p in where["parameters"]:
        table.add_row(p["name"] + (" *" if p["name"] in keep else ""),
                      _fmt(p["share"], ".1f", scale=100, unit="%"),
                      *(_fmt(p["lost"].get(n), ".1f", scale=100, unit="%") for n in names))
    return table


#: The mark on the step-time and speed-up cells of a row whose BF16 products were computed in
#: FP32 (``products.LowPrecisionProductsInFP32``), explained by ``_products_note``.
EMULATED_MARK = "†"


def _spread_of(r: dict[str, Any], key: str, spec: str, *, scale: float = 1.0,
               unit: str = "") -> str:
    """``r[key]`` formatted, with " ± sd" where ``r`` has its spread over seeds (``summarize``'s
    ``<key>_std``)."""
    text = _fmt(r.get(key), spec, scale=scale, unit=unit)
    sd = r.get(f"{key}_std")
    if sd is None or text == "-":
        return text
    return f"{text} ± {format(sd * scale, spec.lstrip('+'))}{unit}"


def _spread(iqr: Sequence[float] | None) -> str:
    """An interquartile range of speed-ups, e.g. "1.95-2.30x"; "-" where there is none."""
    if not iqr or not all(math.isfinite(v) for v in iqr):
        return "-"
    return f"{iqr[0]:.2f}-{iqr[1]:.2f}x"


def _cmd_compare(args: argparse.Namespace) -> int:
    from lowprec.comparison.config import CompareConfig

    console = _console()
    user_task = args.task not in config.TASKS
    try:
        model, batch_size = config.sized(args.size, batch_size=args.batch_size,
                                         d_model=args.d_model, n_layer=args.n_layer,
                                         n_head=args.n_head, context=args.context)
        cfg = CompareConfig(
            recipes=args.recipes, optimizer=args.optimizer, steps=args.steps, lr=args.lr,
            seed=args.seed, batch_size=batch_size, model=model, threads=args.threads,
            eval_batches=args.eval_batches, monitor_every=args.monitor_every,
            fused=args.fused, device=args.device,
            task=config.USER_TASK if user_task else args.task, seeds=args.seeds,
            fp32_values=args.fp32_values,
            pretrain_steps=args.pretrain_steps, schedule=args.schedule,
        )
        cfg.validate()
        if args.assert_recipe is not None and args.assert_recipe not in (cfg.recipes or ()):
            raise ValueError(f"--assert-recipe {args.assert_recipe}: not among the recipes run "
                             f"({', '.join(cfg.recipes or ())}).")
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    json_path = args.json or args.out / "compare.json"
    plot_path = None if args.no_plot else (args.plot or args.out / "compare.png")
    # Checked before training, so that a mistake costs seconds, not the run.
    _check_output(json_path, "--json" if args.json else "--out")
    if plot_path is not None:
        _check_output(plot_path, "--plot" if args.plot else "--out")
    if cfg.task == "finetune":  # (where the pretrained model is cached)
        _check_output(args.out / "pretrained" / "pretrained.pt", "--out")
    # (torch: after the checks)
    from lowprec.comparison.compare import compare, config_dict, noise_floor, recommend, summarize
    from lowprec.comparison.summary import WARMUP_STEPS, lost_by_parameter

    device = _resolve_device(args.device)
    from lowprec.products import bf16_products_in_fp32

    task = None
    if user_task:
        from lowprec.comparison.task import load_task

        try:  # (before any work: a task that is not found costs nothing)
            task = load_task(args.task)
        except (ValueError, TypeError) as exc:
            raise UsageError(str(exc)) from None

    try:  # (LOWPREC_BF16_PRODUCTS read before any work: a bad value costs nothing)
        in_fp32 = bf16_products_in_fp32()
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if device["type"] == "cpu":  # (the JSON's: how BF16 products were computed here)
        device["bf16_products"] = "fp32" if in_fp32 else "native"
    cfg.device = device["device"]  # (what auto chose: the runs and the JSON say the same)
    finetune = cfg.task == "finetune"
    what = (f"fine-tuning on pydoc prose from {cfg.pretrain_steps} FP32 pretraining steps"
            if finetune else "pretraining on stdlib sources")
    seeds = f", {cfg.seeds} seeds" if cfg.seeds > 1 else ""
    shape = (f"d_model {model.d_model} x {model.n_layer} layers ({model.num_parameters:,} "
             f"parameters), batch {cfg.batch_size}x{model.context}")
    if task is not None:
        what, shape = f"{task.name} ({args.task})", "your model and batches"
    title = (f"{what}: {cfg.optimizer} lr {cfg.peak_lr:g} {cfg.lr_schedule}, {cfg.steps} steps"
             f"{seeds}, {shape}, {_device_label(device, cfg.threads)}")
    # (steps and recipes are set: __post_init__ replaced a None with the task's)
    recipes = cast("Sequence[str]", cfg.recipes)
    total = cast(int, cfg.steps) * cfg.seeds

    records: list[dict[str, Any]] = []
    load: dict[str, Any] = {}
    info: dict[str, Any] = {}
    current: dict[str, Any] = {}
    started = time.perf_counter()
    progress = None
    # Where stdout is not a terminal (a log file, CI, nohup, a notebook) rich draws no bars: plain
    # lines instead, about ten per recipe, each with the elapsed time and an estimate of the rest.
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
            tasks[name] = progress.add_task(name, total=total, loss="-")

    # The recipes' elapsed time counts from the end of pretraining; the time left, from the rate
    # since the round after the warm-up steps, whose compilation would inflate it many times.
    clock: dict[str, Any] = {"t0": started, "mark": None}

    def on_step(name: str, step: int, loss: float, n: int = total) -> None:
        current["step"] = step + 1  # (the recipes take their steps in turn: one round each)
        now = time.perf_counter()
        if step == WARMUP_STEPS and clock["mark"] is None:
            clock["mark"] = now
        if progress is not None:
            progress.update(tasks[name], advance=1, loss=f"{loss:.4f}")
        elif plain and ((step + 1) % max(1, n // 10) == 0 or step + 1 == n):
            elapsed = now - clock["t0"]
            if step > WARMUP_STEPS and clock["mark"] is not None:
                rate = (now - clock["mark"]) / (step - WARMUP_STEPS)
            else:
                rate = elapsed / (step + 1)
            left = rate * (n - step - 1)
            console.print(f"{name:<12} step {step + 1:>{len(str(n))}}/{n}  "
                          f"loss {loss:.4f} (this step)  elapsed {elapsed:.0f} s, "
                          f"about {left:.0f} s left", markup=False, highlight=False)

    def on_pretrain(step: int, steps: int, loss: float) -> None:
        if progress is None:
            on_step("pretrain", step, loss, steps)
        else:
            if "pretrain" not in tasks:
                tasks["pretrain"] = progress.add_task("pretrain", total=steps, loss="-")
            progress.update(tasks["pretrain"], advance=1, loss=f"{loss:.4f}")
        if step + 1 == steps:
            clock.update(t0=time.perf_counter(), mark=None)

    def on_note(text: str) -> None:
        console.print(f"[yellow]{text}[/yellow]", highlight=False)

    console.print(f"[bold]lowprec compare[/bold]: {title}; recipes {', '.join(recipes)}")
    interrupted = False
    try:
        if progress is not None:
            progress.start()
        try:
            compare(cfg, on_start=on_start, on_step=on_step, records=records, load=load,
                    cache_dir=args.out / "pretrained", on_pretrain=on_pretrain,
                    on_note=on_note, info=info, task=task)
        except (ValueError, TypeError) as exc:
            # (a task of the user's refused before its first step, check_start: one line)
            if task is None or "step" in current:
                raise
            raise UsageError(f"--task {args.task}: {exc}") from None
        finally:
            if progress is not None:
                progress.stop()
    except KeyboardInterrupt:
        interrupted = True
        console.print(f"[yellow]Interrupted[/yellow] at step {current.get('step', 0)} of "
                      f"{total}: the records hold the steps each recipe took.")

    payload: dict[str, Any] = {
        "command": "compare",
        "interrupted": interrupted,
        "wall_time_s": time.perf_counter() - started,
        "config": {**config_dict(cfg), "size": args.size,
                   "parameters": model.num_parameters},
        "device": device,
        "environment": _environment(),
        "background_load": load or None,
        "pretrained": info.get("pretrained"),
        "records": records,
    }
    if records:
        rows = summarize(records)
        floor = noise_floor(records)
        payload.update(summary=rows, noise_floor=floor)
        payload["recommendation"] = recommend(rows, args.tolerance / 100, floor=floor)
        payload["parameters"] = where = lost_by_parameter(rows)
        console.print(compare_table(rows, title=f"lowprec compare: {title}", finetune=finetune))
        if where is not None and where["parameters"]:
            console.print(lost_table(where, rows))
        _notes(console, rows, finetune=finetune, seeds=cfg.seeds)
        _pretrained_note(console, info.get("pretrained"), cfg.fp32_values)
        _floor_note(console, floor, cfg.seeds, args.tolerance / 100)
        _load_note(console, load, cfg.threads, device)
        _products_note(console, rows, device)
        _recommendation(console, payload["recommendation"])
    else:
        console.print("No recipe finished: nothing to report.")
    _write_json(json_path, payload)
    console.print(f"JSON: {json_path}")
    if plot_path is not None and records:
        try:
            plot_losses(rows, plot_path, title=title)
        except ImportError as exc:  # pragma: no cover - the cli extra installs matplotlib
            raise UsageError(_EXTRA_HINT.format(exc)) from None
        except OSError as exc:
            raise UsageError(f"cannot write {plot_path}: {exc.strerror or exc}") from None
        console.print(f"Plot: {plot_path}")
    console.print(f"Total {payload['wall_time_s']:.0f} s.")
    if interrupted:
        return 130
    if args.assert_gap is not None:
        return _assert_gap(console, payload, args.assert_gap / 100, args.assert_recipe)
    return 0


def _assert_gap(console: Console, payload: dict[str, Any], limit: float,
                recipe: str | None) -> int:
    """``--assert-gap``: 0 where the recommended recipe (or ``recipe``) ended within ``limit``
    (a fraction) of fp32's eval loss, else 1, with a line saying which and by how much."""
    rec = payload.get("recommendation") or {}
    name = recipe or rec.get("recipe")
    if name is None:
        console.print(f"[red]--assert-gap failed[/red]: no recipe recommended "
                      f"({rec.get('reason', 'nothing ran')}).", highlight=False)
        return 1
    row = next((r for r in payload.get("summary", []) if r["recipe"] == name), None)
    gap = None if row is None else row.get("eval_gap")
    if gap is None or not math.isfinite(gap) or gap > limit:
        shown = "no gap (no fp32 run, or it diverged)" if gap is None or not math.isfinite(gap) \
            else f"{gap:+.2%}"
        console.print(f"[red]--assert-gap failed[/red]: {name} ended {shown} against fp32, "
                      f"beyond {limit:.2%}.", highlight=False)
        return 1
    console.print(f"--assert-gap held: {name} ended {gap:+.2%} against fp32, within "
                  f"{limit:.2%}.", highlight=False)
    return 0


def _recommendation(console: Console, rec: dict[str, Any]) -> None:
    """One line for the recipe to use, one reason for each other, and a warning where the run was
    too short to separate a recipe that loses its updates from FP32 by loss alone."""
    if rec["recipe"] is None:
        console.print(f"[bold]No recommendation[/bold]: {rec['reason']}.")
    else:
        console.print(f"[bold]Recommended: {rec['recipe']}[/bold], the cheapest recipe within "
                      f"{rec['threshold']:.2%} of fp32's eval loss on this run that keeps its "
                      f"updates: {rec['reason']}.")
    if rec["others"]:
        console.print("Not chosen: " + "; ".join(f"{k}: {v}" for k, v in rec["others"].items())
                      + ".", highlight=False)
    if rec["short_run"]:
        console.print(
            f"[yellow]This run is too short to separate {', '.join(rec['short_run'])} from fp32 "
            "by loss[/yellow]: within the threshold here, but losing over "
            f"{config.LOST_UPDATES_LIMIT:.0%} of its updates to round-to-nearest (see above), "
            "which costs more the longer the run and the smaller the learning "
            "rate (fine-tuning: lowprec compare --task finetune; docs/fidelity.md). Stochastic "
            "rounding's unchanged weights are not counted as lost: it keeps each update in "
            "expectation.", highlight=False)


def _pretrained_note(console: Console, about: dict[str, Any] | None,
                     fp32_values: bool = True) -> None:
    """Where the fine-tuning task's pretrained model came from."""
    if about is None:
        return
    origin = (f"read from {about['path']}" if about["cached"] else
              f"trained in {about['seconds']:.0f} s" + (f" and saved to {about['path']}"
                                                        if about["path"] else ""))
    loss = about.get("eval_loss")
    loss = f", eval loss {loss:.4f} on held-out sources" if loss is not None else ""
    start = ("each 16-bit recipe from its rounding, its master from the FP32 values"
             if fp32_values else "each 16-bit recipe, master included, from its rounding "
             "(--no-fp32-values)")
    console.print(f"Pretrained model: {origin}{loss}; every recipe starts from its FP32 weights, "
                  f"{start}.", style="dim", highlight=False)


def _floor_note(console: Console, floor: float | None, seeds: int, tolerance: float) -> None:
    """FP32's seed-to-seed spread, or a hint to measure it."""
    if floor is None:
        console.print(f"One seed{'' if seeds == 1 else ' of fp32 finished'}: no noise floor "
                      "measured (--seeds 3 measures fp32's seed-to-seed spread, which a gap must "
                      "exceed to mean anything).", style="dim")
        return
    beyond = (f"; it is above the {tolerance:.1%} tolerance, so recipes within "
              f"{floor:.2%} of fp32 count as equal" if floor > tolerance else "")
    console.print(f"Noise floor: fp32's eval loss varies by {floor:.2%} (sample standard "
                  f"deviation over {seeds} seeds, relative to its mean); a gap smaller than that "
                  f"is within what another seed changes{beyond}.", highlight=False)


def _device_label(device: dict[str, Any], threads: int) -> str:
    """"cuda:0 (NVIDIA H100 80GB HBM3)" or "cpu (<model>), 2 threads": what ran the steps."""
    label = f"{device['device']} ({device['name']})"
    return label if device["type"] != "cpu" else f"{label}, {threads} threads"


def _load_note(console: Console, load: dict[str, Any], threads: int,
               device: dict[str, Any] | None = None) -> None:
    """Say how busy the machine was while the steps were timed, plainly when it was contended.
    The load is the CPU's (``/proc/stat``): on a GPU it slows only the host's share of a step
    (launches, the optimizer's host logic), and the GPU's own load is not measured."""
    from lowprec.comparison.compare import CONTENDED_CORES

    bg, share = load.get("background_cores"), load.get("contended_fraction")
    if bg is None:
        console.print("Background load: not measured here (no /proc/stat).", style="dim")
        return
    share = cast(float, share)  # (measured with the background cores: _Load.summary)
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


def _products_note(console: Console, rows: Sequence[dict[str, Any]],
                   device: dict[str, Any]) -> None:
    """One line where some recipes' BF16 products were computed in FP32 and rounded to BF16
    (``products.LowPrecisionProductsInFP32``): their step times, marked in the table, are not
    BF16 hardware's."""
    names = [r["recipe"] for r in rows if r.get("products_in_fp32") == "bfloat16"]
    if not names:
        return
    why = ("this CPU has no fast BF16 matmul (oneDNN needs AVX-512 BF16 or AMX)"
           if device.get("fast_bf16_matmul") is False
           else "LOWPREC_BF16_PRODUCTS=fp32 asked for it")
    console.print(
        f"{EMULATED_MARK} BF16 products computed in FP32 and rounded to BF16: {why}; the step "
        f"times and speed-ups of {', '.join(names)} are not BF16 hardware's "
        "(LOWPREC_BF16_PRODUCTS=native times torch's own BF16 kernels).",
        style="yellow", highlight=False)


def _notes(console: Console, records: Sequence[dict[str, Any]], *, finetune: bool = False,
           seeds: int = 1) -> None:
    """Reading help under the table, and a warning for each run that diverged."""
    if finetune:
        console.print("eval before/after: on held-out prose before and after fine-tuning; share "
                      "of fp32's drop: the recipe's fall in eval loss over fp32's (1.00: all "
                      "of it).", style="dim")
    if seeds > 1:
        console.print(f"Means over {seeds} seeds, ± their sample standard deviation; the gap "
                      "and share are each seed's own against fp32 on that seed; step times and "
                      "speed-ups are medians.", style="dim")
    for r in records:
        if r["eval_loss"] is None or not math.isfinite(r["eval_loss"]):
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
