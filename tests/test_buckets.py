"""Buckets (``lowprec.optim.buckets``): from the first step, a group's state is views of flat
buffers and a step takes a few compiled calls per bucket, whatever the number of tensors; a
parameter that cannot be gathered with others is a bucket of one.

The reference is the step without buckets (``tests/_steps.py``'s ``full_steps``: every
parameter's full step, eager per tensor), itself checked against torch.optim
elsewhere; every comparison is bit for bit. Each change between two steps that the buckets must
notice or carry through (``CHANGES``) is applied to both.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import pathlib
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lowprec.optim import (
    SGD,
    Adafactor,
    Adagrad,
    AdamW,
    Lamb,
    Lion,
    StableAdamW,
    buckets,
    compiled,
    core,
    driver,
)
from tests import _steps
from tests._same import assert_same, bits
from tests._steps import CHANGES, STEPS, full_steps

# (fused: a compiled step that falls back to eager fails the test, tests/_fallback.py)
pytestmark = pytest.mark.fused

# Even-sized tensors (one bucket), an odd-sized and a one-element one (stepped alone).
SHAPES = [(300, 256), (64,), (32, 4), (7,), (1,), (16, 6)]


def _layout(opt):
    """The buckets ``driver.flatten`` laid out last for ``opt``."""
    return core.stages(opt).buckets


def _adamw_kahan(params):
    return AdamW(params, lr=1e-2, weight_decay=0.1, master="kahan", fused=True, seed=3)


def _run(make, change, *, use_buckets, monkeypatch, steps=STEPS, scaled=None, **shapes):
    """``_steps.run``'s steps (fresh random gradients, ``change`` before step CHANGE_AT), with
    buckets or without them. Returns the parameters, the optimizer and how many steps the
    buckets took as they were laid out."""
    return _steps.run(make, change, use_buckets=use_buckets, steps=steps, scaled=scaled, **shapes)


# Changes after which the next step still goes through the buckets (the others take a full
# step, which lays the buckets out again).
KEPT = ("nothing", "momentum_in_place", "lr_and_betas", "step_count_written",
        "step_counts_past_2_24", "step_counts_written_through_data", "a_grad_missing",
        "grads_in_fp32", "a_grad_in_fp32", "grad_non_contiguous")


@pytest.mark.parametrize("name", list(CHANGES))
def test_buckets_equal_the_step_without_them_across_a_change(name, monkeypatch):
    """Each change a step must notice or carry through: a step through the buckets gives the
    bits of the full step, before and after it; the buckets laid out at the first step are used
    from the second on, and again after a change that made the step lay them out anew."""
    pa, oa, _ = _run(_adamw_kahan, CHANGES[name], use_buckets=False, monkeypatch=monkeypatch)
    pb, ob, taken = _run(_adamw_kahan, CHANGES[name], use_buckets=True, monkeypatch=monkeypatch)
    assert_same(pa, oa, pb, ob)
    # Step 0 creates the state; a change that forces a full step costs one step.
    assert taken >= (STEPS - 1 if name in KEPT else STEPS - 2), taken


def test_a_deleted_state_entry_takes_the_full_step(monkeypatch):
    """A state entry deleted between steps (the full step creates it again, as a new buffer's
    first use): the buckets notice, and the bits are the step's without them."""
    def delete(params, opt, saved):
        del opt.state[params[2]]["exp_avg"]

    pa, oa, _ = _run(_adamw_kahan, delete, use_buckets=False, monkeypatch=monkeypatch)
    pb, ob, taken = _run(_adamw_kahan, delete, use_buckets=True, monkeypatch=monkeypatch)
    assert_same(pa, oa, pb, ob)
    assert taken == STEPS - 2, taken


@pytest.mark.parametrize("make", [
    lambda ps: SGD(ps, lr=1e-2, momentum=0.9, master="split", fused=True),
    lambda ps: AdamW(ps, lr=1e-2, master="fp32", state_dtype=torch.float32, fused=True),
    lambda ps: Lion(ps, lr=1e-3, weight_decay=0.1, master="kahan", fused=True),
    lambda ps: AdamW(ps, lr=1e-2, weight_decay=0.1, master="stochastic", fused=True, seed=5),
    lambda ps: AdamW(ps, lr=1e-2, weight_decay=0.1, master="stochastic", fused=False, seed=5),
    lambda ps: SGD(ps, lr=1e-2, momentum=0.9, master="stochastic", fused=True, seed=5),
], ids=["sgd-split", "adamw-fp32", "lion-kahan", "adamw-stochastic", "adamw-stochastic-eager",
        "sgd-stochastic"])
def test_buckets_equal_the_step_without_them_for_other_rules(make, monkeypatch):
    pa, oa, _ = _run(make, CHANGES["a_grad_missing"], use_buckets=False, monkeypatch=monkeypatch)
    pb, ob, taken = _run(make, CHANGES["a_grad_missing"], use_buckets=True,
                         monkeypatch=monkeypatch)
    assert_same(pa, oa, pb, ob)
    assert taken == STEPS - 1


# Parameters of equal sizes (64, 64; 128 three times), which a rule with whole-tensor sums steps
# as rows, and sizes of their own.
NORM_SHAPES = [(300, 256), (64,), (8, 8), (32, 4), (7,), (16, 8), (1,), (128,), (30,)]


def _lamb_kahan(ps):
    return Lamb(ps, lr=1e-2, weight_decay=0.1, master="kahan", fused=True)


def _every_other_step(step):
    return step % 2 == 0


# (each compiled variant costs ~15 s of compilation with a cold cache: a few, each covering much)
@pytest.mark.parametrize(("make", "change", "scaled"), [
    (_lamb_kahan, "a_grad_missing", _every_other_step),
    (lambda ps: StableAdamW(ps, lr=1e-2, weight_decay=0.1, master="kahan", fused=True),
     "state_loaded", None),
    (lambda ps: Lamb(ps, lr=1e-2, master="stochastic", fused=True, seed=5), "nothing", None),
    (lambda ps: Lamb(ps, lr=1e-2, master="split", state_dtype=torch.float32, fused=False),
     "a_grad_missing", _every_other_step),
], ids=["lamb-kahan-scaled", "stable-adamw-kahan-loaded", "lamb-stochastic",
        "lamb-split-eager-scaled"])
def test_buckets_of_rules_with_norms_equal_the_step_without_them(make, change, scaled,
                                                                 monkeypatch):
    """LAMB's trust ratio and StableAdamW's RMS need each parameter's sums: a piece of parameters
    of one size is stepped as rows, its sums per row (FP64, so that the order of adding does not
    show), a parameter of a size of its own alone; the bits are the step's without buckets."""
    pa, oa, _ = _run(make, CHANGES[change], use_buckets=False, monkeypatch=monkeypatch,
                     scaled=scaled, shapes=NORM_SHAPES)
    pb, ob, taken = _run(make, CHANGES[change], use_buckets=True, monkeypatch=monkeypatch,
                         scaled=scaled, shapes=NORM_SHAPES)
    assert_same(pa, oa, pb, ob)
    assert taken >= STEPS - 3, taken
    bucket, *alone = sorted(_layout(ob).buckets, key=lambda b: -len(b.params))
    assert [b.params[0].numel() for b in alone] == [7]  # (an odd size: a bucket of one)
    pieces = bucket._pieces(0, len(bucket.params))
    assert sorted(b - a for a, b in pieces) == [1, 1, 2, 3], pieces


def test_a_parameter_no_bucket_gathers_is_a_bucket_of_one(monkeypatch):
    """LAMB with 8-bit state: its small parameters (FP32 state) go into a bucket, its 8-bit one
    (codes are not stepped as rows) into a bucket of one; from its second step under each
    step on, that one runs the compiled step its bucket prepared at the first (on the CPU a
    scaled step is the plain one on gradients unscaled in place: loss_scale.skipped_on_host),
    where a parameter stepped on its own prepared it anew at every step; the bits are the step's
    without buckets."""
    shapes = [(32, 256), (64,), (8, 8), (128,), (16, 8), (30,)]  # (the first: 8-bit state)
    make = lambda ps: Lamb(ps, lr=1e-2, master="kahan", state_dtype="8bit", fused=True)  # noqa: E731
    pa, oa, _ = _run(make, CHANGES["a_grad_missing"], use_buckets=False, monkeypatch=monkeypatch,
                     scaled=_every_other_step, shapes=shapes)
    prepared = []
    real = compiled.prepare_fused
    monkeypatch.setattr(compiled, "prepare_fused",
                        lambda rule, storage, p, *a, **k:
                        prepared.append(p.numel()) or real(rule, storage, p, *a, **k))
    pb, ob, taken = _run(make, CHANGES["a_grad_missing"], use_buckets=True,
                         monkeypatch=monkeypatch, scaled=_every_other_step, shapes=shapes)
    assert_same(pa, oa, pb, ob)
    assert taken == STEPS - 1, taken
    assert [len(b.params) for b in _layout(ob).buckets] == [1, 5] and not _layout(ob).rest
    # Step 0 (scaled) prepares it, the plain step's call; 1-5 (plain and scaled) redo it.
    assert prepared.count(32 * 256) == 1, prepared


def test_rows_of_fp32_parameters_equal_the_step_without_them(device):
    """The rows off the CPU's BF16 pairs (FP32 parameters here; every parameter on a GPU): the
    plain kernels on 2-d tensors, each row's sums its own, the bits of the step without
    buckets."""
    shapes = [(64,), (8, 8), (128,), (16, 8), (30,)]
    gen = torch.Generator().manual_seed(0)
    made = [[torch.randn(s, generator=gen).to(device).requires_grad_() for s in shapes]]
    made.append([p.detach().clone().requires_grad_() for p in made[0]])
    opts = [Lamb(ps, lr=1e-2, weight_decay=0.1, master="none", fused=True) for ps in made]
    for _ in range(3):
        grads = [torch.randn(s, generator=gen).to(device) for s in shapes]
        for ps, opt, use in zip(made, opts, (True, False), strict=True):
            for p, g in zip(ps, grads, strict=True):
                p.grad = g.clone()
            if use:
                opt.step()
            else:
                with full_steps():  # (the step without buckets)
                    opt.step()
    (bucket,) = _layout(opts[0]).buckets
    assert [b - a for a, b in bucket._pieces(0, len(bucket.params))] == [1, 2, 2]
    assert all(f.pairs is None for f in bucket.prepared.values())
    for a, b in zip(*made, strict=True):
        assert torch.equal(a, b)
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opts[0].state[a][k], opts[1].state[b][k])


@pytest.mark.parametrize("make", [
    lambda ps: Adafactor(ps, lr=1e-2, master="kahan", fused=True),
    lambda ps: Lamb(ps, lr=1e-2, master="kahan", state_dtype="8bit", fused=True),
], ids=["adafactor", "lamb-8bit"])
def test_a_step_no_bucket_gathers_goes_through_the_layout(make, monkeypatch):
    """Where no bucket gathers parameters (whole-tensor rules: each by its own step; norms with
    8-bit state: each a bucket of one, its call prepared once: 128 x 4096, LAMB with 8-bit
    state, 122 ms a step prepared anew, 68 kept), every step, the first included, still goes
    through the layout; the bits are those of the full step."""
    shapes = [(4096,)] * 3
    pa, oa, _ = _run(make, CHANGES["nothing"], use_buckets=False, monkeypatch=monkeypatch,
                     steps=4, shapes=shapes)
    prepared = []
    real = compiled.prepare_fused
    monkeypatch.setattr(compiled, "prepare_fused",
                        lambda *a, **k: prepared.append(1) or real(*a, **k))
    pb, ob, taken = _run(make, CHANGES["nothing"], use_buckets=True, monkeypatch=monkeypatch,
                         steps=4, shapes=shapes)
    assert_same(pa, oa, pb, ob)
    alone = isinstance(ob, Adafactor)
    assert [len(b.params) for b in _layout(ob).buckets] == ([] if alone else [1, 1, 1])
    assert len(_layout(ob).rest) == (3 if alone else 0)
    assert taken == 3, taken
    assert len(prepared) == (0 if isinstance(ob, Adafactor) else 3), prepared


@pytest.mark.parametrize("limit", [1 << 20, 1024], ids=["gathered", "large-alone"])
@pytest.mark.parametrize("change", ["grads_in_fp32", "grad_non_contiguous", "state_loaded"])
def test_stochastic_rounding_in_buckets_equals_the_step_without_them(change, limit,
                                                                      monkeypatch):
    """Stochastic rounding's random bits are keyed per parameter and element: a gathered piece
    takes one key per parameter and each word's parameter and index (as a batch of small
    parameters does), a parameter alone its own key; either way every element gets the bits
    of the step without buckets."""
    monkeypatch.setitem(buckets._GATHERED, "cpu", limit)

    def make(ps):
        return AdamW(ps, lr=1e-2, weight_decay=0.1, master="stochastic", fused=True, seed=7)

    pa, oa, _ = _run(make, CHANGES[change], use_buckets=False, monkeypatch=monkeypatch)
    pb, ob, taken = _run(make, CHANGES[change], use_buckets=True, monkeypatch=monkeypatch)
    assert_same(pa, oa, pb, ob)
    assert taken >= (STEPS - 1 if change != "state_loaded" else STEPS - 2), taken
    assert _layout(ob).buckets[0].keyed


@pytest.mark.parametrize("name", ["nothing", "a_grad_missing", "grads_in_fp32",
                                  "grad_non_contiguous", "state_loaded"])
@pytest.mark.parametrize("scaled", [lambda step: True, lambda step: step % 2 == 0],
                         ids=["every-step", "even-steps"])
def test_buckets_under_a_loss_scaler_equal_the_step_without_them(name, scaled, monkeypatch):
    """Steps under the loss-scaler contract (``grad_scale`` and ``found_inf``; one step sees an
    inf and is skipped), alone or between plain steps: the buckets' bits are the full step's,
    their unscaled gradients and the scaler's ``found_inf`` included, and the buckets take the
    scaled steps too."""
    found = []

    def make(ps):
        opt = _adamw_kahan(ps)
        real = opt.step

        def step(*args, found_inf=None, **kw):
            out = real(*args, found_inf=found_inf, **kw)
            if found_inf is not None:
                found.append(found_inf.item())
            return out
        opt.step = step
        return opt

    pa, oa, _ = _run(make, CHANGES[name], use_buckets=False, monkeypatch=monkeypatch,
                     scaled=scaled)
    grads_a, found_a = [p.grad for p in pa], found[:]
    found.clear()
    pb, ob, taken = _run(make, CHANGES[name], use_buckets=True, monkeypatch=monkeypatch,
                         scaled=scaled)
    assert_same(pa, oa, pb, ob)
    assert found == found_a and 1.0 in found
    for ga, gb in zip(grads_a, [p.grad for p in pb], strict=True):
        assert (ga is None) == (gb is None)
        if ga is not None:
            torch.testing.assert_close(gb, ga, rtol=0, atol=0)
    assert taken >= (STEPS - 1 if name in KEPT else STEPS - 2), taken


@pytest.mark.parametrize("name", ["nothing", "a_grad_missing", "grads_in_fp32",
                                  "step_count_written", "state_loaded", "lr_and_betas"])
@pytest.mark.parametrize("scaled", [lambda step: True, lambda step: step % 2 == 0],
                         ids=["every-step", "even-steps"])
def test_buckets_with_counts_on_the_device_equal_the_step_without_them(name, scaled,
                                                                        monkeypatch):
    """A GPU's way under a loss scaler, run on the CPU (``driver.skipped_on_host`` patched off: the
    kernels take the scaler's inputs): the step's numbers are made from the bucket's one count.
    Bit for bit the full step's (which makes them per parameter), across the changes a
    step must notice; a count written in place is seen through the counts' version counter. A
    bucket with a parameter missing its gradient, or counts that differ, steps its parameters in
    runs of equal counts, each with its first count's numbers (``_Bucket.runs``), still laid
    out."""
    monkeypatch.setattr(driver, "skipped_on_host", lambda *args, **kwargs: None)
    pa, oa, _ = _run(_adamw_kahan, CHANGES[name], use_buckets=False, monkeypatch=monkeypatch,
                     scaled=scaled)
    pb, ob, taken = _run(_adamw_kahan, CHANGES[name], use_buckets=True, monkeypatch=monkeypatch,
                         scaled=scaled)
    assert_same(pa, oa, pb, ob)
    if name != "state_loaded":
        assert taken == STEPS - 1, taken


# Parameters of whole blocks (8-bit or 4-bit state, in one bucket) and smaller ones (FP32 state:
# a bucket of their own, or stepped alone).
QUANTIZED_SHAPES = [(64, 256), (300,), (32, 128), (4096,), (7,), (16, 6)]


@pytest.mark.parametrize("name", ["nothing", "a_grad_missing", "state_loaded"])
@pytest.mark.parametrize("scaled", [None, lambda step: True], ids=["plain", "scaled"])
@pytest.mark.parametrize("state_dtype", ["8bit", "4bit"])
def test_buckets_with_quantized_state_equal_the_step_without_them(state_dtype, scaled, name,
                                                                   monkeypatch):
    """8-bit and 4-bit state: codes and their scales (one per block) are laid out in flat
    buffers as the other state is, with the bits of the full step, under a loss scaler too."""
    monkeypatch.setattr(_steps, "SHAPES", QUANTIZED_SHAPES)

    def make(ps):
        return AdamW(ps, lr=1e-2, weight_decay=0.1, master="kahan", state_dtype=state_dtype,
                     fused=True)

    pa, oa, _ = _run(make, CHANGES[name], use_buckets=False, monkeypatch=monkeypatch,
                     scaled=scaled)
    pb, ob, taken = _run(make, CHANGES[name], use_buckets=True, monkeypatch=monkeypatch,
                         scaled=scaled)
    assert_same(pa, oa, pb, ob)
    assert taken >= (STEPS - 1 if name in KEPT else STEPS - 2), taken
    coded = [b for b in _layout(ob).buckets if b.qstate]
    assert len(coded) == 1 and len(coded[0].params) == 3, _layout(ob).buckets
    scale = coded[0].flats["exp_avg_scale"]
    assert scale.numel() == sum(p.numel() for p in coded[0].params) // 256


@pytest.mark.parametrize("mode", ["skip", "unscale"])
def test_buckets_under_a_loss_scaler_on_the_device(mode, device):
    """A scaler's inputs on the parameters' device (on a GPU: the counts stay there and the
    buckets make the step's numbers there): ``found_inf`` alone (the
    gradients unscaled already, as after GradScaler's ``unscale_``) or with ``grad_scale``. A
    step the flag marks is skipped through the buckets, bit for bit with the full step, and the
    counts stay."""
    runs = []
    for use in (False, True):
        params = [torch.ones(s, device=device).to(torch.bfloat16).requires_grad_()
                  for s in SHAPES]
        opt = _adamw_kahan(params)
        for step in range(5):
            scale = 256.0 if mode == "unscale" else 1.0
            for p in params:
                p.grad = torch.full_like(p, 0.01 * (step + 1) * scale)
            found = torch.full((), float(step == 2), device=device)
            kw = {"found_inf": found}
            if mode == "unscale":
                kw["grad_scale"] = torch.full((), scale, device=device)
            if use:
                opt.step(**kw)
            else:
                with full_steps():
                    opt.step(**kw)
        if use:
            assert _layout(opt) is not None
        assert all(opt.state[p]["step"].item() == 4 for p in params)
        runs.append((params, opt))
    assert_same(*runs[0], *runs[1])
    for a, b in zip(runs[0][0], runs[1][0], strict=True):  # (the unscaled gradients too)
        assert torch.equal(a.grad, b.grad)


def test_state_becomes_views_of_one_buffer_per_bucket_and_parameters_stay_put(device):
    params = [torch.zeros(s, device=device, dtype=torch.bfloat16, requires_grad=True)
              for s in SHAPES]
    ptrs = [p.data_ptr() for p in params]
    opt = _adamw_kahan(params)
    for _ in range(3):
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
    bucket, odd = _layout(opt).buckets
    inside = [p for p in params if p.numel() % 2 == 0 and p.numel() > 1]
    assert bucket.params == inside
    # (an odd size a bucket of one, its state its own tensors; one element stepped on its own)
    assert [p.numel() for p in odd.params] == [7] and len(_layout(opt).rest) == 1
    assert opt.state[odd.params[0]]["exp_avg"] is odd.views["exp_avg"][0]
    for name in ("exp_avg", "exp_avg_sq", "compensation"):
        storages = {opt.state[p][name].untyped_storage().data_ptr() for p in inside}
        assert storages == {bucket.flats[name].untyped_storage().data_ptr()}, name
    assert {opt.state[p]["step"].untyped_storage().data_ptr() for p in inside} == {
        bucket.counts.untyped_storage().data_ptr()}
    assert all(opt.state[p]["step"].item() == 3 for p in params)
    # (the parameters keep their own storage: Accelerate's checkpoints drop shared ones)
    assert [p.data_ptr() for p in params] == ptrs


class _Ops(TorchDispatchMode):
    """The names of the aten ops run under it."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("make", [
    _adamw_kahan,
    lambda ps: SGD(ps, lr=1e-2, momentum=0.9, master="split", fused=True),
    lambda ps: AdamW(ps, lr=1e-2, master="fp32", state_dtype="8bit", fused=True),
], ids=["adamw-kahan", "sgd-split", "adamw-fp32-8bit"])
def test_the_first_step_makes_the_state_in_the_buckets_buffers(make, monkeypatch):
    """New state is made where the buckets keep it: no buffer per parameter filled and then
    copied into a flat one (which held its largest buffer's bytes over the state's)."""
    params = [torch.zeros(s, dtype=torch.bfloat16, requires_grad=True)
              for s in SHAPES if s[0] % 2 == 0]  # (in buckets)
    opt = make(params)
    for p in params:
        p.grad = torch.ones_like(p)
    ops = _Ops()
    for module, name in ((driver, "flatten"), (core, "init_state")):  # (the ops they run)
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _f=real, **k: ops.__enter__() and (
            _f(*a, **k), ops.__exit__(None, None, None))[0])
    opt.step()
    assert "aten._foreach_copy_.default" not in ops.names
    assert "aten.full_like.default" not in ops.names
    buckets = [b for b in _layout(opt).buckets if len(b.params) > 1]
    assert buckets
    for bucket in buckets:
        for name, flat in bucket.flats.items():
            assert all(opt.state[p][name]._base is flat._base for p in bucket.params), name


# (the benchmark's count of a step's host calls: benchmarks/step_calls.py)
_spec = importlib.util.spec_from_file_location(
    "step_calls", pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "step_calls.py")
step_calls = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(step_calls)


def _scaled(opt):
    """``opt`` stepped under the loss-scaler contract, as GradScaler sets it up."""
    device = opt.param_groups[0]["params"][0].device
    opt.grad_scale = torch.ones((), device=device)
    opt.found_inf = torch.zeros((), device=device)
    return opt


@pytest.mark.parametrize("make", [
    _adamw_kahan,
    lambda ps: _scaled(_adamw_kahan(ps)),
    lambda ps: AdamW(ps, lr=1e-2, master="kahan", state_dtype="8bit", fused=True),
    lambda ps: SGD(ps, lr=1e-2, momentum=0.9, master="split", fused=True),
    lambda ps: Lamb(ps, lr=1e-2, master="kahan", fused=True),
], ids=["adamw-kahan", "adamw-kahan-scaled", "adamw-kahan-8bit", "sgd-split", "lamb-kahan"])
def test_host_calls_per_step_do_not_grow_with_the_number_of_tensors(make, device):
    """Issue 39's target: a step's operator and compiled calls at 512 tensors at most twice those
    at 16 (the step without buckets made ~9 per tensor, ~18 under a loss scaler, ~30 with 8-bit
    state)."""
    calls = {}
    for n in (16, 512):
        # (4096 elements: the smallest parameter that gets 8-bit state)
        params = [torch.randn(4096, device=device).to(torch.bfloat16).requires_grad_()
                  for _ in range(n)]
        for p in params:
            p.grad = torch.randn_like(p)
        opt = make(params)
        opt.step()  # (creates the state and lays the buckets out)
        opt.step()
        calls[n] = step_calls.host_calls(opt.step)[0]
        assert _layout(opt) is not None
    assert calls[512] <= 2 * calls[16], calls


def test_a_model_moved_after_buckets_is_laid_out_again():
    """``model.to(...)`` (here: to the same device, a new copy of each parameter) rebinds the
    parameters: the next step notices, takes a full step and lays the buckets out again,
    with the bits of a run that never had buckets."""
    params = [torch.randn(s).to(torch.bfloat16).requires_grad_() for s in SHAPES]
    opt = _adamw_kahan(params)
    for step in range(4):
        for p in params:
            p.grad = torch.full_like(p, 0.01 * (step + 1))
        if step == 2:
            for p in params:
                p.data = p.data.clone()
            assert not _layout(opt).buckets[0].current(opt)
        opt.step()
    assert _layout(opt).buckets[0].current(opt)
    assert all(opt.state[p]["step"].item() == 4 for p in params)


def test_a_hogwild_model_in_shared_memory_is_stepped_in_place():
    """Parameters in shared memory (``share_memory_()``: other processes read and step them)
    are stepped where they are, and equal a run without buckets."""
    runs = []
    for use in (False, True):
        params = [torch.ones(s).to(torch.bfloat16).share_memory_().requires_grad_()
                  for s in SHAPES]
        ptrs = [p.data_ptr() for p in params]
        opt = _adamw_kahan(params)
        for step in range(3):
            for p in params:
                p.grad = torch.full_like(p, 0.01 * (step + 1))
            if use:
                opt.step()
            else:
                with full_steps():
                    opt.step()
        assert [p.data_ptr() for p in params] == ptrs and all(p.is_shared() for p in params)
        if use:
            assert _layout(opt) is not None
        runs.append((params, opt))
    assert_same(*runs[0], *runs[1])


def test_an_option_that_adds_a_buffer_lays_the_buckets_out_again(monkeypatch):
    """SGD's momentum turned on after the first steps: its buffer is created by the full step
    (as torch.optim creates it), and the buckets are laid out again with it."""
    def momentum_on(params, opt, saved):
        opt.param_groups[0]["momentum"] = 0.9

    def make(ps):
        return SGD(ps, lr=1e-2, momentum=0.0, master="kahan", fused=True)

    pa, oa, _ = _run(make, momentum_on, use_buckets=False, monkeypatch=monkeypatch)
    pb, ob, taken = _run(make, momentum_on, use_buckets=True, monkeypatch=monkeypatch)
    assert_same(pa, oa, pb, ob)
    assert taken == STEPS - 2
    assert "momentum_buffer" in _layout(ob).buckets[0].names


def test_a_large_non_contiguous_gradient_is_gathered_on_its_own(monkeypatch):
    """A parameter too large to share a gathered piece (``buckets._GATHERED``, lowered here)
    with a non-contiguous gradient: gathered into a buffer of its own size, with the bits of
    the step without buckets."""
    monkeypatch.setitem(buckets._GATHERED, "cpu", 1024)
    runs = []
    for use in (False, True):
        params = [torch.ones(s).to(torch.bfloat16).requires_grad_() for s in [(64, 32), (40,)]]
        opt = _adamw_kahan(params)
        for step in range(3):
            for p in params:
                g = torch.full(p.shape[::-1], 0.01 * (step + 1), dtype=torch.bfloat16)
                p.grad = g.t() if p.dim() == 2 else g
            if use:
                opt.step()
            else:
                with full_steps():
                    opt.step()
        runs.append((params, opt))
    assert _layout(runs[1][1]) is not None
    assert_same(*runs[0], *runs[1])


def test_invalid_option_set_between_steps_raises_and_writes_nothing(monkeypatch):
    params, opt, _ = _run(_adamw_kahan, CHANGES["nothing"], use_buckets=True,
                          monkeypatch=monkeypatch, steps=3)
    before = [p.detach().clone() for p in params]
    state = copy.deepcopy(opt.state_dict())
    opt.param_groups[0]["lr"] = -1.0
    with pytest.raises(ValueError, match=r"parameter group 0.*lr"):
        opt.step()
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(before, params, strict=True))
    after = opt.state_dict()
    for k, st in state["state"].items():
        for name, v in st.items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(v, after["state"][k][name]), name
    opt.param_groups[0]["lr"] = 1e-2
    opt.step()  # and it goes on


@pytest.mark.fallback
def test_a_compile_failure_in_the_buckets_falls_back_to_their_eager_step(monkeypatch):
    """A kernel that fails to compile (here: every kernel, from the third step on) leaves
    nothing written; the buckets then step eagerly, with the bits of an eager optimizer."""
    params, opt, _ = _run(_adamw_kahan, CHANGES["nothing"], use_buckets=True,
                          monkeypatch=monkeypatch, steps=2)
    ref_params = [p.detach().clone().requires_grad_() for p in params]
    ref = AdamW(ref_params, lr=1e-2, weight_decay=0.1, master="kahan", fused=False, seed=3)
    ref.load_state_dict(opt.state_dict())
    ref.param_groups[0]["fused"] = False  # (the checkpoint's group brings the saver's fused=True)

    def broken(self, *args, **kwargs):
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(compiled._Kernel, "__call__", broken)
    for step in range(2):
        for p, q in zip(params, ref_params, strict=True):
            p.grad = torch.full_like(p, 0.5 - step)
            q.grad = torch.full_like(q, 0.5 - step)
        if step == 0:
            with pytest.warns(RuntimeWarning, match="fused .* unavailable"):
                opt.step()
        else:
            opt.step()
        ref.step()
        assert_same(params, opt, ref_params, ref)
    assert _layout(opt).buckets


def test_step_counts_past_2_24_are_read_as_the_full_step_reads_them(monkeypatch):
    """Adagrad's lr decays with the step number, so a count that ran on past what an FP32 count
    holds (a step reads back 2**24) would change the update. From the change on, an lr this
    large (3e7: the decayed lrs of steps 2**24 + 1 and 2**24 + 2 differ in FP32) makes that show
    in FP32 masters."""
    def make(ps):
        return Adagrad(ps, lr=0.1, lr_decay=1.0, master="fp32", fused=True)

    def change(params, opt, saved):
        CHANGES["step_counts_past_2_24"](params, opt, saved)
        opt.param_groups[0]["lr"] = 3e7

    steps = _steps.CHANGE_AT + 4
    pa, oa, _ = _run(make, change, use_buckets=False, monkeypatch=monkeypatch, steps=steps)
    pb, ob, taken = _run(make, change, use_buckets=True, monkeypatch=monkeypatch, steps=steps)
    assert_same(pa, oa, pb, ob)
    assert taken == steps - 1, taken
    assert {ob.state[p]["step"].item() for p in pb} == {2.0**24}


def test_the_buckets_keep_no_gradient_alive(monkeypatch):
    """zero_grad(set_to_none=True) frees the gradients before the next backward; buckets that
    held them would add a gradient's memory to every step's peak."""
    params, opt, taken = _run(_adamw_kahan, CHANGES["nothing"], use_buckets=True,
                              monkeypatch=monkeypatch, steps=3)
    assert taken == 2
    grads = [weakref.ref(p.grad) for p in params]
    opt.zero_grad(set_to_none=True)
    assert all(g() is None for g in grads)


def test_a_step_that_raises_midway_leaves_counts_matching_what_was_stepped(monkeypatch):
    monkeypatch.setitem(buckets._GATHERED, "cpu", 1024)  # (the large parameter a piece alone)
    params, opt, _ = _run(_adamw_kahan, CHANGES["nothing"], use_buckets=True,
                          monkeypatch=monkeypatch, steps=3)
    before = [p.detach().clone() for p in params]
    counts = [opt.state[p]["step"].item() for p in params]
    real, pieces = buckets._Bucket._run, []

    def out_of_memory(self, *args, **kwargs):  # (the bucket's second piece fails)
        pieces.append(1)
        if len(pieces) == 2:
            raise MemoryError("simulated")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(buckets._Bucket, "_run", out_of_memory)
    for p in params:
        p.grad = torch.full_like(p, 0.25)
    with pytest.raises(MemoryError):
        opt.step()
    for p, old, count in zip(params, before, counts, strict=True):
        changed = not torch.equal(bits(p), bits(old))
        assert opt.state[p]["step"].item() == count + changed, (tuple(p.shape), changed)
    assert not torch.equal(bits(params[0]), bits(before[0]))


def test_a_parameter_without_gradient_is_still_validated(monkeypatch):
    params, opt, _ = _run(lambda ps: AdamW(ps, lr=1e-2, master="split", fused=True),
                          CHANGES["nothing"], use_buckets=True, monkeypatch=monkeypatch, steps=3)
    for _ in range(2):
        for p in params:
            p.grad = None if p is params[2] else torch.ones_like(p)
        opt.step()
    params[2].data = params[2].data.half()  # split refuses FP16: the step raises
    for p in params:
        p.grad = None if p is params[2] else torch.ones_like(p)
    with pytest.raises(ValueError, match=r"parameter group 0, parameter 2"):
        opt.step()


@pytest.mark.parametrize("mixed", [False, True], ids=["bf16-kahan", "bf16-fp16-stochastic"])
def test_state_memory_stays_the_states_size_when_gradients_come_and_go(mixed):
    """Parameters that have no gradient now and then must not leave old flat buffers alive
    behind their views, nor the first step's new state a buffer part of which a bucket copied
    (FP16 parameters under stochastic rounding are buckets of one, BF16 ones gathered, in one
    group with FP32 state for both; failed before the new state's buffers were keyed by dtype
    and strategy too): the storages holding state add up to the state's size."""
    gen = torch.Generator().manual_seed(0)
    dtypes = [torch.bfloat16, torch.float16] if mixed else [torch.bfloat16]
    params = [torch.randn(s, generator=gen).to(dtypes[i % len(dtypes)]).requires_grad_()
              for i, s in enumerate(SHAPES + SHAPES[:3])]
    opt = (AdamW(params, lr=1e-2, master="stochastic", state_dtype=torch.float32, fused=False,
                 seed=3) if mixed
           else _adamw_kahan(params))
    for step in range(8):
        for i, p in enumerate(params):
            p.grad = None if (i + step) % 3 == 0 else torch.randn(p.shape, generator=gen).to(
                p.dtype)
        opt.step()
    tensors = [t for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    assert sum(storages.values()) == sum(t.numel() * t.element_size() for t in tensors)


def test_a_parameter_whose_first_gradient_comes_later_joins_a_bucket():
    """A parameter without a gradient at the first step (no state then) gets its state where a
    bucket takes it when its first gradient comes: before, it stayed outside the buckets and took
    the eager step of a parameter on its own at every later step. The steps equal the full
    step's, bit for bit."""
    def steps(ctx):
        gen = torch.Generator().manual_seed(0)
        params = [(torch.randn(s, generator=gen) * 0.1).to(torch.bfloat16).requires_grad_()
                  for s in SHAPES]
        opt = _adamw_kahan(params)
        with ctx:
            for step in range(4):
                for i, p in enumerate(params):
                    p.grad = None if (step == 0 and i == 1) else torch.randn(
                        p.shape, generator=gen).to(torch.bfloat16)
                opt.step()
        return params, opt

    params, opt = steps(contextlib.nullcontext())
    ref, ref_opt = steps(full_steps())
    assert id(params[1]) in driver.buckets_of(opt).where
    assert_same(params, opt, ref, ref_opt)
