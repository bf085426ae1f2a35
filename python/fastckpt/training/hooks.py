"""Seed-style import path: ``from fastckpt.training.hooks import CheckpointHook, EMAHook``."""

from fastckpt.hooks import CheckpointHook, EMAHook

__all__ = ["CheckpointHook", "EMAHook"]
