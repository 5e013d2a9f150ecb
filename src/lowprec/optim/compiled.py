"""The compiled (fused) step: the kernels and their cache, and a tensor's compiled step prepared
(``prepare_fused``) and run (``run_fused``).

A kernel is ``update._param_update`` (or another function of ``update``) compiled once per variant
(``_compiled_kernel``). A bucket keeps what ``prepare_fused`` makes. A compilation failure
(``_COMPILE_ERRORS``) writes nothing: the caller steps eagerly and ``_disable_fused`` warns. Tests
replace ``_compiled_kernel`` and ``pairs_plan``: call them through this module.
"""

from __future__ import annotations

import functools
import sys
import types
import warnings
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, cast

import torch
from torch._dynamo.exc import FailOnRecompileLimitHit

from lowprec.numerics import COMPILED_AS_EAGER, _fold_counters, _seed_halves, stream_key_halves
from lowprec.optim import core
from lowprec.optim import qstate as qstate_mod
from lowprec.optim.options import _default_mode
from lowprec.optim.shards import all_reduce_sums
from lowprec.optim.storage import MasterStorage
from lowprec.optim.update import (
    _pair_words,
    _param_sums,
    _param_sums_pairs,
    _param_update,
    _param_update_pairs,
    _roles,
)
from lowprec.optim.vector_casts import vector_casts

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed import ProcessGroup

    from lowprec.optim._typing import PairDtypes, QFormats
    from lowprec.optim.core import Rule, Stepped

# Failures of torch.compile that leave nothing written (no C++ compiler, no Triton, an
# unsupported op): the step falls back to eager with a warning. (Dynamo's errors derive from
# RuntimeError, but for FailOnRecompileLimitHit: from Exception alone.)
_COMPILE_ERRORS: tuple[type[BaseException], ...] = (
    RuntimeError, OSError, ImportError, FailOnRecompileLimitHit)

_KERNELS: dict[Any, _Kernel] = {}
#: Rows of a block per compiled call of a parameter with 8-bit state, per device type (another
#: takes CUDA's): docs/architecture.md, "Device choices".
_QROWS = {"cpu": 2048, "cuda": 1 << 15}
_PAIR_DTYPES = (torch.bfloat16, torch.float32)
_ZERO_KEY = torch.zeros((), dtype=torch.int64)


def _key_tensors(
    lo: int | torch.Tensor, hi: int | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The random key's halves as 0-d tensors (a constant zero where unused)."""
    if isinstance(lo, torch.Tensor):
        return lo, cast(torch.Tensor, hi)  # (both halves are tensors, or both numbers)
    if lo == 0 and hi == 0:
        return _ZERO_KEY, _ZERO_KEY
    return torch.tensor(lo), torch.tensor(hi)


def _compiled_kernel(
    rule: Rule, storage: MasterStorage, flags: dict[str, bool], *, scaled: str | bool = False,
    fn: Callable[..., Any] = _param_update, extra_key: tuple[Any, ...] = (),
    signature: tuple[Any, ...] = (), fullgraph: bool = True,
) -> _Kernel:
    """``fn`` (default ``_param_update``) compiled for one variant, cached in ``_KERNELS``.

    The key holds everything that changes the generated code: the rule's math (not its optimizer),
    storage, flags, scaler mode, ``signature`` (device type and dtypes). Each variant compiles its
    own copy of the code object, so Dynamo keeps a cache and recompile budget per variant. Shapes
    are dynamic. ``fullgraph`` False: the rule may break the graph (``Rule.graph_breaks``)."""
    key = (rule.math, rule.norm_terms, storage.name, tuple(sorted(flags.items())), scaled,
           fn.__name__, extra_key, signature, fullgraph)
    kernel = _KERNELS.get(key)
    if kernel is None:
        code = fn.__code__
        what = "step" if fn is _param_update else fn.__name__.strip("_")
        what += "".join(f"_{str(v).split('.')[-1]}" for _, v in extra_key)
        name = (f"lowprec_{rule.math.__name__.removesuffix('_math')}_{storage.name}"
                f"{f'_{scaled}' if scaled else ''}_{what}")
        if sys.version_info >= (3, 11):
            code = code.replace(co_name=name, co_qualname=name)
        else:
            code = code.replace(co_name=name)
        variant = types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)
        variant.__kwdefaults__ = fn.__kwdefaults__
        # emulate_precision_casts: else x.to(bf16).float() folds to x and Kahan's remainder to 0.
        # cpp.dynamic_threads: the parallel loop whatever size compiles first (the on-disk cache
        # would hand a small size's single-threaded kernel to every size). Random bits: the
        # GPU's realize threshold, else the hash is written anew at each use (half a cold
        # compile). docs/architecture.md, "Tests and CI's time", has the figures.
        hash_ops = {"realize_opcount_threshold": 30} if storage.needs_random_bits else {}
        kernel = _Kernel(torch.compile(
            variant, dynamic=True, fullgraph=fullgraph,
            options={"emulate_precision_casts": True, "cpp.dynamic_threads": True,
                     **hash_ops, **COMPILED_AS_EAGER},
        ), name)
        _KERNELS[key] = kernel
    return kernel


def _signature(
    p: torch.Tensor,
    grad: torch.Tensor,
    sbufs: dict[str, torch.Tensor],
    mbufs: dict[str, torch.Tensor],
) -> tuple[Any, ...]:
    """The device type and every dtype of a step's tensors (part of a kernel's key)."""
    return (p.device.type, p.dtype, grad.dtype,
            *((k, v.dtype) for k, v in sbufs.items()), *((k, v.dtype) for k, v in mbufs.items()))


def _fused_enabled(opt: Stepped, group: dict[str, Any], p: torch.Tensor) -> bool:
    """Whether ``p``'s step is compiled: ``fused=True``, or ``fused=None`` where
    ``_default_compiles`` (warning once where it does not); never after a compile of ``opt`` failed.
    """
    fused = group["fused"]
    if fused is False or core.stages(opt).fused_broken:
        return False
    if fused is None and not _default_compiles(p.device.type):
        missing = _default_mode() == "auto" and _compiler(p.device.type)
        if missing and missing not in _WARNED:
            _WARNED.add(missing)
            warnings.warn(f"lowprec: {missing}", RuntimeWarning, stacklevel=4)
        return False
    return True


def _default_compiles(device_type: str) -> bool:
    """Whether ``fused=None`` compiles on ``device_type`` (``LOWPREC_FUSED``, ``_compiler``)."""
    mode = _default_mode()
    return mode == "fused" or (mode == "auto" and not _compiler(device_type))


_WARNED: set[str] = set()
def inductor_options() -> dict[str, bool]:
    """Each Inductor option the kernels are compiled with (``numerics.INDUCTOR_OPTIONS``) and
    whether this torch has it: the default step compiles only where all exist (``_compiler``)."""
    from lowprec.numerics import INDUCTOR_OPTIONS

    try:
        from torch._inductor import config
    except Exception:  # (a torch without Inductor)
        return dict.fromkeys(INDUCTOR_OPTIONS, False)
    found: dict[str, bool] = {}
    for name in INDUCTOR_OPTIONS:
        obj: Any = config
        for part in name.split("."):
            obj = getattr(obj, part, _NO_OPTION)
            if obj is _NO_OPTION:
                break
        found[name] = obj is not _NO_OPTION
    return found


_NO_OPTION = object()
#: The first torch whose Inductor C++ code keeps a value's round trip through BF16/FP16: in
#: 2.11 and 2.12 ``to_dtype`` caches the inverse cast, so Kahan's remainder compiles to zero
#: and a compiled CPU Kahan step falls back to eager there (tests/test_floor.py). Triton has no
#: such cache.
_CPU_ROUND_TRIPS_KEPT = (2, 13)


class RoundTripsDropped(RuntimeError):
    """Raised and caught (the step falls back to eager) before anything is written, where
    ``fused=True`` asks for a kernel this torch's C++ code would compile without Kahan's round trip
    through 16 bits (``_CPU_ROUND_TRIPS_KEPT``)."""


def _cpu_drops_round_trips() -> bool:
    """Whether this torch's C++ code drops a round trip through BF16/FP16."""
    version = torch.torch_version.TorchVersion(torch.__version__)
    # (TorchVersion compares with tuples; type checkers see a str)
    older: bool = version < _CPU_ROUND_TRIPS_KEPT  # type: ignore[operator]
    return older


def _round_trips_dropped(p: torch.Tensor) -> bool:
    """Whether a compiled CPU step of 16-bit ``p`` would drop it."""
    return (p.device.type == "cpu" and p.dtype in (torch.bfloat16, torch.float16)
            and _cpu_drops_round_trips())


@functools.cache
def _compiler(device_type: str) -> str:
    """Why the default step cannot compile on ``device_type``, or "": Inductor must have every
    option (``inductor_options``); the CPU needs a C++ compiler and ``_CPU_ROUND_TRIPS_KEPT``, CUDA
    Triton."""
    version = torch.torch_version.TorchVersion(torch.__version__)
    if device_type in ("cpu", "cuda"):
        missing = [name for name, found in inductor_options().items() if not found]
        if missing:
            return (f"no fused step with torch {version}: its Inductor lacks the "
                    f"option(s) {', '.join(missing)} that lowprec's fused step is compiled with, "
                    "so the optimizers' default step stays eager, with the same results more "
                    "slowly. The fused step needs torch>=2.11: upgrade torch for it, or set "
                    "LOWPREC_FUSED=0 to silence this warning.")
    if device_type == "cpu" and _cpu_drops_round_trips():
        need = ".".join(map(str, _CPU_ROUND_TRIPS_KEPT))
        return (f"no fused step on the CPU with torch {version}: its Inductor C++ code skips the "
                "round trip of a value through bfloat16/float16 (x.to(bfloat16).float() becomes "
                "x), which would zero the compensation of master='kahan', so the optimizers' "
                "default step on the CPU stays eager, with the same results more slowly. The "
                f"fused step on the CPU needs torch>={need}: upgrade torch for it, or set "
                "LOWPREC_FUSED=0 to silence this warning.")
    if device_type == "cpu":
        try:
            from torch._inductor.cpp_builder import get_cpp_compiler

            get_cpp_compiler()
        except Exception as e:  # (Inductor's InvalidCxxCompiler, or a torch without it)
            return (f"no C++ compiler for torch.compile ({type(e).__name__}); the optimizers' "
                    "default step stays eager, with the same results more slowly. Install a C++ "
                    "compiler (e.g. g++) for the fused step, or set LOWPREC_FUSED=0 to silence "
                    "this warning.")
        return ""
    if device_type == "cuda":
        try:
            from torch.utils._triton import has_triton

            found = has_triton()
        except ImportError:  # pragma: no cover
            found = False
        return "" if found else (
            "Triton is not installed, so torch.compile cannot compile the optimizers' step on "
            "CUDA; it stays eager, with the same results more slowly. Install triton for the "
            "fused step, or set LOWPREC_FUSED=0 to silence this warning.")
    return f"no fused step on {device_type}"


class _Kernel:
    """A compiled kernel, called with its tensors unviewed and Inductor's vector casts on;
    ``warm`` once it has run (compiled)."""

    __slots__ = ("fn", "name", "warm")

    def __init__(self, fn: Callable[..., Any], name: str) -> None:
        self.fn, self.name, self.warm = fn, name, False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with vector_casts():  # (any call can compile: a new pattern of sizes)
            out = self.fn(*_unviewed(args), **_unviewed(kwargs))
        self.warm = True
        return out


def _unviewed(x: Any) -> Any:
    """``x`` (tensors, in tuples and dicts too) with each view replaced by a detached alias: Dynamo
    guards a view's base, so one kernel compiled anew for each kind of base. Kept views are detached
    where they are made, so a step adds no op per kept view."""
    if isinstance(x, torch.Tensor):
        return x.detach() if x._is_view() else x
    if isinstance(x, dict):
        return {k: _unviewed(v) for k, v in x.items()}
    if isinstance(x, tuple):
        return tuple(_unviewed(v) for v in x)
    return x


def _step_keys(lo: torch.Tensor, hi: torch.Tensor, counts: torch.Tensor, index: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """``numerics.stream_key_halves(seed, count + 1, index)`` per element of ``counts`` (the counts
    before the step) and ``index``, from the seed's halves (0-d: ``numerics._seed_halves``)."""
    return _fold_counters(lo, hi, counts.long() + 1, index)


@functools.cache
def _keys_kernel() -> _Kernel:
    """``_step_keys`` compiled: one call for its ~130 integer operations. Each mix's result is
    kept in a buffer (``realize_opcount_threshold``), else each use writes the whole hash below it
    anew: 17 s of compiling against 2.4 s on a Zen 4 (docs/architecture.md)."""
    return _Kernel(torch.compile(
        _step_keys, dynamic=True, fullgraph=True,
        options={**COMPILED_AS_EAGER, "realize_opcount_threshold": 4}), "lowprec_step_keys")


def step_keys(opt: Stepped, group: dict[str, Any], p: torch.Tensor, counts: torch.Tensor,
              index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stochastic rounding's key halves for parameters ``index`` of ``group`` at ``counts`` (1-d,
    the counts before this step; ``p`` one of them): one compiled call where their step is fused,
    else the eager form's ~130 calls (each a launch on a GPU); the same bits either way."""
    seed = group["seed"]
    if _fused_enabled(opt, group, p):
        kept = core.stages(opt).index_tensors
        # (the seed's halves as two 0-d tensors: Dynamo would guard a (2,) one's length equal to
        # a pair of counts', and compile again for others)
        if ("seed_hi", seed, counts.device) not in kept:
            for name, half in zip(("seed_lo", "seed_hi"), _seed_halves(seed), strict=True):
                kept[name, seed, counts.device] = torch.tensor(half, device=counts.device)
        halves = (kept["seed_lo", seed, counts.device], kept["seed_hi", seed, counts.device])
        one = index.numel() == 1  # (two elements: Dynamo would specialise a length of 1)
        try:
            lo, hi = _keys_kernel()(*halves, *((counts.repeat(2), index.repeat(2)) if one
                                               else (counts, index)))
            return (lo[:1], hi[:1]) if one else (lo, hi)
        except _COMPILE_ERRORS as e:  # (nothing written: the eager form below)
            _disable_fused(opt, e)
    return cast("tuple[torch.Tensor, torch.Tensor]",
                stream_key_halves(seed, counts.long() + 1, index))


def _disable_fused(opt: Stepped, error: BaseException) -> None:
    core.stages(opt).fused_broken = True
    if isinstance(error, RoundTripsDropped):
        how = "Upgrade torch for the fused step, or pass fused=False to silence this warning."
    else:
        how = ("Install a C++ compiler (CPU) or Triton (GPU), or pass fused=False to silence "
               "this warning.")
    # (the cause: its first line, and the next where the first ends with ":")
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    cause = " ".join(lines[:2] if lines and lines[0].endswith(":") else lines[:1])
    warnings.warn(f"lowprec: the fused (torch.compile) optimizer step is unavailable here "
                  f"({type(error).__name__}: {cause}); falling back to the eager step, which "
                  f"gives the same results more slowly. {how}", RuntimeWarning, stacklevel=4)


def _step_view(f: _Fused, t: torch.Tensor, role: str = "values") -> torch.Tensor:
    """The view of ``t`` (the parameter, its gradient or a buffer) that ``f``'s kernels take: rows
    of a block where the state has codes (``qstate.rows``, as ``role``), else flat or words of
    pairs, as ``f.rows`` rows where set (a bucket's parameters of one size; never with codes).
    Always a new view, detached: Dynamo guards a view's base (``_unviewed``), and handed a leaf, or
    a view of a BF16 parameter with an FP32 gradient, it fails."""
    if f.qkw:  # (4-bit: a block's two halves; each quantized buffer's scales a column)
        v = qstate_mod.rows(t, qstate_mod.four_bit(f.qkw["qstate"]), role)
    else:
        v = t.view(-1) if f.pairs is None else _pair_words(t, f.n)
    return (v.view(f.rows, -1) if f.rows else v).detach()


def _row_bases(f: _Fused, pieces: list[slice]) -> list[torch.Tensor] | list[None]:
    """Each piece's ``base`` for the random bits (``update._random_bits``), made once."""
    if not f.storage.needs_random_bits:
        return [None] * len(pieces)
    cached = f.bases
    if cached is None or len(cached) != len(pieces):
        half = f.p.dtype == torch.bfloat16
        cached = f.bases = [
            torch.tensor((f.start + sl.start * qstate_mod.BLOCK) // (2 if half else 1),
                         dtype=torch.int64)
            for sl in pieces
        ]
    return cached


class _Fused:
    """A compiled step prepared by ``prepare_fused``."""

    base: torch.Tensor | None
    bases: list[torch.Tensor] | None
    flags: dict[str, bool]
    kernel: _Kernel
    mbufs: dict[str, torch.Tensor]
    rule: Rule
    n: int
    p: torch.Tensor
    pairs: PairDtypes | None
    qkw: dict[str, QFormats]
    row_cuts: list[tuple[slice, dict[str, torch.Tensor], dict[str, torch.Tensor]]] | None
    rows: int
    sbufs: dict[str, torch.Tensor]
    shards: tuple[ProcessGroup, ...]
    start: int
    storage: MasterStorage
    sums_kernel: _Kernel | None
    #: (flat views, or words of pairs, of the storage's and of the rule's buffers)
    views: tuple[dict[str, torch.Tensor], ...]


def prepare_fused(
    rule: Rule,
    storage: MasterStorage,
    p: torch.Tensor,
    grad: torch.Tensor,
    sbufs: dict[str, torch.Tensor],
    mbufs: dict[str, torch.Tensor],
    *,
    scaled: str | bool = False,
    keyed: bool = False,
    start: int = 0,
    shards: Iterable[ProcessGroup] = (),
    qstate: QFormats = (),
    rows: int = 0,
) -> _Fused:
    """What a compiled step of contiguous ``p`` needs besides its gradient and numbers: flat views
    (or words of pairs, or rows of a block) of its buffers, and its kernels.

    ``keyed``: random keys per word (a gathered piece). ``start``: the index of ``p``'s first
    element in a larger parameter (a DTensor's shard), the kernels' ``base``. ``shards``: the
    process groups a shard's whole-tensor sums add over. ``qstate``: the buffers kept as codes
    (never on pairs). ``rows``: ``p`` is that many parameters of one size, stepped as rows, a rule's
    sums taken per row."""
    f = _Fused()
    flags = rule.flags
    f.rule, f.storage, f.flags, f.p, f.sbufs, f.mbufs = rule, storage, flags, p, sbufs, mbufs
    f.qkw = {"qstate": qstate} if qstate else {}
    f.bases = f.row_cuts = None
    f.rows = rows
    f.pairs = pairs = None if qstate else pairs_plan(rule, storage, p, grad, sbufs, mbufs)
    if storage.name == "kahan" and _round_trips_dropped(p):
        raise RoundTripsDropped(
            f"torch {torch.__version__}'s Inductor C++ code turns x.to({p.dtype}).float() "
            "into x, which zeroes master='kahan''s compensation in this kernel; fixed in torch "
            f"{'.'.join(map(str, _CPU_ROUND_TRIPS_KEPT))}")
    f.n = p.numel() & ~1  # (on pairs, an odd last element takes the eager step)
    f.base, f.start, f.shards = None, start, tuple(shards)
    if start:
        # (bfloat16 hashes pairs: the first pair's index; start is even there)
        f.base = torch.tensor(start // 2 if p.dtype == torch.bfloat16 else start,
                              dtype=torch.int64)
    role = _roles(qstate)
    f.views = ({k: _step_view(f, v) for k, v in sbufs.items()},
               {k: _step_view(f, v, role.get(k, "values")) for k, v in mbufs.items()})
    # (the parameter's view is made by each call: one kept here would keep its storage alive
    # after `p.data = ...`; whole-tensor sums are a pass of their own, so the update keeps no
    # full-size temporaries. Kernels of their own: pairs, 4-bit codes (not a recompilation of the
    # 8-bit one's), rows (2-d tensors).)
    variant = pairs or ((("state", qstate_mod.FOUR_BIT),) if qstate_mod.four_bit(qstate) else ())
    rows_key = (("rows", "rows"),) if rows else ()
    kernel = functools.partial(_compiled_kernel, rule, storage, flags, scaled=scaled,
                               signature=_signature(p, grad, sbufs, mbufs))
    f.sums_kernel = kernel(
        fn=_param_sums if pairs is None else _param_sums_pairs, extra_key=(*variant, *rows_key),
    ) if rule.norms else None
    f.kernel = kernel(
        fn=_param_update if pairs is None else _param_update_pairs,
        extra_key=(*variant, *((("keys", "batched"),) if keyed else ()), *rows_key),
    )
    return f


def run_fused(
    f: _Fused,
    grad: torch.Tensor,
    coeffs: dict[str, Any],
    c32: dict[str, torch.Tensor],
    lo: int | torch.Tensor,
    hi: int | torch.Tensor,
    extra: dict[str, Any],
) -> None:
    """The step prepared in ``f`` with ``grad``; a compile error raises before any write."""
    if f.qkw:
        _run_fused_rows(f, grad, c32, lo, hi, extra)
        return
    storage, flags, pairs, n, p, math = f.storage, f.flags, f.pairs, f.n, f.p, f.rule.math
    sv, mv = f.views
    pv, gv = _step_view(f, p), _step_view(f, grad)
    words: dict[str, Any] = {} if pairs is None else {"dtypes": pairs}
    # (on pairs, an odd last element takes the eager step, with its own index for the random bits)
    tail = slice(n, None) if pairs is not None and n < p.numel() else None
    def flat(d: dict[str, torch.Tensor], sl: slice) -> dict[str, torch.Tensor]:
        return {k: v.view(-1)[sl] for k, v in d.items()}
    if f.sums_kernel is not None:
        c32 = dict(c32)  # the sums below are this parameter's own
        kw: dict[str, Any] = dict(storage=storage, norm_terms=f.rule.norm_terms, flags=flags,
                  inv_scale=extra.get("inv_scale"), **({"rows": True} if f.rows else {}))
        sums = f.sums_kernel(pv, gv, sv, mv, c32, **words, **kw)
        if tail is not None:
            sums = sums + _param_sums(p.view(-1)[tail], grad.view(-1)[tail], flat(f.sbufs, tail),
                                      flat(f.mbufs, tail), coeffs, **kw)
        c32["sums"] = all_reduce_sums(sums, f.shards)
        coeffs = {**coeffs, "sums": c32["sums"]}  # (for the eager last element)
    if f.base is not None:
        extra = {**extra, "base": f.base}
    f.kernel(pv, gv, sv, mv, c32, *_key_tensors(lo, hi), storage=storage, math=math,
             flags=flags, **words, **extra)
    if tail is not None:
        _param_update(
            p.view(-1)[tail], grad.view(-1)[tail], flat(f.sbufs, tail), flat(f.mbufs, tail),
            coeffs, lo, hi, storage=storage, math=math, flags=flags,
            offset=f.start + n, **{k: v for k, v in extra.items() if k != "base"},
        )


def _run_fused_rows(
    f: _Fused,
    grad: torch.Tensor,
    c32: dict[str, torch.Tensor],
    lo: int | torch.Tensor,
    hi: int | torch.Tensor,
    extra: dict[str, Any],
) -> None:
    """The step of a parameter with 8-bit or 4-bit state, a call per ``_QROWS`` rows of a block (a
    rule with norms: every piece's sums first): Inductor's full-size temporaries between its loops
    stay in cache. Each piece's random bits are keyed by its elements' indices (``base``)."""
    pv, gv = _step_view(f, f.p), _step_view(f, grad)
    if f.row_cuts is None:  # (the pieces' views of the state, made once: f's tensors stay)
        sv, mv = f.views
        rows = pv.shape[0]
        step = _QROWS.get(pv.device.type, _QROWS["cuda"])
        pieces = [slice(i, min(i + step, rows)) for i in range(0, rows, step)]
        def cut(d: dict[str, torch.Tensor], sl: slice) -> dict[str, torch.Tensor]:
            return {k: v[sl] for k, v in d.items()}
        f.row_cuts = [(sl, *_unviewed((cut(sv, sl), cut(mv, sl)))) for sl in pieces]
    cuts = f.row_cuts
    kw: dict[str, Any] = dict(storage=f.storage, flags=f.flags, **f.qkw)
    if f.sums_kernel is not None:  # (read-only: the scaler's skip is the update's concern)
        sums = None
        for sl, s_sl, m_sl in cuts:
            part = f.sums_kernel(pv[sl].detach(), gv[sl].detach(), s_sl, m_sl, c32,
                                 norm_terms=f.rule.norm_terms,
                                 inv_scale=extra.get("inv_scale"), **kw)
            sums = part if sums is None else sums + part
        c32 = {**c32, "sums": all_reduce_sums(cast(torch.Tensor, sums), f.shards)}
    keys = _key_tensors(lo, hi)
    bases = _row_bases(f, [sl for sl, _, _ in cuts])
    for (sl, s_sl, m_sl), base in zip(cuts, bases, strict=True):
        f.kernel(pv[sl].detach(), gv[sl].detach(), s_sl, m_sl, c32, *keys, math=f.rule.math,
                 **kw, **extra, **({} if base is None else {"base": base}))


# The strategies whose BF16 CPU step takes pairs of elements (32-bit words): those that work on
# the bits, where the pairs kernel is 1.7-1.8x faster; for the others the elementwise kernel is
# (docs/architecture.md, "The step's host cost: designs measured").
_PAIRS_FASTER = ("split", "stochastic")


def pairs_device(device: torch.device) -> bool:
    """Whether a step on ``device`` may take the pairs kernel: the CPU's."""
    return device.type == "cpu"


def pairs_plan(
    rule: Rule,
    storage: MasterStorage,
    p: torch.Tensor,
    grad: torch.Tensor,
    sbufs: dict[str, torch.Tensor],
    mbufs: dict[str, torch.Tensor],
) -> PairDtypes | None:
    """The ``dtypes`` of a fused step on pairs of elements, or None: a CPU step of a strategy with
    pairs (``pairs_ok``) where they pay (``_PAIRS_FASTER``), a rule that is not whole-tensor, and
    gradient and buffers in BF16 or FP32 starting on a pair boundary."""
    if (
        not storage.pairs_ok(p.dtype) or storage.name not in _PAIRS_FASTER
        or p.numel() < 2 or p.storage_offset() % 2
        or rule.whole
        or not pairs_device(p.device)
    ):
        return None
    plan = [("grad", grad.dtype)]
    if grad.dtype not in _PAIR_DTYPES or grad.storage_offset() % 2:
        return None
    for k, t in mbufs.items():
        if t.dtype not in _PAIR_DTYPES or t.storage_offset() % 2:
            return None
        plan.append((k, t.dtype))
    for t in sbufs.values():
        if t.element_size() not in (2, 4) or t.storage_offset() % 2:
            return None
    return tuple(plan)
