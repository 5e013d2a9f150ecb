"""A Lightning precision plugin that lets lowprec's loss scaling and gradient clipping work together.

lowprec's optimizers take part in the loss-scaler contract (``_step_supports_amp_scaling``): under
a scaler they receive the scale and the found-inf flag as device tensors, unscale inside their
update and skip an overflowing step on the device. Lightning's ``MixedPrecision`` treats every
such optimizer like torch's fused Adam: it does not call ``scaler.unscale_`` before
``on_before_optimizer_step`` and it refuses gradient clipping with a ``RuntimeError`` ("does not
allow for gradient clipping because it performs unscaling of gradients internally"), under
``"bf16-mixed"`` too, where there is no scaler at all.

``MixedPrecision`` here is Lightning's plugin with that one decision changed. When gradients are
clipped for an optimizer that unscales in its step, it calls ``scaler.unscale_(optimizer)``
first, as Lightning does for every other optimizer: right after the backward when the trainer
clips (``gradient_clip_val > 0``), so ``on_before_optimizer_step`` sees the true gradients as it
would with ``torch.optim``, or at the clipping itself when a ``configure_gradient_clipping``
override or a manual-optimization ``self.clip_gradients`` asks for it. The scaler then hands the
optimizer the found-inf flag alone and lowprec's step still skips an overflowing step on the
device. Without clipping the gradients stay scaled and the optimizer unscales inside its update:
one pass over the gradients fewer and no host sync, as before. Under ``"bf16-mixed"`` (no
scaler) it is Lightning's plugin, except that clipping is allowed.

For ``"16-mixed"`` the default scaler is ``lowprec.LossScaler``, not ``torch.amp.GradScaler``:

* With a lowprec optimizer and no clipping, GradScaler first reads every gradient in an inf/NaN
  check of its own, which lowprec's step repeats inside its update; ``LossScaler`` leaves the
  check to the step.
* It unscales FP16 gradients, which GradScaler refuses ("Attempting to unscale FP16
  gradients"), so clipping also works for a model whose weights were converted to FP16 (an FP16
  model with an FP32 master copy, ``master="fp32"``).
* It raises ``lowprec.NonFiniteLossError`` once every recent step has overflowed whatever the
  scale (a NaN loss), where GradScaler goes on skipping for ever.

Its scale sequence is GradScaler's and each loads the other's state dict. The class keeps
Lightning's name, which Lightning uses as the plugin's checkpoint key, so a checkpoint written
with Lightning's own plugin resumes with this one, and back. Pass
``scaler=torch.amp.GradScaler(device)`` to keep torch's scaler.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import torch

try:
    import lightning.pytorch as pl
    from lightning.pytorch.core.optimizer import LightningOptimizer
    from lightning.pytorch.plugins.precision import MixedPrecision as _LightningMixedPrecision
    from lightning.pytorch.plugins.precision import Precision as _Precision
    from lightning.pytorch.utilities import GradClipAlgorithmType
except ImportError as error:
    if isinstance(error, ModuleNotFoundError) and (error.name or "").split(".")[0] != "lightning":
        raise  # Lightning is there but one of its own dependencies is missing: show that
    raise ImportError(
        "lowprec.integrations.lightning needs Lightning >= 2.1 (the `lightning` package): "
        'pip install "lowprec[integrations]" (or pip install -U lightning).'
    ) from error

from lowprec.scaling import LossScaler

if TYPE_CHECKING:  # pragma: no cover
    from lightning.fabric.utilities.types import Optimizable

__all__ = ["MixedPrecision"]

_PRECISIONS = ("16-mixed", "bf16-mixed")
_SCALER_METHODS = ("scale", "unscale_", "step", "update", "state_dict", "load_state_dict")


def _handles_unscaling(optimizer: Any) -> bool:
    """Whether ``optimizer`` unscales in its own step (lowprec's, torch's fused ones)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def _unwrap(optimizer: Any) -> Any:
    """The optimizer behind Lightning's wrapper (``self.optimizers()`` in a LightningModule)."""
    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def _trainer_clips(model: pl.LightningModule) -> bool:
    """Whether the trainer will clip this step's gradients (``gradient_clip_val > 0``)."""
    if not model.automatic_optimization:
        return False  # (Lightning refuses gradient_clip_val in manual optimization)
    clip_val = model.trainer.gradient_clip_val
    return clip_val is not None and clip_val > 0


def _device_type(device: Any) -> str:
    if not isinstance(device, (str, torch.device)):
        raise TypeError(
            f"device must be a device type such as 'cuda' or 'cpu' (a str or torch.device), "
            f"got {type(device).__name__}."
        )
    try:
        return torch.device(device).type
    except RuntimeError as error:
        raise ValueError(
            f"device={device!r} is not a device: pass a device type such as 'cuda' or 'cpu'."
        ) from error


class MixedPrecision(_LightningMixedPrecision):
    """Lightning's ``MixedPrecision`` that clips gradients for optimizers that unscale in their step.

    Pass it to the trainer instead of a ``precision=`` flag:

        from lowprec.integrations.lightning import MixedPrecision

        trainer = lightning.Trainer(
            plugins=[MixedPrecision("16-mixed", "cuda")], gradient_clip_val=1.0
        )

    With a lowprec optimizer (or torch's fused optimizers) and clipping, the gradients are
    unscaled before ``on_before_optimizer_step`` and the clipping, as Lightning does for other
    optimizers; without clipping they stay scaled and the optimizer unscales them in its update.

    Args:
        precision: ``"16-mixed"`` (FP16 autocast with loss scaling) or ``"bf16-mixed"`` (BF16
            autocast, no loss scaling).
        device: The device type autocast runs on: ``"cuda"``, ``"cpu"``, ... (a ``torch.device``
            or ``"cuda:1"`` stands for its type).
        scaler: The loss scaler for ``"16-mixed"``, a ``lowprec.LossScaler`` or a
            ``torch.amp.GradScaler`` (default: None, a new ``lowprec.LossScaler()``; it must stay
            None for ``"bf16-mixed"``).

    Raises:
        ValueError: An unknown ``precision`` or ``device``, or a scaler with ``"bf16-mixed"``.
        TypeError: A ``device`` that is no str or ``torch.device``, or a ``scaler`` without
            GradScaler's methods.
    """

    def __init__(
        self,
        precision: Literal["16-mixed", "bf16-mixed"],
        device: str | torch.device,
        *,
        scaler: LossScaler | torch.amp.GradScaler | None = None,
    ) -> None:
        if precision not in _PRECISIONS:
            raise ValueError(
                f"precision must be '16-mixed' or 'bf16-mixed', got {precision!r}; for "
                "'bf16-true' or '16-true' (weights converted to 16 bits) use Lightning's "
                "precision= flag, which needs no scaler."
            )
        device_type = _device_type(device)
        if scaler is None:
            if precision == "16-mixed":
                scaler = LossScaler()  # the scale lives on the loss's device
        elif precision == "bf16-mixed":
            raise ValueError(
                "precision='bf16-mixed' takes no loss scaler: BF16 has FP32's exponent range, "
                "so gradients neither underflow nor overflow; leave scaler=None."
            )
        else:
            missing = [m for m in _SCALER_METHODS if not callable(getattr(scaler, m, None))]
            if missing:
                raise TypeError(
                    f"scaler must be a lowprec.LossScaler or a torch.amp.GradScaler; "
                    f"{type(scaler).__name__} lacks {', '.join(missing)}."
                )
        # (Lightning annotates the scaler as a torch.amp.GradScaler; it calls GradScaler's
        # methods, which LossScaler has)
        super().__init__(precision, device_type, scaler)  # type: ignore[arg-type]
        # id(optimizer) of those unscaled in this iteration, and of those whose backward
        # Lightning skipped (training_step returned None: no step, so no unscaling either).
        self._unscaled: set[int] = set()
        self._no_backward: set[int] = set()

    def _unscale_once(self, optimizer: Optimizable) -> None:
        # The scaler keeps its per-optimizer stage by id(): unscale the optimizer that
        # optimizer_step steps, not the wrapper that manual optimization clips with.
        optimizer = _unwrap(optimizer)
        key = id(optimizer)
        if self.scaler is not None and key not in self._unscaled | self._no_backward:
            self.scaler.unscale_(optimizer)
            self._unscaled.add(key)

    # (Lightning's MixedPrecision overrides fabric's Precision.optimizer_step with this
    # signature, and ignores the override error as this does)
    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Optimizable,
        model: pl.LightningModule,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        """Run the closure (forward and scaled backward), unscale if the trainer clips, step.

        Lightning's step with one addition: for an optimizer that unscales in its step, the
        gradients are unscaled right after the backward when ``gradient_clip_val > 0``.

        Args:
            optimizer: The optimizer to step.
            model: The ``LightningModule`` being trained.
            closure: Lightning's closure: the forward, the scaled backward, and its hooks.
            **kwargs: Passed on to the optimizer's step.

        Returns:
            The closure's result, as Lightning returns it.
        """
        if self.scaler is None or not _handles_unscaling(optimizer):
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        key = id(_unwrap(optimizer))

        def closure_then_unscale() -> Any:
            result = closure()
            if result is None and model.automatic_optimization:
                self._no_backward.add(key)  # Lightning skips this step
            elif _trainer_clips(model):
                self._unscale_once(optimizer)
            return result

        try:
            return super().optimizer_step(
                optimizer, model=model, closure=closure_then_unscale, **kwargs
            )
        finally:
            self._unscaled.discard(key)
            self._no_backward.discard(key)

    def clip_gradients(
        self,
        optimizer: torch.optim.Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        """Clip the true gradients: unscale them first (once) if the optimizer would have.

        Args:
            optimizer: The optimizer whose parameters' gradients are clipped.
            clip_val: The largest norm or value; 0 or less clips nothing (default: 0.0).
            gradient_clip_algorithm: By norm or by value (default: ``GradClipAlgorithmType.NORM``).
        """
        if clip_val > 0 and _handles_unscaling(optimizer):
            self._unscale_once(optimizer)
            # Lightning's MixedPrecision refuses such optimizers here; their gradients are true
            # gradients now, so clip as the base plugin does.
            _Precision.clip_gradients(self, optimizer, clip_val, gradient_clip_algorithm)
            return
        super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm)
