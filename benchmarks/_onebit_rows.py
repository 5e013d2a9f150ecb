"""Helpers of ``onebit_allreduce.py``: synthetic buckets, the link check, the DDP step rows and
the statistics. Kept apart so that the benchmark script stays readable; nothing here is meant to
be imported from elsewhere.
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lowprec.distributed import OneBitState, onebit_hook

# --------------------------------------------------------------------------- synthetic buckets


class Bucket:
    """The part of ``dist.GradBucket`` that ``onebit_hook`` and ``bf16_compress_hook`` use."""

    def __init__(self, index: int, params: list[nn.Parameter], buffer: torch.Tensor,
                 last: bool) -> None:
        self._index, self._params, self._buffer, self._last = index, params, buffer, last

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def parameters(self) -> list[nn.Parameter]:
        return self._params

    def gradients(self) -> list[torch.Tensor]:
        out, at = [], 0
        for p in self._params:
            out.append(self._buffer[at : at + p.numel()].view_as(p))
            at += p.numel()
        return out

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._last


def flat_model(values: int) -> nn.ParameterList:
    """``values`` FP32 values as ``1024 x 1024`` weights (and one shorter weight for the rest)."""
    full, rest = divmod(values, 1024 * 1024)
    shapes = [(1024, 1024)] * full + ([(rest // 1024, 1024)] if rest >= 1024 else [])
    return nn.ParameterList([nn.Parameter(torch.empty(s)) for s in shapes])


def buckets(params: list[nn.Parameter], bucket_bytes: int) -> list[list[nn.Parameter]]:
    """Cut ``params`` into groups of at most ``bucket_bytes`` FP32 bytes (0: one group), in order,
    as DDP fills its buckets."""
    groups: list[list[nn.Parameter]] = [[]]
    size = 0
    for p in params:
        if groups[-1] and bucket_bytes and size + 4 * p.numel() > bucket_bytes:
            groups.append([])
            size = 0
        groups[-1].append(p)
        size += 4 * p.numel()
    return groups


# ------------------------------------------------------------------------------------ timing


def timed(fn: Callable[[], Any], group_max: bool = True) -> float:
    """Seconds ``fn()`` took after a barrier: the slowest rank's time with ``group_max``."""
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    if group_max:
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    return dt.item()


def summary(samples: list[float]) -> dict[str, float]:
    """Median, quartiles and minimum of ``samples`` (seconds). The quartiles interpolate between
    samples (``method="inclusive"``), so they stay within the samples' range for few of them."""
    s = sorted(samples)
    q = statistics.quantiles(s, n=4, method="inclusive") if len(s) > 1 else [s[0]] * 3
    return {"median": statistics.median(s), "q1": q[0], "q3": q[2], "min": s[0]}


# -------------------------------------------------------------------------------- link check


def link_check(nbytes: int, reps: int) -> dict[str, Any] | None:
    """Time ``reps`` round trips of ``nbytes`` between rank 0 and rank 1 (gloo send/recv).

    Rank 0 sends ``nbytes`` to rank 1, which sends them back once it has them all; rank 0's
    time for the round trip carries ``2 * nbytes`` one way after the other, so
    ``16 * nbytes / time`` is the one-way rate in bit/s, the rate a shaped link was given
    (latency adds to it: keep ``nbytes`` large against the link's bandwidth-delay product).
    Every rank must call it; ranks from 2 up only wait at the barriers. One untimed round trip
    comes first (TCP's slow start, gloo's pair setup).

    Returns:
        On rank 0: ``{"bytes", "reps", "samples_s", "gbit_s"}`` with ``gbit_s`` from the median
        round trip. None on the other ranks, and on every rank when the group has one rank.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    if world < 2:
        return None
    buf = torch.zeros(max(nbytes, 1), dtype=torch.uint8)
    samples = []
    for i in range(reps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(buf, dst=1)
            dist.recv(buf, src=1)
        elif rank == 1:
            dist.recv(buf, src=0)
            dist.send(buf, dst=0)
        if i:
            samples.append(time.perf_counter() - t0)
    dist.barrier()
    if rank != 0:
        return None
    med = statistics.median(samples)
    return {"bytes": buf.numel(), "reps": reps, "samples_s": samples,
            "gbit_s": 16 * buf.numel() / med / 1e9}


# ------------------------------------------------------------------------------ the DDP rows


def mlp_width(millions: float) -> int:
    """The width ``d`` of ``mlp(d)`` whose ``6 d**2`` weights come closest to ``millions`` million
    parameters, a multiple of 64 (at least 64): 2048 for 25 (25.2M parameters)."""
    return max(64, round(math.sqrt(millions * 1e6 / 6) / 64) * 64)


def mlp(d: int) -> nn.Sequential:
    """``d -> d -> 2d -> d -> d`` with ReLUs: Linear(d, d), Linear(d, 2d), Linear(2d, d),
    Linear(d, d), ``6 d**2 + 5 d`` parameters (25,176,064 for ``d = 2048``) in 8 tensors."""
    return nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, 2 * d), nn.ReLU(),
                         nn.Linear(2 * d, d), nn.ReLU(), nn.Linear(d, d))


class DDPPair:
    """Two copies of one MLP, each in its own ``DistributedDataParallel`` on the default (gloo)
    group: ``plain`` with DDP's default FP32 all-reduce, ``onebit`` with ``onebit_hook`` (a DDP
    model takes one hook, so the two cannot share a wrapper). Each has its own SGD and the same
    batch, drawn once per rank.
    """

    def __init__(self, width: int, batch: int, bucket_mb: float, rank: int,
                 hook_options: dict[str, Any]) -> None:
        torch.manual_seed(0)  # the same weights on every rank (DDP broadcasts rank 0's anyway)
        model = mlp(width)
        self.params = sum(p.numel() for p in model.parameters())
        self.width, self.batch = width, batch
        cap = bucket_mb if bucket_mb > 0 else 1e6  # 0: one bucket, as for the synthetic rows
        twin = copy.deepcopy(model)
        self.plain = DistributedDataParallel(model, bucket_cap_mb=cap)
        self.onebit = DistributedDataParallel(twin, bucket_cap_mb=cap)
        self.state = OneBitState(twin, warmup_steps=0, **hook_options)
        self.onebit.register_comm_hook(self.state, onebit_hook)
        self.opts = {m: torch.optim.SGD(m.parameters(), lr=1e-6) for m in (self.plain,
                                                                           self.onebit)}
        gen = torch.Generator().manual_seed(1000 + rank)
        self.x = torch.randn(batch, width, generator=gen)
        self.y = torch.randn(batch, width, generator=gen)

    def step(self, ddp: DistributedDataParallel) -> None:
        """One training step: zero the gradients, forward, MSE loss, backward (DDP's
        communication happens in here), SGD step."""
        opt = self.opts[ddp]
        opt.zero_grad(set_to_none=False)
        loss = nn.functional.mse_loss(ddp(self.x), self.y)
        loss.backward()
        opt.step()
