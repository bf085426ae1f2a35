"""``CheckpointManager``: async/sync saves of arbitrary training state, ``load(into=...)``.

A checkpoint is a directory (``checkpoint_id``). Each top-level key of the saved state becomes
``<key>.json`` (the structure, via :mod:`fastckpt.io.tree`) plus ``<key>.safetensors`` (its
tensors; ``<key>.rank<r>.safetensors`` per rank under a process group), and ``commit.json``
records every file with its size and crc32c. The directory is written as a temporary sibling
and swapped into place, so a reader sees the old checkpoint or the new one, never a mix.

Async saves stage a snapshot into reusable host buffers (:mod:`fastckpt.io.staging`), then a
single background thread writes it through the Rust core with the GIL released. Hold
:meth:`CheckpointManager.lock` around code that mutates the state (the optimizer step): it
blocks only while a capture is in progress.

Saves are incremental (``Config.incremental``, on by default): when the previous save of the
manager went to the same directory or a sibling, the tensors unchanged since then are not
written again but kept in hard links to that checkpoint's files, made inside the new one
(``linked/``), so that every checkpoint stays self-contained (see
:mod:`fastckpt.manager.incremental` and :mod:`fastckpt.container.links`); on an object store the
store copies them into the new checkpoint's objects (:mod:`fastckpt.storage.s3.copy`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fastckpt.container.background import BackgroundWriter, mark_committed
from fastckpt.container.commit import (
    DirectoryWriter,
    refuse_inside_checkpoint,
    refuse_to_replace,
)
from fastckpt.container.links import LINKED_DIR, Reference, read_item
from fastckpt.container.listing import saved_after_siblings
from fastckpt.container.promote_checkpoints import (
    CheckpointPromoter,
    NearestCheckpoint,
    committed_checkpoints,
    nearest_intact_checkpoint,
    prune_checkpoints,
    tier_dates,
    tier_left_behind,
)
from fastckpt.container.snapshot import read_consistently
from fastckpt.container.templates import check_disjoint_templates, check_strict
from fastckpt.errors import (
    CheckpointFormatError,
    CheckpointMismatchError,
    ChecksumMismatchError,
    FastCkptError,
    InvalidInputError,
    NotCommittedError,
)
from fastckpt.format.records import (
    COMMIT_RECORD,
    MAX_JSON_DEPTH,
    SHARDED_RECORD,
    check_item_key,
    commit_record,
    item_files,
    read_commit_record,
)
from fastckpt.io import tree
from fastckpt.io.forksafe import ForkSafeLock
from fastckpt.io.paths import check_name, safe_join
from fastckpt.io.progress import log_throughput
from fastckpt.io.staging import (
    Stager,
    StagerOptions,
    make_image_pool,
    make_stager,
    reserve_groups,
    stage_groups,
)
from fastckpt.manager.callbacks import callable_as_callback, run_callback
from fastckpt.manager.collective import (
    DistributedContext,
    RankPart,
    Turn,
    check_same_save,
    check_world_size,
    collective_failure,
    one_line,
    outcome_after,
    record_names,
)
from fastckpt.manager.config import (
    AsyncCheckpointSaverConfig,
    CheckpointLoaderConfig,
    CheckpointSaverConfig,
    CheckpointStagerConfig,
    CheckpointWriterConfig,
    ItemSpec,
    LocalFileSystemStorageConfig,
    StrictConfig,
    SyncCheckpointSaverConfig,
    TiersConfig,
)
from fastckpt.manager.incremental import LinkPlan, Tracker
from fastckpt.manager.load import DirectRead, check_tied_templates, plan_direct_read
from fastckpt.manager.stateful import (
    check_depth,
    check_nesting,
    check_restore,
    check_template,
    contains_stateful,
    prepare_save,
    restore,
)
from fastckpt.storage.access import read_refused
from fastckpt.storage.backend import LOCAL, LocalStaging, disk_refused, explain_full_disk
from fastckpt.storage.registry import (
    absolute,
    backend_for,
    check_path_argument,
    display_path,
    is_local,
    is_object_url,
    use_storage_options,
)

__all__ = [
    "AsyncCheckpointSaverConfig",
    "CheckpointLoaderConfig",
    "CheckpointManager",
    "CheckpointSaverConfig",
    "CheckpointStagerConfig",
    "CheckpointWriterConfig",
    "ItemSpec",
    "LocalFileSystemStorageConfig",
    "SyncCheckpointSaverConfig",
    "TiersConfig",
]


@dataclass
class _ManagerConfig(StrictConfig):
    """``CheckpointManager.Config``: per-item specs, saver, loader, storage and callbacks.

    Fields are checked when set (``ValueError``/``TypeError`` naming the field) and unknown
    attributes are refused (``config.finalize_calback = fn`` raises ``AttributeError``).

    Attributes:
        items: per top-level key :class:`ItemSpec`.
        default: spec for keys not in ``items``; ``None`` is strict mode (unknown keys refused).
        save: :class:`AsyncCheckpointSaverConfig` or :class:`SyncCheckpointSaverConfig`.
        load: :class:`CheckpointLoaderConfig`.
        storage_config: :class:`LocalFileSystemStorageConfig` (default when None).
        subprocess_init_fn / subprocess_init_args: only ``None`` / ``()``: fastckpt writes on a
            thread of this process, so there is no subprocess to initialize (run setup code
            before building the manager instead).
        pre_finalize_callback: ``fn(args)`` with a
            :class:`~fastckpt.manager.callbacks.CallbackArgs` (as torch_checkpointing 0.1.1
            calls it; ``args.path`` is where the files were written), or
            ``fn(checkpoint_id, logger)`` (its earlier form), called on every rank once this
            rank's files of a checkpoint are written and fsynced, before the checkpoint is
            committed (made visible). Unsharded state only: a sharded save refuses it.
        finalize_callback: ``fn(args)`` (``args.path``: the committed checkpoint) or
            ``fn(checkpoint_id, logger)`` (:mod:`fastckpt.manager.callbacks`), called on every
            rank once the
            checkpoint is durable and committed: before a sync ``save`` returns; for async
            saves on the writer thread, before the Future resolves. An exception in it fails
            that save like a write failure (raised by sync ``save``; for async, by the Future,
            or else once by the next ``save`` or ``close``). ``logger`` is the ``logging.Logger``
            ``"fastckpt.manager"`` (torch_checkpointing passes its EventLogger there).
        incremental: tensors unchanged since the manager's previous save (same directory or
            a sibling, or the ``base=`` of ``save``) are kept as hard links to that
            checkpoint's files instead of being written again (docs/incremental.md); on an
            object store the store copies them from that checkpoint's objects instead of
            this process uploading them. ``False`` writes every tensor of every save.
            DTensor state is always written in full (under a process group each rank links
            its own file).
        tiers: :class:`TiersConfig`: every save goes to a fast tier, every N-th is promoted
            to a durable one in the background, and :meth:`CheckpointManager.load_latest`
            restores the newest intact copy (docs/tiers.md). None (default): one tier, the
            checkpoint ids as given.
        collective: under an initialized process group of several ranks, whether this
            manager's saves are collective (True, the default): every rank calls ``save``
            with the same checkpoint id, writes its own files, and rank 0 commits them as
            one checkpoint once every rank's are in (a rank that does not join within
            ``checkpoint_write_barrier_timeout_sec`` fails the save, nothing committed).
            False: this manager is used by this process alone, as without a process group
            (rank 0 of one): the DDP pattern "only rank 0 saves" for state every rank holds
            alike; its checkpoints hold this rank's state only and load on any number of
            ranks. State holding DTensors is saved and loaded by every rank together (a
            ``ValueError`` here, nothing written or read). Building a manager and unsharded
            loads never wait for other ranks either way; ``load_latest`` of a collective
            manager does (every rank loads the same one). The gloo group of a collective
            manager is made at its first collective save, on the thread calling ``save``.
            A collective save that fails on one rank (its write, its
            ``pre_finalize_callback``) is aborted on every rank, nothing committed, the
            others' errors naming that rank; after a collective that failed (a rank that
            died or never called save) the manager refuses later saves at once: build a new
            one on every rank, or restart the job.
    """

    FIXED_AT_BUILD = frozenset({"save", "storage_config", "tiers", "collective"})

    items: dict[str, ItemSpec] = field(default_factory=dict)
    default: ItemSpec | None = field(default_factory=ItemSpec)
    save: AsyncCheckpointSaverConfig | SyncCheckpointSaverConfig = field(
        default_factory=AsyncCheckpointSaverConfig
    )
    load: CheckpointLoaderConfig = field(default_factory=CheckpointLoaderConfig)
    storage_config: LocalFileSystemStorageConfig | None = None
    subprocess_init_fn: Callable[..., None] | None = None
    subprocess_init_args: tuple[Any, ...] = ()
    pre_finalize_callback: Callable[..., None] | None = None
    finalize_callback: Callable[..., None] | None = None
    incremental: bool = True
    tiers: TiersConfig | None = None
    collective: bool = True

    def _check(self, name: str, value: Any) -> None:
        expected: dict[str, tuple[type, ...]] = {
            "tiers": (TiersConfig, type(None)),
            "save": (AsyncCheckpointSaverConfig, SyncCheckpointSaverConfig),
            "load": (CheckpointLoaderConfig,),
            "storage_config": (LocalFileSystemStorageConfig, type(None)),
            "default": (ItemSpec, type(None)),
        }
        if name in expected and not isinstance(value, expected[name]):
            kinds = " or ".join(kind.__name__ for kind in expected[name])
            raise TypeError(f"Config.{name} must be {kinds}, got {type(value).__name__}")
        if name == "items":
            if not isinstance(value, Mapping):
                raise TypeError(f"Config.items must be a dict of ItemSpec, got {value!r}")
            for key, spec in value.items():
                if not isinstance(spec, ItemSpec):
                    raise TypeError(
                        f"Config.items[{key!r}] must be an ItemSpec, got {type(spec).__name__}"
                    )
        if name in ("subprocess_init_fn", "subprocess_init_args") and value not in (None, ()):
            raise self._fail(
                name,
                "fastckpt writes on a background thread of this process; there is no "
                "subprocess to initialize: run the setup before building the manager",
            )
        if name in ("incremental", "collective"):
            self._need_bool(name, value)
        callbacks = ("pre_finalize_callback", "finalize_callback")
        if name in callbacks and value is not None and not callable(value):
            raise TypeError(f"Config.{name} must be callable or None, got {value!r}")
        if name in callbacks and value is not None and not callable_as_callback(value):
            raise TypeError(
                f"Config.{name} must take one argument (a CallbackArgs) or two "
                f"(checkpoint_id, logger); {value!r} takes neither"
            )

    def build(self) -> CheckpointManager:
        """A :class:`CheckpointManager` with this configuration."""
        return CheckpointManager(self)

    @classmethod
    def with_async_save(cls) -> _ManagerConfig:
        """Background writes; CUDA staging when CUDA is available, CPU staging otherwise."""
        return cls(save=AsyncCheckpointSaverConfig())

    @classmethod
    def with_sync_save(cls) -> _ManagerConfig:
        """Inline durable writes."""
        return cls(save=SyncCheckpointSaverConfig())


@dataclass
class _Snapshot:
    """One checkpoint ready to write: per item its skeleton and (staged) tensors."""

    path: Path
    skeletons: dict[str, Any]
    tensors: dict[str, dict[str, torch.Tensor]]
    checkpoint_id: str = ""
    plan: LinkPlan | None = None
    turn: Turn | None = None  # a collective save's (None: this process saves alone)


_LOGGER = logging.getLogger("fastckpt.manager")
#: the one tensor name a safetensors header cannot hold (its metadata entry)
_RESERVED_NAME = "__metadata__"


def _readable(checkpoint: Path) -> bool:
    """Whether ``checkpoint``'s commit record reads (what an earlier process left for its
    promotion to finish): one whose record is damaged can never be promoted, and queueing it
    failed the run that only restored (a ``PromotionError`` at close). It is named instead."""
    if not backend_for(checkpoint).exists(checkpoint / COMMIT_RECORD):
        return True  # a sharded checkpoint: its own record is read by the promotion
    try:
        read_commit_record(checkpoint)
    except (OSError, FastCkptError) as err:
        _LOGGER.warning("%s is not promoted: its commit record does not read (%s)", checkpoint, err)
        return False
    return True


def _record_callback_files(writer: DirectoryWriter) -> None:
    """Files a ``pre_finalize_callback`` wrote into a local staging directory (a run's
    config, metrics) are part of the checkpoint: made durable and listed in its record with
    their size and crc32c, so ``verify`` checks them and the next save of the id replaces
    them with the checkpoint (unlisted, they made it refuse the id as holding the user's
    files). On an object store the callback's objects stay unlisted."""
    if not isinstance(writer.staging, LocalStaging):
        return
    staging = Path(writer.staging.location)
    for directory, _, names in os.walk(staging):
        for name in names:
            path = Path(directory) / name
            relpath = path.relative_to(staging).as_posix()
            if relpath in writer.files or relpath == COMMIT_RECORD:
                continue  # the checkpoint's own files (its record is written after)
            if path.is_symlink() or not path.is_file():
                continue
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            size, crc = LOCAL.checksum(path)
            writer.files[relpath] = {"size": size, "crc32c": crc}


def _check_state_mapping(state: Any, argument: str) -> None:
    """A saved state (or a load's ``into``) is a mapping of item names to values.

    Raises:
        TypeError: it is not (a list of tensors, a lone tensor), naming the argument.
    """
    if not isinstance(state, Mapping):
        raise TypeError(
            f"CheckpointManager {argument} must be a mapping of item names to values (e.g. "
            f"{{'model': model.state_dict(), 'step': step}}), got {type(state).__name__}"
        )


# Messages and pickles name it as users reach it.
_ManagerConfig.__name__ = "Config"
_ManagerConfig.__qualname__ = "CheckpointManager.Config"


class CheckpointManager:
    """Saves and loads training state; see the module docstring for the on-disk format.

    Example:
        >>> manager = CheckpointManager(CheckpointManager.Config.with_async_save())
        >>> future = manager.save("ckpt/step_100", {"model": model.state_dict(), "step": 100})
        >>> manager.close()  # waits until the last checkpoint is durable
    """

    Config = _ManagerConfig

    def __init__(self, config: _ManagerConfig | None = None) -> None:
        """Create a manager (``config`` defaults to ``Config()``: async saves)."""
        self.config = config or _ManagerConfig()
        if not isinstance(self.config, _ManagerConfig):
            raise TypeError(
                f"CheckpointManager takes a CheckpointManager.Config, got {type(config).__name__}"
            )
        self._async = isinstance(self.config.save, AsyncCheckpointSaverConfig)
        staging = (
            self.config.save.staging_config
            if isinstance(self.config.save, AsyncCheckpointSaverConfig)
            else CheckpointStagerConfig()
        )
        self._async_staging = self._async and staging.use_async_staging
        self._stager_options = StagerOptions(
            pinned=staging.use_pinned_memory, non_blocking=staging.use_non_blocking_copy
        )
        self._stager: Stager = make_stager(self._stager_options)
        # Async captures copy each file's tensors into a file image the writer writes as is.
        self._images = make_image_pool(self._stager_options)
        self._dcp_writer: Any = None  # fastckpt.dcp.Writer, made at the first sharded save
        storage = self.config.storage_config or LocalFileSystemStorageConfig()
        self._direct_io = storage.use_direct_io
        self._storage_options = storage.storage_options
        self._threads = self.config.save.writer_config.file_write_max_threads
        self._dist = DistributedContext(
            self.config.save.writer_config.checkpoint_write_barrier_timeout_sec,
            collective=self.config.collective,
        )
        self._writer: BackgroundWriter[None] | None = (
            BackgroundWriter("fastckpt-writer", wait_timeout=self.config.save.wait_timeout_secs)
            if self._async
            else None
        )
        self._tracker = Tracker()
        # Saves from several threads take turns: an async manager tracks one write at a
        # time (a second thread's save raced past the check and failed).
        self._save_turn = threading.RLock()  # a finalize_callback may save again
        self._closed = False
        # Held to submit a write and to close: a save racing close() on another thread is
        # either collected by it or refused as closed, never left running after it.
        self._closing_lock = ForkSafeLock()
        # Set once the close() that closes this manager is done: a close() on another
        # thread meanwhile waits for it.
        self._close_done = threading.Event()
        # What the close() that closed this manager raised (None: nothing): a close() on
        # another thread that waited for it says so too.
        self._close_error: BaseException | None = None
        # ``active`` on the thread inside close(): a close() on that thread meanwhile is a
        # signal handler interrupting it.
        self._closing_here = threading.local()
        # ``active`` on the thread running a sync save's finalize_callback: a close() on
        # another thread waits for that save, so a close() from the callback must not wait
        # for that close.
        self._saving_here = threading.local()
        #: Where :meth:`load_latest` restored from (None before it ran).
        self.restored_from: NearestCheckpoint | None = None
        self._tiers: tuple[Path, Path] | None = None
        self._promoter: CheckpointPromoter | None = None
        #: The fast tier's last checkpoint this process applied keep_last after (see
        #: :meth:`_settle_fast_tier`).
        self._last_tier_save: Path | None = None
        self._saves = 0  # saves committed by this manager (tiers: which ones are promoted)
        self._collective_saves = 0  # collective saves asked for (Turn.number)
        # Where this manager's process group failed ("PATH (why)"): later saves refused.
        self._broken: str | None = None
        if self.config.tiers is not None:
            self._start_tiers(self.config.tiers)
        # What was read above is fixed while this manager is open: a change is refused, not
        # ignored (released by close()).
        self._fixed = [
            part
            for part in (
                self.config,
                self.config.save,
                self.config.save.writer_config,
                staging,
                self.config.storage_config,
                self.config.tiers,
            )
            if part is not None
        ]
        for part in self._fixed:
            part.mark_built()
        _MANAGERS.add(self)

    def _after_fork(self) -> None:
        """In the child of ``os.fork()``, where only the forking thread exists: a save's turn
        a parent thread may have held at the fork is made anew (the hand-over lock and the
        staging pools' locks are :class:`~fastckpt.io.forksafe.ForkSafeLock`; the buffers are
        kept: no CUDA call, which a forked child cannot make), and a close() a parent thread
        had under way counts as done (the manager is closed here; the parent's write is the
        parent's, see :class:`~fastckpt.container.background.BackgroundWriter`). Before, the
        child's first save waited forever for a thread that does not exist."""
        self._save_turn = threading.RLock()
        closing_here = getattr(self._closing_here, "active", False)
        self._close_done = threading.Event()
        if self._closed and not closing_here:
            self._close_done.set()

    def _start_tiers(self, tiers: TiersConfig) -> None:
        """Check the tiers, start their promoter, and (the saving rank) queue the fast
        tier's newest checkpoint: a promotion a killed process left unfinished is finished
        in the background (one the durable tier already holds is not copied again)."""
        fast, durable = tiers.roots()
        if tiers.durable_storage_options is not None:
            use_storage_options(durable, tiers.durable_storage_options, "TiersConfig")
        self._tiers = (fast, durable)
        self._promoter = CheckpointPromoter(
            fast,
            durable,
            keep_last=tiers.durable_keep_last,
            strict=tiers.strict,
            on_error=tiers.on_error,
            detached=tiers.detached,
        )
        if self._dist.rank == 0:
            names = committed_checkpoints(fast)
            if names and not self._fast_left_behind(fast, durable) and _readable(fast / names[-1]):
                self._promoter.submit_checkpoint(names[-1])

    @staticmethod
    def _fast_left_behind(fast: Path, durable: Path) -> bool:
        """Whether the fast tier is left from an earlier run (its newest checkpoint older than
        a durable one it lacks, see
        :func:`~fastckpt.container.promote_checkpoints.left_behind`): then its newest is not
        promoted at start, where it would become the durable tier's newest and push the run's
        real newest out of the durable retention. A durable tier that cannot be listed does
        not stop the manager (the promotion reports it)."""
        try:
            here, there = tier_dates(fast), tier_dates(durable)
        except (OSError, FastCkptError):
            return False
        ahead, _ = tier_left_behind([here], there)
        if ahead is None:
            return False
        _LOGGER.warning(
            "%s looks left from an earlier run: %s holds %s, saved after every checkpoint "
            "of it; its newest is not promoted (latest() takes the durable one)",
            display_path(fast),
            display_path(durable),
            ahead,
        )
        return True

    @property
    def promoter(self) -> CheckpointPromoter | None:
        """The background promotion to the durable tier (None without tiers)."""
        return self._promoter

    @property
    def promotion_healthy(self) -> bool:
        """False while the last promotion to the durable tier failed (True without tiers)."""
        return self._promoter is None or self._promoter.healthy

    def _tier_path(self, checkpoint_id: str | Path) -> Path:
        """Where ``checkpoint_id`` is saved: as given, or with tiers ``fast/<name>``."""
        if self._tiers is None:
            return Path(checkpoint_id)
        fast = self._tiers[0]
        path = Path(checkpoint_id)
        if len(path.parts) == 1 and not path.is_absolute():
            return fast / path
        if os.path.realpath(path.parent) == os.path.realpath(fast):
            return path
        raise ValueError(
            f"{checkpoint_id}: with tiers, save takes a checkpoint name (e.g. 'step_100') or a "
            f"path directly inside the fast tier {display_path(fast)}"
        )

    def _promote_due(self, path: Path) -> None:
        """After a save committed ``path`` (tiers, the saving rank): queue it for promotion
        when due, then apply the fast tier's retention (sparing what waits for promotion)."""
        tiers, promoter = self.config.tiers, self._promoter
        if tiers is None or promoter is None or self._dist.rank != 0:
            return
        due = self._saves % tiers.promote_every == 0
        self._saves += 1
        if due:
            promoter.submit_checkpoint(path.name)
        if tiers.keep_last is not None:
            self._last_tier_save = path
            # The newest checkpoint waiting for promotion is kept (one more on the fast tier
            # while the durable one lags or is down), and so is every one the running
            # promotion copies (else a promotion slower than a few saves lost its checkpoint
            # at every run and the durable tier fell behind for good); older waiting ones
            # may go (superseded).
            try:
                with promoter.retention():  # no promotion chooses meanwhile
                    spare = {path.name, *promoter.queued()[-1:], *promoter.in_flight()}
                    prune_checkpoints(path.parent, tiers.keep_last, spare=spare)
            except (OSError, FastCkptError) as err:  # the save itself is committed
                _LOGGER.warning(
                    "%s: the fast tier's keep_last=%d failed (%s); the next save retries",
                    display_path(path.parent),
                    tiers.keep_last,
                    err,
                )

    def _settle_fast_tier(self) -> None:
        """The fast tier's ``keep_last`` once more after the last promotion ended (at close,
        when it succeeded): what a promotion was copying at the last save was spared then,
        so the fast tier kept one checkpoint more than ``keep_last`` after the run. A failure
        here is logged: every save is committed and promoted."""
        tiers, promoter, newest = self.config.tiers, self._promoter, self._last_tier_save
        self._last_tier_save = None
        if tiers is None or tiers.keep_last is None or promoter is None or newest is None:
            return
        if not promoter.healthy:
            return
        try:
            prune_checkpoints(newest.parent, tiers.keep_last, spare={newest.name})
        except (OSError, FastCkptError) as err:
            _LOGGER.warning(
                "%s: the fast tier's keep_last=%d after the last promotion failed (%s); the "
                "next run's first save applies it",
                display_path(newest.parent),
                tiers.keep_last,
                err,
            )

    def latest(self) -> NearestCheckpoint:
        """The newest checkpoint that verifies on the tiers (the fast tier first; the
        durable one when the fast copy is gone or damaged), with what was passed over.

        Raises:
            ValueError: the manager has no tiers (``Config.tiers``).
            NotCommittedError: no tier holds an intact checkpoint (says what was skipped).
        """
        if self._tiers is None:
            raise ValueError(
                "CheckpointManager.latest needs Config.tiers (without tiers, checkpoint ids "
                "are yours to order: load one by its id)"
            )
        return nearest_intact_checkpoint(self._tiers)

    def load_latest(
        self,
        into: Mapping[str, Any] | None = None,
        *,
        map_location: str | torch.device | None = None,
        strict: bool = False,
    ) -> dict[str, Any]:
        """:meth:`load` the checkpoint :meth:`latest` picks; where it came from is kept in
        :attr:`restored_from` and logged (a warning when a newer copy was skipped).

        Under ``torch.distributed`` it is collective (every rank calls it) and every rank
        loads the same checkpoint: when the ranks' :meth:`latest` differ (a tier one rank
        cannot see, a promotion committed between their looks), the first of their choices,
        in rank order, that every rank holds intact is loaded, and the others are reported
        as skipped; a load of different checkpoints on different ranks would mix their
        states.

        Raises:
            NotCommittedError: under ``torch.distributed``, no checkpoint any rank chose is
                held intact by every rank (names what each rank holds).
            what :meth:`latest` and :meth:`load` raise.
        """
        self._check_open("load")
        nearest = self._agreed_latest()
        log = _LOGGER.warning if nearest.skipped else _LOGGER.info
        log("%s", nearest.describe())
        result = self.load(nearest.path, into, map_location=map_location, strict=strict)
        self.restored_from = nearest
        return result

    def _agreed_latest(self) -> NearestCheckpoint:
        """:meth:`latest`, the same checkpoint on every rank (see :meth:`load_latest`)."""
        if not self._dist.active:
            return self.latest()
        if self._writer is not None:  # its commit's collectives use the same group
            self._writer.settle("CheckpointManager.load_latest")
        try:
            mine: NearestCheckpoint | None = self.latest()
            problem = None
        except NotCommittedError as err:
            mine, problem = None, str(err)
        chosen: list[str | None] = self._load_gather(None if mine is None else mine.name)
        if mine is not None and all(name == mine.name for name in chosen):
            return mine
        candidates = list(dict.fromkeys(name for name in chosen if name is not None))
        if not candidates:  # no rank holds any (the same on every rank: no collective left)
            raise NotCommittedError(str(problem))
        copies: dict[str, NearestCheckpoint] = {} if mine is None else {mine.name: mine}
        for name in candidates:
            if name in copies:
                continue  # this rank's own pick: verified by latest() just now
            with contextlib.suppress(NotCommittedError):
                copies[name] = nearest_intact_checkpoint(self._tiers or [], name)
        holdings: list[list[str]] = self._load_gather(sorted(copies))
        for name in candidates:
            if all(name in held for held in holdings):
                copy = copies[name]
                others = sorted({n for n in chosen if n is not None and n != name})
                if others:
                    copy.skipped.append(f"{', '.join(others)}: not intact on every rank")
                return copy
        seen = "; ".join(
            f"rank {rank}: latest {name or 'none'}, holds {held or 'none'}"
            for rank, (name, held) in enumerate(zip(chosen, holdings, strict=True))
        )
        raise NotCommittedError(
            f"the ranks hold no intact checkpoint in common ({seen})"
            + (f"; this rank: {problem}" if problem else "")
            + ": every rank must see the same tiers (a fast tier every rank sees, the same "
            "durable tier)"
        )

    def _load_gather(self, value: Any) -> list[Any]:
        """:meth:`_agreed_latest`'s gather, its failure explained: a rank that never called
        ``load_latest`` (rank 0 evaluating alone) left gloo's bare timeout.

        Raises:
            RuntimeError: the collective failed (chained): names the rule and the fixes.
        """
        try:
            return self._dist.gather(value)
        except Exception as err:
            raise RuntimeError(
                f"CheckpointManager.load_latest under a process group of "
                f"{self._dist.world_size} ranks is collective (every rank loads the same "
                f"checkpoint, agreed among them), and its collective failed "
                f"({type(err).__name__}: {err}): another rank did not call load_latest within "
                f"checkpoint_write_barrier_timeout_sec ({self._dist.timeout_secs:g} s), died, "
                "or left the group. Nothing was loaded. Call it on every rank, or load on one "
                "rank alone with a manager built with Config.collective=False (or "
                "load(checkpoint_id) of a checkpoint named by hand)"
            ) from err

    # ------------------------------------------------------------------ context manager

    def __enter__(self) -> CheckpointManager:
        """Use as ``with CheckpointManager(...) as manager:``; closes on exit."""
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        """Wait for the last write and close. Leaving the block by an exception, a failure
        of that close (a background write's) is logged, not raised: it would replace the
        exception the block raised."""
        if kind is None:
            self.close()
            return
        try:
            self.close()
        except Exception:
            _LOGGER.exception(
                "CheckpointManager: closing on the way out of an exception (%s) failed",
                kind.__name__,
            )

    # ------------------------------------------------------------------ save

    def _check_open(self, action: str) -> None:
        if self._closed:
            raise RuntimeError(f"CheckpointManager is closed; cannot {action}")

    def _submit(
        self, what: str, write: Callable[[], None], capture: Callable[[], None] | None = None
    ) -> Future[None]:
        """Hand ``write`` to the background writer, unless the manager was closed meanwhile
        (by another thread: ``RuntimeError`` as for a save after close)."""
        assert self._writer is not None
        with self._closing_lock:
            self._check_open("save")
            return self._writer.submit(what, write, capture=capture)

    def _check_required(
        self, directory: Path, available: list[str], into: Mapping[str, Any] | None
    ) -> None:
        """Every item ``Config.items`` declares required (and the load asks for) is in the
        checkpoint.

        Raises:
            CheckpointMismatchError: names the missing items and the checkpoint.
        """
        if into is None and self.config.default is None:
            undeclared = [key for key in available if key not in self.config.items]
            if undeclared:
                raise KeyError(
                    f"{directory}: item(s) {undeclared} have no ItemSpec and Config.default is "
                    "None (strict mode); add them to Config.items, or load(into=...) naming "
                    "only declared items"
                )
        wanted = self.config.items if into is None else {k: self.config.items.get(k) for k in into}
        missing = [
            key
            for key, spec in wanted.items()
            if spec is not None and spec.required and key not in available
        ]
        if missing:
            raise CheckpointMismatchError(
                f"{directory}: required item(s) {missing} are not in the checkpoint (it holds "
                f"{sorted(available)}); declare them ItemSpec(required=False) to load without"
            )

    def _spec(self, key: str) -> ItemSpec:
        spec = self.config.items.get(key, self.config.default)
        if spec is None:
            raise KeyError(
                f"state key {key!r} has no ItemSpec and Config.default is None (strict mode); "
                f"add it to Config.items or set Config.default"
            )
        if not isinstance(spec, ItemSpec):  # put into Config.items in place, unchecked
            raise TypeError(
                f"Config.items[{key!r}] must be an ItemSpec, got {type(spec).__name__} "
                f"({spec!r}); e.g. ItemSpec(requires_copy=False)"
            )
        return spec

    def save(
        self,
        checkpoint_id: str | Path,
        state: Mapping[str, Any],
        *,
        base: str | Path | None = None,
    ) -> Future[None] | None:
        """Save ``state`` as checkpoint directory ``checkpoint_id`` (replaced atomically).

        With ``Config.incremental`` (the default), the tensors unchanged since this
        manager's previous save are hard links to that checkpoint's files when it is the
        same directory or a sibling of ``checkpoint_id`` (or ``base``): deleting it later
        does not affect this one (docs/incremental.md).

        Args:
            checkpoint_id: directory path of the checkpoint.
            state: top-level keys become files; values are nests of tensors and plain values,
                and objects with ``state_dict()`` / ``load_state_dict()`` (modules,
                optimizers, schedulers, your own classes), saved as their ``state_dict()``.
            base: reference this checkpoint's unchanged tensors even when it is not a
                sibling of ``checkpoint_id``; it must be this manager's previous save (None:
                the previous save when it is a sibling, else a full write).

        Returns:
            Async: a Future resolved when the checkpoint is durable. Sync: None.

        Raises:
            RuntimeError: the manager is closed, or the previous background write failed
                and its Future did not deliver the failure (``result()`` raising it or
                ``exception()`` returning it): each failure is raised once; the next save
                works.
            TimeoutError: the previous background write is still running after
                ``wait_timeout_secs`` (nothing new is started; it stays tracked).
            ValueError / KeyError / TypeError: invalid keys or values, or a ``base`` that is
                not the previous save or with ``Config.incremental`` False (nothing written).

        Threads may share a manager: their saves take turns (each waits for the previous
        one's write as a save on one thread does). A save inside :meth:`lock` on the same
        thread is refused (a ``RuntimeError``): it would wait for itself.
        """
        self._check_open("save")
        if self._writer is not None and self._writer.held_by_this_thread():
            raise RuntimeError(
                "cannot start a save of the CheckpointManager inside its lock() on the same "
                "thread: the snapshot waits until the lock is released, so the save (and its "
                "wait for the previous save) would wait for itself, or mix two moments. Save "
                "outside the lock"
            )
        with self._save_turn:
            return self._save(checkpoint_id, state, base)

    def _save(
        self, checkpoint_id: str | Path, state: Mapping[str, Any], base: str | Path | None
    ) -> Future[None] | None:
        """:meth:`save`, one thread at a time. A collective save that fails on this rank
        before its gather still takes part in it (:meth:`_join_failed`)."""
        self._check_open("save")
        turn = self._begin_collective_save(checkpoint_id) if self._dist.active else None
        try:
            return self._save_turn_of(checkpoint_id, state, base, turn)
        except Exception as err:  # not Ctrl-C: it must not wait for the others' gather
            if turn is not None:
                self._join_failed(Path(os.fspath(checkpoint_id)), turn, err)
            raise

    def _save_turn_of(
        self,
        checkpoint_id: str | Path,
        state: Mapping[str, Any],
        base: str | Path | None,
        turn: Turn | None,
    ) -> Future[None] | None:
        """:meth:`_save` of the collective save ``turn`` (None: not collective)."""
        _check_state_mapping(state, "state")
        check_path_argument(checkpoint_id, "CheckpointManager.save")
        path = self._tier_path(checkpoint_id)
        if self._tiers is None:
            use_storage_options(checkpoint_id, self._storage_options, "CheckpointManager.save")
        if self._writer is not None:
            self._writer.wait_timeout = self.config.save.wait_timeout_secs  # read live
            try:
                self._writer.collect()
            except TimeoutError:
                raise  # the previous write is still running (perhaps in a collective)
            except BaseException:
                if turn is not None and not self._writer.busy:
                    turn.may_join = True  # its failure raised once: the writer is idle
                raise
            if turn is not None:
                turn.may_join = True  # no write of this manager is in a collective now
                self._refuse_if_broken(checkpoint_id)  # the write just collected may have
        # its length: see _sibling; '.' or 'runs/..' name no folder of their own
        check_name(path.name, f"checkpoint directory name of {os.fspath(checkpoint_id)!r}")
        # Resolved now: an async write after the caller changed directory still goes where
        # the save was asked for.
        path = absolute(path)
        refuse_to_replace(path)
        refuse_inside_checkpoint(path)
        prepared: dict[str, Any] = {}
        for key, value in state.items():
            check_item_key(key)
            self._spec(key)
            check_nesting(value, key)
            prepared[key] = prepare_save(value, key)
        for key, spec in self.config.items.items():
            if spec.required and key not in state:
                raise KeyError(f"required item {key!r} is missing from the saved state")
        # Object stores have no hard links: full writes there.
        incremental = self.config.incremental
        if base is not None and not self.config.incremental:
            raise ValueError("save(base=...) needs Config.incremental = True")
        if base is not None:
            base = absolute(base)  # as path: resolved now, not when the write runs
            self._tracker.base_for(path, base)  # raises before anything is captured
        if self._dist.active:
            # The manager's group is made here, on the saving thread (see
            # DistributedContext.group), before anything is written: when the other ranks
            # never call save, it fails after the barrier timeout, saying so.
            with self._collective(path, lambda: (False, " (nothing of it was written)")):
                self._dist.make_group()
        if _sharded_state(prepared):
            self._tracker.forget()
            if self.config.pre_finalize_callback is not None:
                raise ValueError(
                    "Config.pre_finalize_callback is not supported for sharded (DTensor) state: "
                    "its files are committed by fastckpt.dcp in one step; use finalize_callback"
                )
            return self._save_sharded(path, prepared, str(checkpoint_id), turn)
        skeletons: dict[str, Any] = {}
        tensors: dict[str, dict[str, torch.Tensor]] = {}
        for key, value in prepared.items():
            skeletons[key], tensors[key], depth = tree.flatten_measured(value)
            check_depth(depth, key, MAX_JSON_DEPTH - 1)  # as written: {"skeleton": ...}
            if _RESERVED_NAME in tensors[key]:  # refused here, not later by the writer
                raise InvalidInputError(
                    f"{tree.join_path(key, _RESERVED_NAME)}: the tensor name {_RESERVED_NAME!r} "
                    "is reserved by the safetensors format; rename that key"
                )
        snapshot = _Snapshot(path, skeletons, tensors, str(checkpoint_id), turn=turn)
        if not incremental:
            self._tracker.forget()

        def plan() -> None:
            # Every tensor is fingerprinted before it is copied; those whose fingerprint
            # did not move are candidates, linked at the write if their digest matches.
            if incremental:
                snapshot.plan = self._tracker.plan(path, base, snapshot.tensors)

        if self._writer is None:
            plan()
            try:
                # Device tensors go through the same pinned buffers and side-stream copies as
                # an async save (one synchronization) instead of one pageable .cpu() copy each.
                stage_groups(
                    self._stager,
                    snapshot.tensors,
                    lambda key, name: snapshot.tensors[key][name].device.type != "cpu",
                )
                self._write(snapshot)
            finally:
                if snapshot.plan is not None:
                    snapshot.plan.close()
            self._promote_due(path)
            self._finalize(snapshot.checkpoint_id, path)
            return None

        def capture() -> None:
            plan()
            try:
                stage_groups(
                    self._stager,
                    snapshot.tensors,
                    lambda key, _: self._spec(key).requires_copy,
                    self._images,
                )
            except BaseException:
                if snapshot.plan is not None:
                    snapshot.plan.close()
                raise

        if not self._async_staging:
            self._writer.capture(capture)

        def write() -> None:
            try:
                self._write(snapshot)
            finally:
                if snapshot.plan is not None:
                    snapshot.plan.close()
            try:
                self._promote_due(path)
                self._finalize(snapshot.checkpoint_id, path)
            except BaseException as err:
                mark_committed(err)  # reported as a failure after the commit, not a lost save
                raise

        background_capture: Callable[[], None] | None = capture if self._async_staging else None
        if background_capture is not None and turn is not None:
            # A capture that fails on the background thread skips the write, and with it
            # this rank's part of the gather: the write runs and takes part with the failure.
            captured: list[BaseException] = []
            capture_alone, write_alone = capture, write

            def capture_noted() -> None:
                try:
                    capture_alone()
                except BaseException as err:
                    captured.append(err)

            def write_or_join() -> None:
                if captured:
                    self._join_failed(path, turn, captured[0])
                    raise captured[0]
                write_alone()

            background_capture, write = capture_noted, write_or_join
        try:
            future = self._submit(display_path(path), write, capture=background_capture)
        except BaseException:
            if snapshot.plan is not None:
                snapshot.plan.close()  # the write that would have closed it never runs
            raise

        def closed_if_cancelled(done: Future[None]) -> None:
            # A write cancelled before it started never runs its ``finally``: the base files
            # a capture opened for hard links are closed here instead.
            if done.cancelled() and snapshot.plan is not None:
                snapshot.plan.close()

        future.add_done_callback(closed_if_cancelled)
        return future

    def _save_sharded(
        self, path: Path, state: dict[str, Any], checkpoint_id: str, turn: Turn | None
    ) -> Future[None] | None:
        """Save state holding DTensors as a sharded checkpoint through :mod:`fastckpt.dcp`
        (collective: every rank saves its own shards; the coordinator commits)."""
        from fastckpt.dcp.state import (
            async_save_state,
            differing_entries,
            replicated_digests,
            save_state,
        )

        if self._dist.alone:
            raise ValueError(
                f"CheckpointManager.save of {display_path(path)}: state holding DTensors is "
                "saved by every rank together (each writes its own shards), but this manager "
                "is used by this rank alone (Config.collective=False); save it with a "
                "collective manager on every rank (nothing was saved)"
            )
        if self._dist.active and turn is not None:
            # DCP keeps one copy of every entry that is not a DTensor: ranks holding their
            # own values there (a loader's position, RNG states) would all load one rank's.
            part = RankPart(turn.number, None, True, replicated_digests(state))
            turn.joined = True  # after the part is built: a failure above joins as such
            with self._collective(path, lambda: (False, " (nothing of it was written)")):
                parts = self._dist.gather(part)
            self._check_parts(path, parts)
            differing = differing_entries([part.payload for part in parts])
            if differing:
                shown = ", ".join(differing[:5]) + (", ..." if len(differing) > 5 else "")
                raise ValueError(
                    f"CheckpointManager.save of {display_path(path)}: state holding DTensors "
                    "is saved as one sharded checkpoint, which keeps a single copy of every "
                    f"entry that is not a DTensor, but the ranks hold different values at "
                    f"{shown}; file per-rank values under a key of each rank's own (e.g. "
                    "state['loader'] = {f'rank{rank}': position}, loaded the same way), or "
                    "save them in a checkpoint without DTensors (nothing was saved)"
                )
        writer = self._sharded_writer(path)
        if self._writer is None:
            with _typed_dcp_errors():
                save_state(path, state, writer=writer, process_group=self._dist.group)
            self._drop_unsharded(path)
            self._promote_due(path)
            self._finalize(checkpoint_id, path)
            return None
        # DCP stages this rank's shards into the writer's reused buffers before returning;
        # the manager's background thread then tracks the upload like any other write, so
        # collect(), wait_timeout_secs and close() treat both kinds alike.
        with _typed_dcp_errors():
            future = async_save_state(path, state, writer=writer, process_group=self._dist.group)

        def wait() -> None:
            with _typed_dcp_errors():
                future.result()
            self._drop_unsharded(path)
            self._promote_due(path)
            self._finalize(checkpoint_id, path)

        return self._submit(display_path(path), wait)

    def _drop_unsharded(self, path: Path) -> None:
        """After a sharded save committed at ``path`` (rank 0): remove the unsharded checkpoint
        an earlier save left there, its ``commit.json`` first (its files are then no
        checkpoint's). Left, ``verify`` checked those stale files while loads read the sharded
        one, and the next unsharded save took them for the user's."""
        backend = backend_for(path)
        if self._dist.rank != 0 or not backend.exists(path / COMMIT_RECORD):
            return
        try:
            listed = list(read_commit_record(path)["files"])
        except (OSError, FastCkptError):
            listed = []
        backend.delete(path / COMMIT_RECORD)
        for relpath in listed:
            with contextlib.suppress(OSError, FastCkptError, ValueError):
                backend.delete(safe_join(path, relpath))
        if is_local(backend):
            with contextlib.suppress(OSError):
                (path / LINKED_DIR).rmdir()

    def _sharded_writer(self, path: Path) -> Any:
        """The manager's one :class:`fastckpt.dcp.Writer` (its staging buffers are reused)."""
        if self._dcp_writer is None:
            from fastckpt.dcp.writer import Writer

            self._dcp_writer = Writer(
                path,
                threads=self._threads,
                direct_io=self._direct_io,
                stager_options=self._stager_options,
                replace_unsharded=True,  # a save of an id replaces whatever kind it held
            )
        return self._dcp_writer

    def _finalize(self, checkpoint_id: str, path: Path) -> None:
        """Run ``Config.finalize_callback`` (the checkpoint at ``path``, where ``checkpoint_id``
        was saved: inside the fast tier with tiers, is durable and committed)."""
        if self.config.finalize_callback is None:
            return
        # A sync save's callback runs on the saving thread, holding the save turn: a close()
        # from it must not wait for another thread's close, which waits for this save.
        sync = self._writer is None
        outer = getattr(self._saving_here, "active", False)  # a callback saving again
        self._saving_here.active = sync or outer
        try:
            run_callback(
                self.config.finalize_callback,
                checkpoint_id=checkpoint_id,
                path=display_path(path),
                storage=backend_for(path),
                logger=_LOGGER,
            )
        finally:
            self._saving_here.active = outer

    def prewarm_staging(self, state: Mapping[str, Any]) -> None:
        """Allocate the staging buffers a save of ``state`` will reuse, now.

        Async managers copy ``requires_copy`` items into reusable host buffers (pinned when
        ``use_pinned_memory``); the first save otherwise pays for allocating them. Call it
        with the state you will save (same keys, shapes and dtypes); it waits for a write in
        flight first (``wait_timeout_secs``), since that write may still read the buffers.
        A synchronous manager writes the live tensors and has no buffers: it returns at once.

        Raises:
            RuntimeError: the manager is closed, or the previous background write failed.
            TimeoutError: the previous background write is still running.
            ValueError: ``state`` holds DTensors (fastckpt.dcp's writer allocates their
                buffers at the first sharded save), or invalid keys/values as for ``save``.
        """
        self._check_open("prewarm staging")
        _check_state_mapping(state, "prewarm_staging state")
        if self._writer is None:
            return
        self._writer.wait_timeout = self.config.save.wait_timeout_secs  # read live
        self._writer.collect()
        prepared = {}
        for key, value in state.items():
            check_item_key(key)
            self._spec(key)
            check_nesting(value, key)
            prepared[key] = prepare_save(value, key)
        if _sharded_state(prepared):
            raise ValueError(
                "prewarm_staging covers unsharded state; DTensor state is staged by "
                "fastckpt.dcp's writer, which allocates its buffers at the first save"
            )
        groups = {key: tree.flatten(value)[1] for key, value in prepared.items()}

        def reserve() -> None:
            reserve_groups(
                self._stager, groups, lambda key, _: self._spec(key).requires_copy, self._images
            )

        self._writer.capture(reserve)

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """Hold while mutating saved state; blocks only while a capture is in progress."""
        if self._writer is None:
            yield
            return
        with self._writer.guard():
            yield

    def _tensor_file(self, key: str) -> str:
        return (
            f"{key}.rank{self._dist.rank}.safetensors"
            if self._dist.active
            else f"{key}.safetensors"
        )

    def _write(self, snapshot: _Snapshot) -> None:
        try:
            with explain_full_disk(snapshot.path):
                self._write_checkpoint(snapshot)
        except BaseException as err:
            if snapshot.turn is not None:  # this rank's part failed: every rank is told
                self._join_failed(snapshot.path, snapshot.turn, err)
            raise

    def _write_checkpoint(self, snapshot: _Snapshot) -> None:
        start = time.perf_counter()
        final = snapshot.path
        writer = DirectoryWriter(final, direct_io=self._direct_io, threads=self._threads)
        plan = snapshot.plan
        refs: dict[str, dict[str, Reference]] = {}
        try:
            if plan is not None:
                # The content proof: digests of the bytes about to be written.
                plan.confirm(snapshot.tensors)
            for key, skeleton in snapshot.skeletons.items():
                if plan is not None:
                    # The hard links first: a file that cannot be linked adds its tensors
                    # to the ones written below.
                    stem = f"{key}.rank{self._dist.rank}" if self._dist.active else key
                    refs[key] = plan.link(writer, key, snapshot.tensors[key], stem)
                copies = None if plan is None else plan.copies.get(key)
                writer.add_tensors(self._tensor_file(key), snapshot.tensors[key], copies)
                # Every rank's plain values (a loader's position, RNG states) are its own.
                rank = self._dist.rank
                name = f"{key}.json" if rank == 0 else f"{key}.rank{rank}.json"
                writer.add_json(name, {"skeleton": skeleton})
            if self.config.pre_finalize_callback is not None:
                run_callback(
                    self.config.pre_finalize_callback,
                    checkpoint_id=snapshot.checkpoint_id,
                    path=writer.staging.location,
                    storage=writer.backend,
                    logger=_LOGGER,
                )
                _record_callback_files(writer)
            record_refs = {self._tensor_file(key): names for key, names in refs.items() if names}
            self._commit(writer, list(snapshot.skeletons), record_refs, snapshot.turn)
        except BaseException as err:
            writer.abort()
            if plan is not None and plan.refs and not disk_refused(err):
                # The next save is full: its base may be the cause. Not for a full disk: a
                # retry once space is freed links the unchanged tensors again (before, it
                # wrote everything and needed about twice the space of the failed save).
                self._tracker.forget()
            raise
        if plan is not None:
            # Committed: from now on the next save may link this checkpoint's files.
            own = {key: writer.stored_relpath(self._tensor_file(key)) for key in snapshot.skeletons}
            try:
                identities = (
                    writer.staging.identities if isinstance(writer.staging, LocalStaging) else None
                )
                self._tracker.record(final, plan, writer.files, own, refs, identities)
            except OSError as err:  # e.g. the checkpoint was deleted at once
                self._tracker.forget()
                _LOGGER.info("%s: not tracked for incremental saves (%s)", final, err)
        linked = set() if plan is None else set(plan.linked)
        written = [record for relpath, record in writer.files.items() if relpath not in linked]
        log_throughput("saved", str(final), written, start)

    def _commit(
        self,
        writer: DirectoryWriter,
        items: list[str],
        refs: Mapping[str, Mapping[str, Reference]] | None = None,
        turn: Turn | None = None,
    ) -> None:
        if not self._dist.active or turn is None:
            saved = saved_after_siblings(writer.final)
            record = commit_record(items, writer.files, 1, refs, saved_ns=saved)
            writer.add_json(COMMIT_RECORD, record)
            writer.commit()
            return
        # Each rank staged its own files; rank 0 gathers the files records, adopts every
        # rank's files and commits once all ranks are done, then tells every rank whether it
        # did. A rank whose part failed gives its error instead (_join_failed): no rank
        # commits. A gather that fails is never committed: rank 0 commits only with every
        # rank's part of it (a rank's files equal to the record already there prove nothing).
        final = writer.final
        rank = self._dist.rank
        payload = (writer.location, writer.files, dict(refs or {}), str(final), sorted(items))
        part = RankPart(turn.number, None, False, payload)
        turn.joined = True
        with self._collective(final, lambda: (False, "")):
            parts = self._dist.gather(part)
        self._check_parts(final, parts)  # alike on every rank: all raise, or none
        gathered = [part.payload for part in parts]
        check_same_save(gathered)
        every_file = {
            relpath: entry for _, files, *_ in gathered for relpath, entry in files.items()
        }
        failure: BaseException | None = None
        outcome: tuple[bool | None, str] = (True, "")
        if rank == 0:
            try:
                merged: dict[str, dict[str, Reference]] = {}
                for location, files, rank_refs, _, _ in gathered:
                    if location != writer.location:
                        writer.adopt(location, files)  # with the rank's linked files
                    merged.update({relpath: dict(names) for relpath, names in rank_refs.items()})
                saved = saved_after_siblings(final)
                world = self._dist.world_size
                record = commit_record(items, writer.files, world, merged, saved_ns=saved)
                writer.add_json(COMMIT_RECORD, record)
                writer.commit()
            except BaseException as err:  # told to the other ranks, then raised here
                failure = err
                outcome = (outcome_after(err, final, writer.files), one_line(err))
        if failure is not None:
            # rank 0's own error is the one to raise
            with contextlib.suppress(RuntimeError), self._collective(final, lambda: outcome):
                self._dist.gather(outcome)
            raise failure
        with self._collective(
            final, lambda: (True, "") if rank == 0 else record_names(final, every_file)
        ):
            told = self._dist.gather(outcome if rank == 0 else None)
        if rank == 0:
            return
        writer.abort()  # what rank 0 did not adopt
        committed, why = told[0]
        if not committed:
            raise RuntimeError(
                f"{display_path(final)}: CheckpointManager.save under a process group: rank 0 "
                f"could not commit this save ({why}); "
                + (
                    "nothing of it was committed: the previous checkpoint stands. Rank 0's "
                    "error says what to fix; then save again on every rank"
                    if committed is False
                    else f"it may have been committed: check it with `fastckpt verify "
                    f"{display_path(final)}`"
                )
            )

    def _check_parts(self, path: Path, parts: list[RankPart]) -> None:
        """Every rank's part of the gather of a collective save of ``path`` belongs to the
        same save (the same :attr:`Turn.number`), none failed, and all are sharded or none.
        Checked alike on every rank (each holds every part).

        Raises:
            RuntimeError: the ranks are out of step (a save that failed or was skipped on
                one rank only before its gather: the manager cannot save collectively any
                more, see :meth:`_begin_collective_save`), or a rank's part failed (naming
                the ranks and their errors): nothing of this save is committed on any rank.
            ValueError: some ranks save DTensor state, others not.
        """
        where = display_path(path)
        numbers = [part.number for part in parts]
        if len(set(numbers)) > 1:
            differing = ", ".join(
                f"rank {rank} at its save {number}" for rank, number in enumerate(numbers)
            )
            why = (
                f"the ranks were out of step ({differing} of this manager: a save failed or "
                "was skipped on some ranks only before its collective, e.g. a TimeoutError "
                "waiting for the previous write, or one rank called save once more)"
            )
            self._broken = f"{where} ({why})"
            raise RuntimeError(
                f"{where}: CheckpointManager.save under a process group: {why}; their parts "
                "belong to different saves, so nothing of this save was committed on any rank "
                "(the previous checkpoint stands). This manager cannot save collectively any "
                "more: restart the job from the last committed checkpoint, or build a new "
                "CheckpointManager on every rank (at the same point of the run)"
            )
        failed = [(rank, part.failure) for rank, part in enumerate(parts) if part.failure]
        if failed:
            named = "; ".join(f"rank {rank}: {failure}" for rank, failure in failed)
            raise RuntimeError(
                f"{where}: CheckpointManager.save under a process group was aborted on every "
                f"rank: the part of rank(s) {', '.join(str(rank) for rank, _ in failed)} "
                f"failed ({named}); nothing of this save was committed: the previous "
                "checkpoint stands. Fix what failed there (that rank's own error says what), "
                "then save again on every rank"
            )
        kinds = {part.sharded for part in parts}
        if len(kinds) > 1:
            sharded = [rank for rank, part in enumerate(parts) if part.sharded]
            raise ValueError(
                f"{where}: CheckpointManager.save under a process group: rank(s) {sharded} "
                "save state holding DTensors, the others do not; every rank must save the "
                "same items (nothing was committed)"
            )

    def _join_failed(self, path: Path, turn: Turn, err: BaseException) -> None:
        """This rank's part of the collective save ``turn`` (of ``path``) failed with ``err``
        before its gather: take part in the gather with the failure, so that the other ranks
        abort this save too (before, their gather paired with this rank's next save: a
        checkpoint of two saves). ``err`` gets a note saying what every rank did."""
        if turn.joined or not turn.may_join or self._broken is not None:
            return
        turn.joined = True
        try:
            with self._collective(path, lambda: (False, "")):
                parts = self._dist.gather(RankPart(turn.number, one_line(err), False, None))
            self._check_parts(path, parts)
        except (RuntimeError, ValueError) as told:
            err.add_note(str(told))

    def _begin_collective_save(self, checkpoint_id: str | Path) -> Turn:
        """Count a collective save of ``checkpoint_id`` (before anything can fail: a save
        one rank skips puts its ranks out of step, which the next gather finds).

        Raises:
            RuntimeError: an earlier collective of this manager failed (a gloo group is not
                usable after that), or its ranks went out of step: at once, nothing written.
        """
        self._refuse_if_broken(checkpoint_id)
        self._collective_saves += 1
        # A rank may join a gather now when no write of this manager can be in a collective
        # (sync, or its previous write done): a bad argument fails the save on every rank.
        idle = self._writer is None or not self._writer.busy
        return Turn(self._collective_saves, may_join=idle)

    def _refuse_if_broken(self, checkpoint_id: str | Path) -> None:
        """Raise at once when an earlier collective of this manager failed (see
        :meth:`_begin_collective_save`)."""
        if self._broken is not None:
            raise RuntimeError(
                f"{os.fspath(checkpoint_id)}: CheckpointManager.save refused at once: this "
                f"manager's process group failed at the save of {self._broken}; a "
                "torch.distributed group is not usable after one of its collectives failed, "
                "so every later collective save of this manager would fail too. Nothing of "
                "this save was written; the checkpoints committed before are intact. Restart "
                "the job from the last committed checkpoint, or build a new CheckpointManager "
                "on every rank (at the same point of the run) and save with it"
            )

    @contextlib.contextmanager
    def _collective(
        self, path: Path, outcome: Callable[[], tuple[bool | None, str]]
    ) -> Iterator[None]:
        """Run a collective of the save of ``path``: torch.distributed's ``RuntimeError`` (a
        rank that died, or never called save) is raised again as :func:`collective_failure`
        words it, with ``outcome()`` (whether the save was committed, asked then), chained,
        and marked committed (:func:`mark_committed`) when it was. The manager's group is
        then marked failed (:meth:`_begin_collective_save` refuses later saves)."""
        try:
            yield
        except FastCkptError:
            raise
        except RuntimeError as err:
            # gloo's group is not usable after a failed collective: later saves say so at once
            self._broken = f"{display_path(path)} ({one_line(err)})"
            committed, detail = outcome()
            failure = collective_failure(path, err, self._dist.timeout_secs, committed, detail)
            if committed:
                mark_committed(failure)
            raise failure from err

    # ------------------------------------------------------------------ load

    def load(
        self,
        checkpoint_id: str | Path,
        into: Mapping[str, Any] | None = None,
        *,
        map_location: str | torch.device | None = None,
        strict: bool = False,
    ) -> dict[str, Any]:
        """Load a checkpoint, optionally into templates.

        Args:
            checkpoint_id: the checkpoint directory.
            into: ``{key: template}``; only the template's keys/indices are loaded. Tensor
                leaves are filled in place (dtype and shape must match; plain contiguous CPU
                tensors are read into directly, with no mapping and no copy: see
                :mod:`fastckpt.manager.load`), non-tensor leaves are replaced, objects with
                ``load_state_dict()`` are restored through it (their tensors checked first),
                and a ``None`` template loads the whole item. ``None`` loads all.
            map_location: device for tensors that are not copied into a template.
            strict: raise on keys a template has but the checkpoint lacks, and on saved
                tensors a template leaves out (an optimizer's ``param_groups`` excepted).

        Returns:
            ``{key: value}`` for each loaded item.

        Raises:
            RuntimeError: the manager is closed.
            TypeError: a template value a load cannot apply, or templates sharing part of
                their memory, by key path (nothing is read).
            KeyError: strict mode (``Config.default`` None) and an item without an
                ``ItemSpec``: named in ``into``, or held by the checkpoint (without ``into``).
            CheckpointMismatchError: dtype/shape mismatch, a module's key set, or (strict) a
                missing key or a left-out tensor, by key path: checked for every item against
                the headers before any template is written into, so every template is left
                untouched.
            CheckpointFormatError / ChecksumMismatchError: damaged files, naming file and
                tensor. Nothing is returned; when templates were read into by then (direct
                reads), the message names every one (the last perhaps in part): load a good
                checkpoint into them before using them.
            FileNotFoundError: no such checkpoint.

        Any other exception, an interrupt (``KeyboardInterrupt``) included, raised after a
        template was written into carries a note naming those templates.
        """
        self._check_open("load")
        check_strict(strict, "CheckpointManager.load")
        use_storage_options(checkpoint_id, self._storage_options, "CheckpointManager.load")
        start = time.perf_counter()
        directory = Path(checkpoint_id)
        self._wait_for_own_write(directory)
        ties: list[list[str]] = []
        if into is not None:
            _check_state_mapping(into, "into")
            for key, template in into.items():
                self._spec(key)  # strict mode (Config.default None): only declared items
                check_template(template, key)
            ties = check_disjoint_templates(into)
        if _is_sharded(directory):
            if self.config.items or self.config.default is None:  # read only to check items
                from fastckpt.dcp.state import stored_items  # torch.distributed.checkpoint

                self._check_required(directory, stored_items(directory), into)
            return self._load_sharded(directory, into, map_location, strict)

        rank = self._dist.rank
        # The items whose templates were written into (or are being), in order: a load that
        # fails or is interrupted after the first says so.
        written: list[str] = []

        def read_all() -> tuple[dict[str, Any], dict[str, Any]]:
            # The record and every item it names, as one snapshot (nothing applied yet).
            # Every template of every item is checked before any is written into: a
            # mismatch of a later item leaves the earlier items' templates untouched too.
            record = read_commit_record(directory)
            available = record["items"]
            self._check_required(directory, available, into)
            requested = [k for k in (available if into is None else into) if k in available]
            check_world_size(directory, record, self._dist.world_size, requested)
            if strict and into is not None:
                for key in into:
                    if key not in available:
                        raise CheckpointMismatchError(f"{key}: not in checkpoint {directory}")
            keys = [k for k in (available if into is None else into) if k in available]
            templates = {key: None if into is None else into[key] for key in keys}
            plans = {  # each checks its template against the headers (nothing read yet)
                key: _plan_checked_item(directory, record, key, rank, templates[key], strict)
                for key in keys
            }
            values: dict[str, Any] = {
                key: _load_checked_item(directory, record, key, rank, map_location, self.config)
                for key in keys
                if plans[key] is None
            }
            for key, value in values.items():
                if templates[key] is not None:
                    check_restore(templates[key], value, key, strict)
            check_tied_templates(ties, templates, plans, values)
            for key, plan in plans.items():
                if plan is not None:
                    _move_to_end(written, key)
                    values[key] = plan.load(map_location)
            return record, values

        try:
            # A save replacing this checkpoint while it is read: read again (bounded).
            record, values = read_consistently(directory / COMMIT_RECORD, read_all)
            available = record["items"]
            keys = list(available) if into is None else list(into)
            result: dict[str, Any] = {}
            for key in keys:
                if key not in available:
                    if into is not None:
                        result[key] = into[key]
                    continue
                template = None if into is None else into[key]
                if template is not None and not isinstance(template, (bool, int, float, str)):
                    _move_to_end(written, key)  # filled in place, or its load_state_dict runs
                result[key] = restore(template, values[key], key, strict)
        except (ChecksumMismatchError, CheckpointFormatError) as err:
            if not written:
                raise
            # Damage found while reading into the templates: say so where the user reads it.
            raise type(err)(f"{err}; {_written_into(directory, written)}") from err
        except BaseException as err:  # an interrupt, a load_state_dict's refusal
            if written:
                err.add_note(
                    f"CheckpointManager.load of {display_path(directory)} stopped part-way; "
                    f"{_written_into(directory, written)}"
                )
            raise
        log_throughput("loaded", str(directory), record["files"].values(), start)
        return result

    def _wait_for_own_write(self, directory: Path) -> None:
        """Wait for this manager's background write when it writes ``directory``: a load
        right after an async ``save`` of the same id read the previous checkpoint there, or
        raised "not a committed fastckpt checkpoint" for a new id, instead of the state just
        saved. The write's failure stays for the next save or close to raise, as usual (the
        load then reads what the id holds). A write of another id is not waited for."""
        writer = self._writer
        if writer is None or not writer.busy:
            return
        if writer.in_flight == display_path(absolute(directory)):
            writer.settle(
                f"CheckpointManager.load of {display_path(directory)}",
                "it writes the checkpoint this load reads",
            )

    def _load_sharded(
        self,
        directory: Path,
        into: Mapping[str, Any] | None,
        map_location: str | torch.device | None,
        strict: bool,
    ) -> dict[str, Any]:
        """Load a sharded checkpoint (collective): templates are filled in place, DTensors
        resharded onto their own placements; stateful objects get ``load_state_dict()``.

        Raises:
            ValueError: this manager is used by this rank alone (``Config.collective=False``
                under a process group of several ranks): DCP's load is collective, and the
                other ranks would never join it (nothing read).
        """
        from fastckpt.dcp.state import load_state

        if self._dist.alone:
            raise ValueError(
                f"CheckpointManager.load of {display_path(directory)}: a sharded (DTensor) "
                "checkpoint is loaded by every rank together (each reads its own shards), but "
                "this manager is used by this rank alone (Config.collective=False), and the "
                "other ranks would never join its collective load; load it with a collective "
                "manager on every rank (nothing was read)"
            )
        if self._dist.active and self._writer is not None:  # its collectives: same group
            self._writer.settle("CheckpointManager.load of a sharded checkpoint")
        # A module goes as it is, so that load_state applies its key set as the unsharded
        # load does (a grown or wrapped model is refused); other templates as their state.
        templates = (
            None
            if into is None
            else {
                key: value
                if isinstance(value, torch.nn.Module)
                else prepare_save(value, key, check=False)
                for key, value in into.items()
            }
        )
        with _typed_dcp_errors():
            loaded = load_state(directory, templates, strict=strict, process_group=self._dist.group)
        result: dict[str, Any] = {}
        for key, value in loaded.items():
            template = None if into is None else into[key]
            if template is None:
                result[key] = _to_location(value, map_location)
            elif contains_stateful(template):
                result[key] = restore(template, value, key, strict)
            else:
                result[key] = value  # the template itself, filled in place
        return result

    # ------------------------------------------------------------------ close

    def close(self) -> None:
        """Wait until the last checkpoint is durable, then release the writer. Idempotent.

        A save running on another thread is waited for (a sync manager's too); saves after
        close() are refused.

        A manager never closed still has its last write finished at interpreter exit (a
        failure then is named on stderr); closing reports it here instead.

        A close() while another thread's close() is under way waits until that one is done;
        when that one raised (the last write failed), so does this one, a ``RuntimeError``
        saying so, chained to the failure. A close() in a signal handler that
        interrupted this thread inside close() cannot wait for that close: it waits for the
        last write itself (committed when it returns, in the fast tier with tiers: the
        promotion is left to the interrupted close) and raises its failure, which the
        interrupted close then does not raise again.

        Raises:
            RuntimeError: the last background write failed (chained to its error) and its
                Future did not deliver the failure; or called inside this thread's own
                ``lock()`` while a save waits for it (the manager stays open: close it
                outside the lock).
        """
        if self._close_done.is_set():
            return
        if getattr(self._closing_here, "active", False):
            # A signal handler interrupting this thread's close(), which goes on only once
            # the handler returns: waiting for it would wait forever.
            if self._writer is not None:
                self._writer.collect_reentrant()
            return
        if self._writer is not None:
            self._writer.check_closable()  # inside its own lock(): refused, still open
        self._closing_here.active = True
        closing = False
        try:
            with self._closing_lock:
                closing = not self._closed
                self._closed = True
            if closing:
                self._close()
            elif self._writer is None and getattr(self._saving_here, "active", False):
                # In a sync save's finalize_callback (its checkpoint is committed): the close
                # under way on another thread waits for this save to end; waiting for it here
                # would wait forever. It completes once this save returns.
                print(
                    "fastckpt: CheckpointManager.close() called from a finalize_callback "
                    "while another thread closes the manager: returning; that close "
                    "finishes once this save returns",
                    file=sys.stderr,
                )
                return
            else:
                self._close_done.wait()  # another thread closes: done when it is
                if self._close_error is not None:
                    raise RuntimeError(
                        "this CheckpointManager was closed by a close() on another thread, "
                        f"which reported: {self._close_error}"
                    ) from self._close_error
        finally:
            self._closing_here.active = False
            if closing:
                self._close_done.set()  # even when interrupted before _close() ran

    def _close(self) -> None:
        """:meth:`close`, run by the one close() that closes the manager (its failure kept
        for the close() calls of other threads waiting for it)."""
        try:
            if self._writer is None:
                # A sync save another thread is running ends first (its turn): before, close()
                # returned at once and that save committed after it, or never, when the
                # documented SIGTERM pattern (close(); os._exit(0)) followed. Saves after this
                # are refused (the manager is closed). On this thread's own save (a signal
                # handler inside it), the re-entrant turn does not wait.
                with self._save_turn:
                    pass
            for part in self._fixed:
                part.release_built()
            try:
                if self._writer is not None:
                    self._writer.close()
            finally:
                self._tracker.forget()  # releases the storages held for the next save
                if self._promoter is not None:
                    self._promoter.close()  # the last promotion's failure: PromotionError
                    self._settle_fast_tier()
        except BaseException as err:
            self._close_error = err
            raise


#: Every manager of this process, for :func:`_forget_parent_threads` after a fork.
_MANAGERS: weakref.WeakSet[CheckpointManager] = weakref.WeakSet()


def _forget_parent_threads() -> None:
    """In the child of ``os.fork()``: see :meth:`CheckpointManager._after_fork`."""
    for manager in list(_MANAGERS):
        manager._after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_parent_threads)


def _sharded_state(state: Mapping[str, Any]) -> bool:
    """Whether a (prepared) state holds DTensors, i.e. must be saved through DCP."""
    if "torch.distributed.tensor" not in sys.modules:
        return False  # nobody made a DTensor in this process
    from fastckpt.dcp.state import contains_dtensors

    return contains_dtensors(state)


@contextlib.contextmanager
def _typed_dcp_errors() -> Iterator[None]:
    """Re-raise DCP's ``CheckpointException`` (a ``BaseException`` that ``except Exception``
    misses) as :func:`fastckpt.dcp.state.typed_dcp_error` picks the error a rank raised (a
    fastckpt error such as ``ChecksumMismatchError`` naming the file, else an ``OSError``
    such as a full disk's, naming the checkpoint and the fix), chained; the same on every
    rank, since DCP gathers the failures. When no rank raised an ``Exception``: a
    ``RuntimeError`` carrying DCP's per-rank report."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as err:
        from fastckpt.dcp.state import typed_dcp_error

        failure = typed_dcp_error(err)
        if failure is err:
            raise RuntimeError(str(err)) from err
        raise failure from err


def _is_sharded(directory: Path) -> bool:
    """Whether ``directory`` holds a sharded commit record: anything by its name, so that a
    FIFO or a link in its place is refused by the sharded reader, not taken for a missing
    ``commit.json``."""
    record = directory / SHARDED_RECORD  # the name only: no torch.distributed import
    if is_object_url(record):
        return backend_for(record).exists(record)
    try:
        return record.is_symlink() or record.exists()
    except PermissionError as err:  # a folder this user may not search: say so, naming it
        raise read_refused(directory, err) from err


def _to_location(value: Any, map_location: str | torch.device | None) -> Any:
    if map_location is None:
        return value
    return tree.map_tensors(value, lambda tensor: tensor.to(map_location))


def _load_item(
    directory: Path,
    record: Mapping[str, Any],
    key: str,
    rank: int,
    map_location: Any,
    use_mmap: bool = True,
) -> Any:
    """One item of a checkpoint: its skeleton and this rank's tensors, both verified
    (``use_mmap=False``: copied out of the file mapping)."""
    skeleton, tensors = read_item(directory, record, key, rank)
    if map_location is not None or not use_mmap:
        tensors = {
            name: t.to(map_location or t.device, copy=not use_mmap) for name, t in tensors.items()
        }
    return tree.unflatten(skeleton, tensors, key)


def _plan_checked_item(
    directory: Path, record: Mapping[str, Any], key: str, rank: int, template: Any, strict: bool
) -> DirectRead | None:
    """The direct read of item ``key`` into ``template`` (:func:`plan_direct_read`, which
    checks the template against the headers first), or None: no template, an object store,
    or no template tensor that can take one (the item is then loaded by
    :func:`_load_checked_item`). Malformed skeletons raise as there."""
    if template is None or is_object_url(directory):
        return None
    with _malformed_item(directory, record, key, rank):
        return plan_direct_read(directory, record, key, rank, template, strict)


def _move_to_end(keys: list[str], key: str) -> None:
    """Put ``key`` last in ``keys`` (appended, or moved there): the item written into last
    (a load read again after a save replaced the checkpoint writes into ``a`` again after
    ``b``) is the one that may hold partial bytes."""
    if key in keys:
        keys.remove(key)
    keys.append(key)


def _written_into(directory: Path, keys: list[str]) -> str:
    """What a load of checkpoint ``directory`` that stopped part-way left in the templates of
    items ``keys`` (written into in this order, the last one perhaps in part), and how to
    get intact templates back."""
    given = ", ".join(f"{key!r}: ..." for key in keys)
    parent = display_path(directory.parent)
    return (
        f"the templates given in into={{{given}}} were already read into, the last one "
        "perhaps in part (it may hold partial bytes), the others in full: load an intact "
        "checkpoint into all of them before using them (an earlier checkpoint of the run: "
        f"`fastckpt ls {parent}` lists them, `fastckpt verify {parent}` checks them; with "
        "Config.tiers, CheckpointManager.load_latest() loads the newest intact copy)"
    )


def _load_checked_item(
    directory: Path,
    record: Mapping[str, Any],
    key: str,
    rank: int,
    map_location: Any,
    config: Any,
) -> Any:
    """:func:`_load_item`, with the malformed-skeleton errors of a hostile item JSON (whose
    checksum was re-sealed) as :class:`CheckpointFormatError` naming the file."""
    with _malformed_item(directory, record, key, rank):
        return _load_item(directory, record, key, rank, map_location, config.load.use_mmap)


@contextlib.contextmanager
def _malformed_item(
    directory: Path, record: Mapping[str, Any], key: str, rank: int
) -> Iterator[None]:
    """Turn the errors a malformed item skeleton causes into :class:`CheckpointFormatError`
    naming the item's file and field."""
    where = directory / item_files(record, key, rank)[0]
    try:
        yield
    except CheckpointFormatError as err:
        if str(directory) in str(err):
            raise
        raise CheckpointFormatError(f"{where}: field 'skeleton': {err}") from err
    except FastCkptError:
        raise
    except (AttributeError, KeyError, TypeError, ValueError, IndexError) as err:
        raise CheckpointFormatError(
            f"{where}: field 'skeleton' is malformed ({type(err).__name__}: {err}); the "
            "checkpoint was edited or is damaged"
        ) from err
