"""Tiers of CheckpointManager checkpoints: a fast root of checkpoint directories whose
checkpoints are promoted to a durable root.

A *tier root* is a directory (or ``s3://`` prefix) holding CheckpointManager checkpoints as
its children (``ROOT/step_100/commit.json`` ...). :func:`promote_checkpoint` copies one of
them to another tier root under the same name as a committed checkpoint, through the same
protocol as :func:`fastckpt.container.promote.promote_index`: every file the source's commit
record lists is read, proven against its size and crc32c and written durably under a name no
other save uses (a temporary sibling locally, a fresh generation on an object store; a damaged
file aborts them, leaving the committed checkpoint there as it was), what was written is
checked against the record, and the commit record is written last. Files this process
promoted before and proves identical by their BLAKE3 digest are stored by the target from
what it holds (a hard link, a server-side copy: see :mod:`fastckpt.container.copy`).

A checkpoint of sharded (DTensor) state, a DCP container written by every rank, is copied the
same way: every rank's file its record lists, proven as it is read, written as the record's
generation under the target, then the record (:func:`~fastckpt.container.sharded.promote.
write_generation`).

The order of a tier's checkpoints ("newest") is when each was saved, a date its commit record
holds and a promotion carries (records of earlier versions: the modification time of the
record, when it was committed there), then the name. Checkpoints are removed
commit record first (:func:`remove_checkpoint`), so a process killed while removing one never
leaves a commit record naming missing files.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import shutil
import warnings
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastckpt import _native
from fastckpt.container.commit import (
    DirectoryWriter,
    refuse_to_replace,
    shown_names,
    stray_names,
)
from fastckpt.container.copy import IndexCopy, copy_files, read_verified, remember_written
from fastckpt.container.listing import (  # listed here too, where they were first
    TierDates,
    committed_checkpoints,
    dated_checkpoints,
    tier_dates,
)
from fastckpt.container.promote import SOURCE_DAMAGE, Promoter
from fastckpt.container.refs import distrust
from fastckpt.container.sharded.promote import record_files, write_generation
from fastckpt.container.verify import verify
from fastckpt.errors import FastCkptError, NotCommittedError
from fastckpt.format.records import (
    COMMIT_RECORD,
    SAVED_NS,
    SHARDED_RECORD,
    commit_record,
    read_commit_record,
    read_record_bytes,
    saved_seconds,
)
from fastckpt.io.paths import check_name, safe_join
from fastckpt.storage.backend import (
    TEMP_PREFIX,
    explain_full_disk,
    remove_replaced,
    restore_replaced,
)
from fastckpt.storage.backend import _sibling as temp_sibling
from fastckpt.storage.registry import backend_for, display_path, is_local

__all__ = [
    "LEFT_BEHIND_S",
    "SAVED_LEFT_BEHIND_S",
    "CheckpointPromoter",
    "NearestCheckpoint",
    "TierDates",
    "checkpoint_problem",
    "committed_checkpoints",
    "date_text",
    "dated_checkpoints",
    "doomed_checkpoints",
    "left_behind",
    "nearest_intact_checkpoint",
    "promote_checkpoint",
    "prune_checkpoints",
    "remove_checkpoint",
    "same_files",
    "saved_later",
    "tier_dates",
    "tier_left_behind",
]

_LOG = logging.getLogger(__name__)


#: How much later than every checkpoint of a faster tier a slower tier's checkpoint must be
#: dated for the faster tier to count as left from an earlier run (a node's disk that held a
#: job before), where some checkpoint of either tier is dated only by its store (a record of
#: an earlier fastckpt version, without :data:`~fastckpt.format.records.SAVED_NS`): the clocks
#: of a node and a store differ by seconds, a promotion lags its save by about as much (a
#: promotion finished later, by the next process, makes the run restore the durable copy of
#: the same save), a tier left behind by hours.
LEFT_BEHIND_S = 600.0
#: The same bound where every checkpoint of both tiers is dated by when it was saved (the date
#: a promotion carries): only the clocks of two nodes of one cluster differ then, and a run
#: that moved elsewhere saved again well after that.
SAVED_LEFT_BEHIND_S = 5.0


def left_behind(
    faster: Mapping[str, float],
    slower: Mapping[str, float],
    margin: float = LEFT_BEHIND_S,
    *,
    same_names: bool = False,
) -> str | None:
    """Whether the faster tier whose checkpoints are ``faster`` is one left from an earlier
    run, judged by the slower tier's ``slower`` (both name -> date, see :func:`tier_dates`):
    the name of the slower tier's newest checkpoint dated more than ``margin`` seconds after
    every one of the faster tier's (:data:`LEFT_BEHIND_S`, or :data:`SAVED_LEFT_BEHIND_S`
    where both tiers' dates are save times), or None.

    Such a checkpoint was saved after all of the faster tier's. With ``same_names`` (both
    tiers' dates are save times, which a promotion carries) one under a name the faster tier
    holds counts too: it cannot be a copy of the faster tier's, so a run that went on
    elsewhere saved that name (``step_1``, ``last``) again. Otherwise only a name the faster
    tier lacks counts: a copy dated by its store is dated when its promotion committed, which
    may be long after the save (:func:`tier_left_behind` decides both)."""
    if not faster:
        return None
    newest = max(faster.values())
    later = [n for n, when in slower.items() if when > newest + margin]
    ahead = [n for n in later if same_names or n not in faster]
    return max(ahead, key=lambda n: slower[n]) if ahead else None


def tier_left_behind(faster: Sequence[TierDates], slower: TierDates) -> tuple[str | None, float]:
    """:func:`left_behind` of the tiers ``faster`` (together) judged by ``slower``: ``(the
    slower tier's checkpoint saved after all of theirs, or None; the margin used)``. The margin
    is :data:`SAVED_LEFT_BEHIND_S` and names they share count where every date of every tier is
    a save time, else :data:`LEFT_BEHIND_S` and only names they lack. A checkpoint whose
    commit record cannot be read is no evidence either way (its store's date may be anything:
    a promotion's, a repair's)."""
    saved = all(tier.saved for tier in (*faster, slower))
    margin = SAVED_LEFT_BEHIND_S if saved else LEFT_BEHIND_S
    merged: dict[str, float] = {}
    for tier in faster:
        merged.update(tier.evidence())
    return left_behind(merged, slower.evidence(), margin, same_names=saved), margin


def _stripped(record: Mapping[str, Any], relpath: str) -> str:
    """``relpath`` of a commit record without its generation prefix (object stores)."""
    generation = record.get("generation")
    if isinstance(generation, str) and relpath.startswith(f"{generation}/"):
        return relpath[len(generation) + 1 :]
    return relpath


def promote_checkpoint(source: str | os.PathLike[str], target: str | os.PathLike[str]) -> IndexCopy:
    """Copy the committed CheckpointManager checkpoint ``source`` to ``target`` (a
    directory or ``s3://`` prefix; replaced atomically if it exists) as a committed
    checkpoint; see the module docstring. Returns the bytes transferred and reused.

    Raises:
        FileNotFoundError: ``source`` is not a committed checkpoint.
        ChecksumMismatchError / CheckpointFormatError: a source file is damaged or missing
            (named); the target is untouched.
        NotACheckpointError: ``target`` holds what a save would not replace (a file, the
            user's data, names its checkpoint's record does not list).
        ValueError: ``source`` is ``target``.
    """
    source, target = Path(source), Path(target)
    if os.path.realpath(source) == os.path.realpath(target):
        raise ValueError(f"{display_path(source)}: promoting a checkpoint onto itself")
    check_name(target.name, "checkpoint directory name")
    # A full disk: the target named, not a hidden temporary path beside it (before: the
    # bare "No space left on device (os error 28)" naming it).
    with explain_full_disk(
        display_path(target),
        doing=f"promoting {display_path(source)} to",
        kept="nothing was promoted and what it held is intact",
        again="promote",
        filename=display_path(target),
    ):
        return _promote_checkpoint(source, target)


def _promote_checkpoint(source: Path, target: Path) -> IndexCopy:
    """:func:`promote_checkpoint`, its arguments checked."""
    what = f"checkpoint {display_path(source)}"
    if backend_for(source).exists(source / SHARDED_RECORD):
        return _promote_sharded(source, target, what)
    record = read_commit_record(source)
    files: dict[str, tuple[Path, Mapping[str, Any]]] = {}
    for relpath, file_record in record["files"].items():
        # as the loaders join it: refused if it resolves outside the checkpoint (a symlink)
        files[_stripped(record, relpath)] = (safe_join(source, relpath), file_record)
    root = target.parent
    refuse_to_replace(target)  # a user's file put into the durable copy is not swapped away
    writer = DirectoryWriter(target)
    held: dict[str, Mapping[str, Any] | None] = {}

    def listed(container: str, relpath: str) -> Mapping[str, Any] | None:
        if container not in held:
            try:
                held[container] = read_commit_record(root / container)["files"]
            except (OSError, FastCkptError):
                held[container] = None
        files_there = held[container]
        return None if files_there is None else files_there.get(relpath)

    try:
        done, written = copy_files(files, writer, root, listed, what)
        refs = {
            writer.stored_relpath(_stripped(record, relpath)): {
                name: {**ref, "file": writer.stored_relpath(_stripped(record, ref["file"]))}
                for name, ref in names.items()
            }
            for relpath, names in (record.get("refs") or {}).items()
        }
        document = commit_record(
            list(record["items"]),
            writer.files,
            record["world_size"],
            refs,
            saved_ns=_saved_ns(source, record),
        )
        writer.add_json(COMMIT_RECORD, document)
        writer.commit()
    except BaseException:
        writer.abort()
        raise
    remember_written(root, target.name, written)
    return done


def _saved_ns(source: Path, record: Mapping[str, Any]) -> int | None:
    """The save date a copy of the checkpoint ``source`` (commit record ``record``) carries:
    its own, so that it dates the same on every tier; for a record of an earlier version
    (none), the date its store gave its record where it was saved. Left undated, the copy
    would date by when the promotion committed it, possibly after checkpoints the run saved
    meanwhile, which the target's retention would then delete as older."""
    saved = record.get(SAVED_NS)
    if isinstance(saved, int):
        return saved
    modified = backend_for(source).stat(source / COMMIT_RECORD).modified
    return None if modified is None else int(modified * 1e9)


def _promote_sharded(source: Path, target: Path, what: str) -> IndexCopy:
    """:func:`promote_checkpoint` of a checkpoint of sharded state (see the module
    docstring): its files keep their generation's name, so its record stays valid as is."""
    raw = read_record_bytes(source, SHARDED_RECORD)
    generation, files, _ = record_files(source, raw, what)
    if not is_local(backend_for(target)):
        # As for indices: every file proven before the target is touched at all.
        for path, file_record in files.values():
            read_verified(path, file_record, what)
    return IndexCopy(write_generation(target, generation, files, raw, what), 0)


def same_files(source: Path, target: Path) -> bool:
    """Whether ``target`` is committed with the files (names, sizes, crc32c) of ``source``
    (for checkpoints of sharded state: the same commit record, naming the same generation
    and files)."""
    if backend_for(source).exists(source / SHARDED_RECORD):
        try:
            return read_record_bytes(target, SHARDED_RECORD) == read_record_bytes(
                source, SHARDED_RECORD
            )
        except (OSError, FastCkptError):
            return False

    def files(path: Path) -> dict[str, tuple[int, int]] | None:
        try:
            record = read_commit_record(path)
        except (OSError, FastCkptError):
            return None
        return {
            _stripped(record, relpath): (int(r["size"]), int(r["crc32c"]))
            for relpath, r in record["files"].items()
        }

    held = files(target)
    return held is not None and held == files(source)


def remove_checkpoint(path: str | os.PathLike[str]) -> None:
    """Delete the checkpoint directory ``path``; nothing there is fine. Locally it is first
    renamed to a hidden temporary sibling that names this process (atomic, made durable), so
    a process killed meanwhile leaves a leftover the next staging in the tier removes
    (:func:`~fastckpt.storage.backend.clean_dead_siblings`), never a directory under the
    checkpoint's name. On an object store its commit record goes first, so a kill leaves an
    uncommitted prefix, never a commit record naming missing files."""
    path = Path(path)
    backend = backend_for(path)
    if not is_local(backend):
        backend.delete(path / COMMIT_RECORD)
        backend.delete(path / SHARDED_RECORD)
        backend.delete(path)
        return
    if os.path.islink(path):
        # A link to a checkpoint elsewhere (another run's, made by hand: saves never write
        # through one): the link goes, what it points to is not this root's to delete.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            _native.fsync_dir(str(path.parent))
        return
    remove_replaced(path)  # an older copy moved aside must not come back in its place
    aside = temp_sibling(TEMP_PREFIX, path)
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return
    _native.fsync_dir(str(path.parent))
    shutil.rmtree(aside, ignore_errors=True)


def checkpoint_problem(path: Path) -> str | None:
    """Why the checkpoint ``path`` does not verify (None: every file does)."""
    try:
        report = verify(path)
    except (OSError, FastCkptError) as err:
        return str(err)
    failures = report.failures
    return None if not failures else failures[0].message or failures[0].status


def prune_checkpoints(
    root: str | os.PathLike[str], keep_last: int, *, spare: Collection[str] = ()
) -> list[str]:
    """Delete all but the newest ``keep_last`` committed checkpoints of the tier root
    ``root`` (:func:`committed_checkpoints` order, symlinks not counted), never one named in
    ``spare`` or that a symlink in ``root`` points at, and never the newest one that
    verifies: the kept ones are verified newest first, and when none of them does, the newest
    older one that verifies is kept too. Returns the deleted names.

    Raises:
        ValueError: ``keep_last < 1``.
    """
    doomed = doomed_checkpoints(root, keep_last, spare=spare)
    for name in doomed:
        remove_checkpoint(Path(root) / name)
    return doomed


def _committed(checkpoint: Path) -> bool:
    """Whether the checkpoint directory ``checkpoint`` holds its commit record."""
    backend = backend_for(checkpoint)
    return any(backend.exists(checkpoint / r) for r in (COMMIT_RECORD, SHARDED_RECORD))


def _alias_targets(root: Path) -> set[str]:
    """The checkpoints of the local tier root ``root`` that a symlink there points at (an
    alias such as ``latest -> step_20``): never pruned, so that no alias is left dangling."""
    if not is_local(backend_for(root)) or not os.path.isdir(root):
        return set()
    real = os.path.realpath(root)
    targets = set()
    for entry in os.scandir(root):
        if entry.is_symlink():
            target = os.path.realpath(entry.path)
            if os.path.dirname(target) == real:
                targets.add(os.path.basename(target))
    return targets


def _holds_strays(checkpoint: Path) -> bool:
    """Whether the local checkpoint folder ``checkpoint`` also holds what its record does not
    name (a user's notes, a checkpoint saved inside it): a prune keeps it, and says why,
    rather than delete what fastckpt did not write (as a save refuses to replace it)."""
    if not is_local(backend_for(checkpoint)) or not os.path.isdir(checkpoint):
        return False
    names = os.listdir(checkpoint)
    strays = stray_names(checkpoint, names) + _nested_strays(checkpoint, names)
    if strays:
        message = (
            f"{display_path(checkpoint)}: not pruned: it also holds {shown_names(strays)}, "
            "which its record does not name; move them out of the checkpoint, then prune again"
        )
        _LOG.warning("%s", message)
        warnings.warn(message, RuntimeWarning, stacklevel=4)
    return bool(strays)


def _nested_strays(checkpoint: Path, names: list[str]) -> list[str]:
    """Files inside the folders of an unsharded checkpoint's record (``linked/``) that the
    record does not list (a user's file put there)."""
    if COMMIT_RECORD not in names:
        return []
    try:
        listed = {str(relpath) for relpath in read_commit_record(checkpoint)["files"]}
    except (OSError, FastCkptError, KeyError, TypeError):
        return []  # unreadable: a prune keeps it anyway (it does not verify)
    folders = {relpath.split("/", 1)[0] for relpath in listed if "/" in relpath}
    found = []
    for folder in sorted(folders & set(names)):
        for here, _, files in os.walk(checkpoint / folder):
            for name in files:
                if name.startswith("."):
                    continue  # hidden (.DS_Store, .nfs*), as at the top level
                relpath = os.path.relpath(os.path.join(here, name), checkpoint)
                if relpath.replace(os.sep, "/") not in listed:
                    found.append(relpath)
    return found


def _none_verifies(root: Path, kept: list[str]) -> bool:
    """Whether none of the checkpoints ``kept`` of ``root`` verifies (read newest first, up
    to the first that does). When the newest does not, the next incremental save of this
    process into ``root`` links nothing (:func:`~fastckpt.container.refs.distrust`): its
    damaged file would otherwise be linked into every later checkpoint."""
    for position, name in enumerate(reversed(kept)):
        if checkpoint_problem(root / name) is None:
            return False
        if position == 0:
            distrust(root)
    return True


def doomed_checkpoints(
    root: str | os.PathLike[str], keep_last: int, *, spare: Collection[str] = ()
) -> list[str]:
    """What :func:`prune_checkpoints` would delete (oldest first), without deleting it.

    Raises:
        ValueError: ``keep_last < 1``.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 (the newest is never deleted), got {keep_last}")
    root = Path(root)
    names = committed_checkpoints(root)
    aliased = _alias_targets(root)
    doomed = [
        name
        for name in names[:-keep_last]
        if name not in spare and name not in aliased and not _holds_strays(root / name)
    ]
    if not doomed:
        return []
    # Only the checkpoints newer than every doomed one count: an older one kept (an alias's
    # target, one being promoted) must not let the newest that verifies be deleted.
    newer = names[names.index(doomed[-1]) + 1 :]
    if _none_verifies(root, newer):
        for name in reversed(doomed):
            if checkpoint_problem(root / name) is None:
                _LOG.warning(
                    "%s: no newer checkpoint verifies; keeping %s", display_path(root), name
                )
                doomed.remove(name)
                break
        else:
            # Nothing verifies: what is damaged may still be partly recoverable (an intact
            # model beside a rotten optimizer file), and a prune must not decide which.
            _LOG.warning(
                "%s: prune deleted nothing: no checkpoint verifies (fastckpt verify %s "
                "names the damage); restore from a copy or delete by hand",
                display_path(root),
                display_path(root),
            )
            return []
    return doomed


@dataclass
class NearestCheckpoint:
    """Where :func:`nearest_intact_checkpoint` found the checkpoint to restore.

    Attributes:
        path: the checkpoint directory.
        tier: the tier root holding it.
        name: its name (the same on every tier: promotion keeps it).
        skipped: ``"<path>: <why>"`` for every newer copy that did not verify and every
            tier that could not be read.
    """

    path: Path
    tier: Path
    name: str
    skipped: list[str] = field(default_factory=list)

    def describe(self) -> str:
        """One line: which copy, and what was passed over."""
        text = f"restoring {self.name} from {display_path(self.tier)}"
        return text + (f" (skipped: {'; '.join(self.skipped)})" if self.skipped else "")


def nearest_intact_checkpoint(
    tiers: Sequence[str | os.PathLike[str]], name: str | None = None
) -> NearestCheckpoint:
    """The copy to restore from the tier roots ``tiers`` (fastest first): the newest
    checkpoint that verifies (every file against its commit record, linked files included)
    on any tier, taken from the first tier that holds it intact; with ``name``, that
    checkpoint from the first tier holding it intact. "Newest" follows the first tier that
    holds the checkpoint (the fast tier saw every save; a durable tier a subset, in order),
    merged by save date where every date is one (a checkpoint the fast tier lost then comes
    before its older ones, from the durable tier), except where a slower tier shows the
    faster ones to be left from an earlier run
    (:func:`tier_left_behind`: it holds a checkpoint saved after all of theirs by more than
    the margin, under a name of its own or, where all dates are save times, one of theirs):
    that tier's order
    comes first, ``skipped`` says so, and
    their copy of a name it holds too is taken only where both date alike (within that
    margin): otherwise it is another run's checkpoint under the same name.

    Raises:
        NotCommittedError: no tier holds an intact copy; the message lists what was passed
            over and why.
    """
    skipped: list[str] = []
    found: list[tuple[Path, TierDates]] = []
    for tier in (Path(t) for t in tiers):
        if is_local(backend_for(tier)):
            for name in restore_replaced(tier):  # a replace its writer never finished
                _LOG.warning("%s: put back %s, which a replace had moved aside", tier, name)
        try:
            found.append((tier, tier_dates(tier)))
        except (OSError, FastCkptError) as err:
            skipped.append(f"{display_path(tier)}: {err}")
    listings = [(tier, listed.dates) for tier, listed in found]
    ranked = list(listings)
    stale: dict[Path, float] = {}  # a tier left behind -> the margin it was judged by
    for i, (tier, dates) in enumerate(listings[1:], start=1):
        ahead, margin = tier_left_behind([t for _, t in found[:i]], found[i][1])
        if ahead is not None:
            faster: dict[str, float] = {}
            for _, earlier in found[:i]:
                faster.update(earlier.evidence())
            stale.update((t, margin) for t, _ in listings[:i])
            newest = max(faster, key=lambda n: faster[n])
            places = ", ".join(display_path(t) for t, _ in listings[:i])
            skipped.append(
                f"{places}: left from an earlier run? its newest checkpoint {newest} was "
                f"saved {date_text(faster[newest])}, before {display_path(tier / ahead)} "
                f"({date_text(dates[ahead])})"
            )
            ranked.remove((tier, dates))
            ranked.insert(0, (tier, dates))
    # Newest first: a tier's own order, the faster tier's first.
    order: list[str] = []
    for _, dates in ranked:
        for candidate in reversed(dates):
            if candidate not in order:
                order.append(candidate)
    if not stale and found and all(listed.saved for _, listed in found):
        # Every date is a save time (a promotion carries it): a checkpoint only a slower tier
        # holds (the fast tier lost its copy) takes its place by when it was saved, not
        # after every checkpoint the fast tier holds (stable: ties keep the order above).
        first_date = {n: next(d[n] for _, d in ranked if n in d) for n in order}
        order.sort(key=lambda n: first_date[n], reverse=True)
    if name is not None:
        order = [name] if name in order else []
    for candidate in order:
        dated = next(dates[candidate] for _, dates in ranked if candidate in dates)
        for tier, names in listings:
            if candidate not in names:
                continue
            if tier in stale and abs(names[candidate] - dated) > stale[tier]:
                skipped.append(
                    f"{display_path(tier / candidate)}: another run's checkpoint under that name "
                    f"(saved {date_text(names[candidate])}; the run's was saved {date_text(dated)})"
                )
                continue
            problem = checkpoint_problem(tier / candidate)
            if problem is None:
                return NearestCheckpoint(tier / candidate, tier, candidate, skipped)
            skipped.append(f"{display_path(tier / candidate)}: {problem}")
    what = "checkpoint" if name is None else f"copy of {name}"
    roots = ", ".join(display_path(Path(t)) for t in tiers)
    raise NotCommittedError(
        f"no intact {what} in {roots}" + (f" (skipped: {'; '.join(skipped)})" if skipped else "")
    )


def saved_later(source: Path, target: Path) -> float | None:
    """When ``target`` (a committed copy under ``source``'s name on another tier) was saved,
    where that is more than :data:`SAVED_LEFT_BEHIND_S` after ``source`` was: a later save
    of the run under that name, which an older copy must not replace. None when it is not, or
    when either record gives no save time (an earlier version's, or none at all)."""
    dates = []
    for directory in (source, target):
        backend = backend_for(directory)
        record = next(
            (r for r in (COMMIT_RECORD, SHARDED_RECORD) if backend.exists(directory / r)), None
        )
        dates.append(None if record is None else saved_seconds(directory, record))
    mine, theirs = dates
    if mine is None or theirs is None or theirs <= mine + SAVED_LEFT_BEHIND_S:
        return None
    return theirs


def date_text(when: float) -> str:
    """A save time (seconds since the epoch) as ISO 8601 UTC, to the second."""
    return datetime.datetime.fromtimestamp(when, tz=datetime.UTC).isoformat(timespec="seconds")


class CheckpointPromoter(Promoter):
    """:class:`~fastckpt.container.promote.Promoter` for tier roots of CheckpointManager
    checkpoints: :meth:`submit_checkpoint` after a checkpoint of ``source`` committed; the
    background thread promotes the queued names in order (a failed one stays queued for the
    next attempt), then keeps the newest ``keep_last`` checkpoints of ``target``
    (:func:`prune_checkpoints`). Failures are reported as the base class reports them;
    ``detached`` runs each attempt in a process of its own, as for the base class.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """As :class:`~fastckpt.container.promote.Promoter` (``every`` is the caller's to
        apply: it decides which saves it submits)."""
        super().__init__(*args, **kwargs)
        self._queue: list[str] = []

    def submit_checkpoint(self, name: str) -> None:
        """Queue the checkpoint ``name`` of ``source`` for promotion; returns at once.

        Raises:
            PromotionError: ``strict`` and the previous attempt failed.
        """
        self.enqueue(name)
        self.submit()

    def enqueue(self, name: str) -> None:
        """Queue the checkpoint ``name`` of ``source`` for the next promotion run, without
        starting one."""
        check_name(name, "checkpoint directory name")
        with self._lock:
            if name not in self._queue:
                self._queue.append(name)

    def queued(self) -> list[str]:
        """The names waiting for promotion, the one being promoted first (the fast tier's
        retention keeps that one and the newest)."""
        with self._lock:
            return list(self._queue)

    def _target_held(self) -> int | None:
        return None  # the queue says what is due: see :meth:`_due_now`

    def _due_now(self, held: int | None) -> frozenset[Any]:
        """The names queued now: this run promotes no other (later ones wait for the next
        run), so a fast tier's retention sparing them never deletes one under it."""
        return frozenset(self.queued())

    def run_here(self) -> dict[str, Any]:
        """Promote the queued names in order, then the target's retention; returns
        ``promoted``, ``done`` (the names taken off the queue: promoted, already held
        there, removed from ``source`` before their turn, or damaged) and ``damaged``
        (``(name, why)`` of the checkpoints that do not verify in ``source`` and were passed
        over for a later one: retrying them never succeeds, and held up every later name).
        A damaged name last in the queue raises (it stays queued for the next run, which
        passes over it once a later save is queued behind it)."""
        promoted: list[str] = []
        done: list[str] = []
        damaged: list[tuple[str, str]] = []
        while True:
            with self._lock:
                # Only what this run was started with (see _due_now): later names wait.
                names = [n for n in self._queue if self._in_flight is None or n in self._in_flight]
                if not names:
                    break
                name = names[0]
            source = self.source / name
            if not _committed(source):
                _LOG.warning("%s: removed before it was promoted", display_path(source))
            elif (later := saved_later(source, self.target / name)) is not None:
                _LOG.warning(
                    "%s is not promoted: %s under that name was saved later (%s), by a run "
                    "that went on elsewhere; this copy is older and would replace it",
                    display_path(source),
                    display_path(self.target / name),
                    date_text(later),
                )
            elif not same_files(source, self.target / name):
                try:
                    promote_checkpoint(source, self.target / name)
                except (FastCkptError, OSError) as err:
                    if _committed(source):
                        proven = isinstance(err, SOURCE_DAMAGE) and (
                            checkpoint_problem(source) is not None
                        )
                        if name == names[-1] or not proven:
                            raise  # the last queued, or not the source's bytes
                        _LOG.warning(
                            "%s does not verify (%s); not promoted, promoting the later ones",
                            display_path(source),
                            err,
                        )
                        damaged.append((name, f"{type(err).__name__}: {err}"))
                    else:
                        # Deleted while it was copied (a retention not told of this run):
                        # like one removed before its turn, not a failed promotion.
                        _LOG.warning("%s: removed while it was promoted", display_path(source))
                else:
                    promoted.append(name)
            with self._lock:
                self._queue.remove(name)
            done.append(name)
        if self.keep_last is not None:
            prune_checkpoints(self.target, self.keep_last)
        return {"promoted": promoted, "done": done, "damaged": damaged}

    def spec(self) -> dict[str, Any]:
        """:meth:`Promoter.spec` with the queued names."""
        return {**super().spec(), "queue": self.queued()}

    def _apply(self, outcome: Mapping[str, Any]) -> None:
        super()._apply(outcome)
        with self._lock:  # a detached run's names (this process's run took them off itself)
            for name in outcome.get("done") or ():
                if name in self._queue:
                    self._queue.remove(name)
