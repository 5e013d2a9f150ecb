"""``--device`` and ``--size`` of ``lowprec compare`` and ``lowprec memory`` (issue 29).

The CPU tests run everywhere. The tests marked ``gpu`` run where ``torch.cuda.is_available()``:
``compare`` trains on CUDA (models, batches, autocast, loss scaler and step timing there) and
``memory`` adds the allocator's held and peak bytes.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import subprocess
import sys
from pathlib import Path
from typing import ClassVar

import pytest
import torch

from lowprec import memory, products, recipes
from lowprec.cli import compare_cmd, parser
from lowprec.cli.common import _console
from lowprec.cli.main import main
from lowprec.comparison import compare, config, run
from lowprec.comparison.task import CharTransformer, ModelConfig

# A model and run small enough for a test (as tests/test_cli.py's).
TINY = ["--steps", "4", "--d-model", "32", "--n-layer", "1", "--n-head", "2", "--context", "16",
        "--batch-size", "4", "--eval-batches", "1", "--monitor-every", "2", "--no-progress"]
TINY_MODEL = ModelConfig(d_model=32, n_layer=1, n_head=2, context=16)
# The page that documents `lowprec compare`'s options (whitespace folded: it wraps its lines).
README = " ".join(
    (Path(__file__).resolve().parents[1] / "docs" / "choosing-a-recipe.md").read_text().split())

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class _AutocastSpy(torch.autocast):
    """``torch.autocast`` that notes the device type of each context a recipe asks for (one
    with a dtype: torch's own internal uses, if any, ask for none)."""

    seen: ClassVar[list[str]] = []

    def __init__(self, device_type, *args, **kwargs):
        if kwargs.get("dtype") is not None:
            _AutocastSpy.seen.append(device_type)
        super().__init__(device_type, *args, **kwargs)


@pytest.fixture
def autocast_types(monkeypatch):
    _AutocastSpy.seen = []
    monkeypatch.setattr(torch, "autocast", _AutocastSpy)
    return _AutocastSpy.seen


def _words(text: str) -> str:
    return " ".join(text.split())


def _no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


# ------------------------------------------------------------------------------ devices


def test_compare_on_the_cpu_records_the_device(tmp_path, capsys, monkeypatch, autocast_types):
    def no_sync(*_a, **_k):
        raise AssertionError("a CPU run synchronizes no CUDA device")

    monkeypatch.setattr(torch.cuda, "synchronize", no_sync)
    path = tmp_path / "c.json"
    assert main(["compare", "--device", "cpu", "--recipes", "fp32,amp-bf16,fp16-master",
                     *TINY, "--json", str(path), "--no-plot", "--no-fused"]) == 0
    out = capsys.readouterr().out
    data = json.loads(path.read_text())
    device = data["device"]
    assert device["device"] == "cpu" and device["type"] == "cpu" and device["name"]
    assert data["config"]["device"] == "cpu"
    # The header and the table's title say which device ran, with the threads it used (words
    # compared: a long CPU name may wrap the table's title).
    assert _words(out).count(_words(f"cpu ({device['name']}), 2 threads")) == 2, out
    # amp-bf16's forward contexts (training and eval) were CPU autocasts, and only its.
    assert autocast_types and set(autocast_types) == {"cpu"}
    assert len(autocast_types) == 4 + 2  # 4 steps, 1 eval batch before training and after
    assert all(math.isfinite(v) for r in data["records"] for v in r["losses"])


def test_auto_is_cuda_exactly_where_torch_finds_it(monkeypatch):
    assert compare.resolve_device("auto").type == ("cuda" if torch.cuda.is_available()
                                                   else "cpu")
    assert compare.resolve_device("cpu") == torch.device("cpu")
    _no_cuda(monkeypatch)
    assert compare.resolve_device("auto") == torch.device("cpu")
    # Where torch finds GPUs, auto is the current one (no GPU is touched: the calls are faked).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert compare.resolve_device("auto") == torch.device("cuda", 1)
    assert compare.resolve_device("cuda:0") == torch.device("cuda", 0)
    with pytest.raises(ValueError, match=r"has 2 CUDA device\(s\): choose cuda:0 to cuda:1"):
        compare.resolve_device("cuda:2")


@pytest.mark.parametrize("command", ["compare", "memory"])
def test_cuda_without_cuda_is_one_clear_line_and_no_training(command, tmp_path, capsys,
                                                             monkeypatch):
    _no_cuda(monkeypatch)
    trained = []
    monkeypatch.setattr(compare, "compare", lambda *a, **k: trained.append(1))
    monkeypatch.setattr(memory, "table", lambda *a, **k: trained.append(1))
    args = [*TINY, "--out", str(tmp_path)] if command == "compare" else []
    assert main([command, "--device", "cuda", *args]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("lowprec: error: --device cuda: no CUDA device"), err
    assert "--device cpu" in err  # the fix
    assert not trained and "lowprec compare" not in captured.out
    assert not list(tmp_path.iterdir())  # nothing written


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_cuda_on_a_cpu_only_torch_says_so_in_a_subprocess(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "lowprec", "compare", "--device", "cuda:0",
                           *TINY, "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.startswith("lowprec: error: --device cuda:0: no CUDA device"), proc.stderr
    assert "Traceback" not in proc.stderr and "lowprec compare" not in proc.stdout
    if torch.version.cuda is None:
        assert "CPU-only build" in proc.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["compare", "--device", "gpu"], "unknown device 'gpu'; choose auto, cpu, cuda"),
        (["compare", "--device", "cuda:x"], "unknown device 'cuda:x'"),
        (["compare", "--size", "huge"], "invalid choice: 'huge'"),
        (["memory", "--device", "tpu"], "unknown device 'tpu'"),
        (["memory", "--size", "gpt3"], "invalid choice: 'gpt3'"),
        (["compare", "--size", "gpt2-small", "--n-head", "7"],
         "d_model=768 must be a multiple of n_head=7"),
    ],
)
def test_bad_device_or_size_is_a_message(args, message, capsys):
    with pytest.raises(SystemExit) as exc:
        raise SystemExit(main(args))
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_the_load_note_on_a_gpu_blames_no_cpu_threads(capsys):
    """The background load is the CPU's: on a GPU run it is reported as such, without the CPU
    run's warning that the step's threads shared busy cores."""
    console = _console()
    gpu = {"device": "cuda:0", "type": "cuda", "name": "a GPU"}
    busy = {"background_cores": 0.9, "max_cores": 1.0, "contended_fraction": 0.4}
    compare_cmd._load_note(console, busy, 2, gpu)
    out = _words(capsys.readouterr().out)
    assert "Background CPU load: 0.90 cores" in out and "in 40% of them" in out
    assert "The steps ran on cuda:0" in out and "share the cores" not in out
    compare_cmd._load_note(console, busy, 2, {"device": "cpu", "type": "cpu", "name": "a CPU"})
    assert "2 threads share the cores" in _words(capsys.readouterr().out)


def test_bad_device_in_the_config_is_a_value_error():
    cfg = compare.CompareConfig(device="cuda:")
    with pytest.raises(ValueError, match="unknown device 'cuda:'"):
        cfg.validate()
    with pytest.raises(ValueError, match="unknown device 'mps'"):
        compare.resolve_device("mps")


# ------------------------------------------------------------------------------ autocast


def test_autocast_follows_the_converted_models_device(monkeypatch):
    # (torch.autocast on the CPU too: where the CPU has no fast BF16 matmul, amp-bf16's CPU
    # context is recipes.LowPrecisionProductsInFP32, tested in tests/test_bf16_products.py)
    monkeypatch.setattr(products, "cpu_has_fast_bf16_matmul", lambda: True)
    monkeypatch.delenv(recipes.BF16_PRODUCTS_ENV, raising=False)
    autocast_types = []  # (a fake: torch has no autocast for the meta device)
    monkeypatch.setattr(torch, "autocast", lambda device_type, **_k: (
        autocast_types.append(device_type), contextlib.nullcontext())[1])
    recipe = recipes.get("amp-bf16")
    model = recipe.convert(torch.nn.Linear(4, 4))
    with recipe.autocast():
        model(torch.randn(2, 4))
    model.to("meta")  # moved after convert: autocast follows it
    recipe.autocast()
    recipe.autocast("cuda:1")  # an explicit device wins
    recipe.autocast(torch.device("cpu"))
    assert autocast_types == ["cpu", "meta", "cuda", "cpu"]


def test_fp16_products_through_fp32_only_for_a_model_on_the_cpu():
    recipe = recipes.get("fp16-master")
    model = recipe.convert(torch.nn.Linear(4, 4))
    assert isinstance(recipe.autocast(), recipes.HalfProductsInFP32)
    model.to("meta")
    assert not isinstance(recipe.autocast(), recipes.HalfProductsInFP32)


def test_autocast_without_a_device_or_a_converted_model(autocast_types):
    with pytest.raises(ValueError, match=r"convert the model with this recipe first.*"
                                         r"recipe.autocast\('cuda'\)"):
        recipes.get("amp-fp16").autocast()
    # Recipes without autocast or FP16 weights need no device: their context is a no-op.
    with recipes.get("bf16-kahan").autocast():
        pass
    assert autocast_types == []


def test_a_recipe_keeps_no_model_alive_and_still_pickles():
    import gc
    import pickle

    recipe = recipes.get("amp-bf16")
    model = recipe.convert(torch.nn.Linear(4, 4))
    assert recipe._device_type() == "cpu"
    copy = pickle.loads(pickle.dumps(recipe))
    assert copy.name == "amp-bf16" and copy._converted is None
    del model
    gc.collect()
    with pytest.raises(ValueError, match="convert the model"):
        recipe.autocast()


# ------------------------------------------------------------------------------ sizes


@pytest.mark.parametrize("name", list(config.SIZES))
def test_size_presets_have_the_documented_parameter_counts(name):
    size = config.SIZES[name]
    with torch.device("meta"):  # shapes only: nothing is allocated
        model = CharTransformer(size.model)
    count = sum(p.numel() for p in model.parameters())
    assert count == size.model.num_parameters
    documented = f"`{name}` ({count / 1e6:.1f}M parameters"
    assert documented in README, f"docs/choosing-a-recipe.md's --size line should say {documented}"
    assert f"{name} ({count / 1e6:.1f}M parameters" in parser._sizes_help()


def test_the_default_size_is_the_built_in_model_and_gpt2_small_has_gpt2s_layers():
    assert config.SIZES["default"].model == ModelConfig()
    assert config.sized() == (ModelConfig(), compare.CompareConfig().batch_size)
    gpt2 = config.SIZES["gpt2-small"].model
    assert (gpt2.n_layer, gpt2.d_model, gpt2.n_head, gpt2.context) == (12, 768, 12, 1024)
    # GPT-2 small's 124M less its 50257 x 768 token and 1024 x 768 position embeddings is its
    # blocks' 85M, which a byte vocabulary keeps.
    blocks = gpt2.n_layer * (12 * gpt2.d_model ** 2 + 13 * gpt2.d_model)
    assert 85.0e6 < blocks < 85.1e6 < gpt2.num_parameters < 124e6


def test_size_and_explicit_overrides_reach_the_run(tmp_path, monkeypatch, capsys):
    seen = []
    monkeypatch.setattr(compare, "compare", lambda cfg, **_k: seen.append(cfg))
    path = tmp_path / "c.json"
    assert main(["compare", "--size", "small", "--d-model", "96", "--n-head", "4",
                     "--device", "cpu", "--json", str(path), "--no-plot"]) == 0
    (cfg,) = seen
    small = config.SIZES["small"]
    assert cfg.model == ModelConfig(d_model=96, n_layer=small.model.n_layer, n_head=4,
                                    context=small.model.context)
    assert cfg.batch_size == small.batch_size
    data = json.loads(path.read_text())
    assert data["config"]["size"] == "small"
    assert data["config"]["parameters"] == cfg.model.num_parameters
    assert f"({cfg.model.num_parameters:,} parameters)" in capsys.readouterr().out
    assert main(["compare", "--size", "small", "--batch-size", "3", "--device", "cpu",
                     "--json", str(path), "--no-plot"]) == 0
    assert seen[1].batch_size == 3 and seen[1].model == small.model


def test_help_lists_the_device_and_the_sizes():
    proc = subprocess.run([sys.executable, "-m", "lowprec", "compare", "--help"],
                          capture_output=True, text=True, timeout=120)
    text = " ".join(proc.stdout.split())  # (argparse wraps the lines)
    assert "--device DEVICE" in text and "auto (CUDA where torch finds a GPU" in text
    for name, size in config.SIZES.items():
        assert f"{name} ({size.model.num_parameters / 1e6:.1f}M parameters" in text
    assert "torch threads, on the CPU only" in text


# ------------------------------------------------------------------------------ memory


def test_memory_on_the_cpu_has_no_peak(tmp_path, capsys):
    path = tmp_path / "m.json"
    assert main(["memory", "--device", "cpu", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "peak MiB" not in out and "on cpu (" in out
    data = json.loads(path.read_text())
    assert data["device"]["type"] == "cpu" and data["size"] == "default"
    assert data["numel"] == ModelConfig().num_parameters
    assert all(r["cuda_peak"] is None for r in data["rows"])


def test_the_cuda_peak_needs_a_model_on_cuda():
    loss = compare.task_loss(TINY_MODEL, 2, "cpu")
    with pytest.raises(ValueError, match="give a model on a CUDA device"):
        memory.table("adamw", model=CharTransformer(TINY_MODEL), loss_fn=loss)
    with pytest.raises(ValueError, match="move it there first"):
        memory.cuda_peak("adamw", "bf16", CharTransformer(TINY_MODEL), loss)


# ------------------------------------------------------------------------------ on a GPU


@pytest.mark.gpu
@needs_cuda
def test_compare_trains_on_cuda(monkeypatch, autocast_types):
    """Models, batches, the loss scalers' state and autocast on CUDA; each timed step waits for
    the GPU; the CPU's thread count is left alone."""
    names = ("fp32", "amp-bf16", "amp-fp16", "bf16-kahan", "fp16-master")
    # (no UpdateMonitor and the eager step here, so that a failure points at the device's
    # plumbing; the end-to-end test below runs both)
    cfg = compare.CompareConfig(recipes=names, steps=3, model=TINY_MODEL, batch_size=4,
                                eval_batches=1, monitor_every=0, text_bytes=200_000,
                                threads=1, device="cuda", fused=False)
    seen: dict[str, set] = {"x": set(), "params": set(), "scaler": set()}
    real_step = run._Run.step

    def spy(self, x, y):
        loss = real_step(self, x, y)
        seen["x"].add(x.device.type)
        seen["params"].update(p.device.type for p in self.model.parameters())
        if self.recipe.scaler is not None:
            seen["scaler"].add(self.recipe.scaler._scale.device.type)
        return loss

    syncs = []
    real_sync = torch.cuda.synchronize
    monkeypatch.setattr(run._Run, "step", spy)
    monkeypatch.setattr(torch.cuda, "synchronize",
                        lambda *a, **k: (syncs.append(1), real_sync(*a, **k))[1])
    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, threads))
    try:
        records = compare.compare(cfg)
        assert torch.get_num_threads() == max(2, threads)  # --threads is the CPU's only
    finally:
        torch.set_num_threads(threads)
    assert seen == {"x": {"cuda"}, "params": {"cuda"}, "scaler": {"cuda"}}
    assert len(syncs) >= 2 * cfg.steps * len(names)  # before and after every timed step
    assert set(autocast_types) == {"cuda"}
    assert len(autocast_types) == 2 * (cfg.steps + 2)  # amp-bf16, amp-fp16: steps + 2 evals
    assert [r["recipe"] for r in records] == list(names)
    for r in records:
        assert all(math.isfinite(v) for v in r["losses"]) and math.isfinite(r["eval_loss"])
        assert r["step_time_s"] > 0


@pytest.mark.gpu
@needs_cuda
def test_compare_device_cuda_end_to_end(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "lowprec", "compare", "--device", "cuda",
                           "--recipes", "fp32,amp-bf16,bf16-kahan,fp16-master", *TINY,
                           "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((out / "compare.json").read_text())
    index = torch.cuda.current_device()
    assert data["device"]["type"] == "cuda" and data["device"]["device"] == f"cuda:{index}"
    assert data["device"]["name"] == torch.cuda.get_device_name(index)
    assert data["config"]["device"] == f"cuda:{index}"
    assert _words(f"cuda:{index} ({data['device']['name']})") in _words(proc.stdout)
    assert "Background CPU load" in proc.stdout or "not measured here" in proc.stdout
    assert "2 threads share the cores" not in proc.stdout
    assert [r["recipe"] for r in data["records"]] == ["fp32", "amp-bf16", "bf16-kahan",
                                                       "fp16-master"]
    for r in data["records"]:
        assert all(v is not None and math.isfinite(v) for v in r["losses"])
        assert r["step_time_s"] > 0
    assert (out / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name", ["fp32", "amp-fp16", "bf16-kahan", "bf16-split-8bit",
                                  "fp16-master"])
def test_cuda_peak_of_a_training_step(name):
    model = CharTransformer(TINY_MODEL).cuda()
    peak = memory.cuda_peak("adamw", name, model, compare.task_loss(TINY_MODEL, 4, "cuda"))
    # The tensors of the same recipe, model and optimizer after a step (synthetic gradients).
    tensors = memory._measured_after_one_step(
        "adamw", name, model, memory.DEFAULT_HYPERPARAMETERS["adamw"], None, 0).bytes
    held_tensors = tensors["total"] - tensors["other"]  # weights, grads, state, master
    assert peak["peak"] >= peak["held"] >= held_tensors > 0, (peak, tensors)


@pytest.mark.gpu
@needs_cuda
def test_memory_device_cuda_adds_the_peak(tmp_path, capsys):
    path = tmp_path / "m.json"
    # (status 0: every recipe's measured bytes agree with the expected ones, as on the CPU)
    assert main(["memory", "--device", "cuda", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "held MiB" in out and "peak MiB" in out
    data = json.loads(path.read_text())
    assert data["device"]["type"] == "cuda"
    assert [r["recipe"] for r in data["rows"]] == list(recipes.RECIPES)
    for row in data["rows"]:
        peak, tensors = row["cuda_peak"], row["measured_bytes"]
        assert peak["peak"] >= peak["held"] > 0, row["recipe"]
        assert peak["held"] >= tensors["total"] - tensors["other"], row["recipe"]
    # The table shows each peak in MiB, as the JSON has it.
    first = data["rows"][0]
    assert re.search(rf"{first['recipe']} .* {first['cuda_peak']['peak'] / 2**20:.1f}", out)
