"""LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning", Algorithm 2).

Adam moments with bias correction, then a per-tensor trust ratio::

    u = m_hat / (sqrt(v_hat) + eps) + weight_decay * w
    ratio = ||w|| / ||u||        (1 when either norm is 0)
    w = w - lr * ratio * u

No options beyond the paper's but ``maximize``: no clamp on ``||w||``, no gradient-norm
pre-scaling. The norms are of the FP32 master and update; the ratio stays a tensor (no host sync).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from lowprec.numerics import plus_l2, sqrt_rn, sum_squares
from lowprec.optim.base import LowPrecisionOptimizer
from lowprec.optim.options import _l2, _moment_hparams

if TYPE_CHECKING:  # pragma: no cover
    from torch.optim.optimizer import ParamsT

__all__ = ["Lamb", "lamb_coefficients", "lamb_math", "lamb_norm_terms"]


def lamb_coefficients(
    *, lr: float | torch.Tensor, beta1: float, beta2: float, eps: float, weight_decay: float,
    step: Any,
) -> dict[str, Any]:
    """The per-step scalars of ``lamb_math``: host floats, or 0-d tensors for a tensor step.

    Bias corrections folded: ``(m / bc1) / (sqrt(v) / bc2 + eps)`` is ``m * (bc2 / bc1) / (sqrt(v)
    + eps * bc2)``, ``bc2 = sqrt(1 - beta2**step)``: one division per element instead of three.
    """
    bc2 = (1 - beta2**step) ** 0.5
    return {
        "lr": lr,
        "beta1": beta1,
        "one_minus_beta1": 1 - beta1,
        "beta2": beta2,
        "one_minus_beta2": 1 - beta2,
        "m_scale": bc2 / (1 - beta1**step),
        "eps": eps * bc2,
        "weight_decay": weight_decay,
    }


def _lamb_direction(
    w: torch.Tensor, g: torch.Tensor, bufs: dict[str, torch.Tensor], c: dict[str, Any],
    l2: bool,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The elementwise part of LAMB: the update direction ``u`` and the new moments."""
    m = bufs["exp_avg"] * c["beta1"] + g * c["one_minus_beta1"]
    v = bufs["exp_avg_sq"] * c["beta2"] + (g * g) * c["one_minus_beta2"]
    # m_hat / (sqrt(v_hat) + eps), the bias corrections folded into c (lamb_coefficients).
    u = (m * c["m_scale"]) / (sqrt_rn(v) + c["eps"])
    if l2:
        u = plus_l2(u, w, c["weight_decay"])
    return u, {"exp_avg": m, "exp_avg_sq": v}


def lamb_norm_terms(
    w: torch.Tensor,
    g: torch.Tensor,
    bufs: dict[str, torch.Tensor],
    c: dict[str, Any],
    *,
    l2: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The tensors whose norms make the trust ratio, ``(w, u)``, over a piece of a tensor (pure).

    The optimizer sums their squares over the whole tensor and hands the two sums to
    ``lamb_math`` as ``c["sums"]`` (no full-size temporary for the norms).
    """
    u, _ = _lamb_direction(w, g, bufs, c, l2)
    return w, u


def lamb_math(
    w: torch.Tensor,
    g: torch.Tensor,
    bufs: dict[str, torch.Tensor],
    c: dict[str, Any],
    *,
    l2: bool = True,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One LAMB update of one tensor in FP32 from precomputed coefficients ``c`` (pure).

    Elementwise but for the two norms of the trust ratio, which stays a 0-d tensor (no host sync).
    ``c["sums"]``, when given, holds the whole tensor's sums of squares of ``lamb_norm_terms``
    (FP64, 2 elements) and replaces those of ``w``, which must then be all of the tensor.
    """
    u, out = _lamb_direction(w, g, bufs, c, l2)
    # FP64 sums (sum_squares): the eager, chunked, compiled and pairs reductions add in
    # different orders, and FP64 hides that in the FP32 ratio.
    sums = c["sums"] if "sums" in c else torch.stack([sum_squares(w), sum_squares(u)])
    w_norm, u_norm = sums.sqrt().float().unbind()
    ratio = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
    return w - u * (ratio * c["lr"]), out


class Lamb(LowPrecisionOptimizer):
    """LAMB with a choice of master-weight storage.

    Args:
        params: Parameters or parameter groups.
        lr: Learning rate (default: 1e-3).
        betas: Moment decay rates (default: (0.9, 0.999)).
        eps: Added to the denominator (default: 1e-6, as in the paper).
        weight_decay: Weight decay inside the trust-ratio update (default: 0).
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
        eps: float = 1e-6,
        weight_decay: float = 0.0,
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
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, maximize=maximize,
            master=master, state_dtype=state_dtype, seed=seed, fused=fused,
        )
        super().__init__(params, defaults, foreach=foreach, capturable=capturable,
                         differentiable=differentiable)

    _nonnegative_hparams = ("lr", "eps", "weight_decay")
    _has_betas = True
    _buffer_names = ("exp_avg", "exp_avg_sq")
    _nonnegative_buffers = ("exp_avg_sq",)

    def _coefficients(self, group: dict[str, Any], step: int | torch.Tensor) -> dict[str, Any]:
        return lamb_coefficients(**_moment_hparams(group), step=step)

    def _flags(self, group: dict[str, Any]) -> dict[str, bool]:
        return dict(l2=_l2(group["weight_decay"]))

    _math = staticmethod(lamb_math)
    _norm_terms = staticmethod(lamb_norm_terms)  # (the trust ratio's whole-tensor norms)
