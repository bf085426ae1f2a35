"""The on-disk layout of a sharded checkpoint and its commit protocol.

```text
CHECKPOINT/                         the DCP checkpoint id (a directory)
    fastckpt-dcp.json               the commit record: generation, files, DCP metadata (JSON)
    g<millis>-<random>/             one generation per save
        rank-00000.safetensors      rank 0's tensor chunks (DCP sharding offsets in the header)
        rank-00000.values           rank 0's non-tensor values (raw bytes / JSON), if any
        rank-00001.safetensors      ...
```

Every save writes into a fresh generation directory whose name the coordinator picks and sends
to all ranks with the plan. Each rank writes its files there through the storage backend
(locally temp -> fsync -> rename; on ``s3://`` parallel multipart uploads under the
generation's prefix). Only after every rank reported its files durable does the coordinator
replace the commit record atomically (``StorageBackend.put_record``: temp -> fsync -> rename
-> fsync of the directory, or a conditional put on an object store): that is the commit. Then
it removes every other generation. So

* a save interrupted at any point (a rank killed, a full disk) leaves the record, and with it
  the previous checkpoint under the same id, untouched; its half-written generation is never
  read and is removed by the next successful save;
* readers never see a mix of two saves: the record names exactly one generation.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from fastckpt import _native
from fastckpt.errors import CheckpointFormatError, NotCommittedError
from fastckpt.format.records import SHARDED_RECORD, read_record_bytes
from fastckpt.format.sharded import Record, decode_record
from fastckpt.storage.registry import backend_for, is_local

__all__ = [
    "RECORD_NAME",
    "commit",
    "data_file_name",
    "generation_dirs",
    "make_generation_dir",
    "new_generation",
    "read_record",
    "remove_other_generations",
]

#: Name of the commit record inside a checkpoint directory.
RECORD_NAME = SHARDED_RECORD
_GENERATION_PREFIX = "g"
_COMMIT_LOCK = threading.Lock()


def new_generation() -> str:
    """A fresh, unique generation directory name (sorts by creation time)."""
    return f"{_GENERATION_PREFIX}{time.time_ns() // 1_000_000:013d}-{uuid.uuid4().hex[:8]}"


def _is_generation(name: str) -> bool:
    head, _, tail = name.partition("-")
    return (
        head.startswith(_GENERATION_PREFIX)
        and head[1:].isdigit()
        and len(tail) == 8
        and all(c in "0123456789abcdef" for c in tail)
    )


def generation_dirs(path: Path) -> list[Path]:
    """Generation directories (prefixes on an object store) present under a checkpoint
    directory, oldest first."""
    backend = backend_for(path)
    if not is_local(backend):
        return [path / name for name in backend.list_dir(path) if _is_generation(name)]
    try:
        entries = sorted(path.iterdir())
    except FileNotFoundError:
        return []
    return [entry for entry in entries if entry.is_dir() and _is_generation(entry.name)]


def data_file_name(rank: int, part: int, suffix: str) -> str:
    """``rank-00003.safetensors`` (``part`` > 0: ``rank-00003-1.safetensors``)."""
    extra = f"-{part}" if part else ""
    return f"rank-{rank:05d}{extra}{suffix}"


def commit(path: Path, generation: str, data: bytes, check: Callable[[], None]) -> None:
    """Commit ``generation``: replace ``path``'s record with ``data`` atomically and durably,
    then remove the generations created before it.

    Commits in this process are serialized, and one never replaces a record that already
    names a newer generation (overlapping saves to one checkpoint: the newest wins, the older
    one fails with nothing committed). ``check`` runs just before the record is written (it
    confirms the generation's files are all there).

    Raises:
        RuntimeError: a newer generation is already committed.
    """
    with _COMMIT_LOCK:
        current = _committed_generation(path)
        if current is not None and current > generation:
            raise RuntimeError(
                f"{path}: a newer save ({current}) committed while this one ({generation}) "
                "was running; nothing was committed"
            )
        check()
        # Locally temp + fsync + rename; on an object store a put conditional on the version
        # _committed_generation just read (another writer's commit meanwhile is refused).
        backend_for(path).put_record(path / RECORD_NAME, data)
        remove_other_generations(path, keep=generation)


def _committed_generation(path: Path) -> str | None:
    try:
        data = json.loads(read_record_bytes(path, RECORD_NAME))
    except (OSError, ValueError):  # CheckpointFormatError (a FIFO, a link...) is a ValueError
        return None
    generation = data.get("generation") if isinstance(data, dict) else None
    return generation if isinstance(generation, str) else None


def read_record(path: Path) -> Record:
    """Read and validate the commit record of the checkpoint directory ``path``.

    The record must be a regular file (not a link, a FIFO or a device: it is opened with
    ``O_NOFOLLOW | O_NONBLOCK`` and checked with ``fstat``, as ``manifest.json`` is) of at
    most :data:`~fastckpt.storage.backend.MAX_RECORD_BYTES`, and its own checksum must match.

    Raises:
        NotCommittedError: no record (never committed, or only interrupted saves).
        CheckpointFormatError: the record is not a regular file or not a valid JSON record
            (names file and field).
        ChecksumMismatchError: the record's content differs from its own checksum.
    """
    record_path = path / RECORD_NAME
    try:
        raw = read_record_bytes(path, RECORD_NAME)
    except IsADirectoryError:
        raise CheckpointFormatError(f"{record_path}: is a directory, not a commit record") from None
    except FileNotFoundError:
        leftovers = generation_dirs(path)
        detail = (
            f"; {len(leftovers)} uncommitted generation(s) ({leftovers[-1].name}, ...) are "
            "left from an interrupted save"
            if leftovers
            else ""
        )
        raise NotCommittedError(
            f"{path}: no committed sharded checkpoint ({RECORD_NAME} is missing){detail}. "
            "Load another checkpoint or save again."
        ) from None
    return decode_record(record_path, raw)


def remove_other_generations(path: Path, keep: str) -> list[Path]:
    """After committing ``keep``, remove the generations created before it: earlier commits
    and interrupted saves. Newer ones (a save still under way) are left alone. Returns the
    removed directories."""
    backend = backend_for(path)
    removed = []
    for directory in generation_dirs(path):
        if directory.name < keep:
            if is_local(backend):
                shutil.rmtree(directory, ignore_errors=True)
            else:
                backend.delete(directory)  # its objects, and unfinished uploads under it
            removed.append(directory)
    if removed and is_local(backend):
        _native.fsync_dir(str(path))
    return removed


def make_generation_dir(path: Path, generation: str) -> Path:
    """Create ``path/generation`` (and ``path``) durably; returns it (on an object store,
    where prefixes need no creation, only returns it)."""
    directory = path / generation
    if not is_local(backend_for(path)):
        return directory
    os.makedirs(directory, exist_ok=True)
    _native.fsync_dir(str(path))
    return directory
