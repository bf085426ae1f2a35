"""Names and relative paths read from a checkpoint's records, checked before they touch a
filesystem: nothing a record says is trusted."""

from __future__ import annotations

import os
from pathlib import Path

from fastckpt.errors import CheckpointFormatError

__all__ = [
    "MAX_NAME_BYTES",
    "check_name",
    "check_name_length",
    "check_relpath",
    "is_ascii_decimal",
    "is_text",
    "safe_join",
]


def is_text(text: str) -> bool:
    """Whether ``text`` can be written as UTF-8 (a name or key holding a lone surrogate, as
    ``surrogateescape`` decoding leaves, cannot: a record or header holds UTF-8)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def is_ascii_decimal(text: str) -> bool:
    """Whether ``text`` is a non-empty run of ASCII digits (``str.isdigit`` also takes ``"²"``,
    which ``int()`` refuses: a stray folder so named made sweeps raise a bare ValueError)."""
    return text.isascii() and text.isdigit()


def check_name(name: object, what: str) -> str:
    """Validate a component or file name that becomes a path component.

    Raises:
        CheckpointFormatError: not a plain name (separators, ``..``, absolute, hidden, empty).
    """
    if (
        not isinstance(name, str)
        or not name
        or name in (".", "..")
        or name.startswith(".")
        or any(sep in name for sep in ("/", "\\", "\0"))
    ):
        raise CheckpointFormatError(
            f"{what} {name!r} is not a valid name: use a non-empty name without '/', a "
            "backslash (a separator on Windows: refused so that checkpoints stay portable), "
            "NUL, or a leading '.'"
        )
    return name


#: The longest model, optimizer, scheduler or item name a save accepts, in UTF-8 bytes: the
#: files named after it add suffixes (``.spec.json``, ``linked/<name>.<index>.safetensors``)
#: and filesystems refuse names over 255 bytes. (A checkpoint folder's own name is checked
#: against its temporary sibling's length when it is saved.)
MAX_NAME_BYTES = 200


def check_name_length(name: str, what: str) -> str:
    """Refuse a name (checked by :func:`check_name`) too long to save under.

    Raises:
        CheckpointFormatError: longer than :data:`MAX_NAME_BYTES` in UTF-8.
    """
    size = len(name.encode("utf-8", "surrogatepass"))
    if size > MAX_NAME_BYTES:
        raise CheckpointFormatError(
            f"{what} {name[:40]!r}... is {size} bytes long (UTF-8): names of more than "
            f"{MAX_NAME_BYTES} bytes cannot be saved, as the files named after it would pass "
            "the filesystem's 255-byte limit; use a shorter name"
        )
    return name


def check_relpath(relpath: object, what: str) -> str:
    """Validate a ``dir/file`` path relative to an index directory (each part a plain name)."""
    if not isinstance(relpath, str) or relpath.startswith("/"):
        raise CheckpointFormatError(f"{what} {relpath!r} must be a relative path")
    for part in relpath.split("/"):
        try:
            check_name(part, what)
        except CheckpointFormatError as err:
            raise CheckpointFormatError(f"{what} {relpath!r}: {err}") from None
    return relpath


def safe_join(
    base: str | os.PathLike[str],
    relpath: str,
    *,
    within: str | os.PathLike[str] | None = None,
    what: str = "file",
) -> Path:
    """``base / relpath`` after checking that it stays inside the checkpoint.

    ``relpath`` must be a plain relative path (:func:`check_relpath`), and the real path of
    the result (every symlink resolved) must lie inside the real path of ``within`` (default
    ``base``). Call it for every file a manifest or commit record names, before opening it: a
    hostile checkpoint cannot then make fastckpt read files outside its directory. Symlinks
    that stay inside ``within`` are allowed (their content is still checked against the
    record). The file itself need not exist.

    Raises:
        CheckpointFormatError: the path is malformed or resolves outside ``within``.
    """
    check_relpath(relpath, what)
    path = Path(base) / relpath
    limit = os.path.realpath(within if within is not None else base)
    real = os.path.realpath(path)
    if real != limit and not real.startswith(limit.rstrip(os.sep) + os.sep):
        raise CheckpointFormatError(
            f"{path}: {what} resolves to {real}, outside the checkpoint directory {limit} "
            "(a symlink pointing out of it?); fastckpt refuses to follow it. Replace the link "
            "by the file itself if the checkpoint is genuine."
        )
    return path
