"""What a training setup costs in memory, per parameter element: measured and expected.

``measure`` counts the bytes of the tensors a model and its optimizer actually hold, by category:

- ``weights``: the model's parameters;
- ``grads``: their ``.grad`` (or, with ``assume_grads=True``, one per trainable parameter in its
  dtype where none exists yet);
- ``optimizer_state``: the update rule's buffers: momentum, moments, Adagrad's ``sum``;
- ``master``: the master-weight strategy's buffers: ``master_weight`` (FP32 copy), ``trail``
  (split) or ``compensation`` (Kahan);
- ``accumulation``: the buffers of ``lowprec.accumulate`` (an FP32 sum or a compensation per
  BF16/FP16 parameter), when it is given one;
- ``other``: everything else in optimizer state, in practice the 0-d ``step`` counters (4 bytes
  per parameter tensor, not per element).

Each tensor is counted once by its storage (``untyped_storage()``: its data pointer and size), so
tied weights and views are not counted twice, and a tensor is charged for the whole storage it
keeps alive. Figures per element divide by the number of distinct parameter elements. For
DTensor parameters and state (FSDP2) the tensors are this rank's shards, so the figures are this
rank's bytes per element it holds.

``expected`` gives the same categories analytically for a model whose parameters are all in a
recipe's weight dtype, derived from the optimizer's own choices (its master strategy's buffers,
its ``state_dtype`` default, the buffers its update rule keeps) rather than from a hand-written
table; ``table`` lists every recipe, optionally beside a measurement of a real model.

On CUDA, ``cuda_peak`` adds what the tensor accounting leaves out: the allocator's peak during a
real training step (activations, temporaries, the allocator's rounding), from
``torch.cuda.max_memory_allocated``. ``lowprec.cli.memory_peak`` measures the peak of a whole step
on any device, each configuration in a fresh process, with and without ``step_in_backward``
(``lowprec memory --measure-peak``), and ``lowprec.cli.memory_plan`` gives what a model of a given
size needs per recipe (``lowprec memory --params 7B``).
"""

from __future__ import annotations

import copy
import gc
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from lowprec import recipes
from lowprec.optim import core, qstate
from lowprec.optim.base import LowPrecisionOptimizer
from lowprec.optim.dtensor import local
from lowprec.optim.storage import resolve_master

if TYPE_CHECKING:  # pragma: no cover
    from lowprec.accumulation import Accumulator

__all__ = [
    "CATEGORIES",
    "DEFAULT_HYPERPARAMETERS",
    "MemoryReport",
    "cuda_peak",
    "expected",
    "measure",
    "table",
]

#: The byte categories, in display order (``total`` is their sum).
CATEGORIES: tuple[str, ...] = ("weights", "grads", "optimizer_state", "master", "accumulation",
                               "other")

#: Hyperparameters ``expected``/``table`` use when given none: SGD with momentum (without it SGD
#: keeps no state at all), the other optimizers at their defaults.
DEFAULT_HYPERPARAMETERS: dict[str, dict[str, Any]] = {
    "sgd": {"lr": 1e-3, "momentum": 0.9},
    "adamw": {"lr": 1e-3},
    "adagrad": {"lr": 1e-2},
    "lamb": {"lr": 1e-3},
    "adam": {"lr": 1e-3},
    "radam": {"lr": 1e-3},
    "lion": {"lr": 1e-4},
    "stableadamw": {"lr": 1e-3},
    "adafactor": {"lr": 1e-2},
    "muon": {"lr": 1e-3},
}

#: Optimizers whose state on a whole model is not their per-element figure: ``expected`` gives the
#: bytes of the parameters the rule is for, and why the model's differ.
MIXED_STATE: dict[str, str] = {
    "muon": "muon: the state column is the momentum of the matrices Muon steps; the model's "
            "embeddings, head, norms and biases take AdamW's two moments (muon_param_groups)",
    "adafactor": "adafactor: no state per element; the measured total holds its row and column "
                 "means (FP32, O(rows + columns) per matrix) and the vectors' full second moment",
}

# State keys of master-weight strategies, for optimizers that are not lowprec's.
_MASTER_KEYS = ("master_weight", "trail", "compensation")


@dataclass(frozen=True)
class MemoryReport:
    """Bytes held by a model and its optimizer, by category.

    Attributes:
        numel: Distinct parameter elements (the denominator of ``bytes_per_param``).
        bytes: Absolute bytes per category of ``CATEGORIES``, plus ``"total"``.
        bytes_per_param: ``bytes`` divided by ``numel`` (all 0.0 for a model without parameters).
    """

    numel: int
    bytes: dict[str, int]
    bytes_per_param: dict[str, float]

    def as_dict(self) -> dict[str, Any]:
        """The fields as a plain dict (``dataclasses.asdict``), for JSON."""
        return asdict(self)


class _Counter:
    """Bytes per category, each storage counted once (by device and data pointer)."""

    def __init__(self) -> None:
        self.bytes = dict.fromkeys(CATEGORIES, 0)
        self._seen: set[tuple[str, int]] = set()

    def add(self, category: str, t: torch.Tensor) -> None:
        t = local(t)  # (this rank's shard: a DTensor has no storage)
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        if nbytes == 0:
            return
        key = (str(t.device), storage.data_ptr())
        if t.device.type == "meta" or key[1] == 0:
            # No real memory to deduplicate by: count the tensor's own bytes.
            self.bytes[category] += t.numel() * t.element_size()
            return
        if key not in self._seen:
            self._seen.add(key)
            self.bytes[category] += nbytes

    def add_bytes(self, category: str, n: int) -> None:
        self.bytes[category] += n


def _param_key(p: torch.Tensor) -> tuple[Any, ...]:
    p = local(p)
    return (str(p.device), p.untyped_storage().data_ptr(), p.storage_offset(), tuple(p.shape),
            p.stride())


def _state_categories(
    optimizer: torch.optim.Optimizer, p: torch.Tensor, group: dict[str, Any]
) -> dict[str, str]:
    """The category of each state key of ``p`` that the optimizer's own code names."""
    if not isinstance(optimizer, LowPrecisionOptimizer):
        return {}
    names = optimizer.rule(group).buffers(p)
    cats = dict.fromkeys((*names, *map(qstate.scale_key, names)), "optimizer_state")
    cats.update(dict.fromkeys(resolve_master(group["master"], p.dtype).buffers(p), "master"))
    return cats


@torch.no_grad()
def measure(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    assume_grads: bool = False,
    accumulator: Accumulator | None = None,
) -> MemoryReport:
    """Measure the bytes per parameter element that ``model`` and ``optimizer`` hold now.

    Optimizer state is created on the first step, so measure after one step to see it.

    Args:
        model: The model; all its parameters count as weights (frozen ones too).
        optimizer: Its optimizer, a lowprec one or any ``torch.optim.Optimizer`` (default: None,
            meaning no optimizer state). For lowprec optimizers the buffers are categorised by the
            names their code declares; for others ``master_weight``/``trail``/``compensation``
            count as master, 0-d tensors and ``step`` as other, and the rest as optimizer state.
        assume_grads: Count a gradient in the parameter's dtype for each trainable parameter
            whose ``.grad`` is None (default: False, meaning count only existing gradients).
        accumulator: The ``lowprec.Accumulator`` of ``lowprec.accumulate(model)``, whose
            buffers count as ``"accumulation"`` (default: None).

    Returns:
        A ``MemoryReport``.

    Raises:
        TypeError: ``model`` is not a module or ``optimizer`` not an optimizer.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"measure() takes an nn.Module, got {type(model).__name__}.")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}."
        )
    counter = _Counter()
    numel = 0
    seen_params: set[tuple[Any, ...]] = set()
    for p in model.parameters():  # parameters() already drops repeated (tied) Parameters
        key = _param_key(p)
        if key in seen_params:
            continue
        seen_params.add(key)
        numel += local(p).numel()
        counter.add("weights", p)
        if p.grad is not None:
            counter.add("grads", p.grad)
        elif assume_grads and p.requires_grad:
            counter.add_bytes("grads", local(p).numel() * p.element_size())
    if optimizer is not None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                state = optimizer.state.get(p)
                if not state:
                    continue
                named = _state_categories(optimizer, p, group)
                for k, v in state.items():
                    if not isinstance(v, torch.Tensor):
                        continue
                    if k in named:
                        cat = named[k]
                    elif k == "step" or v.dim() == 0:
                        cat = "other"
                    elif k in _MASTER_KEYS:
                        cat = "master"
                    else:
                        cat = "optimizer_state"
                    counter.add(cat, v)
    for buf in accumulator.buffers() if accumulator is not None else ():
        counter.add("accumulation", buf)
    by_cat = {**counter.bytes, "total": sum(counter.bytes.values())}
    per = {k: (v / numel if numel else 0.0) for k, v in by_cat.items()}
    return MemoryReport(numel=numel, bytes=by_cat, bytes_per_param=per)


def _in_backward(recipe: recipes.Recipe) -> bool:
    """Whether ``recipe`` steps each parameter during backward (``lowprec.step_in_backward``),
    which frees its gradient once stepped and cannot accumulate over micro-batches."""
    return bool(getattr(recipe, "step_in_backward", False))


def _check_optimizer_name(optimizer_name: str) -> str:
    key = optimizer_name.lower() if isinstance(optimizer_name, str) else optimizer_name
    if key not in DEFAULT_HYPERPARAMETERS:
        raise ValueError(
            f"unknown optimizer {optimizer_name!r}; choose one of "
            f"{', '.join(DEFAULT_HYPERPARAMETERS)}."
        )
    return key


def _hyperparameters(key: str, hyperparameters: dict[str, Any] | None) -> dict[str, Any]:
    if hyperparameters is None:
        return dict(DEFAULT_HYPERPARAMETERS[key])
    if not isinstance(hyperparameters, dict):
        raise TypeError(
            f"hyperparameters must be a dict or None, got {type(hyperparameters).__name__}."
        )
    return dict(hyperparameters)


def expected(
    optimizer_name: str,
    recipe_name: str,
    *,
    hyperparameters: dict[str, Any] | None = None,
    numels: list[int] | None = None,
    accumulate: str | None = None,
) -> dict[str, float]:
    """The analytic bytes per parameter element of a recipe with an optimizer.

    For a model whose parameters are all in the recipe's weight dtype (no layers kept in FP32),
    with gradients present and the optimizer's state created. The figures come from the
    optimizer the recipe builds: its master strategy's buffers and their dtypes, the dtype of its
    update-rule buffers (``state_dtype``, by default FP32 under ``"fp32"``/``"split"`` and the
    weight dtype otherwise; 8-bit or 4-bit codes and one FP32 scale per block of
    ``qstate.BLOCK``, FP32 for parameters too small for them) and the buffers the rule keeps
    with these hyperparameters.

    Args:
        optimizer_name: One of ``lowprec.comparison.config.OPTIMIZERS`` (``"adamw"``, ``"muon"``, ...).
        recipe_name: A recipe of ``lowprec.recipes.RECIPES``.
        hyperparameters: The optimizer's hyperparameters (default: None, meaning
            ``DEFAULT_HYPERPARAMETERS``: SGD with momentum 0.9, the others at their defaults).
            They matter where they add buffers (``momentum``, ``amsgrad``, ``state_dtype``).
        numels: The sizes of the model's parameters, which decide which of them get 8-bit state
            (default: None, one parameter large enough for it).
        accumulate: ``lowprec.accumulate``'s ``how`` (``"fp32"``, ``"kahan"``), whose buffers a
            BF16 or FP16 parameter then has (default: None, none).

    Returns:
        Bytes per element for each of ``CATEGORIES`` and ``"total"``; ``"other"`` is 0.0 (the
        4-byte step counters are per tensor, not per element). ``"grads"`` and
        ``"accumulation"`` are 0.0 for a recipe that steps each parameter in backward
        (``step_in_backward``): it frees each gradient once stepped, so none is held per
        element (one parameter's at a time: ``lowprec.cli.memory_peak``), and it cannot accumulate.

    Raises:
        ValueError: An unknown optimizer or recipe name.
    """
    key = _check_optimizer_name(optimizer_name)
    recipe = recipes.get(recipe_name)
    in_backward = _in_backward(recipe)
    # (a recipe stepping in backward installs its hooks on a model: one Linear's weight)
    holder = nn.Linear(2, 2, bias=False, dtype=recipe.param_dtype).requires_grad_(True)
    p = holder.weight
    opt = recipe.optimizer(key, holder if in_backward else [p],
                           **_hyperparameters(key, hyperparameters))
    group = core.group_of(opt, p)
    storage = resolve_master(group["master"], p.dtype)
    rule = opt.rule(group)

    def size(dtype: torch.dtype) -> float:
        return float(torch.empty((), dtype=dtype).element_size())

    def state_bytes(n: int) -> float:  # (per element of a parameter of n elements)
        dtype = core.state_dtype(group, torch.empty(n, dtype=p.dtype, device="meta"), storage)
        if dtype == torch.uint8:  # (8-bit or 4-bit codes and an FP32 scale per block)
            return qstate.element_bytes(qstate.BITS[group["state_dtype"]])
        return size(dtype)

    numels = numels or [1 << 20]
    state = sum(n * state_bytes(n) for n in numels) / sum(numels)
    out = {
        "weights": size(p.dtype),
        # (autograd gives a parameter a gradient of its own dtype; a recipe stepping in
        # backward frees each as soon as it is stepped: none per element)
        "grads": 0.0 if in_backward else size(p.dtype),
        # (buffers shaped like the parameter; Adafactor's row and column statistics are
        # O(rows + columns): nothing per element)
        "optimizer_state": state * sum(
            rule.buffer_shape(k, p) is None for k in rule.buffers(p)),
        "master": float(sum(size(d) for d in storage.buffers(p).values())),
        "accumulation": 0.0 if accumulate is None or p.dtype == torch.float32 or in_backward
        else size(torch.float32) if accumulate == "fp32" else size(p.dtype),
        "other": 0.0,
    }
    return {**out, "total": sum(out.values())}


@torch.no_grad()
def _measured_after_one_step(
    optimizer_name: str,
    recipe_name: str,
    model: nn.Module | Callable[[], nn.Module],
    hyperparameters: dict[str, Any],
    keep_fp32: tuple[type[nn.Module], ...] | None,
    seed: int,
    accumulate: str | None = None,
) -> MemoryReport:
    fresh = copy.deepcopy(model) if isinstance(model, nn.Module) else model()
    if not isinstance(fresh, nn.Module):
        raise TypeError(
            f"model must be an nn.Module or a function returning one, got a function returning "
            f"{type(fresh).__name__}."
        )
    overrides = {} if keep_fp32 is None else {"keep_fp32": tuple(keep_fp32)}
    recipe = recipes.get(recipe_name, **overrides)
    fresh = recipe.convert(fresh)
    params = [p for p in fresh.parameters() if p.requires_grad]
    in_backward = _in_backward(recipe)
    # (Muon: its two groups, from the model: optim.muon_param_groups; a recipe stepping in
    # backward installs its hooks on the model)
    opt = recipe.optimizer(optimizer_name,
                           fresh if optimizer_name == "muon" or in_backward else params,
                           **hyperparameters)
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        # Synthetic gradients: memory does not depend on their values, and no input is needed.
        g = torch.randn(p.shape, generator=gen, dtype=torch.float32).mul_(1e-3)
        p.grad = g.to(device=p.device, dtype=p.dtype)
    opt.step()  # the state is created lazily by the first step
    if in_backward:  # (its hooks free each gradient once stepped: none is left after a step)
        opt.zero_grad(set_to_none=True)
    accumulator = None
    if (accumulate is not None and not in_backward
            and any(p.dtype != torch.float32 for p in params)):
        from lowprec.accumulation import accumulate as install

        accumulator = install(fresh, how=accumulate)
    return measure(fresh, opt, accumulator=accumulator)


def table(
    optimizer_name: str,
    *,
    model: nn.Module | Callable[[], nn.Module] | None = None,
    hyperparameters: dict[str, Any] | None = None,
    keep_fp32: tuple[type[nn.Module], ...] | None = None,
    seed: int = 0,
    accumulate: str | None = None,
    loss_fn: Callable[[nn.Module], torch.Tensor] | None = None,
) -> list[dict[str, Any]]:
    """Bytes per parameter element of every recipe with one optimizer, expected and measured.

    Args:
        optimizer_name: One of ``lowprec.comparison.config.OPTIMIZERS`` (``"adamw"``, ``"muon"``, ...).
        model: A model, or a function returning a fresh one (default: None, meaning no
            measurement). For each recipe a copy (a module is deep-copied, a function called) is
            converted, given random gradients and stepped once, then measured.
        hyperparameters: The optimizer's hyperparameters (default: None, meaning
            ``DEFAULT_HYPERPARAMETERS``).
        keep_fp32: Layer types the recipes keep in FP32 when converting (default: None, meaning
            each recipe's own choice, the normalization layers). Pass ``()`` to convert every
            layer, the assumption of the expected figures.
        seed: Seed of the synthetic gradients (default: 0).
        accumulate: ``lowprec.accumulate``'s ``how`` for every recipe with BF16 or FP16
            weights (default: None, no accumulation buffers).
        loss_fn: ``loss_fn(model) -> loss`` on a batch, for a model on a CUDA device: each row
            then adds the allocator's bytes of a real training step (``cuda_peak``)
            (default: None, no peak).

    Returns:
        One dict per recipe, in ``recipes.RECIPES`` order: ``"recipe"``, ``"optimizer"``,
        ``"expected"`` (``expected()``'s dict), ``"measured"`` (``MemoryReport.bytes_per_param``
        after one step, or None without a model), ``"measured_bytes"``
        (``MemoryReport.bytes``, or None) and ``"cuda_peak"`` (``cuda_peak()``'s dict, or None
        without ``loss_fn``).

    Raises:
        ValueError: An unknown optimizer name, or ``loss_fn`` without a model on CUDA.
        TypeError: ``model`` is neither a module nor a function returning one.
    """
    key = _check_optimizer_name(optimizer_name)
    if model is not None and not (isinstance(model, nn.Module) or callable(model)):
        raise TypeError(
            f"model must be an nn.Module, a function returning one, or None; got "
            f"{type(model).__name__}."
        )
    hp = _hyperparameters(key, hyperparameters)
    numels = None
    if model is not None:  # (which of its parameters get 8-bit state: their sizes)
        sample = model if isinstance(model, nn.Module) else model()
        if not isinstance(sample, nn.Module):
            raise TypeError(
                f"model must be an nn.Module or a function returning one, got a function "
                f"returning {type(sample).__name__}."
            )
        numels = [p.numel() for p in sample.parameters() if p.requires_grad]
    if loss_fn is not None and (model is None or not _on_cuda(sample)):
        raise ValueError("loss_fn measures the CUDA allocator's peak: give a model on a CUDA "
                         "device (model.cuda()), or leave loss_fn out.")
    rows = []
    for name in recipes.RECIPES:
        row: dict[str, Any] = {
            "recipe": name,
            "optimizer": key,
            "expected": expected(key, name, hyperparameters=hp, numels=numels,
                                 accumulate=accumulate),
            "measured": None,
            "measured_bytes": None,
            "cuda_peak": None,
        }
        if model is not None:
            report = _measured_after_one_step(key, name, model, hp, keep_fp32, seed,
                                              accumulate)
            row["measured"] = report.bytes_per_param
            row["measured_bytes"] = report.bytes
        if loss_fn is not None:
            # (loss_fn needs a model: checked above)
            row["cuda_peak"] = cuda_peak(key, name,
                                         cast("nn.Module | Callable[[], nn.Module]", model),
                                         loss_fn, hyperparameters=hp, keep_fp32=keep_fp32)
        rows.append(row)
    return rows


def _on_cuda(model: nn.Module) -> bool:
    first = next(model.parameters(), None)
    return first is not None and first.device.type == "cuda"


def cuda_peak(
    optimizer_name: str,
    recipe_name: str,
    model: nn.Module | Callable[[], nn.Module],
    loss_fn: Callable[[nn.Module], torch.Tensor],
    *,
    hyperparameters: dict[str, Any] | None = None,
    keep_fp32: tuple[type[nn.Module], ...] | None = None,
) -> dict[str, int]:
    """The CUDA allocator's bytes for one training step of a recipe: held between steps, and
    the peak during a step.

    A copy of ``model`` (on a CUDA device; a module is deep-copied, a function called) is
    converted by the recipe, given its optimizer, and trained one step: ``loss_fn(model)`` under
    the recipe's autocast, its (scaled) backward and step, which creates the optimizer's state
    (and compiles a fused step). Then ``torch.cuda.reset_peak_memory_stats`` and a second step,
    gradients set to None first as a training loop does. Both figures are counted from what the
    device held before the copy was made, so the process's other tensors are left out.

    Args:
        optimizer_name: One of ``lowprec.comparison.config.OPTIMIZERS`` (``"adamw"``, ``"muon"``, ...).
        recipe_name: A recipe of ``lowprec.recipes.RECIPES``.
        model: A model on a CUDA device, or a function returning a fresh one.
        loss_fn: ``loss_fn(model) -> loss``: the forward on a batch of the caller's.
        hyperparameters: The optimizer's (default: None, ``DEFAULT_HYPERPARAMETERS``).
        keep_fp32: Layer types the recipe keeps in FP32 (default: None, the recipe's own).

    Returns:
        ``{"held": bytes allocated after the first step (weights, gradients, optimizer state,
        the scaler's), "peak": torch.cuda.max_memory_allocated during the second step}``; the
        peak is at least the held bytes.

    Raises:
        ValueError: An unknown optimizer or recipe name, or a model not on a CUDA device.
    """
    key = _check_optimizer_name(optimizer_name)
    hp = _hyperparameters(key, hyperparameters)
    overrides = {} if keep_fp32 is None else {"keep_fp32": tuple(keep_fp32)}
    recipe = recipes.get(recipe_name, **overrides)
    gc.collect()  # (the copies of the rows before: freed, so not in the baseline)
    gpus = range(torch.cuda.device_count()) if torch.cuda.is_available() else ()
    base = {i: torch.cuda.memory_allocated(i) for i in gpus}  # (before the copy is made)
    fresh = copy.deepcopy(model) if isinstance(model, nn.Module) else model()
    if not isinstance(fresh, nn.Module) or not _on_cuda(fresh):
        raise ValueError("cuda_peak() measures a model on a CUDA device: move it there first "
                         "(model.cuda()), or pass a function that builds it there.")
    device = next(fresh.parameters()).device
    fresh = recipe.convert(fresh)
    whole = key == "muon" or _in_backward(recipe)  # (Muon's groups; the in-backward hooks)
    opt = recipe.optimizer(
        key, fresh if whole else [p for p in fresh.parameters() if p.requires_grad], **hp)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with recipe.autocast(device.type):
            loss = loss_fn(fresh)
        recipe.backward(loss)
        recipe.step(opt)
        torch.cuda.synchronize(device)

    step()  # the optimizer's state is created lazily, by the first step
    held = torch.cuda.memory_allocated(device) - base[device.index]
    torch.cuda.reset_peak_memory_stats(device)  # (the peak starts again from what is held now)
    step()
    return {"held": held, "peak": torch.cuda.max_memory_allocated(device) - base[device.index]}
