"""What ``compare``'s records mean: gaps to FP32, rows over the seeds, the noise floor, the choice.

``add_relative`` pairs each record with FP32's of the same seed (eval gap, share of FP32's loss
drop, speed-up); ``summarize`` makes one row per recipe over the seeds (means, spreads, the mean
loss curve), ``noise_floor`` is FP32's own seed-to-seed spread, and ``recommend`` picks the
cheapest recipe that trains as well as FP32, never on the strength of a run too short to show
what lost updates cost (``config.LOST_UPDATES_LIMIT``). Torch-free: plain numbers in and out.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from lowprec.comparison.config import DEFAULT_TOLERANCE, LOST_UPDATES_LIMIT

__all__ = ["WARMUP_STEPS", "add_relative", "lost_by_parameter", "noise_floor", "recommend",
           "summarize"]

#: Steps left out of the step times: the fused step compiles its kernels in the first step; the
#: second still runs ~7% above the steady steps (the default task, bf16-kahan on a Zen 4 CPU:
#: 50 ms against 46; fp32's as its steady ones), the allocator and caches warming.
WARMUP_STEPS = 2


def _steady(xs: Sequence[Any]) -> list[Any]:
    """``xs`` without the first ``WARMUP_STEPS`` steps (the last one where no other is left)."""
    return list(xs[WARMUP_STEPS:]) if len(xs) > WARMUP_STEPS else list(xs[-1:])


def _quartiles(xs: Sequence[float]) -> list[float] | None:
    """The 25th and 75th percentiles of ``xs`` (None for fewer than two values)."""
    if len(xs) < 2:
        return None
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return [q[0], q[2]]


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def add_relative(records: list[dict[str, Any]]) -> None:
    """Fill ``eval_gap``, ``drop_share``, ``speedup`` and ``speedup_iqr`` against the FP32 record
    of the same seed, where there is one (None elsewhere).

    ``eval_gap``: the eval loss relative to FP32's. ``drop_share``: the recipe's eval-loss drop
    over its run (``eval_before - eval_loss``) as a share of FP32's. The speed-up is the median
    over the steps of FP32's step time over the recipe's at the same step (the same round of
    ``compare``), the first ``WARMUP_STEPS`` left out."""
    refs = {r.get("seed"): r for r in records if r["recipe"] == "fp32"}
    for r in records:
        ref = refs.get(r.get("seed"))
        if ref is None:
            r["eval_gap"], r["drop_share"], r["speedup"], r["speedup_iqr"] = None, None, None, None
            continue
        r["eval_gap"] = (r["eval_loss"] - ref["eval_loss"]) / ref["eval_loss"]
        r["drop_share"] = None
        before, ref_before = r.get("eval_before"), ref.get("eval_before")
        if _finite(before) and _finite(ref_before):
            ref_drop = ref_before - ref["eval_loss"]
            if ref_drop > 0 and math.isfinite(r["eval_loss"]):
                r["drop_share"] = (before - r["eval_loss"]) / ref_drop
        pairs = list(zip(ref["step_times_s"], r["step_times_s"], strict=False))
        ratios = [a / b for a, b in _steady(pairs)]
        r["speedup"] = statistics.median(ratios) if ratios else None
        r["speedup_iqr"] = _quartiles(ratios)


def _mean(values: Sequence[Any]) -> float | None:
    """The mean of ``values``; NaN where one is not finite (a diverged seed), None for none."""
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    return statistics.fmean(vals) if all(_finite(v) for v in vals) else math.nan


def _std(values: Sequence[Any]) -> float | None:
    """The sample standard deviation of ``values``; None for fewer than two or a non-finite one."""
    vals: list[float] = [v for v in values if v is not None]
    if len(vals) < 2 or not all(_finite(v) for v in vals):
        return None
    return statistics.stdev(vals)


#: The fields ``summarize`` averages over the seeds (and gives a ``<field>_std`` spread).
AVERAGED = ("eval_before", "final_loss", "eval_loss", "eval_gap", "drop_share",
            "lost_update_fraction", "stored_unchanged_fraction")


def summarize(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per recipe (in the records' order) over its seeds, with a record's fields.

    ``AVERAGED`` fields are means over the seeds, each with ``<field>_std``, its sample standard
    deviation (None for one seed); the gap and drop share are the means of each seed's own
    (paired with FP32 on that seed). Step time and speed-up are medians of the seeds'; their
    IQRs the medians of the seeds' quartiles; ``losses`` the mean curve (for the plot);
    ``skipped_steps`` and ``warmup_s`` totals; ``seeds`` the seeds. One seed gives its record's
    values."""
    rows: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        rows.setdefault(r["recipe"], []).append(r)
    out = []
    for runs in rows.values():
        first = runs[0]
        row = {k: v for k, v in first.items() if k not in ("step_times_s", "seed")}
        row["seeds"] = [r.get("seed") for r in runs]
        for key in AVERAGED:
            values = [r.get(key) for r in runs]
            row[key] = _mean(values)
            row[f"{key}_std"] = _std(values)
        row["step_time_s"] = statistics.median(r["step_time_s"] for r in runs)
        speedups: list[float] = [r["speedup"] for r in runs if r.get("speedup") is not None]
        row["speedup"] = statistics.median(speedups) if speedups else None
        for key in ("speedup_iqr", "step_time_iqr_s"):
            iqrs: list[Sequence[float]] = [r[key] for r in runs if r.get(key)]
            row[key] = ([statistics.median(q[0] for q in iqrs),
                         statistics.median(q[1] for q in iqrs)] if iqrs else None)
        length = min(len(r["losses"]) for r in runs)
        row["losses"] = [statistics.fmean(r["losses"][i] for r in runs) for i in range(length)]
        row["parameters"] = _mean_parameters(runs)
        row["skipped_steps"] = sum(r["skipped_steps"] for r in runs)
        row["warmup_s"] = sum(r.get("warmup_s") or 0.0 for r in runs)
        out.append(row)
    return out


def _mean_parameters(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """The runs' per-parameter records (``run._parameters``) with their lost fractions averaged
    over the seeds; None where a run has none (its updates were not monitored)."""
    if not runs or any(not r.get("parameters") for r in runs):
        return None
    out = []
    for i, p in enumerate(runs[0]["parameters"]):
        mean = dict(p)
        for key in ("lost_fraction", "stored_unchanged_fraction"):
            mean[key] = statistics.fmean(r["parameters"][i][key] for r in runs)
        out.append(mean)
    return out


def lost_by_parameter(rows: Sequence[dict[str, Any]], *, top: int = 8) -> dict[str, Any] | None:
    """Where the updates are lost, parameter by parameter (``summarize``'s rows, or one seed's
    records).

    The baseline is plain 16-bit training (the first row with BF16 or FP16 weights, round to
    nearest and no master: ``bf16``), else the row that lost most. Returns ``{"baseline": its
    name, "parameters": the ``top`` parameters it loses the largest share of the model's updates
    in (lost fraction times share of the elements), each with ``name``, ``share`` and ``lost``
    (recipe -> the fraction of that parameter's updates the recipe lost), "keep_fp32": the names
    of parameters that every recipe with a master (split, Kahan, an FP32 copy) still loses over
    ``LOST_UPDATES_LIMIT`` of: only FP32 weights keep them (a recipe's ``keep_fp32`` takes their
    module types or names)}``; None where no row has per-parameter records."""
    rows = [r for r in rows if r.get("parameters")]
    if not rows:
        return None
    plain = [r for r in rows if r.get("weights") in ("bfloat16", "float16")
             and r.get("master") == "none" and r.get("rounding") == "nearest"]
    base = plain[0] if plain else max(rows, key=lambda r: r.get("lost_update_fraction") or 0.0)
    lost = {r["recipe"]: {p["name"]: p["lost_fraction"] for p in r["parameters"]} for r in rows}
    ranked = sorted(base["parameters"], key=lambda p: -p["lost_fraction"] * p["share"])
    masters = [r["recipe"] for r in rows if r.get("weights") in ("bfloat16", "float16")
               and r.get("master") in ("split", "kahan", "fp32")]
    keep = [p["name"] for p in base["parameters"]
            if masters and all(lost[m].get(p["name"], 0.0) > LOST_UPDATES_LIMIT for m in masters)]
    return {
        "baseline": base["recipe"],
        "parameters": [{"name": p["name"], "share": p["share"],
                        "lost": {name: by.get(p["name"]) for name, by in lost.items()}}
                       for p in ranked[:top] if p["lost_fraction"] > 0],
        "keep_fp32": keep,
    }


def noise_floor(records: Sequence[dict[str, Any]]) -> float | None:
    """FP32's seed-to-seed spread: the sample standard deviation of its eval losses over the
    seeds, relative to their mean; None with fewer than two finite FP32 runs. A gap to FP32
    smaller than this is within what another seed would change."""
    losses: list[float] = [r["eval_loss"] for r in records
                           if r["recipe"] == "fp32" and _finite(r["eval_loss"])]
    if len(losses) < 2:
        return None
    return statistics.stdev(losses) / statistics.fmean(losses)


def _lost_rule(r: dict[str, Any]) -> str | None:
    """Why the lost-update rule refuses ``r`` (None where it does not): a round-to-nearest recipe
    losing over ``LOST_UPDATES_LIMIT`` of its updates, or one with 16-bit weights and no master
    whose losses were not measured. Stochastic rounding is exempt: a weight it leaves unchanged
    at a step keeps the update in expectation (it moves by a whole ulp as often as the update's
    share of one), so its unchanged count is not a loss."""
    if r.get("rounding") == "stochastic":
        return None
    lost = r.get("lost_update_fraction")
    if lost is None:
        if r.get("master") == "none" and r.get("weights") in ("bfloat16", "float16"):
            return ("its lost updates were not measured (--monitor-every 0), and with 16-bit "
                    "weights and no master a small loss gap may hide them")
        return None
    if lost > LOST_UPDATES_LIMIT:
        return f"round-to-nearest lost {lost:.0%} of its updates (over {LOST_UPDATES_LIMIT:.0%})"
    return None


def recommend(rows: Sequence[dict[str, Any]], tolerance: float = DEFAULT_TOLERANCE, *,
              floor: float | None = None) -> dict[str, Any]:
    """The cheapest recipe that trains as well as FP32 on this run, and why each other lost.

    ``rows``: records of one seed or ``summarize``'s rows (with ``add_relative``'s fields). A
    recipe qualifies when its eval gap to FP32 is finite and at most the threshold, the larger
    of ``tolerance`` (a fraction) and the noise ``floor`` (``noise_floor``), and the lost-update
    rule does not refuse it (``_lost_rule``: never a round-to-nearest recipe losing over 10% of its
    updates, however small its gap). Among those the fewest bytes per parameter wins, then the
    shorter median step.

    Returns:
        ``{"recipe": name or None, "tolerance", "noise_floor", "threshold", "reason",
        "others": {name: why not}, "short_run": [names]}``; ``recipe`` is None (with the
        reason) where there is no FP32 run or none qualifies. ``short_run`` names the recipes
        whose gap was within the threshold but which the lost-update rule refused: the run was
        too short to separate them from FP32 by loss.
    """
    threshold = max(tolerance, floor or 0.0)
    out: dict[str, Any] = {"recipe": None, "tolerance": tolerance, "noise_floor": floor,
                           "threshold": threshold, "others": {}, "short_run": []}
    if not any(r["recipe"] == "fp32" for r in rows):
        out["reason"] = "no fp32 run to compare with: add fp32 to --recipes"
        return out

    def close(r: dict[str, Any]) -> bool:
        gap = r.get("eval_gap")
        return gap is not None and math.isfinite(gap) and gap <= threshold

    fitting = sorted((r for r in rows if close(r) and _lost_rule(r) is None),
                     key=lambda r: (r["bytes_per_param"]["total"], r["step_time_s"]))
    within = f"within {threshold:.2%}" + (" (the noise floor)" if threshold > tolerance else "")
    best = fitting[0] if fitting else None
    if best is None:
        out["reason"] = f"no recipe ended {within} of fp32's eval loss"
    else:
        b, t = best["bytes_per_param"]["total"], best["step_time_s"]
        out["recipe"] = best["recipe"]
        out["reason"] = (f"eval loss {best['eval_gap']:+.2%} vs fp32 ({within}), "
                         f"{b:.1f} B/param, {1e3 * t:.0f} ms/step")
    for r in rows:
        if r is best:
            continue
        gap = r.get("eval_gap")
        refused = _lost_rule(r)
        if gap is None or not math.isfinite(gap):
            why = "diverged"
        elif refused is not None and close(r):
            why = (f"eval loss {gap:+.2%} vs fp32, but {refused}: a run this short cannot show "
                   "what that costs, and longer runs and smaller learning rates fall behind")
            out["short_run"].append(r["recipe"])
        elif refused is not None:
            why = f"eval loss {gap:+.2%} vs fp32, beyond {threshold:.2%}; {refused}"
        elif gap > threshold:
            why = f"eval loss {gap:+.2%} vs fp32, beyond {threshold:.2%}"
        elif r["bytes_per_param"]["total"] > b:
            why = f"{r['bytes_per_param']['total']:.1f} B/param against {b:.1f}"
        else:
            why = f"as lean, but slower: {1e3 * r['step_time_s']:.0f} against {1e3 * t:.0f} ms/step"
        out["others"][r["recipe"]] = why
    return out
