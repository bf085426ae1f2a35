"""fastckpt: fast, durable, crash-safe checkpoints for PyTorch training.

Files are safetensors-compatible and carry crc32c checksums; the I/O runs in a Rust extension
with the GIL released. Start with :func:`save_file` / :func:`load_file`.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from fastckpt.errors import (
    CheckpointFormatError,
    CheckpointMismatchError,
    ChecksumMismatchError,
    FastCkptError,
    UntrustedTargetError,
)
from fastckpt.files import load_file, read_metadata, save_file

try:
    __version__ = version("fastckpt")
except PackageNotFoundError:  # running from a source tree without an install
    __version__ = "0.0.0"

__all__ = [
    "CheckpointFormatError",
    "CheckpointMismatchError",
    "ChecksumMismatchError",
    "FastCkptError",
    "UntrustedTargetError",
    "__version__",
    "load_file",
    "read_metadata",
    "save_file",
]
