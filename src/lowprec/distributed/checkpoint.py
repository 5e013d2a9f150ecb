"""``OneBitState``'s checkpoints: every rank's residuals gathered into one dict, and taken back.

``state_dict(state)`` is a collective (tensor collectives only: no pickling, no numpy): an int64
header per rank (counters, and per parameter the length of its local residual and the offset and
length of its stripe piece), then every rank's residuals as one flat FP32 tensor, padded to the
longest. ``load_state_dict(state, sd)`` checks the dict against this state and leaves each rank's
part pending until its parameters' buckets next appear. ``OneBitState.state_dict()`` and
``load_state_dict()`` call these after finishing any bucket still in flight.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from lowprec.distributed.layout import _Layout


class OneBitState(Protocol):
    """What a checkpoint reads and sets of ``hook.OneBitState`` (typed here, so that this module
    imports nothing of the hook that calls it)."""

    iter: int
    _numels: dict[str, int]
    _layouts: dict[tuple[Any, ...], _Layout]
    _home: dict[str, _Layout]
    _pending_local: dict[str, torch.Tensor]
    _pending_stripe: dict[str, tuple[int, torch.Tensor]]
    _carry: set[str]
    _residual_scale: float | None
    _scale_iter: int | None

    def _group(self) -> dist.ProcessGroup: ...

    def config(self) -> dict[str, Any]: ...

    def counters(self) -> dict[str, int]: ...

FORMAT = "lowprec.distributed.OneBitState"
VERSION = 1
#: Byte and bucket counters, in the order of a checkpoint's header.
COUNTERS = (
    "bytes_sent",
    "bytes_received",
    "uncompressed_bytes",
    "compressed_buckets",
    "fallback_buckets",
    "uncompressed_buckets",
)
# Settings that change the numbers; a checkpoint made with other values does not resume bit for bit.
NUMERIC_CONFIG = ("bits", "rule", "column_size", "min_column_size")

# torch 2.13 deprecates all_gather_into_tensor in favour of all_gather_single; older releases (the
# project supports torch >= 2.4) only have the former.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor



def _own_residuals(state: OneBitState) -> dict[str, Any]:
    local: dict[str, torch.Tensor] = {}
    stripe: dict[str, dict[str, Any]] = {}
    for key in sorted(set(state._home) | set(state._pending_local) | set(state._pending_stripe)):
        home = state._home.get(key)
        src = state._pending_local.get(key)
        if src is None and home is not None:
            a, b = home.span(key)
            src = home.local[a:b]
        if src is not None:
            local[key] = src.detach().to("cpu", torch.float32, copy=True)
        piece = state._pending_stripe.get(key)
        if piece is None and home is not None:
            piece = home.own_piece(key)
        if piece is not None:
            stripe[key] = {"offset": piece[0],
                           "residual": piece[1].detach().to("cpu", torch.float32, copy=True)}
    return {"local": local, "stripe": stripe, "counters": state.counters()}


def _comm_device(group: dist.ProcessGroup) -> torch.device:
    """Where the checkpoint collectives' tensors live: CUDA for an NCCL-only group, else CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def state_dict(state: OneBitState) -> dict[str, Any]:
    """``OneBitState.state_dict``: every rank's residuals and counters, on every rank (a
    collective), in the format of the module docstring; raises ``RuntimeError`` where the ranks'
    states were built on different models."""
    group = state._group()
    world = group.size()
    device = _comm_device(group)
    own = _own_residuals(state)
    names = list(state._numels)  # the module's parameters, in order: the same on every rank
    counters = own["counters"]
    header = [counters["iter"], *(counters[k] for k in COUNTERS)]
    payload: list[torch.Tensor] = []
    for name in names:
        local = own["local"].get(name)
        piece = own["stripe"].get(name)
        header.append(-1 if local is None else local.numel())
        header += [-1, -1] if piece is None else [piece["offset"], piece["residual"].numel()]
        if local is not None:
            payload.append(local)
        if piece is not None:
            payload.append(piece["residual"])
    flat = torch.cat(payload) if payload else torch.zeros(0)
    # 1. Sizes: the header's length names the model (the same on every rank, else nobody can
    # decode the others' headers), the payload's length sets the padding.
    sizes = torch.tensor([len(header), flat.numel(), sum(state._numels.values())],
                         dtype=torch.int64, device=device)
    all_sizes = torch.empty(world, 3, dtype=torch.int64, device=device)
    all_gather_single(all_sizes.view(-1), sizes, group=group)
    all_sizes = all_sizes.cpu()
    if not bool((all_sizes[:, [0, 2]] == all_sizes[0, [0, 2]]).all()):
        raise RuntimeError(
            "OneBitState.state_dict(): the ranks' states were built on different models "
            f"(parameters per rank: {(all_sizes[:, 0] - 1 - len(COUNTERS)) // 3}, values "
            f"per rank: {all_sizes[:, 2].tolist()}); build every rank's state on the same "
            "model DDP wraps."
        )
    # 2. Headers (now known to have one length) and 3. payloads, padded to the longest.
    headers = torch.empty(world, len(header), dtype=torch.int64, device=device)
    all_gather_single(headers.view(-1), torch.tensor(header, dtype=torch.int64,
                                                       device=device), group=group)
    headers = headers.cpu()
    longest = int(all_sizes[:, 1].max())
    send = torch.zeros(longest, dtype=torch.float32, device=device)
    send[: flat.numel()] = flat
    payloads = torch.empty(world, longest, dtype=torch.float32, device=device)
    if longest:
        all_gather_single(payloads.view(-1), send, group=group)
    payloads = payloads.cpu()
    ranks = [_decode_rank(names, headers[r].tolist(), payloads[r]) for r in range(world)]
    return {
        "format": FORMAT,
        "version": VERSION,
        "world_size": world,
        "iter": state.iter,
        "residual_scale": state._residual_scale,
        "config": state.config(),
        "ranks": ranks,
    }


def _decode_rank(names: list[str], header: list[int], payload: torch.Tensor) -> dict[str, Any]:
    """One rank's part of ``state_dict()`` from its header and payload (see there)."""
    counters = {"iter": header[0], **dict(zip(COUNTERS, header[1 : 1 + len(COUNTERS)],
                                              strict=True))}
    local: dict[str, torch.Tensor] = {}
    stripe: dict[str, dict[str, Any]] = {}
    at, h = 0, 1 + len(COUNTERS)
    for name in names:
        n_local, offset, n_stripe = header[h : h + 3]
        h += 3
        if n_local >= 0:
            local[name] = payload[at : at + n_local].clone()
            at += n_local
        if n_stripe >= 0:
            stripe[name] = {"offset": offset, "residual": payload[at : at + n_stripe].clone()}
            at += n_stripe
    return {"local": dict(sorted(local.items())), "stripe": dict(sorted(stripe.items())),
            "counters": counters}


def load_state_dict(state: OneBitState, state_dict: dict[str, Any], *,
                    strict: bool = True) -> None:
    """``OneBitState.load_state_dict``: check ``state_dict`` against ``state`` (world size,
    settings with ``strict``, parameter names and sizes) before changing anything, then take this
    rank's part, pending until its parameters' buckets next appear."""
    if not isinstance(state_dict, dict) or state_dict.get("format") != FORMAT:
        raise TypeError(
            "state_dict is not a OneBitState.state_dict() (no format "
            f"{FORMAT!r}); pass the dict that state.state_dict() returned."
        )
    if state_dict.get("version") != VERSION:
        raise ValueError(
            f"OneBitState checkpoint version {state_dict.get('version')!r} is not supported "
            f"(this lowprec reads version {VERSION})."
        )
    group = state._group()
    world, rank = group.size(), dist.get_rank(group)
    saved_world = state_dict["world_size"]
    if saved_world != world or len(state_dict["ranks"]) != world:
        raise ValueError(
            f"the OneBitState checkpoint was saved by {saved_world} ranks but this process "
            f"group has {world}: residuals are per rank and cannot be re-split. Resume with "
            f"{saved_world} ranks, or start this state afresh (skip load_state_dict)."
        )
    if strict:
        diff = [f"{k}: saved {state_dict['config'].get(k)!r}, here {getattr(state, k)!r}"
                for k in NUMERIC_CONFIG if state_dict["config"].get(k) != getattr(state, k)]
        if diff:
            raise ValueError(
                "the OneBitState checkpoint was made with other settings (" + "; ".join(diff)
                + "): build the state with the saved settings to resume bit for bit, or "
                "pass strict=False to carry the residuals over anyway."
            )
    for r, part in enumerate(state_dict["ranks"]):
        for key in set(part["local"]) | set(part["stripe"]):
            if key not in state._numels:
                if strict:
                    raise ValueError(
                        f"the OneBitState checkpoint has residuals for {key!r} (rank {r}), "
                        "which is not a parameter of this module; load into a state built "
                        "on the same model, or pass strict=False to drop them."
                    )
                continue
            numel = state._numels[key]
            local = part["local"].get(key)
            piece = part["stripe"].get(key)
            if (local is not None and local.numel() != numel) or (
                piece is not None and piece["offset"] + piece["residual"].numel() > numel
            ):
                raise ValueError(
                    f"the OneBitState checkpoint's residual for {key!r} (rank {r}) does not "
                    f"fit the parameter's {numel} values: it was saved for another model."
                )
    mine = state_dict["ranks"][rank]
    state._layouts.clear()
    state._home.clear()
    state._pending_local = {
        k: v.detach().to(torch.float32).reshape(-1).clone()
        for k, v in mine["local"].items() if k in state._numels
    }
    state._pending_stripe = {
        k: (int(v["offset"]), v["residual"].detach().to(torch.float32).reshape(-1).clone())
        for k, v in mine["stripe"].items() if k in state._numels
    }
    state._carry = {k for part in state_dict["ranks"] for k in part["stripe"]
                   if k in state._numels}
    state.iter = int(state_dict["iter"])
    # The loss scale the residuals were made at (None in older checkpoints: taken as the scale
    # of the next step); the next compressed iteration rescales them to the scale it reads.
    state._residual_scale = state_dict.get("residual_scale")
    state._scale_iter = None
    for k in COUNTERS:
        setattr(state, k, int(mine["counters"].get(k, 0)))
