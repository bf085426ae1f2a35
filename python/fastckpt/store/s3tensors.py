"""Safetensors files as objects: upload with per-tensor crc32c, verified parallel download.

An object written here is a safetensors file laid out as :func:`fastckpt.save_file` lays
out the same tensors (same order and offsets, the crc32c of every tensor under the
``fastckpt.crc32c`` metadata key), so it opens with ``safetensors`` and, once downloaded, with
:func:`fastckpt.load_file`. It carries no header checksum (``fastckpt.header_crc32c``): the
extension does not export its header encoder, and the commit record's whole-object crc32c
covers the header instead.

Upload: the checksums live in the header at the front of the object, and a multipart stream
sends the front first, so the tensors are hashed (Rust, GIL released, in parallel pieces)
just before their bytes stream out; the header is built, then header and tensor memory go up
as zero-copy buffers in parallel parts on Rust threads.

Download: the object is fetched by parallel ranged GETs straight into one buffer, then the
Rust verifier checks the header and every tensor's crc32c on several threads (the same code
that verifies local files) and reports the whole-object crc32c, which is compared with the
commit record's. Tensors are views of that buffer: no further copy.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

import numpy as np
import torch

from fastckpt import _native
from fastckpt.errors import CheckpointFormatError, ChecksumMismatchError
from fastckpt.files import byte_view, dtype_from_name, dtype_name, host_tensor
from fastckpt.store.s3client import S3Client, iter_pieces

__all__ = [
    "CHECKSUM_KEY",
    "crc32c_combine",
    "crc32c_of",
    "encode_header",
    "get_tensors",
    "put_tensors",
]

#: Metadata key of the per-tensor checksums (the Rust core's ``format::CHECKSUM_KEY``).
CHECKSUM_KEY = "fastckpt.crc32c"
_HASH_PIECE = 16 << 20
_HASH_THREADS = 4

# ------------------------------------------------------------------------------- crc32c math

_POLY = 0x82F63B78  # crc32c, reflected


def _multmodp(a: int, b: int) -> int:
    """``a * b`` modulo the crc32c polynomial (reflected bit order)."""
    m, product = 1 << 31, 0
    while True:
        if a & m:
            product ^= b
            if not a & (m - 1):
                return product
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _x2n_table() -> list[int]:
    table, p = [], 1 << 30  # x^1
    # 64 entries, no wrap-around: crc32c's polynomial is not primitive, so x^(2^32) != x.
    for _ in range(64):
        table.append(p)
        p = _multmodp(p, p)
    return table


_X2N = _x2n_table()
_NATIVE_COMBINE = hasattr(_native, "crc32c_combine")


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """The crc32c of ``A + B`` from ``crc32c(A)``, ``crc32c(B)`` and ``len(B)``."""
    if _NATIVE_COMBINE:
        return int(_native.crc32c_combine(crc1, crc2, len2))
    p, k, n = 1 << 31, 3, len2  # x^0; each byte is 8 = 2^3 bits
    while n:
        if n & 1:
            p = _multmodp(_X2N[k], p)
        n >>= 1
        k += 1
    return _multmodp(p, crc1) ^ crc2


def _native_takes_buffers() -> bool:
    try:
        _native.crc32c(cast(bytes, memoryview(b"x")))
    except TypeError:
        return False
    return True


_ZERO_COPY_CRC = _native_takes_buffers()


def crc32c_of(view: np.ndarray | memoryview | bytes, value: int = 0) -> int:
    """crc32c of a buffer in the Rust core (GIL released).

    The extension's ``crc32c`` takes ``bytes`` in this build: other buffers are copied first
    (a build that accepts any buffer is used without the copy).
    """
    if isinstance(view, bytes) or _ZERO_COPY_CRC:
        return _native.crc32c(cast(bytes, view), value)
    return _native.crc32c(bytes(view), value)


def _pieces_crc(views: list[np.ndarray]) -> list[int]:
    """crc32c of each tensor, hashed as pieces in parallel and combined in order."""
    jobs: list[tuple[int, np.ndarray]] = []
    for index, view in enumerate(views):
        jobs.extend((index, piece) for piece in iter_pieces(view, _HASH_PIECE))
    with ThreadPoolExecutor(_HASH_THREADS) as pool:
        crcs = list(pool.map(lambda job: crc32c_of(job[1]), jobs))
    result = [0] * len(views)
    for (index, piece), crc in zip(jobs, crcs, strict=True):
        result[index] = crc32c_combine(result[index], crc, piece.nbytes)
    return result


# ---------------------------------------------------------------------------------- header


_NATIVE_HEADER = hasattr(_native, "encode_header")


def _descriptions(layout: list[tuple[str, torch.Tensor]]) -> list[tuple[str, str, list[int]]]:
    return [(name, dtype_name(t.dtype), list(t.shape)) for name, t in layout]


def _layout(tensors: Mapping[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """The tensors in the order the Rust writer lays them out (larger element size first,
    then by name, which keeps every tensor aligned), as dense CPU tensors."""
    hosts = []
    for name, tensor in tensors.items():
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be str, got {name!r}")
        if name == "__metadata__":
            raise ValueError("tensor name '__metadata__' is reserved by safetensors; rename it")
        hosts.append((name, host_tensor(name, tensor)))
    if _NATIVE_HEADER:
        by_name = dict(hosts)
        _, ranges = _native.encode_header(_descriptions(hosts), {}, None)
        return [(name, by_name[name]) for name, _, _ in ranges]
    hosts.sort(key=lambda item: (-item[1].element_size(), item[0]))
    return hosts


def encode_header(
    layout: list[tuple[str, torch.Tensor]],
    metadata: Mapping[str, str] | None,
    crcs: list[int] | None,
) -> bytes:
    """The safetensors prefix + JSON header (space-padded to 8 bytes) for ``layout``.

    Uses the Rust core's encoder when the extension exports it (then the object is byte for
    byte what ``save_file`` writes, header checksum included); otherwise an equivalent
    header without the header checksum.
    """
    if _NATIVE_HEADER:
        checksums = None
        if crcs is not None:
            checksums = {name: crc for (name, _), crc in zip(layout, crcs, strict=True)}
        encoded, ranges = _native.encode_header(
            _descriptions(layout), dict(metadata or {}), checksums
        )
        if [name for name, _, _ in ranges] != [name for name, _ in layout]:
            raise AssertionError("the Rust core laid the tensors out in another order")
        return bytes(encoded)
    meta = dict(metadata or {})
    if CHECKSUM_KEY in meta:
        raise ValueError(f"metadata key {CHECKSUM_KEY!r} is reserved for checksums; rename it")
    for key, value in meta.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(f"metadata must map str to str; got {key!r}: {type(value).__name__}")
    if crcs is not None:
        table = {name: f"{crc:08x}" for (name, _), crc in zip(layout, crcs, strict=True)}
        meta[CHECKSUM_KEY] = json.dumps(table, separators=(",", ":"))
    header: dict[str, Any] = {"__metadata__": meta}
    offset = 0
    for name, tensor in layout:
        end = offset + tensor.nbytes
        header[name] = {
            "dtype": dtype_name(tensor.dtype),
            "shape": list(tensor.shape),
            "data_offsets": [offset, end],
        }
        offset = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


# ---------------------------------------------------------------------------------- upload


def put_tensors(
    client: S3Client,
    key: str,
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Upload ``tensors`` as one safetensors object at ``key``.

    Returns:
        ``{"size": bytes, "crc32c": whole-object crc32c, "checksums": {name: crc32c}}``.

    Raises:
        TypeError / ValueError: bad tensors or metadata (named).
        ObjectStoreError: the upload failed (typed, naming the URL).
    """
    layout = _layout(tensors)
    views = [byte_view(tensor) for _, tensor in layout]
    crcs = _pieces_crc(views)
    header = encode_header(layout, metadata, crcs)
    file_crc = crc32c_of(header)
    for view, crc in zip(views, crcs, strict=True):
        file_crc = crc32c_combine(file_crc, crc, view.nbytes)
    size = len(header) + sum(view.nbytes for view in views)

    def pieces() -> Any:
        yield header
        for view in views:
            # Bounded pieces keep the client's buffering per part small.
            yield from iter_pieces(view, client.options.part_size)

    client.put_stream(key, pieces(), size)
    return {
        "size": size,
        "crc32c": file_crc,
        "checksums": {name: crc for (name, _), crc in zip(layout, crcs, strict=True)},
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
