"""Suite-wide guard: no test may damage the machine it runs on.

``/dev/null`` replaced by a regular file (a root process that deleted it; the next
``2>/dev/null`` recreates it as a file) breaks every later build on the machine: compiler
probes read each other's output through it. Each test is checked after it runs, and the one
that removed the device fails by name; as root the device is put back so the rest of the
suite and the next build still work.
"""

from __future__ import annotations

import os
import stat
import subprocess
from collections.abc import Iterator

import pytest

# A helper module that test modules load as a plugin (``pytest_plugins``) and also import: its
# asserts are rewritten whichever comes first (under pytest-xdist an import often does).
pytest.register_assert_rewrite("checkpoint_support")


def _devnull_is_a_device() -> bool:
    try:
        return stat.S_ISCHR(os.stat(os.devnull).st_mode)
    except FileNotFoundError:
        return False


def _restore_devnull() -> None:
    if os.geteuid() != 0:
        return
    if os.path.lexists(os.devnull):
        os.unlink(os.devnull)
    subprocess.run(["mknod", "-m", "666", os.devnull, "c", "1", "3"], check=True)


@pytest.fixture(autouse=True)
def _machine_left_intact(request: pytest.FixtureRequest) -> Iterator[None]:
    if not _devnull_is_a_device():
        _restore_devnull()
    yield
    if not _devnull_is_a_device():
        _restore_devnull()
        pytest.fail(
            f"{request.node.nodeid} replaced {os.devnull} (no longer a character device); "
            "it was recreated",
            pytrace=False,
        )
