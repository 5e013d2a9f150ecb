"""Which 8-bit code keeps an optimizer's moments best: measured on ``lowprec compare``'s task.

``state_dtype="8bit"`` keeps each moment as one byte per element and a scale per block of 256
(``lowprec.optim.qstate``). What a byte means is the choice measured here, each on the built-in
task of ``lowprec compare`` (the same model, initial weights, batches and schedule), with BF16
weights and a Kahan compensation, against FP32 training and BF16 + Kahan with BF16 moments:

* ``power`` (lowprec's, ``qstate``): codes on a power-law scale of the block's largest magnitude,
  ``(k / 127)**2`` signed, ``(k / 255)**4`` for non-negative buffers;
* ``float8``: 8-bit floats, ``float8_e4m3fn`` for signed buffers and ``float8_e5m2`` for
  non-negative ones;
* ``dynamic``: the dynamic (tree) map of Dettmers et al. 2022, as described in the paper: a
  sign, a decimal exponent given by the run of leading zero bits, then a linear fraction in
  [0.1, 1] taking the remaining bits (written here from the paper, codes found by nearest
  value);
* ``linear``: the block's largest magnitude divided into 127 (signed) or 255 steps.

Every map is applied by the same table lookup here, nearest value per element (eager step:
the formats differ in their tables only). Prints the eval loss of each and its gap to FP32.

    python benchmarks/state_formats.py                     # AdamW, 400 steps (~15 min)
    python benchmarks/state_formats.py --optimizer sgd --formats power,float8
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from lowprec import compare as compare_mod
from lowprec.config import CompareConfig
from lowprec.optim import qstate


def _dynamic_values(signed: bool) -> torch.Tensor:
    """The 256 values of a dynamic tree map (Dettmers et al. 2022, section 2): for decimal
    exponent e = 0..6 the fractions at that level, 2**e of them per sign (2**(e+1) unsigned,
    which has no sign bit), midpoints of a linear grid on [0.1, 1], times 10**(e - 6); plus 0
    and 1."""
    values = [0.0, 1.0]
    for e in range(7):
        n = 2 ** e if signed else 2 ** (e + 1)
        grid = torch.linspace(0.1, 1.0, n + 1, dtype=torch.float64)
        mids = ((grid[:-1] + grid[1:]) / 2 * 10.0 ** (e - 6)).tolist()
        values += mids + ([-v for v in mids] if signed else [])
    return torch.tensor(sorted(values[:256]), dtype=torch.float32)


def _linear_values(signed: bool) -> torch.Tensor:
    if signed:
        return torch.arange(-127, 129, dtype=torch.float32).clamp(max=127) / 127
    return torch.arange(256, dtype=torch.float32) / 255


def _float8_values(signed: bool) -> torch.Tensor:
    """The finite values of ``float8_e4m3fn`` (signed buffers) or ``float8_e5m2``
    (non-negative ones)."""
    dtype = torch.float8_e4m3fn if signed else torch.float8_e5m2
    vals = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    vals = vals[vals.isfinite() & ((vals >= 0) | signed)]
    return torch.unique(vals) / vals.abs().max()


FORMATS: dict[str, Callable[[bool], torch.Tensor]] = {
    "float8": _float8_values, "dynamic": _dynamic_values, "linear": _linear_values,
}


def table_codec(values_of: Callable[[bool], torch.Tensor]):
    """``encode``/``decode`` replacements that map each block, scaled by its largest magnitude,
    to the nearest of a table's 256 values (in [-1, 1]), the code being its index."""
    tables = {s: torch.sort(values_of(s)).values for s in (True, False)}

    def encode(x, signed):
        vals = tables[signed]
        scale = x.abs().amax(dim=-1, keepdim=True)
        y = x / torch.where(scale > 0, scale, torch.ones_like(scale))
        mids = (vals[1:] + vals[:-1]) / 2
        codes = torch.bucketize(y.contiguous(), mids)
        return codes.to(torch.uint8), scale

    def decode(codes, scale, signed):
        return tables[signed][codes.long()] * scale

    return encode, decode


def run(fmt: str, recipes: tuple[str, ...], args: argparse.Namespace) -> list[dict]:
    saved = qstate.encode, qstate.decode
    if fmt != "power":  # (the library's own format needs no replacement)
        qstate.encode, qstate.decode = table_codec(FORMATS[fmt])
    try:
        cfg = CompareConfig(recipes=recipes, optimizer=args.optimizer, steps=args.steps,
                            fused=False, monitor_every=0, threads=args.threads)
        return compare_mod.compare(cfg)
    finally:
        qstate.encode, qstate.decode = saved


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--optimizer", default="adamw", choices=("adamw", "sgd", "lamb", "adagrad"))
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--formats", default="power,float8,dynamic,linear")
    args = p.parse_args(argv)
    start = time.perf_counter()
    refs = {r["recipe"]: r for r in run("power", ("fp32", "bf16-kahan"), args)}
    fp32 = refs["fp32"]["eval_loss"]
    rows = [("fp32 (reference)", fp32), ("bf16-kahan, BF16 moments", refs["bf16-kahan"]["eval_loss"])]
    for fmt in args.formats.split(","):
        (rec,) = run(fmt, ("bf16-kahan-8bit",), args)
        rows.append((f"bf16-kahan, 8-bit moments: {fmt}", rec["eval_loss"]))
    print(f"{args.optimizer}, {args.steps} steps, eager step, {time.perf_counter() - start:.0f} s")
    print("| run | eval loss | gap vs fp32 |\n|---|---|---|")
    for name, loss in rows:
        print(f"| {name} | {loss:.4f} | {100 * (loss / fp32 - 1):+.2f}% |")


if __name__ == "__main__":
    main()
