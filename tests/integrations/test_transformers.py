"""lowprec optimizers under Hugging Face transformers' Trainer, on tiny BF16 GPT-2 models.

References are a Trainer run of the FP32 model with torch.optim.AdamW on the same data and seed,
and an uninterrupted run for resumed ones.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from transformers import (
    Trainer,
    TrainerCallback,
    TrainingArguments,
    get_cosine_schedule_with_warmup,
    get_linear_schedule_with_warmup,
)
from transformers.modeling_outputs import CausalLMOutputWithCrossAttentions
from transformers.utils import ModelOutput

import lowprec
from tests.integrations._models import (
    KEEPING,
    MASTERS,
    Progressions,
    assert_bit_equal,
    eval_loss,
    gpt2,
    masters,
    moved_apart,
    reset_accelerate_state,
    state_tensors,
    trained_params,
)

pytestmark = pytest.mark.integration

STEPS = 30
LR = 3e-3
#: A strategy that keeps FP32's updates ends within this relative gap of the FP32 run's loss.
GAP = 0.01
TRAIN = Progressions(256, seed=0)
HELD_OUT = Progressions(64, seed=1).batch()


def _args(out, **overrides) -> TrainingArguments:
    options = dict(
        output_dir=str(out), use_cpu=True, report_to=[], disable_tqdm=True,
        dataloader_num_workers=0, seed=0, max_steps=STEPS, per_device_train_batch_size=8,
        learning_rate=LR, lr_scheduler_type="linear", warmup_steps=0, weight_decay=0.0,
        logging_steps=1, save_strategy="no",
    )
    options.update(overrides)
    return TrainingArguments(**options)


def _inner(opt):
    """The optimizer a Trainer wraps (accelerate's ``AcceleratedOptimizer``)."""
    return getattr(opt, "optimizer", opt)


def _logged(trainer, key: str) -> list[float]:
    return [float(h[key]) for h in trainer.state.log_history if key in h and "train_loss" not in h]


class _Run:
    """A finished Trainer run: the trainer, its model and (unwrapped) optimizer, final loss."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.model = trainer.model
        self.opt = _inner(trainer.optimizer)
        self.loss = eval_loss(self.model, HELD_OUT)


class _Runs:
    """Trainer runs shared by the tests of this module (each is made once, when first asked)."""

    def __init__(self, tmp_factory):
        self._tmp = tmp_factory
        self._done: dict[tuple, _Run] = {}
        self.initial_loss = eval_loss(gpt2(), HELD_OUT)

    def get(self, master: str | None, how: str = "cls") -> _Run:
        key = (master, how)
        if key not in self._done:
            reset_accelerate_state()
            out = self._tmp.mktemp(f"run-{master}-{how}")
            if master is None:  # the reference: FP32 model, torch.optim.AdamW
                trainer = Trainer(
                    model=gpt2(), args=_args(out), train_dataset=TRAIN,
                    optimizer_cls_and_kwargs=(torch.optim.AdamW, {"lr": LR}),
                )
            elif how == "cls":
                trainer = Trainer(
                    model=gpt2(dtype=torch.bfloat16), args=_args(out), train_dataset=TRAIN,
                    optimizer_cls_and_kwargs=(lowprec.AdamW, {"lr": LR, "master": master}),
                )
            else:  # how == "tuple": the caller's optimizer and scheduler
                model = gpt2(dtype=torch.bfloat16)
                opt = lowprec.AdamW(model.parameters(), lr=LR, weight_decay=0.0, master=master)
                sched = get_linear_schedule_with_warmup(opt, 0, STEPS)
                trainer = Trainer(
                    model=model, args=_args(out), train_dataset=TRAIN, optimizers=(opt, sched)
                )
            trainer.train()
            self._done[key] = _Run(trainer)
        return self._done[key]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return _Runs(tmp_path_factory)


# ---------------------------------------------------------------------------- training quality


@pytest.mark.parametrize("master", MASTERS)
def test_trainer_with_optimizer_cls_and_kwargs_trains_like_fp32(runs, master):
    ref = runs.get(None)
    run = runs.get(master)
    assert type(run.opt) is lowprec.AdamW
    assert all(p.dtype == torch.bfloat16 for p in run.model.parameters())
    assert all(g["master"] == master for g in run.opt.param_groups)
    # Trainer's default groups: decay and no-decay, with the kwargs' lr (not args.learning_rate).
    assert len(run.opt.param_groups) == 2
    assert ref.loss < 0.7 * runs.initial_loss, "the FP32 reference itself did not learn"
    assert run.loss < 0.7 * runs.initial_loss
    # Trainer's linear schedule drove every group down to 0.
    assert run.trainer.lr_scheduler.get_last_lr() == [0.0, 0.0]
    assert all(g["lr"] == 0.0 for g in run.opt.param_groups)
    if master in KEEPING:
        gap = (run.loss - ref.loss) / ref.loss
        assert abs(gap) < GAP, f"{master}: final loss {run.loss:.4f} vs FP32's {ref.loss:.4f}"


def test_naive_bf16_ends_further_from_fp32_than_a_split_master(runs):
    """The baseline loses updates that the split master keeps (the point of lowprec)."""
    ref = runs.get(None).loss
    none_gap = abs(runs.get("none").loss - ref)
    split_gap = abs(runs.get("split").loss - ref)
    assert split_gap < none_gap


@pytest.mark.parametrize("master", ["kahan", "stochastic"])
def test_trainer_with_optimizers_tuple_uses_the_callers_optimizer_and_scheduler(runs, master):
    ref = runs.get(None)
    run = runs.get(master, how="tuple")
    assert type(run.opt) is lowprec.AdamW
    sched = run.trainer.lr_scheduler
    assert sched.optimizer is run.opt
    assert sched.last_epoch == STEPS  # stepped once per optimizer step
    assert all(g["lr"] == 0.0 for g in run.opt.param_groups)  # the linear schedule's end
    assert run.loss < 0.7 * runs.initial_loss
    assert abs(run.loss - ref.loss) / ref.loss < GAP
    if master == "kahan":
        # The same rule and hyperparameters in other parameter groups: the same bits.
        assert_bit_equal(
            trained_params(run.model), trained_params(runs.get(master).model), "parameter"
        )


def test_trainer_with_the_update_inside_backward_trains_the_same_bits(tmp_path):
    # lowprec.step_in_backward under the Trainer: its loop (backward, accelerate's optimizer
    # step, the scheduler, zero_grad) unchanged; no clipping (max_grad_norm=0: a global norm
    # finds no gradient once they are freed in backward).
    def run(inside: bool):
        reset_accelerate_state()
        model = gpt2(dtype=torch.bfloat16)
        opt = lowprec.AdamW(model.parameters(), lr=LR, weight_decay=0.0, master="kahan",
                            state_dtype="8bit")
        if inside:
            lowprec.step_in_backward(model, opt)
        sched = get_linear_schedule_with_warmup(opt, 0, STEPS)
        trainer = Trainer(model=model, args=_args(tmp_path / str(inside), max_grad_norm=0.0),
                          train_dataset=TRAIN, optimizers=(opt, sched))
        trainer.train()
        assert sched.last_epoch == STEPS
        return trainer

    normal, inside = run(False), run(True)
    assert all(p.grad is None for p in inside.model.parameters())
    assert _logged(inside, "loss") == _logged(normal, "loss")
    assert_bit_equal(trained_params(inside.model), trained_params(normal.model), "parameter")


# ---------------------------------------------------------------------------- resume


@pytest.mark.parametrize(
    ("master", "how", "name"),
    [("kahan", "cls", "AdamW"), ("split", "cls", "AdamW"), ("stochastic", "cls", "AdamW"),
     ("stochastic", "tuple", "AdamW"), ("split-8bit", "cls", "AdamW"),
     # the optimizers beside AdamW: Lion with 8-bit momentum (compiled, elementwise) and
     # Adafactor (each parameter whole, its factored statistics of their own shapes)
     ("kahan-8bit", "cls", "Lion"), ("kahan", "cls", "Adafactor")],
)
def test_trainer_resume_from_checkpoint_is_bit_identical(tmp_path, master, how, name):
    # ("split-8bit": 8-bit moments, codes and scales in Trainer's optimizer.pt)
    cls = getattr(lowprec, name)
    lr = {"AdamW": LR, "Lion": LR / 10, "Adafactor": 1e-2}[name]
    kw = {"master": master.removesuffix("-8bit")}
    if master.endswith("-8bit"):
        kw["state_dtype"] = "8bit"
    steps, half = 8, 4
    options = dict(
        max_steps=steps, save_strategy="steps", save_steps=half, lr_scheduler_type="cosine",
        warmup_steps=2, weight_decay=0.01, max_grad_norm=1.0, logging_steps=half,
    )

    def trainer(out, seed):
        model = gpt2(seed=seed, dtype=torch.bfloat16)
        args = _args(out, **options)
        if how == "cls":
            return Trainer(
                model=model, args=args, train_dataset=TRAIN,
                optimizer_cls_and_kwargs=(cls, {"lr": lr, **kw}),
            )
        # A seed of its own (its default, torch.initial_seed(), is 0 here): the checkpoint's
        # must win.
        opt = lowprec.AdamW(model.parameters(), lr=LR, seed=100 + seed, **kw)
        sched = get_cosine_schedule_with_warmup(opt, 2, steps)
        return Trainer(model=model, args=args, train_dataset=TRAIN, optimizers=(opt, sched))

    whole = trainer(tmp_path / "whole", seed=0)
    whole.train()
    checkpoint = tmp_path / "whole" / f"checkpoint-{half}"
    assert (checkpoint / "optimizer.pt").is_file()

    reset_accelerate_state()
    # Other initial weights: everything must come from the checkpoint.
    resumed = trainer(tmp_path / "resumed", seed=1)
    resumed.train(resume_from_checkpoint=str(checkpoint))

    assert resumed.state.global_step == steps
    assert_bit_equal(trained_params(resumed.model), trained_params(whole.model), "parameter")
    whole_opt, resumed_opt = _inner(whole.optimizer), _inner(resumed.optimizer)
    assert_bit_equal(
        masters(resumed.model, resumed_opt), masters(whole.model, whole_opt), "master weight"
    )
    assert_bit_equal(state_tensors(resumed_opt), state_tensors(whole_opt), "optimizer state")
    if "state_dtype" in kw:  # (the large weights' moments are codes: nothing fell back to FP32)
        assert any(t.dtype == torch.uint8 for t in state_tensors(whole_opt).values())
    assert resumed.lr_scheduler.get_last_lr() == whole.lr_scheduler.get_last_lr()
    seeds = [g["seed"] for g in whole_opt.param_groups]
    assert [g["seed"] for g in resumed_opt.param_groups] == seeds


# ---------------------------------------------------------------------------- Trainer features


class _Recorder(TrainerCallback):
    """What the optimizer is handed at each step: the clipped gradients' norm and the lrs."""

    def __init__(self):
        self.norms: list[float] = []
        self.lrs: list[list[float]] = []
        self.steps = 0

    def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, **kw):
        grads = [p.grad.float() for p in model.parameters() if p.grad is not None]
        self.norms.append(float(torch.linalg.vector_norm(torch.stack(
            [torch.linalg.vector_norm(g) for g in grads]))))
        self.lrs.append([g["lr"] for g in optimizer.param_groups])

    def on_optimizer_step(self, args, state, control, **kw):
        self.steps += 1


FEATURES = dict(
    max_steps=12, per_device_train_batch_size=4, gradient_accumulation_steps=2,
    max_grad_norm=0.3, lr_scheduler_type="cosine", warmup_steps=3, weight_decay=0.1,
)


def _expected_lrs(steps: int, warmup: int) -> list[float]:
    dummy = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=LR)
    sched = get_cosine_schedule_with_warmup(dummy, warmup, steps)
    out = []
    for _ in range(steps):
        out.append(dummy.param_groups[0]["lr"])
        dummy.step()
        sched.step()
    return out


@pytest.mark.parametrize("master", ["kahan", "split"])
def test_trainer_clipping_accumulation_and_schedule_on_a_bf16_model(tmp_path, master):
    recorder = _Recorder()
    model = gpt2(dtype=torch.bfloat16)
    initial = eval_loss(model, HELD_OUT)
    trainer = Trainer(
        model=model, args=_args(tmp_path, **FEATURES), train_dataset=TRAIN,
        optimizer_cls_and_kwargs=(lowprec.AdamW, {"lr": LR, "master": master}),
        callbacks=[recorder],
    )
    trainer.train()
    opt = _inner(trainer.optimizer)
    steps = FEATURES["max_steps"]

    # Accumulation: one optimizer step per 2 micro-batches, counted alike by lowprec.
    assert recorder.steps == steps
    assert all(int(e["step"]) == steps for e in opt.state_dict()["state"].values())
    # Clipping: the logged norm is before clipping, the optimizer sees the clipped gradients.
    before = _logged(trainer, "grad_norm")
    assert len(before) == steps
    clipped = [b > FEATURES["max_grad_norm"] for b in before]
    assert sum(clipped) >= steps // 2, f"clipping was not exercised: {before}"
    for b, seen in zip(before, recorder.norms, strict=True):
        want = min(b, FEATURES["max_grad_norm"])
        assert seen == pytest.approx(want, rel=0.02)  # BF16 gradients, rescaled in BF16
    # The scheduler drives every group's lr: warm-up then cosine, as for torch.optim.
    want = _expected_lrs(steps, FEATURES["warmup_steps"])
    for got, lr in zip(recorder.lrs, want, strict=True):
        assert got == pytest.approx([lr] * len(got), rel=1e-12, abs=1e-15)
    assert eval_loss(trainer.model, HELD_OUT) < 0.9 * initial


def test_trainer_features_on_an_fp32_model_match_torch_optim(tmp_path):
    """Clipping, accumulation, a warm-up + cosine schedule and weight decay in Trainer's groups:
    a lowprec AdamW on FP32 parameters follows torch.optim.AdamW (lowprec: within ~1e-6 a step)."""
    results = {}
    for name, cls in (("torch", torch.optim.AdamW), ("lowprec", lowprec.AdamW)):
        reset_accelerate_state()
        recorder = _Recorder()
        trainer = Trainer(
            model=gpt2(), args=_args(tmp_path / name, **FEATURES), train_dataset=TRAIN,
            optimizer_cls_and_kwargs=(cls, {"lr": LR}), callbacks=[recorder],
        )
        trainer.train()
        results[name] = (trainer, recorder)
    (ref, ref_rec), (low, low_rec) = results["torch"], results["lowprec"]
    assert type(_inner(low.optimizer)) is lowprec.AdamW
    assert low_rec.steps == ref_rec.steps == FEATURES["max_steps"]
    assert low_rec.lrs == ref_rec.lrs
    assert _logged(low, "learning_rate") == _logged(ref, "learning_rate")
    assert _logged(low, "grad_norm") == pytest.approx(_logged(ref, "grad_norm"), rel=1e-3)
    assert _logged(low, "loss") == pytest.approx(_logged(ref, "loss"), rel=1e-4)
    off = moved_apart(trained_params(low.model), trained_params(ref.model), trained_params(gpt2()))
    assert off < 1e-4, f"the weights ended {off:.1e} (relative) away from torch.optim's"


# ---------------------------------------------------------------------------- the model's API


def _check_model_api(model):
    batch = Progressions(4, seed=2).batch()
    out = model(**batch)
    assert isinstance(out, ModelOutput)
    assert isinstance(out, CausalLMOutputWithCrossAttentions)
    assert isinstance(out.loss, torch.Tensor) and out.loss.ndim == 0
    assert math.isfinite(float(out.loss.detach()))
    assert out.logits.shape == (4, batch["input_ids"].shape[1], model.config.vocab_size)
    assert out["loss"] is out.loss and out[0] is out.loss  # ModelOutput's three ways in
    prompt = batch["input_ids"][:, :8]
    generated = model.generate(input_ids=prompt, max_new_tokens=6, do_sample=False)
    assert generated.shape == (4, 8 + 6)
    assert torch.equal(generated[:, :8], prompt)
    assert int(generated.min()) >= 0 and int(generated.max()) < model.config.vocab_size


def test_model_output_and_generate_after_training_with_lowprec(runs):
    run = runs.get("kahan")
    _check_model_api(run.model)


def test_recipe_converted_model_keeps_model_output_and_generate():
    """``recipe.convert`` must leave the outputs' type alone (its hook casts them to FP32)."""
    model = lowprec.recipes.get("bf16-split").convert(gpt2())
    assert model.transformer.h[0].attn.c_attn.weight.dtype == torch.bfloat16
    assert model.transformer.ln_f.weight.dtype == torch.float32
    _check_model_api(model)
    out = model(**Progressions(4, seed=2).batch())
    assert out.logits.dtype == torch.float32


# ---------------------------------------------------------------------------- mixed dtypes


def test_split_with_fp32_norms_in_trainers_default_groups(tmp_path, runs):
    """``recipe.convert`` keeps LayerNorms FP32; Trainer's decay/no-decay groups then mix FP32 and
    BF16 parameters, and ``master="split"`` must step the FP32 ones plainly."""
    model = lowprec.recipes.get("bf16-split").convert(gpt2())
    norms = {n: p for n, p in model.named_parameters() if p.dtype == torch.float32}
    assert norms and all(".ln_" in n for n in norms)
    before = trained_params(model)
    trainer = Trainer(
        model=model, args=_args(tmp_path), train_dataset=TRAIN,
        optimizer_cls_and_kwargs=(lowprec.AdamW, {"lr": LR, "master": "split"}),
    )
    trainer.train()
    opt = _inner(trainer.optimizer)
    mixed = [g for g in opt.param_groups if len({p.dtype for p in g["params"]}) == 2]
    assert mixed, "no group mixes FP32 and BF16 parameters: the test lost its point"

    for name, p in model.named_parameters():
        master = opt.master_weight(p)
        assert master.dtype == torch.float32
        if name in norms:  # plain FP32: the parameter is its own master, and it was trained
            assert p.dtype == torch.float32
            assert torch.equal(master, p)
            assert not torch.equal(p, before[name])
        else:
            assert p.dtype == torch.bfloat16
    # split: the masters of the BF16 parameters hold bits below them
    assert any(not torch.equal(opt.master_weight(p), p.float()) for p in model.parameters())
    loss = eval_loss(model, HELD_OUT)
    ref = runs.get(None).loss
    assert abs(loss - ref) / ref < GAP


# ---------------------------------------------------------------------------- export


@pytest.mark.parametrize("master", ["split", "kahan"])
def test_master_state_dict_exports_the_master_for_tied_weights(runs, master):
    run = runs.get(master)
    model, opt = run.model, run.opt
    assert model.lm_head.weight is model.transformer.wte.weight  # GPT-2 ties them
    master_wte = opt.master_weight(model.transformer.wte.weight)
    assert not torch.equal(master_wte, model.transformer.wte.weight.float())

    exported = lowprec.master_state_dict(model, opt)
    for key in ("transformer.wte.weight", "lm_head.weight"):
        assert exported[key].dtype == torch.float32
        assert torch.equal(exported[key], master_wte), f"{key} is not the FP32 master"
    # What users do with it: an FP32 model that holds the masters, whichever name loads last.
    fp32 = gpt2(seed=1)
    fp32.load_state_dict(exported)
    assert torch.equal(fp32.lm_head.weight, master_wte)
    for name, p in fp32.named_parameters():
        assert torch.equal(p, opt.master_weight(dict(model.named_parameters())[name])), name
