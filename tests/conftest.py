import os

import pytest
import torch

from tests._devices import DEVICES

# The suite steps optimizers eagerly unless a test asks for the fused step (fused=True) or tests
# the default itself (tests/test_fused_default.py): the fused step's equality with the eager one
# is what tests/test_fused.py and tests/test_replay.py check, and compiling a kernel for every
# test's variant would multiply the suite's time on a cold Inductor cache. Subprocesses
# (distributed workers, the CLI) inherit it.
os.environ.setdefault("LOWPREC_FUSED", "0")
# The suite compiles hundreds of kernel variants in one process, far past the compile budget
# that bounds a training process's (tests/test_fused_default.py tests the budget itself).
os.environ.setdefault("LOWPREC_COMPILE_BUDGET", "inf")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    """The device a test makes its tensors on: "cpu", and also "cuda" where CUDA is available
    (tests/_devices.py). Tests built on @given take ``DEVICES`` as a direct parametrization
    instead, since Hypothesis refuses a function-scoped fixture."""
    return request.param
