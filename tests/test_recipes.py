"""Recipes: conversion, optimizer wiring, training to within a stated tolerance of FP32."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lowprec import recipes
from lowprec.dfp import DFPConv2d, DFPLinear
from lowprec.diagnostics import gradient_range
from lowprec.optim import core

STEPS = 150
#: Each recipe's final training loss must be within this relative gap of FP32's. A "-release"
#: recipe trains the bits of the recipe without the suffix
#: (test_release_recipe_trains_the_same_bits_as_its_normal_step: every loss and the final one
#: equal), so its gap is that recipe's, held here: it is not trained a third time for it.
TOLERANCE = {
    "amp-bf16": 0.03, "amp-fp16": 0.03, "bf16": 0.10, "bf16-kahan": 0.03, "bf16-split": 0.03,
    "bf16-sr": 0.03, "bf16-kahan-8bit": 0.03, "bf16-split-8bit": 0.03, "fp16-master": 0.03,
    "dfp16": 0.03, "bf16-kahan-4bit": 0.03,
}


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 64)
        self.norm = nn.LayerNorm(64)
        self.out = nn.Linear(64, 4)

    def forward(self, x):
        return self.out(torch.tanh(self.norm(self.inp(x))))


def _data(n=512):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, 16, generator=gen)
    w = torch.randn(16, 4, generator=gen)
    return x, torch.sin(x @ w)


def _train(recipe, *, steps=STEPS, loss_factor=1.0, lr=1e-2):
    torch.manual_seed(0)
    model = recipe.convert(_Net())
    opt = recipe.optimizer("adamw", model, lr=lr, weight_decay=0.0)
    x, y = _data()
    losses = []
    for i in range(steps):
        sl = slice((i * 64) % 512, (i * 64) % 512 + 64)
        opt.zero_grad()
        with recipe.autocast():
            out = model(x[sl])
        loss = (out.float() - y[sl]).pow(2).mean()
        recipe.backward(loss * loss_factor)
        recipe.step(opt)
        losses.append(float(loss.detach()))
    with torch.no_grad():
        final = float((model(x).float() - y).pow(2).mean())
    return final, losses, model, opt


@pytest.fixture(scope="module")
def fp32_loss():
    return _train(recipes.get("fp32"))[0]


@pytest.mark.parametrize("name", [
    # (the block-format recipes train in tests/test_blockfmt.py, eagerly: here each would
    # compile its quantizer kernels; the -release recipes: see TOLERANCE)
    n for n in recipes.RECIPES
    if n != "fp32" and not n.endswith("-release") and recipes.get(n).gemms is None
])
def test_recipe_trains_within_tolerance_of_fp32(name, fp32_loss):
    final, losses, _, _ = _train(recipes.get(name))
    gap = (final - fp32_loss) / fp32_loss
    print(f"recipe {name}: final {final:.5f} vs fp32 {fp32_loss:.5f}, gap {gap:+.2%}")
    assert final < 0.6 * losses[0]  # it learned
    assert gap < TOLERANCE[name]


@pytest.mark.parametrize("name", [n for n in recipes.RECIPES if n.endswith("-release")])
def test_release_recipe_trains_the_same_bits_as_its_normal_step(name):
    # The update inside backward (lowprec.step_in_backward) is the same step, taken earlier.
    # (Hence also within the recipe without the suffix's TOLERANCE of FP32's loss.)
    final, losses, model, opt = _train(recipes.get(name))
    ref_final, ref_losses, ref_model, _ = _train(recipes.get(name.removesuffix("-release")))
    assert core.stages(opt).in_backward is not None
    assert all(p.grad is None for p in model.parameters())  # (freed in backward)
    assert losses == ref_losses and final == ref_final
    for a, b in zip(model.parameters(), ref_model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_release_recipe_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="loss_scaling"):
        recipes.get("bf16-kahan-8bit-release", loss_scaling="dynamic")
    model = recipes.get("bf16-kahan-8bit-release").convert(_Net())
    with pytest.raises(ValueError, match="pass the model"):
        recipes.get("bf16-kahan-8bit-release").optimizer("adamw", model.parameters())


def test_fp16_master_keeps_the_small_gradients_plain_fp16_loses():
    # A loss 2**-26 times smaller (as with tiny per-sample losses): its FP16 gradients fall below
    # 2**-24 and flush to zero without scaling; AdamW is scale-invariant, so with loss scaling
    # training is unchanged.
    factor = 2.0**-26
    scaled = recipes.get("fp16-master")
    unscaled = recipes.get("fp16-master", loss_scaling=None)
    fp32_final = _train(recipes.get("fp32"), steps=100, loss_factor=factor)[0]
    ok_final, *_ = _train(scaled, steps=100, loss_factor=factor)
    bad_final, bad_losses, model, _ = _train(unscaled, steps=100, loss_factor=factor)
    # measure the flush directly: the unscaled FP16 gradients are mostly zero
    x, y = _data()
    model.zero_grad()
    ((model(x[:64]).float() - y[:64]).pow(2).mean() * factor).backward()
    lost = gradient_range(model)
    assert lost.zero > 0.5
    assert abs(ok_final - fp32_final) / fp32_final < 0.03
    assert bad_final > 0.9 * bad_losses[0]  # barely moved
    assert bad_final > 1.3 * ok_final


def test_convert_keeps_norm_layers_fp32_and_returns_fp32_outputs():
    model = recipes.get("bf16-kahan").convert(_Net())
    assert model.inp.weight.dtype == torch.bfloat16
    assert model.norm.weight.dtype == torch.float32
    out = model(torch.randn(3, 16))  # FP32 input is cast on the way in
    assert out.dtype == torch.float32
    keep_all_low = recipes.get("bf16", keep_fp32=()).convert(_Net())
    assert keep_all_low.norm.weight.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="already converted"):
        recipes.get("bf16").convert(model)


class _Output(dict):
    """A mapping output with attribute access, as Hugging Face's ModelOutput."""

    def __getattr__(self, name):
        return self[name]


class _DictNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        y = self.lin(x)
        return _Output(logits=y, loss=y.square().mean(), cache={"k": y.detach()}, note="kept")


def test_convert_keeps_mapping_outputs_of_their_type():
    model = recipes.get("bf16-kahan").convert(_DictNet())
    out = model(torch.randn(2, 4))
    assert type(out) is _Output
    assert out.loss.dtype == torch.float32 and out.logits.dtype == torch.float32
    assert type(out["cache"]) is dict and out["cache"]["k"].dtype == torch.float32
    assert out.note == "kept"


def test_split_recipe_steps_fp32_layers_plainly():
    recipe = recipes.get("bf16-split")
    model = recipe.convert(_Net())
    opt = recipe.optimizer("sgd", model.parameters(), lr=0.1, momentum=0.9)
    assert [g["master"] for g in opt.param_groups] == ["split"]
    model(torch.randn(3, 16)).sum().backward()
    opt.step()
    assert opt.state[model.inp.weight]["master"] == "split"
    assert opt.state[model.norm.weight]["master"] == "none"


def test_optimizer_names_and_bad_input():
    recipe = recipes.get("bf16-sr")
    for name in ("sgd", "adagrad", "lamb", "adamw", "AdamW", "adam", "radam", "lion",
                 "stableadamw", "adafactor", "Muon"):
        opt = recipe.optimizer(name, [nn.Parameter(torch.zeros(3, 2, dtype=torch.bfloat16))],
                               lr=0.1)
        assert opt.param_groups[0]["master"] == "stochastic"
        assert type(opt).__name__.lower() == name.lower()
    with pytest.raises(ValueError, match="unknown optimizer 'adamax'; choose one of sgd"):
        recipe.optimizer("adamax", [], lr=0.1)
    with pytest.raises(ValueError, match="sets master="):
        recipe.optimizer("sgd", [nn.Parameter(torch.zeros(3))], lr=0.1, master="fp32")
    with pytest.raises(ValueError, match="unknown recipe 'bf8'; choose one of fp32, amp-bf16"):
        recipes.get("bf8")
    with pytest.raises(TypeError, match="unknown options"):
        recipes.get("bf16", master="split")


def test_recipe_state_dict_round_trip():
    a = recipes.get("amp-fp16")
    _train(a, steps=5)
    b = recipes.get("amp-fp16")
    b.load_state_dict(a.state_dict())
    assert b.scaler.get_scale() == a.scaler.get_scale()
    with pytest.raises(ValueError, match="for recipe 'amp-fp16', not 'fp16-master'"):
        recipes.get("fp16-master").load_state_dict(a.state_dict())


def test_every_named_recipe_is_buildable_and_listed():
    assert recipes.names() == recipes.RECIPES
    assert set(recipes.RECIPES) == {"fp32", "amp-bf16", "amp-fp16", "bf16", "bf16-kahan",
                                    "bf16-split", "bf16-sr", "bf16-kahan-8bit",
                                    "bf16-split-8bit", "bf16-kahan-8bit-release",
                                    "bf16-kahan-4bit", "bf16-kahan-4bit-release",
                                    "fp16-master", "dfp16", "mxfp8", "mxfp8-split",
                                    "mxfp8-8bit", "mxfp8-bf16", "mxfp6", "mxfp4", "nvfp4",
                                    "nvfp4-bf16", "nvfp4-bare", "nvfp4-no-2d", "nvfp4-no-sr",
                                    "nvfp4-no-rht", "nvfp4-no-edges"}
    for name in recipes.RECIPES:
        assert recipes.get(name).name == name


class _Kept(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x)


def test_dfp16_converts_linear_and_conv_and_keeps_fp32_masters():
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(8, 4), nn.LayerNorm(4),
                          _Kept())
    before = [p for p in model.parameters()]
    recipe = recipes.get("dfp16", keep_fp32=(*recipes.NORM_LAYERS, _Kept))
    model = recipe.convert(model)
    assert type(model[0]) is DFPConv2d and type(model[2]) is DFPLinear
    assert type(model[4].lin) is nn.Linear  # inside a kept layer type: left alone
    # the parameters are the same FP32 objects: they are the masters the optimizer updates
    assert [p for p in model.parameters()] == before
    assert all(p.dtype == torch.float32 for p in model.parameters())
    opt = recipe.optimizer("sgd", model.parameters(), lr=0.1)
    assert opt.param_groups[0]["master"] == "none" and recipe.scaler is None
    # a bare layer is replaced, not converted in place: convert returns the new module
    layer = recipes.get("dfp16", dfp_rounding="stochastic").convert(nn.Linear(3, 2))
    assert type(layer) is DFPLinear and layer.rounding == "stochastic"
    with pytest.raises(ValueError, match="dfp_rounding applies to DFP recipes only"):
        recipes.get("bf16", dfp_rounding="nearest")
    with pytest.raises(ValueError, match="dfp_rounding must be one of"):
        recipes.get("dfp16", dfp_rounding="up")
    with pytest.raises(ValueError, match="needs a dfp_rounding; for no DFP layers use recipe"):
        recipes.get("dfp16", dfp_rounding=None)
    with pytest.raises(ValueError, match="DFP layers keep FP32 master weights"):
        recipes.Recipe("mine", torch.bfloat16, "none", dfp_rounding="nearest")


def test_dfp16_forward_and_gradients_are_close_to_fp32_but_not_equal():
    torch.manual_seed(0)
    ref = _Net()
    got = recipes.get("dfp16").convert(_Net())
    got.load_state_dict(ref.state_dict())
    x, y = _data(64)
    for m in (ref, got):
        (m(x) - y).pow(2).mean().backward()
    out_ref, out_got = ref(x), got(x)
    assert not torch.equal(out_ref, out_got)  # really quantized
    torch.testing.assert_close(out_got, out_ref, rtol=0, atol=2e-3)
    for a, b in zip(ref.parameters(), got.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=2e-3 * float(a.grad.abs().max()))


# ------------------------------------------------------------------ FP16 products on CPU


def _half(*shape, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).half().requires_grad_()


HALF_OPS = {
    "linear": (lambda a, b, c: nn.functional.linear(a, b, c), [(32, 24), (16, 24), (16,)]),
    "matmul": (lambda a, b: a @ b, [(3, 32, 24), (24, 8)]),
    "bmm": (lambda a, b: torch.bmm(a, b), [(3, 16, 24), (3, 24, 8)]),
    "conv2d": (lambda a, b: nn.functional.conv2d(a, b, padding=1), [(2, 3, 8, 8), (4, 3, 3, 3)]),
    "attention": (lambda q, k, v: nn.functional.scaled_dot_product_attention(q, k, v,
                                                                              is_causal=True),
                  [(2, 2, 8, 16), (2, 2, 8, 16), (2, 2, 8, 16)]),
}


@pytest.mark.parametrize("op", sorted(HALF_OPS))
def test_half_products_are_fp32_sums_rounded_once(op):
    fn, shapes = HALF_OPS[op]
    args = [_half(*s, seed=i) for i, s in enumerate(shapes)]
    with recipes.HalfProductsInFP32():
        out = fn(*args)
    out.float().square().sum().backward()
    # The reference: FP16 operands cast to FP32 (exact), FP32 arithmetic, one rounding to FP16.
    ref_args = [a.detach().float().requires_grad_() for a in args]
    ref = fn(*ref_args)
    ref.half().float().square().sum().backward()
    assert out.dtype == torch.float16 and torch.equal(out, ref.half())
    for a, r in zip(args, ref_args, strict=True):
        assert a.grad.dtype == torch.float16
        # Backward runs in FP32 through the recorded casts; the incoming gradient is the FP16
        # output's, so compare with a tolerance of FP16 rounding.
        torch.testing.assert_close(a.grad.float(), r.grad, rtol=2e-3, atol=1e-3)
    # And it is what PyTorch's own (slow) FP16 kernels give, up to the rounding of the sums.
    native = fn(*[a.detach() for a in args])
    torch.testing.assert_close(out.float(), native.float(), rtol=2e-3, atol=2e-3)


def test_half_products_leave_other_dtypes_alone():
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(8, 16, generator=gen), torch.randn(16, 4, generator=gen)
    with recipes.HalfProductsInFP32():
        bf = a.bfloat16() @ b.bfloat16()
        f32 = a @ b
    assert bf.dtype == torch.bfloat16 and torch.equal(bf, a.bfloat16() @ b.bfloat16())
    assert torch.equal(f32, a @ b)


def test_fp16_recipes_use_half_products_on_cpu_only():
    assert isinstance(recipes.get("fp16-master").autocast("cpu"), recipes.HalfProductsInFP32)
    assert not isinstance(recipes.get("fp16-master").autocast("cuda"),
                          recipes.HalfProductsInFP32)
    for name in ("fp32", "bf16", "bf16-split", "dfp16"):
        assert not isinstance(recipes.get(name).autocast("cpu"), recipes.HalfProductsInFP32)
    assert isinstance(recipes.get("amp-fp16").autocast("cpu"), torch.autocast)


def test_half_products_mode_around_a_compiled_model():
    # The FP16 recipes' forward context entered around a compiled model: Dynamo failed to build
    # its guards on the mode (NameError); now the compiled products go through FP32 as eager's do.
    torch.manual_seed(0)
    lin = nn.Linear(64, 32).half()
    x = torch.randn(8, 64).half()
    with recipes.HalfProductsInFP32():
        eager = lin(x)
        compiled = torch.compile(lin)(x)
    reference = torch.nn.functional.linear(x.float(), lin.weight.float(), lin.bias.float()).half()
    assert torch.equal(eager, reference)
    assert torch.equal(compiled, reference)
