"""FP32 values kept for the optimizer: what a model held before it was cast to BF16 or FP16.

So that a master does not start from the rounded weight, the cast keeps each parameter's FP32
value (``Recipe.convert``; ``keep_fp32_values`` for a user's own cast), and ``MasterStorage.init``
starts the master from it when the state is created, then lets it go. The value is the FP32
tensor itself (no copy), noted with the parameter's version counter: it is taken only by a
parameter of another dtype not written since (a cast or a move is no write; a load or a step
is). Until then it costs the FP32 model's bytes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import torch
from torch import nn

__all__ = ["keep_fp32_values", "kept_value", "release", "take"]

_ATTR = "_lowprec_fp32_value"


def note(p: torch.Tensor, value: torch.Tensor) -> None:
    """Keep ``value`` (FP32, shaped as ``p``) as the value ``p`` is about to be rounded from."""
    setattr(p, _ATTR, (value.detach(), p._version))


def kept_value(p: torch.Tensor) -> torch.Tensor | None:
    """The FP32 value ``p`` was rounded from, on ``p``'s device, while it still holds (``p`` not
    written since, of the same shape, and not FP32 itself); None otherwise. Writes nothing."""
    found = getattr(p, _ATTR, None)
    if found is None:
        return None
    value, version = cast("tuple[torch.Tensor, int]", found)
    if (p._version != version or value.shape != p.shape or p.dtype == torch.float32
            or not p.is_floating_point()):
        return None
    return value if value.device == p.device else value.to(p.device)


def take(p: torch.Tensor) -> torch.Tensor | None:
    """``kept_value(p)``, and the kept value let go."""
    value = kept_value(p)
    release([p])
    return value


def release(params: Iterable[torch.Tensor]) -> None:
    """Let the values kept for ``params`` go."""
    for p in params:
        if hasattr(p, _ATTR):
            delattr(p, _ATTR)


def keep_fp32_values(model: nn.Module) -> nn.Module:
    """Keep the FP32 values of ``model``'s trainable parameters for the optimizer, before you
    cast the model to BF16 or FP16 yourself (``Recipe.convert`` does this already).

    A lowprec optimizer built on the cast model starts each master from the FP32 value
    (``"split"``, ``"fp32"``; ``"kahan"`` with the rounding residual as its compensation)
    instead of the rounded weight. The values are let go at its first step; a parameter
    written before (new weights loaded, another optimizer's step) keeps none.

    Args:
        model: An FP32 model, before its cast.

    Returns:
        ``model``.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.

    Example:
        >>> import torch
        >>> import lowprec
        >>> model = torch.nn.Linear(4, 2)
        >>> fp32 = model.weight.detach().clone()
        >>> model = lowprec.keep_fp32_values(model).to(torch.bfloat16)
        >>> opt = lowprec.AdamW(model.parameters(), master="split")
        >>> torch.equal(opt.master_weight(model.weight), fp32)  # not the BF16 weight
        True
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"keep_fp32_values() takes an nn.Module, got {type(model).__name__}.")
    for p in model.parameters():
        if p.requires_grad and p.dtype == torch.float32:
            note(p, p.detach())
    return model
