"""Small numerical experiments: why low-precision training needs care (``lowprec numerics``).

Each function runs one experiment and returns plain dicts, lists and floats (JSON-ready); nothing
is printed.

- ``swamping``: add a small number to a large one many times. Round-to-nearest BF16 drops every
  addition below half an ulp (the sum never moves); a Kahan compensation, a split trail or
  stochastic rounding keep them. The low-precision methods run the optimizers' own storage code
  (``lowprec.optim.storage``), so what is shown is what the optimizers do.
- ``fp16_underflow``: gradient-sized numbers cast to FP16 with and without loss scaling: how many
  flush to zero, how many land in the subnormal range, and the relative error of the round trip.
- ``dfp16_errors``: the error of DFP-16 quantization (``lowprec.dfp``) per rounding mode, in units
  of the shared exponent.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import torch

from lowprec.numerics import round_stochastic, split
from lowprec.optim.storage import STORAGES

if TYPE_CHECKING:
    from lowprec.dfp import Rounding

__all__ = ["dfp16_errors", "fp16_underflow", "swamping"]

_FP16_SMALLEST_NORMAL = 2.0**-14


def _check_number(name: str, value: Any, *, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}.")
    value = float(value)
    if not math.isfinite(value) or (positive and value <= 0):
        raise ValueError(f"{name} must be finite{' and > 0' if positive else ''}, got {value}.")
    return value


def _check_count(name: str, value: Any, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}.")
    return value


def _errors(final: float, exact: float) -> dict[str, float]:
    err = abs(final - exact)
    return {"abs_error": err, "relative_error": err / abs(exact) if exact else err}


@torch.no_grad()
def swamping(
    *,
    big: float = 1.0,
    small: float = 1e-4,
    steps: int = 1000,
    seed: int = 0,
    sr_trials: int = 64,
) -> dict[str, Any]:
    """Add ``small`` to ``big`` ``steps`` times, stored five ways.

    Each step is what an optimizer step does to one weight: load the FP32 value, add the FP32
    update ``small``, store. The methods (named as the recipes):

    - ``"fp32"``: an FP32 value.
    - ``"bf16"``: a BF16 value, rounded to nearest (``master="none"``).
    - ``"bf16-kahan"``: a BF16 value and a BF16 compensation (``master="kahan"``).
    - ``"bf16-split"``: a BF16 top and an int16 trail, an exact FP32 value (``master="split"``).
    - ``"bf16-sr"``: a BF16 value, stochastically rounded (``numerics.round_stochastic`` with a
      seeded generator); run ``sr_trials`` times independently.

    Args:
        big: The starting value (default: 1.0). The methods start from it rounded to their
            format: FP32, split and Kahan (value plus compensation) from ``float32(big)``, BF16
            and stochastic rounding from ``bfloat16(big)``.
        small: The increment (default: 1e-4), used as an FP32 number.
        steps: Number of additions (default: 1000).
        seed: Seed of the stochastic-rounding generator (default: 0).
        sr_trials: Independent stochastic-rounding runs, to show the mean is right (default: 64).

    Returns:
        ``{"big", "small", "steps", "exact", "methods"}``: ``exact`` is ``big + steps * small``
        in float64; ``methods`` maps each method name to ``{"final", "stored", "abs_error",
        "relative_error"}`` where ``final`` is the value the method holds (the master: value plus
        compensation, top joined with trail), ``stored`` the BF16/FP32 value a model would compute
        with, and the errors are of ``final`` against ``exact``. ``"bf16-sr"`` also has
        ``"trials"``, ``"mean_final"`` and ``"mean_relative_error"`` (its ``final`` is the first
        trial's).
    """
    big = _check_number("big", big)
    small = _check_number("small", small)
    steps = _check_count("steps", steps, minimum=0)
    seed = _check_count("seed", seed, minimum=0)
    sr_trials = _check_count("sr_trials", sr_trials, minimum=1)
    exact = big + steps * small
    bf16 = torch.bfloat16
    start = torch.tensor([big], dtype=torch.float32)
    inc = torch.tensor(small, dtype=torch.float32)

    def run(storage_name: str, param: torch.Tensor,
            bufs: dict[str, torch.Tensor]) -> tuple[float, float]:
        storage = STORAGES[storage_name]
        for _ in range(steps):
            param, bufs = storage.store(storage.load(param, bufs) + inc, param, bufs)
        return float(storage.load(param, bufs)[0]), float(param[0])

    results: dict[str, tuple[float, float]] = {}
    results["fp32"] = run("none", start.clone(), {})
    results["bf16"] = run("none", start.to(bf16), {})
    top = start.to(bf16)
    results["bf16-kahan"] = run("kahan", top, {"compensation": (start - top.float()).to(bf16)})
    top, trail = split(start)
    results["bf16-split"] = run("split", top, {"trail": trail})

    gen = torch.Generator().manual_seed(seed)
    sr = start.to(bf16).expand(sr_trials).clone()
    for _ in range(steps):
        sr = round_stochastic(sr.float() + inc, bf16, generator=gen)
    sr_values = sr.double()
    results["bf16-sr"] = (float(sr_values[0]), float(sr_values[0]))

    methods: dict[str, dict[str, Any]] = {}
    for name, (final, stored) in results.items():
        methods[name] = {"final": final, "stored": stored, **_errors(final, exact)}
    mean = float(sr_values.mean())
    methods["bf16-sr"].update(
        trials=sr_trials,
        mean_final=mean,
        mean_relative_error=_errors(mean, exact)["relative_error"],
    )
    return {"big": big, "small": small, "steps": steps, "exact": exact, "methods": methods}


@torch.no_grad()
def fp16_underflow(
    *,
    scales: Sequence[float] = (1, 2**8, 2**16),
    seed: int = 0,
    n: int = 100_000,
    low: float = 2.0**-34,
    high: float = 2.0**-4,
) -> dict[str, Any]:
    """Cast gradient-sized magnitudes to FP16 at several loss scales.

    The magnitudes are log-uniform on ``[low, high]`` (drawn in float64, then rounded to FP32 as
    gradients are). At scale ``S`` each ``g`` becomes ``float16(g * S)`` and comes back as
    ``float16(g * S) / S`` (in float64).

    Args:
        scales: The loss scales to try (default: (1, 2**8, 2**16)).
        seed: Seed of the sample (default: 0).
        n: Sample size (default: 100_000).
        low: Smallest magnitude (default: 2**-34).
        high: Largest magnitude (default: 2**-4).

    Returns:
        ``{"n", "seed", "low", "high", "rows"}`` with one row per scale: ``"scale"``,
        ``"flushed"`` (fraction that became 0), ``"subnormal"`` (fraction that became a nonzero
        FP16 subnormal, below 2**-14), ``"overflow"`` (fraction that became inf), and over the
        values that did not overflow the round trip's relative error ``|back - g| / g``:
        ``"mean_relative_error"``, ``"median_relative_error"`` and ``"max_relative_error"``
        (a flushed value has error 1).
    """
    scale_list = [_check_number("scale", s, positive=True) for s in scales]
    if not scale_list:
        raise ValueError("scales must hold at least one loss scale, e.g. (1, 2**16).")
    seed = _check_count("seed", seed, minimum=0)
    n = _check_count("n", n, minimum=1)
    low = _check_number("low", low, positive=True)
    high = _check_number("high", high, positive=True)
    if not low < high:
        raise ValueError(f"low must be below high, got low={low}, high={high}.")
    gen = torch.Generator().manual_seed(seed)
    e = torch.empty(n, dtype=torch.float64).uniform_(math.log2(low), math.log2(high), generator=gen)
    g = torch.exp2(e).float().double()  # gradients are FP32 numbers
    rows = []
    for scale in scale_list:
        h = (g * scale).float().half()  # the scaled FP32 gradient stored in FP16
        back = h.double() / scale
        finite = torch.isfinite(h)
        rel = ((back - g).abs() / g)[finite]
        rows.append({
            "scale": scale,
            "flushed": float((h == 0).double().mean()),
            "subnormal": float(((h != 0) & (h.abs() < _FP16_SMALLEST_NORMAL)).double().mean()),
            "overflow": float((~finite).double().mean()),
            "mean_relative_error": float(rel.mean()) if rel.numel() else math.nan,
            "median_relative_error": float(rel.median()) if rel.numel() else math.nan,
            "max_relative_error": float(rel.max()) if rel.numel() else math.nan,
        })
    return {"n": n, "seed": seed, "low": low, "high": high, "rows": rows}


@torch.no_grad()
def dfp16_errors(*, n: int = 10_000, seed: int = 0) -> dict[str, Any]:
    """The error of DFP-16 quantization per rounding mode, in units of the shared exponent.

    Args:
        n: Sample size: standard normal FP32 values (default: 10_000).
        seed: Seed of the sample and of stochastic rounding (default: 0).

    Returns:
        ``{"n", "seed", "bits", "exponent", "modes"}`` where ``modes`` maps each rounding mode of
        ``lowprec.dfp.ROUNDING_MODES`` to ``{"max_abs_error", "mean_error", "mean_abs_error"}``
        of ``(dequantize(quantize(x)) - x) / 2**exponent``; ``mean_error`` shows a mode's bias.
    """
    from lowprec import dfp

    n = _check_count("n", n, minimum=1)
    seed = _check_count("seed", seed, minimum=0)
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)
    out: dict[str, dict[str, float]] = {}
    exponent = None
    for mode in dfp.ROUNDING_MODES:
        # (ROUNDING_MODES, a tuple of str, holds exactly the values of the Rounding literal)
        q = dfp.quantize(x, bits=16, rounding=cast("Rounding", mode),
                         generator=torch.Generator().manual_seed(seed))
        exponent = q.exponent
        # DFP-16 values are exact in FP32 and FP64; the division by a power of two is exact.
        err = (q.dequantize().double() - x.double()) / math.ldexp(1.0, exponent)
        out[mode] = {
            "max_abs_error": float(err.abs().max()),
            "mean_error": float(err.mean()),
            "mean_abs_error": float(err.abs().mean()),
        }
    return {"n": n, "seed": seed, "bits": 16, "exponent": exponent, "modes": out}
