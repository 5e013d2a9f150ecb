"""Adafactor and Muon, the rules that need each parameter whole, against what users trust.

References: ``torch.optim.Adafactor`` and ``torch.optim.Muon`` over torch's own option matrices
(``torch.testing._internal.common_optimizers``) and their error inputs; an FP32 run (``"split"``
on BF16 is bit-identical to it); the optimizer's own uninterrupted run (checkpoints, conversion
between strategies); torch.optim checkpoints adopted. Both step each parameter eagerly in its
own shape (``LowPrecisionOptimizer._whole``): Adafactor's compiled as one graph where the step
is fused, checked to give the eager bits; Muon's elementwise work around its matmuls likewise.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import lowprec
from lowprec.optim import Adafactor, Muon, compiled, core, muon_param_groups
from tests._cases import pairwise
from tests._same import assert_same, bits
from tests.test_optim import assert_rel_close, feed, grad_sequence
from tests.test_torch_contracts import (
    _CO,
    NO_DATA,
    _check_round_trips,
    _sid,
    fallback_is_an_error,
)
from tests.test_torch_contracts import test_torch_error_inputs as _check_error_input

pytestmark = pytest.mark.filterwarnings("error:lowprec. the fused:RuntimeWarning")

OURS = {torch.optim.Adafactor: Adafactor, torch.optim.Muon: Muon}
# Adafactor factors tensors of 2 or more dimensions and keeps a full variance for vectors; Muon
# takes matrices only (tall, wide and square: the iteration transposes tall ones).
SHAPES = {Adafactor: [(33, 17), (64,), (5, 3, 4), (1,)], Muon: [(33, 17), (16, 40), (8, 8)]}
KW = {Adafactor: {"lr": 1e-2, "weight_decay": 0.01}, Muon: {"lr": 2e-2}}
STRATEGIES = ["none", "fp32", "split", "kahan", "stochastic"]


def _params(cls, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).to(dtype).requires_grad_() for s in SHAPES[cls]]


def _option_sets():
    if _CO is None:
        return [pytest.param(None, None, None, marks=pytest.mark.skipif(_CO is None, reason=NO_DATA))]
    out = []
    for info in _CO.optim_db:
        ours = OURS.get(info.optim_cls)
        for inp in info.optim_inputs_func(device="cpu") if ours else ():
            out.append(pytest.param(ours, info.optim_cls, inp.kwargs, id=_sid(ours, inp.desc)))
    return out


@pytest.mark.parametrize(("ours", "ref", "kw"), _option_sets())
def test_fp32_matches_torch_over_its_option_matrix(ours, ref, kw):
    params = _params(ours)
    ref_params = [p.detach().clone().requires_grad_() for p in params]
    opt = ours(params, master="none", **kw)
    ref_opt = ref(ref_params, **kw)
    for grads in grad_sequence(SHAPES[ours], 40, seed=3):
        feed(params, grads)
        feed(ref_params, grads)
        opt.step()
        ref_opt.step()
        for p, q in zip(params, ref_params, strict=True):  # (within 1e-6 at every step)
            assert_rel_close(p, q)


def _error_inputs():
    if _CO is None:
        return [pytest.param(None, None, None, marks=pytest.mark.skipif(_CO is None, reason=NO_DATA))]
    return [pytest.param(OURS[info.optim_cls], info.optim_cls, e,
                         id=_sid(OURS[info.optim_cls], e.optimizer_error_input.desc))
            for info in _CO.optim_db if info.optim_cls in OURS
            for e in info.optim_error_inputs_func(device="cpu", dtype=torch.float32)]


@pytest.mark.parametrize(("ours", "ref", "error_input"), _error_inputs())
def test_torch_error_inputs(ours, ref, error_input):
    inp = error_input.optimizer_error_input
    if error_input.error_type is RuntimeError and "complex" in inp.desc:
        # torch refuses a complex parameter at its step; lowprec at construction, as any
        # tensor that is not floating point (nothing has been stepped yet either way)
        with pytest.raises(RuntimeError, match="complex"):
            opt = ref(inp.params, **inp.kwargs)
            for p in inp.params:
                p.grad = torch.ones_like(p)
            opt.step()
        with pytest.raises(TypeError, match="floating-point"):
            ours(inp.params, **inp.kwargs)
        return
    _check_error_input(ours, ref, error_input)


@pytest.mark.parametrize("cls", [Adafactor, Muon])
def test_split_equals_fp32_bit_for_bit(cls):
    fp32 = _params(cls)
    bf16 = [p.detach().bfloat16().requires_grad_() for p in fp32]
    fp32 = [p.detach().bfloat16().float().requires_grad_() for p in fp32]  # (the same start)
    a, b = cls(fp32, master="none", **KW[cls]), cls(bf16, master="split", **KW[cls])
    for grads in grad_sequence(SHAPES[cls], 20, seed=1, dtype=torch.bfloat16):
        feed(fp32, grads)
        feed(bf16, grads)
        a.step()
        b.step()
    for p, q in zip(fp32, bf16, strict=True):
        assert torch.equal(b.master_weight(q), p.detach())


# Each optimizer with every strategy, BF16 and FP16 in turn: every pair of optimizer, strategy
# and dtype in some case (tests/_cases.py: pairwise).
STRATEGY_CASES = pairwise([Adafactor, Muon], STRATEGIES, [torch.bfloat16, torch.float16])


@pytest.mark.slow  # (a compiled whole-tensor step per case)
@pytest.mark.parametrize(("cls", "master", "dtype"), STRATEGY_CASES,
                         ids=[f"{c.__name__}-{m}-{str(d)[6:]}" for c, m, d in STRATEGY_CASES])
def test_every_strategy_follows_fp32_and_fused_is_the_eager_step(cls, master, dtype, monkeypatch):
    if master == "split" and dtype == torch.float16:
        with pytest.raises(ValueError, match="bfloat16"):
            cls(_params(cls, dtype), master=master)
        return
    calls = []
    real = compiled._compiled_kernel
    monkeypatch.setattr(compiled, "_compiled_kernel",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    ref = _params(cls, torch.float32)
    runs = []
    for fused in (False, True):
        params = [p.detach().to(dtype).requires_grad_() for p in ref]
        opt = cls(params, master=master, fused=fused, seed=7, **KW[cls])
        with fallback_is_an_error():
            for grads in grad_sequence(SHAPES[cls], 10, seed=2):
                feed(params, grads)
                opt.step()
        runs.append((params, opt))
    # Adafactor's whole-tensor step compiles as one graph (its sums in FP64, so the bits are the
    # eager step's); Muon's compiles its elementwise work as two graphs, its matmuls eager.
    assert calls
    assert not core.stages(runs[1][1]).fused_broken
    assert_same(*runs[0], *runs[1])
    fp32 = [p.detach().to(dtype).float().requires_grad_() for p in ref]
    opt = cls(fp32, master="none", **KW[cls])
    for grads in grad_sequence(SHAPES[cls], 10, seed=2):
        feed(fp32, grads)
        opt.step()
    params, opt16 = runs[0]
    for p, q in zip(params, fp32, strict=True):  # within the format's rounding of FP32's run
        err = (opt16.master_weight(p) - q).norm() / q.norm()
        assert err < (1e-2 if master in ("none", "stochastic") else 2e-3), (master, err)


@pytest.mark.parametrize("cls", [Adafactor, Muon])
@pytest.mark.parametrize("master", ["none", "kahan", "split", "stochastic"])
def test_state_dict_round_trips_resume_bit_for_bit(cls, master):
    dtype = torch.float32 if master == "none" else torch.bfloat16
    _check_round_trips(cls, KW[cls], dtype, master, SHAPES[cls])


def test_adafactor_state_is_torchs_and_its_statistics_stay_fp32():
    p = torch.randn(6, 5, 4).bfloat16().requires_grad_()
    v = torch.randn(4096).bfloat16().requires_grad_()
    opt = Adafactor([p, v], state_dtype="8bit")
    feed([p, v], grad_sequence([(6, 5, 4), (4096,)], 1)[0])
    opt.step()
    st = opt.state[p]
    assert (st["row_var"].shape, st["col_var"].shape) == ((6, 5, 1), (6, 1, 4))
    assert st["row_var"].dtype == st["col_var"].dtype == torch.float32
    assert "variance" not in st and "row_var" not in opt.state[v]
    assert opt.state[v]["variance"].dtype == torch.uint8  # (a vector's full second moment)
    ref_p = torch.randn(6, 5, 4, requires_grad=True)
    ref = torch.optim.Adafactor([ref_p])
    ref_p.grad = torch.randn(6, 5, 4)
    ref.step()
    assert {k for k in ref.state[ref_p]} == {k for k in st} - {"master", "compensation"}


@pytest.mark.parametrize("cls", [Adafactor, Muon])
def test_a_torch_checkpoint_resumes_as_torch_continues(cls):
    ref_params = _params(cls)
    params = [p.detach().clone().requires_grad_() for p in ref_params]
    ref = getattr(torch.optim, cls.__name__)(ref_params, **KW[cls])
    seq = grad_sequence(SHAPES[cls], 10, seed=5)
    for grads in seq[:5]:
        feed(ref_params, grads)
        ref.step()
    for p, q in zip(params, ref_params, strict=True):
        p.data.copy_(q.detach())
    opt = cls(params, master="none", **KW[cls])
    opt.load_state_dict(copy.deepcopy(ref.state_dict()))
    for grads in seq[5:]:
        feed(params, grads)
        feed(ref_params, grads)
        opt.step()
        ref.step()
    for p, q in zip(params, ref_params, strict=True):
        assert_rel_close(p, q)


@pytest.mark.parametrize("cls", [Adafactor, Muon])
@pytest.mark.parametrize(("old", "new"), [("kahan", "split"), ("split", "fp32"),
                                          ("fp32", "kahan")])
def test_a_checkpoint_of_another_strategy_converts(cls, old, new):
    params = _params(cls, torch.bfloat16)
    opt = cls(params, master=old, **KW[cls])
    seq = grad_sequence(SHAPES[cls], 6, seed=8)
    for grads in seq[:3]:
        feed(params, grads)
        opt.step()
    masters = [opt.master_weight(p) for p in params]
    other = cls(params, master=new, **KW[cls])
    other.load_state_dict(opt.state_dict())
    for p, w in zip(params, masters, strict=True):
        same = torch.equal(other.master_weight(p), w)
        assert same or new == "kahan", (old, new)  # (kahan keeps what BF16 + one BF16 can)
    for grads in seq[3:]:
        feed(params, grads)
        other.step()
    assert all(torch.isfinite(p).all() for p in params)


def test_muon_eight_bit_momentum_follows_bf16_momentum_and_resumes():
    torch.manual_seed(0)
    shapes = [(256, 64)]
    init = torch.randn(shapes[0]).bfloat16()
    runs = {}
    for sd in (None, "8bit"):
        p = init.clone().requires_grad_()
        opt = Muon([p], lr=2e-2, state_dtype=sd)
        for grads in grad_sequence(shapes, 20, seed=9):
            feed([p], grads)
            opt.step()
        runs[sd] = (p, opt)
    p, opt = runs["8bit"]
    assert opt.state[p]["momentum_buffer"].dtype == torch.uint8
    assert "momentum_buffer_scale" in opt.state[p]
    drift = (runs["8bit"][1].master_weight(p) - runs[None][1].master_weight(runs[None][0]))
    assert drift.norm() / init.float().norm() < 2e-2
    # a checkpoint of the codes resumes bit for bit
    q = p.detach().clone().requires_grad_()
    resumed = Muon([q], lr=2e-2, state_dtype="8bit")
    resumed.load_state_dict(copy.deepcopy(opt.state_dict()))
    for grads in grad_sequence(shapes, 3, seed=10):
        feed([p], grads)
        feed([q], grads)
        opt.step()
        resumed.step()
    assert torch.equal(bits(p), bits(q))


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.hidden = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.proj = nn.Linear(16, 8, bias=False)
        self.head = nn.Linear(8, 11)

    def forward(self, x):
        return self.head(self.proj(self.norm(self.hidden(self.embed(x)))))


def test_muon_param_groups_and_one_optimizer_for_a_whole_model():
    model = _Tiny().bfloat16()
    groups = muon_param_groups(model, adamw={"lr": 3e-3})
    names = [[n for n, _ in g["params"]] for g in groups]
    assert names == [["hidden.weight", "proj.weight"],
                     ["embed.weight", "hidden.bias", "norm.weight", "norm.bias", "head.weight",
                      "head.bias"]]
    opt = lowprec.Muon(groups, lr=2e-2, master="kahan")
    assert opt.param_groups[1]["eps"] == 1e-8 and opt.param_groups[1]["betas"] == (0.9, 0.999)
    # The AdamW group is lowprec.AdamW's step, bit for bit (the same rule, compiled alike).
    twin = _Tiny().bfloat16()
    twin.load_state_dict(model.state_dict())
    rest = [p for n, p in twin.named_parameters() if n in names[1]]
    hidden = [p for n, p in twin.named_parameters() if n in names[0]]
    adamw = lowprec.AdamW(rest, lr=3e-3, master="kahan")
    muon = lowprec.Muon(hidden, lr=2e-2, master="kahan")
    x = torch.randint(0, 11, (4, 6))
    for _ in range(3):
        for m, opts in ((model, [opt]), (twin, [adamw, muon])):
            m(x).float().square().mean().backward()
            for o in opts:
                o.step()
                o.zero_grad()
    for (n, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert torch.equal(bits(p), bits(q)), n
    assert sorted(opt.state[model.embed.weight]) == ["compensation", "exp_avg", "exp_avg_sq",
                                                     "master", "step"]


def test_muon_refuses_a_vector_and_names_the_way_out():
    with pytest.raises(ValueError, match="muon_param_groups"):
        Muon([nn.Parameter(torch.zeros(4))])


@pytest.mark.parametrize("cls", [Adafactor, Muon])
def test_a_skipped_step_under_a_loss_scaler_changes_nothing(cls):
    params = _params(cls, torch.bfloat16)
    opt = cls(params, **KW[cls])
    seq = grad_sequence(SHAPES[cls], 3, seed=4)
    feed(params, seq[0])
    opt.step()
    before = copy.deepcopy(opt.state_dict()), [p.detach().clone() for p in params]
    feed(params, seq[1])
    opt.step(grad_scale=torch.tensor(1024.0), found_inf=torch.tensor(1.0))
    assert [torch.equal(bits(p), bits(q)) for p, q in zip(params, before[1], strict=True)]
    after = opt.state_dict()
    for pid, st in before[0]["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(bits(v), bits(after["state"][pid][k])), k
    # and an unskipped scaled step equals the unscaled one
    a = _params(cls, torch.bfloat16, seed=1)
    b = [p.detach().clone().requires_grad_() for p in a]
    oa, ob = cls(a, **KW[cls]), cls(b, **KW[cls])
    feed(a, [g * 1024 for g in seq[2]])
    feed(b, seq[2])
    oa.step(grad_scale=torch.tensor(1024.0), found_inf=torch.tensor(0.0))
    ob.step()
    assert_same(a, oa, b, ob)


@pytest.mark.parametrize("name", ["Adam", "RAdam", "Lion", "StableAdamW", "Adafactor", "Muon"])
def test_master_state_dict_exports_each_optimizers_masters(name):
    model = _Tiny().bfloat16()
    params = muon_param_groups(model) if name == "Muon" else model.parameters()
    opt = getattr(lowprec, name)(params, lr=1e-3, master="split")
    x = torch.randint(0, 11, (4, 6))
    for _ in range(3):
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    exported = lowprec.master_state_dict(model, opt)
    for n, p in model.named_parameters():
        assert exported[n].dtype == torch.float32
        assert torch.equal(exported[n], opt.master_weight(p)), n
        assert not torch.equal(exported[n], p.detach().float()), n  # (split: more than BF16)


def test_the_readmes_muon_line_builds_one_optimizer_for_a_whole_model():
    import pathlib
    import re

    # (the README's optimizer section moved to docs/optimizers.md)
    page = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "optimizers.md").read_text()
    section = page.split("\n## The ten optimizers\n", 1)[1].split("\n## ", 1)[0]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    scope = {"model": _Tiny().bfloat16(), "lowprec": lowprec}
    exec(compile(code, "docs/optimizers.md", "exec"), scope)
    opt = scope["opt"]
    assert [g["use_muon"] for g in opt.param_groups] == [True, False]
    assert opt.param_groups[1]["lr"] == 3e-4 and opt.param_groups[0]["lr"] == 0.02
