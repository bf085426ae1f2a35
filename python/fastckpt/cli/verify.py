"""``fastckpt verify PATH``: every file's size and crc32c against its commit record."""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any

from fastckpt.cli.common import (
    EXIT_BAD,
    EXIT_OK,
    UserError,
    error_text,
    locate,
    no_index,
    one_line,
)
from fastckpt.cli.render import (
    print_json,
    table,
)
from fastckpt.errors import FastCkptError
from fastckpt.progress import format_bytes, io_progress
from fastckpt.store.locate import Location
from fastckpt.store.records import Manifest, read_commit_record
from fastckpt.verify import VerifyReport, verify

# --------------------------------------------------------------------------- fastckpt verify


def _expected_bytes(location: Location, index: int | None) -> int | None:
    """What verifying will read, for the progress bar (None when it cannot be told)."""
    try:
        if location.kind == "file":
            return location.path.stat().st_size
        if location.kind == "manager":
            record = read_commit_record(location.path)
            return sum(entry["size"] for entry in record["files"].values())
        if location.root is None:
            return None
        manifest = Manifest.load(location.root)
        chosen = location.index if location.kind == "index" else index
        if chosen == -1:
            chosen = manifest.latest
        indices = sorted(manifest.entries) if chosen is None else [chosen]
        return sum(
            record["size"]
            for i in indices
            if i in manifest.entries
            for record in manifest.entries[i]["files"].values()
        )
    except (OSError, FastCkptError):
        return None


def _verify_json(report: VerifyReport, seconds: float) -> dict[str, Any]:
    return {
        "ok": report.ok,
        "failed_indices": report.failed_indices(),
        "bytes": sum(f.actual_size or 0 for f in report.files),
        "seconds": round(seconds, 6),
        **dataclasses.asdict(report),
    }


def _newest_intact(report: VerifyReport) -> int | None:
    intact = [i for i in report.indices if report.index_ok(i)]
    return max(intact) if intact else None


def _verify_text(report: VerifyReport, seconds: float) -> str:
    checked = sum(f.actual_size or 0 for f in report.files)
    scope = f"{len(report.files)} file(s)"
    if report.indices:
        scope += f" of index(es) {', '.join(str(i) for i in report.indices)}"
    rate = f"{format_bytes(checked / seconds)}/s" if seconds > 0 else "-"
    if report.ok:
        return (
            f"ok: {report.target}: {scope} verified, {format_bytes(checked)} in "
            f"{seconds:.2f} s ({rate})"
        )
    failures = report.failures
    lines = [f"BAD: {report.target}: {len(failures)} problem(s) in {scope}"]
    rows = [["-" if f.index is None else f.index, f.status, one_line(f.message)] for f in failures]
    lines.append(table(["INDEX", "STATUS", "PROBLEM"], rows, "  "))
    if report.indices:
        failed = report.failed_indices()
        newest = _newest_intact(report)
        resume = "none" if newest is None else str(newest)
        lines.append(
            f"damaged index(es): {', '.join(str(i) for i in failed) or '-'}; "
            f"newest intact index: {resume}"
        )
    return "\n".join(lines)


def cmd_verify(args: argparse.Namespace) -> int:
    """``fastckpt verify PATH [--index N]``: exit 0 when intact, 1 when anything is bad."""
    location = locate(args.path)
    no_index(location, args.index)
    total = _expected_bytes(location, args.index)
    started = time.perf_counter()
    with io_progress(f"verify {location.path}", total):
        try:
            report = verify(location.path, args.index)
        except (KeyError, ValueError) as err:
            if isinstance(err, FastCkptError):
                raise
            raise UserError(error_text(err)) from None
    seconds = time.perf_counter() - started
    if args.json:
        print_json(_verify_json(report, seconds))
    else:
        print(_verify_text(report, seconds))
    return EXIT_OK if report.ok else EXIT_BAD
