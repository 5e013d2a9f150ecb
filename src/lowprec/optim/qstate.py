"""8-bit optimizer state: moments kept as one byte per element with a scale per block.

``state_dtype="8bit"`` keeps each of an update rule's buffers (AdamW's moments, SGD's momentum,
Adagrad's sum, LAMB's moments) for a parameter of at least ``MIN_NUMEL`` elements, a multiple
of ``BLOCK``, as

* ``state[name]``: ``uint8`` codes shaped as the parameter, and
* ``state[name + "_scale"]``: FP32, one per ``BLOCK`` consecutive elements of the flattened
  parameter: the block's largest magnitude over ``MAX_CODE_VALUE``,

so a moment costs 1 + 4 / ``BLOCK`` bytes per element instead of 2 (BF16) or 4 (FP32). Smaller
parameters (biases, norms) and those of another size keep FP32 state, as bitsandbytes' and
torchao's 8-bit optimizers do: they are a small part of a model's bytes and the most sensitive.

A code is a small float with 3 mantissa bits, scaled per block so that the block's largest
magnitude is the format's largest value (1.875), with subnormals below the smallest normal:

* signed buffers (a first moment, a momentum): sign, 4 exponent bits, 3 mantissa bits;
  magnitudes from 1.875 down to 2**-17 (7.6e-6) of the scale, relative error at most 1/16;
* non-negative buffers (a second moment, Adagrad's sum): 5 exponent bits, 3 mantissa bits;
  from 1.875 down to 2**-33 (1.2e-10) of the scale, the same relative error. A second moment
  spans the square of the gradients' range, so it needs the range more than a first moment;
  a second moment rounded to zero would divide an update by ``eps`` alone.

The format was chosen by measurement against linear 8-bit codes and the dynamic (tree) map of
Dettmers et al. 2022 (``benchmarks/state_formats.py``; the numbers are in docs/architecture.md).
Rounding is to nearest, by integer operations on the FP32 bits, so that the eager and the
compiled step (Inductor) give the same bits and vectorize; ``encode``/``decode`` work on
``[blocks, BLOCK]`` tensors (``decode`` on anything whose last dimension is a block).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["BLOCK", "EIGHT_BIT", "MAX_CODE_VALUE", "MIN_NUMEL", "decode", "encode", "qualifies"]

#: The ``state_dtype`` value that asks for 8-bit state.
EIGHT_BIT = "8bit"
#: Elements per block: each block has its own scale.
BLOCK = 256
#: Parameters smaller than this keep FP32 state.
MIN_NUMEL = 4096
#: The largest value of a code: the block's largest magnitude is stored as this.
MAX_CODE_VALUE = 1.875

# Exponent bits of the magnitude: 4 for signed codes (bit 7 is the sign), 5 for non-negative.
_EXPONENT_BITS = {True: 4, False: 5}


def qualifies(p: torch.Tensor) -> bool:
    """Whether parameter ``p`` gets 8-bit state under ``state_dtype="8bit"``."""
    n = p.numel()
    return n >= MIN_NUMEL and n % BLOCK == 0


def _magnitude_code(y: torch.Tensor, exponent_bits: int) -> torch.Tensor:
    """``y`` (FP32, in ``[0, MAX_CODE_VALUE]``) rounded to nearest (ties to even) as the code of
    a float with ``exponent_bits`` and 3 mantissa bits, exponent bias ``2**exponent_bits - 1``
    (int32 codes, 0 .. ``2**(exponent_bits + 3) - 1``)."""
    bias = (1 << exponent_bits) - 1
    top = (1 << (exponent_bits + 3)) - 1
    # Subnormals (below 2**(1 - bias)): multiples of 2**(-bias - 2), the code itself (0 .. 8;
    # 8 is the smallest normal's code). torch.round rounds half to even.
    sub = torch.round(y * 2.0 ** (bias + 2)).to(torch.int32)
    # Normals: the FP32 bits rounded to 3 mantissa bits (half to even: + 0x7FFFF + the lowest
    # kept bit), whose exponent and mantissa fields then are the code, less the exponent offset.
    bits = y.view(torch.int32)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - ((127 - bias) << 3)
    code = torch.where(y < 2.0 ** (1 - bias), sub, normal)
    return code.clamp(0, top)


def _magnitude_value(code: torch.Tensor, exponent_bits: int) -> torch.Tensor:
    """The FP32 value of magnitude codes (int32): the inverse of ``_magnitude_code``."""
    bias = (1 << exponent_bits) - 1
    normal = ((code + ((127 - bias) << 3)) << 20).view(torch.float32)
    return torch.where(code < 8, code.float() * 2.0 ** (-bias - 2), normal)


def encode(x: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (``uint8``, shaped as ``x``) and scales (FP32, ``[blocks, 1]``) of FP32 ``x``
    (``[blocks, BLOCK]``). A block of zeros has scale 0; a block holding inf or NaN gets a
    non-finite scale, so that it decodes to inf/NaN rather than to finite numbers."""
    mag = x.abs()
    scale = mag.amax(dim=-1, keepdim=True) / MAX_CODE_VALUE
    # (0 / 0 would be NaN: a zero block's values are zeros, divided by 1)
    y = mag / torch.where(scale > 0, scale, torch.ones_like(scale))
    eb = _EXPONENT_BITS[signed]
    code = _magnitude_code(torch.where(torch.isnan(y), torch.zeros_like(y), y), eb)
    if signed:
        code = code | (x < 0).to(torch.int32) << 7
    return code.to(torch.uint8), scale


def decode(codes: torch.Tensor, scale: torch.Tensor, signed: bool) -> torch.Tensor:
    """FP32 values of ``codes`` (``uint8``, ``[..., BLOCK]``) with their blocks' ``scale``
    (``[..., 1]``)."""
    c = codes.to(torch.int32)
    if not signed:
        return _magnitude_value(c, _EXPONENT_BITS[False]) * scale
    mag = _magnitude_value(c & 0x7F, _EXPONENT_BITS[True]) * scale
    return torch.where(c >= 0x80, -mag, mag)


def new_state(value: float, p: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and scales (flat, ``[numel / BLOCK]``) of a buffer of ``p``'s shape filled with
    ``value``."""
    n = p.numel()
    x = torch.full((n // BLOCK, BLOCK), float(value), device=p.device)
    codes, scale = encode(x, signed)
    return codes.view(p.shape), scale.view(-1)


def expected(p: torch.Tensor) -> dict[str, Any]:
    """Shape and dtype of a quantized buffer's two tensors for ``p``."""
    return {"codes": (tuple(p.shape), torch.uint8), "scale": ((p.numel() // BLOCK,), torch.float32)}
