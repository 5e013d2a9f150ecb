"""Test helper: the devices and process-group backends present, for tests that run on each.

The ``device`` fixture (tests/conftest.py) runs a test on every entry of ``DEVICES``: the CPU
always, CUDA where it is available. The multi-process 1-bit SGD tests run on every entry of
``DIST_BACKENDS``: gloo on the CPU always, NCCL (one GPU per rank) where two GPUs exist. The CUDA
and NCCL entries carry the ``gpu`` marker, so ``python -m pytest -m gpu`` runs only them.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist


def cuda_count() -> int:
    """How many CUDA devices this process sees (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


#: The devices of the device-parametrized tests (the ``device`` fixture's parameters).
DEVICES = ["cpu"] + ([pytest.param("cuda", marks=pytest.mark.gpu)] if cuda_count() else [])

#: The backends of the multi-process tests: NCCL needs a GPU per rank, and they run 2 ranks.
DIST_BACKENDS = ["gloo"] + (
    [pytest.param("nccl", marks=pytest.mark.gpu)]
    if cuda_count() >= 2 and dist.is_available() and dist.is_nccl_available() else []
)
