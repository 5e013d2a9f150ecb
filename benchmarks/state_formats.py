"""Which 8-bit or 4-bit code keeps an optimizer's moments best: measured on ``lowprec compare``'s task.

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

``--bits 4`` measures 4-bit candidates (``state_dtype="4bit"``) the same way, each named
``<signed map>+<unsigned map>@<block><f32|bf16>`` (``MAPS4``, ``DEFAULT4``): power-law codes
with 7 steps a sign (15 values) for signed buffers, 15 steps from zero or 16 without a zero for
non-negative ones (``upow4``, ``upow4nz``, ``upow3nz``), the 4-bit dynamic map and the linear
map without zero that torchao's 4-bit optimizers take (``dyn``, ``linnz``), at blocks of 256 or
128 with FP32 or BF16 scales (rounded up, so that no value exceeds its block's). Each runs
through the 8-bit state's path with its codes unpacked (packing changes no value) and
``qstate.BLOCK`` set to its block; the table gives each one's bytes per element of a moment.
Run several processes of one thread each on a shared machine (``--threads 1 --no-refs``):
two threads there lost most of their time waiting for each other.

    python benchmarks/state_formats.py                     # AdamW, 400 steps (~15 min)
    python benchmarks/state_formats.py --optimizer sgd --formats power,float8
    python benchmarks/state_formats.py --bits 4 --threads 1 --formats pow2+upow4nz@256f32
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from lowprec.comparison import compare as compare_mod
from lowprec.comparison.config import CompareConfig, ModelConfig
from lowprec.optim import qstate


def _dynamic_values(signed: bool, levels: int = 7) -> torch.Tensor:
    """The 2**(levels + 1) values of a dynamic tree map (Dettmers et al. 2022, section 2): for
    decimal exponent e = 0..levels-1 the fractions at that level, 2**e of them per sign
    (2**(e+1) unsigned, which has no sign bit), midpoints of a linear grid on [0.1, 1], times
    10**(e - levels + 1); plus 0 and 1. ``levels`` 7: the 8-bit map; 3: the 4-bit one (0,
    +-0.0055, +-0.0325, +-0.0775, +-0.21 .. +-0.89, 1) that torchao's 4-bit optimizers take
    for first moments."""
    values = [0.0, 1.0]
    for e in range(levels):
        n = 2 ** e if signed else 2 ** (e + 1)
        grid = torch.linspace(0.1, 1.0, n + 1, dtype=torch.float64)
        mids = ((grid[:-1] + grid[1:]) / 2 * 10.0 ** (e - levels + 1)).tolist()
        values += mids + ([-v for v in mids] if signed else [])
    return torch.tensor(sorted(values[:2 ** (levels + 1)]), dtype=torch.float32)


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


# ------------------------------------------------------------------ 4-bit candidates
#
# A 4-bit map: its values at scale 1 (at most 16, sorted) and the power of the root scale on
# which the nearest is taken (1: the nearest value).

def _signed_power(power: float, steps: int = 7) -> tuple[torch.Tensor, float]:
    """``sign * (k / steps)**power``, k = 0..steps: 2 * steps + 1 values (7: 15 of 16 codes)."""
    k = torch.arange(-steps, steps + 1, dtype=torch.float64) / steps
    return (k.sign() * k.abs() ** power).float(), power


def _unsigned_power(power: float, zero: bool = True) -> tuple[torch.Tensor, float]:
    """``(k / 15)**power``, k = 0..15, or without zero ``((k + 1) / 16)**power``."""
    k = torch.arange(16, dtype=torch.float64)
    k = k / 15 if zero else (k + 1) / 16
    return (k ** power).float(), power


MAPS4: dict[str, Callable[[], tuple[torch.Tensor, float]]] = {
    "pow2": lambda: _signed_power(2),
    "pow3": lambda: _signed_power(3),
    "dyn": lambda: (_dynamic_values(True, 3), 1.0),
    "upow4": lambda: _unsigned_power(4),
    "upow4nz": lambda: _unsigned_power(4, zero=False),
    "upow3nz": lambda: _unsigned_power(3, zero=False),
    "linnz": lambda: _unsigned_power(1, zero=False),
}


def _round_up_bf16(s: torch.Tensor) -> torch.Tensor:
    """The BF16 value at or above each (non-negative, finite) FP32 ``s``, as FP32."""
    bits = s.view(torch.int32)
    return ((bits + 0xFFFF) & ~0xFFFF).view(torch.float32)


def root_codec(signed_map: str, unsigned_map: str, bf16_scales: bool):
    """``encode``/``decode`` replacements for a 4-bit candidate: each block, scaled by its
    largest magnitude (rounded up to BF16 with ``bf16_scales``), to the nearest of a map's
    values on its root scale, the code being its index (kept unpacked here: packing changes
    no value)."""
    maps = {True: MAPS4[signed_map](), False: MAPS4[unsigned_map]()}

    def root(t, power):
        return t.sign() * t.abs() ** (1 / power)

    def encode(x, signed):
        vals, power = maps[signed]
        scale = x.abs().amax(dim=-1, keepdim=True)
        if bf16_scales:
            scale = _round_up_bf16(scale)
        y = x / torch.where(scale > 0, scale, torch.ones_like(scale))
        t = root(vals.to(x.device), power)
        codes = torch.bucketize(root(y, power).contiguous(), (t[1:] + t[:-1]) / 2)
        return codes.to(torch.uint8), scale

    def decode(codes, scale, signed):
        return maps[signed][0].to(codes.device)[codes.long()] * scale

    return encode, decode


def run4(spec: str, args: argparse.Namespace) -> tuple[list[dict], float]:
    """One 4-bit candidate ``<signed map>+<unsigned map>@<block><f32|bf16>`` (e.g.
    ``pow2+upow4nz@256f32``) through the 8-bit state's path with its codec and block; returns
    the records and what the two moments cost per element (codes and scales)."""
    maps, layout = spec.split("@")
    signed_map, unsigned_map = maps.split("+")
    bf16 = layout.endswith("bf16")
    block = int(layout.removesuffix("bf16").removesuffix("f32"))
    saved = qstate.encode, qstate.decode, qstate.BLOCK
    qstate.encode, qstate.decode = root_codec(signed_map, unsigned_map, bf16)
    qstate.BLOCK = block
    try:
        return _compare(("bf16-kahan-8bit",), args), 2 * (0.5 + (2 if bf16 else 4) / block)
    finally:
        qstate.encode, qstate.decode, qstate.BLOCK = saved


def run(fmt: str, recipes: tuple[str, ...], args: argparse.Namespace) -> list[dict]:
    saved = qstate.encode, qstate.decode
    if fmt != "power":  # (the library's own format needs no replacement)
        qstate.encode, qstate.decode = table_codec(FORMATS[fmt])
    try:
        return _compare(recipes, args)
    finally:
        qstate.encode, qstate.decode = saved


def _compare(recipes: tuple[str, ...], args: argparse.Namespace) -> list[dict]:
    """``lowprec.comparison.compare`` of ``recipes`` with the eager step, on the built-in model or the
    width and depth given."""
    model = replace(ModelConfig(), **{k: v for k, v in (("d_model", args.d_model),
                                                        ("n_layer", args.n_layer)) if v})
    cfg = CompareConfig(recipes=recipes, optimizer=args.optimizer, steps=args.steps,
                        fused=False, monitor_every=0, threads=args.threads, seed=args.seed,
                        model=model)
    return compare_mod.compare(cfg)


#: The 4-bit candidates measured by default (``--bits 4``): lowprec's power-law codes with
#: and without a zero for the second moment, torchao's maps (the dynamic map for the first
#: moment, a linear one without zero for the second), each at block 256 with FP32 scales; the
#: closest at block 128 with BF16 scales (the same bytes) and with FP32 scales (over the memory
#: target, for reference), and torchao's own layout (block 128, FP32 scales).
DEFAULT4 = ("pow2+upow4@256f32,pow2+upow4nz@256f32,pow2+upow3nz@256f32,pow3+upow4nz@256f32,"
            "dyn+upow4nz@256f32,pow2+linnz@256f32,dyn+linnz@256f32,pow2+upow4nz@128bf16,"
            "pow2+upow4nz@128f32,dyn+linnz@128f32")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--optimizer", default="adamw", choices=("adamw", "sgd", "lamb", "adagrad"))
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0, help="the task's seed (weights, batches)")
    p.add_argument("--d-model", type=int, default=None,
                   help="the model's width (default: the built-in model's, 256)")
    p.add_argument("--n-layer", type=int, default=None,
                   help="the model's blocks (default: the built-in model's, 2)")
    p.add_argument("--bits", type=int, default=8, choices=(8, 4))
    p.add_argument("--formats", default=None,
                   help="8-bit: power,float8,dynamic,linear; 4-bit: candidates as "
                        "<signed map>+<unsigned map>@<block><f32|bf16> (MAPS4), default DEFAULT4")
    p.add_argument("--no-refs", action="store_true", help="skip the FP32 and 8-bit rows")
    args = p.parse_args(argv)
    start = time.perf_counter()
    rows = []
    fp32 = None
    if not args.no_refs:
        refs = {r["recipe"]: r for r in run("power", ("fp32", "bf16-kahan", "bf16-kahan-8bit"),
                                            args)}
        fp32 = refs["fp32"]["eval_loss"]
        rows = [("fp32 (reference)", fp32, 4.0),
                ("bf16-kahan, BF16 moments", refs["bf16-kahan"]["eval_loss"], 2.0),
                ("bf16-kahan, 8-bit moments (lowprec)", refs["bf16-kahan-8bit"]["eval_loss"],
                 1 + 4 / qstate.BLOCK)]
    if args.bits == 8:
        for fmt in (args.formats or "power,float8,dynamic,linear").split(","):
            (rec,) = run(fmt, ("bf16-kahan-8bit",), args)
            rows.append((f"bf16-kahan, 8-bit moments: {fmt}", rec["eval_loss"], None))
    else:
        for spec in (args.formats or DEFAULT4).split(","):
            (rec,), per = run4(spec, args)
            rows.append((f"bf16-kahan, 4-bit moments: {spec}", rec["eval_loss"], per / 2))
            print(f"{spec}: eval loss {rec['eval_loss']:.4f}", flush=True)
    print(f"{args.optimizer}, {args.steps} steps, eager step, {time.perf_counter() - start:.0f} s")
    print("| run | eval loss | gap vs fp32 | bytes per moment element |\n|---|---|---|---|")
    for name, loss, per in rows:
        gap = "" if fp32 is None else f"{100 * (loss / fp32 - 1):+.2f}%"
        print(f"| {name} | {loss:.4f} | {gap} | {'' if per is None else f'{per:.4f}'} |")


if __name__ == "__main__":
    main()
