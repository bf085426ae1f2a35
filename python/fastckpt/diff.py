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

from fastckpt.files import load_file, read_metadata

__all__ = ["TensorFiles", "compare_tensors", "diff_checkpoints"]


@dataclasses.dataclass
class TensorFiles:
    """One side of a diff: tensor files keyed by a prefix for tensor names.

    Attributes:
        label: how the side is named in the result.
        files: prefix -> safetensors file (prefix ``""``: tensor names stay as they are).
    """

    label: str
    files: dict[str, Path]


def _qualified(prefix: str, name: str) -> str:
    return f"{prefix}:{name}" if prefix else name


_INT_VIEWS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def compare_tensors(a: torch.Tensor, b: torch.Tensor) -> tuple[int, float]:
    """Compare two tensors of equal dtype and shape bit for bit.

    Returns:
        ``(differing elements, max |a - b| over them)``; NaN when a differing element is NaN.
    """
    view = _INT_VIEWS[a.element_size()]
    flat_a, flat_b = a.reshape(-1), b.reshape(-1)
    differ = flat_a.view(view) != flat_b.view(view)
    count = int(differ.sum())
    if count == 0:
        return 0, 0.0
    wide = torch.complex128 if a.is_complex() else torch.float64
    delta = (flat_a[differ].to(wide) - flat_b[differ].to(wide)).abs()
    return count, float(delta.max())


def _headers(side: TensorFiles) -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = {}
    for prefix, path in side.files.items():
        for name, info in read_metadata(path)["tensors"].items():
            found[_qualified(prefix, name)] = {
                "prefix": prefix,
                "name": name,
                "dtype": info["dtype"],
                "shape": info["shape"],
            }
    return found


def _load(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(path)
    except TypeError as err:  # a dtype this torch build lacks
        raise TypeError(f"{path}: {err}") from None


def diff_checkpoints(a: TensorFiles, b: TensorFiles, atol: float = 0.0) -> dict[str, Any]:
    """Compare every tensor of two sides (see ``fastckpt diff``).

    Args:
        a, b: the two sides.
        atol: tensors whose largest difference is at most this count as equal.

    Returns:
        ``{"a", "b", "atol", "identical", "compared", "same", "changed", "mismatched",
        "added", "removed"}``: ``changed`` lists tensors whose values differ (with the count
        of differing elements and the largest difference), ``mismatched`` those whose dtype
        or shape differ, ``added``/``removed`` those only ``b``/``a`` has.

    Raises:
        TypeError: a tensor's dtype is unknown to this torch build (names the file).
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
        tensors_a, tensors_b = _load(a.files[prefix_a]), _load(b.files[prefix_b])
        for name in names:
            left = tensors_a[head_a[name]["name"]]
            right = tensors_b[head_b[name]["name"]]
            count, biggest = compare_tensors(left, right)
            if count == 0 or biggest <= atol:
                same += 1
                continue
            changed.append(
                {
                    "name": name,
                    **_meta(head_a[name]),
                    "differing": count,
                    "elements": left.numel(),
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
