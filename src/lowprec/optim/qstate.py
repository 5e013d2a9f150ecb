"""8-bit and 4-bit optimizer state (``state_dtype="8bit"``/``"4bit"``): a rule buffer of a
parameter that ``qualifies`` as codes, with an FP32 scale (its largest magnitude) per ``BLOCK``.

Codes are the nearest on the root scale of the block's ``s``: 8-bit ``s * (k/127)**2`` (signed)
and ``s * (k/255)**4`` (non-negative), 4-bit ``s * (k/7)**2`` and ``s * (k+1)/16`` (no zero, so
a second moment never rounds to zero); roots, products and rounding alone, which compiled CPU
code vectorizes. Measurements: docs/architecture.md, "8-bit and 4-bit optimizer state".
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
#: The attribute noting, on a DTensor parameter and its local tensor, whether it gets 8-bit
#: state, decided from the whole parameter (``block_rows``, ``dtensor.mark_blocks``).
SHARDED = "_lowprec_8bit"


def scale_key(name: str) -> str:
    """The state entry holding the scales of buffer ``name``'s codes."""
    return f"{name}_scale"


def qualifies(p: torch.Tensor) -> bool:
    """Whether parameter ``p`` gets codes under ``state_dtype="8bit"`` or ``"4bit"``: a large
    contiguous one, or for a DTensor and its shard what ``block_rows`` decided."""
    decided: bool | None = getattr(p, SHARDED, None)
    if decided is None and hasattr(p, "device_mesh"):  # a DTensor the optimizer has not noted
        decided = block_rows(p)
        setattr(p, SHARDED, decided)
    if decided is not None:
        return decided
    n = p.numel()
    return n >= MIN_NUMEL and n % BLOCK == 0 and p.is_contiguous()


def block_rows(p: Any) -> bool:
    """Whether DTensor ``p`` gets 8-bit state: its shards are whole rows (``block_sharded``) of
    whole blocks and it has ``MIN_NUMEL`` elements. From shape and placements alone, so every
    rank (an empty shard too) decides alike."""
    return (block_sharded(p) and p.dim() >= 1 and p.numel() >= MIN_NUMEL
            and math.prod(p.shape[1:]) % BLOCK == 0)


def block_sharded(p: Any) -> bool:
    """Whether every rank's shard of DTensor ``p`` is one run of ``p``'s flattened elements (each
    placement replicates or shards dim 0); from the placements alone, alike on every rank."""
    from torch.distributed.tensor import Replicate, Shard

    return all(isinstance(pl, Replicate) or (type(pl) is Shard and pl.dim == 0)
               for pl in p.placements)


def scale_shape(p: torch.Tensor) -> tuple[int, ...]:
    """The shape of ``p``'s scales: one per block of ``p`` flattened, or for a DTensor (and its
    shard) a row per row of ``p``, so that they shard as ``p`` does."""
    if getattr(p, SHARDED, None):
        return (p.shape[0], math.prod(p.shape[1:]) // BLOCK)
    return (p.numel() // BLOCK,)


def encode(x: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (``uint8``, shaped as ``x``) and scales (FP32, ``[blocks, 1]``) of FP32 ``x``
    (``[blocks, BLOCK]``; non-negative unless ``signed``). A zero block has scale 0; one holding
    inf or NaN a non-finite scale, so that it decodes to inf/NaN."""
    scale = x.abs().amax(dim=-1, keepdim=True)
    # (a zero block is divided by 1, not 0; a NaN ratio, in a non-finite block, gets code 0)
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
    """A whole buffer ``x`` (contiguous, a multiple of ``BLOCK`` elements) as state keeps it:
    codes shaped as ``x`` (4-bit: flat, packed) and flat scales."""
    if bits == 4:
        codes, scale = encode4(rows(x.float().reshape(-1), True), signed)
        return codes.view(-1), scale.view(-1)
    codes, scale = encode(x.float().reshape(-1, BLOCK), signed)
    return codes.view(x.shape), scale.view(-1)


def from_codes(codes: torch.Tensor, scale: torch.Tensor, signed: bool,
               shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """The FP32 values of a buffer kept as ``to_codes`` keeps it, shaped as ``codes`` or as
    ``shape`` (4-bit codes are flat); the width is read from the codes' number per scale."""
    scale = scale.reshape(-1).float()
    if codes.numel() != scale.numel() * BLOCK:  # (4-bit)
        out = decode4(rows(codes.reshape(-1), True, "codes"), rows(scale, True, "scale"), signed)
        return out.view(shape if shape is not None else (-1,))
    out = decode(codes.reshape(-1, BLOCK), scale.view(-1, 1), signed)
    return out.view(shape if shape is not None else codes.shape)


def new_state(value: float, p: torch.Tensor, signed: bool,
              bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and scales (shaped by ``scale_shape``) of a buffer of ``p``'s shape filled with
    ``value``: one block encoded and repeated (encoding every block took 7 s of a 124M-parameter
    model's first step)."""
    codes, scale = to_codes(torch.full((BLOCK,), float(value), device=p.device), signed, bits)
    blocks = p.numel() // BLOCK
    codes = codes.repeat(blocks)
    return (codes.view(p.shape) if bits == 8 else codes,
            scale.expand(blocks).clone().view(scale_shape(p)))


# ---------------------------------------------------------------------- 4-bit codes and formats
# A buffer's format: "s8"/"u8" (``encode``) or "s4"/"u4" (``encode4``); one width per parameter.


def fmt(signed: bool, bits: int) -> str:
    """The format of a buffer's codes (``"s8"``, ``"u8"``, ``"s4"``, ``"u4"``)."""
    return f"{'s' if signed else 'u'}{bits}"


def is_signed(f: str) -> bool:
    return f[0] == "s"


def four_bit(quantized: tuple[tuple[str, str], ...]) -> bool:
    """Whether ``qstate`` (``(name, format)`` pairs) keeps 4-bit codes."""
    return any(f[1:] == "4" for _, f in quantized)


def rows(t: torch.Tensor, four: bool, role: str = "values") -> torch.Tensor:
    """Flat ``t`` (whole blocks) as the coders take it: ``"values"`` and ``"codes"`` as
    ``[blocks, BLOCK]``, or 4-bit ``[blocks, 2, HALF]`` and packed ``[blocks, 1, HALF]``;
    ``"scale"`` as a column, ``[blocks, 1]`` (4-bit ``[blocks, 1, 1]``)."""
    if role == "scale":
        return t.view(-1, 1, 1) if four else t.view(-1, 1)
    if not four:
        return t.view(-1, BLOCK)
    return t.view(-1, 1, HALF) if role == "codes" else t.view(-1, 2, HALF)


def encode4(x: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed 4-bit codes (``uint8``, ``[blocks, 1, HALF]``: element ``j`` in the low half-byte,
    ``j + HALF`` in the high) and scales (FP32, ``[blocks, 1, 1]``) of FP32 ``x``
    (``[blocks, 2, HALF]``); zero and non-finite blocks as in ``encode``."""
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
    # (shift 0 for the first half, 4 for the second: elementwise, no concatenated temporary)
    shift = 4 * torch.arange(2, device=codes.device, dtype=torch.int32).view(2, 1)
    q = ((codes.to(torch.int32) >> shift) & 15).float()
    if signed:
        q = (q - 8) * (1 / _SIGNED4)
        return q * q.abs() * scale
    return (q + 1) * (1 / _UNSIGNED4) * scale


def encode_as(x: torch.Tensor, f: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``encode`` or ``encode4`` for format ``f`` (``x`` as ``rows`` gives it)."""
    return (encode4 if f[1:] == "4" else encode)(x, is_signed(f))


def decode_as(codes: torch.Tensor, scale: torch.Tensor, f: str) -> torch.Tensor:
    """``decode`` or ``decode4`` for format ``f`` (``codes`` and ``scale`` as ``rows`` gives
    them)."""
    return (decode4 if f[1:] == "4" else decode)(codes, scale, is_signed(f))


def codes_shape(p: torch.Tensor, bits: int) -> tuple[int, ...]:
    """The shape of ``p``'s codes: ``p``'s (8-bit), or flat, two per byte (4-bit)."""
    return tuple(p.shape) if bits == 8 else (p.numel() // 2,)


def element_bytes(bits: int) -> float:
    """Bytes per element of a buffer kept as codes of ``bits``: the code and its share of the
    block's FP32 scale."""
    return bits / 8 + 4 / BLOCK


def check_group(group: dict[str, Any], where: str) -> None:
    """Refuse DTensor parameters in a group under 4-bit state, naming the first (their packed
    codes would need placing as the parameter)."""
    if group.get("state_dtype") != FOUR_BIT:
        return
    for i, p in enumerate(group["params"]):
        if hasattr(p, "device_mesh") or getattr(p, SHARDED, None) is not None:
            raise ValueError(
                f"{where}, parameter {i}: state_dtype='4bit' does not support DTensor "
                "parameters (FSDP2's fully_shard, tensor parallelism) yet; use "
                "state_dtype='8bit', which keeps a sharded parameter's moments as 8-bit codes."
            )
