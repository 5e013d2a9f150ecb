"""lowprec's optimizers under torch.optim's own contracts, with torch's option matrices as data.

PyTorch publishes the inputs of its optimizer tests in
``torch.testing._internal.common_optimizers``: for every optimizer an ``OptimizerInfo`` whose
``optim_inputs_func`` lists option sets (``OptimizerInput(kwargs=..., desc=...)``) and whose
``optim_error_inputs_func`` lists bad ones with the error torch raises. The tests below take the
sets of ``torch.optim.SGD``, ``AdamW`` and ``Adagrad`` as data for their lowprec namesakes (the
tests themselves are written here) and check what code written for torch.optim relies on:
state-dict, deepcopy, pickle and ``torch.save`` round trips that change nothing and resume bit for
bit, step counts saved as numbers, the hooks, ``repr``, named parameters, the errors, the fused
step over every dtype in one process, and SGD's momentum turned on mid-run.

Option mapping (``_lowprec_kwargs``): ``foreach`` is passed through (lowprec accepts and ignores
it), ``fused`` means lowprec's compiled step, ``capturable``/``differentiable`` are passed when
False; the values not compared with torch are in ``UNSUPPORTED`` (``differentiable=True`` is
checked to raise ``ValueError``, ``capturable=True`` to be taken; the rest of their option set
runs without them).
"""

from __future__ import annotations

import ast
import contextlib
import copy
import io
import logging
import math
import pickle
import re
import sys
import types
import unittest
import warnings

import pytest
import torch
from torch import nn
from torch.optim import optimizer as torch_optimizer

from lowprec.optim import SGD, Adagrad, Adam, AdamW, Lamb, Lion, RAdam, StableAdamW, compiled, core
from tests._cases import pairwise
from tests._same import assert_same, bits

# A fused step that falls back to eager (its compilation failed) fails the test instead of warning.
pytestmark = pytest.mark.filterwarnings("error:lowprec. the fused:RuntimeWarning")

# ------------------------------------------------------------------ torch's matrices as data


def _torch_common_optimizers():
    """``torch.testing._internal.common_optimizers``, or None where this torch lacks it.

    Its import pulls in torch's unittest base classes, which derive from ``expecttest`` (a
    dependency of torch's own test suite, not of torch): where it is not installed a stand-in
    serves for the import only. The import also freezes ``torch.backends`` flags for torch's test
    suite (``disable_global_flags``); that is undone so nothing else in this process changes.
    """
    stub = None
    if "expecttest" not in sys.modules:
        try:
            import expecttest  # noqa: F401
        except ImportError:
            stub = types.ModuleType("expecttest")
            stub.TestCase = unittest.TestCase
            stub.ACCEPT = False
            sys.modules["expecttest"] = stub
    frozen = torch.backends.flags_frozen()
    try:
        from torch.testing._internal import common_optimizers
    except Exception:  # (a private module: absent or changed in another torch)
        return None
    finally:
        if stub is not None and sys.modules.get("expecttest") is stub:
            del sys.modules["expecttest"]
        setattr(torch.backends, "__allow_nonbracketed_mutation_flag", not frozen)
    return common_optimizers


_CO = _torch_common_optimizers()
NO_DATA = "torch.testing._internal.common_optimizers is not importable in this torch"

LOWPREC_OF = {torch.optim.SGD: SGD, torch.optim.AdamW: AdamW, torch.optim.Adagrad: Adagrad}

# Options of torch's sets not compared with torch here: (option, value) -> reason. A set holding
# one is checked at construction (test_unsupported_options_are_refused: differentiable is
# refused, capturable accepted); its other options run as a set of their own unless that repeats
# another set.
UNSUPPORTED = {
    ("capturable", True): "accepted, but torch's capturable step runs on CUDA alone: lowprec's is "
                          "checked against its own default step (tests/test_capturable.py)",
    ("differentiable", True): "the step writes the weights in place outside autograd "
                              "(documented: 'differentiable: Must be False')",
}


def _canon(v):
    if isinstance(v, torch.Tensor):
        return ("tensor", tuple(v.shape), tuple(v.reshape(-1).tolist()))
    if isinstance(v, (tuple, list)):
        return tuple(_canon(x) for x in v)
    return v


def _lowprec_kwargs(kwargs):
    """torch's option set as lowprec takes it, and the unsupported options it held."""
    out, dropped = {}, []
    for k, v in kwargs.items():
        if (k, v) in UNSUPPORTED:
            dropped.append(k)
        else:
            out[k] = v
    return out, dropped


def _collect_sets():
    """Every option set torch publishes for SGD, AdamW and Adagrad: the CUDA matrix (every
    implementation flag: foreach, fused, differentiable, and the capturable sets) and the CPU
    one, deduplicated by description."""
    sets, refused, seen_desc, seen_kw = [], [], set(), set()
    if _CO is None:
        return sets, refused
    for info in _CO.optim_db:
        ours = LOWPREC_OF.get(info.optim_cls)
        if ours is None:
            continue
        for device in ("cuda", "cpu"):  # (only builds kwargs: no CUDA call is made)
            for inp in _CO._get_optim_inputs_including_global_cliquey_kwargs(
                device, torch.float32, info
            ):
                if (ours, inp.desc) in seen_desc:
                    continue
                seen_desc.add((ours, inp.desc))
                kw, dropped = _lowprec_kwargs(inp.kwargs)
                if dropped:
                    refused.append((ours, info.optim_cls, inp.desc, inp.kwargs))
                key = (ours, tuple(sorted((k, _canon(v)) for k, v in kw.items() if not (
                    k in ("foreach", "capturable", "differentiable") and v is False))))
                if key in seen_kw:  # (a set that repeats another once its refusals are dropped)
                    continue
                seen_kw.add(key)
                desc = inp.desc + (f" ({', '.join(dropped)} dropped)" if dropped else "")
                sets.append((ours, info.optim_cls, desc, kw))
    return sets, refused


OPTION_SETS, REFUSED_SETS = _collect_sets()


def _sid(ours, desc):
    return f"{ours.__name__}-{desc.replace(' ', '_')}"


def _set_params(sets, *, fused_slow=True):
    if not sets:
        return [pytest.param(None, None, None, None,
                             marks=pytest.mark.skipif(_CO is None, reason=NO_DATA))]
    out = []
    for ours, ref, desc, kw in sets:
        marks = [pytest.mark.slow] if fused_slow and kw.get("fused") else []
        out.append(pytest.param(ours, ref, desc, kw, id=_sid(ours, desc), marks=marks))
    return out


# The strategies the contracts are checked under: plain FP32 and every BF16 strategy whose state
# differs (a compensation buffer, an int16 trail, a random stream keyed by the seed).
STRATEGIES = [
    pytest.param(torch.float32, "none", id="fp32-none"),
    pytest.param(torch.bfloat16, "kahan", id="bf16-kahan"),
    pytest.param(torch.bfloat16, "split", id="bf16-split"),
    pytest.param(torch.bfloat16, "stochastic", id="bf16-stochastic"),
]
# lowprec-only (no torch counterpart, so no torch set): LAMB under the same contracts.
LAMB_SET = (Lamb, None, "lamb weight_decay", {"lr": 1e-2, "weight_decay": 0.01})

# ------------------------------------------------------------------ helpers

SHAPES = [(5, 4), (7,), (1,)]


def _init(dtype, shapes=SHAPES, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).to(dtype) for s in shapes]


def _grad_seq(dtype, steps, seed, shapes=SHAPES):
    gen = torch.Generator().manual_seed(100 + seed)
    return [[torch.randn(s, generator=gen).to(dtype) for s in shapes] for _ in range(steps)]


def _make(cls, kw, init, master, **extra):
    params = [t.clone().requires_grad_() for t in init]
    return params, cls(params, master=master, seed=5, **copy.deepcopy(kw), **extra)


def _params_of(opt):
    return [p for g in opt.param_groups for p in g["params"]]


def _run(params, opt, seq):
    for grads in seq:
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        opt.step()


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.detach().contiguous().reshape(-1), b.detach().contiguous().reshape(-1)
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def assert_equal_values(a, b, where="state_dict"):
    """``a`` and ``b`` (state dicts, or any nesting of dicts, sequences, tensors and numbers) are
    equal: the same keys, the same types, tensors of the same dtype and shape bit for bit."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{where}: {a!r} vs {b!r}"
        assert a.dtype == b.dtype and a.shape == b.shape, f"{where}: {a.dtype} vs {b.dtype}"
        assert _same_bits(a, b), f"{where}: values differ"
    elif isinstance(a, dict):
        assert isinstance(b, dict), f"{where}: {type(b).__name__}"
        assert set(a) == set(b), f"{where}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"
        for k in a:
            assert_equal_values(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), f"{where}: {a!r} vs {b!r}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_equal_values(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), f"{where}: {a!r} vs {b!r}"
    else:
        assert type(a) is type(b) and a == b, f"{where}: {a!r} vs {b!r}"


@contextlib.contextmanager
def fallback_is_an_error():
    """lowprec's warning that the fused step fell back to eager (a compile failure, Dynamo's
    recompile limit...) raised as an error: a fused test that falls back fails loudly."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="lowprec: the fused", category=RuntimeWarning)
        yield


# ------------------------------------------------------------------ 1. state-dict determinism


def _copies(cls, kw, params, master, opt):
    """The optimizer ``opt`` of ``params`` copied four ways: (name, params, optimizer); the two
    loaded from a state dict take copies of the parameters' current values, as a resumed run
    loads the model's weights first."""
    init = [p.detach().clone() for p in params]
    sd = opt.state_dict()
    out = []
    params, loaded = _make(cls, kw, init, master)
    loaded.load_state_dict(sd)
    out.append(("load_state_dict", params, loaded))
    deep = copy.deepcopy(opt)
    out.append(("deepcopy", _params_of(deep), deep))
    unpickled = pickle.loads(pickle.dumps(opt))
    out.append(("pickle", _params_of(unpickled), unpickled))
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    from_disk = torch.load(buf, weights_only=True)
    assert_equal_values(sd, from_disk, "torch.load(torch.save(state_dict))")
    params, saved = _make(cls, kw, init, master)
    saved.load_state_dict(from_disk)
    out.append(("torch.save", params, saved))
    return out


def _check_round_trips(cls, kw, dtype, master, shapes=SHAPES):
    init = _init(dtype, shapes)
    seq = _grad_seq(dtype, 5, seed=1, shapes=shapes)
    params, opt = _make(cls, kw, init, master)
    fresh_keys = [sorted(g) for g in opt.state_dict()["param_groups"]]
    with fallback_is_an_error():
        _run(params, opt, seq[:3])
        sd = copy.deepcopy(opt.state_dict())
        # No key added to the groups by stepping either (torch's 'differentiable', 'foreach'...).
        assert [sorted(g) for g in sd["param_groups"]] == fresh_keys
        copies = _copies(cls, kw, params, master, opt)
        assert_equal_values(sd, opt.state_dict(), "state_dict after copying")
        for name, _, copt in copies:
            assert_equal_values(sd, copt.state_dict(), f"{name}: state_dict")
        _run(params, opt, seq[3:])
        for name, cparams, copt in copies:
            _run(cparams, copt, seq[3:])
            try:
                assert_same(params, opt, cparams, copt)
            except AssertionError as e:
                raise AssertionError(f"{name}: the next steps differ") from e
            assert not core.stages(copt).fused_broken
    return opt


def _round_trip_params():
    """Every option set under every strategy, but the fused sets (each a compiled kernel per
    strategy: minutes of compilation with a cold cache) under FP32 and BF16 + Kahan alone; the
    fused step of every strategy is compared with the eager one in test_fused.py."""
    out = []
    for s in _set_params(OPTION_SETS):
        (ours, ref, desc, kw), marks = s.values, s.marks
        for strategy in STRATEGIES:
            if kw and kw.get("fused") and strategy.id not in ("fp32-none", "bf16-kahan"):
                continue
            out.append(pytest.param(ours, ref, desc, kw, *strategy.values, marks=marks,
                                    id=f"{s.id}-{strategy.id}"))
    return out


@pytest.mark.parametrize(("ours", "ref", "desc", "kw", "dtype", "master"), _round_trip_params())
def test_state_dict_round_trips_are_equal_and_resume_bit_for_bit(ours, ref, desc, kw, dtype,
                                                                  master):
    opt = _check_round_trips(ours, kw, dtype, master)
    if isinstance(kw.get("lr"), torch.Tensor):
        # torch's tensor lr: a one-element tensor is accepted, kept as given, and steps as the
        # same lr given as a number.
        assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)
        init, seq = _init(dtype), _grad_seq(dtype, 5, seed=1)
        pa, oa = _make(ours, kw, init, master)
        pb, ob = _make(ours, {**kw, "lr": kw["lr"].item()}, init, master)
        _run(pa, oa, seq)
        _run(pb, ob, seq)
        assert_same(pa, oa, pb, ob)


@pytest.mark.parametrize(("dtype", "master"), STRATEGIES)
def test_lamb_state_dict_round_trips(dtype, master):
    ours, _, _, kw = LAMB_SET
    _check_round_trips(ours, kw, dtype, master)


# The elementwise optimizers beside the first four, each with an option set that uses its
# buffers (torch's own sets of Adam and RAdam are checked against torch in test_adam_radam.py;
# Muon and Adafactor in test_whole_tensor_optimizers.py).
FAMILY_SETS = [
    (Adam, {"lr": 1e-2, "weight_decay": 0.1, "amsgrad": True}),
    (RAdam, {"lr": 1e-2, "weight_decay": 0.1, "decoupled_weight_decay": True}),
    (Lion, {"lr": 1e-3, "weight_decay": 0.1}),
    (StableAdamW, {"lr": 1e-2, "weight_decay": 0.01}),
]


@pytest.mark.parametrize(("dtype", "master"), STRATEGIES)
@pytest.mark.parametrize(("cls", "kw"), FAMILY_SETS, ids=lambda v: getattr(v, "__name__", ""))
def test_family_state_dict_round_trips(cls, kw, dtype, master):
    _check_round_trips(cls, kw, dtype, master)


@pytest.mark.parametrize(("ours", "ref", "desc", "kw"), _set_params(REFUSED_SETS, fused_slow=False))
def test_unsupported_options_are_refused(ours, ref, desc, kw):
    # torch accepts the set (on CPU, where capturable is not CUDA-only)...
    params = [nn.Parameter(torch.randn(3))]
    if not kw.get("capturable"):
        ref(params, **kw)
    # ...lowprec refuses differentiable at construction, naming it, and takes capturable.
    if kw.get("differentiable"):
        with pytest.raises(ValueError, match=r"differentiable"):
            ours(params, **kw)
    else:
        assert core.stages(ours(params, **kw)).capturable


def test_implementation_options_are_not_kept_in_the_groups():
    p = torch.randn(3, requires_grad=True)
    opt = AdamW([p], foreach=True, capturable=False, differentiable=False)
    keys = set(opt.param_groups[0])
    assert not keys & {"foreach", "capturable", "differentiable"}
    for clone in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        assert set(clone.param_groups[0]) == keys


# ------------------------------------------------------------------ 2. steps saved as numbers

NUMBER_STEP_CASES = [
    (SGD, {"lr": 0.05, "momentum": 0.9, "dampening": 0.5}),
    (AdamW, {"lr": 1e-2, "weight_decay": 0.1, "amsgrad": True}),
    (Adagrad, {"lr": 0.1, "lr_decay": 0.5, "weight_decay": 0.1}),
    (Lamb, {"lr": 1e-2, "weight_decay": 0.01}),
]


@pytest.mark.parametrize("number", [float, int], ids=["float", "int"])
@pytest.mark.parametrize(("dtype", "master"), STRATEGIES)
@pytest.mark.parametrize(("cls", "kw"), NUMBER_STEP_CASES, ids=lambda v: getattr(v, "__name__", ""))
def test_steps_saved_as_numbers_load_and_resume_bit_for_bit(cls, kw, dtype, master, number):
    init, seq = _init(dtype), _grad_seq(dtype, 6, seed=2)
    params, opt = _make(cls, kw, init, master)
    _run(params, opt, seq[:3])
    sd = copy.deepcopy(opt.state_dict())
    old = copy.deepcopy(sd)
    for st in old["state"].values():  # as torch wrote them before 1.12
        st["step"] = number(st["step"].item())
    resumed = []
    for state_dict in (sd, old):
        ps, o = _make(cls, kw, [p.detach().clone() for p in params], master)
        o.load_state_dict(state_dict)
        for p in ps:
            assert isinstance(o.state[p]["step"], torch.Tensor)
        _run(ps, o, seq[3:])
        resumed.append((ps, o))
    (pa, oa), (pb, ob) = resumed
    assert_same(pa, oa, pb, ob)


@pytest.mark.parametrize(("ours", "ref", "kw"), [
    (SGD, torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    (AdamW, torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    (Adagrad, torch.optim.Adagrad, {"lr": 0.1}),
], ids=["SGD", "AdamW", "Adagrad"])
def test_a_torch_checkpoint_with_number_steps_loads(ours, ref, kw):
    init, seq = _init(torch.float32), _grad_seq(torch.float32, 6, seed=3)
    params = [t.clone().requires_grad_() for t in init]
    topt = ref(params, foreach=False, **kw)
    _run(params, topt, seq[:3])
    sd = copy.deepcopy(topt.state_dict())
    old = copy.deepcopy(sd)
    for st in old["state"].values():
        if "step" in st:
            st["step"] = float(st["step"])
    runs = []
    for state_dict in (sd, old):
        ps = [p.detach().clone().requires_grad_() for p in params]
        o = ours(ps, master="none")
        o.load_state_dict(state_dict)
        _run(ps, o, seq[3:])
        runs.append((ps, o))
    assert_same(*runs[0], *runs[1])


# ------------------------------------------------------------------ 3. hooks

HOOK_PAIRS = [
    pytest.param(torch.optim.SGD, SGD, {"lr": 0.1, "momentum": 0.9}, "momentum_buffer", id="SGD"),
    pytest.param(torch.optim.AdamW, AdamW, {"lr": 1e-2}, "exp_avg", id="AdamW"),
]


def _hook_events(make, buffer):
    """Every hook call torch.optim's contract makes while stepping, saving and loading, with what
    each hook saw; ``make(params)`` builds the optimizer."""
    events = []
    w = torch.randn(4, 3, generator=torch.Generator().manual_seed(0)).requires_grad_()
    opt = make([w])

    def closure():
        events.append(("closure",))
        opt.zero_grad()
        loss = (w * w).sum()
        loss.backward()
        return loss

    def name(v):
        return "self" if v is opt else "closure" if v is closure else repr(v)

    def describe(args, kwargs):  # (args start with the optimizer itself, as torch passes them)
        return tuple(map(name, args)), tuple(sorted((k, name(v)) for k, v in kwargs.items()))

    h_pre = opt.register_step_pre_hook(
        lambda o, args, kwargs: events.append(("step_pre", o is opt, describe(args, kwargs))))
    opt.register_step_post_hook(
        lambda o, args, kwargs: events.append(("step_post", o is opt, describe(args, kwargs))))
    g_pre = torch_optimizer.register_optimizer_step_pre_hook(
        lambda o, args, kwargs: events.append(("global_pre", o is opt)))
    g_post = torch_optimizer.register_optimizer_step_post_hook(
        lambda o, args, kwargs: events.append(("global_post", o is opt)))
    try:
        w.grad = torch.ones_like(w)
        opt.step()
        opt.step(closure)
        opt.step(closure=closure)
        h_pre.remove()
        opt.step(closure)
    finally:
        g_pre.remove()
        g_post.remove()

    # A step pre-hook may replace the arguments.
    def swap(o, args, kwargs):
        events.append(("swap", describe(args, kwargs)))
        return args[:1], {"closure": closure}

    opt.register_step_pre_hook(swap)
    events.append(("loss", float(opt.step().detach())))

    opt.register_state_dict_pre_hook(lambda o: events.append(("sd_pre", o is opt)))

    def sd_post(o, sd):
        events.append(("sd_post", o is opt, sorted(sd)))
        return {**sd, "extra": 1}

    opt.register_state_dict_post_hook(sd_post)
    sd = opt.state_dict()
    events.append(("sd_keys", sorted(sd)))
    saved = copy.deepcopy(sd)

    w2 = w.detach().clone().requires_grad_()
    other = make([w2])

    def load_pre(o, sd):
        st = sd["state"]
        events.append(("load_pre", o is other, sorted(sd), sorted(st),
                       float(sd["param_groups"][0]["lr"])))
        return {**sd, "param_groups": [{**g, "lr": 0.125} for g in sd["param_groups"]],
                "state": {k: {**v, buffer: v[buffer] * 2} for k, v in st.items()}}

    def load_post(o):
        st = o.state.get(w2, {})
        events.append(("load_post", o is other, len(o.state), float(o.param_groups[0]["lr"]),
                       buffer in st and torch.equal(st[buffer], saved["state"][0][buffer] * 2)))

    other.register_load_state_dict_pre_hook(load_pre)
    other.register_load_state_dict_post_hook(load_post)
    other.load_state_dict(saved)
    st = other.state.get(w2, {})
    events.append(("load_result", float(other.param_groups[0]["lr"]),
                   buffer in st and torch.equal(st[buffer], saved["state"][0][buffer] * 2)))
    return events


def _compare_hook_events(ref, ours, kw, buffer, load):
    expected = _hook_events(lambda ps: ref(ps, foreach=False, **kw), buffer)
    got = _hook_events(lambda ps: ours(ps, master="none", **kw), buffer)
    expected, got = ([e for e in events if e[0].startswith("load") == load]
                     for events in (expected, got))
    assert [e[0] for e in got] == [e[0] for e in expected]  # the same calls in the same order
    for e, g in zip(expected, got, strict=True):
        if e[0] == "loss":
            assert math.isclose(e[1], g[1], rel_tol=1e-6), (e, g)
        else:
            assert g == e


@pytest.mark.parametrize(("ref", "ours", "kw", "buffer"), HOOK_PAIRS)
def test_step_and_state_dict_hooks_are_called_as_by_torch_optim(ref, ours, kw, buffer):
    _compare_hook_events(ref, ours, kw, buffer, load=False)


@pytest.mark.parametrize(("ref", "ours", "kw", "buffer"), HOOK_PAIRS)
def test_load_state_dict_hooks_are_called_as_by_torch_optim(ref, ours, kw, buffer):
    # The pre-hook sees the state dict given to load_state_dict (its state included) and may
    # return a changed one, which is what loads; the post-hook sees the loaded state.
    _compare_hook_events(ref, ours, kw, buffer, load=True)


# ------------------------------------------------------------------ 4. printing

_IMPL_KEYS = {"foreach", "fused", "capturable", "differentiable", "decoupled_weight_decay"}


def _repr_options(text):
    """``repr(optimizer)`` parsed: the class name and, per group, {option: printed value}."""
    lines = text.splitlines()
    name = lines[0].removesuffix(" (")
    groups = []
    for line in lines[1:]:
        if line.startswith("Parameter Group "):
            groups.append({})
        elif line.startswith("    "):
            key, _, value = line.strip().partition(": ")
            groups[-1][key] = value
    assert lines[-1] == ")", text
    return name, groups


def _printed_value(text):
    """A printed option as a value: numbers compare as numbers, and a one-element tensor as its
    number (torch's AdamW reshapes one-element tensor betas to 0-d, lowprec keeps them as given:
    'tensor([[0.9900]])' against 'tensor(0.9900)')."""
    text = re.sub(r"tensor\(\[*([-+0-9.e]+)\]*\)", r"\1", text)
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


@pytest.mark.parametrize(("ours", "ref", "desc", "kw"), _set_params(OPTION_SETS, fused_slow=False))
def test_repr_lists_the_group_options_as_torch_does(ours, ref, desc, kw):
    a, b = nn.Parameter(torch.randn(3)), nn.Parameter(torch.randn(2))
    torch_kw = {k: v for k, v in kw.items() if k != "foreach"}  # (not printed as an option)
    theirs = ref([{"params": [a]}, {"params": [b], "lr": 0.5}], **torch_kw)
    mine = ours([{"params": [a]}, {"params": [b], "lr": 0.5}], **kw)
    tname, tgroups = _repr_options(repr(theirs))
    name, groups = _repr_options(repr(mine))
    assert name == tname == ours.__name__
    assert len(groups) == len(tgroups) == 2
    for g, tg, group in zip(groups, tgroups, mine.param_groups, strict=True):
        # every option of the group is listed, printed as torch prints it
        assert list(g) == sorted(set(group) - {"params"})
        assert all(g[k] == f"{v}" for k, v in group.items() if k != "params")
        # and the options lowprec shares with torch print the same values (the same numbers:
        # torch's signatures default some floats to the int 0, printed "0" where lowprec's
        # 0.0 prints "0.0")
        shared = set(tg) - _IMPL_KEYS
        assert shared <= set(g), shared - set(g)
        assert {k: _printed_value(g[k]) for k in shared} == {
            k: _printed_value(tg[k]) for k in shared}


# ------------------------------------------------------------------ 5. named parameters


def _net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))


def _train(model, opt, steps=4):
    gen = torch.Generator().manual_seed(9)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(5, 4, generator=gen)).pow(2).sum().backward()
        opt.step()


def test_named_parameters_are_kept_as_torch_keeps_them():
    ref_model, named_model, plain_model = _net(), _net(), _net()
    ref = torch.optim.AdamW(ref_model.named_parameters(), lr=1e-2, foreach=False)
    named = AdamW(named_model.named_parameters(), lr=1e-2, master="none")
    plain = AdamW(plain_model.parameters(), lr=1e-2, master="none")
    names = [n for n, _ in ref_model.named_parameters()]
    assert ref.param_groups[0]["param_names"] == names
    assert named.param_groups[0]["param_names"] == names
    assert "param_names" not in plain.param_groups[0]
    for m, o in ((ref_model, ref), (named_model, named), (plain_model, plain)):
        _train(m, o)
    # the names change nothing in the steps
    assert_same(list(named_model.parameters()), named, list(plain_model.parameters()), plain)
    for a, b in zip(ref_model.parameters(), named_model.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
    sd, tsd = named.state_dict(), ref.state_dict()
    assert sd["param_groups"][0]["param_names"] == tsd["param_groups"][0]["param_names"]
    assert sd["param_groups"][0]["params"] == tsd["param_groups"][0]["params"]

    # Loading, as torch.optim loads: a checkpoint's names are taken, a checkpoint without names
    # leaves the optimizer's; the same through deepcopy and pickle.
    plain_sd = plain.state_dict()
    cases = []
    for build in (lambda m: torch.optim.AdamW(m.named_parameters(), lr=1e-2),
                  lambda m: AdamW(m.named_parameters(), lr=1e-2, master="none"),
                  lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2),
                  lambda m: AdamW(m.parameters(), lr=1e-2, master="none")):
        row = []
        for source in (sd, plain_sd):
            o = build(_net())
            o.load_state_dict(copy.deepcopy(source))
            row.append(o.param_groups[0].get("param_names"))
            row.append(copy.deepcopy(o).param_groups[0].get("param_names"))
            row.append(pickle.loads(pickle.dumps(o)).param_groups[0].get("param_names"))
        cases.append(row)
    assert cases[1] == cases[0]  # named lowprec as named torch
    assert cases[3] == cases[2]  # unnamed lowprec as unnamed torch


def test_named_parameter_groups_and_add_param_group():
    def build(cls, model, **kw):
        named = list(model.named_parameters())
        opt = cls([{"params": named[:2]}, {"params": named[2:3], "lr": 0.5}], lr=1e-2, **kw)
        opt.add_param_group({"params": named[3:], "lr": 0.25})
        return opt

    ref = build(torch.optim.AdamW, _net())
    ours = build(AdamW, _net(), master="none")
    assert [g["param_names"] for g in ours.param_groups] == [
        g["param_names"] for g in ref.param_groups]
    assert [g["param_names"] for g in ours.state_dict()["param_groups"]] == [
        g["param_names"] for g in ref.state_dict()["param_groups"]]


# ------------------------------------------------------------------ 6. errors

# torch's error cases where lowprec legitimately differs: desc -> (what lowprec does, reason).
ERROR_DIFFERENCES = {
    "a param group cannot have duplicate parameters": (
        "raises ValueError", "torch warns and keeps the duplicate; lowprec refuses it at "
        "construction (a tensor stepped twice per step is a bug), tested in test_optim.py"),
    "lr as Tensor doesn't work with foreach & not capturable": (
        "accepts", "foreach is ignored by lowprec, which reads a tensor lr on the host with any "
        "implementation; the run equals the float lr's bit for bit"),
    "betas must be either both floats or both Tensors": (
        "accepts", "lowprec reads each beta as a host number at each step, so mixing a float "
        "and a one-element tensor is well defined; the run equals the float betas' bit for bit"),
    r"betas\[0\] as a Tensor is not supported for capturable=False and foreach=True": (
        "accepts", "as above: foreach is ignored and tensor betas are read on the host"),
}


def _error_inputs():
    if _CO is None:
        return [pytest.param(None, None, None, marks=pytest.mark.skipif(_CO is None, reason=NO_DATA))]
    out = []
    for info in _CO.optim_db:
        ours = LOWPREC_OF.get(info.optim_cls)
        if ours is None:
            continue
        for e in info.optim_error_inputs_func(device="cpu", dtype=torch.float32):
            desc = e.optimizer_error_input.desc
            out.append(pytest.param(ours, info.optim_cls, e, id=_sid(ours, desc)))
    return out


def _to_number(v):
    if isinstance(v, torch.Tensor):
        return v.item()
    if isinstance(v, tuple):
        return tuple(_to_number(x) for x in v)
    return v


@pytest.mark.parametrize(("ours", "ref", "error_input"), _error_inputs())
def test_torch_error_inputs(ours, ref, error_input):
    inp = error_input.optimizer_error_input
    desc, kw = inp.desc, inp.kwargs
    at_step = error_input.error_on == _CO.OptimizerErrorEnum.STEP_ERROR
    expected = error_input.error_type

    def params():
        # (torch's sets with params=None fail on their options first; a real parameter makes
        # sure the option, not the missing parameters, is what raises)
        return inp.params if inp.params is not None else [nn.Parameter(torch.randn(1, 1))]

    def attempt(cls):
        ps = params()
        opt = cls(ps, **kw)
        for p in _params_of(opt):
            p.grad = torch.ones_like(p)
        opt.step()

    # torch, the reference, raises (or warns) for this input
    if issubclass(expected, Warning):
        with pytest.warns(expected):
            ref(params(), **kw)
    else:
        with pytest.raises(expected):
            attempt(ref)

    what, _ = ERROR_DIFFERENCES.get(desc, (None, None))
    if what == "accepts":
        init, seq = _init(torch.float32), _grad_seq(torch.float32, 3, seed=4)
        pa, oa = _make(ours, kw, init, "none")
        pb, ob = _make(ours, {k: _to_number(v) for k, v in kw.items()}, init, "none")
        _run(pa, oa, seq)
        _run(pb, ob, seq)
        assert_same(pa, oa, pb, ob)
        return
    if what == "raises ValueError":
        with pytest.raises(ValueError):
            ours(params(), **kw)
        return
    assert issubclass(expected, (ValueError, TypeError)), expected
    if at_step:
        opt = ours(params(), **kw)  # constructs, as torch's does
        for p in _params_of(opt):
            p.grad = torch.ones_like(p)
        with pytest.raises(expected):
            opt.step()
    else:
        with pytest.raises(expected):
            ours(params(), **kw)


def test_every_error_difference_is_a_torch_case():
    # (the table must not hide a case torch no longer publishes)
    if _CO is None:
        pytest.skip(NO_DATA)
    descs = {e.optimizer_error_input.desc for info in _CO.optim_db if info.optim_cls in LOWPREC_OF
             for e in info.optim_error_inputs_func(device="cpu", dtype=torch.float32)}
    assert set(ERROR_DIFFERENCES) <= descs


# ------------------------------------------------------------------ 7. fused == eager, every dtype

MATRIX_OPTIMIZERS = [
    (SGD, {"lr": 0.05, "momentum": 0.9}),
    (AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    (Adagrad, {"lr": 0.05, "weight_decay": 0.01}),
    (Lamb, {"lr": 1e-2, "weight_decay": 0.01}),
]
MATRIX_MASTERS = ["none", "kahan", "split", "stochastic", "fp32"]
MATRIX_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
MATRIX_STATE_DTYPES = [None, torch.float32, torch.bfloat16]
MATRIX_SHAPES = [(33,), (8, 6)]
# AdamW's every dtype x state dtype under master="none" (9 variants of one optimizer and strategy:
# past Dynamo's recompile limit of 8, were they one compiled function, the failure this guards
# against; the key is the same for every optimizer), and every optimizer x strategy with its
# default state dtype, the dtypes in turn so that each optimizer and each strategy meets every
# dtype (tests/_cases.py: pairwise; each variant costs seconds of compilation with a cold cache,
# and tests/test_fused.py crosses the four with every strategy on BF16 besides).
MATRIX = [
    (AdamW, dict(MATRIX_OPTIMIZERS)[AdamW], "none", dtype, state_dtype)
    for dtype in MATRIX_DTYPES for state_dtype in MATRIX_STATE_DTYPES
] + [
    (cls, kw, master, dtype, None)
    for (cls, kw), master, dtype in pairwise(MATRIX_OPTIMIZERS, MATRIX_MASTERS, MATRIX_DTYPES)
    if not (cls is AdamW and master == "none")
] + [
    # The elementwise optimizers beside the first four (Muon and Adafactor step whole tensors
    # eagerly: tests/test_whole_tensor_optimizers.py), every strategy on BF16, FP32, and Kahan
    # on FP16 (their kernels differ by dtype where the strategies do not).
    (cls, kw, master, dtype, None)
    for cls, kw in [(Adam, {"lr": 1e-2, "weight_decay": 0.1}), (RAdam, {"lr": 1e-2}),
                    (Lion, {"lr": 1e-3, "weight_decay": 0.1}),
                    (StableAdamW, {"lr": 1e-2, "weight_decay": 0.01})]
    for master, dtype in [*((m, torch.bfloat16) for m in MATRIX_MASTERS),
                          ("none", torch.float32), ("kahan", torch.float16)]
]


@pytest.mark.slow
def test_fused_equals_eager_for_every_dtype_in_one_process(monkeypatch, caplog):
    """Every optimizer x strategy x parameter dtype (and state dtypes: MATRIX),
    fused against eager, in one process: compiled kernels are keyed by dtype, so no function
    recompiles into Dynamo's limit (a fallback to eager is an error here, not a warning)."""
    # (torch's structured-trace logger writes every compilation at DEBUG: megabytes of captured
    # log on a failure, and none of it about the failure)
    caplog.set_level(logging.INFO, logger="torch.__trace")
    calls = []
    real = compiled._compiled_kernel

    def spy(*args, **kwargs):
        kernel = real(*args, **kwargs)
        return lambda *a, **k: calls.append(1) or kernel(*a, **k)

    monkeypatch.setattr(compiled, "_compiled_kernel", spy)
    failures, ran, index = [], 0, 0
    for cls, kw, master, dtype, state_dtype in MATRIX:
        case = (cls.__name__, master, str(dtype)[6:], str(state_dtype)[6:])
        index += 1
        init = _init(dtype, MATRIX_SHAPES, seed=index)
        seq = _grad_seq(dtype, 3, seed=index, shapes=MATRIX_SHAPES)
        try:
            if master == "split" and dtype == torch.float16:
                for fused in (False, True):  # split is BF16-only for 16-bit params
                    with pytest.raises(ValueError, match="bfloat16"):
                        _make(cls, kw, init, master, fused=fused,
                              state_dtype=state_dtype)
                continue
            runs = []
            for fused in (False, True):
                before = len(calls)
                with fallback_is_an_error():
                    params, opt = _make(cls, kw, init, master, fused=fused,
                                        state_dtype=state_dtype)
                    _run(params, opt, seq)
                assert (len(calls) > before) == fused, "compiled calls"
                assert not core.stages(opt).fused_broken
                runs.append((params, opt))
            if dtype == torch.float32:  # every strategy leaves FP32 plain
                assert all(st["master"] == "none" for st in runs[1][1].state.values())
            differ = sum(int((bits(p) != bits(q)).sum())
                         for p, q in zip(runs[0][0], runs[1][0], strict=True))
            assert differ == 0, f"fused != eager in {differ} parameter elements"
            assert_same(*runs[0], *runs[1])
            ran += 1
        except Exception as e:  # (collected: one report of every failing case)
            failures.append((case, f"{type(e).__name__}: {str(e)[:300]}"))
    assert not failures, "\n".join(map(str, failures))
    assert ran == sum(not (m == "split" and d == torch.float16) for _, _, m, d, _ in MATRIX)


# ------------------------------------------------------------------ 8. SGD momentum mid-run


def _rel_close(a, b, rel=1e-6):
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item() <= rel


@pytest.mark.parametrize("fused", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["eager", "fused"])
@pytest.mark.parametrize("schedule", [
    pytest.param([(0.0, 0.0)] * 3 + [(0.9, 0.0)] * 5, id="on"),
    pytest.param([(0.0, 0.5)] * 3 + [(0.9, 0.5)] * 5, id="on-dampening"),
    pytest.param([(0.0, 0.0)] * 2 + [(0.9, 0.0)] * 2 + [(0.0, 0.0)] * 2 + [(0.9, 0.0)] * 2,
                 id="on-off-on"),
    pytest.param([(0.0, 0.3)] * 2 + [(0.9, 0.3)] * 2 + [(0.0, 0.3)] * 2 + [(0.5, 0.3)] * 2,
                 id="on-off-on-dampening"),
])
def test_sgd_momentum_turned_on_mid_run_matches_torch(schedule, fused):
    init, seq = _init(torch.float32), _grad_seq(torch.float32, len(schedule), seed=6)
    ref_params = [t.clone().requires_grad_() for t in init]
    ref = torch.optim.SGD(ref_params, lr=0.1, foreach=False)
    params, opt = _make(SGD, {"lr": 0.1}, init, "none", fused=fused)
    with fallback_is_an_error():
        for (momentum, dampening), grads in zip(schedule, seq, strict=True):
            for o in (ref, opt):
                o.param_groups[0].update(momentum=momentum, dampening=dampening)
            _run(ref_params, ref, [grads])
            _run(params, opt, [grads])
            for p, q in zip(params, ref_params, strict=True):
                assert _rel_close(p, q), (momentum, dampening)
    assert not core.stages(opt).fused_broken
    for p, q in zip(params, ref_params, strict=True):
        if "momentum_buffer" in ref.state[q]:
            assert _rel_close(opt.state[p]["momentum_buffer"], ref.state[q]["momentum_buffer"])
