"""8-bit optimizer state: moments kept as one byte per element with a scale per block.

``state_dtype="8bit"`` keeps each of an update rule's buffers (AdamW's moments, SGD's momentum,
Adagrad's sum, LAMB's moments) for a parameter of at least ``MIN_NUMEL`` elements, a multiple
of ``BLOCK``, as

* ``state[name]``: ``uint8`` codes shaped as the parameter, and
* ``state[name + "_scale"]``: FP32, one per ``BLOCK`` consecutive elements of the flattened
  parameter: the block's largest magnitude,

so a moment costs 1 + 4 / ``BLOCK`` bytes per element instead of 2 (BF16) or 4 (FP32). Smaller
parameters (biases, norms) and those of another size keep FP32 state, as bitsandbytes' and
torchao's 8-bit optimizers do: they are a small part of a model's bytes and the most sensitive.
A DTensor parameter (FSDP2) qualifies when its shards are whole rows of whole blocks, and then
keeps its scales a row per row of the parameter (``scale_shape``; ``lowprec.optim.shards``).

A code is an integer on a power-law scale of the block's largest magnitude ``s`` (the scale
kept per block), so that small values keep codes of their own while the large ones, which move
an update most, are kept finest:

* signed buffers (a first moment, a momentum): ``x = s * sign * (k / 127)**2`` for code
  ``128 + sign * k``, ``k`` in 0..127: relative error 0.8% at ``s``, 8% at ``s / 100``, and
  values below ``s / 65000`` round to zero;
* non-negative buffers (a second moment, Adagrad's sum): ``x = s * (k / 255)**4``, ``k`` in
  0..255: 0.8% at ``s``, 8% at ``s / 10**4``, zero below ``s / (7 * 10**10)``. A second moment
  spans the square of the gradients' range, so it needs the range more than a first moment:
  one rounded to zero would divide an update by ``eps`` alone, and the error of its square root
  (the update's denominator) is half its own.

A code is the nearest on the root scale (``sqrt`` or the fourth root of ``|x| / s``, rounded
half to even), found with square roots, multiplications and rounding alone, which vectorize in
compiled CPU code; 8-bit floats (``float8_e4m3fn``/``e5m2``) and the dynamic map of Dettmers et
al. 2022 need bit casts or a search there, and made the compiled step 2-4x slower. The format was
chosen by measurement against those and linear codes (``benchmarks/state_formats.py``; the
numbers are in docs/architecture.md). ``encode``/``decode`` work on ``[blocks, BLOCK]`` tensors
(``decode`` on anything whose last dimension is a block), eagerly and compiled alike (the roots
are correctly rounded in both: ``numerics.sqrt_rn``).
"""

from __future__ import annotations

import math

import torch

from lowprec.numerics import sqrt_rn

__all__ = ["BLOCK", "EIGHT_BIT", "MIN_NUMEL", "decode", "encode", "from_codes", "qualifies",
           "scale_key", "scale_shape", "to_codes"]

#: The ``state_dtype`` value that asks for 8-bit state.
EIGHT_BIT = "8bit"
#: Elements per block: each block has its own scale.
BLOCK = 256
#: Parameters smaller than this keep FP32 state.
MIN_NUMEL = 4096
#: The largest root-scale code of a signed buffer (about 0, +-127) and of a non-negative one.
_SIGNED_STEPS, _UNSIGNED_STEPS = 127.0, 255.0
#: The attribute in which ``lowprec.optim.shards`` notes, on a DTensor parameter and on its local
#: tensor, whether the parameter gets 8-bit state: decided from the whole parameter, so that
#: every rank keeps its shard's state alike (``shards.mark_blocks``).
SHARDED = "_lowprec_8bit"


def scale_key(name: str) -> str:
    """The state entry holding the scales of buffer ``name``'s codes."""
    return f"{name}_scale"


def qualifies(p: torch.Tensor) -> bool:
    """Whether parameter ``p`` gets 8-bit state under ``state_dtype="8bit"`` (a contiguous one:
    its blocks are runs of its flat view; for a DTensor parameter and its shard, what
    ``shards.mark_blocks`` decided for the whole parameter)."""
    decided = getattr(p, SHARDED, None)
    if decided is None and hasattr(p, "device_mesh"):  # a DTensor the optimizer has not noted
        from lowprec.optim.shards import mark_blocks

        mark_blocks(p)
        decided = getattr(p, SHARDED)
    if decided is not None:
        return decided
    n = p.numel()
    return n >= MIN_NUMEL and n % BLOCK == 0 and p.is_contiguous()


def scale_shape(p: torch.Tensor) -> tuple[int, ...]:
    """The shape of the scales of ``p``'s 8-bit buffers: one per block of ``p`` flattened, and
    for a DTensor parameter (and its shard) a row of them per row of ``p`` (its rows are whole
    blocks), so that the scales shard along the first dimension as ``p`` does."""
    if getattr(p, SHARDED, None):
        return (p.shape[0], math.prod(p.shape[1:]) // BLOCK)
    return (p.numel() // BLOCK,)


def encode(x: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (``uint8``, shaped as ``x``) and scales (FP32, ``[blocks, 1]``: the blocks' largest
    magnitudes) of FP32 ``x`` (``[blocks, BLOCK]``; non-negative unless ``signed``). A block of
    zeros has scale 0; a block holding inf or NaN gets a non-finite scale, so that it decodes
    to inf/NaN rather than to finite numbers."""
    scale = x.abs().amax(dim=-1, keepdim=True)
    # (0 / 0 would be NaN: a zero block's values are zeros, divided by 1; and a NaN ratio, in a
    # block whose scale is already non-finite, gets code 0 rather than an undefined one)
    y = x.abs() / torch.where(scale > 0, scale, torch.ones_like(scale))
    y = torch.where(y == y, y, torch.zeros_like(y))
    if not signed:
        return torch.round(_UNSIGNED_STEPS * sqrt_rn(sqrt_rn(y))).to(torch.uint8), scale
    k = torch.round(_SIGNED_STEPS * sqrt_rn(y))
    return torch.where(x < 0, 128 - k, 128 + k).to(torch.uint8), scale


def decode(codes: torch.Tensor, scale: torch.Tensor, signed: bool) -> torch.Tensor:
    """FP32 values of ``codes`` (``uint8``, ``[..., BLOCK]``) with their blocks' ``scale``
    (``[..., 1]``)."""
    if not signed:
        q = codes.float() * (1 / _UNSIGNED_STEPS)
        q = q * q
        return q * q * scale
    q = (codes.float() - 128) * (1 / _SIGNED_STEPS)
    return q * q.abs() * scale


def to_codes(x: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A whole buffer ``x`` (any shape, a multiple of ``BLOCK`` elements, contiguous) as it is
    kept in state: codes shaped as ``x`` and scales flat, ``[numel / BLOCK]``."""
    codes, scale = encode(x.float().reshape(-1, BLOCK), signed)
    return codes.view(x.shape), scale.view(-1)


def from_codes(codes: torch.Tensor, scale: torch.Tensor, signed: bool) -> torch.Tensor:
    """The FP32 values of a whole buffer kept as ``to_codes`` keeps it, shaped as ``codes``."""
    rows = codes.reshape(-1, BLOCK)
    return decode(rows, scale.reshape(-1, 1).float(), signed).view(codes.shape)


def new_state(value: float, p: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and scales (``to_codes``, the scales shaped by ``scale_shape``) of a buffer of
    ``p``'s shape filled with ``value``."""
    codes, scale = to_codes(torch.full(p.shape, float(value), device=p.device), signed)
    return codes, scale.view(scale_shape(p))
