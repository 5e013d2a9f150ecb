"""SGD with momentum, dampening, Nesterov, weight decay and maximize, over any master storage.

``sgd_update`` is the whole update rule, written once in FP32 with the same operations, in the same
order, as ``torch.optim.SGD``'s single-tensor path, so ``master="none"`` on FP32 parameters follows
torch bit for bit. ``SGD`` drives it over parameters stored as ``master=`` says.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from lowprec.optim.base import LowPrecisionOptimizer, _as_float

__all__ = ["SGD", "sgd_update"]


def sgd_update(
    w: torch.Tensor,
    g: torch.Tensor,
    momentum_buffer: torch.Tensor | None,
    *,
    lr: float,
    momentum: float = 0.0,
    dampening: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    maximize: bool = False,
    first_step: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One SGD update in FP32 (pure: the inputs are not modified).

    Args:
        w: The FP32 master weight.
        g: The FP32 gradient.
        momentum_buffer: The FP32 momentum buffer, or None when ``momentum == 0``.
        lr: Learning rate.
        momentum: Momentum factor (default: 0).
        dampening: Dampening of the momentum (default: 0).
        nesterov: Nesterov momentum (default: False).
        weight_decay: L2 penalty added to the gradient (default: 0).
        maximize: Ascend instead of descend (default: False).
        first_step: The buffer is initialised to the gradient on the first step (default: False).

    Returns:
        ``(new_w, new_momentum_buffer)``.
    """
    d = -g if maximize else g
    if weight_decay != 0:
        d = d.add(w, alpha=weight_decay)
    buf = momentum_buffer
    if momentum != 0:
        buf = d.clone() if first_step else torch.add(buf * momentum, d, alpha=1 - dampening)
        d = d.add(buf, alpha=momentum) if nesterov else buf
    return w.add(d, alpha=-lr), buf


class SGD(LowPrecisionOptimizer):
    """Stochastic gradient descent with a choice of master-weight storage.

    Same defaults and semantics as ``torch.optim.SGD``.

    Args:
        params: Parameters or parameter groups.
        lr: Learning rate (default: 1e-3).
        momentum: Momentum factor (default: 0).
        dampening: Dampening for momentum (default: 0).
        weight_decay: L2 penalty (default: 0). With a compensated ``master`` it takes effect even
            when ``lr * weight_decay * w`` is below half an ulp of the stored weight.
        nesterov: Nesterov momentum; needs ``momentum > 0`` and ``dampening == 0`` (default: False).
        maximize: Maximize the objective (default: False).
        master: How the master weight is kept: ``"auto"``, ``"none"``, ``"fp32"``, ``"split"``,
            ``"kahan"`` or ``"stochastic"`` (default: ``"auto"``; see ``lowprec.optim``).
        state_dtype: dtype of the momentum buffer (default: None, meaning float32 for ``"fp32"``
            and ``"split"`` and the parameter's dtype otherwise).
        seed: Seed of the stochastic-rounding hash (default: None, meaning ``torch.initial_seed()``).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
        master: str = "auto",
        state_dtype: torch.dtype | None = None,
        seed: int | None = None,
    ) -> None:
        defaults = dict(
            lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
            nesterov=nesterov, maximize=maximize, master=master, state_dtype=state_dtype,
            seed=seed,
        )
        super().__init__(params, defaults)

    def _validate_hparams(self, group):
        for name in ("lr", "momentum", "dampening", "weight_decay"):
            if _as_float(group[name], name) < 0:
                raise ValueError(f"invalid {name}={group[name]}: must be >= 0.")
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ValueError(
                "nesterov=True needs momentum > 0 and dampening == 0; got momentum="
                f"{group['momentum']}, dampening={group['dampening']}."
            )

    def _math_buffers(self, group):
        return ("momentum_buffer",) if group["momentum"] != 0 else ()

    def _update(self, w, g, bufs, group, step):
        new_w, buf = sgd_update(
            w, g, bufs.get("momentum_buffer"),
            lr=_as_float(group["lr"], "lr"), momentum=group["momentum"],
            dampening=group["dampening"], nesterov=group["nesterov"],
            weight_decay=group["weight_decay"], maximize=group["maximize"],
            first_step=step == 1,
        )
        return new_w, ({"momentum_buffer": buf} if buf is not None else {})
