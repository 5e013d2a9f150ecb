"""What ``fused=None`` (the optimizers' default) does: compiled where torch.compile has a
compiler, eager with one warning where it has none, and ``LOWPREC_FUSED`` to choose. Every way
gives the eager step's results.

The rest of the suite runs with ``LOWPREC_FUSED=0`` (tests/conftest.py); these tests set it.
The tests that claim a compiled step ran are marked ``fused``: a compiled step that falls back to
eager fails them (tests/_fallback.py); the others test the fallbacks themselves.
"""

from __future__ import annotations

import pytest
import torch

from lowprec.optim import AdamW, Lamb, compiled
from tests._same import assert_same

pytestmark = pytest.mark.slow

SHAPES = [(300, 256), (64,), (32, 4), (7,)]


def _run(cls, fused, steps=3, **kw):
    torch.manual_seed(0)
    params = [(torch.randn(s) * 0.1).to(torch.bfloat16).requires_grad_() for s in SHAPES]
    opt = cls(params, lr=1e-2, master="kahan", seed=3, fused=fused, **kw)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = (torch.randn(p.shape, generator=gen) * 1e-2).to(torch.bfloat16)
        opt.step()
    return params, opt


@pytest.mark.fused
@pytest.mark.parametrize("cls", [AdamW, Lamb])
def test_the_default_step_is_compiled_where_a_compiler_exists(monkeypatch, kernel_calls, cls):
    monkeypatch.delenv("LOWPREC_FUSED", raising=False)
    assert compiled._compiler("cpu") == ""  # (this machine has the C++ compiler Inductor uses)
    pa, oa = _run(cls, None)
    assert kernel_calls, "the default step ran no compiled kernel"
    pb, ob = _run(cls, False)
    assert_same(pa, oa, pb, ob)


def test_without_a_compiler_the_default_warns_once_and_steps_eagerly(monkeypatch, kernel_calls):
    monkeypatch.delenv("LOWPREC_FUSED", raising=False)
    monkeypatch.setattr(compiled, "_compiler", lambda device: "no C++ compiler (simulated)")
    monkeypatch.setattr(compiled, "_WARNED", set())
    with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler") as caught:
        pa, oa = _run(AdamW, None)
        _run(AdamW, None)  # a second optimizer: no second warning
    assert len([w for w in caught if "lowprec" in str(w.message)]) == 1
    assert kernel_calls == []
    pb, ob = _run(AdamW, False)
    assert_same(pa, oa, pb, ob)


@pytest.mark.fused
@pytest.mark.parametrize("value, compiles", [("0", False), ("eager", False), ("1", True),
                                             ("auto", True), ("", True)])
def test_lowprec_fused_sets_what_the_default_means(monkeypatch, kernel_calls, value, compiles):
    monkeypatch.setenv("LOWPREC_FUSED", value)
    _run(AdamW, None, steps=2)
    assert bool(kernel_calls) is compiles
    kernel_calls.clear()
    _run(AdamW, False, steps=2)  # an explicit choice is kept whatever the environment says
    assert kernel_calls == []


def test_an_unknown_lowprec_fused_is_refused_when_the_optimizer_is_made(monkeypatch):
    monkeypatch.setenv("LOWPREC_FUSED", "maybe")
    p = torch.zeros(4, requires_grad=True)
    with pytest.raises(ValueError, match=r"LOWPREC_FUSED='maybe'.*auto.*1.*0"):
        AdamW([p])
    AdamW([p], fused=False)  # (an explicit choice does not read it)


