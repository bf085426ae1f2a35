"""``CheckpointManager``: async/sync saves of arbitrary training state, ``load(into=...)``.

A checkpoint is a directory (``checkpoint_id``). Each top-level key of the saved state becomes
``<key>.json`` (the structure, via :mod:`fastckpt.tree`) plus ``<key>.safetensors`` (its
tensors; ``<key>.rank<r>.safetensors`` per rank under a process group), and ``commit.json``
records every file with its size and crc32c. The directory is written as a temporary sibling
and swapped into place, so a reader sees the old checkpoint or the new one, never a mix.

Async saves stage a snapshot into reusable host buffers (:mod:`fastckpt.staging`), then a
single background thread writes it through the Rust core with the GIL released. Hold
:meth:`CheckpointManager.lock` around code that mutates the state (the optimizer step): it
blocks only while a capture is in progress.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fastckpt import tree
from fastckpt.errors import CheckpointMismatchError, FastCkptError
from fastckpt.files import DEFAULT_WRITE_THREADS
from fastckpt.progress import log_throughput
from fastckpt.staging import (
    BackgroundWriter,
    Stager,
    StagerOptions,
    make_stager,
    stage_groups,
)
from fastckpt.stateful import check_template, contains_stateful, prepare_save, restore
from fastckpt.store.backend import TEMP_PREFIX
from fastckpt.store.commit import DirectoryWriter
from fastckpt.store.paths import check_name
from fastckpt.store.reader import read_manager_item
from fastckpt.store.records import COMMIT_RECORD, commit_record, read_commit_record

__all__ = [
    "AsyncCheckpointSaverConfig",
    "CheckpointLoaderConfig",
    "CheckpointManager",
    "CheckpointStagerConfig",
    "CheckpointWriterConfig",
    "ItemSpec",
    "LocalFileSystemStorageConfig",
    "SyncCheckpointSaverConfig",
]


def _cuda() -> bool:
    return torch.cuda.is_available()


@dataclass
class ItemSpec:
    """How one top-level key of the state is saved.

    Attributes:
        requires_copy: stage a snapshot copy before the background write. ``False`` writes the
            live tensors directly (only safe if they are not mutated until the write is done).
        layout: file layout; only ``None`` (one safetensors + one JSON file per item).
        required: at load, a missing required item is an error; optional items are skipped.
    """

    requires_copy: bool = True
    layout: str | None = None
    required: bool = True


@dataclass
class CheckpointStagerConfig:
    """Staging options; the CUDA-dependent defaults are decided when the config is built.

    Attributes:
        use_pinned_memory: pinned host buffers for CUDA tensors.
        use_shared_memory: accepted for compatibility; staging stays in this process.
        use_async_staging: capture on the background thread (``save`` returns at once; hold
            :meth:`CheckpointManager.lock` while mutating state).
        use_non_blocking_copy: non-blocking device-to-host copies on a side stream.
    """

    use_pinned_memory: bool = field(default_factory=_cuda)
    use_shared_memory: bool = False
    use_async_staging: bool = True
    use_non_blocking_copy: bool = field(default_factory=_cuda)


@dataclass
class CheckpointWriterConfig:
    """Writer options.

    Attributes:
        file_write_max_threads: parallel writer threads per file.
        temp_dir_prefix: accepted for compatibility (temporary siblings use ``.tmp-``).
    """

    file_write_max_threads: int = DEFAULT_WRITE_THREADS
    temp_dir_prefix: str = TEMP_PREFIX


@dataclass
class AsyncCheckpointSaverConfig:
    """Background saving: ``save`` returns a Future resolved once the write is durable."""

    staging_config: CheckpointStagerConfig = field(default_factory=CheckpointStagerConfig)
    writer_config: CheckpointWriterConfig = field(default_factory=CheckpointWriterConfig)
    wait_timeout_secs: float = 600


@dataclass
class SyncCheckpointSaverConfig:
    """Inline saving: ``save`` writes durably and returns None."""

    writer_config: CheckpointWriterConfig = field(default_factory=CheckpointWriterConfig)
    wait_timeout_secs: float = 600


@dataclass
class CheckpointLoaderConfig:
    """Loader options (``use_mmap`` accepted for compatibility: loads always map the files
    privately and verify them, see :func:`fastckpt.files.read_tensors`)."""

    use_mmap: bool = False


@dataclass
class LocalFileSystemStorageConfig:
    """Local filesystem storage.

    ``use_direct_io``: True tries O_DIRECT (falling back safely), False writes through the page
    cache, None (default) picks per file (:func:`fastckpt.files.choose_direct_io`: buffered
    while a file fits in the kernel's background-writeback allowance, O_DIRECT above).
    """

    use_direct_io: bool | None = None


@dataclass
class _ManagerConfig:
    """``CheckpointManager.Config``: per-item specs, saver, loader and storage choices.

    Attributes:
        items: per top-level key :class:`ItemSpec`.
        default: spec for keys not in ``items``; ``None`` is strict mode (unknown keys refused).
        save: :class:`AsyncCheckpointSaverConfig` or :class:`SyncCheckpointSaverConfig`.
        load: :class:`CheckpointLoaderConfig`.
        storage_config: :class:`LocalFileSystemStorageConfig` (default when None).
    """

    items: dict[str, ItemSpec] = field(default_factory=dict)
    default: ItemSpec | None = field(default_factory=ItemSpec)
    save: AsyncCheckpointSaverConfig | SyncCheckpointSaverConfig = field(
        default_factory=AsyncCheckpointSaverConfig
    )
    load: CheckpointLoaderConfig = field(default_factory=CheckpointLoaderConfig)
    storage_config: LocalFileSystemStorageConfig | None = None

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


class _DistributedContext:
    """Rank information and a gloo group for the writer thread's collectives."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.active = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self.rank = dist.get_rank() if self.active else 0
        self.world_size = dist.get_world_size() if self.active else 1
        # A dedicated group so background-thread collectives never interleave with training's.
        self.group: Any = dist.new_group(backend="gloo") if self.active else None

    def barrier(self) -> None:
        if self.active:
            import torch.distributed as dist

            dist.barrier(group=self.group)

    def gather(self, value: Any) -> list[Any]:
        if not self.active:
            return [value]
        import torch.distributed as dist

        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, value, group=self.group)
        return gathered


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
        for key, spec in self.config.items.items():
            if spec.layout is not None:
                raise ValueError(
                    f"item {key!r}: layout {spec.layout!r} is not supported (use None)"
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
        self._dcp_writer: Any = None  # fastckpt.dcp.Writer, made at the first sharded save
        storage = self.config.storage_config or LocalFileSystemStorageConfig()
        self._direct_io = storage.use_direct_io
        self._threads = self.config.save.writer_config.file_write_max_threads
        self._dist = _DistributedContext()
        self._writer: BackgroundWriter[None] | None = (
            BackgroundWriter("fastckpt-writer", wait_timeout=self.config.save.wait_timeout_secs)
            if self._async
            else None
        )
        self._closed = False

    # ------------------------------------------------------------------ context manager

    def __enter__(self) -> CheckpointManager:
        """Use as ``with CheckpointManager(...) as manager:``; closes on exit."""
        return self

    def __exit__(self, *exc: object) -> None:
        """Wait for the last write and close."""
        self.close()

    # ------------------------------------------------------------------ save

    def _check_open(self, action: str) -> None:
        if self._closed:
            raise RuntimeError(f"CheckpointManager is closed; cannot {action}")

    def _spec(self, key: str) -> ItemSpec:
        spec = self.config.items.get(key, self.config.default)
        if spec is None:
            raise KeyError(
                f"state key {key!r} has no ItemSpec and Config.default is None (strict mode); "
                f"add it to Config.items or set Config.default"
            )
        return spec

    def save(self, checkpoint_id: str | Path, state: Mapping[str, Any]) -> Future[None] | None:
        """Save ``state`` as checkpoint directory ``checkpoint_id`` (replaced atomically).

        Args:
            checkpoint_id: directory path of the checkpoint.
            state: top-level keys become files; values are nests of tensors and plain values,
                and objects with ``state_dict()`` / ``load_state_dict()`` (modules,
                optimizers, schedulers, your own classes), saved as their ``state_dict()``.

        Returns:
            Async: a Future resolved when the checkpoint is durable. Sync: None.

        Raises:
            RuntimeError: the manager is closed, or the previous background write failed
                (raised once; the next save works).
            TimeoutError: the previous background write is still running after
                ``wait_timeout_secs`` (nothing new is started; it stays tracked).
            ValueError / KeyError / TypeError: invalid keys or values (nothing written).
        """
        self._check_open("save")
        if self._writer is not None:
            self._writer.collect()
        path = Path(checkpoint_id)
        check_name(path.name, "checkpoint directory name")
        prepared: dict[str, Any] = {}
        for key, value in state.items():
            check_name(key, "state key")
            self._spec(key)
            prepared[key] = prepare_save(value, key)
        for key, spec in self.config.items.items():
            if spec.required and key not in state:
                raise KeyError(f"required item {key!r} is missing from the saved state")
        if _sharded_state(prepared):
            return self._save_sharded(path, prepared)
        skeletons: dict[str, Any] = {}
        tensors: dict[str, dict[str, torch.Tensor]] = {}
        for key, value in prepared.items():
            skeletons[key], tensors[key] = tree.flatten(value)
        snapshot = _Snapshot(path, skeletons, tensors)
        if self._writer is None:
            self._write(snapshot)
            return None

        def capture() -> None:
            stage_groups(
                self._stager, snapshot.tensors, lambda key, _: self._spec(key).requires_copy
            )

        if not self._async_staging:
            self._writer.capture(capture)
        return self._writer.submit(
            str(path),
            lambda: self._write(snapshot),
            capture=capture if self._async_staging else None,
        )

    def _save_sharded(self, path: Path, state: dict[str, Any]) -> Future[None] | None:
        """Save state holding DTensors as a sharded checkpoint through :mod:`fastckpt.dcp`
        (collective: every rank saves its own shards; the coordinator commits)."""
        from fastckpt.dcp.state import async_save_state, save_state

        writer = self._sharded_writer(path)
        if self._writer is None:
            with _typed_dcp_errors():
                save_state(path, state, writer=writer, process_group=self._dist.group)
            return None
        # DCP stages this rank's shards into the writer's reused buffers before returning;
        # the manager's background thread then tracks the upload like any other write, so
        # collect(), wait_timeout_secs and close() treat both kinds alike.
        with _typed_dcp_errors():
            future = async_save_state(path, state, writer=writer, process_group=self._dist.group)

        def wait() -> None:
            with _typed_dcp_errors():
                future.result()

        return self._writer.submit(str(path), wait)

    def _sharded_writer(self, path: Path) -> Any:
        """The manager's one :class:`fastckpt.dcp.Writer` (its staging buffers are reused)."""
        if self._dcp_writer is None:
            from fastckpt.dcp.writer import Writer

            self._dcp_writer = Writer(
                path,
                threads=self._threads,
                direct_io=self._direct_io,
                stager_options=self._stager_options,
            )
        return self._dcp_writer

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
        start = time.perf_counter()
        final = snapshot.path
        writer = DirectoryWriter(final, direct_io=self._direct_io, threads=self._threads)
        try:
            for key, skeleton in snapshot.skeletons.items():
                writer.add_tensors(self._tensor_file(key), snapshot.tensors[key])
                if self._dist.rank == 0:
                    writer.add_json(f"{key}.json", {"skeleton": skeleton})
            self._commit(writer, list(snapshot.skeletons))
        except BaseException:
            writer.abort()
            raise
        log_throughput("saved", str(final), writer.files.values(), start)

    def _commit(self, writer: DirectoryWriter, items: list[str]) -> None:
        if not self._dist.active:
            writer.add_json(COMMIT_RECORD, commit_record(items, writer.files, 1))
            writer.commit()
            return
        # Each rank staged its own files; rank 0 gathers the files records, adopts every
        # rank's files and commits once all ranks are done.
        gathered = self._dist.gather((writer.location, writer.files))
        if self._dist.rank == 0:
            for location, files in gathered[1:]:
                writer.adopt(location, files)
            record = commit_record(items, writer.files, self._dist.world_size)
            writer.add_json(COMMIT_RECORD, record)
            writer.commit()
        self._dist.barrier()
        if self._dist.rank != 0:
            writer.abort()

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
                leaves are filled in place (dtype and shape must match), non-tensor leaves are
                replaced, objects with ``load_state_dict()`` are restored through it (their
                tensors checked first), and a ``None`` template loads the whole item. ``None``
                loads all.
            map_location: device for tensors that are not copied into a template.
            strict: raise on keys a template has but the checkpoint lacks.

        Returns:
            ``{key: value}`` for each loaded item.

        Raises:
            RuntimeError: the manager is closed.
            TypeError: a template value a load cannot apply, by key path (nothing is read).
            CheckpointMismatchError: dtype/shape mismatch or (strict) missing key, by key path.
            CheckpointFormatError / ChecksumMismatchError: damaged files.
            FileNotFoundError: no such checkpoint.
        """
        self._check_open("load")
        start = time.perf_counter()
        directory = Path(checkpoint_id)
        if into is not None:
            for key, template in into.items():
                check_template(template, key)
        if _is_sharded(directory):
            return self._load_sharded(directory, into, map_location, strict)
        record = read_commit_record(directory)
        available = record["items"]
        keys = list(available) if into is None else list(into)
        result: dict[str, Any] = {}
        for key in keys:
            if key not in available:
                if strict:
                    raise CheckpointMismatchError(f"{key}: not in checkpoint {directory}")
                if into is not None:
                    result[key] = into[key]
                continue
            value = _load_item(directory, record, key, self._dist.rank, map_location)
            template = None if into is None else into[key]
            result[key] = restore(template, value, key, strict, _merge)
        log_throughput("loaded", str(directory), record["files"].values(), start)
        return result

    def _load_sharded(
        self,
        directory: Path,
        into: Mapping[str, Any] | None,
        map_location: str | torch.device | None,
        strict: bool,
    ) -> dict[str, Any]:
        """Load a sharded checkpoint (collective): templates are filled in place, DTensors
        resharded onto their own placements; stateful objects get ``load_state_dict()``."""
        from fastckpt.dcp.state import load_state

        templates = (
            None if into is None else {key: prepare_save(value, key) for key, value in into.items()}
        )
        with _typed_dcp_errors():
            loaded = load_state(directory, templates, strict=strict, process_group=self._dist.group)
        result: dict[str, Any] = {}
        for key, value in loaded.items():
            template = None if into is None else into[key]
            if template is None:
                result[key] = _to_location(value, map_location)
            elif contains_stateful(template):
                result[key] = restore(template, value, key, strict, _merge)
            else:
                result[key] = value  # the template itself, filled in place
        return result

    # ------------------------------------------------------------------ close

    def close(self) -> None:
        """Wait until the last checkpoint is durable, then release the writer. Idempotent.

        Raises:
            RuntimeError: the last background write failed (chained to its error).
        """
        if self._closed:
            return
        self._closed = True
        if self._writer is not None:
            self._writer.close()


def _sharded_state(state: Mapping[str, Any]) -> bool:
    """Whether a (prepared) state holds DTensors, i.e. must be saved through DCP."""
    if "torch.distributed.tensor" not in sys.modules:
        return False  # nobody made a DTensor in this process
    from fastckpt.dcp.state import contains_dtensors

    return contains_dtensors(state)


@contextlib.contextmanager
def _typed_dcp_errors() -> Iterator[None]:
    """Re-raise DCP's ``CheckpointException`` (a ``BaseException`` that ``except Exception``
    misses) as the fastckpt error a rank raised (``ChecksumMismatchError`` naming the file,
    ``UnsupportedValueError``, ...), chained; the same on every rank, since DCP gathers the
    failures. Other failures become a ``RuntimeError`` carrying DCP's per-rank report."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as err:
        failures = [failure for failure, _ in err.failures.values()]
        for failure in failures:
            if isinstance(failure, FastCkptError):
                raise failure from err
        raise RuntimeError(str(err)) from err


def _is_sharded(directory: Path) -> bool:
    from fastckpt.dcp.commit import RECORD_NAME

    return (directory / RECORD_NAME).is_file()


def _to_location(value: Any, map_location: str | torch.device | None) -> Any:
    if map_location is None:
        return value
    return tree.map_tensors(value, lambda tensor: tensor.to(map_location))


def _load_item(
    directory: Path, record: Mapping[str, Any], key: str, rank: int, map_location: Any
) -> Any:
    """One item of a checkpoint: its skeleton and this rank's tensors, both verified."""
    skeleton, tensors = read_manager_item(directory, record, key, rank)
    if map_location is not None:
        tensors = {name: t.to(map_location) for name, t in tensors.items()}
    return tree.unflatten(skeleton, tensors, key)


def _merge(template: Any, value: Any, path: str, strict: bool) -> Any:
    """Apply a loaded value to a template (see :meth:`CheckpointManager.load`)."""
    if template is None:
        return value
    if isinstance(template, torch.Tensor):
        if not isinstance(value, torch.Tensor):
            raise CheckpointMismatchError(
                f"{path}: expected a tensor, found {type(value).__name__}"
            )
        if template.dtype != value.dtype or template.shape != value.shape:
            raise CheckpointMismatchError(
                f"{path}: template has dtype {template.dtype} shape {tuple(template.shape)}, "
                f"checkpoint has dtype {value.dtype} shape {tuple(value.shape)}; no implicit "
                "cast or broadcast is done: fix the template or convert after loading"
            )
        with torch.no_grad():
            template.copy_(value)
        return template
    if isinstance(template, Mapping):
        if not isinstance(value, Mapping):
            raise CheckpointMismatchError(
                f"{path}: expected a mapping, found {type(value).__name__}"
            )
        merged = dict(template)
        for key, sub in template.items():
            if key in value:
                merged[key] = _merge(sub, value[key], tree.join_path(path, key), strict)
            elif strict:
                raise CheckpointMismatchError(f"{tree.join_path(path, key)}: missing in checkpoint")
        if isinstance(template, dict):
            template.update(merged)
            return template
        return merged
    if isinstance(template, (list, tuple)):
        if not isinstance(value, (list, tuple)):
            raise CheckpointMismatchError(
                f"{path}: expected a sequence, found {type(value).__name__}"
            )
        items = []
        for i, sub in enumerate(template):
            if i < len(value):
                items.append(_merge(sub, value[i], tree.join_path(path, i), strict))
            elif strict:
                raise CheckpointMismatchError(f"{tree.join_path(path, i)}: missing in checkpoint")
            else:
                items.append(sub)
        if isinstance(template, list):
            template[:] = items
            return template
        return tuple(items)
    return value
