"""Module-wide locks that a forked child can take.

``os.fork()`` copies a lock as it is: one that another thread of the parent held at the fork
stays held in the child, where that thread does not exist, and the child's first save waits
for it forever (a DataLoader worker, a ``multiprocessing`` fork child). :class:`ForkSafeLock`
is a ``threading.Lock`` made anew in every child, for the locks fastckpt's modules keep for the
whole process (the state they guard is the parent's, and a child never finds it half
updated by a thread of its own).
"""

from __future__ import annotations

import os
import threading
import weakref
from types import TracebackType

__all__ = ["ForkSafeLock"]


class ForkSafeLock:
    """A ``threading.Lock`` (``with``, :meth:`acquire`, :meth:`release`) that is free in the
    child of ``os.fork()`` whoever held it in the parent."""

    def __init__(self) -> None:
        """A free lock."""
        self._lock = threading.Lock()
        _LOCKS.add(self)

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        """As ``threading.Lock.acquire``."""
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        """As ``threading.Lock.release``."""
        self._lock.release()

    def __enter__(self) -> ForkSafeLock:
        self._lock.acquire()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self._lock.release()

    def _after_fork(self) -> None:
        self._lock = threading.Lock()


_LOCKS: weakref.WeakSet[ForkSafeLock] = weakref.WeakSet()


def _free_in_child() -> None:
    for lock in list(_LOCKS):
        lock._after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_free_in_child)
