"""Will BF16 hurt fine-tuning this model? ``lowprec.compare`` on a Hugging Face Llama.

The model is a Llama built from a config (nothing downloaded), byte-level, trained in FP32 on a
text of your own (``--text FILE``; by default the standard library's sources), then fine-tuned
at a small learning rate on a second text (``--finetune-text``; by default Python's English help
texts) under each recipe, every one starting from those FP32 weights::

    python examples/compare_llama.py                    # ~3M parameters, 3 seeds
    python examples/compare_llama.py --small --seeds 1  # seconds: what the test runs
    lowprec compare --task examples/compare_llama.py:task   # the same task, from the command

The batches are dicts (``input_ids``, ``labels``), so the loss is the model's own
(``model(**batch).loss``). The table shows each recipe's eval loss against FP32's, the updates
it lost, and which parameters plain BF16 loses most of.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

import lowprec
from lowprec.comparison.task import Task, load_prose, load_text

transformers.logging.set_verbosity_error()


def windows(text: torch.Tensor, n: int, batch: int, context: int, seed: int) -> list[dict]:
    """``n`` batches of random windows of the byte ``text``, as a causal LM takes them."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        starts = torch.randint(0, len(text) - context, (batch,), generator=gen)
        ids = text[starts[:, None] + torch.arange(context)].long()
        out.append({"input_ids": ids, "labels": ids})
    return out


def build(small: bool) -> LlamaForCausalLM:
    width, layers = (32, 1) if small else (256, 4)
    config = LlamaConfig(vocab_size=256, hidden_size=width, intermediate_size=2 * width,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=128, tie_word_embeddings=False,
                         bos_token_id=0, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def pretrain(model: LlamaForCausalLM, text: torch.Tensor, steps: int, context: int) -> float:
    """Train ``model`` in FP32 with torch's AdamW; returns the last step's loss."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-3, total_steps=steps)
    loss = math.nan
    for batch in windows(text, steps, 16, context, seed=1234):
        opt.zero_grad()
        out = model(**batch)
        out.loss.backward()
        opt.step()
        sched.step()
        loss = float(out.loss.detach())
    return loss


def task(small: bool = False, text: str | None = None, finetune_text: str | None = None,
         pretrain_steps: int | None = None) -> Task:
    """The fine-tuning task: the Llama pretrained in FP32, and batches of the second text."""
    context = 16 if small else 64
    first = load_text() if text is None else _bytes(text)
    second = load_prose() if finetune_text is None else _bytes(finetune_text)
    cut = int(len(second) * 0.9)
    model = build(small)
    pretrain(model, first, pretrain_steps or (4 if small else 400), context)
    return Task(model=lambda seed: model,
                train=lambda seed: windows(second[:cut], 500, 16, context, seed),
                eval=windows(second[cut:], 4 if small else 16, 16, context, seed=10_000),
                name="Llama fine-tuning")


def _bytes(path: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(Path(path).read_bytes()), dtype=torch.uint8).clone()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="a tiny model and run (seconds)")
    parser.add_argument("--text", help="the FP32 pretraining text (default: stdlib sources)")
    parser.add_argument("--finetune-text", help="the fine-tuning text (default: Python's help)")
    parser.add_argument("--steps", type=int, default=None, help="fine-tuning steps")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--lr", type=float, default=3e-5, help="the fine-tuning rate")
    parser.add_argument("--json", help="write the comparison there")
    args = parser.parse_args()
    t = task(args.small, args.text, args.finetune_text)
    steps = args.steps or (4 if args.small else 300)
    result = lowprec.compare(
        t.model(0), t.train, t.eval, loss=t.loss, steps=steps, seeds=args.seeds, lr=args.lr,
        recipes=["fp32", "bf16", "bf16-kahan", "bf16-split", "bf16-sr"],
        fused=False if args.small else None, device="cpu" if args.small else "auto",
        monitor_every=2 if args.small else 10)
    print(result)
    if args.json:
        result.to_json(args.json)


if __name__ == "__main__":
    main()
