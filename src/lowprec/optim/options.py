"""Group options: lowprec's own defaults (``_COMMON_DEFAULTS``) and the checks that the base
class, the update rules and the loss-scaler inputs share, and ``ARG_DOCS``, the one text of the
arguments every optimizer takes, which ``fill_docs`` puts into each class's docstring. Imports
nothing from the rest of ``lowprec.optim``.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import os
import re
import textwrap
from collections.abc import Iterator
from typing import Any

import torch

_STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
#: Those dtypes by name: how a state dict keeps a group's state_dtype (DCP's full state dict
#: takes no torch.dtype) and how a configuration file may give it.
_STATE_DTYPE_NAMES = {str(d).removeprefix("torch."): d for d in _STATE_DTYPES}


#: The ``state_dtype`` values that keep the moments as codes with a scale per block
#: (``lowprec.optim.qstate``: ``EIGHT_BIT``, ``FOUR_BIT``).
_QUANTIZED_STATE = ("8bit", "4bit")


def _state_dtype_value(value: Any) -> Any:
    """A group's ``state_dtype`` as lowprec keeps it: a dtype's name (``"bfloat16"``) as the
    dtype, anything else as it is (``_check_state_dtype`` checks it)."""
    return _STATE_DTYPE_NAMES.get(value, value) if isinstance(value, str) else value


def _check_state_dtype(value: Any, where: str) -> None:
    """Raise ``ValueError`` unless ``value`` (as ``_state_dtype_value`` keeps it) is a
    ``state_dtype`` lowprec knows: None, ``"8bit"``, ``"4bit"`` or one of ``_STATE_DTYPES``."""
    if value is None or value in _STATE_DTYPES:
        return
    if isinstance(value, str) and value in _QUANTIZED_STATE:
        return
    raise ValueError(
        f"{where}: state_dtype must be None, '8bit', '4bit' or one of torch.float32, "
        f"torch.bfloat16, torch.float16, torch.float64 (or their names, 'bfloat16'); "
        f"got {value!r}."
    )
_COMMON_DEFAULTS = {"master": "auto", "state_dtype": None, "seed": None, "fused": None}
# torch.optim's implementation options: accepted for code written for it, kept out of the groups.
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


#: Set during a step (``driver.run``): a tensor hyperparameter's value, checked when its group
#: was added, is left unread (only its shape and dtype checked), so the step reads no host value.
_IN_STEP: contextvars.ContextVar[bool] = contextvars.ContextVar("lowprec_in_step", default=False)


@contextlib.contextmanager
def in_step() -> Iterator[None]:
    token = _IN_STEP.set(True)
    try:
        yield
    finally:
        _IN_STEP.reset(token)


def _unread(value: Any, name: str) -> bool:
    """Whether ``value`` is a tensor whose value a step leaves unread (``_IN_STEP``); checks that
    it is a one-element floating-point tensor."""
    if not isinstance(value, torch.Tensor) or not _IN_STEP.get():
        return False
    if value.numel() != 1 or not value.is_floating_point():
        raise ValueError(f"{name} must be a number or a one-element floating-point tensor, got "
                         f"a {tuple(value.shape)} {value.dtype} tensor.")
    return True


def _lr(group: dict[str, Any]) -> float | torch.Tensor:
    """A group's learning rate: a float, or a tensor (changed in place by a scheduler) as a 0-d
    FP64 tensor, never read on the host, whose coefficients have the bits a number gives."""
    lr = group["lr"]
    if isinstance(lr, torch.Tensor):
        _unread(lr, "lr")  # (its shape; its value was checked when its group was added)
        return lr.detach().to(torch.float64).reshape(())
    return _as_float(lr, "lr")


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
    # (foreach is accepted and changes nothing: lowprec's step has its own, fused=)


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


def _l2(value: Any) -> bool:
    """Whether an L2 weight decay of ``value`` is in the step's code (the rules' ``l2`` flag):
    a nonzero number, or a tensor, whose value a step does not read on the host."""
    return isinstance(value, torch.Tensor) or value != 0


def _moment_hparams(group: dict[str, Any]) -> dict[str, Any]:
    """A group's ``lr``, ``betas`` (as ``beta1`` and ``beta2``), ``eps`` and ``weight_decay``, as
    the ``*_coefficients`` of Adam's family (AdamW, LAMB, RAdam, StableAdamW) take them."""
    beta1, beta2 = group["betas"]
    return dict(lr=_lr(group), beta1=float(beta1), beta2=float(beta2), eps=group["eps"],
                weight_decay=group["weight_decay"])


def _check_nonnegative(group: dict[str, Any], *names: str) -> None:
    for name in names:
        if not _unread(group[name], name) and _as_float(group[name], name) < 0:
            raise ValueError(f"invalid {name}={group[name]}: must be >= 0.")


def _validate_betas(betas: Any) -> None:
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}.")
    for i, b in enumerate(betas):
        if not _unread(b, f"betas[{i}]") and not 0.0 <= _as_float(b, f"betas[{i}]") < 1.0:
            raise ValueError(f"invalid betas[{i}]={b}: must be in [0, 1).")

_FUSED_ENV = "LOWPREC_FUSED"
_FUSED_VALUES = {"": "auto", "auto": "auto", "1": "fused", "true": "fused", "on": "fused",
                 "fused": "fused", "0": "eager", "false": "eager", "off": "eager",
                 "eager": "eager"}

def _default_mode() -> str:
    """What ``fused=None`` means here: "auto" (compile where a compiler exists), "fused" or
    "eager", from the environment variable ``LOWPREC_FUSED`` (unset: "auto")."""
    value = os.environ.get(_FUSED_ENV, "")
    mode = _FUSED_VALUES.get(value.strip().lower())
    if mode is None:
        raise ValueError(
            f"{_FUSED_ENV}={value!r} is not a setting of lowprec's default optimizer step: use "
            "auto (compile where a compiler exists), 1 (always compile) or 0 (eager)."
        )
    return mode


#: The text of the arguments the optimizers share: ``{name}`` in a class docstring's ``Args:``
#: stands for it (``fill_docs``, for ``help()``; docs/griffe_comments.py, for the reference).
ARG_DOCS = {
    "master": (
        'How the FP32 master weight of a BF16/FP16 parameter is kept: ``"auto"`` (``"kahan"`` '
        'for BF16 and FP16 parameters), ``"none"`` (round to nearest: small updates are lost), '
        '``"kahan"`` (a compensation buffer in the parameter\'s dtype), ``"stochastic"`` '
        '(stochastic rounding, nothing stored), ``"split"`` (an int16 trail: the BF16 parameter '
        'is the top half of an exact FP32 master; BF16 only) or ``"fp32"`` (an FP32 copy); FP32 '
        'parameters are always their own master (default: ``"auto"``).'
    ),
    "state_formats": (
        'a dtype or its name (``torch.bfloat16`` or ``"bfloat16"``), ``"8bit"`` (one byte per '
        'element and an FP32 scale per block of 256) or ``"4bit"`` (half a byte per element); '
        'under ``"8bit"`` and ``"4bit"`` a parameter below 4096 elements, or not a multiple of '
        '256 of them, keeps FP32 state (default: None, meaning float32 for ``"fp32"`` and '
        '``"split"`` and the parameter\'s dtype otherwise).'
    ),
    "seed": "Seed of the stochastic-rounding hash (default: None, meaning ``torch.initial_seed()``).",
    "fused": (
        "Run the step as compiled passes (``torch.compile``: C++ on CPU, Triton on GPU), with "
        "the same results as the eager step: a group's parameters of one device, dtype and "
        "strategy take a few calls whatever their number, those of a rule with per-tensor norms "
        "a few calls per size (``lowprec.optim.buckets``) (default: None, meaning compiled "
        "wherever torch.compile has a compiler, C++ or Triton, and eager elsewhere; see "
        "``lowprec.optim``)."
    ),
    "foreach": (
        "Accepted for code written for ``torch.optim``, and ignored: lowprec picks its own "
        "implementation (``fused``) (default: None)."
    ),
    "capturable": (
        "Read no tensor value on the host in any step, so that a CUDA graph can hold it: every "
        "step keeps its counts on the parameters' device and makes its numbers there anyway, "
        "and this also keeps a loss-scaled CPU step from reading its inf/NaN finding on the "
        "host; ``lr`` may then be a one-element tensor (on that device), which a scheduler "
        "changes in place without a recompile. The steps are the same bits either way "
        "(default: False)."
    ),
    "differentiable": (
        "Must be False: the step writes the weights in place, outside autograd (default: False)."
    ),
}
_ARG_TOKEN = re.compile(r"\{(" + "|".join(ARG_DOCS) + r")\}")
_ENTRY = re.compile(r"\s*\w+: \S")  # (an ``Args:`` entry's first line)


def fill_docs(doc: str) -> str:
    """``doc`` with each ``{name}`` of ``ARG_DOCS`` replaced by its text, every ``Args:`` entry
    that held one wrapped anew at 100 columns (its continuation lines 4 deeper)."""
    lines, out, i = doc.splitlines(), [], 0
    while i < len(lines):
        indent, j = len(lines[i]) - len(lines[i].lstrip()), i + 1
        while _ENTRY.match(lines[i]) and j < len(lines) and lines[j].strip() \
                and len(lines[j]) - len(lines[j].lstrip()) > indent:
            j += 1  # (an entry's continuation lines)
        entry = " ".join(line.strip() for line in lines[i:j])
        if _ENTRY.match(lines[i]) and _ARG_TOKEN.search(entry):
            out += textwrap.wrap(_ARG_TOKEN.sub(lambda m: ARG_DOCS[m[1]], entry), 100,
                                 initial_indent=" " * indent,
                                 subsequent_indent=" " * (indent + 4),
                                 break_long_words=False, break_on_hyphens=False)
        else:
            out += lines[i:j]
        i = j
    return "\n".join(out) + ("\n" if doc.endswith("\n") else "")
