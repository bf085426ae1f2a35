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
from fastckpt.dcp.metadata import StoredChunk
from fastckpt.errors import CheckpointFormatError, ChecksumMismatchError
from fastckpt.files import dtype_from_name

__all__ = ["DEFAULT_BLOCK_BYTES", "ChunkFiles", "block_checksums", "crc32c_of"]

#: Chunks above this size get one crc32c per block of this size, so that partial reads are
#: verified while reading at most one block more than needed at each end of a range.
DEFAULT_BLOCK_BYTES = 4 << 20
_PIECE = 8 << 20


def _accepts_buffers() -> bool:
    try:
        _native.crc32c(memoryview(b"x"))  # type: ignore[arg-type]
    except TypeError:
        return False
    return True


_BUFFERS = _accepts_buffers()


def crc32c_of(data: np.ndarray) -> int:
    """crc32c of a contiguous uint8 array (hashed by the Rust core without the GIL)."""
    if _BUFFERS:
        return _native.crc32c(data)  # type: ignore[arg-type]
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

    Args:
        directory: the generation directory.
        verify: check crc32c of everything read (on by default).

    Attributes:
        bytes_read: bytes read from disk so far (for tests and benchmarks).
    """

    def __init__(self, directory: Path, *, verify: bool = True) -> None:
        """Remember the directory; files are opened on first use."""
        self.directory = directory
        self.verify = verify
        self.bytes_read = 0
        self._fds: dict[str, int] = {}

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
            path = self.directory / chunk.file
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            size = os.fstat(fd).st_size
            if size != chunk.file_len:
                os.close(fd)
                raise CheckpointFormatError(
                    f"{path}: size {size} differs from the {chunk.file_len} bytes the commit "
                    "record lists; the file was truncated or replaced"
                )
            self._fds[chunk.file] = fd
        return fd

    def _pread(self, chunk: StoredChunk, begin: int, end: int) -> torch.Tensor:
        """Bytes ``[begin, end)`` of the chunk as a fresh uint8 tensor."""
        fd = self._fd(chunk)
        out = torch.empty(end - begin, dtype=torch.uint8)
        view = memoryview(out.numpy())  # type: ignore[arg-type]
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
        return out

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
            data = self._pread(chunk, 0, chunk.length)
            if self.verify and (actual := crc32c_of(data.numpy())) != chunk.crc32c:
                raise self._mismatch(chunk, "", chunk.crc32c, actual)
            return data[begin:end]
        block = chunk.block_bytes
        first = begin // block
        last = max(first, math.ceil(end / block))
        start = first * block
        data = self._pread(chunk, start, min(last * block, chunk.length))
        if self.verify:
            array = data.numpy()
            for k in range(first, last):
                piece = array[(k - first) * block : (k - first + 1) * block]
                actual = crc32c_of(piece)
                if k >= len(chunk.blocks) or actual != chunk.blocks[k]:
                    stored = chunk.blocks[k] if k < len(chunk.blocks) else 0
                    where = f" (bytes {k * block}-{k * block + piece.size})"
                    raise self._mismatch(chunk, where, stored, actual)
        return data[begin - start : end - start]

    def read_box(self, chunk: StoredChunk, offsets: Any, lengths: Any) -> torch.Tensor:
        """The sub-box ``offsets``/``lengths`` of a stored tensor chunk, verified.

        Only the rows (along the first dimension) that the box covers are read, rounded out to
        verification blocks.
        """
        dtype = dtype_from_name(chunk.dtype or "")
        shape = list(chunk.shape or ())
        offsets, lengths = list(offsets), list(lengths)
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
