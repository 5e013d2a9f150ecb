"""What precision costs a given model: gradient range against FP16/BF16, and lost updates.

``gradient_range`` looks at a model's current gradients and says how many would flush to zero in
FP16 or BF16, how many would overflow FP16 at a given loss scale, and which static scale keeps the
largest gradient representable with headroom (the rule of "Mixed Precision Training",
Micikevicius et al. 2017: the largest power of two whose product with the largest gradient stays
below FP16's maximum).

``UpdateMonitor`` (``lowprec.updates``, importable from here too) watches optimizer steps and
counts, per parameter, the updates rounding lost.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from lowprec.updates import LOST_UPDATE_THRESHOLD, ParamUpdates, UpdateMonitor, UpdateReport

__all__ = [
    "LOST_UPDATE_THRESHOLD",
    "GradientRange",
    "ParamUpdates",
    "UpdateMonitor",
    "UpdateReport",
    "gradient_range",
]

_FP16 = torch.finfo(torch.float16)
_BF16 = torch.finfo(torch.bfloat16)
#: Smallest positive subnormals: values below half of them round to zero.
FP16_MIN_SUBNORMAL = 2.0**-24
BF16_MIN_SUBNORMAL = 2.0**-133


@dataclass(frozen=True)
class GradientRange:
    """Fractions are of all gradient elements (zeros included).

    Attributes:
        numel: Gradient elements examined.
        zero: Fraction exactly zero already.
        fp16_underflow: Fraction of nonzero values that FP16 would flush to zero
            (``|g| < 2**-24``, below FP16's smallest subnormal).
        fp16_subnormal: Fraction in FP16's subnormal range (``2**-24 <= |g| < 2**-14``), kept
            with reduced precision.
        bf16_underflow: Fraction of nonzero values BF16 would flush to zero (``|g| < 2**-133``).
        scale: The loss scale the overflow figures assume.
        fp16_overflow_at_scale: Fraction with ``|g| * scale`` above FP16's maximum (65504).
        fp16_underflow_at_scale: Fraction of nonzero values still below ``2**-24`` after scaling.
        max_abs: The largest finite ``|g|``.
        nonfinite: Fraction of inf/NaN values.
        recommended_scale: The largest power of two ``S`` with ``max_abs * S <= 65504 / headroom``
            (1.0 when every gradient is zero).
    """

    numel: int
    zero: float
    fp16_underflow: float
    fp16_subnormal: float
    bf16_underflow: float
    scale: float
    fp16_overflow_at_scale: float
    fp16_underflow_at_scale: float
    max_abs: float
    nonfinite: float
    recommended_scale: float

    def as_dict(self) -> dict[str, Any]:
        """The fields as a plain dict (``dataclasses.asdict``), for JSON."""
        return asdict(self)


def _gradients(source: Any) -> list[torch.Tensor]:
    if isinstance(source, torch.nn.Module):
        source = source.parameters()
    if isinstance(source, torch.Tensor):
        source = [source]
    if not isinstance(source, Iterable):
        raise TypeError(
            "gradient_range() takes a module, a tensor or an iterable of parameters, got "
            f"{type(source).__name__}."
        )
    grads = []
    for p in source:
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"expected tensors, got {type(p).__name__}.")
        g = p.grad
        if g is not None and g.is_floating_point():
            grads.append(g.detach())
    return grads


@torch.no_grad()
def gradient_range(
    source: Any, *, scale: float = 1.0, headroom: float = 2.0
) -> GradientRange:
    """Measure the current gradients of ``source`` against FP16 and BF16.

    Args:
        source: A module, a parameter or an iterable of parameters; their ``.grad`` is read
            (unscaled gradients, as after ``scaler.unscale_``).
        scale: The loss scale for the overflow/underflow-at-scale figures (default: 1.0).
        headroom: Factor kept free below FP16's maximum in the recommendation (default: 2.0).

    Returns:
        A ``GradientRange``.

    Raises:
        ValueError: If there are no gradients (run backward first), or ``scale``/``headroom``
            are not positive.
    """
    if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a finite number > 0, got {scale!r}.")
    if not (isinstance(headroom, (int, float)) and math.isfinite(headroom) and headroom >= 1):
        raise ValueError(f"headroom must be a finite number >= 1, got {headroom!r}.")
    grads = _gradients(source)
    if not grads:
        raise ValueError("no gradients found: call loss.backward() before gradient_range().")
    n = 0
    counts = dict.fromkeys(
        ("zero", "fp16_underflow", "fp16_subnormal", "bf16_underflow", "overflow", "under_scaled",
         "nonfinite"), 0
    )
    max_abs = 0.0
    for g in grads:
        a = g.double().abs().flatten()  # FP64 so the thresholds and products are exact
        n += a.numel()
        finite = torch.isfinite(a)
        counts["nonfinite"] += int((~finite).sum())
        a = a[finite]
        nonzero = a > 0
        counts["zero"] += int((~nonzero).sum())
        counts["fp16_underflow"] += int((nonzero & (a < FP16_MIN_SUBNORMAL)).sum())
        counts["fp16_subnormal"] += int(((a >= FP16_MIN_SUBNORMAL) & (a < _FP16.tiny)).sum())
        counts["bf16_underflow"] += int((nonzero & (a < BF16_MIN_SUBNORMAL)).sum())
        scaled = a * scale
        counts["overflow"] += int((scaled > _FP16.max).sum())
        counts["under_scaled"] += int((nonzero & (scaled < FP16_MIN_SUBNORMAL)).sum())
        if a.numel():
            max_abs = max(max_abs, float(a.max()))
    frac: Callable[[str], float] = (lambda k: counts[k] / n) if n else (lambda k: 0.0)
    if max_abs > 0:
        recommended = 2.0 ** math.floor(math.log2(_FP16.max / headroom / max_abs))
    else:
        recommended = 1.0
    return GradientRange(
        numel=n, zero=frac("zero"), fp16_underflow=frac("fp16_underflow"),
        fp16_subnormal=frac("fp16_subnormal"), bf16_underflow=frac("bf16_underflow"),
        scale=float(scale), fp16_overflow_at_scale=frac("overflow"),
        fp16_underflow_at_scale=frac("under_scaled"), max_abs=max_abs,
        nonfinite=frac("nonfinite"), recommended_scale=recommended,
    )


# ---------------------------------------------------------------------------------------------
# Lost updates
# ---------------------------------------------------------------------------------------------
