"""What an operating-system limit met by a file operation means, and the fix to name."""

from __future__ import annotations

import errno

__all__ = ["NO_DESCRIPTORS", "descriptor_advice"]

#: The errnos of a process (``EMFILE``) or system (``ENFILE``) out of file descriptors.
NO_DESCRIPTORS = (errno.EMFILE, errno.ENFILE)


def descriptor_advice(code: int) -> str:
    """Who had no file descriptor free (``code``: one of :data:`NO_DESCRIPTORS`) and the fix:
    "this process had no file descriptor free (raise `ulimit -n` or open fewer files)"."""
    who = "this process" if code == errno.EMFILE else "the system"
    return f"{who} had no file descriptor free (raise `ulimit -n` or open fewer files)"
