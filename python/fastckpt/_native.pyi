"""Type stubs for the Rust extension ``fastckpt._native`` (see rust/py_api.rs)."""

from collections.abc import Callable, Sequence
from typing import Any

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
def load_into(
    path: str,
    allocate: Callable[[str, str, list[int]], Any],
    verify: bool,
    threads: int,
) -> dict[str, Any]: ...
def read_header(path: str) -> dict[str, Any]: ...
def verify_file(path: str, threads: int) -> tuple[int, list[str]]: ...
def crc32c(data: bytes, value: int = 0) -> int: ...
def write_bytes_atomic(path: str, data: bytes, fsync: bool = True) -> None: ...
def fsync_dir(path: str) -> None: ...
def write_ceiling(path: str, length: int, block: int) -> bool: ...
