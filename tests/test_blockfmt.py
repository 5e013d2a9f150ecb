"""Block formats (lowprec.blockfmt): the quantizer bit for bit against torchao's mx_formats and
against brute force, the element grids, stochastic rounding, blocks along any dimension and
tiles, and the errors."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from lowprec import blockfmt, recipes
from lowprec.blockfmt.quantizer import round_to_element

MX = ["mxfp8", "mxfp8-e5m2", "mxfp6", "mxfp6-e3m2", "mxfp4"]


def _torchao():
    logging.disable(logging.WARNING)  # (its CUDA kernels' libraries fail to load on a CPU)
    try:
        mx = pytest.importorskip(
            "torchao.prototype.mx_formats.mx_tensor", reason="torchao is in the dev extra")
    finally:
        logging.disable(logging.NOTSET)
    return mx


def _edge_cases(dtype=torch.float32) -> torch.Tensor:
    """Rows of 64 values (two MX blocks, four NVFP4 blocks): random magnitudes over 2**±20 and
    the spec's edge cases: zeros, FP32 subnormals, elements in the formats' subnormal ranges, a
    NaN, an Inf, an all-max block, ties, and a block whose largest element saturates."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(48, 64, generator=g) * torch.exp2(
        torch.randint(-20, 20, (48, 1), generator=g).float())
    x[0] = 0.0
    x[1, :32] = 1e-40  # FP32 subnormals
    x[1, 32:] = torch.linspace(-3e-39, 3e-39, 32)
    x[2, :32] = 448.0  # all-max (E4M3)
    x[2, 32:] = -6.0  # all-max (E2M1)
    x[3, 5] = float("nan")
    x[4, 40] = float("inf")
    x[5, :32] = torch.arange(32) * 0.25  # ties on the coarse grids
    x[6, :32] = 1.0
    x[6, 0] = 1.99  # floor's scale: 1.99 / 2**0 saturates E2M1's 6? no: the block's top
    x[7, :32] = 2.0**-8 * torch.arange(1, 33)  # tiny against the block max: subnormal elements
    x[8] = torch.randn(64, generator=g) * 1e-3
    x[8, 0] = 1e3  # one outlier per block: the rest fall into subnormals or to zero
    x[8, 32] = -1e3
    return x.to(dtype)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN where NaN."""
    return torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(
        torch.nan_to_num(a, nan=0.0), torch.nan_to_num(b, nan=0.0))


# ---------------------------------------------------------------- bit equality with torchao


@pytest.mark.parametrize("name", MX)
@pytest.mark.parametrize("rule", blockfmt.SCALE_RULES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mx_equals_torchao_bit_for_bit(name, rule, dtype):
    mx = _torchao()
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.constants import DTYPE_FP6_E2M3, DTYPE_FP6_E3M2

    elem = {"mxfp8": torch.float8_e4m3fn, "mxfp8-e5m2": torch.float8_e5m2,
            "mxfp6": DTYPE_FP6_E2M3, "mxfp6-e3m2": DTYPE_FP6_E3M2,
            "mxfp4": torch.float4_e2m1fn_x2}[name]
    x = _edge_cases(dtype)
    scale_e8m0, data = mx.to_mx(x, elem, 32, ScaleCalculationMode(rule))
    theirs = mx.to_dtype(data, scale_e8m0, elem, 32, torch.float32)
    q = blockfmt.quantize(x, name, scale_rule=rule)
    # The scales: E8M0 codes, compared as the values they stand for (NaN for code 255).
    assert _same(q.scales, mx.get_fp_scale(scale_e8m0).reshape(q.scales.shape))
    assert _same(q.dequantize(), theirs)
    assert _same(blockfmt.fake_quantize(x, name, scale_rule=rule), theirs)


@pytest.mark.parametrize("two_level", [False, True])
def test_nvfp4_equals_torchao_bit_for_bit(two_level):
    _torchao()
    from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, unpack_uint4
    from torchao.prototype.mx_formats.nvfp4_tensor import (
        nvfp4_quantize,
        per_tensor_amax_to_scale,
    )

    x = _edge_cases()
    x = x[torch.isfinite(x).all(1)]  # (torchao's NVFP4 quantizer assumes finite input)
    per_tensor = per_tensor_amax_to_scale(x.abs().amax()) if two_level else None
    scales, packed = nvfp4_quantize(x, 16, per_tensor)
    elements = f4_unpacked_to_f32(unpack_uint4(packed)).reshape(x.shape)
    q = blockfmt.quantize(x, "nvfp4", tensor_scale=two_level)
    assert torch.equal(q.elements, elements)
    assert torch.equal(q.scales, scales.float())
    if two_level:
        assert torch.equal(q.tensor_scale, per_tensor)
        hp = per_tensor * scales.float()
    else:
        assert q.tensor_scale is None
        hp = scales.float()
    theirs = (elements.reshape(len(x), -1, 16) * hp.unsqueeze(-1)).reshape(x.shape)
    assert torch.equal(q.dequantize(), theirs)


def test_element_rounding_equals_torchs_fp8_casts():
    # An independent check of the one element rule: torch's own FP8 casts (nearest, ties to
    # even) on values spread over both formats' ranges, subnormals included, saturated.
    g = torch.Generator().manual_seed(1)
    x = torch.randn(200_000, generator=g) * torch.exp2(
        torch.randint(-24, 18, (200_000,), generator=g).float())
    for name, dtype in (("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)):
        element = blockfmt.ELEMENTS[name]
        theirs = x.clamp(-element.max, element.max).to(dtype).float()
        assert torch.equal(round_to_element(x, element), theirs), name


def _grid(name: str) -> torch.Tensor:
    """Every non-negative value of an element format, from its bit fields."""
    e = blockfmt.ELEMENTS[name]
    if e.integer:
        return torch.arange(128) / 64
    ebits = {"e4m3": 4, "e5m2": 5, "e2m3": 2, "e3m2": 3, "e2m1": 2}[name]
    bias = 1 - e.emin
    values = []
    for field in range(2**ebits):
        for m in range(2**e.mbits):
            if field == 0:
                v = m / 2**e.mbits * 2.0**e.emin
            else:
                v = (1 + m / 2**e.mbits) * 2.0 ** (field - bias)
            if v <= e.max:
                values.append(v)
    return torch.tensor(sorted(set(values)))


@pytest.mark.parametrize("name", list(blockfmt.ELEMENTS))
def test_every_element_value_is_kept_and_midpoints_round_to_even(name):
    element = blockfmt.ELEMENTS[name]
    grid = _grid(name)
    expected = {"e4m3": 127, "e5m2": 124, "e2m3": 32, "e3m2": 32, "e2m1": 8, "int8": 128}
    assert len(grid) == expected[name]
    assert torch.equal(round_to_element(grid, element), grid)
    assert torch.equal(round_to_element(-grid, element), -grid)
    mid = (grid[:-1] + grid[1:]) / 2
    got = round_to_element(mid, element)
    steps = torch.searchsorted(grid, got)
    low = torch.arange(len(mid))
    assert torch.equal(torch.where(got == grid[low], low, low + 1), steps)
    # Ties go to the neighbour whose last mantissa bit (its index's parity) is 0.
    assert bool((steps % 2 == 0).all())
    assert round_to_element(torch.tensor([1e30]), element).item() == element.max


def test_mxint8_equals_brute_force_integers():
    x = _edge_cases()
    x = x[torch.isfinite(x).all(1)].double()
    q = blockfmt.quantize(x, "mxint8")
    blocks = x.reshape(len(x), -1, 32)
    for r in range(blocks.shape[0]):
        for c in range(blocks.shape[1]):
            block = blocks[r, c].tolist()
            amax = max(abs(v) for v in block)
            exponent = -127 if amax == 0 else max(int(torch.tensor(amax).log2().floor()), -127)
            scale = 2.0**exponent
            assert q.scales[r, c].item() == scale
            for i, v in enumerate(block):
                k = max(-127, min(127, round(v / max(scale, 2.0**-126) * 64)))  # half to even
                assert q.elements[r, c * 32 + i].item() == k / 64


# ---------------------------------------------------------------- stochastic rounding


@pytest.mark.parametrize("name", ["mxfp8", "mxfp4", "nvfp4", "mxint8"])
def test_stochastic_rounding_is_unbiased_and_picks_a_neighbour(name):
    fmt = blockfmt.get_format(name)
    x = torch.randn(1, fmt.block, generator=torch.Generator().manual_seed(2))
    x[0, 0] = 4.0  # fixes the block's scale at a power of two for every draw
    nearest = blockfmt.quantize(x, name)
    g = torch.Generator().manual_seed(3)
    draws = torch.stack([
        blockfmt.quantize(x, name, rounding="stochastic", generator=g).elements[0]
        for _ in range(4000)
    ])
    scaled = x[0] / (nearest.scales if nearest.tensor_scale is None else
                     nearest.tensor_scale * nearest.scales).repeat_interleave(fmt.block)
    grid = torch.cat([-_grid(fmt.element.name).flip(0), _grid(fmt.element.name)])
    low = grid[torch.searchsorted(grid, scaled, right=True) - 1]
    high = grid[torch.searchsorted(grid, scaled)]
    assert bool(((draws == low) | (draws == high)).all())
    spread = (high - low).clamp(min=1e-30)
    # The mean of 4,000 draws is within 5 standard errors of the value (and biased nearest
    # rounding is not, on some element).
    tolerance = 5 * spread / 2 / 4000**0.5
    assert bool(((draws.mean(0) - scaled).abs() <= tolerance + 1e-7).all())
    assert bool(((nearest.elements[0] - scaled).abs() > tolerance + 1e-7).any())
    g1, g2 = torch.Generator().manual_seed(4), torch.Generator().manual_seed(4)
    assert torch.equal(blockfmt.quantize(x, name, rounding="stochastic", generator=g1).elements,
                       blockfmt.quantize(x, name, rounding="stochastic", generator=g2).elements)


# ---------------------------------------------------------------- dimensions, padding, tiles


@pytest.mark.parametrize("name", ["mxfp8", "nvfp4"])
def test_blocks_run_along_the_dimension_given(name):
    x = torch.randn(3, 64, 96, generator=torch.Generator().manual_seed(5))
    for dim in (0, 1, 2, -1):
        q = blockfmt.quantize(x, name, dim=dim)
        moved = blockfmt.quantize(x.movedim(dim, -1).contiguous(), name)
        assert torch.equal(q.elements, moved.elements.movedim(-1, dim))
        assert torch.equal(q.scales, moved.scales.movedim(-1, dim))
        assert torch.equal(q.dequantize(), blockfmt.fake_quantize(x, name, dim=dim))


def test_a_length_off_the_block_is_padded_with_zeros():
    x = torch.randn(5, 70, generator=torch.Generator().manual_seed(6))
    q = blockfmt.quantize(x, "mxfp8")
    padded = blockfmt.quantize(torch.nn.functional.pad(x, [0, 26]), "mxfp8")
    assert q.elements.shape == x.shape and q.scales.shape == (5, 3)
    assert torch.equal(q.elements, padded.elements[:, :70])
    assert torch.equal(q.scales, padded.scales)


def test_tiles_quantize_a_matrix_and_its_transpose_alike():
    w = torch.randn(40, 72, generator=torch.Generator().manual_seed(7))
    q = blockfmt.quantize(w, "nvfp4", tile=True)
    assert q.scales.shape == (3, 5)
    assert torch.equal(blockfmt.fake_quantize(w.t(), "nvfp4", tile=True),
                       blockfmt.fake_quantize(w, "nvfp4", tile=True).t())
    # Each 16 x 16 tile is one block of 256 under the same tensor scale (brute force).
    big = dataclasses.replace(blockfmt.get_format("nvfp4"), block=256)
    wp = torch.nn.functional.pad(w, [0, 8, 0, 8])
    tiles = wp.reshape(3, 16, 5, 16).transpose(1, 2).reshape(15, 256)
    ref = blockfmt.quantize(tiles, big)
    assert torch.equal(q.tensor_scale, ref.tensor_scale)
    assert torch.equal(q.scales, ref.scales.reshape(3, 5))
    ref_elements = ref.elements.reshape(3, 5, 16, 16).transpose(1, 2).reshape(48, 80)
    assert torch.equal(q.elements, ref_elements[:40, :72])


def test_the_quantizer_compiles_to_the_same_bits():
    x = _edge_cases()
    compiled = torch.compile(blockfmt.fake_quantize, dynamic=False)
    for name, rule in (("mxfp8", "floor"), ("mxfp4", "rceil"), ("nvfp4", "floor")):
        assert _same(compiled(x, name, scale_rule=rule), blockfmt.fake_quantize(x, name,
                                                                            scale_rule=rule))


@pytest.mark.parametrize("name", [*MX, "mxint8"])
def test_bf16_holds_every_value_of_a_format_without_a_tensor_scale(name):
    """The compiled quantizer's BF16 output (what BlockLinear multiplies in BF16) is its FP32
    output exactly, for every MX format, along either dimension: elements of at most 8
    significant bits under a power-of-two scale. Only values below BF16's smallest subnormal
    (2**-133) could round: the row of FP32 subnormals is left out."""
    from lowprec.blockfmt.quantizer import fast_fake_quantize

    x = _edge_cases()
    x = x[torch.arange(len(x)) != 1]
    fmt = blockfmt.get_format(name)
    for dim in (0, 1):
        want = blockfmt.fake_quantize(x, fmt, dim=dim)
        # (compiled once: the kernel's cast is the eager one's; each variant costs ~10 s)
        compiled = name == "mxfp8" and dim == 1
        got = fast_fake_quantize(x, fmt, dim=dim, dtype=torch.bfloat16, compiled=compiled)
        assert got.dtype == torch.bfloat16
        assert _same(got.float(), want), (name, dim)


def test_one_compiled_kernel_serves_every_shape_of_a_variant():
    """A variant compiles once, its tensors' sizes dynamic from the first call, whatever the
    layer (the settings are constants of the kernel: a recompile per shape would cost each
    layer ~10 s). (A width of a single block, a guard on the layout, compiles its own.)"""
    from torch._dynamo.utils import counters

    from lowprec.blockfmt.quantizer import fast_fake_quantize

    fmt = blockfmt.get_format("mxfp4")
    before = counters["stats"]["unique_graphs"]
    for shape in ((64, 96), (40, 160), (7, 3, 160)):
        x = torch.randn(*shape)
        got = fast_fake_quantize(x, fmt, dim=-1, scale_rule="even")
        assert _same(got, blockfmt.fake_quantize(x, fmt, dim=-1, scale_rule="even"))
    assert counters["stats"]["unique_graphs"] - before == 2  # (2-D, then 3-D)


# ---------------------------------------------------------------- errors


def test_bad_input_gets_a_clear_error():
    x = torch.randn(4, 32)
    with pytest.raises(ValueError, match=r"unknown block format 'mxfp9'.*mxfp8"):
        blockfmt.quantize(x, "mxfp9")
    with pytest.raises(TypeError, match=r"floating-point.*torch.int64.*x.float\(\)"):
        blockfmt.quantize(torch.arange(32), "mxfp8")
    with pytest.raises(ValueError, match="rounding must be one of"):
        blockfmt.quantize(x, "mxfp8", rounding="up")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="scale_rule must be one of"):
        blockfmt.fake_quantize(x, "mxfp8", scale_rule="round")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"tiles of a matrix.*tile=False"):
        blockfmt.quantize(torch.randn(32), "nvfp4", tile=True)
    with pytest.raises(ValueError, match="unknown block format"):
        blockfmt.BlockGemms("fp8")


# ---------------------------------------------------------------- BlockLinear


def _reference(x, w, b, gy, gemms):
    """The three GEMMs written out: each operand quantized along its GEMM's reduction
    dimension, multiplied in FP32."""
    fq = blockfmt.fake_quantize
    fmt, rule, tile = gemms.fmt, gemms.scale_rule, gemms.weight_tiles
    y = fq(x, fmt, dim=1, scale_rule=rule) @ fq(w, fmt, dim=1, scale_rule=rule, tile=tile).t()
    gx = fq(gy, fmt, dim=1, scale_rule=rule) @ fq(w, fmt, dim=0, scale_rule=rule, tile=tile)
    gw = fq(gy, fmt, dim=0, scale_rule=rule).t() @ fq(x, fmt, dim=0, scale_rule=rule)
    return y + b, gx, gw, gy.sum(0)


@pytest.mark.parametrize(("gemms", "compiled"), [
    (blockfmt.BlockGemms("mxfp8", scale_rule="rceil"), False),
    (blockfmt.BlockGemms("mxfp4"), False),
    (blockfmt.BlockGemms("nvfp4", weight_tiles=True), False),
    # (compiling costs ~10 s a variant: one case shows the compiled kernels in the layer)
    (blockfmt.BlockGemms("nvfp4", weight_tiles=True), True),
], ids=["mxfp8", "mxfp4", "nvfp4-2d", "nvfp4-2d-compiled"])
def test_block_linear_quantizes_each_gemm_along_its_reduction_dimension(gemms, compiled):
    g = torch.Generator().manual_seed(8)
    lin = torch.nn.Linear(64, 48)
    x = torch.randn(2, 40, 64, generator=g, requires_grad=True)
    gy = torch.randn(2, 40, 48, generator=g)
    layer = blockfmt.BlockLinear.from_linear(lin, dataclasses.replace(gemms, compiled=compiled))
    y = layer(x)
    y.backward(gy)
    ref_y, ref_gx, ref_gw, ref_gb = _reference(
        x.detach().reshape(80, 64), lin.weight.detach(), lin.bias.detach(), gy.reshape(80, 48),
        gemms)
    # (the same quantized values; F.linear and @ may sum in another order)
    torch.testing.assert_close(y.detach().reshape(80, 48), ref_y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.reshape(80, 64), ref_gx, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lin.weight.grad, ref_gw, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lin.bias.grad, ref_gb)
    # The wrong dimension for the weight gradient's operands is measurably different.
    fq = blockfmt.fake_quantize
    wrong = fq(gy.reshape(80, 48), gemms.fmt, dim=1).t() @ fq(x.detach().reshape(80, 64),
                                                            gemms.fmt, dim=1)
    assert not torch.allclose(wrong, ref_gw, rtol=1e-5, atol=1e-5)


def test_bf16_gemms_where_the_cpu_multiplies_bf16_fast(monkeypatch):
    """A BF16 layer's MX GEMMs multiply the quantized values in BF16 where the CPU has a fast
    BF16 matmul (oneDNN: exact products summed in FP32, rounded once), with the results of
    the FP32 GEMMs rounded to BF16; NVFP4 (a tensor scale BF16 cannot hold), FP32 layers and
    CPUs without the kernels multiply in FP32."""
    from lowprec import products
    from lowprec.blockfmt.linear import _gemm_dtype

    mx, nv = blockfmt.get_format("mxfp8"), blockfmt.get_format("nvfp4")
    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    monkeypatch.delenv(products.BF16_PRODUCTS_ENV, raising=False)
    for fast in (True, False):
        monkeypatch.setattr(products, "cpu_has_fast_bf16_matmul", lambda fast=fast: fast)
        assert _gemm_dtype(mx, bf16, cpu) == (bf16 if fast else torch.float32)
        assert _gemm_dtype(nv, bf16, cpu) == torch.float32
        assert _gemm_dtype(mx, torch.float32, cpu) == torch.float32
    assert _gemm_dtype(mx, bf16, torch.device("meta")) == torch.float32

    g = torch.Generator().manual_seed(3)
    lin = torch.nn.Linear(96, 64).bfloat16()
    x = torch.randn(3, 40, 96, generator=g).bfloat16()
    gy = torch.randn(3, 40, 64, generator=g).bfloat16()
    runs = {}
    for fast in (True, False):
        monkeypatch.setattr(products, "cpu_has_fast_bf16_matmul", lambda fast=fast: fast)
        gemms = blockfmt.BlockGemms("mxfp8", compiled=False)
        layer = blockfmt.BlockLinear.from_linear(lin, gemms)
        xi = x.clone().requires_grad_()
        lin.zero_grad()
        y = layer(xi)
        y.backward(gy)
        runs[fast] = [t.detach().clone() for t in (y, xi.grad, lin.weight.grad, lin.bias.grad)]
    for got, want in zip(runs[True], runs[False], strict=True):
        assert got.dtype == want.dtype == torch.bfloat16
        # (the same products, summed in FP32 in another order: at most one rounding apart)
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-8, atol=1e-6)


def test_block_linear_keeps_no_quantized_operand_for_backward():
    lin = torch.nn.Linear(64, 32)
    layer = blockfmt.BlockLinear.from_linear(lin, blockfmt.BlockGemms("mxfp8", compiled=False))
    x = torch.randn(16, 64, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = layer(x)
    assert len(saved) == 2  # the input and the weight themselves: what nn.Linear saves
    assert saved[0] is x and saved[1] is lin.weight
    y.sum().backward()


def test_the_hadamard_transform_cancels_in_the_weight_gradient():
    from lowprec.blockfmt.linear import _rotate_tokens

    g = torch.Generator().manual_seed(9)
    signs = torch.randint(0, 2, (16,), generator=g).float() * 2 - 1
    h = blockfmt.hadamard_matrix(16, signs)
    torch.testing.assert_close(h @ h.t(), torch.eye(16))
    a, b = torch.randn(70, 8, generator=g), torch.randn(70, 12, generator=g)  # 70: padded
    torch.testing.assert_close(_rotate_tokens(a, h).t() @ _rotate_tokens(b, h), a.t() @ b,
                               rtol=1e-5, atol=1e-5)
    # An outlier token is spread over its 16: the block's largest magnitude falls by 4x.
    spike = torch.zeros(16, 1)
    spike[3] = 8.0
    assert _rotate_tokens(spike, h).abs().max().item() == pytest.approx(2.0)
    with pytest.raises(ValueError, match="power-of-two"):
        blockfmt.hadamard_matrix(12)


def test_nvfp4_recipe_layers_stochastic_gradients_and_hadamard_stay_close():
    torch.manual_seed(10)
    lin = torch.nn.Linear(64, 64)
    x = torch.randn(64, 64, requires_grad=True)
    full = blockfmt.BlockGemms("nvfp4", weight_tiles=True, grad_rounding="stochastic",
                               hadamard=True, compiled=False)
    layer = blockfmt.BlockLinear.from_linear(lin, full)
    assert layer.hadamard_signs is not None and layer.hadamard_signs.abs().eq(1).all()
    layer(x).square().sum().backward()
    exact = 2 * (x.detach() @ lin.weight.detach().t() + lin.bias.detach())
    exact_gw = exact.t() @ x.detach()
    rel = (lin.weight.grad - exact_gw).norm() / exact_gw.norm()
    assert 0 < rel.item() < 0.3  # FP4's error, not a wrong product


def test_convert_to_blocks_shares_parameters_and_skips_what_it_is_told():
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(),
                                torch.nn.Sequential(torch.nn.Linear(32, 32)),
                                torch.nn.Linear(32, 8))
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert blockfmt.edge_linears(model) == ("0", "3")
    blockfmt.convert_to_blocks(model, blockfmt.BlockGemms("mxfp6"), skip=["3"])
    assert type(model[0]) is blockfmt.BlockLinear and type(model[2][0]) is blockfmt.BlockLinear
    assert type(model[3]) is torch.nn.Linear
    assert [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)] == weights
    with pytest.raises(ValueError, match=r"skip names \['nope'\] match no module"):
        blockfmt.convert_to_blocks(model, blockfmt.BlockGemms("mxfp6"), skip=["nope"])
    single = blockfmt.convert_to_blocks(torch.nn.Linear(4, 4), blockfmt.BlockGemms("mxfp8"))
    assert type(single) is blockfmt.BlockLinear
    with pytest.raises(TypeError, match="floating-point input"):
        single(torch.ones(2, 4, dtype=torch.long))


def test_block_recipes_convert_and_train_near_fp32():
    def run(name):
        torch.manual_seed(11)
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(),
                                    torch.nn.LayerNorm(128), torch.nn.Linear(128, 64),
                                    torch.nn.GELU(), torch.nn.Linear(64, 10))
        recipe = recipes.get(name)
        if recipe.gemms is not None:  # (eager: compiling is tested above)
            recipe.gemms = dataclasses.replace(recipe.gemms, compiled=False)
        model = recipe.convert(model)
        opt = recipe.optimizer("adamw", model.parameters(), lr=1e-3, fused=False)
        g = torch.Generator().manual_seed(12)
        x = torch.randn(256, 64, generator=g)
        y = (x[:, :10] * 3).argmax(1)
        for _ in range(25):
            opt.zero_grad()
            with recipe.autocast():
                loss = torch.nn.functional.cross_entropy(model(x), y)
            recipe.backward(loss)
            recipe.step(opt)
        return model, loss.item()

    model, fp32 = run("fp32")
    model, mxfp8 = run("mxfp8")
    kinds = [type(m).__name__ for m in model.modules()]
    assert kinds.count("BlockLinear") == 3 and model[0].weight.dtype == torch.bfloat16
    model, nvfp4 = run("nvfp4")
    assert [type(model[i]) for i in (0, 3, 5)] == [torch.nn.Linear, blockfmt.BlockLinear,
                                                   torch.nn.Linear]  # the edges kept in BF16
    assert 0.1 < fp32 < 1.5  # (it learned, and is still learning: it started at ln 10 = 2.3)
    # (measured: +0.009 and +0.023 on 1.20)
    assert abs(mxfp8 - fp32) < 0.02 and abs(nvfp4 - fp32) < 0.06


@pytest.mark.parametrize("name", [n for n in recipes.RECIPES if recipes.get(n).gemms])
def test_every_block_recipe_converts_and_steps(name):
    recipe = recipes.get(name)
    recipe.gemms = dataclasses.replace(recipe.gemms, compiled=False)
    torch.manual_seed(13)
    model = recipe.convert(torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.LayerNorm(64), torch.nn.Linear(64, 64),
        torch.nn.Linear(64, 8)))
    blocks = [type(m) is blockfmt.BlockLinear for m in model]
    edges = recipe.gemms_skip_edges
    assert blocks == [not edges, False, True, not edges]
    assert all(p.dtype == torch.bfloat16 for p in model[2].parameters())
    opt = recipe.optimizer("adamw", model.parameters(), lr=1e-3, fused=False)
    before = model[2].weight.detach().clone()
    for _ in range(2):
        with recipe.autocast():
            loss = model(torch.randn(48, 32)).square().mean()
        recipe.backward(loss)
        recipe.step(opt)
        opt.zero_grad()
    assert torch.isfinite(loss) and not torch.equal(model[2].weight, before)
    assert opt.param_groups[0]["master"] == recipe.master
