"""One parameter's update as the eager and the compiled steps both run it: load the FP32 master,
apply the rule, store, write.

``_param_update`` is the whole step of a tensor (or a chunk, or a bucket's piece); the compiled step
runs it under ``torch.compile``. ``_param_update_pairs`` is the same on words of two elements (the
compiled CPU step of split and stochastic rounding), ``_param_sums`` and ``_param_sums_pairs`` the
read-only pass of a rule with whole-tensor norms. They take plain tensors and the rule's pure math,
and write only after everything is computed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from lowprec.numerics import (
    _pack_f32_pairs,
    _pack_nearest_bf16_pairs,
    _unpack_bf16_pairs,
    _unpack_f32_pairs,
    hash_bits,
    sum_squares,
    sum_squares_pairs,
)
from lowprec.optim import qstate as qstate_mod
from lowprec.optim.storage import MasterStorage

if TYPE_CHECKING:  # pragma: no cover
    from lowprec.optim._typing import QFormats

# Elements per piece of the eager step on large tensors, per device type (another takes
# CUDA's): the temporaries stay in cache on the CPU, and the step's peak memory within 5% of
# what it keeps (docs/architecture.md, "Device choices").
_EAGER_CHUNKS = {"cpu": 1 << 16, "cuda": 1 << 22}


def _eager_chunk(device: torch.device) -> int:
    """Elements per piece of the eager step on ``device`` (``_EAGER_CHUNKS``)."""
    return _EAGER_CHUNKS.get(device.type, _EAGER_CHUNKS["cuda"])


# Indices up to here are int32 (a cheaper hash), past it int64 (tests lower it).
_INT32_MAX = 2**31 - 1


def _descent(
    g: torch.Tensor, flags: dict[str, Any]
) -> tuple[torch.Tensor, dict[str, Any]]:
    """The gradient the rule descends along (negated where the flag ``maximize`` is on) and the
    rule's own flags."""
    rest = {k: v for k, v in flags.items() if k != "maximize"}
    return (-g if flags.get("maximize") else g), rest


def _inputs(
    p: torch.Tensor,
    grad: torch.Tensor,
    sbufs: dict[str, torch.Tensor],
    mbufs: dict[str, torch.Tensor],
    storage: MasterStorage,
    inv_scale: torch.Tensor | None,
    qstate: tuple[tuple[str, str], ...] = (),
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """The rule's FP32 inputs: the master, the (unscaled) gradient, the buffers (codes decoded)."""
    g = grad.float() if inv_scale is None else grad.float() * inv_scale
    fmts = dict(qstate)
    scales = set(map(qstate_mod.scale_key, fmts))
    m = {k: qstate_mod.decode_as(v, mbufs[qstate_mod.scale_key(k)], fmts[k]) if k in fmts
         else v.float() for k, v in mbufs.items() if k not in scales}
    return storage.load(p, sbufs), g, m


def _blocks(
    p: torch.Tensor,
    grad: torch.Tensor,
    sbufs: dict[str, torch.Tensor],
    mbufs: dict[str, torch.Tensor],
    qstate: QFormats,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Flat tensors as rows of ``qstate.BLOCK`` elements (4-bit codes: a block's two halves), the
    quantized buffers' scales as a column: the shapes the encoders and decoders take."""
    four = qstate_mod.four_bit(qstate)
    role = _roles(qstate)
    # (told that the size is a multiple of the block, the compiler indexes rows without a modulo)
    torch._check(p.numel() % qstate_mod.BLOCK == 0)
    rows = qstate_mod.rows
    return (rows(p, four), rows(grad, four), {k: rows(v, four) for k, v in sbufs.items()},
            {k: rows(v, four, role.get(k, "values")) for k, v in mbufs.items()})


def _roles(qstate: QFormats) -> dict[str, str]:
    """Each quantized buffer's ``qstate.rows`` role, ``"codes"``, and its scales', ``"scale"``."""
    role = {k: "codes" for k, _ in qstate}
    role.update({qstate_mod.scale_key(k): "scale" for k, _ in qstate})
    return role


def _param_sums(
    p: torch.Tensor,
    grad: torch.Tensor,
    sbufs: dict[str, torch.Tensor],
    mbufs: dict[str, torch.Tensor],
    c: dict[str, Any],
    *,
    storage: MasterStorage,
    norm_terms: Callable[..., tuple[torch.Tensor, ...]],
    flags: dict[str, bool],
    inv_scale: torch.Tensor | None = None,
    qstate: tuple[tuple[str, str], ...] = (),
    rows: bool = False,
) -> torch.Tensor:
    """The sums of squares of the rule's ``norm_terms`` over ``p`` (read-only; FP64). ``rows``: each
    row a parameter, the sums per row, shaped (terms, rows, 1) to broadcast over its elements."""
    if qstate:
        p, grad, sbufs, mbufs = _blocks(p, grad, sbufs, mbufs, qstate)
    w, g, m = _inputs(p, grad, sbufs, mbufs, storage, inv_scale, qstate)
    g, flags = _descent(g, flags)
    return _stacked_sums(norm_terms(w, g, m, c, **flags), rows)


def _stacked_sums(terms: tuple[torch.Tensor, ...], rows: bool) -> torch.Tensor:
    """``sum_squares`` of each of ``terms``, stacked; ``rows``: per row."""
    if rows:  # (FP64 as sum_squares: each square exact, the row's order of adding unseen)
        return torch.stack([t.double().square().sum(-1, keepdim=True) for t in terms])
    return torch.stack([sum_squares(t) for t in terms])


def _param_sums_pairs(
    p: torch.Tensor,
    grad: torch.Tensor,
    sbufs: dict[str, torch.Tensor],
    mbufs: dict[str, torch.Tensor],
    c: dict[str, Any],
    *,
    storage: MasterStorage,
    norm_terms: Callable[..., tuple[torch.Tensor, ...]],
    flags: dict[str, bool],
    dtypes: tuple[tuple[str, torch.dtype], ...],
    inv_scale: torch.Tensor | None = None,
    rows: bool = False,
) -> torch.Tensor:
    """``_param_sums`` on pairs of elements (the words of ``_param_update_pairs``)."""
    (we, ge, me), (wo, go, mo) = _pair_inputs(p, grad, sbufs, mbufs, storage, dict(dtypes),
                                              inv_scale)
    (ge, _), (go, flags) = _descent(ge, flags), _descent(go, flags)
    even = norm_terms(we, ge, me, c, **flags)
    odd = norm_terms(wo, go, mo, c, **flags)
    if rows:
        return _stacked_sums(even, True) + _stacked_sums(odd, True)
    return torch.stack([sum_squares_pairs(a, b) for a, b in zip(even, odd, strict=True)])


def _param_update(
    p: torch.Tensor,
    grad: torch.Tensor,
    sbufs: dict[str, torch.Tensor],
    mbufs: dict[str, torch.Tensor],
    c: dict[str, Any],
    key_lo: int | torch.Tensor,
    key_hi: int | torch.Tensor,
    *,
    storage: MasterStorage,
    math: Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]],
    flags: dict[str, bool],
    offset: int = 0,
    inv_scale: torch.Tensor | None = None,
    skip: torch.Tensor | None = None,
    base: torch.Tensor | None = None,
    qstate: tuple[tuple[str, str], ...] = (),
    shape: tuple[int, ...] | None = None,
    idx: torch.Tensor | None = None,
    owner: torch.Tensor | None = None,
) -> None:
    """The whole step of one parameter: load the master, update in FP32, store, then write.

    ``qstate``: the buffers kept as codes, each with its format; every tensor is then taken as rows
    of ``qstate.BLOCK`` elements, and ``shape`` is the parameter's own, for a rule that needs it.
    ``offset``: the index of ``p``'s first element in its parameter, and ``base`` (0-d int64) moves
    every index (a DTensor's shard): both key the random bits; ``idx`` and ``owner`` key a gathered
    piece per word (``_random_bits``). Under a loss scaler ``inv_scale`` multiplies the gradient,
    which is written back unscaled (as GradScaler leaves it), and ``skip`` (0-d bool) writes back
    the old values."""
    if qstate:
        p, grad, sbufs, mbufs = _blocks(p, grad, sbufs, mbufs, qstate)
    w, g, m = _inputs(p, grad, sbufs, mbufs, storage, inv_scale, qstate)
    rows, unscaled = w.shape, g  # (the gradient written back as the step viewed it)
    g, flags = _descent(g, flags)
    if shape is not None:  # (a rule that needs the parameter's shape, its state in rows)
        w, g, m = w.view(shape), g.view(shape), {k: v.view(shape) for k, v in m.items()}
    new_w, new_m = math(w, g, m, c, **flags)
    if shape is not None:
        new_w, new_m = new_w.reshape(rows), {k: v.reshape(rows) for k, v in new_m.items()}
    bits = None
    if storage.needs_random_bits:
        bits = _random_bits(offset, p.numel(), p.device, key_lo, key_hi, p.dtype, base,
                            idx, owner)
        bits = bits.view(p.shape)
    new_p, new_s = storage.store(new_w, p, sbufs, bits)
    new_q = {}  # (quantized buffers: their codes and scales, written as they are)
    for k, f in qstate:
        new_q[k], new_q[qstate_mod.scale_key(k)] = qstate_mod.encode_as(new_m.pop(k), f)
    _write(p, grad, sbufs, mbufs, new_p, new_s, new_m, new_q,
           None if inv_scale is None else unscaled, skip)


def _write(
    p: torch.Tensor, grad: torch.Tensor, sbufs: dict[str, torch.Tensor],
    mbufs: dict[str, torch.Tensor], new_p: torch.Tensor, new_s: dict[str, torch.Tensor],
    new_m: dict[str, torch.Tensor], new_q: dict[str, torch.Tensor],
    unscaled: torch.Tensor | None, skip: torch.Tensor | None,
) -> None:
    """A step's writes, once everything is computed: the rule's buffers (``new_m`` in FP32,
    ``new_q`` as kept: codes and scales, or words of pairs), the storage's, the parameter, and
    the gradient ``unscaled`` where given. ``skip`` (0-d bool): write back what was there, bit
    for bit."""
    if skip is not None:
        new_p = torch.where(skip, p, new_p)
        new_s = {k: torch.where(skip, sbufs[k], v) for k, v in new_s.items()}
        new_m = {k: torch.where(skip, mbufs[k].float(), v) for k, v in new_m.items()}
        new_q = {k: torch.where(skip, mbufs[k], v) for k, v in new_q.items()}
    for k, v in (*new_m.items(), *new_q.items()):
        mbufs[k].copy_(v)
    for k, v in new_s.items():
        sbufs[k].copy_(v)
    p.copy_(new_p)
    if unscaled is not None:
        grad.copy_(unscaled)


def _random_bits(
    offset: int, numel: int, device: torch.device, key_lo: Any, key_hi: Any, dtype: torch.dtype,
    base: torch.Tensor | None = None, idx: torch.Tensor | None = None,
    owner: torch.Tensor | None = None,
) -> torch.Tensor:
    """Stochastic rounding's random bits for elements ``offset`` to ``offset + numel - 1``.

    BF16 element ``i`` takes a 16-bit half of the 32-bit hash of ``i // 2`` (low for even ``i``),
    one hash per pair, as the pairs kernel; other dtypes the hash of ``i``. ``base`` (0-d int64) is
    added to every hashed index (a compiled shard's first element's, or for BF16 first pair's).
    ``idx`` and ``owner``: a gathered piece's words' indices within their parameters and their
    parameters' places, whose key halves ``key_lo`` and ``key_hi`` hold."""
    # (int32 indices where they fit: much cheaper without 64-bit vector multiplies; same bits)
    wide = offset + numel > _INT32_MAX
    itype = torch.int64 if wide else torch.int32
    if dtype != torch.bfloat16:
        idx = torch.arange(offset, offset + numel, device=device, dtype=itype)
        return hash_bits(idx if base is None else idx + base, key_lo, key_hi)
    if numel == 0:
        return torch.empty(0, device=device, dtype=torch.int32)
    # Each pair's hash once: its low half for the even element, its high half (shifted down)
    # for the odd one, interleaved; the elements asked for are a slice of them.
    first = offset // 2
    if owner is not None and idx is not None:
        words, key_lo, key_hi = idx, key_lo[owner], key_hi[owner]
    else:
        words = torch.arange(first, (offset + numel - 1) // 2 + 1, device=device, dtype=itype)
    h = hash_bits(words if base is None else words + base, key_lo, key_hi)
    halves = torch.stack([h & 0xFFFF, (h >> 16) & 0xFFFF], dim=-1).view(-1)
    start = offset - 2 * first
    return halves[start:start + numel]


def _unpack_pairs(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return _unpack_bf16_pairs(t) if dtype == torch.bfloat16 else _unpack_f32_pairs(t)


_RuleInputs = tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]


def _pair_inputs(
    p: torch.Tensor,
    grad: torch.Tensor,
    sbufs: dict[str, torch.Tensor],
    mbufs: dict[str, torch.Tensor],
    storage: MasterStorage,
    kinds: dict[str, torch.dtype],
    inv_scale: torch.Tensor | None,
) -> tuple[_RuleInputs, _RuleInputs]:
    """``_inputs`` on words: the rule's FP32 inputs of the even elements and of the odd ones;
    ``kinds`` gives the gradient's and each buffer's dtype."""
    g_even, g_odd = _unpack_pairs(grad, kinds["grad"])
    if inv_scale is not None:
        g_even, g_odd = g_even * inv_scale, g_odd * inv_scale
    w_even, w_odd = storage.load_pairs(p, sbufs)
    halves = {k: _unpack_pairs(v, kinds[k]) for k, v in mbufs.items()}
    return (
        (w_even, g_even, {k: h[0] for k, h in halves.items()}),
        (w_odd, g_odd, {k: h[1] for k, h in halves.items()}),
    )


def _pack_pairs(even: torch.Tensor, odd: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Words holding ``even`` and ``odd`` (FP32) rounded to ``dtype`` as ``copy_`` rounds."""
    if dtype == torch.bfloat16:
        return _pack_nearest_bf16_pairs(even, odd)
    return _pack_f32_pairs(even, odd)


def _param_update_pairs(
    p: torch.Tensor,
    grad: torch.Tensor,
    sbufs: dict[str, torch.Tensor],
    mbufs: dict[str, torch.Tensor],
    c: dict[str, Any],
    key_lo: int | torch.Tensor,
    key_hi: int | torch.Tensor,
    *,
    storage: MasterStorage,
    math: Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]],
    flags: dict[str, bool],
    dtypes: tuple[tuple[str, torch.dtype], ...],
    inv_scale: torch.Tensor | None = None,
    skip: torch.Tensor | None = None,
    idx: torch.Tensor | None = None,
    owner: torch.Tensor | None = None,
    base: torch.Tensor | None = None,
) -> None:
    """``_param_update`` on pairs of elements, for the compiled CPU step of split and stochastic
    rounding.

    Every tensor is the words of a parameter's first ``2 * len(p)`` elements (int32 for 16-bit
    tensors, int64 for 32-bit ones; "Pairs" in ``lowprec.numerics``); ``dtypes`` gives the
    gradient's and each buffer's dtype. The rule runs unchanged on the even and on the odd elements,
    unpacked and packed with exact bit operations, so each element gets ``_param_update``'s bits;
    Inductor's C++ code vectorizes the words where it cannot vectorize int16 elements. ``idx``,
    ``owner`` and ``base``: as ``_random_bits``."""
    kinds = dict(dtypes)
    even, odd = _pair_inputs(p, grad, sbufs, mbufs, storage, kinds, inv_scale)
    unscaled = None if inv_scale is None else _pack_pairs(even[1], odd[1], kinds["grad"])
    (ge, _), (go, flags) = _descent(even[1], flags), _descent(odd[1], flags)
    new_we, m_even = math(even[0], ge, even[2], c, **flags)
    new_wo, m_odd = math(odd[0], go, odd[2], c, **flags)
    bits = None
    if storage.needs_random_bits:  # one hash per pair: see _random_bits
        if idx is None:
            idx = torch.arange(p.numel(), device=p.device,
                               dtype=torch.int64 if p.numel() > _INT32_MAX else torch.int32)
        elif owner is not None:
            # (per-word keys are tensors; no typing.cast in a function torch.compile traces)
            key_lo, key_hi = key_lo[owner], key_hi[owner]  # type: ignore[index]
        bits = hash_bits(idx if base is None else idx + base, key_lo, key_hi)
    new_p, new_s = storage.store_pairs(new_we, new_wo, p, sbufs, bits)
    words = {k: _pack_pairs(m_even[k], m_odd[k], kinds[k]) for k in m_even}
    _write(p, grad, sbufs, mbufs, new_p, new_s, {}, words, unscaled, skip)


_WORDS = {2: torch.int32, 4: torch.int64}


def _pair_words(t: torch.Tensor, n: int) -> torch.Tensor:
    """The first ``n`` (even) elements of contiguous ``t`` as words of two elements each."""
    flat = t.view(-1)
    return (flat if n == flat.numel() else flat[:n]).view(_WORDS[t.element_size()])
