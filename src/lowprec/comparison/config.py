"""What the ``lowprec`` command and ``lowprec.comparison.compare`` run by default, and their option
checks.

Imports nothing heavier than the standard library (no torch), so that ``lowprec --help`` and a
mistyped option answer at once: the command imports torch only once a command runs.
``lowprec.comparison.compare`` and ``lowprec.comparison.task`` re-export these names; ``lowprec.comparison.run`` checks
that ``lowprec.recipes`` defines the recipes named here.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

__all__ = ["BLOCK_RECIPES", "DEFAULT_LR", "DEFAULT_RECIPES", "DEFAULT_TOLERANCE", "FINETUNE_LR",
           "FINETUNE_RECIPES", "LOST_UPDATES_LIMIT", "OPTIMIZERS", "RECIPES", "RECIPE_GROUPS",
           "SIZES", "TASKS", "TASK_STEPS", "USER_RECIPES", "USER_TASK", "CompareConfig",
           "ModelConfig", "Size", "check_device", "sized"]

#: The recipe names, in display order (``lowprec.recipes`` defines each).
RECIPES: tuple[str, ...] = (
    "fp32", "amp-bf16", "amp-fp16", "bf16", "bf16-kahan", "bf16-split", "bf16-sr",
    "bf16-kahan-8bit", "bf16-split-8bit", "bf16-kahan-8bit-release", "bf16-kahan-4bit",
    "bf16-kahan-4bit-release", "fp16-master", "dfp16", "mxfp8", "mxfp8-split", "mxfp8-8bit",
    "mxfp8-bf16", "mxfp6", "mxfp4", "nvfp4", "nvfp4-bf16", "nvfp4-bare", "nvfp4-no-2d",
    "nvfp4-no-sr", "nvfp4-no-rht", "nvfp4-no-edges",
)
#: ``--recipes blocks``: the block formats beside FP32 and BF16 (lowprec.blockfmt): each format
#: under a Kahan master, MXFP8 and NVFP4 also on plain BF16 weights, and NVFP4 without its
#: recipe's extras.
BLOCK_RECIPES: tuple[str, ...] = (
    "fp32", "bf16", "bf16-kahan", "mxfp8", "mxfp8-bf16", "mxfp6", "mxfp4", "nvfp4",
    "nvfp4-bf16", "nvfp4-bare",
)
#: Names that stand for several recipes in ``--recipes``.
RECIPE_GROUPS: dict[str, tuple[str, ...]] = {"blocks": BLOCK_RECIPES}


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

    @property
    def num_parameters(self) -> int:
        """The model's parameter count, from its shapes (``lowprec.comparison.task.CharTransformer``: byte
        and position embeddings, ``n_layer`` blocks of 12 d^2 + 13 d, a final norm, a 256-way
        head); torch-free, so that ``--help`` can print it."""
        d, vocab = self.d_model, 256
        return vocab * d + self.context * d + self.n_layer * (12 * d * d + 13 * d) + 2 * d \
            + d * vocab + vocab


@dataclass(frozen=True)
class Size:
    """A model size for ``lowprec compare --size``: the model and a batch size that suit it.

    Attributes:
        model: The model's shape.
        batch_size: Windows per batch.
        note: One line for ``--help`` and the docs.
    """

    model: ModelConfig
    batch_size: int
    note: str


#: ``--size`` presets. ``default`` is the built-in model the README's figures come from (2
#: threads of a CPU run it in minutes); the others are for a GPU. ``small`` has nanoGPT's
#: character-level shape; ``gpt2-small`` has GPT-2 small's layers (12 x d_model 768, 12 heads,
#: a 1024-byte context), but a 256-byte vocabulary, so 86M parameters instead of GPT-2's 124M
#: (whose 50257-token embedding is 39M of them).
SIZES: dict[str, Size] = {
    "default": Size(ModelConfig(), 16, "the built-in model"),
    "small": Size(ModelConfig(d_model=384, n_layer=6, n_head=6, context=256), 32,
                  "nanoGPT's character-level shape"),
    "medium": Size(ModelConfig(d_model=512, n_layer=8, n_head=8, context=512), 16,
                   "between the two"),
    "gpt2-small": Size(ModelConfig(d_model=768, n_layer=12, n_head=12, context=1024), 8,
                       "GPT-2 small's layers, a byte vocabulary"),
}


def sized(size: str = "default", *, batch_size: int | None = None,
          **model: int | None) -> tuple[ModelConfig, int]:
    """The model and batch size of a ``SIZES`` preset, with any of them given explicitly.

    Args:
        size: A key of ``SIZES`` (default: ``"default"``).
        batch_size: Windows per batch, or None for the preset's (default: None).
        **model: ``d_model``, ``n_layer``, ``n_head``, ``context``: None keeps the preset's.

    Raises:
        ValueError: An unknown size, or a model the overrides make invalid.
    """
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose from {', '.join(SIZES)}.")
    preset = SIZES[size]
    unknown = set(model) - {"d_model", "n_layer", "n_head", "context"}
    if unknown:
        raise TypeError(f"sized() got unknown options {sorted(unknown)}.")
    chosen = replace(preset.model, **{k: v for k, v in model.items() if v is not None})
    return chosen, preset.batch_size if batch_size is None else batch_size


_DEVICE = re.compile(r"(auto|cpu|cuda(:\d+)?)")


def check_device(device: str) -> str:
    """``device`` if it names where ``compare`` can run: ``"auto"`` (CUDA where torch finds it,
    else the CPU), ``"cpu"``, ``"cuda"`` or ``"cuda:N"``. Only the spelling is checked here
    (without torch); ``lowprec.comparison.run.resolve_device`` checks that the device exists.

    Raises:
        ValueError: Any other value.
    """
    if not isinstance(device, str) or not _DEVICE.fullmatch(device):
        raise ValueError(f"unknown device {device!r}; choose auto, cpu, cuda or cuda:N "
                         "(N: the GPU's index).")
    return device


#: What ``lowprec compare`` runs by default: the reference, the BF16 recipes and the 2017 FP16
#: recipe. Left out (run them with ``--recipes``): ``amp-fp16``, whose FP16 matmuls have no
#: hardware path on most CPUs (32x slower than FP32 per step here), and ``dfp16``, whose exact
#: integer emulation costs ~20 FP32 steps per step.
DEFAULT_RECIPES: tuple[str, ...] = (
    "fp32", "amp-bf16", "bf16", "bf16-kahan", "bf16-split", "bf16-sr", "bf16-kahan-8bit",
    "bf16-split-8bit", "bf16-kahan-8bit-release", "bf16-kahan-4bit", "fp16-master",
)
#: What ``lowprec compare --task finetune`` runs by default: the above but ``amp-bf16``, whose
#: FP32 weights and optimizer lose no update (its loss follows fp32's), so that the run fits in
#: a few minutes on 2 cores.
FINETUNE_RECIPES: tuple[str, ...] = tuple(r for r in DEFAULT_RECIPES if r != "amp-bf16")
#: Default training steps per task (``CompareConfig.steps``).
TASK_STEPS = {"pretrain": 400, "finetune": 300}
#: The optimizers compare and memory take by name (``Recipe.optimizer``'s names).
OPTIMIZERS: tuple[str, ...] = ("sgd", "adagrad", "lamb", "adamw", "adam", "radam", "lion",
                               "stableadamw", "adafactor", "muon")
#: How far above FP32's eval loss a recipe may end and still be recommended (0.005: 0.5 %).
DEFAULT_TOLERANCE = 0.005

#: The built-in tasks: ``pretrain`` trains the model from random weights on the standard
#: library's sources; ``finetune`` pretrains it once in FP32 on them (cached) and fine-tunes it
#: under each recipe, cast from those FP32 weights, on the English prose of ``pydoc_data.topics``.
TASKS: tuple[str, ...] = ("pretrain", "finetune")
#: ``CompareConfig.task`` for a task of the user's (``lowprec.compare``, ``--task FILE:NAME``):
#: its model, data and loss are the ``Task``'s; the built-in tasks' own options go unused.
USER_TASK = "yours"
#: What a comparison on the user's task runs by default: FP32, plain BF16, the three
#: compensations (a few minutes on a small model).
USER_RECIPES: tuple[str, ...] = ("fp32", "bf16", "bf16-kahan", "bf16-split", "bf16-sr")

#: A round-to-nearest recipe whose measured share of lost updates is above this is never
#: recommended, however small its loss gap: a short run cannot show yet what they cost (lost
#: updates bias every step the same way, so their cost grows with the run). 10%: five times the
#: most a compensated recipe lost in docs/fidelity.md's runs (Kahan, 2.2% over 3,000 steps), a
#: third of the least plain BF16 lost there (28% in a 30-step run; 57% in 400, 86% fine-tuning).
LOST_UPDATES_LIMIT = 0.1

# Peak learning rates per optimizer for the built-in task, checked on it at the default size:
# AdamW at 5e-4 keeps the runs stable through warm-up (1e-3 spiked near its end); SGD with
# momentum 0.9 diverges at 0.3 and trains at 0.05-0.1; Adagrad and LAMB need larger steps.
# The others: the best FP32 eval loss of benchmarks/lr_sweep.py on the task (docs/optimizers.md),
# each between two rates that did worse: Adam 1e-3 (of 2.5e-4 to 2e-3), RAdam 4e-3 (5e-4 to
# 8e-3: its first steps are un-adapted), Lion 1e-4 (2.5e-5 to 2e-4), StableAdamW 1e-3 (5e-4 to
# 2e-3), Adafactor 3e-2 (3e-3 to 0.1: the cap of its relative step), Muon 2e-2 (1e-2 to 4e-2).
DEFAULT_LR = {"adamw": 5e-4, "lamb": 4e-3, "adagrad": 2e-2, "sgd": 0.05, "adam": 1e-3,
              "radam": 4e-3, "lion": 1e-4, "stableadamw": 1e-3, "adafactor": 3e-2,
              "muon": 2e-2}
# Fine-tuning rates: AdamW at 3e-5, the range (1e-5 to 1e-4) where people fine-tune in BF16 and
# where an Adam step is below half a BF16 ulp of most weights; the others about as far below
# their pretraining rates.
# The other optimizers: their pretraining rate times AdamW's ratio, 0.06.
FINETUNE_LR = {"adamw": 3e-5, "lamb": 2.5e-4, "adagrad": 1.25e-3, "sgd": 3e-3, "adam": 6e-5,
               "radam": 2.4e-4, "lion": 6e-6, "stableadamw": 6e-5, "adafactor": 1.8e-3,
               "muon": 1.2e-3}


@dataclass
class CompareConfig:
    """What ``compare`` runs.

    Attributes:
        recipes: Recipe names, FP32 first if present (default: None, the task's:
            ``DEFAULT_RECIPES``, or ``FINETUNE_RECIPES`` for fine-tuning).
        optimizer: ``"sgd"``, ``"adagrad"``, ``"lamb"`` or ``"adamw"`` (default: ``"adamw"``).
        steps: Training steps per recipe and seed (default: None, the task's: ``TASK_STEPS``,
            400 for pretraining, 300 for fine-tuning).
        lr: Peak learning rate (default: None, the optimizer's default for this task).
        seed: Seed of the initial weights and the batches (default: 0).
        batch_size: Windows per batch (default: 16).
        model: Model size (default: ``ModelConfig()``; ``sized()`` gives a preset's).
        threads: torch threads, on the CPU only (default: 2).
        eval_batches: Evaluation batches at the end (default: 8).
        monitor_every: Measure lost updates every k steps, 0 for never (default: 10).
        warmup: Fraction of steps with linear warm-up; then cosine decay to 10% (default: 0.05).
        text_bytes: Bytes of training text to read (default: 2,000,000).
        fused: The optimizers' ``fused`` option: True compiles each optimizer variant's step
            with ``torch.compile`` (seconds per variant on the first step, not counted in the
            median step time), None is the library default (compiled where torch.compile has
            a compiler, C++ or Triton; see ``lowprec.optim``), False the eager step
            (default: None).
        device: Where the models, batches and steps run: ``"auto"`` (CUDA where
            ``torch.cuda.is_available()``, else the CPU), ``"cpu"``, ``"cuda"`` or ``"cuda:N"``
            (default: ``"auto"``).
        task: ``"pretrain"`` or ``"finetune"`` (``TASKS``), or ``USER_TASK`` for a task of the
            user's, whose model, data and loss ``compare`` is given (default: ``"pretrain"``).
        seeds: Runs per recipe, with seeds ``seed``, ``seed + 1``, ...; their spread is the
            noise floor a gap must exceed (default: 1).
        pretrain_steps: FP32 AdamW steps of the fine-tuning task's pretraining (default: 400).
        schedule: After the warm-up, ``"cosine"`` decay to 10% of the peak or ``"constant"``
            (default: None, the task's: cosine for pretraining, constant for fine-tuning and
            for a task of the user's).
        fp32_values: Start each recipe's master from the FP32 weights it was cast from
            (``Recipe.convert``'s ``fp32_values``; what the fine-tuning task's pretrained FP32
            weights hold below BF16's precision) (default: True; False: from the rounded
            weights).
        optimizer_options: The optimizer's other hyperparameters (``betas``, ``weight_decay``,
            ``momentum``, ...), over compare's own (weight decay 0.01 for AdamW and LAMB,
            momentum 0.9 for SGD) (default: none).
    """

    recipes: Sequence[str] | None = None
    optimizer: str = "adamw"
    steps: int | None = None
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
    device: str = "auto"
    task: str = "pretrain"
    seeds: int = 1
    pretrain_steps: int = 400
    schedule: str | None = None
    fp32_values: bool = True
    optimizer_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        finetune = self.task == "finetune"
        if self.recipes is None:
            self.recipes = (FINETUNE_RECIPES if finetune else USER_RECIPES
                            if self.task == USER_TASK else DEFAULT_RECIPES)
        if self.steps is None:
            self.steps = TASK_STEPS.get(self.task, TASK_STEPS["pretrain"])

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
        if self.task not in (*TASKS, USER_TASK):
            raise ValueError(f"unknown task {self.task!r}; choose from {', '.join(TASKS)}.")
        if self.schedule not in (None, "cosine", "constant"):
            raise ValueError(f"unknown schedule {self.schedule!r}; choose cosine or constant.")
        for name, low in (("steps", 1), ("batch_size", 1), ("threads", 1), ("eval_batches", 1),
                          ("monitor_every", 0), ("text_bytes", 10_000), ("seeds", 1),
                          ("pretrain_steps", 1), ("seed", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}.")
        if self.lr is not None and not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a positive number, got {self.lr!r}.")
        if not 0 <= self.warmup < 1:
            raise ValueError(f"warmup must be a fraction in [0, 1), got {self.warmup!r}.")
        if self.fused not in (None, True, False):
            raise ValueError(f"fused must be True, False or None, got {self.fused!r}.")
        check_device(self.device)
        if not isinstance(self.optimizer_options, dict):
            raise TypeError(f"optimizer_options must be a dict of hyperparameters, got "
                            f"{type(self.optimizer_options).__name__}.")
        taken = sorted(set(self.optimizer_options) & {"lr", "master", "fused", "seed",
                                                      "state_dtype"})
        if taken:
            raise ValueError(f"optimizer_options may not set {', '.join(taken)}: lr is compare's "
                             "own option, and the rest are each recipe's.")

    @property
    def peak_lr(self) -> float:
        """``lr``, or the optimizer's default for the task (``DEFAULT_LR``, ``FINETUNE_LR``)."""
        if self.lr is not None:
            return self.lr
        return (FINETUNE_LR if self.task == "finetune" else DEFAULT_LR)[self.optimizer]

    @property
    def adamw_lr(self) -> float:
        """The rate of Muon's AdamW group (embeddings, head, norms, biases): AdamW's for the
        task."""
        return (FINETUNE_LR if self.task == "finetune" else DEFAULT_LR)["adamw"]

    @property
    def lr_schedule(self) -> str:
        """``schedule``, or the task's: cosine for pretraining, constant for fine-tuning."""
        if self.schedule is not None:
            return self.schedule
        return "cosine" if self.task == "pretrain" else "constant"

    @property
    def seed_list(self) -> list[int]:
        """The seeds of the runs: ``seed``, ``seed + 1``, ..., ``seeds`` of them."""
        return [self.seed + i for i in range(self.seeds)]
