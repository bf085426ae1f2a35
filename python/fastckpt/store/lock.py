"""The root lock: one process at a time saves into (or prunes) a checkpoint root."""

from __future__ import annotations

import errno
import fcntl
import os
import time
import weakref
from pathlib import Path
from typing import Any

__all__ = ["LOCK_FILE", "RootLock"]

LOCK_FILE = ".fastckpt.lock"


class RootLock:
    """Exclusive inter-process lock on a checkpoint root: ``flock`` on ``ROOT/.fastckpt.lock``.

    The kernel releases a ``flock`` when its holder exits, however it exits (SIGKILL
    included), so a crashed writer never leaves a stale lock. The lock file is deleted on
    release; an acquirer that locked a file deleted meanwhile notices (inode check) and
    retries, so two processes can never both believe they hold the lock. Each
    :class:`RootLock` object is one lock owner: two objects exclude each other even inside one
    process. Works on local filesystems and on NFS (where Linux maps ``flock`` to POSIX locks).

    Use as a context manager, or :meth:`acquire` / :meth:`release`.
    """

    def __init__(self, root: str | os.PathLike[str], *, timeout: float | None = None) -> None:
        """Prepare to lock ``root`` (which must exist); ``timeout`` None waits forever."""
        self.path = Path(root) / LOCK_FILE
        self.timeout = timeout
        self._fd: int | None = None
        self._finalizer: weakref.finalize[Any, Any] | None = None

    @property
    def held(self) -> bool:
        """Whether this object holds the lock."""
        return self._fd is not None

    def acquire(self) -> None:
        """Block until the lock is held.

        Raises:
            TimeoutError: ``timeout`` elapsed first (the message names the lock file).
            OSError: the lock file cannot be created (e.g. read-only root).
        """
        if self._fd is not None:
            raise RuntimeError(f"{self.path}: already held by this RootLock")
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                self._flock(fd, deadline)
                if self._is_current(fd):
                    self._fd = fd
                    self._finalizer = weakref.finalize(self, os.close, fd)
                    return
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)  # we locked a lock file its previous holder had deleted: retry

    def _flock(self, fd: int, deadline: float | None) -> None:
        if deadline is None:
            fcntl.flock(fd, fcntl.LOCK_EX)
            return
        pause = 0.001
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        errno.ETIMEDOUT,
                        f"another process is saving into {self.path.parent} (it holds "
                        f"{self.path}) and did not finish within {self.timeout} s; wait for "
                        "it or save into another root",
                        str(self.path),
                    ) from None
                time.sleep(pause)
                pause = min(pause * 2, 0.05)

    def _is_current(self, fd: int) -> bool:
        try:
            now = os.stat(self.path)
        except FileNotFoundError:
            return False
        mine = os.fstat(fd)
        return (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino)

    def release(self) -> None:
        """Delete the lock file and release the lock (idempotent)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        try:
            self.path.unlink(missing_ok=True)
        finally:
            os.close(fd)

    def __enter__(self) -> RootLock:
        """Acquire on entry."""
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        """Release on exit."""
        self.release()
