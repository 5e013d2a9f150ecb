"""RAdam (Liu et al. 2020, "On the Variance of the Adaptive Learning Rate and Beyond") over any
master storage.

Adam's moments; while the approximated SMA length ``rho_t`` is at most 5 the step is the
un-adapted ``lr * m_hat``, after it ``lr * rect * m_hat * sqrt(1 - beta2**step) / (sqrt(v) + eps)``.
The step number alone decides which, so ``radam_coefficients`` picks it (on the host, or on the
device for a step counted there) and ``radam_math`` is one branch-free formula for both.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from lowprec.numerics import plus_l2, sqrt_rn
from lowprec.optim.base import LowPrecisionOptimizer
from lowprec.optim.options import _l2, _moment_hparams

if TYPE_CHECKING:  # pragma: no cover
    from torch.optim.optimizer import ParamsT

__all__ = ["RAdam", "radam_coefficients", "radam_math"]


def radam_coefficients(
    *, lr: float | torch.Tensor, beta1: float, beta2: float, eps: float, weight_decay: float,
    step: Any, decoupled: bool = False,
) -> dict[str, Any]:
    """The per-step scalars of ``radam_math``: host floats, or 0-d tensors for a tensor step.
    ``decay`` and ``l2`` as ``adamw_coefficients`` (L2 is torch.optim.RAdam's default).

    ``radam_math`` steps by ``step_size * m / (sqrt(min(v, v_max)) + eps)``. Rectified:
    ``step_size = lr * rect * sqrt(bc2) / bc1``, ``v_max = inf``, ``eps`` itself (torch adds it
    before the bias correction ``sqrt(bc2)``). Un-adapted: ``step_size = lr / bc1``, ``v_max = 0``,
    ``eps = 1``: ``lr * m / bc1`` whatever ``v`` is (0, or +inf after an overflow).
    """
    bc1 = 1 - beta1**step
    bc2 = 1 - beta2**step
    rho_inf = 2 / (1 - beta2) - 1
    rho_t = rho_inf - 2 * step * beta2**step / bc2
    rectified = rho_t > 5
    # (rect's square is negative, or its denominator 0, only where the step is not rectified)
    if isinstance(rectified, torch.Tensor):  # (a step counted on the device: decided there)
        r = (rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t)
        rect = torch.where(rectified, r, 0.0).sqrt()
        pick = lambda a, b: torch.where(rectified, a, b)  # noqa: E731
    else:
        rect = (
            (rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t)
        ) ** 0.5 if rectified else 0.0
        pick = lambda a, b: a if rectified else b  # noqa: E731
    return {
        "decay": 1 - lr * weight_decay if decoupled else 1.0,
        "l2": 0.0 if decoupled else weight_decay,
        "beta1": beta1,
        "one_minus_beta1": 1 - beta1,
        "beta2": beta2,
        "one_minus_beta2": 1 - beta2,
        "step_size": pick(lr * rect * bc2**0.5 / bc1, lr / bc1),
        "v_max": pick(math.inf, 0.0),
        "eps": pick(eps, 1.0),
    }


def radam_math(
    w: torch.Tensor,
    g: torch.Tensor,
    bufs: dict[str, torch.Tensor],
    c: dict[str, Any],
    *,
    l2: bool = True,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One RAdam update in FP32, per element, from precomputed coefficients ``c`` (pure); the
    static flag ``l2`` adds the L2 term ``c["l2"] * w``."""
    if l2:
        g = plus_l2(g, w, c["l2"])
    w = w * c["decay"]  # (1 without decoupled decay: w itself)
    m = bufs["exp_avg"] * c["beta1"] + g * c["one_minus_beta1"]
    v = bufs["exp_avg_sq"] * c["beta2"] + (g * g) * c["one_minus_beta2"]
    denom = sqrt_rn(v.clamp(max=c["v_max"])) + c["eps"]
    return w - (m * c["step_size"]) / denom, {"exp_avg": m, "exp_avg_sq": v}


class RAdam(LowPrecisionOptimizer):
    """RAdam with a choice of master-weight storage.

    Same defaults and semantics as ``torch.optim.RAdam``, whose checkpoints it loads.

    Args:
        params: Parameters or parameter groups.
        lr: Learning rate (default: 1e-3).
        betas: Moment decay rates (default: (0.9, 0.999)).
        eps: Added to the denominator (default: 1e-8).
        weight_decay: L2 penalty added to the gradient, or the decoupled decay with
            ``decoupled_weight_decay`` (default: 0).
        decoupled_weight_decay: Decay the weight as AdamW does, ``w *= 1 - lr * weight_decay``,
            instead of adding the L2 penalty to the gradient (default: False).
        maximize: Maximize the objective (default: False).
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
        decoupled_weight_decay: bool = False,
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
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
            decoupled_weight_decay=decoupled_weight_decay, maximize=maximize, master=master,
            state_dtype=state_dtype, seed=seed, fused=fused,
        )
        super().__init__(params, defaults, foreach=foreach, capturable=capturable,
                         differentiable=differentiable)

    _nonnegative_hparams = ("lr", "eps", "weight_decay")
    _has_betas = True
    _buffer_names = ("exp_avg", "exp_avg_sq")
    _nonnegative_buffers = ("exp_avg_sq",)

    def _coefficients(self, group: dict[str, Any], step: int | torch.Tensor) -> dict[str, Any]:
        return radam_coefficients(**_moment_hparams(group), step=step,
                                  decoupled=bool(group["decoupled_weight_decay"]))

    def _flags(self, group: dict[str, Any]) -> dict[str, bool]:
        return dict(l2=not group["decoupled_weight_decay"] and _l2(group["weight_decay"]))

    _math = staticmethod(radam_math)
