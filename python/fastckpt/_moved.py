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

from fastckpt._moved_paths import MOVED, SPLIT

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
