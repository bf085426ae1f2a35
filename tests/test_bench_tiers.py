"""The tiers benchmark scenario (``python -m fastckpt.bench tiers``) runs end to end on a tiny
state: a local moto server, every configuration (fast tier alone, fast+s3, s3, the throttled
directory, fast+throttled) at two checkpoint intervals, restores from every tier checked
bitwise; the JSON and markdown land in ``--out`` with every row and both targets. No
wall-clock figure is asserted (benchmarks are not timed tests). The throttled directory's
backend is tested on its own too: what it stores loads back bitwise, and its pacing holds a
transfer to the cap."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

CONFIGS = ("fast", "fast+s3", "s3", "throttled", "fast+throttled")


@pytest.fixture(autouse=True)
def _schemes_restored() -> Iterator[None]:
    """The bench registers its ``throttled://`` scheme in this process: take it out again
    after each test, so that later tests see only the package's own schemes."""
    from fastckpt.storage import registry

    before = dict(registry.SCHEMES)
    yield
    registry.SCHEMES.clear()
    registry.SCHEMES.update(before)


TIERS = ("ram", "disk", "s3", "throttled")


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def test_the_tiers_scenario_runs_and_reports_every_figure(tmp_path: Path) -> None:
    pytest.importorskip("moto")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    command = [sys.executable, "-m", "fastckpt.bench", "tiers", "--server", "moto"]
    command += ["--size-mib", "2", "--repeats", "1", "--intervals", "1,10"]
    command += ["--lead-in", "3", "--quiet-tail", "2", "--baseline-steps", "5"]
    command += ["--out", str(tmp_path / "out")]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-4000:]
    json_path = tmp_path / "out" / "tiers-2mib-moto.json"
    md_path = json_path.with_suffix(".md")
    assert json_path.is_file() and md_path.is_file()
    document = json.loads(json_path.read_text())
    assert document["scenario"] == "tiers"
    assert document["server_kind"] == "moto"
    assert document["promote_every"] == {"1": 50, "10": 5}
    assert 0 < document["model"]["state_bytes"] < 4 << 20
    assert set(document["configs"]) == set(CONFIGS)
    for kind, summary in document["configs"].items():
        assert set(summary["intervals"]) == {"1", "10"}, kind
        for interval, entry in summary["intervals"].items():
            assert entry["errors"] == [], (kind, interval, entry["errors"])
            for measure in ("baseline_overhead", "in_run_overhead"):
                assert _finite(entry[measure]["median"]), (kind, interval, measure, entry)
            # with promotion: promote_every (50 and 5) capped at 5; without: at 2
            assert entry["checkpoints_per_run"] == (5 if "+" in kind else 2), (kind, interval)
            stall = entry["stall_s"]["median"]
            assert _finite(stall) and stall >= 0, (kind, interval, entry)
            if "+" in kind:  # the run's first index was promoted, or the report says why not
                assert entry["promote_every"] == {"1": 50, "10": 5}[interval]
                pruned = any("pruned before it was promoted" in w for w in entry["warnings"])
                assert entry["promoted_per_run"] == [1] or pruned, (kind, interval, entry)
            else:
                assert entry["promote_every"] is None
        assert set(summary["shortest_under_1pct"]) == {"baseline_overhead", "in_run_overhead"}
    runs = document["raw"]["runs"]
    assert len(runs) == len(CONFIGS) * 2
    for row in runs:
        assert row["steps"] > (row["checkpoints"] - 1) * row["interval"], row
        assert row["seconds"] > 0 and row["quiet_steps"] >= 1, row
        assert len(row["stall_s"]) == row["checkpoints"], row
        assert row["promotion_healthy"] and row["error"] is None, row
    assert len(document["raw"]["baselines"]) == 2
    restore = document["restore"]
    assert set(restore["tiers"]) == set(TIERS)
    for tier, row in restore["tiers"].items():
        assert row["verified"] == [True], (tier, row["mismatches"])
        assert len(row["seconds"]) == 1 and len(row["read_seconds"]) == 1, tier
        for key in ("gib_s", "vs_memcpy", "read_gib_s", "read_vs_memcpy", "prune_s"):
            assert _finite(row[key]) and row[key] > 0, (tier, key, row)
    assert _finite(restore["memcpy"]["gib_s"]) and restore["memcpy"]["gib_s"] > 0
    targets = document["targets"]
    assert set(targets) == {"overhead_every_10_steps", "ram_restore_vs_memcpy"}
    assert targets["overhead_every_10_steps"]["verdict"] in ("met", "missed", "inconclusive")
    assert targets["ram_restore_vs_memcpy"]["verdict"] in ("met", "missed")
    assert document["load_average"]["before"] is not None
    assert "environment" in document and "versions" in document
    table = md_path.read_text()
    for kind in CONFIGS:
        assert f"| {kind} | vs baseline |" in table and f"| {kind} | in-run |" in table
    for tier in TIERS:
        assert f"| {tier} |" in table
    assert "MISMATCH" not in table and "failed" not in table
    assert "stand-in for a shared filesystem" in table
    assert not list(tmp_path.glob("fastckpt-tiers-*"))  # the scratch roots were removed
    assert not (tmp_path / "s3:").exists() and not (tmp_path / "throttled:").exists()


def test_the_throttled_directory_stores_bitwise_and_holds_the_cap(tmp_path: Path) -> None:
    import torch

    import fastckpt
    from fastckpt.bench import throttled

    root = throttled.url_for(tmp_path / "share") + "/root"
    fastckpt.configure_storage(throttled.url_for(tmp_path / "share"), write_mib_s=8, burst_mib=1)
    try:
        module = torch.nn.Linear(512, 1024)  # 2 MiB of weights
        start = time.monotonic()
        fastckpt.save_checkpoint(root, models={"main": (module, None)})
        seconds = time.monotonic() - start
        loaded = fastckpt.load_checkpoint(root)["models"]["main"]["model"]
    finally:
        fastckpt.configure_storage(throttled.url_for(tmp_path / "share"))
    assert torch.equal(loaded.weight, module.weight) and torch.equal(loaded.bias, module.bias)
    # 2 MiB through an 8 MiB/s link with a 1 MiB burst: at least (2 - 1) / 8 s.
    assert seconds >= 0.1
    files = [p for p in (tmp_path / "share" / "root").rglob("*") if p.is_file()]
    assert any(p.name == "manifest.json" for p in files)
    assert not (tmp_path / "throttled:").exists()


def test_a_pacer_shares_its_rate_between_transfers() -> None:
    from fastckpt.bench.throttled import Pacer

    pacer = Pacer(100 * 2**20, burst_bytes=0)
    first = pacer.reserve(10 * 2**20)
    second = pacer.reserve(10 * 2**20)
    assert second - first == pytest.approx(0.1, rel=1e-6)  # queued behind the first
    assert pacer.bytes == 20 * 2**20
