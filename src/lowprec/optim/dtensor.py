"""DTensor parameters' local tensors: ``local`` (a shard, the same object every call),
``wrap_like``/``wrap_state`` (a shard's value as a DTensor placed as its parameter),
``mark_blocks`` and ``flat_offset``; plain functions that ``shards`` and ``core`` build on.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from lowprec.optim import qstate

if TYPE_CHECKING:  # pragma: no cover
    from typing_extensions import TypeIs

try:
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError:  # pragma: no cover - torch built without distributed
    DTensor = Replicate = Shard = None  # type: ignore[assignment,misc]


def is_dtensor(t: object) -> TypeIs[DTensor]:
    return DTensor is not None and isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor holding this rank's elements of DTensor ``t`` (else ``t``): the same object
    every call, since the step writes into it (``to_local()`` hands a fresh view each time)."""
    return t._local_tensor if is_dtensor(t) else t


def wrap_like(t: torch.Tensor, p: DTensor) -> DTensor:
    """Local tensor ``t`` (shaped as ``p``'s shard) as a DTensor of ``p``'s mesh and placements."""
    with torch.no_grad():
        return DTensor.from_local(
            t, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
        )


def wrap_state(name: str, value: Any, lp: torch.Tensor, p: DTensor) -> Any:
    """State entry ``name`` of shard ``lp`` as ``p``'s state keeps it: a per-element buffer, or
    the scales of an 8-bit one (a row per row of the shard: ``qstate.scale_shape``), as a
    DTensor placed as ``p``; anything else as it is."""
    if not isinstance(value, torch.Tensor) or name == "step":  # (the count, an option)
        return value
    if value.shape == lp.shape:
        return wrap_like(value, p)
    if qstate.qualifies(lp) and value.shape == qstate.scale_shape(lp):
        shape = qstate.scale_shape(p)
        with torch.no_grad():
            # (torch annotates shape as a torch.Size; any tuple of ints is one to it)
            return DTensor.from_local(value, p.device_mesh, p.placements, run_check=False,
                                      shape=shape,  # type: ignore[arg-type]
                                      stride=(shape[1], 1))
    return value


def mark_blocks(p: DTensor) -> None:
    """Note on DTensor ``p`` and on its local tensor whether it gets 8-bit state
    (``qstate.block_rows``, which ``qstate.qualifies`` reads back; a step refuses a shard that
    is not contiguous: ``_refusal``)."""
    ok = qstate.block_rows(p)
    setattr(p, qstate.SHARDED, ok)
    setattr(local(p), qstate.SHARDED, ok)


def flat_offset(p: DTensor) -> int:
    """Index, in ``p`` flattened, of the first element of this rank's shard (its shards are
    blocks: ``qstate.block_sharded``)."""
    if all(isinstance(pl, Replicate) for pl in p.placements) or p.dim() == 0:
        return 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return int(offset[0]) * math.prod(p.shape[1:])
