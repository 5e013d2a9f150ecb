"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", Algorithm 2).

Per step::

    c = beta1 * m + (1 - beta1) * g
    w = w * (1 - lr * weight_decay) - lr * sign(c)
    m = beta2 * m + (1 - beta2) * g

Every element moves by ``lr`` (0 where ``c`` is 0), so the paper's lr is 3-10x smaller than
AdamW's and its weight decay 3-10x larger. Defaults are the paper's, lion-pytorch's and optimi's;
``decouple_lr`` is optimi's fully decoupled decay (lion-pytorch's ``decoupled_weight_decay``).
A NaN or infinite ``c`` gives a NaN update (not ``torch.sign``'s 0 or 1): a NaN gradient shows in
the weights, as under AdamW, instead of freezing them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from lowprec.optim.base import LowPrecisionOptimizer
from lowprec.optim.options import _as_float, _lr

if TYPE_CHECKING:  # pragma: no cover
    from torch.optim.optimizer import ParamsT

__all__ = ["Lion", "lion_coefficients", "lion_math"]


def lion_coefficients(
    *, lr: float | torch.Tensor, beta1: float, beta2: float, weight_decay: float,
    max_lr: float | None = None,
) -> dict[str, Any]:
    """The per-step scalars of ``lion_math`` (host floats). ``max_lr`` given: the decay is fully
    decoupled from the learning rate's scale, ``1 - (lr / max_lr) * weight_decay``."""
    scale = lr if max_lr is None else lr / max_lr
    return {
        "lr": lr,
        "decay": 1 - scale * weight_decay,
        "beta1": beta1,
        "one_minus_beta1": 1 - beta1,
        "beta2": beta2,
        "one_minus_beta2": 1 - beta2,
    }


def lion_math(
    w: torch.Tensor,
    g: torch.Tensor,
    bufs: dict[str, torch.Tensor],
    c: dict[str, Any],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One Lion update in FP32, per element, from precomputed coefficients ``c`` (pure)."""
    w = w * c["decay"]  # (1 without decay: w, bit for bit)
    m = bufs["exp_avg"]
    direction = m * c["beta1"] + g * c["one_minus_beta1"]
    # (direction - direction) is 0, or NaN for a NaN or an infinity: such an update is NaN.
    update = torch.sign(direction) + (direction - direction)
    return w - update * c["lr"], {"exp_avg": m * c["beta2"] + g * c["one_minus_beta2"]}


def _resolve_max_lr(group: dict[str, Any]) -> None:
    """``decouple_lr``'s ``max_lr``: checked, or the group's ``lr`` when the group is added."""
    if group["decouple_lr"] not in (True, False):
        raise ValueError(f"decouple_lr must be True or False, got {group['decouple_lr']!r}.")
    if group["decouple_lr"] and group["max_lr"] is None:
        group["max_lr"] = _as_float(group["lr"], "lr")
    if group["max_lr"] is not None and not _as_float(group["max_lr"], "max_lr") > 0:
        raise ValueError(f"invalid max_lr={group['max_lr']}: must be > 0.")


class Lion(LowPrecisionOptimizer):
    """Lion with a choice of master-weight storage.

    Same defaults and semantics as optimi's and ``lion-pytorch``'s ``Lion``.

    Args:
        params: Parameters or parameter groups.
        lr: Learning rate: every element moves by ``lr`` per step (default: 1e-4).
        betas: ``beta1`` interpolates the update direction between momentum and gradient,
            ``beta2`` is the momentum's decay (default: (0.9, 0.99)).
        weight_decay: Decoupled weight decay, ``w *= 1 - lr * weight_decay`` (default: 0).
        decouple_lr: Fully decoupled weight decay, ``w *= 1 - (lr / max_lr) * weight_decay``:
            a schedule scales the decay but ``lr``'s size does not (default: False).
        max_lr: The schedule's largest ``lr`` for ``decouple_lr`` (default: None, meaning the
            group's own ``lr`` when the group is added, where optimi takes the constructor's
            ``lr`` for every group; ``OneCycleLR`` sets it to its ``max_lr``).
        maximize: Maximize the objective (default: False).
        master: {master}
        state_dtype: How the momentum (``exp_avg``) is kept: {state_formats}
        seed: {seed}
        fused: {fused}
        foreach: {foreach}
        capturable: {capturable}
        differentiable: {differentiable}
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
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
            lr=lr, betas=betas, weight_decay=weight_decay, decouple_lr=decouple_lr,
            max_lr=max_lr, maximize=maximize, master=master, state_dtype=state_dtype, seed=seed,
            fused=fused,
        )
        super().__init__(params, defaults, foreach=foreach, capturable=capturable,
                         differentiable=differentiable)

    _nonnegative_hparams = ("lr", "weight_decay")
    _has_betas = True

    def _validate_hparams(self, group: dict[str, Any]) -> None:
        super()._validate_hparams(group)
        _resolve_max_lr(group)

    _buffer_names = ("exp_avg",)

    def _coefficients(self, group: dict[str, Any], step: int | torch.Tensor) -> dict[str, Any]:
        beta1, beta2 = group["betas"]
        return lion_coefficients(
            lr=_lr(group), beta1=float(beta1), beta2=float(beta2),
            weight_decay=group["weight_decay"],
            max_lr=float(group["max_lr"]) if group["decouple_lr"] else None,
        )

    _math = staticmethod(lion_math)
