"""The on-disk layout of a checkpoint root: the manifest and atomic commits of index directories.

```
ROOT/manifest.json     the commit record (schema_version, latest, one entry per committed index)
ROOT/<index>/          one self-contained directory per committed index
ROOT/.tmp-<...>/       an index being written (removed by the next save if a crash left it)
ROOT/.fastckpt.lock    held (flock) by the one process saving into ROOT; gone when none is
```

An index is written into a temporary sibling, every file and directory fsynced, renamed into
place, then ``manifest.json`` is replaced atomically (temp + fsync + rename + fsync(ROOT)). The
manifest is the commit point: nothing it names is partial. Writers of one root are serialized
by an exclusive ``flock`` (:class:`RootLock`), which the kernel drops when its holder dies, so
a killed writer never leaves a stale lock. Nothing read from the manifest is trusted: names
are checked before they touch the filesystem, and :func:`safe_join` refuses files that resolve
(through symlinks) outside the checkpoint.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import os
import re
import shutil
import socket
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fastckpt import _native
from fastckpt.errors import CheckpointFormatError, ChecksumMismatchError
from fastckpt.files import write_tensors

__all__ = [
    "ENTRY_FIELDS",
    "LOCK_FILE",
    "MANIFEST",
    "MANIFEST_CRC_FIELD",
    "SCHEMA_VERSION",
    "DirectoryWriter",
    "IndexWriter",
    "Manifest",
    "RootLock",
    "check_name",
    "check_relpath",
    "clean_dead_siblings",
    "clean_leftovers",
    "exchange_paths",
    "safe_join",
    "seal_manifest",
]

MANIFEST = "manifest.json"
LOCK_FILE = ".fastckpt.lock"
SCHEMA_VERSION = 1
TEMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
#: Top-level manifest field holding the crc32c of the rest of the document (see Manifest).
MANIFEST_CRC_FIELD = "crc32c"
_MANIFEST_FIELDS = frozenset(
    {"format", "schema_version", "latest", "checkpoints", MANIFEST_CRC_FIELD}
)
#: Fields every manifest entry has (written by fastckpt.checkpoint.write_snapshot).
ENTRY_FIELDS = ("created", "counters", "components", "associations", "files")


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
            f"{what} {name!r} is not a valid name: use a non-empty name without path "
            "separators, NUL, or a leading '.'"
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


# --------------------------------------------------------------------------- the manifest


def _canonical(document: Mapping[str, Any]) -> bytes:
    """The bytes the manifest checksum covers: the document without the checksum field, in a
    canonical encoding (so indentation does not matter, every value does)."""
    body = {k: v for k, v in document.items() if k != MANIFEST_CRC_FIELD}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def seal_manifest(document: dict[str, Any]) -> dict[str, Any]:
    """Set the ``crc32c`` field of a hand-edited manifest document to match its content.

    For tools and tests that edit ``manifest.json`` on purpose; returns ``document``.
    """
    document[MANIFEST_CRC_FIELD] = _native.crc32c(_canonical(document))
    return document


@dataclass
class Manifest:
    """The commit record of a checkpoint root.

    The serialized manifest carries a ``crc32c`` of its own canonical content, so damage to
    the fields no other check covers (counters, associations, timestamps) is detectable:
    :meth:`load` with ``verify_checksum=True`` (what :func:`fastckpt.verify.verify` uses)
    refuses a manifest whose checksum does not match.

    Attributes:
        root: the checkpoint root directory.
        entries: index -> entry (``created``, ``counters``, ``components``, ``files``...).
        stored_crc32c: the checksum read from disk (None: absent, or not loaded from disk).
        actual_crc32c: the checksum of what was read (None when not loaded from disk).
    """

    root: Path
    entries: dict[int, dict[str, Any]] = field(default_factory=dict)
    stored_crc32c: int | None = None
    actual_crc32c: int | None = None

    @property
    def latest(self) -> int | None:
        """The newest committed index, or None for an empty root."""
        return max(self.entries) if self.entries else None

    @classmethod
    def load(cls, root: str | os.PathLike[str], *, verify_checksum: bool = False) -> Manifest:
        """Read and validate ``ROOT/manifest.json``; an absent manifest is an empty root.

        Args:
            root: the checkpoint root.
            verify_checksum: also require the manifest's own crc32c to match its content
                (manifests written before the checksum existed have none and pass).

        Raises:
            CheckpointFormatError: malformed JSON, unknown schema, invalid names or fields.
            ChecksumMismatchError: ``verify_checksum`` and the content does not match.
        """
        root = Path(root)
        path = root / MANIFEST
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return cls(root)
        except IsADirectoryError:
            raise CheckpointFormatError(f"{path}: is a directory, not a manifest") from None
        data = _load_json(path, raw)
        entries = _parse_entries(path, data)
        stored = data.get(MANIFEST_CRC_FIELD)
        if stored is not None and (not isinstance(stored, int) or isinstance(stored, bool)):
            raise CheckpointFormatError(f"{path}: field {MANIFEST_CRC_FIELD!r} must be an int")
        actual = _native.crc32c(_canonical(data))
        manifest = cls(root, entries, stored, actual)
        if verify_checksum:
            unknown = sorted(set(data) - _MANIFEST_FIELDS)
            if unknown:
                raise CheckpointFormatError(f"{path}: unexpected field(s) {unknown}")
            if stored is not None and stored != actual:
                raise ChecksumMismatchError(
                    f"{path}: content crc32c {actual:08x} differs from the recorded "
                    f"{stored:08x} (field {MANIFEST_CRC_FIELD!r}); the manifest is corrupt or "
                    "was edited: restore it from a copy"
                )
        return manifest

    def to_json(self) -> bytes:
        """Serialized manifest (with its own checksum)."""
        document: dict[str, Any] = {
            "format": "fastckpt",
            "schema_version": SCHEMA_VERSION,
            "latest": self.latest,
            "checkpoints": {str(i): self.entries[i] for i in sorted(self.entries)},
        }
        return json.dumps(seal_manifest(document), indent=1, sort_keys=False).encode()

    def commit(self) -> None:
        """Replace ``manifest.json`` atomically and durably."""
        _native.write_bytes_atomic(str(self.root / MANIFEST), self.to_json(), True)

    def resolve(self, index: int) -> int:
        """Map ``-1`` to the latest index and check that ``index`` is committed.

        Raises:
            FileNotFoundError: the root has no committed checkpoint.
            KeyError: ``index`` is not committed (lists the available ones).
        """
        if not self.entries:
            raise FileNotFoundError(f"{self.root / MANIFEST}: no committed checkpoint here")
        if index == -1:
            return self.latest  # type: ignore[return-value]
        if index not in self.entries:
            raise KeyError(
                f"checkpoint index {index} is not in {self.root / MANIFEST}; "
                f"available: {sorted(self.entries)}"
            )
        return index


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    document: dict[str, Any] = {}
    for key, value in pairs:
        if key in document:
            raise CheckpointFormatError(f"duplicate key {key!r}")
        document[key] = value
    return document


def _load_json(path: Path, raw: bytes) -> Any:
    """Parse a manifest: invalid UTF-8/JSON, absurd nesting or numbers, and duplicate keys
    (which JSON parsers silently resolve) are all format errors naming the file."""
    try:
        return json.loads(raw, object_pairs_hook=_unique_keys)
    except CheckpointFormatError as err:
        raise CheckpointFormatError(f"{path}: {err}") from None
    except (ValueError, RecursionError) as err:  # JSONDecodeError, UnicodeDecodeError, ...
        raise CheckpointFormatError(f"{path}: not valid JSON ({err})") from None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _parse_entries(path: Path, data: Any) -> dict[int, dict[str, Any]]:
    if not isinstance(data, dict):
        raise CheckpointFormatError(f"{path}: manifest must be a JSON object")
    version = data.get("schema_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise CheckpointFormatError(f"{path}: field 'schema_version' missing or not an int")
    if version > SCHEMA_VERSION:
        raise CheckpointFormatError(
            f"{path}: schema_version {version} was written by a newer fastckpt (this one reads "
            f"up to {SCHEMA_VERSION}); upgrade fastckpt to load it"
        )
    if version < 1:
        raise CheckpointFormatError(f"{path}: schema_version {version} does not exist")
    if data.get("format", "fastckpt") != "fastckpt":
        raise CheckpointFormatError(f"{path}: field 'format' must be \"fastckpt\"")
    checkpoints = data.get("checkpoints")
    if not isinstance(checkpoints, dict):
        raise CheckpointFormatError(f"{path}: field 'checkpoints' must be an object")
    entries: dict[int, dict[str, Any]] = {}
    for key, entry in checkpoints.items():
        if not (key.isdigit() and len(key) <= 18 and str(int(key)) == key):
            raise CheckpointFormatError(f"{path}: checkpoint index {key!r} is not an integer")
        where = f"{path}: checkpoints.{key}"
        if not isinstance(entry, dict) or not isinstance(entry.get("files"), dict):
            raise CheckpointFormatError(f"{where}.files must be an object")
        for relpath, record in entry["files"].items():
            check_relpath(relpath, f"{where}.files entry")
            if not (
                isinstance(record, dict)
                and _is_int(record.get("size"))
                and _is_int(record.get("crc32c"))
                and record["size"] >= 0
                and 0 <= record["crc32c"] <= 0xFFFFFFFF
            ):
                raise CheckpointFormatError(
                    f"{where}.files[{relpath!r}] needs int size >= 0 and a 32-bit crc32c"
                )
        _check_entry_fields(where, entry)
        entries[int(key)] = entry
    latest = data.get("latest", max(entries, default=None))
    if latest != max(entries, default=None) or isinstance(latest, bool):
        raise CheckpointFormatError(
            f"{path}: field 'latest' ({latest!r}) is not the newest committed index "
            f"({max(entries, default=None)!r})"
        )
    return entries


def _check_entry_fields(where: str, entry: dict[str, Any]) -> None:
    """Check the entry fields loaders rely on, types and cross-references, so that a damaged
    or hostile manifest fails here with a typed error instead of deep inside a loader, or,
    worse, loading less than was saved (a renamed ``associations`` key would silently drop
    optimizers)."""
    missing = [name for name in ENTRY_FIELDS if name not in entry]
    if missing:
        raise CheckpointFormatError(f"{where}: missing field(s) {missing}")
    if not isinstance(entry["created"], str):
        raise CheckpointFormatError(f"{where}.created must be a string")
    if not isinstance(entry["counters"], dict):
        raise CheckpointFormatError(f"{where}.counters must be an object")
    components = entry["components"]
    if not isinstance(components, dict):
        raise CheckpointFormatError(f"{where}.components must be an object")
    names: dict[str, set[str]] = {}
    for kind, listed in components.items():
        if not isinstance(listed, list):
            raise CheckpointFormatError(f"{where}.components.{kind} must be a list of names")
        names[kind] = {check_name(name, f"{where}.components.{kind} entry") for name in listed}
        if len(names[kind]) != len(listed):
            raise CheckpointFormatError(f"{where}.components.{kind} lists a name twice")
    associations = entry["associations"]
    if not isinstance(associations, dict):
        raise CheckpointFormatError(f"{where}.associations must be an object")
    # optimizer -> its model (or null), scheduler -> its optimizer
    for kind, target_kind in (("optimizers", "models"), ("schedulers", "optimizers")):
        mapping = associations.get(kind, {})
        if not isinstance(mapping, dict):
            raise CheckpointFormatError(f"{where}.associations.{kind} must be an object")
        if set(mapping) != names.get(kind, set()):
            raise CheckpointFormatError(
                f"{where}.associations.{kind} names {sorted(mapping)} but components.{kind} "
                f"lists {sorted(names.get(kind, set()))}"
            )
        for name, target in mapping.items():
            allowed_none = kind == "optimizers"
            if not (
                (target is None and allowed_none)
                or (isinstance(target, str) and target in names.get(target_kind, set()))
            ):
                raise CheckpointFormatError(
                    f"{where}.associations.{kind}.{name} = {target!r} is not one of "
                    f"components.{target_kind}"
                )


def json_bytes(document: Any) -> bytes:
    """Canonical JSON encoding of a checkpoint document (NaN refused: it is not JSON)."""
    return json.dumps(document, indent=1, allow_nan=False).encode()


# --------------------------------------------------------------------------- the root lock


class RootLock:
    """Exclusive inter-process lock on a checkpoint root: ``flock`` on ``ROOT/.fastckpt.lock``.

    The kernel releases a ``flock`` when its holder exits, however it exits (SIGKILL
    included), so a crashed writer never leaves a stale lock. The lock file is deleted on
    release; an acquirer that locked a file deleted meanwhile notices (inode check) and
    retries, so two processes can never both believe they hold the lock. Each
    :class:`RootLock` object is one lock owner: two objects exclude each other even inside one
    process. Works on local filesystems and on NFS (where Linux maps ``flock`` to POSIX locks).

    Use as a context manager, or :meth:`acquire` / :meth:`release`.
    """

    def __init__(self, root: str | os.PathLike[str], *, timeout: float | None = None) -> None:
        """Prepare to lock ``root`` (which must exist); ``timeout`` None waits forever."""
        self.path = Path(root) / LOCK_FILE
        self.timeout = timeout
        self._fd: int | None = None
        self._finalizer: weakref.finalize[Any, Any] | None = None

    @property
    def held(self) -> bool:
        """Whether this object holds the lock."""
        return self._fd is not None

    def acquire(self) -> None:
        """Block until the lock is held.

        Raises:
            TimeoutError: ``timeout`` elapsed first (the message names the lock file).
            OSError: the lock file cannot be created (e.g. read-only root).
        """
        if self._fd is not None:
            raise RuntimeError(f"{self.path}: already held by this RootLock")
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                self._flock(fd, deadline)
                if self._is_current(fd):
                    self._fd = fd
                    self._finalizer = weakref.finalize(self, os.close, fd)
                    return
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)  # we locked a lock file its previous holder had deleted: retry

    def _flock(self, fd: int, deadline: float | None) -> None:
        if deadline is None:
            fcntl.flock(fd, fcntl.LOCK_EX)
            return
        pause = 0.001
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        errno.ETIMEDOUT,
                        f"another process is saving into {self.path.parent} (it holds "
                        f"{self.path}) and did not finish within {self.timeout} s; wait for "
                        "it or save into another root",
                        str(self.path),
                    ) from None
                time.sleep(pause)
                pause = min(pause * 2, 0.05)

    def _is_current(self, fd: int) -> bool:
        try:
            now = os.stat(self.path)
        except FileNotFoundError:
            return False
        mine = os.fstat(fd)
        return (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino)

    def release(self) -> None:
        """Delete the lock file and release the lock (idempotent)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        try:
            self.path.unlink(missing_ok=True)
        finally:
            os.close(fd)

    def __enter__(self) -> RootLock:
        """Acquire on entry."""
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        """Release on exit."""
        self.release()


# --------------------------------------------------------------------------- directory commits

_HOST = re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname())[:64] or "host"
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
    """A hidden sibling of ``final`` whose name says which process and host made it."""
    tag = f"{final.name}~{os.getpid()}~{_HOST}~{os.urandom(4).hex()}"
    return final.parent / f"{prefix}{tag}"


def _owner(name: str) -> tuple[str, str, int, str] | None:
    """``(prefix, target name, pid, host)`` of a temp/trash sibling name, or None."""
    for prefix in (TEMP_PREFIX, TRASH_PREFIX):
        if name.startswith(prefix):
            parts = name[len(prefix) :].rsplit("~", 3)
            if len(parts) == 4 and parts[1].isdigit() and parts[0]:
                return prefix, parts[0], int(parts[1]), parts[2]
    return None


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def clean_dead_siblings(parent: Path) -> list[str]:
    """Remove what crashed :class:`DirectoryWriter` commits left in ``parent``.

    Only siblings made on this host by processes that no longer exist are touched, so live
    writers (other ranks, other processes) are safe. A leftover temporary directory is
    deleted. A leftover trash directory holds a complete previous checkpoint: it is put back
    if its checkpoint directory is missing (a crash between the two renames of the fallback
    commit), deleted otherwise.

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
        prefix, target, pid, host = owner
        if host != _HOST or _alive(pid):
            continue
        destination = parent / target
        if prefix == TRASH_PREFIX and not os.path.lexists(destination):
            try:
                child.rename(destination)
            except OSError:
                continue
        else:
            _remove(child)
        touched.append(child.name)
    return touched


def _make_dirs(directory: Path) -> None:
    for ancestor in (directory, *directory.parents):
        if ancestor.exists() and not ancestor.is_dir():
            raise NotADirectoryError(
                errno.ENOTDIR, f"cannot create {directory}: a file is in the way", str(ancestor)
            )
    directory.mkdir(parents=True, exist_ok=True)


class DirectoryWriter:
    """Writes files into a temporary sibling of ``final``, then swaps it into place.

    Use :meth:`add_tensors` / :meth:`add_json` for each file, then :meth:`commit`, which
    fsyncs everything and puts the directory in place: an existing ``final`` is exchanged
    atomically (``renameat2(RENAME_EXCHANGE)``; where the filesystem cannot, it is renamed
    aside first and a crash in between is repaired by the next writer) and deleted after.
    :meth:`abort` removes the temporary directory. Creating a writer first removes what
    crashed writers (dead processes of this host) left next to ``final``.

    Attributes:
        files: relpath -> ``{"size", "crc32c"}`` of every file written so far.
    """

    def __init__(
        self, final: Path, *, direct_io: bool | None = None, threads: int | None = None
    ) -> None:
        """Create the temporary sibling directory of ``final``."""
        self.final = final
        self.direct_io = direct_io
        self.threads = threads
        _make_dirs(final.parent)
        clean_dead_siblings(final.parent)
        self.temp = _sibling(TEMP_PREFIX, final)
        self.temp.mkdir()
        self.files: dict[str, dict[str, int]] = {}
        self._dirs: set[Path] = {self.temp}

    def _target(self, relpath: str) -> Path:
        check_relpath(relpath, "file")
        path = self.temp / relpath
        if path.parent not in self._dirs:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._dirs.add(path.parent)
        return path

    def add_tensors(self, relpath: str, tensors: Mapping[str, torch.Tensor]) -> None:
        """Write a safetensors file (fsynced) and record its size and crc32c."""
        report = write_tensors(
            tensors, self._target(relpath), direct_io=self.direct_io, threads=self.threads
        )
        self.files[relpath] = {"size": report["file_len"], "crc32c": report["file_crc32c"]}

    def add_json(self, relpath: str, document: Any) -> None:
        """Write a JSON file (fsynced) and record its size and crc32c."""
        data = json_bytes(document)
        _native.write_bytes_atomic(str(self._target(relpath)), data, True)
        self.files[relpath] = {"size": len(data), "crc32c": _native.crc32c(data)}

    def commit(self) -> None:
        """fsync every directory, swap the temporary directory into place, fsync the parent."""
        for directory in sorted(self._dirs, key=lambda p: len(p.parts), reverse=True):
            _native.fsync_dir(str(directory))
        old: Path | None = None
        if os.path.lexists(self.final):
            if exchange_paths(self.temp, self.final):
                old = self.temp  # now holds the previous content
            else:
                old = _sibling(TRASH_PREFIX, self.final)
                self.final.rename(old)
                self.temp.rename(self.final)
        else:
            self.temp.rename(self.final)
        _native.fsync_dir(str(self.final.parent))
        if old is not None:
            _remove(old)

    def abort(self) -> None:
        """Remove the temporary directory."""
        shutil.rmtree(self.temp, ignore_errors=True)


class IndexWriter(DirectoryWriter):
    """A :class:`DirectoryWriter` for ``ROOT/<index>`` whose commit also records the index
    in the manifest (the commit point).

    Creating it takes the root's :class:`RootLock` (held until :meth:`commit_entry` or
    :meth:`abort` returns), then removes what crashed saves left, then picks the index: so two
    processes saving into one root are serialized, and with ``index=None`` they never pick the
    same index.

    Attributes:
        index: the index being written (decided under the lock when ``index`` was None).
        lock: the held :class:`RootLock`.
    """

    def __init__(
        self,
        root: Path,
        index: int | None = None,
        *,
        direct_io: bool | None = None,
        lock_timeout: float | None = None,
    ) -> None:
        """Prepare to write index ``index`` of ``root`` (None: the next one, decided under
        the lock); ``lock_timeout`` None waits for other writers as long as they take.

        Raises:
            ValueError: a negative index.
            TimeoutError: another process held the root longer than ``lock_timeout``.
            CheckpointFormatError: ``index`` is None and the manifest is damaged.
        """
        root = Path(root)
        if index is not None and index < 0:
            raise ValueError(f"checkpoint index must be >= 0 (or None for the next), got {index}")
        _make_dirs(root)
        self.root = root
        self.lock = RootLock(root, timeout=lock_timeout)
        self.lock.acquire()
        try:
            clean_leftovers(root)
            if index is None:
                latest = Manifest.load(root).latest
                index = 0 if latest is None else latest + 1
            self.index: int = index
            super().__init__(root / str(index), direct_io=direct_io)
        except BaseException:
            self.lock.release()
            raise

    def commit_entry(self, entry: dict[str, Any]) -> None:
        """Swap the index directory into place, then commit ``entry`` to the manifest.

        Replacing a committed index first withdraws it from the manifest, so the manifest never
        names a directory whose files differ from its records (a crash in between loses the
        replaced index, never corrupts it). If the final manifest write fails, the directory
        is removed again. The root lock is released in every case.
        """
        try:
            manifest = Manifest.load(self.root)
            if manifest.entries.pop(self.index, None) is not None:
                manifest.commit()
            self.commit()
            manifest.entries[self.index] = {**entry, "files": self.files}
            try:
                manifest.commit()
            except BaseException:
                _remove(self.final)
                raise
        finally:
            self.lock.release()

    def abort(self) -> None:
        """Remove the temporary directory and release the root lock."""
        try:
            super().abort()
        finally:
            self.lock.release()


def clean_leftovers(root: Path) -> list[str]:
    """Remove what crashed saves and prunes left in a checkpoint root.

    That is: temporary and trash directories, manifest temp files, and index directories the
    manifest no longer names that are older than its latest index (a prune or a replacement
    interrupted after its manifest commit). Newer unnamed index directories are left alone:
    the next save of that index replaces them.

    Call it only while holding the root's :class:`RootLock` (as :class:`IndexWriter` does):
    everything temporary in the root then belongs to a dead writer. Returns what was removed.
    """
    removed: list[str] = []
    if not root.is_dir():
        return removed
    try:
        manifest: Manifest | None = Manifest.load(root)
    except (CheckpointFormatError, OSError):
        manifest = None  # never delete index directories on the word of a damaged manifest
    latest = None if manifest is None else manifest.latest
    for child in root.iterdir():
        name = child.name
        if name.startswith((TEMP_PREFIX, TRASH_PREFIX)) and (child.is_dir() or child.is_symlink()):
            _remove(child)
        elif name.startswith(f".{MANIFEST}.fastckpt-tmp."):
            child.unlink(missing_ok=True)
        elif (
            manifest is not None
            and latest is not None
            and name.isdigit()
            and len(name) <= 18
            and str(int(name)) == name
            and int(name) < latest
            and int(name) not in manifest.entries
            and child.is_dir()
            and not child.is_symlink()
        ):
            shutil.rmtree(child, ignore_errors=True)
        else:
            continue
        removed.append(name)
    return removed
