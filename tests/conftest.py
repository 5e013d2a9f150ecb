import os

# Under pytest-xdist (the README's test command: ``-n auto``) each worker takes its share of the
# cores for torch's intra-op threads, set before torch starts its thread pools; subprocesses (the
# CLI, distributed ranks) inherit it. Otherwise every worker would run as many OpenMP threads as
# there are cores, and idle ones spinning beside the other workers slow everything down.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(
        1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))

import pytest
import torch

from tests._devices import DEVICES
from tests._fallback import fallbacks_are_errors

# The suite steps optimizers eagerly unless a test asks for the fused step (fused=True) or tests
# the default itself (tests/test_fused_default.py): the fused step's equality with the eager one
# is what tests/test_fused.py and tests/test_buckets.py check, and compiling a kernel for every
# test's variant would multiply the suite's time on a cold Inductor cache. Subprocesses
# (distributed workers, the CLI) inherit it.
os.environ.setdefault("LOWPREC_FUSED", "0")


#: The most pytest-xdist workers ``-n auto`` starts: each holds torch, Inductor and its compiled
#: kernels (1-1.5 GB), and compiles its own; past a few, workers mostly compile the same kernels.
MAX_WORKERS = 8


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one worker per core, at most ``MAX_WORKERS``."""
    return max(1, min(os.cpu_count() or 1, MAX_WORKERS))


def pytest_collection_modifyitems(config, items):
    """The modules that compile steps (those with tests marked ``fused`` or ``slow``) first, each
    module's tests together and in their order: under pytest-xdist the long compiles then start
    early and the run ends on short tests, instead of on compiles that began last (alphabetical
    order put two such modules at the end; on a 2-core EPYC the single-process run took 2,225 s
    with this order against 2,295 s without)."""
    compiling = {item.nodeid.split("::")[0] for item in items
                 if item.get_closest_marker("fused") or item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in compiling)


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
    to this test (an empty cache: a kernel is compiled here)."""
    from lowprec.optim import compiled

    calls = []
    monkeypatch.setattr(compiled, "_KERNELS", {})
    real = compiled._Kernel.__call__

    def spy(self, *args, **kwargs):
        calls.append(self)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(compiled._Kernel, "__call__", spy)
    return calls


@pytest.fixture
def no_buckets():
    """Steps that never go through buckets (``lowprec.optim.buckets``): every parameter by its
    full step (``tests/_steps.py``'s ``full_steps``), for the tests of a parameter's own step on
    layouts that buckets would take."""
    from tests._steps import full_steps

    with full_steps():
        yield
