"""The compiled (fused) step: kernels and their cache; a tensor's compiled step prepared and run.

``_compiled_kernel`` compiles ``update._param_update`` (or another function of ``update``) once
per variant: optimizer, strategy, flags, loss-scaler mode and the tensors' device type and dtypes
(``_signature``), with the Inductor settings the step's numerics need; ``_KERNELS`` caches them.
``prepare_fused`` gathers what a compiled step of one contiguous tensor needs besides its
gradient and the step's numbers (``_Fused``: flat views or words of pairs, ``pairs_plan``, and
the kernels), which depends on layouts and dtypes alone, so a bucket keeps it;
``run_fused`` runs it (a sums pass first for a rule with norms; the odd last element of pairs
eagerly). A compilation failure (``_COMPILE_ERRORS``) leaves nothing written: the caller
falls back to the eager step and ``_disable_fused`` turns the fused step off with a warning.
Tests replace ``_compiled_kernel`` and ``pairs_plan``; other modules call them through this one.
"""

from __future__ import annotations

import functools
import os
import sys
import time
import types
import warnings
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, cast

import torch

from lowprec.numerics import COMPILED_AS_EAGER
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
)
from lowprec.optim.vector_casts import vector_casts

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed import ProcessGroup

    from lowprec.optim._typing import PairDtypes, QFormats
    from lowprec.optim.core import OptimizerCore, Rule

# Failures of torch.compile that leave nothing written (no C++ compiler, no Triton, an
# unsupported op): the step falls back to eager with a warning.
_COMPILE_ERRORS: tuple[type[BaseException], ...] = (RuntimeError, OSError, ImportError)
try:  # the Dynamo/Inductor error classes, where this PyTorch has them
    from torch._dynamo import exc as _dynamo_exc

    # (FailOnRecompileLimitHit derives from Exception alone)
    _COMPILE_ERRORS = (*_COMPILE_ERRORS, *(
        getattr(_dynamo_exc, name) for name in ("TorchDynamoException", "FailOnRecompileLimitHit")
        if isinstance(getattr(_dynamo_exc, name, None), type)
    ))
except ImportError:  # pragma: no cover
    pass

_KERNELS: dict[Any, _Kernel] = {}
#: Rows of a block per compiled call of a parameter with 8-bit state (_run_fused_rows), per
#: device type (a device not named takes CUDA's). CPU: 512K elements, whose temporaries (6 MB)
#: stay in cache (256, 1024, 4096 and 8192 rows measured within 10% of it but 256, whose calls'
#: overhead made it 2x slower). CUDA: no cache to keep them in, and each call costs its
#: launches and ~30 us of host work, so 8M elements a call (a 25M-parameter step in 4 calls
#: instead of 48), with at most a few hundred MB of temporaries. Not yet measured on a GPU:
#: benchmarks/device_choices.py times 2048 rows, 32768 and the whole tensor.
_QROWS = {"cpu": 2048, "cuda": 1 << 15}
_PAIR_DTYPES = (torch.bfloat16, torch.float32)
_ZERO_KEY = torch.zeros((), dtype=torch.int64)


def _key_tensors(
    lo: int | torch.Tensor, hi: int | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The random key's halves as 0-d tensors for a compiled kernel (a constant zero when unused)."""
    if isinstance(lo, torch.Tensor):
        return lo, cast(torch.Tensor, hi)  # (both halves are tensors, or both numbers)
    if lo == 0 and hi == 0:
        return _ZERO_KEY, _ZERO_KEY
    return torch.tensor(lo), torch.tensor(hi)


def _compiled_kernel(
    rule: Rule, storage: MasterStorage, flags: dict[str, bool], *, scaled: str | bool = False,
    fn: Callable[..., Any] = _param_update, extra_key: tuple[Any, ...] = (),
    options: dict[str, Any] | None = None, signature: tuple[Any, ...] = (), fullgraph: bool = True,
) -> _Kernel:
    """A compiled ``_param_update`` (or ``fn``) for one variant: the rule's math (not its
    optimizer), storage, flags, and the ``signature`` of its tensors (``_signature``).

    Each variant gets its own copy of the function's code object, so Dynamo keeps a separate
    cache (and recompile budget) per variant instead of one shared by every optimizer. Everything
    that changes the generated code is in the key: a dtype or device left out made one function
    recompile for every combination a process stepped, until Dynamo's recompile limit raised.
    Shapes are dynamic (parameters are passed flattened), so one compilation serves every size.
    ``options``: Inductor settings on top of the ones below (``_MANY_OPTIONS``). ``fullgraph``
    False lets Dynamo break the graph at a call it must not trace (``_whole_graph_breaks``).
    """
    key = (rule.math, rule.norm_terms, storage.name, tuple(sorted(flags.items())), scaled,
           fn.__name__, extra_key, tuple(sorted((options or {}).items())), signature, fullgraph)
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
        # emulate_precision_casts: without it Inductor folds x.to(bf16).float() into x, which
        # would make the Kahan remainder w - round(w) zero and drop the compensation silently.
        # cpp.dynamic_threads: the C++ kernel gets its parallel loop whatever the size it is
        # first compiled for. Otherwise Inductor leaves out the parallel region when that size is
        # small, and its on-disk cache then hands the single-threaded kernel to every later
        # process and size (a test run on small tensors made a 25M-parameter step 1.4x slower).
        # Random bits: Inductor's GPU threshold (30 ops) for storing a value its kernel reads
        # twice, not torch 2.13's CPU one (50), under which the hash is written anew at each
        # use: half a stochastic kernel's cold compile, the same C++ for AdamW's (compile_time.py).
        hash_ops = {"realize_opcount_threshold": 30} if storage.needs_random_bits else {}
        kernel = _Kernel(torch.compile(
            variant, dynamic=True, fullgraph=fullgraph,
            options={"emulate_precision_casts": True, "cpp.dynamic_threads": True,
                     **hash_ops, **COMPILED_AS_EAGER, **(options or {})},
        ), name)
        _KERNELS[key] = kernel
    return kernel


def _signature(
    p: torch.Tensor,
    grad: torch.Tensor,
    sbufs: dict[str, torch.Tensor],
    mbufs: dict[str, torch.Tensor],
) -> tuple[Any, ...]:
    """What of a step's tensors besides their sizes decides a compiled kernel's code: the device
    type and every dtype (``_compiled_kernel``'s key)."""
    return (p.device.type, p.dtype, grad.dtype,
            *((k, v.dtype) for k, v in sbufs.items()), *((k, v.dtype) for k, v in mbufs.items()))


def _fused_enabled(opt: OptimizerCore, group: dict[str, Any], p: torch.Tensor) -> bool:
    """Whether ``p``'s step is compiled: ``fused=True``, or the default (``fused=None``) where a
    working compiler exists for its device (``_compiler``), unless ``LOWPREC_FUSED`` says
    otherwise; never after this optimizer's compilation failed (``_disable_fused``)."""
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
    """Whether ``fused=None`` compiles the step on ``device_type`` (``LOWPREC_FUSED``, then
    whether a compiler exists there)."""
    mode = _default_mode()
    return mode == "fused" or (mode == "auto" and not _compiler(device_type))


_WARNED: set[str] = set()
def inductor_options() -> dict[str, bool]:
    """Each Inductor option the compiled step is built with (``numerics.INDUCTOR_OPTIONS``) and
    whether the installed torch's Inductor has it (a dotted name is looked up part by part). The
    default step compiles only where every one exists (``_compiler``): Inductor refuses an
    option it does not know, and without them the compiled step would not round as the eager one.
    """
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
#: The first torch whose Inductor C++ backend keeps a value's round trip through BF16/FP16
#: under ``emulate_precision_casts``. In torch 2.11 and 2.12 its ``to_dtype`` caches the inverse
#: conversion unconditionally, so that ``x.to(bfloat16).float()`` of a value it has just rounded
#: is the FP32 value again: Kahan's remainder ``w - w.to(p.dtype).float()`` compiles to zero, and
#: a compiled Kahan step on FP16, or on BF16 off the pairs path, drops the compensation (measured
#: on 2.11: tests/test_floor.py). Triton has no such cache.
_CPU_ROUND_TRIPS_KEPT = (2, 13)


class RoundTripsDropped(RuntimeError):
    """Raised (and caught: the step falls back to eager) where ``fused=True`` asks for a kernel
    that this torch's Inductor C++ code would compile without Kahan's round trip through 16 bits
    (``_CPU_ROUND_TRIPS_KEPT``), before anything is written."""


def _cpu_drops_round_trips() -> bool:
    """Whether this torch's Inductor C++ code drops a value's round trip through BF16/FP16
    (``_CPU_ROUND_TRIPS_KEPT``)."""
    version = torch.torch_version.TorchVersion(torch.__version__)
    # (TorchVersion's comparisons, which take tuples, are set with setattr: to type checkers
    # they are str's)
    older: bool = version < _CPU_ROUND_TRIPS_KEPT  # type: ignore[operator]
    return older


def _round_trips_dropped(p: torch.Tensor) -> bool:
    """Whether a compiled step of ``p`` (a 16-bit CPU tensor, off the pairs path) would lose a
    value's round trip through its dtype in this torch."""
    return (p.device.type == "cpu" and p.dtype in (torch.bfloat16, torch.float16)
            and _cpu_drops_round_trips())


@functools.cache
def _compiler(device_type: str) -> str:
    """Why the default step cannot be compiled on ``device_type`` ("" where it can): Inductor
    must have every option the step sets (``inductor_options``), the CPU needs the C++ compiler
    Inductor looks for and a torch whose C++ code keeps low-precision round trips
    (``_CPU_ROUND_TRIPS_KEPT``), CUDA needs Triton; other devices step eagerly."""
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


class CompileBudgetExceeded(RuntimeError):
    """Raised (and caught: the step falls back to eager) where a new kernel would be compiled
    after this process already spent its budget (``LOWPREC_COMPILE_BUDGET``) compiling."""


_COMPILE_BUDGET_ENV = "LOWPREC_COMPILE_BUDGET"
_COMPILE_BUDGET_S = 300.0
#: Seconds this process spent in kernels' first calls (their compilation, and one run).
_COMPILE_SPENT = [0.0]


def _compile_budget() -> float:
    value = os.environ.get(_COMPILE_BUDGET_ENV)
    if value is None:
        return _COMPILE_BUDGET_S
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{_COMPILE_BUDGET_ENV}={value!r} must be a number of seconds "
                         "(e.g. 300, or inf for no budget).") from None


class _Kernel:
    """A compiled kernel that keeps count of its first call, the one that compiles it: once this
    process has spent more than its budget in first calls (``_compile_budget``), a kernel not yet
    called raises ``CompileBudgetExceeded`` instead of compiling, before anything is written, and
    the optimizer steps eagerly from then on (``_disable_fused``). A compilation cannot be
    interrupted, so the bound is the budget plus one compilation; Inductor's on-disk cache makes
    a machine's later processes pay a fraction of it."""

    __slots__ = ("fn", "name", "warm")

    def __init__(self, fn: Callable[..., Any], name: str) -> None:
        self.fn, self.name, self.warm = fn, name, False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = _unviewed(args), _unviewed(kwargs)
        if self.warm:
            with vector_casts():  # (a call can recompile: a new pattern of sizes)
                return self.fn(*args, **kwargs)
        try:
            budget = _compile_budget()
        except ValueError as e:  # (raised mid-step, it would leave the step half taken)
            raise CompileBudgetExceeded(str(e)) from None
        if _COMPILE_SPENT[0] > budget:
            raise CompileBudgetExceeded(
                f"this process spent {_COMPILE_SPENT[0]:.0f} s compiling optimizer steps, past "
                f"{_COMPILE_BUDGET_ENV}={budget:g} s, so {self.name} is not compiled"
            )
        start = time.perf_counter()
        try:
            with vector_casts():
                out = self.fn(*args, **kwargs)
        finally:
            _COMPILE_SPENT[0] += time.perf_counter() - start
        self.warm = True
        return out


def _unviewed(x: Any) -> Any:
    """``x`` (tensors, in tuples and dicts too) with each view replaced by a detached alias (same
    memory and version counter, no ``_base``): Dynamo guards a view's base (rank, size, duck
    sizing), so one kernel compiled anew for a vector's view, a matrix's and a bucket's piece.
    Aliases are still seen (AOTAutograd compares storages). Kept views are detached once where
    they are made (``prepare_fused``, ``_run_fused_rows``), so a step adds no op per kept view."""
    if isinstance(x, torch.Tensor):
        return x.detach() if x._is_view() else x
    if isinstance(x, dict):
        return {k: _unviewed(v) for k, v in x.items()}
    if isinstance(x, tuple):
        return tuple(_unviewed(v) for v in x)
    return x


def _disable_fused(opt: OptimizerCore, error: BaseException) -> None:
    core.stages(opt).fused_broken = True
    if isinstance(error, CompileBudgetExceeded):
        how = (f"set {_COMPILE_BUDGET_ENV} to a larger number of seconds to compile more, or "
               "pass fused=False to silence this warning.")
    elif isinstance(error, RoundTripsDropped):
        how = "Upgrade torch for the fused step, or pass fused=False to silence this warning."
    else:
        how = ("Install a C++ compiler (CPU) or Triton (GPU), or pass fused=False to silence "
               "this warning.")
    # (The cause: the first line, and the next where the first only introduces it, as
    # BackendCompilerFailed's "backend='inductor' raised:" does.)
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    cause = " ".join(lines[:2] if lines and lines[0].endswith(":") else lines[:1])
    warnings.warn(f"lowprec: the fused (torch.compile) optimizer step is unavailable here "
                  f"({type(error).__name__}: {cause}); falling back to the eager step, which "
                  f"gives the same results more slowly. {how}", RuntimeWarning, stacklevel=4)


def _step_view(f: _Fused, t: torch.Tensor) -> torch.Tensor:
    """The view of a parameter (or its gradient) ``t`` that ``f``'s kernel takes: flat, or its
    words of pairs of elements. Always a new view of ``t`` detached, even of a 1-d ``t``: handed
    a 1-d parameter itself (a leaf that requires grad), a parameter's own call fails to compile
    in Inductor, and handed a view of a BF16 parameter whose gradient is FP32 (``grad_dtype``
    None), Dynamo's fake copy of it refuses the FP32 gradient. Detached after the view, so that
    it is no view (``_unviewed``)."""
    if f.qkw:  # (8-bit or 4-bit state: rows of a block; see prepare_fused)
        return qstate_mod.rows(t, qstate_mod.four_bit(f.qkw["qstate"])).detach()
    v = t.view(-1) if f.pairs is None else _pair_words(t, f.n)
    # (rows: a bucket's parameters of one size)
    return (v.view(f.rows, -1) if f.rows else v).detach()


def _row_bases(f: _Fused, pieces: list[slice]) -> list[torch.Tensor] | list[None]:
    """Each piece's ``base`` for the random bits (the index of its first element in the whole
    parameter, of its first pair for bfloat16; ``_random_bits``), made once per layout."""
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
    signature: tuple[Any, ...]
    start: int
    storage: MasterStorage
    sums_fn: Callable[..., torch.Tensor] | None
    sums_kernel: _Kernel | None
    update_fn: Callable[..., None]
    #: (flat views, or words of pairs, of the storage's and of the rule's buffers)
    views: tuple[dict[str, torch.Tensor], ...]

    __slots__ = (
        "base",
        "bases",
        "flags",
        "kernel",
        "mbufs",
        "n",
        "p",
        "pairs",
        "qkw",
        "row_cuts",
        "rows",
        "rule",
        "sbufs",
        "shards",
        "signature",
        "start",
        "storage",
        "sums_fn",
        "sums_kernel",
        "update_fn",
        "views",
    )


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
    """What a compiled step of contiguous ``p`` under ``rule`` needs besides the gradient and
    the step's numbers: flattened views (or words of pairs) of its buffers, and the kernel
    variants.
    It depends on the tensors' layouts and dtypes alone, so a recorded step keeps it
    (``buckets``).

    ``keyed``: per-word random keys (a gathered piece of BF16 parameters, on pairs or, off
    the CPU, elementwise). ``start``: the
    index of ``p``'s first element in a larger parameter whose random bits it takes (a DTensor's
    shard; even on pairs), passed to the kernels as ``base``. ``shards``: the process groups
    over which a DTensor shard's whole-tensor sums are added (``_norm_terms``). ``qstate``:
    the buffers kept as codes (``update._param_update``; never on pairs). ``rows``: ``p`` and
    every buffer are ``rows`` parameters of one size laid end to end (a bucket's piece,
    ``buckets``), stepped as rows of a matrix, a rule's whole-tensor sums (``_norm_terms``)
    made per row; 0: one parameter (or its piece).
    """
    f = _Fused()
    flags = rule.flags
    f.rule, f.storage, f.flags, f.p, f.sbufs, f.mbufs = rule, storage, flags, p, sbufs, mbufs
    f.qkw = {"qstate": qstate} if qstate else {}
    f.bases = f.row_cuts = None
    f.rows = rows
    f.pairs = pairs = None if qstate else pairs_plan(rule, storage, p, grad, sbufs, mbufs)
    if storage.name == "kahan" and pairs is None and _round_trips_dropped(p):
        raise RoundTripsDropped(
            f"torch {torch.__version__}'s Inductor C++ code turns x.to({p.dtype}).float() "
            "into x, which zeroes master='kahan''s compensation in this kernel (FP16, or "
            "BF16 off the pairs path or with 8-bit state); fixed in torch "
            f"{'.'.join(map(str, _CPU_ROUND_TRIPS_KEPT))}")
    f.n = n = p.numel() & ~1  # (on pairs, an odd last element takes the eager step)
    f.base, f.start, f.shards = None, start, tuple(shards)
    if start:
        # (bfloat16 hashes pairs: the first pair's index; start is even there)
        f.base = torch.tensor(start // 2 if p.dtype == torch.bfloat16 else start,
                              dtype=torch.int64)
    four = qstate_mod.four_bit(qstate)
    if qstate:
        # Rows of a block (4-bit: its two halves), each quantized buffer's scales a column
        # (_run_fused_rows steps them a piece of rows at a time).
        role = {k: "codes" for k, _ in qstate}
        role.update({qstate_mod.scale_key(k): "scale" for k, _ in qstate})
        f.views = ({k: qstate_mod.rows(v, four) for k, v in sbufs.items()},
                   {k: qstate_mod.rows(v, four, role.get(k, "values"))
                    for k, v in mbufs.items()})
    elif pairs is None:
        f.views = ({k: v.view(-1) for k, v in sbufs.items()},
                   {k: v.view(-1) for k, v in mbufs.items()})
    else:
        f.views = ({k: _pair_words(v, n) for k, v in sbufs.items()},
                   {k: _pair_words(v, n) for k, v in mbufs.items()})
    if rows:
        f.views = tuple({k: v.view(rows, -1) for k, v in d.items()} for d in f.views)
    f.views = _unviewed(f.views)
    # (The parameter's own view is made by each call, like the gradient's: a view kept here
    # would keep its storage allocated after `p.data = ...` or `model.to(...)`.)
    # The whole-tensor sums in a compiled pass of their own, so that the update pass
    # recomputes what it needs instead of keeping full-size temporaries.
    # The functions the kernels compile.
    f.update_fn = _param_update if pairs is None else _param_update_pairs
    f.sums_fn = None
    f.sums_kernel = None
    f.signature = signature = _signature(p, grad, sbufs, mbufs)
    # (4-bit codes: a kernel of their own, not a recompilation of the 8-bit one's)
    codes_key = (("state", qstate_mod.FOUR_BIT),) if four else ()
    rows_key = (("rows", "rows"),) if rows else ()  # (kernels of their own: 2-d tensors)
    if rule.norms:
        f.sums_fn = _param_sums if pairs is None else _param_sums_pairs
        f.sums_kernel = _compiled_kernel(
            rule, storage, flags, scaled=scaled, fn=f.sums_fn,
            extra_key=(*(codes_key if pairs is None else pairs), *rows_key),
            signature=signature,
        )
    f.kernel = _compiled_kernel(
        rule, storage, flags, scaled=scaled, fn=f.update_fn,
        extra_key=(*(codes_key if pairs is None else pairs),
                   *((("keys", "batched"),) if keyed else ()), *rows_key),
        signature=signature,
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
    """The compiled step prepared in ``f`` with gradient ``grad`` (raises compile errors before
    writing anything)."""
    if f.qkw:
        _run_fused_rows(f, grad, c32, lo, hi, extra)
        return
    storage, flags, pairs, n, p, math = f.storage, f.flags, f.pairs, f.n, f.p, f.rule.math
    sv, mv = f.views
    pv, gv = _step_view(f, p), _step_view(f, grad)
    tail = slice(n, None) if pairs is not None and n < p.numel() else None
    def flat(d: dict[str, torch.Tensor], sl: slice) -> dict[str, torch.Tensor]:
        return {k: v.view(-1)[sl] for k, v in d.items()}
    if f.sums_kernel is not None:
        c32 = dict(c32)  # the sums below are this parameter's own
        kw: dict[str, Any] = dict(storage=storage, norm_terms=f.rule.norm_terms, flags=flags,
                  inv_scale=extra.get("inv_scale"), **({"rows": True} if f.rows else {}))
        if pairs is None:
            c32["sums"] = all_reduce_sums(f.sums_kernel(pv, gv, sv, mv, c32, **kw), f.shards)
        else:
            c32["sums"] = f.sums_kernel(pv, gv, sv, mv, c32, dtypes=pairs, **kw)
            if tail is not None:
                c32["sums"] = c32["sums"] + _param_sums(
                    p.view(-1)[tail], grad.view(-1)[tail], flat(f.sbufs, tail),
                    flat(f.mbufs, tail), coeffs, **kw,
                )
            c32["sums"] = all_reduce_sums(c32["sums"], f.shards)
        coeffs = {**coeffs, "sums": c32["sums"]}  # (for the eager last element)
    if f.base is not None:
        extra = {**extra, "base": f.base}
    if pairs is None:
        f.kernel(pv, gv, sv, mv, c32, *_key_tensors(lo, hi),
                 storage=storage, math=math, flags=flags, **extra)
        return
    # 16-bit strategies go through pairs of elements (vectorized); an odd last element
    # takes the eager step, with its own index for the random bits.
    f.kernel(pv, gv, sv, mv, c32, *_key_tensors(lo, hi), storage=storage, math=math,
             flags=flags, dtypes=pairs, **extra)
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
    """The compiled step of a parameter with 8-bit or 4-bit state, a call per ``_QROWS`` (per device
    type) rows of a block (a rule with norms: every piece's sums first, then every piece's update).
    Inductor writes the new moments and weights to full-size temporaries between its loops over the
    rows; per piece they stay in cache and the allocator reuses them, where a step over a
    16M-element parameter at once took 3.5x as long per element as one over 256K (2.8x faster in
    all). Each piece's random bits are keyed by its elements' indices in the whole parameter
    (``base``)."""
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


# The strategies whose CPU step takes pairs of BF16 elements (32-bit words, ``storage``'s
# ``load_pairs``/``store_pairs``): those that work on the bits (split's 16-bit trail,
# stochastic rounding's random bits), for which the pairs kernel is the faster. For the others
# the elementwise kernel is the faster, with the same bits (Inductor vectorizes BF16 <-> FP32
# itself; the pairs kernel unpacks words with integer shifts). AdamW, BF16, 25M parameters in 32
# tensors, Zen 3 (AVX2), torch 2.13, 2 threads, ms a step, pairs -> elementwise: kahan 57.0 ->
# 33.0, none 59.1 -> 44.0, fp32 79.8 -> 37.0; LAMB kahan 116 -> 62; SGD kahan 45.4 -> 27.2; but
# split 67.4 -> 113.5 and stochastic 63.0 -> 113.2 (benchmarks/fast_path.py's pairs column).
_PAIRS_FASTER = ("split", "stochastic")


def _pairs_pay(storage: MasterStorage) -> bool:
    """Whether a BF16 CPU step under ``storage`` takes the pairs kernel: where it is the faster
    (``_PAIRS_FASTER``), and for Kahan where this torch's Inductor C++ code would drop the
    compensation's round trip in the elementwise kernel (``_CPU_ROUND_TRIPS_KEPT``)."""
    return storage.name in _PAIRS_FASTER or (storage.name == "kahan"
                                             and _cpu_drops_round_trips())


def pairs_device(device: torch.device) -> bool:
    """Whether a step on ``device`` may take the pairs kernel (``pairs_plan``): the CPU's, where
    Inductor's C++ code vectorizes integer words it cannot vectorize as 16-bit elements. Off
    it the elementwise kernel takes a gathered piece's per-word random keys
    (``update._random_bits``)."""
    return device.type == "cpu"


def pairs_plan(
    rule: Rule,
    storage: MasterStorage,
    p: torch.Tensor,
    grad: torch.Tensor,
    sbufs: dict[str, torch.Tensor],
    mbufs: dict[str, torch.Tensor],
) -> PairDtypes | None:
    """The ``dtypes`` of a fused step on pairs of elements, or None where it does not apply.

    Pairs are for CPU steps of the strategies that provide them (``storage.pairs_ok``: every
    strategy on bfloat16 parameters) where they are the faster kernel or the only correct one
    (``_pairs_pay``), elementwise rules or rules whose only reductions are ``_norm_terms``, and
    gradients and buffers in bfloat16 or FP32 whose flat views start on a pair boundary.
    """
    if (
        not storage.pairs_ok(p.dtype) or not _pairs_pay(storage)
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
