"""The recorded step: ``step()`` redoes the previous step's work while nothing it relied on changed.

Every test runs the same steps twice from the same start, with recording (the default) and with
every step taken in full, applies the same change between two steps to both runs, and asserts that
parameters and state agree bit for bit afterwards, and that the recorded step was used where
nothing changed (so a test cannot pass by never replaying).
"""

from __future__ import annotations

import copy
import gc
import sys
import warnings
import weakref
from unittest import mock

import pytest
import torch

from lowprec.optim import SGD, Adagrad, AdamW, Lamb, batches, compiled, loss_scale, plan, update
from lowprec.optim import replay as replay_mod
from tests._cases import axes
from tests._same import assert_same, bits

# (fused: a compiled step that falls back to eager fails the test, tests/_fallback.py;
# no_buckets: the recorded step is what a step without buckets redoes, tests/test_buckets.py)
pytestmark = [pytest.mark.slow, pytest.mark.fused, pytest.mark.usefixtures("no_buckets")]

# One parameter above batches._SMALL (stepped alone), small ones batched, an odd-length one (its
# last element takes the eager step) and a one-element one (eager).
SHAPES = [(300, 256), (64,), (32, 4), (7,), (1,)]
CHANGE_AT = 3
STEPS = 6


def _run(make, change, *, replay, steps=STEPS, scaled=None, shapes=None):
    """Steps with fresh random gradients (the same for both runs); ``change(params, opt, saved)`` runs
    before step CHANGE_AT, ``saved`` being a state_dict taken after the first step. ``scaled(step)``:
    whether that step goes through the loss-scaler contract (gradients scaled by 256, passed as
    grad_scale with a found_inf flag; at step CHANGE_AT + 1 one gradient holds an inf, so that
    step is skipped). Returns the parameters, the optimizer and the number of steps redone from a
    record. ``shapes``: the parameters' (the first one 2-d)."""
    gen = torch.Generator().manual_seed(0)
    params = [
        (torch.randn(s, generator=gen) * 0.1).to(torch.bfloat16).requires_grad_()
        for s in (SHAPES if shapes is None else shapes)  # (SHAPES read now: tests replace it)
    ]
    opt = make(params)
    replayed = 0
    real = replay_mod.redo

    def spy(o, ctx):  # (this optimizer's record redone, or (replay False) never)
        nonlocal replayed
        if o is not opt:
            return real(o, ctx)
        done = replay and real(o, ctx)
        replayed += done
        return done

    with mock.patch.object(replay_mod, "redo", spy):
        _steps(params, opt, gen, change, steps, scaled)
    return params, opt, replayed


def _steps(params, opt, gen, change, steps, scaled):
    saved = None
    for step in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(torch.bfloat16)
        if step == CHANGE_AT:
            change(params, opt, saved)
        if scaled is not None and scaled(step):
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(256)
            if step == CHANGE_AT + 1:
                params[0].grad[0, 0] = float("inf")
            opt.step(grad_scale=torch.tensor(256.0), found_inf=torch.zeros(()))
        else:
            opt.step()
        if step == 0:
            saved = copy.deepcopy(opt.state_dict())
    return saved


def _same_with_and_without_replay(make, change, replays=STEPS - 1, steps=STEPS, scaled=None):
    """Both runs agree; at least ``replays`` steps of the recording run were redone (step 0
    records; a change may force full steps after it)."""
    pa, oa, _ = _run(make, change, replay=False, steps=steps, scaled=scaled)
    pb, ob, n = _run(make, change, replay=True, steps=steps, scaled=scaled)
    assert_same(pa, oa, pb, ob)
    assert n >= replays, n
    return pb, ob


def _adamw_kahan(params):
    return AdamW(params, lr=1e-2, weight_decay=0.1, master="kahan", fused=True, seed=3)


def _set_grads(values):
    def change(params, opt, saved):
        for p, g in zip(params, values(params), strict=True):
            if g.dtype != p.dtype:
                p.grad_dtype = None  # allow an FP32 gradient on a BF16 parameter
            p.grad = g
    return change


CHANGES = {
    "nothing": lambda params, opt, saved: None,
    # In-place changes to state the step reads: the recorded views see them.
    "momentum_in_place": lambda params, opt, saved: opt.state[params[0]]["exp_avg"].mul_(-3),
    "lr_and_betas": lambda params, opt, saved: opt.param_groups[0].update(
        lr=5e-3, betas=(0.5, 0.9)),
    # Changes that the recorded step must notice (and take a full step for).
    "step_count_written": lambda params, opt, saved: opt.state[params[1]]["step"].fill_(50),
    # FP32 counts stop at 2**24 (the full step reads back what it stored; so must the record).
    "step_counts_past_2_24": lambda params, opt, saved: [
        opt.state[p]["step"].fill_(2**24 - 2) for p in params],
    # Writes that leave the version counter as it was: the counts are read every step.
    "step_counts_written_through_data": lambda params, opt, saved: [
        opt.state[p]["step"].data.fill_(40 + i) for i, p in enumerate(params[:2])],
    "state_tensor_replaced": lambda params, opt, saved: opt.state[params[0]].update(
        exp_avg_sq=torch.ones_like(opt.state[params[0]]["exp_avg_sq"])),
    "batched_state_tensor_replaced": lambda params, opt, saved: opt.state[params[2]].update(
        exp_avg=torch.full_like(opt.state[params[2]]["exp_avg"], 0.5)),
    "state_loaded": lambda params, opt, saved: opt.load_state_dict(saved),
    "param_data_replaced": lambda params, opt, saved: [
        setattr(p, "data", p.data.clone() + 1) for p in params[:2]],
    "a_grad_missing": lambda params, opt, saved: [
        setattr(p, "grad", None) for p in params[1::2]],
    "grads_in_fp32": _set_grads(lambda params: [p.grad.float() for p in params]),
    "grad_non_contiguous": _set_grads(lambda params: [
        p.grad.t().contiguous().t() if p.dim() == 2 else p.grad for p in params]),
    "weight_decay_off": lambda params, opt, saved: opt.param_groups[0].update(weight_decay=0.0),
    "master_changed_on_a_new_group": lambda params, opt, saved: opt.add_param_group(
        {"params": [torch.zeros(6, dtype=torch.bfloat16, requires_grad=True)],
         "master": "split"}),
}


# Changes the recorded step carries on through (every step after the first is redone).
KEPT = ("nothing", "momentum_in_place", "lr_and_betas")


@pytest.mark.parametrize("name", list(CHANGES))
def test_replay_equals_the_full_step_across_a_change(name):
    # Steps 1, 2 and the last are redone whatever the change (a change undone by the next
    # step's fresh gradients forces two full steps).
    _same_with_and_without_replay(
        _adamw_kahan, CHANGES[name], replays=STEPS - 1 if name in KEPT else 3
    )


def test_a_parameter_without_gradient_keeps_its_step_count_under_replay():
    def change(params, opt, saved):
        params[2].grad = None

    params, opt = _same_with_and_without_replay(_adamw_kahan, change, replays=3)
    counts = [opt.state[p]["step"].item() for p in params]
    assert counts == [STEPS, STEPS, STEPS - 1, STEPS, STEPS], counts


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: SGD(ps, lr=0.05, momentum=0.9, master="split", fused=True),
        lambda ps: SGD(ps, lr=0.05, momentum=0.9, master="stochastic", fused=True, seed=5),
        lambda ps: Lamb(ps, lr=1e-2, weight_decay=0.01, master="split", fused=True),
        lambda ps: AdamW(ps, lr=1e-2, master="split", fused=False),
    ],
    ids=["sgd-split", "sgd-stochastic", "lamb-split", "adamw-split-eager"],
)
def test_replay_equals_the_full_step(make):
    _same_with_and_without_replay(make, CHANGES["nothing"])


def test_invalid_option_set_between_steps_raises_and_writes_nothing():
    params, opt, _ = _run(_adamw_kahan, CHANGES["nothing"], replay=True, steps=3)
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
def test_compile_failure_during_replay_falls_back_to_eager(monkeypatch):
    params, opt, _ = _run(_adamw_kahan, CHANGES["nothing"], replay=True, steps=2)
    ref_params = [p.detach().clone().requires_grad_() for p in params]
    ref = AdamW(ref_params, lr=1e-2, weight_decay=0.1, master="kahan", fused=False, seed=3)
    ref.load_state_dict(opt.state_dict())
    ref.param_groups[0]["fused"] = False  # (the checkpoint's group brings the saver's fused=True)

    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler found")

    for entry in opt._step_plan.entries:
        if entry.fused is not None:
            monkeypatch.setattr(entry.fused, "kernel", broken)
    monkeypatch.setattr(compiled, "_compiled_kernel", lambda *a, **k: broken)
    for p, q in zip(params, ref_params, strict=True):
        p.grad = torch.full_like(p, 0.5)
        q.grad = torch.full_like(q, 0.5)
    with pytest.warns(RuntimeWarning, match="fused .* unavailable"):
        opt.step()
    ref.step()
    assert_same(params, opt, ref_params, ref)
    assert opt._step_plan is None


def _assert_tiled(opt, small):
    """Each state buffer of the parameters ``small`` is a view of one flat tensor, in turn."""
    for name in ("exp_avg", "exp_avg_sq", "compensation"):
        views = [opt.state[p][name] for p in small]
        buf = views[0]._base
        assert buf is not None and all(v._base is buf for v in views), name
        # The views tile the buffer, one after the other (an odd total padded by an element:
        # plan._flat_state).
        at = sorted(((v.data_ptr() - buf.data_ptr()) // buf.element_size(), v.numel())
                    for v in views)
        ends = [0] + [start + n for start, n in at]
        assert [start for start, _ in at] == ends[:-1], at
        assert buf.numel() == ends[-1] + ends[-1] % 2, at


def test_small_parameters_keep_their_state_in_one_buffer_across_full_steps():
    params, opt, _ = _run(_adamw_kahan, CHANGES["nothing"], replay=True, steps=2)
    small = [p for p in params if 2 <= p.numel() <= batches._SMALL]  # (one batch, for Kahan)
    assert len(small) == 3
    _assert_tiled(opt, small)
    ptrs = [opt.state[p]["exp_avg"].data_ptr() for p in small]
    for p in params:
        p.grad = torch.ones_like(p)
    opt._step_plan = None  # a full step lays the batch out again: the buffer is kept
    opt.step()
    assert [opt.state[p]["exp_avg"].data_ptr() for p in small] == ptrs


def test_a_loaded_checkpoint_is_laid_out_as_the_step_batches_it():
    # A resumed run steps its small parameters' state in place, as a fresh run does, rather
    # than concatenating it and copying it back every step; and steps the same.
    params, opt, _ = _run(_adamw_kahan, CHANGES["nothing"], replay=True, steps=2)
    saved = copy.deepcopy(opt.state_dict())
    fresh = [p.detach().clone().requires_grad_() for p in params]
    other = _adamw_kahan(fresh)
    other.load_state_dict(saved)
    small = [q for q in fresh if 2 <= q.numel() <= batches._SMALL]
    _assert_tiled(other, small)
    ptrs = {name: [other.state[q][name].data_ptr() for q in small]
            for name in ("exp_avg", "compensation")}
    for _ in range(2):  # a full step, then a replayed one
        for p, q in zip(params, fresh, strict=True):
            p.grad = torch.full_like(p, -0.25)
            q.grad = torch.full_like(q, -0.25)
        opt.step()
        other.step()
        assert_same(params, opt, fresh, other)
        for name, before in ptrs.items():
            assert [other.state[q][name].data_ptr() for q in small] == before, name
    # The checkpoint's own tensors were copied, not taken: it is as it was saved.
    for k, st in saved["state"].items():
        assert not any(v is other.state[fresh[k]][n]
                       for n, v in st.items() if isinstance(v, torch.Tensor))
    assert saved["state"][1]["step"].item() == 2


def test_a_loaded_checkpoint_that_the_step_batches_differently_still_steps_the_same():
    # Laid out for every small parameter having a gradient; one without, the batch differs
    # from the layout and is concatenated instead, with the same results.
    params, opt, _ = _run(_adamw_kahan, CHANGES["nothing"], replay=True, steps=2)
    fresh = [p.detach().clone().requires_grad_() for p in params]
    other = _adamw_kahan(fresh)
    other.load_state_dict(copy.deepcopy(opt.state_dict()))
    small = [i for i, p in enumerate(params) if 2 <= p.numel() <= batches._SMALL]
    for step in range(3):
        for i, (p, q) in enumerate(zip(params, fresh, strict=True)):
            idle = i == small[step % len(small)]
            p.grad = None if idle else torch.full_like(p, 0.5 - step)
            q.grad = None if idle else torch.full_like(q, 0.5 - step)
        opt.step()
        other.step()
        assert_same(params, opt, fresh, other)


def test_replay_reads_step_counts_past_2_24_as_the_full_step_does():
    # Adagrad's lr decays with the step number, so a count that ran on past what an FP32 count
    # holds (the full step reads back 2**24) would change the update. From the change on, an lr
    # this large (3e7: the decayed lrs of steps 2**24 + 1 and 2**24 + 2 differ in FP32) makes
    # that show in FP32 masters.
    def make(ps):
        return Adagrad(ps, lr=0.1, lr_decay=1.0, master="fp32", fused=True)

    def change(params, opt, saved):
        CHANGES["step_counts_past_2_24"](params, opt, saved)
        opt.param_groups[0]["lr"] = 3e7

    # Counts 2**24 - 1 at the change, then 2**24, then 2**24 + 1 (stored as 2**24), again...
    params, opt = _same_with_and_without_replay(make, change, replays=5, steps=CHANGE_AT + 4)
    assert {opt.state[p]["step"].item() for p in params} == {2.0**24}


def test_a_recorded_step_keeps_no_gradient_alive():
    # zero_grad(set_to_none=True) frees the gradients before the next backward; a record that
    # held them would add a gradient's memory to every step's peak.
    params, opt, n = _run(_adamw_kahan, CHANGES["nothing"], replay=True, steps=3)
    assert n == 2
    grads = [weakref.ref(p.grad) for p in params]
    opt.zero_grad(set_to_none=True)
    assert all(g() is None for g in grads)


@pytest.mark.parametrize("name", ["nothing", "param_data_replaced", "a_grad_missing"])
@pytest.mark.parametrize(
    "make",
    [_adamw_kahan,
     lambda ps: SGD(ps, lr=0.05, momentum=0.9, master="stochastic", fused=True, seed=5)],
    ids=["adamw-kahan", "sgd-stochastic"],
)
@pytest.mark.parametrize("counts", ["host", "device"])
def test_replay_under_a_loss_scaler_equals_the_full_step(make, name, counts, monkeypatch):
    # Every step scaled, one of them skipped for an inf: the step counts and everything else
    # agree with full steps. "device": the counts are read on their device, as on a GPU.
    if counts == "device":
        monkeypatch.setattr(loss_scale, "_host_counts", lambda device: False)
    params, opt = _same_with_and_without_replay(
        make, CHANGES[name], replays=STEPS - 1 if name in KEPT else 3, scaled=lambda step: True
    )
    assert opt.state[params[0]]["step"].item() == STEPS - 1  # (one step skipped)


def test_switching_between_scaled_and_plain_steps_takes_full_steps():
    # A record is redone only by a step of its own kind (the kernels and step counts differ).
    params, opt, n = _run(_adamw_kahan, CHANGES["nothing"], replay=True,
                          scaled=lambda step: step % 3 == 2)
    pa, oa, _ = _run(_adamw_kahan, CHANGES["nothing"], replay=False,
                     scaled=lambda step: step % 3 == 2)
    assert_same(pa, oa, params, opt)
    assert n == 2, n  # steps 0 1 | 2 (scaled) | 3 4 | 5 (scaled): replayed 1 and 4


def test_state_tensors_a_caller_holds_stay_the_optimizers():
    # A batch lays out flat only the state it creates; state that existed (here loaded from a
    # checkpoint) keeps its tensors, which a caller may hold or have put in shared memory.
    params, opt, _ = _run(_adamw_kahan, CHANGES["nothing"], replay=True, steps=2)
    fresh = [p.detach().clone().requires_grad_() for p in params]
    other = _adamw_kahan(fresh)
    other.load_state_dict(copy.deepcopy(opt.state_dict()))
    held = {k: other.state[fresh[1]][k] for k in ("exp_avg", "exp_avg_sq", "compensation")}
    for _ in range(3):
        for p in fresh:
            p.grad = torch.full_like(p, 0.125)
        other.step()
    for k, t in held.items():
        assert other.state[fresh[1]][k] is t, k
    assert other.state[fresh[1]]["step"].item() == 5


def test_a_step_that_raises_midway_leaves_counts_matching_what_was_stepped(monkeypatch):
    params, opt, n = _run(_adamw_kahan, CHANGES["nothing"], replay=True, steps=3)
    assert n == 2
    before = [p.detach().clone() for p in params]
    counts = [opt.state[p]["step"].item() for p in params]

    def out_of_memory(*args, **kwargs):
        raise MemoryError("simulated")

    # Fail in the batch of small parameters, after the large one was stepped by its kernel.
    monkeypatch.setattr(batches, "run_batch", out_of_memory)
    for p in params:
        p.grad = torch.full_like(p, 0.25)
    with pytest.raises(MemoryError):
        opt.step()
    for p, old, count in zip(params, before, counts, strict=True):
        changed = not torch.equal(bits(p), bits(old))
        assert opt.state[p]["step"].item() == count + changed, (tuple(p.shape), changed)
    assert not torch.equal(bits(params[0]), bits(before[0]))


def test_a_parameter_without_gradient_is_still_validated():
    params, opt, n = _run(
        lambda ps: AdamW(ps, lr=1e-2, master="split", fused=True), CHANGES["nothing"],
        replay=True, steps=3,
    )
    assert n == 2
    for _ in range(2):  # recorded, then redone, with parameter 2 idle
        for p in params:
            p.grad = None if p is params[2] else torch.ones_like(p)
        opt.step()
    params[2].data = params[2].data.half()  # split refuses FP16: the full step raises
    for p in params:
        p.grad = None if p is params[2] else torch.ones_like(p)
    with pytest.raises(ValueError, match=r"parameter group 0, parameter 2"):
        opt.step()


def test_state_memory_stays_the_states_size_when_batches_change():
    # Parameters that drop out of a batch now and then (no gradient) must not leave old flat
    # buffers alive behind their views: the storages holding state add up to the state's size.
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=gen).to(torch.bfloat16).requires_grad_() for s in SHAPES]
    opt = _adamw_kahan(params)
    for step in range(8):
        for i, p in enumerate(params):
            p.grad = None if (i + step) % 3 == 0 else torch.randn(p.shape, generator=gen).to(
                torch.bfloat16)
        opt.step()
    tensors = [t for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    assert sum(storages.values()) == sum(t.numel() * t.element_size() for t in tensors)


def test_a_record_does_not_keep_replaced_parameter_storage_alive():
    # model.to(...) or p.data = ... gives a parameter new storage; the old one must be freed
    # then, not at the next step (on a GPU that is the model's size).
    params, opt, n = _run(_adamw_kahan, CHANGES["nothing"], replay=True, steps=3)
    assert n == 2
    old = weakref.ref(params[0].data.untyped_storage())
    storage_ptr = params[0].data_ptr()
    params[0].data = params[0].data.clone()
    assert params[0].data_ptr() != storage_ptr
    gc.collect()
    assert old() is None
    assert opt._step_plan is not None  # (the record is still there)


# Several parameters of one kernel variant: a redone step steps them with one compiled call
# (plan._Many). Three of these take the fused step's own call; the small ones batch.
MANY_SHAPES = [(300, 256), (256, 300), (72000,), (64,), (32, 4), (7,), (1,)]
MANY_MAKERS = {
    "adamw-kahan": _adamw_kahan,
    "sgd-stochastic": lambda ps: SGD(ps, lr=0.05, momentum=0.9, master="stochastic", fused=True,
                                     seed=5),
    "adagrad-split": lambda ps: Adagrad(ps, lr=0.05, master="split", fused=True),
    # (whole-tensor norms: each parameter's sums, then its update, inside the shared call)
    "lamb-stochastic": lambda ps: Lamb(ps, lr=1e-2, weight_decay=0.01, master="stochastic",
                                       fused=True, seed=5),
}


def _calls_shared(opt) -> bool:
    """Whether the last record's parameters took one call together (a _Many that ran: its pattern
    of sizes compiled, its kernel called without error and not broken)."""
    record = opt._step_plan
    runs = [] if record is None or record.many is None else record.many
    return any(isinstance(r, plan._Many) and r.pattern in plan._MANY_SEEN.get(r.kernel, ())
               and r.kernel.warm and r.kernel not in plan._MANY_BROKEN for r in runs)


@pytest.fixture
def many_shapes(monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "SHAPES", MANY_SHAPES)
    monkeypatch.setattr(plan, "_MANY_SEEN", {})  # (a budget of its own for this test)


# Every change with AdamW + Kahan's shared call, every kind of shared call with nothing changed
# (tests/_cases.py: axes), and LAMB's (each parameter's sums, then its update) with a gradient
# missing: a change that makes a new pattern of sizes, whose call compiles anew.
MANY_CASES = [*axes(list(MANY_MAKERS), ["nothing", "step_count_written", "a_grad_missing",
                                        "param_data_replaced", "grads_in_fp32",
                                        "step_counts_written_through_data"],
                    at=("adamw-kahan", "nothing")),
              ("lamb-stochastic", "a_grad_missing")]


@pytest.mark.parametrize(("make", "name"), MANY_CASES)
def test_one_call_for_several_parameters_equals_the_full_step(make, name, many_shapes):
    _, opt = _same_with_and_without_replay(
        MANY_MAKERS[make], CHANGES[name], replays=STEPS - 1 if name in KEPT else 3
    )
    assert _calls_shared(opt)


@pytest.mark.parametrize("make", ["adamw-kahan", "sgd-stochastic", "lamb-stochastic"])
def test_one_call_for_several_parameters_under_a_loss_scaler(make, many_shapes):
    _, opt = _same_with_and_without_replay(
        MANY_MAKERS[make], CHANGES["nothing"], replays=STEPS - 1, scaled=lambda step: True
    )
    assert _calls_shared(opt)


def test_a_variant_past_its_budget_of_size_patterns_steps_one_call_each(many_shapes, monkeypatch):
    # Dynamo compiles the shared call per number and sizes of parameters; past the budget the
    # parameters take their own calls, with the same results.
    monkeypatch.setattr(plan, "_MANY_PATTERNS", 0)
    _, opt = _same_with_and_without_replay(_adamw_kahan, CHANGES["nothing"])
    assert not _calls_shared(opt)
    assert any(isinstance(r, plan._Many) for r in opt._step_plan.many)


@pytest.mark.fallback
def test_a_shared_call_that_fails_to_compile_leaves_each_its_own(many_shapes, monkeypatch):
    params, opt, _ = _run(_adamw_kahan, CHANGES["nothing"], replay=True, steps=2)
    ref_params = [p.detach().clone().requires_grad_() for p in params]
    ref = _adamw_kahan(ref_params)
    ref.load_state_dict(opt.state_dict())

    def broken(*args, **kwargs):
        raise RuntimeError("simulated compile failure")

    for run in opt._step_plan.many:
        if isinstance(run, plan._Many):
            monkeypatch.setattr(run, "kernel", broken)
    monkeypatch.setattr(plan, "_MANY_BROKEN", set())
    for _ in range(2):
        for p, q in zip(params, ref_params, strict=True):
            p.grad = torch.full_like(p, 0.5)
            q.grad = torch.full_like(q, 0.5)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # (the fused step itself stays on: no warning)
            opt.step()
        ref.step()
        assert_same(params, opt, ref_params, ref)
    assert plan._MANY_BROKEN and not getattr(opt, "_fused_broken", False)


def test_shared_calls_hold_at_most_many_max_parameters_each(many_shapes, monkeypatch):
    # Sorted by size and cut into calls of _MANY_MAX: with 2, the three large parameters take a
    # shared call of two and a call of their own, with the same results as the full step.
    monkeypatch.setattr(plan, "_MANY_MAX", 2)
    _, opt = _same_with_and_without_replay(_adamw_kahan, CHANGES["nothing"])
    shared = [r for r in opt._step_plan.many if isinstance(r, plan._Many)]
    assert [len(r.entries) for r in shared] == [2]
    assert [r.p.numel() for r in shared[0].entries] == [72000, 76800]  # (sorted by size)
    assert _calls_shared(opt)


def test_shared_calls_of_equal_sizes_compile_once(monkeypatch):
    # Two calls, each of two parameters of one size (a different size in each), are one pattern
    # of sizes for Dynamo: the second call reuses the first one's compilation.
    shapes = [(300, 256), (300, 256), (72000,), (72000,)]
    monkeypatch.setattr(sys.modules[__name__], "SHAPES", shapes)
    monkeypatch.setattr(plan, "_MANY_SEEN", {})
    monkeypatch.setattr(plan, "_MANY_MAX", 2)
    monkeypatch.setattr(compiled, "_KERNELS", {})  # (fresh compiled functions: fresh Dynamo caches)
    torch.manual_seed(0)
    params = [torch.randn(s, dtype=torch.bfloat16, requires_grad=True) for s in shapes]
    opt = _adamw_kahan(params)
    def graphs() -> int:
        return torch._dynamo.utils.counters["stats"]["unique_graphs"]

    for step in range(3):
        for p in params:
            p.grad = torch.randn_like(p)
        before = graphs()
        opt.step()
        if step == 1:  # (the first step redone from its record compiles the shared calls)
            assert graphs() - before == 1
    shared = [r for r in opt._step_plan.many if isinstance(r, plan._Many)]
    assert len(shared) == 2 and len({r.kernel for r in shared}) == 1
    assert {r.pattern for r in shared} == {(0, 0)} and _calls_shared(opt)


@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "loss_scaler"])
def test_lamb_on_fp32_parameters_shares_a_call_with_each_ones_norms(scaled, monkeypatch):
    # FP32 parameters take the elementwise kernels (no pairs): the shared call runs _param_sums
    # and then _param_update for each parameter in turn, with the bits of the eager step. Under a
    # loss scaler both take the unscaled gradient, and a step with an inf is skipped.
    monkeypatch.setattr(plan, "_MANY_SEEN", {})
    shapes = [(300, 256), (72000,), (999,)]

    def run(fused):
        gen = torch.Generator().manual_seed(0)
        params = [(torch.randn(s, generator=gen) * 0.1).requires_grad_() for s in shapes]
        opt = Lamb(params, lr=1e-2, weight_decay=0.01, master="none", fused=fused)
        for step in range(5):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            if not scaled:
                opt.step()
                continue
            for p in params:
                p.grad.mul_(256)
            if step == 3:
                params[1].grad[5] = float("inf")
            opt.step(grad_scale=torch.tensor(256.0), found_inf=torch.zeros(()))
        return params, opt

    pa, oa = run(False)
    pb, ob = run(True)
    assert_same(pa, oa, pb, ob)
    shared = [r for r in ob._step_plan.many if isinstance(r, plan._Many)]
    assert [r.sums_fn for r in shared] == [update._param_sums] and _calls_shared(ob)
