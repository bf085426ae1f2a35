"""BackgroundWriter runs captures at the caller's priority and writes at a lowered one.

Training waits for a capture before its next optimizer step; a capture running at the writer's
lowered priority would make it wait longer while training threads hold the CPU.
"""

from __future__ import annotations

import os
import threading

import pytest

from fastckpt.container.background import BACKGROUND_NICE, BackgroundWriter


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_capture_runs_at_the_callers_priority_and_the_write_lower() -> None:
    mine = _nice()
    seen: dict[str, int] = {}
    writer: BackgroundWriter[int] = BackgroundWriter("prio", wait_timeout=30)
    try:
        for round_ in range(2):  # the second save reuses both threads
            seen.clear()

            def capture() -> None:
                seen["capture"] = _nice()
                seen["capture_thread"] = threading.get_native_id()

            def write(round_: int = round_) -> int:
                seen["write"] = _nice()
                seen["write_thread"] = threading.get_native_id()
                return round_

            writer.submit(f"round {round_}", write, capture=capture)
            with writer.guard():  # returns once the capture is done
                assert "capture" in seen
            assert writer.collect() == round_
            assert seen["capture"] == mine
            assert seen["write"] == min(19, mine + BACKGROUND_NICE)
            assert seen["capture_thread"] != seen["write_thread"]
            assert threading.get_native_id() not in (seen["capture_thread"], seen["write_thread"])
    finally:
        writer.close()
    assert _nice() == mine


def test_a_failing_capture_fails_the_write_once_and_releases_the_guard() -> None:
    writer: BackgroundWriter[int] = BackgroundWriter("prio", wait_timeout=30)
    wrote: list[int] = []

    def bad_capture() -> None:
        raise ValueError("capture broke")

    def write() -> int:
        wrote.append(1)
        return 1

    try:
        writer.submit("bad", write, capture=bad_capture)
        with writer.guard():  # not stuck behind the failed capture
            pass
        with pytest.raises(RuntimeError, match="bad") as info:
            writer.collect()
        assert isinstance(info.value.__cause__, ValueError)
        assert wrote == []  # the write never ran on a failed capture
        writer.submit("good", lambda: 2, capture=lambda: None)
        assert writer.collect() == 2
    finally:
        writer.close()
    assert not writer.running
