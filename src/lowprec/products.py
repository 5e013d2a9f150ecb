"""BF16 and FP16 matrix products on the CPU, computed as 16-bit hardware computes them.

A CPU without AVX-512 BF16 or AMX has no fast BF16 matrix multiply in torch (its BF16 GEMM is a
plain loop, about 40x slower than FP32's), and almost no CPU has a fast FP16 one. Since the
product of two BF16 or FP16 numbers is exact in FP32, ``LowPrecisionProductsInFP32`` casts the
operands of linear layers, matmuls, convolutions and attention to FP32, multiplies and sums in
FP32 and rounds the result once to the 16-bit dtype: what tensor cores give, at FP32's speed.

``Recipe.autocast()`` (``lowprec.recipes``) enters the mode on the CPU for FP16 weights always,
and for BF16 weights and ``amp-bf16`` where ``bf16_products_in_fp32()`` says so: where
``cpu_has_fast_bf16_matmul()`` finds no oneDNN BF16 kernel, or where the environment variable
``LOWPREC_BF16_PRODUCTS`` is ``fp32``. ``lowprec.recipes`` re-exports every name here.
"""

from __future__ import annotations

import copy
import functools
import os
from collections.abc import Callable, Collection, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = [
    "BF16_PRODUCTS_ENV",
    "HalfProductsInFP32",
    "LowPrecisionProductsInFP32",
    "bf16_products_in_fp32",
    "cpu_has_fast_bf16_matmul",
]


def cast_floats(obj: Any, dtype: torch.dtype,
                 only: tuple[torch.dtype, ...] | None = None) -> Any:
    """``obj`` with its floating tensors (those of a dtype in ``only``, where given) cast to
    ``dtype``, through tuples, lists and mappings."""
    if isinstance(obj, torch.Tensor):
        convert = (obj.is_floating_point() and obj.dtype != dtype
                   and (only is None or obj.dtype in only))
        return obj.to(dtype) if convert else obj
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(cast_floats(o, dtype, only) for o in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(cast_floats(o, dtype, only) for o in obj)
    if isinstance(obj, Mapping):
        if type(obj) is dict:
            return {k: cast_floats(v, dtype, only) for k, v in obj.items()}
        # A mapping of its own type (a Hugging Face ModelOutput, an OrderedDict...) stays one:
        # callers read its attributes (`.loss`, `.past_key_values`). A copy keeps the type and
        # whatever its constructor needs; item assignment updates ModelOutput's attributes too.
        out: Any = copy.copy(obj)  # (a mapping of its own type: item assignment, above)
        for k, v in obj.items():
            cast = cast_floats(v, dtype, only)
            if cast is not v:
                out[k] = cast
        return out
    return obj


def has_cpu_tensor(obj: Any, dtypes: tuple[torch.dtype, ...]) -> bool:
    """Whether ``obj`` (a tensor, or a list, tuple or mapping of them) holds a CPU tensor of one
    of ``dtypes``."""
    if isinstance(obj, torch.Tensor):
        return obj.dtype in dtypes and obj.device.type == "cpu"
    if isinstance(obj, (list, tuple)):
        return any(has_cpu_tensor(o, dtypes) for o in obj)
    if isinstance(obj, Mapping):
        return any(has_cpu_tensor(o, dtypes) for o in obj.values())
    return False


#: The products the modes compute in FP32 for operands of a low-precision dtype.
_PRODUCT_OPS = frozenset({
    F.linear, F.bilinear, F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d,
    F.conv_transpose2d, F.conv_transpose3d, F.scaled_dot_product_attention,
    torch.matmul, torch.mm, torch.bmm, torch.addmm, torch.baddbmm, torch.einsum,
    torch.Tensor.__matmul__, torch.Tensor.__rmatmul__, torch.Tensor.matmul,
    torch.Tensor.mm, torch.Tensor.bmm,
})
#: Those of them that CPU autocast runs in its lower-precision dtype (its casts happen at
#: dispatch, below a function mode: einsum is cast there as the bmm it becomes). F.bilinear is
#: not one: autocast runs it in the widest of its operands' dtypes.
_AUTOCAST_PRODUCT_OPS = _PRODUCT_OPS - {F.bilinear}
#: Autocast's casts: floating tensors but FP64 (``at::autocast::is_eligible``).
_AUTOCAST_CASTS = (torch.float32, torch.float16, torch.bfloat16)

#: The environment variable that sets how ``Recipe.autocast`` computes BF16 products on the CPU:
#: ``auto`` (unset), ``fp32`` or ``native`` (``bf16_products_in_fp32``).
BF16_PRODUCTS_ENV = "LOWPREC_BF16_PRODUCTS"
_BF16_PRODUCTS_VALUES = ("auto", "fp32", "native")


@functools.cache
def cpu_has_fast_bf16_matmul() -> bool:
    """Whether torch has a fast BF16 matrix multiply on this machine's CPU.

    torch's CPU BF16 matmul is oneDNN's where the CPU has AVX-512 BF16 or AMX; elsewhere (an
    AVX2-only x86 CPU, such as AMD's before Zen 4) it is a plain loop, about 40x slower than
    the FP32 GEMM. Asked once and cached.

    Returns:
        True where oneDNN's BF16 kernels run here.
    """
    return bool(torch.backends.mkldnn.is_available()
                and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def bf16_products_in_fp32() -> bool:
    """Whether ``Recipe.autocast`` computes BF16 matrix products on the CPU in FP32
    (``LowPrecisionProductsInFP32``) instead of with torch's BF16 kernels.

    The environment variable ``LOWPREC_BF16_PRODUCTS`` decides: ``auto`` (or unset) where this
    CPU has no fast BF16 matmul (``cpu_has_fast_bf16_matmul``), ``fp32`` always, ``native``
    never (torch's own kernels, slow or not). A GPU always uses its own BF16 kernels.

    Returns:
        True where BF16 products on the CPU are computed in FP32 and rounded to BF16.

    Raises:
        ValueError: ``LOWPREC_BF16_PRODUCTS`` holds another value.
    """
    value = os.environ.get(BF16_PRODUCTS_ENV, "").strip().lower() or "auto"
    if value not in _BF16_PRODUCTS_VALUES:
        raise ValueError(
            f"{BF16_PRODUCTS_ENV}={os.environ[BF16_PRODUCTS_ENV]!r} is not a setting of how BF16 "
            "products are computed on the CPU: use auto (in FP32 where this CPU has no fast BF16 "
            "matmul), fp32 (always in FP32) or native (torch's BF16 kernels)."
        )
    if value == "auto":
        return not cpu_has_fast_bf16_matmul()
    return value == "fp32"


class LowPrecisionProductsInFP32(TorchFunctionMode):
    """BF16 or FP16 matrix products on the CPU computed as BF16/FP16 hardware computes them.

    A product of two BF16 or FP16 numbers is exact in FP32, so casting the operands to FP32,
    multiplying and summing in FP32, and rounding the result once to the low-precision dtype
    gives what tensor cores (or AVX-512 BF16/AMX) with FP32 accumulation give, up to the order
    of the sums. torch's own CPU kernels for these dtypes are slow where the CPU has no such
    arithmetic: FP16 everywhere but on AVX-512 FP16/AMX-FP16 CPUs (about 70x an FP32 GEMM on an
    AVX-512 BF16 machine), BF16 without AVX-512 BF16 or AMX (about 40x). This mode routes linear
    layers, matmuls, convolutions and attention on CPU operands of ``dtype`` through FP32 this
    way. Autograd records the casts, so the backward products are computed the same way.
    Elementwise ops, weights, activations and gradients keep their dtypes.

    With ``autocast=True`` the mode also enters ``torch.autocast("cpu", dtype=dtype)`` and
    computes the products that autocast would run in ``dtype`` (linear, matmul, mm, bmm, addmm,
    baddbmm, einsum, the convolutions and attention) as autocast's semantics give them, on FP32
    operands too: each floating operand (but FP64) rounded to ``dtype``, the product in FP32,
    the result rounded to ``dtype``; every other op is autocast's. Where autocast is disabled
    or set to another dtype inside the context, the products are left to it.

    ``Recipe.autocast()`` enters this mode on the CPU for FP16 weights always, and for BF16
    weights and the ``amp-bf16`` recipe where ``bf16_products_in_fp32()`` says so.

    Args:
        dtype: The low-precision dtype whose products are computed in FP32:
            ``torch.bfloat16`` or ``torch.float16`` (default: ``torch.bfloat16``).
        autocast: Also enter CPU autocast to ``dtype`` and emulate its products on FP32
            operands (default: False).

    Raises:
        TypeError: ``dtype`` is neither BF16 nor FP16, or ``autocast`` is not a bool.

    Examples:
        >>> import torch
        >>> from lowprec.products import LowPrecisionProductsInFP32
        >>> a, b = torch.randn(4, 8).bfloat16(), torch.randn(8, 2).bfloat16()
        >>> with LowPrecisionProductsInFP32(torch.bfloat16):
        ...     c = a @ b
        >>> c.dtype, torch.equal(c, (a.float() @ b.float()).bfloat16())
        (torch.bfloat16, True)
    """

    def __init__(self, dtype: torch.dtype = torch.bfloat16, *, autocast: bool = False) -> None:
        if dtype not in (torch.bfloat16, torch.float16):
            raise TypeError(
                f"LowPrecisionProductsInFP32 computes BF16 or FP16 products; got dtype={dtype!r}: "
                "use torch.bfloat16 or torch.float16."
            )
        if not isinstance(autocast, bool):
            raise TypeError(f"autocast must be a bool, got {type(autocast).__name__}.")
        super().__init__()
        self.dtype = dtype
        self.autocast = autocast
        self._autocast: torch.autocast | None = None

    def __enter__(self) -> LowPrecisionProductsInFP32:
        if self.autocast:  # (autocast outside the mode: the mode sees each call first)
            self._autocast = torch.autocast("cpu", dtype=self.dtype)
            self._autocast.__enter__()
        try:
            super().__enter__()  # type: ignore[no-untyped-call]
        except BaseException:
            if self._autocast is not None:
                self._autocast.__exit__(None, None, None)
                self._autocast = None
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)  # type: ignore[no-untyped-call]
        finally:
            if self._autocast is not None:
                self._autocast.__exit__(*exc)
                self._autocast = None

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Collection[type],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        # (Inside torch.compile, Dynamo guards on what this reads: a guard on an attribute of
        # the active mode, self.OPS, failed to build (NameError
        # '___get_torch_function_mode_stack_at') for a compiled model under the FP16 mode; the
        # product sets are the module's for that reason.)
        if "out" in kwargs:
            # A product into a given tensor is left to torch: its casts would write a copy.
            # (Inductor's compiled code calls extern_kernels.mm(..., out=buf) while the mode is
            # active; a cast ``out`` left ``buf`` unwritten.)
            return func(*args, **kwargs)
        dtype, autocast = self.dtype, self.autocast
        if dtype == torch.bfloat16 and torch.compiler.is_compiling():
            # Inductor drops a round trip through BF16 (x.to(bf16).to(fp32)) unless
            # emulate_precision_casts is set, so the compiled emulation would skip the roundings
            # it is made of (autocast's operands', a product's result where the next op fuses
            # with it): a compiled BF16 product is torch's own. (FP16 keeps its mode compiled,
            # as it always did.)
            return func(*args, **kwargs)
        if autocast:
            if (func in _AUTOCAST_PRODUCT_OPS and torch.is_autocast_enabled("cpu")
                    and torch.get_autocast_dtype("cpu") == dtype
                    and (has_cpu_tensor(args, _AUTOCAST_CASTS)
                         or has_cpu_tensor(kwargs, _AUTOCAST_CASTS))):
                # Autocast's cast to ``dtype``, then FP32 (exact) with autocast off.
                casts = _AUTOCAST_CASTS
                args = cast_floats(cast_floats(args, dtype, casts), torch.float32, casts)
                kwargs = cast_floats(cast_floats(kwargs, dtype, casts), torch.float32, casts)
                with torch.autocast("cpu", enabled=False):
                    out = func(*args, **kwargs)
                return cast_floats(out, dtype)
            return func(*args, **kwargs)
        if func in _PRODUCT_OPS and (has_cpu_tensor(args, (dtype,))
                                     or has_cpu_tensor(kwargs, (dtype,))):
            out = func(*cast_floats(args, torch.float32), **cast_floats(kwargs, torch.float32))
            return cast_floats(out, dtype)
        return func(*args, **kwargs)


class HalfProductsInFP32(LowPrecisionProductsInFP32):
    """FP16 matrix products on the CPU computed in FP32 and rounded once to FP16:
    ``LowPrecisionProductsInFP32(torch.float16)``, under its earlier name."""

    def __init__(self) -> None:
        super().__init__(torch.float16)
