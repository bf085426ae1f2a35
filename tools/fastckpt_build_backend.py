"""fastckpt-io's build backend: maturin's, with the Rust toolchain question asked first.

pyproject.toml names this module (``backend-path = ["tools"]``); every PEP 517 hook is
maturin's own. Only a build that finds no ``cargo`` on ``PATH`` behaves differently:

- maturin would fetch a Rust toolchain (rustup's minimal profile, about 721 MB in
  ``~/.cache/puccinialin``) with nothing on the terminal unless pip runs with ``-v``; this
  backend says so on stderr before the download starts;
- where that fetch cannot happen (no network, or ``MATURIN_NO_INSTALL_RUST`` set), the build
  stops at once with a message that names the fix, instead of a traceback from the downloader.

A machine with Rust installed builds exactly as with ``build-backend = "maturin"``.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable
from typing import Any

import maturin
from maturin import (  # the hooks that run no cargo, re-exported as they are
    get_requires_for_build_editable,
    get_requires_for_build_sdist,
    get_requires_for_build_wheel,
)

#: What a source build needs, and where to get it, said the same way on every failure.
FIX = (
    "fastckpt-io builds a Rust extension from source, and no Rust toolchain (cargo) is on PATH.\n"
    "Fix, either of:\n"
    "  - install Rust (https://rustup.rs, or your distribution's `cargo` package), make sure\n"
    '    `cargo --version` works in this shell (rustup: `. "$HOME/.cargo/env"`), and retry;\n'
    "  - install a prebuilt wheel instead (CPython 3.11+, Linux x86_64 and aarch64): one\n"
    "    `make wheel` built in a checkout on a machine with Rust, pip install\n"
    "    fastckpt_io-<version>-cp311-abi3-manylinux2014_<arch>.manylinux_2_17_<arch>.whl\n"
    "    (fastckpt-io is not on PyPI yet; once it is, pip install --only-binary fastckpt-io\n"
    "    fastckpt-io)."
)
DOWNLOAD_NOTICE = (
    "fastckpt-io: no cargo on PATH, so the build downloads a Rust toolchain (about 721 MB,\n"
    "into ~/.cache/puccinialin) before compiling. To use an installed toolchain instead, put\n"
    "its cargo on PATH; to forbid the download, set MATURIN_NO_INSTALL_RUST=1.\n"
)


def _ensure_rust() -> None:
    """Make ``cargo`` reachable for maturin, or stop the build with :data:`FIX`.

    The download is the one maturin itself would start (``puccinialin.setup_rust``); doing it
    here puts its failure next to the fix, and the toolchain's directories into
    ``os.environ``, where maturin's hooks then find cargo and fetch nothing more.
    """
    if shutil.which("cargo"):
        return
    if os.environ.get("MATURIN_NO_INSTALL_RUST"):
        raise SystemExit(f"\nMATURIN_NO_INSTALL_RUST is set, so no toolchain is fetched.\n{FIX}\n")
    sys.stderr.write(DOWNLOAD_NOTICE)
    sys.stderr.flush()
    try:
        from puccinialin import setup_rust

        extra_env = setup_rust()
    except BaseException as error:  # the downloader exits or raises on a failed fetch
        if isinstance(error, KeyboardInterrupt):
            raise
        raise SystemExit(f"\nFetching a Rust toolchain failed ({error!r}).\n{FIX}\n") from None
    os.environ.update(extra_env)
    if not shutil.which("cargo"):
        raise SystemExit(f"\nA Rust toolchain was fetched but cargo is still not on PATH.\n{FIX}\n")


def _with_rust(hook: Callable[..., str]) -> Callable[..., str]:
    """``hook`` (a maturin hook that runs cargo), preceded by :func:`_ensure_rust`."""

    def run(*args: Any, **kwargs: Any) -> str:
        _ensure_rust()
        return hook(*args, **kwargs)

    run.__name__ = hook.__name__
    run.__doc__ = hook.__doc__
    return run


build_wheel = _with_rust(maturin.build_wheel)
build_editable = _with_rust(maturin.build_editable)
build_sdist = _with_rust(maturin.build_sdist)
prepare_metadata_for_build_wheel = _with_rust(maturin.prepare_metadata_for_build_wheel)
prepare_metadata_for_build_editable = _with_rust(maturin.prepare_metadata_for_build_editable)

__all__ = [
    "build_editable",
    "build_sdist",
    "build_wheel",
    "get_requires_for_build_editable",
    "get_requires_for_build_sdist",
    "get_requires_for_build_wheel",
    "prepare_metadata_for_build_editable",
    "prepare_metadata_for_build_wheel",
]
