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

import operator
import os
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from fastckpt import _native
from fastckpt.container.kinds import (
    IndexContainer,
    KindVisitor,
    ManagerContainer,
    RootContainer,
    SavedContainer,
    ShardedContainer,
    TensorFile,
    open_container,
)
from fastckpt.container.links import reference_reports as link_reports
from fastckpt.container.reader import FileReport, Status, check_recorded, verify_content
from fastckpt.container.refs import REFS_FILE, reference_reports
from fastckpt.container.report import VerifyReport
from fastckpt.container.sharded.parts import part_damage, part_file_reports
from fastckpt.container.snapshot import check_consistently, wait_out_replacement
from fastckpt.errors import CheckpointFormatError, ChecksumMismatchError
from fastckpt.format.records import (
    COMMIT_RECORD,
    MANAGER_FORMAT,
    MANIFEST,
    MANIFEST_CRC_FIELD,
    SHARDED_RECORD,
    Manifest,
    check_seal,
    load_json,
    read_commit_record,
    refuse_other_kind,
)
from fastckpt.io.headers import DEFAULT_THREADS
from fastckpt.io.paths import safe_join
from fastckpt.storage.backend import MAX_RECORD_BYTES, StorageBackend
from fastckpt.storage.registry import backend_for, use_storage_options

__all__ = [
    "CheckpointSkippedWarning",
    "FileReport",
    "Status",
    "VerifyReport",
    "checked_index",
    "latest_intact",
    "verify",
]


#: What :func:`verify`'s ``index`` accepts (for :func:`checked_index`'s message).
_VERIFY_INDEX = "an int (a committed index, -1: the latest) or None (every index)"


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
    checked.report.note_unchecked(list(checked.value or []))
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


# --------------------------------------------------------------------------- lone files

#: The suffix of a safetensors file.
SUFFIX = ".safetensors"
#: The ``format`` of a sharded checkpoint record (``fastckpt.format.sharded.FORMAT``; not
#: imported, that module needs torch.distributed).
SHARDED_FORMAT = "fastckpt-dcp"
#: Records that carry no checksum of their own: format -> (what it is, its name in place).
#: Records that only mean something with the files they list (checked in their directory).
_DIRECTORY_RECORDS = {
    MANAGER_FORMAT: ("a CheckpointManager commit record", COMMIT_RECORD),
    SHARDED_FORMAT: ("a sharded checkpoint record", SHARDED_RECORD),
}


def _lone_content(threads: int) -> Callable[[Path], tuple[list[str], int | None]]:
    """Check a lone file (no commit record lists it) by what its content is, whatever its
    name: a safetensors file tensor by tensor (the value: its tensors without a checksum); a
    save_checkpoint manifest against its own crc32c. Anything else cannot be checked: a
    :class:`CheckpointFormatError` saying so (the file is then not ok)."""

    def read(path: Path) -> tuple[list[str], int | None]:
        store = backend_for(path)
        size = store.stat(path).size
        head = store.read_range(path, 0, 9) if size else b""
        why_not = _not_safetensors(head, size)
        if path.name.endswith(SUFFIX) or why_not is None:
            crc, unchecked = store.verify_tensors(path, threads)
            return unchecked, crc
        return [], _check_record(store, path, head, size, why_not)

    return read


def _not_safetensors(head: bytes, size: int) -> str | None:
    """Why a file of ``size`` bytes starting with ``head`` is not a safetensors file (None: it
    has the shape of one, an 8-byte little-endian header length the file can hold followed by
    a JSON object; its header and tensors are then checked in full)."""
    if size < 10:
        return f"it has {size} byte(s), fewer than the 8-byte header length and a header"
    length = int.from_bytes(head[:8], "little")
    if length < 2 or length > size - 8:
        return (
            f"its first 8 bytes, read as the header length, say {length} bytes, and the file "
            f"holds {size}"
        )
    if head[8:9] != b"{":
        return "its header does not start with '{'"
    return None


def _check_record(store: StorageBackend, path: Path, head: bytes, size: int, why_not: str) -> int:
    """The whole-file crc32c of ``path`` once its content checked as a fastckpt record.

    Raises:
        CheckpointFormatError: not a record, or a record checked only with its directory.
        ChecksumMismatchError: a manifest whose content differs from its own crc32c.
    """
    cannot = "fastckpt cannot tell what this file is, so its bytes were not verified"
    if size > MAX_RECORD_BYTES or head.lstrip()[:1] not in (b"{", b""):
        raise CheckpointFormatError(
            f"{path}: not a safetensors file ({why_not}), nor a JSON fastckpt record; {cannot}"
        )
    data = store.read_bytes(path)
    try:
        document = load_json(path, data)
    except CheckpointFormatError as err:
        raise CheckpointFormatError(
            f"{path}: not a safetensors file ({why_not}), nor a JSON fastckpt record ({err}); "
            f"{cannot}"
        ) from None
    kind = document.get("format") if isinstance(document, dict) else None
    if isinstance(kind, str) and kind in _DIRECTORY_RECORDS:
        what, name = _DIRECTORY_RECORDS[kind]
        raise CheckpointFormatError(
            f"{path}: {what}, whose bytes were not verified here: a record is checked in its "
            f"checkpoint directory, as {name}, with the files it lists: verify that directory"
        )
    if not (
        isinstance(document, dict) and kind in (None, "fastckpt") and "checkpoints" in document
    ):
        raise CheckpointFormatError(
            f"{path}: not a safetensors file ({why_not}), and JSON but not a fastckpt record; "
            f"{cannot}"
        )
    if not check_seal(path, document):
        raise CheckpointFormatError(
            f"{path}: a save_checkpoint manifest without a checksum of its own (field "
            f"{MANIFEST_CRC_FIELD!r}; older fastckpt versions wrote none): its bytes were not "
            f"verified; verify its root, where it is {MANIFEST}"
        )
    return _native.crc32c(data)


# --------------------------------------------------------------------------- roots


def _load_manifest(root: Path) -> tuple[FileReport, Manifest | None]:
    report = FileReport(root / MANIFEST, "ok")
    try:
        manifest = Manifest.load(root, verify_checksum=True)
    except ChecksumMismatchError as err:
        report.status, report.message = "mismatch", str(err)
        manifest = Manifest.load(root)  # parseable, so its records can still be checked
    except PermissionError as err:  # no damage: this user may not read it (says who may)
        report.status, report.message = "unreadable", err.strerror or str(err)
        return report, None
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


def _verify_root(
    container: SavedContainer, target: Path, index: int | None, threads: int
) -> VerifyReport:
    """Verify every committed index of a root, or only ``index``; ``target`` is what the
    report names."""
    root = container.root
    report = VerifyReport(target, container.kind)
    manifest_report, manifest = _load_manifest(root)
    report.files.append(manifest_report)
    if manifest is None:
        return report
    report.indices = sorted(manifest.entries) if index is None else [manifest.resolve(index)]
    for i in report.indices:
        report.files += _index_files(manifest, i, threads)
        report.files += part_file_reports(manifest, i, threads)  # an FSDP2 strategy's shards
    return report


# --------------------------------------------------------------------------- sharded checkpoints


def _sharded_files(directory: Path, threads: int, index: int | None = None) -> list[FileReport]:
    # Deferred: decoding the record needs torch.distributed.checkpoint's metadata types.
    from fastckpt.container.sharded.reports import sharded_file_reports

    return sharded_file_reports(directory, threads=threads, index=index)


# --------------------------------------------------------------------------- manager checkpoints


def _verify_manager(directory: Path, threads: int) -> VerifyReport:
    report = VerifyReport(directory, ManagerContainer.kind)
    record_path = directory / COMMIT_RECORD
    record_report = FileReport(record_path, "ok")
    report.files.append(record_report)
    try:
        record = read_commit_record(directory)
    except PermissionError as err:  # no damage: this user may not read it (says who may)
        record_report.status, record_report.message = "unreadable", err.strerror or str(err)
        return report
    except (CheckpointFormatError, ChecksumMismatchError, OSError) as err:
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


def _is_bool(value: Any) -> bool:
    """Whether ``value`` is a bool: Python's, or a NumPy / torch bool scalar (which
    ``operator.index`` may take for 0 or 1)."""
    return isinstance(value, bool) or str(getattr(value, "dtype", "")) in ("bool", "torch.bool")


def checked_index(value: Any, argument: str, accepted: str) -> int | None:
    """``value`` as a checkpoint index: an ``int`` (an integer scalar such as ``numpy.int64``
    is taken as its ``int``), or None, returned as it is (each caller says what None means).

    The one check of the index argument of every public entry point (:func:`verify`,
    ``save_checkpoint``, ``load_checkpoint``): ``True`` (which ``int()`` takes for ``1``),
    ``2.0`` or ``"1"`` would silently name another index, or a directory that does not
    exist. It imports neither torch nor NumPy.

    Args:
        value: what the caller passed.
        argument: the argument's name, for the message (``"checkpoint_index"``).
        accepted: what the caller accepts, for the message (``"an int (-1: the latest) or
            None (the latest)"``).

    Returns:
        The index as an ``int``, or None.

    Raises:
        TypeError: ``value`` is a bool, a float, a string or anything else that is not an
            integer; the message names the argument, the value and what is accepted.
    """
    if value is None:
        return None
    if not _is_bool(value):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise TypeError(f"{argument} must be {accepted}, not {type(value).__name__} {value!r}")


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
    * a single file, told by its content whatever its name: a safetensors file (an 8-byte
      header length and a JSON header) has its header and every tensor checksum checked (no
      record to compare the whole file with; tensors without a checksum, as the
      ``safetensors`` package writes them, make it ``unchecked``, not ``ok``: their bytes
      were read, not verified); a ``manifest.json`` under another name is
      checked against its own crc32c. Anything else (random bytes, text, a record without a
      checksum of its own such as a renamed ``commit.json``) cannot be checked: its report is
      ``corrupt``, saying so, never ``ok``;
    * ``manifest.json`` or ``commit.json`` itself (same as its directory).

    A file this user may not read is ``unreadable`` (not ``corrupt``: nothing says it is
    damaged), its message naming its owner and the fix.

    The manifest's own checksum is verified too. Tensor files are read completely (through
    small buffers, nothing is kept) with the GIL released.

    Args:
        path_or_root: what to verify (see above).
        index: for a root, one committed index (an ``int``; ``-1``: the latest) instead of
            all of them (None).
        threads: reader threads per tensor file (default ``fastckpt.io.files.DEFAULT_THREADS``).
        storage_options: object-store client options for an ``s3://`` path (endpoint_url, region,
            access_key_id, ... as for :func:`fastckpt.configure_storage`), over the AWS
            environment; registered for its prefix (as ``configure_storage``) and kept in
            effect for it. A local path refuses them (``StorageOptionsError``).

    Returns:
        A :class:`VerifyReport`; damage is reported there (``report.ok`` is False), not raised.

    Raises:
        TypeError: ``index`` is not an ``int`` or None (a bool, float or string), or
            ``threads`` is not an ``int`` from 1 to 65536 or None.
        FileNotFoundError: ``path_or_root`` does not exist or is not a fastckpt checkpoint
            (or the root has no committed index and ``index=-1``).
        PermissionError: this user may not look into ``path_or_root`` (or a folder above
            it), so what it is cannot be told; the message names the folder and the fix.
        KeyError: ``index`` is not committed in the root.
        ValueError: ``index`` given for something that is not a root.
    """
    requested = checked_index(index, "index", _VERIFY_INDEX)
    _check_threads(threads)
    use_storage_options(path_or_root, storage_options, "verify")
    try:
        container = open_container(path_or_root)
    except CheckpointFormatError as err:  # a folder holding two kinds of records: neither
        where = Path(path_or_root)
        return VerifyReport(where, "manager", [FileReport(where, "corrupt", message=str(err))])
    return container.accept(_Verifier(requested, threads or DEFAULT_THREADS))


def _check_threads(threads: object) -> None:
    """Refuse a ``threads`` that is neither None nor an ``int`` from 1 to 65536 (a bool, a
    float, a string, 0 or a negative count), as :func:`verify` and :func:`latest_intact` take.

    Raises:
        TypeError: naming the value and the range.
    """
    if threads is not None and (
        isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= 1 << 16
    ):
        raise TypeError(f"threads must be an int from 1 to 65536 or None, got {threads!r}")


def _steady(
    record: Path, check: Callable[[], VerifyReport], *, lock_root: Path | None = None
) -> VerifyReport:
    """``check`` (the verification of ``record`` and what it names), again while what it
    found may come from a writer replacing or pruning the checkpoint meanwhile (see
    :func:`~fastckpt.container.snapshot.check_consistently`): a concurrent prune or re-save is
    not reported as damage."""

    def problem(report: VerifyReport) -> str | None:
        if report.ok:
            return None
        return "missing" if any(f.status == "missing" for f in report.files) else "damage"

    return check_consistently(record, check, problem, lock_root=lock_root)


class _Verifier(KindVisitor[VerifyReport]):
    """:func:`verify` of each kind of container."""

    def __init__(self, index: int | None, threads: int) -> None:
        self.requested = index
        self.threads = threads

    def root(self, container: RootContainer) -> VerifyReport:
        return _steady(
            container.root / MANIFEST,
            lambda: _verify_root(container, container.path, self.requested, self.threads),
            lock_root=container.root,
        )

    def index(self, container: IndexContainer) -> VerifyReport:
        own = container.index
        if self.requested is not None and self.requested != own:
            raise ValueError(
                f"{container.path} is index {own}; index={self.requested} does not apply to it"
            )
        return _steady(
            container.root / MANIFEST,
            lambda: _verify_root(container, container.root / str(own), own, self.threads),
            lock_root=container.root,
        )

    def manager(self, container: ManagerContainer) -> VerifyReport:
        _no_index(self.requested, container.path, "a CheckpointManager checkpoint")
        return _steady(
            container.path / COMMIT_RECORD, lambda: _verify_manager(container.path, self.threads)
        )

    def sharded(self, container: ShardedContainer) -> VerifyReport:
        _no_index(self.requested, container.path, "a sharded checkpoint")
        return VerifyReport(
            container.path, container.kind, _sharded_files(container.path, self.threads)
        )

    def file(self, container: TensorFile) -> VerifyReport:
        _no_index(self.requested, container.path, "a single file")
        report = VerifyReport(container.path, container.kind)
        checked = check_recorded(
            container.path, None, _lone_content(self.threads), source="no record"
        )
        checked.report.note_unchecked(list(checked.value or []))
        report.files.append(checked.report)
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
        threads: reader threads per tensor file (an ``int`` from 1 to 65536; None: the
            default).

    Returns:
        The index, or None when the root has no committed index (or none verifies).

    Raises:
        CheckpointFormatError: ``manifest.json`` cannot be parsed at all (nothing can be
            trusted; restore it from a copy). A manifest that parses but fails its own
            checksum is only warned about: every index is still checked against it.
        FileNotFoundError: ``root`` holds no root but a CheckpointManager or sharded
            checkpoint, or a folder of CheckpointManager checkpoints (named, with the call
            that reads it), as ``list_checkpoints`` and ``prune`` there.
        TypeError: ``threads`` is not an ``int`` from 1 to 65536 or None (as ``verify``).
    """
    # 0, -1 and True were taken as the default; "2" failed deep inside, 10**30 in Rust.
    _check_threads(threads)
    root = Path(root)
    workers = threads or DEFAULT_THREADS
    wait_out_replacement(root)  # an index being replaced is out of the manifest until then

    def search() -> tuple[int | None, list[str]]:
        """The newest index that verifies, and why each newer one was skipped."""
        skipped: list[str] = []
        try:
            manifest = Manifest.load(root, verify_checksum=True)
        except ChecksumMismatchError as err:
            skipped.append(f"{err}; checking every index against it anyway")
            manifest = Manifest.load(root)
        if not manifest.entries:
            refuse_other_kind(root, "latest_intact")  # else: a root not saved into yet
        for index in sorted(manifest.entries, reverse=True):
            failures = [r for r in _index_files(manifest, index, workers) if not r.ok]
            problem = None
            if failures:
                more = f" (and {len(failures) - 1} more problem(s))" if len(failures) > 1 else ""
                problem = f"{failures[0].status}: {failures[0].message}{more}"
            else:
                problem = part_damage(manifest, index, workers)  # an FSDP2 strategy's shards
            if problem is None:
                return index, skipped
            skipped.append(
                f"{root}: skipping checkpoint index {index}, it failed verification: {problem}"
            )
        return None, skipped

    def problem(found: tuple[int | None, list[str]]) -> str | None:
        if not found[1]:
            return None
        missing = any("failed verification: missing:" in why for why in found[1])
        return "missing" if missing else "damage"

    # Again while a writer replacing or pruning indices explains what was found (as verify).
    index, skipped = check_consistently(root / MANIFEST, search, problem, lock_root=root)
    for why in skipped:
        warnings.warn(why, CheckpointSkippedWarning, stacklevel=2)
    return index
