"""The optimizer's side of the loss-scaler contract: ``step(grad_scale=..., found_inf=...)``.

``_Scaling.prepare`` checks every gradient for inf/NaN before the first write, adds the finding to
``found_inf`` and takes ``1 / grad_scale`` as GradScaler does; the kernels take ``kernel_args``
(the inverse scale, applied inside the update, and the skip flag, which selects every write's old
value). On the CPU ``skipped_on_host`` takes most scaled steps as GradScaler takes torch.optim's.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, cast

import torch

from lowprec.optim.options import _as_float

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed import ProcessGroup

    from lowprec.optim._typing import WorkItem


class _Scaling:
    """One step's loss-scaler inputs, resolved on the devices: ``1 / grad_scale`` and the skip flag
    (checked before the first write: a skipped step leaves every parameter unchanged)."""

    def __init__(self, inv_scale: torch.Tensor | None, skip: torch.Tensor) -> None:
        #: The kernels' arguments (``kernel_args``) by name, each by the devices it was copied to.
        self._args: dict[str, dict[torch.device, torch.Tensor]] = {}
        if inv_scale is not None:
            self._args["inv_scale"] = {inv_scale.device: inv_scale}
        self._args["skip"] = {skip.device: skip}
        self._taken: dict[torch.device, torch.Tensor] = {}
        #: "unscale" (unscale the gradients, write them back, skip on inf/NaN) or "skip"
        #: (already unscaled, e.g. by ``unscale_``). Part of a compiled kernel's key.
        self.mode = "skip" if inv_scale is None else "unscale"

    @classmethod
    def prepare(
        cls,
        work: Sequence[WorkItem],
        grad_scale: torch.Tensor | float | None,
        found_inf: torch.Tensor | None,
        reduce: Iterable[ProcessGroup] | None = None,
    ) -> _Scaling:
        """``reduce``: process groups over which the inf/NaN finding is combined (the ranks
        holding the shards of DTensor parameters: lowprec.optim.shards), so that all skip alike."""
        devices, home, inv = _inputs(work, grad_scale, found_inf)
        bad = torch.zeros((), dtype=torch.float32, device=home)
        for device in devices:
            # (cast: a work item's parameter has a gradient, core.collect)
            grads = [cast(torch.Tensor, p.grad) for _, p, _, _ in work
                     if p.device == device and cast(torch.Tensor, p.grad).numel()]
            if grads:
                bad += _non_finite(grads, device).to(home)
        found = _add_found(bad, found_inf, reduce)
        return cls(inv, found.reshape(()) != 0)

    def _on(self, name: str, device: torch.device) -> torch.Tensor:
        """Kernel argument ``name`` on ``device`` (copied there once)."""
        copies = self._args[name]
        if device not in copies:
            copies[device] = next(iter(copies.values())).to(device, non_blocking=True)
        return copies[device]

    def kernel_args(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The keyword arguments a step's kernel takes on ``device``: the skip flag, and the
        inverse scale where the gradients carry one (``mode``)."""
        return {name: self._on(name, device) for name in self._args}

    def taken_on(self, device: torch.device) -> torch.Tensor:
        if device not in self._taken:
            self._taken[device] = (~self._on("skip", device)).float()
        return self._taken[device]


def _inputs(
    work: Sequence[WorkItem], grad_scale: torch.Tensor | float | None,
    found_inf: torch.Tensor | None,
) -> tuple[list[torch.device], torch.device, torch.Tensor | None]:
    """The step's devices, the one ``found_inf`` is (or would be) on, and ``1 / grad_scale``
    (None without a scale), as GradScaler makes it; raises on inputs of the wrong kind."""
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
        return devices, home, None
    if isinstance(grad_scale, torch.Tensor):
        if grad_scale.numel() != 1 or not grad_scale.is_floating_point():
            raise TypeError(
                f"grad_scale must be a one-element floating-point tensor or a positive number,"
                f" got a {tuple(grad_scale.shape)} {grad_scale.dtype} tensor."
            )
        # As torch.amp.GradScaler: the reciprocal in FP64, then rounded to FP32.
        return devices, home, grad_scale.detach().reshape(()).double().reciprocal().float()
    scale = _as_float(grad_scale, "grad_scale")
    if not (scale > 0 and scale < float("inf")):
        raise ValueError(f"grad_scale must be positive and finite, got {grad_scale}.")
    return devices, home, torch.tensor(1.0 / scale, dtype=torch.float32, device=home)


def _add_found(
    bad: torch.Tensor, found_inf: torch.Tensor | None, reduce: Iterable[ProcessGroup] | None,
) -> torch.Tensor:
    """This step's finding added to the caller's ``found_inf`` (which it increments), combined
    over the process groups ``reduce`` (the caller's finding too: e.g. a scaler's unscale_)."""
    found = bad
    if found_inf is not None:
        found = found_inf
        found.add_(bad.to(found.device, found.dtype))
    for group in reduce or ():
        torch.distributed.all_reduce(found, op=torch.distributed.ReduceOp.MAX, group=group)
    return found


def skipped_on_host(
    work: Sequence[WorkItem],
    grad_scale: torch.Tensor | float | None,
    found_inf: torch.Tensor | None,
    reduce: Iterable[ProcessGroup] | None = None,
) -> bool | None:
    """A scaled CPU step taken as GradScaler takes torch.optim's: gradients checked and unscaled
    in place in one pass, the finding read on the host; True: skip (nothing written), False: the
    plain step. None (``_Scaling`` takes it) unless that unscaling is exact and is what the
    kernels would see: contiguous CPU BF16/FP32/FP64 gradients, a power-of-two scale (FP16
    gradients unscaled in FP16 would lose what the scale kept)."""
    grads = [cast(torch.Tensor, p.grad) for _, p, _, _ in work]
    if any(g.device.type != "cpu" or not g.is_contiguous() for g in grads) or (
        isinstance(found_inf, torch.Tensor) and found_inf.device.type != "cpu"
    ) or (isinstance(grad_scale, torch.Tensor) and grad_scale.device.type != "cpu"):
        return None
    _, _, inv = _inputs(work, grad_scale, found_inf)
    if inv is not None and (math.frexp(float(inv))[0] != 0.5
                            or any(g.dtype not in _EXACT for g in grads)):
        return None
    bad = torch.zeros((), dtype=torch.float32)
    dense = [g for g in grads if g.numel()]
    if dense:
        torch._amp_foreach_non_finite_check_and_unscale_(
            dense, bad, _one(torch.device("cpu")) if inv is None else inv)
    return bool(_add_found(bad, found_inf, reduce).reshape(()) != 0)


#: The gradient dtypes that hold ``g * 2**-k`` exactly (FP32's exponent range or more).
_EXACT = (torch.bfloat16, torch.float32, torch.float64)


def _non_finite(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """1.0 (0-d FP32 on ``device``) where any of ``grads`` holds inf or NaN, else 0.0. On the CPU
    torch's scaler check with a scale of 1 (one vectorized pass; ``_foreach_norm`` loops per
    tensor there); elsewhere (no BF16 CUDA check: pytorch#127176) and for gradients it cannot
    write back (not contiguous), the ``_foreach_norm`` maxima summed in FP64: finite iff all are."""
    found = torch.zeros((), dtype=torch.float32, device=device)
    cpu = device.type == "cpu"
    dense: list[torch.Tensor] = []
    rest: list[torch.Tensor] = []
    for g in grads:
        (dense if cpu and g.is_contiguous() else rest).append(g)
    if dense:
        torch._amp_foreach_non_finite_check_and_unscale_(dense, found, _one(device))
    if rest:
        ends = torch.stack(torch._foreach_norm(rest, float("inf"))).double()
        found += (~torch.isfinite(ends.sum())).float()
    return found.clamp_(max=1.0)


_ONES: dict[torch.device, torch.Tensor] = {}


def _one(device: torch.device) -> torch.Tensor:
    """A 0-d FP32 1.0 on ``device``, kept (made once)."""
    one = _ONES.get(device)
    if one is None:
        one = _ONES[device] = torch.ones((), dtype=torch.float32, device=device)
    return one


def _mode(scaling: _Scaling | None) -> str | bool:
    """How a step's kernels take a loss scaler's inputs (``_Scaling.mode``); False: none."""
    return False if scaling is None else scaling.mode
