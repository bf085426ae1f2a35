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
) -> dict[str, Any]: ...
def load_into(
    path: str,
    allocate: Callable[[str, str, list[int]], Any],
    verify: bool,
    threads: int,
) -> dict[str, str]: ...
def read_header(path: str) -> dict[str, Any]: ...
def verify_file(path: str, threads: int) -> list[str]: ...
def write_bytes_atomic(path: str, data: bytes, fsync: bool = True) -> None: ...
def fsync_dir(path: str) -> None: ...
def write_ceiling(path: str, length: int, block: int) -> bool: ...
