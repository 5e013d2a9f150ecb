"""Adagrad (with lr decay, weight decay, initial accumulator) over any master storage.

``adagrad_math`` is the FP32 rule (plain elementwise ops, host coefficients), shared by the eager
and the compiled step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from lowprec.numerics import plus_l2, sqrt_rn
from lowprec.optim.base import LowPrecisionOptimizer
from lowprec.optim.options import _l2, _lr

if TYPE_CHECKING:  # pragma: no cover
    from torch.optim.optimizer import ParamsT

__all__ = ["Adagrad", "adagrad_coefficients", "adagrad_math"]


def adagrad_coefficients(
    *, lr: float | torch.Tensor, lr_decay: float, weight_decay: float, eps: float, step: Any
) -> dict[str, Any]:
    """The per-step scalars of ``adagrad_math``, computed once on the host."""
    return {"clr": lr / (1 + (step - 1) * lr_decay), "weight_decay": weight_decay, "eps": eps}


def adagrad_math(
    w: torch.Tensor,
    g: torch.Tensor,
    bufs: dict[str, torch.Tensor],
    c: dict[str, Any],
    *,
    l2: bool = True,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One Adagrad update in FP32, per element, from precomputed coefficients ``c`` (pure); the
    static flag ``l2`` adds the L2 term."""
    if l2:
        g = plus_l2(g, w, c["weight_decay"])
    s = bufs["sum"] + g * g
    return w - (g * c["clr"]) / (sqrt_rn(s) + c["eps"]), {"sum": s}


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
        master: {master}
        state_dtype: How the squared-gradient sum is kept: {state_formats}
        seed: {seed}
        fused: {fused}
        foreach: {foreach}
        capturable: {capturable}
        differentiable: {differentiable}
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-2,
        lr_decay: float = 0.0,
        weight_decay: float = 0.0,
        initial_accumulator_value: float = 0.0,
        eps: float = 1e-10,
        *,
        maximize: bool = False,
        master: str = "auto",
        state_dtype: torch.dtype | str | None = None,
        seed: int | None = None,
        fused: bool | None = None,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
    ) -> None:
        defaults = dict(
            lr=lr, lr_decay=lr_decay, weight_decay=weight_decay,
            initial_accumulator_value=initial_accumulator_value, eps=eps, maximize=maximize,
            master=master, state_dtype=state_dtype, seed=seed, fused=fused,
        )
        super().__init__(params, defaults, foreach=foreach, capturable=capturable,
                         differentiable=differentiable)

    _nonnegative_hparams = ("lr", "lr_decay", "weight_decay", "initial_accumulator_value", "eps")
    _buffer_names = ("sum",)
    _nonnegative_buffers = ("sum",)

    def _init_math_buffer(self, name: str, param: torch.Tensor, group: dict[str, Any]) -> float:
        return float(group["initial_accumulator_value"])

    def _coefficients(self, group: dict[str, Any], step: int | torch.Tensor) -> dict[str, Any]:
        return adagrad_coefficients(
            lr=_lr(group), lr_decay=group["lr_decay"],
            weight_decay=group["weight_decay"], eps=group["eps"], step=step,
        )

    def _flags(self, group: dict[str, Any]) -> dict[str, bool]:
        return dict(l2=_l2(group["weight_decay"]))

    _math = staticmethod(adagrad_math)
