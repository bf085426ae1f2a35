"""Promotion: a committed index of one root copied to another root, as a committed index.

The first building block of tiers (a fast tier that takes every checkpoint, a durable one that
takes some of them): :func:`promote_index` copies index ``i`` of a *source* root (say a
node-local disk) into a *target* root (another filesystem, or ``s3://``) through the one
commit protocol of :mod:`fastckpt.container.commit`:

1. the target root's lock is taken and what interrupted saves or promotions left is removed;
2. every file the source's manifest lists for the index is read, and its size and crc32c are
   checked against that manifest before it is written to the target (a damaged source file
   raises :class:`~fastckpt.errors.ChecksumMismatchError` naming it, and the target is left
   as it was: on an object store, where replacing an index withdraws it first, the whole
   index is proven before the target is touched at all);
3. the files are written durably under the index's staging name in the target, and what was
   written is checked against the source's records once more;
4. the target's manifest is committed last, with the source's entry (its counters, components,
   creation time), so the promoted index loads, verifies and lists exactly like the original.

A process killed at any moment leaves the target's manifest as it was before (the index is not
named, or is named with its complete files); the next promotion or save into the target removes
the leftovers, and :func:`promote` finishes the job (it copies every source index the target
does not hold yet).

Every index is self-contained (its unchanged tensors are hard links inside it, see
:mod:`fastckpt.container.incremental`), so its files copy as they are; each file is held in
memory once while it is copied. An index of a root written by an earlier fastckpt version
references tensors in an earlier index's own file (:mod:`fastckpt.container.refs`): where
the target does not hold that file as the reference records it, the file is copied into the
target's retained copy of that index (``ROOT/.ref-<index>/``, where loads find it), before
the commit; every reference is checked to resolve in the target before the commit, and one
that cannot (an object store, which keeps no retained copies; the target's index of that
number being another checkpoint) refuses the promotion with
:class:`~fastckpt.errors.PromotionError`, nothing committed.

Files the target already holds (this process promoted them, and proves them identical by
their BLAKE3 digest) are stored by the target from what it holds, a hard link or a server-side
copy, instead of being transferred again: see :mod:`fastckpt.container.copy`.

An index of a sharded (FSDP2 / TP) strategy brings its sharded part, every rank's files,
written and committed before the index's own files: see :mod:`fastckpt.container.sharded.promote`.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastckpt.container.background import after_pending_writes, report_tolerated, stderr_line
from fastckpt.container.commit import IndexWriter, clean_leftovers, index_intact, prune_indices
from fastckpt.container.copy import (
    IndexCopy,
    copy_files,
    forget_promoted,
    read_verified,
    remember_written,
)
from fastckpt.container.refs import (
    REFS_FILE,
    RETAINED_PREFIX,
    Reference,
    check_reference,
    index_references,
    root_key,
    source_path,
    write_retained,
)
from fastckpt.container.sharded.nodes import NodeHoldings, PartKey, held_by_others
from fastckpt.container.sharded.parts import Part
from fastckpt.container.sharded.promote import (
    part_problem,
    prove_part,
    upload_rank_files,
    write_part,
)
from fastckpt.errors import (
    CheckpointFormatError,
    ChecksumMismatchError,
    DamagedSourceError,
    FastCkptError,
    NotCommittedError,
    PromotionError,
)
from fastckpt.format.records import Manifest
from fastckpt.storage.registry import (
    absolute,
    backend_for,
    display_path,
    is_local,
    storage_options_of,
)

__all__ = [
    "SOURCE_DAMAGE",
    "IndexCopy",  # re-exported from fastckpt.container.copy
    "NearestCopy",
    "Promoter",
    "PromotionReport",
    "RankPromoter",
    "forget_promoted",  # re-exported from fastckpt.container.copy
    "nearest_intact",
    "promote",
    "promote_index",
    "still_committed",
]

_LOG = logging.getLogger(__name__)

#: What a promotion raises when its source's bytes or records are damaged or missing (a
#: rotten or missing file, an unreadable record): passed over once the source is proven
#: not to verify (see :func:`promote`).
SOURCE_DAMAGE = (CheckpointFormatError, ChecksumMismatchError, FileNotFoundError)

#: How the detached promoter starts: ``python -c _DETACHED_BOOT SYS_PATH`` (the trainer's
#: ``sys.path`` as JSON), then :mod:`fastckpt.container.detached` as ``__main__``.
_DETACHED_BOOT = (
    "import json, runpy, sys; sys.path[:] = json.loads(sys.argv[1]); "
    "runpy.run_module('fastckpt.container.detached', run_name='__main__', alter_sys=True)"
)


@dataclass
class PromotionReport:
    """What :func:`promote` did.

    Attributes:
        promoted: the indices copied, in order.
        skipped: the source indices the target already held (same files, same checksums),
            or older than the target's newest.
        vanished: indices the source's retention pruned while they were being promoted.
        damaged: ``(index, why)`` of the source indices that do not verify (a rotten or
            missing file) and were passed over for a newer one: one damaged index never
            holds up the promotion of the later ones (the newest due index, when damaged,
            raises instead).
        conflicting: indices the target holds as its newest, intact (read whole), with
            other files than the source's: another run's (another node's) checkpoint under
            the same number, left as it is (never replaced by a copy from elsewhere).
        bytes_copied: bytes read from the source and written to the target.
        bytes_reused: bytes the target stored from files it already held (proven identical,
            see the module docstring), none of them transferred.
        newest: the target's newest committed index afterwards (None: it holds none).
    """

    promoted: list[int] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)
    vanished: list[int] = field(default_factory=list)
    damaged: list[tuple[int, str]] = field(default_factory=list)
    conflicting: list[int] = field(default_factory=list)
    bytes_copied: int = 0
    bytes_reused: int = 0
    newest: int | None = None


def _distinct(source: Path, target: Path) -> None:
    """Refuse promoting a local root into itself, however it is named (a symlink, ``..``)."""
    if os.path.realpath(source) == os.path.realpath(target):
        shown = display_path(target)
        if os.path.abspath(source) != os.path.abspath(target):
            shown += f" (that is {os.path.realpath(target)})"
        raise ValueError(f"{display_path(source)}: promoting a root into itself: {shown}")


def promote_index(
    source: str | os.PathLike[str],
    target: str | os.PathLike[str],
    index: int,
    *,
    node_local: bool = False,
    wait_s: float | None = None,
    newest_only: bool = False,
) -> IndexCopy | None:
    """Copy the committed index ``index`` of the root ``source`` into the root ``target`` as
    a committed index with the same number (replacing one already there); see the module
    docstring for the protocol and for the files that are not transferred again.

    ``newest_only``: copy nothing and return None when, under the target's lock, the target
    holds an index newer than ``index`` (another promoter committed, and its retention may
    have pruned, past it since the caller looked).

    ``node_local``: ``source`` is rank 0's node-local fast root of a sharded run; the other
    ranks' shards are uploaded by their ranks, waited for up to ``wait_s`` seconds (see
    :mod:`fastckpt.container.sharded.promote`).

    Raises:
        NotCommittedError: ``source`` has no committed index ``index``.
        ChecksumMismatchError / CheckpointFormatError: a source file is damaged or missing
            (names it); the target is untouched.
        ValueError: a sharded index written before parts existed (not promotable).
        TimeoutError: ``node_local`` and another rank's shards did not arrive in time.
    """
    source, target = Path(source), Path(target)
    _distinct(source, target)
    manifest = Manifest.load(source, verify_checksum=True)  # never re-seal an edited entry
    entry = manifest.entries.get(index)
    if entry is None:
        committed = sorted(manifest.entries)
        raise NotCommittedError(
            f"{display_path(source)}: no committed index {index} to promote (committed: "
            f"{committed or 'none'})"
        )
    what = f"index {index} of {display_path(source)}"
    part = prove_part(source, manifest, index, what, node_local=node_local)
    files: dict[str, tuple[Path, Mapping[str, Any]]] = {}
    for relpath, record in (entry.get("files") or {}).items():
        # checked as the loaders check it: a plain relpath whose real path (symlinks
        # followed) stays inside the source root, else CheckpointFormatError
        files[relpath] = (manifest.file_path(index, relpath), record)
    # The copy pass reads and proves each file as it writes it; a damaged one aborts the
    # staging, leaving the target's committed indices as they were. On an object store,
    # where replacing an index withdraws it (and its objects) first, every source file is
    # also proven before the target is touched at all, holding one file at a time.
    if not is_local(backend_for(target)):
        for path, record in [*files.values(), *(part.files.values() if part else ())]:
            read_verified(path, record, what)

    def past_it(held: Manifest, number: int) -> None:
        # Under the lock, before anything changes (an index an object store is replacing is
        # set aside only after this): the target moved past this index since it was chosen.
        if newest_only and held.latest is not None and number < held.latest:
            raise _TargetMovedOn

    try:
        writer = IndexWriter(target, index, check=past_it)  # the lock, held until the commit
    except _TargetMovedOn:
        return None
    try:
        held = Manifest.load(target)
        part_bytes = 0 if part is None else write_part(target, index, part, what, wait_s=wait_s)

        def listed(container: str, relpath: str) -> Mapping[str, Any] | None:
            held_entry = held.entries.get(int(container))
            return None if held_entry is None else (held_entry.get("files") or {}).get(relpath)

        done, written = copy_files(files, writer, target, listed, what)
        retained = _resolve_references(manifest, index, target, held, what)
        writer.commit_entry({key: value for key, value in entry.items() if key != "files"})
    except BaseException:
        writer.abort()  # a failed commit too: no hidden staging folder left in the target
        raise
    remember_written(target, str(index), written)
    return IndexCopy(done.copied + part_bytes + retained, done.reused)


class _TargetMovedOn(Exception):
    """Raised under the target's lock by :func:`promote_index` (``newest_only``): the target
    holds an index newer than the one to promote."""


def _resolve_references(
    source: Manifest, index: int, target: Path, held: Manifest, what: str
) -> int:
    """Before index ``index`` of ``source`` is committed in ``target`` (whose manifest,
    read under its lock, is ``held``): make every reference of it into an earlier index (an
    earlier fastckpt version's layout) resolve in ``target``, copying each referenced file
    the target lacks into its retained copy of that index (``.ref-<i>``); then check that
    every such reference resolves there (the file's size and each referenced tensor's
    crc32c in its header). References into the index itself (its linked files) are its own
    files, copied and proven with it. Returns the bytes copied into retained copies.

    Raises:
        PromotionError: a reference cannot resolve in ``target`` (nothing is committed).
        CheckpointFormatError / ChecksumMismatchError: the source's ``refs.json`` or a
            referenced file is damaged or missing.
    """
    groups: dict[tuple[int, str, int, int], list[Reference]] = {}
    for names in index_references(source, index).values():
        for ref in names.values():
            if ref["index"] != index:
                key = (ref["index"], ref["file"], ref["file_size"], ref["file_crc32c"])
                groups.setdefault(key, []).append(ref)
    local = is_local(backend_for(target))
    copied = 0
    for (named, relpath, size, crc), group in sorted(groups.items()):
        problem = check_reference(held, group)
        retained = target / f"{RETAINED_PREFIX}{named}"
        if problem is None:
            continue
        if not local:
            reason = "an object store keeps no retained copies of indices it does not hold"
        elif named in held.entries:
            reason = f"its index {named} is another checkpoint, with other files"
        elif backend_for(retained).exists(retained / relpath):
            reason = f"its retained copy {display_path(retained / relpath)} holds other bytes"
        else:
            data = read_verified(
                source_path(source, group[0]),
                {"size": size, "crc32c": crc},
                f"{what} (its {REFS_FILE} references it)",
            )
            write_retained(target, named, relpath, data)
            copied += len(data)
            del data
            problem = check_reference(held, group)
            if problem is None:
                continue
            reason = "the copy made there does not match"
        raise PromotionError(
            f"{what} was written by an earlier fastckpt version: its {REFS_FILE} reads "
            f"tensors from index {named}'s {relpath}, which {display_path(target)} cannot "
            f"hold ({reason}: {problem}); nothing of index {index} was committed there. Fix: "
            f"promote every index (fastckpt promote --every 1, promote_every=1) into a "
            f"target that holds none of another run, so that index {named} is there first; "
            f"or load index {index} and save it again with this fastckpt (every index it "
            "writes is self-contained), then promote that"
        )
    return copied


def _clean(root: Path) -> None:
    """Remove what interrupted writers left in ``root``, under its lock."""
    lock = backend_for(root).lock(root)
    lock.acquire()
    try:
        clean_leftovers(root, promoting=True)
    finally:
        lock.release()


def _same_files(a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool:
    """Whether two manifest entries record the same files (names, sizes and crc32c): one
    index and its promoted copy on another tier."""

    def key(entry: dict[str, Any] | None) -> dict[str, tuple[int, int]]:
        files = (entry or {}).get("files") or {}
        return {name: (int(r["size"]), int(r["crc32c"])) for name, r in files.items()}

    return a is not None and b is not None and key(a) == key(b)


def _saved_later(entry: Mapping[str, Any], than: Mapping[str, Any]) -> bool:
    """Whether manifest entry ``entry`` records a later save than ``than`` (their ``created``
    times): an index re-saved in place (``checkpoint_index=``) after its promotion, not
    another run's older checkpoint under that number."""
    try:
        return _dt.datetime.fromisoformat(str(entry["created"])) > _dt.datetime.fromisoformat(
            str(than["created"])
        )
    except (KeyError, TypeError, ValueError):
        return False


def promote(
    source: str | os.PathLike[str],
    target: str | os.PathLike[str],
    *,
    every: int = 1,
    newest: bool = True,
    node_local: bool = False,
    wait_s: float | None = None,
    verify_held: bool = False,
    within: Collection[int] | None = None,
) -> PromotionReport:
    """Bring ``target`` up to date with ``source``: every committed index of ``source``
    whose number is a multiple of ``every`` (and, with ``newest``, the newest whatever its
    number) and is newer than ``target``'s newest index is promoted, oldest first (see
    :func:`promote_index`); so is ``target``'s newest index itself when its copy there does
    not verify (read whole) and either its files differ from the source's or ``verify_held``
    (``fastckpt promote``, a repair), or when the source's index was saved later (re-saved in
    place with ``checkpoint_index=``). A newest index there that verifies, holds other files
    than the source's and was saved later than it is another run's checkpoint under that
    number (the run went on elsewhere): it is kept, logged and listed in the report's
    ``conflicting``. Older indices ``target`` lacks (pruned
    there) are not copied again. A promotion that a killed process left unfinished is
    thereby finished.
    ``node_local``, ``wait_s``: as for :func:`promote_index`; only the newest due index is
    promoted then. ``within``: only these indices are promoted (what a :class:`Promoter` run
    decided before it started, which the fast tier's retention spares meanwhile).

    A due index that does not verify in ``source`` (a damaged or missing file) is passed
    over for the later ones, listed in the report's ``damaged`` and logged: it can never be
    promoted, and retrying it at every run held up every later checkpoint.

    Raises:
        ValueError: ``every`` < 1, or ``target`` is ``source``.
        what :func:`promote_index` raises, for the newest due index when it is damaged, or
        the first index that fails otherwise (the indices before it are committed in
        ``target``).
    """
    if every < 1:
        raise ValueError(f"every must be >= 1, got {every}")
    _distinct(Path(source), Path(target))
    source_manifest = Manifest.load(source, verify_checksum=True)
    report = PromotionReport()
    target_manifest = Manifest.load(target)
    report.newest = target_manifest.latest
    if source_manifest.latest is None:
        return report
    if target_manifest.latest is not None:
        _clean(Path(target))  # what killed promotions (or saves) left there
    floor = -1 if target_manifest.latest is None else target_manifest.latest
    due = [
        index
        for index in sorted(source_manifest.entries)
        if not index % every or (newest and index == source_manifest.latest)
    ]
    if within is not None:
        report.skipped += [index for index in due if index not in within]
        due = [index for index in due if index in within]
    if node_local:
        # Only the newest: an older index whose other shards never come (a node replaced
        # since) must not hold up every later promotion.
        report.skipped += due[:-1]
        due = due[-1:]
    for index in due:
        # What the target holds now: another promoter (the trainer's, a `fastckpt promote`)
        # may have committed and pruned there since (before: indices its retention had just
        # pruned were promoted back, each said not to verify).
        if index >= floor:  # (the floor only rises: retention keeps the newest index)
            target_manifest = Manifest.load(target)
            floor = -1 if target_manifest.latest is None else target_manifest.latest
        held = target_manifest.entries.get(index)
        same = _same_files(source_manifest.entries[index], held)
        if same and verify_held and index == floor:
            problem = index_intact(target_manifest, index)
            if problem is not None:
                _LOG.warning(
                    "%s: its copy of index %d does not verify (%s); promoting it again",
                    display_path(target),
                    index,
                    problem,
                )
                same = False
        source_entry = source_manifest.entries[index]
        if not same and held is not None and index == floor and not node_local:
            problem = index_intact(target_manifest, index)
            if problem is None and not _saved_later(source_entry, held):
                _LOG.warning(
                    "%s: index %d there verifies but holds other files than %s's index %d "
                    "(another run's or node's checkpoint under that number): kept, not "
                    "replaced; delete it there by hand to promote this one",
                    display_path(target),
                    index,
                    display_path(source),
                    index,
                )
                report.conflicting.append(index)
                continue
        if index < floor or same:
            report.skipped.append(index)
            continue
        try:
            done = promote_index(
                source, target, index, node_local=node_local, wait_s=wait_s, newest_only=True
            )
            if done is None:  # the target moved past it under its lock, since read above
                report.skipped.append(index)
                continue
            report.bytes_copied += done.copied
            report.bytes_reused += done.reused
        except SOURCE_DAMAGE as err:
            if index not in Manifest.load(source).entries:
                # Pruned from the source while this ran (its retention): nothing to promote.
                _LOG.warning("%s: index %d was pruned before it was promoted", source, index)
                report.vanished.append(index)
                continue
            if index == due[-1] or index_intact(Manifest.load(source), index) is None:
                # the newest due index, or the failure was not the source's bytes
                if report.promoted:  # say what this run did commit before it
                    raise type(err)(
                        f"{err}; committed in {display_path(target)} before it: "
                        f"{', '.join(f'index {i}' for i in report.promoted)}"
                    ) from err
                raise
            _LOG.warning(
                "%s: index %d does not verify (%s); not promoted, promoting the later ones",
                display_path(source),
                index,
                err,
            )
            report.damaged.append((index, f"{type(err).__name__}: {err}"))
            continue
        report.promoted.append(index)
    report.newest = Manifest.load(target).latest
    return report


class _DetachedProcess:
    """A promoter's detached process (:mod:`fastckpt.container.detached`): started in a new
    session with the trainer's ``sys.path`` (so it imports this very fastckpt); each run is
    one JSON line on its stdin, answered by one JSON line on its stdout. Its stderr (warnings)
    goes to a file, so that it can finish a run after the trainer died; it exits when its
    stdin closes (:meth:`close`, or the trainer's death), after the run it is in."""

    def __init__(self) -> None:
        self._child: subprocess.Popen[bytes] | None = None
        self._log: Any = None  # its stderr: a temporary file
        self._logged = 0  # how much of it was relayed

    def _started(self) -> subprocess.Popen[bytes]:
        if self._child is not None and self._child.poll() is None:
            return self._child
        self.close()
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 - the process's lifetime, closed by close()
        self._logged = 0
        self._child = subprocess.Popen(
            [sys.executable, "-c", _DETACHED_BOOT, json.dumps(sys.path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            start_new_session=True,
        )
        return self._child

    def run(self, spec: Mapping[str, Any], handed: Callable[[int | None], None]) -> dict[str, Any]:
        """Hand it ``spec``, call ``handed(pid)`` (then ``handed(None)`` once it answered),
        return its outcome.

        Raises:
            RuntimeError: the run failed there, or the process died (the next run starts a
                new one).
        """
        child = self._started()
        assert child.stdin is not None and child.stdout is not None
        line = b""
        try:
            with contextlib.suppress(BrokenPipeError):  # it died: reported below
                child.stdin.write(json.dumps(spec).encode() + b"\n")
                child.stdin.flush()
                handed(child.pid)
                line = child.stdout.readline()
        finally:
            handed(None)
        self._relay(child.pid)
        if not line:
            code = child.wait()
            self.close()
            raise RuntimeError(f"the detached promoter (pid {child.pid}) exited with code {code}")
        outcome = json.loads(line)
        if "error" in outcome:
            raise RuntimeError(
                f"the detached promoter (pid {child.pid}) failed: {outcome['error']}"
            )
        result: dict[str, Any] = outcome
        return result

    def _relay(self, pid: int) -> None:
        """Log what the process wrote to its stderr since the last run (its warnings)."""
        if self._log is None:
            return
        self._log.seek(self._logged)
        text = self._log.read()
        self._logged += len(text)
        if text.strip():
            message = text.decode(errors="replace").strip()[-4000:]
            _LOG.warning("detached promoter (pid %d): %s", pid, message)

    def close(self) -> None:
        """Close its stdin and wait for it to exit (after the run it may be in)."""
        child, self._child = self._child, None
        if child is not None:
            assert child.stdin is not None
            with contextlib.suppress(BrokenPipeError):
                child.stdin.close()
            child.wait()
            if child.stdout is not None:
                child.stdout.close()
            self._relay(child.pid)
        if self._log is not None:
            self._log.close()
            self._log = None


#: Seconds the exit hook waits for a promotion before it says it still runs (and waits on).
_EXIT_NOTICE_S = 60.0
#: Every promoter of this process (for the fork reset and the exit hook below).
_PROMOTERS: weakref.WeakSet[Promoter] = weakref.WeakSet()


def _forget_parent_threads() -> None:
    for promoter in list(_PROMOTERS):
        promoter._after_fork()


def _finish_pending_promotions() -> None:
    for promoter in list(_PROMOTERS):
        promoter.finish_at_exit()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_parent_threads)
after_pending_writes(_finish_pending_promotions)


class Promoter:
    """Promotes a fast root's checkpoints to a durable root in the background.

    :meth:`submit` after each commit into ``source``; one background thread then runs
    :func:`promote` (``every``-th indices; submissions while it runs coalesce into one more
    run), and prunes ``target`` to ``keep_last`` indices. Training is never blocked by it.

    With ``detached``, the runs happen in a process of its own, in a new session
    (:mod:`fastckpt.container.detached`, started by the first run and kept until
    :meth:`close`), which this thread hands each run to and waits for: a trainer killed while
    it promotes (SIGKILL, or Ctrl-C of its process group) leaves that process to finish the
    promotion, and exit, so the durable tier gets the checkpoint without waiting for a next
    process (see docs/tiers.md). Each run hands it this promoter's configuration and the
    object-store options registered for both roots.

    A failure does not stop training unless ``strict``: it is logged as a warning, kept in
    :attr:`error` (:attr:`healthy` turns False), given to ``on_error`` and retried by the
    next submission, whose success clears it; :meth:`close` waits for the thread and raises
    :class:`~fastckpt.errors.PromotionError` when the last attempt failed. ``strict=True``
    raises that error from the next :meth:`submit` instead.

    Args:
        source: the fast root (node-local disk, ``/dev/shm``).
        target: the durable root (a shared filesystem, ``s3://``).
        every: promote the indices that are multiples of this.
        keep_last: after each promotion keep the newest N indices of ``target`` (None: all).
        strict: raise a failure at the next :meth:`submit`.
        on_error: called with each failure's :class:`~fastckpt.errors.PromotionError`, on the
            promotion thread (an exception it raises is logged and dropped).
        detached: run each promotion in a process of its own that outlives this one.
    """

    def __init__(
        self,
        source: str | os.PathLike[str],
        target: str | os.PathLike[str],
        *,
        every: int = 1,
        keep_last: int | None = None,
        strict: bool = False,
        on_error: Callable[[PromotionError], object] | None = None,
        detached: bool = False,
    ) -> None:
        """Configure; the thread starts on the first :meth:`submit`."""
        if every < 1:
            raise ValueError(f"promote every must be >= 1, got {every}")
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"durable keep_last must be >= 1 or None, got {keep_last}")
        # Resolved now: promotions run in the background, after the script may have
        # changed directory.
        self.source, self.target = absolute(source), absolute(target)
        _distinct(self.source, self.target)
        self.every, self.keep_last, self.strict = every, keep_last, strict
        self.on_error = on_error
        self.detached = bool(detached)
        #: The process id of the detached promoter while it runs a promotion handed to it
        #: (None: none is running).
        self.detached_pid: int | None = None
        #: Rank 0 of a sharded run on node-local fast tiers (set by the hook when it sees
        #: it): the other ranks upload their own shards (:class:`RankPromoter`), waited for
        #: up to :attr:`wait_s` seconds.
        self.node_local = False
        self.wait_s: float | None = 600.0
        #: The indices promoted so far by this promoter, in order.
        self.promoted: list[int | str] = []
        #: The target's newest committed index after the last successful run (None before).
        self.target_newest: int | None = None
        #: The last attempt's failure (None after a success).
        self.error: PromotionError | None = None
        self._raised: PromotionError | None = None  # the error close() raised (raised once)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._pending = False
        self._running = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self._process: _DetachedProcess | None = None  # started by the first detached run
        #: What the running promotion copies, decided before it starts (see :meth:`spared`;
        #: indices, or checkpoint names for :class:`CheckpointPromoter`); None: no run, or a
        #: run not restricted (:meth:`run_here` called by hand).
        self._in_flight: frozenset[Any] | None = None
        #: Held while a run decides what it copies and while a retention decides and deletes
        #: (see :meth:`retention`): one never decides between the other's two steps.
        self._choosing = threading.Lock()
        #: Set by :meth:`withhold`: promotions stopped for good, this error says why.
        self._withheld: PromotionError | None = None
        self._pid = os.getpid()
        _PROMOTERS.add(self)

    def _after_fork(self) -> None:
        """In the child of ``os.fork()``: the parent's promotion thread does not exist here
        (the parent finishes what it queued); the child's next submission starts its own."""
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._pending = self._running = self._closed = False
        self._thread = None
        self._process = None
        self._in_flight = None
        self._choosing = threading.Lock()
        self._pid = os.getpid()

    @contextlib.contextmanager
    def retention(self) -> Iterator[None]:
        """Hold while a fast tier's retention decides what to spare (:meth:`spared`,
        :meth:`in_flight`) and deletes: a promotion run starting meanwhile decides what it
        copies after the deletions (before, one that started between the two read the
        source first, chose an index the retention then deleted, and lost it: "pruned
        before it was promoted")."""
        with self._choosing:
            yield

    def finish_at_exit(self) -> None:
        """At interpreter exit, when the owner never called :meth:`close`: finish the queued
        or running promotion (its thread is a daemon, which the interpreter would stop
        half-way), saying so on stderr, and name a last attempt that failed. Never raises."""
        if self._pid != os.getpid():
            return
        with self._lock:
            busy = self._pending or self._running
        if busy:
            stderr_line(
                f"the interpreter is exiting with a promotion of {display_path(self.source)} to "
                f"{display_path(self.target)} queued or running (close() was not called): "
                "finishing it; killing the process now leaves it to the next process that "
                "opens the tiers (or fastckpt promote)"
            )
            try:
                if not self._wait_for(_EXIT_NOTICE_S):
                    stderr_line(
                        f"WARNING: the promotion to {display_path(self.target)} is still "
                        f"running after {_EXIT_NOTICE_S:.0f} s (a store that does not answer?); "
                        "still waiting for it: killing the process now leaves it to the next "
                        "process that opens the tiers"
                    )
                    self.wait()
            except BaseException as err:  # Ctrl-C while waiting: say what may be left
                stderr_line(
                    f"WARNING: interrupted ({type(err).__name__}) while finishing the "
                    f"promotion to {display_path(self.target)}; it may NOT be done"
                )
                return
        error = self.error
        if error is not None and error is not self._raised:
            stderr_line(
                f"WARNING: the last promotion to {display_path(self.target)} failed and close() "
                f"was not called to report it: {error}"
            )
        elif busy:
            stderr_line(f"the promotion to {display_path(self.target)} is done")

    def withhold(self, reason: BaseException) -> None:
        """Stop promoting for good, for ``reason`` (the target holds another run's newer
        checkpoints, which this run's promotions and retention would replace and delete):
        no run starts any more, and it is reported as a failed promotion is (a warning,
        ``on_error``, :attr:`healthy` False, raised by :meth:`close`; ``strict``: by the
        next :meth:`submit`). The source's checkpoints are untouched."""
        error = PromotionError(
            f"not promoting {display_path(self.source)} to {display_path(self.target)}: "
            f"{reason}; training goes on, on the fast tier only"
        )
        error.__cause__ = reason
        with self._lock:
            self._withheld = error
        self.error = error
        report_tolerated(_LOG, str(error), error, self.on_error)

    @property
    def healthy(self) -> bool:
        """False while the last promotion attempt failed (see :attr:`error`)."""
        return self.error is None

    @property
    def busy(self) -> bool:
        """Whether a promotion is queued or running."""
        with self._lock:
            return self._pending or self._running

    def awaiting(self, newest: int) -> int | None:
        """The index up to ``newest`` that the next promotion is due to copy and the target
        was not seen holding: the newest multiple of ``every`` (None when the target already
        holds it or a newer one). A fast tier's retention keeps it (see
        :func:`~fastckpt.container.commit.prune_indices`'s ``spare``), so a promotion that lags
        behind the saves, or a durable tier that is down, never loses it."""
        due = newest - newest % self.every
        held = self.target_newest
        return due if held is None or due > held else None

    def spared(self, newest: int) -> tuple[int, ...]:
        """What a fast tier's retention must keep after the save of index ``newest``: the
        index due next (:meth:`awaiting`) and every index the running promotion may be
        copying. Without the latter, a promotion slower than a few saves had its index
        pruned under it at every run and the durable tier fell behind for good."""
        awaiting = self.awaiting(newest)
        spared = set(self.in_flight())
        if awaiting is not None:
            spared.add(awaiting)
        return tuple(sorted(spared))

    def in_flight(self) -> frozenset[Any]:
        """What the running promotion copies (empty when none runs): it copies nothing else,
        so a fast tier's retention sparing these never deletes a checkpoint under it."""
        with self._lock:
            return self._in_flight or frozenset()

    def _target_held(self) -> int | None:
        """The target's newest index as far as known: after a run, what it reported; in a
        new process (a resumed run), read from the target (or every due index the fast tier
        still holds would be spared until the first run ends: seven indices kept for
        keep_last=2 after a resume). Read outside :attr:`_choosing`: a slow store must not
        hold up a retention waiting for it."""
        if self.target_newest is not None:
            return self.target_newest
        try:
            latest = Manifest.load(self.target).latest
        except (OSError, CheckpointFormatError):
            return None  # the run reports an unreadable target
        # The target's newest itself may be copied again (a source index re-saved since
        # replaces its promoted copy, see :func:`promote`): one below it.
        return None if latest is None else latest - 1

    def _due_now(self, held: int | None) -> frozenset[Any]:
        """The indices of the source a promotion run started now copies (at most): the
        multiples of ``every`` newer than ``held``, the target's newest known index; empty
        when the source cannot be read (the run reports that)."""
        try:
            indices = Manifest.load(self.source).entries
        except (OSError, CheckpointFormatError):
            return frozenset()
        return frozenset(i for i in indices if not i % self.every and (held is None or i > held))

    def submit(self) -> None:
        """Ask for a promotion run (after a commit into ``source``); returns at once.

        Raises:
            PromotionError: ``strict`` and the previous attempt failed (not once
                :meth:`close` raised it: a promoter used again tries anew).
        """
        with self._lock:
            if self.strict and self.error is not None and self.error is not self._raised:
                raise self.error
            if self._withheld is not None:
                return
            self._pending = True
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="fastckpt-promote", daemon=True
                )
                self._thread.start()
            self._wake.notify()

    def wait(self) -> None:
        """Wait until no promotion is queued or running."""
        with self._lock:
            while self._pending or self._running:
                self._wake.wait()

    def _wait_for(self, seconds: float) -> bool:
        """:meth:`wait` for up to ``seconds``; whether nothing is queued or running then."""
        deadline = time.monotonic() + seconds
        with self._lock:
            while self._pending or self._running:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._wake.wait(left)
        return True

    def close(self) -> None:
        """Finish the queued promotion, stop the thread (a later :meth:`submit` starts a new
        one: a hook entered again for another run keeps promoting).

        Raises:
            PromotionError: the last attempt failed (the fast tier holds the checkpoints;
                ``fastckpt promote`` retries by hand); raised once, :attr:`healthy` stays
                False until a promotion succeeds.
        """
        self.wait()
        with self._lock:
            self._closed = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            self._thread, self._closed = None, False
        if self._process is not None:
            self._process.close()
            self._process = None
        self._withheld = None  # a promoter used again (a hook entered for another run) decides anew
        if self.error is not None and self.error is not self._raised:
            # Raised once; :attr:`healthy` stays False until a promotion succeeds.
            self._raised = self.error
            raise self.error

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._pending and not self._closed:
                    self._wake.wait()
                if not self._pending:
                    return
                self._pending, self._running = False, True
            try:
                self._promote_once()
            finally:
                with self._lock:
                    self._running = False
                    self._wake.notify_all()

    def _attempt(self) -> None:
        """One promotion run, here or in a detached process (raises what fails, and after
        taking in its outcome, the damaged source checkpoints it passed over)."""
        outcome = self._run_detached() if self.detached else self.run_here()
        self._apply(outcome)
        damaged = outcome.get("damaged") or []
        if damaged:
            raise DamagedSourceError(
                f"{display_path(self.source)} holds checkpoints that do not verify, passed "
                "over (the later ones were promoted): "
                + "; ".join(
                    f"{'index ' if isinstance(what, int) else ''}{what}: {why}"
                    for what, why in damaged
                )
            )

    def _apply(self, outcome: Mapping[str, Any]) -> None:
        """Take in a run's outcome (see :meth:`run_here`)."""
        self.promoted.extend(outcome["promoted"])
        if outcome.get("target_newest") is not None:
            self.target_newest = int(outcome["target_newest"])

    def run_here(self) -> dict[str, Any]:
        """One promotion run in this process: :func:`promote`, then the target's retention.
        Returns what it did as the detached process reports it (JSON): ``promoted`` (the
        indices) and ``target_newest``."""
        report = promote(
            self.source,
            self.target,
            every=self.every,
            newest=False,
            node_local=self.node_local,
            wait_s=self.wait_s,
            within=self._in_flight,
        )
        if self.keep_last is not None and report.promoted:
            # prune_indices never deletes the newest index that verifies, and sweeps the
            # sharded parts of older indices no kept index names (the pruned ones', a
            # vanished promotion's), never a newer index's (ranks may be uploading there).
            prune_indices(self.target, self.keep_last, promoting=True, read_shards=False)
        return {
            "promoted": report.promoted,
            "target_newest": report.newest,
            "damaged": report.damaged,
        }

    def spec(self) -> dict[str, Any]:
        """This promoter's configuration as JSON, from which the detached process makes it
        again (:func:`fastckpt.container.detached.promoter_from_spec`)."""
        return {
            "source": os.fspath(self.source),
            "target": os.fspath(self.target),
            "every": self.every,
            "keep_last": self.keep_last,
            "node_local": self.node_local,
            "wait_s": self.wait_s,
            "within": None if self._in_flight is None else sorted(self._in_flight),
            "storage_options": {
                os.fspath(root): options
                for root in (self.source, self.target)
                if (options := storage_options_of(root)) is not None
            },
        }

    def _run_detached(self) -> dict[str, Any]:
        """:meth:`run_here` in this promoter's detached process (see the class docstring);
        waits for it and returns its outcome.

        Raises:
            RuntimeError: the run failed there (its error), or the process died (restarted
                by the next attempt).
        """
        if self._process is None:
            self._process = _DetachedProcess()
        return self._process.run(self.spec(), self._handed)

    def _handed(self, pid: int | None) -> None:
        self.detached_pid = pid

    def report_failure(self, cause: BaseException) -> PromotionError:
        """Report a failed attempt, as a failed run is reported (a warning, ``on_error``,
        :attr:`healthy` False until a run succeeds, raised by :meth:`close`): the run's own
        failure, or the caller's (the target could not even be read); returns the
        :class:`~fastckpt.errors.PromotionError` reported."""
        then = (
            "strict promotion: raised once the next checkpoint is committed to the fast tier"
            if self.strict
            else "training goes on, the next checkpoint retries"
        )
        error = PromotionError(
            f"promoting {display_path(self.source)} to {display_path(self.target)} failed: "
            f"{cause}; {then} (or run fastckpt promote {display_path(self.source)} "
            f"{display_path(self.target)})"
        )
        error.__cause__ = cause
        self.error = error
        report_tolerated(_LOG, str(error), error, self.on_error)
        return error

    def _check_target_still_there(self) -> None:
        """Refuse a run into a target that held this promoter's checkpoints and now holds no
        committed checkpoint at all: a durable tier unmounted (lazily, under the running
        promoter) or deleted leaves the bare folder beneath, which a promotion would fill
        as if it were durable storage.

        Raises:
            PromotionError: it is so (the run is reported as failed; the next checkpoint
                retries, and succeeds once the tier is back).
        """
        if self.target_newest is None:
            return  # nothing promoted yet, or not tracked (a rank's share)
        try:
            latest = Manifest.load(self.target).latest
        except (OSError, CheckpointFormatError):
            return  # the run reports an unreadable target
        if latest is None:
            raise PromotionError(
                f"{display_path(self.target)} held index {self.target_newest} after this "
                "process's last promotion and holds no committed checkpoint now: the durable "
                "tier was unmounted, replaced or deleted; not promoting into what is there "
                "instead (mount it again: the next checkpoint retries; or start a new run to "
                "promote into an empty tier)"
            )

    def _promote_once(self) -> None:
        try:
            self._check_target_still_there()
            held = self._target_held()
            with self._choosing:  # not between a retention's decision and its deletions
                due = self._due_now(held)
                with self._lock:
                    self._in_flight = due  # spared by the fast tier's retention until the end
            self._attempt()
        except Exception as err:  # reported, retried by the next submission
            self.report_failure(err)
            return
        finally:
            with self._lock:
                self._in_flight = None
        self.error = self._withheld  # None unless promotions were stopped meanwhile


class RankPromoter(Promoter):
    """A rank's share of promoting a sharded run whose fast tier is node-local (rank ``rank``
    > 0): each run uploads this rank's files of the due parts of its node's fast root
    (:func:`~fastckpt.container.sharded.promote.upload_rank_files`); rank 0's
    :class:`Promoter` commits them. Reports, retries and :meth:`close` as :class:`Promoter`.
    """

    def __init__(
        self,
        source: str | os.PathLike[str],
        target: str | os.PathLike[str],
        rank: int,
        *,
        every: int = 1,
        strict: bool = False,
        on_error: Callable[[PromotionError], object] | None = None,
        detached: bool = False,
    ) -> None:
        """Configure; the thread starts on the first :meth:`submit`."""
        super().__init__(
            source, target, every=every, strict=strict, on_error=on_error, detached=detached
        )
        self.rank = rank
        #: This rank's files known to be in the target (not uploaded again).
        self.uploaded: set[str] = set()

    def awaiting(self, newest: int) -> int | None:
        """Not tracked here: rank 0's retention decides what every node keeps."""
        return None

    def _target_held(self) -> int | None:
        return None  # not needed: see :meth:`_due_now`

    def _due_now(self, held: int | None) -> frozenset[Any]:
        return frozenset()  # as :meth:`awaiting`

    def run_here(self) -> dict[str, Any]:
        """Upload this rank's files of the newest due part; returns ``promoted`` (the
        indices) and ``uploaded`` (every file known to be in the target)."""
        done = upload_rank_files(self.source, self.target, self.every, self.rank, self.uploaded)
        return {"promoted": done, "uploaded": sorted(self.uploaded)}

    def spec(self) -> dict[str, Any]:
        """:meth:`Promoter.spec` with this rank and the files it knows are uploaded."""
        return {**super().spec(), "rank": self.rank, "uploaded": sorted(self.uploaded)}

    def _apply(self, outcome: Mapping[str, Any]) -> None:
        super()._apply(outcome)
        self.uploaded.update(outcome.get("uploaded") or ())


@dataclass
class NearestCopy:
    """Where :func:`nearest_intact` found the checkpoint to restore.

    Attributes:
        root: the tier (root) that holds it.
        index: its index (the same number on every tier: promotion keeps it).
        skipped: ``"<root> index <i>: <why>"`` for every newer copy that did not verify, and
            ``"<root>: <why>"`` for a tier that could not be read at all.
    """

    root: Path
    index: int
    skipped: list[str] = field(default_factory=list)
    #: the copy is spread over the nodes' node-local fast tiers: ``root`` (rank 0's node)
    #: lacks shards that other ranks' nodes hold (:mod:`fastckpt.container.sharded.nodes`)
    node_local: bool = False
    #: ``(display_path(root), index)`` of every newer copy that did not verify (the indices
    #: of :attr:`skipped`)
    passed_over: list[tuple[str, int]] = field(default_factory=list)

    def passed(self, root: str | os.PathLike[str], index: int) -> bool:
        """Whether this restore passed over index ``index`` of ``root`` (it did not verify);
        ``root`` spelled any way (relative, absolute, a trailing slash)."""
        key = root_key(root)
        return any(root_key(r) == key and i == index for r, i in self.passed_over)

    def describe(self) -> str:
        """One line: which copy, and what was passed over."""
        text = f"restoring index {self.index} from {display_path(self.root)}"
        if self.node_local:
            text += " with the other nodes' copies of it (node-local tiers)"
        return text + (f" (skipped: {'; '.join(self.skipped)})" if self.skipped else "")


def _other_nodes(
    elsewhere: Sequence[NodeHoldings],
    position: int,
    index: int,
    answers: list[bool],
    asked: list[PartKey] | None,
) -> Callable[[Part, dict[str, int]], bool]:
    """``part_problem``'s ``elsewhere`` for index ``index`` of tier ``position``: whether
    other nodes hold the files missing here (each answer is appended to ``answers``, and the
    part's key to ``asked``)."""

    def held(part: Part, missing: dict[str, int]) -> bool:
        if part.name is None or part.record_crc32c is None:
            return False
        if asked is not None:
            asked.append((position, index, part.name))
        found = held_by_others(elsewhere, position, index, part.name, part.record_crc32c, missing)
        answers.append(found)
        return found

    return held


def still_committed(root: str | os.PathLike[str], index: int) -> bool:
    """Whether ``index`` is still committed in ``root``: False once a live writer pruned it
    (while it was checked, or after it was chosen and before it was read); True when the
    manifest cannot be read (the error at hand is then real)."""
    try:
        return index in Manifest.load(root).entries
    except (OSError, FastCkptError):
        return True


def nearest_intact(
    tiers: Sequence[str | os.PathLike[str]],
    index: int | None = None,
    *,
    elsewhere: Sequence[NodeHoldings] = (),
    asked: list[PartKey] | None = None,
    _rescans: int = 3,
) -> NearestCopy:
    """The copy to restore from ``tiers`` (fastest first: the fast root, then the durable
    ones): the newest index that verifies on any tier (every file against its manifest
    record, referenced tensors included; a sharded index's part record against the index and
    every rank's file present with its size, the chunks being verified as they load), taken
    from the first tier that holds it intact; with ``index``, that index from the first tier
    holding it intact. A tier that is gone (a new node) or unreadable is passed over, and so
    is a node-local fast tier, which holds only its own node's shards, unless ``elsewhere``
    (what the other ranks' nodes hold of the same tiers,
    :func:`~fastckpt.container.sharded.nodes.node_holdings`) shows that the nodes together
    hold every file of the part (the copy is then ``node_local``). ``asked`` collects the
    keys of the parts newer than the copy found whose files were missing here: what to ask
    the other nodes about (:func:`~fastckpt.container.sharded.nodes.node_holdings`).

    Raises:
        NotCommittedError: no tier holds an intact copy (of ``index``); the message lists
            what was passed over and why.
    """
    skipped: list[str] = []
    passed_over: list[tuple[str, int]] = []
    best: tuple[int, Path] | None = None
    spread = False
    for position, tier in enumerate(Path(t) for t in tiers):
        try:
            manifest = Manifest.load(tier, verify_checksum=True)
        except (OSError, FastCkptError) as err:
            skipped.append(f"{display_path(tier)}: {err}")
            continue
        if manifest.latest is None:
            if best is None:
                # Said, as what was passed over: a fast tier gone (a new node) is why the
                # copy comes from a slower one.
                skipped.append(f"{display_path(tier)}: no committed index (gone, or never written)")
            continue
        wanted = sorted(manifest.entries, reverse=True) if index is None else [index]
        for candidate in wanted:
            if candidate not in manifest.entries:
                continue
            if best is not None and candidate <= best[0]:
                break  # an earlier (faster) tier already holds this one or a newer one
            others: list[bool] = []
            held = _other_nodes(elsewhere, position, candidate, others, asked)
            problem = index_intact(manifest, candidate) or part_problem(manifest, candidate, held)
            if problem is None:
                best, spread = (candidate, tier), any(others)
                break
            if not still_committed(tier, candidate):
                # A live writer's prune, not damage: nothing to report. The newest asked
                # for: look again, the writer may have committed a newer index meanwhile.
                if index is None and _rescans > 0:
                    if asked is not None:
                        asked.clear()  # what this look found: the next one says again
                    return nearest_intact(
                        tiers, index, elsewhere=elsewhere, asked=asked, _rescans=_rescans - 1
                    )
                continue
            skipped.append(f"{display_path(tier)} index {candidate}: {problem}")
            passed_over.append((display_path(tier), candidate))
    if best is None:
        what = "checkpoint" if index is None else f"copy of index {index}"
        names = ", ".join(display_path(Path(t)) for t in tiers)
        raise NotCommittedError(
            f"no intact {what} in {names}"
            + (f" (skipped: {'; '.join(skipped)})" if skipped else "")
        )
    return NearestCopy(best[1], best[0], skipped, spread, passed_over)
