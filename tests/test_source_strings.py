"""Every string constant of the package is valid UTF-8.

A docstring holding a ``\\udce9`` escape (a lone surrogate) compiles on CPython 3.11 but not
on 3.13, which encodes constants strictly when it writes bytecode: the installed command
failed at ``import fastckpt.cli`` with ``UnicodeEncodeError`` (round 19, found by the
per-Python wheel tests). This check runs on any Python.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "python" / "fastckpt"


def test_no_string_constant_of_the_package_holds_a_lone_surrogate() -> None:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                try:
                    node.value.encode("utf-8")
                except UnicodeEncodeError:
                    found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert found == []
