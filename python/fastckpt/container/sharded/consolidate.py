"""Tools for a sharded checkpoint that need no process group: verify, describe, consolidate.

* :func:`verify_sharded` checks every file the commit record lists (size, whole-file crc32c,
  every tensor's crc32c) and reports instead of raising, like :func:`fastckpt.verify`.
* :func:`describe_sharded` summarizes the record: generation, files, tensors and their chunks.
* :func:`consolidate` assembles the full tensors from all ranks' chunks and writes them as one
  safetensors file (verified reads, Rust writer); non-tensor values go into its metadata.
"""

from __future__ import annotations

import base64
import json
import math
import os
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from fastckpt.container.report import VerifyReport
from fastckpt.container.sharded.chunks import ChunkFiles
from fastckpt.container.sharded.commit import generation_dirs, read_record
from fastckpt.container.sharded.reports import sharded_file_reports
from fastckpt.container.sharded.values import load_skeleton
from fastckpt.errors import CheckpointFormatError
from fastckpt.io.files import copy_values, empty_tensor, save_file
from fastckpt.io.tree import unflatten

__all__ = [
    "VALUES_METADATA_KEY",
    "consolidate",
    "describe_sharded",
    "sharded_file_reports",
    "verify_sharded",
]

#: safetensors metadata key of a consolidated file holding the non-tensor values, as JSON:
#: ``{fqn: {"json": <fastckpt.io.tree skeleton>} | {"base64": "<raw bytes>"}}``.
VALUES_METADATA_KEY = "fastckpt.container.sharded.values"


def verify_sharded(path: str | os.PathLike[str], *, threads: int | None = None) -> VerifyReport:
    """Check a sharded checkpoint on disk without loading it or a process group (the same
    check as :func:`fastckpt.verify` on its directory). Problems, a missing record included,
    are reported in the returned :class:`VerifyReport` (``kind`` ``"sharded"``), not raised.
    """
    return VerifyReport(Path(path), "sharded", sharded_file_reports(path, threads=threads))


def describe_sharded(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A JSON-able summary of a sharded checkpoint's commit record.

    Returns:
        ``{"path", "generation", "uncommitted": [names of leftover generations], "files":
        {name: {"size", "crc32c"}}, "tensors": {fqn: {"dtype", "shape", "chunks"}},
        "values": [fqns]}``.

    Raises:
        NotCommittedError, CheckpointFormatError: as :class:`fastckpt.dcp.Reader`.
    """
    root = Path(path)
    record = read_record(root)
    tensors: dict[str, Any] = {}
    values = []
    for fqn, entry in record.metadata.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            tensors[fqn] = {
                "dtype": str(entry.properties.dtype).removeprefix("torch."),
                "shape": list(entry.size),
                "chunks": len(entry.chunks),
            }
        else:
            values.append(fqn)
    return {
        "path": str(root),
        "generation": record.generation,
        "uncommitted": [d.name for d in generation_dirs(root) if d.name != record.generation],
        "files": record.files,
        "tensors": tensors,
        "values": values,
    }


def consolidate(
    path: str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    verify: bool = True,
    threads: int | None = None,
) -> dict[str, Any]:
    """Write the full tensors of a sharded checkpoint into one safetensors file.

    No process group is needed: the chunks of every rank are read (verified) and placed at
    their DCP offsets. Tensors are named by their DCP fully qualified names (``model.w``,
    ``optim.state.model.w.exp_avg``); non-tensor values are stored in the file's metadata
    under :data:`VALUES_METADATA_KEY`. The whole state is held in memory once.

    Returns:
        ``{"tensors": int, "bytes": int, "values": [fqns]}``.

    Raises:
        NotCommittedError, CheckpointFormatError, ChecksumMismatchError: as when loading.
    """
    root = Path(path)
    record = read_record(root)
    tensors: dict[str, torch.Tensor] = {}
    values: dict[str, Any] = {}
    with ChunkFiles(root / record.generation, verify=verify, within=root) as files:
        for fqn, entry in record.metadata.state_dict_metadata.items():
            if isinstance(entry, BytesStorageMetadata):
                chunk = record.storage.get(MetadataIndex(fqn))
                if chunk is None:
                    raise CheckpointFormatError(f"{record.path}: no stored value for {fqn!r}")
                payload = files.read_bytes(chunk).numpy().tobytes()
                if chunk.kind == "json":
                    where = f"{files.directory / chunk.file}: {fqn!r}"
                    skeleton = load_skeleton(where, payload)  # as strictly as a load reads it
                    unflatten(skeleton, {}, where)  # and in our encoding
                    values[fqn] = {"json": skeleton}
                else:
                    values[fqn] = {"base64": base64.b64encode(payload).decode()}
                continue
            full = empty_tensor(entry.size, entry.properties.dtype)
            covered = 0
            for meta in entry.chunks:
                chunk = record.storage.get(MetadataIndex(fqn, meta.offsets))
                if chunk is None:
                    raise CheckpointFormatError(
                        f"{record.path}: no stored chunk of {fqn!r} at {list(meta.offsets)}"
                    )
                target = full
                for dim, (offset, size) in enumerate(zip(meta.offsets, meta.sizes, strict=True)):
                    target = target.narrow(dim, offset, size)
                copy_values(target, files.read_chunk(chunk))
                covered += math.prod(meta.sizes)
            if covered != full.numel():
                raise CheckpointFormatError(
                    f"{record.path}: the chunks of {fqn!r} cover {covered} of {full.numel()} "
                    "elements"
                )
            tensors[fqn] = full
    metadata = {VALUES_METADATA_KEY: json.dumps(values)} if values else None
    save_file(tensors, output, metadata, threads=threads)
    return {
        "tensors": len(tensors),
        "bytes": sum(t.nbytes for t in tensors.values()),
        "values": sorted(values),
    }
