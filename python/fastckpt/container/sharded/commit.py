"""The on-disk layout of a sharded checkpoint and its commit protocol.

```text
CHECKPOINT/                         the DCP checkpoint id (a directory)
    fastckpt-dcp.json               the commit record: generation, files, DCP metadata (JSON)
    g-<millis>-<random>/            one generation per save
        rank-00000.safetensors      rank 0's tensor chunks (DCP sharding offsets in the header)
        rank-00000.values           rank 0's non-tensor values (raw bytes / JSON), if any
        rank-00001.safetensors      ...
```

This is the commit protocol of every container (:mod:`fastckpt.container.commit`), with the
data spread over ranks: every save writes into a fresh generation whose name the coordinator
picks and sends to all ranks with the plan. Each rank writes its files there through the
storage backend (locally temp -> fsync -> rename; on ``s3://`` parallel multipart uploads
under the generation's prefix). Only after every rank reported its files durable does the
coordinator commit (:func:`~fastckpt.container.commit.commit_generation`: the record replaced
atomically, then the older generations removed). So

* a save interrupted at any point (a rank killed, a full disk) leaves the record, and with it
  the previous checkpoint under the same id, untouched; its half-written generation is never
  read and is removed by the next successful save;
* readers never see a mix of two saves: the record names exactly one generation.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from fastckpt.container.commit import (
    commit_generation,
    generation_dirs,
    make_generation_dir,
)
from fastckpt.errors import CheckpointFormatError, NotCommittedError
from fastckpt.format.records import SHARDED_RECORD, new_generation, read_record_bytes
from fastckpt.format.sharded import Record, decode_record
from fastckpt.storage.registry import backend_for, display_path

__all__ = [
    "RECORD_NAME",
    "commit",
    "data_file_name",
    "generation_dirs",
    "make_generation_dir",
    "new_generation",
    "read_record",
    "refuse_torch_checkpoint",
]

#: Name of the commit record inside a checkpoint directory.
RECORD_NAME = SHARDED_RECORD


#: The metadata file of a checkpoint written by torch's own ``FileSystemWriter``.
TORCH_METADATA = ".metadata"


def refuse_torch_checkpoint(path: Path, action: str) -> None:
    """Refuse to ``action`` (save into, load) the checkpoint directory ``path`` when it also
    holds a checkpoint written by torch's ``FileSystemWriter`` (its ``.metadata``): the two
    formats side by side leave each reader loading its own, older or newer, without a word.

    Raises:
        CheckpointFormatError: names the directory, the file and the fix.
    """
    if backend_for(path).exists(path / TORCH_METADATA):
        raise CheckpointFormatError(
            f"{display_path(path)}: cannot {action} it: it holds a checkpoint written by "
            f"torch's FileSystemWriter ({TORCH_METADATA}), and a fastckpt checkpoint beside "
            "it would leave each reader loading its own one, one of them stale. Save into "
            "a new checkpoint id (to move a torch checkpoint over, load it with "
            "FileSystemReader and save it with fastckpt.dcp.Writer there), or delete one of "
            "the two"
        )


def data_file_name(rank: int, part: int, suffix: str) -> str:
    """``rank-00003.safetensors`` (``part`` > 0: ``rank-00003-1.safetensors``)."""
    extra = f"-{part}" if part else ""
    return f"rank-{rank:05d}{extra}{suffix}"


def commit(path: Path, generation: str, data: bytes, check: Callable[[], None]) -> None:
    """Commit ``generation`` of the sharded checkpoint ``path`` with the record ``data``
    (:func:`~fastckpt.container.commit.commit_generation`; ``check`` confirms the
    generation's files are all there, just before the record is written).

    Raises:
        RuntimeError: a newer generation is already committed.
    """
    commit_generation(path, RECORD_NAME, data, generation, check=check)


def read_record(path: Path) -> Record:
    """Read and validate the commit record of the checkpoint directory ``path``.

    The record must be a regular file (not a link, a FIFO or a device: it is opened with
    ``O_NOFOLLOW | O_NONBLOCK`` and checked with ``fstat``, as ``manifest.json`` is) of at
    most :data:`~fastckpt.storage.backend.MAX_RECORD_BYTES`, and its own checksum must match.

    Raises:
        NotCommittedError: no record (never committed, or only interrupted saves).
        CheckpointFormatError: the record is not a regular file or not a valid JSON record
            (names file and field); or there is none, and the directory holds a checkpoint
            torch's ``FileSystemWriter`` wrote (its ``.metadata``: the message names
            ``FileSystemReader``).
        ChecksumMismatchError: the record's content differs from its own checksum.
    """
    record_path = path / RECORD_NAME
    try:
        raw = read_record_bytes(path, RECORD_NAME)
    except IsADirectoryError:
        raise CheckpointFormatError(f"{record_path}: is a directory, not a commit record") from None
    except FileNotFoundError:
        if backend_for(path).exists(path / TORCH_METADATA):
            # Before: "no committed sharded checkpoint ... save again", for a checkpoint that
            # is there in torch's own format (what sharded.md's migration diff leads to).
            raise CheckpointFormatError(
                f"{display_path(path)}: not a fastckpt sharded checkpoint ({RECORD_NAME} is "
                f"missing): it holds a checkpoint written by torch's FileSystemWriter "
                f"({TORCH_METADATA}). Load it with torch.distributed.checkpoint.FileSystemReader "
                "(dcp.load(state, storage_reader=FileSystemReader(path))); to move it to "
                "fastckpt, save what that loads with fastckpt.dcp.Writer under a new "
                "checkpoint id"
            ) from None
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
