"""Stagers: copy live tensors into host buffers that are allocated once and reused.

An async save must not write live tensors (training mutates them), so it first *stages* a
snapshot. Fresh host pages cost a page fault each (about 3x a copy into warm memory), so the
stagers keep one buffer per tensor name and reuse it as long as dtype and shape match: host
memory stays bounded by one copy of the state and flat across repeated saves.

* :class:`CpuStager` - plain host buffers, synchronous copies (CPU tensors, or CUDA tensors
  when pinned memory is off).
* :class:`CudaStager` - pinned host buffers filled by non-blocking device-to-host copies on a
  side stream, synchronized before the snapshot is handed to the writer.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import torch

__all__ = [
    "BACKGROUND_NICE",
    "CpuStager",
    "CudaStager",
    "Stager",
    "StagerOptions",
    "background_executor",
    "make_stager",
    "stage_groups",
]

#: How much lower than the training thread the background writer runs (Linux nice units).
#: On a machine with few cores the writer's copies and syscalls otherwise take CPU from the
#: training step; at a lower priority they fill the gaps instead.
BACKGROUND_NICE = 10


def _lower_thread_priority() -> None:
    """Lower this OS thread's priority (threads it spawns, e.g. Rust writers, inherit it)."""
    try:
        current = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), current + BACKGROUND_NICE)
    except (OSError, AttributeError):  # not Linux, or not permitted: run at normal priority
        pass


def background_executor(name: str) -> ThreadPoolExecutor:
    """A one-thread executor for background checkpoint work, at lowered priority."""
    return ThreadPoolExecutor(
        max_workers=1, thread_name_prefix=name, initializer=_lower_thread_priority
    )


@dataclass(frozen=True)
class StagerOptions:
    """How to stage. ``pinned``/``non_blocking`` only matter for CUDA tensors."""

    pinned: bool
    non_blocking: bool


class Stager(Protocol):
    """Copies tensors into reusable host buffers."""

    def stage(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Return host copies of ``tensors`` (complete when this returns)."""
        ...

    @property
    def nbytes(self) -> int:
        """Bytes currently held in staging buffers."""
        ...


class _BufferPool:
    """One reusable host buffer per name, replaced only when dtype/shape change."""

    def __init__(self, pinned: bool) -> None:
        self.pinned = pinned
        self.buffers: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()

    def get(self, name: str, like: torch.Tensor) -> torch.Tensor:
        with self._lock:
            buffer = self.buffers.get(name)
            if buffer is None or buffer.dtype != like.dtype or buffer.shape != like.shape:
                buffer = torch.empty(like.shape, dtype=like.dtype, pin_memory=self.pinned)
                self.buffers[name] = buffer
            return buffer

    def retain_only(self, names: set[str]) -> None:
        """Drop buffers of tensors that are no longer part of the state."""
        with self._lock:
            for name in set(self.buffers) - names:
                del self.buffers[name]

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())


class CpuStager:
    """Synchronous copies into reusable (unpinned) host buffers."""

    def __init__(self) -> None:
        """Create an empty pool; buffers appear on the first :meth:`stage`."""
        self._pool = _BufferPool(pinned=False)

    def stage(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copy every tensor into its pooled buffer and return the buffers."""
        staged = {}
        for name, tensor in tensors.items():
            buffer = self._pool.get(name, tensor)
            buffer.copy_(tensor.detach())
            staged[name] = buffer
        self._pool.retain_only(set(tensors))
        return staged

    @property
    def nbytes(self) -> int:
        """Bytes held in staging buffers."""
        return self._pool.nbytes


class CudaStager:
    """Pinned host buffers, non-blocking D2H copies on a side stream, one sync at the end."""

    def __init__(self, options: StagerOptions) -> None:
        """Create the pool (pinned per ``options``) and a side stream for the copies."""
        self.options = options
        self._pool = _BufferPool(pinned=options.pinned)
        self._stream = torch.cuda.Stream() if torch.cuda.is_available() else None

    def stage(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copy every tensor to its pooled host buffer; returns once all copies finished."""
        staged = {}
        cuda_tensors = {n: t for n, t in tensors.items() if t.is_cuda}
        if cuda_tensors and self._stream is not None:
            # The side stream must see all work the training stream queued on these tensors.
            self._stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._stream):
                for name, tensor in cuda_tensors.items():
                    buffer = self._pool.get(name, tensor)
                    buffer.copy_(tensor.detach(), non_blocking=self.options.non_blocking)
                    staged[name] = buffer
            self._stream.synchronize()
        for name, tensor in tensors.items():
            if name not in staged:
                buffer = self._pool.get(name, tensor)
                buffer.copy_(tensor.detach())
                staged[name] = buffer
        self._pool.retain_only(set(tensors))
        return {name: staged[name] for name in tensors}

    @property
    def nbytes(self) -> int:
        """Bytes held in staging buffers."""
        return self._pool.nbytes


def stage_groups(
    stager: Stager,
    groups: dict[str, dict[str, torch.Tensor]],
    select: Callable[[str, str], bool],
) -> None:
    """Replace the selected tensors of ``{group: {name: tensor}}`` by staged copies, in place.

    ``select(group, name)`` says which tensors to copy now; the stager's pool is keyed by
    group and name, so the same tensor reuses the same buffer on every save.
    """
    selected = {
        f"{group}\0{name}": tensor
        for group, tensors in groups.items()
        for name, tensor in tensors.items()
        if select(group, name)
    }
    for key, staged in stager.stage(selected).items():
        group, name = key.split("\0", 1)
        groups[group][name] = staged


def make_stager(options: StagerOptions) -> Stager:
    """The right stager for this process: CUDA staging when CUDA is available, else CPU."""
    if torch.cuda.is_available():
        return CudaStager(options)
    return CpuStager()
