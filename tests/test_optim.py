"""lowprec.optim against trusted references: torch.optim, FP32 runs, the split encoding.

Tests that take ``device`` make their parameters there (the CPU, and CUDA where present: the
``device`` fixture); gradients and initial values are drawn on the CPU and moved, so every device
sees the same numbers. A reference runs on the same device as the run it is compared with
(``torch.optim`` with ``foreach=False``, its for-loop implementation, as on the CPU); the
bit-for-bit claims (split == FP32, resumed == uninterrupted, chunked == one pass) compare two runs
on one device.
"""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch

from lowprec.numerics import join, split
from lowprec.optim import SGD, Adagrad, AdamW, Lamb, master_state_dict
from tests.reference.lamb import ReferenceLamb

# ----------------------------------------------------------------------------------- helpers

SHAPES = [(33, 17), (64,), (5, 3, 4), (1,)]


def make_params(dtype=torch.float32, shapes=SHAPES, scale=1.0, device="cpu"):
    return [(torch.randn(s) * scale).to(dtype).to(device).requires_grad_() for s in shapes]


def grad_sequence(shapes, steps, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=g).to(dtype) for s in shapes] for _ in range(steps)]


def feed(params, grads):
    for p, g in zip(params, grads, strict=True):
        p.grad = g.to(p.dtype).to(p.device).clone()


def run(opt, params, seq):
    for grads in seq:
        feed(params, grads)
        opt.step()


def assert_rel_close(actual, expected, rel=1e-6):
    """Relative closeness at the tensor's scale: the norm-wise relative error and every element's
    error measured against the largest magnitude (an element near zero after a random walk has no
    meaningful relative error of its own)."""
    actual, expected = actual.detach().cpu().double(), expected.detach().cpu().double()
    scale = expected.abs().max().clamp_min(1e-30)
    norm_err = ((actual - expected).norm() / expected.norm().clamp_min(1e-30)).item()
    max_err = ((actual - expected).abs().max() / scale).item()
    assert norm_err <= rel and max_err <= rel, (norm_err, max_err)


def state_bytes(opt, params):
    """Bytes per parameter element: the params, their grads and every state tensor but 'step'."""
    total = 0
    for p in params:
        total += p.numel() * p.element_size()
        if p.grad is not None:
            total += p.grad.numel() * p.grad.element_size()
        for k, v in opt.state[p].items():
            if isinstance(v, torch.Tensor) and k != "step":
                total += v.numel() * v.element_size()
    return total / sum(p.numel() for p in params)


# ------------------------------------------------------------- master="none" == torch.optim

SGD_CASES = [
    dict(lr=0.1),
    dict(lr=0.05, momentum=0.9),
    dict(lr=0.05, momentum=0.9, dampening=0.3),
    dict(lr=0.05, momentum=0.9, nesterov=True),
    dict(lr=0.05, momentum=0.5, weight_decay=0.1),
    dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01, maximize=True),
]
ADAMW_CASES = [
    dict(),
    dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6),
    dict(lr=1e-2, weight_decay=0.0),
    dict(lr=1e-2, weight_decay=0.3),
    dict(lr=1e-2, amsgrad=True),
    dict(lr=3e-3, amsgrad=True, maximize=True, weight_decay=0.05),
]
ADAGRAD_CASES = [
    dict(),
    dict(lr=0.1, lr_decay=0.01),
    dict(lr=0.05, weight_decay=0.1, initial_accumulator_value=0.5),
    dict(lr=0.05, eps=1e-6, maximize=True),
]
CASES = (
    [(SGD, torch.optim.SGD, kw) for kw in SGD_CASES]
    + [(AdamW, torch.optim.AdamW, kw) for kw in ADAMW_CASES]
    + [(Adagrad, torch.optim.Adagrad, kw) for kw in ADAGRAD_CASES]
)


@pytest.mark.parametrize(("ours", "ref", "kw"), CASES, ids=lambda v: getattr(v, "__name__", v))
def test_none_on_fp32_matches_torch(ours, ref, kw, device):
    params = make_params(device=device)
    ref_params = [p.detach().clone().requires_grad_() for p in params]
    opt = ours(params, master="none", **kw)
    ref_opt = ref(ref_params, foreach=False, **kw)
    for grads in grad_sequence(SHAPES, 100):
        feed(params, grads)
        feed(ref_params, grads)
        opt.step()
        ref_opt.step()
    for p, q in zip(params, ref_params, strict=True):
        assert_rel_close(p, q)


LAMB_CASES = [
    dict(lr=1e-2),
    dict(lr=1e-2, betas=(0.8, 0.95), eps=1e-8),
    dict(lr=5e-3, weight_decay=0.1),
]


@pytest.mark.parametrize("kw", LAMB_CASES)
def test_lamb_none_on_fp32_matches_the_paper(kw, device):
    params = make_params(device=device)
    ref = ReferenceLamb([p.cpu() for p in params], **kw)  # (FP64, on the CPU)
    opt = Lamb(params, master="none", **kw)
    for grads in grad_sequence(SHAPES, 100):
        feed(params, grads)
        opt.step()
        ref.step(grads)
    for p, w in zip(params, ref.w, strict=True):
        torch.testing.assert_close(p.detach().cpu().double(), w, rtol=2e-5, atol=1e-6)


def test_lamb_trust_ratio_is_one_for_zero_norms(device):
    w = torch.zeros(10, device=device, requires_grad=True)  # ||w|| = 0: the step is lr * u
    opt = Lamb([w], lr=0.1)
    w.grad = torch.ones(10, device=device)
    opt.step()  # m_hat = 1, v_hat = 1: u = 1 / (1 + eps)
    torch.testing.assert_close(w.detach().cpu(), torch.full((10,), -0.1 / (1 + 1e-6)))
    # ||u|| = 0 (zero gradient, no decay): nothing moves
    z = torch.ones(4, device=device, requires_grad=True)
    opt = Lamb([z], lr=0.1)
    z.grad = torch.zeros(4, device=device)
    opt.step()
    assert torch.equal(z.detach().cpu(), torch.ones(4))


@pytest.mark.parametrize(
    ("ours", "ref", "kw"), [CASES[1], CASES[len(SGD_CASES) + 4], CASES[-3]],
    ids=["sgd", "adamw", "adagrad"],
)
def test_param_groups_and_scheduler_match_torch(ours, ref, kw, device):
    a, b = make_params(shapes=[(10, 10)], device=device), make_params(shapes=[(7,)], device=device)
    ra, rb = ([p.detach().clone().requires_grad_() for p in ps] for ps in (a, b))
    opt = ours([{"params": a}, {"params": b, "lr": 0.01}], **kw)
    ref_opt = ref([{"params": ra}, {"params": rb, "lr": 0.01}], foreach=False, **kw)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=5, gamma=0.5)
    for grads in grad_sequence([(10, 10), (7,)], 20):
        feed(a + b, grads)
        feed(ra + rb, grads)
        opt.step()
        ref_opt.step()
        sched.step()
        ref_sched.step()
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]
    for p, q in zip(a + b, ra + rb, strict=True):
        assert_rel_close(p, q)


def test_closure_zero_grad_add_param_group(device):
    w = torch.randn(8).to(device).requires_grad_()
    opt = SGD([w], lr=0.1)

    def closure():
        opt.zero_grad()
        loss = (w**2).sum()
        loss.backward()
        return loss

    before = w.detach().clone()
    loss = opt.step(closure)
    assert torch.equal(loss, (before**2).sum())
    torch.testing.assert_close(w.detach(), before * 0.8)
    opt.zero_grad()
    assert w.grad is None
    extra = torch.randn(3, dtype=torch.bfloat16).to(device).requires_grad_()
    opt.add_param_group({"params": [extra], "lr": 1.0})
    extra.grad = torch.ones(3, dtype=torch.bfloat16, device=device)
    opt.step()
    assert "compensation" in opt.state[extra]  # "auto" on bf16 -> kahan
    assert opt.param_groups[1]["master"] == "auto"


def test_params_without_grad_are_skipped_and_zero_size_works(device):
    a, b, empty = (torch.randn(4).to(device).requires_grad_(),
                   torch.randn(4).to(device).requires_grad_(),
                   torch.randn(0, dtype=torch.bfloat16).to(device).requires_grad_())
    opt = AdamW([a, b, empty])
    a.grad = torch.ones(4, device=device)
    empty.grad = torch.zeros(0, dtype=torch.bfloat16, device=device)
    b0 = b.detach().clone()
    opt.step()
    assert torch.equal(b, b0) and not opt.state[b]
    assert opt.state[empty]["step"].item() == 1.0


# --------------------------------------------------------------- split == FP32, bit for bit


SPLIT_CASES = [
    (Adagrad, dict(lr=0.05, lr_decay=0.01, weight_decay=0.01)),
    (Lamb, dict(lr=1e-3, weight_decay=0.01)),
    (SGD, dict(lr=0.05, momentum=0.9, weight_decay=0.01)),
    (SGD, dict(lr=0.01, momentum=0.9, nesterov=True, maximize=True)),
    (AdamW, dict(lr=1e-3, weight_decay=0.1)),
    (AdamW, dict(lr=1e-3, amsgrad=True)),
]


@pytest.mark.parametrize(("cls", "kw"), SPLIT_CASES)
def test_split_equals_fp32_bit_for_bit(cls, kw, device):
    shapes = [(40, 30), (30,)]
    bf = make_params(torch.bfloat16, shapes, device=device)
    fp = [p.detach().float().requires_grad_() for p in bf]  # same starting values
    opt_bf = cls(bf, master="split", **kw)
    opt_fp = cls(fp, master="none", **kw)
    # Gradients a BF16 backward could produce, fed identically to both runs.
    for grads in grad_sequence(shapes, 200, dtype=torch.bfloat16):
        feed(bf, grads)
        feed(fp, [g.float() for g in grads])
        opt_bf.step()
        opt_fp.step()
    for pb, pf in zip(bf, fp, strict=True):
        master = opt_bf.master_weight(pb)
        assert torch.equal(master.view(torch.int32), pf.detach().view(torch.int32))
        assert torch.equal(join(pb.detach(), opt_bf.state[pb]["trail"]), pf.detach())
        # The BF16 weights forward sees are the master rounded to nearest (split's tie rule)...
        assert torch.equal(pb.detach().view(torch.int16), split(pf.detach())[0].view(torch.int16))
        # ...which is torch's round-to-nearest-even except at exact ties.
        ties = (pf.detach().view(torch.int32) & 0xFFFF) == 0x8000
        assert torch.equal(pb.detach()[~ties], pf.detach().to(torch.bfloat16)[~ties])


# ------------------------------------------------- small updates: compensation vs round-to-nearest

STRATEGIES = ["none", "kahan", "stochastic", "fp32", "split"]


def _small_update_errors(cls, kw, steps=1000, device="cpu"):
    """Relative error of each strategy's final master weights against an FP32 run, where every
    update is far below half a BF16 ulp: |w| in [1, 2] (half-ulp 2**-8 ~ 4e-3) and
    lr * |g| ~ 1e-4, with gradients drifting one way (mean 1) so the weights move steadily."""
    shape = (256, 64)
    sign = torch.randint(0, 2, shape) * 2 - 1
    init = [((torch.rand(shape) + 1) * sign).to(torch.bfloat16).to(device).requires_grad_()]
    gen = torch.Generator().manual_seed(7)
    seq = [[(1 + 0.5 * torch.randn(shape, generator=gen)).to(torch.bfloat16)]
           for _ in range(steps)]
    ref = [p.detach().float().requires_grad_() for p in init]
    # Stepped eagerly (fused=False): the property is the strategy's, and 1,000 steps of each
    # strategy's compiled step cost minutes of compiling here; tests/test_fused.py checks that
    # the compiled step is the eager one bit for bit, for each optimizer and strategy.
    run(cls(ref, master="none", fused=False, **kw), ref, seq)
    moved = (ref[0].detach() - init[0].detach().float()).norm()
    errors = {}
    for master in STRATEGIES:
        params = [p.detach().clone().requires_grad_() for p in init]
        opt = cls(params, master=master, seed=3, fused=False, **kw)
        run(opt, params, seq)
        errors[master] = ((opt.master_weight(params[0]) - ref[0].detach()).norm() / moved).item()
    return errors


@pytest.mark.parametrize(
    ("cls", "kw"),
    [(SGD, dict(lr=1e-4, momentum=0.0)), (AdamW, dict(lr=1e-4, weight_decay=0.0)),
     (Adagrad, dict(lr=1e-3)), (Lamb, dict(lr=1e-4))],
    ids=["sgd", "adamw", "adagrad", "lamb"],
)
def test_compensated_strategies_follow_fp32_where_nearest_loses_updates(cls, kw, device):
    err = _small_update_errors(cls, kw, device=device)
    # Measured (SGD / AdamW / Adagrad / LAMB): none 1.0 for all (every update rounded away);
    # fp32 and split 0.0 (bit-exact masters); kahan 0.001 / 0.022 / 0.034 / 0.006; stochastic
    # 0.28 / 0.30 / 0.38 / 0.23 (unbiased, but every step adds rounding noise that averages out
    # only as 1/sqrt(steps)). Asserted with margin:
    assert err["none"] > 0.99, err
    assert err["fp32"] == 0.0 and err["split"] == 0.0, err
    assert err["kahan"] < err["none"] / 20, err
    assert err["stochastic"] < err["none"] / 2.5, err


DECAY_CASES = [  # (optimizer, options, decay factor per step with zero gradients)
    (SGD, dict(lr=1e-3, weight_decay=0.1), 1 - 1e-4),
    (AdamW, dict(lr=1e-3, weight_decay=0.1), 1 - 1e-4),
    (Lamb, dict(lr=1e-4, weight_decay=0.1), 1 - 1e-4),  # u = wd * w, ratio = 1 / wd
]


@pytest.mark.parametrize(("cls", "kw", "factor"), DECAY_CASES, ids=["sgd", "adamw", "lamb"])
@pytest.mark.parametrize("master", ["kahan", "fp32", "split", "stochastic"])
def test_weight_decay_below_half_ulp_still_acts(cls, kw, factor, master, device):
    # Decay alone: 1e-4 of the weight per step, far below a BF16 half-ulp (2**-9 relative).
    steps = 1000
    w = (torch.rand(4096) + 1.0).to(torch.bfloat16).to(device).requires_grad_()  # |w| in [1, 2]
    w0 = w.detach().float().clone()
    # (eagerly, as in _small_update_errors: the compiled step is the eager one, test_fused.py)
    opt = cls([w], master=master, seed=11, fused=False, **kw)
    naive = w.detach().clone().requires_grad_()
    opt_naive = cls([naive], master="none", fused=False, **kw)
    for _ in range(steps):
        w.grad = torch.zeros_like(w)
        naive.grad = torch.zeros_like(naive)
        opt.step()
        opt_naive.step()
    expected = w0 * factor**steps  # about 0.905 * w0
    assert torch.equal(naive.detach().float(), w0), "round-to-nearest should lose the decay"
    ratio = (opt.master_weight(w) / expected).mean().item()
    assert abs(ratio - 1) < 2e-3, ratio
    ratio_bf16 = (w.detach().float() / expected).mean().item()
    assert abs(ratio_bf16 - 1) < 4e-3, ratio_bf16


# --------------------------------------------------------------------------- memory table


@pytest.mark.parametrize(
    ("dtype", "master", "state_dtype", "expected"),
    [
        (torch.float32, "none", None, 16),
        (torch.bfloat16, "fp32", None, 16),
        (torch.bfloat16, "kahan", None, 10),
        (torch.bfloat16, "auto", None, 10),
        (torch.bfloat16, "none", None, 8),
        (torch.bfloat16, "stochastic", None, 8),
        (torch.bfloat16, "split", None, 14),
        (torch.bfloat16, "split", torch.bfloat16, 10),
        (torch.float16, "fp32", None, 16),
        (torch.float16, "kahan", None, 10),
    ],
)
@pytest.mark.parametrize("cls", [AdamW, Lamb])
def test_adam_family_bytes_per_param(cls, dtype, master, state_dtype, expected, device):
    params = make_params(dtype, [(128, 64), (64,)], device=device)
    opt = cls(params, master=master, state_dtype=state_dtype)
    feed(params, grad_sequence([(128, 64), (64,)], 1)[0])
    opt.step()
    assert state_bytes(opt, params) == expected


@pytest.mark.parametrize(
    ("cls", "kw"), [(SGD, dict(lr=0.1, momentum=0.9)), (Adagrad, dict())], ids=["sgd", "adagrad"]
)
def test_one_buffer_optimizers_bytes_per_param(cls, kw, device):
    params = make_params(torch.bfloat16, [(128, 64)], device=device)
    cases = {"none": 6, "kahan": 8, "split": 10, "fp32": 12, "stochastic": 6}
    for master, expected in cases.items():
        ps = [p.detach().clone().requires_grad_() for p in params]
        opt = cls(ps, master=master, **kw)
        feed(ps, grad_sequence([(128, 64)], 1)[0])
        opt.step()
        assert state_bytes(opt, ps) == expected, master


def test_auto_resolution_and_mixed_dtypes_in_one_group(device):
    w16, w32 = torch.randn(8, dtype=torch.bfloat16).to(device), torch.randn(8).to(device)
    w16.requires_grad_(), w32.requires_grad_()
    opt = AdamW([w16, w32], master="kahan")
    w16.grad, w32.grad = torch.ones_like(w16), torch.ones_like(w32)
    opt.step()
    assert opt.state[w16]["master"] == "kahan" and "compensation" in opt.state[w16]
    assert opt.state[w32]["master"] == "none" and "compensation" not in opt.state[w32]
    assert opt.state[w16]["exp_avg"].dtype == torch.bfloat16
    assert opt.state[w32]["exp_avg"].dtype == torch.float32


# ------------------------------------------------------------------- master values and export


@pytest.mark.parametrize("master", STRATEGIES)
def test_master_weight_and_export(master, device):
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5)).to(torch.bfloat16)
    model.to(device)
    model[1].float()  # a layer kept in FP32
    # (every strategy, split too, leaves the FP32 layer plain in the same group)
    opt = AdamW(model.parameters(), lr=1e-2, master=master)
    for _ in range(3):
        opt.zero_grad()
        x = torch.randn(4, 6, dtype=torch.bfloat16).to(device)
        # (the FP32 layer takes FP32 input: CUDA's layer_norm wants one dtype for both)
        model[1](model[0](x).float()).sum().backward()
        opt.step()
    w = model[0].weight
    mw = opt.master_weight(w)
    assert mw.dtype == torch.float32
    st = opt.state[w]
    expected = {
        "none": w.detach().float(),
        "stochastic": w.detach().float(),
        "kahan": w.detach().float() + st.get("compensation", torch.zeros((), device=device)).float(),
        "fp32": st.get("master_weight"),
        "split": join(w.detach(), st["trail"]) if "trail" in st else None,
    }[master]
    assert torch.equal(mw, expected)
    exported = master_state_dict(model, opt)
    assert set(exported) == set(model.state_dict())
    assert all(v.dtype == torch.float32 for v in exported.values())
    assert torch.equal(exported["0.weight"], mw)
    assert torch.equal(exported["1.weight"], model[1].weight.detach())
    # Before any step the master is the parameter itself.
    fresh = torch.randn(3, dtype=torch.bfloat16).to(device).requires_grad_()
    assert torch.equal(AdamW([fresh]).master_weight(fresh), fresh.detach().float())


def test_export_names_every_tie_of_a_tied_weight(device):
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(11, 6)
            self.head = torch.nn.Linear(6, 11, bias=False)
            self.head.weight = self.emb.weight  # GPT-2's lm_head / wte

        def forward(self, ids):
            return self.head(self.emb(ids))

    model = Tied().to(torch.bfloat16).to(device)
    opt = AdamW(model.parameters(), lr=1e-2, master="split")
    for _ in range(3):
        opt.zero_grad()
        model(torch.randint(0, 11, (4, 5)).to(device)).float().sum().backward()
        opt.step()
    master = opt.master_weight(model.emb.weight)
    assert not torch.equal(master, model.emb.weight.detach().float())  # the trail holds bits
    exported = master_state_dict(model, opt)
    assert torch.equal(exported["emb.weight"], master)
    assert torch.equal(exported["head.weight"], master)

    class Wrapper:  # as Accelerate's AcceleratedOptimizer (HF Trainer's trainer.optimizer)
        def __init__(self, optimizer):
            self.optimizer = optimizer

    wrapped = master_state_dict(model, Wrapper(Wrapper(opt)))
    assert wrapped.keys() == exported.keys()
    assert all(torch.equal(wrapped[k], exported[k]) for k in exported)
    with pytest.raises(TypeError, match="needs a lowprec optimizer"):
        master_state_dict(model, torch.optim.SGD(model.parameters(), lr=0.1))


# --------------------------------------------------------------------------- checkpoints

RESUME_CASES = [
    (cls, dtype, master, kw)
    for cls, kw in [(SGD, dict(lr=0.05, momentum=0.9, weight_decay=1e-3)),
                    (AdamW, dict(lr=1e-3, amsgrad=True)),
                    (Adagrad, dict(lr=1e-2, lr_decay=1e-3)),
                    (Lamb, dict(lr=1e-3, weight_decay=0.01))]
    for dtype, master in [
        (torch.float32, "none"), (torch.bfloat16, "none"), (torch.bfloat16, "kahan"),
        (torch.bfloat16, "split"), (torch.bfloat16, "stochastic"), (torch.bfloat16, "fp32"),
        (torch.float16, "kahan"), (torch.float16, "fp32"), (torch.float16, "stochastic"),
    ]
]


def _bits(t):
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


@pytest.mark.parametrize(("cls", "dtype", "master", "kw"), RESUME_CASES)
def test_save_load_resumes_bit_for_bit_and_keeps_dtypes(cls, dtype, master, kw, device):
    shapes = [(20, 10), (10,)]
    seq = grad_sequence(shapes, 30, seed=5)
    params = make_params(dtype, shapes, device=device)
    init = [p.detach().clone() for p in params]
    opt = cls(params, master=master, seed=99, **kw)
    run(opt, params, seq)  # uninterrupted reference

    resumed = [p.clone().requires_grad_() for p in init]
    opt1 = cls(resumed, master=master, seed=99, **kw)
    run(opt1, resumed, seq[:12])
    buf = io.BytesIO()
    torch.save({"model": [p.detach() for p in resumed], "opt": opt1.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    fresh = [p.clone().requires_grad_() for p in ckpt["model"]]
    opt2 = cls(fresh, master=master, **kw)  # seed comes from the checkpoint
    opt2.load_state_dict(ckpt["opt"])
    for p, q in zip(resumed, fresh, strict=True):
        for k, v in opt1.state[p].items():
            if isinstance(v, torch.Tensor):
                assert opt2.state[q][k].dtype == v.dtype, k
    run(opt2, fresh, seq[12:])
    for p, q in zip(params, fresh, strict=True):
        assert torch.equal(_bits(p), _bits(q))
        for k, v in opt.state[p].items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(_bits(v), _bits(opt2.state[q][k])), k


def test_torch_default_load_would_round_the_state(device):
    """Guards the reason for our override: torch casts state to the param dtype."""
    p = torch.randn(16, dtype=torch.bfloat16).to(device).requires_grad_()
    opt = AdamW([p], master="fp32")
    p.grad = torch.randn(16, dtype=torch.bfloat16).to(device)
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    q = p.detach().clone().requires_grad_()
    plain = torch.optim.AdamW([q])
    torch.optim.Optimizer.load_state_dict(plain, sd)
    assert plain.state[q]["master_weight"].dtype == torch.bfloat16
    ours = AdamW([q], master="fp32")
    ours.load_state_dict(sd)
    assert ours.state[q]["master_weight"].dtype == torch.float32


def test_resume_in_a_new_process(tmp_path, device):
    """A run saved at step N and resumed in a fresh interpreter continues bit for bit."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        """
        import sys, torch
        from lowprec.optim import SGD, Adagrad, AdamW, Lamb
        mode, path, device = sys.argv[1], sys.argv[2], sys.argv[3]
        torch.manual_seed(0)
        seq = [torch.randn(64, 32).to(device) for _ in range(20)]
        out = {}
        for name, cls in [("sgd", SGD), ("adamw", AdamW), ("adagrad", Adagrad), ("lamb", Lamb)]:
            for master in ["none", "kahan", "split", "stochastic", "fp32"]:
                key = f"{name}-{master}"
                w = torch.linspace(-1, 1, 64 * 32).reshape(64, 32).bfloat16().to(device)
                w.requires_grad_()
                kw = dict(lr=1e-3, master=master, seed=5)
                if name == "sgd":
                    kw["momentum"] = 0.9
                opt = cls([w], **kw)
                start, stop = {"full": (0, 20), "first": (0, 10), "second": (10, 20)}[mode]
                if mode == "second":
                    ck = torch.load(path + key, weights_only=True)
                    w.data.copy_(ck["w"])
                    opt.load_state_dict(ck["opt"])
                for g in seq[start:stop]:
                    w.grad = g.bfloat16()
                    opt.step()
                if mode == "first":
                    torch.save({"w": w.detach(), "opt": opt.state_dict()}, path + key)
                out[key] = w.detach().clone()
        if mode != "first":
            torch.save(out, path + mode)
        """
    )
    f = tmp_path / "resume.py"
    f.write_text(script)
    prefix = str(tmp_path / "ck-")
    for mode in ("full", "first", "second"):
        subprocess.run([sys.executable, str(f), mode, prefix, device], check=True, timeout=300)
    full = torch.load(prefix + "full", weights_only=True)
    second = torch.load(prefix + "second", weights_only=True)
    assert full.keys() == second.keys() and len(full) == 20
    for key in full:
        assert torch.equal(_bits(full[key]), _bits(second[key])), key


# ------------------------------------------------------------------- stochastic determinism


def test_stochastic_is_reproducible_and_seeded(device):
    def train(seed, manual=None):
        if manual is not None:
            torch.manual_seed(manual)
        w = torch.linspace(-1, 1, 1000).bfloat16().to(device).requires_grad_()
        opt = SGD([w], lr=1e-4, master="stochastic", seed=seed)
        for i in range(20):
            w.grad = torch.full_like(w, 1.0 + i / 20)
            opt.step()
        return w.detach()

    assert torch.equal(train(1), train(1))
    assert not torch.equal(train(1), train(2))
    # seed=None takes torch.initial_seed(): reproducible under torch.manual_seed.
    assert torch.equal(train(None, manual=42), train(None, manual=42))
    assert not torch.equal(train(None, manual=42), train(None, manual=43))


# ------------------------------------------------------------------------------ bad input

def _z(d, dtype=torch.float32, *, grad=True, n=3):
    """Zeros on device ``d``: a parameter of the construction table below."""
    return torch.zeros(n, dtype=dtype, device=d, requires_grad=grad)


BAD_CONSTRUCTION = [
    (lambda d: SGD([_z(d, torch.int64, grad=False)]), TypeError, "floating-point"),
    (lambda d: SGD([_z(d, torch.complex64, grad=False)]), TypeError, "floating-point"),
    (lambda d: AdamW([_z(d)], differentiable=True), ValueError,
     "does not support differentiable=True"),
    (lambda d: AdamW([_z(d)], capturable="yes"), TypeError,
     "capturable must be a bool or None"),
    (lambda d: SGD([_z(d)], foreach="yes"), TypeError,
     "foreach must be a bool or None"),
    (lambda d: SGD([("w", _z(d)), _z(d, n=2, grad=False)]), ValueError,
     "with/without names"),
    (lambda d: AdamW([_z(d, torch.float16)], master="split"),
     ValueError, "needs bfloat16.*master='fp32'"),
    (lambda d: SGD([_z(d)], master="bf16"), ValueError,
     "unknown master='bf16'; choose one of auto, none"),
    (lambda d: SGD([_z(d)], lr=-1.0), ValueError, "invalid lr=-1.0"),
    (lambda d: SGD([_z(d)], momentum=-0.5), ValueError,
     "invalid momentum"),
    (lambda d: SGD([_z(d)], weight_decay=-1e-4), ValueError,
     "invalid weight_decay"),
    (lambda d: SGD([_z(d)], nesterov=True), ValueError,
     "nesterov=True needs momentum > 0"),
    (lambda d: SGD([_z(d)], lr="0.1"), TypeError, "lr must be a number"),
    (lambda d: AdamW([_z(d)], betas=(1.0, 0.999)), ValueError,
     r"invalid betas\[0\]=1.0"),
    (lambda d: AdamW([_z(d)], betas=(0.9,)), ValueError,
     "betas must be a pair"),
    (lambda d: AdamW([_z(d)], eps=-1.0), ValueError, "invalid eps"),
    (lambda d: Lamb([_z(d)], betas=(0.9, -0.1)), ValueError,
     r"invalid betas\[1\]"),
    (lambda d: Lamb([_z(d, torch.float16)], master="split"),
     ValueError, "needs bfloat16"),
    (lambda d: Adagrad([_z(d)], lr_decay=-1.0), ValueError,
     "invalid lr_decay"),
    (lambda d: Adagrad([_z(d)], initial_accumulator_value=-1.0),
     ValueError, "invalid initial_accumulator_value"),
    (lambda d: AdamW([_z(d)], state_dtype=torch.int8), ValueError,
     "state_dtype must be"),
    (lambda d: AdamW([_z(d)], seed=-3), ValueError, "seed must be"),
    (lambda d: SGD([_z(d)] * 2), ValueError, "appears twice"),
    (lambda d: SGD({_z(d)}), TypeError, "not a set"),
    (lambda d: SGD([_z(d), torch.zeros(3, device="meta")]),
     ValueError, "mixes devices"),
]


@pytest.mark.parametrize(("make", "exc", "match"), BAD_CONSTRUCTION)
def test_bad_construction(make, exc, match, device):
    with pytest.raises(exc, match=match):
        make(device)


def test_same_param_in_two_groups_and_bad_add_param_group_leaves_optimizer_unchanged(device):
    p = _z(device)
    with pytest.raises(ValueError, match="more than one parameter group"):
        SGD([{"params": [p]}, {"params": [p]}])
    opt = SGD([p])
    with pytest.raises(ValueError, match="invalid lr"):
        opt.add_param_group({"params": [_z(device, n=2)], "lr": -1})
    assert len(opt.param_groups) == 1


def _trained_pair(master="kahan", device="cpu"):
    a = torch.randn(6, dtype=torch.bfloat16).to(device).requires_grad_()
    b = torch.randn(6, dtype=torch.bfloat16).to(device).requires_grad_()
    opt = AdamW([a, b], lr=1e-2, master=master)
    a.grad, b.grad = torch.randn_like(a), torch.randn_like(b)
    opt.step()
    return opt, a, b


def _snapshot(opt, params):
    return [p.detach().clone() for p in params], copy.deepcopy(opt.state_dict()["state"])


def _same(snapshot, opt, params):
    ps, state = snapshot
    assert all(torch.equal(p, q) for p, q in zip(ps, params, strict=True))
    now = opt.state_dict()["state"]
    for i, st in state.items():
        for k, v in st.items():
            assert torch.equal(v, now[i][k]) if isinstance(v, torch.Tensor) else v == now[i][k]


BAD_STEP = [
    ("sparse", lambda opt, a, b: setattr(b, "grad", torch.zeros_like(b).to_sparse()), ValueError,
     "sparse gradients"),
    ("lr", lambda opt, a, b: opt.param_groups[0].update(lr=-0.1), ValueError, "invalid lr"),
    ("master changed", lambda opt, a, b: opt.param_groups[0].update(master="split"),
     ValueError, "state was created with master='kahan'"),
    ("state tampered", lambda opt, a, b: opt.state[b].update(
        exp_avg=torch.zeros_like(b, dtype=torch.float32)), ValueError, "state 'exp_avg' should be"),
]


@pytest.mark.parametrize(("name", "spoil", "exc", "match"), BAD_STEP, ids=[c[0] for c in BAD_STEP])
def test_step_that_raises_changes_nothing(name, spoil, exc, match, device):
    opt, a, b = _trained_pair(device=device)
    a.grad = torch.randn_like(a)
    b.grad = torch.randn_like(b)
    spoil(opt, a, b)
    snap = _snapshot(opt, [a, b])
    with pytest.raises(exc, match=match):
        opt.step()
    _same(snap, opt, [a, b])


BAD_LOAD = [
    ("groups", lambda sd: sd["param_groups"].append(dict(sd["param_groups"][0], params=[9])),
     "parameter groups"),
    ("group size", lambda sd: sd["param_groups"][0]["params"].pop(), "has 2 parameters"),
    ("trail for kahan", lambda sd: sd["state"][0].update(master="split"),
     "saved with master='split', whose 'trail' should be"),
    ("unknown master", lambda sd: sd["state"][0].update(master="fp8"),
     "saved with master='fp8', which lowprec does not know"),
    ("wrong dtype", lambda sd: sd["state"][1].update(
        compensation=sd["state"][1]["compensation"].new_zeros(6, dtype=torch.float32)),
     "should be a"),
    ("bad lr", lambda sd: sd["param_groups"][0].update(lr=-5.0), "invalid lr"),
]


@pytest.mark.parametrize(("name", "spoil", "match"), BAD_LOAD, ids=[c[0] for c in BAD_LOAD])
def test_bad_checkpoint_is_rejected_before_anything_changes(name, spoil, match, device):
    opt, a, b = _trained_pair(device=device)
    sd = copy.deepcopy(opt.state_dict())
    spoil(sd)
    snap = _snapshot(opt, [a, b])
    lr = opt.param_groups[0]["lr"]
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(sd)
    _same(snap, opt, [a, b])
    assert opt.param_groups[0]["lr"] == lr


STRATEGIES = ("none", "fp32", "split", "kahan", "stochastic")


@pytest.mark.parametrize("new", STRATEGIES)
@pytest.mark.parametrize("old", STRATEGIES)
def test_a_checkpoint_of_another_master_strategy_is_converted(old, new, device):
    # A checkpoint saved under one master= strategy, loaded by an optimizer given another: the
    # FP32 master is rebuilt and stored the new way, exactly where the new way holds FP32
    # (fp32, split), to the compensation's precision for kahan, rounded to nearest for none and
    # stochastic; the moments take the new strategy's state dtype, the hyperparameters and
    # counts the checkpoint's. Then it steps as an optimizer of the new strategy would from
    # that state.
    shapes = [(33, 17), (64,)]
    seq = grad_sequence(shapes, 14, seed=3)
    params = make_params(torch.bfloat16, shapes, device=device)
    saved_opt = AdamW(params, lr=3e-2, weight_decay=0.1, master=old, seed=7)
    run(saved_opt, params, seq[:6])
    masters = [saved_opt.master_weight(p) for p in params]
    saved = copy.deepcopy(saved_opt.state_dict())

    fresh = [p.detach().clone().requires_grad_() for p in params]  # (the model loaded first)
    opt = AdamW(fresh, lr=1.0, master=new)
    opt.load_state_dict(saved)
    group = opt.param_groups[0]
    assert group["master"] == new and group["lr"] == 3e-2 and group["seed"] == 7
    for p, q, w in zip(params, fresh, masters, strict=True):
        st = opt.state[q]
        assert st["master"] == new and float(st["step"]) == 6.0
        assert st["exp_avg"].dtype == (torch.float32 if new in ("fp32", "split") else q.dtype)
        assert torch.equal(st["exp_avg"], saved_opt.state[p]["exp_avg"].to(st["exp_avg"].dtype))
        got = opt.master_weight(q)
        if new in ("fp32", "split") or old in ("none", "stochastic"):
            assert torch.equal(got, w)
        elif new == "kahan":  # (16 significant bits: within 2**-16 of the value)
            assert ((got - w).abs() <= w.abs() * 2.0**-16).all()
        else:
            assert torch.equal(got, w.to(q.dtype).float())
        if new in ("none", "stochastic", "fp32"):  # (the parameter: the master's rounding)
            assert torch.equal(q.detach(), got.to(q.dtype))
    # The converted state steps as the new strategy's own state would.
    ref = [q.detach().clone().requires_grad_() for q in fresh]
    ref_opt = AdamW(ref, lr=1.0, master=new)
    ref_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    run(opt, fresh, seq[6:])
    run(ref_opt, ref, seq[6:])
    for q, r in zip(fresh, ref, strict=True):
        assert torch.equal(_bits(q), _bits(r))
        assert torch.equal(opt.master_weight(q), ref_opt.master_weight(r))


def test_a_split_run_resumed_as_fp32_continues_its_masters_bit_for_bit(device):
    # split and fp32 keep the same FP32 master and FP32 moments, so converting between them
    # loses nothing: the masters go on exactly as the uninterrupted split run's.
    shapes = [(40, 9), (9,)]
    seq = grad_sequence(shapes, 20, seed=11)
    params = make_params(torch.bfloat16, shapes, device=device)
    straight = [p.detach().clone().requires_grad_() for p in params]
    straight_opt = SGD(straight, lr=0.1, momentum=0.9, master="split")
    run(straight_opt, straight, seq)
    first = SGD(params, lr=0.1, momentum=0.9, master="split")
    run(first, params, seq[:8])
    second = SGD(params, lr=0.5, master="fp32")
    second.load_state_dict(copy.deepcopy(first.state_dict()))
    run(second, params, seq[8:])
    for p, q in zip(straight, params, strict=True):
        assert torch.equal(straight_opt.master_weight(p), second.master_weight(q))


def test_an_optimizer_left_at_auto_keeps_the_checkpoints_master(device):
    # master="auto" (the default) takes the checkpoint's strategy, as before: nothing converted.
    params = make_params(torch.bfloat16, [(8, 3)], device=device)
    opt = AdamW(params, lr=1e-2, master="split")
    run(opt, params, grad_sequence([(8, 3)], 2))
    other = AdamW([p.detach().clone().requires_grad_() for p in params], lr=1e-2)
    other.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert other.param_groups[0]["master"] == "split"
    assert all(st["master"] == "split" for st in other.state.values())


def test_state_dtype_by_name_and_in_a_state_dict(tmp_path):
    # A dtype's name is the dtype (a configuration file's "bfloat16"); a state dict keeps the
    # name, which torch.distributed.checkpoint's full state dict needs (it takes no torch.dtype
    # values: FSDP2's get_optimizer_state_dict(full_state_dict=True) raised on
    # state_dtype=torch.bfloat16), and loads back as the dtype.
    import subprocess
    import sys

    params = make_params(torch.bfloat16, [(8, 3)])
    named = AdamW(params, lr=1e-2, master="kahan", state_dtype="bfloat16")
    assert named.param_groups[0]["state_dtype"] is torch.bfloat16
    run(named, params, grad_sequence([(8, 3)], 2))
    sd = named.state_dict()
    assert sd["param_groups"][0]["state_dtype"] == "bfloat16"
    assert named.param_groups[0]["state_dtype"] is torch.bfloat16  # (the live group as given)
    other = AdamW([p.detach().clone().requires_grad_() for p in params], lr=1e-2)
    other.load_state_dict(copy.deepcopy(sd))
    assert other.param_groups[0]["state_dtype"] is torch.bfloat16
    assert other.state[other.param_groups[0]["params"][0]]["exp_avg"].dtype == torch.bfloat16
    with pytest.raises(ValueError, match="or their names"):
        AdamW(params, lr=1e-2, state_dtype="bf16x")
    code = f"""
import torch, torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import distribute_tensor, Shard
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict)
import lowprec
dist.init_process_group("gloo", init_method="file://{tmp_path}/store", rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
m = nn.Linear(256, 64).bfloat16()
for n, p in list(m.named_parameters()):
    setattr(m, n, nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)])))
opt = lowprec.AdamW(m.parameters(), lr=1e-3, master="kahan", state_dtype=torch.bfloat16)
for p in m.parameters():
    p.grad = distribute_tensor(torch.randn(p.shape).bfloat16(), mesh, [Shard(0)])
opt.step()
full = StateDictOptions(full_state_dict=True)
sd = get_optimizer_state_dict(m, opt, options=full)
set_optimizer_state_dict(m, opt, sd, options=full)
print("full state dict:", sd["param_groups"][0]["state_dtype"], opt.param_groups[0]["state_dtype"])
dist.destroy_process_group()
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert "full state dict: bfloat16 torch.bfloat16" in proc.stdout, proc.stderr


def test_pickle_and_setstate_fill_new_options(device):
    opt, _, _ = _trained_pair(device=device)
    state = opt.__getstate__()
    for g in state["param_groups"]:
        del g["seed"], g["state_dtype"]
    clone = AdamW.__new__(AdamW)
    clone.__setstate__(state)
    assert clone.param_groups[0]["state_dtype"] is None
    assert "seed" in clone.param_groups[0]


def test_lr_as_tensor_and_ints_are_accepted(device):
    w = torch.ones(4, device=device, requires_grad=True)
    opt = SGD([w], lr=torch.tensor(0.5))  # (a CPU tensor, as torch.optim's schedulers keep it)
    w.grad = torch.ones(4, device=device)
    opt.step()
    assert torch.equal(w.detach().cpu(), torch.full((4,), 0.5))
    one = torch.ones(1, device=device, requires_grad=True)
    assert math.isclose(SGD([one], lr=1).param_groups[0]["lr"], 1)


@pytest.mark.parametrize("cls", [SGD, AdamW, Adagrad, Lamb])
@pytest.mark.parametrize("master", STRATEGIES)
def test_chunked_eager_step_equals_one_pass(monkeypatch, cls, master, device):
    """Large tensors go through the eager step in chunks; the result must not change."""
    from lowprec.optim import update

    shapes = [(37, 29), (1000,), (3,)]
    init = make_params(torch.bfloat16, shapes, device=device)
    seq = grad_sequence(shapes, 5, seed=4, dtype=torch.bfloat16)
    results = []
    for chunk in (1 << 40, 64):  # one pass, then chunks of 64 (with a ragged last chunk)
        monkeypatch.setattr(update, "_EAGER_CHUNKS", {"cpu": chunk, "cuda": chunk})
        params = [p.detach().clone().requires_grad_() for p in init]
        opt = cls(params, master=master, seed=9)
        run(opt, params, seq)
        results.append((params, opt))
    (pa, oa), (pb, ob) = results
    for a, b in zip(pa, pb, strict=True):
        assert torch.equal(_bits(a), _bits(b))
        for k, v in oa.state[a].items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(_bits(v), _bits(ob.state[b][k])), k


@pytest.mark.parametrize("master", ["none", "split", "stochastic"])
def test_chunked_lamb_two_passes_under_a_loss_scaler(monkeypatch, master, device):
    """LAMB's chunked eager step (sums first, then the update) under grad_scale/found_inf:
    identical to one pass, and a skipped step (inf gradient) changes nothing."""
    from lowprec.optim import update

    shapes = [(37, 29), (300,)]
    init = make_params(torch.bfloat16, shapes, device=device)
    seq = grad_sequence(shapes, 4, seed=5, dtype=torch.bfloat16)
    seq[2][0][3, 4] = math.inf  # the third step is skipped
    results = []
    calls = []
    for chunk in (1 << 40, 64):
        monkeypatch.setattr(update, "_EAGER_CHUNKS", {"cpu": chunk, "cuda": chunk})
        params = [p.detach().clone().requires_grad_() for p in init]
        opt = Lamb(params, lr=1e-2, weight_decay=0.1, master=master, seed=3)
        opt._norm_terms = lambda *a, chunk=chunk, spy=opt._norm_terms, **k: (
            calls.append(chunk) or spy(*a, **k)
        )
        for grads in seq:
            feed(params, [g * 16 for g in grads])
            opt.step(grad_scale=torch.tensor(16.0, device=device),
                     found_inf=torch.zeros((), device=device))
        results.append((params, opt))
    assert set(calls) == {64}  # only the chunked run sums in a separate pass
    (pa, oa), (pb, ob) = results
    for a, b in zip(pa, pb, strict=True):
        assert torch.equal(_bits(a), _bits(b))
        assert oa.state[a]["step"].item() == 3
        for k, v in oa.state[a].items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(_bits(v), _bits(ob.state[b][k])), k


def test_stochastic_int64_indices_give_the_same_stream(monkeypatch, device):
    """The random bits use int32 element indices where they fit and int64 ones past 2**31 - 1;
    both give the same stream (forced here with a tiny int32 limit)."""
    from lowprec.optim import update

    shapes = [(37, 29), (1000,)]
    init = make_params(torch.bfloat16, shapes, scale=1e-2, device=device)
    seq = grad_sequence(shapes, 4, seed=6, dtype=torch.bfloat16)
    results = []
    for limit in (update._INT32_MAX, 100):
        monkeypatch.setattr(update, "_INT32_MAX", limit)
        monkeypatch.setattr(update, "_EAGER_CHUNKS", {"cpu": 256, "cuda": 256})  # (offsets past it)
        params = [p.detach().clone().requires_grad_() for p in init]
        run(AdamW(params, lr=1e-3, master="stochastic", seed=11), params, seq)
        results.append(params)
    for a, b in zip(*results, strict=True):
        assert torch.equal(_bits(a), _bits(b))


RESUME_FROM_TORCH = [
    (SGD, torch.optim.SGD, dict(lr=0.1)),  # (no momentum: no state to adopt)
    (SGD, torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True)),
    (AdamW, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1, amsgrad=True)),
    (Adagrad, torch.optim.Adagrad, dict(lr=0.05, initial_accumulator_value=0.1)),
]


@pytest.mark.parametrize(("ours", "ref", "kw"), RESUME_FROM_TORCH,
                         ids=lambda v: getattr(v, "__name__", None))
def test_resumes_a_torch_optim_checkpoint(ours, ref, kw, device):
    # A run of torch.optim, saved, goes on with lowprec's optimizer of the same family: the
    # checkpoint's hyperparameters and moments are taken, lowprec's own options (fused here)
    # stay, and the steps after go as torch's own would (as test_none_on_fp32_matches_torch).
    grads = grad_sequence(SHAPES, 10)
    params = make_params(device=device)
    start = [p.detach().clone() for p in params]
    torch_opt = ref(params, foreach=False, **kw)
    for gs in grads[:5]:
        feed(params, gs)
        torch_opt.step()
    saved = copy.deepcopy(torch_opt.state_dict())
    resumed = [p.detach().clone().requires_grad_() for p in params]
    for gs in grads[5:]:
        feed(params, gs)
        torch_opt.step()

    opt = ours(resumed, lr=123.0, fused=False)  # (lr and the rest come from the checkpoint)
    opt.load_state_dict(saved)
    assert opt.param_groups[0]["lr"] == kw["lr"] and opt.param_groups[0]["fused"] is False
    for gs in grads[5:]:
        feed(resumed, gs)
        opt.step()
    for p, q, s in zip(resumed, params, start, strict=True):
        assert not torch.equal(p, s)
        assert_rel_close(p, q)


def test_resuming_a_torch_optim_checkpoint_on_bf16_makes_the_master_fresh(device):
    # BF16 parameters under Kahan: the moments are torch's (in the state dtype), the compensation
    # starts at zero as in a fresh run, the count goes on.
    params = make_params(torch.bfloat16, device=device)
    torch_opt = torch.optim.AdamW(params, lr=1e-2)
    for gs in grad_sequence(SHAPES, 3):
        feed(params, gs)
        torch_opt.step()
    opt = AdamW(params, lr=1e-2, master="kahan")
    opt.load_state_dict(torch_opt.state_dict())
    for p in params:
        st, ref = opt.state[p], torch_opt.state[p]
        assert st["master"] == "kahan" and float(st["step"]) == 3.0
        assert torch.equal(st["exp_avg"], ref["exp_avg"]) and st["exp_avg"] is not ref["exp_avg"]
        assert not st["compensation"].any()
    feed(params, grad_sequence(SHAPES, 1, seed=9)[0])
    opt.step()
    assert all(float(opt.state[p]["step"]) == 4.0 for p in params)


def test_a_torch_checkpoint_of_another_family_is_refused_before_anything_changes(device):
    params = make_params(device=device)
    adam = torch.optim.AdamW(params, lr=1e-2)
    feed(params, grad_sequence(SHAPES, 1)[0])
    adam.step()
    opt = SGD(params, lr=0.1, momentum=0.9)
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=r"holds \['exp_avg', 'exp_avg_sq'\].*momentum_buffer"):
        opt.load_state_dict(adam.state_dict())
    assert opt.state_dict() == before


def test_an_empty_momentum_buffer_of_an_older_torch_sgd_checkpoint_loads(device):
    # Older torch SGD without momentum saved {"momentum_buffer": None} per parameter.
    params = make_params(device=device)
    sd = torch.optim.SGD(params, lr=0.1).state_dict()
    sd["state"] = {i: {"momentum_buffer": None} for i in range(len(params))}
    opt = SGD(params, lr=0.5)
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["lr"] == 0.1
    assert all(float(opt.state[p]["step"]) == 0.0 for p in params)


def test_a_torch_adam_checkpoint_with_l2_decay_is_refused_by_adamw(device):
    # torch.optim.Adam adds its weight decay to the gradient (L2); lowprec.AdamW decays
    # decoupled, so such a checkpoint is refused before anything changes; without decay it loads.
    params = make_params(device=device)
    for decay, loads in ((0.1, False), (0.0, True)):
        adam = torch.optim.Adam(params, lr=1e-2, weight_decay=decay)
        feed(params, grad_sequence(SHAPES, 1)[0])
        adam.step()
        opt = AdamW(params, lr=1e-3)
        if loads:
            opt.load_state_dict(adam.state_dict())
            assert float(opt.state[params[0]]["step"]) == 1.0
            continue
        before = copy.deepcopy(opt.state_dict())
        with pytest.raises(ValueError, match=r"L2 \(decoupled_weight_decay=False"):
            opt.load_state_dict(adam.state_dict())
        assert opt.state_dict() == before


@pytest.mark.parametrize("offset", [0, 1, 2, 65537])
@pytest.mark.parametrize("numel", [0, 1, 2, 5, 4096])
def test_stochastic_bits_of_bf16_elements_are_halves_of_their_pairs_hash(offset, numel, device):
    # Element i of a BF16 parameter takes the low 16 bits of the hash of i // 2 when i is even
    # and the high 16 when odd (what the fused step on pairs uses); the eager step hashes each
    # pair once and interleaves, for any chunk offset and length.
    from lowprec.numerics import hash_bits
    from lowprec.optim.update import _random_bits

    lo, hi = 0x89ABCDEF, 0x01234567
    idx = torch.arange(offset, offset + numel, dtype=torch.int64)
    h = hash_bits(idx // 2, lo, hi).to(torch.int64) & 0xFFFFFFFF
    expected = torch.where(idx % 2 == 0, h & 0xFFFF, h >> 16)
    got = _random_bits(offset, numel, torch.device(device), lo, hi, torch.bfloat16)
    assert got.dtype == torch.int32 and torch.equal(got.cpu().to(torch.int64), expected)
