"""Which process wrote a leftover, as temporary names and lock files record it.

A save names what it leaves while it works (a staging directory, a replaced checkpoint set
aside, a sharded part) after its pid and :data:`HOST`, and a later process removes or puts
back such a leftover only when :func:`gone` says its writer is. A pid says nothing outside
its PID namespace: a container (a Kubernetes pod's sidecar, a restarted container whose
trainer got the same pid as before) shares the hostname and the filesystem but not the pids.
So :data:`HOST` names the PID namespace too, unless it is the kernel's initial one (the
names of processes outside containers are what they always were), and a writer of another
namespace counts as one of another host: never taken for dead (its leftovers stay, as
another host's do), and what it set aside is put back as another host's is.
"""

from __future__ import annotations

import os
import re
import socket

__all__ = ["HOST", "gone"]

#: The inode of the kernel's initial PID namespace (``PROC_PID_INIT_INO``).
_INITIAL_PID_NAMESPACE = 0xEFFFFFFC
#: The longest :data:`HOST` (names built from it are checked against 255 bytes).
_HOST_BYTES = 64


def _pid_namespace() -> int | None:
    """This process's PID namespace inode (None: unknown, e.g. without ``/proc``)."""
    try:
        link = os.readlink("/proc/self/ns/pid")  # 'pid:[4026531836]'
    except OSError:
        return None
    found = re.fullmatch(r"pid:\[(\d+)\]", link)
    return int(found.group(1)) if found else None


def _host() -> str:
    name = re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname()) or "host"
    namespace = _pid_namespace()
    if namespace is None or namespace == _INITIAL_PID_NAMESPACE:
        return name[:_HOST_BYTES]
    suffix = f".pidns{namespace}"
    return name[: _HOST_BYTES - len(suffix)] + suffix


#: This host and PID namespace as leftovers' names record them (letters, digits, ``.``,
#: ``-``, ``_``; at most 64 characters).
HOST = _host()


def gone(pid: int, host: str) -> bool:
    """Whether the process ``pid`` of ``host`` (as :data:`HOST` spells it) that wrote a
    leftover no longer exists. Only a process of this host and PID namespace can be asked:
    another one's is never taken for gone, nor is this process itself."""
    if host != HOST or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's live process
        return False
    return False
