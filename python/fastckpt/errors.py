"""The exceptions fastckpt raises.

Every fastckpt-specific error derives from :class:`FastCkptError`. Errors that describe bad
data also derive from :class:`ValueError`, so code that already catches ``ValueError`` keeps
working. Operating-system failures keep their usual Python types (``FileNotFoundError``,
``PermissionError``, ``OSError`` with ``errno.ENOSPC``) and name the file they happened on.

The Rust extension raises these same classes (it looks them up in this module), so there is
exactly one hierarchy.
"""

from __future__ import annotations

__all__ = [
    "CheckpointFormatError",
    "CheckpointMismatchError",
    "ChecksumMismatchError",
    "FastCkptError",
    "UntrustedTargetError",
]


class FastCkptError(Exception):
    """Base class of every fastckpt-specific error."""


class ChecksumMismatchError(FastCkptError, ValueError):
    """Bytes on disk do not match the crc32c recorded when they were written.

    The message names the file and the tensor. The file is corrupt: restore it from a copy or
    load an older checkpoint.
    """


class CheckpointFormatError(FastCkptError, ValueError):
    """A file or manifest is malformed: bad header, lying offsets, truncation, bad JSON.

    The message names the file and the offending field.
    """


class CheckpointMismatchError(FastCkptError, ValueError):
    """A load target disagrees with the checkpoint (dtype or shape), named by key path."""


class UntrustedTargetError(FastCkptError):
    """A checkpoint names a dotted path the trust policy refuses to import or call.

    The message names the path and how to allow it (``trusted=`` at load, or a registration).
    """
