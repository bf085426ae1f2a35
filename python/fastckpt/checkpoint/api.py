"""Component checkpoints: ``save_checkpoint`` / ``load_checkpoint`` and root housekeeping.

A checkpoint index holds, for each component given as ``{name: (obj, spec)}``:

```
models/<name>.safetensors      weights (DDP unwrapped: no ``module.`` prefixes)
models/<name>.spec.json        the reconstruction spec
optimizers/<name>.safetensors  tensor state (exp_avg, step, ...)
optimizers/<name>.json         spec, parameter references, the JSON skeleton of state_dict()
schedulers/<name>.safetensors  tensor state, if any
schedulers/<name>.json         spec and the JSON skeleton of state_dict()
```

and the manifest entry records associations (optimizer -> model, scheduler -> optimizer),
counters, and every file with its size and crc32c. Loading verifies each file against the
manifest, rebuilds components through the trust policy (:mod:`fastckpt.checkpoint.specs`), and never
unpickles anything.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from fastckpt.checkpoint.components import (
    LOAD_INDEX,
    SAVE_INDEX,
    Components,
    Trusted,
    check_incremental,
    checked_model_names,
    create_snapshot,
    load_components,
    write_snapshot,
)
from fastckpt.checkpoint.trust import frozen_trusted
from fastckpt.container.commit import prune_indices
from fastckpt.container.listing import list_checkpoints
from fastckpt.container.promote import NearestCopy, nearest_intact, still_committed
from fastckpt.container.snapshot import read_consistently
from fastckpt.container.verify import checked_index
from fastckpt.errors import CheckpointFormatError, FastCkptError, IndexNotCommittedError
from fastckpt.format.records import MANIFEST, Manifest, refuse_other_kind
from fastckpt.storage.registry import (
    checked_paths,
    display_path,
    is_object_url,
    use_storage_options,
)
from fastckpt.training.strategy import TrainingStrategy, check_per_rank, refuse_a_replica_save

_LOG = logging.getLogger(__name__)

__all__ = [
    "list_checkpoints",
    "load_checkpoint",
    "prune",
    "save_checkpoint",
]


def save_checkpoint(
    root: str | os.PathLike[str],
    models: Components | Any = None,
    optimizers: Components | None = None,
    schedulers: Components | None = None,
    associations: Mapping[str, Any] | None = None,
    checkpoint_index: int | None = -1,
    strategy: Any = None,
    *,
    counters: Mapping[str, int] | None = None,
    incremental: bool = True,
    lock_timeout: float | None = None,
    storage_options: Mapping[str, Any] | None = None,
    per_rank: bool = False,
) -> int:
    """Save models, optimizers and schedulers (or a whole strategy) as one committed index.

    Under a process group of more than one rank, DDP replicas (a ``DistributedDataParallel``
    model over every rank, given as it is or in a strategy) are saved by rank 0 alone: call
    this on rank 0 only (``if torch.distributed.get_rank() == 0:``); another rank's call is
    refused, nothing written. Other models are saved on any rank (they may be the rank's own).

    Args:
        root: checkpoint root directory (created if needed).
        models: ``{name: (module, spec)}``; spec may be None to introspect the constructor or
            use the module's ``checkpoint_spec()``. DDP wrappers are unwrapped. A
            ``TrainingStrategy`` here is taken as ``strategy``.
        optimizers: ``{name: (optimizer, spec)}``; spec None records the optimizer class and
            its ``defaults``.
        schedulers: ``{name: (scheduler, spec)}``; spec None records the class and the
            constructor arguments found in its ``state_dict()``.
        associations: ``{"optimizers": {opt: model}, "schedulers": {sched: opt}}`` (or a flat
            ``{component: target}``); missing ones are inferred (optimizer -> the model owning
            its parameters, scheduler -> its optimizer).
        checkpoint_index: ``-1`` (or None) for the next index, or an explicit index, an
            ``int`` (replaced atomically if it exists).
        strategy: a ``TrainingStrategy`` to save whole (components, recipe, counters, RNG
            states, data position, hook states); the component arguments must then be empty.
        counters: optional integer counters recorded in the manifest (step, epoch, ...):
            ``str`` names to ``int`` values (anything else is a ``TypeError``).
        incremental: write only the tensors that changed since this process's last save
            into ``root``, recording the others as references to the bytes already there
            (see docs/incremental.md); False writes everything.
        lock_timeout: give up waiting for another process saving into or pruning ``root``
            after this many seconds (None: wait; who holds the lock is logged after a second).
        storage_options: object-store client options for an ``s3://`` root (endpoint_url,
            region, access_key_id, ... as for :func:`fastckpt.configure_storage`), over the
            AWS environment; they are registered for ``root``'s prefix (as
            ``configure_storage(root, storage_options)``) and stay in effect for it. A local
            ``root`` refuses them (``StorageOptionsError``).
        per_rank: this rank's models are its own, not replicas of rank 0's, saved into a
            root of its own: DDP-wrapped models too are saved on any rank of a process group.

    Returns:
        The committed index.

    Raises:
        TypeError / ValueError: bad components (a module or optimizer not in a
            ``{name: (component, spec)}`` mapping, none at all), or a ``checkpoint_index``
            that is not an ``int`` (a bool, float or string) or out of range (-1, or 0 to
            ``MAX_INDEX`` = 10**18 - 1) (nothing is written).
        KeyError: ``associations`` naming no saved optimizer or scheduler.
        OSError: writing failed (nothing is committed; earlier indices are untouched).
        TimeoutError: ``lock_timeout`` passed while another process held the root (the
            message names it: pid and host).
        TypeError: ``per_rank`` is not a bool.
        InvalidInputError: DDP replicas saved on a rank other than 0 of a process group of
            more than one rank without ``per_rank`` (a sharded strategy excepted: its save
            is :meth:`TrainingStrategy.save_checkpoint`'s).
    """
    index = checked_index(checkpoint_index, "checkpoint_index", SAVE_INDEX)
    check_per_rank(per_rank, "save_checkpoint")
    use_storage_options(root, storage_options, "save_checkpoint")
    if isinstance(models, TrainingStrategy):
        strategy, models = models, None
    if strategy is not None:
        if not isinstance(strategy, TrainingStrategy):
            raise TypeError(
                f"strategy must be a TrainingStrategy, got {type(strategy).__name__}; save "
                "models as models={'main': (model, None)}"
            )
        if models or optimizers or schedulers:
            raise TypeError("pass either a strategy or components, not both")
        snapshot = strategy.checkpoint_snapshot()
    else:
        snapshot = create_snapshot(models, optimizers, schedulers, associations, counters)
        if not any(snapshot.names.values()):
            # An empty index would become the latest: a resume would find no model, and
            # prune(keep_last=1) would keep it in place of the last real checkpoint.
            raise ValueError(
                f"save_checkpoint({display_path(root)!r}) was given no model, optimizer or "
                "scheduler: pass models={'main': (model, None)} (or a strategy)"
            )
    snapshot.incremental = check_incremental(incremental, "save_checkpoint")
    if strategy is None:
        given = [e[0] if isinstance(e, tuple) else e for e in (models or {}).values()]
        refuse_a_replica_save("save_checkpoint", per_rank, given)
    elif not strategy.sharded:
        refuse_a_replica_save("save_checkpoint", per_rank, strategy.models.values())
    return write_snapshot(root, snapshot, -1 if index is None else index, lock_timeout=lock_timeout)


def load_checkpoint(
    root: str | os.PathLike[str],
    checkpoint_index: int | None = -1,
    map_location: str | torch.device | None = None,
    model_names: Sequence[str] | None = None,
    *,
    validators: Any = None,
    hooks: Any = None,
    training_fn: Any = None,
    strategy: Any = None,
    trusted: Trusted = None,
    storage_options: Mapping[str, Any] | None = None,
    fallback_dirs: Sequence[str | os.PathLike[str]] | None = None,
) -> dict[str, Any]:
    """Load a committed checkpoint index, rebuilding models, optimizers and schedulers.

    Args:
        root: checkpoint root.
        checkpoint_index: ``-1`` (or None) for the latest committed index, or an explicit
            one, an ``int``.
        map_location: device for tensors; factories that accept ``device`` receive it.
        model_names: load only these models (and the optimizers/schedulers tied to them): a
            list of names such as ``["main"]``; a single string is refused (``TypeError``),
            not taken for one name per character.
        validators: callables ``validator(model)`` (or ``{model_name: [validators]}``) run
            after weights are loaded; a failure raises ``ValueError`` naming both.
        hooks: runtime hooks for a strategy checkpoint (checkpointable ones get their state).
        training_fn: the training function for a strategy checkpoint (wins over the recorded
            dotted path).
        strategy: accepted for compatibility; ignored.
        trusted: extra dotted paths / callables the trust policy admits for this load.
        storage_options: object-store client options for an ``s3://`` root (endpoint_url,
            region, access_key_id, ... as for :func:`fastckpt.configure_storage`), over the
            AWS environment; they are registered for ``root``'s prefix (as
            ``configure_storage(root, storage_options)``) and stay in effect for it. A local
            ``root`` refuses them (``StorageOptionsError``).
        fallback_dirs: other tiers holding copies of ``root``'s indices (durable roots it is
            promoted to, see docs/tiers.md): the newest index that verifies on any of them is
            loaded (``checkpoint_index``: that index), from ``root`` when it holds it intact;
            a tier that is gone or damaged is passed over. The result's ``"restored_from"``
            says which copy was used and what was skipped (logged as a warning when anything
            was).

    Every model is rebuilt from its spec and holds exactly the saved tensors: the dtype each
    parameter and buffer was saved in (a model converted after construction with
    ``.to(torch.bfloat16)`` loads in bfloat16, mixed dtypes stay mixed) and its bits;
    optimizers are rebuilt over those parameters, their state tensors in their saved dtypes.

    Returns:
        ``{"checkpoint_index", "manifest", "strategy", "source": {"format", "path"},
        "models": {name: {"model", "spec", "optimizers": {name: {"optimizer", "spec"}},
        "schedulers": {name: {"scheduler", "spec"}}, "metadata": {"associations"}}}}``.
        ``strategy`` is the restored ``TrainingStrategy`` for a strategy checkpoint loaded
        whole, or None (component-only checkpoint, a ``model_names`` subset, or a training
        function that must be supplied / is not trusted).

    Raises:
        TypeError: ``checkpoint_index`` is not an ``int`` or None (a bool, float or string),
            or ``model_names`` is a string or holds a non-string.
        FileNotFoundError: no checkpoint, or a file the manifest lists is missing.
        KeyError: unknown index or model names (lists the available ones).
        CheckpointFormatError / ChecksumMismatchError: damaged or tampered files.
        UntrustedTargetError: a spec names code outside the trust policy.
    """
    del strategy  # accepted for signature compatibility: the checkpoint says what it holds
    index = checked_index(checkpoint_index, "checkpoint_index", LOAD_INDEX)
    checkpoint_index = -1 if index is None else index
    model_names = checked_model_names(model_names)
    use_storage_options(root, storage_options, "load_checkpoint")
    fallback_dirs = checked_paths(fallback_dirs, "fallback_dirs", "load_checkpoint")
    trusted = frozen_trusted(trusted)
    named = [root, *(fallback_dirs or ())]  # the roots a rebuilt CheckpointHook may save to

    def read(where: str | os.PathLike[str], number: int) -> dict[str, Any]:
        def attempt() -> dict[str, Any]:
            result = load_components(
                where,
                number,
                map_location,
                model_names,
                validators=validators,
                trusted=trusted,
            )
            reader = result.pop("reader")
            if "strategy.json" in reader.files and model_names is None:
                result["strategy"] = _restore_strategy(
                    result["models"], reader, hooks, training_fn, trusted, map_location, named
                )
            return result

        # A save replacing the index, or a prune, while this reads: read again (bounded).
        return read_consistently(Path(where) / MANIFEST, attempt, lock_root=Path(where))

    if not fallback_dirs:
        return read(root, checkpoint_index)
    for tries_left in reversed(range(_CHOOSE_ATTEMPTS)):
        copy = choose_copy(root, fallback_dirs, checkpoint_index)
        try:
            loaded = read(copy.root, copy.index)
        except IndexNotCommittedError:
            # The newest copy chosen, then pruned by a live writer before it was read: the
            # caller asked for the newest, so choose again (bounded). Before, a bare KeyError
            # named an index the caller never asked for.
            if checkpoint_index != -1 or not tries_left or still_committed(copy.root, copy.index):
                raise
            continue
        loaded["restored_from"] = {
            "path": display_path(copy.root),
            "index": copy.index,
            "skipped": copy.skipped,
        }
        return loaded
    raise AssertionError("unreachable")  # pragma: no cover


#: How many times a load with ``fallback_dirs`` of the newest copy chooses again when a live
#: writer pruned the chosen index before it was read.
_CHOOSE_ATTEMPTS = 5


def choose_copy(
    root: str | os.PathLike[str],
    fallback_dirs: Sequence[str | os.PathLike[str]],
    checkpoint_index: int | None = -1,
) -> NearestCopy:
    """The copy a load with ``fallback_dirs`` restores (see :func:`load_checkpoint`); logged,
    as a warning when a newer or faster copy was passed over. ``checkpoint_index``: ``-1``
    or None for the newest intact index, else that ``int`` index (``TypeError`` otherwise)."""
    index = checked_index(checkpoint_index, "checkpoint_index", LOAD_INDEX)
    copy = nearest_intact([root, *fallback_dirs], None if index in (None, -1) else index)
    (_LOG.warning if copy.skipped else _LOG.info)("%s", copy.describe())
    return copy


def _restore_strategy(
    models: dict[str, Any],
    reader: Any,
    hooks: Any,
    training_fn: Any,
    trusted: Trusted,
    map_location: str | torch.device | None,
    named: Sequence[str | os.PathLike[str]],
) -> Any:
    """``TrainingStrategy.from_loaded``, with the malformed-field errors of a hostile
    ``strategy.json`` / ``hooks.json`` (whose checksums were re-sealed) as typed errors
    naming the files."""
    where = f"{reader.directory}/strategy.json (or hooks.json)"
    try:
        return TrainingStrategy.from_loaded(
            models,
            reader,
            hooks=hooks,
            training_fn=training_fn,
            trusted=trusted,
            map_location=map_location,
            require_training_fn=False,
            named_roots=named,
        )
    except CheckpointFormatError as err:
        if "strategy.json" in str(err) or "hooks.json" in str(err):
            raise
        raise CheckpointFormatError(f"{where}: {err}") from err
    except FastCkptError:
        raise
    except (AttributeError, KeyError, TypeError, ValueError, IndexError) as err:
        raise CheckpointFormatError(
            f"{where}: a field has the wrong type or value ({type(err).__name__}: {err}); the "
            "checkpoint was edited or is damaged"
        ) from err


# --------------------------------------------------------------------------- housekeeping


def prune(
    root: str | os.PathLike[str],
    keep_last: int,
    *,
    lock_timeout: float | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> list[int]:
    """Delete all but the newest ``keep_last`` indices (never the latest).

    The manifest is committed first, so a crash mid-prune leaves only unreferenced
    directories, never a manifest naming a deleted index. A prune waits for another
    process's save or prune of the root: after a second it logs who that is (pid, host);
    ``lock_timeout`` (seconds) gives up with a ``TimeoutError`` naming it.

    Args:
        root: checkpoint root.
        keep_last: how many of the newest indices to keep.
        lock_timeout: see above.
        storage_options: object-store client options for an ``s3://`` root (endpoint_url,
            region, access_key_id, ... as for :func:`fastckpt.configure_storage`), over the
            AWS environment; they are registered for ``root``'s prefix (as
            ``configure_storage(root, storage_options)``) and stay in effect for it. A local
            ``root`` refuses them (``StorageOptionsError``).

    Returns:
        The deleted indices.

    Raises:
        FileNotFoundError: ``root`` is not a directory (a local root), or holds no root but
            another kind of checkpoint, or CheckpointManager checkpoints (the message says
            how to prune those).
        TypeError / ValueError: ``keep_last`` is not an int >= 1.
    """
    use_storage_options(root, storage_options, "prune")
    if not is_object_url(root) and not Path(root).is_dir():
        # (the root's lock file would be named instead)
        raise FileNotFoundError(
            errno.ENOENT, f"{root}: no checkpoint root here, nothing to prune", os.fspath(root)
        )
    if Manifest.load(root).latest is None:
        refuse_other_kind(root, "prune")  # a folder of manager checkpoints: not pruned here
    return prune_indices(Path(root), keep_last, lock_timeout=lock_timeout)
