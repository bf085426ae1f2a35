"""fastckpt's version as a module, in the shape torch_checkpointing's ``version`` module has.

Code written for torch_checkpointing reads its version with ``torch_checkpointing.version``'s
``__version__``, ``get_version()`` and ``Version``; the same names live here, and describe the
installed ``fastckpt-io`` distribution::

    from fastckpt.version import get_version

    version = get_version()  # None when no fastckpt-io distribution is installed
    if version is not None:
        print(version.get_version(), version.get_sha())

The version is read from the installed distribution's metadata when this module is imported
(``importlib.reload`` reads it again). Where none is installed (a source tree on
``sys.path``), ``__version__`` is :data:`UNKNOWN` and :func:`get_version` returns ``None``;
``fastckpt.__version__`` says ``"0.0.0"`` there instead.
"""

from __future__ import annotations

import importlib.metadata

__all__ = ["DISTRIBUTION", "UNKNOWN", "Version", "__version__", "get_version"]

#: The distribution whose version this module reports (the module it installs is fastckpt).
DISTRIBUTION = "fastckpt-io"

#: ``__version__`` when the distribution's metadata cannot be found.
UNKNOWN = "Unknown"

try:
    __version__: str = importlib.metadata.version(DISTRIBUTION)
except importlib.metadata.PackageNotFoundError:
    __version__ = UNKNOWN


class Version:
    """A version string split at its first ``+``: the release before it, a local part
    (the commit, for development builds) after it.

    ``Version("1.2.3+abc123")`` has ``get_version() == "1.2.3"`` and
    ``get_sha() == "abc123"``; without a ``+`` the sha is ``None``, and after a trailing
    ``+`` it is ``""``. ``str()`` gives the whole string back.
    """

    __slots__ = ("_full", "_release", "_sha")

    def __init__(self, full_version_string: str) -> None:
        self._full = full_version_string
        release, plus, local = full_version_string.partition("+")
        self._release = release
        self._sha: str | None = local if plus else None

    def get_version(self) -> str:
        """The release part: ``"1.2.3"`` of ``"1.2.3+abc123"``."""
        return self._release

    def get_full_version(self) -> str:
        """The string the version was made from, unchanged."""
        return self._full

    def get_sha(self) -> str | None:
        """What follows the first ``+`` (``None`` where there is no ``+``)."""
        return self._sha

    def __str__(self) -> str:
        """The full version string."""
        return self._full

    def __repr__(self) -> str:
        """``Version('<full version string>')``."""
        return f"Version({self._full!r})"


def get_version() -> Version | None:
    """The installed fastckpt-io's version, or ``None`` when it is :data:`UNKNOWN`."""
    if __version__ == UNKNOWN:
        return None
    return Version(__version__)
