"""The on-disk layout of a checkpoint root: the manifest and atomic commits of index directories.

```
ROOT/manifest.json     the commit record (schema_version, latest, one entry per committed index)
ROOT/<index>/          one self-contained directory per committed index
ROOT/.tmp-<...>/       an index being written (removed by the next save if a crash left it)
```

An index is written into a temporary sibling, every file and directory fsynced, renamed into
place, then ``manifest.json`` is replaced atomically (temp + fsync + rename + fsync(ROOT)). The
manifest is the commit point: nothing it names is partial. Nothing read from the manifest is
trusted: names are checked before they touch the filesystem.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fastckpt import _native
from fastckpt.errors import CheckpointFormatError
from fastckpt.files import write_tensors

__all__ = [
    "MANIFEST",
    "SCHEMA_VERSION",
    "DirectoryWriter",
    "IndexWriter",
    "Manifest",
    "check_name",
    "check_relpath",
]

MANIFEST = "manifest.json"
SCHEMA_VERSION = 1
TEMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"


def check_name(name: object, what: str) -> str:
    """Validate a component or file name that becomes a path component.

    Raises:
        CheckpointFormatError: not a plain name (separators, ``..``, absolute, hidden, empty).
    """
    if (
        not isinstance(name, str)
        or not name
        or name in (".", "..")
        or name.startswith(".")
        or any(sep in name for sep in ("/", "\\", "\0"))
    ):
        raise CheckpointFormatError(
            f"{what} {name!r} is not a valid name: use a non-empty name without path "
            "separators, NUL, or a leading '.'"
        )
    return name


def check_relpath(relpath: object, what: str) -> str:
    """Validate a ``dir/file`` path relative to an index directory (each part a plain name)."""
    if not isinstance(relpath, str) or relpath.startswith("/"):
        raise CheckpointFormatError(f"{what} {relpath!r} must be a relative path")
    for part in relpath.split("/"):
        check_name(part, what)
    return relpath


@dataclass
class Manifest:
    """The commit record of a checkpoint root.

    Attributes:
        root: the checkpoint root directory.
        entries: index -> entry (``created``, ``counters``, ``components``, ``files``...).
    """

    root: Path
    entries: dict[int, dict[str, Any]] = field(default_factory=dict)

    @property
    def latest(self) -> int | None:
        """The newest committed index, or None for an empty root."""
        return max(self.entries) if self.entries else None

    @classmethod
    def load(cls, root: str | os.PathLike[str]) -> Manifest:
        """Read and validate ``ROOT/manifest.json``; an absent manifest is an empty root.

        Raises:
            CheckpointFormatError: malformed JSON, unknown schema, invalid names.
        """
        root = Path(root)
        path = root / MANIFEST
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return cls(root)
        try:
            data = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise CheckpointFormatError(f"{path}: not valid JSON ({err})") from None
        return cls(root, _parse_entries(path, data))

    def to_json(self) -> bytes:
        """Serialized manifest."""
        document = {
            "format": "fastckpt",
            "schema_version": SCHEMA_VERSION,
            "latest": self.latest,
            "checkpoints": {str(i): self.entries[i] for i in sorted(self.entries)},
        }
        return json.dumps(document, indent=1, sort_keys=False).encode()

    def commit(self) -> None:
        """Replace ``manifest.json`` atomically and durably."""
        _native.write_bytes_atomic(str(self.root / MANIFEST), self.to_json(), True)

    def resolve(self, index: int) -> int:
        """Map ``-1`` to the latest index and check that ``index`` is committed.

        Raises:
            FileNotFoundError: the root has no committed checkpoint.
            KeyError: ``index`` is not committed (lists the available ones).
        """
        if not self.entries:
            raise FileNotFoundError(f"{self.root / MANIFEST}: no committed checkpoint here")
        if index == -1:
            return self.latest  # type: ignore[return-value]
        if index not in self.entries:
            raise KeyError(
                f"checkpoint index {index} is not in {self.root / MANIFEST}; "
                f"available: {sorted(self.entries)}"
            )
        return index


def _parse_entries(path: Path, data: Any) -> dict[int, dict[str, Any]]:
    if not isinstance(data, dict):
        raise CheckpointFormatError(f"{path}: manifest must be a JSON object")
    version = data.get("schema_version")
    if not isinstance(version, int):
        raise CheckpointFormatError(f"{path}: field 'schema_version' missing or not an int")
    if version > SCHEMA_VERSION:
        raise CheckpointFormatError(
            f"{path}: schema_version {version} was written by a newer fastckpt (this one reads "
            f"up to {SCHEMA_VERSION}); upgrade fastckpt to load it"
        )
    checkpoints = data.get("checkpoints")
    if not isinstance(checkpoints, dict):
        raise CheckpointFormatError(f"{path}: field 'checkpoints' must be an object")
    entries: dict[int, dict[str, Any]] = {}
    for key, entry in checkpoints.items():
        if not (isinstance(key, str) and key.isdigit() and str(int(key)) == key):
            raise CheckpointFormatError(f"{path}: checkpoint index {key!r} is not an integer")
        if not isinstance(entry, dict) or not isinstance(entry.get("files"), dict):
            raise CheckpointFormatError(f"{path}: checkpoints.{key}.files must be an object")
        for relpath, record in entry["files"].items():
            check_relpath(relpath, f"{path}: checkpoints.{key}.files entry")
            if not (
                isinstance(record, dict)
                and isinstance(record.get("size"), int)
                and isinstance(record.get("crc32c"), int)
            ):
                raise CheckpointFormatError(
                    f"{path}: checkpoints.{key}.files[{relpath!r}] needs int size and crc32c"
                )
        entries[int(key)] = entry
    return entries


def json_bytes(document: Any) -> bytes:
    """Canonical JSON encoding of a checkpoint document (NaN refused: it is not JSON)."""
    return json.dumps(document, indent=1, allow_nan=False).encode()


class DirectoryWriter:
    """Writes files into a temporary sibling of ``final``, then swaps it into place.

    Use :meth:`add_tensors` / :meth:`add_json` for each file, then :meth:`commit`, which
    fsyncs everything and renames the directory into place (an existing ``final`` is moved
    aside first and deleted after). :meth:`abort` removes the temporary directory.

    Attributes:
        files: relpath -> ``{"size", "crc32c"}`` of every file written so far.
    """

    def __init__(self, final: Path, *, direct_io: bool = True, threads: int | None = None) -> None:
        """Create the temporary sibling directory of ``final``."""
        self.final = final
        self.direct_io = direct_io
        self.threads = threads
        for ancestor in (final.parent, *final.parent.parents):
            if ancestor.exists() and not ancestor.is_dir():
                raise NotADirectoryError(
                    errno.ENOTDIR, f"cannot create {final}: a file is in the way", str(ancestor)
                )
        final.parent.mkdir(parents=True, exist_ok=True)
        self.temp = final.parent / f"{TEMP_PREFIX}{final.name}-{os.getpid()}-{os.urandom(4).hex()}"
        self.temp.mkdir()
        self.files: dict[str, dict[str, int]] = {}
        self._dirs: set[Path] = {self.temp}

    def _target(self, relpath: str) -> Path:
        check_relpath(relpath, "file")
        path = self.temp / relpath
        if path.parent not in self._dirs:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._dirs.add(path.parent)
        return path

    def add_tensors(self, relpath: str, tensors: Mapping[str, torch.Tensor]) -> None:
        """Write a safetensors file (fsynced) and record its size and crc32c."""
        report = write_tensors(
            tensors, self._target(relpath), direct_io=self.direct_io, threads=self.threads
        )
        self.files[relpath] = {"size": report["file_len"], "crc32c": report["file_crc32c"]}

    def add_json(self, relpath: str, document: Any) -> None:
        """Write a JSON file (fsynced) and record its size and crc32c."""
        data = json_bytes(document)
        _native.write_bytes_atomic(str(self._target(relpath)), data, True)
        self.files[relpath] = {"size": len(data), "crc32c": _native.crc32c(data)}

    def commit(self) -> None:
        """fsync every directory, swap the temporary directory into place, fsync the parent."""
        for directory in sorted(self._dirs, key=lambda p: len(p.parts), reverse=True):
            _native.fsync_dir(str(directory))
        trash = None
        if self.final.exists():
            trash = self.final.parent / f"{TRASH_PREFIX}{self.final.name}-{os.urandom(4).hex()}"
            self.final.rename(trash)
        self.temp.rename(self.final)
        _native.fsync_dir(str(self.final.parent))
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)

    def abort(self) -> None:
        """Remove the temporary directory."""
        shutil.rmtree(self.temp, ignore_errors=True)


class IndexWriter(DirectoryWriter):
    """A :class:`DirectoryWriter` for ``ROOT/<index>`` whose commit also records the index
    in the manifest (the commit point)."""

    def __init__(self, root: Path, index: int, *, direct_io: bool = True) -> None:
        """Prepare to write index ``index`` of checkpoint root ``root`` (cleaning up what
        crashed saves left behind first)."""
        clean_leftovers(root)
        super().__init__(root / str(index), direct_io=direct_io)
        self.root = root
        self.index = index

    def commit_entry(self, entry: dict[str, Any]) -> None:
        """Swap the index directory into place, then commit ``entry`` to the manifest."""
        self.commit()
        manifest = Manifest.load(self.root)
        manifest.entries[self.index] = {**entry, "files": self.files}
        manifest.commit()


def clean_leftovers(root: Path) -> list[str]:
    """Remove temporary/trash directories left by crashed saves. Returns what was removed."""
    removed: list[str] = []
    if not root.is_dir():
        return removed
    for child in root.iterdir():
        if child.name.startswith((TEMP_PREFIX, TRASH_PREFIX)) and child.is_dir():
            shutil.rmtree(child, ignore_errors=True)
            removed.append(child.name)
        elif child.name.startswith(f".{MANIFEST}.fastckpt-tmp."):
            child.unlink(missing_ok=True)
            removed.append(child.name)
    return removed
