"""What every integration test needs: one torch thread, and Accelerate's singletons forgotten."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """Run torch on one thread: these models are too small to gain from more, and on a shared
    2-core machine a second intra-op thread waiting for its core made steps 10-30x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _fresh_accelerate_state() -> Iterator[None]:
    """Forget Accelerate's process-wide singletons around each test, as Accelerate's own tests
    do (an ``Accelerator`` with other settings than an earlier one's refuses to start otherwise;
    Hugging Face Trainer makes one too)."""
    try:
        from accelerate.state import AcceleratorState, GradientState
    except ImportError:
        yield
        return

    def reset() -> None:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()

    reset()
    yield
    reset()
