"""A bench-only storage backend: a local directory behind a bandwidth cap.

It stands in for a shared filesystem (NFS, Lustre, a cloud file share) in the tiers benchmark
(:mod:`fastckpt.bench.tiers`): such a filesystem gives each node a fraction of its local
disk's bandwidth, which is what makes checkpointing straight to it expensive. Nothing else of
a shared filesystem is modelled: no per-request latency, no metadata cost, no client CPU (the
cap sleeps, it does not burn a core), no page cache effects beyond the local disk's own.

Paths are ``throttled:///absolute/local/path`` (``pathlib`` spells them
``throttled:/absolute/local/path``); every byte is stored in the local directory the path
names, through fastckpt's own writers and readers, and every byte read or written is paced
by a token bucket (:class:`Pacer`, one per direction, shared by every path under a
registered prefix and by every thread): a transfer of ``n`` bytes that starts at ``t0`` on
an idle link ends no earlier than ``t0 + n / rate``, and concurrent transfers queue behind
each other, so the aggregate never exceeds the cap. Only the bytes moved are charged: the
local work (writing, fsync, checksumming) overlaps the paced time rather than adding to it.

The scheme is registered with :func:`fastckpt.storage.registry.register_scheme` by
:func:`register` (importing this module does it), and the caps are set per prefix with
``fastckpt.configure_storage("throttled:///srv/share", read_mib_s=..., write_mib_s=...)``
(the longest registered prefix wins; without one the transfer is not paced).

Because the path has a URL scheme, fastckpt treats it as it treats an object store: files
are written in place under their final names (no staging directory renamed into place), the
manifest written last is the commit point, and incremental saves copy unchanged tensors into
the new index (read back and written again here, and charged both ways) instead of
referencing them. That is the object-store protocol, not the local-filesystem one, and a
real shared filesystem would use the latter (hard links, renames): a difference in
protocol, not in bandwidth, noted wherever the results are shown.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastckpt import _native
from fastckpt.io.forksafe import ForkSafeLock
from fastckpt.io.headers import read_metadata
from fastckpt.io.paths import check_relpath
from fastckpt.storage.backend import (
    LOCAL,
    MAX_RECORD_BYTES,
    CopySource,
    FileRecord,
    ObjectInfo,
    Staging,
    StorageBackend,
    make_dirs,
)
from fastckpt.storage.lock import RootLock
from fastckpt.storage.registry import register_scheme

if TYPE_CHECKING:
    import numpy as np
    import torch

__all__ = [
    "SCHEME",
    "Limits",
    "Pacer",
    "ThrottledBackend",
    "backend_for_url",
    "local_path",
    "register",
    "register_storage_options",
    "url_for",
]

SCHEME = "throttled"
_MIB = 1 << 20


def register() -> None:
    """Store ``throttled://`` paths with this module (idempotent)."""
    register_scheme(SCHEME, __name__)


def local_path(path: str | os.PathLike[str]) -> Path:
    """The local path a ``throttled:`` URL (either spelling) names.

    Raises:
        ValueError: not a ``throttled:`` URL of an absolute path.
    """
    text = os.fspath(path)
    scheme, colon, rest = text.partition(":")
    if scheme != SCHEME or not colon or not rest.startswith("/"):
        raise ValueError(f"{text}: not a {SCHEME}:///absolute/path URL")
    return Path("/" + rest.lstrip("/"))


def url_for(directory: str | os.PathLike[str]) -> str:
    """``throttled:///<absolute directory>``."""
    return f"{SCHEME}://{os.path.abspath(directory)}"


class Pacer:
    """A token bucket (in its GCRA form: a virtual finish time) capping one direction's
    bandwidth, shared by threads.

    Args:
        bytes_per_s: the cap.
        burst_bytes: how much may go at once after an idle period (the bucket's depth).
    """

    def __init__(self, bytes_per_s: float, burst_bytes: int = 4 * _MIB) -> None:
        if not bytes_per_s > 0:
            raise ValueError(f"a pacer needs a positive rate, got {bytes_per_s}")
        self.rate = float(bytes_per_s)
        self.burst = burst_bytes / self.rate  # seconds of credit
        self._finish = 0.0  # when the link is free again (monotonic clock)
        self._lock = threading.Lock()
        #: Bytes paced so far, and seconds spent sleeping for them (all threads).
        self.bytes = 0
        self.slept = 0.0

    def reserve(self, nbytes: int, since: float | None = None) -> float:
        """Book ``nbytes`` on the link, the transfer having started at ``since`` (default:
        now); returns when it may be considered finished (monotonic clock)."""
        now = time.monotonic()
        start = now if since is None else min(since, now)
        with self._lock:
            begin = max(self._finish, start - self.burst)
            self._finish = begin + nbytes / self.rate
            self.bytes += nbytes
            return self._finish

    def wait_until(self, finish: float) -> None:
        """Sleep until ``finish`` (a :meth:`reserve` result)."""
        delay = finish - time.monotonic()
        if delay > 0:
            time.sleep(delay)
            with self._lock:
                self.slept += delay

    def pay(self, nbytes: int, since: float | None = None) -> None:
        """:meth:`reserve` then :meth:`wait_until`."""
        self.wait_until(self.reserve(nbytes, since))


@dataclass
class Limits:
    """The caps of one registered prefix (None: that direction is not paced)."""

    read: Pacer | None
    write: Pacer | None


_LIMITS: dict[str, Limits] = {}
_LIMITS_LOCK = ForkSafeLock()  # free in a forked child


def register_storage_options(url: str, options: Mapping[str, Any] | None) -> None:
    """Cap every path under ``url``: ``{"read_mib_s": float, "write_mib_s": float,
    "burst_mib": float}`` (either rate may be left out or None: not paced). ``None``
    removes the caps.

    Raises:
        TypeError: an unknown option.
        ValueError: a rate that is not positive.
    """
    prefix = str(local_path(url)).rstrip("/") or "/"
    if options is None:
        with _LIMITS_LOCK:
            _LIMITS.pop(prefix, None)
        return
    unknown = set(options) - {"read_mib_s", "write_mib_s", "burst_mib"}
    if unknown:
        raise TypeError(
            f"unknown {SCHEME} option(s) {sorted(unknown)}; use read_mib_s, write_mib_s, burst_mib"
        )
    burst = int(float(options.get("burst_mib", 4)) * _MIB)

    def pacer(key: str) -> Pacer | None:
        rate = options.get(key)
        return None if rate is None else Pacer(float(rate) * _MIB, burst)

    with _LIMITS_LOCK:
        _LIMITS[prefix] = Limits(read=pacer("read_mib_s"), write=pacer("write_mib_s"))


def limits_for(path: str | os.PathLike[str]) -> Limits:
    """The caps of the longest registered prefix holding ``path`` (none: unpaced)."""
    local = str(local_path(path))
    best, found = -1, Limits(None, None)
    with _LIMITS_LOCK:
        for prefix, limits in _LIMITS.items():
            inside = local == prefix or local.startswith(prefix.rstrip("/") + "/")
            if inside and len(prefix) > best:
                best, found = len(prefix), limits
    return found


def backend_for_url(url: str | os.PathLike[str]) -> ThrottledBackend:
    """The backend for a ``throttled:`` path, with the caps registered for its prefix."""
    return ThrottledBackend(limits_for(url))


@contextmanager
def _paced(pacer: Pacer | None, nbytes: int | None = None) -> Iterator[list[int]]:
    """Time the local work in the block, then wait until ``nbytes`` (or what the block
    appended to the yielded list) would have crossed the link since the block started."""
    since = time.monotonic()
    sizes: list[int] = [] if nbytes is None else [nbytes]
    yield sizes
    if pacer is not None and sizes:
        pacer.pay(sum(sizes), since)


class ThrottledBackend(StorageBackend):
    """A local directory behind :class:`Limits` (see the module docstring)."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits

    # ------------------------------------------------------------------------------- reading

    def stat(self, path: Path) -> ObjectInfo:
        """The local file's size and kind (not paced: metadata)."""
        return LOCAL.stat(local_path(path))

    def exists(self, path: Path) -> bool:
        """Whether anything is there (not paced)."""
        return LOCAL.exists(local_path(path))

    def is_directory(self, path: Path) -> bool:
        """Whether the local path is a directory (not paced)."""
        return LOCAL.is_directory(local_path(path))

    def read_bytes(self, path: Path, *, limit: int = MAX_RECORD_BYTES) -> bytes:
        """The whole small file, paced."""
        with _paced(self.limits.read) as sizes:
            data = LOCAL.read_bytes(local_path(path), limit=limit)
            sizes.append(len(data))
        return data

    def read_range(self, path: Path, offset: int, length: int) -> bytes:
        """One range, paced."""
        with _paced(self.limits.read) as sizes:
            data = LOCAL.read_range(local_path(path), offset, length)
            sizes.append(len(data))
        return data

    def read_into(self, path: Path, offset: int, dest: np.ndarray) -> None:
        """Fill ``dest`` from ``offset``, paced."""
        with _paced(self.limits.read, dest.nbytes):
            LOCAL.read_into(local_path(path), offset, dest)

    def checksum(self, path: Path) -> tuple[int, int]:
        """``(size, crc32c)`` of the whole file, paced."""
        with _paced(self.limits.read) as sizes:
            size, crc = LOCAL.checksum(local_path(path))
            sizes.append(size)
        return size, crc

    def verify_tensors(self, path: Path, threads: int) -> tuple[int, list[str]]:
        """The Rust verifier over the whole file, paced."""
        local = local_path(path)
        with _paced(self.limits.read, os.stat(local).st_size):
            return LOCAL.verify_tensors(local, threads)

    def open_tensors(
        self, path: Path, *, verify: bool = True, threads: int | None = None
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The tensors of the file, the whole file paced as read."""
        local = local_path(path)
        with _paced(self.limits.read, os.stat(local).st_size):
            return LOCAL.open_tensors(local, verify=verify, threads=threads)

    def read_header(self, path: Path) -> dict[str, Any]:
        """The validated header, its bytes paced."""
        with _paced(self.limits.read) as sizes:
            header = LOCAL.read_header(local_path(path))
            sizes.append(int(header.get("data_start", 8)))
        return header

    def list_dir(self, directory: Path) -> list[str]:
        """Names inside ``directory`` (not paced)."""
        return LOCAL.list_dir(local_path(directory))

    # ------------------------------------------------------------------------------- writing

    def stage(
        self, final: Path, *, direct_io: bool | None = None, threads: int | None = None
    ) -> ThrottledStaging:
        """Files written in place under ``final`` (the object-store protocol)."""
        return ThrottledStaging(self, Path(final), direct_io=direct_io, threads=threads)

    def put_record(self, path: Path, data: bytes) -> None:
        """Temp file + fsync + rename (the Rust core), paced."""
        local = local_path(path)
        make_dirs(local.parent)
        with _paced(self.limits.write, len(data)):
            _native.write_bytes_atomic(str(local), data, True)

    def delete(self, path: Path) -> None:
        """Remove a file or a tree (not paced: metadata)."""
        LOCAL.delete(local_path(path))

    def lock(self, root: Path, *, timeout: float | None = None) -> RootLock:
        """The local ``flock`` of the root (a shared filesystem's lock, e.g. NFS's)."""
        local = local_path(root)
        make_dirs(local)
        return RootLock(local, timeout=timeout)


class ThrottledStaging(Staging):
    """The files of one container written under their final names, paced; :meth:`publish`
    only makes the new directory entries durable (the manifest, written next, commits)."""

    def __init__(
        self,
        backend: ThrottledBackend,
        final: Path,
        *,
        direct_io: bool | None = None,
        threads: int | None = None,
    ) -> None:
        self.backend = backend
        self.final = final
        self.local = local_path(final)
        self.direct_io = direct_io
        self.threads = threads
        self.files = {}
        self._dirs: set[Path] = set()

    @property
    def location(self) -> str:
        """The container's URL (files are already at their final names)."""
        return os.fspath(self.final)

    def _target(self, relpath: str) -> Path:
        check_relpath(relpath, "file")
        path = self.local / relpath
        if path.parent not in self._dirs:
            make_dirs(path.parent)
            self._dirs.add(path.parent)
        return path

    def put_bytes(self, relpath: str, data: bytes) -> FileRecord:
        """Write ``data`` durably, paced."""
        target = self._target(relpath)
        with _paced(self.backend.limits.write, len(data)):
            _native.write_bytes_atomic(str(target), data, True)
        record = {"size": len(data), "crc32c": _native.crc32c(data)}
        self.files[relpath] = record
        return record

    def put_tensors(
        self,
        relpath: str,
        tensors: Mapping[str, torch.Tensor],
        copies: Mapping[str, CopySource] | None = None,
        *,
        metadata: Mapping[str, str] | None = None,
    ) -> FileRecord:
        """Write a safetensors file durably (the Rust writer), paced. Tensors in ``copies``
        are read back from the committed files holding them (verified, the read paced) and
        written again (an object store would copy them server-side)."""
        from fastckpt.io.files import write_tensors
        from fastckpt.io.images import find_image, write_image

        target = self._target(relpath)
        everything = dict(tensors)
        if copies:
            if metadata:
                raise ValueError(f"{self.final}/{relpath}: metadata with copies")
            everything.update(self._copied(copies))
        image = find_image(tensors) if metadata is None and not copies else None
        with _paced(self.backend.limits.write) as sizes:
            if image is not None:
                report = write_image(image, target, direct_io=self.direct_io)
            else:
                report = write_tensors(
                    everything, target, metadata, direct_io=self.direct_io, threads=self.threads
                )
            sizes.append(int(report["file_len"]))
        record = {"size": int(report["file_len"]), "crc32c": int(report["file_crc32c"])}
        self.files[relpath] = record
        return record

    def _copied(self, copies: Mapping[str, CopySource]) -> dict[str, torch.Tensor]:
        """The tensors ``copies`` names, read from their files (verified; paced)."""
        from fastckpt.errors import ChecksumMismatchError

        opened: dict[Path, dict[str, torch.Tensor]] = {}
        found = {}
        for name, source in copies.items():
            if source.path not in opened:
                header = read_metadata(local_path(source.path))
                for wanted, copy in copies.items():
                    if copy.path != source.path:
                        continue
                    entry = header["tensors"].get(copy.name)
                    got = None if entry is None else (entry["dtype"], entry["shape"])
                    got_crc = None if entry is None else entry["crc32c"]
                    if got != (copy.dtype, list(copy.shape)) or got_crc != copy.crc32c:
                        raise ChecksumMismatchError(
                            f"{source.path}: tensor {copy.name!r} (for {wanted!r}) is not what "
                            "an incremental save expected; save again in full"
                        )
                opened[source.path], _ = self.backend.open_tensors(source.path, verify=True)
            found[name] = opened[source.path][source.name]
        return found

    def written_header(self, relpath: str) -> dict[str, Any]:
        """The header of the file :meth:`put_tensors` wrote (read locally, not paced: the
        writer knows what it sent)."""
        return read_metadata(self._target(relpath))

    def adopt(self, location: str, relpath: str, record: FileRecord) -> None:
        """Take a file another staging wrote: nothing to move when it wrote to this
        container, a paced copy otherwise."""
        if location != self.location:
            data = self.backend.read_bytes(Path(location) / relpath, limit=1 << 62)
            self.put_bytes(relpath, data)
        self.files[relpath] = dict(record)

    def publish(self) -> None:
        """fsync the directories files were created in."""
        for directory in sorted(self._dirs, key=lambda p: len(p.parts), reverse=True):
            _native.fsync_dir(str(directory))

    def discard(self) -> None:
        """Delete the files put so far."""
        for relpath in self.files:
            (self.local / relpath).unlink(missing_ok=True)
        self.files = {}


register()
