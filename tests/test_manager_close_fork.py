"""CheckpointManager.close() called again while a close waits for the last write (from
another thread, or from a signal handler interrupting that close on the same thread), and a
child forked while another thread of its parent is inside ``save()``.

Real threads, a real signal delivered to the main thread, real forked processes. The write is
held back by a ``pre_finalize_callback`` (it runs before the commit) until the test lets it go,
so "close() returned before the commit" is seen every time, not by chance.
"""

from __future__ import annotations

import errno
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from fastckpt import CheckpointManager


def _held_manager(release: threading.Event, fail: bool) -> CheckpointManager:
    """An async manager whose writes wait for ``release`` before their commit (then fail
    with an ``OSError`` when ``fail``)."""

    def hold(checkpoint_id: str, logger: Any) -> None:
        assert release.wait(60)
        if fail:
            raise OSError(errno.EIO, "the disk went away")

    config = CheckpointManager.Config.with_async_save()
    config.pre_finalize_callback = hold
    return CheckpointManager(config)


def manager_load(path: Path) -> dict[str, Any]:
    """The checkpoint at ``path``, read by a new synchronous manager."""
    with CheckpointManager(CheckpointManager.Config.with_sync_save()) as reader:
        return reader.load(path)


def _wait_until_closing(manager: CheckpointManager) -> None:
    """Until a close() on another thread has started (it refuses saves from then on)."""
    deadline = time.monotonic() + 60
    while not manager._closed:
        assert time.monotonic() < deadline, "close() never started"
        time.sleep(0.001)
    time.sleep(0.1)  # it is now waiting for the write


@pytest.mark.parametrize("outcome", ["committed", "failed"])
def test_a_second_close_on_another_thread_waits_for_the_write(tmp_path: Path, outcome: str) -> None:
    """Before, a close() on a second thread while the first thread's close() waited for the
    last write returned at once, the checkpoint not committed yet (close promises it is when
    it returns). Now it waits until the first close is done; a failure of that write is
    raised by the first close and said by the second too (a RuntimeError chained to it: a
    thread closing before it exits must not take the checkpoint for saved)."""
    release = threading.Event()
    manager = _held_manager(release, fail=outcome == "failed")
    path = tmp_path / "step_1"
    manager.save(path, {"w": torch.arange(8.0)})
    raised: dict[str, BaseException | None] = {}
    committed_on_return: dict[str, bool] = {}

    def close(name: str) -> None:
        try:
            manager.close()
            raised[name] = None
        except BaseException as err:
            raised[name] = err
        committed_on_return[name] = (path / "commit.json").exists()

    first = threading.Thread(target=close, args=("first",))
    second = threading.Thread(target=close, args=("second",))
    try:
        first.start()
        _wait_until_closing(manager)
        second.start()
        second.join(0.5)
        assert second.is_alive(), "the second close() returned before the write ended"
        release.set()
    finally:
        release.set()
        first.join(60)
        second.join(60)
    committed = outcome == "committed"
    assert committed_on_return == {"first": committed, "second": committed}
    if committed:
        assert raised == {"first": None, "second": None}
        assert torch.equal(manager_load(path)["w"], torch.arange(8.0))
    else:
        assert isinstance(raised["first"], RuntimeError)
        assert isinstance(raised["first"].__cause__, OSError)
        assert str(path) in str(raised["first"])
        second = raised["second"]
        assert isinstance(second, RuntimeError) and second.__cause__ is raised["first"]
        assert "closed by a close() on another thread" in str(second)


@pytest.mark.parametrize("outcome", ["committed", "failed"])
def test_a_close_in_a_signal_handler_interrupting_close_waits_for_the_write(
    tmp_path: Path, outcome: str
) -> None:
    """A preemption handler (SIGTERM: close() to make the last checkpoint durable, then
    ``os._exit``) running while the main thread is inside close(): before, the handler's
    close() returned at once, the checkpoint not committed, and the exit after it lost it.
    The handler interrupts the close on the same thread, so it cannot wait for that close;
    it waits for the write itself, and raises its failure (once: the interrupted close then
    stays quiet)."""
    assert threading.current_thread() is threading.main_thread()
    release = threading.Event()
    manager = _held_manager(release, fail=outcome == "failed")
    path = tmp_path / "step_1"
    manager.save(path, {"w": torch.arange(8.0)})
    seen: dict[str, Any] = {}

    def on_signal(signum: int, frame: Any) -> None:
        try:
            manager.close()
            seen["raised"] = None
        except RuntimeError as err:
            seen["raised"] = err
        seen["committed"] = (path / "commit.json").exists()

    main = threading.get_ident()

    def preempt() -> None:
        _wait_until_closing(manager)
        signal.pthread_kill(main, signal.SIGUSR1)  # the main thread runs the handler
        time.sleep(0.3)  # the handler's close() is waiting now
        release.set()

    previous = signal.signal(signal.SIGUSR1, on_signal)
    scheduler = threading.Thread(target=preempt)
    try:
        scheduler.start()
        manager.close()  # the end of training; the handler interrupts it
    finally:
        release.set()
        scheduler.join(60)
        signal.signal(signal.SIGUSR1, previous)
    committed = outcome == "committed"
    assert seen["committed"] is committed
    if committed:
        assert seen["raised"] is None
        assert torch.equal(manager_load(path)["w"], torch.arange(8.0))
    else:
        assert isinstance(seen["raised"], RuntimeError)
        assert isinstance(seen["raised"].__cause__, OSError)
    manager.close()  # closed: returns at once


# A parent thread is inside save() at the fork: a sync save waiting in its callback (its turn
# taken), an async save waiting for the previous write (its turn taken), or a thread holding
# the lock an async save hands its write over under, or the one its capture allocates its
# file image under. The child then saves with the manager it
# inherited and closes it; the parent waits for it at most 30 s.
FORK_WHILE_SAVING = textwrap.dedent(
    """
    import os, sys, threading, time, torch
    from fastckpt import CheckpointManager
    from fastckpt.container import incremental
    from fastckpt.io import images
    from fastckpt.storage import backend

    torch.set_num_threads(1)  # torch's own pool does not survive a fork either
    root, mode, held = sys.argv[1:4]
    config = (CheckpointManager.Config.with_sync_save() if mode == "sync"
              else CheckpointManager.Config.with_async_save())
    config.save.wait_timeout_secs = 120
    release = threading.Event()

    def hold(checkpoint_id, logger):
        if str(checkpoint_id).endswith("parent-1"):
            release.wait(60)

    config.pre_finalize_callback = hold
    manager = CheckpointManager(config)

    def parent_saves():
        manager.save(f"{root}/parent-1", {"w": torch.full((8,), 1.0)})
        # async: this save waits inside save() for the first write, its turn taken
        manager.save(f"{root}/parent-2", {"w": torch.full((8,), 2.0)})

    locks = {
        "turn": manager._save_turn,
        "hand-over": manager._closing_lock,  # what a thread handing its write over holds
        "staging": manager._images._lock,  # what a capture allocating its file image holds
        "fingerprint": incremental._LOCK,  # what a save fingerprinting its tensors holds
        "images": images._IMAGES_LOCK,  # what a save looking up its file images holds
        "staged": backend._STAGED_LOCK,  # what a save registering its staging folder holds
    }
    lock = locks[held]

    def holding():
        with lock:
            release.wait(60)

    thread = threading.Thread(target=parent_saves if held == "turn" else holding)
    thread.start()
    while lock.acquire(blocking=False):  # until the thread holds it
        lock.release()
        time.sleep(0.001)
    time.sleep(0.2)
    pid = os.fork()
    if pid == 0:
        try:
            future = manager.save(f"{root}/child", {"w": torch.full((8,), 3.0)})
            if future is not None:
                future.result(timeout=60)
            manager.close()
        except BaseException as err:
            print("child failed:", repr(err), flush=True)
            os._exit(1)
        os._exit(0)
    deadline = time.monotonic() + 30
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            print("child exit", os.waitstatus_to_exitcode(status), flush=True)
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            print("child hung", flush=True)
            break
        time.sleep(0.05)
    release.set()
    thread.join()
    if held != "turn":
        manager.save(f"{root}/parent-1", {"w": torch.full((8,), 1.0)})
        manager.save(f"{root}/parent-2", {"w": torch.full((8,), 2.0)})
    manager.close()
    print("parent done", flush=True)
    """
)


@pytest.mark.parametrize(
    ("mode", "held"),
    [
        ("sync", "turn"),
        ("async", "turn"),
        ("async", "hand-over"),
        ("async", "staging"),
        ("sync", "fingerprint"),
        ("async", "images"),
        ("sync", "staged"),
    ],
)
def test_a_child_forked_while_a_thread_saves_saves_with_the_manager_it_inherited(
    tmp_path: Path, mode: str, held: str
) -> None:
    """Before, the child hung forever in its first save: the manager's save turn (or the
    lock an async save hands its write over under, or its file images' lock) was inherited
    held by a parent thread that does not exist in the child. The child now gets them anew,
    saves and closes; the parent's saves are the parent's."""
    script = tmp_path / "fork_while_saving.py"
    script.write_text(FORK_WHILE_SAVING)
    root = tmp_path / "runs"
    result = subprocess.run(
        [sys.executable, str(script), str(root), mode, held],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert "child exit 0" in result.stdout, (result.stdout, result.stderr)
    assert "parent done" in result.stdout, (result.stdout, result.stderr)
    for name, value in (("parent-1", 1.0), ("parent-2", 2.0), ("child", 3.0)):
        assert torch.equal(manager_load(root / name)["w"], torch.full((8,), value)), name
