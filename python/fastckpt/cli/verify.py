"""``fastckpt verify PATH``: every file's size and crc32c against its commit record."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fastckpt.cli.common import (
    EXIT_BAD,
    EXIT_ERROR,
    EXIT_OK,
    EXIT_UNCHECKED,
    UserError,
    error_text,
    locate,
    manager_children,
    no_index,
    one_line,
)
from fastckpt.cli.render import (
    print_json,
    size_text,
    table,
)
from fastckpt.cli.text import printable
from fastckpt.container.kinds import (
    Container,
    IndexContainer,
    KindVisitor,
    ManagerContainer,
    RootContainer,
    SavedContainer,
    ShardedContainer,
    TensorFile,
)
from fastckpt.container.links import split_sizes
from fastckpt.container.verify import FileReport, VerifyReport, verify
from fastckpt.errors import FastCkptError
from fastckpt.format.records import COMMIT_RECORD, SHARDED_RECORD, Manifest, read_commit_record
from fastckpt.io.progress import format_bytes, io_progress
from fastckpt.storage.registry import backend_for, display_path

# --------------------------------------------------------------------------- fastckpt verify


#: The file records of what verifying reads: one ``{relpath: {"size": ...}}`` per checkpoint.
_Records = list[Mapping[str, Mapping[str, Any]]]


class _RecordedFiles(KindVisitor[_Records | None]):
    """What verifying each kind of container will read, as file records (None: it cannot be
    told before verifying, as for a sharded checkpoint)."""

    def __init__(self, index: int | None) -> None:
        self.requested = index

    def root(self, container: RootContainer) -> _Records | None:
        return self._indices(container, self.requested)

    def index(self, container: IndexContainer) -> _Records | None:
        return self._indices(container, container.index)

    def manager(self, container: ManagerContainer) -> _Records | None:
        return [read_commit_record(container.path)["files"]]

    def sharded(self, container: ShardedContainer) -> _Records | None:
        return None

    def file(self, container: TensorFile) -> _Records | None:
        # A lone file: no record, itself (its length; nothing in it is linked).
        return [{container.path.name: {"size": container.path.stat().st_size}}]

    @staticmethod
    def _indices(container: SavedContainer, chosen: int | None) -> _Records:
        manifest = Manifest.load(container.root)
        if chosen == -1:
            chosen = manifest.latest
        indices = sorted(manifest.entries) if chosen is None else [chosen]
        return [manifest.entries[i]["files"] for i in indices if i in manifest.entries]


def _shown(path: Path) -> str:
    """``path`` as a line of the answer shows it: a checkpoint folder's name in a folder of
    them is chosen by whoever saved there, so it is :func:`printable` like a tensor name."""
    return printable(display_path(path))


def _recorded_files(container: Container, index: int | None) -> _Records | None:
    """The file records (one mapping per checkpoint) that verifying will read, or None when
    they cannot be told (a damaged record: the verifier reports it)."""
    try:
        return container.accept(_RecordedFiles(index))
    except (OSError, FastCkptError):
        return None


def _expected_bytes(container: Container, index: int | None) -> int | None:
    """What verifying will read, for the progress bar (None when it cannot be told)."""
    recorded = _recorded_files(container, index)
    if recorded is None:
        return None
    return sum(entry["size"] for files in recorded for entry in files.values())


def _child_bytes(child: Path) -> int:
    """:func:`_expected_bytes` of one checkpoint of a folder of them (0: not told, e.g.
    deleted since it was listed: ``locate`` says so as a :class:`UserError`)."""
    try:
        return _expected_bytes(locate(child), None) or 0
    except (OSError, FastCkptError, UserError):
        return 0


def _child_sizes(child: Path) -> tuple[int, int] | None:
    """:func:`_sizes` of one checkpoint of a folder of them (None: not told, e.g. deleted
    after it was verified: a retention ran meanwhile)."""
    try:
        return _sizes(locate(child), None)
    except (OSError, FastCkptError, UserError):
        return None


def _sizes(container: Container, index: int | None) -> tuple[int, int] | None:
    """``(size, linked_size)`` of what was verified, as ``fastckpt ls`` counts them (a lone
    file: its length), or None when there are no records to count."""
    recorded = _recorded_files(container, index)
    if recorded is None:
        return None
    pairs = [split_sizes(files) for files in recorded]
    return sum(size for size, _ in pairs), sum(linked for _, linked in pairs)


def unchecked_files(report: VerifyReport) -> list[FileReport]:
    """Files without damage some of whose bytes no checksum covers (tensors without a crc32c
    in a file that no commit record lists with its own crc32c)."""
    return [f for f in report.files if f.status == "unchecked"]


def unreadable_files(report: VerifyReport) -> list[FileReport]:
    """Files this user may not read: not checked, and not damage (their owner can check
    them)."""
    return [f for f in report.files if f.status == "unreadable"]


def _damaged(report: VerifyReport) -> bool:
    return any(f.status not in ("ok", "unchecked", "unreadable") for f in report.files)


def _status(report: VerifyReport) -> int:
    """Damage: 1; else a file this user may not read: 2 (it could not be checked; before, 1
    as for damage); else bytes without a checksum: 3; else 0."""
    if _damaged(report):
        return EXIT_BAD
    if unreadable_files(report):
        return EXIT_ERROR
    return EXIT_UNCHECKED if unchecked_files(report) else EXIT_OK


#: Which of two exit statuses of a folder's checkpoints wins: damage, then a checkpoint that
#: could not be read, then unchecked bytes.
_PRECEDENCE = (EXIT_BAD, EXIT_ERROR, EXIT_UNCHECKED, EXIT_OK)


def _verify_json(
    report: VerifyReport, seconds: float, sizes: tuple[int, int] | None
) -> dict[str, Any]:
    unchecked = unchecked_files(report)
    size, linked_size = sizes if sizes is not None else (None, None)
    return {
        "ok": report.ok,
        "status": {
            EXIT_OK: "ok",
            EXIT_BAD: "bad",
            EXIT_ERROR: "unreadable",
            EXIT_UNCHECKED: "unchecked",
        }[_status(report)],
        "unchecked_files": [str(f.path) for f in unchecked],
        "failed_indices": report.failed_indices(),
        "bytes": sum(f.actual_size or 0 for f in report.files),
        "size": size,
        "linked_size": linked_size,
        "seconds": round(seconds, 6),
        **dataclasses.asdict(report),
    }


def _newest_intact(report: VerifyReport) -> int | None:
    intact = [i for i in report.indices if report.index_ok(i)]
    return max(intact) if intact else None


def _verify_text(
    report: VerifyReport,
    seconds: float,
    sizes: tuple[int, int] | None,
    scoped: bool = False,
) -> str:
    """The text report; ``scoped``: only the index ``--index`` named was checked (the newest
    intact index of the root is then not known)."""
    checked = sum(f.actual_size or 0 for f in report.files)
    scope = f"{len(report.files)} file(s)"
    if report.indices:
        scope += f" of index(es) {', '.join(str(i) for i in report.indices)}"
    rate = f"{format_bytes(checked / seconds)}/s" if seconds > 0 else "-"
    unchecked = unchecked_files(report)
    if unchecked and not _damaged(report) and not unreadable_files(report):
        lines = [
            f"UNCHECKED: {_shown(report.target)}: no damage found in {scope}, but "
            f"{len(unchecked)} file(s) have tensors without checksums; their bytes were read, "
            "not verified"
        ]
        for f in unchecked:
            names = ", ".join(printable(name) for name in f.unchecked_tensors[:5])
            more = (
                f" (+{len(f.unchecked_tensors) - 5} more)" if len(f.unchecked_tensors) > 5 else ""
            )
            lines.append(
                f"  {printable(f.path)}: {len(f.unchecked_tensors)} tensor(s) unchecked: "
                f"{names}{more}"
            )
        lines.append(
            "  (written without fastckpt's checksums, e.g. by the safetensors package; "
            "re-save it with fastckpt.save_file to protect it)"
        )
        return "\n".join(lines)
    if report.ok:
        size = "" if sizes is None else f"{size_text(*sizes)}; "
        return (
            f"ok: {_shown(report.target)}: {scope} verified, {size}"
            f"{format_bytes(checked)} read in {seconds:.2f} s ({rate})"
        )
    failures = report.failures
    rows = [["-" if f.index is None else f.index, f.status, one_line(f.message)] for f in failures]
    if not _damaged(report):  # only files this user may not read: no damage found
        unreadable = unreadable_files(report)
        rows = [
            ["-" if f.index is None else f.index, f.status, one_line(f.message)] for f in unreadable
        ]
        lines = [
            f"UNREADABLE: {_shown(report.target)}: {len(unreadable)} of {scope} may not "
            "be read by this user, so they were not checked; no damage was found (check it "
            "as its owner, or give this user read access)",
            table(["INDEX", "STATUS", "PROBLEM"], rows, "  "),
        ]
        if unchecked:
            lines.append(
                f"  and {len(unchecked)} file(s) have tensors without checksums; their bytes "
                "were read, not verified"
            )
        return "\n".join(lines)
    lines = [f"BAD: {_shown(report.target)}: {len(failures)} problem(s) in {scope}"]
    lines.append(table(["INDEX", "STATUS", "PROBLEM"], rows, "  "))
    if report.indices:
        failed = report.failed_indices()
        newest = _newest_intact(report)
        resume = "none" if newest is None else str(newest)
        lines.append(
            f"damaged index(es): {', '.join(str(i) for i in failed) or '-'}; "
            + (
                "only that index was checked (fastckpt verify without --index finds the "
                "newest intact one)"
                if scoped
                else f"newest intact index: {resume}"
            )
        )
    return "\n".join(lines)


def _verify_managers(args: argparse.Namespace, children: list[Path]) -> int:
    """Verify every CheckpointManager checkpoint of a directory; the worst status wins."""
    if args.index is not None:
        raise UserError(
            f"{args.path} is a directory of CheckpointManager checkpoints; --index "
            "only applies to a save_checkpoint root"
        )
    results = []
    times = []  # each checkpoint's own (before: every line showed the whole run's)
    total = sum(_child_bytes(child) for child in children)
    gone: list[Path] = []
    with io_progress(f"verify {args.path}", total):
        for child in children:
            started = time.perf_counter()
            try:
                results.append(verify(child))
            except (OSError, FastCkptError):
                store = backend_for(child)
                if store.exists(child / COMMIT_RECORD) or store.exists(child / SHARDED_RECORD):
                    raise
                gone.append(child)  # deleted since it was listed: a prune or retention ran
                continue
            times.append(time.perf_counter() - started)
    children = [child for child in children if child not in gone]
    for child in gone:
        print(
            f"{_shown(child)}: deleted while the folder was verified (a prune or a "
            "tier's retention ran meanwhile); not checked",
            file=sys.stderr,
        )
    child_sizes = [_child_sizes(child) for child in children]
    statuses = [_status(report) for report in results]
    worst = min(statuses, key=_PRECEDENCE.index)
    if args.json:
        print_json(
            {
                "path": str(args.path),
                "ok": worst == EXIT_OK,
                "checkpoints": [
                    _verify_json(report, seconds, sizes)
                    for report, seconds, sizes in zip(results, times, child_sizes, strict=True)
                ],
            }
        )
    else:
        print(
            "\n".join(
                _verify_text(report, seconds, sizes)
                for report, seconds, sizes in zip(results, times, child_sizes, strict=True)
            )
        )
    return worst


def cmd_verify(args: argparse.Namespace) -> int:
    """``fastckpt verify PATH [--index N]``: exit 0 when every byte verified, 1 when anything
    is damaged, 2 when nothing is damaged but this user may not read some files (or the
    path), 3 when nothing is damaged but some bytes carry no checksum."""
    children = manager_children(args.path)
    if children:
        return _verify_managers(args, children)
    container = locate(args.path)
    no_index(container, args.index)
    total = _expected_bytes(container, args.index)
    started = time.perf_counter()
    with io_progress(f"verify {display_path(container.path)}", total):
        try:
            report = verify(container.path, args.index)
        except (KeyError, ValueError) as err:
            if isinstance(err, FastCkptError):
                raise
            raise UserError(error_text(err)) from None
    seconds = time.perf_counter() - started
    if args.json:
        print_json(_verify_json(report, seconds, _sizes(container, args.index)))
    else:
        sizes = _sizes(container, args.index)
        print(_verify_text(report, seconds, sizes, scoped=args.index is not None))
    return _status(report)
