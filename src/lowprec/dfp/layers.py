"""DFP-16 training layers: Linear and Conv2d whose products are INT16 x INT16 summed in INT32.

Each layer keeps its weight as an FP32 ``nn.Parameter``, the master copy that the optimizer updates
in FP32. Every forward quantizes the input and the weight to DFP-16 and computes the output with
``lowprec.dfp.matmul`` (INT32 chunks summed in FP32); the bias is added in FP32. Backward quantizes
the output gradient to DFP-16 and computes the input and weight gradients from it and from the
DFP-16 operands saved in forward (int16: half the memory of FP32 activations), with the same
integer matmul. The bias gradient is an FP32 sum. Convolution is an integer matmul over im2col
patches (``F.unfold`` of the int16 mantissas); in backward, ``F.fold`` sums the overlapping patch
gradients in FP32.

``rounding`` (forward: inputs and weights) and ``grad_rounding`` (backward: output gradients)
default to ``"nearest"``: deterministic, unbiased at ties, and the smallest error (half a unit of
the shared exponent, ``2**-15`` of the largest magnitude). ``"stochastic"`` is the choice when
small gradient elements, which keep fewer bits under the shared exponent, should stay unbiased;
it draws from PyTorch's default generator.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal, cast

import torch
import torch.nn.functional as F
from torch import nn

from lowprec._swap import swap_layers
from lowprec.dfp.ops import matmul
from lowprec.dfp.tensor import DFPTensor, Rounding, _check_rounding, quantize

__all__ = ["DFPConv2d", "DFPLinear", "convert_to_dfp"]

# (nn.Conv2d's own argument types)
_Size2 = int | tuple[int, int]
_PaddingMode = Literal["zeros", "reflect", "replicate", "circular"]


def _resolve_roundings(
    rounding: Rounding, grad_rounding: Rounding | None, fn: str
) -> tuple[Rounding, Rounding]:
    _check_rounding(rounding, fn)
    grad_rounding = rounding if grad_rounding is None else grad_rounding
    _check_rounding(grad_rounding, fn)
    return rounding, grad_rounding


# ---------------------------------------------------------------------------------------------
# Linear
# ---------------------------------------------------------------------------------------------


class _DFPLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        rounding: Rounding,
        grad_rounding: Rounding,
    ) -> torch.Tensor:
        out_features, in_features = weight.shape
        qx = quantize(x.reshape(-1, in_features), rounding=rounding)  # (M, K)
        qw = quantize(weight, rounding=rounding)  # (N, K)
        y = matmul(qx, DFPTensor(qw.mantissa.t(), qw.exponent))  # (M, N), FP32
        if bias is not None:
            y = y + bias.to(torch.float32)
        ctx.save_for_backward(qx.mantissa, qw.mantissa)
        ctx.exponents = (qx.exponent, qw.exponent)
        ctx.grad_rounding = grad_rounding
        ctx.x_meta = (x.shape, x.dtype)
        ctx.w_dtype = weight.dtype
        ctx.has_bias = bias is not None
        return y.reshape(*x.shape[:-1], out_features).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad_y: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        mx, mw = ctx.saved_tensors
        ex, ew = ctx.exponents
        x_shape, x_dtype = ctx.x_meta
        g = grad_y.reshape(-1, mw.shape[0])  # (M, N)
        qg = quantize(g, rounding=ctx.grad_rounding)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:  # (M, N) @ (N, K)
            grad_x = matmul(qg, DFPTensor(mw, ew)).reshape(x_shape).to(x_dtype)
        if ctx.needs_input_grad[1]:  # (N, M) @ (M, K)
            grad_w = matmul(DFPTensor(qg.mantissa.t(), qg.exponent), DFPTensor(mx, ex))
            grad_w = grad_w.to(ctx.w_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g.to(torch.float32).sum(0).to(ctx.w_dtype)
        return grad_x, grad_w, grad_b, None, None


class DFPLinear(nn.Linear):
    """``nn.Linear`` computed in DFP-16 with INT32 accumulation, with an FP32 master weight.

    Args:
        in_features: Size of each input sample.
        out_features: Size of each output sample.
        bias: Learn an additive bias, kept and applied in FP32 (default: True).
        device: Where to create the parameters (default: PyTorch's default device).
        dtype: Parameter dtype (default: PyTorch's default, float32).
        rounding: Rounding of inputs and weights to DFP-16 (default: ``"nearest"``).
        grad_rounding: Rounding of output gradients to DFP-16 (default: None, same as
            ``rounding``).

    The output has the input's dtype. Inputs must be float32, float16 or bfloat16 and finite.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        rounding: Rounding = "nearest",
        grad_rounding: Rounding | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias, device, dtype)
        self.rounding, self.grad_rounding = _resolve_roundings(rounding, grad_rounding, "DFPLinear")

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        *,
        rounding: Rounding = "nearest",
        grad_rounding: Rounding | None = None,
    ) -> DFPLinear:
        """A ``DFPLinear`` that shares ``linear``'s parameter objects (so an optimizer built on
        ``linear`` keeps updating it) and its training mode.

        Args:
            linear: The layer to compute in DFP-16.
            rounding: Rounding of inputs and weights (default: ``"nearest"``).
            grad_rounding: Rounding of output gradients (default: None, same as ``rounding``).
        """
        new = cls(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            device="meta",  # no allocation or init: the parameters are replaced just below
            rounding=rounding,
            grad_rounding=grad_rounding,
        )
        new.weight = linear.weight
        new.bias = linear.bias
        return new.train(linear.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ weight.T + bias`` from DFP-16 operands with INT32 sums.

        Args:
            x: Input of shape ``(..., in_features)``: float32, float16 or bfloat16, finite.
        """
        # (torch leaves Function.apply unannotated)
        return _DFPLinearFunction.apply(  # type: ignore[no-any-return,no-untyped-call]
            x, self.weight, self.bias, self.rounding, self.grad_rounding
        )

    def extra_repr(self) -> str:
        """The layer's settings, roundings included, for ``repr``."""
        return (
            f"{super().extra_repr()}, rounding={self.rounding!r}, "
            f"grad_rounding={self.grad_rounding!r}"
        )


# ---------------------------------------------------------------------------------------------
# Conv2d
# ---------------------------------------------------------------------------------------------


def _patches(
    mantissa: torch.Tensor, kernel: tuple[int, int], dilation: _Size2, stride: _Size2
) -> torch.Tensor:
    """im2col of an int16 ``(N, C, H, W)`` tensor: ``(N * L, C * kh * kw)`` int16, columns ordered
    channel-major as ``F.unfold`` orders them (so a group's columns are contiguous)."""
    n = mantissa.shape[0]
    # unfold only copies values, and every int16 is exact in FP32, so the round trip is exact.
    cols = F.unfold(mantissa.to(torch.float32), kernel, dilation=dilation, stride=stride)
    return cols.transpose(1, 2).reshape(n * cols.shape[2], cols.shape[1]).to(torch.int16)


class _DFPConv2dFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        xp: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        stride: tuple[int, int],
        dilation: tuple[int, int],
        groups: int,
        rounding: Rounding,
        grad_rounding: Rounding,
    ) -> torch.Tensor:
        n, _, hp, wp = xp.shape
        out_ch, cg, kh, kw = weight.shape
        og = out_ch // groups
        span = cg * kh * kw  # columns per group
        ho = (hp - dilation[0] * (kh - 1) - 1) // stride[0] + 1
        wo = (wp - dilation[1] * (kw - 1) - 1) // stride[1] + 1

        qx = quantize(xp, rounding=rounding)
        qw = quantize(weight, rounding=rounding)
        cols = _patches(qx.mantissa, (kh, kw), dilation, stride)  # (N*L, C*kh*kw)
        w2 = qw.mantissa.reshape(out_ch, span)
        ys = [
            matmul(
                DFPTensor(cols[:, g * span : (g + 1) * span], qx.exponent),
                DFPTensor(w2[g * og : (g + 1) * og].t(), qw.exponent),
            )
            for g in range(groups)
        ]
        y = torch.cat(ys, dim=1)  # (N*L, O)
        if bias is not None:
            y = y + bias.to(torch.float32)
        y = y.reshape(n, ho, wo, out_ch).permute(0, 3, 1, 2)

        ctx.save_for_backward(qx.mantissa, qw.mantissa)
        ctx.exponents = (qx.exponent, qw.exponent)
        ctx.conf = (stride, dilation, groups, grad_rounding)
        ctx.dtypes = (xp.dtype, weight.dtype)
        ctx.has_bias = bias is not None
        return y.contiguous().to(xp.dtype)

    @staticmethod
    def backward(ctx: Any, grad_y: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        mx, mw = ctx.saved_tensors
        ex, ew = ctx.exponents
        stride, dilation, groups, grad_rounding = ctx.conf
        x_dtype, w_dtype = ctx.dtypes
        n, _, hp, wp = mx.shape
        out_ch, cg, kh, kw = mw.shape
        og = out_ch // groups
        span = cg * kh * kw

        qg = quantize(grad_y, rounding=grad_rounding)
        g2 = qg.mantissa.permute(0, 2, 3, 1).reshape(-1, out_ch)  # (N*L, O)
        w2 = mw.reshape(out_ch, span)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_cols = torch.cat(
                [
                    matmul(
                        DFPTensor(g2[:, g * og : (g + 1) * og], qg.exponent),
                        DFPTensor(w2[g * og : (g + 1) * og], ew),
                    )
                    for g in range(groups)
                ],
                dim=1,
            )  # (N*L, C*kh*kw)
            grad_cols = grad_cols.reshape(n, -1, grad_cols.shape[1]).transpose(1, 2)
            grad_x = F.fold(grad_cols, (hp, wp), (kh, kw), dilation=dilation, stride=stride)
            grad_x = grad_x.to(x_dtype)
        if ctx.needs_input_grad[1]:
            cols = _patches(mx, (kh, kw), dilation, stride)
            grad_w = torch.cat(
                [
                    matmul(
                        DFPTensor(g2[:, g * og : (g + 1) * og].t(), qg.exponent),
                        DFPTensor(cols[:, g * span : (g + 1) * span], ex),
                    )
                    for g in range(groups)
                ],
                dim=0,
            )  # (O, Cg*kh*kw)
            grad_w = grad_w.reshape(mw.shape).to(w_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad_y.to(torch.float32).sum((0, 2, 3)).to(w_dtype)
        return grad_x, grad_w, grad_b, None, None, None, None, None


class DFPConv2d(nn.Conv2d):
    """``nn.Conv2d`` computed in DFP-16 with INT32 accumulation, with an FP32 master weight.

    Takes ``nn.Conv2d``'s arguments (every padding, padding mode, stride, dilation and group count),
    plus the roundings.

    Args:
        in_channels: Channels of the input.
        out_channels: Channels of the output.
        kernel_size: Size of the kernel, an int or a pair.
        stride: Stride, an int or a pair (default: 1).
        padding: Padding: an int, a pair, ``"valid"`` or ``"same"`` (default: 0).
        dilation: Spacing between kernel elements, an int or a pair (default: 1).
        groups: Blocked connections from input to output channels (default: 1).
        bias: Learn an additive bias, kept and applied in FP32 (default: True).
        padding_mode: ``"zeros"``, ``"reflect"``, ``"replicate"`` or ``"circular"``
            (default: ``"zeros"``).
        device: Where to create the parameters (default: PyTorch's default device).
        dtype: Parameter dtype (default: PyTorch's default, float32).
        rounding: Rounding of inputs and weights to DFP-16 (default: ``"nearest"``).
        grad_rounding: Rounding of output gradients to DFP-16 (default: None, same as
            ``rounding``).

    Padding is applied to the float input before quantizing (it never changes the largest
    magnitude, so it commutes with quantization). The output has the input's dtype.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: _Size2,
        stride: _Size2 = 1,
        padding: str | _Size2 = 0,
        dilation: _Size2 = 1,
        groups: int = 1,
        bias: bool = True,
        padding_mode: _PaddingMode = "zeros",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        rounding: Rounding = "nearest",
        grad_rounding: Rounding | None = None,
    ) -> None:
        super().__init__(
            in_channels,
            out_channels,
            kernel_size,
            stride,
            padding,
            dilation,
            groups,
            bias,
            padding_mode,
            device,
            dtype,
        )
        self.rounding, self.grad_rounding = _resolve_roundings(rounding, grad_rounding, "DFPConv2d")

    @classmethod
    def from_conv2d(
        cls,
        conv: nn.Conv2d,
        *,
        rounding: Rounding = "nearest",
        grad_rounding: Rounding | None = None,
    ) -> DFPConv2d:
        """A ``DFPConv2d`` that shares ``conv``'s parameter objects and its training mode.

        Args:
            conv: The layer to compute in DFP-16.
            rounding: Rounding of inputs and weights (default: ``"nearest"``).
            grad_rounding: Rounding of output gradients (default: None, same as ``rounding``).
        """
        # (cast: torch types a Conv2d's sizes as tuples of any length; they are pairs)
        new = cls(
            conv.in_channels,
            conv.out_channels,
            cast("tuple[int, int]", conv.kernel_size),
            stride=cast("tuple[int, int]", conv.stride),
            padding=cast("str | tuple[int, int]", conv.padding),
            dilation=cast("tuple[int, int]", conv.dilation),
            groups=conv.groups,
            bias=conv.bias is not None,
            padding_mode=conv.padding_mode,
            device="meta",  # no allocation or init: the parameters are replaced just below
            rounding=rounding,
            grad_rounding=grad_rounding,
        )
        new.weight = conv.weight
        new.bias = conv.bias
        return new.train(conv.training)

    def _pads(self) -> tuple[int, int, int, int]:
        """``F.pad`` amounts ``(left, right, top, bottom)`` for this layer's padding."""
        if self.padding == "valid":
            return (0, 0, 0, 0)
        if self.padding == "same":
            pads: list[int] = []
            # F.pad lists the last dimension (width) first; the smaller half goes before, as in
            # nn.Conv2d.
            for d, k in reversed(list(zip(self.dilation, self.kernel_size, strict=True))):
                total = d * (k - 1)
                pads += [total // 2, total - total // 2]
            return (pads[0], pads[1], pads[2], pads[3])
        ph, pw = cast("tuple[int, int]", self.padding)  # (not "valid" or "same": numbers)
        return (pw, pw, ph, ph)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The convolution of ``x`` from DFP-16 operands with INT32 sums.

        Args:
            x: Input of shape ``(N, C, H, W)`` or ``(C, H, W)``: float32, float16 or bfloat16,
                finite.
        """
        if x.dim() not in (3, 4):
            raise ValueError(
                f"DFPConv2d takes (N, C, H, W) or (C, H, W) input, got shape {tuple(x.shape)}."
            )
        unbatched = x.dim() == 3
        if unbatched:
            x = x.unsqueeze(0)
        pads = self._pads()
        if any(pads):
            mode = "constant" if self.padding_mode == "zeros" else self.padding_mode
            x = F.pad(x, pads, mode=mode)
        # (torch leaves Function.apply unannotated)
        y: torch.Tensor = _DFPConv2dFunction.apply(  # type: ignore[no-untyped-call]
            x,
            self.weight,
            self.bias,
            self.stride,
            self.dilation,
            self.groups,
            self.rounding,
            self.grad_rounding,
        )
        return y.squeeze(0) if unbatched else y

    def extra_repr(self) -> str:
        """The layer's settings, roundings included, for ``repr``."""
        return (  # (torch leaves _ConvNd.extra_repr unannotated)
            f"{super().extra_repr()}, rounding={self.rounding!r}, "  # type: ignore[no-untyped-call]
            f"grad_rounding={self.grad_rounding!r}"
        )


# ---------------------------------------------------------------------------------------------
# Model conversion
# ---------------------------------------------------------------------------------------------


def convert_to_dfp(
    model: nn.Module,
    *,
    rounding: Rounding = "nearest",
    grad_rounding: Rounding | None = None,
    skip: Iterable[str] = (),
) -> nn.Module:
    """Swap every ``nn.Linear`` and ``nn.Conv2d`` in ``model`` for its DFP-16 version, in place.

    The new layers share the old ones' parameter objects: weights, state dict keys and an optimizer
    built before the conversion all stay valid. Only modules whose type is exactly ``nn.Linear`` or
    ``nn.Conv2d`` are swapped: subclasses (e.g. the ``out_proj`` of ``nn.MultiheadAttention``,
    whose weight is used without calling its forward) are left alone. A module reachable under
    several names is converted once and stays shared.

    Args:
        model: The model to convert.
        rounding: Forward rounding for every converted layer (default: ``"nearest"``).
        grad_rounding: Backward rounding (default: None, same as ``rounding``).
        skip: Qualified module names, as ``model.named_modules()`` gives them, to leave in FP32
            (default: none); a name also skips everything under it, e.g. ``"head"`` skips
            ``"head.0"``.

    Returns:
        ``model``, converted; or, when ``model`` itself is an ``nn.Linear``/``nn.Conv2d``, its new
        DFP version (a module cannot replace itself in place).

    Raises:
        ValueError: a ``skip`` name matches no module (a typo would silently convert it), or a
            rounding mode is unknown.
    """
    rounding, grad_rounding = _resolve_roundings(rounding, grad_rounding, "convert_to_dfp")

    def make(module: nn.Module) -> nn.Module:
        if type(module) is nn.Linear:
            return DFPLinear.from_linear(module, rounding=rounding, grad_rounding=grad_rounding)
        return DFPConv2d.from_conv2d(cast(nn.Conv2d, module), rounding=rounding,
                                     grad_rounding=grad_rounding)

    return swap_layers(model, (nn.Linear, nn.Conv2d), make, skip, "convert_to_dfp")
