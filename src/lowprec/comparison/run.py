"""One recipe's training run on the built-in task: ``_Run`` steps it batch by batch,
``run_recipe`` runs one alone; ``task_data`` gives a seed's batches and initial weights,
``resolve_device`` the device it runs on. ``lowprec.comparison.compare`` takes every recipe's steps in
turn; ``lowprec.comparison.pretrained`` pretrains the finetune task's start with one fp32 run.

Everything runs on ``cfg.device`` (``resolve_device``: ``"auto"`` is CUDA where torch finds it):
the models (built on the CPU from one seeded FP32 state, so every device starts from the same
weights, then moved), the batches and the eval batches; each recipe's autocast is entered for
that device's type, and its loss scaler lives where its loss does. On CUDA a step's time is read
after ``torch.cuda.synchronize``, so it is the step's run time, not the time its kernels took to
be queued.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, cast

import torch

from lowprec import diagnostics, memory, products
from lowprec import recipes as recipes_mod
from lowprec.comparison import config
from lowprec.comparison.config import CompareConfig, ModelConfig, check_device
from lowprec.comparison.summary import WARMUP_STEPS, _quartiles, _steady
from lowprec.comparison.task import (
    Batches,
    CharTransformer,
    Task,
    default_loss,
    load_prose,
    load_text,
)

__all__ = ["device_info", "resolve_device", "run_recipe", "task_data", "task_loss"]

# The command lists and checks recipe names without importing torch (config.RECIPES); the
# library's recipes must be those (the library imports nothing of the command, so the check is
# here, where compare and memory's table first build recipes).
if recipes_mod.RECIPES != config.RECIPES:
    raise ImportError(f"lowprec.comparison.config.RECIPES {config.RECIPES} must name the recipes defined "
                      f"in lowprec.recipes, {recipes_mod.RECIPES}, in the same order.")


def resolve_device(device: str = "auto") -> torch.device:
    """The ``torch.device`` that ``device`` (``CompareConfig.device``) names on this machine.

    ``"auto"`` is the current CUDA device where ``torch.cuda.is_available()``, else the CPU.

    Raises:
        ValueError: A spelling ``config.check_device`` refuses, CUDA asked for where torch finds
            none, or a GPU index this machine does not have.
    """
    check_device(device)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type != "cuda":
        return dev
    if not torch.cuda.is_available():
        why = ("this torch is a CPU-only build" if torch.version.cuda is None
               else "torch finds no CUDA GPU")
        raise ValueError(f"no CUDA device: {why} (torch {torch.__version__}); train on the CPU "
                         "(--device cpu, or auto, which picks CUDA only where there is one), "
                         "or on a machine with a GPU and a CUDA build of torch.")
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        raise ValueError(f"no CUDA device {dev.index}: this machine has {count} CUDA "
                         f"device(s): choose cuda:0 to cuda:{count - 1}.")
    return torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)


def device_info(device: torch.device) -> dict[str, Any]:
    """What ran the steps, for the JSON and the header: ``{"device": "cuda:0", "type": "cuda",
    "name": the GPU's name (``torch.cuda.get_device_name``) or the CPU's model}``, and for a GPU
    its memory, compute capability and torch's CUDA version."""
    info: dict[str, Any] = {"device": str(device), "type": device.type}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(name=torch.cuda.get_device_name(device), total_memory=props.total_memory,
                    capability=f"{props.major}.{props.minor}", cuda=torch.version.cuda)
    else:
        info["name"] = _cpu_name()
        # Whether torch's BF16 matmul has a fast kernel on this CPU (oneDNN, with AVX-512 BF16
        # or AMX); where not, Recipe.autocast computes BF16 products in FP32
        # (products.bf16_products_in_fp32, which LOWPREC_BF16_PRODUCTS may set either way).
        info["fast_bf16_matmul"] = products.cpu_has_fast_bf16_matmul()
    return info


def _cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``, else ``platform.processor()``), or "CPU"."""
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "CPU"


def _schedule(cfg: CompareConfig) -> Callable[[int], float]:
    """The learning rate's factor at each step: a linear warm-up over ``cfg.warmup`` of the
    steps, then ``cfg.lr_schedule``: cosine decay to 10% of the peak, or the peak throughout."""
    steps = cast(int, cfg.steps)  # (set: __post_init__ replaced a None with the task's)
    warm = max(1, int(cfg.warmup * steps))
    cosine = cfg.lr_schedule == "cosine"

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        if not cosine:
            return 1.0
        progress = (step - warm) / max(1, steps - warm)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def _text(cfg: CompareConfig) -> torch.Tensor:
    """The text ``cfg.task`` trains on: ``pydoc_data``'s prose for ``finetune``, the standard
    library's sources for ``pretrain``."""
    return load_prose() if cfg.task == "finetune" else load_text(cfg.text_bytes)


def _seed_data(cfg: CompareConfig, device: torch.device, seed: int, text: torch.Tensor,
               pretrained: dict[str, torch.Tensor] | None,
               ) -> tuple[Batches, dict[str, torch.Tensor]]:
    if cfg.task == "finetune":
        if pretrained is None:
            raise ValueError("the finetune task starts from pretrained weights: pass "
                             "pretrained=lowprec.comparison.pretrained.pretrained(cfg, device)[0].")
        initial = pretrained
    else:
        torch.manual_seed(seed)
        initial = copy.deepcopy(CharTransformer(cfg.model).state_dict())
    # (every seed is measured on the first seed's held-out windows: the spread over seeds is the
    # training's, not the sampling of the eval set's)
    batches = Batches(text, context=cfg.model.context, batch_size=cfg.batch_size, seed=seed,
                      eval_seed=cfg.seed + 1, device=device)
    return batches, initial


def task_data(cfg: CompareConfig, device: torch.device, seed: int, *,
              pretrained: dict[str, torch.Tensor] | None = None,
              ) -> tuple[Batches, dict[str, torch.Tensor]]:
    """The batches and initial FP32 weights of one seed's runs of ``cfg.task``.

    ``pretrain``: windows of the standard library's sources and seeded random weights.
    ``finetune``: windows of ``pydoc_data``'s prose and ``pretrained`` (required: the weights
    ``lowprec.comparison.pretrained.pretrained`` returns, the same for every seed).
    """
    return _seed_data(cfg, device, seed, _text(cfg), pretrained)


def builtin_task(cfg: CompareConfig, device: torch.device, *,
                 pretrained: dict[str, torch.Tensor] | None = None) -> Task:
    """``cfg.task`` (``pretrain`` or ``finetune``) as a ``Task``: each seed's model and
    batches as ``task_data`` gives them (the text read once), the first seed's held-out
    windows, the default loss."""
    text = _text(cfg)

    def model(seed: int) -> torch.nn.Module:
        net = CharTransformer(cfg.model)
        net.load_state_dict(_seed_data(cfg, device, seed, text, pretrained)[1])
        return net

    def train(seed: int) -> Iterator[Any]:
        batches = _seed_data(cfg, device, seed, text, pretrained)[0]
        return batches.train_batches(cast(int, cfg.steps))

    held_out = _seed_data(cfg, device, cfg.seed, text, pretrained)[0]
    return Task(model=model, train=train, eval=held_out.eval_batches(cfg.eval_batches),
                name=f"{cfg.task} (built-in)")


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor in it (in dicts, tuples and lists, at any depth) on
    ``device`` (no copy where it is there already)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, list):
        return [to_device(v, device) for v in batch]
    if isinstance(batch, tuple):
        return tuple(to_device(v, device) for v in batch)
    return batch


def task_loss(model: ModelConfig, batch_size: int, device: torch.device | str,
              seed: int = 0) -> Callable[[torch.nn.Module], torch.Tensor]:
    """``loss_fn(model)``: the built-in task's loss on one fixed batch of random bytes on
    ``device``, for ``memory.cuda_peak`` (a step's memory does not depend on which bytes)."""
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, 256, (batch_size, model.context + 1), generator=gen).to(device)
    x, y = idx[:, :-1], idx[:, 1:]
    return lambda m: default_loss(m, (x, y))


def check_start(task: Task, start: torch.nn.Module, batch: Any, device: torch.device) -> None:
    """Refuse a seed's start before its first step: ``start`` must have trainable FP32
    parameters, and ``task.loss`` of (a copy of) it on ``batch`` must be a finite scalar tensor.

    Raises:
        ValueError: No trainable floating-point parameter, one that is not FP32, or a loss that
            is not one finite number.
        TypeError: ``start`` is not a module, or the loss does not take the batch.
    """
    if not isinstance(start, torch.nn.Module):
        raise TypeError(f"the task's model is a {type(start).__name__}, not an nn.Module.")
    floats = [p for p in start.parameters() if p.is_floating_point() and p.requires_grad]
    if not floats:
        raise ValueError("the model has no trainable floating-point parameters: nothing for a "
                         "recipe to train (are they all frozen?).")
    low = sorted({str(p.dtype).removeprefix("torch.") for p in floats
                  if p.dtype != torch.float32})
    if low:
        raise ValueError(f"the model's parameters are {', '.join(low)}, not FP32: give the "
                         "model in FP32 (each recipe casts its own copy, keeping the FP32 "
                         "values for its master), e.g. model.float().")
    model = copy.deepcopy(start).to(device)
    with torch.no_grad():
        value = task.loss(model, to_device(batch, device))
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        got = (f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor)
               else f"a {type(value).__name__}")
        raise ValueError(f"the loss must be a scalar tensor, got {got}: return one number "
                         "(e.g. .mean() over the batch).")
    if not torch.isfinite(value).all():
        raise ValueError(f"the loss of the FP32 model on the first batch is {float(value)}: "
                         "check the model, the batch and the loss before comparing recipes.")


@torch.no_grad()
def _evaluate(model: torch.nn.Module, recipe: recipes_mod.Recipe, batches: Iterable[Any],
              device: torch.device,
              loss: Callable[[torch.nn.Module, Any], torch.Tensor] = default_loss) -> float:
    model.eval()
    try:
        with recipe.autocast(device.type):
            return statistics.fmean(float(loss(model, to_device(b, device))) for b in batches)
    finally:
        model.train()


class _Run:
    """One recipe's training run, stepped one batch at a time (``compare`` takes the recipes'
    steps in turn; ``run_recipe`` runs one alone) from a copy of ``start``, the task's FP32
    model for this seed. Its eval loss before training is measured when it is built
    (``eval_before``), on ``task``'s held-out batches."""

    def __init__(self, name: str, cfg: CompareConfig, start: torch.nn.Module, task: Task,
                 seed: int | None = None) -> None:
        self.name, self.cfg, self.task = name, cfg, task
        self.seed = cfg.seed if seed is None else seed
        self.device = resolve_device(cfg.device)
        self.recipe = recipe = recipes_mod.get(name)
        if recipe.gemms is not None and cfg.fused is False:  # (--no-fused: nothing compiles)
            recipe.gemms = dataclasses.replace(recipe.gemms, compiled=False)
        model = copy.deepcopy(start).to(self.device)
        self.model = model = recipe.convert(model, fp32_values=cfg.fp32_values)
        self.eval_before = _evaluate(model, recipe, task.eval, self.device, task.loss)
        hp: dict[str, Any] = {"lr": cfg.peak_lr, "fused": cfg.fused}
        if cfg.optimizer == "sgd":
            hp["momentum"] = 0.9
        if cfg.optimizer in ("adamw", "lamb"):
            hp["weight_decay"] = 0.01
        if cfg.optimizer == "muon":  # (AdamW for the embeddings, head, norms and biases)
            hp["adamw"] = {"lr": cfg.adamw_lr, "weight_decay": 0.01}
        hp.update(cfg.optimizer_options)  # (the caller's hyperparameters: betas, decay, ...)
        self.opt = recipe.optimizer(cfg.optimizer, model, seed=self.seed, **hp)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, _schedule(cfg))
        self.monitor = None
        # (a step inside backward has moved the weights before the monitor could preview it; its
        # updates are those of the same recipe stepped normally, bit for bit)
        if cfg.monitor_every and not recipe.step_in_backward:
            self.monitor = diagnostics.UpdateMonitor(
                model, self.opt, every=cfg.monitor_every, scaler=recipe.scaler
            )
        self.losses: list[float] = []
        self.times: list[float] = []
        self.skipped = 0
        self.products_in_fp32: str | None = None

    def step(self, batch: Any) -> float:
        """One training step on ``batch``; returns its loss (NaN for inf or NaN)."""
        recipe, model, opt, monitor = self.recipe, self.model, self.opt, self.monitor
        batch = to_device(batch, self.device)
        start = self._clock()
        opt.zero_grad(set_to_none=True)
        context = recipe.autocast(self.device.type)
        # (which 16-bit products this CPU computes in FP32, for the record and the table's marks)
        self.products_in_fp32 = _products_in_fp32(context)
        with context:
            loss = self.task.loss(model, batch)
        recipe.backward(loss)
        with monitor.step() if monitor is not None else contextlib.nullcontext():
            stepped = recipe.step(opt)
        if stepped:
            self.sched.step()
        else:
            self.skipped += 1
        self.times.append(self._clock() - start)
        value = float(loss.detach())
        value = value if math.isfinite(value) else float("nan")
        self.losses.append(value)
        return value

    def _clock(self) -> float:
        """``time.perf_counter()`` once the device has finished the work queued on it (on CUDA
        the calls return when the kernels are queued, not run)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def record(self) -> dict[str, Any]:
        """The run's record (the steps taken so far), with its eval loss and memory."""
        monitor, task = self.monitor, self.task
        losses, times = self.losses, self.times
        tail = [v for v in losses[-max(1, len(losses) // 10):] if math.isfinite(v)]
        mem = memory.measure(self.model, self.opt)
        lost = parameters = None
        if monitor is not None:
            # What the training trajectory loses: updates that left the master value unchanged
            # (for Kahan, split and an FP32 copy the stored BF16/FP16 weight may lag while the
            # master keeps the update).
            lost = monitor.master_lost_fraction
            if lost is None:
                lost = monitor.lost_update_fraction
            parameters = _parameters(monitor.report())
            monitor.close()
        steady = _steady(times)
        median = statistics.median(steady)
        recipe = self.recipe
        return {
            "recipe": self.name,
            "seed": self.seed,
            "eval_before": self.eval_before,
            "final_loss": statistics.fmean(tail) if tail else float("nan"),
            "eval_loss": _evaluate(self.model, self.recipe, task.eval, self.device, task.loss),
            "step_time_s": median,
            "step_time_iqr_s": _quartiles(steady),
            # What the first steps took beyond two steady ones: the fused step's compilation.
            "warmup_s": max(0.0, sum(times[:WARMUP_STEPS]) - median * len(times[:WARMUP_STEPS])),
            "step_times_s": times,
            "bytes_per_param": mem.bytes_per_param,
            "lost_update_fraction": lost,
            "stored_unchanged_fraction": (
                monitor.lost_update_fraction if monitor is not None else None
            ),
            "skipped_steps": self.skipped,
            "parameters": parameters,
            "losses": losses,
            "description": recipe.description,
            # What the recommendation's lost-update rule reads (``summary.recommend``).
            "weights": str(recipe.param_dtype).removeprefix("torch."),
            "master": recipe.master,
            "rounding": "stochastic" if recipe.master == "stochastic" else "nearest",
            # "bfloat16"/"float16" where the steps' products of that dtype were computed in FP32
            # and rounded to it (products.LowPrecisionProductsInFP32: a CPU without that
            # arithmetic), so their step times are not the dtype's hardware's; else None.
            "products_in_fp32": self.products_in_fp32,
        }


def _parameters(report: diagnostics.UpdateReport) -> list[dict[str, Any]]:
    """Per parameter (its name in ``named_parameters()``: a tied one once), what the monitored
    steps lost of its updates: ``lost_fraction``, those its master kept unchanged (the weight
    itself where there is no master), ``stored_unchanged_fraction``, those that left the stored
    weight unchanged, and ``share``, its part of the trained elements (a frozen parameter, never
    stepped, is left out)."""
    trained = [p for p in report.params if p.steps]  # (frozen ones are not: no gradient)
    total = sum(p.numel for p in trained) or 1
    return [{"name": p.name, "numel": p.numel, "share": p.numel / total, "dtype": p.dtype,
             "master": p.master, "lost_fraction": p.effective_lost_fraction,
             "stored_unchanged_fraction": p.lost_fraction} for p in trained]


def _products_in_fp32(context: Any) -> str | None:
    """The dtype (``"bfloat16"``, ``"float16"``) whose products the forward context ``context``
    (``Recipe.autocast``'s) computes in FP32, or None."""
    if isinstance(context, products.LowPrecisionProductsInFP32):
        return str(context.dtype).removeprefix("torch.")
    return None


def run_recipe(
    name: str,
    cfg: CompareConfig,
    batches: Batches,
    initial: dict[str, torch.Tensor],
    *,
    on_step: Callable[[int, float], None] | None = None,
) -> dict[str, Any]:
    """Train one recipe alone on the built-in model from the ``initial`` FP32 weights and
    ``batches`` and return its record (its seed: ``batches.seed``)."""
    start = CharTransformer(cfg.model)
    start.load_state_dict(initial)
    steps = cast(int, cfg.steps)  # (set: __post_init__ replaced a None with the task's)
    task = Task(model=lambda seed: start, train=lambda seed: batches.train_batches(steps),
                eval=batches.eval_batches(cfg.eval_batches))
    run = _Run(name, cfg, start, task, batches.seed)
    for step, batch in enumerate(task.train(batches.seed)):
        loss = run.step(batch)
        if on_step is not None:
            on_step(step, loss)
    return run.record()
