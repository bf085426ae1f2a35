"""Single safetensors files, written and read by the Rust core.

Drop-in replacements for ``safetensors.torch.save_file`` / ``load_file`` with the same call
shape and file format, plus durability (fsync + atomic rename), per-tensor crc32c checksums
verified on load, and parallel chunked I/O with the GIL released.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fastckpt import _native

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "DEFAULT_THREADS",
    "DEFAULT_WRITE_THREADS",
    "choose_direct_io",
    "dtype_from_name",
    "dtype_name",
    "load_file",
    "read_metadata",
    "read_tensors",
    "save_file",
    "write_tensors",
    "writeback_allowance",
]

#: Reader threads used when ``threads`` is not given (the Rust reader has no default).
DEFAULT_THREADS = 4
#: Writer threads used when ``threads`` is not given: with O_DIRECT, one thread copies and
#: hashes chunks ahead of one thread that writes them in file order (raise it for disks faster
#: than a core can copy). Defined by the Rust core; see docs/performance.md for measurements.
DEFAULT_WRITE_THREADS: int = _native.DEFAULT_WRITE_THREADS
#: Bytes per write chunk when ``chunk_size`` is not given (two such aligned buffers are kept
#: for O_DIRECT). Defined by the Rust core; see docs/performance.md for measurements.
DEFAULT_CHUNK_SIZE: int = _native.DEFAULT_CHUNK_SIZE

_DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.int16: "I16",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.complex64: "C64",
}
# Newer dtypes, present depending on the torch version.
for _attr, _name in [
    ("uint16", "U16"),
    ("uint32", "U32"),
    ("uint64", "U64"),
    ("float8_e4m3fn", "F8_E4M3"),
    ("float8_e5m2", "F8_E5M2"),
]:
    if hasattr(torch, _attr):
        _DTYPE_NAMES[getattr(torch, _attr)] = _name
_DTYPES_BY_NAME = {name: dtype for dtype, name in _DTYPE_NAMES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """Return the safetensors name of a torch dtype (``torch.float32`` -> ``"F32"``).

    Raises:
        TypeError: the dtype has no safetensors equivalent.
    """
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        supported = ", ".join(str(d) for d in _DTYPE_NAMES)
        raise TypeError(f"dtype {dtype} cannot be stored; supported: {supported}") from None


def dtype_from_name(name: str) -> torch.dtype:
    """Return the torch dtype for a safetensors dtype name (``"BF16"`` -> ``torch.bfloat16``).

    Raises:
        TypeError: this torch build has no such dtype.
    """
    try:
        return _DTYPES_BY_NAME[name]
    except KeyError:
        raise TypeError(f"safetensors dtype {name!r} has no torch equivalent here") from None


def host_tensor(name: str, tensor: Any) -> torch.Tensor:
    """Return ``tensor`` as a dense, contiguous CPU tensor whose bytes can be written.

    Copies only when needed (non-CPU, non-contiguous, or lazily conjugated/negated tensors).

    Raises:
        TypeError: not a tensor, sparse/quantized, or an unsupported dtype (names ``name``).
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name!r}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout is not torch.strided:
        raise TypeError(f"{name!r}: {tensor.layout} tensors cannot be saved; call .to_dense()")
    if tensor.is_quantized:
        raise TypeError(f"{name!r}: quantized tensors cannot be saved; dequantize() first")
    dtype_name(tensor.dtype)
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.to("cpu")
    tensor = tensor.resolve_conj().resolve_neg()
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    return tensor


def byte_view(tensor: torch.Tensor) -> np.ndarray:
    """A zero-copy uint8 numpy view of a contiguous CPU tensor's bytes (writable)."""
    return tensor.reshape(-1).view(torch.uint8).numpy()


def _check_metadata(metadata: Mapping[str, str] | None) -> dict[str, str]:
    if metadata is None:
        return {}
    for key, value in metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(
                f"metadata must map str to str; got {key!r}: {type(value).__name__} "
                "(serialize values with json.dumps first)"
            )
    return dict(metadata)


def choose_direct_io(nbytes: int) -> bool:
    """The write mode ``direct_io=None`` picks for a file of ``nbytes``: O_DIRECT when the file
    exceeds the kernel's background-writeback allowance, buffered writes below it.

    Below the allowance (``vm.dirty_background_bytes``, or ``vm.dirty_background_ratio`` % of
    available memory) the page cache takes the whole file at memory speed and the fsync then
    writes it back with a deep queue: 2.6 vs 1.5 GiB/s for a 1.5 GiB file on the development
    VM. Above it buffered writers are throttled to writeback speed while filling the cache
    (4 GiB: 1.1 vs 1.5 GiB/s), so O_DIRECT wins. When the settings cannot be read, O_DIRECT.
    """
    allowance = writeback_allowance()
    return allowance is None or nbytes > allowance


def writeback_allowance() -> int | None:
    """Bytes of dirty page cache the kernel lets a writer build up before background writeback
    starts: ``vm.dirty_background_bytes``, else ``vm.dirty_background_ratio`` % of available
    memory. None where these cannot be read."""
    try:
        allowance = int(Path("/proc/sys/vm/dirty_background_bytes").read_text())
        if allowance == 0:
            ratio = int(Path("/proc/sys/vm/dirty_background_ratio").read_text())
            available = next(
                int(line.split()[1]) * 1024
                for line in Path("/proc/meminfo").read_text().splitlines()
                if line.startswith("MemAvailable:")
            )
            allowance = available * ratio // 100
    except (OSError, ValueError, StopIteration, IndexError):
        return None
    return allowance


def save_file(
    tensors: Mapping[str, torch.Tensor],
    path: str | os.PathLike[str],
    metadata: Mapping[str, str] | None = None,
    *,
    threads: int | None = None,
    chunk_size: int | None = None,
    direct_io: bool | None = None,
    fsync: bool = True,
    checksums: bool = True,
) -> None:
    """Save tensors to a safetensors file, durably and atomically.

    The file is written to a temporary sibling in parallel chunks (crc32c of each tensor
    computed in the same pass), fsynced, renamed over ``path`` and the directory fsynced. If
    anything fails, ``path`` is untouched and the temporary file removed.

    Args:
        tensors: name -> tensor. Any device; non-contiguous tensors are made contiguous.
        path: destination file.
        metadata: optional str -> str metadata stored in the header (``__metadata__``).
        threads: writer threads (default :data:`DEFAULT_WRITE_THREADS`); with O_DIRECT all
            but one prepare chunks (copy + crc32c) ahead of the one that writes them in order.
            Buffered writes are one sequential stream with write-behind.
        chunk_size: bytes per write chunk (default :data:`DEFAULT_CHUNK_SIZE`).
        direct_io: True tries O_DIRECT (falling back to buffered writes if the filesystem
            refuses it), False writes through the page cache; None (default) picks per file
            with :func:`choose_direct_io`.
        fsync: make the file durable before returning (turn off only for scratch files).
        checksums: store per-tensor crc32c (turn off only to measure their cost).

    Raises:
        TypeError: a value is not a dense tensor of a supported dtype, or metadata is not str.
        ValueError: duplicate or reserved names.
        OSError: the file cannot be written (the message names it).
    """
    write_tensors(
        tensors,
        path,
        metadata,
        threads=threads,
        chunk_size=chunk_size,
        direct_io=direct_io,
        fsync=fsync,
        checksums=checksums,
    )


def write_tensors(
    tensors: Mapping[str, torch.Tensor],
    path: str | os.PathLike[str],
    metadata: Mapping[str, str] | None = None,
    *,
    threads: int | None = None,
    chunk_size: int | None = None,
    direct_io: bool | None = None,
    fsync: bool = True,
    checksums: bool = True,
) -> dict[str, Any]:
    """:func:`save_file` that returns the writer's report.

    Returns:
        ``{"file_len": int, "file_crc32c": int | None, "direct_io": bool (O_DIRECT actually
        used), "checksums": {name: crc32c}}``.
    """
    if not isinstance(tensors, Mapping):
        raise TypeError(
            f"tensors must be a mapping of name -> tensor, got {type(tensors).__name__}"
        )
    entries = []
    keep_alive = []
    nbytes = 0
    for name, tensor in tensors.items():
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be str, got {name!r}")
        host = host_tensor(name, tensor)
        keep_alive.append(host)
        entries.append((name, dtype_name(host.dtype), list(host.shape), byte_view(host)))
        nbytes += host.nbytes
    if direct_io is None:
        direct_io = choose_direct_io(nbytes)
    return _native.save_file(
        os.fspath(path),
        entries,
        _check_metadata(metadata),
        threads or DEFAULT_WRITE_THREADS,
        chunk_size or DEFAULT_CHUNK_SIZE,
        direct_io,
        fsync,
        checksums,
    )


def load_file(
    path: str | os.PathLike[str],
    device: str | torch.device = "cpu",
    *,
    verify: bool = True,
    threads: int | None = None,
) -> dict[str, torch.Tensor]:
    """Load every tensor of a safetensors file (written by fastckpt or by safetensors).

    The file is mapped privately and each tensor is a copy-on-write view of its bytes (as with
    ``safetensors.torch.load_file``); with ``verify``, the Rust core hashes the mapping on
    ``threads`` threads without the GIL, which is what reads the file in, and nothing is
    returned unless every checksum matched. Writing to a returned tensor never changes the
    file. Like any file mapping, the tensors see the file's bytes: replacing the file (as
    fastckpt's atomic saves do) is safe, editing or truncating it in place while they are
    alive is not.

    Args:
        path: the file.
        device: where the returned tensors live.
        verify: check crc32c checksums (files without them, e.g. from safetensors, load as-is).
        threads: reader threads (default :data:`DEFAULT_THREADS`).

    Returns:
        name -> tensor, in file order.

    Raises:
        CheckpointFormatError: malformed or truncated file (names file and field).
        ChecksumMismatchError: corrupt tensor bytes (names file and tensor).
        FileNotFoundError: no such file.
    """
    tensors, _ = read_tensors(path, verify=verify, threads=threads)
    target = torch.device(device)
    if target.type != "cpu":
        tensors = {name: t.to(target) for name, t in tensors.items()}
    return tensors


def read_tensors(
    path: str | os.PathLike[str], *, verify: bool = True, threads: int | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """:func:`load_file` on CPU that also returns ``{"metadata": ..., "file_crc32c": ...}``.

    The file is mapped privately (copy-on-write, like ``safetensors.torch.load_file``) and the
    returned tensors are views of that mapping: loading copies nothing, and hashing the mapping
    on ``threads`` threads is what reads the file in. Writing to a returned tensor changes only
    this process's copy of that page. A tensor whose bytes are not aligned to its element size
    is copied instead.

    ``file_crc32c`` is the checksum of the whole file when ``verify`` is set, so callers
    holding a manifest can confirm it is the file they recorded.
    """
    name = os.fspath(path)
    storage: Any = torch.UntypedStorage(0)
    # A regular file or a typed error at once (FIFOs and devices are refused without blocking
    # or reading); FileNotFoundError / PermissionError keep their types.
    with os.fdopen(_native.open_regular(name), "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        if size:
            # Map the file this handle opened, not whatever the path names by now (a save
            # may rename a new file over it meanwhile).
            try:
                storage = torch.UntypedStorage.from_file(
                    f"/proc/self/fd/{handle.fileno()}", shared=False, nbytes=size
                )
            except RuntimeError as err:
                raise OSError(f"{name}: cannot map the file for reading: {err}") from None
    flat = torch.empty(0, dtype=torch.uint8).set_(storage)
    header = _native.check_mapped(name, byte_view(flat), verify, threads or DEFAULT_THREADS)
    start = header["data_start"]
    tensors: dict[str, torch.Tensor] = {}
    for entry in header["tensors"]:
        dtype = dtype_from_name(entry["dtype"])
        begin, end = entry["data_offsets"]
        # Each tensor gets its own storage starting at its first byte (a slice that keeps the
        # mapping alive), not an offset into the file's: some torch APIs, e.g.
        # torch.set_rng_state, ignore storage offsets.
        data = torch.empty(0, dtype=torch.uint8).set_(storage[start + begin : start + end])
        if (start + begin) % dtype.itemsize:
            data = data.clone()
        tensors[entry["name"]] = data.view(dtype).reshape(entry["shape"])
    return tensors, {"metadata": header["metadata"], "file_crc32c": header["file_crc32c"]}


def read_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and validate a file's header without reading tensor data.

    Returns:
        ``{"tensors": {name: {"dtype", "shape", "data_offsets", "crc32c"}}, "metadata": {...},
        "data_start": int, "file_len": int}``; ``crc32c`` is an int or ``None`` for files
        written without checksums.

    Raises:
        CheckpointFormatError: malformed or truncated header.
    """
    header = _native.read_header(os.fspath(path))
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
        "data_start": header["data_start"],
        "file_len": header["file_len"],
    }
