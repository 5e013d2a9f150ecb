"""SGD with momentum, dampening, Nesterov, weight decay and maximize, over any master storage.

``sgd_math`` is the FP32 rule (plain elementwise ops, host coefficients from ``sgd_coefficients``):
the eager and the compiled step both run it and agree bit for bit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from lowprec.numerics import plus_l2
from lowprec.optim.base import LowPrecisionOptimizer
from lowprec.optim.options import _check_nonnegative, _l2, _lr

if TYPE_CHECKING:  # pragma: no cover
    from torch.optim.optimizer import ParamsT

__all__ = ["SGD", "sgd_coefficients", "sgd_math"]


def sgd_coefficients(
    *, lr: float | torch.Tensor, momentum: float, dampening: float, weight_decay: float,
    first_step: bool | torch.Tensor,
) -> dict[str, Any]:
    """The per-step scalars of ``sgd_math``: host floats, or 0-d float64 tensors where
    ``first_step`` is a 0-d bool tensor (a step count kept on the device)."""
    # The buffer starts as the first step's direction: buf * 0 + d * 1 (buffers start at 0).
    later = ~first_step if isinstance(first_step, torch.Tensor) else not first_step
    later = later.double() if isinstance(later, torch.Tensor) else float(later)
    return {
        "lr": lr,
        "weight_decay": weight_decay,
        "momentum": momentum,
        "buf_keep": momentum * later,
        "buf_add": 1.0 - dampening * later,
    }


def sgd_math(
    w: torch.Tensor,
    g: torch.Tensor,
    bufs: dict[str, torch.Tensor],
    c: dict[str, Any],
    *,
    momentum: bool,
    nesterov: bool = False,
    l2: bool = True,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One SGD update in FP32, per element, from precomputed coefficients ``c`` (pure).

    The keyword flags are static (they choose the code); ``c`` holds numbers or 0-d tensors."""
    d = plus_l2(g, w, c["weight_decay"]) if l2 else g
    out = {}
    if momentum:
        buf = bufs["momentum_buffer"] * c["buf_keep"] + d * c["buf_add"]
        out["momentum_buffer"] = buf
        d = d + buf * c["momentum"] if nesterov else buf
    return w - d * c["lr"], out


class SGD(LowPrecisionOptimizer):
    """Stochastic gradient descent with a choice of master-weight storage.

    Same defaults and semantics as ``torch.optim.SGD``.

    Args:
        params: Parameters or parameter groups.
        lr: Learning rate (default: 1e-3).
        momentum: Momentum factor (default: 0).
        dampening: Dampening for momentum (default: 0).
        weight_decay: L2 penalty (default: 0). With a compensated ``master`` it takes effect even
            when ``lr * weight_decay * w`` is below half an ulp of the stored weight.
        nesterov: Nesterov momentum; needs ``momentum > 0`` and ``dampening == 0`` (default: False).
        maximize: Maximize the objective (default: False).
        master: {master}
        state_dtype: How the momentum buffer is kept: {state_formats}
        seed: {seed}
        fused: {fused}
        foreach: {foreach}
        capturable: {capturable}
        differentiable: {differentiable}

    Examples:
        An update below half a BF16 unit in the last place is lost when rounded to nearest, and
        kept by a compensated master:

        >>> import torch
        >>> import lowprec
        >>> w = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
        >>> opt = lowprec.SGD([w], lr=1e-4, master="split")
        >>> for _ in range(10):
        ...     w.grad = torch.ones_like(w)
        ...     opt.step()
        >>> w[0].item()  # the stored BF16 weight has not moved
        1.0
        >>> round(opt.master_weight(w)[0].item(), 6)  # the FP32 master has
        0.999
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
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
            lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
            nesterov=nesterov, maximize=maximize, master=master, state_dtype=state_dtype,
            seed=seed, fused=fused,
        )
        super().__init__(params, defaults, foreach=foreach, capturable=capturable,
                         differentiable=differentiable)

    def _validate_hparams(self, group: dict[str, Any]) -> None:
        _check_nonnegative(group, "lr", "momentum", "dampening", "weight_decay")
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ValueError(
                "nesterov=True needs momentum > 0 and dampening == 0; got momentum="
                f"{group['momentum']}, dampening={group['dampening']}."
            )

    def _math_buffers(
        self, group: dict[str, Any], p: torch.Tensor | None = None
    ) -> tuple[str, ...]:
        return ("momentum_buffer",) if group["momentum"] != 0 else ()

    def _coefficients(self, group: dict[str, Any], step: int | torch.Tensor) -> dict[str, Any]:
        return sgd_coefficients(
            lr=_lr(group), momentum=group["momentum"],
            dampening=group["dampening"], weight_decay=group["weight_decay"],
            first_step=step == 1,
        )

    def _first_use_coefficients(
        self, group: dict[str, Any], step: int | torch.Tensor
    ) -> dict[str, Any]:
        # A buffer created mid-run (momentum turned on later) starts as the step's direction,
        # as torch.optim.SGD's does.
        return self._coefficients(group, 1)

    def _flags(self, group: dict[str, Any]) -> dict[str, bool]:
        return dict(momentum=group["momentum"] != 0, nesterov=bool(group["nesterov"]),
                    l2=_l2(group["weight_decay"]))

    _math = staticmethod(sgd_math)
