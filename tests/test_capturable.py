"""A step a CUDA graph can hold: ``capturable=True`` (and every step off the CPU) keeps the step
counts on the parameters' device, makes the step's numbers there and reads no tensor value on the
host; no parameter or state tensor changes address between steps; a tensor learning rate under
a scheduler changes nothing but the value the kernels read.

The CPU shows the shape a GPU's step will have: the profiler's host reads (``aten::item`` and
its kin), ``tests/_host.py``'s ``no_host_reads`` (any ``item``, ``tolist``, ``bool`` ...), the
data pointers, and the bits of the default step (host counts, a float ``lr``) as the reference.
"""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import lowprec
from tests._cases import axes
from tests._host import no_host_reads
from tests._same import assert_same

#: (class, keywords): every optimizer; Muon takes its matrices, AdamW's rule the vectors.
OPTIMIZERS = {
    "sgd": (lowprec.SGD, {"lr": 1e-2, "momentum": 0.9}),
    "adamw": (lowprec.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    "adam": (lowprec.Adam, {"lr": 1e-2}),
    "radam": (lowprec.RAdam, {"lr": 1e-2}),
    "adagrad": (lowprec.Adagrad, {"lr": 1e-2, "lr_decay": 0.01}),
    "lion": (lowprec.Lion, {"lr": 1e-3, "weight_decay": 0.1}),
    "lamb": (lowprec.Lamb, {"lr": 1e-2}),
    "stable_adamw": (lowprec.StableAdamW, {"lr": 1e-2}),
    "adafactor": (lowprec.Adafactor, {"lr": 1e-2}),
    "muon": (lowprec.Muon, {"lr": 1e-2}),
}
MASTERS = ["kahan", "split", "stochastic"]
# Two matrices and two vectors (one odd-sized: a parameter on its own).
SHAPES = [(64, 32), (32, 16), (64,), (7,)]
HOST_READS = ("aten::item", "aten::_local_scalar_dense", "aten::is_nonzero", "aten::equal")


def _make(name, params, master, lr=None, **kw):
    cls, options = OPTIMIZERS[name]
    options = {**options, **({} if lr is None else {"lr": lr})}
    groups = params
    if name == "muon":
        groups = [{"params": [p for p in params if p.dim() == 2]},
                  {"params": [p for p in params if p.dim() != 2], "use_muon": False}]
    return cls(groups, master=master, seed=3, **options, **kw)


def _params():
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn(s, generator=gen) * 0.1).bfloat16().requires_grad_() for s in SHAPES]


def _step(opt, params, step, scaled):
    gen = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=gen) * (256 if scaled else 1)).bfloat16()
    if scaled:  # (step 3 sees an inf: skipped on the device)
        if step == 3:
            params[0].grad[0, 0] = float("inf")
        opt.step(grad_scale=torch.tensor(256.0), found_inf=torch.zeros(()))
    else:
        opt.step()


def _addresses(opt, params):
    return [p.data_ptr() for p in params] + [
        t.data_ptr() for p in params for t in opt.state[p].values() if isinstance(t, torch.Tensor)
    ]


@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "scaled"])
@pytest.mark.parametrize(("name", "master"), axes(list(OPTIMIZERS), MASTERS, at=("adamw", "kahan"))
                         + [(n, "stochastic") for n in OPTIMIZERS if n != "adamw"])
def test_no_step_reads_the_host_or_moves_a_tensor(name, master, scaled):
    """Every optimizer with Kahan, every master with AdamW, and every optimizer with stochastic
    rounding (its keys made on the device), plain and under a loss scaler: after the first step
    (which creates the state and lays out the buckets, reading their counts once), a step reads
    nothing on the host, and the parameters and the state keep their addresses."""
    params = _params()
    opt = _make(name, params, master, capturable=True)
    _step(opt, params, 0, scaled)
    before = _addresses(opt, params)
    for step in range(1, 5):
        with profile(activities=[ProfilerActivity.CPU]) as prof, no_host_reads():
            _step(opt, params, step, scaled)
        reads = [e.name for e in prof.events() if e.name in HOST_READS]
        assert not reads, (step, reads)
        assert _addresses(opt, params) == before, step
    assert all(opt.state[p]["step"].item() == (3 if scaled else 4) + 1 for p in params)


def _schedule(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.5 * s))


def _scheduled_run(name, master, capturable, fused, scaled=False):
    """Five steps under a LambdaLR schedule: the default step (a float ``lr``, counts on the
    host) or a capturable one (an FP64 tensor ``lr`` the scheduler fills in place)."""
    params = _params()
    lr = OPTIMIZERS[name][1]["lr"]
    opt = _make(name, params, master, fused=fused, capturable=capturable,
                lr=torch.tensor(lr, dtype=torch.float64) if capturable else lr)
    sched = _schedule(opt)
    lr_tensor = opt.param_groups[0]["lr"]
    for step in range(5):
        _step(opt, params, step, scaled)
        sched.step()
    if capturable:  # (the same tensor, its value changed in place)
        assert opt.param_groups[0]["lr"] is lr_tensor
    return params, opt


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_capturable_with_a_tensor_lr_under_a_schedule_is_the_default_step(name):
    """Every optimizer, eager: the capturable step with a tensor ``lr`` under a schedule gives
    the default step's bits (Kahan; stochastic rounding for its keys made on the device)."""
    for master in ("kahan", "stochastic"):
        pa, oa = _scheduled_run(name, master, capturable=False, fused=False)
        pb, ob = _scheduled_run(name, master, capturable=True, fused=False)
        assert_same(pa, oa, pb, ob)


@pytest.mark.fused
@pytest.mark.parametrize(("name", "master", "scaled"), [
    ("adamw", "kahan", False), ("adamw", "kahan", True), ("sgd", "split", False),
    ("lamb", "kahan", False),
], ids=["adamw-kahan", "adamw-kahan-scaled", "sgd-split", "lamb-kahan"])
def test_capturable_fused_equals_the_default_step_and_never_recompiles(name, master, scaled,
                                                                       kernel_calls):
    """Compiled: the same bits as the default step, and the schedule's new values recompile
    nothing (the kernels compiled by the first steps are all that run after them)."""
    from torch._dynamo.utils import counters

    pa, oa = _scheduled_run(name, master, capturable=False, fused=True, scaled=scaled)
    graphs = counters["stats"]["unique_graphs"]
    pb, ob = _scheduled_run(name, master, capturable=True, fused=True, scaled=scaled)
    assert_same(pa, oa, pb, ob)
    made = counters["stats"]["unique_graphs"] - graphs
    # (and a later schedule's values: still no new graph)
    sched = _schedule(ob)
    for step in range(5, 8):
        _step(ob, pb, step, scaled)
        sched.step()
    assert counters["stats"]["unique_graphs"] - graphs == made
    assert kernel_calls, "no compiled kernel ran"


def test_a_tensor_lr_is_checked_when_its_group_is_added():
    """A tensor ``lr``'s value is checked when its group is added (as torch.optim checks it);
    a step checks its shape only, reading nothing, and refuses one of several elements before
    anything is written."""
    params = _params()
    with pytest.raises(ValueError, match="lr"):
        lowprec.AdamW(params, lr=torch.tensor(-1.0), capturable=True)
    opt = lowprec.AdamW(params, lr=torch.tensor(1e-3), capturable=True)
    opt.param_groups[0]["lr"] = torch.ones(2)
    for p in params:
        p.grad = torch.ones_like(p)
    before = [p.detach().clone() for p in params]
    with pytest.raises(ValueError, match="lr must be a number or a one-element"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, params, strict=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("name", "master", "scaled"), [
    ("adamw", "kahan", False), ("adamw", "kahan", True), ("sgd", "split", False),
    ("adamw", "stochastic", False), ("lamb", "kahan", False),
], ids=["adamw-kahan", "adamw-kahan-scaled", "sgd-split", "adamw-stochastic", "lamb-kahan"])
def test_a_step_captured_in_a_cuda_graph_replays_the_default_steps_bits(name, master, scaled):
    """The step captured once in a ``torch.cuda.CUDAGraph`` (after warm-up steps on a side
    stream, torch's recipe) and replayed with new gradients copied into the same tensors gives
    the bits of the uncaptured default step, and no replay reads the host
    (``torch.cuda.set_sync_debug_mode("error")``)."""
    steps, warm = 6, 3
    gen = torch.Generator().manual_seed(7)
    grads = [[(torch.randn(s, generator=gen) * (256 if scaled else 1)).bfloat16().cuda()
              for s in SHAPES] for _ in range(steps)]
    lr = OPTIMIZERS[name][1]["lr"]

    def make(capturable):
        params = [p.detach().cuda().requires_grad_() for p in _params()]
        tensor_lr = torch.tensor(lr, dtype=torch.float64, device="cuda")
        return params, _make(name, params, master, capturable=capturable,
                             lr=tensor_lr if capturable else lr)

    scale = {"grad_scale": torch.full((), 256.0, device="cuda"),
             "found_inf": torch.zeros((), device="cuda")} if scaled else {}
    ref_params, ref = make(False)
    for k in range(steps):
        for p, g in zip(ref_params, grads[k], strict=True):
            p.grad = g.clone()
        ref.step(**scale)
    params, opt = make(True)
    for p, g in zip(params, grads[0], strict=True):
        p.grad = g.clone()  # (the static gradients: each step copies its own into them)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # (state, buckets, compiled kernels: before the capture)
        for k in range(warm):
            for p, g in zip(params, grads[k], strict=True):
                p.grad.copy_(g)
            opt.step(**scale)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step(**scale)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for k in range(warm, steps):
            for p, g in zip(params, grads[k], strict=True):
                p.grad.copy_(g)
            graph.replay()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert_same(params, opt, ref_params, ref)


def test_a_constant_coefficient_is_made_anew_where_its_bits_change():
    """The constants kept from step to step (``param_step._constant``) are kept by their bits:
    the same value gives the same tensor (nothing made in a captured step), and -0.0 after 0.0
    a tensor of its own, as a value that changed does."""
    from lowprec.optim import param_step

    p = torch.zeros(4, requires_grad=True)
    opt = lowprec.SGD([p], lr=0.5)
    group, cpu = opt.param_groups[0], torch.device("cpu")
    first = param_step._constant(opt, group, cpu, "weight_decay", 0.0)
    assert param_step._constant(opt, group, cpu, "weight_decay", 0.0) is first
    negative = param_step._constant(opt, group, cpu, "weight_decay", -0.0)
    assert negative is not first and torch.signbit(negative)
    assert param_step._constant(opt, group, cpu, "weight_decay", 0.25).item() == 0.25
