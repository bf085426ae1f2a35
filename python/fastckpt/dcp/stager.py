"""DCP's ``AsyncStager`` protocol on fastckpt's reusable staging buffers.

``dcp.async_save`` first asks a stager for a "training-safe" copy of the state dict and then
writes that copy in the background. DCP's default stagers allocate a fresh host copy of the
whole state on every save (or cache one pinned copy); fastckpt's stagers
(:mod:`fastckpt.io.staging`) keep one host buffer per tensor and refill it on each save, so the
training loop stalls only for the copy into warm memory.

:class:`DcpStager` stages nests of dicts/lists/tuples of tensors and DTensors (a DTensor's
local shard is staged and re-wrapped with the same mesh and placements); non-tensor values are
copied.
"""

from __future__ import annotations

import copy
import io
import threading
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.tensor import DTensor

from fastckpt.errors import UnsupportedValueError
from fastckpt.io.staging import Stager, StagerOptions, make_stager
from fastckpt.io.tree import join_path

__all__ = ["DcpStager"]


class DcpStager(AsyncStager):
    """An ``AsyncStager`` that copies a DCP state dict into reusable host buffers.

    Pass it as ``dcp.async_save(..., async_stager=DcpStager())``, or let
    :class:`fastckpt.dcp.Writer` (which is one) stage. Staging is synchronous: when
    :meth:`stage` returns, the copy is complete and training may change the originals.

    A snapshot's buffers are reused by the next :meth:`stage` only after :meth:`release` was
    called for it (the writer does that when this rank's data is written); until then a new
    snapshot gets new buffers, so an unfinished save never sees its data overwritten.

    Args:
        options: how to stage CUDA tensors (pinned buffers and non-blocking copies by default).
    """

    _synchronize_after_execute: bool = False

    def __init__(self, options: StagerOptions | None = None) -> None:
        """Create the stager; buffers are allocated on the first :meth:`stage`."""
        self._options = options or StagerOptions(pinned=True, non_blocking=True)
        self._stager: Stager = make_stager(self._options)
        self._in_use = False
        self._lock = threading.Lock()

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """A copy of ``state_dict`` whose tensors live in this stager's host buffers.

        Raises:
            UnsupportedValueError: a ``ShardedTensor`` (FSDP1) value; use FSDP2 or ``dcp.save``.
        """
        with self._lock:
            if self._in_use:
                self._stager = make_stager(self._options)
            self._in_use = True
            stager = self._stager
        tensors: dict[str, torch.Tensor] = {}
        skeleton = _collect(state_dict, "", tensors)
        staged = stager.stage(tensors)
        return _rebuild(skeleton, staged)

    def release(self) -> None:
        """Allow the next :meth:`stage` to reuse the buffers of the last snapshot."""
        with self._lock:
            self._in_use = False

    def synchronize_staging(self) -> None:
        """No-op: :meth:`stage` returns once the copy is complete."""

    def close(self) -> None:
        """Drop the staging buffers."""
        with self._lock:
            self._stager = make_stager(self._options)
            self._in_use = False

    @property
    def nbytes(self) -> int:
        """Bytes held in staging buffers."""
        return self._stager.nbytes


class _Staged:
    """A placeholder in the skeleton: the tensor (or DTensor shard) staged under ``key``."""

    def __init__(self, key: str, dtensor: DTensor | None) -> None:
        self.key = key
        self.dtensor = dtensor


def _collect(
    value: Any, path: str, tensors: dict[str, torch.Tensor], keys: tuple[Any, ...] = ()
) -> Any:
    """The skeleton of ``value`` (at key path ``path``, for messages; ``keys``: the same as a
    tuple) with each tensor replaced by a placeholder for the buffer staged into ``tensors``.
    Buffers are named by the tuple of keys: dotted paths collide (``{"": {"x": a}}`` and
    ``{"x": b}`` are both ``x``), and one buffer staged for both saved ``b`` twice."""
    key = repr(keys)
    if isinstance(value, DTensor):
        tensors[key] = value.to_local()
        return _Staged(key, value)
    if isinstance(value, torch.Tensor):
        if type(value).__name__ == "ShardedTensor" or value.layout is not torch.strided:
            raise UnsupportedValueError(
                f"{path}: {type(value).__name__} ({value.layout}) cannot be staged; use FSDP2 "
                "(DTensor) state or a synchronous dcp.save"
            )
        tensors[key] = value
        return _Staged(key, None)
    if isinstance(value, Mapping):
        return {
            name: _collect(item, join_path(path, name), tensors, (*keys, name))
            for name, item in value.items()
        }
    if isinstance(value, list):
        return [
            _collect(item, join_path(path, i), tensors, (*keys, i)) for i, item in enumerate(value)
        ]
    if isinstance(value, tuple) and type(value) is tuple:
        return tuple(
            _collect(item, join_path(path, i), tensors, (*keys, i)) for i, item in enumerate(value)
        )
    if isinstance(value, io.BytesIO):
        return io.BytesIO(value.getvalue())
    if type(value).__name__ == "ShardedTensor":
        raise UnsupportedValueError(
            f"{path}: ShardedTensor (FSDP1) values cannot be staged; use FSDP2 (fully_shard) "
            "or a synchronous dcp.save"
        )
    return copy.deepcopy(value)


def _rebuild(skeleton: Any, staged: Mapping[str, torch.Tensor]) -> Any:
    if isinstance(skeleton, _Staged):
        local = staged[skeleton.key]
        if skeleton.dtensor is None:
            return local
        return DTensor(local, skeleton.dtensor._spec, requires_grad=False)
    if isinstance(skeleton, dict):
        return {key: _rebuild(item, staged) for key, item in skeleton.items()}
    if isinstance(skeleton, list):
        return [_rebuild(item, staged) for item in skeleton]
    if isinstance(skeleton, tuple):
        return tuple(_rebuild(item, staged) for item in skeleton)
    return skeleton
