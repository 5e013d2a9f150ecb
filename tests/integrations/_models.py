"""Tiny Hugging Face language models and a learnable synthetic dataset for integration tests.

Nothing is downloaded: the models are built from configs with random initial weights. Importing
this module needs ``transformers``; the test modules skip before importing it where it is absent.
"""

from __future__ import annotations

import math

import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import lowprec

VOCAB = 128
SEQ = 32
#: The five master-weight strategies, "none" being the naive BF16 baseline.
MASTERS = ("none", "kahan", "split", "stochastic", "fp32")
#: The strategies that keep (exactly or nearly) what FP32 would: "none" loses small updates.
KEEPING = ("kahan", "split", "stochastic", "fp32")

transformers.logging.set_verbosity_error()


def gpt2(seed: int = 0, dtype: torch.dtype = torch.float32) -> GPT2LMHeadModel:
    """A 2-layer, width-64 GPT-2 (tied ``lm_head``/``wte``, LayerNorms), no dropout."""
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=0, eos_token_id=None, pad_token_id=0, loss_type="ForCausalLM",
    )
    torch.manual_seed(seed)
    return GPT2LMHeadModel(config).to(dtype)


def llama(seed: int = 0, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    """A 2-layer, width-64 Llama (RoPE, RMSNorm, untied head)."""
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=SEQ,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=None, pad_token_id=0,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(dtype)


class Progressions(torch.utils.data.Dataset):
    """Arithmetic progressions mod ``VOCAB``: a random start and a step of 1, 2 or 3.

    After two tokens the rest of a sequence is determined, so the loss can fall from
    ln(128) ~ 4.85 to ~0.2; a tiny model gets well below 3 within a few dozen steps.
    """

    def __init__(self, n: int = 256, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (n, 1), generator=gen)
        step = torch.randint(1, 4, (n, 1), generator=gen)
        self.ids = (start + step * torch.arange(SEQ)) % VOCAB

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}

    def batch(self, n: int | None = None) -> dict[str, torch.Tensor]:
        ids = self.ids[:n]
        return {"input_ids": ids, "labels": ids}


def eval_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> float:
    """The model's loss on ``batch`` without gradients."""
    device = next(model.parameters()).device
    batch = {k: v.to(device) for k, v in batch.items()}
    was_training = model.training
    model.eval()
    with torch.no_grad():
        loss = float(model(**batch).loss)
    model.train(was_training)
    assert math.isfinite(loss)
    return loss


def trained_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Detached copies of the named parameters, on the CPU."""
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


def moved_apart(got: dict, want: dict, start: dict) -> float:
    """How far two runs from ``start`` ended apart, relative to how far ``want`` moved: the norm
    of ``got - want`` over the norm of ``want - start``, over all parameters."""

    def norm(ts) -> float:
        return float(torch.linalg.vector_norm(torch.stack(
            [torch.linalg.vector_norm(t.double()) for t in ts])))

    return norm([got[k] - want[k] for k in want]) / norm([want[k] - start[k] for k in want])


def masters(model: torch.nn.Module, opt: lowprec.optim.LowPrecisionOptimizer) -> dict:
    """``opt.master_weight(p)`` for each named parameter of ``model``."""
    return {n: opt.master_weight(p) for n, p in model.named_parameters()}


def assert_bit_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str):
    """Every tensor of ``got`` has the dtype and the bits of ``want``'s."""
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].dtype == want[name].dtype, f"{what} {name}: dtype differs"
        assert torch.equal(got[name], want[name]), (
            f"{what} {name}: differs from the reference in "
            f"{int((got[name] != want[name]).sum())} of {want[name].numel()} elements"
        )


def state_tensors(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every tensor of ``opt.state_dict()["state"]``, keyed ``"index/name"``."""
    out = {}
    for index, entry in opt.state_dict()["state"].items():
        for name, value in entry.items():
            if isinstance(value, torch.Tensor):
                out[f"{index}/{name}"] = value.detach().clone()
    return out


def reset_accelerate_state() -> None:
    """Forget accelerate's process-wide singletons, as accelerate's own tests do between tests
    (an ``Accelerator`` with other settings than an earlier one's refuses to start otherwise)."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
