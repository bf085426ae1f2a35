"""Training: the strategy, its hooks and the FSDP2 part; also the seed-style import path
``from fastckpt.training import TrainingStrategy, CheckpointHook``.

The names load on first use, so importing a submodule does not import the whole package.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastckpt._exports import lazy_exports

if TYPE_CHECKING:
    from fastckpt.checkpoint.api import load_checkpoint, save_checkpoint
    from fastckpt.checkpoint.specs import BaseSpec, create_model_spec, register_type_serializer
    from fastckpt.training.hooks import CheckpointHook, EMAHook
    from fastckpt.training.strategy import FineTuningStrategy, OptimizerConfig, TrainingStrategy

__getattr__, __dir__ = lazy_exports(
    globals(),
    {
        "fastckpt.checkpoint.api": ("load_checkpoint", "save_checkpoint"),
        "fastckpt.checkpoint.specs": ("BaseSpec", "create_model_spec", "register_type_serializer"),
        "fastckpt.training.hooks": ("CheckpointHook", "EMAHook"),
        "fastckpt.training.strategy": ("FineTuningStrategy", "OptimizerConfig", "TrainingStrategy"),
    },
)

__all__ = [
    "BaseSpec",
    "CheckpointHook",
    "EMAHook",
    "FineTuningStrategy",
    "OptimizerConfig",
    "TrainingStrategy",
    "create_model_spec",
    "load_checkpoint",
    "register_type_serializer",
    "save_checkpoint",
]
