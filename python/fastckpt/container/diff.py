"""Comparing the tensors of two checkpoints bit for bit (what ``fastckpt diff`` reports).

A side of a comparison is a :class:`TensorFiles`: safetensors files keyed by a prefix that
qualifies the names of their tensors (``models/main:weight``); the command line builds them
from a checkpoint path, a program can build them from any files.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from fastckpt.errors import CheckpointFormatError
from fastckpt.storage.registry import backend_for

__all__ = ["TensorFiles", "compare_tensors", "diff_checkpoints"]


@dataclasses.dataclass
class TensorFiles:
    """One side of a diff: tensor files keyed by a prefix for tensor names.

    Attributes:
        label: how the side is named in the result.
        files: prefix -> safetensors file (prefix ``""``: tensor names stay as they are).
        references: prefix -> referenced tensors of that prefix (default none).
    """

    label: str
    files: dict[str, Path]
    #: prefix -> {tensor name: (file, name in that file)}: tensors of an incremental
    #: checkpoint index that live in another index's file (see :mod:`fastckpt.container.refs`).
    references: dict[str, dict[str, tuple[Path, str]]] = dataclasses.field(default_factory=dict)


def _qualified(prefix: str, name: str) -> str:
    return f"{prefix}:{name}" if prefix else name


_INT_VIEWS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def compare_tensors(a: torch.Tensor, b: torch.Tensor) -> tuple[int, int | float]:
    """Compare two tensors of equal dtype and shape bit for bit.

    Returns:
        ``(differing elements (the 4-bit values of float4), max |a - b| over them)``. For
        integer and bool tensors the difference is exact (a Python ``int``, even between int64
        or uint64 values that float64 cannot tell apart); for floating tensors it is a float
        (``0.0`` for elements that differ only in their bits, ``+0.0`` against ``-0.0``), NaN
        when a differing element is NaN.
    """
    # contiguous: a strided 1-D view cannot be viewed as an integer of another element size
    # (complex128 as two int64 words).
    flat_a, flat_b = a.reshape(-1).contiguous(), b.reshape(-1).contiguous()
    size = a.element_size()
    words = max(1, size // 8)  # complex128: two 8-byte words per element
    view = _INT_VIEWS[size // words]
    differ = (flat_a.view(view) != flat_b.view(view)).reshape(-1, words).any(dim=1)
    count = int(differ.sum())
    if count == 0:
        return 0, 0.0
    if a.dtype == _FLOAT4_PAIRS:
        # No torch kernel indexes or converts it: decode both 4-bit values of each byte, and
        # count the 4-bit values that differ (the elements the header counts), not bytes.
        pick_a, pick_b = flat_a.view(torch.uint8)[differ], flat_b.view(torch.uint8)[differ]
        flipped = pick_a ^ pick_b
        count = int(((flipped & 0x0F) != 0).sum() + ((flipped >> 4) != 0).sum())
        delta = (_decode_float4_pairs(pick_a) - _decode_float4_pairs(pick_b)).abs()
        return count, float(delta.max())
    if a.is_floating_point() or a.is_complex():
        wide = torch.complex128 if a.is_complex() else torch.float64
        delta = (flat_a[differ].to(wide) - flat_b[differ].to(wide)).abs()
        return count, float(delta.max())
    return count, _max_int_distance(flat_a[differ], flat_b[differ])


#: ``float4_e2m1fn_x2`` (torch >= 2.8; None before): two E2M1 values in each byte.
_FLOAT4_PAIRS = getattr(torch, "float4_e2m1fn_x2", None)


def element_count(tensor: torch.Tensor) -> int:
    """The elements of ``tensor`` as its file's header counts them: two per byte of packed
    ``float4_e2m1fn_x2`` (whose torch shape counts bytes), one per torch element otherwise."""
    return tensor.numel() * (2 if tensor.dtype == _FLOAT4_PAIRS else 1)


#: The 16 E2M1 values by their 4 bits (sign, 2 exponent bits, 1 mantissa bit).
_E2M1 = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=torch.float64,
)


def _decode_float4_pairs(packed: torch.Tensor) -> torch.Tensor:
    """The values of 1-D uint8 bytes that each hold two E2M1 numbers, as float64 pairs."""
    low, high = (packed & 0x0F).long(), (packed >> 4).long()
    return torch.stack([_E2M1[low], _E2M1[high]], dim=1)


#: The unsigned 64-bit dtype (torch >= 2.3; None before): its bits need their order mapped.
_UINT64 = getattr(torch, "uint64", None)


def _max_int_distance(a: torch.Tensor, b: torch.Tensor) -> int:
    """``max |a - b|`` of two non-empty 1-D integer (or bool) tensors of one dtype, exactly.

    Every element is widened to int64 without loss: a uint64 by its bits with the sign bit
    flipped, which keeps the order and the differences modulo 2**64. ``high - low`` is then
    in ``[0, 2**64)`` but wraps in int64: a negative result stands for itself plus 2**64,
    which exceeds every non-negative one.
    """
    if a.dtype == _UINT64:
        sign = torch.tensor(-(2**63), dtype=torch.int64)
        a, b = a.view(torch.int64) ^ sign, b.view(torch.int64) ^ sign
    else:
        a, b = a.to(torch.int64), b.to(torch.int64)
    wrapped = torch.maximum(a, b) - torch.minimum(a, b)
    negative = wrapped[wrapped < 0]
    if negative.numel():
        return int(negative.max()) + 2**64
    return int(wrapped.max())


def _within(count: int, biggest: int | float, atol: float) -> bool:
    """Whether a comparison by :func:`compare_tensors` counts as equal under ``atol``.

    With ``atol`` 0 (the default) only identical bits do: ``+0.0`` against ``-0.0`` and
    int64 values float64 cannot tell apart are changes. With ``atol`` > 0 a tensor whose
    largest difference is at most ``atol`` is equal; one involving a NaN never is.
    """
    if count == 0:
        return True
    return atol > 0 and biggest <= atol  # NaN <= atol is False


def _headers(side: TensorFiles) -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = {}
    for prefix, path in side.files.items():
        for name, info in backend_for(path).read_header(path)["tensors"].items():
            found[_qualified(prefix, name)] = {
                "prefix": prefix,
                "name": name,
                "dtype": info["dtype"],
                "shape": info["shape"],
            }
    sources: dict[Path, dict[str, Any]] = {}
    for prefix, names in side.references.items():
        for name, (path, source_name) in names.items():
            if path not in sources:
                sources[path] = backend_for(path).read_header(path)["tensors"]
            info = sources[path].get(source_name)
            if info is None:
                raise CheckpointFormatError(
                    f"{path}: has no tensor {source_name!r}, which {name!r} references; the "
                    "file or the references are damaged (fastckpt verify names which)"
                )
            found[_qualified(prefix, name)] = {
                "prefix": prefix,
                "name": name,
                "dtype": info["dtype"],
                "shape": info["shape"],
            }
    return found


def _load_prefix(side: TensorFiles, prefix: str) -> dict[str, torch.Tensor]:
    """The tensors of one prefix: its file's and the ones it references."""
    tensors = _load(side.files[prefix]) if prefix in side.files else {}
    by_source: dict[Path, list[tuple[str, str]]] = {}
    for name, (path, source_name) in side.references.get(prefix, {}).items():
        by_source.setdefault(path, []).append((name, source_name))
    for path, pairs in by_source.items():
        source = _load(path)
        tensors.update({name: source[source_name] for name, source_name in pairs})
    return tensors


def _load(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a file on any backend (local or ``s3://``), checksums verified."""
    try:
        return backend_for(path).open_tensors(path, verify=True)[0]
    except TypeError as err:  # a dtype this torch build lacks
        raise TypeError(f"{path}: {err}") from None


def diff_checkpoints(a: TensorFiles, b: TensorFiles, atol: float = 0.0) -> dict[str, Any]:
    """Compare every tensor of two sides (see ``fastckpt diff``).

    Args:
        a, b: the two sides.
        atol: when > 0, tensors whose largest difference is at most this count as equal
            (see :func:`_within`); 0: only identical bits do.

    Returns:
        ``{"a", "b", "atol", "identical", "compared", "same", "changed", "mismatched",
        "added", "removed"}``: ``changed`` lists tensors whose values differ (with the count
        of differing elements and the largest difference), ``mismatched`` those whose dtype
        or shape differ, ``added``/``removed`` those only ``b``/``a`` has. The largest
        difference (``max_abs_diff``) is an exact ``int`` for integer tensors, a float for
        floating ones, None when a NaN is involved.

    Raises:
        TypeError: a tensor's dtype is unknown to this torch build (names the file).
        CheckpointFormatError: a reference names a tensor its file does not have (names the
            file and the tensor).
    """
    head_a, head_b = _headers(a), _headers(b)
    removed = [{"name": n, **_meta(head_a[n])} for n in head_a if n not in head_b]
    added = [{"name": n, **_meta(head_b[n])} for n in head_b if n not in head_a]
    common = [n for n in head_a if n in head_b]
    mismatched = [
        {"name": n, "a": _meta(head_a[n]), "b": _meta(head_b[n])}
        for n in common
        if _meta(head_a[n]) != _meta(head_b[n])
    ]
    comparable = [n for n in common if _meta(head_a[n]) == _meta(head_b[n])]
    changed: list[dict[str, Any]] = []
    same = 0
    by_pair: dict[tuple[str, str], list[str]] = {}
    for name in comparable:
        key = (head_a[name]["prefix"], head_b[name]["prefix"])
        by_pair.setdefault(key, []).append(name)
    for (prefix_a, prefix_b), names in by_pair.items():
        tensors_a, tensors_b = _load_prefix(a, prefix_a), _load_prefix(b, prefix_b)
        for name in names:
            left = tensors_a[head_a[name]["name"]]
            right = tensors_b[head_b[name]["name"]]
            count, biggest = compare_tensors(left, right)
            if _within(count, biggest, atol):
                same += 1
                continue
            changed.append(
                {
                    "name": name,
                    **_meta(head_a[name]),
                    "differing": count,
                    "elements": element_count(left),
                    "max_abs_diff": None if math.isnan(biggest) else biggest,
                }
            )
        del tensors_a, tensors_b
    return {
        "a": a.label,
        "b": b.label,
        "atol": atol,
        "identical": not (changed or mismatched or added or removed),
        "compared": len(common),
        "same": same,
        "changed": changed,
        "mismatched": mismatched,
        "added": added,
        "removed": removed,
    }


def _meta(header: Mapping[str, Any]) -> dict[str, Any]:
    return {"dtype": header["dtype"], "shape": header["shape"]}
