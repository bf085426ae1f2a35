"""The hooks a strategy checkpoint records, and rebuilding them at resume.

A strategy checkpoint lists every hook of the run, in order, in ``hooks.json`` under
``configs``: ``{"class": dotted path, "config": {...}}`` for fastckpt's own hooks
(:class:`~fastckpt.training.hooks.CheckpointHook`, :class:`~fastckpt.training.hooks.EMAHook`, which
say how they
were configured with ``hook_config()``), ``"config": null`` for any other hook (a function, a
class of yours). ``TrainingStrategy.load_checkpoint`` without ``hooks=`` rebuilds the
recorded fastckpt hooks from their configuration (their state, such as EMA weights, is then
restored as usual) and warns about each recorded hook it cannot rebuild, so that a resumed run
keeps checkpointing; ``hooks=`` replaces them all. Only the classes listed here are ever built
from a checkpoint: nothing is imported by the name a checkpoint gives.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import fastckpt.checkpoint.trust as trust
from fastckpt.errors import CheckpointFormatError
from fastckpt.training.hooks.checkpoint import CheckpointHook
from fastckpt.training.hooks.ema import EMAHook

__all__ = ["CONFIGS_FIELD", "REBUILDABLE", "parse_hook_configs", "rebuild_hooks", "record_hooks"]

#: The ``hooks.json`` field listing the run's hooks.
CONFIGS_FIELD = "configs"

#: dotted path -> the hook classes fastckpt rebuilds from their recorded configuration.
REBUILDABLE: dict[str, type] = {
    trust.dotted_path(CheckpointHook): CheckpointHook,
    trust.dotted_path(EMAHook): EMAHook,
}


def _name(hook: Any) -> str:
    """A hook's dotted path (a function's own, else its class's), for records and messages."""
    for candidate in (hook, type(hook)):
        try:
            return trust.dotted_path(candidate)
        except TypeError:
            continue
    return repr(hook)


def record_hooks(hooks: Sequence[Any]) -> list[dict[str, Any]]:
    """The ``configs`` entries for the run's ``hooks`` (JSON values only)."""
    records = []
    for hook in hooks:
        name = _name(hook)
        rebuildable = REBUILDABLE.get(name) is type(hook)
        config = hook.hook_config() if rebuildable else None
        records.append({"class": name, "config": config})
    return records


def parse_hook_configs(document: Any, where: str) -> list[dict[str, Any]]:
    """The checked ``configs`` of a ``hooks.json`` document (empty when absent: a checkpoint
    of an earlier version).

    Raises:
        CheckpointFormatError: the field is malformed (names ``where`` and the entry).
    """
    records = document.get(CONFIGS_FIELD, [])
    if not isinstance(records, list):
        raise CheckpointFormatError(f"{where}: field '{CONFIGS_FIELD}' must be a list")
    for i, record in enumerate(records):
        if (
            not isinstance(record, dict)
            or not isinstance(record.get("class"), str)
            or not (record.get("config") is None or isinstance(record.get("config"), dict))
        ):
            raise CheckpointFormatError(
                f"{where}: field '{CONFIGS_FIELD}[{i}]' must be an object with 'class' (a "
                "string) and 'config' (an object or null)"
            )
    return records


def rebuild_hooks(records: Sequence[dict[str, Any]], where: str) -> list[Any]:
    """The recorded fastckpt hooks, built from their configuration; a warning names each
    recorded hook that cannot be rebuilt (pass ``hooks=`` to keep it).

    Raises:
        CheckpointFormatError: a recorded configuration the hook's constructor refuses.
    """
    hooks = []
    for i, record in enumerate(records):
        cls = REBUILDABLE.get(record["class"])
        if cls is None or record["config"] is None:
            warnings.warn(
                f"{where}: the run had hook {record['class']}, which fastckpt cannot rebuild "
                "from a checkpoint; the resumed run goes without it: pass hooks=[...] to "
                "load_checkpoint to keep it (hooks= also replaces the rebuilt ones)",
                stacklevel=4,
            )
            continue
        try:
            hooks.append(cls(**record["config"]))
        except (TypeError, ValueError) as err:
            raise CheckpointFormatError(
                f"{where}: field '{CONFIGS_FIELD}[{i}].config': {record['class']} refused it "
                f"({type(err).__name__}: {err}); pass hooks=[...] to load_checkpoint instead"
            ) from err
    return hooks
