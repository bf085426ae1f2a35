"""Module paths of earlier releases: the table the old import paths (:mod:`fastckpt._moved`)
and the readers of class paths recorded in checkpoints share. A private module of the bottom
layer, so that ``import fastckpt`` (which installs the old paths) imports no package of it.

Checkpoints record the dotted paths of fastckpt's own classes (a hook's state is matched to
the hook by it, ``fastckpt export --model ema`` finds the EMA by it). Those written before the
package took its layered layout name the old modules (``fastckpt.hooks.ema.EMAHook``):
:func:`current_path` gives each its path today, so they still load.
"""

from __future__ import annotations

__all__ = ["MOVED", "SPLIT", "current_path"]

#: Old module path -> the module that now holds it (docs/architecture.md).
MOVED: dict[str, str] = {
    "fastckpt.headers": "fastckpt.io.headers",
    "fastckpt.files": "fastckpt.io.files",
    "fastckpt.file_images": "fastckpt.io.images",
    "fastckpt.tree": "fastckpt.io.tree",
    "fastckpt.progress": "fastckpt.io.progress",
    "fastckpt.staging": "fastckpt.io.staging",
    "fastckpt.store.paths": "fastckpt.io.paths",
    "fastckpt.format.paths": "fastckpt.io.paths",
    "fastckpt.store.records": "fastckpt.format.records",
    "fastckpt.dcp.metadata": "fastckpt.format.sharded",
    "fastckpt.dcp.errors": "fastckpt.errors",
    "fastckpt.store.backend": "fastckpt.storage.backend",
    "fastckpt.store.dispatch": "fastckpt.storage.registry",
    "fastckpt.store.lock": "fastckpt.storage.lock",
    "fastckpt.store.s3config": "fastckpt.storage.s3.config",
    "fastckpt.store.s3errors": "fastckpt.storage.s3.errors",
    "fastckpt.store.s3client": "fastckpt.storage.s3.client",
    "fastckpt.store.s3tensors": "fastckpt.storage.s3.tensors",
    "fastckpt.store.s3copy": "fastckpt.storage.s3.copy",
    "fastckpt.store.s3backend": "fastckpt.storage.s3.backend",
    "fastckpt.store.commit": "fastckpt.container.commit",
    "fastckpt.store.reader": "fastckpt.container.reader",
    "fastckpt.store.snapshot": "fastckpt.container.snapshot",
    "fastckpt.store.refs": "fastckpt.container.refs",
    "fastckpt.store.links": "fastckpt.container.links",
    "fastckpt.store.listing": "fastckpt.container.listing",
    "fastckpt.store.locate": "fastckpt.container.locate",
    "fastckpt.store.report": "fastckpt.container.report",
    "fastckpt.verify": "fastckpt.container.verify",
    "fastckpt.lazy": "fastckpt.container.lazy",
    "fastckpt.diff": "fastckpt.container.diff",
    "fastckpt.incremental": "fastckpt.container.incremental",
    "fastckpt.dcp.commit": "fastckpt.container.sharded.commit",
    "fastckpt.dcp.parts": "fastckpt.container.sharded.parts",
    "fastckpt.dcp.chunks": "fastckpt.container.sharded.chunks",
    "fastckpt.dcp.values": "fastckpt.container.sharded.values",
    "fastckpt.components": "fastckpt.checkpoint.components",
    "fastckpt.containers": "fastckpt.checkpoint.containers",
    "fastckpt.stateful": "fastckpt.manager.stateful",
    "fastckpt.manager_config": "fastckpt.manager.config",
    "fastckpt.manager_callbacks": "fastckpt.manager.callbacks",
    "fastckpt.manager_incremental": "fastckpt.manager.incremental",
    "fastckpt.manager_load": "fastckpt.manager.load",
    "fastckpt.strategy": "fastckpt.training.strategy",
    "fastckpt.sharded_training": "fastckpt.training.sharded",
    "fastckpt.hooks": "fastckpt.training.hooks",
    "fastckpt.hooks.checkpoint": "fastckpt.training.hooks.checkpoint",
    "fastckpt.hooks.context": "fastckpt.training.hooks.context",
    "fastckpt.hooks.ema": "fastckpt.training.hooks.ema",
    "fastckpt.hooks.rebuild": "fastckpt.training.hooks.rebuild",
}

#: Old module paths whose names now live in several modules (``specs.py`` was split along its
#: concepts): the old path is a view that finds each name in the first module defining it.
SPLIT: dict[str, tuple[str, ...]] = {
    "fastckpt.specs": (
        "fastckpt.checkpoint.specs",
        "fastckpt.checkpoint.trust",
        "fastckpt.checkpoint.values",
        "fastckpt.checkpoint.build",
    ),
}


def current_path(dotted: str) -> str:
    """``dotted`` (a ``module.Class`` path a checkpoint recorded) with a module of an earlier
    release replaced by the one that holds it now (the longest moved prefix wins); any other
    path as it is. ``fastckpt.hooks.ema.EMAHook`` -> ``fastckpt.training.hooks.ema.EMAHook``."""
    module = dotted.rpartition(".")[0]
    while module:
        moved = MOVED.get(module)
        if moved is not None:
            return f"{moved}{dotted[len(module) :]}"
        module = module.rpartition(".")[0]
    return dotted
