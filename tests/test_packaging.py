"""Packaging promises: the distribution name users read, the Python versions and dependency
bounds claimed, the license, README links that work on a package index page, and the
Makefile's interpreter check."""

from __future__ import annotations

import importlib.metadata as metadata
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
DIST = "fastckpt-io"
USER_TEXTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_distribution_name_is_the_free_one_everywhere() -> None:
    """`fastckpt` on PyPI is another project: every install line names fastckpt-io."""
    assert PROJECT["name"] == DIST
    install_lines = []
    for path in USER_TEXTS:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for match in re.finditer(r"pip install\s+(?:-\S+\s+)*'?([A-Za-z0-9_.\-\[\]/*]+)", line):
                install_lines.append((path.name, number, match[1]))
    assert install_lines, "README/docs should say how to install"
    for name, number, target in install_lines:
        assert target.startswith(("fastckpt-io", "dist/fastckpt_io-")), f"{name}:{number}"
    readme = (ROOT / "README.md").read_text()
    assert "pip install fastckpt-io" in readme


def test_python_versions_claimed_are_the_tested_one() -> None:
    claimed = SpecifierSet(PROJECT["requires-python"])
    running = Version(f"{sys.version_info.major}.{sys.version_info.minor}")
    assert running in claimed, "the test suite must run on a claimed Python"
    assert Version("3.10") not in claimed, "3.10 has no torch 2.15 wheels and is not tested"
    classifiers = [c for c in PROJECT["classifiers"] if re.fullmatch(r".*Python :: 3\.\d+", c)]
    assert [c.rsplit(" ", 1)[1] for c in classifiers] == ["3.11"]


def test_dependencies_have_lower_bounds_this_run_satisfies() -> None:
    """Every runtime and extra dependency declares a lower bound (set to the version the
    suite ran against), and the versions this run tests satisfy every bound."""
    groups = {"runtime": PROJECT["dependencies"], **PROJECT["optional-dependencies"]}
    for group, requirements in groups.items():
        for text in requirements:
            req = Requirement(text)
            lower = [s for s in req.specifier if s.operator in (">=", "==", "~=")]
            assert lower, f"{group}: {text} has no lower bound"
            try:
                installed = metadata.version(req.name)
            except metadata.PackageNotFoundError:
                continue  # an extra another part of the project installs on demand
            assert req.specifier.contains(installed, prereleases=True), (text, installed)


def test_matplotlib_is_an_extra_not_a_requirement() -> None:
    assert not any(Requirement(r).name == "matplotlib" for r in PROJECT["dependencies"])
    assert [Requirement(r).name for r in PROJECT["optional-dependencies"]["plot"]] == ["matplotlib"]


def test_license_file_is_apache_2() -> None:
    text = (ROOT / "LICENSE").read_text()
    assert PROJECT["license"] == "Apache-2.0" and PROJECT["license-files"] == ["LICENSE"]
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    for section in ("1. Definitions.", "7. Disclaimer of Warranty.", "END OF TERMS AND CONDITIONS"):
        assert section in text


def test_readme_links_are_absolute() -> None:
    """The README is the package index page, where relative links break."""
    readme = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)]+)\)", readme) + re.findall(r'(?:href|src)="([^"]+)"', readme)
    relative = [t for t in targets if not re.match(r"https?://", t)]
    assert relative == []


def _runs(python: str) -> bool:
    try:
        return (
            subprocess.run([python, "--version"], capture_output=True, timeout=60).returncode == 0
        )
    except OSError:
        return False


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_refuses_an_unsupported_python_before_installing(tmp_path: Path) -> None:
    """`make setup` with another interpreter stops at once with the fix, instead of failing
    minutes later (it used to die on `No module named 'tomllib'` under 3.10)."""
    candidates = ("/root/.pyenv/versions/3.10.13/bin/python", shutil.which("python3.10"))
    other = next((p for p in candidates if p and _runs(p)), None)
    if other is None:
        pytest.skip("no Python 3.10 interpreter on this machine")
    venv = tmp_path / "venv"
    result = subprocess.run(
        ["make", "--no-print-directory", f"VENV={venv}", f"PYTHON={other}", "setup"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode != 0
    assert "fastckpt needs CPython 3.11" in result.stderr
    assert "PYTHON=python3.11" in result.stderr
    assert not (venv / ".deps-installed").exists()
    assert "tomllib" not in result.stderr
