"""Seed-style import path: ``from fastckpt.training import TrainingStrategy, CheckpointHook``."""

from fastckpt.checkpoint import load_checkpoint, save_checkpoint
from fastckpt.hooks import CheckpointHook, EMAHook
from fastckpt.specs import BaseSpec, create_model_spec, register_type_serializer
from fastckpt.strategy import FineTuningStrategy, OptimizerConfig, TrainingStrategy

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
