"""The incremental-save benchmark and the CheckpointHook training scenario, at toy sizes."""

from __future__ import annotations

from pathlib import Path

import pytest

from fastckpt.bench import incremental
from fastckpt.bench.training import SCENARIOS, TrainingConfig, run_training

TINY = TrainingConfig(steps=6, every=2, hidden=16, layers=1, batch=4, warmup=1)


def test_the_hook_scenario_checkpoints_at_the_same_steps_as_the_manager(tmp_path: Path) -> None:
    assert "fastckpt-hook" in SCENARIOS
    hook = run_training("fastckpt-hook", TINY, tmp_path)
    assert hook["available"], hook["reason"]
    manager = run_training("fastckpt-async", TINY, tmp_path)
    if not manager["available"]:
        pytest.skip(f"CheckpointManager not available: {manager['reason']}")
    # Steps 2 and 4 (not the last step, 6), each stall measured once.
    assert hook["checkpoints"] == manager["checkpoints"] == 2
    assert len(hook["stall_seconds"]) == 2
    assert hook["checkpoint_mib"] == manager["checkpoint_mib"]
    for result in (hook, manager):  # steps overlapping a checkpoint, against the others
        assert 0 <= result["overlapped_steps"] <= TINY.steps
        assert "in_run_overhead" in result
    assert run_training("none", TINY, tmp_path)["in_run_overhead"] is None
    assert list(tmp_path.iterdir()) == []  # each run removes its checkpoints


def test_incremental_benchmark_interleaves_full_and_incremental_saves(tmp_path: Path) -> None:
    """Both fastckpt writers save the same run; an incremental save of a model whose 90 %
    is frozen writes a fraction of a full save's bytes; the ratios use saves 2..N."""
    results = incremental.run(
        model_mib=8,
        frozen=0.9,
        optimizer="sgd",
        saves=3,
        writers=list(incremental.PAIR),
        work=tmp_path,
        repeats=2,
    )
    rows = results["writers"]
    for name in incremental.PAIR:
        assert len(rows[name]["runs"]) == 2
        assert all(len(run["seconds"]) == 3 for run in rows[name]["runs"])
    full, mine = rows["fastckpt-full"]["summary"], rows["fastckpt"]["summary"]
    assert full["bytes_vs_full_fastckpt"] == 1.0 and full["time_vs_full_fastckpt"] == 1.0
    assert mine["first_bytes"] == full["first_bytes"]  # the first save of a process is full
    assert 0.05 < mine["bytes_vs_full_fastckpt"] < 0.2
    assert len(mine["runs_time_vs_full_fastckpt"]) == 2
    assert "paired_time_vs_full_fastckpt" in mine
    assert results["targets"]["bytes_at_most_15pct"] is True
    assert len(results["environment"]["load_average_before"]) == 3
    text = incremental.render_markdown(results)
    assert "| fastckpt |" in text and "Load average" in text
