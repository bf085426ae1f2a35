"""Module paths of earlier releases, kept working after the package took its layered layout.

``import fastckpt.files`` (or ``fastckpt.store.commit``, ``fastckpt.strategy``, ...) gives
the module at its new path itself, not a copy: the same functions and classes, and a
``monkeypatch`` through either path changes both. :data:`MOVED` is the whole table; the
finder answers only for the names in it, so nothing else's import is slowed or changed.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Sequence
from typing import Any

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

#: The old top-level names, reachable as attributes of ``fastckpt`` like any submodule.
TOP_LEVEL: tuple[str, ...] = tuple(
    sorted({old.split(".")[1] for old in [*MOVED, *SPLIT] if old.count(".") == 1})
)


class _Alias(importlib.abc.Loader):
    """Loads an old path by putting the new module under the old name in ``sys.modules``."""

    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return None  # a placeholder; exec_module replaces it

    def exec_module(self, module: types.ModuleType) -> None:
        # The import system returns whatever sys.modules holds under the name afterwards.
        sys.modules[module.__name__] = importlib.import_module(self.target)


class _SplitModule(types.ModuleType):
    """An old module path whose names moved to several modules: reading a name finds it in
    the first module that has it, and setting one (a ``monkeypatch``) sets it there."""

    def __init__(self, name: str, parts: tuple[str, ...]) -> None:
        super().__init__(name)
        object.__setattr__(self, "_parts", tuple(importlib.import_module(p) for p in parts))

    def _owner(self, name: str) -> types.ModuleType | None:
        return next((part for part in self._parts if hasattr(part, name)), None)

    def __getattr__(self, name: str) -> Any:
        owner = self._owner(name)
        if owner is None:
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")
        return getattr(owner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        owner = self._owner(name) if not name.startswith("__") else None
        setattr(owner if owner is not None else super(), name, value)

    def __delattr__(self, name: str) -> None:
        owner = self._owner(name)
        if owner is None:
            raise AttributeError(name)
        delattr(owner, name)

    def __dir__(self) -> list[str]:
        return sorted({name for part in self._parts for name in dir(part)})


class _Split(importlib.abc.Loader):
    """Loads an old path of :data:`SPLIT` as a :class:`_SplitModule`."""

    def __init__(self, parts: tuple[str, ...]) -> None:
        self.parts = parts

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _SplitModule(spec.name, self.parts)

    def exec_module(self, module: types.ModuleType) -> None:
        pass  # the view reads the parts; nothing to run


class MovedModules(importlib.abc.MetaPathFinder):
    """The finder for :data:`MOVED`, installed once by ``import fastckpt``."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        new = MOVED.get(fullname)
        if new is not None:
            return importlib.machinery.ModuleSpec(fullname, _Alias(new))
        parts = SPLIT.get(fullname)
        if parts is not None:
            return importlib.machinery.ModuleSpec(fullname, _Split(parts))
        return None


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once): an old package path such as
    ``fastckpt.hooks`` is the new package, so its old submodule names must be answered
    here before the path finder would load the files a second time under the old names."""
    if not any(isinstance(finder, MovedModules) for finder in sys.meta_path):
        sys.meta_path.insert(0, MovedModules())
