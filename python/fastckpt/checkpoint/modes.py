"""Training modes (``module.training``) of a model's submodules, recorded at a save and given
back to a rebuilt model.

A model rebuilt from its recipe has every module in training mode, as constructors leave
them, while the saved run may have put some in evaluation mode after construction (a frozen
BatchNorm backbone in fine-tuning, a Dropout switched off, the whole model): the resumed run
would then update those statistics and drop those activations, and differ from the
uninterrupted one without a word. The manifest entry records, per model, the modules whose
mode differs from their parent's (the root's from training mode), by canonical name
(:data:`fastckpt.checkpoint.components.MODES_FIELD`): ``{"": false}`` for ``model.eval()``,
``{"backbone.1": false}`` for one frozen layer. A wrapped module (activation checkpointing)
and its wrapper share a canonical name: the wrapped one, which computes, is recorded.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch

from fastckpt.checkpoint.build import canonical_name
from fastckpt.errors import CheckpointFormatError

__all__ = ["apply_modes", "recorded_modes"]


def _canonical_modes(model: torch.nn.Module) -> dict[str, bool]:
    """``{canonical name: training}`` of every module, parents before children; a wrapped
    module's mode replaces its wrapper's (it comes after it)."""
    return {
        canonical_name(name): module.training
        for name, module in model.named_modules(remove_duplicate=False)
    }


def _parent(name: str) -> str:
    return name.rpartition(".")[0]


def recorded_modes(model: torch.nn.Module) -> dict[str, bool]:
    """``{canonical name: training}`` of the modules of ``model`` whose training mode differs
    from their parent's (the root's: from ``True``); empty for a model all in training mode."""
    if all(module.training for module in model.modules()):
        return {}  # the common case, without naming every module
    modes = _canonical_modes(model)
    return {
        name: training
        for name, training in modes.items()
        if training != (True if name == "" else modes.get(_parent(name), True))
    }


def apply_modes(model: torch.nn.Module, modes: Any, where: str) -> None:
    """Give the modules of ``model`` the training modes a record of :func:`recorded_modes`
    describes (None: every module in training mode, as rebuilt): each module takes its
    recorded mode, or its parent's. A recorded name the rebuilt model lacks (a module the
    saved run added after construction, which its recipe does not build) is skipped with a
    warning.

    Raises:
        CheckpointFormatError: ``modes`` is not ``{name: bool}`` (``where`` names the record).
    """
    if modes is None:
        return
    if not isinstance(modes, Mapping) or not all(type(v) is bool for v in modes.values()):
        raise CheckpointFormatError(f"{where}: must be an object of module name -> true/false")
    applied: dict[str, bool] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        canonical = canonical_name(name)
        inherited = True if canonical == "" else applied.get(_parent(canonical), True)
        module.training = modes.get(canonical, inherited)
        applied[canonical] = module.training
    missing = sorted(set(modes) - set(applied))
    if missing:
        warnings.warn(
            f"{where}: records the training mode of modules {missing[:5]}, which the rebuilt "
            "model does not have (added after construction: its recipe does not build "
            "them); their modes are not applied",
            stacklevel=3,
        )
