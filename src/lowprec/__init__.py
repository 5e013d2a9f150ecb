"""lowprec: train PyTorch models in BF16/FP16 with FP32-quality results.

The names below are imported on first use (PEP 562), so that ``import lowprec.comparison.config`` and the
``lowprec`` command's ``--help`` do not wait for torch; ``lowprec.AdamW``,
``from lowprec import AdamW`` and ``lowprec.optim`` work as plain imports do.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# name -> the module that defines it (a submodule's own name for the submodules)
_LAZY = {
    "Accumulator": "lowprec.accumulation",
    "compare": "lowprec.comparison.api",
    "Comparison": "lowprec.comparison.api",
    "accumulate": "lowprec.accumulation",
    "SGD": "lowprec.optim",
    "Adagrad": "lowprec.optim",
    "AdamW": "lowprec.optim",
    "Lamb": "lowprec.optim",
    "Adafactor": "lowprec.optim",
    "Adam": "lowprec.optim",
    "RAdam": "lowprec.optim",
    "Lion": "lowprec.optim",
    "StableAdamW": "lowprec.optim",
    "Muon": "lowprec.optim",
    "muon_param_groups": "lowprec.optim",
    "master_state_dict": "lowprec.optim",
    "keep_fp32_values": "lowprec.optim",
    "StepInBackward": "lowprec.optim",
    "step_in_backward": "lowprec.optim",
    "LossScaler": "lowprec.scaling",
    "NonFiniteLossError": "lowprec.scaling",
    "diagnostics": "lowprec.diagnostics",
    "numerics": "lowprec.numerics",
    "optim": "lowprec.optim",
    "recipes": "lowprec.recipes",
}

__all__ = [
    "SGD",
    "Accumulator",
    "Adafactor",
    "Adagrad",
    "Adam",
    "AdamW",
    "Comparison",
    "Lamb",
    "Lion",
    "LossScaler",
    "Muon",
    "NonFiniteLossError",
    "RAdam",
    "StableAdamW",
    "StepInBackward",
    "__version__",
    "accumulate",
    "compare",
    "diagnostics",
    "keep_fp32_values",
    "master_state_dict",
    "muon_param_groups",
    "numerics",
    "optim",
    "recipes",
    "step_in_backward",
]

if TYPE_CHECKING:  # (what a type checker and an IDE see: the plain imports)
    from lowprec import diagnostics, numerics, optim, recipes
    from lowprec.accumulation import Accumulator, accumulate
    from lowprec.comparison.api import Comparison, compare
    from lowprec.optim import (
        SGD,
        Adafactor,
        Adagrad,
        Adam,
        AdamW,
        Lamb,
        Lion,
        Muon,
        RAdam,
        StableAdamW,
        StepInBackward,
        keep_fp32_values,
        master_state_dict,
        muon_param_groups,
        step_in_backward,
    )
    from lowprec.scaling import LossScaler, NonFiniteLossError


def __getattr__(name: str) -> Any:
    where = _LAZY.get(name)
    if where is None:
        # Any other submodule (lowprec.dfp, lowprec.distributed, ...) on first use, as the
        # package's eager imports used to make most of them available.
        if name.startswith("_") or importlib.util.find_spec(f"lowprec.{name}") is None:
            raise AttributeError(f"module 'lowprec' has no attribute {name!r}")
        where = f"lowprec.{name}"
    module = importlib.import_module(where)
    value = module if where == f"lowprec.{name}" else getattr(module, name)
    globals()[name] = value  # (the next lookup is a plain one)
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
