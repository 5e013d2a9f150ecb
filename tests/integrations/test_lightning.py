"""lowprec under the real Lightning Trainer: BF16 training, checkpoints, and the precision plugin.

Every test trains a tiny regression model on CPU and compares with a reference run: an FP32 run
with ``torch.optim``, an uninterrupted run, or ``torch.optim`` under Lightning's own plugin.

On CPU, ``Trainer(precision="16-mixed")`` silently becomes ``"bf16-mixed"`` (Lightning's
accelerator connector: "AMP with fp16 is not supported on CPU"), so the FP16 runs pass the plugin
itself, ``plugins=[MixedPrecision("16-mixed", "cpu")]``: FP16 autocast and loss scaling then run
on CPU as on a GPU.
"""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Callable
from functools import partial
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

lightning = pytest.importorskip("lightning")

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.precision import (
    MixedPrecision as LightningMixedPrecision,
)

import lowprec
from lowprec.integrations.lightning import MixedPrecision

pytestmark = pytest.mark.integration

FEATURES = 16
BATCHES_PER_EPOCH = 8
INF_STEP = 5  # the optimizer step whose gradient the clipping tests poison with an inf


def _data(batch_size: int = 32) -> DataLoader:
    """A fixed regression task: a random two-layer teacher, in a fixed order (no shuffling)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(BATCHES_PER_EPOCH * batch_size, FEATURES, generator=g)
    w1 = torch.randn(FEATURES, 32, generator=g) / FEATURES**0.5
    w2 = torch.randn(32, 1, generator=g) / 32**0.5
    y = torch.tanh(x @ w1) @ w2
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


class Regressor(lightning.LightningModule):
    """A two-layer MLP that records what each step saw and did.

    Args:
        make_optimizer: Builds the optimizer from the parameters.
        make_scheduler: Builds a per-step lr scheduler from the optimizer (default: None).
        dtype: The parameters' dtype before Lightning converts anything (default: FP32).
        inf_at_step: Write an inf into a gradient at this optimizer step (default: None).
        clip_in_hook: Clip by norm to this value in ``configure_gradient_clipping`` whatever the
            trainer's ``gradient_clip_val`` (default: None: Lightning's own hook).
    """

    def __init__(
        self,
        make_optimizer: Callable[..., torch.optim.Optimizer],
        *,
        make_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
        dtype: torch.dtype = torch.float32,
        inf_at_step: int | None = None,
        clip_in_hook: float | None = None,
    ) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(FEATURES, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)
        )
        g = torch.Generator().manual_seed(1)  # the same initial weights in every run
        with torch.no_grad():
            for p in self.net.parameters():
                bound = p.shape[-1] ** -0.5 if p.dim() == 2 else 0.1
                p.uniform_(-bound, bound, generator=g)
        self.net.to(dtype)
        self.make_optimizer = make_optimizer
        self.make_scheduler = make_scheduler
        self.inf_at_step = inf_at_step
        self.clip_in_hook = clip_in_hook
        self.losses: list[float] = []
        self.hook_norms: list[float] = []  # gradient norm seen by on_before_optimizer_step
        self.params: list[torch.Tensor] = []  # all parameters, flat FP32, after each batch
        self.scales: list[float | None] = []
        self.lrs: list[float] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> Any:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x).float(), y.float())
        self.losses.append(float(loss))
        return loss

    def on_after_backward(self) -> None:
        if self.trainer.global_step == self.inf_at_step:
            with torch.no_grad():
                self.net[0].weight.grad.view(-1)[0] = float("inf")

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.hook_norms.append(_norm(self.parameters()))

    def configure_gradient_clipping(
        self, optimizer: torch.optim.Optimizer, gradient_clip_val: Any = None,
        gradient_clip_algorithm: Any = None,
    ) -> None:
        if self.clip_in_hook is None:
            super().configure_gradient_clipping(
                optimizer, gradient_clip_val, gradient_clip_algorithm
            )
        else:
            self.clip_gradients(optimizer, self.clip_in_hook, "norm")

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.params.append(
            torch.cat([p.detach().float().flatten() for p in self.parameters()])
        )
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        self.scales.append(None if scaler is None else scaler.get_scale())
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])

    def configure_optimizers(self) -> Any:
        optimizer = self.make_optimizer(self.parameters())
        if self.make_scheduler is None:
            return optimizer
        scheduler = {"scheduler": self.make_scheduler(optimizer), "interval": "step"}
        return {"optimizer": optimizer, "lr_scheduler": scheduler}


def _norm(params: Any) -> float:
    grads = [p.grad.float() for p in params if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))


def _fit(module: Regressor, *, ckpt_path: Any = None, callbacks: tuple = (), **kwargs: Any):
    with warnings.catch_warnings():
        # (Lightning's advice about dataloader workers, logging intervals and the like)
        warnings.simplefilter("ignore")
        trainer = lightning.Trainer(
            accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
            enable_model_summary=False, enable_checkpointing=bool(callbacks),
            callbacks=list(callbacks), **kwargs,
        )
        trainer.fit(module, _data(), ckpt_path=ckpt_path)
    return trainer


def _tail_loss(module: Regressor) -> float:
    """The mean training loss of the last two epochs (every batch twice)."""
    return sum(module.losses[-2 * BATCHES_PER_EPOCH:]) / (2 * BATCHES_PER_EPOCH)


# --------------------------------------------------------------------------- BF16 weights

BF16_LR = 5e-4  # Adam's steps, ~lr, are below half a BF16 ulp of many weights
BF16_STEPS = 160
BF16_TOLERANCE = 0.02  # of the FP32 run's final loss


@pytest.fixture(scope="module")
def bf16_baselines() -> dict[str, float]:
    """Final losses of the FP32 reference (torch.optim.AdamW) and of naive BF16 (master="none")."""
    fp32 = Regressor(partial(torch.optim.AdamW, lr=BF16_LR))
    _fit(fp32, precision="32-true", max_steps=BF16_STEPS)
    naive = Regressor(partial(lowprec.AdamW, lr=BF16_LR, master="none"))
    _fit(naive, precision="bf16-true", max_steps=BF16_STEPS)
    return {"fp32": _tail_loss(fp32), "first": fp32.losses[0], "none": _tail_loss(naive)}


def _gap(loss: float, baselines: dict[str, float]) -> float:
    return (loss - baselines["fp32"]) / baselines["fp32"]


@pytest.mark.parametrize("master", ["kahan", "split", "stochastic", "fp32"])
def test_bf16_true_trains_like_fp32(master: str, bf16_baselines: dict[str, float]) -> None:
    module = Regressor(partial(lowprec.AdamW, lr=BF16_LR, master=master))
    trainer = _fit(module, precision="bf16-true", max_steps=BF16_STEPS)

    assert all(p.dtype == torch.bfloat16 for p in module.parameters())  # Lightning converted
    opt = trainer.optimizers[0]
    assert all(opt.master_weight(p).dtype == torch.float32 for p in module.parameters())
    assert _tail_loss(module) < 0.2 * bf16_baselines["first"]
    assert abs(_gap(_tail_loss(module), bf16_baselines)) < BF16_TOLERANCE


def test_bf16_true_naive_baseline_falls_behind(bf16_baselines: dict[str, float]) -> None:
    # Round-to-nearest BF16 loses the small updates the masters keep: this is what the test
    # above would catch if a master strategy stopped working under Lightning.
    assert _gap(bf16_baselines["none"], bf16_baselines) > 5 * BF16_TOLERANCE


@pytest.mark.parametrize("master", ["kahan", "split", "stochastic"])
def test_bf16_checkpoint_resumes_bit_for_bit(master: str, tmp_path: Any) -> None:
    make = partial(lowprec.AdamW, lr=BF16_LR, master=master, weight_decay=0.1)
    steps, saved_at = 3 * BATCHES_PER_EPOCH, 2 * BATCHES_PER_EPOCH
    full = Regressor(make)
    checkpoint = ModelCheckpoint(
        dirpath=tmp_path, every_n_train_steps=saved_at, save_top_k=-1, filename="{step}"
    )
    full_trainer = _fit(full, precision="bf16-true", max_steps=steps, callbacks=(checkpoint,))

    # A new process has another default seed; the stochastic-rounding seed is in the checkpoint.
    torch.manual_seed(4321)
    resumed = Regressor(make)
    resumed_trainer = _fit(
        resumed, precision="bf16-true", max_steps=steps,
        ckpt_path=tmp_path / f"step={saved_at}.ckpt",
    )

    assert resumed_trainer.global_step == steps
    assert resumed.losses == full.losses[saved_at:]  # the same batches, the same losses
    full_opt, resumed_opt = full_trainer.optimizers[0], resumed_trainer.optimizers[0]
    for p, q in zip(full.parameters(), resumed.parameters(), strict=True):
        assert q.dtype == torch.bfloat16
        assert torch.equal(p, q)
        assert torch.equal(full_opt.master_weight(p), resumed_opt.master_weight(q))
        loaded = resumed_opt.state[q]
        assert loaded.keys() == full_opt.state[p].keys()
        for name, value in full_opt.state[p].items():
            if isinstance(value, torch.Tensor):
                assert loaded[name].dtype == value.dtype and torch.equal(loaded[name], value)
            else:
                assert loaded[name] == value


# --------------------------------------------------------------------------- the plugin

CLIP_STEPS = 30
SGD = partial(lowprec.SGD, lr=0.1, momentum=0.9)
TORCH_SGD = partial(torch.optim.SGD, lr=0.1, momentum=0.9)


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_lightnings_own_plugin_refuses_clipping_with_lowprec(precision: str) -> None:
    # Why the plugin exists: lowprec's optimizers unscale in their step
    # (_step_supports_amp_scaling), and Lightning's MixedPrecision refuses to clip for any such
    # optimizer, even under bf16-mixed, which has no scaler.
    module = Regressor(SGD)
    with pytest.raises(RuntimeError, match="does not allow for gradient clipping"):
        _fit(module, plugins=[LightningMixedPrecision(precision, "cpu")],
             gradient_clip_val=0.5, max_steps=2)


class _Spy:
    """Counts ``scaler.unscale_`` calls and records the gradient norm each clipping saw."""

    def __init__(self, plugin: Any) -> None:
        self.unscales = 0
        self.clipped_norms: list[float] = []  # before clipping
        self.clip_changed = 0  # clippings that changed a finite gradient
        unscale, by_norm, by_value = (
            plugin.scaler.unscale_, plugin.clip_grad_by_norm, plugin.clip_grad_by_value
        )

        def counting_unscale(optimizer: Any) -> None:
            self.unscales += 1
            unscale(optimizer)

        def seeing(clip: Callable[..., None]) -> Callable[..., None]:
            def wrapper(optimizer: Any, clip_val: Any) -> None:
                params = [p for g in optimizer.param_groups for p in g["params"]]
                before = _norm(params)
                self.clipped_norms.append(before)
                clip(optimizer, clip_val)
                self.clip_changed += math.isfinite(before) and _norm(params) < before
            return wrapper

        plugin.scaler.unscale_ = counting_unscale
        plugin.clip_grad_by_norm = seeing(by_norm)
        plugin.clip_grad_by_value = seeing(by_value)


def _skipped(module: Regressor) -> list[int]:
    """The steps that left every parameter unchanged (the scaler skipped them)."""
    before = [module.params[0].new_full(module.params[0].shape, float("nan")), *module.params]
    return [i for i in range(len(module.params)) if torch.equal(before[i], before[i + 1])]


def _assert_norms_match(ours: list[float], ref: list[float]) -> None:
    ours_t, ref_t = torch.tensor(ours), torch.tensor(ref)
    assert torch.equal(ours_t.isfinite(), ref_t.isfinite())
    finite = ref_t.isfinite()
    torch.testing.assert_close(ours_t[finite], ref_t[finite], rtol=1e-4, atol=0)


CLIP_CASES = {
    # name: (trainer arguments, Regressor arguments, our scaler)
    "no-clipping": ({}, {}, None),
    "clip-norm": ({"gradient_clip_val": 0.5}, {}, None),
    "clip-value": (
        {"gradient_clip_val": 0.02, "gradient_clip_algorithm": "value"}, {}, None
    ),
    "clip-norm-torch-gradscaler": (
        {"gradient_clip_val": 0.5}, {}, lambda: torch.amp.GradScaler("cpu")
    ),
    "clip-in-configure_gradient_clipping": ({}, {"clip_in_hook": 0.5}, None),
}


@pytest.mark.parametrize("case", list(CLIP_CASES))
def test_16_mixed_plugin_matches_torch_optim_under_lightnings_plugin(case: str) -> None:
    trainer_args, module_args, make_scaler = CLIP_CASES[case]
    clipping = bool(trainer_args) or bool(module_args)
    trainer_clips = bool(trainer_args)

    ours_plugin = MixedPrecision(
        "16-mixed", "cpu", scaler=None if make_scaler is None else make_scaler()
    )
    ours_spy = _Spy(ours_plugin)
    ours = Regressor(SGD, inf_at_step=INF_STEP, **module_args)
    _fit(ours, plugins=[ours_plugin], max_steps=CLIP_STEPS, **trainer_args)

    ref_plugin = LightningMixedPrecision("16-mixed", "cpu")  # torch's GradScaler
    ref_spy = _Spy(ref_plugin)
    ref = Regressor(TORCH_SGD, inf_at_step=INF_STEP, **module_args)
    _fit(ref, plugins=[ref_plugin], max_steps=CLIP_STEPS, **trainer_args)

    # The same steps skipped (the poisoned one among them), the scale backing off alike.
    assert INF_STEP in _skipped(ours)
    assert _skipped(ours) == _skipped(ref)
    assert ours.scales == ref.scales
    assert ours.scales[INF_STEP] == ours.scales[INF_STEP - 1] / 2
    # The same parameters at every step, and a falling loss.
    torch.testing.assert_close(torch.stack(ours.params), torch.stack(ref.params),
                               rtol=1e-4, atol=1e-5)
    assert _tail_loss(ours) < 0.5 * ours.losses[0]

    if clipping:
        # The clipping saw the true (unscaled) gradients, each step, as with torch.optim.
        assert len(ours_spy.clipped_norms) == CLIP_STEPS
        _assert_norms_match(ours_spy.clipped_norms, ref_spy.clipped_norms)
        assert ours_spy.unscales == CLIP_STEPS
        assert ours_spy.clip_changed > CLIP_STEPS // 2  # the clipping was active
    else:
        # No clipping: the gradients stay scaled and the optimizer unscales in its update.
        assert ours_spy.unscales == 0
        assert ours_spy.clipped_norms == []
    if trainer_clips:
        # Unscaled before on_before_optimizer_step, as Lightning does for torch.optim.
        _assert_norms_match(ours.hook_norms, ref.hook_norms)


def _plain_amp_loop(
    make_optimizer: Callable[..., torch.optim.Optimizer], steps: int, clip_val: float
) -> tuple[list[torch.Tensor], list[float]]:
    """torch.amp's own recipe without Lightning: scale, backward, unscale_, clip, step, update.

    Returns the parameters after each step and the gradient norm each clipping saw.
    """
    module = Regressor(make_optimizer)
    optimizer = make_optimizer(module.parameters())
    scaler = torch.amp.GradScaler("cpu")
    params, clipped_norms = [], []
    batches = [batch for _ in range(-(-steps // BATCHES_PER_EPOCH)) for batch in _data()]
    for x, y in batches[:steps]:
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16, cache_enabled=False):
            loss = torch.nn.functional.mse_loss(module.net(x).float(), y)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        clipped_norms.append(float(torch.nn.utils.clip_grad_norm_(module.parameters(), clip_val)))
        scaler.step(optimizer)
        scaler.update()
        params.append(torch.cat([p.detach().flatten() for p in module.parameters()]))
    return params, clipped_norms


def test_16_mixed_plugin_in_manual_optimization() -> None:
    # Manual optimization clips with self.clip_gradients(self.optimizers(), ...) before
    # opt.step(): the plugin unscales there (the optimizer behind Lightning's wrapper).
    class Manual(Regressor):
        def __init__(self, make_optimizer: Callable[..., torch.optim.Optimizer]) -> None:
            super().__init__(make_optimizer)
            self.automatic_optimization = False

        def training_step(self, batch: Any, batch_idx: int) -> None:
            opt = self.optimizers()
            opt.zero_grad()
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x).float(), y.float())
            self.losses.append(float(loss))
            self.manual_backward(loss)
            self.clip_gradients(opt, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
            opt.step()

    steps = 12
    plugin = MixedPrecision("16-mixed", "cpu")
    spy = _Spy(plugin)
    ours = Manual(SGD)
    _fit(ours, plugins=[plugin], max_steps=steps)
    ref_params, ref_norms = _plain_amp_loop(TORCH_SGD, steps, 0.5)

    assert spy.unscales == steps
    _assert_norms_match(spy.clipped_norms, ref_norms)
    assert max(ref_norms) > 0.5  # clipping was active
    torch.testing.assert_close(torch.stack(ours.params), torch.stack(ref_params),
                               rtol=1e-4, atol=1e-5)


def test_bf16_mixed_is_lightnings_plugin_and_clips() -> None:
    # Without clipping: Lightning's own bf16-mixed (what precision="16-mixed" becomes on CPU
    # too), bit for bit.
    ours = Regressor(partial(lowprec.AdamW, lr=1e-2))
    trainer = _fit(ours, plugins=[MixedPrecision("bf16-mixed", "cpu")], max_steps=12)
    ref = Regressor(partial(lowprec.AdamW, lr=1e-2))
    _fit(ref, precision="bf16-mixed", max_steps=12)
    assert trainer.precision_plugin.scaler is None
    assert ours.losses == ref.losses
    assert torch.equal(ours.params[-1], ref.params[-1])

    # With clipping, which Lightning's plugin refuses for lowprec: as torch.optim.SGD clips there.
    ours = Regressor(SGD)
    _fit(ours, plugins=[MixedPrecision("bf16-mixed", "cpu")], max_steps=CLIP_STEPS,
         gradient_clip_val=0.5)
    ref = Regressor(TORCH_SGD)
    _fit(ref, precision="bf16-mixed", max_steps=CLIP_STEPS, gradient_clip_val=0.5)
    assert max(ours.hook_norms) > 0.5  # clipping was active
    torch.testing.assert_close(torch.stack(ours.params), torch.stack(ref.params),
                               rtol=1e-3, atol=1e-4)
    assert _tail_loss(ours) < 0.5 * ours.losses[0]


def test_fp16_weights_clip_with_the_default_lossscaler_only() -> None:
    # Why the plugin's default scaler is lowprec.LossScaler: it unscales FP16 gradients, so an
    # FP16 model with an FP32 master copy can clip; torch's GradScaler refuses them.
    make = partial(lowprec.AdamW, lr=1e-2, master="fp32")
    ours = Regressor(make, dtype=torch.float16)
    _fit(ours, plugins=[MixedPrecision("16-mixed", "cpu")], max_steps=CLIP_STEPS,
         gradient_clip_val=0.5)
    ref = Regressor(partial(torch.optim.AdamW, lr=1e-2))
    _fit(ref, precision="32-true", max_steps=CLIP_STEPS, gradient_clip_val=0.5)
    assert all(p.dtype == torch.float16 for p in ours.parameters())
    assert abs(_tail_loss(ours) - _tail_loss(ref)) < 0.05 * _tail_loss(ref)

    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match="unscale FP16 gradients"):
        _fit(Regressor(make, dtype=torch.float16), plugins=[plugin], max_steps=2,
             gradient_clip_val=0.5)


@pytest.mark.parametrize("first_plugin", ["lowprec", "lightning"])
def test_16_mixed_resume_restores_the_scale(first_plugin: str, tmp_path: Any) -> None:
    steps, saved_at = 3 * BATCHES_PER_EPOCH, 2 * BATCHES_PER_EPOCH

    def checkpoint(folder: str) -> ModelCheckpoint:
        return ModelCheckpoint(dirpath=tmp_path / folder, every_n_train_steps=saved_at,
                               save_top_k=-1, filename="{step}")

    full = Regressor(SGD, inf_at_step=INF_STEP)  # the skipped step halves the scale
    _fit(full, plugins=[MixedPrecision("16-mixed", "cpu")], max_steps=steps,
         callbacks=(checkpoint("full"),))
    path = tmp_path / "full" / f"step={saved_at}.ckpt"
    if first_plugin == "lightning":
        # The first part under Lightning's own plugin (torch's GradScaler; the checkpoint key is
        # the same): it steps lowprec's optimizer the same way when nothing is clipped.
        first = Regressor(SGD, inf_at_step=INF_STEP)
        _fit(first, plugins=[LightningMixedPrecision("16-mixed", "cpu")], max_steps=saved_at,
             callbacks=(checkpoint("first"),))
        assert first.scales == full.scales[:saved_at]
        path = tmp_path / "first" / f"step={saved_at}.ckpt"

    resumed = Regressor(SGD, inf_at_step=INF_STEP)
    _fit(resumed, plugins=[MixedPrecision("16-mixed", "cpu")], max_steps=steps, ckpt_path=path)
    assert full.scales[saved_at - 1] != full.scales[0]  # the scale to restore is not the initial one
    assert resumed.scales == full.scales[saved_at:]
    assert resumed.losses == full.losses[saved_at:]
    assert torch.equal(resumed.params[-1], full.params[-1])


@pytest.mark.parametrize("precision", ["32-true", "16-mixed"])
def test_accumulation_and_scheduler_as_with_torch_optim(precision: str) -> None:
    accumulate, steps = 3, 8

    def run(make: Callable[..., torch.optim.Optimizer], lightnings_plugin: bool) -> Any:
        module = Regressor(
            make, make_scheduler=partial(torch.optim.lr_scheduler.StepLR, step_size=3, gamma=0.5)
        )
        if precision == "32-true":
            setup: dict[str, Any] = {"precision": "32-true"}
        else:
            plugin = (LightningMixedPrecision("16-mixed", "cpu") if lightnings_plugin
                      else MixedPrecision("16-mixed", "cpu"))
            setup = {"plugins": [plugin], "gradient_clip_val": 0.5}
        trainer = _fit(module, accumulate_grad_batches=accumulate, max_steps=steps, **setup)
        return module, trainer

    ours, ours_trainer = run(partial(lowprec.AdamW, lr=1e-2, weight_decay=0.1), False)
    ref, ref_trainer = run(partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1), True)

    assert ours_trainer.global_step == ref_trainer.global_step == steps
    assert len(ours.losses) == len(ref.losses) > steps
    assert ours.lrs == ref.lrs
    assert ours.lrs[-1] < ours.lrs[0]  # the scheduler stepped
    assert ours.scales == ref.scales
    # Parameters move only at the end of each accumulation window, as torch.optim's do.
    assert _skipped(ours) == _skipped(ref)
    torch.testing.assert_close(torch.stack(ours.params), torch.stack(ref.params),
                               rtol=1e-5, atol=1e-6)
    for p, q in zip(ours.parameters(), ref.parameters(), strict=True):
        assert float(ours_trainer.optimizers[0].state[p]["step"]) == float(
            ref_trainer.optimizers[0].state[q]["step"]
        )


# --------------------------------------------------------------------------- plugin arguments


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        (("16-true", "cpu"), {}, ValueError, "'16-mixed' or 'bf16-mixed'"),
        (("bf16-true", "cpu"), {}, ValueError, "'16-mixed' or 'bf16-mixed'"),
        (("16-mixed", "not-a-device"), {}, ValueError, "not a device"),
        (("16-mixed", 0), {}, TypeError, "device must be"),
        (("bf16-mixed", "cpu"), {"scaler": lowprec.LossScaler()}, ValueError, "no loss scaler"),
        (("16-mixed", "cpu"), {"scaler": object()}, TypeError, "lacks scale, unscale_"),
    ],
)
def test_plugin_rejects_bad_arguments(
    args: tuple, kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        MixedPrecision(*args, **kwargs)


def test_plugin_defaults() -> None:
    assert isinstance(MixedPrecision("16-mixed", "cpu").scaler, lowprec.LossScaler)
    assert MixedPrecision("bf16-mixed", torch.device("cpu")).scaler is None
    assert MixedPrecision("16-mixed", "cuda:1").device == "cuda"
    scaler = torch.amp.GradScaler("cpu")
    assert MixedPrecision("16-mixed", "cpu", scaler=scaler).scaler is scaler


def test_lowprec_imports_without_lightning() -> None:
    code = textwrap.dedent("""
        import sys
        import lowprec, lowprec.integrations
        assert not [m for m in sys.modules if m.split(".")[0] == "lightning"], "imported lightning"
        sys.modules["lightning"] = None  # as if Lightning were not installed
        try:
            import lowprec.integrations.lightning
        except ImportError as error:
            print(error)
        else:
            raise SystemExit("the plugin module imported without Lightning")
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert 'pip install "lowprec[integrations]"' in result.stdout
