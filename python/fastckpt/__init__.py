"""fastckpt: fast, durable, crash-safe checkpoints for PyTorch training.

Files are safetensors-compatible and carry crc32c checksums; the I/O runs in a Rust extension
with the GIL released. Start with :func:`save_file` / :func:`load_file`.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from fastckpt.checkpoint import list_checkpoints, load_checkpoint, prune, save_checkpoint
from fastckpt.errors import (
    CheckpointFormatError,
    CheckpointMismatchError,
    ChecksumMismatchError,
    FastCkptError,
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
    "ItemSpec",
    "LocalFileSystemStorageConfig",
    "OptimizerConfig",
    "SyncCheckpointSaverConfig",
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
    "prune",
    "read_metadata",
    "register_type_serializer",
    "save_checkpoint",
    "save_file",
    "verify",
]
