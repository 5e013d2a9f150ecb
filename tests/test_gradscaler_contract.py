"""LossScaler, and lowprec's optimizers under torch.amp.GradScaler, against GradScaler's contract.

The reference is always ``torch.amp.GradScaler`` driving a plain ``torch.optim`` optimizer: its scale
sequence and skipped steps on injected inf/NaN gradients, the unscaled gradients it leaves in
``p.grad``, clipping after ``unscale_``, two optimizers on one scaler, and its state dict. Each is
checked for ``lowprec.LossScaler`` (default options) and for lowprec's optimizers under both
scalers (they take the scale and the found-inf flag from the scaler and unscale and skip inside
their step: GradScaler's ``_step_supports_amp_scaling`` contract), eager and fused.

What a skipped step leaves in ``p.grad``: GradScaler with a plain torch.optim optimizer unscales the
gradients in ``unscale_`` before it knows of the overflow, so after a skipped step ``p.grad`` holds
the unscaled gradients, the inf/NaN elements still inf/NaN. (torch's own fused optimizers, which
skip inside their kernel, leave them scaled.) lowprec's optimizers are held to the plain optimizer's
behaviour, under either scaler.

Every test runs on each device present (the CPU, and CUDA where present: the ``device`` fixture),
model, batches and scalers alike (batches are drawn on the CPU and moved); the references run on
the same device, ``torch.optim`` with ``foreach=False`` (its for-loop implementation, the CPU's
default).
"""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
from torch import nn

import lowprec
from lowprec import LossScaler

# A fused step that falls back to eager (its compilation failed) fails the test instead of warning.
pytestmark = pytest.mark.filterwarnings("error:lowprec. the fused:RuntimeWarning")

SCALERS = ["grad_scaler", "loss_scaler"]
FUSED = [False, pytest.param(True, marks=pytest.mark.slow)]


def _scaler(kind, device="cpu", **kw):
    if kind == "grad_scaler":
        return torch.amp.GradScaler(device, **kw)
    return LossScaler(**kw)


def _model(dtype=torch.float32, seed=0, device="cpu"):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3)).to(dtype).to(device)


def _device_of(model):
    return next(model.parameters()).device


def _loss(model, i, dtype=torch.float32):
    gen = torch.Generator().manual_seed(1000 + i)
    x, y = torch.randn(8, 6, generator=gen).to(dtype), torch.randn(8, 3, generator=gen)
    device = _device_of(model)
    return (model(x.to(device)).float() - y.to(device)).pow(2).mean()


def _poison(params, i, which=None):
    """An inf (or, every third time, a NaN) in one gradient element, as an overflow leaves it."""
    p = params[(i if which is None else which) % len(params)]
    p.grad.view(-1)[i % p.numel()] = math.nan if i % 3 == 0 else math.inf


def _snapshot(params):
    return [p.detach().clone() for p in params]


def _moved(before, params):
    return any(not torch.equal(a, b) for a, b in zip(before, params, strict=True))


def _same_grads(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit, except that a NaN equals any NaN (payloads are not part of the
    contract)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    return torch.equal(nan_a, nan_b) and torch.equal(a[~nan_a], b[~nan_b])


def _rel_close(a, b, rel=1e-6):
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item() <= rel


# ------------------------------------------------------------------ 1. the scale sequence


def _pattern(name):
    """(steps, injected iterations, init_scale) of each named pattern."""
    if name == "random":
        gen = torch.Generator().manual_seed(11)
        bad = set(torch.nonzero(torch.rand(150, generator=gen) < 0.15).view(-1).tolist())
        return 150, bad, 2.0**16
    return {
        "isolated": (40, {3, 9, 10, 17, 31}, 2.0**16),
        "burst": (40, set(range(5, 14)), 2.0**16),
        # 40 overflows in a row from 2**4 go down to 2**-36, and clean steps climb back (40 stays
        # under LossScaler's max_consecutive_skips=50, past which it raises instead of skipping)
        "below one": (70, set(range(2, 42)), 16.0),
        "alternating": (40, set(range(0, 40, 2)), 2.0**10),
        # no injection: the scale climbs until the scaled loss (made large: _LARGE_LOSS) itself
        # overflows FP32, backs off and climbs again
        "climb to overflow": (150, set(), 2.0**96),
        "odd init": (40, {0, 1, 6, 7, 8, 20}, 3.0),
    }[name]


PATTERN_NAMES = ["isolated", "burst", "below one", "alternating", "random", "climb to overflow",
                 "odd init"]


_LARGE_LOSS = 2.0**20


def _scale_run(kind, opt_kind, steps, bad, init_scale, growth_interval, factor=1.0,
               device="cpu"):
    model = _model(device=device)
    params = list(model.parameters())
    lr = 0.01 / factor  # (a large loss, the same steps)
    opt = (lowprec.SGD(params, lr=lr, master="none") if opt_kind == "lowprec"
           else torch.optim.SGD(params, lr=lr, foreach=False))
    scaler = _scaler(kind, device, init_scale=init_scale, growth_interval=growth_interval)
    scales, skipped, returned = [], [], []
    for i in range(steps):
        opt.zero_grad()
        scaler.scale(_loss(model, i) * factor).backward()
        if i in bad:
            _poison(params, i)
        before = _snapshot(params)
        r = scaler.step(opt)
        if kind == "loss_scaler":
            returned.append(bool(r))
        skipped.append(not _moved(before, params))
        scaler.update()
        scales.append(scaler.get_scale())
    return scales, skipped, returned


@pytest.mark.parametrize("growth_interval", [1, 2, 3, 7])
@pytest.mark.parametrize("pattern", PATTERN_NAMES, ids=lambda n: n.replace(" ", "-"))
def test_scale_sequence_and_skips_equal_grad_scalers(pattern, growth_interval, device):
    steps, bad, init_scale = _pattern(pattern)
    factor = _LARGE_LOSS if pattern == "climb to overflow" else 1.0
    ref_scales, ref_skipped, _ = _scale_run("grad_scaler", "torch", steps, bad, init_scale,
                                            growth_interval, factor, device)
    # (the pattern does what it is named for)
    assert [i for i, s in enumerate(ref_skipped) if s] == sorted(bad) or not bad
    if pattern == "below one":
        assert min(ref_scales) < 1
    if pattern == "climb to overflow":
        assert any(ref_skipped) and max(ref_scales) > init_scale
        assert sum(ref_skipped) < steps / growth_interval  # (overflows at the top, not divergence)
    for kind, opt_kind in [("loss_scaler", "torch"), ("loss_scaler", "lowprec"),
                           ("grad_scaler", "lowprec")]:
        scales, skipped, returned = _scale_run(kind, opt_kind, steps, bad, init_scale,
                                               growth_interval, factor, device)
        assert scales == ref_scales, (kind, opt_kind)
        assert skipped == ref_skipped, (kind, opt_kind)
        if returned:
            assert returned == [not s for s in ref_skipped], (kind, opt_kind)


# ------------------------------------------------------------------ 2. unscaled gradients


OPTIMIZERS = {
    "SGD": lambda ps, **kw: lowprec.SGD(ps, lr=0.05, momentum=0.9, **kw),
    "AdamW": lambda ps, **kw: lowprec.AdamW(ps, lr=1e-2, **kw),
    "Adagrad": lambda ps, **kw: lowprec.Adagrad(ps, lr=0.05, **kw),
    "Lamb": lambda ps, **kw: lowprec.Lamb(ps, lr=1e-2, **kw),
}
MASTER_OF = {torch.float32: "none", torch.bfloat16: "split", torch.float16: "fp32"}
DTYPES = [pytest.param(d, id=str(d)[6:]) for d in MASTER_OF]
INIT_SCALE = 2.0**10


def _reference_from(model, dtype, i, bad):
    """What GradScaler leaves in ``p.grad`` after ``step`` with a plain torch.optim optimizer, for
    iteration ``i`` of ``model`` (and the scaled gradients it came from)."""
    params = list(model.parameters())
    scaler = torch.amp.GradScaler(_device_of(model).type, init_scale=INIT_SCALE)
    scaler.scale(_loss(model, i, dtype)).backward()
    if bad:
        _poison(params, i)
    scaled = [p.grad.clone() for p in params]
    if dtype == torch.float16:
        # GradScaler refuses to unscale FP16 gradients for a plain optimizer ("Attempting to
        # unscale FP16 gradients"); what its unscale_ would do is this op with its inverse scale.
        found = torch.zeros((), device=_device_of(model))
        inv = scaler._scale.double().reciprocal().float()
        torch._amp_foreach_non_finite_check_and_unscale_([p.grad for p in params], found, inv)
    else:
        scaler.step(torch.optim.SGD(params, lr=0.1, foreach=False))
    return scaled, [p.grad.clone() for p in params]


@pytest.mark.parametrize("fused", FUSED, ids=["eager", "fused"])
@pytest.mark.parametrize("bad", [False, True], ids=["clean", "overflow"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("kind", SCALERS)
def test_step_leaves_the_unscaled_gradients(kind, name, dtype, bad, fused, device):
    model = _model(dtype, device=device)
    params = list(model.parameters())
    opt = OPTIMIZERS[name](params, master=MASTER_OF[dtype], fused=fused)
    scaler = _scaler(kind, device, init_scale=INIT_SCALE)
    for i in range(2):  # a clean step, then a clean or an overflowing one
        poison = bad and i == 1
        # the reference starts from this model's current weights
        ref_model = _model(dtype, device=device)
        for r, p in zip(ref_model.parameters(), params, strict=True):
            r.data.copy_(p.detach())
        scaled, expected = _reference_from(ref_model, dtype, i, poison)
        opt.zero_grad()
        scaler.scale(_loss(model, i, dtype)).backward()
        if poison:
            _poison(params, i)
        assert all(_same_grads(p.grad, s) for p, s in zip(params, scaled, strict=True))
        before = _snapshot(params)
        scaler.step(opt)
        for p, e in zip(params, expected, strict=True):
            assert p.grad.dtype == dtype
            assert _same_grads(p.grad, e), (i, p.shape)
        assert _moved(before, params) != poison  # the overflow was skipped, nothing else
        scaler.update()
    assert scaler.get_scale() == (INIT_SCALE / 2 if bad else INIT_SCALE)


def test_the_fp16_reference_is_what_grad_scaler_does(device):
    # (the FP16 reference above uses GradScaler's unscale op directly: on FP32 and BF16, where
    # GradScaler runs it itself, the two agree bit for bit)
    for dtype in (torch.float32, torch.bfloat16):
        for bad in (False, True):
            model = _model(dtype, device=device)
            _, by_step = _reference_from(model, dtype, 0, bad)
            model = _model(dtype, device=device)
            params = list(model.parameters())
            scaler = torch.amp.GradScaler(device, init_scale=INIT_SCALE)
            scaler.scale(_loss(model, 0, dtype)).backward()
            if bad:
                _poison(params, 0)
            inv = scaler._scale.double().reciprocal().float()
            torch._amp_foreach_non_finite_check_and_unscale_(
                [p.grad for p in params], torch.zeros((), device=device), inv)
            assert all(_same_grads(p.grad, e) for p, e in zip(params, by_step, strict=True))


# ------------------------------------------------------------------ 3. clipping after unscale_

CLIP_PAIRS = {
    "SGD": (lambda ps, **kw: lowprec.SGD(ps, lr=0.05, momentum=0.9, **kw),
            lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, foreach=False)),
    "AdamW": (lambda ps, **kw: lowprec.AdamW(ps, lr=1e-2, weight_decay=0.1, **kw),
              lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=False)),
    "Adagrad": (lambda ps, **kw: lowprec.Adagrad(ps, lr=0.05, **kw),
                lambda ps: torch.optim.Adagrad(ps, lr=0.05, foreach=False)),
}
CLIP_BAD = {3, 7, 8}


def _clipped_run(make_opt, kind, steps=12, max_norm=0.05, device="cpu"):
    model = _model(device=device)
    params = list(model.parameters())
    opt = make_opt(params)
    scaler = _scaler(kind, device, init_scale=2.0**12, growth_interval=2)
    trace = []
    for i in range(steps):
        opt.zero_grad()
        scaler.scale(_loss(model, i)).backward()
        if i in CLIP_BAD:
            _poison(params, i)
        scaler.unscale_(opt)
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        before = _snapshot(params)
        scaler.step(opt)
        scaler.update()
        trace.append((not _moved(before, params), scaler.get_scale(), float(norm),
                      _snapshot(params)))
    return trace


@pytest.mark.parametrize("fused", FUSED, ids=["eager", "fused"])
@pytest.mark.parametrize("kind", SCALERS)
@pytest.mark.parametrize("name", list(CLIP_PAIRS))
def test_clipping_after_unscale_matches_torch(name, kind, fused, device):
    ours, theirs = CLIP_PAIRS[name]
    ref = _clipped_run(theirs, "grad_scaler", device=device)
    got = _clipped_run(lambda ps: ours(ps, master="none", fused=fused), kind, device=device)
    assert any(n > 0.05 for _, _, n, _ in ref if math.isfinite(n))  # clipping did act
    assert [t[0] for t in got] == [t[0] for t in ref] == [i in CLIP_BAD for i in range(12)]
    assert [t[1] for t in got] == [t[1] for t in ref]
    for i, (g, r) in enumerate(zip(got, ref, strict=True)):
        if math.isfinite(r[2]):
            assert math.isclose(g[2], r[2], rel_tol=1e-5), i
        for a, b in zip(g[3], r[3], strict=True):
            assert _rel_close(a, b), i


# ------------------------------------------------------------------ 4. two optimizers, one scaler

BAD_FIRST, BAD_SECOND = {2, 5, 6}, {5, 9}


def _two_optimizer_run(make_opts, kind, unscale_first, steps=12, device="cpu"):
    model = _model(device=device)
    params = list(model.parameters())
    opts = make_opts(params[:2], params[2:])
    scaler = _scaler(kind, device, init_scale=2.0**10, growth_interval=2)
    scales, skipped = [], []
    for i in range(steps):
        for o in opts:
            o.zero_grad()
        scaler.scale(_loss(model, i)).backward()
        if i in BAD_FIRST:
            _poison(params, i, which=0)
        if i in BAD_SECOND:
            _poison(params, i, which=3)
        if unscale_first:
            scaler.unscale_(opts[0])
        for o in opts:
            ps = [p for g in o.param_groups for p in g["params"]]
            before = _snapshot(ps)
            scaler.step(o)
            skipped.append(not _moved(before, ps))
        scaler.update()
        scales.append(scaler.get_scale())
    return scales, skipped, _snapshot(params)


def _torch_pair(a, b):
    return [torch.optim.SGD(a, lr=0.1, momentum=0.9, foreach=False),
            torch.optim.AdamW(b, lr=1e-2, foreach=False)]


TWO_OPTS = {
    "lowprec+lowprec": lambda fused: lambda a, b: [
        lowprec.SGD(a, lr=0.1, momentum=0.9, master="none", fused=fused),
        lowprec.AdamW(b, lr=1e-2, master="none", fused=fused)],
    "lowprec+torch": lambda fused: lambda a, b: [
        lowprec.SGD(a, lr=0.1, momentum=0.9, master="none", fused=fused),
        torch.optim.AdamW(b, lr=1e-2, foreach=False)],
    "torch+lowprec": lambda fused: lambda a, b: [
        torch.optim.SGD(a, lr=0.1, momentum=0.9, foreach=False),
        lowprec.AdamW(b, lr=1e-2, master="none", fused=fused)],
}


@pytest.mark.parametrize("fused", FUSED, ids=["eager", "fused"])
@pytest.mark.parametrize("unscale_first", [False, True], ids=["step", "unscale-first"])
@pytest.mark.parametrize("kind", SCALERS)
@pytest.mark.parametrize("pair", list(TWO_OPTS))
def test_two_optimizers_on_one_scaler(pair, kind, unscale_first, fused, device):
    ref_scales, ref_skipped, ref_params = _two_optimizer_run(_torch_pair, "grad_scaler",
                                                             unscale_first, device=device)
    assert ref_skipped == [i in bad for i in range(12) for bad in (BAD_FIRST, BAD_SECOND)]
    scales, skipped, params = _two_optimizer_run(TWO_OPTS[pair](fused), kind, unscale_first,
                                                 device=device)
    assert skipped == ref_skipped
    assert scales == ref_scales
    for a, b in zip(params, ref_params, strict=True):
        assert _rel_close(a, b)


@pytest.mark.parametrize("kind", SCALERS)
def test_loss_scaler_and_grad_scaler_agree_with_two_torch_optimizers(kind, device):
    # LossScaler itself (no lowprec optimizer) with two torch.optim optimizers, bit for bit
    ref = _two_optimizer_run(_torch_pair, "grad_scaler", unscale_first=True, device=device)
    got = _two_optimizer_run(_torch_pair, kind, unscale_first=True, device=device)
    assert got[0] == ref[0] and got[1] == ref[1]
    assert all(torch.equal(a, b) for a, b in zip(got[2], ref[2], strict=True))


# ------------------------------------------------------------------ 5. state dicts

RESUME_BAD = {3, 4, 5, 11, 12, 13, 14, 15, 16, 17, 18, 19}
RESUME_STEPS = 40


def _resumed_run(first, second, split, *, opt_kind="torch", warm_target=False, via_disk=False,
                 device="cpu"):
    """A run whose scaler is ``first`` for iterations ``0 .. split - 1``, then ``second`` loaded
    from its state dict (``first == second`` and ``split == RESUME_STEPS``: uninterrupted)."""
    model = _model(device=device)
    params = list(model.parameters())
    opt = (lowprec.SGD(params, lr=0.01, master="none") if opt_kind == "lowprec"
           else torch.optim.SGD(params, lr=0.01, foreach=False))
    kw = dict(init_scale=2.0**8, growth_interval=3)
    scaler = _scaler(first, device, **kw)
    scales, skipped = [], []
    for i in range(RESUME_STEPS):
        if i == split:
            sd = scaler.state_dict()
            if via_disk:
                buf = io.BytesIO()
                torch.save(sd, buf)
                buf.seek(0)
                sd = torch.load(buf, weights_only=True)
            # (its own defaults: everything comes from the state dict)
            scaler = _scaler(second, device)
            if warm_target:  # a scaler that has already scaled a loss (its state is allocated)
                scaler.scale(torch.ones((), device=device))
            scaler.load_state_dict(copy.deepcopy(sd))
            assert scaler.get_scale() == sd["scale"]
        opt.zero_grad()
        scaler.scale(_loss(model, i)).backward()
        if i in RESUME_BAD:
            _poison(params, i)
        before = _snapshot(params)
        scaler.step(opt)
        skipped.append(not _moved(before, params))
        scaler.update()
        scales.append(scaler.get_scale())
    return scales, skipped, _snapshot(params), scaler.state_dict()


@pytest.mark.parametrize("warm_target", [False, True], ids=["fresh", "warm"])
@pytest.mark.parametrize("split", [0, 4, 9, 16])
@pytest.mark.parametrize(("first", "second"), [("grad_scaler", "loss_scaler"),
                                               ("loss_scaler", "grad_scaler")],
                         ids=["grad-to-loss", "loss-to-grad"])
def test_resuming_across_scalers_continues_identically(first, second, split, warm_target,
                                                       device):
    ref = _resumed_run("grad_scaler", "grad_scaler", RESUME_STEPS, device=device)
    assert min(ref[0]) < 2.0**8 < max(ref[0])  # it backed off and grew
    got = _resumed_run(first, second, split, warm_target=warm_target, via_disk=split == 9,
                       device=device)
    assert got[0] == ref[0]
    assert got[1] == ref[1]
    assert all(torch.equal(a, b) for a, b in zip(got[2], ref[2], strict=True))
    shared = ref[3].keys() & got[3].keys()
    assert {k: got[3][k] for k in shared} == {k: ref[3][k] for k in shared}


def test_state_dict_keys_and_values_match_grad_scalers_mid_run(device):
    # After backing off below the initial scale, with the growth tracker part way through its
    # interval: LossScaler's state dict holds GradScaler's keys with GradScaler's values (and
    # types), and each loads the other's.
    for split in (0, 7, 21):
        states = []
        for kind in SCALERS:
            model = _model(device=device)
            params = list(model.parameters())
            opt = torch.optim.SGD(params, lr=0.01)
            scaler = _scaler(kind, device, init_scale=2.0**8, growth_interval=3)
            for i in range(split):
                opt.zero_grad()
                scaler.scale(_loss(model, i)).backward()
                if i in RESUME_BAD:
                    _poison(params, i)
                scaler.step(opt)
                scaler.update()
            states.append(scaler.state_dict())
        theirs, ours = states
        assert set(theirs) <= set(ours)
        assert {k: (type(ours[k]), ours[k]) for k in theirs} == {
            k: (type(v), v) for k, v in theirs.items()}
        into_grad = torch.amp.GradScaler(device)
        into_grad.load_state_dict(ours)
        assert into_grad.state_dict() == theirs
        into_loss = LossScaler()
        into_loss.load_state_dict(theirs)
        assert {k: into_loss.state_dict()[k] for k in theirs} == theirs


def test_resuming_with_lowprec_optimizers_under_either_scaler(device):
    ref = _resumed_run("grad_scaler", "grad_scaler", RESUME_STEPS, opt_kind="lowprec",
                       device=device)
    for first, second in (("grad_scaler", "loss_scaler"), ("loss_scaler", "grad_scaler")):
        got = _resumed_run(first, second, 13, opt_kind="lowprec", device=device)
        assert got[0] == ref[0] and got[1] == ref[1]
        assert all(torch.equal(a, b) for a, b in zip(got[2], ref[2], strict=True))
