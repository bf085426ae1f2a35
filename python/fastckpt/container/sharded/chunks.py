"""Verified reads of stored chunks: only the byte ranges asked for, each checked by crc32c.

A saved chunk is one safetensors entry. Its crc32c covers all of it, so a rank that needs only
some rows of it (resharding) could not check what it read. Chunks larger than a *verification
block* therefore also carry one crc32c per block (:func:`block_checksums`, computed by the
writer): a reader fetches the rows it needs, rounded out to whole blocks, and checks each
block. Smaller chunks are one block, checked against the entry's own crc32c.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fastckpt import _native
from fastckpt.errors import CheckpointFormatError, ChecksumMismatchError
from fastckpt.format.paths import check_relpath, safe_join
from fastckpt.format.sharded import StoredChunk
from fastckpt.io.files import dtype_from_name
from fastckpt.storage.registry import backend_for, is_local

__all__ = ["DEFAULT_BLOCK_BYTES", "ChunkFiles", "block_checksums", "crc32c_of"]

#: Chunks above this size get one crc32c per block of this size, so that partial reads are
#: verified while reading at most one block more than needed at each end of a range.
DEFAULT_BLOCK_BYTES = 4 << 20
_PIECE = 8 << 20


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
    checkpoint directory once every symlink is resolved (:func:`~fastckpt.format.paths.safe_join`:
    a rank file or a generation directory linked out of it is refused), and the file must be a
    regular file, checked on the open descriptor without blocking (a FIFO or a device in its
    place is a :class:`~fastckpt.CheckpointFormatError` at once, not a read that never ends).

    Args:
        directory: the generation directory.
        verify: check crc32c of everything read (on by default).
        within: the checkpoint directory the files must stay in (default: ``directory``'s
            parent, the checkpoint directory of a generation).

    Attributes:
        bytes_read: bytes read from disk so far (for tests and benchmarks).
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
        #: on an object store: the files whose size was checked against the record
        self._objects: set[str] = set()

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
                    f"{path}: size {info.size} differs from the {chunk.file_len} bytes the "
                    "commit record lists; the object was truncated or replaced"
                )
            self._objects.add(chunk.file)
        return path

    def _pread_into(self, chunk: StoredChunk, begin: int, out: np.ndarray) -> None:
        """Fill ``out`` with the chunk's bytes from ``begin`` on (on an object store, ranged
        GETs of exactly those bytes)."""
        if not is_local(self._backend):
            if out.nbytes:
                self._backend.read_into(self._object_path(chunk), chunk.offset + begin, out)
            self.bytes_read += out.nbytes
            return
        fd = self._fd(chunk)
        view = memoryview(out)  # type: ignore[arg-type]
        done = 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], chunk.offset + begin + done)
            if n == 0:
                raise CheckpointFormatError(
                    f"{self.directory / chunk.file}: ends inside {chunk.name or chunk.kind!r}; "
                    "the file is truncated"
                )
            done += n
        self.bytes_read += len(view)

    def _mismatch(self, chunk: StoredChunk, what: str, stored: int, actual: int) -> Exception:
        label = f"tensor {chunk.name!r}" if chunk.kind == "tensor" else "a non-tensor value"
        return ChecksumMismatchError(
            f"{self.directory / chunk.file}: {label}{what}: crc32c {actual:08x} does not match "
            f"the stored {stored:08x}; the file is corrupt (restore it or load an older "
            "checkpoint)"
        )

    def read_bytes(
        self, chunk: StoredChunk, begin: int = 0, end: int | None = None
    ) -> torch.Tensor:
        """Bytes ``[begin, end)`` of a stored chunk, verified, as a uint8 tensor.

        Whole verification blocks around the range are read and checked; the result is the
        requested slice of them.

        Raises:
            ChecksumMismatchError: a block's bytes differ from its stored crc32c (names file
                and tensor).
            CheckpointFormatError: the file is shorter than the record says.
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
        start = pieces[0][0] if pieces else begin
        data = self._read_verified(chunk, pieces)
        return data[begin - start : end - start]

    def _read_verified(
        self, chunk: StoredChunk, pieces: list[tuple[int, int, int]]
    ) -> torch.Tensor:
        """Read the contiguous pieces ``(begin, end, crc32c)`` of a chunk into the reusable
        buffer and check each piece's crc32c there (Rust, without the GIL). The returned
        bytes stay valid until the next read."""
        if not pieces or pieces[-1][1] == pieces[0][0]:
            return torch.empty(0, dtype=torch.uint8)
        start, stop = pieces[0][0], pieces[-1][1]
        if self._buffer.size < stop - start:
            self._buffer = np.empty(max(stop - start, 2 * self._buffer.size), dtype=np.uint8)
        buffer = self._buffer[: stop - start]
        self._pread_into(chunk, start, buffer)
        if self.verify:
            for begin, end, crc in pieces:
                actual = crc32c_of(buffer[begin - start : end - start])
                if actual != crc:
                    where = "" if (begin, end) == (0, chunk.length) else f" (bytes {begin}-{end})"
                    raise self._mismatch(chunk, where, crc, actual)
        return torch.from_numpy(buffer)

    def read_into(self, chunk: StoredChunk, target: torch.Tensor) -> bool:
        """Read a whole stored tensor chunk straight into ``target`` and verify it there.

        Returns False (and reads nothing) when ``target`` cannot take the bytes directly: not a
        contiguous CPU tensor of the chunk's dtype and element count.
        """
        dtype = dtype_from_name(chunk.dtype or "")
        if (
            target.device.type != "cpu"
            or target.dtype != dtype
            or not target.is_contiguous()
            or target.numel() * dtype.itemsize != chunk.length
            or chunk.length == 0
        ):
            return False
        data = target.detach().reshape(-1).view(torch.uint8).numpy()
        self._pread_into(chunk, 0, data)
        if self.verify:
            if chunk.blocks is None or chunk.block_bytes is None:
                pieces = [(0, chunk.length, chunk.crc32c)]
            else:
                block = chunk.block_bytes
                pieces = [
                    (k * block, min((k + 1) * block, chunk.length), crc)
                    for k, crc in enumerate(chunk.blocks)
                ]
            for begin, end, crc in pieces:
                actual = crc32c_of(data[begin:end])
                if actual != crc:
                    where = "" if (begin, end) == (0, chunk.length) else f" (bytes {begin}-{end})"
                    raise self._mismatch(chunk, where, crc, actual)
        return True

    def read_box(self, chunk: StoredChunk, offsets: Any, lengths: Any) -> torch.Tensor:
        """The sub-box ``offsets``/``lengths`` of a stored tensor chunk, verified.

        Only the rows (along the first dimension) that the box covers are read, rounded out to
        verification blocks.

        Raises:
            CheckpointFormatError: the box does not lie inside the chunk's shape.
        """
        dtype = dtype_from_name(chunk.dtype or "")
        shape = list(chunk.shape or ())
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
            return torch.empty(lengths, dtype=dtype)
        if not shape:
            return self.read_bytes(chunk).view(dtype).reshape(())
        row = math.prod(shape[1:]) * dtype.itemsize
        data = self.read_bytes(chunk, offsets[0] * row, (offsets[0] + lengths[0]) * row)
        tensor = data.view(dtype).reshape([lengths[0], *shape[1:]])
        for dim in range(1, len(shape)):
            tensor = tensor.narrow(dim, offsets[dim], lengths[dim])
        return tensor

    def read_chunk(self, chunk: StoredChunk) -> torch.Tensor:
        """A whole stored tensor chunk, verified."""
        shape = list(chunk.shape or ())
        return self.read_box(chunk, [0] * len(shape), shape)
