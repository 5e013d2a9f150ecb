"""FP32 weights kept through a cast (``lowprec.optim.kept``): the master of a model cast from FP32
starts from the FP32 values, not from the rounded weights.

References: the FP32 model's own tensors, and for Kahan, whose compensation is itself BF16, the
bound of that compensation's rounding. The steps run eager (``fused=False``): what is checked is
the state the optimizer creates, which the compiled and eager steps share.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import lowprec
from lowprec import numerics
from lowprec.optim import kept

OPTIMIZERS = ["SGD", "Adagrad", "Adam", "AdamW", "RAdam", "Lion", "Lamb", "StableAdamW",
              "Adafactor", "Muon"]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(24, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 3))


def _optimizer(name: str, model: nn.Module, master: str, lr: float = 0.0):
    cls = getattr(lowprec, name)
    if name == "Muon":
        groups = lowprec.muon_param_groups(model, adamw={"lr": lr})
        return cls(groups, lr=lr, master=master, fused=False)
    return cls(model.parameters(), lr=lr, master=master, fused=False)


def _step(model: nn.Module, opt) -> None:
    opt.zero_grad()
    model(torch.randn(4, 24, dtype=torch.bfloat16)).float().square().mean().backward()
    opt.step()


def _masters(model: nn.Module, opt) -> dict[str, torch.Tensor]:
    return {n: opt.master_weight(p) for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("master", ["split", "fp32"])
def test_exact_masters_start_as_the_fp32_values(name, master):
    # A model cast from FP32: master_weight is the FP32 value bit for bit before the first step
    # and after a step at learning rate 0, and the kept values are gone after that step.
    model = _model()
    fp32 = {n: p.detach().clone() for n, p in model.named_parameters()}
    model = lowprec.recipes.get("bf16-split").convert(model)
    assert model[0].weight.dtype == torch.bfloat16  # (the norm layer stays FP32)
    opt = _optimizer(name, model, master)
    for when in ("before", "after"):
        got = _masters(model, opt)
        for n, value in fp32.items():
            assert torch.equal(got[n], value), f"{name}, {master}, {when} the first step: {n}"
        if when == "before":
            _step(model, opt)
    assert not any(hasattr(p, kept._ATTR) for p in model.parameters())


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_kahan_compensation_starts_as_the_rounding_residual(name):
    model = _model()
    fp32 = {n: p.detach().clone() for n, p in model.named_parameters()}
    model = lowprec.recipes.get("bf16-kahan").convert(model)
    opt = _optimizer(name, model, "kahan")
    _step(model, opt)
    for n, p in model.named_parameters():
        if p.dtype == torch.float32:  # (the norm layer, kept FP32 by the recipe)
            continue
        comp = opt.state[p]["compensation"]
        residual = fp32[n] - p.float()  # (exact in FP32)
        assert residual.abs().max() > 0  # (the cast rounded something)
        # the BF16 weight plus its compensation is the FP32 value to within the compensation's
        # own rounding: half an ulp of a BF16 number of the residual's size
        err = (p.float() + comp.float() - fp32[n]).abs()
        assert bool((err <= residual.abs() * 2.0 ** -8).all()), n
        assert torch.equal(comp, residual.to(torch.bfloat16)), n


@pytest.mark.parametrize("master", ["none", "stochastic"])
def test_plain_and_stochastic_start_from_the_rounded_weights_and_keep_nothing(master):
    model = lowprec.recipes.get("bf16").convert(_model())
    assert all(hasattr(p, kept._ATTR) for p in model.parameters() if p.dtype == torch.bfloat16)
    opt = lowprec.AdamW(model.parameters(), lr=0.0, master=master, fused=False)
    assert not any(hasattr(p, kept._ATTR) for p in model.parameters())  # (let go at once)
    for p in model.parameters():
        assert torch.equal(opt.master_weight(p), p.float())


def test_split_at_an_exact_tie_writes_the_top_half():
    # A value exactly halfway between two BF16 numbers: the cast rounds it to even, split's top
    # half away from zero; the split master holds the value exactly, its top in the parameter.
    lin = nn.Linear(2, 2, bias=False)
    ties = torch.tensor([[1.0 + 2.0 ** -8, -(1.0 + 3 * 2.0 ** -8)], [1.5, 0.1]])
    with torch.no_grad():
        lin.weight.copy_(ties)
    model = lowprec.recipes.get("bf16-split").convert(lin)
    cast = ties.to(torch.bfloat16)
    assert torch.equal(model.weight.detach(), cast)
    opt = lowprec.SGD(model.parameters(), lr=0.0, master="split", fused=False)
    assert torch.equal(opt.master_weight(model.weight), ties)
    _step_2 = model(torch.ones(1, 2, dtype=torch.bfloat16)).float().sum()
    _step_2.backward()
    opt.step()
    top, trail = numerics.split(ties)
    assert torch.equal(model.weight.detach(), top)
    assert torch.equal(opt.state[model.weight]["trail"], trail)
    assert torch.equal(opt.master_weight(model.weight), ties)


def test_keep_fp32_values_before_the_users_own_cast():
    model = _model()
    fp32 = {n: p.detach().clone() for n, p in model.named_parameters()}
    model = lowprec.keep_fp32_values(model).to(torch.bfloat16)
    opt = lowprec.AdamW(model.parameters(), lr=0.0, master="split", fused=False)
    exported = lowprec.master_state_dict(model, opt)
    for n, value in fp32.items():
        assert torch.equal(opt.master_weight(dict(model.named_parameters())[n]), value)
        assert torch.equal(exported[n], value)


def test_a_parameter_written_after_its_cast_keeps_no_value():
    # Weights loaded after the cast (a BF16 checkpoint): the kept values are another model's.
    model = lowprec.recipes.get("bf16-split").convert(_model())
    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    model.load_state_dict(other.state_dict())
    opt = lowprec.AdamW(model.parameters(), lr=0.0, master="split", fused=False)
    for p in model.parameters():
        assert torch.equal(opt.master_weight(p), p.float())
    _step(model, opt)
    for p in model.parameters():
        if p.dtype == torch.bfloat16:
            assert not bool(opt.state[p]["trail"].any())


def test_without_fp32_values_the_master_starts_from_the_rounded_weights():
    model = lowprec.recipes.get("bf16-split").convert(_model(), fp32_values=False)
    assert not any(hasattr(p, kept._ATTR) for p in model.parameters())
    opt = lowprec.AdamW(model.parameters(), lr=0.0, master="split", fused=False)
    for p in model.parameters():
        assert torch.equal(opt.master_weight(p), p.float())


def test_frozen_and_fp32_parameters_keep_nothing():
    model = _model()
    model[0].weight.requires_grad_(False)
    recipe = lowprec.recipes.get("bf16-split")
    model = recipe.convert(model)
    assert not hasattr(model[0].weight, kept._ATTR)
    assert hasattr(model[3].weight, kept._ATTR)
    # the norm layer stays FP32 (the recipe's keep_fp32): nothing to keep for it
    assert model[2].weight.dtype == torch.float32 and not hasattr(model[2].weight, kept._ATTR)


def test_keep_fp32_values_takes_a_module():
    with pytest.raises(TypeError, match=r"nn\.Module"):
        lowprec.keep_fp32_values([torch.zeros(2)])  # type: ignore[arg-type]


@pytest.mark.parametrize("master", ["split", "kahan"])
def test_a_monitored_first_step_leaves_the_value_to_the_step(master):
    # UpdateMonitor previews the state a first step creates: it must neither take the kept
    # value nor write the parameter (lowprec compare monitors the first step).
    model = _model()
    fp32 = {n: p.detach().clone() for n, p in model.named_parameters()}
    model = lowprec.recipes.get(f"bf16-{master}").convert(model)
    opt = lowprec.AdamW(model.parameters(), lr=0.0, master=master, fused=False)
    monitor = lowprec.diagnostics.UpdateMonitor(model, opt, every=1)
    with monitor.step():
        _step(model, opt)
    monitor.close()
    for n, p in model.named_parameters():
        if p.dtype == torch.float32:
            continue
        if master == "split":
            assert torch.equal(opt.master_weight(p), fp32[n]), n
        else:
            assert torch.equal(opt.state[p]["compensation"],
                               (fp32[n] - p.float()).to(torch.bfloat16)), n


def test_keep_fp32_takes_module_names_as_well_as_types():
    # Where lowprec.compare names parameters no master keeps, a recipe keeps them in FP32 by name.
    recipe = lowprec.recipes.get("bf16-split", keep_fp32=(nn.LayerNorm, "3"))
    model = recipe.convert(_model())
    assert model[0].weight.dtype == torch.bfloat16
    assert model[2].weight.dtype == torch.float32 and model[3].weight.dtype == torch.float32
    nested = nn.Sequential(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))
    lowprec.recipes.get("bf16", keep_fp32=("1",)).convert(nested)  # (a trailing part: "0.1")
    assert nested[0][0].weight.dtype == torch.bfloat16
    assert nested[0][1].weight.dtype == torch.float32
    with pytest.raises(TypeError, match="keep_fp32 takes module types and module names"):
        lowprec.recipes.get("bf16", keep_fp32=(3,))
