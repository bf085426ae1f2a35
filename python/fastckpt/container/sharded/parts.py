"""Where a strategy root keeps the sharded part of each index, and removing the parts no
committed index names.

```text
ROOT/manifest.json                  names index 3 (the commit point of index 3)
ROOT/3/strategy.json                "sharded": {"part": "p1764540000000-3f9a1c2e~4711~node1",
                                                "record_crc32c": 2876543210, ...}
ROOT/sharded/3/p1764540000000-3f9a1c2e~4711~node1/
    fastckpt-dcp.json               the part's DCP commit record (its crc32c is the one above)
    g1764540000100-0badc0de/        every rank's files (see fastckpt.container.sharded.commit)
```

Every save of an index writes its sharded part into a fresh directory (a *part*) that no
other save writes, named by its writer (time, random, the pid and host of rank 0), and the
index's ``strategy.json``, committed by the manifest, names the part together with the crc32c
of the part's commit record. The manifest commit is therefore the one commit point of a save or
a replacement: before it readers load the old index whole (its own part), after it the new one.
The replaced part is removed only after the manifest commit, by :func:`sweep`; so are the parts
of saves killed before their commit, and the parts of pruned indices.

Indices written before parts existed keep their sharded part directly in ``ROOT/sharded/<i>``
(``strategy.json`` names no part); they load as before, and :func:`sweep` leaves them alone.

Imports only the store layer (no torch), so that :mod:`fastckpt.container.commit` can sweep.
"""

from __future__ import annotations

import os
import re
import shutil
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastckpt.container.reader import FileReport, read_json
from fastckpt.errors import CheckpointFormatError, ChecksumMismatchError
from fastckpt.format.records import SHARDED_DIR, SHARDED_RECORD, Manifest
from fastckpt.io.paths import check_name, is_ascii_decimal
from fastckpt.storage.identity import HOST, gone
from fastckpt.storage.registry import backend_for, is_local

__all__ = [
    "PART_CRC_FIELD",
    "PART_FIELD",
    "Part",
    "committed_part",
    "index_dir",
    "new_part",
    "part_damage",
    "part_file_reports",
    "part_of",
    "sweep",
]

#: Field of an index's ``strategy.json`` ``sharded`` record naming its part.
PART_FIELD = "part"
#: Field of the same record holding the whole-file crc32c of the part's commit record.
PART_CRC_FIELD = "record_crc32c"
_PREFIX = "p"
#: ``.`` separates the writer's pid and host (``~`` in parts of earlier versions, still read:
#: an object-store prefix holding ``~`` is refused by some servers' request signing).
_PART = re.compile(r"^p(\d{13})-([0-9a-f]{8})[~.](\d+)[~.]([A-Za-z0-9._-]+)$")


def new_part() -> str:
    """A fresh part name: ``p<millis>-<random>.<pid>.<host>`` (sorts by creation time; says
    which process wrote it, so that a sweep on this host can tell a killed save's part from
    one still being written)."""
    millis = time.time_ns() // 1_000_000
    return f"{_PREFIX}{millis:013d}-{uuid.uuid4().hex[:8]}.{os.getpid()}.{HOST}"


def index_dir(root: str | os.PathLike[str], index: int) -> Path:
    """``ROOT/sharded/<index>``: the parts of index ``index`` (or, written before parts
    existed, its sharded checkpoint itself)."""
    return Path(root) / SHARDED_DIR / str(index)


@dataclass(frozen=True)
class Part:
    """The sharded part an index names.

    Attributes:
        path: the DCP checkpoint directory of the part.
        name: the part's name (None: an index written before parts, stored in
            ``ROOT/sharded/<index>`` itself).
        record_crc32c: the crc32c its commit record must have (None: not recorded).
        source: the file that names the part (for messages).
    """

    path: Path
    name: str | None
    record_crc32c: int | None
    source: str


def part_of(root: str | os.PathLike[str], index: int, sharded: Any, source: str) -> Part:
    """The part named by the ``sharded`` record of index ``index``'s ``strategy.json``.

    Raises:
        CheckpointFormatError: the record or its part fields are malformed (names ``source``
            and the field).
    """
    if not isinstance(sharded, Mapping):
        raise CheckpointFormatError(f"{source}: field 'sharded' must be an object")
    name = sharded.get(PART_FIELD)
    if name is None:
        return Part(index_dir(root, index), None, None, source)
    if not isinstance(name, str) or not _PART.match(name):
        raise CheckpointFormatError(
            f"{source}: field 'sharded.{PART_FIELD}' = {name!r} is not a part name"
        )
    check_name(name, f"{source}: field 'sharded.{PART_FIELD}'")
    crc = sharded.get(PART_CRC_FIELD)
    if not (isinstance(crc, int) and not isinstance(crc, bool) and 0 <= crc <= 0xFFFFFFFF):
        raise CheckpointFormatError(
            f"{source}: field 'sharded.{PART_CRC_FIELD}' must be a 32-bit int, got {crc!r}"
        )
    return Part(index_dir(root, index) / name, name, crc, source)


def committed_part(manifest: Manifest, index: int) -> Part | None:
    """The part committed index ``index`` names (its ``strategy.json`` read and checked
    against the manifest), or None when the index has no sharded part.

    Raises:
        CheckpointFormatError, ChecksumMismatchError, FileNotFoundError: ``strategy.json`` is
            damaged or missing.
    """
    files = manifest.entries[index]["files"]
    if "strategy.json" not in files:
        return None
    path = manifest.file_path(index, "strategy.json")
    recipe = read_json(path, files["strategy.json"], source=str(manifest.path))
    if not isinstance(recipe, Mapping) or recipe.get("sharded") is None:
        return None
    return part_of(manifest.root, index, recipe["sharded"], str(path))


def _writer_dead(name: str) -> bool:
    """Whether the part ``name`` was written by a process of this host (and PID namespace,
    see :mod:`fastckpt.storage.identity`) that is gone."""
    match = _PART.match(name)
    return match is not None and gone(int(match.group(3)), match.group(4))


def _is_index_name(name: str) -> bool:
    return is_ascii_decimal(name) and len(name) <= 18 and str(int(name)) == name


#: An earlier part written on another host (whose writer cannot be asked whether it lives)
#: is removed once it is this much older than the committed one.
FOREIGN_PART_GRACE_S = 3600


def _writer_gone(name: str, named: str) -> bool:
    """Whether the part ``name``, created before the committed part ``named``, can no longer
    be written by anyone: written by this process (its saves of an index run one after the
    other), by a process of this host that is gone, or on another host long before."""
    match = _PART.match(name)
    if match is None:
        return True
    if match.group(4) == HOST:
        return int(match.group(3)) == os.getpid() or _writer_dead(name)
    committed = _PART.match(named)
    age_ms = int(committed.group(1)) - int(match.group(1)) if committed else 0
    return age_ms >= FOREIGN_PART_GRACE_S * 1000


def _entries(directory: Path) -> list[str]:
    """The names under ``directory`` (a local directory, or an object-store prefix)."""
    backend = backend_for(directory)
    if not is_local(backend):
        return backend.list_dir(directory)
    return sorted(entry.name for entry in directory.iterdir())


def _doomed_entries(directory: Path, named: str) -> list[Path]:
    """What of ``ROOT/sharded/<i>`` goes when the committed index names part ``named``: the
    layout from before parts; parts created before it (replaced, or saves that never
    committed) whose writer is gone (:func:`_writer_gone`: a live writer's earlier part may
    be a replacement under way, whose clock is behind); and later parts whose writer died on
    this host."""
    return [
        directory / name
        for name in _entries(directory)
        if name != named and _is_doomed(name, named)
    ]


def _is_doomed(name: str, named: str) -> bool:
    if not _PART.match(name):
        return True
    if name < named:
        return _writer_gone(name, named)
    return _writer_dead(name)


def _remove(path: Path) -> None:
    backend = backend_for(path)
    if not is_local(backend):
        backend.delete(path)  # the objects under it, and unfinished uploads
    elif path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def sweep(
    root: str | os.PathLike[str],
    manifest: Manifest,
    *,
    writing: int | None = None,
    uncommitted: bool = True,
    only_older: bool = False,
) -> list[Path]:
    """Remove the sharded parts of ``root`` that no committed index names and no live save
    is writing. Call it after a commit (the manifest read after it), preferably under the
    root's lock.

    * a committed index that names a part: every other entry of ``ROOT/sharded/<i>`` but later
      parts of live writers (see :func:`_doomed_entries`);
    * ``uncommitted``: ``ROOT/sharded/<i>`` of an index older than the latest that the
      manifest no longer names (pruned, or a prune killed after its commit), whole; of a newer
      one, the parts whose writer died on this host;
    * never index ``writing`` (a save of it is under way), an index written before parts, an
      index whose ``strategy.json`` cannot be read (never delete on the word of a damaged
      record), or names that are not indices;
    * ``only_older``: nothing but the uncommitted indices older than the latest, whole. For a
      root that other processes promote into: the parts of a newer index, or another part of a
      committed one, may be receiving other ranks' files under the name of a writer that is
      gone (a node-local promotion after a restart, see
      :mod:`fastckpt.container.sharded.promote`).

    Returns:
        The removed paths.
    """
    base = Path(root) / SHARDED_DIR
    local = is_local(backend_for(base))
    if local and (not base.is_dir() or base.is_symlink()):
        return []
    latest = manifest.latest
    removed: list[Path] = []
    for directory in (base / name for name in _entries(base)):
        if not _is_index_name(directory.name):
            continue
        if local and (directory.is_symlink() or not directory.is_dir()):
            continue
        index = int(directory.name)
        if index == writing:
            continue
        if only_older and (index in manifest.entries or latest is None or index >= latest):
            continue
        if index in manifest.entries:
            try:
                part = committed_part(manifest, index)
            except (CheckpointFormatError, OSError, ValueError):
                continue
            if part is None or part.name is None:
                continue
            doomed = _doomed_entries(directory, part.name)
        elif not uncommitted:
            continue
        elif latest is not None and index < latest:
            doomed = [directory]
        else:
            doomed = [directory / name for name in _entries(directory) if _writer_dead(name)]
        for path in doomed:
            _remove(path)
        removed += doomed
    return removed


def part_file_reports(
    manifest: Manifest, index: int, threads: int, *, read: bool = True
) -> list[FileReport]:
    """The reports of the sharded part index ``index`` names in its ``strategy.json`` (none
    when it names none, or when ``strategy.json`` cannot be read: the index's own file check
    reports that), locally and on an object store; its commit record must be the one the
    index recorded."""
    if is_local(manifest.backend) and not (manifest.root / SHARDED_DIR).is_dir():
        return []  # no index of this root has a part: nothing to read
    # Deferred: decoding the part's record needs torch.distributed.checkpoint's types.
    from fastckpt.container.sharded.reports import sharded_file_reports

    try:
        part = committed_part(manifest, index)
    except (CheckpointFormatError, ChecksumMismatchError, OSError):
        return []
    if part is None:
        return []
    return sharded_file_reports(
        part.path, threads=threads, index=index, record_crc32c=part.record_crc32c, read=read
    )


def part_damage(manifest: Manifest, index: int, threads: int, *, read: bool = True) -> str | None:
    """Why the sharded part of committed ``index`` does not verify (None: it does, or the
    index has none), for what decides which index is intact (``prune``'s and ``keep_last``'s
    newest that verifies, ``latest_intact``). A shard file that is absent while the part's
    commit record is intact is passed over: a node-local fast root holds only its node's
    ranks' shards and cannot be told apart from one that lost a file (``fastckpt verify``
    reports it; loading it fails naming it). A damaged, truncated or replaced one counts;
    ``read=False`` (retention, which would otherwise read the whole sharded checkpoint
    after every save): the record and each shard's size, no byte of the shards read."""
    for report in part_file_reports(manifest, index, threads, read=read):
        if report.ok or (report.status == "missing" and report.path.name != SHARDED_RECORD):
            continue
        return report.message or f"{report.path}: {report.status}"
    return None
