"""``fastckpt prune ROOT --keep-last N``: delete all but the newest N indices."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from fastckpt.checkpoint.api import list_checkpoints, prune
from fastckpt.cli.common import (
    EXIT_OK,
    UserError,
    locate,
    manager_children,
)
from fastckpt.cli.render import (
    print_json,
)
from fastckpt.cli.text import printable
from fastckpt.container.commit import prune_plan
from fastckpt.container.kinds import RootContainer
from fastckpt.container.links import file_inodes, freed_bytes
from fastckpt.container.promote_checkpoints import (
    doomed_checkpoints,
    remove_checkpoint,
)
from fastckpt.container.refs import referenced_indices
from fastckpt.errors import FastCkptError
from fastckpt.format.records import COMMIT_RECORD, MANIFEST, Manifest
from fastckpt.io.progress import format_bytes
from fastckpt.storage.access import NO_ROOM
from fastckpt.storage.identity import HOST
from fastckpt.storage.lock import LOCK_FILE, lock_holder
from fastckpt.storage.registry import backend_for, display_path, is_local, is_object_url

# --------------------------------------------------------------------------- the root lock


def describe_holder(root: Path) -> str:
    """Who holds ``root``'s lock (the pid and host its lock file records), with the holder's
    command line when it runs on this machine; on object storage, the owner its lease
    object names: ``host:pid:id``)."""
    if is_object_url(root):
        try:
            lease = json.loads(backend_for(root).read_bytes(root / LOCK_FILE, limit=1 << 16))
            return f"lease owner {lease['owner']} (host:pid:id)"
        except (OSError, FastCkptError, ValueError, KeyError, TypeError):
            return "an unknown process"
    holder = lock_holder(root)
    words = holder.split()
    if len(words) == 5 and words[0] == "pid" and words[4] == HOST:  # pid namespace too
        return f"pid {words[1]} ({_command(words[1])}) on host {words[4]}"
    return holder


def _command(pid: str) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "command unknown"
    text = " ".join(raw.decode(errors="replace").replace("\0", " ").split())
    return text[:100] or "command unknown"


def announce_lock(root: Path, timeout: float | None) -> None:
    """While another process holds ``root``'s lock, say who on stderr before waiting for it
    (the wait itself is the prune's, bounded by ``timeout``)."""
    probe = backend_for(root).lock(root, timeout=0)
    try:
        probe.acquire()
    except TimeoutError:
        limit = "" if timeout is None else f" (at most {timeout:g} s, --lock-timeout)"
        print(
            f"fastckpt prune: {display_path(root)} is locked by {describe_holder(root)} "
            f"(a save or prune in progress); waiting{limit}",
            file=sys.stderr,
            flush=True,
        )
    except OSError as err:
        if err.errno not in NO_ROOM:
            raise
        # No room for the lock file: the prune itself says what it would delete and the fix.
    else:
        probe.release()


# --------------------------------------------------------------------------- manager checkpoints


def _prune_managers(args: argparse.Namespace, children: list[Path]) -> int:
    """Delete all but the newest N manager checkpoints of a directory, as a manager's
    retention does (:func:`~fastckpt.container.promote_checkpoints.prune_checkpoints`: in the
    manager's order, never the newest one that verifies; each removed commit record first, so
    that an interrupted delete leaves only a leftover recognised as such). ``--lock-timeout``
    is refused: manager checkpoints take no lock (before, it was accepted and did nothing)."""
    if args.lock_timeout is not None:
        raise UserError(
            f"{args.root} is a directory of CheckpointManager checkpoints, which take no lock; "
            "--lock-timeout applies to save_checkpoint roots (leave it out here)"
        )
    root = children[0].parent
    doomed_names = set(doomed_checkpoints(root, args.keep_last))
    doomed = [child for child in children if child.name in doomed_names]
    kept = [child for child in children if child.name not in doomed_names]
    # Incremental saves: files a kept checkpoint hard-links are not freed. Not counted on an
    # object store (None).
    freed = freed_bytes(doomed, kept) if is_local(backend_for(root)) else None
    if not args.dry_run:
        for child in doomed:
            remove_checkpoint(child)
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
    kept_text = ", ".join(printable(child.name) for child in kept)
    names = ", ".join(printable(child.name) for child in doomed)
    if not doomed:
        print(
            f"nothing to delete: {len(children)} checkpoint(s), keeping the last {args.keep_last}"
        )
    elif args.dry_run:
        print(f"would delete {names}{_freed_text(freed, '')}; would keep {kept_text}")
    else:
        print(f"deleted {names}{_freed_text(freed, ' freed')}; kept {kept_text}")
    return EXIT_OK


def _freed_text(freed: int | None, suffix: str) -> str:
    return "" if freed is None else f" ({format_bytes(freed)}{suffix})"


# --------------------------------------------------------------------------- fastckpt prune


def _referenced_by(root: Path | str, kept: list[int]) -> set[int]:
    """Indices whose bytes the kept indices of ``root`` reference (incremental saves)."""
    if not kept:
        return set()
    manifest = Manifest.load(root, verify_checksum=True)
    return referenced_indices(manifest, [i for i in kept if i in manifest.entries])


def cmd_prune(args: argparse.Namespace) -> int:
    """``fastckpt prune ROOT --keep-last N [--dry-run] [--lock-timeout S]``."""
    children = manager_children(args.root)
    if children:
        return _prune_managers(args, children)
    location = locate(args.root)
    if not isinstance(location, RootContainer):
        raise UserError(
            f"{display_path(location.path)} is a {location.name}; prune works on a "
            f"save_checkpoint root (a directory holding {MANIFEST}) or a directory of "
            f"CheckpointManager checkpoints (each holding {COMMIT_RECORD})"
        )
    entries = list_checkpoints(location.path)
    sizes = {row["index"]: row["size"] for row in entries}
    indices = sorted(sizes)
    # Locally, what each index's files are (taken before anything is deleted): a file
    # hard-linked into a kept index is not freed by deleting the index it came from.
    local = not is_object_url(location.path)
    inodes = {i: file_inodes(Path(location.path) / str(i)) for i in indices} if local else {}
    due = indices[: -args.keep_last] if len(indices) > args.keep_last else []
    doomed = due
    if args.dry_run and doomed:
        # What the real prune would delete, decided as it decides (under the root's lock).
        doomed = prune_plan(Manifest.load(location.path), doomed, local=local)
    if not args.dry_run and doomed:
        # Only a prune that has something to delete waits for the lock: say so.
        if is_object_url(location.path) or Path(location.path).is_dir():
            announce_lock(Path(location.path), args.lock_timeout)
        try:
            doomed = prune(location.path, keep_last=args.keep_last, lock_timeout=args.lock_timeout)
        except TimeoutError as err:
            raise UserError(
                f"{display_path(location.path)} is still locked by "
                f"{describe_holder(Path(location.path))} after {args.lock_timeout:g} s; "
                "wait for it to finish, stop it, or raise --lock-timeout"
            ) from err
    kept = [i for i in indices if i not in doomed]
    # A pruned index whose bytes a kept incremental index references is retained
    # (ROOT/.ref-<index>), so its bytes are not freed.
    retained = sorted(_referenced_by(location.path, kept) & set(doomed))
    if local:
        freed = freed_bytes(
            [inodes[i] for i in doomed if i not in retained], [inodes[i] for i in kept]
        )
    else:
        freed = sum(sizes[i] for i in doomed if i not in retained)
    if args.json:
        print_json(
            {
                "root": display_path(location.path),
                "keep_last": args.keep_last,
                "dry_run": args.dry_run,
                "deleted": doomed,
                "kept": kept,
                "retained_for_references": retained,
                "freed_bytes": freed,
            }
        )
        return EXIT_OK
    kept_text = ", ".join(str(i) for i in kept) or "-"
    if retained:
        kept_text += (
            f" (the bytes of index(es) {', '.join(str(i) for i in retained)} stay as "
            "references of kept incremental saves)"
        )
    # Indices the age rule dooms that prune keeps: prune_indices warned why (above): files
    # fastckpt did not write, a link from a kept index, or the newest index that verifies.
    held_back = [i for i in due if i not in doomed]
    if held_back:
        kept_text += (
            f" (index(es) {', '.join(str(i) for i in held_back)} despite --keep-last "
            f"{args.keep_last}: the warning above says why)"
        )
    if not doomed and held_back:
        print(f"nothing to delete: {len(indices)} index(es), keeping {kept_text}")
    elif not doomed:
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
