"""The peak of a training step (memory_probe, memory_peak) and the plan for a model size
(memory_plan, ``lowprec memory --params``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lowprec import memory, recipes
from lowprec.cli import memory_peak, memory_plan, memory_probe
from lowprec.cli.main import main

# ---------------------------------------------------------------------------------- --params


@pytest.mark.parametrize("text, numel", [
    ("3e9", 3_000_000_000), ("7B", 7_000_000_000), ("1.5e9", 1_500_000_000),
    ("1.5B", 1_500_000_000), ("350m", 350_000_000), (" 12 ", 12), ("2.5k", 2500),
])
def test_parse_params_counts(text, numel):
    size = memory_plan.parse_params(text)
    assert (size.numel, size.largest) == (numel, None)


@pytest.mark.parametrize("text, match", [
    ("0", "not a positive parameter count"),
    ("7X", "neither a parameter count"),
    ("-3e9", "neither a parameter count"),
    ("missing/config.json", "cannot read"),
])
def test_parse_params_errors_name_the_fix(text, match):
    with pytest.raises(ValueError, match=match):
        memory_plan.parse_params(text)


def test_plan_is_expected_times_the_count():
    size = memory_plan.ModelSize(numel=3_000_000_000, largest=None, source="test")
    rows = memory_plan.plan(size, "adamw")
    assert [(r["recipe"], r["in_backward"]) for r in rows] == [
        (name, mode) for name in recipes.RECIPES for mode in (False, True)]
    refused = {r["recipe"] for r in rows if r["refused"] is not None}
    # a loss scaler cannot skip a step already taken inside backward
    assert refused == {r for r in recipes.RECIPES if recipes.get(r).loss_scaling is not None}
    assert all(r["in_backward"] and r["gib"] is None for r in rows if r["refused"])
    for r in rows:
        if r["refused"]:
            continue
        e = memory.expected("adamw", r["recipe"])  # (hand computation from the per-element table)
        grads = 0.0 if r["in_backward"] else e["weights"] * size.numel / 2**30
        want = {"weights": e["weights"] * size.numel / 2**30, "grads": grads,
                "optimizer_state": e["optimizer_state"] * size.numel / 2**30,
                "master": e["master"] * size.numel / 2**30}
        want["total"] = sum(want.values())
        assert r["gib"] == pytest.approx(want, rel=1e-12)
        assert r["fits"] == {c: want["total"] <= c for c in memory_plan.CARDS}
    (k8,) = [r for r in rows if r["recipe"] == "bf16-kahan-8bit" and r["in_backward"]]
    # BF16 weights, two 8-bit moments with an FP32 scale per 256, a BF16 compensation
    assert k8["gib"]["total"] == pytest.approx(3e9 * (2 + 2 * (1 + 4 / 256) + 2) / 2**30)


def test_plan_in_backward_keeps_the_largest_gradient():
    size = memory_plan.ModelSize(numel=10_000, largest=1234, source="test")
    for r in memory_plan.plan(size, "sgd", recipe_names=("bf16-kahan", "fp32")):
        per = memory.expected("sgd", r["recipe"])["weights"]  # (a gradient: its weight's dtype)
        want = per * (1234 if r["in_backward"] else 10_000)
        assert r["gib"]["grads"] * 2**30 == pytest.approx(want)


def _llama_config(**overrides):
    cfg = {"model_type": "llama", "vocab_size": 1000, "hidden_size": 64,
           "intermediate_size": 176, "num_hidden_layers": 3, "num_attention_heads": 8,
           "num_key_value_heads": 2, "tie_word_embeddings": False}
    return {**cfg, **overrides}


@pytest.mark.parametrize("model_type, overrides", [
    ("llama", {}),
    ("llama", {"tie_word_embeddings": True}),
    ("llama", {"attention_bias": True, "mlp_bias": True, "num_key_value_heads": 8}),
    ("llama", {"head_dim": 16}),
    ("mistral", {}),
    ("qwen2", {"tie_word_embeddings": True}),
    ("qwen3", {"head_dim": 16}),
])
def test_config_count_equals_the_transformers_model(tmp_path, model_type, overrides):
    transformers = pytest.importorskip("transformers")
    cfg = _llama_config(model_type=model_type, **overrides)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    size = memory_plan.parse_params(str(path))
    config = transformers.AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    params = list(model.parameters())  # (tied weights once)
    assert size.numel == sum(p.numel() for p in params)
    assert size.largest == max(p.numel() for p in params)
    assert memory_plan.parse_params(str(tmp_path)).numel == size.numel  # a folder: its config


@pytest.mark.parametrize("cfg, match", [
    ({"model_type": "gpt2", "n_embd": 768}, "cannot count a model_type 'gpt2'"),
    (_llama_config(model_type="mistral", num_local_experts=8), "mixture of experts"),
    ({k: v for k, v in _llama_config().items() if k != "hidden_size"}, "missing hidden_size"),
    (_llama_config(num_hidden_layers=0), "num_hidden_layers must be a positive whole"),
    (_llama_config(hidden_size=60), "not a multiple of num_attention_heads"),
    ([1, 2], "no JSON object"),
])
def test_config_errors(tmp_path, cfg, match):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=match):
        memory_plan.count_config(path)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a JSON file"):
        memory_plan.count_config(tmp_path / "bad.json")


def test_cli_params_table_and_json(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["memory", "--params", "7B", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "7,000,000,000 parameters" in text and "bf16-kahan-8bit" in text
    data = json.loads(out.read_text())
    assert data["params"]["numel"] == 7_000_000_000
    rows = {(r["recipe"], r["in_backward"]): r for r in data["plan"]}
    e = memory.expected("adamw", "bf16-kahan")
    assert rows["bf16-kahan", False]["gib"]["total"] == pytest.approx(7e9 * e["total"] / 2**30)
    assert rows["fp32", False]["fits"] == {"24": False, "40": False, "80": False}


@pytest.mark.parametrize("argv, match", [
    (["--params", "7X"], "neither a parameter count"),
    (["--params", "0"], "not a positive parameter count"),
    (["--params", "7B", "--measure-peak"], "one at a time"),
])
def test_cli_params_errors(argv, match, capsys):
    try:
        status = main(["memory", *argv])
    except SystemExit as exc:  # (argparse's errors)
        status = exc.code
    assert status == 2
    assert match in capsys.readouterr().err


# ---------------------------------------------------------------------------------- the probe


def test_probe_accounting_equals_measure_on_the_normal_path():
    out = memory_probe.run("bf16-kahan-8bit", depth=3, width=128, batch=4, warmup=1,
                           in_backward=False)
    # the same configuration by hand: every gradient alive at the step, measure() counts them
    recipe = recipes.get("bf16-kahan-8bit")
    torch.manual_seed(0)
    model = recipe.convert(memory_probe.build_model(3, 128))
    opt = recipe.optimizer("adamw", list(model.parameters()), lr=1e-3)
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(0))
    model(x).float().pow(2).mean().backward()
    opt.step()
    report = memory.measure(model, opt)
    assert out["numel"] == report.numel == 3 * 128 * 128
    assert out["accounted"] == report.bytes
    assert out["accounted"]["grads"] == 2 * out["numel"]  # all BF16 gradients at once
    assert out["grad_samples"] == 3 + 1  # after each accumulation, and at step()
    assert out["measured"]["peak"] >= out["measured"]["baseline"] > 0


@pytest.mark.skipif(not memory_peak.in_backward_available(), reason="no step_in_backward yet")
@pytest.mark.parametrize("recipe", ["bf16-kahan-8bit", "fp32"])
def test_probe_in_backward_holds_the_largest_gradient(recipe):
    # (512^2 elements: stepped in its own hook, not with the small ones at the end of backward)
    out = memory_probe.run(recipe, depth=3, width=512, batch=4, warmup=1, in_backward=True)
    normal = memory_probe.run(recipe, depth=3, width=512, batch=4, warmup=1, in_backward=False)
    size = 4 if recipe == "fp32" else 2
    assert out["in_backward"] and not normal["in_backward"]
    assert out["accounted"]["grads"] == size * out["largest"] == size * 512 * 512
    assert normal["accounted"]["grads"] == size * out["numel"]
    for k in ("weights", "optimizer_state", "master"):
        assert out["accounted"][k] == normal["accounted"][k]


OWN_IN_BACKWARD = [r for r in recipes.RECIPES
                   if getattr(recipes.get(r), "step_in_backward", False)]


@pytest.mark.parametrize("recipe", OWN_IN_BACKWARD)
def test_probe_follows_and_undoes_a_recipes_own_step_in_backward(recipe):
    own = memory_probe.run(recipe, depth=2, width=512, batch=4, warmup=1)  # (the recipe's way)
    off = memory_probe.run(recipe, depth=2, width=512, batch=4, warmup=1, in_backward=False)
    assert own["in_backward"] and own["recipe_in_backward"] and not off["in_backward"]
    assert own["accounted"]["grads"] == 2 * own["largest"]
    assert off["accounted"]["grads"] == 2 * off["numel"]


@pytest.mark.slow
def test_fresh_process_probe_measures_the_gradients():
    # 8 x 512^2 BF16: 4 MiB of gradients, alive at once at the step
    rows = memory_peak.peak_table("adamw", recipe_names=("bf16-kahan",), depth=8, width=512,
                                  modes=(False, True) if memory_peak.in_backward_available()
                                  else (False,))
    off = rows[0]
    assert "error" not in off, off.get("error")
    grads = off["accounted"]["grads"]
    assert grads == 2 * 8 * 512 * 512
    m = off["measured"]
    assert m["how"] in ("VmHWM after clear_refs", "getrusage ru_maxrss",
                        "torch.cuda.max_memory_allocated")
    assert m["baseline"] > off["accounted"]["total"]  # the process holds the tensors and torch
    if m["how"] == "VmHWM after clear_refs":
        # the step's peak over the baseline holds the gradients, but not the whole state again
        assert grads <= m["over_baseline"] < grads + off["accounted"]["total"]
    if len(rows) == 2:
        on = rows[1]
        assert "error" not in on, on.get("error")
        assert on["saved"] == m["over_baseline"] - on["measured"]["over_baseline"]
        assert on["saved"] > grads / 2


def test_probe_failure_is_a_row():
    row = memory_peak.probe("no-such-recipe", timeout=120)
    assert "unknown recipe" in row["error"]


def test_targets_check_the_rows():
    def row(recipe, mode, total, over, grads):
        return {"recipe": recipe, "optimizer": "adamw", "in_backward": mode,
                "accounted_per_param": {"total": total},
                "accounted": {"grads": grads, "total": 4 * grads},
                "measured": {"over_baseline": over}}

    rows = [row("bf16", False, 8.0, 100, 64), row("bf16", True, 6.0, 40, 2),  # (not checked)
            row("bf16-kahan-8bit", False, 8.03, 100, 64),
            row("bf16-kahan-8bit", True, 6.09, 38, 2)]
    rows[1]["saved"], rows[3]["saved"] = 0, 62  # freed: 64 - 2
    checks = memory_peak.targets(rows)
    assert [c["passed"] for c in checks] == [True, True]
    assert checks[1]["limit"] == 62 and "25.0% of the tensors" in checks[1]["detail"]
    rows[3]["accounted_per_param"]["total"], rows[3]["saved"] = 6.2, 61
    assert [c["passed"] for c in memory_peak.targets(rows)] == [False, False]
    rows[3]["saved"] = 62 * (1 - memory_peak.SAVING_TOLERANCE)
    assert memory_peak.targets(rows)[1]["passed"]
    assert memory_peak.targets([{**r, "optimizer": "sgd"} for r in rows]) == []
    assert memory_peak.targets(rows[:2]) == []


@pytest.mark.slow
def test_cli_measure_peak_table_and_json(tmp_path, capsys, monkeypatch):
    # the probes themselves are tested above; here one real run of the smallest probe per mode,
    # and an error row, through the command's table, targets and JSON
    calls = []
    real = memory_peak.probe

    def small(recipe, optimizer, *, in_backward, **probe):
        calls.append((recipe, in_backward, probe["depth"], probe["width"], probe["batch"]))
        if recipe != "bf16-kahan-8bit":
            return {"recipe": recipe, "optimizer": optimizer, "in_backward": in_backward,
                    "error": "RuntimeError: not run here"}
        return real(recipe, optimizer, in_backward=in_backward, **probe)

    monkeypatch.setattr(memory_peak, "probe", small)
    out = tmp_path / "m.json"
    status = main(["memory", "--device", "cpu", "--measure-peak",
                   "--probe-depth", "2", "--probe-width", "512", "--probe-batch", "2",
                   "--json", str(out)])
    text = capsys.readouterr().out
    assert "Peak of a training step" in text and "not run here" in text
    available = memory_peak.in_backward_available()
    assert calls.count(("bf16-kahan-8bit", False, 2, 512, 2)) == 1
    assert calls.count(("bf16-kahan-8bit", True, 2, 512, 2)) == int(available)
    peak = json.loads(out.read_text())["peak"]
    assert peak["probe"] == {"depth": 2, "width": 512, "batch": 2}
    assert len(peak["rows"]) == 2 * len(recipes.RECIPES)
    if available:
        (target, *_) = peak["targets"]
        assert target["name"].startswith("bf16-kahan-8bit + step_in_backward")
        assert status == (0 if all(t["passed"] for t in peak["targets"]) else 1)
        assert ("NOT MET" in text) == (status == 1)


def test_readme_totals_by_size_are_the_plans():
    from pathlib import Path

    # (docs/memory.md holds what the README held about memory planning)
    readme = (Path(__file__).resolve().parents[1] / "docs" / "memory.md").read_text()
    table = readme.split("Totals by size", 1)[1].split("\n\n", 2)[1]
    rows = [line.split("|")[1:-1] for line in table.splitlines()[2:]]
    assert len(rows) >= 3
    plans = {n: memory_plan.plan(memory_plan.parse_params(n), "adamw") for n in ("1B", "3B", "7B")}
    for name, *cells in rows:
        recipe = name.strip().strip("`")
        for cell, (n, mode) in zip(cells, [(n, m) for n in plans for m in (False, True)],
                                   strict=True):
            (row,) = [r for r in plans[n] if r["recipe"] == recipe and r["in_backward"] == mode]
            assert float(cell.split()[0]) == round(row["gib"]["total"], 1), (recipe, n, mode)


def test_the_probes_path_is_the_directory_that_holds_the_package():
    # (the fresh process imports lowprec from there, also from a source tree never installed)
    root = Path(memory_peak._src_root())
    assert (root / "lowprec" / "__init__.py").is_file(), root
