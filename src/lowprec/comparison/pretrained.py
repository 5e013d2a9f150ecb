"""The fine-tuning task's starting point: the built-in model pretrained once in FP32, cached.

``pretrained(cfg, device, cache_dir=...)`` returns the weights every recipe and seed of the
``finetune`` task starts from: the built-in model trained ``cfg.pretrain_steps`` AdamW steps in
FP32 on the standard library's sources (the ``pretrain`` task's recipe, seed and schedule), in
FP32: FP32 starts from them exactly, and each BF16 recipe from their rounding, its master from
the FP32 values where it holds more than the BF16 weight (``Recipe.convert``'s
``fp32_values``; ``CompareConfig.fp32_values=False`` starts it from the rounding). Pretraining
takes a minute on 2 CPU cores, so the FP32 result is saved in ``cache_dir`` under a name derived
from everything that determines it (``cache_key``) and reused by later runs. A cache file that
cannot be read, belongs to another key, lacks a tensor or fails its checksum is reported and
trained again, never trusted: the file holds a SHA-256 of its tensors' bytes. Files are written
to a temporary name and renamed, so an interrupted run never leaves half a file under the name.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch

from lowprec.comparison.config import DEFAULT_LR, CompareConfig
from lowprec.comparison.run import _evaluate, _Run, builtin_task
from lowprec.comparison.task import CharTransformer, load_text

__all__ = ["FORMAT", "cache_key", "cache_path", "pretrained"]

#: The cache files' format; a change of what they hold or how it is trained bumps it.
FORMAT = 1
#: The pretraining's peak rate (AdamW, FP32).
PRETRAIN_LR = DEFAULT_LR["adamw"]


def _pretrain_config(cfg: CompareConfig) -> CompareConfig:
    """The run that pretrains: ``cfg``'s model, batch, seed, device and text, the ``pretrain``
    task's FP32 AdamW at its default rate and cosine schedule, ``pretrain_steps`` steps."""
    return dataclasses.replace(
        cfg, task="pretrain", recipes=("fp32",), optimizer="adamw", lr=PRETRAIN_LR,
        steps=cfg.pretrain_steps, schedule="cosine", warmup=0.05, seeds=1, monitor_every=0,
    )


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def cache_key(cfg: CompareConfig, device: torch.device, text: torch.Tensor) -> dict[str, Any]:
    """Everything that determines the pretrained weights: the format, the model's shape, the
    pretraining's steps, optimizer, rate, schedule, batch and seed, the text's SHA-256, the
    device type, the CPU thread count (a matmul's summation order can follow it) and torch's
    version."""
    p = _pretrain_config(cfg)
    return {
        "format": FORMAT,
        "model": dataclasses.asdict(p.model),
        "steps": p.steps, "optimizer": p.optimizer, "lr": p.lr, "schedule": p.schedule,
        "warmup": p.warmup, "weight_decay": 0.01, "batch_size": p.batch_size, "seed": p.seed,
        "text_sha256": _sha256(text.numpy().tobytes()), "text_bytes": len(text),
        "device": device.type, "threads": p.threads if device.type == "cpu" else None,
        "torch": str(torch.__version__),
    }


def cache_path(cache_dir: str | os.PathLike[str], key: dict[str, Any]) -> Path:
    """``cache_dir/pretrained-<16 hex digits of the key's SHA-256>.pt``."""
    digest = _sha256(json.dumps(key, sort_keys=True).encode())[:16]
    return Path(cache_dir) / f"pretrained-{digest}.pt"


def _digest(state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(state):
        h.update(name.encode())
        h.update(state[name].detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _read(path: Path, key: dict[str, Any], expected: dict[str, torch.Tensor]
          ) -> tuple[dict[str, Any] | None, str]:
    """The cache file's contents if they are sound, else None and why not."""
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # (any unreadable file is trained again, never trusted)
        first = (str(exc).splitlines() or [""])[0][:120]
        return None, f"unreadable ({type(exc).__name__}: {first})"
    if not isinstance(data, dict) or data.get("key") != key:
        return None, "written for other settings"
    state = data.get("state")
    if not isinstance(state, dict) or set(state) != set(expected):
        return None, "its tensors are not the model's"
    for name, ref in expected.items():
        t = state[name]
        if not isinstance(t, torch.Tensor) or t.shape != ref.shape or t.dtype != ref.dtype:
            return None, f"tensor {name} has the wrong shape or dtype"
    if data.get("sha256") != _digest(state):
        return None, "its checksum does not match its tensors"
    if not all(bool(torch.isfinite(t).all()) for t in state.values() if t.is_floating_point()):
        return None, "it holds inf or NaN"
    return data, ""


def _write(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # (this process's own name)
    try:
        torch.save(payload, tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _train(cfg: CompareConfig, device: torch.device,
           on_step: Callable[[int, int, float], None] | None) -> tuple[dict[str, Any], float]:
    """Pretrain in FP32; returns the CPU state dict and the eval loss on held-out sources."""
    p = _pretrain_config(cfg)
    steps = cast(int, p.steps)  # (_pretrain_config's: cfg.pretrain_steps)
    task = builtin_task(p, device)
    run = _Run("fp32", p, task.model(p.seed), task, p.seed)
    for step, batch in enumerate(task.train(p.seed)):
        loss = run.step(batch)
        if on_step is not None:
            on_step(step, steps, loss)
    eval_loss = _evaluate(run.model, run.recipe, task.eval, device)
    state = {k: v.detach().cpu().clone() for k, v in run.model.state_dict().items()}
    return state, eval_loss


def pretrained(
    cfg: CompareConfig,
    device: torch.device,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    on_step: Callable[[int, int, float], None] | None = None,
    on_note: Callable[[str], None] | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The fine-tuning task's initial weights (FP32) and what they are.

    Read from ``cache_dir`` where a sound file for ``cache_key`` is there; else pretrained
    (``on_step(step, total, loss)`` after each step) and, with a ``cache_dir``, saved there.
    ``on_note(text)`` hears a cache file that was there but unsound, and why.

    Returns:
        ``(state, about)``: ``about`` holds ``path`` (None without a cache), ``cached`` (read
        from the file), ``seconds`` (what training took; 0 when read), ``eval_loss`` (the FP32
        model's on held-out sources) and ``key``.
    """
    text = load_text(cfg.text_bytes)
    key = cache_key(cfg, device, text)
    expected = CharTransformer(cfg.model).state_dict()
    path = None if cache_dir is None else cache_path(cache_dir, key)
    if path is not None and path.exists():
        data, why = _read(path, key, expected)
        if data is not None:
            about = {"path": str(path), "cached": True, "seconds": 0.0,
                     "eval_loss": data.get("eval_loss"), "key": key}
            return data["state"], about
        if on_note is not None:
            on_note(f"the cached pretrained model {path} is {why}: pretraining again")
    started = time.perf_counter()
    state, eval_loss = _train(cfg, device, on_step)
    seconds = time.perf_counter() - started
    if not math.isfinite(eval_loss):
        raise RuntimeError(f"pretraining diverged (eval loss {eval_loss}); nothing was cached.")
    if path is not None:
        try:
            _write(path, {"key": key, "state": state, "sha256": _digest(state),
                          "eval_loss": eval_loss, "seconds": seconds})
        except OSError as exc:  # (the run goes on; the next one pretrains again)
            if on_note is not None:
                on_note(f"could not cache the pretrained model in {path}: "
                        f"{exc.strerror or exc}")
            path = None
    about = {"path": None if path is None else str(path), "cached": False, "seconds": seconds,
             "eval_loss": eval_loss, "key": key}
    return state, about
