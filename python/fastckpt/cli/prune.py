"""``fastckpt prune ROOT --keep-last N``: delete all but the newest N indices."""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import sys
from pathlib import Path
from typing import Any

from fastckpt.checkpoint import list_checkpoints, prune
from fastckpt.cli.common import (
    EXIT_OK,
    UserError,
    locate,
    manager_children,
)
from fastckpt.cli.render import (
    print_json,
)
from fastckpt.errors import FastCkptError
from fastckpt.progress import format_bytes
from fastckpt.store.backend import TEMP_PREFIX
from fastckpt.store.locate import KIND_NAMES
from fastckpt.store.lock import LOCK_FILE, RootLock
from fastckpt.store.records import COMMIT_RECORD, MANIFEST, read_commit_record

# --------------------------------------------------------------------------- the root lock


def lock_holder(lock_file: Path) -> str:
    """Who holds the ``flock`` on ``lock_file``: ``pid N (command) on HOST`` when the holder
    runs on this machine (from ``/proc/locks``), else a description that says it may not."""
    try:
        info = os.stat(lock_file)
        with open("/proc/locks", encoding="ascii") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return f"another process (it holds {lock_file})"
    wanted = f":{info.st_ino}"
    devices = {
        f"{os.major(info.st_dev):02x}:{os.minor(info.st_dev):02x}",
        f"{os.major(info.st_dev)}:{os.minor(info.st_dev)}",
    }
    for line in lines:
        fields = line.split()
        # "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF" (blocked waiters carry "->")
        if "->" in fields or len(fields) < 6 or fields[1] != "FLOCK":
            continue
        pid, where = fields[4], fields[5]
        if where.endswith(wanted) and where.rsplit(":", 1)[0] in devices:
            return f"pid {pid} ({_command(pid)}) on {socket.gethostname()}"
    return (
        f"a process on another machine or in another container (it holds {lock_file}; no "
        "process here does)"
    )


def _command(pid: str) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "command unknown"
    text = " ".join(part.decode(errors="replace") for part in raw.split(b"\0") if part)
    return text[:120] or "command unknown"


def wait_for_lock(root: Path, timeout: float | None) -> None:
    """Return once ``root``'s lock is free; while another process holds it, say who (on
    stderr) and wait at most ``timeout`` seconds (None: as long as it takes).

    Raises:
        UserError: the lock was still held after ``timeout`` (names the holder).
    """
    probe = RootLock(root, timeout=0)
    try:
        probe.acquire()
    except TimeoutError:
        pass
    else:
        probe.release()
        return
    holder = lock_holder(root / LOCK_FILE)
    limit = "" if timeout is None else f" (at most {timeout:g} s, --lock-timeout)"
    print(
        f"fastckpt prune: {root} is locked by {holder} (a save or prune in progress); "
        f"waiting{limit}",
        file=sys.stderr,
        flush=True,
    )
    lock = RootLock(root, timeout=timeout)
    try:
        lock.acquire()
    except TimeoutError:
        raise UserError(
            f"{root} is still locked by {holder} after {timeout:g} s; try again when it is "
            "done, or raise --lock-timeout"
        ) from None
    lock.release()


# --------------------------------------------------------------------------- manager checkpoints


def _prune_managers(args: argparse.Namespace, children: list[Path]) -> int:
    """Delete all but the newest N (by commit time) manager checkpoints of a directory.

    Each is first renamed to a hidden ``.tmp-`` sibling (atomic: ``ls`` stops listing it, and
    an interrupted delete leaves only a leftover recognised as such), then removed."""
    doomed = children[: -args.keep_last] if len(children) > args.keep_last else []
    kept = [child for child in children if child not in doomed]
    sizes = {child: _size(child) for child in doomed}
    if not args.dry_run:
        for child in doomed:
            aside = child.with_name(f"{TEMP_PREFIX}pruned-{os.getpid()}-{child.name}")
            os.rename(child, aside)
            shutil.rmtree(aside)
    freed = sum(sizes.values())
    if args.json:
        print_json(
            {
                "root": str(args.root),
                "kind": "manager",
                "keep_last": args.keep_last,
                "dry_run": args.dry_run,
                "deleted": [child.name for child in doomed],
                "kept": [child.name for child in kept],
                "freed_bytes": freed,
            }
        )
        return EXIT_OK
    kept_text = ", ".join(child.name for child in kept)
    names = ", ".join(child.name for child in doomed)
    if not doomed:
        print(
            f"nothing to delete: {len(children)} checkpoint(s), keeping the last {args.keep_last}"
        )
    elif args.dry_run:
        print(f"would delete {names} ({format_bytes(freed)}); would keep {kept_text}")
    else:
        print(f"deleted {names} ({format_bytes(freed)} freed); kept {kept_text}")
    return EXIT_OK


def _size(directory: Path) -> int:
    try:
        record: Any = read_commit_record(directory)
        return sum(int(entry["size"]) for entry in record["files"].values())
    except (OSError, FastCkptError):  # a damaged record: count what is on disk
        return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())


# --------------------------------------------------------------------------- fastckpt prune


def cmd_prune(args: argparse.Namespace) -> int:
    """``fastckpt prune ROOT --keep-last N [--dry-run] [--lock-timeout S]``."""
    children = manager_children(args.root)
    if children:
        return _prune_managers(args, children)
    location = locate(args.root)
    if location.kind != "root":
        raise UserError(
            f"{location.path} is a {KIND_NAMES[location.kind]}; prune works on a "
            f"save_checkpoint root (a directory holding {MANIFEST}) or a directory of "
            f"CheckpointManager checkpoints (each holding {COMMIT_RECORD})"
        )
    if not args.dry_run and Path(location.path).is_dir():
        wait_for_lock(Path(location.path), args.lock_timeout)
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
