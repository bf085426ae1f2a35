"""Checkpoints of training components: ``save_checkpoint`` / ``load_checkpoint`` /
``list_checkpoints`` / ``prune`` (:mod:`fastckpt.checkpoint.api`), the components' files
(:mod:`~fastckpt.checkpoint.components`) and model specs (:mod:`~fastckpt.checkpoint.specs`).

The names load on first use, so importing a submodule does not import the whole package.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastckpt._exports import lazy_exports

if TYPE_CHECKING:
    from fastckpt.checkpoint.api import (
        list_checkpoints,
        load_checkpoint,
        prune,
        save_checkpoint,
    )

__getattr__, __dir__ = lazy_exports(
    globals(),
    {
        "fastckpt.checkpoint.api": (
            "list_checkpoints",
            "load_checkpoint",
            "prune",
            "save_checkpoint",
        )
    },
)

__all__ = ["list_checkpoints", "load_checkpoint", "prune", "save_checkpoint"]
