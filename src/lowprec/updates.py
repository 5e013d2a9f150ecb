"""Updates lost to rounding: ``UpdateMonitor`` and its reports.

``UpdateMonitor`` watches optimizer steps and counts, per parameter, the elements whose stored
value did not change although the FP32 update was nonzero (an update below half an ulp of a BF16
weight is rounded away: "swamping"), and the relative error of the stored change against the
intended one. For a lowprec optimizer the intended update is previewed before the step with the
optimizer's own pieces (storage ``load``, the update rule, the step's coefficients), writing
nothing; the preview costs about one extra step, hence ``every=``. For other optimizers only the
stored values and the gradients are known, and the intended-update figures are None.
Importable from ``lowprec.diagnostics`` as well, beside ``gradient_range``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch

from lowprec.optim import core
from lowprec.optim._typing import compiler_disable
from lowprec.optim.base import LowPrecisionOptimizer
from lowprec.optim.dtensor import is_dtensor, local
from lowprec.optim.shards import all_reduce_sums, local_shards
from lowprec.optim.storage import resolve_master
from lowprec.optim.update import _descent

if TYPE_CHECKING:  # pragma: no cover
    from lowprec.optim.storage import MasterStorage

__all__ = ["LOST_UPDATE_THRESHOLD", "ParamUpdates", "UpdateMonitor", "UpdateReport"]


#: Fraction of lost updates above which a layer is reported as needing compensation or FP32.
LOST_UPDATE_THRESHOLD = 0.01

_SAME_SIZE_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
#: Strategies whose master keeps what the stored value drops (the stored value may lag).
_COMPENSATED = ("fp32", "split", "kahan")


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bit patterns as integers of the same width (for bitwise comparisons)."""
    return t.view(_SAME_SIZE_INT[t.element_size()])


@dataclass(frozen=True)
class ParamUpdates:
    """What the monitored steps did to one parameter. Counts are summed over monitored steps.

    Attributes:
        name: The parameter's name in ``model.named_parameters()``.
        shape: The parameter's shape.
        dtype: The parameter's dtype, e.g. ``"bfloat16"``.
        master: The lowprec master strategy that stores it (``"none"``, ``"fp32"``, ``"split"``,
            ``"kahan"``, ``"stochastic"``), or None for other optimizers.
        numel: Elements in the parameter.
        steps: Monitored steps in which the parameter had a gradient and was updated.
        updated: Element updates attempted: elements whose intended FP32 value differed from the
            FP32 value before the step (other optimizers: elements with a nonzero gradient).
        lost: Of those, the elements whose stored value stayed bitwise the same.
        lost_fraction: ``lost / updated`` (0.0 when nothing was attempted).
        master_lost: Of the attempted elements, those whose FP32 master value
            (``optimizer.master_weight(p)``) stayed bitwise the same; None for other optimizers.
            Equal to ``lost`` for ``"none"`` and ``"stochastic"`` (the parameter is the master),
            0 for ``"fp32"`` and ``"split"`` (an exact FP32 master).
        master_lost_fraction: ``master_lost / updated``, or None.
        relative_error: ``||stored change - intended change|| / ||intended change||`` with the
            changes in FP64 and the norms over all elements and monitored steps (the stored
            value is the parameter the model computes with); None for other optimizers, or when
            no intended change was nonzero.
        master_relative_error: The same for the master value; None likewise.
        state_relative_error: For a parameter whose optimizer state is kept in 8 bits
            (``state_dtype="8bit"``): ``||stored state - FP32 state|| / ||FP32 state||``, the
            FP32 state being what the update rule computed from the stored state of the step
            before, over its buffers and the monitored steps: what one rounding to 8 bits per
            step costs. None otherwise (default: None).
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    master: str | None
    numel: int
    steps: int
    updated: int
    lost: int
    lost_fraction: float
    master_lost: int | None
    master_lost_fraction: float | None
    relative_error: float | None
    master_relative_error: float | None
    state_relative_error: float | None = None

    @property
    def effective_lost_fraction(self) -> float:
        """The fraction of updates the training trajectory loses: the master's where known."""
        if self.master_lost_fraction is None:
            return self.lost_fraction
        return self.master_lost_fraction

    def advice(self, threshold: float = LOST_UPDATE_THRESHOLD) -> str | None:
        """What to do about this parameter, or None when nothing needs doing.

        Args:
            threshold: Lost-update fraction above which a layer needs action (default: 0.01).
        """
        if self.master in ("fp32", "split", "stochastic"):
            return None  # an exact FP32 master, or unbiased in expectation
        if self.master == "kahan":
            if (self.master_lost_fraction or 0.0) > threshold:
                return "the BF16/FP16 compensation drops updates too: use split or an FP32 master"
            return None
        if self.lost_fraction <= threshold:
            return None
        if self.dtype in ("float32", "float64"):
            return (f"loses updates even in {self.dtype}: they are below half an ulp of the "
                    "weights (is the learning rate too small for weights this large?)")
        return "needs compensation (kahan/split/stochastic) or FP32"

    def as_dict(self) -> dict[str, Any]:
        """The fields as a plain dict (``dataclasses.asdict``), for JSON."""
        return asdict(self)


@dataclass(frozen=True)
class UpdateReport:
    """The monitored steps of every parameter, and the totals.

    Attributes:
        params: One ``ParamUpdates`` per monitored parameter, in ``named_parameters()`` order.
        every: Every how many steps the monitor looked.
        steps_seen: Steps passed through the monitor (monitored or not).
        steps_monitored: Steps looked at and recorded.
        steps_skipped: Steps looked at that the optimizer skipped (a loss scaler found inf/NaN,
            or the step count did not advance); nothing is recorded for them.
        updated: Attempted element updates, over all parameters and recorded steps.
        lost: Lost element updates, likewise.
        lost_update_fraction: ``lost / updated`` (0.0 when nothing was attempted).
        master_lost_fraction: The same for master values, over the parameters where it is known
            (None when it is known for none).
        relative_error: The relative error of the stored changes over all parameters where it is
            known (norms over everything), or None.
        threshold: The lost fraction above which a parameter is flagged.
        flagged: Names of the parameters that need action, with the advice (default: none).
    """

    params: list[ParamUpdates]
    every: int
    steps_seen: int
    steps_monitored: int
    steps_skipped: int
    updated: int
    lost: int
    lost_update_fraction: float
    master_lost_fraction: float | None
    relative_error: float | None
    threshold: float
    flagged: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """The fields as a plain dict (``dataclasses.asdict``), for JSON."""
        return asdict(self)


class _Tally:
    """Running sums for one parameter."""

    __slots__ = ("err_sq", "intended_sq", "lost", "master_err_sq", "master_lost", "state_err_sq",
                 "state_sq", "steps", "storage", "updated")

    def __init__(self) -> None:
        self.storage: str | None = None
        self.steps = 0
        self.updated = 0
        self.lost = 0
        self.master_lost: int | None = None
        self.err_sq: float | None = None
        self.master_err_sq: float | None = None
        self.intended_sq: float | None = None
        self.state_err_sq: float | None = None
        self.state_sq: float | None = None


def _add(total: Any, value: Any) -> Any:
    return value if total is None else total + value


def _fraction(part: int, whole: int) -> float:
    return part / whole if whole else 0.0


def _ratio(err_sq: float | None, ref_sq: float | None) -> float | None:
    if err_sq is None or not ref_sq:
        return None
    return math.sqrt(err_sq / ref_sq)


class UpdateMonitor:
    """Count the updates that rounding loses, per parameter, around the user's optimizer steps.

    In a training loop:

        monitor = UpdateMonitor(model, optimizer)
        for x, y in data:
            optimizer.zero_grad()
            loss_fn(model(x), y).backward()
            with monitor.step():          # or monitor.before_step(); ...; monitor.after_step()
                optimizer.step()          # or scaler.step(optimizer), recipe.step(optimizer)
        print(monitor.summary())

    An element's update is *lost* when its intended FP32 value differs from its FP32 value before
    the step but the stored parameter is bitwise unchanged after it. For a
    ``LowPrecisionOptimizer`` the intended value is computed before the step exactly as the step
    will compute it (the storage's ``load``, the update rule, the step's coefficients, gradients
    divided by the loss scale), without writing anything; state that does not exist yet (first
    step) is built as the step would build it and thrown away. For other optimizers the intended
    update is unknown: an element counts as attempted when its gradient is nonzero, and the
    intended-update figures are None.

    DTensor parameters (FSDP2) are previewed and compared on each rank's shards, as the step
    takes them, and the counts and sums added over the ranks holding the shards (one
    ``all_reduce`` per parameter and monitored step), so every rank reports the whole
    parameters.

    A step counts as skipped (and records nothing) when ``optimizer.step()`` was not called
    (a loss scaler skipped it; the monitor registers a step post-hook on the optimizer, which
    ``close()`` removes) or, for a lowprec optimizer, when a parameter's step count did not advance
    (a skip decided on the device).

    Args:
        model: The model; parameter names come from ``model.named_parameters()``, and its
            parameters that the optimizer updates are monitored.
        optimizer: The optimizer that steps them.
        every: Look at every ``every``-th step only, starting with the first (default: 1). A
            monitored step costs about one extra optimizer step (the preview) and a copy of the
            parameters.
        scaler: The loss scale the gradients carry: a loss scaler (anything with
            ``get_scale()``, e.g. ``lowprec.LossScaler``, ``torch.amp.GradScaler`` or a recipe's
            ``scaler``) or a fixed positive number (default: None, meaning unscaled gradients).
            Gradients already unscaled by ``scaler.unscale_(optimizer)`` are recognised.

    Raises:
        TypeError: ``model`` is not a module, ``optimizer`` not an optimizer, or ``scaler`` has
            no ``get_scale()``.
        ValueError: ``every`` is not a positive int, or the optimizer updates none of the
            model's parameters.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        every: int = 1,
        scaler: Any = None,
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"UpdateMonitor takes an nn.Module, got {type(model).__name__}.")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"UpdateMonitor takes a torch.optim.Optimizer, got {type(optimizer).__name__}."
            )
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be an int >= 1, got {every!r}.")
        if scaler is not None and not hasattr(scaler, "get_scale"):
            if isinstance(scaler, bool) or not isinstance(scaler, (int, float)):
                raise TypeError(
                    "scaler must be a loss scaler with get_scale() (lowprec.LossScaler, "
                    f"torch.amp.GradScaler) or a positive number, got {type(scaler).__name__}."
                )
            if not (math.isfinite(scaler) and scaler > 0):
                raise ValueError(f"a fixed scaler must be finite and > 0, got {scaler}.")
        if isinstance(optimizer, LowPrecisionOptimizer) and core.stages(optimizer).in_backward is not None:
            raise ValueError(
                "UpdateMonitor previews each step from the gradients before step(), but this "
                "optimizer steps inside backward (lowprec.step_in_backward), where they are gone "
                "by then; monitor the same optimizer without it (the updates are the same bits)."
            )
        in_optimizer = {id(p) for g in optimizer.param_groups for p in g["params"]}
        self._names = {
            id(p): name for name, p in model.named_parameters() if id(p) in in_optimizer
        }
        if not self._names:
            raise ValueError(
                "the optimizer updates none of the model's parameters; pass the model the "
                "optimizer was built from (after any conversion, e.g. recipe.convert(model))."
            )
        self._params = {
            id(p): p for g in optimizer.param_groups for p in g["params"] if id(p) in self._names
        }
        self.model = model
        self.optimizer = optimizer
        self.every = every
        self.scaler = scaler
        self._lowprec = isinstance(optimizer, LowPrecisionOptimizer)
        self._tallies = {pid: _Tally() for pid in self._names}
        self._steps_seen = 0
        self._steps_monitored = 0
        self._steps_skipped = 0
        self._pending: dict[int, dict[str, Any]] | None = None
        self._in_step = False
        self._step_calls = 0
        self._step_calls_before = 0
        self._hook = optimizer.register_step_post_hook(self._on_step)

    # ------------------------------------------------------------------ the step

    def _on_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._step_calls += 1

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Wrap one optimizer step: ``before_step()`` on entry, ``after_step()`` on exit.

        If the block raises, nothing is recorded for the step.
        """
        self.before_step()
        try:
            yield
        except BaseException:
            self._pending = None
            self._in_step = False
            raise
        self.after_step()

    # before_step/after_step stay out of graphs that torch.compile traces around them (a
    # compiled training step): their preview must be the optimizer's own arithmetic, bit for
    # bit, and traced it failed to compile (Dynamo's fake run of the preview raised).
    @compiler_disable
    @torch.no_grad()
    def before_step(self) -> None:
        """Snapshot the parameters (and preview the intended update) before the step.

        Raises:
            RuntimeError: ``before_step()`` was called twice without ``after_step()``.
        """
        if self._in_step:
            raise RuntimeError(
                "before_step() was called twice without after_step(); call after_step() after "
                "each optimizer step (or use `with monitor.step():`)."
            )
        self._in_step = True
        monitored = self._steps_seen % self.every == 0
        self._steps_seen += 1
        self._pending = None
        if not monitored:
            return
        self._step_calls_before = self._step_calls
        snaps: dict[int, dict[str, Any]] = {}
        if self._lowprec:
            inv = self._inverse_scale()
            opt = cast(LowPrecisionOptimizer, self.optimizer)
            # (DTensor parameters: previewed on this rank's shards, as the step takes them)
            sharded = core.stages(opt).has_dtensors
            with local_shards(opt) if sharded else contextlib.nullcontext():
                owner = {id(s.local): pid for pid, s in core.stages(opt).shards.items()}
                # core.collect validates like the step itself (clear errors) and writes nothing.
                for group, p, _index, storage in core.collect(opt):
                    pid = owner.get(id(p), id(p))
                    if pid in self._names:
                        snaps[pid] = self._preview(opt, group, p, storage, inv)
        else:
            for pid, p in self._params.items():
                if p.grad is None:
                    continue
                snaps[pid] = {
                    "old": p.detach().clone(),
                    "attempted": p.grad.detach() != 0,
                    "step": self._plain_step_count(p),
                }
        self._pending = snaps

    def _inverse_scale(self) -> torch.Tensor | None:
        if self.scaler is None:
            return None
        if hasattr(self.scaler, "get_scale"):
            if self._already_unscaled():
                return None
            scale = float(self.scaler.get_scale())
        else:
            scale = float(self.scaler)
        if scale == 1.0:
            return None
        # As the optimizer's step and GradScaler: the reciprocal in FP64, rounded to FP32.
        return torch.tensor(1.0 / scale, dtype=torch.float32)

    def _already_unscaled(self) -> bool:
        """Whether ``scaler.unscale_(optimizer)`` ran this iteration (the grads are true ones)."""
        per_opt = getattr(self.scaler, "_per_optimizer", None)  # lowprec.LossScaler
        if per_opt is None:
            per_opt = getattr(self.scaler, "_per_optimizer_states", None)  # torch GradScaler
        if not isinstance(per_opt, dict):
            return False
        state = per_opt.get(id(self.optimizer))
        stage = state.get("stage") if isinstance(state, dict) else None
        return getattr(stage, "name", None) == "UNSCALED"

    @staticmethod
    def _preview(
        opt: LowPrecisionOptimizer,
        group: dict[str, Any],
        p: torch.Tensor,
        storage: MasterStorage,
        inv: torch.Tensor | None,
    ) -> dict[str, Any]:
        state = opt.state.get(p)
        rule = opt.rule(group)
        if not state:
            # What the step's lazy initialisation will create (a new dict; the FP32 value a cast
            # kept for p left for the step itself to take: lowprec.optim.kept).
            state = core.init_state(rule, group, p, storage, preview=True)
        step = int(state["step"]) + 1
        sbufs = {k: state[k] for k in storage.buffers(p)}
        late = [k for k in rule.buffers(p) if state.get(k) is None]  # (first_use)
        if late:
            state = {**state}
            for k in late:
                state.update(core.new_buffer(rule, group, p, k, core.state_dtype(group, p, storage)))
        mbufs = core.math_state(rule, group, p, state)
        coeffs = (rule.first_use if late else rule.coefficients)(step)
        w = storage.load(p, sbufs).clone()
        grad = cast(torch.Tensor, p.grad)  # (a parameter the step takes: present)
        g = grad.float() if inv is None else grad.float() * inv.to(p.device)
        g, flags = _descent(g, rule.flags)  # (maximize: the step's, before the rule)
        new_w, new_m = rule.math(w, g, mbufs, coeffs, **flags)
        eight_bit = {k for k, _ in core.qformats(rule, group, state, p)}
        return {
            "new_state": {k: v for k, v in new_m.items() if k in eight_bit},
            "old": p.detach().clone(),
            "w": w,
            "new_w": new_w,
            "storage": storage.name,
            "step": step - 1,
        }

    def _plain_step_count(self, p: torch.Tensor) -> float | None:
        step = self.optimizer.state.get(p, {}).get("step")
        if isinstance(step, torch.Tensor) and step.numel() == 1:
            return float(step)
        return float(step) if isinstance(step, (int, float)) else None

    @compiler_disable
    @torch.no_grad()
    def after_step(self) -> None:
        """Compare the parameters with the snapshot and record the step.

        A step the optimizer skipped (it was not called, e.g. a loss scaler found inf/NaN, or
        its step count did not advance) records nothing.

        Raises:
            RuntimeError: ``after_step()`` was called without ``before_step()``.
        """
        if not self._in_step:
            raise RuntimeError(
                "after_step() was called without before_step(); call before_step() before the "
                "optimizer step (or use `with monitor.step():`)."
            )
        self._in_step = False
        snaps, self._pending = self._pending, None
        if snaps is None:  # not a monitored step
            return
        self._steps_monitored += 1
        if self._step_calls == self._step_calls_before:
            self._steps_skipped += 1
            return
        recorded = 0
        for pid, snap in snaps.items():
            p = self._params[pid]
            if self._lowprec:
                state = self.optimizer.state.get(p) or {}
                if "step" not in state or int(state["step"]) <= snap["step"]:
                    continue  # this parameter's step was skipped on the device
                self._record_lowprec(pid, p, snap)
            else:
                before, after = snap["step"], self._plain_step_count(p)
                if before is not None and after is not None and after <= before:
                    continue
                self._record_plain(pid, p, snap)
            recorded += 1
        if snaps and not recorded:
            self._steps_skipped += 1

    def _record_plain(self, pid: int, p: torch.Tensor, snap: dict[str, Any]) -> None:
        unchanged = _bits(snap["old"]) == _bits(p.detach())
        attempted = snap["attempted"]
        t = self._tallies[pid]
        t.steps += 1
        t.updated += int(attempted.sum())
        t.lost += int((attempted & unchanged).sum())

    def _record_lowprec(self, pid: int, p: torch.Tensor, snap: dict[str, Any]) -> None:
        opt = cast(LowPrecisionOptimizer, self.optimizer)  # (the caller's _lowprec)
        old, w, new_w = snap["old"], snap["w"], snap["new_w"]
        master = opt.master_weight(p)
        state = opt.state[p]
        groups = ()
        if is_dtensor(p):  # (this rank's shard; the sums are added over the shards below)
            p, master = local(p), local(master)
            state = {k: local(v) for k, v in state.items()}
            groups = core.stages(opt).shards[pid].groups
        new = p.detach()
        attempted = new_w != w
        unchanged = _bits(old) == _bits(new)
        master_unchanged = _bits(master) == _bits(w)
        intended = new_w.double() - w.double()
        err = (new.double() - old.double()) - intended
        master_err = (master.double() - w.double()) - intended
        sums = [attempted.sum(), (attempted & unchanged).sum(),
                (attempted & master_unchanged).sum(), err.square().sum(),
                master_err.square().sum(), intended.square().sum()]
        if snap["new_state"]:
            group = core.group_of(opt, self._params[pid])
            stored = core.math_state(opt.rule(group), group, p, state)
            sums.append(sum((stored[k].double() - v.double()).square().sum()
                            for k, v in snap["new_state"].items()))
            sums.append(sum(v.double().square().sum() for v in snap["new_state"].values()))
        total = all_reduce_sums(torch.stack([s.double() for s in sums]), groups).tolist()
        t = self._tallies[pid]
        t.storage = snap["storage"]
        t.steps += 1
        t.updated += int(total[0])
        t.lost += int(total[1])
        t.master_lost = _add(t.master_lost, int(total[2]))
        t.err_sq = _add(t.err_sq, total[3])
        t.master_err_sq = _add(t.master_err_sq, total[4])
        t.intended_sq = _add(t.intended_sq, total[5])
        if snap["new_state"]:
            t.state_err_sq = _add(t.state_err_sq, total[6])
            t.state_sq = _add(t.state_sq, total[7])

    # ------------------------------------------------------------------ results

    def _strategies(self) -> dict[int, str | None]:
        """The master strategy of each monitored parameter (None for other optimizers)."""
        if not self._lowprec:
            return dict.fromkeys(self._names)
        opt = cast(LowPrecisionOptimizer, self.optimizer)
        return {
            id(p): resolve_master(group["master"], p.dtype).name
            for group in opt.param_groups for p in group["params"] if id(p) in self._names
        }

    def report(self, *, threshold: float = LOST_UPDATE_THRESHOLD) -> UpdateReport:
        """The records so far, per parameter and in total.

        Args:
            threshold: Lost-update fraction above which a parameter is flagged (default: 0.01).

        Returns:
            An ``UpdateReport``.
        """
        if not (isinstance(threshold, (int, float)) and 0 <= threshold <= 1):
            raise ValueError(f"threshold must be a fraction in [0, 1], got {threshold!r}.")
        params = []
        strategies = self._strategies()
        for pid, name in self._names.items():
            p, t = self._params[pid], self._tallies[pid]
            params.append(ParamUpdates(
                name=name, shape=tuple(p.shape), dtype=str(p.dtype).removeprefix("torch."),
                master=t.storage or strategies.get(pid), numel=p.numel(), steps=t.steps,
                updated=t.updated, lost=t.lost, lost_fraction=_fraction(t.lost, t.updated),
                master_lost=t.master_lost,
                master_lost_fraction=(None if t.master_lost is None
                                      else _fraction(t.master_lost, t.updated)),
                relative_error=_ratio(t.err_sq, t.intended_sq),
                master_relative_error=_ratio(t.master_err_sq, t.intended_sq),
                state_relative_error=_ratio(t.state_err_sq, t.state_sq),
            ))
        updated = sum(r.updated for r in params)
        lost = sum(r.lost for r in params)
        known = [t for t in self._tallies.values() if t.err_sq is not None]
        relative = (_ratio(sum(cast(float, t.err_sq) for t in known),
                           sum(cast(float, t.intended_sq) for t in known))
                    if known else None)
        flagged = {r.name: a for r in params if (a := r.advice(threshold)) is not None}
        return UpdateReport(
            params=params, every=self.every, steps_seen=self._steps_seen,
            steps_monitored=self._steps_monitored, steps_skipped=self._steps_skipped,
            updated=updated, lost=lost, lost_update_fraction=_fraction(lost, updated),
            master_lost_fraction=self.master_lost_fraction, relative_error=relative,
            threshold=float(threshold), flagged=flagged,
        )

    @property
    def lost_update_fraction(self) -> float:
        """Lost element updates over attempted ones, over all parameters and recorded steps."""
        tallies = self._tallies.values()
        return _fraction(sum(t.lost for t in tallies), sum(t.updated for t in tallies))

    @property
    def master_lost_fraction(self) -> float | None:
        """The same for the master values: over the parameters where it is known (those of a
        lowprec optimizer with a recorded step), None where it is known for none."""
        known = [t for t in self._tallies.values() if t.master_lost is not None]
        if not known:
            return None
        return _fraction(sum(cast(int, t.master_lost) for t in known),
                         sum(t.updated for t in known))

    def summary(self, *, threshold: float = LOST_UPDATE_THRESHOLD) -> str:
        """A few lines: how many updates were lost, which layers need what.

        Args:
            threshold: Lost-update fraction above which a layer needs action (default: 0.01).
        """
        r = self.report(threshold=threshold)
        def pct(x: float | None) -> str:
            return "n/a" if x is None else f"{100 * x:.2f}%"
        lines = [
            f"Update monitor: {r.steps_monitored} of {r.steps_seen} steps monitored "
            f"(every {r.every}), {r.steps_skipped} skipped by the optimizer; "
            f"{sum(p.numel for p in r.params):,} parameter elements.",
        ]
        if not r.updated:
            lines.append("No update recorded yet: wrap optimizer steps in `with monitor.step():`.")
            return "\n".join(lines)
        lines.append(
            f"Stored values unchanged by a nonzero update: {pct(r.lost_update_fraction)} of "
            f"{r.updated:,} element updates"
            + ("" if r.master_lost_fraction is None
               else f"; master values unchanged: {pct(r.master_lost_fraction)}")
            + "."
        )
        width = max(len(p.name) for p in r.params)
        if r.flagged:
            lines.append(f"Layers losing more than {pct(threshold)} of their updates:")
            for p in r.params:
                if p.name in r.flagged:
                    rel = "" if p.relative_error is None else f", rel. error {p.relative_error:.3g}"
                    lines.append(
                        f"  {p.name:<{width}}  {p.dtype:<8}  master={p.master or '-':<10}  "
                        f"lost {pct(p.effective_lost_fraction)}{rel} -> {r.flagged[p.name]}"
                    )
        else:
            lines.append(f"No layer loses more than {pct(threshold)} of its updates.")
        lagging = [p for p in r.params if p.master in (*_COMPENSATED, "stochastic")
                   and p.name not in r.flagged and p.lost_fraction > threshold]
        if lagging:
            lines.append(
                "Stored value lags but nothing is lost (the master keeps the update, or "
                "stochastic rounding keeps it in expectation):"
            )
            for p in lagging:
                lines.append(
                    f"  {p.name:<{width}}  master={p.master:<10}  stored unchanged "
                    f"{pct(p.lost_fraction)}, master unchanged {pct(p.master_lost_fraction)}"
                )
        return "\n".join(lines)

    def reset(self) -> None:
        """Forget everything recorded (the step count starts again at 0)."""
        self._tallies = {pid: _Tally() for pid in self._names}
        self._steps_seen = self._steps_monitored = self._steps_skipped = 0
        self._pending, self._in_step = None, False

    def close(self) -> None:
        """Remove the monitor's hook from the optimizer."""
        self._hook.remove()
