"""lowprec.optim's Adam and RAdam against torch.optim.Adam and torch.optim.RAdam.

torch's own option matrices (``common_optimizers``' ``optim_db``, imported as
tests/test_torch_contracts.py imports it) are the data: every option set of its CPU matrix, and of
its CUDA one (built, not run), which adds tensor ``lr`` and ``betas`` under ``capturable``, which
torch runs on CUDA alone: the set runs without it (lowprec's capturable step is checked against
its own default step, tests/test_capturable.py). Each set runs on FP32 parameters with
``master="none"`` beside torch's for-loop implementation (``foreach=False``) and must match it
within 1e-6 of the tensor's scale, eagerly and, once per compiled variant (a set whose
update-rule flags no earlier set had), compiled. torch's bad option sets raise torch's errors; BF16 with ``master="split"`` is
the FP32 run bit for bit; a torch checkpoint (L2 decay) resumes as torch; a step counted on the
device (a GPU's way under a loss scaler) steps as one counted on the host, reading nothing there.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

from lowprec.numerics import split
from lowprec.optim import AdamW, core
from lowprec.optim.adam import Adam
from lowprec.optim.radam import RAdam
from tests._host import no_host_reads
from tests._same import assert_same, bits
from tests.test_optim import assert_rel_close, feed, grad_sequence, make_params
from tests.test_torch_contracts import (
    NO_DATA,
    _canon,
    _lowprec_kwargs,
    _sid,
    _torch_common_optimizers,
)
from tests.test_torch_contracts import test_torch_error_inputs as _check_error_input

_CO = _torch_common_optimizers()
LOWPREC_OF = {torch.optim.Adam: Adam, torch.optim.RAdam: RAdam}
SHAPES = [(33, 17), (64,), (5, 3, 4), (1,)]
STEPS = 30  # (RAdam's rectified step starts at step 6 with the default betas)

# What torch's matrices leave out: Adam's decoupled decay (torch.optim.AdamW's rule) and RAdam
# with betas[1] = 0.6, whose rho_inf of 4 never rectifies (and would divide by zero if it did).
EXTRA_SETS = [
    (Adam, torch.optim.Adam, "decoupled_weight_decay",
     {"weight_decay": 0.1, "decoupled_weight_decay": True}),
    (Adam, torch.optim.Adam, "decoupled_weight_decay, amsgrad, maximize",
     {"lr": 1e-2, "weight_decay": 0.1, "decoupled_weight_decay": True, "amsgrad": True,
      "maximize": True}),
    (RAdam, torch.optim.RAdam, "decoupled_weight_decay, maximize, betas",
     {"lr": 1e-2, "betas": (0.8, 0.99), "weight_decay": 0.1, "decoupled_weight_decay": True,
      "maximize": True}),
    (RAdam, torch.optim.RAdam, "never rectified", {"lr": 1e-2, "betas": (0.9, 0.6)}),
]


def _collect_sets():
    """torch's Adam and RAdam sets (CPU and CUDA matrices) with the unsupported options dropped,
    deduplicated, then ``EXTRA_SETS``; and the sets that held an unsupported option."""
    sets, refused, seen = [], [], set()
    for info in [] if _CO is None else _CO.optim_db:
        ours = LOWPREC_OF.get(info.optim_cls)
        if ours is None:
            continue
        for inp in [*info.optim_inputs_func(device="cpu"), *info.optim_inputs_func(device="cuda")]:
            kw, dropped = _lowprec_kwargs(inp.kwargs)
            if dropped:
                refused.append(pytest.param(ours, inp.kwargs, id=_sid(ours, inp.desc)))
            key = (ours, tuple(sorted((k, _canon(v)) for k, v in kw.items())))
            if key not in seen:
                seen.add(key)
                desc = inp.desc + (f" ({', '.join(dropped)} dropped)" if dropped else "")
                sets.append((ours, info.optim_cls, desc, kw))
    return sets + EXTRA_SETS, refused


OPTION_SETS, REFUSED_SETS = _collect_sets()


def _variant(ours, kw):
    """The compiled variant a set steps with: its optimizer and update-rule flags."""
    opt = ours([torch.zeros(2, requires_grad=True)], **copy.deepcopy(kw))
    return ours, tuple(sorted(opt._flags(opt.param_groups[0]).items()))


def _matrix():
    out, compiled = [], set()
    for ours, ref, desc, kw in OPTION_SETS:
        out.append(pytest.param(ours, ref, kw, False, id=_sid(ours, desc) + "-eager"))
        if _variant(ours, kw) not in compiled:
            compiled.add(_variant(ours, kw))
            out.append(pytest.param(ours, ref, kw, True, id=_sid(ours, desc) + "-fused",
                                    marks=[pytest.mark.slow, pytest.mark.fused]))
    return out


def _twins(device, shapes=SHAPES, dtype=torch.float32):
    params = make_params(dtype, shapes, device=device)
    return params, [p.detach().float().clone().requires_grad_() for p in params]


def _step_both(params, opt, ref_params, ref_opt, seq):
    for grads in seq:
        feed(params, grads)
        feed(ref_params, grads)
        opt.step()
        ref_opt.step()


def _assert_matches(params, opt, ref_params, ref_opt):
    """Parameters and torch's state (by torch's names, so checkpoints carry over) within 1e-6."""
    for p, q in zip(params, ref_params, strict=True):
        assert_rel_close(p, q)
        for k, v in ref_opt.state[q].items():
            if k == "step":
                assert float(opt.state[p]["step"]) == float(v)
            else:
                assert_rel_close(opt.state[p][k], v)


# ------------------------------------------------------------------ torch's matrices


@pytest.mark.parametrize(("ours", "ref", "kw", "fused"), _matrix())
def test_none_on_fp32_matches_torch(ours, ref, kw, fused, device):
    params, ref_params = _twins(device)
    opt = ours(params, master="none", fused=fused, **copy.deepcopy(kw))
    ref_opt = ref(ref_params, foreach=False, **copy.deepcopy(kw))
    _step_both(params, opt, ref_params, ref_opt, grad_sequence(SHAPES, STEPS))
    _assert_matches(params, opt, ref_params, ref_opt)


@pytest.mark.parametrize(("ours", "kw"), REFUSED_SETS or [
    pytest.param(None, None, marks=pytest.mark.skipif(_CO is None, reason=NO_DATA))])
def test_unsupported_options_are_refused(ours, kw):
    # (differentiable refused, naming it; capturable taken: tests/test_capturable.py)
    if kw.get("differentiable"):
        with pytest.raises(ValueError, match=r"differentiable"):
            ours([torch.randn(3, requires_grad=True)], **kw)
    else:
        assert core.stages(ours([torch.randn(3, requires_grad=True)], **kw)).capturable


def _error_inputs():
    if _CO is None:
        return [pytest.param(None, None, None, marks=pytest.mark.skipif(_CO is None, reason=NO_DATA))]
    return [pytest.param(ours, info.optim_cls, e, id=_sid(ours, e.optimizer_error_input.desc))
            for info in _CO.optim_db if (ours := LOWPREC_OF.get(info.optim_cls)) is not None
            for e in info.optim_error_inputs_func(device="cpu", dtype=torch.float32)]


@pytest.mark.parametrize(("ours", "ref", "error_input"), _error_inputs())
def test_torch_error_inputs(ours, ref, error_input):
    # (test_torch_contracts' check: the same exception type, or the documented difference)
    _check_error_input(ours, ref, error_input)


# ------------------------------------------------------------------ lowprec's own claims

CASES = [
    pytest.param(Adam, {"lr": 1e-2, "weight_decay": 0.1}, id="Adam-l2"),
    pytest.param(Adam, {"lr": 1e-2, "weight_decay": 0.1, "decoupled_weight_decay": True,
                        "amsgrad": True, "maximize": True}, id="Adam-decoupled-amsgrad-maximize"),
    pytest.param(RAdam, {"lr": 1e-2, "weight_decay": 0.1}, id="RAdam-l2"),
    pytest.param(RAdam, {"lr": 1e-2, "weight_decay": 0.1, "decoupled_weight_decay": True},
                 id="RAdam-decoupled"),
]


@pytest.mark.parametrize(("cls", "kw"), CASES)
def test_split_equals_fp32_bit_for_bit(cls, kw, device):
    shapes = [(40, 30), (30,)]
    bf, fp = _twins(device, shapes, torch.bfloat16)
    opt_bf, opt_fp = cls(bf, master="split", **kw), cls(fp, master="none", **kw)
    for grads in grad_sequence(shapes, 60, dtype=torch.bfloat16):
        feed(bf, grads)
        feed(fp, [g.float() for g in grads])
        opt_bf.step()
        opt_fp.step()
    for pb, pf in zip(bf, fp, strict=True):
        assert torch.equal(bits(opt_bf.master_weight(pb)), bits(pf))
        assert torch.equal(bits(pb), bits(split(pf.detach())[0]))


def test_decoupled_adam_is_adamw_bit_for_bit(device):
    kw = {"lr": 1e-2, "weight_decay": 0.1, "amsgrad": True}
    pa, pb = _twins(device)
    a = Adam(pa, master="none", decoupled_weight_decay=True, **kw)
    b = AdamW(pb, master="none", **kw)
    for grads in grad_sequence(SHAPES, 10):
        feed(pa, grads)
        feed(pb, grads)
        a.step()
        b.step()
    assert_same(pa, a, pb, b)


@pytest.mark.parametrize(("ours", "ref", "kw"), [
    pytest.param(Adam, torch.optim.Adam, {"lr": 1e-2, "weight_decay": 0.1}, id="Adam-l2"),
    pytest.param(Adam, torch.optim.Adam, {"lr": 1e-2, "weight_decay": 0.1, "amsgrad": True},
                 id="Adam-l2-amsgrad"),
    pytest.param(RAdam, torch.optim.RAdam, {"lr": 1e-2, "weight_decay": 0.1}, id="RAdam-l2"),
])
def test_torch_checkpoint_with_l2_decay_resumes_as_torch(ours, ref, kw):
    seq = grad_sequence(SHAPES, 20)
    ref_params = make_params()
    ref_opt = ref(ref_params, foreach=False, **kw)
    for grads in seq[:4]:
        feed(ref_params, grads)
        ref_opt.step()
    params = [q.detach().clone().requires_grad_() for q in ref_params]
    opt = ours(params, master="none")  # (the checkpoint brings its hyperparameters)
    opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))
    group = opt.param_groups[0]
    assert group["weight_decay"] == 0.1 and group["decoupled_weight_decay"] is False
    _step_both(params, opt, ref_params, ref_opt, seq[4:])
    _assert_matches(params, opt, ref_params, ref_opt)


@pytest.mark.parametrize(
    "fused", [False, pytest.param(True, marks=[pytest.mark.slow, pytest.mark.fused])],
    ids=["eager", "fused"],
)
@pytest.mark.parametrize(("cls", "kw"), CASES)
def test_a_capturable_scaled_step_reads_nothing_and_steps_as_the_plain_one(cls, kw, fused,
                                                                          device):
    # The step count stays on the device, and the coefficients (RAdam's choice of the rectified
    # step included) are made there: a capturable step under a loss scaler reads nothing on the
    # host, and steps as the plain step on the unscaled gradients.
    pa, pb = _twins(device)
    host = cls(pa, master="none", fused=fused, **kw)
    on_device = cls(pb, master="none", fused=fused, capturable=True, **kw)
    for i, grads in enumerate(grad_sequence(SHAPES, 12)):
        feed(pa, grads)
        host.step()
        feed(pb, [g * 64 for g in grads])
        scale, found = torch.tensor(64.0, device=device), torch.zeros((), device=device)
        # (the first step creates the state, and may compile: shapes read, not values; the
        # second, the first through buckets, reads which of their counts are the same, once:
        # buckets._Bucket.count_marks)
        with no_host_reads() if i > 1 else contextlib.nullcontext():
            on_device.step(grad_scale=scale, found_inf=found)
    assert_same(pa, host, pb, on_device)
