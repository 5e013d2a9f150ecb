"""Adafactor (Shazeer & Stern 2018, "Adafactor: Adaptive Learning Rates with Sublinear Memory
Cost") with ``torch.optim.Adafactor``'s defaults and semantics, over any master storage.

No first moment; a tensor of 2+ dimensions keeps its squared gradient's means over the last
dimension (``row_var``, ``(..., rows, 1)``) and the one before (``col_var``, ``(..., 1, cols)``),
in FP32 whatever ``state_dtype`` says; a vector keeps a full ``variance``. Per step ``t``::

    beta2_hat = t ** beta2_decay                   (the weight of the new squares)
    rho = min(lr, 1 / sqrt(t))                     (relative step size, capped by lr)
    alpha = max(eps2, RMS(w)) * rho
    w = w * (1 - lr * weight_decay)
    V = row_var @ col_var / max(mean(row_var), eps1)    (or variance)
    U = g / sqrt(max(V, eps1**2))
    w = w - alpha * U / max(1, RMS(U) / d)

The means and RMS need whole tensors (``_whole``: one compiled graph per parameter where fused);
the RMS stay 0-d tensors (no host sync; torch calls ``.item()``). Sums of squares and means are
FP64, rounded to FP32 once, so the eager and compiled steps, which add in different orders, agree
bit for bit. RMS(w) is the FP32 master's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from lowprec.numerics import sqrt_rn, sum_squares
from lowprec.optim.base import LowPrecisionOptimizer
from lowprec.optim.options import _check_nonnegative, _lr

if TYPE_CHECKING:  # pragma: no cover
    from torch.optim.optimizer import ParamsT

__all__ = ["Adafactor", "adafactor_coefficients", "adafactor_math"]

_FP32_EPS = torch.finfo(torch.float32).eps


def adafactor_coefficients(
    *, lr: float | torch.Tensor, beta2_decay: float, eps: tuple[float | None, float], d: float,
    weight_decay: float, step: Any,
) -> dict[str, Any]:
    """The per-step scalars of ``adafactor_math``: host floats, or 0-d tensors for a tensor step.
    ``eps[0]`` None is FP32's machine epsilon, as the rule runs on the FP32 master (torch takes
    the parameter dtype's: 2**-7 for BF16)."""
    eps1 = _FP32_EPS if eps[0] is None else eps[0]
    if isinstance(step, torch.Tensor):
        rho = torch.clamp(step.rsqrt(), max=lr)
    elif isinstance(lr, torch.Tensor):  # (a capturable optimizer's: not read on the host)
        rho = torch.clamp(torch.tensor(1 / step**0.5, dtype=torch.float64, device=lr.device),
                          max=lr)
    else:
        rho = min(lr, 1 / step**0.5)
    new = step**beta2_decay
    return {
        "decay": 1 - lr * weight_decay,
        "new_weight": new,
        "old_weight": 1 - new,
        "rho": rho,
        "eps1": eps1,
        "eps1_sq": eps1 * eps1,
        "eps2": eps[1],
        "d": d,
    }


def _rms(t: torch.Tensor) -> torch.Tensor:
    """The root mean square of FP32 ``t``, from an FP64 sum, rounded to FP32 once."""
    return (sum_squares(t) / t.numel()).sqrt().float()


def _mean_squares(g: torch.Tensor, dim: int) -> torch.Tensor:
    """The mean of ``g * g`` over ``dim`` (kept), summed in FP64 and rounded to FP32 once."""
    return (g.double().square().sum(dim, keepdim=True) / g.size(dim)).float()


def adafactor_math(
    w: torch.Tensor,
    g: torch.Tensor,
    bufs: dict[str, torch.Tensor],
    c: dict[str, Any],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One Adafactor update of a whole tensor in FP32 (pure): factored where ``bufs`` holds
    ``row_var`` and ``col_var``, else with the full ``variance``."""
    alpha = torch.clamp(_rms(w), min=c["eps2"]) * c["rho"]
    w = w * c["decay"]  # (1 without decay: w, bit for bit)
    new, old = c["new_weight"], c["old_weight"]
    if "row_var" in bufs:
        row_var = bufs["row_var"] * old + _mean_squares(g, -1) * new
        col_var = bufs["col_var"] * old + _mean_squares(g, -2) * new
        # (row_var @ col_var, an outer product: each element one rounded product)
        mean = (row_var.double().sum(-2, keepdim=True) / row_var.size(-2)).float()
        var = (row_var * col_var) / mean.clamp(min=c["eps1"])
        out = {"row_var": row_var, "col_var": col_var}
    else:
        var = bufs["variance"] * old + (g * g) * new
        out = {"variance": var}
    u = g / sqrt_rn(var.clamp(min=c["eps1_sq"]))
    denom = torch.clamp(_rms(u) / c["d"], min=1.0)
    return w - u * (alpha / denom), out


class Adafactor(LowPrecisionOptimizer):
    """Adafactor with a choice of master-weight storage.

    Same defaults and semantics as ``torch.optim.Adafactor``, but for ``eps[0]=None``, which is
    FP32's machine epsilon whatever the parameter's dtype (the rule runs on the FP32 master).

    Args:
        params: Parameters or parameter groups.
        lr: The cap of the relative step size, and the decay's rate (default: 1e-2).
        beta2_decay: The second moment's new squares weigh ``step ** beta2_decay``
            (default: -0.8).
        eps: ``(eps1, eps2)``: the floor of the second moment's estimate (its square) and of a
            weight's RMS in the step size (default: (None, 1e-3)).
        d: The update's RMS is clipped to ``d`` (default: 1.0).
        weight_decay: Decoupled weight decay: ``w *= 1 - lr * weight_decay`` (default: 0.0).
        maximize: Maximize the objective (default: False).
        master: {master}
        state_dtype: How a vector's ``variance`` (a matrix's row and column statistics stay FP32)
            is kept: {state_formats}
        seed: {seed}
        fused: Run each parameter's step as one compiled graph in its shape (``torch.compile``),
            with the same results as the eager step (default: None, meaning compiled wherever
            torch.compile has a compiler; see ``lowprec.optim``).
        foreach: {foreach}
        capturable: {capturable}
        differentiable: {differentiable}
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-2,
        beta2_decay: float = -0.8,
        eps: tuple[float | None, float] = (None, 1e-3),
        d: float = 1.0,
        weight_decay: float = 0.0,
        *,
        foreach: bool | None = None,
        maximize: bool = False,
        master: str = "auto",
        state_dtype: torch.dtype | str | None = None,
        seed: int | None = None,
        fused: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
    ) -> None:
        defaults = dict(
            lr=lr, beta2_decay=beta2_decay, eps=eps, d=d, weight_decay=weight_decay,
            maximize=maximize, master=master, state_dtype=state_dtype, seed=seed, fused=fused,
        )
        super().__init__(params, defaults, foreach=foreach, capturable=capturable,
                         differentiable=differentiable)

    def _validate_hparams(self, group: dict[str, Any]) -> None:
        _check_nonnegative(group, "lr", "weight_decay")
        if not group["beta2_decay"] <= 0.0:
            raise ValueError(f"beta2_decay should be <= 0 but is: {group['beta2_decay']}")
        eps = group["eps"]
        if not isinstance(eps, (tuple, list)) or len(eps) != 2:
            raise ValueError(f"eps must be a pair (eps1 or None, eps2), got {eps!r}.")
        if eps[0] is not None and not eps[0] >= 0.0:
            raise ValueError(f"epsilon1 should be >= 0 but is: {eps[0]}")
        if not eps[1] >= 0.0:
            raise ValueError(f"epsilon2 should be >= 0 but is: {eps[1]}")
        if not group["d"] >= 1.0:
            raise ValueError(f"Clipping threshold d should be >= 1 but is: {group['d']}")

    _nonnegative_buffers = ("variance",)

    def _math_buffers(
        self, group: dict[str, Any], p: torch.Tensor | None = None
    ) -> tuple[str, ...]:
        if p is None:  # (the group's: every name a parameter may have)
            return ("row_var", "col_var", "variance")
        return ("row_var", "col_var") if p.dim() > 1 else ("variance",)

    def _buffer_shape(self, name: str, p: torch.Tensor) -> tuple[int, ...] | None:
        if name == "row_var":
            return (*p.shape[:-1], 1)
        if name == "col_var":
            return (*p.shape[:-2], 1, p.shape[-1])
        return None

    def _whole(self, group: dict[str, Any]) -> bool:
        return True

    _whole_compiles = True  # (its reductions and elementwise work fuse into a few passes)

    def _coefficients(self, group: dict[str, Any], step: int | torch.Tensor) -> dict[str, Any]:
        return adafactor_coefficients(
            lr=_lr(group), beta2_decay=group["beta2_decay"],
            eps=tuple(group["eps"]), d=group["d"], weight_decay=group["weight_decay"], step=step,
        )

    _math = staticmethod(adafactor_math)
