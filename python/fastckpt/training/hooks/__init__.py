"""Training hooks: the stages and context they see, the protocols, and the built-in hooks."""

from fastckpt.training.hooks.checkpoint import CheckpointHook
from fastckpt.training.hooks.context import (
    CheckpointableHook,
    Hook,
    MutationGuard,
    TrainContext,
    TrainingStage,
)
from fastckpt.training.hooks.ema import EMAHook

__all__ = [
    "CheckpointHook",
    "CheckpointableHook",
    "EMAHook",
    "Hook",
    "MutationGuard",
    "TrainContext",
    "TrainingStage",
]
