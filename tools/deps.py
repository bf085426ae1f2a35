"""The requirement lists the Makefile installs, read from pyproject.toml (one list, not two).

    python tools/deps.py all      runtime dependencies and every extra (the development venv)
    python tools/deps.py lowest   the runtime dependencies pinned to their lower bounds, and the
                                  test runner pinned to its own (the lowest-bound venv that
                                  ``make test-lowest`` runs the focused suite in)

Each requirement is printed shell-quoted on one line. Only the standard library is used: the
development venv's list is read before anything is installed into it.
"""

from __future__ import annotations

import re
import shlex
import sys
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
#: What the lowest-bound venv needs besides the runtime dependencies: the test runner.
LOWEST_TOOLS = ("pytest", "pytest-timeout", "pytest-xdist")
_LOWER_BOUND = re.compile(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*>=\s*([^,;\s]+)")


def project() -> dict:
    """The ``[project]`` table of pyproject.toml."""
    with PYPROJECT.open("rb") as handle:
        return tomllib.load(handle)["project"]


def every_requirement() -> list[str]:
    """Runtime dependencies, then each extra's, as pyproject.toml writes them."""
    table = project()
    extras = [req for group in table["optional-dependencies"].values() for req in group]
    return [*table["dependencies"], *extras]


def lower_bound(requirement: str) -> tuple[str, str]:
    """``("torch", "2.9.0")`` for ``"torch>=2.9.0"``; a requirement without ``>=`` is an error."""
    match = _LOWER_BOUND.match(requirement)
    if match is None:
        raise SystemExit(f"pyproject.toml: {requirement!r} states no lower bound (>=)")
    return match[1], match[2]


def lowest_requirements() -> list[str]:
    """The runtime dependencies and :data:`LOWEST_TOOLS`, each pinned to its lower bound."""
    table = project()
    dev = {lower_bound(req)[0]: req for req in table["optional-dependencies"]["dev"]}
    chosen = [*table["dependencies"], *(dev[name] for name in LOWEST_TOOLS)]
    return ["{}=={}".format(*lower_bound(req)) for req in chosen]


def main(argv: list[str]) -> int:
    """Print the list ``argv[0]`` names (``all`` or ``lowest``)."""
    lists = {"all": every_requirement, "lowest": lowest_requirements}
    if len(argv) != 1 or argv[0] not in lists:
        print(f"usage: {Path(__file__).name} {{{'|'.join(lists)}}}", file=sys.stderr)
        return 2
    print(" ".join(shlex.quote(req) for req in lists[argv[0]]()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
