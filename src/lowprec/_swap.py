"""Swapping a model's layers in place, for the layer conversions (``dfp.convert_to_dfp``,
``blockfmt.convert_to_blocks``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from torch import nn

__all__ = ["swap_layers"]


def swap_layers(
    model: nn.Module,
    targets: tuple[type[nn.Module], ...],
    make: Callable[[nn.Module], nn.Module],
    skip: Iterable[str],
    fn: str,
) -> nn.Module:
    """Replace every module of ``model`` whose type is exactly one of ``targets`` by
    ``make(module)``, except those under a ``skip`` name; a module reachable under several names
    is replaced once and stays shared.

    Returns ``model``, or its replacement when ``model`` itself is a target (a module cannot
    replace itself in place). Raises ``ValueError``, naming ``fn``, for a ``skip`` name that
    matches no module (a typo would silently convert it).
    """
    skip = tuple(skip)
    names = {name for name, _ in model.named_modules()}
    unknown = [s for s in skip if s not in names]
    if unknown:
        raise ValueError(
            f"{fn}(): skip names {unknown} match no module; use names from "
            "model.named_modules(), e.g. 'features.0' or 'head'."
        )

    def skipped(name: str) -> bool:
        return any(name == s or name.startswith(s + ".") or s == "" for s in skip)

    converted: dict[int, nn.Module] = {}

    def convert(module: nn.Module) -> nn.Module:
        if id(module) not in converted:
            converted[id(module)] = make(module)
        return converted[id(module)]

    if type(model) in targets:
        return model if skipped("") else convert(model)
    for parent_name, parent in list(model.named_modules(remove_duplicate=False)):
        # _modules, not named_children(): the latter hides a second name for the same child.
        for child_name, child in list(parent._modules.items()):
            full = f"{parent_name}.{child_name}" if parent_name else child_name
            if type(child) in targets and not skipped(full):
                setattr(parent, child_name, convert(child))
    return model
