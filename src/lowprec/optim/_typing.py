"""Type aliases of ``lowprec``'s internals, for annotations (imported under ``TYPE_CHECKING``),
and ``compiler_disable``, ``torch.compiler.disable`` as type checkers should see it."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from lowprec.optim.storage import MasterStorage

    _F = TypeVar("_F", bound=Callable[..., Any])

    def compiler_disable(fn: _F) -> _F:
        """``torch.compiler.disable`` as a plain decorator, typed (torch leaves it unannotated,
        which would make what it decorates untyped)."""
else:
    from torch.compiler import disable as compiler_disable

__all__ = ["PairDtypes", "QFormats", "WorkItem", "compiler_disable"]

#: One parameter's step to take: (its group, the parameter, its index among every group's
#: parameters, its storage strategy), as ``core.collect`` lists them.
WorkItem: TypeAlias = "tuple[dict[str, Any], torch.Tensor, int, MasterStorage]"
#: The update rule's buffers kept as codes, each with its format (``qstate.fmt``).
QFormats: TypeAlias = "tuple[tuple[str, str], ...]"
#: A step on pairs of elements: the gradient's and each rule buffer's dtype
#: (``compiled.pairs_plan``).
PairDtypes: TypeAlias = "tuple[tuple[str, torch.dtype], ...]"
