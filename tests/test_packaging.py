"""The package's metadata: one version source, a license file, a changelog, and CI's checks of
the built wheel (.ci/wheel_check.sh builds and installs it; these tests check what it reads)."""

from __future__ import annotations

import re
from pathlib import Path

import lowprec
from lowprec.cli.parser import build_parser

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = (ROOT / "pyproject.toml").read_text()


def _project_table() -> str:
    return PYPROJECT.split("[project]\n", 1)[1].split("\n[", 1)[0]


def test_the_version_is_set_once():
    project = _project_table()
    assert re.search(r'^dynamic = \["version"\]', project, re.M)
    assert not re.search(r"^version\s*=", project, re.M), "a second version in pyproject.toml"
    assert 'version = { attr = "lowprec.__version__" }' in PYPROJECT
    init = (ROOT / "src" / "lowprec" / "__init__.py").read_text()
    assert re.findall(r'^__version__ = "([^"]+)"$', init, re.M) == [lowprec.__version__]


def test_the_command_prints_the_version(capsys):
    try:
        build_parser().parse_args(["--version"])
    except SystemExit as done:
        assert done.code == 0
    assert capsys.readouterr().out.strip() == f"lowprec {lowprec.__version__}"


def test_license_and_changelog_ship_with_the_metadata():
    project = _project_table()
    assert 'license = "Apache-2.0"' in project and 'license-files = ["LICENSE"]' in project
    assert "Apache License" in (ROOT / "LICENSE").read_text()
    assert re.search(r"^\[project\.urls\]$", PYPROJECT, re.M)
    assert "Typing :: Typed" in project
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert changelog.startswith("# Changelog") and "## [Unreleased]" in changelog
    headings = re.findall(r"^### (\w+)$", changelog, re.M)
    assert headings and set(headings) <= {"Added", "Changed", "Deprecated", "Removed", "Fixed",
                                          "Security"}


def test_ci_builds_installs_and_runs_the_wheel():
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'bash .ci/wheel_check.sh "$venv/bin/python"' in ci
    assert '"$venv/bin/mkdocs" build --strict' in ci and '"$venv/bin/mypy"' in ci
    check = (ROOT / ".ci" / "wheel_check.sh").read_text()
    for step in ("-m build", "twine check", '"$wheel[cli]"', "lowprec\" --version",
                 "lowprec\" compare --steps 5"):
        assert step in check, step
