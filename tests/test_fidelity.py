"""The fine-tuning task, seeds and the noise floor, and a recommendation no short run can fool.

The fine-tuning task's pretrained model is cached (reused, never trusted when corrupt), its
weights are rounded to BF16 once, every seed is measured on the same held-out windows, and
``recommend`` never picks a round-to-nearest recipe that loses over 10% of its updates.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from lowprec.cli.main import main
from lowprec.comparison import compare, pretrained, run, summary
from lowprec.comparison.config import FINETUNE_LR, LOST_UPDATES_LIMIT, CompareConfig, ModelConfig
from lowprec.comparison.task import Batches, load_prose, load_text

TINY_MODEL = ModelConfig(d_model=32, n_layer=1, n_head=2, context=16)
TINY = ["--steps", "4", "--d-model", "32", "--n-layer", "1", "--n-head", "2", "--context", "16",
        "--batch-size", "4", "--eval-batches", "1", "--monitor-every", "2", "--no-progress"]


def _cfg(**kw) -> CompareConfig:
    base = dict(recipes=("fp32", "bf16", "bf16-kahan"), task="finetune", steps=3,
                pretrain_steps=5, model=TINY_MODEL, batch_size=4, eval_batches=1,
                monitor_every=1, text_bytes=200_000, device="cpu")
    base.update(kw)
    return CompareConfig(**base)


@pytest.fixture
def trainings(monkeypatch):
    """How many times pretraining ran (``pretrained._train`` called)."""
    calls = []
    real = pretrained._train

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(pretrained, "_train", counted)
    return calls


# ------------------------------------------------------------------------- the texts and config


def test_prose_is_english_text_and_differs_from_the_sources():
    prose = load_prose()
    assert prose.dtype == torch.uint8 and len(prose) > 100_000
    text = bytes(prose[:20_000].tolist()).decode("utf-8", errors="replace")
    assert " the " in text and "statement" in text
    assert not torch.equal(prose[:1000], load_text(200_000)[:1000])
    assert torch.equal(prose, load_prose())  # the same bytes every time (sorted topics)


def test_config_defaults_and_checks_for_the_tasks():
    cfg = CompareConfig()
    assert cfg.task == "pretrain" and cfg.lr_schedule == "cosine" and cfg.peak_lr == 5e-4
    ft = CompareConfig(task="finetune")
    assert ft.lr_schedule == "constant" and ft.peak_lr == 3e-5
    assert CompareConfig(task="finetune", lr=1e-4, schedule="cosine").peak_lr == 1e-4
    assert CompareConfig(seed=3, seeds=3).seed_list == [3, 4, 5]
    for bad, match in ((dict(task="glue"), "unknown task 'glue'"),
                       (dict(schedule="linear"), "unknown schedule"),
                       (dict(seeds=0), "seeds must be an integer >= 1"),
                       (dict(pretrain_steps=0), "pretrain_steps must be an integer >= 1")):
        with pytest.raises(ValueError, match=match):
            CompareConfig(**bad).validate()


def test_schedules_warm_up_then_hold_or_decay():
    const = run._schedule(CompareConfig(steps=100, warmup=0.1, schedule="constant"))
    cos = run._schedule(CompareConfig(steps=100, warmup=0.1, schedule="cosine"))
    assert [const(s) for s in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])
    assert [cos(s) for s in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])
    assert const(50) == const(99) == 1.0
    assert cos(10) == pytest.approx(1.0) and cos(99) == pytest.approx(0.1, abs=1e-3)


def test_task_data_finetune_needs_the_pretrained_weights():
    with pytest.raises(ValueError, match="starts from pretrained weights"):
        compare.task_data(_cfg(), torch.device("cpu"), 0)


def test_every_seed_is_measured_on_the_same_held_out_windows():
    cfg = _cfg(task="pretrain", seeds=2)
    a, init_a = compare.task_data(cfg, torch.device("cpu"), 0)
    b, init_b = compare.task_data(cfg, torch.device("cpu"), 1)
    assert all(torch.equal(x, y) for (x, _), (y, _) in zip(a.eval_batches(2), b.eval_batches(2),
                                                               strict=True))
    assert not torch.equal(next(a.train_batches(1))[0], next(b.train_batches(1))[0])
    assert not torch.equal(init_a["tok.weight"], init_b["tok.weight"])  # seeded weights differ
    # A lone Batches keeps its old evaluation windows (seed + 1).
    text = load_text(200_000)
    lone = Batches(text, context=16, batch_size=4, seed=0)
    assert torch.equal(lone.eval_batches(1)[0][0], a.eval_batches(1)[0][0])


# ------------------------------------------------------------------------- the pretrained cache


def test_pretraining_is_cached_and_reused(tmp_path, trainings):
    cfg = _cfg()
    dev = torch.device("cpu")
    notes = []
    first, about = pretrained.pretrained(cfg, dev, cache_dir=tmp_path, on_note=notes.append)
    assert not about["cached"] and len(trainings) == 1 and about["seconds"] > 0
    assert about["path"] == str(pretrained.cache_path(tmp_path, about["key"]))
    again, about2 = pretrained.pretrained(cfg, dev, cache_dir=tmp_path, on_note=notes.append)
    assert about2["cached"] and len(trainings) == 1 and notes == []
    assert about2["eval_loss"] == about["eval_loss"]
    assert all(torch.equal(first[k], again[k]) for k in first)
    # FP32 weights, not rounded: what a BF16 recipe's master starts from (Recipe.convert's
    # fp32_values); most hold bits below BF16's precision.
    assert all(t.dtype == torch.float32 for t in first.values())
    assert any(not torch.equal(t, t.bfloat16().float()) for t in first.values())
    # The cached weights are the pretraining's: trained again without a cache, the same values.
    fresh, _ = pretrained.pretrained(cfg, dev)
    assert all(torch.equal(first[k], fresh[k]) for k in first)
    # Another setting (the pretraining's steps) is another file; the fine-tuning's own options
    # (its steps, rate, recipes, optimizer) share the pretrained model.
    pretrained.pretrained(_cfg(steps=7, lr=1e-4, optimizer="sgd", recipes=("fp32",)), dev,
                          cache_dir=tmp_path)
    assert len(trainings) == 2
    pretrained.pretrained(_cfg(pretrain_steps=6), dev, cache_dir=tmp_path)
    assert len(trainings) == 3 and len(list(tmp_path.glob("pretrained-*.pt"))) == 2
    assert not list(tmp_path.glob(".pretrained-*"))  # no temporary file left behind


def _corrupt_truncated(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _corrupt_garbage(path):
    path.write_bytes(b"not a torch file")


def _corrupt_a_weight(path):
    data = torch.load(path, weights_only=True)
    data["state"]["head.weight"][0, 0] += 1.0  # (the checksum no longer matches)
    torch.save(data, path)


def _corrupt_other_key(path):
    data = torch.load(path, weights_only=True)
    data["key"]["steps"] += 1
    torch.save(data, path)


def _corrupt_missing_tensor(path):
    data = torch.load(path, weights_only=True)
    del data["state"]["head.bias"]
    torch.save(data, path)


@pytest.mark.parametrize("corrupt, why", [
    (_corrupt_truncated, "unreadable"),
    (_corrupt_garbage, "unreadable"),
    (_corrupt_a_weight, "checksum does not match"),
    (_corrupt_other_key, "written for other settings"),
    (_corrupt_missing_tensor, "tensors are not the model's"),
])
def test_a_corrupt_cache_is_reported_and_trained_again(tmp_path, trainings, corrupt, why):
    cfg, dev = _cfg(), torch.device("cpu")
    good, about = pretrained.pretrained(cfg, dev, cache_dir=tmp_path)
    path = pretrained.cache_path(tmp_path, about["key"])
    corrupt(path)
    notes = []
    again, about2 = pretrained.pretrained(cfg, dev, cache_dir=tmp_path, on_note=notes.append)
    assert len(trainings) == 2 and not about2["cached"]
    assert len(notes) == 1 and why in notes[0] and str(path) in notes[0]
    assert all(torch.equal(good[k], again[k]) for k in good)
    # ... and the file is sound again: the next run reads it.
    _, about3 = pretrained.pretrained(cfg, dev, cache_dir=tmp_path)
    assert about3["cached"] and len(trainings) == 2


# ------------------------------------------------------------------------- the runs


def test_finetune_runs_start_from_the_pretrained_model(tmp_path):
    cfg = _cfg(seeds=2)
    info: dict = {}
    records = compare.compare(cfg, cache_dir=tmp_path, info=info)
    assert [(r["recipe"], r["seed"]) for r in records] == [
        (n, s) for s in (0, 1) for n in cfg.recipes]
    # Every recipe and seed starts from the same pretrained FP32 weights (a BF16 recipe from
    # their rounding) and is measured on the same windows: the eval loss before training
    # agrees, up to the recipe's rounding and arithmetic.
    befores = [r["eval_before"] for r in records]
    assert max(befores) - min(befores) < 0.01 * min(befores)
    assert info["pretrained"]["cached"] is False
    for r in records:
        fp32 = next(x for x in records if x["recipe"] == "fp32" and x["seed"] == r["seed"])
        assert r["eval_gap"] == pytest.approx((r["eval_loss"] - fp32["eval_loss"])
                                              / fp32["eval_loss"])
        drop = fp32["eval_before"] - fp32["eval_loss"]
        assert r["drop_share"] == pytest.approx((r["eval_before"] - r["eval_loss"]) / drop)
    assert {r["rounding"] for r in records} == {"nearest"}
    assert {r["weights"] for r in records} == {"float32", "bfloat16"}
    # The seeds differ in their batches (and stochastic rounding's seed), not their start: each
    # seed's run is the one run_recipe gives alone from the pretrained weights and its batches.
    weights, about = pretrained.pretrained(cfg, torch.device("cpu"), cache_dir=tmp_path)
    assert about["cached"]
    batches, initial = compare.task_data(cfg, torch.device("cpu"), 1, pretrained=weights)
    assert initial is weights
    alone = compare.run_recipe("bf16-kahan", cfg, batches, initial)
    second = next(r for r in records if r["recipe"] == "bf16-kahan" and r["seed"] == 1)
    assert alone["losses"] == second["losses"] and alone["eval_loss"] == second["eval_loss"]
    first = next(r for r in records if r["recipe"] == "bf16-kahan" and r["seed"] == 0)
    assert first["losses"] != second["losses"]


def test_finetune_command_end_to_end(tmp_path, capsys):
    out = tmp_path / "out"
    args = ["compare", "--task", "finetune", "--pretrain-steps", "5", "--seeds", "2",
            "--recipes", "fp32,bf16,bf16-sr", *TINY, "--out", str(out)]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "fine-tuning on pydoc prose from 5 FP32 pretraining steps" in text
    assert "eval before" in text and "share of fp32's drop" in text and "±" in text
    assert "Pretrained model: trained in" in text and "Noise floor:" in text
    data = json.loads((out / "compare.json").read_text())
    assert data["config"]["task"] == "finetune" and data["config"]["seed_list"] == [0, 1]
    assert len(data["records"]) == 6 and [r["recipe"] for r in data["summary"]] == [
        "fp32", "bf16", "bf16-sr"]
    assert data["noise_floor"] == pytest.approx(summary.noise_floor(data["records"]))
    assert data["pretrained"]["cached"] is False and (out / "pretrained").is_dir()
    assert data["recommendation"]["threshold"] == max(0.005, data["noise_floor"])
    # The second run reads the pretrained model instead of training it.
    assert main(args) == 0
    assert "Pretrained model: read from" in capsys.readouterr().out
    assert json.loads((out / "compare.json").read_text())["pretrained"]["cached"] is True


# ------------------------------------------------------------------------- summary and choice


def _rec(name, gap, total=8.0, ms=50, *, lost=0.0, rounding="nearest", master="none",
         weights="bfloat16", seed=0, eval_loss=None, before=None):
    return {"recipe": name, "seed": seed, "eval_gap": gap, "bytes_per_param": {"total": total},
            "step_time_s": ms / 1e3, "lost_update_fraction": lost, "rounding": rounding,
            "master": master, "weights": weights,
            "eval_loss": eval_loss if eval_loss is not None else 2.0 * (1 + gap),
            "eval_before": before, "losses": [1.0], "skipped_steps": 0}


def _params(lost, shares=(0.5, 0.3, 0.2)):
    return [{"name": n, "numel": int(100 * s), "share": s, "dtype": "bfloat16", "master": None,
             "lost_fraction": f, "stored_unchanged_fraction": f}
            for n, s, f in zip(("a.weight", "b.weight", "norm.weight"), shares, lost, strict=True)]


def test_lost_by_parameter_names_what_plain_bf16_loses_and_what_no_master_keeps():
    rows = [{**_rec("fp32", 0.0, weights="float32"), "parameters": _params((0, 0, 0))},
            {**_rec("bf16", 0.05), "parameters": _params((0.3, 0.9, 0.6))},
            {**_rec("bf16-kahan", 0.0, master="kahan"), "parameters": _params((0.0, 0.02, 0.5))},
            {**_rec("bf16-split", 0.0, master="split"), "parameters": _params((0, 0, 0.4))},
            {**_rec("bf16-sr", 0.0, rounding="stochastic", master="stochastic"),
             "parameters": _params((0.3, 0.9, 0.6))}]
    where = summary.lost_by_parameter(rows)
    assert where["baseline"] == "bf16"
    # ranked by the share of the model's updates lost: 0.3 * 0.9 > 0.5 * 0.3 > 0.2 * 0.6
    assert [p["name"] for p in where["parameters"]] == ["b.weight", "a.weight", "norm.weight"]
    assert where["parameters"][0]["lost"] == {"fp32": 0, "bf16": 0.9, "bf16-kahan": 0.02,
                                              "bf16-split": 0, "bf16-sr": 0.9}
    # lost over the limit under Kahan and split alike: only FP32 weights keep it
    assert where["keep_fp32"] == ["norm.weight"]
    assert summary.lost_by_parameter(rows, top=1)["parameters"][0]["name"] == "b.weight"
    # Over seeds, summarize averages each parameter's fractions.
    seeds = [{**rows[1], "seed": 0}, {**rows[1], "seed": 1, "parameters": _params((0.1, 0.5, 0.2))}]
    row = summary.summarize(seeds)[0]
    assert [p["lost_fraction"] for p in row["parameters"]] == pytest.approx([0.2, 0.7, 0.4])
    # Unmonitored runs have no per-parameter records.
    assert summary.lost_by_parameter([_rec("bf16", 0.0)]) is None
    assert summary.summarize([_rec("bf16", 0.0)])[0]["parameters"] is None


def test_a_round_to_nearest_recipe_losing_most_updates_is_never_recommended():
    rows = [_rec("fp32", 0.0, 16.0, 80, weights="float32"),
            _rec("bf16", 0.0, 8.0, 50, lost=0.57),  # as good as fp32 by loss: a short run
            _rec("bf16-kahan", 0.002, 10.0, 55, lost=0.01, master="kahan")]
    rec = summary.recommend(rows, 0.005)
    assert rec["recipe"] == "bf16-kahan"
    assert "lost 57% of its updates" in rec["others"]["bf16"]
    assert rec["short_run"] == ["bf16"]
    # At the limit it qualifies; above it, it does not, whatever the tolerance.
    assert summary.recommend([rows[0], _rec("bf16", 0.0, lost=LOST_UPDATES_LIMIT)])[
        "recipe"] == "bf16"
    for lost in (LOST_UPDATES_LIMIT + 0.01, 0.28, 0.51):  # (0.28: plain bf16 in 30 steps)
        assert summary.recommend([rows[0], _rec("bf16", -0.01, lost=lost)], 0.5)[
            "recipe"] == "fp32"
    # Stochastic rounding leaves weights unchanged without losing the update in expectation.
    sr = _rec("bf16-sr", 0.001, 8.0, 52, lost=0.51, rounding="stochastic")
    assert summary.recommend([rows[0], sr])["recipe"] == "bf16-sr"
    # Unmeasured (monitor off): 16-bit weights without a master are not taken on trust.
    blind = _rec("bf16", 0.0, lost=None)
    rec = summary.recommend([rows[0], blind])
    assert rec["recipe"] == "fp32" and "not measured" in rec["others"]["bf16"]
    assert summary.recommend([rows[0], _rec("bf16-kahan", 0.0, 10.0, lost=None,
                                            master="kahan")])["recipe"] == "bf16-kahan"
    # A gap beyond the threshold is the reason first, and no short-run warning.
    far = summary.recommend([rows[0], _rec("bf16", 0.08, lost=0.9)])
    assert far["short_run"] == [] and "lost 90%" in far["others"]["bf16"]


def test_the_noise_floor_widens_the_threshold():
    rows = [_rec("fp32", 0.0, 16.0, 80, weights="float32"),
            _rec("bf16-kahan", 0.008, 10.0, 55, master="kahan")]
    assert summary.recommend(rows, 0.005)["recipe"] == "fp32"
    wide = summary.recommend(rows, 0.005, floor=0.01)
    assert wide["recipe"] == "bf16-kahan" and wide["threshold"] == 0.01
    assert "the noise floor" in wide["reason"]


def test_summary_over_seeds_means_spreads_and_floor():
    recs = []
    for seed, (f, b) in enumerate(((2.0, 2.2), (2.1, 2.3), (2.2, 2.2))):
        recs.append(dict(_rec("fp32", 0.0, seed=seed, eval_loss=f, before=3.0),
                         losses=[f, f], step_time_s=0.08, speedup=1.0, final_loss=f,
                         stored_unchanged_fraction=0.0, speedup_iqr=[1.0, 1.0]))
        recs.append(dict(_rec("bf16", None, seed=seed, eval_loss=b, before=3.0, lost=0.5 + seed / 10),
                         losses=[b, b + 1], step_time_s=0.05 + seed / 100, speedup=1.6,
                         final_loss=b, stored_unchanged_fraction=0.6, speedup_iqr=[1.5, 1.7]))
    for r in recs:
        r["step_times_s"] = [0.1] * 4
    summary.add_relative(recs)
    rows = {r["recipe"]: r for r in summary.summarize(recs)}
    bf = rows["bf16"]
    gaps = [(2.2 - 2.0) / 2.0, (2.3 - 2.1) / 2.1, 0.0]
    assert bf["eval_gap"] == pytest.approx(sum(gaps) / 3)
    assert bf["eval_gap_std"] == pytest.approx(torch.tensor(gaps).std().item())
    shares = [(3 - 2.2) / 1.0, (3 - 2.3) / 0.9, (3 - 2.2) / 0.8]
    assert bf["drop_share"] == pytest.approx(sum(shares) / 3)
    assert bf["lost_update_fraction"] == pytest.approx(0.6)
    assert bf["step_time_s"] == pytest.approx(0.06) and bf["seeds"] == [0, 1, 2]
    assert bf["losses"] == pytest.approx([2.2 + 0.1 / 3, 3.2 + 0.1 / 3])
    assert rows["fp32"]["eval_loss_std"] == pytest.approx(0.1)
    assert summary.noise_floor(recs) == pytest.approx(0.1 / 2.1)
    assert summary.noise_floor(recs[:2]) is None  # one seed: no floor
    one = summary.summarize(recs[:2])[1]
    assert one["eval_gap_std"] is None and one["eval_gap"] == pytest.approx(0.1)


def test_a_diverged_seed_makes_the_mean_nan_not_a_crash():
    recs = [dict(_rec("fp32", 0.0, eval_loss=2.0, before=3.0), step_times_s=[0.1] * 3),
            dict(_rec("bf16", 0.0, eval_loss=math.nan, before=3.0), step_times_s=[0.1] * 3)]
    summary.add_relative(recs)
    row = summary.summarize(recs)[1]
    assert math.isnan(row["eval_gap"]) and row["drop_share"] is None
    assert summary.recommend(summary.summarize(recs))["others"]["bf16"] == "diverged"


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "lamb", "adamw"])
def test_every_optimizer_fine_tunes_at_its_own_rate(tmp_path, optimizer):
    """Every optimizer runs the finetune task at its fine-tuning rate (``FINETUNE_LR``), from the
    one pretrained model (AdamW's, whatever optimizer fine-tunes), and FP32 lowers the loss."""
    cfg = _cfg(optimizer=optimizer, recipes=("fp32", "bf16-kahan"), steps=6, pretrain_steps=20)
    assert cfg.peak_lr == FINETUNE_LR[optimizer]
    records = compare.compare(cfg, cache_dir=tmp_path)
    fp32 = records[0]
    assert fp32["eval_loss"] < fp32["eval_before"]
    assert all(math.isfinite(r["eval_loss"]) for r in records)
    assert len(list(tmp_path.glob("pretrained-*.pt"))) == 1


def test_the_command_says_when_a_run_is_too_short_to_judge_plain_bf16(tmp_path, capsys):
    """At a rate far below BF16's resolution plain bf16 ends level with fp32 after a few steps
    while losing nearly every update: the command does not recommend it, and says why."""
    assert main(["compare", "--recipes", "fp32,bf16", "--lr", "1e-6", *TINY,
                     "--monitor-every", "1", "--no-plot", "--out", str(tmp_path)]) == 0
    text = " ".join(capsys.readouterr().out.split())
    data = json.loads((tmp_path / "compare.json").read_text())
    bf16 = data["summary"][1]
    assert abs(bf16["eval_gap"]) < 0.005 and bf16["lost_update_fraction"] > LOST_UPDATES_LIMIT
    assert data["recommendation"]["recipe"] == "fp32"
    assert data["recommendation"]["short_run"] == ["bf16"]
    assert "This run is too short to separate bf16 from fp32 by loss" in text


def test_a_cache_that_cannot_be_written_costs_a_note_not_the_run(tmp_path):
    cfg, dev = _cfg(), torch.device("cpu")
    _, about = pretrained.pretrained(cfg, dev)  # (no cache: nothing written)
    assert about["path"] is None and not list(tmp_path.iterdir())
    pretrained.cache_path(tmp_path, about["key"]).mkdir()  # a folder where the file goes
    notes = []
    state, about = pretrained.pretrained(cfg, dev, cache_dir=tmp_path, on_note=notes.append)
    assert about["path"] is None and not about["cached"] and state
    assert "unreadable" in notes[0] and "could not cache" in notes[1]
