"""CheckpointHook and EMAHook: cadence, background writes, failures and timeouts."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch

import fastckpt
import training_support as support
from fastckpt import CheckpointHook


def test_a_timed_out_hook_write_stays_tracked_and_its_failure_is_raised_once(
    tmp_path: Path,
) -> None:
    """While the strategy holds the hook's guard (its optimizer step), a background capture
    cannot run: a save waiting longer than ``wait_timeout_secs`` says which write is still in
    flight, and that write's failure is still reported, once, when the hook closes."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    root = blocker / "ckpt"
    hook = CheckpointHook(root, step_interval=1, wait_timeout_secs=0.2)
    strategy = support.new_strategy([hook], num_steps=1)
    with hook:
        with hook.guard():
            hook.save(strategy.context)
            with pytest.raises(TimeoutError, match=r"ckpt.*still running") as timeout:
                hook.save(strategy.context)
            assert timeout.value.errno == errno.ETIMEDOUT
        with pytest.raises(RuntimeError, match="background checkpoint write") as info:
            hook.close()
        assert isinstance(info.value.__cause__, NotADirectoryError)
        assert hook.last_checkpoint_index is None
    hook.close()  # reported once


def test_a_hook_write_that_outlasts_one_wait_is_collected_by_the_next_save(
    tmp_path: Path,
) -> None:
    hook = CheckpointHook(tmp_path, step_interval=1, wait_timeout_secs=0.2)
    strategy = support.new_strategy([hook], num_steps=1)
    with hook:
        with hook.guard():
            hook.save(strategy.context)
            with pytest.raises(TimeoutError):
                hook.save(strategy.context)
        hook.save(strategy.context)  # the first write finished: this one starts
        assert hook.last_checkpoint_index == 0
    assert hook.last_checkpoint_index == 1
    assert [row["index"] for row in fastckpt.list_checkpoints(tmp_path)] == [0, 1]
    loaded = fastckpt.load_checkpoint(tmp_path, 1, training_fn=support.training_fn)
    for name, tensor in strategy.models["main"].state_dict().items():
        assert torch.equal(loaded["models"]["main"]["model"].state_dict()[name], tensor)


def test_wait_timeout_is_validated() -> None:
    with pytest.raises(ValueError, match="wait_timeout_secs"):
        CheckpointHook("x", step_interval=1, wait_timeout_secs=0)
