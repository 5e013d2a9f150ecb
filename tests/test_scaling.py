"""LossScaler: GradScaler's scale sequence, exact control runs, skips, checkpoints, misuse.

Tests that take ``device`` put the model, its batches and the scalers there (the CPU, and CUDA
where present: the ``device`` fixture); batches are drawn on the CPU and moved, and every
comparison is between two runs on the same device.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn

import lowprec
from lowprec import LossScaler, NonFiniteLossError
from lowprec.optim import SGD, AdamW, core
from tests._host import no_host_reads

pytestmark = pytest.mark.floor  # (also run under the oldest torch claimed: .ci/run)

BAD = "inf"


def _model(dtype=torch.float32, seed=0, device="cpu"):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3)).to(dtype).to(device)


def _batch(i, dtype=torch.float32, device="cpu"):
    gen = torch.Generator().manual_seed(100 + i)
    x, y = torch.randn(8, 6, generator=gen).to(dtype), torch.randn(8, 3, generator=gen)
    return x.to(device), y.to(device)


def _loss(model, i, dtype=torch.float32, poison=None):
    x, y = _batch(i, dtype, next(model.parameters()).device)  # (on the model's device)
    loss = (model(x).float() - y).pow(2).mean()
    if poison == "inf":
        loss = loss * float("inf")
    elif poison == "nan":
        loss = loss * float("nan")
    return loss


def _snapshot(model, opt):
    out = [p.detach().clone() for p in model.parameters()]
    for st in opt.state.values():
        out += [v.clone() for _, v in sorted(st.items()) if isinstance(v, torch.Tensor)]
    return out


def _equal(a, b):
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in
                                    zip(a, b, strict=True))


# ------------------------------------------------------------------ the scale sequence

PATTERNS = {
    "isolated": {3, 9, 10, 17},
    "burst": {2, 3, 4, 5, 6},
    "clean": set(),
    "alternating": set(range(0, 24, 2)),
    "below one": set(range(1, 15)),  # 2**10 backs off to 2**-4: no floor at 1
}


@pytest.mark.parametrize("growth_interval", [1, 3, 5])
@pytest.mark.parametrize("pattern", sorted(PATTERNS))
@pytest.mark.parametrize("make_opt", ["lowprec", "torch"])
def test_scale_sequence_equals_grad_scaler(pattern, growth_interval, make_opt, device):
    bad = PATTERNS[pattern]
    seqs, stepped = [], []
    for cls in (torch.amp.GradScaler, LossScaler):
        model = _model(device=device)
        opt = (AdamW(model.parameters(), lr=1e-2, master="none") if make_opt == "lowprec"
               else torch.optim.SGD(model.parameters(), lr=0.1))
        # (the defaults of both: neither has a floor)
        kw = {"device": device} if cls is torch.amp.GradScaler else {}
        scaler = cls(init_scale=2.0**10, growth_interval=growth_interval, **kw)
        seq, took = [], []
        for i in range(24):
            opt.zero_grad()
            scaler.scale(_loss(model, i, poison="nan" if i % 5 == 0 else "inf")
                         if i in bad else _loss(model, i)).backward()
            r = scaler.step(opt)
            took.append(bool(r) if cls is LossScaler else None)
            scaler.update()
            seq.append(scaler.get_scale())
        seqs.append(seq)
        stepped.append(took)
    assert seqs[0] == seqs[1]
    assert stepped[1] == [i not in bad for i in range(24)]


# ------------------------------------------------------------------ control runs


def _train(*, scaled, master="kahan", dtype=torch.bfloat16, clip=False, accumulate=1,
           two_opts=False, steps=10, bad=(), device="cpu"):
    model = _model(dtype, device=device)
    params = list(model.parameters())
    if two_opts:
        opts = [AdamW(params[:2], lr=1e-2, master=master), SGD(params[2:], lr=0.1,
                                                               momentum=0.9, master=master)]
    else:
        opts = [AdamW(params, lr=1e-2, master=master)]
    scaler = LossScaler(init_scale=2.0**12, growth_interval=4) if scaled else None
    for i in range(steps):
        for o in opts:
            o.zero_grad()
        for k in range(accumulate):
            loss = _loss(model, i * accumulate + k, dtype, poison=BAD if i in bad else None)
            (scaler.scale(loss) if scaled else loss).backward()
        if clip:
            for o in opts:
                if scaled:
                    scaler.unscale_(o)
            torch.nn.utils.clip_grad_norm_(params, 0.05)
        for o in opts:
            if scaled:
                scaler.step(o)
            else:
                o.step()
        if scaled:
            scaler.update()
    return model, opts, scaler


@pytest.mark.parametrize(
    "options",
    [
        dict(),
        dict(clip=True),
        dict(accumulate=3),
        dict(two_opts=True),
        dict(two_opts=True, clip=True),
        dict(master="split"),
        dict(master="stochastic"),
        dict(master="fp32", dtype=torch.float16),
        dict(master="none", dtype=torch.float32, clip=True, accumulate=2),
    ],
    ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()) or "plain",
)
def test_scaled_run_equals_unscaled_run_bitwise(options, device):
    ref, ref_opts, _ = _train(scaled=False, device=device, **options)
    got, got_opts, scaler = _train(scaled=True, device=device, **options)
    # the scale grew along the way (powers of two: exact), so this is a real test of unscaling
    assert scaler.get_scale() > 2.0**12
    for a, b in zip(ref.parameters(), got.parameters(), strict=True):
        assert torch.equal(a, b)
    for oa, ob in zip(ref_opts, got_opts, strict=True):
        for pa, pb in zip(oa.state.values(), ob.state.values(), strict=True):
            for k in pa:
                if isinstance(pa[k], torch.Tensor):
                    assert torch.equal(pa[k], pb[k]), k


def test_skipped_step_is_bit_identical_and_not_counted(device):
    model = _model(torch.bfloat16, device=device)
    opt = AdamW(model.parameters(), lr=1e-2, master="split")
    scaler = LossScaler(init_scale=2.0**8)
    for i in range(3):
        opt.zero_grad()
        scaler.scale(_loss(model, i, torch.bfloat16)).backward()
        assert bool(scaler.step(opt))
        scaler.update()
    before = _snapshot(model, opt)
    opt.zero_grad()
    scaler.scale(_loss(model, 3, torch.bfloat16, poison="nan")).backward()
    assert not bool(scaler.step(opt))
    scaler.update()
    assert _equal(_snapshot(model, opt), before)
    assert scaler.get_scale() == 2.0**7
    assert all(float(st["step"]) == 3 for st in opt.state.values())


def test_skip_with_other_optimizers_too(device):
    for make in (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
                 lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True)):
        model = _model(device=device)
        opt = make(model.parameters())
        scaler = LossScaler()
        scaler.scale(_loss(model, 0)).backward()
        scaler.step(opt)
        scaler.update()
        before = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
        scaler.scale(_loss(model, 1, poison="inf")).backward()
        assert not bool(scaler.step(opt))
        scaler.update()
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_fp16_gradients_with_a_torch_optimizer_are_unscaled(device):
    # GradScaler raises "Attempting to unscale FP16 gradients"; LossScaler unscales them.
    model = _model(torch.float16, device=device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="FP16"):
        gs = torch.amp.GradScaler(device)
        gs.scale(_loss(model, 0, torch.float16)).backward()
        gs.step(opt)
    opt.zero_grad()
    scaler = LossScaler(init_scale=2.0**8)
    scaler.scale(_loss(model, 0, torch.float16)).backward()
    assert bool(scaler.step(opt))
    scaler.update()


def test_state_dict_round_trip_resumes_exactly(device):
    def run(steps, resume_from=None):
        model = _model(torch.bfloat16, device=device)
        opt = AdamW(model.parameters(), lr=1e-2, master="kahan")
        scaler = LossScaler(init_scale=2.0**8, growth_interval=2, hysteresis=2)
        start = 0
        if resume_from is not None:
            ck = resume_from
            model.load_state_dict(ck["model"])
            opt.load_state_dict(ck["opt"])
            scaler.load_state_dict(ck["scaler"])
            start = ck["i"]
        for i in range(start, steps):
            opt.zero_grad()
            scaler.scale(_loss(model, i, torch.bfloat16, poison="inf" if i in (2, 5, 6) else None)
                         ).backward()
            scaler.step(opt)
            scaler.update()
            if i == 4 and resume_from is None:
                ck = {"model": {k: v.clone() for k, v in model.state_dict().items()},
                      "opt": copy.deepcopy(opt.state_dict()), "scaler": scaler.state_dict(), "i": 5}
        return model, opt, scaler, (ck if resume_from is None else None)

    full_m, full_o, full_s, ck = run(10)
    res_m, res_o, res_s, _ = run(10, resume_from=ck)
    assert _equal(_snapshot(res_m, res_o), _snapshot(full_m, full_o))
    assert res_s.state_dict() == full_s.state_dict()


def test_loads_a_grad_scaler_state_dict(device):
    gs = torch.amp.GradScaler(device, init_scale=123.0, growth_interval=7)
    model = _model(device=device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gs.scale(_loss(model, 0)).backward()
    gs.step(opt)
    gs.update()
    scaler = LossScaler()
    scaler.load_state_dict(gs.state_dict())
    assert scaler.get_scale() == 123.0 and scaler.get_growth_interval() == 7
    assert scaler.state_dict()["_growth_tracker"] == 1


# ------------------------------------------------------------------ limits


def test_never_grows_past_max_scale_or_to_inf(device):
    model = _model(device=device)
    opt = SGD(model.parameters(), lr=1e-3, master="none")
    scaler = LossScaler(init_scale=2.0**120, growth_interval=1, max_scale=2.0**125)
    for i in range(10):
        opt.zero_grad()
        # a loss tiny enough that even a huge scale stays finite
        scaler.scale(_loss(model, i) * 2.0**-120).backward()
        scaler.step(opt)
        scaler.update()
    assert scaler.get_scale() == 2.0**125
    unlimited = LossScaler(init_scale=2.0**126, growth_interval=1)
    for i in range(4):
        opt.zero_grad()
        unlimited.scale(_loss(model, i) * 0.0).backward()
        unlimited.step(opt)
        unlimited.update()
    assert unlimited.get_scale() == 2.0**127  # 2**128 would be inf: kept


def test_min_scale_and_hysteresis(device):
    model = _model(device=device)
    opt = SGD(model.parameters(), lr=1e-3, master="none")
    scaler = LossScaler(init_scale=8.0, min_scale=2.0, hysteresis=2, growth_interval=100)
    seq = []
    for i in range(8):
        opt.zero_grad()
        poison = "inf" if i in (0, 2, 3, 4, 5, 6) else None
        scaler.scale(_loss(model, i, poison=poison)).backward()
        scaler.step(opt)
        scaler.update()
        seq.append(scaler.get_scale())
    # 0: first overflow (run 1) keeps; 1 clean; 2: run 1 keeps; 3: run 2 backs off; 4..6 back off,
    # floored at min_scale
    assert seq == [8.0, 8.0, 8.0, 4.0, 2.0, 2.0, 2.0, 2.0]


def test_a_forward_that_always_overflows_raises_a_clear_error(device):
    model = _model(device=device)
    opt = SGD(model.parameters(), lr=1e-3, master="none")
    scaler = LossScaler(max_consecutive_skips=5)
    with pytest.raises(NonFiniteLossError, match="forward pass or the loss is itself"):
        for i in range(20):
            opt.zero_grad()
            scaler.scale(_loss(model, i, poison="nan")).backward()
            scaler.step(opt)
            scaler.update()
    assert i == 4


def test_static_scaling_keeps_the_scale_and_still_skips(device):
    model = _model(device=device)
    opt = SGD(model.parameters(), lr=1e-3, master="none")
    scaler = LossScaler(init_scale=64.0, dynamic=False)
    took = []
    for i in range(4):
        opt.zero_grad()
        scaler.scale(_loss(model, i, poison="inf" if i == 1 else None)).backward()
        took.append(bool(scaler.step(opt)))
        scaler.update()
    assert took == [True, False, True, True] and scaler.get_scale() == 64.0


# ------------------------------------------------------------------ misuse and API


def _ready(device="cpu"):
    model = _model(device=device)
    opt = AdamW(model.parameters(), master="none")
    scaler = LossScaler()
    scaler.scale(_loss(model, 0)).backward()
    return model, opt, scaler


def test_misuse_raises_clear_errors(device):
    _, opt, scaler = _ready(device)
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="already called on this optimizer"):
        scaler.unscale_(opt)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match="step\\(\\) was already called"):
        scaler.step(opt)
    with pytest.raises(RuntimeError, match="after step"):
        scaler.unscale_(opt)
    scaler.update()
    with pytest.raises(RuntimeError, match=r"without a scaler\.step"):
        scaler.update()
    fresh = LossScaler()
    with pytest.raises(RuntimeError, match="before scale"):
        fresh.step(opt)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(init_scale=0.0), "init_scale must be finite and > 0"),
        (dict(growth_factor=1.0), "growth_factor must be finite and > 1"),
        (dict(backoff_factor=1.5), "backoff_factor must be < 1"),
        (dict(growth_interval=0), "growth_interval must be an int >= 1"),
        (dict(hysteresis=1.5), "hysteresis must be an int"),
        (dict(min_scale=4.0, init_scale=2.0), "must lie in"),
        (dict(max_consecutive_skips=0), "max_consecutive_skips"),
    ],
)
def test_bad_options(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        LossScaler(**kwargs)


def test_disabled_scaler_is_a_pass_through(device):
    model = _model(device=device)
    opt = SGD(model.parameters(), lr=0.1, master="none")
    scaler = LossScaler(enabled=False)
    loss = _loss(model, 0)
    assert scaler.scale(loss) is loss
    loss.backward()
    scaler.unscale_(opt)
    assert bool(scaler.step(opt))
    scaler.update()
    assert scaler.get_scale() == 1.0 and scaler.state_dict() == {}


def test_closure_and_several_losses(device):
    model = _model(device=device)
    opt = SGD(model.parameters(), lr=0.1, master="none")
    ref = _model(device=device)
    ref_opt = SGD(ref.parameters(), lr=0.1, master="none")
    scaler = LossScaler(init_scale=2.0**6)

    def closure():
        opt.zero_grad()
        scaler.scale([_loss(model, 0), _loss(model, 1)])[0].backward(retain_graph=True)
        scaler.scale(_loss(model, 1)).backward()

    assert bool(scaler.step(opt, closure=closure))
    scaler.update()
    ref_opt.zero_grad()
    (_loss(ref, 0) + _loss(ref, 1)).backward()
    ref_opt.step()
    for a, b in zip(ref.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_exported_at_top_level():
    assert lowprec.LossScaler is LossScaler


def test_defaults_and_state_dict_keys_match_grad_scaler(device):
    ours, theirs = LossScaler(), torch.amp.GradScaler(device)
    assert ours.get_scale() == theirs.get_scale()
    assert ours.get_growth_factor() == theirs.get_growth_factor()
    assert ours.get_backoff_factor() == theirs.get_backoff_factor()
    assert ours.get_growth_interval() == theirs.get_growth_interval()
    assert ours.enabled is theirs.is_enabled() is ours.is_enabled()
    model = _model(device=device)
    for scaler in (ours, theirs):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler.scale(_loss(model, 0)).backward()
        scaler.step(opt)
        scaler.update()
    mine, ref = ours.state_dict(), theirs.state_dict()
    assert set(ref) <= set(mine)
    assert {k: mine[k] for k in ref} == ref


# Every lowprec optimizer x master strategy the recipes use: a skipped iteration must be
# invisible, i.e. the run equals one in which that iteration never happened, bit for bit (no
# moment, trail, compensation, step counter or stochastic-rounding stream moved).
SKIP_CASES = [
    (cls, master, dtype)
    for cls in (lowprec.SGD, lowprec.Adagrad, lowprec.Lamb, lowprec.AdamW)
    for master, dtype in (("none", torch.float32), ("none", torch.bfloat16),
                          ("kahan", torch.bfloat16), ("split", torch.bfloat16),
                          ("stochastic", torch.bfloat16))
]


@pytest.mark.parametrize(
    "cls, master, dtype", SKIP_CASES,
    ids=[f"{c.__name__}-{m}-{str(d)[6:]}" for c, m, d in SKIP_CASES],
)
def test_skipped_iteration_is_invisible(cls, master, dtype, device):
    def run(inject):
        model = _model(dtype, device=device)
        kw = {"momentum": 0.9} if cls is lowprec.SGD else {}
        opt = cls(model.parameters(), lr=1e-2, master=master, seed=1, **kw)
        scaler = LossScaler(init_scale=2.0**10, growth_interval=3)
        took = []
        for i in range(6):
            if inject and i == 3:  # an extra iteration that overflows
                opt.zero_grad()
                scaler.scale(_loss(model, 99, dtype, poison="nan")).backward()
                before = _snapshot(model, opt)
                took.append(bool(scaler.step(opt)))
                assert _equal(_snapshot(model, opt), before)
                scaler.update()
            opt.zero_grad()
            scaler.scale(_loss(model, i, dtype)).backward()
            took.append(bool(scaler.step(opt)))
            scaler.update()
        return _snapshot(model, opt), took, scaler.get_scale()

    clean, took_clean, scale_clean = run(False)
    skipped, took_skipped, scale_skipped = run(True)
    assert took_clean == [True] * 6 and took_skipped == [True] * 3 + [False] + [True] * 3
    assert scale_skipped < scale_clean  # it backed off: the runs really differ in scale
    assert _equal(skipped, clean)




@pytest.mark.parametrize("use_buckets", [False, True], ids=["full-step", "buckets"])
def test_scaler_step_with_a_lowprec_optimizer_reads_nothing_on_the_host(use_buckets, monkeypatch,
                                                                         device, request):
    # As on a GPU (capturable: on the CPU the default step reads its counts and the inf/NaN
    # finding on the host, which is no synchronisation there). Through buckets, the first step,
    # which lays them out, reads their counts once (whether they are all the same:
    # buckets._Bucket.count_marks); every later step reads nothing.
    if not use_buckets:
        request.getfixturevalue("no_buckets")
    model = _model(torch.bfloat16, device=device)
    opt = AdamW(model.parameters(), lr=1e-2, master="kahan", capturable=True)
    scaler = LossScaler(init_scale=2.0**8)
    for i in range(4):
        opt.zero_grad()
        loss = scaler.scale(_loss(model, i, torch.bfloat16, poison="inf" if i == 2 else None))
        loss.backward()
        reads = contextlib.nullcontext() if use_buckets and i == 0 else no_host_reads()
        with reads:
            stepped = scaler.step(opt)  # unscale, inf/NaN check and skip all on the device
        assert bool(stepped) == (i != 2)
        scaler.update()
    assert (core.stages(opt).buckets is not None) == use_buckets


@pytest.mark.parametrize(
    "change, error, match",
    [
        ({"scale": float("inf")}, ValueError, "scale must be finite and > 0"),
        ({"scale": -1.0}, ValueError, "scale must be finite and > 0"),
        ({"growth_factor": 0.5}, ValueError, "growth_factor must be finite and > 1"),
        ({"backoff_factor": 2.0}, ValueError, "backoff_factor must be < 1"),
        ({"growth_interval": 0}, ValueError, "growth_interval must be an int >= 1"),
        ({"_growth_tracker": -1}, ValueError, "_growth_tracker must be an int >= 0"),
        ({"hysteresis": 0}, ValueError, "hysteresis must be an int >= 1"),
        ({"min_scale": 1e9}, ValueError, "must lie in"),
        ({"scale": "big"}, TypeError, "scale must be a number"),
    ],
)
def test_bad_state_dict_raises_and_changes_nothing(change, error, match, device):
    model = _model(device=device)
    opt = SGD(model.parameters(), lr=0.1, master="none")
    scaler = LossScaler(init_scale=2.0**9, growth_interval=3)
    scaler.scale(_loss(model, 0)).backward()
    scaler.step(opt)
    scaler.update()
    before = scaler.state_dict()
    with pytest.raises(error, match=match):
        scaler.load_state_dict({**before, **change})
    assert scaler.state_dict() == before
    fresh = LossScaler()  # before its first scale(): the pending state must stay untouched too
    with pytest.raises(error, match=match):
        fresh.load_state_dict({**before, **change})
    assert fresh.state_dict() == LossScaler().state_dict()


@pytest.mark.parametrize("lowprec_opts", [False, True], ids=["torch-sgd", "lowprec-sgd"])
def test_two_optimizers_overflowing_separately_match_grad_scaler(lowprec_opts, device):
    # inf in one optimizer's gradients skips that optimizer only; the scale backs off once per
    # iteration whichever optimizers overflowed, as GradScaler does.
    bad_first, bad_second = {2, 5, 6}, {5, 9}
    results = []
    for cls in (torch.amp.GradScaler, LossScaler):
        model = _model(device=device)
        params = list(model.parameters())
        if lowprec_opts:
            opts = [SGD(params[:2], lr=0.1, master="none"), SGD(params[2:], lr=0.1, master="none")]
        else:
            opts = [torch.optim.SGD(params[:2], lr=0.1), torch.optim.SGD(params[2:], lr=0.1)]
        kw = {"device": device} if cls is torch.amp.GradScaler else {}
        scaler = cls(init_scale=2.0**10, growth_interval=2, **kw)
        scales, took = [], []
        for i in range(12):
            for o in opts:
                o.zero_grad()
            scaler.scale(_loss(model, i)).backward()
            if i in bad_first:
                params[0].grad.view(-1)[0] = float("inf")
            if i in bad_second:
                params[3].grad.view(-1)[1] = float("nan")
            for o in opts:
                r = scaler.step(o)
                took.append(bool(r) if cls is LossScaler else None)
            scaler.update()
            scales.append(scaler.get_scale())
        results.append((scales, [p.detach().clone() for p in params], took))
    (s_ref, p_ref, _), (s_got, p_got, took) = results
    assert s_got == s_ref
    assert all(torch.equal(a, b) for a, b in zip(p_ref, p_got, strict=True))
    expected = [ok for i in range(12) for ok in (i not in bad_first, i not in bad_second)]
    assert took == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_unscale_gives_the_unscaled_gradients_in_every_dtype(dtype, device):
    # The reference: the same backward without a scale. Power-of-two scales make unscaling exact
    # wherever the scaled backward neither overflows nor rounds differently in the subnormals.
    ref = _model(dtype, device=device)
    _loss(ref, 0, dtype).backward()
    model = _model(dtype, device=device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = LossScaler(init_scale=2.0**8)
    scaler.scale(_loss(model, 0, dtype)).backward()
    scaler.unscale_(opt)
    for a, b in zip(ref.parameters(), model.parameters(), strict=True):
        assert b.grad.dtype == dtype
        if dtype == torch.float16:  # FP16's subnormals: the scaled run keeps more bits there
            torch.testing.assert_close(b.grad, a.grad, rtol=2e-3, atol=2.0**-24)
        else:
            assert torch.equal(b.grad, a.grad)
