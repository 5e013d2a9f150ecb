"""Will BF16 hurt this image classifier? ``lowprec.compare`` on a ResNet with BatchNorm.

The classifier is Hugging Face's ``ResNetForImageClassification`` built from a config (nothing
downloaded; any ``nn.Module`` returning logits, or an output with ``.logits``, works the same).
The images are synthetic and learnable: each class a faint square (0.15 over noise of
standard deviation 1) in its own place.
It is trained a little in FP32, then fine-tuned at a small learning rate under each recipe from
those FP32 weights::

    python examples/compare_vision.py                    # 3 seeds
    python examples/compare_vision.py --small --seeds 1  # seconds: what the test runs

The batches are ``(images, labels)`` tuples, so the loss is the default: cross-entropy of the
model's logits against the batch's last element. BatchNorm keeps its running statistics in FP32
under every recipe (the recipes keep norm layers in FP32).
"""

from __future__ import annotations

import argparse

import torch
import transformers
from transformers import ResNetConfig, ResNetForImageClassification

import lowprec

transformers.logging.set_verbosity_error()

CLASSES = 4


def images(n: int, batch: int, size: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` batches: noise with a faint square in the label's quadrant."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    half = size // 2
    for _ in range(n):
        labels = torch.randint(0, CLASSES, (batch,), generator=gen)
        x = torch.randn(batch, 3, size, size, generator=gen)
        for i, c in enumerate(labels.tolist()):
            r, col = (c // 2) * half, (c % 2) * half
            x[i, :, r + 2:r + half - 2, col + 2:col + half - 2] += 0.15
        out.append((x, labels))
    return out


def build(small: bool) -> ResNetForImageClassification:
    config = ResNetConfig(num_channels=3, embedding_size=8 if small else 32,
                          hidden_sizes=[8, 16] if small else [32, 64, 128],
                          depths=[1, 1] if small else [2, 2, 2], layer_type="basic",
                          num_labels=CLASSES)
    torch.manual_seed(0)
    return ResNetForImageClassification(config)


def pretrain(model: torch.nn.Module, steps: int, size: int) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for x, y in images(steps, 32, size, seed=1234):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x).logits, y).backward()
        opt.step()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="a tiny model and run (seconds)")
    parser.add_argument("--steps", type=int, default=None, help="fine-tuning steps")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--lr", type=float, default=3e-5, help="the fine-tuning rate")
    parser.add_argument("--json", help="write the comparison there")
    args = parser.parse_args()
    size = 16 if args.small else 32
    model = build(args.small)
    pretrain(model, 4 if args.small else 100, size)
    steps = args.steps or (4 if args.small else 200)
    result = lowprec.compare(
        model, lambda seed: images(steps, 32, size, seed), images(4, 64, size, seed=10_000),
        steps=steps, seeds=args.seeds, lr=args.lr,
        recipes=["fp32", "bf16", "bf16-kahan", "bf16-split", "bf16-sr"],
        fused=False if args.small else None, device="cpu" if args.small else "auto",
        monitor_every=2 if args.small else 10)
    print(result)
    if args.json:
        result.to_json(args.json)


if __name__ == "__main__":
    main()
