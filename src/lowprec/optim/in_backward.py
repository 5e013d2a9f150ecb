"""The update inside backward: ``lowprec.step_in_backward(model, optimizer)``.

A training step normally holds every gradient at once: backward writes them all, then
``optimizer.step()`` reads them. With BF16 weights that is 2 bytes per parameter, as much as the
weights themselves. ``step_in_backward`` steps each parameter in its post-accumulate-grad hook,
as soon as autograd has summed its gradient, and frees the gradient right after, so that only
the gradients autograd is still producing exist at any moment (optimi's "gradient release",
torch's private ``_apply_optimizer_in_backward``).

It runs the optimizer's own per-parameter step (``driver._step_param``, compiled where the step
is fused), with the numbers of the parameter's group made once per step, so the result equals
the same optimizer stepped normally bit for bit, for every optimizer and ``master=`` strategy:
each parameter's update depends on its own gradient and state alone (LAMB's and StableAdamW's
norms are per tensor; stochastic rounding's key is the parameter's index and step). Small
parameters (biases, norms: ``batches._SMALL`` elements or fewer) are stepped together at the
end of backward (``queue_callback``), in the compiled batches of a normal step; their gradients
are a few KB.

``optimizer.step()`` must still be called once after each backward: it finds no gradient on
these parameters, so it steps nothing, and it ends the step (a second backward before it is
refused as gradient accumulation); ``zero_grad()`` finds nothing to free. Schedulers, which
change ``lr`` between ``step()`` calls, and checkpoints (the state is the optimizer's as ever)
work as they do without it.

What cannot work is refused, before anything is written where it can be known then:

* **gradient accumulation over micro-batches**: every backward updates the parameters; the
  second backward before ``step()`` raises at its first parameter;
* **a loss scaler** (FP16): a step taken during backward cannot be skipped when a later
  gradient overflows; FP16 parameters are refused at registration, and ``step()`` raises
  where ``torch.amp.GradScaler`` or a ``LossScaler`` hands it a scale (by then one step was
  taken with scaled gradients);
* **DDP** (its all-reduce runs after these hooks) and **FSDP2 / DTensor parameters** (FSDP2
  sets each sharded gradient after its reduce-scatter without running post-accumulate-grad
  hooks): refused at registration;
* **clipping by the global gradient norm** cannot be detected: by the time
  ``clip_grad_norm_`` runs, the gradients are gone and it sees none (it returns 0). Use
  ``lowprec.StableAdamW`` (its update is clipped per tensor by its RMS) instead.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lowprec.optim.base import LowPrecisionOptimizer
from lowprec.optim.batches import _by_size
from lowprec.optim.shards import is_dtensor

__all__ = ["StepInBackward", "step_in_backward"]

#: The attribute marking a parameter stepped inside backward (``lowprec.accumulate`` refuses it).
MARK = "_lowprec_in_backward"


class _Step:
    """What one optimizer step's hooks share: each parameter's group, index and storage, the
    per-group numbers (``memo``), the small parameters waiting for the end of backward."""

    __slots__ = ("items", "memo", "queued", "small")

    def __init__(self, items: dict[int, tuple]) -> None:
        self.items = items
        self.memo: dict[Any, Any] = {}
        self.small: list[tuple] = []
        self.queued = False


class StepInBackward:
    """The hooks ``step_in_backward`` installed; ``remove()`` restores the normal step.

    Attributes:
        optimizer: The optimizer whose step runs in the hooks.
        params: The parameters stepped inside backward.
    """

    def __init__(self, model: nn.Module, optimizer: LowPrecisionOptimizer) -> None:
        self.optimizer = optimizer
        self.params = _check(model, optimizer)
        self._stepped: set[int] = set()  # (stepped since the last optimizer.step())
        self._step: _Step | None = None
        self._checked: dict[int, tuple] = {}  # (state tensors last found valid, per parameter)
        self._handles = [p.register_post_accumulate_grad_hook(self._hook) for p in self.params]
        for p in self.params:
            setattr(p, MARK, True)
        optimizer._in_backward = self

    # ------------------------------------------------------------------ the hooks

    def _begin(self) -> _Step:
        """The first hook of a step: check every group's options and every parameter's state
        (as ``step()`` does before writing anything), and note each parameter's place."""
        opt = self.optimizer
        for name in ("grad_scale", "found_inf"):
            if opt.__dict__.get(name) is not None:
                raise _scaler_error()
        items = {}
        index = -1
        for gi, group in enumerate(opt.param_groups):
            storages = opt._validate_group(group, gi)
            for pi, (p, storage) in enumerate(zip(group["params"], storages, strict=True)):
                index += 1
                late = False
                state = opt.state.get(p)
                if state:
                    # (the same options and state tensors as at the last check: not again)
                    key = (storage.name, group["state_dtype"], opt._math_buffers(group, p),
                           tuple(map(id, state.values())))
                    checked = self._checked.get(id(p))
                    if checked is None or checked[0] != key:
                        missing = opt._check_state(state, group, p, storage, (gi, pi))
                        checked = self._checked[id(p)] = (key, bool(missing))
                    late = checked[1]
                items[id(p)] = (group, index, storage, (gi, pi), late)
        return _Step(items)

    @torch.no_grad()
    def _hook(self, p: torch.Tensor) -> None:
        if id(p) in self._stepped:
            raise RuntimeError(
                "step_in_backward: a second backward ran before optimizer.step(). Each backward "
                "updates the parameters, so gradients cannot be accumulated over micro-batches: "
                "call optimizer.step() after every backward, and to train on a larger batch, "
                "run it in one backward (or remove() this and use lowprec.accumulate with the "
                "normal step)."
            )
        step = self._step
        if step is None:
            step = self._step = self._begin()
        item = step.items.get(id(p))
        if item is None:  # (no longer in the optimizer's groups)
            return
        group, index, storage, where, late = item
        opt = self.optimizer
        opt._check_grad(p, where)
        work = (group, p, index, storage)
        if late:  # (buffers an option turned on since the last step: created now)
            self._checked.pop(id(p), None)
            opt._step_late([work], None)
        elif not _by_size([work])[0]:  # (small: with the others at the end of backward)
            step.small.append(work)
            if not step.queued:
                step.queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._flush)
            return
        else:
            opt._step_param(group, p, index, storage, None, step.memo)
        p.grad = None
        self._stepped.add(id(p))

    @torch.no_grad()
    def _flush(self) -> None:
        """The end of backward: step the small parameters together, as ``step()`` would."""
        step = self._step
        if step is None or not step.small:
            return
        small = sorted(step.small, key=lambda item: (-item[1].numel(), item[2]))
        step.small, step.queued = [], False
        opt = self.optimizer
        for group, p, index, storage in opt._step_small_fused(small, step.memo):
            opt._step_param(group, p, index, storage, None, step.memo)
        for _, p, _, _ in small:
            p.grad = None
            self._stepped.add(id(p))

    def _end_step(self, grad_scale: Any, found_inf: Any) -> None:
        """``optimizer.step()``: the step's end (called before it looks for gradients)."""
        if grad_scale is not None or found_inf is not None:
            raise _scaler_error()
        self._flush()  # (a backward whose end was not seen: torch.autograd.backward inputs=)
        self._stepped.clear()
        self._step = None

    # ------------------------------------------------------------------ undo

    def remove(self) -> None:
        """Remove the hooks: backward leaves gradients again and ``step()`` steps them."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for p in self.params:
            if getattr(p, MARK, False):
                delattr(p, MARK)
        if self.optimizer.__dict__.get("_in_backward") is self:
            del self.optimizer._in_backward
        self._step = None
        self._stepped.clear()


def _scaler_error() -> RuntimeError:
    return RuntimeError(
        "step_in_backward cannot take a loss scaler's scale or skip a step: each parameter "
        "was stepped during backward, before an inf or NaN in a later gradient could be found. "
        "Train in BF16 (it needs no loss scaling), or remove() step_in_backward to use the "
        "scaler with the normal step."
    )


def _check(model: nn.Module, optimizer: Any) -> list[torch.Tensor]:
    """The optimizer's parameters that require gradients, after every refusal that can be
    decided at registration."""
    if not isinstance(optimizer, LowPrecisionOptimizer):
        raise TypeError(
            f"step_in_backward takes a lowprec optimizer, got {type(optimizer).__name__}; "
            "build it from lowprec.optim (e.g. lowprec.AdamW(model.parameters()))."
        )
    if not isinstance(model, nn.Module):
        raise TypeError(f"step_in_backward takes the model (an nn.Module) first, got "
                        f"{type(model).__name__}.")
    if optimizer.__dict__.get("_in_backward") is not None:
        raise ValueError("this optimizer already steps inside backward; remove() its "
                         "StepInBackward first.")
    from torch.nn.parallel import DistributedDataParallel

    for m in model.modules():
        if isinstance(m, DistributedDataParallel) or type(m).__name__ == "FullyShardedDataParallel":
            raise ValueError(
                f"step_in_backward cannot run under {type(m).__name__}: it averages the "
                "gradients across ranks after the hooks in which each parameter would already "
                "have been stepped on its own rank's gradient. Use the normal step()."
            )
    in_model = {id(p) for p in model.parameters()}
    params = []
    for gi, group in enumerate(optimizer.param_groups):
        for pi, p in enumerate(group["params"]):
            where = f"parameter group {gi}, parameter {pi}"
            if is_dtensor(p) or optimizer.__dict__.get("_has_dtensors"):
                raise ValueError(
                    f"{where} is a DTensor (FSDP2 or tensor parallelism): FSDP2 writes each "
                    "sharded gradient after its reduce-scatter without running post-accumulate-"
                    "grad hooks, so it cannot be stepped inside backward. Use the normal step()."
                )
            if id(p) not in in_model:
                raise ValueError(f"{where} is not a parameter of the model given; pass the "
                                 "model whose parameters the optimizer steps.")
            if p.dtype == torch.float16:
                raise ValueError(
                    f"{where} is FP16, which needs a loss scaler, and a scaler cannot skip a "
                    "step taken during backward; use BF16 weights (no scaling needed) with "
                    "step_in_backward, or FP16 with the normal step."
                )
            if getattr(p, "_lowprec_accumulating", False):
                raise ValueError(
                    f"{where} accumulates its gradient over micro-batches (lowprec.accumulate), "
                    "but step_in_backward steps it at every backward; remove() one of them."
                )
            if p.grad is not None:
                raise ValueError(
                    f"{where} already has a gradient, which its first step inside backward "
                    "would add to; call optimizer.zero_grad(set_to_none=True) first."
                )
            if p.requires_grad:
                params.append(p)
    return params


def step_in_backward(model: nn.Module, optimizer: LowPrecisionOptimizer) -> StepInBackward:
    """Step each of ``optimizer``'s parameters during backward and free its gradient at once.

    The training loop stays as it is (``loss.backward()``, ``optimizer.step()``,
    ``optimizer.zero_grad()``, a scheduler's ``step()``); the update now happens inside
    ``backward()``, so no full set of gradients ever exists: a step's peak memory drops by the
    gradients' bytes (2 per parameter with BF16 weights). The result is the normal step's, bit
    for bit. See the module docstring for what is refused (gradient accumulation, loss scaling
    and FP16, DDP, FSDP2) and for global-norm clipping, which this makes a no-op.

    Args:
        model: The module whose parameters ``optimizer`` steps.
        optimizer: A lowprec optimizer (every one, with any ``master=`` and ``state_dtype``).

    Returns:
        The ``StepInBackward``; ``remove()`` restores the normal step.

    Raises:
        TypeError: Not a lowprec optimizer, or not a module.
        ValueError: What cannot be stepped inside backward (above), or a parameter already
            holding a gradient.
    """
    return StepInBackward(model, optimizer)
