"""What the ``lowprec`` commands share: ``UsageError`` (a mistake in the command line: one line,
exit status 2), rich's console and table, number formatting, the JSON output and its path
checked before any work, the environment recorded with the results, and ``--device`` resolved.

Torch-free to import (``lowprec.cli.main`` and ``lowprec.cli.compare_cmd`` import it while the
command starts); ``_environment`` and ``_resolve_device`` import torch when they are called.
"""

from __future__ import annotations

import json
import math
import os
import platform
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lowprec import __version__

if TYPE_CHECKING:  # (rich is imported when a command prints: the start stays light)
    from rich.console import Console
    from rich.table import Table

_EXTRA_HINT = 'the lowprec command needs its extras: pip install "lowprec[cli]" ({})'


class UsageError(Exception):
    """A mistake in the command line: printed as one line, exit status 2."""


def _import_rich() -> tuple[type[Console], type[Table]]:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError as exc:  # pragma: no cover - the cli extra installs rich
        raise UsageError(_EXTRA_HINT.format(exc)) from None
    return Console, Table


def _console() -> Console:
    """A rich console; wide enough for the tables (compare's 14 columns, 16 when fine-tuning)
    when the output is a file or a pipe."""
    Console, _ = _import_rich()
    console = Console()
    if not console.is_terminal:
        console = Console(width=240)
    return console


# ---------------------------------------------------------------------------------- output


def _fmt(value: Any, spec: str, *, scale: float = 1.0, unit: str = "") -> str:
    """``value * scale`` formatted with ``spec`` and ``unit``; "-" for a missing or NaN value."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value * scale, spec) + unit


def _json_ready(obj: Any) -> Any:
    """``obj`` with inf and NaN (a diverged run's losses) as null: strict JSON has neither."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _json_ready(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_ready(v) for v in obj]
    return obj


def _write_json(path: Path, payload: dict[str, Any]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(_json_ready(payload), indent=2, allow_nan=False) + "\n")
    except OSError as exc:
        raise UsageError(f"cannot write {path}: {exc.strerror or exc}") from None


def _check_output(path: Path, option: str) -> None:
    """Make sure ``path`` can be written before any work is done: its folder is created (as the
    write would create it) and a scratch file written and removed there. A mistake (a file where a
    folder must be, a folder where the file goes, no permission, a read-only file system) is a
    ``UsageError`` naming ``option``, instead of a failure after minutes of training."""
    import tempfile

    if path.is_dir():
        raise UsageError(f"{option} {path} is a folder: name a file inside it, e.g. "
                         f"{path / ('compare' + (path.suffix or '.json'))}")
    for parent in (path.parent, *path.parent.parents):
        if parent.exists():
            if not parent.is_dir():
                raise UsageError(f"cannot write {path} ({option}): {parent} is a file, not a "
                                 "folder; choose another path")
            break
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=".lowprec-check-"):
            pass
    except OSError as exc:
        raise UsageError(f"cannot write {path} ({option}): {exc.strerror or exc}") from None


def _environment() -> dict[str, Any]:
    import torch

    return {
        "lowprec": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "cpu_count": os.cpu_count(),
        "bf16_matmul_isa": torch.backends.cpu.get_cpu_capability(),
    }


def _resolve_device(name: str) -> dict[str, Any]:
    """``run.device_info`` of the device ``name`` names here; a ``UsageError`` where there
    is none (``--device cuda`` without CUDA), before any work."""
    from lowprec.comparison.run import device_info, resolve_device

    try:
        return device_info(resolve_device(name))
    except ValueError as exc:
        raise UsageError(f"--device {name}: {exc}") from None
