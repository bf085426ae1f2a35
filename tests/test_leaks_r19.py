"""Process-wide records that grew with every save of a long run (round 19's leak hunt)."""

from __future__ import annotations

import gc
from pathlib import Path

import torch

import fastckpt
import fastckpt.dcp
from fastckpt.container import commit


def test_the_record_of_committed_indices_keeps_only_what_the_root_holds(tmp_path: Path) -> None:
    """Before: every index this process committed stayed in ``commit._COMMITTED`` for good,
    pruned or not (500 saves with ``keep_last=2``: 500 entries, ~90 B a save)."""
    model = torch.nn.Linear(4, 2)
    root = tmp_path / "root"
    for _ in range(12):
        fastckpt.save_checkpoint(root, models={"m": (model, None)})
        fastckpt.prune(root, 2)
    on_disk = {entry["index"] for entry in fastckpt.list_checkpoints(root)}
    assert on_disk == {10, 11}
    assert on_disk <= commit.committed_here(root) <= {9, 10, 11}


def test_commit_locks_live_only_while_a_commit_holds_them(tmp_path: Path) -> None:
    """Before: one lock per checkpoint directory ever committed (every sharded save and
    every ``s3://`` manager save) stayed in ``commit._COMMIT_LOCKS`` for the process's life."""
    for step in range(5):
        fastckpt.dcp.save_state(tmp_path / f"step_{step}", {"x": torch.full((4,), float(step))})
    gc.collect()
    assert len(commit._COMMIT_LOCKS) == 0
    loaded = fastckpt.dcp.load_state(tmp_path / "step_4")
    assert torch.equal(loaded["x"], torch.full((4,), 4.0))
