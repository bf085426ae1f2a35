"""The root lock: one process at a time saves into (or prunes) a checkpoint root."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import stat
import threading
import time
import weakref
from pathlib import Path
from typing import Any

from fastckpt.errors import CheckpointFormatError, ConcurrentSaveError
from fastckpt.io.paths import is_ascii_decimal
from fastckpt.storage.access import NO_ROOM, access_note, free_space_advice
from fastckpt.storage.identity import HOST

__all__ = [
    "LOCK_FILE",
    "REPLACING",
    "WARN_AFTER_SECS",
    "RootLock",
    "checked_lock_timeout",
    "lock_holder",
    "reentry_error",
    "replacing",
]

LOCK_FILE = ".fastckpt.lock"
#: How long an acquirer waits before it logs who holds the lock (seconds).
WARN_AFTER_SECS = 1.0
_LOG = logging.getLogger(__name__)
_READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC

#: The lock files' descriptors this process has open (held locks, and locks being taken), and
#: the RootLocks that hold one: a forked child closes and forgets them
#: (:func:`_forget_in_child`). Changed under :data:`_GUARD`, which a fork holds, so a child
#: never inherits a descriptor this set does not name.
_OPEN: set[int] = set()
_HELD: weakref.WeakSet[RootLock] = weakref.WeakSet()
_GUARD = threading.RLock()  # re-entrant: a finalizer's close may run inside a guarded block


def _open_tracked(path: str | os.PathLike[str], flags: int, mode: int = 0o644) -> int:
    """``os.open`` of a lock file whose descriptor a forked child closes (see :data:`_OPEN`):
    for each one that may take a ``flock``."""
    with _GUARD:
        fd = os.open(path, flags, mode)
        _OPEN.add(fd)
    return fd


def _close(fd: int) -> None:
    """Close a lock file's descriptor (and stop tracking it)."""
    with _GUARD:
        _OPEN.discard(fd)
        os.close(fd)


def _forget_in_child() -> None:
    """In a forked child: the parent's locks are not the child's. No thread of the child is
    inside a locked section or waiting for a lock (only the forking thread exists there), yet
    the child inherited each lock file's descriptor, and a ``flock`` belongs to the open file
    description: the child held the parent's lock too, so its own save into that root waited
    for itself forever, even after the parent released it. Each such descriptor is closed
    here (the parent keeps its lock), and the child's copies of the held locks say they are
    not held."""
    for fd in _OPEN:
        with contextlib.suppress(OSError):
            os.close(fd)
    _OPEN.clear()
    for lock in list(_HELD):
        lock._drop()
    _GUARD.release()  # taken by the forking thread before the fork


if hasattr(os, "register_at_fork"):
    os.register_at_fork(
        before=_GUARD.acquire, after_in_parent=_GUARD.release, after_in_child=_forget_in_child
    )


def lock_holder(root: str | os.PathLike[str]) -> str:
    """Who holds ``root``'s lock, as its lock file says (``pid N on host H``), for messages;
    ``an unknown process`` when it does not say (or is not a regular file)."""
    try:
        fd = os.open(os.path.join(root, LOCK_FILE), _READ_FLAGS)
    except OSError:
        return "an unknown process"
    try:
        text = os.read(fd, 256).decode("ascii", "replace").split()
    except OSError:
        text = []
    finally:
        os.close(fd)
    if len(text) >= 2 and is_ascii_decimal(text[0]):
        return f"pid {text[0]} on host {text[1]}"
    return "an unknown process"


#: What a holder replacing a committed index says it does (``pid host replacing <index>``).
REPLACING = "replacing"


def replacing(root: str | os.PathLike[str]) -> int | None:
    """The index a live writer of ``root`` is replacing (it withdrew the index from the
    manifest until the new one is committed), as its lock file says; None when no process
    holds the lock (a dead writer's file says nothing) or it does something else."""
    try:
        fd = _open_tracked(os.path.join(root, LOCK_FILE), _READ_FLAGS)
    except OSError:
        return None
    try:
        words = os.read(fd, 256).decode("ascii", "replace").split()
        if len(words) != 4 or words[2] != REPLACING or not is_ascii_decimal(words[3]):
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # taken: nobody holds the lock
        except BlockingIOError:
            return int(words[3])
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    except OSError:
        return None
    finally:
        _close(fd)


def _say_holder(fd: int, doing: str = "") -> None:
    """Write ``pid host`` (and what the holder does) into the held lock file, for
    :func:`lock_holder` and :func:`replacing` (best effort: a full disk must not stop a save
    that needs no new space)."""
    line = f"{os.getpid()} {HOST}" + (f" {doing}" if doing else "")
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{line}\n".encode(), 0)
    except OSError:
        pass


def checked_lock_timeout(timeout: object) -> float | None:
    """``timeout`` (a save's or prune's ``lock_timeout``) when it is None or a number of
    seconds >= 0 (``inf`` waits forever).

    Raises:
        TypeError: not a number (``"5"``).
        ValueError: negative or NaN.
    """
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"lock_timeout must be a number of seconds or None (wait), got {timeout!r}")
    if not timeout >= 0:
        raise ValueError(f"lock_timeout must be >= 0 seconds or None (wait), got {timeout!r}")
    return float(timeout)


def reentry_error(root: str | os.PathLike[str]) -> ConcurrentSaveError:
    """The error for taking ``root``'s lock (a local flock or an object store's lease) on a
    thread that already holds it: waiting would be waiting for itself, forever."""
    return ConcurrentSaveError(
        f"{root}: this thread already holds the root's lock ({LOCK_FILE}): a save or prune "
        "into it is under way on this thread and was interrupted (a signal handler that "
        "saves?), or the caller holds the root's lock; this one would wait for it forever. "
        "Nothing was written. In a signal handler, set a flag and save once the interrupted "
        "save has returned (TrainingStrategy.run holds SIGTERM/SIGINT until the step is done, "
        "so a handler there may save)"
    )


class RootLock:
    """Exclusive inter-process lock on a checkpoint root: ``flock`` on ``ROOT/.fastckpt.lock``.

    The kernel releases a ``flock`` when its holder exits, however it exits (SIGKILL
    included), so a crashed writer never leaves a stale lock. The lock file is deleted on
    release; an acquirer that locked a file deleted meanwhile notices (inode check) and
    retries, so two processes can never both believe they hold the lock. Each
    :class:`RootLock` object is one lock owner: two objects exclude each other even inside one
    process (on the thread that holds one, taking another raises
    :class:`~fastckpt.errors.ConcurrentSaveError` instead of waiting for itself forever), and
    a child forked while the lock is held does not hold it. Works on local
    filesystems and on NFS (where Linux maps ``flock`` to POSIX locks).

    Use as a context manager, or :meth:`acquire` / :meth:`release`.
    """

    def __init__(self, root: str | os.PathLike[str], *, timeout: float | None = None) -> None:
        """Prepare to lock ``root`` (which must exist); ``timeout`` None waits forever.

        Raises:
            TypeError / ValueError: ``timeout`` is no number of seconds >= 0 (see
                :func:`checked_lock_timeout`).
        """
        self.path = Path(root) / LOCK_FILE
        self.timeout = checked_lock_timeout(timeout)
        self._fd: int | None = None
        self._thread: int | None = None  # the thread that acquired the lock
        self._finalizer: weakref.finalize[Any, Any] | None = None

    @property
    def held(self) -> bool:
        """Whether this object holds the lock."""
        return self._fd is not None

    def acquire(self) -> None:
        """Block until the lock is held.

        Raises:
            TimeoutError: ``timeout`` elapsed first (the message names the lock file).
            PermissionError / OSError: the lock file cannot be created (a root another user
                owns, a read-only filesystem, a full disk): the message names the root and
                the fix.
        """
        if self._fd is not None:
            raise RuntimeError(f"{self.path}: already held by this RootLock")
        self._refuse_waiting_for_this_thread()
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        while True:
            fd = self._open()
            try:
                self._flock(fd, deadline)
                if self._is_current(fd):
                    _say_holder(fd)
                    with _GUARD:
                        self._fd = fd
                        self._thread = threading.get_ident()
                        self._finalizer = weakref.finalize(self, _close, fd)
                        _HELD.add(self)
                    return
            except BaseException:
                _close(fd)
                raise
            _close(fd)  # we locked a lock file its previous holder had deleted: retry

    def _refuse_waiting_for_this_thread(self) -> None:
        """Refuse to wait for a lock of the same root that this thread holds: a signal
        handler saving into the root while the save it interrupted holds the lock (or a
        save inside a ``with RootLock(root)``) waited for itself forever, the warning naming
        this very process as the holder. Another thread's lock is waited for as usual.

        Raises:
            ConcurrentSaveError: names the root and the fix; nothing was written.
        """
        me = threading.get_ident()
        with _GUARD:
            mine = [lock for lock in _HELD if lock.held and lock._thread == me]
        for lock in mine:
            if os.path.realpath(lock.path) == os.path.realpath(self.path):
                raise reentry_error(self.path.parent)

    def _open(self) -> int:
        """Open (create) the lock file: a regular file in the root, never a link followed (the
        holder writes into it)."""
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
        try:
            fd = _open_tracked(self.path, flags)
        except OSError as err:
            if err.errno in (errno.EACCES, errno.EPERM, errno.EROFS, *NO_ROOM):
                raise self._refused(err) from err
            if err.errno not in (errno.ELOOP, errno.EISDIR):
                raise
            fd = -1
        if fd < 0 or not stat.S_ISREG(os.fstat(fd).st_mode):
            if fd >= 0:
                _close(fd)
            raise CheckpointFormatError(
                f"{self.path}: not a regular file (a symlink, directory, FIFO or device in "
                "place of the root's lock file); remove it if no fastckpt process is saving "
                "into the root"
            )
        return fd

    def _refused(self, err: OSError) -> OSError:
        """The error for a lock file that cannot be created or opened for writing (``err``:
        ``EACCES``, ``EPERM``, ``EROFS``, ``ENOSPC`` or ``EDQUOT``): the same errno, the root
        as its path, and a message saying that the root cannot be written, that nothing was
        saved into it or deleted from it, and the fix (before: a bare error naming the lock
        file; for a full disk, often one out of inodes while ``df -h`` shows free space)."""
        root = self.path.parent
        code = err.errno if err.errno is not None else errno.EACCES
        if code == errno.EROFS:
            why = "it is on a read-only filesystem"
            fix = "remount it read-write, or save into a root on another filesystem"
        elif code in NO_ROOM:
            why = "its disk has no room left"
            fix = f"{free_space_advice(root)} and try again"
        else:
            refused = self.path if os.path.lexists(self.path) else root
            why = f"this user may not write to {refused} ({access_note(refused)})"
            fix = (
                "save or prune it as its owner, give this user write access to it (chmod, "
                "chown or an ACL), or save into another root"
            )
        return OSError(
            code,
            f"{os.strerror(code)}: cannot lock {root} to save into or prune it, as {why} (its "
            f"lock file {LOCK_FILE} cannot be created): nothing was saved into it or deleted "
            f"from it, and the checkpoints there are intact; {fix}",
            str(root),
        )

    def _flock(self, fd: int, deadline: float | None) -> None:
        """Take the flock, polling; after :data:`WARN_AFTER_SECS` log who holds it, and at
        the deadline raise a TimeoutError naming the holder."""
        pause = 0.001
        warn_at: float | None = time.monotonic() + WARN_AFTER_SECS
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    raise TimeoutError(
                        errno.ETIMEDOUT,
                        f"{lock_holder(self.path.parent)} holds {self.path} (it is saving into "
                        f"or pruning {self.path.parent}) and did not finish within "
                        f"{self.timeout} s; wait for it, stop it, or use another root",
                        str(self.path),
                    ) from None
                if warn_at is not None and now >= warn_at:
                    warn_at = None
                    _LOG.warning(
                        "waiting for %s, held by %s (saving into or pruning %s)%s",
                        self.path,
                        lock_holder(self.path.parent),
                        self.path.parent,
                        "" if self.timeout is None else f"; giving up after {self.timeout} s",
                    )
                    if deadline is None:
                        fcntl.flock(fd, fcntl.LOCK_EX)  # said who we wait for: now just wait
                        return
                time.sleep(pause)
                pause = min(pause * 2, 0.05)

    def _is_current(self, fd: int) -> bool:
        try:
            now = os.stat(self.path)
        except FileNotFoundError:
            return False
        mine = os.fstat(fd)
        return (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino)

    def announce(self, doing: str) -> None:
        """Say in the held lock file what this holder does (read by :func:`replacing`)."""
        if self._fd is None:
            raise RuntimeError(f"{self.path}: not held by this RootLock")
        _say_holder(self._fd, doing)

    def release(self) -> None:
        """Delete the lock file and release the lock (idempotent)."""
        fd = self._drop()
        if fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)
        finally:
            _close(fd)

    def _drop(self) -> int | None:
        """Stop holding: the lock file's descriptor (None when not held), for the caller to
        close (a forked child's copy of a held lock only forgets it: see
        :func:`_forget_in_child`)."""
        with _GUARD:
            fd, self._fd = self._fd, None
            _HELD.discard(self)
            if self._finalizer is not None:
                self._finalizer.detach()
                self._finalizer = None
        return fd

    def __enter__(self) -> RootLock:
        """Acquire on entry."""
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        """Release on exit."""
        self.release()
