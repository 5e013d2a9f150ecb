"""``lowprec.compare`` on real models: Hugging Face causal LMs built from configs (Llama, and
GPT-2 with its tied embedding) with dict batches, an image classifier (Hugging Face's ResNet,
BatchNorm buffers) with tuple batches, and a model with integer buffers and frozen parameters.

Each run is short and eager (``fused=False``): what is checked is that every recipe starts from
the same FP32 weights and sees the same batches, that the records name each parameter once, and
that the user's model is left as it was. References: an FP32 run of the same recipe machinery
(its first loss is the FP32 model's own), and the model's ``named_parameters()``.
"""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from transformers import ResNetConfig, ResNetForImageClassification

import lowprec
from tests.integrations._models import SEQ, VOCAB, Progressions, gpt2, llama

RECIPES = ["fp32", "bf16", "bf16-kahan", "bf16-split"]


def _lm_batches(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    ids = Progressions(n * 4, seed=seed).ids
    return [{"input_ids": ids[i:i + 4], "labels": ids[i:i + 4]} for i in range(0, 4 * n, 4)]


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _check(result, model: nn.Module, before: dict[str, torch.Tensor], first_loss: float,
           steps: int) -> None:
    assert [r["recipe"] for r in result.rows] == RECIPES
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    for r in result.rows:
        assert len(r["losses"]) == steps and all(math.isfinite(v) for v in r["losses"])
        assert [p["name"] for p in r["parameters"]] == names
        assert sum(p["share"] for p in r["parameters"]) == pytest.approx(1.0)
    # Every recipe's first step is on the same weights and batch: FP32's first loss is the FP32
    # model's own loss on the first batch, and the 16-bit recipes' are its rounding's.
    fp32 = result.row("fp32")
    assert fp32["losses"][0] == pytest.approx(first_loss, rel=1e-5)
    for r in result.rows:
        assert r["losses"][0] == pytest.approx(first_loss, rel=2e-2)
    # The user's model is not trained: copies are.
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert result.parameters["baseline"] == "bf16"
    assert result.recommendation["recipe"] in RECIPES
    assert "recommended:" in str(result)


@pytest.mark.parametrize("build", [llama, gpt2], ids=["llama", "gpt2"])
def test_a_hugging_face_causal_lm_with_dict_batches(build):
    model = build()
    before = _snapshot(model)
    train, held_out = _lm_batches(6, seed=0), _lm_batches(2, seed=1)
    with torch.no_grad():
        first = float(model(**train[0]).loss)
    result = lowprec.compare(model, train, held_out, recipes=RECIPES, steps=6, lr=1e-3,
                             fused=False, device="cpu", monitor_every=2)
    _check(result, model, before, first, 6)
    if build is gpt2:
        # The tied head is the embedding: stepped once and counted once, under its first name.
        names = [p["name"] for p in result.row("bf16")["parameters"]]
        assert "transformer.wte.weight" in names and "lm_head.weight" not in names
        assert model.lm_head.weight is model.transformer.wte.weight


def test_an_image_classifier_with_batchnorm_and_tuple_batches():
    config = ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                          layer_type="basic", num_labels=5)
    torch.manual_seed(0)
    model = ResNetForImageClassification(config)
    assert any(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    gen = torch.Generator().manual_seed(0)
    data = [(torch.randn(8, 3, 16, 16, generator=gen), torch.randint(0, 5, (8,), generator=gen))
            for _ in range(8)]
    # (the first training step's loss: batch statistics, as compare's step; on a copy, since a
    # training-mode forward moves the running statistics)
    with torch.no_grad():
        first = float(nn.functional.cross_entropy(copy.deepcopy(model)(data[0][0]).logits,
                                                  data[0][1]))
    before = _snapshot(model)
    result = lowprec.compare(model, data[:6], data[6:], recipes=RECIPES, steps=6, lr=1e-3,
                             fused=False, device="cpu", monitor_every=2)
    # (the BatchNorm running statistics are buffers of each recipe's copy, not the model's)
    _check(result, model, before, first, 6)


class _WithFrozenAndCounts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.embed.weight.requires_grad_(False)  # (frozen: no recipe trains it)
        self.body = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, VOCAB))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("positions", torch.arange(SEQ))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.body(self.embed(ids))


def test_a_model_with_frozen_parameters_and_integer_buffers():
    torch.manual_seed(0)
    model = _WithFrozenAndCounts()
    before = _snapshot(model)
    ids = Progressions(40, seed=0).ids
    data = [(ids[i:i + 4, :-1], ids[i:i + 4, 1:]) for i in range(0, 40, 4)]
    with torch.no_grad():
        logits = model(data[0][0])
        first = float(nn.functional.cross_entropy(logits.reshape(-1, VOCAB),
                                                  data[0][1].reshape(-1)))
    model.calls.zero_()
    before = _snapshot(model)
    result = lowprec.compare(model, data[:6], data[6:], recipes=RECIPES, steps=6, lr=1e-3,
                             fused=False, device="cpu", monitor_every=2)
    _check(result, model, before, first, 6)
    assert all("embed.weight" not in [p["name"] for p in r["parameters"]] for r in result.rows)


# ------------------------------------------------------------------ the examples and --task

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize("name", ["compare_llama", "compare_vision"])
def test_the_examples_run_on_a_small_size(name, tmp_path):
    out = tmp_path / "c.json"
    proc = subprocess.run([sys.executable, str(EXAMPLES / f"{name}.py"), "--small", "--seeds",
                           "1", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "recommended:" in proc.stdout
    data = json.loads(out.read_text())
    assert [r["recipe"] for r in data["summary"]] == ["fp32", "bf16", "bf16-kahan",
                                                      "bf16-split", "bf16-sr"]
    assert data["parameters"]["baseline"] == "bf16"


def test_the_command_runs_a_task_file_and_holds_a_gap(tmp_path):
    # A task file of the user's: NAME a function returning a Task (here the Llama example's,
    # small); --assert-gap exits 0 where the recommended recipe is within PCT, 1 beyond.
    spec = tmp_path / "my_task.py"
    spec.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(EXAMPLES)!r})\n"
        "from compare_llama import task as llama_task\n\n"
        "def small():\n"
        "    return llama_task(small=True)\n")
    common = ["compare", "--task", f"{spec}:small", "--steps", "4", "--recipes",
              "fp32,bf16,bf16-split", "--no-fused", "--monitor-every", "2", "--no-progress",
              "--no-plot", "--device", "cpu", "--out", str(tmp_path / "out")]
    proc = subprocess.run([sys.executable, "-m", "lowprec", *common, "--assert-gap", "50"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Llama fine-tuning" in proc.stdout and "--assert-gap held" in proc.stdout
    data = json.loads((tmp_path / "out" / "compare.json").read_text())
    assert data["config"]["task"] == "yours"
    assert [r["recipe"] for r in data["records"]] == ["fp32", "bf16", "bf16-split"]
    # --assert-gap 0 held to plain bf16: exit 1 wherever it ended above fp32
    proc = subprocess.run([sys.executable, "-m", "lowprec", *common, "--assert-gap", "0",
                           "--assert-recipe", "bf16"], capture_output=True, text=True,
                          timeout=300)
    gap = next(r for r in json.loads((tmp_path / "out" / "compare.json").read_text())["summary"]
               if r["recipe"] == "bf16")["eval_gap"]
    assert proc.returncode == (1 if gap > 0 else 0), proc.stdout + proc.stderr


@pytest.mark.parametrize("spec, message", [
    ("nowhere.py:task", "no file nowhere.py"),
    ("lowprec_no_such_module:task", "no module 'lowprec_no_such_module'"),
    ("{file}:nothing", "has no 'nothing'"),
    ("{file}:NOT_A_TASK", "not a task"),
])
def test_a_task_that_is_not_found_or_not_a_task_is_a_message(spec, message, tmp_path):
    path = tmp_path / "tasks.py"
    path.write_text("NOT_A_TASK = 3\n")
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "lowprec", "compare", "--task",
                           spec.format(file=path), "--out", str(tmp_path / "o"),
                           "--device", "cpu"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert time.perf_counter() - started < 10 + 5  # (the interpreter's and torch's start)
    assert not (tmp_path / "o" / "compare.json").exists()
