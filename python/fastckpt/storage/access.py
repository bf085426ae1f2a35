"""Who may read or write a path: the messages of permission errors.

A checkpoint another user wrote (under ``umask 077``), or a root this user may not write, is
no damage: these errors say who owns what and the fix, instead of calling the checkpoint
corrupt or naming a lock file.
"""

from __future__ import annotations

import errno
import os
import pwd
import resource
from pathlib import Path

from fastckpt.io.limits import NO_DESCRIPTORS, descriptor_advice

__all__ = [
    "NO_DESCRIPTORS",
    "NO_ROOM",
    "ScratchSpaceError",
    "access_note",
    "descriptor_advice",
    "file_size_advice",
    "free_space_advice",
    "read_refused",
    "scratch_full",
]


def _user(uid: int) -> str:
    """``name (uid N)``, or ``uid N`` for a uid without a name."""
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def access_note(path: str | os.PathLike[str]) -> str:
    """Who owns ``path`` and who asked, for a permission error's message that names
    ``path`` just before: ``it belongs to root (uid 0), mode 0700; this process runs as
    nobody (uid 65534)`` (the first half left out when ``path`` cannot be examined either)."""
    me = f"this process runs as {_user(os.geteuid())}"
    try:
        info = os.stat(path)
    except OSError:
        return me
    return f"it belongs to {_user(info.st_uid)}, mode {info.st_mode & 0o7777:04o}; {me}"


def read_refused(path: str | os.PathLike[str], err: OSError) -> PermissionError:
    """The error for reading ``path`` (a checkpoint, or a file or folder of one) refused by
    its permissions (``err``: ``EACCES`` / ``EPERM``): the same errno and path, and a message
    saying that this is no damage, who owns what, and the fix.

    Args:
        path: what was to be read (named in the message and as the error's ``filename``).
        err: the refusal.
    """
    code = err.errno if err.errno is not None else errno.EACCES
    return PermissionError(
        code,
        f"{os.fspath(path)}: {os.strerror(code)}: this user may not read it "
        f"({access_note(path)}); nothing says it is damaged, but it cannot be checked or "
        "loaded as this user: read it as its owner, or give this user read access (chmod, "
        "chown or an ACL, on its folders too)",
        os.fspath(path),
    )


#: Errors of a disk that has no room (a full filesystem, out of inodes, a quota).
NO_ROOM = (errno.ENOSPC, errno.EDQUOT)

#: Fewer free inodes than this (on a filesystem that limits them) and "free space" alone may
#: be the wrong advice: ``df -h`` shows space while no file can be created. A save creates
#: many files at once (a file per model, optimizer and item, staging folders) and removes
#: them when it fails, so the count read after a failure is higher than what it lacked: the
#: bound is generous (a disk with inodes to spare has millions).
_FEW_INODES = 1024


def free_space_advice(path: str | os.PathLike[str]) -> str:
    """What to free for a write refused as full (``ENOSPC``/``EDQUOT``) at ``path``: "free
    space", or "free space or inodes (df -i)" where its filesystem limits inodes and has
    fewer than :data:`_FEW_INODES` left (there ``df -h`` shows free space). The nearest
    existing folder of ``path`` is asked (``statvfs``); where that fails, "free space"."""
    folder = Path(path)
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        stats = os.statvfs(folder)
    except OSError:
        return "free space"
    if stats.f_files > 0 and stats.f_favail < _FEW_INODES:  # f_files 0: no inode limit
        return "free space or inodes (df -i)"
    return "free space"


def file_size_advice() -> str:
    """Why a write was refused as too large (``EFBIG``) and the fix: where this process has a
    file-size limit (``ulimit -f``, ``RLIMIT_FSIZE``; Python ignores ``SIGXFSZ``, so the write
    fails instead of killing it), that limit refused it, "raise `ulimit -f`"; else the
    filesystem refused a file that large, "use a filesystem that allows larger files"."""
    limit, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    if limit != resource.RLIM_INFINITY:
        return (
            f"this process's file-size limit (`ulimit -f`, {limit} bytes) refused the write: "
            "raise it (`ulimit -f unlimited`)"
        )
    return "the filesystem refused a file this large: use a filesystem that allows larger files"


class ScratchSpaceError(OSError):
    """A full (``ENOSPC``/``EDQUOT``) local scratch folder (``TMPDIR``) met while working on a
    checkpoint stored elsewhere (an object store): its message names the folder and the fix,
    and the save and export explanations of a full disk pass it on as it is (they would
    blame the checkpoint's store, and advise pruning it, which frees nothing here)."""


def scratch_full(err: OSError, folder: str, doing: str) -> ScratchSpaceError:
    """``err`` (a full scratch ``folder``) as a :class:`ScratchSpaceError` saying what was
    being done (``doing``) and the fix."""
    code = err.errno if err.errno is not None else errno.ENOSPC
    return ScratchSpaceError(
        code,
        f"{os.strerror(code)} in the local scratch folder {folder} while {doing}; "
        f"{free_space_advice(folder)} there, or point TMPDIR at a folder with room, and try "
        "again (nothing in the checkpoint's store was changed by this step)",
        folder,
    )
