"""Test helper: make any read of a tensor's value on the host raise (a host sync detector)."""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def no_host_reads():
    """Make every way of reading a tensor's value on the host raise ``AssertionError``."""
    names = ["item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy"]
    saved = {n: getattr(torch.Tensor, n) for n in names}

    def boom(*args, **kwargs):
        raise AssertionError("a tensor was read on the host (a host sync)")

    try:
        for n in names:
            setattr(torch.Tensor, n, boom)
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)
