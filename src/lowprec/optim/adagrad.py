"""Adagrad (with lr decay, weight decay, initial accumulator) over any master storage.

``adagrad_update`` is the whole update rule, written once in FP32 with the same operations, in the
same order, as ``torch.optim.Adagrad``'s single-tensor path.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from lowprec.optim.base import LowPrecisionOptimizer, _as_float

__all__ = ["Adagrad", "adagrad_update"]


def adagrad_update(
    w: torch.Tensor,
    g: torch.Tensor,
    state_sum: torch.Tensor,
    *,
    lr: float,
    lr_decay: float,
    weight_decay: float,
    eps: float,
    step: int,
    maximize: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One Adagrad update in FP32 (pure: the inputs are not modified).

    Args:
        w: The FP32 master weight.
        g: The FP32 gradient.
        state_sum: The running sum of squared gradients.
        lr: Learning rate.
        lr_decay: The step size is ``lr / (1 + (step - 1) * lr_decay)``.
        weight_decay: L2 penalty added to the gradient.
        eps: Added to the denominator.
        step: The step number, from 1.
        maximize: Ascend instead of descend (default: False).

    Returns:
        ``(new_w, new_state_sum)``.
    """
    if maximize:
        g = -g
    if weight_decay != 0:
        g = g.add(w, alpha=weight_decay)
    clr = lr / (1 + (step - 1) * lr_decay)
    s = torch.addcmul(state_sum, g, g, value=1)
    std = s.sqrt().add_(eps)
    return torch.addcdiv(w, g, std, value=-clr), s


class Adagrad(LowPrecisionOptimizer):
    """Adagrad with a choice of master-weight storage.

    Same defaults and semantics as ``torch.optim.Adagrad`` (dense gradients only).

    Args:
        params: Parameters or parameter groups.
        lr: Learning rate (default: 1e-2).
        lr_decay: Learning-rate decay (default: 0).
        weight_decay: L2 penalty (default: 0).
        initial_accumulator_value: Starting value of the squared-gradient sum (default: 0).
        eps: Added to the denominator (default: 1e-10).
        maximize: Maximize the objective (default: False).
        master: How the master weight is kept: ``"auto"``, ``"none"``, ``"fp32"``, ``"split"``,
            ``"kahan"`` or ``"stochastic"`` (default: ``"auto"``; see ``lowprec.optim``).
        state_dtype: dtype of the squared-gradient sum (default: None, meaning float32 for
            ``"fp32"`` and ``"split"`` and the parameter's dtype otherwise).
        seed: Seed of the stochastic-rounding hash (default: None, meaning ``torch.initial_seed()``).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-2,
        lr_decay: float = 0.0,
        weight_decay: float = 0.0,
        initial_accumulator_value: float = 0.0,
        eps: float = 1e-10,
        *,
        maximize: bool = False,
        master: str = "auto",
        state_dtype: torch.dtype | None = None,
        seed: int | None = None,
    ) -> None:
        defaults = dict(
            lr=lr, lr_decay=lr_decay, weight_decay=weight_decay,
            initial_accumulator_value=initial_accumulator_value, eps=eps, maximize=maximize,
            master=master, state_dtype=state_dtype, seed=seed,
        )
        super().__init__(params, defaults)

    def _validate_hparams(self, group):
        for name in ("lr", "lr_decay", "weight_decay", "initial_accumulator_value", "eps"):
            if _as_float(group[name], name) < 0:
                raise ValueError(f"invalid {name}={group[name]}: must be >= 0.")

    def _math_buffers(self, group):
        return ("sum",)

    def _init_math_buffer(self, name, param, group):
        return float(group["initial_accumulator_value"])

    def _update(self, w, g, bufs, group, step):
        new_w, s = adagrad_update(
            w, g, bufs["sum"], lr=_as_float(group["lr"], "lr"), lr_decay=group["lr_decay"],
            weight_decay=group["weight_decay"], eps=group["eps"], step=step,
            maximize=group["maximize"],
        )
        return new_w, {"sum": s}
