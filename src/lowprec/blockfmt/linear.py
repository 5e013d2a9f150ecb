"""Linear layers whose three GEMMs take block-format operands, multiplied in FP32.

A linear layer ``y = x W^T`` runs three GEMMs in training, each reducing over another dimension:

| GEMM | product | reduction | blocks of |
|---|---|---|---|
| forward | ``y = x W^T`` | in_features | ``x`` along its rows, ``W`` along its rows |
| input gradient | ``dx = dy W`` | out_features | ``dy`` along its rows, ``W`` along its columns |
| weight gradient | ``dW = dy^T x`` | the tokens | ``dy`` and ``x`` along their columns |

``BlockLinear`` quantizes each GEMM's two operands to a block format along that GEMM's reduction
dimension, as block-format hardware needs them, and multiplies the values in FP32, as the
hardware accumulates. The quantized operands live only for their GEMM: backward quantizes again
from the saved input and weight (what ``nn.Linear`` saves too). ``BlockGemms`` holds the
per-GEMM choices of the published recipes:

- ``weight_tiles``: 16 x 16 tiles for the weight (NVFP4's 2D scaling), so the forward and the
  input-gradient GEMM see the same quantized weight.
- ``grad_rounding="stochastic"``: the output gradient rounded stochastically (both backward
  GEMMs), so small gradients survive on average.
- ``hadamard``: a random Hadamard transform of the weight-gradient GEMM's inputs along the
  tokens, 16 at a time (an orthogonal change of basis that cancels in the product and spreads
  outliers over their block).

The bias is added, and its gradient summed, in FP32.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from lowprec._swap import swap_layers
from lowprec.blockfmt.formats import SCALE_RULES, BlockFormat, ScaleRule, get_format
from lowprec.blockfmt.quantizer import ROUNDINGS, ElementRounding
from lowprec.blockfmt.quantizer import fast_fake_quantize as _fq
from lowprec.products import bf16_products_in_fp32

__all__ = [
    "BlockGemms", "BlockLinear", "convert_to_blocks", "edge_linears", "hadamard_matrix",
]

_HADAMARD = 16


@dataclass(frozen=True)
class BlockGemms:
    """How a ``BlockLinear``'s three GEMMs quantize their operands.

    Attributes:
        fmt: The block format's name (``"mxfp8"``, ``"mxfp4"``, ``"nvfp4"``, ...).
        scale_rule: The MX scale rule (``"floor"``, ``"ceil"``, ``"even"``, ``"rceil"``)
            (default: ``"floor"``).
        weight_tiles: Scale the weight in square tiles (NVFP4's 16 x 16) (default: False).
        grad_rounding: Rounding of the output gradient in both backward GEMMs: ``"nearest"``
            or ``"stochastic"`` (default: ``"nearest"``).
        hadamard: A random Hadamard transform (16 x 16, random signs) of the weight-gradient
            GEMM's inputs along the tokens (default: False).
        seed: Seed of the Hadamard transform's signs (default: 0).
        compiled: Quantize with ``torch.compile``d kernels (one per format and rounding,
            the same bits as eager; a failed compile warns and stays eager) (default: True).
    """

    fmt: str
    scale_rule: ScaleRule = "floor"
    weight_tiles: bool = False
    grad_rounding: ElementRounding = "nearest"
    hadamard: bool = False
    seed: int = 0
    compiled: bool = True

    def __post_init__(self) -> None:
        get_format(self.fmt)  # (an unknown name raises, naming the choices)
        if self.scale_rule not in SCALE_RULES:
            raise ValueError(
                f"scale_rule must be one of {', '.join(map(repr, SCALE_RULES))}, got "
                f"{self.scale_rule!r}."
            )
        if self.grad_rounding not in ROUNDINGS:
            raise ValueError(
                f"grad_rounding must be one of {', '.join(map(repr, ROUNDINGS))}, got "
                f"{self.grad_rounding!r}."
            )

    @property
    def format(self) -> BlockFormat:
        """The block format."""
        return get_format(self.fmt)


def hadamard_matrix(n: int = _HADAMARD, signs: torch.Tensor | None = None) -> torch.Tensor:
    """An orthonormal ``n x n`` Hadamard matrix (Sylvester's construction, divided by
    ``sqrt(n)``), its columns multiplied by ``signs`` where given.

    Args:
        n: The size, a power of two (default: 16).
        signs: ``n`` values of +1 or -1 (default: None, all +1).

    Returns:
        An FP32 matrix ``H`` with ``H @ H.T == I`` (to rounding).

    Raises:
        ValueError: ``n`` is not a power of two.
    """
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Hadamard matrix here has a power-of-two size, got {n}.")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    h = h / math.sqrt(n)
    return h if signs is None else h * signs.to(h.dtype)


def _rotate_tokens(t: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """``t`` (tokens x features) with each run of ``len(h)`` tokens multiplied by ``h``; the
    tokens padded with zeros to a multiple of it (zero rows add nothing to ``dy^T x``)."""
    n = h.shape[0]
    extra = -t.shape[0] % n
    if extra:
        t = F.pad(t, [0, 0, 0, extra])
    blocks = t.reshape(-1, n, t.shape[1])
    return torch.matmul(h.to(t.device), blocks).reshape(-1, t.shape[1])


def _signs(gemms: BlockGemms) -> torch.Tensor | None:
    """The Hadamard transform's random signs (fixed by ``gemms.seed``), or None without it."""
    if not gemms.hadamard:
        return None
    g = torch.Generator().manual_seed(gemms.seed)
    return torch.randint(0, 2, (_HADAMARD,), generator=g).float() * 2 - 1


def _gemm_dtype(fmt: BlockFormat, result: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype a GEMM's quantized operands are multiplied in: BF16 where its result is BF16,
    the format has no tensor scale (so BF16 holds its values exactly) and the CPU has a fast
    BF16 matmul (oneDNN's: exact products summed in FP32, rounded once to BF16, 4x an FP32
    GEMM on a Zen 5); FP32 elsewhere, the result rounded to its dtype after. (On a GPU, cuBLAS
    may reduce BF16 in BF16: FP32 there.)"""
    if (result == torch.bfloat16 and fmt.scale == "e8m0" and device.type == "cpu"
            and not bf16_products_in_fp32()):
        return torch.bfloat16
    return torch.float32


class _BlockLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        gemms: BlockGemms,
        signs: torch.Tensor | None,
    ) -> torch.Tensor:
        fmt, rule, tiles, c = gemms.format, gemms.scale_rule, gemms.weight_tiles, gemms.compiled
        x2 = x.reshape(-1, weight.shape[1])
        dt = _gemm_dtype(fmt, x.dtype, x.device)
        qx = _fq(x2, fmt, dim=1, scale_rule=rule, compiled=c, dtype=dt)
        qw = _fq(weight, fmt, dim=1, scale_rule=rule, tile=tiles, compiled=c, dtype=dt)
        y = F.linear(qx, qw, None if bias is None else bias.to(dt))
        ctx.save_for_backward(x, weight, signs)
        ctx.gemms = gemms
        ctx.has_bias = bias is not None
        return y.reshape(*x.shape[:-1], weight.shape[0]).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad_y: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, signs = ctx.saved_tensors
        gemms: BlockGemms = ctx.gemms
        fmt, rule, gr = gemms.format, gemms.scale_rule, gemms.grad_rounding
        tiles, c = gemms.weight_tiles, gemms.compiled
        gy = grad_y.reshape(-1, weight.shape[0])  # (the quantizer reads any float dtype)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            dt = _gemm_dtype(fmt, x.dtype, x.device)
            qg = _fq(gy, fmt, dim=1, rounding=gr, scale_rule=rule, compiled=c, dtype=dt)
            qw = _fq(weight, fmt, dim=0, scale_rule=rule, tile=tiles, compiled=c, dtype=dt)
            grad_x = (qg @ qw).reshape(x.shape).to(x.dtype)
        if ctx.needs_input_grad[1]:
            dt = _gemm_dtype(fmt, weight.dtype, weight.device)
            a, b = gy, x.reshape(-1, weight.shape[1])
            if gemms.hadamard:
                h = hadamard_matrix(_HADAMARD, signs)
                a, b = _rotate_tokens(a.float(), h), _rotate_tokens(b.float(), h)
            qa = _fq(a, fmt, dim=0, rounding=gr, scale_rule=rule, compiled=c, dtype=dt)
            qb = _fq(b, fmt, dim=0, scale_rule=rule, compiled=c, dtype=dt)
            grad_w = (qa.t() @ qb).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = gy.to(torch.float32).sum(0)
        return grad_x, grad_w, grad_b, None, None


class BlockLinear(nn.Linear):
    """``nn.Linear`` whose forward and backward GEMMs take block-format operands (emulated:
    quantized values multiplied in FP32).

    Args:
        in_features: Size of each input sample.
        out_features: Size of each output sample.
        bias: Learn an additive bias, applied in FP32 (default: True).
        device: Where to create the parameters (default: PyTorch's default device).
        dtype: Parameter dtype (default: PyTorch's default, float32).
        gemms: The GEMMs' format and choices (default: None, ``BlockGemms("mxfp8")``).

    The output has the input's dtype; the gradients have the input's and the weight's.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        gemms: BlockGemms | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias, device, dtype)
        self.gemms = BlockGemms("mxfp8") if gemms is None else gemms
        signs = _signs(self.gemms)
        if signs is not None and device is not None:
            signs = signs.to(device)
        self.register_buffer("hadamard_signs", signs, persistent=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, gemms: BlockGemms) -> BlockLinear:
        """A ``BlockLinear`` sharing ``linear``'s parameter objects (so an optimizer built on
        ``linear`` keeps updating it) and its training mode.

        Args:
            linear: The layer to compute with block-format GEMMs.
            gemms: The GEMMs' format and choices.
        """
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                  device="meta", gemms=gemms)
        new.weight = linear.weight
        new.bias = linear.bias
        signs = _signs(gemms)
        if signs is not None:
            new.hadamard_signs = signs.to(linear.weight.device)
        return new.train(linear.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ weight.T + bias`` from block-format operands, summed in FP32.

        Args:
            x: Input of shape ``(..., in_features)``, floating point.
        """
        if not x.is_floating_point():
            raise TypeError(f"BlockLinear takes a floating-point input, got {x.dtype}.")
        signs = cast(torch.Tensor | None, self.hadamard_signs)
        # (torch leaves Function.apply unannotated)
        return _BlockLinearFunction.apply(  # type: ignore[no-any-return,no-untyped-call]
            x, self.weight, self.bias, self.gemms, signs
        )

    def extra_repr(self) -> str:
        """The layer's settings, its GEMMs' included, for ``repr``."""
        return f"{super().extra_repr()}, gemms={self.gemms!r}"


def convert_to_blocks(
    model: nn.Module, gemms: BlockGemms, *, skip: Iterable[str] = ()
) -> nn.Module:
    """Swap every ``nn.Linear`` in ``model`` for a ``BlockLinear``, in place.

    The new layers share the old ones' parameter objects: weights, state dict keys and an
    optimizer built before the conversion all stay valid. Only modules whose type is exactly
    ``nn.Linear`` are swapped (as ``lowprec.dfp.convert_to_dfp`` does).

    Args:
        model: The model to convert.
        gemms: The GEMMs' format and choices.
        skip: Qualified module names (``model.named_modules()``'s) to leave as they are, with
            everything under them (default: none).

    Returns:
        ``model``, converted; or, when ``model`` is itself an ``nn.Linear``, its new version.

    Raises:
        ValueError: A ``skip`` name matches no module.
    """
    return swap_layers(model, (nn.Linear,),
                       lambda m: BlockLinear.from_linear(cast(nn.Linear, m), gemms), skip,
                       "convert_to_blocks")


def edge_linears(model: nn.Module) -> tuple[str, ...]:
    """The qualified names of the first and the last ``nn.Linear`` in ``model``'s module
    order (the layers the NVFP4 recipe keeps in higher precision here).

    Args:
        model: The model.

    Returns:
        The names (one, where the model has a single ``nn.Linear``; none without one).
    """
    names = [n for n, m in model.named_modules() if type(m) is nn.Linear]
    return tuple(dict.fromkeys(names[:1] + names[-1:]))
