"""The storage interface every checkpoint read and write goes through.

A checkpoint is a set of *files* (immutable once written) and one *commit record* per
container (``manifest.json`` of a root, ``commit.json`` of a manager checkpoint) that names
them with their size and crc32c. The protocols above this module (:mod:`fastckpt.container.commit`)
only ever ask a :class:`StorageBackend` to:

* read: :meth:`~StorageBackend.stat`, :meth:`~StorageBackend.read_bytes` (whole small
  object, size-capped), :meth:`~StorageBackend.read_range`, :meth:`~StorageBackend.checksum`
  (streamed whole-object crc32c), :meth:`~StorageBackend.open_tensors` (a verified
  safetensors file), :meth:`~StorageBackend.list_dir`;
* write: :meth:`~StorageBackend.stage` a set of files that become visible together
  (:class:`Staging`: ``put_bytes``/``put_tensors``, then ``publish`` or ``discard``), and
  :meth:`~StorageBackend.put_record`, the atomic, durable replacement of a commit record: the
  commit point, written after every file it names;
* :meth:`~StorageBackend.delete` files or whole directories, and take the container's
  :meth:`~StorageBackend.lock`.

The local filesystem (:class:`LocalFileSystem`) stages into a hidden temporary sibling
directory, fsyncs it, and publishes by one rename (``renameat2(RENAME_EXCHANGE)`` when
replacing); records are replaced by temp file + fsync + rename. An object store has no rename:
its staging puts data objects under their final keys (after the record withdrew what they
replace), ``publish`` is a no-op, and ``put_record`` is a conditional put, so the record,
written last, stays the only commit point.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import errno
import logging
import os
import shutil
import stat
import sys
import time
import warnings
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol

from fastckpt import _native
from fastckpt.errors import CheckpointFormatError, CommitNotDurableError, InvalidInputError
from fastckpt.io.forksafe import ForkSafeLock
from fastckpt.io.headers import read_metadata
from fastckpt.io.paths import check_relpath, is_ascii_decimal
from fastckpt.io.progress import active_counter
from fastckpt.storage.access import (
    NO_DESCRIPTORS,
    NO_ROOM,
    ScratchSpaceError,
    descriptor_advice,
    file_size_advice,
    free_space_advice,
    read_refused,
)
from fastckpt.storage.identity import HOST, gone, running, writer_tag
from fastckpt.storage.lock import RootLock

_LOG = logging.getLogger(__name__)

if TYPE_CHECKING:
    import numpy as np
    import torch

__all__ = [
    "ATOMIC_TEMP_INFIX",
    "MAX_RECORD_BYTES",
    "TEMP_PREFIX",
    "TRASH_PREFIX",
    "CopySource",
    "FileRecord",
    "LocalFileSystem",
    "LocalStaging",
    "ObjectInfo",
    "Staging",
    "StorageBackend",
    "WriterLock",
    "clean_dead_siblings",
    "disk_refused",
    "exchange_paths",
    "explain_full_disk",
    "read_by_size",
    "remove_replaced",
    "remove_tree",
    "restore_replaced",
    "stored_sizes",
]

#: ``{"size": bytes, "crc32c": whole-file crc32c}``: what a commit record says of one file.
FileRecord = dict[str, int]


def read_by_size(
    handle: BinaryIO, size: int, limit: int, path: str | os.PathLike[str] | None = None
) -> bytes:
    """Read an open file whose ``fstat`` size is ``size``, never more than ``limit`` + 1 bytes.

    Asks for ``size`` + 1 bytes (the one more shows whether the file grew since the
    ``fstat``) and only if it did reads on, in 1 MiB pieces, until the end or past ``limit``:
    a small record never needs the cap's worth of memory (an up-front buffer of the cap fails
    under ``ulimit -v`` however small the file is). The caller compares the length with
    ``limit``. A failed read raises its ``OSError`` (errno kept) naming ``path``, the file
    the handle reads.
    """
    try:
        data = handle.read(min(size, limit) + 1)
        if len(data) <= size:
            return data
        pieces = [data]
        total = len(data)
        while total <= limit:
            piece = handle.read(min(1 << 20, limit + 1 - total))
            if not piece:
                break
            pieces.append(piece)
            total += len(piece)
    except OSError as err:
        if err.filename is not None or path is None:
            raise
        # A read of an fdopen'ed handle names no file (an EIO gave filename None).
        raise OSError(err.errno, f"{path}: {err.strerror or err}", os.fspath(path)) from err
    return b"".join(pieces)


@dataclass(frozen=True)
class CopySource:
    """A tensor whose bytes are already in a committed file of the same store.

    Attributes:
        path: that file.
        name: the tensor's name in it.
        dtype / shape / crc32c: what the tensor must be there (its header is checked).
    """

    path: Path
    name: str
    dtype: str
    shape: list[int]
    crc32c: int


#: Hidden siblings of a directory being written / set aside (``.tmp-<name>~<pid>~<host>~<rnd>``).
TEMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
#: The Rust core's temporary name for an atomic file replacement: ``.<name>.fastckpt-tmp.<...>``
#: (the marker is defined once, in the core's ``replace`` module).
ATOMIC_TEMP_INFIX = _native.TEMP_MARKER
#: How long a ``.tmp-*`` staging of a writer :func:`~fastckpt.storage.identity.gone` cannot
#: prove dead (another host's, another PID namespace's, a pid since reused) must stay untouched,
#: nothing in it modified, before a later save removes it: a writer stopped that long has lost
#: it (its publish then fails loudly: the directory it renames is gone), and a killed one's
#: leftover no longer stays for good.
STALE_STAGING_SECONDS = 24 * 3600
#: The largest commit record or JSON document fastckpt reads whole (a hostile file cannot make
#: it read without bound).
MAX_RECORD_BYTES = 1 << 30
_READ_PIECE = 16 << 20


#: Local files whose bytes this process wrote or read back in full:
#: ``(st_dev, st_ino) -> (st_size, st_mtime_ns, crc32c)`` as they were then. A new hard link
#: to one (:meth:`LocalStaging.put_proven_link`) is made without reading it again while its
#: size and modification time stay (a write into the file moves its modification time; a
#: link or an unlink does not). The oldest entries go beyond :data:`_PROVEN_LIMIT`.
_PROVEN: collections.OrderedDict[tuple[int, int], tuple[int, int, int]] = collections.OrderedDict()
_PROVEN_LIMIT = 16384
_PROVEN_LOCK = ForkSafeLock()


def _remember_proven(info: os.stat_result, crc32c: int) -> None:
    """Record that the file ``info`` describes holds bytes of crc32c ``crc32c`` (see
    :data:`_PROVEN`)."""
    key = (info.st_dev, info.st_ino)
    with _PROVEN_LOCK:
        _PROVEN[key] = (info.st_size, info.st_mtime_ns, crc32c)
        _PROVEN.move_to_end(key)
        while len(_PROVEN) > _PROVEN_LIMIT:
            _PROVEN.popitem(last=False)


def _is_proven(info: os.stat_result, record: FileRecord) -> bool:
    """Whether this process proved the bytes of the file ``info`` describes to be
    ``record``'s and neither its size nor its modification time moved since."""
    with _PROVEN_LOCK:
        entry = _PROVEN.get((info.st_dev, info.st_ino))
    return entry is not None and entry == (
        int(record["size"]),
        info.st_mtime_ns,
        int(record["crc32c"]),
    )


def _file_checksum(path: Path) -> tuple[int, int]:
    """``(size, crc32c)`` of a local file, read in 16 MiB pieces."""
    crc = size = 0
    with open(path, "rb") as handle:
        while piece := handle.read(_READ_PIECE):
            crc = _native.crc32c(piece, crc)
            size += len(piece)
    return size, crc


class WriterLock(Protocol):
    """The exclusive writer lock of a container, as :meth:`StorageBackend.lock` returns it
    (locally :class:`~fastckpt.storage.lock.RootLock`, a ``flock``; on an object store a lease
    object, :class:`~fastckpt.storage.s3.backend.S3RootLock`)."""

    def acquire(self) -> None:
        """Block until held (or the lock's timeout elapses: ``TimeoutError``)."""

    def release(self) -> None:
        """Give it up (idempotent)."""

    def __enter__(self) -> Any:
        """:meth:`acquire`."""

    def __exit__(self, *exc: object) -> None:
        """:meth:`release`."""


@dataclass(frozen=True)
class ObjectInfo:
    """What :meth:`StorageBackend.stat` reports.

    Attributes:
        size: bytes.
        regular: a plain file (not a directory, FIFO, device...).
        modified: last modification, seconds since the epoch (None when unknown).
        version: the store's entity tag of the object (None when unknown, and on a local
            filesystem): with ``size`` and ``modified``, what tells a reader that a writer
            replaced it.
    """

    size: int
    regular: bool
    modified: float | None = None
    version: str | None = None


class Staging(ABC):
    """Files written for one container (a directory) that become visible together.

    Attributes:
        final: where the files appear after :meth:`publish`.
        files: relpath -> :data:`FileRecord` of every file put (or adopted) so far.
    """

    final: Path
    files: dict[str, FileRecord]

    @property
    @abstractmethod
    def location(self) -> str:
        """An opaque handle of this staging area another process can :meth:`adopt` from."""

    @abstractmethod
    def put_bytes(self, relpath: str, data: bytes) -> FileRecord:
        """Write one small file durably and record it."""

    @abstractmethod
    def put_tensors(
        self,
        relpath: str,
        tensors: Mapping[str, torch.Tensor],
        copies: Mapping[str, CopySource] | None = None,
        *,
        metadata: Mapping[str, str] | None = None,
    ) -> FileRecord:
        """Write a safetensors file durably (through the Rust core) and record it (the write
        options are the staging's, given to :meth:`StorageBackend.stage`).

        ``copies`` (object stores only: local incremental saves reference instead) names
        further tensors of the file whose bytes are already stored, in a committed file of the
        same store: the store copies them (see :mod:`fastckpt.storage.s3.copy`). ``metadata``:
        the header's ``__metadata__`` strings (not with ``copies``).
        """

    @abstractmethod
    def written_header(self, relpath: str) -> dict[str, Any]:
        """The header (as :func:`~fastckpt.io.files.read_metadata` gives it) of the
        safetensors file :meth:`put_tensors` wrote at ``relpath``, without a request to a
        remote store."""

    @abstractmethod
    def adopt(self, location: str, relpath: str, record: FileRecord) -> None:
        """Take over a file another staging area (``location``) wrote, with its record."""

    def identity(self, relpath: str) -> Hashable | None:
        """What names the exact version of the file this staging put at ``relpath``, valid
        once published (locally its ``(st_dev, st_ino)``; on an object store its etag), for a
        later :meth:`put_copy` from it; None when this backend cannot tell."""
        return None

    def put_copy(self, relpath: str, source: Path, record: FileRecord, identity: Hashable) -> bool:
        """Store at ``relpath`` the bytes of ``source``, a committed file of the same store,
        without them passing through this process (a hard link; a server-side copy), and
        record it with ``record`` (the source's size and crc32c). Only from the version of
        ``source`` that ``identity`` names (what :meth:`identity` gave when it was written):
        a source replaced since is never used.

        Returns:
            False when that is not possible here (no links or server-side copies, ``source``
            gone or replaced): nothing was recorded, the caller writes the bytes instead.
        """
        return False

    @abstractmethod
    def publish(self) -> None:
        """Make every file visible under :attr:`final`, replacing what was there, durably."""

    @abstractmethod
    def discard(self) -> None:
        """Drop what was staged (idempotent)."""


class StorageBackend(ABC):
    """Where checkpoints live; see the module docstring for the contract."""

    @abstractmethod
    def stat(self, path: Path) -> ObjectInfo:
        """Size and kind of ``path``.

        Raises:
            FileNotFoundError: nothing there.
        """

    @abstractmethod
    def exists(self, path: Path) -> bool:
        """Whether anything is at ``path``."""

    def is_directory(self, path: Path) -> bool:
        """Whether ``path`` is a directory (on an object store: a prefix with objects under
        it, asked with one listing, never a request for an object of that name). This
        default asks :meth:`list_dir`; a backend with a cheaper answer overrides it."""
        try:
            return bool(self.list_dir(path))
        except (FileNotFoundError, NotADirectoryError):
            return False

    @abstractmethod
    def read_bytes(self, path: Path, *, limit: int = MAX_RECORD_BYTES) -> bytes:
        """The whole content of a small regular file.

        Raises:
            FileNotFoundError: nothing there. IsADirectoryError: a directory.
            CheckpointFormatError: not a regular file, or larger than ``limit``.
        """

    @abstractmethod
    def read_range(self, path: Path, offset: int, length: int) -> bytes:
        """``length`` bytes from ``offset`` (fewer at the end of the file)."""

    def read_into(self, path: Path, offset: int, dest: np.ndarray) -> None:
        """Fill ``dest`` (a contiguous uint8 array) with the bytes of ``path`` from
        ``offset`` (a backend may read in parallel pieces).

        Raises:
            CheckpointFormatError: the file ends before ``dest`` is full.
        """
        data = self.read_range(path, offset, dest.nbytes)
        if len(data) != dest.nbytes:
            raise CheckpointFormatError(
                f"{path}: ends at {offset + len(data)}, inside the {dest.nbytes} bytes read from "
                f"{offset}; the file is truncated"
            )
        dest.data.cast("B")[:] = data

    @abstractmethod
    def checksum(self, path: Path) -> tuple[int, int]:
        """``(size, crc32c)`` of the whole file, read in pieces."""

    @abstractmethod
    def verify_tensors(self, path: Path, threads: int) -> tuple[int, list[str]]:
        """Check a safetensors file tensor by tensor: ``(whole-file crc32c, unchecked names)``.

        Raises:
            CheckpointFormatError / ChecksumMismatchError: naming file and tensor.
        """

    @abstractmethod
    def open_tensors(
        self, path: Path, *, verify: bool = True, threads: int | None = None
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The tensors of a safetensors file and ``{"metadata", "file_crc32c"}``."""

    @abstractmethod
    def read_header(self, path: Path) -> dict[str, Any]:
        """A safetensors file's validated header, no tensor data read (the document of
        :func:`fastckpt.io.files.read_metadata`).

        Raises:
            CheckpointFormatError: malformed, damaged or truncated header.
        """

    @abstractmethod
    def list_dir(self, directory: Path) -> list[str]:
        """Names directly inside ``directory`` (empty when it does not exist)."""

    @abstractmethod
    def stage(
        self, final: Path, *, direct_io: bool | None = None, threads: int | None = None
    ) -> Staging:
        """Start writing the files of the container ``final``."""

    @abstractmethod
    def put_record(self, path: Path, data: bytes) -> None:
        """Replace a commit record atomically and durably (the commit point)."""

    @abstractmethod
    def delete(self, path: Path) -> None:
        """Remove a file or a whole directory; nothing there is fine."""

    @abstractmethod
    def lock(self, root: Path, *, timeout: float | None = None) -> WriterLock:
        """The exclusive writer lock of ``root`` (not yet acquired)."""

    def copy_file(self, source: Path, target: Path, size: int) -> bool:
        """Have the store copy the file ``source`` (``size`` bytes) to ``target``, without
        the bytes passing through this process (an object store's server-side copy). False
        when this backend cannot (a filesystem renames instead): nothing was written."""
        return False

    def prepare_writer(self) -> None:
        """Set up now what a writer's first save would otherwise set up on its way (clients,
        connections): a writer created before training calls this, so that its first save
        stalls no longer than the next. Nothing to do on a filesystem."""
        return None


# --------------------------------------------------------------------------- local filesystem

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _load_renameat2() -> Any:
    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):  # pragma: no cover - glibc < 2.28 or not Linux
        return None
    c_int, c_path = ctypes.c_int, ctypes.c_char_p
    function.argtypes = [c_int, c_path, c_int, c_path, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


_RENAMEAT2 = _load_renameat2()


def exchange_paths(a: Path, b: Path) -> bool:
    """Atomically swap two existing paths (``renameat2(RENAME_EXCHANGE)``).

    Returns:
        False when the kernel or filesystem cannot exchange (the caller falls back).

    Raises:
        OSError: the exchange failed for another reason.
    """
    if _RENAMEAT2 is None:  # pragma: no cover - see _load_renameat2
        return False
    if _RENAMEAT2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, f"cannot swap {a} into place: {os.strerror(code)}", str(b))


def _sibling(prefix: str, final: Path) -> Path:
    """A hidden sibling of ``final`` whose name says which process and host made it.

    Raises:
        OSError: (``ENAMETOOLONG``) the sibling's name would pass the filesystem's 255-byte
            limit; the message gives the longest name that fits.
    """
    # The last part: random, then the writer's start and boot (storage.identity.running).
    written_by = writer_tag()
    suffix = f".{written_by}" if written_by else ""
    tag = f"{final.name}~{os.getpid()}~{HOST}~{os.urandom(4).hex()}{suffix}"
    name = f"{prefix}{tag}"
    # os.fsencode: a name the filesystem holds need not be UTF-8 (b"caf\xe9", which Python
    # gives as a lone surrogate); str.encode raised a bare UnicodeEncodeError for it.
    extra = len(os.fsencode(name)) - len(os.fsencode(final.name))
    if len(os.fsencode(name)) > _NAME_MAX:
        raise OSError(
            errno.ENAMETOOLONG,
            f"{final}: the name {final.name[:40]!r}... is {len(os.fsencode(final.name))} bytes; "
            f"fastckpt writes it under a temporary name {extra} bytes longer, so names of at "
            f"most {_NAME_MAX - extra} bytes fit (the filesystem allows {_NAME_MAX}): use a "
            "shorter checkpoint name",
        )
    return final.parent / name


#: The longest file name (bytes) local filesystems allow.
_NAME_MAX = 255


def _owner(name: str) -> tuple[str, str, int, str, str] | None:
    """``(prefix, target name, pid, host, writer tag)`` of a temp/trash sibling name, or
    None; the tag is empty in names written before it was recorded."""
    for prefix in (TEMP_PREFIX, TRASH_PREFIX):
        if name.startswith(prefix):
            parts = name[len(prefix) :].rsplit("~", 3)
            # ASCII digits of a pid the kernel can have: "²" is a digit to str.isdigit and
            # int() refuses it; a 30-digit number made os.kill raise OverflowError.
            pid = parts[1] if len(parts) == 4 else ""
            if is_ascii_decimal(pid) and int(pid) < 1 << 31 and parts[0]:
                tag = parts[3].partition(".")[2]
                return prefix, parts[0], int(parts[1]), parts[2], tag
    return None


def _writer_gone(pid: int, host: str, tag: str) -> bool:
    """Whether the writer of a leftover is gone: no process has its pid, or the process
    that has it is another one (a reused pid, another boot)."""
    return gone(pid, host) or running(pid, host, tag) is False


#: This process's staging directories that are neither published nor discarded yet, each
#: with its :class:`LocalStaging`: one whose object is gone (a save interrupted, by Ctrl-C,
#: right after the directory was made, before its writer held it) is abandoned; so is one
#: registered with :func:`_discarded` (a removal that did not finish: no writer will use it
#: again, whenever the garbage collector frees its object).
_STAGED: dict[str, Callable[[], LocalStaging | None]] = {}
_STAGED_LOCK = ForkSafeLock()


def _discarded() -> LocalStaging | None:
    """What :data:`_STAGED` holds for a folder no writer uses any more (see there)."""
    return None


def _left_over(path: Path) -> None:
    """After an attempt to remove this process's staging folder ``path`` (a discarded
    staging, or the copy a publish replaced): forget it once gone, otherwise register it as
    abandoned, so that the next sweep in this process removes it (before round 22 that
    waited for the garbage collector to free the staging object, which an exception's
    traceback cycle kept alive: a leftover of a save out of file descriptors stayed)."""
    with _STAGED_LOCK:
        if os.path.lexists(path):
            _STAGED[str(path)] = _discarded
        else:
            _STAGED.pop(str(path), None)


def _abandoned(path: Path) -> bool:
    """Whether ``path`` is a staging directory of this process whose LocalStaging is gone."""
    with _STAGED_LOCK:
        ref = _STAGED.get(str(path))
        if ref is None or ref() is not None:
            return False
        del _STAGED[str(path)]
        return True


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        remove_tree(path)
    else:
        path.unlink(missing_ok=True)


def remove_tree(path: Path) -> None:
    """``rm -rf path`` that says when it could not: what stays (files of another user, a
    read-only folder, a tree left when the process had no file descriptor free) is named in
    a warning with the first error and the advice for it, instead of being left without a
    word at every attempt (a prune reporting space freed that was not)."""
    failures: list[BaseException] = []
    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=lambda *args: failures.append(args[2]))
    else:  # onerror: deprecated since 3.12, the only hook before
        shutil.rmtree(path, onerror=lambda *args: failures.append(args[2][1]))
    if failures and os.path.lexists(path):
        message = f"{path}: could not be deleted ({failures[0]}); {_left_because(failures[0])}"
        _LOG.warning("%s", message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def _left_because(error: BaseException) -> str:
    """What a tree :func:`remove_tree` could not delete means, and the fix, by its error: a
    lack of file descriptors passes (before, every error said "fix its permissions first")."""
    code = getattr(error, "errno", None)
    if code in NO_DESCRIPTORS:
        return f"{descriptor_advice(code)}; a later save or prune removes it"
    if code in (errno.EACCES, errno.EPERM):
        return "its bytes stay on disk until it is deleted by hand (fix its permissions first)"
    return "its bytes stay on disk until it is deleted"


def clean_dead_siblings(parent: Path) -> list[str]:
    """Remove what crashed local stagings left in ``parent``.

    Only siblings made on this host by processes that no longer exist are touched, so live
    writers (other ranks, other processes) are safe; and a temporary directory of a writer
    that cannot be proven dead (another host's or PID namespace's, a reused pid) once nothing
    in it changed for :data:`STALE_STAGING_SECONDS`. A leftover temporary directory is
    deleted. A leftover trash directory holds a complete previous checkpoint: it is put back
    if its checkpoint directory is missing (a crash between the two renames of the fallback
    publish), deleted otherwise.

    Returns:
        The names removed or restored.
    """
    touched: list[str] = []
    try:
        children = list(parent.iterdir())
    except FileNotFoundError:
        return touched
    for child in children:
        owner = _owner(child.name)
        if owner is None:
            continue
        prefix, target, pid, host, tag = owner
        if host == HOST and pid == os.getpid() and _abandoned(child):
            _remove(child)  # this process's staging, interrupted before anyone held it
            touched.append(child.name)
            continue
        if prefix == TRASH_PREFIX and host != HOST:
            # Another host's (or PID namespace's: fastckpt.storage.identity) replace that
            # never finished (its checkpoint put back) or that
            # is superseded (a checkpoint is in place again: the copy aside is obsolete).
            if os.path.lexists(parent / target) or not _holds_a_commit_record(child):
                _remove(child)
            elif not _put_back(child, parent / target):
                continue
            touched.append(child.name)
            continue
        if not _writer_gone(pid, host, tag):
            mine = pid == os.getpid() and host == HOST
            # A writer proven alive keeps its staging however long it was stopped (SIGSTOP,
            # a suspended VM or job; before, 24 h untouched by the wall clock removed it
            # under the live writer); one that cannot be proven either way loses it then.
            if (
                prefix == TEMP_PREFIX
                and not mine
                and running(pid, host, tag) is None
                and _untouched_for(child)
            ):
                _remove(child)
                touched.append(child.name)
            continue
        destination = parent / target
        if (
            prefix == TRASH_PREFIX
            and not os.path.lexists(destination)
            and _holds_a_commit_record(child)
        ):
            if not _put_back(child, destination):
                continue
        else:
            _remove(child)
        touched.append(child.name)
    return touched


def _untouched_for(path: Path, seconds: float = STALE_STAGING_SECONDS) -> bool:
    """Whether nothing in the tree ``path`` (the directory itself, every file and folder in
    it) was modified in the last ``seconds``: a live writer's staging holds at least the
    directory it made when it started and the files it is writing."""
    limit = time.time() - seconds
    try:
        if os.lstat(path).st_mtime > limit:
            return False
        for folder, dirs, files in os.walk(path):
            for name in (*dirs, *files):
                if os.lstat(os.path.join(folder, name)).st_mtime > limit:
                    return False
    except OSError:
        return False  # changing under us, or unreadable: not proven stale
    return True


def _put_back(trash: Path, destination: Path) -> bool:
    """Rename the trash directory ``trash`` back to ``destination`` when nothing is there:
    the previous checkpoint a replace without an exchange moved aside, its writer gone before
    the new one took its place. Safe whoever and wherever that writer is: one still between
    its two renames then fails its second (the place is taken) and keeps nothing of its own.
    """
    if os.path.lexists(destination) or not _holds_a_commit_record(trash):
        return False
    try:
        trash.rename(destination)
    except OSError:
        return False
    return True


def _holds_a_commit_record(directory: Path) -> bool:
    """Whether ``directory`` holds a checkpoint's commit record (a manager's or a sharded
    one): a copy moved aside whole, not what a deletion interrupted half-way left."""
    return any(
        os.path.isfile(directory / record) for record in ("commit.json", "fastckpt-dcp.json")
    )


def remove_replaced(path: Path) -> None:
    """Delete the copies a replace moved aside next to the checkpoint ``path`` (any host's):
    a checkpoint deliberately removed must not be put back by :func:`restore_replaced`."""
    try:
        children = list(path.parent.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return
    for child in children:
        owner = _owner(child.name)
        if owner is not None and owner[0] == TRASH_PREFIX and owner[1] == path.name:
            _remove(child)


def restore_replaced(parent: Path) -> list[str]:
    """Put back, in the local folder ``parent``, every checkpoint a replace moved aside and
    whose writer never put the new one in place: those of any host (a shared durable tier on
    NFS), and of dead processes of this one. A reader calls it before it lists ``parent``
    (a restore on another node would otherwise find nothing there). Returns the names put
    back."""
    restored: list[str] = []
    try:
        children = list(parent.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return restored
    for child in children:
        owner = _owner(child.name)
        if owner is None or owner[0] != TRASH_PREFIX:
            continue
        _, target, pid, host, tag = owner
        if (host != HOST or _writer_gone(pid, host, tag)) and _put_back(child, parent / target):
            restored.append(target)
    return restored


def stored_sizes(
    backend: StorageBackend, directory: Path, names: Sequence[str]
) -> list[int | None]:
    """The size of each file ``names`` of ``directory`` as the backend holds it (None: it is
    not there): one ``stat`` each, on an object store many at a time (a request each)."""

    def size(name: str) -> int | None:
        try:
            return backend.stat(directory / name).size
        except FileNotFoundError:
            return None

    if isinstance(backend, LocalFileSystem) or len(names) < 2:
        return [size(name) for name in names]
    with ThreadPoolExecutor(min(32, len(names)), "fastckpt-stat") as pool:
        return list(pool.map(size, names))


def disk_refused(err: BaseException) -> bool:
    """Whether ``err`` is a disk refusing a write as such (full, over quota, read-only): it
    says nothing about what was being written (an incremental save's base, for one)."""
    return isinstance(err, OSError) and err.errno in (*NO_ROOM, errno.EROFS)


#: The longest path (bytes, the terminating NUL included) Linux takes (``PATH_MAX``).
_PATH_MAX = 4096


def _path_too_long(err: OSError) -> bool:
    """Whether ``err`` is ``ENAMETOOLONG`` for a whole path past :data:`_PATH_MAX`, every
    name in it within the 255 bytes a name may have (a name too long says so itself, see
    :func:`_sibling`)."""
    if err.errno != errno.ENAMETOOLONG or not err.filename:
        return False
    parts = os.fsencode(err.filename).split(b"/")
    return all(len(part) <= _NAME_MAX for part in parts)


#: What :func:`explain_full_disk` says a failed save left by default.
_SAVE_KEPT = "nothing of this save was committed and the checkpoints saved before are intact"


@contextlib.contextmanager
def explain_full_disk(
    target: str | os.PathLike[str],
    *,
    doing: str = "saving",
    kept: str = _SAVE_KEPT,
    again: str = "save",
    filename: str | None = None,
) -> Iterator[None]:
    """Re-raise a full (or read-only) disk met while saving ``target``, a file past the
    file-size limit (``EFBIG``: ``ulimit -f``), or a path under it past ``PATH_MAX``, as the
    same ``OSError`` (errno and file kept) whose message names the checkpoint and the way
    out; other errors pass.

    Other writers say what they were ``doing`` ("exporting to"), what a failure leaves
    (``kept``), the command to run ``again`` ("export"), and the path to name as the error's
    ``filename`` (default: the file the error names, which may be a hidden temporary one)."""
    try:
        yield
    except ScratchSpaceError:
        raise  # a full local scratch folder: its message names it and the fix
    except OSError as err:
        too_large = err.errno == errno.EFBIG
        if err.errno is None or not (disk_refused(err) or too_large or _path_too_long(err)):
            raise
        where = err.filename or os.fspath(target)
        if err.errno == errno.ENAMETOOLONG:
            fix = (
                f"the path of a file it writes, {len(os.fsencode(where))} bytes, passes the "
                f"limit of {_PATH_MAX} bytes the system sets on a whole path: {again} into a "
                "folder with a shorter path"
            )
        elif err.errno == errno.EROFS:
            fix = f"remount it read-write (or {again} elsewhere) and {again} again"
        elif too_large:
            fix = f"{file_size_advice()}, and {again} again"
        else:
            fix = (
                f"{free_space_advice(where)} (`fastckpt prune ROOT --keep-last N` deletes "
                f"older checkpoints) and {again} again"
            )
        raise OSError(
            err.errno,
            f"{os.strerror(err.errno)} while {doing} {os.fspath(target)}: {kept}; {fix}",
            filename if filename is not None else where,
        ) from err


def make_dirs(directory: Path) -> None:
    """``mkdir -p`` that names the file standing in the way, if one does, and makes every
    directory it creates durable: the parent of each is fsynced (a save that returns must not
    lose its new root to a power cut)."""
    created = []
    for ancestor in (directory, *directory.parents):
        if os.path.islink(ancestor) and not ancestor.exists():
            raise FileNotFoundError(
                errno.ENOENT,
                f"cannot create {directory}: {ancestor} is a symlink to "
                f"{os.readlink(ancestor)}, which does not exist (a disk not mounted?); mount "
                "or create its target, or remove the link",
                str(ancestor),
            )
        if ancestor.exists():
            if not ancestor.is_dir():
                raise NotADirectoryError(
                    errno.ENOTDIR, f"cannot create {directory}: a file is in the way", str(ancestor)
                )
            break
        created.append(ancestor)
    directory.mkdir(parents=True, exist_ok=True)
    for made in created:  # deepest first; each one's entry lives in its parent
        _native.fsync_dir(str(made.parent))


class LocalStaging(Staging):
    """A hidden temporary sibling of ``final``, swapped into place by :meth:`publish`.

    Creating it first removes what crashed writers (dead processes of this host) left next to
    ``final``. :meth:`publish` fsyncs every file and directory, then puts the directory in
    place: an existing ``final`` is exchanged atomically (``renameat2(RENAME_EXCHANGE)``; where
    the filesystem cannot, it is renamed aside first and a crash in between is repaired by the
    next writer) and deleted after.
    """

    def __init__(
        self, final: Path, *, direct_io: bool | None = None, threads: int | None = None
    ) -> None:
        """Create the temporary sibling directory of ``final``."""
        self.final = final
        self.direct_io = direct_io
        self.threads = threads
        make_dirs(final.parent)
        clean_dead_siblings(final.parent)
        self.temp = _sibling(TEMP_PREFIX, final)
        with _STAGED_LOCK:
            _STAGED[str(self.temp)] = weakref.ref(self)
        self.temp.mkdir()
        self.files = {}
        #: relpath -> ``(st_dev, st_ino, st_size, st_mtime_ns)`` of each file as
        #: :meth:`publish` put it in place (read before the swap: after it, ``final`` may
        #: already hold another writer's directory).
        self.identities: dict[str, tuple[int, int, int, int]] = {}
        self._dirs: set[Path] = {self.temp}
        #: Whether :meth:`publish` put the directory in place (:meth:`discard` then keeps
        #: what the temporary name holds: the replaced content).
        self._published = False
        #: relpaths hard-linked from committed files, and the ``(size, mtime)`` under which
        #: :meth:`put_proven_link` proved each of its links.
        self._linked: set[str] = set()
        self._proofs: dict[str, tuple[int, int]] = {}

    @property
    def location(self) -> str:
        """The temporary directory."""
        return str(self.temp)

    def _target(self, relpath: str) -> Path:
        check_relpath(relpath, "file")
        path = self.temp / relpath
        if path.parent not in self._dirs:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._dirs.add(path.parent)
        return path

    def put_bytes(self, relpath: str, data: bytes) -> FileRecord:
        """Write ``data`` (fsynced) and record its size and crc32c."""
        _native.write_bytes_atomic(str(self._target(relpath)), data, True)
        record = {"size": len(data), "crc32c": _native.crc32c(data)}
        self.files[relpath] = record
        return record

    def written_header(self, relpath: str) -> dict[str, Any]:
        """The header of the staged file at ``relpath`` (read from the local disk)."""
        return read_metadata(self._target(relpath))

    def put_tensors(
        self,
        relpath: str,
        tensors: Mapping[str, torch.Tensor],
        copies: Mapping[str, CopySource] | None = None,
        *,
        metadata: Mapping[str, str] | None = None,
    ) -> FileRecord:
        """Write a safetensors file (fsynced) and record its size and crc32c; tensors staged
        into a file image are written straight from it (no copy) unless ``metadata`` is
        given (an image's header is fixed when it is staged).

        Raises:
            ValueError: ``copies`` given (a local root references unchanged tensors).
        """
        if copies:
            raise ValueError(
                f"{self.final}: a local checkpoint references unchanged tensors instead of "
                "copying them"
            )
        # Deferred: torch is imported by the tensor writers only, so that listing and verifying
        # (which use this module) start without it.
        from fastckpt.io.files import write_tensors
        from fastckpt.io.images import find_image, write_image

        image = find_image(tensors) if metadata is None else None
        target = self._target(relpath)
        try:
            if image is not None:
                report = write_image(image, target, direct_io=self.direct_io, threads=self.threads)
            else:
                report = write_tensors(
                    tensors, target, metadata, direct_io=self.direct_io, threads=self.threads
                )
        except InvalidInputError as err:
            # The core names the staged file; the caller knows the one it asked for.
            message = str(err).removeprefix(f"{target}: ")
            raise InvalidInputError(f"{self.final / relpath}: {message}") from None
        record = {"size": report["file_len"], "crc32c": report["file_crc32c"]}
        self.files[relpath] = record
        return record

    def put_link(
        self, relpath: str, source: Path, record: FileRecord, identity: tuple[int, int]
    ) -> None:
        """Hard-link the committed file ``source`` as ``relpath`` (no byte copied; the
        directory entry is fsynced at :meth:`publish`) and record it with ``record`` (the
        source's size and crc32c). ``identity``: the ``(st_dev, st_ino)`` the caller checked
        ``source`` under; a link to any other inode (``source`` replaced meanwhile) is
        removed again.

        Raises:
            OSError: no hard link possible here (EXDEV, EPERM, EMLINK...) or the inode
                differs (FileExistsError); nothing is recorded.
        """
        check_relpath(relpath, "file")
        target = self.temp / relpath
        made = not target.parent.is_dir()
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            os.link(source, target, follow_symlinks=False)
            linked = os.stat(target, follow_symlinks=False)
            if not stat.S_ISREG(linked.st_mode) or (linked.st_dev, linked.st_ino) != identity:
                raise FileExistsError(errno.EEXIST, "the source file was replaced", str(source))
        except BaseException:
            with contextlib.suppress(OSError):
                target.unlink()
            if made:
                with contextlib.suppress(OSError):
                    target.parent.rmdir()  # no empty folder left in the checkpoint
            raise
        self._dirs.add(target.parent)
        self.files[relpath] = dict(record)
        self._linked.add(relpath)

    def identity(self, relpath: str) -> Hashable | None:
        """``(st_dev, st_ino)`` of the staged file (publishing renames its directory: the
        inode stays)."""
        info = os.stat(self._target(relpath), follow_symlinks=False)
        return (info.st_dev, info.st_ino)

    def put_proven_link(self, relpath: str, source: Path, record: FileRecord) -> bool:
        """Hard-link the committed file ``source`` as ``relpath`` (:meth:`put_link`) once its
        bytes are proven to be ``record``'s (size and crc32c): this process wrote or read back
        that inode in full and its size and modification time have not moved since
        (:data:`_PROVEN`), or else the linked inode is read back now. An earlier checkpoint's
        file changed in place (``dd conv=notrunc``, a disk's bit flip found at this read) is
        never linked into a new one: False, with a warning naming it, and the caller writes
        its tensors from memory. False also where no hard link can be made here.
        """
        try:
            info = os.stat(source, follow_symlinks=False)
        except OSError:
            return False
        try:
            self.put_link(relpath, source, record, (info.st_dev, info.st_ino))
        except OSError as err:
            _LOG.info("%s: not linked here (%s)", source, err)
            return False
        linked = self._target(relpath)
        expected = (int(record["size"]), int(record["crc32c"]))
        try:
            now = os.stat(linked, follow_symlinks=False)  # the linked inode, as it is now
        except OSError:
            self._unlink_staged(relpath)
            return False
        if not _is_proven(now, record):
            try:
                got: tuple[int, int] | None = _file_checksum(linked)
                after = os.stat(linked, follow_symlinks=False)
            except OSError:
                got = None
            if got != expected:
                self._unlink_staged(relpath)
                _LOG.warning(
                    "%s: its bytes are no longer the ones its checkpoint recorded (size, crc32c "
                    "%s, read back: %s): it was changed in place or damaged, and every "
                    "checkpoint that shares it is damaged too (fastckpt verify names them); "
                    "this save writes its tensors from memory instead of linking it",
                    source,
                    expected,
                    got,
                )
                return False
            if (after.st_size, after.st_mtime_ns) != (now.st_size, now.st_mtime_ns):
                # Written to while it was read: what was read proves nothing (review 1).
                self._unlink_staged(relpath)
                _LOG.warning(
                    "%s: changed while this save read it back; its tensors are written from "
                    "memory instead of linking it",
                    source,
                )
                return False
            _remember_proven(after, expected[1])
        # publish() remembers the file as proven only if it is still as it was proven here:
        # a write into it while the rest of the index is written moves its time (review 1).
        self._proofs[relpath] = (now.st_size, now.st_mtime_ns)
        return True

    def _unlink_staged(self, relpath: str) -> None:
        """Forget and remove a staged file (a link that is not to be kept)."""
        self.files.pop(relpath, None)
        with contextlib.suppress(OSError):
            self._target(relpath).unlink()

    def put_copy(self, relpath: str, source: Path, record: FileRecord, identity: Hashable) -> bool:
        """A hard link to ``source`` (:meth:`put_link`) when it is still the inode
        ``identity`` names and the linked bytes are proven to be ``record``'s (read back:
        size and crc32c). An inode number is no proof on its own: a file deleted since may
        have handed its number to another one, and a file may be rewritten in place. False
        where no link can be made, the inode differs or the bytes do (the link is removed).
        """
        if not isinstance(identity, tuple) or len(identity) != 2:
            return False
        try:
            self.put_link(relpath, source, record, (int(identity[0]), int(identity[1])))
        except OSError:
            return False
        linked = self._target(relpath)
        try:
            proven = _file_checksum(linked) == (int(record["size"]), int(record["crc32c"]))
        except OSError:
            proven = False
        if not proven:
            del self.files[relpath]
            with contextlib.suppress(OSError):
                linked.unlink()
        return proven

    def adopt(self, location: str, relpath: str, record: FileRecord) -> None:
        """Move a file from another staging directory into this one."""
        Path(location, relpath).rename(self._target(relpath))
        self.files[relpath] = dict(record)

    def publish(self) -> None:
        """fsync every directory, swap the temporary directory into place, fsync the parent."""
        for directory in sorted(self._dirs, key=lambda p: len(p.parts), reverse=True):
            _native.fsync_dir(str(directory))
        for relpath, record in self.files.items():
            info = os.stat(self.temp / relpath, follow_symlinks=False)
            self.identities[relpath] = (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)
            crc = record.get("crc32c")
            proof: tuple[int, int] | None = self._proofs.get(
                relpath, (info.st_size, info.st_mtime_ns)
            )
            if relpath in self._linked and relpath not in self._proofs:
                proof = None  # linked on another proof (the manager's): not this process's
            if (
                isinstance(crc, int)
                and record.get("size") == info.st_size
                and proof == (info.st_size, info.st_mtime_ns)
            ):
                _remember_proven(info, crc)  # written, or proven and unchanged since
        old: Path | None = None
        if os.path.lexists(self.final):
            if exchange_paths(self.temp, self.final):
                old = self.temp  # now holds the previous content
            else:
                old = _sibling(TRASH_PREFIX, self.final)
                try:
                    self.final.rename(old)
                    self.temp.rename(self.final)
                except BaseException:
                    # Interrupted (Ctrl-C) or failed between the two renames: the previous
                    # checkpoint goes back (a crash here is repaired by the next writer).
                    if not os.path.lexists(self.final) and os.path.lexists(old):
                        old.rename(self.final)
                    raise
        else:
            self.temp.rename(self.final)
        self._published = True
        try:
            _native.fsync_dir(str(self.final.parent))
        except OSError as err:
            # The swap took effect but may not survive a power cut, which could bring the
            # previous content back: it is kept (under its staging name, which the sweep
            # of a later process removes), never deleted here.
            self._settled()
            raise CommitNotDurableError.after(err, self.final, kept=old) from err
        self._settled()
        if old is not None:
            # A removal interrupted (Ctrl-C in a large tree) or unfinished leaves the replaced
            # copy to the next sweep in this process (before, only a later process's sweep
            # removed it: a checkpoint-sized leftover per interrupted save, round 22). While
            # it runs, the copy is this live staging's: no other thread's sweep takes it.
            with _STAGED_LOCK:
                _STAGED[str(old)] = weakref.ref(self)
            try:
                _remove(old)
            finally:
                _left_over(old)

    def discard(self) -> None:
        """Remove the temporary directory; one that cannot be removed (the process out of file
        descriptors) is named in a warning (:func:`remove_tree`), no longer left silently.
        After :meth:`publish` renamed it into place nothing is removed: the temporary name
        then holds the replaced content, kept when the commit's ``fsync`` failed."""
        if self._published:
            return
        try:
            remove_tree(self.temp)
        finally:
            _left_over(self.temp)  # what remains, the next sweep in this process removes

    def _settled(self) -> None:
        with _STAGED_LOCK:
            _STAGED.pop(str(self.temp), None)


class LocalFileSystem(StorageBackend):
    """The local (or network-mounted POSIX) filesystem."""

    def stat(self, path: Path) -> ObjectInfo:
        """``os.stat`` (symlinks followed: callers check containment with ``safe_join``)."""
        info = os.stat(path)
        return ObjectInfo(info.st_size, stat.S_ISREG(info.st_mode), info.st_mtime)

    def exists(self, path: Path) -> bool:
        """``os.path.lexists``."""
        return os.path.lexists(path)

    def is_directory(self, path: Path) -> bool:
        """``os.path.isdir`` (symlinks followed)."""
        return os.path.isdir(path)

    def read_bytes(self, path: Path, *, limit: int = MAX_RECORD_BYTES) -> bytes:
        """Read a regular file whole; FIFOs and devices are refused before any read."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except IsADirectoryError:
            raise IsADirectoryError(errno.EISDIR, f"{path}: is a directory", str(path)) from None
        with os.fdopen(fd, "rb") as handle:
            info = os.fstat(fd)
            if stat.S_ISDIR(info.st_mode):
                raise IsADirectoryError(errno.EISDIR, f"{path}: is a directory", str(path))
            if not stat.S_ISREG(info.st_mode):
                raise CheckpointFormatError(f"{path}: not a regular file")
            if info.st_size > limit:
                raise CheckpointFormatError(
                    f"{path}: {info.st_size} bytes, more than the {limit} a record may have"
                )
            data = read_by_size(handle, info.st_size, limit, path)
        if len(data) > limit:
            raise CheckpointFormatError(f"{path}: more than the {limit} bytes a record may have")
        return data

    def read_range(self, path: Path, offset: int, length: int) -> bytes:
        """``pread`` of one range."""
        with open(path, "rb") as handle:
            return os.pread(handle.fileno(), length, offset)

    def checksum(self, path: Path) -> tuple[int, int]:
        """``(size, crc32c)`` read in 16 MiB pieces."""
        return _file_checksum(path)

    def verify_tensors(self, path: Path, threads: int) -> tuple[int, list[str]]:
        """The Rust verifier (GIL released)."""
        crc, unchecked = _native.verify_file(str(path), threads)
        return crc, list(unchecked)

    def open_tensors(
        self, path: Path, *, verify: bool = True, threads: int | None = None
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """A private mapping of the file (:func:`fastckpt.io.files.read_tensors`), verified bytes
        counted on the :func:`fastckpt.io.progress.active_counter` if one is set."""
        from fastckpt.io.files import read_tensors  # deferred: torch, for tensor reads only

        return read_tensors(path, verify=verify, threads=threads, progress=active_counter())

    def read_header(self, path: Path) -> dict[str, Any]:
        """:func:`fastckpt.io.files.read_metadata`."""
        return read_metadata(path)

    def list_dir(self, directory: Path) -> list[str]:
        """``os.listdir`` (empty for a missing directory; a folder this user may not read
        is :func:`read_refused`, naming its owner and the fix)."""
        try:
            return sorted(os.listdir(directory))
        except (FileNotFoundError, NotADirectoryError):
            return []
        except PermissionError as err:
            raise read_refused(directory, err) from err

    def stage(
        self, final: Path, *, direct_io: bool | None = None, threads: int | None = None
    ) -> LocalStaging:
        """A :class:`LocalStaging` next to ``final``."""
        return LocalStaging(final, direct_io=direct_io, threads=threads)

    def put_record(self, path: Path, data: bytes) -> None:
        """Temp file + fsync + rename + fsync of the directory (the Rust core)."""
        _native.write_bytes_atomic(str(path), data, True)

    def delete(self, path: Path) -> None:
        """Remove a file, a symlink or a directory tree."""
        _remove(path)

    def lock(self, root: Path, *, timeout: float | None = None) -> RootLock:
        """A :class:`~fastckpt.storage.lock.RootLock` on ``root``."""
        return RootLock(root, timeout=timeout)


LOCAL = LocalFileSystem()
