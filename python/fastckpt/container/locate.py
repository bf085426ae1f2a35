"""What a path names: a save_checkpoint root, one of its indices, a CheckpointManager
checkpoint, or a lone file."""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from fastckpt.errors import CheckpointFormatError
from fastckpt.format.records import COMMIT_RECORD, MANIFEST, SHARDED_RECORD
from fastckpt.io.paths import is_ascii_decimal
from fastckpt.storage.access import read_refused
from fastckpt.storage.backend import StorageBackend
from fastckpt.storage.registry import backend_for, display_path, is_local

__all__ = ["KIND_NAMES", "Kind", "Location", "locate"]

#: ``root``: a save_checkpoint root (``manifest.json`` inside). ``index``: one index
#: directory of such a root. ``manager``: a CheckpointManager checkpoint (``commit.json``
#: inside). ``sharded``: a sharded checkpoint of :mod:`fastckpt.dcp` (``fastckpt-dcp.json``
#: inside: ``dcp.save`` with ``fastckpt.dcp.Writer``, a CheckpointManager save of DTensor
#: state, or the sharded part of a strategy index). ``file``: a lone (safetensors) file.
Kind = Literal["root", "index", "manager", "sharded", "file"]
#: How each kind is called in messages.
KIND_NAMES: dict[str, str] = {
    "root": "save_checkpoint root",
    "index": "save_checkpoint index",
    "manager": "CheckpointManager checkpoint",
    "sharded": "sharded (DCP) checkpoint",
    "file": "safetensors file",
}


@dataclass
class Location:
    """What a path names.

    Attributes:
        kind: see :data:`Kind`.
        path: the path as given (``manifest.json`` / ``commit.json`` resolved to their
            directory).
        root: the save_checkpoint root (kinds root and index).
        index: the index directory's own index (kind index).
    """

    kind: Kind
    path: Path
    root: Path | None = None
    index: int | None = None


def locate(path_or_root: str | os.PathLike[str]) -> Location:
    """Work out what kind of checkpoint ``path_or_root`` names.

    Raises:
        FileNotFoundError: it does not exist, is neither a regular file nor a directory, or is
            a directory that is not a fastckpt checkpoint (the message says which).
        CheckpointFormatError: it holds a root's manifest and another checkpoint's record.
        PermissionError: this user may not look into it or a folder above it (the message
            names the folder, its owner and the fix).
    """
    path = Path(path_or_root)
    backend = backend_for(path)
    if not is_local(backend):
        return _locate_object(path, backend)
    if _is(path, stat.S_ISREG):
        if path.name in (MANIFEST, COMMIT_RECORD, SHARDED_RECORD):
            return locate(path.parent)
        return Location("file", path)
    if _is(path, stat.S_ISDIR):
        # A record that is there but damaged (a directory, a FIFO...) still says what the
        # directory is: verifying it then reports the damage.
        if _present(path / MANIFEST):
            others = [r for r in (COMMIT_RECORD, SHARDED_RECORD) if _present(path / r)]
            _one_kind(path, MANIFEST, others)
            return Location("root", path, root=path)
        if _present(path / COMMIT_RECORD):
            others = [SHARDED_RECORD] if _present(path / SHARDED_RECORD) else []
            _one_kind(path, COMMIT_RECORD, others)
            return Location("manager", path)
        if _present(path / SHARDED_RECORD):
            return Location("sharded", path)
        if is_ascii_decimal(path.name) and _present(path.parent / MANIFEST):
            return Location("index", path, root=path.parent, index=int(path.name))
        # A symbolic link (or a ``..``) to an index directory: its root is beside the target.
        real = Path(os.path.realpath(path))
        if is_ascii_decimal(real.name) and _present(real.parent / MANIFEST):
            return Location("index", real, root=real.parent, index=int(real.name))
        raise FileNotFoundError(
            errno.ENOENT,
            f"{path} is not a fastckpt checkpoint: no {MANIFEST} (save_checkpoint root), "
            f"{COMMIT_RECORD} (CheckpointManager checkpoint) or {SHARDED_RECORD} (sharded "
            "checkpoint) in it, and it is not an index directory of a root",
            str(path),
        )
    if os.path.lexists(path):
        raise FileNotFoundError(errno.ENOENT, f"{path}: not a regular file or directory", str(path))
    raise FileNotFoundError(errno.ENOENT, f"{path}: no such file or directory", str(path))


def _is(path: Path, kind: Callable[[int], bool]) -> bool:
    """Whether ``path`` (links followed) exists and is of ``kind`` (``stat.S_ISDIR``...).

    Raises:
        PermissionError: a folder above it may not be searched (:func:`read_refused`).
    """
    try:
        return kind(os.stat(path).st_mode)
    except PermissionError as err:
        raise read_refused(path, err) from err
    except (FileNotFoundError, NotADirectoryError, ValueError):
        return False
    except OSError as err:  # as ``Path.is_dir``: a dangling or looping link is no directory
        if err.errno in (errno.EBADF, errno.ELOOP):
            return False
        raise


def _present(path: Path) -> bool:
    """Whether ``path`` is there (a link counts, followed or not), as ``os.path.lexists``,
    but a folder this user may not search is said so, not taken for an empty one.

    Raises:
        PermissionError: its folder may not be searched (:func:`read_refused`, naming the
            folder: before, a checkpoint another user may not enter was "not a fastckpt
            checkpoint").
    """
    try:
        os.lstat(path)
    except PermissionError as err:
        raise read_refused(path.parent, err) from err
    except (OSError, ValueError):
        return False
    return True


#: What each record makes a folder, for messages.
_KIND_OF = {
    MANIFEST: "a save_checkpoint root",
    COMMIT_RECORD: "a CheckpointManager checkpoint",
    SHARDED_RECORD: "a sharded checkpoint",
}


def _one_kind(path: Path, record: str, others: list[str]) -> None:
    """A folder holding two kinds of records (``record`` and ``others`` found beside it) is
    neither: checking it as one kind would say nothing of the other's files (which share the
    folder), and a load could read one while ``verify`` checked the other.

    Raises:
        CheckpointFormatError: names both records and the fix.
    """
    if others:
        raise CheckpointFormatError(
            f"{path} holds both {record} ({_KIND_OF[record]}) and {others[0]} "
            f"({_KIND_OF[others[0]]}), which never share a folder: it is neither; move one of "
            "them into a folder of its own, or save this checkpoint again"
        )


def _locate_object(path: Path, backend: StorageBackend) -> Location:
    """:func:`locate` on an object store, where a "directory" is a key prefix."""
    if path.name in (MANIFEST, COMMIT_RECORD, SHARDED_RECORD) and backend.exists(path):
        return _locate_object(path.parent, backend)
    if backend.exists(path / MANIFEST):
        others = [r for r in (COMMIT_RECORD, SHARDED_RECORD) if backend.exists(path / r)]
        _one_kind(path, MANIFEST, others)
        return Location("root", path, root=path)
    if backend.exists(path / COMMIT_RECORD):
        others = [SHARDED_RECORD] if backend.exists(path / SHARDED_RECORD) else []
        _one_kind(path, COMMIT_RECORD, others)
        return Location("manager", path)
    if backend.exists(path / SHARDED_RECORD):
        return Location("sharded", path)
    if is_ascii_decimal(path.name) and backend.exists(path.parent / MANIFEST):
        return Location("index", path, root=path.parent, index=int(path.name))
    try:
        info = backend.stat(path)
    except FileNotFoundError:
        raise FileNotFoundError(
            errno.ENOENT, f"{display_path(path)}: no such object or prefix", display_path(path)
        ) from None
    if info.regular:
        return Location("file", path)
    raise FileNotFoundError(
        errno.ENOENT,
        f"{display_path(path)} is not a fastckpt checkpoint: no {MANIFEST} (save_checkpoint "
        f"root), {COMMIT_RECORD} (CheckpointManager checkpoint) or {SHARDED_RECORD} (sharded "
        "checkpoint) under it",
        display_path(path),
    )
