"""Quantizing to a block format: a scale per block, then each element rounded to its grid.

``quantize`` returns the elements (their values, in FP32) and the scales; ``fake_quantize``
returns what the format represents, in FP32 (``elements * scale``), for emulated GEMMs. Both
follow the order of operations of torchao's ``mx_formats`` (``MXTensor``, ``nvfp4_quantize``), so
their encodings are bit for bit the same for every element type torchao has (tests/
test_blockfmt.py), and they add what torchao lacks:

- **Stochastic rounding** of the elements (``rounding="stochastic"``): a value between two
  grid points goes up with probability equal to its distance from the lower one, so the
  expected value is exact.
- **MXINT8** (integers times ``2**-6`` under an E8M0 scale).
- **Any dimension** (``dim``): the block runs along a GEMM's reduction dimension, whichever it
  is; a length that is not a multiple of the block is padded with zeros (which change no
  block's largest magnitude) and the padding dropped.
- **2D tiles** (``tile=True``, NVFP4's 16 x 16 weight blocks): one scale per square tile of a
  matrix, so the matrix and its transpose quantize to the same values.

One element rule serves every element format: ``|x|`` is saturated at the format's largest value;
with ``e`` the exponent of ``|x|`` (read from its bits), at least the format's smallest normal
exponent, the grid spacing is ``2**(e - mbits)``; ``|x|`` divided by it (exact: a power of two)
is rounded to an integer and multiplied back. MXINT8's spacing is ``2**-6`` throughout.
"""

from __future__ import annotations

import math
import types
import warnings
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import torch
import torch.nn.functional as F

from lowprec.blockfmt.formats import SCALE_RULES, BlockFormat, ElementFormat, ScaleRule, get_format

__all__ = ["ROUNDINGS", "Quantized", "fake_quantize", "quantize", "round_to_element"]

#: Element roundings: ``"nearest"`` (to nearest, ties to even) and ``"stochastic"``.
ROUNDINGS: tuple[str, ...] = ("nearest", "stochastic")
ElementRounding = Literal["nearest", "stochastic"]

_F32_MIN_NORMAL = 2.0**-126
_E4M3_TINY = 2.0**-6  # FP8 E4M3's smallest normal: NVFP4's smallest block scale
_E4M3_MAX = 448.0


class Quantized(NamedTuple):
    """A tensor in a block format.

    Attributes:
        elements: The elements' values (on the element format's grid), FP32, in the input's
            shape.
        scales: One FP32 scale per block, in the input's shape with the block dimension
            (``dim``) divided by the block size, rounded up (for tiles, both dimensions). For MX
            formats a power of two (NaN for a block that held a NaN); for NVFP4 the E4M3 scale.
        tensor_scale: NVFP4's FP32 per-tensor scale (a 0-dim tensor), or None.
        dim: The dimension the blocks run along.
        fmt: The format.
        tile: Whether blocks are square tiles of the last two dimensions.
    """

    elements: torch.Tensor
    scales: torch.Tensor
    tensor_scale: torch.Tensor | None
    dim: int
    fmt: BlockFormat
    tile: bool

    def dequantize(self) -> torch.Tensor:
        """The represented values, FP32: each element times its block's scale (times the
        tensor scale)."""
        scales = self.scales if self.tensor_scale is None else self.tensor_scale * self.scales
        b = self.fmt.block
        if self.tile:
            full = scales.repeat_interleave(b, -2).repeat_interleave(b, -1)
            full = full[..., : self.elements.shape[-2], : self.elements.shape[-1]]
        else:
            full = scales.repeat_interleave(b, self.dim).narrow(
                self.dim, 0, self.elements.shape[self.dim])
        return self.elements * full


def round_to_element(
    x: torch.Tensor,
    element: ElementFormat,
    rounding: ElementRounding = "nearest",
    noise: torch.Tensor | None = None,
) -> torch.Tensor:
    """FP32 values rounded to an element format's grid, saturating at its largest value.

    Args:
        x: FP32 values (already divided by their block's scale).
        element: The element format.
        rounding: ``"nearest"`` (ties to even) or ``"stochastic"`` (default: ``"nearest"``).
        noise: For ``"stochastic"``: uniform draws in [0, 1) of ``x``'s shape (default: None,
            drawn from torch's default generator).

    Returns:
        The rounded values, FP32; NaN stays NaN, and the sign of zero is kept.
    """
    a = torch.clamp(x.abs(), max=element.max)  # (max is on the grid: the same as after)
    exponent = ((a.view(torch.int32) >> 23) & 0xFF) - 127  # |x| = m * 2**exponent, 1 <= m < 2
    if element.integer:
        exponent = torch.full_like(exponent, element.emin)
    else:
        exponent = torch.clamp(exponent, min=element.emin)
    # The grid's spacing there, a power of two built from its bits (a normal FP32 number for
    # every element format), so that |x| / spacing is exact.
    spacing = ((exponent - element.mbits + 127) << 23).view(torch.float32)
    steps = a / spacing
    if rounding == "nearest":
        steps = torch.round(steps)  # (half to even)
    else:
        if noise is None:
            noise = torch.rand(x.shape, device=x.device)
        low = torch.floor(steps)
        # Up with probability equal to the fraction: u >= 1 - f (both exact in FP32).
        steps = low + (noise >= 1 - (steps - low)).to(steps.dtype)
    q = steps * spacing
    return torch.copysign(q, x)


def _e8m0(amax: torch.Tensor, element: ElementFormat, rule: ScaleRule) -> torch.Tensor:
    """MX scales as biased E8M0 codes (int32, 0-255, 255 = NaN) from blocks' largest
    magnitudes (FP32), by ``rule``; the bit operations torchao's ``to_mx`` uses."""
    nan = torch.isnan(amax)
    if rule == "rceil":
        descale = amax / element.max
        code = torch.clamp(torch.ceil(torch.log2(descale)), min=-127, max=127) + 127
        code = torch.where(torch.isinf(descale), 254, code.to(torch.int32))
        return torch.where(nan, 255, code)
    if rule == "even":  # round |max| to the element's mantissa first
        bits = amax.view(torch.int32)
        bits = (bits + (1 << (23 - element.mbits - 1))) & -(1 << 23)  # (sign and exponent)
        amax = torch.where(nan, amax, bits.view(torch.float32))
    bits = amax.view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) - 127
    if rule == "ceil":
        exponent = exponent + ((bits & 0x7FFFFF) > 0).to(torch.int32)
    code = torch.clamp(exponent - element.emax, min=-127, max=128) + 127
    return torch.where(nan, 255, code)


def _e8m0_value(code: torch.Tensor) -> torch.Tensor:
    """The FP32 value of biased E8M0 codes: ``2**(code - 127)``, NaN for 255."""
    value = torch.exp2(code.to(torch.float32) - 127)
    return torch.where(code == 255, float("nan"), value)


def _quantize_blocks(
    xb: torch.Tensor,
    fmt: BlockFormat,
    rounding: ElementRounding,
    rule: ScaleRule,
    noise: torch.Tensor | None,
    two_level: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``xb``: FP32 blocks along the last dimension. Returns the elements, each block's scale
    (a trailing dimension of 1) and the tensor scale."""
    amax = torch.amax(xb.abs(), dim=-1, keepdim=True)
    element = fmt.element
    tensor_scale = None
    if fmt.scale == "e8m0":
        code = _e8m0(amax, element, rule)
        if rule == "rceil":
            reciprocal = torch.where(code == 0, 1.0, torch.exp2(127 - code.to(torch.float32)))
            scaled = xb * torch.where(code == 255, amax / element.max, reciprocal)
        else:
            divisor = torch.clamp((code << 23).view(torch.float32), min=_F32_MIN_NORMAL)
            scaled = xb / divisor
        scales = _e8m0_value(code)
    else:  # NVFP4: an E4M3 scale per block, under an FP32 scale per tensor
        block_scale = amax / element.max
        if two_level:
            total = torch.amax(amax)
            tensor_scale = total / (_E4M3_MAX * element.max)
            # (an all-zero tensor: any scale represents it; 1 keeps the divisions finite)
            tensor_scale = torch.where(tensor_scale == 0, 1.0, tensor_scale)
            block_scale = block_scale / tensor_scale
        scales = torch.clamp(block_scale, min=_E4M3_TINY, max=_E4M3_MAX)
        scales = scales.to(torch.float8_e4m3fn).to(torch.float32)
        reciprocal = 1.0 / scales if tensor_scale is None else (1.0 / tensor_scale) / scales
        scaled = xb * reciprocal
    scaled = torch.clamp(scaled, min=-element.max, max=element.max)
    return round_to_element(scaled, element, rounding, noise), scales, tensor_scale


def _check(x: object, fn: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn}() takes a tensor, got {type(x).__name__}.")
    if not x.is_floating_point():
        raise TypeError(
            f"{fn}() quantizes floating-point tensors, got {x.dtype}; convert it first "
            "(x.float())."
        )
    return x


def _options(rounding: str, scale_rule: str, fn: str) -> None:
    if rounding not in ROUNDINGS:
        raise ValueError(
            f"{fn}(): rounding must be one of {', '.join(map(repr, ROUNDINGS))}, got "
            f"{rounding!r}."
        )
    if scale_rule not in SCALE_RULES:
        raise ValueError(
            f"{fn}(): scale_rule must be one of {', '.join(map(repr, SCALE_RULES))}, got "
            f"{scale_rule!r}."
        )


def _pad_to(x: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    extra = -x.shape[dim] % multiple
    if extra == 0:
        return x
    pad = [0, 0] * (x.dim() - 1 - dim % x.dim()) + [0, extra]
    return F.pad(x, pad)


class _Blocked(NamedTuple):
    """``x`` (FP32) as blocks along the last dimension, and how to undo it."""

    blocks: torch.Tensor
    x_shape: torch.Size
    padded: torch.Size
    dim: int
    tile: bool

    def unblock(self, t: torch.Tensor) -> torch.Tensor:
        """A tensor of the blocks' shape back in ``x``'s shape (the padding dropped)."""
        b = t.shape[-1]
        if self.tile:
            b = math.isqrt(b)
            lead, (r, c) = self.padded[:-2], self.blocks.shape[-3:-1]
            t = t.reshape(*lead, r, c, b, b).transpose(-3, -2).reshape(self.padded)
            return t[..., : self.x_shape[-2], : self.x_shape[-1]]
        t = t.reshape(self.padded)[..., : self.x_shape[self.dim]]
        return t.movedim(-1, self.dim)


def _block(x: torch.Tensor, b: int, dim: int, tile: bool) -> _Blocked:
    xf = x.to(torch.float32)
    if tile:
        if x.dim() < 2:
            raise ValueError(
                f"quantize(tile=True) scales square tiles of a matrix; got a {x.dim()}-D "
                "tensor (use blocks along a dimension: tile=False)."
            )
        xp = _pad_to(_pad_to(xf, -1, b), -2, b)
        lead, r, c = xp.shape[:-2], xp.shape[-2] // b, xp.shape[-1] // b
        xb = xp.reshape(*lead, r, b, c, b).transpose(-3, -2).reshape(*lead, r, c, b * b)
        return _Blocked(xb, x.shape, xp.shape, x.dim() - 1, True)
    dim = dim % x.dim() if x.dim() else 0
    xp = _pad_to(xf.movedim(dim, -1), -1, b)
    xb = xp.reshape(*xp.shape[:-1], xp.shape[-1] // b, b)
    return _Blocked(xb, x.shape, xp.shape, dim, False)


def _run(
    x: torch.Tensor,
    fmt: str | BlockFormat,
    dim: int,
    rounding: ElementRounding,
    scale_rule: ScaleRule,
    tile: bool,
    tensor_scale: bool,
    generator: torch.Generator | None,
    fn: str,
) -> tuple[_Blocked, torch.Tensor, torch.Tensor, torch.Tensor | None, BlockFormat]:
    fmt = get_format(fmt)
    _check(x, fn)
    _options(rounding, scale_rule, fn)
    blocked = _block(x, fmt.block, dim, tile)
    noise = None
    if rounding == "stochastic":
        noise = torch.rand(blocked.blocks.shape, generator=generator, device=x.device)
    elements, scales, ts = _quantize_blocks(
        blocked.blocks, fmt, rounding, scale_rule, noise, tensor_scale)
    return blocked, elements, scales, ts, fmt


def quantize(
    x: torch.Tensor,
    fmt: str | BlockFormat,
    *,
    dim: int = -1,
    rounding: ElementRounding = "nearest",
    scale_rule: ScaleRule = "floor",
    tile: bool = False,
    tensor_scale: bool = True,
    generator: torch.Generator | None = None,
) -> Quantized:
    """Quantize ``x`` to a block format, blocks along ``dim`` (or square tiles).

    Args:
        x: A floating-point tensor.
        fmt: A name in ``BLOCK_FORMATS`` (``"mxfp8"``, ``"nvfp4"``, ...) or a ``BlockFormat``.
        dim: The dimension the blocks run along: a GEMM's reduction dimension (default: -1).
            A length that is not a multiple of the block is padded with zeros.
        rounding: The elements' rounding: ``"nearest"`` (ties to even) or ``"stochastic"``
            (default: ``"nearest"``).
        scale_rule: How an MX block's power-of-two scale is chosen: ``"floor"`` (the OCP
            spec's), ``"ceil"``, ``"even"`` or ``"rceil"`` (see ``SCALE_RULES``); NVFP4 ignores
            it (default: ``"floor"``).
        tile: One scale per ``block x block`` tile of the last two dimensions (NVFP4's 2D
            weight scaling) instead of blocks along ``dim`` (default: False).
        tensor_scale: For NVFP4: an FP32 per-tensor scale under the E4M3 block scales, as
            NVIDIA's recipe has; False for block scales alone (default: True).
        generator: The generator of stochastic rounding's draws (default: None, torch's
            default generator).

    Returns:
        The elements and scales (``Quantized``; ``.dequantize()`` gives the values).

    Raises:
        TypeError: ``x`` is not a floating-point tensor.
        ValueError: An unknown format, rounding or scale rule, or ``tile`` on a tensor of
            fewer than two dimensions.

    Examples:
        >>> import torch
        >>> from lowprec import blockfmt
        >>> q = blockfmt.quantize(torch.tensor([[0.3, -1.7, 5.0, 100.0]]), "mxfp8")
        >>> q.elements, q.scales  # 2**(6 - 8): 100's power of two less E4M3's largest
        (tensor([[  1.2500,  -7.0000,  20.0000, 384.0000]]), tensor([[0.2500]]))
        >>> q.dequantize()
        tensor([[ 0.3125, -1.7500,  5.0000, 96.0000]])
    """
    blocked, elements, scales, ts, fmt = _run(
        x, fmt, dim, rounding, scale_rule, tile, tensor_scale, generator, "quantize")
    scales = scales.squeeze(-1)
    if not tile:
        scales = scales.movedim(-1, blocked.dim)
    return Quantized(blocked.unblock(elements), scales, ts, blocked.dim, fmt, tile)


def fake_quantize(
    x: torch.Tensor,
    fmt: str | BlockFormat,
    *,
    dim: int = -1,
    rounding: ElementRounding = "nearest",
    scale_rule: ScaleRule = "floor",
    tile: bool = False,
    tensor_scale: bool = True,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """The values ``x`` has in a block format, FP32 (quantized, then dequantized).

    Takes ``quantize``'s arguments (``dim``, ``rounding``, ``scale_rule``, ``tile``,
    ``tensor_scale``, ``generator``), with its defaults.

    Args:
        x: A floating-point tensor.
        fmt: A name in ``BLOCK_FORMATS`` or a ``BlockFormat``.
        dim: The dimension the blocks run along (default: -1).
        rounding: ``"nearest"`` or ``"stochastic"`` (default: ``"nearest"``).
        scale_rule: The MX scale rule (default: ``"floor"``).
        tile: Square tiles of the last two dimensions (default: False).
        tensor_scale: NVFP4's per-tensor scale (default: True).
        generator: Stochastic rounding's generator (default: None).

    Returns:
        An FP32 tensor of ``x``'s shape.
    """
    blocked, elements, scales, ts, _ = _run(
        x, fmt, dim, rounding, scale_rule, tile, tensor_scale, generator, "fake_quantize")
    return blocked.unblock(elements * (scales if ts is None else ts * scales))


def _fake(
    x: torch.Tensor,
    noise: torch.Tensor | None,
    fmt: BlockFormat,
    rounding: ElementRounding,
    rule: ScaleRule,
    two_level: bool,
    dim: int,
    tile: bool,
) -> torch.Tensor:
    """``fake_quantize`` without its checks, with the draws of stochastic rounding given in
    ``x``'s shape: the function ``fast_fake_quantize`` compiles (the cast, the blocking and
    its undoing fuse with the per-element work)."""
    blocked = _block(x, fmt.block, dim, tile)
    nb = None if noise is None else _block(noise, fmt.block, dim, tile).blocks
    elements, scales, ts = _quantize_blocks(blocked.blocks, fmt, rounding, rule, nb, two_level)
    return blocked.unblock(elements * (scales if ts is None else ts * scales))


_KERNELS: dict[tuple[Any, ...], Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]] = {}
_FAILED: set[tuple[Any, ...]] = set()


def _variant(key: tuple[Any, ...]) -> Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]:
    """``_fake`` of one variant (``fast_fake_quantize``'s key: format, rounding, scale rule,
    tensor scale, dimension, tiles, output dtype, device type), its settings bound in a
    closure: compiled, they are constants (``_kernel`` compiles without ``dynamic=True``, and
    the call marks only the tensors' sizes dynamic). As arguments under ``dynamic=True`` the block size and the format's exponents
    became symbols, and a 1024 x 1024 MXFP8 operand took 1.6-7.3 ms instead of 0.65-1.3 on a
    2-core Zen 5 (its BF16-output loop scalar)."""
    fmt, rounding, rule, two_level, dim, tile, dtype, _ = key

    def kernel(x: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
        return _fake(x, noise, fmt, rounding, rule, two_level, dim, tile).to(dtype)

    return kernel


def _kernel(key: tuple[Any, ...]) -> Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]:
    """The compiled ``_variant`` of one key. Each variant compiles its own copy of the code,
    so that Dynamo keeps a cache (and a recompile budget) per variant; the caller marks the
    sizes dynamic, so that one kernel serves every layer's operands."""
    kernel = _KERNELS.get(key)
    if kernel is None:
        from lowprec.numerics import COMPILED_AS_EAGER

        label = "lowprec_blockfmt_" + "_".join(
            str(getattr(k, "name", k)).replace("-", "_").replace(".", "_") for k in key)
        fn = _variant(key)
        code = fn.__code__.replace(co_name=label)
        copy = types.FunctionType(code, fn.__globals__, label, None, fn.__closure__)
        kernel = torch.compile(copy, options=dict(COMPILED_AS_EAGER))
        _KERNELS[key] = kernel
    return kernel


def fast_fake_quantize(
    x: torch.Tensor,
    fmt: BlockFormat,
    *,
    dim: int,
    rounding: ElementRounding = "nearest",
    scale_rule: ScaleRule = "floor",
    tile: bool = False,
    tensor_scale: bool = True,
    compiled: bool = True,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``fake_quantize`` with the per-element work in one ``torch.compile``d kernel per
    variant (format, rounding, rule, ...), the same bits (tests/test_blockfmt.py); where
    compiling fails it warns once and stays eager. The values come out in ``dtype``: BF16 holds
    every value of a format without a tensor scale exactly (at most 8 significant bits, FP32's
    exponents), down to BF16's smallest subnormal, 2**-133. For ``BlockLinear``'s GEMMs: no
    checks of the arguments, which the layer made."""
    if type(x) is not torch.Tensor:  # (a Parameter would compile a kernel of its own)
        x = x.detach()
    if tile:
        dim = -1  # (tiles ignore it: one kernel serves the forward and the backward GEMM)
    noise = torch.rand(x.shape, device=x.device) if rounding == "stochastic" else None
    key = (fmt, rounding, scale_rule, tensor_scale, dim, tile, dtype, x.device.type)
    if compiled and key not in _FAILED:
        try:
            for t in (x,) if noise is None else (x, noise):
                for d in range(t.dim()):  # (one kernel serves every layer's operands)
                    torch._dynamo.maybe_mark_dynamic(t, d)
            return _kernel(key)(x, noise)
        except Exception as error:  # (a failed compile falls back, never crashes)
            _FAILED.add(key)
            warnings.warn(
                f"lowprec: the block-format quantizer did not compile ({type(error).__name__}: "
                f"{error}); {fmt.name} GEMMs quantize eagerly, with the same results, more "
                "slowly.", RuntimeWarning, stacklevel=2)
    return _fake(x, noise, fmt, rounding, scale_rule, tensor_scale, dim, tile).to(dtype)
