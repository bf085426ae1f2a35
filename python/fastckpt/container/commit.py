"""The commit protocol of every container, and the two writers built on it.

Every save, whatever its front door, commits the same way:

1. its data goes under names no other save uses: a temporary sibling directory renamed into
   place (a local index or CheckpointManager checkpoint), a fresh index prefix
   (save_checkpoint roots on an object store), or a *generation* (a CheckpointManager
   checkpoint on an object store and every sharded checkpoint; see
   :data:`~fastckpt.format.records.GENERATION_PREFIX`);
2. every byte of it is durable (fsynced files and directories; completed uploads) and its
   size and crc32c are recorded;
3. one commit record is written last, atomically, by the backend's
   :meth:`~fastckpt.storage.backend.StorageBackend.put_record` (temp -> fsync -> rename ->
   fsync of the directory locally; a put conditional on the version read before, on an
   object store): ``manifest.json`` of a root, ``commit.json`` of a CheckpointManager
   checkpoint, ``fastckpt-dcp.json`` of a sharded one;
4. only then is what the record no longer names removed.

A crash at any step leaves the previous record, and every file it names, untouched; what the
interrupted save wrote is never read and is removed by the next save.
:func:`commit_generation` is step 3-4 for generations (both writers of generations call it).

```
ROOT/manifest.json     the commit record (see fastckpt.format.records)
ROOT/<index>/          one self-contained directory per committed index
ROOT/.tmp-<...>/       an index being written (removed by the next save if a crash left it)
ROOT/.fastckpt.lock    held (flock) by the one process saving into ROOT; gone when none is
CKPT/g-<ms>-<hex>/     a generation (object stores, sharded checkpoints)
```

Writers of one root are serialized by the backend's lock (:class:`RootLock` locally), which
the kernel drops when its holder dies, so a killed writer never leaves a stale lock.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import stat
import threading
import warnings
import weakref
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastckpt import _native
from fastckpt.container import refs
from fastckpt.container.links import LINKED_DIR
from fastckpt.container.listing import is_alias
from fastckpt.container.reader import check_recorded, verify_content
from fastckpt.container.sharded.parts import part_damage
from fastckpt.errors import (
    CheckpointFormatError,
    CommitNotDurableError,
    FastCkptError,
    NotACheckpointError,
)
from fastckpt.format.records import (
    COMMIT_RECORD,
    COMPONENT_SUFFIXES,
    GENERATION_PREFIX,
    MANIFEST,
    MAX_INDEX,
    REPLACED_MANIFEST,
    SHARDED_DIR,
    SHARDED_RECORD,
    Manifest,
    generation_order,
    json_bytes,
    new_generation,
    read_commit_record,
    read_record_bytes,
    seal_manifest,
)
from fastckpt.io.forksafe import ForkSafeLock
from fastckpt.io.paths import is_ascii_decimal
from fastckpt.storage.access import NO_ROOM, access_note, free_space_advice
from fastckpt.storage.backend import (
    ATOMIC_TEMP_INFIX,
    TEMP_PREFIX,
    TRASH_PREFIX,
    CopySource,
    LocalFileSystem,
    LocalStaging,
    StorageBackend,
    make_dirs,
    stored_sizes,
)
from fastckpt.storage.backend import _sibling as temp_sibling
from fastckpt.storage.lock import LOCK_FILE, REPLACING, RootLock, checked_lock_timeout
from fastckpt.storage.registry import backend_for, display_path, is_local
from fastckpt.storage.s3.errors import CommitOutcomeUnknownError

if TYPE_CHECKING:
    import torch

__all__ = [
    "DirectoryWriter",
    "IndexWriter",
    "RootLock",
    "clean_leftovers",
    "commit_generation",
    "committed_generation",
    "committed_here",
    "generation_dirs",
    "index_intact",
    "make_generation_dir",
    "prune_indices",
    "prune_plan",
    "refuse_inside_checkpoint",
    "remove_superseded",
    "shown_names",
    "spare_newest_intact",
]

_LOG = logging.getLogger(__name__)

_COMMITTED_LOCK = ForkSafeLock()  # free in a forked child: every local commit takes it
#: The indices this process committed, per root (:func:`refs.root_key`).
_COMMITTED: dict[str, set[int]] = {}


def committed_here(root: str | os.PathLike[str]) -> frozenset[int]:
    """The indices of ``root`` this process committed (by any front door, in any thread):
    an index of the root outside them was saved by another process, e.g. another run
    saving into the same root (see ``CheckpointHook``'s check at each commit)."""
    with _COMMITTED_LOCK:
        return frozenset(_COMMITTED.get(refs.root_key(root), ()))


def _committed(root: Path, index: int, kept: Iterable[int]) -> None:
    """Record ``index`` as committed by this process; only the indices the root still has
    (``kept``: its manifest's) stay recorded beside it (before, one entry per save stayed for
    good, pruned or not: a process-wide set growing with every save of a long run)."""
    with _COMMITTED_LOCK:
        held = _COMMITTED.setdefault(refs.root_key(root), set())
        held.intersection_update(kept)
        held.add(index)


#: Per object-store root: the indices whose manifest put had an unknown outcome in this
#: process (CommitOutcomeUnknownError) and that no later commit of the root has settled. Such
#: a put may still land (a proxy delivering it late): its condition holds until the manifest
#: changes, and it names that index's objects as that save wrote them. The next save must not
#: reuse the number (it would delete and rewrite those objects, and the late put then named
#: another save's bytes: a committed index that never verifies).
_IN_DOUBT: dict[str, set[int]] = {}


def _next_free_index(root: Path, latest: int | None) -> int:
    """The next index of ``root``: after ``latest``, past the in-doubt ones."""
    index = 0 if latest is None else latest + 1
    with _COMMITTED_LOCK:
        doubtful = _IN_DOUBT.get(refs.root_key(root), set())
        while index in doubtful:
            index += 1
    return index


def _is_in_doubt(root: Path, index: int) -> bool:
    with _COMMITTED_LOCK:
        return index in _IN_DOUBT.get(refs.root_key(root), set())


def _settle_in_doubt(root: Path, index: int | None) -> None:
    """Record ``index`` as in doubt (None: a commit of ``root`` succeeded, so no earlier put
    can land any more: its condition no longer holds)."""
    with _COMMITTED_LOCK:
        if index is None:
            _IN_DOUBT.pop(refs.root_key(root), None)
        else:
            _IN_DOUBT.setdefault(refs.root_key(root), set()).add(index)


#: Threads writing an index's JSON documents next to its tensor files.
_JSON_THREADS = 4


#: One lock per checkpoint directory: serializes the commits of its generations in this
#: process (see :func:`commit_generation`). Commits of different checkpoints run in parallel.
#: Reentrant, so that code running inside a commit on the same thread (a callback, a test
#: standing in for a second writer) meets the store's conditional put instead of a deadlock.
#: Weakly held: a lock lives while a commit holds it (before, one lock per checkpoint
#: directory ever committed stayed for the process's life).
_COMMIT_LOCKS: weakref.WeakValueDictionary[str, threading.RLock] = weakref.WeakValueDictionary()
_COMMIT_LOCKS_GUARD = ForkSafeLock()

if hasattr(os, "register_at_fork"):
    # A commit a parent thread was running at the fork holds its lock in the child for good
    # (the thread does not exist there): the child's commits take fresh locks.
    os.register_at_fork(after_in_child=_COMMIT_LOCKS.clear)


def _commit_lock(directory: Path) -> threading.RLock:
    """The lock that serializes this process's commits to ``directory``."""
    key = str(directory)
    with _COMMIT_LOCKS_GUARD:
        lock = _COMMIT_LOCKS.get(key)
        if lock is None:
            lock = threading.RLock()
            _COMMIT_LOCKS[key] = lock
        return lock


def generation_dirs(directory: Path) -> list[Path]:
    """The generations present under ``directory`` (directories, or prefixes on an object
    store), oldest first."""
    backend = backend_for(directory)
    if is_local(backend):
        try:
            names = [entry.name for entry in directory.iterdir() if entry.is_dir()]
        except (FileNotFoundError, NotADirectoryError):
            return []
    else:
        names = backend.list_dir(directory)
    ordered = sorted((key, name) for name in names if (key := generation_order(name)))
    return [directory / name for _, name in ordered]


def make_generation_dir(directory: Path, generation: str) -> Path:
    """Create ``directory/generation`` (and ``directory``) durably and return it (on an
    object store, where prefixes need no creation, only return it)."""
    target = directory / generation
    if is_local(backend_for(directory)):
        make_dirs(target)
        _native.fsync_dir(str(directory))
    return target


def committed_generation(
    directory: Path, record_name: str, backend: StorageBackend | None = None
) -> str | None:
    """The generation the commit record ``record_name`` of ``directory`` names, if any
    (on an object store, reading it through ``backend`` also makes that backend's next put
    of the record conditional on this version)."""
    backend = backend or backend_for(directory)
    try:
        if is_local(backend):
            raw = read_record_bytes(directory, record_name)
        else:
            raw = backend.read_bytes(directory / record_name)
        document = json.loads(raw)
    except (OSError, ValueError):  # CheckpointFormatError (a FIFO, a link...) is a ValueError
        return None
    generation = document.get("generation") if isinstance(document, dict) else None
    return generation if isinstance(generation, str) else None


def record_names_generation(
    directory: Path, record_name: str, generation: str, backend: StorageBackend | None = None
) -> bool | None:
    """Whether the commit record ``record_name`` of ``directory`` names ``generation``: False
    when it names another or there is none, None when it cannot be read (unlike
    :func:`committed_generation`, which takes that for none: a caller deciding whether to
    delete must tell the two apart)."""
    path = directory / record_name
    try:
        document = json.loads((backend or backend_for(path)).read_bytes(path))
    except FileNotFoundError:
        return False
    except (OSError, ValueError, FastCkptError):
        return None
    return isinstance(document, dict) and document.get("generation") == generation


def commit_generation(
    directory: Path,
    record_name: str,
    data: bytes,
    generation: str,
    *,
    check: Callable[[], None] | None = None,
    sweep_all: bool = False,
    reread: bool = True,
    backend: StorageBackend | None = None,
) -> list[Path]:
    """Commit ``generation`` of ``directory``: write the record ``data`` last, then remove
    what it superseded (steps 3 and 4 of the protocol, see the module docstring).

    Commits to one directory are serialized (in this process by a lock, between processes on
    a filesystem by the directory's lock file, on an object store by the conditional put),
    and one never replaces a record that already names a newer generation (overlapping saves
    to one checkpoint: the newest wins, the older one fails with nothing committed).
    ``check`` runs just before the record is written (for example: the generation's files
    are all there). Then the generations created before ``generation`` are removed (killed
    saves' ones included); with ``sweep_all`` (a writer holding the checkpoint's lock)
    everything else under ``directory`` too. Returns what was removed.

    The record is read again just before the put (``reread``), so that on an object store
    the put is conditional on that version; a writer that read it when it started passes
    ``reread=False`` to keep its put conditional on the version it started from (a commit
    by anyone else meanwhile then fails the put with a typed conflict error). Such a writer
    passes its ``backend`` too: the version it read is known to that instance only.

    Raises:
        RuntimeError: a newer generation is already committed; nothing was committed.
    """
    backend = backend or backend_for(directory)
    # Other processes too (a filesystem has no conditional put): the directory's lock file
    # while the record is read, checked and written; a writer holding the checkpoint's lock
    # already (sweep_all) or committing what it read at its start (no reread) does not.
    between_processes: contextlib.AbstractContextManager[Any] = (
        RootLock(directory)
        if reread and not sweep_all and is_local(backend)
        else contextlib.nullcontext()
    )
    with _commit_lock(directory), between_processes:
        current = committed_generation(directory, record_name, backend) if reread else None
        if current is not None and _newer(current, generation):
            raise RuntimeError(
                f"{display_path(directory)}: a newer save ({current}) committed while this one "
                f"({generation}) was running; nothing was committed"
            )
        if check is not None:
            check()
        try:
            backend.put_record(directory / record_name, data)
        except BaseException as err:
            # Locally the record is renamed into place, then its folder fsynced: a failure
            # of that fsync left the commit applied.
            if _fails_after_commit(err, backend) and _holds(directory / record_name, data):
                assert isinstance(err, OSError)
                raise CommitNotDurableError.after(err, display_path(directory)) from err
            raise
        try:
            return remove_superseded(
                directory, generation, record_name, sweep_all=sweep_all, backend=backend
            )
        except Exception as err:  # committed: what it superseded is the next save's to remove
            _LOG.warning(
                "%s: committed %s, but removing what it replaced failed (%s); the next save "
                "there removes it",
                display_path(directory),
                generation,
                err,
            )
            return []


def _fails_after_commit(error: BaseException, backend: StorageBackend) -> bool:
    """Whether ``error``, raised by a local commit that took effect, is a plain OS failure
    (the ``fsync`` after the rename) to report as :class:`CommitNotDurableError`."""
    return isinstance(error, OSError) and not isinstance(error, FastCkptError) and is_local(backend)


def _holds(path: Path, data: bytes) -> bool:
    """Whether the local file ``path`` holds exactly ``data`` (False when it cannot be read)."""
    try:
        return path.read_bytes() == data
    except OSError:
        return False


def _cause_of(error: CommitNotDurableError) -> BaseException:
    """The failure a :class:`CommitNotDurableError` was raised for (itself when it has none)."""
    return error.__cause__ if error.__cause__ is not None else error


def _newer(current: str, generation: str) -> bool:
    mine = generation_order(generation)
    theirs = generation_order(current)
    return mine is not None and theirs is not None and theirs > mine


def remove_superseded(
    directory: Path,
    keep: str,
    record_name: str,
    *,
    sweep_all: bool = False,
    backend: StorageBackend | None = None,
) -> list[Path]:
    """After ``keep`` was committed: remove the generations of ``directory`` created before
    it (earlier commits and interrupted saves; on an object store with their unfinished
    uploads). Newer ones (a save still under way) are left alone, unless ``sweep_all``,
    which removes everything but the record and ``keep``. Returns what was removed."""
    backend = backend or backend_for(directory)
    local = is_local(backend)
    kept = generation_order(keep)
    if sweep_all:
        names = (
            [entry.name for entry in directory.iterdir()] if local else backend.list_dir(directory)
        )
        doomed = [directory / name for name in names if name not in (record_name, keep)]
    else:
        doomed = [
            path
            for path in generation_dirs(directory)
            if kept is None or (generation_order(path.name) or kept) < kept
        ]
    for path in doomed:
        if not local:
            backend.delete(path)
        elif path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
    if doomed and local:
        _native.fsync_dir(str(directory))
    return doomed


def refuse_to_replace(path: Path, *, files: bool = False) -> None:
    """A save replaces a checkpoint at ``path`` atomically, and nothing else: a file, a folder
    of the user's data or a folder of checkpoints there (``runs/mgr`` for
    ``runs/mgr/step_30``) was deleted by the swap, committed checkpoints included. Empty
    folders and what killed saves leave (generations, hidden temporary names) are replaced.

    Args:
        path: where the save goes.
        files: a regular file there may be replaced too (Lightning's plugins replace a
            ``torch.save`` file of the same name, as its own ``TorchCheckpointIO`` does).

    Raises:
        NotACheckpointError: names what is there and the fix (a symbolic link to a folder
            elsewhere: a save would replace the link, not write where it points).
        FileNotFoundError: ``path`` is a symlink to nothing (a disk not mounted); names the
            link and its target.
    """
    backend = backend_for(path)
    if is_local(backend):
        if not os.path.lexists(path):
            return
        if os.path.islink(path) and is_alias(path):
            return  # an alias beside its checkpoint (even one gone): the swap replaces the link
        if os.path.islink(path) and not os.path.exists(path):
            make_dirs(path)  # raises, naming the link and its missing target; creates nothing
        if os.path.islink(path):
            # The save would swap a folder in place of the link, on the link's disk, and the
            # checkpoint would no longer go where the link points. (An alias beside its
            # checkpoint, Lightning's ``last.ckpt -> epoch=...``, is replaced as before.)
            raise NotACheckpointError(
                f"{display_path(path)} is a symbolic link to {os.readlink(path)}: a save "
                "replaces the checkpoint folder itself, which would put it on the link's disk "
                "instead of the target's; save to the target's path, or link the folder that "
                "holds the checkpoints instead"
            )
        if not os.path.isdir(path):
            if files and os.path.isfile(path) and not os.path.islink(path):
                return
            raise NotACheckpointError(
                f"{display_path(path)} is a file, not a checkpoint; a save replaces only a "
                "checkpoint: save under another name, or move the file first"
            )
        names = os.listdir(path)
    else:
        names = backend.list_dir(path)
    strays = stray_names(path, names)
    own = _checkpoint_names(path, names)
    shown = shown_names(strays)
    if strays and own:
        raise NotACheckpointError(
            f"{display_path(path)} is a checkpoint that also holds {shown}, which its record "
            "does not name; a save replaces the whole folder and would delete them: move them "
            "out first, or save under another name"
        )
    if strays:
        raise NotACheckpointError(
            f"{display_path(path)} holds {shown} and is not a checkpoint (no {COMMIT_RECORD}); "
            "a save replaces only a checkpoint, and would delete these: save under another "
            "name (a folder of checkpoints takes e.g. step_100 inside it)"
        )


def stray_names(path: Path, names: Collection[str]) -> list[str]:
    """The entries among ``names`` of the checkpoint folder ``path`` that are not its own:
    neither its record, nor a top-level name of the files the record lists, nor hidden, nor
    a generation (what a user or another tool put there; everything when ``path`` is no
    checkpoint)."""
    own = _checkpoint_names(path, names)
    return sorted(
        n for n in names if n not in own and not n.startswith(".") and generation_order(n) is None
    )


def shown_names(names: Sequence[str]) -> str:
    """The first three of ``names`` for a message (``a, b, c, ...``)."""
    return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")


def refuse_inside_checkpoint(path: Path, *, roots: bool = True) -> None:
    """A checkpoint is never saved inside another one (``runs/step_1`` where ``runs`` itself
    became a checkpoint by a forgotten ``/step_N``, or inside a save_checkpoint root's index):
    the outer checkpoint's next save or prune would delete it, and listings no longer see it.
    Local paths: every folder above ``path`` is looked at, symlinks resolved (an object
    store's would cost a request each). ``roots`` False: a path inside a root but not inside
    one of its index folders (``ROOT/fast``, a tier kept beside the indices) is accepted.

    Raises:
        NotACheckpointError: names the enclosing checkpoint, its record and the fix.
    """
    if not is_local(backend_for(path)):
        return
    real = Path(os.path.realpath(path))
    for directory in real.parents:
        for record in (COMMIT_RECORD, SHARDED_RECORD, MANIFEST):
            inside = real.relative_to(directory).parts[0]
            if record == MANIFEST and not roots and not _is_index_name(inside):
                continue  # beside a root's indices: no prune of that root deletes it
            if os.path.lexists(directory / record) and _is_record(directory, record):
                shown = display_path(path)
                if str(real) != os.path.abspath(path):
                    shown += f" (that is {real})"
                raise NotACheckpointError(
                    f"{shown} is inside the checkpoint {display_path(directory)} "
                    f"(it holds {record}), whose next save or prune would delete it: save it "
                    "beside that checkpoint, not inside it"
                )


#: ``(path, device, inode, mtime, size) -> whether it is a record`` for :func:`_is_record`:
#: a large file above a run folder (a data set's manifest) is parsed once, not at every save.
_RECORD_ANSWERS: dict[tuple[str, int, int, int, int], bool] = {}


def _is_record(directory: Path, record: str) -> bool:
    """Whether ``directory/record`` reads as fastckpt's record of that name (a project's own
    ``manifest.json`` or a repository's ``commit.json`` above a save path is not one); the
    answer is kept for the file as it is (its inode, mtime and size)."""
    try:
        info = os.stat(directory / record)
    except OSError:
        return False
    key = (str(directory / record), info.st_dev, info.st_ino, info.st_mtime_ns, info.st_size)
    known = _RECORD_ANSWERS.get(key)
    if known is None:
        known = _RECORD_ANSWERS[key] = _reads_as_record(directory, record)
    return known


def _reads_as_record(directory: Path, record: str) -> bool:
    try:
        if record == COMMIT_RECORD:
            read_commit_record(directory)
        elif record == MANIFEST:
            Manifest.load(directory)
        else:
            read_record_bytes(directory, record)  # a name only fastckpt's sharded saves use
    except (OSError, ValueError, FastCkptError):
        return False
    return True


def _checkpoint_names(path: Path, names: Collection[str]) -> set[str]:
    """The entries of folder ``path`` (holding ``names``) that belong to the checkpoint there:
    its commit record and the top-level names of the files the record lists (a sharded
    checkpoint's files are all under generations; a folder may hold both kinds, a sharded
    save's over an unsharded one). Empty when ``path`` is not a checkpoint.
    A record that cannot be read leaves the names a checkpoint writes to be replaced with it:
    tensor files, the JSON document beside each, ``linked/``; so does a sharded record
    without a ``commit.json`` (what a sharded save left of the unsharded checkpoint it
    replaced when it was killed removing it)."""
    own = {SHARDED_RECORD} & set(names)
    if COMMIT_RECORD not in names:
        return own | _unsharded_files(path, names) if own else own
    own.add(COMMIT_RECORD)
    try:
        record = read_commit_record(path)
        listed = [str(relpath) for relpath in record["files"]]
    except (OSError, FastCkptError, KeyError, TypeError, AttributeError):
        return own | _unsharded_files(path, names)
    return own | {relpath.split("/", 1)[0] for relpath in listed}


def _unsharded_files(path: Path, names: Collection[str]) -> set[str]:
    """The names among ``names`` (in folder ``path``) an unsharded manager checkpoint writes:
    tensor files, the JSON document beside each, an item's document of plain values (a JSON
    object holding its ``skeleton`` alone), ``linked/``."""
    tensors = {n for n in names if n.endswith(".safetensors")}
    stems = {n.removesuffix(".safetensors").split(".rank", 1)[0] for n in tensors}
    documents = {
        n
        for n in names
        if n.endswith(".json")
        and (n.removesuffix(".json").split(".rank", 1)[0] in stems or _item_document(path / n))
    }
    return tensors | documents | ({LINKED_DIR} & set(names))


def _item_document(path: Path) -> bool:
    """Whether ``path`` is a manager item's JSON document (``{"skeleton": ...}`` alone)."""
    try:
        document = json.loads(backend_for(path).read_bytes(path, limit=_ITEM_DOCUMENT_LIMIT))
    except (OSError, ValueError, FastCkptError):
        return False
    return isinstance(document, dict) and set(document) == {"skeleton"}


#: The largest item document :func:`_item_document` reads (a plain-values skeleton is small).
_ITEM_DOCUMENT_LIMIT = 16 << 20


def _refuse_manager_checkpoints(root: Path, backend: StorageBackend) -> None:
    """A save_checkpoint root and CheckpointManager (or sharded) checkpoints never share a
    folder: a root written into a checkpoint was deleted by that checkpoint's next save, and
    ``verify`` of the folder checked the root only. Locally, a checkpoint directly inside the
    root is refused too.

    Raises:
        NotACheckpointError: names the checkpoint found and the fix.
    """
    local = is_local(backend)
    names = os.listdir(root) if local else backend.list_dir(root)
    found = [name for name in (COMMIT_RECORD, SHARDED_RECORD) if name in names]
    if found:
        raise NotACheckpointError(
            f"{display_path(root)} is a CheckpointManager or sharded checkpoint ({found[0]}), "
            "not a save_checkpoint root; the two never share a folder: save the root elsewhere"
        )
    if not local:
        return
    for name in sorted(names):
        if name.startswith(".") or is_ascii_decimal(name) or name == SHARDED_DIR:
            continue
        child = root / name
        record = next(
            (r for r in (COMMIT_RECORD, SHARDED_RECORD) if os.path.lexists(child / r)), None
        )
        if record is not None:
            raise NotACheckpointError(
                f"{display_path(root)} holds the checkpoint {name} ({record}); a "
                "save_checkpoint root and CheckpointManager checkpoints never share a folder "
                "(the root's retention and theirs would delete each other's files): save the "
                "root elsewhere"
            )


class DirectoryWriter:
    """Writes the files of one directory so that they appear together at :meth:`commit`.

    Use :meth:`add_tensors` / :meth:`add_json` for each file, then :meth:`commit`, or
    :meth:`abort`. The backend decides how (locally: a temporary sibling directory swapped
    into place, see :class:`~fastckpt.storage.backend.LocalStaging`).

    On an object store (no rename) a CheckpointManager checkpoint is written as a
    *generation*: the data objects go under ``final/g-<random>/``, a prefix no other save
    uses, and the ``commit.json`` given to :meth:`add_json` is held back and written last by
    the backend's conditional :meth:`~fastckpt.storage.backend.StorageBackend.put_record` at
    :meth:`commit`, naming the generation's files (``g-<random>/<relpath>``). Only then are
    the replaced generation and what killed saves left under ``final`` deleted. A crash
    before that put leaves the previous record, and the files it names, untouched.

    Attributes:
        final: the directory.
        files: relpath -> ``{"size", "crc32c"}`` of every file written so far.
        generation: the generation prefix (object stores; None locally).
    """

    def __init__(
        self,
        final: Path,
        *,
        direct_io: bool | None = None,
        threads: int | None = None,
        generations: bool = True,
    ) -> None:
        """Start staging ``final`` (with the Rust writer's options, default: its own);
        ``generations`` False: on an object store, delete what is at ``final`` and write in
        place instead (for an index whose manifest entry was already withdrawn)."""
        self.final = Path(final)
        self.backend = backend_for(self.final)
        self.generation: str | None = None
        self._record: bytes | None = None
        # A commit whose outcome is unknown (CommitOutcomeUnknownError): the record may name
        # what was written, so abort() keeps it.
        self._keep = False
        stage_at = self.final
        if not is_local(self.backend):
            if generations:
                _remember_record_version(self.backend, self.final)
                self.generation = new_generation()
                stage_at = self.final / self.generation
            else:
                # Also aborts unfinished multipart uploads a killed attempt left.
                self.backend.delete(self.final)
        self.staging = self.backend.stage(stage_at, direct_io=direct_io, threads=threads)

    def _prefixed(self, relpath: str) -> str:
        return relpath if self.generation is None else f"{self.generation}/{relpath}"

    def stored_relpath(self, relpath: str) -> str:
        """Where file ``relpath`` is under :attr:`final` (and in :attr:`files`): the same
        relpath, under the generation prefix on an object store."""
        return self._prefixed(relpath)

    @property
    def files(self) -> dict[str, dict[str, int]]:
        """relpath -> ``{"size", "crc32c"}`` of every file written so far."""
        if self.generation is None:
            return self.staging.files
        return {self._prefixed(relpath): record for relpath, record in self.staging.files.items()}

    @property
    def location(self) -> str:
        """Where the files are staged (another rank's writer can :meth:`adopt` from it)."""
        return self.staging.location

    def add_tensors(
        self,
        relpath: str,
        tensors: Mapping[str, torch.Tensor],
        copies: Mapping[str, CopySource] | None = None,
    ) -> None:
        """Write a safetensors file (durably) and record its size and crc32c; tensors in
        ``copies`` are copied by an object store (see :meth:`Staging.put_tensors`)."""
        self.staging.put_tensors(relpath, tensors, copies)

    def add_json(self, relpath: str, document: Any) -> None:
        """Write a JSON file (durably) and record its size and crc32c (a generation's
        ``commit.json`` is held back for :meth:`commit`, see the class docstring)."""
        if relpath == COMMIT_RECORD:
            document = dict(document)
            if self.generation is not None:
                document["generation"] = self.generation
            seal_manifest(document)  # the record's own crc32c, over every field
            if self.generation is not None:
                self._record = json_bytes(document)
                return
        self.staging.put_bytes(relpath, json_bytes(document))

    def adopt(self, location: str, files: Mapping[str, dict[str, int]]) -> None:
        """Take over files another writer staged at ``location``, with their records."""
        for relpath, record in files.items():
            if self.generation is not None and relpath.startswith(GENERATION_PREFIX):
                relpath = relpath.split("/", 1)[1]  # the other writer's generation prefix
            self.staging.adopt(location, relpath, record)

    def commit(self) -> None:
        """Make the directory visible, replacing what was there."""
        self.staging.publish()
        if not is_local(self.backend):
            stored_at = self.final if self.generation is None else self.final / self.generation
            _check_stored(self.backend, stored_at, self.staging.files)
        if self._record is None:
            return
        assert self.generation is not None
        record, self._record = self._record, None
        # The writer holds the checkpoint's lock: whatever the record does not name (the
        # replaced generation, killed saves' objects) is garbage once it is written.
        try:
            commit_generation(
                self.final,
                COMMIT_RECORD,
                record,
                self.generation,
                sweep_all=True,
                reread=False,
                backend=self.backend,
            )
        except CommitOutcomeUnknownError:
            self._keep = True
            raise
        except BaseException:
            # An interruption (Ctrl-C) can land after the record was put: what it names is
            # then this save's, and kept (so is it when the record cannot be read).
            assert self.generation is not None
            named = record_names_generation(
                self.final, COMMIT_RECORD, self.generation, self.backend
            )
            self._keep = named is not False
            raise

    def abort(self) -> None:
        """Drop what was written (kept after a commit whose outcome is unknown: the record
        may name it)."""
        if self._keep:
            _LOG.warning(
                "%s: keeping what this save wrote: its commit may have been applied",
                display_path(self.final),
            )
            return
        self.staging.discard()


def _check_stored(backend: StorageBackend, directory: Path, files: Mapping[str, Any]) -> None:
    """On an object store, before a commit record names them: every object of ``directory``
    this save put (``files``: relpath -> record) is there with its size. The store answered
    each upload; one it did not keep (or another process removed since) was committed, and
    the save failed only after its commit, or not at all (an adversarial store found it).

    Raises:
        FileNotFoundError: an object is missing (named); nothing is committed.
        CheckpointFormatError: an object holds another size than the save wrote (named);
            nothing is committed.
    """
    names = list(files)
    for relpath, actual in zip(names, stored_sizes(backend, directory, names), strict=True):
        expected = files[relpath]["size"]
        if actual == expected:
            continue
        path = directory / relpath
        if actual is None:
            raise FileNotFoundError(
                errno.ENOENT,
                f"{display_path(path)}: missing after the store acknowledged its upload (the "
                "store did not keep it, or another process removed it); nothing was "
                "committed, save again",
                str(path),
            )
        raise CheckpointFormatError(
            f"{display_path(path)}: {actual} bytes, not the {expected} this save wrote, after "
            "the store acknowledged its upload (another process wrote that name, or the store "
            "damaged it); nothing was committed, save again"
        )


class IndexWriter(DirectoryWriter):
    """A :class:`DirectoryWriter` for ``ROOT/<index>`` whose commit also records the index
    in the manifest (the commit point).

    Creating it takes the root's lock (held until :meth:`commit_entry` or :meth:`abort`
    returns), then removes what crashed saves left, then picks the index: so two processes
    saving into one root are serialized, and with ``index=None`` they never pick the same
    index.

    On a local root the files are written in the background while the caller goes on: the
    tensor files one after the other on one thread, the JSON documents next to them on
    others, so that the small files' fsyncs overlap the tensor writes instead of following
    them (each durable small file costs two fsyncs, a few milliseconds each on a virtual
    disk, which is most of an incremental save's time; see benches/NOTES.md). The
    tensors and documents given must not change until :meth:`commit_entry` or :meth:`abort`
    returns. :attr:`files`, :meth:`commit_entry` and :meth:`abort` wait for the writes; the
    first write error is raised by the first of them.

    Attributes:
        index: the index being written (decided under the lock when ``index`` was None).
        lock: the held lock.
        manifest: the root's manifest, read once under the lock (as cleaned, and on an
            object store without the index being replaced); it is what the root holds until
            :meth:`commit_entry` commits this index into it, since every writer of a manifest
            (a save, a prune, a promotion) holds the lock. Read it, do not change it.
    """

    def __init__(
        self,
        root: Path,
        index: int | None = None,
        *,
        direct_io: bool | None = None,
        lock_timeout: float | None = None,
        check: Callable[[Manifest, int], None] | None = None,
    ) -> None:
        """Prepare to write index ``index`` of ``root`` (None: the next one, decided under
        the lock); ``lock_timeout`` None waits for other writers as long as they take.
        ``check`` is called under the lock with the root's manifest and the index, before
        anything changes (an index being replaced is still committed then); what it raises
        aborts the save, the lock released.

        Raises:
            ValueError: a negative index, or one over MAX_INDEX (10**18 - 1) (``index`` None:
                the root's latest index is MAX_INDEX already).
            TimeoutError: another process held the root longer than ``lock_timeout``.
            CheckpointFormatError: ``index`` is None and the manifest is damaged.
        """
        root = Path(root)
        self._aside: Path | None = None  # on an object store, the copy of a replaced index
        self._released = False
        checked_lock_timeout(lock_timeout)  # before the root is created
        if index is not None and not 0 <= index <= MAX_INDEX:
            raise ValueError(
                f"checkpoint index must be from 0 to {MAX_INDEX} (or None for the next), got "
                f"{index}"
            )
        backend = backend_for(root)
        if is_local(backend):
            refuse_inside_checkpoint(root, roots=False)
            make_dirs(root)
        self.root = root
        self.lock = backend.lock(root, timeout=lock_timeout)
        self.lock.acquire()
        try:
            _refuse_manager_checkpoints(root, backend)
            # The one read of the manifest for this save, under the lock: handed to the
            # clean-up, the caller's checks and the commit (no other writer can change it
            # before the commit: each takes the lock). A manifest whose seal fails is refused
            # before anything is written: this save's commit would re-seal the damage (an
            # edited counter) as fastckpt's own.
            sealed = Manifest.load(root)
            sealed.refuse_if_damaged()
            _removed, cleaned = _clean_leftovers(root, sealed, writing=index)
            # As cleaned (the same manifest, unless an interrupted replacement was undone);
            # None: the restored manifest does not read, and this read raises why.
            sealed = cleaned if cleaned is not None else Manifest.load(root)
            if index is None:
                index = _next_free_index(root, sealed.latest)
                if index > MAX_INDEX:
                    raise ValueError(
                        f"{display_path(root)}: the root's latest index is already "
                        f"{sealed.latest} and the next one would be past {MAX_INDEX}, the "
                        "largest a manifest holds: give an index (checkpoint_index=...), or "
                        "save into a new root"
                    )
            self.index: int = index
            self.manifest = sealed
            if check is not None:
                check(sealed, index)
            _refuse_foreign_files(root, backend, sealed, index)
            # Objects are written in place (delete first, no rename): a committed index being
            # replaced leaves the manifest before its objects go, so the manifest never names a
            # missing or partial object (clean_leftovers leaves the manifest as read). Its
            # objects are copied aside first (by the store), so that a crash before the new
            # one is committed does not lose it (_restore_object_replacements).
            if not is_local(backend) and index in sealed.entries:
                self._aside = _set_aside_object_index(root, backend, sealed, index)
                del sealed.entries[index]
                sealed.commit()
            elif not is_local(backend) and _is_in_doubt(root, index):
                # An earlier save of this index may still land its manifest put (outcome
                # unknown): a put of the manifest in other bytes first voids that put's
                # condition (an etag), so it can no longer name the objects this save is
                # about to rewrite.
                sealed.commit_anew()
                _settle_in_doubt(root, None)
            super().__init__(root / str(index), direct_io=direct_io, generations=False)
        except BaseException as err:
            try:
                if self._aside is not None and not isinstance(err, FileExistsError):
                    _put_back_now(root, backend, self.index, self._aside)  # still holding the root
            finally:
                self._released = True
                self.lock.release()
            raise
        self._background = is_local(self.backend)
        self._tensor_lane: ThreadPoolExecutor | None = None
        self._json_lane: ThreadPoolExecutor | None = None
        self._pending: list[Future[object]] = []

    def _submit(self, lane: str, work: Callable[[], object]) -> None:
        if lane == "tensors":
            if self._tensor_lane is None:
                self._tensor_lane = ThreadPoolExecutor(1, thread_name_prefix="fastckpt-tensors")
            pool = self._tensor_lane
        else:
            if self._json_lane is None:
                self._json_lane = ThreadPoolExecutor(
                    _JSON_THREADS, thread_name_prefix="fastckpt-records"
                )
            pool = self._json_lane
        try:
            self._pending.append(pool.submit(work))
        except RuntimeError as err:
            if "can't start new thread" not in str(err):
                raise
            # Before, the bare RuntimeError named nothing; the save is aborted by its caller.
            raise OSError(
                errno.EAGAIN,
                f"{display_path(self.final)}: no thread could be started for this save: the "
                "process is at its thread limit (`ulimit -u`, a container's pids limit); raise "
                "it or run fewer threads",
            ) from err

    def add_tensors(
        self,
        relpath: str,
        tensors: Mapping[str, torch.Tensor],
        copies: Mapping[str, CopySource] | None = None,
    ) -> None:
        """Write a safetensors file (durably, in the background on a local root); tensors in
        ``copies`` are copied by an object store (see :meth:`Staging.put_tensors`)."""
        if not self._background:
            super().add_tensors(relpath, tensors, copies)
            return
        self._submit("tensors", lambda: self.staging.put_tensors(relpath, tensors, copies))

    def add_json(self, relpath: str, document: Any) -> None:
        """Write a JSON file (durably, in the background on a local root)."""
        if not self._background:
            super().add_json(relpath, document)
            return
        self._submit("json", lambda: self.staging.put_bytes(relpath, json_bytes(document)))

    def wait_written(self) -> None:
        """Wait for every background write; raise the first error (each error once)."""
        pending, self._pending = self._pending, []
        error: BaseException | None = None
        for future in pending:
            failure = future.exception()
            if failure is not None and error is None:
                error = failure
        for pool in (self._tensor_lane, self._json_lane):
            if pool is not None:
                pool.shutdown(wait=True)
        self._tensor_lane = self._json_lane = None
        if error is not None:
            raise error

    @property
    def files(self) -> dict[str, dict[str, int]]:
        """relpath -> ``{"size", "crc32c"}`` of every file written (waits for the writes)."""
        self.wait_written()
        return super().files

    def commit(self) -> None:
        """Make the directory visible (once every background write finished).

        Not a commit of the index (the manifest is): when the ``fsync`` after the directory
        was put in place fails, the directory is removed (no uncommitted ``ROOT/<i>`` is
        left) and that plain ``OSError`` raised.
        """
        self.wait_written()
        try:
            super().commit()
        except CommitNotDurableError as err:
            self.backend.delete(self.final)  # placed, never committed
            raise _cause_of(err) from None

    def commit_entry(self, entry: dict[str, Any]) -> None:
        """Put the index directory in place, then commit ``entry`` to the manifest.

        Replacing a committed index first withdraws it from the manifest, so the manifest never
        names a directory whose files differ from its records (locally, a crash in between
        leaves the old index for the next writer to commit again, see
        :func:`_restore_interrupted_replacements`; on an object store, the copy
        :func:`_set_aside_object_index` kept, see :func:`_restore_object_replacements`; a
        failure here puts that copy back before the lock is released). Locally, an *error* at
        any step (a full disk included) leaves the old index committed or the new one, never
        neither: the new manifest is written (not yet renamed) before anything is withdrawn,
        the old manifest and the old directory are kept (a hard link and a rename, no space
        needed) until the new manifest is renamed into place and fsynced, and a failure puts
        them back by renames alone. The root lock is released in every case.
        """
        try:
            self._commit_entry(entry)
            if self._aside is not None:
                _drop_copy(self.root, self.backend, self.index, self._aside)
        except BaseException as err:
            if not isinstance(err, FileExistsError):  # a conflict or lost lease: not ours
                self._put_aside_back()  # still holding the root: the old index back
            raise
        finally:
            self._released = True
            self.lock.release()

    def _commit_entry(self, entry: dict[str, Any]) -> None:
        self.wait_written()
        # Not read again: the lock held since __init__ kept every other writer out (on an
        # object store, the lease: a writer that outlived its lease is refused by the
        # conditional put, which is conditioned on the version read under the lease).
        manifest = self.manifest
        if self.index in manifest.entries and isinstance(self.staging, LocalStaging):
            _replace_local(self, manifest, {**entry, "files": self.files})
            _committed(self.root, self.index, manifest.entries)
            return
        if manifest.entries.pop(self.index, None) is not None:
            manifest.commit()
        self.commit()
        manifest.entries[self.index] = {**entry, "files": self.files}
        try:
            manifest.commit()
        except FileExistsError:
            # Another writer committed first (an object store's conditional put, or a
            # lost lease): what is at self.final may be its objects by now; leave them.
            raise
        except CommitOutcomeUnknownError:
            self._keep = True  # the manifest may name them
            _committed(self.root, self.index, manifest.entries)
            if not is_local(self.backend):
                _settle_in_doubt(self.root, self.index)  # the next save takes another number
            raise
        except BaseException as err:
            # An interruption (Ctrl-C, a signal handler raising) can land after the new
            # manifest took its place: the files it names are then kept.
            listed = self._listed()
            if listed is False:
                self.backend.delete(self.final)
                raise
            self._keep = True
            _committed(self.root, self.index, manifest.entries)
            if listed and _fails_after_commit(err, self.backend):
                # Locally, the only error after the manifest's rename: the fsync after it.
                assert isinstance(err, OSError)
                raise CommitNotDurableError.after(err, display_path(self.final)) from err
            raise
        _committed(self.root, self.index, manifest.entries)
        _settle_in_doubt(self.root, None)

    def _put_aside_back(self) -> None:
        """After a failed replacement on an object store, while the root's lock is held:
        commit the replaced index again from its copy, unless the new one was committed
        (best effort: the next writer tries again)."""
        if self._aside is None or self._released or self._keep:
            return
        self.staging.files = {}  # the objects at those keys are the old index's again
        _put_back_now(self.root, self.backend, self.index, self._aside)

    def _recorded(self) -> bool:
        """Whether the root's manifest names this index with the files written here (or
        cannot be read, which leaves the question open: the files are kept, the next save's
        clean-up removes them if no manifest names them)."""
        return self._listed() is not False

    def _listed(self) -> bool | None:
        """Whether the root's manifest names this index with the files written here; None
        when it cannot be read."""
        try:
            listed = Manifest.load(self.root).entries.get(self.index)
        except Exception:  # unreadable: the question stays open
            return None
        return listed is not None and listed.get("files") == self.files

    def abort(self) -> None:
        """Drop what was written and release the root lock."""
        try:
            with contextlib.suppress(Exception):
                self.wait_written()  # its error is the caller's to raise, not this one's
            super().abort()
            self._put_aside_back()  # not once commit_entry released the lock: it did
        finally:
            self._released = True
            self.lock.release()


def _write_aside(path: Path, data: bytes) -> None:
    """Write ``data`` durably to the new file ``path`` (not renamed anywhere)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def _replace_local(writer: IndexWriter, manifest: Manifest, entry: dict[str, Any]) -> None:
    """Replace committed index ``writer.index`` of a local root (see
    :meth:`IndexWriter.commit_entry`): on an error, the old index is committed again (or the
    new one already is) before the error propagates."""
    root, final = writer.root, writer.final
    tag = f"{os.getpid()}.{os.urandom(4).hex()}"
    record = root / MANIFEST
    new_record = root / f".{MANIFEST}{ATOMIC_TEMP_INFIX}new.{tag}"
    old_record = root / f".{MANIFEST}{ATOMIC_TEMP_INFIX}old.{tag}"
    old_directory = root / f"{TRASH_PREFIX}{final.name}~{tag}"
    withdrawn = Manifest(root, dict(manifest.entries))
    del withdrawn.entries[writer.index]
    replaced = Manifest(root, {**manifest.entries, writer.index: entry})
    step = "start"
    try:
        _write_aside(new_record, replaced.to_json())  # the space the commit needs, taken first
        try:
            os.link(record, old_record)  # the old record, kept without a copy
        except OSError:  # a filesystem without hard links: a copy, before anything changes
            _write_aside(old_record, manifest.to_json())
        if isinstance(writer.lock, RootLock):
            writer.lock.announce(f"{REPLACING} {writer.index}")  # readers wait for its commit
        step = "withdrawn"
        withdrawn.commit()
        step = "set aside"
        if os.path.lexists(final):
            os.rename(final, old_directory)
        step = "published"
        writer.commit()
        step = "renamed"
        os.rename(new_record, record)
        _native.fsync_dir(str(root))
        step = "done"
        if isinstance(writer.lock, RootLock):
            writer.lock.announce("")  # committed: readers need not wait for the clean-up
    except BaseException:
        _roll_back(step, record, old_record, final, old_directory, writer)
        raise
    finally:
        for leftover in (new_record, old_record):
            leftover.unlink(missing_ok=True)
    shutil.rmtree(old_directory, ignore_errors=True)


def _roll_back(
    step: str, record: Path, old_record: Path, final: Path, old: Path, writer: IndexWriter
) -> None:
    """Undo :func:`_replace_local` up to ``step`` by renames only (no space needed)."""
    if step in ("published", "renamed") and os.path.lexists(final):
        aside = final.parent / f"{TEMP_PREFIX}{final.name}~undo.{os.urandom(4).hex()}"
        os.rename(final, aside)
        shutil.rmtree(aside, ignore_errors=True)
    if step in ("set aside", "published", "renamed") and os.path.lexists(old):
        os.rename(old, final)
    if step in ("withdrawn", "set aside", "published", "renamed") and os.path.lexists(old_record):
        os.rename(old_record, record)
    _native.fsync_dir(str(record.parent))
    writer.staging.discard()


def _restore_interrupted_replacements(root: Path) -> bool:
    """Put back the index a replacement (:func:`_replace_local`) withdrew from the manifest
    when its writer died before committing the new one: the old manifest it kept (a hard
    link) names the index, the old directory is whole (renamed aside in one step, or not
    moved yet), so the index is committed again as it was and the unfinished new directory
    removed. Called under the root's lock, before the leftovers (those copies) are removed.
    Returns whether it committed the manifest (changed).
    """
    prefix = f".{MANIFEST}{ATOMIC_TEMP_INFIX}old."
    restored = False
    for name in sorted(os.listdir(root)):
        if not name.startswith(prefix):
            continue
        tag = name[len(prefix) :]
        try:
            old = Manifest.parse(root, root / name, read_record_bytes(root, name))
            current = Manifest.load(root)
        except (CheckpointFormatError, OSError):
            continue  # never restore on the word of a damaged record
        withdrawn = [i for i in old.entries if i not in current.entries]
        if len(withdrawn) != 1:
            continue  # not a replacement's withdrawal (or already committed again)
        index = withdrawn[0]
        final, aside = root / str(index), root / f"{TRASH_PREFIX}{index}~{tag}"
        set_aside = os.path.lexists(aside)
        if set_aside:
            if os.path.lexists(final):  # the new directory, never committed
                unfinished = root / f"{TEMP_PREFIX}{index}~undo.{os.urandom(4).hex()}"
                os.rename(final, unfinished)
                shutil.rmtree(unfinished, ignore_errors=True)
            os.rename(aside, final)
            _native.fsync_dir(str(root))
        elif not final.is_dir():
            continue  # nothing to put back
        current.entries[index] = old.entries[index]
        if not set_aside and index_intact(current, index) is not None:
            # Not set aside: the directory in place is the old one only if it verifies
            # against the old record (the old one was missing, so the new one took its place).
            continue
        current.commit()
        restored = True
        _LOG.warning(
            "%s: index %d was being replaced when its writer died; the old index %d is "
            "committed again",
            display_path(root),
            index,
            index,
        )
    return restored


def _set_aside_object_index(
    root: Path, backend: StorageBackend, manifest: Manifest, index: int
) -> Path | None:
    """On an object store, before committed index ``index`` is replaced in place: have the
    store copy its objects to ``ROOT/.trash-<index>.<pid>.<random>/`` (no ``~``: some
    servers' request signing refuses it in a prefix) and put the manifest that names
    it there as :data:`~fastckpt.format.records.REPLACED_MANIFEST`, written last (a copy
    without it was interrupted before anything was withdrawn). Returns that directory; None
    when the store cannot copy (the index is then replaced as before: a crash before the new
    one is committed loses it, which a warning says)."""
    aside = root / f"{TRASH_PREFIX}{index}.{os.getpid()}.{os.urandom(4).hex()}"
    for relpath, record in manifest.entries[index]["files"].items():
        source = root / str(index) / relpath
        try:
            size: int | None = backend.stat(source).size
        except FileNotFoundError:
            size = None
        if size != int(record["size"]):  # damaged already: saving it again repairs it
            copied = False
            state = "missing" if size is None else "damaged"
            why = f"its object {display_path(source)} is {state}"
        else:
            copied = backend.copy_file(source, aside / relpath, int(record["size"]))
            why = "the store cannot copy objects"
        if not copied:
            backend.delete(aside)
            _LOG.warning(
                "%s: %s, so index %d is replaced in place without a copy kept: a crash "
                "before the new index %d is committed loses it",
                display_path(root),
                why,
                index,
                index,
            )
            return None
    backend.stage(aside).put_bytes(REPLACED_MANIFEST, manifest.to_json())  # a plain put, last
    return aside


def _put_back_now(root: Path, backend: StorageBackend, index: int, aside: Path) -> None:
    """:func:`_restore_object_index` after a failed save that still holds the root (best
    effort: the next writer tries again; the save's own error is the one raised)."""
    try:
        _restore_object_index(root, backend, index, aside)
    except Exception as err:
        _LOG.warning(
            "%s: index %d, replaced by a save that failed, could not be put back yet (%s); "
            "the next save or prune of the root puts it back",
            display_path(root),
            index,
            err,
        )


def _drop_copy(root: Path, backend: StorageBackend, index: int, aside: Path) -> None:
    """After the new ``index`` was committed (the lock still held): delete the copy the
    replacement kept, its manifest first (a copy without it is inert: an interrupted copy);
    a failure only warns (the next writer deletes it: the index is committed)."""
    try:
        backend.delete(aside / REPLACED_MANIFEST)
        backend.delete(aside)
    except Exception as err:
        _LOG.warning(
            "%s: index %d committed; the copy %s of the one it replaced stays until the next "
            "save (%s)",
            display_path(root),
            index,
            display_path(aside),
            err,
        )


def _restore_object_replacements(
    root: Path, backend: StorageBackend, names: Sequence[str] | None = None
) -> bool:
    """On an object store, under the root's lock: each index a replacement withdrew and
    whose writer died before committing the new one is committed again from the copy
    :func:`_set_aside_object_index` kept (verified against its record first); copies no
    longer needed are deleted. ``names``: the root's listing, when the caller has it.
    Returns whether there was such a copy (the manifest may have been committed again)."""
    if names is None:
        try:
            names = backend.list_dir(root)
        except (FileNotFoundError, NotADirectoryError):
            return False
    found = False
    for name in names:
        number, _, tag = name.removeprefix(TRASH_PREFIX).partition(".")
        if name.startswith(TRASH_PREFIX) and tag and _is_index_name(number):
            _restore_object_index(root, backend, int(number), root / name)
            found = True
    return found


def _restore_object_index(root: Path, backend: StorageBackend, index: int, aside: Path) -> None:
    """:func:`_restore_object_replacements` for one copy ``aside`` of index ``index``."""
    try:
        current = Manifest.load(root)
    except (CheckpointFormatError, OSError) as err:
        _LOG.warning(
            "%s: index %d, being replaced, stays withdrawn for now: the manifest cannot be read "
            "(%s); the next save or prune puts it back from %s",
            display_path(root),
            index,
            err,
            display_path(aside),
        )
        return  # never act on the word of a damaged manifest
    if index in current.entries:
        backend.delete(aside)  # the new index was committed, or the old never withdrawn
        return
    try:
        data = read_record_bytes(aside, REPLACED_MANIFEST)
    except FileNotFoundError:
        backend.delete(aside)  # the copy was interrupted before anything was withdrawn
        return
    try:
        old = Manifest.parse(root, aside / REPLACED_MANIFEST, data, verify_checksum=True)
        entry = old.entries.get(index)
    except CheckpointFormatError as err:
        _LOG.warning(
            "%s: the copy of index %d a replacement kept has a damaged record (%s); it is "
            "left there, not committed: delete it, or commit it again by hand",
            display_path(aside),
            index,
            err,
        )
        return
    if entry is None:
        backend.delete(aside)
        return
    final = root / str(index)
    backend.delete(final)  # what the unfinished new index wrote
    for relpath, record in entry["files"].items():
        if not backend.copy_file(aside / relpath, final / relpath, int(record["size"])):
            _LOG.warning(
                "%s: the store cannot copy objects: index %d stays withdrawn, its copy kept at %s",
                display_path(root),
                index,
                display_path(aside),
            )
            return
    current.entries[index] = entry
    damage = index_intact(current, index)
    if damage is not None:
        # Never committed on the word of a copy that does not verify; kept, as the reason may
        # be the store not answering the reads (the next writer tries again).
        _LOG.warning(
            "%s: index %d, put back from the copy a replacement kept, does not verify (%s): it "
            "stays withdrawn and the copy %s is kept; delete it if the copy is damaged",
            display_path(root),
            index,
            damage,
            display_path(aside),
        )
        return
    current.commit()
    backend.delete(aside)
    _LOG.warning(
        "%s: index %d was being replaced when its writer stopped; the old index %d is "
        "committed again",
        display_path(root),
        index,
        index,
    )


def _is_index_name(name: str) -> bool:
    return is_ascii_decimal(name) and len(name) <= 18 and str(int(name)) == name


def clean_leftovers(
    root: Path, *, writing: int | None = None, promoting: bool = False
) -> list[str]:
    """Remove what crashed saves and prunes left in a checkpoint root.

    That is: temporary and trash directories, manifest temp files, and index directories the
    manifest no longer names that are older than its latest index (a prune or a replacement
    interrupted after its manifest commit). Newer unnamed index directories are left alone:
    the next save of that index replaces them, with a logged warning naming each (an older
    backup's manifest restored over the root leaves newer checkpoints unnamed too). Sharded
    parts (``ROOT/sharded``) no committed index names go too
    (:func:`fastckpt.container.sharded.parts.sweep`), but never those of index ``writing``,
    whose save is under way; on an object store, and where the caller is ``promoting`` into
    ``root``, only those of indices older than the latest (other ranks may be uploading into
    the newer ones: ``only_older``).

    Call it only while holding the root's lock (as :class:`IndexWriter` does): everything
    temporary in the root then belongs to a dead writer. Returns what was removed.
    """
    return _clean_leftovers(root, None, writing=writing, promoting=promoting)[0]


def _clean_leftovers(
    root: Path, manifest: Manifest | None, *, writing: int | None, promoting: bool = False
) -> tuple[list[str], Manifest | None]:
    """:func:`clean_leftovers`, given the root's manifest as the caller read it under the
    lock (None: read here); returns what was removed and the manifest as cleaned: the one
    given, unless an interrupted replacement was undone (which commits the manifest: read
    again then), None when it does not read (nothing is deleted on the word of a damaged
    manifest)."""
    removed: list[str] = []
    backend = backend_for(root)
    if not is_local(backend):
        return _clean_object_root(root, backend, writing, manifest)
    if not root.is_dir():
        return removed, manifest
    if _restore_interrupted_replacements(root) or manifest is None:
        try:
            manifest = Manifest.load(root)
        except (CheckpointFormatError, OSError):
            manifest = None  # never delete index directories on the word of a damaged manifest
    latest = None if manifest is None else manifest.latest
    referenced: set[int] | None = None
    for name in backend.list_dir(root):
        child = root / name
        if name.startswith((TEMP_PREFIX, TRASH_PREFIX)) and (child.is_dir() or child.is_symlink()):
            backend.delete(child)
        elif name.startswith(f".{MANIFEST}{ATOMIC_TEMP_INFIX}"):
            child.unlink(missing_ok=True)
        elif (
            manifest is not None
            and latest is not None
            and _is_index_name(name)
            and int(name) < latest
            and int(name) not in manifest.entries
            and child.is_dir()
            and not os.path.islink(child)
        ):
            if referenced is None:
                referenced = _referenced(manifest)
            foreign = _not_written_by_fastckpt(child)
            if foreign and int(name) not in referenced:
                message = (
                    f"{display_path(child)}: a folder named like an index that {MANIFEST} does "
                    f"not name, holding {shown_names(foreign)}, which fastckpt does not write: "
                    "left in place; move it out of the checkpoint root"
                )
                _LOG.warning("%s", message)
                warnings.warn(message, RuntimeWarning, stacklevel=4)
                continue
            if int(name) in referenced:
                # A prune committed, then died before setting the bytes kept indices
                # reference aside: finish it.
                refs.retain_for_references(root, int(name))
            else:
                refs.remove_directory(root, child)
        else:
            continue
        removed.append(name)
    if manifest is not None and any(n.startswith(refs.RETAINED_PREFIX) for n in os.listdir(root)):
        # Retained copies no committed index references, or of an index still committed
        # (a prune that did not commit): readers find those bytes in the index itself. One
        # whose committed index lost its folder (an earlier version's prune renamed it
        # aside, then failed to commit) is put back instead.
        in_use = referenced if referenced is not None else _referenced(manifest)
        removed += refs.collect_garbage(root, in_use - set(manifest.entries), manifest.entries)
    if manifest is not None:
        removed += _sweep_sharded(root, manifest, writing, only_older=promoting)
    return removed, manifest


def _sweep_sharded(
    root: Path, manifest: Manifest, writing: int | None = None, *, only_older: bool = False
) -> list[str]:
    """The sharded parts of a root no committed index names, removed (see
    :func:`fastckpt.container.sharded.parts.sweep`, ``only_older`` included); on a local root
    without any, nothing to do and nothing imported (an object store is asked: one listing).
    On an object store only the parts of indices older than the latest go: a sharded save
    there sweeps its own (:func:`fastckpt.training.sharded.sweep_parts`), and promotions of
    other ranks may be uploading into the newer ones."""
    local = is_local(backend_for(root))
    if local and not (root / SHARDED_DIR).is_dir():
        return []
    from fastckpt.container.sharded.parts import (
        sweep,  # deferred: only roots of FSDP2 strategies have parts
    )

    swept = sweep(root, manifest, writing=writing, only_older=only_older or not local)
    return [str(path.relative_to(root)) for path in swept]


def _referenced(manifest: Manifest) -> set[int]:
    """The indices whose bytes the committed indices reference (all, when the references
    cannot be read: never delete on the word of a damaged record)."""
    try:
        return refs.referenced_indices(manifest, list(manifest.entries))
    except (CheckpointFormatError, OSError):
        return set(range((manifest.latest or 0) + 1))


def _clean_object_root(
    root: Path, backend: StorageBackend, writing: int | None, manifest: Manifest | None
) -> tuple[list[str], Manifest | None]:
    """:func:`_clean_leftovers` on an object store: index prefixes the manifest does not name
    that are older than its latest index (with their unfinished uploads), and the sharded parts
    of such indices (see :func:`_sweep_sharded`). Newer index prefixes are deleted by the next
    save of that index."""
    try:
        names = backend.list_dir(root)  # once: a request each (the copies' names stay apart)
    except (FileNotFoundError, NotADirectoryError):
        return [], manifest
    # Before deciding what the root holds; a copy of a replaced index may be committed again.
    if _restore_object_replacements(root, backend, names) or manifest is None:
        try:
            manifest = Manifest.load(root)
        except (CheckpointFormatError, OSError):
            return [], None
    latest = manifest.latest
    if latest is None:
        return [], manifest
    removed = []
    for name in names:
        if _is_index_name(name) and int(name) < latest and int(name) not in manifest.entries:
            backend.delete(root / name)
            removed.append(name)
    # Only older indices, but never ``writing``: a save may replace an older index.
    return removed + _sweep_sharded(root, manifest, writing), manifest


def _remember_record_version(backend: StorageBackend, final: Path) -> None:
    """Read ``final``'s commit record (if any), so that the backend's conditional put at
    commit replaces exactly that version: a writer that committed meanwhile is not
    overwritten (the later put fails with a typed conflict error instead)."""
    with contextlib.suppress(FileNotFoundError, CheckpointFormatError):
        backend.read_bytes(final / COMMIT_RECORD)


def prune_plan(
    manifest: Manifest, due: list[int], *, local: bool, read_shards: bool = True
) -> list[int]:
    """Which of the indices ``due`` (by age) a prune of ``manifest``'s root deletes: never
    the newest index that verifies (:func:`spare_newest_intact`), nor, on a local root, an
    index a kept index links into or one holding files fastckpt did not write (each kept
    one warned of, saying why). :func:`prune_indices` decides with it under the root's lock;
    ``fastckpt prune --dry-run`` without it, so that the two agree."""
    doomed = spare_newest_intact(manifest, due, read_shards=read_shards) if due else []
    if doomed and local:
        doomed = _not_linked_into(manifest, doomed)
        doomed = [index for index in doomed if _holds_only_its_files(manifest, index)]
    elif doomed:
        doomed = _not_referenced(manifest, doomed)
    return doomed


def _not_referenced(manifest: Manifest, doomed: list[int]) -> list[int]:
    """``doomed`` without the indices a kept index of an object-store root references through
    an earlier version's ``refs.json`` (copied there by ``fastckpt promote --every 1``): an
    object store keeps no retained copy (``.ref-<index>``) of a pruned index, so deleting one
    left the newest index listed as committed but unloadable. A spared index stays committed
    and loadable, so what it references is kept too; each is warned of, saying why."""
    doomed = list(doomed)
    while True:
        kept = [index for index in manifest.entries if index not in doomed]
        referenced = refs.referenced_indices(manifest, kept) & set(doomed)
        if not referenced:
            return doomed
        for index in sorted(referenced):
            _LOG.warning(
                "%s: not deleting index %d: a kept index written by an earlier fastckpt "
                "version reads tensors from it (refs.json), and an object store keeps no "
                "copy of a pruned index; load the newest index and save it again (every index "
                "this fastckpt writes is self-contained), then prune again",
                display_path(manifest.root),
                index,
            )
        doomed = [index for index in doomed if index not in referenced]


def _doomed(
    manifest: Manifest, keep_last: int, spare: Collection[int], read_shards: bool
) -> list[int]:
    """The indices a prune to the newest ``keep_last`` of ``manifest``'s root deletes, never
    those of ``spare`` (:func:`prune_plan`)."""
    due = [index for index in sorted(manifest.entries)[:-keep_last] if index not in spare]
    local = is_local(backend_for(manifest.root))
    return prune_plan(manifest, due, local=local, read_shards=read_shards)


def _plan_without_lock(
    root: Path, keep_last: int, spare: Collection[int], read_shards: bool
) -> tuple[list[int], set[int]]:
    """What a prune of ``root`` that could not take the root's lock would have deleted, and
    which of those indices kept ones of an earlier version's layout read tensors from (as
    ``fastckpt prune --dry-run`` decides, without the lock); nothing where its manifest
    cannot be read."""
    try:
        manifest = Manifest.load(root)
        doomed = _doomed(manifest, keep_last, spare, read_shards)
        kept = [index for index in manifest.entries if index not in doomed]
        if not is_local(backend_for(root)):
            return doomed, set()
        return doomed, refs.referenced_indices(manifest, kept) & set(doomed)
    except (CheckpointFormatError, OSError):
        return [], set()


def _no_room_to_prune(
    err: OSError, root: Path, step: str, doomed: Collection[int], read_from: Collection[int]
) -> OSError:
    """The error of a prune of ``root`` that had no room for ``step`` (``err``: ``ENOSPC`` or
    ``EDQUOT``), nothing deleted: the folders of ``doomed`` to delete by hand, never one of
    ``read_from``, which kept indices of an earlier version's layout read tensors from
    (deleting it by hand broke them), and what to free (space, or inodes)."""
    by_hand = [index for index in sorted(doomed) if index not in read_from]
    free = free_space_advice(root)
    code = err.errno if err.errno is not None else errno.ENOSPC
    message = f"{os.strerror(code)}: {step}, and there is no room for it; nothing was deleted."
    if by_hand:
        message += (
            " Delete the folders it would have deleted by hand (rm -rf "
            + " ".join(display_path(root / str(index)) for index in by_hand)
            + ": every other index stays loadable; files they share with kept indices free "
            f"nothing), then prune again to drop them from the manifest; or {free} and prune "
            "again"
        )
    else:
        message += f" {free[0].upper()}{free[1:]} and prune again"
    if read_from:
        shown = ", ".join(str(index) for index in sorted(read_from))
        message += (
            f" (not index(es) {shown} by hand: indices written by an earlier fastckpt version "
            "read tensors from their files; a prune with room keeps those bytes for them)"
        )
    return OSError(code, message, err.filename)


_EFFECTIVE = os.access in os.supports_effective_ids  # ask as the effective user, where possible


def _refuse_undeletable(root: Path, directories: Sequence[Path]) -> None:
    """Refuse a prune this user could commit but not carry out, before its commit: an index
    folder (or a folder inside it) another user owns whose entries this user may not
    remove, or one in a sticky root (``chmod +t``, as ``/tmp``) that this user does not own
    (nor the root).

    Before, such a prune committed (the indices no longer listed), could not delete them,
    and returned them as deleted: their bytes stayed, renamed aside, with a warning.

    Raises:
        PermissionError: naming the folder, who owns it, that nothing was deleted, and the
            fix.
    """
    me = os.geteuid()
    try:
        sticky = bool(os.stat(root).st_mode & stat.S_ISVTX) and os.stat(root).st_uid != me
    except OSError:
        sticky = False
    for directory in directories:
        if directory.is_symlink() or not directory.is_dir():
            continue  # a link loses only itself here (its target is checked where it goes)
        unlisted: list[OSError] = []  # folders os.walk could not list (mode 0711)
        try:
            refused = sticky and me != 0 and os.stat(directory).st_uid != me
            if not refused:
                for folder, _, _ in os.walk(directory, onerror=unlisted.append):
                    if not os.access(folder, os.W_OK | os.X_OK, effective_ids=_EFFECTIVE):
                        refused = True
                        directory = Path(folder)
                        break
        except OSError:
            continue  # vanished meanwhile: nothing to delete
        if not refused and unlisted and unlisted[0].errno in (errno.EACCES, errno.EPERM):
            refused = True  # what a folder this user may not list holds cannot be deleted
            directory = Path(unlisted[0].filename or directory)
        if refused:
            raise PermissionError(
                errno.EACCES,
                f"{directory}: this user may not delete it ({access_note(directory)}); "
                f"nothing was deleted from {root}: prune as its owner, or grant this user "
                "write access to the index folders",
                str(directory),
            )


def prune_indices(
    root: Path,
    keep_last: int,
    *,
    lock_timeout: float | None = None,
    spare: Collection[int] = (),
    promoting: bool = False,
    read_shards: bool = True,
) -> list[int]:
    """Delete all but the newest ``keep_last`` indices of ``root`` (never the latest).

    Under the root's lock, the manifest is committed first, so a crash mid-prune leaves only
    unreferenced directories (removed by the next save), never a manifest naming a deleted
    index. An index directory that is a symlink loses the link and, when the link points
    inside the root, what it points to; a target outside the root is left alone (logged).
    Returns the deleted indices.

    The newest index that verifies is never deleted: the kept indices are verified newest
    first (every file against the manifest, every tensor and reference; normally only the
    latest is read), and when none of them verifies, the newest doomed index that does is
    kept too (a warning names the damaged ones). When no index verifies, nothing is deleted.

    Args:
        root: the checkpoint root.
        keep_last: how many of the newest indices to keep (>= 1).
        lock_timeout: give up waiting for another process's save or prune of ``root`` after
            this many seconds (None: wait; who holds the lock is logged after a second).
        spare: indices kept whatever their age (a fast tier's index not yet promoted, see
            :meth:`fastckpt.container.promote.Promoter.awaiting`).
        promoting: the caller promotes into ``root`` (a durable tier): of the sharded parts
            no committed index names, only those of indices older than the latest go (other
            ranks may be uploading into a newer index's part under the name of a trainer
            that is gone: ``only_older`` of :func:`fastckpt.container.sharded.parts.sweep`).
        read_shards: whether the check of which kept index verifies reads the shards of an
            FSDP2 strategy's index (``prune``, ``fastckpt prune``); a retention that runs
            after every save (a hook's ``keep_last``, a durable tier's) checks their record
            and sizes only, as reading them would read the whole sharded checkpoint each time.

    Once the new manifest is committed the indices are pruned: a folder (or what they left)
    that cannot then be set aside or removed is a ``RuntimeWarning`` naming it, never an error.

    Raises:
        TypeError: ``keep_last`` is not an int (``1.5``, ``"1"``, ``True``).
        ValueError: ``keep_last < 1``.
        TimeoutError: another process held the root longer than ``lock_timeout`` (the
            message names it: pid and host).
        OSError: ``ENOSPC``/``EDQUOT``: no room for the root's lock file or the new manifest,
            nothing deleted (the message names the folders to delete by hand, and what to free).
    """
    if isinstance(keep_last, bool) or not isinstance(keep_last, int):
        raise TypeError(f"keep_last must be an int >= 1, got {keep_last!r}")
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 (the latest is never deleted), got {keep_last}")
    backend = backend_for(root)
    local = is_local(backend)
    with contextlib.ExitStack() as held:
        try:
            held.enter_context(backend.lock(root, timeout=lock_timeout))
        except OSError as err:
            if err.errno not in NO_ROOM:
                raise
            # No room for the lock file (often no inode left): say what the prune would
            # have deleted, decided without the lock (as ``fastckpt prune --dry-run`` does).
            step = f"a prune creates the root's lock file ({LOCK_FILE}) before deleting anything"
            planned = _plan_without_lock(root, keep_last, spare, read_shards)
            raise _no_room_to_prune(err, root, step, *planned) from err
        if local and root.is_dir():
            _restore_interrupted_replacements(root)  # before deciding what the root holds
        elif not local:
            _restore_object_replacements(root, backend)
        manifest = Manifest.load(root)
        if local and root.is_dir() and refs.set_aside_committed(root, manifest.entries):
            # What a failed prune of an earlier version left: a committed index renamed aside
            # (put back only on the word of a manifest that is intact).
            manifest.refuse_if_damaged()
            refs.restore_committed(root, manifest.entries)
        doomed = _doomed(manifest, keep_last, spare, read_shards)
        if not doomed:
            # What a prune killed after its commit left.
            _sweep_sharded(root, manifest, only_older=promoting)
            return []
        manifest.refuse_if_damaged()  # before any index is moved aside
        # Bytes a kept (incremental) index references outlive their pruned index, renamed
        # to ROOT/.ref-<index> (fastckpt.container.refs).
        kept = [index for index in manifest.entries if index not in doomed]
        # Hard links make the retained copy before the manifest lets the index go, so a
        # kill at any point leaves the committed indices and their references whole.
        referenced = refs.referenced_indices(manifest, kept) if local else set()
        needed = referenced & set(doomed)  # a kept index's bytes stay where they are
        linked = {index for index in needed if _link_retained(root, index)}
        recorded = {index: set(manifest.entries[index]["files"]) for index in doomed}
        if local:
            try:
                _refuse_undeletable(
                    root,
                    [manifest.directory(i) for i in doomed if i not in needed or i in linked],
                )
            except PermissionError:
                for index in sorted(linked):  # nothing changed: the links made go again
                    refs.remove_directory(root, root / f"{refs.RETAINED_PREFIX}{index}")
                raise
        for index in doomed:
            del manifest.entries[index]
        try:
            manifest.commit()
        except OSError as err:
            for index in sorted(linked):  # nothing changed: the links made go again
                refs.remove_directory(root, root / f"{refs.RETAINED_PREFIX}{index}")
            if err.errno not in NO_ROOM:
                raise
            step = f"a prune rewrites {MANIFEST} before deleting anything"
            raise _no_room_to_prune(err, root, step, doomed, needed) from err
        # After the commit the indices are pruned whatever happens to their folders: a
        # failure here is a warning naming the folder, which the next save removes (a save
        # or prune killed here leaves the same), never an error saying the prune failed
        # (before: a bare OSError, and later prunes left the folders).
        for index in sorted(needed - linked):
            # No hard links here: renamed after the commit (never before: a failed or killed
            # commit then left a committed index without its folder, and the next save
            # deleted the retained copy as garbage). Until the rename, the references of kept
            # indices read ROOT/<index> (refs.source_path); a kill leaves it to the next save.
            try:
                refs.retain_for_references(root, index)
            except OSError as err:
                if isinstance(err, FastCkptError):
                    raise  # fastckpt's own (a lost lease): not a folder left behind
                warnings.warn(
                    f"{display_path(root / str(index))}: index {index} is pruned, but its "
                    f"folder could not be set aside for the kept indices that read it ({err}): "
                    "it stays in place, where they read it, and the next save sets it aside; "
                    "do not delete it by hand",
                    RuntimeWarning,
                    stacklevel=2,
                )
        for index in doomed:
            if index not in needed or index in linked:
                directory = manifest.directory(index)
                try:
                    _delete_index(backend, root, directory, set(manifest.entries), recorded[index])
                except OSError as err:
                    if isinstance(err, FastCkptError):
                        raise
                    _warn_pruned_folder_left(directory, index, err)
        try:
            if local:
                refs.collect_garbage(root, referenced - set(manifest.entries), manifest.entries)
            # The pruned indices' sharded parts, after the commit.
            _sweep_sharded(root, manifest, only_older=promoting)
        except OSError as err:
            if isinstance(err, FastCkptError):
                raise
            warnings.warn(
                f"{display_path(root)}: indices {doomed} are pruned, but what they left "
                f"(retained copies, sharded parts) could not all be removed ({err}); the next "
                "save or prune removes it",
                RuntimeWarning,
                stacklevel=2,
            )
    return doomed


#: Threads checking an index's tensors before a prune deletes anything.
_VERIFY_THREADS = 4


def index_intact(
    manifest: Manifest, index: int, *, threads: int = _VERIFY_THREADS, read_shards: bool = True
) -> str | None:
    """Why committed ``index`` does not verify (None: it does): every file against its
    manifest record (size, crc32c, each tensor's checksum) and, for an incremental index,
    every referenced file and tensor, and the shards of its sharded part (see
    :func:`~fastckpt.container.sharded.parts.part_damage`; ``read_shards=False``: their
    record and sizes)."""
    files = manifest.entries[index]["files"]
    if refs.REFS_FILE in files:
        for report in refs.reference_reports(manifest, index, threads):
            if not report.ok:
                return report.message or f"{report.path}: {report.status}"
    for relpath in sorted(files):
        try:
            path = manifest.file_path(index, relpath)
        except CheckpointFormatError as err:
            return str(err)
        checked = check_recorded(
            path, files[relpath], verify_content(threads), source=str(manifest.path), index=index
        )
        if not checked.report.ok:
            return checked.report.message or f"{path}: {checked.report.status}"
    # An FSDP2 strategy's shards (``read_shards=False``: their record and sizes only).
    return part_damage(manifest, index, threads, read=read_shards)


def _not_linked_into(manifest: Manifest, doomed: list[int]) -> list[int]:
    """``doomed`` without the indices a kept index's file is a symlink into (a link made by
    hand: loads follow links that stay inside the root). Deleting such an index left the kept
    one listed as committed but unloadable; it stays, with a warning, until nothing links
    into it."""
    root = os.path.realpath(manifest.root)
    targets = {index: os.path.join(root, str(index)) + os.sep for index in doomed}
    linked: set[int] = set()
    for index in (i for i in manifest.entries if i not in doomed):
        own = os.path.join(root, str(index)) + os.sep
        for relpath in manifest.entries[index]["files"]:
            try:
                real = os.path.realpath(manifest.file_path(index, relpath))
            except CheckpointFormatError:
                continue  # refused by every load, and by verify
            if real.startswith(own):
                continue  # its own file (the usual case: no link on the way)
            for target, prefix in targets.items():
                if real.startswith(prefix):
                    linked.add(target)
                    _LOG.warning(
                        "%s: not deleting index %d: %s of kept index %d is a link into it",
                        display_path(manifest.root),
                        target,
                        relpath,
                        index,
                    )
    return [index for index in doomed if index not in linked]


def spare_newest_intact(
    manifest: Manifest, doomed: list[int], *, read_shards: bool = True
) -> list[int]:
    """``doomed`` without the newest index that verifies, when no kept index newer than every
    doomed one verifies (all of ``doomed``'s indices are kept when none verifies at all); see
    :func:`prune_indices`. Kept indices older than a doomed one (spared: one a promotion is
    copying) do not count: the newest index that verifies is never deleted, whatever older
    one is kept. A newest index that does not verify makes this process's next incremental
    save into the root write every tensor (:func:`fastckpt.container.refs.distrust`)."""
    newest_doomed = max(doomed, default=-1)
    kept = sorted((i for i in manifest.entries if i > newest_doomed), reverse=True)
    damaged: list[str] = []
    for index in kept:
        problem = index_intact(manifest, index, read_shards=read_shards)
        if problem is None:
            return doomed
        damaged.append(f"index {index}: {problem}")
        if index == manifest.latest:
            refs.distrust(manifest.root)  # the next save references nothing of these
    for index in sorted(doomed, reverse=True):
        problem = index_intact(manifest, index, read_shards=read_shards)
        if problem is None:
            _LOG.warning(
                "%s: keeping index %d, the newest that verifies, although prune would delete "
                "it: the newer indices fail verification (%s)",
                display_path(manifest.root),
                index,
                "; ".join(damaged),
            )
            return [i for i in doomed if i != index]
        damaged.append(f"index {index}: {problem}")
    _LOG.warning(
        "%s: prune deleted nothing: no committed index verifies (%s)",
        display_path(manifest.root),
        "; ".join(damaged),
    )
    return []


def _refuse_foreign_files(
    root: Path, backend: StorageBackend, manifest: Manifest, index: int
) -> None:
    """Refuse a save of ``index`` whose folder (or object prefix) holds what fastckpt did not
    write: files a committed index's entry does not record, or, for an index not committed,
    any file a save of an index does not write (:func:`_written_by_fastckpt`: what a killed
    save leaves there). A
    save replaces the whole folder, so a user's ``results.csv`` in ``ROOT/<next index>/`` or
    ``NOTES.md`` in an index replaced with ``checkpoint_index=`` was deleted without a word.
    A folder of fastckpt's files for an index the manifest does not name is replaced, with a
    logged warning (:func:`_warn_replacing_unnamed`).

    Raises:
        NotACheckpointError: names the folder, the files and the fix; nothing was written or
            deleted.
    """
    directory = root / str(index)
    committed = index in manifest.entries
    recorded = set(manifest.entries[index]["files"]) if committed else set()
    if is_local(backend):
        if os.path.islink(directory) or not os.path.isdir(directory):
            return  # a symlink is replaced alone, as before
        if committed:
            foreign = _unrecorded(str(directory), recorded)
        else:
            foreign = _not_written_by_fastckpt(directory)
    else:
        stored = _object_relpaths(backend, directory)
        if not stored:
            return
        if committed:
            foreign = [relpath for relpath in stored if relpath not in recorded]
        else:
            foreign = [relpath for relpath in stored if not _written_by_fastckpt(relpath)]
    if not foreign:
        if not committed:
            _warn_replacing_unnamed(directory, manifest, index)
        return
    what = f"committed index {index}" if committed else f"a folder named like index {index}"
    raise NotACheckpointError(
        f"{display_path(directory)}: {what} of the root holds {shown_names(foreign)}, "
        f"which fastckpt did not write; a save of index {index} replaces the whole folder and "
        "would delete them. Move them out of the folder, then save again (nothing was written "
        "or deleted)"
    )


def _warn_replacing_unnamed(directory: Path, manifest: Manifest, index: int) -> None:
    """Log (a warning) that the save of ``index`` replaces ``directory``, a folder of
    fastckpt's files that the manifest does not name. The save goes on: a save killed
    between putting its folder in place and committing the manifest leaves the same picture,
    and its next save of that index replaces the folder. But the folder may also hold a
    checkpoint committed after the ``manifest.json`` now in place (an older backup restored
    over the root): before, it was replaced without a word, and each later save replaced the
    next such folder."""
    latest = "none" if manifest.latest is None else str(manifest.latest)
    # A crash leaves a folder written after the manifest's last commit: routine, logged at
    # INFO (every preempted job would see a warning). A folder older than the manifest in
    # place is what a restored backup leaves: a warning (review 1: the first version warned
    # at every crash recovery).
    level = logging.INFO
    if is_local(backend_for(directory)):
        try:
            folder_time = os.stat(directory).st_mtime_ns
            manifest_time = os.stat(directory.parent / MANIFEST).st_mtime_ns
        except OSError:
            folder_time = manifest_time = 0
        if folder_time < manifest_time:
            level = logging.WARNING
    _LOG.log(
        level,
        "%s: index %d is not in %s (its latest index: %s), but this folder holds a "
        "checkpoint's files: a save interrupted before its commit left them, or they are a "
        "checkpoint saved after the %s now in place (an older backup restored over the "
        "root). This save replaces it; to keep such a folder, move it out of the root before "
        "saving again",
        display_path(directory),
        index,
        MANIFEST,
        latest,
        MANIFEST,
    )


def _object_relpaths(backend: StorageBackend, directory: Path) -> list[str]:
    """Every object's path under the prefix ``directory`` of an object store, relative to it
    (unfinished multipart uploads are not objects)."""
    found: list[str] = []
    pending: list[str] = [""]
    while pending:
        relative = pending.pop()
        here = directory / relative if relative else directory
        for name in backend.list_dir(here):
            relpath = f"{relative}/{name}" if relative else name
            try:
                regular = backend.stat(here / name).regular
            except FileNotFoundError:
                continue  # an unfinished multipart upload: a killed save's, deleted with it
            (found if regular else pending).append(relpath)
    return sorted(found)


def _holds_only_its_files(manifest: Manifest, index: int) -> bool:
    """Whether the local index folder of ``index`` holds only the files its entry records;
    if not (a user's notes, a checkpoint saved inside it by hand), a prune keeps the index
    and says why, rather than delete what fastckpt did not write."""
    directory = manifest.directory(index)
    if os.path.islink(directory) or not os.path.isdir(directory):
        return True  # a symlink is unlinked alone; _delete_index decides about its target
    recorded = {str(relpath) for relpath in manifest.entries[index]["files"]}
    foreign = _unrecorded(str(directory), recorded)
    if not foreign:
        return True
    message = (
        f"{display_path(directory)}: not pruned: it also holds {shown_names(foreign)}, which "
        "fastckpt did not write; move them out of the index folder, then prune again"
    )
    _LOG.warning("%s", message)
    warnings.warn(message, RuntimeWarning, stacklevel=4)
    return False


def _unrecorded(directory: str, recorded: set[str]) -> list[str]:
    """The files (and links) under ``directory`` that are not among the ``recorded`` paths."""
    found = []
    for here, folders, files in os.walk(directory):
        links = [name for name in folders if os.path.islink(os.path.join(here, name))]
        for name in (*files, *links):
            relpath = os.path.relpath(os.path.join(here, name), directory).replace(os.sep, "/")
            if relpath not in recorded:
                found.append(relpath)
    return sorted(found)


#: The files at the top of an index folder: the strategy's and its hooks' documents and
#: tensors, and the references of an incremental save.
_INDEX_DOCUMENTS = frozenset(
    {"strategy.json", "strategy.safetensors", "hooks.json", "hooks.safetensors", refs.REFS_FILE}
)


def _written_by_fastckpt(relpath: str) -> bool:
    """Whether ``relpath`` (``/``-separated, inside an index folder) is a name a save of an
    index writes: :data:`_INDEX_DOCUMENTS`, ``<kind>/<name><suffix>`` of a component kind
    (:data:`~fastckpt.format.records.COMPONENT_SUFFIXES`), or a linked file
    (``linked/<n>.safetensors``). Anything else (``results.csv``, ``eval.json``,
    ``export/model.safetensors``) is a user's."""
    parts = relpath.split("/")
    if len(parts) == 1:
        return parts[0] in _INDEX_DOCUMENTS
    if len(parts) != 2 or not parts[1]:
        return False
    folder, name = parts
    if folder == LINKED_DIR:
        return name.endswith(".safetensors") and name != ".safetensors"
    suffixes = COMPONENT_SUFFIXES.get(folder, ())
    return any(name.endswith(suffix) and name != suffix for suffix in suffixes)


def _not_written_by_fastckpt(directory: Path) -> list[str]:
    """The files (and links) under ``directory`` that no save of an index writes
    (:func:`_written_by_fastckpt`): an unnamed index folder holding any is not a leftover of an
    interrupted save, prune or replacement, and is never deleted as one."""
    found = []
    for here, folders, files in os.walk(directory):
        links = [name for name in folders if os.path.islink(os.path.join(here, name))]
        for name in (*files, *links):
            relpath = os.path.relpath(os.path.join(here, name), directory).replace(os.sep, "/")
            if name in links or not _written_by_fastckpt(relpath):
                found.append(relpath)
    return sorted(found)


def _holds_only(directory: str, recorded: set[str]) -> bool:
    """Whether every file (and link) under ``directory`` is one of the ``recorded`` paths."""
    return not _unrecorded(directory, recorded)


def _link_retained(root: Path, index: int) -> bool:
    """Make ``ROOT/.ref-<index>`` a copy of ``ROOT/<index>`` by hard links (no data copied),
    durably, leaving the index in place; False when links are not possible here."""
    directory = root / str(index)
    if not directory.is_dir() or directory.is_symlink():
        return False
    temp = temp_sibling(TEMP_PREFIX, root / f"ref-{index}")  # .tmp-ref-<index>~pid~host~rnd
    try:
        for source in sorted(directory.rglob("*")):
            target = temp / source.relative_to(directory)
            if source.is_dir() and not source.is_symlink():
                target.mkdir(parents=True, exist_ok=True)
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                os.link(source, target, follow_symlinks=False)
        temp.mkdir(exist_ok=True)
        for folder in sorted((p for p in temp.rglob("*") if p.is_dir()), reverse=True):
            _native.fsync_dir(str(folder))
        _native.fsync_dir(str(temp))
    except OSError:
        shutil.rmtree(temp, ignore_errors=True)
        return False
    retained = root / f"{refs.RETAINED_PREFIX}{index}"
    # A retained copy is whole or absent at every instant: an older one (of this index, still
    # committed) is renamed away before the new one takes its name, and deleted after.
    stale = temp_sibling(TEMP_PREFIX, root / f"gone-ref-{index}")
    replaced = os.path.lexists(retained)
    if replaced:
        os.rename(retained, stale)
    os.rename(temp, retained)
    _native.fsync_dir(str(root))
    if replaced:
        shutil.rmtree(stale, ignore_errors=True)
    return True


def _warn_pruned_folder_left(directory: Path, index: int, error: OSError) -> None:
    """Warn that pruned ``index`` (no longer in the manifest) left its folder ``directory``
    (a symlink, or its target, is left to be removed by hand: saves never follow one)."""
    if os.path.islink(directory):
        fate = "it is a symlink, which saves never follow: remove it (or its target) by hand"
    elif not os.path.lexists(directory):
        fate = "it was moved aside under a hidden name, which the next save into the root removes"
    else:
        fate = "the next save into the root removes it"
    warnings.warn(
        f"{display_path(directory)}: index {index} is pruned ({MANIFEST} no longer names it), "
        f"but its folder could not be moved aside or removed ({error}); {fate}",
        RuntimeWarning,
        stacklevel=3,
    )


def _delete_index(
    backend: StorageBackend, root: Path, directory: Path, committed: set[int], recorded: set[str]
) -> None:
    """Delete an index directory (and, when it is a symlink to a directory of the root that
    no committed index uses and that holds nothing but files the index recorded, its
    target: another checkpoint kept inside the root is never taken with it)."""
    if os.path.islink(directory):
        target = os.path.realpath(directory)
        limit = os.path.realpath(root).rstrip(os.sep) + os.sep
        directory.unlink()
        top = target[len(limit) :].split(os.sep, 1)[0] if target.startswith(limit) else ""
        ours = top and not top.startswith(".") and os.path.isdir(target)
        ours = ours and not (_is_index_name(top) and int(top) in committed)
        if ours and _holds_only(target, recorded):
            backend.delete(Path(target))
        else:
            _LOG.warning("pruned %s, a symlink; left its target %s", directory, target)
        return
    if isinstance(backend, LocalFileSystem) and os.path.isdir(directory):
        # Renamed away first: an index directory is whole or absent (a kill mid-deletion
        # leaves a temporary directory, never a partial ROOT/<index>).
        refs.remove_directory(root, directory)
    else:
        backend.delete(directory)
    if isinstance(backend, LocalFileSystem) and os.path.lexists(directory):
        raise OSError(
            errno.ENOTEMPTY, f"{directory}: pruned but could not be deleted", str(directory)
        )
