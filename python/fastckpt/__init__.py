"""fastckpt: fast, durable, crash-safe checkpoints for PyTorch training.

Files are safetensors-compatible and carry crc32c checksums; the I/O runs in a Rust extension
with the GIL released. Start with :func:`save_file` / :func:`load_file`.
"""

from __future__ import annotations

import importlib
import os
import sys
import types
from typing import TYPE_CHECKING, Any

from fastckpt import _moved

_moved.install()  # earlier releases' module paths (fastckpt.files, fastckpt.store.commit, ...)

if TYPE_CHECKING:  # the names below, for type checkers; at run time they load on first use
    __version__: str
    from fastckpt.checkpoint.api import load_checkpoint, prune, save_checkpoint
    from fastckpt.checkpoint.specs import BaseSpec, create_model_spec
    from fastckpt.checkpoint.values import register_type_serializer
    from fastckpt.container.incremental import mark_frozen, unmark_frozen
    from fastckpt.container.lazy import SafeOpen, TensorSlice, safe_open
    from fastckpt.container.listing import list_checkpoints
    from fastckpt.container.verify import VerifyReport, latest_intact, verify
    from fastckpt.errors import (
        CheckpointFormatError,
        CheckpointMismatchError,
        ChecksumMismatchError,
        FastCkptError,
        InvalidInputError,
        MixedRunError,
        NotACheckpointError,
        UntrustedTargetError,
    )
    from fastckpt.io.files import load_file, read_metadata, save_file
    from fastckpt.manager import (
        AsyncCheckpointSaverConfig,
        CheckpointLoaderConfig,
        CheckpointManager,
        CheckpointStagerConfig,
        CheckpointWriterConfig,
        ItemSpec,
        LocalFileSystemStorageConfig,
        SyncCheckpointSaverConfig,
        TiersConfig,
    )
    from fastckpt.storage.registry import configure_storage
    from fastckpt.training.hooks import (
        CheckpointableHook,
        CheckpointHook,
        EMAHook,
        Hook,
        TrainContext,
        TrainingStage,
    )
    from fastckpt.training.strategy import FineTuningStrategy, OptimizerConfig, TrainingStrategy

#: Where each public name lives. ``import fastckpt`` imports none of them (so ``fastckpt
#: --version`` and ``--help`` never import torch); the first use of a name imports its module.
_NAMES = {
    "fastckpt.checkpoint.api": ("load_checkpoint", "prune", "save_checkpoint"),
    "fastckpt.errors": (
        "CheckpointFormatError",
        "CheckpointMismatchError",
        "ChecksumMismatchError",
        "FastCkptError",
        "InvalidInputError",
        "MixedRunError",
        "NotACheckpointError",
        "UntrustedTargetError",
    ),
    "fastckpt.io.files": ("load_file", "read_metadata", "save_file"),
    "fastckpt.training.hooks": (
        "CheckpointableHook",
        "CheckpointHook",
        "EMAHook",
        "Hook",
        "TrainContext",
        "TrainingStage",
    ),
    "fastckpt.container.incremental": ("mark_frozen", "unmark_frozen"),
    "fastckpt.container.lazy": ("SafeOpen", "TensorSlice", "safe_open"),
    "fastckpt.manager": (
        "AsyncCheckpointSaverConfig",
        "CheckpointLoaderConfig",
        "CheckpointManager",
        "CheckpointStagerConfig",
        "CheckpointWriterConfig",
        "ItemSpec",
        "LocalFileSystemStorageConfig",
        "SyncCheckpointSaverConfig",
        "TiersConfig",
    ),
    "fastckpt.checkpoint.specs": ("BaseSpec", "create_model_spec"),
    "fastckpt.checkpoint.values": ("register_type_serializer",),
    "fastckpt.storage.registry": ("configure_storage",),
    "fastckpt.container.listing": ("list_checkpoints",),
    "fastckpt.training.strategy": ("FineTuningStrategy", "OptimizerConfig", "TrainingStrategy"),
    "fastckpt.verify": ("VerifyReport", "latest_intact", "verify"),
}
_MODULE_OF = {name: module for module, names in _NAMES.items() for name in names}

#: The extension, reachable as ``fastckpt._native`` like the public submodules below.
_PRIVATE_SUBMODULES = ("_native",)


def _public_submodules() -> tuple[str, ...]:
    """The package's public submodules (``errors``, ``specs``, ``store``, ``dcp``, ...).

    Read from the package's directory (a listing, no import), so that a new module is
    reachable as ``fastckpt.<name>`` without being registered here.
    """
    names = set()
    for directory in __path__:
        for entry in os.scandir(directory):
            name = entry.name
            if entry.is_dir() and os.path.isfile(os.path.join(entry.path, "__init__.py")):
                names.add(name)
            elif name.endswith(".py") and entry.is_file():
                names.add(name.removesuffix(".py"))
    return tuple(sorted(name for name in names if not name.startswith("_")))


#: Every submodule is an attribute of the package, imported on first use: ``import fastckpt``
#: imports none of them (``fastckpt.dcp`` pulls in torch.distributed.checkpoint, which most
#: users never need), and ``fastckpt.errors.FastCkptError`` works without ``import
#: fastckpt.errors``. Where a public name and a submodule share a name (``verify``), the
#: attribute is the public name; the module stays importable as ``fastckpt.verify``.
_SUBMODULES = _public_submodules()
_LAZY_SUBMODULES = (
    frozenset(_SUBMODULES + _PRIVATE_SUBMODULES + _moved.TOP_LEVEL) - _MODULE_OF.keys()
)


def __getattr__(name: str) -> Any:
    """Import a public name's module, or a submodule, when the name is first used."""
    module = _MODULE_OF.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value  # later lookups skip this function
        return value
    if name == "__version__":
        value = _installed_version()
        globals()[name] = value
        return value
    if name in _LAZY_SUBMODULES:
        # Importing binds the submodule as an attribute of the package, so this runs once.
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'fastckpt' has no attribute {name!r}")


class _Package(types.ModuleType):
    """The package's module type: a public name wins over a submodule of the same name.

    Importing a submodule binds it as an attribute of its package, so the first
    ``import fastckpt.verify`` anywhere would replace the function ``fastckpt.verify`` by the
    module ``fastckpt.verify``; the public name must keep meaning the function.
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _MODULE_OF and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __dir__() -> list[str]:
    """The public names and the submodules, as ``dir(fastckpt)`` should list them."""
    return sorted({*globals(), *_MODULE_OF, *_SUBMODULES, *_moved.TOP_LEVEL, "__version__"})


def _installed_version() -> str:
    """The installed distribution's version (``fastckpt.__version__``), read on first use:
    importlib.metadata alone costs about 40 ms of every start-up (the CLI's included)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fastckpt-io")
    except PackageNotFoundError:  # running from a source tree without an install
        return "0.0.0"


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
    "MixedRunError",
    "NotACheckpointError",
    "OptimizerConfig",
    "SafeOpen",
    "SyncCheckpointSaverConfig",
    "TensorSlice",
    "TiersConfig",
    "TrainContext",
    "TrainingStage",
    "TrainingStrategy",
    "UntrustedTargetError",
    "VerifyReport",
    "__version__",
    "configure_storage",
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
    "unmark_frozen",
    "verify",
]
