"""What an optimizer's step reads of it: ``Stepped`` (its groups, its state and each group's
``Rule``), ``OptimizerCore`` (the update rule's interface that the optimizers implement, handed to
the step as ``Rule``s), what the step keeps between steps (``Stages``), and the functions the step's
modules call for the groups' checks and the state's layout.

Only ``OptimizerCore`` reads the optimizer's private members (``tests/test_layout.py`` counts); the
step's modules take a ``Stepped`` and this module imports none of them, so they and ``base`` form
no import circle.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
from torch.optim import Optimizer

from lowprec.optim import kept, qstate
from lowprec.optim.dtensor import is_dtensor, local, mark_blocks, wrap_state
from lowprec.optim.options import (
    _check_nonnegative,
    _check_state_dtype,
    _default_mode,
    _state_dtype_value,
    _validate_betas,
)
from lowprec.optim.storage import MASTER_CHOICES, MasterStorage, resolve_master

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed import ProcessGroup

    from lowprec.optim._typing import WorkItem

__all__ = ["OptimizerCore", "Rule", "Stages", "Stepped", "check_grad", "check_param", "check_state",
           "collect", "group_of", "init_state", "math_state", "new_buffer",
           "qformats", "stages", "state_dtype", "state_tensors", "step_options",
           "validate_group", "validate_options"]


@dataclass(frozen=True, eq=False)
class Rule:
    """A group's update rule as the step takes it (``OptimizerCore.rule``): its math, flags and
    buffers. Elementwise, unless ``norms`` (elementwise but for whole-tensor sums of
    ``norm_terms``: two passes, a bucket's parameters of one size as rows) or ``whole`` (each
    parameter in its own shape, one call: compiled where ``compiles``, as two graphs around a call
    it must not trace where ``graph_breaks``). Kernels are keyed by ``math``, not the optimizer."""

    math: Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
    #: Static switches, the rule's and ``maximize`` (``update._descent``): each combination is a
    #: kernel. Not coefficients: a select on a 0-d coefficient in every element made the compiled
    #: step 5-15% slower (docs/architecture.md).
    flags: dict[str, Any]
    #: The rule's per-step scalars at a step number (host int, or the counts' tensor).
    coefficients: Callable[[int | torch.Tensor], dict[str, Any]]
    #: Those of a parameter's first step with buffers an option turned on since its last.
    first_use: Callable[[int | torch.Tensor], dict[str, Any]]
    #: The names of the buffers the rule keeps for a parameter (for ``None``: the group's).
    buffers: Callable[[torch.Tensor | None], tuple[str, ...]]
    #: A buffer's shape where it is not the parameter's (FP32 statistics: Adafactor's).
    buffer_shape: Callable[[str, torch.Tensor], tuple[int, ...] | None]
    #: The buffers that are never negative (their 8-bit codes unsigned).
    nonnegative: tuple[str, ...]
    #: A buffer's first value for a parameter (0.0 but for Adagrad's ``initial_accumulator_value``).
    initial: Callable[[str, torch.Tensor], float]
    #: Raises ``ValueError`` or ``TypeError`` for the group's invalid hyperparameters.
    validate: Callable[[], None]
    norms: bool = False
    whole: bool = False
    norm_terms: Callable[..., tuple[torch.Tensor, ...]] | None = None
    compiles: bool = False
    graph_breaks: bool = False


class Stepped(Protocol):
    """What the step's modules and this module's functions take of an optimizer: its groups, its
    state and each group's ``Rule``. ``OptimizerCore`` is one; the step needs no optimizer type."""

    param_groups: list[dict[str, Any]]
    state: defaultdict[torch.Tensor, Any]

    def rule(self, group: dict[str, Any]) -> Rule: ...


@dataclass(eq=False)
class Stages:
    """What the step's modules keep on an optimizer from one step to the next (``stages``)."""

    #: ``capturable=True`` (``base``): no step reads a value on the host, on the CPU either.
    capturable: bool = False
    #: A group holds DTensor parameters (``base.add_param_group``): steps run on local shards.
    has_dtensors: bool = False
    #: A compile failed (``compiled._disable_fused``): this optimizer's later steps are eager.
    fused_broken: bool = False
    #: The buckets ``driver.flatten`` laid out last (a ``driver._Layout``).
    buckets: Any = None
    #: The hooks ``lowprec.step_in_backward`` installed (an ``in_backward.StepInBackward``).
    in_backward: Any = None
    #: DTensor parameters' local views by the parameter's id (``shards.local_shards``), and
    #: the seeds checked to agree over every mesh.
    shards: dict[int, Any] = field(default_factory=dict)
    seeds_checked: tuple[Any, ...] = ()
    #: For the length of a step on DTensor shards (``shards.local_shards``): each local tensor's
    #: offset in its parameter, the process groups a loss scaler's skip agrees over, those each
    #: shard's whole-tensor sums add over, and the local tensors whose shards have one shape on
    #: every rank (``shards.even_shards``). None between steps.
    shard_offsets: dict[int, int] | None = None
    shard_reduce: list[ProcessGroup] | None = None
    shard_groups: dict[int, list[ProcessGroup]] | None = None
    shard_even: set[int] | None = None
    #: The groups' constant coefficients as tensors, and the index tensors and seeds' halves of
    #: stochastic rounding's keys, kept from step to step (``param_step.step_numbers_many``,
    #: ``compiled.step_keys``).
    constants: dict[Any, dict[str, tuple[Any, torch.Tensor]]] = field(default_factory=dict)
    index_tensors: dict[Any, torch.Tensor] = field(default_factory=dict)


def stages(opt: Stepped) -> Stages:
    """The record of what ``opt``'s step keeps between steps."""
    got = opt.__dict__.get("_stages")
    if got is None:  # (an optimizer unpickled from before it had one)
        got = opt.__dict__["_stages"] = Stages()
    return cast(Stages, got)


class OptimizerCore(Optimizer):
    """A ``torch.optim.Optimizer`` with an update rule and a master-weight storage per group: what
    the step reads. Subclasses implement the rule's interface below (``_coefficients`` and ``_math``
    at least)."""


    # ------------------------------------------------------------------ subclass interface

    #: The hyperparameters that the default ``_validate_hparams`` checks are numbers >= 0, and
    #: whether it checks the group's ``betas`` (a pair, each in [0, 1)).
    _nonnegative_hparams: tuple[str, ...] = ()
    _has_betas = False

    def _validate_hparams(self, group: dict[str, Any]) -> None:
        """Raise ``ValueError`` for invalid hyperparameters in ``group`` (default: those that
        ``_nonnegative_hparams`` and ``_has_betas`` name)."""
        _check_nonnegative(group, *self._nonnegative_hparams)
        if self._has_betas:
            _validate_betas(group["betas"])

    #: The state tensors the rule keeps for every parameter (what the default ``_math_buffers``
    #: returns).
    _buffer_names: tuple[str, ...] = ()

    def _math_buffers(self, group: dict[str, Any], p: torch.Tensor | None = None) -> tuple[str, ...]:
        """Names of the state tensors the rule keeps for ``p`` (for None: the group's; default:
        ``_buffer_names``; Adafactor's depend on ``p``'s number of dimensions)."""
        return self._buffer_names

    def _buffer_shape(self, name: str, p: torch.Tensor) -> tuple[int, ...] | None:
        """A buffer's shape where it is not ``p``'s (kept in FP32 whatever ``state_dtype`` says);
        None: shaped as ``p``, in the state dtype."""
        return None

    #: A whole-tensor rule (``_whole``) whose step compiles as one graph in the parameter's shape
    #: where the step is fused (Adafactor: reductions and elementwise work, which Inductor fuses
    #: into a few passes; its sums are FP64, so compiled and eager agree bit for bit). False:
    #: always eager.
    _whole_compiles = False
    #: The compiled whole-tensor step may break its graph where the rule calls a function under
    #: ``torch.compiler.disable`` (Muon's matmuls: the elementwise work around them compiles as
    #: two graphs). False: one graph, which must compile whole (``fullgraph``).
    _whole_graph_breaks = False

    def _whole(self, group: dict[str, Any]) -> bool:
        """Whether the rule needs each parameter of ``group`` whole, in its own shape (one call of
        ``_math``, never chunks, pairs or buckets; a sharded DTensor is refused)."""
        return False

    #: For a rule elementwise but for whole-tensor sums of squares: ``(w, g, bufs, c, **flags) ->
    #: tuple of FP32 tensors`` whose sums the rule needs (LAMB: ``w`` and its update). The step
    #: goes through the tensor twice, first summing the squares (``numerics.sum_squares``: FP64,
    #: so whole, chunked, compiled and pairs sums give the same FP32 norms), then updating with
    #: the sums passed to ``_math`` as ``c["sums"]``. The eager step does it chunk by chunk, the
    #: fused step as a compiled pass of its own: neither keeps full-size temporaries. None: an
    #: elementwise rule (one pass, which the eager step may take in chunks).
    _norm_terms: Callable[..., tuple[torch.Tensor, ...]] | None = None

    #: The update rule's buffers that are never negative (second moments, sums of squares):
    #: under ``state_dtype="8bit"`` they take the unsigned codes, which span a wider range.
    _nonnegative_buffers: tuple[str, ...] = ()

    def _init_math_buffer(self, name: str, param: torch.Tensor, group: dict[str, Any]) -> float:
        """Initial value of buffer ``name`` (default: 0.0)."""
        return 0.0

    def _coefficients(self, group: dict[str, Any], step: int | torch.Tensor) -> dict[str, Any]:
        """The rule's per-step scalars (lr, bias corrections...), on the host."""
        raise NotImplementedError

    def _flags(self, group: dict[str, Any]) -> dict[str, Any]:
        """Static switches of the rule (e.g. ``amsgrad``): each combination is a kernel."""
        return {}

    @staticmethod
    def _math(
        w: torch.Tensor,
        g: torch.Tensor,
        bufs: dict[str, torch.Tensor],
        c: dict[str, Any],
        *args: Any,
        **flags: Any,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The update rule: new FP32 weight and buffers from FP32 inputs (pure, plain ops)."""
        raise NotImplementedError

    def rule(self, group: dict[str, Any]) -> Rule:
        """The update rule of ``group`` as the step takes it: its math, flags and buffers.

        Args:
            group: One of ``param_groups``.
        """
        whole = self._whole(group)
        flags = {**self._flags(group), "maximize": bool(group.get("maximize", False))}
        return Rule(self._group_math(group), flags,
                    functools.partial(self._coefficients, group),
                    functools.partial(self._first_use_coefficients, group),
                    functools.partial(self._math_buffers, group), self._buffer_shape,
                    self._nonnegative_buffers,
                    lambda name, p: self._init_math_buffer(name, p, group),
                    functools.partial(self._validate_hparams, group),
                    norms=self._norm_terms is not None and not whole, whole=whole,
                    norm_terms=self._norm_terms, compiles=self._whole_compiles,
                    graph_breaks=self._whole_graph_breaks)

    def _first_use_coefficients(
        self, group: dict[str, Any], step: int | torch.Tensor
    ) -> dict[str, Any]:
        """The coefficients of a first step with buffers created late (default: the step's own;
        SGD's momentum starts as the step's direction, as torch's does)."""
        return self._coefficients(group, step)

    def _group_math(self, group: dict[str, Any]) -> Callable[..., Any]:
        """The rule ``group`` is stepped by (Muon's ``use_muon=False`` groups: AdamW's)."""
        return self._math


# ------------------------------------------------------------------ the step's interface
# (What the step's modules call: the groups' checks and the state's layout, over the subclass
# interface above, which only this module reads.)


def validate_group(opt: Stepped, group: dict[str, Any], index: int) -> list[MasterStorage]:
    """Validate a group's options and parameters; returns each parameter's storage."""
    validate_options(opt, group, index)
    where = f"parameter group {index}"
    storages: dict[torch.dtype, MasterStorage] = {}
    out = []
    device = None
    for i, p in enumerate(group["params"]):
        storage = storages.get(p.dtype)
        if storage is None:
            if not p.is_floating_point():
                raise TypeError(
                    f"{where}, parameter {i}: lowprec optimizers update floating-point "
                    f"parameters, got {p.dtype}; leave integer and complex tensors out of "
                    "the optimizer."
                )
            try:
                storage = storages[p.dtype] = resolve_master(group["master"], p.dtype)
            except ValueError as e:
                raise ValueError(f"{where}, parameter {i}: {e}") from None
        if device is None:
            device = p.device
        elif p.device != device:
            raise ValueError(
                f"{where} mixes devices ({device} and {p.device}); move the model to one "
                "device before creating the optimizer, or put each device's parameters in "
                "their own group."
            )
        out.append(storage)
    return out


def validate_options(opt: Stepped, group: dict[str, Any], index: int) -> None:
    """Validate a group's options (raises ``ValueError`` or ``TypeError`` naming the group)."""
    where = f"parameter group {index}"
    if group["master"] not in MASTER_CHOICES:
        raise ValueError(
            f"{where}: unknown master={group['master']!r}; choose one of "
            f"{', '.join(MASTER_CHOICES)}."
        )
    group["state_dtype"] = _state_dtype_value(group["state_dtype"])
    _check_state_dtype(group["state_dtype"], where)
    qstate.check_group(group, where)  # (4-bit state: no DTensor parameters)
    if group["fused"] not in (None, True, False):
        raise ValueError(f"{where}: fused must be None, True or False, got {group['fused']!r}.")
    if group["fused"] is None:
        _default_mode()  # (LOWPREC_FUSED, which decides what None means, is a valid setting)
    seed = group["seed"]
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"{where}: seed must be a non-negative int or None, got {seed!r}.")
    try:
        opt.rule(group).validate()
    except (ValueError, TypeError) as e:
        raise type(e)(f"{where}: {e}") from None


def step_options(opt: Stepped, group: dict[str, Any]) -> tuple[Any, ...]:
    """A group's options that shape a step beyond its coefficients: buckets and the update inside
    backward step a group only while they stay the same."""
    rule = opt.rule(group)
    return (group["master"], group["state_dtype"], group["fused"], group["seed"],
            rule.buffers(None), rule.flags)


def state_dtype(group: dict[str, Any], p: torch.Tensor, storage: MasterStorage) -> torch.dtype:
    """The dtype of the rule's buffers for ``p``: ``torch.uint8`` for 8-bit or 4-bit codes (FP32 for
    parameters too small for them), ``state_dtype``, or FP32 for ``"fp32"``/``"split"``, else
    ``p``'s."""
    if group["state_dtype"] in qstate.BITS:
        return torch.uint8 if qstate.qualifies(p) else torch.float32
    if group["state_dtype"] is not None:
        return cast(torch.dtype, group["state_dtype"])
    if storage.name in ("fp32", "split"):
        return torch.float32
    return p.dtype


def collect(opt: Stepped, late: list[WorkItem] | None = None) -> list[WorkItem]:
    """Validate every group, gradient and state; return the work list. Writes nothing. ``late``
    collects the items whose state lacks a buffer an option turned on since their first step."""
    work: list[WorkItem] = []
    index = -1
    expected: dict[Any, dict[str, torch.dtype]] = {}  # per (group, dtype, strategy)
    for gi, group in enumerate(opt.param_groups):
        storages = validate_group(opt, group, gi)
        rule = opt.rule(group)
        for pi, (p, storage) in enumerate(zip(group["params"], storages, strict=True)):
            index += 1
            if is_dtensor(p):  # (steps swap them for their shards: add_param_group notes them)
                raise ValueError(
                    f"parameter group {gi}, parameter {pi}: a DTensor parameter was put in "
                    "param_groups directly; add it with add_param_group (or pass it to the "
                    "constructor) so that steps run on its local shard."
                )
            if p.grad is None:
                continue
            if check_param(opt, rule, group, p, storage, (gi, pi), expected) and late is not None:
                late.append((group, p, index, storage))
            work.append((group, p, index, storage))
    return work


def check_param(
    opt: Stepped,
    rule: Rule,
    group: dict[str, Any],
    p: torch.Tensor,
    storage: MasterStorage,
    where: tuple[int, int],
    expected: dict[Any, dict[str, torch.dtype]],
) -> bool:
    """Raise ``ValueError`` unless ``p``'s gradient and state fit it; True where its state lacks
    buffers ``rule`` (the group's) now keeps. ``expected`` caches ``_expected_state`` per kind of
    parameter."""
    check_grad(p, where)
    state = opt.state.get(p)
    if not state:
        return False
    key = (where[0], p.dtype, storage.name, qstate.qualifies(p), p.dim())
    if key not in expected:
        expected[key] = _expected_state(rule, group, p, storage)
    return bool(check_state(rule, state, group, p, storage, where, expected[key]))


def check_grad(p: torch.Tensor, where: tuple[int, int]) -> None:
    """Raise ``ValueError`` unless ``p``'s gradient is dense and shaped as ``p``."""
    g = cast(torch.Tensor, p.grad)  # (present: collect steps parameters with gradients)
    gi, pi = where
    if g.is_sparse:
        raise ValueError(
            f"parameter group {gi}, parameter {pi}: sparse gradients are not "
            "supported; use dense gradients (e.g. nn.Embedding(..., sparse=False)) or "
            "torch.optim.SparseAdam."
        )
    if g.shape != p.shape or g.device != p.device or not g.is_floating_point():
        raise ValueError(
            f"parameter group {gi}, parameter {pi}: gradient {tuple(g.shape)} "
            f"{g.dtype} on {g.device} does not match the parameter {tuple(p.shape)} "
            f"{p.dtype} on {p.device}."
        )


def _expected_state(
    rule: Rule, group: dict[str, Any], p: torch.Tensor, storage: MasterStorage
) -> dict[str, torch.dtype]:
    sd = state_dtype(group, p, storage)
    names = rule.buffers(p)
    shaped = [k for k in names if rule.buffer_shape(k, p) is None]
    scales: dict[str, torch.dtype] = {}
    if sd == torch.uint8:  # (8-bit or 4-bit codes: one FP32 scale per block beside each)
        scales = dict.fromkeys(map(qstate.scale_key, shaped), torch.float32)
    return {**storage.buffers(p), **dict.fromkeys(names, torch.float32),
            **dict.fromkeys(shaped, sd), **scales}


def qformats(
    rule: Rule, group: dict[str, Any], state: dict[str, Any], p: torch.Tensor | None = None
) -> tuple[tuple[str, str], ...]:
    """The rule's buffers that ``state`` keeps as codes, each with its format (``qstate.fmt``)."""
    bits = 4 if group["state_dtype"] == qstate.FOUR_BIT else 8
    return tuple((k, qstate.fmt(k not in rule.nonnegative, bits))
                 for k in rule.buffers(p) if qstate.scale_key(k) in state)


def state_tensors(
    rule: Rule, state: dict[str, Any], p: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """The rule's state tensors of ``p``: its buffers and the codes' scales."""
    names = rule.buffers(p)
    out = {k: state[k] for k in names}
    out.update({s: state[s] for s in map(qstate.scale_key, names) if s in state})
    return out


def math_state(
    rule: Rule, group: dict[str, Any], p: torch.Tensor, state: dict[str, Any]
) -> dict[str, torch.Tensor]:
    """The rule's buffers of ``p`` as FP32 values (codes decoded, shaped as ``p``)."""
    fmts = dict(qformats(rule, group, state, p))
    return {k: qstate.from_codes(state[k], state[qstate.scale_key(k)],
                                 qstate.is_signed(fmts[k]), p.shape)
            if k in fmts else state[k].float() for k in rule.buffers(p)}


def _scales_of(expected: dict[str, torch.dtype]) -> dict[str, str]:
    """The scales' names of the buffers kept as codes, each with its buffer's."""
    return {qstate.scale_key(k): k for k, d in expected.items() if d == torch.uint8}


def state_layout(
    rule: Rule, group: dict[str, Any], p: torch.Tensor,
    expected: dict[str, torch.dtype],
) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """The dtype and shape of each state tensor of ``p`` (``expected``: ``_expected_state``): scales
    one per block, 4-bit codes flat (two a byte)."""
    scale_of = _scales_of(expected)
    bits = qstate.BITS.get(group["state_dtype"], 8)
    return {name: (dtype, tuple(qstate.scale_shape(p) if name in scale_of
                                else qstate.codes_shape(p, bits) if dtype == torch.uint8
                                else rule.buffer_shape(name, p) or p.shape))
            for name, dtype in expected.items()}


def check_state(
    rule: Rule,
    state: dict[str, Any],
    group: dict[str, Any],
    p: torch.Tensor,
    storage: MasterStorage,
    where: str | tuple[int, int],
    expected: dict[str, torch.dtype] | None = None,
) -> tuple[str, ...]:
    """Raise ``ValueError`` unless ``state`` was made for ``p`` under these options; returns the
    rule's buffers it lacks (created at the next step: ``param_step.step_param``'s ``first_use``)."""
    if isinstance(where, tuple):  # (group, parameter): formatted only for an error
        where = f"parameter group {where[0]}, parameter {where[1]}"
    if state.get("master") != storage.name:
        raise ValueError(
            f"{where}: its optimizer state was created with master={state.get('master')!r} "
            f"but the group now resolves to {storage.name!r} (was the parameter's dtype or the "
            "group's master changed?); create a new optimizer after changing either."
        )
    if expected is None:
        expected = _expected_state(rule, group, p, storage)
    missing = tuple(name for name in rule.buffers(p) if state.get(name) is None)
    scale_of = _scales_of(expected)
    for name, (dtype, shape) in state_layout(rule, group, p, expected).items():
        t = state.get(name)
        if name in missing or scale_of.get(name) in missing:
            continue
        if not isinstance(t, torch.Tensor) or t.shape != shape or t.dtype != dtype:
            raise ValueError(
                f"{where}: state {name!r} should be a {tuple(shape)} {dtype} tensor, got "
                f"{_described(t)}; the state does not belong to this parameter or these options."
            )
    return missing


def _described(t: object) -> str:
    """A state entry as an error names it: a tensor's shape and dtype, anything else's repr."""
    return f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else repr(t)


def init_state(
    rule: Rule, group: dict[str, Any], p: torch.Tensor, storage: MasterStorage, *,
    preview: bool = False, out: dict[str, torch.Tensor] | None = None,
) -> dict[str, Any]:
    """A new state for ``p``. ``preview``: the state its first step would create
    (``diagnostics.UpdateMonitor``): the kept FP32 value read, not taken, and ``p`` not written.
    ``out``: tensors (of ``state_layout``) written in place, by name (``driver.new_state``)."""
    if is_dtensor(p):  # (a checkpoint's state adopted for a DTensor: checkpoint._adopt_state)
        # (computed on its shard, kept as DTensors placed as p)
        mark_blocks(p)
        lp = local(p)
        st = init_state(rule, group, lp, storage, preview=preview)
        return {k: wrap_state(k, v, lp, p) for k, v in st.items()}
    sd = state_dtype(group, p, storage)
    state: dict[str, Any] = {  # (the count on p's device, where the step's numbers are made)
        "step": torch.tensor(0.0, dtype=torch.float32, device=p.device),
        "master": storage.name,
    }
    # (the master from the FP32 value p was cast from, where one was kept and the master
    # holds more than p's bits: lowprec.optim.kept; the value let go either way)
    value = kept.kept_value(p) if preview else kept.take(p)
    # (split writes its top half into p at an exact tie: a preview's into a copy)
    target = p.detach().clone() if preview and value is not None else p
    out = out or {}
    state.update(storage.init(target, value if storage.takes_value else None))
    for name in rule.buffers(p):
        state.update(new_buffer(rule, group, p, name, sd, out.get(name)))
    # (copy_ returns its tensor; a buffer filled with a constant was written in place)
    return {k: out[k].copy_(v) if k in out and v is not out[k] else v for k, v in state.items()}


def new_buffer(
    rule: Rule, group: dict[str, Any], p: torch.Tensor, name: str, dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> dict[str, Any]:
    """A new rule buffer ``name`` as state entries: the buffer and, for codes (``dtype`` uint8), its
    scales; ``out``: the tensor a buffer of ``p``'s shape is filled in."""
    value = rule.initial(name, p)
    shape = rule.buffer_shape(name, p)
    if shape is not None:  # (FP32 statistics of their own shape: Adafactor's)
        return {name: torch.full(shape, value, dtype=torch.float32, device=p.device)}
    if dtype == torch.uint8:
        codes, scale = qstate.new_state(value, p, name not in rule.nonnegative,
                                        qstate.BITS.get(group["state_dtype"], 8))
        return {name: codes, qstate.scale_key(name): scale}
    if out is not None:
        return {name: out.fill_(value)}
    return {name: torch.full_like(p, value, dtype=dtype, memory_format=torch.preserve_format)}


def group_of(opt: Stepped, p: torch.Tensor) -> dict[str, Any]:
    for group in opt.param_groups:
        if any(q is p for q in group["params"]):
            return group
    raise ValueError("this tensor is not a parameter of the optimizer.")
