"""``CheckpointHook``: periodic strategy checkpoints, written in the background.

At its cadence the hook takes a snapshot of the strategy (JSON documents built at once; tensor
references collected), copies the tensors that can change outside the optimizer step (model
buffers) immediately, and hands the rest to a single background thread. That thread copies
parameters, optimizer and hook state into reusable staging buffers and then writes the index
through the Rust core. The strategy holds :meth:`CheckpointHook.guard` around its optimizer
step, so the copy overlaps the next forward/backward instead of stalling training. The
staging buffers are allocated before training starts (and after the first step, for state it
creates), not at the first save: see :meth:`CheckpointHook.prewarm_staging`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any, NoReturn

import fastckpt.checkpoint.build as build
from fastckpt.checkpoint.components import Snapshot, plan_incremental, write_snapshot
from fastckpt.container.background import BackgroundWriter, report_tolerated
from fastckpt.container.commit import committed_here, prune_indices
from fastckpt.container.promote import Promoter, RankPromoter
from fastckpt.container.refs import root_key
from fastckpt.container.sharded.promote import node_local_root
from fastckpt.errors import FastCkptError, MixedRunError, PromotionError, StateChangedError
from fastckpt.format.records import Manifest
from fastckpt.io.staging import (
    Stager,
    StagerOptions,
    make_image_pool,
    make_stager,
    reserve_groups,
    stage_groups,
)
from fastckpt.storage.registry import absolute, display_path, use_storage_options
from fastckpt.training.hooks.context import TrainContext, TrainingStage
from fastckpt.training.replicas import data_parallel_over_world
from fastckpt.training.sharded import remove_sharded, share_commit

__all__ = ["CheckpointHook"]

_LOG = logging.getLogger(__name__)


def _positive(name: str, value: int | None) -> int | None:
    """Refuse a count that is no int (``TypeError``) or not positive (``ValueError``)."""
    if value is None:
        return value
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"CheckpointHook {name} must be a positive integer, got {value!r}")
    if value <= 0:
        raise ValueError(f"CheckpointHook {name} must be a positive integer, got {value!r}")
    return value


def _flag(name: str, value: object) -> None:
    """Refuse a non-bool flag: ``async_save="no"`` is truthy, and saved asynchronously."""
    if not isinstance(value, bool):
        raise TypeError(f"CheckpointHook {name} must be a bool, got {value!r}")


def _callback(name: str, value: object) -> None:
    """Refuse an error callback that is neither callable nor None: ``on_save_error=3`` was
    stored, and the first failed save then raised ``'int' object is not callable``."""
    if value is not None and not callable(value):
        raise TypeError(f"CheckpointHook {name} must be callable or None, got {value!r}")


def _seconds(name: str, value: object, least: str) -> None:
    """Refuse a timeout that is no number (``"5"``: ``TypeError``, as ``save_checkpoint``
    does), or NaN / below its bound (``least``: ``"> 0"`` or ``">= 0"``: ``ValueError``)."""
    if value is None:
        return
    message = f"CheckpointHook {name} must be a number of seconds {least} or None, got {value!r}"
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(message)
    if not (value > 0 if least == "> 0" else value >= 0):
        raise ValueError(message)


def _replicas_over_world(ctx: TrainContext) -> bool:
    """Whether the run's models are unsharded DDP replicas over every rank of a process
    group of more than one rank (a sharded strategy's, or a rank's own models, are not)."""
    import torch.distributed as dist

    if getattr(ctx.workflow, "sharded", False):
        return False
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return False
    world = dist.get_world_size()
    return any(data_parallel_over_world(model, world) for model in ctx.models.values())


class CheckpointHook:
    """Save a restartable ``TrainingStrategy`` checkpoint every N steps or N epochs.

    Args:
        checkpoint_dir: checkpoint root (positional or keyword, not both).
        step_interval: save after every N completed optimizer steps (AFTER_BATCH).
        epoch_interval: save after every N completed epochs (AFTER_EPOCH). Exactly one of the
            two intervals must be given.
        async_save: capture on the training thread, write on a background thread.
        rank_zero_only: under a process group, only global rank 0 writes (unsharded state;
            a strategy with FSDP2-sharded models is saved by every rank, each its shards).
        keep_last: after each save keep only the newest N indices (None keeps all).
        save_last: at the end of ``run`` (AFTER_TRAINING), save once more when the run
            advanced past the last saved step (``num_steps=10, step_interval=3`` saves step
            10 too); ``keep_last`` applies to that save as well. False saves only on the
            cadence.
        incremental: each save writes only the tensors that changed since the hook's previous
            save (the others are references to bytes already on disk, which ``keep_last``
            keeps while referenced; see docs/incremental.md). False writes everything.
        wait_timeout_secs: how long a save waits for the previous background write (None:
            as long as it takes); a write still running then raises ``TimeoutError`` and stays
            tracked, its outcome reported by a later save or by ``close``.
        lock_timeout: how long a save or ``keep_last`` prune waits for another process that
            holds the root's lock (who holds it is logged after a second); then the save fails
            with ``TimeoutError`` naming the holder. None (default) waits as long as it takes.
        durable_dir: a second root (a shared filesystem, ``s3://``) that the checkpoints of
            ``checkpoint_dir`` (then the fast tier: node-local disk, ``/dev/shm``) are promoted
            to in the background, verified, commit last (see docs/tiers.md). None: one tier.
        promote_every: promote the indices that are multiples of N (default 1: every one).
        durable_keep_last: keep only the newest N indices of ``durable_dir`` (None: all).
        strict_promotion: a failed promotion raises
            :class:`~fastckpt.errors.PromotionError` at the next save; by default it is
            reported (a warning, :attr:`promotion_healthy`, ``on_promotion_error``), retried
            by the next save, and raised by ``close``.
        on_promotion_error: called with each failed promotion's
            :class:`~fastckpt.errors.PromotionError` (on the promotion thread; not recorded
            in the checkpoint, so a hook rebuilt on resume has none).
        detached_promotion: run the promotions in a process of its own (a new session,
            started at the first one, kept until ``close``), which a SIGKILL or Ctrl-C of
            the trainer does not stop: it finishes the promotion it is in by itself instead
            of leaving it to the next process (see :mod:`fastckpt.container.detached`).
        strict_saves: a failed save raises at once (sync) or at the next save (async). False:
            it is reported (a ``RuntimeWarning``, :attr:`healthy`, ``on_save_error``),
            training goes on, the next checkpoint is attempted as usual, and ``close`` raises
            the failure unless a later save succeeded. None (default): False with a
            ``durable_dir`` (a fast tier that fails must not stop a run the durable tier
            keeps safe), True otherwise. Sharded strategies always raise (their saves are
            collective: the ranks must agree). An async save not committed because tensors
            changed in place outside the optimizer step while it copied them
            (:class:`~fastckpt.errors.StateChangedError`) is always reported, never raised:
            later saves copy those tensors when they are taken.
        on_save_error: called with each failed save's exception when saves are not strict
            (not recorded in the checkpoint).

    With a ``durable_dir``, ``keep_last`` never deletes the newest fast-tier index that is
    due for promotion (a multiple of ``promote_every``) and not yet seen on the durable tier:
    a promotion lagging behind the saves, or a durable tier that is down, costs one more
    index on the fast tier instead of the durable copy. A run that starts (or resumes) with
    the hook first finishes what an earlier process left unpromoted, in the background.

    Attributes:
        last_checkpoint_index: newest index known to be committed (async: updated when the
            background write is collected).

    Raises:
        ValueError: zero or two intervals, a non-positive interval, keep_last or timeout; a
            promotion setting (``promote_every``, ``durable_keep_last``, ``strict_promotion``,
            ``on_promotion_error``, ``detached_promotion``) without a ``durable_dir``.
        TypeError: no checkpoint_dir, or given both positionally and as a keyword (Python's
            own "multiple values" error).
    """

    #: The strategy calls this hook after the others at the stages it saves at (whatever
    #: their order in its hook list), so that a checkpoint holds their work of the stage it is
    #: taken at: a resumed run starts after that stage and does not replay it.
    saves_checkpoints = True

    def __init__(
        self,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        *,
        step_interval: int | None = None,
        epoch_interval: int | None = None,
        async_save: bool = True,
        rank_zero_only: bool = True,
        keep_last: int | None = None,
        wait_timeout_secs: float | None = 600,
        save_last: bool = True,
        incremental: bool = True,
        storage_options: Mapping[str, Any] | None = None,
        lock_timeout: float | None = None,
        overwrite: bool = False,
        durable_dir: str | os.PathLike[str] | None = None,
        promote_every: int = 1,
        durable_keep_last: int | None = None,
        strict_promotion: bool = False,
        on_promotion_error: Callable[[PromotionError], object] | None = None,
        detached_promotion: bool = False,
        strict_saves: bool | None = None,
        on_save_error: Callable[[BaseException], object] | None = None,
    ) -> None:
        """Validate the policy; the background writer starts when the hook is entered.

        ``overwrite``: save even when the newest committed checkpoint of ``checkpoint_dir``
        or of ``durable_dir`` is further along than the run (a run restarted from step 0, or
        resumed from an earlier index on purpose; a fresh run on a new node, its fast tier
        empty, sharing another run's durable tier); by default training then stops before
        its first step with :class:`~fastckpt.errors.MixedRunError`, so two runs never
        interleave in one root unnoticed (nor does one's durable retention delete the other's
        checkpoints). The new checkpoints get the next indices either way. Each save checks
        again, under the root's lock, that the root's newest index is the one the run
        started from or one this process committed: two runs started together on one root
        (each saw it empty) stop at the first save after the other's, with ``MixedRunError``
        (``overwrite`` does not lift this check; a sharded FSDP2 save is checked by rank 0
        at its commit, after every rank wrote its shards, which the next save removes).

        ``storage_options``: object-store client options for an ``s3://`` checkpoint_dir
        (endpoint_url, region, access_key_id, ... as for :func:`fastckpt.configure_storage`),
        over the AWS environment; registered for its prefix (as ``configure_storage``) and
        kept in effect for it. A local path refuses them (``StorageOptionsError``).

        Raises:
            TypeError: no ``checkpoint_dir``; a count (intervals, ``keep_last``) that is no
                int, a timeout that is no number, a flag that is no bool, an error callback
                (``on_save_error``, ``on_promotion_error``) that is neither callable nor None.
            ValueError: a count or timeout out of range, not exactly one interval, or a
                tier setting that does not fit (see ``durable_dir``).
        """
        if checkpoint_dir is None:
            raise TypeError("CheckpointHook needs a checkpoint_dir")
        use_storage_options(checkpoint_dir, storage_options, "CheckpointHook")
        _positive("step_interval", step_interval)
        _positive("epoch_interval", epoch_interval)
        _positive("keep_last", keep_last)
        _seconds("wait_timeout_secs", wait_timeout_secs, "> 0")
        _seconds("lock_timeout", lock_timeout, ">= 0")
        for name, flag in (
            ("async_save", async_save),
            ("rank_zero_only", rank_zero_only),
            ("strict_promotion", strict_promotion),
            ("detached_promotion", detached_promotion),
        ):
            _flag(name, flag)
        _callback("on_save_error", on_save_error)
        _callback("on_promotion_error", on_promotion_error)
        if (step_interval is None) == (epoch_interval is None):
            raise ValueError("CheckpointHook needs exactly one of step_interval or epoch_interval")
        # Resolved now: a save written in the background after the training script changed
        # directory still goes where the hook was given (the record keeps what was given).
        self._given_dir = os.fspath(checkpoint_dir)
        self.checkpoint_dir = absolute(checkpoint_dir)
        self.step_interval = step_interval
        self.epoch_interval = epoch_interval
        self.async_save = async_save
        self.rank_zero_only = rank_zero_only
        self.keep_last = keep_last
        self.lock_timeout = lock_timeout
        if not isinstance(save_last, bool):
            raise TypeError(f"CheckpointHook save_last must be a bool, got {save_last!r}")
        self.save_last = save_last
        if not isinstance(overwrite, bool):
            raise TypeError(f"CheckpointHook overwrite must be a bool, got {overwrite!r}")
        self.overwrite = overwrite
        if not isinstance(incremental, bool):
            raise TypeError(f"CheckpointHook incremental must be a bool, got {incremental!r}")
        self.incremental = incremental
        self.last_checkpoint_index: int | None = None
        # The step count of the last save and of the run's start (for save_last).
        self._saved_step: int | None = None
        self._start_step: int | None = None
        # checkpoint_dir's newest index when the run started (False: not read, no run).
        self._started_from: int | bool | None = False
        # The run's models are DDP replicas over every rank (the MixedRunError note).
        self._replicas_over_world = False
        # A failed background write is raised with its own type, as a sync save raises it.
        self._writer: BackgroundWriter[int] = BackgroundWriter(
            "fastckpt-hook", wait_timeout=wait_timeout_secs, typed_errors=True
        )
        options = StagerOptions(pinned=_cuda_available(), non_blocking=_cuda_available())
        self._stager: Stager = make_stager(options)
        # Volatile tensors get their own pool: each pool keeps exactly the names it stages.
        self._volatile_stager: Stager = make_stager(options)
        #: ``(relpath, name)`` of tensors an async save saw change outside the optimizer
        #: step while it copied them: copied when each later save is taken.
        self._changed_in_forward: set[tuple[str, str]] = set()
        # Both pools copy into the same file images (one per file): the writer then writes
        # each file straight from its image.
        self._images = make_image_pool(options)
        self._dcp_writer: tuple[Any, Any] | None = None  # (fastckpt.dcp.Writer, group)
        _positive("promote_every", promote_every)
        _positive("durable_keep_last", durable_keep_last)
        if durable_dir is None:
            given = [
                name
                for name, value, default in (
                    ("promote_every", promote_every, 1),
                    ("durable_keep_last", durable_keep_last, None),
                    ("strict_promotion", strict_promotion, False),
                    ("on_promotion_error", on_promotion_error, None),
                    ("detached_promotion", detached_promotion, False),
                )
                if value != default
            ]
            if given:
                raise ValueError(
                    f"CheckpointHook: {', '.join(given)} configure the promotion to a durable "
                    "tier, and this hook has none: give durable_dir=... or drop them"
                )
        self._given_durable = None if durable_dir is None else os.fspath(durable_dir)
        self.durable_dir = None if durable_dir is None else absolute(durable_dir)
        self.promote_every = promote_every
        self.durable_keep_last = durable_keep_last
        self.strict_promotion = bool(strict_promotion)
        self.wait_timeout_secs = wait_timeout_secs
        self._on_promotion_error = on_promotion_error
        self._promoter: Promoter | None = None
        # A rank > 0 of a sharded run on node-local fast tiers uploads its own shards.
        self._rank_promoter: RankPromoter | None = None
        #: The newest index this process pruned after (and whether its shards go too): the
        #: retention runs once more at :meth:`close`, when no promotion holds an index.
        self._retained: tuple[int, bool] | None = None
        if self.durable_dir is not None:
            self._promoter = Promoter(
                self.checkpoint_dir,
                self.durable_dir,
                every=promote_every,
                keep_last=durable_keep_last,
                strict=self.strict_promotion,
                on_error=on_promotion_error,
                detached=detached_promotion,
            )
            # Node-local fast tiers: how long rank 0 waits for the other ranks' shards.
            timeout = wait_timeout_secs
            self._promoter.wait_s = float("inf") if timeout is None else float(timeout)
        self._prewarm_pending = False  # allocate the first step's new state after it
        # The lowest index this hook saves into: past the durable tier's newest when this
        # hook first saved (None: not read yet). See _save_index.
        self._floor: int | None = None
        # The durable tier could not be read when the run started (a store down): whether it
        # holds another run's later checkpoints is checked at the first save that reads it;
        # nothing is promoted before (see _check_durable_later).
        self._durable_unchecked = False
        # A read of the durable tier failed during this run (a store down or not answering):
        # the next reads run in the background, one at a time, so that a tier that does not
        # answer costs the saves nothing (see _durable_manifest).
        self._durable_failed = False
        self._durable_read: Future[Manifest] | None = None
        if strict_saves is not None and not isinstance(strict_saves, bool):
            raise TypeError(
                f"CheckpointHook strict_saves must be a bool or None, got {strict_saves!r}"
            )
        self.strict_saves = self.durable_dir is None if strict_saves is None else strict_saves
        self.on_save_error = on_save_error
        #: The last save's failure while saves are not strict (None after a success).
        self.save_error: BaseException | None = None
        self._raised_save_error: BaseException | None = None  # what close() raised (once)

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> CheckpointHook:
        """Start the background writer (async mode)."""
        if self.async_save:
            self._writer.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, *_: object
    ) -> None:
        """Flush the pending write; its error is raised unless another one is propagating,
        which then carries a note naming it (and it is logged)."""
        try:
            self.close()
        except Exception as err:
            if exc_type is None:
                raise
            if isinstance(err, PromotionError):  # the fast tier holds the checkpoints
                message = f"CheckpointHook: promotion failed too ({err})"
            else:
                message = (
                    f"CheckpointHook: the pending write to {display_path(self.checkpoint_dir)} "
                    f"failed too ({type(err).__name__}: {err}); it was not saved"
                )
            _LOG.warning("%s", message)
            if exc is not None:
                exc.add_note(message)

    def close(self) -> None:
        """Wait for the pending write and stop the background writer.

        A hook that is never closed (entered by hand, the process ends) still has its
        pending write finished at interpreter exit; a failure then is named on stderr.

        Raises:
            Exception: the pending background write failed: its own error (``OSError``,
                ``AccessDeniedError``, ``CheckpointFormatError``, ...), with a note naming
                the write; raised once.
        """
        try:
            self._saved(self._writer.close)
            if self.save_error is not None and self.save_error is not self._raised_save_error:
                # Raised once; :attr:`healthy` stays False until a save commits.
                self._raised_save_error = self.save_error
                raise self.save_error
        finally:
            self._durable_read = None  # a read still waiting on the store: not awaited
            try:
                if self._rank_promoter is not None:
                    self._rank_promoter.close()
            finally:
                if self._promoter is not None:
                    self._promoter.close()
                    self._settle_retention()

    @property
    def healthy(self) -> bool:
        """False while the last save (not strict) or the last promotion failed."""
        return self.save_error is None and self.promotion_healthy

    def _saved(self, outcome: Callable[[], int | None]) -> None:
        """Record the index ``outcome()`` returns (a save that committed); when saves are
        not strict, report its failure instead of raising it (see ``strict_saves``)."""
        try:
            index = outcome()
        except Exception as err:
            # A save not committed because its state changed while copied is reported, never
            # raised: the next saves copy that state in time (nothing else is wrong).
            strict = self.strict_saves and not isinstance(err, StateChangedError)
            if strict or isinstance(err, PromotionError):
                raise  # strict_promotion's failures are raised at once too
            self.save_error = err
            where = display_path(self.checkpoint_dir)
            message = (
                f"CheckpointHook: a save to {where} failed ({type(err).__name__}: {err}); "
                "training goes on, the next checkpoint is attempted as usual"
            )
            report_tolerated(_LOG, message, err, self.on_save_error, stacklevel=3)
            return
        if index is not None:
            self.last_checkpoint_index = index
            self.save_error = None

    @property
    def promotion_healthy(self) -> bool:
        """False while the last promotion to ``durable_dir`` failed (True without one)."""
        return all(p.healthy for p in (self._promoter, self._rank_promoter) if p is not None)

    @property
    def promoter(self) -> Promoter | None:
        """The background promotion to ``durable_dir`` (None without one); on a rank > 0 of
        a sharded run on node-local fast tiers, once seen, the upload of this rank's shards
        (:class:`~fastckpt.container.promote.RankPromoter`)."""
        return self._rank_promoter or self._promoter

    @property
    def writing(self) -> bool:
        """Whether a background write is in progress (async mode)."""
        return self._writer.busy

    @property
    def staging_allocations(self) -> int:
        """How many staging buffers this hook allocated so far (async saves; a save into
        prewarmed buffers allocates none)."""
        return (
            self._stager.allocations + self._volatile_stager.allocations + self._images.allocations
        )

    def _record(self, index: int | None) -> None:
        if index is not None:
            self.last_checkpoint_index = index

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Held by the strategy around its optimizer step: waits for an in-progress capture."""
        with self._writer.guard():
            yield

    def hook_config(self) -> dict[str, Any]:
        """How this hook was configured (JSON values): what a strategy checkpoint records so
        that ``TrainingStrategy.load_checkpoint`` can rebuild it (see
        :mod:`fastckpt.training.hooks.rebuild`). ``storage_options`` are not recorded (they may hold
        credentials): a rebuilt hook uses what ``configure_storage`` or the environment give."""
        config: dict[str, Any] = {
            "checkpoint_dir": self._given_dir,
            "step_interval": self.step_interval,
            "epoch_interval": self.epoch_interval,
            "async_save": self.async_save,
            "rank_zero_only": self.rank_zero_only,
            "keep_last": self.keep_last,
            "wait_timeout_secs": self._writer.wait_timeout,
            "save_last": self.save_last,
            "incremental": self.incremental,
            "lock_timeout": self.lock_timeout,
        }
        if self.durable_dir is not None:
            # Only hooks with two tiers record these: a one-tier hook's record stays what
            # earlier fastckpt versions rebuild.
            config.update(
                durable_dir=self._given_durable,
                promote_every=self.promote_every,
                durable_keep_last=self.durable_keep_last,
                strict_promotion=self.strict_promotion,
            )
            if self._promoter is not None and self._promoter.detached:
                config["detached_promotion"] = True
        if self.strict_saves != (self.durable_dir is None):
            config["strict_saves"] = self.strict_saves  # not the default: recorded
        return config

    # ------------------------------------------------------------------ policy

    def _should_save(self, ctx: TrainContext, stage: TrainingStage) -> bool:
        # Sharded (FSDP2) models: every rank holds shards, so every rank takes part.
        sharded = bool(getattr(ctx.workflow, "sharded", False))
        if self.rank_zero_only and ctx.global_rank != 0 and not sharded:
            return False
        return self._due(ctx, stage)

    def saves_for_all_ranks_at(self, ctx: TrainContext, stage: TrainingStage) -> bool:
        """Whether rank 0 takes a checkpoint at ``stage`` (``AFTER_BATCH`` or ``AFTER_EPOCH``)
        of state every rank holds the same (``rank_zero_only``, unsharded models), decided
        from the counters and this hook's cadence alone: every rank of a data-parallel run
        gives the same answer, and the strategy gathers each rank's RNG states for that
        checkpoint (see :meth:`~fastckpt.TrainingStrategy.run`)."""
        if not self.rank_zero_only or getattr(ctx.workflow, "sharded", False):
            return False
        return stage is not TrainingStage.AFTER_TRAINING and self._due(ctx, stage)

    def _warn_a_rank_never_saved(self, ctx: TrainContext) -> None:
        """On a rank other than 0 that ``rank_zero_only`` keeps from saving: say so when its
        unsharded models are not DDP replicas over every rank (a run of a sweep, a pipeline
        stage: state of its own), which no rank then saves. Before, nothing said it: the
        run trained without a checkpoint of that rank's state."""
        import torch.distributed as dist

        if not self.rank_zero_only or ctx.global_rank == 0 or self._replicas_over_world:
            return
        if getattr(ctx.workflow, "sharded", False):
            return
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return
        message = (
            f"CheckpointHook({display_path(self.checkpoint_dir)}) on rank {ctx.global_rank} of "
            f"{dist.get_world_size()}: rank_zero_only=True (the default) saves on rank 0 "
            "alone, and this rank's models are not DistributedDataParallel replicas over "
            "every rank, so their state is never saved here. If they are this rank's own (a "
            "run of a sweep, a pipeline stage), pass rank_zero_only=False and a "
            "checkpoint_dir of this rank's own; if they are replicas kept in step another "
            "way, rank 0's checkpoints hold them and this warning can be ignored"
        )
        _LOG.warning("%s", message)
        warnings.warn(message, RuntimeWarning, stacklevel=2)

    def _due(self, ctx: TrainContext, stage: TrainingStage) -> bool:
        """Whether this hook's cadence saves at ``stage`` (on a rank that saves)."""
        if stage is TrainingStage.AFTER_BATCH and self.step_interval is not None:
            return ctx.step_count > 0 and ctx.step_count % self.step_interval == 0
        if stage is TrainingStage.AFTER_EPOCH and self.epoch_interval is not None:
            return ctx.epoch > 0 and ctx.epoch % self.epoch_interval == 0
        if stage is TrainingStage.AFTER_TRAINING and self.save_last:
            # Only a state this run trained, and only if the cadence did not just save it.
            return ctx.step_count != self._start_step and ctx.step_count != self._saved_step
        return False

    def __call__(self, ctx: TrainContext, stage: TrainingStage) -> None:
        """Save when the cadence is reached, and at the end of the run (``save_last``).

        Async: the staging buffers are allocated before training starts, and those of state
        the first step creates (e.g. Adam's moments) after that step, so no save in the loop
        pays for fresh memory (see :meth:`prewarm_staging`).
        """
        if stage is TrainingStage.BEFORE_TRAINING:
            self._start_step = ctx.step_count
            self._started_from = self._newest_index()
            self._replicas_over_world = _replicas_over_world(ctx)
            self._warn_a_rank_never_saved(ctx)
            self._floor = None  # the durable tier is read again by this run's first save
            self._durable_failed, self._durable_read = False, None
            check_recordable = getattr(ctx.workflow, "check_recordable", None)
            if check_recordable is not None:
                check_recordable()  # before any step: not at the first save, work lost
            if not self.overwrite:
                self._refuse_a_mixed_run(ctx)
            self._start_promotion(ctx)
            self._prewarm_pending = True
            self._prewarm(ctx)
        elif stage is TrainingStage.AFTER_BATCH and self._prewarm_pending:
            self._prewarm_pending = False
            self._prewarm(ctx)
        if self._should_save(ctx, stage):
            if stage is TrainingStage.AFTER_TRAINING and not getattr(
                ctx.workflow, "sharded", False
            ):
                # The run's last save is never skipped (see save): wait for the write in
                # flight however long it takes, as close() would next.
                self._saved(self._writer.collect_waiting)
            self.save(ctx)

    def _start_promotion(self, ctx: TrainContext) -> None:
        """Two tiers: the rank that commits (rank 0 for sharded strategies) finishes in the
        background what an earlier process left unpromoted."""
        if self._promoter is None:
            return
        sharded = bool(getattr(ctx.workflow, "sharded", False))
        if sharded and node_local_root(self.checkpoint_dir):
            # Each node its own fast disk: every rank uploads its shards, rank 0 commits.
            if ctx.global_rank != 0:
                self._promote_rank_files(ctx.global_rank)
                return
            self._promoter.node_local = True
        if ctx.global_rank != 0 and (sharded or self.rank_zero_only):
            return
        if self._durable_unchecked:
            return  # the first save that reads the durable tier decides (_check_durable_later)
        try:
            committed = Manifest.load(self.checkpoint_dir).latest is not None
        except (OSError, FastCkptError):
            return  # the first save reports it
        if committed:
            self._promoter.submit()

    def _promote_rank_files(self, rank: int) -> None:
        """Rank ``rank`` > 0 on a node-local fast tier: upload its due shards (background)."""
        if self.durable_dir is None:
            return
        if self._rank_promoter is None:
            self._rank_promoter = RankPromoter(
                self.checkpoint_dir,
                self.durable_dir,
                rank,
                every=self.promote_every,
                strict=self.strict_promotion,
                on_error=self._on_promotion_error,
                detached=self._promoter is not None and self._promoter.detached,
            )
        self._rank_promoter.submit()

    def _after_sharded_commit(
        self, rank: int, index: int, failure: BaseException | None, group: Any
    ) -> None:
        """Every rank, after rank 0 committed index ``index`` and pruned (or failed to):
        learn the outcome, and on node-local fast tiers keep this node's copy of the part
        record and retention in step; then promote (rank 0 commits what every rank
        uploads)."""
        shared = share_commit(self.checkpoint_dir, index, failure=failure, process_group=group)
        if rank == 0 and failure is None:
            self._went_past(index)
        if self._promoter is None:
            return  # node-local roots were refused at the commit (the writer's check)
        if rank != 0:
            if shared.node_local:
                self._promote_rank_files(rank)
            return
        self._promoter.node_local = shared.node_local
        if not self._durable_unchecked:
            self._promoter.submit()
        elif self.strict_promotion and self._promoter.error is not None:
            raise self._promoter.error  # the durable tier could not be read; committed here

    def _refuse_a_mixed_run(self, ctx: TrainContext) -> None:
        """Raise :class:`MixedRunError` when the root's newest committed index is at a later
        step than the run starts at (every rank checks, so that none trains on alone; for a
        sharded strategy rank 0 decides for all, as other ranks' roots may be node-local
        disks without the index)."""
        self._durable_unchecked = False
        problem = self._mixed_run(ctx)
        if getattr(ctx.workflow, "sharded", False):
            import torch.distributed as dist

            if dist.is_initialized() and dist.get_world_size() > 1:
                decided = [problem]
                dist.broadcast_object_list(decided, src=0)
                problem = decided[0]
        if problem is not None:
            raise MixedRunError(problem)

    def _mixed_run(self, ctx: TrainContext) -> str | None:
        """The :class:`MixedRunError` message, when the newest index of this hook's root, or
        of its durable tier, is further along than the run (None: neither is). A run resumed
        from the newest index of this hook's durable tier (``restored_from``) continues the
        tiers' own run: the fast tier's newer indices were passed over by that restore
        (damaged, or holding only a node's shards) and are not another run's; so is a
        newest index the restore passed over as damaged, on any tier. The durable
        tier is checked too: a run started afresh on a new node (an empty fast tier) would
        otherwise promote into another run's durable tier, whose retention then deleted that
        run's checkpoints."""
        problem = self._further_along(ctx, self.checkpoint_dir, "checkpoint_dir")
        if problem is None and self.durable_dir is not None:
            problem = self._further_along(ctx, self.durable_dir, "durable_dir")
        return problem

    def _further_along(
        self, ctx: TrainContext, root: Path, argument: str, manifest: Manifest | None = None
    ) -> str | None:
        """:meth:`_mixed_run` for one tier ``root`` (the hook's ``argument``), against the
        step the run started at; ``manifest``: ``root``'s, read already."""
        if manifest is None:
            try:
                manifest = Manifest.load(root)
            except (OSError, FastCkptError):
                # Unreadable: the first save reports it. A durable tier is checked once it
                # can be read, before anything is promoted to it (_check_durable_later);
                # the saves read it in the background (_durable_manifest).
                self._durable_unchecked = root == self.durable_dir
                self._durable_failed = self._durable_failed or self._durable_unchecked
                return None
        latest = manifest.latest
        if latest is None:
            return None
        saved = manifest.entries[latest].get("counters", {}).get("step_count")
        started = ctx.step_count if self._start_step is None else self._start_step
        if not isinstance(saved, int) or isinstance(saved, bool) or saved <= started:
            return None
        copy = getattr(ctx.workflow, "restored_from", None)
        passed = getattr(copy, "passed", None)
        if (root == self.checkpoint_dir and self._resumed_from_durable(ctx)) or (
            passed is not None and passed(root, latest)
        ):
            _LOG.warning(
                "%s: its newest index %d (step %d) is further along than the run, which "
                "resumed from %s (the restore passed over the newer copies); saving on",
                display_path(root),
                latest,
                saved,
                ctx.workflow.restored_from.describe(),
            )
            return None
        shown = display_path(root)
        return (
            f"{shown}: its newest checkpoint (index {latest}) is at step {saved}, but this run "
            f"starts at step {started}; its saves would interleave with that run's. "
            f"Resume it (TrainingStrategy.load_checkpoint({shown!r}, ...)), give the "
            f"CheckpointHook another {argument}, or pass CheckpointHook(..., "
            "overwrite=True) to save there anyway (e.g. resuming from an earlier index on "
            "purpose)"
        )

    def _resumed_from_durable(self, ctx: TrainContext) -> bool:
        """Whether the run was restored from the newest committed index of ``durable_dir``."""
        copy = getattr(ctx.workflow, "restored_from", None)
        if copy is None or self.durable_dir is None:
            return False
        if root_key(copy.root) != root_key(self.durable_dir):  # spelled any way
            return False
        try:
            return bool(Manifest.load(self.durable_dir).latest == copy.index)
        except (OSError, FastCkptError):
            return False

    def _prewarm(self, ctx: TrainContext) -> None:
        sharded = bool(getattr(ctx.workflow, "sharded", False))
        if not self.async_save or ctx.workflow is None or sharded:
            return
        if self.rank_zero_only and ctx.global_rank != 0:
            return
        self.prewarm_staging(ctx.workflow)

    def prewarm_staging(self, strategy: Any) -> int:
        """Allocate (and touch) the staging buffers an async save of ``strategy`` will copy
        into, now, instead of at its first save (fresh memory costs a page fault per page,
        pinned memory an expensive registration: seconds per GiB on a GPU machine). Buffers
        that exist are kept; nothing is copied. The hook calls it before training starts and
        again after the first step (whose optimizer step may create state, e.g. Adam's
        moments); call it yourself when driving :meth:`save` by hand. A sync hook or a
        sharded strategy (staged by fastckpt.dcp's writer) has nothing to allocate.

        Returns:
            The bytes newly allocated.
        """
        if not self.async_save or getattr(strategy, "sharded", False):
            return 0
        if any(build.has_lazy_tensors(model) for model in strategy.models.values()):
            return 0  # no shapes before the first forward pass: again after the first step
        snapshot: Snapshot = strategy.checkpoint_snapshot()

        def volatile(relpath: str, name: str) -> bool:
            return (relpath, name) in snapshot.volatile

        files = snapshot.tensor_files
        return reserve_groups(
            self._volatile_stager, files, volatile, self._images
        ) + reserve_groups(
            self._stager, files, lambda relpath, name: not volatile(relpath, name), self._images
        )

    # ------------------------------------------------------------------ saving

    def save(self, ctx: TrainContext) -> None:
        """Capture the strategy now and write it (in the background when async).

        Raises:
            RuntimeError: no strategy in ``ctx.workflow``, or the async writer was not started.
            TimeoutError: the previous background write is still running after
                ``wait_timeout_secs`` (it stays tracked).
            Exception: the previous background write failed: its own error, with a note
                naming it (raised once; as a sync save would raise it).
        """
        if ctx.workflow is None:
            raise RuntimeError(
                "CheckpointHook needs TrainContext.workflow to be the running TrainingStrategy"
            )
        sharded = bool(getattr(ctx.workflow, "sharded", False))
        if sharded:
            self._record(self._writer.collect())  # collective: every rank raises
        else:
            self._saved(self._writer.collect)  # one write in flight; keeps indices ordered
            if self._writer.in_flight is not None:
                # Still running after wait_timeout_secs (reported above; strict_saves raised
                # it): this save is skipped, the next one is attempted as usual.
                _LOG.warning(
                    "CheckpointHook: the save at step %d to %s is skipped: the previous write "
                    "is still running",
                    ctx.step_count,
                    display_path(self.checkpoint_dir),
                )
                return
        self._saved_step = ctx.step_count
        if sharded:
            self._save_sharded(ctx)
            return
        index = self._save_index(0, ctx)  # every rank that saves its own root checks
        snapshot: Snapshot = ctx.workflow.checkpoint_snapshot()
        # Unchanged tensors become references now, before anything is staged.
        snapshot.incremental = self.incremental
        plan_incremental(self.checkpoint_dir, snapshot)
        if not self.async_save:
            self._saved(lambda: self._write(snapshot, index))
            return
        if not self._writer.running:
            raise RuntimeError(
                "CheckpointHook's async writer is not running: run it through "
                "TrainingStrategy.run (which enters hooks) or use it as a context manager"
            )
        # Buffers and frozen parameters change outside the optimizer step: copied now, on
        # the training thread; so are tensors an earlier save saw change in forward.
        snapshot.volatile.update(
            (relpath, name)
            for relpath, tensors in snapshot.tensor_files.items()
            for name in tensors
            if (relpath, name) in self._changed_in_forward
        )
        self._stage(snapshot, only_volatile=True)
        # The rest is copied in the background, before the next optimizer step (guarded);
        # their version counters prove nothing else changed them meanwhile.
        versions = {
            (relpath, name): (tensor, tensor._version)
            for relpath, tensors in snapshot.tensor_files.items()
            for name, tensor in tensors.items()
            if hasattr(tensor, "_version") and (relpath, name) not in snapshot.volatile
        }
        changed: list[tuple[str, str]] = []

        def capture() -> None:
            self._stage(snapshot, only_volatile=False)
            changed.extend(key for key, (t, version) in versions.items() if t._version != version)
            self._changed_in_forward.update(changed)

        def write() -> int:
            if changed:
                names = ", ".join(f"{relpath}:{name}" for relpath, name in changed[:5])
                raise StateChangedError(
                    f"the save at step {ctx.step_count} to {display_path(self.checkpoint_dir)} "
                    f"was not committed: {len(changed)} tensor(s) changed in place outside the "
                    f"optimizer step while the save copied them ({names}), e.g. "
                    "nn.Embedding(max_norm=...) in forward; from now on they are copied when "
                    "a save is taken, on the training thread"
                )
            return self._write(snapshot, index)

        try:
            self._writer.submit(
                f"{display_path(self.checkpoint_dir)} (the save at step {ctx.step_count})",
                write,
                capture=capture,
            )
        except OSError as err:  # no thread could start for the write: reported like a failure
            self._saved(functools.partial(_reraise, err))

    def _save_sharded(self, ctx: TrainContext) -> None:
        """A strategy with FSDP2-sharded models: every rank writes its shards, then rank 0
        commits the index (recipe, counters, RNG, scheduler and hook states) and prunes,
        sharded parts included.

        Sync: :meth:`TrainingStrategy.save_checkpoint` on the training thread. Async: every
        rank stages its shards into this hook's reused :class:`fastckpt.dcp.Writer` now; the
        background thread waits for their upload (on a gloo group for checkpoints only), then
        rank 0 stages the hook states and commits the index.
        """
        assert ctx.workflow is not None
        first = self._save_index(ctx.global_rank, ctx)  # rank 0's is the one used
        if not self.async_save:
            # node-local fast roots are allowed when every rank promotes its shards
            index = ctx.workflow.save_checkpoint(
                self.checkpoint_dir,
                checkpoint_index=first,
                node_local=self._promoter is not None,
                lock_timeout=self.lock_timeout,
                check_root=self._check_no_other_run,
            )
            self.last_checkpoint_index = index
            failure: BaseException | None = None
            if ctx.global_rank == 0:
                try:
                    self._prune_sharded(index)
                except Exception as err:
                    failure = err
            self._after_sharded_commit(ctx.global_rank, index, failure, None)
            return
        if not self._writer.running:
            raise RuntimeError(
                "CheckpointHook's async writer is not running: run it through "
                "TrainingStrategy.run (which enters hooks) or use it as a context manager"
            )
        writer, group = self._sharded_writer()
        index, future = ctx.workflow.start_sharded_save(
            self.checkpoint_dir, writer=writer, process_group=group, checkpoint_index=first
        )
        snapshot: Snapshot | None = None
        if ctx.global_rank == 0:
            snapshot = ctx.workflow.checkpoint_snapshot()
            self._stage(snapshot, only_volatile=True)

        rank = ctx.global_rank

        def write() -> int:
            future.result()
            failure: BaseException | None = None
            if snapshot is not None:
                try:
                    write_snapshot(
                        self.checkpoint_dir,
                        snapshot,
                        index,
                        lock_timeout=self.lock_timeout,
                        check_root=self._check_no_other_run,
                    )
                    self._prune_sharded(index)
                except Exception as err:
                    failure = err
            self._after_sharded_commit(rank, index, failure, group)
            return index

        def capture() -> None:
            if snapshot is not None:
                self._stage(snapshot, only_volatile=False)

        self._writer.submit(
            f"{display_path(self.checkpoint_dir)} (the save at step {ctx.step_count})",
            write,
            capture=capture,
        )

    def _sharded_writer(self) -> tuple[Any, Any]:
        """This hook's DCP writer and checkpoint process group, made at the first async
        sharded save (every rank is there, so the group creation is collective)."""
        if self._dcp_writer is None:
            import torch.distributed as dist

            from fastckpt.dcp.writer import Writer

            group = None
            if dist.is_available() and dist.is_initialized():
                # On one rank too: DCP's async save needs a CPU backend (NCCL alone lacks it).
                group = dist.new_group(backend="gloo")
            options = StagerOptions(pinned=_cuda_available(), non_blocking=_cuda_available())
            writer = Writer(
                self.checkpoint_dir,
                stager_options=options,
                node_local=self._promoter is not None,  # every rank promotes its shards
            )
            self._dcp_writer = (writer, group)
        return self._dcp_writer

    def _prune_sharded(self, index: int) -> None:
        if self.keep_last is not None:
            remove_sharded(self.checkpoint_dir, self._prune(index, sharded=True))

    def _prune(self, newest: int, *, sharded: bool = False) -> list[int]:
        """``keep_last`` after the save of index ``newest``, sparing the index that waits
        for its promotion and those the running promotion copies (two tiers, see
        :meth:`~fastckpt.container.promote.Promoter.spared`). Returns the pruned indices."""
        assert self.keep_last is not None
        if self._promoter is None:
            return self._prune_sparing(())
        self._retained = (newest, sharded)  # sharded: not pruned again at close
        with self._promoter.retention():  # no promotion chooses meanwhile
            return self._prune_sparing(self._promoter.spared(newest))

    def _settle_retention(self) -> None:
        """``keep_last`` once more after the last promotion ended (at :meth:`close`, when it
        succeeded): the index a promotion was copying at the run's last save was spared
        then, so the fast tier kept one index more than ``keep_last`` after the run. Not for
        sharded saves (see below). A failure here is logged: every save is committed and
        promoted."""
        retained, self._retained = self._retained, None
        if retained is None or self._promoter is None or not self.promotion_healthy:
            return
        newest, sharded = retained
        if sharded:
            # Other nodes remove their shards of what rank 0 prunes after each save, in a
            # collective this close() cannot run: their extra index stays until the next save.
            return
        try:
            self._prune(newest)
        except (OSError, FastCkptError) as err:
            _LOG.warning(
                "CheckpointHook: keep_last=%d on %s after the last promotion failed (%s); "
                "the next run's first save applies it",
                self.keep_last,
                display_path(self.checkpoint_dir),
                err,
            )
        self._retained = None

    def _prune_sparing(self, spare: Sequence[int]) -> list[int]:
        assert self.keep_last is not None
        return prune_indices(
            self.checkpoint_dir,
            self.keep_last,
            lock_timeout=self.lock_timeout,
            spare=spare,
            read_shards=False,  # after every save: not the whole sharded checkpoint again
        )

    def _check_durable_later(self, ctx: TrainContext, manifest: Manifest) -> None:
        """The durable tier, read at the run's first save (``manifest``; it could not be read
        when the run started, see :meth:`_further_along`, or was, and another run may have
        promoted into it since): when it holds another run's later
        checkpoints, this hook's promotions stop for good (reported: ``PromotionError``
        caused by :class:`MixedRunError`, raised at close) instead of promoting into it,
        whose retention then deleted that run's checkpoints; otherwise they start, with
        what the fast tier holds."""
        if self._promoter is None or self.durable_dir is None:
            return
        unchecked, self._durable_unchecked = self._durable_unchecked, False
        # Checked again at the first save even when it was read at the start: another run
        # started together with this one (the tier empty for both then) may have promoted
        # into it meanwhile; its retention would then delete that run's checkpoints.
        problem = (
            None
            if self.overwrite and not unchecked
            else self._further_along(ctx, self.durable_dir, "durable_dir", manifest)
        )
        if problem is not None:
            self._promoter.withhold(MixedRunError(problem))
        elif unchecked:
            self._promoter.submit()

    def _save_index(self, rank: int, ctx: TrainContext) -> int:
        """The index of this save: -1 (the fast root's next) unless the fast root is behind
        the durable tier, then the durable tier's newest index + 1.

        A run resumed from the durable tier (a new node: its fast tier empty, or left from
        an earlier run) would number its saves from the fast root's own next index: ones the
        durable tier already holds. They were then never promoted (the durable tier held an
        index as new), and a restore with both tiers took the durable tier's older index as
        the newest. The durable tier is read once per hook (rank 0 decides for sharded
        runs); until the fast root holds an index past it (a first save that failed
        included), saves go to that floor, which each of this hook's commits raises past
        itself (:meth:`_went_past`). A durable tier that cannot be read is left to the
        promotion to report; once a read failed, the next is made in the background
        (:meth:`_durable_manifest`) and this save goes to the fast root's next index."""
        if self.durable_dir is None or rank != 0:
            return -1
        try:
            if self._floor is None:
                manifest = self._durable_manifest()
                if manifest is None:
                    return -1  # being read in the background: nothing promoted until it is
                self._check_durable_later(ctx, manifest)
                durable = manifest.latest
                self._floor = 0 if durable is None else durable + 1
            if self._floor == 0:  # the durable tier was empty: nothing to go past
                return -1
            fast = Manifest.load(self.checkpoint_dir).latest
        except (OSError, FastCkptError) as err:
            if self._durable_unchecked and self._promoter is not None:
                # Nothing is promoted before the durable tier is read (see
                # _check_durable_later): reported as a failed promotion would be, and (strict)
                # raised once this save is committed to the fast tier, by its submission.
                self._promoter.report_failure(err)
            return -1
        if fast is not None and fast + 1 >= self._floor:
            return -1
        _LOG.info(
            "%s: the durable tier %s holds index %d, past this fast tier's %s (a run resumed "
            "from the durable tier): this save goes to index %d",
            display_path(self.checkpoint_dir),
            display_path(self.durable_dir),
            self._floor - 1,
            "none" if fast is None else f"newest {fast}",
            self._floor,
        )
        return self._floor

    def _durable_manifest(self) -> Manifest | None:
        """The durable tier's manifest, for :meth:`_save_index`: read here until a read
        failed in this run; then in the background, one read at a time (None while it runs;
        its failure raised by the save that finds it done), as a store that does not answer
        would hold up every save by its timeouts and retries (a 15 s stall per save with the
        default options: a review finding). With ``strict_promotion`` it is always read here:
        its failure stops the run at this save."""
        assert self.durable_dir is not None
        if not self._durable_failed or self.strict_promotion:
            try:
                return Manifest.load(self.durable_dir)
            except (OSError, FastCkptError):
                self._durable_failed = True
                raise
        read = self._durable_read
        if read is None:
            self._durable_read = _in_background(Manifest.load, self.durable_dir)
            return None
        if not read.done():
            return None
        self._durable_read = None
        return read.result()  # its error: reported as a failed read here is

    def _stage(self, snapshot: Snapshot, *, only_volatile: bool) -> None:
        """Replace the snapshot's tensors with staged copies (volatile ones or the rest)."""
        stager = self._volatile_stager if only_volatile else self._stager
        stage_groups(
            stager,
            snapshot.tensor_files,
            lambda relpath, name: ((relpath, name) in snapshot.volatile) == only_volatile,
            self._images,
        )

    def _went_past(self, index: int) -> None:
        """After this hook committed ``index`` (two tiers, rank 0): its next save goes past it
        whatever the fast root holds then. A fast root wiped mid-run (``/dev/shm`` cleared, a
        node-local disk reclaimed) numbered its next saves from 0 again, below the durable
        tier's newest: they were never promoted, and a restore took the durable tier's older
        index over them without a word (see :meth:`_save_index`)."""
        if self.durable_dir is not None and self._floor is not None:
            self._floor = max(self._floor, index + 1)

    def _newest_index(self) -> int | bool | None:
        """``checkpoint_dir``'s newest committed index (None: none; False: unreadable, the
        first save reports it)."""
        try:
            return Manifest.load(self.checkpoint_dir).latest
        except (OSError, FastCkptError):
            return False

    def _check_no_other_run(self, manifest: Manifest) -> None:
        """Raise :class:`MixedRunError` when ``checkpoint_dir``'s newest index (``manifest``,
        read under the root's lock) is newer than the one the run started from and than
        every one this process committed: another process saved into the root during the
        run (indices are chosen under that lock, so another save gets a newer one)."""
        latest = manifest.latest
        if self._started_from is False or latest is None:
            return
        known = committed_here(self.checkpoint_dir)
        if self._started_from is not None:
            known |= {self._started_from}
        if latest in known or (known and latest < max(known)):
            return  # ours, or older than ours (newer ones deleted by hand): no other run's
        step = manifest.entries[latest].get("counters", {}).get("step_count")
        shown = display_path(self.checkpoint_dir)
        import torch.distributed as dist

        ranks = ""
        if not self.rank_zero_only and self._replicas_over_world:
            # DDP replicas over the world: every rank of this run saves into the root.
            ranks = (
                f" It may be another rank of this same run: under a process group of "
                f"{dist.get_world_size()} ranks with rank_zero_only=False, every rank saves "
                "its unsharded models (DDP replicas) itself; rank_zero_only=True (the default) "
                "makes rank 0 the only writer, with every rank's RNG states"
            )
        raise MixedRunError(
            f"{shown}: index {latest}{'' if step is None else f' (step {step})'} was committed "
            "by another process while this run saved there: two runs are saving into one root "
            "and their checkpoints would interleave (each one's retention deleting the "
            "other's). Nothing was saved by this save; stop one of the runs, or give this "
            f"CheckpointHook another checkpoint_dir.{ranks}"
        )

    def _write(self, snapshot: Snapshot, index: int = -1) -> int:
        index = write_snapshot(
            self.checkpoint_dir,
            snapshot,
            index,
            lock_timeout=self.lock_timeout,
            check_root=self._check_no_other_run,
        )
        self._went_past(index)
        if self.keep_last is not None:
            self._prune(index)
        if self._promoter is not None:
            if not self._durable_unchecked:
                self._promoter.submit()  # in the background: training is not held up
            elif self.strict_promotion and self._promoter.error is not None:
                raise self._promoter.error  # the durable tier could not be read; committed here
        return index


def _in_background(function: Callable[[Path], Manifest], argument: Path) -> Future[Manifest]:
    """``function(argument)`` on a daemon thread of its own (a read that never returns, from
    a store that does not answer, must not hold up the interpreter's exit)."""
    future: Future[Manifest] = Future()

    def run() -> None:
        try:
            future.set_result(function(argument))
        except BaseException as err:
            future.set_exception(err)

    threading.Thread(target=run, name="fastckpt-durable-read", daemon=True).start()
    return future


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _reraise(error: BaseException) -> NoReturn:
    """Raise ``error``: the outcome of a save that failed before it started, for
    :meth:`CheckpointHook._saved` to raise or report."""
    raise error
