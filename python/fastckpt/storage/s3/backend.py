"""The object-store implementation of :class:`~fastckpt.storage.backend.StorageBackend`.

Paths are ``s3://bucket/key`` URLs (also in their ``pathlib`` spelling ``s3:/bucket/key``,
which is what ``Path("s3://...")`` turns them into). How the interface maps onto a store
without rename or directories:

* a *directory* is a key prefix: :meth:`S3Backend.list_dir` lists one level of it,
  :meth:`S3Backend.delete` removes every object under it and aborts unfinished multipart
  uploads there;
* :meth:`S3Backend.stage` returns an :class:`S3Staging` that puts each file straight under
  its final key (safetensors files as parallel multipart uploads with per-tensor crc32c);
  ``publish`` has nothing left to do: the commit record, written after, is what makes the
  files part of a checkpoint;
* :meth:`S3Backend.put_record` is a *conditional* put: it only replaces the version of the
  record this backend last read (``If-Match``), or only creates it when it read none
  (``If-None-Match: *``); a writer that lost a race gets
  :class:`~fastckpt.storage.s3.errors.CommitConflictError` instead of overwriting a commit;
* :meth:`S3Backend.lock` is :class:`S3RootLock`, a lease held as the object
  ``ROOT/.fastckpt.lock``, created conditionally, renewed by a heartbeat and taken over once
  its holder stopped renewing it (a killed holder blocks others for at most ``lease_ttl_s``);
* while this process holds a root's lease, the backend *fences* every write under that root
  with it: objects are written and deleted only while the lease is still this holder's
  (:meth:`S3RootLock.check`), and a commit record is replaced only if it is still the version
  this holder first read under the lease or last wrote (not a version re-read just before the
  put), right after a conditional renewal of the lease. A writer that was paused past its
  lease and taken over gets :class:`~fastckpt.storage.s3.errors.LeaseLostError` and commits and
  deletes nothing.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import math
import os
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Hashable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from fastckpt import _native
from fastckpt.errors import CheckpointFormatError, ChecksumMismatchError
from fastckpt.io.forksafe import ForkSafeLock
from fastckpt.io.headers import read_metadata
from fastckpt.io.paths import check_relpath
from fastckpt.storage.access import NO_ROOM, scratch_full
from fastckpt.storage.backend import (
    MAX_RECORD_BYTES,
    CopySource,
    FileRecord,
    ObjectInfo,
    Staging,
    StorageBackend,
)
from fastckpt.storage.lock import LOCK_FILE, checked_lock_timeout, reentry_error
from fastckpt.storage.s3.client import (
    MAX_PART,
    CopyNotSupportedError,
    CopyPart,
    S3Client,
    client_for,
)
from fastckpt.storage.s3.config import S3Options, S3Url
from fastckpt.storage.s3.copy import (
    CopiedTensor,
    is_known_intact,
    prove_copied_tensors,
    put_tensors_copying,
    remember_written,
)
from fastckpt.storage.s3.errors import (
    AccessDeniedError,
    CommitConflictError,
    CommitOutcomeUnknownError,
    LeaseLostError,
    ObjectNotFoundError,
    ObjectStoreError,
)
from fastckpt.storage.s3.tensors import get_tensors, put_tensors

if TYPE_CHECKING:
    import torch

__all__ = [
    "S3Backend",
    "S3RootLock",
    "S3Staging",
    "backend_for_url",
    "register_storage_options",
    "registered_options",
]

_LOG = logging.getLogger(__name__)
#: the packages this backend imports on use, and the extra that installs them (checked by
#: :mod:`fastckpt.storage.registry` before an ``s3://`` path is used)
REQUIRES = ("obstore", "boto3")
EXTRA = "s3"
_READ_PIECE = 16 << 20
_MAX_HEADER = 100 << 20  # the safetensors limit on a header's size
_OPTIONS: dict[str, S3Options] = {}
_OPTIONS_LOCK = ForkSafeLock()  # free in a forked child


def register_storage_options(url: str, options: S3Options | Mapping[str, Any] | None) -> None:
    """Use ``options`` for every path under ``url`` that is opened without explicit ones
    (the longest registered prefix wins; None removes the registration)."""
    prefix = str(S3Url.parse(url))
    with _OPTIONS_LOCK:
        if options is None:
            _OPTIONS.pop(prefix, None)
        else:
            _OPTIONS[prefix] = S3Options.from_mapping(options)


def _registered(url: S3Url) -> S3Options | None:
    text = str(url)
    with _OPTIONS_LOCK:
        matches = [p for p in _OPTIONS if text == p or text.startswith(p.rstrip("/") + "/")]
        return _OPTIONS[max(matches, key=len)] if matches else None


def registered_options(url: str) -> dict[str, Any] | None:
    """The options registered for ``url``'s prefix (None: none), as a mapping
    :func:`register_storage_options` takes again."""
    options = _registered(S3Url.parse(url))
    return None if options is None else dataclasses.asdict(options)


def backend_for_url(
    path: str | os.PathLike[str], storage_options: S3Options | Mapping[str, Any] | None = None
) -> S3Backend:
    """The backend for an ``s3://`` path (``storage_options`` None: the registered options
    for its prefix, else the AWS environment and config files)."""
    url = S3Url.parse(path)
    options = (
        S3Options.from_mapping(storage_options) if storage_options is not None else _registered(url)
    )
    return S3Backend(client_for(url, options))


def parse_header(header: bytes, size: int, url: str) -> dict[str, Any]:
    """The validated header of a ``size``-byte safetensors object whose first bytes are
    ``header`` (length word included), as :func:`~fastckpt.io.files.read_metadata` gives it.

    The bytes are placed at the start of a sparse local temporary file as long as the object,
    so the Rust core checks the data offsets against the real size without any tensor data.

    Raises:
        CheckpointFormatError: not a valid header for that size (names ``url``).
        ScratchSpaceError: the local temporary folder (``TMPDIR``) has no room for it.
    """
    try:
        # Unbuffered: a write refused for room fails here, not again when the file closes.
        scratch = tempfile.NamedTemporaryFile(prefix="fastckpt-header-", buffering=0)  # noqa: SIM115
    except OSError as err:
        if err.errno not in NO_ROOM:
            raise
        raise scratch_full(err, tempfile.gettempdir(), f"reading the header of {url}") from err
    with scratch:
        try:
            _write_all(scratch, header)
            scratch.truncate(size)
            scratch.flush()
        except OSError as err:
            if err.errno not in NO_ROOM:
                raise
            folder = os.path.dirname(scratch.name)
            raise scratch_full(err, folder, f"reading the header of {url}") from err
        try:
            return read_metadata(scratch.name)
        except CheckpointFormatError as err:
            raise CheckpointFormatError(str(err).replace(scratch.name, url)) from None


def _write_all(file: Any, data: bytes) -> None:
    """Write every byte of ``data`` to the unbuffered ``file``: a raw write may store part of
    it (a nearly full disk), and the rest is written, or its refusal raised, by the next
    (before, the rest was left as the zeros of the sparse file: a healthy object's header
    read as damaged)."""
    view = memoryview(data)
    while view:
        written = file.write(view)
        if not written:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), file.name)
        view = view[written:]


class S3Backend(StorageBackend):
    """:class:`StorageBackend` over one bucket (see the module docstring).

    Args:
        client: the bucket's client (:func:`~fastckpt.storage.s3.client.client_for`).
    """

    def __init__(self, client: S3Client) -> None:
        self.client = client
        self._etags: dict[str, str | None] = {}  # record key -> etag last seen (None: absent)
        self._etags_lock = threading.Lock()

    def _key(self, path: str | os.PathLike[str]) -> str:
        url = S3Url.parse(path)
        if url.bucket != self.client.bucket_url.bucket:
            raise ValueError(f"{url} is not in bucket {self.client.bucket_url.bucket!r}")
        return url.prefix

    def fence(self, key: str) -> S3RootLock | None:
        """Before a write of ``key``: the lease this process holds on its root, checked
        (None: no lease covers it).

        Raises:
            LeaseLostError: the lease was taken over (nothing may be written any more).
        """
        lease = held_lease(self.client, key)
        if lease is not None:
            lease.check()
        return lease

    # ------------------------------------------------------------------------------- reading

    def stat(self, path: Path) -> ObjectInfo:
        """An object's size (``regular=True``), or a non-empty prefix (``regular=False``; the
        bucket itself is one: a HEAD of the empty key is a HEAD of the bucket, which a store
        answers with a size of 0 as if it were an empty object)."""
        key = self._key(path)
        if not key.strip("/"):
            if self.list_dir(path):
                return ObjectInfo(0, False)
            raise ObjectNotFoundError(f"{S3Url.parse(path)}: an empty bucket")
        try:
            meta = self.client.head(key)
        except ObjectNotFoundError:
            if self.list_dir(path):
                return ObjectInfo(0, False)
            raise
        except ObjectStoreError:
            # Some stores (s3s-fs) answer a HEAD of a folder's name with a server error.
            if self.is_directory(path):
                return ObjectInfo(0, False)
            raise
        return ObjectInfo(meta.size, True, meta.modified, meta.etag)

    def exists(self, path: Path) -> bool:
        """An object or a non-empty prefix is there."""
        try:
            self.stat(path)
        except ObjectNotFoundError:
            return False
        return True

    def is_directory(self, path: Path) -> bool:
        """Objects are under the prefix ``path``: one listing (no HEAD of a key named like
        the prefix, which some stores answer with a server error, retried, for a folder)."""
        folders, objects = self.client.list_dir(self._key(path).rstrip("/") + "/")
        return bool(folders or objects)

    def read_bytes(self, path: Path, *, limit: int = MAX_RECORD_BYTES) -> bytes:
        """One GET; remembers the version read, for a later conditional :meth:`put_record`."""
        key = self._key(path)
        lease = held_lease(self.client, key)
        try:
            data, meta = self.client.get(key, limit=limit)
        except ObjectNotFoundError:
            with self._etags_lock:
                self._etags[key] = None
            if lease is not None:
                lease.saw_version(key, None)
            raise
        with self._etags_lock:
            self._etags[key] = meta.etag
        if lease is not None:
            lease.saw_version(key, meta.etag)
        return data

    def read_range(self, path: Path, offset: int, length: int) -> bytes:
        """One ranged GET."""
        return self.client.get_range(self._key(path), offset, offset + length)

    def read_into(self, path: Path, offset: int, dest: np.ndarray) -> None:
        """Parallel ranged GETs streamed into ``dest`` (:meth:`S3Client.read_into`).

        Raises:
            ObjectStoreError: a range failed or came back short (typed, naming the URL).
        """
        self.client.read_into(self._key(path), dest, offset)

    def checksum(self, path: Path) -> tuple[int, int]:
        """``(size, crc32c)`` of the object, streamed in 16 MiB ranges."""
        key = self._key(path)
        size = self.client.head(key).size
        crc = 0
        for offset in range(0, size, _READ_PIECE):
            crc = _native.crc32c(self.client.get_range(key, offset, offset + _READ_PIECE), crc)
        return size, crc

    def verify_tensors(self, path: Path, threads: int) -> tuple[int, list[str]]:
        """Download and run the Rust verifier: ``(whole-object crc32c, unchecked names)``."""
        key = self._key(path)
        flat = np.empty(self.client.head(key).size, dtype=np.uint8)
        self.client.read_into(key, flat, 0)
        header = _native.check_mapped(self.client.url(key), flat, True, threads)
        checked = set(header["checksums"])
        unchecked = [t["name"] for t in header["tensors"] if t["name"] not in checked]
        return int(header["file_crc32c"]), unchecked

    def open_tensors(
        self, path: Path, *, verify: bool = True, threads: int | None = None
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Parallel ranged GETs into one buffer, verified by the Rust core."""
        return get_tensors(self.client, self._key(path), verify=verify, threads=threads or 4)

    def read_header(self, path: Path) -> dict[str, Any]:
        """Two ranged GETs (the length word, then the header), validated by the Rust core.

        The header bytes are placed at the start of a sparse local temporary file as long as
        the object, so the core checks the data offsets against the real size without any
        tensor data being downloaded or stored.
        """
        key = self._key(path)
        size = self.client.head(key).size
        url = self.client.url(key)
        prefix = self.client.get_range(key, 0, 8)
        length = int.from_bytes(prefix, "little") if len(prefix) == 8 else 0
        if len(prefix) < 8 or length > min(size - 8, _MAX_HEADER):
            raise CheckpointFormatError(
                f"{url}: not a safetensors file (header length {length} in a {size}-byte object)"
            )
        header = prefix + self.client.get_range(key, 8, 8 + length)
        return parse_header(header, size, url)

    def list_dir(self, directory: Path) -> list[str]:
        """Sub-prefix and object names one level under ``directory``.

        A sub-prefix holding nothing but unfinished multipart uploads (a save killed before
        its first object completed) is listed too, so that a clean-up deleting what it lists
        (:meth:`delete` aborts uploads) leaves no upload behind.
        """
        key = self._key(directory)
        folders, objects = self.client.list_dir(key)
        names = set(folders) | {meta.key.rsplit("/", 1)[-1] for meta in objects}
        folder = key.rstrip("/") + "/" if key.rstrip("/") else ""
        for upload in self.client.pending_uploads(folder):
            rest = upload.key[len(folder) :]
            if rest:
                names.add(rest.split("/", 1)[0])
        return sorted(names)

    # ------------------------------------------------------------------------------- writing

    def stage(
        self, final: Path, *, direct_io: bool | None = None, threads: int | None = None
    ) -> S3Staging:
        """An :class:`S3Staging` writing under ``final``'s prefix (``direct_io`` and
        ``threads`` concern local disks and are ignored)."""
        del direct_io, threads
        return S3Staging(self, S3Url.parse(final))

    def put_record(self, path: Path, data: bytes) -> None:
        """Replace a commit record only if it is still the version last read here.

        Under a lease this process holds on the record's root, "last read" is the version
        this holder *first* read under the lease (or last wrote itself): a record another
        writer committed meanwhile is never overwritten, however often it was re-read. The
        lease is renewed (conditionally) right before the put.

        A put that fails without a refusal (no answer, a server error, a conflict met by a
        retry) is settled by reading the record back and, when it does not hold ``data``,
        putting it once more on the same condition (:meth:`_settle`).

        Raises:
            LeaseLostError: this holder's lease was taken over; nothing was written.
            CommitConflictError: another writer replaced (or created) it meanwhile.
            CommitOutcomeUnknownError: the put failed and the record cannot be read back, or
                failed twice: it may have been applied (delete nothing it may name).
        """
        key = self._key(path)
        lease = held_lease(self.client, key)
        known, etag = False, None
        if lease is not None:
            lease.confirm()
            known, etag = lease.record_version(key)
        if not known:
            with self._etags_lock:
                known = key in self._etags
                etag = self._etags.get(key)
        if not known:
            try:
                etag = self.client.head(key).etag
            except ObjectNotFoundError:
                etag = None
        mode: str | dict[str, Any] = {"e_tag": etag} if etag else "create"
        try:
            new_etag = self.client.put(key, data, mode=mode)
        except (AccessDeniedError, ObjectNotFoundError):
            raise  # answered, and refused: nothing was written
        except ObjectStoreError as err:
            # No answer, a server error, or a conflict met by a retry of a put that was
            # applied: the store may hold this very record (see _settle).
            new_etag = self._settle(key, data, mode, err, lease)
        with self._etags_lock:
            self._etags[key] = new_etag
        if lease is not None:
            lease.saw_version(key, new_etag, wrote=True)

    def _settle(
        self,
        key: str,
        data: bytes,
        mode: str | dict[str, Any],
        failure: ObjectStoreError,
        lease: Any = None,
    ) -> str | None:
        """After the put of record ``key`` failed with ``failure`` (no answer, a server error,
        or a conflict met by a retry of a put the store had applied): make sure whether the
        record holds ``data``, and return its etag when it does (committed).

        The record is read back first: holding ``data``, the put was applied. Otherwise the
        put is issued once more, on the same condition: a first put still in flight can then
        no longer land unnoticed (after this one, its condition fails; before it, this one
        conflicts and the record is read again), and one that never reached the store lands
        now. Under a lease the second put is made only while the lease still holds (the
        first attempt may have outlasted it).

        Raises:
            LeaseLostError: the lease was taken over meanwhile: nothing more is put.
            CommitConflictError: the record is another writer's.
            CommitOutcomeUnknownError: the record cannot be read, or the second put got no
                answer either: it may hold ``data`` (the caller must delete nothing it may
                name).
        """
        holds, etag = self._holds(key, data, failure)
        if holds:
            return etag
        if lease is not None:
            lease.confirm()
        try:
            etag = self.client.put(key, data, mode=mode)
        except CommitConflictError as conflict:
            holds, etag = self._holds(key, data, conflict)
            if holds:
                return etag
            raise conflict from failure
        except (AccessDeniedError, ObjectNotFoundError):
            raise
        except ObjectStoreError as again:
            raise CommitOutcomeUnknownError(
                f"{self.client.url(key)}: the put of this commit record failed twice ({failure}; "
                f"{again}): the store may have applied either, so the save is reported failed "
                "but nothing it wrote is deleted. Once the store answers, `fastckpt verify` "
                "shows which checkpoint is committed; the next save removes what no record "
                "names."
            ) from again
        _LOG.warning(
            "%s: the first put of this commit record failed (%s); the second was applied",
            self.client.url(key),
            failure,
        )
        return etag

    def _holds(self, key: str, data: bytes, failure: ObjectStoreError) -> tuple[bool, str | None]:
        """Whether record ``key`` reads back as ``data`` byte for byte (and its etag).

        Raises:
            CommitOutcomeUnknownError: it cannot be read (``failure`` is what made it asked).
        """
        try:
            stored, meta = self.client.get(key, limit=len(data))
        except (ObjectNotFoundError, CheckpointFormatError):
            return False, None  # none, or longer than this record: not this put's
        except ObjectStoreError as err:
            raise CommitOutcomeUnknownError(
                f"{self.client.url(key)}: the put of this commit record failed ({failure}) and "
                f"reading it back failed too ({err}): the store may have applied it, so the "
                "save is reported failed but nothing it wrote is deleted. Once the store "
                "answers, `fastckpt verify` shows which checkpoint is committed; the next save "
                "removes what no record names."
            ) from failure
        if stored != data:
            return False, None
        _LOG.warning(
            "%s: the store applied this commit record although its put failed (%s): committed",
            self.client.url(key),
            failure,
        )
        return True, meta.etag

    def delete(self, path: Path) -> None:
        """Remove the object at ``path`` and everything under it (unfinished uploads too).

        Raises:
            LeaseLostError: under a root whose lease this process lost (nothing deleted).
        """
        key = self._key(path)
        self.fence(key)
        folder = key.rstrip("/") + "/"
        for upload in self.client.pending_uploads(folder):
            self.client.abort_upload(upload)
        # The object at ``key`` itself first (a commit record deleted before the files it
        # names): the LIST below covers ``key/`` only (before, a delete of one object deleted
        # nothing). Only keys that exist are deleted: a store that keeps folders, such as
        # s3s-fs on a filesystem, refuses to delete a key that names one.
        if self.client.has_object(key):
            self.client.delete([key])
        listed = self.client.list_objects(key)
        self.client.delete(m.key for m in listed if m.key.startswith(folder))
        with self._etags_lock:
            self._etags.pop(key, None)

    def copy_file(self, source: Path, target: Path, size: int) -> bool:
        """A server-side copy: a multipart upload of parts the store copies from ``source``
        (UploadPartCopy, at most 5 GiB each), fenced by this process's lease on the root.
        False when the store cannot copy ranges (nothing is left at ``target``).

        Raises:
            LeaseLostError: the lease was taken over; nothing was written.
            ObjectNotFoundError / ObjectStoreError: ``source`` is gone, or the store failed.
        """
        key, source_key = self._key(target), self._key(source)
        self.fence(key)
        if size == 0:
            self.client.put(key, b"")
            return True
        parts = [
            CopyPart(source_key, start, min(start + MAX_PART, size))
            for start in range(0, size, MAX_PART)
        ]
        try:
            self.client.compose(key, parts)
        except CopyNotSupportedError:
            return False
        return True

    def lock(self, root: Path, *, timeout: float | None = None) -> S3RootLock:
        """The lease lock of ``root`` (:class:`S3RootLock`, not yet acquired; its time to
        live is the client's ``lease_ttl_s`` option)."""
        return S3RootLock(
            self.client, S3Url.parse(root), timeout=timeout, ttl_s=self.client.options.lease_ttl_s
        )

    def prepare_writer(self) -> None:
        """Build the client a commit lists and aborts unfinished uploads with (boto3: its
        import and set-up take a few hundred ms, which a writer's first commit would pay)."""
        self.client.control_client()


class S3Staging(Staging):
    """Files of one container put under their final keys (see the module docstring).

    Attributes:
        final: the container's URL in ``pathlib`` spelling.
        files: relpath -> ``{"size", "crc32c"}``.
        copied_bytes: bytes the store copied instead of this process uploading them
            (incremental saves).
    """

    def __init__(self, backend: S3Backend, url: S3Url) -> None:
        self.backend = backend
        self.url = url
        self.final = Path(str(url))
        self.files = {}
        self.copied_bytes = 0
        self._headers: dict[str, tuple[bytes, int]] = {}
        self._etags: dict[str, str | None] = {}
        #: The lease this process held on the container's root when staging began: every
        #: write is fenced with it (see :meth:`S3RootLock.check`).
        self.lease = held_lease(backend.client, url.prefix)

    def _fence(self, key: str) -> None:
        if self.lease is not None:
            self.lease.check()
        else:
            self.backend.fence(key)

    @property
    def location(self) -> str:
        """The container's URL (files are already at their final keys)."""
        return str(self.url)

    def _key(self, relpath: str) -> str:
        check_relpath(relpath, "file")
        return self.url.key(relpath)

    def put_bytes(self, relpath: str, data: bytes) -> FileRecord:
        """One PUT; records size and crc32c."""
        key = self._key(relpath)
        self._fence(key)
        client = self.backend.client
        if len(data) <= client.options.single_put_max:
            etag = client.put(key, data)
        else:  # a large file (a promoted tensor file): parallel multipart
            etag = client.put_stream(key, [memoryview(data)], len(data))
        remember_written(client, key, etag)
        self._etags[relpath] = etag
        record = {"size": len(data), "crc32c": _native.crc32c(data)}
        self.files[relpath] = record
        return record

    def put_tensors(
        self,
        relpath: str,
        tensors: Mapping[str, torch.Tensor],
        copies: Mapping[str, CopySource] | None = None,
        *,
        metadata: Mapping[str, str] | None = None,
    ) -> FileRecord:
        """A parallel multipart upload of a safetensors object; records size and crc32c.
        Tensors in ``copies`` are copied by the store from the objects that hold them
        (:mod:`fastckpt.storage.s3.copy`), whose headers are read to find their bytes, and only
        from objects whose bytes are proven intact (see :meth:`_locate`).

        Raises:
            ChecksumMismatchError: a copied tensor is not what ``copies`` says any more (its
                object was replaced), or its stored bytes fail its checksum.
        """
        client = self.backend.client
        key = self._key(relpath)
        self._fence(key)
        if copies:
            if metadata:
                raise ValueError(f"{self.backend.client.url(key)}: metadata with copies")
            report = put_tensors_copying(client, key, tensors, self._locate(copies))
            self.copied_bytes += report["copied_bytes"]
        else:
            report = put_tensors(client, key, tensors, metadata)
        remember_written(client, key, report["etag"])
        self._etags[relpath] = report["etag"]
        record = {"size": report["size"], "crc32c": report["crc32c"]}
        self.files[relpath] = record
        self._headers[relpath] = (report["header"], report["size"])
        return record

    def written_header(self, relpath: str) -> dict[str, Any]:
        """The header of the safetensors object :meth:`put_tensors` wrote at ``relpath``, as
        :meth:`S3Backend.read_header` would read it back, from the bytes this process sent
        (no request: the upload succeeded, so the store holds exactly these bytes).

        Raises:
            KeyError: nothing was put at ``relpath`` by this staging.
        """
        header, size = self._headers[relpath]
        return parse_header(header, size, str(self.url) + "/" + relpath)

    def _locate(self, copies: Mapping[str, CopySource]) -> dict[str, CopiedTensor]:
        """Where each copied tensor's bytes are (one HEAD and one header read per source
        object), each pinned to the source's current version (its etag).

        A source is trusted as it is only when that version is one this process wrote (or
        proved before); otherwise the copied tensors' bytes are read back from it and checked
        against their crc32c first (:func:`~fastckpt.storage.s3.copy.prove_copied_tensors`), so
        a store never copies damaged bytes into a new checkpoint."""
        client = self.backend.client
        headers: dict[Path, dict[str, Any]] = {}
        versions: dict[Path, str | None] = {}
        located = {}
        for name, source in copies.items():
            if source.path not in headers:
                versions[source.path] = client.head(self.backend._key(source.path)).etag
                headers[source.path] = self.backend.read_header(source.path)
            header = headers[source.path]
            entry = header["tensors"].get(source.name)
            found = None if entry is None else (entry["dtype"], entry["shape"], entry["crc32c"])
            if found != (source.dtype, list(source.shape), source.crc32c):
                expected = (source.dtype, list(source.shape), source.crc32c)
                raise ChecksumMismatchError(
                    f"{self.backend.client.url(self.backend._key(source.path))}: tensor "
                    f"{source.name!r} is (dtype, shape, crc32c) {found}, not the {expected} an "
                    "incremental save expected; the object was replaced: save again (in full)"
                )
            begin, end = entry["data_offsets"]
            start = header["data_start"]
            located[name] = CopiedTensor(
                self.backend._key(source.path),
                start + begin,
                start + end,
                source.dtype,
                list(source.shape),
                source.crc32c,
                versions[source.path],
            )
        unproven = {
            name: copy
            for name, copy in located.items()
            if not is_known_intact(client, copy.source_key, copy.etag)
        }
        if unproven:
            prove_copied_tensors(client, unproven)
        return located

    def identity(self, relpath: str) -> Hashable | None:
        """The etag the store gave the object put at ``relpath`` (None: it gave none)."""
        return self._etags.get(relpath)

    def put_copy(self, relpath: str, source: Path, record: FileRecord, identity: Hashable) -> bool:
        """Have the store copy the object ``source`` (its version ``identity``, an etag) to
        ``relpath``: a multipart upload of copied parts (UploadPartCopy, each conditional on
        that etag), so no byte reaches this process. False when the store cannot copy, or
        ``source`` is gone or was replaced: the caller uploads the bytes (over what a copy
        may have left at ``relpath``).

        The source's etag is also read before and after the copy: a store that ignores the
        copy condition (moto does) would otherwise copy a replaced object's bytes, and the
        promotion commit a file that does not verify."""
        size = int(record["size"])
        if not isinstance(identity, str) or not identity or size == 0:
            return False
        client = self.backend.client
        key = self._key(relpath)
        source_key = self.backend._key(source)
        self._fence(key)
        if not self._still(source_key, identity):
            return False
        parts = [
            CopyPart(source_key, start, min(start + MAX_PART, size), identity)
            for start in range(0, size, MAX_PART)
        ]
        try:
            etag = client.compose(key, parts)
        except (ObjectStoreError, FileNotFoundError) as err:
            # CommitConflictError here is the copy condition failing (the source was
            # replaced); the lease is checked by _fence, outside.
            _LOG.info("%s: no server-side copy from %s (%s); uploading", key, source_key, err)
            return False
        if not self._still(source_key, identity):
            return False
        remember_written(client, key, etag)
        self._etags[relpath] = etag
        self.copied_bytes += size
        self.files[relpath] = dict(record)
        return True

    def _still(self, source_key: str, etag: str) -> bool:
        """Whether the object ``source_key`` is still version ``etag`` (logged when not)."""
        try:
            now = self.backend.client.head(source_key).etag
        except (ObjectStoreError, FileNotFoundError) as err:
            _LOG.info("%s: not copied (%s); uploading", source_key, err)
            return False
        if now is None or now.strip('"') != etag.strip('"'):
            _LOG.info(
                "%s: replaced since it was written (etag %s, not %s); uploading",
                source_key,
                now,
                etag,
            )
            return False
        return True

    def adopt(self, location: str, relpath: str, record: FileRecord) -> None:
        """Take a file another staging wrote: nothing to move when it wrote to this
        container, a server-side copy otherwise."""
        import obstore

        source = S3Url.parse(location)
        if source != self.url:
            client = self.backend.client
            self._fence(self._key(relpath))
            try:
                obstore.copy(client.store, source.key(relpath), self._key(relpath))
            except Exception as err:
                raise client._fail(err, source.key(relpath)) from err
        self.files[relpath] = dict(record)

    def publish(self) -> None:
        """Nothing to do: the files are in place; the commit record, written next, commits."""

    def discard(self) -> None:
        """Delete the files put so far (best effort is not enough: errors propagate).

        Staged under a root's lease, they are deleted only while that lease is still held:
        once it was lost (or released), the keys may hold the next writer's objects, so they
        are left to its clean-up (a newer index's leftovers go when that index is written).
        """
        keys = [self.url.key(relpath) for relpath in self.files]
        self.files = {}
        if not keys:
            return
        if self.lease is not None:
            try:
                self.lease.check()
            except LeaseLostError as err:
                _LOG.warning("%s: not deleting what this save wrote: %s", self.url, err)
                return
        else:
            self.backend.fence(keys[0])
        self.backend.client.delete(keys)


#: Leases held by this process: (endpoint, bucket, root prefix) -> the lock holding it.
_HELD: dict[tuple[str | None, str, str], S3RootLock] = {}
#: Owner ids of this process's leases that may still be stored although no lock uses them any
#: more (a release or an acquire that failed mid-outage): the next acquire takes them over at
#: once instead of waiting for them to expire.
_ABANDONED: set[str] = set()
_HELD_LOCK = ForkSafeLock()  # free in a forked child


def held_lease(client: S3Client, key: str) -> S3RootLock | None:
    """The lease this process holds on the innermost root containing object ``key`` (None:
    none)."""
    found: tuple[int, S3RootLock] | None = None
    with _HELD_LOCK:
        for (endpoint, bucket, root), lock in _HELD.items():
            if endpoint != client.endpoint or bucket != client.bucket_url.bucket:
                continue
            inside = not root or key == root or key.startswith(root + "/")
            if inside and (found is None or len(root) > found[0]):
                found = (len(root), lock)
    return None if found is None else found[1]


class S3RootLock:
    """A lease on a checkpoint root held as the object ``ROOT/.fastckpt.lock``.

    Acquiring creates the object conditionally (``If-None-Match: *``) with this holder's id
    and an expiry ``ttl_s`` ahead; a thread renews it every ``ttl_s / 3`` (conditionally on
    its own version). A lease that was not renewed before its expiry belongs to a dead or
    stuck holder and is taken over, again conditionally, so two waiters never both win.
    Clocks of the hosts involved must agree to well within ``ttl_s``.

    The lease *fences* its holder (see :class:`S3Backend`): while it is held, every write
    under the root first checks it (:meth:`check`), each commit record is replaced only if it
    is still the version this holder first read under the lease (or last wrote itself), and
    right before such a put the lease is renewed conditionally (:meth:`confirm`). A holder
    that was paused or cut off past its expiry and taken over therefore gets
    :class:`~fastckpt.storage.s3.errors.LeaseLostError` instead of committing or deleting
    anything. What it cannot fence: a holder paused for more than ``ttl_s`` in the moment
    between its last check and the request that follows (milliseconds); S3 has no
    conditional write spanning two objects.

    Raises (``acquire``):
        TimeoutError: ``timeout`` elapsed (names the lock object and its holder).
    """

    def __init__(
        self,
        client: S3Client,
        root: S3Url,
        *,
        timeout: float | None = None,
        ttl_s: float = 30.0,
    ) -> None:
        self.client = client
        self.root = root
        self.key = root.key(LOCK_FILE)
        self.path = Path(client.url(self.key))
        self.timeout = checked_lock_timeout(timeout)
        self.ttl_s = ttl_s
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._etag: str | None = None
        self._expires = 0.0  # wall-clock expiry written into the lease last
        self._lost = False
        self._versions: dict[str, str | None] = {}  # record key -> etag under this lease
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None
        self._state_lock = threading.Lock()
        self._thread: int | None = None  # the thread that acquired the lease

    @property
    def held(self) -> bool:
        """Whether this object holds the lease (as far as it knows: see :meth:`check`)."""
        return self._etag is not None and not self._lost

    @property
    def lost(self) -> bool:
        """Whether the lease was taken over while this object held it (stays True after
        :meth:`release`, until the next :meth:`acquire`)."""
        return self._lost

    def _body(self) -> tuple[bytes, float]:
        expires = time.time() + self.ttl_s
        return json.dumps({"owner": self.owner, "expires": expires}).encode(), expires

    def _registry_key(self) -> tuple[str | None, str, str]:
        return (self.client.endpoint, self.root.bucket, self.root.prefix)

    def acquire(self) -> None:
        """Block until the lease is held (see the class docstring)."""
        if self._etag is not None:
            raise RuntimeError(f"{self.path}: already held by this lock")
        with _HELD_LOCK:
            other = _HELD.get(self._registry_key())
        if other is not None and other.held and other._thread == threading.get_ident():
            # A signal handler saving inside a save on this thread: the held lease would be
            # renewed by its own heartbeat while this waited for it, forever.
            raise reentry_error(str(self.root))
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        holder, left = "unknown", None
        while True:
            body, expires = self._body()
            try:
                self._etag = self._put(body, "create")
                break
            except CommitConflictError:
                pass
            try:
                raw, meta = self.client.get(self.key, limit=1 << 16)
                lease = json.loads(raw)
                holder = str(lease.get("owner"))
                with _HELD_LOCK:
                    ours = holder in _ABANDONED
                recorded = float(lease["expires"])
                if not math.isfinite(recorded):
                    raise ValueError(recorded)  # a lease that would never expire
                left = recorded - time.time()
                if ours or left < 0:
                    body, expires = self._body()
                    self._etag = self._put(body, {"e_tag": meta.etag})
                    with _HELD_LOCK:
                        _ABANDONED.discard(holder)
                    break
            except (ObjectNotFoundError, CommitConflictError):
                continue  # released or taken over meanwhile: try again at once
            except (ValueError, KeyError, TypeError, CheckpointFormatError):
                raise CheckpointFormatError(
                    f"{self.path}: not a fastckpt lease; remove it if no writer is running"
                ) from None
            if deadline is not None and time.monotonic() > deadline:
                expiry = (
                    "" if left is None else f"its lease expires in {left:.1f} s unless renewed; "
                )
                raise TimeoutError(
                    f"{self.path}: held by {holder} for more than {self.timeout} s; {expiry}"
                    "a dead holder's lease expires lease_ttl_s (its own) after its last renewal"
                )
            time.sleep(0.2)
        self._expires = expires
        self._lost = False
        self._versions = {}
        self._thread = threading.get_ident()
        with _HELD_LOCK:
            _HELD[self._registry_key()] = self
        self._stop.clear()
        self._renewer = threading.Thread(target=self._renew, daemon=True, name="s3-lease")
        self._renewer.start()

    def _put(self, body: bytes, mode: str | dict[str, Any]) -> str | None:
        """Write the lease conditionally; an outcome the store did not report (the request
        failed, it may have landed) marks this owner's lease as abandoned."""
        try:
            return self.client.put(self.key, body, mode=mode)
        except CommitConflictError:
            raise
        except ObjectStoreError:
            with _HELD_LOCK:
                _ABANDONED.add(self.owner)
            raise

    def _renew_once(self) -> None:
        """One conditional renewal (caller holds ``_state_lock``).

        Raises:
            LeaseLostError: another writer took the lease over.
        """
        if self._lost or self._etag is None:
            raise self._lost_error()
        body, expires = self._body()
        try:
            self._etag = self.client.put(self.key, body, mode={"e_tag": self._etag})
        except (CommitConflictError, ObjectNotFoundError):
            self._lost = True
            raise self._lost_error() from None
        self._expires = expires

    def _lost_error(self) -> LeaseLostError:
        if not self._lost:
            return LeaseLostError(
                f"{self.client.url(self.root.prefix)}: this writer no longer holds its lease "
                f"{self.path} (released), so it writes and deletes nothing more under the root"
            )
        try:
            raw, _ = self.client.get(self.key, limit=1 << 16)
            holder = str(json.loads(raw).get("owner"))
        except Exception:
            holder = "nobody now"
        late = max(0.0, time.time() - (self._expires - self.ttl_s))
        return LeaseLostError(
            f"{self.client.url(self.root.prefix)}: this writer lost its lease {self.path} "
            f"(held by {holder} now) after {late:.1f} s without renewing it (lease_ttl_s="
            f"{self.ttl_s}); another writer may have saved since, so this one commits and "
            "deletes nothing: load the latest checkpoint and save again (raise lease_ttl_s if "
            "writers pause that long)"
        )

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            with self._state_lock:
                if self._etag is None or self._lost:
                    return
                try:
                    self._renew_once()
                except LeaseLostError:
                    return  # fenced: every later write of this holder is refused
                except Exception:
                    continue  # unreachable for now: the next renewal (or check) tells

    def check(self) -> None:
        """Refuse to go on once the lease is lost: raises at once when a renewal found it
        taken over, and renews it (conditionally) first when its expiry is near or past,
        e.g. after the process was paused. Cheap otherwise (no request).

        Raises:
            LeaseLostError: another writer took it over.
        """
        with self._state_lock:
            if self._lost or self._etag is None:
                raise self._lost_error()
            if time.time() < self._expires - self.ttl_s / 3:
                return
            self._renew_once()

    def confirm(self) -> None:
        """Renew the lease now (conditionally on this holder's version), so that the request
        that follows, a commit, runs with a whole ``ttl_s`` ahead of it.

        Raises:
            LeaseLostError: another writer took it over.
        """
        with self._state_lock:
            self._renew_once()

    def record_version(self, key: str) -> tuple[bool, str | None]:
        """``(known, etag)`` of commit record ``key`` under this lease (``etag`` None: absent)."""
        with self._state_lock:
            return key in self._versions, self._versions.get(key)

    def saw_version(self, key: str, etag: str | None, *, wrote: bool = False) -> None:
        """Remember the version of record ``key`` this holder read (only the first read under
        the lease counts: later reads do not move it) or ``wrote`` (always)."""
        with self._state_lock:
            if wrote or key not in self._versions:
                self._versions[key] = etag

    def release(self) -> None:
        """Stop renewing and remove the lease (if it is still ours). Never raises for an
        unreachable store: the lease is then left (logged), and the next acquire of this
        process takes it over at once (other processes: once it expired)."""
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join()
            self._renewer = None
        with _HELD_LOCK:
            if _HELD.get(self._registry_key()) is self:
                del _HELD[self._registry_key()]
        with self._state_lock:
            etag, self._etag = self._etag, None
            lost = self._lost
        if etag is None or lost:
            return
        try:
            if self.client.head(self.key).etag == etag:
                self.client.delete([self.key])
        except ObjectNotFoundError:
            pass
        except ObjectStoreError as err:
            with _HELD_LOCK:
                _ABANDONED.add(self.owner)
            _LOG.warning(
                "%s: could not remove the lease (%s); this process's next save of the root "
                "takes it over at once, other writers once it expires (%s s)",
                self.client.url(self.key),
                err,
                self.ttl_s,
            )

    def __enter__(self) -> S3RootLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
