"""torch_checkpointing's ``version`` surface in fastckpt, and the peer-suite alias script.

``fastckpt.version`` has the names of ``torch_checkpointing.version`` (``__version__``,
``get_version()``, ``Version``, ``UNKNOWN``) and reports the installed fastckpt-io. The alias
run of the peers' own suites (``tools/peer_suites.py``) needs their sdists; it is exercised only
where the wheelhouse holds torch_checkpointing's, and skipped otherwise (no network here).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest

import fastckpt
import fastckpt.version

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "peer_suites.py"


def test_version_names_match_torch_checkpointings() -> None:
    module = fastckpt.version
    assert set(module.__all__) >= {"__version__", "get_version", "Version", "UNKNOWN"}
    assert module.UNKNOWN == "Unknown"
    assert module.DISTRIBUTION == "fastckpt-io"
    for name in ("get_version", "Version"):
        assert getattr(module, name).__doc__


def test_version_reports_the_installed_distribution() -> None:
    try:
        installed = importlib.metadata.version("fastckpt-io")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("fastckpt-io is not installed (source tree on sys.path)")
    assert fastckpt.version.__version__ == installed == fastckpt.__version__
    version = fastckpt.version.get_version()
    assert version is not None and version.get_full_version() == installed


@pytest.mark.parametrize(
    ("text", "release", "sha"),
    [
        ("1.2.3+abc123def456", "1.2.3", "abc123def456"),
        ("2.0.1", "2.0.1", None),
        ("1.0.0+sha+extra", "1.0.0", "sha+extra"),
        ("1.0.0+", "1.0.0", ""),
    ],
)
def test_version_class_splits_at_the_first_plus(text: str, release: str, sha: str | None) -> None:
    version = fastckpt.version.Version(text)
    assert version.get_version() == release
    assert version.get_full_version() == text
    assert version.get_sha() == sha
    assert str(version) == text
    assert repr(version) == f"Version('{text}')"


def test_reload_rereads_the_metadata_and_unknown_gives_none() -> None:
    module = fastckpt.version
    try:
        with mock.patch("importlib.metadata.version", return_value="9.8.7+cafe") as read:
            importlib.reload(module)
            read.assert_called_with("fastckpt-io")
            assert module.__version__ == "9.8.7+cafe"
            found = module.get_version()
            assert found is not None and found.get_sha() == "cafe"
        missing = importlib.metadata.PackageNotFoundError("fastckpt-io")
        with mock.patch("importlib.metadata.version", side_effect=missing):
            importlib.reload(module)
            assert module.__version__ == module.UNKNOWN
            assert module.get_version() is None
    finally:
        importlib.reload(module)


def test_fastckpt_version_resolves_from_a_bare_import() -> None:
    code = "import fastckpt; print(fastckpt.version.get_version())"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(fastckpt.version.get_version())


def _sdist(name: str) -> Path | None:
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        peer_suites = importlib.import_module("peer_suites")
    finally:
        sys.path.remove(str(SCRIPT.parent))
    suite = peer_suites.SUITES[name]
    found: Path | None = peer_suites.find_sdist(suite, None, download=False)
    return found


def test_torch_checkpointing_suite_runs_through_the_alias(tmp_path: Path) -> None:
    """The whole public-API suite runs; the version tests reach fastckpt.version and pass up to
    the package name they expect, and the round trips pass."""
    import torch

    if tuple(int(p) for p in torch.__version__.split(".")[:2]) < (2, 11):
        pytest.skip("torch_checkpointing 0.1.1 needs torch 2.11 or newer")
    if _sdist("torch_checkpointing") is None:
        pytest.skip("the wheelhouse has no torch_checkpointing sdist (tools/peer_suites.py)")
    record = tmp_path / "record.json"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "torch_checkpointing", "--json", str(record)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    tests = json.loads(record.read_text())["torch_checkpointing"]["tests"]
    assert all(entry["reached_fastckpt"] for entry in tests.values())
    for name in ("test_sync_save_then_load_round_trip", "test_async_save_then_load_round_trip"):
        assert tests[f"tests/test_checkpoint_manager.py::{name}"]["outcome"] == "passed"
    versions = {k: v for k, v in tests.items() if k.startswith("tests/test_version.py::")}
    assert len(versions) == 6
    assert versions["tests/test_version.py::test_version_package_not_found_exception"][
        "outcome"
    ] == ("passed")
    for nodeid, entry in versions.items():
        if entry["outcome"] != "passed":  # only the last line: the package name it expects
            assert "expected call not found" in entry["message"], nodeid
