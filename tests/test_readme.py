"""The README's usage example runs as written, and its commands name what the project ships."""

from __future__ import annotations

import re
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_usage_example_runs():
    usage = README.split("## Usage", 1)[1]
    code = re.search(r"```python\n(.*?)```", usage, re.S).group(1)
    gen = torch.Generator().manual_seed(0)
    loader = [(torch.randn(8, 512, generator=gen), torch.randint(0, 10, (8,), generator=gen))
              for _ in range(3)]
    scope: dict = {"loader": loader}
    exec(compile(code, "README.md", "exec"), scope)
    weights = scope["fp32_weights"]
    assert weights and all(w.dtype == torch.float32 for w in weights.values())
    assert torch.isfinite(scope["loss"])


def test_the_readme_is_a_landing_page():
    # The details live on the docs site's pages (docs/, mkdocs.yml), which it links to.
    assert len(README.splitlines()) <= 200, "README.md: at most 200 lines; details go to docs/"
    assert 'pip install -e ".[docs]" && mkdocs serve' in README
    assert "(docs/getting-started.md)" in README and "(docs/fidelity.md)" in README


def test_setup_commands_match_the_project():
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'lowprec = "lowprec.cli.main:entry_point"' in pyproject
    extras = [e for group in re.findall(r'-e "\.\[([\w,]+)\]"', README) for e in group.split(",")]
    assert "integrations" in extras  # the test command installs the frameworks' tests' needs
    for extra in extras:
        assert re.search(rf"^{extra} = \[", pyproject, re.M), extra
    assert ".venv/bin/lowprec compare" in README and ".venv/bin/python -m pytest" in README


def test_ci_runs_the_readmes_test_command():
    # (both pytest runs: the single-process tests under pytest-xdist, the multi-process alone)
    line = next(ln for ln in README.splitlines() if ln.startswith("python3 -m venv")
                and "[dev,integrations]" in ln)
    runs = [r.strip() for r in line.split("&&") if "-m pytest" in r]
    ci = (ROOT / ".ci" / "run").read_text()
    assert len(runs) == 2
    for run in runs:
        assert run.replace(".venv/bin/python", '"$venv/bin/python"') in ci.splitlines(), run
