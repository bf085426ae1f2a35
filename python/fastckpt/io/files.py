"""Single safetensors files, written and read by the Rust core.

Drop-in replacements for ``safetensors.torch.save_file`` / ``load_file`` with the same call
shape (``filename=``, ``metadata=``, ``device=``, ``backend=``) and file format, plus durability
(fsync + atomic rename), per-tensor and header crc32c checksums verified on load, and parallel
chunked I/O with the GIL released. Where the two differ by design (tensors sharing memory are
saved as copies, non-contiguous tensors are accepted, the checksum metadata keys) is listed in
docs/migrating.md.
"""

from __future__ import annotations

import errno
import math
import os
import re
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from fastckpt import _native
from fastckpt.errors import CheckpointFormatError, InvalidInputError
from fastckpt.io.headers import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_THREADS,
    DEFAULT_WRITE_THREADS,
    DIRECT_IO_MIN_BYTES,
    check_flag,
    choose_direct_io,
    file_path,
    read_metadata,
)
from fastckpt.io.limits import NO_DESCRIPTORS, descriptor_advice
from fastckpt.io.paths import is_text

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "DEFAULT_THREADS",
    "DEFAULT_WRITE_THREADS",
    "DIRECT_IO_MIN_BYTES",
    "check_count",
    "check_flag",
    "check_storable",
    "choose_direct_io",
    "copy_values",
    "dtype_from_name",
    "dtype_name",
    "file_path",
    "header_shape",
    "load_file",
    "read_into",
    "read_metadata",
    "read_tensors",
    "save_file",
    "staging_bytes",
    "torch_shape",
    "write_tensors",
]

#: Bounds of the ``threads`` and ``chunk_size`` arguments.
MAX_THREADS = 1 << 16
MIN_CHUNK_SIZE = 4096
MAX_CHUNK_SIZE = 1 << 30  # larger chunks gain nothing; each O_DIRECT buffer is one chunk

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
    ("float8_e4m3fnuz", "F8_E4M3FNUZ"),
    ("float8_e5m2fnuz", "F8_E5M2FNUZ"),
    ("float8_e8m0fnu", "F8_E8M0"),
    ("float4_e2m1fn_x2", "F4"),
]:
    if hasattr(torch, _attr):
        _DTYPE_NAMES[getattr(torch, _attr)] = _name
_DTYPES_BY_NAME = {name: dtype for dtype, name in _DTYPE_NAMES.items()}
#: The safetensors name whose elements torch packs two to a byte (``float4_e2m1fn_x2``): the
#: header counts 4-bit elements, torch counts bytes.
_PACKED_PAIRS = "F4"
#: ``load_file(backend=...)`` values, as in safetensors.
BACKENDS = ("mmap", "pread")


def dtype_name(dtype: torch.dtype) -> str:
    """Return the safetensors name of a torch dtype (``torch.float32`` -> ``"F32"``).

    Raises:
        InvalidInputError: the dtype has no safetensors equivalent (a TypeError and a
            ValueError).
    """
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        supported = ", ".join(str(d) for d in _DTYPE_NAMES)
        raise InvalidInputError(f"dtype {dtype} cannot be stored; supported: {supported}") from None


def dtype_from_name(name: str) -> torch.dtype:
    """Return the torch dtype for a safetensors dtype name (``"BF16"`` -> ``torch.bfloat16``).

    Raises:
        InvalidInputError: this torch build has no such dtype (``F6_E2M3``/``F6_E3M2`` never
            have one).
    """
    try:
        return _DTYPES_BY_NAME[name]
    except KeyError:
        raise InvalidInputError(
            f"safetensors dtype {name!r} has no torch equivalent in torch {torch.__version__}"
        ) from None


def header_shape(name: str, tensor: torch.Tensor) -> list[int]:
    """The shape a tensor has in a safetensors header: its torch shape, except for
    ``float4_e2m1fn_x2``, whose last dimension counts bytes of two 4-bit ``F4`` elements (the
    header counts elements, so it is doubled, as safetensors does).

    Raises:
        InvalidInputError: a 0-d ``float4_e2m1fn_x2`` tensor (no dimension to double).
    """
    shape = list(tensor.shape)
    if _DTYPE_NAMES.get(tensor.dtype) == _PACKED_PAIRS:
        if not shape:
            raise InvalidInputError(
                f"{name!r}: a 0-d {tensor.dtype} tensor has no safetensors F4 layout; "
                "reshape it to (1,) first"
            )
        shape[-1] *= 2
    return shape


def torch_shape(where: str, dtype: str, shape: list[int]) -> list[int]:
    """The torch shape of a tensor stored with safetensors ``dtype`` and header ``shape``
    (the inverse of :func:`header_shape`; ``where`` names file and tensor in errors).

    Raises:
        InvalidInputError: an ``F4`` tensor whose last dimension is odd or absent (torch's
            ``float4_e2m1fn_x2`` holds pairs).
    """
    if dtype != _PACKED_PAIRS:
        return shape
    if not shape or shape[-1] % 2:
        raise InvalidInputError(
            f"{where}: F4 shape {shape} cannot be loaded as torch.float4_e2m1fn_x2 (it packs "
            "two values per byte: the last dimension must be even)"
        )
    return [*shape[:-1], shape[-1] // 2]


_PYTHON_DISPATCH = torch._C.DispatchKey.Python


def check_storable(name: str, tensor: Any) -> torch.Tensor:
    """``tensor`` as the tensor whose bytes are stored (itself, or for an
    ``AsyncCollectiveTensor`` the result it waited for), or a refusal before anything is
    copied or written.

    Raises:
        InvalidInputError: naming ``name`` and the fix: not a tensor; a sparse, mkldnn,
            quantized, nested, meta or zero (``_efficientzerotensor``) tensor; a wrapper
            subclass whose values live elsewhere (``__torch_dispatch__`` subclasses such as
            torchao's quantized and float8 tensors: their storage holds none of them); a dtype
            safetensors has no name for; a 0-d ``float4_e2m1fn_x2`` tensor; a tensor whose
            storage does not hold its values (freed or shrunk below the bytes its elements
            reach, or a functional tensor's, which cannot be read).
    """
    if not isinstance(tensor, torch.Tensor):
        raise InvalidInputError(f"{name!r}: expected a torch.Tensor, got {type(tensor).__name__}")
    if isinstance(
        tensor, (torch.nn.parameter.UninitializedParameter, torch.nn.parameter.UninitializedBuffer)
    ):
        raise InvalidInputError(
            f"{name!r}: an uninitialized (lazy) parameter or buffer has no values yet; run a "
            "forward pass (or initialize the lazy module) before saving"
        )
    collectives = sys.modules.get("torch.distributed._functional_collectives")
    if collectives is not None and isinstance(tensor, collectives.AsyncCollectiveTensor):
        tensor = tensor.wait()  # a collective's result: a plain tensor once waited for
    if tensor.layout is not torch.strided:
        raise InvalidInputError(
            f"{name!r}: {tensor.layout} tensors cannot be saved; call .to_dense()"
        )
    if tensor.is_quantized:
        raise InvalidInputError(f"{name!r}: quantized tensors cannot be saved; dequantize() first")
    if tensor.is_nested:
        raise InvalidInputError(
            f"{name!r}: nested tensors cannot be saved; save its components "
            "(.unbind()) or a padded tensor (.to_padded_tensor(0))"
        )
    if tensor.is_meta:
        raise InvalidInputError(
            f"{name!r}: a meta tensor has no values to save; materialize it "
            "(module.to_empty(device=...) and initialize it) first"
        )
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter) and torch._C._dispatch_keys(
        tensor
    ).has(_PYTHON_DISPATCH):
        raise InvalidInputError(
            f"{name!r}: a {type(tensor).__name__} (a __torch_dispatch__ tensor subclass) "
            "cannot be saved as one tensor: its storage does not hold its values; save its "
            "plain tensors (e.g. its inner tensors, or a dequantized copy)"
        )
    if tensor._is_zerotensor():
        raise InvalidInputError(
            f"{name!r}: a zero tensor (torch._efficientzerotensor) has no storage to save; "
            "save torch.zeros_like(it) instead"
        )
    try:
        dtype_name(tensor.dtype)
    except InvalidInputError as err:
        raise InvalidInputError(f"{name!r}: {err}") from None
    header_shape(name, tensor)  # a 0-d float4: refused here, under the caller's full name
    _check_memory(name, tensor)
    return tensor


def _check_memory(name: str, tensor: torch.Tensor) -> None:
    """Refuse a strided ``tensor`` whose storage does not hold its values, before anything
    reads it (past a storage's end lies other memory: saved as garbage, or a segfault).

    Raises:
        InvalidInputError: naming ``name`` and the fix: a storage whose memory cannot be
            read (a functionalization wrapper, as ``torch._to_functional_tensor`` makes); a
            storage smaller than the bytes the tensor's elements reach (freed or shrunk with
            ``untyped_storage().resize_()``, as FSDP frees unsharded parameters).
    """
    try:
        storage = tensor.untyped_storage()
        storage.data_ptr()
    except RuntimeError:
        if tensor.device.type not in ("cpu", "cuda"):
            return  # a backend without host-visible storage (XLA, lazy): copied to the CPU
        raise InvalidInputError(
            f"{name!r}: its storage cannot be read (a functional tensor, as "
            "torch.func.functionalize and torch.compile tracing make, holds no values of its "
            "own); save it outside the functionalized code, where it is a plain tensor"
        ) from None
    reach = _reach(tensor)
    if reach > storage.nbytes():
        raise InvalidInputError(
            f"{name!r}: its storage holds {storage.nbytes()} bytes but its elements reach "
            f"{reach} (shape {list(tensor.shape)}, stride {list(tensor.stride())}, storage "
            f"offset {tensor.storage_offset()}): the storage was freed or shrunk "
            "(untyped_storage().resize_(), as FSDP does to unsharded parameters); save the "
            "tensor while its storage holds its values (before it is freed, or the sharded "
            "state_dict() that holds them)"
        )


def _reach(tensor: torch.Tensor) -> int:
    """The bytes of its storage that ``tensor``'s elements reach: up to the end of the
    element furthest in (0 for a tensor without elements; torch strides are never negative)."""
    numel = tensor.numel()
    if numel == 0:
        return 0
    if tensor.is_contiguous():  # the common case, without a sum over the dimensions
        return (int(tensor.storage_offset()) + numel) * tensor.element_size()
    last = int(tensor.storage_offset()) + sum(
        (size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True)
    )
    return (last + 1) * tensor.element_size()


def host_tensor(name: str, tensor: Any) -> torch.Tensor:
    """Return ``tensor`` as a dense, contiguous CPU tensor whose bytes can be written.

    Copies only when needed (non-CPU, non-contiguous, or lazily conjugated/negated tensors).

    Raises:
        InvalidInputError: what :func:`check_storable` refuses (names ``name``; a TypeError
            and a ValueError).
    """
    tensor = check_storable(name, tensor).detach()
    if tensor.device.type != "cpu":
        tensor = tensor.to("cpu")
    tensor = tensor.resolve_conj().resolve_neg()
    if not tensor.is_contiguous():
        integer = _SAME_SIZE_INT.get(tensor.dtype.itemsize)
        if _DTYPE_NAMES.get(tensor.dtype) == _PACKED_PAIRS and integer is not None:
            # torch has no copy kernel for float4_e2m1fn_x2: the bytes move as integers.
            tensor = tensor.view(integer).contiguous().view(tensor.dtype)
        else:
            tensor = tensor.contiguous()
    return tensor


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def empty_tensor(
    shape: Sequence[int],
    dtype: torch.dtype,
    *,
    device: str | torch.device = "cpu",
    pin_memory: bool = False,
) -> torch.Tensor:
    """An uninitialised tensor to read saved bytes into: ``torch.empty`` allocated as bytes
    and viewed as ``dtype``, so it works under ``torch.use_deterministic_algorithms(True)``,
    which fills new tensors and has no fill kernel for ``float4_e2m1fn_x2`` (a Lightning
    ``Trainer(deterministic=True)`` turns that mode on for the whole process).
    """
    shape = tuple(int(n) for n in shape)
    size = math.prod(shape) * dtype.itemsize
    raw = torch.empty(size, dtype=torch.uint8, device=device, pin_memory=pin_memory)
    return raw.view(dtype).view(shape)


def staging_bytes(size: int, *, pin_memory: bool, what: str) -> torch.Tensor:
    """``size`` uninitialised bytes of host memory for a save's staging copy (``what`` names
    it: a tensor's buffer, a file's image).

    Raises:
        MemoryError: the allocation failed (torch's bare "DefaultCPUAllocator: can't allocate
            memory"), naming ``what``, the size and the fixes; nothing of the save was
            committed.
    """
    try:
        return torch.empty(size, dtype=torch.uint8, pin_memory=pin_memory)
    except RuntimeError as err:
        text = str(err).lower()
        if "can't allocate memory" not in text and "out of memory" not in text:
            raise
        kind = "pinned host memory" if pin_memory else "host memory"
        pinned = " or stage in pageable memory (use_pinned_memory=False)" if pin_memory else ""
        raise MemoryError(
            f"{what}: {size} bytes of {kind} could not be allocated for a save's staging "
            "copy, so that save is not committed (the checkpoints before it are intact); "
            f"free memory{pinned}, or, for an async save of host tensors, save synchronously "
            "(CheckpointManager.Config.with_sync_save(), CheckpointHook(async_save=False)), "
            "which stages no copy of them"
        ) from err


def copy_values(target: torch.Tensor, source: torch.Tensor) -> None:
    """``target.copy_(source)``; for a dtype torch has no copy kernel for (``float4_e2m1fn_x2``
    in torch 2.9) and equal dtypes, the bits are copied through same-size integer views.

    Raises:
        what ``copy_`` raises otherwise.
    """
    try:
        target.copy_(source)
    except NotImplementedError:
        integer = _SAME_SIZE_INT.get(target.dtype.itemsize)
        if target.dtype != source.dtype or integer is None:
            raise
        target.view(integer).copy_(source.view(integer))


def byte_view(tensor: torch.Tensor) -> np.ndarray:
    """A zero-copy uint8 numpy view of a contiguous CPU tensor's bytes (writable).

    Not ``Tensor.numpy()``: torch marks the storage of a tensor it exports to NumPy as not
    resizable, for good, and a save must leave the caller's tensors as they were (code that
    frees a parameter's storage with ``untyped_storage().resize_(0)`` failed after the first
    checkpoint). The array keeps the tensor's storage alive."""
    flat = tensor.reshape(-1).view(torch.uint8)
    if flat.device.type != "cpu":
        raise TypeError(f"byte_view needs a CPU tensor, got one on {flat.device}")
    if flat.numel() == 0:
        # No bytes to share (its data pointer may be NULL, which NumPy < 1.25 refuses).
        return np.empty(0, dtype=np.uint8)
    return np.asarray(_Bytes(flat))


class _Bytes:
    """The bytes of a flat uint8 CPU tensor, for NumPy (``__array_interface__``); holding the
    tensor keeps its storage alive as long as an array made from it."""

    __slots__ = ("__array_interface__", "_tensor")

    def __init__(self, flat: torch.Tensor) -> None:
        self._tensor = flat
        self.__array_interface__ = {
            "version": 3,
            "shape": (flat.numel(),),
            "typestr": "|u1",
            "data": (flat.data_ptr(), False),
        }


def read_into(
    path: str,
    entries: Sequence[tuple[str, str, list[int], np.ndarray]],
    threads: int,
    *,
    progress: Any = None,
    fresh: set[str] | None = None,
    labels: Mapping[str, str] | None = None,
) -> int:
    """Read the tensors ``entries`` (name, dtype, shape, byte view) of the safetensors file
    ``path`` into their memory; returns the file's crc32c (``_native.read_into``).
    ``labels`` names tensors in messages the way the caller's user knows them (a manager
    item's keys), by their names in the file.

    Raises:
        InvalidInputError: a destination's memory cannot be written (a read-only file
            mapping, such as ``np.memmap(mode="r")`` made a tensor with ``torch.from_numpy``),
            naming the file and the tensor; before, the kernel's bare ``[Errno 14] Bad
            address``.
    """
    try:
        return int(_native.read_into(path, entries, threads, progress=progress, fresh=fresh))
    except OSError as err:
        if err.errno != errno.EFAULT:
            raise
        named = [name for name, _, _, memory in entries if not _writable_memory(memory)]
        which = f"tensor {(labels or {}).get(named[0], named[0])!r}" if named else "a tensor"
        raise InvalidInputError(
            f"{path}: cannot read {which} into its destination: that memory cannot be written "
            "(a read-only mapping, as np.memmap(mode='r') or mmap(PROT_READ) give); pass a "
            "writable template tensor (or none, and copy the loaded values yourself)"
        ) from err


def _writable_memory(memory: np.ndarray) -> bool:
    """Whether every page of ``memory`` lies in a writable mapping of this process (Linux's
    ``/proc/self/maps``; True where it cannot be told)."""
    if memory.size == 0:
        return True
    begin = memory.__array_interface__["data"][0]
    end = begin + memory.nbytes
    try:
        with open("/proc/self/maps", encoding="ascii", errors="replace") as maps:
            lines = maps.readlines()
    except OSError:
        return True
    covered = begin
    for line in lines:
        span, perms = line.split()[:2]
        low, high = (int(bound, 16) for bound in span.split("-"))
        if low <= covered < high:
            if "w" not in perms:
                return False
            covered = high
            if covered >= end:
                return True
    return covered >= end


def check_count(value: object, name: str, default: int, least: int, most: int) -> int:
    """``value`` (None: ``default``) as an ``int`` from ``least`` to ``most``, else an
    :class:`InvalidInputError` naming ``name``."""
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= most:
        raise InvalidInputError(
            f"{name} must be an int from {least} to {most} (or None for the default, "
            f"{default}), got {value!r}"
        )
    return value


def _check_metadata(metadata: Mapping[str, str] | None) -> dict[str, str]:
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise InvalidInputError(
            f"metadata must be a mapping of str to str (or None), got {type(metadata).__name__}"
        )
    for key, value in metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise InvalidInputError(
                f"metadata must map str to str; got {key!r}: {type(value).__name__} "
                "(serialize values with json.dumps first)"
            )
        if not (is_text(key) and is_text(value)):
            raise InvalidInputError(
                f"metadata {key!r}: {value!r} is not valid Unicode text (a lone surrogate); "
                "a safetensors header holds UTF-8"
            )
    return dict(metadata)


def _the_path(
    filename: str | os.PathLike[str] | None, path: str | os.PathLike[str] | None, where: str
) -> str:
    """The file named by safetensors' ``filename`` or fastckpt's older ``path`` keyword (of
    the call ``where``), as a ``str`` (a bytes path is refused: :func:`file_path`)."""
    if filename is None and path is None:
        raise TypeError("missing the file: pass filename (or path=)")
    if filename is not None and path is not None:
        raise TypeError("pass the file once: filename or path=, not both")
    if filename is not None:
        return file_path(filename, "filename", where)
    assert path is not None
    return file_path(path, "path", where)


def save_file(
    tensors: Mapping[str, torch.Tensor],
    filename: str | os.PathLike[str] | None = None,
    metadata: Mapping[str, str] | None = None,
    *,
    path: str | os.PathLike[str] | None = None,
    threads: int | None = None,
    chunk_size: int | None = None,
    direct_io: bool | None = None,
    fsync: bool = True,
    checksums: bool = True,
) -> None:
    """Save tensors to a safetensors file, durably and atomically.

    The file is written to a temporary sibling in parallel chunks (crc32c of each tensor
    computed in the same pass), fsynced, renamed over ``filename`` and the directory fsynced.
    If anything fails, ``filename`` is untouched and the temporary file removed.

    Args:
        tensors: name -> tensor. Any device; non-contiguous tensors are made contiguous, and
            tensors sharing memory are each saved as their own copy.
        filename: destination file (safetensors' name for it; ``path=`` is accepted too).
        metadata: optional str -> str metadata stored in the header (``__metadata__``).
        path: the destination, by fastckpt's earlier keyword name (give one of the two).
        threads: writer threads (default :data:`DEFAULT_WRITE_THREADS`); with O_DIRECT all
            but one prepare chunks (copy + crc32c) ahead of the one that writes them in order.
            Buffered writes are one sequential stream with write-behind.
        chunk_size: bytes per write chunk (default :data:`DEFAULT_CHUNK_SIZE`).
        direct_io: True tries O_DIRECT (falling back to buffered writes if the filesystem
            refuses it), False writes through the page cache; None (default) picks per file
            with :func:`choose_direct_io`.
        fsync: make the file durable before returning (turn off only for scratch files).
        checksums: store per-tensor and header crc32c (turn off only to measure their cost;
            the file then has no ``__metadata__`` unless ``metadata`` is given).

    Raises:
        InvalidInputError: not a mapping of str to dense tensors of a supported dtype, or
            metadata not a str -> str mapping (a TypeError and a ValueError), ``threads`` or
            ``chunk_size`` out of range, ``direct_io`` / ``fsync`` / ``checksums`` not a
            bool (``direct_io`` may be None), a bytes path (decode it with ``os.fsdecode``),
            duplicate or reserved names or metadata keys, or a header (names, shapes,
            metadata) over the 100,000,000 bytes safetensors reads (nothing is written).
        OSError: the file cannot be written (the message names it).
    """
    check_flag(direct_io, "direct_io", "save_file", none=True)
    check_flag(fsync, "fsync", "save_file")
    check_flag(checksums, "checksums", "save_file")
    write_tensors(
        tensors,
        _the_path(filename, path, "save_file"),
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
    progress: _native.ByteCounter | None = None,
) -> dict[str, Any]:
    """:func:`save_file` that returns the writer's report.

    ``progress`` (a :class:`fastckpt._native.ByteCounter`) advances by the tensor bytes
    written, from the writer threads, for a progress display polling it.

    Returns:
        ``{"file_len": int, "file_crc32c": int | None, "direct_io": bool (O_DIRECT actually
        used), "checksums": {name: crc32c}}``.
    """
    if not isinstance(tensors, Mapping):
        raise InvalidInputError(
            f"tensors must be a mapping of name -> tensor, got {type(tensors).__name__}"
        )
    entries = []
    keep_alive = []
    nbytes = 0
    for name, tensor in tensors.items():
        if not isinstance(name, str) or not is_text(name):
            raise InvalidInputError(f"tensor names must be str of valid Unicode, got {name!r}")
        host = host_tensor(name, tensor)
        keep_alive.append(host)
        shape = header_shape(name, host)
        entries.append((name, dtype_name(host.dtype), shape, byte_view(host)))
        nbytes += host.nbytes
    if direct_io is None:
        direct_io = choose_direct_io(nbytes)
    return _native.save_file(
        os.fspath(path),
        entries,
        _check_metadata(metadata),
        check_count(threads, "threads", DEFAULT_WRITE_THREADS, 1, MAX_THREADS),
        check_count(chunk_size, "chunk_size", DEFAULT_CHUNK_SIZE, MIN_CHUNK_SIZE, MAX_CHUNK_SIZE),
        direct_io,
        fsync,
        checksums,
        progress,
    )


def load_file(
    filename: str | os.PathLike[str] | None = None,
    device: str | int | torch.device = "cpu",
    *,
    path: str | os.PathLike[str] | None = None,
    backend: str = "mmap",
    verify: bool = True,
    threads: int | None = None,
) -> dict[str, torch.Tensor]:
    """Load every tensor of a safetensors file (written by fastckpt or by safetensors).

    With the default ``backend="mmap"`` the file is mapped privately and each tensor is a
    copy-on-write view of its bytes (as with ``safetensors.torch.load_file``); with
    ``verify``, the Rust core hashes the mapping on ``threads`` threads without the GIL, which
    is what reads the file in, and nothing is returned unless every checksum matched. Writing
    to a returned tensor never changes the file. Like any file mapping, the tensors see the
    file's bytes: replacing the file (as fastckpt's atomic saves do) is safe, editing or
    truncating it in place while they are alive is not; ``backend="pread"`` reads the file
    into private memory instead, so the tensors never depend on it afterwards.

    Tensors are created on the CPU whatever ``torch.set_default_device`` or a
    ``with torch.device(...)`` block says (as safetensors does), then moved to ``device``.

    Args:
        filename: the file (safetensors' name for it; ``path=`` is accepted too).
        device: where the returned tensors live (``"cpu"``, ``"cuda:0"``, a device index...).
        path: the file, by fastckpt's earlier keyword name (give one of the two).
        backend: ``"mmap"`` (default) or ``"pread"``, as in safetensors.
        verify: check crc32c checksums (files without them, e.g. from safetensors, load as-is).
        threads: reader threads (default :data:`DEFAULT_THREADS`).

    Returns:
        name -> tensor, in file order.

    Raises:
        CheckpointFormatError: malformed or truncated file, or not a regular file (names file
            and field).
        ChecksumMismatchError: corrupt tensor bytes (names file and tensor).
        InvalidInputError: a dtype this torch has no type for, an unknown ``backend``,
            ``threads`` out of range, ``verify`` not a bool, or a bytes path.
        FileNotFoundError: no such file.
    """
    check_flag(verify, "verify", "load_file")
    tensors, _ = read_tensors(
        _the_path(filename, path, "load_file"), verify=verify, threads=threads, backend=backend
    )
    target = torch.device(device)
    if target.type != "cpu":
        tensors = {name: t.to(target) for name, t in tensors.items()}
    return tensors


def _mapped(handle: Any, name: str, size: int) -> Any:
    """A private (copy-on-write) mapping of the open file, as an untyped CPU storage."""
    # Map the file this handle opened, not whatever the path names by now (a save may rename
    # a new file over it meanwhile).
    try:
        return torch.UntypedStorage.from_file(
            f"/proc/self/fd/{handle.fileno()}", shared=False, nbytes=size
        )
    except RuntimeError as err:
        raise _mapping_failed(name, err) from None


def _mapping_failed(name: str, err: RuntimeError) -> OSError:
    """torch's failure to map ``name`` as an ``OSError`` naming it, with the errno torch's
    message ends with (``... Too many open files (24)``) kept, so that callers can test it,
    and the fix for a lack of file descriptors (mapping opens the file a second time)."""
    # The first line only: with TORCH_SHOW_CPP_STACKTRACES=1 a C++ backtrace follows it
    # (review 2: the errno was lost again there).
    first_line = str(err).strip().splitlines()[0] if str(err).strip() else ""
    found = re.search(r"\((\d+)\)\s*$", first_line)
    if found is None:
        return OSError(f"{name}: cannot map the file for reading: {err}")
    code = int(found.group(1))
    why = os.strerror(code)
    if code in NO_DESCRIPTORS:
        why = f"{why}: {descriptor_advice(code)}"
    return OSError(code, f"{name}: cannot map the file for reading: {why}", name)


def _read_whole(handle: Any, name: str, size: int) -> Any:
    """The file's bytes read into fresh CPU memory (``backend="pread"``)."""
    buffer = torch.empty(size, dtype=torch.uint8, device="cpu")
    view = buffer.numpy().data
    done = 0
    while done < size:
        got = os.preadv(handle.fileno(), [view[done:]], done)
        if got == 0:
            raise CheckpointFormatError(
                f"{name}: the file shrank from {size} to {done} bytes while it was read"
            )
        done += got
    return buffer.untyped_storage()


def read_tensors(
    path: str | os.PathLike[str],
    *,
    verify: bool = True,
    threads: int | None = None,
    backend: str = "mmap",
    progress: _native.ByteCounter | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """:func:`load_file` on CPU that also returns ``{"metadata": ..., "file_crc32c": ...}``.

    With ``backend="mmap"`` the file is mapped privately (copy-on-write, like
    ``safetensors.torch.load_file``) and the returned tensors are views of that mapping:
    loading copies nothing, and hashing the mapping on ``threads`` threads is what reads the
    file in. Writing to a returned tensor changes only this process's copy of that page. With
    ``backend="pread"`` the file is read into private memory first. A tensor whose bytes are
    not aligned to its element size is copied.

    ``file_crc32c`` is the checksum of the whole file when ``verify`` is set, so callers
    holding a manifest can confirm it is the file they recorded. ``progress`` (a
    :class:`fastckpt._native.ByteCounter`) advances by the bytes hashed while verifying, which
    is when a mapped file is read in (it stays at 0 without ``verify``).
    """
    if backend not in BACKENDS:
        raise InvalidInputError(f"backend must be one of {BACKENDS}, got {backend!r}")
    threads_ = check_count(threads, "threads", DEFAULT_THREADS, 1, MAX_THREADS)
    name = os.fspath(path)
    storage: Any = torch.UntypedStorage(0, device="cpu")
    # A regular file or a typed error at once (FIFOs and devices are refused without blocking
    # or reading); FileNotFoundError / PermissionError keep their types.
    with os.fdopen(_native.open_regular(name), "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        if size:
            read = _mapped if backend == "mmap" else _read_whole
            storage = read(handle, name, size)
    # Explicitly on the CPU: a `with torch.device("meta")` block or set_default_device must
    # not move the empty tensors the file's storage is attached to.
    flat = torch.empty(0, dtype=torch.uint8, device="cpu").set_(storage)
    header = _native.check_mapped(name, byte_view(flat), verify, threads_, progress)
    start = header["data_start"]
    tensors: dict[str, torch.Tensor] = {}
    for entry in header["tensors"]:
        dtype = dtype_from_name(entry["dtype"])
        shape = torch_shape(f"{name}: tensor {entry['name']!r}", entry["dtype"], entry["shape"])
        begin, end = entry["data_offsets"]
        # Each tensor gets its own storage starting at its first byte (a slice that keeps the
        # mapping alive), not an offset into the file's: some torch APIs, e.g.
        # torch.set_rng_state, ignore storage offsets.
        data = torch.empty(0, dtype=torch.uint8, device="cpu").set_(
            storage[start + begin : start + end]
        )
        if (start + begin) % dtype.itemsize:
            data = data.clone()
        tensors[entry["name"]] = data.view(dtype).reshape(shape)
    return tensors, {"metadata": header["metadata"], "file_crc32c": header["file_crc32c"]}
