"""docs/integrations.md's examples run as written, each against its real framework."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.integration

PAGE = (Path(__file__).resolve().parents[2] / "docs" / "integrations.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", PAGE, re.S)


def _block(heading: str) -> str:
    """The first Python example under the page's section ``## heading``."""
    section = PAGE.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.fixture(autouse=True)
def _tmp_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # (the examples write their checkpoints where they run)


def _run(code: str) -> dict:
    scope: dict = {"__name__": "__docs__"}
    exec(compile(code, "docs/integrations.md", "exec"), scope)
    return scope


def test_the_page_has_one_example_per_framework():
    assert len(BLOCKS) == 3
    assert [_block(h) for h in ("Hugging Face Trainer", "Accelerate", "Lightning")] == BLOCKS


def test_trainer_example(monkeypatch):
    transformers = pytest.importorskip("transformers")
    ends = []  # the parameters after each trainer.train()
    train = transformers.Trainer.train

    def recorded(self, *args, **kwargs):
        out = train(self, *args, **kwargs)
        ends.append([p.detach().clone() for p in self.model.parameters()])
        return out

    monkeypatch.setattr(transformers.Trainer, "train", recorded)
    scope = _run(_block("Hugging Face Trainer"))
    trainer, fp32 = scope["trainer"], scope["fp32"]
    # The resumed run (checkpoint 4 -> 8) ends on the bits of the uninterrupted one before it.
    assert trainer.state.global_step == 8
    assert len(ends) == 2
    assert all(torch.equal(a, b) for a, b in zip(*ends, strict=True))
    opt = trainer.optimizer.optimizer
    assert type(opt).__name__ == "AdamW" and opt.param_groups[0]["master"] == "split"
    for name, p in trainer.model.named_parameters(remove_duplicate=False):
        assert fp32[name].dtype == torch.float32
        assert torch.equal(fp32[name], opt.master_weight(p)), name
    assert (Path("trainer-out") / "checkpoint-4" / "optimizer.pt").exists()


def test_accelerate_example():
    pytest.importorskip("accelerate")
    scope = _run(_block("Accelerate"))
    opt, fp32 = scope["opt"], scope["fp32"]
    assert Path("accelerate-ckpt").is_dir()
    steps = {int(st["step"]) for st in opt.optimizer.state.values()}
    assert steps == {4}  # 8 micro-batches, 2 per optimizer step
    assert all(t.dtype == torch.float32 for t in fp32.values() if t.is_floating_point())


def test_lightning_example():
    pytest.importorskip("lightning")
    scope = _run(_block("Lightning"))
    model, amp_model = scope["model"], scope["amp_model"]
    opt = model.trainer.optimizers[0]
    assert opt.param_groups[0]["master"] == "split"
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert {int(st["step"]) for st in opt.state.values()} == {40}
    # Under the FP16 plugin every step was taken but those the scaler backed off for.
    amp_opt = amp_model.trainer.optimizers[0]
    scaler = amp_model.trainer.precision_plugin.scaler
    assert type(scaler).__name__ == "LossScaler"
    skipped = round(torch.log2(torch.tensor(2.0**16 / scaler.get_scale())).item())
    assert {int(st["step"]) for st in amp_opt.state.values()} == {40 - skipped}
    assert all(p.dtype == torch.float32 for p in amp_model.parameters())
