"""The base class of lowprec's optimizers: ``LowPrecisionOptimizer``.

It composes an update rule (the subclass: ``SGD``, ``AdamW``, ...: FP32 math that never knows how
the weight is stored) with a master-weight storage (``storage``), per group. It is
``core.OptimizerCore`` (what the step reads) with what a caller meets: ``add_param_group``,
``step()`` (which hands a ``driver.StepContext`` to ``driver.run``), ``state_dict`` /
``load_state_dict`` (``checkpoint``: every state tensor keeps its dtype) and ``master_weight``. A
step validates everything before it writes anything, so a step that raises leaves parameters and
state as they were. Module-level names that tests replace (``driver.step_buckets``,
``compiled._compiled_kernel``, ``update._INT32_MAX``) are read through their modules, so that one
``monkeypatch.setattr`` reaches every caller.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar, overload

import torch

from lowprec.optim import checkpoint, driver, kept
from lowprec.optim._typing import compiler_disable
from lowprec.optim.core import OptimizerCore, group_of, stages, validate_group
from lowprec.optim.dtensor import is_dtensor, local, mark_blocks, wrap_like
from lowprec.optim.options import (
    _COMMON_DEFAULTS,
    _TORCH_ONLY_OPTIONS,
    _check_torch_options,
    fill_docs,
)
from lowprec.optim.shards import warn_fp32_shards
from lowprec.optim.storage import resolve_master

if TYPE_CHECKING:  # pragma: no cover
    from torch.optim.optimizer import ParamsT

__all__ = ["LowPrecisionOptimizer"]

_T = TypeVar("_T")


class LowPrecisionOptimizer(OptimizerCore):
    """Base class: an update rule in FP32 over a pluggable master-weight storage.

    Subclasses implement the update rule's interface (``core.OptimizerCore``: ``_math``,
    ``_coefficients``, ``_math_buffers``, ...). They pass their hyperparameter defaults;
    ``master``, ``state_dtype``, ``seed`` and ``fused`` are added here.

    Every lowprec optimizer (``SGD``, ``AdamW``, ...) inherits its public methods from here:
    ``step`` (with the loss-scaler contract's ``grad_scale`` and ``found_inf``),
    ``state_dict``/``load_state_dict`` (every state tensor keeps its dtype), ``add_param_group``
    and ``master_weight``; ``zero_grad`` is ``torch.optim.Optimizer``'s.

    Args:
        params: Parameters or parameter groups, as ``torch.optim.Optimizer`` takes them (an
            ordered collection: a set is refused); ``(name, tensor)`` pairs keep the names as
            the group's ``param_names``.
        defaults: The subclass's hyperparameter defaults; ``master``, ``state_dtype``, ``seed``
            and ``fused`` are added to them.
        foreach: {foreach}
        capturable: {capturable}
        differentiable: {differentiable}

    Raises:
        TypeError: ``params`` is a set, or an option has the wrong type.
        ValueError: An invalid option, hyperparameter or parameter (naming its group).
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__doc__:  # (the shared arguments' text: options.ARG_DOCS)
            cls.__doc__ = fill_docs(cls.__doc__)

    def __init__(
        self,
        params: ParamsT,
        defaults: dict[str, Any],
        *,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
    ) -> None:
        if isinstance(params, set):
            raise TypeError(
                "parameters must be an ordered collection (a list), not a set: a set's order "
                "changes between runs, and checkpoints map state to parameters by position."
            )
        _check_torch_options(type(self).__name__, foreach, capturable, differentiable)
        # (set before the groups: read by their checks)
        stages(self).capturable = bool(capturable)
        super().__init__(params, {**_COMMON_DEFAULTS, **defaults})

    # ------------------------------------------------------------------ groups and validation

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group, as ``torch.optim.Optimizer.add_param_group`` does, and check it.

        Options the group leaves out take the optimizer's defaults; ``seed=None`` becomes
        ``torch.initial_seed()``. A group that fails its checks is not added.

        Args:
            param_group: A dict with ``"params"`` (tensors, or ``(name, tensor)`` pairs) and
                any options to set for this group (``lr``, ``master``, ``state_dtype``, ...).

        Raises:
            TypeError: Not a dict, parameters in a set, or a parameter that is not a tensor.
            ValueError: A parameter given twice, or an invalid option (naming the group).
        """
        # (torch.optim's checks follow in super(): no set, tensors, names for all or none)
        if not isinstance(param_group, dict):
            raise TypeError(f"a parameter group must be a dict, got {type(param_group).__name__}.")
        params = param_group["params"]
        if not isinstance(params, (torch.Tensor, set)):
            params = list(params)  # (an iterator read once, here)
            # (refused before torch's checks, which only warn of it)
            ids = [id(p[1] if isinstance(p, tuple) else p) for p in params]
            if len(set(ids)) != len(ids):
                raise ValueError(
                    "a parameter appears twice in one parameter group; pass each parameter once "
                    "(e.g. deduplicate tied weights with a dict keyed by id)."
                )
        # (a copy: torch keeps the dict it is given as the group, and writes into it)
        super().add_param_group({**param_group, "params": params})
        added = self.param_groups[-1]
        params = added["params"]
        try:
            if added.get("seed") is None:
                # (what torch.manual_seed set: the same on every rank seeded alike, and reading
                # it consumes no random numbers)
                added["seed"] = torch.initial_seed()
            storages = validate_group(self, added, index=len(self.param_groups) - 1)
        except Exception:
            self.param_groups.pop()
            raise
        # (FP32 values kept by a cast that no master of this group holds: let go now)
        kept.release(p for p, storage in zip(params, storages, strict=True)
                     if not storage.takes_value)
        if any(is_dtensor(p) for p in params):
            stages(self).has_dtensors = True  # (steps run on their local shards)
            for p in params:
                if is_dtensor(p):
                    mark_blocks(p)
            warn_fp32_shards(added, len(self.param_groups) - 1)

    def __setstate__(self, state: dict[str, Any]) -> None:
        # (torch's __setstate__ adds "differentiable" to the defaults: not a lowprec group
        # option, so not copied into the groups, whose state_dict() would then differ)
        super().__setstate__(state)
        own = {k: v for k, v in self.defaults.items() if k not in _TORCH_ONLY_OPTIONS}
        for group in self.param_groups:
            for key, value in {**_COMMON_DEFAULTS, **own}.items():
                group.setdefault(key, value)

    # ------------------------------------------------------------------ the step (driver)

    #: torch.amp.GradScaler hands this optimizer its scale and found-inf flag as the attributes
    #: ``grad_scale`` and ``found_inf`` (and does not unscale the gradients itself).
    _step_supports_amp_scaling = True

    # Left out of any graph torch.compile traces around it: the step compiles its own kernels
    # with the settings they need (docs/architecture.md, "How a step flows").
    @overload
    def step(
        self,
        closure: None = None,
        *,
        grad_scale: torch.Tensor | float | None = None,
        found_inf: torch.Tensor | None = None,
    ) -> None: ...

    @overload
    def step(
        self,
        closure: Callable[[], _T],
        *,
        grad_scale: torch.Tensor | float | None = None,
        found_inf: torch.Tensor | None = None,
    ) -> _T: ...

    @compiler_disable
    @torch.no_grad()
    def step(
        self,
        closure: Callable[[], _T] | None = None,
        *,
        grad_scale: torch.Tensor | float | None = None,
        found_inf: torch.Tensor | None = None,
    ) -> _T | None:
        """Perform one optimization step.

        With ``grad_scale`` or ``found_inf`` (the loss-scaler contract, also taken from the
        attributes of the same names that ``torch.amp.GradScaler`` sets), the step divides the
        gradients by ``grad_scale`` inside the update (``p.grad`` is not written), checks every
        gradient for inf/NaN, adds 1 to ``found_inf`` in place when it finds one, and skips the
        update when ``found_inf`` is nonzero: parameters, state and step counts stay bit-identical.
        All of it happens on the parameters' device without reading a value on the host.

        Args:
            closure: Re-evaluates the model and returns the loss (default: None).
            grad_scale: The loss scale the gradients carry, a one-element tensor or a positive
                number (default: None, meaning no scale).
            found_inf: A one-element float tensor, nonzero when a step must be skipped; the step
                adds its own finding to it (default: None, meaning no check).

        Returns:
            The closure's loss, or None.
        """
        if grad_scale is None:
            grad_scale = getattr(self, "grad_scale", None)
        if found_inf is None:
            found_inf = getattr(self, "found_inf", None)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        driver.run(self, driver.StepContext(grad_scale, found_inf))
        return loss

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """torch.optim's ``state_dict``, each ``state_dtype`` by its name (``checkpoint``)."""
        return checkpoint.state_dict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a ``state_dict``, keeping every state tensor's dtype (``checkpoint``): an FP32
        master, FP32 moments or a trail kept for a BF16 parameter are not rounded.

        A checkpoint saved under another ``master=`` strategy or ``state_dtype`` is converted
        (load the model's weights first: the master is rebuilt from them and the saved state),
        and a checkpoint of the ``torch.optim`` namesake (same buffer names) is adopted to go on
        with a torch run.

        Args:
            state_dict: What ``state_dict()`` returned (this class's, or torch.optim's).
        """
        checkpoint.load_state_dict(self, state_dict)
        # (the loaded state holds the masters: FP32 values kept by a cast are let go)
        kept.release(p for g in self.param_groups for p in g["params"] if self.state.get(p))

    # ------------------------------------------------------------------ master values

    @torch.no_grad()
    def master_weight(self, p: torch.Tensor) -> torch.Tensor:
        """The FP32 value the optimizer holds for parameter ``p`` (a new tensor).

        For ``"split"`` this is ``join(top, trail)``, for ``"kahan"`` the compensated value, for
        ``"fp32"`` the FP32 copy, otherwise the parameter itself in FP32.

        Args:
            p: A parameter of this optimizer (a DTensor gives a DTensor placed as ``p``).

        Returns:
            A new FP32 tensor shaped as ``p``.

        Raises:
            ValueError: ``p`` is not a parameter of this optimizer.
        """
        group = group_of(self, p)
        storage = resolve_master(group["master"], p.dtype)
        state = self.state.get(p)
        if is_dtensor(p):  # (computed on this rank's shard, returned as a DTensor like p)
            lp = local(p)
            if not state:
                return wrap_like(lp.float(), p)
            bufs = {k: local(state[k]) for k in storage.buffers(lp)}
            return wrap_like(storage.load(lp, bufs).clone(), p)
        if not state:
            value = kept.kept_value(p) if storage.takes_value else None
            if value is None:
                return p.detach().float().clone()
            # (the master the first step will start from: lowprec.optim.kept)
            copy = p.detach().clone()
            return storage.load(copy, storage.init(copy, value)).clone()
        return storage.load(p, {k: state[k] for k in storage.buffers(p)}).clone()


LowPrecisionOptimizer.__doc__ = fill_docs(LowPrecisionOptimizer.__doc__ or "")
