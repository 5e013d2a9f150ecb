"""The 1-bit benchmark's per-rank entry point (benchmarks/onebit_allreduce.py) and the link
emulation harness's command line (benchmarks/linksim.sh)."""

import importlib.util
import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPT = BENCH / "onebit_allreduce.py"
LINKSIM = BENCH / "linksim.sh"


def _bench_module(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # the script imports its helpers, _onebit_rows
    spec = importlib.util.spec_from_file_location("onebit_allreduce", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.multiprocess
def test_two_ranks_started_separately_fill_every_row(tmp_path):
    """Rank 0 from the command-line options, rank 1 from torchrun's variables: both join, and rank
    0's JSON has every row (the fused one left out: it compiles), the link check and the bytes."""
    out = tmp_path / "result.json"
    port = _free_port()
    common = ["--values-millions", "0.2", "--ddp-millions", "0.2", "--iters", "2", "--warmup",
              "1", "--link-mb", "1", "--link-reps", "2", "--no-fused", "--timeout", "60"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    rank0 = subprocess.Popen(
        [sys.executable, str(SCRIPT), "--rank", "0", "--world-size", "2", "--master-addr",
         "127.0.0.1", "--master-port", str(port), "--json", str(out), *common],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    rank1 = subprocess.Popen(
        [sys.executable, str(SCRIPT), *common],
        env={**env, "RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": str(port)},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        log0, _ = rank0.communicate(timeout=150)
        log1, _ = rank1.communicate(timeout=30)
    finally:
        for p in (rank0, rank1):
            if p.poll() is None:
                p.kill()
    assert rank0.returncode == 0, log0
    assert rank1.returncode == 0, log1
    assert "link check" in log0 and "ddp step, 1-bit hook" in log0
    assert "link check" not in log1  # only rank 0 reports

    result = json.loads(out.read_text())
    assert result["options"]["mode"] == "per-rank" and result["world"] == 2
    rows = {"fp32 all_reduce (1 call)", "fp32 all_reduce (buckets)", "bf16_compress_hook",
            "1-bit collectives", "1-bit hook, eager", "memory floor",
            "ddp step, fp32 all-reduce", "ddp step, 1-bit hook"}
    assert set(result["samples_s"]) == rows
    for row, samples in result["samples_s"].items():
        assert len(samples) == 2 and all(t > 0 for t in samples), row
    assert result["link_check"]["gbit_s"] > 0 and len(result["link_check"]["samples_s"]) == 2
    # Rank 0's main-thread CPU time per timed iteration, for the hook and the floor it is set against.
    assert set(result["cpu_s"]) == {"1-bit hook, eager", "memory floor"}
    assert all(len(v) == 2 and all(t > 0 for t in v) for v in result["cpu_s"].values())
    assert "x the floor" in log0
    b = result["bytes_per_iteration"]
    assert b["fp32_ring"] / b["onebit_sent"] >= 25  # 1024-value columns: about 30x
    assert sum(m["bytes_per_step"] for m in result["messages"]) == b["onebit_sent"]
    assert result["compiled"] == {"1-bit hook, eager": False}
    ddp = result["ddp"]
    assert ddp["compiled"] is False and ddp["messages"]
    # 192-value columns (width 192) carry relatively more column stats: about 24x.
    assert ddp["bytes_per_step"]["fp32_ring"] / ddp["bytes_per_step"]["onebit_sent"] >= 15


def test_per_rank_options_and_their_errors(monkeypatch, capsys):
    ob = _bench_module(monkeypatch)
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    args = ob.parse_args(["--quick"])
    assert args.mode == "loopback" and args.world == 2 and args.master_addr == "127.0.0.1"
    args = ob.parse_args(["--rank", "1", "--world-size", "4", "--master-addr", "10.0.0.1",
                          "--master-port", "1234", "--ifname", "eth0"])
    assert (args.mode, args.rank, args.world, args.master_port, args.ifname) == (
        "per-rank", 1, 4, 1234, "eth0")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    monkeypatch.setenv("MASTER_PORT", "29400")
    args = ob.parse_args([])
    assert (args.mode, args.rank, args.world, args.master_port, args.ifname) == (
        "per-rank", 0, 2, 29400, "lo")
    assert ob.parse_args(["--master-port", "1"]).master_port == 1  # the option wins
    assert ob.parse_args(["--ddp-millions", "25"]).ddp_width == 2048
    monkeypatch.delenv("MASTER_ADDR")
    with pytest.raises(SystemExit):
        ob.parse_args([])
    assert "needs --master-addr (or MASTER_ADDR)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ob.parse_args(["--rank", "2", "--master-addr", "h"])
    assert "--rank 2 is not in 0..1" in capsys.readouterr().err


def _linksim(*args, user=None):
    cmd = ["bash", str(LINKSIM), *args]
    if user is not None:
        cmd = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30)


def test_linksim_help_and_argument_errors():
    r = _linksim("--help")
    assert r.returncode == 0 and "Usage: benchmarks/linksim.sh" in r.stdout
    assert "--rate" in r.stdout and "--cleanup" in r.stdout
    r = _linksim("--rate", "fast")
    assert r.returncode == 2 and "is not a tc rate" in r.stderr
    r = _linksim("--ranks", "1")
    assert r.returncode == 2 and "--ranks must be 2..250" in r.stderr
    r = _linksim("--", "--rank", "0")
    assert r.returncode == 2 and "--rank is set by the harness" in r.stderr


def test_linksim_refuses_to_run_without_root():
    """As a user other than root (root drops to nobody for this), it stops before touching the
    network, with a message that says why."""
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("running as root and no setpriv to drop to another user")
        r = _linksim("--rate", "1gbit", user=65534)
        if "Permission denied" in r.stderr:
            pytest.skip(f"user 65534 cannot read {LINKSIM}")
    else:
        r = _linksim("--rate", "1gbit")
    assert r.returncode == 2, r.stderr
    assert "needs root (EUID 0" in r.stderr
