"""``lowprec.compare``: the recipes side by side on the user's own model, data and loss.

Every recipe starts from the same FP32 weights (the model is copied for each, and each 16-bit
recipe's master starts from those FP32 values: ``Recipe.convert``'s ``fp32_values``) and takes
the same batches in the same order, the recipes taking their steps in turn
(``comparison.compare``). What comes back is a ``Comparison``: one row per recipe with the
command's JSON record fields, the recommendation, and where the updates are lost, parameter by
parameter. Everything is checked before the first step.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lowprec.comparison import config as config_mod
from lowprec.comparison.compare import compare as run_compare
from lowprec.comparison.compare import config_dict
from lowprec.comparison.run import resolve_device
from lowprec.comparison.summary import lost_by_parameter, noise_floor, recommend, summarize
from lowprec.comparison.task import Task, default_loss

__all__ = ["Comparison", "compare"]

#: The columns of ``Comparison``'s printed table: (header, row key, format, scale).
_COLUMNS = (("recipe", "recipe", "s", 1.0), ("eval loss", "eval_loss", ".4f", 1.0),
            ("gap vs fp32", "eval_gap", "+.2%", 1.0),
            ("lost updates", "lost_update_fraction", ".1%", 1.0),
            ("B/param", None, ".1f", 1.0), ("step ms", "step_time_s", ".1f", 1e3),
            ("speed-up", "speedup", ".2f", 1.0))


@dataclass
class Comparison:
    """What ``lowprec.compare`` measured.

    Attributes:
        rows: One dict per recipe (means over the seeds, with ``<field>_std`` spreads): the
            command's JSON record keys (``recipe``, ``eval_before``, ``eval_loss``,
            ``eval_gap``, ``drop_share``, ``lost_update_fraction``, ``bytes_per_param``,
            ``step_time_s``, ``speedup``, ``skipped_steps``, ``losses``, ``parameters``, ...).
        records: One dict per recipe and seed, as measured.
        recommendation: The recipe to use and why (``recipe``, ``reason``, ``others``: why
            not each other one; ``recipe`` None where none trains as well as FP32).
        parameters: Where the updates are lost (``baseline``: plain 16-bit training's recipe;
            ``parameters``: the parameters it loses most of, by module path, with each
            recipe's lost fraction; ``keep_fp32``: those no recipe's master keeps), or None
            where the updates were not monitored.
        noise_floor: FP32's seed-to-seed spread of the eval loss (None for one seed).
        config: The options the comparison ran with (default: none).
    """

    rows: list[dict[str, Any]]
    records: list[dict[str, Any]]
    recommendation: dict[str, Any]
    parameters: dict[str, Any] | None
    noise_floor: float | None
    config: dict[str, Any] = field(default_factory=dict)

    def row(self, recipe: str) -> dict[str, Any]:
        """The row of ``recipe``.

        Args:
            recipe: A recipe's name, as in ``rows``.

        Raises:
            KeyError: No such recipe in this comparison.
        """
        for r in self.rows:
            if r["recipe"] == recipe:
                return r
        raise KeyError(f"no recipe {recipe!r} in this comparison: "
                       f"{', '.join(r['recipe'] for r in self.rows)}")

    def to_json(self, path: str | os.PathLike[str] | None = None) -> dict[str, Any]:
        """The comparison as JSON-ready values (the command's ``compare.json`` keys:
        ``config``, ``records``, ``summary``, ``noise_floor``, ``recommendation``,
        ``parameters``), written to ``path`` where one is given.

        Args:
            path: Where to write the JSON (default: None, nowhere).
        """
        out = {"config": self.config, "records": self.records, "summary": self.rows,
               "noise_floor": self.noise_floor, "recommendation": self.recommendation,
               "parameters": self.parameters}
        if path is not None:
            with open(path, "w") as f:
                json.dump(out, f, indent=2, default=str)
        return out

    def plot(self, path: str | os.PathLike[str], *, title: str = "lowprec.compare") -> None:
        """The loss curves, gaps, bytes and step times as a figure at ``path`` (needs
        matplotlib: ``pip install lowprec[cli]``).

        Args:
            path: The image file to write (PNG, SVG, PDF, ... by its suffix).
            title: The figure's title (default: ``"lowprec.compare"``).
        """
        from lowprec.comparison.plot import plot_losses

        plot_losses(self.rows, Path(path), title=title)

    def __str__(self) -> str:
        cells = [[h for h, *_ in _COLUMNS]]
        for r in self.rows:
            line = []
            for _, key, spec, scale in _COLUMNS:
                value = r["bytes_per_param"]["total"] if key is None else r.get(key)
                line.append(value if isinstance(value, str) else _fmt(value, spec, scale))
            cells.append(line)
        widths = [max(len(c[i]) for c in cells) for i in range(len(_COLUMNS))]
        lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                           for i, (c, w) in enumerate(zip(row, widths, strict=True)))
                 for row in cells]
        rec = self.recommendation
        lines.append("recommended: " + (f"{rec['recipe']} ({rec['reason']})" if rec["recipe"]
                                        else f"none ({rec['reason']})"))
        where = self.parameters
        if where and where["parameters"]:
            worst = ", ".join(f"{p['name']} ({p['lost'][where['baseline']]:.0%})"
                              for p in where["parameters"][:3])
            lines.append(f"most updates lost under {where['baseline']}: {worst}")
            if where["keep_fp32"]:
                lines.append("keep in FP32 (no master keeps their updates): "
                             + ", ".join(where["keep_fp32"]))
        return "\n".join(lines)


def _fmt(value: Any, spec: str, scale: float) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return format(value * scale, spec)


def _model_source(model: nn.Module | Callable[[], nn.Module]) -> Callable[[int], nn.Module]:
    """``Task.model`` of what the user gave: an FP32 model (each seed starts from its weights)
    or a function building one (called once per seed, under ``torch.manual_seed(seed)``)."""
    if isinstance(model, nn.Module):
        return lambda seed: model
    if not callable(model):
        raise TypeError(f"model must be an nn.Module or a function returning one, got "
                        f"{type(model).__name__}.")

    def build(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        built = model()
        if not isinstance(built, nn.Module):
            raise TypeError(f"the model function returned a {type(built).__name__}, not an "
                            "nn.Module.")
        return built

    return build


def _train_source(train: Iterable[Any] | Callable[[int], Iterable[Any]],
                  steps: int) -> Callable[[int], Iterable[Any]]:
    """``Task.train`` of what the user gave: a function of the seed, or an iterable, whose first
    ``steps`` batches are drawn once and given to every seed (a generator or a DataLoader over a
    one-shot stream is read once)."""
    if not isinstance(train, Iterable):
        if callable(train):
            return train
        raise TypeError(f"train must be an iterable of batches or a function of the seed "
                        f"returning one, got {type(train).__name__}.")
    stream = train
    cached: list[Any] = []

    def batches(seed: int) -> Iterable[Any]:
        if not cached:  # (read once: the first call draws, compare checks there are enough)
            cached.extend(itertools.islice(stream, steps))
        return cached

    return batches


def compare(
    model: nn.Module | Callable[[], nn.Module],
    train: Iterable[Any] | Callable[[int], Iterable[Any]],
    eval: Iterable[Any],
    *,
    loss: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    recipes: Sequence[str] | None = None,
    steps: int = 200,
    optimizer: str = "adamw",
    lr: float | None = None,
    optimizer_options: dict[str, Any] | None = None,
    schedule: str = "constant",
    warmup: float = 0.05,
    seeds: int = 1,
    seed: int = 0,
    device: str = "auto",
    tolerance: float = config_mod.DEFAULT_TOLERANCE,
    monitor_every: int = 10,
    fused: bool | None = None,
    fp32_values: bool = True,
    threads: int | None = None,
    on_step: Callable[[str, int, float], None] | None = None,
) -> Comparison:
    """Train ``model`` under each recipe from the same FP32 weights on the same batches, and say
    which recipe trains as well as FP32 for the fewest bytes, and where the updates are lost.

    Args:
        model: The FP32 model (copied for each recipe, never trained itself) or a function
            returning one (called once per seed, after ``torch.manual_seed(seed)``).
        train: Training batches: an iterable (its first ``steps`` batches, read once and used
            for every seed) or a function of the seed returning one.
        eval: Held-out batches; the eval loss is their mean loss.
        loss: ``loss(model, batch) -> scalar tensor`` (default: ``model(**batch).loss`` for
            dict batches, as Hugging Face models take them; else cross-entropy of the model's
            output on the batch's other elements against its last: ``task.default_loss``).
        recipes: Recipe names (``lowprec.recipes.RECIPES``), FP32 first (default: fp32, bf16,
            bf16-kahan, bf16-split, bf16-sr).
        steps: Training steps per recipe and seed (default: 200).
        optimizer: The optimizer's name (default: ``"adamw"``; ``config.OPTIMIZERS``).
        lr: Peak learning rate (default: None, the optimizer's pretraining rate on the
            built-in task, ``config.DEFAULT_LR``: pass your own).
        optimizer_options: The optimizer's other hyperparameters, e.g. ``{"betas": (0.9,
            0.95), "weight_decay": 0.1}`` (default: None: weight decay 0.01 for AdamW and
            LAMB, momentum 0.9 for SGD, the optimizer's own defaults otherwise).
        schedule: After the warm-up, ``"constant"`` or ``"cosine"`` decay to 10% (default:
            ``"constant"``).
        warmup: Fraction of the steps with linear warm-up (default: 0.05).
        seeds: Runs per recipe (seeds ``seed``, ``seed + 1``, ...); with 2 or more, FP32's
            spread is the noise floor a gap must exceed (default: 1).
        seed: The first seed (default: 0).
        device: ``"auto"`` (CUDA where there is one), ``"cpu"``, ``"cuda"``, ``"cuda:N"``
            (default: ``"auto"``).
        tolerance: How far above FP32's eval loss a recipe may end and be recommended, a
            fraction (default: 0.005).
        monitor_every: Measure lost updates every k steps, 0 for never (default: 10).
        fused: The optimizers' ``fused`` option (default: None, compiled where a compiler is).
        fp32_values: Start each recipe's master from the FP32 weights (default: True).
        threads: torch's CPU threads for the run (default: None, as they are).
        on_step: ``on_step(recipe, step, loss)`` after every step (default: None).

    Returns:
        A ``Comparison``: ``rows``, ``recommendation``, ``parameters``, ``to_json()``,
        ``plot()``, and a table as its ``str``.

    Raises:
        ValueError: An unknown recipe, optimizer or device, too few batches, a model with no
            trainable FP32 parameters, or a loss that is not a finite scalar tensor: all
            before the first step.
        TypeError: A model, batches or loss of the wrong kind.

    Example:
        >>> import torch
        >>> import lowprec
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <torch._C.Generator object at ...>
        >>> net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
        ...                           torch.nn.Linear(16, 3))
        >>> data = [(torch.randn(32, 8), torch.randint(0, 3, (32,))) for _ in range(20)]
        >>> result = lowprec.compare(net, data, data[:4], steps=20, lr=1e-3, fused=False,
        ...                          recipes=["fp32", "bf16", "bf16-split"], device="cpu")
        >>> [r["recipe"] for r in result.rows]
        ['fp32', 'bf16', 'bf16-split']
        >>> result.row("bf16-split")["eval_gap"] < 0.01
        True
    """
    if loss is not None and not callable(loss):
        raise TypeError(f"loss must be a function loss(model, batch), got {type(loss).__name__}.")
    cfg = config_mod.CompareConfig(
        recipes=None if recipes is None else tuple(recipes), optimizer=optimizer, steps=steps,
        lr=lr, seed=seed, monitor_every=monitor_every, warmup=warmup, fused=fused,
        device=device, task=config_mod.USER_TASK, seeds=seeds, schedule=schedule,
        fp32_values=fp32_values, threads=threads if threads is not None else 1,
        optimizer_options=dict(optimizer_options or {}),
    )
    cfg.validate()
    if not (isinstance(tolerance, (int, float)) and tolerance >= 0):
        raise ValueError(f"tolerance must be a fraction >= 0, got {tolerance!r}.")
    resolve_device(device)  # (a device that is not there: refused here, before any work)
    if not hasattr(eval, "__iter__"):
        raise TypeError(f"eval must be an iterable of batches, got {type(eval).__name__}.")
    held_out = list(eval)
    if not held_out:
        raise ValueError("no eval batches: give at least one held-out batch.")
    task = Task(model=_model_source(model), train=_train_source(train, steps), eval=held_out,
                loss=loss or default_loss)
    kept_threads = torch.get_num_threads()
    try:
        if threads is None:
            cfg.threads = kept_threads  # (compare sets the CPU's threads to cfg.threads)
        records = run_compare(cfg, on_step=on_step, task=task)
    finally:
        torch.set_num_threads(kept_threads)
    rows = summarize(records)
    floor = noise_floor(records)
    return Comparison(rows=rows, records=records,
                      recommendation=recommend(rows, tolerance, floor=floor),
                      parameters=lost_by_parameter(rows), noise_floor=floor,
                      config=config_dict(cfg))
