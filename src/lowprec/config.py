"""What the ``lowprec`` command and ``lowprec.compare`` run by default, and their option checks.

Imports nothing heavier than the standard library (no torch), so that ``lowprec --help`` and a
mistyped option answer at once: the command imports torch only once a command runs.
``lowprec.compare`` and ``lowprec.task`` re-export these names; ``lowprec.recipes`` checks that
its recipes are the ones named here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["DEFAULT_LR", "DEFAULT_RECIPES", "DEFAULT_TOLERANCE", "OPTIMIZERS", "RECIPES",
           "CompareConfig", "ModelConfig"]

#: The recipe names, in display order (``lowprec.recipes`` defines each).
RECIPES: tuple[str, ...] = (
    "fp32", "amp-bf16", "amp-fp16", "bf16", "bf16-kahan", "bf16-split", "bf16-sr",
    "bf16-kahan-8bit", "bf16-split-8bit", "fp16-master", "dfp16",
)


@dataclass(frozen=True)
class ModelConfig:
    """Size of the built-in model.

    Attributes:
        d_model: Width (default: 256).
        n_layer: Transformer blocks (default: 2).
        n_head: Attention heads (default: 4).
        context: Window length (default: 64).
    """

    d_model: int = 256
    n_layer: int = 2
    n_head: int = 4
    context: int = 64

    def __post_init__(self) -> None:
        for name in ("d_model", "n_layer", "n_head", "context"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}.")
        if self.d_model % self.n_head:
            raise ValueError(
                f"d_model={self.d_model} must be a multiple of n_head={self.n_head}."
            )


#: What ``lowprec compare`` runs by default: the reference, the BF16 recipes and the 2017 FP16
#: recipe. Left out (run them with ``--recipes``): ``amp-fp16``, whose FP16 matmuls have no
#: hardware path on most CPUs (32x slower than FP32 per step here), and ``dfp16``, whose exact
#: integer emulation costs ~20 FP32 steps per step.
DEFAULT_RECIPES: tuple[str, ...] = (
    "fp32", "amp-bf16", "bf16", "bf16-kahan", "bf16-split", "bf16-sr", "bf16-kahan-8bit",
    "bf16-split-8bit", "fp16-master",
)
OPTIMIZERS: tuple[str, ...] = ("sgd", "adagrad", "lamb", "adamw")
#: How far above FP32's eval loss a recipe may end and still be recommended (0.005: 0.5 %).
DEFAULT_TOLERANCE = 0.005

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
            median step time), None is the library default (compiled where torch.compile has
            a compiler, C++ or Triton; see ``lowprec.optim``), False the eager step
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
        valid = RECIPES
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
