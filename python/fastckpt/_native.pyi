"""Type stubs for the Rust extension ``fastckpt._native`` (see rust/py_api.rs)."""

from collections.abc import Sequence
from typing import Any

#: Marker in the name of every temporary sibling the core creates (see ``temp_prefix``).
TEMP_MARKER: str
#: Default bytes per write chunk (the one definition; ``fastckpt.io.files`` re-exports it).
DEFAULT_CHUNK_SIZE: int
#: Default writer threads (the one definition; ``fastckpt.io.files`` re-exports it).
DEFAULT_WRITE_THREADS: int
#: Files from this size are written with O_DIRECT by default and verified with O_DIRECT reads.
DIRECT_IO_MIN_BYTES: int
STALE_CHECKSUMS_HINT: str

class ByteCounter:
    """Bytes of tensor data the core has written, read or hashed so far (thread-safe)."""

    def __init__(self) -> None: ...
    @property
    def value(self) -> int: ...

def save_file(
    path: str,
    tensors: Sequence[tuple[str, str, Sequence[int], Any]],
    metadata: dict[str, str],
    threads: int,
    chunk_size: int,
    direct_io: bool,
    fsync: bool,
    checksums: bool = True,
    progress: ByteCounter | None = None,
) -> dict[str, Any]: ...
def check_mapped(
    path: str, data: Any, verify: bool, threads: int, progress: ByteCounter | None = None
) -> dict[str, Any]: ...
def read_header(path: str, follow_symlinks: bool = True) -> dict[str, Any]: ...
def verify_file(
    path: str, threads: int, follow_symlinks: bool = True, progress: ByteCounter | None = None
) -> tuple[int, list[str]]: ...
def read_into(
    path: str,
    tensors: Sequence[tuple[str, str, Sequence[int], Any]],
    threads: int,
    follow_symlinks: bool = True,
    progress: ByteCounter | None = None,
    fresh: set[str] | None = None,
) -> int: ...
def open_regular(path: str, follow_symlinks: bool = True) -> int: ...
def crc32c(data: Any, value: int = 0) -> int: ...
def crc32c_combine(crc_a: int, crc_b: int, len_b: int) -> int: ...
def digests(buffers: Sequence[Any], threads: int = 2) -> list[bytes]: ...
def encode_header(
    tensors: Sequence[tuple[str, str, Sequence[int]]],
    metadata: dict[str, str],
    checksums: dict[str, int] | None = None,
) -> tuple[bytes, list[tuple[str, int, int]]]: ...
def image_layout(
    tensors: Sequence[tuple[str, str, Sequence[int]]],
    metadata: dict[str, str],
    checksums: bool = True,
) -> tuple[int, int, list[tuple[str, int, int]]]: ...
def write_image(
    path: str,
    tensors: Sequence[tuple[str, str, Sequence[int]]],
    image: Any,
    data_start: int,
    metadata: dict[str, str],
    chunk_size: int,
    direct_io: bool,
    fsync: bool,
    checksums: bool = True,
    progress: ByteCounter | None = None,
    threads: int = ...,
) -> dict[str, Any]: ...
def write_bytes_atomic(path: str, data: bytes, fsync: bool = True) -> None: ...
def fsync_dir(path: str) -> None: ...
def write_ceiling(path: str, length: int, block: int) -> bool: ...
def temp_prefix(file_name: str) -> str: ...
