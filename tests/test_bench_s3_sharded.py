"""The sharded-on-object-storage benchmark scenario (``python -m fastckpt.bench s3-sharded``)
runs end to end on a tiny state: a local moto server, 2 gloo ranks saving through every
writer, loads onto 1 and 3 ranks each checked bitwise, async stalls; the JSON and markdown
land in ``--out`` with every row. No wall-clock figure is asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("moto")
pytest.importorskip("s3fs")
pytest.importorskip("s3torchconnector.dcp")

WRITERS = ("fastckpt", "s3torchconnector", "fsspec")


def test_the_s3_sharded_scenario_runs_and_verifies_every_load(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    command = [sys.executable, "-m", "fastckpt.bench", "s3-sharded"]
    command += ["--size-mib", "3", "--repeat", "1", "--out", str(tmp_path / "out")]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-4000:]
    json_path = tmp_path / "out" / "s3-sharded-3mib-moto.json"
    md_path = json_path.with_suffix(".md")
    assert json_path.is_file() and md_path.is_file()
    document = json.loads(json_path.read_text())
    assert document["scenario"] == "s3-sharded"
    assert document["save_world"] == 2 and document["load_worlds"] == [1, 3]
    assert set(document["writers"]) == set(WRITERS)
    for name, row in document["writers"].items():
        assert row["error"] is None, (name, row["error"])
        assert row["async_error"] is None, (name, row["async_error"])
        assert len(row["raw"]["save"]["save_s"]) == 1, name
        assert row["save_s"]["median"] is not None, name
        assert len(row["raw"]["save"]["stall_s"]) == 1, name
        assert len(row["raw"]["save"]["total_s"]) == 1, name
        for world in ("1", "3"):
            load = row["loads"][world]
            assert load["error"] is None, (name, world, load["error"])
            assert load["verified"] == [True], (name, world, row["raw"][f"load_{world}"])
            assert load["load_s"]["median"] is not None, (name, world)
            if name == "fastckpt":  # what the reader needed and fetched, all ranks together
                needed, fetched = load["needed_bytes"]["median"], load["fetched_bytes"]["median"]
                assert 0 < needed <= fetched, (world, load)
    assert set(document["ratios"]) == {
        "save_speedup",
        "stall_ratio",
        "load_speedup_1_rank",
        "load_speedup_3_ranks",
    }
    assert all(entry["value"] is not None for entry in document["ratios"].values())
    assert document["load_average"]["before"] is not None
    assert "environment" in document and "versions" in document
    table = md_path.read_text()
    for name in WRITERS:
        assert f"| {name} |" in table
    assert "bitwise" in table and "MISMATCH" not in table and "failed" not in table
    assert "MiB needed" in table
    assert not (tmp_path / "s3:").exists()  # nothing of an s3:// id reached the disk
