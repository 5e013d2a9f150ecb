"""Bit casts in Inductor's vectorized C++ (``lowprec.optim.vector_casts``): the code lowprec's
kernels compile to has vector casts where Inductor alone writes a scalar loop per cast, the
results are the same bits, and Inductor is left as it was for code compiled outside lowprec."""

from __future__ import annotations

import pytest
import torch

import lowprec
from lowprec.optim import compiled, vector_casts

inductor_utils = pytest.importorskip("torch._inductor.utils")
pytestmark = [
    pytest.mark.skipif(bool(compiled._compiler("cpu")), reason="no C++ compiler for Inductor"),
    pytest.mark.skipif(not vector_casts.available(), reason="this torch's Inductor lacks it"),
    pytest.mark.fused,  # (a compiled step that falls back to eager fails: tests/_fallback.py)
]

_SCALAR_CAST = "c10::bit_cast"
_VECTOR_CAST = "at::vec::cast<"


def _fresh_cache():
    fresh = getattr(inductor_utils, "fresh_cache", None) or inductor_utils.fresh_inductor_cache
    return fresh()


def _casts(x: torch.Tensor) -> torch.Tensor:
    """Bit casts of every kind the steps use: 32-bit words as FP32 and back, FP32 pairs as
    64-bit words and back, and arithmetic between them so that nothing folds away."""
    lo = (x << 16).view(torch.float32)  # the low BF16 half of each word, as FP32
    hi = (x & -65536).view(torch.float32)  # the high half
    w = torch.where(lo > hi, lo, hi).view(torch.int32) ^ x
    wide = torch.stack([lo, hi], -1).view(torch.int64).view(-1)  # FP32 pairs as 64-bit words
    back = torch.where(wide.view(torch.float64) > 0, wide, -wide)  # (no rounding: exact bits)
    return w, back


def _steps(opt, n: int) -> None:
    for _ in range(n):
        opt.step()


def _code(fn, *args) -> tuple[object, str]:
    with _fresh_cache():
        out, sources = inductor_utils.run_and_get_code(
            torch.compile(fn, dynamic=True, fullgraph=True), *args)
    return out, "\n".join(sources)


def test_lowprec_kernels_cast_bits_as_vectors_and_equal_eager():
    x = torch.randint(-2**31, 2**31 - 1, (4099,), dtype=torch.int32)  # every pattern: NaNs too
    with vector_casts.vector_casts():
        (w, back), code = _code(_casts, x)
    assert "at::vec::cast<float>" in code and "at::vec::cast<int32_t>" in code
    assert "at::vec::cast<double>" in code  # (64-bit words in a loop of 16 floats: VectorizedN)
    # (scalar bit casts remain only in the loops' scalar tails)
    assert "tmpbuf_out[i] = c10::bit_cast" not in code
    ew, eback = _casts(x)
    assert torch.equal(w, ew) and torch.equal(back, eback)


def test_inductor_is_left_as_it_was_outside_the_context():
    x = torch.randint(-2**31, 2**31 - 1, (4099,), dtype=torch.int32)
    with vector_casts.vector_casts(), vector_casts.vector_casts():  # (re-entrant)
        pass
    _, code = _code(_casts, x)
    assert _VECTOR_CAST not in code and _SCALAR_CAST in code


def test_a_fused_bf16_step_compiles_to_vector_casts_and_equals_eager(monkeypatch):
    """The update on BF16 pairs, the kernel the scalar casts were in, compiled afresh."""
    monkeypatch.setattr(compiled, "_KERNELS", {})  # (compiled here, not taken from another test)
    torch.manual_seed(0)
    w0 = torch.randn(4097).to(torch.bfloat16)
    g = (torch.randn(4097) * 1e-2).to(torch.bfloat16)
    result, code = {}, ""
    for fused in (False, True):
        p = torch.nn.Parameter(w0.clone())
        p.grad = g.clone()
        opt = lowprec.AdamW([p], lr=1e-3, master="stochastic", fused=fused, seed=3)
        with _fresh_cache():
            _, sources = inductor_utils.run_and_get_code(_steps, opt, 3)
        code += "\n".join(sources)
        result[fused] = (p.detach().clone(), opt.state[p]["exp_avg"].clone())
    assert torch.equal(result[True][0].view(torch.int16), result[False][0].view(torch.int16))
    assert torch.equal(result[True][1], result[False][1])
    assert code.count(_VECTOR_CAST) >= 10, "the pairs kernel was not compiled with vector casts"
    assert "tmpbuf_out[i] = c10::bit_cast" not in code
