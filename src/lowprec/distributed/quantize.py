"""Per-column gradient quantization (1, 2, 4 or 8 bits per value) with error feedback.

A *column* (the 1-bit SGD paper's and CNTK's word) is a run of values that share one pair of FP32
numbers, the column's *stats*. Here a column is always a row of a 2-D ``[columns, length]`` tensor;
which values of a gradient make up a column is decided by the caller (``lowprec.distributed.hook``:
one output unit of a weight, or a fixed-size slice of a flat parameter).

Two rules, both "code + two floats per column"; ``"range"`` is the default (``DEFAULT_RULE``):

``"range"`` (the 1-bit SGD notes' rule, any width)
    The stats are the column's minimum and maximum. ``[min, max]`` is cut into ``2**bits`` equal
    bins of width ``step = (max - min) / 2**bits``; the code is the index of the bin holding the
    value, ``floor((v - min) / step)`` clipped to ``[0, 2**bits - 1]``, and it reconstructs to the
    bin's centre ``min + (code + 0.5) * step``: for 1 bit the notes' ``(Q + 0.5) * (max - min) / 2 +
    min``. The notes pair that formula with ``Q = 0 if v >= 0 else 1``, which as written sends
    non-negative values to the *lower* centre, and a threshold at 0 with centres of ``[min, max]``
    is inconsistent anyway when a column is all positive (every value would land on one centre).
    We take the threshold at the midpoint ``(min + max) / 2`` instead: each value goes to the
    nearer of the two centres, the error is at most ``(max - min) / 4``, and 1 bit is simply the
    ``bits=1`` case of the multi-bit rule. A constant column (``max == min``) reconstructs exactly.

``"zero-threshold"`` (CNTK's 1-bit rule, 1 bit only)
    The code is 1 for ``v >= 0`` (``-0.0`` included) and 0 for ``v < 0``. The stats are the mean of
    the column's negative values and the mean of its non-negative values; a code reconstructs to
    its group's mean (a group with no members gets 0, which no code refers to). Each group's sum is
    kept, so the reconstruction has exactly the column's sum (up to FP32 rounding).

Error feedback: ``quantize_with_feedback_(x)`` takes ``x = gradient + old residual`` and leaves the
new residual ``x - reconstruction`` in ``x``, so ``gradient + old residual == reconstruction + new
residual`` up to the rounding of those two FP32 operations.

Codes are ``uint8`` tensors, one code per value; ``pack_codes`` puts ``8 // bits`` of them in each
byte, lowest bits first, and ``unpack_codes`` undoes it. Everything here is elementwise or a
per-row reduction, so it runs unchanged on CPU and CUDA.
"""

from __future__ import annotations

import torch

__all__ = [
    "BITS",
    "DEFAULT_RULE",
    "RULES",
    "check_quantizer",
    "columns_finite",
    "dequantize_columns",
    "pack_codes",
    "packed_size",
    "quantize_columns",
    "quantize_with_feedback_",
    "unpack_codes",
]

#: The reconstruction rules; see the module docstring.
RULES = ("range", "zero-threshold")
#: The code widths ``pack_codes`` supports (a byte holds a whole number of codes).
BITS = (1, 2, 4, 8)
#: The rule used unless told otherwise. Measured on 2-process DDP training (docs/distributed.md,
#: "Choosing the rule"), 1-bit "range" ended 0.1-1.3 % above the uncompressed run's loss on average
#: and "zero-threshold" 0.8-6 %: the range rule sends a column's extremes at once (within a
#: quarter of the range), while the zero-threshold means flatten them into the residual.
DEFAULT_RULE = "range"


def check_quantizer(*, bits: int, rule: str) -> None:
    """Raise if ``bits`` and ``rule`` do not name a quantizer.

    Args:
        bits: Code width in bits: 1, 2, 4 or 8.
        rule: ``"zero-threshold"`` (1 bit only) or ``"range"``.

    Raises:
        TypeError: ``bits`` is not an int or ``rule`` not a string.
        ValueError: An unknown width or rule, or ``"zero-threshold"`` with more than 1 bit.
    """
    if isinstance(bits, bool) or not isinstance(bits, int):
        raise TypeError(f"bits must be an int (1, 2, 4 or 8), got {type(bits).__name__}.")
    if bits not in BITS:
        raise ValueError(
            f"bits={bits} is not supported: use 1, 2, 4 or 8 (a byte must hold whole codes)."
        )
    if not isinstance(rule, str):
        raise TypeError(f"rule must be a string, one of {RULES}, got {type(rule).__name__}.")
    if rule not in RULES:
        raise ValueError(f"unknown rule {rule!r}: use one of {RULES}.")
    if rule == "zero-threshold" and bits != 1:
        raise ValueError(
            f"rule='zero-threshold' is a 1-bit rule (one threshold, two means); with bits={bits} "
            "use rule='range'."
        )


def _check_columns(x: torch.Tensor, what: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} must be a tensor, got {type(x).__name__}.")
    if x.dim() != 2:
        raise ValueError(
            f"{what} must be 2-D [columns, length] (one column per row), got shape "
            f"{tuple(x.shape)}; use x.view(columns, -1)."
        )
    if x.dtype != torch.float32:
        raise TypeError(f"{what} must be float32, got {x.dtype}; convert with x.float().")
    if x.shape[1] == 0:
        raise ValueError(f"{what} has columns of length 0 (shape {tuple(x.shape)}); every column "
                         "needs at least one value.")


def quantize_columns(
    x: torch.Tensor, *, bits: int = 1, rule: str = DEFAULT_RULE
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize every row of ``x`` (one column per row) to ``bits``-bit codes and two floats.

    Args:
        x: FP32 tensor of shape ``[columns, length]``; ``length >= 1``.
        bits: Code width: 1, 2, 4 or 8 (default: 1).
        rule: ``"zero-threshold"`` or ``"range"`` (default: ``"range"``).

    Returns:
        ``(codes, stats)``: ``uint8`` codes shaped like ``x``, and FP32 stats of shape
        ``[columns, 2]`` (negative mean and non-negative mean, or min and max). A column with a
        NaN or an infinity gets non-finite stats (see ``columns_finite``) and meaningless codes.
    """
    check_quantizer(bits=bits, rule=rule)
    _check_columns(x, "x")
    if rule == "zero-threshold":
        codes = (x >= 0).view(torch.uint8)  # a bool is one byte holding 0 or 1; NaN gives 0
        n_upper = codes.sum(dim=1, dtype=torch.int32)
        # Group sums: clamping sends the other group's values to 0, and keeps a NaN a NaN (so a NaN
        # or an infinity makes the column's stats non-finite, whichever group it falls in).
        sum_upper = x.clamp_min(0).sum(dim=1)
        sum_lower = x.clamp_max(0).sum(dim=1)
        # An empty group's sum is 0; dividing by 1 then gives the unused stat 0 instead of NaN.
        mean_upper = sum_upper / n_upper.clamp_min(1)
        mean_lower = sum_lower / (x.shape[1] - n_upper).clamp_min(1)
        return codes, torch.stack([mean_lower, mean_upper], dim=1)
    codes, lo, hi = range_parts(x, bits)
    return codes, torch.stack([lo, hi], dim=1)


def range_parts(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``"range"`` rule on rows of any shape: row ``i`` is ``x[i]``, all of it (the compiled
    hook passes ``[columns, bytes, codes per byte]``, the packed layout). Returns ``uint8`` codes
    shaped like ``x`` and each row's min and max (1-D). No checks: ``quantize_columns`` makes them.
    Kept apart from the stacked stats so that a compiled caller reconstructs from ``lo`` and ``hi``
    directly, which lets Inductor run the quantizing pass in the same loop over rows as the min/max
    (a row then is read from memory once, not twice)."""
    dims = tuple(range(1, x.dim()))
    lo, hi = x.amin(dim=dims), x.amax(dim=dims)  # both propagate NaN
    step = (hi - lo) / (1 << bits)
    # A constant column has step 0: dividing by 1 instead gives code 0, which reconstructs to
    # lo + 0.5 * 0 == lo exactly. (A step that underflows to 0 for a tiny nonzero range is treated
    # the same; the small remainder goes to the residual.)
    safe = torch.where(step > 0, step, 1.0).view(-1, *[1] * len(dims))
    q = torch.sub(x, lo.view_as(safe)).div_(safe).floor_().clamp_(0, (1 << bits) - 1)
    # Through int32: PyTorch's direct float -> uint8 cast is not vectorized on CPU (3x slower).
    return q.to(torch.int32).to(torch.uint8), lo, hi


def range_values(codes: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                 bits: int) -> torch.Tensor:
    """The ``"range"`` rule's reconstruction for rows of any shape (as ``range_parts``), from each
    row's ``lo`` and ``hi`` (1-D): ``lo + (code + 0.5) * step``, FP32. No checks."""
    shape = (-1, *[1] * (codes.dim() - 1))
    lo, hi = lo.view(shape), hi.view(shape)
    step = (hi - lo) / (1 << bits)
    return codes.to(torch.float32).add_(0.5).mul_(step).add_(lo)


def dequantize_columns(
    codes: torch.Tensor,
    stats: torch.Tensor,
    *,
    bits: int = 1,
    rule: str = DEFAULT_RULE,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rebuild FP32 values from ``codes`` and ``stats`` (the inverse map of ``quantize_columns``).

    Args:
        codes: ``uint8`` codes of shape ``[columns, length]``.
        stats: FP32 stats of shape ``[columns, 2]``.
        bits: Code width the codes were made with (default: 1).
        rule: Rule the codes were made with (default: ``"range"``).
        out: Optional FP32 tensor shaped like ``codes`` to write into (default: None, a new one).

    Returns:
        The reconstruction, FP32, shaped like ``codes`` (``out`` when given).
    """
    check_quantizer(bits=bits, rule=rule)
    if codes.dtype != torch.uint8 or codes.dim() != 2:
        raise TypeError(
            f"codes must be a 2-D uint8 tensor, got {codes.dtype} of shape {tuple(codes.shape)}."
        )
    if stats.shape != (codes.shape[0], 2) or stats.dtype != torch.float32:
        raise ValueError(
            f"stats must be float32 of shape [{codes.shape[0]}, 2] (two floats per column of "
            f"codes), got {stats.dtype} of shape {tuple(stats.shape)}."
        )
    lo, hi = stats[:, 0:1], stats[:, 1:2]
    if rule == "zero-threshold":
        # An exact select, faster than torch.where with per-row operands: for code 1 the terms
        # are hi * 1 and lo * 0 (a zero), for code 0 hi * 0 and lo * 1, and x + 0 == x.
        up = codes.to(torch.float32)
        value = (up * hi).add_(up.neg_().add_(1).mul_(lo))
    else:  # lo + (code + 0.5) * step: the centre of bin `code`
        value = range_values(codes, stats[:, 0], stats[:, 1], bits)
    if out is None:
        return value
    return out.copy_(value)


def quantize_with_feedback_(
    x: torch.Tensor, *, bits: int = 1, rule: str = DEFAULT_RULE
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` and replace it, in place, by its quantization error (the new residual).

    On entry ``x`` holds ``gradient + old residual``; on return it holds ``x - reconstruction``, so
    that ``gradient + old residual == reconstruction + new residual`` to FP32 rounding. That error,
    added to the next step's gradient, is what keeps 1-bit SGD unbiased over time.

    Args:
        x: FP32 tensor of shape ``[columns, length]``, overwritten with the residual.
        bits: Code width: 1, 2, 4 or 8 (default: 1).
        rule: ``"zero-threshold"`` or ``"range"`` (default: ``"range"``).

    Returns:
        ``(codes, stats)`` as from ``quantize_columns``.
    """
    codes, stats = quantize_columns(x, bits=bits, rule=rule)
    x.sub_(dequantize_columns(codes, stats, bits=bits, rule=rule))
    return codes, stats


def columns_finite(stats: torch.Tensor, *, rule: str = DEFAULT_RULE) -> torch.Tensor:
    """Per column, whether its reconstruction is finite (a bool tensor of shape ``[columns]``).

    False where the column held a NaN or an infinity, or where finite values overflowed a group
    sum (``"zero-threshold"``) or ``max - min`` (``"range"``).

    Args:
        stats: FP32 stats of shape ``[columns, 2]`` from ``quantize_columns``.
        rule: The rule that made them (default: ``"range"``).
    """
    if rule == "range":
        return torch.isfinite(stats[:, 1] - stats[:, 0])
    return torch.isfinite(stats).all(dim=1)


def packed_size(numel: int, bits: int) -> int:
    """Bytes that ``numel`` codes of ``bits`` bits take once packed: ``ceil(numel * bits / 8)``.

    Args:
        numel: The number of codes.
        bits: Bits per code (1, 2, 4 or 8).

    Examples:
        >>> from lowprec.distributed import packed_size
        >>> packed_size(1000, 1), packed_size(1000, 4)
        (125, 500)
    """
    return -(-numel * bits // 8)


def pack_codes(codes: torch.Tensor, *, bits: int = 1) -> torch.Tensor:
    """Pack a flat ``uint8`` tensor of ``bits``-bit codes, ``8 // bits`` per byte, lowest first.

    Args:
        codes: 1-D ``uint8`` tensor, every value below ``2**bits``.
        bits: Code width: 1, 2, 4 or 8 (default: 1).

    Returns:
        A 1-D ``uint8`` tensor of ``packed_size(codes.numel(), bits)`` bytes; code ``i`` sits in
        byte ``i // (8 // bits)`` at bit ``bits * (i % (8 // bits))``. Unused high bits of the
        last byte are 0.
    """
    check_quantizer(bits=bits, rule="range")
    if codes.dtype != torch.uint8 or codes.dim() != 1:
        raise TypeError(f"codes must be a 1-D uint8 tensor, got {codes.dtype} of "
                        f"shape {tuple(codes.shape)}.")
    if bits == 8:
        return codes.clone()
    per = 8 // bits
    n = codes.numel()
    m = packed_size(n, bits)
    if n != m * per:  # pad the last byte's unused slots with code 0
        codes = torch.cat([codes, codes.new_zeros(m * per - n)])
    slots = codes.view(m, per)  # row b holds the codes of byte b
    out = slots[:, 0].clone()
    for j in range(1, per):
        out.bitwise_or_(slots[:, j] << (bits * j))  # code j of the byte goes to bits [bits*j, bits*j+bits)
    return out


def unpack_codes(packed: torch.Tensor, numel: int, *, bits: int = 1) -> torch.Tensor:
    """Unpack ``numel`` codes of ``bits`` bits from ``packed`` (the inverse of ``pack_codes``).

    Args:
        packed: 1-D ``uint8`` tensor of at least ``packed_size(numel, bits)`` bytes.
        numel: How many codes to return.
        bits: Code width: 1, 2, 4 or 8 (default: 1).

    Returns:
        A 1-D ``uint8`` tensor of ``numel`` codes.
    """
    check_quantizer(bits=bits, rule="range")
    m = packed_size(numel, bits)
    if packed.dtype != torch.uint8 or packed.dim() != 1 or packed.numel() < m:
        raise ValueError(
            f"packed must be a 1-D uint8 tensor of at least {m} bytes for {numel} codes of "
            f"{bits} bits, got {packed.dtype} of shape {tuple(packed.shape)}."
        )
    if bits == 8:
        return packed[:numel].clone()
    per = 8 // bits
    mask = (1 << bits) - 1
    src = packed[:m]
    out = torch.empty(m, per, dtype=torch.uint8, device=packed.device)
    for j in range(per):
        out[:, j] = (src >> (bits * j)) & mask  # code j of each byte: shift down, keep `bits` bits
    return out.view(-1)[:numel]
