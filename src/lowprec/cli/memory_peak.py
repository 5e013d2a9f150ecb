"""The peak of a whole training step, measured in fresh processes, beside its tensor accounting.

``lowprec.memory`` counts what a model and its optimizer hold between steps; this module
measures what a step needs at its peak, with and without ``lowprec.step_in_backward`` (which
steps each parameter in its post-accumulate-grad hook and frees its gradient at once, so no full
set of gradients ever exists). Each configuration runs in a process of its own
(``python -m lowprec.cli.memory_probe``, which says how it measures), started with
``MALLOC_MMAP_THRESHOLD_`` set so that glibc gives a freed tensor's pages back at once, and
answers in JSON.

``peak_table`` runs every recipe of ``recipes.RECIPES``, each without and with
``step_in_backward`` (a recipe's own ``step_in_backward`` attribute, where it has one, marks which
of the two is the recipe's way), so a recipe added there appears here with no change.
``targets`` checks the figures the feature was built for.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from lowprec.cli.memory_plan import in_backward_refusal
from lowprec.cli.memory_probe import DEFAULTS

__all__ = ["MMAP_THRESHOLD", "SAVING_TOLERANCE", "TARGET_BYTES_PER_PARAM", "TARGET_RECIPE",
           "in_backward_available", "peak_table", "probe", "targets"]

#: Allocations of at least this many bytes are mmapped by glibc in the probe's process (and so
#: unmapped when freed), instead of the dynamic threshold (up to 32 MiB) that keeps them.
MMAP_THRESHOLD = 65536

#: The issue's target for AdamW with BF16 + Kahan weights, 8-bit moments and step_in_backward:
#: bytes per parameter accounted at the peak of a step.
TARGET_BYTES_PER_PARAM = 6.1
TARGET_RECIPE = "bf16-kahan-8bit"
#: How far below the freed gradient bytes a measured saving may fall and still meet the target.
SAVING_TOLERANCE = 0.01


def in_backward_available() -> bool:
    """Whether this lowprec has ``step_in_backward`` (``lowprec.optim.in_backward``)."""
    return importlib.util.find_spec("lowprec.optim.in_backward") is not None


def _src_root() -> str:
    return str(Path(__file__).resolve().parents[2])  # (src/lowprec/cli/this file -> src)


def probe(
    recipe_name: str,
    optimizer_name: str = "adamw",
    *,
    in_backward: bool | None = None,
    depth: int = DEFAULTS["depth"],
    width: int = DEFAULTS["width"],
    batch: int = DEFAULTS["batch"],
    warmup: int = DEFAULTS["warmup"],
    device: str = "cpu",
    timeout: float = 600.0,
) -> dict[str, Any]:
    """One configuration measured in a fresh process (``lowprec.cli.memory_probe.run``'s dict).

    Returns:
        The probe's dict, or ``{"recipe", "optimizer", "in_backward", "error"}`` where the
        process failed, timed out or answered no JSON.
    """
    flag = {None: "recipe", True: "yes", False: "no"}[in_backward]
    cmd = [sys.executable, "-m", "lowprec.cli.memory_probe", "--recipe", recipe_name,
           "--optimizer", optimizer_name, "--in-backward", flag, "--depth", str(depth),
           "--width", str(width), "--batch", str(batch), "--warmup", str(warmup),
           "--device", device]
    env = dict(os.environ)
    env.setdefault("MALLOC_MMAP_THRESHOLD_", str(MMAP_THRESHOLD))
    # BF16 products as torch computes them natively (products.BF16_PRODUCTS_ENV): the peak a
    # recipe reaches on BF16 hardware, not with the FP32 copies of the operands that emulating
    # them on a CPU without a fast BF16 matmul makes (which hid in-backward's saving).
    env.setdefault("LOWPREC_BF16_PRODUCTS", "native")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_src_root(), env.get("PYTHONPATH")) if p)
    failed = {"recipe": recipe_name, "optimizer": optimizer_name, "in_backward": in_backward}
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                              check=False)
    except subprocess.TimeoutExpired:
        return {**failed, "error": f"the probe ran past its {timeout:g} s limit"}
    lines = done.stdout.strip().splitlines()
    try:
        out = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        out = None
    if not isinstance(out, dict):
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {**failed, "error": f"the probe exited with status {done.returncode}: {tail}"}
    if "error" in out:
        return {**failed, "error": out["error"]}
    return out


def peak_table(
    optimizer_name: str = "adamw",
    *,
    recipe_names: Iterable[str] | None = None,
    modes: Iterable[bool] = (False, True),
    depth: int = DEFAULTS["depth"],
    width: int = DEFAULTS["width"],
    batch: int = DEFAULTS["batch"],
    warmup: int = DEFAULTS["warmup"],
    device: str = "cpu",
    timeout: float = 600.0,
    progress: Callable[[str, bool], None] | None = None,
) -> list[dict[str, Any]]:
    """Every recipe's step measured without and with ``step_in_backward``, one process each.

    Args:
        optimizer_name: The optimizer (default: ``"adamw"``).
        recipe_names: Recipes to run (default: None, all of ``recipes.RECIPES``).
        modes: ``step_in_backward`` off and on (default: both); an "on" run is left out, with
            a row saying why, where the recipe refuses it (a loss scaler) or this lowprec has no
            ``step_in_backward``.
        depth, width, batch, warmup, device: The probe's (``memory_probe.run``).
        timeout: Seconds each process may take.
        progress: Called with ``(recipe, in_backward)`` before each run (default: None).

    Returns:
        One dict per run: the probe's dict (or its error) with ``"recipe_in_backward"`` (the
        recipe's own choice) and, on a row with ``step_in_backward``, ``"saved"``: the measured
        peak of the same recipe without it minus this one's, in bytes (None where either
        failed).
    """
    from lowprec import recipes

    names = tuple(recipe_names) if recipe_names is not None else recipes.RECIPES
    modes = tuple(modes)
    available = in_backward_available()
    rows: list[dict[str, Any]] = []
    for name in names:
        recipe = recipes.get(name)
        own = bool(getattr(recipe, "step_in_backward", False))
        by_mode: dict[bool, dict[str, Any]] = {}
        for mode in modes:
            refused = in_backward_refusal(recipe) if mode else None
            if mode and not available:
                refused = "this lowprec has no step_in_backward"
            if refused is not None:  # (not run: it would be refused)
                row = {"recipe": name, "optimizer": optimizer_name, "in_backward": True,
                       "error": refused}
            else:
                if progress is not None:
                    progress(name, mode)
                row = probe(name, optimizer_name, in_backward=mode, depth=depth, width=width,
                            batch=batch, warmup=warmup, device=device, timeout=timeout)
            row["recipe_in_backward"] = own
            by_mode[mode] = row
            rows.append(row)
        on, off = by_mode.get(True), by_mode.get(False)
        if on is not None:
            on["saved"] = (off["measured"]["over_baseline"] - on["measured"]["over_baseline"]
                           if off is not None and "error" not in off and "error" not in on
                           else None)
    return rows


def _find(rows: list[dict[str, Any]], recipe: str, mode: bool) -> dict[str, Any] | None:
    for r in rows:
        if r["recipe"] == recipe and r["in_backward"] == mode and "error" not in r:
            return r
    return None


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's checks on ``peak_table``'s rows, for AdamW's ``TARGET_RECIPE`` (BF16 + Kahan
    weights, 8-bit moments); none for another optimizer or without its rows.

    * with ``step_in_backward``: at most ``TARGET_BYTES_PER_PARAM`` bytes per parameter
      accounted at the peak;
    * its measured peak with ``step_in_backward`` below the one without it by at least the
      gradient bytes that ``step_in_backward`` frees: the gradients accounted at the peak
      without it less those with it (the largest parameter's gradient is alive while that
      parameter is stepped), within ``SAVING_TOLERANCE`` of them (resident memory moves by a
      few hundred KiB between runs). The detail gives the share of all gradient bytes too.

    Returns:
        ``{"name", "value", "limit", "passed", "detail"}`` per check.
    """
    out: list[dict[str, Any]] = []
    if not rows or rows[0].get("optimizer") != "adamw":
        return out
    on, off = _find(rows, TARGET_RECIPE, True), _find(rows, TARGET_RECIPE, False)
    if on is not None:
        value = on["accounted_per_param"]["total"]
        out.append({"name": f"{TARGET_RECIPE} + step_in_backward, accounted at the peak",
                    "value": value, "limit": TARGET_BYTES_PER_PARAM,
                    "passed": value <= TARGET_BYTES_PER_PARAM,
                    "detail": f"{value:.3f} B/param (at most {TARGET_BYTES_PER_PARAM:g})"})
    if on is not None and off is not None and on.get("saved") is not None:
        grads, kept = off["accounted"]["grads"], on["accounted"]["grads"]
        freed, saved = grads - kept, on["saved"]
        share = grads / off["accounted"]["total"]
        out.append({
            "name": f"{TARGET_RECIPE}: measured peak lowered by step_in_backward",
            "value": saved, "limit": freed, "passed": saved >= (1 - SAVING_TOLERANCE) * freed,
            "detail": f"{saved / 2**20:.1f} MiB saved, the gradients freed "
                      f"{freed / 2**20:.1f} MiB (all of them {grads / 2**20:.1f} MiB, "
                      f"{share:.1%} of the tensors at the peak without it; the largest "
                      f"parameter's {kept / 2**20:.1f} MiB is alive while it is stepped): "
                      f"{saved / grads:.1%} of all gradient bytes"})
    return out
