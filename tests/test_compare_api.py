"""``lowprec.compare`` on a model of the caller's: its options, its result, and every bad input
refused with a message naming the fix, before any step (``on_step`` is never called) and within
seconds.

References: the built-in machinery run on the same task (``comparison.compare``), and the
recipes' own FP32 run (its first loss is the model's own loss on the first batch).
"""

from __future__ import annotations

import json
import math
import time

import pytest
import torch
from torch import nn

import lowprec
from lowprec.comparison import config


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.LayerNorm(16), nn.Linear(16, 3))


def _data(n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 8, generator=gen), torch.randint(0, 3, (16,), generator=gen))
            for _ in range(n)]


RECIPES = ["fp32", "bf16", "bf16-split"]
FAST = {"fused": False, "device": "cpu", "recipes": RECIPES, "lr": 1e-3, "monitor_every": 2}


def test_the_result_holds_rows_recommendation_parameters_and_json(tmp_path):
    net, data = _net(), _data(10)
    seen: list[tuple[str, int]] = []
    result = lowprec.compare(net, data[:8], data[8:], steps=8, seeds=2,
                             on_step=lambda name, step, loss: seen.append((name, step)), **FAST)
    assert [r["recipe"] for r in result.rows] == RECIPES
    assert len(result.records) == 6 and len(seen) == 2 * 8 * 3
    assert result.noise_floor is not None and result.noise_floor >= 0
    for r in result.rows:
        assert r["seeds"] == [0, 1] and len(r["losses"]) == 8
        assert r["eval_loss_std"] is not None
    # The same batches for both seeds (an iterable is read once), the same start: FP32's first
    # loss is the model's own on the first batch, for every seed.
    with torch.no_grad():
        first = float(nn.functional.cross_entropy(net(data[0][0]), data[0][1]))
    for rec in result.records:
        if rec["recipe"] == "fp32":
            assert rec["losses"][0] == pytest.approx(first, rel=1e-6)
    assert result.parameters["baseline"] == "bf16"
    assert {p["name"] for p in result.parameters["parameters"]} <= {
        n for n, _ in net.named_parameters()}
    saved = result.to_json(tmp_path / "c.json")
    assert json.loads((tmp_path / "c.json").read_text())["summary"][0]["recipe"] == "fp32"
    assert saved["recommendation"] == result.recommendation
    assert "bf16-split" in str(result) and "recommended:" in str(result)
    with pytest.raises(KeyError, match="no recipe 'x'"):
        result.row("x")


def test_the_optimizers_hyperparameters_reach_it():
    # The caller's betas and decay, over compare's own weight decay 0.01: read from each
    # recipe's optimizer as built.
    from lowprec.comparison import run

    seen = []
    real = run._Run.__init__

    def spy(self, *args, **kwargs):
        real(self, *args, **kwargs)
        seen.append(dict(self.opt.param_groups[0]))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(run._Run, "__init__", spy)
        lowprec.compare(_net(), _data(4), _data(1, 9), steps=2,
                        optimizer_options={"betas": (0.5, 0.75), "weight_decay": 0.0}, **FAST)
    assert seen and all(g["betas"] == (0.5, 0.75) and g["weight_decay"] == 0.0 for g in seen)


def test_a_model_function_a_batch_function_and_a_loss_of_ones_own():
    calls: list[int] = []

    def batches(seed):
        calls.append(seed)
        return _data(6, seed)

    def loss(model, batch):
        x, y = batch
        return nn.functional.cross_entropy(model(x).float(), y)

    result = lowprec.compare(_net, batches, _data(2, 9), loss=loss, steps=6, seeds=2, **FAST)
    assert set(calls) == {0, 1}  # (a function of the seed: each seed its own batches)
    a, b = (r for r in result.records if r["recipe"] == "fp32")
    assert a["losses"] != b["losses"]
    # One generator, read once: its batches serve every seed.
    once = (b for b in _data(6))
    result = lowprec.compare(_net(), once, _data(2, 9), steps=6, seeds=2, **FAST)
    a, b = (r for r in result.records if r["recipe"] == "fp32")
    assert a["losses"] == b["losses"]


def test_the_built_in_task_and_the_api_agree():
    # The command's own task is a Task like a user's: the same records from compare() on it.
    from lowprec.comparison import compare as engine
    from lowprec.comparison.run import builtin_task

    cfg = config.CompareConfig(recipes=("fp32", "bf16"), steps=3, fused=False, device="cpu",
                               model=config.ModelConfig(d_model=32, n_layer=1, n_head=2,
                                                        context=16),
                               batch_size=4, eval_batches=1, monitor_every=0)
    task = builtin_task(cfg, torch.device("cpu"))
    a = engine.compare(cfg)
    b = engine.compare(cfg, task=task)
    assert [r["losses"] for r in a] == [r["losses"] for r in b]
    assert [r["eval_loss"] for r in a] == [r["eval_loss"] for r in b]


def _nan_loss(model, batch):
    return model(batch[0]).sum() * float("nan")


class _Ints(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.arange(4))

    def forward(self, x):
        return x


BAD = {
    "unknown recipe": ({"recipes": ["fp32", "bf17"]}, ValueError, "unknown recipe 'bf17'"),
    "unknown optimizer": ({"optimizer": "adamx"}, ValueError, "unknown optimizer 'adamx'"),
    "no such device": ({"device": "tpu"}, ValueError, "device"),
    "a GPU that is not there": ({"device": "cuda:7"}, ValueError, "no CUDA device"),
    "too few batches": ({"steps": 50}, ValueError, "ran out after 8 of the 50 steps"),
    "a loss that is not a scalar": ({"loss": lambda m, b: m(b[0])}, ValueError,
                                    "scalar tensor, got a tensor of shape"),
    "a NaN loss": ({"loss": _nan_loss}, ValueError, "is nan"),
    "a loss that is not a function": ({"loss": 3}, TypeError, "loss must be a function"),
    "a model in BF16": ({"model": _net().to(torch.bfloat16)}, ValueError, "not FP32"),
    "no floating parameters": ({"model": _Ints()}, ValueError, "no trainable floating"),
    "not a model": ({"model": 3}, TypeError, "nn.Module"),
    "batches that are not batches": ({"train": 3}, TypeError, "train must be an iterable"),
    "a batch of another kind": ({"train": [torch.zeros(2, 8)] * 8}, TypeError,
                                "default loss takes a dict batch"),
    "no eval batches": ({"eval": []}, ValueError, "no eval batches"),
    "a recipe's option among the optimizer's": ({"optimizer_options": {"master": "fp32"}},
                                               ValueError, "may not set master"),
    "an optimizer option it does not take": ({"optimizer_options": {"betaz": 1}}, TypeError,
                                             "betaz"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_refused_before_any_step(case):
    options, error, message = BAD[case]
    if case == "a GPU that is not there" and torch.cuda.device_count() > 7:
        pytest.skip("this machine has a cuda:7")
    kwargs = {**FAST, "steps": 8, **options}
    model = kwargs.pop("model", _net())
    train = kwargs.pop("train", _data(8))
    held_out = kwargs.pop("eval", _data(2, 9))
    steps: list[int] = []
    started = time.perf_counter()
    with pytest.raises(error, match=message):
        lowprec.compare(model, train, held_out, on_step=lambda *a: steps.append(1), **kwargs)
    assert not steps
    assert time.perf_counter() - started < 10


def test_bf16_split_keeps_updates_plain_bf16_loses_on_a_small_learning_rate():
    # A step far below half a BF16 ulp of the weights: plain BF16 loses most of its updates,
    # the split master none (24 steps are too few for the losses to tell them apart).
    net, data = _net(), _data(30)
    result = lowprec.compare(net, data[:24], data[24:], steps=24, **{**FAST, "lr": 1e-5})
    assert result.row("bf16")["lost_update_fraction"] > 0.5
    assert result.row("bf16-split")["lost_update_fraction"] == 0
    assert math.isfinite(result.row("bf16-split")["eval_gap"])
    worst = result.parameters["parameters"][0]
    assert worst["lost"]["bf16"] > 0.5 and worst["lost"]["bf16-split"] == 0
