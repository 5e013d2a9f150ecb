"""benchmarks/fused_check.py (fused == eager, bit for bit) and benchmarks/gpu_check.sh.

The check must never call a variant equal that is not: a fused step that differs, falls back to
eager or runs no compiled kernel at all is reported and fails the run. These tests inject each
of those on the CPU; the real equal runs compile (marked slow; CI runs them). gpu_check.sh's CPU
mode itself runs in .ci/run; here only its budget logic and summary, with no time to run any
section.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from lowprec.optim import compiled

ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("fused_check", ROOT / "benchmarks" / "fused_check.py")
fc = importlib.util.module_from_spec(_spec)
sys.modules["fused_check"] = fc  # (dataclasses resolve their module)
_spec.loader.exec_module(fc)

CPU = torch.device("cpu")


def test_variants_cover_every_optimizer_strategy_and_dtype():
    names = [v.name for v in fc.variants()]
    assert len(names) == len(set(names))
    for opt in fc.OPTIMIZERS:
        for master in ("none", "fp32", "split", "kahan", "stochastic"):
            assert f"{opt}/{master}/bf16" in names
            assert (f"{opt}/{master}/fp16" in names) == (master != "split")  # (split: BF16 only)
        assert f"{opt}/split/bf16/8bit" in names and f"{opt}/none/fp32" in names
        assert (f"{opt}/kahan/bf16/8bit" in names) == (opt in ("SGD", "AdamW", "Adagrad", "Lamb"))
    assert set(fc.QUICK) <= set(names)
    # The most informative first: a run cut short by its budget loses the least.
    assert names[0] == "AdamW/kahan/bf16"


def _as_if_fused(monkeypatch, tamper=None):
    """``fused_check._run`` with the fused runs stepped eagerly (nothing compiles), and
    ``tamper(params, opt)`` applied to each fused run's result."""
    real = fc._run

    def run(v, device, fused, *args, **kwargs):
        params, opt = real(v, device, False, *args, **kwargs)
        if fused and tamper is not None:
            tamper(params, opt)
        return params, opt

    monkeypatch.setattr(fc, "_run", run)


def test_a_differing_parameter_bit_is_reported_with_where_and_how_many(monkeypatch):
    def flip(params, opt):
        w = params[0].detach().view(-1).view(torch.int16)
        w[:3] ^= 1  # the last mantissa bit of three elements

    _as_if_fused(monkeypatch, flip)
    r = fc.check(fc.Variant("SGD", "split", "bf16"), CPU, quick=True)
    assert r["result"] == "DIFFERS", r
    # Three elements after the first run, the same three in the resumed one.
    assert r["detail"].startswith("6 of ") and "after 4 steps: param 0: 3" in r["detail"], r


def test_a_differing_state_tensor_is_reported(monkeypatch):
    def nudge(params, opt):
        state = opt.state[params[1]]
        state["compensation"].view(-1)[7] += 1

    _as_if_fused(monkeypatch, nudge)
    r = fc.check(fc.Variant("AdamW", "kahan", "bf16"), CPU, quick=True)
    assert r["result"] == "DIFFERS" and "compensation of 1: 1" in r["detail"], r


def test_a_run_resumed_from_the_fused_checkpoint_keeps_its_own_step():
    """The fused run's state_dict carries fused=True in its groups: the eager run resumed from
    it must stay eager, or the resumed comparison would be fused against fused."""
    v = fc.Variant("SGD", "split", "bf16")
    init = [torch.ones(8, dtype=torch.bfloat16)]
    _, saver = fc._run(v, CPU, True, init, 0, seed=1)
    assert saver.state_dict()["param_groups"][0]["fused"] is True
    for fused in (False, True):
        _, opt = fc._run(v, CPU, fused, init, 0, seed=1, state=saver.state_dict())
        assert [g["fused"] for g in opt.param_groups] == [fused]


def test_no_compiled_kernel_run_is_a_fallback_not_a_pass(monkeypatch):
    """The bits match (both runs eager), but nothing compiled ran: that is no pass."""
    _as_if_fused(monkeypatch)
    r = fc.check(fc.Variant("SGD", "none", "fp32"), CPU, quick=True)
    assert r["result"] == "FALLBACK", r
    assert r["detail"] == "no compiled kernel ran in the first fused run and the resumed fused run"


def test_an_eager_reference_that_ran_compiled_kernels_is_an_error(monkeypatch):
    """Fused against fused proves nothing (a resumed run that took the checkpoint's fused=True
    did so): the eager runs may call no compiled kernel."""
    real = fc._run
    fake = compiled._Kernel(lambda *a, **k: None, "fake")
    fake.warm = True

    def calls_a_kernel(v, device, fused, *a, **k):
        if not fused:
            fake()  # as if the eager run had compiled its step
        return real(v, device, False, *a, **k)

    monkeypatch.setattr(fc, "_run", calls_a_kernel)
    r = fc.check(fc.Variant("SGD", "none", "fp32"), CPU, quick=True)
    assert r["result"] == "ERROR" and "eager reference ran compiled kernels" in r["detail"], r


def _failing_compiler(monkeypatch):
    def failing(*args, **kwargs):
        def kernel(*a, **k):
            raise RuntimeError("simulated compile failure")
        return kernel

    monkeypatch.setattr(compiled, "_compiled_kernel", failing)


def test_a_compile_failure_that_falls_back_to_eager_is_a_failure(monkeypatch, tmp_path):
    """A kernel that fails to compile makes the step fall back to eager with the same bits and a
    warning: the check reports FALLBACK with the cause, and exits 1."""
    _failing_compiler(monkeypatch)
    r = fc.check(fc.Variant("AdamW", "kahan", "bf16"), CPU, quick=True)
    assert r["result"] == "FALLBACK" and "simulated compile failure" in r["detail"], r
    out = tmp_path / "fused.json"
    assert fc.main(["--device", "cpu", "--quick", "--only", "SGD/split", "--json", str(out)]) == 1
    data = json.loads(out.read_text())
    assert data["counts"]["FALLBACK"] == 1 and data["results"][0]["variant"] == "SGD/split/bf16"


def test_an_exception_in_a_step_is_an_error(monkeypatch):
    def broken(params, opt):
        raise ValueError("simulated")

    _as_if_fused(monkeypatch, broken)
    r = fc.check(fc.Variant("SGD", "split", "bf16"), CPU, quick=True)
    assert r["result"] == "ERROR" and "ValueError: simulated" in r["detail"], r


def test_past_the_budget_the_rest_are_skipped_and_do_not_fail(monkeypatch, capsys):
    _as_if_fused(monkeypatch)  # (never reached: the budget is spent before the first variant)
    assert fc.main(["--device", "cpu", "--quick", "--budget-s", "-1"]) == 0
    out = capsys.readouterr().out
    assert out.count("SKIPPED (past the budget") == len(fc.QUICK), out


@pytest.mark.slow
def test_quick_on_the_cpu_in_two_worker_processes(tmp_path, capsys):
    """The real thing: --quick's variants compiled and run in two --jobs workers (the GPU run's
    way), each equal, each with the compiled kernels it ran named."""
    out = tmp_path / "fused.json"
    env = {k: v for k, v in os.environ.items() if k != "LOWPREC_FUSED"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "fused_check.py"), "--device", "cpu", "--quick",
         "--jobs", "2", "--json", str(out)],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads(out.read_text())
    assert [r["variant"] for r in data["results"]] == list(fc.QUICK)
    assert all(r["result"] == "equal" and r["kernels"] for r in data["results"]), data
    assert f"{len(fc.QUICK)} equal of {len(fc.QUICK)}" in done.stdout


def test_gpu_check_keeps_to_its_budget_and_writes_its_summary(tmp_path):
    """With no time at all every section is skipped, saying so; the summary and the last line
    count them, and the run exits 0 (nothing failed)."""
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "GPU_CHECK_BUDGET_S": "0", "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh")], capture_output=True,
                          text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert [s["section"] for s in summary["sections"]] == [
        "1-versions", "2-fused", "3-pytest", "4-bench", "5-choices", "6-train"]
    assert all(s["status"] == "skip" for s in summary["sections"])
    assert any("no time left" in s["reason"] for s in summary["sections"])
    assert summary["counts"] == {"pass": 0, "fail": 0, "skip": 6}
    assert "| 2-fused: fused == eager, bit for bit | skip |" in (out / "summary.md").read_text()
    assert done.stdout.strip().splitlines()[-1].startswith("gpu_check: 0 passed, 0 failed, 6 skipped")
