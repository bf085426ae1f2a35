"""The file reports of a sharded checkpoint: its commit record, then every file the record
lists, each checked against it (what ``fastckpt.verify``, ``verify_sharded`` and the checks of
which index is intact share). Below :mod:`fastckpt.container.commit`: it reads the record
without the commit protocol."""

from __future__ import annotations

import os
from pathlib import Path

from fastckpt.container.reader import FileReport, check_recorded, verify_content
from fastckpt.errors import CheckpointFormatError, ChecksumMismatchError
from fastckpt.format.records import SHARDED_RECORD as RECORD_NAME
from fastckpt.format.records import read_record_bytes
from fastckpt.format.sharded import decode_record
from fastckpt.io.headers import DEFAULT_THREADS
from fastckpt.io.paths import safe_join

__all__ = ["sharded_file_reports"]


def sharded_file_reports(
    path: str | os.PathLike[str],
    *,
    threads: int | None = None,
    index: int | None = None,
    record_crc32c: int | None = None,
    within: str | os.PathLike[str] | None = None,
    read: bool = True,
) -> list[FileReport]:
    """The commit record's report, then one per file it lists, each checked by the store's
    one recorded-file check (size, whole-file crc32c, every tensor entry's crc32c).

    The record itself is read as every loader reads it (a regular file, its own checksum
    checked). ``index`` is copied into the reports (the sharded part of a strategy root's
    index); ``record_crc32c`` is the whole-file crc32c that index recorded for the part's
    record (a different record is a ``mismatch``); ``within``: the directory the files must
    stay in (default ``path``); ``read=False``: each file's presence and size only (no
    byte is read).
    """
    root = Path(path)
    limit = root if within is None else Path(within)
    record_path = root / RECORD_NAME
    record_report = FileReport(record_path, "ok", index=index)
    try:
        record = decode_record(record_path, read_record_bytes(root, RECORD_NAME))
    except (CheckpointFormatError, ChecksumMismatchError, OSError) as err:
        record_report.status = "missing" if isinstance(err, FileNotFoundError) else "corrupt"
        record_report.message = str(err)
        return [record_report]
    record_report.actual_crc32c = record.file_crc32c
    record_report.expected_crc32c = record_crc32c
    if record_crc32c is not None and record.file_crc32c != record_crc32c:
        record_report.status = "mismatch"
        record_report.message = (
            f"{record_path}: crc32c {record.file_crc32c:08x} differs from the {record_crc32c:08x} "
            f"its index {index} recorded; the sharded part was replaced or damaged"
        )
        return [record_report]
    reports = [record_report]
    content = verify_content(max(1, threads or DEFAULT_THREADS)) if read else _sizes_only
    for name in sorted(record.files):
        try:
            file = safe_join(root / record.generation, name, within=limit)
        except CheckpointFormatError as err:
            reports.append(FileReport(root / name, "corrupt", message=str(err), index=index))
            continue
        checked = check_recorded(file, record.files[name], content, source=str(record_path))
        checked.report.index = index
        checked.report.note_unchecked(list(checked.value or []))
        reports.append(checked.report)
    return reports


def _sizes_only(path: Path) -> tuple[list[str], int | None]:
    """Content that reads nothing: :func:`check_recorded` then checks presence and size."""
    return [], None
