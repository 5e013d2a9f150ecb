"""The block formats: element formats, their scales and the rules that choose a block's scale.

A block format stores a tensor as small blocks of low-precision elements that share one scale.
The OCP Microscaling formats (MX v1.0) use blocks of 32 and a power-of-two scale (E8M0: an
8-bit exponent, no mantissa); NVIDIA's NVFP4 uses blocks of 16 FP4 elements, an FP8 E4M3 scale
per block and one FP32 scale per tensor.

| name | element | block | block scale | largest element |
|---|---|---|---|---|
| ``mxfp8`` | FP8 E4M3 | 32 | E8M0 | 448 |
| ``mxfp8-e5m2`` | FP8 E5M2 | 32 | E8M0 | 57344 |
| ``mxfp6`` | FP6 E2M3 | 32 | E8M0 | 7.5 |
| ``mxfp6-e3m2`` | FP6 E3M2 | 32 | E8M0 | 28 |
| ``mxfp4`` | FP4 E2M1 | 32 | E8M0 | 6 |
| ``mxint8`` | INT8, implied scale 2**-6 | 32 | E8M0 | 127/64 |
| ``nvfp4`` | FP4 E2M1 | 16 | E4M3, times an FP32 per-tensor scale | 6 |
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "BLOCK_FORMATS",
    "ELEMENTS",
    "SCALE_RULES",
    "BlockFormat",
    "ElementFormat",
    "ScaleRule",
    "get_format",
]

#: The rules for an MX block's power-of-two scale, as torchao's ``ScaleCalculationMode`` names
#: them: ``"floor"`` (the OCP spec's: the block's largest magnitude's power of two, less the
#: element's largest power of two; the largest elements may saturate), ``"ceil"`` (rounded up:
#: nothing saturates), ``"even"`` (the largest magnitude first rounded to the element's
#: mantissa, then floor) and ``"rceil"`` (NVIDIA's cuBLAS rule: the largest magnitude over the
#: element's largest value, rounded up to a power of two).
SCALE_RULES: tuple[str, ...] = ("floor", "ceil", "even", "rceil")
ScaleRule = Literal["floor", "ceil", "even", "rceil"]


@dataclass(frozen=True)
class ElementFormat:
    """A block's element format: a small float (sign, exponent, mantissa) or a scaled integer.

    Attributes:
        name: Its short name (``"e4m3"``, ``"e2m1"``, ``"int8"``, ...).
        mbits: Mantissa bits (for ``int8``: the fraction bits of its implied scale, 6).
        emin: The exponent of the smallest normal value (its subnormals share it).
        max: The largest finite value; larger magnitudes saturate to it.
        integer: A scaled integer (every value a multiple of ``2**-mbits``) (default: False).
    """

    name: str
    mbits: int
    emin: int
    max: float
    integer: bool = False

    @property
    def emax(self) -> int:
        """The largest power of two at or below ``max`` (the OCP spec's ``emax_elem``)."""
        return math.floor(math.log2(self.max))

    @property
    def bits(self) -> int:
        """Bits per element, the sign included."""
        if self.integer:
            return 8
        return {"e4m3": 8, "e5m2": 8, "e2m3": 6, "e3m2": 6, "e2m1": 4}[self.name]


#: The element formats by name.
ELEMENTS: dict[str, ElementFormat] = {
    e.name: e for e in (
        ElementFormat("e4m3", mbits=3, emin=-6, max=448.0),
        ElementFormat("e5m2", mbits=2, emin=-14, max=57344.0),
        ElementFormat("e2m3", mbits=3, emin=0, max=7.5),
        ElementFormat("e3m2", mbits=2, emin=-2, max=28.0),
        ElementFormat("e2m1", mbits=1, emin=0, max=6.0),
        ElementFormat("int8", mbits=6, emin=0, max=127 / 64, integer=True),
    )
}


@dataclass(frozen=True)
class BlockFormat:
    """A block format: an element format, a block size and how a block's scale is stored.

    Attributes:
        name: The format's name (``"mxfp8"``, ``"nvfp4"``, ...).
        element: The element format.
        block: Elements per block along the quantized dimension.
        scale: ``"e8m0"`` (MX: a power of two) or ``"e4m3"`` (NVFP4: an FP8 E4M3 value under an
            FP32 per-tensor scale).
    """

    name: str
    element: ElementFormat
    block: int
    scale: Literal["e8m0", "e4m3"]

    @property
    def bits_per_element(self) -> float:
        """Storage bits per element, the shared scales included (NVFP4's per-tensor scale is
        not counted)."""
        return self.element.bits + 8 / self.block


#: The block formats by name.
BLOCK_FORMATS: dict[str, BlockFormat] = {
    f.name: f for f in (
        BlockFormat("mxfp8", ELEMENTS["e4m3"], 32, "e8m0"),
        BlockFormat("mxfp8-e5m2", ELEMENTS["e5m2"], 32, "e8m0"),
        BlockFormat("mxfp6", ELEMENTS["e2m3"], 32, "e8m0"),
        BlockFormat("mxfp6-e3m2", ELEMENTS["e3m2"], 32, "e8m0"),
        BlockFormat("mxfp4", ELEMENTS["e2m1"], 32, "e8m0"),
        BlockFormat("mxint8", ELEMENTS["int8"], 32, "e8m0"),
        BlockFormat("nvfp4", ELEMENTS["e2m1"], 16, "e4m3"),
    )
}


def get_format(fmt: str | BlockFormat) -> BlockFormat:
    """The block format of a name (a ``BlockFormat`` is returned as it is).

    Args:
        fmt: A name in ``BLOCK_FORMATS`` or a ``BlockFormat``.

    Returns:
        The format.

    Raises:
        ValueError: An unknown name.
        TypeError: Neither a name nor a ``BlockFormat``.
    """
    if isinstance(fmt, BlockFormat):
        return fmt
    if not isinstance(fmt, str):
        raise TypeError(f"a block format is a name or a BlockFormat, got {type(fmt).__name__}.")
    try:
        return BLOCK_FORMATS[fmt]
    except KeyError:
        raise ValueError(
            f"unknown block format {fmt!r}; choose one of {', '.join(BLOCK_FORMATS)}."
        ) from None
