"""Copying a committed container's files into another root, proven, without transferring
what the target already holds: the machinery under every promotion
(:mod:`fastckpt.container.promote` for roots, :mod:`fastckpt.container.promote_checkpoints`
for CheckpointManager checkpoints, :mod:`fastckpt.container.sharded.promote` for sharded
parts).

Every file is read from the source and proven against the size and crc32c its commit record
gives (:func:`read_verified`) before it is written.

**Unchanged files are not transferred again.** :func:`copy_files` takes each file's 256-bit
BLAKE3 digest as it reads it. This process remembers, per target root, the digest of every file
it promoted there and the exact version it wrote (:meth:`Staging.identity
<fastckpt.storage.backend.Staging.identity>`: the inode locally, the etag on an object store).
A later file whose digest equals a remembered one, whose container is still committed in the
target listing it with the same size and crc32c, is stored by the target itself from that
version (:meth:`Staging.put_copy <fastckpt.storage.backend.Staging.put_copy>`: a hard link
whose bytes are read back against the record, a server-side copy conditional on the etag)
instead of being uploaded; a target that cannot, or whose file was replaced or rewritten since,
gets the bytes uploaded. Bytes are reused only on that proof,
never on a size or crc32c match; a new process starts with full copies (like incremental
saves, see :mod:`fastckpt.container.incremental`). A fast tier's incremental saves keep
unchanged tensors in ``linked/`` files that are the very files of an earlier checkpoint, so a
promoted checkpoint whose frozen tensors did not change uploads only what did.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastckpt import _native
from fastckpt.container.commit import DirectoryWriter
from fastckpt.errors import CheckpointFormatError, ChecksumMismatchError
from fastckpt.io.forksafe import ForkSafeLock
from fastckpt.storage.registry import backend_for, display_path, is_object_url

__all__ = [
    "IndexCopy",
    "Listed",
    "Written",
    "copy_files",
    "forget_promoted",
    "read_verified",
    "remember_written",
]

#: Threads taking a promoted file's BLAKE3 digest.
_DIGEST_THREADS = 4


@dataclass(frozen=True)
class IndexCopy:
    """What a promotion wrote: ``copied`` bytes transferred, ``reused`` bytes the target
    stored from a file it already held (a hard link, a server-side copy)."""

    copied: int
    reused: int


@dataclass(frozen=True)
class _Promoted:
    """A file this process promoted: where it is in the target root (``container``: an
    index number or a checkpoint name; ``relpath`` as the container's record lists it), and
    its exact version."""

    container: str
    relpath: str
    size: int
    crc32c: int
    identity: Hashable


_PROMOTED_LOCK = ForkSafeLock()

#: target root -> BLAKE3 digest of a file's bytes -> the newest file promoted with them.
_PROMOTED: dict[str, dict[bytes, _Promoted]] = {}
#: Files remembered per target (the newest win; older ones belong to pruned indices anyway).
_PROMOTED_MAX = 4096

#: ``listed(container, relpath)``: the record (size, crc32c) under which the target's
#: committed ``container`` lists ``relpath`` now, or None.
Listed = Callable[[str, str], Mapping[str, Any] | None]
#: A promoted file: its digest, its record and the identity of what was written.
Written = dict[str, tuple[bytes, dict[str, Any], Hashable]]


def _target_key(root: Path) -> str:
    if is_object_url(root):
        return display_path(root).rstrip("/")
    return os.path.abspath(root)


def forget_promoted(target: str | os.PathLike[str] | None = None) -> None:
    """Forget what this process promoted into ``target`` (None: every target), so the next
    promotion there copies every file."""
    with _PROMOTED_LOCK:
        if target is None:
            _PROMOTED.clear()
        else:
            _PROMOTED.pop(_target_key(Path(target)), None)


def _reusable(
    target: Path, digest: bytes, record: Mapping[str, Any], listed: Listed
) -> _Promoted | None:
    """A file of a committed container of ``target`` this process wrote with the bytes whose
    digest is ``digest`` (and the size and crc32c of ``record``), still listed there so."""
    with _PROMOTED_LOCK:
        known = _PROMOTED.get(_target_key(target), {}).get(digest)
    size, crc = int(record["size"]), int(record["crc32c"])
    if known is None or (known.size, known.crc32c) != (size, crc):
        return None
    now = listed(known.container, known.relpath)
    if now is None or (int(now["size"]), int(now["crc32c"])) != (size, crc):
        return None
    return known


def _remember(target: Path, container: str, written: Written) -> None:
    with _PROMOTED_LOCK:
        known = _PROMOTED.setdefault(_target_key(target), {})
        for relpath, (digest, record, identity) in written.items():
            if identity is None:
                continue
            known.pop(digest, None)  # re-inserted last: the newest copy is kept longest
            known[digest] = _Promoted(
                container, relpath, int(record["size"]), int(record["crc32c"]), identity
            )
        while len(known) > _PROMOTED_MAX:
            del known[next(iter(known))]


def read_verified(path: Path, record: Mapping[str, Any], what: str) -> bytes:
    """The bytes of the file ``path``, proven equal to the size and crc32c its commit record
    gives (``record``); ``what`` names the container being promoted, for messages.

    Raises:
        CheckpointFormatError: missing or unreadable (nothing is promoted).
        ChecksumMismatchError: damaged (nothing is promoted).
    """
    size, crc = int(record["size"]), int(record["crc32c"])
    try:
        data = backend_for(path).read_bytes(path, limit=size)
    except FileNotFoundError:
        raise CheckpointFormatError(
            f"{display_path(path)}: missing, but the commit record of {what} lists it; it "
            "cannot be promoted (verify the source, promote an intact checkpoint)"
        ) from None
    except CheckpointFormatError as err:
        raise CheckpointFormatError(f"{err}; {what} cannot be promoted") from None
    got = _native.crc32c(data)
    if len(data) != size or got != crc:
        raise ChecksumMismatchError(
            f"{display_path(path)}: {len(data)} bytes with crc32c {got:08x}, but the commit "
            f"record holds {size} bytes with crc32c {crc:08x}; the file is damaged and {what} "
            "was not promoted (nothing of it was written to the target)"
        )
    return data


def copy_files(
    files: Mapping[str, tuple[Path, Mapping[str, Any]]],
    writer: DirectoryWriter,
    target: Path,
    listed: Listed | None,
    what: str,
) -> tuple[IndexCopy, Written]:
    """Write ``files`` (relpath in the new container -> (source file, its record)) through
    ``writer`` (a staging in the target root ``target``), each read and proven against its
    record again, and stored from a file the target already holds when this process proves
    its bytes identical (see the module docstring); then check what the writer recorded.
    ``listed`` None: nothing is reused (every file transferred).

    Returns:
        What was transferred and reused, and the files written (by their relpath in the
        writer's records) for :func:`remember_written`.
    """
    copied = reused = 0
    written: Written = {}
    staging = writer.staging
    for relpath, (path, record) in files.items():
        data = read_verified(path, record, what)
        digest = _native.digests([memoryview(data)], _DIGEST_THREADS)[0]
        known = None if listed is None else _reusable(target, digest, record, listed)
        if known is not None and staging.put_copy(
            relpath, target / known.container / known.relpath, dict(record), known.identity
        ):
            reused += len(data)
        else:
            staging.put_bytes(relpath, data)
            copied += len(data)
        del data
        written[writer.stored_relpath(relpath)] = (digest, dict(record), staging.identity(relpath))
    recorded = writer.files
    for relpath, (_, record, _) in written.items():
        got = recorded.get(relpath)
        if got is None or (got["size"], got["crc32c"]) != (record["size"], record["crc32c"]):
            raise ChecksumMismatchError(
                f"{display_path(writer.final / relpath)}: written as {got}, but the source "
                f"records {record}; {what} was not promoted"
            )
    return IndexCopy(copied, reused), written


def remember_written(target: Path, container: str, written: Written) -> None:
    """After ``container`` of the root ``target`` committed with ``written``: later
    promotions into ``target`` may store those bytes from it (see the module docstring)."""
    _remember(target, container, written)
