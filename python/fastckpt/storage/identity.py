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

A pid alone also cannot tell its writer from a later process that got the same pid, so
names also carry :func:`writer_tag`: when the process started (clock ticks since boot) and
which boot it was. :func:`running` then tells a writer that is alive, however long it was
stopped (``SIGSTOP``, a suspended VM or job), from a reused pid, without reading any clock.
"""

from __future__ import annotations

import os
import re
import socket

__all__ = ["HOST", "gone", "running", "writer_tag"]

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


def _boot() -> str:
    """The first 8 hex digits of this boot's id (empty: unknown)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as file:
            return file.read().strip().replace("-", "")[:8]
    except OSError:
        return ""


_BOOT = _boot()


def _started(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (``/proc/<pid>/stat`` field
    22), or None (no such process, or no ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            data = file.read()
    except OSError:
        return None
    fields = data[data.rfind(b")") + 2 :].split()  # the name in parentheses may hold spaces
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


_TAG: tuple[int, str] | None = None  # (pid, tag): a forked child computes its own


def writer_tag() -> str:
    """This process's start time and boot, as leftovers' names record them
    (``<start ticks hex>-<boot>``; empty where ``/proc`` cannot tell)."""
    global _TAG
    pid = os.getpid()
    if _TAG is None or _TAG[0] != pid:
        start = _started(pid)
        _TAG = (pid, f"{start:x}-{_BOOT}" if start is not None and _BOOT else "")
    return _TAG[1]


def running(pid: int, host: str, tag: str) -> bool | None:
    """Whether the writer that recorded ``pid``, ``host`` and ``tag`` (its
    :func:`writer_tag`) is the process running as ``pid`` now: True (alive: its leftovers
    are in use, however old), False (gone: another boot, or another process got the pid),
    None (cannot be told: another host or PID namespace, no tag, no ``/proc``)."""
    if host != HOST or not tag or "-" not in tag:
        return None
    start_hex, boot = tag.split("-", 1)
    if not boot or not _BOOT:
        return None
    if boot != _BOOT:
        return False  # written before this boot: that process is gone
    try:
        start = int(start_hex, 16)
    except ValueError:
        return None
    live = _started(pid)
    if live is None:
        # No /proc entry to read: gone only if no process has the pid. One that exists but
        # hides its entry (/proc mounted hidepid=1/2, another user's) cannot be told.
        return False if gone(pid, host) else None
    return live == start
