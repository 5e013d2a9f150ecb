"""lowprec's optimizers on DTensor parameters (FSDP2's ``fully_shard``, tensor parallelism).

The steps run on each rank's shard (``lowprec.optim.shards``). The reference is the unsharded
run: the same optimizer on the same full tensors in this process. Every master strategy must give
its bits, element for element, stochastic rounding included (its random bits are keyed by the
element's index in the whole parameter), with the state kept as DTensors placed as the
parameters. The sharded runs are in 2 and 3 gloo processes (fixture ``sharded``).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from tests import _dist_workers as workers
from tests import _shard_workers as shard
from tests._fallback import fallbacks_are_errors

# (fused: the unsharded reference runs here, and a compiled step of it that falls back to
# eager fails the test; the sharded runs' fused steps raise in the workers likewise)
pytestmark = [pytest.mark.multiprocess, pytest.mark.fused]

B, F = torch.bfloat16, torch.float32
SGD = {"lr": 0.1, "momentum": 0.9, "seed": 3}
CONFIGS = {
    **{f"sgd-{m}": {"cls": "SGD", "dtype": B, "kw": {**SGD, "master": m, "fused": False}}
       for m in ("none", "kahan", "split", "stochastic", "fp32")},
    **{f"sgd-{m}-fused": {"cls": "SGD", "dtype": B, "kw": {**SGD, "master": m, "fused": True}}
       for m in ("split", "stochastic")},
    "adamw-kahan-fused": {"cls": "AdamW", "dtype": B,
                          "kw": {"lr": 1e-2, "weight_decay": 0.1, "master": "kahan",
                                 "fused": True}},
    "adamw-stochastic": {"cls": "AdamW", "dtype": B,
                         "kw": {"lr": 1e-2, "master": "stochastic", "fused": False, "seed": 5}},
    "adamw-stochastic-resume": {"cls": "AdamW", "dtype": B, "resume": True,
                                "kw": {"lr": 1e-2, "master": "stochastic", "seed": 5,
                                       "fused": False}},
    "adagrad-fp32-params": {"cls": "Adagrad", "dtype": F,
                                  "kw": {"lr": 0.1, "fused": False}},
    "adagrad-split": {"cls": "Adagrad", "dtype": B, "kw": {"lr": 0.1, "master": "split"}},
    # Sharded along dim 1 (tensor parallelism's row-wise layout): fine without random bits.
    "adamw-kahan-dim1-fused": {"cls": "AdamW", "dtype": B, "shard_dim": 1,
                               "kw": {"lr": 1e-2, "master": "kahan", "fused": True}},
    "sgd-split-dim1": {"cls": "SGD", "dtype": B, "shard_dim": 1,
                       "kw": {**SGD, "master": "split"}},
    # Under a loss scaler, an inf in one rank's shard skips the step on every rank.
    "sgd-split-scaled-inf": {"cls": "SGD", "dtype": B, "scaled": True, "inf_step": 2,
                             "kw": {**SGD, "master": "split"}},
    "adamw-stochastic-fused-scaled-inf": {"cls": "AdamW", "dtype": B, "scaled": True,
                                          "inf_step": 1,
                                          "kw": {"lr": 1e-2, "master": "stochastic",
                                                 "seed": 5, "fused": True}},
    # lowprec.LossScaler with unscale_ first (clipping's order): the inf is found by one rank's
    # unscale_, and every rank skips and backs off alike.
    # ... with a plain parameter beside the DTensors ("b"): one list of gradients of both kinds.
    "sgd-split-scaler-inf": {"cls": "SGD", "dtype": B, "scaler": True, "inf_step": 2,
                             "plain": ("b",), "kw": {**SGD, "master": "split"}},
    "adamw-stochastic-fused-mixed": {"cls": "AdamW", "dtype": B, "plain": ("b", "big"),
                                     "kw": {"lr": 1e-2, "master": "stochastic", "seed": 5,
                                            "fused": True}},
    # Fused, with small parameters batched, through deepcopy, torch.save and torch.load.
    "adamw-kahan-fused-resume": {"cls": "AdamW", "dtype": B, "resume": True,
                                 "kw": {"lr": 1e-2, "master": "kahan", "fused": True}},
    "sgd-stochastic-fused-resume": {"cls": "SGD", "dtype": B, "resume": True,
                                    "kw": {**SGD, "master": "stochastic", "fused": True}},
    # LAMB: each shard's sums of squares added over the ranks make the whole tensor's norms.
    "lamb-kahan": {"cls": "Lamb", "dtype": B, "kw": {"lr": 1e-2, "weight_decay": 0.01,
                                                     "master": "kahan", "fused": False}},
    "lamb-split-fused": {"cls": "Lamb", "dtype": B, "kw": {"lr": 1e-2, "master": "split",
                                                           "fused": True}},
    "lamb-stochastic-fused": {"cls": "Lamb", "dtype": B, "kw": {"lr": 1e-2, "seed": 2,
                                                                "master": "stochastic",
                                                                "fused": True}},
    # 8-bit state: "big"'s shards are whole rows of whole blocks, so they keep 8-bit codes with
    # the unsharded run's bits and scales sharded as the rows; the small ones FP32 state.
    "adamw-kahan-8bit-fused": {"cls": "AdamW", "dtype": B,
                               "kw": {"lr": 1e-2, "master": "kahan", "state_dtype": "8bit",
                                      "fused": True}},
    "lamb-stochastic-8bit-fused": {"cls": "Lamb", "dtype": B,
                                   "kw": {"lr": 1e-2, "seed": 2, "master": "stochastic",
                                          "state_dtype": "8bit", "fused": True}},
    "sgd-split-8bit-resume": {"cls": "SGD", "dtype": B, "resume": True,
                              "kw": {**SGD, "master": "split", "state_dtype": "8bit",
                                     "fused": False}},
    # The elementwise optimizers beside the first four: Adam's L2 decay and RAdam's rectified
    # steps on shards; Lion's 8-bit momentum; StableAdamW's RMS, a sum over every rank's shard.
    "adam-stochastic-fused": {"cls": "Adam", "dtype": B,
                              "kw": {"lr": 1e-2, "weight_decay": 0.1, "seed": 4,
                                     "master": "stochastic", "fused": True}},
    "radam-split": {"cls": "RAdam", "dtype": B, "kw": {"lr": 1e-2, "master": "split",
                                                       "fused": False}},
    "lion-kahan-8bit-fused": {"cls": "Lion", "dtype": B,
                              "kw": {"lr": 1e-3, "weight_decay": 0.1, "master": "kahan",
                                     "state_dtype": "8bit", "fused": True}},
    "stableadamw-kahan-fused": {"cls": "StableAdamW", "dtype": B,
                                "kw": {"lr": 1e-2, "master": "kahan", "fused": True}},
    "stableadamw-split": {"cls": "StableAdamW", "dtype": B,
                          "kw": {"lr": 1e-2, "master": "split", "fused": False}},
    # A checkpoint of the full tensors is refused for sharded parameters, nothing loaded.
    "sgd-kahan-load-plain": {"cls": "SGD", "dtype": B, "load_plain": True,
                             "kw": {**SGD, "master": "kahan"}},
}
# What a shard cannot do alone: refused before anything is written.
REFUSED = {
    "sr-rank-seeds": ({"cls": "AdamW", "dtype": B, "rank_seed": True,
                       "kw": {"lr": 1e-2, "master": "stochastic"}},
                      "ValueError", "different seeds"),
    "sr-dim1": ({"cls": "SGD", "dtype": B, "shard_dim": 1,
                 "kw": {"lr": 0.1, "master": "stochastic"}},
                "NotImplementedError", "are not blocks of it"),
    # Adafactor's row and column means (and Muon's orthogonalization) need the whole matrix.
    "adafactor-sharded": ({"cls": "Adafactor", "dtype": B, "kw": {"master": "kahan"}},
                          "NotImplementedError", "needs each parameter whole"),
}


def reference(cfg):
    """The unsharded run: the same steps on plain tensors."""
    params = {n: nn.Parameter(t) for n, t in shard.full_params(cfg["dtype"]).items()}
    opt = shard.make(cfg, list(params.values()))
    scaler = shard.new_scaler(cfg)
    found = []
    for step in range(shard.STEPS):
        for n, g in shard.grads_for_step(cfg, step, scaler).items():
            params[n].grad = g
        found.append(shard.opt_step(opt, cfg, scaler))
    return params, opt, found


@pytest.fixture(scope="module")
def references():
    """Every configuration's unsharded run, made once and before any rank starts: the ranks then
    find the kernels they compile in Inductor's on-disk cache, where 2 to 4 processes used to
    compile each at once. A fused run here may not fall back to eager (the tests' ``fused``
    mark does not reach a module's fixture)."""
    out = {}
    for name, cfg in CONFIGS.items():
        with fallbacks_are_errors() if cfg["kw"].get("fused") else contextlib.nullcontext():
            out[name] = reference(cfg)
    return out


# HSDP: a 2 x 2 mesh, replicated along its first dimension, sharded along its second.
HSDP = ("adamw-stochastic-fused-scaled-inf", "sgd-split-scaler-inf", "lamb-kahan",
        "lamb-stochastic-fused", "adamw-kahan-fused-resume")


@pytest.fixture(scope="module")
def meshes(tmp_path_factory, references):
    """Every sharded run, in one launch of 4 gloo processes (``shard.worker_meshes``): CONFIGS on
    two 2-rank meshes side by side (the rows of a 2 x 2 mesh), on a 3-rank mesh, HSDP's on the
    2 x 2 mesh, then REFUSED on the 2-rank meshes (last: ``rank_seed`` reseeds the processes).
    Results per rank: ``{phase: {name: results}}``. (One launch per mesh had each launch's
    processes compile every fused variant anew: 3 launches, 9 processes, where these 4 compile
    each once.)"""
    where = tmp_path_factory.mktemp("meshes")
    RUN.clear()
    workers.launch(shard.worker_meshes, 4, where, [
        ("2", "pairs", CONFIGS), ("3", "three", CONFIGS),
        ("hsdp", "grid", {k: CONFIGS[k] for k in HSDP}),
        ("2", "pairs", {k: v[0] for k, v in REFUSED.items()}),
    ])
    RUN.extend(torch.load(where / f"rank{r}.pt", weights_only=False) for r in range(4))
    return RUN


#: ``meshes``' results once it has run in this session: tests/test_floor.py's DTensor tests read
#: them instead of launching their own 2-rank run of the same configurations (under the floor's
#: torch, where this module's multi-process tests do not run, they launch it).
RUN: list[dict] = []


@pytest.fixture(scope="module")
def sharded(meshes):
    """Per world size, each rank's results in mesh order: for 2, both 2-rank meshes (ranks 0, 1,
    then 2, 3: the second shard at odd places, as on the 2 x 2 mesh); for 3, ranks 0, 1, 3."""
    return {2: [meshes[r]["2"] for r in range(4)],
            3: [meshes[r]["3"] for r in shard.THREE]}


@pytest.fixture(scope="module")
def hsdp(meshes):
    return [meshes[r]["hsdp"] for r in range(4)]


@pytest.mark.parametrize("name", HSDP)
def test_hsdp_steps_equal_unsharded(hsdp, references, name):
    """On a 2-D mesh the inf/NaN finding, LAMB's sums and the seed check span the sharded
    dimension, and the replicas stay equal."""
    check_sharded(CONFIGS[name], hsdp, name, references[name])


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_sharded_steps_equal_unsharded(sharded, references, world, name):
    check_sharded(CONFIGS[name], sharded[world], name, references[name])


def check_sharded(cfg, ranks, name, unsharded):
    params, opt, found = unsharded
    for rank, results in enumerate(ranks):
        got = results[name]
        assert "error" not in got, got.get("error")
        assert got["found"] == found, rank  # (an inf in one shard: every rank skips)
        calls, based = got["compiled"]
        if (cfg["kw"].get("master") == "kahan" and not cfg["kw"].get("state_dtype")
                and cfg["cls"] in ("AdamW", "SGD", "Lamb")):
            # (the even-sized shards of a group go into a bucket, their state gathered per
            # piece, so that a checkpoint can deep-copy it, as the resume runs do; LAMB's,
            # whose sums add every rank's, each a bucket of one, stepped in the parameters'
            # order)
            assert got["bucketed"] >= 2, (rank, got["bucketed"])
        if cfg["cls"] in ("Lamb", "StableAdamW"):
            # (shards whose sums add every rank's, gathered where every rank's shard has one
            # shape, so that every rank cuts the same pieces: "sq" and "sq2")
            assert got["gathered_shards"] >= 2, (rank, got["gathered_shards"])
        if cfg["kw"].get("master") == "stochastic" and cfg["cls"] in ("AdamW", "SGD"):
            # (stochastic rounding's shards gathered too, each word keyed by its index in its
            # parameter: "w" and "big", whose shards start on even elements)
            assert got["gathered_shards"] >= (1 if cfg.get("plain") else 2), (rank, got)
        if cfg["kw"].get("fused"):  # (not silently eager: the same bits would pass)
            assert calls > 0, rank
            if not cfg.get("resume"):  # (the buckets' calls kept: none prepared at the last)
                assert got["prepared"][-1] == got["prepared"][-2], (rank, got["prepared"])
            # A shard past the start of a stochastic parameter keys its bits in the kernel, by
            # its base alone or by its words' indices in a gathered piece (in 4 ranks' results,
            # the 2 x 2 mesh's or two 2-rank meshes': the second shard, odd ranks).
            past = rank % 2 if len(ranks) == 4 else rank
            want_based = past > 0 and cfg["kw"]["master"] == "stochastic"
            assert (based > 0) == want_based, (rank, based)
        else:
            assert calls == 0, rank
        for n, p in params.items():
            assert torch.equal(got["params"][n], p.detach()), (rank, n)
            assert torch.equal(got["masters"][n], opt.master_weight(p)), (rank, n)
            want = opt.state[p]
            assert set(got["state"][n]) == set(want), (rank, n)
            for k, v in want.items():
                if isinstance(v, torch.Tensor):
                    # (an 8-bit buffer's scales: flat here, a row per row of the DTensor there)
                    g = got["state"][n][k]
                    assert torch.equal(g.view(v.shape) if k.endswith("_scale") else g, v), (
                        rank, n, k)
                    if k != "step":  # (parameter-shaped state: a DTensor placed as the parameter)
                        assert got["placements"][n][k] == got["param_placements"][n], (n, k)
                else:
                    assert got["state"][n][k] == v


def test_a_full_checkpoint_is_refused_for_sharded_parameters(sharded):
    for results in sharded[2]:
        got = results["sgd-kahan-load-plain"]
        assert "error" not in got, got.get("error")
        assert "is a plain tensor" in got["load_error"], got["load_error"]
        assert "distribute_tensor" in got["load_error"]
        assert not got["load_left_state"]


@pytest.mark.parametrize("name", list(REFUSED))
def test_what_a_shard_cannot_do_is_refused_and_changes_nothing(sharded, name):
    cfg, error, message = REFUSED[name]
    start = shard.full_params(cfg["dtype"])
    for results in sharded[2]:
        got = results[name]
        assert got["error"].startswith(error) and message in got["error"], got["error"]
        for n, t in start.items():
            assert torch.equal(got["params"][n], t), n
        assert all(not st for st in got["state"].values())


FSDP2_RUNS = {f"{m}-{'fused' if f else 'eager'}": {"master": m, "fused": f}
              for m in ("split", "stochastic", "kahan") for f in (False, True)}
FSDP2_RUNS["kahan-8bit-fused"] = {"master": "kahan", "fused": True, "state_dtype": "8bit",
                                  "wide": True, "monitor": True}


@pytest.fixture(scope="module")
def fsdp2_and_dcp(tmp_path_factory):
    """FSDP2_RUNS, then DCP_RUNS, in the same 2 gloo processes (one launch: the DCP runs find
    the kernels the FSDP2 runs compiled)."""
    where = tmp_path_factory.mktemp("fsdp2")
    workers.launch(shard.worker_fsdp2, 2, where, FSDP2_RUNS, DCP_RUNS)
    return [torch.load(where / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.fixture(scope="module")
def fsdp2(fsdp2_and_dcp):
    return [results["fsdp2"] for results in fsdp2_and_dcp]


@pytest.mark.parametrize("master", ["split", "stochastic", "kahan"])
def test_fsdp2_training(fsdp2, master):
    """A model under FSDP2's fully_shard: its shards step as the whole model does, given the
    gradients FSDP2 reduced, to the last bit, fused and eager; and the steps moved it."""
    start = dict(shard._mlp().named_parameters())
    for rank, results in enumerate(fsdp2):
        for how in ("eager", "fused"):
            got = results[f"{master}-{how}"]
            for n, w in got["unsharded"].items():
                assert torch.equal(got["sharded"][n], w), (rank, how, n)
                assert not torch.equal(w, start[n].detach()), (rank, how, n)


DCP_RUNS = {"split": {"master": "split"}, "stochastic": {"master": "stochastic"},
            "kahan-8bit-fused": {"master": "kahan", "fused": True, "state_dtype": "8bit",
                                 "wide": True},
            # BF16 moments saved, resumed as 8-bit codes (each rank encodes its shards).
            "bf16-as-8bit": {"master": "kahan", "state_dtype": torch.bfloat16, "wide": True,
                             "resume_as": {"state_dtype": "8bit"}},
            "fp32": {"master": "fp32"},
            "kahan-fused": {"master": "kahan", "fused": True},
            "stochastic-fused": {"master": "stochastic", "fused": True},
            # Saved under split, resumed under fp32 and under kahan (issue 22's strategy switch).
            "split-as-fp32": {"master": "split", "resume_as": {"master": "fp32"}},
            "split-as-kahan": {"master": "split", "fused": True,
                               "resume_as": {"master": "kahan"}}}


@pytest.fixture(scope="module")
def dcp_runs(fsdp2_and_dcp):
    return [results["dcp"] for results in fsdp2_and_dcp]


@pytest.mark.parametrize("name", [n for n, run in DCP_RUNS.items() if "resume_as" not in run])
def test_fsdp2_distributed_checkpoint_resumes_bit_for_bit(dcp_runs, name):
    """FSDP2's checkpoint path (get_state_dict, torch.distributed.checkpoint save and load,
    set_state_dict) saves the sharded state and a resumed run goes on as the straight one."""
    for rank, results in enumerate(dcp_runs):
        straight, resumed = results[name]["straight"], results[name]["resumed"]
        for n, w in straight.items():
            assert torch.equal(resumed[n], w), (rank, n)


def test_fsdp2_training_with_8bit_state(fsdp2):
    """FSDP2 with 8-bit state: the weight whose rows are whole blocks keeps its shards as 8-bit
    codes, and the sharded steps give the unsharded model's bits (the small weights: FP32 state
    alike)."""
    start = dict(shard._mlp(wide=True).named_parameters())
    for rank, results in enumerate(fsdp2):
        got = results["kahan-8bit-fused"]
        assert {n for n, d in got["state_dtypes"].items() if d == torch.uint8} == {"4.weight"}
        for n, w in got["unsharded"].items():
            assert torch.equal(got["sharded"][n], w), (rank, n)
            assert not torch.equal(w, start[n].detach()), (rank, n)


def test_update_monitor_on_fsdp2_counts_as_on_the_unsharded_model(fsdp2):
    """UpdateMonitor around the FSDP2 steps (previewed on each rank's shards, the counts and
    sums added over the ranks) reports what it reports for the unsharded model: the same
    counts, and errors equal but for the order of the sums."""
    import math

    for rank, results in enumerate(fsdp2):
        sharded, whole = results["kahan-8bit-fused"]["reports"]
        assert sharded["steps_monitored"] == whole["steps_monitored"] == 3
        assert [p["name"] for p in sharded["params"]] == [p["name"] for p in whole["params"]]
        for got, want in zip(sharded["params"], whole["params"], strict=True):
            for k in ("numel", "steps", "updated", "lost", "master_lost"):
                assert got[k] == want[k], (rank, got["name"], k)
            for k in ("relative_error", "master_relative_error", "state_relative_error"):
                if want[k] is None:
                    assert got[k] is None, (rank, got["name"], k)
                else:
                    assert math.isclose(got[k], want[k], rel_tol=1e-9), (rank, got["name"], k)
        by_name = {p["name"]: p for p in whole["params"]}
        assert by_name["4.weight"]["state_relative_error"] is not None  # (its 8-bit state)
        assert whole["updated"] > 0


def test_a_dcp_checkpoint_of_bf16_moments_resumes_as_8bit_state(dcp_runs):
    """A DCP checkpoint of BF16 moments handed to an 8-bit optimizer: each rank encodes its
    shards, and the resumed run steps with 8-bit codes, near the straight BF16 run."""
    for rank, results in enumerate(dcp_runs):
        run = results["bf16-as-8bit"]
        assert run["resumed_dtypes"]["4.weight"] == torch.uint8, rank
        assert run["resumed_dtypes"]["0.weight"] == torch.float32, rank
        for n, w in run["straight_masters"].items():
            # (the 2 steps after the switch: the 8-bit run moves as the BF16 one, within a
            # tenth of how far both moved)
            moved = (w - run["loaded"][n]).norm()
            off = (run["resumed_masters"][n] - w).norm()
            assert 0 < off < 0.1 * moved, (rank, n, float(off), float(moved))


def test_a_dcp_checkpoint_resumes_under_another_master_strategy(dcp_runs):
    """A DCP checkpoint saved under split, loaded under split, then handed to an optimizer of
    another strategy (its load_state_dict converts each rank's shards): into fp32 the FP32
    masters go on exactly as the straight split run's; into kahan each shard's masters become
    what the conversion makes of the whole tensors (BF16 value plus BF16 remainder), and the
    run goes on the kahan way."""
    from lowprec.optim.storage import STORAGES, convert

    for rank, results in enumerate(dcp_runs):
        exact, lean = results["split-as-fp32"], results["split-as-kahan"]
        assert set(exact["resumed_state"].values()) == {"fp32"}
        assert set(lean["resumed_state"].values()) == {"kahan"}
        for n, w in exact["straight_masters"].items():
            assert torch.equal(exact["resumed_masters"][n], w), (rank, n)
            loaded = lean["loaded"][n]
            top, bufs = convert(STORAGES["fp32"], STORAGES["kahan"], loaded.to(B),
                                {"master_weight": loaded})
            assert torch.equal(lean["converted"][n], STORAGES["kahan"].load(top, bufs)), n
            assert not torch.equal(lean["resumed_masters"][n], lean["converted"][n]), n


def test_fsdp2_example_runs_under_torchrun(tmp_path):
    """examples/fsdp2_bf16.py with ``torchrun --nproc-per-node 2`` on 127.0.0.1: a DCP checkpoint
    after 6 steps, resumed to 10, ends where 10 straight steps end, to the last bit; resumed
    with another --strategy (kahan), it says so and trains on from the converted state
    (issue 22: it ended in a traceback, a missing 'compensation' key). The example chooses its
    device (``--device auto``): NCCL and CUDA only with a GPU per rank, so on a machine with
    fewer than 2 GPUs (one GPU included) gloo on the CPU; it says which."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    from tests._devices import cuda_count

    script = Path(__file__).resolve().parents[1] / "examples" / "fsdp2_bf16.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    nccl = cuda_count() >= 2 and torch.distributed.is_nccl_available()
    chosen = "device: cuda, backend nccl" if nccl else "device: cpu, backend gloo"

    def torchrun(*args: str, strategy: str = "split") -> tuple[str, ...]:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
               "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(workers.free_port()), str(script), "--strategy", strategy,
               "--log-every", "5", *args]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, done.stdout + done.stderr
        assert f"{chosen} (--device auto: " in done.stdout, done.stdout
        converted = "resumed a master split checkpoint as master kahan" in done.stdout
        return (*re.search(r"done: 2 ranks, (\d+) steps .* master (\S+), moments \S+, eval loss (\S+)",
                           done.stdout).groups(), converted)

    ckpt = tmp_path / "ckpt"
    assert torchrun("--steps", "6", "--checkpoint", str(ckpt))[0] == "6"
    steps, master, resumed, converted = torchrun("--steps", "10", "--resume", str(ckpt))
    assert (steps, master, converted) == ("4", "split", False)
    assert torchrun("--steps", "10") == ("10", "split", resumed, False)
    steps, master, lean, converted = torchrun("--steps", "10", "--resume", str(ckpt),
                                              strategy="kahan")
    assert (steps, master, converted) == ("4", "kahan", True)
    assert abs(float(lean) - float(resumed)) < 0.02 * float(resumed), (lean, resumed)
