"""AdamW (decoupled weight decay, optional AMSGrad) over any master storage.

``adamw_update`` is the whole update rule, written once in FP32 with the same operations, in the
same order, as ``torch.optim.AdamW``'s single-tensor path, so ``master="none"`` on FP32 parameters
follows torch bit for bit. The decay multiplies the FP32 master, so with a compensated ``master``
a decay below half an ulp of the stored weight still takes effect.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from lowprec.optim.base import LowPrecisionOptimizer, _as_float, _validate_betas

__all__ = ["AdamW", "adamw_update"]


def adamw_update(
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
    maximize: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One AdamW update in FP32 (pure: the inputs are not modified).

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
        weight_decay: Decoupled weight decay: ``w *= 1 - lr * weight_decay``.
        step: The step number, from 1, for bias correction.
        maximize: Ascend instead of descend (default: False).

    Returns:
        ``(new_w, new_exp_avg, new_exp_avg_sq, new_max_exp_avg_sq)``.
    """
    if maximize:
        g = -g
    if weight_decay != 0:
        w = w * (1 - lr * weight_decay)
    m = torch.lerp(exp_avg, g, 1 - beta1)
    v = torch.addcmul(exp_avg_sq * beta2, g, g, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    bias_correction2_sqrt = bias_correction2**0.5
    vmax = None
    if max_exp_avg_sq is not None:
        vmax = torch.maximum(max_exp_avg_sq, v)
        denom = (vmax.sqrt() / bias_correction2_sqrt).add_(eps)
    else:
        denom = (v.sqrt() / bias_correction2_sqrt).add_(eps)
    return torch.addcdiv(w, m, denom, value=-step_size), m, v, vmax


class AdamW(LowPrecisionOptimizer):
    """AdamW with a choice of master-weight storage.

    Same defaults and semantics as ``torch.optim.AdamW``.

    Args:
        params: Parameters or parameter groups.
        lr: Learning rate (default: 1e-3).
        betas: Moment decay rates (default: (0.9, 0.999)).
        eps: Added to the denominator (default: 1e-8).
        weight_decay: Decoupled weight decay (default: 1e-2).
        amsgrad: Use the running maximum of the second moment (default: False).
        maximize: Maximize the objective (default: False).
        master: How the master weight is kept: ``"auto"``, ``"none"``, ``"fp32"``, ``"split"``,
            ``"kahan"`` or ``"stochastic"`` (default: ``"auto"``; see ``lowprec.optim``).
        state_dtype: dtype of the moments (default: None, meaning float32 for ``"fp32"`` and
            ``"split"`` and the parameter's dtype otherwise).
        seed: Seed of the stochastic-rounding hash (default: None, meaning ``torch.initial_seed()``).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        master: str = "auto",
        state_dtype: torch.dtype | None = None,
        seed: int | None = None,
    ) -> None:
        defaults = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
            maximize=maximize, master=master, state_dtype=state_dtype, seed=seed,
        )
        super().__init__(params, defaults)

    def _validate_hparams(self, group):
        for name in ("lr", "eps", "weight_decay"):
            if _as_float(group[name], name) < 0:
                raise ValueError(f"invalid {name}={group[name]}: must be >= 0.")
        _validate_betas(group["betas"])

    def _math_buffers(self, group):
        names = ("exp_avg", "exp_avg_sq")
        return (*names, "max_exp_avg_sq") if group["amsgrad"] else names

    def _update(self, w, g, bufs, group, step):
        beta1, beta2 = group["betas"]
        new_w, m, v, vmax = adamw_update(
            w, g, bufs["exp_avg"], bufs["exp_avg_sq"], bufs.get("max_exp_avg_sq"),
            lr=_as_float(group["lr"], "lr"), beta1=float(beta1), beta2=float(beta2),
            eps=group["eps"], weight_decay=group["weight_decay"], step=step,
            maximize=group["maximize"],
        )
        out = {"exp_avg": m, "exp_avg_sq": v}
        if vmax is not None:
            out["max_exp_avg_sq"] = vmax
        return new_w, out
