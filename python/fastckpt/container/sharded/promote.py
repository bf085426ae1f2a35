"""Promoting the sharded part of a strategy index (FSDP2 / TP training) to another root.

An index of a sharded strategy names its part (``ROOT/sharded/<i>/<part>``, see
:mod:`fastckpt.container.sharded.parts`) and the crc32c of the part's commit record in its
``strategy.json``. :func:`promote_index <fastckpt.container.promote.promote_index>` copies
such an index in three steps, all under the target root's lock:

1. :func:`prove_part`: the part's commit record is read, its crc32c compared with the one the
   index records, and every file of every rank it lists is read and checked against the size
   and crc32c it records (before the target is touched);
2. :func:`write_part`: the files are written durably into the target's part under the same
   part and generation names (so the record's bytes, and with them ``strategy.json``, stay
   valid as they are), read from the source and proven once more, then the part's commit
   record is written (:func:`fastckpt.container.commit.commit_generation`);
3. the index's own files follow and the target's manifest is committed last, as for any index.

A promotion killed before step 3 leaves a part no committed index names: the next save,
promotion or prune of the target removes it (:func:`fastckpt.container.sharded.parts.sweep`).
Restoring from the promoted copy reshards like any sharded checkpoint (``parallelize=``).

The fast root must be readable by the promoting process in full (one filesystem shared by the
ranks of a node, the usual single-node case). Ranks on several nodes, each with its own
node-local fast tier, are not supported yet.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastckpt import _native
from fastckpt.container.commit import DirectoryWriter, commit_generation
from fastckpt.container.copy import copy_files
from fastckpt.container.sharded.parts import Part, committed_part, index_dir
from fastckpt.errors import ChecksumMismatchError
from fastckpt.format.records import SHARDED_RECORD, Manifest, read_record_bytes
from fastckpt.storage.registry import display_path

__all__ = ["PartCopy", "prove_part", "write_part"]


@dataclass(frozen=True)
class PartCopy:
    """A proven sharded part, ready to write into another root.

    Attributes:
        part: the source part.
        record: the bytes of its commit record (checked against the index).
        generation: the generation directory its files are in.
        files: file name -> (source path, ``{"size", "crc32c"}``).
    """

    part: Part
    record: bytes
    generation: str
    files: dict[str, tuple[Path, Mapping[str, Any]]]

    @property
    def nbytes(self) -> int:
        """The part's data bytes."""
        return sum(int(record["size"]) for _, record in self.files.values())


def prove_part(source: Path, manifest: Manifest, index: int, what: str) -> PartCopy | None:
    """The sharded part of index ``index`` of ``source`` with its record proven against the
    index (None: the index has no sharded part); the data files are listed, not yet read (the
    caller proves them with :func:`~fastckpt.container.promote.read_verified`).

    Raises:
        ChecksumMismatchError: the part's record differs from the one the index committed.
        ValueError: an index written before parts existed (not promotable).
    """
    # Deferred: decoding a part's record imports torch.distributed.checkpoint (heavy).
    from fastckpt.format.sharded import decode_record

    part = committed_part(manifest, index)
    if part is None:
        return None
    if part.name is None or part.record_crc32c is None:
        raise ValueError(
            f"{what}: its sharded data were written before parts existed "
            f"({display_path(part.path)}); promote a newer index"
        )
    raw = read_record_bytes(part.path, SHARDED_RECORD)
    crc = _native.crc32c(raw)
    if crc != part.record_crc32c:
        raise ChecksumMismatchError(
            f"{display_path(part.path / SHARDED_RECORD)}: crc32c {crc:08x}, but {part.source} "
            f"records {part.record_crc32c:08x}; {what} was not promoted"
        )
    record = decode_record(part.path / SHARDED_RECORD, raw)
    files: dict[str, tuple[Path, Mapping[str, Any]]] = {}
    for name, file_record in record.files.items():
        if file_record.get("crc32c") is None:
            raise ValueError(
                f"{display_path(part.path / record.generation / name)}: recorded without a "
                f"crc32c (an early fastckpt); {what} cannot be promoted with proof"
            )
        files[name] = (part.path / record.generation / name, file_record)
    return PartCopy(part, raw, record.generation, files)


def write_part(target: Path, index: int, copy: PartCopy, what: str) -> int:
    """Write the proven part ``copy`` as the part of index ``index`` of the root ``target``
    (its files, each read and proven again, then its commit record); the caller holds
    ``target``'s lock and commits the index afterwards. Returns the bytes written."""
    assert copy.part.name is not None
    part_dir = index_dir(target, index) / copy.part.name
    writer = DirectoryWriter(part_dir / copy.generation, generations=False)
    try:
        done, _ = copy_files(copy.files, writer, part_dir, None, what)
        writer.commit()
    except BaseException:
        writer.abort()
        raise
    commit_generation(part_dir, SHARDED_RECORD, copy.record, copy.generation)
    return done.copied + done.reused
