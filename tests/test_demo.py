"""``python -m fastckpt.demo`` runs its whole story: crash mid-save, resume, verify, measure."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_demo_kills_resumes_and_measures(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "fastckpt.demo", "--size-mib", "16", "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "killed with SIGKILL" in out
    assert "files verified (ok)" in out
    assert "weights equal the checkpoint: True" in out
    assert "torch.save+fsync" in out and "GiB/s" in out
    assert list(tmp_path.iterdir()) == []  # the demo cleans up after itself


def test_a_missing_dir_is_named_with_the_fix(tmp_path: Path) -> None:
    """``--dir`` naming no folder: one line naming it and the fix, exit 2. Before, a
    ``FileNotFoundError`` traceback from ``tempfile``."""
    missing = tmp_path / "nowhere"
    result = subprocess.run(
        [sys.executable, "-m", "fastckpt.demo", "--dir", str(missing)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert f"--dir {missing}: no such folder" in result.stderr
    assert "Traceback" not in result.stderr
