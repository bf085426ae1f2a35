"""File images: staging memory laid out as the file it will become, so a save copies once.

An async save copies the live state into staging buffers (training mutates it meanwhile);
the writer then used to copy those buffers again, into the aligned buffers an O_DIRECT write
needs, computing the checksums on the way. On a machine with few cores both copies compete
with training for CPU time and memory bandwidth (benches/NOTES.md, "Training-loop
overhead").

A :class:`FileImage` is one 4096-byte aligned host buffer (pinned when asked) laid out
exactly as the safetensors file of one set of tensors: a header region padded to an aligned
length, then every tensor at its offset in the file. Staging copies each tensor into its
view of the image; :func:`write_image` hands the whole image to the Rust core, which writes
it with O_DIRECT straight from that memory while a second thread computes the crc32c
checksums from it: the staging copy is the only copy. The file is a normal fastckpt
safetensors file; its header is padded with spaces (valid JSON whitespace) up to the aligned
data start.

:class:`ImagePool` keeps one image per file and reuses it while the file's tensors keep their
names, dtypes and shapes (like the stagers' per-tensor buffers). A writer recognises image
views with :func:`find_image`, which accepts a mapping only when it is exactly the image's
views, every one: anything else (a tensor added at write time, a live tensor that was never
staged) is written the ordinary way.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch

from fastckpt import _native
from fastckpt.io.files import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_WRITE_THREADS,
    MAX_THREADS,
    check_count,
    choose_direct_io,
    dtype_name,
    header_shape,
    staging_bytes,
)
from fastckpt.io.forksafe import ForkSafeLock

__all__ = ["ALIGN", "IMAGE_MIN_BYTES", "FileImage", "ImagePool", "find_image", "write_image"]

#: Alignment of an image's start and of its data section (O_DIRECT's block alignment).
ALIGN = 4096
#: Files with fewer tensor bytes are staged tensor by tensor as before: the image saves
#: nothing worth a header padded to 4 KiB there (at most 1.6 % of this size).
IMAGE_MIN_BYTES = 256 << 10

_IMAGES: weakref.WeakValueDictionary[int, FileImage] = weakref.WeakValueDictionary()
_IMAGES_LOCK = ForkSafeLock()

Signature = tuple[tuple[str, torch.dtype, tuple[int, ...]], ...]


def _signature(tensors: Mapping[str, torch.Tensor]) -> Signature:
    return tuple(sorted((name, t.dtype, tuple(t.shape)) for name, t in tensors.items()))


def _eligible(tensors: Mapping[str, Any]) -> bool:
    """Plain strided tensors of safetensors dtypes, at least :data:`IMAGE_MIN_BYTES` in all."""
    nbytes = 0
    for tensor in tensors.values():
        if (
            not isinstance(tensor, torch.Tensor)
            or tensor.layout is not torch.strided
            or tensor.is_quantized
            or tensor.is_meta
            or type(tensor) not in (torch.Tensor, torch.nn.Parameter)
        ):
            return False
        try:
            dtype_name(tensor.dtype)
        except TypeError:
            return False
        nbytes += tensor.numel() * tensor.element_size()
    return nbytes >= IMAGE_MIN_BYTES


class FileImage:
    """One aligned buffer laid out as the safetensors file of a set of tensors.

    Attributes:
        signature: the ``(name, dtype, shape)`` of every tensor, sorted by name.
        descriptions: ``(name, safetensors dtype, header shape)`` of every tensor.
        data_start: where the data section starts (a multiple of :data:`ALIGN`).
        buffer: the image, a uint8 tensor of the image's length.
        views: name -> a tensor of the tensor's dtype and shape inside ``buffer``.
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor], *, pinned: bool) -> None:
        """Allocate (not touch) the image of ``tensors`` (their names, dtypes and shapes).

        Raises:
            InvalidInputError / ValueError: a tensor cannot be saved (as in ``save_file``).
        """
        self.signature = _signature(tensors)
        self.descriptions = [
            (name, dtype_name(t.dtype), header_shape(name, t)) for name, t in tensors.items()
        ]
        self.data_start, image_len, ranges = _native.image_layout(self.descriptions, {}, True)
        names = ", ".join(list(tensors)[:3]) + (", ..." if len(tensors) > 3 else "")
        raw = staging_bytes(
            image_len + ALIGN, pin_memory=pinned, what=f"the file image of tensors {names}"
        )
        offset = -raw.data_ptr() % ALIGN
        self.buffer = raw[offset : offset + image_len]
        self.views: dict[str, torch.Tensor] = {}
        for name, begin, end in ranges:
            like = tensors[name]
            data = self.buffer[self.data_start + begin : self.data_start + end]
            self.views[name] = data.view(like.dtype).view(like.shape)
        with _IMAGES_LOCK:
            _IMAGES[self.buffer.data_ptr()] = self

    @property
    def nbytes(self) -> int:
        """Bytes of the image."""
        return self.buffer.numel()

    def touch(self) -> None:
        """Fault in every page now (a fresh page costs a fault at its first write)."""
        self.buffer.zero_()


def find_image(tensors: Mapping[str, torch.Tensor]) -> FileImage | None:
    """The image whose views ``tensors`` are, exactly (same names, the very view objects),
    or None."""
    if not tensors:
        return None
    first = next(iter(tensors.values()))
    if not isinstance(first, torch.Tensor) or first.device.type != "cpu":
        return None
    with _IMAGES_LOCK:
        candidates = list(_IMAGES.values())
    for image in candidates:
        views = image.views
        if len(views) == len(tensors) and all(
            views.get(name) is tensor for name, tensor in tensors.items()
        ):
            return image
    return None


def write_image(
    image: FileImage,
    path: str | os.PathLike[str],
    *,
    direct_io: bool | None = None,
    fsync: bool = True,
    progress: _native.ByteCounter | None = None,
    threads: int | None = None,
) -> dict[str, Any]:
    """Write ``image`` (its views staged) to ``path`` as ``save_file`` writes the same tensors
    (durably, atomically, with checksums), without copying it; ``direct_io=None`` picks the
    mode as ``save_file`` does. ``threads`` (None: the writer's default,
    :data:`~fastckpt.io.files.DEFAULT_WRITE_THREADS`) counts every thread of the write: with
    more than one, one hashes while the others write chunks. The caller must not stage into
    the image until this returns.

    Returns:
        The writer's report, as :func:`fastckpt.io.files.write_tensors` returns it.
    """
    data_bytes = image.nbytes - image.data_start
    if direct_io is None:
        direct_io = choose_direct_io(data_bytes)
    return _native.write_image(
        os.fspath(path),
        image.descriptions,
        image.buffer.numpy(),
        image.data_start,
        {},
        DEFAULT_CHUNK_SIZE,
        direct_io,
        fsync,
        True,
        progress,
        check_count(threads, "threads", DEFAULT_WRITE_THREADS, 1, MAX_THREADS),
    )


class ImagePool:
    """One :class:`FileImage` per file (group), reused while its tensors keep their names,
    dtypes and shapes; pinned when ``pinned``."""

    def __init__(self, *, pinned: bool) -> None:
        """An empty pool; images appear at the first :meth:`destinations`."""
        self.pinned = pinned
        self.images: dict[str, FileImage] = {}
        self.allocations = 0
        self._lock = ForkSafeLock()  # free in a forked child (the images are kept)

    def destinations(
        self,
        groups: Mapping[str, Mapping[str, torch.Tensor]],
        select: Callable[[str, str], bool],
        *,
        touch: bool = False,
    ) -> tuple[dict[str, torch.Tensor], int]:
        """The image views to stage ``{group: {name: tensor}}`` into, keyed ``group\\0name``,
        for the groups where ``select(group, name)`` picks a tensor (groups too small or with
        tensors an image cannot hold get none), and the bytes newly allocated (touched when
        ``touch``). Images of groups not in ``groups`` are dropped."""
        into: dict[str, torch.Tensor] = {}
        allocated = 0
        with self._lock:
            for group in set(self.images) - set(groups):
                del self.images[group]
            for group, tensors in groups.items():
                if not any(select(group, name) for name in tensors):
                    continue
                if not _eligible(tensors):
                    # Kept: a save that rewrites little (incremental) is often followed by
                    # one that rewrites the whole file again.
                    continue
                image = self.images.get(group)
                if image is None or image.signature != _signature(tensors):
                    # The stale image is dropped first: its memory and the new one's are
                    # never both needed.
                    self.images.pop(group, None)
                    image = None
                    try:
                        image = FileImage(tensors, pinned=self.pinned)
                    except (TypeError, ValueError, RuntimeError, MemoryError):
                        # A tensor the format cannot hold as laid out (the file's writer
                        # reports it), or no memory for the image: staged and written the
                        # ordinary way (whose buffers raise their own MemoryError).
                        continue
                    self.images[group] = image
                    self.allocations += 1
                    allocated += image.nbytes
                    if touch:
                        image.touch()
                into.update((f"{group}\0{name}", view) for name, view in image.views.items())
        return into, allocated

    @property
    def nbytes(self) -> int:
        """Bytes held in images."""
        return sum(image.nbytes for image in self.images.values())
