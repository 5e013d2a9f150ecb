"""DFP-16: dynamic fixed point with shared exponents, computed with exact integer arithmetic.

After Das et al., "Mixed Precision Training of Convolutional Neural Networks using Integer
Operations" (ICLR 2018): tensors are INT16 mantissas sharing one exponent, products are INT16 x
INT16 summed in INT32 over chunks short enough not to overflow, chunk sums are added in FP32, and
weights are FP32 masters. Everything here is exact emulation of that integer hardware, on any
device: the results are bit for bit what the integer kernels would produce, not FP32 simulations.

- ``tensor``: ``DFPTensor``, ``quantize`` (FP32 -> DFP), ``down_convert`` (DFP-32 -> DFP-16) and
  the one rounding right shift (``shift_right``) behind every conversion, with the rounding modes
  ``"nearest"``, ``"stochastic"``, ``"biased"`` and ``"floor"`` defined there.
- ``ops``: ``multiply``, ``add``, ``add_fp32`` and ``matmul`` (INT32 chunks, overflow management).
- ``layers``: ``DFPLinear``, ``DFPConv2d`` and ``convert_to_dfp`` for training.

See docs/dfp.md for the definitions, the overflow argument and measured errors.
"""

from lowprec.dfp.layers import DFPConv2d, DFPLinear, convert_to_dfp
from lowprec.dfp.ops import INT32_MAX, add, add_fp32, matmul, multiply, safe_chunk
from lowprec.dfp.tensor import (
    ROUNDING_MODES,
    ZERO_EXPONENT,
    DFPTensor,
    Rounding,
    down_convert,
    quantize,
    shared_exponent,
    shift_right,
)

__all__ = [
    "INT32_MAX",
    "ROUNDING_MODES",
    "ZERO_EXPONENT",
    "DFPConv2d",
    "DFPLinear",
    "DFPTensor",
    "Rounding",
    "add",
    "add_fp32",
    "convert_to_dfp",
    "down_convert",
    "matmul",
    "multiply",
    "quantize",
    "safe_chunk",
    "shared_exponent",
    "shift_right",
]
