"""FP32 values kept for the optimizer: what a model held before it was cast to BF16 or FP16.

Casting an FP32 model to BF16 rounds each weight to 8 significant bits. An optimizer built on
the cast model would start its master from the rounded weight: the split master's trail at
zero, Kahan's compensation at zero, the FP32 copy as the rounded value, and what the FP32
weights held below BF16's precision would be gone before the first step. So the cast keeps
each parameter's FP32 value (``Recipe.convert`` does; ``keep_fp32_values`` for a model the user
casts), and the optimizer, when it creates a parameter's state, starts the master from it
(``MasterStorage.init``'s ``value``: the split master as the exact FP32 value, Kahan's
compensation as the rounding residual, the FP32 copy as the value) and lets it go. Plain BF16
and stochastic rounding keep nothing beyond the parameter and start from the rounded weight.

The value is the FP32 tensor the parameter held (no copy: the cast leaves it to us instead of
freeing it), noted on the parameter with the parameter's version counter. A value is taken
only while the parameter has not been written since (``torch.Tensor._version``: loading other
weights into it, or a step, counts as a write; a cast or a move to another device does not,
and the value follows the parameter to its device), and only by a parameter of another dtype.
Until then it costs the FP32 bytes the model had: a BF16 model cast from FP32 holds 6 bytes a
parameter until its optimizer's first step, as the FP32 model held 4.
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

    A lowprec optimizer built on the cast model then starts each parameter's master from its
    FP32 value instead of the rounded weight: ``master="split"`` as the exact FP32 value,
    ``"fp32"`` as a copy of it, ``"kahan"`` with the rounding residual as its compensation
    (``master_weight(p)`` gives that value before the first step too). The values are let go
    when the optimizer creates the parameter's state, at its first step; a parameter written
    between (new weights loaded into it, a step of another optimizer) keeps none.

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
