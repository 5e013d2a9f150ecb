"""Checkpoints: ``LowPrecisionOptimizer``'s ``state_dict`` and ``load_state_dict`` (functions of
the optimizer that ``base``'s methods call; this module does not import ``base``).

torch.optim's ``load_state_dict`` casts floating state to the parameter's dtype, which would round
an FP32 master or FP32 moments of a BF16 parameter. The load here keeps every state tensor's
dtype, checks the whole checkpoint before changing anything, adopts torch.optim checkpoints
(``_adopt_state``) and converts state saved under another ``master=`` (``_convert_master``).
"""

from __future__ import annotations

import copy
from collections import defaultdict
from typing import TYPE_CHECKING, Any

import torch
from torch.optim import Optimizer

from lowprec.optim import core, qstate
from lowprec.optim.dtensor import is_dtensor, local, mark_blocks, wrap_like, wrap_state
from lowprec.optim.options import _COMMON_DEFAULTS, _TORCH_ONLY_OPTIONS, _step_tensor
from lowprec.optim.shards import check_loaded_state
from lowprec.optim.storage import STORAGES, convert, resolve_master

if TYPE_CHECKING:  # pragma: no cover
    from lowprec.optim.core import OptimizerCore
    from lowprec.optim.storage import MasterStorage

# How the state is stored: an optimizer given these explicitly keeps them over a checkpoint's.
_STORAGE_OPTIONS = ("master", "state_dtype")


def state_dict(opt: OptimizerCore) -> dict[str, Any]:
    """``torch.optim.Optimizer.state_dict``, each group's ``state_dtype`` dtype by its name
    (``"bfloat16"``): torch.distributed.checkpoint's full state dict takes no ``torch.dtype``."""
    sd = Optimizer.state_dict(opt)
    for group in sd["param_groups"]:
        if isinstance(group.get("state_dtype"), torch.dtype):
            group["state_dtype"] = str(group["state_dtype"]).removeprefix("torch.")
    return sd


def load_state_dict(opt: OptimizerCore, state_dict: dict[str, Any]) -> None:
    """Load ``state_dict``, every state tensor keeping its dtype (moved to its parameter's
    device), all checked before anything changes; torch.optim's load pre-hooks run first (each
    may replace it) and its post-hooks last."""
    state_dict = state_dict.copy()  # (as torch.optim: a pre-hook may edit or replace it)
    for pre_hook in opt._optimizer_load_state_dict_pre_hooks.values():
        out = pre_hook(opt, state_dict)
        if out is not None:
            state_dict = out
    saved_groups = copy.deepcopy(state_dict["param_groups"])  # (not shared with the caller)
    saved_state = state_dict["state"]
    if len(saved_groups) != len(opt.param_groups):
        raise ValueError(
            f"the checkpoint has {len(saved_groups)} parameter groups, this optimizer "
            f"{len(opt.param_groups)}."
        )
    id_map: dict[Any, tuple[torch.Tensor, dict[str, Any]]] = {}
    loaded_groups = []
    for gi, (sg, g) in enumerate(zip(saved_groups, opt.param_groups, strict=True)):
        if len(sg["params"]) != len(g["params"]):
            raise ValueError(
                f"parameter group {gi} has {len(g['params'])} parameters but the checkpoint's "
                f"has {len(sg['params'])}."
            )
        # The checkpoint's options win, but for storage options given explicitly (the state
        # is converted). A torch.optim checkpoint keeps lowprec's own options as the live
        # group has them: its "fused" means torch's kernels, and it has no master or seed.
        if "master" in sg:
            own = {k: g[k] for k in _STORAGE_OPTIONS if g[k] != _COMMON_DEFAULTS[k]}
        else:
            own = {k: g[k] for k in _COMMON_DEFAULTS}
        merged = {k: v for k, v in {**g, **sg, **own}.items() if k not in _TORCH_ONLY_OPTIONS}
        merged["params"] = g["params"]
        if merged["seed"] is None:
            merged["seed"] = g["seed"]
        core.validate_group(opt, merged, gi)
        loaded_groups.append(merged)  # (with the live parameters, as torch's update_group)
        for sid, p in zip(sg["params"], g["params"], strict=True):
            id_map[sid] = (p, merged)
    new_state: dict[torch.Tensor, dict[str, Any]] = {}
    writes: list[tuple[torch.Tensor, torch.Tensor]] = []  # (converted masters' parameters)
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
            # (a count saved as a number: torch before 1.12, some third-party code)
            moved["step"] = _step_tensor(moved["step"], f"parameter {sid!r}")
        if moved:
            storage = resolve_master(merged["master"], p.dtype)
            where = f"parameter {sid!r}"
            if is_dtensor(p):
                mark_blocks(p)
                check_loaded_state(moved, p, where)
            if "master" not in moved:  # torch.optim's state: see _adopt_state
                moved = _adopt_state(opt, moved, merged, p, storage, where)
            elif moved["master"] != storage.name:
                moved, value = _convert_master(opt, moved, merged, p, storage, where)
                writes.append((p, value))
            _cast_math_buffers(opt, moved, merged, p, storage)
            core.check_state(opt.rule(merged), moved, merged, p, storage, where)
        new_state[p] = moved
    with torch.no_grad():  # (every check has passed: now the parameters may change)
        for p, value in writes:
            local(p).copy_(value)
    core.stages(opt).shards = {}  # (DTensor parameters' local views: lowprec.optim.shards)
    # (as torch's load_state_dict ends: the live parameters in the groups, state keyed by them)
    state: defaultdict[torch.Tensor, dict[str, Any]] = defaultdict(dict)
    state.update(new_state)
    opt.__setstate__({"state": state, "param_groups": loaded_groups})
    for post_hook in opt._optimizer_load_state_dict_post_hooks.values():
        post_hook(opt)


def _convert_master(
    opt: OptimizerCore,
    st: dict[str, Any],
    group: dict[str, Any],
    p: torch.Tensor,
    storage: MasterStorage,
    where: str,
) -> tuple[dict[str, Any], torch.Tensor]:
    """State saved under another ``master=`` (``st["master"]``) converted to ``storage`` from
    the parameter's current value (load the model first): the new state and the parameter's new
    value (a DTensor's local shard), which the caller writes once every check has passed."""
    old = STORAGES.get(st["master"])
    if old is None:
        raise ValueError(
            f"{where}: the checkpoint's state was saved with master={st['master']!r}, which "
            f"lowprec does not know, so it cannot be converted to this optimizer's "
            f"master={storage.name!r}; load a checkpoint saved by a lowprec optimizer."
        )
    lp = local(p) if is_dtensor(p) else p.detach()
    bufs: dict[str, torch.Tensor] = {}
    for name, dtype in old.buffers(lp).items():
        t = st.get(name)
        if not isinstance(t, torch.Tensor) or t.shape != p.shape or t.dtype != dtype:
            raise ValueError(
                f"{where}: its state was saved with master={old.name!r}, whose {name!r} should "
                f"be a {tuple(p.shape)} {dtype} tensor, got {core._described(t)}; so it cannot be "
                f"converted to this optimizer's master={storage.name!r}. Load a checkpoint "
                "of this model's parameters."
            )
        bufs[name] = local(t)
    value, new_bufs = convert(old, storage, lp, bufs)
    out = {k: v for k, v in st.items() if k not in bufs}
    out["master"] = storage.name
    for name, t in new_bufs.items():
        out[name] = wrap_like(t, p) if is_dtensor(p) else t
    return out, value


def _cast_math_buffers(
    opt: OptimizerCore,
    st: dict[str, Any],
    group: dict[str, Any],
    p: torch.Tensor,
    storage: MasterStorage,
) -> None:
    """The rule's buffers in ``st`` converted in place to the group's state dtype: cast, or
    encoded/decoded through FP32 (``qstate``). A buffer that is neither values shaped as ``p``
    nor codes of ``p`` with scales is left for ``core.check_state`` to refuse."""
    dtype = core.state_dtype(group, p, storage)
    want = qstate.BITS.get(group["state_dtype"], 8) if dtype == torch.uint8 else 0
    # (a DTensor parameter's buffers: converted on this rank's shard, kept as DTensors)
    lp = local(p)

    def keep(name: str, value: torch.Tensor) -> Any:
        return wrap_state(name, value, lp, p) if is_dtensor(p) else value

    rule = opt.rule(group)
    for name in rule.buffers(p):
        key = qstate.scale_key(name)
        t: Any  # (a tensor or anything else: _saved_width says)
        scale: Any
        t, scale = st.get(name), st.get(key)
        saved = _saved_width(t, scale, p)
        if saved is None:
            continue
        if saved and not is_dtensor(scale):
            # (scales saved in another layout: FSDP2's rows per row, or a plain run's flat)
            st[key] = scale = scale.reshape(qstate.scale_shape(p))
        if saved and saved == want:
            continue
        signed = name not in rule.nonnegative
        lt = local(t)
        if saved:  # (codes of another width, or values wanted: their FP32 values)
            ls = local(scale)
            if ls.numel() * qstate.BLOCK != lp.numel():
                continue
            values = qstate.from_codes(lt, ls, signed, lp.shape)
            del st[key]
            if not want:
                st[name] = keep(name, values.to(dtype))
                continue
            lt = values
        if want:
            codes, scales = qstate.to_codes(lt, signed, want)
            st[name] = keep(name, codes)
            st[key] = keep(key, scales.view(qstate.scale_shape(lp)))
        elif lt.dtype != dtype:
            st[name] = t.to(dtype)


def _adopt_state(
    opt: OptimizerCore,
    st: dict[str, Any],
    group: dict[str, Any],
    p: torch.Tensor,
    storage: MasterStorage,
    where: str,
) -> dict[str, Any]:
    """A torch.optim state entry (same buffer names, no ``"master"``) as this optimizer's: the
    moments cast, the master's buffers fresh from the parameter (load the model first), the
    count kept (torch's SGD keeps none: 1 once it has a momentum buffer)."""
    rule = opt.rule(group)
    names = rule.buffers(p)
    # (older torch SGD without momentum kept momentum_buffer=None: nothing to adopt)
    unknown = sorted(k for k, v in st.items() if v is not None and k not in {"step", *names})
    if unknown:
        raise ValueError(
            f"{where}: the checkpoint's state holds {unknown}, which {type(opt).__name__} "
            f"with these options does not keep (it keeps {['step', *names]}); load a "
            "checkpoint of the same optimizer."
        )
    state = core.init_state(rule, group, p, storage)
    for name in names:
        t = st.get(name)
        if t is None:  # (torch's SGD before its first step: the fresh buffer)
            continue
        shape = rule.buffer_shape(name, p) or p.shape
        if not isinstance(t, torch.Tensor) or t.shape != shape:
            raise ValueError(
                f"{where}: state {name!r} should be a {tuple(shape)} tensor, got "
                f"{core._described(t)}; the state does not belong to this parameter."
            )
        # (8-bit state: the FP32 moments, which _cast_math_buffers encodes next)
        dtype = torch.float32 if state[name].dtype == torch.uint8 else state[name].dtype
        state[name] = t.to(device=p.device, dtype=dtype, copy=True)
    step = st.get("step")
    if step is None:
        step = 1.0 if any(st.get(name) is not None for name in names) else 0.0
    state["step"] = torch.tensor(float(step), dtype=torch.float32)
    return state


def _saved_width(t: Any, scale: Any, p: torch.Tensor) -> int | None:
    """What a checkpoint holds for a buffer of ``p``: 8 or 4 (codes of that width with their
    scales, one per block of ``p``), 0 (floating-point values shaped as ``p``), None (neither:
    not this parameter's)."""
    if not isinstance(t, torch.Tensor):
        return None
    if (t.dtype == torch.uint8 and isinstance(scale, torch.Tensor)
            and scale.numel() * qstate.BLOCK == p.numel()):
        if t.shape == p.shape:
            return 8
        return 4 if t.shape == (p.numel() // 2,) and not is_dtensor(t) else None
    return 0 if t.shape == p.shape and t.is_floating_point() else None
