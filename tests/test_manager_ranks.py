"""``CheckpointManager`` under a process group when the ranks do not all take part: the DDP
pattern "only rank 0 saves" (``Config.collective``), a save other ranks never join, and a
save whose peer rank is SIGKILLed. Real gloo ranks spawned here (``manager_ranks.py``), each
run bounded by a timeout so that a hang fails the test."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import fastckpt
from dcp_support import launch

#: how long one 2-rank run may take before its ranks are killed (a hang fails the test)
RUN_TIMEOUT_SECS = 120


def _run(function: str, root: Path, *args: str) -> list[tuple[int, str, str]]:
    root.mkdir()
    return launch(function, root, 2, *args, ranks="manager_ranks", timeout=RUN_TIMEOUT_SECS)


def _report(result: tuple[int, str, str]) -> dict[str, Any]:
    code, out, err = result
    assert code == 0, f"exit {code}\n{out[-2000:]}\n{err[-3000:]}"
    report: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return report


def _first_weight(checkpoint: Path) -> float:
    """The first weight of ``checkpoint`` loaded in this (one) process."""
    with fastckpt.CheckpointManager(fastckpt.CheckpointManager.Config.with_sync_save()) as m:
        return float(m.load(checkpoint)["model"]["w"][0])


def _staging_left(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith(".tmp-"))


def test_a_manager_used_by_one_rank_alone_builds_loads_and_saves(tmp_path: Path) -> None:
    """Before: a manager built on rank 0 alone under an initialized process group hung in its
    constructor (``dist.new_group`` waits for every rank), to save or to load, without a
    word; there was no way to say that one rank saves replicated state alone."""
    root = tmp_path / "root"
    ranks = [_report(result) for result in _run("rank_zero_alone", root)]
    zero = ranks[0]
    assert zero["built_s"] < 2, zero  # nothing waited for rank 1
    assert zero["loaded"] == 1.0  # saved with Config.collective=False, loaded with no collective
    # A collective save rank 1 never joins: a typed error after the barrier timeout.
    error = zero["error"]
    assert error is not None and error["type"] == "RuntimeError", zero
    message = error["message"]
    assert str(root / "c") in message and "checkpoint_write_barrier_timeout_sec" in message
    assert "did not call save" in message and "Config.collective=False" in message
    assert "was not committed" in message and not error["marked_committed"]
    assert 3 <= zero["failed_after_s"] < 30, zero
    assert zero["after"] == 1.0 and zero["left"] == []  # the previous checkpoint stands
    assert [rank["both_load"] for rank in ranks] == [1.0, 1.0]
    for rank in ranks:  # DTensor state: a one-rank manager refuses it, nothing saved
        assert (
            "Config.collective=False" in rank["dtensor"] and "nothing was saved" in rank["dtensor"]
        )
    assert not list(root.glob("sharded*"))


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_save_the_other_ranks_never_join_fails_saying_nothing_was_committed(
    tmp_path: Path, kind: str
) -> None:
    """Before: rank 0's save on its own (after a save of both ranks) raised gloo's bare
    timeout error, naming neither the checkpoint nor what to do."""
    root = tmp_path / "root"
    zero = _report(_run("rank_zero_alone_after_a_joint_save", root, kind)[0])
    error = zero["error"]
    assert error is not None and error["type"] == "RuntimeError", zero
    assert error["cause"] is not None  # gloo's error, chained
    message = error["message"]
    assert str(root / "c") in message and "collective of torch.distributed" in message
    assert "did not call save" in message and "Config.collective=False" in message
    assert "was not committed" in message and "previous checkpoint stands" in message
    assert zero["after"] == 1.0 and zero["left"] == []


@pytest.mark.parametrize(
    ("victim", "when", "kind", "committed"),
    [
        (1, "before_gather", "sync", False),
        (1, "before_gather", "async", False),
        (1, "after_commit", "sync", True),
        (1, "after_commit", "async", True),
        (0, "before_gather", "sync", False),
        (0, "after_commit", "sync", True),
    ],
)
def test_a_save_whose_peer_rank_dies_says_whether_it_was_committed(
    tmp_path: Path, victim: int, when: str, kind: str, committed: bool
) -> None:
    """Before: the surviving rank's save raised gloo's bare RuntimeError ("Connection reset
    by peer"), the same whether the checkpoint had been committed or not."""
    root = tmp_path / "root"
    results = _run("peer_killed", root, str(victim), when, kind)
    assert results[victim][0] == -9, results[victim][2][-2000:]
    survivor = _report(results[1 - victim])
    error = survivor["error"]
    assert error is not None and error["type"] == "RuntimeError", survivor
    assert error["cause"] is not None  # gloo's error, chained
    message = error["message"]
    assert str(root / "c") in message and "collective of torch.distributed" in message
    if committed:
        assert "was committed" in message, message
    else:
        assert "was not committed" in message and "previous checkpoint stands" in message
    assert error["marked_committed"] is committed
    assert _first_weight(root / "c") == (2.0 if committed else 1.0)
    # The dead rank's staging is removed by the next save.
    with fastckpt.CheckpointManager(fastckpt.CheckpointManager.Config.with_sync_save()) as m:
        m.save(root / "c", {"model": {"w": torch.full((1000,), 3.0)}, "step": 3})
    assert _staging_left(root) == []
    assert _first_weight(root / "c") == 3.0
