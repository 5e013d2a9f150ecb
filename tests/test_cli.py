"""The ``lowprec`` command end to end: compare, memory, numerics, and the user's mistakes."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys

import pytest
import torch

from lowprec import memory, products, recipes
from lowprec.cli import compare_cmd
from lowprec.cli.common import _console
from lowprec.cli.main import main
from lowprec.comparison import compare, plot, run
from lowprec.comparison.task import Batches, CharTransformer, ModelConfig, load_text

# A model and run small enough for a test: the whole comparison takes seconds.
TINY = ["--steps", "4", "--d-model", "32", "--n-layer", "1", "--n-head", "2", "--context", "16",
        "--batch-size", "4", "--eval-batches", "1", "--monitor-every", "2", "--no-progress"]
RECORD_FIELDS = {"recipe", "final_loss", "eval_loss", "step_time_s", "bytes_per_param",
                 "lost_update_fraction", "eval_gap", "speedup", "losses", "skipped_steps",
                 "speedup_iqr", "step_time_iqr_s", "step_times_s", "warmup_s"}


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """The command as a user runs it: a fresh interpreter, ``python -m lowprec``."""
    return subprocess.run([sys.executable, "-m", "lowprec", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_compare_end_to_end_in_a_subprocess(tmp_path):
    out = tmp_path / "out"
    names = "fp32,bf16,bf16-kahan,fp16-master"
    proc = run_cli("compare", "--recipes", names, *TINY, "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    for name in names.split(","):
        assert name in proc.stdout
    data = json.loads((out / "compare.json").read_text())
    assert data["interrupted"] is False
    assert data["background_load"]["rounds"] == 4
    assert data["config"]["steps"] == 4 and data["config"]["recipes"] == names.split(",")
    records = data["records"]
    assert [r["recipe"] for r in records] == names.split(",")
    for r in records:
        assert set(r) >= RECORD_FIELDS
        assert len(r["losses"]) == 4 and all(math.isfinite(v) for v in r["losses"])
        assert r["eval_loss"] > 0 and r["step_time_s"] > 0
        assert 0 <= r["lost_update_fraction"] <= 1
        parts = sum(r["bytes_per_param"][k] for k in memory.CATEGORIES)
        assert r["bytes_per_param"]["total"] == pytest.approx(parts)
    by = {r["recipe"]: r for r in records}
    assert by["fp32"]["eval_gap"] == 0 and by["fp32"]["speedup"] == 1
    # Bytes per parameter come from the tensors: BF16 weights and grads, an FP32 master for FP16.
    assert by["fp32"]["bytes_per_param"]["weights"] == pytest.approx(4.0)
    assert by["bf16-kahan"]["bytes_per_param"]["master"] > 1.9
    assert by["fp16-master"]["bytes_per_param"]["master"] > 3.9
    # Per parameter, by name: every trainable parameter once, shares summing to one, and the
    # record's whole-model fraction their element-weighted mean (the monitor's own totals).
    names_of = [n for n, _ in CharTransformer(ModelConfig(d_model=32, n_layer=1, n_head=2,
                                                          context=16)).named_parameters()]
    for r in records:
        params = r["parameters"]
        assert [p["name"] for p in params] == names_of
        assert sum(p["share"] for p in params) == pytest.approx(1.0)
    assert all(p["lost_fraction"] == 0 for p in by["fp32"]["parameters"])
    assert any(p["lost_fraction"] > 0 for p in by["bf16"]["parameters"])
    where = data["parameters"]
    assert where["baseline"] == "bf16" and where["parameters"]
    assert set(where["parameters"][0]["lost"]) == set(names.split(","))
    assert "Where the updates are lost" in proc.stdout
    png = (out / "compare.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_compare_same_start_and_data_for_every_recipe():
    cfg = compare.CompareConfig(recipes=("fp32", "amp-bf16"), steps=3,
                                model=ModelConfig(d_model=32, n_layer=1, n_head=2, context=16),
                                batch_size=4, eval_batches=1, monitor_every=0)
    text = load_text(200_000)
    batches = Batches(text, context=16, batch_size=4, seed=0)
    torch.manual_seed(0)
    initial = CharTransformer(cfg.model).state_dict()
    a = compare.run_recipe("fp32", cfg, batches, initial)
    b = compare.run_recipe("fp32", cfg, batches, initial)
    c = compare.run_recipe("amp-bf16", cfg, batches, initial)
    assert a["losses"] == b["losses"] and a["eval_loss"] == b["eval_loss"]  # deterministic
    # The first loss is computed before any update: same weights and batch, BF16 matmuls.
    assert c["losses"][0] == pytest.approx(a["losses"][0], rel=1e-2)
    assert c["losses"] != a["losses"]


def test_compare_json_and_plot_paths_and_no_plot(tmp_path):
    json_path = tmp_path / "deep" / "r.json"
    code = main(["compare", "--recipes", "fp32", *TINY, "--json", str(json_path),
                     "--no-plot", "--out", str(tmp_path / "unused")])
    assert code == 0
    assert json.loads(json_path.read_text())["records"][0]["recipe"] == "fp32"
    assert not (tmp_path / "unused").exists()


def test_compare_runs_block_format_recipes_beside_the_others(tmp_path, capsys):
    """The block-format recipes in the main job: their rows and records, trained near fp32's
    loss but not on its path, and ``--recipes blocks`` naming the group."""
    path = tmp_path / "c.json"
    assert main(["compare", "--device", "cpu", "--recipes", "fp32,mxfp8,nvfp4", *TINY,
                 "--json", str(path), "--no-plot", "--no-fused"]) == 0
    out = capsys.readouterr().out
    records = {r["recipe"]: r for r in json.loads(path.read_text())["records"]}
    assert set(records) == {"fp32", "mxfp8", "nvfp4"}
    for name in ("mxfp8", "nvfp4"):
        assert any(line.startswith("│") and line.split()[1] == name
                   for line in out.splitlines()), out
        assert records[name]["losses"] != records["fp32"]["losses"]
        assert abs(records[name]["eval_loss"] / records["fp32"]["eval_loss"] - 1) < 0.05
    from lowprec.cli import parser
    from lowprec.comparison import config

    assert parser._recipe_list("blocks,nvfp4-no-sr") == (*config.BLOCK_RECIPES, "nvfp4-no-sr")


@pytest.mark.parametrize("fast", [False, True])
def test_compare_says_where_bf16_products_were_computed_in_fp32(fast, tmp_path, capsys,
                                                                monkeypatch):
    """Without a fast BF16 matmul the BF16 recipes' products are computed in FP32 and rounded to
    BF16: their speed cells are marked, one line says why, and the JSON records it per recipe
    and for the device. With one, none of it (a width-32 model: torch's BF16 kernels are slow
    where the detection is faked fast)."""
    monkeypatch.delenv(recipes.BF16_PRODUCTS_ENV, raising=False)
    monkeypatch.setattr(products, "cpu_has_fast_bf16_matmul", lambda: fast)
    path = tmp_path / "c.json"
    assert main(["compare", "--device", "cpu", "--recipes", "fp32,amp-bf16,bf16,fp16-master",
                 *TINY, "--json", str(path), "--no-plot", "--no-fused"]) == 0
    out = capsys.readouterr().out
    data = json.loads(path.read_text())
    assert data["device"]["fast_bf16_matmul"] is fast
    assert data["device"]["bf16_products"] == ("native" if fast else "fp32")
    in_fp32 = {r["recipe"]: r["products_in_fp32"] for r in data["records"]}
    assert in_fp32 == {"fp32": None, "amp-bf16": None if fast else "bfloat16",
                        "bf16": None if fast else "bfloat16", "fp16-master": "float16"}
    rows = {line.split()[1]: line for line in out.splitlines()
            if line.startswith("│") and line.split()[1] in in_fp32}
    mark = compare_cmd.EMULATED_MARK
    for name, line in rows.items():
        # (the step time, speed-up and its IQR: three marks on an emulated row)
        assert line.count(mark) == (3 if in_fp32[name] == "bfloat16" else 0), line
    note = " ".join(out.split())
    said = ("BF16 products computed in FP32 and rounded to BF16: this CPU has no fast BF16 "
            "matmul (oneDNN needs AVX-512 BF16 or AMX); the step times and speed-ups of "
            "amp-bf16, bf16 are not BF16 hardware's")
    assert (said in note) is not fast, note


def test_compare_refuses_a_bad_bf16_products_setting_before_any_work(monkeypatch, capsys):
    monkeypatch.setenv(recipes.BF16_PRODUCTS_ENV, "bf16")
    with pytest.raises(SystemExit) as exc:
        raise SystemExit(main(["compare", "--recipes", "fp32", *TINY, "--no-plot"]))
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "LOWPREC_BF16_PRODUCTS='bf16'" in err and "Traceback" not in err


def test_ctrl_c_reports_what_was_measured(tmp_path, monkeypatch, capsys):
    real = run._Run.step

    def interrupted_at_bf16s_third_step(self, batch):
        if self.name == "bf16" and len(self.losses) == 2:
            raise KeyboardInterrupt
        return real(self, batch)

    monkeypatch.setattr(run._Run, "step", interrupted_at_bf16s_third_step)
    code = main(["compare", "--recipes", "fp32,bf16,bf16-kahan", *TINY,
                     "--out", str(tmp_path)])
    assert code == 130
    out = capsys.readouterr().out
    assert "Interrupted at step 3 of 4" in out and "fp32" in out
    data = json.loads((tmp_path / "compare.json").read_text())
    assert data["interrupted"] is True
    # The recipes took their steps in turn, the third round in the order bf16-kahan, fp32, bf16:
    # both had taken their third step when bf16's was interrupted.
    steps = {r["recipe"]: len(r["losses"]) for r in data["records"]}
    assert steps == {"fp32": 3, "bf16": 2, "bf16-kahan": 3}
    assert all(math.isfinite(r["eval_loss"]) for r in data["records"])


def test_recipes_take_their_steps_in_turn_with_the_same_results_as_alone(monkeypatch):
    cfg = compare.CompareConfig(recipes=("fp32", "bf16-kahan", "bf16-sr"), steps=4,
                                model=ModelConfig(d_model=32, n_layer=1, n_head=2, context=16),
                                batch_size=4, eval_batches=1, monitor_every=2,
                                text_bytes=200_000)
    order = []
    real = run._Run.step

    def spy(self, batch):
        order.append(self.name)
        return real(self, batch)

    monkeypatch.setattr(run._Run, "step", spy)
    load: dict = {}
    records = compare.compare(cfg, load=load)
    # One step of each recipe per round, the round's first recipe rotating.
    a, b, c = cfg.recipes
    assert order == [a, b, c, b, c, a, c, a, b, a, b, c]
    # Interleaved, each recipe trains exactly as it does alone.
    text = load_text(cfg.text_bytes)
    batches = Batches(text, context=16, batch_size=4, seed=cfg.seed)
    torch.manual_seed(cfg.seed)
    initial = CharTransformer(cfg.model).state_dict()
    for r in records:
        alone = compare.run_recipe(r["recipe"], cfg, batches, initial)
        assert r["losses"] == alone["losses"] and r["eval_loss"] == alone["eval_loss"]
        assert r["lost_update_fraction"] == alone["lost_update_fraction"]
    # The speed-up is the median of the per-step ratios against fp32 (the first two steps, which
    # compile a fused step, left out).
    by = {r["recipe"]: r for r in records}
    for r in records:
        times = r["step_times_s"]
        ratios = sorted(f / t for f, t in zip(by["fp32"]["step_times_s"][2:], times[2:],
                                              strict=True))
        assert r["speedup"] == pytest.approx((ratios[0] + ratios[1]) / 2)
        lo, hi = r["speedup_iqr"]
        assert lo <= r["speedup"] <= hi
        assert r["step_time_s"] == pytest.approx((times[2] + times[3]) / 2)
        assert r["warmup_s"] == pytest.approx(max(0.0, times[0] + times[1] - 2 * r["step_time_s"]))
    assert load["rounds"] == 4
    if load["background_cores"] is not None:  # (Linux: /proc/stat)
        assert load["background_cores"] >= 0 and 0 <= load["contended_fraction"] <= 1


def test_background_load_is_measured_and_reported(capsys):
    meter = compare._Load()
    meter.start()
    sum(range(200_000))  # (this process's own work is not background)
    meter.stop()
    summary = meter.summary()
    assert summary["rounds"] == 1
    if summary["background_cores"] is not None:
        assert 0 <= summary["background_cores"] < 4
    console = _console()
    compare_cmd._load_note(console, {"background_cores": 0.9, "max_cores": 1.0,
                             "contended_fraction": 0.4}, threads=2)
    compare_cmd._load_note(console, {"background_cores": 0.0, "max_cores": 0.1,
                             "contended_fraction": 0.0}, threads=2)
    out = capsys.readouterr().out
    assert "The machine was contended" in out and "40% of the rounds" in out
    assert "Background load: 0.00 cores" in out


@pytest.mark.parametrize(
    "args, message",
    [
        (["compare", "--recipes", "fp32,bf17"], "unknown recipe 'bf17'; choose from fp32"),
        (["compare", "--recipes", "fp32,fp32"], "a recipe is listed twice"),
        (["compare", "--optimizer", "adamax"], "unknown optimizer 'adamax'; choose from sgd"),
        (["compare", "--steps", "0"], "must be at least 1, got 0"),
        (["compare", "--steps", "ten"], "expected a whole number, got 'ten'"),
        (["compare", "--lr", "-1"], "must be a positive finite number"),
        (["compare", "--lr", "nan"], "must be a positive finite number"),
        (["compare", "--d-model", "30", "--n-head", "4"], "d_model=30 must be a multiple of"),
        (["memory", "--optimizer", "rmsprop"], "unknown optimizer 'rmsprop'"),
        (["numerics", "--steps", "-3"], "must be at least 0, got -3"),
        (["numerics", "--small", "inf"], "small must be finite"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
    ],
)
def test_user_mistakes_give_a_message_not_a_traceback(args, message, capsys):
    with pytest.raises(SystemExit) as exc:
        code = main(args)
        raise SystemExit(code)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_unwritable_output_is_a_message(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    proc = run_cli("numerics", "--steps", "10", "--json", str(blocker / "x.json"))
    assert proc.returncode == 2
    assert "lowprec: error: cannot write" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("mistake", ["out-is-a-file", "json-is-a-folder", "plot-under-a-file",
                                     "json-not-creatable"])
def test_output_paths_are_checked_before_training(mistake, tmp_path, capsys, monkeypatch):
    """An output path that cannot be written stops ``compare`` before its first step (issue 22:
    the JSON and the plot were lost after minutes of training), with a message naming the option
    and the problem; nothing is trained (the run's header is not even printed)."""
    readme = tmp_path / "README.md"
    readme.write_text("a file")
    args, expected = {
        "out-is-a-file": (["--out", str(readme)], f"{readme} is a file, not a folder"),
        "json-is-a-folder": (["--out", str(tmp_path), "--json", str(tmp_path)],
                             f"--json {tmp_path} is a folder"),
        "plot-under-a-file": (["--out", str(tmp_path), "--plot", str(readme / "p.png")],
                              "(--plot): " + f"{readme} is a file"),
        "json-not-creatable": (["--json", "/proc/lowprec-x/compare.json"],
                               "cannot write /proc/lowprec-x/compare.json (--json)"),
    }[mistake]
    trained = []
    monkeypatch.setattr("lowprec.comparison.compare.compare", lambda *a, **k: trained.append(1))
    assert main(["compare", "--recipes", "fp32", *TINY, *args]) == 2
    captured = capsys.readouterr()
    assert "lowprec: error: " in captured.err and expected in captured.err, captured.err
    assert not trained and "lowprec compare" not in captured.out
    assert readme.read_text() == "a file"
    assert not list(tmp_path.glob(".lowprec-check-*"))  # the scratch file is removed


def test_progress_is_plain_lines_when_stdout_is_not_a_terminal(tmp_path, capsys):
    """Redirected to a file or a pipe (capsys here), the bars are not drawn, so ``compare``
    prints plain progress lines instead: recipe, step, the step's own loss, elapsed, time left;
    the table's loss column says what it is."""
    tiny = [a for a in TINY if a != "--no-progress"]
    assert main(["compare", "--recipes", "fp32,bf16", *tiny, "--no-plot",
                     "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    lines = re.findall(r"^(\S+) +step (\d)/4  loss \d+\.\d{4} \(this step\)  elapsed \d+ s, "
                       r"about \d+ s left$", out, flags=re.MULTILINE)
    # (each round takes the recipes in a rotating order: compare a sorted list)
    assert sorted(lines) == sorted((r, str(k)) for k in range(1, 5) for r in ("fp32", "bf16"))
    assert "train loss (last 10%)" in out and "mean over the last 10% of steps" in out
    assert re.search(r"Recommended: (fp32|bf16)|No recommendation", out)
    rec = json.loads((tmp_path / "compare.json").read_text())["recommendation"]
    assert rec["tolerance"] == 0.005 and set(rec["others"]) | {rec["recipe"]} >= {"bf16"}


def _rec(name, gap, total, ms):
    return {"recipe": name, "eval_gap": gap, "bytes_per_param": {"total": total},
            "step_time_s": ms / 1e3}


def test_recommendation_is_the_leanest_within_tolerance_then_the_fastest():
    records = [_rec("fp32", 0.0, 16.0, 80), _rec("bf16", 0.03, 8.0, 50),
               _rec("bf16-kahan", 0.001, 10.0, 60), _rec("bf16-sr", 0.004, 10.0, 55),
               _rec("bf16-split", -0.001, 14.0, 58), _rec("amp-bf16", float("nan"), 16.0, 70)]
    rec = compare.recommend(records, 0.005)
    assert rec["recipe"] == "bf16-sr"  # 10 B/param like bf16-kahan, and faster
    assert rec["reason"] == "eval loss +0.40% vs fp32 (within 0.50%), 10.0 B/param, 55 ms/step"
    assert rec["others"] == {
        "fp32": "16.0 B/param against 10.0",
        "bf16": "eval loss +3.00% vs fp32, beyond 0.50%",
        "bf16-kahan": "as lean, but slower: 60 against 55 ms/step",
        "bf16-split": "14.0 B/param against 10.0",
        "amp-bf16": "diverged",
    }
    tight = compare.recommend(records, 0.0001)  # only fp32 and bf16-split (below fp32) fit
    assert tight["recipe"] == "bf16-split"
    assert compare.recommend(records[1:])["recipe"] is None  # no fp32: nothing to compare with
    assert "add fp32" in compare.recommend(records[1:])["reason"]


@pytest.mark.parametrize("with_fp32", [True, False])
def test_plot_draws_every_panel_for_diverged_and_missing_references(tmp_path, with_fp32):
    """The picture is drawn for records with a diverged recipe (NaN losses, no eval gap) and
    for runs without fp32 (the gap panel then says what to add)."""
    steps = 50
    records = [dict(_rec("fp32", 0.0, 16.0, 80), losses=[3 - i / steps for i in range(steps)]),
               dict(_rec("bf16-kahan", 0.001, 10.0, 60),
                    losses=[3.01 - i / steps for i in range(steps)]),
               dict(_rec("bf16", None, 8.0, 50), losses=[3.0] * 10 + [math.nan] * 40)]
    if not with_fp32:
        records = records[1:]
    path = tmp_path / "p.png"
    plot.plot_losses(records, path, title="test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_diverged_run_is_reported_not_a_crash(tmp_path, capsys):
    code = main(["compare", "--recipes", "fp32", "--optimizer", "sgd", "--lr", "1e12", *TINY,
                     "--no-plot", "--out", str(tmp_path)])
    assert code == 0
    assert "fp32 diverged" in capsys.readouterr().out
    text = (tmp_path / "compare.json").read_text()
    assert "NaN" not in text and "Infinity" not in text  # strict JSON: non-finite is null
    record = json.loads(text)["records"][0]
    assert record["eval_loss"] is None and record["eval_gap"] is None


def test_no_command_prints_help(capsys):
    assert main([]) == 2
    assert "compare" in capsys.readouterr().out


def test_memory_table_agrees_with_the_tensors(tmp_path, capsys):
    path = tmp_path / "m.json"
    assert main(["memory", "--optimizer", "adamw", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "NO" not in out
    rows = {r["recipe"]: r for r in json.loads(path.read_text())["rows"]}
    assert set(rows) == set(recipes.RECIPES)
    # The AdamW figures: mixed precision 16, BF16 + Kahan 10, pure BF16 8, split 14.
    expected = {"amp-bf16": 16, "bf16-kahan": 10, "bf16": 8, "bf16-split": 14, "fp16-master": 16}
    for name, total in expected.items():
        assert rows[name]["expected"]["total"] == total
        assert rows[name]["measured"]["total"] == pytest.approx(total, abs=0.01)
    # 8-bit moments: 8 bytes per parameter, plus the block scales and the small parameters'
    # FP32 moments (0.06 on the built-in model).
    assert rows["bf16-kahan-8bit"]["measured"]["total"] == pytest.approx(8.06, abs=0.01)


@pytest.mark.parametrize("optimizer", ["muon", "adafactor"])
def test_memory_of_optimizers_whose_model_state_is_mixed(optimizer, capsys, monkeypatch):
    # Muon steps the embeddings, head, norms and biases with AdamW; Adafactor keeps row and
    # column means: the state column is the per-element figure, said so, the rest must agree.
    # The accounting is the subject, not the size: a one-block model of width 64 (each recipe's
    # Muon step on the built-in model orthogonalizes its matrices with BF16 matmuls, a minute
    # in all where torch has no fast BF16 kernel, as on AVX2-only CPUs).
    from lowprec.comparison import config

    monkeypatch.setitem(config.SIZES, "default", config.Size(
        ModelConfig(d_model=64, n_layer=1, n_head=2, context=32), 4, "a test's"))
    assert main(["memory", "--optimizer", optimizer]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "NO" not in out and "agrees compares the other columns" in out


def test_memory_with_accumulation_buffers(tmp_path, capsys):
    path = tmp_path / "m.json"
    assert main(["memory", "--accumulate", "kahan", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "accumulation" in out and "NO" not in out
    rows = {r["recipe"]: r for r in json.loads(path.read_text())["rows"]}
    assert rows["bf16-kahan"]["measured"]["accumulation"] == pytest.approx(2.0)
    assert rows["bf16-kahan"]["expected"]["total"] == 12
    assert rows["fp32"]["measured"]["accumulation"] == 0  # (FP32 gradients need none)


def test_numerics_shows_the_swamping_problem(tmp_path, capsys):
    path = tmp_path / "n.json"
    assert main(["numerics", "--steps", "500", "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    methods = data["swamping"]["methods"]
    assert methods["bf16"]["final"] == 1.0  # every 1e-4 below half a BF16 ulp of 1.0: lost
    assert methods["bf16-split"]["relative_error"] < 1e-4
    assert methods["bf16-kahan"]["relative_error"] < 0.01 < methods["bf16"]["relative_error"]
    rows = data["fp16_underflow"]["rows"]
    assert rows[0]["flushed"] > 0.1 > rows[-1]["flushed"]
    assert set(data["dfp16"]["modes"]) >= {"nearest", "stochastic", "biased"}
    out = capsys.readouterr().out
    assert "Swamping" in out and "FP16 underflow" in out and "DFP-16" in out


@pytest.mark.parametrize("args", [["--help"], ["compare", "--help"], ["--version"],
                                  ["compare", "--recipes", "bf8"], ["compare", "--d-model", "30"],
                                  ["compare", "--optimizer", "adamax"], ["memory", "--help"],
                                  ["compare", "--device", "gpu"], ["compare", "--size", "huge"]])
def test_help_and_mistakes_answer_without_importing_torch(args):
    # torch takes seconds to import: the command's help, version and argument errors do not
    # wait for it (issue 22, point 9); they answer as before.
    code = ("import sys\nfrom lowprec.cli.main import main\n"
            f"try:\n    status = main({args!r})\nexcept SystemExit as e:\n    status = e.code\n"
            "print('torch imported:', 'torch' in sys.modules, 'status:', status)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert "torch imported: False" in proc.stdout, proc.stdout + proc.stderr
    failed = args[-1] in ("bf8", "30", "adamax", "gpu", "huge")
    assert ("status: 2" if failed else "status: 0") in proc.stdout, proc.stdout
    assert "Traceback" not in proc.stderr


def test_the_package_names_import_on_first_use():
    # lowprec's top-level names are imported when first used, as plain imports give them.
    import lowprec
    from lowprec import optim as optim_mod

    for name in lowprec.__all__:
        assert getattr(lowprec, name) is not None, name
    assert lowprec.AdamW is optim_mod.AdamW and lowprec.recipes is recipes
    assert set(lowprec.__all__) <= set(dir(lowprec))
    # every submodule too, on first use (lowprec.dfp was reachable through recipes' import)
    code = "import lowprec; print(lowprec.dfp.convert_to_dfp.__name__, lowprec.scaling.__name__)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.stdout.split() == ["convert_to_dfp", "lowprec.scaling"], proc.stderr
    with pytest.raises(AttributeError, match="no attribute 'Adamax'"):
        _ = lowprec.Adamax
    assert recipes.RECIPES == lowprec.comparison.config.RECIPES
