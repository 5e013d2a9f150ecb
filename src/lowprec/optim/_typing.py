"""Type aliases of ``lowprec.optim``'s internals, for annotations only (imported under
``TYPE_CHECKING``: nothing here runs)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeAlias

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from lowprec.optim.storage import MasterStorage

#: One parameter's step to take: (its group, the parameter, its index among every group's
#: parameters, its storage strategy), as ``LowPrecisionOptimizer._collect`` lists them.
WorkItem: TypeAlias = "tuple[dict[str, Any], torch.Tensor, int, MasterStorage]"
#: The update rule's buffers kept as codes, each with its format (``qstate.fmt``).
QFormats: TypeAlias = "tuple[tuple[str, str], ...]"
#: A step on pairs of elements: the gradient's and each rule buffer's dtype
#: (``compiled.pairs_plan``).
PairDtypes: TypeAlias = "tuple[tuple[str, torch.dtype], ...]"
#: What one ``step()`` shares between its parameters (``param_step.step_param``'s ``memo``).
Memo: TypeAlias = "dict[Any, Any]"
