"""A save whose background writer thread cannot start fails typed, naming the limit.

Before, ``save_checkpoint`` at the process's thread limit raised CPython's bare
``RuntimeError("can't start new thread")`` from the index writer's thread pool, naming no
file and no fix. The refusal is simulated where CPython raises it (``Thread.start`` of the
writer's pool thread); the real limit (a pids cgroup, ``ulimit -u``) ends in the same call.
"""

from __future__ import annotations

import errno
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import fastckpt


def test_a_save_whose_writer_thread_cannot_start_raises_a_typed_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "root"
    model = torch.nn.Linear(4, 4)
    fastckpt.save_checkpoint(root, models={"m": (model, None)})
    real_start = threading.Thread.start

    def start(thread: threading.Thread, *args: Any, **kwargs: Any) -> None:
        if thread.name.startswith("fastckpt-"):
            raise RuntimeError("can't start new thread")
        real_start(thread, *args, **kwargs)

    monkeypatch.setattr(threading.Thread, "start", start)
    with torch.no_grad():
        model.weight.add_(1.0)
    with pytest.raises(OSError) as caught:
        fastckpt.save_checkpoint(root, models={"m": (model, None)})
    assert caught.value.errno == errno.EAGAIN
    assert str(root) in str(caught.value) and "thread limit" in str(caught.value)
    monkeypatch.undo()
    assert [c["index"] for c in fastckpt.list_checkpoints(root)] == [0]
    assert fastckpt.verify(root, 0).ok
    fastckpt.save_checkpoint(root, models={"m": (model, None)})  # the next save works
    assert fastckpt.verify(root, 1).ok
