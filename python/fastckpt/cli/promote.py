"""``fastckpt promote SOURCE TARGET``: copy a root's committed indices to another root."""

from __future__ import annotations

import argparse
from pathlib import Path

from fastckpt.cli.render import print_json
from fastckpt.cli.status import EXIT_OK, UserError
from fastckpt.container.promote import promote
from fastckpt.io.progress import format_bytes
from fastckpt.storage.registry import display_path


def cmd_promote(args: argparse.Namespace) -> int:
    """Promote every committed index of ``args.source`` (each ``args.every``-th and the
    newest) that ``args.target`` does not hold yet, oldest first; finishes a promotion a
    killed process left half done."""
    source, target = Path(args.source), Path(args.target)
    try:
        report = promote(source, target, every=args.every)
    except ValueError as err:  # a sharded index, or the root itself as the target
        raise UserError(str(err)) from None
    if args.json:
        print_json(
            {
                "source": display_path(source),
                "target": display_path(target),
                "promoted": report.promoted,
                "skipped": report.skipped,
                "bytes_copied": report.bytes_copied,
            }
        )
        return EXIT_OK
    if report.promoted:
        indices = ", ".join(str(index) for index in report.promoted)
        print(
            f"promoted index(es) {indices} of {display_path(source)} to {display_path(target)} "
            f"({format_bytes(report.bytes_copied)})"
        )
    else:
        print(f"{display_path(target)} already holds every index of {display_path(source)}")
    return EXIT_OK
