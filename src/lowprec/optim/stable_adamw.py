"""StableAdamW (Wortsman et al. 2023, "Stable and low-precision training for large-scale
vision-language models"): AdamW with per-tensor update clipping.

The learning rate is divided, per tensor, by the RMS of ``g / sqrt(v)`` where it exceeds 1
(Adafactor's update clipping), so a loss spike moves the weights no more than a usual step.
Formulas, defaults and options are optimi's ``StableAdamW``'s::

    m, v = Adam's moments with debiased betas, beta_hat = beta * (1 - beta**(t-1)) / (1 - beta**t)
    lr_t = lr / max(1, sqrt(mean(g**2 / max(v, eps**2))))      (over the tensor, the new v)
    w = w * (1 - lr_t * weight_decay) - lr_t * m / (sqrt(v) + eps)

The debiased betas replace Adam's bias corrections (``m = g`` at the first step). The RMS stays a
0-d tensor (no host sync), from FP64 sums of squares as LAMB's norms.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from lowprec.numerics import sqrt_rn, sum_squares
from lowprec.optim.base import LowPrecisionOptimizer
from lowprec.optim.lion import _resolve_max_lr
from lowprec.optim.options import _moment_hparams

if TYPE_CHECKING:  # pragma: no cover
    from torch.optim.optimizer import ParamsT

__all__ = [
    "StableAdamW", "stable_adamw_coefficients", "stable_adamw_math", "stable_adamw_norm_terms",
]


def _debiased(beta: float, step: Any) -> Any:
    """``beta * (1 - beta**(t - 1)) / (1 - beta**t)``: 0 at the first step, then towards beta."""
    return beta * (1 - beta ** (step - 1)) / (1 - beta**step)


def stable_adamw_coefficients(
    *, lr: float | torch.Tensor, beta1: float, beta2: float, eps: float, weight_decay: float,
    step: Any,
    max_lr: float | None = None,
) -> dict[str, Any]:
    """The per-step scalars of ``stable_adamw_math``: host floats, or 0-d tensors for a tensor
    step. ``max_lr`` given: the decay is fully decoupled, ``lr_t * (weight_decay / max_lr)``."""
    beta1_hat, beta2_hat = _debiased(beta1, step), _debiased(beta2, step)
    return {
        "lr": lr,
        "beta1": beta1_hat,
        "one_minus_beta1": 1 - beta1_hat,
        "beta2": beta2_hat,
        "one_minus_beta2": 1 - beta2_hat,
        "eps": eps,
        "eps_sq": eps * eps,
        "weight_decay": weight_decay if max_lr is None else weight_decay / max_lr,
    }


def _moments(
    g: torch.Tensor, bufs: dict[str, torch.Tensor], c: dict[str, Any]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The new moments ``(m, v)``."""
    m = bufs["exp_avg"] * c["beta1"] + g * c["one_minus_beta1"]
    v = bufs["exp_avg_sq"] * c["beta2"] + (g * g) * c["one_minus_beta2"]
    return m, v


def _rms_terms(
    w: torch.Tensor, g: torch.Tensor, v: torch.Tensor, c: dict[str, Any]
) -> tuple[torch.Tensor, torch.Tensor]:
    return g / sqrt_rn(torch.clamp_min(v, c["eps_sq"])), torch.ones_like(w)


def stable_adamw_norm_terms(
    w: torch.Tensor,
    g: torch.Tensor,
    bufs: dict[str, torch.Tensor],
    c: dict[str, Any],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The tensors whose sums of squares make the RMS, over a piece of a tensor (pure):
    ``g / sqrt(max(v, eps**2))`` (their sum is that of ``g**2 / max(v, eps**2)``) and ones
    (their sum is the element count, which a piece alone does not know)."""
    _, v = _moments(g, bufs, c)
    return _rms_terms(w, g, v, c)


def stable_adamw_math(
    w: torch.Tensor,
    g: torch.Tensor,
    bufs: dict[str, torch.Tensor],
    c: dict[str, Any],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One StableAdamW update of one tensor in FP32 from precomputed coefficients ``c`` (pure).

    Elementwise but for the RMS, which stays a 0-d tensor (no host sync). ``c["sums"]``, when
    given, holds the whole tensor's sums of squares of ``stable_adamw_norm_terms`` (FP64, 2
    elements) and replaces those of ``w``, which must then be all of the tensor.
    """
    m, v = _moments(g, bufs, c)
    if "sums" in c:
        sums = c["sums"]
    else:
        sums = torch.stack([sum_squares(t) for t in _rms_terms(w, g, v, c)])
    # 1 / max(1, rms) in FP64 (where eager, chunked and compiled sums agree), rounded to FP32 once.
    scale = torch.clamp_min((sums[0] / sums[1]).sqrt(), 1.0).reciprocal().float()
    lr = scale * c["lr"]
    w = w * (1 - lr * c["weight_decay"])  # (1 without decay: w, bit for bit)
    return w - (m * lr) / (sqrt_rn(v) + c["eps"]), {"exp_avg": m, "exp_avg_sq": v}


class StableAdamW(LowPrecisionOptimizer):
    """StableAdamW with a choice of master-weight storage.

    Same defaults and semantics as optimi's ``StableAdamW`` (which has no default ``lr``).

    Args:
        params: Parameters or parameter groups.
        lr: Learning rate, before each tensor's update clipping (default: 1e-3).
        betas: Moment decay rates, debiased (default: (0.9, 0.99)).
        weight_decay: Decoupled weight decay, ``w *= 1 - lr_t * weight_decay`` with the
            tensor's clipped ``lr_t`` (default: 1e-2).
        eps: Added to the denominator; ``eps**2`` floors the second moment in the RMS
            (default: 1e-6).
        decouple_lr: Fully decoupled weight decay, ``w *= 1 - (lr_t / max_lr) * weight_decay``
            (default: False).
        max_lr: The schedule's largest ``lr`` for ``decouple_lr`` (default: None, meaning the
            group's own ``lr`` when the group is added, where optimi takes the constructor's
            ``lr`` for every group; ``OneCycleLR`` sets it to its ``max_lr``).
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
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 1e-2,
        eps: float = 1e-6,
        *,
        decouple_lr: bool = False,
        max_lr: float | None = None,
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
            lr=lr, betas=betas, weight_decay=weight_decay, eps=eps, decouple_lr=decouple_lr,
            max_lr=max_lr, maximize=maximize, master=master, state_dtype=state_dtype, seed=seed,
            fused=fused,
        )
        super().__init__(params, defaults, foreach=foreach, capturable=capturable,
                         differentiable=differentiable)

    _nonnegative_hparams = ("lr", "eps", "weight_decay")
    _has_betas = True

    def _validate_hparams(self, group: dict[str, Any]) -> None:
        super()._validate_hparams(group)
        _resolve_max_lr(group)

    _buffer_names = ("exp_avg", "exp_avg_sq")
    _nonnegative_buffers = ("exp_avg_sq",)

    def _coefficients(self, group: dict[str, Any], step: int | torch.Tensor) -> dict[str, Any]:
        return stable_adamw_coefficients(
            **_moment_hparams(group), step=step,
            max_lr=float(group["max_lr"]) if group["decouple_lr"] else None,
        )

    _math = staticmethod(stable_adamw_math)
    _norm_terms = staticmethod(stable_adamw_norm_terms)  # (the RMS over the whole tensor)
