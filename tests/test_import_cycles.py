"""The package has no import cycles: every module sits above what it imports.

Imports are read with ``ast`` from every module of ``python/fastckpt``, at module level and
inside functions alike (a function-level import is still a dependency, only a deferred one).
An import under ``if TYPE_CHECKING:`` never runs (a package face such as
``fastckpt/checkpoint/__init__.py`` names its lazily loaded exports there for type checkers),
so it is not an edge.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "python" / "fastckpt"


def module_names(package: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file below ``package``."""
    modules = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _is_type_checking(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _run_time_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node of ``tree`` except the bodies of ``if TYPE_CHECKING:`` blocks."""
    found: list[ast.AST] = []
    pending: list[ast.AST] = [tree]
    while pending:
        node = pending.pop()
        found.append(node)
        for child in ast.iter_child_nodes(node):
            if _is_type_checking(child):
                assert isinstance(child, ast.If)
                pending.extend(child.orelse)
            else:
                pending.append(child)
    return found


def imported(name: str, path: Path) -> set[str]:
    """Every dotted name ``name`` (in ``path``) imports, relative imports resolved."""
    found: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in _run_time_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def dependency_graph(package: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports.

    Importing ``a.b.c`` also runs ``a/b/__init__.py``, so a subpackage is an edge too. A
    module's own parent packages (already being imported when it runs) and the top package,
    whose ``__init__`` is only its public face, are not edges.
    """
    modules = module_names(package)
    root = package.name
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for target in imported(name, path):
            while target and target not in modules:
                target = target.rpartition(".")[0]
            while target and target != root:
                if target != name and not name.startswith(target + "."):
                    graph[name].add(target)
                target = target.rpartition(".")[0]
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_package_has_no_import_cycles() -> None:
    graph = dependency_graph(PACKAGE)
    assert len(graph) > 10  # the walk found the package
    assert cycles(graph) == []


def test_the_cycle_finder_finds_cycles_through_function_level_imports(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("from pkg.a import thing\n")
    (package / "a.py").write_text("from pkg.sub import b\nthing = 1\n")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "b.py").write_text("def late():\n    from ..c import other\n")
    (package / "c.py").write_text("from . import a\nother = 2\n")
    (package / "d.py").write_text("import pkg.a\n")
    graph = dependency_graph(package)
    assert graph["pkg.d"] == {"pkg.a"}
    assert graph["pkg.a"] == {"pkg.sub", "pkg.sub.b"}
    assert cycles(graph) == [["pkg.a", "pkg.c", "pkg.sub.b"]]


def test_importing_a_submodule_runs_its_package_init(tmp_path: Path) -> None:
    """``hooks/__init__.py`` imports ``hooks.saver``, which imports ``front``, which imports
    ``hooks.context``: loading ``front`` first fails at run time, so it is a cycle."""
    package = tmp_path / "pkg"
    (package / "hooks").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "hooks" / "__init__.py").write_text("from pkg.hooks.saver import Saver\n")
    (package / "hooks" / "context.py").write_text("from pkg.hooks import saver\n")
    (package / "hooks" / "saver.py").write_text("from pkg.front import prune\nclass Saver: ...\n")
    (package / "front.py").write_text("from pkg.hooks.context import Stage\n")
    graph = dependency_graph(package)
    assert graph["pkg.front"] == {"pkg.hooks", "pkg.hooks.context"}
    assert graph["pkg.hooks.context"] == {"pkg.hooks.saver"}
    assert cycles(graph) == [["pkg.front", "pkg.hooks", "pkg.hooks.context", "pkg.hooks.saver"]]


def test_type_checking_imports_are_not_edges(tmp_path: Path) -> None:
    """An import under ``if TYPE_CHECKING:`` never runs; its ``else`` branch does."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "import typing\n"
        "if TYPE_CHECKING:\n    from pkg.b import x\n"
        "if typing.TYPE_CHECKING:\n    import pkg.b\nelse:\n    import pkg.c\n"
    )
    (package / "b.py").write_text("import pkg.a\n")
    (package / "c.py").write_text("")
    graph = dependency_graph(package)
    assert graph["pkg.a"] == {"pkg.c"}
    assert cycles(graph) == []
