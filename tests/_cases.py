"""How the suite picks cases from an option matrix without compiling every combination.

Each combination of optimizer, master, dtype and state format compiles a kernel of its own, 5 to
30 seconds on a 2-core CPU, so a full product is kept only where every case can fail in its own
way: the per-tensor step's fused-equals-eager matrix (tests/test_fused.py, across a checkpoint)
crosses every optimizer with every master and dtype. Around that kernel sit wrappers shared by
every rule and master (pairs of elements, batches of small parameters, the loss-scaled load and
skip, 4-bit codes, whose moments no master touches): their tests take

- ``axes``: every value of each factor once, the others at a reference value (one factor's
  code never sees the other's: the update rule never sees how the master is stored);
- ``pairwise``: three factors, every pair of values of any two of them in some case.
"""

from __future__ import annotations

import importlib.util
import itertools
import pathlib
from collections.abc import Sequence
from types import ModuleType
from typing import Any


def axes(first: Sequence[Any], second: Sequence[Any], at: tuple[Any, Any]) -> list[tuple[Any, Any]]:
    """Every ``(a, at[1])`` for ``a`` in ``first`` and every ``(at[0], b)`` for ``b`` in
    ``second``, once each, in that order."""
    out = [(a, at[1]) for a in first]
    out += [(at[0], b) for b in second if (at[0], b) not in out]
    return out


def pairwise(first: Sequence[Any], second: Sequence[Any],
             third: Sequence[Any]) -> list[tuple[Any, Any, Any]]:
    """``first`` x ``second`` whole, with ``third`` turning round, so that every pair of values of
    any two factors is in some case (``third`` no longer than either of the others):
    ``len(first) * len(second)`` cases instead of that times ``len(third)``."""
    if len(third) > min(len(first), len(second)):
        raise ValueError("pairwise: the third factor must be the shortest")
    return [(a, b, third[(i + j) % len(third)])
            for (i, a), (j, b) in itertools.product(enumerate(first), enumerate(second))]


def kernel_families() -> ModuleType:
    """``benchmarks/kernel_families.py``, the matrix of configurations (optimizer x master x
    state format) and its census of kernels, loaded as a module."""
    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "kernel_families.py"
    spec = importlib.util.spec_from_file_location("kernel_families", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
