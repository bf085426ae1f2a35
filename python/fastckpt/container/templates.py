"""Load templates that can hold what is loaded into them: a tensor template needs memory of
its own (not a meta tensor, no two elements at one address), and no two templates may share
part of their memory, since each is filled with its own saved values (the one filled last
would change the other). Used by every load into templates (``CheckpointManager.load(into=)``,
``fastckpt.dcp.load_state(into=)``) before anything is read.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import torch

from fastckpt.io import tree
from fastckpt.io.headers import check_flag

__all__ = [
    "check_disjoint_templates",
    "check_strict",
    "check_tensor_template",
    "is_dtensor",
    "template_tensors",
    "template_view",
]


def check_strict(strict: object, call: str) -> None:
    """Refuse a ``strict=`` of a load (``call``) that is not a bool: ``"no"`` and ``"false"``
    acted as strict, ``0`` and None as lenient, without a word.

    Raises:
        InvalidInputError: a ``TypeError`` naming ``call`` and the value.
    """
    check_flag(strict, "strict", call)


def is_dtensor(value: torch.Tensor) -> bool:
    """Whether ``value`` is a DTensor (without importing torch.distributed.tensor)."""
    dtensor = sys.modules.get("torch.distributed.tensor")  # not imported: nobody made one
    return dtensor is not None and isinstance(value, dtensor.DTensor)


def check_tensor_template(template: torch.Tensor, path: str) -> None:
    """Refuse a tensor template that cannot hold the saved values: a meta tensor (no memory:
    the load would return it untouched), an inference tensor outside inference mode (torch
    refuses to write it), or one whose elements share memory (``expand``)."""
    where = path or "<root>"
    if template.is_meta:
        raise TypeError(
            f"{where}: a meta tensor holds no memory, nothing can be loaded into it; pass None "
            "to take the saved tensor, or a tensor with memory (torch.empty_like(t, "
            "device='cpu'))"
        )
    if template.is_inference() and not torch.is_inference_mode_enabled():
        raise TypeError(
            f"{where}: an inference tensor (made under torch.inference_mode()) cannot be "
            "written outside inference mode, so nothing can be loaded into it; pass None to "
            "take the saved tensor, or a normal tensor (.clone() outside inference mode)"
        )
    if _elements_overlap(template):
        raise TypeError(
            f"{where}: the template's elements share memory (an expanded or strided view), so "
            "it cannot hold every saved value; pass None or a tensor of its own (.clone())"
        )


def check_disjoint_templates(templates: Mapping[str, Any]) -> list[list[str]]:
    """Refuse tensor templates (outside stateful objects) whose memory partly overlaps
    another's: each is filled with its own saved values, so the one filled last would change
    the other's. The same tensor (or an identical view) in two places, tied weights, is
    accepted: their key paths are returned, one list per tensor, for the caller to prove
    that the checkpoint holds the same bytes at each (else one would be loaded over the
    other's).

    Raises:
        TypeError: names both key paths and the fix.
    """
    found: list[tuple[str, torch.Tensor]] = []
    template_tensors(templates, "", found)
    places: dict[tuple[Any, ...], list[str]] = {}
    for path, tensor in found:
        if tensor.device.type != "meta" and tensor.numel() and not is_dtensor(tensor):
            places.setdefault(template_view(tensor), []).append(path)
    spans = sorted(
        (
            (t.data_ptr(), t.data_ptr() + _extent_bytes(t), path, t)
            for path, t in found
            # a DTensor's memory is its local shard's (filled by DCP, resharded): not compared
            if t.device.type != "meta" and t.numel() and not is_dtensor(t) and t.data_ptr()
        ),
        key=lambda span: span[:3],
    )
    cluster: list[tuple[int, int, str, torch.Tensor]] = []  # extents overlapping in a chain
    end = -1
    for span in spans:
        if cluster and span[0] >= end:
            _check_cluster(cluster)
            cluster = []
        end = span[1] if not cluster else max(end, span[1])
        cluster.append(span)
    _check_cluster(cluster)
    return [paths for paths in places.values() if len(paths) > 1]


def template_view(tensor: torch.Tensor) -> tuple[Any, ...]:
    """What makes two template tensors one (tied weights): the same memory seen the same way,
    lazy conjugate and negative bits included (``t`` and ``t.conj()`` share memory but see
    other values: taken for one tensor, both were filled through it, and the first came back
    conjugated)."""
    return (
        tensor.data_ptr(),
        tensor.dtype,
        tuple(tensor.shape),
        tensor.stride(),
        tensor.is_conj(),
        tensor.is_neg(),
    )


def _check_cluster(cluster: list[tuple[int, int, str, torch.Tensor]]) -> None:
    """Refuse two templates of ``cluster`` (sorted by address, extents overlapping in a
    chain) that share a byte: each one's bytes are looked up in, then marked in, one mask of
    the cluster's extent (an identical view, tied weights, counts once)."""
    if len(cluster) < 2:
        return
    origin = cluster[0][0]
    size = max(span[1] for span in cluster) - origin
    if size > _MASK_BYTES:
        raise TypeError(
            f"{cluster[0][2]} and {cluster[1][2]}: the templates lie in one block of memory "
            f"too large ({size} bytes) to prove that they share none, so loading one might "
            "change another; pass None for them, or tensors of their own (.clone())"
        )
    mask = torch.zeros(size, dtype=torch.bool)
    seen: dict[tuple[Any, ...], str] = {}
    marked: list[tuple[str, torch.Tensor]] = []
    for _, _, path, tensor in cluster:
        view = template_view(tensor)
        if view in seen:
            continue
        seen[view] = path
        taken = _bytes_of(mask, tensor, origin)
        if bool(taken.any()):
            other = next(p for p, t in marked if _share_elements(tensor, t))
            raise TypeError(
                f"{other} and {path}: the templates share part of their memory, so loading "
                "one would change the other; pass None for one of them, or tensors of their "
                "own (.clone())"
            )
        taken.fill_(True)
        marked.append((path, tensor))


def template_tensors(value: Any, path: str, out: list[tuple[str, torch.Tensor]]) -> None:
    """Collect in ``out`` the tensors of plain containers (mappings, lists, tuples) in
    ``value`` by key path (``path`` is ``value``'s own)."""
    if isinstance(value, torch.Tensor):
        out.append((path, value))
    elif isinstance(value, Mapping):
        for key, item in value.items():
            template_tensors(item, tree.join_path(path, key), out)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            template_tensors(item, tree.join_path(path, i), out)


def _extent_bytes(tensor: torch.Tensor) -> int:
    """Bytes from the tensor's first element to just past its last (strides >= 0)."""
    last = sum((n - 1) * abs(step) for n, step in zip(tensor.shape, tensor.stride(), strict=True))
    return (last + 1) * tensor.element_size()


def _share_elements(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors have a byte in common (which one a cluster's mask found, for the
    message): none when their extents are apart; certain when they overlap and both are
    contiguous; strided views are told apart by a mask of the extents' union (beyond
    :data:`_MASK_BYTES` they count as sharing)."""
    a_end, b_end = a.data_ptr() + _extent_bytes(a), b.data_ptr() + _extent_bytes(b)
    if a.data_ptr() >= b_end or b.data_ptr() >= a_end:
        return False
    if a.is_contiguous() and b.is_contiguous():
        return True
    origin = min(a.data_ptr(), b.data_ptr())
    end = max(a_end, b_end)
    if end - origin > _MASK_BYTES:
        return True
    mask = torch.zeros(end - origin, dtype=torch.bool)
    _bytes_of(mask, a, origin).fill_(True)
    return bool(_bytes_of(mask, b, origin).any())


def _bytes_of(mask: torch.Tensor, tensor: torch.Tensor, origin: int) -> torch.Tensor:
    """The bytes of ``tensor`` as a strided view of ``mask`` (byte 0 at address ``origin``)."""
    size = tensor.element_size()
    return mask.as_strided(
        (*tensor.shape, size),
        (*(step * size for step in tensor.stride()), 1),
        tensor.data_ptr() - origin,
    )


#: The largest extent of a cluster of templates compared byte by byte (a mask of this many
#: bytes); templates in a larger block whose extents overlap are refused as unprovable.
_MASK_BYTES = 1 << 28


def _elements_overlap(tensor: torch.Tensor) -> bool:
    """Whether two elements of ``tensor`` are one memory location (``expand``, ``unfold``):
    torch's quick answer where it has one, else the element offsets counted."""
    overlap = getattr(torch, "_debug_has_internal_overlap", None)  # 0: no, 1: yes, 2: can't tell
    answer = 2 if overlap is None else overlap(tensor)
    if answer != 2:
        return bool(answer == 1)
    if tensor.numel() < 2:
        return False
    # Sufficient for no overlap (any strided view of a dense tensor passes): ordered by
    # stride, each dimension steps past everything the smaller-stride dimensions span.
    spanned = 0
    for size, stride in sorted(
        ((n, abs(step)) for n, step in zip(tensor.shape, tensor.stride(), strict=True) if n > 1),
        key=lambda dim: dim[1],
    ):
        if stride <= spanned:
            break
        spanned += (size - 1) * stride
    else:
        return False
    if tensor.numel() > _COUNTED_ELEMENTS:
        return True  # cannot be shown apart cheaply: refused as if shared
    shape, strides, start = tensor.shape, tensor.stride(), tensor.storage_offset()
    extent = start + 1 + sum((n - 1) * step for n, step in zip(shape, strides, strict=True))
    offsets = torch.arange(extent).as_strided(shape, strides, start)
    return bool(offsets.unique().numel() != tensor.numel())


#: Templates up to this many elements whose layout proves nothing are checked by counting
#: their element offsets; larger ones are refused (pass a contiguous template instead).
_COUNTED_ELEMENTS = 1 << 22
