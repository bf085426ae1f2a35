"""Ctrl-C (and a SIGTERM handler) stop training between two steps, not inside one.

A training step fetches a batch (drawing from the RNGs), runs the model, then changes the
weights, the optimizer state, the schedulers and the counters one after the other. A
``KeyboardInterrupt`` raised in between leaves a state that is no step's: saved (the usual
``except KeyboardInterrupt: strategy.save_checkpoint(...)``), it verifies and loads, and the
resumed run trains a batch again, or with the optimizer a step ahead, or draws other random
numbers. While :class:`HeldSignals` is entered, the Python handlers of SIGINT and SIGTERM are
replaced by a recorder: the first signal is held until :meth:`HeldSignals.deliver` (called
between steps) runs the original handler there; a second one runs it at once (a hard stop,
the state then possibly between two steps).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any

import torch.utils.data

__all__ = ["HeldSignals"]

_HELD = (signal.SIGINT, signal.SIGTERM)

Handler = Callable[[int, FrameType | None], Any]

#: The outermost entered holder (a run inside a hook of another run shares it).
_ACTIVE: HeldSignals | None = None


def _forget_in_child() -> None:
    """In a forked child: the parent's run is not running here (a run the child starts
    holds its own signals)."""
    global _ACTIVE
    _ACTIVE = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


class HeldSignals:
    """Hold SIGINT and SIGTERM between :meth:`deliver` calls (see the module docstring).

    Only Python-level handlers can be held (the default ``KeyboardInterrupt`` one, a handler
    the script installed), and only on the main thread, where Python runs them; a signal
    whose action is the operating system's (SIGTERM's default: the process ends) is left
    alone, and so is everything on other threads.
    """

    def __init__(self) -> None:
        self._originals: dict[int, Handler] = {}
        self._came: tuple[int, FrameType | None] | None = None
        #: The holder of an enclosing run (this one then only delivers what it holds).
        self._outer: HeldSignals | None = None
        self._pid = os.getpid()
        self._stopped_at_once = False

    @property
    def stopped_at_once(self) -> bool:
        """Whether a second signal stopped training at once (inside a step)."""
        if self._outer is not None:
            return self._outer.stopped_at_once
        return self._stopped_at_once

    def __enter__(self) -> HeldSignals:
        global _ACTIVE
        if threading.current_thread() is not threading.main_thread():
            return self
        if _ACTIVE is not None:
            self._outer = _ACTIVE  # a run inside another's hook: its steps deliver too
            return self
        _ACTIVE = self
        for number in _HELD:
            handler = signal.getsignal(number)
            if callable(handler):
                self._originals[number] = handler
                signal.signal(number, self._record)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        global _ACTIVE
        if self._outer is not None:
            return
        if _ACTIVE is self:
            _ACTIVE = None
        originals, self._originals = self._originals, {}
        for number, handler in originals.items():
            signal.signal(number, handler)
        came, self._came = self._came, None
        if came is not None and kind is None and came[0] in originals:
            originals[came[0]](*came)  # training ended first: the signal takes effect now

    def deliver(self) -> None:
        """Between two steps: run the original handler of a signal held since the last
        call (a ``KeyboardInterrupt`` is raised from here; a handler that returns lets
        training go on, holding the next signal again)."""
        if self._outer is not None:
            self._outer.deliver()
            return
        came, self._came = self._came, None
        if came is not None:
            self._originals[came[0]](*came)

    def _record(self, number: int, frame: FrameType | None) -> None:
        if os.getpid() != self._pid:
            # A forked child inherited this handler. A DataLoader worker ignores the signal:
            # its parent stops it after the step (killed at once, the worker would fail the
            # parent's fetch instead of the interrupt being delivered). Any other child
            # (a pool's worker) handles it as it would have.
            if torch.utils.data.get_worker_info() is None:
                self._originals[number](number, frame)
            return
        if self._came is not None:  # asked twice: stop now
            held, self._came = self._came, None
            try:
                self._originals[number](number, frame)
            except BaseException:
                self._stopped_at_once = True  # it stopped training, inside a step
                raise
            self._came = held  # the handler returned: the held signal still waits
            return
        self._came = (number, frame)
        name = signal.Signals(number).name
        try:
            sys.stderr.write(
                f"fastckpt: {name} received: training stops after the current step "
                "(send it again to stop at once)\n"
            )
            sys.stderr.flush()
        except (OSError, ValueError, AttributeError):  # stderr closed: nowhere to say it
            pass
