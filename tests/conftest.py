import os

import pytest
import torch

from tests._devices import DEVICES
from tests._fallback import fallbacks_are_errors

# The suite steps optimizers eagerly unless a test asks for the fused step (fused=True) or tests
# the default itself (tests/test_fused_default.py): the fused step's equality with the eager one
# is what tests/test_fused.py and tests/test_replay.py check, and compiling a kernel for every
# test's variant would multiply the suite's time on a cold Inductor cache. Subprocesses
# (distributed workers, the CLI) inherit it.
os.environ.setdefault("LOWPREC_FUSED", "0")
# The suite compiles hundreds of kernel variants in one process, far past the compile budget
# that bounds a training process's (tests/test_fused_default.py tests the budget itself).
os.environ.setdefault("LOWPREC_COMPILE_BUDGET", "inf")


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "fused: the test claims that compiled (fused) steps ran, so a compiled step that falls "
        "back to eager fails it (tests/_fallback.py; -m fused selects these tests)",
    )
    config.addinivalue_line(
        "markers",
        "fallback: the test makes a compiled step fall back on purpose (exempt from 'fused')",
    )


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)


@pytest.fixture(autouse=True)
def _no_fallback(request):
    """Under the ``fused`` marker (and not ``fallback``) a compiled step may not quietly become
    eager: its fallback raises (tests/_fallback.py)."""
    node = request.node
    if node.get_closest_marker("fused") is None or node.get_closest_marker("fallback"):
        yield
        return
    with fallbacks_are_errors():
        yield


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    """The device a test makes its tensors on: "cpu", and also "cuda" where CUDA is available
    (tests/_devices.py). Tests built on @given take ``DEVICES`` as a direct parametrization
    instead, since Hypothesis refuses a function-scoped fixture."""
    return request.param


@pytest.fixture
def kernel_calls(monkeypatch):
    """The compiled kernels called (``compiled._Kernel``, once per call), with every kernel new
    to this test (an empty cache: a kernel is compiled, or refused by the budget, here)."""
    from lowprec.optim import compiled

    calls = []
    monkeypatch.setattr(compiled, "_KERNELS", {})
    real = compiled._Kernel.__call__

    def spy(self, *args, **kwargs):
        calls.append(self)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(compiled._Kernel, "__call__", spy)
    return calls
