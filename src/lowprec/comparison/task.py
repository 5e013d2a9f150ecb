"""What a comparison trains (``Task``: a model, its batches, a loss), and the built-in tasks'
model and data: a small byte-level transformer on texts every Python has.

A ``Task`` is what ``lowprec.compare`` makes of a user's model, batches and loss, and what
``lowprec compare --task FILE:NAME`` loads; the built-in ``pretrain`` and ``finetune`` tasks are
two of them (``run.builtin_task``). ``default_loss`` is the loss a task takes when none is given:
a Hugging Face model's own for dict batches, cross-entropy of the output against the batch's
last element otherwise.

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
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lowprec.comparison.config import ModelConfig

__all__ = ["Batches", "CharTransformer", "ModelConfig", "Task", "default_loss", "load_prose",
           "load_task", "load_text"]

VOCAB = 256


def default_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """The loss of ``model`` on ``batch`` where a task names none.

    A dict batch (a Hugging Face model's, with ``labels``): ``model(**batch).loss``. A tuple or
    list: the model on every element but the last, and the cross-entropy (in FP32, mean over
    every position) of its output, or of the output's ``logits``, against the last element,
    the class indices: a classifier's ``(images, labels)``, a language model's
    ``(tokens, next tokens)``.

    Raises:
        TypeError: A batch of another kind, or a dict batch whose output has no ``loss``.
    """
    if isinstance(batch, Mapping):
        out = model(**batch)
        loss = getattr(out, "loss", None)
        if loss is None and isinstance(out, Mapping):
            loss = out.get("loss")
        if not isinstance(loss, torch.Tensor):
            raise TypeError(
                "a dict batch is given to the model as keywords and its output's loss is taken "
                f"(model(**batch).loss), but the output ({type(out).__name__}) has no loss: "
                "put the labels in the batch (labels=...), or pass loss=fn(model, batch)."
            )
        return loss
    if isinstance(batch, (tuple, list)) and len(batch) >= 2:
        *inputs, target = batch
        out = model(*inputs)
        logits = getattr(out, "logits", out)
        if not isinstance(logits, torch.Tensor):
            raise TypeError(f"the model's output ({type(out).__name__}) is not a tensor of "
                            "logits: pass loss=fn(model, batch).")
        logits = logits.float()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
    raise TypeError(
        f"the default loss takes a dict batch (model(**batch).loss) or a tuple (inputs..., "
        f"target), got {type(batch).__name__}: pass loss=fn(model, batch) -> a scalar tensor."
    )


@dataclass
class Task:
    """What a comparison trains: every recipe and seed starts from the task's FP32 model and
    takes its batches in the same order.

    Attributes:
        model: The seed's FP32 starting model: ``model(seed)`` returns it, built once per seed
            and copied for each recipe (a model that does not depend on the seed returns the
            same weights every time).
        train: The seed's training batches: ``train(seed)``, at least as many as the steps
            (only that many are drawn).
        eval: The held-out batches the eval loss averages over, the same for every seed.
        loss: ``loss(model, batch)`` -> a scalar tensor (default: ``default_loss``).
        name: What the task is, for the table's title (default: ``"your model"``).
    """

    model: Callable[[int], nn.Module]
    train: Callable[[int], Iterable[Any]]
    eval: Sequence[Any]
    loss: Callable[[nn.Module, Any], torch.Tensor] = default_loss
    name: str = "your model"


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

    It has ``cfg.num_parameters`` parameters (``lowprec.comparison.config.SIZES`` lists the presets').
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


def load_task(spec: str) -> Task:
    """The ``Task`` that ``spec`` names: ``FILE.py:NAME`` or ``package.module:NAME``, where
    ``NAME`` is a ``Task`` or a function of no arguments returning one (``lowprec compare
    --task``). A file is run as a module of its own, with its folder on ``sys.path`` while it
    loads (so that it imports the modules beside it).

    Raises:
        ValueError: No ``:NAME``, no such file or module, or no ``NAME`` in it.
        TypeError: ``NAME`` is not a task, or its function returned something else.
    """
    import importlib
    import importlib.util
    import sys

    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise ValueError(f"--task {spec!r}: give the built-in pretrain or finetune, or a task of "
                         "yours as FILE.py:NAME or package.module:NAME.")
    if where.endswith(".py") or os.sep in where:
        path = Path(where).resolve()
        if not path.is_file():
            raise ValueError(f"--task {spec!r}: no file {where}.")
        loader_spec = importlib.util.spec_from_file_location(f"lowprec_task_{path.stem}", path)
        if loader_spec is None or loader_spec.loader is None:  # pragma: no cover - a .py file
            raise ValueError(f"--task {spec!r}: {where} cannot be loaded as Python.")
        module = importlib.util.module_from_spec(loader_spec)
        sys.path.insert(0, str(path.parent))
        try:
            loader_spec.loader.exec_module(module)
        finally:
            sys.path.remove(str(path.parent))
    else:
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as exc:
            raise ValueError(f"--task {spec!r}: no module {exc.name!r} (give a file as "
                             "path/to/file.py:NAME, or install the package).") from None
    found = getattr(module, name, None)
    if found is None:
        tasks = sorted(k for k, v in vars(module).items() if isinstance(v, Task))
        hint = f"; it defines the task(s) {', '.join(tasks)}" if tasks else ""
        raise ValueError(f"--task {spec!r}: {where} has no {name!r}{hint}.")
    if not isinstance(found, Task) and callable(found) and not isinstance(found, type):
        found = found()
    if not isinstance(found, Task):
        raise TypeError(f"--task {spec!r}: {name} is a {type(found).__name__}, not a task: make "
                        "it a lowprec.comparison.task.Task(model=..., train=..., eval=...), or a "
                        "function returning one.")
    return found
