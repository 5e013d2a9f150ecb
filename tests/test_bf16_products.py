"""BF16 products on a CPU without a fast BF16 matmul: computed in FP32 and rounded once to BF16
(``recipes.LowPrecisionProductsInFP32``), against an explicit reference (bit for bit), against
torch's own BF16 kernels and ``torch.autocast`` (to within the order of the sums), and the
automatic choice ``Recipe.autocast`` makes from ``recipes.cpu_has_fast_bf16_matmul``.

The shapes are small: torch's own BF16 kernels, the comparison, are slow on such a CPU.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lowprec import products, recipes
from lowprec.numerics import ulp

BF16 = torch.bfloat16
Mode = recipes.LowPrecisionProductsInFP32


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many BF16 ulps (at the larger magnitude) apart ``a`` and ``b`` are, elementwise."""
    a64, b64 = a.detach().double(), b.detach().double()
    return ((a64 - b64).abs() / ulp(torch.maximum(a64.abs(), b64.abs()), BF16)).flatten()


def _close_in_ulps(got: torch.Tensor, want: torch.Tensor, *, most: float, share: float,
                   worst: float) -> None:
    """At least ``share`` of the elements within ``most`` BF16 ulps (at their own magnitude), and
    none further apart than ``worst`` ulps at the tensor's largest magnitude (an element near
    zero, where the sums cancel, is many of its own ulps off for a difference in the last bit
    of the terms)."""
    d = _ulps(got, want)
    within = float((d <= most).double().mean())
    assert within >= share, f"{within:.3f} within {most} ulp, want >= {share}"
    top = float(ulp(want.detach().double().abs().max(), BF16))
    far = float((got.detach().double() - want.detach().double()).abs().max()) / top
    assert far <= worst, f"{far} ulps of the largest element apart at worst, want <= {worst}"


def _rand(*shape: int, seed: int, dtype: torch.dtype = BF16) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype).requires_grad_()


OPS = {
    "linear": (lambda a, b, c: F.linear(a, b, c), [(32, 24), (16, 24), (16,)]),
    "matmul": (lambda a, b: a @ b, [(3, 32, 24), (24, 8)]),
    "bmm": (lambda a, b: torch.bmm(a, b), [(3, 16, 24), (3, 24, 8)]),
    "addmm": (lambda c, a, b: torch.addmm(c, a, b), [(8,), (16, 24), (24, 8)]),
    "baddbmm": (lambda c, a, b: torch.baddbmm(c, a, b), [(3, 16, 8), (3, 16, 24), (3, 24, 8)]),
    "einsum": (lambda a, b: torch.einsum("bij,jk->bik", a, b), [(3, 16, 24), (24, 8)]),
    "conv1d": (lambda a, b: F.conv1d(a, b, padding=1), [(2, 3, 16), (4, 3, 3)]),
    "conv2d": (lambda a, b: F.conv2d(a, b, padding=1), [(2, 3, 8, 8), (4, 3, 3, 3)]),
    "attention": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                  [(2, 2, 8, 16), (2, 2, 8, 16), (2, 2, 8, 16)]),
}


@pytest.mark.parametrize("op", sorted(OPS))
def test_bf16_products_are_fp32_sums_rounded_once(op):
    fn, shapes = OPS[op]
    args = [_rand(*s, seed=i) for i, s in enumerate(shapes)]
    with Mode(BF16):
        out = fn(*args)
    out.float().square().sum().backward()
    # The reference: BF16 operands cast to FP32 (exact), FP32 arithmetic, one rounding to BF16;
    # its backward in FP32 from the same incoming gradient, each gradient rounded once to BF16.
    ref_args = [a.detach().float().requires_grad_() for a in args]
    ref = fn(*ref_args)
    ref.bfloat16().float().square().sum().backward()
    assert out.dtype == BF16 and torch.equal(out, ref.bfloat16())
    for a, r in zip(args, ref_args, strict=True):
        assert a.grad.dtype == BF16 and torch.equal(a.grad, r.grad.bfloat16())
    # torch's own (slow) BF16 kernels give the same up to the order of the sums: within one ulp
    # nearly everywhere (its attention also rounds the probabilities to BF16 before the second
    # product, which the mode, as FP32 attention, does not).
    native_args = [a.detach().requires_grad_() for a in args]
    native = fn(*native_args)
    native.float().square().sum().backward()
    worst = 8 if op == "attention" else 2
    _close_in_ulps(out, native, most=1, share=0.9, worst=worst)
    # (The gradients of attention and conv2d's input, summed in another order and through more
    # intermediate roundings by torch's BF16 backward kernels, differ in the last bit more often:
    # 85% within one ulp, measured.)
    share = 0.8 if op in ("attention", "conv2d") else 0.9
    for a, n in zip(args, native_args, strict=True):
        _close_in_ulps(a.grad, n.grad, most=1, share=share, worst=worst)


def test_the_ulp_check_fails_where_results_differ():
    a = torch.linspace(1, 2, 100).bfloat16()
    with pytest.raises(AssertionError, match="within 1 ulp"):
        _close_in_ulps(a, a * 1.02, most=1, share=0.9, worst=2)
    with pytest.raises(AssertionError, match="at worst"):
        _close_in_ulps(a, torch.cat([a[:99], a[99:] * 1.5]), most=1, share=0.9, worst=2)


class _Attention(nn.Module):
    """A small pre-norm attention block with an MLP: Linear, attention, GELU and LayerNorm."""

    def __init__(self, d: int = 32, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.ln = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln(x)).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(x)))


def _model_run(recipe_name: str, context, *, seed: int = 0):
    """The outputs, input gradient and weight gradients of ``_Attention`` converted by the
    recipe, forward in ``context(recipe)``."""
    torch.manual_seed(seed)
    recipe = recipes.get(recipe_name)
    model = recipe.convert(_Attention())
    x = torch.randn(2, 8, 32, requires_grad=True)
    with context(recipe):
        out = model(x)
    out.square().mean().backward()
    return out, x.grad, {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", ["bf16", "amp-bf16"])
def test_a_models_forward_and_backward_match_torchs_bf16(name, monkeypatch):
    """The BF16 recipes' forward context without a fast BF16 matmul (the mode) against the one
    with (torch's own BF16 kernels, or torch.autocast): outputs and gradients of the weights and
    the input agree to within the order of the sums, carried through the layers."""
    monkeypatch.setattr(products, "cpu_has_fast_bf16_matmul", lambda: False)
    emulated = _model_run(name, lambda r: r.autocast("cpu"))
    kind = recipes.LowPrecisionProductsInFP32
    assert isinstance(recipes.get(name).autocast("cpu"), kind)
    monkeypatch.setattr(products, "cpu_has_fast_bf16_matmul", lambda: True)
    assert not isinstance(recipes.get(name).autocast("cpu"), kind)
    native = _model_run(name, lambda r: r.autocast("cpu"))
    out, x_grad, grads = emulated
    assert out.dtype == torch.float32 and x_grad.dtype == torch.float32
    # (BF16 output rounded, carried through two residual blocks' worth of roundings. oneDNN's
    # BF16 kernels on an AVX-512 BF16 CPU sum in their own order: on a Zen 5, 94.7% of the
    # outputs were within 1 ulp of the emulation's and 96.7% within 2; on a Zen 3, without
    # those kernels, over 95% within 1.)
    _close_in_ulps(out, native[0], most=2, share=0.95, worst=4)
    _close_in_ulps(x_grad, native[1], most=1, share=0.8, worst=64)
    for n, g in grads.items():
        assert g.dtype == native[2][n].dtype
        scale = float(native[2][n].abs().max())
        torch.testing.assert_close(g.float(), native[2][n].float(), rtol=0,
                                   atol=0.02 * scale, msg=lambda m, n=n: f"{n}: {m}")


def test_autocasts_emulation_is_autocasts_casts_and_fp32_sums():
    """amp-bf16's mode on FP32 weights: each product's floating operands rounded to BF16 as
    autocast rounds them, summed in FP32, the result rounded to BF16; autocast's own everywhere
    else (what it leaves in FP32, and a region where it is disabled)."""
    torch.manual_seed(0)
    lin = nn.Linear(24, 16)
    x = torch.randn(8, 24, requires_grad=True)
    with Mode(BF16, autocast=True):
        out = lin(x)
        norm = F.layer_norm(out, (16,))
        soft = torch.softmax(out, -1)
        with torch.autocast("cpu", enabled=False):
            plain = lin(x)
    ref = F.linear(x.bfloat16().float(), lin.weight.bfloat16().float(),
                   lin.bias.bfloat16().float()).bfloat16()
    assert out.dtype == BF16 and torch.equal(out, ref)
    with torch.autocast("cpu", dtype=BF16):
        native = lin(x)
        assert F.layer_norm(native, (16,)).dtype == norm.dtype
        assert torch.softmax(native, -1).dtype == soft.dtype
    _close_in_ulps(out, native, most=1, share=0.95, worst=2)
    assert plain.dtype == torch.float32 and torch.equal(plain, F.linear(x, lin.weight, lin.bias))
    # The backward: FP32 products of the rounded operands' gradients, rounded to BF16 on the way
    # (autocast's backward does the same in BF16 kernels), cast to the FP32 leaves.
    out.float().square().sum().backward()
    x_ref = x.detach().clone().requires_grad_()
    w_ref = lin.weight.detach().clone().requires_grad_()
    b_ref = lin.bias.detach().clone().requires_grad_()
    r = F.linear(x_ref.bfloat16().float(), w_ref.bfloat16().float(), b_ref.bfloat16().float())
    r.bfloat16().float().square().sum().backward()
    assert torch.equal(x.grad, x_ref.grad) and torch.equal(lin.weight.grad, w_ref.grad)
    assert torch.equal(lin.bias.grad, b_ref.grad)


def test_the_mode_leaves_other_dtypes_and_fp64_alone():
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(8, 16, generator=gen), torch.randn(16, 4, generator=gen)
    with Mode(BF16):
        f32, f16 = a @ b, a.half() @ b.half()
    assert torch.equal(f32, a @ b) and torch.equal(f16, a.half() @ b.half())
    with Mode(BF16, autocast=True):
        f64 = a.double() @ b.double()
    assert f64.dtype == torch.float64 and torch.equal(f64, a.double() @ b.double())


def test_a_product_into_a_given_tensor_is_torchs():
    # (Inductor's compiled code calls extern kernels with out= while the mode is active: a
    # cast copy of ``out`` would leave the given tensor unwritten.)
    a, b = torch.randn(4, 8).bfloat16(), torch.randn(8, 2).bfloat16()
    out = torch.full((4, 2), float("nan"), dtype=BF16)
    with Mode(BF16):
        torch.mm(a, b, out=out)
    assert torch.equal(out, torch.mm(a, b))


@pytest.mark.parametrize("autocast", [False, True])
def test_a_compiled_model_under_the_mode_is_torchs_bf16(autocast):
    """Inductor drops a round trip through BF16 unless told to emulate it, so the compiled
    emulation would skip its own roundings: a compiled model's BF16 products are torch's, as
    they are without the mode."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 16))
    x = torch.randn(4, 32)
    if not autocast:
        model, x = model.bfloat16(), x.bfloat16()
    native_context = (torch.autocast("cpu", dtype=BF16) if autocast
                      else contextlib.nullcontext())
    torch._dynamo.reset()
    with native_context:
        native = torch.compile(model)(x)
    torch._dynamo.reset()
    with Mode(BF16, autocast=autocast):
        compiled = torch.compile(model)(x)
    assert compiled.dtype == BF16 and not compiled.isnan().any()
    assert torch.equal(compiled, native)


def test_bad_arguments_are_refused():
    with pytest.raises(TypeError, match=r"BF16 or FP16 products; got dtype=torch.float32"):
        Mode(torch.float32)
    with pytest.raises(TypeError, match="autocast must be a bool"):
        Mode(BF16, autocast="yes")
    assert recipes.HalfProductsInFP32().dtype == torch.float16


# ------------------------------------------------------------------ the automatic choice


@pytest.mark.parametrize("fast", [False, True])
def test_the_recipes_follow_the_detection(fast, monkeypatch):
    monkeypatch.delenv(recipes.BF16_PRODUCTS_ENV, raising=False)
    monkeypatch.setattr(products, "cpu_has_fast_bf16_matmul", lambda: fast)
    assert recipes.bf16_products_in_fp32() is not fast
    for name in ("bf16", "bf16-kahan", "bf16-split", "bf16-sr", "bf16-kahan-8bit",
                 "bf16-kahan-4bit-release"):
        context = recipes.get(name).autocast("cpu")
        assert isinstance(context, Mode) is not fast, name
        if not fast:
            assert context.dtype == BF16 and not context.autocast
        # A GPU has BF16 hardware; without a device the mode is entered (it acts on CPU
        # tensors only), so BF16 weights still need none.
        assert isinstance(recipes.get(name).autocast("cuda"), contextlib.nullcontext)
        assert isinstance(recipes.get(name).autocast(), Mode) is not fast
    amp = recipes.get("amp-bf16").autocast("cpu")
    if fast:
        assert type(amp) is torch.autocast
    else:
        assert isinstance(amp, Mode) and amp.autocast and amp.dtype == BF16
    # FP16 and FP32 are as they were, whatever BF16's kernels.
    assert type(recipes.get("fp16-master").autocast("cpu")) is recipes.HalfProductsInFP32
    assert type(recipes.get("amp-fp16").autocast("cpu")) is torch.autocast
    for name in ("fp32", "dfp16"):
        assert isinstance(recipes.get(name).autocast("cpu"), contextlib.nullcontext)


@pytest.mark.parametrize(("value", "in_fp32"), [("fp32", True), ("native", False),
                                                ("auto", None), ("", None), (" FP32 ", True)])
def test_the_environment_forces_either_way(value, in_fp32, monkeypatch):
    monkeypatch.setattr(products, "cpu_has_fast_bf16_matmul", lambda: True)
    monkeypatch.setenv(recipes.BF16_PRODUCTS_ENV, value)
    assert recipes.bf16_products_in_fp32() is (False if in_fp32 is None else in_fp32)
    assert isinstance(recipes.get("bf16").autocast("cpu"), Mode) is bool(in_fp32)


def test_a_bad_environment_value_says_what_to_use(monkeypatch):
    monkeypatch.setenv(recipes.BF16_PRODUCTS_ENV, "fast")
    with pytest.raises(ValueError, match=r"LOWPREC_BF16_PRODUCTS='fast'.*auto.*fp32.*native"):
        recipes.get("bf16").autocast("cpu")


def test_the_detection_is_oneDNNs_and_asked_once():
    recipes.cpu_has_fast_bf16_matmul.cache_clear()
    fast = recipes.cpu_has_fast_bf16_matmul()
    assert fast == bool(torch.backends.mkldnn.is_available()
                        and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert recipes.cpu_has_fast_bf16_matmul.cache_info().hits == 0
    recipes.cpu_has_fast_bf16_matmul()
    assert recipes.cpu_has_fast_bf16_matmul.cache_info().hits == 1
