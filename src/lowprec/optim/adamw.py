"""AdamW (decoupled weight decay, optional AMSGrad) over any master storage.

``adamw_math`` is the FP32 rule (plain elementwise ops, host coefficients from
``adamw_coefficients``): the eager and the compiled step both run it and agree bit for bit. The
decay multiplies the FP32 master, so with a compensated ``master`` it acts even below half an ulp.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from lowprec.numerics import plus_l2, sqrt_rn
from lowprec.optim.base import LowPrecisionOptimizer
from lowprec.optim.options import _check_nonnegative, _moment_hparams, _validate_betas

if TYPE_CHECKING:  # pragma: no cover
    from torch.optim.optimizer import ParamsT

__all__ = ["AdamW", "adamw_coefficients", "adamw_math"]


def adamw_coefficients(
    *, lr: float | torch.Tensor, beta1: float, beta2: float, eps: float, weight_decay: float,
    step: Any, decoupled: bool = True,
) -> dict[str, Any]:
    """The per-step scalars of ``adamw_math``: host floats, or 0-d tensors for a tensor step.

    ``decoupled``: ``decay = 1 - lr * weight_decay`` (AdamW), ``l2 = 0``; else ``decay = 1``
    (``w * 1`` is ``w``: one kernel serves decay and none), ``l2 = weight_decay`` (Adam's L2).
    Bias corrections are folded (Kingma & Ba's efficient form): ``step_size * m / (sqrt(v) / bc2
    + eps)`` is ``(step_size * bc2) * m / (sqrt(v) + eps * bc2)``, ``bc2 = sqrt(1 - beta2**step)``:
    one division per element, not two (a divide is the update's costliest operation on CPUs).
    """
    bc2 = (1 - beta2**step) ** 0.5
    return {
        "decay": 1 - lr * weight_decay if decoupled else 1.0,
        "l2": 0.0 if decoupled else weight_decay,
        "beta1": beta1,
        "one_minus_beta1": 1 - beta1,
        "beta2": beta2,
        "one_minus_beta2": 1 - beta2,
        "step_size": lr * bc2 / (1 - beta1**step),
        "eps": eps * bc2,
    }


def adamw_math(
    w: torch.Tensor,
    g: torch.Tensor,
    bufs: dict[str, torch.Tensor],
    c: dict[str, Any],
    *,
    amsgrad: bool,
    l2: bool = True,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One AdamW (or Adam) update in FP32, per element, from precomputed coefficients ``c``
    (pure). ``c["decay"]`` is 1 without decoupled decay; the static flag ``l2`` adds Adam's L2
    term ``c["l2"] * w`` to the gradient."""
    if l2:  # (L2: the decay goes through the moments)
        g = plus_l2(g, w, c["l2"])
    w = w * c["decay"]
    m = bufs["exp_avg"] * c["beta1"] + g * c["one_minus_beta1"]
    v = bufs["exp_avg_sq"] * c["beta2"] + (g * g) * c["one_minus_beta2"]
    out = {"exp_avg": m, "exp_avg_sq": v}
    if amsgrad:
        v = torch.maximum(bufs["max_exp_avg_sq"], v)
        out["max_exp_avg_sq"] = v
    # c["eps"] and c["step_size"] carry the bias corrections (adamw_coefficients): one division.
    return w - (m * c["step_size"]) / (sqrt_rn(v) + c["eps"]), out


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
        master: {master}
        state_dtype: How the moments (``exp_avg``, ``exp_avg_sq``) are kept: {state_formats}
        seed: {seed}
        fused: {fused}
        foreach: {foreach}
        capturable: {capturable}
        differentiable: {differentiable}

    Examples:
        >>> import torch
        >>> import lowprec
        >>> model = torch.nn.Linear(64, 64).bfloat16()
        >>> opt = lowprec.AdamW(model.parameters(), lr=1e-3, master="kahan", state_dtype="8bit")
        >>> model(torch.randn(4, 64, dtype=torch.bfloat16)).float().square().mean().backward()
        >>> opt.step()
        >>> opt.state[model.weight]["exp_avg"].dtype  # 4096 elements: one-byte codes
        torch.uint8
        >>> opt.state[model.bias]["exp_avg"].dtype  # 64 elements: FP32
        torch.float32
        >>> opt.master_weight(model.weight).dtype
        torch.float32
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
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
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
            maximize=maximize, master=master, state_dtype=state_dtype, seed=seed, fused=fused,
        )
        super().__init__(params, defaults, foreach=foreach, capturable=capturable,
                         differentiable=differentiable)

    # (Explicit methods that read no overridable attribute: Muon's AdamW groups call them on a Muon)
    def _validate_hparams(self, group: dict[str, Any]) -> None:
        _check_nonnegative(group, "lr", "eps", "weight_decay")
        _validate_betas(group["betas"])
        # (a torch.optim.Adam group's L2 decay would silently become decoupled decay here)
        if group.get("decoupled_weight_decay", True) is False and group["weight_decay"] != 0:
            raise ValueError(
                "this group's weight decay is L2 (decoupled_weight_decay=False, as in a "
                "torch.optim.Adam checkpoint), but lowprec.AdamW decays decoupled; load an AdamW "
                "checkpoint, or set the group's weight_decay to 0 before loading."
            )

    _nonnegative_buffers = ("exp_avg_sq", "max_exp_avg_sq")

    def _math_buffers(
        self, group: dict[str, Any], p: torch.Tensor | None = None
    ) -> tuple[str, ...]:
        names = ("exp_avg", "exp_avg_sq")
        return (*names, "max_exp_avg_sq") if group["amsgrad"] else names

    def _coefficients(self, group: dict[str, Any], step: int | torch.Tensor) -> dict[str, Any]:
        return adamw_coefficients(**_moment_hparams(group), step=step)

    def _flags(self, group: dict[str, Any]) -> dict[str, bool]:
        return dict(amsgrad=group["amsgrad"], l2=False)

    _math = staticmethod(adamw_math)
