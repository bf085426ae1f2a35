"""Safetensors files as objects: upload with per-tensor crc32c, verified parallel download.

An object written here is byte for byte the file :func:`fastckpt.save_file` writes for the
same tensors: the header comes from the Rust core's own encoder (``_native.encode_header``:
same layout, per-tensor crc32c table and header checksum), so it opens with ``safetensors`` and,
once downloaded, with :func:`fastckpt.load_file`.

Upload: the checksums live in the header at the front of the object, and a multipart stream
sends the front first, so the tensors are hashed (Rust, GIL released, zero-copy, in parallel
pieces) just before their bytes stream out; then header and tensor memory go up as zero-copy
buffers in parallel parts on Rust threads.

Download: the object is fetched by parallel ranged GETs straight into one buffer, then the
Rust verifier checks the header and every tensor's crc32c on several threads (the same code
that verifies local files) and reports the whole-object crc32c, which is compared with the
commit record's. Tensors are views of that buffer: no further copy.

torch is imported by the functions that make or take tensors, not with the module: a process
that only copies objects (a detached promoter) starts without it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from fastckpt import _native
from fastckpt.errors import CheckpointFormatError, ChecksumMismatchError, InvalidInputError
from fastckpt.storage.s3.client import S3Client, iter_pieces

if TYPE_CHECKING:
    import torch

__all__ = ["encode_header", "get_tensors", "put_tensors", "tensor_crcs"]

_HASH_PIECE = 16 << 20
_HASH_THREADS = 4


def tensor_crcs(views: list[np.ndarray]) -> list[int]:
    """crc32c of each uint8 view, hashed as 16 MiB pieces on 4 threads (GIL released, no
    copy) and combined in order."""
    jobs: list[tuple[int, np.ndarray]] = []
    for index, view in enumerate(views):
        jobs.extend((index, piece) for piece in iter_pieces(view, _HASH_PIECE))
    with ThreadPoolExecutor(_HASH_THREADS) as pool:
        crcs = list(pool.map(lambda job: _native.crc32c(job[1]), jobs))
    result = [0] * len(views)
    for (index, piece), crc in zip(jobs, crcs, strict=True):
        result[index] = _native.crc32c_combine(result[index], crc, piece.nbytes)
    return result


# ---------------------------------------------------------------------------------- header


def _descriptions(layout: list[tuple[str, torch.Tensor]]) -> list[tuple[str, str, list[int]]]:
    from fastckpt.io.files import dtype_name  # deferred: torch (see the module docstring)

    return [(name, dtype_name(t.dtype), list(t.shape)) for name, t in layout]


def _layout(tensors: Mapping[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """The tensors as dense CPU tensors, in the order the Rust writer lays them out."""
    from fastckpt.io.files import host_tensor  # deferred: torch (see the module docstring)

    hosts = []
    for name, tensor in tensors.items():
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be str, got {name!r}")
        hosts.append((name, host_tensor(name, tensor)))
    by_name = dict(hosts)
    _, ranges = _native.encode_header(_descriptions(hosts), {}, None)
    return [(name, by_name[name]) for name, _, _ in ranges]


def encode_header(
    layout: list[tuple[str, torch.Tensor]],
    metadata: Mapping[str, str] | None,
    crcs: list[int] | None,
) -> bytes:
    """The header (prefix + padded JSON) ``save_file`` writes for ``layout`` (Rust core).

    Raises:
        TypeError / ValueError: bad metadata or names (the core's messages).
    """
    checksums = None
    if crcs is not None:
        checksums = {name: crc for (name, _), crc in zip(layout, crcs, strict=True)}
    encoded, ranges = _native.encode_header(_descriptions(layout), dict(metadata or {}), checksums)
    if [name for name, _, _ in ranges] != [name for name, _ in layout]:
        raise AssertionError("the Rust core laid the tensors out in another order")
    return bytes(encoded)


@contextlib.contextmanager
def naming_the_object(url: str) -> Iterator[None]:
    """The Rust core's refusal of a header (over the size limit, bad metadata) raised as the
    same error naming the object ``url`` it was for."""
    try:
        yield
    except InvalidInputError as err:
        raise InvalidInputError(f"{url}: {err}") from None


# ---------------------------------------------------------------------------------- upload


def put_tensors(
    client: S3Client,
    key: str,
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Upload ``tensors`` as one safetensors object at ``key``.

    Returns:
        ``{"size": bytes, "crc32c": whole-object crc32c, "checksums": {name: crc32c},
        "etag": the new object's etag (None when the store gave none), "header": the
        object's safetensors header bytes (length word included)}``.

    Raises:
        TypeError / ValueError: bad tensors or metadata (named).
        ObjectStoreError: the upload failed (typed, naming the URL).
    """
    from fastckpt.io.files import byte_view  # deferred: torch (see the module docstring)

    with naming_the_object(client.url(key)):
        layout = _layout(tensors)
        views = [byte_view(tensor) for _, tensor in layout]
        crcs = tensor_crcs(views)
        header = encode_header(layout, metadata, crcs)
    file_crc = _native.crc32c(header)
    for view, crc in zip(views, crcs, strict=True):
        file_crc = _native.crc32c_combine(file_crc, crc, view.nbytes)
    size = len(header) + sum(view.nbytes for view in views)

    def pieces() -> Any:
        yield header
        for view in views:
            # Bounded pieces keep the client's buffering per part small.
            yield from iter_pieces(view, client.options.part_size)

    etag = client.put_stream(key, pieces(), size)
    return {
        "size": size,
        "crc32c": file_crc,
        "checksums": {name: crc for (name, _), crc in zip(layout, crcs, strict=True)},
        "etag": etag,
        "header": bytes(header),
    }


# -------------------------------------------------------------------------------- download


def get_tensors(
    client: S3Client,
    key: str,
    *,
    size: int | None = None,
    crc32c: int | None = None,
    verify: bool = True,
    threads: int = 4,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Download and verify a safetensors object.

    Args:
        size: the size the commit record gives (checked; None: asked from the store).
        crc32c: the whole-object crc32c the commit record gives (checked when ``verify``).
        verify: check every tensor's crc32c and the object's.
        threads: verifier threads.

    Returns:
        ``(name -> CPU tensor, {"metadata": ..., "file_crc32c": ...})``; tensors are views of
        one buffer holding the object.

    Raises:
        ObjectNotFoundError: no such object. ObjectStoreError: transfer failures.
        CheckpointFormatError: malformed header, or a size that disagrees with the record.
        ChecksumMismatchError: corrupt bytes (names the URL and the tensor).
    """
    import torch  # deferred: see the module docstring

    from fastckpt.io.files import byte_view, dtype_from_name

    url = client.url(key)
    actual = client.head(key).size
    if size is not None and actual != size:
        raise CheckpointFormatError(
            f"{url}: {actual} bytes, but the commit record says {size}; the object was "
            "replaced or truncated: load an older checkpoint"
        )
    buffer = torch.empty(actual, dtype=torch.uint8)
    flat = byte_view(buffer)
    client.read_into(key, flat, 0)
    header = _native.check_mapped(url, flat, verify, threads)
    if verify and crc32c is not None and header["file_crc32c"] != crc32c:
        raise ChecksumMismatchError(
            f"{url}: crc32c {header['file_crc32c']:08x} differs from the commit record's "
            f"{crc32c:08x}; the object was changed after it was committed: load an older "
            "checkpoint"
        )
    start = header["data_start"]
    storage = buffer.untyped_storage()
    result: dict[str, torch.Tensor] = {}
    for entry in header["tensors"]:
        dtype = dtype_from_name(entry["dtype"])
        begin, end = entry["data_offsets"]
        data = torch.empty(0, dtype=torch.uint8).set_(storage[start + begin : start + end])
        if (start + begin) % dtype.itemsize:
            data = data.clone()
        result[entry["name"]] = data.view(dtype).reshape(entry["shape"])
    return result, {"metadata": header["metadata"], "file_crc32c": header["file_crc32c"]}
