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

import os
import warnings
from collections.abc import Sequence
from typing import Any

import fastckpt.checkpoint.trust as trust
from fastckpt._moved_paths import current_path
from fastckpt.errors import CheckpointFormatError
from fastckpt.storage.registry import absolute, display_path, is_object_url
from fastckpt.training.hooks.checkpoint import CheckpointHook
from fastckpt.training.hooks.ema import EMAHook

__all__ = [
    "CONFIGS_FIELD",
    "REBUILDABLE",
    "RECORDED_KEYS",
    "parse_hook_configs",
    "rebuild_hooks",
    "record_hooks",
]

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


def parse_hook_configs(document: Any, where: str) -> list[dict[str, Any]] | None:
    """The checked ``configs`` of a ``hooks.json`` document (None when absent: a checkpoint
    of an earlier version, which did not record its hooks).

    Raises:
        CheckpointFormatError: the field is malformed (names ``where`` and the entry).
    """
    if CONFIGS_FIELD not in document:
        return None
    records = document[CONFIGS_FIELD]
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


#: The configuration keys each rebuildable hook's ``hook_config()`` records (earlier versions
#: recorded fewer): a record with any other key is refused, so that a checkpoint cannot hand
#: a rebuilt hook an option its run never recorded (``overwrite=True``, callbacks...).
RECORDED_KEYS: dict[type, frozenset[str]] = {
    CheckpointHook: frozenset(
        {
            "checkpoint_dir",
            "step_interval",
            "epoch_interval",
            "async_save",
            "rank_zero_only",
            "keep_last",
            "wait_timeout_secs",
            "save_last",
            "incremental",
            "lock_timeout",
            "durable_dir",
            "promote_every",
            "durable_keep_last",
            "strict_promotion",
            "detached_promotion",
            "strict_saves",
        }
    ),
    EMAHook: frozenset({"model_key", "decay", "update_every"}),
}


def rebuild_hooks(
    records: Sequence[dict[str, Any]] | None,
    where: str,
    named: Sequence[str | os.PathLike[str]] = (),
) -> list[Any]:
    """The recorded fastckpt hooks, built from their configuration; a warning names each
    recorded hook that cannot be rebuilt (pass ``hooks=`` to keep it). ``records`` None (a
    checkpoint of an earlier version, which did not record its hooks): none, with a warning
    saying so (before, a resumed run of such a checkpoint went on without its CheckpointHook
    and saved nothing more, without a word).

    The run's one :class:`CheckpointHook` saves where the caller says, not where the
    checkpoint says (see :func:`_placed`): ``named`` are the roots the caller passed
    (``root``, then ``fallback_dirs``). A run with several keeps those whose recorded roots
    the caller named; each other one is left out with a warning (a recorded path must not
    decide by itself where the resumed run saves and prunes: an edited ``hooks.json`` could
    add a hook whose retention deletes another run's checkpoints).

    Raises:
        CheckpointFormatError: a recorded configuration the hook's constructor refuses, or
            with a key its ``hook_config()`` never records.
    """
    if records is None:
        warnings.warn(
            f"{where}: this checkpoint was written by an earlier fastckpt version, which did "
            "not record the run's hooks: none are rebuilt, so a run that had a CheckpointHook "
            "saves no more checkpoints; pass hooks=[fastckpt.CheckpointHook(...)] to "
            "TrainingStrategy.load_checkpoint to keep checkpointing",
            stacklevel=4,
        )
        return []
    savers = [r for r in records if REBUILDABLE.get(current_path(r["class"])) is CheckpointHook]
    if len(savers) > 1 and named:
        unnamed = [r for r in savers if not any(_records_root(r, n) for n in named)]
        if len(unnamed) == len(savers):
            # None names the caller's root (a moved run, another working directory): the
            # one recorded under the root's name saves there (else the first), as a run's
            # one hook would; the others are left out.
            unnamed.remove(_likeliest_saver(savers, named[0]))
        for record in unnamed:
            config = record.get("config") or {}
            warnings.warn(
                f"{where}: the run had a CheckpointHook saving to "
                f"{config.get('checkpoint_dir')!r}, a root you did not name; the resumed run "
                "goes without it (pass hooks=[...] to load_checkpoint to keep it)",
                stacklevel=4,
            )
        records = [r for r in records if not any(r is u for u in unnamed)]
        savers = [r for r in savers if not any(r is u for u in unnamed)]
    hooks = []
    for i, record in enumerate(records):
        cls = REBUILDABLE.get(current_path(record["class"]))
        if cls is None or record["config"] is None:
            warnings.warn(
                f"{where}: the run had hook {record['class']}, which fastckpt cannot rebuild "
                "from a checkpoint; the resumed run goes without it: pass hooks=[...] to "
                "load_checkpoint to keep it (hooks= also replaces the rebuilt ones)",
                stacklevel=4,
            )
            continue
        field = f"{CONFIGS_FIELD}[{i}].config"
        unknown = sorted(set(record["config"]) - RECORDED_KEYS[cls])
        if unknown:
            raise CheckpointFormatError(
                f"{where}: field '{field}' has {', '.join(map(repr, unknown))}, which "
                f"{record['class']} never records; pass hooks=[...] to load_checkpoint instead"
            )
        config = dict(record["config"])
        try:
            if cls is CheckpointHook and len(savers) == 1 and named:
                config = _placed(config, named, f"{where}: field '{field}'")
            hooks.append(cls(**config))
        except (TypeError, ValueError) as err:
            raise CheckpointFormatError(
                f"{where}: field '{CONFIGS_FIELD}[{i}].config': {record['class']} refused it "
                f"({type(err).__name__}: {err}); pass hooks=[...] to load_checkpoint instead"
            ) from err
    return hooks


def _likeliest_saver(savers: Sequence[dict[str, Any]], root: str | os.PathLike[str]) -> Any:
    """The CheckpointHook record whose recorded ``checkpoint_dir`` has ``root``'s last name
    (``ckpt/steps`` for ``/elsewhere/ckpt/steps``), else the first."""
    name = os.path.basename(os.path.normpath(os.fspath(root)))
    for record in savers:
        recorded = (record.get("config") or {}).get("checkpoint_dir")
        if isinstance(recorded, str) and os.path.basename(os.path.normpath(recorded)) == name:
            return record
    return savers[0]


def _same_root(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> bool:
    """Whether two roots are one (object-store URLs as written, local paths resolved)."""
    if is_object_url(a) or is_object_url(b):
        return display_path(a).rstrip("/") == display_path(b).rstrip("/")
    try:
        return os.path.realpath(a) == os.path.realpath(b)
    except (OSError, ValueError):  # an edited path (a NUL byte): not the caller's
        return False


def _records_root(record: dict[str, Any], root: str | os.PathLike[str]) -> bool:
    """Whether a CheckpointHook record names ``root`` as one of its tiers."""
    config = record.get("config") or {}
    tiers = [config.get("checkpoint_dir"), config.get("durable_dir")]
    return any(isinstance(tier, str) and _same_root(tier, root) for tier in tiers)


def _placed(
    config: dict[str, Any], named: Sequence[str | os.PathLike[str]], where: str
) -> dict[str, Any]:
    """The run's one :class:`CheckpointHook` record, placed where the caller's arguments say:
    the paths a checkpoint records must not decide, by themselves, where the resumed run
    saves and prunes. ``named[0]`` is the root the caller passed, ``named[1:]`` its
    ``fallback_dirs``.

    * The hook saves into the caller's root, whatever path was recorded (a relative one
      from another working directory, a moved or copied run); a warning says when they
      differ. Unless the caller's root is the recorded ``durable_dir`` (a run resumed from
      its durable tier, the fast one lost): the recorded ``checkpoint_dir`` is then kept.
    * A recorded ``durable_dir`` the caller did not name gives way to the caller's one
      fallback dir (a warning says so); without one, it is kept.
    * Without ``fallback_dirs``, a caller's root that is the recorded ``durable_dir`` by
      name only (two relative records read from another working directory, or two absolute
      ones of a moved or copied run: more of its trailing path names match the recorded
      durable tier than the fast one) is taken as the durable tier, and the fast tier is
      placed where it lay beside it in the record (``fast`` next to ``durable`` stays next
      to it), each with a warning. Before, such a run saved its fast-tier checkpoints into
      its durable root and promoted them to a new folder. A relative record beside an
      absolute one says nothing of where the two lie relative to each other: the caller's
      root stays the fast tier, as before.

    A recorded root that is kept is checked by the hook before its first step, as any
    hook's: a root further along than the run stops it with :class:`MixedRunError`.
    """
    fast, durable = config.get("checkpoint_dir"), config.get("durable_dir")
    if not isinstance(fast, str) or not isinstance(durable, str | None):
        return config  # malformed: the hook's constructor refuses it
    root, fallbacks = named[0], list(named[1:])
    if durable is not None and _same_root(durable, root):
        return config
    if (
        durable is not None
        and not fallbacks  # the caller named the durable tier: its root is the fast one
        and os.path.isabs(fast) == os.path.isabs(durable)  # one layout, both moved alike
        and not _same_root(fast, root)
        and _shared_tail(durable, root) > _shared_tail(fast, root)
    ):
        beside = _beside(fast, durable, root)
        _moved(where, "durable_dir", durable, root)
        config["durable_dir"] = display_path(root)
        if not _same_root(fast, beside):
            _moved(where, "checkpoint_dir", fast, beside)
            config["checkpoint_dir"] = display_path(beside)
        return config
    if not _same_root(fast, root):
        _moved(where, "checkpoint_dir", fast, root)
        config["checkpoint_dir"] = display_path(root)
    if durable is not None and len(fallbacks) == 1 and not _same_root(durable, fallbacks[0]):
        _moved(where, "durable_dir", durable, fallbacks[0])
        config["durable_dir"] = display_path(fallbacks[0])
    return config


def _parts(path: str | os.PathLike[str]) -> tuple[str, ...]:
    """A local path's names, normalized as text (an object URL: none)."""
    if is_object_url(path):
        return ()
    return tuple(part for part in os.path.normpath(os.fspath(path)).split(os.sep) if part)


def _shared_tail(recorded: str, root: str | os.PathLike[str]) -> int:
    """How many trailing names a recorded local path shares with the caller's root
    (``durable`` and ``/new/place/durable``: 1; ``run/durable`` and ``/x/run/durable``: 2)."""
    a, b = _parts(recorded), _parts(absolute(root))
    count = 0
    while count < min(len(a), len(b)) and a[-1 - count] == b[-1 - count]:
        count += 1
    return count


def _beside(fast: str, durable: str, root: str | os.PathLike[str]) -> str:
    """Where the fast tier lies for a durable tier found at ``root``: as it lay beside the
    recorded durable tier (both local), else the recorded fast tier itself."""
    if is_object_url(fast) or is_object_url(durable) or is_object_url(root):
        return fast
    # Two relative records were relative to one directory, as are two absolute ones.
    step = os.path.relpath(fast, os.path.dirname(os.path.normpath(durable)) or os.curdir)
    return os.path.normpath(os.path.join(os.path.dirname(absolute(root)), step))


def _moved(where: str, argument: str, recorded: str, now: str | os.PathLike[str]) -> None:
    warnings.warn(
        f"{where}: the run's {argument} was {recorded!r}; the resumed run uses "
        f"{display_path(now)!r}, which you passed (pass hooks=[...] to load_checkpoint to "
        "choose)",
        stacklevel=6,
    )
