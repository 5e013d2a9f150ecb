"""The picture of ``lowprec compare``: ``plot_losses`` draws its records (matplotlib, headless).

Three panels: each recipe's gap to FP32's training loss over the steps, the loss curves over the
second half of training, and each recipe placed by bytes per parameter and step time with its
eval-loss gap; ``_labels_apart`` keeps the labels of nearby points from overlapping. Imports
matplotlib only when it draws, and nothing of torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["plot_losses"]


def plot_losses(records: Sequence[dict[str, Any]], path: Path, *, title: str) -> None:
    """The comparison as a picture, three panels: each recipe's gap to FP32's training loss over
    the steps (in %, each line labelled at its end, so lines near 0 stay apart); the loss curves
    over the second half of training, where they differ; and each recipe placed by bytes per
    parameter and step time, marked with its eval-loss gap (the cost half of the decision)."""
    import matplotlib  # (ImportError without the cli extra: the command says so)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def ema(values: Sequence[float]) -> list[float]:
        out, avg = [], None
        for v in values:
            if math.isfinite(v):
                avg = v if avg is None else 0.95 * avg + 0.05 * v
            out.append(math.nan if avg is None else avg)
        return out

    smooth = {r["recipe"]: ema(r["losses"]) for r in records}
    ref = smooth.get("fp32")
    colors = {r["recipe"]: plt.get_cmap("tab10")(i % 10) for i, r in enumerate(records)}
    fig, (gap, tail, cost) = plt.subplots(1, 3, figsize=(17, 5))
    fig.suptitle(title, fontsize=11)
    ends: list[tuple[float, float, str, Any]] = []  # the gap lines' last points and labels
    n = max(len(v) for v in smooth.values())
    start = n // 5  # the first fifth (warm-up, fast early descent) would set every scale
    for r in records:
        name = r["recipe"]
        style = {"color": colors[name], "lw": 2.2 if name == "fp32" else 1.4,
                 "ls": "--" if name == "fp32" else "-"}
        steps = list(range(1, len(smooth[name]) + 1))
        half = len(steps) // 2
        tail.plot(steps[half:], smooth[name][half:], label=name, **style)
        if ref is not None:
            pct = [100 * (a - b) / b for a, b in zip(smooth[name], ref, strict=False)]
            gap.plot(steps[start:len(pct)], pct[start:], label=name, **style)
            last = next((v for v in reversed(pct) if math.isfinite(v)), None)
            if last is not None:
                ends.append((len(pct), last, f"{name} {last:+.2f}%", colors[name]))
    if ref is not None:
        # A symmetric log scale: linear within +-0.05 %, logarithmic beyond, so that recipes a
        # few hundredths of a percent apart separate while a diverging one still fits.
        gap.set_yscale("symlog", linthresh=0.05, linscale=1.0)
        gap.axhline(0, color="black", lw=0.6)
        _labels_apart(gap, ends)
        gap.set(xlabel="step", ylabel="train loss vs fp32's, % (EMA 0.95)",
                title="gap to fp32 (above 0: worse), from step " + str(start + 1))
        gap.margins(x=0.22)
        gap.legend(fontsize=8, loc="upper left")
    else:
        gap.text(0.5, 0.5, "no fp32 run: add fp32 to --recipes", ha="center",
                 transform=gap.transAxes)
        gap.set_axis_off()
    tail.set(xlabel="step", ylabel="train loss (EMA 0.95)",
             title="training loss, second half")
    tail.legend(fontsize=8)
    points = []
    for r in records:
        name, b, t = r["recipe"], r["bytes_per_param"]["total"], r["step_time_s"]
        g = r.get("eval_gap")
        label = name if g is None or not math.isfinite(g) else f"{name}\n{100 * g:+.2f}%"
        cost.scatter([b], [1e3 * t], s=70, color=colors[name], zorder=3)
        points.append((b, 1e3 * t, label, colors[name]))
    cost.set(xlabel="bytes per parameter (measured)", ylabel="median step, ms",
             title="cost: bytes and time (label: eval loss vs fp32)")
    cost.margins(x=0.35, y=0.2)
    _labels_apart(cost, points, spacing=24)
    for ax in (gap, tail, cost):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)  # (an OSError goes to the caller: the command says so)
    finally:
        plt.close(fig)


def _labels_apart(ax: Any, points: Sequence[tuple[float, float, str, Any]], *,
                  spacing: float = 12) -> None:
    """Label each ``(x, y, text, color)`` just right of its point, moving labels up just enough
    that none overlaps another of about the same ``x`` (``spacing`` points apart on screen)."""
    ax.figure.canvas.draw()  # settle the limits and scales first
    points_per_pixel = 72 / ax.figure.dpi  # (the shifts are offsets in points)
    placed: list[tuple[float, float]] = []
    for x, y, text, color in sorted(points, key=lambda p: p[1]):
        px, py = ax.transData.transform((x, y)) * points_per_pixel
        shift = 0.0
        for qx, qy in placed:
            if abs(qx - px) < 60 and py + shift < qy + spacing:
                shift = qy + spacing - py
        placed.append((px, py + shift))
        ax.annotate(text, (x, y), xytext=(6, shift), textcoords="offset points", va="center",
                    fontsize=8, color=color)
