"""8-bit optimizer state (``state_dtype="8bit"``, ``lowprec.optim.qstate``).

The codes against a brute-force search of their 256 values; the optimizers' 8-bit steps against
the same step on FP32 state that is decoded and re-encoded by hand (the reference of what the
quantized step must do), fused against eager bit for bit, under a loss scaler's skip, through
checkpoints and conversions; and what it costs in fidelity against FP32 moments.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch

from lowprec import memory
from lowprec.optim import SGD, Adagrad, AdamW, Lamb, core, qstate
from tests.test_optim import feed, grad_sequence, make_params, run

# A compiled step that falls back to eager fails these tests (tests/_fallback.py).
pytestmark = [pytest.mark.fused]

B = qstate.BLOCK
SHAPES = [(40, 128), (300,), (64, 96)]  # 8-bit state, FP32 state (small), 8-bit state

def _decoded(opt, p):
    """``p``'s rule buffers (its group the first) as FP32 values, codes decoded."""
    group = opt.param_groups[0]
    return core.math_state(opt.rule(group), group, p, opt.state[p])



def _values(signed: bool) -> torch.Tensor:
    """The values of the 256 codes at scale 1 (index: the code)."""
    return qstate.decode(torch.arange(256, dtype=torch.uint8).view(1, -1), torch.ones(1, 1),
                         signed).view(-1)


@pytest.mark.parametrize("signed", [True, False])
def test_codes_are_the_nearest_on_their_root_scale(signed):
    # The power-law codes: x = s * sign * (k/127)**2 (signed), s * (k/255)**4 (non-negative),
    # s the block's largest magnitude. Each element's code is the nearest on the root scale,
    # against a brute-force search in FP64; the relative error is as the docstring says.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(400, B, generator=g) * torch.exp(2 * torch.randn(400, B, generator=g))
    x = x if signed else x.abs()
    codes, scale = qstate.encode(x, signed)
    assert codes.dtype == torch.uint8 and scale.shape == (400, 1)
    assert torch.equal(scale, x.abs().amax(1, keepdim=True))
    steps, power = (127, 2) if signed else (255, 4)
    root = (x.double().abs() / scale.double()) ** (1 / power) * steps
    k = torch.arange(steps + 1, dtype=torch.float64)
    brute = (root.reshape(-1, 1) - k).abs().argmin(1).view_as(x)
    got = (codes.long() - 128).abs() if signed else codes.long()
    assert torch.equal(got, brute)
    if signed:
        assert torch.equal(codes < 128, (x < 0) & (brute > 0))
    out = qstate.decode(codes, scale, signed)
    assert torch.equal(out, _values(signed)[codes.long()] * scale)
    assert torch.equal(out.abs().amax(1, keepdim=True), scale)  # the largest comes back exactly
    # Relative error: at most (k / (k - 1/2))**power - 1 for code k (the value half a step
    # below it on the root scale), 0.8% near the scale, 14% (signed) or 29% at code 8.
    kk = got[got >= 1].double()
    rel = ((out - x).abs() / x.abs())[got >= 1].double()
    assert (rel <= (kk / (kk - 0.5)) ** power - 1 + 1e-6).all()
    near_top = ((out - x).abs() / x.abs())[x.abs() > scale / 2]
    assert near_top.max() < 0.012


@pytest.mark.parametrize("signed", [True, False])
def test_code_values_survive_encoding_and_range_is_as_documented(signed):
    vals = _values(signed)
    top = 127 if signed else 255
    assert vals.max() == 1.0 and (vals[1:].min() == -1.0 if signed else vals.min() == 0)
    assert vals[vals > 0].min() == pytest.approx((1 / top) ** (2 if signed else 4), rel=1e-6)
    if signed:
        assert vals[0] < -1 and torch.all(vals[1:].diff() > 0)  # (code 0 is never written)
        vals = vals[1:]
    else:
        assert torch.all(vals.diff() > 0)
    x = vals.view(1, -1)
    codes, scale = qstate.encode(x, signed)
    assert torch.equal(qstate.decode(codes, scale, signed), x)


def test_zero_and_non_finite_blocks():
    x = torch.zeros(3, B)
    x[1, 5] = float("inf")
    x[2, 7] = float("nan")
    codes, scale = qstate.encode(x, True)
    out = qstate.decode(codes, scale, True)
    assert torch.equal(out[0], torch.zeros(B))
    assert not out[1].isfinite().all() and not out[2].isfinite().all()


def _same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k, v in a.items():
        assert torch.equal(v, b[k]) if isinstance(v, torch.Tensor) else v == b[k], k


def _optimizers():
    return [
        (AdamW, {"lr": 3e-2, "weight_decay": 0.1}),
        (AdamW, {"lr": 3e-2, "amsgrad": True}),
        (SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
        (Adagrad, {"lr": 0.1, "initial_accumulator_value": 0.1}),
        (Lamb, {"lr": 3e-2, "weight_decay": 0.01}),
    ]


def _names(cls, kw):
    return f"{cls.__name__}{'-amsgrad' if kw.get('amsgrad') else ''}"


@pytest.mark.parametrize(("cls", "kw"), _optimizers(), ids=[_names(*c) for c in _optimizers()])
@pytest.mark.parametrize("master", ["kahan", "split", "stochastic"])
def test_each_step_is_the_fp32_step_of_the_decoded_state_then_encoded(cls, kw, master, device):
    # The reference: the same optimizer with FP32 state that, before every step, is set to the
    # 8-bit state's decoded values, and whose new state is then encoded by hand. The 8-bit
    # optimizer must give its parameters, masters and codes, bit for bit.
    seq = grad_sequence(SHAPES, 5, seed=2)
    params = make_params(torch.bfloat16, SHAPES, device=device)
    ref_params = [p.detach().clone().requires_grad_() for p in params]
    opt = cls(params, master=master, state_dtype="8bit", seed=5, **kw)
    ref = cls(ref_params, master=master, state_dtype=torch.float32, seed=5, **kw)
    names = opt._math_buffers(opt.param_groups[0])
    for grads in seq:
        feed(params, grads)
        feed(ref_params, grads)
        if opt.state:
            for p, q in zip(params, ref_params, strict=True):
                decoded = _decoded(opt, p)
                ref.state[q].update({k: v.clone() for k, v in decoded.items()})
        opt.step()
        ref.step()
        for p, q in zip(params, ref_params, strict=True):
            assert torch.equal(p, q)
            assert torch.equal(opt.master_weight(p), ref.master_weight(q))
            st = opt.state[p]
            for k in names:
                if p.numel() < qstate.MIN_NUMEL:
                    assert st[k].dtype == torch.float32 and f"{k}_scale" not in st
                    assert torch.equal(st[k], ref.state[q][k])
                    continue
                signed = k not in opt._nonnegative_buffers
                codes, scale = qstate.encode(ref.state[q][k].view(-1, B), signed)
                assert torch.equal(st[k].view(-1, B), codes), k
                assert torch.equal(st[f"{k}_scale"], scale.view(-1)), k


@pytest.mark.parametrize(("cls", "kw", "master", "rows"), [
    (AdamW, {"lr": 3e-2, "weight_decay": 0.1}, "kahan", None),
    (SGD, {"lr": 0.1, "momentum": 0.9}, "split", None),
    (Adagrad, {"lr": 0.1}, "stochastic", None),
    (Lamb, {"lr": 3e-2}, "kahan", None),
    (AdamW, {"lr": 3e-2}, "stochastic", 8),
    (Lamb, {"lr": 3e-2}, "kahan", 8),
], ids=["adamw-kahan", "sgd-split", "adagrad-stochastic", "lamb-kahan",
        "adamw-stochastic-pieces", "lamb-kahan-pieces"])
def test_fused_step_equals_eager_bit_for_bit(cls, kw, master, rows, monkeypatch, device):
    # The compiled step of a parameter with 8-bit state goes a piece of rows at a time
    # (compiled._QROWS; 8 in the "pieces" cases, 3 pieces a parameter): each piece's random
    # bits keyed by its place in the parameter, LAMB's norms summed over every piece first.
    from lowprec.optim import compiled

    if rows is not None:
        monkeypatch.setattr(compiled, "_QROWS", {"cpu": rows, "cuda": rows})
    seq = grad_sequence(SHAPES, 4, seed=1)
    start = make_params(torch.bfloat16, SHAPES, device=device)
    out = []
    for fused in (False, True):
        params = [p.detach().clone().requires_grad_() for p in start]
        opt = cls(params, master=master, state_dtype="8bit", fused=fused, seed=3, **kw)
        run(opt, params, seq)
        out.append((params, opt))
    (pe, oe), (pf, of) = out
    for p, q in zip(pe, pf, strict=True):
        assert torch.equal(p, q)
        _same_state(oe.state[p], of.state[q])


def test_a_skipped_step_leaves_codes_and_scales_as_they_were(device):
    # The loss-scaler contract (what LossScaler and GradScaler hand the step): an inf found in
    # one gradient skips the step on the device, every code and scale written back as it was.
    params = make_params(torch.bfloat16, SHAPES, device=device)
    opt = AdamW(params, lr=1e-2, master="kahan", state_dtype="8bit", fused=True)
    run(opt, params, grad_sequence(SHAPES, 2))
    before = copy.deepcopy(opt.state_dict())
    weights = [p.detach().clone() for p in params]
    feed(params, grad_sequence(SHAPES, 1, seed=9)[0])
    params[0].grad[3, 4] = float("inf")
    found = torch.zeros((), device=device)
    opt.step(grad_scale=torch.tensor(256.0, device=device), found_inf=found)
    assert found.item() == 1
    assert all(torch.equal(p, w) for p, w in zip(params, weights, strict=True))
    now = opt.state_dict()["state"]
    for i, st in before["state"].items():
        _same_state(st, now[i])


@pytest.mark.parametrize("fused", [False, True])
def test_checkpoint_keeps_the_codes_and_resumes_bit_for_bit(fused, device):
    seq = grad_sequence(SHAPES, 12, seed=4)
    params = make_params(torch.bfloat16, SHAPES, device=device)
    start = [p.detach().clone() for p in params]
    straight = AdamW(params, lr=1e-2, master="kahan", state_dtype="8bit", fused=fused)
    run(straight, params, seq)

    first = [p.clone().requires_grad_() for p in start]
    opt = AdamW(first, lr=1e-2, master="kahan", state_dtype="8bit", fused=fused)
    run(opt, first, seq[:5])
    buf = io.BytesIO()
    torch.save({"model": [p.detach() for p in first], "opt": opt.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    assert ckpt["opt"]["state"][0]["exp_avg"].dtype == torch.uint8
    assert ckpt["opt"]["state"][0]["exp_avg_scale"].shape == (40 * 128 // B,)
    resumed = [p.clone().requires_grad_() for p in ckpt["model"]]
    again = AdamW(resumed, lr=1.0, state_dtype="8bit", fused=fused)
    again.load_state_dict(ckpt["opt"])
    run(again, resumed, seq[5:])
    for p, q in zip(params, resumed, strict=True):
        assert torch.equal(p, q)
        _same_state(straight.state[p], again.state[q])


def test_moments_convert_between_8bit_and_full_precision_on_load(device):
    # A checkpoint with BF16 moments loads into an 8-bit optimizer (encoded), an 8-bit one into
    # an optimizer given state_dtype=torch.float32 (decoded): the values the codes hold.
    params = make_params(torch.bfloat16, SHAPES, device=device)
    bf16 = AdamW(params, lr=1e-2, master="kahan")
    run(bf16, params, grad_sequence(SHAPES, 3))
    eight = AdamW(params, lr=1e-2, master="kahan", state_dtype="8bit")
    eight.load_state_dict(copy.deepcopy(bf16.state_dict()))
    p = params[0]
    codes, scale = qstate.encode(bf16.state[p]["exp_avg"].float().view(-1, B), True)
    assert torch.equal(eight.state[p]["exp_avg"].view(-1, B), codes)
    assert torch.equal(eight.state[p]["exp_avg_scale"], scale.view(-1))
    assert eight.state[params[1]]["exp_avg"].dtype == torch.float32  # (too small: FP32)
    full = AdamW(params, lr=1e-2, master="kahan", state_dtype=torch.float32)
    full.load_state_dict(copy.deepcopy(eight.state_dict()))
    decoded = _decoded(eight, p)
    assert torch.equal(full.state[p]["exp_avg_sq"], decoded["exp_avg_sq"])
    assert "exp_avg_sq_scale" not in full.state[p]


def test_a_torch_optim_checkpoint_loads_into_8bit_state():
    # torch.optim.AdamW's FP32 moments adopted by an 8-bit AdamW: encoded, as an 8-bit step
    # would keep them (they were cast to uint8 before, which truncated them to zero).
    params = make_params(torch.float32, SHAPES)
    ref = torch.optim.AdamW(params, lr=1e-2)
    run(ref, params, grad_sequence(SHAPES, 3))
    eight = AdamW(params, lr=1e-2, state_dtype="8bit")
    eight.load_state_dict(copy.deepcopy(ref.state_dict()))
    for p in (params[0], params[2]):
        for name, signed in (("exp_avg", True), ("exp_avg_sq", False)):
            codes, scale = qstate.to_codes(ref.state[p][name], signed)
            assert torch.equal(eight.state[p][name], codes), name
            assert torch.equal(eight.state[p][qstate.scale_key(name)], scale), name
    assert torch.equal(eight.state[params[1]]["exp_avg"], ref.state[params[1]]["exp_avg"])


def test_bad_8bit_state_is_refused_before_anything_changes():
    params = make_params(torch.bfloat16, SHAPES)
    opt = AdamW(params, lr=1e-2, state_dtype="8bit")
    run(opt, params, grad_sequence(SHAPES, 1))
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][0]["exp_avg_scale"] = sd["state"][0]["exp_avg_scale"][:-1]
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=r"'exp_avg_scale' should be a \(20,\) torch.float32"):
        opt.load_state_dict(sd)
    _same_state(before["state"][0], opt.state_dict()["state"][0])
    with pytest.raises(ValueError, match="state_dtype must be None, '8bit', '4bit' or one of"):
        AdamW(params, lr=1e-2, state_dtype="int8")


def test_memory_of_8bit_state_measured_from_the_tensors():
    # 2 + 2 + 2 x (1 + 4/256) + 2 bytes per element for the large parameters; the small one's
    # moments are FP32: expected (from the parameters' sizes) and measured agree.
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 256))
    rows = {r["recipe"]: r for r in memory.table("adamw", model=model, keep_fp32=())}
    row = rows["bf16-kahan-8bit"]
    numel = sum(p.numel() for p in model.parameters())
    small = 512 + 256
    state = (2 * (1 + 4 / B) * (numel - small) + 8 * small) / numel
    assert row["expected"]["optimizer_state"] == pytest.approx(state)
    assert row["measured"]["optimizer_state"] == pytest.approx(state)
    assert row["measured"]["total"] == pytest.approx(6 + state, abs=1e-3)
    assert rows["bf16-split-8bit"]["expected"]["master"] == 2


def test_8bit_adamw_trains_as_well_as_fp32_moments():
    # A noisy regression where the moments matter (features on scales 1e-3 .. 1e1, so the
    # gradients of one block span 8 orders of magnitude in the second moment): 8-bit moments
    # with a split master end within 2% of the loss FP32 AdamW reaches.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 256, generator=g) * torch.logspace(-3, 1, 256)
    w_true = torch.randn(256, 16, generator=g)
    y = x @ w_true / 16 + 0.1 * torch.randn(512, 16, generator=g)
    losses = {}
    for name, kw in {"fp32": {}, "8bit": {"state_dtype": "8bit", "master": "split"}}.items():
        w = torch.zeros(256, 16, dtype=torch.bfloat16 if kw else torch.float32,
                        requires_grad=True)
        opt = AdamW([w], lr=3e-2, **kw)
        for _ in range(300):
            loss = ((x.to(w.dtype) @ w).float() - y).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        losses[name] = ((x @ opt.master_weight(w) - y).pow(2).mean()).item()
    assert losses["8bit"] < 1.02 * losses["fp32"], losses


def test_update_monitor_reports_what_8bit_state_costs():
    # state_relative_error: the stored moments against the FP32 moments the rule computed from
    # them, per monitored step: for 8-bit codes a norm-wise error of a few tenths of a percent
    # to a few percent (0.8% at a block's largest value, more below it); None where the state
    # is not 8-bit.
    from lowprec.diagnostics import UpdateMonitor

    model = torch.nn.Sequential(torch.nn.Linear(128, 64), torch.nn.Linear(64, 8)).bfloat16()
    opt = AdamW(model.parameters(), lr=1e-3, master="kahan", state_dtype="8bit")
    monitor = UpdateMonitor(model, opt)
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        x = torch.randn(32, 128, generator=g).bfloat16()
        model(x).float().pow(2).mean().backward()
        with monitor.step():
            opt.step()
        opt.zero_grad()
    by = {r.name: r for r in monitor.report().params}
    err = by["0.weight"].state_relative_error
    assert 1e-3 < err < 0.1, err
    assert by["0.bias"].state_relative_error is None  # (64 elements: FP32 state)


def test_which_dtensor_parameters_get_8bit_state(tmp_path):
    # FSDP2's DTensor parameters: 8-bit state where every shard is whole rows of whole blocks
    # (sharded along the first dimension, rows a multiple of 256), FP32 state otherwise, even
    # where a plain parameter of that size gets 8-bit state (with a warning naming them); the
    # scales a DTensor placed as the parameter, a row per row, which a plain optimizer loads
    # as its flat scales; a shard that is not contiguous refused by the step (a one-rank gloo
    # group in a subprocess, to leave this process's default group alone;
    # tests/test_dtensor.py steps sharded 8-bit state on 2 and 3 ranks).
    import subprocess
    import sys

    code = f"""
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, distribute_tensor, Shard
import lowprec
dist.init_process_group("gloo", init_method="file://{tmp_path}/store", rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
shapes = {{"rows": ((64, 256), 0), "dim1": ((64, 256), 1), "short": ((64, 128), 0)}}
ps = {{n: torch.nn.Parameter(distribute_tensor(torch.randn(s).bfloat16(), mesh, [Shard(d)]))
      for n, (s, d) in shapes.items()}}
ps["plain"] = torch.nn.Parameter(torch.randn(64, 128).bfloat16())
import warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    opt = lowprec.AdamW(list(ps.values()), lr=1e-3, state_dtype="8bit")
print("warned:", [str(w.message) for w in caught])
for p in ps.values():
    p.grad = torch.randn(p.shape).bfloat16() if not isinstance(p, DTensor) else distribute_tensor(
        torch.randn(p.shape).bfloat16(), mesh, p.placements)
opt.step()
for n, p in ps.items():
    st = opt.state[p]
    sc = st.get("exp_avg_scale")
    where = tuple(sc.placements) if isinstance(sc, DTensor) else None
    print(n, st["exp_avg"].dtype, None if sc is None else tuple(sc.shape), where)
# The sharded 8-bit state as full tensors (a row of scales per row) into a plain optimizer
# (flat scales): the same moments.
full = {{k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in opt.state[ps["rows"]].items()}}
q = torch.nn.Parameter(ps["rows"].full_tensor())
plain = lowprec.AdamW([q], lr=1e-3, state_dtype="8bit")
sd = plain.state_dict()
sd["state"] = {{0: full}}
plain.load_state_dict(sd)
got = plain.state[q]
print("plain load:", tuple(got["exp_avg_scale"].shape),
      torch.equal(got["exp_avg"], full["exp_avg"]),
      torch.equal(got["exp_avg_scale"], full["exp_avg_scale"].view(-1)))
# lowprec.memory.measure counts the shards: 8 bytes per element and the scales.
m = torch.nn.Module()
m.w = torch.nn.Parameter(distribute_tensor(torch.randn(64, 256).bfloat16(), mesh, [Shard(0)]))
o = lowprec.AdamW(m.parameters(), lr=1e-3, master="kahan", state_dtype="8bit")
m.w.grad = distribute_tensor(torch.randn(64, 256).bfloat16(), mesh, [Shard(0)])
o.step()
print("memory:", round(lowprec.memory.measure(m, o).bytes_per_param["total"], 4))
# A rank's shard that is not contiguous: refused by the step, nothing written.
t = DTensor.from_local(torch.randn(256, 64).bfloat16().t(), mesh, [Shard(0)], run_check=False)
r = torch.nn.Parameter(t)
bad = lowprec.AdamW([r], lr=1e-3, state_dtype="8bit")
r.grad = DTensor.from_local(torch.ones(64, 256).bfloat16(), mesh, [Shard(0)], run_check=False)
before = r.full_tensor().clone()
try:
    bad.step()
except NotImplementedError as e:
    print("refused:", e, torch.equal(r.full_tensor(), before), not bad.state[r])
dist.destroy_process_group()
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    lines = set(proc.stdout.splitlines())
    assert "rows torch.uint8 (64, 1) (Shard(dim=0),)" in lines, (proc.stdout, proc.stderr)
    assert "dim1 torch.float32 None None" in lines, (proc.stdout, proc.stderr)
    assert "short torch.float32 None None" in lines, (proc.stdout, proc.stderr)
    assert "plain torch.uint8 (32,) None" in lines, (proc.stdout, proc.stderr)
    assert "plain load: (64,) True True" in lines, (proc.stdout, proc.stderr)
    # (weights, grads, compensation 2 each; codes 2 + scales 2 * 4 / 256; the step count 4 / 16384)
    assert "memory: 8.0315" in lines, (proc.stdout, proc.stderr)
    warned = [ln for ln in lines if ln.startswith("warned:")]
    assert len(warned) == 1 and "keeps FP32 state for 2 DTensor parameter(s)" in warned[0], warned
    assert "(64, 256), (64, 128)" in warned[0], warned
    refused = [ln for ln in lines if ln.startswith("refused:")]
    assert len(refused) == 1 and "is not contiguous" in refused[0], (proc.stdout, proc.stderr)
    assert refused[0].endswith("True True"), refused  # (the parameter and state unchanged)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize(("value", "signed"), [(0.0, True), (0.0, False), (-1.5, True),
                                                (2.5, False)])
def test_new_state_equals_encoding_the_whole_filled_buffer(value, signed, bits):
    """``new_state`` encodes one block and repeats it (every block of a filled buffer is the
    same): the codes and scales of encoding the whole buffer, in their shapes."""
    for shape in [(4096,), (16, 512), (3, 1024)]:
        p = torch.empty(shape)
        codes, scale = qstate.new_state(value, p, signed, bits)
        ref_codes, ref_scale = qstate.to_codes(torch.full(shape, value), signed, bits)
        assert codes.shape == ref_codes.shape and torch.equal(codes, ref_codes)
        assert torch.equal(scale, ref_scale.view(qstate.scale_shape(p)))
        assert codes.is_contiguous() and scale.is_contiguous()
