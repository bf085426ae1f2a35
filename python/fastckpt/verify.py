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

import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fastckpt.errors import CheckpointFormatError, ChecksumMismatchError
from fastckpt.files import DEFAULT_THREADS
from fastckpt.store.dispatch import backend_for, use_storage_options
from fastckpt.store.links import reference_reports as link_reports
from fastckpt.store.locate import Kind, locate
from fastckpt.store.paths import safe_join
from fastckpt.store.reader import FileReport, Status, check_recorded, verify_content
from fastckpt.store.records import (
    COMMIT_RECORD,
    MANIFEST,
    SHARDED_DIR,
    SHARDED_RECORD,
    Manifest,
    read_commit_record,
)
from fastckpt.store.refs import REFS_FILE, reference_reports
from fastckpt.store.report import VerifyReport

__all__ = [
    "CheckpointSkippedWarning",
    "FileReport",
    "Status",
    "VerifyReport",
    "latest_intact",
    "verify",
]


class CheckpointSkippedWarning(UserWarning):
    """:func:`latest_intact` skipped a committed index that failed verification."""


# --------------------------------------------------------------------------- files


def _check_file(
    path: Path,
    record: dict[str, int] | None,
    *,
    source: str,
    index: int | None,
    threads: int,
) -> FileReport:
    """Check one file: existence, size, content checksums (tensor files tensor by tensor)."""
    checked = check_recorded(path, record, verify_content(threads), source=source, index=index)
    checked.report.unchecked_tensors = list(checked.value or [])
    return checked.report


def _check_recorded(
    directory: Path,
    relpath: str,
    record: dict[str, int],
    *,
    within: Path,
    source: str,
    index: int | None,
    threads: int,
) -> FileReport:
    try:
        path = safe_join(directory, relpath, within=within)
    except CheckpointFormatError as err:
        return FileReport(directory / str(relpath), "corrupt", message=str(err), index=index)
    return _check_file(path, record, source=source, index=index, threads=threads)


# --------------------------------------------------------------------------- roots


def _load_manifest(root: Path) -> tuple[FileReport, Manifest | None]:
    report = FileReport(root / MANIFEST, "ok")
    try:
        manifest = Manifest.load(root, verify_checksum=True)
    except ChecksumMismatchError as err:
        report.status, report.message = "mismatch", str(err)
        manifest = Manifest.load(root)  # parseable, so its records can still be checked
    except (CheckpointFormatError, OSError) as err:
        report.status, report.message = "corrupt", str(err)
        return report, None
    report.path = manifest.path
    report.expected_crc32c = manifest.stored_crc32c
    report.actual_crc32c = manifest.actual_crc32c
    report.actual_size = manifest.size
    return report, manifest


def _index_files(manifest: Manifest, index: int, threads: int) -> list[FileReport]:
    directory = manifest.directory(index)
    files = manifest.entries[index]["files"]
    # An incremental index: the bytes it references in other (or pruned) indices too.
    referenced = reference_reports(manifest, index, threads) if REFS_FILE in files else []
    return referenced + [
        _check_recorded(
            directory,
            relpath,
            files[relpath],
            within=manifest.root,
            source=str(manifest.path),
            index=index,
            threads=threads,
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
        sharded = root / SHARDED_DIR / str(i)  # the shards of an FSDP2 strategy's index
        if os.path.lexists(sharded / SHARDED_RECORD):
            report.files += _sharded_files(sharded, threads, index=i)
    return report


# --------------------------------------------------------------------------- sharded checkpoints


def _sharded_files(directory: Path, threads: int, index: int | None = None) -> list[FileReport]:
    # Deferred: decoding the record needs torch.distributed.checkpoint's metadata types.
    from fastckpt.dcp.consolidate import sharded_file_reports

    return sharded_file_reports(directory, threads=threads, index=index)


# --------------------------------------------------------------------------- manager checkpoints


def _verify_manager(directory: Path, threads: int) -> VerifyReport:
    report = VerifyReport(directory, "manager")
    record_path = directory / COMMIT_RECORD
    record_report = FileReport(record_path, "ok")
    report.files.append(record_report)
    try:
        record = read_commit_record(directory)
    except (CheckpointFormatError, OSError) as err:
        message = str(err) if str(record_path) in str(err) else f"{record_path}: {err!r}"
        record_report.status, record_report.message = "corrupt", message
        return report
    record_report.actual_size = backend_for(directory).stat(record_path).size
    files = record["files"]
    for relpath in sorted(files):
        report.files.append(
            _check_recorded(
                directory,
                relpath,
                files[relpath],
                within=directory,
                source=str(record_path),
                index=None,
                threads=threads,
            )
        )
    # Incremental checkpoints: each reference resolves in its linked file's header.
    report.files += link_reports(directory, record)
    return report


# --------------------------------------------------------------------------- public API


def verify(
    path_or_root: str | os.PathLike[str],
    index: int | None = None,
    *,
    threads: int | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> VerifyReport:
    """Verify a checkpoint on disk: every file's size and crc32c against its commit record.

    ``path_or_root`` may be:

    * a :func:`fastckpt.save_checkpoint` root (``manifest.json`` inside): every committed index,
      or only ``index`` (``-1``: the latest);
    * one index directory of such a root (``ROOT/<index>``);
    * a :class:`fastckpt.CheckpointManager` checkpoint directory (``commit.json`` inside);
    * a sharded checkpoint directory (``fastckpt-dcp.json`` inside: :mod:`fastckpt.dcp`, a
      manager save of DTensor state); a root's indices include their sharded parts;
    * a single ``.safetensors`` file: its header and every tensor checksum (no record to
      compare the whole file with);
    * ``manifest.json`` or ``commit.json`` itself (same as its directory).

    The manifest's own checksum is verified too. Tensor files are read completely (through
    small buffers, nothing is kept) with the GIL released.

    Args:
        path_or_root: what to verify (see above).
        index: for a root, one committed index instead of all of them.
        threads: reader threads per tensor file (default ``fastckpt.files.DEFAULT_THREADS``).
        storage_options: object-store client options for an ``s3://`` path (endpoint_url, region,
            access_key_id, ... as for :func:`fastckpt.configure_storage`), over the AWS
            environment; registered for its prefix (as ``configure_storage``) and kept in
            effect for it. A local path refuses them (``StorageOptionsError``).

    Returns:
        A :class:`VerifyReport`; damage is reported there (``report.ok`` is False), not raised.

    Raises:
        FileNotFoundError: ``path_or_root`` does not exist or is not a fastckpt checkpoint
            (or the root has no committed index and ``index=-1``).
        KeyError: ``index`` is not committed in the root.
        ValueError: ``index`` given for something that is not a root.
    """
    use_storage_options(path_or_root, storage_options, "verify")
    location = locate(path_or_root)
    workers = max(1, threads or DEFAULT_THREADS)
    if location.kind == "root":
        return _verify_root(location.path, index, "root", workers)
    if location.kind == "index":
        own = location.index
        assert own is not None and location.root is not None
        if index is not None and index != own:
            raise ValueError(f"{location.path} is index {own}; index={index} does not apply to it")
        return _verify_root(location.root, own, "index", workers)
    if location.kind == "manager":
        _no_index(index, location.path, "a CheckpointManager checkpoint")
        return _verify_manager(location.path, workers)
    if location.kind == "sharded":
        _no_index(index, location.path, "a sharded checkpoint")
        return VerifyReport(location.path, "sharded", _sharded_files(location.path, workers))
    _no_index(index, location.path, "a single file")
    report = VerifyReport(location.path, "file")
    report.files.append(
        _check_file(location.path, None, source="no record", index=None, threads=workers)
    )
    return report


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
