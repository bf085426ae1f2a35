"""Threads of one process (round 19's threads tester).

One ``safe_open`` handle used by several threads, ``close()`` on one while another reads:
before, ``close()`` closed the descriptors at once under a read in flight: the read went on
with a number that another ``open`` then took, and returned another file's bytes (a partial
slice, unverified by default), blamed this intact file's checksum (a whole read), or raised
a bare ``EBADF``. Now a read in flight finishes with the right bytes and its files close when
it ends; reads started after ``close()`` raise ``HandleClosedError``.

A sync ``CheckpointManager`` closed on one thread while another saves: see below.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import fastckpt
import fastckpt.container.lazy as lazy
from fastckpt.container.lazy import HandleClosedError, safe_open


@pytest.mark.parametrize("read", ["slice", "tensor"])
def test_a_handle_closed_under_a_read_gives_that_read_its_own_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, read: str
) -> None:
    rows = 4096
    first, other = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    fastckpt.save_file({"big": torch.ones(rows, 64)}, first)
    fastckpt.save_file({"big": torch.full((rows, 64), 2.0)}, other)

    started, closed = threading.Event(), threading.Event()
    original_into, original_exact = lazy.pread_into, lazy.pread_exact

    def paused() -> None:  # the read is in flight: wait until the handle was closed
        if not started.is_set():
            started.set()
            assert closed.wait(30)

    def pread_into(fd: int, offset: int, target: np.ndarray, where: str) -> None:
        paused()
        original_into(fd, offset, target, where)

    def pread_exact(fd: int, offset: int, length: int, where: str) -> bytes:
        paused()
        return original_exact(fd, offset, length, where)

    monkeypatch.setattr(lazy, "pread_into", pread_into)
    monkeypatch.setattr(lazy, "pread_exact", pread_exact)
    handle = safe_open(first)
    result: dict[str, Any] = {}

    def reader() -> None:
        try:
            if read == "tensor":
                result["value"] = handle.get_tensor("big")  # verified
            else:
                result["value"] = handle.get_slice("big")[0 : rows - 1]  # unverified
        except BaseException as err:
            result["error"] = err

    thread = threading.Thread(target=reader)
    thread.start()
    assert started.wait(30)
    handle.close()
    others = [safe_open(other) for _ in range(3)]  # would take a freed descriptor number
    closed.set()
    thread.join(30)
    for opened in others:
        opened.close()
    assert "error" not in result, result
    assert bool((result["value"] == 1.0).all())
    with pytest.raises(HandleClosedError):
        handle.get_tensor("big")


def test_closing_a_sync_manager_waits_for_a_save_running_on_another_thread(
    tmp_path: Path,
) -> None:
    """Before, ``close()`` of a sync manager returned at once while another thread's
    ``save()`` was writing: the documented shutdown pattern (a SIGTERM handler running
    ``manager.close(); os._exit(0)``) then lost that checkpoint and left its staging folder.
    Now close() returns once that save is committed; a save after it is refused."""
    state = {"model": {f"w{i}": torch.randn(512, 1024) for i in range(32)}}  # 64 MiB
    manager = fastckpt.CheckpointManager(fastckpt.CheckpointManager.Config.with_sync_save())
    errors: list[BaseException] = []

    def save() -> None:
        try:
            manager.save(tmp_path / "ckpt", state)
        except BaseException as err:
            errors.append(err)

    thread = threading.Thread(target=save)
    thread.start()
    deadline = time.monotonic() + 60
    while not any(name.startswith(".tmp-ckpt") for name in os.listdir(tmp_path)):
        assert time.monotonic() < deadline and thread.is_alive(), "the save never started"
        time.sleep(0.001)
    manager.close()
    assert (tmp_path / "ckpt" / "commit.json").exists()  # committed before close() returned
    thread.join(60)
    assert errors == []
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    with pytest.raises(RuntimeError, match="closed"):
        manager.save(tmp_path / "later", state)
    with fastckpt.CheckpointManager() as reader:
        loaded = reader.load(tmp_path / "ckpt")
    assert torch.equal(loaded["model"]["w31"], state["model"]["w31"])


def test_a_close_from_a_saves_callback_while_another_thread_closes_does_not_hang(
    tmp_path: Path,
) -> None:
    """Review of the first version of the wait above: thread A's close() waited for thread
    B's save, whose finalize_callback called close() and waited for A's close: both hung for
    good. The callback's close() now returns; A's completes once B's save ends."""
    in_callback, closing = threading.Event(), threading.Event()
    config = fastckpt.CheckpointManager.Config.with_sync_save()
    holder: dict[str, fastckpt.CheckpointManager] = {}

    def finalize(checkpoint_id: Any, logger: Any) -> None:
        in_callback.set()
        assert closing.wait(30)
        time.sleep(0.2)  # A's close() is waiting for this save by now
        holder["manager"].close()

    config.finalize_callback = finalize
    manager = holder["manager"] = fastckpt.CheckpointManager(config)
    saver = threading.Thread(target=manager.save, args=(tmp_path / "ckpt", {"x": torch.ones(4)}))
    saver.start()
    assert in_callback.wait(30)
    closer = threading.Thread(target=manager.close)
    closer.start()
    closing.set()
    closer.join(30)
    saver.join(30)
    assert not closer.is_alive() and not saver.is_alive()
    assert (tmp_path / "ckpt" / "commit.json").exists()


def test_a_child_forked_during_a_read_closes_its_copy_of_the_handle(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review of the deferred close: a child forked while a parent thread was reading
    inherited the read count, so its close() left the files open for its whole life."""
    path = tmp_path / "a.safetensors"
    fastckpt.save_file({"big": torch.ones(1024, 64)}, path)
    started, release = threading.Event(), threading.Event()
    original = lazy.pread_into

    def pread_into(fd: int, offset: int, target: np.ndarray, where: str) -> None:
        started.set()
        assert release.wait(30)
        original(fd, offset, target, where)

    monkeypatch.setattr(lazy, "pread_into", pread_into)
    handle = safe_open(path)
    reader = threading.Thread(target=lambda: handle.get_slice("big")[0:1000])
    reader.start()
    assert started.wait(30)
    child = os.fork()
    if child == 0:  # the child: no reader thread here
        handle.close()
        still_open = any(
            os.path.realpath(f"/proc/self/fd/{fd}") == str(path)
            for fd in os.listdir("/proc/self/fd")
        )
        os._exit(1 if still_open else 0)
    _, status = os.waitpid(child, 0)
    release.set()
    reader.join(30)
    handle.close()
    assert os.waitstatus_to_exitcode(status) == 0


_SIGTERM_DURING_ASYNC_SAVE = """
import os, signal, sys, threading, time
from pathlib import Path
import torch, fastckpt

root = Path(sys.argv[1])
config = fastckpt.CheckpointManager.Config()
config.pre_finalize_callback = lambda checkpoint_id, logger: time.sleep(2.0)  # a slow write
manager = fastckpt.CheckpointManager(config)

def handler(signum, frame):
    manager.close()
    os._exit(0)

signal.signal(signal.SIGTERM, handler)
manager.save(root / "ck1", {"x": torch.ones(4)})
threading.Timer(0.3, manager.close).start()  # another thread closes while ck2's save waits
threading.Timer(0.6, lambda: os.kill(os.getpid(), signal.SIGTERM)).start()
try:
    manager.save(root / "ck2", {"x": torch.ones(4)})  # waits for ck1's write
except RuntimeError:
    pass
time.sleep(10)
os._exit(3)
"""


def test_a_sigterm_close_inside_an_async_save_waits_for_the_last_write(tmp_path: Path) -> None:
    """Review 3 of the early return above: it first covered the whole of save(), so a
    SIGTERM handler's close() on a thread inside an async save (waiting for the previous
    write) returned at once while another thread closed, and ``os._exit(0)`` lost that
    write. It covers a sync save's finalize_callback only now."""
    done = subprocess.run(
        [sys.executable, "-c", _SIGTERM_DURING_ASYNC_SAVE, str(tmp_path)], timeout=120
    )
    assert done.returncode == 0
    assert (tmp_path / "ck1" / "commit.json").exists()
