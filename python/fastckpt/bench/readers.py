"""The readers compared by the harness, plus the read ceiling.

Each reader's input is written once (untimed) by the matching library; every timed read then
starts from a cold page cache when the harness may drop it. fastckpt verifies its checksums
while reading; the ceiling is the same byte count read back with O_DIRECT in large
aligned blocks by as many threads as fastckpt reads with, into reused buffers (the disk, without
any deserialization, copy or verification).
"""

from __future__ import annotations

import mmap
import os
import time
import warnings
from abc import ABC, abstractmethod
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from fastckpt import _native
from fastckpt.bench.compare import same_bits
from fastckpt.bench.writers import (
    CEILING_BLOCK,
    WriterUnavailable,
    ceiling_block,
    fsync_path,
    remove_path,
    torch_checkpointing_manager,
)
from fastckpt.io import files

__all__ = ["READERS", "ReadTiming", "Reader", "make_readers", "read_ceiling"]

State = Mapping[str, torch.Tensor]


@dataclass
class ReadTiming:
    """One timed read.

    Attributes:
        seconds: wall time until every tensor was in memory (and verified, for fastckpt).
        details: reader-specific facts.
    """

    seconds: float
    details: dict[str, Any] = field(default_factory=dict)


class Reader(ABC):
    """One way of loading the state back. Subclasses set ``name``/``label``."""

    #: Short identifier used on the command line and as the JSON key.
    name: ClassVar[str]
    #: Human-readable description for tables.
    label: ClassVar[str]
    #: File suffix of the input ("" for directories).
    suffix: ClassVar[str] = ""

    def __init__(self) -> None:
        self.path = Path()

    def prepare(self, state: State, directory: Path) -> None:
        """Write this reader's input file from ``state`` (untimed, made durable).

        Raises:
            WriterUnavailable: the library is missing.
        """
        self.path = directory / f"read-{self.name}{self.suffix}"
        self._write(state)
        fsync_path(self.path)

    @abstractmethod
    def _write(self, state: State) -> None: ...

    def destination(self, state: State) -> Any:
        """What :meth:`load` fills, allocated before the clock starts (None: it allocates)."""
        return None

    @abstractmethod
    def load(self, destination: Any) -> Any:
        """Load the input (into ``destination`` where the reader takes one); timed."""

    def details(self, loaded: Any) -> dict[str, Any]:
        """Reader-specific facts about one read (recorded in the JSON)."""
        return {}

    def read(self, state: State) -> tuple[ReadTiming, Any]:
        """Allocate the destination (untimed), time :meth:`load`; returns timing and result."""
        destination = self.destination(state)
        start = time.perf_counter()
        loaded = self.load(destination)
        touch_every_page(loaded)
        seconds = time.perf_counter() - start
        return ReadTiming(seconds, self.details(loaded)), loaded

    def check(self, state: State, loaded: Any) -> bool:
        """Whether ``loaded`` holds exactly the tensors of ``state``, bit for bit."""
        if not isinstance(loaded, Mapping) or set(loaded) != set(state):
            return False
        return all(same_bits(loaded[name], tensor) for name, tensor in state.items())

    def cleanup(self) -> None:
        """Delete the input file."""
        remove_path(self.path)


def touch_every_page(loaded: Any) -> None:
    """Read one element per 4 KiB page of every loaded tensor.

    Some loaders (safetensors >= 0.5) return tensors backed by a lazy mmap: the file is only
    read when the data is first touched. Timing stops after this, so every reader is charged
    for actually bringing the bytes into memory; for tensors already in memory it costs
    almost nothing.
    """
    tensors = loaded.values() if isinstance(loaded, Mapping) else []
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and tensor.numel() > 0:
            flat = tensor.reshape(-1).view(torch.uint8)
            flat[::4096].sum()


class FastckptReader(Reader):
    """``fastckpt.load_file`` with checksum verification."""

    name = "fastckpt"
    label = "fastckpt load_file (crc verified)"
    suffix = ".safetensors"

    def _write(self, state: State) -> None:
        files.save_file(state, self.path)

    def load(self, destination: Any) -> Any:
        """``fastckpt.load_file(path, verify=True)``."""
        return files.load_file(self.path, verify=True)


def _templates(state: State) -> dict[str, Any]:
    """``{"state": {name: empty tensor like it}}``: the ``into=`` of a manager load, allocated
    before the clock starts (pages not yet touched), as a resuming run's model and optimizer
    hold them."""
    return {"state": {name: torch.empty_like(tensor) for name, tensor in state.items()}}


class FastckptManagerReader(Reader):
    """``CheckpointManager.load(path, into=templates)`` of a sync manager save: the call a
    resume makes, checksums verified, next to ``load_file`` of the same bytes."""

    name = "fastckpt-manager"
    label = "fastckpt CheckpointManager load(into=) (crc verified)"

    def __init__(self) -> None:
        super().__init__()
        self._manager: Any = None

    def _write(self, state: State) -> None:
        from fastckpt.manager import CheckpointManager

        self._manager = CheckpointManager(CheckpointManager.Config.with_sync_save())
        self._manager.save(str(self.path), {"state": dict(state)})

    def destination(self, state: State) -> Any:
        """Templates of the state's shapes and dtypes."""
        return _templates(state)

    def load(self, destination: Any) -> Any:
        """``manager.load(path, into=destination)``; the loaded state's tensors."""
        return self._manager.load(str(self.path), into=destination)["state"]

    def cleanup(self) -> None:
        """Close the manager and delete the input."""
        if self._manager is not None:
            self._manager.close()
            self._manager = None
        super().cleanup()


class TorchCheckpointingReader(Reader):
    """torch_checkpointing's ``CheckpointManager.load(path, into=templates)`` of its own sync
    save, with the storage the writer rows use (:data:`fastckpt.bench.writers.TC_STORAGE`,
    buffered reads)."""

    name = "tc"
    label = "torch_checkpointing load(into=) (buffered storage)"

    def __init__(self) -> None:
        super().__init__()
        self._manager: Any = None

    def prepare(self, state: State, directory: Path) -> None:
        """Write the input with torch_checkpointing.

        Raises:
            WriterUnavailable: torch_checkpointing is not installed.
        """
        self._manager = torch_checkpointing_manager(async_save=False, direct_io=False)
        super().prepare(state, directory)

    def _write(self, state: State) -> None:
        self._manager.save(str(self.path), {"state": dict(state)})

    def destination(self, state: State) -> Any:
        """Templates of the state's shapes and dtypes."""
        return _templates(state)

    def load(self, destination: Any) -> Any:
        """``manager.load(path, into=destination)``; the loaded state's tensors."""
        return self._manager.load(str(self.path), into=destination)["state"]

    def details(self, loaded: Any) -> dict[str, Any]:
        """torch_checkpointing's version."""
        import torch_checkpointing

        return {"version": str(getattr(torch_checkpointing, "__version__", "?"))}

    def cleanup(self) -> None:
        """Close the manager and delete the input."""
        if self._manager is not None:
            self._manager.close()
            self._manager = None
        super().cleanup()


class TorchLoadReader(Reader):
    """``torch.load(weights_only=True, mmap=False)`` of a ``torch.save`` file."""

    name = "torch.load"
    label = "torch.load (weights_only)"
    suffix = ".pt"

    def _write(self, state: State) -> None:
        torch.save(dict(state), self.path)

    def load(self, destination: Any) -> Any:
        """``torch.load(path, weights_only=True, mmap=False)``."""
        return torch.load(self.path, weights_only=True, mmap=False)


class SafetensorsReader(Reader):
    """``safetensors.torch.load_file`` of a safetensors file."""

    name = "safetensors"
    label = "safetensors load_file"
    suffix = ".safetensors"

    def prepare(self, state: State, directory: Path) -> None:
        """Write the input with safetensors.

        Raises:
            WriterUnavailable: safetensors is not installed.
        """
        try:
            import safetensors.torch  # noqa: F401
        except ImportError as err:
            raise WriterUnavailable(f"safetensors: {err}") from err
        super().prepare(state, directory)

    def _write(self, state: State) -> None:
        import safetensors.torch

        safetensors.torch.save_file(dict(state), str(self.path))

    def load(self, destination: Any) -> Any:
        """``safetensors.torch.load_file(path)``."""
        import safetensors.torch

        return safetensors.torch.load_file(str(self.path))


class DcpReader(Reader):
    """DCP ``load`` into a preallocated state dict (allocated untimed, filled timed)."""

    name = "dcp"
    label = "DCP load (preallocated)"

    def prepare(self, state: State, directory: Path) -> None:
        """Write the input with ``dcp.save``.

        Raises:
            WriterUnavailable: torch has no distributed checkpoint support.
        """
        try:
            import torch.distributed.checkpoint  # noqa: F401
        except ImportError as err:
            raise WriterUnavailable(f"torch.distributed.checkpoint: {err}") from err
        super().prepare(state, directory)

    def _write(self, state: State) -> None:
        import torch.distributed.checkpoint as dcp

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(dict(state), storage_writer=dcp.FileSystemWriter(str(self.path)), no_dist=True)

    def destination(self, state: State) -> Any:
        """Preallocated tensors of the state's shapes (pages not yet touched, as for others)."""
        return {name: torch.empty_like(tensor) for name, tensor in state.items()}

    def load(self, destination: Any) -> Any:
        """``dcp.load`` into the preallocated dict."""
        import torch.distributed.checkpoint as dcp

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(destination, storage_reader=dcp.FileSystemReader(str(self.path)), no_dist=True)
        return destination


def _open_direct(path: Path) -> tuple[int, bool]:
    direct_flag = getattr(os, "O_DIRECT", 0)
    if direct_flag:
        try:
            return os.open(path, os.O_RDONLY | direct_flag), True
        except OSError:
            pass
    return os.open(path, os.O_RDONLY), False


def read_ceiling(
    path: Path, block: int = CEILING_BLOCK, streams: int = files.DEFAULT_THREADS
) -> tuple[int, bool]:
    """Read ``path`` start to end with O_DIRECT: ``streams`` threads, ``block``-byte reads.

    Thread ``i`` reads blocks ``i, i + streams, ...`` into its own page-aligned buffer (the same
    parallelism fastckpt's reader uses by default; ``os.preadv`` releases the GIL). Falls back
    to buffered reads where the filesystem refuses O_DIRECT.

    Returns:
        (bytes read, whether O_DIRECT was used).
    """
    size = path.stat().st_size
    fd, direct = _open_direct(path)
    blocks = -(-size // block)

    def stream(first: int) -> int:
        buffer = mmap.mmap(-1, block)  # page aligned, as O_DIRECT requires
        total = 0
        try:
            for index in range(first, blocks, streams):
                total += os.preadv(fd, [buffer], index * block)
        finally:
            buffer.close()
        return total

    try:
        with ThreadPoolExecutor(max_workers=streams) as pool:
            total = sum(pool.map(stream, range(max(1, streams))))
    finally:
        os.close(fd)
    return total, direct


class CeilingReader(Reader):
    """The cold read ceiling: the state's byte count read back with O_DIRECT (4 streams)."""

    name = "ceiling"
    label = "disk ceiling (O_DIRECT, 4 streams)"
    suffix = ".bin"

    def _write(self, state: State) -> None:
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        _native.write_ceiling(str(self.path), nbytes, ceiling_block(nbytes))

    def load(self, destination: Any) -> Any:
        """Stream the file through a reused aligned buffer; returns (bytes, O_DIRECT used)."""
        return read_ceiling(self.path)

    def details(self, loaded: Any) -> dict[str, Any]:
        """Bytes read and whether O_DIRECT was used."""
        nbytes, direct = loaded
        return {"bytes": nbytes, "direct_io": direct}

    def check(self, state: State, loaded: Any) -> bool:
        """The whole file was read."""
        return bool(loaded[0] == sum(t.numel() * t.element_size() for t in state.values()))


#: Every reader, in the order they run within a repetition.
READERS: dict[str, type[Reader]] = {
    cls.name: cls
    for cls in (
        FastckptReader,
        FastckptManagerReader,
        TorchLoadReader,
        SafetensorsReader,
        DcpReader,
        TorchCheckpointingReader,
        CeilingReader,
    )
}


def make_readers(names: list[str] | None = None) -> list[Reader]:
    """Instantiate the named readers (all by default), in :data:`READERS` order.

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    wanted = list(READERS) if names is None else names
    unknown = [n for n in wanted if n not in READERS]
    if unknown:
        raise ValueError(f"unknown reader(s) {unknown}; choose from {list(READERS)}")
    return [cls() for name, cls in READERS.items() if name in wanted]
