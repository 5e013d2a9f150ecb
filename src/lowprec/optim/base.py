"""The common machinery of lowprec's optimizers.

``LowPrecisionOptimizer`` is a ``torch.optim.Optimizer`` that composes an *update rule* with a
*master-weight storage*:

* the subclass (``SGD``, ``AdamW``, ...) names its state buffers and computes the new FP32 weight and
  buffers from the FP32 weight, the FP32 gradient and the FP32 buffers, never knowing how the weight
  is stored;
* a ``MasterStorage`` (``lowprec.optim.storage``) rebuilds the FP32 master before the update and
  writes the new value back (round to nearest, FP32 copy, split trail, Kahan compensation,
  stochastic rounding).

A step first validates everything (hyperparameters, gradients, state) and only then writes, so a
step that raises leaves parameters and state as they were. State is created lazily on a parameter's
first step, with only the buffers its strategy needs. ``state_dict``/``load_state_dict`` keep every
state tensor's dtype (torch's default would cast an FP32 master or a trail to the parameter's
dtype).
"""

from __future__ import annotations

import contextlib
import copy
import math
import operator
import sys
import types
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.optim import Optimizer

from lowprec.numerics import (
    _pack_f32_pairs,
    _pack_nearest_bf16_pairs,
    _unpack_bf16_pairs,
    _unpack_f32_pairs,
    hash_bits,
    stream_key,
    stream_key_halves,
    sum_squares,
    sum_squares_pairs,
)
from lowprec.optim.shards import (
    all_reduce_sums,
    check_loaded_state,
    init_state_local,
    is_dtensor,
    local,
    local_shards,
    reduce_groups,
    wrap_like,
)
from lowprec.optim.storage import MASTER_CHOICES, MasterStorage, resolve_master

__all__ = ["LowPrecisionOptimizer", "master_state_dict"]

_STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_COMMON_DEFAULTS = {"master": "auto", "state_dtype": None, "seed": None, "fused": None}
# Options of torch.optim's implementations (how its step runs), accepted for code written for
# torch.optim and kept out of lowprec's groups: lowprec chooses its own implementation.
_TORCH_ONLY_OPTIONS = ("foreach", "capturable", "differentiable")


def _as_float(value: Any, name: str) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a number or a one-element tensor, got shape "
                             f"{tuple(value.shape)}.")
        return float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}.")
    return float(value)


def _check_torch_options(
    name: str, foreach: bool | None, capturable: bool, differentiable: bool
) -> None:
    """Accept torch.optim's implementation options as code written for torch.optim passes them,
    and refuse the ones lowprec cannot honour, naming the reason."""
    for option, value in (("foreach", foreach), ("capturable", capturable),
                          ("differentiable", differentiable)):
        if value not in (None, True, False):
            raise TypeError(f"{option} must be a bool or None, got {value!r}.")
    if differentiable:
        raise ValueError(
            f"lowprec.{name} does not support differentiable=True: its step updates the stored "
            "weights in place without autograd; use torch.optim for differentiating through "
            "an optimizer step."
        )
    if capturable:
        raise ValueError(
            f"lowprec.{name} does not support capturable=True: its step decides on the host "
            "which kernels to run, so it cannot be captured in a CUDA graph; leave capturable "
            "at False."
        )
    # foreach: torch's choice between its loop and multi-tensor kernels; lowprec's step has its
    # own (fused=), so any value is accepted and changes nothing.


def _step_tensor(value: Any, where: str) -> torch.Tensor:
    """A step count saved as a plain number, as the 0-d FP32 tensor lowprec keeps."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
        math.isfinite(value) and value >= 0 and float(value).is_integer()
    ):
        raise ValueError(
            f"{where}: the checkpoint's step count must be a whole number >= 0 or a tensor, got "
            f"{value!r}."
        )
    return torch.tensor(float(value), dtype=torch.float32)


def _check_nonnegative(group: dict[str, Any], *names: str) -> None:
    for name in names:
        if _as_float(group[name], name) < 0:
            raise ValueError(f"invalid {name}={group[name]}: must be >= 0.")


def _validate_betas(betas: Any) -> None:
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}.")
    for i, b in enumerate(betas):
        if not 0.0 <= _as_float(b, f"betas[{i}]") < 1.0:
            raise ValueError(f"invalid betas[{i}]={b}: must be in [0, 1).")


class LowPrecisionOptimizer(Optimizer):
    """Base class: an update rule in FP32 over a pluggable master-weight storage.

    Subclasses implement ``_validate_hparams``, ``_math_buffers``, ``_init_math_buffer`` and
    ``_update``. They pass their hyperparameter defaults; ``master``, ``state_dtype`` and ``seed`` are
    added here.
    """

    def __init__(
        self,
        params: Iterable[Any],
        defaults: dict[str, Any],
        *,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
    ) -> None:
        if isinstance(params, set):
            raise TypeError(
                "parameters must be an ordered collection (a list), not a set: a set's order "
                "changes between runs, and checkpoints map state to parameters by position."
            )
        _check_torch_options(type(self).__name__, foreach, capturable, differentiable)
        super().__init__(params, {**_COMMON_DEFAULTS, **defaults})

    # ------------------------------------------------------------------ subclass interface

    def _validate_hparams(self, group: dict[str, Any]) -> None:
        """Raise ``ValueError`` for invalid hyperparameters in ``group``."""

    def _math_buffers(self, group: dict[str, Any]) -> tuple[str, ...]:
        """Names of the per-parameter state tensors the update rule keeps (e.g. momentum)."""
        return ()

    #: The rule is elementwise (no reduction over the tensor), so the eager step may process a
    #: large tensor in chunks. LAMB's trust ratio needs whole-tensor norms and sets this False.
    _elementwise = True

    #: For a rule that is not elementwise: ``(w, g, bufs, c, **flags) -> tuple of FP32 tensors``
    #: whose whole-tensor sums of squares the rule needs (LAMB: ``w`` and its update). The step
    #: goes through the tensor twice, first summing the squares (``numerics.sum_squares``: FP64,
    #: so whole, chunked, compiled and pairs sums give the same FP32 norms), then updating with
    #: the sums passed to ``_math`` as ``c["sums"]``. The eager step does it chunk by chunk, the
    #: fused step as a compiled pass of its own: neither keeps full-size temporaries. None: one
    #: pass, unchunked.
    _norm_terms: Callable[..., tuple[torch.Tensor, ...]] | None = None

    def _init_math_buffer(self, name: str, param: torch.Tensor, group: dict[str, Any]) -> float:
        """Initial value of buffer ``name`` (default: 0.0)."""
        return 0.0

    def _coefficients(self, group: dict[str, Any], step: int) -> dict[str, float]:
        """The update rule's per-step scalars, computed on the host (lr, bias corrections...)."""
        raise NotImplementedError

    def _flags(self, group: dict[str, Any]) -> dict[str, bool]:
        """Static switches of the update rule (e.g. ``amsgrad``); each combination is a variant."""
        return {}

    @staticmethod
    def _math(
        w: torch.Tensor,
        g: torch.Tensor,
        bufs: dict[str, torch.Tensor],
        c: dict[str, Any],
        **flags: bool,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The update rule: new FP32 weight and buffers from FP32 inputs (pure, plain ops)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ groups and validation

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not isinstance(param_group, dict):
            raise TypeError(f"a parameter group must be a dict, got {type(param_group).__name__}.")
        params = param_group.get("params")
        if isinstance(params, torch.Tensor):
            params = [params]
        elif isinstance(params, set):
            raise TypeError("parameters must be an ordered collection (a list), not a set.")
        else:
            params = list(params or [])
        param_group = dict(param_group)
        if any(isinstance(p, tuple) for p in params):
            # (name, parameter) pairs, as model.named_parameters() gives them: torch.optim (2.6
            # and newer) keeps the names as the group's "param_names", and so does this.
            if not all(isinstance(p, tuple) and len(p) == 2 for p in params):
                raise ValueError(
                    "give every parameter of a group with its name, as (name, tensor) pairs "
                    "(e.g. list(model.named_parameters())), or none of them."
                )
            param_group["param_names"] = [name for name, _ in params]
            params = [p for _, p in params]
        seen: set[int] = set()
        for p in params:
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"optimizer parameters must be tensors, got {type(p).__name__}.")
            if id(p) in seen:
                raise ValueError(
                    "a parameter appears twice in one parameter group; pass each parameter once "
                    "(e.g. deduplicate tied weights with a dict keyed by id)."
                )
            seen.add(id(p))
        group = {**param_group, "params": params}
        super().add_param_group(group)
        added = self.param_groups[-1]
        try:
            if added.get("seed") is None:
                # torch.initial_seed() is what torch.manual_seed set: reproducible, the same on
                # every rank that seeds alike, and reading it consumes no random numbers.
                added["seed"] = torch.initial_seed()
            self._validate_group(added, index=len(self.param_groups) - 1)
        except Exception:
            self.param_groups.pop()
            raise
        if any(is_dtensor(p) for p in params):
            self._has_dtensors = True  # (steps run on their local shards: lowprec.optim.shards)

    def _validate_group(self, group: dict[str, Any], index: int) -> list[MasterStorage]:
        """Validate a group's options and parameters; returns each parameter's storage strategy
        (resolved once per dtype)."""
        self._validate_options(group, index)
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
                    storage = storages[p.dtype] = self._storage(group, p)
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

    def _validate_options(self, group: dict[str, Any], index: int) -> None:
        """Validate a group's options (raises ``ValueError`` or ``TypeError`` naming the group)."""
        where = f"parameter group {index}"
        if group["master"] not in MASTER_CHOICES:
            raise ValueError(
                f"{where}: unknown master={group['master']!r}; choose one of "
                f"{', '.join(MASTER_CHOICES)}."
            )
        sd = group["state_dtype"]
        if sd is not None and sd not in _STATE_DTYPES:
            raise ValueError(
                f"{where}: state_dtype must be None or one of torch.float32, torch.bfloat16, "
                f"torch.float16, torch.float64; got {sd!r}."
            )
        if group["fused"] not in (None, True, False):
            raise ValueError(f"{where}: fused must be None, True or False, got {group['fused']!r}.")
        seed = group["seed"]
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"{where}: seed must be a non-negative int or None, got {seed!r}.")
        try:
            self._validate_hparams(group)
        except (ValueError, TypeError) as e:
            raise type(e)(f"{where}: {e}") from None

    def _plan_options(self, group: dict[str, Any]) -> tuple[Any, ...]:
        """A group's options that shape a step beyond its ``_flags`` and coefficients: a recorded
        step (``_replay``) is redone only while they stay the same."""
        return (group["master"], group["state_dtype"], group["fused"], group["seed"],
                self._math_buffers(group))

    def __setstate__(self, state: dict[str, Any]) -> None:
        # (torch's __setstate__, which load_state_dict, deepcopy and unpickling call, adds
        # "differentiable" to the defaults: an option of torch's own step, not a group option of
        # lowprec's, so it is not copied into the groups, whose state_dict() would then differ
        # from the one saved.)
        super().__setstate__(state)
        own = {k: v for k, v in self.defaults.items() if k not in _TORCH_ONLY_OPTIONS}
        for group in self.param_groups:
            for key, value in {**_COMMON_DEFAULTS, **own}.items():
                group.setdefault(key, value)
            for st in (self.state.get(p) for p in group["params"]):
                if st and "step" in st and not isinstance(st["step"], torch.Tensor):
                    # (a count saved as a number, as torch did before 1.12: a tensor, as torch's
                    # own optimizers convert it)
                    st["step"] = _step_tensor(st["step"], "a parameter's state")

    # ------------------------------------------------------------------ the step

    def _storage(self, group: dict[str, Any], p: torch.Tensor) -> MasterStorage:
        return resolve_master(group["master"], p.dtype)

    def _state_dtype(self, group: dict[str, Any], p: torch.Tensor, storage: MasterStorage):
        if group["state_dtype"] is not None:
            return group["state_dtype"]
        if storage.name in ("fp32", "split"):
            return torch.float32
        return p.dtype

    def _collect(
        self, late: list | None = None
    ) -> list[tuple[dict[str, Any], torch.Tensor, int, MasterStorage]]:
        """Validate every group, gradient and state; return the work list. Writes nothing.

        ``late`` collects the work items whose state lacks a buffer the update rule now keeps
        (an option turned on after the parameter's first step, e.g. SGD's momentum going from 0
        to 0.9): ``_step_all`` creates it, as torch.optim creates its buffers lazily."""
        work = []
        index = -1
        expected: dict[Any, dict[str, torch.dtype]] = {}  # per (group, dtype, strategy)
        for gi, group in enumerate(self.param_groups):
            storages = self._validate_group(group, gi)
            for pi, (p, storage) in enumerate(zip(group["params"], storages, strict=True)):
                index += 1
                if is_dtensor(p):  # (steps swap them for their shards: add_param_group notes them)
                    raise ValueError(
                        f"parameter group {gi}, parameter {pi}: a DTensor parameter was put in "
                        "param_groups directly; add it with add_param_group (or pass it to the "
                        "constructor) so that steps run on its local shard."
                    )
                g = p.grad
                if g is None:
                    continue
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
                state = self.state.get(p)
                if state:
                    key = (gi, p.dtype, storage.name)
                    if key not in expected:
                        expected[key] = self._expected_state(group, p, storage)
                    missing = self._check_state(
                        state, group, p, storage, (gi, pi), expected[key]
                    )
                    if missing and late is not None:
                        late.append((group, p, index, storage))
                work.append((group, p, index, storage))
        return work

    def _expected_state(self, group, p, storage) -> dict[str, torch.dtype]:
        sd = self._state_dtype(group, p, storage)
        return {**storage.buffers(p), **dict.fromkeys(self._math_buffers(group), sd)}

    def _check_state(self, state, group, p, storage, where, expected=None) -> tuple[str, ...]:
        """Raise ``ValueError`` unless ``state`` was made for ``p`` under these options; returns
        the update rule's buffers it lacks (created at the next step: ``_step_late``)."""
        if isinstance(where, tuple):  # (group, parameter): formatted only for an error
            where = f"parameter group {where[0]}, parameter {where[1]}"
        if state.get("master") != storage.name:
            raise ValueError(
                f"{where}: its optimizer state was created with master={state.get('master')!r} "
                f"but the group now resolves to {storage.name!r} (was the parameter's dtype or the "
                "group's master changed?); create a new optimizer after changing either."
            )
        if expected is None:
            expected = self._expected_state(group, p, storage)
        missing = tuple(
            name for name in self._math_buffers(group) if state.get(name, None) is None
        )
        for name, dtype in expected.items():
            t = state.get(name)
            if name in missing:
                continue
            if not isinstance(t, torch.Tensor) or t.shape != p.shape or t.dtype != dtype:
                got = (
                    f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else repr(t)
                )
                raise ValueError(
                    f"{where}: state {name!r} should be a {tuple(p.shape)} {dtype} tensor, got "
                    f"{got}; the state does not belong to this parameter or these options."
                )
        return missing

    def _init_state(self, group, p, storage) -> dict[str, Any]:
        if is_dtensor(p):  # (a checkpoint's state adopted for a DTensor: _adopt_state)
            return init_state_local(self, group, p, storage)
        sd = self._state_dtype(group, p, storage)
        state: dict[str, Any] = {
            "step": torch.tensor(0.0, dtype=torch.float32),
            "master": storage.name,
        }
        state.update(storage.init(p))
        for name in self._math_buffers(group):
            state[name] = self._new_math_buffer(group, p, name, sd)
        return state

    def _new_math_buffer(self, group, p, name: str, dtype: torch.dtype) -> torch.Tensor:
        return torch.full_like(
            p, self._init_math_buffer(name, p, group), dtype=dtype,
            memory_format=torch.preserve_format,
        )

    def _first_use_coefficients(self, group: dict[str, Any], step: Any) -> dict[str, Any]:
        """The coefficients of a parameter's first step with buffers created late (an option
        turned on after its first step: ``_collect``'s ``late``). Default: the step's own; SGD's
        momentum buffer starts as the step's direction, as torch.optim's does."""
        return self._coefficients(group, step)

    #: torch.amp.GradScaler hands this optimizer its scale and found-inf flag as the attributes
    #: ``grad_scale`` and ``found_inf`` (and does not unscale the gradients itself).
    _step_supports_amp_scaling = True

    # Left out of any graph that torch.compile traces around it (a compiled training step, or
    # torch.compile(opt.step)): the step compiles its own kernels with the settings they need
    # (emulate_precision_casts keeps Kahan's compensation; without it Inductor folds it to zero)
    # and decides on the host what to run; traced, it failed to compile, recompiled per
    # parameter past Dynamo's limit, or lost the compensation of an eager Kahan step.
    @torch.compiler.disable
    @torch.no_grad()
    def step(
        self,
        closure: Callable[[], Any] | None = None,
        *,
        grad_scale: torch.Tensor | float | None = None,
        found_inf: torch.Tensor | None = None,
    ) -> Any:
        """Perform one optimization step.

        With ``grad_scale`` or ``found_inf`` (the loss-scaler contract, also taken from the
        attributes of the same names that ``torch.amp.GradScaler`` sets), the step divides the
        gradients by ``grad_scale`` inside the update (``p.grad`` is not written), checks every
        gradient for inf/NaN, adds 1 to ``found_inf`` in place when it finds one, and skips the
        update when ``found_inf`` is nonzero: parameters, state and step counts stay bit-identical.
        All of it happens on the parameters' device without reading a value on the host.

        Args:
            closure: Re-evaluates the model and returns the loss (default: None).
            grad_scale: The loss scale the gradients carry, a one-element tensor or a positive
                number (default: None, meaning no scale).
            found_inf: A one-element float tensor, nonzero when a step must be skipped; the step
                adds its own finding to it (default: None, meaning no check).

        Returns:
            The closure's loss, or None.
        """
        if grad_scale is None:
            grad_scale = getattr(self, "grad_scale", None)
        if found_inf is None:
            found_inf = getattr(self, "found_inf", None)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.__dict__.get("_has_dtensors"):
            with local_shards(self):
                self._step_all(grad_scale, found_inf)
        else:
            self._step_all(grad_scale, found_inf)
        return loss

    def _step_all(self, grad_scale: Any, found_inf: Any) -> None:
        """``step()`` after the closure: redo the recorded step, or take a full one."""
        # (how the kernels take the scaler's inputs: _Scaling.mode)
        scaled = "unscale" if grad_scale is not None else "skip" if found_inf is not None else False
        plan = self.__dict__.get("_step_plan")
        if plan is not None and plan.scaled == scaled and self._replay(plan, grad_scale, found_inf):
            return
        self._step_plan = None
        late: list[Any] = []
        work = self._collect(late)
        scaling = None
        if scaled:
            scaling = _Scaling.prepare(
                work, grad_scale, found_inf, self.__dict__.get("_shard_reduce")
            )
        if late:  # (rare: a step that creates buffers is not recorded)
            self._step_late(late, scaling)
            ids = {id(p) for _, p, _, _ in late}
            work = [item for item in work if id(item[1]) not in ids]
            plan = None
        else:
            # The step is recorded, for the next steps to redo (_replay).
            plan = _Plan(self, scaled)
        memo: dict[Any, Any] = {"plan": plan}
        large, small = _by_size(work)
        for group, p, index, storage in large:
            self._step_param(group, p, index, storage, scaling, memo)
        small = self._step_small_fused(small, memo, scaling)
        for group, p, index, storage in small:
            self._step_param(group, p, index, storage, scaling, memo)
        self._step_plan = plan

    def _step_late(self, late: list, scaling: _Scaling | None) -> None:
        """Step the parameters whose state lacks buffers the rule now keeps (``_collect``):
        create them, then take an eager step with the coefficients of their first use."""
        for group, p, index, storage in late:
            state = self.state[p]
            dtype = self._state_dtype(group, p, storage)
            for name in self._math_buffers(group):
                if state.get(name, None) is None:
                    state[name] = self._new_math_buffer(group, p, name, dtype)
            self._step_param(group, p, index, storage, scaling, {}, first_use=True)

    def _replay(self, plan: _Plan, grad_scale: Any = None, found_inf: Any = None) -> bool:
        """Redo the recorded step ``plan`` with this step's numbers, if nothing it relied on changed.

        A step re-derives, per parameter, what rarely changes between steps: its strategy, the
        state's layout, flattened views, kernel variants, batches of small tensors. That host
        work is a large share of a fused step (more so with the caches cold after backward), so
        the previous step's outcome is kept and checked instead: the same groups, options and
        flags, the same parameter, gradient and state tensors (gradients may be new tensors of the
        same layout); the step counts are read as the full step reads them. Returns False, having
        written nothing, when anything differs; the full step then runs (and records anew).
        Options are validated as the full step validates them. A step under a loss scaler
        (``plan.scaled``) checks the gradients for inf/NaN first, as the full step does, and
        computes each parameter's numbers on its device from its step count.
        """
        if getattr(self, "_fused_broken", False) or len(self.param_groups) != len(plan.groups):
            return False
        memo: dict[Any, Any] = {}
        for gi, (group, (ref, params, options, flags)) in enumerate(
            zip(self.param_groups, plan.groups, strict=True)
        ):
            now = group["params"]
            if (group is not ref or len(now) != len(params)
                    or not all(map(operator.is_, now, params))):
                return False
            self._validate_options(group, gi)  # (raises as the full step would)
            if self._plan_options(group) != options or self._flags(group) != flags:
                return False
            memo[("flags", id(group))] = flags
        if any(p.grad is not None or p.dtype != dtype or p.device != device
               for p, dtype, device in plan.idle):
            return False  # (the full step validates every parameter, with a gradient or not)
        state = self.state
        if not all(e.current(state) for e in plan.entries):
            return False
        if not plan.read_counts():  # (before the scaler's check, which writes found_inf)
            return False
        scaling = None
        if plan.scaled:  # (off the CPU the counts are read on the device: _scaled_numbers)
            scaling = _Scaling.prepare(
                [(e.group, e.p, e.index, e.storage) for e in plan.entries], grad_scale, found_inf,
                self.__dict__.get("_shard_reduce"),
            )
        fused: list[_Entry] = []  # stepped by a compiled call here: their counts advance below
        try:
            for run in plan.merged(self):
                if isinstance(run, _Many):
                    if self._run_many(run, memo, scaling):
                        fused.extend(run.entries)
                        continue
                    runs = run.entries  # (not compiled: each by its own call, below)
                else:
                    runs = [run]
                for run in runs:
                    self._replay_run(run, memo, scaling, fused)
        finally:
            if fused:  # (also when a later parameter raised: these were stepped)
                _advance_counts([e.count for e in fused], scaling)
        return True

    def _replay_run(self, run, memo, scaling, fused: list[_Entry]) -> None:
        """Redo one recorded run (a batch or a parameter); ``fused`` collects the entries whose
        counts ``_replay`` advances."""
        if isinstance(run, _Batch):
            if not self._run_batch(run, run.entries[0].step + 1, memo, scaling):
                self._step_plan = None
                for group, p, index, storage in run.items:
                    self._step_param(group, p, index, storage, scaling, memo)
            return
        e = run
        if e.fused is not None:
            host = scaling is None or _host_counts(e.p.device)
            try:
                if host:
                    step = e.step + 1
                    self._run_fused(
                        e.fused, e.p.grad, *self._step_coefficients(e.group, step, memo),
                        *self._keys(e.group, e.storage, step, e.index),
                        {} if scaling is None else scaling.kernel_args(e.p.device),
                    )
                else:
                    step, lo, hi, coeffs, extra = self._scaled_numbers(
                        e.group, e.p, e.index, e.storage, e.state, scaling, memo
                    )
                    self._run_fused(e.fused, e.p.grad, coeffs, coeffs, lo, hi, extra)
            except _COMPILE_ERRORS as err:  # compilation failed before anything was written
                _disable_fused(self, err)
                self._step_plan = None
            else:
                if host:
                    fused.append(e)
                else:
                    self._advance(e.state, step, scaling, e.p.device)
                return
        self._step_param(e.group, e.p, e.index, e.storage, scaling, memo)

    def _run_many(self, many: _Many, memo, scaling) -> bool:
        """Redo ``many``'s parameters with one compiled call (``_update_many``); False, having
        written nothing, where they must go one by one instead: their step counts differ (the
        coefficients are shared), or the call cannot be compiled."""
        entries = many.entries
        step = entries[0].step + 1
        if any(e.step + 1 != step for e in entries) or not many.usable():
            return False
        e0 = entries[0]
        group, storage = e0.group, e0.storage
        _, c32 = self._step_coefficients(group, step, memo)
        if storage.needs_random_bits:
            keys = [_key_tensors(*self._keys(group, storage, step, e.index)) for e in entries]
            los, his = [lo for lo, _ in keys], [hi for _, hi in keys]
        else:
            los = his = [_ZERO_KEY] * len(entries)
        pvs = [_step_view(e.fused, e.p) for e in entries]
        gvs = [_step_view(e.fused, e.p.grad) for e in entries]
        kw = {} if scaling is None else scaling.kernel_args(e0.p.device)
        f = e0.fused
        if f.pairs is not None:
            kw["dtypes"] = f.pairs
        if f.sums_kernel is not None:
            kw["sums_fn"], kw["norm_terms"] = many.sums_fn, self._norm_terms
        try:
            with _one_cpp_kernel_per_loop():
                many.kernel(pvs, gvs, many.svs, many.mvs, c32, los, his, fn=many.fn,
                            storage=storage, math=self._math, flags=f.flags, **kw)
        except _COMPILE_ERRORS:  # (compilation failed before anything was written)
            many.broken()
            return False
        return True

    def _group_flags(self, group: dict[str, Any], memo: dict[Any, Any]) -> dict[str, bool]:
        key = ("flags", id(group))
        flags = memo.get(key)
        if flags is None:
            flags = memo[key] = self._flags(group)
        return flags

    def _step_coefficients(self, group, step, memo, tensors: bool = True) -> tuple[dict, Any]:
        """The group's coefficients at ``step`` on the host, and (``tensors``) as 0-d FP32 tensors
        for the compiled kernels; computed once per group and step number in a ``step()``."""
        key = ("coeffs", id(group), step)
        cached = memo.get(key)
        if cached is None or (tensors and cached[1] is None):
            host = self._coefficients(group, step) if cached is None else cached[0]
            c32 = self._coefficient_tensors(group, host) if tensors else None
            cached = memo[key] = (host, c32)
        return cached

    def _coefficient_tensors(self, group, host: dict[str, Any]) -> dict[str, torch.Tensor]:
        """``host`` as 0-d FP32 tensors for the compiled kernels, reusing the group's tensor from
        the previous step for every value that did not change (lr, betas, weight decay... most
        of them), so that a step creates few (each costs microseconds of host time)."""
        cache = self.__dict__.setdefault("_coefficient_cache", {})
        prev = cache.get(id(group))
        old_host, old = (prev[1], prev[2]) if prev is not None and prev[0] is group else ({}, {})
        c32 = {
            k: old[k] if k in old_host and _same_number(v, old_host[k])
            else torch.as_tensor(v, dtype=torch.float32)
            for k, v in host.items()
        }
        cache[id(group)] = (group, host, c32)
        return c32

    def _scaled_numbers(self, group, p, index, storage, state, scaling: _Scaling, memo) -> tuple:
        """A parameter's step under a loss scaler: its step number (FP64), random key halves,
        FP32 coefficients and the scaler's tensors, all on its device. The step count lives there
        and advances only when the step is taken, so everything that depends on it is computed
        there too. The coefficients that do not depend on it (lr, weight decay...) are the same
        tensors for the group's parameters within a ``step()``."""
        if state["step"].device != p.device:
            state["step"] = state["step"].to(p.device)
        step = state["step"].double() + 1
        lo, hi = (
            stream_key_halves(group["seed"], step.long(), index)
            if storage.needs_random_bits else (0, 0)
        )
        shared = memo.setdefault(("constants", id(group), p.device), {})
        coeffs = {}
        for k, v in self._coefficients(group, step).items():
            if isinstance(v, torch.Tensor):
                coeffs[k] = torch.as_tensor(v, dtype=torch.float32, device=p.device)
            else:
                t = shared.get(k)
                if t is None:
                    t = shared[k] = torch.as_tensor(v, dtype=torch.float32, device=p.device)
                coeffs[k] = t
        return step, lo, hi, coeffs, scaling.kernel_args(p.device)

    @staticmethod
    def _keys(group, storage: MasterStorage, step: int, index: int) -> tuple[int, int]:
        """The halves of a parameter's random key at ``step`` (zeros where none is needed)."""
        if not storage.needs_random_bits:
            return 0, 0
        key = stream_key(group["seed"], step, index)
        return key & 0xFFFFFFFF, key >> 32

    def _step_param(
        self, group, p, index, storage: MasterStorage, scaling=None, memo=None,
        first_use: bool = False,
    ) -> None:
        """One parameter's step. ``memo`` caches, for one ``step()`` call, what every parameter of a
        group shares (flags, coefficients and their tensors for a given step number), so that a
        model of many small tensors does not pay for them per tensor; its ``"plan"`` records the
        step for ``_replay``. ``first_use``: the first step of buffers created late
        (``_step_late``), eager, with ``_first_use_coefficients``."""
        memo = {} if memo is None else memo
        state = self.state[p]
        if not state:
            state.update(self._init_state(group, p, storage))
        sbufs = {k: state[k] for k in storage.buffers(p)}
        mbufs = {k: state[k] for k in self._math_buffers(group)}
        flags = self._group_flags(group, memo)
        if scaling is None or _host_counts(p.device):
            step = int(state["step"].item()) + 1
            lo, hi = self._keys(group, storage, step, index)
            coeffs, _ = self._step_coefficients(group, step, memo, tensors=False)
            extra = {} if scaling is None else scaling.kernel_args(p.device)
        else:
            step, lo, hi, coeffs, extra = self._scaled_numbers(
                group, p, index, storage, state, scaling, memo
            )
        if first_use:
            coeffs = self._first_use_coefficients(group, step)
        plan = memo.get("plan")
        # A DTensor's shard (lowprec.optim.shards): whole-tensor sums add every rank's shard.
        shards = reduce_groups(self, p) if not self._elementwise else ()
        # A DTensor's shard (lowprec.optim.shards): its random bits are keyed by its elements'
        # indices in the whole parameter, from `start` on (the compiled kernels take it as a
        # tensor, `base`; on bfloat16 pairs it must fall on a pair boundary).
        start = 0
        offsets = self.__dict__.get("_shard_offsets")
        if offsets and storage.needs_random_bits:
            start = offsets.get(id(p), 0)
        fusable = not start or (
            start + p.numel() <= _INT32_MAX and (start % 2 == 0 or p.dtype != torch.bfloat16)
        )
        tensors = (p, p.grad, *sbufs.values(), *mbufs.values())
        # Flattening must give views for the in-place writes to land: both the fused kernel and
        # the chunked eager step need contiguous tensors.
        contiguous = all(t.is_contiguous() for t in tensors)
        flat = lambda d, sl=slice(None): {k: v.view(-1)[sl] for k, v in d.items()}  # noqa: E731
        if (p.numel() > 1 and contiguous and fusable and not first_use
                and _fused_enabled(self, group, p)):
            if isinstance(step, int):  # (shared by the group's parameters at this step number)
                coeffs, c32 = self._step_coefficients(group, step, memo)
            else:
                c32 = {k: torch.as_tensor(v, dtype=torch.float32) for k, v in coeffs.items()}
            try:
                fused = self._prepare_fused(
                    storage, flags, p, p.grad, sbufs, mbufs, scaled=_mode(scaling),
                    start=start, shards=shards,
                )
                self._run_fused(fused, p.grad, coeffs, c32, lo, hi, extra)
            except _COMPILE_ERRORS as e:  # compilation failed before anything was written
                _disable_fused(self, e)
            else:
                self._advance(state, step, scaling, p.device)
                if plan is not None:
                    plan.add(_Entry(group, p, index, storage, state, fused))
                return
        chunkable = self._elementwise or self._norm_terms is not None
        if chunkable and contiguous and p.numel() > _EAGER_CHUNK:
            # Eager on a large tensor: go in chunks so the temporaries stay in cache (full-size
            # temporaries are fresh allocations that page-fault on every step) and the step's
            # peak memory stays a few MB over what it keeps. Elementwise rules and index-offset
            # random bits make this bit-identical to one pass.
            pieces = [
                (p.view(-1)[sl], p.grad.view(-1)[sl], flat(sbufs, sl), flat(mbufs, sl),
                 start + sl.start)
                for sl in (slice(i, i + _EAGER_CHUNK) for i in range(0, p.numel(), _EAGER_CHUNK))
            ]
        else:
            pieces = [(p, p.grad, sbufs, mbufs, start)]
        if self._norm_terms is not None and not self._elementwise and (len(pieces) > 1 or shards):
            # First pass: the rule's whole-tensor sums (FP64), read-only.
            sums = None
            for piece_p, piece_g, piece_s, piece_m, _ in pieces:
                part = _param_sums(
                    piece_p, piece_g, piece_s, piece_m, coeffs, storage=storage,
                    norm_terms=self._norm_terms, flags=flags, inv_scale=extra.get("inv_scale"),
                )
                sums = part if sums is None else sums + part
            coeffs = {**coeffs, "sums": all_reduce_sums(sums, shards)}
        for piece_p, piece_g, piece_s, piece_m, offset in pieces:
            _param_update(piece_p, piece_g, piece_s, piece_m, coeffs, lo, hi, storage=storage,
                          math=self._math, flags=flags, offset=offset, **extra)
        self._advance(state, step, scaling, p.device)
        if plan is not None:
            plan.add(_Entry(group, p, index, storage, state, None))

    def _prepare_fused(
        self, storage, flags, p, grad, sbufs, mbufs, *, scaled: bool = False,
        keyed: bool = False, per_word: bool = False, start: int = 0, shards: Any = (),
    ) -> _Fused:
        """What a compiled step of contiguous ``p`` needs besides the gradient and the step's
        numbers: flattened views (or words of pairs) of its buffers, and the kernel variants.
        It depends on the tensors' layouts and dtypes alone, so a recorded step keeps it
        (``_replay``).

        ``keyed``: per-word random keys (a batch of small parameters on pairs). ``per_word``: the
        sums are per parameter of such a batch, for a rule with ``_norm_terms``. ``start``: the
        index of ``p``'s first element in a larger parameter whose random bits it takes (a DTensor's
        shard; even on pairs), passed to the kernels as ``base``. ``shards``: the process groups
        over which a DTensor shard's whole-tensor sums are added (``_norm_terms``).
        """
        f = _Fused()
        f.storage, f.flags, f.p, f.sbufs, f.mbufs = storage, flags, p, sbufs, mbufs
        f.pairs = pairs = self._pairs_plan(storage, p, grad, sbufs, mbufs)
        f.n = n = p.numel() & ~1  # (on pairs, an odd last element takes the eager step)
        f.base, f.start, f.shards = None, start, tuple(shards)
        if start:
            # (bfloat16 hashes pairs: the first pair's index; start is even there)
            f.base = torch.tensor(start // 2 if p.dtype == torch.bfloat16 else start,
                                  dtype=torch.int64)
        f.per_word = per_word = per_word and self._norm_terms is not None
        if per_word and (pairs is None or n != p.numel()):
            raise ValueError("a batch with per-parameter norms needs the fused step on pairs")
        if pairs is None:
            if keyed:
                raise ValueError("per-word random keys need the fused step on pairs")
            f.views = ({k: v.view(-1) for k, v in sbufs.items()},
                       {k: v.view(-1) for k, v in mbufs.items()})
        else:
            f.views = ({k: _pair_words(v, n) for k, v in sbufs.items()},
                       {k: _pair_words(v, n) for k, v in mbufs.items()})
        # (The parameter's own view is made by each call, like the gradient's: a view kept here
        # would keep its storage allocated after `p.data = ...` or `model.to(...)`.)
        # The whole-tensor sums in a compiled pass of their own, so that the update pass
        # recomputes what it needs instead of keeping full-size temporaries.
        # The functions the kernels compile (a shared call, _Many, runs the same ones).
        f.update_fn = _param_update if pairs is None else _param_update_pairs
        f.sums_fn = None
        f.sums_kernel = None
        f.signature = signature = _signature(p, grad, sbufs, mbufs)
        if self._norm_terms is not None:
            f.sums_fn = _param_sums if pairs is None else _param_sums_pairs
            f.sums_kernel = _compiled_kernel(
                type(self), storage, flags, scaled=scaled, fn=f.sums_fn,
                extra_key=() if pairs is None
                else (*pairs, *((("sums", "per_word"),) if per_word else ())),
                signature=signature,
            )
        f.kernel = _compiled_kernel(
            type(self), storage, flags, scaled=scaled, fn=f.update_fn,
            extra_key=() if pairs is None
            else (*pairs, *((("keys", "batched"),) if keyed else ()),
                  *((("sums", "per_word"),) if per_word else ())),
            signature=signature,
        )
        return f

    def _run_fused(self, f: _Fused, grad, coeffs, c32, lo, hi, extra, segments=None) -> None:
        """The compiled step prepared in ``f`` with gradient ``grad`` (raises compile errors before
        writing anything).

        ``segments`` (a batch of small parameters on pairs, for a rule with ``_norm_terms``):
        ``(words, owner)``, the number of words of each parameter (a list) and each word's
        parameter (int32), so that the sums are each parameter's own.
        """
        storage, flags, pairs, n, p = f.storage, f.flags, f.pairs, f.n, f.p
        sv, mv = f.views
        pv, gv = _step_view(f, p), _step_view(f, grad)
        tail = slice(n, None) if pairs is not None and n < p.numel() else None
        flat = lambda d, sl: {k: v.view(-1)[sl] for k, v in d.items()}  # noqa: E731
        if f.sums_kernel is not None:
            c32 = dict(c32)  # the sums below are this parameter's own
            kw = dict(storage=storage, norm_terms=self._norm_terms, flags=flags,
                      inv_scale=extra.get("inv_scale"))
            if f.per_word:
                # Each word's squares (FP64; a batch is small, so this temporary is too), summed
                # per parameter and handed back to every word of the parameter.
                squares = f.sums_kernel(pv, gv, sv, mv, c32, dtypes=pairs, per_word=True, **kw)
                # ATen's sum along the words of each parameter adds pairwise, as eager's
                # sum_squares does (a strictly sequential sum, e.g. torch.segment_reduce, can
                # lose small squares to a large running total that pairwise sums keep).
                words, owner = segments
                sums = torch.stack([part.sum(1) for part in squares.split(words, dim=1)], dim=1)
                c32["sums"] = sums.index_select(1, owner)
            elif pairs is None:
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
                     storage=storage, math=self._math, flags=flags, **extra)
            return
        # 16-bit strategies go through pairs of elements (vectorized); an odd last element
        # takes the eager step, with its own index for the random bits.
        f.kernel(pv, gv, sv, mv, c32, *_key_tensors(lo, hi), storage=storage, math=self._math,
                 flags=flags, dtypes=pairs, **extra)
        if tail is not None:
            _param_update(
                p.view(-1)[tail], grad.view(-1)[tail], flat(f.sbufs, tail), flat(f.mbufs, tail),
                coeffs, lo, hi, storage=storage, math=self._math, flags=flags,
                offset=f.start + n, **{k: v for k, v in extra.items() if k != "base"},
            )

    def _step_small_fused(self, items, memo, scaling: _Scaling | None = None) -> list:
        """Fused steps of small parameters batched per group: one compiled call per batch.

        The per-call cost of a compiled kernel (~30-60 us, Dynamo's guards and wrappers) is most of
        a small tensor's step, and models have many (biases, norms). For deterministic
        elementwise strategies the batch's parameters and gradients are concatenated, stepped in
        one call with the group's coefficients (the state buffers in place where ``_flat_state``
        laid them out), and copied back: the same operations on every element, so the same bits.
        Stochastic rounding batches too, on pairs of elements (bfloat16 parameters of even
        length): each word of the batch is hashed with its own parameter's key and its index
        within that parameter, so it gets the random bits of the parameter's own step. Returns
        the items it did not take (stepped one by one as before).

        Under a loss scaler (``scaling``) the batch's call unscales and skips as a parameter's
        own does; batches are on CPU, where reading the step counts on the host costs no
        synchronisation, so the coefficients are the group's host numbers as in a plain step.
        """
        batches, rest = self._small_batches(items)
        plan = memo.get("plan")
        for batch in batches:
            if getattr(self, "_fused_broken", False) or not self._run_batch(
                batch, batch.step, memo, scaling
            ):
                rest.extend(batch.items)
            elif plan is not None:
                batch.entries = [
                    _Entry(group, p, index, storage, self.state[p], None)
                    for group, p, index, storage in batch.items
                ]
                plan.add(batch)
        return rest

    def _small_batches(self, items) -> tuple[list[_Batch], list]:
        """``_step_small_fused``'s batches of ``items`` (two or more parameters each, creating
        their state), and the items left out."""
        fresh: set[int] = set()  # ids of the parameters whose state is created here
        buckets, rest = self._small_buckets(items, fresh)
        batches = [_Batch(self, batch, step, fresh) for step, batch in buckets]
        return batches, rest

    def _small_buckets(self, items, fresh: set[int] | None) -> tuple[list[tuple[int, list]], list]:
        """How ``items`` (small parameters, in step order) fall into batches: ``(step, items)`` per
        batch of two or more, and the items left out.

        Per parameter this does only what must be redone each step (the host work here is most of
        a small tensor's cost): the state buffers' dtypes were checked by ``_collect``, so a
        batch is keyed by group, strategy, step and gradient dtype alone. With ``fresh`` a set,
        missing state is created (its parameters' ids added to ``fresh``); with None (a
        checkpoint being laid out, ``_lay_out_loaded``) parameters without state are left out and
        each gradient is taken to be like its parameter, as ``backward`` makes it.
        """
        if getattr(self, "_fused_broken", False) or not (
            self._elementwise or self._norm_terms is not None
        ):
            return [], items
        # Per-word random keys and per-parameter norms need every word within one parameter:
        # such batches are on pairs, of parameters of even length.
        norms = not self._elementwise
        rest, buckets, filled_of = [], {}, {}
        names_of: dict[Any, Any] = {}  # per (group, strategy, dtype): buffer names, or None
        shard_offsets = self.__dict__.get("_shard_offsets")
        for item in items:
            group, p, _index, storage = item
            ck = (id(group), storage.name, p.dtype)
            names = names_of.get(ck, _UNSET)
            if names is _UNSET:
                pairs_ok = not (norms or storage.needs_random_bits) or storage.pairs_ok(p.dtype)
                names = names_of[ck] = (
                    (*storage.buffers(p), *self._math_buffers(group))
                    if pairs_ok and p.device.type == "cpu" and _fused_enabled(self, group, p)
                    else None
                )
            g = p.grad if fresh is not None else p
            n = p.numel()
            if names is None or n < 2 or (n % 2 and (norms or storage.needs_random_bits)) or (
                storage.needs_random_bits and shard_offsets and shard_offsets.get(id(p))
            ) or (norms and reduce_groups(self, p)):
                # (a shard's random bits start at its offset, and its norms add every rank's
                # shard: _step_param)
                rest.append(item)
                continue
            state = self.state[p]
            if not state:
                if fresh is None:
                    rest.append(item)
                    continue
                state.update(self._init_state(group, p, storage))
                if not (shard_offsets and id(p) in shard_offsets):
                    # (a DTensor's shard keeps its own state tensors: a DTensor made from a
                    # view into a batch's flat tensor could not be saved or copied)
                    fresh.add(id(p))
            if not (p.is_contiguous() and g.is_contiguous()) or not all(
                state[k].is_contiguous() for k in names
            ):
                rest.append(item)
                continue
            step = int(state["step"].item()) + 1
            key = (ck, step, g.dtype)
            bucket = buckets.get(key)
            if bucket is None:
                bucket = buckets[key] = [[]]
            filled = filled_of.get(key, 0)  # elements in the bucket's last batch
            if filled + n > _SMALL_BATCH:
                bucket.append([])
                filled = 0
            bucket[-1].append(item)
            filled_of[key] = filled + n
        batches = []
        for key, bucket in buckets.items():
            for batch in bucket:
                if len(batch) == 1:
                    rest.extend(batch)
                else:
                    batches.append((key[1], batch))
        return batches, rest

    def _run_batch(self, batch: _Batch, step: int, memo, scaling: _Scaling | None = None) -> bool:
        """One compiled step of ``batch`` at ``step`` (under ``scaling``, if given); False (nothing
        written) where it cannot run fused, for its parameters to be stepped one by one."""
        group, storage = batch.group, batch.storage
        flags = self._group_flags(group, memo)
        coeffs, c32 = self._step_coefficients(group, step, memo)
        params = torch.cat(batch.dst)
        grad = torch.cat([_flat(p.grad) for p in batch.ps])
        # A state buffer laid out flat is stepped in place, the others concatenated.
        bufs = {k: torch.cat(batch.views[k]) if b is None else b for k, b in batch.bufs.items()}
        sbufs = {k: bufs[k] for k in batch.names_s}
        mbufs = {k: bufs[k] for k in batch.names_m}
        lo: Any = 0
        hi: Any = 0
        extra: dict[str, torch.Tensor] = {}
        if scaling is not None:
            extra = scaling.kernel_args(params.device)
        segments = None
        keyed = storage.needs_random_bits
        if not self._elementwise or keyed:
            if self._pairs_plan(storage, params, grad, sbufs, mbufs) is None:
                return False
            owner, idx = self._batch_layout(batch.words)
            if not self._elementwise:
                segments = (list(batch.words), owner)
            if keyed:
                keys = [stream_key(group["seed"], step, i) for _, _, i, _ in batch.items]
                lo = torch.tensor([k & 0xFFFFFFFF for k in keys], dtype=torch.int64)
                hi = torch.tensor([k >> 32 for k in keys], dtype=torch.int64)
                extra["owner"], extra["idx"] = owner, idx
        try:
            fused = self._prepare_fused(
                storage, flags, params, grad, sbufs, mbufs, scaled=_mode(scaling),
                keyed=keyed, per_word=segments is not None,
            )
            self._run_fused(fused, grad, coeffs, c32, lo, hi, extra, segments)
        except _COMPILE_ERRORS as e:  # nothing of the parameters was written
            _disable_fused(self, e)
            return False
        torch._foreach_copy_(batch.dst, params.split(batch.sizes))
        if "inv_scale" in extra:  # (the kernel unscaled the batch's copy of the gradients)
            torch._foreach_copy_([_flat(p.grad) for p in batch.ps], grad.split(batch.sizes))
        for k, b in batch.bufs.items():
            if b is None:
                torch._foreach_copy_(batch.views[k], bufs[k].split(batch.sizes))
        _advance_counts(batch.counts, scaling)  # (each held step - 1, the batch's key)
        return True

    def _batch_layout(self, words: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """For a batch on pairs of parameters of ``words`` words each: every word's parameter (its
        position in the batch) and its index within that parameter (int32 each), for
        per-parameter norms and ``_param_update_pairs``'s per-word random keys. Kept per batch
        composition, which stays the same from step to step."""
        layouts = self.__dict__.setdefault("_batch_layouts", {})
        layout = layouts.get(words)
        if layout is None:
            counts = torch.tensor(words, dtype=torch.int64)
            total = sum(words)
            owner = torch.repeat_interleave(
                torch.arange(len(words), dtype=torch.int64), counts, output_size=total
            )
            starts = torch.cumsum(counts, 0) - counts
            idx = torch.arange(total, dtype=torch.int64) - starts[owner]
            if len(layouts) >= 64:  # (a model whose batches keep changing: keep it bounded)
                layouts.clear()
            layout = layouts[words] = (owner.to(torch.int32), idx.to(torch.int32))
        return layout

    def _pairs_plan(
        self, storage: MasterStorage, p: torch.Tensor, grad, sbufs, mbufs
    ) -> tuple | None:
        """The ``dtypes`` of a fused step on pairs of elements, or None where it does not apply.

        Pairs are for CPU steps of the strategies that provide them (``storage.pairs_ok``: every
        strategy on bfloat16 parameters), elementwise rules or rules whose only reductions are
        ``_norm_terms``, and gradients and buffers in bfloat16 or FP32 whose flat views start on
        a pair boundary.
        """
        if (
            not storage.pairs_ok(p.dtype) or p.numel() < 2 or p.storage_offset() % 2
            or not (self._elementwise or self._norm_terms is not None)
            or p.device.type != "cpu"
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

    @staticmethod
    def _advance(state, step, scaling, device) -> None:
        if scaling is None:
            state["step"].fill_(step)
        else:  # one more step unless this one was skipped, decided on the device
            state["step"].add_(scaling.taken_on(device))

    # ------------------------------------------------------------------ master values

    def _group_of(self, p: torch.Tensor) -> dict[str, Any]:
        for group in self.param_groups:
            if any(q is p for q in group["params"]):
                return group
        raise ValueError("this tensor is not a parameter of the optimizer.")

    @torch.no_grad()
    def master_weight(self, p: torch.Tensor) -> torch.Tensor:
        """The FP32 value the optimizer holds for parameter ``p`` (a new tensor).

        For ``"split"`` this is ``join(top, trail)``, for ``"kahan"`` the compensated value, for
        ``"fp32"`` the FP32 copy, otherwise the parameter itself in FP32.
        """
        group = self._group_of(p)
        storage = self._storage(group, p)
        state = self.state.get(p)
        if is_dtensor(p):  # (computed on this rank's shard, returned as a DTensor like p)
            lp = local(p)
            if not state:
                return wrap_like(lp.float(), p)
            bufs = {k: local(state[k]) for k in storage.buffers(lp)}
            return wrap_like(storage.load(lp, bufs).clone(), p)
        if not state:
            return p.detach().float().clone()
        return storage.load(p, {k: state[k] for k in storage.buffers(p)}).clone()

    # ------------------------------------------------------------------ checkpoints

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a ``state_dict``, keeping every state tensor's dtype.

        ``torch.optim.Optimizer.load_state_dict`` casts floating-point state to the parameter's
        dtype, which would round an FP32 master copy, FP32 moments or a compensation buffer kept
        for a BF16 parameter. Here state tensors keep their saved dtype and move to the
        parameter's device; the checkpoint is checked against the parameters before anything is
        changed. The hooks of ``register_load_state_dict_pre_hook`` and ``..._post_hook`` run
        as torch.optim runs them: the pre-hooks on (a shallow copy of) the state dict first,
        each able to replace it, the post-hooks once everything is loaded.
        """
        state_dict = state_dict.copy()  # (as torch.optim: a pre-hook may edit or replace it)
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            out = pre_hook(self, state_dict)
            if out is not None:
                state_dict = out
        saved_groups = copy.deepcopy(state_dict["param_groups"])  # (not shared with the caller)
        saved_state = state_dict["state"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"the checkpoint has {len(saved_groups)} parameter groups, this optimizer "
                f"{len(self.param_groups)}."
            )
        id_map: dict[Any, tuple[torch.Tensor, dict[str, Any]]] = {}
        loaded_groups = []
        for gi, (sg, g) in enumerate(zip(saved_groups, self.param_groups, strict=True)):
            if len(sg["params"]) != len(g["params"]):
                raise ValueError(
                    f"parameter group {gi} has {len(g['params'])} parameters but the checkpoint's "
                    f"has {len(sg['params'])}."
                )
            # The checkpoint's options win. A torch.optim checkpoint (no "master") brings its
            # hyperparameters, and lowprec's own options stay as this optimizer's group has
            # them: its "fused" means torch's kernels, and it has no master or seed.
            own = {} if "master" in sg else {k: g[k] for k in _COMMON_DEFAULTS}
            merged = {k: v for k, v in {**g, **sg, **own}.items() if k not in _TORCH_ONLY_OPTIONS}
            merged["params"] = g["params"]
            if merged["seed"] is None:
                merged["seed"] = g["seed"]
            self._validate_group(merged, gi)
            loaded_groups.append(merged)  # (with the live parameters, as torch's update_group)
            for sid, p in zip(sg["params"], g["params"], strict=True):
                id_map[sid] = (p, merged)
        new_state: dict[torch.Tensor, dict[str, Any]] = {}
        for sid, st in saved_state.items():
            if sid not in id_map:
                raise ValueError(f"the checkpoint holds state for unknown parameter id {sid!r}.")
            p, merged = id_map[sid]
            moved = {
                k: (v.to(device=v.device if k == "step" else p.device, copy=True)
                    if isinstance(v, torch.Tensor) else copy.deepcopy(v))
                for k, v in st.items()
            }
            if "step" in moved and not isinstance(moved["step"], torch.Tensor):
                # A count saved as a number (torch before 1.12, and some third-party code):
                # a tensor, as torch's own optimizers convert it.
                moved["step"] = _step_tensor(moved["step"], f"parameter {sid!r}")
            if moved:
                storage = self._storage(merged, p)
                if "master" not in moved:  # torch.optim's state: see _adopt_state
                    moved = self._adopt_state(moved, merged, p, storage, f"parameter {sid!r}")
                self._check_state(moved, merged, p, storage, f"parameter {sid!r}")
                if is_dtensor(p):
                    check_loaded_state(moved, p, f"parameter {sid!r}")
            new_state[p] = moved
        self._step_plan = None
        self.__dict__.pop("_shards", None)  # (DTensor parameters' local views: lowprec.optim.shards)
        # What torch's load_state_dict does once it has cast the state, which here keeps its
        # dtypes: the live parameters in the loaded groups, the state keyed by them.
        state: defaultdict[torch.Tensor, dict[str, Any]] = defaultdict(dict)
        state.update(new_state)
        self.__setstate__({"state": state, "param_groups": loaded_groups})
        self._lay_out_loaded()
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _adopt_state(self, st, group, p, storage, where) -> dict[str, Any]:
        """A parameter's state saved by torch.optim (SGD, AdamW or Adagrad: the same buffer names,
        no ``"master"`` entry) as this optimizer's, to resume a torch.optim run with lowprec: the
        moments cast to this group's state dtype, the master's own buffers as at a fresh start
        from the parameter's current value (a zero Kahan compensation or split trail, an FP32
        copy of the parameter: load the model's weights first), the count kept
        (torch's SGD keeps none: 1 once it has a momentum buffer, so the next step is not the
        first)."""
        names = self._math_buffers(group)
        # (older torch SGD without momentum kept momentum_buffer=None: nothing to adopt)
        unknown = sorted(k for k, v in st.items() if v is not None and k not in {"step", *names})
        if unknown:
            raise ValueError(
                f"{where}: the checkpoint's state holds {unknown}, which {type(self).__name__} "
                f"with these options does not keep (it keeps {['step', *names]}); load a "
                "checkpoint of the same optimizer."
            )
        state = self._init_state(group, p, storage)
        for name in names:
            t = st.get(name)
            if t is None:  # (torch's SGD before its first step: the fresh buffer)
                continue
            if not isinstance(t, torch.Tensor) or t.shape != p.shape:
                got = f"{tuple(t.shape)}" if isinstance(t, torch.Tensor) else repr(t)
                raise ValueError(
                    f"{where}: state {name!r} should be a {tuple(p.shape)} tensor, got {got}; "
                    "the state does not belong to this parameter."
                )
            state[name] = t.to(device=p.device, dtype=state[name].dtype, copy=True)
        step = st.get("step")
        if step is None:
            step = 1.0 if any(st.get(name) is not None for name in names) else 0.0
        state["step"] = torch.tensor(float(step), dtype=torch.float32)
        return state

    def _lay_out_loaded(self) -> None:
        """Lay out the small parameters' loaded state as a fused step batches them (one flat
        tensor per batch and buffer name, each parameter's entry a view of it: ``_flat_state``),
        so that a resumed run steps it in place as a fresh one does, rather than concatenating it
        and copying it back every step. The tensors were just copied from the checkpoint, so
        nothing outside the optimizer holds them yet. Where the next step batches differently
        (a parameter without a gradient, a gradient of another dtype) it concatenates as before.
        """
        work, index = [], -1
        for gi, group in enumerate(self.param_groups):
            for p, storage in zip(group["params"], self._validate_group(group, gi), strict=True):
                index += 1
                if self.state.get(p) and not is_dtensor(p):  # (DTensor state stays as loaded)
                    work.append((group, p, index, storage))
        buckets, _ = self._small_buckets(_by_size(work)[1], None)
        for _step, items in buckets:
            group, _, _, storage = items[0]
            states = [self.state[p] for _, p, _, _ in items]
            sizes = [p.numel() for _, p, _, _ in items]
            for name in (*storage.buffers(items[0][1]), *self._math_buffers(group)):
                if all(st.get(name) is not None for st in states) and len(
                    {(st[name].dtype, st[name].device) for st in states}
                ) == 1:
                    _flat_state(states, name, sizes, True)


def _inputs(
    p: torch.Tensor,
    grad: torch.Tensor,
    sbufs: dict[str, torch.Tensor],
    mbufs: dict[str, torch.Tensor],
    storage: MasterStorage,
    inv_scale: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """The update rule's FP32 inputs: the master weight, the (unscaled) gradient, the buffers."""
    g = grad.float() if inv_scale is None else grad.float() * inv_scale
    return storage.load(p, sbufs), g, {k: v.float() for k, v in mbufs.items()}


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
) -> torch.Tensor:
    """The sums of squares of a rule's ``_norm_terms`` over ``p`` (read-only; FP64, one each)."""
    terms = norm_terms(*_inputs(p, grad, sbufs, mbufs, storage, inv_scale), c, **flags)
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
    per_word: bool = False,
) -> torch.Tensor:
    """``_param_sums`` on pairs of elements (the words of ``_param_update_pairs``). With
    ``per_word``, each word's share instead: the squares of its two elements' terms added in
    FP64, one row per term, which a batch of parameters sums per parameter."""
    even, odd = _pair_inputs(p, grad, sbufs, mbufs, storage, dict(dtypes), inv_scale)
    even, odd = norm_terms(*even, c, **flags), norm_terms(*odd, c, **flags)
    if per_word:
        return torch.stack(
            [a.double().square() + b.double().square() for a, b in zip(even, odd, strict=True)]
        )
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
) -> None:
    """The whole step of one parameter: load the master, update in FP32, store, then write.

    ``offset`` is the index of ``p``'s first element when ``p`` is a chunk of a larger parameter
    (it keys the random bits of stochastic rounding); ``base`` (a 0-d int64 tensor, for compiled
    steps of a DTensor's shard) moves every index by as much: ``_random_bits``. Under a loss
    scaler, ``inv_scale`` (0-d FP32) multiplies the gradient, which is written back unscaled (as
    ``torch.amp.GradScaler`` leaves gradients: for code that reads them after the step), and
    ``skip`` (0-d bool) selects the old values for every write but the gradient's.

    The eager path calls this directly; the fused path runs it under ``torch.compile``, which turns
    it into one pass over the elements with the writes done in place. Everything is computed
    before the first write.
    """
    w, g, m = _inputs(p, grad, sbufs, mbufs, storage, inv_scale)
    new_w, new_m = math(w, g, m, c, **flags)
    bits = None
    if storage.needs_random_bits:
        bits = _random_bits(offset, p.numel(), p.device, key_lo, key_hi, p.dtype, base)
        bits = bits.view(p.shape)
    new_p, new_s = storage.store(new_w, p, sbufs, bits)
    if skip is not None:  # a skipped step writes back what was there, bit for bit
        new_p = torch.where(skip, p, new_p)
        new_s = {k: torch.where(skip, sbufs[k], v) for k, v in new_s.items()}
        new_m = {k: torch.where(skip, mbufs[k].float(), v) for k, v in new_m.items()}
    for k, v in new_m.items():
        mbufs[k].copy_(v)
    for k, v in new_s.items():
        sbufs[k].copy_(v)
    p.copy_(new_p)
    if inv_scale is not None:
        grad.copy_(g)


def _random_bits(
    offset: int, numel: int, device: torch.device, key_lo: Any, key_hi: Any, dtype: torch.dtype,
    base: torch.Tensor | None = None,
) -> torch.Tensor:
    """Stochastic rounding's random bits for elements ``offset .. offset + numel - 1`` of a parameter.

    ``base``: a 0-d int64 tensor added to every hashed index (a compiled step of a DTensor's shard
    passes its first element's index in the whole parameter there, so that one compilation serves
    every shard): for bfloat16 the index of the first pair (half that element's index, which must
    be even, with ``offset`` 0), otherwise the first element's index.

    Element ``i`` of a bfloat16 parameter takes 16 bits of the 32-bit hash of ``i // 2``: the low
    half for even ``i``, the high half for odd ``i``, so one hash serves a pair of elements: it is
    computed once per pair here as in the fused step on pairs (hashing it per element made an
    eager BF16 stochastic AdamW step ~13% longer). Other dtypes (float16 takes 24 bits) get the
    hash of ``i`` itself.
    """
    # int32 indices where they fit (the hash is then int32 throughout, much cheaper than int64 on
    # CPUs without 64-bit vector multiplies); the same bits either way.
    wide = offset + numel > _INT32_MAX
    itype = torch.int64 if wide else torch.int32
    if dtype != torch.bfloat16:
        idx = torch.arange(offset, offset + numel, device=device, dtype=itype)
        return hash_bits(idx if base is None else idx + base, key_lo, key_hi)
    if numel == 0:
        return torch.empty(0, device=device, dtype=torch.int32)
    # Each pair's hash once: its low half for the even element, its high half (shifted down)
    # for the odd one, interleaved; elements offset .. offset + numel - 1 are a slice of them.
    first = offset // 2
    words = torch.arange(first, (offset + numel - 1) // 2 + 1, device=device, dtype=itype)
    h = hash_bits(words if base is None else words + base, key_lo, key_hi)
    halves = torch.stack([h & 0xFFFF, (h >> 16) & 0xFFFF], dim=-1).view(-1)
    start = offset - 2 * first
    return halves[start:start + numel]


def _unpack_pairs(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return _unpack_bf16_pairs(t) if dtype == torch.bfloat16 else _unpack_f32_pairs(t)


def _pair_inputs(p, grad, sbufs, mbufs, storage, kinds, inv_scale):
    """``_inputs`` on words: the rule's FP32 (master, gradient, buffers) of the even elements
    and of the odd ones; ``kinds`` gives the grad's and each math buffer's real dtype."""
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
    """Words holding ``even`` and ``odd`` (FP32) rounded to ``dtype`` as ``copy_`` would round them."""
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
    """``_param_update`` on pairs of elements, for the compiled step of a 16-bit strategy.

    Every tensor is a view of one parameter's first ``2 * len(p)`` elements as words holding
    two elements each (see "Pairs" in ``lowprec.numerics``): int32 for 16-bit tensors, int64 for
    32-bit ones. ``dtypes`` gives the grad's and each math buffer's real dtype. The update rule
    runs unchanged on the even and on the odd elements, so each element gets the operations
    ``_param_update`` gives it; the words are unpacked and packed with exact bit operations.
    Compiled CPU code vectorizes this where it cannot vectorize a loop over int16 elements.

    ``idx`` and ``owner`` (int32, one per word) key a batch of small parameters: ``key_lo`` and
    ``key_hi`` then hold one key half per parameter (int64), ``owner`` gives each word's
    parameter and ``idx`` its index within that parameter, which replaces the word's own index
    in the random bits' hash (``_batch_layout``). ``base`` (0-d int64) is added to every word's
    index: a DTensor shard's first word's index in the whole parameter (``_random_bits``).
    """
    kinds = dict(dtypes)
    even, odd = _pair_inputs(p, grad, sbufs, mbufs, storage, kinds, inv_scale)
    unscaled = None if inv_scale is None else _pack_pairs(even[1], odd[1], kinds["grad"])
    new_we, m_even = math(*even, c, **flags)
    new_wo, m_odd = math(*odd, c, **flags)
    bits = None
    if storage.needs_random_bits:  # one hash per pair: see _random_bits
        if idx is None:
            idx = torch.arange(p.numel(), device=p.device,
                               dtype=torch.int64 if p.numel() > _INT32_MAX else torch.int32)
        elif owner is not None:
            key_lo, key_hi = key_lo[owner], key_hi[owner]
        bits = hash_bits(idx if base is None else idx + base, key_lo, key_hi)
    new_p, new_s = storage.store_pairs(new_we, new_wo, p, sbufs, bits)
    new_m = {k: _pack_pairs(m_even[k], m_odd[k], kinds[k]) for k in m_even}
    if skip is not None:  # a skipped step writes back what was there, bit for bit
        new_p = torch.where(skip, p, new_p)
        new_s = {k: torch.where(skip, sbufs[k], v) for k, v in new_s.items()}
        new_m = {k: torch.where(skip, mbufs[k], v) for k, v in new_m.items()}
    for k, v in new_m.items():
        mbufs[k].copy_(v)
    for k, v in new_s.items():
        sbufs[k].copy_(v)
    p.copy_(new_p)
    if unscaled is not None:  # (the gradient written back unscaled: _param_update)
        grad.copy_(unscaled)


def _update_many(
    pvs, gvs, svs, mvs, c, los, his, *, fn, sums_fn=None, norm_terms=None, **kw
) -> None:
    """``fn`` (``_param_update`` or ``_param_update_pairs``) on each of several parameters, for
    one compiled call that steps them all (``_Many``); ``c`` is shared, the keys are each one's.

    A rule with whole-tensor norms passes ``sums_fn`` (``_param_sums`` or ``_param_sums_pairs``)
    and its ``norm_terms``: each parameter's sums, then its update, before the next parameter's,
    so that the update finds the parameter's tensors still in cache from its own sums pass."""
    sums_kw = {k: kw[k] for k in ("storage", "flags", "dtypes", "inv_scale") if k in kw}
    for pv, gv, sv, mv, lo, hi in zip(pvs, gvs, svs, mvs, los, his, strict=True):
        cp = c
        if sums_fn is not None:
            cp = {**c, "sums": sums_fn(pv, gv, sv, mv, c, norm_terms=norm_terms, **sums_kw)}
        fn(pv, gv, sv, mv, cp, lo, hi, **kw)


_WORDS = {2: torch.int32, 4: torch.int64}


def _pair_words(t: torch.Tensor, n: int) -> torch.Tensor:
    """The first ``n`` (even) elements of contiguous ``t`` as words of two elements each."""
    flat = t.view(-1)
    return (flat if n == flat.numel() else flat[:n]).view(_WORDS[t.element_size()])


class _Scaling:
    """One step's loss-scaler inputs, resolved on the devices: ``1 / grad_scale`` and the skip flag.

    The inf/NaN check is a read-only pass over the gradients (a min and a max per tensor, which
    propagate inf and NaN) done before the first write, since a skipped step must leave every
    parameter unchanged, including those updated before the bad gradient would be met. The
    unscaling happens inside the update itself; ``p.grad`` is never rewritten.
    """

    def __init__(self, inv_scale: torch.Tensor | None, skip: torch.Tensor) -> None:
        self._inv = {} if inv_scale is None else {inv_scale.device: inv_scale}
        self._skip = {skip.device: skip}
        self._taken: dict[torch.device, torch.Tensor] = {}
        #: What the kernels do: "unscale" (divide the gradients by the scale, write them back
        #: unscaled, skip on inf/NaN) or "skip" (gradients already unscaled, e.g. by the scaler's
        #: unscale_: skip only). Part of a compiled kernel's key.
        self.mode = "skip" if inv_scale is None else "unscale"

    @classmethod
    def prepare(cls, work, grad_scale, found_inf, reduce=None) -> _Scaling:
        """``reduce``: process groups over which the inf/NaN finding is combined (the ranks
        holding the shards of DTensor parameters: lowprec.optim.shards), so that all skip alike."""
        devices = list(dict.fromkeys(p.device for _, p, _, _ in work))
        home = found_inf.device if isinstance(found_inf, torch.Tensor) else (
            devices[0] if devices else torch.device("cpu"))
        if found_inf is not None and (
            not isinstance(found_inf, torch.Tensor) or found_inf.numel() != 1
            or not found_inf.is_floating_point()
        ):
            raise TypeError(
                "found_inf must be a one-element floating-point tensor (e.g. "
                "torch.zeros((), device=...)), which the step increments when it finds inf/NaN."
            )
        if grad_scale is None:
            inv = None
        elif isinstance(grad_scale, torch.Tensor):
            if grad_scale.numel() != 1 or not grad_scale.is_floating_point():
                raise TypeError(
                    f"grad_scale must be a one-element floating-point tensor or a positive number,"
                    f" got a {tuple(grad_scale.shape)} {grad_scale.dtype} tensor."
                )
            # As torch.amp.GradScaler: the reciprocal in FP64, then rounded to FP32.
            inv = grad_scale.detach().reshape(()).double().reciprocal().float()
        else:
            scale = _as_float(grad_scale, "grad_scale")
            if not (scale > 0 and scale < float("inf")):
                raise ValueError(f"grad_scale must be positive and finite, got {grad_scale}.")
            inv = torch.tensor(1.0 / scale, dtype=torch.float32, device=home)
        bad = torch.zeros((), dtype=torch.float32, device=home)
        for device in devices:
            grads = [p.grad for _, p, _, _ in work if p.device == device and p.grad.numel()]
            if not grads:
                continue
            # min + max of every gradient, summed in FP64 (no overflow from finite values): the
            # total is finite exactly when every gradient is.
            ends = torch.stack([e for g in grads for e in torch.aminmax(g)]).double()
            bad += (~torch.isfinite(ends.sum())).to(device=home, dtype=torch.float32)
        if found_inf is None:
            found = bad
        else:
            found = found_inf
            found.add_(bad.to(found.device, found.dtype))
        for group in reduce or ():  # (the caller's finding too: e.g. a scaler's unscale_)
            torch.distributed.all_reduce(found, op=torch.distributed.ReduceOp.MAX, group=group)
        return cls(inv, found.reshape(()) != 0)

    def inv_scale_on(self, device: torch.device) -> torch.Tensor:
        if device not in self._inv:
            self._inv[device] = next(iter(self._inv.values())).to(device, non_blocking=True)
        return self._inv[device]

    def skip_on(self, device: torch.device) -> torch.Tensor:
        if device not in self._skip:
            self._skip[device] = next(iter(self._skip.values())).to(device, non_blocking=True)
        return self._skip[device]

    def kernel_args(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The keyword arguments a step's kernel takes on ``device``: the skip flag, and the
        inverse scale where the gradients carry one (``mode``)."""
        if not self._inv:
            return {"skip": self.skip_on(device)}
        return {"inv_scale": self.inv_scale_on(device), "skip": self.skip_on(device)}

    def taken_on(self, device: torch.device) -> torch.Tensor:
        if device not in self._taken:
            self._taken[device] = (~self.skip_on(device)).float()
        return self._taken[device]


def _mode(scaling: _Scaling | None) -> str | bool:
    """How a step's kernels take a loss scaler's inputs (``_Scaling.mode``); False: none."""
    return False if scaling is None else scaling.mode


def _by_size(work: list) -> tuple[list, list]:
    """``step()``'s order of its work list: the large parameters, largest first, then the small
    ones (up to ``_SMALL`` elements, batched). Parameters are independent (the random key is a
    parameter's index, not its position here), so only the batches depend on this order."""
    work = sorted(work, key=lambda item: -item[1].numel())
    n_large = sum(item[1].numel() > _SMALL for item in work)
    return work[:n_large], work[n_large:]


def _advance_counts(counts: list[torch.Tensor], scaling: _Scaling | None) -> None:
    """Advance the step counts of parameters stepped together, in one call. Each holds the whole
    number read on the host before the step, so adding 1 stores what ``_advance``'s
    ``fill_(count + 1)`` would, for floating-point or integer counts (a loaded checkpoint keeps
    its dtype); under a loss scaler, ``1 - skip``, decided on the device (these counts are on the
    CPU, where the flag costs no synchronisation)."""
    torch._foreach_add_(counts, 1 if scaling is None else scaling.taken_on(counts[0].device))


def _host_counts(device: torch.device) -> bool:
    """Whether a step under a loss scaler reads the step counts of parameters on ``device`` on the
    host and takes the group's host numbers, as a plain step does: on the CPU, where that costs
    no synchronisation and saves each parameter a dozen small tensor operations. Elsewhere the
    numbers are computed on the device (``_scaled_numbers``)."""
    return device.type == "cpu"


# ------------------------------------------------------------------ the compiled (fused) path

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

_KERNELS: dict[Any, Callable[..., None]] = {}
_UNSET = object()
_PAIR_DTYPES = (torch.bfloat16, torch.float32)
_ZERO_KEY = torch.zeros((), dtype=torch.int64)


def _key_tensors(lo: Any, hi: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The random key's halves as 0-d tensors for a compiled kernel (a constant zero when unused)."""
    if isinstance(lo, torch.Tensor):
        return lo, hi
    if lo == 0 and hi == 0:
        return _ZERO_KEY, _ZERO_KEY
    return torch.tensor(lo), torch.tensor(hi)
_INT32_MAX = 2**31 - 1
# Elements per piece of the eager step on large tensors: big enough to amortise Python overhead,
# small enough that the temporaries (40-60 bytes per element at their peak, 3-4 MB here) stay in
# cache and keep a step's peak memory within 5% of the resident params, grads and state of a
# 25M-parameter BF16 model. Measured with benchmarks/optimizer_step.py (peak/res of the BF16
# eager rows, 25M parameters): 2**17 gives 1.03-1.09 (the allocator's fragmentation roughly
# doubles the live temporaries), 2**16 1.01-1.05 row by row (up to 1.08 after earlier rows have
# fragmented the heap), at 5-25% more time per eager step than 2**17.
_EAGER_CHUNK = 1 << 16
# Fused steps of parameters up to _SMALL elements are batched, up to _SMALL_BATCH elements per
# compiled call (the concatenated copies are the batch's only temporaries: a few MB at most).
_SMALL = 1 << 16
_SMALL_BATCH = 1 << 18


def _compiled_kernel(
    cls: type, storage: MasterStorage, flags: dict[str, bool], *, scaled: bool = False,
    fn: Callable[..., Any] = _param_update, extra_key: tuple[Any, ...] = (),
    options: dict[str, Any] | None = None, signature: tuple[Any, ...] = (),
) -> Callable[..., Any]:
    """A compiled ``_param_update`` (or ``fn``) for one variant: optimizer, storage, flags, and
    the ``signature`` of its tensors (``_signature``: device type and dtypes).

    Each variant gets its own copy of the function's code object, so Dynamo keeps a separate
    cache (and recompile budget) per variant instead of one shared by every optimizer. Everything
    that changes the generated code is in the key: a dtype or device left out made one function
    recompile for every combination a process stepped, until Dynamo's recompile limit raised.
    Shapes are dynamic (parameters are passed flattened), so one compilation serves every size.
    ``options``: Inductor settings on top of the ones below (``_MANY_OPTIONS``).
    """
    key = (cls, storage.name, tuple(sorted(flags.items())), scaled, fn.__name__, extra_key,
           tuple(sorted((options or {}).items())), signature)
    kernel = _KERNELS.get(key)
    if kernel is None:
        code = fn.__code__
        what = "step" if fn is _param_update else fn.__name__.strip("_")
        what += "".join(f"_{str(v).split('.')[-1]}" for _, v in extra_key)
        name = f"lowprec_{cls.__name__}_{storage.name}{f'_{scaled}' if scaled else ''}_{what}"
        variant = types.FunctionType(
            code.replace(co_name=name, co_qualname=name)
            if sys.version_info >= (3, 11) else code.replace(co_name=name),
            fn.__globals__, name, fn.__defaults__, fn.__closure__,
        )
        variant.__kwdefaults__ = fn.__kwdefaults__
        # emulate_precision_casts: without it Inductor folds x.to(bf16).float() into x, which
        # would make the Kahan remainder w - round(w) zero and drop the compensation silently.
        # cpp.dynamic_threads: the C++ kernel gets its parallel loop whatever the size it is
        # first compiled for. Otherwise Inductor leaves out the parallel region when that size is
        # small, and its on-disk cache then hands the single-threaded kernel to every later
        # process and size (a test run on small tensors made a 25M-parameter step 1.4x slower).
        kernel = torch.compile(
            variant, dynamic=True, fullgraph=True,
            options={"emulate_precision_casts": True, "cpp.dynamic_threads": True,
                     **(options or {})},
        )
        _KERNELS[key] = kernel
    return kernel


def _signature(p, grad, sbufs, mbufs) -> tuple[Any, ...]:
    """What of a step's tensors besides their sizes decides a compiled kernel's code: the device
    type and every dtype (``_compiled_kernel``'s key)."""
    return (p.device.type, p.dtype, grad.dtype,
            *((k, v.dtype) for k, v in sbufs.items()), *((k, v.dtype) for k, v in mbufs.items()))


def _fused_enabled(opt, group, p) -> bool:
    fused = group["fused"]
    if fused is False or getattr(opt, "_fused_broken", False):
        return False
    if fused is None:
        return p.device.type == "cuda"
    return True


def _disable_fused(opt, error: BaseException) -> None:
    opt._fused_broken = True
    warnings.warn(
        f"lowprec: the fused (torch.compile) optimizer step is unavailable here ({type(error).__name__}: "
        f"{str(error).splitlines()[0] if str(error) else ''}); falling back to the eager step, "
        "which gives the same results more slowly. Install a C++ compiler (CPU) or Triton (GPU), "
        "or pass fused=False to silence this warning.",
        RuntimeWarning,
        stacklevel=4,
    )


# ------------------------------------------------------------------ recorded steps (_replay)


def _same_number(a: Any, b: Any) -> bool:
    """Whether host numbers ``a`` and ``b`` are the same value, bit for bit (-0.0 is not 0.0)."""
    if type(a) is not type(b) or not isinstance(a, (int, float)):
        return False
    return a.hex() == b.hex() if isinstance(a, float) else a == b


def _flat(t: torch.Tensor) -> torch.Tensor:
    """Contiguous ``t`` as a 1-d view (``t`` itself when it is one)."""
    return t if t.dim() == 1 else t.view(-1)


def _step_view(f: _Fused, t: torch.Tensor) -> torch.Tensor:
    """The view of a parameter (or its gradient) ``t`` that ``f``'s kernel takes: flat, or its
    words of pairs of elements. Always a new view, even of a 1-d ``t``: handed a 1-d parameter
    itself (a leaf that requires grad), a parameter's own call fails to compile in Inductor."""
    return t.view(-1) if f.pairs is None else _pair_words(t, f.n)


def _grad_kind(g: torch.Tensor) -> tuple[Any, ...]:
    """What a step's path depends on in a gradient besides its shape."""
    return g.dtype, g.device, g.layout, g.is_contiguous(), g.storage_offset() % 2


class _Fused:
    """A compiled step prepared by ``LowPrecisionOptimizer._prepare_fused``."""

    __slots__ = (
        "base",
        "flags",
        "kernel",
        "mbufs",
        "n",
        "p",
        "pairs",
        "per_word",
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


class _Entry:
    """One parameter of a recorded step: what ``_replay`` checks before redoing it (the parameter,
    the layout of its gradient, its state tensors) and its prepared compiled step (None: it took
    ``_step_param``, redone as such). It holds no gradient, so that a gradient the training loop
    drops is freed. ``step`` is its step count as ``_Plan.read_counts`` last read it."""

    __slots__ = ("count", "dtype", "fused", "gkind", "group", "index", "names", "p", "ptr",
                 "shape", "size", "state", "step", "storage", "stride", "tensors")

    def __init__(self, group, p, index, storage, state, fused) -> None:
        self.group, self.p, self.index, self.storage, self.fused = group, p, index, storage, fused
        self.state, self.count, self.step = state, state["step"], 0
        self.names = tuple(k for k, v in state.items() if isinstance(v, torch.Tensor))
        self.tensors = tuple(state[k] for k in self.names)
        self.size = len(state)
        self.ptr, self.dtype, self.shape, self.stride = p.data_ptr(), p.dtype, p.shape, p.stride()
        self.gkind = _grad_kind(p.grad)

    def current(self, state: dict[Any, Any]) -> bool:
        p = self.p
        g = p.grad  # (checked every step: a record that held it would keep it alive)
        if g is None or g.shape != self.shape or _grad_kind(g) != self.gkind:
            return False
        st = state.get(p)
        return (
            st is self.state and p.data_ptr() == self.ptr and p.dtype == self.dtype
            and p.shape == self.shape and p.stride() == self.stride and len(st) == self.size
            and all(map(operator.is_, map(st.get, self.names), self.tensors))
        )


# Recorded parameters of one kernel variant are redone by shared compiled calls (``_Many``). Dynamo
# compiles such a call for each number of parameters and pattern of sizes, so a variant takes at
# most _MANY_PATTERNS of them (well below Dynamo's own recompile limit of 8, past which it would
# run the function uncompiled); further ones are stepped one call per parameter, as before.
_MANY_PATTERNS = 4
_MANY_MAX = 4  # parameters per shared call (more compile longer: _one_cpp_kernel_per_loop)
_MANY_SEEN: dict[Any, set[tuple[int, ...]]] = {}  # per variant: the size patterns compiled
_MANY_BROKEN: set[Any] = set()  # variants whose call failed to compile
# Inductor fuses loops that read nothing in common but a few bytes (here the step's 0-d
# coefficients, shared by every parameter of a call) when they share at least
# score_fusion_memory_threshold bytes (10 by default). It then ran the sums passes of all of a
# shared call's parameters as one loop before any update, and the updates read everything back
# from memory: LAMB's shared calls were 1.07x slower than a call per pass and parameter. Loops
# over different parameters of a call share only those scalars (under 100 bytes), so this
# threshold keeps them apart. Loops of one parameter share its tensors' bytes: far more than the
# threshold for the large parameters these calls are for; a parameter of under ~1000 elements
# (shared calls take small ones where they do not batch, e.g. FP32 LAMB) may then take its two
# sums in two loops instead of one: the same bits, a few KB read twice.
_MANY_OPTIONS = {"score_fusion_memory_threshold": 4096}


@contextlib.contextmanager
def _one_cpp_kernel_per_loop() -> Iterator[None]:
    """While compiling a shared call (``_Many``), Inductor's C++ backend ends its kernel after each
    loop instead of gathering every loop of the graph into one C++ function.

    Gathered, a call over 12 parameters is one function with 12 copies of the update (~0.5 MB of
    C++), which took 63-95 s to compile with a cold cache. Ended per loop, the copies come out as
    a few distinct sources (2-3 there: they differ only in Inductor's buffer numbering), each
    compiled once and called for its parameters: 7-33 s with a cold cache for calls of 12
    parameters, 4-13 s for calls of at most 4 (``_MANY_MAX``). The setting is Inductor's class
    attribute ``CppScheduling.MAX_FUSED_KERNEL_ARGS_NUM`` (the argument count past which it ends a
    kernel); where a version of torch lacks it, nothing is changed. Only compilation reads it."""
    try:
        from torch._inductor.codegen.cpp import CppScheduling
    except Exception:  # (no Inductor C++ backend here: nothing to set)
        yield
        return
    old = getattr(CppScheduling, "MAX_FUSED_KERNEL_ARGS_NUM", None)
    if not isinstance(old, int):
        yield
        return
    CppScheduling.MAX_FUSED_KERNEL_ARGS_NUM = 1
    try:
        yield
    finally:
        CppScheduling.MAX_FUSED_KERNEL_ARGS_NUM = old


class _Many:
    """Recorded parameters redone by one compiled call (``_run_many``): their prepared steps
    (``_Fused``) share a kernel variant, a group and a device, and none has an odd last element.
    Their updates are independent, so one call gives each the bits its own call would; a rule
    with whole-tensor norms (LAMB) takes each parameter's sums pass, then its update, in turn.
    Per-parameter calls cost ~20-35 us each of Dynamo guards and wrappers, more with the caches
    cold after backward: a 25M-parameter model has a dozen (two dozen with norms)."""

    __slots__ = ("entries", "fn", "kernel", "mvs", "pattern", "sums_fn", "svs")

    def __init__(self, opt: LowPrecisionOptimizer, entries: list[_Entry], scaled: bool) -> None:
        f = entries[0].fused
        self.entries = entries
        self.fn, self.sums_fn = f.update_fn, f.sums_fn
        # (One compiled function per variant, cached by _compiled_kernel: it is the variant's key
        # in _MANY_SEEN and _MANY_BROKEN.)
        self.kernel = _compiled_kernel(
            type(opt), f.storage, f.flags, scaled=scaled, fn=_update_many,
            extra_key=(("many", self.fn.__name__.strip("_")), *(f.pairs or ()),
                       *((("sums", "sums"),) if self.sums_fn is not None else ())),
            options=_MANY_OPTIONS, signature=f.signature,
        )
        self.svs = [e.fused.views[0] for e in entries]
        self.mvs = [e.fused.views[1] for e in entries]
        # Dynamo's guards on the sizes (dynamic shapes) are which of them are equal, not their
        # values: the pattern is each size's first position among them.
        sizes = [e.p.numel() for e in entries]
        self.pattern = tuple(sizes.index(n) for n in sizes)

    def usable(self) -> bool:
        """Whether the call may be compiled (or was) for this pattern of sizes."""
        if self.kernel in _MANY_BROKEN:
            return False
        seen = _MANY_SEEN.setdefault(self.kernel, set())
        if self.pattern not in seen:
            if len(seen) >= _MANY_PATTERNS:
                return False
            seen.add(self.pattern)
        return True

    def broken(self) -> None:
        _MANY_BROKEN.add(self.kernel)

    @staticmethod
    def merge(opt: LowPrecisionOptimizer, runs: list[Any], scaled: bool) -> list[Any]:
        """``runs`` with the entries that can share a call replaced, where two or more can, by
        ``_Many`` calls (of at most ``_MANY_MAX`` each) at the place of the smallest."""
        together: dict[Any, list[_Entry]] = {}
        for run in runs:
            f = getattr(run, "fused", None)
            if (
                f is not None and (f.pairs is None or f.n == run.p.numel()) and f.base is None
                and not f.shards
                and (not scaled or _host_counts(run.p.device))
            ):
                # (Their step counts as last read: the coefficients are shared. Counts that
                # stop agreeing later, written by a caller, make _run_many step them one by one.)
                key = (id(f.kernel), id(run.group), run.p.device, run.step)
                together.setdefault(key, []).append(run)
        # Sorted by size and cut into calls of at most _MANY_MAX: a call's compile time grows
        # with its parameters, and calls of equal sizes share one compilation (one pattern).
        first: dict[int, list[Any]] = {}
        for es in together.values():
            if len(es) > 1:
                es = sorted(es, key=lambda e: e.p.numel())
                first[id(es[0])] = [
                    _Many(opt, part, scaled) if len(part) > 1 else part[0]
                    for part in (es[i:i + _MANY_MAX] for i in range(0, len(es), _MANY_MAX))
                ]
        rest = {id(e) for calls in first.values() for c in calls
                for e in (c.entries if isinstance(c, _Many) else [c])}
        merged: list[Any] = []
        for run in runs:
            if id(run) in first:
                merged.extend(first[id(run)])
            elif id(run) not in rest:
                merged.append(run)
        return merged


class _Batch:
    """Small parameters stepped together by one compiled call (``_step_small_fused``): their
    flattened views, to concatenate and copy back, and per state buffer name the one flat tensor
    holding every parameter's buffer in turn where there is one (``_flat_state``), which the call
    updates in place, else None (those buffers are concatenated and copied back too)."""

    __slots__ = ("bufs", "counts", "dst", "entries", "group", "items", "names_m", "names_s", "ps",
                 "sizes", "step", "storage", "views", "words")

    def __init__(self, opt: LowPrecisionOptimizer, items: list, step: int, fresh) -> None:
        self.items, self.step, self.entries = items, step, []
        self.group, _, _, self.storage = items[0]
        self.ps = [p for _, p, _, _ in items]
        states = [opt.state[p] for p in self.ps]
        self.names_s = tuple(self.storage.buffers(self.ps[0]))
        self.names_m = tuple(opt._math_buffers(self.group))
        self.dst = [_flat(p) for p in self.ps]
        self.sizes = [p.numel() for p in self.ps]
        new = all(id(p) in fresh for p in self.ps)
        self.bufs = {k: _flat_state(states, k, self.sizes, new)
                     for k in (*self.names_s, *self.names_m)}
        self.views = {k: [_flat(st[k]) for st in states] for k in self.bufs}
        self.words = tuple(n // 2 for n in self.sizes)
        self.counts = [st["step"] for st in states]


def _flat_state(states: list[dict[str, Any]], name: str, sizes: list[int], new: bool):
    """The flat tensor whose consecutive views are ``state[name]`` of each of ``states`` (contiguous
    tensors of ``sizes`` elements, one dtype), or None. ``new``: the states were just created
    (nothing outside the optimizer holds their tensors yet), so they are moved into a new flat
    tensor; existing state tensors are never replaced (a caller may hold them, or have put them in
    shared memory), only recognised when already laid out so (e.g. by an earlier step)."""
    ts = [st[name] for st in states]
    base = ts[0]._base
    if base is not None and base.dim() == 1 and base.numel() == sum(sizes):
        ptr, width, at = base.data_ptr(), base.element_size(), 0
        for t, n in zip(ts, sizes, strict=True):
            if t._base is not base or t.data_ptr() != ptr + at * width or t.dtype != base.dtype:
                break
            at += n
        else:
            return base
    if not new:
        return None
    buf = torch.cat([t.reshape(-1) for t in ts])
    for st, t, view in zip(states, ts, buf.split(sizes), strict=True):
        st[name] = view.view(t.shape)
    return buf


class _Plan:
    """A step recorded for ``_replay``: per group its options and flags, the parameters that had
    no gradient (with their dtype and device), and the work (``_Entry`` or ``_Batch``) in the order
    it ran."""

    __slots__ = ("batches", "counts", "entries", "groups", "idle", "many", "runs", "scaled")

    def __init__(self, opt: LowPrecisionOptimizer, scaled: bool) -> None:
        self.scaled = scaled  # (recorded under a loss scaler: redone only under one)
        groups = opt.param_groups
        self.groups = [
            (g, tuple(g["params"]), opt._plan_options(g), opt._flags(g)) for g in groups
        ]
        self.idle = tuple(
            (p, p.dtype, p.device) for g in groups for p in g["params"] if p.grad is None
        )
        self.runs: list[Any] = []
        self.entries: list[_Entry] = []
        self.batches: list[_Batch] = []
        self.counts: list[tuple[list[_Entry], list[torch.Tensor]]] | None = None
        self.many: list[Any] | None = None

    def merged(self, opt: LowPrecisionOptimizer) -> list[Any]:
        """The runs to redo, entries sharing a compiled call merged (``_Many.merge``)."""
        if self.many is None:
            self.many = _Many.merge(opt, self.runs, self.scaled)
        return self.many

    def add(self, run: _Entry | _Batch) -> None:
        self.runs.append(run)
        if isinstance(run, _Batch):
            self.batches.append(run)
            self.entries.extend(run.entries)
        else:
            self.entries.append(run)

    def read_counts(self) -> bool:
        """Read every entry's step count into ``entry.step``, as the full step reads them (one
        transfer per dtype and device; a count can change without its version counter showing
        it, e.g. by a collective or through ``.data``). False where the record cannot be redone
        at these counts: one that is not a whole number, or a batch whose counts differ.

        A step under a loss scaler reads only the counts of its batches and of parameters on the
        CPU (``_host_counts``): the others are read on their devices (``_scaled_numbers``), with no
        host synchronisation."""
        if self.counts is None:
            sets: dict[Any, tuple[list[_Entry], list[torch.Tensor]]] = {}
            batched = {id(e) for b in self.batches for e in b.entries}
            read = [e for e in self.entries if not self.scaled or id(e) in batched
                    or _host_counts(e.p.device)]
            for e in read:
                entries, counts = sets.setdefault((e.count.dtype, e.count.device), ([], []))
                entries.append(e)
                counts.append(e.count)
            self.counts = list(sets.values())
        for entries, counts in self.counts:
            for e, value in zip(entries, torch.stack(counts).tolist(), strict=True):
                if not float(value).is_integer():
                    return False
                e.step = int(value)
        return all(all(e.step == b.entries[0].step for e in b.entries) for b in self.batches)


def master_state_dict(model: torch.nn.Module, optimizer: LowPrecisionOptimizer) -> dict[str, Any]:
    """A model state dict holding the optimizer's FP32 master values, for export.

    Parameters the optimizer updates are replaced by ``optimizer.master_weight(p)``; other
    floating-point entries (frozen parameters, buffers) are cast to FP32; the rest is kept.
    ``optimizer`` may be a framework's wrapper of a lowprec optimizer that keeps it as
    ``.optimizer`` (Accelerate's ``AcceleratedOptimizer``, which Hugging Face Trainer's
    ``trainer.optimizer`` is, or Lightning's ``LightningOptimizer``).
    """
    inner = optimizer
    for _ in range(4):  # (a wrapper of a wrapper at most, in practice)
        if isinstance(inner, LowPrecisionOptimizer):
            break
        inner = getattr(inner, "optimizer", None)
    if not isinstance(inner, LowPrecisionOptimizer):
        raise TypeError(
            "master_state_dict needs a lowprec optimizer (or a framework's wrapper of one, "
            f"holding it as .optimizer), got {type(optimizer).__name__}; a torch.optim "
            "optimizer keeps no master: its model's state_dict() is the export."
        )
    optimizer = inner
    masters = {}
    known = {id(p) for group in optimizer.param_groups for p in group["params"]}
    by_id: dict[int, torch.Tensor] = {}
    # Every name of a tied parameter (GPT-2's lm_head.weight is wte.weight), each holding the
    # master: named_parameters() would name it once and leave the others at the stored value.
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in known:
            if id(p) not in by_id:
                by_id[id(p)] = optimizer.master_weight(p)
            masters[name] = by_id[id(p)]
    out = {}
    for name, t in model.state_dict().items():
        if name in masters:
            out[name] = masters[name]
        elif isinstance(t, torch.Tensor) and t.is_floating_point():
            out[name] = t.detach().float().clone()
        else:
            out[name] = t
    return out
