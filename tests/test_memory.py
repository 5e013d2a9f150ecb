"""Memory per parameter: the analytic figures against a hand-made table, and against tensors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lowprec import memory, recipes
from lowprec.optim import AdamW

# (weights, grads, optimizer_state, master) bytes per element, by hand from the recipes' table:
# FP32 weights for fp32/amp-*; BF16/FP16 weights otherwise; update-rule state in FP32 under the
# "fp32" and "split" strategies and in the weight dtype otherwise; FP32 copy 4, trail 2,
# compensation 2 (the weight dtype).
ADAM_LIKE = {  # two moments
    "fp32": (4, 4, 8, 0),
    "amp-bf16": (4, 4, 8, 0),
    "amp-fp16": (4, 4, 8, 0),
    "bf16": (2, 2, 4, 0),
    "bf16-kahan": (2, 2, 4, 2),
    "bf16-split": (2, 2, 8, 2),
    "bf16-sr": (2, 2, 4, 0),
    # 8-bit state: a byte per element and an FP32 scale per 256 (a parameter large enough)
    "bf16-kahan-8bit": (2, 2, 2 * (1 + 4 / 256), 2),
    "bf16-split-8bit": (2, 2, 2 * (1 + 4 / 256), 2),
    # each parameter stepped in backward, its gradient freed: none held per element
    "bf16-kahan-8bit-release": (2, 0, 2 * (1 + 4 / 256), 2),
    "bf16-kahan-4bit": (2, 2, 2 * (0.5 + 4 / 256), 2),
    "bf16-kahan-4bit-release": (2, 0, 2 * (0.5 + 4 / 256), 2),
    "fp16-master": (2, 2, 8, 4),
    "dfp16": (4, 4, 8, 0),  # FP32 masters; DFP-16 exists only inside Linear/Conv2d products
}
ONE_BUFFER = {  # SGD's momentum (0.9 by default here), Adagrad's sum
    "fp32": (4, 4, 4, 0),
    "amp-bf16": (4, 4, 4, 0),
    "amp-fp16": (4, 4, 4, 0),
    "bf16": (2, 2, 2, 0),
    "bf16-kahan": (2, 2, 2, 2),
    "bf16-split": (2, 2, 4, 2),
    "bf16-sr": (2, 2, 2, 0),
    "bf16-kahan-8bit": (2, 2, 1 + 4 / 256, 2),
    "bf16-split-8bit": (2, 2, 1 + 4 / 256, 2),
    "bf16-kahan-8bit-release": (2, 0, 1 + 4 / 256, 2),
    "bf16-kahan-4bit": (2, 2, 0.5 + 4 / 256, 2),
    "bf16-kahan-4bit-release": (2, 0, 0.5 + 4 / 256, 2),
    "fp16-master": (2, 2, 4, 4),
    "dfp16": (4, 4, 4, 0),
}
# The block-format recipes hold what their master's BF16 recipe holds: the formats live only
# inside the GEMMs.
BLOCK_LIKE = {"mxfp8": "bf16-kahan", "mxfp8-split": "bf16-split", "mxfp8-8bit": "bf16-kahan-8bit",
              "mxfp8-bf16": "bf16", "mxfp6": "bf16-kahan", "mxfp4": "bf16-kahan",
              "nvfp4": "bf16-kahan", "nvfp4-bf16": "bf16", "nvfp4-bare": "bf16-kahan",
              "nvfp4-no-2d": "bf16-kahan", "nvfp4-no-sr": "bf16-kahan",
              "nvfp4-no-rht": "bf16-kahan", "nvfp4-no-edges": "bf16-kahan"}
for _table in (ADAM_LIKE, ONE_BUFFER):
    _table.update({name: _table[like] for name, like in BLOCK_LIKE.items()})
# Adafactor: no moment per element (its row and column means are O(rows + cols)); Muon: the
# momentum of the matrices it steps.
NO_BUFFER = {r: (w, g, 0, m) for r, (w, g, _, m) in ONE_BUFFER.items()}
HAND = {"adamw": ADAM_LIKE, "lamb": ADAM_LIKE, "sgd": ONE_BUFFER, "adagrad": ONE_BUFFER,
        "adam": ADAM_LIKE, "radam": ADAM_LIKE, "stableadamw": ADAM_LIKE, "lion": ONE_BUFFER,
        "muon": ONE_BUFFER, "adafactor": NO_BUFFER}
#: Optimizers whose every parameter's state is per element, so that measured == expected on any
#: model (Muon steps vectors with AdamW; Adafactor's statistics are per row and column).
PER_ELEMENT = [k for k in HAND if k not in ("muon", "adafactor")]
FIGURES = ("weights", "grads", "optimizer_state", "master")


def _mlp():
    return nn.Sequential(nn.Linear(16, 24), nn.ReLU(), nn.Linear(24, 8), nn.Linear(8, 3))


@pytest.mark.parametrize("optimizer", list(HAND))
@pytest.mark.parametrize("recipe", recipes.RECIPES)
def test_expected_matches_the_hand_table(optimizer, recipe):
    e = memory.expected(optimizer, recipe)
    assert tuple(e[k] for k in FIGURES) == HAND[optimizer][recipe]
    assert e["other"] == 0.0 and e["accumulation"] == 0.0
    assert e["total"] == sum(HAND[optimizer][recipe])


@pytest.mark.parametrize(
    "optimizer, recipe, hyperparameters, state, master",
    [
        ("adamw", "bf16", {"amsgrad": True}, 6, 0),  # a third moment
        ("adamw", "bf16-kahan", {"state_dtype": torch.float32}, 8, 2),
        ("sgd", "bf16-split", {"lr": 0.1}, 0, 2),  # no momentum, no buffer
        ("adagrad", "fp16-master", {"state_dtype": torch.bfloat16}, 2, 4),
    ],
)
def test_expected_follows_the_hyperparameters(optimizer, recipe, hyperparameters, state, master):
    e = memory.expected(optimizer, recipe, hyperparameters=hyperparameters)
    assert (e["optimizer_state"], e["master"]) == (state, master)


@pytest.mark.parametrize("optimizer", PER_ELEMENT)
def test_measured_equals_expected_without_kept_layers(optimizer):
    rows = memory.table(optimizer, model=_mlp, keep_fp32=())
    assert [r["recipe"] for r in rows] == list(recipes.RECIPES)
    model = _mlp()
    numel = sum(p.numel() for p in model.parameters())
    tensors = len(list(model.parameters()))
    for row in rows:
        e, m, b = row["expected"], row["measured"], row["measured_bytes"]
        assert {k: m[k] for k in FIGURES} == {k: e[k] for k in FIGURES}, row["recipe"]
        # one 4-byte FP32 step counter per parameter tensor
        assert b["other"] == 4 * tensors
        assert b["total"] == e["total"] * numel + 4 * tensors
        assert m["total"] == pytest.approx(e["total"] + 4 * tensors / numel, rel=1e-12)


def test_table_without_a_model_has_no_measurement():
    rows = memory.table("adamw")
    assert all(r["measured"] is None and r["measured_bytes"] is None for r in rows)
    assert [r["expected"]["total"] for r in rows] == [sum(ADAM_LIKE[r["recipe"]]) for r in rows]
    assert [r["expected"]["total"] for r in rows if r["recipe"] in ("fp32", "bf16-kahan")] == [
        16, 10]


def test_kept_fp32_layers_show_in_the_measurement():
    def make():
        return nn.Sequential(nn.Linear(10, 10), nn.LayerNorm(10))

    model = make()
    (bf16,) = [r for r in memory.table("adamw", model=model) if r["recipe"] == "bf16"]
    # Linear in BF16 (2 bytes), LayerNorm kept in FP32 (4 bytes): weights and grads alike, and
    # the moments follow each parameter's dtype.
    assert bf16["measured_bytes"]["weights"] == 110 * 2 + 20 * 4
    assert bf16["measured_bytes"]["grads"] == 110 * 2 + 20 * 4
    assert bf16["measured_bytes"]["optimizer_state"] == 2 * (110 * 2 + 20 * 4)
    assert bf16["measured"]["weights"] > bf16["expected"]["weights"]
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the model was copied


def test_measure_counts_bytes_by_category():
    model = nn.Linear(3, 2)  # 8 elements in 2 tensors
    opt = AdamW(model.parameters())
    r = memory.measure(model, opt)
    assert r.numel == 8
    assert r.bytes == {"weights": 32, "grads": 0, "optimizer_state": 0, "master": 0,
                       "accumulation": 0, "other": 0,
                       "total": 32}
    assert memory.measure(model, opt, assume_grads=True).bytes["grads"] == 32
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    r = memory.measure(model, opt)
    assert r.bytes == {"weights": 32, "grads": 32, "optimizer_state": 64, "master": 0,
                       "accumulation": 0, "other": 8,
                       "total": 136}
    assert r.bytes_per_param["total"] == 136 / 8


def test_measure_a_torch_optimizer():
    model = nn.Linear(3, 2).to(torch.bfloat16)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 3, dtype=torch.bfloat16)).sum().backward()
    opt.step()
    r = memory.measure(model, opt)
    # moments in the parameter's dtype, a 4-byte FP32 step tensor per parameter
    assert (r.bytes["optimizer_state"], r.bytes["master"], r.bytes["other"]) == (32, 0, 8)


def test_tied_and_shared_weights_count_once():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 4)
            self.head = nn.Linear(4, 10, bias=False)
            self.head.weight = self.emb.weight  # tied

    model = Tied()
    model.head(model.emb(torch.tensor([1, 2]))).sum().backward()
    r = memory.measure(model)
    assert (r.numel, r.bytes["weights"], r.bytes["grads"]) == (40, 160, 160)

    shared = nn.Module()
    base = torch.zeros(6)
    shared.a, shared.b = nn.Parameter(base), nn.Parameter(base)  # two Parameters, one storage
    assert memory.measure(shared).bytes["weights"] == 24 and memory.measure(shared).numel == 6


def test_assume_grads_skips_frozen_parameters():
    model = nn.Linear(4, 4)  # 20 elements
    model.bias.requires_grad_(False)
    assert memory.measure(model, assume_grads=True).bytes["grads"] == 16 * 4


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: memory.expected("adamax", "bf16"), ValueError, "unknown optimizer 'adamax'"),
        (lambda: memory.expected("adamw", "bf8"), ValueError, "unknown recipe 'bf8'"),
        (lambda: memory.expected("sgd", "bf16", hyperparameters=[1]), TypeError, "must be a dict"),
        (lambda: memory.measure("model"), TypeError, "takes an nn.Module"),
        (lambda: memory.measure(nn.Linear(2, 2), "opt"), TypeError, "torch.optim.Optimizer"),
        (lambda: memory.table("sgd", model=3), TypeError, "must be an nn.Module"),
        (lambda: memory.table("sgd", model=lambda: 3), TypeError, "function returning int"),
    ],
)
def test_bad_input(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_muon_and_adafactor_measured_on_a_model():
    model = _mlp()
    (muon,) = [r for r in memory.table("muon", model=model) if r["recipe"] == "bf16-kahan"]
    b = muon["measured_bytes"]
    mats = sum(m.weight.numel() for m in model if isinstance(m, nn.Linear))
    vecs = sum(m.bias.numel() for m in model if isinstance(m, nn.Linear))
    # BF16 momentum for the matrices, BF16 AdamW moments for the biases (muon_param_groups)
    assert b["optimizer_state"] == 2 * mats + 4 * vecs
    (ada,) = [r for r in memory.table("adafactor", model=model) if r["recipe"] == "bf16-kahan"]
    rows_cols = sum(sum(m.weight.shape) for m in model if isinstance(m, nn.Linear))
    # FP32 row and column means for the matrices, a BF16 variance for the biases
    assert ada["measured_bytes"]["optimizer_state"] == 4 * rows_cols + 2 * vecs
