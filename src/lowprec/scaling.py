"""Loss scaling: ``LossScaler``, a drop-in for ``torch.amp.GradScaler``.

FP16 gradients below 2**-24 flush to zero and large ones overflow. Loss scaling multiplies the
loss by ``S`` before backward and divides the gradients by ``S`` before the update; a dynamic
scaler backs off when a step overflows (and skips that step) and grows after a run of clean steps.

``LossScaler`` keeps GradScaler's method names, defaults and scale sequence, and adds what it
lacks:

* It unscales FP16 gradients too, so FP16 weights with an FP32 master copy (the 2017 recipe) can
  use it.
* With lowprec optimizers (and any optimizer with ``_step_supports_amp_scaling``) the scale and
  found-inf flag go to the optimizer as device tensors: lowprec's step divides the gradients by
  the scale inside its update, checks them for inf/NaN with one read-only pass, and skips on the
  device. No value is read on the host, and the gradients are never rewritten.
* ``step()`` says whether the optimizer stepped (a 0-d bool tensor: ``if scaler.step(opt):`` reads
  it; ignore it to stay free of host syncs), so a scheduler can skip with it.
* ``min_scale`` (no floor by default, as GradScaler), ``max_scale``, hysteresis (back off only
  after ``hysteresis`` overflows in a row), and an error instead of endless skipping when every
  step overflows whatever the scale.
* Misuse (``unscale_`` twice, ``step`` twice, ``update`` without ``step``) raises clear errors.

All scaler state (scale, growth tracker, overflow run) lives in 0-d tensors on the loss's device
and is updated there with tensor ops.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Iterable
from typing import Any, cast, overload

import torch

from lowprec.optim.dtensor import is_dtensor, local

__all__ = ["LossScaler", "NonFiniteLossError"]

_FP32_MAX = torch.finfo(torch.float32).max


class NonFiniteLossError(RuntimeError):
    """Every recent step overflowed, whatever the scale: the forward pass itself is not finite.

    ``LossScaler.update`` raises it once ``max_consecutive_skips`` steps in a row were skipped,
    with the likely causes in its message, instead of shrinking the scale toward zero in
    silence. A ``RuntimeError``.
    """


class _Stage(enum.Enum):
    READY = 0
    UNSCALED = 1
    STEPPED = 2


def _check_positive(
    name: str, value: Any, *, above_one: bool = False, zero: bool = False
) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}.")
    value = float(value)
    low = 1.0 if above_one else 0.0
    if not math.isfinite(value) or value < low or (value == low and not zero):
        limit = "> 1" if above_one else ">= 0" if zero else "> 0"
        raise ValueError(f"{name} must be finite and {limit}, got {value}.")
    return value


class LossScaler:
    """Static or dynamic loss scaling for FP16, BF16 and FP32 gradients.

    Use it exactly like ``torch.amp.GradScaler``:

        scaler = lowprec.LossScaler()
        for x, y in data:
            optimizer.zero_grad()
            with torch.autocast("cuda", dtype=torch.float16):
                loss = loss_fn(model(x), y)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)            # optional, e.g. before clipping
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if scaler.step(optimizer):            # False when the step was skipped
                scheduler.step()
            scaler.update()

    Args:
        device: Accepted for compatibility with GradScaler; the scale lives on the device of the
            first loss passed to ``scale`` (default: None).
        init_scale: The initial scale (default: 2**16).
        growth_factor: Multiplies the scale after ``growth_interval`` clean steps in a row
            (default: 2.0).
        backoff_factor: Multiplies the scale on an overflow (default: 0.5).
        growth_interval: Clean steps in a row before the scale grows (default: 2000).
        enabled: When False every method is a pass-through (default: True).
        dynamic: Adjust the scale; False keeps ``init_scale`` fixed and still skips steps with
            inf/NaN gradients (default: True).
        min_scale: The scale never backs off below this; 0 means no floor, GradScaler's
            behaviour, so the scale sequence is GradScaler's (default: 0.0).
        max_scale: The scale never grows above this (default: the largest finite FP32 value, so
            it never becomes inf).
        hysteresis: Back off only after this many overflows in a row; the steps are skipped
            either way (default: 1, GradScaler's behaviour).
        max_consecutive_skips: Raise ``NonFiniteLossError`` once this many steps in a row have
            been skipped (default: 50). On CPU the check happens at every ``update``; on an
            accelerator it reads the counter only every ``max(1, max_consecutive_skips // 4)``
            updates, to keep host syncs rare.

    Examples:
        An overflowing step is skipped and the scale backs off:

        >>> import torch
        >>> import lowprec
        >>> w = torch.nn.Parameter(torch.ones(4, dtype=torch.float16))
        >>> opt = lowprec.AdamW([w], lr=1e-3, master="fp32")
        >>> scaler = lowprec.LossScaler()
        >>> scaler.scale((w.float() * float("inf")).sum()).backward()
        >>> bool(scaler.step(opt))  # inf gradients: the step is skipped, w is unchanged
        False
        >>> scaler.update()
        >>> scaler.get_scale()
        32768.0
    """

    def __init__(
        self,
        device: str | torch.device | None = None,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        dynamic: bool = True,
        min_scale: float = 0.0,
        max_scale: float = _FP32_MAX,
        hysteresis: int = 1,
        max_consecutive_skips: int = 50,
    ) -> None:
        self._init_scale = _check_positive("init_scale", init_scale)
        self._growth_factor = _check_positive("growth_factor", growth_factor, above_one=True)
        self._backoff_factor = _check_positive("backoff_factor", backoff_factor)
        if self._backoff_factor >= 1:
            raise ValueError(f"backoff_factor must be < 1, got {backoff_factor}.")
        for name, value in (
            ("growth_interval", growth_interval), ("hysteresis", hysteresis),
            ("max_consecutive_skips", max_consecutive_skips),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}.")
        self._growth_interval = growth_interval
        self._hysteresis = hysteresis
        self._max_skips = max_consecutive_skips
        self._min_scale = _check_positive("min_scale", min_scale, zero=True)
        self._max_scale = _check_positive("max_scale", max_scale)
        if not self._min_scale <= self._init_scale <= self._max_scale:
            raise ValueError(
                f"init_scale={init_scale} must lie in [min_scale, max_scale] = "
                f"[{min_scale}, {max_scale}]."
            )
        self._enabled = bool(enabled)
        self._dynamic = bool(dynamic)
        self._device = torch.device(device) if device is not None else None
        self._scale: torch.Tensor | None = None
        self._growth_tracker: torch.Tensor | None = None
        self._overflow_run: torch.Tensor | None = None
        self._updates_since_check = 0
        self._pending: dict[str, Any] | None = None  # state loaded before the first scale()
        self._per_optimizer: dict[int, dict[str, Any]] = {}

    # ------------------------------------------------------------------ state

    def is_enabled(self) -> bool:
        """Whether scaling is on (GradScaler's name)."""
        return self._enabled

    @property
    def enabled(self) -> bool:
        """Whether scaling is on."""
        return self._enabled

    def _lazy_init(self, device: torch.device) -> None:
        saved = self._pending or {}
        self._scale = torch.full(
            (), saved.get("scale", self._init_scale), dtype=torch.float32, device=device
        )
        self._growth_tracker = torch.full(
            (), saved.get("_growth_tracker", 0), dtype=torch.int32, device=device
        )
        self._overflow_run = torch.full(
            (), saved.get("_overflow_run", 0), dtype=torch.int32, device=device
        )
        self._pending = None

    def _state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return self._per_optimizer.setdefault(
            id(optimizer), {"stage": _Stage.READY, "found_inf": None, "optimizer": optimizer}
        )

    def get_scale(self) -> float:
        """The current scale as a Python float (reads the device value: a host sync)."""
        if not self._enabled:
            return 1.0
        if self._scale is None:
            return float((self._pending or {}).get("scale", self._init_scale))
        return float(self._scale.item())

    def get_growth_factor(self) -> float:
        """The factor the scale grows by (``growth_factor``)."""
        return self._growth_factor

    def get_backoff_factor(self) -> float:
        """The factor the scale backs off by (``backoff_factor``)."""
        return self._backoff_factor

    def get_growth_interval(self) -> int:
        """Clean steps in a row before the scale grows (``growth_interval``)."""
        return self._growth_interval

    # ------------------------------------------------------------------ scale

    @overload
    def scale(self, outputs: torch.Tensor) -> torch.Tensor: ...

    @overload
    def scale(self, outputs: list[torch.Tensor]) -> list[torch.Tensor]: ...

    @overload
    def scale(self, outputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]: ...

    @overload
    def scale(self, outputs: Iterable[torch.Tensor]) -> Iterable[torch.Tensor]: ...

    def scale(self, outputs: Any) -> Any:
        """Multiply a loss (or a tensor, or an iterable of them) by the scale.

        Args:
            outputs: A tensor, or a list, tuple or other iterable of tensors.

        Returns:
            ``outputs`` times the scale, in the same structure (unchanged when disabled).

        Raises:
            TypeError: Neither a tensor nor an iterable of tensors.
        """
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            if self._scale is None:
                self._lazy_init(outputs.device if self._device is None else self._device)
            scale = cast(torch.Tensor, self._scale)  # (made by _lazy_init)
            return outputs * scale.to(outputs.device, non_blocking=True)
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(o) for o in outputs)
        if isinstance(outputs, Iterable):
            return map(self.scale, outputs)
        raise TypeError(
            f"scale() takes a tensor or an iterable of tensors, got {type(outputs).__name__}."
        )

    def _require_scale(self, what: str) -> torch.Tensor:
        if self._scale is None:
            raise RuntimeError(
                f"{what} was called before scale(): call scaler.scale(loss).backward() first, so "
                "the gradients carry the scale."
            )
        return self._scale

    # ------------------------------------------------------------------ unscale

    def _grads(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        grads = []
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise ValueError(
                        "LossScaler does not unscale sparse gradients; use dense gradients."
                    )
                # A DTensor's gradient (FSDP2): its local shard, unscaled in place like any
                # other; the optimizer's step combines every rank's finding (lowprec.optim.shards).
                grads.append(local(p.grad) if is_dtensor(p.grad) else p.grad)
        return grads

    def _check_and_unscale(self, grads: list[torch.Tensor], inv_scale: torch.Tensor,
                           found_inf: torch.Tensor) -> None:
        by_key: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for g in grads:
            by_key.setdefault((g.device, g.dtype), []).append(g)
        for (device, _), group in by_key.items():
            local_found = torch.zeros((), dtype=torch.float32, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(
                group, local_found, inv_scale.to(device, non_blocking=True)
            )
            found_inf.add_(local_found.to(found_inf.device, non_blocking=True))

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale in place (e.g. before clipping).

        FP16 gradients are unscaled in FP16, so values that only the scale kept above 2**-24
        flush to zero here; unscale only when you need true gradients (clipping, logging).

        Args:
            optimizer: The optimizer whose parameters' gradients are unscaled.

        Raises:
            RuntimeError: Called twice for an optimizer in one iteration, after ``step``, or
                before ``scale``.
        """
        if not self._enabled:
            return
        state = self._state(optimizer)
        if state["stage"] is _Stage.UNSCALED:
            raise RuntimeError(
                "unscale_() was already called on this optimizer since the last update(); "
                "unscale once per iteration, after the last backward."
            )
        if state["stage"] is _Stage.STEPPED:
            raise RuntimeError(
                "unscale_() was called after step() on this optimizer; call it before step(), "
                "then call update() to finish the iteration."
            )
        scale = self._require_scale("unscale_()")
        inv_scale = scale.double().reciprocal().float()
        found_inf = torch.zeros((), dtype=torch.float32, device=scale.device)
        self._check_and_unscale(self._grads(optimizer), inv_scale, found_inf)
        state["found_inf"] = found_inf
        state["stage"] = _Stage.UNSCALED

    # ------------------------------------------------------------------ step

    def step(
        self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        """Unscale (if not done yet) and step ``optimizer`` unless a gradient holds inf/NaN.

        A ``closure`` keyword is evaluated once first (it should compute the loss and call
        ``scaler.scale(loss).backward()``), then the step proceeds without it.

        Args:
            optimizer: The optimizer to step: a lowprec optimizer takes the scale and the
                found-inf flag into its own step (no host sync); any other is stepped only when
                its gradients are finite, as GradScaler steps it.
            *args: Passed to ``optimizer.step``.
            **kwargs: Passed to ``optimizer.step`` (but ``closure``, evaluated first).

        Returns:
            A 0-d bool tensor, True when the optimizer stepped. Reading it on the host
            (``if scaler.step(opt):``) syncs with the device; ignoring it does not.
        """
        if not self._enabled:
            optimizer.step(*args, **kwargs)
            return torch.tensor(True)
        closure: Callable[[], Any] | None = kwargs.pop("closure", None)
        if closure is not None:
            with torch.enable_grad():
                closure()
        state = self._state(optimizer)
        if state["stage"] is _Stage.STEPPED:
            raise RuntimeError(
                "step() was already called on this optimizer since the last update(); call "
                "scaler.update() once per iteration, after the steps."
            )
        scale = self._require_scale("step()")
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            # The optimizer unscales inside its update and skips on the device.
            from lowprec.optim.base import LowPrecisionOptimizer

            if state["stage"] is _Stage.UNSCALED:
                grad_scale, found_inf = None, state["found_inf"]
            else:
                grad_scale = scale
                found_inf = torch.zeros((), dtype=torch.float32, device=scale.device)
                if not isinstance(optimizer, LowPrecisionOptimizer):
                    # torch's fused optimizers expect the flag computed beforehand.
                    self._check_and_unscale(
                        self._grads(optimizer), torch.ones_like(scale), found_inf
                    )
            # (the contract's attributes, which torch.optim.Optimizer does not declare)
            contract: Any = optimizer
            contract.grad_scale = grad_scale
            contract.found_inf = found_inf
            try:
                optimizer.step(*args, **kwargs)
            finally:
                del contract.grad_scale, contract.found_inf
            state["found_inf"] = found_inf
        else:
            if state["stage"] is _Stage.READY:
                self.unscale_(optimizer)
            found_inf = state["found_inf"]
            if not found_inf.item():  # an optimizer without the contract needs a host decision
                optimizer.step(*args, **kwargs)
        state["stage"] = _Stage.STEPPED
        return found_inf == 0

    # ------------------------------------------------------------------ update

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Adjust the scale from this iteration's overflows and reset for the next iteration.

        Args:
            new_scale: Set the scale to this value instead (default: None).
        """
        if not self._enabled:
            return
        scale = self._require_scale("update()")
        if new_scale is not None:
            value = float(new_scale)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"new_scale must be finite and > 0, got {new_scale}.")
            scale.fill_(value)
            self._per_optimizer.clear()
            return
        stepped = [s for s in self._per_optimizer.values() if s["stage"] is _Stage.STEPPED]
        if not stepped:
            raise RuntimeError(
                "update() was called without a scaler.step(optimizer) since the last update(); "
                "call scaler.step(optimizer) for each optimizer first."
            )
        # (made with the scale: _lazy_init)
        overflow_run = cast(torch.Tensor, self._overflow_run)
        growth_tracker = cast(torch.Tensor, self._growth_tracker)
        found = torch.zeros((), dtype=torch.float32, device=scale.device)
        for s in stepped:
            found.add_(s["found_inf"].to(scale.device, non_blocking=True))
        overflow = found > 0
        run = torch.where(overflow, overflow_run + 1, torch.zeros_like(overflow_run))
        overflow_run.copy_(run)
        if self._dynamic:
            clean = torch.where(
                overflow, torch.zeros_like(growth_tracker), growth_tracker + 1
            )
            grow = clean >= self._growth_interval
            grown = scale * self._growth_factor
            # Grow only to a value at most max_scale (never to inf), as GradScaler keeps the
            # scale when growing would overflow.
            grown = torch.where(grown <= self._max_scale, grown, scale)
            backed = torch.clamp(scale * self._backoff_factor, min=self._min_scale)
            back_off = overflow & (run >= self._hysteresis)
            new = torch.where(back_off, backed, torch.where(grow, grown, scale))
            scale.copy_(new)
            growth_tracker.copy_(torch.where(grow, torch.zeros_like(clean), clean))
        self._per_optimizer.clear()
        self._updates_since_check += 1
        every = 1 if scale.device.type == "cpu" else max(1, self._max_skips // 4)
        if self._updates_since_check >= every:
            self._updates_since_check = 0
            skipped = int(overflow_run.item())
            if skipped >= self._max_skips:
                raise NonFiniteLossError(
                    f"the last {skipped} steps all had inf/NaN gradients (scale now "
                    f"{float(scale.item()):g}, min_scale {self._min_scale:g}): the forward pass "
                    "or the loss is itself non-finite, not overflowing because of the scale. "
                    "Look for a log/division of zero, an exploding activation, FP16 "
                    "overflow in softmax/normalization (keep those layers in FP32), or a learning "
                    "rate that diverged; raise max_consecutive_skips if this is expected."
                )

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """Plain numbers: GradScaler's keys plus lowprec's options and overflow run."""
        if not self._enabled:
            return {}
        if self._scale is None:
            saved = self._pending or {}
            scale = saved.get("scale", self._init_scale)
            tracker = saved.get("_growth_tracker", 0)
            run = saved.get("_overflow_run", 0)
        else:
            scale = float(self._scale.item())
            # (made with the scale: _lazy_init)
            tracker = int(cast(torch.Tensor, self._growth_tracker).item())
            run = int(cast(torch.Tensor, self._overflow_run).item())
        return {
            "scale": scale,
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
            "_growth_tracker": tracker,
            "dynamic": self._dynamic,
            "min_scale": self._min_scale,
            "max_scale": self._max_scale,
            "hysteresis": self._hysteresis,
            "max_consecutive_skips": self._max_skips,
            "_overflow_run": run,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a ``state_dict`` of this class or of ``torch.amp.GradScaler``.

        Every value is checked before any is applied: a bad state dict raises and leaves the
        scaler unchanged.

        Args:
            state_dict: What ``state_dict()`` returned, here or from GradScaler.

        Raises:
            RuntimeError: An empty state dict (from a disabled scaler) for an enabled one.
            ValueError: A missing key or a value out of range.
        """
        if not self._enabled:
            return
        if len(state_dict) == 0:
            raise RuntimeError(
                "the scaler state dict is empty: it came from a disabled scaler; load it only "
                "into a disabled scaler, or start this one fresh."
            )
        missing = {"scale", "growth_factor", "backoff_factor", "growth_interval",
                   "_growth_tracker"} - set(state_dict)
        if missing:
            raise ValueError(f"not a loss-scaler state dict: missing {sorted(missing)}.")

        def count(name: str, default: int, low: int) -> int:
            value = state_dict.get(name, default)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}.")
            return value

        scale = _check_positive("scale", state_dict["scale"])
        growth_factor = _check_positive("growth_factor", state_dict["growth_factor"],
                                        above_one=True)
        backoff_factor = _check_positive("backoff_factor", state_dict["backoff_factor"])
        if backoff_factor >= 1:
            raise ValueError(f"backoff_factor must be < 1, got {backoff_factor}.")
        growth_interval = count("growth_interval", 0, 1)
        tracker = count("_growth_tracker", 0, 0)
        run = count("_overflow_run", 0, 0)
        hysteresis = count("hysteresis", self._hysteresis, 1)
        max_skips = count("max_consecutive_skips", self._max_skips, 1)
        min_scale = _check_positive(
            "min_scale", state_dict.get("min_scale", self._min_scale), zero=True
        )
        max_scale = _check_positive("max_scale", state_dict.get("max_scale", self._max_scale))
        if not min_scale <= max_scale:
            raise ValueError(f"min_scale={min_scale} must be <= max_scale={max_scale}.")
        if "min_scale" in state_dict and not min_scale <= scale <= max_scale:
            # (a GradScaler state has no bounds: its scale is taken as it is)
            raise ValueError(
                f"scale={scale} must lie in [min_scale, max_scale] = [{min_scale}, {max_scale}]."
            )

        self._growth_factor = growth_factor
        self._backoff_factor = backoff_factor
        self._growth_interval = growth_interval
        self._dynamic = bool(state_dict.get("dynamic", self._dynamic))
        self._min_scale = min_scale
        self._max_scale = max_scale
        self._hysteresis = hysteresis
        self._max_skips = max_skips
        values = {"scale": scale, "_growth_tracker": tracker, "_overflow_run": run}
        if self._scale is None:
            self._pending = values
        else:
            self._scale.fill_(values["scale"])
            # (made with the scale: _lazy_init)
            cast(torch.Tensor, self._growth_tracker).fill_(values["_growth_tracker"])
            cast(torch.Tensor, self._overflow_run).fill_(values["_overflow_run"])
        self._per_optimizer.clear()
