"""Whether a loaded tensor is bit for bit what was saved (the "verified"/"bitwise" columns).

``torch.equal`` compares values: it passes ``-0.0`` loaded where ``0.0`` was saved and fails a
NaN read back exactly. The harness compares bytes instead, with
:func:`fastckpt.container.diff.compare_tensors` (what ``fastckpt diff`` reports).
"""

from __future__ import annotations

import torch

from fastckpt.container.diff import compare_tensors

__all__ = ["same_bits"]


def same_bits(loaded: torch.Tensor, saved: torch.Tensor) -> bool:
    """Whether two tensors have the same dtype, shape and bytes (element by element, so a
    non-contiguous tensor compares by its values' order, as it would be saved).

    Pass a DTensor's ``to_local()``: its local shard is what a rank saved and loads.
    """
    if loaded.dtype != saved.dtype or loaded.shape != saved.shape:
        return False
    if loaded.device != saved.device:
        loaded = loaded.to(saved.device)
    differing, _ = compare_tensors(loaded, saved)
    return differing == 0
