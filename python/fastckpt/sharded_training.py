"""FSDP2-sharded models in :class:`~fastckpt.TrainingStrategy` checkpoints.

A strategy whose models are sharded with ``torch.distributed.fsdp.fully_shard`` keeps its
model and optimizer state in a sharded (DCP) checkpoint, ``ROOT/sharded/<index>``, that every
rank writes its own shards to through :mod:`fastckpt.dcp` (optimizer state keyed by parameter
name, as ``get_state_dict`` gives it, so it reshards onto any world size). The index itself
(``ROOT/<index>``, committed by rank 0 after the sharded part) holds what exists once: the
recipe with each model's spec, counters, RNG states, scheduler and hook states, and the path
of its sharded part.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from fastckpt import specs
from fastckpt.store import records

__all__ = [
    "SHARDED_DIR",
    "async_save_sharded",
    "check_not_fsdp1",
    "check_recordable",
    "is_sharded_model",
    "load_sharded",
    "remove_sharded",
    "save_sharded",
    "sharded_path",
    "unsharded_spec",
]

#: The subdirectory of a strategy root holding the sharded part of each index.
SHARDED_DIR = records.SHARDED_DIR


def is_sharded_model(model: torch.nn.Module) -> bool:
    """Whether ``model`` is FSDP2-sharded (``fully_shard`` applied to it)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch built without distributed
        return False
    return isinstance(model, FSDPModule)


def check_not_fsdp1(name: str, model: torch.nn.Module) -> None:
    """Refuse FSDP1 (``FullyShardedDataParallel``) with the fix.

    Raises:
        ValueError: ``model`` is wrapped in ``FullyShardedDataParallel``.
    """
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - torch built without distributed
        return
    if isinstance(model, FullyShardedDataParallel):
        raise ValueError(
            f"model {name!r} is wrapped in FullyShardedDataParallel (FSDP1), which "
            "TrainingStrategy does not checkpoint: shard it with "
            "torch.distributed.fsdp.fully_shard (FSDP2) instead; FSDP2 models are checkpointed "
            "sharded and resume on any number of ranks (load_checkpoint(..., parallelize=fn))"
        )


def sharded_path(root: str | Path, index: int) -> Path:
    """Where index ``index`` of ``root`` keeps its sharded part."""
    return Path(root) / SHARDED_DIR / str(index)


@contextlib.contextmanager
def _original_classes(model: torch.nn.Module) -> Iterator[None]:
    """Give every FSDP2 module its class from before ``fully_shard`` while the block runs
    (``fully_shard`` swaps in a generated subclass, which is not importable)."""
    from torch.distributed.fsdp import FSDPModule

    swapped: list[tuple[torch.nn.Module, type]] = []
    try:
        for module in model.modules():
            cls = type(module)
            if isinstance(module, FSDPModule):
                original = next(base for base in cls.__bases__ if not issubclass(base, FSDPModule))
                module.__class__ = original  # type: ignore[assignment]
                swapped.append((module, cls))
        yield
    finally:
        for module, cls in swapped:
            module.__class__ = cls


def unsharded_spec(model: torch.nn.Module) -> specs.BaseSpec:
    """The spec that rebuilds ``model`` unsharded (an attached spec wins, as always)."""
    with _original_classes(model):
        return specs.model_spec(model)


def check_recordable(name: str, model: torch.nn.Module) -> None:
    """:func:`fastckpt.specs.check_recordable` for an FSDP2 model (its unsharded recipe; the
    parameters' global shapes)."""
    with _original_classes(model):
        specs.check_recordable(model, name)


def _state(
    models: Mapping[str, torch.nn.Module], optimizers: Mapping[str, torch.optim.Optimizer]
) -> dict[str, Any]:
    """``{"models": {name: sharded state}, "optimizers": {name: state by parameter name}}``."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    state: dict[str, Any] = {"models": {}, "optimizers": {}}
    for name, model in models.items():
        optimizer = optimizers.get(name)
        if optimizer is None:
            state["models"][name] = get_model_state_dict(model)
        else:
            state["models"][name], state["optimizers"][name] = get_state_dict(model, optimizer)
    return {section: value for section, value in state.items() if value}


def save_sharded(
    root: str | Path,
    index: int,
    models: Mapping[str, torch.nn.Module],
    optimizers: Mapping[str, torch.optim.Optimizer],
) -> Path:
    """Write the models' and optimizers' shards as ``ROOT/sharded/<index>``; collective (every
    rank calls it with its own shards). Returns the directory."""
    from fastckpt.dcp.state import save_state

    path = sharded_path(root, index)
    save_state(path, _state(models, optimizers))
    return path


def async_save_sharded(
    root: str | Path,
    index: int,
    models: Mapping[str, torch.nn.Module],
    optimizers: Mapping[str, torch.optim.Optimizer],
    *,
    writer: Any,
    process_group: Any = None,
) -> Any:
    """:func:`save_sharded` in the background: returns once every rank's shards are staged
    into ``writer``'s (a :class:`fastckpt.dcp.Writer`, reused) buffers, with the future of
    the upload and commit."""
    from fastckpt.dcp.state import async_save_state

    path = sharded_path(root, index)
    return async_save_state(
        path, _state(models, optimizers), writer=writer, process_group=process_group
    )


def load_sharded(
    path: Path,
    models: Mapping[str, torch.nn.Module],
    optimizers: Mapping[str, torch.optim.Optimizer],
) -> None:
    """Load a sharded part into live (sharded or plain) models and optimizers, resharding as
    their placements say; collective. Every tensor must be in the checkpoint (strict)."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    from fastckpt.dcp.state import load_state

    templates = _state(models, optimizers)
    loaded = load_state(path, templates, strict=True)
    for name, model in models.items():
        optimizer = optimizers.get(name)
        if optimizer is None:
            set_model_state_dict(model, loaded["models"][name])
        else:
            set_state_dict(
                model,
                optimizer,
                model_state_dict=loaded["models"][name],
                optim_state_dict=loaded["optimizers"][name],
            )


def remove_sharded(root: str | Path, indices: list[int]) -> None:
    """Delete the sharded parts of pruned indices."""
    for index in indices:
        shutil.rmtree(sharded_path(root, index), ignore_errors=True)
