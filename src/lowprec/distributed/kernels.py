"""The hook's per-block work as functions that run eagerly or under ``torch.compile``.

``onebit_hook`` spends its compute in four places: quantizing gradient + residual (stage 1,
``encode``), summing and requantizing a stripe (stage 2, ``reaggregate``), dequantizing into the
bucket (stage 3, ``decode``), and packing and unpacking codes. Packing has an eager form (``pack``)
and one for the compiler (``pack_wide``: integer operations, equal by construction and by test).
The math is ``lowprec.distributed.quantize``'s own (``quantize_columns``, ``dequantize_columns``,
and for the ``"range"`` rule their parts ``range_parts``/``range_values``), so there is one copy of
it: the eager path calls these functions as they are; the compiled path (the default where a
compiler exists, ``OneBitState(fused=None)``) runs the same functions through ``torch.compile``
(Inductor: C++ on CPU, Triton on GPU). On that path, stages 2 and 3 read a block whose codes fill
whole bytes straight from the packed message (``reaggregate_packed``, ``decode_packed``) instead
of unpacking it first. The results are identical bit for bit for the ``"range"`` rule (min, max
and elementwise FP32 operations in the same order; the tests check it against a single-process
simulation). ``"zero-threshold"`` always runs eagerly: its column sums would be split into
different partial sums by the compiled reduction.

Outputs go into caller-provided tensors (``res_out``, ``codes_out``, ``stats_out``, ``out``), so
that the compiled kernels write straight into the hook's residual buffers and messages.
"""

from __future__ import annotations

import contextlib
import sys
import types
import warnings
from collections.abc import Callable
from typing import Any

import torch

from lowprec.distributed.quantize import (
    columns_finite,
    dequantize_columns,
    quantize_columns,
    range_parts,
    range_values,
)
from lowprec.numerics import COMPILED_AS_EAGER

__all__ = [
    "COMPILE_ERRORS",
    "compiled",
    "decode",
    "decode_packed",
    "encode",
    "pack",
    "pack_wide",
    "reaggregate",
    "reaggregate_packed",
    "unpack",
    "unpack_wide",
]


def _requantize(v: torch.Tensor, bits: int, rule: str) -> tuple[torch.Tensor, ...]:
    """Quantize ``v``: ``(codes, stats, reconstruction, all columns finite)``. The ``"range"``
    rule goes through ``range_parts``/``range_values`` on the unstacked min and max (see there:
    25% faster compiled, the same values)."""
    if rule == "range":
        codes, lo, hi = range_parts(v, bits)
        return (codes, torch.stack([lo, hi], dim=1), range_values(codes, lo, hi, bits),
                torch.isfinite(hi - lo).all())
    codes, stats = quantize_columns(v, bits=bits, rule=rule)
    return (codes, stats, dequantize_columns(codes, stats, bits=bits, rule=rule),
            columns_finite(stats, rule=rule).all())


def encode(g: torch.Tensor, res: torch.Tensor, res_out: torch.Tensor, codes_out: torch.Tensor,
           stats_out: torch.Tensor, bits: int, rule: str) -> torch.Tensor:
    """Stage 1 for a block of ``[columns, length]``: quantize ``g + res`` (``g`` in its own dtype,
    ``res`` FP32); write the codes, the stats and the new residual; return "all columns finite"."""
    v = g.float() + res
    codes, stats, rec, finite = _requantize(v, bits, rule)
    res_out.copy_(v - rec)
    codes_out.copy_(codes)
    stats_out.copy_(stats)
    return finite


def reaggregate(codes: torch.Tensor, stats: torch.Tensor, res: torch.Tensor,
                res_out: torch.Tensor, codes_out: torch.Tensor, stats_out: torch.Tensor,
                bits: int, rule: str) -> torch.Tensor:
    """Stage 2 for a block: dequantize the ``W`` senders' copies (``codes`` ``[W, columns,
    length]``, ``stats`` ``[W, columns, 2]``), sum them in rank order, divide by ``W``, add the
    stripe residual ``res`` and quantize like ``encode``; return "all columns finite"."""
    copies = [dequantize_columns(codes[k], stats[k], bits=bits, rule=rule)
              for k in range(codes.shape[0])]
    return _average_and_requantize(copies, res, res_out, codes_out, stats_out, bits, rule)


def _average_and_requantize(copies: list[torch.Tensor], res: torch.Tensor, res_out: torch.Tensor,
                            codes_out: torch.Tensor, stats_out: torch.Tensor, bits: int,
                            rule: str) -> torch.Tensor:
    """Stage 2's common part: sum the senders' dequantized ``copies`` in rank order, divide by
    their number, add the stripe residual, requantize into the outputs."""
    acc = copies[0]
    for copy in copies[1:]:
        acc = acc + copy
    v = acc / len(copies) + res
    new_codes, new_stats, rec, finite = _requantize(v, bits, rule)
    res_out.copy_(v - rec)
    codes_out.copy_(new_codes)
    stats_out.copy_(new_stats)
    return finite


def decode(codes: torch.Tensor, stats: torch.Tensor, out: torch.Tensor, bits: int,
           rule: str) -> None:
    """Stage 3 for a block: dequantize into ``out`` (the bucket, in its own dtype)."""
    out.copy_(dequantize_columns(codes, stats, bits=bits, rule=rule))


# Stages 2 and 3 straight from the packed bytes, for blocks whose codes fill whole bytes (the
# compiled path; ``"range"`` rule). A block of ``[columns, length]`` is seen as ``[columns, length
# // per, per]``: byte ``j`` of a column and its ``per`` codes, which broadcasting a byte against
# its ``per`` shifts yields without an unpacked copy (1.8x faster than unpack + decode compiled on
# CPU). The math is ``range_parts``/``range_values``, the same as the 2-D kernels'.


def _spread(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The codes of ``packed`` (``[..., bytes]``) as ``[..., bytes, 8 // bits]`` int32."""
    shifts = torch.arange(0, 8, bits, dtype=torch.int32, device=packed.device)
    return (packed.to(torch.int32)[..., None] >> shifts) & ((1 << bits) - 1)


def reaggregate_packed(packed: torch.Tensor, stats: torch.Tensor, res: torch.Tensor,
                       res_out: torch.Tensor, codes_out: torch.Tensor, stats_out: torch.Tensor,
                       bits: int, rule: str) -> torch.Tensor:
    """``reaggregate`` for a block whose senders' codes are ``packed`` ``[W, columns, bytes]``
    (``res``, ``res_out``, ``codes_out``: ``[columns, bytes, per]``); ``"range"`` rule only."""
    copies = [range_values(_spread(packed[k], bits), stats[k, :, 0], stats[k, :, 1], bits)
              for k in range(packed.shape[0])]
    return _average_and_requantize(copies, res, res_out, codes_out, stats_out, bits, rule)


def decode_packed(packed: torch.Tensor, stats: torch.Tensor, out: torch.Tensor, bits: int,
                  rule: str) -> None:
    """``decode`` from ``packed`` ``[columns, bytes]`` into ``out`` ``[columns, bytes, per]``;
    ``"range"`` rule only."""
    out.copy_(range_values(_spread(packed, bits), stats[:, 0], stats[:, 1], bits))


def pack(codes: torch.Tensor, out: torch.Tensor, bits: int) -> None:
    """Pack ``codes`` (1-D ``uint8``, ``out.numel() * per`` of them with ``per = 8 // bits``; the
    caller pads with zeros) into ``out``, ``per`` per byte, lowest bits first: the layout of
    ``quantize.pack_codes``, without its allocations. The eager path's form (``pack_wide`` is
    the compiled path's)."""
    per = 8 // bits
    slots = codes.view(-1, per)
    out.copy_(slots[:, 0])
    for j in range(1, per):
        out.bitwise_or_(slots[:, j] << (bits * j))  # code j of each byte to bits [bits*j, ...)


def unpack(packed: torch.Tensor, out: torch.Tensor, bits: int) -> None:
    """The inverse of ``pack`` for each row: ``packed`` ``[rows, m]`` into ``out`` ``[rows, m *
    per]``; code ``j`` of byte ``i`` is ``(packed[i] >> (j * bits)) & (2**bits - 1)``. The eager
    path's form (``unpack_wide`` is the compiled path's)."""
    per = 8 // bits
    slots = out.view(out.shape[0], -1, per)
    for j in range(per):
        torch.bitwise_and(packed >> (bits * j), (1 << bits) - 1, out=slots[:, :, j])


# Packing for the compiled path: the ``per`` codes of a byte, ``per`` bytes in a row, read as one
# integer of ``per`` bytes (little-endian: byte j holds bits 8j...8j+7), so that packing and
# unpacking are elementwise shifts and masks of one contiguous integer tensor, which Inductor turns
# into one vectorized pass (10-30x faster than ``pack``/``unpack``; eagerly they are slower).
_WIDE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def pack_wide(codes: torch.Tensor, out: torch.Tensor, bits: int) -> None:
    """``pack`` with integer views (the same bytes): code j of byte i sits at bits ``8j`` of
    the ``i``-th ``per``-byte integer and moves down to bits ``bits * j``. ``codes`` must start
    at a multiple of ``per`` bytes (the hook's scratch buffers start at 0)."""
    per = 8 // bits
    mask = (1 << bits) - 1
    x = codes.view(_WIDE[per])
    acc = x & mask
    for j in range(1, per):
        acc = acc | ((x >> (8 * j - bits * j)) & (mask << (bits * j)))  # bits 8j.. to bits*j..
    out.copy_(acc)  # < 256: the packed byte


def unpack_wide(packed: torch.Tensor, out: torch.Tensor, bits: int) -> None:
    """``unpack`` with integer views: bits ``bits * j`` of a packed byte move up to bits ``8j``
    (byte j) of a ``per``-byte integer of ``out``; ``out``'s rows start at multiples of ``per``
    bytes."""
    per = 8 // bits
    mask = (1 << bits) - 1
    p = packed.to(_WIDE[per])
    acc = p & mask
    for j in range(1, per):
        acc = acc | ((p << (8 * j - bits * j)) & (mask << (8 * j)))  # bits*j.. to byte j
    out.view(_WIDE[per]).copy_(acc)


_COMPILED: dict[tuple[Any, ...], Callable[..., Any]] = {}

#: Failures of torch.compile that leave nothing written (no C++ compiler, no Triton, an
#: unsupported op): the hook then warns and continues eagerly, with the same results.
COMPILE_ERRORS: tuple[type[BaseException], ...] = (RuntimeError, OSError, ImportError)
try:  # Dynamo's error classes, where this PyTorch has them
    from torch._dynamo.exc import FailOnRecompileLimitHit, TorchDynamoException

    COMPILE_ERRORS = (*COMPILE_ERRORS, TorchDynamoException, FailOnRecompileLimitHit)
except ImportError:  # pragma: no cover
    pass


def compiled(name: str, *variant: Any) -> Callable[..., Any]:
    """The ``torch.compile``d form of ``encode``, ``reaggregate``, ``decode``, ``pack_wide`` or
    ``unpack_wide`` for one ``variant`` (the hook passes code width, rule, dtype and rank).

    Each variant compiles its own copy of the function's code, so Dynamo keeps a separate cache
    (and recompile budget) per variant; shapes are dynamic, so one variant serves every block
    size, apart from the size-1 specializations (one column, or columns of one value).
    """
    key = (name, *variant)
    kernel = _COMPILED.get(key)
    if kernel is None:
        fn = globals()[name]
        label = "_".join(str(v).replace("torch.", "") for v in variant)
        label = f"lowprec_onebit_{name}_{label}"
        code = fn.__code__
        code = (code.replace(co_name=label, co_qualname=label) if sys.version_info >= (3, 11)
                else code.replace(co_name=label))
        copy = types.FunctionType(code, fn.__globals__, label, fn.__defaults__, fn.__closure__)
        kernel = torch.compile(copy, dynamic=True, fullgraph=True, options=COMPILED_AS_EAGER)
        _COMPILED[key] = kernel
    return kernel


def compile_settings() -> Any:
    """A context for calling the compiled kernels: no duck sizing (two sizes or offsets that
    happen to be equal must not become a guard that the next block breaks) and a recompile budget
    for the remaining specializations (sizes and storage offsets of 0 or 1)."""
    import torch._dynamo.config as dynamo_config
    import torch.fx.experimental._config as fx_config

    return contextlib.ExitStack() if _SETTINGS is None else _SETTINGS(dynamo_config, fx_config)


def _settings(dynamo_config: Any, fx_config: Any) -> Any:
    stack = contextlib.ExitStack()
    stack.enter_context(fx_config.patch(use_duck_shape=False))
    # Integer arguments (the code width) are constants: the packed kernels' innermost dimension
    # is 8 // bits long, and only a constant length vectorizes (5-8x slower symbolic).
    settings: dict[str, Any] = {"specialize_int": True}
    limit = _recompile_limit_name(dynamo_config)
    if limit is not None:
        settings[limit] = RECOMPILE_LIMIT
    stack.enter_context(dynamo_config.patch(**settings))
    return stack


def _recompile_limit_name(dynamo_config: Any) -> str | None:
    """The name of Dynamo's per-function recompile budget in this torch: ``recompile_limit``
    (torch 2.7 on), ``cache_size_limit`` before; None, with one warning, where it has neither
    (the kernels then keep Dynamo's own budget, and a variant past it steps eagerly)."""
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo_config, name):
            return name
    if not _WARNED_LIMIT:
        _WARNED_LIMIT.append(True)
        warnings.warn(
            f"lowprec: torch {torch.__version__}'s Dynamo has no recompile_limit (nor "
            f"cache_size_limit), so the 1-bit hook's compiled kernels keep Dynamo's default "
            f"recompile budget instead of {RECOMPILE_LIMIT}; a kernel that reaches it runs eagerly "
            "from then on, with the same results more slowly.",
            RuntimeWarning, stacklevel=2,
        )
    return None


_WARNED_LIMIT: list[bool] = []


#: Compilations allowed per kernel variant (the sizes and offsets of 0 or 1 give a few each).
RECOMPILE_LIMIT = 32
_SETTINGS: Callable[..., Any] | None = _settings
