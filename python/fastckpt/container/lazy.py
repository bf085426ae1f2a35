"""Lazy, sliced, verified reads: ``fastckpt.safe_open``, shaped like ``safetensors.safe_open``.

```python
with fastckpt.safe_open("model.safetensors", framework="pt") as f:
    names = f.keys()
    bias = f.get_tensor("bias")             # reads these bytes only, crc32c verified
    rows = f.get_slice("embed")[100:200]    # reads only the rows asked for
```

Opening reads the safetensors header and nothing else; each ``get_tensor`` / slice reads
exactly the byte ranges it returns with ``os.pread`` (no mapping of the file), so reading one
4-byte tensor of a multi-GiB file reads its header and 4 bytes.

What is verified:

* ``get_tensor`` (and a slice that selects every element) checks the tensor's crc32c from the
  header's checksum table before returning; a mismatch raises
  :class:`~fastckpt.errors.ChecksumMismatchError` naming the file and the tensor. Tensors of
  files without checksums (written by the ``safetensors`` package) are returned unverified.
* A partial slice cannot be checked against a checksum of the whole tensor without reading
  the whole tensor. By default it is returned unverified. With ``verify_slices=True`` the
  whole covering tensor is read once (its size in memory), verified, and the slice is cut
  from those verified bytes.
* The header (names, dtypes, shapes, offsets, the checksum table, metadata) is checked when
  the file is opened: against its own crc32c (``fastckpt.header_crc32c``) where the file has
  one, and for consistency with itself and the file's size in every case (files of the
  ``safetensors`` package and of older fastckpt versions have no header checksum).
* For a checkpoint root or ``CheckpointManager`` checkpoint, each file's size is checked
  against the commit record; the record's whole-file crc32c needs the whole file: run
  :func:`fastckpt.verify` for that. Each tensor an incremental checkpoint references in
  another file must be there with the dtype, size and crc32c its reference records (else
  :class:`~fastckpt.errors.CheckpointFormatError`, or ``ChecksumMismatchError`` for the
  crc32c), so every referenced name is a key.

Targets: a single safetensors file; one committed index of a :func:`fastckpt.save_checkpoint`
root (``safe_open(root, index=3)`` or ``safe_open("root/3")``); a
:class:`fastckpt.CheckpointManager` checkpoint directory. A target with several tensor files
names its tensors ``<part>/<tensor>``, where the part is the file's path inside the
checkpoint without ``.safetensors`` (``models/main``, ``optimizers/adam``, or a manager item
such as ``model``); ``part=`` selects one file, whose tensors keep their plain names.
"""

from __future__ import annotations

import contextlib
import math
import operator
import os
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError

from fastckpt import _native
from fastckpt.container.kinds import (
    IndexContainer,
    KindVisitor,
    ManagerContainer,
    RootContainer,
    SavedContainer,
    ShardedContainer,
    TensorFile,
    open_container,
)
from fastckpt.container.links import is_linked_file, referenced_sources
from fastckpt.container.refs import REFS_FILE, index_references, source_path
from fastckpt.container.verify import checked_index
from fastckpt.errors import (
    CheckpointFormatError,
    ChecksumMismatchError,
    FastCkptError,
    InvalidInputError,
)
from fastckpt.format.records import Manifest, read_commit_record
from fastckpt.io.files import BACKENDS, check_flag, dtype_from_name, empty_tensor, torch_shape
from fastckpt.io.forksafe import ForkSafeLock
from fastckpt.io.limits import NO_DESCRIPTORS, descriptor_advice
from fastckpt.io.paths import safe_join

__all__ = ["HandleClosedError", "SafeOpen", "TensorSlice", "safe_open"]

SUFFIX = ".safetensors"
#: Largest single read; also bounds the extra memory of a verified read (one chunk).
READ_CHUNK = 64 << 20
#: Two selected byte runs closer than this are read as one span (the kernel reads whole
#: pages anyway); a span is also read whole when its unselected bytes are at most its
#: selected ones.
PAGE = 4096
_FRAMEWORKS = ("pt", "torch", "pytorch")
_UINTS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


# --------------------------------------------------------------------------- opening files


def pread_exact(fd: int, offset: int, length: int, where: str) -> bytes:
    """``length`` bytes at ``offset`` (short reads continued); a truncated file is a
    :class:`CheckpointFormatError` naming ``where``."""
    parts: list[bytes] = []
    done = 0
    while done < length:
        data = os.pread(fd, min(length - done, READ_CHUNK), offset + done)
        if not data:
            raise CheckpointFormatError(
                f"{where}: file ended {length - done} bytes early at offset {offset + done}; "
                "it was truncated while open"
            )
        parts.append(data)
        done += len(data)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def pread_into(fd: int, offset: int, target: np.ndarray, where: str) -> None:
    """Fill the contiguous uint8 array ``target`` from ``offset`` with ``preadv`` (no
    intermediate copy); a truncated file is a :class:`CheckpointFormatError`."""
    view = target.data.cast("B")
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done : done + READ_CHUNK]], offset + done)
        if got == 0:
            raise CheckpointFormatError(
                f"{where}: file ended {len(view) - done} bytes early at offset {offset + done}; "
                "it was truncated while open"
            )
        done += got


@dataclass
class _Entry:
    """Where one tensor lives: its file and byte range."""

    file: _File
    name: str
    dtype: str
    shape: list[int]  # as the header says (F4: counting 4-bit values)
    begin: int  # absolute file offsets
    end: int
    crc32c: int | None

    @property
    def torch_shape(self) -> list[int]:
        """The shape torch holds it in (F4: pairs of 4-bit values, ``float4_e2m1fn_x2``)."""
        return torch_shape(f"{self.file.path}: tensor {self.name!r}", self.dtype, self.shape)


class _File:
    """One open safetensors file: its descriptor and validated header."""

    def __init__(self, path: Path, expected_size: int | None) -> None:
        self.path = path
        # Regular files only (a FIFO or device is refused without blocking), and the
        # resolved path is opened without following a link swapped in since.
        self.fd = _native.open_regular(str(path), False)
        try:
            size = os.fstat(self.fd).st_size
            if expected_size is not None and size != expected_size:
                raise CheckpointFormatError(
                    f"{path}: size {size} differs from the commit record's {expected_size}; "
                    "the file was truncated or replaced"
                )
            self.header = self._read_header()
        except BaseException:
            os.close(self.fd)
            raise

    def _read_header(self) -> dict[str, Any]:
        # Parse the header of the file this descriptor opened (not whatever the path names by
        # now), with the Rust core's validation; errors then name the real path.
        alias = f"/proc/self/fd/{self.fd}"
        try:
            return _native.read_header(alias)
        except (CheckpointFormatError, ChecksumMismatchError) as err:
            raise type(err)(str(err).replace(alias, str(self.path))) from None
        except OSError as err:
            # Opening the alias takes a second descriptor: out of them (EMFILE), the error
            # named the alias, not the file.
            if err.errno is None or err.filename != alias:
                raise
            why = os.strerror(err.errno)
            if err.errno in NO_DESCRIPTORS:
                why = f"{why}: {descriptor_advice(err.errno)}"
            raise OSError(
                err.errno, f"{self.path}: cannot read its header: {why}", str(self.path)
            ) from None

    def close(self) -> None:
        os.close(self.fd)

    def entries(self) -> Iterator[_Entry]:
        start = self.header["data_start"]
        checksums = self.header["checksums"]
        for info in self.header["tensors"]:
            begin, end = info["data_offsets"]
            yield _Entry(
                self,
                info["name"],
                info["dtype"],
                list(info["shape"]),
                start + begin,
                start + end,
                checksums.get(info["name"]),
            )


# --------------------------------------------------------------------------- targets


@dataclass(frozen=True)
class _Ref:
    """A tensor an incremental checkpoint references in another file: the name it shows
    under, and what the reference says the tensor in that file is."""

    name: str
    crc32c: int
    dtype: str
    nbytes: int


def _ref(name: str, reference: Mapping[str, Any]) -> _Ref:
    """The :class:`_Ref` of ``name`` for its (parsed) reference."""
    return _Ref(name, reference["crc32c"], reference["dtype"], reference["nbytes"])


#: ``(part label, file, expected size, only)``: ``only`` None takes every tensor of the file;
#: else ``{name in the file: the references to it}``, the tensors an incremental index
#: references in another index's file (:mod:`fastckpt.container.refs`); two names may
#: reference the same tensor.
_Target = tuple[str, Path, int | None, "dict[str, list[_Ref]] | None"]


def _resolve_files(path: Path, index: int | None, part: str | None) -> tuple[list[_Target], str]:
    """The files to open and a description of the target."""
    try:
        container = open_container(path)
    except FileNotFoundError:
        if os.path.lexists(path) and not path.is_dir():
            # A FIFO, a device...: the core says what it is, without blocking on it.
            os.close(_native.open_regular(str(path), False))
        raise
    return container.accept(_Targets(path, index, part))


class _Targets(KindVisitor[tuple[list[_Target], str]]):
    """The files :func:`safe_open` opens for each kind of container, and the description."""

    def __init__(self, path: Path, index: int | None, part: str | None) -> None:
        self.path = path
        self.requested = checked_index(
            index, "index", "an int (a committed index, -1: the latest) or None (the latest)"
        )
        self.part = part

    def file(self, container: TensorFile) -> tuple[list[_Target], str]:
        if self.requested is not None or self.part is not None:
            raise ValueError(f"{self.path} is a single file; index= and part= apply to checkpoints")
        return [("", Path(os.path.realpath(self.path)), None, None)], str(self.path)

    def manager(self, container: ManagerContainer) -> tuple[list[_Target], str]:
        if self.requested is not None:
            raise ValueError(
                f"{self.path} is a CheckpointManager checkpoint; index= applies to a "
                "save_checkpoint root"
            )
        directory = container.path
        record = read_commit_record(directory)
        # Linked files (incremental saves) are read through the references only: they may
        # hold stale tensors no reference names.
        files = {r: v for r, v in record["files"].items() if not is_linked_file(r)}
        selected = _select(files, directory, directory, self.part, str(directory))
        selected += _linked(directory, record, self.part)
        return selected, str(directory)

    def sharded(self, container: ShardedContainer) -> tuple[list[_Target], str]:
        raise ValueError(
            f"{self.path} is a sharded (DCP) checkpoint: its tensors are chunks spread over "
            "the ranks' files, which safe_open does not join; consolidate it into one "
            f"safetensors file first (fastckpt export {self.path} --to FILE)"
        )

    def root(self, container: RootContainer) -> tuple[list[_Target], str]:
        return self._index_files(container, self.requested)

    def index(self, container: IndexContainer) -> tuple[list[_Target], str]:
        if self.requested is not None and self.requested != container.index:
            raise ValueError(
                f"{self.path} is index {container.index}; index={self.requested} does not apply"
            )
        return self._index_files(container, container.index)

    def _index_files(
        self, container: SavedContainer, index: int | None
    ) -> tuple[list[_Target], str]:
        root = container.root
        manifest = Manifest.load(root, verify_checksum=True)
        resolved = manifest.resolve(-1 if index is None else index)
        directory = root / str(resolved)
        where = f"{directory} (index {resolved} of {root})"
        files = manifest.entries[resolved]["files"]
        # Linked files (fastckpt.container.refs.link_into) are read through the references
        # only.
        own = {r: v for r, v in files.items() if not is_linked_file(r)}
        selected = _select(own, directory, root, self.part, where)
        if REFS_FILE in files:
            selected += _referenced(manifest, resolved, self.part)
        return selected, where


def _referenced(manifest: Manifest, index: int, part: str | None) -> list[_Target]:
    """The referenced tensors of incremental index ``index``, one target per source file."""
    by_source: dict[tuple[str, Path], dict[str, list[_Ref]]] = {}
    sizes: dict[Path, int] = {}
    for relpath, names in index_references(manifest, index).items():
        label = relpath[: -len(SUFFIX)]
        if part is not None and label != part:
            continue
        for name, ref in names.items():
            source = Path(os.path.realpath(source_path(manifest, ref)))
            sizes[source] = ref["file_size"]
            key = (label if part is None else "", source)
            by_source.setdefault(key, {}).setdefault(ref["name"], []).append(_ref(name, ref))
    return [(label, path, sizes[path], only) for (label, path), only in by_source.items()]


def _linked(directory: Path, record: Mapping[str, Any], part: str | None) -> list[_Target]:
    """The referenced tensors of an incremental manager checkpoint, one target per linked
    file."""
    by_source: dict[tuple[str, Path], dict[str, list[_Ref]]] = {}
    sizes: dict[Path, int] = {}
    for relpath, names in referenced_sources(directory, record).items():
        label = relpath[: -len(SUFFIX)]
        if part is not None and label != part:
            continue
        for name, (path, ref) in names.items():
            source = Path(os.path.realpath(path))
            sizes[source] = record["files"][ref["file"]]["size"]
            key = (label if part is None else "", source)
            by_source.setdefault(key, {}).setdefault(ref["name"], []).append(_ref(name, ref))
    return [(label, path, sizes[path], only) for (label, path), only in by_source.items()]


def _select(
    files: Mapping[str, Mapping[str, int]],
    directory: Path,
    within: Path,
    part: str | None,
    where: str,
) -> list[_Target]:
    labels = {relpath[: -len(SUFFIX)]: relpath for relpath in files if relpath.endswith(SUFFIX)}
    if part is not None:
        if part not in labels:
            raise KeyError(f"{where} has no tensor file {part!r}; parts: {sorted(labels)}")
        labels = {part: labels[part]}
    selected: list[_Target] = []
    for label, relpath in sorted(labels.items()):
        real = Path(os.path.realpath(safe_join(directory, relpath, within=within)))
        selected.append((label if part is None else "", real, files[relpath]["size"], None))
    return selected


# --------------------------------------------------------------------------- slicing


@dataclass(frozen=True)
class _Dim:
    """The selection along one dimension: ``count`` indices from ``start`` by ``step``."""

    start: int
    step: int
    count: int
    keep: bool  # False for an integer index (the dimension is dropped from the result)


def _normalize(key: Any, shape: Sequence[int], where: str) -> list[_Dim]:
    """The selection ``key`` makes of a tensor of ``shape``, one :class:`_Dim` per dimension,
    exactly as torch indexing selects: ints (negative from the end), slices with any start and
    stop (clipped to the dimension, as Python and torch clip them) and a positive step, one
    ``...``.

    An empty list selects nothing along its dimension, as in torch. Two or more lists are
    refused (torch merges them, with the integers beside them, into one dimension, which a
    selection per dimension cannot describe), as every non-empty list is.

    Refused the way torch refuses them, each naming ``where``: an index out of range or too
    many indices (``IndexError``); a step of zero or below
    (:class:`~fastckpt.errors.InvalidInputError`, a ``ValueError`` as torch raises); any other
    kind of index (``InvalidInputError``, a ``TypeError``).
    """
    if isinstance(key, slice):
        # A lone slice: torch checks its step before the tensor's dimensions.
        _step(key, 0, where)
    items = list(key) if isinstance(key, tuple) else [key]
    if sum(item is Ellipsis for item in items) > 1:
        raise IndexError(f"{where}: an index can only have a single ellipsis ('...')")
    if Ellipsis in items:
        at = items.index(Ellipsis)
        fill = len(shape) - (len(items) - 1)
        items[at : at + 1] = [slice(None)] * max(fill, 0)
    if len(items) > len(shape):
        raise IndexError(
            f"{where}: too many indices ({len(items)}) for a tensor of {len(shape)} dimension(s)"
        )
    items += [slice(None)] * (len(shape) - len(items))
    dims = []
    for axis, (item, size) in enumerate(zip(items, shape, strict=True)):
        if isinstance(item, list) and not item:
            # An empty list selects nothing along its dimension, as in torch and safetensors.
            dims.append(_Dim(0, 1, 0, True))
            continue
        if isinstance(item, (bool, np.bool_)) or not isinstance(item, (int, np.integer, slice)):
            raise InvalidInputError(
                f"{where}: dimension {axis}: index {item!r} is not supported; use integers, "
                "slices with a positive step, and '...'"
            )
        if isinstance(item, slice):
            step = _step(item, axis, where)
            try:
                start, stop, _ = item.indices(size)
            except TypeError as err:
                raise InvalidInputError(
                    f"{where}: dimension {axis}: index {item!r} is not supported ({err}); "
                    "slice bounds must be integers or None"
                ) from None
            count = len(range(start, stop, step))
            # An empty selection starts at 0: nothing is read, and no bound can wrap around.
            dims.append(_Dim(start if count else 0, step, count, True))
            continue
        position = int(item) + (size if item < 0 else 0)
        if not 0 <= position < size:
            raise IndexError(
                f"{where}: index {int(item)} is out of bounds for dimension {axis} of size {size}"
            )
        dims.append(_Dim(position, 1, 1, False))
    lists = [axis for axis, item in enumerate(items) if isinstance(item, list)]
    if len(lists) > 1:
        # Before, each empty list kept a dimension of its own: [[], []] gave (0, 0, 3) where
        # torch gives (0, 3). Checked last, so that what torch refuses is refused as torch does.
        raise InvalidInputError(
            f"{where}: dimensions {lists[0]} and {lists[1]}: a second list index is not "
            "supported (torch merges list indices into one dimension); use at most one list "
            "index (an empty one), with integers, slices with a positive step, and '...'"
        )
    return dims


def _step(item: slice, axis: int, where: str) -> int:
    """The step of slice ``item`` (1 when None); zero or below is refused, as torch does."""
    if item.step is None:
        return 1
    try:
        step = operator.index(item.step)
    except TypeError:
        raise InvalidInputError(
            f"{where}: dimension {axis}: slice step {item.step!r} is not an integer"
        ) from None
    if step <= 0:
        raise InvalidInputError(
            f"{where}: dimension {axis}: step must be positive, got {step} (torch refuses "
            "zero and negative steps too; flip the result with torch.flip instead)"
        )
    return step


def _as_index(dim: _Dim) -> slice | int:
    """``dim`` as a torch index of the whole tensor: the slice of its ``count`` elements (its
    stop never below its start, so it cannot wrap around), or the integer it keeps."""
    if not dim.keep:
        return dim.start
    return slice(dim.start, dim.start + dim.count * dim.step, dim.step)


def _strides(shape: Sequence[int]) -> list[int]:
    strides = [1] * len(shape)
    for axis in range(len(shape) - 2, -1, -1):
        strides[axis] = strides[axis + 1] * shape[axis + 1]
    return strides


@dataclass
class _Piece:
    """One span of elements read with one pread, and the selection it holds."""

    first: int  # element offset of the span (its first selected element)
    length: int  # elements in the span
    dims: list[_Dim]


def _span(dims: Sequence[_Dim], strides: Sequence[int]) -> tuple[int, int, int]:
    """(first element, span length, selected elements) of a non-empty selection."""
    first = sum(d.start * s for d, s in zip(dims, strides, strict=True))
    last = sum((d.start + (d.count - 1) * d.step) * s for d, s in zip(dims, strides, strict=True))
    return first, last - first + 1, math.prod(d.count for d in dims)


def _dense(length: int, selected: int, itemsize: int) -> bool:
    return (length - selected) * itemsize <= max(selected * itemsize, PAGE)


def _plan(dims: list[_Dim], strides: Sequence[int], itemsize: int) -> list[_Piece]:
    """Pieces covering the selection, in the result's row-major order."""
    first, length, selected = _span(dims, strides)
    if _dense(length, selected, itemsize):
        return [_Piece(first, length, dims)]
    axis = next(i for i, d in enumerate(dims) if d.count > 1)
    dim = dims[axis]
    pieces: list[_Piece] = []
    lo = 0
    while lo < dim.count:
        hi = lo + 1
        while hi < dim.count:
            group = _with(dims, axis, _Dim(dim.start + lo * dim.step, dim.step, hi + 1 - lo, True))
            _, length, selected = _span(group, strides)
            if not _dense(length, selected, itemsize):
                break
            hi += 1
        group = _with(dims, axis, _Dim(dim.start + lo * dim.step, dim.step, hi - lo, True))
        if hi - lo > 1:
            first, length, _ = _span(group, strides)
            pieces.append(_Piece(first, length, group))
        else:
            pieces += _plan(group, strides, itemsize)
        lo = hi
    return pieces


def _with(dims: list[_Dim], axis: int, dim: _Dim) -> list[_Dim]:
    return [*dims[:axis], dim, *dims[axis + 1 :]]


# --------------------------------------------------------------------------- references


def _check_reference(entry: _Entry, ref: _Ref, where: str) -> None:
    """Refuse the tensor ``entry`` of a referenced file when it is not the one ``where``
    references as ``ref.name`` (another dtype or size, other bytes)."""
    path = entry.file.path
    nbytes = entry.end - entry.begin
    if entry.dtype != ref.dtype or nbytes != ref.nbytes:
        raise CheckpointFormatError(
            f"{path}: tensor {entry.name!r} is {entry.dtype} of {nbytes} B, but {where} "
            f"references it as {ref.name!r}, {ref.dtype} of {ref.nbytes} B; the file or the "
            "references are damaged (fastckpt verify names which)"
        )
    if entry.crc32c != ref.crc32c:
        raise ChecksumMismatchError(
            f"{path}: tensor {entry.name!r} is not the one {where} references as "
            f"{ref.name!r} (crc32c differs)"
        )


def _check_found(handle: _File, only: Mapping[str, list[_Ref]], where: str) -> None:
    """Refuse a referenced file that lacks a tensor ``where`` references in it (each
    reference is a tensor of the checkpoint: none is dropped silently)."""
    present = {entry.name for entry in handle.entries()}
    for source_name, refs in only.items():
        if source_name not in present:
            raise CheckpointFormatError(
                f"{handle.path}: has no tensor {source_name!r}, which {where} references as "
                f"{refs[0].name!r}; the file or the references are damaged (fastckpt verify "
                "names which)"
            )


# --------------------------------------------------------------------------- the handle


class HandleClosedError(FastCkptError, SafetensorError, ValueError):
    """A closed :class:`SafeOpen` handle was used. A ``safetensors.SafetensorError`` too (what
    safetensors raises for a closed handle), so code written for safetensors catches it."""


class TensorSlice:
    """A tensor not read yet; index it (``[...]``, ints, slices) to read part of it.

    Mirrors the slice object of ``safetensors.safe_open(...).get_slice(name)``.
    """

    def __init__(self, handle: SafeOpen, name: str, entry: _Entry) -> None:
        """Created by :meth:`SafeOpen.get_slice`."""
        self._handle = handle
        self._name = name
        self._entry = entry

    def get_shape(self) -> list[int]:
        """The tensor's shape."""
        return list(self._entry.shape)

    def get_dtype(self) -> str:
        """The tensor's safetensors dtype name (``"F32"``, ``"BF16"``, ...)."""
        return self._entry.dtype

    def __len__(self) -> int:
        """Size of the first dimension."""
        if not self._entry.shape:
            raise TypeError(f"{self._name}: len() of a 0-d tensor")
        return self._entry.shape[0]

    def __getitem__(self, key: Any) -> torch.Tensor:
        """Read the selected elements: exactly the shape and values ``tensor[key]`` has in
        torch, for ints, slices (any start and stop, a positive step; empty selections
        included), one empty list and one ``...``; what torch refuses is refused
        (``IndexError``, or :class:`~fastckpt.errors.InvalidInputError` for a step of zero or
        below and for other kinds of index: a non-empty list, a second list). See the module
        docstring for what is verified."""
        return self._handle._read_slice(self._name, self._entry, key)


class SafeOpen:
    """An open checkpoint or file: see :func:`safe_open`. Use as a context manager."""

    def __init__(
        self,
        files: list[_Target],
        where: str,
        device: torch.device,
        verify: bool,
        verify_slices: bool,
    ) -> None:
        """Open every file and read their headers (see :func:`safe_open`)."""
        self.where = where
        self.device = device
        self.verify = verify
        self.verify_slices = verify_slices
        self._closed = False
        self._files: list[_File] = []
        self._entries: dict[str, _Entry] = {}
        # Reads in flight (any thread): close() leaves their descriptors open until the last
        # one ends (closed under a reader, a descriptor number taken by another open made
        # the read return another file's bytes, or blame this file's checksum).
        self._state = ForkSafeLock()
        self._readers = 0
        _HANDLES.add(self)
        try:
            for label, path, size, only in files:
                handle = _File(path, size)
                self._files.append(handle)
                for entry in handle.entries():
                    if only is None:
                        self._add(label, entry.name, entry)
                        continue
                    for ref in only.get(entry.name, []):
                        _check_reference(entry, ref, where)
                        self._add(label, ref.name, entry)
                if only is not None:
                    _check_found(handle, only, where)
        except BaseException:
            self.close()
            raise

    def _add(self, label: str, name: str, entry: _Entry) -> None:
        """Make ``entry`` readable as ``name`` (``<label>/<name>`` over several files)."""
        key = f"{label}/{name}" if label else name
        if key in self._entries:
            raise CheckpointFormatError(
                f"{self.where}: tensor key {key!r} is ambiguous (two files name it); "
                "select one file with part="
            )
        self._entries[key] = entry

    # ------------------------------------------------------------------ safetensors API

    def keys(self) -> list[str]:
        """Tensor names, sorted (``<part>/<name>`` over several files), as safetensors does."""
        self._check_open()
        return sorted(self._entries)

    def offset_keys(self) -> list[str]:
        """Tensor names in the order their bytes appear (file by file)."""
        self._check_open()
        return list(self._entries)

    def metadata(self) -> dict[str, str] | None:
        """The file's ``__metadata__`` without fastckpt's checksum entries; None when it has
        none (as safetensors says of a file saved without metadata) or when the handle spans
        several files."""
        self._check_open()
        if len(self._files) != 1:
            return None
        return dict(self._files[0].header["metadata"]) or None

    def get_tensor(self, name: str) -> torch.Tensor:
        """Read one whole tensor; its crc32c is verified (when the file has one and
        ``verify`` is on).

        Raises:
            KeyError: no such tensor (lists some of the names).
            ChecksumMismatchError: the bytes differ from the checksum (names file and tensor).
        """
        entry = self._entry(name)
        with self._reading():
            return self._to_device(self._read_whole(name, entry))

    def get_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor, ``{name: tensor}`` in file order (:meth:`get_tensor` of each of
        :meth:`offset_keys`, each verified as it is read)."""
        return {name: self.get_tensor(name) for name in self.offset_keys()}

    def get_slice(self, name: str) -> TensorSlice:
        """A lazy view of tensor ``name``: ``get_shape()``, ``get_dtype()``, ``[...]``."""
        return TensorSlice(self, name, self._entry(name))

    # ------------------------------------------------------------------ fastckpt extras

    def info(self, name: str) -> dict[str, Any]:
        """``{"file", "dtype", "shape", "data_offsets" (absolute), "crc32c"}`` of a tensor."""
        entry = self._entry(name)
        return {
            "file": str(entry.file.path),
            "dtype": entry.dtype,
            "shape": list(entry.shape),
            "data_offsets": [entry.begin, entry.end],
            "crc32c": entry.crc32c,
        }

    def close(self) -> None:
        """Close the files (idempotent). A read another thread is running finishes with the
        right bytes (its files close when it ends); reads after this raise
        :class:`HandleClosedError`."""
        with self._state:
            self._closed = True
            if self._readers:
                return  # the last read closes them
            files, self._files = self._files, []
        for handle in files:
            handle.close()

    @contextlib.contextmanager
    def _reading(self) -> Iterator[None]:
        """Hold the files open for one read (see :meth:`close`)."""
        counted = False
        try:
            with self._state:
                if self._closed:
                    raise HandleClosedError(f"{self.where}: this safe_open handle is closed")
                self._readers += 1
                counted = True
            yield
        finally:
            files: list[_File] = []
            if counted:
                with self._state:
                    self._readers -= 1
                    if self._closed and not self._readers:
                        files, self._files = self._files, []
            for handle in files:
                handle.close()

    def _after_fork(self) -> None:
        """In a forked child: the parent's reads in flight are not the child's (their
        threads do not exist there); a close that waited for them closes the files now."""
        self._readers = 0
        if self._closed:
            files, self._files = self._files, []
            for handle in files:
                handle.close()

    def __enter__(self) -> SafeOpen:
        """Return self."""
        return self

    def __exit__(self, *exc: object) -> None:
        """Close."""
        self.close()

    def __del__(self) -> None:
        """Close descriptors a caller forgot to close."""
        if getattr(self, "_files", None):
            self.close()

    # ------------------------------------------------------------------ reading

    def _check_open(self) -> None:
        if self._closed:
            raise HandleClosedError(f"{self.where}: this safe_open handle is closed")

    def _entry(self, name: str) -> _Entry:
        self._check_open()
        try:
            return self._entries[name]
        except KeyError:
            names = list(self._entries)
            shown = ", ".join(repr(n) for n in names[:10]) + (", ..." if len(names) > 10 else "")
            raise KeyError(f"{self.where}: no tensor {name!r}; it has {shown}") from None

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if self.device.type == "cpu" else tensor.to(self.device)

    def _read_whole(self, name: str, entry: _Entry) -> torch.Tensor:
        dtype = dtype_from_name(entry.dtype)
        out = empty_tensor(entry.torch_shape, dtype)
        target = out.reshape(-1).view(torch.uint8).numpy()
        where = f"{entry.file.path}: tensor {entry.name!r}"
        if not (self.verify and entry.crc32c is not None):
            pread_into(entry.file.fd, entry.begin, target, where)
            return out
        crc = 0
        for at in range(entry.begin, entry.end, READ_CHUNK):
            data = pread_exact(entry.file.fd, at, min(READ_CHUNK, entry.end - at), where)
            crc = _native.crc32c(data, crc)
            target[at - entry.begin : at - entry.begin + len(data)] = np.frombuffer(data, np.uint8)
        if crc != entry.crc32c:
            raise ChecksumMismatchError(
                f"{entry.file.path}: checksum mismatch in tensor {entry.name!r} (stored crc32c "
                f"{entry.crc32c:08x}, computed {crc:08x}); the file is corrupt: restore it from "
                f"a copy or load an older checkpoint {_native.STALE_CHECKSUMS_HINT}"
            )
        return out

    def _read_slice(self, name: str, entry: _Entry, key: Any) -> torch.Tensor:
        with self._reading():
            return self._read_slice_open(name, entry, key)

    def _read_slice_open(self, name: str, entry: _Entry, key: Any) -> torch.Tensor:
        where = f"{entry.file.path}: tensor {entry.name!r}"
        dims = _normalize(key, entry.shape, where)
        held = entry.torch_shape
        if held != entry.shape:  # F4: torch holds pairs of 4-bit values
            last = dims[-1]
            # Whole: every value, in order (the step does not matter below two values).
            if not (
                last.keep and last.count == entry.shape[-1] and (last.step == 1 or last.count < 2)
            ):
                raise ValueError(
                    f"{where}: {entry.dtype} packs two values per byte; slice the leading "
                    "dimensions only and keep the last one whole"
                )
            dims[-1] = _Dim(0, 1, held[-1], True)
        shape = [d.count for d in dims if d.keep]
        numel = math.prod(held)
        if math.prod(d.count for d in dims) == numel or self.verify_slices:
            whole = self._read_whole(name, entry)
            picked = whole[tuple(_as_index(d) for d in dims)]
            # A part is copied out, so the whole tensor it was cut from can be freed.
            return self._to_device(picked if picked.numel() == numel else picked.clone())
        dtype = dtype_from_name(entry.dtype)
        out = empty_tensor(shape, dtype)
        if out.numel() == 0:
            return self._to_device(out)
        itemsize = dtype.itemsize
        flat = out.reshape(-1).view(torch.uint8).numpy().view(_UINTS[itemsize])
        strides = _strides(held)
        position = 0
        for piece in _plan(dims, strides, itemsize):
            offset = entry.begin + piece.first * itemsize
            counts = [d.count for d in piece.dims]
            count = math.prod(counts)
            if count == piece.length:  # contiguous: straight into the result
                target = flat[position : position + count].view(np.uint8)
                pread_into(entry.file.fd, offset, target, where)
                position += count
                continue
            data = pread_exact(entry.file.fd, offset, piece.length * itemsize, where)
            span = np.frombuffer(data, _UINTS[itemsize])
            view = np.lib.stride_tricks.as_strided(
                span,
                shape=counts,
                strides=[d.step * s * itemsize for d, s in zip(piece.dims, strides, strict=True)],
                writeable=False,
            )
            flat[position : position + count].reshape(counts)[...] = view
            position += count
        return self._to_device(out)


#: Open handles, for :func:`_forget_parent_reads` after a fork.
_HANDLES: weakref.WeakSet[SafeOpen] = weakref.WeakSet()


def _forget_parent_reads() -> None:
    for handle in list(_HANDLES):
        handle._after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_parent_reads)


def safe_open(
    path: str | os.PathLike[str],
    framework: str = "pt",
    device: str | torch.device = "cpu",
    *,
    index: int | None = None,
    part: str | None = None,
    verify: bool = True,
    verify_slices: bool = False,
    backend: str = "mmap",
) -> SafeOpen:
    """Open a safetensors file or a fastckpt checkpoint for lazy reads of single tensors.

    The same shape as ``safetensors.safe_open``: ``keys()``, ``metadata()``,
    ``get_tensor(name)``, ``get_slice(name)[...]`` (``get_shape()``, ``get_dtype()``). Only the
    headers are read when opening; each read fetches only its bytes (see the module docstring
    for exactly what is and is not verified).

    Args:
        path: a ``.safetensors`` file (fastckpt's or the ``safetensors`` package's); a
            :func:`fastckpt.save_checkpoint` root or one of its index directories; or a
            :class:`fastckpt.CheckpointManager` checkpoint directory. Symlinks in a path you
            give are resolved once; the file is then opened without following links and must
            be a regular file. Files a commit record names must resolve inside the checkpoint.
        framework: ``"pt"`` (tensors are torch tensors; the only framework supported).
        device: where returned tensors live.
        index: for a root, the committed index (default: the latest).
        part: one tensor file of a checkpoint, e.g. ``"models/main"`` (an index) or ``"model"``
            (a manager item); its tensors then keep their plain names.
        verify: check each whole tensor's crc32c when it is read.
        verify_slices: also verify partial slices, by reading their whole tensor; needs
            ``verify=True``.
        backend: ``"mmap"`` (default) or ``"pread"``, as safetensors takes them. The handle
            reads each tensor's bytes with positional reads into fresh memory either way (a
            mapping could change under a verified tensor), so both give the same tensors;
            another value is refused.

    Returns:
        A :class:`SafeOpen` handle (a context manager; close it to release the files).

    Raises:
        FileNotFoundError: no such path, a directory that is not a checkpoint, or a file the
            record names is missing.
        CheckpointFormatError: not a regular file (FIFO, device, a link swapped in), a
            malformed header or one that fails its own crc32c, a size that differs from
            the commit record, or a reference of an incremental checkpoint naming a tensor
            its file lacks or one of another dtype or size (names the file and the tensor).
        ChecksumMismatchError: a damaged manifest (for roots), or a referenced tensor whose
            crc32c differs from its reference's.
        KeyError: an index or part that the checkpoint does not have.
        ValueError: an unsupported framework or backend, ``verify_slices=True`` with
            ``verify=False``, index/part given for a single file, or a sharded (DCP)
            checkpoint (consolidate it with ``fastckpt export``).
        InvalidInputError: ``verify`` or ``verify_slices`` not a bool (a ``TypeError``).
    """
    if backend not in BACKENDS:
        raise InvalidInputError(
            f"backend {backend!r} is not supported: use one of {', '.join(BACKENDS)} (fastckpt "
            "reads with positional reads for both)"
        )
    if framework not in _FRAMEWORKS:
        raise ValueError(
            f"framework {framework!r} is not supported: fastckpt.safe_open returns torch "
            "tensors (framework='pt')"
        )
    # verify=None (falsy) turned checksum checking off: damaged bytes were returned.
    check_flag(verify, "verify", "safe_open")
    check_flag(verify_slices, "verify_slices", "safe_open")
    if verify_slices and not verify:
        # Before, the pair was accepted and verified nothing: slices came back unverified.
        raise ValueError(
            "safe_open: verify_slices=True needs verify=True (verify=False turns every "
            "checksum check off, slices included); pass verify=True, or verify_slices=False to "
            "read unverified"
        )
    files, where = _resolve_files(Path(path), index, part)
    return SafeOpen(files, where, torch.device(device), verify, verify_slices)
