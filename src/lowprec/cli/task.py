"""The built-in tasks' model and data: a small byte-level transformer on texts every Python has.

Every Python installation carries its standard library as ``.py`` files, so the tasks need no
download: ``load_text`` reads the modules beside ``os.py`` in sorted order (byte-level, so the
vocabulary is the 256 byte values), ``load_prose`` the English help texts of
``pydoc_data.topics`` (the fine-tuning task's second text), and ``Batches`` cuts training and
evaluation windows from a text with a seeded generator, so every recipe sees the same data in the
same order.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from lowprec.cli.config import ModelConfig

__all__ = ["Batches", "CharTransformer", "ModelConfig", "load_prose", "load_text"]

VOCAB = 256


def load_text(max_bytes: int = 2_000_000) -> torch.Tensor:
    """Bytes of the standard library's top-level modules, in sorted order, as a uint8 tensor.

    Args:
        max_bytes: Stop after this many bytes (default: 2,000,000).

    Raises:
        RuntimeError: If the standard library's sources cannot be found (e.g. a frozen or
            sources-stripped Python).
    """
    stdlib = Path(os.__file__).resolve().parent
    files = sorted(p for p in stdlib.glob("*.py") if p.is_file())
    chunks, total = [], 0
    for path in files:
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if total < 100_000:
        raise RuntimeError(
            f"found only {total} bytes of Python source beside {stdlib}; this Python ships "
            "without its standard library sources, which the built-in task trains on."
        )
    blob = b"".join(chunks)[:max_bytes]
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8).clone()


def load_prose() -> torch.Tensor:
    """The English prose of ``pydoc_data.topics`` (the language reference's help texts that
    ``help()`` shows; about 460 KB), topics in sorted order, UTF-8, as a uint8 tensor.

    Raises:
        RuntimeError: If this Python lacks ``pydoc_data`` (some distributions package it apart).
    """
    try:
        from pydoc_data.topics import topics
    except ImportError as exc:
        raise RuntimeError(
            f"this Python has no pydoc_data.topics ({exc}), the fine-tuning task's text; "
            "install the package that holds the standard library's help texts (on Debian and "
            "Ubuntu the pythonX.Y full package), or run the pretrain task."
        ) from None
    blob = "".join(topics[key] for key in sorted(topics)).encode("utf-8")
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8).clone()


class Batches:
    """Seeded random windows of the text: training from the first 90%, evaluation from the rest.

    Args:
        text: The uint8 corpus.
        context: Window length in bytes.
        batch_size: Windows per batch.
        seed: Seed of the window positions (default: 0).
        eval_seed: Seed of the evaluation windows (default: None, ``seed + 1``); runs of
            several seeds share one to be measured on the same windows.
        device: Where the batches go; the windows are drawn on the CPU, so every device gets
            the same ones (default: None, the CPU).
    """

    def __init__(self, text: torch.Tensor, *, context: int, batch_size: int, seed: int = 0,
                 eval_seed: int | None = None, device: torch.device | str | None = None):
        cut = int(len(text) * 0.9)
        self.train, self.eval = text[:cut].long(), text[cut:].long()
        self.context, self.batch_size, self.seed = context, batch_size, seed
        self.eval_seed = seed + 1 if eval_seed is None else eval_seed
        self.device = torch.device("cpu") if device is None else torch.device(device)

    def _windows(self, data: torch.Tensor, gen: torch.Generator,
                 n: int) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, len(data) - self.context - 1, (n,), generator=gen)
        idx = starts[:, None] + torch.arange(self.context + 1)
        chunk = data[idx].to(self.device)
        return chunk[:, :-1], chunk[:, 1:]

    def train_batches(self, steps: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """``steps`` training batches, the same sequence for the same seed."""
        gen = torch.Generator().manual_seed(self.seed)
        for _ in range(steps):
            yield self._windows(self.train, gen, self.batch_size)

    def eval_batches(self, n: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A fixed set of ``n`` evaluation batches (the same for every call)."""
        gen = torch.Generator().manual_seed(self.eval_seed)
        return [self._windows(self.eval, gen, self.batch_size) for _ in range(n)]


class _Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.n_head = cfg.n_head
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        out: torch.Tensor = x + self.out(F.gelu(self.fc(self.ln2(x))))
        return out


class CharTransformer(nn.Module):
    """A GPT-style byte-level language model: embeddings, pre-norm blocks, a linear head.

    It has ``cfg.num_parameters`` parameters (``lowprec.cli.config.SIZES`` lists the presets').
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(VOCAB, cfg.d_model)
        self.pos = nn.Embedding(cfg.context, cfg.d_model)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.n_layer))
        self.ln = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, VOCAB)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() > 1:
                std = 0.02 / math.sqrt(2 * cfg.n_layer) if name.endswith(("proj.weight",
                                                                          "out.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(self.ln(x))
        return logits
