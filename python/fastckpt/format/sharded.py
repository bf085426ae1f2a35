"""DCP's checkpoint ``Metadata`` <-> the JSON commit record of a sharded checkpoint. No pickle.

``torch.distributed.checkpoint.FileSystemWriter`` pickles its ``Metadata`` into ``.metadata``,
so loading a tampered checkpoint runs whatever the file says. fastckpt writes the same
information as JSON (:func:`encode_record`) and rebuilds it from plain JSON values only
(:func:`decode_record`): dtypes, layouts and memory formats are looked up by name among
torch's own objects, never imported or called.

The record also names the *generation* directory that holds the data files and lists every
file with its size and crc32c (see :mod:`fastckpt.container.sharded.commit`), and carries a crc32c
of its
own canonical content (field :data:`RECORD_CRC_FIELD`, sealed like ``manifest.json``, see
:func:`fastckpt.format.records.seal_manifest`), checked on every read: a flipped bit anywhere
in it (a tensor name, a shape, a file name) is a :class:`~fastckpt.ChecksumMismatchError`
naming the file, never a load that silently skips a tensor. Records written before the field
existed (fastckpt 0.x up to this change) have none: they are read as before, provided they
hold exactly the fields such records had.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from fastckpt import _native
from fastckpt.errors import CheckpointFormatError
from fastckpt.format.records import (
    MANIFEST_CRC_FIELD,
    check_seal,
    load_json,
    seal_manifest,
    unexpected_fields,
)
from fastckpt.io.files import dtype_name, torch_shape
from fastckpt.io.tree import flatten, unflatten

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "RECORD_CRC_FIELD",
    "Record",
    "StoredChunk",
    "decode_record",
    "encode_record",
]

#: ``format`` field of every commit record.
FORMAT = "fastckpt-dcp"
#: ``format_version`` this code writes and reads.
FORMAT_VERSION = 1

#: Top-level field holding the crc32c of the rest of the record (the manifest's field name
#: and canonical form: sort_keys, compact, ASCII).
RECORD_CRC_FIELD = MANIFEST_CRC_FIELD
#: The top-level fields of a record; records written before the checksum lack only it.
_LEGACY_FIELDS = frozenset({"format", "format_version", "generation", "files", "dcp"})
_FIELDS = _LEGACY_FIELDS | {RECORD_CRC_FIELD}

ValueKind = Literal["tensor", "bytes", "bytesio", "json"]
_KINDS = ("tensor", "bytes", "bytesio", "json")


@dataclass(frozen=True)
class StoredChunk:
    """Where one DCP item (a tensor chunk or a non-tensor value) lies on disk.

    Attributes:
        file: file name inside the generation directory.
        kind: ``"tensor"`` (an entry of a safetensors file), ``"bytes"`` / ``"bytesio"`` (raw
            bytes) or ``"json"`` (UTF-8 JSON, see :mod:`fastckpt.container.sharded.values`).
        offset: absolute byte offset of the item's bytes in the file.
        length: number of bytes.
        crc32c: crc32c of all ``length`` bytes.
        name: entry name in the safetensors file (tensors only; the DCP fully qualified name).
        dtype: safetensors dtype name (tensors only).
        shape: the chunk's shape (tensors only).
        block_bytes: size of the verification blocks when the chunk is checked block by block
            (``None``: one block, the whole chunk, checked against ``crc32c``).
        blocks: crc32c of each ``block_bytes`` piece of the chunk, in order (last one short).
        file_len: size of the whole file (carried to the coordinator for the files table).
        file_crc32c: crc32c of the whole file, when the writer computed it.
        generation: the generation directory the file is in (the record stores it once).
    """

    file: str
    kind: ValueKind
    offset: int
    length: int
    crc32c: int
    name: str | None = None
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    block_bytes: int | None = None
    blocks: tuple[int, ...] | None = None
    file_len: int = 0
    file_crc32c: int | None = None
    generation: str = ""

    @property
    def tensor_shape(self) -> tuple[int, ...]:
        """The chunk's shape as torch and DCP's plan hold it: :attr:`shape` is the safetensors
        header's, which counts an ``F4`` tensor's 4-bit values where torch's
        ``float4_e2m1fn_x2`` holds pairs (its last dimension halved).

        Raises:
            InvalidInputError: an ``F4`` shape whose last dimension is odd or absent.
        """
        shape = list(self.shape or ())
        return tuple(torch_shape(f"{self.file}: tensor {self.name!r}", self.dtype or "", shape))


@dataclass
class Record:
    """A decoded commit record: the generation, its files and DCP's metadata.

    Attributes:
        path: the record file.
        generation: the generation directory its files are in.
        files: file name -> ``{"size", "crc32c"}``.
        metadata: DCP's metadata.
        storage: where each DCP item lies (see :class:`StoredChunk`).
        file_crc32c: crc32c of the record file's bytes (what a strategy index records of the
            sharded part it committed).
        sealed: whether the record carries its own checksum (False: written before it existed).
    """

    path: Path
    generation: str
    files: dict[str, dict[str, int | None]]
    metadata: Metadata
    storage: dict[MetadataIndex, StoredChunk] = field(default_factory=dict)
    file_crc32c: int = 0
    sealed: bool = True


# ------------------------------------------------------------------------------ encoding


#: Whether torch's TensorProperties records a tensor's strides (a field newer torch added;
#: torch 2.9 has none). Records keep "strides" either way: null where torch gave none.
_PROPERTIES_HAVE_STRIDES = "strides" in {f.name for f in fields(TensorProperties)}


def _torch_name(value: object) -> str:
    text = str(value)
    if not text.startswith("torch."):
        raise CheckpointFormatError(f"cannot record {value!r} by name")
    return text


def _encode_properties(props: TensorProperties) -> dict[str, Any]:
    strides = getattr(props, "strides", None)
    return {
        "dtype": _torch_name(props.dtype),
        "layout": _torch_name(props.layout),
        "requires_grad": bool(props.requires_grad),
        "memory_format": _torch_name(props.memory_format),
        "pin_memory": bool(props.pin_memory),
        "strides": None if strides is None else [int(s) for s in strides],
    }


def _encode_entry(entry: Any, fqn: str) -> dict[str, Any]:
    if isinstance(entry, TensorStorageMetadata):
        return {
            "type": "tensor",
            "size": [int(s) for s in entry.size],
            "properties": _encode_properties(entry.properties),
            "chunks": [
                {"offsets": [int(o) for o in c.offsets], "sizes": [int(s) for s in c.sizes]}
                for c in entry.chunks
            ],
        }
    if isinstance(entry, BytesStorageMetadata):
        return {"type": "bytes"}
    raise CheckpointFormatError(f"{fqn}: unknown DCP storage metadata {type(entry).__name__}")


def _encode_chunk(index: MetadataIndex, chunk: StoredChunk) -> dict[str, Any]:
    out: dict[str, Any] = {
        "fqn": index.fqn,
        "offset": None if index.offset is None else [int(o) for o in index.offset],
        "file": chunk.file,
        "kind": chunk.kind,
        "byte_offset": chunk.offset,
        "length": chunk.length,
        "crc32c": chunk.crc32c,
    }
    if chunk.kind == "tensor":
        out.update(
            name=chunk.name,
            dtype=chunk.dtype,
            shape=list(chunk.shape or ()),
            block_bytes=chunk.block_bytes,
            blocks=None if chunk.blocks is None else list(chunk.blocks),
        )
    return out


def _encode_storage_meta(meta: StorageMeta | None) -> Any:
    if meta is None:
        return None
    return {
        "checkpoint_id": None if meta.checkpoint_id is None else str(meta.checkpoint_id),
        "save_id": meta.save_id,
        "modules": list(meta.modules),
    }


def encode_record(
    generation: str, metadata: Metadata, storage: dict[MetadataIndex, StoredChunk]
) -> bytes:
    """The commit record of ``generation`` as UTF-8 JSON bytes.

    Raises:
        CheckpointFormatError: the metadata holds something JSON cannot express (e.g. planner
            data that is not a nest of plain values).
    """
    files: dict[str, dict[str, int | None]] = {}
    for chunk in storage.values():
        files[chunk.file] = {"size": chunk.file_len, "crc32c": chunk.file_crc32c}
    try:
        planner_data, planner_tensors = flatten(metadata.planner_data)
    except TypeError as err:
        raise CheckpointFormatError(f"DCP planner data cannot be stored as JSON: {err}") from None
    if planner_tensors:
        raise CheckpointFormatError("DCP planner data holds tensors; it cannot be stored as JSON")
    record: dict[str, Any] = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "generation": generation,
        "files": dict(sorted(files.items())),
        "dcp": {
            "version": metadata.version,
            "state_dict_metadata": {
                fqn: _encode_entry(entry, fqn)
                for fqn, entry in metadata.state_dict_metadata.items()
            },
            "planner_data": planner_data,
            "storage_meta": _encode_storage_meta(metadata.storage_meta),
            "storage_data": [_encode_chunk(index, chunk) for index, chunk in storage.items()],
        },
    }
    return json.dumps(seal_manifest(record), separators=(",", ":"), allow_nan=False).encode()


# ------------------------------------------------------------------------------ decoding


class _Decoder:
    """Decodes one record, raising :class:`CheckpointFormatError` naming the file and field."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def fail(self, where: str, message: str) -> CheckpointFormatError:
        return CheckpointFormatError(f"{self.path}: {where}: {message}")

    def typed(self, value: Any, kind: type | tuple[type, ...], where: str) -> Any:
        if not isinstance(value, kind):
            raise self.fail(where, f"expected {getattr(kind, '__name__', kind)}, got {value!r}")
        return value

    def ints(self, value: Any, where: str) -> list[int]:
        items = self.typed(value, list, where)
        for item in items:
            if not isinstance(item, int) or isinstance(item, bool) or item < 0:
                raise self.fail(where, f"expected non-negative ints, got {value!r}")
        return list(items)

    def torch_object(self, text: Any, kind: type, where: str) -> Any:
        name = self.typed(text, str, where)
        value = (
            getattr(torch, name.removeprefix("torch."), None) if name.startswith("torch.") else None
        )
        if not isinstance(value, kind):
            raise self.fail(where, f"unknown {kind.__name__} {name!r}")
        return value

    def properties(self, data: Any, where: str) -> TensorProperties:
        data = self.typed(data, dict, where)
        strides = data.get("strides")
        # A record written by a newer torch may carry strides this torch cannot hold.
        extra: dict[str, Any] = {}
        if _PROPERTIES_HAVE_STRIDES:
            extra["strides"] = (
                None if strides is None else tuple(self.ints(strides, f"{where}.strides"))
            )
        return TensorProperties(
            dtype=self.torch_object(data.get("dtype"), torch.dtype, f"{where}.dtype"),
            layout=self.torch_object(data.get("layout"), torch.layout, f"{where}.layout"),
            requires_grad=bool(self.typed(data.get("requires_grad"), bool, where)),
            memory_format=self.torch_object(
                data.get("memory_format"), torch.memory_format, f"{where}.memory_format"
            ),
            pin_memory=bool(self.typed(data.get("pin_memory"), bool, where)),
            **extra,
        )

    def entry(self, fqn: str, data: Any) -> TensorStorageMetadata | BytesStorageMetadata:
        where = f"state_dict_metadata[{fqn!r}]"
        data = self.typed(data, dict, where)
        if data.get("type") == "bytes":
            return BytesStorageMetadata()
        if data.get("type") != "tensor":
            raise self.fail(where, f"unknown type {data.get('type')!r}")
        chunks = []
        for i, chunk in enumerate(self.typed(data.get("chunks"), list, f"{where}.chunks")):
            chunk = self.typed(chunk, dict, f"{where}.chunks[{i}]")
            chunks.append(
                ChunkStorageMetadata(
                    offsets=torch.Size(self.ints(chunk.get("offsets"), f"{where}.offsets")),
                    sizes=torch.Size(self.ints(chunk.get("sizes"), f"{where}.sizes")),
                )
            )
        return TensorStorageMetadata(
            properties=self.properties(data.get("properties"), f"{where}.properties"),
            size=torch.Size(self.ints(data.get("size"), f"{where}.size")),
            chunks=chunks,
        )

    def chunk(
        self, data: Any, i: int, files: dict[str, Any], generation: str
    ) -> tuple[MetadataIndex, StoredChunk]:
        where = f"storage_data[{i}]"
        data = self.typed(data, dict, where)
        fqn = self.typed(data.get("fqn"), str, f"{where}.fqn")
        offset = data.get("offset")
        index = MetadataIndex(
            fqn, None if offset is None else self.ints(offset, f"{where}.offset"), index=None
        )
        file = self.typed(data.get("file"), str, f"{where}.file")
        if file not in files or "/" in file or file.startswith("."):
            raise self.fail(where, f"file {file!r} is not listed in the record's files")
        kind = data.get("kind")
        if kind not in _KINDS:
            raise self.fail(where, f"unknown kind {kind!r}")
        info = files[file]
        common: dict[str, Any] = {
            "file": file,
            "kind": kind,
            "offset": self.ints([data.get("byte_offset")], f"{where}.byte_offset")[0],
            "length": self.ints([data.get("length")], f"{where}.length")[0],
            "crc32c": self.ints([data.get("crc32c")], f"{where}.crc32c")[0],
            "file_len": info["size"],
            "file_crc32c": info["crc32c"],
            "generation": generation,
        }
        if kind == "tensor":
            blocks = data.get("blocks")
            block_bytes = data.get("block_bytes")
            common.update(
                name=self.typed(data.get("name"), str, f"{where}.name"),
                dtype=self.typed(data.get("dtype"), str, f"{where}.dtype"),
                shape=tuple(self.ints(data.get("shape"), f"{where}.shape")),
                block_bytes=None
                if block_bytes is None
                else self.ints([block_bytes], f"{where}.block_bytes")[0],
                blocks=None if blocks is None else tuple(self.ints(blocks, f"{where}.blocks")),
            )
            if (common["blocks"] is None) != (common["block_bytes"] is None) or (
                common["block_bytes"] == 0
            ):
                raise self.fail(where, "block_bytes and blocks must be given together")
            if common["blocks"] is not None:
                count = -(-common["length"] // common["block_bytes"])  # one per piece
                if len(common["blocks"]) != count:
                    raise self.fail(
                        where,
                        f"{len(common['blocks'])} block checksums for {common['length']} bytes "
                        f"in blocks of {common['block_bytes']} ({count} expected)",
                    )
        return index, StoredChunk(**common)

    def files(self, data: Any) -> dict[str, dict[str, int | None]]:
        files = self.typed(data, dict, "files")
        out: dict[str, dict[str, int | None]] = {}
        for name, info in files.items():
            info = self.typed(info, dict, f"files[{name!r}]")
            size = self.ints([info.get("size")], f"files[{name!r}].size")[0]
            crc = info.get("crc32c")
            if crc is not None:
                crc = self.ints([crc], f"files[{name!r}].crc32c")[0]
            out[name] = {"size": size, "crc32c": crc}
        return out

    def storage_meta(self, data: Any) -> StorageMeta:
        if data is None:
            return StorageMeta()
        data = self.typed(data, dict, "storage_meta")
        checkpoint_id = data.get("checkpoint_id")
        save_id = data.get("save_id")
        return StorageMeta(
            checkpoint_id=None
            if checkpoint_id is None
            else self.typed(checkpoint_id, str, "storage_meta.checkpoint_id"),
            save_id=None if save_id is None else self.typed(save_id, str, "storage_meta.save_id"),
            modules=[
                self.typed(m, str, "storage_meta.modules")
                for m in self.typed(data.get("modules", []), list, "storage_meta.modules")
            ],
        )


def decode_record(path: Path, raw: bytes) -> Record:
    """Parse and validate a commit record read from ``path``.

    Raises:
        CheckpointFormatError: not UTF-8 JSON (e.g. a pickle), not a fastckpt-dcp record, or a
            field is missing or malformed; the message names the file and the field.
    """
    decoder = _Decoder(path)
    try:
        data = load_json(path, raw)
    except CheckpointFormatError as err:
        raise CheckpointFormatError(
            f"{err}: not a JSON commit record; the file was replaced or damaged (fastckpt "
            "never unpickles it). Load another checkpoint."
        ) from None
    data = decoder.typed(data, dict, "<root>")
    sealed = _check_seal(path, data)
    if data.get("format") != FORMAT:
        raise decoder.fail("format", f"expected {FORMAT!r}, got {data.get('format')!r}")
    if data.get("format_version") != FORMAT_VERSION:
        raise decoder.fail(
            "format_version",
            f"version {data.get('format_version')!r} is not {FORMAT_VERSION}; upgrade fastckpt",
        )
    generation = decoder.typed(data.get("generation"), str, "generation")
    if "/" in generation or generation.startswith(".") or not generation:
        raise decoder.fail("generation", f"bad directory name {generation!r}")
    files = decoder.files(data.get("files"))
    dcp = decoder.typed(data.get("dcp"), dict, "dcp")
    entries = decoder.typed(dcp.get("state_dict_metadata"), dict, "state_dict_metadata")
    state_dict_metadata: dict[str, Any] = {
        decoder.typed(fqn, str, "state_dict_metadata"): decoder.entry(fqn, entry)
        for fqn, entry in entries.items()
    }
    storage = dict(
        decoder.chunk(item, i, files, generation)
        for i, item in enumerate(decoder.typed(dcp.get("storage_data"), list, "storage_data"))
    )
    try:
        planner_data = unflatten(dcp.get("planner_data"), {}, "planner_data")
    except CheckpointFormatError as err:
        raise decoder.fail("planner_data", str(err)) from None
    _check_consistent(decoder, state_dict_metadata, storage, planner_data)
    version = dcp.get("version")
    metadata = Metadata(
        state_dict_metadata=state_dict_metadata,
        planner_data=planner_data,
        storage_data=storage,
        storage_meta=decoder.storage_meta(dcp.get("storage_meta")),
        version=None if version is None else decoder.typed(version, str, "version"),
    )
    return Record(path, generation, files, metadata, storage, _native.crc32c(raw), sealed)


#: Above this many chunks of one tensor, chunks are checked for overlaps by their offsets only
#: (the pairwise test grows with the square of the count: 128 chunks, under a ms).
_PAIRWISE_CHUNKS = 128


def _check_consistent(
    decoder: _Decoder,
    entries: dict[str, TensorStorageMetadata | BytesStorageMetadata],
    storage: dict[MetadataIndex, StoredChunk],
    planner_data: Any,
) -> None:
    """Refuse a record whose parts disagree, so that no reader builds a tensor from stored
    bytes of another dtype or shape, or leaves part of one unread (uninitialized memory):
    every stored chunk belongs to an entry of its kind and lies inside its file; a tensor
    chunk has the entry's dtype and the shape and byte count of the metadata chunk at its
    offsets; a tensor's chunks lie inside it, do not overlap, cover it exactly and each has
    stored bytes; the planner's paths are of entries, each used once."""
    stored: set[tuple[str, tuple[int, ...]]] = set()
    chunk_sizes = {
        fqn: {tuple(c.offsets): tuple(c.sizes) for c in entry.chunks}
        for fqn, entry in entries.items()
        if isinstance(entry, TensorStorageMetadata)
    }
    for index, chunk in storage.items():
        where = f"storage_data[{index.fqn!r}]"
        entry = entries.get(index.fqn)
        if entry is None:
            raise decoder.fail(where, "names no entry of state_dict_metadata")
        if chunk.offset + chunk.length > chunk.file_len:
            raise decoder.fail(where, f"ends past the end of its file {chunk.file!r}")
        if isinstance(entry, BytesStorageMetadata) != (chunk.kind != "tensor"):
            raise decoder.fail(where, f"a {chunk.kind} value stored for a {_kind(entry)} entry")
        if isinstance(entry, BytesStorageMetadata):
            continue
        if chunk.name != index.fqn:  # the writer names each tensor of a rank file by its fqn
            raise decoder.fail(where, f"names the tensor {chunk.name!r} of its file")
        offsets = tuple(index.offset or ())
        sizes = chunk_sizes[index.fqn].get(offsets)
        if sizes is None:
            raise decoder.fail(where, f"offsets {list(offsets)} are no chunk of the tensor")
        expected = _safetensors_dtype(entry.properties.dtype)
        if chunk.dtype != expected:
            raise decoder.fail(
                where, f"dtype {chunk.dtype!r} differs from the entry's {expected!r}"
            )
        try:
            shape = chunk.tensor_shape
        except ValueError as err:
            raise decoder.fail(where, str(err)) from None
        nbytes = entry.properties.dtype.itemsize
        for size in sizes:
            nbytes *= size
        if shape != sizes or chunk.length != nbytes:
            raise decoder.fail(
                where,
                f"holds {list(shape)} in {chunk.length} bytes, its chunk is {list(sizes)} "
                f"({nbytes} bytes)",
            )
        stored.add((index.fqn, offsets))
    for fqn, entry in entries.items():
        if isinstance(entry, TensorStorageMetadata):
            _check_tiling(decoder, fqn, entry, stored)
    if isinstance(planner_data, dict):
        # The default planner's: each entry's state-dict path (a tuple of keys), which
        # load_state rebuilds the state from; a custom planner's data is its own business.
        seen: dict[tuple[Any, ...], str] = {}
        for fqn, path in planner_data.items():
            if not (isinstance(path, tuple) and all(isinstance(k, (str, int)) for k in path)):
                continue
            where = f"planner_data[{fqn!r}]"
            if fqn not in entries:
                raise decoder.fail(where, "names no entry of state_dict_metadata")
            if path in seen:
                raise decoder.fail(where, f"the same path as {seen[path]!r}")
            if ".".join(map(str, path)) != fqn:  # DCP names each entry by its path
                raise decoder.fail(where, f"{list(path)} is not the key path of {fqn!r}")
            seen[path] = fqn


def _kind(entry: TensorStorageMetadata | BytesStorageMetadata) -> str:
    return "tensor" if isinstance(entry, TensorStorageMetadata) else "non-tensor"


def _safetensors_dtype(dtype: torch.dtype) -> str | None:
    try:
        return dtype_name(dtype)
    except ValueError:
        return None


def _check_tiling(
    decoder: _Decoder,
    fqn: str,
    entry: TensorStorageMetadata,
    stored: set[tuple[str, tuple[int, ...]]],
) -> None:
    """A tensor's chunks lie inside it, do not overlap, cover it and each has stored bytes."""
    where = f"state_dict_metadata[{fqn!r}].chunks"
    size = tuple(entry.size)
    total = 1
    for n in size:
        total *= n
    boxes = []
    covered = 0
    for chunk in entry.chunks:
        offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
        if len(offsets) != len(size) or len(sizes) != len(size):
            raise decoder.fail(where, f"chunk {list(offsets)} has not {len(size)} dimensions")
        if any(o + n > limit for o, n, limit in zip(offsets, sizes, size, strict=True)):
            raise decoder.fail(
                where, f"chunk at {list(offsets)} of {list(sizes)} leaves {list(size)}"
            )
        if (fqn, offsets) not in stored:
            raise decoder.fail(where, f"chunk at {list(offsets)} has no stored data")
        volume = 1
        for n in sizes:
            volume *= n
        covered += volume
        if volume:
            boxes.append((offsets, sizes))
    if covered != total:
        raise decoder.fail(where, f"the chunks hold {covered} of the tensor's {total} elements")
    if len({offsets for offsets, _ in boxes}) != len(boxes):
        raise decoder.fail(where, "two chunks start at the same offsets")
    if 1 < len(boxes) <= _PAIRWISE_CHUNKS and size:
        starts = np.array([offsets for offsets, _ in boxes], dtype=np.int64)
        ends = starts + np.array([sizes for _, sizes in boxes], dtype=np.int64)
        # Boxes i and j overlap where, in every dimension, each starts before the other ends.
        meets = np.all(
            (starts[:, None, :] < ends[None, :, :]) & (starts[None, :, :] < ends[:, None, :]),
            axis=2,
        )
        np.fill_diagonal(meets, False)
        if meets.any():
            i, j = (int(n) for n in np.argwhere(meets)[0])
            raise decoder.fail(
                where, f"chunks at {list(boxes[i][0])} and {list(boxes[j][0])} overlap"
            )


def _check_seal(path: Path, data: dict[str, Any]) -> bool:
    """Check the record's own checksum; whether it has one.

    Raises:
        ChecksumMismatchError: the content does not match the stored checksum.
        CheckpointFormatError: an unknown top-level field, or a checksum that is not an int.
    """
    unknown = sorted(set(data) - _FIELDS)
    if unknown:
        raise unexpected_fields(str(path), unknown)
    # False: written before records carried a checksum.
    return check_seal(path, data)
