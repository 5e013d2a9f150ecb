"""The torch versions lowprec claims: what an older torch lacks is found, said once, and done
without (the fused step's Inductor options, the 1-bit hook's recompile budget), and the floor in
pyproject.toml is the one CI tests (``.ci/run``'s second venv) and the warning names.

The floor CI runs these too (``-m floor``), so they check the floor torch itself as well.
"""

from __future__ import annotations

import contextlib
import re
import types
import warnings
from pathlib import Path

import pytest
import torch
from torch.torch_version import TorchVersion

from lowprec.distributed import kernels
from lowprec.numerics import COMPILED_AS_EAGER, INDUCTOR_OPTIONS
from lowprec.optim import SGD, AdamW, compiled, core
from lowprec.optim.storage import STORAGES
from tests._fallback import FALLBACK_WARNING
from tests._same import assert_same
from tests.test_fused_default import _run as run_kahan

pytestmark = pytest.mark.floor

ROOT = Path(__file__).resolve().parent.parent
SHAPES = [(300, 256), (64,), (7,)]


def _run(fused, steps=3):
    return run_kahan(AdamW, fused, steps)


@pytest.fixture
def fresh_compiler():
    """``compiled._compiler`` asked afresh in this test and after it (it caches its answer)."""
    compiled._compiler.cache_clear()
    yield
    compiled._compiler.cache_clear()


def test_the_listed_options_are_those_the_kernels_are_compiled_with(monkeypatch):
    seen = []

    def compile_spy(fn, **kwargs):
        seen.append(kwargs.get("options") or {})
        return fn

    monkeypatch.setattr(torch, "compile", compile_spy)
    monkeypatch.setattr(compiled, "_KERNELS", {})
    monkeypatch.setattr(kernels, "_COMPILED", {})
    opt = SGD([torch.zeros(2, requires_grad=True)], lr=0.1, momentum=0.9)
    for name in ("kahan", "stochastic"):
        compiled._compiled_kernel(opt.rule(opt.param_groups[0]), STORAGES[name], {"momentum": True})
    kernels.compiled("encode", 1, "range", torch.float32)
    step, random_bits, hook = seen
    # (random bits: Inductor's accelerator threshold for storing what a kernel reads twice)
    assert random_bits == {**step, "realize_opcount_threshold": 30}
    assert set(random_bits) == set(INDUCTOR_OPTIONS)
    assert all(v is True for v in step.values())
    assert hook == COMPILED_AS_EAGER and set(hook) <= set(INDUCTOR_OPTIONS)


ROUND_TRIPS_KEPT = TorchVersion(torch.__version__) >= compiled._CPU_ROUND_TRIPS_KEPT


def test_the_installed_torch_has_every_option(fresh_compiler):
    found = compiled.inductor_options()
    assert list(found) == list(INDUCTOR_OPTIONS)
    assert all(found.values()), found
    # (this machine has the C++ compiler Inductor uses)
    assert (compiled._compiler("cpu") == "") == ROUND_TRIPS_KEPT


@pytest.mark.parametrize(("version", "compiles"), [("2.11.0+cu130", False), ("2.12.1", False),
                                                   ("2.13.0a0+git1234", False), ("2.13.0", True),
                                                   ("2.14.1+cpu", True)])
def test_the_default_step_on_the_cpu_needs_a_torch_that_keeps_round_trips(
    monkeypatch, fresh_compiler, version, compiles
):
    monkeypatch.setattr(torch, "__version__", version)
    message = compiled._compiler("cpu")
    assert (message == "") == compiles
    if not compiles:
        assert f"torch {version}" in message and "torch>=2.13" in message
        assert re.match(FALLBACK_WARNING, "lowprec: " + message)
    assert "round trip" not in compiled._compiler("cuda")  # (Triton keeps them)


def test_the_default_step_on_this_torch(monkeypatch, fresh_compiler, kernel_calls):
    """Compiled on the CPU from torch 2.13; before, eager with one warning. The same bits."""
    monkeypatch.delenv("LOWPREC_FUSED", raising=False)
    monkeypatch.setattr(compiled, "_WARNED", set())
    calls = kernel_calls
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pa, oa = _run(None)
        _run(None)
    ours = [str(w.message) for w in caught if str(w.message).startswith("lowprec")]
    if ROUND_TRIPS_KEPT:
        assert ours == [] and calls
    else:
        assert len(ours) == 1 and "round trip" in ours[0], ours
        assert calls == []
    pb, ob = _run(False)
    assert_same(pa, oa, pb, ob)


@pytest.mark.parametrize("option", ["emulate_precision_casts", "eager_numerics.disable_ftz"])
def test_an_option_this_torch_lacks_is_found_by_its_dotted_name(monkeypatch, option):
    *parents, leaf = option.split(".")
    owner = torch._inductor.config
    for part in parents:
        owner = getattr(owner, part)
    monkeypatch.delattr(owner, leaf)  # (Inductor's config hides it, as if this torch lacked it)
    found = compiled.inductor_options()
    assert found == {name: name != option for name in INDUCTOR_OPTIONS}


@pytest.mark.parametrize("option", ["cpp.dynamic_threads", "eager_numerics.division_rounding"])
def test_without_an_option_the_default_step_warns_once_and_stays_eager(
    monkeypatch, fresh_compiler, kernel_calls, option
):
    monkeypatch.delenv("LOWPREC_FUSED", raising=False)
    monkeypatch.setattr(compiled, "_WARNED", set())
    calls = kernel_calls
    *parents, leaf = option.split(".")
    owner = torch._inductor.config
    for part in parents:
        owner = getattr(owner, part)
    monkeypatch.delattr(owner, leaf)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pa, oa = _run(None)
        _run(None)  # a second optimizer: no second warning
    ours = [str(w.message) for w in caught if str(w.message).startswith("lowprec")]
    assert len(ours) == 1, ours
    message = ours[0]
    assert option in message and torch.__version__ in message and "torch>=2.11" in message
    # The tests that claim a fused step ran turn this warning into an error (tests/_fallback.py).
    assert re.match(FALLBACK_WARNING, message)
    assert calls == []
    pb, ob = _run(False)
    assert_same(pa, oa, pb, ob)


class _DynamoConfig(types.SimpleNamespace):
    """A stand-in for ``torch._dynamo.config`` with only the given settings."""

    def patch(self, **settings):
        self.patched = settings
        return contextlib.nullcontext()


@pytest.mark.parametrize("name", ["recompile_limit", "cache_size_limit"])
def test_the_hook_sets_the_recompile_budget_by_this_torch_s_name(monkeypatch, name):
    monkeypatch.setattr(kernels, "_WARNED_LIMIT", [])
    config = _DynamoConfig(**{name: 8, "specialize_int": False})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kernels._recompile_limit_name(config) == name


def test_without_a_recompile_budget_the_hook_warns_once_and_patches_the_rest(monkeypatch):
    monkeypatch.setattr(kernels, "_WARNED_LIMIT", [])
    config = _DynamoConfig(specialize_int=False)
    fx_config = _DynamoConfig(use_duck_shape=True)
    with pytest.warns(RuntimeWarning, match="recompile_limit") as caught:
        kernels._settings(config, fx_config)
        kernels._settings(config, fx_config)
    assert len(caught) == 1
    assert torch.__version__ in str(caught[0].message)
    assert config.patched == {"specialize_int": True}
    assert fx_config.patched == {"use_duck_shape": False}


def test_the_hook_s_settings_apply_to_the_installed_dynamo():
    import torch._dynamo.config as dynamo_config

    before = dynamo_config.recompile_limit
    with kernels.compile_settings():
        assert dynamo_config.recompile_limit == kernels.RECOMPILE_LIMIT
        assert dynamo_config.specialize_int is True
    assert dynamo_config.recompile_limit == before


def _floor() -> str:
    text = (ROOT / "pyproject.toml").read_text()
    found = re.findall(r'"torch>=([0-9.]+)"', text)
    assert len(found) == 1, found
    return found[0]


def test_the_claimed_floor_is_the_torch_ci_tests_and_the_warning_names(monkeypatch,
                                                                        fresh_compiler):
    floor = _floor()
    ci = (ROOT / ".ci" / "run").read_text()
    assert f"torch=={floor}.0" in ci  # (the floor venv's pin: the oldest release claimed)
    assert re.search(r'-m "floor and (not )?multiprocess"', ci)  # (the floor subset, both parts)
    installed = tuple(int(x) for x in re.findall(r"\d+", torch.__version__)[:2])
    assert installed >= tuple(int(x) for x in floor.split("."))
    monkeypatch.setattr(compiled, "inductor_options", lambda: {"some_option": False})
    assert f"torch>={floor}" in compiled._compiler("cpu")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_kahan_falls_back_where_this_torch_drops_its_round_trip(monkeypatch, dtype):
    """fused=True asks for a Kahan kernel on a torch whose C++ code drops the round trip
    (simulated with a floor no torch reaches): the step warns, takes the eager step and loses
    nothing."""
    monkeypatch.setattr(compiled, "_CPU_ROUND_TRIPS_KEPT", (99, 0))
    w0 = torch.randn(64, 33).to(dtype)
    grads = [torch.randn(64, 33).mul(1e-2).to(dtype) for _ in range(3)]
    out = []
    for fused in (True, False):
        p = w0.clone().requires_grad_()
        opt = AdamW([p], lr=1e-3, master="kahan", fused=fused)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for g in grads:
                p.grad = g.clone()
                opt.step()
        fell_back = [w for w in caught if "RoundTripsDropped" in str(w.message)]
        if fused:
            assert fell_back and core.stages(opt).fused_broken
        out.append((p.detach().clone(), opt.state[p]["compensation"].clone()))
    assert torch.equal(out[0][0].view(torch.int16), out[1][0].view(torch.int16))
    assert torch.equal(out[0][1].view(torch.int16), out[1][1].view(torch.int16))
    assert out[1][1].abs().sum() > 0  # (the compensation is kept: the round trip was not lost)
