"""A save whose background writer thread cannot start fails typed, naming the limit.

Before, ``save_checkpoint`` at the process's thread limit raised CPython's bare
``RuntimeError("can't start new thread")`` from the index writer's thread pool, naming no
file and no fix. The refusal is simulated where CPython raises it (``Thread.start`` of the
writer's pool thread); the real limit (a pids cgroup, ``ulimit -u``) ends in the same call.
"""

from __future__ import annotations

import errno
import sys
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


def _refuse_threads(monkeypatch: pytest.MonkeyPatch, prefix: str) -> None:
    """Make ``Thread.start`` fail as CPython does at the thread limit, for names ``prefix*``."""
    real_start = threading.Thread.start

    def start(thread: threading.Thread, *args: Any, **kwargs: Any) -> None:
        if thread.name.startswith(prefix):
            raise RuntimeError("can't start new thread")
        real_start(thread, *args, **kwargs)

    monkeypatch.setattr(threading.Thread, "start", start)


@pytest.mark.parametrize("strict", [False, True])
def test_an_async_hook_whose_writer_thread_cannot_start_reports_it_as_a_failed_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, strict: bool
) -> None:
    """Before, CPython's bare RuntimeError escaped the hook's error handling: a run with
    ``strict_saves=False`` stopped at its first save, ``on_save_error`` never called."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import training_support as support

    errors: list[BaseException] = []
    hook = fastckpt.CheckpointHook(
        tmp_path / "root",
        step_interval=2,
        async_save=True,
        strict_saves=strict,
        on_save_error=None if strict else errors.append,
    )
    strategy = support.new_strategy([hook], num_steps=4)
    _refuse_threads(monkeypatch, "fastckpt-hook_")  # the writer's own thread, not its capture's
    if strict:
        with pytest.raises(OSError) as caught:
            strategy.run(support.loader())
        assert caught.value.errno == errno.EAGAIN and "thread limit" in str(caught.value)
        return
    with pytest.raises(OSError) as caught:  # the last failure is raised at close, once
        strategy.run(support.loader())
    assert caught.value.errno == errno.EAGAIN
    assert strategy.step_count == 4  # training went on past the failed saves
    assert len(errors) >= 2 and all(
        isinstance(e, OSError) and e.errno == errno.EAGAIN for e in errors
    ), errors
    assert fastckpt.list_checkpoints(tmp_path / "root") == []


def test_a_save_whose_writer_thread_started_only_later_is_not_written_then(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review 2 of the first version: the pool queues the work before its thread fails to
    start, so the refused save stayed queued and the next save's thread ran it, unwatched,
    writing the current tensors under the old step's index (its capture signalled before the
    new save's ran). Here the first start is refused, the later ones are not: every save
    written is one that was accepted, each written once."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import training_support as support
    from fastckpt.container import background

    refused: list[str] = []
    real_start = threading.Thread.start

    def start(thread: threading.Thread, *args: Any, **kwargs: Any) -> None:
        if thread.name.startswith("fastckpt-hook_") and not refused:
            refused.append(thread.name)
            raise RuntimeError("can't start new thread")
        real_start(thread, *args, **kwargs)

    executed: list[int] = []
    real_execute = background.BackgroundWriter._execute

    def execute(writer: Any, future: Any, capture: Any, write: Any) -> None:
        executed.append(len(executed))
        real_execute(writer, future, capture, write)

    monkeypatch.setattr(threading.Thread, "start", start)
    monkeypatch.setattr(background.BackgroundWriter, "_execute", execute)
    errors: list[BaseException] = []
    hook = fastckpt.CheckpointHook(
        tmp_path / "root",
        step_interval=2,
        async_save=True,
        strict_saves=False,
        on_save_error=errors.append,
    )
    strategy = support.new_strategy([hook], num_steps=6)
    strategy.run(support.loader())
    assert refused and len(errors) == 1  # the save at step 2, reported
    assert len(executed) == 2  # steps 4 and 6: the refused one never ran
    assert not hook._changed_in_forward  # no unwatched write failing on a moved state
    assert [c["index"] for c in fastckpt.list_checkpoints(tmp_path / "root")] == [0, 1]
    assert all(fastckpt.verify(tmp_path / "root", i).ok for i in (0, 1))


def test_an_async_hook_whose_capture_thread_cannot_start_fails_typed_at_the_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review 3: the capture thread's refusal (made when the hook is entered) escaped as
    CPython's bare RuntimeError, and the pool left without a thread was never warmed again."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import training_support as support

    hook = fastckpt.CheckpointHook(tmp_path / "root", step_interval=2, async_save=True)
    strategy = support.new_strategy([hook], num_steps=2)
    _refuse_threads(monkeypatch, "fastckpt-hook-capture")
    with pytest.raises(OSError) as caught:
        strategy.run(support.loader())
    assert caught.value.errno == errno.EAGAIN and "thread limit" in str(caught.value)
    monkeypatch.undo()
    strategy.run(support.loader())  # the limit lifted: the same hook starts and saves
    assert [c["index"] for c in fastckpt.list_checkpoints(tmp_path / "root")] == [0]
