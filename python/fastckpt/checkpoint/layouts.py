"""Memory layouts of a model's tensors, recorded at a save and given back to a rebuilt model.

A model converted after construction to another layout (``model.to(memory_format=
torch.channels_last)``, a transposed parameter) runs other kernels than its constructor's
contiguous build, whose results differ in the last bits: a run resumed in the constructor's
layout would not continue the saved one bit for bit. The tensor files hold values in
contiguous order whatever the layout; the manifest entry records the strides
(:data:`fastckpt.checkpoint.components.STRIDES_FIELD`) of every parameter and buffer laid out
densely but not contiguously, by canonical name (without wrapper segments such as
``_checkpoint_wrapped_module``, as the rebuilt model names them), and a load lays the rebuilt
tensors out so (a recorded tensor the rebuilt model lacks is skipped with a warning).
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from fastckpt.checkpoint.build import canonical_name
from fastckpt.errors import CheckpointFormatError

__all__ = ["apply_strides", "recorded_strides"]


def _named_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``model``'s parameters and buffers by their own names, tied ones under each name
    (:func:`canonical_name` of a name drops wrapper segments)."""
    return itertools.chain(
        model.named_parameters(remove_duplicate=False),
        model.named_buffers(remove_duplicate=False),
    )


def _contiguous_strides(shape: torch.Size | list[int]) -> list[int]:
    strides: list[int] = []
    step = 1
    for size in reversed(list(shape)):
        strides.append(step)
        step *= max(size, 1)
    return strides[::-1]


def _dense_layout(shape: torch.Size | list[int], stride: list[int]) -> bool:
    """Whether ``stride`` lays out ``shape``'s elements with no gap and no overlap (a
    permutation of the contiguous layout, as ``channels_last`` and transposes are), every
    stride within the tensor (a size-1 dimension's stride is free, but bounded here), so
    that a tensor of it holds exactly its elements."""
    numel = 1
    for size in shape:
        numel *= size
    if numel == 0 or any(step < 0 or step > numel for step in stride):
        return False
    expected = 1
    for step, size in sorted((s, n) for s, n in zip(stride, shape, strict=True) if n != 1):
        if step != expected:
            return False
        expected *= size
    return True


def recorded_strides(model: torch.nn.Module) -> dict[str, list[int]]:
    """``{canonical name: stride}`` of ``model``'s parameters and buffers whose strides are
    not the contiguous ones but lay them out densely (``channels_last``, including its 1x1
    and depthwise weights, which torch calls contiguous; a transposed weight). Views with gaps
    or overlaps (which a rebuilt tensor cannot take) and empty tensors are left out."""
    strides: dict[str, list[int]] = {}
    for raw, tensor in _named_tensors(model):
        if tensor.is_meta or tensor.layout != torch.strided or tensor.numel() == 0:
            continue  # sparse layouts have no strides (the save refuses them, typed)
        if tensor.is_contiguous() and 1 not in tensor.shape:
            continue  # the common case: contiguous strides, without computing them
        name = canonical_name(raw)
        stride = list(tensor.stride())
        if stride != _contiguous_strides(tensor.shape) and _dense_layout(tensor.shape, stride):
            strides[name] = stride
    return strides


def apply_strides(model: torch.nn.Module, strides: Any, where: str) -> None:
    """Give each parameter and buffer of ``model`` named in ``strides`` (a record
    :func:`recorded_strides` made; None: none) that layout, in place and keeping its values:
    its ``.data`` is replaced by a copy laid out so (``Parameter`` objects, their
    ``requires_grad`` and whatever references them stay).

    Raises:
        CheckpointFormatError: ``strides`` is not ``{name: [int, ...]}`` giving the tensors of
            ``model`` it names a dense layout of their shape (``where`` names the record); a
            name the rebuilt model lacks is skipped with a warning.
    """
    if strides is None:
        return
    if not isinstance(strides, Mapping):
        raise CheckpointFormatError(f"{where}: must be an object of tensor name -> strides")
    tensors = {canonical_name(name): tensor for name, tensor in _named_tensors(model)}
    missing = sorted(set(strides) - set(tensors))
    if missing:
        warnings.warn(
            f"{where}: records the layout of tensors {missing[:5]}, which the rebuilt model "
            "does not have (added after construction, or buffers its recipe does not build); "
            "their layouts are not applied",
            stacklevel=3,
        )
    for name, stride in strides.items():
        tensor = tensors.get(name)
        if tensor is None:
            continue
        if (
            not isinstance(stride, list)
            or not all(type(step) is int for step in stride)
            or len(stride) != tensor.dim()
            or not _dense_layout(tensor.shape, stride)
        ):
            raise CheckpointFormatError(
                f"{where}.{name}: {stride!r} is no dense layout of shape {list(tensor.shape)}"
            )
        if list(tensor.stride()) == stride or tensor.is_meta:
            continue
        laid_out = torch.empty_strided(
            tensor.shape, stride, dtype=tensor.dtype, device=tensor.device
        )
        laid_out.copy_(tensor.detach())
        tensor.data = laid_out
