"""The optimizers' device-specific choices, each made per device type in the module that owns it
(docs/architecture.md, "Device choices"); benchmarks/device_choices.py measures them."""

from __future__ import annotations

import pytest
import torch

from lowprec.optim import buckets, compiled, update


@pytest.mark.parametrize("device, chunk", [("cpu", 1 << 16), ("cuda", 1 << 22), ("xpu", 1 << 22)])
def test_eager_pieces_are_small_on_the_cpu_and_large_elsewhere(device, chunk):
    assert update._eager_chunk(torch.device(device)) == chunk


def test_eight_bit_rows_per_call():
    assert compiled._QROWS["cpu"] == 2048 and compiled._QROWS["cuda"] == 1 << 15


@pytest.mark.parametrize("device, gathered", [("cpu", 1 << 20), ("cuda", 1 << 26),
                                              ("xpu", 1 << 26)])
def test_bucket_pieces_stay_in_cache_on_the_cpu_and_are_large_elsewhere(device, gathered):
    assert buckets._gathered(torch.device(device)) == gathered
