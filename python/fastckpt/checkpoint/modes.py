"""Training modes (``module.training``) of a model's submodules, recorded at a save and given
back to a rebuilt model.

A model rebuilt from its recipe has every module in training mode, as constructors leave
them, while the saved run may have put some in evaluation mode after construction (a frozen
BatchNorm backbone in fine-tuning, a Dropout switched off, the whole model): the resumed run
would then update those statistics and drop those activations, and differ from the
uninterrupted one without a word. The manifest entry records, per model, the modules whose
mode differs from their parent's (the root's from training mode), by canonical name
(:data:`fastckpt.checkpoint.components.MODES_FIELD`): ``{"": false}`` for ``model.eval()``,
``{"backbone.1": false}`` for one frozen layer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from fastckpt.checkpoint.build import canonical_name
from fastckpt.errors import CheckpointFormatError

__all__ = ["apply_modes", "recorded_modes"]


def _modules_with_parents(
    model: torch.nn.Module,
) -> list[tuple[str, torch.nn.Module, torch.nn.Module | None]]:
    """``(canonical name, module, parent)`` of every module of ``model`` (the root's parent
    None), parents before children."""
    found: list[tuple[str, torch.nn.Module, torch.nn.Module | None]] = [("", model, None)]
    at = 0
    while at < len(found):
        name, module, _ = found[at]
        at += 1
        for child_name, child in module.named_children():
            full = f"{name}.{child_name}" if name else child_name
            found.append((full, child, module))
    return [(canonical_name(name), module, parent) for name, module, parent in found]


def recorded_modes(model: torch.nn.Module) -> dict[str, bool]:
    """``{canonical name: training}`` of the modules of ``model`` whose training mode differs
    from their parent's (the root's: from ``True``); empty for a model all in training mode."""
    modes: dict[str, bool] = {}
    for name, module, parent in _modules_with_parents(model):
        inherited = True if parent is None else parent.training
        if module.training != inherited and name not in modes:
            modes[name] = module.training
    return modes


def apply_modes(model: torch.nn.Module, modes: Any, where: str) -> None:
    """Give the modules of ``model`` the training modes a record of :func:`recorded_modes`
    describes (None: every module in training mode, as rebuilt): each module takes its
    recorded mode, or its parent's.

    Raises:
        CheckpointFormatError: ``modes`` is not ``{name: bool}`` naming modules of ``model``
            (``where`` names the record).
    """
    if modes is None:
        return
    if not isinstance(modes, Mapping) or not all(type(v) is bool for v in modes.values()):
        raise CheckpointFormatError(f"{where}: must be an object of module name -> true/false")
    listed = _modules_with_parents(model)
    unknown = sorted(set(modes) - {name for name, _, _ in listed})
    if unknown:
        raise CheckpointFormatError(
            f"{where}: names modules {unknown[:5]}, which the model does not have"
        )
    for name, module, parent in listed:
        inherited = True if parent is None else parent.training
        module.training = modes.get(name, inherited)
