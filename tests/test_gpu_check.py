"""tools/gpu_check.py: skips cleanly without CUDA and its measurements run (on the CPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parent.parent / "tools" / "gpu_check.py"


def run_script(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_skips_cleanly_without_cuda() -> None:
    result = run_script()
    assert result.returncode == 0, result.stderr
    assert "skipped: no CUDA device" in result.stdout


def test_cpu_smoke_run_measures_every_section(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    result = run_script(
        "--device", "cpu", "--state-gib", "0.01", "--repeats", "1", "--out", str(out),
        "--scratch", str(tmp_path),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert report["staging"]["bytes"] > 0
    assert report["staging"]["stager_gbps"] > 0 and report["staging"]["plain_copy_gbps"] > 0
    assert report["stall_state_bytes"] > 0
    for section in ("manager", "dcp", "hook"):
        assert report[section]["stall_median_s"] > 0, section
    assert len(report["hook"]["stall_s"]) == 1  # one save per repeat, each timed
    assert len(report["manager"]["sync_save_s"]) == 1
    assert report["exact_resume"] == {"bitwise_equal": True, "mismatched": [], "device": "cpu"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]  # scratch cleaned
