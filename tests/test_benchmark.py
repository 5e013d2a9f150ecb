"""The optimizer-step benchmark's paired ratios (benchmarks/optimizer_step.py)."""

import importlib.util
import pathlib
import statistics
import sys

import torch

_PATH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "optimizer_step.py"
_spec = importlib.util.spec_from_file_location("optimizer_step", _PATH)
ob = importlib.util.module_from_spec(_spec)
sys.modules["optimizer_step"] = ob  # (dataclasses resolve their module)
_spec.loader.exec_module(ob)


def _result(name, source, times, ref_times, axpy_times, paired_ref):
    lp = source == "lowprec"
    row = ob.Row(name, "adamw", source, torch.bfloat16 if lp else torch.float32, None,
                 master="kahan" if lp else "none")
    r = ob.Result(row, paired_ref=paired_ref)
    r.windows.append(ob.Window(list(times), [0.0] * len(times), ref_times=list(ref_times),
                               axpy_times=list(axpy_times)))
    return r


def test_paired_ratios_follow_the_reference_step_by_step():
    """A machine twice as fast in the second half: the paired ratio sees the constant 0.5x that
    the plain medians, taken while the speed changed, do not."""
    ref = _result("torch-adamw-fp32-fused", "torch", [2, 2, 1, 1], [], [4, 4, 2, 2],
                  "torch-adamw-fp32-fused")
    fast = _result("lowprec-adamw-bf16-kahan-fused", "lowprec", [1, 1, 0.5, 0.5],
                   [2, 2, 1, 1], [4, 4, 2, 2], "torch-adamw-fp32-fused")
    peer = _result("optimi-adamw-bf16-kahan-loop", "optimi", [6, 6, 3, 3], [2, 2, 1, 1],
                   [4, 4, 2, 2], "torch-adamw-fp32-fused")
    assert ob._paired_x_ref(ref) == 1.0
    assert ob._paired_x_ref(fast) == 0.5
    assert statistics.median(fast.axpy_ratios) == 0.25
    recs, _ = ob.comparisons([ref, fast, peer])
    (rec,) = [r for r in recs if r["row"] == fast.row.name]
    assert rec["ratio_paired"] == 0.5 / 3.0


def test_paired_comparison_needs_the_same_reference():
    a = _result("lowprec-adamw-bf16-kahan-fused", "lowprec", [1, 1], [2, 2], [1, 1], "x")
    b = _result("optimi-adamw-bf16-kahan-loop", "optimi", [3, 3], [2, 2], [1, 1], "y")
    recs, _ = ob.comparisons([a, b])
    assert recs and all(r["ratio_paired"] is None for r in recs)
    assert recs[0]["ratio"] == 1 / 3


def test_ab_ratios_time_the_two_rows_in_turn(monkeypatch):
    """Two fake optimizers on a fake clock, one taking 3 units a step and the other 1: every turn
    gives 3, whichever goes first, and the order alternates."""
    clock = [0.0]
    order = []

    class Fake:
        def __init__(self, name, cost):
            self.name, self.cost = name, cost

        def step(self):
            clock[0] += self.cost
            order.append(self.name)

    monkeypatch.setattr(ob.time, "perf_counter", lambda: clock[0])
    num = ob.Row("lowprec-x", "adamw", "lowprec", torch.bfloat16, lambda ps: Fake("a", 3.0))
    den = ob.Row("optimi-x", "adamw", "optimi", torch.bfloat16, lambda ps: Fake("b", 1.0))
    base = ob.BaseTensors.make([("w", (4, 4))])
    args = ob.parse_args(["--ab-steps", "4", "--warmup", "1"])
    assert ob.ab_ratios(num, den, base, args, None) == [3.0] * 4
    assert order[-8:] == ["a", "b", "b", "a", "a", "b", "b", "a"]
    # A row that fails gives no ratios (its own passes report the error).
    broken = ob.Row("lowprec-y", "adamw", "lowprec", torch.bfloat16, lambda ps: 1 / 0)
    assert ob.ab_ratios(broken, den, base, args, None) == []
    # And comparisons() carries the A/B median beside the others.
    a = _result("lowprec-adamw-bf16-kahan-fused", "lowprec", [1, 1], [2, 2], [1, 1], "x")
    b = _result("optimi-adamw-bf16-kahan-loop", "optimi", [3, 3], [2, 2], [1, 1], "x")
    recs, lines = ob.comparisons([a, b], {(a.row.name, b.row.name): [0.25, 0.5, 0.75]})
    assert recs[0]["ratio_ab"] == 0.5 and recs[0]["ab_steps"] == 3
    assert "A/B  0.50x" in lines[0]


def test_passes_of_unknown_background_are_kept():
    """A pass too short for /proc/stat has an unknown bg: it counts, as an uncontended one does;
    only a pass known to be contended is set aside (when another is not)."""
    def window(times, busy):
        return ob.Window(list(times), [0.0] * len(times), wall=1.0, cpu=0.0, busy=busy)

    short = [window([1.0, 1.0], None), window([1.0, 1.0], None)]
    quiet = window([3.0, 3.0], 0.1)
    busy = window([9.0, 9.0], 1.5)
    assert ob._clean([*short, quiet, busy], 0.3) == [*short, quiet]
    assert ob._clean([busy], 0.3) == [busy]
    r = ob.Result(ob.Row("x", "adamw", "torch", torch.float32, None), bg_max=0.3)
    r.windows.extend([*short, quiet])
    assert r.median == 1.0 and len(r.times) == 6


def test_the_state_format_benchmark_runs_and_its_maps_are_what_it_says(capsys):
    """benchmarks/state_formats.py: its table maps hold 256 codes' values in [-1, 1] (the
    dynamic map's decimal levels reach below 1e-6), and a short run prints a row per format
    (on a model of width 32: the built-in one's BF16 matmuls took 80 s where torch has no fast
    BF16 kernel, and the run's wiring is the subject here)."""
    path = _PATH.parent / "state_formats.py"
    spec = importlib.util.spec_from_file_location("state_formats", path)
    sf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sf)
    for signed in (True, False):
        dyn = sf._dynamic_values(signed)
        assert dyn.numel() == 256 and dyn.max() == 1 and dyn[dyn > 0].min() < 1e-6
        assert (-1 <= dyn.min() < -0.99) if signed else (dyn.min() == 0)
        assert sf._float8_values(signed).max() == 1
    sf.main(["--steps", "3", "--formats", "power,linear", "--threads", "1", "--d-model", "32",
             "--n-layer", "1"])
    out = capsys.readouterr().out
    for row in ("fp32 (reference)", "8-bit moments: power", "8-bit moments: linear"):
        assert row in out, out


def test_the_device_option_refuses_cuda_without_a_gpu(capsys):
    # (on a GPU machine the same call lists the rows it would time there)
    try:
        rc = ob.main(["--device", "cuda", "--list", "--threads", str(torch.get_num_threads())])
    finally:
        ob.DEVICE = torch.device("cpu")
    out = capsys.readouterr()
    if torch.cuda.is_available():
        assert rc == 0 and "lowprec-adamw-bf16-kahan-state8bit-default" in out.out
    else:
        assert rc == 2 and "sees no CUDA device" in out.err


def test_the_isa_option_sets_inductors_vector_width_and_the_header_says_so(capsys):
    import torch._inductor.config as inductor_config

    from lowprec.optim import vector_casts

    old, target = inductor_config.cpp.simdlen, vector_casts._TARGET
    try:
        assert ob.main(["--isa", "avx2", "--no-vector-casts", "--list",
                        "--threads", str(torch.get_num_threads())]) == 0
        assert inductor_config.cpp.simdlen == 256 and vector_casts._TARGET is None
        isa = ob._inductor_isa()
    finally:
        inductor_config.cpp.simdlen, vector_casts._TARGET = old, target
    capsys.readouterr()
    # (a machine without AVX2 has no such ISA: Inductor then picks none)
    assert isa.startswith("avx2 (256-bit)") or "avx2" not in ob._cpu_features()
