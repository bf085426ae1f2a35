"""Commit protocols: a directory that appears whole, and an index that the manifest commits.

```
ROOT/manifest.json     the commit record (see fastckpt.store.records)
ROOT/<index>/          one self-contained directory per committed index
ROOT/.tmp-<...>/       an index being written (removed by the next save if a crash left it)
ROOT/.fastckpt.lock    held (flock) by the one process saving into ROOT; gone when none is
```

An index is staged (locally: a temporary sibling, every file and directory fsynced, renamed
into place), then ``manifest.json`` is replaced atomically: the manifest is the commit point,
nothing it names is partial. Writers of one root are serialized by the backend's lock
(:class:`RootLock` locally), which the kernel drops when its holder dies, so a killed writer
never leaves a stale lock.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from fastckpt import _native
from fastckpt.errors import CheckpointFormatError
from fastckpt.store.backend import (
    ATOMIC_TEMP_INFIX,
    TEMP_PREFIX,
    TRASH_PREFIX,
    LocalStaging,
    backend_for,
    make_dirs,
)
from fastckpt.store.lock import RootLock
from fastckpt.store.records import MANIFEST, Manifest, json_bytes

__all__ = ["DirectoryWriter", "IndexWriter", "RootLock", "clean_leftovers", "prune_indices"]


class DirectoryWriter:
    """Writes the files of one directory so that they appear together at :meth:`commit`.

    Use :meth:`add_tensors` / :meth:`add_json` for each file, then :meth:`commit`, or
    :meth:`abort`. The backend decides how (locally: a temporary sibling directory swapped
    into place, see :class:`~fastckpt.store.backend.LocalStaging`).

    Attributes:
        final: the directory.
        files: relpath -> ``{"size", "crc32c"}`` of every file written so far.
    """

    def __init__(
        self, final: Path, *, direct_io: bool | None = None, threads: int | None = None
    ) -> None:
        """Start staging ``final`` (with the Rust writer's options, default: its own)."""
        self.final = Path(final)
        self.backend = backend_for(self.final)
        self.staging = self.backend.stage(self.final, direct_io=direct_io, threads=threads)

    @property
    def files(self) -> dict[str, dict[str, int]]:
        """relpath -> ``{"size", "crc32c"}`` of every file written so far."""
        return self.staging.files

    @property
    def location(self) -> str:
        """Where the files are staged (another rank's writer can :meth:`adopt` from it)."""
        return self.staging.location

    def add_tensors(self, relpath: str, tensors: Mapping[str, torch.Tensor]) -> None:
        """Write a safetensors file (durably) and record its size and crc32c."""
        self.staging.put_tensors(relpath, tensors)

    def add_json(self, relpath: str, document: Any) -> None:
        """Write a JSON file (durably) and record its size and crc32c."""
        self.staging.put_bytes(relpath, json_bytes(document))

    def adopt(self, location: str, files: Mapping[str, dict[str, int]]) -> None:
        """Take over files another writer staged at ``location``, with their records."""
        for relpath, record in files.items():
            self.staging.adopt(location, relpath, record)

    def commit(self) -> None:
        """Make the directory visible, replacing what was there."""
        self.staging.publish()

    def abort(self) -> None:
        """Drop what was written."""
        self.staging.discard()


class IndexWriter(DirectoryWriter):
    """A :class:`DirectoryWriter` for ``ROOT/<index>`` whose commit also records the index
    in the manifest (the commit point).

    Creating it takes the root's lock (held until :meth:`commit_entry` or :meth:`abort`
    returns), then removes what crashed saves left, then picks the index: so two processes
    saving into one root are serialized, and with ``index=None`` they never pick the same
    index.

    Attributes:
        index: the index being written (decided under the lock when ``index`` was None).
        lock: the held lock.
    """

    def __init__(
        self,
        root: Path,
        index: int | None = None,
        *,
        direct_io: bool | None = None,
        lock_timeout: float | None = None,
    ) -> None:
        """Prepare to write index ``index`` of ``root`` (None: the next one, decided under
        the lock); ``lock_timeout`` None waits for other writers as long as they take.

        Raises:
            ValueError: a negative index.
            TimeoutError: another process held the root longer than ``lock_timeout``.
            CheckpointFormatError: ``index`` is None and the manifest is damaged.
        """
        root = Path(root)
        if index is not None and index < 0:
            raise ValueError(f"checkpoint index must be >= 0 (or None for the next), got {index}")
        make_dirs(root)
        self.root = root
        self.lock = backend_for(root).lock(root, timeout=lock_timeout)
        self.lock.acquire()
        try:
            clean_leftovers(root)
            if index is None:
                latest = Manifest.load(root).latest
                index = 0 if latest is None else latest + 1
            self.index: int = index
            super().__init__(root / str(index), direct_io=direct_io)
        except BaseException:
            self.lock.release()
            raise

    def commit_entry(self, entry: dict[str, Any]) -> None:
        """Put the index directory in place, then commit ``entry`` to the manifest.

        Replacing a committed index first withdraws it from the manifest, so the manifest never
        names a directory whose files differ from its records (a crash in between loses the
        replaced index, never corrupts it). Locally, an *error* at any step (a full disk
        included) leaves the old index committed or the new one, never neither: the new
        manifest is written (not yet renamed) before anything is withdrawn, the old manifest
        and the old directory are kept (a hard link and a rename, no space needed) until the
        new manifest is renamed into place and fsynced, and a failure puts them back by
        renames alone. The root lock is released in every case.
        """
        try:
            manifest = Manifest.load(self.root)
            if self.index in manifest.entries and isinstance(self.staging, LocalStaging):
                _replace_local(self, manifest, {**entry, "files": self.files})
                return
            if manifest.entries.pop(self.index, None) is not None:
                manifest.commit()
            self.commit()
            manifest.entries[self.index] = {**entry, "files": self.files}
            try:
                manifest.commit()
            except BaseException:
                self.backend.delete(self.final)
                raise
        finally:
            self.lock.release()

    def abort(self) -> None:
        """Drop what was written and release the root lock."""
        try:
            super().abort()
        finally:
            self.lock.release()


def _write_aside(path: Path, data: bytes) -> None:
    """Write ``data`` durably to the new file ``path`` (not renamed anywhere)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def _replace_local(writer: IndexWriter, manifest: Manifest, entry: dict[str, Any]) -> None:
    """Replace committed index ``writer.index`` of a local root (see
    :meth:`IndexWriter.commit_entry`): on an error, the old index is committed again (or the
    new one already is) before the error propagates."""
    root, final = writer.root, writer.final
    tag = f"{os.getpid()}.{os.urandom(4).hex()}"
    record = root / MANIFEST
    new_record = root / f".{MANIFEST}{ATOMIC_TEMP_INFIX}new.{tag}"
    old_record = root / f".{MANIFEST}{ATOMIC_TEMP_INFIX}old.{tag}"
    old_directory = root / f"{TRASH_PREFIX}{final.name}~{tag}"
    withdrawn = Manifest(root, dict(manifest.entries))
    del withdrawn.entries[writer.index]
    replaced = Manifest(root, {**manifest.entries, writer.index: entry})
    step = "start"
    try:
        _write_aside(new_record, replaced.to_json())  # the space the commit needs, taken first
        try:
            os.link(record, old_record)  # the old record, kept without a copy
        except OSError:  # a filesystem without hard links: a copy, before anything changes
            _write_aside(old_record, manifest.to_json())
        step = "withdrawn"
        withdrawn.commit()
        step = "set aside"
        if os.path.lexists(final):
            os.rename(final, old_directory)
        step = "published"
        writer.commit()
        step = "renamed"
        os.rename(new_record, record)
        _native.fsync_dir(str(root))
        step = "done"
    except BaseException:
        _roll_back(step, record, old_record, final, old_directory, writer)
        raise
    finally:
        for leftover in (new_record, old_record):
            leftover.unlink(missing_ok=True)
    shutil.rmtree(old_directory, ignore_errors=True)


def _roll_back(
    step: str, record: Path, old_record: Path, final: Path, old: Path, writer: IndexWriter
) -> None:
    """Undo :func:`_replace_local` up to ``step`` by renames only (no space needed)."""
    if step in ("published", "renamed") and os.path.lexists(final):
        aside = final.parent / f"{TEMP_PREFIX}{final.name}~undo.{os.urandom(4).hex()}"
        os.rename(final, aside)
        shutil.rmtree(aside, ignore_errors=True)
    if step in ("set aside", "published", "renamed") and os.path.lexists(old):
        os.rename(old, final)
    if step in ("withdrawn", "set aside", "published", "renamed") and os.path.lexists(old_record):
        os.rename(old_record, record)
    _native.fsync_dir(str(record.parent))
    writer.staging.discard()


def _is_index_name(name: str) -> bool:
    return name.isdigit() and len(name) <= 18 and str(int(name)) == name


def clean_leftovers(root: Path) -> list[str]:
    """Remove what crashed saves and prunes left in a checkpoint root.

    That is: temporary and trash directories, manifest temp files, and index directories the
    manifest no longer names that are older than its latest index (a prune or a replacement
    interrupted after its manifest commit). Newer unnamed index directories are left alone:
    the next save of that index replaces them.

    Call it only while holding the root's lock (as :class:`IndexWriter` does): everything
    temporary in the root then belongs to a dead writer. Returns what was removed.
    """
    removed: list[str] = []
    if not root.is_dir():
        return removed
    backend = backend_for(root)
    try:
        manifest: Manifest | None = Manifest.load(root)
    except (CheckpointFormatError, OSError):
        manifest = None  # never delete index directories on the word of a damaged manifest
    latest = None if manifest is None else manifest.latest
    for name in backend.list_dir(root):
        child = root / name
        if name.startswith((TEMP_PREFIX, TRASH_PREFIX)) and (child.is_dir() or child.is_symlink()):
            backend.delete(child)
        elif name.startswith(f".{MANIFEST}{ATOMIC_TEMP_INFIX}"):
            child.unlink(missing_ok=True)
        elif (
            manifest is not None
            and latest is not None
            and _is_index_name(name)
            and int(name) < latest
            and int(name) not in manifest.entries
            and child.is_dir()
            and not os.path.islink(child)
        ):
            backend.delete(child)
        else:
            continue
        removed.append(name)
    return removed


def prune_indices(root: Path, keep_last: int) -> list[int]:
    """Delete all but the newest ``keep_last`` indices of ``root`` (never the latest).

    Under the root's lock, the manifest is committed first, so a crash mid-prune leaves only
    unreferenced directories (removed by the next save), never a manifest naming a deleted
    index. Returns the deleted indices.

    Raises:
        ValueError: ``keep_last < 1``.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 (the latest is never deleted), got {keep_last}")
    backend = backend_for(root)
    with backend.lock(root):
        manifest = Manifest.load(root)
        doomed = sorted(manifest.entries)[:-keep_last]
        if not doomed:
            return []
        for index in doomed:
            del manifest.entries[index]
        manifest.commit()
        for index in doomed:
            backend.delete(manifest.directory(index))
    return doomed
