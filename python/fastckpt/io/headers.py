"""Safetensors headers and the I/O defaults, without torch.

What a file holds (names, dtypes, shapes, offsets, checksums) is read by the Rust core from its
header alone, so listing, inspecting and verifying checkpoints never imports torch or numpy:
``fastckpt ls``/``inspect``/``verify`` start in a fraction of a second. The tensor I/O that
needs torch is in :mod:`fastckpt.io.files`, which re-exports these names.
"""

from __future__ import annotations

import os
from typing import Any

from fastckpt import _native
from fastckpt.errors import InvalidInputError

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "DEFAULT_THREADS",
    "DEFAULT_WRITE_THREADS",
    "DIRECT_IO_MIN_BYTES",
    "MAX_LOAD_THREADS",
    "check_flag",
    "choose_direct_io",
    "file_path",
    "load_threads",
    "read_metadata",
]

#: Reader threads used when ``threads`` is not given (the Rust reader has no default).
DEFAULT_THREADS = 4
#: The most reader threads a load picks by itself (:func:`load_threads`).
MAX_LOAD_THREADS = 8
#: Writer threads used when ``threads`` is not given: with O_DIRECT, one thread copies and
#: hashes chunks ahead of one thread that writes them in file order (raise it for disks faster
#: than a core can copy). Defined by the Rust core; see benches/NOTES.md for measurements.
DEFAULT_WRITE_THREADS: int = _native.DEFAULT_WRITE_THREADS
#: Bytes per write chunk when ``chunk_size`` is not given (two such aligned buffers are kept
#: for O_DIRECT). Defined by the Rust core; see benches/NOTES.md for measurements.
DEFAULT_CHUNK_SIZE: int = _native.DEFAULT_CHUNK_SIZE
#: Files of at least this many bytes are written with O_DIRECT when ``direct_io=None``
#: (:func:`choose_direct_io`), and verified with O_DIRECT reads where the filesystem allows
#: (``_native.verify_file``: bytes hashed once and dropped do not go through the page cache):
#: four default chunks. Below it both write modes measured the same. Defined by the Rust core.
DIRECT_IO_MIN_BYTES: int = _native.DIRECT_IO_MIN_BYTES


def load_threads() -> int:
    """Reader threads of a load into memory when ``threads`` is not given: one per CPU this
    process may run on, at least :data:`DEFAULT_THREADS` and at most :data:`MAX_LOAD_THREADS`.

    A load blocks the caller, and from the page cache or a RAM tier (``/dev/shm``) it is a
    kernel copy and a crc32c pass over memory, both bound by a core's speed: on a 2-core
    machine one thread moved 257 MiB in 0.083 s and two in 0.042 s. Background work
    (verifying before a prune, promotion) keeps :data:`DEFAULT_THREADS`, to leave the cores to
    training.
    """
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(DEFAULT_THREADS, min(MAX_LOAD_THREADS, cpus))


def choose_direct_io(nbytes: int) -> bool:
    """The write mode ``direct_io=None`` picks for a file of ``nbytes``: O_DIRECT from
    :data:`DIRECT_IO_MIN_BYTES` up, buffered below (the writer falls back to buffered writes by
    itself where the filesystem refuses O_DIRECT, e.g. tmpfs).

    O_DIRECT runs at the disk's speed whatever the machine's memory is doing; a buffered write
    first has the kernel allocate and fill one page-cache page per 4 KiB (about 4x the kernel
    CPU of O_DIRECT per GiB), so its time depends on free CPU and on the state of memory
    management, and on a busy machine it was both slower and bimodal. Small files write equally
    fast either way, and buffered keeps them cached. The measurements are in
    benches/NOTES.md ("Write mode").
    """
    return nbytes >= DIRECT_IO_MIN_BYTES


def check_flag(value: object, name: str, where: str, *, none: bool = False) -> None:
    """Refuse a flag ``name`` of the call ``where`` that is no ``bool`` (``None`` too, unless
    ``none``): ``"no"`` is truthy and ``0`` or ``None`` falsy, so taking them as flags would
    do what was not asked (``verify=None`` turned checksum checking off).

    Raises:
        InvalidInputError: naming ``where``, ``name`` and the value (a ``TypeError``).
    """
    if isinstance(value, bool) or (none and value is None):
        return
    allowed = "a bool or None" if none else "a bool (True or False)"
    raise InvalidInputError(f"{where}: {name} must be {allowed}, got {value!r}")


def file_path(path: str | os.PathLike[str], name: str, where: str) -> str:
    """``path`` as a ``str``, refusing a ``bytes`` path (or an ``os.PathLike`` returning
    bytes), which the Rust core cannot take, with the fix.

    Raises:
        TypeError: not a path at all (``os.fspath``'s), or a bytes path (naming ``where``
            and ``name``).
    """
    chosen = os.fspath(path)
    if not isinstance(chosen, str):
        raise InvalidInputError(
            f"{where}: {name} must be a str or os.PathLike of str, got bytes {chosen!r}; "
            f"decode it with os.fsdecode({name})"
        )
    return chosen


def read_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and validate a file's header without reading tensor data.

    Returns:
        ``{"tensors": {name: {"dtype", "shape", "data_offsets", "crc32c"}}, "metadata": {...},
        "header_crc32c": int | None, "data_start": int, "file_len": int}``; ``crc32c`` is an
        int or ``None`` for files written without checksums, ``header_crc32c`` the verified
        header checksum (``None`` for files of other writers and older fastckpt files),
        ``metadata`` the user's entries only.

    Raises:
        CheckpointFormatError: malformed, damaged or truncated header, or not a regular file.
        InvalidInputError: a bytes path (a ``TypeError``; decode it with ``os.fsdecode``).
    """
    header = _native.read_header(file_path(path, "path", "read_metadata"))
    checksums = header["checksums"]
    return {
        "tensors": {
            entry["name"]: {
                "dtype": entry["dtype"],
                "shape": list(entry["shape"]),
                "data_offsets": list(entry["data_offsets"]),
                "crc32c": checksums.get(entry["name"]),
            }
            for entry in header["tensors"]
        },
        "metadata": dict(header["metadata"]),
        "header_crc32c": header["header_crc32c"],
        "data_start": header["data_start"],
        "file_len": header["file_len"],
    }
