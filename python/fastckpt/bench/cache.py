"""Dropping the page cache so that reads come from the disk ("cold"), where allowed."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

__all__ = ["CacheControl", "meminfo_kib"]

_DROP_CACHES = "/proc/sys/vm/drop_caches"


def meminfo_kib(field: str) -> int | None:
    """A field of ``/proc/meminfo`` in KiB (``"Cached"``, ``"MemTotal"``...), or None."""
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                key, _, rest = line.partition(":")
                if key == field:
                    return int(rest.split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return None


@dataclass
class CacheControl:
    """Drops the page cache before each timed read when the process may.

    Attributes:
        cold: whether dropping works here (root on Linux); reads are labelled "warm" otherwise.
        reason: why caches cannot be dropped ("" when they can).
        cached_before_kib: page cache size before the probe drop (evidence it worked).
        cached_after_kib: page cache size right after it.
    """

    cold: bool = False
    reason: str = ""
    cached_before_kib: int | None = None
    cached_after_kib: int | None = None

    @classmethod
    def probe(cls, enabled: bool = True) -> CacheControl:
        """Try one drop and report whether cold-cache reads are possible."""
        if not enabled:
            return cls(cold=False, reason="page cache not dropped: pass --drop-caches (as root)")
        if not sys.platform.startswith("linux"):
            return cls(cold=False, reason=f"cannot drop caches on {sys.platform}")
        control = cls(cold=True, cached_before_kib=meminfo_kib("Cached"))
        error = control._drop()
        if error:
            return cls(cold=False, reason=error)
        control.cached_after_kib = meminfo_kib("Cached")
        return control

    def _drop(self) -> str:
        os.sync()
        try:
            with open(_DROP_CACHES, "w") as handle:
                handle.write("3\n")
        except OSError as err:
            return f"cannot write {_DROP_CACHES}: {err.strerror or err}"
        return ""

    def drop(self) -> None:
        """Sync, then drop clean page cache, dentries and inodes (no-op when warm)."""
        if not self.cold:
            return
        error = self._drop()
        if error:  # it worked at probe time; do not silently mix cold and warm figures
            raise RuntimeError(f"dropping caches stopped working: {error}")

    @property
    def label(self) -> str:
        """``"cold"`` or ``"warm"``."""
        return "cold" if self.cold else "warm"
