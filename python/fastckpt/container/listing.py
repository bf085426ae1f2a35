"""What a checkpoint root holds: the committed indices of a ``save_checkpoint`` root (read from
its manifest alone), and the committed CheckpointManager checkpoints of a directory (a tier
root), oldest first; a symlink to a sibling in a tier root is an alias, not a checkpoint
(never listed, ordered or pruned).

Listing needs neither torch nor the tensor files (``fastckpt ls`` starts without importing
torch); :func:`fastckpt.list_checkpoints` is the first.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from fastckpt.container.links import LINKED_DIR, split_sizes
from fastckpt.container.snapshot import wait_out_replacement
from fastckpt.format import records
from fastckpt.format.records import (
    COMMIT_RECORD,
    SHARDED_RECORD,
    Manifest,
    by_commit_time,
    generation_order,
    save_dated,
)
from fastckpt.io.forksafe import ForkSafeLock
from fastckpt.storage.backend import StorageBackend
from fastckpt.storage.registry import backend_for, is_local, use_storage_options

__all__ = [
    "TierDates",
    "committed_checkpoints",
    "dated_checkpoints",
    "is_alias",
    "list_checkpoints",
    "saved_after_siblings",
    "tier_dates",
]


def list_checkpoints(
    root: str | os.PathLike[str], *, storage_options: Mapping[str, Any] | None = None
) -> list[dict[str, Any]]:
    """Committed indices of a root, oldest first.

    Args:
        root: checkpoint root.
        storage_options: object-store client options for an ``s3://`` root (endpoint_url,
            region, access_key_id, ... as for :func:`fastckpt.configure_storage`), over the
            AWS environment; they are registered for ``root``'s prefix (as
            ``configure_storage(root, storage_options)``) and stay in effect for it. A local
            ``root`` refuses them (``StorageOptionsError``).

    Returns:
        One dict per index: ``index``, ``created``, ``size`` (the bytes its save wrote),
        ``linked_size`` (the bytes of unchanged tensors' files it holds as hard links to an
        earlier index's, written by that one), ``counters``, ``components``, ``latest``
        (bool).

    Raises:
        CheckpointFormatError / ChecksumMismatchError: the manifest is damaged (the same
            checks as :func:`load_checkpoint`, its own crc32c included).
    """
    use_storage_options(root, storage_options, "list_checkpoints")
    if is_local(backend_for(root)):
        wait_out_replacement(Path(root))  # an index being replaced is out of the manifest
    manifest = Manifest.load(root, verify_checksum=True)
    if not manifest.entries:
        records.refuse_other_kind(root, "list_checkpoints")
    rows = []
    for index, entry in sorted(manifest.entries.items()):
        written, linked = split_sizes(entry["files"])
        rows.append(
            {
                "index": index,
                "created": entry.get("created"),
                "size": written,
                "linked_size": linked,
                "counters": entry.get("counters", {}),
                "components": entry.get("components", {}),
                "latest": index == manifest.latest,
            }
        )
    return rows


class TierDates(NamedTuple):
    """The committed checkpoints of a tier root, oldest first (:func:`tier_dates`)."""

    #: name -> when it was saved (seconds since the epoch), or where its record does not say
    #: (an earlier fastckpt version), when the store dates its commit record.
    dates: dict[str, float]
    #: Every date is a save time (none is the store's), damaged records aside.
    saved: bool
    #: The names whose commit record cannot be read (damaged): dated by their store, they
    #: count as nobody's evidence of when the tier was written.
    unreadable: frozenset[str] = frozenset()

    def evidence(self) -> dict[str, float]:
        """:attr:`dates` of the checkpoints whose records could be read."""
        return {name: when for name, when in self.dates.items() if name not in self.unreadable}


def is_alias(path: Path) -> bool:
    """Whether the local ``path`` is a symlink to a sibling (``latest -> step_20`` in a tier
    root): an alias, not a checkpoint of its own (never listed, ordered or pruned; a symlink
    to a checkpoint elsewhere is one)."""
    if not os.path.islink(path):
        return False
    return os.path.dirname(os.path.realpath(path)) == os.path.realpath(path.parent)


def committed_checkpoints(root: str | os.PathLike[str]) -> list[str]:
    """The names of the committed CheckpointManager checkpoints in the tier root ``root``
    (of sharded state too), oldest first (see :func:`tier_dates`). A root that does not
    exist has none."""
    return list(tier_dates(root).dates)


def dated_checkpoints(root: str | os.PathLike[str]) -> dict[str, float]:
    """:func:`committed_checkpoints` with when each was saved, oldest first (see
    :func:`tier_dates`)."""
    return tier_dates(root).dates


def tier_dates(root: str | os.PathLike[str]) -> TierDates:
    """The committed checkpoints of the tier root ``root``, oldest first: by when each was
    saved (:func:`fastckpt.format.records.saved_seconds`: a promotion carries it, so a
    checkpoint dates the same on every tier), or where its record does not say, when the
    store dates its commit record; where two dates tie (S3 dates objects to the second), by
    the generations their records name (to the millisecond), then by name
    (:func:`fastckpt.format.records.by_commit_time`)."""
    root = Path(root)
    backend = backend_for(root)
    found: dict[str, tuple[float, str]] = {}  # name -> (store date, record file)
    local = is_local(backend)
    for name in backend.list_dir(root):
        if name.startswith("."):
            continue  # staging areas, trash, locks
        if local and is_alias(root / name):
            continue  # ``latest -> step_20``: the checkpoint is listed under its own name
        for record in (COMMIT_RECORD, SHARDED_RECORD):
            try:
                info = backend.stat(root / name / record)
            except (FileNotFoundError, NotADirectoryError):
                continue
            if info.regular:
                found[name] = (info.modified or 0.0, record)
                break
    dated, undated, unreadable = save_dated(root, found)
    for name in list(unreadable):
        if found[name][1] == COMMIT_RECORD and not _holds_checkpoint_files(backend, root / name):
            # A folder of someone else's files that happens to hold a commit.json (a run's
            # notes): not a checkpoint, so never listed, counted by retention or deleted.
            unreadable.remove(name)
            del dated[name]
            if name in undated:
                undated.remove(name)
    order = by_commit_time(root, dated)
    return TierDates({name: dated[name][0] for name in order}, not undated, frozenset(unreadable))


def _holds_checkpoint_files(backend: StorageBackend, directory: Path) -> bool:
    """Whether ``directory``, whose commit record cannot be read, holds what a damaged
    CheckpointManager checkpoint would: tensor files, JSON files, linked or generation
    folders and its record, and nothing else (hidden temporary names aside)."""
    try:
        names = [n for n in backend.list_dir(directory) if not n.startswith(".")]
    except OSError:
        return False
    data = [n for n in names if n.endswith(".safetensors") or n == LINKED_DIR]
    data += [n for n in names if generation_order(n) is not None]
    others = [n for n in names if n.endswith(".json") and n not in data]
    return bool(data) and len(data) + len(others) == len(names)


#: Tier root -> the newest save date (ns) this process gave or found there.
_NEWEST_SAVED: dict[str, int] = {}
_NEWEST_LOCK = ForkSafeLock()


def saved_after_siblings(checkpoint: str | os.PathLike[str]) -> int:
    """When the CheckpointManager checkpoint about to be committed at ``checkpoint`` is saved,
    in ns since the epoch (its record's ``saved_ns``): now, but after every checkpoint
    committed beside it, so that a wall clock stepped back (an NTP step, a restored VM
    snapshot) never makes ``latest``, ``keep_last`` or ``prune`` take an older save for the
    newest. The newest date beside it is read once per tier root and process (one listing,
    see :func:`tier_dates`), then kept."""
    parent = Path(checkpoint).parent
    key = str(parent)
    with _NEWEST_LOCK:
        floor = _NEWEST_SAVED.get(key)
    if floor is None:
        try:
            dates = list(tier_dates(parent).dates.values())
        except OSError:
            dates = []
        # Dates are float seconds: a microsecond above any rounding of the newest.
        floor = max((math.ceil(date * 1e9) + 1_000 for date in dates), default=0)
    with _NEWEST_LOCK:
        floor = max(floor, _NEWEST_SAVED.get(key, 0))
        saved = max(records.now_ns(), floor + 1)
        _NEWEST_SAVED[key] = saved
    return saved
