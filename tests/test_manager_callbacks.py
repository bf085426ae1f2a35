"""Commit callbacks in both forms: ``fn(CallbackArgs)`` (torch_checkpointing 0.1.1) and
``fn(checkpoint_id, logger)`` (its earlier releases), for sync and async saves."""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

import fastckpt
from fastckpt.manager.callbacks import CallbackArgs, takes_callback_args


def _manager(async_save: bool, **callbacks: Any) -> fastckpt.CheckpointManager:
    config = (
        fastckpt.CheckpointManager.Config.with_async_save()
        if async_save
        else fastckpt.CheckpointManager.Config.with_sync_save()
    )
    for name, fn in callbacks.items():
        setattr(config, name, fn)
    return config.build()


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_one_argument_callbacks_get_callback_args(tmp_path: Path, async_save: bool) -> None:
    seen: dict[str, Any] = {}
    target = tmp_path / "step_1"

    def pre_finalize(args: CallbackArgs) -> None:
        # This rank's files are written where args.path says, and not yet visible at target.
        seen["pre"] = args
        seen["pre_files"] = sorted(args.storage.list_dir(Path(args.path)))
        seen["visible_before_commit"] = (target / "commit.json").exists()

    def finalize(args: CallbackArgs) -> None:
        seen["final"] = args
        seen["committed"] = (Path(args.path) / "commit.json").exists()

    manager = _manager(async_save, pre_finalize_callback=pre_finalize, finalize_callback=finalize)
    future = manager.save(str(target), {"model": {"w": torch.arange(4.0)}, "step": 1})
    if future is not None:
        future.result()
    manager.close()

    final, pre = seen["final"], seen["pre"]
    assert isinstance(final, CallbackArgs) and isinstance(pre, CallbackArgs)
    assert final.path == str(target) and seen["committed"]
    assert final.storage.exists(target / "commit.json")
    assert isinstance(final.event_logger, logging.Logger)
    assert pre.path != str(target) and "model.safetensors" in seen["pre_files"]
    assert not seen["visible_before_commit"]


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_two_argument_callbacks_get_the_id_and_the_logger(tmp_path: Path, async_save: bool) -> None:
    calls: list[tuple[str, str, Any]] = []
    manager = _manager(
        async_save,
        pre_finalize_callback=lambda checkpoint_id, logger: calls.append(
            ("pre", checkpoint_id, logger)
        ),
        finalize_callback=lambda checkpoint_id, logger: calls.append(
            ("final", checkpoint_id, logger)
        ),
    )
    future = manager.save(str(tmp_path / "c"), {"model": {"w": torch.ones(2)}})
    if future is not None:
        future.result()
    manager.close()
    assert [(kind, cid) for kind, cid, _ in calls] == [
        ("pre", str(tmp_path / "c")),
        ("final", str(tmp_path / "c")),
    ]
    assert all(logger.name == "fastckpt.manager" for _, _, logger in calls)


def test_the_form_is_read_from_the_signature() -> None:
    def one(args: CallbackArgs) -> None: ...
    def one_with_option(args: CallbackArgs, verbose: bool = False) -> None: ...
    def two(checkpoint_id: str, logger: Any) -> None: ...
    def star(*args: Any) -> None: ...

    class Bound:
        def method(self, args: CallbackArgs) -> None: ...

    assert takes_callback_args(one)
    assert takes_callback_args(Bound().method)
    assert takes_callback_args(functools.partial(two, "fixed"))
    assert not takes_callback_args(one_with_option)  # may take a second positional argument
    assert not takes_callback_args(two)
    assert not takes_callback_args(star)
    assert not takes_callback_args(print)  # builtins whose signature has *args


@pytest.mark.timeout(60)
def test_a_finalize_callback_of_an_async_manager_saving_again_is_refused_at_once(
    tmp_path: Path,
) -> None:
    """An async save's callback runs on the writer thread: a save from it waited for the
    write it is part of, for ``wait_timeout_secs`` (600 s by default), then failed with a
    TimeoutError saying to raise the timeout. Now refused at once, naming the cause; the
    checkpoint the callback ran for is committed, and the manager saves again after it."""
    errors: list[BaseException] = []
    config = fastckpt.CheckpointManager.Config.with_async_save()
    config.save.wait_timeout_secs = 120

    def also_save_best(checkpoint_id: str, logger: Any) -> None:
        try:
            manager.save(tmp_path / "best", {"x": torch.zeros(2)})
        except RuntimeError as err:
            errors.append(err)
            raise

    config.finalize_callback = also_save_best
    with fastckpt.CheckpointManager(config) as manager:
        future = manager.save(tmp_path / "step_1", {"x": torch.ones(2)})
        with pytest.raises(RuntimeError, match="cannot save from inside the background"):
            future.result(timeout=60)
        config.finalize_callback = None
        manager.save(tmp_path / "step_2", {"x": torch.ones(2)}).result(timeout=60)
    assert len(errors) == 1 and "finalize_callback" in str(errors[0])
    assert fastckpt.verify(tmp_path / "step_1").ok and fastckpt.verify(tmp_path / "step_2").ok
    assert not (tmp_path / "best").exists()

    # close() from the callback: refused the same way, the manager still open and saving
    # (a first version let it through to Python's "cannot join current thread", closed).
    def close_it(checkpoint_id: str, logger: Any) -> None:
        manager.close()

    config = fastckpt.CheckpointManager.Config.with_async_save()
    config.finalize_callback = close_it
    with fastckpt.CheckpointManager(config) as manager:
        future = manager.save(tmp_path / "step_3", {"x": torch.ones(2)})
        with pytest.raises(RuntimeError, match="cannot close from inside the background"):
            future.result(timeout=60)
        config.finalize_callback = None
        manager.save(tmp_path / "step_4", {"x": torch.ones(2)}).result(timeout=60)
    assert fastckpt.verify(tmp_path / "step_4").ok


def test_a_finalize_callback_of_a_sync_manager_may_save_again(tmp_path: Path) -> None:
    # Saves take turns between threads; a save from the callback of a save on the same
    # thread (a "latest" copy) must not wait for its own turn (a deadlock for a moment).
    copies: list[str] = []
    config = fastckpt.CheckpointManager.Config.with_sync_save()

    def also_save_latest(checkpoint_id: str, logger: Any) -> None:
        if checkpoint_id != str(tmp_path / "latest"):
            copies.append(checkpoint_id)
            manager.save(tmp_path / "latest", {"x": torch.full((2,), float(len(copies)))})

    config.finalize_callback = also_save_latest
    with fastckpt.CheckpointManager(config) as manager:
        manager.save(tmp_path / "step_1", {"x": torch.ones(2)})
        assert torch.equal(manager.load(tmp_path / "latest")["x"], torch.ones(2))
