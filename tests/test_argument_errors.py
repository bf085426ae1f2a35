"""Wrong arguments to the public API are typed errors naming the argument and the fix, raised
before anything is written (the directory is checked before and after). Each case was
accepted, ignored or failed with a bare error from deep inside before 2026-12-05."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import pytest
import torch

import fastckpt
from fastckpt import CheckpointHook, CheckpointManager, OptimizerConfig, TrainingStrategy


def _model() -> torch.nn.Module:
    return torch.nn.Linear(2, 2)


def _save(root: Path, model: torch.nn.Module, **keywords: Any) -> int:
    return fastckpt.save_checkpoint(root, models={"m": (model, None)}, **keywords)


@pytest.mark.parametrize(
    ("keywords", "error", "match"),
    [
        ({"async_save": "no"}, TypeError, "async_save must be a bool"),
        ({"rank_zero_only": 1}, TypeError, "rank_zero_only must be a bool"),
        # "5" was a ValueError here and a TypeError in save_checkpoint: now one rule.
        ({"lock_timeout": "5"}, TypeError, "lock_timeout must be a number of seconds"),
        ({"lock_timeout": math.nan}, ValueError, "lock_timeout must be a number of seconds"),
        ({"wait_timeout_secs": "9"}, TypeError, "wait_timeout_secs must be a number"),
        ({"wait_timeout_secs": 0}, ValueError, "wait_timeout_secs must be a number"),
        ({"keep_last": 2.0}, TypeError, "keep_last must be a positive integer"),
        ({"keep_last": 0}, ValueError, "keep_last must be a positive integer"),
    ],
)
def test_checkpoint_hook_refuses_flags_and_timeouts_of_the_wrong_type(
    tmp_path: Path, keywords: dict[str, Any], error: type[Exception], match: str
) -> None:
    # async_save="no" was accepted and saved asynchronously (a truthy string).
    with pytest.raises(error, match=match):
        CheckpointHook(tmp_path / "run", step_interval=1, **keywords)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        # A bare AttributeError ('Linear' object has no attribute 'checkpoint_snapshot').
        (lambda root, m: fastckpt.save_checkpoint(root, m), TypeError, "models must be a mapping"),
        (lambda root, m: fastckpt.save_checkpoint(root, models=[m]), TypeError, "models must be"),
        (
            lambda root, m: fastckpt.save_checkpoint(root, strategy=m),
            TypeError,
            "strategy must be a TrainingStrategy",
        ),
        # TypeError: 'SGD' object is not iterable.
        (
            lambda root, m: fastckpt.save_checkpoint(
                root,
                models={"m": (m, None)},
                optimizers=torch.optim.SGD(m.parameters(), lr=0.1),
            ),
            TypeError,
            r"optimizers must be a mapping .*optimizers=\{'main'",
        ),
        # Accepted and dropped without a word.
        (
            lambda root, m: fastckpt.save_checkpoint(
                root, models={"m": (m, None)}, associations=[1]
            ),
            TypeError,
            "associations must be a mapping",
        ),
        (
            lambda root, m: fastckpt.save_checkpoint(
                root, models={"m": (m, None)}, associations={"x": "m"}
            ),
            KeyError,
            "no saved optimizer or scheduler",
        ),
        # Committed an empty index that became the latest.
        (lambda root, m: fastckpt.save_checkpoint(root), ValueError, "no model, optimizer"),
        (lambda root, m: fastckpt.save_checkpoint(root, models={}), ValueError, "no model"),
        # TypeError: unsupported operand type(s) for +: 'float' and 'str'; -1 was accepted.
        (
            lambda root, m: fastckpt.save_checkpoint(
                root, models={"m": (m, None)}, lock_timeout="5"
            ),
            TypeError,
            "lock_timeout must be a number",
        ),
        (
            lambda root, m: fastckpt.save_checkpoint(
                root, models={"m": (m, None)}, lock_timeout=-1
            ),
            ValueError,
            "lock_timeout must be >= 0",
        ),
    ],
)
def test_save_checkpoint_refuses_misplaced_components_before_writing(
    tmp_path: Path, call: Any, error: type[Exception], match: str
) -> None:
    root = tmp_path / "root"
    with pytest.raises(error, match=match):
        call(root, _model())
    assert not root.exists()


def test_prune_and_verify_refuse_arguments_of_the_wrong_type(tmp_path: Path) -> None:
    root = tmp_path / "root"
    fastckpt.save_checkpoint(root, models={"m": (_model(), None)})
    before = sorted(p.name for p in root.iterdir())
    with pytest.raises(TypeError, match="lock_timeout must be a number"):
        fastckpt.prune(root, keep_last=1, lock_timeout="5")
    for threads in ("2", 0, -1, 2.0):  # "2" was a bare TypeError, 0 and -1 were accepted
        with pytest.raises(TypeError, match="threads must be an int from 1 to 65536"):
            fastckpt.verify(root, threads=threads)
    assert sorted(p.name for p in root.iterdir()) == before
    assert fastckpt.verify(root, threads=3).ok


def _strategy(**keywords: Any) -> TrainingStrategy:
    return TrainingStrategy(
        _model(),
        OptimizerConfig(torch.optim.SGD, {"lr": 0.1}),
        training_fn=lambda model, batch: model(batch).sum(),
        **keywords,
    )


@pytest.mark.parametrize("limit", [-1, 2.5, "3", True])
def test_run_refuses_a_step_limit_that_is_no_count(limit: Any) -> None:
    # num_steps=-1 ran no step, 2.5 ran three, "3" failed deep inside the loop.
    strategy = _strategy(num_steps=limit)
    with pytest.raises(TypeError, match="num_steps must be an int >= 0"):
        strategy.run([torch.ones(1, 2)] * 4)
    assert strategy.step_count == 0


def test_run_refuses_a_hook_that_is_not_callable() -> None:
    # hooks=[1] was accepted, and run() failed with "'int' object is not callable".
    strategy = _strategy(num_steps=2, hooks=[1])
    with pytest.raises(TypeError, match=r"hooks\[0\] is a int, not a hook"):
        strategy.run([torch.ones(1, 2)] * 2)
    assert strategy.step_count == 0


def test_leaving_a_manager_block_by_an_exception_keeps_that_exception(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Before, a background write that failed too made close() raise its RuntimeError in
    # place of the block's own exception (kept only as __context__).
    blocker = tmp_path / "file"
    blocker.write_text("x")
    caplog.set_level(logging.ERROR, logger="fastckpt.manager")
    config = CheckpointManager.Config.with_async_save()
    with pytest.raises(KeyError, match="the user's own"), CheckpointManager(config) as manager:
        manager.save(blocker / "ckpt", {"x": torch.ones(3)})  # fails in the background
        raise KeyError("the user's own")
    assert "closing on the way out of an exception (KeyError) failed" in caplog.text
    assert "NotADirectoryError" in caplog.text


def test_a_tensor_no_file_can_hold_is_named_by_its_whole_path_before_anything_is_written(
    tmp_path: Path,
) -> None:
    # A 0-d float4 buffer inside a manager item was refused as 'inner.scale' (its key inside
    # the item's file), not 'model.inner.scale', and only by the writer.
    inner = torch.nn.Module()
    inner.register_buffer("scale", torch.empty((), dtype=torch.float4_e2m1fn_x2))
    model = torch.nn.Module()
    model.inner = inner
    with (
        CheckpointManager(CheckpointManager.Config()) as manager,
        pytest.raises(TypeError, match=r"'model\.inner\.scale'.*reshape it to \(1,\)"),
    ):
        manager.save(tmp_path / "ckpt", {"model": model.state_dict()})
    assert list(tmp_path.iterdir()) == []
