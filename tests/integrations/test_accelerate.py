"""lowprec optimizers under Hugging Face Accelerate: prepare, backward, clipping, accumulation,
save_state/load_state and fp16 loss scaling (torch.amp.GradScaler), on tiny Llama models.

References are the same loop written without Accelerate, an uninterrupted run for a resumed one,
and torch.optim.AdamW under the same GradScaler.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from torch.utils.data import DataLoader
from transformers import get_cosine_schedule_with_warmup

import lowprec
from tests.integrations._models import (
    Progressions,
    assert_bit_equal,
    eval_loss,
    llama,
    masters,
    moved_apart,
    reset_accelerate_state,
    state_tensors,
    trained_params,
)

pytestmark = pytest.mark.integration

LR = 3e-3
ACCUMULATE = 2
STEPS = 16  # optimizer steps: STEPS * ACCUMULATE micro-batches
MICRO = 4
MAX_NORM = 0.5
DATA = Progressions(STEPS * ACCUMULATE * MICRO, seed=0)
HELD_OUT = Progressions(64, seed=1).batch()


def _parts(master: str, seed: int = 0):
    """A BF16 Llama, a lowprec AdamW, an ordered loader and a warm-up + cosine schedule."""
    model = llama(seed=seed, dtype=torch.bfloat16)
    opt = lowprec.AdamW(model.parameters(), lr=LR, weight_decay=0.01, master=master)
    loader = DataLoader(DATA, batch_size=MICRO, shuffle=False)
    sched = get_cosine_schedule_with_warmup(opt, 2, STEPS)
    return model, opt, loader, sched


def _accelerate_loop(accelerator, model, opt, loader, sched, save_at=None, save_dir=None):
    """The loop of Accelerate's docs: accumulate, backward, clip when synced, step."""
    for i, batch in enumerate(loader):
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)
            opt.step()
            sched.step()
            opt.zero_grad()
        if save_at is not None and i + 1 == save_at * ACCUMULATE:
            accelerator.save_state(str(save_dir))


@pytest.mark.parametrize("master", ["kahan", "split", "stochastic"])
def test_accelerate_loop_equals_the_plain_loop(master):
    """prepare() + backward + clip_grad_norm_ + accumulate change nothing a lowprec step sees."""
    model, opt, loader, sched = _parts(master)
    initial = eval_loss(model, HELD_OUT)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATE)
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    assert isinstance(opt, AcceleratedOptimizer) and type(opt.optimizer) is lowprec.AdamW
    calls = []
    opt.optimizer.register_step_post_hook(lambda o, args, kwargs: calls.append(1))
    _accelerate_loop(accelerator, model, opt, loader, sched)

    ref_model, ref_opt, ref_loader, ref_sched = _parts(master)
    for i, batch in enumerate(ref_loader):
        (ref_model(**batch).loss / ACCUMULATE).backward()
        if (i + 1) % ACCUMULATE == 0:
            torch.nn.utils.clip_grad_norm_(ref_model.parameters(), MAX_NORM)
            ref_opt.step()
            ref_sched.step()
            ref_opt.zero_grad()

    assert len(calls) == STEPS  # micro-batches' steps were skipped by the wrapper
    assert opt.optimizer.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]
    unwrapped = accelerator.unwrap_model(model)
    assert_bit_equal(trained_params(unwrapped), trained_params(ref_model), "parameter")
    assert_bit_equal(masters(unwrapped, opt.optimizer), masters(ref_model, ref_opt), "master")
    assert all(p.dtype == torch.bfloat16 for p in unwrapped.parameters())
    assert eval_loss(unwrapped, HELD_OUT) < 0.9 * initial


@pytest.mark.parametrize("master", ["kahan", "split", "stochastic"])
def test_accelerate_save_state_load_state_resumes_bit_for_bit(tmp_path, master):
    half = STEPS // 2
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATE)
    model, opt, loader, sched = accelerator.prepare(*_parts(master))
    _accelerate_loop(accelerator, model, opt, loader, sched, save_at=half, save_dir=tmp_path)
    whole_model = accelerator.unwrap_model(model)

    reset_accelerate_state()
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATE)
    # Other initial weights: everything must come from the saved state.
    r_model, r_opt, r_loader, r_sched = accelerator.prepare(*_parts(master, seed=1))
    accelerator.load_state(str(tmp_path))
    rest = accelerator.skip_first_batches(r_loader, half * ACCUMULATE)
    _accelerate_loop(accelerator, r_model, r_opt, rest, r_sched)
    resumed_model = accelerator.unwrap_model(r_model)

    assert_bit_equal(trained_params(resumed_model), trained_params(whole_model), "parameter")
    assert_bit_equal(
        masters(resumed_model, r_opt.optimizer), masters(whole_model, opt.optimizer), "master"
    )
    assert_bit_equal(state_tensors(r_opt), state_tensors(opt), "optimizer state")
    assert r_sched.get_last_lr() == sched.get_last_lr()


# ---------------------------------------------------------------------------- fp16 loss scaling


def _fp16_accelerator() -> Accelerator:
    """``Accelerator(mixed_precision="fp16")`` with its GradScaler.

    On CPU, Accelerate makes neither a GradScaler nor an autocast for fp16 (it trains in FP32,
    silently); it gets a ``torch.amp.GradScaler("cpu")``, which CPU fp16 autocast can use, so
    that the loop below runs Accelerate's own fp16 code (scaled backward, ``unscale_`` before
    clipping, ``scaler.step``/``update`` in the optimizer wrapper) as it would on a GPU.
    """
    cuda = torch.cuda.is_available()
    accelerator = Accelerator(mixed_precision="fp16", cpu=not cuda)
    if accelerator.scaler is None:
        accelerator.native_amp = True
        accelerator.scaler = torch.amp.GradScaler(accelerator.device.type)
    return accelerator


def _fp16_run(make_opt, steps: int = 8):
    """Train an FP32 Llama under fp16 autocast + GradScaler; clip at even steps; put an inf in a
    gradient at step ``OVERFLOW_AT`` (a GradScaler must skip that step and halve its scale).

    Returns the model, the optimizer, and per step: the scale before and after, Accelerate's
    ``step_was_skipped``, the parameters before, the gradients before the step (scaled), the norm
    ``clip_grad_norm_`` returned (or None), the gradients after clipping and after the step.
    """
    accelerator = _fp16_accelerator()
    model = llama(seed=0).to(accelerator.device)
    opt = make_opt(model.parameters())
    loader = DataLoader(Progressions(steps * MICRO, seed=0), batch_size=MICRO, shuffle=False)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    records = []
    for i, batch in enumerate(loader):
        loss = model(**batch).loss
        accelerator.backward(loss)
        if i == OVERFLOW_AT:
            next(model.parameters()).grad.view(-1)[0] = float("inf")
        scale = accelerator.scaler.get_scale()
        params = [p.detach().clone() for p in model.parameters()]
        before = [p.grad.clone() for p in model.parameters()]
        norm, clipped = None, None
        if i % 2 == 0:
            norm = float(accelerator.clip_grad_norm_(model.parameters(), MAX_NORM))
            clipped = [p.grad.clone() for p in model.parameters()]
        opt.step()
        after = [p.grad.clone() for p in model.parameters()]
        records.append(dict(
            scale=scale, scale_after=accelerator.scaler.get_scale(),
            was_skipped=opt.step_was_skipped, params=params, before=before, norm=norm,
            clipped=clipped, after=after, loss=float(loss.detach()),
        ))
        opt.zero_grad()
    return accelerator.unwrap_model(model), opt.optimizer, records


def _norm(grads) -> float:
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float())
                                                       for g in grads])))


#: (lowprec optimizer, torch.optim reference): SGD's update is proportional to the gradient, so a
#: wrong scale shows in the weights; AdamW's is nearly scale-free, and near-zero gradients make
#: its eps term amplify the ~1e-7 differences of lowprec's FP32 arithmetic, so only its losses
#: are compared.
OPTIMIZERS = {
    "sgd": (lambda ps: lowprec.SGD(ps, lr=0.2, momentum=0.9),
            lambda ps: torch.optim.SGD(ps, lr=0.2, momentum=0.9, foreach=False)),
    "adamw": (lambda ps: lowprec.AdamW(ps, lr=LR),
              lambda ps: torch.optim.AdamW(ps, lr=LR, foreach=False)),
}
OVERFLOW_AT = 3


@pytest.fixture(scope="module", params=list(OPTIMIZERS))
def fp16_runs(request):
    make_low, make_ref = OPTIMIZERS[request.param]
    reset_accelerate_state()
    low = _fp16_run(make_low)
    reset_accelerate_state()
    ref = _fp16_run(make_ref)
    reset_accelerate_state()
    return request.param, low, ref


def test_fp16_gradscaler_drives_a_lowprec_step_as_a_torch_step(fp16_runs):
    _, (model, opt, recs), (ref_model, _, ref_recs) = fp16_runs
    assert type(opt) in (lowprec.SGD, lowprec.AdamW)
    assert recs[0]["scale"] > 1  # the gradients really were scaled
    # The same scale sequence: the overflow step, and only it, halved the scale.
    scales = [(r["scale"], r["scale_after"]) for r in recs]
    assert scales == [(r["scale"], r["scale_after"]) for r in ref_recs]
    skipped = [after < before for before, after in scales]
    assert skipped == [i == OVERFLOW_AT for i in range(len(recs))]
    # The skipped step left every parameter as it was.
    for before, now in zip(recs[OVERFLOW_AT]["params"], recs[OVERFLOW_AT + 1]["params"],
                           strict=True):
        assert torch.equal(before, now)
    # The same updates otherwise: lowprec on FP32 parameters is within ~1e-6 of torch.optim a
    # step, which the fp16 forward amplifies a little (a wrong scale would be off 2**15-fold).
    assert [r["loss"] for r in recs] == pytest.approx([r["loss"] for r in ref_recs], rel=1e-3)
    start = trained_params(llama(seed=0))
    off = moved_apart(trained_params(model), trained_params(ref_model), start)
    assert off < 1e-2, f"the weights ended {off:.1e} (relative) away from torch.optim's"
    assert eval_loss(model, HELD_OUT) < 0.95 * eval_loss(llama(seed=0), HELD_OUT)


def test_fp16_clip_grad_norm_sees_unscaled_gradients(fp16_runs):
    _, (_, _, recs), _ = fp16_runs
    clipped_steps = [r for r in recs if r["norm"] is not None]
    assert clipped_steps
    for r in clipped_steps:
        unscaled = [g / r["scale"] for g in r["before"]]
        assert r["norm"] == pytest.approx(_norm(unscaled), rel=1e-4)
        assert r["norm"] > MAX_NORM  # clipping acted (the tiny model's norms are ~1-3)
        assert _norm(r["clipped"]) <= MAX_NORM * (1 + 1e-4)


def test_fp16_gradients_after_the_step_are_unscaled_as_with_torch_optim(fp16_runs):
    """GradScaler.step unscales ``p.grad`` for torch.optim (in place, before its step); a lowprec
    step takes ``grad_scale`` instead and must leave ``p.grad`` unscaled too."""
    _, (_, _, recs), (_, _, ref_recs) = fp16_runs
    plain = [(r, q) for i, (r, q) in enumerate(zip(recs, ref_recs, strict=True))
             if r["norm"] is None and i != OVERFLOW_AT]
    assert plain, "no step without clipping went through"
    for r, q in plain:
        for ref_before, ref_after in zip(q["before"], q["after"], strict=True):
            assert torch.equal(ref_after, ref_before / q["scale"])  # what torch.optim leaves
        for before, after in zip(r["before"], r["after"], strict=True):
            assert torch.equal(after, before / r["scale"]), (
                f"p.grad after the step is {float(after.abs().sum() / before.abs().sum()):g} "
                f"times the scaled gradient, not 1/{r['scale']:g}"
            )
