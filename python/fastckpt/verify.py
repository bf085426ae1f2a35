"""Checking checkpoints on disk without loading them, and finding the newest intact one.

:func:`verify` reads every file a checkpoint's commit record lists (``manifest.json`` of a
:func:`fastckpt.save_checkpoint` root, ``commit.json`` of a :class:`fastckpt.CheckpointManager`
checkpoint) and compares its size and crc32c with the record; tensor files are also checked
tensor by tensor against the crc32c stored in their own header. Damage is *reported*, not
raised: the :class:`VerifyReport` lists every file with its status. :func:`latest_intact` is
the resume helper: the newest committed index that verifies, with a warning for each newer
index it had to skip.

```python
report = fastckpt.verify("runs/exp1")           # every committed index
if not report.ok:
    print(report.summary())
index = fastckpt.latest_intact("runs/exp1")     # None: nothing intact, start fresh
```
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from fastckpt import _native
from fastckpt.errors import CheckpointFormatError, ChecksumMismatchError
from fastckpt.files import DEFAULT_THREADS
from fastckpt.layout import MANIFEST, Manifest, safe_join

__all__ = [
    "CheckpointSkippedWarning",
    "FileReport",
    "Status",
    "VerifyReport",
    "latest_intact",
    "verify",
]

#: ``ok``: size and checksums match. ``mismatch``: the file is readable but its size or crc32c
#: differs from the commit record (truncated, replaced, swapped). ``missing``: the record
#: names it but it is not there. ``corrupt``: it cannot be read as what it should be (bad
#: header, tensor checksum failure, escapes the checkpoint, unreadable record).
Status = Literal["ok", "mismatch", "missing", "corrupt"]
Kind = Literal["root", "index", "manager", "file"]

COMMIT_RECORD = "commit.json"  # the CheckpointManager commit record (fastckpt.manager)
_READ_PIECE = 16 << 20


class CheckpointSkippedWarning(UserWarning):
    """:func:`latest_intact` skipped a committed index that failed verification."""


@dataclass
class FileReport:
    """What :func:`verify` found for one file.

    Attributes:
        path: the file.
        status: ``"ok"``, ``"mismatch"``, ``"missing"`` or ``"corrupt"`` (see :data:`Status`).
        expected_size: size from the commit record (None: no record, e.g. a lone file).
        expected_crc32c: whole-file crc32c from the commit record (None: no record).
        actual_size: size on disk (None: not readable).
        actual_crc32c: whole-file crc32c computed now (None: not computed).
        message: why it is not ok (empty when ok), naming the file and tensor/field.
        index: the committed index the file belongs to (save_checkpoint roots), else None.
        unchecked_tensors: tensors without a stored checksum (files written by the
            ``safetensors`` package); their bytes are only covered by the record's crc32c.
    """

    path: Path
    status: Status
    expected_size: int | None = None
    expected_crc32c: int | None = None
    actual_size: int | None = None
    actual_crc32c: int | None = None
    message: str = ""
    index: int | None = None
    unchecked_tensors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Whether the file verified."""
        return self.status == "ok"


@dataclass
class VerifyReport:
    """The result of :func:`verify`.

    Attributes:
        target: what was verified.
        kind: ``"root"`` (save_checkpoint root), ``"index"`` (one index directory),
            ``"manager"`` (a CheckpointManager checkpoint) or ``"file"`` (a lone
            safetensors file).
        files: one :class:`FileReport` per file, the commit record itself first.
        indices: the committed indices that were checked (roots and index directories).
    """

    target: Path
    kind: Kind
    files: list[FileReport] = field(default_factory=list)
    indices: list[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Whether every file verified."""
        return all(report.ok for report in self.files)

    @property
    def failures(self) -> list[FileReport]:
        """The files that did not verify."""
        return [report for report in self.files if not report.ok]

    def failed_indices(self) -> list[int]:
        """Indices with at least one failed file (a damaged manifest fails them all)."""
        if any(not r.ok and r.index is None for r in self.files):
            return list(self.indices)
        return sorted({r.index for r in self.failures if r.index is not None})

    def index_ok(self, index: int) -> bool:
        """Whether every file of ``index`` (and the manifest) verified."""
        return index in self.indices and index not in self.failed_indices()

    def summary(self) -> str:
        """A human-readable account: one line per failure, or a one-line all-clear."""
        scope = f"{len(self.files)} file(s)"
        if self.indices:
            scope += f" of index(es) {self.indices}"
        if self.ok:
            return f"{self.target}: ok ({scope} verified)"
        lines = [f"{self.target}: {len(self.failures)} problem(s) in {scope}"]
        lines += [f"  {r.status}: {r.message}" for r in self.failures]
        return "\n".join(lines)

    def __str__(self) -> str:
        """Same as :meth:`summary`."""
        return self.summary()


# --------------------------------------------------------------------------- single files


def _crc_of_file(path: Path) -> tuple[int, int]:
    """(size, crc32c) of a file, read in pieces."""
    crc = size = 0
    with open(path, "rb") as handle:
        while piece := handle.read(_READ_PIECE):
            crc = _native.crc32c(piece, crc)
            size += len(piece)
    return size, crc


def _check_file(
    path: Path,
    expected_size: int | None,
    expected_crc: int | None,
    *,
    index: int | None,
    threads: int,
) -> FileReport:
    """Check one file: existence, size, content checksums (tensor files tensor by tensor)."""
    report = FileReport(path, "ok", expected_size, expected_crc, index=index)

    def fail(status: Status, message: str) -> FileReport:
        report.status, report.message = status, message
        return report

    try:
        info = os.stat(path)
    except FileNotFoundError:
        return fail("missing", f"{path}: missing (listed in the commit record)")
    except OSError as err:
        return fail("corrupt", f"{path}: cannot be read ({err})")
    if not stat.S_ISREG(info.st_mode):
        return fail("corrupt", f"{path}: not a regular file")
    report.actual_size = info.st_size
    if expected_size is not None and info.st_size != expected_size:
        return fail(
            "mismatch",
            f"{path}: size {info.st_size} differs from the recorded {expected_size}; the file "
            "was truncated or replaced",
        )
    try:
        if path.name.endswith(".safetensors"):
            crc, unchecked = _native.verify_file(str(path), threads)
            report.unchecked_tensors = list(unchecked)
        else:
            report.actual_size, crc = _crc_of_file(path)
    except (ChecksumMismatchError, CheckpointFormatError) as err:
        return fail("corrupt", str(err))
    except FileNotFoundError:
        return fail("missing", f"{path}: disappeared while being verified")
    except OSError as err:
        return fail("corrupt", f"{path}: cannot be read ({err})")
    report.actual_crc32c = crc
    if expected_crc is not None and crc != expected_crc:
        return fail(
            "mismatch",
            f"{path}: file crc32c {crc:08x} differs from the recorded {expected_crc:08x}; the "
            "file was replaced, swapped with another checkpoint's, or corrupted",
        )
    return report


def _check_recorded(
    directory: Path,
    relpath: str,
    record: Any,
    *,
    within: Path,
    index: int | None,
    threads: int,
) -> FileReport:
    try:
        path = safe_join(directory, relpath, within=within)
    except CheckpointFormatError as err:
        return FileReport(directory / str(relpath), "corrupt", message=str(err), index=index)
    return _check_file(path, record["size"], record["crc32c"], index=index, threads=threads)


# --------------------------------------------------------------------------- roots


def _load_manifest(root: Path) -> tuple[FileReport, Manifest | None]:
    path = root / MANIFEST
    report = FileReport(path, "ok")
    try:
        manifest = Manifest.load(root, verify_checksum=True)
    except ChecksumMismatchError as err:
        report.status, report.message = "mismatch", str(err)
        manifest = Manifest.load(root)  # parseable, so its records can still be checked
    except (CheckpointFormatError, OSError) as err:
        report.status, report.message = "corrupt", str(err)
        return report, None
    report.expected_crc32c = manifest.stored_crc32c
    report.actual_crc32c = manifest.actual_crc32c
    with contextlib.suppress(OSError):
        report.actual_size = path.stat().st_size
    return report, manifest


def _index_files(manifest: Manifest, index: int, threads: int) -> list[FileReport]:
    directory = manifest.root / str(index)
    files = manifest.entries[index]["files"]
    return [
        _check_recorded(
            directory, relpath, files[relpath], within=manifest.root, index=index, threads=threads
        )
        for relpath in sorted(files)
    ]


def _verify_root(root: Path, index: int | None, kind: Kind, threads: int) -> VerifyReport:
    report = VerifyReport(root if kind == "root" else root / str(index), kind)
    manifest_report, manifest = _load_manifest(root)
    report.files.append(manifest_report)
    if manifest is None:
        return report
    report.indices = sorted(manifest.entries) if index is None else [manifest.resolve(index)]
    for i in report.indices:
        report.files += _index_files(manifest, i, threads)
    return report


# --------------------------------------------------------------------------- manager checkpoints


def _verify_manager(directory: Path, threads: int) -> VerifyReport:
    from fastckpt.manager import _read_commit_record

    report = VerifyReport(directory, "manager")
    record_path = directory / COMMIT_RECORD
    record_report = FileReport(record_path, "ok")
    report.files.append(record_report)
    try:
        safe_join(directory, COMMIT_RECORD)
        record = _read_commit_record(directory)
    except (CheckpointFormatError, OSError, ValueError, RecursionError) as err:
        message = str(err) if str(record_path) in str(err) else f"{record_path}: {err!r}"
        record_report.status, record_report.message = "corrupt", message
        return report
    record_report.actual_size = record_path.stat().st_size
    files = record["files"]
    for relpath in sorted(files):
        report.files.append(
            _check_recorded(
                directory, relpath, files[relpath], within=directory, index=None, threads=threads
            )
        )
    return report


# --------------------------------------------------------------------------- public API


def verify(
    path_or_root: str | os.PathLike[str],
    index: int | None = None,
    *,
    threads: int | None = None,
) -> VerifyReport:
    """Verify a checkpoint on disk: every file's size and crc32c against its commit record.

    ``path_or_root`` may be:

    * a :func:`fastckpt.save_checkpoint` root (``manifest.json`` inside): every committed index,
      or only ``index`` (``-1``: the latest);
    * one index directory of such a root (``ROOT/<index>``);
    * a :class:`fastckpt.CheckpointManager` checkpoint directory (``commit.json`` inside);
    * a single ``.safetensors`` file: its header and every tensor checksum (no record to
      compare the whole file with);
    * ``manifest.json`` or ``commit.json`` itself (same as its directory).

    The manifest's own checksum is verified too. Tensor files are read completely (through
    small buffers, nothing is kept) with the GIL released.

    Args:
        path_or_root: what to verify (see above).
        index: for a root, one committed index instead of all of them.
        threads: reader threads per tensor file (default ``fastckpt.files.DEFAULT_THREADS``).

    Returns:
        A :class:`VerifyReport`; damage is reported there (``report.ok`` is False), not raised.

    Raises:
        FileNotFoundError: ``path_or_root`` does not exist or is not a fastckpt checkpoint
            (or the root has no committed index and ``index=-1``).
        KeyError: ``index`` is not committed in the root.
        ValueError: ``index`` given for something that is not a root.
    """
    path = Path(path_or_root)
    workers = max(1, threads or DEFAULT_THREADS)
    if path.is_file():
        if path.name == MANIFEST:
            return verify(path.parent, index, threads=threads)
        if path.name == COMMIT_RECORD:
            return verify(path.parent, index, threads=threads)
        _no_index(index, path, "a single file")
        report = VerifyReport(path, "file")
        report.files.append(_check_file(path, None, None, index=None, threads=workers))
        return report
    if path.is_dir():
        if (path / MANIFEST).exists():
            return _verify_root(path, index, "root", workers)
        if (path / COMMIT_RECORD).exists():
            _no_index(index, path, "a CheckpointManager checkpoint")
            return _verify_manager(path, workers)
        if path.name.isdigit() and (path.parent / MANIFEST).exists():
            own = int(path.name)
            if index is not None and index != own:
                raise ValueError(f"{path} is index {own}; index={index} does not apply to it")
            return _verify_root(path.parent, own, "index", workers)
        raise FileNotFoundError(
            errno.ENOENT,
            f"{path} is not a fastckpt checkpoint: no {MANIFEST} (save_checkpoint root) or "
            f"{COMMIT_RECORD} (CheckpointManager checkpoint) in it, and it is not an index "
            "directory of a root",
            str(path),
        )
    raise FileNotFoundError(errno.ENOENT, f"{path}: no such file or directory", str(path))


def _no_index(index: int | None, path: Path, what: str) -> None:
    if index is not None:
        raise ValueError(f"{path} is {what}; index= only applies to a save_checkpoint root")


def latest_intact(root: str | os.PathLike[str], *, threads: int | None = None) -> int | None:
    """The newest committed index of a save_checkpoint root whose files all verify.

    Newer indices that fail verification are skipped, each with a
    :class:`CheckpointSkippedWarning` naming the index and its first problem. Use it to resume
    after a crash or a disk fault: ``fastckpt.load_checkpoint(root, latest_intact(root))``.

    Args:
        root: the checkpoint root.
        threads: reader threads per tensor file.

    Returns:
        The index, or None when the root has no committed index (or none verifies).

    Raises:
        CheckpointFormatError: ``manifest.json`` cannot be parsed at all (nothing can be
            trusted; restore it from a copy). A manifest that parses but fails its own
            checksum is only warned about: every index is still checked against it.
    """
    root = Path(root)
    workers = max(1, threads or DEFAULT_THREADS)
    try:
        manifest = Manifest.load(root, verify_checksum=True)
    except ChecksumMismatchError as err:
        warnings.warn(
            f"{err}; checking every index against it anyway",
            CheckpointSkippedWarning,
            stacklevel=2,
        )
        manifest = Manifest.load(root)
    for index in sorted(manifest.entries, reverse=True):
        failures = [r for r in _index_files(manifest, index, workers) if not r.ok]
        if not failures:
            return index
        more = f" (and {len(failures) - 1} more problem(s))" if len(failures) > 1 else ""
        warnings.warn(
            f"{root}: skipping checkpoint index {index}, it failed verification: "
            f"{failures[0].status}: {failures[0].message}{more}",
            CheckpointSkippedWarning,
            stacklevel=2,
        )
    return None
