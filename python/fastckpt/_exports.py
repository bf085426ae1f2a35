"""Lazy re-exports for a package's ``__init__``: a name is imported from its module on first use.

A package whose ``__init__`` imported its modules eagerly would run the whole package (and
torch) for any import of one of its submodules, and would turn a submodule importing a
sibling package into an import cycle. :func:`lazy_exports` gives the ``__init__`` the
``__getattr__`` and ``__dir__`` of PEP 562 instead.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(
    namespace: dict[str, Any], names: Mapping[str, tuple[str, ...]]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for a package whose ``__init__`` has ``namespace`` as its
    globals, exporting each module's ``names`` (``{"fastckpt.x.y": ("A", "b")}``)."""
    module_of = {name: module for module, exported in names.items() for name in exported}

    def __getattr__(name: str) -> Any:
        module = module_of.get(name)
        if module is None:
            raise AttributeError(f"module {namespace['__name__']!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value  # later lookups skip this function
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *module_of})

    return __getattr__, __dir__
