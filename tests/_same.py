"""Test helper: parameters and optimizer state compared bit for bit."""

from __future__ import annotations

import torch


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bits as integers of its width (so NaNs, signed zeros and payloads compare too)."""
    t = t.detach().reshape(-1)
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def assert_same(pa, oa, pb, ob) -> None:
    """Parameters ``pa`` and ``pb`` (lists) and their state in optimizers ``oa`` and ``ob`` hold
    the same bits, with the same state keys and dtypes."""
    for a, b in zip(pa, pb, strict=True):
        assert torch.equal(bits(a), bits(b))
        sa, sb = oa.state[a], ob.state[b]
        assert sa.keys() == sb.keys()
        for k, v in sa.items():
            if isinstance(v, torch.Tensor):
                assert v.dtype == sb[k].dtype, k
                assert torch.equal(bits(v), bits(sb[k])), k
            else:
                assert v == sb[k], k
