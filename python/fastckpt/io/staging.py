"""Stagers: copy live tensors into host buffers that are allocated once and reused.

An async save must not write live tensors (training mutates them), so it first *stages* a
snapshot. Fresh host pages cost a page fault each (far more than a copy into warm memory; see
benches/NOTES.md), so the stagers keep one buffer per tensor name and reuse it as long as
dtype and shape match: host memory stays bounded by one copy of the state and flat across
repeated saves. :meth:`Stager.reserve` allocates (and touches) them ahead of the first save.
Given a file image's views (:mod:`fastckpt.io.images`), a stager copies into those instead,
so that the file's writer needs no second copy.

* :class:`CpuStager` - plain host buffers, synchronous copies (CPU tensors, or CUDA tensors
  when pinned memory is off).
* :class:`CudaStager` - pinned host buffers filled by non-blocking device-to-host copies on a
  side stream, synchronized before the snapshot is handed to the writer.

The async engine that runs the writes is :class:`fastckpt.container.background.BackgroundWriter`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from fastckpt.io.files import check_storable, copy_values, staging_bytes
from fastckpt.io.forksafe import ForkSafeLock
from fastckpt.io.images import ImagePool

__all__ = [
    "CpuStager",
    "CudaStager",
    "Stager",
    "StagerOptions",
    "make_image_pool",
    "make_stager",
    "reserve_groups",
    "stage_groups",
]


@dataclass(frozen=True)
class StagerOptions:
    """How to stage. ``pinned``/``non_blocking`` only matter for CUDA tensors."""

    pinned: bool
    non_blocking: bool


class Stager(Protocol):
    """Copies tensors into reusable host buffers."""

    def stage(
        self,
        tensors: Mapping[str, torch.Tensor],
        into: Mapping[str, torch.Tensor] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Return host copies of ``tensors`` (complete when this returns): copied into
        ``into[name]`` where given (a file image's view), else into the stager's own buffer."""
        ...

    def reserve(
        self,
        tensors: Mapping[str, torch.Tensor],
        into: Mapping[str, torch.Tensor] | None = None,
    ) -> int:
        """Allocate (and touch) the buffers a :meth:`stage` of ``tensors`` will use, without
        copying; returns the bytes newly allocated (names in ``into`` need none)."""
        ...

    @property
    def allocations(self) -> int:
        """How many buffers were allocated so far (a warm stage allocates none)."""
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
        self.allocations = 0
        self._lock = ForkSafeLock()  # free in a forked child (the buffers are kept)

    def get(
        self, name: str, like: torch.Tensor, into: Mapping[str, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """``into[name]`` when given, else this pool's buffer for ``name``."""
        if into is not None and name in into:
            return into[name]
        return self._get(name, like)[0]

    def _get(self, name: str, like: torch.Tensor) -> tuple[torch.Tensor, bool]:
        with self._lock:
            buffer = self.buffers.get(name)
            if buffer is None or buffer.dtype != like.dtype or buffer.shape != like.shape:
                self.buffers.pop(name, None)  # a stale buffer and its successor never both
                buffer = None
                size = math.prod(like.shape) * like.dtype.itemsize
                what = f"the staging buffer of {name.replace(chr(0), ':')!r}"  # file\0tensor
                raw = staging_bytes(size, pin_memory=self.pinned, what=what)
                buffer = raw.view(like.dtype).view(like.shape)
                self.buffers[name] = buffer
                self.allocations += 1
                return buffer, True
            return buffer, False

    def reserve(
        self, tensors: Mapping[str, torch.Tensor], into: Mapping[str, torch.Tensor] | None
    ) -> int:
        """Allocate the missing buffers for ``tensors`` (except names in ``into``) and touch
        their pages (a page fault per fresh page is most of a first copy's cost); returns the
        bytes allocated."""
        allocated = 0
        for name, tensor in tensors.items():
            if into is not None and name in into:
                continue
            buffer, fresh = self._get(name, tensor)
            if fresh:
                buffer.zero_()
                allocated += buffer.numel() * buffer.element_size()
        return allocated

    def retain_only(
        self, names: Iterable[str], into: Mapping[str, torch.Tensor] | None = None
    ) -> None:
        """Drop buffers of tensors that are no longer part of the state, or that are now
        staged into ``into``."""
        names = set(names) - set(into or ())
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

    def stage(
        self,
        tensors: Mapping[str, torch.Tensor],
        into: Mapping[str, torch.Tensor] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Copy every tensor into ``into[name]`` or its pooled buffer; return the copies."""
        staged = {}
        for name, tensor in tensors.items():
            buffer = self._pool.get(name, tensor, into)
            copy_values(buffer, tensor.detach())
            staged[name] = buffer
        self._pool.retain_only(tensors, into)
        return staged

    def reserve(
        self,
        tensors: Mapping[str, torch.Tensor],
        into: Mapping[str, torch.Tensor] | None = None,
    ) -> int:
        """Allocate and touch the buffers a :meth:`stage` of ``tensors`` will use (no copy);
        returns the bytes newly allocated."""
        return self._pool.reserve(tensors, into)

    @property
    def allocations(self) -> int:
        """Buffers allocated so far."""
        return self._pool.allocations

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

    def stage(
        self,
        tensors: Mapping[str, torch.Tensor],
        into: Mapping[str, torch.Tensor] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Copy every tensor to ``into[name]`` (pinned when the image is) or its pooled host
        buffer; returns once all copies finished."""
        staged = {}
        cuda_tensors = {n: t for n, t in tensors.items() if t.is_cuda}
        if cuda_tensors and self._stream is not None:
            # The side stream must see all work the training stream queued on these tensors.
            self._stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._stream):
                for name, tensor in cuda_tensors.items():
                    buffer = self._pool.get(name, tensor, into)
                    buffer.copy_(tensor.detach(), non_blocking=self.options.non_blocking)
                    staged[name] = buffer
            self._stream.synchronize()
        for name, tensor in tensors.items():
            if name not in staged:
                buffer = self._pool.get(name, tensor, into)
                copy_values(buffer, tensor.detach())
                staged[name] = buffer
        self._pool.retain_only(tensors, into)
        return {name: staged[name] for name in tensors}

    def reserve(
        self,
        tensors: Mapping[str, torch.Tensor],
        into: Mapping[str, torch.Tensor] | None = None,
    ) -> int:
        """Allocate (pinned, per the options) and touch the buffers a :meth:`stage` of
        ``tensors`` will use (no copy); returns the bytes newly allocated."""
        return self._pool.reserve(tensors, into)

    @property
    def allocations(self) -> int:
        """Buffers allocated so far."""
        return self._pool.allocations

    @property
    def nbytes(self) -> int:
        """Bytes held in staging buffers."""
        return self._pool.nbytes


def stage_groups(
    stager: Stager,
    groups: dict[str, dict[str, torch.Tensor]],
    select: Callable[[str, str], bool],
    images: ImagePool | None = None,
) -> None:
    """Replace the selected tensors of ``{group: {name: tensor}}`` by staged copies, in place.

    ``select(group, name)`` says which tensors to copy now; the stager's pool is keyed by
    group and name, so the same tensor reuses the same buffer on every save. With ``images``
    each group (one file) large enough is staged into its :class:`~fastckpt.io.images.
    FileImage` instead, which the file's writer then writes without copying it again
    (every tensor of the group must be staged, by this call or an earlier one of the same
    save, for the writer to use the image).
    """
    selected = {}
    for group, tensors in groups.items():
        for name, tensor in tensors.items():
            if select(group, name):
                # what a copy_ would not refuse (or would copy wrongly) is refused here
                selected[f"{group}\0{name}"] = check_storable(f"{group}/{name}", tensor)
    into = None if images is None else images.destinations(groups, select)[0]
    for key, staged in stager.stage(selected, into).items():
        group, name = key.split("\0", 1)
        groups[group][name] = staged


def reserve_groups(
    stager: Stager,
    groups: Mapping[str, Mapping[str, torch.Tensor]],
    select: Callable[[str, str], bool],
    images: ImagePool | None = None,
) -> int:
    """Allocate (and touch) the buffers :func:`stage_groups` with the same arguments will
    use (keyed the same way, images included), without copying; returns the bytes newly
    allocated."""
    into, allocated = (
        (None, 0) if images is None else images.destinations(groups, select, touch=True)
    )
    return allocated + stager.reserve(
        {
            f"{group}\0{name}": tensor
            for group, tensors in groups.items()
            for name, tensor in tensors.items()
            if select(group, name)
        },
        into,
    )


def make_image_pool(options: StagerOptions) -> ImagePool:
    """The file-image pool for stagers made by :func:`make_stager` with ``options``
    (pinned images only when CUDA is available and pinned memory is asked for)."""
    return ImagePool(pinned=options.pinned and torch.cuda.is_available())


def make_stager(options: StagerOptions) -> Stager:
    """The right stager for this process: CUDA staging when CUDA is available, else CPU."""
    if torch.cuda.is_available():
        return CudaStager(options)
    return CpuStager()
