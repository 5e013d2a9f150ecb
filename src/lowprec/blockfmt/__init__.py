"""Block formats: MX (OCP Microscaling v1.0) and NVFP4, quantized and used in emulated GEMMs.

DFP-16 (``lowprec.dfp``) shares one exponent across a tensor; its successors share a scale per
small block: the MX formats (blocks of 32 with a power-of-two E8M0 scale; FP8, FP6, FP4 or INT8
elements) and NVIDIA's NVFP4 (blocks of 16 FP4 elements with an FP8 E4M3 scale and an FP32
per-tensor scale).

- ``formats``: the element and block formats (``BLOCK_FORMATS``) and the MX scale rules.
- ``quantizer``: ``quantize`` (elements and scales), ``fake_quantize`` (the values, FP32).
- ``linear``: ``BlockLinear`` (its three GEMMs from block-format operands, multiplied in FP32),
  ``BlockGemms`` (the per-GEMM choices) and ``convert_to_blocks`` for training.

See docs/block-formats.md for the definitions, the recipes and the measurements.
"""

from lowprec.blockfmt.formats import (
    BLOCK_FORMATS,
    ELEMENTS,
    SCALE_RULES,
    BlockFormat,
    ElementFormat,
    get_format,
)
from lowprec.blockfmt.linear import (
    BlockGemms,
    BlockLinear,
    convert_to_blocks,
    edge_linears,
    hadamard_matrix,
)
from lowprec.blockfmt.quantizer import (
    ROUNDINGS,
    Quantized,
    fake_quantize,
    quantize,
    round_to_element,
)

__all__ = [
    "BLOCK_FORMATS",
    "ELEMENTS",
    "ROUNDINGS",
    "SCALE_RULES",
    "BlockFormat",
    "BlockGemms",
    "BlockLinear",
    "ElementFormat",
    "Quantized",
    "convert_to_blocks",
    "edge_linears",
    "fake_quantize",
    "get_format",
    "hadamard_matrix",
    "quantize",
    "round_to_element",
]
