"""Incremental saves on object storage: unchanged tensors are copied by the store, not uploaded.

A local incremental save records an unchanged tensor as a reference to the bytes an earlier
index holds (:mod:`fastckpt.container.refs`). On an object store the earlier object's bytes can be
reused without references: the new object is assembled as a multipart upload whose parts are
either uploaded (the header and the tensors that changed) or *copied by the store* from a byte
range of the earlier object (S3's UploadPartCopy). The unchanged bytes never travel to or from
this process, and every object stays a complete safetensors file: loading, verifying,
exporting and pruning see nothing new, and deleting an older index never breaks a newer one.

S3 wants every part but the last to hold at least 5 MiB. :func:`plan_parts` therefore lays
the object out as parts: copied ranges of at least 5 MiB stay copies (split at 5 GiB, S3's
largest part; the object's last part may be shorter); the uploaded runs between them are
topped up to 5 MiB with the first bytes of the next copied range, fetched with a ranged GET
(never read from live tensors, which an async save's training loop may be changing); copied
ranges too short to stand alone are fetched and uploaded. So an object needs a run of about
10 MiB of unchanged bytes (5 MiB after the header's part) before the store copies anything.
A store without UploadPartCopy gets the whole object uploaded, the unchanged bytes fetched
first.

What the store copies is never taken on trust: a copied range comes only from an object whose
bytes are known to be intact, by its version. Every object this process writes has its etag
remembered (:func:`remember_written`); a copy from it, and every fetch that fills a part, is
conditional on that etag (``x-amz-copy-source-if-match`` / ``If-Match``), so an object that
was replaced since (a rewrite with one bit changed, a different file) is never copied. A
source whose etag is not one this process wrote or proved is read back first and each copied
tensor's crc32c compared with its header before anything is copied
(:func:`prove_copied_tensors`); a damaged one fails the save with ``ChecksumMismatchError``
naming the object and the tensor, before anything is committed.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastckpt import _native
from fastckpt.errors import ChecksumMismatchError
from fastckpt.io.forksafe import ForkSafeLock
from fastckpt.storage.s3.client import (
    MAX_PART,
    MIN_PART,
    CopyNotSupportedError,
    CopyPart,
    DataPart,
    S3Client,
    piece_length,
)
from fastckpt.storage.s3.errors import CommitConflictError, ObjectStoreError
from fastckpt.storage.s3.tensors import naming_the_object, tensor_crcs

if TYPE_CHECKING:
    import torch

__all__ = [
    "CopiedTensor",
    "is_known_intact",
    "plan_parts",
    "prove_copied_tensors",
    "put_tensors_copying",
    "remember_written",
]

_PROOF_PIECE = 16 << 20
#: (endpoint, bucket, key) -> etag of an object this process wrote or proved intact.
_INTACT: dict[tuple[str | None, str, str], str] = {}
_INTACT_MAX = 4096
_INTACT_LOCK = ForkSafeLock()  # free in a forked child


def _etag_key(etag: str) -> str:
    return etag.strip().strip('"')


def remember_written(client: S3Client, key: str, etag: str | None) -> None:
    """Remember that version ``etag`` of object ``key`` holds exactly the bytes this process
    wrote there (or read back and checked): later incremental saves may have the store copy
    from it without reading it first. None (a store that gave no etag) forgets the key."""
    where = (client.endpoint, client.bucket_url.bucket, key)
    with _INTACT_LOCK:
        _INTACT.pop(where, None)
        if etag:
            if len(_INTACT) >= _INTACT_MAX:
                del _INTACT[next(iter(_INTACT))]
            _INTACT[where] = _etag_key(etag)


def is_known_intact(client: S3Client, key: str, etag: str | None) -> bool:
    """Whether version ``etag`` of ``key`` is one :func:`remember_written` vouched for."""
    if not etag:
        return False
    with _INTACT_LOCK:
        known = _INTACT.get((client.endpoint, client.bucket_url.bucket, key))
    return known is not None and known == _etag_key(etag)


@dataclass(frozen=True)
class CopiedTensor:
    """A tensor whose bytes are already stored: ``[start, end)`` of object ``source_key``.

    Attributes:
        dtype: its safetensors dtype name.
        shape: its shape as the header gives it.
        crc32c: the checksum of its bytes (from the source object's header).
        etag: the version of the source object those bytes were proven intact in; copies
            and fetches are conditional on it (None: unconditional).
    """

    source_key: str
    start: int
    end: int
    dtype: str
    shape: list[int]
    crc32c: int
    etag: str | None = None


def prove_copied_tensors(client: S3Client, copies: Mapping[str, CopiedTensor]) -> None:
    """Read back the bytes of each copied tensor (from the version its ``etag`` names) and
    check them against its crc32c; remember each source object proven this way.

    Raises:
        ChecksumMismatchError: a tensor's stored bytes differ from its checksum (names the
            object and the tensor), or its object was replaced while being read.
    """
    proven: dict[str, str | None] = {}
    for name, copy in copies.items():
        crc = 0
        for offset in range(copy.start, copy.end, _PROOF_PIECE):
            end = min(copy.end, offset + _PROOF_PIECE)
            try:
                piece = client.get_range(copy.source_key, offset, end, copy.etag)
            except CommitConflictError:
                raise _replaced(client, copy.source_key) from None
            crc = _native.crc32c(piece, crc)
        if crc != copy.crc32c:
            raise ChecksumMismatchError(
                f"{client.url(copy.source_key)}: tensor {name!r} fails its crc32c in the store "
                f"(stored {copy.crc32c:08x}, computed {crc:08x}): the stored bytes are damaged, "
                "so this incremental save cannot copy them; nothing was committed, and the "
                "next save writes every tensor in full (the checkpoints holding this object "
                "fail verification)"
            )
        proven[copy.source_key] = copy.etag
    for key, etag in proven.items():
        remember_written(client, key, etag)


def _replaced(client: S3Client, key: str) -> ChecksumMismatchError:
    return ChecksumMismatchError(
        f"{client.url(key)}: the object was replaced while an incremental save copied from "
        "it; nothing was committed, and the next save writes every tensor in full"
    )


def _range(key: str, start: int, end: int, etag: str | None) -> tuple[Any, ...]:
    """A :class:`DataPart` piece fetching ``[start, end)`` of ``key`` (from version ``etag``)."""
    return (key, start, end) if etag is None else (key, start, end, etag)


Segment = Any  # a byte buffer (uploaded) or a CopyPart (copied)
Piece = Any  # a byte buffer, or (source key, start, end) to fetch


def _cut(pieces: list[Piece], sizes: list[int]) -> list[DataPart]:
    """Split ``pieces`` (in order) into consecutive parts of ``sizes`` bytes."""
    parts: list[DataPart] = []
    queue = list(pieces)
    for size in sizes:
        taken: list[Piece] = []
        while size > 0:
            piece = queue.pop(0)
            n = piece_length(piece)
            if n <= size:
                taken.append(piece)
                size -= n
                continue
            if isinstance(piece, tuple):
                key, start, end, *etag = piece
                taken.append((key, start, start + size, *etag))
                queue.insert(0, (key, start + size, end, *etag))
            else:
                view = memoryview(piece).cast("B")
                taken.append(view[:size])
                queue.insert(0, view[size:])
            size = 0
        parts.append(DataPart(tuple(taken)))
    return parts


def plan_parts(
    segments: Sequence[Segment],
    *,
    data_part: int,
    min_part: int = MIN_PART,
    max_part: int = MAX_PART,
) -> list[DataPart | CopyPart]:
    """Lay an object out as multipart-upload parts (see the module docstring).

    Args:
        segments: the object's content in order: byte buffers to upload and
            :class:`~fastckpt.storage.s3.client.CopyPart` ranges the store copies.
        data_part: the size uploaded runs are cut into (>= ``min_part``).
        min_part: the smallest part but the last.
        max_part: the largest part.

    Returns:
        Parts whose bytes, in order, are exactly the segments'; every part but the last holds
        at least ``min_part`` bytes and none more than ``max_part``.
    """
    merged: list[Segment] = []
    for segment in segments:
        if isinstance(segment, CopyPart):
            last = merged[-1] if merged else None
            if (
                isinstance(last, CopyPart)
                and last.source_key == segment.source_key
                and last.etag == segment.etag
                and last.end == segment.start
            ):
                merged[-1] = CopyPart(last.source_key, last.start, segment.end, last.etag)
            elif segment.nbytes:
                merged.append(segment)
        elif piece_length(segment):
            merged.append(segment)

    parts: list[DataPart | CopyPart] = []
    pending: list[Piece] = []

    def flush() -> None:
        total = sum(piece_length(piece) for piece in pending)
        if total == 0:
            return
        count = max(1, total // data_part, -(-total // max_part))
        bounds = [total * i // count for i in range(count + 1)]
        parts.extend(_cut(pending, [b - a for a, b in itertools.pairwise(bounds)]))
        pending.clear()

    for position, segment in enumerate(merged):
        if not isinstance(segment, CopyPart):
            pending.append(segment)
            continue
        last = position == len(merged) - 1  # the object's last part may be short
        key, start, end, etag = segment.source_key, segment.start, segment.end, segment.etag
        if pending:
            short = min_part - sum(piece_length(piece) for piece in pending)
            if short > 0:
                take = min(short, end - start)
                pending.append(_range(key, start, start + take, etag))
                start += take
        if end - start >= min_part or (last and end > start):
            flush()
            while start < end:
                n = min(max_part, end - start)
                if 0 < end - start - n < min_part:
                    n = end - start - min_part
                parts.append(CopyPart(key, start, start + n, etag))
                start += n
        elif end > start:
            pending.append(_range(key, start, end, etag))
    flush()
    return parts


def put_tensors_copying(
    client: S3Client,
    key: str,
    tensors: Mapping[str, torch.Tensor],
    copies: Mapping[str, CopiedTensor],
    metadata: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Store ``tensors`` and the already stored ``copies`` as one safetensors object at
    ``key``, byte for byte what :func:`fastckpt.storage.s3.tensors.put_tensors` writes for the
    same tensors, with the copied bytes moved by the store.

    Returns:
        ``{"size", "crc32c", "checksums": {name: crc32c}, "copied_bytes", "uploaded_bytes",
        "etag"}`` (the copied and uploaded bytes count tensor and header bytes sent by this
        process or copied by the store; bytes fetched to fill parts count as uploaded).

    Raises:
        ValueError: a name is both uploaded and copied.
        ChecksumMismatchError: a source object was replaced while it was copied from (the
            copies' ``etag`` no longer matches).
        ObjectNotFoundError: a copied object is gone. ObjectStoreError: the upload failed.
    """
    both = set(tensors) & set(copies)
    if both:
        raise ValueError(f"{key}: tensors {sorted(both)} are both uploaded and copied")
    # Deferred: torch, which a process that only copies objects (a promoter) never needs.
    from fastckpt.io.files import byte_view, dtype_name, header_shape, host_tensor

    with naming_the_object(client.url(key)):
        hosts = {name: host_tensor(name, tensor) for name, tensor in tensors.items()}
        descriptions = [
            (name, dtype_name(t.dtype), header_shape(name, t)) for name, t in hosts.items()
        ]
        descriptions += [(name, c.dtype, c.shape) for name, c in copies.items()]
        _, ranges = _native.encode_header(descriptions, dict(metadata or {}), None)
        uploaded = [name for name, _, _ in ranges if name in hosts]
        views = {name: byte_view(hosts[name]) for name in uploaded}
        checksums = dict(zip(uploaded, tensor_crcs([views[n] for n in uploaded]), strict=True))
        checksums.update((name, copy.crc32c) for name, copy in copies.items())
        header = bytes(_native.encode_header(descriptions, dict(metadata or {}), checksums)[0])
    segments: list[Segment] = [header]
    file_crc = _native.crc32c(header)
    size = len(header)
    for name, begin, end in ranges:
        if name in copies:
            copy = copies[name]
            if copy.end - copy.start != end - begin:
                raise ValueError(
                    f"{client.url(copy.source_key)}: tensor {name!r} has {copy.end - copy.start} "
                    f"bytes there, but its dtype and shape need {end - begin}"
                )
            segments.append(CopyPart(copy.source_key, copy.start, copy.end, copy.etag))
        else:
            segments.append(views[name])
        file_crc = _native.crc32c_combine(file_crc, checksums[name], end - begin)
        size += end - begin
    parts = plan_parts(segments, data_part=client.options.part_size)
    copied = sum(part.nbytes for part in parts if isinstance(part, CopyPart))
    etag: str | None = None
    try:
        if copied:
            try:
                etag = client.compose(key, parts)
            except CopyNotSupportedError:
                copied = 0
            else:
                _check_unreplaced(client, copies.values())
        if not copied:
            etag = _upload_all(client, key, parts, size)
    except CommitConflictError:  # a conditional copy or fetch: the source was replaced
        sources = sorted({c.source_key for c in copies.values()})
        raise _replaced(client, sources[0] if len(sources) == 1 else key) from None
    return {
        "size": size,
        "crc32c": file_crc,
        "checksums": checksums,
        "copied_bytes": copied,
        "uploaded_bytes": size - copied,
        "etag": etag,
        "header": header,
    }


def _check_unreplaced(client: S3Client, copies: Iterable[CopiedTensor]) -> None:
    """After the store copied from ``copies``' objects: each is still the version the copy was
    conditional on. A store that ignores the copy condition (moto does) copies a replaced
    object's bytes; the new object's crc32c, made from the copied tensors' recorded checksums,
    would then describe bytes it does not hold.

    Raises:
        ChecksumMismatchError: an object was replaced (or deleted) since.
    """
    for source_key, etag in sorted({(c.source_key, c.etag) for c in copies if c.etag}):
        try:
            now = client.head(source_key).etag
        except (ObjectStoreError, FileNotFoundError):
            now = None
        if now is None or now.strip('"') != etag.strip('"'):
            raise _replaced(client, source_key)


def _upload_all(
    client: S3Client, key: str, parts: list[DataPart | CopyPart], size: int
) -> str | None:
    """Upload the whole object, fetching what the parts would have copied; returns its etag."""

    def pieces() -> Any:
        for part in parts:
            if isinstance(part, CopyPart):
                for offset in range(part.start, part.end, client.options.part_size):
                    end = min(part.end, offset + client.options.part_size)
                    yield client.get_range(part.source_key, offset, end, part.etag)
            else:
                for piece in part.read(client):
                    view = memoryview(piece).cast("B")
                    for offset in range(0, view.nbytes, client.options.part_size):
                        yield view[offset : offset + client.options.part_size]

    return client.put_stream(key, pieces(), size)
