"""Train the built-in model under several recipes and measure what each costs.

``compare`` runs every recipe with the same seed, the same initial weights and the same batches,
and returns one record per recipe: final train loss, eval loss and gap to FP32, median step time
and speed-up over FP32, bytes per parameter by buffer (measured from the tensors), the fraction
of updates lost to rounding (``diagnostics.UpdateMonitor``) and the loss curve. The CLI
(``lowprec compare``) prints, plots and saves these records; nothing here prints.
"""

from __future__ import annotations

import contextlib
import copy
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from lowprec import recipes as recipes_mod
from lowprec.task import Batches, CharTransformer, ModelConfig, load_text

__all__ = ["DEFAULT_RECIPES", "OPTIMIZERS", "CompareConfig", "compare", "run_recipe"]

#: What ``lowprec compare`` runs by default: the reference, the BF16 recipes and the 2017 FP16
#: recipe. Left out (run them with ``--recipes``): ``amp-fp16``, whose FP16 matmuls have no
#: hardware path on most CPUs (several times slower than FP32 here), and ``dfp16``, whose exact
#: integer emulation costs ~20 FP32 steps per step.
DEFAULT_RECIPES: tuple[str, ...] = (
    "fp32", "amp-bf16", "bf16", "bf16-kahan", "bf16-split", "bf16-sr", "fp16-master",
)
OPTIMIZERS: tuple[str, ...] = ("sgd", "adagrad", "lamb", "adamw")

# Peak learning rates per optimizer for the built-in task, checked on it at the default size:
# AdamW at 5e-4 keeps the runs stable through warm-up (1e-3 spiked near its end); SGD with
# momentum 0.9 diverges at 0.3 and trains at 0.05-0.1; Adagrad and LAMB need larger steps.
DEFAULT_LR = {"adamw": 5e-4, "lamb": 4e-3, "adagrad": 2e-2, "sgd": 0.05}


@dataclass
class CompareConfig:
    """What ``compare`` runs.

    Attributes:
        recipes: Recipe names, FP32 first if present (default: ``DEFAULT_RECIPES``).
        optimizer: ``"sgd"``, ``"adagrad"``, ``"lamb"`` or ``"adamw"`` (default: ``"adamw"``).
        steps: Training steps per recipe (default: 400).
        lr: Peak learning rate (default: None, the optimizer's default for this task).
        seed: Seed of the initial weights and the batches (default: 0).
        batch_size: Windows per batch (default: 16).
        model: Model size (default: ``ModelConfig()``).
        threads: torch threads (default: 2).
        eval_batches: Evaluation batches at the end (default: 8).
        monitor_every: Measure lost updates every k steps, 0 for never (default: 10).
        warmup: Fraction of steps with linear warm-up; then cosine decay to 10% (default: 0.05).
        text_bytes: Bytes of training text to read (default: 2,000,000).
        fused: The optimizers' ``fused`` option: True compiles each optimizer variant's step
            with ``torch.compile`` (seconds per variant on the first step, not counted in the
            median step time), None is the library default (compiled on CUDA, eager on CPU)
            (default: None).
    """

    recipes: Sequence[str] = DEFAULT_RECIPES
    optimizer: str = "adamw"
    steps: int = 400
    lr: float | None = None
    seed: int = 0
    batch_size: int = 16
    model: ModelConfig = field(default_factory=ModelConfig)
    threads: int = 2
    eval_batches: int = 8
    monitor_every: int = 10
    warmup: float = 0.05
    text_bytes: int = 2_000_000
    fused: bool | None = None

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad option."""
        valid = recipes_mod.names()
        if not self.recipes:
            raise ValueError(f"no recipes given; choose from {', '.join(valid)}.")
        for name in self.recipes:
            if name not in valid:
                raise ValueError(f"unknown recipe {name!r}; choose from {', '.join(valid)}.")
        if len(set(self.recipes)) != len(self.recipes):
            raise ValueError("a recipe is listed twice; list each once.")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(
                f"unknown optimizer {self.optimizer!r}; choose from {', '.join(OPTIMIZERS)}."
            )
        for name, low in (("steps", 1), ("batch_size", 1), ("threads", 1), ("eval_batches", 1),
                          ("monitor_every", 0), ("text_bytes", 10_000)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}.")
        if self.lr is not None and not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a positive number, got {self.lr!r}.")
        if not 0 <= self.warmup < 1:
            raise ValueError(f"warmup must be a fraction in [0, 1), got {self.warmup!r}.")
        if self.fused not in (None, True, False):
            raise ValueError(f"fused must be True, False or None, got {self.fused!r}.")

    @property
    def peak_lr(self) -> float:
        return self.lr if self.lr is not None else DEFAULT_LR[self.optimizer]


def _schedule(cfg: CompareConfig) -> Callable[[int], float]:
    warm = max(1, int(cfg.warmup * cfg.steps))

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        progress = (step - warm) / max(1, cfg.steps - warm)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x).float()
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), y.reshape(-1))


@torch.no_grad()
def _evaluate(model, recipe, batches) -> float:
    model.eval()
    try:
        with recipe.autocast():
            return statistics.fmean(float(_loss(model, x, y)) for x, y in batches)
    finally:
        model.train()


def run_recipe(
    name: str,
    cfg: CompareConfig,
    batches: Batches,
    initial: dict[str, torch.Tensor],
    *,
    on_step: Callable[[int, float], None] | None = None,
) -> dict[str, Any]:
    """Train one recipe from the ``initial`` FP32 weights and return its record."""
    from lowprec import diagnostics, memory

    recipe = recipes_mod.get(name)
    model = CharTransformer(cfg.model)
    model.load_state_dict(initial)
    model = recipe.convert(model)
    hp: dict[str, Any] = {"lr": cfg.peak_lr, "fused": cfg.fused}
    if cfg.optimizer == "sgd":
        hp["momentum"] = 0.9
    if cfg.optimizer in ("adamw", "lamb"):
        hp["weight_decay"] = 0.01
    opt = recipe.optimizer(cfg.optimizer, model.parameters(), seed=cfg.seed, **hp)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule(cfg))
    monitor = None
    if cfg.monitor_every:
        monitor = diagnostics.UpdateMonitor(
            model, opt, every=cfg.monitor_every, scaler=recipe.scaler
        )
    losses: list[float] = []
    times: list[float] = []
    skipped = 0
    for step, (x, y) in enumerate(batches.train_batches(cfg.steps)):
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with recipe.autocast():
            loss = _loss(model, x, y)
        recipe.backward(loss)
        with monitor.step() if monitor is not None else contextlib.nullcontext():
            stepped = recipe.step(opt)
        if stepped:
            sched.step()
        else:
            skipped += 1
        times.append(time.perf_counter() - start)
        value = float(loss.detach())
        if not math.isfinite(value):
            value = float("nan")
        losses.append(value)
        if on_step is not None:
            on_step(step, value)
    tail = [v for v in losses[-max(1, cfg.steps // 10):] if math.isfinite(v)]
    mem = memory.measure(model, opt)
    lost = None
    if monitor is not None:
        # What the training trajectory loses: updates that left the master value unchanged
        # (for Kahan, split and an FP32 copy the stored BF16/FP16 weight may lag while the
        # master keeps the update).
        lost = monitor.master_lost_fraction
        if lost is None:
            lost = monitor.lost_update_fraction
        monitor.close()
    return {
        "recipe": name,
        "final_loss": statistics.fmean(tail) if tail else float("nan"),
        "eval_loss": _evaluate(model, recipe, batches.eval_batches(cfg.eval_batches)),
        "step_time_s": statistics.median(times[1:] if len(times) > 1 else times),
        "bytes_per_param": mem.bytes_per_param,
        "lost_update_fraction": lost,
        "stored_unchanged_fraction": (
            monitor.lost_update_fraction if monitor is not None else None
        ),
        "skipped_steps": skipped,
        "losses": losses,
        "description": recipe.description,
    }


def compare(
    cfg: CompareConfig,
    *,
    on_start: Callable[[str], None] | None = None,
    on_step: Callable[[int, float], None] | None = None,
    on_done: Callable[[dict[str, Any]], None] | None = None,
    records: list[dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """Run every recipe of ``cfg`` and return their records, with gaps and speed-ups vs FP32.

    ``records`` (if given) is filled as recipes finish, so a caller interrupted part-way still
    holds what was measured.
    """
    cfg.validate()
    torch.set_num_threads(cfg.threads)
    out = records if records is not None else []
    text = load_text(cfg.text_bytes)
    batches = Batches(text, context=cfg.model.context, batch_size=cfg.batch_size, seed=cfg.seed)
    torch.manual_seed(cfg.seed)
    initial = copy.deepcopy(CharTransformer(cfg.model).state_dict())
    for name in cfg.recipes:
        if on_start is not None:
            on_start(name)
        record = run_recipe(name, cfg, batches, initial, on_step=on_step)
        out.append(record)
        add_relative(out)
        if on_done is not None:
            on_done(record)
    return out


def add_relative(records: list[dict[str, Any]]) -> None:
    """Fill ``eval_gap`` and ``speedup`` against the FP32 record, where there is one."""
    ref = next((r for r in records if r["recipe"] == "fp32"), None)
    for r in records:
        if ref is None:
            r["eval_gap"], r["speedup"] = None, None
            continue
        r["eval_gap"] = (r["eval_loss"] - ref["eval_loss"]) / ref["eval_loss"]
        r["speedup"] = ref["step_time_s"] / r["step_time_s"]


def config_dict(cfg: CompareConfig) -> dict[str, Any]:
    """``cfg`` as plain JSON-ready values."""
    d = asdict(cfg)
    d["recipes"] = list(cfg.recipes)
    d["lr"] = cfg.peak_lr
    return d
