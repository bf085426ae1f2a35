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


def test_a_survivor_whose_files_equal_the_committed_ones_says_nothing_was_committed(
    tmp_path: Path,
) -> None:
    """Rank 0 is SIGKILLed before the gather of a save whose files are byte-identical to the
    committed checkpoint's (the same values saved again). Before, rank 1 found its files in
    rank 0's (old) record and said the save "was committed", though rank 0 cannot commit
    without rank 1's part of the gather; now: not committed."""
    root = tmp_path / "root"
    results = _run("peer_killed", root, "0", "before_gather", "sync", "same")
    assert results[0][0] == -9, results[0][2][-2000:]
    error = _report(results[1])["error"]
    assert error is not None and "was not committed" in error["message"], error
    assert not error["marked_committed"]
    assert _first_weight(root / "c") == 1.0


@pytest.mark.parametrize("kind", ["sync", "async"])
@pytest.mark.parametrize("ids", ["fixed", "steps"])
def test_a_save_failing_on_one_rank_is_aborted_on_every_rank_and_the_next_saves_commit(
    tmp_path: Path, kind: str, ids: str
) -> None:
    """Rank 1's second save fails on its own (ENOSPC from its pre_finalize_callback). Before,
    it raised before the gather, so rank 0's gather paired with rank 1's next save: with a
    fixed checkpoint id rank 0's save 2 committed rank 0's values 2 with rank 1's 3, save 3
    the same (each "ok" on rank 0, wrong data); with step ids every later save failed naming
    different checkpoint ids. Now every rank takes part in every gather: save 2 fails on
    both ranks (rank 0 naming rank 1 and its error), nothing of it is committed, and saves
    3 and 4 commit each rank's own values."""
    root = tmp_path / "root"
    zero, one = (_report(result) for result in _run("one_rank_write_fails", root, kind, ids))
    assert zero["saves"][0] is None and one["saves"][0] is None, (zero, one)
    failed = one["saves"][1]
    assert failed is not None and "No space left on device" in failed["message"], one
    told = zero["saves"][1]
    assert told is not None and told["type"] == "RuntimeError", zero
    assert "rank 1" in told["message"] and "No space left on device" in told["message"], told
    assert (
        "nothing of this save was committed" in told["message"] and not told["marked_committed"]
    ), told
    assert zero["saves"][2:] == [None, None] and one["saves"][2:] == [None, None], (zero, one)
    assert zero["last"] == 4.0 and one["last"] == 4.0  # each rank's own save 4
    expected = ["c"] if ids == "fixed" else ["step_1", "step_3", "step_4"]
    assert zero["committed"] == expected and zero["left"] == [] and one["left"] == []


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_after_a_failed_collective_later_saves_say_the_group_failed(
    tmp_path: Path, kind: str
) -> None:
    """Rank 0 saves alone (its collective times out); then both ranks save with the same
    manager. Before, that save failed too, after the timeout, blaming "another rank did not
    call save" (gloo's group cannot be used after a failed collective). Now rank 0 refuses
    it at once, naming the save whose collective failed and the way out; a new manager on
    every rank saves again (a new group), and the checkpoint was never damaged."""
    root = tmp_path / "root"
    zero, one = (_report(result) for result in _run("saves_after_a_failed_collective", root, kind))
    assert zero["alone"] is not None and "was not committed" in zero["alone"]["message"], zero
    refused = zero["same_manager"]
    assert refused is not None and refused["type"] == "RuntimeError", zero
    message = refused["message"]
    assert "process group failed at the save of" in message and str(root / "c") in message
    assert "Restart the job" in message and "new CheckpointManager on every rank" in message
    assert "did not call save" not in message, message
    assert zero["same_manager_s"] < 2, zero  # at once, no timeout waited out
    assert one["same_manager"] is not None, one  # rank 1's collective found no rank 0
    assert zero["after_same"] == 1.0 and one["after_same"] == 1.0
    assert zero["new_manager"] is None and one["new_manager"] is None, (zero, one)
    assert zero["after_new"] == 4.0 and one["after_new"] == 4.0
    assert zero["left"] == [] and one["left"] == []


def test_a_manager_used_by_one_rank_alone_refuses_a_sharded_load(tmp_path: Path) -> None:
    """Before: rank 0's ``collective=False`` manager loading a sharded checkpoint ran DCP's
    collective load on the default group, which rank 1 never joined: it hung until the
    default group's timeout. Now it is refused at once, nothing read."""
    root = tmp_path / "root"
    zero = _report(_run("sharded_load_alone", root)[0])
    error = zero["error"]
    assert error is not None and error["type"] == "ValueError", zero
    assert str(root / "s") in error["message"] and "Config.collective=False" in error["message"]
    assert zero["secs"] < 10, zero
