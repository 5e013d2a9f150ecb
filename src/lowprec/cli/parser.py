"""The ``lowprec`` command's options: argparse, its argument types, and ``build_parser``.

Torch-free (it reads ``lowprec.comparison.config``), so that ``--help``, ``--version`` and a mistyped
option answer without the seconds an import of torch takes; each subcommand's parser names its
command (``command``), which ``lowprec.cli.main.main`` runs.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from lowprec import __version__
from lowprec.comparison import config

if TYPE_CHECKING:
    from lowprec.cli.memory_plan import ModelSize


def _whole(minimum: int) -> Callable[[str], int]:
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


def _nonnegative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def _task(text: str) -> str:
    """A built-in task's name, or ``FILE.py:NAME`` / ``package.module:NAME`` (loaded once the
    command runs: ``comparison.task.load_task``)."""
    if text in config.TASKS or (":" in text and text.rpartition(":")[2]):
        return text
    raise argparse.ArgumentTypeError(
        f"unknown task {text!r}: choose {', '.join(config.TASKS)}, or a task of yours as "
        "FILE.py:NAME or package.module:NAME")


def _recipe_list(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    names = tuple(r for n in names for r in config.RECIPE_GROUPS.get(n, (n,)))
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


def _model_size(text: str) -> ModelSize:
    """``--params``: a parameter count or a Hugging Face config.json (``memory_plan``)."""
    from lowprec.cli.memory_plan import parse_params  # (torch-free)

    try:
        return parse_params(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


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
    from lowprec.comparison.config import (
        DEFAULT_LR,
        DEFAULT_RECIPES,
        DEFAULT_TOLERANCE,
        FINETUNE_LR,
        RECIPES,
        TASK_STEPS,
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
            "Writes a JSON file with every number and a PNG of the loss curves. --task "
            "finetune fine-tunes a pretrained model at a small learning rate instead, where "
            "plain BF16 loses most of its updates; --seeds N repeats every run over N seeds. "
            "Runs on the GPU where torch finds one (--device), and --size picks a model for it."
        ),
    )
    c.add_argument("--task", type=_task, default=cfg.task,
                   help="pretrain: train the model from random weights on the standard "
                        "library's sources; finetune: pretrain it once in FP32 on them (cached "
                        "in OUT), and fine-tune it under each recipe, cast from those FP32 "
                        "weights, on the English prose of pydoc_data.topics at a fine-tuning "
                        f"rate (adamw {FINETUNE_LR['adamw']:g}); or a task of yours, "
                        "FILE.py:NAME or package.module:NAME, NAME a "
                        "lowprec.comparison.task.Task or a function returning one "
                        f"(default: {cfg.task})")
    c.add_argument("--assert-gap", type=_nonnegative_float, default=None, metavar="PCT",
                   help="exit with status 1 when the recommended recipe (or --assert-recipe) "
                        "ends more than PCT percent above fp32's eval loss, or none is "
                        "recommended: a CI check of a precision choice")
    c.add_argument("--assert-recipe", default=None, metavar="NAME",
                   help="the recipe --assert-gap holds to its gap (default: the recommended one)")
    c.add_argument("--seeds", type=_positive_int, default=cfg.seeds,
                   help="runs per recipe, seeds SEED, SEED+1, ...: the table shows means and "
                        "spreads, and fp32's spread is the noise floor a gap must exceed "
                        f"(default: {cfg.seeds})")
    c.add_argument("--pretrain-steps", type=_positive_int, default=cfg.pretrain_steps,
                   help="FP32 steps of the finetune task's pretraining "
                        f"(default: {cfg.pretrain_steps})")
    c.add_argument("--schedule", choices=("cosine", "constant"), default=None,
                   help="after the warm-up: cosine decay to 10%% of the peak, or constant "
                        "(default: cosine for pretrain, constant for finetune)")
    c.add_argument("--recipes", type=_recipe_list, default=None,
                   help=f"comma-separated recipes (default: {','.join(DEFAULT_RECIPES)}; "
                        "finetune leaves out amp-bf16; "
                        f"blocks: {','.join(config.BLOCK_RECIPES)}; "
                        f"all: {','.join(RECIPES)})")
    c.add_argument("--optimizer", type=_optimizer, default=cfg.optimizer,
                   help=f"{', '.join(config.OPTIMIZERS)} (default: {cfg.optimizer}); muon "
                        "steps the hidden layers' matrices, AdamW the rest")
    c.add_argument("--steps", type=_positive_int, default=None,
                   help="training steps per recipe and seed (default: "
                        f"{TASK_STEPS['pretrain']} for pretrain, {TASK_STEPS['finetune']} for "
                        "finetune)")
    c.add_argument("--lr", type=_positive_float, default=None,
                   help="peak learning rate (default: per optimizer and task, adamw "
                        f"{DEFAULT_LR['adamw']:g} for pretrain, {FINETUNE_LR['adamw']:g} for "
                        "finetune)")
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
    c.add_argument("--fp32-values", action=argparse.BooleanOptionalAction, default=True,
                   help="start each recipe's master (split, Kahan, FP32 copy) from the FP32 "
                        "weights it was cast from, or --no-fp32-values from the rounded ones "
                        "(default: on)")
    c.add_argument("--fused", action=argparse.BooleanOptionalAction, default=None,
                   help="compile the optimizer step with torch.compile, or --no-fused for the "
                        "eager step and eager block-format quantizers (default: the library's, "
                        "compiled where a C++ compiler or Triton is found)")
    c.add_argument("--tolerance", type=_positive_float, default=100 * DEFAULT_TOLERANCE,
                   help="recommend the cheapest recipe whose eval loss is at most this many "
                        "percent above fp32's, or fp32's noise floor where that is larger "
                        "(round-to-nearest recipes that lose over 10%% of their updates never "
                        f"qualify) (default: {100 * DEFAULT_TOLERANCE:g})")
    c.add_argument("--out", type=Path, default=Path("lowprec-out"),
                   help="folder for compare.json, compare.png and the finetune task's "
                        "pretrained model (OUT/pretrained) (default: lowprec-out)")
    c.add_argument("--json", type=Path, default=None,
                   help="where to write the JSON (default: OUT/compare.json)")
    c.add_argument("--plot", type=Path, default=None,
                   help="where to write the loss-curve PNG (default: OUT/compare.png)")
    c.add_argument("--no-plot", action="store_true", help="do not draw the PNG")
    c.add_argument("--no-progress", action="store_true", help="no progress bars")
    c.set_defaults(command="compare")

    m = sub.add_parser(
        "memory",
        help="bytes per parameter of each recipe, expected and measured",
        description=(
            "Bytes per parameter element (weights, gradients, optimizer state, master copy / "
            "trail / compensation) of each recipe with one optimizer: derived from the "
            "optimizer's own choices, and measured from the tensors of the built-in model "
            "after one step (every layer converted, so the two must agree). On CUDA it adds "
            "the allocator's bytes of a real training step: held between steps, and the peak "
            "during one (torch.cuda.max_memory_allocated). --measure-peak adds the measured "
            "peak of a whole training step, without and with step_in_backward, each in a fresh "
            "process; --params 7B (or a config.json) gives, instead, the GiB a model of that "
            "size needs per recipe."
        ),
    )
    m.add_argument("--optimizer", type=_optimizer, default="adamw",
                   help=f"{', '.join(config.OPTIMIZERS)} (default: adamw)")
    _add_device_and_size(m, "--batch-size overrides its batch")
    m.add_argument("--batch-size", type=_positive_int, default=None,
                   help="sequences per batch of the CUDA peak's step (default: the size's)")
    m.add_argument("--accumulate", choices=("fp32", "kahan"), default=None,
                   help="add lowprec.accumulate's buffers (gradient accumulation without "
                        "rounding loss) to the recipes with BF16/FP16 weights")
    m.add_argument("--params", type=_model_size, default=None, metavar="N|CONFIG",
                   help="instead of the built-in model: the GiB each recipe's weights, "
                        "gradients, optimizer state and master need for a model of N parameters "
                        "(3e9, 7B, 1.5e9, 350M) or of a Hugging Face config.json (Llama, "
                        "Mistral, Qwen2/3 style), without and with step_in_backward, and whether "
                        "that fits in 24, 40 and 80 GiB")
    m.add_argument("--measure-peak", action="store_true",
                   help="also measure the peak of a whole training step (forward, backward, "
                        "step) for every recipe, without and with step_in_backward, each in a "
                        "fresh process on a deep MLP (minutes on a CPU), beside the tensors "
                        "accounted at that peak")
    m.add_argument("--probe-depth", type=_positive_int, default=32,
                   help="--measure-peak's model: bias-free Linear layers (default: 32)")
    m.add_argument("--probe-width", type=_positive_int, default=1024,
                   help="--measure-peak's model: their width (default: 1024)")
    m.add_argument("--probe-batch", type=_positive_int, default=8,
                   help="--measure-peak's step: rows of its input (default: 8)")
    m.add_argument("--json", type=Path, default=None, help="also write the table as JSON")
    m.set_defaults(command="memory")

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
    n.set_defaults(command="numerics")
    return parser
