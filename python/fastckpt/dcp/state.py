"""Whole training states with sharded (DTensor / FSDP2) values, saved and loaded through DCP.

This is what :class:`fastckpt.CheckpointManager` needs for sharded state: a checkpoint id is
one DCP checkpoint directory written by :class:`~fastckpt.dcp.Writer`, each top-level key of
the state one subtree of it.

* :func:`save_state` / :func:`async_save_state`: every rank calls them with its own shards.
* :func:`load_state`: load into templates (DTensors are filled in place and resharded when the
  world size or mesh changed); keys and shapes are checked against the checkpoint first, so a
  mismatch raises :class:`fastckpt.CheckpointMismatchError` naming the key path instead of a
  raw DCP error. A ``None`` template loads an item as full, unsharded tensors.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict, unflatten_state_dict
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor

from fastckpt.dcp.commit import RECORD_NAME
from fastckpt.dcp.reader import Reader
from fastckpt.dcp.writer import Writer
from fastckpt.errors import CheckpointMismatchError
from fastckpt.store.dispatch import require_local

__all__ = [
    "async_save_state",
    "contains_dtensors",
    "is_sharded_checkpoint",
    "load_state",
    "save_state",
]


#: What to use instead of an ``s3://`` URL.
_SHARED_FS = "use a shared filesystem path every rank can reach for sharded (DCP) checkpoints"


def contains_dtensors(state: Any) -> bool:
    """Whether a nest of mappings/lists/tuples holds a ``DTensor`` (FSDP2, TP) anywhere."""
    if isinstance(state, DTensor):
        return True
    if isinstance(state, Mapping):
        return any(contains_dtensors(value) for value in state.values())
    if isinstance(state, (list, tuple)):
        return any(contains_dtensors(value) for value in state)
    return False


def is_sharded_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a committed sharded (DCP) checkpoint directory."""
    return (Path(path) / RECORD_NAME).is_file()


def save_state(
    path: str | os.PathLike[str],
    state: Mapping[str, Any],
    *,
    writer: Writer | None = None,
    process_group: Any = None,
) -> None:
    """Save ``state`` (this rank's shards) as the sharded checkpoint ``path``; collective.

    Args:
        path: the checkpoint directory (replaced atomically).
        state: ``{key: nest of tensors, DTensors and plain values}``.
        writer: a writer to reuse (its options and staging buffers); one is made otherwise.
        process_group: the group DCP coordinates on (default: the default group, if any).
    """
    require_local(path, "fastckpt.dcp.save_state", _SHARED_FS)
    writer = writer or Writer(path)
    writer.reset(path)
    dcp.save(dict(state), storage_writer=writer, process_group=process_group)


def async_save_state(
    path: str | os.PathLike[str],
    state: Mapping[str, Any],
    *,
    writer: Writer,
    process_group: Any = None,
) -> Future[Any]:
    """:func:`save_state` in the background; returns once ``state`` is staged.

    Training may change the state as soon as this returns. Reuse one ``writer`` across saves
    so its staging buffers are reused, and pass a ``process_group`` dedicated to checkpoints
    (gloo), so the background collectives never interleave with training's.

    Returns:
        A future resolved when the checkpoint is committed (raises what the save raised).
    """
    require_local(path, "fastckpt.dcp.async_save_state", _SHARED_FS)
    writer.reset(path)
    future = dcp.async_save(dict(state), storage_writer=writer, process_group=process_group)
    return future  # type: ignore[return-value]


def _describe(value: Any) -> str:
    return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"


def _check_templates(
    path: Path, metadata: Metadata, templates: Mapping[str, Any], strict: bool
) -> None:
    flat, _ = flatten_state_dict(dict(templates))
    stored = metadata.state_dict_metadata
    for fqn, value in flat.items():
        entry = stored.get(fqn)
        if entry is None:
            if strict:
                raise CheckpointMismatchError(f"{fqn}: not in checkpoint {path}")
            continue
        if not isinstance(value, torch.Tensor):
            continue
        if not isinstance(entry, TensorStorageMetadata):
            raise CheckpointMismatchError(
                f"{fqn}: the checkpoint has a non-tensor value, the template a tensor"
            )
        if value.dtype != entry.properties.dtype or tuple(value.shape) != tuple(entry.size):
            raise CheckpointMismatchError(
                f"{fqn}: checkpoint has {_describe_entry(entry)}, template has "
                f"{_describe(value)} (a DTensor template is compared by its global shape)"
            )


def _describe_entry(entry: TensorStorageMetadata) -> str:
    return f"{str(entry.properties.dtype).removeprefix('torch.')}{list(entry.size)}"


def _paths(metadata: Metadata) -> dict[str, tuple[Any, ...]]:
    """The state-dict path of every stored entry (DCP's flattening map, saved as planner
    data; dotted names split when a planner saved none)."""
    mappings = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    return {fqn: tuple(mappings.get(fqn) or fqn.split(".")) for fqn in metadata.state_dict_metadata}


def _full_template(metadata: Metadata, key: str) -> Any:
    """Plain full-size tensors (and placeholders for values) for every entry under ``key``."""
    flat: dict[str, Any] = {}
    paths: dict[str, Any] = {}
    for fqn, path in _paths(metadata).items():
        entry = metadata.state_dict_metadata[fqn]
        if str(path[0]) != key:
            continue
        if isinstance(entry, TensorStorageMetadata):
            flat[fqn] = torch.empty(list(entry.size), dtype=entry.properties.dtype)
        else:
            flat[fqn] = None
        paths[fqn] = path
    return unflatten_state_dict(flat, paths).get(key)


def load_state(
    path: str | os.PathLike[str],
    into: Mapping[str, Any] | None = None,
    *,
    strict: bool = False,
    process_group: Any = None,
    reader: Reader | None = None,
) -> dict[str, Any]:
    """Load a sharded checkpoint, optionally into templates; collective.

    Args:
        path: the checkpoint directory.
        into: ``{key: template}``. Tensor and DTensor leaves are filled in place (resharded as
            the template's placements say); plain values are replaced; a ``None`` template
            loads that item as full tensors. ``None`` loads every item that way.
        strict: raise on template keys the checkpoint lacks (otherwise they keep their value).
        process_group: the group DCP coordinates on.
        reader: a reader to use (e.g. ``Reader(path, verify=False)``).

    Returns:
        ``{key: value}`` for each requested item.

    Raises:
        CheckpointMismatchError: dtype/shape mismatch, or (strict) a missing key, by key path.
        NotCommittedError, CheckpointFormatError: no or a damaged commit record.
        torch.distributed.checkpoint.api.CheckpointException: a read failed on some rank
            (e.g. ``ChecksumMismatchError`` naming the file and tensor).
    """
    require_local(path, "fastckpt.dcp.load_state", _SHARED_FS)
    root = Path(path)
    reader = reader or Reader(root)
    reader.reset(root)
    metadata = Reader(root).read_metadata()
    stored_keys = {str(path[0]) for path in _paths(metadata).values()}
    keys = sorted(stored_keys) if into is None else list(into)
    state: dict[str, Any] = {}
    result: dict[str, Any] = {}
    for key in keys:
        template = None if into is None else into[key]
        if key not in stored_keys:
            if strict:
                raise CheckpointMismatchError(f"{key}: not in checkpoint {root}")
            result[key] = template
            continue
        state[key] = _full_template(metadata, key) if template is None else template
    _check_templates(root, metadata, state, strict)
    if state:
        dcp.load(
            state,
            storage_reader=reader,
            planner=DefaultLoadPlanner(allow_partial_load=not strict),
            process_group=process_group,
        )
    result.update(state)
    return {key: result[key] for key in keys}
