"""Adam (L2 or decoupled weight decay, optional AMSGrad) over any master storage.

Adam's rule is AdamW's, ``adamw_math`` (so the two share compiled kernels), with torch.optim.Adam's
default L2 decay: ``weight_decay * w`` added to the gradient (``adamw_coefficients`` with
``decoupled=False``). ``decoupled_weight_decay=True`` is AdamW's step, bit for bit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from lowprec.optim.adamw import AdamW, adamw_coefficients, adamw_math
from lowprec.optim.base import LowPrecisionOptimizer
from lowprec.optim.options import _l2, _moment_hparams

if TYPE_CHECKING:  # pragma: no cover
    from torch.optim.optimizer import ParamsT

__all__ = ["Adam"]


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

    _nonnegative_hparams = ("lr", "eps", "weight_decay")
    _has_betas = True
    _nonnegative_buffers = AdamW._nonnegative_buffers
    _math_buffers = AdamW._math_buffers

    def _coefficients(self, group: dict[str, Any], step: int | torch.Tensor) -> dict[str, Any]:
        return adamw_coefficients(**_moment_hparams(group), step=step,
                                  decoupled=bool(group["decoupled_weight_decay"]))

    def _flags(self, group: dict[str, Any]) -> dict[str, bool]:
        # (without L2 decay, AdamW's flags: AdamW's kernels)
        return dict(amsgrad=group["amsgrad"], l2=not group["decoupled_weight_decay"]
                    and _l2(group["weight_decay"]))

    _math = staticmethod(adamw_math)
