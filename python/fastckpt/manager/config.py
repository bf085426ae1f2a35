"""The parts of ``CheckpointManager.Config``: item specs, staging, writer, saver, loader, storage.

The names and fields follow torch_checkpointing's, so a configuration written for it reads the
same here. Every config is strict:

* a field is checked when the config is made *and* whenever it is assigned later
  (``config.save.wait_timeout_secs = -1`` raises ``ValueError`` naming the field);
* an attribute that is not a field raises ``AttributeError`` naming the closest field
  (``config.finalize_calback = fn`` does not silently add an attribute nobody reads);
* a field whose reference meaning fastckpt cannot honour (a writer *process*, shared memory
  for it, a separate barrier service, resharder objects) keeps the one value fastckpt does
  honour, and any other value raises ``ValueError`` saying why and what to do instead.

fastckpt writes on one background thread of the training process, so there is no process to
configure and nothing to share with one (see docs/migrating.md, torch_checkpointing section).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from fastckpt.io.files import DEFAULT_WRITE_THREADS
from fastckpt.storage.backend import TEMP_PREFIX
from fastckpt.storage.registry import display_path, is_object_url

__all__ = [
    "AsyncCheckpointSaverConfig",
    "CheckpointLoaderConfig",
    "CheckpointSaverConfig",
    "CheckpointStagerConfig",
    "CheckpointWriterConfig",
    "ItemSpec",
    "LocalFileSystemStorageConfig",
    "StrictConfig",
    "SyncCheckpointSaverConfig",
    "TiersConfig",
]

DEFAULT_WAIT_TIMEOUT_SECS = 600
_THREAD_DESIGN = "fastckpt writes on one background thread of the training process"


def _cuda() -> bool:
    return torch.cuda.is_available()


class StrictConfig:
    """Base of the config dataclasses: unknown attributes are refused and every assignment is
    checked by :meth:`_check` (at construction and later). Fields a
    :class:`~fastckpt.manager.CheckpointManager` reads once, when it is built from the config
    (:attr:`FIXED_AT_BUILD`), refuse an assignment while that manager is open instead of
    being ignored."""

    #: The fields a manager reads when it is built (see :meth:`mark_built`).
    FIXED_AT_BUILD: ClassVar[frozenset[str]] = frozenset()

    def __setattr__(self, name: str, value: Any) -> None:
        """Check ``value`` for field ``name``; refuse names that are not fields, and fields
        fixed by a manager built from this config."""
        names = [f.name for f in dataclasses.fields(self)]  # type: ignore[arg-type]
        if name not in names:
            close = difflib.get_close_matches(name, names, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; its fields are {names}"
            raise AttributeError(f"{type(self).__qualname__} has no field {name!r}{hint}")
        if name in self.FIXED_AT_BUILD and vars(self).get("_built", 0):
            raise AttributeError(
                f"{type(self).__qualname__}.{name} was read when a CheckpointManager was built "
                "from this config, and a change would be ignored while it is open: close it "
                "first, or build the next manager from a copy of the config"
            )
        self._check(name, value)
        object.__setattr__(self, name, value)

    def mark_built(self) -> None:
        """A manager was built from this config: its :attr:`FIXED_AT_BUILD` fields are read
        (fixed until :meth:`release_built` by that manager's ``close()``)."""
        object.__setattr__(self, "_built", vars(self).get("_built", 0) + 1)

    def release_built(self) -> None:
        """A manager built from this config was closed (see :meth:`mark_built`)."""
        object.__setattr__(self, "_built", max(0, vars(self).get("_built", 0) - 1))

    def _check(self, name: str, value: Any) -> None:
        """Raise ``ValueError``/``TypeError`` naming the field when ``value`` is invalid."""

    def _fail(self, name: str, message: str) -> ValueError:
        return ValueError(f"{type(self).__qualname__}.{name}: {message}")

    def _need_bool(self, name: str, value: Any) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"{type(self).__qualname__}.{name} must be a bool, got {value!r}")

    def _need_none(self, name: str, value: Any, why: str) -> None:
        if value is not None:
            raise self._fail(name, f"must be None: {why}")


def _timeout(config: StrictConfig, name: str, value: Any, *, allow_none: bool) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"{type(config).__qualname__}.{name} must be a number of seconds"
            f"{' or None' if allow_none else ''}, got {value!r}"
        )
    if not value >= 0 or value == float("inf"):  # nan fails every comparison
        raise ValueError(
            f"{type(config).__qualname__}.{name} must be a finite number of seconds >= 0"
            f"{' (None: no limit)' if allow_none else ''}, got {value!r}"
        )


@dataclass
class ItemSpec(StrictConfig):
    """How one top-level key of the state is saved.

    Attributes:
        requires_copy: stage a snapshot copy before the background write. ``False`` writes the
            live tensors directly (only safe if they are not mutated until the write is done).
        layout: file layout; only ``None`` (one safetensors + one JSON file per item, one
            tensor file per rank under a process group).
        resharder: only ``None``: DTensor items are resharded on load automatically
            (:mod:`fastckpt.dcp`), with no resharder object to declare.
        required: at load, a missing required item is an error; optional items are skipped.
    """

    requires_copy: bool = True
    layout: str | None = None
    resharder: Any = None
    required: bool = True

    def _check(self, name: str, value: Any) -> None:
        if name in ("requires_copy", "required"):
            self._need_bool(name, value)
        elif name == "layout" and value is not None:
            raise self._fail(
                name,
                f"layout {value!r} is not supported: fastckpt writes one <key>.safetensors "
                "(per rank) and one <key>.json per item; use None",
            )
        elif name == "resharder":
            self._need_none(
                name,
                value,
                "DTensor items are saved sharded and resharded onto the template's placements "
                "on load automatically; plain tensors are loaded whole on every rank",
            )


@dataclass
class CheckpointStagerConfig(StrictConfig):
    """Staging options; the CUDA-dependent defaults are decided when the config is made
    (all fixed once a manager is built from them).

    Attributes:
        use_pinned_memory: pinned host buffers for CUDA tensors (default: CUDA is available).
        use_shared_memory: only ``False``. The reference stages into shared memory for its
            writer process; fastckpt's writer is a thread of this process, which reads the
            staging buffers directly, so ``True`` raises ``ValueError``.
        use_async_staging: capture on the background thread (``save`` returns at once; hold
            :meth:`CheckpointManager.lock` while mutating state). ``False`` copies on the
            calling thread before ``save`` returns.
        use_non_blocking_copy: non-blocking device-to-host copies on a side stream.
    """

    FIXED_AT_BUILD = frozenset(
        {"use_pinned_memory", "use_shared_memory", "use_async_staging", "use_non_blocking_copy"}
    )

    use_pinned_memory: bool = field(default_factory=_cuda)
    use_shared_memory: bool = False
    use_async_staging: bool = True
    use_non_blocking_copy: bool = field(default_factory=_cuda)

    def _check(self, name: str, value: Any) -> None:
        self._need_bool(name, value)
        if name == "use_shared_memory" and value:
            raise self._fail(
                name,
                f"must be False: {_THREAD_DESIGN}, which reads the staging buffers directly; "
                "no other process needs them in shared memory",
            )


@dataclass
class CheckpointWriterConfig(StrictConfig):
    """Writer options.

    Attributes:
        file_write_max_threads: parallel writer threads per file (>= 1).
        temp_dir_prefix: only ``".tmp-"``: a checkpoint is written as a ``.tmp-`` sibling and
            renamed into place, and ``ls``/``prune``/loads recognise and clean leftovers by that
            prefix; another prefix raises ``ValueError``.
        checkpoint_write_barrier_timeout_sec: under a process group, how long the ranks wait
            for each other to commit a checkpoint (the manager's gloo group timeout) (> 0).
        barrier_config: only ``None``: ranks agree through the default process group (a gloo
            group of its own), with no separate barrier service.
    """

    FIXED_AT_BUILD = frozenset({"file_write_max_threads", "checkpoint_write_barrier_timeout_sec"})

    file_write_max_threads: int = DEFAULT_WRITE_THREADS
    temp_dir_prefix: str = TEMP_PREFIX
    checkpoint_write_barrier_timeout_sec: float = 600
    barrier_config: Any = None

    def _check(self, name: str, value: Any) -> None:
        if name == "file_write_max_threads":
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"CheckpointWriterConfig.{name} must be an int, got {value!r}")
            if value < 1:
                raise self._fail(name, f"must be positive (>= 1), got {value}")
        elif name == "temp_dir_prefix" and value != TEMP_PREFIX:
            raise self._fail(
                name,
                f"must be {TEMP_PREFIX!r}, got {value!r}: fastckpt's ls, prune and loads "
                f"recognise interrupted writes by the {TEMP_PREFIX!r} prefix and clean them",
            )
        elif name == "checkpoint_write_barrier_timeout_sec":
            _timeout(self, name, value, allow_none=False)
            if value == 0:
                raise self._fail(name, "must be > 0")
        elif name == "barrier_config":
            self._need_none(
                name,
                value,
                "ranks agree through collectives on a gloo group of the default process group; "
                "set checkpoint_write_barrier_timeout_sec to bound the wait",
            )


@dataclass
class CheckpointSaverConfig(StrictConfig):
    """What both savers share.

    Attributes:
        writer_config: :class:`CheckpointWriterConfig`.
        wait_timeout_secs: how long a save (and ``prewarm_staging``) waits for the previous
            background write (non-negative, or None to wait as long as it takes); a write still
            running then raises ``TimeoutError`` and stays tracked. A synchronous save has no
            previous write to wait for.
    """

    FIXED_AT_BUILD = frozenset({"writer_config"})

    writer_config: CheckpointWriterConfig = field(default_factory=CheckpointWriterConfig)
    wait_timeout_secs: float | None = DEFAULT_WAIT_TIMEOUT_SECS

    def _check(self, name: str, value: Any) -> None:
        if name == "writer_config" and not isinstance(value, CheckpointWriterConfig):
            raise TypeError(
                f"{type(self).__qualname__}.writer_config must be a CheckpointWriterConfig, "
                f"got {type(value).__name__}"
            )
        if name == "wait_timeout_secs":
            _timeout(self, name, value, allow_none=True)


@dataclass
class SyncCheckpointSaverConfig(CheckpointSaverConfig):
    """Inline saving: ``save`` writes durably and returns None (fields: see the base)."""


@dataclass
class AsyncCheckpointSaverConfig(CheckpointSaverConfig):
    """Background saving: ``save`` returns a Future resolved once the write is durable.

    Attributes:
        writer_config, wait_timeout_secs: see :class:`CheckpointSaverConfig`.
        staging_config: :class:`CheckpointStagerConfig`.
        process_config: only ``None``: there is no writer process to configure (its init and
            shutdown timeouts have no counterpart; the thread starts with the manager).
    """

    FIXED_AT_BUILD = frozenset({"writer_config", "staging_config"})

    staging_config: CheckpointStagerConfig = field(default_factory=CheckpointStagerConfig)
    process_config: Any = None

    def _check(self, name: str, value: Any) -> None:
        if name == "staging_config" and not isinstance(value, CheckpointStagerConfig):
            raise TypeError(
                "AsyncCheckpointSaverConfig.staging_config must be a CheckpointStagerConfig, "
                f"got {type(value).__name__}"
            )
        if name == "process_config":
            self._need_none(name, value, f"{_THREAD_DESIGN}; there is no process to configure")
        super()._check(name, value)


@dataclass
class CheckpointLoaderConfig(StrictConfig):
    """Loader options.

    Attributes:
        use_mmap: ``True`` (default): loaded tensors that are not copied into a template are
            views of a private, read-only-backed mapping of the verified file (no copy).
            ``False``: they are copied into ordinary memory and the mapping is released. An
            item read straight into its templates (:mod:`fastckpt.manager.load`) maps
            nothing: its other tensors are read into private memory either way.
    """

    use_mmap: bool = True

    def _check(self, name: str, value: Any) -> None:
        self._need_bool(name, value)


@dataclass
class LocalFileSystemStorageConfig(StrictConfig):
    """Storage: the local filesystem, and client options for ``s3://`` checkpoint ids.

    Attributes:
        use_direct_io: True tries O_DIRECT (falling back safely), False writes through the
            page cache, None (default) picks per file (:func:`fastckpt.io.files.choose_direct_io`:
            O_DIRECT for files of 64 MiB and more, buffered below).
        storage_options: object-store client options (endpoint_url, region, access_key_id,
            ... as for :func:`fastckpt.configure_storage`) for every ``s3://`` checkpoint id
            the manager saves or loads, over the AWS environment: they are registered for
            each id's prefix (as ``configure_storage(id, storage_options)``) when the manager
            touches it. None (default): the AWS environment and config files. A local id is
            refused while they are set (``StorageOptionsError``).
    """

    FIXED_AT_BUILD = frozenset({"use_direct_io", "storage_options"})

    use_direct_io: bool | None = None
    storage_options: Mapping[str, Any] | None = None

    def _check(self, name: str, value: Any) -> None:
        if name == "storage_options":
            if value is not None:
                from fastckpt.storage.s3.config import S3Options

                if not isinstance(value, Mapping):
                    raise TypeError(
                        f"{type(self).__qualname__}.storage_options must be a mapping of client "
                        f"options or None, got {value!r}"
                    )
                S3Options.from_mapping(value)  # unknown keys / bad values fail here
            return
        if value is not None:
            self._need_bool(name, value)


@dataclass
class TiersConfig(StrictConfig):
    """A fast tier that takes every checkpoint and a durable tier that takes every N-th,
    promoted in the background (``CheckpointManager.Config.tiers``; see docs/tiers.md).

    With tiers, ``save(checkpoint_id, ...)`` takes a checkpoint *name* (``"step_100"``, or a
    path directly inside ``fast``): the checkpoint is written to ``fast/<name>`` and, when
    due, copied to ``durable/<name>`` as a committed checkpoint on a background thread.
    :meth:`CheckpointManager.latest` / :meth:`CheckpointManager.load_latest` restore the
    newest checkpoint that verifies on either tier, the fast one first.

    Attributes:
        fast: the fast tier root: node-local disk, or a ``/dev/shm`` directory for a RAM tier
            that survives a crash of the training process (a local path).
        durable: the durable tier root: a shared filesystem or ``s3://bucket/prefix``.
        promote_every: promote every N-th save of this manager (the first save of a process
            is promoted, then every N-th after it); default 1: every save.
        keep_last: keep the newest N checkpoints on the fast tier (None: all). Never
            deleted: the newest one that verifies, the newest checkpoint waiting for its
            promotion, and those the running promotion copies; older ones still waiting may
            be deleted (the newest waiting one supersedes them: a lagging durable tier then
            gets the newer one instead).
        durable_keep_last: keep the newest N checkpoints on the durable tier (None: all);
            the newest one that verifies is never deleted.
        strict: a failed promotion raises :class:`~fastckpt.errors.PromotionError` at the
            next save; by default it is reported (a warning, ``on_error``,
            ``CheckpointManager.promotion_healthy``), retried with the next promotion, and
            raised by ``close``.
        on_error: called with each failed promotion's ``PromotionError`` (on the promotion
            thread).
        durable_storage_options: object-store client options for an ``s3://`` durable tier
            (as for :func:`fastckpt.configure_storage`); None: the AWS environment.
        detached: run the promotions in a process of its own (a new session) that a killed
            trainer leaves to finish it (see :mod:`fastckpt.container.detached`).
    """

    FIXED_AT_BUILD = frozenset(
        {
            "fast",
            "durable",
            "promote_every",
            "keep_last",
            "durable_keep_last",
            "strict",
            "on_error",
            "durable_storage_options",
            "detached",
        }
    )

    fast: str | os.PathLike[str] | None = None
    durable: str | os.PathLike[str] | None = None
    promote_every: int = 1
    keep_last: int | None = None
    durable_keep_last: int | None = None
    strict: bool = False
    on_error: Callable[..., object] | None = None
    durable_storage_options: Mapping[str, Any] | None = None
    detached: bool = False

    def _check(self, name: str, value: Any) -> None:
        if name in ("fast", "durable"):
            if value is not None and not isinstance(value, (str, os.PathLike)):
                raise TypeError(f"TiersConfig.{name} must be a path, got {value!r}")
        elif name in ("promote_every", "keep_last", "durable_keep_last"):
            if value is None and name != "promote_every":
                return
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise self._fail(name, f"must be a positive integer, got {value!r}")
        elif name in ("strict", "detached"):
            self._need_bool(name, value)
        elif name == "on_error" and value is not None and not callable(value):
            raise TypeError(f"TiersConfig.on_error must be callable or None, got {value!r}")
        elif name == "durable_storage_options" and value is not None:
            from fastckpt.storage.s3.config import S3Options  # deferred: the S3 client

            if not isinstance(value, Mapping):
                raise TypeError(
                    f"TiersConfig.durable_storage_options must be a mapping, got {value!r}"
                )
            S3Options.from_mapping(value)  # unknown keys / bad values fail here

    def roots(self) -> tuple[Path, Path]:
        """``(fast, durable)`` as paths.

        Raises:
            ValueError: one is missing, or the fast tier is not a local path.
        """
        if self.fast is None or self.durable is None:
            raise ValueError("TiersConfig needs both fast= and durable= roots")
        fast, durable = Path(self.fast), Path(self.durable)
        if is_object_url(fast):
            raise ValueError(
                f"TiersConfig.fast must be a local directory (node-local disk or /dev/shm), "
                f"got {display_path(fast)}"
            )
        if os.path.realpath(fast) == os.path.realpath(durable):
            raise ValueError(f"TiersConfig: fast and durable are both {display_path(fast)}")
        return fast, durable
