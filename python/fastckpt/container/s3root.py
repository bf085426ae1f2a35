"""The commit protocol for an object store, which has no rename.

```
ROOT/records/<index:012d>.json          one commit record per committed index (immutable)
ROOT/data/<index:012d>.<generation>/... the objects of one save attempt of that index
```

A save (:meth:`S3Root.save`):

1. picks the index (the latest committed + 1 by default) and a random *generation*, so its
   data objects live under a prefix no other save uses;
2. uploads every data object (parallel multipart, per-tensor crc32c in the header);
3. writes the index's commit record **last**, with a conditional put that only creates
   (``If-None-Match: *``): two writers can never both commit one index, the loser gets
   :class:`~fastckpt.storage.s3.errors.CommitConflictError` and nothing of its lands in a record;
4. removes leftovers: data of superseded generations (an index at or below the latest
   committed one whose record names another generation or was pruned) and the unfinished
   multipart uploads under them.

Readers trust records only, and a record is written after every object it names is complete,
so a crash at any instant leaves every committed index loadable; what a killed save uploaded
is removed by the next save or :meth:`S3Root.prune`. Data of an index *above* the latest
committed one is never touched: it may belong to a save still running elsewhere.
"""

from __future__ import annotations

import json
import re
import secrets
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from fastckpt import _native
from fastckpt.errors import CheckpointFormatError, ChecksumMismatchError
from fastckpt.storage.s3.client import S3Client, client_for
from fastckpt.storage.s3.config import S3Options, S3Url
from fastckpt.storage.s3.errors import CommitConflictError, ObjectStoreError
from fastckpt.storage.s3.tensors import get_tensors, put_tensors

__all__ = [
    "RECORD_FORMAT",
    "Leftovers",
    "S3Root",
    "SavedCheckpoint",
]

RECORD_FORMAT = "fastckpt-s3-record"
SCHEMA_VERSION = 1
RECORDS = "records"
DATA = "data"
#: The largest record fastckpt reads (a hostile object cannot make it read without bound).
MAX_RECORD_BYTES = 64 << 20
_RECORD_NAME = re.compile(r"^(\d{12})\.json$")
_DATA_NAME = re.compile(r"^(\d{12})\.([0-9a-f]{16})$")
_KINDS = ("tensors", "bytes")


@dataclass
class SavedCheckpoint:
    """What :meth:`S3Root.load` returns.

    Attributes:
        index: the committed index.
        record: its commit record (``created``, ``metadata``, ``files``...).
        files: relpath -> tensors (``dict[str, Tensor]``) or bytes, all verified.
    """

    index: int
    record: dict[str, Any]
    files: dict[str, Any]


@dataclass
class Leftovers:
    """What crashed or losing saves left behind (see :meth:`S3Root.leftovers`).

    Attributes:
        keys: data objects of superseded generations.
        uploads: unfinished multipart uploads under superseded generations.
    """

    keys: list[str]
    uploads: list[Any]

    def __bool__(self) -> bool:
        return bool(self.keys or self.uploads)


def _check_relpath(relpath: object) -> str:
    if not isinstance(relpath, str) or not relpath:
        raise CheckpointFormatError(f"file name {relpath!r} must be a non-empty str")
    for part in relpath.split("/"):
        if not part or part in (".", "..") or part.startswith(".") or "\\" in part or "\0" in part:
            raise CheckpointFormatError(
                f"file name {relpath!r}: use plain names separated by '/' (no empty, '.', "
                "'..' or hidden parts)"
            )
    return relpath


def _canonical(document: Mapping[str, Any]) -> bytes:
    return json.dumps(document, sort_keys=True, separators=(",", ":")).encode()


def _sealed(document: dict[str, Any]) -> bytes:
    body = {k: v for k, v in document.items() if k != "crc32c"}
    return _canonical({**body, "crc32c": _native.crc32c(_canonical(body))})


class S3Root:
    """A root of indexed checkpoints at ``s3://bucket/prefix`` (see the module docstring).

    Args:
        url: ``s3://bucket/prefix``.
        storage_options: per-call client settings (:class:`~fastckpt.storage.s3.config.S3Options`
            fields); unset ones come from the AWS environment and config files.
        client: an existing client of the bucket (overrides ``storage_options``).
    """

    def __init__(
        self,
        url: str | S3Url,
        storage_options: S3Options | Mapping[str, Any] | None = None,
        *,
        client: S3Client | None = None,
    ) -> None:
        self.url = url if isinstance(url, S3Url) else S3Url.parse(url)
        self.client = client or client_for(self.url, storage_options)

    # ------------------------------------------------------------------------------- names

    def record_key(self, index: int) -> str:
        """The key of index ``index``'s commit record."""
        return self.url.key(RECORDS, f"{index:012d}.json")

    def data_prefix(self, index: int, generation: str) -> str:
        """The folder of one save attempt's objects."""
        return self.url.key(DATA, f"{index:012d}.{generation}")

    # ------------------------------------------------------------------------------- reading

    def indices(self) -> list[int]:
        """The committed indices, ascending (one LIST of the records folder)."""
        found = []
        for meta in self.client.list_objects(self.url.key(RECORDS) + "/"):
            match = _RECORD_NAME.match(meta.key.rsplit("/", 1)[-1])
            if match:
                found.append(int(match.group(1)))
        return sorted(found)

    def latest(self) -> int | None:
        """The newest committed index, or None when nothing is committed."""
        found = self.indices()
        return found[-1] if found else None

    def read_record(self, index: int) -> dict[str, Any]:
        """The commit record of ``index``, checked (format, checksum, names).

        Raises:
            ObjectNotFoundError: ``index`` is not committed.
            CheckpointFormatError: the record is malformed or fails its checksum.
        """
        key = self.record_key(index)
        where = self.client.url(key)
        raw, _ = self.client.get(key, limit=MAX_RECORD_BYTES)
        try:
            document = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise CheckpointFormatError(f"{where}: not JSON ({err})") from None
        if not isinstance(document, dict) or document.get("format") != RECORD_FORMAT:
            raise CheckpointFormatError(f"{where}: field 'format' is not {RECORD_FORMAT!r}")
        body = {k: v for k, v in document.items() if k != "crc32c"}
        if document.get("crc32c") != _native.crc32c(_canonical(body)):
            raise ChecksumMismatchError(
                f"{where}: the record fails its crc32c; it was changed after commit: load "
                "another index"
            )
        if document.get("index") != index or not _DATA_NAME.match(
            f"{index:012d}.{document.get('generation')}"
        ):
            raise CheckpointFormatError(f"{where}: field 'index' or 'generation' is wrong")
        files = document.get("files")
        if not isinstance(files, dict):
            raise CheckpointFormatError(f"{where}: field 'files' is not a mapping")
        for relpath, entry in files.items():
            _check_relpath(relpath)
            if (
                not isinstance(entry, dict)
                or entry.get("kind") not in _KINDS
                or not isinstance(entry.get("size"), int)
                or not isinstance(entry.get("crc32c"), int)
            ):
                raise CheckpointFormatError(f"{where}: field 'files.{relpath}' is malformed")
        return document

    def load(self, index: int = -1, *, verify: bool = True, threads: int = 4) -> SavedCheckpoint:
        """Download and verify every file of a committed index (-1: the latest).

        Raises:
            ObjectNotFoundError: nothing committed, ``index`` not committed, or a file the
                record names is gone (named).
            ChecksumMismatchError: corrupt bytes (names the URL and tensor).
            CheckpointFormatError: malformed record or file.
        """
        if index == -1:
            latest = self.latest()
            if latest is None:
                from fastckpt.storage.s3.errors import ObjectNotFoundError

                raise ObjectNotFoundError(f"{self.url}: no committed checkpoint")
            index = latest
        record = self.read_record(index)
        prefix = self.data_prefix(index, record["generation"])
        files: dict[str, Any] = {}
        for relpath, entry in record["files"].items():
            key = f"{prefix}/{relpath}"
            if entry["kind"] == "tensors":
                files[relpath], _ = get_tensors(
                    self.client,
                    key,
                    size=entry["size"],
                    crc32c=entry["crc32c"],
                    verify=verify,
                    threads=threads,
                )
            else:
                data, meta = self.client.get(key, limit=MAX_RECORD_BYTES)
                if verify and (
                    meta.size != entry["size"] or _native.crc32c(data) != entry["crc32c"]
                ):
                    raise ChecksumMismatchError(
                        f"{self.client.url(key)}: size or crc32c differs from the commit "
                        "record; the object was changed after commit: load another index"
                    )
                files[relpath] = data
        return SavedCheckpoint(index, record, files)

    # ------------------------------------------------------------------------------- writing

    def save(
        self,
        files: Mapping[str, bytes | Mapping[str, torch.Tensor]],
        *,
        metadata: Mapping[str, Any] | None = None,
        index: int = -1,
    ) -> int:
        """Upload ``files`` and commit them as one index (see the module docstring).

        Args:
            files: relpath -> bytes, or relpath -> ``{name: tensor}`` (a safetensors object).
            metadata: JSON-serializable data stored in the record.
            index: the index to commit (-1: the latest committed + 1).

        Returns:
            The committed index.

        Raises:
            CommitConflictError: another writer committed ``index`` first.
            ObjectStoreError: an upload failed (typed; nothing was committed).
        """
        plan = {_check_relpath(relpath): content for relpath, content in files.items()}
        if index == -1:
            latest = self.latest()
            index = 0 if latest is None else latest + 1
        if index < 0:
            raise ValueError(f"index must be >= 0 or -1 (next), got {index}")
        generation = secrets.token_hex(8)
        prefix = self.data_prefix(index, generation)
        entries: dict[str, dict[str, Any]] = {}
        for relpath, content in plan.items():
            key = f"{prefix}/{relpath}"
            if isinstance(content, bytes | bytearray | memoryview):
                data = bytes(content)
                self.client.put(key, data)
                entries[relpath] = {
                    "kind": "bytes",
                    "size": len(data),
                    "crc32c": _native.crc32c(data),
                }
            else:
                report = put_tensors(self.client, key, content)
                entries[relpath] = {
                    "kind": "tensors",
                    "size": report["size"],
                    "crc32c": report["crc32c"],
                }
        record = {
            "format": RECORD_FORMAT,
            "schema_version": SCHEMA_VERSION,
            "index": index,
            "generation": generation,
            "created": time.time(),
            "metadata": dict(metadata or {}),
            "files": entries,
        }
        try:
            self.client.put(self.record_key(index), _sealed(record), mode="create")
        except CommitConflictError:
            self._remove_quietly([f"{prefix}/{relpath}" for relpath in entries])
            raise
        self._clean_quietly()
        return index

    # ---------------------------------------------------------------------------- cleaning

    def leftovers(self) -> Leftovers:
        """Data of superseded save attempts, and their unfinished multipart uploads.

        An attempt is superseded when its index is at or below the latest committed index
        and no record names its generation (it crashed, lost a commit race, or was pruned).
        """
        committed = set(self.indices())
        if not committed:
            return Leftovers([], [])
        latest = max(committed)
        live: dict[int, str | None] = {}

        def generation_of(index: int) -> str | None:
            # One GET per index that still has data folders, not per committed index.
            if index not in live:
                try:
                    live[index] = self.read_record(index)["generation"]
                except (CheckpointFormatError, ObjectStoreError):
                    live[index] = None  # unreadable: keep its data, never guess
            return live[index]

        def superseded(folder: str) -> bool:
            match = _DATA_NAME.match(folder)
            if not match:
                return False
            index = int(match.group(1))
            if index > latest:
                return False
            if index not in committed:
                return True
            generation = generation_of(index)
            return generation is not None and generation != match.group(2)

        data_root = self.url.key(DATA) + "/"
        keys = [
            meta.key
            for meta in self.client.list_objects(data_root)
            if superseded(meta.key[len(data_root) :].split("/", 1)[0])
        ]
        uploads = [
            upload
            for upload in self.client.pending_uploads(data_root)
            if superseded(upload.key[len(data_root) :].split("/", 1)[0])
        ]
        return Leftovers(keys, uploads)

    def clean(self) -> Leftovers:
        """Delete every leftover (see :meth:`leftovers`); returns what was removed."""
        found = self.leftovers()
        for upload in found.uploads:
            self.client.abort_upload(upload)
        self.client.delete(found.keys)
        return found

    def prune(self, keep_last: int) -> list[int]:
        """Keep the newest ``keep_last`` committed indices; remove the others.

        Records go first (so no record ever names a deleted object), then their data.

        Returns:
            The removed indices.
        """
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        committed = self.indices()
        removed = committed[:-keep_last]
        self.client.delete([self.record_key(index) for index in removed])
        self.clean()
        return removed

    def _remove_quietly(self, keys: list[str]) -> None:
        try:
            self.client.delete(keys)
        except ObjectStoreError as err:
            warnings.warn(f"could not remove a losing save's objects: {err}", stacklevel=3)

    def _clean_quietly(self) -> None:
        try:
            self.clean()
        except ObjectStoreError as err:
            warnings.warn(
                f"{self.url}: committed, but removing leftovers failed ({err}); the next save "
                "or prune retries",
                stacklevel=3,
            )
