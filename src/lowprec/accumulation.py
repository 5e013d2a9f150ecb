"""Gradient accumulation without rounding loss for BF16/FP16 parameters: ``lowprec.accumulate``.

Autograd adds each micro-batch's gradient into ``p.grad`` in the parameter's dtype, so with BF16
parameters every micro-batch after the first rounds the running sum to 8 significant bits:
over 16 micro-batches the summed gradient's median relative error is about 4e-3, and only 38%
of its elements are the exact sum rounded once (measured: ``tests/test_accumulate.py``).
``accumulate(model)`` keeps the sum beside each parameter and hands ``p.grad`` the sum rounded
once, after every micro-batch:

* ``how="fp32"`` (the default): an FP32 accumulator, 4 bytes per parameter element. ``p.grad``
  is the FP32 sum rounded to the parameter's dtype: within one rounding of the exact sum.
* ``how="kahan"``: a compensation in the parameter's dtype, 2 bytes per element: ``p.grad``
  is the running sum, the compensation what its rounding dropped (Kahan summation). As
  accurate as the FP32 accumulator for 99.9% of the elements over 16 micro-batches; an
  element whose sum cancels to far below its terms keeps an error of the terms' rounding.

Two hooks per parameter do it: a tensor hook (``register_hook``) sees each micro-batch's gradient
before autograd adds it, and a post-accumulate hook (``register_post_accumulate_grad_hook``)
then writes the sum into ``p.grad``. A sum starts over where ``p.grad`` is None
(``zero_grad()``) or was written by anything else since (``zero_grad(set_to_none=False)``, an
optimizer writing unscaled gradients back): the hooks compare ``p.grad``'s version counter. The
post-accumulate hook runs before DDP's reducer reads the gradient (its hook is the accumulation
node's post hook, which runs after), so under ``no_sync()`` DDP all-reduces the compensated sum
at the last micro-batch. Under a loss scaler the sums are of scaled gradients, as autograd's
are; an inf or NaN stays in the sum until the step is skipped and the gradients zeroed.
FP32 parameters, and those that do not require a gradient, are left alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, cast

import torch
from torch import nn

__all__ = ["Accumulator", "accumulate"]

_HOW = ("fp32", "kahan")


class _Sum:
    """One parameter's running sum: its buffer, the exact FP32 total between the two hooks
    (``"kahan"``), and the version of ``p.grad`` it last wrote."""

    __slots__ = ("buf", "pending", "version")

    def __init__(self, p: torch.Tensor, how: str) -> None:
        dtype = torch.float32 if how == "fp32" else p.dtype
        self.buf = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        self.pending: torch.Tensor | None = None
        self.version: int | None = None


class Accumulator:
    """The hooks ``accumulate`` installed, and their buffers; ``remove()`` takes them away.

    Made by ``accumulate(model, how)``, which chooses the parameters and checks ``how``.

    Args:
        params: The BF16/FP16 parameters whose gradients it accumulates.
        how: ``"fp32"`` or ``"kahan"``.

    Attributes:
        how: ``"fp32"`` or ``"kahan"``.
        params: The parameters whose gradients it accumulates.
    """

    def __init__(self, params: list[torch.Tensor], how: str) -> None:
        self.how = how
        self.params = params
        self._sums = [_Sum(p, how) for p in params]
        self._handles: list[Any] = []
        for p, s in zip(params, self._sums, strict=True):
            self._handles.append(p.register_hook(self._incoming(p, s)))
            self._handles.append(p.register_post_accumulate_grad_hook(self._accumulated(s)))
            # (lowprec.step_in_backward refuses such parameters; an attribute torch.Tensor does
            # not declare, hence setattr)
            setattr(p, "_lowprec_accumulating", True)  # noqa: B010

    def _incoming(self, p: torch.Tensor, s: _Sum) -> Callable[[torch.Tensor], torch.Tensor]:
        """The tensor hook: a micro-batch's gradient ``g``, before autograd adds it."""

        def hook(g: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                if p.grad is None or p.grad._version != s.version:
                    # A new sum (zero_grad, or p.grad written by someone else since): autograd
                    # sets or adds g exactly, so its own value is the sum.
                    s.pending = None
                    s.version = None
                    if self.how == "fp32":
                        s.buf.copy_(g)
                    else:
                        s.buf.zero_()
                elif self.how == "fp32":
                    s.buf.add_(g)
                else:  # the running sum, its compensation and g, added in FP32
                    s.pending = p.grad.float() + s.buf.float() + g.float()
            return g

        return hook

    def _accumulated(self, s: _Sum) -> Callable[[torch.Tensor], None]:
        """The post-accumulate hook: ``p.grad`` made the sum, rounded once."""

        def hook(p: torch.Tensor) -> None:
            grad = cast(torch.Tensor, p.grad)  # (a post-accumulate-grad hook's: present)
            if grad._is_view():
                raise RuntimeError(
                    "lowprec.accumulate() needs gradients of their own, but this one is a view "
                    "(DistributedDataParallel(gradient_as_bucket_view=True) makes them so, and "
                    "a bucket's views share one version counter); use DDP's default "
                    "gradient_as_bucket_view=False with accumulate()."
                )
            with torch.no_grad():
                if self.how == "fp32":
                    if s.version is not None:  # (the first micro-batch's sum is autograd's)
                        grad.copy_(s.buf)
                elif s.pending is not None:
                    total, s.pending = s.pending, None
                    grad.copy_(total)  # the running sum: the total rounded once
                    s.buf.copy_(total - grad.float())  # what that rounding dropped
            s.version = grad._version

        return hook

    def bytes(self) -> int:
        """Bytes of the accumulation buffers."""
        return sum(s.buf.numel() * s.buf.element_size() for s in self._sums)

    def buffers(self) -> list[torch.Tensor]:
        """The accumulation buffers (for memory accounting)."""
        return [s.buf for s in self._sums]

    def remove(self) -> None:
        """Remove the hooks and free the buffers."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._sums.clear()
        for p in self.params:
            if getattr(p, "_lowprec_accumulating", False):
                delattr(p, "_lowprec_accumulating")


def accumulate(model: nn.Module | Iterable[torch.Tensor], how: str = "fp32") -> Accumulator:
    """Accumulate the BF16/FP16 parameters' gradients over micro-batches without rounding loss.

    Call it once after building (and converting) the model; train as usual: ``backward()`` per
    micro-batch, ``step()`` and ``zero_grad()`` per optimizer step. See the module docstring.

    Args:
        model: A module, or its parameters.
        how: ``"fp32"`` (an FP32 accumulator, 4 bytes per element) or ``"kahan"`` (a
            compensation in the parameter's dtype, 2 bytes per element) (default: ``"fp32"``).

    Returns:
        The ``Accumulator``; ``remove()`` undoes it.

    Raises:
        ValueError: An unknown ``how``, no BF16/FP16 parameter that requires a gradient, or a
            parameter stepped inside backward (``step_in_backward``).
        TypeError: Something other than a module or tensors.

    Examples:
        A gradient of 1 and then 16 of 1e-3: autograd's BF16 sum rounds each 1e-3 away, the
        accumulator's is the exact sum rounded once.

        >>> import torch
        >>> import lowprec
        >>> w = torch.nn.Parameter(torch.zeros(1, dtype=torch.bfloat16))
        >>> def micro_batches():
        ...     w.grad = None
        ...     (w * 1.0).sum().backward()
        ...     for _ in range(16):
        ...         (w * 1e-3).sum().backward()
        ...     return w.grad.item()
        >>> micro_batches()
        1.0
        >>> acc = lowprec.accumulate([w])
        >>> micro_batches()
        1.015625
        >>> acc.remove()
    """
    if how not in _HOW:
        raise ValueError(f"how must be one of {', '.join(map(repr, _HOW))}, got {how!r}.")
    params = model.parameters() if isinstance(model, nn.Module) else model
    chosen: list[torch.Tensor] = []
    seen: set[int] = set()
    for p in params:
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"accumulate() takes a module or tensors, got {type(p).__name__}.")
        if getattr(p, "_lowprec_in_backward", False):
            raise ValueError(
                "accumulate(): a parameter is stepped inside backward (lowprec.step_in_backward), "
                "which updates it at every backward; remove() that first to accumulate gradients."
            )
        if p.requires_grad and p.dtype in (torch.bfloat16, torch.float16) and id(p) not in seen:
            seen.add(id(p))
            chosen.append(p)
    if not chosen:
        raise ValueError(
            "accumulate() found no BF16 or FP16 parameter that requires a gradient: FP32 "
            "gradients accumulate without this loss; convert the model first (e.g. "
            "lowprec.recipes.get('bf16-kahan').convert(model))."
        )
    return Accumulator(chosen, how)
