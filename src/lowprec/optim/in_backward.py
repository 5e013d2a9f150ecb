"""The update inside backward: ``lowprec.step_in_backward(model, optimizer)``.

Each parameter is stepped in its post-accumulate-grad hook, through its bucket as a piece of its own
(``buckets._Bucket.step_one``; one no bucket takes by ``param_step.step_param``), and its gradient
freed at once (optimi's "gradient release"). Small parameters wait for the end of backward, where
the normal step's buckets take them together. Each parameter's update depends on its own gradient
and state alone, so the result equals the normal step's bit for bit. docs/architecture.md, "The
update inside backward", tells the rest.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from lowprec.optim import core, driver, param_step, qstate
from lowprec.optim.core import OptimizerCore
from lowprec.optim.dtensor import is_dtensor
from lowprec.optim.options import in_step
from lowprec.optim.param_step import Memo

if TYPE_CHECKING:  # pragma: no cover
    from lowprec.optim.storage import MasterStorage

__all__ = ["StepInBackward", "step_in_backward"]

#: The attribute marking a parameter stepped inside backward (``lowprec.accumulate`` refuses it).
MARK = "_lowprec_in_backward"
#: Parameters of up to this many elements (biases, norms) wait for the end of backward, where
#: the buckets step them together.
_SMALL = 1 << 16


class _Item:
    """A parameter's place in the optimizer, as the last full look at the groups found it."""

    __slots__ = ("dtype", "group", "index", "p", "small", "storage", "where")

    def __init__(
        self,
        group: dict[str, Any],
        p: torch.Tensor,
        index: int,
        storage: MasterStorage,
        where: tuple[int, int],
    ) -> None:
        self.group, self.p, self.index, self.storage, self.where = group, p, index, storage, where
        self.dtype = p.dtype
        self.small = p.numel() <= _SMALL and not (group["state_dtype"] in qstate.BITS
                                                   and qstate.qualifies(p))


class StepInBackward:
    """The hooks ``step_in_backward`` installed; ``remove()`` restores the normal step.

    Made by ``step_in_backward(model, optimizer)``, which is the way to create one.

    Args:
        model: The module whose parameters ``optimizer`` steps.
        optimizer: A lowprec optimizer.

    Attributes:
        optimizer: The optimizer whose step runs in the hooks.
        params: The parameters stepped inside backward.
    """

    def __init__(self, model: nn.Module, optimizer: OptimizerCore) -> None:
        self.optimizer = optimizer
        self.params = _check(model, optimizer)
        self._stepped: set[int] = set()  # (stepped since the last optimizer.step())
        self._memo: Memo | None = None  # (this step's numbers; None between steps)
        self._items: dict[int, _Item] | None = None  # (by _begin's last full look)
        self._small_waiting = False
        self._handles = [p.register_post_accumulate_grad_hook(self._hook) for p in self.params]
        for p in self.params:
            setattr(p, MARK, True)
        core.stages(optimizer).in_backward = self

    # ------------------------------------------------------------------ the hooks

    def _begin(self) -> Memo:
        """The first hook of a step: check what ``step()`` checks before writing anything, and
        create and lay out the missing state; returns the step's memo. Where the buckets still
        hold (``driver.laid_out``), the bucketed state is theirs: only the groups' options and
        the state of the parameters outside buckets are checked again."""
        opt = self.optimizer
        for name in ("grad_scale", "found_inf"):
            if getattr(opt, name, None) is not None:  # (GradScaler's, set on the optimizer)
                raise _scaler_error()
        for gi, group in enumerate(opt.param_groups):
            core.validate_options(opt, group, gi)  # (raises as step() would)
        items = self._items
        fresh = (items is None or not driver.laid_out(opt)
                 or any(it.p.dtype != it.dtype for it in items.values()))
        if fresh:  # (each parameter's strategy and device, as step() checks them)
            items = self._items = {}
            index = -1
            for gi, group in enumerate(opt.param_groups):
                storages = core.validate_group(opt, group, gi)
                for pi, (p, storage) in enumerate(zip(group["params"], storages, strict=True)):
                    index += 1
                    items[id(p)] = _Item(group, p, index, storage, (gi, pi))
        items = cast("dict[int, _Item]", items)  # (made: fresh where there were none)
        layout = driver.buckets_of(opt)
        check = (list(items.values()) if fresh or layout is None
                 else [items[id(opt.param_groups[gi]["params"][pi])] for gi, pi, _ in layout.rest])
        new = []
        for it in check:
            state = opt.state.get(it.p)
            if state:
                core.check_state(opt.rule(it.group), state, it.group, it.p, it.storage, it.where)
            elif it.p.requires_grad:
                new.append((it.group, it.p, it.index, it.storage))
        if new or fresh:  # (created and laid out before any parameter is stepped)
            driver.flatten(opt, driver.new_state(opt, new))
        return Memo()

    @torch.no_grad()
    def _hook(self, p: torch.Tensor) -> None:
        with in_step():  # (a tensor hyperparameter's value is not read on the host)
            self._step_in_hook(p)

    def _step_in_hook(self, p: torch.Tensor) -> None:
        if id(p) in self._stepped:
            raise RuntimeError(
                "step_in_backward: a second backward ran before optimizer.step(). Each backward "
                "updates the parameters, so gradients cannot be accumulated over micro-batches: "
                "call optimizer.step() after every backward, and to train on a larger batch, "
                "run it in one backward (or remove() this and use lowprec.accumulate with the "
                "normal step)."
            )
        memo = self._memo
        if memo is None:
            memo = self._memo = self._begin()
        it = cast("dict[int, _Item]", self._items).get(id(p))  # (made by _begin)
        if it is None:  # (no longer in the optimizer's groups)
            return
        self._stepped.add(id(p))
        if it.small:  # (with the others, in the normal step's buckets, at the end of backward)
            if not self._small_waiting:
                self._small_waiting = True
                torch.autograd.Variable._execution_engine.queue_callback(self._flush)
            return
        core.check_grad(p, it.where)
        self._step(it, memo)
        p.grad = None

    def _step(self, it: _Item, memo: Memo) -> None:
        """A parameter's step: through its bucket, else on its own, as ``step()`` takes it."""
        opt = self.optimizer
        layout = driver.buckets_of(opt)
        where = layout.where.get(id(it.p)) if layout is not None else None
        if where is not None:
            where[0].step_one(opt, where[1], memo)
            return
        state = opt.state[it.p]  # (made by _begin)
        late = bool(core.check_state(opt.rule(it.group), state, it.group, it.p, it.storage,
                                     it.where))  # (buffers an option turned on since)
        param_step.step_param(opt, it.group, it.p, it.index, it.storage, None, memo,
                              first_use=late)

    @torch.no_grad()
    def _flush(self) -> None:
        """The end of backward: the small parameters take the optimizer's own step."""
        if not self._small_waiting:
            return
        self._small_waiting = False
        driver.stages(self.optimizer, driver.StepContext())
        for it in cast("dict[int, _Item]", self._items).values():  # (a hook saw the step)
            if it.small:
                it.p.grad = None

    def _end_step(
        self, grad_scale: torch.Tensor | float | None, found_inf: torch.Tensor | None
    ) -> bool:
        """``optimizer.step()``: the step's end. Returns whether a parameter still has a gradient
        (one the hooks did not see) for it to step."""
        if grad_scale is not None or found_inf is not None:
            raise _scaler_error()
        self._flush()  # (a backward whose end was not seen: torch.autograd.backward inputs=)
        self._stepped.clear()
        self._memo = None
        return any(p.grad is not None for group in self.optimizer.param_groups
                   for p in group["params"])

    # ------------------------------------------------------------------ undo

    def remove(self) -> None:
        """Remove the hooks: backward leaves gradients again and ``step()`` steps them."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for p in self.params:
            if getattr(p, MARK, False):
                delattr(p, MARK)
        if core.stages(self.optimizer).in_backward is self:
            core.stages(self.optimizer).in_backward = None
        self._memo = None
        self._stepped.clear()


def _scaler_error() -> RuntimeError:
    return RuntimeError(
        "step_in_backward cannot take a loss scaler's scale or skip a step: each parameter "
        "was stepped during backward, before an inf or NaN in a later gradient could be found. "
        "Train in BF16 (it needs no loss scaling), or remove() step_in_backward to use the "
        "scaler with the normal step."
    )


def _check(model: nn.Module, optimizer: object) -> list[torch.Tensor]:
    """The optimizer's parameters that require gradients, after every refusal that can be decided at
    registration."""
    if not isinstance(optimizer, OptimizerCore):
        raise TypeError(
            f"step_in_backward takes a lowprec optimizer, got {type(optimizer).__name__}; "
            "build it from lowprec.optim (e.g. lowprec.AdamW(model.parameters()))."
        )
    if not isinstance(model, nn.Module):
        raise TypeError(f"step_in_backward takes the model (an nn.Module) first, got "
                        f"{type(model).__name__}.")
    if core.stages(optimizer).in_backward is not None:
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
    params: list[torch.Tensor] = []
    for gi, group in enumerate(optimizer.param_groups):
        for pi, p in enumerate(group["params"]):
            where = f"parameter group {gi}, parameter {pi}"
            if is_dtensor(p) or core.stages(optimizer).has_dtensors:
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


def step_in_backward(model: nn.Module, optimizer: OptimizerCore) -> StepInBackward:
    """Step each of ``optimizer``'s parameters during backward and free its gradient at once.

    The training loop stays as it is (``loss.backward()``, ``optimizer.step()``,
    ``optimizer.zero_grad()``, a scheduler's ``step()``); the update now happens inside
    ``backward()``, so no full set of gradients ever exists: a step's peak memory drops by the
    gradients' bytes (2 per parameter with BF16 weights). The result is the normal step's, bit for
    bit. ``optimizer.step()`` must still be called after each backward: it ends the step.

    Refused, before anything is written where it can be known then: gradient accumulation (a second
    backward before ``step()``), a loss scaler and FP16 parameters (a step taken during backward
    cannot be skipped), DDP and FSDP2 / DTensor parameters (their gradients are reduced after these
    hooks). Clipping by the global gradient norm cannot be detected: it finds no gradients and does
    nothing (``lowprec.StableAdamW`` clips each tensor's update by its RMS).

    Args:
        model: The module whose parameters ``optimizer`` steps.
        optimizer: A lowprec optimizer (every one, with any ``master=`` and ``state_dtype``).

    Returns:
        The ``StepInBackward``; ``remove()`` restores the normal step.

    Raises:
        TypeError: Not a lowprec optimizer, or not a module.
        ValueError: What cannot be stepped inside backward (above), or a parameter already
            holding a gradient.

    Examples:
        >>> import torch
        >>> import lowprec
        >>> model = torch.nn.Linear(64, 64).bfloat16()
        >>> opt = lowprec.AdamW(model.parameters(), lr=1e-3, master="kahan", state_dtype="8bit")
        >>> handle = lowprec.step_in_backward(model, opt)
        >>> model(torch.randn(4, 64, dtype=torch.bfloat16)).float().square().mean().backward()
        >>> model.weight.grad is None  # stepped during backward, its gradient freed
        True
        >>> opt.step()  # still called after each backward: it ends the step
        >>> handle.remove()  # the normal step again
    """
    return StepInBackward(model, optimizer)
