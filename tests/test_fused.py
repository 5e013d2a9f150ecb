"""The fused (torch.compile) step against the eager step: bit for bit.

Compiling costs a few seconds per (optimizer, strategy, flags) variant, tens of seconds for the
stochastic-rounding hash, so this module is marked slow; CI runs it.

Tests that take ``device`` compare the two steps on each device present (the CPU, and CUDA where
present: the ``device`` fixture), where the fused step is Inductor's C++ or Triton code; initial
values and gradients are drawn on the CPU and moved. The pairs of elements, the shared calls of
small parameters and OpenMP loops are the CPU's fused step only, so their tests stay on the CPU.

The module is marked ``fused`` (tests/conftest.py, tests/_fallback.py): a compiled step that falls
back to eager fails the test instead of passing with eager bits (but in the tests marked
``fallback``, which make it fall back on purpose). That the mark works and that ``fused=True``
really runs compiled kernels are tested at the end.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import warnings

import pytest
import torch

from lowprec.numerics import split
from lowprec.optim import SGD, Adafactor, Adagrad, Adam, AdamW, Lamb, Muon, compiled, core, update
from tests._cases import kernel_families, pairwise
from tests._same import assert_same, bits

pytestmark = [pytest.mark.slow, pytest.mark.fused]

OPTIMIZERS = [
    (SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)),
    (AdamW, dict(lr=1e-3, amsgrad=True, weight_decay=0.1)),
    (Adagrad, dict(lr=0.01, weight_decay=0.1, lr_decay=0.01)),
    (Lamb, dict(lr=1e-3, weight_decay=0.01)),
]
DETERMINISTIC = [
    (torch.float32, "none"), (torch.bfloat16, "none"), (torch.bfloat16, "kahan"),
    (torch.bfloat16, "split"), (torch.bfloat16, "fp32"), (torch.float16, "kahan"),
]
# A zero-size tensor last in the group, a one-element tensor (both take the eager path inside a
# fused step) and a parameter whose gradient stays None.
SHAPES = [(96, 40), (33,), (2, 3, 5), (1,), (0,)]
NO_GRAD = 2


def _run(cls, kw, dtype, master, fused, steps, init, seed=1, opt_state=None):
    params = [x.clone().requires_grad_() for x in init]
    opt = cls(params, master=master, fused=fused, seed=7, **kw)
    if opt_state is not None:
        opt.load_state_dict(opt_state)
        for group in opt.param_groups:  # (the checkpoint's groups bring the saver's "fused")
            group["fused"] = fused
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for i, p in enumerate(params):
            p.grad = None if i == NO_GRAD else (
                torch.randn(p.shape, generator=gen).to(dtype).to(p.device))
        opt.step()
    return params, opt


@contextlib.contextmanager
def _kernel_calls():
    """Record every compiled-kernel call made inside: (function name, extra key, first input's
    length), the first input being the parameter (flat, or its words of two elements)."""
    calls = []
    real = compiled._compiled_kernel

    def spy(*args, **kwargs):
        kernel = real(*args, **kwargs)
        name = kwargs.get("fn", update._param_update).__name__
        key = kwargs.get("extra_key")
        return lambda *a, **k: calls.append((name, key, a[0].numel())) or kernel(*a, **k)

    compiled._compiled_kernel = spy
    try:
        yield calls
    finally:
        compiled._compiled_kernel = real


def _eager_and_fused(make, init, *, steps, seed, drop=None):
    """Steps ``make(params, fused)`` eager and fused from the same ``init`` and the same random
    gradients (parameter ``drop[1]`` has none at step ``drop[0]``), asserts that the two agree bit
    for bit and returns the fused run's compiled-kernel calls, parameters and optimizer."""
    results = []
    for fused in (False, True):
        params = [x.clone().requires_grad_() for x in init]
        opt = make(params, fused)
        gen = torch.Generator().manual_seed(seed)
        with _kernel_calls() as calls:
            for step in range(steps):
                for p in params:
                    p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
                if drop is not None and step == drop[0]:
                    params[drop[1]].grad = None
                opt.step()
        results.append((params, opt))
    assert_same(*results[0], *results[1])
    return calls, *results[1]


CASES = [(*o, *d) for o, d in itertools.product(OPTIMIZERS, DETERMINISTIC)] + [
    (*o, torch.bfloat16, "stochastic") for o in OPTIMIZERS
]


@pytest.mark.parametrize(
    ("cls", "kw", "dtype", "master"), CASES,
    ids=[f"{c[0].__name__}-{str(c[2])[6:]}-{c[3]}" for c in CASES],
)
def test_fused_equals_eager_bit_for_bit_across_a_checkpoint(cls, kw, dtype, master, device):
    init = [torch.randn(s).to(dtype).to(device) for s in SHAPES]
    pa, oa = _run(cls, kw, dtype, master, False, 8, init)
    pb, ob = _run(cls, kw, dtype, master, True, 8, init)
    assert_same(pa, oa, pb, ob)
    # Save from the fused run, resume both ways: still identical, and identical to never stopping.
    sd = copy.deepcopy(ob.state_dict())
    mid = [p.detach().clone() for p in pb]
    pc, oc = _run(cls, kw, dtype, master, False, 5, mid, seed=2, opt_state=sd)
    pd, od = _run(cls, kw, dtype, master, True, 5, mid, seed=2, opt_state=sd)
    assert_same(pc, oc, pd, od)
    assert od.state[pd[0]]["step"].item() == 13


def test_non_contiguous_params_use_eager():
    # (What the default fused=None does: tests/test_fused_default.py.)
    w = torch.randn(8, 6).t().contiguous().t().requires_grad_()  # non-contiguous
    assert not w.is_contiguous()
    opt = AdamW([w], fused=True)
    w.grad = torch.randn(6, 8).t()
    ref = AdamW([w.detach().clone().requires_grad_()], fused=False)
    ref.param_groups[0]["params"][0].grad = w.grad.clone()
    opt.step()
    ref.step()
    assert torch.equal(w.detach(), ref.param_groups[0]["params"][0].detach())



def test_stochastic_keys_are_one_compiled_call_with_the_eager_bits():
    """``compiled.step_keys``: bit for bit ``numerics.stream_key_halves`` of the counts plus one
    and the indices, for one parameter and for many, seeds past 32 bits and counts up to FP32's
    last exact integer, from one compiled graph."""
    from lowprec.numerics import stream_key_halves

    gen = torch.Generator().manual_seed(0)
    p = torch.zeros(2, dtype=torch.bfloat16, requires_grad=True)
    graphs = _graphs()
    for seed in (0, 5, 2**40 + 7, 2**64 - 1):
        opt = AdamW([p], master="stochastic", fused=True, seed=seed)
        for n in (1, 2, 37):
            counts = torch.randint(0, 2**24, (n,), generator=gen).float()
            index = torch.randint(0, 2**31, (n,), generator=gen)
            with torch.no_grad():
                got = compiled.step_keys(opt, opt.param_groups[0], p, counts, index)
            want = stream_key_halves(seed, counts.long() + 1, index)
            assert all(map(torch.equal, got, want)), (seed, n)
    assert _graphs() - graphs <= 1  # (none where an earlier test compiled it)


def _top_calls(fn) -> list[str]:
    """The operator calls and compiled-region calls ``fn`` makes from Python (as
    benchmarks/step_calls.py counts them)."""
    from torch.profiler import ProfilerActivity, profile

    def counted(e):
        return e.name.startswith("aten::") or "Compiled" in e.name

    def nested(e):
        q = e.cpu_parent
        while q is not None and not counted(q):
            q = q.cpu_parent
        return q is not None

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return [e.name for e in prof.events() if counted(e) and not nested(e)]


def test_a_stochastic_step_makes_its_keys_in_one_call():
    """Stochastic rounding's step makes its random keys in one compiled call (the eager form's
    integer operations were ~130 calls a step, each a launch on a GPU): it makes at most a few
    calls more than Kahan's step of the same parameters."""
    calls = {}
    for master in ("kahan", "stochastic"):
        params = [torch.randn(4096).bfloat16().requires_grad_() for _ in range(16)]
        opt = AdamW(params, lr=1e-3, master=master, fused=True, seed=3)
        for _ in range(3):
            for p in params:
                p.grad = torch.randn_like(p)
            opt.step()
        calls[master] = _top_calls(opt.step)
    assert not {"aten::__xor__", "aten::__rshift__", "aten::bitwise_xor"} & set(
        calls["stochastic"]), calls["stochastic"]
    assert len(calls["stochastic"]) <= len(calls["kahan"]) + 10, calls


@pytest.mark.fallback
def test_a_keys_kernel_that_fails_to_compile_falls_back_with_the_same_bits(monkeypatch):
    def failing():
        def kernel(*a, **k):
            raise RuntimeError("simulated compile failure")
        return kernel

    monkeypatch.setattr(compiled, "_keys_kernel", failing)
    init = [torch.randn(s).to(torch.bfloat16) for s in SHAPES]
    pa, oa = _run(AdamW, {}, torch.bfloat16, "stochastic", False, 3, init)
    with pytest.warns(RuntimeWarning, match="fused .* unavailable .* simulated compile failure"):
        pb, ob = _run(AdamW, {}, torch.bfloat16, "stochastic", True, 3, init)
    assert_same(pa, oa, pb, ob)

@pytest.mark.fallback
def test_compile_failure_falls_back_to_eager_with_a_warning(monkeypatch, device):
    def broken(*args, **kwargs):
        def kernel(*a, **k):
            raise RuntimeError("no C++ compiler found")
        return kernel

    monkeypatch.setattr(compiled, "_compiled_kernel", broken)
    init = [torch.randn(s).to(torch.bfloat16).to(device) for s in SHAPES]
    pa, oa = _run(AdamW, {}, torch.bfloat16, "kahan", False, 3, init)
    with pytest.warns(RuntimeWarning, match="fused .* unavailable .* no C\\+\\+ compiler"):
        pb, ob = _run(AdamW, {}, torch.bfloat16, "kahan", True, 3, init)
    assert_same(pa, oa, pb, ob)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per optimizer, not every step
        pb[0].grad = torch.zeros_like(pb[0])
        ob.step()


def test_changing_lr_does_not_recompile_and_shapes_share_kernels(device):
    torch._dynamo.reset()
    compiled._KERNELS.clear()
    graphs = lambda: torch._dynamo.utils.counters["stats"]["unique_graphs"]  # noqa: E731
    start = graphs()
    w = torch.randn(64, 32).to(device).requires_grad_()
    opt = SGD([w], lr=0.1, momentum=0.9, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    counts = []
    for _ in range(6):
        w.grad = torch.randn_like(w)
        opt.step()
        sched.step()
        counts.append(graphs() - start)
    # The lr, the step's coefficients and the random key are tensors, not constants: one graph.
    assert counts == [1] * 6, counts
    # Parameters of many other sizes and ranks share the graph (dynamic shapes, and the kernel
    # takes no view, whose base Dynamo would guard: a matrix's flat view first, then a vector's,
    # then a bucket's pieces made three graphs of one kernel: compiled._unviewed).
    for n in (1000, 4096, 777, 12345, 65536, 3):
        v = torch.randn(n).to(device).requires_grad_()
        opt.add_param_group({"params": [v]})
    opt.add_param_group({"params": [torch.randn(n, 8).to(device).requires_grad_()
                                    for n in (16, 16, 32, 8, 100)]})
    for _ in range(2):
        for group in opt.param_groups:
            for p in group["params"]:
                p.grad = torch.randn_like(p)
        opt.step()
    assert graphs() - start == 1, graphs() - start


def _graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def _steps_and_graphs(make, shapes, device, seed=0):
    """Three steps of ``make(params, fused)``'s optimizer, fused and eager on the same
    parameters and gradients (a few -0.0 in the first: ``-0.0 + 0 * w`` is +0.0 for a positive
    ``w``); returns both runs and the Dynamo graphs the fused one made."""
    torch._dynamo.reset()
    compiled._KERNELS.clear()
    gen = torch.Generator().manual_seed(seed)
    init = [torch.randn(s, generator=gen).bfloat16().to(device) for s in shapes]
    grads = [[torch.randn(s, generator=gen).bfloat16().to(device) for s in shapes]
             for _ in range(3)]
    for g in grads[0]:
        g.view(-1)[:4] = -0.0
    out = []
    for fused in (True, False):
        ps = [t.clone().requires_grad_() for t in init]
        opts = make(ps, fused)
        start = _graphs()
        for gs in grads:
            for p, g in zip(ps, gs, strict=True):
                p.grad = g.clone()
            for opt in opts:
                opt.step()
        out.append((ps, opts, _graphs() - start))
    return out


# An option that is a number picks no compiled code: decoupled decay is a factor 1 - lr * wd,
# 1 without it (Hugging Face's Trainer puts biases and norms in a group without decay), so
# the groups of such a row run one compiled kernel. An option that adds work to every element
# is a switch, a kernel of its own: maximize (update._descent), SGD's nesterov and an L2 term
# (numerics.plus_l2), since a select on a 0-d coefficient made the step 5-15% slower
# (core.step_flags). Either way the fused step is the eager step bit for bit.
GRAPHS = {
    "adamw-decay": (AdamW, {"lr": 1e-2, "weight_decay": 0.1}, {"weight_decay": 0.0}, 1),
    "adam-decoupled-decay": (Adam, {"lr": 1e-2, "weight_decay": 0.1,
                                    "decoupled_weight_decay": True}, {"weight_decay": 0.0}, 1),
    "adamw-maximize": (AdamW, {"lr": 1e-2, "weight_decay": 0.1}, {"maximize": True}, 2),
    "adam-l2-decoupled": (Adam, {"lr": 1e-2, "weight_decay": 0.1},
                          {"decoupled_weight_decay": True}, 2),
    "sgd-decay": (SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.1},
                  {"weight_decay": 0.0}, 2),
    "sgd-nesterov-maximize": (SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.1},
                              {"nesterov": True, "maximize": True}, 2),
}


@pytest.mark.parametrize("case", list(GRAPHS))
def test_groups_share_a_graph_unless_an_option_switches_the_code(case, device):
    cls, kw, other, graphs = GRAPHS[case]

    def make(ps, fused):
        return [cls([{"params": ps[::2]}, {"params": ps[1::2], **other}], master="kahan",
                    fused=fused, **kw)]

    (pf, (of,), made), (pe, (oe,), _) = _steps_and_graphs(
        make, [(64, 32), (32,), (64, 32), (32,)], device)
    assert made == graphs, made
    assert_same(pf, of, pe, oe)


def test_adam_adamw_and_muons_adamw_groups_share_one_graph(device):
    # One rule, one function (adamw_math): the kernels are keyed by it, not by the optimizer.
    kw = {"lr": 1e-2, "weight_decay": 0.1, "master": "kahan"}

    def make(ps, fused):
        return [AdamW(ps[0:2], fused=fused, **kw),
                Adam(ps[2:4], fused=fused, decoupled_weight_decay=True, **kw),
                Muon([{"params": ps[4:6], "use_muon": False}], fused=fused, **kw)]

    (_, of, made), (_, oe, _) = _steps_and_graphs(make, [(64, 32), (32,)] * 3, device)
    assert made == 1, made
    for a, b in zip(of, oe, strict=True):
        assert_same([p for g in a.param_groups for p in g["params"]], a,
                    [p for g in b.param_groups for p in g["params"]], b)


# Every optimizer with every master; the state and gradient dtypes packed into the words turn
# round, so that each meets every optimizer and every master (tests/_cases.py: pairwise).
PAIR_CASES = [
    (cls, kw, master, state_dtype, grad_dtype)
    for (cls, kw), (state_dtype, grad_dtype), master in pairwise(
        OPTIMIZERS,
        ((None, torch.bfloat16), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32)),
        ("split", "stochastic"),
    )
]


@pytest.mark.parametrize(
    ("cls", "kw", "master", "state_dtype", "grad_dtype"), PAIR_CASES,
    ids=[f"{c[0].__name__}-{c[2]}-state{str(c[3])[6:]}-grad{str(c[4])[6:]}" for c in PAIR_CASES],
)
def test_fused_on_pairs_equals_eager(cls, kw, master, state_dtype, grad_dtype):
    """(CPU only: pairs are the CPU fused step's.)

    The fused step of BF16 parameters on pairs of elements (int32/int64 words) equals eager, for
    the strategies that take them: split and stochastic rounding (``compiled._PAIRS_FASTER``).

    Odd lengths (the last element goes eager), BF16 and FP32 moments, BF16 and FP32 gradients,
    small parameters (gathered in a bucket), and a large one viewed at an odd offset of its
    storage (no pairs: the elementwise kernel).
    """
    n = (1 << 16) + 301
    storage = torch.randn(n + 1).to(torch.bfloat16)
    def run(fused):
        odd_view = storage.clone()[1:].requires_grad_()  # storage offset 1
        params = [torch.randn(s).to(torch.bfloat16).requires_grad_() for s in [(96, 40), (33,)]]
        params = [*params, odd_view, torch.randn(n).to(torch.bfloat16).requires_grad_()]
        opt = cls(params, master=master, fused=fused, seed=11, state_dtype=state_dtype, **kw)
        gen = torch.Generator().manual_seed(5)
        for _ in range(4):
            for p in params:
                if grad_dtype != p.dtype:
                    p.grad_dtype = None  # allow an FP32 gradient on a BF16 parameter
                p.grad = torch.randn(p.shape, generator=gen).to(grad_dtype)
            opt.step()
        return params, opt

    torch.manual_seed(0)
    pa, oa = run(False)
    torch.manual_seed(0)
    with _kernel_calls() as calls:
        pb, ob = run(True)
    assert_same(pa, oa, pb, ob)
    used = [name for name, _, _ in calls]
    assert "_param_update_pairs" in used and "_param_update" in used, used
    if cls is Lamb:  # the norms' pass on pairs too
        assert "_param_sums_pairs" in used and "_param_sums" in used, used


def test_small_stochastic_parameters_share_one_call_with_their_own_random_bits():
    """(CPU only: the CPU's BF16 pairs.)

    Small BF16 parameters under stochastic rounding share a gathered call in their bucket, each
    word hashed with its own parameter's key and index (``buckets._Bucket._keys``): bit for bit
    the eager step, for a seed whose keys use all 64 bits. Odd lengths stay out of the bucket. A
    parameter without a gradient for a step is left out of it (and then its step count differs
    from the others', so it is stepped in a piece of its own): still the eager bits."""
    shapes = [(96, 40), (6,), (2, 3, 5), (33,), (8, 2)]
    init = [torch.randn(s).to(torch.bfloat16) for s in shapes]
    calls, params, opt = _eager_and_fused(
        lambda params, fused: AdamW(params, lr=1e-2, master="stochastic", fused=fused,
                                    seed=2**64 - 3),
        init, steps=4, seed=3, drop=(1, 1),
    )
    assert [int(opt.state[p]["step"]) for p in params] == [4, 3, 4, 4, 4]
    assert core.stages(opt).buckets.buckets[0].keyed
    # The four even-length parameters' 3840 + 6 + 30 + 16 elements in one call (words of two);
    # from the step the (6,) parameter missed on, the runs around it (which then has a count of
    # its own): 3840, 6 and 30 + 16; the (33,) one alone, its last element eager.
    words = [n for name, key, n in calls if name == "_param_update_pairs"]
    assert words[0] == (3840 + 6 + 30 + 16) // 2, calls
    assert set(words[1:]) == {3840 // 2, 6 // 2, (30 + 16) // 2, 33 // 2}, calls


@pytest.mark.parametrize("master", ["none", "kahan", "split", "stochastic", "fp32"])
def test_small_lamb_parameters_take_a_call_per_size(master):
    """Small LAMB parameters step in their bucket's pieces, one per size (equal sizes as rows of
    a matrix, each row's own sums; an odd size a bucket of one), bit for bit the eager step, a
    parameter without a gradient at a step and a seed whose keys use all 64 bits included.
    Split and stochastic rounding step on pairs (words), the others on the elements, as FP32
    parameters (a bucket of their own) do."""
    shapes = [(64, 30), (6,), (2, 3, 5), (33,), (8, 2), (4, 4)]
    init = [torch.randn(s).to(torch.bfloat16) for s in shapes]
    init[4] = init[4] * 100  # a very different ||w|| (ratios differ by parameter)
    if master != "split":  # (which takes bfloat16 parameters only)
        init.append(torch.randn(10))  # FP32: plain storage, not on pairs
    make = lambda params, fused: Lamb(params, lr=1e-2, weight_decay=0.1,  # noqa: E731
                                      master=master, fused=fused, seed=2**63 + 5)
    _eager_and_fused(make, init, steps=4, seed=4, drop=(1, 5))
    params = [x.clone().requires_grad_() for x in init]
    opt = make(params, True)
    for p in params:
        p.grad = torch.randn(p.shape).to(p.dtype)
    with _kernel_calls() as calls:
        opt.step()  # (the first step: through the buckets)
    on_pairs = master in compiled._PAIRS_FASTER
    sums = sorted((n for name, _, n in calls
                   if name == ("_param_sums_pairs" if on_pairs else "_param_sums")), reverse=True)
    if on_pairs:  # (each size its own words, (8, 2) and (4, 4) as two rows; 33: 16 and one eager)
        assert sums == [960, 16, 16, 15, 3], calls
    else:  # (each size its own elements, the FP32 parameter's 10 among them)
        assert sums == [1920, 33, 32, 30, 10, 6], calls


def _sequential_sum_trap(words: int) -> torch.Tensor:
    """An FP32 vector of ``2 * words`` elements, two near 1.5 and the rest 2**-27, whose FP32
    norm is right only if the tiny squares are not lost: their total moves the FP64 sum of
    squares across an FP32 rounding boundary of the norm, while each alone is below half an
    FP64 ulp of the running total, so a strictly sequential sum drops every one of them."""
    gen = torch.Generator().manual_seed(0)
    x, y = 1 + torch.rand(1 << 21, generator=gen), 1 + torch.rand(1 << 21, generator=gen)
    r = (x.double() ** 2 + y.double() ** 2).sqrt()
    ulp = torch.exp2(torch.floor(torch.log2(r)) - 23)
    below_midpoint = (torch.floor(r / ulp) + 0.5) * ulp - r
    tiny = 2.0**-27
    total = 2 * (words - 1) * tiny * tiny
    i = int(((below_midpoint > 0) & (below_midpoint < total / (4 * r))).nonzero()[0, 0])
    w = torch.full((2 * words,), tiny)
    w[0], w[1] = x[i], y[i]
    sequential = torch.zeros((), dtype=torch.float64)
    for v in (w[0:2].double() ** 2).tolist() + [tiny * tiny] * 2:
        sequential += v  # the first tiny squares already vanish
    assert sequential.sqrt().float() != w.double().square().sum().sqrt().float()
    return w


@pytest.mark.parametrize("master", ["fp32", "split"], ids=["elements", "pairs"])
def test_lamb_norms_are_summed_pairwise(master):
    """A compiled sums pass adds pairwise, as eager does: on a vector whose norm a sequential sum
    gets one FP32 ulp wrong, fused equals eager bit for bit, on the elements (an FP32 master) and
    on pairs (split)."""
    w = _sequential_sum_trap(32001)
    results = []
    for fused in (False, True):
        params = [w.to(torch.bfloat16).requires_grad_(), torch.ones(16, dtype=torch.bfloat16,
                                                                     requires_grad=True)]
        opt = Lamb(params, lr=1e-2, master=master, fused=fused)
        gen = torch.Generator().manual_seed(1)
        with _kernel_calls() as calls:
            for step in range(2):
                for p in params:
                    p.grad = torch.randn(p.shape, generator=gen).to(torch.bfloat16)
                if step == 1:  # a master weight as training leaves it: any FP32 values
                    state = opt.state[params[0]]
                    if master == "fp32":
                        state["master_weight"].copy_(w)
                    else:
                        top, trail = split(w)
                        with torch.no_grad():
                            params[0].copy_(top)
                        state["trail"].copy_(trail)
                opt.step()
        results.append((params, opt))
    name, n = ("_param_sums", 64002) if master == "fp32" else ("_param_sums_pairs", 32001)
    assert n in [length for fn, _, length in calls if fn == name], calls
    assert_same(*results[0], *results[1])


def test_small_batch_advances_integer_step_counts():
    """A checkpoint may hold integer step counts: the batch advances them like the one-by-one
    step (to the step number, keeping their dtype), after writing nothing it could not finish."""
    init = [torch.randn(8).to(torch.bfloat16) for _ in range(6)]
    results = []
    for fused in (False, True):
        params = [x.clone().requires_grad_() for x in init[:3]]
        opt = AdamW(params, lr=1e-2, master="kahan", fused=fused)
        for p, g in zip(params, init[3:], strict=True):
            p.grad = g.clone()
        opt.step()
        for p in params:
            opt.state[p]["step"] = torch.tensor(int(opt.state[p]["step"]))  # int64
        opt.step()
        assert [opt.state[p]["step"].dtype for p in params] == [torch.int64] * 3
        assert [int(opt.state[p]["step"]) for p in params] == [2, 2, 2]
        results.append((params, opt))
    assert_same(*results[0], *results[1])


@pytest.mark.parametrize(
    ("cls", "master"), [(SGD, "split"), (AdamW, "kahan"), (Lamb, "stochastic")],
    ids=["SGD-split", "AdamW-kahan", "Lamb-stochastic"],
)
def test_kernels_have_a_parallel_loop_whatever_size_compiles_them(cls, master, monkeypatch):
    """(CPU only: Inductor's C++ code.)

    A variant first compiled for a tiny parameter still gets a parallel loop: the kernel
    (also as Inductor's on-disk cache hands it to later processes) serves large tensors too."""
    from torch._inductor.utils import run_and_get_code

    fresh = type(f"Fresh{cls.__name__}", (cls,), {})  # a variant of its own: compiled here
    # (stochastic rounding's keys, a few integers per parameter: no loop to parallelise, eager)
    monkeypatch.setattr(compiled, "_keys_kernel", lambda: compiled._step_keys)
    p = torch.randn(8).to(torch.bfloat16).requires_grad_()
    p.grad = torch.randn(8).to(torch.bfloat16)
    _, code = run_and_get_code(fresh([p], lr=1e-3, master=master, fused=True).step)
    assert code and all("#pragma omp parallel" in c for c in code), code


@pytest.mark.parametrize("master", ["none", "kahan", "split", "stochastic"])
def test_fused_lamb_equals_eager_on_large_tensors(master, device):
    """LAMB on tensors longer than the eager chunk: the eager step (norms summed chunk by chunk)
    and the compiled one (whole; on the CPU on pairs for split and stochastic, with an odd last
    element), plain and loss-scaled, agree bit for bit."""
    shapes = [(257, 301), (2, 65536)]
    init = [torch.randn(s).to(torch.bfloat16).to(device) for s in shapes]
    results = []
    for fused in (False, True):
        params = [x.clone().requires_grad_() for x in init]
        opt = Lamb(params, lr=1e-2, weight_decay=0.1, master=master, fused=fused, seed=5)
        gen = torch.Generator().manual_seed(9)
        for step in range(3):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen).to(torch.bfloat16).to(device)
            if step == 2:
                for p in params:
                    p.grad.mul_(8)
                opt.step(grad_scale=torch.tensor(8.0, device=device),
                         found_inf=torch.zeros((), device=device))
            else:
                opt.step()
        results.append((params, opt))
    assert_same(*results[0], *results[1])


@pytest.mark.parametrize("master", ["none", "split"])
def test_lamb_kernels_serve_every_length(master, device):
    """LAMB's two compiled passes (norms, update) are compiled once for tensors shorter and
    longer than a chunk, of odd and even lengths, at storage offsets; fused equals eager for
    each."""
    torch._dynamo.reset()
    compiled._KERNELS.clear()
    graphs = lambda: torch._dynamo.utils.counters["stats"]["unique_graphs"]  # noqa: E731
    start = graphs()
    for offset, n in ((0, 200_000), (2, 70_000), (0, 65_536), (4, 3_000), (0, 131_075), (0, 12)):
        storage = torch.randn(offset + n).to(torch.bfloat16).to(device)
        w = torch.nn.Parameter(storage[offset:])  # (a view of a longer storage if offset)
        ref = w.detach().clone().requires_grad_()
        for p, fused in ((w, True), (ref, False)):
            g = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(torch.bfloat16)
            p.grad = g.to(device)
            Lamb([p], lr=1e-2, master=master, fused=fused).step()
        assert torch.equal(bits(w), bits(ref)), (offset, n)
    # The norms' pass and the update pass, one more at most where Inductor specialises on the
    # length being a multiple of its vector width. (A count of the C++ backend's: elsewhere the
    # storage offsets' alignment may add graphs, and the bits above are what is checked.)
    if device == "cpu":
        assert graphs() - start <= 3, graphs() - start


def test_small_parameters_past_one_piece_take_several_calls(monkeypatch):
    """More small parameters than a bucket's gathered piece holds (``buckets._GATHERED``, lowered
    here to 200,000 elements): several compiled calls, each within the limit, and the same bits
    as eager."""
    from lowprec.optim import buckets

    monkeypatch.setitem(buckets._GATHERED, "cpu", 200_000)
    shapes = [(60_000,)] * 6
    init = [torch.randn(s).to(torch.bfloat16) for s in shapes]
    results = []
    for fused in (False, True):
        params = [x.clone().requires_grad_() for x in init]
        opt = AdamW(params, lr=1e-2, master="kahan", fused=fused)
        for p in params:
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(1)).bfloat16()
        with _kernel_calls() as calls:
            opt.step()
        results.append((params, opt))
    assert_same(*results[0], *results[1])
    sizes = [n for _, _, n in calls]
    assert sorted(sizes) == [180_000, 180_000], sizes  # 3 + 3 parameters


@pytest.mark.parametrize(
    ("cls", "master", "fused"),
    [(AdamW, "kahan", False), (AdamW, "kahan", True), (SGD, "split", True),
     (Lamb, "stochastic", True)],
    ids=["adamw-kahan-eager", "adamw-kahan-fused", "sgd-split-fused", "lamb-stochastic-fused"],
)
def test_step_inside_torch_compile_is_the_step_itself(cls, master, fused, device):
    """``torch.compile(opt.step)`` (or a compiled training step around it) runs the step as it
    is: traced, a fused step failed to compile, and an eager Kahan step lost its compensation
    (Inductor folds the BF16 round trip away without emulate_precision_casts)."""
    shapes = [(64, 40), (40,), ((1 << 16) + 2,)]

    def run(compiled):
        torch.manual_seed(0)
        params = [(torch.randn(s) * 0.1).to(torch.bfloat16).to(device).requires_grad_()
                  for s in shapes]
        kw = {"momentum": 0.9} if cls is SGD else {}
        opt = cls(params, lr=1e-2, master=master, fused=fused, seed=3, **kw)
        step = torch.compile(opt.step) if compiled else opt.step
        gen = torch.Generator().manual_seed(1)
        for _ in range(4):
            for p in params:
                p.grad = (torch.randn(p.shape, generator=gen) * 1e-3).to(torch.bfloat16).to(device)
            step()
        return params, opt

    pa, oa = run(False)
    pb, ob = run(True)
    assert_same(pa, oa, pb, ob)


# ------------------------------------------------ compiled kernels ran, and a fallback is an error

#: Two large parameters of one kernel variant and a small one, in one bucket.
RAN_SHAPES = [(300, 256), (256, 300), (64,)]


def _steps(params, opt, steps, device):
    gen = torch.Generator().manual_seed(2)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype).to(device)
        opt.step()


def test_a_fused_step_runs_compiled_kernels(kernel_calls, device):
    """``fused=True`` compiles and runs compiled code, which the bits alone cannot show (a step
    that fell back to eager gives the same): every ``compiled._Kernel`` the steps made was called
    and finished its first call (``warm``: compiled without error); Dynamo captured a graph for
    each and Inductor generated kernels for them (C++ on the CPU, Triton on CUDA); and the
    parameters and state are the eager step's."""
    from torch._dynamo.utils import counters
    from torch._inductor import metrics

    # (kernel_calls: every kernel new, compiled by this test)
    init = [torch.randn(s).to(torch.bfloat16).to(device) for s in RAN_SHAPES]
    runs = []
    for fused in (False, True):
        graphs, generated = counters["stats"]["unique_graphs"], metrics.generated_kernel_count
        params = [x.clone().requires_grad_() for x in init]
        opt = AdamW(params, lr=1e-2, master="kahan", fused=fused, seed=3)
        _steps(params, opt, 3, device)
        runs.append((params, opt))
    assert_same(*runs[0], *runs[1])
    kernels = set(kernel_calls)
    assert kernels == set(compiled._KERNELS.values()), "a kernel was made but never called"
    assert all(k.warm for k in kernels), [k.name for k in kernels if not k.warm]
    assert kernels, "no kernel ran"
    assert counters["stats"]["unique_graphs"] - graphs >= len(kernels)
    assert metrics.generated_kernel_count - generated >= len(kernels)


def test_under_the_fused_mark_a_fallback_fails_the_test(monkeypatch, device):
    """What the ``fused`` mark does (this module has it): a kernel that fails to compile, whose
    step would fall back to eager with the same bits, makes the step raise its warning (having
    written nothing); so does ``fused=None`` finding no compiler, even where the once-per-process
    warning was already given."""
    from tests._fallback import fallbacks_are_errors

    def make(fused):
        params = [torch.randn(s).to(torch.bfloat16).to(device).requires_grad_()
                  for s in RAN_SHAPES]
        return params, AdamW(params, lr=1e-2, master="kahan", fused=fused)

    def failing(*args, **kwargs):
        def kernel(*a, **k):
            raise RuntimeError("simulated compile failure")
        return kernel

    with monkeypatch.context() as m:
        m.setattr(compiled, "_compiled_kernel", failing)
        params, opt = make(True)
        for p in params:
            p.grad = torch.ones_like(p)
        before = bits(params[0]).clone()
        with pytest.raises(RuntimeWarning, match=r"lowprec: the fused .*simulated compile fail"):
            opt.step()
        assert torch.equal(bits(params[0]), before)

    # fused=None without a compiler: lowprec warns once per process (here as if an earlier test
    # had been warned already); fallbacks_are_errors (the mark's) makes it warn, and raise, again.
    missing = "no C++ compiler for torch.compile (simulated)"
    with monkeypatch.context() as m:
        m.delenv("LOWPREC_FUSED", raising=False)
        m.setattr(compiled, "_compiler", lambda device_type: missing)
        m.setattr(compiled, "_WARNED", {missing})
        for inside in (False, True):
            params, opt = make(None)
            for p in params:
                p.grad = torch.ones_like(p)
            if not inside:
                opt.step()  # (already warned: silently eager)
                continue
            with fallbacks_are_errors(), pytest.raises(RuntimeWarning, match=r"no C\+\+ compiler"):
                opt.step()


@pytest.mark.fallback
def test_the_fallback_filter_matches_every_fallback_warning(monkeypatch):
    """``FALLBACK_WARNING`` (the filter behind the ``fused`` mark) matches the start of each
    message lowprec gives where a compiled step does not run: the optimizer's fallback (a compile
    error), ``fused=None`` without a C++ compiler, without Triton, with a
    torch whose Inductor lacks an option the step needs or (CPU) drops low-precision round trips,
    or on a device with no fused step, and the 1-bit hook's fallback; and no other lowprec
    warning."""
    import re
    import types

    from torch._inductor import cpp_builder
    from torch.utils import _triton

    from lowprec.distributed import kernels, stages
    from tests._fallback import FALLBACK_WARNING

    def no_compiler():
        raise RuntimeError("simulated: no C++ compiler")

    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", no_compiler)
    monkeypatch.setattr(_triton, "has_triton", lambda: False)
    why = compiled._compiler.__wrapped__  # (uncached)
    messages = [f"lowprec: {why(d)}" for d in ("cpu", "cuda", "mps")]
    with monkeypatch.context() as m:
        m.setattr(compiled, "_CPU_ROUND_TRIPS_KEPT", (99, 0))
        messages.append(f"lowprec: {why('cpu')}")
        m.setattr(compiled, "inductor_options", lambda: {"emulate_precision_casts": False})
        messages.append(f"lowprec: {why('cuda')}")  # (the same on the CPU)
    assert len(set(messages)) == len(messages), messages  # (each a case of its own)

    def fails(*variant):
        def kernel(*args):
            raise RuntimeError("simulated compile failure")
        return kernel

    monkeypatch.setattr(kernels, "compiled", fails)
    monkeypatch.setattr(kernels, "probe", lambda x: x, raising=False)
    state = types.SimpleNamespace(_fused_active=True, bits=1, rule="range")
    with pytest.warns(RuntimeWarning) as caught:
        compiled._disable_fused(types.SimpleNamespace(), RuntimeError("simulated"))
        assert stages.run(state, "probe", torch.zeros(2)) is not None
    messages += [str(w.message) for w in caught]
    assert len(messages) == 7 and all(m.startswith("lowprec: ") for m in messages), messages
    fallback = re.compile(FALLBACK_WARNING, re.I)  # (a warnings filter's flags)
    assert all(fallback.match(m) for m in messages), messages
    assert not fallback.match("lowprec: parameter group 0: state_dtype='8bit' keeps FP32 state")


def test_whole_tensor_rules_compile_for_fp32_gradients_of_bf16_parameters():
    """A BF16 parameter with an FP32 gradient (``grad_dtype`` None) takes the compiled step of a
    rule that needs the tensor whole (Adafactor), bit for bit the eager one: handed a view of the
    parameter, Dynamo refused its FP32 gradient and the optimizer fell back to eager for good
    (under the ``fused`` mark a fallback fails this test)."""
    init = torch.randn(64, 48).to(torch.bfloat16)
    results = []
    for fused in (False, True):
        p = init.clone().requires_grad_()
        p.grad_dtype = None
        opt = Adafactor([p], lr=1e-2, master="kahan", fused=fused)
        gen = torch.Generator().manual_seed(2)
        for _ in range(2):
            p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
        results.append(([p], opt))
    assert_same(*results[0], *results[1])


@pytest.mark.parametrize("state", [None, "8bit"])
@pytest.mark.parametrize("master", ["kahan", "split", "stochastic"])
@pytest.mark.parametrize("name", ["adamw", "lamb", "adafactor", "muon"])
def test_a_configuration_asks_for_its_kernels_whatever_its_shapes(name, master, state,
                                                                  monkeypatch):
    """One configuration (optimizer, master, state format, scaled or not) over a model of many
    shapes (gathered pieces, a large parameter alone, odd sizes, matrices and vectors) and three
    steps under a schedule asks for the kernels its kind of rule needs and no more
    (``benchmarks/kernel_families.py``: the census and its ``expected`` counts); each kernel is
    one graph for every size (test_changing_lr_does_not_recompile_and_shapes_share_kernels).
    Counted with ``torch.compile`` replaced by the function itself: nothing is compiled."""
    families = kernel_families()
    monkeypatch.setattr(torch, "compile", lambda fn, **_: fn)
    monkeypatch.setattr(compiled, "_KERNELS", {})
    plain = families.census(name, master, state, False)
    assert len(plain) == families.expected(name, master, state), plain
    # On the CPU a scaled step is the plain one on gradients unscaled in place (power-of-two
    # scale, BF16 gradients: loss_scale.skipped_on_host): the same kernels. With its counts on
    # capturable (as on a GPU) the kernels take the scaler's inputs themselves.
    assert families.census(name, master, state, True) == plain
    device = families.census(name, master, state, True, capturable=True)
    assert len(device) == len(plain) and all("_unscale_" in n for n in device), device
