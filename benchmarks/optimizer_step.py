"""Time one ``optimizer.step()`` of lowprec's optimizers against their peers.

The parameters (about 25M by default) are laid out like a small transformer: blocks of four
``d x d`` attention matrices, a ``4d x d`` and a ``d x 4d`` MLP matrix, their biases and two
norms. Every row gets fresh parameters and fixed random gradients; the warmup steps create the
optimizer state, then each ``step()`` is timed on its own (wall clock, and process CPU time).

Per row the table shows the median step time and its spread, parameters per second, the bytes
per parameter a step has to move at the least (``2 x`` param and every state tensor, ``1 x`` the
gradient, counted from the actual tensors; LAMB, whose trust ratio needs whole-tensor norms before
the first write, reads them all once more), the resident bytes per parameter (param + grad +
state), and the achieved bandwidth (bytes moved / median time) as a fraction of an in-place
``a.add_(b, alpha=s)`` measured in the same run. Ratios compare each row with torch's fused
optimizer of the same family on FP32 parameters, and the lowprec strategies with their closest
peers (optimi's Kahan summation, torchao's BF16 stochastic rounding). The families are SGD, AdamW,
Adagrad (beside ``torch.optim.Adagrad``) and LAMB (beside timm's ``Lamb`` when timm imports; no
other maintained LAMB is available without changing torch). Every row also reports the peak
process RSS during one step over the resident param + grad + state bytes, and compiled rows the
time of their first (compiling) step.

By default (``--paired``) each timed step of a row is followed by one step of its family's
reference optimizer (kept alive beside it, with its own parameters) and one axpy, and the
``%axpy`` and ``x fused`` columns are medians of those per-step ratios: the machine's speed can
change by 2x within seconds on a shared host, and two rows timed a minute apart then compare
that swing as much as the code. Comparisons between two rows of a family go through the same
reference: the ratio of their paired ``x fused``.

Rows are data (``Row``: name, family, source, parameter dtype, optimizer factory). Every lowprec
configuration is timed once per implementation variant named in ``--lowprec-variants``; a variant
is an entry of ``LOWPREC_VARIANTS`` (extra constructor keywords, e.g. ``"fused": {"fused": True}``)
and gets its own rows, ``x fused``/``x none`` ratios and comparison lines. A peer is one more
``Row`` in ``peer_rows()``, a comparison one more entry of ``COMPARISONS``.

Examples::

    python benchmarks/optimizer_step.py                  # the full table, ~25M parameters
    python benchmarks/optimizer_step.py --quick          # smoke run, ~0.1M parameters, 3 steps
    python benchmarks/optimizer_step.py --rows adamw-bf16 --json out.json
    python benchmarks/optimizer_step.py --lowprec-variants default,eager,fused
    python benchmarks/optimizer_step.py --list           # row names, for --rows
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import json
import logging
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

# (the rows of the other families live beside this script; imported by path, as the tests load
# this module from its file)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _family_rows as family_rows

#: The optimizer families, in table order.
FAMILIES = ("sgd", "adamw", "adagrad", "lamb", *family_rows.FAMILIES)
LR = {"sgd": 1e-2, "adamw": 1e-3, "adagrad": 1e-2, "lamb": 1e-3, **family_rows.LR}
MOMENTUM = 0.9
#: The row each row's time is divided by (column ``x fused``), per family: the first of the
#: candidates that ran. LAMB has no torch.optim peer; timm's Lamb stands in when it imports.
REFERENCE: dict[str, tuple[str, ...]] = {
    "sgd": ("torch-sgd-fp32-fused",),
    "adamw": ("torch-adamw-fp32-fused",),
    "adagrad": ("torch-adagrad-fp32-fused", "torch-adagrad-fp32-foreach"),
    "lamb": ("timm-lamb-fp32",),
    **family_rows.REFERENCE,
}
#: Implementation variants of lowprec's optimizers: name -> extra constructor keyword arguments.
#: Each variant named in --lowprec-variants gets its own rows (``lowprec-...-<variant>``), ratios
#: and comparison lines. A variant whose keywords the optimizer's constructor does not take is
#: listed as skipped, so an entry can exist before the path it selects does.
#: A keyword set to False (an off switch) is left out where the constructor does not take it.
LOWPREC_VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},  # what a user gets: fused=None (compiled where a compiler exists)
    "eager": {"fused": False},  # the per-parameter step
    "fused": {"fused": True},  # the compiled, fused step
}
DEFAULT_VARIANTS = ("default", "eager")
#: The issue's target for peak memory during a step, over resident params + grads + state.
PEAK_TARGET = 1.05
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


#: Where the parameters live (``--device``): the CPU, or a GPU whose steps run asynchronously,
#: so every clock reading first waits for its queued work.
DEVICE = torch.device("cpu")


def _now() -> float:
    """``time.perf_counter()`` once the device's queued work is done."""
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)
    return time.perf_counter()


# ------------------------------------------------------------------------------------- rows


@dataclass(frozen=True)
class Row:
    """One line of the table: an optimizer factory applied to parameters of one dtype."""

    name: str  # unique; what --rows matches
    family: str  # one of FAMILIES
    source: str  # "torch", "optimi", "torchao", "bnb", "timm" or "lowprec"
    dtype: torch.dtype  # parameter (and gradient) dtype
    make: Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None
    master: str = "none"  # how the master weight is kept ("none", "kahan", "stochastic", ...)
    variant: str = ""  # implementation: "foreach", "fused", "loop", "eager", ...
    state_dtype: torch.dtype | str | None = None  # state_dtype= when given ("8bit": 8-bit)
    skip: str = ""  # why the row cannot run here (the factory is then None)
    compiled: bool = False  # its first step compiles (torch.compile): the "compile s" column
    scaled: bool = False  # stepped under a loss scaler's contract (_under_scaler)


def _name(*parts: str) -> str:
    return "-".join(p for p in parts if p)


def _under_scaler(make: Callable[[list[torch.Tensor]], torch.optim.Optimizer]
                  ) -> Callable[[list[torch.Tensor]], torch.optim.Optimizer]:
    """``make``'s optimizer stepped as ``torch.amp.GradScaler`` steps one that unscales inside
    its step (``_step_supports_amp_scaling``): with the attributes ``grad_scale`` and
    ``found_inf``. The step then checks the gradients for inf/NaN, unscales them inside the
    update and writes them back unscaled, as GradScaler leaves them. A scale of 1 keeps the
    gradients' values from step to step (the cost does not depend on the scale)."""
    def made(params: list[torch.Tensor]) -> torch.optim.Optimizer:
        opt = make(params)
        opt.grad_scale = torch.ones((), device=DEVICE)
        opt.found_inf = torch.zeros((), device=DEVICE)
        return opt
    return made


def _optimi_rows() -> list[Row]:
    try:
        with _quiet():
            import optimi
    except Exception as e:  # any import failure: the rows are skipped with the reason
        reason = f"optimi not importable: {type(e).__name__}: {e}"
        return [
            Row(_name("optimi", fam, "bf16-kahan"), fam, "optimi", torch.bfloat16, None,
                "kahan", skip=reason)
            for fam in ("adamw", "sgd")
        ]
    rows = []
    for fam, cls_name in (("adamw", "AdamW"), ("sgd", "SGD")):
        cls = getattr(optimi, cls_name, None)
        for variant, foreach in (("foreach", True), ("loop", False)):
            name = _name("optimi", fam, "bf16-kahan", variant)
            if cls is None:
                rows.append(Row(name, fam, "optimi", torch.bfloat16, None, "kahan", variant,
                                skip=f"optimi has no {cls_name}"))
                continue
            sig = inspect.signature(cls.__init__).parameters
            kwargs: dict[str, Any] = {"lr": LR[fam]}
            if fam == "sgd":
                kwargs["momentum"] = MOMENTUM
            for key, value in (("kahan_sum", True), ("foreach", foreach), ("triton", False)):
                if key in sig:
                    kwargs[key] = value
            skip = ""
            if "kahan_sum" not in sig:
                skip = f"optimi.{cls_name} takes no kahan_sum"
            elif "foreach" not in sig and foreach:
                skip = f"optimi.{cls_name} takes no foreach"

            def make(params, cls=cls, kwargs=kwargs):
                return cls(params, **kwargs)

            rows.append(Row(name, fam, "optimi", torch.bfloat16, None if skip else make,
                            "kahan", variant, skip=skip))
    return rows


def _torchao_rows() -> list[Row]:
    name = "torchao-adamw-bf16-sr"
    try:
        with _quiet():
            import torchao.optim as tao
    except Exception as e:
        reason = f"torchao.optim not importable: {type(e).__name__}: {e}"
        return [Row(name, "adamw", "torchao", torch.bfloat16, None, "stochastic", skip=reason)]
    cls = getattr(tao, "_AdamW", None) or getattr(tao, "AdamW", None)
    if cls is None:
        return [Row(name, "adamw", "torchao", torch.bfloat16, None, "stochastic",
                    skip="torchao.optim has neither _AdamW nor AdamW")]
    if "bf16_stochastic_round" not in inspect.signature(cls.__init__).parameters:
        return [Row(name, "adamw", "torchao", torch.bfloat16, None, "stochastic",
                    skip=f"torchao.optim.{cls.__name__} takes no bf16_stochastic_round")]

    def make(params):
        return cls(params, lr=LR["adamw"], bf16_stochastic_round=True)

    # torchao compiles its per-parameter step (torch.compile, one graph per shape): the first
    # warmup step pays for that; the table's times are the compiled steps.
    rows = [Row(name, "adamw", "torchao", torch.bfloat16, make, "stochastic", "compiled",
                compiled=True)]
    # Its 8-bit AdamW (blockwise dynamic-map moments) on BF16 weights with stochastic rounding,
    # the nearest peer of lowprec's 8-bit state on BF16 weights.
    cls8 = getattr(tao, "AdamW8bit", None)
    name8 = "torchao-adamw-bf16-8bit-sr"
    if cls8 is None:
        rows.append(Row(name8, "adamw", "torchao", torch.bfloat16, None, "stochastic",
                        state_dtype="8bit", skip="torchao.optim has no AdamW8bit"))
    else:
        def make8(params):
            return cls8(params, lr=LR["adamw"], bf16_stochastic_round=True)

        rows.append(Row(name8, "adamw", "torchao", torch.bfloat16, make8, "stochastic",
                        "compiled", "8bit", compiled=True))
    return rows


def _bnb_rows() -> list[Row]:
    """bitsandbytes' 8-bit AdamW (blockwise dynamic-map moments), on BF16 weights (rounded to
    nearest) and on FP32 ones, where it runs here."""
    rows = []
    try:
        with _quiet():
            import bitsandbytes as bnb
        cls = bnb.optim.AdamW8bit
    except Exception as e:
        reason = f"bitsandbytes not importable: {type(e).__name__}: {e}"
        return [Row(_name("bnb-adamw", DTYPE_NAMES[d], "8bit"), "adamw", "bnb", d, None,
                    state_dtype="8bit", skip=reason) for d in (torch.bfloat16, torch.float32)]
    for dtype in (torch.bfloat16, torch.float32):
        def make(params, cls=cls):
            return cls(params, lr=LR["adamw"])

        rows.append(Row(_name("bnb-adamw", DTYPE_NAMES[dtype], "8bit"), "adamw", "bnb", dtype,
                        make, "none", "", "8bit"))
    return rows


def _torch_adagrad_rows() -> list[Row]:
    """torch.optim.Adagrad on FP32, foreach and (where this torch has it on CPU) fused."""
    cls = torch.optim.Adagrad
    sig = inspect.signature(cls.__init__).parameters
    rows = []
    for variant in ("foreach", "fused"):
        name = _name("torch", "adagrad", "fp32", variant)
        if variant not in sig:
            rows.append(Row(name, "adagrad", "torch", torch.float32, None, "none", variant,
                            skip=f"torch.optim.Adagrad takes no {variant}= in torch "
                                 f"{torch.__version__}"))
            continue

        def make(params, variant=variant):
            return torch.optim.Adagrad(params, lr=LR["adagrad"], **{variant: True})

        # A torch without a CPU fused Adagrad kernel raises at the first step: the row then
        # shows the error and x fused falls back to the foreach row (REFERENCE).
        rows.append(Row(name, "adagrad", "torch", torch.float32, make, "none", variant))
    return rows


def _timm_lamb_rows() -> list[Row]:
    """timm's Lamb on FP32 (the maintained LAMB on PyPI), only if timm already imports here.

    timm requires torchvision, whose wheels pin one torch release each: installing it into an
    environment can replace torch, so the benchmark never asks for it. Configured like lowprec's
    Lamb: the trust ratio on every tensor (``always_adapt``, since weight decay is 0), no global
    gradient-norm pre-scaling (``max_grad_norm=None``), no trust clipping.
    """
    name = "timm-lamb-fp32"
    try:
        with _quiet():
            from timm.optim import Lamb
    except Exception as e:
        return [Row(name, "lamb", "timm", torch.float32, None, skip=(
            f"no LAMB peer: timm not importable ({type(e).__name__}); torch.optim has no LAMB, "
            "optimi none, torch-optimizer is archived"))]
    sig = inspect.signature(Lamb.__init__).parameters
    kwargs: dict[str, Any] = {"lr": LR["lamb"], "weight_decay": 0.0}
    for key, value in (("always_adapt", True), ("max_grad_norm", None), ("trust_clip", False)):
        if key in sig:
            kwargs[key] = value
    skip = "" if "always_adapt" in sig else "timm.optim.Lamb takes no always_adapt"

    def make(params):
        return Lamb(params, **kwargs)

    return [Row(name, "lamb", "timm", torch.float32, None if skip else make, skip=skip)]


def peer_rows() -> list[Row]:
    rows = []
    for fam, cls in (("sgd", torch.optim.SGD), ("adamw", torch.optim.AdamW)):
        extra = {"momentum": MOMENTUM} if fam == "sgd" else {}
        for variant in ("foreach", "fused"):

            def make(params, cls=cls, extra=extra, variant=variant, fam=fam):
                return cls(params, lr=LR[fam], **extra, **{variant: True})

            rows.append(Row(_name("torch", fam, "fp32", variant), fam, "torch", torch.float32,
                            make, "none", variant))
    # The same step under a loss scaler (torch's fused kernel unscales and writes the grads).
    make = rows[-1].make
    rows.append(Row("torch-adamw-fp32-fused-scaled", "adamw", "torch", torch.float32,
                    _under_scaler(make), "none", "fused", scaled=True))
    # Round-to-nearest BF16 with BF16 state: the least traffic any AdamW can move.
    rows.append(Row("torch-adamw-bf16-fused", "adamw", "torch", torch.bfloat16,
                    lambda params: torch.optim.AdamW(params, lr=LR["adamw"], fused=True),
                    "none", "fused"))
    rows += _optimi_rows()
    rows += _torchao_rows()
    rows += _bnb_rows()
    rows += _torch_adagrad_rows()
    rows += _timm_lamb_rows()
    rows += family_rows.peer_rows(Row, _name)
    return rows


def lowprec_rows(variants: list[str]) -> list[Row]:
    try:
        import lowprec.optim as lo
    except Exception as e:
        return [Row("lowprec", "adamw", "lowprec", torch.float32, None,
                    skip=f"lowprec not importable: {type(e).__name__}: {e}")]
    configs: list[tuple[torch.dtype, str, torch.dtype | None]] = [
        (torch.float32, "none", None),
        *((torch.bfloat16, m, None) for m in ("none", "kahan", "split", "stochastic", "fp32")),
    ]
    rows = []
    for variant in variants:
        for fam, cls_name in (("sgd", "SGD"), ("adamw", "AdamW"), ("adagrad", "Adagrad"),
                              ("lamb", "Lamb")):
            cls = getattr(lo, cls_name, None)
            if cls is None:
                rows.append(Row(_name("lowprec", fam, variant), fam, "lowprec", torch.float32,
                                None, variant=variant, skip=f"lowprec.optim has no {cls_name}"))
                continue
            sig = inspect.signature(cls.__init__).parameters
            vkw = {k: v for k, v in LOWPREC_VARIANTS[variant].items() if k in sig or v is not False}
            missing = [k for k in vkw if k not in sig]
            skip = f"{cls.__name__} takes no {', '.join(missing)}=" if missing else ""
            extra = {"momentum": MOMENTUM} if fam == "sgd" else {}
            # Split with BF16 state: the trail keeps the weights exact, the moments are BF16;
            # and 8-bit state (qstate) under kahan and split, in every family.
            fam_configs = configs + ([(torch.bfloat16, "split", torch.bfloat16)]
                                     if fam in ("adamw", "sgd") else []) + [
                (torch.bfloat16, "kahan", "8bit"), (torch.bfloat16, "split", "8bit")]
            for dtype, master, sd in fam_configs:
                kwargs = {"lr": LR[fam], **extra, "master": master, **vkw}
                if sd is not None:
                    kwargs["state_dtype"] = sd
                name = _name("lowprec", fam, DTYPE_NAMES[dtype], master,
                             f"state{DTYPE_NAMES.get(sd, sd)}" if sd is not None else "",
                             variant)

                def make(params, cls=cls, kwargs=kwargs):
                    return cls(params, **kwargs)

                rows.append(Row(name, fam, "lowprec", dtype, None if skip else make, master,
                                variant, sd, skip=skip, compiled=_compiles(vkw)))
                if fam == "adamw" and sd is None and (dtype, master) in (
                        (torch.float32, "none"), (torch.bfloat16, "kahan")):
                    # Under a loss scaler: the inf/NaN check and the unscaled gradients written
                    # back cost this much more than the plain step (the comparisons below).
                    rows.append(Row(f"{name}-scaled", fam, "lowprec", dtype,
                                    None if skip else _under_scaler(make), master, variant, sd,
                                    skip=skip, compiled=_compiles(vkw), scaled=True))
    rows += family_rows.lowprec_rows(
        Row, _name, {v: LOWPREC_VARIANTS[v] for v in variants}, _compiles)
    return rows


def _compiles(kwargs: dict[str, Any]) -> bool:
    """Whether a lowprec row with these keywords compiles its step (its first step's time is
    the "compile s" column): fused=True, or the default where it compiles here."""
    if "fused" in kwargs:
        return kwargs["fused"] is True
    from lowprec.optim import compiled

    return compiled._default_compiles(DEVICE.type)


# Comparisons printed under the table: (title, numerator rows, denominator rows). Each lowprec
# variant gets its own line; the denominator is the fastest matching row.
def _is(**want: Any) -> Callable[[Row], bool]:
    return lambda r: all(getattr(r, k) == v for k, v in want.items())


COMPARISONS: list[tuple[str, Callable[[Row], bool], Callable[[Row], bool]]] = [
    ("AdamW bf16 kahan vs best optimi AdamW kahan",
     _is(source="lowprec", family="adamw", dtype=torch.bfloat16, master="kahan", state_dtype=None,
         scaled=False),
     _is(source="optimi", family="adamw")),
    ("SGD bf16 kahan vs best optimi SGD kahan",
     _is(source="lowprec", family="sgd", dtype=torch.bfloat16, master="kahan", state_dtype=None),
     _is(source="optimi", family="sgd")),
    ("AdamW bf16 stochastic vs torchao bf16 SR",
     _is(source="lowprec", family="adamw", dtype=torch.bfloat16, master="stochastic"),
     _is(source="torchao", family="adamw", state_dtype=None)),
    # 8-bit moments (issue 23): against the same strategy with BF16 moments (it moves fewer
    # bytes, so it should be no slower), and against the peers' 8-bit AdamW.
    *((f"{fam_title} bf16 kahan 8-bit vs bf16 kahan",
       _is(source="lowprec", family=fam, dtype=torch.bfloat16, master="kahan", state_dtype="8bit"),
       _is(source="lowprec", family=fam, dtype=torch.bfloat16, master="kahan", state_dtype=None,
           scaled=False))
      for fam, fam_title in (("adamw", "AdamW"), ("sgd", "SGD"), ("adagrad", "Adagrad"),
                             ("lamb", "LAMB"))),
    ("AdamW bf16 kahan 8-bit vs torchao AdamW8bit (bf16 SR)",
     _is(source="lowprec", family="adamw", dtype=torch.bfloat16, master="kahan",
         state_dtype="8bit"),
     _is(name="torchao-adamw-bf16-8bit-sr")),
    ("AdamW bf16 kahan 8-bit vs bitsandbytes AdamW8bit (bf16)",
     _is(source="lowprec", family="adamw", dtype=torch.bfloat16, master="kahan",
         state_dtype="8bit"),
     _is(name="bnb-adamw-bf16-8bit")),
    ("AdamW fp32 none vs torch AdamW foreach",
     _is(source="lowprec", family="adamw", dtype=torch.float32, scaled=False),
     _is(name="torch-adamw-fp32-foreach")),
    ("SGD fp32 none vs torch SGD foreach",
     _is(source="lowprec", family="sgd", dtype=torch.float32),
     _is(name="torch-sgd-fp32-foreach")),
    ("AdamW bf16 none vs torch fused AdamW on bf16",
     _is(source="lowprec", family="adamw", dtype=torch.bfloat16, master="none", scaled=False),
     _is(name="torch-adamw-bf16-fused")),
    # What a loss scaler costs a step (inf/NaN check, unscaling, gradients written back), for
    # torch's fused AdamW and for lowprec's, each against its own plain step.
    ("torch fused AdamW scaled vs plain",
     _is(name="torch-adamw-fp32-fused-scaled"), _is(name="torch-adamw-fp32-fused")),
    *((f"AdamW {dt} {m} scaled vs plain ({v})",
       _is(source="lowprec", family="adamw", master=m, variant=v, dtype=d, scaled=True),
       _is(source="lowprec", family="adamw", master=m, variant=v, dtype=d, state_dtype=None,
           scaled=False))
      for v in LOWPREC_VARIANTS
      for dt, d, m in (("fp32", torch.float32, "none"), ("bf16", torch.bfloat16, "kahan"))),
    # What the default (fused=None) gives a user, against the eager and the fused step.
    *((f"{fam_title} bf16 kahan default vs {v}",
       _is(source="lowprec", family=fam, dtype=torch.bfloat16, master="kahan", state_dtype=None,
           variant="default", scaled=False),
       _is(source="lowprec", family=fam, dtype=torch.bfloat16, master="kahan", state_dtype=None,
           variant=v, scaled=False))
      for fam, fam_title in (("adamw", "AdamW"), ("sgd", "SGD"), ("adagrad", "Adagrad"),
                             ("lamb", "LAMB"))
      for v in ("eager", "fused")),
    ("Adagrad fp32 none vs torch Adagrad foreach",
     _is(source="lowprec", family="adagrad", dtype=torch.float32),
     _is(name="torch-adagrad-fp32-foreach")),
    ("LAMB fp32 none vs timm Lamb",
     _is(source="lowprec", family="lamb", dtype=torch.float32),
     _is(source="timm", family="lamb")),
    # No LAMB in torch: the nearest torch step is AdamW's (the same moments, no norms).
    ("LAMB fp32 none vs best torch AdamW fp32",
     _is(source="lowprec", family="lamb", dtype=torch.float32),
     lambda r: r.source == "torch" and r.family == "adamw" and r.dtype == torch.float32),
    # Adam, RAdam, Lion, StableAdamW, Adafactor, Muon (_family_rows)
    *family_rows.comparisons(_is),
]


# ------------------------------------------------------------------------------ parameters


def _block_shapes(d: int) -> list[tuple[str, tuple[int, ...]]]:
    shapes = []
    for m in ("q", "k", "v", "o"):
        shapes += [(f"attn.{m}.weight", (d, d)), (f"attn.{m}.bias", (d,))]
    shapes += [("mlp.fc1.weight", (4 * d, d)), ("mlp.fc1.bias", (4 * d,)),
               ("mlp.fc2.weight", (d, 4 * d)), ("mlp.fc2.bias", (d,))]
    for n in ("ln1", "ln2"):
        shapes += [(f"{n}.weight", (d,)), (f"{n}.bias", (d,))]
    return shapes


def layout(params_millions: float) -> tuple[int, int, list[tuple[str, tuple[int, ...]]]]:
    """(d_model, blocks, [(name, shape)]): d_model 1024 unless one block would exceed the target."""
    target = params_millions * 1e6
    for d in (1024, 768, 512, 384, 256, 128, 64):
        per_block = sum(math.prod(s) for _, s in _block_shapes(d))
        if per_block <= target or d == 64:
            break
    blocks = max(1, round(target / per_block))
    shapes = [(f"blocks.{b}.{n}", s) for b in range(blocks) for n, s in _block_shapes(d)]
    return d, blocks, shapes


@dataclass
class BaseTensors:
    """FP32 values and gradients every row starts from (converted to the row's dtype)."""

    values: list[torch.Tensor]
    grads: list[torch.Tensor]

    @classmethod
    def make(cls, shapes: list[tuple[str, tuple[int, ...]]], seed: int = 0) -> BaseTensors:
        gen = torch.Generator().manual_seed(seed)
        values, grads = [], []
        for name, shape in shapes:
            v = torch.randn(shape, generator=gen).mul_(0.02)
            if name.endswith("ln1.weight") or name.endswith("ln2.weight"):
                v.add_(1.0)
            values.append(v)
            grads.append(torch.randn(shape, generator=gen).mul_(1e-3))
        return cls(values, grads)

    def params(self, dtype: torch.dtype) -> list[torch.Tensor]:
        ps = []
        for v, g in zip(self.values, self.grads, strict=True):
            p = v.to(DEVICE, dtype, copy=True).requires_grad_()
            p.grad = g.to(DEVICE, dtype, copy=True)
            ps.append(p)
        return ps


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def footprint(opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> dict[str, int]:
    """Bytes of params, grads and optimizer state, counted from the tensors themselves."""
    seen: set[int] = set()

    def count(t: Any) -> int:
        if not isinstance(t, torch.Tensor) or id(t) in seen:
            return 0
        seen.add(id(t))
        return _tensor_bytes(t)

    p_bytes = sum(count(p) for p in params)
    g_bytes = sum(count(p.grad) for p in params)
    s_bytes = 0
    for st in opt.state.values():
        values = st.values() if isinstance(st, dict) else [st]
        s_bytes += sum(count(v) for v in values)
    return {"param": p_bytes, "grad": g_bytes, "state": s_bytes,
            "moved": 2 * p_bytes + g_bytes + 2 * s_bytes,
            # A rule with whole-tensor norms (LAMB) reads everything once before the first write.
            "moved_two_pass": 3 * p_bytes + 2 * g_bytes + 3 * s_bytes,
            "resident": p_bytes + g_bytes + s_bytes}


#: Families whose update needs whole-tensor reductions first: their floor is two passes.
TWO_PASS_FAMILIES = ("lamb", *family_rows.TWO_PASS)


# ---------------------------------------------------------------------------------- timing


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence warnings and the import-time log chatter of the peers (torchao, optimi, bnb)."""
    loggers = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree", "optimi",
                                              "bitsandbytes")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def _quantiles(xs: list[float]) -> tuple[float, float, float]:
    if len(xs) == 1:
        return xs[0], xs[0], xs[0]
    q1, q2, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q1, q2, q3


def _cpu_busy_s() -> float | None:
    """Seconds of CPU time the whole machine has been busy (all processes), from /proc/stat."""
    try:
        from lowprec.comparison.compare import machine_busy_s
    except ImportError:  # (the peers' rows run without lowprec)
        return None
    return machine_busy_s()


#: A window shorter than this (in seconds) is too short to tell contention from /proc/stat.
MIN_BG_WINDOW_S = 0.25


@dataclass
class Window:
    """One pass of timed steps, and how busy the rest of the machine was meanwhile."""

    times: list[float]  # wall seconds per step
    cpu_times: list[float]  # process CPU seconds per step (all threads)
    # --paired: after each step, the family reference's step and an axpy, in seconds (the
    # reference's list stays empty for the reference row itself and families without one).
    ref_times: list[float] = field(default_factory=list)
    axpy_times: list[float] = field(default_factory=list)
    # What bg is computed from: the timed steps' span, or, when that is too short, the span from
    # the end of the first warmup step.
    wall: float = 0.0
    cpu: float = 0.0
    busy: float | None = None  # machine-wide busy CPU seconds (/proc/stat), None if unknown

    @property
    def bg(self) -> float | None:
        """Cores other processes kept busy during the window (contention), or None."""
        if self.busy is None or self.wall <= 0:
            return None
        return max(0.0, (self.busy - self.cpu) / self.wall)


@contextlib.contextmanager
def _window(times: list[float] | None = None) -> Iterator[Window]:
    w = Window(times if times is not None else [], [])
    busy0, cpu0, wall0 = _cpu_busy_s(), time.process_time(), _now()
    yield w
    busy1, cpu1, wall1 = _cpu_busy_s(), time.process_time(), _now()
    w.wall, w.cpu = wall1 - wall0, cpu1 - cpu0
    w.busy = None if busy0 is None or busy1 is None else busy1 - busy0


def _clean(windows: list[Window], bg_max: float) -> list[Window]:
    """The windows not known to be contended (a window too short for /proc/stat's ticks has an
    unknown bg, which is no sign of contention), or all of them if every one is."""
    clean = [w for w in windows if w.bg is None or w.bg <= bg_max]
    return clean or windows


def _is_contended(windows: list[Window], bg_max: float) -> bool:
    known = [w.bg for w in windows if w.bg is not None]
    return bool(known) and min(known) > bg_max


def _mean_bg(windows: list[Window]) -> float | None:
    if not windows or any(w.bg is None for w in windows):
        return None
    wall = sum(w.wall for w in windows)
    return sum(w.bg * w.wall for w in windows) / wall if wall > 0 else None  # type: ignore[operator]


# ----------------------------------------------------------------------------- peak memory


def _malloc_trim() -> None:
    """Hand the allocator's free pages back to the OS (glibc), so that a step's temporaries
    show up as new resident pages instead of reusing pages a previous step left resident."""
    try:
        import ctypes
        import ctypes.util

        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass


class PeakRSS:
    """The process's resident-set high-water mark around a call.

    Preferred: Linux's ``VmHWM`` (``/proc/self/status``), reset to the current RSS by writing
    ``5`` to ``/proc/self/clear_refs`` -- exact, no sampling. Checked at start-up by touching and
    freeing a 64 MiB tensor; where it does not work, a thread samples the RSS every 0.5 ms
    (``/proc/self/statm``, or psutil where /proc is missing), which can miss short peaks.
    tracemalloc does not see torch's allocations, so it is not an option.
    """

    def __init__(self) -> None:
        self.method = "none"
        self._psutil: Any = None
        try:
            self._status()
            self.method = "VmHWM" if self._hwm_works() else "sampling /proc/self/statm"
        except (OSError, ValueError, KeyError):
            try:
                import psutil

                self._psutil = psutil.Process()
                self.method = "sampling psutil"
            except Exception:
                self.method = "none"

    @staticmethod
    def _status() -> dict[str, int]:
        out = {}
        with open("/proc/self/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    out[key] = int(rest.split()[0]) * 1024
        return {"VmRSS": out["VmRSS"], "VmHWM": out["VmHWM"]}

    @staticmethod
    def _reset() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            return True
        except OSError:
            return False

    def _hwm_works(self) -> bool:
        n = 64 << 20
        if not self._reset():
            return False
        before = self._status()["VmRSS"]
        t = torch.ones(n // 4)  # touched, so resident
        del t
        grew = self._status()["VmHWM"] - before
        # After a reset the mark must drop back to (about) the current RSS.
        self._reset()
        st = self._status()
        return grew >= 0.9 * n and st["VmHWM"] - st["VmRSS"] < n // 4

    def _rss(self) -> int:
        if self._psutil is not None:
            return int(self._psutil.memory_info().rss)
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def measure(self, fn: Callable[[], Any]) -> tuple[int, int] | None:
        """(RSS just before ``fn()``, peak RSS during it), in bytes; None if unmeasurable."""
        if self.method == "none":
            fn()
            return None
        gc.collect()
        _malloc_trim()
        if self.method == "VmHWM":
            self._reset()
            before = self._status()["VmRSS"]
            fn()
            return before, max(before, self._status()["VmHWM"])
        import threading

        peak = before = self._rss()
        done = threading.Event()

        def sample() -> None:
            nonlocal peak
            while not done.wait(0.0005):
                peak = max(peak, self._rss())

        th = threading.Thread(target=sample, daemon=True)
        th.start()
        try:
            fn()
        finally:
            done.set()
            th.join()
        return before, max(peak, self._rss())


def axpy_bandwidth(n: int, reps: int) -> Window:
    """Times of ``a.add_(b, alpha=s)`` (reads a and b, writes a: 12 bytes per element)."""
    a = torch.randn(n, device=DEVICE)
    b = torch.randn(n, device=DEVICE)
    a.add_(b, alpha=1e-3)
    with _window() as w:  # long enough for bg: 10 reps of >= 16M elements
        for _ in range(reps):
            t0 = _now()
            a.add_(b, alpha=1e-3)
            w.times.append(_now() - t0)
    del a, b
    gc.collect()
    return w


@dataclass
class Companions:
    """What ``--paired`` times right after each step of a row: one step of the family's reference
    optimizer (``REFERENCE``; fresh parameters of its own, alive beside the row's) and one axpy on
    operands allocated once for the run."""

    rows: dict[str, Row]  # every row of the run, by name
    results: dict[str, Result]  # so far: a reference that failed is not tried again
    a: torch.Tensor
    b: torch.Tensor

    def reference_for(self, row: Row) -> Row | None:
        for name in REFERENCE.get(row.family, ()):
            if name in self.rows and self.results[name].status == "ok":
                return self.rows[name]
        return None

    def axpy(self) -> float:
        t0 = _now()
        self.a.add_(self.b, alpha=1e-3)
        return _now() - t0


@dataclass
class Result:
    row: Row
    status: str = "ok"  # "ok", "skipped" or "error"
    note: str = ""
    windows: list[Window] = field(default_factory=list)  # one per pass over the row
    warmup_times: list[float] = field(default_factory=list)
    numel: int = 0
    bytes: dict[str, int] = field(default_factory=dict)
    bg_max: float = math.inf
    pass_seconds: list[float] = field(default_factory=list)  # wall time of each whole pass
    rss: tuple[int, int] | None = None  # (RSS before, peak RSS during) one untimed steady step
    paired_ref: str | None = None  # --paired: the reference row timed beside this one (or itself)

    @property
    def used(self) -> list[Window]:
        """The passes the statistics come from: those without contention, if any."""
        return _clean(self.windows, self.bg_max)

    @property
    def contended(self) -> bool:
        return _is_contended(self.windows, self.bg_max)

    @property
    def times(self) -> list[float]:
        return [t for w in self.used for t in w.times]

    @property
    def cpu_times(self) -> list[float]:
        return [t for w in self.used for t in w.cpu_times]

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def background(self) -> float | None:
        return _mean_bg(self.used)

    @property
    def ref_ratios(self) -> list[float]:
        """--paired: each step's time over the reference step timed right after it."""
        return [t / r for w in self.used if w.ref_times
                for t, r in zip(w.times, w.ref_times, strict=True)]

    @property
    def axpy_ratios(self) -> list[float]:
        """--paired: each step's time over the axpy timed right after it."""
        return [t / a for w in self.used if w.axpy_times
                for t, a in zip(w.times, w.axpy_times, strict=True)]


def run_row(row: Row, base: BaseTensors, args: argparse.Namespace, result: Result,
            peak_rss: PeakRSS | None = None, companions: Companions | None = None) -> None:
    """Warm up and time one pass of ``row`` with fresh parameters; adds a window to ``result``.

    The row's first pass also measures the peak RSS of one more (untimed) step with ``peak_rss``.
    With ``companions`` (--paired) each timed step is followed by the reference's and an axpy.
    """
    t0 = _now()
    _run_pass(row, base, args, result, peak_rss, companions)
    result.pass_seconds.append(_now() - t0)


def _snapshot() -> tuple[float | None, float, float]:
    return _cpu_busy_s(), time.process_time(), _now()


def _paired_reference(row: Row, base: BaseTensors, companions: Companions | None,
                      result: Result) -> tuple[torch.optim.Optimizer | None, float]:
    """The reference optimizer to time after each of ``row``'s steps (its state created by one
    untimed step), or None; and the seconds that step plus an axpy took (the companions' cost)."""
    if companions is None:
        return None, 0.0
    ref = companions.reference_for(row)
    opt = None
    t0 = _now()
    if ref is not None and ref.name == row.name:
        result.paired_ref = row.name  # its own reference: x fused is 1 by definition
    elif ref is not None:
        try:
            with _quiet():
                opt = ref.make(base.params(ref.dtype))
                opt.step()
            result.paired_ref = ref.name
        except Exception:  # the reference's own pass reports its error
            opt = None
    companions.axpy()
    return opt, _now() - t0


def _run_pass(row: Row, base: BaseTensors, args: argparse.Namespace, result: Result,
              peak_rss: PeakRSS | None = None, companions: Companions | None = None) -> None:
    params = base.params(row.dtype)
    opt = ref_opt = None
    try:
        budget = args.row_seconds / args.rounds  # for this pass's timed steps
        with _quiet(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt = row.make(params)
            spent = 0.0
            steady = _snapshot()
            for i in range(args.warmup):
                # A slow row (or a compiled one) stops warming up once its state exists and the
                # warmup has used half the pass's budget; a compiled lowprec row compiles on its
                # second step too (the redone step's shared calls), so it warms up with both.
                if i > (1 if row.compiled else 0) and spent > budget / 2:
                    break
                t0 = _now()
                opt.step()
                result.warmup_times.append(_now() - t0)
                spent += result.warmup_times[-1]
                if i == 0:
                    # bg of a short timed window is taken from here on instead: after the first
                    # step, whose state creation or compilation (with its compiler processes,
                    # which /proc/stat would count as contention) is over.
                    steady = _snapshot()
        if row.source == "lowprec":  # e.g. a fused step falling back to eager: say so
            for w in caught:
                if not (str(w.message).startswith("lowprec") or "lowprec" in w.filename):
                    continue  # torch's own chatter while compiling
                msg = f"warning: {str(w.message).splitlines()[0][:100]}"
                if msg not in result.note:
                    result.note = _join(result.note, msg)
        ref_opt, companion_s = _paired_reference(row, base, companions, result)
        est = (result.warmup_times[-1] if result.warmup_times else 0.0) + companion_s
        steps = math.ceil(args.steps / args.rounds)
        if est > 0 and est * steps > budget:
            min_steps = math.ceil(args.min_steps / args.rounds)
            steps = max(min_steps, min(steps, int(budget / est)))
        with _window() as win:
            for _ in range(steps):
                c0, t0 = time.process_time(), _now()
                opt.step()
                t1, c1 = _now(), time.process_time()
                win.times.append(t1 - t0)
                win.cpu_times.append(c1 - c0)
                if companions is not None:
                    if ref_opt is not None:
                        t0 = _now()
                        ref_opt.step()
                        win.ref_times.append(_now() - t0)
                    win.axpy_times.append(companions.axpy())
        if win.wall < MIN_BG_WINDOW_S:
            busy0, cpu0, wall0 = steady
            busy1, cpu1, wall1 = _snapshot()
            win.wall, win.cpu = wall1 - wall0, cpu1 - cpu0
            win.busy = None if busy0 is None or busy1 is None else busy1 - busy0
            if win.wall < MIN_BG_WINDOW_S:
                win.busy = None  # too short for /proc/stat's 10 ms ticks: unknown
        result.windows.append(win)
        if peak_rss is not None and result.rss is None:
            # Memory of a steady step (the state exists, compilation is done), after the timed
            # ones: it starts with the allocator's free pages returned to the OS.
            with _quiet():
                result.rss = peak_rss.measure(opt.step)
        result.numel = sum(p.numel() for p in params)
        result.bytes = footprint(opt, params)
        if not all(bool(torch.isfinite(p).all()) for p in params):
            result.note = _join(result.note, "non-finite parameters after the steps!")
    except Exception as e:  # a peer's API or platform limit: report, keep going
        result.status = "error"
        result.note = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
    finally:
        del opt, params, ref_opt
        gc.collect()


def _join(*notes: str) -> str:
    return "; ".join(n for n in notes if n)


# --------------------------------------------------------------------------------- report


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


#: The CPU features that decide which vector ISA Inductor and ATen use.
_CPU_FEATURES = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16")


def _cpu_features() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    return " ".join(x for x in _CPU_FEATURES if x in have)
    except OSError:
        pass
    return ""


def _cpu_capability() -> str:
    try:
        return torch.backends.cpu.get_cpu_capability()
    except Exception:
        return "?"


def _inductor_isa() -> str:
    """The vector ISA Inductor's C++ kernels are compiled for (``--isa``; its default is the
    widest the CPU has, or ATEN_CPU_CAPABILITY's)."""
    try:
        from torch._inductor import cpu_vec_isa

        isa = cpu_vec_isa.pick_vec_isa()
        return f"{isa} ({isa.bit_width()}-bit)" if isa else "none (scalar C++)"
    except Exception as e:
        return f"? ({type(e).__name__})"


#: --isa: Inductor's ``cpp.simdlen`` (vector width in bits) for each ISA name.
ISA_SIMDLEN = {"default": None, "avx2": 256, "avx512": 512}


def _loadavg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


def _version(mod: str) -> str:
    try:
        with _quiet():
            m = __import__(mod)
        return getattr(m, "__version__", "?")
    except Exception:
        return "not importable"


def _lowprec_source() -> str:
    """lowprec's version and, from a git checkout, its commit and whether src/ has edits."""
    try:
        import lowprec
    except Exception as e:
        return f"not importable ({type(e).__name__})"
    where = os.path.dirname(os.path.abspath(lowprec.__file__))
    desc = getattr(lowprec, "__version__", "?")
    try:
        def git(*a: str) -> str:
            return subprocess.run(["git", "-C", where, *a], capture_output=True, text=True,
                                  timeout=10, check=True).stdout.strip()

        rev = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--", ".")
        desc += f" @ {rev}" + (" + uncommitted edits in src" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return desc


def header(args: argparse.Namespace, d: int, blocks: int, numel: int, n_tensors: int) -> dict:
    return {
        "torch": torch.__version__,
        "lowprec": _lowprec_source(),
        "python": platform.python_version(),
        "optimi": _version("optimi"),
        "torchao": _version("torchao"),
        "timm": _version("timm"),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_capability": _cpu_capability(),
        "cpu_features": _cpu_features(),
        "inductor_isa": _inductor_isa() if DEVICE.type == "cpu" else None,
        "vector_casts": args.vector_casts,
        "device": (torch.cuda.get_device_name(DEVICE) if DEVICE.type == "cuda" else "cpu"),
        "threads": torch.get_num_threads(),
        "params": numel,
        "tensors": n_tensors,
        "d_model": d,
        "blocks": blocks,
        "steps": args.steps,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "row_seconds": args.row_seconds,
    }


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


COLUMNS_HELP = """\
n: timed steps; median, p25-p75, min: wall ms per step(); cpu ms: median process CPU time per
step (all threads); bg: cores other processes kept busy meanwhile (/proc/stat); the statistics
set aside a row's passes with bg > --bg-max (unknown bg: kept) unless every one has it
("contended in every pass");
B/p mv: bytes per parameter a step must move (2x param and state, 1x grad; LAMB, two passes: 3x
param and state, 2x grad); B/p res:
resident param + grad + state bytes per parameter; GB/s: B/p mv x params / median; %axpy: that
over the axpy bandwidth (--paired: the median over the steps of each step's bandwidth over that of
the axpy timed right after it); x fused: median / torch's fused optimizer of the family on fp32
(Adagrad: foreach where fused fails; LAMB: timm's Lamb, "-" without one; --paired: the median over
the steps of each step's time over the reference's step timed right after it); x none: median / the same lowprec
optimizer with master='none' on bf16; compile s: the first step of a compiled row (lowprec: the
first two, the second compiling the calls a redone step shares between parameters; torch.compile
of its step, plus state creation), in seconds; B/p peak: process RSS high-water mark during one
more, untimed step minus the RSS just before it, per parameter (temporaries the step allocates);
peak/res: (B/p res + B/p peak) / B/p res, the step's peak over the resident param + grad + state
bytes ("*": above the target of 1.05)."""


def _paired_x_ref(r: Result) -> float | None:
    """--paired ``x fused``: 1 for a reference row, else the median step / reference-step ratio."""
    if r.paired_ref == r.row.name:
        return 1.0
    ratios = r.ref_ratios
    return statistics.median(ratios) if ratios else None


def build_table(results: list[Result], axpy_bw: float,
                axpy_bytes: float) -> tuple[list[dict], list[str]]:
    """The table; ``axpy_bw`` is the run's axpy bandwidth and ``axpy_bytes`` the bytes one axpy
    moves (what --paired's per-step axpy times are divided into)."""
    by_name = {r.row.name: r for r in results if r.status == "ok" and r.times}
    records, lines = [], []
    cols = [("row", "<", 40), ("n", ">", 2), ("median ms", ">", 9), ("p25-p75 ms", ">", 15),
            ("min ms", ">", 8), ("cpu ms", ">", 7), ("bg", ">", 4), ("Mparam/s", ">", 8),
            ("B/p mv", ">", 6), ("B/p res", ">", 7), ("GB/s", ">", 5), ("%axpy", ">", 5),
            ("x fused", ">", 7), ("x none", ">", 6), ("compile s", ">", 9), ("B/p peak", ">", 8),
            ("peak/res", ">", 8), ("note", "<", 0)]

    def line(values: list[str]) -> str:
        out = [f"{v:{a}{w}}" if w else v for v, (_, a, w) in zip(values, cols, strict=True)]
        return "  ".join(out).rstrip()

    lines.append(line([c for c, _, _ in cols]))
    lines.append(line(["-" * w if w else "----" for _, _, w in cols]))
    family = None
    for r in results:
        if r.row.family != family and family is not None:
            lines.append("")
        family = r.row.family
        rec: dict[str, Any] = {
            "name": r.row.name, "family": r.row.family, "source": r.row.source,
            "dtype": DTYPE_NAMES.get(r.row.dtype, str(r.row.dtype)), "master": r.row.master,
            "variant": r.row.variant, "status": r.status, "note": r.note,
        }
        if r.status != "ok" or not r.times:
            records.append(rec)
            lines.append(line([r.row.name, *[""] * (len(cols) - 2), f"{r.status}: {r.note}"]))
            continue
        q1, med, q3 = _quantiles(r.times)
        cpu_med = statistics.median(r.cpu_times)
        moved_bytes = r.bytes["moved_two_pass" if r.row.family in TWO_PASS_FAMILIES else "moved"]
        moved = moved_bytes / r.numel
        resident = r.bytes["resident"] / r.numel
        gbs = moved_bytes / med
        ref = next((by_name[n] for n in REFERENCE.get(r.row.family, ()) if n in by_name), None)
        x_ref = med / ref.median if ref else None
        frac = gbs / axpy_bw
        x_ref_paired = _paired_x_ref(r)
        frac_paired = (statistics.median(moved_bytes / axpy_bytes / q for q in r.axpy_ratios)
                       if r.axpy_ratios else None)
        x_none = None
        if r.row.source == "lowprec" and r.row.dtype != torch.float32:
            none = by_name.get(_name("lowprec", r.row.family, DTYPE_NAMES[r.row.dtype], "none",
                                     r.row.variant))
            x_none = med / none.median if none else None
        note = r.note
        if r.contended:
            note = _join(note, "contended in every pass")
        first = r.warmup_times[0] if r.warmup_times else None
        compile_s = first if r.row.compiled else None
        if compile_s is not None and r.row.source == "lowprec" and len(r.warmup_times) > 1:
            compile_s += r.warmup_times[1]  # (the second step compiles the shared calls)
        if first is not None and not r.row.compiled and first > max(1.0, 5 * med):
            note = _join(note, f"1st step {first:.1f} s")
        peak_extra = peak_ratio = None
        if r.rss is not None:
            peak_extra = (r.rss[1] - r.rss[0]) / r.numel
            peak_ratio = (r.bytes["resident"] + r.rss[1] - r.rss[0]) / r.bytes["resident"]
        rec.update({
            "steps": len(r.times), "median_ms": med * 1e3, "p25_ms": q1 * 1e3,
            "p75_ms": q3 * 1e3, "min_ms": min(r.times) * 1e3, "max_ms": max(r.times) * 1e3,
            "cpu_median_ms": cpu_med * 1e3, "background_cores": r.background,
            "params_per_s": r.numel / med,
            "bytes_moved_per_param": moved, "bytes_resident_per_param": resident,
            "bytes": r.bytes, "achieved_bytes_per_s": gbs, "fraction_of_axpy": frac,
            "fraction_of_axpy_paired": frac_paired,
            "vs_fused_reference": x_ref, "reference": ref.row.name if ref else None,
            "vs_fused_reference_paired": x_ref_paired,
            "paired_reference": r.paired_ref if x_ref_paired is not None else None,
            "vs_bf16_none": x_none, "compile_s": compile_s,
            "rss_before_step": r.rss[0] if r.rss else None,
            "rss_peak_during_step": r.rss[1] if r.rss else None,
            "peak_bytes_per_param": peak_extra, "peak_over_resident": peak_ratio,
            "warmup_ms": [t * 1e3 for t in r.warmup_times], "times_ms": [t * 1e3 for t in r.times],
            "passes": [{"times_ms": [t * 1e3 for t in w.times], "bg": w.bg,
                        "reference_ms": [t * 1e3 for t in w.ref_times],
                        "axpy_ms": [t * 1e3 for t in w.axpy_times],
                        "used": w in r.used} for w in r.windows],
            "contended": r.contended, "note": note,
        })
        records.append(rec)
        lines.append(line([
            r.row.name, str(len(r.times)), _fmt(med * 1e3, ".1f"),
            f"{q1 * 1e3:.1f}-{q3 * 1e3:.1f}", _fmt(min(r.times) * 1e3, ".1f"),
            _fmt(cpu_med * 1e3, ".0f"), _fmt(r.background, ".1f"),
            _fmt(r.numel / med / 1e6, ".0f"), _fmt(moved, ".1f"), _fmt(resident, ".1f"),
            _fmt(gbs / 1e9, ".1f"),
            _fmt(100 * (frac if frac_paired is None else frac_paired), ".0f"),
            _fmt(x_ref if frac_paired is None else x_ref_paired, ".2f"),
            _fmt(x_none, ".2f"), _fmt(compile_s, ".1f"), _fmt(peak_extra, ".2f"),
            _fmt(peak_ratio, ".2f") + ("*" if peak_ratio and peak_ratio > PEAK_TARGET else ""),
            note,
        ]))
    return records, lines


def ab_ratios(num: Row, den: Row, base: BaseTensors, args: argparse.Namespace,
              companions: Companions | None) -> list[float]:
    """A comparison's two rows timed against each other: both optimizers alive, on parameters of
    their own, stepped in turn (which goes first alternates), each step followed by an axpy when
    --paired gives one; the ratios of the two steps of each turn. The ratio then depends on
    neither a reference nor the machine's speed between the rows' own passes."""
    a = b = None
    try:
        with _quiet(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            a, b = num.make(base.params(num.dtype)), den.make(base.params(den.dtype))
            for _ in range(max(args.warmup, 2)):
                a.step()
                b.step()
            ratios = []
            for turn in range(args.ab_steps):
                times = {}
                for name, opt in ((("a", a), ("b", b)) if turn % 2 == 0
                                  else (("b", b), ("a", a))):
                    t0 = _now()
                    opt.step()
                    times[name] = _now() - t0
                    if companions is not None:
                        companions.axpy()
                ratios.append(times["a"] / times["b"])
        return ratios
    except Exception:  # (the rows' own passes report their errors)
        return []
    finally:
        del a, b
        gc.collect()


def comparisons(results: list[Result], ab: dict[tuple[str, str], list[float]] | None = None
                ) -> tuple[list[dict], list[str]]:
    ok = [r for r in results if r.status == "ok" and r.times]
    records, lines = [], []
    for title, num_pred, den_pred in COMPARISONS:
        if not any(den_pred(r.row) for r in results):
            continue  # the peer was not selected (--rows)
        dens = [r for r in ok if den_pred(r.row)]
        for num in (r for r in ok if num_pred(r.row)):
            if not dens:
                lines.append(f"  {title}: {num.row.name} vs - (the peer was skipped or failed)")
                continue
            den = min(dens, key=lambda r: r.median)
            ratio = num.median / den.median
            # --paired: through the reference both were timed beside, where it is the same one.
            paired = None
            x_num = _paired_x_ref(num)
            ref_name = num.paired_ref
            x_dens = [(x, d) for d in dens
                      if (x := _paired_x_ref(d)) is not None and d.paired_ref == ref_name]
            if x_num is not None and ref_name and len(x_dens) == len(dens):
                x_den, pden = min(x_dens, key=lambda xd: xd[0])
                paired = x_num / x_den
            ab_list = (ab or {}).get((num.row.name, den.row.name)) or []
            ratio_ab = statistics.median(ab_list) if ab_list else None
            records.append({"title": title, "row": num.row.name, "peer": den.row.name,
                            "ratio": ratio, "ratio_paired": paired, "ratio_ab": ratio_ab,
                            "ab_steps": len(ab_list),
                            "peer_paired": pden.row.name if paired is not None else None,
                            "paired_reference": ref_name if paired is not None else None})
            lines.append(f"  {title:<44} {num.row.name:<42} / {den.row.name:<32} "
                         f"{ratio:6.2f}x" + (f"  paired {paired:5.2f}x"
                                              + (f" ({pden.row.name})" if pden is not den else "")
                                              if paired is not None else "")
                         + (f"  A/B {ratio_ab:5.2f}x" if ratio_ab is not None else ""))
    return records, lines


# ----------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--params-millions", type=float, default=25.0,
                   help="parameter count to aim for; sets the number of blocks (default: 25)")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default: 2)")
    p.add_argument("--device", default="cpu",
                   help="where the parameters, gradients and state live: cpu, or cuda[:N] "
                        "(default: cpu; the peak-RSS column then measures host memory only)")
    p.add_argument("--isa", choices=sorted(ISA_SIMDLEN), default="default",
                   help="the vector ISA of Inductor's C++ kernels (lowprec's compiled step, "
                        "torch.compile'd peers): its cpp.simdlen, 256 for avx2, 512 for avx512; "
                        "ATen's own kernels (torch.optim's fused rows) keep theirs, which "
                        "ATEN_CPU_CAPABILITY=avx2 would change too (default: Inductor's choice)")
    p.add_argument("--vector-casts", action=argparse.BooleanOptionalAction, default=True,
                   help="compile lowprec's kernels with bit casts as vector casts "
                        "(lowprec.optim.vector_casts); --no-vector-casts leaves Inductor's "
                        "scalar casts, to measure what they cost (default: on)")
    p.add_argument("--steps", type=int, default=15, help="timed steps per row (default: 15)")
    p.add_argument("--warmup", type=int, default=3,
                   help="untimed steps first; they create the state (default: 3)")
    p.add_argument("--row-seconds", type=float, default=6.0,
                   help="time budget for a row's timed steps (all rounds): slow rows run fewer "
                        "steps, at least --min-steps, and warm up less (default: 6)")
    p.add_argument("--min-steps", type=int, default=3,
                   help="fewest timed steps a slow row gets, over all rounds (default: 3)")
    p.add_argument("--rounds", type=int, default=3,
                   help="go through all rows this many times, each time with fresh parameters and "
                        "state and a share of --steps and --row-seconds, pooling the samples: "
                        "spreads the load swings of a shared machine over every row (default: 3)")
    p.add_argument("--bg-max", type=float, default=0.3,
                   help="a pass during which other processes kept more than this many cores busy "
                        "is contended: a row's statistics set its contended passes aside when it "
                        "has others (default: 0.3; inf keeps every pass)")
    p.add_argument("--retries", type=int, default=2,
                   help="extra passes, after the rounds, over the rows that were contended in "
                        "every pass so far, cheapest first (default: 2)")
    p.add_argument("--retry-seconds", type=float, default=30.0,
                   help="time budget of all the retries together (default: 30)")
    p.add_argument("--rows", default="",
                   help="comma-separated substrings: run only the rows whose name contains one "
                        "(and the x fused reference rows of their family); see --list")
    p.add_argument("--lowprec-variants", default=",".join(DEFAULT_VARIANTS),
                   help=f"comma-separated lowprec implementations to time, of "
                        f"{', '.join(LOWPREC_VARIANTS)} (default: {','.join(DEFAULT_VARIANTS)})")
    p.add_argument("--axpy-millions", type=float, default=64.0,
                   help="elements (2**20) of each axpy operand (default: 64)")
    p.add_argument("--paired", action=argparse.BooleanOptionalAction, default=True,
                   help="time the family's reference optimizer and an axpy right after each step "
                        "and take %%axpy, x fused and the comparisons from those per-step ratios "
                        "(default: on)")
    p.add_argument("--ab-steps", type=int, default=15,
                   help="after the rounds, time each comparison's two rows against each other, "
                        "stepped in turn this many times, for the A/B ratio (default: 15; 0: "
                        "off)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: ~0.1M parameters, 3 steps, 1 warmup, 1 round, no retries, "
                        "16M-element axpy")
    p.add_argument("--list", action="store_true", help="print the row names and exit")
    args = p.parse_args(argv)
    if args.quick:
        # 0.1M parameters (d_model 64): every row's code runs, and Muon's BF16 matmuls stay
        # cheap where torch's BF16 matmul has no fast kernel (AVX2-only x86: at 2M parameters
        # its seven Muon rows took 7 s a step, 500 of the smoke run's 630 s).
        args.params_millions, args.steps, args.warmup, args.axpy_millions = 0.1, 3, 1, 16.0
        args.rounds, args.retries, args.ab_steps = 1, 0, 3
    for v in args.lowprec_variants.split(","):
        if v and v not in LOWPREC_VARIANTS:
            p.error(f"unknown lowprec variant {v!r}; known: {', '.join(LOWPREC_VARIANTS)}")
    if (args.steps < 1 or args.warmup < 0 or args.rounds < 1 or args.min_steps < 1
            or args.retries < 0 or args.ab_steps < 0):
        p.error("--steps, --rounds and --min-steps must be >= 1, --warmup, --retries and "
                "--ab-steps >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.isa != "default":
        import torch._inductor.config as inductor_config

        inductor_config.cpp.simdlen = ISA_SIMDLEN[args.isa]
    if not args.vector_casts:
        from lowprec.optim import vector_casts

        vector_casts._TARGET = None
    global DEVICE
    DEVICE = torch.device(args.device)
    if DEVICE.type == "cuda" and not torch.cuda.is_available():
        print(f"--device {args.device}: this torch sees no CUDA device; run on a GPU machine or "
              "leave --device out for the CPU", file=sys.stderr)
        return 2
    variants = [v for v in args.lowprec_variants.split(",") if v]
    rows = peer_rows() + lowprec_rows(variants)
    if args.rows:
        wanted = [s.strip() for s in args.rows.split(",") if s.strip()]
        families = {r.family for r in rows if any(s in r.name for s in wanted)}
        # The family's reference rows stay in: the x fused column divides by them.
        rows = [r for r in rows if any(s in r.name for s in wanted)
                or (r.family in families and r.name in REFERENCE.get(r.family, ()))]
    # Group the table by family (FAMILIES' order); within a family peers come first.
    rows.sort(key=lambda r: (FAMILIES.index(r.family) if r.family in FAMILIES else len(FAMILIES),
                             r.source == "lowprec"))
    if args.list:
        print("\n".join(r.name + (f"  (skipped: {r.skip})" if r.skip else "") for r in rows))
        return 0
    if not rows:
        print("no row matches --rows", file=sys.stderr)
        return 2

    t_start = _now()
    load_start = _loadavg()
    d, blocks, shapes = layout(args.params_millions)
    base = BaseTensors.make(shapes)
    numel = sum(v.numel() for v in base.values)
    info = header(args, d, blocks, numel, len(shapes))
    print(f"optimizer step benchmark: lowprec {info['lowprec']}")
    print(f"torch {info['torch']}, python {info['python']}, optimi {info['optimi']}, "
          f"torchao {info['torchao']}, timm {info['timm']}")
    print(f"cpu: {info['cpu']} ({info['cpu_capability']}), {info['cpu_count']} logical cpus, "
          f"torch threads {info['threads']}; load average at start {load_start}")
    if DEVICE.type == "cpu":
        print(f"cpu vector features: {info['cpu_features'] or 'none of ' + ' '.join(_CPU_FEATURES)}"
              f"; Inductor's C++ ISA: {info['inductor_isa']}; lowprec's bit casts: "
              f"{'vector casts' if args.vector_casts else 'Inductor scalar casts (--no-vector-casts)'}")
    print(f"device: {info['device']}")
    print(f"params: {numel / 1e6:.2f}M in {len(shapes)} tensors ({blocks} blocks, d_model {d}); "
          f"{args.warmup} warmup + up to {args.steps} timed steps per row"
          f" (fewer past {args.row_seconds:g} s), {args.rounds} round(s)")

    peak_rss = PeakRSS()
    info["peak_rss_method"] = peak_rss.method
    print(f"peak memory of a step: {peak_rss.method} (RSS high-water mark during one untimed "
          f"step, allocator trimmed first)")

    n_axpy = int(args.axpy_millions * 2**20)
    axpy = [axpy_bandwidth(n_axpy, reps=10)]

    def axpy_bw(w: Window) -> float:
        return 12 * n_axpy / statistics.median(w.times)

    print(f"axpy a.add_(b, alpha=s), {n_axpy / 2**20:g}M fp32 elements: "
          f"{statistics.median(axpy[0].times) * 1e3:.1f} ms median = {axpy_bw(axpy[0]) / 1e9:.1f}"
          f" GB/s (bg {_fmt(axpy[0].bg, '.1f')})", flush=True)

    results = {r.name: Result(r, status="skipped" if r.skip else "ok", note=r.skip,
                              bg_max=args.bg_max) for r in rows}
    companions = None
    if args.paired:
        companions = Companions({r.name: r for r in rows}, results, torch.randn(n_axpy, device=DEVICE),
                                torch.randn(n_axpy, device=DEVICE))

    def one_pass(label: str, todo: list[Row], deadline: float = math.inf) -> None:
        for r in todo:
            res = results[r.name]
            t0 = _now()
            if res.pass_seconds and t0 + res.pass_seconds[-1] > deadline:
                continue  # would overrun the retry budget
            run_row(r, base, args, res, peak_rss, companions)
            if res.status == "ok":
                w = res.windows[-1]
                print(f"  {label}{r.name}: {statistics.median(w.times) * 1e3:.1f} ms median of "
                      f"{len(w.times)}, bg {_fmt(w.bg, '.1f')} ({_now() - t0:.1f} s)",
                      file=sys.stderr, flush=True)
            else:
                print(f"  {label}{r.name}: {res.status}: {res.note}", file=sys.stderr, flush=True)

    for rnd in range(args.rounds):
        one_pass(f"round {rnd + 1}/{args.rounds} " if args.rounds > 1 else "",
                 [r for r in rows if results[r.name].status == "ok"])
        axpy.append(axpy_bandwidth(n_axpy, reps=10))
    deadline = _now() + args.retry_seconds
    for rt in range(args.retries):
        todo = [r for r in rows if results[r.name].status == "ok" and results[r.name].contended]
        todo.sort(key=lambda r: results[r.name].pass_seconds[-1])
        if _is_contended(axpy, args.bg_max):
            axpy.append(axpy_bandwidth(n_axpy, reps=10))
        if not todo or _now() >= deadline:
            break
        one_pass(f"retry {rt + 1}/{args.retries} (contended) ", todo, deadline)

    ordered = [results[r.name] for r in rows]
    ab: dict[tuple[str, str], list[float]] = {}
    if args.ab_steps:
        # Each comparison's row against its (fastest) peer, head to head.
        for rec in comparisons(ordered)[0]:
            num, den = results[rec["row"]].row, results[rec["peer"]].row
            ab[(num.name, den.name)] = ab_ratios(num, den, base, args, companions)
            if ab[(num.name, den.name)]:
                print(f"  A/B {num.name} / {den.name}: "
                      f"{statistics.median(ab[(num.name, den.name)]):.2f}x", file=sys.stderr,
                      flush=True)

    axpy_used = _clean(axpy, args.bg_max)
    axpy_ref = statistics.median([axpy_bw(w) for w in axpy_used])
    records, lines = build_table(ordered, axpy_ref, 12 * n_axpy)
    comp_records, comp_lines = comparisons(ordered, ab)
    runtime = _now() - t_start
    print(f"axpy over the run: {', '.join(f'{axpy_bw(w) / 1e9:.1f}' for w in axpy)} GB/s "
          f"(bg {', '.join(_fmt(w.bg, '.1f') for w in axpy)}); reference for %axpy: "
          f"{axpy_ref / 1e9:.1f} GB/s (median of "
          + ("all, every one contended)" if _is_contended(axpy, args.bg_max)
             else f"the {len(axpy_used)} uncontended)"))
    n_cont = sum(r.contended for r in ordered if r.status == "ok")
    print(f"load average at end {_loadavg()}; rows contended in every pass: {n_cont} "
          f"(bg > {args.bg_max:g}); total runtime {runtime:.0f} s")
    print()
    print("\n".join(lines))
    print()
    print(COLUMNS_HELP)
    if comp_lines:
        print()
        print("comparisons (median / median; < 1 means lowprec is faster"
              + ("; paired: x fused / x fused, each against the reference timed beside it"
                 if args.paired else "")
              + ("; A/B: the median ratio of the two stepped in turn, both alive"
                 if args.ab_steps else "") + "):")
        print("\n".join(comp_lines))
    if args.json:
        payload = {"header": {**info, "load_average_start": load_start,
                              "load_average_end": _loadavg(), "runtime_s": runtime,
                              "bg_max": args.bg_max, "retries": args.retries},
                   "axpy": [{"bytes_per_s": axpy_bw(w), "bg": w.bg,
                             "times_ms": [t * 1e3 for t in w.times]} for w in axpy],
                   "axpy_bytes_per_s": axpy_ref, "rows": records, "comparisons": comp_records}
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
