"""The package's layers, bottom to top, and the rule that a module imports only from its own
layer or below (docs/architecture.md).

Every module of ``python/fastckpt`` is assigned to a layer by :data:`LAYERS` (the longest
matching prefix wins), and every ``import`` of a fastckpt module in it, at module level or
inside a function, is checked. :data:`KNOWN_UPWARD` lists the imports that still point up; the
test fails on any other upward import, on a module no layer claims, and on a listed import
that no longer exists (so the list only shrinks).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "python" / "fastckpt"

#: Bottom to top: (layer, the modules and packages it holds).
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "io: one file or one nest of tensors at a time",
        (
            "fastckpt._native",
            "fastckpt._exports",
            "fastckpt._moved_paths",
            "fastckpt.errors",
            "fastckpt.version",
            "fastckpt.io",
        ),
    ),
    # Storage knows bytes, paths and its own temporary names, nothing of checkpoints; the
    # format reads and writes its records through a storage backend.
    ("storage: where bytes live (local disk, object stores)", ("fastckpt.storage",)),
    ("format: on-disk names and records", ("fastckpt.format",)),
    ("container: a committed set of files, written, read, verified", ("fastckpt.container",)),
    (
        "front doors: what training code calls",
        (
            "fastckpt.checkpoint",
            "fastckpt.manager",
            "fastckpt.training",
            "fastckpt.dcp",
            "fastckpt.integrations",
        ),
    ),
    (
        "clients: the package face (and the old module paths), the command line, the "
        "benchmark, the demo",
        ("fastckpt", "fastckpt.cli", "fastckpt.bench", "fastckpt.demo"),
    ),
)

#: Imports that still point up a layer: (importer, imported). Fix one, then delete it here.
KNOWN_UPWARD: frozenset[tuple[str, str]] = frozenset()


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    found["fastckpt._native"] = PACKAGE / "_native.pyi"
    return found


def layer_of(module: str) -> int | None:
    """The index in :data:`LAYERS` of the longest prefix that claims ``module``."""
    best: tuple[int, int] | None = None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (
                best is None or len(prefix) > best[1]
            ):
                best = (index, len(prefix))
    return None if best is None else best[0]


def _imported(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The fastckpt modules ``module`` imports anywhere in its file."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            candidates = [
                f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
                for alias in node.names
            ]
        else:
            continue
        for name in candidates:
            while name not in modules and "." in name:
                name = name.rsplit(".", 1)[0]
            if name in modules and name != module:
                targets.add(name)
    return targets


def _upward() -> set[tuple[str, str]]:
    modules = _modules()
    found = set()
    for module, path in modules.items():
        if path.suffix != ".py":
            continue
        for target in _imported(module, path, modules):
            if layer_of(target) > layer_of(module):  # type: ignore[operator]
                found.add((module, target))
    return found


def test_every_module_has_a_layer() -> None:
    assert sorted(m for m in _modules() if layer_of(m) is None) == []


def test_modules_import_only_from_their_layer_or_below() -> None:
    new = sorted(_upward() - KNOWN_UPWARD)
    assert new == [], (
        "imports that point up a layer (see docs/architecture.md; move the code to the layer "
        f"it belongs to, or invert the dependency): {new}"
    )


def test_the_known_upward_imports_still_exist() -> None:
    """A fixed one must leave :data:`KNOWN_UPWARD`, so the list states the debt exactly."""
    assert sorted(KNOWN_UPWARD - _upward()) == []


def test_the_checker_sees_an_upward_import(tmp_path: Path) -> None:
    """The check is not vacuous: an io module importing a front door, at module level or
    inside a function, relatively or absolutely, is seen and is upward."""
    probe = tmp_path / "files.py"
    probe.write_text(
        "from fastckpt.manager import CheckpointManager\n"
        "def f():\n"
        "    from ..training.strategy import TrainingStrategy\n"
        "    import fastckpt.cli.main\n"
    )
    seen = _imported("fastckpt.io.files", probe, _modules())
    assert {"fastckpt.manager", "fastckpt.training.strategy", "fastckpt.cli.main"} <= seen
    assert all(layer_of(target) > layer_of("fastckpt.io.files") for target in seen)  # type: ignore[operator]
