"""Lion and StableAdamW against their papers' FP64 references, FP32 against the split encoding,
fused against eager.

The references (tests/reference/lion.py, tests/reference/stable_adamw.py) are written from the
papers and optimi's documented semantics, in float64, sharing nothing with lowprec. One shape of
each run has more elements than the CPU's eager chunk (2**16), so the eager step goes in pieces
and StableAdamW's RMS is summed across them.

Lion's update is ``lr * sign(c)``: where FP32 and FP64 round ``c`` to opposite sides of 0 the two
updates differ by ``2 * lr``, whatever the precision. Over a run such a near-tie happens a few
times in millions of element-steps, and from then on the two trajectories differ there. So Lion is
compared step by step: each step of the reference starts from lowprec's FP32 state, and every
element must agree to FP32 rounding but the near-ties, where ``|c|`` is within 1e-6 of the size of
its two terms (counted, and rare). An exact 0 is no near-tie: both give ``sign(0) = 0``.
"""

from __future__ import annotations

import pytest
import torch

from lowprec.numerics import join
from lowprec.optim import update
from lowprec.optim.lion import Lion
from lowprec.optim.stable_adamw import StableAdamW
from tests._same import assert_same
from tests.reference.lion import ReferenceLion
from tests.reference.stable_adamw import ReferenceStableAdamW

SHAPES = [(33, 17), (64,), (5, 3, 4), (1,), (263, 257)]  # the last: 67591 elements, 2 chunks
# StableAdamW's gradients: the second tensor's are tiny (the eps**2 floor of the RMS comes into
# play), and every tensor's jump 30-fold at some steps (a spike: the RMS exceeds 1 and clips lr).
SCALES = [1.0, 1e-3, 1.0, 1.0, 1.0]
SPIKES = {7: 30.0, 25: 30.0, 26: 10.0, 45: 100.0}


def _params(shapes=SHAPES, dtype=torch.float32, device="cpu"):
    return [torch.randn(s).to(dtype).to(device).requires_grad_() for s in shapes]


def _grads(steps, shapes=SHAPES, scales=None, spikes=None, seed=0, dead=0):
    """Gradients for ``steps`` steps; ``dead``: that many first steps have the same tenth of
    every tensor's elements exactly 0 (Lion's ``c`` is then exactly 0 there)."""
    gen = torch.Generator().manual_seed(seed)
    scales = scales or [1.0] * len(shapes)
    masks = [torch.rand(s, generator=gen) < 0.1 for s in shapes]
    out = []
    for t in range(steps):
        spike = (spikes or {}).get(t, 1.0)
        gs = [torch.randn(s, generator=gen) * (k * spike) for s, k in zip(shapes, scales,
                                                                           strict=True)]
        if t < dead:
            gs = [g.masked_fill(m, 0.0) for g, m in zip(gs, masks, strict=True)]
        out.append(gs)
    return out


def _feed(params, grads):
    for p, g in zip(params, grads, strict=True):
        p.grad = g.to(p.dtype).to(p.device).clone()


def _close(actual, expected, rel, scale=None):
    """Within ``rel`` of the tensor's largest magnitude, element by element, and norm-wise; or,
    given ``scale``, within ``rel`` of it element by element."""
    actual, expected = actual.detach().cpu().double(), expected.detach().cpu().double()
    err = (actual - expected).abs()
    if scale is not None:
        assert (err <= rel * scale).all(), (err / scale).max().item()
        return
    max_err = (err.max() / expected.abs().max().clamp_min(1e-30)).item()
    norm_err = (err.norm() / expected.norm().clamp_min(1e-30)).item()
    assert max_err <= rel and norm_err <= rel, (max_err, norm_err)


def _reference_kw(kw, lr):
    """The options of a lowprec run as the references take them: ``lr`` (the optimizer's default
    where ``kw`` has none) and ``max_lr`` for ``decouple_lr``."""
    out = {"lr": lr, **{k: v for k, v in kw.items() if k not in ("decouple_lr", "max_lr")}}
    if kw.get("decouple_lr"):
        out["max_lr"] = kw.get("max_lr", out["lr"])
    return out


# --------------------------------------------------------------------- Lion against the paper

LION_CASES = [
    dict(lr=1e-3),
    dict(lr=3e-4, betas=(0.95, 0.98), weight_decay=0.1),
    dict(lr=1e-3, weight_decay=0.5, maximize=True),
    dict(lr=1e-3, weight_decay=2e-3, decouple_lr=True, max_lr=4e-3),
    dict(lr=5e-4, betas=(0.0, 0.5), weight_decay=0.1, decouple_lr=True),  # max_lr: lr
]


@pytest.mark.parametrize("fused", [False, pytest.param(True, marks=pytest.mark.fused)],
                         ids=["eager", "fused"])
@pytest.mark.parametrize("kw", LION_CASES)
def test_lion_none_on_fp32_matches_the_paper_step_by_step(kw, fused, device):
    params = _params(device=device)
    opt = Lion(params, master="none", fused=fused, **kw)
    ref = ReferenceLion([p.cpu() for p in params], **_reference_kw(kw, lr=1e-4))
    ties = zeros = 0
    for grads in _grads(60, dead=3):
        # The reference's step from lowprec's FP32 state (the momentum 0 before the first step).
        ref.w = [p.detach().cpu().double() for p in params]
        ref.m = [opt.state[p]["exp_avg"].cpu().double() if opt.state[p] else torch.zeros_like(w)
                 for p, w in zip(params, ref.w, strict=True)]
        c = [ref.direction(i, g) for i, g in enumerate(grads)]
        size = [ref.b1 * m.abs() + (1 - ref.b1) * g.double().abs()
                for m, g in zip(ref.m, grads, strict=True)]
        # The new weight and momentum may cancel: their errors are FP32's on their terms' sizes.
        decay = 1 - (ref.lr if ref.max_lr is None else ref.lr / ref.max_lr) * ref.wd
        w_size = [w.abs() * decay + ref.lr for w in ref.w]
        m_size = [ref.b2 * m.abs() + (1 - ref.b2) * g.double().abs()
                  for m, g in zip(ref.m, grads, strict=True)]
        ref.step(grads)
        _feed(params, grads)
        opt.step()
        for i, p in enumerate(params):
            near = (c[i].abs() <= 1e-6 * size[i]) & (size[i] > 0)
            ties += int(near.sum())
            zeros += int((c[i] == 0).sum())
            # (a sign flipped outside the near-ties would be off by 2 * lr: over 100x this bound)
            _close(p[~near.to(p.device)], ref.w[i][~near], rel=1e-6, scale=w_size[i][~near])
            _close(opt.state[p]["exp_avg"], ref.m[i], rel=1e-6, scale=m_size[i])
    assert zeros > 0  # the dead elements of the first steps: sign(0) = 0 in both
    assert ties <= 20, ties  # (of 60 steps x 68k elements)


def test_lion_moves_every_element_by_lr():
    w = torch.zeros(1000, requires_grad=True)
    opt = Lion([w], lr=0.25, master="none", fused=False)
    w.grad = torch.randn(1000)
    w.grad[:10] = 0.0
    opt.step()
    assert torch.equal(w.detach().abs()[10:], torch.full((990,), 0.25))
    assert torch.equal(w.detach()[:10], torch.zeros(10))  # sign(0) = 0: no move
    assert torch.equal(w.detach()[10:], -0.25 * w.grad[10:].sign())


@pytest.mark.parametrize("fused", [False, pytest.param(True, marks=pytest.mark.fused)],
                         ids=["eager", "fused"])
def test_lion_nan_and_inf_gradients_show_in_the_weights(fused):
    """torch.sign gives 0 for NaN: Lion's update is NaN there instead (as AdamW's would be),
    so a NaN gradient does not silently freeze the weight."""
    w = torch.ones(64, requires_grad=True)
    opt = Lion([w], lr=0.1, master="none", fused=fused)
    w.grad = torch.ones(64)
    w.grad[3], w.grad[5] = float("nan"), float("inf")
    opt.step()
    assert w[3].isnan() and w[5].isnan()
    assert torch.equal(w.detach()[6:], torch.full((58,), 0.9))


# -------------------------------------------------------------- StableAdamW against optimi's

STABLE_CASES = [
    dict(),
    dict(lr=1e-2, betas=(0.8, 0.95), eps=1e-8, weight_decay=0.0),
    dict(lr=3e-3, weight_decay=0.1, maximize=True),
    dict(lr=1e-2, weight_decay=1e-4, decouple_lr=True, max_lr=2e-2),
    dict(lr=1e-2, eps=3e-3, decouple_lr=True),  # eps**2 above the tiny gradients' v; max_lr: lr
]


@pytest.mark.parametrize("fused", [False, pytest.param(True, marks=pytest.mark.fused)],
                         ids=["eager", "fused"])
@pytest.mark.parametrize("kw", STABLE_CASES)
def test_stable_adamw_none_on_fp32_matches_the_reference(kw, fused, device):
    params = _params(device=device)
    opt = StableAdamW(params, master="none", fused=fused, **kw)
    ref = ReferenceStableAdamW([p.cpu() for p in params], **_reference_kw(kw, lr=1e-3))
    rms, steps = [], 60
    for grads in _grads(steps, scales=SCALES, spikes=SPIKES):
        ref.step(grads)
        rms.append(ref.rms)
        _feed(params, grads)
        opt.step()
    # Meaningful: every tensor (but the one-element one, whose RMS is 1 or less) had its
    # learning rate clipped at the spikes and not elsewhere.
    rms = torch.tensor(rms)
    assert (rms[list(SPIKES), :3] > 1.2).all() and (rms[list(SPIKES), 4] > 1.2).all()
    assert (rms[30:45] < 1.0).all()
    # The decay factor 1 - lr_t * weight_decay, rounded to FP32 (as torch's and optimi's AdamW
    # round it), is off by up to 2**-25 of itself at every step, always the same way while lr_t
    # is: the weights drift from FP64's by up to that much per step, on top of their rounding.
    decays = kw.get("weight_decay", 1e-2) != 0
    for i, p in enumerate(params):
        _close(p, ref.w[i], rel=1e-6 + (steps * 2**-25 if decays else 0))
        _close(opt.state[p]["exp_avg"], ref.m[i], rel=1e-6)
        _close(opt.state[p]["exp_avg_sq"], ref.v[i], rel=1e-6)


def test_stable_adamw_chunked_equals_one_pass(monkeypatch):
    """The eager step sums the RMS over chunks (here 4096 elements of 12,300): bit for bit the
    step that takes the whole tensor in one pass."""
    w = torch.randn(100, 123, requires_grad=True)
    ref = w.detach().clone().requires_grad_()
    runs = [(4096, w, StableAdamW([w], lr=1e-2, weight_decay=0.1, master="none", fused=False)),
            (1 << 20, ref, StableAdamW([ref], lr=1e-2, weight_decay=0.1, master="none",
                                       fused=False))]
    for (g,) in _grads(6, [(100, 123)], spikes={3: 50.0}):
        for chunk, t, opt in runs:
            monkeypatch.setitem(update._EAGER_CHUNKS, "cpu", chunk)
            t.grad = g.clone()
            opt.step()
        assert torch.equal(w.detach(), ref.detach())
        assert torch.equal(runs[0][2].state[w]["exp_avg_sq"], runs[1][2].state[ref]["exp_avg_sq"])


def test_decouple_lr_takes_the_groups_own_lr_as_max_lr():
    a, b = torch.zeros(2, requires_grad=True), torch.zeros(2, requires_grad=True)
    opt = StableAdamW([{"params": [a]}, {"params": [b], "lr": 0.5}], lr=0.1, decouple_lr=True)
    assert [g["max_lr"] for g in opt.param_groups] == [0.1, 0.5]
    assert Lion([a], lr=0.1, decouple_lr=True, max_lr=1.0).param_groups[0]["max_lr"] == 1.0
    assert Lion([a], lr=0.1).param_groups[0]["max_lr"] is None


# --------------------------------------------------------------- split == FP32, bit for bit

SPLIT_CASES = [
    (Lion, dict(lr=1e-3, weight_decay=0.1)),
    (Lion, dict(lr=1e-4, betas=(0.9, 0.999), maximize=True)),
    (StableAdamW, dict(lr=1e-3, weight_decay=0.1)),
    (StableAdamW, dict(lr=1e-2, decouple_lr=True, weight_decay=1e-3)),
]


@pytest.mark.parametrize(("cls", "kw"), SPLIT_CASES)
def test_split_equals_fp32_bit_for_bit(cls, kw, device):
    shapes = [(40, 30), (30,)]
    bf = _params(shapes, torch.bfloat16, device)
    fp = [p.detach().float().requires_grad_() for p in bf]
    opt_bf = cls(bf, master="split", **kw)
    opt_fp = cls(fp, master="none", **kw)
    for grads in _grads(100, shapes, spikes={50: 30.0}):
        grads = [g.to(torch.bfloat16) for g in grads]  # (what a BF16 backward could produce)
        _feed(bf, grads)
        _feed(fp, grads)
        opt_bf.step()
        opt_fp.step()
    for pb, pf in zip(bf, fp, strict=True):
        assert torch.equal(opt_bf.master_weight(pb).view(torch.int32),
                           pf.detach().view(torch.int32))
        assert torch.equal(join(pb.detach(), opt_bf.state[pb]["trail"]), pf.detach())


# ------------------------------------------------------------------ fused == eager, bit for bit

FUSED_CASES = [
    (Lion, dict(lr=1e-3, weight_decay=0.1), "kahan", None),
    (Lion, dict(lr=1e-3, weight_decay=0.1), "stochastic", None),
    (Lion, dict(lr=1e-3, weight_decay=0.1), "kahan", "8bit"),
    (StableAdamW, dict(lr=1e-2, weight_decay=0.1), "kahan", None),
    (StableAdamW, dict(lr=1e-2, weight_decay=0.1), "stochastic", None),
    (StableAdamW, dict(lr=1e-2, weight_decay=0.1), "kahan", "8bit"),
]


@pytest.mark.slow
@pytest.mark.fused
@pytest.mark.parametrize(
    ("cls", "kw", "master", "state_dtype"), FUSED_CASES,
    ids=[f"{c[0].__name__}-{c[2]}-{c[3] or 'bf16'}" for c in FUSED_CASES],
)
def test_fused_equals_eager_bit_for_bit(cls, kw, master, state_dtype, device):
    """BF16 parameters: two longer than the eager chunk (2 pieces; StableAdamW's RMS summed over
    both), one of odd length, 8-bit state for those of >= 4096 elements, multiples of 256 (the
    second and third), a small one, and a loss-scaled step."""
    shapes = [(263, 257), (260, 256), (64, 128), (33,)]
    init = [torch.randn(s).to(torch.bfloat16).to(device) for s in shapes]
    results = []
    for fused in (False, True):
        params = [x.clone().requires_grad_() for x in init]
        opt = cls(params, master=master, state_dtype=state_dtype, fused=fused, seed=11, **kw)
        for step, grads in enumerate(_grads(5, shapes, spikes={2: 30.0}, seed=3)):
            grads = [g.to(torch.bfloat16) for g in grads]
            if step == 4:
                _feed(params, [g * 8 for g in grads])
                opt.step(grad_scale=torch.tensor(8.0, device=device),
                         found_inf=torch.zeros((), device=device))
            else:
                _feed(params, grads)
                opt.step()
        results.append((params, opt))
    assert_same(*results[0], *results[1])
    if state_dtype == "8bit":
        assert results[0][1].state[results[0][0][1]]["exp_avg"].dtype == torch.uint8


# ------------------------------------------------------------------------ bad hyperparameters

BAD = [
    (lambda w: Lion([w], lr=-1e-4), "invalid lr=-0.0001"),
    (lambda w: Lion([w], betas=(0.9, 1.0)), r"invalid betas\[1\]=1.0"),
    (lambda w: Lion([w], betas=(0.9,)), "betas must be a pair"),
    (lambda w: Lion([w], weight_decay=-0.1), "invalid weight_decay=-0.1"),
    (lambda w: Lion([w], decouple_lr=True, max_lr=0.0), "invalid max_lr=0.0"),
    (lambda w: Lion([w], decouple_lr="yes"), "decouple_lr must be True or False"),
    (lambda w: StableAdamW([w], eps=-1e-6), "invalid eps=-1e-06"),
    (lambda w: StableAdamW([w], betas=(-0.1, 0.99)), r"invalid betas\[0\]=-0.1"),
    (lambda w: StableAdamW([w], lr=-1.0), "invalid lr=-1.0"),
    (lambda w: StableAdamW([w], weight_decay=-1.0), "invalid weight_decay=-1.0"),
    (lambda w: StableAdamW([w], decouple_lr=True, max_lr=-1.0), "invalid max_lr=-1.0"),
    (lambda w: StableAdamW([w], differentiable=True), "differentiable=True"),
]


@pytest.mark.parametrize(("make", "match"), BAD)
def test_bad_hyperparameters_are_refused(make, match):
    with pytest.raises(ValueError, match=match):
        make(torch.zeros(3, requires_grad=True))


def test_a_bad_value_set_later_is_refused_before_anything_changes():
    w = torch.ones(3, requires_grad=True)
    opt = StableAdamW([w])
    opt.param_groups[0]["betas"] = (0.9, 1.5)
    w.grad = torch.ones(3)
    with pytest.raises(ValueError, match=r"parameter group 0: invalid betas\[1\]=1.5"):
        opt.step()
    assert torch.equal(w.detach(), torch.ones(3)) and not opt.state[w]
