"""The object-store client: one bucket, typed errors, GIL-free transfers.

Data moves through ``obstore`` (the Rust ``object_store`` crate): requests run on Rust threads
with the GIL released, large bodies go up as parallel multipart uploads and come down as
parallel ranged GETs. The two S3 calls ``object_store`` does not expose, listing and aborting
unfinished multipart uploads, go through ``boto3`` (control plane only, a few small requests).
docs/object-storage.md records the measurements behind this choice.

Every method raises :class:`~fastckpt.storage.s3.errors.ObjectStoreError` subclasses naming the
``s3://`` URL involved (see :func:`~fastckpt.storage.s3.errors.translate`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import numpy as np

from fastckpt.errors import CheckpointFormatError
from fastckpt.io.forksafe import ForkSafeLock
from fastckpt.storage.s3.config import ResolvedS3, S3Options, S3Url
from fastckpt.storage.s3.errors import ForkedAfterUseError, ObjectStoreError, translate

__all__ = [
    "MAX_PART",
    "MIN_PART",
    "CopyNotSupportedError",
    "CopyPart",
    "DataPart",
    "ObjectMeta",
    "PendingUpload",
    "S3Client",
    "client_for",
    "piece_length",
]

_CHUNK = 4 << 20
#: Requests moving at most this many bytes go through the store with the read timeout.
_SMALL = 1 << 20
_LOG = logging.getLogger(__name__)
_WARNED_UNLISTED: set[str | None] = set()  # endpoints that cannot list multipart uploads
#: The character obstore writes into a listing's query differently from how SigV4 signs it
#: (``+`` for ``%20``): listings under such a prefix go through boto3.
_QUERY_SIGNED_APART = " "


@dataclass(frozen=True)
class ObjectMeta:
    """One object as listed or probed.

    Attributes:
        key: the full object key.
        size: bytes.
        etag: the store's entity tag (for conditional replacement), when known.
        modified: last modification, seconds since the epoch, when known.
    """

    key: str
    size: int
    etag: str | None = None
    modified: float | None = None


#: S3's smallest multipart part (every part but the last).
MIN_PART = 5 << 20
#: S3's largest part, uploaded or copied.
MAX_PART = 5 << 30


@dataclass(frozen=True)
class CopyPart:
    """Bytes ``[start, end)`` of the object ``source_key`` (same bucket), copied by the store;
    with ``etag``, only from that version of it (``x-amz-copy-source-if-match``: a store
    refuses the copy once the object was replaced)."""

    source_key: str
    start: int
    end: int
    etag: str | None = None

    @property
    def nbytes(self) -> int:
        """Bytes copied."""
        return self.end - self.start


@dataclass(frozen=True)
class DataPart:
    """A part uploaded from this process: buffers, and ranges of other objects fetched first
    (``(source_key, start, end)``, or ``(source_key, start, end, etag)`` to fetch only from
    that version of the object), concatenated in order."""

    pieces: tuple[Any, ...]

    @property
    def nbytes(self) -> int:
        """Bytes uploaded."""
        return sum(piece_length(piece) for piece in self.pieces)

    def read(self, client: S3Client) -> list[Any]:
        """The part's bytes, piece by piece (fetching the ranges)."""
        return [
            client.get_range(*piece) if isinstance(piece, tuple) else piece for piece in self.pieces
        ]


def piece_length(piece: Any) -> int:
    """Bytes of a :class:`DataPart` piece: a buffer, or a ``(key, start, end[, etag])``
    range."""
    if isinstance(piece, tuple):
        return int(piece[2] - piece[1])
    return int(memoryview(piece).nbytes)


class CopyNotSupportedError(ObjectStoreError):
    """The store has no UploadPartCopy (the bytes must be uploaded instead)."""


@dataclass(frozen=True)
class PendingUpload:
    """An unfinished multipart upload (its parts are stored, hidden, and billed)."""

    key: str
    upload_id: str
    initiated: datetime | None


class S3Client:
    """All object-store calls fastckpt makes, for one bucket.

    Args:
        url: any URL in the bucket (only the bucket is used; keys are absolute).
        options: per-call settings (:class:`~fastckpt.storage.s3.config.S3Options` or a mapping);
            unset fields come from the environment and the AWS config files.

    Raises:
        AccessDeniedError: no credentials could be found.
        TypeError / ValueError: bad options (named).
    """

    def __init__(self, url: S3Url, options: S3Options | Mapping[str, Any] | None = None) -> None:
        import obstore.store

        self.bucket_url = S3Url(url.bucket, "")
        self.options = S3Options.from_mapping(options)
        self.resolved: ResolvedS3 = self.options.resolved(str(url))
        self.endpoint = self.resolved.endpoint_url
        opts = self.options
        config: dict[str, Any] = {
            "region": self.resolved.region,
            "unsigned_payload": opts.unsigned_payload,
        }
        if self.endpoint:
            config["endpoint"] = self.endpoint
        credential_provider = None
        if self.resolved.refresh_session is not None:
            credential_provider = _refreshing_provider(self.resolved)
        else:
            config["access_key_id"] = self.resolved.access_key_id
            config["secret_access_key"] = self.resolved.secret_access_key
            if self.resolved.session_token:
                config["session_token"] = self.resolved.session_token
        client_options: dict[str, Any] = {
            "allow_http": self.resolved.allow_http,
            "connect_timeout": timedelta(seconds=opts.connect_timeout_s),
            "timeout": timedelta(seconds=opts.request_timeout_s),
        }
        retry_config: dict[str, Any] = {
            "max_retries": opts.max_retries,
            "retry_timeout": timedelta(seconds=opts.retry_timeout_s),
            "backoff": {
                "init_backoff": timedelta(seconds=0.1),
                "max_backoff": timedelta(seconds=2),
                "base": 2,
            },
        }
        #: Data transfers (parts, large ranges): bounded by ``request_timeout_s`` only, since
        #: the client's read timeout also runs while a request body is being sent.
        self._data_store = obstore.store.S3Store(
            url.bucket,
            config=config,  # type: ignore[arg-type]
            client_options=client_options,  # type: ignore[arg-type]
            retry_config=retry_config,  # type: ignore[arg-type]
            credential_provider=credential_provider,
        )
        #: Everything else (records, the lease, HEADs, listings, deletes, small ranges): a
        #: server that stops answering is given up after ``read_timeout_s``.
        self._control_store = obstore.store.S3Store(
            url.bucket,
            config=config,  # type: ignore[arg-type]
            client_options={
                **client_options,
                "read_timeout": timedelta(seconds=opts.read_timeout_s),
            },  # type: ignore[arg-type]
            retry_config=retry_config,  # type: ignore[arg-type]
            credential_provider=credential_provider,
        )
        self._boto: dict[bool, Any] = {}
        self._boto_lock = threading.Lock()
        #: Ranged GETs of :meth:`read_into` in flight, over every thread that calls it.
        self._gets = threading.BoundedSemaphore(opts.concurrency)
        self._uploads_unlisted = False  # the store answered ListMultipartUploads: NotImplemented

    @property
    def store(self) -> Any:
        """The obstore store for data transfers (parts, large ranges).

        Raises:
            ForkedAfterUseError: see :func:`check_not_forked_after_use`.
        """
        check_not_forked_after_use(self.bucket_url)
        return self._data_store

    @property
    def control_store(self) -> Any:
        """The obstore store for everything else (records, the lease, HEADs, listings)."""
        check_not_forked_after_use(self.bucket_url)
        return self._control_store

    # ------------------------------------------------------------------------------ helpers

    def url(self, key: str) -> str:
        """``s3://bucket/key``."""
        return self.bucket_url.url_of(key)

    def _fail(self, err: BaseException, key: str) -> ObjectStoreError:
        return translate(err, self.url(key), self.endpoint)

    def _control(self, *, transfer: bool = False) -> Any:
        """A boto3 client with the same endpoint, region, credentials and timeouts: its
        socket reads wait at most ``read_timeout_s`` (``request_timeout_s`` for one that
        moves parts, ``transfer``)."""
        with self._boto_lock:
            if transfer not in self._boto:
                import boto3
                import botocore.config

                resolved, opts = self.resolved, self.options
                session = boto3.session.Session(
                    aws_access_key_id=resolved.access_key_id,
                    aws_secret_access_key=resolved.secret_access_key,
                    aws_session_token=resolved.session_token,
                    region_name=resolved.region,
                )
                self._boto[transfer] = session.client(
                    "s3",
                    endpoint_url=self.endpoint,
                    config=botocore.config.Config(
                        connect_timeout=opts.connect_timeout_s,
                        read_timeout=opts.request_timeout_s if transfer else opts.read_timeout_s,
                        retries={"max_attempts": opts.max_retries + 1, "mode": "standard"},
                    ),
                )
            return self._boto[transfer]

    def control_client(self) -> None:
        """Build the boto3 client of the calls obstore lacks (listing and aborting multipart
        uploads) now, not at the first such call."""
        self._control()

    # ------------------------------------------------------------------------------ objects

    def put(self, key: str, data: bytes, *, mode: str | dict[str, Any] = "overwrite") -> str | None:
        """Store a small object in one request.

        Args:
            mode: ``"overwrite"``; ``"create"`` (fails if the key exists: If-None-Match);
                or ``{"e_tag": etag}`` (fails unless the object still has that etag: If-Match).

        Returns:
            The new object's etag.

        Raises:
            CommitConflictError: the condition of ``mode`` failed.
        """
        import obstore

        store = self.control_store if len(data) <= _SMALL else self.store
        try:
            result = obstore.put(store, key, data, mode=mode, use_multipart=False)  # type: ignore[arg-type]
        except Exception as err:
            raise self._fail(err, key) from err
        return result.get("e_tag")

    def put_stream(self, key: str, pieces: Iterable[Any], total: int) -> str | None:
        """Upload ``total`` bytes given as buffers, in parallel parts of ``part_size``.

        At most ``multipart_threshold`` bytes (default: ``part_size``): one PUT, the buffers
        handed over without a Python-side copy. Larger: a multipart upload with
        ``concurrency`` parts in flight on Rust threads; an upload that fails is aborted by
        the client (a killed process leaves it pending: see :meth:`pending_uploads`).

        Returns:
            The new object's etag (when the store gave one).
        """
        import obstore

        opts = self.options
        try:
            if total <= opts.single_put_max:
                result = obstore.put(self.store, key, list(pieces), use_multipart=False)
            else:
                result = obstore.put(
                    self.store,
                    key,
                    iter(pieces),
                    chunk_size=opts.part_size,
                    max_concurrency=opts.concurrency,
                    use_multipart=True,
                )
        except Exception as err:
            raise self._fail(err, key) from err
        return result.get("e_tag")

    def get(self, key: str, *, limit: int) -> tuple[bytes, ObjectMeta]:
        """The whole content of a small object and its metadata.

        Raises:
            ObjectNotFoundError: no such object.
            CheckpointFormatError: larger than ``limit`` bytes (not a record fastckpt wrote).
        """
        import obstore

        try:
            result = obstore.get(self.control_store, key)
            meta = result.meta
            if meta["size"] <= limit:
                data = bytes(result.bytes())
        except Exception as err:
            raise self._fail(err, key) from err
        if meta["size"] > limit:
            raise CheckpointFormatError(
                f"{self.url(key)}: {meta['size']} bytes, more than the {limit} a record may have"
            )
        return data, ObjectMeta(key, meta["size"], meta.get("e_tag"))

    def head(self, key: str) -> ObjectMeta:
        """Size and etag of an object.

        Raises:
            ObjectNotFoundError: no such object.
        """
        import obstore

        try:
            meta = obstore.head(self.control_store, key)
        except Exception as err:
            raise self._fail(err, key) from err
        stamp = meta.get("last_modified")
        modified = stamp.timestamp() if stamp is not None else None
        return ObjectMeta(key, meta["size"], meta.get("e_tag"), modified)

    def get_range(self, key: str, start: int, end: int, if_match: str | None = None) -> bytes:
        """Bytes ``[start, end)`` of an object (fewer at its end); with ``if_match``, only
        from the version of the object with that etag.

        Raises:
            CommitConflictError: ``if_match`` is not the object's etag any more (replaced).
        """
        import obstore

        if end <= start:
            return b""
        store = self.control_store if end - start <= _SMALL else self.store
        try:
            if if_match is None:
                return bytes(obstore.get_range(store, key, start=start, end=end))
            result = obstore.get(store, key, options={"range": (start, end), "if_match": if_match})
            return bytes(result.bytes())
        except Exception as err:
            raise self._fail(err, key) from err

    def read_into(self, key: str, dest: np.ndarray, start: int) -> None:
        """Fill ``dest`` (a contiguous uint8 array) with the object's bytes from ``start``.

        A span of at most ``ranged_get_threshold`` bytes (default: ``read_part_size``) comes
        as one GET; a larger one as parallel ranged GETs of ``read_part_size`` bytes. At most
        ``concurrency`` GETs are in flight at once, over all the threads that call this
        (a reader may fetch many ranges together). Each response streams into its slice of
        ``dest`` in chunks (numpy copies without the GIL), so no whole-range buffer sits in
        between.

        Raises:
            ObjectStoreError: a range failed or came back short (the object changed or is
                truncated).
        """
        import obstore

        total = dest.nbytes
        step = total if total <= self.options.single_get_max else self.options.read_part_size
        spans = [(offset, min(total, offset + step)) for offset in range(0, total, step)]

        def fetch(span: tuple[int, int]) -> None:
            lo, hi = span
            position = lo
            try:
                with self._gets:
                    result = obstore.get(
                        self.store, key, options={"range": (start + lo, start + hi)}
                    )
                    # Streamed in chunks straight into dest: no whole-range buffer in between.
                    for chunk in result.stream(min_chunk_size=_CHUNK):
                        view = np.frombuffer(memoryview(chunk), dtype=np.uint8)
                        if position + view.nbytes > hi:
                            break
                        np.copyto(dest[position : position + view.nbytes], view)
                        position += view.nbytes
            except Exception as err:
                raise self._fail(err, key) from err
            if position != hi:
                raise ObjectStoreError(
                    f"{self.url(key)}: bytes {start + lo}-{start + hi} came back as "
                    f"{position - lo} bytes; the object is not the size its record says"
                )

        if len(spans) <= 1:
            for span in spans:
                fetch(span)
            return
        with ThreadPoolExecutor(min(self.options.concurrency, len(spans))) as pool:
            for _ in pool.map(fetch, spans):
                pass

    def list_objects(self, prefix: str) -> list[ObjectMeta]:
        """Every object under the folder ``prefix`` (every object of the bucket for ``""``)."""
        import obstore

        if _QUERY_SIGNED_APART in prefix:
            return self._list_with_boto(prefix, nested=True)[1]
        found: list[ObjectMeta] = []
        try:
            for chunk in obstore.list(self.control_store, prefix):
                found.extend(ObjectMeta(m["path"], m["size"], m.get("e_tag")) for m in chunk)
        except Exception as err:
            raise self._fail(err, prefix) from err
        return sorted(found, key=lambda m: m.key)

    def has_object(self, key: str) -> bool:
        """Whether an object is stored at exactly ``key``, by one listing (a HEAD of a key
        naming a folder fails on stores that keep folders, such as s3s-fs: HTTP 500). The
        key sorts first among those it prefixes, so one entry tells."""
        try:
            page = self._control().list_objects_v2(
                Bucket=self.bucket_url.bucket, Prefix=key, MaxKeys=1
            )
        except Exception as err:
            raise self._fail(err, key) from err
        return any(item["Key"] == key for item in page.get("Contents", []))

    def list_dir(self, prefix: str) -> tuple[list[str], list[ObjectMeta]]:
        """One level under the folder ``prefix``: ``(sub-folder names, objects)``."""
        import obstore

        if _QUERY_SIGNED_APART in prefix:
            return self._list_with_boto(prefix, nested=False)
        folder = prefix.rstrip("/")
        try:
            result = obstore.list_with_delimiter(self.control_store, folder or None)
        except Exception as err:
            raise self._fail(err, prefix) from err
        names = sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in result["common_prefixes"])
        objects = [ObjectMeta(m["path"], m["size"], m.get("e_tag")) for m in result["objects"]]
        return names, sorted(objects, key=lambda m: m.key)

    def _list_with_boto(self, prefix: str, *, nested: bool) -> tuple[list[str], list[ObjectMeta]]:
        """:meth:`list_objects` (``nested``) or :meth:`list_dir` through boto3, which writes
        a space in the query as ``%20`` as SigV4 signs it; obstore sends ``+``, which S3
        servers that sign the query as sent (moto) refuse with ``SignatureDoesNotMatch``."""
        folder = prefix.strip("/")
        request: dict[str, Any] = {"Bucket": self.bucket_url.bucket}
        request["Prefix"] = folder + "/" if folder else ""
        if not nested:
            request["Delimiter"] = "/"
        names: list[str] = []
        objects: list[ObjectMeta] = []
        try:
            for page in self._control().get_paginator("list_objects_v2").paginate(**request):
                for common in page.get("CommonPrefixes", []):
                    names.append(common["Prefix"].rstrip("/").rsplit("/", 1)[-1])
                for item in page.get("Contents", []):
                    objects.append(ObjectMeta(item["Key"], item["Size"], item.get("ETag")))
        except Exception as err:
            raise self._fail(err, prefix) from err
        return sorted(names), sorted(objects, key=lambda m: m.key)

    def delete(self, keys: Iterable[str]) -> None:
        """Delete objects (absent ones are fine)."""
        import obstore

        batch = list(keys)
        for start in range(0, len(batch), 1000):
            chunk = batch[start : start + 1000]
            try:
                obstore.delete(self.control_store, chunk)
            except Exception as err:
                failed = translate(err, self.url(chunk[0]), self.endpoint)
                if not isinstance(failed, FileNotFoundError):
                    raise failed from err

    # ------------------------------------------------------------------- multipart uploads

    def compose(self, key: str, parts: Sequence[DataPart | CopyPart]) -> str | None:
        """Create ``key`` as one multipart upload whose parts are either uploaded bytes
        (:class:`DataPart`) or ranges of other objects of the bucket that the store copies
        itself (:class:`CopyPart`, S3's UploadPartCopy: the bytes never reach this client;
        a part's ``etag`` makes the copy conditional on that version of the source).
        Every part but the last must hold at least :data:`MIN_PART` bytes. Parts go up
        ``concurrency`` at a time; on any failure the upload is aborted.

        Returns:
            The new object's etag (when the store gave one).

        Raises:
            ObjectNotFoundError: a copied object is gone.
            ObjectStoreError: any other failure (``NotImplemented`` when the store has no
                UploadPartCopy: the caller uploads the bytes instead).
        """
        client = self._control(transfer=True)
        bucket = self.bucket_url.bucket
        try:
            upload_id = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
        except Exception as err:
            raise self._fail(err, key) from err

        def send(number: int, part: DataPart | CopyPart) -> dict[str, Any]:
            common = {"Bucket": bucket, "Key": key, "UploadId": upload_id, "PartNumber": number}
            if isinstance(part, CopyPart):
                condition = {} if part.etag is None else {"CopySourceIfMatch": part.etag}
                try:
                    reply = client.upload_part_copy(
                        CopySource={"Bucket": bucket, "Key": part.source_key},
                        CopySourceRange=f"bytes={part.start}-{part.end - 1}",
                        **condition,
                        **common,
                    )
                except Exception as err:
                    if _error_code(err) == "NotImplemented":
                        raise CopyNotSupportedError(
                            f"{self.url(key)}: the store at {self.endpoint or 'AWS'} cannot "
                            "copy object ranges (UploadPartCopy is not implemented)"
                        ) from err
                    raise self._fail(err, part.source_key) from err
                return {"PartNumber": number, "ETag": reply["CopyPartResult"]["ETag"]}
            body = b"".join(part.read(self))
            try:
                reply = client.upload_part(Body=body, **common)
            except Exception as err:
                raise self._fail(err, key) from err
            return {"PartNumber": number, "ETag": reply["ETag"]}

        try:
            with ThreadPoolExecutor(max(1, min(self.options.concurrency, len(parts)))) as pool:
                done = list(pool.map(send, range(1, len(parts) + 1), parts))
            reply = client.complete_multipart_upload(
                Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": done}
            )
        except BaseException as err:
            with contextlib.suppress(Exception):
                client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id)
            if isinstance(err, Exception) and not isinstance(err, ObjectStoreError):
                raise self._fail(err, key) from err
            raise
        etag = reply.get("ETag")
        return etag if isinstance(etag, str) else None

    def pending_uploads(self, prefix: str) -> list[PendingUpload]:
        """Unfinished multipart uploads under ``prefix`` (a killed writer leaves these).

        A store that does not implement ListMultipartUploads (some S3-compatible servers,
        e.g. ``s3s-fs``) answers ``NotImplemented``: then none can be found, the list is empty
        and a warning (once per endpoint) says to let a bucket lifecycle rule abort them.
        """
        if self._uploads_unlisted:
            return []
        client = self._control()
        pending: list[PendingUpload] = []
        marker: dict[str, str] = {}
        try:
            while True:
                page = client.list_multipart_uploads(
                    Bucket=self.bucket_url.bucket, Prefix=prefix, **marker
                )
                pending.extend(
                    PendingUpload(u["Key"], u["UploadId"], u.get("Initiated"))
                    for u in page.get("Uploads", [])
                )
                if not page.get("IsTruncated"):
                    return pending
                marker = {
                    "KeyMarker": page["NextKeyMarker"],
                    "UploadIdMarker": page["NextUploadIdMarker"],
                }
        except Exception as err:
            if _error_code(err) == "NotImplemented":
                self._uploads_unlisted = True
                if self.endpoint in _WARNED_UNLISTED:
                    return []
                _WARNED_UNLISTED.add(self.endpoint)
                _LOG.warning(
                    "%s: the store at %s cannot list unfinished multipart uploads "
                    "(ListMultipartUploads is not implemented); uploads a killed save left "
                    "there are not aborted by fastckpt: add a lifecycle rule that aborts "
                    "incomplete multipart uploads",
                    self.url(prefix),
                    self.endpoint or "AWS",
                )
                return []
            raise self._fail(err, prefix) from err

    def abort_upload(self, upload: PendingUpload) -> None:
        """Abort an unfinished multipart upload (its stored parts are freed)."""
        try:
            self._control().abort_multipart_upload(
                Bucket=self.bucket_url.bucket, Key=upload.key, UploadId=upload.upload_id
            )
        except Exception as err:
            failed = translate(err, self.url(upload.key), self.endpoint)
            if not isinstance(failed, FileNotFoundError):
                raise failed from err


def _error_code(err: BaseException) -> str | None:
    """The S3 error code of a botocore ``ClientError`` (None for anything else)."""
    response = getattr(err, "response", None)
    if not isinstance(response, dict):
        return None
    code = response.get("Error", {}).get("Code")
    return code if isinstance(code, str) else None


def _refreshing_provider(resolved: ResolvedS3) -> Any:
    """An obstore credential provider that refreshes temporary credentials through boto3."""
    import boto3
    from obstore.auth.boto3 import Boto3CredentialProvider

    session = boto3.session.Session(botocore_session=resolved.refresh_session)
    return Boto3CredentialProvider(session)


_CLIENTS: dict[tuple[Any, ...], S3Client] = {}
_CLIENTS_LOCK = ForkSafeLock()  # free in a forked child


#: The process that made this process's first object-store request (obstore starts its
#: runtime, one per process, then); None before any. A forked child inherits the value.
_REQUESTS_PID: int | None = None


def check_not_forked_after_use(bucket: S3Url) -> None:
    """Note that this process makes object-store requests; refuse in a process forked from
    one that had made some: obstore's runtime started in the parent and its threads do not
    survive a fork, so the child's requests would hang forever (as any tokio-based client's).

    Raises:
        ForkedAfterUseError: naming ``bucket`` and the fix.
    """
    global _REQUESTS_PID
    pid = os.getpid()
    if _REQUESTS_PID is None:
        _REQUESTS_PID = pid
    elif pid != _REQUESTS_PID:
        raise ForkedAfterUseError(
            f"{bucket.url_of('')}: this process ({pid}) was forked from process "
            f"{_REQUESTS_PID} after that one used object storage; the object-store "
            "client's threads do not survive a fork, so requests from here would never "
            "finish. Start processes that use s3:// with the 'spawn' or 'forkserver' method "
            "(multiprocessing, torch.multiprocessing), or fork before the first object-store "
            "request"
        )


def client_for(url: S3Url, options: S3Options | Mapping[str, Any] | None = None) -> S3Client:
    """A shared :class:`S3Client` for ``url``'s bucket and these options.

    Connections and credentials are reused across calls with the same bucket, options and
    ``AWS_*`` environment; a forked child builds its own (a client is not fork-safe), and
    one forked after this process made requests cannot make any
    (:func:`check_not_forked_after_use`).
    """
    opts = S3Options.from_mapping(options)
    environment = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_")))
    cache_key = (os.getpid(), url.bucket, opts, environment)
    with _CLIENTS_LOCK:
        client = _CLIENTS.get(cache_key)
        if client is None:
            client = _CLIENTS[cache_key] = S3Client(url, opts)
        return client


def iter_pieces(view: np.ndarray, piece: int) -> Iterator[np.ndarray]:
    """Consecutive slices of at most ``piece`` bytes of a uint8 array (none when empty)."""
    for start in range(0, view.nbytes, piece):
        yield view[start : start + piece]
