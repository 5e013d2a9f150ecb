"""The optimizers' device-specific choices, each made per device type in the module that owns it
(docs/architecture.md, "Device choices"); benchmarks/device_choices.py measures them."""

from __future__ import annotations

import pytest
import torch

from lowprec.optim import batches, compiled, update
from lowprec.optim.storage import STORAGES


@pytest.mark.parametrize("device, chunk", [("cpu", 1 << 16), ("cuda", 1 << 22), ("xpu", 1 << 22)])
def test_eager_pieces_are_small_on_the_cpu_and_large_elsewhere(device, chunk):
    assert update._eager_chunk(torch.device(device)) == chunk


def test_eight_bit_rows_per_call():
    assert compiled._QROWS["cpu"] == 2048 and compiled._QROWS["cuda"] == 1 << 15


@pytest.mark.parametrize("device, master, dtype, batched", [
    ("cpu", "kahan", torch.bfloat16, True),
    ("cpu", "split", torch.bfloat16, True),
    ("cpu", "stochastic", torch.bfloat16, True),  # (on pairs: per-word keys)
    ("cpu", "stochastic", torch.float16, False),  # (no pairs for FP16)
    ("cuda", "kahan", torch.bfloat16, True),
    ("cuda", "none", torch.float16, True),
    ("cuda", "stochastic", torch.bfloat16, False),  # (pairs are a CPU layout)
    ("meta", "kahan", torch.bfloat16, False),
])
def test_which_small_parameters_batch(device, master, dtype, batched):
    storage = STORAGES[master]
    assert batches._batches_on(torch.device(device), storage, dtype) is batched
