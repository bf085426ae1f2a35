"""``fastckpt prune ROOT --keep-last N``: delete all but the newest N indices."""

from __future__ import annotations

import argparse

from fastckpt.checkpoint import list_checkpoints, prune
from fastckpt.cli.common import (
    EXIT_OK,
    UserError,
    locate,
)
from fastckpt.cli.render import (
    print_json,
)
from fastckpt.progress import format_bytes
from fastckpt.store.locate import KIND_NAMES
from fastckpt.store.records import MANIFEST

# --------------------------------------------------------------------------- fastckpt prune


def cmd_prune(args: argparse.Namespace) -> int:
    """``fastckpt prune ROOT --keep-last N [--dry-run]``."""
    location = locate(args.root)
    if location.kind != "root":
        raise UserError(
            f"{location.path} is a {KIND_NAMES[location.kind]}; prune works on a "
            f"save_checkpoint root (a directory holding {MANIFEST})"
        )
    entries = list_checkpoints(location.path)
    sizes = {row["index"]: row["size"] for row in entries}
    indices = sorted(sizes)
    doomed = indices[: -args.keep_last] if len(indices) > args.keep_last else []
    if not args.dry_run and doomed:
        doomed = prune(location.path, keep_last=args.keep_last)
    kept = [i for i in indices if i not in doomed]
    freed = sum(sizes[i] for i in doomed)
    if args.json:
        print_json(
            {
                "root": str(location.path),
                "keep_last": args.keep_last,
                "dry_run": args.dry_run,
                "deleted": doomed,
                "kept": kept,
                "freed_bytes": freed,
            }
        )
        return EXIT_OK
    kept_text = ", ".join(str(i) for i in kept) or "-"
    if not doomed:
        print(f"nothing to delete: {len(indices)} index(es), keeping the last {args.keep_last}")
    elif args.dry_run:
        print(
            f"would delete index(es) {', '.join(str(i) for i in doomed)} "
            f"({format_bytes(freed)}); would keep {kept_text}"
        )
    else:
        print(
            f"deleted index(es) {', '.join(str(i) for i in doomed)} "
            f"({format_bytes(freed)} freed); kept {kept_text}"
        )
    return EXIT_OK
