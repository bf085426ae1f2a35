"""Type stubs for the Rust extension ``fastckpt._native`` (see rust/py_api.rs)."""

from collections.abc import Sequence
from typing import Any

#: Marker in the name of every temporary sibling the core creates (see ``temp_prefix``).
TEMP_MARKER: str
#: Default bytes per write chunk (the one definition; ``fastckpt.files`` re-exports it).
DEFAULT_CHUNK_SIZE: int
#: Default writer threads (the one definition; ``fastckpt.files`` re-exports it).
DEFAULT_WRITE_THREADS: int

def save_file(
    path: str,
    tensors: Sequence[tuple[str, str, Sequence[int], Any]],
    metadata: dict[str, str],
    threads: int,
    chunk_size: int,
    direct_io: bool,
    fsync: bool,
    checksums: bool = True,
) -> dict[str, Any]: ...
def check_mapped(path: str, data: Any, verify: bool, threads: int) -> dict[str, Any]: ...
def read_header(path: str) -> dict[str, Any]: ...
def verify_file(path: str, threads: int) -> tuple[int, list[str]]: ...
def crc32c(data: bytes, value: int = 0) -> int: ...
def write_bytes_atomic(path: str, data: bytes, fsync: bool = True) -> None: ...
def fsync_dir(path: str) -> None: ...
def write_ceiling(path: str, length: int, block: int) -> bool: ...
def temp_prefix(file_name: str) -> str: ...
