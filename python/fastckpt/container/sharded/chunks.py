"""Verified reads of stored chunks: only the byte ranges asked for, each checked by crc32c.

A saved chunk is one safetensors entry. Its crc32c covers all of it, so a rank that needs only
some rows of it (resharding) could not check what it read. Chunks larger than a *verification
block* therefore also carry one crc32c per block (:func:`block_checksums`, computed by the
writer): a reader fetches the rows it needs, rounded out to whole blocks, and checks each
block. Smaller chunks are one block, checked against the entry's own crc32c.

A load asks for many such ranges at once (:class:`Want`, one per item of its plan):
:meth:`ChunkFiles.read_spans` reads the coalesced spans that cover them
(:mod:`fastckpt.container.sharded.ranges`), an object store's requests all in flight together,
and :meth:`ChunkFiles.check` verifies every piece of them there.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fastckpt import _native
from fastckpt.container.sharded.ranges import Range, Span
from fastckpt.errors import CheckpointFormatError, ChecksumMismatchError
from fastckpt.format.sharded import StoredChunk
from fastckpt.io.files import byte_view, dtype_from_name, empty_tensor
from fastckpt.io.paths import check_relpath, safe_join
from fastckpt.storage.registry import backend_for, display_path, is_local

__all__ = [
    "DEFAULT_BLOCK_BYTES",
    "OBJECT_STORE_GAP",
    "ChunkFiles",
    "Want",
    "block_checksums",
    "box_view",
    "crc32c_of",
]

#: Chunks above this size get one crc32c per block of this size, so that partial reads are
#: verified while reading at most one block more than needed at each end of a range.
DEFAULT_BLOCK_BYTES = 4 << 20
_PIECE = 8 << 20
#: On an object store, ranges of one object at most this far apart are read by one request
#: (the bytes in between too). A separate request costs about a first-byte latency (20-50 ms
#: on S3), in which one connection moves 2-5 MB at 100 MB/s; and a partial read already
#: fetches up to a verification block (:data:`DEFAULT_BLOCK_BYTES`) more than it needs at each
#: end, so a gap of one block costs no more than the rounding does. On a local disk only
#: ranges that touch or overlap are merged. (Measured on moto, 256 MiB loaded onto 3 ranks:
#: 5.8 s with 256 KiB, 3.9 s with 1 MiB, 3.1 s with 4 MiB.)
OBJECT_STORE_GAP = DEFAULT_BLOCK_BYTES
#: Spans of an object store fetched at once (each one's GETs are bounded by the client).
_FETCHERS = 16

#: A verification piece of a chunk: bytes ``[begin, end)`` of it and their crc32c.
Piece = tuple[int, int, int]


@dataclass(frozen=True)
class Want:
    """Bytes ``[begin, end)`` of a stored chunk that a load needs, rounded out to whole
    verification pieces (``pieces``, in order, covering exactly ``[begin, end)``)."""

    chunk: StoredChunk
    begin: int
    end: int
    pieces: tuple[Piece, ...]

    @property
    def range(self) -> Range:
        """The bytes of the data file this want covers."""
        return Range(self.chunk.file, self.chunk.offset + self.begin, self.chunk.offset + self.end)


def _accepts_buffers() -> bool:
    try:
        _native.crc32c(memoryview(b"x"))
    except TypeError:
        return False
    return True


_BUFFERS = _accepts_buffers()


def crc32c_of(data: np.ndarray) -> int:
    """crc32c of a contiguous uint8 array (hashed by the Rust core without the GIL)."""
    if _BUFFERS:
        return _native.crc32c(data)
    crc = 0
    for start in range(0, data.size, _PIECE):
        crc = _native.crc32c(data[start : start + _PIECE].tobytes(), crc)
    return crc


def block_checksums(data: np.ndarray, block_bytes: int) -> tuple[int, ...]:
    """crc32c of each ``block_bytes`` piece of ``data`` (the last one may be short)."""
    return tuple(
        crc32c_of(data[start : start + block_bytes]) for start in range(0, data.size, block_bytes)
    )


class ChunkFiles:
    """Open data files of one generation directory and read verified ranges from them.

    Files are opened as the other readers of fastckpt open them: the path must stay inside the
    checkpoint directory once every symlink is resolved (:func:`~fastckpt.io.paths.safe_join`:
    a rank file or a generation directory linked out of it is refused), and the file must be a
    regular file, checked on the open descriptor without blocking (a FIFO or a device in its
    place is a :class:`~fastckpt.CheckpointFormatError` at once, not a read that never ends).

    Args:
        directory: the generation directory.
        verify: check crc32c of everything read (on by default).
        within: the checkpoint directory the files must stay in (default: ``directory``'s
            parent, the checkpoint directory of a generation).

    Attributes:
        bytes_read: bytes read from the files so far, the gaps inside coalesced spans
            included (for tests and benchmarks).
    """

    def __init__(self, directory: Path, *, verify: bool = True, within: Path | None = None) -> None:
        """Remember the directory; files are opened on first use."""
        self.directory = directory
        self.within = directory.parent if within is None else within
        self.verify = verify
        self.bytes_read = 0
        self._fds: dict[str, int] = {}
        self._buffer = np.empty(0, dtype=np.uint8)
        self._backend = backend_for(directory)
        #: the files are on a local disk (not an object store)
        self.local = is_local(self._backend)
        #: on an object store: the files whose size was checked against the record
        self._objects: set[str] = set()
        #: ranges of files this node does not hold, received from other ranks
        #: (:meth:`receive`): file -> [(start, bytes, the rank that sent them)]
        self._received: dict[str, list[tuple[int, np.ndarray, int]]] = {}

    def close(self) -> None:
        """Close every open file."""
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> ChunkFiles:
        """Use as a context manager that closes the files."""
        return self

    def __exit__(self, *exc: object) -> None:
        """Close the files."""
        self.close()

    def _fd(self, chunk: StoredChunk) -> int:
        fd = self._fds.get(chunk.file)
        if fd is None:
            relpath = f"{self.directory.name}/{chunk.file}"
            path = safe_join(self.directory.parent, relpath, within=self.within, what="data file")
            try:
                fd = _native.open_regular(str(path), True)
            except IsADirectoryError:
                raise CheckpointFormatError(f"{path}: is a directory, not a data file") from None
            size = os.fstat(fd).st_size
            if size != chunk.file_len:
                os.close(fd)
                raise CheckpointFormatError(
                    f"{path}: size {size} differs from the {chunk.file_len} bytes the commit "
                    "record lists; the file was truncated or replaced"
                )
            self._fds[chunk.file] = fd
        return fd

    def _object_path(self, chunk: StoredChunk) -> Path:
        """An object-store data file, its size checked against the record (once)."""
        path = self.directory / check_relpath(chunk.file, "data file")
        if chunk.file not in self._objects:
            info = self._backend.stat(path)
            if not info.regular or info.size != chunk.file_len:
                raise CheckpointFormatError(
                    f"{display_path(path)}: size {info.size} differs from the "
                    f"{chunk.file_len} bytes the commit record lists; the object was "
                    "truncated or replaced"
                )
            self._objects.add(chunk.file)
        return path

    def receive(self, file: str, start: int, data: np.ndarray, sender: int) -> None:
        """Serve bytes ``[start, start + len(data))`` of ``file`` (a file this node does not
        hold) from ``data``, received from rank ``sender``
        (:mod:`fastckpt.dcp.peers`); they are verified as they are read, like the disk's."""
        self._received.setdefault(file, []).append((start, data, sender))

    def received(self, where: Range) -> bool:
        """Whether the bytes of ``where`` were received (:meth:`receive`)."""
        return self._span_of(where.file, where.start, where.stop) is not None

    def _span_of(self, file: str, start: int, stop: int) -> tuple[int, np.ndarray, int] | None:
        for span in self._received.get(file, ()):
            if span[0] <= start and stop <= span[0] + span[1].size:
                return span
        return None

    def read_raw(self, chunk: StoredChunk, start: int, stop: int) -> np.ndarray:
        """Bytes ``[start, stop)`` of the local data file of ``chunk``, unverified (for a rank
        that holds them to send; the receiver verifies)."""
        out = np.empty(stop - start, dtype=np.uint8)
        self._pread(chunk, start, out)
        return out

    def _pread(self, chunk: StoredChunk, offset: int, out: np.ndarray) -> None:
        """Fill ``out`` from the local data file of ``chunk``, from the absolute ``offset``
        (or from the bytes received of it)."""
        if chunk.file in self._received:
            span = self._span_of(chunk.file, offset, offset + out.size)
            if span is None:
                raise CheckpointFormatError(
                    f"{self.directory / chunk.file}: bytes {offset}-{offset + out.size} are "
                    "neither on this node nor received from the rank holding the file"
                )
            out[:] = span[1][offset - span[0] : offset - span[0] + out.size]
            return
        fd = self._fd(chunk)
        view = memoryview(out)  # type: ignore[arg-type]
        done = 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], offset + done)
            if n == 0:
                raise CheckpointFormatError(
                    f"{self.directory / chunk.file}: ends inside {chunk.name or chunk.kind!r}; "
                    "the file is truncated"
                )
            done += n

    def read_spans(self, spans: Sequence[Span], chunks: Sequence[StoredChunk]) -> list[np.ndarray]:
        """The bytes of each span, in new buffers (``chunks[i]``: any chunk of span ``i``'s
        file, for its expected size), unverified (see :meth:`check`). On a local disk, one
        read each; on an object store the spans are fetched together (``_FETCHERS`` at a
        time, while the store's client bounds the ranged GETs in flight by its
        ``concurrency``).

        Raises:
            CheckpointFormatError: a file is not the size the record says, or ends early.
            ObjectStoreError: a request failed (typed, naming the URL).
        """
        buffers = [np.empty(span.nbytes, dtype=np.uint8) for span in spans]
        if self.local:
            for span, chunk, buffer in zip(spans, chunks, buffers, strict=True):
                self._pread(chunk, span.start, buffer)
        else:
            reads = [
                (self._object_path(chunk), span.start, buffer)
                for span, chunk, buffer in zip(spans, chunks, buffers, strict=True)
            ]
            backend = self._backend
            if len(reads) == 1:
                backend.read_into(*reads[0])
            else:
                with ThreadPoolExecutor(min(_FETCHERS, len(reads))) as pool:
                    for _ in pool.map(lambda read: backend.read_into(*read), reads):
                        pass
        self.bytes_read += sum(span.nbytes for span in spans)
        return buffers

    @property
    def gap(self) -> int:
        """How far apart two ranges of one file may be and still be read as one span (see
        :data:`OBJECT_STORE_GAP`)."""
        return 0 if self.local else OBJECT_STORE_GAP

    def _mismatch(self, chunk: StoredChunk, what: str, stored: int, actual: int) -> Exception:
        label = f"tensor {chunk.name!r}" if chunk.kind == "tensor" else "a non-tensor value"
        senders = sorted({span[2] for span in self._received.get(chunk.file, ())})
        if senders:
            label = f"(received from the node of rank {senders[0]}) {label}"
        return ChecksumMismatchError(
            f"{display_path(self.directory / chunk.file)}: {label}{what}: crc32c "
            f"{actual:08x} does not match "
            f"the stored {stored:08x}; the file is corrupt (restore it or load an older "
            "checkpoint)"
        )

    def want(self, chunk: StoredChunk, begin: int = 0, end: int | None = None) -> Want:
        """Bytes ``[begin, end)`` of a stored chunk (default: all of it), rounded out to whole
        verification blocks.

        Raises:
            CheckpointFormatError: the range lies outside the chunk, or the chunk has too few
                block checksums.
        """
        end = chunk.length if end is None else end
        if not 0 <= begin <= end <= chunk.length:
            raise CheckpointFormatError(
                f"{self.directory / chunk.file}: range {begin}-{end} outside {chunk.name!r}"
            )
        if chunk.blocks is None or chunk.block_bytes is None:
            pieces = [(0, chunk.length, chunk.crc32c)]
        else:
            block = chunk.block_bytes
            first, last = begin // block, max(begin // block, math.ceil(end / block))
            if last > len(chunk.blocks):
                raise CheckpointFormatError(
                    f"{self.directory / chunk.file}: {chunk.name!r} has too few block checksums"
                )
            pieces = [
                (k * block, min((k + 1) * block, chunk.length), chunk.blocks[k])
                for k in range(first, last)
            ]
        if not pieces or pieces[-1][1] == pieces[0][0]:
            return Want(chunk, begin, begin, ())
        return Want(chunk, pieces[0][0], pieces[-1][1], tuple(pieces))

    def want_box(self, chunk: StoredChunk, offsets: Any, lengths: Any) -> Want:
        """The rows (along the first dimension) of a stored tensor chunk that the sub-box
        ``offsets``/``lengths`` covers (see :func:`box_view`), rounded out to blocks.

        Raises:
            CheckpointFormatError: the box does not lie inside the chunk's shape.
        """
        dtype = dtype_from_name(chunk.dtype or "")
        shape = list(chunk.tensor_shape)
        offsets, lengths = [int(o) for o in offsets], [int(n) for n in lengths]
        if not (
            len(offsets) == len(lengths) == len(shape)
            and all(
                o >= 0 and n >= 0 and o + n <= size
                for o, n, size in zip(offsets, lengths, shape, strict=True)
            )
        ):
            raise CheckpointFormatError(
                f"{self.directory / chunk.file}: the load asks for rows {offsets} + {lengths} "
                f"of {chunk.name!r}, which is stored with shape {shape}"
            )
        if math.prod(lengths) == 0:
            return Want(chunk, 0, 0, ())
        if not shape:
            return self.want(chunk)
        row = math.prod(shape[1:]) * dtype.itemsize
        return self.want(chunk, offsets[0] * row, (offsets[0] + lengths[0]) * row)

    def check(
        self, want: Want, data: np.ndarray, checked: set[tuple[str, int]] | None = None
    ) -> None:
        """Verify the bytes ``data`` read for ``want`` (all of ``[want.begin, want.end)``)
        piece by piece (Rust, without the GIL); nothing when verification is off. A piece
        whose ``(file, offset)`` is in ``checked`` is skipped; checked ones are added.

        Raises:
            ChecksumMismatchError: a piece differs from its stored crc32c (names file, tensor
                and, for a block, its bytes).
        """
        if not self.verify:
            return
        chunk = want.chunk
        for begin, end, crc in want.pieces:
            where_in_file = (chunk.file, chunk.offset + begin)
            if checked is not None:
                if where_in_file in checked:
                    continue
                checked.add(where_in_file)
            actual = crc32c_of(data[begin - want.begin : end - want.begin])
            if actual != crc:
                where = "" if (begin, end) == (0, chunk.length) else f" (bytes {begin}-{end})"
                raise self._mismatch(chunk, where, crc, actual)

    def read_want(self, want: Want) -> np.ndarray:
        """The verified bytes ``[want.begin, want.end)`` (into the reusable buffer: valid
        until the next read)."""
        size = want.end - want.begin
        if size == 0:
            return np.empty(0, dtype=np.uint8)
        if self._buffer.size < size:
            self._buffer = np.empty(max(size, 2 * self._buffer.size), dtype=np.uint8)
        buffer = self._buffer[:size]
        self._read_range(want.chunk, want.chunk.offset + want.begin, buffer)
        self.check(want, buffer)
        return buffer

    def _read_range(self, chunk: StoredChunk, offset: int, out: np.ndarray) -> None:
        """Fill ``out`` from the file of ``chunk`` at the absolute ``offset`` (one read)."""
        if self.local:
            self._pread(chunk, offset, out)
        elif out.nbytes:
            self._backend.read_into(self._object_path(chunk), offset, out)
        self.bytes_read += out.nbytes

    def read_into(self, chunk: StoredChunk, target: torch.Tensor) -> bool:
        """Read a whole stored tensor chunk straight into ``target`` and verify it there.

        Returns False (and reads nothing) when ``target`` cannot take the bytes directly: not a
        contiguous CPU tensor of the chunk's dtype and element count, or a lazy negative or
        conjugate view (``torch._neg_view``, ``.conj()``: its memory holds the negated or
        conjugated values, which the caller's ``copy_`` writes).
        """
        dtype = dtype_from_name(chunk.dtype or "")
        if (
            target.device.type != "cpu"
            or target.dtype != dtype
            or not target.is_contiguous()
            or target.is_neg()
            or target.is_conj()
            or target.numel() * dtype.itemsize != chunk.length
            or chunk.length == 0
        ):
            return False
        data = byte_view(target.detach())
        self._read_range(chunk, chunk.offset, data)
        self.check(self.want(chunk), data)
        return True

    def read_bytes(
        self, chunk: StoredChunk, begin: int = 0, end: int | None = None
    ) -> torch.Tensor:
        """Bytes ``[begin, end)`` of a stored chunk, verified, as a uint8 tensor.

        Whole verification blocks around the range are read and checked; the result is the
        requested slice of them (valid until the next read).

        Raises:
            ChecksumMismatchError: a block's bytes differ from its stored crc32c (names file
                and tensor).
            CheckpointFormatError: the file is shorter than the record says.
        """
        end = chunk.length if end is None else end
        want = self.want(chunk, begin, end)
        data = torch.from_numpy(self.read_want(want))
        return data[begin - want.begin : end - want.begin]

    def read_box(self, chunk: StoredChunk, offsets: Any, lengths: Any) -> torch.Tensor:
        """The sub-box ``offsets``/``lengths`` of a stored tensor chunk, verified.

        Only the rows (along the first dimension) that the box covers are read, rounded out to
        verification blocks.

        Raises:
            CheckpointFormatError: the box does not lie inside the chunk's shape.
        """
        want = self.want_box(chunk, offsets, lengths)
        return box_view(want, self.read_want(want), offsets, lengths)

    def read_chunk(self, chunk: StoredChunk) -> torch.Tensor:
        """A whole stored tensor chunk, verified."""
        shape = list(chunk.tensor_shape)
        return self.read_box(chunk, [0] * len(shape), shape)


def box_view(want: Want, data: np.ndarray, offsets: Any, lengths: Any) -> torch.Tensor:
    """The sub-box ``offsets``/``lengths`` of a tensor chunk as a view of ``data``, the bytes
    of ``want`` (made by :meth:`ChunkFiles.want_box` for the same box)."""
    chunk = want.chunk
    dtype = dtype_from_name(chunk.dtype or "")
    shape = list(chunk.tensor_shape)
    offsets, lengths = [int(o) for o in offsets], [int(n) for n in lengths]
    if math.prod(lengths) == 0:
        return empty_tensor(lengths, dtype)
    if not shape:
        return torch.from_numpy(data).view(dtype).reshape(())
    row = math.prod(shape[1:]) * dtype.itemsize
    begin = offsets[0] * row - want.begin
    # Sliced before it becomes a tensor: the view's storage starts at the rows (a chunk may
    # start at any byte of a span, and torch views dtypes only from an aligned offset).
    rows = torch.from_numpy(data[begin : begin + lengths[0] * row])
    tensor = rows.view(dtype).reshape([lengths[0], *shape[1:]])
    for dim in range(1, len(shape)):
        tensor = tensor.narrow(dim, offsets[dim], lengths[dim])
    return tensor
