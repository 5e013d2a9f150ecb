"""The floor subset's choice from the suite's largest files.

CI (``.ci/run``) runs every test marked ``floor`` once more under the oldest torch that
pyproject.toml claims (torch 2.11.0, in ``.ci/venv-floor``). tests/test_scaling.py (the loss
scaler) and tests/test_versions.py carry the marker whole. The files of the fused step, the eager
optimizers, the loss-scaled step, the 1-bit hook and DTensor took 4 to 17 minutes each there with
a cold Inductor cache (every compiled variant, every multi-process scenario; on 2 busy cores), so
this module runs a few of their cases through their own test functions and workers, the same
checks on fewer cases: each optimizer's
fused step against its eager step across a checkpoint, 8-bit state, the loss-scaled step eager and
fused, the eager step against torch.optim and its checkpoints, the 1-bit hook against its
simulation (eager and compiled, FP32 and BF16 buckets), and DTensor shards against the unsharded
run (fused with a loss scaler, LossScaler.unscale_, LAMB's sums over the ranks).
"""

from __future__ import annotations

import pytest
import torch

from lowprec.optim import SGD, Adagrad, AdamW, Lamb, compiled
from tests import _dist_workers as workers
from tests import _shard_workers as shard
from tests import (
    test_distributed,
    test_dtensor,
    test_fused,
    test_optim,
    test_qstate,
    test_step_scaling,
)

pytestmark = pytest.mark.floor

B, H, F = torch.bfloat16, torch.float16, torch.float32
KW = dict(test_fused.OPTIMIZERS)

#: Before torch 2.13, Inductor's C++ code drops the round trip through FP16/BF16 that Kahan's
#: remainder is made of (``compiled._CPU_ROUND_TRIPS_KEPT``): fused=True with Kahan falls back
#: to the eager step there with a warning (``compiled.RoundTripsDropped``), which fails a test
#: marked ``fused``, and the default step stays eager. The compiled cases here take the other
#: strategies.
ROUND_TRIPS_DROPPED = (
    torch.torch_version.TorchVersion(torch.__version__) < compiled._CPU_ROUND_TRIPS_KEPT
)

# The eager step against torch.optim, its checkpoints, split against FP32: the tests themselves,
# with their own cases.
test_none_on_fp32_matches_torch = test_optim.test_none_on_fp32_matches_torch
test_split_equals_fp32_bit_for_bit = test_optim.test_split_equals_fp32_bit_for_bit
test_save_load_resumes_bit_for_bit_and_keeps_dtypes = (
    test_optim.test_save_load_resumes_bit_for_bit_and_keeps_dtypes)
test_resumes_a_torch_optim_checkpoint = test_optim.test_resumes_a_torch_optim_checkpoint


@pytest.mark.fused
@pytest.mark.parametrize(("cls", "dtype", "master"), [
    (AdamW, B, "stochastic"), (SGD, B, "split"), (Adagrad, B, "stochastic"), (Lamb, B, "split"),
    (SGD, F, "none"), (AdamW, H, "fp32"),
    pytest.param(AdamW, H, "kahan", marks=pytest.mark.xfail(
        ROUND_TRIPS_DROPPED, strict=True,
        reason=f"torch {torch.__version__}'s C++ code drops Kahan's round trip: eager")),
], ids=lambda v: getattr(v, "__name__", str(v).replace("torch.", "")))
def test_fused_equals_eager_across_a_checkpoint(cls, dtype, master):
    test_fused.test_fused_equals_eager_bit_for_bit_across_a_checkpoint(
        cls, KW[cls], dtype, master, "cpu")


@pytest.mark.fused
def test_fused_8bit_state_equals_eager(monkeypatch):
    test_qstate.test_fused_step_equals_eager_bit_for_bit(
        SGD, {"lr": 0.1, "momentum": 0.9}, "split", None, monkeypatch, "cpu")


@pytest.mark.parametrize("name", sorted(test_step_scaling.OPTIMIZERS))
def test_scaled_step_equals_unscaled_and_skips(name):
    test_step_scaling.test_scaled_step_equals_unscaled_bitwise_and_skips_cleanly(
        name, "kahan", "cpu")


@pytest.mark.fused
@pytest.mark.parametrize(("name", "master"), [("adamw", "split"), ("sgd", "stochastic")])
def test_fused_scaled_step_equals_eager(name, master):
    test_step_scaling.test_fused_scaled_step_equals_eager(name, master, "cpu")


# ------------------------------------------------------------------------------ the 1-bit hook

HOOK = ("w2-1bit-range-warmup", "w2-fused-1bit", "w2-bf16")


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    """HOOK's scenarios, run by 2 gloo processes: results[name][rank]. (Run once per session:
    where tests/test_distributed.py runs too, the two read the same launch's results.)"""
    return test_distributed.run_synthetic(HOOK, "gloo", tmp_path_factory)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", HOOK)
def test_hook_matches_simulation(synthetic, name):
    test_distributed.test_hook_matches_simulation_bit_for_bit(synthetic, name, "gloo")
    if test_distributed.SYNTHETIC[name][1]["state"].get("fused"):  # (compiled, not fallen back)
        assert all(rank["compiled"] for rank in synthetic[name])


# ----------------------------------------------------------------------------------- DTensor

SHARDED = ("adamw-stochastic-fused-scaled-inf", "sgd-split-scaler-inf", "lamb-kahan")


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """SHARDED's configurations on 2 gloo processes: results per rank. (Where
    tests/test_dtensor.py's runs came first in this session, its first 2-rank mesh's.)"""
    if test_dtensor.RUN:
        return [test_dtensor.RUN[r]["2"] for r in range(2)]
    out = tmp_path_factory.mktemp("floor-sharded")
    workers.launch(shard.worker_sharded, 2, out, {n: test_dtensor.CONFIGS[n] for n in SHARDED})
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", SHARDED)
def test_sharded_steps_equal_unsharded(sharded, name):
    cfg = test_dtensor.CONFIGS[name]
    test_dtensor.check_sharded(cfg, sharded, name, test_dtensor.reference(cfg))
