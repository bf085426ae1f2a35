"""``fastckpt ls ROOT``: the committed indices of a root, or the CheckpointManager checkpoints
of a directory.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fastckpt.cli import sharded
from fastckpt.cli.common import (
    EXIT_OK,
    UserError,
    error_text,
    read_document,
)
from fastckpt.cli.render import (
    counter,
    dash,
    mtime_iso,
    print_json,
    size_text,
    table,
    when,
)
from fastckpt.container.links import split_sizes
from fastckpt.container.listing import committed_checkpoints, list_checkpoints
from fastckpt.errors import FastCkptError
from fastckpt.format.records import (
    COMMIT_RECORD,
    MANIFEST,
    SHARDED_RECORD,
    read_commit_record,
    record_file,
)
from fastckpt.io.paths import is_ascii_decimal, safe_join
from fastckpt.storage.backend import StorageBackend
from fastckpt.storage.registry import backend_for, display_path

# --------------------------------------------------------------------------- fastckpt ls


def _is_file(backend: StorageBackend, path: Path) -> bool:
    """A regular file (an object) is at ``path`` (symlinks followed)."""
    try:
        return backend.stat(path).regular
    except OSError:
        return False


def _ls_root(root: Path) -> dict[str, Any]:
    return {"root": display_path(root), "kind": "root", "checkpoints": list_checkpoints(root)}


def _manager_item_value(directory: Path, record: Mapping[str, Any], item: str) -> Any:
    """The value of a scalar item (``step``, ``epoch``) of a manager checkpoint, or None."""
    relpath = record_file(record, f"{item}.json")
    if item not in record["items"] or relpath not in record["files"]:
        return None
    try:
        document = read_document(safe_join(directory, relpath))
    except (OSError, FastCkptError):
        return None
    value = document.get("skeleton") if isinstance(document, dict) else None
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _sharded_row(directory: Path) -> dict[str, Any]:
    """A sharded checkpoint's row (items: the top-level keys of its state)."""
    try:
        return sharded.listing_row(directory)
    except (OSError, FastCkptError) as err:
        return {
            "name": directory.name,
            "path": display_path(directory),
            "committed": None,
            "size": None,
            "linked_size": None,
            "items": [],
            "error": error_text(err),
            "sharded": True,
        }


def _ls_managers(parent: Path) -> dict[str, Any]:
    checkpoints: list[dict[str, Any]] = []
    backend = backend_for(parent)
    # The checkpoints the manager and retention see (no staging areas, aliases, or folders
    # of other files that hold a commit.json: see committed_checkpoints).
    for name in committed_checkpoints(parent):
        child = parent / name
        if _is_file(backend, child / SHARDED_RECORD):
            checkpoints.append(_sharded_row(child))
            continue
        if not _is_file(backend, child / COMMIT_RECORD):
            continue
        row: dict[str, Any] = {"name": child.name, "path": display_path(child)}
        try:
            record = read_commit_record(child)
        except (OSError, FastCkptError) as err:
            row.update(committed=None, size=None, linked_size=None, items=[], error=error_text(err))
            checkpoints.append(row)
            continue
        size, linked_size = split_sizes(record["files"])
        row.update(
            committed=mtime_iso(child / COMMIT_RECORD),
            size=size,
            linked_size=linked_size,
            items=list(record["items"]),
            step=_manager_item_value(child, record, "step"),
            epoch=_manager_item_value(child, record, "epoch"),
        )
        checkpoints.append(row)
    if not checkpoints:
        raise UserError(
            f"{display_path(parent)} holds no checkpoints: it is neither a save_checkpoint root "
            f"(no {MANIFEST}) nor a directory of CheckpointManager checkpoints"
        )
    checkpoints = _by_commit_time(parent, checkpoints)
    dated = [row for row in checkpoints if row["committed"]]
    newest = dated[-1] if dated else None
    for row in checkpoints:
        row["latest"] = row is newest
    return {"root": display_path(parent), "kind": "manager", "checkpoints": checkpoints}


def _by_commit_time(parent: Path, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` oldest first, as the manager orders them
    (:func:`fastckpt.container.listing.committed_checkpoints`); rows whose record cannot be
    dated last."""
    rank = {name: i for i, name in enumerate(committed_checkpoints(parent))}
    return sorted(rows, key=lambda row: rank.get(row["name"], len(rank)))


def _ls_text(listing: Mapping[str, Any]) -> str:
    rows = listing["checkpoints"]
    if listing["kind"] == "root":
        if not rows:
            return f"{listing['root']}: no committed checkpoint yet"
        total = size_text(sum(row["size"] for row in rows), sum(row["linked_size"] for row in rows))
        title = f"{listing['root']}: {len(rows)} committed index(es), {total}"
        headers = ["INDEX", "CREATED (UTC)", "SIZE", "STEP", "EPOCH", "COMPONENTS"]
        cells = [
            (
                row["index"],
                when(row["created"]),
                size_text(row["size"], row["linked_size"]),
                counter(row["counters"], "step_count", "step", "global_step"),
                counter(row["counters"], "epoch_count", "epoch"),
                _components_text(row["components"]),
            )
            for row in rows
        ]
    else:
        title = f"{listing['root']}: {len(rows)} CheckpointManager checkpoint(s)"
        headers = ["NAME", "COMMITTED (UTC)", "SIZE", "STEP", "EPOCH", "ITEMS"]
        cells = [
            (
                row["name"],
                when(row["committed"]),
                "?" if row["size"] is None else size_text(row["size"], row.get("linked_size") or 0),
                row.get("step"),
                row.get("epoch"),
                row.get("error") or ", ".join(row["items"]),
            )
            for row in rows
        ]
    marked = (
        ["*" if row["latest"] else "", *values[:3], dash(values[3]), dash(values[4]), values[5]]
        for row, values in zip(rows, cells, strict=True)
    )
    return f"{title}\n{table(['', *headers], marked)}\n(* = latest)"


def _components_text(components: Mapping[str, Sequence[str]]) -> str:
    parts = [f"{kind}: {', '.join(names)}" for kind, names in components.items() if names]
    return "; ".join(parts) or "-"


def cmd_ls(args: argparse.Namespace) -> int:
    """``fastckpt ls ROOT``."""
    path = Path(args.root)
    backend = backend_for(path)
    shown = display_path(path)
    # Asked as a directory first: some stores answer a HEAD of a folder's name with an error.
    if not backend.is_directory(path):
        try:
            regular = backend.stat(path).regular
        except FileNotFoundError:
            raise UserError(f"{shown}: no such file or directory") from None
        if regular:
            raise UserError(f"{shown} is a file; ls lists a checkpoint root (use fastckpt inspect)")
    if _is_file(backend, path / MANIFEST):
        listing = _ls_root(path)
    elif _is_file(backend, path / COMMIT_RECORD):
        raise UserError(
            f"{shown} is one CheckpointManager checkpoint; list its parent directory, or use "
            f"fastckpt inspect {shown}"
        )
    elif _is_file(backend, path / SHARDED_RECORD):
        raise UserError(
            f"{shown} is one sharded checkpoint; list its parent directory, or use "
            f"fastckpt inspect {shown}"
        )
    elif is_ascii_decimal(path.name) and _is_file(backend, path.parent / MANIFEST):
        raise UserError(
            f"{shown} is one index of the root {display_path(path.parent)}; list the root, or use "
            f"fastckpt inspect {shown}"
        )
    else:
        listing = _ls_managers(path)
    if args.json:
        print_json(listing)
    else:
        print(_ls_text(listing))
    return EXIT_OK
