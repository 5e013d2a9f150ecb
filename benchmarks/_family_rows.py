"""The rows of ``optimizer_step.py`` for the optimizers beside its first four families: Adam,
RAdam, Lion, StableAdamW, Adafactor and Muon, each with its peers (torch.optim's fastest step of
the same optimizer on FP32, optimi's Kahan-summed BF16 step) and lowprec's strategies. Kept apart
so that the benchmark script stays readable; nothing here is meant to be imported elsewhere.

    python benchmarks/optimizer_step.py --rows -lion-,-muon- --lowprec-variants default

Muon takes matrices only: its rows step the model's 2-D weights with Muon and its vectors with
AdamW (lowprec: one optimizer with a ``use_muon=False`` group; torch: ``torch.optim.Muon`` and
fused ``torch.optim.AdamW`` side by side, stepped one after the other).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

FAMILIES = ("adam", "radam", "lion", "stableadamw", "adafactor", "muon")
LR = {"adam": 1e-3, "radam": 1e-3, "lion": 1e-4, "stableadamw": 1e-3, "adafactor": 1e-2,
      "muon": 2e-2}
TITLES = {"adam": "Adam", "radam": "RAdam", "lion": "Lion", "stableadamw": "StableAdamW",
          "adafactor": "Adafactor", "muon": "Muon"}
#: The x fused column's denominator: torch's fastest FP32 step of the optimizer, or optimi's
#: FP32 step where torch has none (Lion, StableAdamW).
REFERENCE = {
    "adam": ("torch-adam-fp32-fused",),
    "radam": ("torch-radam-fp32-foreach",),
    "lion": ("optimi-lion-fp32-foreach",),
    "stableadamw": ("optimi-stableadamw-fp32-foreach",),
    "adafactor": ("torch-adafactor-fp32-foreach", "torch-adafactor-fp32-loop"),
    "muon": ("torch-muon-fp32-loop",),
}
#: Their update reads the whole tensor before writing (StableAdamW's RMS, Adafactor's means).
TWO_PASS = ("stableadamw", "adafactor")


class _Both:
    """Two optimizers stepped as one (torch's Muon for the matrices, AdamW for the rest)."""

    def __init__(self, *opts: torch.optim.Optimizer) -> None:
        self.opts = opts
        self.state = {k: v for o in opts for k, v in o.state.items()}
        self.param_groups = [g for o in opts for g in o.param_groups]

    def step(self) -> None:
        for o in self.opts:
            o.step()
        self.state = {k: v for o in self.opts for k, v in o.state.items()}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.opts:
            o.zero_grad(set_to_none=set_to_none)


def _split(params: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return [p for p in params if p.dim() == 2], [p for p in params if p.dim() != 2]


def peer_rows(Row: Any, name: Callable[..., str]) -> list[Any]:
    rows = []
    for fam, cls, variants in (("adam", torch.optim.Adam, ("fused", "foreach")),
                               ("radam", torch.optim.RAdam, ("foreach",)),
                               ("adafactor", torch.optim.Adafactor, ("foreach", "loop"))):
        for variant in variants:
            kw = {} if variant == "loop" else {variant: True}

            def make(params, cls=cls, kw=kw, fam=fam):
                return cls(params, lr=LR[fam], **kw)

            rows.append(Row(name("torch", fam, "fp32", variant), fam, "torch", torch.float32,
                            make, "none", variant))

    def muon(params):
        mats, rest = _split(params)
        return _Both(torch.optim.Muon(mats, lr=LR["muon"]),
                     torch.optim.AdamW(rest, lr=1e-3, fused=True))

    rows.append(Row(name("torch", "muon", "fp32", "loop"), "muon", "torch", torch.float32,
                    muon, "none", "loop"))
    try:
        import optimi
    except Exception as e:
        return rows + [Row(name("optimi", fam, "fp32-foreach"), fam, "optimi", torch.float32,
                           None, skip=f"optimi not importable: {type(e).__name__}")
                       for fam in ("lion", "stableadamw")]
    for fam, cls_name in (("adam", "Adam"), ("radam", "RAdam"), ("lion", "Lion"),
                          ("stableadamw", "StableAdamW")):
        cls = getattr(optimi, cls_name, None)
        for dtype, master in ((torch.float32, "none"), (torch.bfloat16, "kahan")):
            if fam in ("adam", "radam") and dtype == torch.float32:
                continue  # (torch's own FP32 step is the reference)
            row = name("optimi", fam, "fp32" if dtype == torch.float32 else "bf16-kahan",
                       "foreach")
            if cls is None or "foreach" not in inspect.signature(cls.__init__).parameters:
                rows.append(Row(row, fam, "optimi", dtype, None, master, "foreach",
                                skip=f"optimi.{cls_name} missing or takes no foreach"))
                continue

            def make(params, cls=cls, fam=fam, kahan=master == "kahan"):
                return cls(params, lr=LR[fam], kahan_sum=kahan, foreach=True, triton=False)

            rows.append(Row(row, fam, "optimi", dtype, make, master, "foreach"))
    return rows


def lowprec_rows(Row: Any, name: Callable[..., str], variants: dict[str, dict[str, Any]],
                 compiles: Callable[[dict[str, Any]], bool]) -> list[Any]:
    import lowprec.optim as lo

    classes = {"adam": lo.Adam, "radam": lo.RAdam, "lion": lo.Lion,
               "stableadamw": lo.StableAdamW, "adafactor": lo.Adafactor, "muon": lo.Muon}
    configs = [(torch.float32, "none", None),
               *((torch.bfloat16, m, None) for m in ("none", "kahan", "split", "stochastic")),
               (torch.bfloat16, "kahan", "8bit")]
    rows = []
    for variant, vkw in variants.items():
        for fam in FAMILIES:
            cls = classes[fam]
            for dtype, master, sd in configs:
                if fam == "adafactor" and sd == "8bit":
                    continue  # (no moments: its factored statistics stay FP32)
                kwargs = {"lr": LR[fam], "master": master, **vkw}
                if sd is not None:
                    kwargs["state_dtype"] = sd

                def make(params, cls=cls, kwargs=kwargs, fam=fam):
                    if fam == "muon":
                        mats, rest = _split(params)
                        params = [{"params": mats},
                                  {"params": rest, "use_muon": False, "lr": 1e-3}]
                    return cls(params, **kwargs)

                rows.append(Row(
                    name("lowprec", fam, {torch.float32: "fp32"}.get(dtype, "bf16"), master,
                         "state8bit" if sd else "", variant),
                    fam, "lowprec", dtype, make, master, variant, sd,
                    compiled=compiles(vkw) and fam not in ("adafactor",)))
    return rows


def comparisons(is_: Callable[..., Callable[[Any], bool]]) -> list[tuple]:
    """For each family: BF16 + Kahan (the default, BF16 moments) against the reference, against
    optimi's BF16 Kahan step where it has one, and 8-bit state against BF16 state."""
    out = []
    for fam in FAMILIES:
        title = TITLES[fam]
        kahan = is_(source="lowprec", family=fam, dtype=torch.bfloat16, master="kahan",
                    state_dtype=None)
        out.append((f"{title} bf16 kahan vs {REFERENCE[fam][0]}", kahan,
                    lambda r, fam=fam: r.name in REFERENCE[fam]))
        if fam in ("adam", "radam", "lion", "stableadamw"):
            out.append((f"{title} bf16 kahan vs optimi {title} bf16 kahan", kahan,
                        is_(source="optimi", family=fam, master="kahan")))
        if fam != "adafactor":
            out.append((f"{title} bf16 kahan 8-bit vs bf16 kahan",
                        is_(source="lowprec", family=fam, dtype=torch.bfloat16, master="kahan",
                            state_dtype="8bit"), kahan))
    return out
