"""The writers compared by the harness, each made durable (every file it wrote fsynced).

A writer saves the benchmark state to a target path and reports how long until the bytes were
durable and the *stall*: how long until the calling (training) thread may change the state
again (the same for synchronous writers). For an async save that is not when the save call
returns but when the snapshot is captured: ``manager.lock()`` taken for the managers (the next
optimizer step must take it), staging done for DCP's ``async_save``; when the call returned is
recorded beside it. Peers that do not fsync on their own are fsynced by the harness inside the
timed region, along with their directory, the same as fastckpt does for its files.
"""

from __future__ import annotations

import errno
import os
import shutil
import time
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from fastckpt import _native
from fastckpt.io import files

__all__ = [
    "CEILING_BLOCK",
    "TC_STORAGE",
    "WRITERS",
    "WriteTiming",
    "Writer",
    "WriterUnavailable",
    "ceiling_block",
    "dcp_staged",
    "fix_default_write_mode",
    "fsync_path",
    "make_writers",
    "path_bytes",
    "remove_path",
    "save_until_reusable",
    "torch_checkpointing_manager",
]

#: Block size of the O_DIRECT ceiling stream (the same as fastckpt's default chunk).
CEILING_BLOCK = files.DEFAULT_CHUNK_SIZE

State = Mapping[str, torch.Tensor]


class WriterUnavailable(RuntimeError):
    """The writer cannot run here (its API is missing); the reason is the message."""


@dataclass
class WriteTiming:
    """One timed write.

    Attributes:
        seconds: wall time until every byte was durable.
        stall_seconds: wall time until the caller may change the saved state again (==
            seconds when synchronous; async: the save call returned and the snapshot is
            captured).
        details: writer-specific facts (e.g. whether O_DIRECT was actually used).
        returned_seconds: async writers: wall time until the save call returned (the state
            may still be being captured then); None: when the stall ended.
    """

    seconds: float
    stall_seconds: float
    details: dict[str, Any] = field(default_factory=dict)
    returned_seconds: float | None = None


def fsync_path(path: Path) -> None:
    """fsync a file, or every file under a directory, then the containing directories."""
    dirs: set[Path] = {path.parent}
    if path.is_dir():
        dirs.add(path)
        for root, _, names in os.walk(path):
            dirs.add(Path(root))
            for name in names:
                _fsync_one(Path(root) / name, os.O_RDONLY)
    else:
        _fsync_one(path, os.O_RDONLY)
    for directory in dirs:
        _fsync_dir(directory)


def _fsync_one(path: Path, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(directory: Path) -> None:
    _fsync_one(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))


def path_bytes(path: Path) -> int:
    """Bytes on disk under ``path`` (a file or a directory tree); 0 if it does not exist."""
    if path.is_file():
        return path.stat().st_size
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return 0


def remove_path(path: Path) -> None:
    """Delete a file or directory tree if it exists."""
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


class Writer(ABC):
    """One way of saving the state. Subclasses set ``name``/``label`` and implement write."""

    #: Short identifier used on the command line and as the JSON key.
    name: ClassVar[str]
    #: Human-readable description for tables.
    label: ClassVar[str]
    #: Whether the calling thread is released before the bytes are durable.
    is_async: ClassVar[bool] = False
    #: File suffix of the target ("" for directories).
    suffix: ClassVar[str] = ""

    def open(self) -> None:
        """Acquire long-lived resources (thread pools, staging buffers).

        Raises:
            WriterUnavailable: the writer cannot run in this environment.
        """
        return None

    @abstractmethod
    def write(self, state: State, target: Path) -> WriteTiming:
        """Save ``state`` to ``target`` durably and time it."""

    def close(self) -> None:
        """Release what :meth:`open` acquired."""
        return None

    def target(self, directory: Path) -> Path:
        """Where this writer's output goes inside ``directory``."""
        return directory / f"{self.name}{self.suffix}"


def _timed_sync(action: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    result = action()
    return time.perf_counter() - start, result


class FastckptWriter(Writer):
    """``fastckpt.save_file`` (sync) as users get it: the automatic write mode
    (:func:`fastckpt.io.files.choose_direct_io`), checksums on. The notes say which mode ran."""

    name = "fastckpt"
    label = "fastckpt save_file (default mode: O_DIRECT from 64 MiB)"
    suffix = ".safetensors"
    direct_io: bool | None = None
    checksums = True

    def write(self, state: State, target: Path) -> WriteTiming:
        """Save with :func:`fastckpt.io.files.write_tensors` (fsync + rename + dir fsync)."""
        seconds, report = _timed_sync(
            lambda: files.write_tensors(
                state, target, direct_io=self.direct_io, checksums=self.checksums
            )
        )
        return WriteTiming(seconds, seconds, {"direct_io": bool(report["direct_io"])})


class FastckptDirectWriter(FastckptWriter):
    """``fastckpt.save_file`` with O_DIRECT forced (``direct_io=True``)."""

    name = "fastckpt-direct"
    label = "fastckpt save_file (O_DIRECT forced)"
    direct_io = True


class FastckptBufferedWriter(FastckptWriter):
    """``fastckpt.save_file`` through the page cache (``direct_io=False``): the other write
    mode, measured side by side with the default so the choice can be checked."""

    name = "fastckpt-buffered"
    label = "fastckpt save_file (buffered forced)"
    direct_io = False


class FastckptNoChecksumWriter(FastckptWriter):
    """``fastckpt.save_file`` with checksums off: the other half of the checksum-cost figure."""

    name = "fastckpt-nocrc"
    label = "fastckpt save_file (default mode, no crc)"
    checksums = False


def save_until_reusable(manager: Any, target: Path, state: State) -> WriteTiming:
    """``manager.save(target, {"state": state})`` on an async manager (fastckpt's or
    torch_checkpointing's, which share the contract), timed until the future resolved.

    The stall lasts until the caller may change the state again: ``save()`` returned and
    ``manager.lock()``, which an optimizer step must hold, was taken (it blocks while the
    snapshot is being captured). When ``save()`` returned is ``returned_seconds``.
    """
    start = time.perf_counter()
    future = manager.save(str(target), {"state": dict(state)})
    returned = time.perf_counter() - start
    with manager.lock():
        stall = time.perf_counter() - start
    future.result()
    return WriteTiming(time.perf_counter() - start, stall, returned_seconds=returned)


class FastckptAsyncWriter(Writer):
    """``CheckpointManager`` with async saves: stall until the state may be changed again
    (:func:`save_until_reusable`), total until durable.

    One manager lives across all repetitions, as it would across a training run.
    """

    name = "fastckpt-async"
    label = "fastckpt CheckpointManager async"
    is_async = True

    def __init__(self) -> None:
        self._manager: Any = None

    def open(self) -> None:
        """Create the manager.

        Raises:
            WriterUnavailable: ``fastckpt.manager.CheckpointManager`` cannot be imported or
                configured for async saves.
        """
        self._manager = open_async_manager()

    def write(self, state: State, target: Path) -> WriteTiming:
        """Save through the manager; the future resolves when the checkpoint is durable."""
        return save_until_reusable(self._manager, target, state)

    def close(self) -> None:
        """Close the manager (waits for outstanding saves)."""
        if self._manager is not None:
            self._manager.close()
            self._manager = None


def open_async_manager() -> Any:
    """A ``CheckpointManager`` configured for async saves.

    Raises:
        WriterUnavailable: the manager is not available in this build.
    """
    try:
        from fastckpt.manager import CheckpointManager  # type: ignore[import-not-found,unused-ignore]
    except Exception as err:  # ImportError, or a half-written module failing on import
        raise WriterUnavailable(f"fastckpt.manager.CheckpointManager: {err!r}") from err
    try:
        return CheckpointManager(CheckpointManager.Config.with_async_save())
    except Exception as err:
        raise WriterUnavailable(f"CheckpointManager(Config.with_async_save()): {err!r}") from err


class FastckptManagerWriter(Writer):
    """``CheckpointManager`` with sync saves (``Config.with_sync_save()``): durable, committed
    and fsynced when ``save()`` returns. The state is saved as one item, ``{"state": ...}``,
    as the async writer saves it."""

    name = "fastckpt-manager"
    label = "fastckpt CheckpointManager sync"

    def __init__(self) -> None:
        self._manager: Any = None

    def open(self) -> None:
        """Create the manager (one for every repetition, as in a training run)."""
        from fastckpt.manager import CheckpointManager

        self._manager = CheckpointManager(CheckpointManager.Config.with_sync_save())

    def write(self, state: State, target: Path) -> WriteTiming:
        """``manager.save(target, {"state": state})``."""
        seconds, _ = _timed_sync(lambda: self._manager.save(str(target), {"state": dict(state)}))
        return WriteTiming(seconds, seconds)

    def close(self) -> None:
        """Close the manager."""
        if self._manager is not None:
            self._manager.close()
            self._manager = None


#: What the torch_checkpointing rows run with: its ``LocalFileSystemStorage`` through the page
#: cache. Its default, ``use_direct_io=True``, writes the file with O_DIRECT and fails with
#: EINVAL on the unaligned tail of a file on ext4 (the ``tc-direct`` row records that).
TC_STORAGE = "LocalFileSystemStorageConfig(use_direct_io=False)"


def torch_checkpointing_manager(*, async_save: bool, direct_io: bool) -> Any:
    """A ``torch_checkpointing.CheckpointManager`` (sync or async preset) whose file storage
    uses O_DIRECT or not.

    Raises:
        WriterUnavailable: torch_checkpointing (PyPI ``torch-checkpointing``) is not installed.
    """
    try:
        from torch_checkpointing import CheckpointManager
        from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig
    except Exception as err:  # ImportError, or a torch too old for it
        raise WriterUnavailable(f"torch_checkpointing: {err!r}") from err
    presets = CheckpointManager.Config
    config = presets.with_async_save() if async_save else presets.with_sync_save()
    config.storage_config = LocalFileSystemStorageConfig(use_direct_io=direct_io)
    return config.build()


def _tc_version() -> dict[str, str]:
    """``{"version": torch_checkpointing.__version__}`` (empty if it has none)."""
    import torch_checkpointing

    version = getattr(torch_checkpointing, "__version__", None)
    return {} if version is None else {"version": str(version)}


def _remove_tc_leftovers(target: Path) -> None:
    """torch_checkpointing writes into ``tmp_<name>`` beside the target and renames it; a
    failed write leaves that directory behind."""
    remove_path(target.with_name(f"tmp_{target.name}"))


class TorchCheckpointingWriter(Writer):
    """torch_checkpointing's ``CheckpointManager`` sync save (``Config.with_sync_save()``) with
    :data:`TC_STORAGE`. It does not fsync: the harness fsyncs its files and directories inside
    the timed region."""

    name = "tc-sync"
    label = "torch_checkpointing CheckpointManager sync (buffered storage) + fsync"
    direct_io = False

    def __init__(self) -> None:
        self._manager: Any = None

    def open(self) -> None:
        """Create the manager.

        Raises:
            WriterUnavailable: torch_checkpointing is not installed.
        """
        self._manager = torch_checkpointing_manager(async_save=False, direct_io=self.direct_io)

    def write(self, state: State, target: Path) -> WriteTiming:
        """``manager.save(target, {"state": state})``, then fsync."""

        def action() -> None:
            self._manager.save(str(target), {"state": dict(state)})
            fsync_path(target)

        try:
            seconds, _ = _timed_sync(action)
        except OSError as err:
            _remove_tc_leftovers(target)
            if err.errno == errno.EINVAL and self.direct_io:
                raise RuntimeError(
                    "torch_checkpointing's default storage, LocalFileSystemStorageConfig("
                    "use_direct_io=True), failed: O_DIRECT refused the file's unaligned tail "
                    f"on this filesystem ({err})"
                ) from err
            raise
        return WriteTiming(seconds, seconds, {"direct_io": self.direct_io, **_tc_version()})

    def close(self) -> None:
        """Close the manager."""
        if self._manager is not None:
            self._manager.close()
            self._manager = None


class TorchCheckpointingDirectWriter(TorchCheckpointingWriter):
    """torch_checkpointing's sync save with its default storage (``use_direct_io=True``), which
    fails with EINVAL on filesystems that refuse unaligned O_DIRECT writes (ext4): a failed
    row that says so, not a crash."""

    name = "tc-direct"
    label = "torch_checkpointing CheckpointManager sync (default O_DIRECT storage) + fsync"
    direct_io = True


class TorchCheckpointingAsyncWriter(Writer):
    """torch_checkpointing's ``CheckpointManager`` async save (``Config.with_async_save()``,
    staging through shared memory, a writer subprocess) with :data:`TC_STORAGE`: stall until
    the state may be changed again (:func:`save_until_reusable`: its manager has the same
    ``lock()``), total until its future resolved and the harness fsynced the files.

    The subprocess starts on the first save (the warm-up round); its memory is not the
    training process's, so the memory figure does not include it.
    """

    name = "tc-async"
    label = "torch_checkpointing CheckpointManager async (buffered storage) + fsync"
    is_async = True

    def __init__(self) -> None:
        self._manager: Any = None

    def open(self) -> None:
        """Create the manager.

        Raises:
            WriterUnavailable: torch_checkpointing is not installed.
        """
        self._manager = torch_checkpointing_manager(async_save=True, direct_io=False)

    def write(self, state: State, target: Path) -> WriteTiming:
        """Start the save, wait for its future, fsync what it wrote."""
        start = time.perf_counter()
        timing = save_until_reusable(self._manager, target, state)
        fsync_path(target)
        timing.seconds = time.perf_counter() - start
        timing.details = {"direct_io": False, **_tc_version()}
        return timing

    def close(self) -> None:
        """Close the manager (waits for its subprocess)."""
        if self._manager is not None:
            self._manager.close()
            self._manager = None


class TorchSaveWriter(Writer):
    """``torch.save`` into an open file, then flush + fsync (file and directory)."""

    name = "torch.save"
    label = "torch.save + fsync"
    suffix = ".pt"

    def write(self, state: State, target: Path) -> WriteTiming:
        """Pickle the dict with torch.save and make it durable."""

        def action() -> None:
            with open(target, "wb") as handle:
                torch.save(dict(state), handle)
                handle.flush()
                os.fsync(handle.fileno())
            _fsync_dir(target.parent)

        seconds, _ = _timed_sync(action)
        return WriteTiming(seconds, seconds)


class SafetensorsWriter(Writer):
    """``safetensors.torch.save_file``, then fsync of the file and its directory."""

    name = "safetensors"
    label = "safetensors save_file + fsync"
    suffix = ".safetensors"

    def open(self) -> None:
        """Import safetensors.

        Raises:
            WriterUnavailable: safetensors is not installed.
        """
        try:
            import safetensors.torch  # noqa: F401
        except ImportError as err:
            raise WriterUnavailable(f"safetensors: {err}") from err

    def write(self, state: State, target: Path) -> WriteTiming:
        """Save with safetensors and make it durable."""
        import safetensors.torch

        def action() -> None:
            safetensors.torch.save_file(dict(state), str(target))
            fsync_path(target)

        seconds, _ = _timed_sync(action)
        return WriteTiming(seconds, seconds)


def _dcp() -> Any:
    try:
        import torch.distributed.checkpoint as dcp
    except ImportError as err:
        raise WriterUnavailable(f"torch.distributed.checkpoint: {err}") from err
    return dcp


class DcpWriter(Writer):
    """PyTorch DCP ``save`` with ``FileSystemWriter(thread_count=N, sync_files=True)``.

    Single process, no process group. DCP fsyncs its files; the harness adds the directory.
    """

    name = "dcp-1t"
    label = "DCP save (1 thread)"
    thread_count = 1

    def open(self) -> None:
        """Import DCP.

        Raises:
            WriterUnavailable: torch was built without distributed support.
        """
        _dcp()

    def _storage_writer(self, target: Path) -> Any:
        return _dcp().FileSystemWriter(str(target), thread_count=self.thread_count)

    def write(self, state: State, target: Path) -> WriteTiming:
        """Save with ``dcp.save`` and fsync the checkpoint directory."""
        dcp = _dcp()

        def action() -> None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dcp.save(dict(state), storage_writer=self._storage_writer(target), no_dist=True)
            _fsync_dir(target)
            _fsync_dir(target.parent)

        seconds, _ = _timed_sync(action)
        return WriteTiming(seconds, seconds)


class Dcp2Writer(DcpWriter):
    """DCP ``save`` with two writer threads."""

    name = "dcp-2t"
    label = "DCP save (2 threads)"
    thread_count = 2


def dcp_staged(response: Any) -> Future[Any]:
    """Wait until the state given to ``dcp.async_save`` may be changed again, and return the
    future that resolves when the checkpoint is written.

    ``async_save`` returns a future once it staged the state, or (with a stager that stages in
    the background) an ``AsyncSaveResponse`` whose ``staging_completion`` says when staging
    is done; that is waited for here.
    """
    staged: Future[Any] | None = getattr(response, "staging_completion", None)
    if staged is not None:
        staged.result()
    upload: Future[Any] = getattr(response, "upload_completion", response)
    return upload


class DcpAsyncWriter(DcpWriter):
    """DCP ``async_save`` (thread executor): stall until the state is staged
    (:func:`dcp_staged`), total until the future resolved and the directory is fsynced."""

    name = "dcp-async"
    label = "DCP async_save"
    is_async = True

    def write(self, state: State, target: Path) -> WriteTiming:
        """Start ``dcp.async_save`` and wait for its future."""
        dcp = _dcp()
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            response = dcp.async_save(
                dict(state), storage_writer=self._storage_writer(target), no_dist=True
            )
        returned = time.perf_counter() - start
        future = dcp_staged(response)
        stall = time.perf_counter() - start
        future.result()
        _fsync_dir(target)
        _fsync_dir(target.parent)
        return WriteTiming(time.perf_counter() - start, stall, returned_seconds=returned)


def ceiling_block(nbytes: int, max_block: int = CEILING_BLOCK, align: int = 4096) -> int:
    """Block size for the ceiling stream of ``nbytes``: at most ``max_block``, aligned.

    The native writer writes whole blocks and truncates, so the block is chosen to split
    ``nbytes`` evenly (overshoot under one ``align`` per block) rather than to waste up to a
    whole block at the end.
    """
    count = max(1, -(-nbytes // max_block))
    per_block = -(-nbytes // count)
    return max(align, -(-per_block // align) * align)


class CeilingWriter(Writer):
    """The disk ceiling: the state's byte count as one O_DIRECT stream of aligned blocks."""

    name = "ceiling"
    label = "disk ceiling (O_DIRECT, 1 stream)"
    suffix = ".bin"

    def __init__(self, max_block: int = CEILING_BLOCK) -> None:
        self.max_block = max_block

    def write(self, state: State, target: Path) -> WriteTiming:
        """Write ``sum(tensor bytes)`` with :func:`fastckpt._native.write_ceiling`."""
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        block = ceiling_block(nbytes, self.max_block)
        seconds, direct = _timed_sync(lambda: _native.write_ceiling(str(target), nbytes, block))
        return WriteTiming(seconds, seconds, {"direct_io": bool(direct), "block": block})


#: Every writer, in the order they run within a repetition.
WRITERS: dict[str, type[Writer]] = {
    cls.name: cls
    for cls in (
        FastckptWriter,
        FastckptDirectWriter,
        FastckptBufferedWriter,
        FastckptNoChecksumWriter,
        FastckptManagerWriter,
        FastckptAsyncWriter,
        TorchSaveWriter,
        SafetensorsWriter,
        DcpWriter,
        Dcp2Writer,
        DcpAsyncWriter,
        TorchCheckpointingWriter,
        TorchCheckpointingAsyncWriter,
        TorchCheckpointingDirectWriter,
        CeilingWriter,
    )
}


def make_writers(names: list[str] | None = None) -> list[Writer]:
    """Instantiate the named writers (all of them by default), in :data:`WRITERS` order.

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    wanted = list(WRITERS) if names is None else names
    unknown = [n for n in wanted if n not in WRITERS]
    if unknown:
        raise ValueError(f"unknown writer(s) {unknown}; choose from {list(WRITERS)}")
    return [cls() for name, cls in WRITERS.items() if name in wanted]


def fix_default_write_mode(writers: list[Writer], nbytes: int) -> None:
    """Resolve the automatic write mode of the fastckpt writers once, for a state of
    ``nbytes`` (:func:`fastckpt.io.files.choose_direct_io`), so all their runs use the same."""
    mode = files.choose_direct_io(nbytes)
    for writer in writers:
        if isinstance(writer, FastckptWriter) and writer.direct_io is None:
            writer.direct_io = mode
