"""One training step's memory, measured in a process of its own:
``python -m lowprec.cli.memory_probe``.

``lowprec.cli.memory_peak`` starts this module in a fresh interpreter per configuration (a recipe,
with or without ``lowprec.step_in_backward``), so that nothing of the caller's (its tensors, its
allocator's free lists, another configuration's kernels) is in the figures. It builds a deep MLP
(``depth`` bias-free ``nn.Linear(width, width)`` layers with ReLUs between them: no parameter over
1/depth of the whole, so the optimizer's share dominates and one parameter's gradient is small),
converts it with the recipe, takes ``warmup`` steps (the optimizer's state is created lazily and
compiled kernels load on the first step), and then measures one more whole step (forward,
backward, step) two ways:

* **measured**: on the CPU, the process's peak resident memory over what it held before the step
  (Linux: ``VmRSS`` read, the peak reset by writing 5 to ``/proc/self/clear_refs``, the step run,
  ``VmHWM`` read; where ``clear_refs`` cannot be written, ``resource.getrusage``'s lifetime peak,
  which then includes the warm-up steps and says so). The parent sets ``MALLOC_MMAP_THRESHOLD_``
  so that glibc returns a freed tensor's pages at once rather than keeping them for reuse:
  otherwise the gradients of the warm-up steps would already be resident at the baseline. On
  CUDA, ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, over
  ``memory_allocated`` before the step.
* **accounted**: the tensors by category at the peak of the step (``lowprec.memory.measure``'s
  weights, optimizer state, master and other), with the gradients counted as the most gradient
  bytes alive at once: a post-accumulate-grad hook on every parameter, registered before
  ``step_in_backward``'s so that it runs first, adds up the ``.grad`` storages alive after each
  accumulation, and the normal path adds up all of them once more when ``optimizer.step()`` is
  called.

The result is one JSON object on stdout (``run``'s dict). ``run`` can be called in-process too
(the tests do, for the accounting); only its ``measured`` figures need the fresh process.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import sys
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:  # (torch is imported when the probe runs)
    import torch
    from torch import nn

    from lowprec.optim import LowPrecisionOptimizer, StepInBackward

__all__ = ["DEFAULTS", "build_model", "main", "run"]

#: The probe model and step: depth x (width x width) bias-free Linear layers, batch rows.
DEFAULTS: dict[str, int] = {"depth": 32, "width": 1024, "batch": 8, "warmup": 2}

_CLEAR_REFS = "/proc/self/clear_refs"


def build_model(depth: int, width: int) -> nn.Sequential:
    """The probe's model: ``depth`` bias-free ``Linear(width, width)`` with ReLUs between."""
    from torch import nn

    layers: list[nn.Module] = []
    for i in range(depth):
        layers.append(nn.Linear(width, width, bias=False))
        if i < depth - 1:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak() -> bool:
    """Reset the kernel's peak RSS (VmHWM) to the current RSS; False where it cannot be."""
    try:
        with open(_CLEAR_REFS, "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def _rusage_peak_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # (bytes on macOS, KiB on Linux)


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    return (str(t.device), t.untyped_storage().data_ptr())


class _GradTracker:
    """The most ``.grad`` bytes alive at once, sampled after each accumulation and at ``step``."""

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        self.params = list(params)
        self.peak = 0
        self.samples = 0
        self.handles = [p.register_post_accumulate_grad_hook(self._hook) for p in self.params]

    def live(self) -> int:
        seen: set[tuple[str, int]] = set()
        total = 0
        for p in self.params:
            g = p.grad
            if g is None:
                continue
            key = _storage_key(g)
            if key not in seen:
                seen.add(key)
                total += g.untyped_storage().nbytes()
        return total

    def sample(self) -> None:
        self.samples += 1
        self.peak = max(self.peak, self.live())

    def _hook(self, _p: torch.Tensor) -> None:
        self.sample()

    def reset(self) -> None:
        self.peak, self.samples = 0, 0

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _install_in_backward(model: nn.Module, opt: LowPrecisionOptimizer) -> StepInBackward:
    import lowprec

    return lowprec.step_in_backward(model, opt)


def run(
    recipe_name: str,
    optimizer_name: str = "adamw",
    *,
    in_backward: bool | None = None,
    depth: int = DEFAULTS["depth"],
    width: int = DEFAULTS["width"],
    batch: int = DEFAULTS["batch"],
    warmup: int = DEFAULTS["warmup"],
    device: str = "cpu",
    seed: int = 0,
) -> dict[str, Any]:
    """Train the probe model ``warmup`` steps under a recipe, then measure one step.

    Args:
        recipe_name: A recipe of ``lowprec.recipes.RECIPES``.
        optimizer_name: The optimizer (default: ``"adamw"``), at ``memory``'s default
            hyperparameters.
        in_backward: Step each parameter during backward (``lowprec.step_in_backward``)
            (default: None, the recipe's own ``step_in_backward``, False where it has none).
        depth, width: The model's Linear layers and their width.
        batch: Rows of the step's input.
        warmup: Steps before the measured one (at least 1: the state is created by the first).
        device: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
        seed: Seed of the weights and inputs.

    Returns:
        A JSON-ready dict: the configuration, ``numel``, ``largest`` (the largest parameter's
        elements), ``accounted`` (bytes by category at the step's peak, and ``"total"``),
        ``accounted_per_param``, ``grad_samples``, ``measured`` (``{"how", "baseline",
        "peak", "over_baseline"}`` in bytes, ``"note"`` where it falls back) and ``seconds``.
    """
    import torch

    from lowprec import memory, recipes
    from lowprec.optim.core import stages

    if warmup < 1:
        raise ValueError(f"warmup must be at least 1 (the first step creates the state), got "
                         f"{warmup}.")
    recipe = recipes.get(recipe_name)
    own = bool(getattr(recipe, "step_in_backward", False))
    in_backward = own if in_backward is None else bool(in_backward)
    key = memory._check_optimizer_name(optimizer_name)
    dev = torch.device(device)
    torch.manual_seed(seed)
    model = recipe.convert(build_model(depth, width).to(dev))
    params = [p for p in model.parameters() if p.requires_grad]
    # (before any step_in_backward hook, a recipe's included: it sees each gradient first)
    tracker = _GradTracker(params)
    # (Muon's groups, and a recipe stepping in backward installs its hooks: from the model)
    opt = recipe.optimizer(key, model if key == "muon" or own else params,
                           **memory._hyperparameters(key, None))
    handle = stages(opt).in_backward  # (the recipe's own StepInBackward)
    if handle is not None and not in_backward:
        handle.remove()  # (the recipe's way, undone: the normal step to compare with)
        handle = None
    elif handle is None and in_backward:
        handle = _install_in_backward(model, opt)
    gen = torch.Generator(device=dev).manual_seed(seed)
    x = torch.randn(batch, width, generator=gen, device=dev)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with recipe.autocast(dev.type):
            loss = model(x).float().pow(2).mean()
        recipe.backward(loss)
        del loss
        if not in_backward:
            tracker.sample()  # (every gradient is alive when the optimizer steps)
        recipe.step(opt)

    for _ in range(warmup):
        step()
    opt.zero_grad(set_to_none=True)
    gc.collect()
    tracker.reset()
    cuda = dev.type == "cuda"
    measured: dict[str, Any]
    t0 = time.perf_counter()
    if cuda:
        torch.cuda.synchronize(dev)
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        step()
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev)
        measured = {"how": "torch.cuda.max_memory_allocated", "baseline": base, "peak": peak}
    else:
        rss = _status_kib("VmRSS")
        if rss is not None and _reset_peak():
            # (/proc/self/status was read just above: its VmRSS and VmHWM are there)
            base = cast(int, _status_kib("VmRSS")) * 1024
            step()
            measured = {"how": "VmHWM after clear_refs", "baseline": base,
                        "peak": cast(int, _status_kib("VmHWM")) * 1024}
        else:
            base = (rss * 1024) if rss is not None else _rusage_peak_bytes()
            step()
            measured = {"how": "getrusage ru_maxrss", "baseline": base,
                        "peak": _rusage_peak_bytes(),
                        "note": "/proc/self/clear_refs could not be written: the peak is the "
                                "process's lifetime peak, warm-up steps included"}
    seconds = time.perf_counter() - t0
    measured["over_baseline"] = measured["peak"] - measured["baseline"]
    grads_peak = tracker.peak
    if handle is not None:
        handle.remove()
    tracker.remove()
    report = memory.measure(model, opt)  # (gradients are gone or set to None: counted apart)
    accounted = {k: report.bytes[k] for k in memory.CATEGORIES}
    accounted["grads"] = grads_peak
    accounted["total"] = sum(accounted.values())
    numel = report.numel
    return {
        "recipe": recipe_name,
        "optimizer": key,
        "in_backward": in_backward,
        "recipe_in_backward": own,
        "depth": depth,
        "width": width,
        "batch": batch,
        "warmup": warmup,
        "device": str(dev),
        "numel": numel,
        "largest": max(p.numel() for p in params),
        "accounted": accounted,
        "accounted_per_param": {k: v / numel for k, v in accounted.items()},
        "grad_samples": tracker.samples,
        "measured": measured,
        "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
        "seconds": seconds,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lowprec.cli.memory_probe",
                                description="Measure one training step's memory; JSON on stdout.")
    p.add_argument("--recipe", required=True)
    p.add_argument("--optimizer", default="adamw")
    p.add_argument("--in-backward", choices=("yes", "no", "recipe"), default="recipe")
    for name, value in DEFAULTS.items():
        p.add_argument(f"--{name}", type=int, default=value)
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    flag = {"yes": True, "no": False, "recipe": None}[args.in_backward]
    try:
        out = run(args.recipe, args.optimizer, in_backward=flag, depth=args.depth,
                  width=args.width, batch=args.batch, warmup=args.warmup, device=args.device,
                  seed=args.seed)
    except Exception as exc:  # (the parent reports it in its table)
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
        return 1
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
