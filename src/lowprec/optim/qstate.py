"""8-bit and 4-bit optimizer state: moments kept as codes of one byte or half a byte per element,
with a scale per block.

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

``state_dtype="4bit"`` keeps the same buffers of the same parameters as 4-bit codes, two per
byte, with the same FP32 scale per block of ``BLOCK`` (``encode4``/``decode4``): a moment costs
0.5 + 4 / ``BLOCK`` bytes per element, so AdamW's two 1.03. Element ``j`` of a block shares its
byte with element ``j + HALF`` (low and high half-byte), so that a block is two rows of
``HALF`` (``rows``: ``[blocks, 2, HALF]``) that unpack and pack with elementwise integer
operations on whole rows, which compiled CPU code vectorizes. The codes, measured as the 8-bit
ones were:

* signed buffers: ``x = s * sign * (k / 7)**2`` for code ``8 + sign * k``, ``k`` in 0..7
  (code 0 is never written): 15 values, zero below ``s / 196``;
* non-negative buffers: ``x = s * (k + 1) / 16`` for code ``k`` in 0..15 (the linear map
  without zero of torchao's 4-bit optimizers, after Li et al. 2023): no zero, the smallest
  ``s / 16``. A second moment rounded to zero would divide its update by ``eps`` alone (the
  8-bit codes reach far enough below the scale; 16 codes cannot), so the values below the
  smallest code round up to it, which can only shrink their updates. Power-law codes without
  zero (``((k + 1) / 16)**4``) kept small values better but trained further from FP32 on the
  measured task (docs/architecture.md).

The parameters that qualify are those of 8-bit state (``qualifies``); DTensor parameters are
refused under 4-bit state (``check_group``). The packed codes of a parameter are flat,
``[numel / 2]`` (``codes_shape``).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from lowprec.numerics import sqrt_rn
from lowprec.optim.options import _QUANTIZED_STATE

__all__ = ["BITS", "BLOCK", "EIGHT_BIT", "FOUR_BIT", "HALF", "MIN_NUMEL", "block_rows",
           "block_sharded", "check_group",
           "codes_shape", "decode", "decode4", "encode", "encode4", "from_codes", "qualifies",
           "scale_key", "scale_shape", "to_codes"]

#: The ``state_dtype`` values that ask for 8-bit and for 4-bit state.
EIGHT_BIT, FOUR_BIT = _QUANTIZED_STATE
#: Bits per code of each of those ``state_dtype`` values.
BITS = {EIGHT_BIT: 8, FOUR_BIT: 4}
#: Elements per block: each block has its own scale.
BLOCK = 256
#: A block's half: 4-bit codes pack element ``j`` of a block with element ``j + HALF``.
HALF = BLOCK // 2
#: Parameters smaller than this keep FP32 state.
MIN_NUMEL = 4096
#: The largest root-scale code of a signed buffer (about 0, +-127) and of a non-negative one.
_SIGNED_STEPS, _UNSIGNED_STEPS = 127.0, 255.0
#: 4-bit codes: the largest signed root-scale code (about 8, +-7), and the steps of the
#: non-negative codes' linear scale (codes 0..15 are steps 1..16: no zero).
_SIGNED4, _UNSIGNED4 = 7.0, 16.0
#: The attribute in which ``lowprec.optim.shards`` notes, on a DTensor parameter and on its local
#: tensor, whether the parameter gets 8-bit state: decided from the whole parameter, so that
#: every rank keeps its shard's state alike (``block_rows``, ``shards.mark_blocks``).
SHARDED = "_lowprec_8bit"


def scale_key(name: str) -> str:
    """The state entry holding the scales of buffer ``name``'s codes."""
    return f"{name}_scale"


def qualifies(p: torch.Tensor) -> bool:
    """Whether parameter ``p`` gets codes under ``state_dtype="8bit"`` or ``"4bit"`` (a contiguous one:
    its blocks are runs of its flat view; for a DTensor parameter and its shard, what
    ``block_rows`` decided for the whole parameter)."""
    decided: bool | None = getattr(p, SHARDED, None)
    if decided is None and hasattr(p, "device_mesh"):  # a DTensor the optimizer has not noted
        decided = block_rows(p)
        setattr(p, SHARDED, decided)
    if decided is not None:
        return decided
    n = p.numel()
    return n >= MIN_NUMEL and n % BLOCK == 0 and p.is_contiguous()


def block_rows(p: Any) -> bool:
    """Whether DTensor ``p`` gets 8-bit state: every rank's shard is whole rows of ``p``
    (``block_sharded``), its rows are whole blocks, and ``p`` is as large as ``MIN_NUMEL``.
    Decided from the parameter's shape and placements alone, so every rank decides alike (an
    empty shard too); ``shards.mark_blocks`` notes it on the parameter and its local tensor."""
    return (block_sharded(p) and p.dim() >= 1 and p.numel() >= MIN_NUMEL
            and math.prod(p.shape[1:]) % BLOCK == 0)


def block_sharded(p: Any) -> bool:
    """Whether every rank's shard of DTensor ``p`` is one block of consecutive elements of ``p``
    flattened: each placement replicates or shards the first dimension (decided from the
    placements alone, so every rank decides alike)."""
    from torch.distributed.tensor import Replicate, Shard

    return all(isinstance(pl, Replicate) or (type(pl) is Shard and pl.dim == 0)
               for pl in p.placements)


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


def to_codes(x: torch.Tensor, signed: bool, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """A whole buffer ``x`` (any shape, a multiple of ``BLOCK`` elements, contiguous) as it is
    kept in state: codes shaped as ``x`` (4-bit: flat, packed, ``codes_shape``) and scales
    flat, ``[numel / BLOCK]``."""
    if bits == 4:
        codes, scale = encode4(rows(x.float().reshape(-1), True), signed)
        return codes.view(-1), scale.view(-1)
    codes, scale = encode(x.float().reshape(-1, BLOCK), signed)
    return codes.view(x.shape), scale.view(-1)


def from_codes(codes: torch.Tensor, scale: torch.Tensor, signed: bool,
               shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """The FP32 values of a whole buffer kept as ``to_codes`` keeps it, shaped as ``codes``, or
    as ``shape`` (the parameter's: 4-bit codes are flat). Which width the codes are is read from
    their number against the scales' (two per byte: 4-bit)."""
    scale = scale.reshape(-1).float()
    if codes.numel() != scale.numel() * BLOCK:  # (4-bit)
        out = decode4(rows(codes.reshape(-1), True, "codes"), rows(scale, True, "scale"), signed)
        return out.view(shape if shape is not None else (-1,))
    out = decode(codes.reshape(-1, BLOCK), scale.view(-1, 1), signed)
    return out.view(shape if shape is not None else codes.shape)


def new_state(value: float, p: torch.Tensor, signed: bool,
              bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and scales (``to_codes``, the scales shaped by ``scale_shape``) of a buffer of
    ``p``'s shape filled with ``value``: one block encoded and repeated, since every block is
    the same (encoding all of them took 7 s of a 124M-parameter model's first step here)."""
    codes, scale = to_codes(torch.full((BLOCK,), float(value), device=p.device), signed, bits)
    blocks = p.numel() // BLOCK
    codes = codes.repeat(blocks)
    return (codes.view(p.shape) if bits == 8 else codes,
            scale.expand(blocks).clone().view(scale_shape(p)))


# ---------------------------------------------------------------------- 4-bit codes and formats
#
# ``update._param_update``'s ``qstate`` names each buffer kept as codes with its format: "s8"
# and "u8" (8-bit, signed or not: ``encode``/``decode``), "s4" and "u4" (4-bit, packed:
# ``encode4``/``decode4``). A parameter's buffers are all of one width.


def fmt(signed: bool, bits: int) -> str:
    """The format of a buffer's codes (``"s8"``, ``"u8"``, ``"s4"``, ``"u4"``)."""
    return f"{'s' if signed else 'u'}{bits}"


def is_signed(f: str) -> bool:
    return f[0] == "s"


def four_bit(quantized: tuple[tuple[str, str], ...]) -> bool:
    """Whether ``qstate`` (``(name, format)`` pairs) keeps 4-bit codes."""
    return any(f[1:] == "4" for _, f in quantized)


def rows(t: torch.Tensor, four: bool, role: str = "values") -> torch.Tensor:
    """A flat tensor (a parameter's, a chunk's or a piece's, whole blocks) as ``encode``/
    ``encode4`` and the decoders take it: ``role`` ``"values"`` (the parameter, its gradient,
    its master's buffers) and ``"codes"`` (8-bit) as rows of a block, ``[blocks, BLOCK]``, and
    4-bit as the block's two halves, ``[blocks, 2, HALF]``, packed codes ``[blocks, 1, HALF]``;
    ``"scale"``: a column, ``[blocks, 1]`` (``[blocks, 1, 1]``)."""
    if role == "scale":
        return t.view(-1, 1, 1) if four else t.view(-1, 1)
    if not four:
        return t.view(-1, BLOCK)
    return t.view(-1, 1, HALF) if role == "codes" else t.view(-1, 2, HALF)


def encode4(x: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed 4-bit codes (``uint8``, ``[blocks, 1, HALF]``: element ``j`` of a block in the low
    half-byte, element ``j + HALF`` in the high one) and scales (FP32, ``[blocks, 1, 1]``: the
    blocks' largest magnitudes) of FP32 ``x`` (``[blocks, 2, HALF]``; non-negative unless
    ``signed``). Each code is the nearest, on the root scale for signed codes as ``encode``'s;
    a block of zeros has scale 0, one holding inf or NaN a non-finite scale."""
    scale = x.abs().amax(dim=(-2, -1), keepdim=True)
    y = x.abs() / torch.where(scale > 0, scale, torch.ones_like(scale))
    y = torch.where(y == y, y, torch.zeros_like(y))
    if signed:
        k = torch.round(_SIGNED4 * sqrt_rn(y))
        k = torch.where(x < 0, 8 - k, 8 + k)
    else:  # (steps 1..16 of a linear scale, the values below step 1 rounded up to it)
        k = torch.clamp(torch.round(_UNSIGNED4 * y), min=1.0) - 1
    return (k[..., :1, :] + 16 * k[..., 1:, :]).to(torch.uint8), scale


def decode4(codes: torch.Tensor, scale: torch.Tensor, signed: bool) -> torch.Tensor:
    """FP32 values (``[blocks, 2, HALF]``) of packed 4-bit ``codes`` (``[blocks, 1, HALF]``)
    with their blocks' ``scale`` (``[blocks, 1, 1]``)."""
    # (each byte shifted by 0 for the block's first half and by 4 for its second: elementwise,
    # where a concatenation of the two halves was a full-size temporary of its own)
    shift = 4 * torch.arange(2, device=codes.device, dtype=torch.int32).view(2, 1)
    q = ((codes.to(torch.int32) >> shift) & 15).float()
    if signed:
        q = (q - 8) * (1 / _SIGNED4)
        return q * q.abs() * scale
    return (q + 1) * (1 / _UNSIGNED4) * scale


def encode_as(x: torch.Tensor, f: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``encode`` or ``encode4`` for format ``f`` (``x`` as ``rows`` gives it)."""
    if f[1:] == "4":
        return encode4(x, is_signed(f))
    return encode(x, is_signed(f))


def decode_as(codes: torch.Tensor, scale: torch.Tensor, f: str) -> torch.Tensor:
    """``decode`` or ``decode4`` for format ``f`` (``codes`` and ``scale`` as ``rows`` gives
    them)."""
    if f[1:] == "4":
        return decode4(codes, scale, is_signed(f))
    return decode(codes, scale, is_signed(f))


def codes_shape(p: torch.Tensor, bits: int) -> tuple[int, ...]:
    """The shape of ``p``'s codes: ``p``'s (8-bit), or flat, two per byte (4-bit)."""
    return tuple(p.shape) if bits == 8 else (p.numel() // 2,)


def element_bytes(bits: int) -> float:
    """Bytes per element of a buffer kept as codes of ``bits``: the code and its share of the
    block's FP32 scale."""
    return bits / 8 + 4 / BLOCK


def check_group(group: dict[str, Any], where: str) -> None:
    """Refuse DTensor parameters (FSDP2, tensor parallelism) in a group under 4-bit state,
    naming the first: their shards would need the packed codes placed as the parameter; 8-bit
    state keeps sharded parameters (``lowprec.optim.shards``)."""
    if group.get("state_dtype") != FOUR_BIT:
        return
    for i, p in enumerate(group["params"]):
        if hasattr(p, "device_mesh") or getattr(p, SHARDED, None) is not None:
            raise ValueError(
                f"{where}, parameter {i}: state_dtype='4bit' does not support DTensor "
                "parameters (FSDP2's fully_shard, tensor parallelism) yet; use "
                "state_dtype='8bit', which keeps a sharded parameter's moments as 8-bit codes."
            )
