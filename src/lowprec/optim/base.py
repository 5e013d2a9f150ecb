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

import copy
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim import Optimizer

from lowprec.numerics import stream_key
from lowprec.optim.storage import MASTER_CHOICES, MasterStorage, resolve_master

__all__ = ["LowPrecisionOptimizer", "master_state_dict"]

_STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_COMMON_DEFAULTS = {"master": "auto", "state_dtype": None, "seed": None}


def _as_float(value: Any, name: str) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a number or a one-element tensor, got shape "
                             f"{tuple(value.shape)}.")
        return float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}.")
    return float(value)


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

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any]) -> None:
        if isinstance(params, set):
            raise TypeError(
                "parameters must be an ordered collection (a list), not a set: a set's order "
                "changes between runs, and checkpoints map state to parameters by position."
            )
        super().__init__(params, {**_COMMON_DEFAULTS, **defaults})

    # ------------------------------------------------------------------ subclass interface

    def _validate_hparams(self, group: dict[str, Any]) -> None:
        """Raise ``ValueError`` for invalid hyperparameters in ``group``."""

    def _math_buffers(self, group: dict[str, Any]) -> tuple[str, ...]:
        """Names of the per-parameter state tensors the update rule keeps (e.g. momentum)."""
        return ()

    def _init_math_buffer(self, name: str, param: torch.Tensor, group: dict[str, Any]) -> float:
        """Initial value of buffer ``name`` (default: 0.0)."""
        return 0.0

    def _update(
        self,
        w: torch.Tensor,
        g: torch.Tensor,
        bufs: dict[str, torch.Tensor],
        group: dict[str, Any],
        step: int,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Return the new FP32 weight and new FP32 buffers (pure: must not modify its inputs)."""
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

    def _validate_group(self, group: dict[str, Any], index: int) -> None:
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
        seed = group["seed"]
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"{where}: seed must be a non-negative int or None, got {seed!r}.")
        try:
            self._validate_hparams(group)
        except (ValueError, TypeError) as e:
            raise type(e)(f"{where}: {e}") from None
        device = None
        for i, p in enumerate(group["params"]):
            if not p.is_floating_point():
                raise TypeError(
                    f"{where}, parameter {i}: lowprec optimizers update floating-point parameters,"
                    f" got {p.dtype}; leave integer and complex tensors out of the optimizer."
                )
            try:
                resolve_master(group["master"], p.dtype)
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

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            for key, value in {**_COMMON_DEFAULTS, **self.defaults}.items():
                group.setdefault(key, value)

    # ------------------------------------------------------------------ the step

    def _storage(self, group: dict[str, Any], p: torch.Tensor) -> MasterStorage:
        return resolve_master(group["master"], p.dtype)

    def _state_dtype(self, group: dict[str, Any], p: torch.Tensor, storage: MasterStorage):
        if group["state_dtype"] is not None:
            return group["state_dtype"]
        if storage.name in ("fp32", "split"):
            return torch.float32
        return p.dtype

    def _collect(self) -> list[tuple[dict[str, Any], torch.Tensor, int, MasterStorage]]:
        """Validate every group, gradient and state; return the work list. Writes nothing."""
        work = []
        index = -1
        for gi, group in enumerate(self.param_groups):
            self._validate_group(group, gi)
            for pi, p in enumerate(group["params"]):
                index += 1
                g = p.grad
                if g is None:
                    continue
                where = f"parameter group {gi}, parameter {pi}"
                if g.is_sparse:
                    raise ValueError(
                        f"{where}: sparse gradients are not supported; use dense gradients "
                        "(e.g. nn.Embedding(..., sparse=False)) or torch.optim.SparseAdam."
                    )
                if g.shape != p.shape or g.device != p.device or not g.is_floating_point():
                    raise ValueError(
                        f"{where}: gradient {tuple(g.shape)} {g.dtype} on {g.device} does not match"
                        f" the parameter {tuple(p.shape)} {p.dtype} on {p.device}."
                    )
                storage = self._storage(group, p)
                state = self.state.get(p)
                if state:
                    self._check_state(state, group, p, storage, where)
                work.append((group, p, index, storage))
        return work

    def _expected_state(self, group, p, storage) -> dict[str, torch.dtype]:
        sd = self._state_dtype(group, p, storage)
        return {**storage.buffers(p), **dict.fromkeys(self._math_buffers(group), sd)}

    def _check_state(self, state, group, p, storage, where) -> None:
        if state.get("master") != storage.name:
            raise ValueError(
                f"{where}: its optimizer state was created with master={state.get('master')!r} "
                f"but the group now resolves to {storage.name!r} (was the parameter's dtype or the "
                "group's master changed?); create a new optimizer after changing either."
            )
        for name, dtype in self._expected_state(group, p, storage).items():
            t = state.get(name)
            if not isinstance(t, torch.Tensor) or t.shape != p.shape or t.dtype != dtype:
                got = (
                    f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else repr(t)
                )
                raise ValueError(
                    f"{where}: state {name!r} should be a {tuple(p.shape)} {dtype} tensor, got "
                    f"{got}; the state does not belong to this parameter or these options."
                )

    def _init_state(self, group, p, storage) -> dict[str, Any]:
        sd = self._state_dtype(group, p, storage)
        state: dict[str, Any] = {
            "step": torch.tensor(0.0, dtype=torch.float32),
            "master": storage.name,
        }
        state.update(storage.init(p))
        for name in self._math_buffers(group):
            state[name] = torch.full_like(
                p, self._init_math_buffer(name, p, group), dtype=sd,
                memory_format=torch.preserve_format,
            )
        return state

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Perform one optimization step.

        Args:
            closure: Re-evaluates the model and returns the loss (default: None).

        Returns:
            The closure's loss, or None.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group, p, index, storage in self._collect():
            self._step_param(group, p, index, storage)
        return loss

    def _step_param(self, group, p, index, storage: MasterStorage) -> None:
        state = self.state[p]
        if not state:
            state.update(self._init_state(group, p, storage))
        step = int(state["step"].item()) + 1
        sbufs = {k: state[k] for k in storage.buffers(p)}
        w = storage.load(p, sbufs)
        g = p.grad.float()
        mbufs = {k: state[k].float() for k in self._math_buffers(group)}
        w_new, new_bufs = self._update(w, g, mbufs, group, step)
        bits = None
        if storage.needs_random_bits:
            bits = storage.random_bits(p, stream_key(group["seed"], step, index))
        p_new, new_sbufs = storage.store(w_new, p, sbufs, bits)
        # All computed: now write.
        for k, v in new_bufs.items():
            state[k].copy_(v)
        for k, v in new_sbufs.items():
            state[k].copy_(v)
        p.copy_(p_new)
        state["step"].fill_(step)

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
        changed.
        """
        saved_groups = state_dict["param_groups"]
        saved_state = state_dict["state"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"the checkpoint has {len(saved_groups)} parameter groups, this optimizer "
                f"{len(self.param_groups)}."
            )
        id_map: dict[Any, tuple[torch.Tensor, dict[str, Any]]] = {}
        for gi, (sg, g) in enumerate(zip(saved_groups, self.param_groups, strict=True)):
            if len(sg["params"]) != len(g["params"]):
                raise ValueError(
                    f"parameter group {gi} has {len(g['params'])} parameters but the checkpoint's "
                    f"has {len(sg['params'])}."
                )
            merged = {**_COMMON_DEFAULTS, **self.defaults, **sg, "params": g["params"]}
            self._validate_group(merged, gi)
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
            if moved:
                self._check_state(moved, merged, p, self._storage(merged, p), f"parameter {sid!r}")
            new_state[p] = moved
        super().load_state_dict({"state": {}, "param_groups": saved_groups})
        for p, st in new_state.items():
            self.state[p] = st


def master_state_dict(model: torch.nn.Module, optimizer: LowPrecisionOptimizer) -> dict[str, Any]:
    """A model state dict holding the optimizer's FP32 master values, for export.

    Parameters the optimizer updates are replaced by ``optimizer.master_weight(p)``; other
    floating-point entries (frozen parameters, buffers) are cast to FP32; the rest is kept.
    """
    masters = {}
    known = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for name, p in model.named_parameters():
        if id(p) in known:
            masters[name] = optimizer.master_weight(p)
    out = {}
    for name, t in model.state_dict().items():
        if name in masters:
            out[name] = masters[name]
        elif isinstance(t, torch.Tensor) and t.is_floating_point():
            out[name] = t.detach().float().clone()
        else:
            out[name] = t
    return out
