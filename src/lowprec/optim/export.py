"""The export of the FP32 master values: ``master_state_dict``, a model state dict of each
parameter's ``LowPrecisionOptimizer.master_weight``. Imports ``base``; nothing in
``lowprec.optim`` imports this module but the package's ``__init__``.
"""

from __future__ import annotations

from typing import Any

import torch

from lowprec.optim.base import LowPrecisionOptimizer

__all__ = ["master_state_dict"]


def master_state_dict(model: torch.nn.Module, optimizer: object) -> dict[str, Any]:
    """A model state dict holding the optimizer's FP32 master values, for export.

    Parameters the optimizer updates are replaced by ``optimizer.master_weight(p)``; other
    floating-point entries (frozen parameters, buffers) are cast to FP32; the rest is kept.
    ``optimizer`` may be a wrapper holding it as ``.optimizer`` (Accelerate's
    ``AcceleratedOptimizer``, Hugging Face Trainer's, Lightning's ``LightningOptimizer``).

    Args:
        model: The model whose ``state_dict()`` is exported; every name of a tied weight gets
            the master.
        optimizer: The lowprec optimizer that steps the model's parameters, or a framework's
            wrapper of one.

    Returns:
        ``model.state_dict()`` with FP32 values: what ``model.float().load_state_dict`` takes.

    Raises:
        TypeError: ``optimizer`` is not a lowprec optimizer nor a wrapper of one.

    Examples:
        >>> import torch
        >>> import lowprec
        >>> model = torch.nn.Linear(4, 4).bfloat16()
        >>> opt = lowprec.SGD(model.parameters(), lr=1e-4, master="split")
        >>> model(torch.ones(1, 4, dtype=torch.bfloat16)).sum().backward()
        >>> opt.step()
        >>> fp32 = lowprec.master_state_dict(model, opt)
        >>> fp32["weight"].dtype, torch.equal(fp32["weight"], opt.master_weight(model.weight))
        (torch.float32, True)
    """
    inner = optimizer
    for _ in range(4):  # (a wrapper of a wrapper at most, in practice)
        if isinstance(inner, LowPrecisionOptimizer):
            break
        inner = getattr(inner, "optimizer", None)
    if not isinstance(inner, LowPrecisionOptimizer):
        raise TypeError(
            "master_state_dict needs a lowprec optimizer (or a framework's wrapper of one, "
            f"holding it as .optimizer), got {type(optimizer).__name__}; a torch.optim "
            "optimizer keeps no master: its model's state_dict() is the export."
        )
    optimizer = inner
    masters = {}
    known = {id(p) for group in optimizer.param_groups for p in group["params"]}
    by_id: dict[int, torch.Tensor] = {}
    # (remove_duplicate=False: every name of a tied weight, e.g. GPT-2's lm_head, gets the master)
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in known:
            if id(p) not in by_id:
                by_id[id(p)] = optimizer.master_weight(p)
            masters[name] = by_id[id(p)]
    out = {}
    for name, t in model.state_dict().items():
        if name in masters:
            out[name] = masters[name]
        elif isinstance(t, torch.Tensor) and t.is_floating_point():
            out[name] = t.detach().float().clone()
        else:
            out[name] = t
    return out
