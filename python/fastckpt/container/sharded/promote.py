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

**Node-local fast tiers** (each node's ranks save to their own disk, so a node's fast root
holds the index, manifest and part record only on rank 0's node, and every node only its own
ranks' files; the part record is copied to every node at commit, see
:func:`fastckpt.training.sharded.share_commit`): the part is promoted rank by rank. Every
rank uploads its own files (:func:`upload_rank_files`: read from its node, proven against the
part record, written atomically into the target part's generation); rank 0 uploads its own,
waits until every other rank's file is in the target with its recorded size
(:func:`write_part` with ``wait_s``), and only then writes the part record, the index and the
manifest. A rank that never uploads (its node died) times the promotion out: nothing is
committed, the next promotion retries, and the files already uploaded are removed with the part
by the target's next sweep once a later index is committed.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastckpt import _native
from fastckpt.container.commit import DirectoryWriter, commit_generation
from fastckpt.container.copy import copy_files, read_verified
from fastckpt.container.sharded.parts import Part, committed_part, index_dir
from fastckpt.errors import CheckpointFormatError, ChecksumMismatchError
from fastckpt.format.records import SHARDED_DIR, SHARDED_RECORD, Manifest, read_record_bytes
from fastckpt.io.paths import is_ascii_decimal, safe_join
from fastckpt.storage.backend import make_dirs
from fastckpt.storage.registry import backend_for, display_path, is_local

__all__ = [
    "PartCopy",
    "held_elsewhere",
    "node_local_root",
    "part_problem",
    "prove_part",
    "rank_of",
    "record_files",
    "upload_rank_files",
    "write_generation",
    "write_part",
]

#: ``rank-00003.safetensors``, ``rank-00003-1.safetensors``, ``rank-00003.values``
#: (:func:`fastckpt.container.sharded.commit.data_file_name`).
_RANK_FILE = re.compile(r"^rank-(\d{5,})(?:-\d+)?\.")
_LOG = logging.getLogger(__name__)

#: Seconds between two looks at the target while waiting for the other ranks' uploads.
_POLL_S = 0.2


def rank_of(name: str) -> int | None:
    """The rank that wrote the data file ``name`` of a sharded part (None: not a data
    file name)."""
    match = _RANK_FILE.match(name)
    return None if match is None else int(match.group(1))


def held_elsewhere(part: Path, generation: str, files: Mapping[str, Any]) -> list[str]:
    """The files of a committed part's record (``files``) that this node's copy of the part
    (``part``) does not hold: other nodes' ranks' files on node-local storage."""
    return sorted(name for name in files if not os.path.exists(part / generation / name))


@dataclass(frozen=True)
class PartCopy:
    """A proven sharded part, ready to write into another root.

    Attributes:
        part: the source part.
        record: the bytes of its commit record (checked against the index).
        generation: the generation directory its files are in.
        files: file name -> (source path, ``{"size", "crc32c"}``): the files this process
            copies.
        elsewhere: on node-local storage, the other ranks' files (they upload them).
    """

    part: Part
    record: bytes
    generation: str
    files: dict[str, tuple[Path, Mapping[str, Any]]]
    #: Node-local storage: file name -> record of the files other ranks upload themselves.
    elsewhere: dict[str, Mapping[str, Any]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """The part's data bytes."""
        return sum(int(record["size"]) for _, record in self.files.values())


def prove_part(
    source: Path, manifest: Manifest, index: int, what: str, *, node_local: bool = False
) -> PartCopy | None:
    """The sharded part of index ``index`` of ``source`` with its record proven against the
    index (None: the index has no sharded part); the data files are listed, not yet read (the
    caller proves them with :func:`~fastckpt.container.promote.read_verified`).
    ``node_local``: ``source`` is rank 0's node-local root; only rank 0's files are copied
    from it, the others are listed in ``elsewhere`` (their ranks upload them).

    Raises:
        ChecksumMismatchError: the part's record differs from the one the index committed.
        ValueError: an index written before parts existed (not promotable).
    """
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
    generation, files, elsewhere = record_files(part.path, raw, what, node_local=node_local)
    return PartCopy(part, raw, generation, files, elsewhere)


def record_files(
    directory: Path, raw: bytes, what: str, *, node_local: bool = False
) -> tuple[str, dict[str, tuple[Path, Mapping[str, Any]]], dict[str, Mapping[str, Any]]]:
    """The generation of the sharded container ``directory`` (a part, or a
    CheckpointManager checkpoint of sharded state) whose commit record is ``raw``, and its
    files: name -> (path, ``{"size", "crc32c"}``); with ``node_local``, the files of ranks
    other than 0 go in the second mapping (name -> record) instead.

    Raises:
        CheckpointFormatError: ``raw`` is not a valid record.
        ValueError: a file recorded without a crc32c (cannot be copied with proof).
    """
    # Deferred: decoding a record imports torch.distributed.checkpoint (heavy).
    from fastckpt.format.sharded import decode_record

    record = decode_record(directory / SHARDED_RECORD, raw)
    files: dict[str, tuple[Path, Mapping[str, Any]]] = {}
    elsewhere: dict[str, Mapping[str, Any]] = {}
    for name, file_record in record.files.items():
        if file_record.get("crc32c") is None:
            raise ValueError(
                f"{display_path(directory / record.generation / name)}: recorded without a "
                f"crc32c (an early fastckpt); {what} cannot be promoted with proof"
            )
        if node_local and rank_of(name) != 0:
            elsewhere[name] = file_record
        elif is_local(backend_for(directory)):
            # as the readers join it: refused if it resolves outside the part (a symlink)
            files[name] = (safe_join(directory, f"{record.generation}/{name}"), file_record)
        else:
            files[name] = (directory / record.generation / name, file_record)
    return record.generation, files, elsewhere


def part_problem(
    manifest: Manifest,
    index: int,
    elsewhere: Callable[[Part, dict[str, int]], bool] | None = None,
) -> str | None:
    """Why the sharded part of committed index ``index`` cannot be restored from this root
    (None: it can, or the index has none): its record differs from the one the index
    recorded, or a file it lists is missing or has another size (another node's shards on
    node-local storage, a deleted file). Sizes only: the bytes are verified as they are
    loaded, which refuses a damaged chunk.

    ``elsewhere(part, missing)``: whether the files ``missing`` (name -> recorded size) of
    this root's copy are held by other nodes' copies of the part (node-local fast tiers,
    :mod:`fastckpt.container.sharded.nodes`); when it says so they are no problem.
    """
    try:
        if committed_part(manifest, index) is None:
            return None
        what = f"index {index} of {display_path(manifest.root)}"
        copy = prove_part(manifest.root, manifest, index, what)
    except (CheckpointFormatError, ChecksumMismatchError, OSError, ValueError) as err:
        return str(err)
    if copy is None:
        return None
    missing: dict[str, int] = {}
    problem = None
    for name, (path, record) in copy.files.items():
        try:
            size: int | None = backend_for(path).stat(path).size
        except FileNotFoundError:
            size = None
        if size != int(record["size"]):
            found = "missing" if size is None else f"{size} bytes"
            problem = problem or (
                f"{display_path(path)}: {found}, the part's record holds {record['size']}"
            )
            if size is not None:
                return problem  # a file of another size is damaged, wherever the others are
            missing[name] = int(record["size"])
    if problem is not None and elsewhere is not None and elsewhere(copy.part, missing):
        return None
    return problem


def write_part(
    target: Path, index: int, copy: PartCopy, what: str, *, wait_s: float | None = None
) -> int:
    """Write the proven part ``copy`` as the part of index ``index`` of the root ``target``
    (its files, each read and proven again, then its commit record); the caller holds
    ``target``'s lock and commits the index afterwards. Returns the bytes written.

    With files ``elsewhere`` (node-local storage), this process's files are put one by one
    into the target's generation, next to the ones the other ranks upload
    (:func:`upload_rank_files`), and the record is written only once every one of those is
    there with its recorded size, waited for up to ``wait_s`` seconds.

    Raises:
        TimeoutError: files of other ranks still missing after ``wait_s`` (names them);
            nothing was committed.
    """
    assert copy.part.name is not None
    part_dir = index_dir(target, index) / copy.part.name
    if copy.elsewhere:
        written = 0
        for name, (path, record) in copy.files.items():
            data = read_verified(path, record, what)
            _put_file(target, part_dir / copy.generation, name, data)
            written += len(data)
        _wait_for(part_dir / copy.generation, copy.elsewhere, wait_s, what)
        commit_generation(part_dir, SHARDED_RECORD, copy.record, copy.generation)
        return written
    return write_generation(part_dir, copy.generation, copy.files, copy.record, what)


def write_generation(
    directory: Path,
    generation: str,
    files: Mapping[str, tuple[Path, Mapping[str, Any]]],
    record: bytes,
    what: str,
) -> int:
    """Write ``files`` (each read and proven against its record as it is copied) durably
    as ``directory/generation``, then commit the sharded container ``directory`` with the
    record ``record`` (which supersedes its older generations). Returns the bytes written.

    Raises:
        ChecksumMismatchError / CheckpointFormatError: a source file is damaged or missing;
            nothing was committed.
    """
    writer = DirectoryWriter(directory / generation, generations=False)
    try:
        done, _ = copy_files(files, writer, directory, None, what)
        writer.commit()
    except BaseException:
        writer.abort()
        raise
    commit_generation(directory, SHARDED_RECORD, record, generation)
    return done.copied + done.reused


def _put_file(root: Path, directory: Path, name: str, data: bytes) -> None:
    """One file written atomically and durably into ``directory`` of the root ``root``
    (locally temp -> fsync -> rename, with every directory made on the way fsynced; on an
    object store one upload under the prefix), as the DCP writer writes each rank's files."""
    backend = backend_for(directory)
    if not is_local(backend):
        backend.stage(directory).put_bytes(name, data)
        return
    make_dirs(directory)
    _native.write_bytes_atomic(str(directory / name), data, True)
    here = directory
    while here != root and here.parent != here:
        _native.fsync_dir(str(here))
        here = here.parent
    _native.fsync_dir(str(root))


def _wait_for(
    directory: Path, files: Mapping[str, Mapping[str, Any]], wait_s: float | None, what: str
) -> None:
    """Until every file of ``files`` is in ``directory`` with its recorded size (each rank
    writes its files atomically, after proving them against the same record)."""
    deadline = None if wait_s is None else time.monotonic() + wait_s
    while True:
        missing = _missing(directory, files)
        if not missing:
            return
        if deadline is None or time.monotonic() >= deadline:
            ranks = sorted({rank_of(name) for name in missing}, key=lambda r: r or 0)
            raise TimeoutError(
                f"{display_path(directory)}: rank(s) {ranks} did not upload "
                f"{sorted(missing)} within {wait_s}s (their nodes hold those shards: a "
                f"node-local fast tier); {what} was not promoted, the next promotion retries"
            )
        time.sleep(_POLL_S)


def _newest_committed_part(directory: Path) -> Path | None:
    """The newest part under ``ROOT/sharded/<i>`` of this node holding a commit record."""
    try:
        names = sorted(os.listdir(directory), reverse=True)
    except (FileNotFoundError, NotADirectoryError):
        return None
    for name in names:
        if os.path.isfile(directory / name / SHARDED_RECORD):
            return directory / name
    return None


def _committed_parts(root: Path) -> list[tuple[int, Path]]:
    """``(index, newest committed part)`` of every index under ``ROOT/sharded`` of this
    node that has one, oldest index first."""
    base = root / SHARDED_DIR
    try:
        names = os.listdir(base)
    except (FileNotFoundError, NotADirectoryError):
        return []
    parts = []
    for index in sorted(int(n) for n in names if is_ascii_decimal(n) and len(n) <= 18):
        part = _newest_committed_part(base / str(index))
        if part is not None:
            parts.append((index, part))
    return parts


def node_local_root(root: Path) -> bool:
    """Whether ``root`` is a node-local fast root of a sharded run: its newest committed
    part (the record copied here at commit) lacks files other ranks wrote."""
    parts = _committed_parts(root)
    if not parts:
        return False
    part = parts[-1][1]
    try:
        record = json.loads(read_record_bytes(part, SHARDED_RECORD))
        return bool(held_elsewhere(part, record["generation"], record["files"]))
    except (OSError, ValueError, KeyError, TypeError):
        return False


def upload_rank_files(
    source: Path, target: Path, every: int, rank: int | None, uploaded: set[str]
) -> list[int]:
    """A rank's share of promoting node-local sharded parts: for the newest index of this
    node's fast root ``source`` that is a multiple of ``every`` and newer than the target's
    newest committed index (rank 0 promotes that one only), the files of rank ``rank`` in its
    newest committed part (the record copied here at commit) are read, proven against the
    record, and put into the same part and generation of ``target``, where rank 0 commits
    them (:func:`write_part`). ``rank`` None (``fastckpt promote`` after a crash): the files
    of every rank other than 0 that this node holds. ``uploaded``
    (kept by the caller) names the parts done already, so each is uploaded once per process.
    Returns the indices uploaded.

    Raises:
        ChecksumMismatchError / CheckpointFormatError: one of this rank's files is damaged or
            missing (names it); what was uploaded before stays (rank 0 commits nothing
            without every file).
    """
    # Deferred: decoding a part's record imports torch.distributed.checkpoint (heavy).
    from fastckpt.format.sharded import decode_record

    newest = Manifest.load(target).latest
    due = [
        (index, part)
        for index, part in _committed_parts(source)
        if not index % every and (newest is None or index > newest)
    ]
    done: list[int] = []
    for index, part in due[-1:]:  # rank 0 promotes the newest due index only
        try:
            raw = read_record_bytes(part, SHARDED_RECORD)
            record = decode_record(part / SHARDED_RECORD, raw)
            key = f"{index}/{part.name}/{record.generation}"
            directory = index_dir(target, index) / part.name / record.generation
            mine = {
                name: rec
                for name, rec in record.files.items()
                if rank_of(name) == rank
                or (
                    rank is None
                    and rank_of(name) not in (None, 0)
                    and os.path.exists(part / record.generation / name)
                )
            }
            if key in uploaded and not _missing(directory, mine):
                continue  # uploaded by this process and still there, waiting for the commit
            whose = "this node's" if rank is None else f"rank {rank}'s"
            what = f"{whose} shards of index {index} of {display_path(source)}"
            for name, file_record in sorted(mine.items()):
                data = read_verified(part / record.generation / name, file_record, what)
                _put_file(target, directory, name, data)
        except (CheckpointFormatError, FileNotFoundError):
            if os.path.isdir(part):
                raise
            # Removed meanwhile by this node's retention (rank 0 no longer keeps the index).
            _LOG.info("%s: index %d was pruned before its shards were uploaded", source, index)
            continue
        uploaded.add(key)
        done.append(index)
    return done


def _missing(directory: Path, files: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The files of ``files`` not in ``directory`` with their recorded size."""
    backend = backend_for(directory)
    missing = []
    for name, record in files.items():
        try:
            if backend.stat(directory / name).size == int(record["size"]):
                continue
        except FileNotFoundError:
            pass
        missing.append(name)
    return missing
