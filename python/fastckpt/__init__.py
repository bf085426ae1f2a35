"""fastckpt: fast, durable, crash-safe checkpoints for PyTorch training.

Files are safetensors-compatible and carry crc32c checksums; the I/O runs in a Rust extension
with the GIL released. Start with :func:`save_file` / :func:`load_file`.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from fastckpt.checkpoint import list_checkpoints, load_checkpoint, prune, save_checkpoint
from fastckpt.errors import (
    CheckpointFormatError,
    CheckpointMismatchError,
    ChecksumMismatchError,
    FastCkptError,
    InvalidInputError,
    UntrustedTargetError,
)
from fastckpt.files import load_file, read_metadata, save_file
from fastckpt.hooks import (
    CheckpointableHook,
    CheckpointHook,
    EMAHook,
    Hook,
    TrainContext,
    TrainingStage,
)
from fastckpt.incremental import mark_frozen
from fastckpt.lazy import SafeOpen, TensorSlice, safe_open
from fastckpt.manager import (
    AsyncCheckpointSaverConfig,
    CheckpointLoaderConfig,
    CheckpointManager,
    CheckpointStagerConfig,
    CheckpointWriterConfig,
    ItemSpec,
    LocalFileSystemStorageConfig,
    SyncCheckpointSaverConfig,
)
from fastckpt.specs import BaseSpec, create_model_spec, register_type_serializer
from fastckpt.strategy import FineTuningStrategy, OptimizerConfig, TrainingStrategy
from fastckpt.verify import VerifyReport, latest_intact, verify

#: Subpackages imported on first attribute access (``fastckpt.dcp``): each costs import time
#: (DCP pulls in torch.distributed.checkpoint) that most users of the package never need.
_LAZY_SUBMODULES = ("dcp", "integrations")


def __getattr__(name: str) -> Any:
    """Import :mod:`fastckpt.dcp` / :mod:`fastckpt.integrations` when first used."""
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f"fastckpt.{name}")
    raise AttributeError(f"module 'fastckpt' has no attribute {name!r}")


try:
    __version__ = version("fastckpt-io")
except PackageNotFoundError:  # running from a source tree without an install
    __version__ = "0.0.0"

__all__ = [
    "AsyncCheckpointSaverConfig",
    "BaseSpec",
    "CheckpointFormatError",
    "CheckpointHook",
    "CheckpointLoaderConfig",
    "CheckpointManager",
    "CheckpointMismatchError",
    "CheckpointStagerConfig",
    "CheckpointWriterConfig",
    "CheckpointableHook",
    "ChecksumMismatchError",
    "EMAHook",
    "FastCkptError",
    "FineTuningStrategy",
    "Hook",
    "InvalidInputError",
    "ItemSpec",
    "LocalFileSystemStorageConfig",
    "OptimizerConfig",
    "SafeOpen",
    "SyncCheckpointSaverConfig",
    "TensorSlice",
    "TrainContext",
    "TrainingStage",
    "TrainingStrategy",
    "UntrustedTargetError",
    "VerifyReport",
    "__version__",
    "create_model_spec",
    "latest_intact",
    "list_checkpoints",
    "load_checkpoint",
    "load_file",
    "mark_frozen",
    "prune",
    "read_metadata",
    "register_type_serializer",
    "safe_open",
    "save_checkpoint",
    "save_file",
    "verify",
]
