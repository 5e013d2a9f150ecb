"""What a model of a given size needs per recipe: ``lowprec memory --params 7B``.

``parse_params`` reads a parameter count (``3e9``, ``7B``, ``1.5e9``, ``350M``) or a Hugging Face
``config.json`` (``count_config``: Llama, Mistral, Qwen2 and Qwen3 style decoders, from their
shapes); both are torch-free, so the command's argument errors answer at once. ``plan`` then gives,
from ``lowprec.memory.expected``'s bytes per element, the GiB of weights, gradients, optimizer
state and master each recipe needs, without and with ``step_in_backward`` (gradients: none held
between parameters' steps; the largest parameter's while it is stepped, where a config gives the
shapes), and whether that fits on cards of ``CARDS`` GiB. These are the tensors a training step
keeps alive at its peak; activations, temporaries, the CUDA context and the allocator's slack come
on top.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, TypedDict

__all__ = ["CARDS", "ModelSize", "count_config", "in_backward_refusal", "parse_params", "plan"]

#: Card sizes, in GiB, that ``plan`` says a recipe fits in or not.
CARDS: tuple[int, ...] = (24, 40, 80)

_SUFFIX = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
_NUMBER = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmbgt]?)\s*$", re.IGNORECASE)


class _Family(TypedDict):
    """What differs between the decoders ``count_config`` counts."""

    qkv_bias: bool | None  # (None: the config's attention_bias)
    qk_norm: bool


#: The decoders ``count_config`` counts (``model_type``) and what differs between them.
_FAMILIES: dict[str, _Family] = {
    "llama": {"qkv_bias": None, "qk_norm": False},
    "mistral": {"qkv_bias": False, "qk_norm": False},
    "qwen2": {"qkv_bias": True, "qk_norm": False},
    "qwen3": {"qkv_bias": None, "qk_norm": True},
}
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads")


@dataclass(frozen=True)
class ModelSize:
    """A model's parameter count, and where it came from.

    Attributes:
        numel: Parameter elements.
        largest: The largest parameter's elements, where the shapes are known (else None).
        source: ``"--params 7B"`` or the config's path and model type.
    """

    numel: int
    largest: int | None
    source: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def parse_params(text: str) -> ModelSize:
    """A parameter count (``3e9``, ``7B``, ``1.5e9``, ``350M``; K, M, B or G, T) or the path of a
    Hugging Face ``config.json``.

    Raises:
        ValueError: Neither a positive count nor a readable config it can count; the message
            names the problem and what to pass instead.
    """
    m = _NUMBER.match(text)
    if m is not None:
        value = float(m.group(1)) * _SUFFIX[m.group(2).lower()]
        if not (math.isfinite(value) and value >= 1):
            raise ValueError(f"{text!r} is not a positive parameter count; e.g. 7B or 3e9")
        return ModelSize(numel=round(value), largest=None, source=f"--params {text.strip()}")
    path = Path(text).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if path.suffix != ".json" and not path.exists():
        raise ValueError(f"{text!r} is neither a parameter count (e.g. 7B, 1.5e9, 350M) nor the "
                         "path of a Hugging Face config.json")
    return count_config(path)


def count_config(path: str | Path) -> ModelSize:
    """The parameters of a Llama, Mistral, Qwen2 or Qwen3 style decoder from its ``config.json``.

    Per layer: the attention's q and o projections (``num_attention_heads * head_dim`` by
    ``hidden_size``), k and v (``num_key_value_heads * head_dim``; q, k, v biases for Qwen2 and
    where ``attention_bias`` is set), the gated MLP's three ``hidden_size x intermediate_size``
    matrices (biases where ``mlp_bias`` is set), two RMSNorm weights (and Qwen3's q and k norms of
    ``head_dim``); then the embedding, the final norm, and an output head unless
    ``tie_word_embeddings``.

    Raises:
        ValueError: The file cannot be read or is not JSON, its ``model_type`` is not one of
            those above, a field is missing or not a positive whole number, or it describes a
            mixture of experts.
    """
    path = Path(path)
    try:
        cfg = json.loads(path.read_text())
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not a JSON file ({exc})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path} holds no JSON object; pass a Hugging Face config.json")
    kind = cfg.get("model_type")
    if kind not in _FAMILIES:
        raise ValueError(f"{path}: cannot count a model_type {kind!r} config; it counts "
                         f"{', '.join(_FAMILIES)} decoders: pass the parameter count instead "
                         "(--params 7B)")
    moe = [k for k in ("num_local_experts", "num_experts", "n_routed_experts") if cfg.get(k)]
    if moe:
        raise ValueError(f"{path}: a mixture of experts ({moe[0]}={cfg[moe[0]]}) is not counted; "
                         "pass the parameter count instead (--params 47B)")

    def whole(name: str, default: Any = None) -> int:
        value = cfg.get(name, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{path}: {name} must be a positive whole number, got {value!r}; "
                             "fix the config or pass the parameter count (--params 7B)")
        return value

    missing = [k for k in _REQUIRED if k not in cfg]
    if missing:
        raise ValueError(f"{path}: missing {', '.join(missing)}, needed to count a {kind} "
                         "model; fix the config or pass the parameter count (--params 7B)")
    vocab, d, inter, layers, heads = (whole(k) for k in _REQUIRED)
    kv = whole("num_key_value_heads", heads)
    head_dim = cfg.get("head_dim")
    if head_dim is None:
        if d % heads:
            raise ValueError(f"{path}: hidden_size {d} is not a multiple of num_attention_heads "
                             f"{heads} and there is no head_dim; fix the config or pass the "
                             "parameter count (--params 7B)")
        head_dim = d // heads
    else:
        head_dim = whole("head_dim")
    family = _FAMILIES[kind]
    qkv_bias = family["qkv_bias"]
    if qkv_bias is None:
        qkv_bias = bool(cfg.get("attention_bias", False))
    q, k = heads * head_dim, kv * head_dim
    attn = d * q + 2 * d * k + q * d + (q + 2 * k if qkv_bias else 0)
    if kind == "llama" and cfg.get("attention_bias"):
        attn += d  # (Llama's o_proj takes the bias too)
    mlp = 3 * d * inter + ((2 * inter + d) if cfg.get("mlp_bias") else 0)
    norms = 2 * d + (2 * head_dim if family["qk_norm"] else 0)
    tied = bool(cfg.get("tie_word_embeddings", False))
    numel = vocab * d + layers * (attn + mlp + norms) + d + (0 if tied else vocab * d)
    largest = max(vocab * d, d * inter, d * q, d * k)
    return ModelSize(numel=numel, largest=largest, source=f"{path} ({kind})")


def plan(
    size: ModelSize,
    optimizer_name: str = "adamw",
    *,
    recipe_names: tuple[str, ...] | None = None,
    cards: tuple[int, ...] = CARDS,
) -> list[dict[str, Any]]:
    """GiB of each recipe's tensors at a step's peak for a model of ``size``, without and with
    ``step_in_backward``.

    From ``memory.expected(optimizer_name, recipe)`` per element, every parameter taken as large
    enough for 8-bit state and in the recipe's weight dtype: weights, optimizer state and master
    are ``numel`` times their figure; gradients too without ``step_in_backward``, and with it the
    largest parameter's (``size.largest``, 0 where unknown).

    Returns:
        One dict per recipe and mode: ``"recipe"``, ``"in_backward"``, ``"recipe_in_backward"``
        (the recipe's own choice), ``"bytes_per_param"`` (``expected()``'s dict),
        ``"gib"`` (``weights``, ``grads``, ``optimizer_state``, ``master``, ``total``),
        ``"fits"`` (card GiB -> bool) and ``"refused"``: None, or why the recipe cannot step in
        backward (the recipe's own check: a loss scaler cannot skip a step already taken),
        where ``"gib"`` and ``"fits"`` are None.
    """
    from lowprec import memory, recipes

    names = recipe_names if recipe_names is not None else recipes.RECIPES
    rows: list[dict[str, Any]] = []
    for name in names:
        e = memory.expected(optimizer_name, name)
        recipe = recipes.get(name)
        own = bool(getattr(recipe, "step_in_backward", False))
        for mode in (False, True):
            refused = in_backward_refusal(recipe) if mode else None
            if refused is not None:
                rows.append({"recipe": name, "in_backward": mode, "recipe_in_backward": own,
                             "bytes_per_param": e, "gib": None, "fits": None,
                             "refused": refused})
                continue
            # (a gradient has its parameter's dtype: expected() gives a recipe stepping in
            # backward none per element, so the weights' size is the one to take)
            grads = e["weights"] * (size.numel if not mode else (size.largest or 0))
            b = {"weights": e["weights"] * size.numel, "grads": grads,
                 "optimizer_state": e["optimizer_state"] * size.numel,
                 "master": e["master"] * size.numel}
            b["total"] = sum(b.values())
            gib = {k: v / 2**30 for k, v in b.items()}
            rows.append({"recipe": name, "in_backward": mode, "recipe_in_backward": own,
                         "bytes_per_param": e, "gib": gib,
                         "fits": {c: gib["total"] <= c for c in cards}, "refused": None})
    return rows


def in_backward_refusal(recipe: Any) -> str | None:
    """Why ``recipe`` cannot step in backward, by its own check (``Recipe.__post_init__``), or
    None where it can."""
    if getattr(recipe, "step_in_backward", False):
        return None
    try:
        replace(recipe, step_in_backward=True)
    except TypeError:  # (a Recipe without the field: nothing to check it by)
        return None
    except ValueError as exc:
        return str(exc)
    return None
