"""Muon (Jordan et al. 2024, "Muon: An optimizer for hidden layers in neural networks") with
``torch.optim.Muon``'s defaults and semantics, over any master storage; and the usual setup of
one optimizer for a whole model: Muon for the hidden layers' matrices, AdamW for the rest.

Per step, for a 2-D parameter::

    B = lerp(B, g, 1 - momentum)                   (torch's form of the momentum)
    U = lerp(g, B, momentum) if nesterov else B
    O = NewtonSchulz(U)                             (in BF16, as torch: ns_steps quintic steps)
    w = w * (1 - lr * weight_decay) - lr * adjust(shape) * O

The orthogonalization needs the whole matrix (``_whole``); fused, the elementwise work around
the matmuls compiles as two graphs, bit for bit the eager step. A ``use_muon=False`` group is
stepped by AdamW's rule, with torch.optim.AdamW's defaults for what it does not set.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from lowprec.optim._typing import compiler_disable
from lowprec.optim.adamw import AdamW, adamw_math
from lowprec.optim.base import LowPrecisionOptimizer
from lowprec.optim.options import _check_nonnegative, _lr

if TYPE_CHECKING:  # pragma: no cover
    from torch.optim.optimizer import ParamsT

__all__ = ["Muon", "muon_math", "muon_param_groups", "newton_schulz"]

#: torch.optim.Muon's Newton-Schulz coefficients, steps and epsilon.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
NS_EPS = 1e-7
#: What a ``use_muon=False`` group takes where it sets nothing: torch.optim.AdamW's defaults.
ADAMW_DEFAULTS = {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2}
_ADJUST = (None, "original", "match_rms_adamw")


def newton_schulz(
    u: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float
) -> torch.Tensor:
    """The quintic Newton-Schulz iteration towards the orthogonal factor of matrix ``u``, in
    BF16 as torch.optim.Muon computes it (the same operations); returns a BF16 matrix."""
    a, b, c = coefficients
    x = u.bfloat16()
    tall = u.size(0) > u.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def _adjusted_ratio(adjust: str | None, shape: Sequence[int]) -> float:
    rows, cols = shape[:2]
    if adjust is None or adjust == "original":
        return math.sqrt(max(1, rows / cols))
    return 0.2 * math.sqrt(max(rows, cols))  # "match_rms_adamw" (Moonshot's)


@compiler_disable
def _momentum_and_orthogonalize(
    g: torch.Tensor, buf: torch.Tensor, c: dict[str, Any], nesterov: bool,
    ns: tuple[float, float, float], steps: int, eps: float, adjust: str | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The new momentum, ``newton_schulz`` of the update, and the lr's shape ratio (0-d FP32, so
    ``lr * ratio`` rounds alike eager and compiled). Never compiled, to round as torch: ATen's CPU
    lerp fuses a multiply-add in its vector loop, not its tail; Inductor rounds addmm twice."""
    buf = buf.lerp(g, c["one_minus_momentum"])
    u = g.lerp(buf, c["momentum"]) if nesterov else buf
    ratio = torch.tensor(_adjusted_ratio(adjust, u.shape), dtype=torch.float32)
    return buf, newton_schulz(u, ns, steps, eps), ratio


def muon_math(
    w: torch.Tensor,
    g: torch.Tensor,
    bufs: dict[str, torch.Tensor],
    c: dict[str, Any],
    *,
    nesterov: bool = True,
    ns: tuple[float, float, float] = NS_COEFFICIENTS,
    ns_steps: int = NS_STEPS,
    ns_eps: float = NS_EPS,
    adjust: str | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One Muon update of a whole matrix in FP32 (pure); its ``use_muon=False`` groups take
    AdamW's, ``adamw_math``."""
    buf, o, ratio = _momentum_and_orthogonalize(g, bufs["momentum_buffer"], c, nesterov, ns,
                                                ns_steps, ns_eps, adjust)
    w = w * c["decay"]  # (1 without decay: w, bit for bit)
    return w - o.float() * (c["lr"] * ratio), {"momentum_buffer": buf}


def muon_param_groups(
    model: nn.Module,
    *,
    muon: dict[str, Any] | None = None,
    adamw: dict[str, Any] | None = None,
    exclude: Sequence[str] = ("embed", "head"),
) -> list[dict[str, Any]]:
    """A model's parameters as ``lowprec.Muon``'s two groups: the weights of its ``nn.Linear``
    layers (the hidden matrices) with ``use_muon=True``, and the rest (embeddings, the output
    head, norms, biases, other layers' weights) with ``use_muon=False``, stepped by AdamW.

    Args:
        model: The model; each parameter is taken once (a tied weight by its first name).
        muon: Options of the Muon group (default: None, the optimizer's).
        adamw: Options of the AdamW group (default: None: torch.optim.AdamW's ``betas``, ``eps``
            and ``weight_decay``, the optimizer's ``lr``).
        exclude: A Linear weight whose name contains one of these goes to AdamW: a model's
            output head, and input projections named so (default: ``("embed", "head")``).

    Returns:
        The groups that have parameters, each with the parameters as ``(name, tensor)`` pairs.

    Examples:
        >>> import torch
        >>> import lowprec
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
        ...                             torch.nn.Linear(16, 4))
        >>> groups = lowprec.muon_param_groups(model, adamw={"lr": 3e-4})
        >>> [(g["use_muon"], [name for name, _ in g["params"]]) for g in groups]
        [(True, ['0.weight', '2.weight']), (False, ['0.bias', '2.bias'])]
        >>> opt = lowprec.Muon(groups, lr=0.02)
    """
    linear = {id(m.weight) for m in model.modules()
              if isinstance(m, nn.Linear) and not isinstance(m.weight, nn.UninitializedParameter)}
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    hidden: list[tuple[str, nn.Parameter]] = []
    rest: list[tuple[str, nn.Parameter]] = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        is_hidden = (id(p) in linear and id(p) not in embedded and p.dim() == 2
                     and not any(word in name for word in exclude))
        (hidden if is_hidden else rest).append((name, p))
    groups = [{"params": hidden, "use_muon": True, **(muon or {})},
              {"params": rest, "use_muon": False, **(adamw or {})}]
    return [g for g in groups if g["params"]]


class Muon(LowPrecisionOptimizer):
    """Muon with a choice of master-weight storage.

    Same defaults and semantics as ``torch.optim.Muon`` for its groups (2-D parameters only);
    a group with ``use_muon=False`` is stepped by AdamW (``muon_param_groups`` builds both).

    Args:
        params: Parameters or parameter groups.
        lr: Learning rate (default: 1e-3).
        weight_decay: Decoupled weight decay: ``w *= 1 - lr * weight_decay`` (default: 0.1).
        momentum: Momentum factor (default: 0.95).
        nesterov: Nesterov momentum (default: True).
        ns_coefficients: The quintic Newton-Schulz iteration's ``(a, b, c)`` (default:
            ``(3.4445, -4.7750, 2.0315)``).
        eps: Floor of the norm the iteration divides by (default: 1e-7).
        ns_steps: Newton-Schulz steps (default: 5).
        adjust_lr_fn: ``None`` or ``"original"`` (lr times ``sqrt(max(1, rows / cols))``) or
            ``"match_rms_adamw"`` (``0.2 * sqrt(max(rows, cols))``) (default: None).
        master: {master}
        state_dtype: How the momentum (and a ``use_muon=False`` group's moments) is kept:
            {state_formats}
        seed: {seed}
        fused: For ``use_muon=False`` groups, as ``lowprec.AdamW``'s; a Muon group's step is
            matmuls, run as ATen calls per parameter (default: None).
        foreach: {foreach}
        capturable: {capturable}
        differentiable: {differentiable}
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        eps: float = NS_EPS,
        ns_steps: int = NS_STEPS,
        adjust_lr_fn: str | None = None,
        *,
        master: str = "auto",
        state_dtype: torch.dtype | str | None = None,
        seed: int | None = None,
        fused: bool | None = None,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
    ) -> None:
        defaults = dict(
            lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
            ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps,
            adjust_lr_fn=adjust_lr_fn, use_muon=True, master=master, state_dtype=state_dtype,
            seed=seed, fused=fused,
        )
        super().__init__(params, defaults, foreach=foreach, capturable=capturable,
                         differentiable=differentiable)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group; one with ``use_muon=False`` takes AdamW's defaults.

        Args:
            param_group: A dict with ``"params"`` and the group's options, as
                ``LowPrecisionOptimizer.add_param_group`` takes it.
        """
        if isinstance(param_group, dict) and param_group.get("use_muon", True) is False:
            param_group = {**ADAMW_DEFAULTS, "amsgrad": False, "maximize": False, **param_group}
        super().add_param_group(param_group)

    def _validate_hparams(self, group: dict[str, Any]) -> None:
        if group["use_muon"] not in (True, False):
            raise ValueError(f"use_muon must be True or False, got {group['use_muon']!r}.")
        if not group["use_muon"]:  # (an AdamW group: AdamW's checks)
            AdamW._validate_hparams(cast(AdamW, self), group)
            return
        _check_nonnegative(group, "lr", "weight_decay", "eps", "momentum")
        if group["adjust_lr_fn"] not in _ADJUST:
            raise ValueError(
                f"Adjust learning rate function {group['adjust_lr_fn']} is not supported; "
                "choose None, 'original' or 'match_rms_adamw'."
            )
        ns = group["ns_coefficients"]
        if not isinstance(ns, (tuple, list)) or len(ns) != 3:
            raise ValueError(f"ns_coefficients must be 3 numbers (a, b, c), got {ns!r}.")
        steps = group["ns_steps"]
        if isinstance(steps, bool) or not isinstance(steps, int) or not 0 <= steps < 100:
            raise ValueError(f"ns_steps must be an int in [0, 100), got {steps!r}.")
        for i, p in enumerate(group["params"]):
            if p.dim() != 2:
                raise ValueError(
                    f"Muon only supports 2D parameters whereas we found a parameter with size: "
                    f"{tuple(p.shape)} (parameter {i}); step embeddings, norms and biases with "
                    "AdamW in a group with use_muon=False: lowprec.muon_param_groups(model) "
                    "makes both groups."
                )

    _nonnegative_buffers = AdamW._nonnegative_buffers  # (the AdamW groups' second moments)

    # A use_muon=False group's buffers, coefficients and flags are AdamW's (its methods, on self).

    def _math_buffers(
        self, group: dict[str, Any], p: torch.Tensor | None = None
    ) -> tuple[str, ...]:
        if not group["use_muon"]:
            return AdamW._math_buffers(cast(AdamW, self), group, p)
        return ("momentum_buffer",)

    def _whole(self, group: dict[str, Any]) -> bool:
        return cast(bool, group["use_muon"])

    def _group_math(self, group: dict[str, Any]) -> Any:
        return muon_math if group["use_muon"] else adamw_math  # (AdamW's kernels, shared)

    # Fused: two graphs around the eager `_momentum_and_orthogonalize` (`_whole_graph_breaks`).
    _whole_compiles = True
    _whole_graph_breaks = True

    def _coefficients(self, group: dict[str, Any], step: int | torch.Tensor) -> dict[str, Any]:
        if not group["use_muon"]:
            return AdamW._coefficients(cast(AdamW, self), group, step)
        lr = _lr(group)
        momentum = float(group["momentum"])
        return {"lr": lr, "decay": 1 - lr * group["weight_decay"], "momentum": momentum,
                "one_minus_momentum": 1 - momentum}

    def _flags(self, group: dict[str, Any]) -> dict[str, Any]:
        if not group["use_muon"]:
            return AdamW._flags(cast(AdamW, self), group)
        return dict(
            nesterov=bool(group["nesterov"]),
            ns=tuple(map(float, group["ns_coefficients"])), ns_steps=group["ns_steps"],
            ns_eps=float(group["eps"]), adjust=group["adjust_lr_fn"],
        )

    _math = staticmethod(muon_math)
