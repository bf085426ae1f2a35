"""A training script started again (instead of resumed) into a root holding a later run's
checkpoints is refused before its first step, with the fixes named; resuming, a new root, or
``overwrite=True`` go on."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import fastckpt
import training_support as support
from s3_support import s3_env, s3_server

__all__ = ["s3_env", "s3_server"]  # fixtures used by name below


def _indices(root: Path) -> list[int]:
    return [row["index"] for row in fastckpt.list_checkpoints(root)]


def _first_run(root: Path) -> None:
    hook = fastckpt.CheckpointHook(root, step_interval=2, async_save=False)
    support.new_strategy([hook], num_steps=6).run(support.loader())
    assert _indices(root) == [0, 1, 2]


@pytest.mark.parametrize("async_save", [False, True])
def test_a_restarted_run_is_refused_before_its_first_step(tmp_path: Path, async_save: bool) -> None:
    _first_run(tmp_path)
    hook = fastckpt.CheckpointHook(tmp_path, step_interval=2, async_save=async_save)
    again = support.new_strategy([hook], num_steps=6)
    with pytest.raises(fastckpt.MixedRunError) as caught:
        again.run(support.loader())
    message = str(caught.value)
    assert str(tmp_path) in message and "index 2 is at step 6" in message.replace(")", "")
    assert "starts at step 0" in message and "load_checkpoint" in message
    assert "overwrite=True" in message
    assert again.step_count == 0 and _indices(tmp_path) == [0, 1, 2]  # nothing trained or saved


def test_resuming_the_newest_index_goes_on(tmp_path: Path) -> None:
    _first_run(tmp_path)
    hook = fastckpt.CheckpointHook(tmp_path, step_interval=2, async_save=False)
    resumed = fastckpt.TrainingStrategy.load_checkpoint(
        tmp_path, hooks=[hook], training_fn=support.training_fn
    )
    resumed.num_steps = 10
    resumed.run(support.loader())
    assert resumed.step_count == 10 and _indices(tmp_path) == [0, 1, 2, 3, 4]


def test_resuming_an_earlier_index_needs_overwrite(tmp_path: Path) -> None:
    _first_run(tmp_path)

    def resume(hook: fastckpt.CheckpointHook) -> fastckpt.TrainingStrategy:
        strategy = fastckpt.TrainingStrategy.load_checkpoint(
            tmp_path, 0, hooks=[hook], training_fn=support.training_fn
        )
        strategy.num_steps = 4
        return strategy

    refused = resume(fastckpt.CheckpointHook(tmp_path, step_interval=2, async_save=False))
    with pytest.raises(fastckpt.MixedRunError, match="starts at step 2"):
        refused.run(support.loader())
    allowed = resume(
        fastckpt.CheckpointHook(tmp_path, step_interval=2, async_save=False, overwrite=True)
    )
    allowed.run(support.loader())
    assert _indices(tmp_path) == [0, 1, 2, 3]  # the rolled-back run's step 4, after the rest
    assert fastckpt.list_checkpoints(tmp_path)[-1]["counters"]["step_count"] == 4


def test_a_new_root_and_a_bad_overwrite_value(tmp_path: Path) -> None:
    _first_run(tmp_path / "a")
    _first_run(tmp_path / "b")  # a fresh root: no refusal
    with pytest.raises(TypeError, match="overwrite must be a bool"):
        fastckpt.CheckpointHook(tmp_path, step_interval=2, overwrite="yes")  # type: ignore[arg-type]


OTHER_RUN = """
import sys, torch, fastckpt
fastckpt.save_checkpoint(sys.argv[1], models={"main": (torch.nn.Linear(2, 2), None)},
                         counters={"step_count": 3})
"""


def _saving_at_third_step(root: Path, other_process: bool) -> Any:
    """The reference training step, which at the run's third step has another run save into
    ``root`` (a real process), or this process save there by hand."""
    calls = [0]

    def training_fn(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        calls[0] += 1
        if calls[0] == 3:
            if other_process:
                subprocess.run([sys.executable, "-c", OTHER_RUN, str(root)], check=True)
            else:
                fastckpt.save_checkpoint(root, models={"main": (torch.nn.Linear(2, 2), None)})
        return support.training_fn(model, batch)

    return training_fn


@pytest.mark.parametrize("async_save", [False, True])
def test_a_run_saving_into_the_root_meanwhile_stops_the_next_save(
    tmp_path: Path, async_save: bool
) -> None:
    """Two runs started together on one root each saw it empty at their start: before, both
    trained to the end with their checkpoints interleaved (and each one's keep_last deleting
    the other's); the resume took whichever committed last. Now each save checks, under the
    root's lock, that the newest index is the run's own (or the one it started from)."""
    hook = fastckpt.CheckpointHook(tmp_path, step_interval=1, async_save=async_save)
    strategy = support.new_strategy([hook], num_steps=6)
    strategy.training_fn = _saving_at_third_step(tmp_path, other_process=True)
    with pytest.raises(fastckpt.MixedRunError) as caught:
        strategy.run(support.loader())
    message = str(caught.value)
    assert "index 2 (step 3) was committed by another process" in message
    assert "checkpoint_dir" in message and "Nothing was saved" in message
    assert _indices(tmp_path) == [0, 1, 2]  # steps 1, 2 of this run, then the other run's
    assert fastckpt.verify(tmp_path).ok
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]


def test_a_save_into_the_root_by_the_same_process_is_not_another_run(tmp_path: Path) -> None:
    hook = fastckpt.CheckpointHook(tmp_path, step_interval=1, async_save=False)
    strategy = support.new_strategy([hook], num_steps=4)
    strategy.training_fn = _saving_at_third_step(tmp_path, other_process=False)
    strategy.run(support.loader())
    assert _indices(tmp_path) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("where", ["local", "s3"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_sharded_run_saving_into_a_root_another_run_saved_into_stops(
    tmp_path: Path, mode: str, where: str, request: pytest.FixtureRequest
) -> None:
    """FSDP2 on 2 gloo ranks: before, a sharded hook save made no such check (each run's
    index was chosen before its shards were written and committed whatever the root held
    then). Now rank 0 checks at the commit: ``MixedRunError`` there, a ``RuntimeError``
    naming it on rank 1, and the root holds this run's indices and the other run's only. On
    ``s3://`` too, where a save replacing an index withdraws it first: the check runs before
    (a review found it ran after, passing, and the other run's index was replaced)."""
    import json

    from dcp_support import launch

    root: Any = tmp_path / "run"
    extra: list[str] = []
    if where == "s3":
        server = request.getfixturevalue("s3_server")
        request.getfixturevalue("s3_env")  # the ranks and the other run inherit the variables
        root = server.url(f"mixed-{mode}-{os.getpid()}")
        extra = [root]
    results = launch("strategy_mixed_run", tmp_path / "run", 2, mode, *extra, ranks="sharded_ranks")
    reports = [json.loads(out.strip().splitlines()[-1]) for _, out, _ in results]
    assert [code for code, _, _ in results] == [0, 0], [err for _, _, err in results]
    assert reports[0]["error"] == "MixedRunError", reports
    assert "index 2 (step 3) was committed by another process" in reports[0]["message"]
    assert reports[1]["error"] == "RuntimeError" and "MixedRunError" in reports[1]["message"]
    rows = fastckpt.list_checkpoints(root)
    assert [row["index"] for row in rows] == [0, 1, 2]
    assert [row["counters"]["step_count"] for row in rows] == [1, 2, 3]
    assert rows[2]["counters"] == {"step_count": 3}  # the other run's (a strategy's has more)
    assert fastckpt.verify(root).ok
