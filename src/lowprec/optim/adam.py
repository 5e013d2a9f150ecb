"""Adam (L2 or decoupled weight decay, optional AMSGrad) over any master storage.

Adam's rule is AdamW's, ``adamw_math`` (so the two share compiled kernels), with torch.optim.Adam's
default L2 decay: ``weight_decay * w`` added to the gradient (``adamw_coefficients`` with
``decoupled=False``). ``decoupled_weight_decay=True`` is AdamW's step, bit for bit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from lowprec.optim.adamw import adamw_coefficients, adamw_math
from lowprec.optim.base import LowPrecisionOptimizer
from lowprec.optim.options import _check_nonnegative, _l2, _lr, _validate_betas

if TYPE_CHECKING:  # pragma: no cover
    from torch.optim.optimizer import ParamsT

__all__ = ["Adam", "adam_update"]


def adam_update(
    w: torch.Tensor,
    g: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    max_exp_avg_sq: torch.Tensor | None,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    decoupled_weight_decay: bool = False,
    maximize: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One Adam update in FP32 (pure: the inputs are not modified); the functional form.

    Args:
        w: The FP32 master weight.
        g: The FP32 gradient.
        exp_avg: First moment.
        exp_avg_sq: Second moment.
        max_exp_avg_sq: Running maximum of the second moment (AMSGrad), or None.
        lr: Learning rate.
        beta1: First-moment decay.
        beta2: Second-moment decay.
        eps: Added to the denominator.
        weight_decay: L2 penalty added to the gradient, or with ``decoupled_weight_decay``
            ``w *= 1 - lr * weight_decay``.
        step: The step number, from 1, for bias correction.
        decoupled_weight_decay: Decay the weight as AdamW does (default: False).
        maximize: Ascend instead of descend (default: False).

    Returns:
        ``(new_w, new_exp_avg, new_exp_avg_sq, new_max_exp_avg_sq)``.
    """
    c = adamw_coefficients(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                           step=step, decoupled=decoupled_weight_decay)
    bufs = {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    if max_exp_avg_sq is not None:
        bufs["max_exp_avg_sq"] = max_exp_avg_sq
    new_w, out = adamw_math(w, -g if maximize else g, bufs, c,
                            amsgrad=max_exp_avg_sq is not None)
    return new_w, out["exp_avg"], out["exp_avg_sq"], out.get("max_exp_avg_sq")


class Adam(LowPrecisionOptimizer):
    """Adam with a choice of master-weight storage.

    Same defaults and semantics as ``torch.optim.Adam``, whose checkpoints it loads.

    Args:
        params: Parameters or parameter groups.
        lr: Learning rate (default: 1e-3).
        betas: Moment decay rates (default: (0.9, 0.999)).
        eps: Added to the denominator (default: 1e-8).
        weight_decay: L2 penalty added to the gradient, or the decoupled decay with
            ``decoupled_weight_decay`` (default: 0).
        amsgrad: Use the running maximum of the second moment (default: False).
        maximize: Maximize the objective (default: False).
        decoupled_weight_decay: Decay the weight as AdamW does, ``w *= 1 - lr * weight_decay``,
            instead of adding the L2 penalty to the gradient (default: False).
        master: {master}
        state_dtype: How the moments (``exp_avg``, ``exp_avg_sq``) are kept: {state_formats}
        seed: {seed}
        fused: {fused}
        foreach: {foreach}
        capturable: {capturable}
        differentiable: {differentiable}
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        decoupled_weight_decay: bool = False,
        master: str = "auto",
        state_dtype: torch.dtype | str | None = None,
        seed: int | None = None,
        fused: bool | None = None,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
    ) -> None:
        defaults = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
            maximize=maximize, decoupled_weight_decay=decoupled_weight_decay, master=master,
            state_dtype=state_dtype, seed=seed, fused=fused,
        )
        super().__init__(params, defaults, foreach=foreach, capturable=capturable,
                         differentiable=differentiable)

    def _validate_hparams(self, group: dict[str, Any]) -> None:
        _check_nonnegative(group, "lr", "eps", "weight_decay")
        _validate_betas(group["betas"])

    _nonnegative_buffers = ("exp_avg_sq", "max_exp_avg_sq")

    def _math_buffers(
        self, group: dict[str, Any], p: torch.Tensor | None = None
    ) -> tuple[str, ...]:
        names = ("exp_avg", "exp_avg_sq")
        return (*names, "max_exp_avg_sq") if group["amsgrad"] else names

    def _coefficients(self, group: dict[str, Any], step: int | torch.Tensor) -> dict[str, Any]:
        beta1, beta2 = group["betas"]
        return adamw_coefficients(
            lr=_lr(group), beta1=float(beta1), beta2=float(beta2), eps=group["eps"],
            weight_decay=group["weight_decay"], step=step,
            decoupled=bool(group["decoupled_weight_decay"]),
        )

    def _flags(self, group: dict[str, Any]) -> dict[str, bool]:
        # (without L2 decay, AdamW's flags: AdamW's kernels)
        return dict(amsgrad=group["amsgrad"], l2=not group["decoupled_weight_decay"]
                    and _l2(group["weight_decay"]))

    _math = staticmethod(adamw_math)
