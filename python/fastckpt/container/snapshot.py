"""Consistent reads: a commit record and the files it names, as one snapshot, while a writer
may replace them.

A reader opens a record, then the files it names, without a lock. A writer replacing the
checkpoint meanwhile (a save of the same index or id, a prune) can make a file the record
named vanish or differ from its record, or withdraw the index for the moment of a
replacement. Such errors are not damage: :func:`read_consistently` tells them apart by
looking again, and reads again, a bounded number of times:

* the record's content changed since the read began: a writer committed meanwhile, read again;
* the record did not change, but a writer holds the root's lock and the error says the index or
  a file is missing (a replacement withdraws the index before it commits the new one): wait
  (bounded) for the record to change, then read again;
* otherwise the error is real (the files do not match a record no one is changing) and is
  raised as it is.

Every file is checked against the record it was read with, so what a read returns is always
one committed version, old or new, never a mixture.
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from fastckpt import _native
from fastckpt.errors import CheckpointFormatError, ChecksumMismatchError, FastCkptError
from fastckpt.storage.lock import LOCK_FILE, replacing
from fastckpt.storage.registry import backend_for, is_local

__all__ = [
    "ATTEMPTS",
    "WRITER_WAIT_SECS",
    "check_consistently",
    "fingerprint",
    "read_consistently",
    "wait_out_replacement",
]

T = TypeVar("T")

#: How many times a read is tried while the record keeps changing underneath it.
ATTEMPTS = 50
#: How long a reader waits for a writer that holds the lock to commit, when the record says
#: the requested checkpoint is not there (seconds).
WRITER_WAIT_SECS = 5.0
#: What a concurrent replacement can make a read raise.
_RACY = (ChecksumMismatchError, CheckpointFormatError, FileNotFoundError, KeyError)
_MISSING = (FileNotFoundError, KeyError)
_FINGERPRINT_LIMIT = 1 << 30


def fingerprint(record: Path) -> tuple[object, ...] | None:
    """``(inode, mtime, ctime, size, crc32c)`` of a commit record, or None when it cannot be
    read (absent, not a regular file, a symlink, too large): what tells a reader that a writer
    committed. The file's identity counts, not only its content: a writer alternating two
    states writes the same bytes again (old, new, old), in a new file each time. On an object
    store: the object's ``(size, modified, entity tag)`` from one HEAD (before, None there
    every time, so a read or verify racing a prune never looked again: the pruned index was
    reported as damage)."""
    backend = backend_for(record)
    if not is_local(backend):
        try:
            stored = backend.stat(record)
        except (OSError, FastCkptError):
            return None
        return (stored.size, stored.modified, stored.version) if stored.regular else None
    try:
        fd = os.open(record, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > _FINGERPRINT_LIMIT:
            return None
        crc = size = 0
        while piece := os.read(fd, 1 << 20):
            crc = _native.crc32c(piece, crc)
            size += len(piece)
        return info.st_ino, info.st_mtime_ns, info.st_ctime_ns, size, crc
    except OSError:
        return None
    finally:
        os.close(fd)


def _writer_active(root: Path) -> bool:
    """Whether a writer may hold ``root``'s lock: its lock file is there (on an object
    store, the lease object; a dead writer's too, which the bounded wait absorbs)."""
    backend = backend_for(root)
    if is_local(backend):
        return os.path.lexists(root / LOCK_FILE)
    try:
        return backend.exists(root / LOCK_FILE)
    except (OSError, FastCkptError):
        return False


def read_consistently(record: Path, read: Callable[[], T], *, lock_root: Path | None = None) -> T:
    """Run ``read`` (which reads ``record`` and the files it names) until it returns a
    snapshot of one committed version (see the module docstring).

    Args:
        record: the commit record (``ROOT/manifest.json`` or ``CKPT/commit.json``).
        read: the whole read; it must have no effect but its result when it raises.
        lock_root: the directory whose writer lock a replacement holds (a root), or None
            (a CheckpointManager checkpoint is replaced by one atomic exchange: no wait).

    Raises:
        Whatever ``read`` raises when the error is real, or after :data:`ATTEMPTS` reads that
        all raced a writer.
    """
    pause = 0.001
    for attempt in range(ATTEMPTS):
        if lock_root is not None:
            wait_out_replacement(lock_root)
        before = fingerprint(record)
        try:
            return read()
        except _RACY as err:
            if attempt == ATTEMPTS - 1:
                raise
            if fingerprint(record) == before and not (
                lock_root is not None
                and isinstance(err, _MISSING)
                and _writer_active(lock_root)
                and _wait_for_change(record, before, lock_root)
            ):
                raise
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
    raise AssertionError("unreachable")  # pragma: no cover


def check_consistently(
    record: Path,
    check: Callable[[], T],
    problem: Callable[[T], str | None],
    *,
    lock_root: Path | None = None,
    attempts: int = 3,
) -> T:
    """:func:`read_consistently` for a check that reports damage instead of raising it
    (``fastckpt.verify``): ``check`` runs again while ``problem`` of its result (None: no
    problem; ``"missing"``: a file or index was missing; anything else: other damage) may
    come from a writer replacing or pruning what it checked: the record changed meanwhile,
    or something was missing while a writer holds ``lock_root``'s lock (waited for, as a
    read waits), at most ``attempts`` times in all (a whole check can be long, and real
    damage found while a writer keeps saving would otherwise be checked again and again).
    Returns the last result: damage no writer explains is reported as found."""
    pause = 0.001
    for attempt in range(attempts):
        before = fingerprint(record)
        result = check()
        found = problem(result)
        if found is None or attempt == attempts - 1:
            return result
        if fingerprint(record) == before and not (
            lock_root is not None
            and found == "missing"
            and _writer_active(lock_root)
            and _wait_for_change(record, before, lock_root)
        ):
            return result
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
    raise AssertionError("unreachable")  # pragma: no cover


def wait_out_replacement(root: Path) -> None:
    """Wait (at most :data:`WRITER_WAIT_SECS`) while a live writer replaces a committed index
    of ``root`` (withdrawn from the manifest until its new version is committed, see
    :func:`~fastckpt.storage.lock.replacing`): a read meanwhile would find that index gone,
    and take an older one for the newest."""
    deadline = time.monotonic() + WRITER_WAIT_SECS
    while replacing(root) is not None and time.monotonic() < deadline:
        time.sleep(0.002)


def _wait_for_change(record: Path, before: tuple[object, ...] | None, root: Path) -> bool:
    """Wait (at most :data:`WRITER_WAIT_SECS`) while a writer holds ``root``'s lock for
    ``record`` to change or the writer to finish; whether one of them happened."""
    deadline = time.monotonic() + WRITER_WAIT_SECS
    # Each look is a stat locally, two requests (HEADs) on an object store: poll gently there.
    pause = 0.002 if is_local(backend_for(root)) else 0.1
    while time.monotonic() < deadline:
        time.sleep(pause)
        if fingerprint(record) != before:
            return True
        if not _writer_active(root):
            return True  # the writer finished (it may have set files aside): read once more
    return False
