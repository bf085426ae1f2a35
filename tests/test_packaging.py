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
        # "." is this project's checkout (a source install); anything else must name the dist
        assert target == "." or target.startswith(("fastckpt-io", "dist/fastckpt_io-")), (
            f"{name}:{number}"
        )
    readme = (ROOT / "README.md").read_text()
    assert "pip install fastckpt-io" in readme


def test_python_versions_claimed_are_the_tested_ones() -> None:
    """requires-python and the classifiers agree: CPython 3.11 and newer (one abi3 wheel),
    3.11, 3.12 and 3.13 named because tests/test_wheel.py installs the wheel on each; 3.10 is
    refused (its refusal is tested there too)."""
    claimed = SpecifierSet(PROJECT["requires-python"])
    running = Version(f"{sys.version_info.major}.{sys.version_info.minor}")
    assert running in claimed, "the test suite must run on a claimed Python"
    assert PROJECT["requires-python"] == ">=3.11"
    assert Version("3.10") not in claimed
    assert all(Version(v) in claimed for v in ("3.11", "3.12", "3.13"))
    classifiers = [c for c in PROJECT["classifiers"] if re.fullmatch(r".*Python :: 3\.\d+", c)]
    assert [c.rsplit(" ", 1)[1] for c in classifiers] == ["3.11", "3.12", "3.13"]


def _lower_bounds() -> dict[str, str]:
    """Runtime dependency -> its ``>=`` lower bound, as pyproject.toml states it."""
    bounds = {}
    for text in PROJECT["dependencies"]:
        req = Requirement(text)
        (lower,) = [s.version for s in req.specifier if s.operator == ">="]
        bounds[req.name] = lower
    return bounds


def test_lowest_bounds_are_what_the_lowest_venv_installs() -> None:
    """`make test-lowest` pins exactly pyproject.toml's lower bounds (tools/deps.py reads
    them), and they are the ones issue 24 asks for: torch 2.9 or older, numpy 1.x."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "deps.py"), "lowest"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    pins = dict(line.split("==") for line in done.stdout.split())
    bounds = _lower_bounds()
    assert {k: v for k, v in pins.items() if k in bounds} == bounds
    assert set(pins) - set(bounds) == {"pytest", "pytest-timeout", "pytest-xdist"}
    assert Version(bounds["torch"]) <= Version("2.9.0")
    assert Version(bounds["numpy"]) < Version("2")


def test_make_test_runs_the_matrix() -> None:
    """`make test` (CI's .ci/run) includes the aarch64 tests under qemu and the focused suite
    on the lowest bounds, whose test files exist and cover the areas the bounds are about."""
    makefile = (ROOT / "Makefile").read_text()
    (test_line,) = [line for line in makefile.splitlines() if line.startswith("test:")]
    assert {"wheel", "cargo-test", "cargo-test-aarch64", "pytest", "test-lowest"} <= set(
        test_line.split()[1:]
    )
    match = re.search(r"^LOWEST_TESTS := ((?:.*\\\n)*.*)$", makefile, re.MULTILINE)
    assert match, "LOWEST_TESTS not found"
    files = match[1].replace("\\\n", " ").split()
    assert files and all((ROOT / f).is_file() for f in files), files
    for area in ("files", "checkpoint", "manager", "strategy", "dcp", "staging", "sharded"):
        assert any(area in f for f in files), area
    assert "tools/deps.py lowest" in makefile and "--only-binary" in makefile


def test_the_lowest_venv_holds_the_lower_bounds() -> None:
    """Where `make test-lowest` has run, .venv-min really has those versions (on CPython
    3.11, the oldest claimed)."""
    python = ROOT / ".venv-min" / "bin" / "python"
    if not (ROOT / ".venv-min" / ".deps-installed").exists():
        pytest.skip("make test-lowest has not run in this checkout")
    code = (
        "import sys, importlib.metadata as m; "
        "print('%d.%d' % sys.version_info[:2], *(m.version(n) for n in sys.argv[1:]))"
    )
    bounds = _lower_bounds()
    done = subprocess.run(
        [str(python), "-c", code, *bounds], capture_output=True, text=True, check=True
    )
    python_version, *versions = done.stdout.split()
    assert python_version == "3.11"
    assert [Version(v).base_version for v in versions] == [
        Version(b).base_version for b in bounds.values()
    ]


def test_readme_install_matrix_matches_the_claims() -> None:
    """The README's install matrix names every claimed Python, both architectures, and the
    lower bounds pyproject.toml states."""
    readme = (ROOT / "README.md").read_text()
    start = readme.index("### Install matrix")
    section = readme[start : readme.index("\n## ", start)]
    for python in ("3.11", "3.12", "3.13", "3.10"):
        assert python in section, python
    for arch in ("x86_64", "aarch64"):
        assert arch in section, arch
    for name, bound in _lower_bounds().items():
        assert f"{name} {bound}" in section, (name, bound)


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
    assert "fastckpt needs CPython 3.11 or newer" in result.stderr
    assert "PYTHON=python3.11" in result.stderr
    assert not (venv / ".deps-installed").exists()
    assert "tomllib" not in result.stderr
