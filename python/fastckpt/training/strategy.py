"""``TrainingStrategy``: a training loop whose whole state checkpoints and resumes exactly.

The strategy owns models, optimizers, schedulers, the training function, hooks and five
counters. A strategy checkpoint (``save_checkpoint``) holds the components (as in
:mod:`fastckpt.checkpoint.api`), a JSON recipe to rebuild them, the counters, the RNG states
(python, numpy, torch CPU and CUDA) and the position inside the current epoch (with the
training loader's settings it counts batches of), plus the state of every
:class:`~fastckpt.training.hooks.CheckpointableHook`. Resuming replays the epoch's data order
from the RNG state saved at the epoch start and skips the batches already consumed, so a
resumed run matches an uninterrupted one bit for bit (CPU, deterministic ops, a ``DataLoader``
with ``num_workers=0``).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import inspect
import logging
import os
import random
import sys
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset

import fastckpt.checkpoint.build as build
import fastckpt.checkpoint.components as codec
import fastckpt.checkpoint.specs as specs
import fastckpt.checkpoint.trust as trust
import fastckpt.training.sharded as sharded_training
from fastckpt._moved_paths import current_path
from fastckpt.checkpoint.fill import loads_as_given
from fastckpt.container.commit import shown_names
from fastckpt.container.promote import NearestCopy, nearest_intact, still_committed
from fastckpt.container.refs import REFS_FILE, root_key
from fastckpt.container.sharded.nodes import node_holdings
from fastckpt.container.snapshot import read_consistently
from fastckpt.container.verify import checked_index
from fastckpt.errors import (
    CheckpointFormatError,
    CheckpointMismatchError,
    ConcurrentSaveError,
    FastCkptError,
    IndexNotCommittedError,
    InterruptedStepError,
    InvalidInputError,
    NotCommittedError,
    UnsupportedValueError,
    UntrustedTargetError,
)
from fastckpt.format.records import MANIFEST, MAX_INDEX, Manifest
from fastckpt.io import tree
from fastckpt.io.files import torch_shape
from fastckpt.io.headers import check_flag
from fastckpt.manager.stateful import check_optimizer_state
from fastckpt.storage.registry import (
    check_path_argument,
    checked_paths,
    display_path,
    use_storage_options,
)
from fastckpt.training.hooks.context import (
    CheckpointableHook,
    MutationGuard,
    TrainContext,
    TrainingStage,
)
from fastckpt.training.hooks.rebuild import (
    CONFIGS_FIELD,
    parse_hook_configs,
    rebuild_hooks,
    record_hooks,
)
from fastckpt.training.replicas import data_parallel_over_world
from fastckpt.training.signals import HeldSignals

_LOG = logging.getLogger(__name__)

__all__ = ["FineTuningStrategy", "OptimizerConfig", "TrainingStrategy"]

Trusted = Iterable[str | Callable[..., Any]] | None
MUST_BE_SUPPLIED = "must be supplied"
COUNTERS = ("step_count", "global_step_count", "batch_count", "epoch_count", "epoch_step_count")


def _path_of(target: type | str) -> str:
    return target if isinstance(target, str) else trust.dotted_path(target)


@dataclass
class OptimizerConfig:
    """How to build a model's optimizer (and optionally its LR scheduler).

    Attributes:
        optimizer_cls: an Optimizer subclass or its dotted path.
        optimizer_kwargs: keyword arguments (``lr``, ``betas``, ...).
        scheduler_cls: an LR-scheduler class or dotted path, or None.
        scheduler_kwargs: its keyword arguments (the optimizer is passed first).
    """

    optimizer_cls: type[torch.optim.Optimizer] | str
    optimizer_kwargs: dict[str, Any] = field(default_factory=dict)
    scheduler_cls: type | str | None = None
    scheduler_kwargs: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        """Refuse what would build something else than asked, or fail later without naming
        the field.

        Raises:
            TypeError: a class field that is neither a class nor a dotted path, or a kwargs
                field that is not a mapping.
            ValueError: ``scheduler_kwargs`` without ``scheduler_cls`` (before: accepted, and
                no scheduler was built: the learning rate never moved).
        """
        for name, value in (
            ("optimizer_cls", self.optimizer_cls),
            ("scheduler_cls", self.scheduler_cls),
        ):
            if value is None and name == "scheduler_cls":
                continue
            if not (callable(value) or (isinstance(value, str) and value)):
                raise TypeError(
                    f"OptimizerConfig.{name} must be a class (or a factory) or its dotted "
                    f"path, got {type(value).__name__} {value!r}"
                )
        for name, kwargs in (
            ("optimizer_kwargs", self.optimizer_kwargs),
            ("scheduler_kwargs", self.scheduler_kwargs),
        ):
            if kwargs is not None and not isinstance(kwargs, Mapping):
                raise TypeError(
                    f"OptimizerConfig.{name} must be a dict of keyword arguments, got "
                    f"{type(kwargs).__name__}"
                )
        if self.scheduler_cls is None and self.scheduler_kwargs:
            raise ValueError(
                f"OptimizerConfig: scheduler_kwargs {self.scheduler_kwargs!r} given without "
                "scheduler_cls, so no scheduler would be built; give the scheduler class too "
                "(scheduler_cls=torch.optim.lr_scheduler.StepLR, say), or drop the kwargs"
            )

    @classmethod
    def from_optimizer(cls, optimizer: torch.optim.Optimizer) -> OptimizerConfig:
        """A config with the live optimizer's class and ``defaults``."""
        return cls(type(optimizer), codec.accepted_kwargs(type(optimizer), optimizer.defaults))

    def build(
        self, params: Iterable[torch.nn.Parameter], trusted: Trusted = None
    ) -> tuple[torch.optim.Optimizer, Any]:
        """Build the optimizer on ``params`` and the scheduler on it (or None).

        Dotted paths go through the trust policy (:func:`fastckpt.checkpoint.trust.resolve_target`).
        """
        optimizer_cls = self.optimizer_cls
        trusted = trust.frozen_trusted(trusted)
        if isinstance(optimizer_cls, str):
            optimizer_cls = trust.resolve_target(optimizer_cls, "optimizer", trusted)
        optimizer = optimizer_cls(params, **self.optimizer_kwargs)
        scheduler = None
        if self.scheduler_cls is not None:
            scheduler_cls = self.scheduler_cls
            if isinstance(scheduler_cls, str):
                scheduler_cls = trust.resolve_target(scheduler_cls, "scheduler", trusted)
            scheduler = scheduler_cls(optimizer, **(self.scheduler_kwargs or {}))
            _refuse_a_scheduler_needing_a_metric(scheduler)
        return optimizer, scheduler

    def to_json(self) -> dict[str, Any]:
        """JSON recipe (classes as dotted paths, kwargs encoded by
        :mod:`fastckpt.checkpoint.specs`)."""
        return {
            "optimizer_cls": _path_of(self.optimizer_cls),
            "optimizer_kwargs": specs.encode_value(self.optimizer_kwargs, "optimizer_kwargs"),
            "scheduler_cls": None if self.scheduler_cls is None else _path_of(self.scheduler_cls),
            "scheduler_kwargs": specs.encode_value(self.scheduler_kwargs, "scheduler_kwargs"),
        }

    @classmethod
    def from_json(cls, data: Any) -> OptimizerConfig:
        """Inverse of :meth:`to_json` (classes stay dotted paths until :meth:`build`)."""
        if not isinstance(data, Mapping) or not isinstance(data.get("optimizer_cls"), str):
            raise CheckpointFormatError(f"bad optimizer config {data!r}")
        scheduler_cls = data.get("scheduler_cls")
        if scheduler_cls is not None and not isinstance(scheduler_cls, str):
            raise CheckpointFormatError(
                f"field 'scheduler_cls' must be a dotted path or null, got {scheduler_cls!r}"
            )
        for key in ("optimizer_cls", "scheduler_cls"):
            if data.get(key) is not None:
                trust.validate_dotted_path(data[key])  # the form only: nothing imported
        scheduler_kwargs = specs.decode_value(data.get("scheduler_kwargs"))
        if scheduler_cls is None and scheduler_kwargs:
            # Recorded by fastckpt before such a config was refused: no scheduler was ever
            # built from it, so none is now (the checkpoint loads, as it did).
            scheduler_kwargs = None
        return cls(
            optimizer_cls=data["optimizer_cls"],
            optimizer_kwargs=specs.decode_value(data.get("optimizer_kwargs") or {}),
            scheduler_cls=scheduler_cls,
            scheduler_kwargs=scheduler_kwargs,
        )


def _world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _agreed_copy(tiers: Sequence[str | Path], index: int | None) -> NearestCopy:
    """:func:`~fastckpt.container.promote.nearest_intact` decided by rank 0 for every rank
    (collective): ranks looking on their own could pick different copies (a promotion, say a
    detached one, committing a newer index between their looks), and a sharded load of
    different copies fails. Each rank takes the tier at rank 0's position in its own list.
    When rank 0's copies of newer parts lack files (node-local fast tiers), every rank reports
    what its node holds of those parts, and an index the nodes hold together counts as intact
    (``node_local`` in the result).

    Raises:
        NotCommittedError: no tier holds an intact copy (as rank 0 saw it).
    """
    import torch.distributed as dist

    rank = dist.get_rank()
    message: list[Any] = [None]
    if rank == 0:
        message[0] = _decide(tiers, index, [])
    dist.broadcast_object_list(message, src=0)
    if message[0][0] == "ask":  # rank 0 asks every node about the parts it lacks files of
        held = node_holdings(tiers, message[0][1])
        gathered: list[Any] = [None] * dist.get_world_size() if rank == 0 else []
        dist.gather_object(held, gathered if rank == 0 else None, dst=0)
        if rank == 0:
            message[0] = _decide(tiers, index, gathered[1:], ask=False)
        dist.broadcast_object_list(message, src=0)
    if message[0][0] != "ok":
        raise NotCommittedError(f"rank 0 found no copy to restore: {message[0][1]}")
    _, position, chosen, skipped, spread, passed = message[0]
    passed_over = [(display_path(Path(tiers[p])), int(i)) for p, i in passed]
    return NearestCopy(Path(tiers[position]), int(chosen), list(skipped), bool(spread), passed_over)


def check_per_rank(per_rank: Any, call: str) -> bool:
    """``per_rank`` (of ``call``) checked to be a bool.

    Raises:
        TypeError: it is not (``1`` or ``"yes"`` would silently choose a behaviour).
    """
    if not isinstance(per_rank, bool):
        raise TypeError(f"{call}: per_rank must be a bool, got {per_rank!r}")
    return per_rank


def _check_load_per_rank(per_rank: Any, parallelize: Any, call: str) -> bool:
    """``per_rank`` of a load checked: a bool, and not with ``parallelize``.

    Raises:
        TypeError: ``per_rank`` is not a bool.
        InvalidInputError: ``per_rank=True`` with ``parallelize`` (a sharded load is
            collective by nature: every rank reads its shards and they are resharded).
    """
    if check_per_rank(per_rank, call) and parallelize is not None:
        raise InvalidInputError(
            f"{call}: per_rank=True cannot be given with parallelize: a load of sharded "
            "(FSDP2) models is collective by nature (every rank calls it and reads its "
            "shards); drop per_rank, and call it on every rank"
        )
    return per_rank


#: What every rank's agreement needs, and the way out, as both its errors say it.
_AGREEMENT_RULE = (
    "Every rank must call it, with the same tiers (fallback_dirs given on every rank or on "
    "none). A load on this rank alone (evaluation on rank 0, independent runs of a sweep, "
    "one per rank) passes per_rank=True"
)


def _collective_failed(call: str, world: int, err: BaseException) -> str:
    """The message of a ``RuntimeError`` raised when a collective of a load's agreement
    fails (a gloo timeout: another rank never called the load, or called it otherwise; a
    peer gone)."""
    return (
        f"{call}: this load is collective under a process group of {world} ranks (the ranks "
        "of a data-parallel run load the same index, agreed among them), and the agreement "
        f"with the other ranks failed ({type(err).__name__}: {err}). {_AGREEMENT_RULE}"
    )


def _gathered(value: Any, call: str) -> list[Any]:
    """Every rank's ``value``, in rank order (collective), exchanged on a gloo group
    (:func:`fastckpt.dcp.peers.gloo_group`: the default group when it is gloo, else one made
    once at the first agreement): NCCL object collectives need ``torch.cuda.set_device``
    first, and a resume often runs before it.

    Raises:
        RuntimeError: the collective failed (chained): what the load needs of every rank,
            and ``per_rank``.
    """
    import torch.distributed as dist

    from fastckpt.dcp.peers import gloo_group

    _, world = _world()
    everyone: list[Any] = [None] * world
    try:
        dist.all_gather_object(everyone, value, group=gloo_group())
    except Exception as err:
        raise RuntimeError(_collective_failed(call, world, err)) from err
    return everyone


def _every_replica_loaded(failure: BaseException | None, call: str) -> None:
    """After the replicas of a data-parallel run each read the agreed copy (collective):
    raise on every rank when any rank's read failed. The agreement checks what each rank
    holds, but a read can still fail on one rank (a file found damaged as it is read, a
    validator): before, that rank raised alone, and the others went on to train and waited
    in DDP's first allreduce until the group's timeout (30 minutes by default).

    Raises:
        BaseException: this rank's own ``failure``, when it has one.
        RuntimeError: another rank failed; names it and its error (nothing should train).
    """
    mine = None if failure is None else f"{type(failure).__name__}: {failure}"[:500]
    everyone = _gathered(mine, call)
    if failure is not None:
        raise failure
    failed = [(rank, why) for rank, why in enumerate(everyone) if why is not None]
    if failed:
        raise RuntimeError(
            f"{call}: the load failed on rank "
            + "; on rank ".join(f"{rank}: {why}" for rank, why in failed)
            + ". Every rank of a data-parallel run loads the same index, so every rank "
            "raises and none trains alone; fix or remove that rank's copy (a damaged fast "
            "tier: pass the durable one in fallback_dirs), then load again"
        )


def _refuse_mixed_tiers(given: Sequence[bool], call: str) -> None:
    """Raise on every rank alike when some ranks gave ``fallback_dirs`` and others did not
    (``given``: each rank's answer): the ranks would wait on different collectives.

    Raises:
        InvalidInputError: naming the ranks on each side, the rule and ``per_rank``.
    """
    if len(set(given)) < 2:
        return
    with_tiers = ", ".join(str(rank) for rank, has in enumerate(given) if has)
    without = ", ".join(str(rank) for rank, has in enumerate(given) if not has)
    raise InvalidInputError(
        f"{call}: fallback_dirs were given on rank {with_tiers} but not on rank {without} of "
        f"a process group of {len(given)} ranks. The load is collective (the ranks of a "
        "data-parallel run load the same index, agreed among them). Nothing was loaded. "
        + _AGREEMENT_RULE
    )


def _common_copy(
    tiers: Sequence[str | Path], index: int | None, *, fallback: bool, call: str
) -> NearestCopy:
    """The copy this rank restores in a load of unsharded replicas (a DDP run) from
    ``tiers`` (this rank's ``root`` then ``fallback_dirs``) on several ranks (collective):
    the newest index every rank holds intact on one of its tiers (``index``: that index,
    never another), each rank taking it from its nearest tier holding it. Ranks looking on
    their own took different indices when their fast tiers differ (node-local disks, only
    rank 0's written to): different step counts, optimizer and RNG states in replicas of
    one run. Each rank reports the newest index it holds intact; while they differ, each
    reports its newest at or below the oldest reported. A rank's newer index passed over
    for that is named in the result's ``skipped`` (so logged as a warning).

    ``fallback``: this rank was given ``fallback_dirs`` (every rank must say the same).
    Without, ``tiers`` is ``[root]`` and an index counts when ``root`` lists it (the load
    verifies what it reads, as a load of one root alone).

    An interrupt (``KeyboardInterrupt``) while this rank looks is told to the others (they
    raise a ``RuntimeError`` naming it) and then raised here.

    Raises:
        InvalidInputError: on every rank alike, some ranks gave ``fallback_dirs`` and
            others did not.
        NotCommittedError: on every rank alike, naming each rank that holds no intact copy
            (of ``index``, or at or below what the others hold) and what it saw.
        RuntimeError: another rank failed otherwise (naming it), or the agreement's
            collective failed (see :func:`_gathered`).
    """
    ceiling = index
    copy: NearestCopy | None = None
    first: NearestCopy | None = None
    newest: list[int] = []
    while True:
        failure: BaseException | None = None
        if copy is None or copy.index != ceiling:
            try:
                copy = _newest_intact_at_most(
                    tiers, ceiling, exact=index is not None, verify=fallback
                )
            except BaseException as err:  # told to every rank, so that none waits alone
                copy, failure = None, err
        missing = isinstance(failure, NotCommittedError)
        found_here = None if copy is None else copy.index
        everyone = _gathered((fallback, found_here, _why(failure), missing), call)
        if failure is not None and not isinstance(failure, Exception):
            raise failure  # an interrupt: the others were told
        _refuse_mixed_tiers([given for given, *_ in everyone], call)
        if failure is not None and not missing:
            raise failure
        failed = [
            f"rank {other}: {why}"
            for other, (_, found, why, lacks) in enumerate(everyone)
            if found is None and not lacks
        ]
        if failed:
            raise RuntimeError(
                f"{call}: another rank of this process group could not look for the index "
                f"every rank loads: {'; '.join(failed)}. Nothing was loaded"
            )
        lacking = [
            f"rank {other}: {why}"
            for other, (_, found, why, _) in enumerate(everyone)
            if found is None
        ]
        if lacking:
            held = [
                f"rank {other}'s is index {found}"
                for other, (_, found, _, _) in enumerate(everyone)
                if found is not None
            ]
            what = f"index {index}" if index is not None else "an index"
            raise NotCommittedError(
                f"not every rank of this process group holds {what} intact in its tiers, and "
                f"the ranks of a run of unsharded models (DDP) load the same index: "
                f"{'; '.join(lacking)}"
                + (f" (the newest elsewhere: {', '.join(held)})" if held else "")
                + ". Give every rank a tier holding the run's checkpoints (the shared "
                "durable_dir in fallback_dirs)"
            )
        found = [int(f) for _, f, _, _ in everyone]
        assert copy is not None  # this rank answered with an index
        if index is not None:  # an index asked for: that one on every rank, never another
            return copy
        if first is None:
            first, newest = copy, found
        if len(set(found)) == 1:
            return _noting_passed_over(first, copy, newest)
        ceiling = min(found)


def _why(failure: BaseException | None) -> str:
    """What a rank tells the others of why it found no copy."""
    if failure is None:
        return ""
    if isinstance(failure, NotCommittedError):
        return str(failure)
    return f"{type(failure).__name__}: {failure}"


def _newest_intact_at_most(
    tiers: Sequence[str | Path], ceiling: int | None, *, exact: bool = False, verify: bool = True
) -> NearestCopy:
    """:func:`~fastckpt.container.promote.nearest_intact` of the newest index at or below
    ``ceiling`` (None: of any; ``exact``: of ``ceiling`` alone). ``verify=False`` (one tier,
    no ``fallback_dirs``): the newest such index the tier's manifest lists, unverified (the
    load verifies what it reads); a damaged manifest raises.

    Raises:
        NotCommittedError: no tier holds such an index intact.
    """
    if not verify:
        (root,) = tiers
        entries = Manifest.load(root).entries
        listed = [
            i for i in entries if ceiling is None or (i == ceiling if exact else i <= ceiling)
        ]
        if not listed:
            what = "" if ceiling is None else f" {'' if exact else 'at or below '}{ceiling}"
            raise NotCommittedError(f"no committed index{what} in {display_path(Path(root))}")
        return NearestCopy(Path(root), max(listed))
    if ceiling is None or exact:
        return nearest_intact(tiers, ceiling)
    listed_anywhere: set[int] = set()
    for tier in tiers:
        with contextlib.suppress(OSError, FastCkptError):  # as nearest_intact passes it over
            listed_anywhere.update(i for i in Manifest.load(tier).entries if i <= ceiling)
    for candidate in sorted(listed_anywhere, reverse=True):
        with contextlib.suppress(NotCommittedError):
            return nearest_intact(tiers, candidate)
    names = ", ".join(display_path(Path(t)) for t in tiers)
    raise NotCommittedError(f"no intact checkpoint at or below index {ceiling} in {names}")


def _noting_passed_over(
    first: NearestCopy, chosen: NearestCopy, newest: Sequence[int]
) -> NearestCopy:
    """``chosen``, with what ``first`` (this rank's newest intact copy) skipped and, when
    ``chosen`` is older, why ``first`` was passed over: ``newest`` (each rank's newest
    intact index) shows which ranks lack it."""
    if first.index == chosen.index:
        return chosen
    lacking = ", ".join(
        f"rank {other}'s is index {index}"
        for other, index in enumerate(newest)
        if index < first.index
    )
    note = (
        f"{display_path(first.root)} index {first.index}: this rank's newest intact, passed "
        f"over as not every rank holds it ({lacking}); every rank of the process group "
        f"loads the same index, index {chosen.index}"
    )
    skipped = [*first.skipped, *(s for s in chosen.skipped if s not in first.skipped), note]
    passed = [*first.passed_over, *(p for p in chosen.passed_over if p not in first.passed_over)]
    return NearestCopy(chosen.root, chosen.index, skipped, chosen.node_local, passed)


def refuse_a_replica_save(
    call: str, per_rank: bool, models: Iterable[torch.nn.Module] = ()
) -> None:
    """Refuse a save of DDP replicas (``models`` holding a ``DistributedDataParallel``
    module over every rank; ``call`` names the function) on a rank other than 0 of a
    process group of more than one rank, unless ``per_rank``: every rank's save committed
    an index of its own of the same step, and a resume took whichever rank wrote last (its
    RNG streams and data position on every rank). Nothing is written. Other models are
    saved on any rank (they may be the rank's own: a pipeline stage, a run of a sweep).

    Raises:
        TypeError: ``per_rank`` is not a bool.
        InvalidInputError: naming the rank, the world and the fixes.
    """
    check_per_rank(per_rank, call)
    rank, world = _world()
    if per_rank or rank == 0:
        return
    if not any(data_parallel_over_world(model, world) for model in models):
        return
    raise InvalidInputError(
        f"{call} was called on rank {rank} of a process group of {world} ranks with DDP "
        "models (DistributedDataParallel replicas over every rank): every rank's save would "
        "commit an index of its own of the same step, and a resume would take whichever "
        "rank wrote last (its RNG streams and data position on every rank). Nothing was "
        "saved. Save on rank 0 alone (`if torch.distributed.get_rank() == 0:`), or let a "
        "CheckpointHook save (rank_zero_only=True, the default: rank 0 writes, with every "
        "rank's RNG states); ranks whose models are their own, each saving into its own "
        "root, pass per_rank=True"
    )


def _no_checkpoint(tiers: Sequence[str | Path]) -> bool:
    """Whether no tier holds a committed index (a damaged manifest raises)."""
    return all(Manifest.load(tier).latest is None for tier in tiers)


def _rank_0_decides(decide: Callable[[], bool], *, fallback: bool, call: str) -> bool:
    """``decide()`` on rank 0, its answer on every rank (collective, on the gloo group of
    :func:`_gathered`). ``fallback``: this rank was given ``fallback_dirs`` (every rank must
    say the same). Rank 0's failure, an interrupt included, is told to every rank before it
    is raised there.

    Raises:
        InvalidInputError: on every rank alike, some ranks gave ``fallback_dirs`` and
            others did not.
        RuntimeError: on the other ranks, rank 0 could not decide (naming its error); or
            the collective failed (see :func:`_gathered`).
    """
    answer: tuple[str, Any] | None = None
    failure: BaseException | None = None
    if _world()[0] == 0:
        try:
            answer = ("ok", decide())
        except BaseException as err:  # told to every rank, so that none waits alone
            answer, failure = ("failed", f"{type(err).__name__}: {err}"), err
    everyone = _gathered((fallback, answer), call)
    if failure is not None and not isinstance(failure, Exception):
        raise failure  # an interrupt: the others were told
    _refuse_mixed_tiers([given for given, _ in everyone], call)
    if failure is not None:
        raise failure
    status, value = everyone[0][1]
    if status != "ok":
        raise RuntimeError(f"{call}: rank 0 could not tell whether to resume: {value}")
    return bool(value)


def _decide(
    tiers: Sequence[str | Path], index: int | None, elsewhere: list[Any], *, ask: bool = True
) -> tuple[Any, ...]:
    """Rank 0's answer for :func:`_agreed_copy`: ``("ok", tier position, index, skipped,
    node_local, [(tier position, index) passed over])``, ``("ask", part keys)`` (its copies
    of those newer parts lack files: ask the other nodes) or ``("failed", why)``."""
    asked: list[Any] = []
    try:
        copy = nearest_intact(tiers, index, elsewhere=elsewhere, asked=asked if ask else None)
    except NotCommittedError as err:
        if asked:
            return ("ask", asked)
        return ("failed", f"{type(err).__name__}: {err}")
    except Exception as err:  # typed on rank 0's side; the others get its message
        return ("failed", f"{type(err).__name__}: {err}")
    if asked:
        return ("ask", asked)
    position = [Path(tier) for tier in tiers].index(copy.root)
    passed = [
        (p, i) for p, tier in enumerate(tiers) for _, i in copy.passed_over if copy.passed(tier, i)
    ]
    return ("ok", position, copy.index, copy.skipped, copy.node_local, sorted(set(passed)))


#: How many times a load with ``fallback_dirs`` of the newest copy chooses again when a live
#: writer pruned the chosen index before it was read.
_CHOOSE_ATTEMPTS = 5


#: The stages a CheckpointHook saves at (see TrainingStrategy._fire).
_SAVING_STAGES = frozenset(
    {TrainingStage.AFTER_BATCH, TrainingStage.AFTER_EPOCH, TrainingStage.AFTER_TRAINING}
)


def _rng_state() -> dict[str, Any]:
    """Every RNG a training step may draw from, as tensors and plain values."""
    version, internal, gauss = random.getstate()
    numpy_state: tuple[Any, ...] = tuple(np.random.get_state(legacy=True))
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = numpy_state
    state: dict[str, Any] = {
        "python": [version, torch.tensor(internal, dtype=torch.int64), gauss],
        "numpy": [
            np_name,
            torch.from_numpy(np_keys.astype(np.int64)),
            np_pos,
            np_has_gauss,
            np_gauss,
        ],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _interrupted(step: int, where: str, refused: str) -> str:
    return (
        f"step {step} was interrupted half-way{where} (a second Ctrl-C inside it, or an error "
        "between the optimizer step and the counters): the weights, optimizer, schedulers, "
        "counters and RNGs are of no one step, and a checkpoint of them would resume "
        f"wrongly; nothing was {refused}. Restore the last checkpoint (restore_checkpoint) "
        "and train on from there"
    )


def _torn_restore_message(directory: str, where: str, refused: str) -> str:
    return (
        f"a restore_checkpoint of {directory} stopped part-way{where} (interrupted, or a "
        "validator or hook refused after some weights were applied): the weights, optimizer, "
        "schedulers, counters and RNGs are partly the checkpoint's and partly the run's, and "
        f"a checkpoint of them would resume wrongly; nothing was {refused}. Restore a "
        "checkpoint again (restore_checkpoint) and train on from there"
    )


#: Set in an epoch-start RNG record taken before the epoch's ``BEFORE_EPOCH`` hooks ran (a
#: resume then fires them from it); records without it were taken after them.
_BEFORE_EPOCH_HOOKS = "before_epoch_hooks"


def _cpu_rng_state() -> dict[str, Any]:
    """:func:`_rng_state` without the CUDA generators (what a data order draws from)."""
    return {name: value for name, value in _rng_state().items() if name != "cuda"}


def _set_rng_state(state: Mapping[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(int(x) for x in internal.tolist()), gauss))
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = state["numpy"]
    np.random.set_state(
        (np_name, np_keys.numpy().astype(np.uint32), np_pos, np_has_gauss, np_gauss)
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        states = list(state["cuda"])
        count = torch.cuda.device_count()
        for device, device_state in enumerate(states[:count]):
            torch.cuda.set_rng_state(device_state, device)
        mismatch = _cuda_rng_mismatch(len(states), count)
        if mismatch is not None:
            warnings.warn(mismatch, stacklevel=3)


def _cuda_rng_mismatch(recorded: int, visible: int) -> str | None:
    """What a resume with ``recorded`` CUDA generator states on ``visible`` devices cannot
    restore (the states of devices 0 .. min - 1 are; a recorded state without a device is
    dropped, a device without a recorded state keeps its own), or None when they match."""
    if recorded == visible:
        return None
    if recorded > visible:
        lost = f"the states of devices {visible}..{recorded - 1} are dropped"
    else:
        lost = f"devices {recorded}..{visible - 1} keep their current state"
    return (
        f"the checkpoint recorded CUDA RNG states for {recorded} device(s) and this process "
        f"sees {visible}: {lost}, so CUDA random ops on them do not repeat the saved run "
        "exactly (restore on as many visible devices, e.g. the same CUDA_VISIBLE_DEVICES, for "
        "an exact resume)"
    )


def _to_device(value: Any, device: torch.device | None) -> Any:
    if device is None:
        return value
    return tree.map_tensors(value, lambda tensor: tensor.to(device))


class TrainingStrategy:
    """Runs a training loop and checkpoints all of it.

    Args:
        models: an ``nn.Module`` (named ``"main"``) or a mapping name -> module (DDP-wrapped
            modules are fine; they are unwrapped in checkpoints).
        optimizers: an :class:`OptimizerConfig` (applied to every model), a live
            ``torch.optim.Optimizer`` (single model), or a mapping model name -> either.
        training_fn: ``training_fn(model, batch) -> loss`` (with several models the first
            argument is the mapping of models), or its dotted path.
        hooks: hooks called at every :class:`TrainingStage`.
        num_steps: stop after this many optimizer steps in total.
        num_epochs: stop after this many completed epochs in total.
        device: move models and batches here.

    Attributes:
        models, optimizers, schedulers: live objects keyed by model name.
        step_count, global_step_count, batch_count, epoch_count, epoch_step_count: counters.
    """

    def __init__(
        self,
        models: torch.nn.Module | Mapping[str, torch.nn.Module],
        optimizers: Any = None,
        training_fn: Callable[..., Any] | str | None = None,
        hooks: Sequence[Any] = (),
        num_steps: int | None = None,
        num_epochs: int | None = None,
        device: str | torch.device | None = None,
    ) -> None:
        """Build the optimizers and schedulers from their configs; counters start at 0."""
        try:
            self.models: dict[str, torch.nn.Module] = (
                {"main": models} if isinstance(models, torch.nn.Module) else dict(models)
            )
        except (TypeError, ValueError):
            raise TypeError(
                "TrainingStrategy models must be an nn.Module or a mapping of names to them, "
                f"got {type(models).__name__}"
            ) from None
        for name, model in self.models.items():
            if not isinstance(name, str) or not name or not isinstance(model, torch.nn.Module):
                raise TypeError(
                    f"TrainingStrategy models: {name!r} -> {type(model).__name__}; each entry "
                    "must be a non-empty str name and an nn.Module"
                )
        if not self.models:
            raise ValueError("TrainingStrategy needs at least one model")
        for name, model in self.models.items():
            sharded_training.check_not_fsdp1(name, model)
            if build.has_lazy_tensors(model):
                # Shaped by the first forward pass (LazyLinear): its recipe is proven at
                # every save, once it has shapes (before, torch's raw "Can't access the
                # shape of an uninitialized parameter" refused the run here).
                continue
            if sharded_training.is_sharded_model(model):
                sharded_training.check_recordable(name, model)
            else:
                build.check_recordable(codec.unwrap_model(model), name)
        self.device = None if device is None else torch.device(device)
        if self.device is not None:
            for model in self.models.values():
                model.to(self.device)
        self.optimizer_configs: dict[str, OptimizerConfig] = {}
        self.optimizers: dict[str, torch.optim.Optimizer] = {}
        self.schedulers: dict[str, Any] = {}
        self._setup_optimizers(optimizers)
        self.training_fn = self._resolve_training_fn(training_fn)
        if isinstance(hooks, (str, bytes, Mapping)) or not isinstance(hooks, Iterable):
            raise TypeError(
                f"TrainingStrategy hooks must be a list of hooks, got {type(hooks).__name__}"
            )
        self.hooks = list(hooks)
        #: Which tier's copy :meth:`load_checkpoint` with ``fallback_dirs`` resumed from.
        self.restored_from: NearestCopy | None = None
        self.num_steps = num_steps
        self.num_epochs = num_epochs
        self.step_count = 0
        self.global_step_count = 0
        self.batch_count = 0
        self.epoch_count = 0
        self.epoch_step_count = 0
        #: every CPU RNG (Python's, NumPy's, torch's) as the current epoch began (a torch
        #: state tensor alone when restored from a checkpoint of an earlier fastckpt)
        self._epoch_start_rng: dict[str, Any] | torch.Tensor | None = None
        #: The states of the loader's own generators when the epoch began (see
        #: :func:`_loader_generators`); None before the first epoch.
        self._epoch_start_loader_rng: list[torch.Tensor] | None = None
        #: The settings of the loader the current epoch's position counts batches of (see
        #: :func:`_loader_record`); None before the first epoch, at an epoch's end, and when
        #: restored from a checkpoint of an earlier fastckpt (it recorded none).
        self._epoch_loader: dict[str, Any] | None = None
        #: The loader of the running :meth:`run` (its generators' states go into each save).
        self._train_loader: Iterable[Any] | None = None
        #: Its generators' states when the last :meth:`run` returned (a save after it, to
        #: resume for more epochs, records them).
        self._loader_rng_after_run: list[torch.Tensor] = []
        #: Whether a restore's loader generator states are still to be given back (at the
        #: next epoch that begins afresh), and those states (None: the checkpoint, saved by
        #: an earlier fastckpt, recorded none).
        self._resume_loader_pending = False
        self._resume_loader_rng: list[torch.Tensor] | None = None
        #: Whether the current epoch's loader had its persistent workers running already as
        #: the epoch began (started in an earlier epoch and kept: see :meth:`_iterate`).
        self._epoch_workers_kept = False
        #: A restore's word on that for the epoch it starts or replays (None: not restored,
        #: or saved by an earlier fastckpt), used by the first iterator made after it.
        self._resume_workers_kept: bool | None = None
        self._ctx = TrainContext(workflow=self)

    # ------------------------------------------------------------------ construction

    def _setup_optimizers(self, optimizers: Any) -> None:
        if optimizers is None:
            return
        if not isinstance(optimizers, (OptimizerConfig, torch.optim.Optimizer, Mapping)):
            raise TypeError(
                "TrainingStrategy optimizers must be an OptimizerConfig, a live optimizer, or a "
                f"mapping of model names to them, got {type(optimizers).__name__} "
                f"{optimizers!r}"
            )
        if isinstance(optimizers, (OptimizerConfig, torch.optim.Optimizer)):
            if isinstance(optimizers, torch.optim.Optimizer) and len(self.models) != 1:
                raise ValueError("a live optimizer needs a single model; pass a mapping instead")
            optimizers = dict.fromkeys(self.models, optimizers)
        for name, config in dict(optimizers).items():
            if name not in self.models:
                raise KeyError(
                    f"optimizer for unknown model {name!r}; models: {sorted(self.models)}"
                )
            if isinstance(config, torch.optim.Optimizer):
                self.optimizers[name] = config
                self.optimizer_configs[name] = OptimizerConfig.from_optimizer(config)
                continue
            if not isinstance(config, OptimizerConfig):
                raise TypeError(f"optimizers[{name!r}] must be an OptimizerConfig or Optimizer")
            optimizer, scheduler = config.build(self.models[name].parameters())
            self.optimizers[name] = optimizer
            self.optimizer_configs[name] = config
            if scheduler is not None:
                self.schedulers[name] = scheduler

    @staticmethod
    def _resolve_training_fn(training_fn: Callable[..., Any] | str | None) -> Any:
        if isinstance(training_fn, str):
            # The caller wrote this path in their own code: it is trusted by construction.
            return trust.resolve_target(training_fn, "callable", trusted=[training_fn])
        return training_fn

    @property
    def context(self) -> TrainContext:
        """The context hooks receive (kept current by the loop)."""
        return self._ctx

    # ------------------------------------------------------------------ the loop

    def _fire(self, stage: TrainingStage) -> None:
        ctx = self._ctx
        ctx.step_count = self.step_count
        ctx.global_step_count = self.global_step_count
        ctx.batch_count = self.batch_count
        ctx.epoch_step_count = self.epoch_step_count
        ctx.epoch = self.epoch_count
        ctx.global_rank = _world()[0]
        ctx.models = self.models
        ctx.optimizers = self.optimizers
        ctx.schedulers = self.schedulers
        self._stage = stage
        # At the stages checkpoints are taken at, hooks that save them run after the others,
        # so that a checkpoint holds every other hook's work of that stage (a resumed run does
        # not replay it); elsewhere list order (a CheckpointHook's refusal of a mixed run at
        # BEFORE_TRAINING comes before other hooks start anything).
        savers = (
            [hook for hook in self.hooks if getattr(hook, "saves_checkpoints", False) is True]
            if stage in _SAVING_STAGES
            else []
        )
        for hook in self.hooks:
            if not any(hook is saver for saver in savers):
                hook(ctx, stage)
        if savers and self._rank_rng_group is not None and self._saves_for_all_ranks(savers):
            self._gather_rank_rng(self._rank_rng_group)  # for rank 0's save (collective)
        try:
            for hook in savers:
                hook(ctx, stage)
        finally:
            if not self.sharded:
                self._pending_rank_rng = None  # never carried to a later, other save

    def _saves_for_all_ranks(self, savers: Sequence[Any]) -> bool:
        """Whether rank 0's hooks take a checkpoint for every rank at this stage: the same
        answer on every rank (the run's end always counts: whether it saves depends on
        what rank 0 saved before)."""
        ctx = self._ctx
        if self._stage is TrainingStage.AFTER_TRAINING:
            return True
        return any(
            bool(getattr(hook, "saves_for_all_ranks_at", lambda *_: False)(ctx, self._stage))
            for hook in savers
        )

    def _agree_on_rank_rng(self) -> None:
        """At the start of :meth:`run` of a data-parallel (DDP) strategy on several ranks:
        when every rank has the same checkpoint-saving hooks, the checkpoints rank 0 takes
        for all will hold each rank's RNG states (gathered at each save on a gloo group made
        now), so that ranks seeded apart, or each advancing its own GPU's generator, resume
        their own streams. Collective on every rank of the default group: a DDP model over
        it means every rank runs this loop."""
        import torch.distributed as dist

        rank, world = _world()
        if world == 1 or self.sharded or self._rank_rng_group is not None:
            return
        if not any(data_parallel_over_world(model, world) for model in self.models.values()):
            return
        group: Any = dist.new_group(backend="gloo")
        mine = [
            (
                f"{type(hook).__module__}.{type(hook).__qualname__}",
                getattr(hook, "step_interval", None),
                getattr(hook, "epoch_interval", None),
                getattr(hook, "rank_zero_only", None),
            )
            for hook in self.hooks
            if getattr(hook, "saves_checkpoints", False) is True
        ]
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, mine, group=group)
        if all(hooks == everyone[0] for hooks in everyone):
            self._rank_rng_group = group
        elif rank == 0:
            warnings.warn(
                "the ranks of this data-parallel run do not all have the same checkpoint "
                f"hooks ({everyone}): rank 0's checkpoints hold its own RNG states only, and "
                "every rank of a resume draws rank 0's streams (give every rank the same "
                "hooks; rank_zero_only keeps the writing on rank 0)",
                stacklevel=3,
            )

    def _done(self) -> bool:
        return (self.num_steps is not None and self.step_count >= self.num_steps) or (
            self.num_epochs is not None and self.epoch_count >= self.num_epochs
        )

    def run(self, train_loader: Iterable[Any]) -> None:
        """Train until ``num_steps`` steps or ``num_epochs`` epochs (totals), firing hooks.

        A restored or previously stopped strategy continues mid-epoch where it stopped.

        Raises:
            ValueError: no training_fn, no optimizer, no stopping condition, or an empty loader.
            TypeError: ``num_steps`` / ``num_epochs`` is not an int >= 0 or None, or a hook
                is not callable.
        """
        if self.training_fn is None:
            raise ValueError("TrainingStrategy.run needs a training_fn")
        if not self.optimizers:
            raise ValueError("TrainingStrategy.run needs optimizers")
        for name in ("num_steps", "num_epochs"):
            limit = getattr(self, name)
            if limit is not None and not _is_count(limit):
                raise TypeError(
                    f"TrainingStrategy {name} must be an int >= 0 (a total) or None, got {limit!r}"
                )
        if self.num_steps is None and self.num_epochs is None:
            raise ValueError("set num_steps or num_epochs before run()")
        # Training on would carry the cut-off state into every later checkpoint. The ranks of
        # a sharded run ask each other: one rank refusing alone would leave the others
        # waiting in their first collective until it timed out.
        if self.sharded and _world()[1] > 1:
            self._refuse_an_interrupted_step_on_any_rank("trained on")
        else:
            torn = self._torn_state("", "trained on")
            if torn is not None:
                raise InterruptedStepError(torn)
        for position, hook in enumerate(self.hooks):
            if not callable(hook):
                raise TypeError(
                    f"hooks[{position}] is a {type(hook).__name__}, not a hook: a hook is "
                    "called as hook(ctx, stage) (see fastckpt.Hook)"
                )
        _refuse_two_savers_on_one_root(self.hooks)
        if any(getattr(hook, "saves_checkpoints", False) is True for hook in self.hooks):
            _warn_unsaved_sampler_rngs(train_loader)
        for scheduler in self.schedulers.values():  # one put into schedulers by hand, say
            _refuse_a_scheduler_needing_a_metric(scheduler)
        self._train_loader = train_loader
        with contextlib.ExitStack() as stack:
            stack.callback(self._loader_done)
            stack.callback(setattr, self, "_run_thread", self._run_thread)
            self._run_thread = threading.get_ident()
            for hook in self.hooks:
                if hasattr(hook, "__enter__") and hasattr(hook, "__exit__"):
                    stack.enter_context(hook)
            self._fire(TrainingStage.SETUP)
            self._agree_on_rank_rng()
            self._fire(TrainingStage.BEFORE_TRAINING)
            self._signals = HeldSignals()
            try:
                with self._signals:
                    while not self._done():
                        if not self._run_epoch(train_loader):
                            break
                        self._signals.deliver()  # after the epoch's hooks (validation, say)
            except BaseException:  # a handler may raise SystemExit, say
                self._mark_hard_stop()
                raise
            finally:
                self._signals = None
                self._step_started = None
            self._fire(TrainingStage.AFTER_TRAINING)

    def _epoch_iterator(self, train_loader: Iterable[Any]) -> Iterator[Any]:
        """A fresh epoch, or the current one replayed from its start RNG and fast-forwarded.

        A run resumed mid-epoch fires ``BEFORE_EPOCH`` again (with ``epoch_step_count`` > 0),
        from every CPU RNG as the epoch began: the epoch's setup in this process, such as
        ``DistributedSampler.set_epoch`` or a random per-epoch setting, must precede the
        replay and draw what it drew then. The replay goes on from there: a
        sampler may shuffle with torch's, Python's (``random.shuffle``) or NumPy's
        (``np.random.permutation``), and the dataset draws from them too. Every RNG is put
        back after the replay, as the checkpoint left them for the resumed batches."""
        if self.epoch_step_count == 0 or self._epoch_start_rng is None:
            self.epoch_step_count = 0
            start: Any = _cpu_rng_state()  # before the epoch's setup, which may draw from them
            if isinstance(start, Mapping):  # marked: earlier versions took it after the hooks
                start = {**start, _BEFORE_EPOCH_HOOKS: True}
            self._fire(TrainingStage.BEFORE_EPOCH)
            self._restore_loader_generators(train_loader)
            self._epoch_start_rng = start
            self._epoch_start_loader_rng = [g.get_state() for g in _loader_generators(train_loader)]
            self._epoch_loader = _loader_record(train_loader)
            return self._iterate(train_loader)
        current = _rng_state()
        recorded = self._epoch_start_rng
        before_hooks = isinstance(recorded, Mapping) and recorded.get(_BEFORE_EPOCH_HOOKS) is True
        if not before_hooks:
            # Recorded by an earlier fastckpt after the epoch's hooks had run: they run here as
            # they did with it, before the state is set (their draws are not replayed).
            self._fire(TrainingStage.BEFORE_EPOCH)
        if isinstance(recorded, torch.Tensor):
            torch.set_rng_state(recorded)  # recorded by an earlier fastckpt
        else:
            _set_rng_state(recorded)
        if before_hooks:
            # The epoch's setup draws what it drew when the epoch began (a random per-epoch
            # setting: before, it drew from the checkpoint's RNG state, and the resumed
            # epoch ran with another one).
            self._fire(TrainingStage.BEFORE_EPOCH)
        self._rewind_loader_generators(train_loader)
        self._resume_loader_pending = False  # the replay advances them as the saved run did
        live = _loader_record(train_loader)
        _warn_another_loader(self._epoch_loader, live, self.epoch_count, self.epoch_step_count)
        self._epoch_loader = live  # the position counts this loader's batches from here
        iterator = self._iterate(train_loader)
        for consumed in range(self.epoch_step_count):
            try:
                next(iterator)
            except StopIteration:
                raise ValueError(
                    f"the loader has only {consumed} batches but the checkpoint stopped after "
                    f"{self.epoch_step_count} in this epoch; resume with the same data"
                ) from None
        _set_rng_state(current)
        return iterator

    def _iterate(self, train_loader: Iterable[Any]) -> Iterator[Any]:
        """``iter(train_loader)`` for this epoch, drawing from the RNGs what the saved run drew.

        A DataLoader with persistent workers makes its worker iterator at its first
        ``iter()``, drawing the workers' base seed before the sampler's shuffle seed, and
        keeps it: later epochs draw the shuffle seed alone. Where the saved run had its
        workers running already as this epoch began (``_resume_workers_kept``, recorded in
        the checkpoint) and this process has not started them, the new iterator's base seed
        is drawn from a generator of its own, so that the sampler draws what it drew in the
        saved run (before, one draw early: the resumed epoch read its batches in another
        order, without a word). The workers' own random streams start from that new seed, not
        where the saved run's were: said in a warning. Otherwise, as ``iter()`` (a run that
        made a new loader every epoch drew the base seed from the RNG every epoch)."""
        starting = _persistent_workers_to_start(train_loader)
        self._epoch_workers_kept = not starting and _persistent_workers_kept(train_loader)
        kept_then, self._resume_workers_kept = self._resume_workers_kept, None
        if not (starting and kept_then is True):
            return iter(train_loader)
        self._epoch_workers_kept = True  # as in the saved run
        warnings.warn(
            f"the loader's persistent workers start anew in this resumed run (epoch "
            f"{self.epoch_count}): its batches come in the uninterrupted run's order, but "
            "random numbers drawn inside the workers (augmentation in Dataset.__getitem__) "
            "come from a new seed, not from where the uninterrupted run's workers were; with "
            "persistent_workers=False every epoch seeds its workers from the saved RNG, and "
            "a resume replays them exactly",
            UserWarning,
            stacklevel=4,
        )
        loader: Any = train_loader
        kept = loader.generator
        loader.generator = torch.Generator().manual_seed(int.from_bytes(os.urandom(8)) >> 1)
        try:
            return iter(train_loader)
        finally:
            loader.generator = kept

    def _workers_kept_for_resume(self) -> bool:
        """What a checkpoint taken now records for :meth:`_iterate` of a run resumed from it:
        whether the epoch that run starts or replays had its loader's persistent workers
        running as it began. Mid-epoch, as this epoch began; at an epoch's end, whether this
        run goes on with the same loader, whose workers keep running."""
        if self._epoch_loader is not None:
            return self._epoch_workers_kept
        loader = self._train_loader
        return loader is not None and _persistent_workers_kept(loader) and not self._done()

    def _rewind_loader_generators(self, train_loader: Iterable[Any]) -> None:
        """Give the loader's own generators (``DataLoader(generator=...)``, a sampler's) the
        states they had when the resumed epoch began, so its replay shuffles as that epoch
        did; a warning when the checkpoint has no states for them (saved by an earlier
        fastckpt) or states for other generators."""
        _set_loader_generators(
            train_loader, self._epoch_start_loader_rng, "the epoch-start state", stacklevel=5
        )

    def _loader_done(self) -> None:
        """At the end of :meth:`run`: keep the loader's generators' states for later saves."""
        if self._train_loader is not None:
            self._loader_rng_after_run = _loader_states(self._train_loader)
        self._train_loader = None

    def _restore_loader_generators(self, train_loader: Iterable[Any]) -> None:
        """At the first epoch after a restore that begins afresh (the checkpoint was taken at
        an epoch's end), give the loader's own generators the states they had when the
        checkpoint was taken: the epochs before advanced them, and a rebuilt loader's start
        from their seed (the next epoch would shuffle as the first did). A warning when the
        checkpoint has no states for them, or states for other generators."""
        if not self._resume_loader_pending:
            return
        self._resume_loader_pending = False
        _set_loader_generators(
            train_loader, self._resume_loader_rng, "the state at its save", stacklevel=6
        )

    def _run_epoch(self, train_loader: Iterable[Any]) -> bool:
        """Run (the rest of) one epoch; False when training must stop mid-epoch."""
        seen = self.epoch_step_count
        # The epoch's setup (its hooks, the replay of a resumed epoch) sets the RNGs aside
        # and back: a hard stop inside it leaves them of no one step.
        self._step_started = self.step_count + 1
        iterator = self._epoch_iterator(train_loader)
        self._step_started = None
        while True:
            # Ctrl-C is held until the step is done (HeldSignals); a second one stops at once,
            # and a step it cuts off after the fetch began is marked (see _mark_hard_stop).
            self._step_started = self.step_count + 1
            try:
                batch = next(iterator)
            except StopIteration:
                self._step_started = None
                break
            self._train_batch(batch)
            self._step_started = None
            seen += 1
            if self._signals is not None:
                self._signals.deliver()
            if self._done():
                return False
        if seen == 0:
            raise ValueError("the training loader yielded no batches")
        self.epoch_count += 1
        self.epoch_step_count = 0
        self._epoch_start_rng = None
        self._epoch_start_loader_rng = None
        self._epoch_loader = None
        self._fire(TrainingStage.AFTER_EPOCH)
        return True

    def _train_batch(self, batch: Any) -> None:
        self._ctx.batch = batch
        self._fire(TrainingStage.BEFORE_BATCH)
        for optimizer in self.optimizers.values():
            optimizer.zero_grad(set_to_none=True)
        model_arg: Any = self.models["main"] if list(self.models) == ["main"] else self.models
        loss = self.training_fn(model_arg, _to_device(batch, self.device))
        loss.backward()
        self._ctx.loss = loss.detach()
        with contextlib.ExitStack() as guards:
            for hook in self.hooks:
                if isinstance(hook, MutationGuard):
                    guards.enter_context(hook.guard())
            # The gradients are whole: hooks clip or scale them before the step uses them
            # (under the guards, as a hook may change weights here too).
            self._fire(TrainingStage.BEFORE_OPTIMIZER_STEP)
            # From the optimizer step until the counters move, the state is between two
            # steps: an error raised there leaves it marked, and a save then refuses it.
            self._interrupted_step = self.step_count + 1
            for optimizer in self.optimizers.values():
                optimizer.step()
            for scheduler in self.schedulers.values():
                scheduler.step()
            # Every counter moves with the optimizer step, before any hook runs: a hook raising
            # at AFTER_OPTIMIZER_STEP leaves a state whose save resumes after this batch (not
            # one that trained it again).
            self.step_count += 1
            self.global_step_count += _world()[1]
            self.batch_count += 1
            self.epoch_step_count += 1
            self._interrupted_step = None  # the step's state moved as one (see _run_epoch)
            self._step_started = None  # and is whole: its hooks may be stopped at once
            self._fire(TrainingStage.AFTER_OPTIMIZER_STEP)
        self._fire(TrainingStage.AFTER_BATCH)
        self._ctx.batch = None

    # ------------------------------------------------------------------ checkpoints

    @property
    def counters(self) -> dict[str, int]:
        """The five counters."""
        return {name: getattr(self, name) for name in COUNTERS}

    def _training_fn_path(self) -> str:
        if self.training_fn is None:
            return MUST_BE_SUPPLIED
        try:
            return trust.dotted_path(self.training_fn)
        except TypeError:
            return MUST_BE_SUPPLIED

    #: The part fields of the sharded save under way (see :meth:`start_sharded_save`), for
    #: the next :meth:`checkpoint_snapshot` to name in the index.
    _pending_sharded_part: dict[str, Any] | None = None
    #: Every rank's RNG states at the sharded save being taken (rank 0, when the ranks'
    #: states differ: ranks seeded apart), for the next snapshot (see :meth:`_gather_rank_rng`).
    _pending_rank_rng: list[dict[str, Any]] | None = None
    #: A data-parallel run whose ranks agreed on their checkpoint hooks: the gloo group
    #: every rank's RNG states are gathered on for rank 0's saves (see _agree_on_rank_rng).
    _rank_rng_group: Any = None
    #: The stage the hooks are being called for.
    _stage: TrainingStage | None = None
    #: The step whose update (optimizer and scheduler steps, counters) an error cut short:
    #: the state is between two steps until a restore (None: it is not).
    _interrupted_step: int | None = None
    #: The checkpoint directory a :meth:`restore_checkpoint` was applying when it stopped
    #: part-way (None: no restore is half-applied); cleared by a restore that completes.
    _torn_restore: str | None = None
    #: Ctrl-C / SIGTERM held until the current step is done, while :meth:`run` trains.
    _signals: HeldSignals | None = None
    #: The step under way from its batch's fetch until its counters move (None between steps).
    _step_started: int | None = None
    #: The thread :meth:`run` trains on (None: not training).
    _run_thread: int | None = None

    @property
    def sharded(self) -> bool:
        """Whether a model is FSDP2-sharded: checkpoints then keep model and optimizer state
        as every rank's shards (``ROOT/sharded/<index>``), and every rank must save."""
        return any(sharded_training.is_sharded_model(model) for model in self.models.values())

    def checkpoint_snapshot(self) -> codec.Snapshot:
        """Everything a checkpoint of this strategy holds, captured now (no file I/O).

        For a :attr:`sharded` strategy, the part of an index that exists once (recipe with
        each model's spec, counters, RNG, scheduler and hook states); :meth:`save_checkpoint`
        writes the shards.
        """
        torn = self._torn_state("", "saved")
        if torn is not None:
            raise InterruptedStepError(torn)
        self._refuse_a_save_beside_run()
        if self.sharded:
            return self._sharded_snapshot()
        models = {name: (model, None) for name, model in self.models.items()}
        optimizers = {name: (opt, None) for name, opt in self.optimizers.items()}
        schedulers = {
            name: (sched, self._scheduler_spec(name, sched))
            for name, sched in self.schedulers.items()
        }
        associations = {
            "optimizers": {name: name for name in optimizers},
            "schedulers": {name: name for name in schedulers},
        }
        snapshot = codec.create_snapshot(
            models, optimizers, schedulers, associations, self.counters
        )
        self._add_runtime(snapshot, {})
        return snapshot

    def _sharded_snapshot(self) -> codec.Snapshot:
        snapshot = codec.create_snapshot(counters=self.counters)
        schedulers = {name: sched.state_dict() for name, sched in self.schedulers.items()}
        self._add_runtime(snapshot, {"schedulers": schedulers})
        # The part this save wrote (its commit record's crc32c is added once it committed:
        # the async save fills in this very dict before its future resolves).
        record = self._pending_sharded_part if self._pending_sharded_part is not None else {}
        self._pending_sharded_part = None
        record.update(
            directory=sharded_training.SHARDED_DIR,
            models={
                name: sharded_training.unsharded_spec(model).to_json()
                for name, model in self.models.items()
            },
            optimizers=sorted(self.optimizers),
            # which parameters each group holds: the rebuilt optimizer is made with the same
            # groups (their settings come back with the optimizer state)
            param_groups={
                name: _group_names(self.models[name], optimizer)
                for name, optimizer in self.optimizers.items()
                if name in self.models
            },
            # rebuilt models are trainable throughout; these parameters were frozen
            frozen={name: codec.frozen_names(model) for name, model in self.models.items()},
        )
        snapshot.json_files["strategy.json"]["sharded"] = record
        return snapshot

    def _add_runtime(self, snapshot: codec.Snapshot, extra: dict[str, Any]) -> None:
        """Add the recipe, counters, RNG states (plus ``extra``) and hook states."""
        runtime = {**self._run_rng(), "rank_rng": self._pending_rank_rng, **extra}
        if self.sharded:
            self._pending_rank_rng = None  # gathered for this one save (see _gather_rank_rng)
        # Unsharded (DDP): kept for every snapshot of this stage (a hook's prewarm, a second
        # saver's), then dropped by _fire once the savers ran.
        skeleton, tensors = tree.flatten(runtime)
        snapshot.tensor_files["strategy.safetensors"] = tensors
        snapshot.json_files["strategy.json"] = {
            "strategy_cls": trust.dotted_path(type(self)),
            "optimizer_configs": {n: c.to_json() for n, c in self.optimizer_configs.items()},
            "training_fn": self._training_fn_path(),
            "num_steps": self.num_steps,
            "num_epochs": self.num_epochs,
            "counters": self.counters,
            # what the replay of a resumed epoch skips batches of (see _warn_another_loader)
            "epoch_loader": self._epoch_loader,
            # whether that epoch's persistent loader workers were running (see _iterate)
            "loader_workers_kept": self._workers_kept_for_resume(),
            "runtime": skeleton,
        }
        # The run state changes outside the optimizer step: an async save copies it when the
        # save is taken (RNG states are copies already; a few bytes).
        snapshot.volatile.update(("strategy.safetensors", name) for name in tensors)
        hook_states: list[dict[str, Any]] = []
        in_background: set[str] = set()  # positions of hooks whose tensors may be copied later
        occurrences: dict[str, int] = {}
        for hook in self.hooks:
            if isinstance(hook, CheckpointableHook):
                cls_path = trust.dotted_path(type(hook))
                occurrence = occurrences.get(cls_path, 0)
                occurrences[cls_path] = occurrence + 1
                if getattr(hook, "state_changes_in_optimizer_step", False) is True:
                    in_background.add(str(len(hook_states)))
                hook_states.append(
                    {"class": cls_path, "occurrence": occurrence, "state": hook.state_dict()}
                )
        skeleton, tensors = tree.flatten(hook_states)
        _refuse_sharded_hook_state(hook_states, tensors)
        snapshot.json_files["hooks.json"] = {
            "hooks": skeleton,
            CONFIGS_FIELD: record_hooks(self.hooks),
        }
        snapshot.tensor_files["hooks.safetensors"] = tensors
        # A hook may change its tensors at any stage (see CheckpointableHook): copied when
        # the save is taken, unless the hook says they change only in the optimizer step,
        # which waits for the background copy (EMAHook's averaged weights).
        snapshot.volatile.update(
            ("hooks.safetensors", name)
            for name in tensors
            if name.split(".", 1)[0] not in in_background
        )

    def check_recordable(self) -> None:
        """Raise now what saving this strategy's recipe would raise at its first checkpoint:
        an optimizer or scheduler argument a recipe cannot record (a function, as
        ``LambdaLR``'s ``lr_lambda``; scheduler objects, as ``SequentialLR``'s), of the
        ``OptimizerConfig`` or of a scheduler put into :attr:`schedulers` by hand. A
        :class:`~fastckpt.training.hooks.CheckpointHook` calls it before training starts.

        Raises:
            TypeError: naming the optimizer or scheduler and the argument; or a model whose
                state holds a value that is not a tensor (``get_extra_state()`` returning a
                dict), which an unsharded checkpoint cannot store (before, a sync hook
                found it at its first save, the work of ``step_interval`` steps lost).
        """
        if not self.sharded:
            for name, model in self.models.items():
                codec.check_tensor_state(name, codec.unwrap_model(model).state_dict())
        for name, config in self.optimizer_configs.items():
            try:
                config.to_json()
            except (TypeError, ValueError) as err:
                raise TypeError(
                    f"optimizers[{name!r}]: {err}; a checkpoint records how to rebuild the "
                    "optimizer and its scheduler, so their arguments must be plain values "
                    "(pass a scheduler class whose arguments are numbers, or step your own "
                    "scheduler in a hook)"
                ) from err
        for name, scheduler in self.schedulers.items():
            _refuse_a_scheduler_needing_a_metric(scheduler)  # put here by hand, say
            if self.sharded or self._scheduler_spec(name, scheduler) is not None:
                # A sharded save keeps a scheduler's state_dict() alone; one from an
                # OptimizerConfig is recorded from it, checked above.
                continue
            try:
                codec.scheduler_spec(scheduler).to_json()
            except (TypeError, ValueError) as err:
                raise TypeError(
                    f"schedulers[{name!r}] ({type(scheduler).__name__}): {err}. A checkpoint "
                    "records how to rebuild it, from arguments its state_dict() holds as plain "
                    "values; give it through OptimizerConfig(scheduler_cls=..., "
                    "scheduler_kwargs=...) with plain arguments, or step it in a hook and keep "
                    "it out of strategy.schedulers"
                ) from err

    def _scheduler_spec(self, name: str, scheduler: Any) -> specs.BaseSpec | None:
        config = self.optimizer_configs.get(name)
        if config is None or config.scheduler_cls is None:
            return None
        return specs.BaseSpec(
            cls_path=_path_of(config.scheduler_cls), kwargs=dict(config.scheduler_kwargs or {})
        )

    def save_checkpoint(
        self,
        root: str | Path,
        *,
        checkpoint_index: int = -1,
        incremental: bool = True,
        node_local: bool = False,
        lock_timeout: float | None = None,
        check_root: Callable[[Manifest], None] | None = None,
        per_rank: bool = False,
    ) -> int:
        """Write this strategy as a committed checkpoint index of ``root``; returns it.

        A :attr:`sharded` strategy's save is collective: every rank calls it, writes its own
        shards, and rank 0 then commits the index (the recipe and counters, once); the commit
        is refused (on every rank, nothing committed) when rank 0 does not see another rank's
        shards in ``root``: a ``root`` on each node's own disk could not be restored.
        ``node_local`` allows it, for a caller that promotes every rank's shards to a shared
        tier (:class:`~fastckpt.training.hooks.CheckpointHook` with a ``durable_dir``).
        ``incremental`` (unsharded strategies): write only the tensors that changed since this
        process's last save into ``root`` (see docs/incremental.md); False writes everything.
        ``lock_timeout`` and ``check_root``: as
        :func:`fastckpt.checkpoint.components.write_snapshot` (a sharded strategy: on rank 0 at
        the commit; what ``check_root`` raises there is
        raised on rank 0 and reported on the others as a ``RuntimeError``, nothing committed).

        A strategy of DDP replicas (a ``DistributedDataParallel`` model over every rank of
        a process group of more than one rank) is saved by rank 0 alone: call this on rank 0
        only (``if torch.distributed.get_rank() == 0:``), or let a
        :class:`~fastckpt.training.hooks.CheckpointHook` save. On another rank it is refused
        (``InvalidInputError``, nothing written), unless ``per_rank``: this rank's models
        are its own, saved into a root of its own. Other unsharded models (a pipeline
        stage, a run of a sweep) are saved on any rank.

        Raises:
            TypeError: ``per_rank`` is not a bool.
            InvalidInputError: a strategy of DDP replicas saved on a rank other than 0
                without ``per_rank``.
        """
        check_path_argument(root, "TrainingStrategy.save_checkpoint")
        check_flag(node_local, "node_local", "TrainingStrategy.save_checkpoint")
        codec.check_incremental(incremental, "TrainingStrategy.save_checkpoint")
        self._refuse_a_save_beside_run()  # before a sharded save's collectives and writes
        check_per_rank(per_rank, "TrainingStrategy.save_checkpoint")
        if not self.sharded:
            refuse_a_replica_save(
                "TrainingStrategy.save_checkpoint", per_rank, self.models.values()
            )
            snapshot = self.checkpoint_snapshot()
            snapshot.incremental = incremental
            return codec.write_snapshot(
                root, snapshot, checkpoint_index, lock_timeout=lock_timeout, check_root=check_root
            )
        return self._save_sharded(
            Path(root),
            checkpoint_index,
            node_local,
            lock_timeout=lock_timeout,
            check_root=check_root,
        )

    def _refuse_a_save_beside_run(self) -> None:
        """Refuse a checkpoint taken on another thread while :meth:`run` trains: the
        counters and RNG states are read at once, the weights and optimizer state later,
        while the training thread's optimizer steps change them (a watchdog thread saving on
        a preemption notice wrote the counters of step 22 with the weights of step 23, and
        it verified and resumed without a word).

        Raises:
            ConcurrentSaveError: names both threads and the fix; nothing was written.
        """
        running = self._run_thread
        if running is None or running == threading.get_ident():
            return
        raise ConcurrentSaveError(
            f"TrainingStrategy checkpoint asked for on thread {threading.get_ident()} while "
            f"run() trains on thread {running}: the optimizer would change the weights while "
            "they are written (the counters of one step with the weights of another). Nothing "
            "was written. Save from the training thread: a CheckpointHook, or a hook of yours "
            "that saves when a flag your thread sets is up (checked at AFTER_BATCH); SIGTERM "
            "and SIGINT are held by run() until the step is done, so a signal handler may "
            "save, or raise to stop run() and save after it returns"
        )

    def _refuse_unsaveable_hook_state(self) -> None:
        """On every rank, before a sharded save starts: refuse hook state rank 0 could not
        write (see :func:`_refuse_sharded_hook_state`), so that every rank raises the same
        error instead of rank 0 alone, mid-save, leaving the others waiting for its commit.

        Raises:
            UnsupportedValueError: a checkpointable hook's state holds a DTensor.
        """
        states = [
            {"class": trust.dotted_path(type(hook)), "state": hook.state_dict()}
            for hook in self.hooks
            if isinstance(hook, CheckpointableHook)
        ]
        _refuse_sharded_hook_state(states, tree.flatten(states)[1])

    def _mark_hard_stop(self) -> None:
        """A second signal stopped a step that had begun (its batch fetched, the RNGs drawn
        from, perhaps the weights updated): the state is then of no one step."""
        signals = self._signals
        started, self._step_started = self._step_started, None
        cut = signals is not None and signals.stopped_at_once and started is not None
        if cut and self._interrupted_step is None:
            self._interrupted_step = started

    def _torn_state(self, where: str, refused: str) -> str | None:
        """Why this strategy's state is of no one step (a step cut off inside its update, or
        a restore stopped part-way), as the refusal of what ``refused`` names; None when it
        is whole."""
        if self._interrupted_step is not None:
            return _interrupted(self._interrupted_step, where, refused)
        if self._torn_restore is not None:
            return _torn_restore_message(self._torn_restore, where, refused)
        return None

    def _refuse_an_interrupted_step_on_any_rank(self, refused: str = "saved") -> None:
        """Collective, at the start of a sharded save (or of :meth:`run`: ``refused`` says
        which): raise :class:`InterruptedStepError` on every rank when any rank's step was
        cut off inside its update or its restore stopped part-way (each rank writes its own
        shards: one rank's would be of no one step)."""
        import torch.distributed as dist

        rank, world = _world()
        torn = self._torn_state(f" on rank {rank}" if world > 1 else "", refused)
        cut: list[Any] = [torn]
        if world > 1:
            cut = [None] * world
            dist.all_gather_object(cut, torn)
        for why in cut:
            if why is not None:
                raise InterruptedStepError(why)

    def _run_rng(self) -> dict[str, Any]:
        """This process's RNG states as a checkpoint records them (see :meth:`_add_runtime`)."""
        loader = self._train_loader
        return {
            "rng": _rng_state(),
            "epoch_start_rng": self._epoch_start_rng,
            "epoch_start_loader_rng": self._epoch_start_loader_rng,
            "loader_rng": self._loader_rng_after_run if loader is None else _loader_states(loader),
        }

    def _gather_rank_rng(self, group: Any = None) -> None:
        """Collective (on ``group``, the default one when None), at a sharded save or a save
        rank 0 takes for a data-parallel run: rank 0 keeps every rank's RNG states when they
        differ from its own (ranks seeded apart: per-rank dropout, per-rank shuffles), so that
        a resume on as many ranks gives each rank its own streams back; nothing when they are
        all equal (the usual single seed)."""
        import torch.distributed as dist

        rank, world = _world()
        self._pending_rank_rng = None
        if world == 1:
            return
        gathered: list[Any] | None = [None] * world if rank == 0 else None
        dist.gather_object(self._run_rng(), gathered, dst=0, group=group)
        if gathered is not None and not all(_same_state(g, gathered[0]) for g in gathered):
            self._pending_rank_rng = gathered

    def _sharded_index(self, root: Path, checkpoint_index: int) -> tuple[int, str]:
        """The index every rank saves into and the fresh part its shards go to: rank 0's
        choice, broadcast (collective)."""
        import torch.distributed as dist

        from fastckpt.container.sharded.parts import new_part

        requested = checked_index(checkpoint_index, "checkpoint_index", codec.SAVE_INDEX)
        rank, world = _world()
        decided: list[Any] = [None, None]
        if rank == 0:
            latest = Manifest.load(root).latest
            next_index = 0 if latest is None else latest + 1
            decided[0] = next_index if requested in (None, -1) else requested
            decided[1] = new_part()
        if world > 1:
            dist.broadcast_object_list(decided, src=0)
        index = int(decided[0])
        if not 0 <= index <= MAX_INDEX:
            raise ValueError(
                f"checkpoint_index must be -1 (the next) or from 0 to {MAX_INDEX}, got "
                f"{checkpoint_index}"
                + (
                    f" (the root's latest index is already {MAX_INDEX}: give an index, or "
                    "save into a new root)"
                    if index > MAX_INDEX and requested in (None, -1)
                    else ""
                )
            )
        return index, str(decided[1])

    def start_sharded_save(
        self,
        root: str | Path,
        *,
        writer: Any,
        process_group: Any = None,
        checkpoint_index: int = -1,
    ) -> tuple[int, Any]:
        """Begin an async checkpoint of a :attr:`sharded` strategy (collective; used by
        :class:`~fastckpt.training.hooks.CheckpointHook`).

        Every rank stages its shards into ``writer``'s reused buffers (training may go on once
        this returns) and uploads them in the background on ``process_group`` (a gloo group
        for checkpoints only), into a fresh part of the index. Rank 0 commits the index
        afterwards, once the returned future resolved: ``write_snapshot(root, snapshot,
        index)`` with the next :meth:`checkpoint_snapshot`, taken now (it names the part; the
        part's record checksum is filled in before the future resolves).

        ``checkpoint_index``: the index to save into (rank 0's counts), -1 for the root's
        next.

        Returns:
            The index and the future of the sharded part.
        """
        self._refuse_a_save_beside_run()
        self._refuse_unsaveable_hook_state()
        self._refuse_an_interrupted_step_on_any_rank()
        index, part = self._sharded_index(Path(root), checkpoint_index)
        self._gather_rank_rng()
        fields, future = sharded_training.async_save_sharded(
            root,
            index,
            part,
            self.models,
            self.optimizers,
            writer=writer,
            process_group=process_group,
        )
        self._pending_sharded_part = fields
        return index, future

    def _save_sharded(
        self,
        root: Path,
        checkpoint_index: int,
        node_local: bool,
        *,
        lock_timeout: float | None = None,
        check_root: Callable[[Manifest], None] | None = None,
    ) -> int:
        import torch.distributed as dist

        rank, world = _world()
        self._refuse_unsaveable_hook_state()
        self._refuse_an_interrupted_step_on_any_rank()
        index, part = self._sharded_index(root, checkpoint_index)
        self._gather_rank_rng()
        path = sharded_training.save_sharded(
            root, index, part, self.models, self.optimizers, node_local=node_local
        )
        outcome: list[Any] = [None]
        failure: Exception | None = None
        if rank == 0:
            try:
                self._pending_sharded_part = sharded_training.part_record(path)
                codec.write_snapshot(  # the commit
                    root,
                    self.checkpoint_snapshot(),
                    index,
                    lock_timeout=lock_timeout,
                    check_root=check_root,
                )
            except Exception as err:
                if world == 1:
                    raise
                failure = err
                outcome[0] = f"{type(err).__name__}: {err}"
            else:
                with contextlib.suppress(OSError, CheckpointFormatError):  # committed anyway
                    sharded_training.sweep_parts(root)  # the replaced part, killed saves'
        if world > 1:
            dist.broadcast_object_list(outcome, src=0)  # every rank learns how the commit went
        if failure is not None:
            raise failure  # rank 0: its own error, typed
        if outcome[0] is not None:
            raise RuntimeError(f"rank 0 could not commit index {index} of {root}: {outcome[0]}")
        return index

    def restore_checkpoint(
        self,
        root: str | Path,
        checkpoint_index: int = -1,
        map_location: str | torch.device | None = None,
        *,
        validators: Any = None,
    ) -> int:
        """Restore weights, optimizer/scheduler state, counters, RNG, data position and hook
        states into this live strategy. Returns the restored index.

        All or nothing: every file is read and verified, and every component checked against
        the live one (models' keys and shapes, optimizer and scheduler kinds, parameter
        groups, frozen parameters), before anything live changes; a save replacing the index
        meanwhile makes it read again (as ``fastckpt.load_checkpoint``). A hook that refuses
        its state (configured otherwise) leaves the hooks and schedulers as they were. A
        restore stopped once weights are being applied (a ``validators`` refusal, Ctrl-C)
        leaves the state torn: saves and :meth:`run` then raise ``InterruptedStepError``
        until a restore completes.

        Raises:
            ValueError: the checkpoint is component-only.
            CheckpointMismatchError: (a ``ValueError``) the checkpoint's models, or a model's
                keys or shapes, optimizers, schedulers or parameter groups differ from this
                strategy's; named, nothing live changed.
            ChecksumMismatchError / CheckpointFormatError: a damaged file, named; nothing live
                changed.
        """
        index, restore = read_consistently(
            Path(root) / MANIFEST,
            lambda: self._read_restore(root, checkpoint_index, map_location),
            lock_root=Path(root),
        )
        if restore is None:  # FSDP2-sharded models: read as one snapshot, then applied
            index = self._restore_sharded(Path(root), index, validators)
            self._interrupted_step = self._step_started = None
            return index
        self._apply_restore(restore, map_location, validators)
        self._interrupted_step = self._step_started = None  # the checkpoint's state now
        return index

    def _read_restore(
        self,
        root: str | Path,
        checkpoint_index: int,
        map_location: str | torch.device | None,
    ) -> tuple[int, _Restore | None]:
        """One attempt of :meth:`restore_checkpoint`'s read: everything it applies, read,
        verified and checked against this strategy, nothing live changed (None: the index
        holds FSDP2-sharded models, restored by :meth:`_restore_sharded`)."""
        manifest, index, reader, recipe = _index_snapshot(root, checkpoint_index, True)
        if recipe.get("sharded") is not None:
            return index, None
        entry = manifest.entries[index]
        saved_models = entry.get("components", {}).get("models", [])
        if sorted(saved_models) != sorted(self.models):
            raise CheckpointMismatchError(
                f"checkpoint {index} has models {sorted(saved_models)}, this strategy has "
                f"{sorted(self.models)}"
            )
        runtime = _parse_runtime(reader, recipe)
        saved_schedulers = entry.get("components", {}).get("schedulers", [])
        self._check_live_components(recipe, [*saved_schedulers, *runtime.schedulers], reader)
        for name, model in self.models.items():
            _check_model_fits(name, codec.unwrap_model(model), reader)
        optimizers = {
            name: reader.component_state("optimizers", name, map_location)
            for name in self.optimizers
        }
        for name, optimizer in self.optimizers.items():
            _check_param_groups(
                optimizer, optimizers[name], f"{reader.directory}/optimizers/{name}"
            )
        frozen = entry.get(codec.FROZEN_FIELD) or {}
        _check_frozen(self.models, frozen, f"{manifest.path}: {codec.FROZEN_FIELD}")
        schedulers = {
            name: reader.component_state("schedulers", name, None) for name in self.schedulers
        }
        weights = {  # views of the files' mappings: load_state_dict copies them
            name: reader.tensors(f"models/{name}.safetensors", owned=False) for name in self.models
        }
        return index, _Restore(reader, weights, optimizers, schedulers, runtime, frozen)

    def _apply_restore(
        self, restore: _Restore, map_location: str | torch.device | None, validators: Any
    ) -> None:
        """Apply what :meth:`_read_restore` read and checked: the scheduler and hook states
        first (all or nothing: a hook may still refuse its state), then the weights,
        optimizer states, frozen parameters, counters and RNG."""
        reader = restore.reader
        self._load_refusable_states(
            [
                (name, state, f"{reader.directory}/schedulers/{name}.json")
                for name, state in restore.schedulers.items()
            ],
            restore.runtime,
            reader,
        )
        frozen_where = f"{reader.manifest.path}: {codec.FROZEN_FIELD}"
        # From here on a stop leaves the state torn (the hook and scheduler states above were
        # all or nothing): saves and training refuse it until a restore completes.
        self._torn_restore = display_path(reader.directory)
        try:
            for name, model in self.models.items():
                target = codec.unwrap_model(model)
                target.load_state_dict(restore.weights[name])
                if map_location is not None:
                    target.to(map_location)
                codec.run_validators(validators, name, target)
            for name, optimizer in self.optimizers.items():
                optimizer.load_state_dict(restore.optimizers[name])
            _refreeze(self.models, restore.frozen, frozen_where)
            self._set_counters_and_rng(restore.runtime)
        except BaseException as err:  # a validator's refusal or Ctrl-C (the checks passed)
            err.add_note(
                f"restore_checkpoint of {reader.directory} stopped part-way: this strategy's "
                "hook and scheduler states and some of its weights are the checkpoint's, so "
                "it refuses to save or train (InterruptedStepError) until a restore_checkpoint "
                "completes"
            )
            raise
        self._torn_restore = None  # applied whole

    def _restore_sharded(
        self,
        root: Path,
        index: int,
        validators: Any,
        spread: sharded_training.NodeLocalIndex | None = None,
        *,
        rebuilt: bool = False,
    ) -> int:
        """Restore committed index ``index`` of FSDP2-sharded models: its strategy.json, run
        state and the part it names, read as one snapshot (in one process, read again when a
        save replaced the index meanwhile), then applied. ``spread``: the index is spread over
        node-local fast tiers; this rank's copy of the part is under ``spread.part_root``."""

        def attempt() -> tuple[codec.IndexReader, _Runtime]:
            manifest = Manifest.load(root)
            manifest.resolve(index)
            reader = codec.IndexReader(manifest, index)
            recipe = _read_recipe(reader)
            where = f"{reader.directory}/strategy.json"
            sharded = recipe.get("sharded")
            if not isinstance(sharded, Mapping) or not isinstance(sharded.get("models"), Mapping):
                raise CheckpointFormatError(f"{where}: bad 'sharded' record")
            if sorted(sharded["models"]) != sorted(self.models):
                raise ValueError(
                    f"checkpoint {index} has models {sorted(sharded['models'])}, this strategy "
                    f"has {sorted(self.models)}"
                )
            runtime = _parse_runtime(reader, recipe)
            self._check_live_components(recipe, list(runtime.schedulers), reader, rebuilt)
            frozen = sharded.get("frozen") or {}
            _check_frozen(self.models, frozen, f"{where}: sharded.frozen")
            part_root = root if spread is None else spread.part_root
            part = sharded_training.committed_part(part_root, index, sharded, where)
            record = None if spread is None else spread.record
            # From here on a stop leaves the state torn (see _apply_restore).
            self._torn_restore = display_path(reader.directory)
            sharded_training.load_sharded(part, self.models, self.optimizers, record)  # applies
            _refreeze(self.models, frozen, f"{where}: sharded.frozen")
            return reader, runtime

        if _world()[1] == 1:
            reader, runtime = read_consistently(root / MANIFEST, attempt, lock_root=root)
        else:  # the ranks cannot retry one by one: a retry would hang the others
            reader, runtime = attempt()
        for name, model in self.models.items():
            codec.run_validators(validators, name, model)
        self._apply_runtime(runtime, reader)
        self._torn_restore = None  # applied whole
        return index

    def _restore_runtime(self, reader: codec.IndexReader, recipe: Mapping[str, Any]) -> None:
        """Restore counters, RNG, data position, scheduler and hook states (checked first:
        a malformed field is a :class:`CheckpointFormatError` naming its file and field)."""
        self._apply_runtime(_parse_runtime(reader, recipe), reader)

    def _check_live_components(
        self,
        recipe: Mapping[str, Any],
        saved_schedulers: Sequence[str],
        reader: codec.IndexReader,
        rebuilt: bool = False,
    ) -> None:
        """Refuse restoring into optimizers or schedulers of another kind than the checkpoint
        recorded, or a strategy with other schedulers: torch's ``load_state_dict`` would take
        the saved state anyway (an SGD given Adam's groups failed later with a bare
        ``KeyError``; an ``ExponentialLR`` took ``StepLR``'s gamma and step size; a scheduler
        the strategy lacks was dropped, freezing the learning rate).

        ``rebuilt``: this strategy was built from the recipe (``load_checkpoint`` of an FSDP2
        index), which does not rebuild schedulers attached by hand.

        Raises:
            CheckpointMismatchError: naming the component, both kinds and the fix.
        """
        where = f"{reader.directory}/strategy.json"
        configs = recipe.get("optimizer_configs")
        configs = configs if isinstance(configs, Mapping) else {}
        fix = (
            "an FSDP2 strategy's scheduler attached by hand (not given through "
            "OptimizerConfig) is not rebuilt: build the strategy, attach the scheduler and "
            "call restore_checkpoint"
            if rebuilt
            else "build the strategy as the checkpoint was saved, or load it whole with "
            "TrainingStrategy.load_checkpoint"
        )
        for name, optimizer in self.optimizers.items():
            config = configs.get(name)
            if not isinstance(config, Mapping):
                continue
            for kind, live in (
                ("optimizer_cls", optimizer),
                ("scheduler_cls", self.schedulers.get(name)),
            ):
                recorded = config.get(kind)
                other = isinstance(recorded, str) and live is not None
                if other and _names_other_class(str(recorded), type(live)):
                    raise CheckpointMismatchError(
                        f"{where}: {kind.split('_')[0]} {name!r} was saved as {recorded}, "
                        f"this strategy's is {trust.dotted_path(type(live))}; {fix}"
                    )
        if sorted(set(saved_schedulers)) != sorted(self.schedulers):
            raise CheckpointMismatchError(
                f"{where}: the checkpoint has schedulers {sorted(set(saved_schedulers))}, this "
                f"strategy has {sorted(self.schedulers)} (a scheduler left out would stop "
                f"moving the learning rate, one added would start over); {fix}"
            )

    def _apply_runtime(self, runtime: _Runtime, reader: codec.IndexReader) -> None:
        """Apply a checkpoint's run state: the scheduler and hook states strategy.json and
        hooks.json hold (all or nothing), then the counters and RNG."""
        self._load_refusable_states([], runtime, reader)
        self._set_counters_and_rng(runtime)

    def _load_refusable_states(
        self,
        components: Sequence[tuple[str, Any, str]],
        runtime: _Runtime,
        reader: codec.IndexReader,
    ) -> None:
        """Load the scheduler states of ``components`` (name, state, file), then those
        ``runtime`` holds, then the hooks' states: what a live object may still refuse (a
        hook configured otherwise, an edited scheduler record), so loaded before anything
        else. All or nothing: on a refusal, the schedulers and hooks already loaded get back
        the states they had (their ``state_dict()`` taken before)."""
        where = f"{reader.directory}/strategy.json"
        previous: list[tuple[Any, Any]] = []
        try:
            for name, state, source in components:
                scheduler = self.schedulers[name]
                previous.append((scheduler, scheduler.state_dict()))
                codec.load_scheduler_state(scheduler, state, source)
            for name, state in runtime.schedulers.items():
                if name in self.schedulers:
                    scheduler = self.schedulers[name]
                    previous.append((scheduler, scheduler.state_dict()))
                    with _malformed(where, f"runtime.schedulers.{name}"):
                        codec.load_scheduler_state(
                            scheduler, state, f"{where}: field 'runtime.schedulers.{name}'"
                        )
            previous.extend(
                (hook, hook.state_dict())
                for hook in self.hooks
                if isinstance(hook, CheckpointableHook)
            )
            _restore_hook_states(self.hooks, runtime.hooks, f"{reader.directory}/hooks.json")
        except BaseException:
            for item, state in reversed(previous):
                with contextlib.suppress(Exception):
                    item.load_state_dict(state)
            raise

    def _set_counters_and_rng(self, runtime: _Runtime) -> None:
        """Set the counters, the RNGs and the data position ``runtime`` holds (checked)."""
        for name, value in runtime.counters.items():
            setattr(self, name, value)
        own = _own_rng(runtime)
        _set_rng_state(own["rng"])
        self._epoch_start_rng = own["epoch_start_rng"]
        self._epoch_start_loader_rng = own["epoch_start_loader_rng"]
        self._epoch_loader = runtime.epoch_loader
        self._resume_workers_kept = runtime.workers_kept
        self._resume_loader_pending = True
        self._resume_loader_rng = own.get("loader_rng")
        self._loader_rng_after_run = list(own.get("loader_rng") or [])  # a save before run

    @classmethod
    def load_checkpoint(
        cls,
        root: str | Path,
        checkpoint_index: int = -1,
        map_location: str | torch.device | None = None,
        *,
        hooks: Sequence[Any] | None = None,
        training_fn: Callable[..., Any] | None = None,
        validators: Any = None,
        trusted: Trusted = None,
        parallelize: Callable[[torch.nn.Module], torch.nn.Module] | None = None,
        storage_options: Mapping[str, Any] | None = None,
        fallback_dirs: Sequence[str | os.PathLike[str]] | None = None,
        per_rank: bool = False,
    ) -> TrainingStrategy:
        """Rebuild a strategy from a checkpoint: models from their specs, optimizers and
        schedulers from the recipe, then every piece of state.

        Args:
            training_fn: always wins; otherwise the recorded dotted path is used (it must be
                registered or listed in ``trusted``).
            hooks: the resumed run's hooks (checkpointable ones get their saved state). None
                (default): the run's recorded ``CheckpointHook``/``EMAHook`` are rebuilt from
                their configuration, with their state, so that the resumed run keeps
                checkpointing; a recorded hook that cannot be rebuilt (a function, a class of
                yours) is named in a warning. ``[]``: no hooks.
            parallelize: for a checkpoint of FSDP2-sharded models, ``fn(model) -> model``
                applied to each rebuilt model before its optimizer is built (e.g. your
                ``fully_shard`` calls on the current mesh); the shards are then loaded and
                resharded to the current world size (collective: every rank calls this).
                Without it, such a checkpoint loads into unsharded models.
            storage_options: object-store client options for an ``s3://`` root (endpoint_url,
                region, access_key_id, ... as for :func:`fastckpt.configure_storage`), over the AWS
                environment; registered for its prefix (as ``configure_storage``) and kept in
                effect for it. A local path refuses them (``StorageOptionsError``).
            fallback_dirs: other tiers holding copies of ``root``'s indices (the durable
                roots it is promoted to, docs/tiers.md): the run resumes from the newest
                index that verifies on any tier, from ``root`` when it holds it intact (a new
                node without the fast tier, or a damaged newest copy, falls back). The
                returned strategy's ``restored_from``
                (:class:`~fastckpt.container.promote.NearestCopy`) says which copy was used
                and what was skipped; logged, as a warning when anything was. With
                ``parallelize`` under a process group, rank 0 picks the copy for every rank
                (each rank passes its tiers in the same order; its ``root`` may be its own
                node's disk).
            per_rank: this rank loads alone, deciding its copy alone (evaluation on rank 0
                only; independent runs of a sweep, one per rank, sharing a process group).
                Without it (the default), under a process group of more than one rank (a
                DDP run: unsharded replicas), the load is collective (every rank calls it,
                with ``fallback_dirs`` on every rank or on none): every rank loads the same
                index, the newest that every rank holds intact on one of its tiers (without
                ``fallback_dirs``: the newest ``root`` lists; ``checkpoint_index``: that
                index, never another), each rank from its nearest tier holding it; a rank's
                newer index passed over for that is named in ``restored_from.skipped`` (and
                the warning). Not with ``parallelize`` (a sharded load is collective).

        Raises:
            ValueError: a component-only checkpoint (use ``fastckpt.load_checkpoint``), the
                training function must be supplied, or ``parallelize`` was given for a
                checkpoint of unsharded models.
            TypeError: ``per_rank`` is not a bool.
            InvalidInputError: ``per_rank=True`` with ``parallelize``; or, collective, some
                ranks gave ``fallback_dirs`` and others did not (on every rank alike).
            NotCommittedError: with ``fallback_dirs``, no tier holds an intact copy; on
                several ranks, raised on every rank alike, naming each rank that holds none
                (of the index every rank needs).
            RuntimeError: collective, the agreement with the other ranks failed (a rank
                that never called the load: the process group's timeout), saying what the
                load needs of every rank and that ``per_rank=True`` loads alone.
        """
        call = "TrainingStrategy.load_checkpoint"
        _check_load_per_rank(per_rank, parallelize, call)
        use_storage_options(root, storage_options, call)
        fallback_dirs = checked_paths(fallback_dirs, "fallback_dirs", call)  # a str, say
        trusted = trust.frozen_trusted(trusted)
        requested = checked_index(checkpoint_index, "checkpoint_index", codec.LOAD_INDEX)
        several = _world()[1] > 1
        replicas = several and parallelize is None and not per_rank  # one index for all
        if fallback_dirs or replicas:
            tiers = [root, *(fallback_dirs or ())]
            wanted = None if requested in (None, -1) else requested
            collective = (parallelize is not None and several) or replicas
            for tries_left in reversed(range(_CHOOSE_ATTEMPTS)):
                if parallelize is not None and several:
                    copy = _agreed_copy(tiers, wanted)  # a collective load: one copy for all
                elif replicas:
                    copy = _common_copy(tiers, wanted, fallback=bool(fallback_dirs), call=call)
                else:
                    copy = nearest_intact(tiers, wanted)
                (_LOG.warning if copy.skipped else _LOG.info)("%s", copy.describe())
                failure: BaseException | None = None
                try:
                    with contextlib.ExitStack() as stack:
                        spread = None
                        if copy.node_local:  # rank 0's node: the index; every node: shards
                            index_of = sharded_training.node_local_index(copy.root, copy.index)
                            spread = stack.enter_context(index_of)
                        resumed = cls._load_from(
                            copy.root if spread is None else spread.root,
                            copy.index,
                            map_location,
                            hooks,
                            training_fn,
                            validators,
                            trusted,
                            parallelize,
                            spread,
                            tiers,
                        )
                except IndexNotCommittedError as err:
                    # The newest copy, pruned by a live writer before it was read: choose
                    # again (one process alone; collective choices are agreed once).
                    retry = not collective and wanted is None and tries_left > 0
                    if retry and not still_committed(copy.root, copy.index):
                        continue
                    if not replicas:
                        raise
                    failure = err
                except BaseException as err:  # told to every replica, so that none trains alone
                    if not replicas:
                        raise
                    failure = err
                if replicas:
                    _every_replica_loaded(failure, call)
                resumed.restored_from = copy
                return resumed
        return cls._load_from(
            root,
            checkpoint_index,
            map_location,
            hooks,
            training_fn,
            validators,
            trusted,
            parallelize,
        )

    @classmethod
    def _load_from(
        cls,
        root: str | Path,
        checkpoint_index: int,
        map_location: str | torch.device | None,
        hooks: Sequence[Any] | None,
        training_fn: Callable[..., Any] | None,
        validators: Any,
        trusted: Trusted,
        parallelize: Callable[[torch.nn.Module], torch.nn.Module] | None,
        spread: sharded_training.NodeLocalIndex | None = None,
        named: Sequence[str | Path] | None = None,
    ) -> TrainingStrategy:
        """:meth:`load_checkpoint` of one root (``spread``: a sharded index spread over
        node-local fast tiers, see :func:`~fastckpt.training.sharded.node_local_index`;
        ``root`` is then where this rank reads the index's own files). ``named``: the roots the
        caller passed (default: ``root``), where a rebuilt hook saves
        (:func:`~fastckpt.training.hooks.rebuild.rebuild_hooks`)."""
        named = [root] if named is None else named

        def attempt() -> tuple[
            int, dict[str, Any], list[dict[str, Any]] | None, str, TrainingStrategy | None
        ]:
            # The recipe and (for a sharded index) the recorded hooks, or the whole strategy
            # of an unsharded index, from one snapshot: a save replacing the index meanwhile
            # makes it all read again (as fastckpt.load_checkpoint).
            _, index, reader, recipe = _index_snapshot(root, checkpoint_index, False)
            where = f"{reader.directory}/hooks.json"
            configs = None
            if recipe.get("sharded") is not None:
                if hooks is None:
                    configs = parse_hook_configs(reader.json("hooks.json"), where)
                return index, recipe, configs, where, None
            if parallelize is not None:
                raise ValueError(
                    f"index {index} of {root} holds unsharded models; parallelize= applies to "
                    "checkpoints of FSDP2-sharded models (load, then wrap the models yourself)"
                )
            result = codec.load_components(
                root, index, map_location, validators=validators, trusted=trusted
            )
            strategy = cls.from_loaded(  # require_training_fn=True: raises, never None
                result["models"],
                result["reader"],
                hooks=hooks,
                training_fn=training_fn,
                trusted=trusted,
                map_location=map_location,
                named_roots=named,
            )
            return index, recipe, configs, where, strategy

        index, recipe, configs, where, loaded = read_consistently(
            Path(root) / MANIFEST, attempt, lock_root=Path(root)
        )
        if loaded is not None:
            return loaded
        if recipe.get("sharded") is not None:
            if hooks is None:  # configs were read (None: not recorded by an earlier version)
                hooks = rebuild_hooks(configs, where, named)
            return cls._load_sharded(
                Path(root),
                index,
                recipe,
                map_location,
                hooks,
                training_fn,
                validators,
                trusted,
                parallelize,
                spread,
            )
        raise AssertionError("unreachable: an unsharded index was loaded by attempt()")

    @classmethod
    def resume_or_start(
        cls,
        root: str | Path,
        start: Callable[[], TrainingStrategy],
        *,
        per_rank: bool = False,
        **load: Any,
    ) -> TrainingStrategy:
        """The one call of a restartable training script: the strategy resumed from
        ``root``'s newest committed index (:meth:`load_checkpoint` with ``load``'s keyword
        arguments; its recorded hooks rebuilt unless ``hooks=`` is given) when there is one,
        else ``start()``, your fresh strategy (whose ``CheckpointHook`` saves into ``root``).

        With ``fallback_dirs`` (the durable tiers) the run resumes when any tier holds a
        committed index (a new node's empty fast root does not start the run afresh). Under
        a process group of more than one rank this is collective (every rank calls it, with
        ``fallback_dirs`` on every rank or on none): rank 0 decides for every rank whether
        to resume (on a node-local root only rank 0's node holds the manifest; a rank
        starting afresh beside resumed ones would train another state), and the load is
        collective too (see :meth:`load_checkpoint`): a rank whose tiers hold no copy of the
        index every rank loads makes every rank raise, and so does a copy one rank finds
        damaged as it reads it. ``per_rank=True``: this rank decides and
        loads alone (independent runs of a sweep, one per rank, sharing a process group).

        Raises:
            CheckpointFormatError / ChecksumMismatchError: a tier's manifest is damaged
                (never taken for "no checkpoint": a fresh start would bury the old run).
            NotCommittedError: rank 0 resumes and a rank holds no copy of the index every
                rank loads (every rank raises it, naming that rank).
            TypeError / InvalidInputError / RuntimeError: as :meth:`load_checkpoint`'s.
        """
        call = "TrainingStrategy.resume_or_start"
        _check_load_per_rank(per_rank, load.get("parallelize"), call)
        use_storage_options(root, load.pop("storage_options", None), call)
        # Checked once, as a list (an iterator given would be used up by the check).
        load["fallback_dirs"] = checked_paths(load.get("fallback_dirs"), "fallback_dirs", call)
        fallback = tuple(load["fallback_dirs"])
        tiers = [root, *fallback]
        if _world()[1] > 1 and not per_rank:  # one decision for every rank (see above)
            fresh = _rank_0_decides(
                lambda: _no_checkpoint(tiers), fallback=bool(fallback), call=call
            )
        else:
            fresh = _no_checkpoint(tiers)
        if fresh:
            return start()
        return cls.load_checkpoint(root, per_rank=per_rank, **load)

    @classmethod
    def _load_sharded(
        cls,
        root: Path,
        index: int,
        recipe: Mapping[str, Any],
        map_location: str | torch.device | None,
        hooks: Sequence[Any] | None,
        training_fn: Callable[..., Any] | None,
        validators: Any,
        trusted: Trusted,
        parallelize: Callable[[torch.nn.Module], torch.nn.Module] | None,
        spread: sharded_training.NodeLocalIndex | None = None,
    ) -> TrainingStrategy:
        sharded = recipe["sharded"]
        if not isinstance(sharded, Mapping) or not isinstance(sharded.get("models"), Mapping):
            raise CheckpointFormatError(f"{root}/{index}/strategy.json: bad 'sharded' record")
        # The dtypes the part holds each model's tensors in: a model converted after
        # construction (.to(torch.bfloat16)) is rebuilt in them, not in its constructor's.
        part = sharded_training.committed_part(
            root if spread is None else spread.part_root,
            index,
            sharded,
            f"{root}/{index}/strategy.json",
        )
        dtypes = sharded_training.saved_dtypes(
            part, sharded["models"], None if spread is None else spread.record
        )
        models: dict[str, torch.nn.Module] = {}
        for name, document in sharded["models"].items():
            where = f"{root}/{index}/strategy.json: model {name!r}"
            spec = specs.BaseSpec.from_json(document, source=where)
            model = build.build_model(
                spec, device=map_location, trusted=trusted, where=where, dtypes=dtypes[name]
            )
            frozen = sharded.get("frozen") or {}
            if not isinstance(frozen, Mapping):
                raise CheckpointFormatError(
                    f"{root}/{index}/strategy.json: field 'sharded.frozen' must be an object"
                )
            codec.freeze(
                model, frozen.get(name), f"{root}/{index}/strategy.json: sharded.frozen.{name}"
            )
            if parallelize is not None:
                model = parallelize(model)
                if not isinstance(model, torch.nn.Module):
                    raise TypeError(f"parallelize must return the nn.Module, got {type(model)}")
            models[name] = model
        fn = training_fn
        if fn is None:
            fn = _recorded_training_fn(recipe, trusted, models.values())
        strategy = cls.__new__(cls)
        TrainingStrategy.__init__(
            strategy,
            models,
            None,
            fn,
            hooks or (),
            recipe.get("num_steps"),
            recipe.get("num_epochs"),
        )
        for name, data in dict(recipe.get("optimizer_configs") or {}).items():
            if name not in models:
                raise CheckpointFormatError(f"{root}/{index}: optimizer for unknown model {name!r}")
            config = OptimizerConfig.from_json(data)
            groups = _param_groups(models[name], sharded, name, f"{root}/{index}/strategy.json")
            optimizer, scheduler = config.build(groups, trusted)
            strategy.optimizers[name] = optimizer
            strategy.optimizer_configs[name] = config
            if scheduler is not None:
                strategy.schedulers[name] = scheduler
        strategy._restore_sharded(root, index, validators, spread, rebuilt=True)
        return strategy

    @classmethod
    def from_loaded(
        cls,
        models: Mapping[str, Mapping[str, Any]],
        reader: codec.IndexReader,
        *,
        hooks: Sequence[Any] | None = None,
        training_fn: Callable[..., Any] | None = None,
        trusted: Trusted = None,
        map_location: str | torch.device | None = None,
        require_training_fn: bool = True,
        named_roots: Sequence[str | os.PathLike[str]] | None = None,
    ) -> TrainingStrategy | None:
        """Assemble a strategy from components already rebuilt by ``fastckpt.load_checkpoint``
        (its ``models`` result) and the recipe, counters, RNG and hook states in ``reader``.

        A rebuilt ``CheckpointHook`` (``hooks=None``) saves where ``named_roots`` say (the
        roots the caller passed, ``root`` then ``fallback_dirs``; default: ``reader``'s root),
        see :func:`~fastckpt.training.hooks.rebuild.rebuild_hooks`.

        Returns None instead of raising when ``require_training_fn`` is False and the training
        function is neither supplied nor recorded and trusted.
        """
        recipe = _read_recipe(reader)
        trusted = trust.frozen_trusted(trusted)
        fn = training_fn
        if fn is None:
            try:
                fn = _recorded_training_fn(
                    recipe, trusted, [record["model"] for record in models.values()]
                )
            except (ValueError, UntrustedTargetError):
                if require_training_fn:
                    raise
                return None
        where = f"{reader.directory}/strategy.json"
        limits = {name: _run_limit(recipe, name, where) for name in ("num_steps", "num_epochs")}
        configs: dict[str, OptimizerConfig] = {}
        optimizer_configs = recipe.get("optimizer_configs") or {}
        if not isinstance(optimizer_configs, Mapping):
            raise CheckpointFormatError(f"{where}: field 'optimizer_configs' must be an object")
        for name, data in optimizer_configs.items():
            with _malformed(where, f"optimizer_configs.{name}"):
                configs[name] = OptimizerConfig.from_json(data)
        runtime = _parse_runtime(reader, recipe)
        if hooks is None:
            hooks = rebuild_hooks(
                runtime.hook_configs,
                f"{reader.directory}/hooks.json",
                [reader.root] if named_roots is None else named_roots,
            )
        live_models = {name: record["model"] for name, record in models.items()}
        strategy = cls.__new__(cls)
        TrainingStrategy.__init__(
            strategy,
            live_models,
            None,
            fn,
            hooks,
            limits["num_steps"],
            limits["num_epochs"],
            map_location,
        )
        for record in models.values():
            for opt_name, item in record["optimizers"].items():
                strategy.optimizers[opt_name] = item["optimizer"]
            for sched_name, item in record["schedulers"].items():
                strategy.schedulers[sched_name] = item["scheduler"]
        _check_configs_match(configs, strategy.optimizers, strategy.schedulers, where)
        strategy.optimizer_configs.update(configs)
        strategy._apply_runtime(runtime, reader)
        return strategy


def _recorded_training_fn(
    recipe: Mapping[str, Any], trusted: Trusted, models: Iterable[torch.nn.Module]
) -> Any:
    """The training function a recipe names (see
    :func:`fastckpt.checkpoint.trust.resolve_training_fn`).

    ``models`` are the models the checkpoint rebuilt: a function in the same top-level package
    as one of their classes may be restored even when that package is installed.
    """
    path = recipe.get("training_fn")
    if path == MUST_BE_SUPPLIED or not isinstance(path, str):
        raise ValueError(
            "this checkpoint's training function was not importable (a lambda, closure or "
            "local function), so it must be supplied: pass training_fn=... to load_checkpoint"
        )
    return trust.resolve_training_fn(path, trusted, models=models)


def _index_snapshot(
    root: str | Path, checkpoint_index: int, recipe_required: bool
) -> tuple[Manifest, int, codec.IndexReader, dict[str, Any]]:
    """The manifest, the resolved index, its reader and its recipe (``{}`` when it has none
    and ``recipe_required`` is False): one attempt of a read under
    :func:`fastckpt.container.snapshot.read_consistently` (raises when a save raced it)."""
    requested = checked_index(checkpoint_index, "checkpoint_index", codec.LOAD_INDEX)
    manifest = Manifest.load(root)
    index = manifest.resolve(-1 if requested is None else requested)
    reader = codec.IndexReader(manifest, index)
    if not recipe_required and "strategy.json" not in reader.files:
        return manifest, index, reader, {}
    return manifest, index, reader, _read_recipe(reader)


def _group_names(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> list[list[str]] | None:
    """The parameter names of each of ``optimizer``'s groups (None when a parameter is not
    one of ``model``'s: nothing is recorded, the rebuild makes one group)."""
    names: dict[int, str] = {}
    for name, parameter in codec.canonical_parameters(model).items():
        names.setdefault(id(parameter), name)
    groups = [[names.get(id(p), "") for p in group["params"]] for group in optimizer.param_groups]
    return None if any("" in group for group in groups) else groups


def _param_groups(model: torch.nn.Module, sharded: Mapping[str, Any], name: str, where: str) -> Any:
    """What the rebuilt optimizer of model ``name`` is made over: the parameter groups the
    sharded record (of ``where``) lists, as ``[{"params": [...]}, ...]`` (their settings are
    restored with the optimizer state), or all the model's parameters when it lists none (a
    checkpoint of an earlier fastckpt, or an optimizer over other parameters).

    Raises:
        CheckpointFormatError: the record is malformed or names a parameter the model lacks.
    """
    recorded = (sharded.get("param_groups") or {}).get(name)
    if recorded is None:
        return model.parameters()
    field_path = f"sharded.param_groups.{name}"
    if not isinstance(recorded, list) or not all(
        isinstance(group, list) and all(isinstance(n, str) for n in group) for group in recorded
    ):
        raise CheckpointFormatError(f"{where}: field {field_path!r} must be a list of name lists")
    parameters = codec.canonical_parameters(model)
    unknown = sorted({n for group in recorded for n in group} - set(parameters))
    if unknown:
        raise CheckpointFormatError(
            f"{where}: field {field_path!r} names {unknown}, which model {name!r} does not have"
        )
    return [{"params": [parameters[n] for n in group]} for group in recorded]


def _refuse_sharded_hook_state(
    hook_states: list[dict[str, Any]], tensors: Mapping[str, torch.Tensor]
) -> None:
    """Refuse hook state holding DTensors (an ``EMAHook`` over an FSDP2 model): hook states
    are written whole by rank 0, and a DTensor is one rank's shard of the tensor.

    Raises:
        UnsupportedValueError: names the hook and the tensor.
    """
    from torch.distributed.tensor import DTensor  # deferred: torch.distributed is heavy

    for name, tensor in tensors.items():
        if isinstance(tensor, DTensor):
            hook = hook_states[int(name.split(".", 1)[0])]["class"]
            raise UnsupportedValueError(
                f"hook {hook}: its state tensor {name.split('.', 2)[-1]!r} is a DTensor (one "
                "rank's shard of an FSDP2 model's tensor), which a strategy checkpoint cannot "
                "save whole; keep the hook's state in plain tensors (e.g. full_tensor() on the "
                "ranks that need it), or leave the hook out of FSDP2 runs"
            )


def _read_recipe(reader: codec.IndexReader) -> dict[str, Any]:
    if "strategy.json" not in reader.files:
        raise ValueError(
            f"{reader.directory} is a component-only checkpoint (no strategy recipe); load it "
            "with fastckpt.load_checkpoint instead"
        )
    recipe = reader.json("strategy.json")
    if not isinstance(recipe, dict):
        raise CheckpointFormatError(f"{reader.directory}/strategy.json must be an object")
    return recipe


#: What a field of a hostile strategy.json / hooks.json makes the parsing code raise.
_MALFORMED = (AttributeError, KeyError, TypeError, ValueError, IndexError, OverflowError)


@contextlib.contextmanager
def _malformed(where: str, field_path: str) -> Iterator[None]:
    """Re-raise what a malformed field makes the code in the block raise as a
    :class:`CheckpointFormatError` naming the file (``where``) and the field."""
    try:
        yield
    except CheckpointFormatError as err:
        if where in str(err):
            raise
        raise CheckpointFormatError(f"{where}: field {field_path!r}: {err}") from err
    except (UntrustedTargetError, CheckpointMismatchError):
        raise
    except (*_MALFORMED, RuntimeError) as err:
        raise CheckpointFormatError(
            f"{where}: field {field_path!r} is malformed ({type(err).__name__}: {err}); the "
            "checkpoint was edited or is damaged"
        ) from err


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _run_limit(recipe: Mapping[str, Any], name: str, where: str) -> int | None:
    """``num_steps`` / ``num_epochs`` of a recipe: None or an int >= 0."""
    value = recipe.get(name)
    if value is not None and not _is_count(value):
        raise CheckpointFormatError(
            f"{where}: field {name!r} must be null or an integer >= 0, got {value!r}"
        )
    return value


def _check_configs_match(
    configs: Mapping[str, OptimizerConfig],
    optimizers: Mapping[str, Any],
    schedulers: Mapping[str, Any],
    where: str,
) -> None:
    """Warn when a run's recorded optimizer recipe (``strategy.json``) names another class
    than the optimizer or scheduler the checkpoint rebuilt (their own files): an edited
    recipe, or an optimizer swapped by hand during the run (``strategy.optimizers[...] =``,
    which saves fine). The recipe is kept (it is recorded again by the next save and builds
    a fine-tuning run's optimizer with ``use_original_opt_class``); the warning names both.
    """
    for name, config in configs.items():
        pairs: list[tuple[str, Any, Any]] = [
            ("optimizer_cls", config.optimizer_cls, optimizers.get(name)),
            ("scheduler_cls", config.scheduler_cls, schedulers.get(name)),
        ]
        for key, recorded, live in pairs:
            if live is None or not isinstance(recorded, str):
                continue
            if _names_other_class(recorded, type(live)):
                warnings.warn(
                    f"{where}: field 'optimizer_configs.{name}.{key}' names {recorded}, but "
                    f"the checkpoint's {name!r} is a {trust.dotted_path(type(live))} (swapped "
                    "by hand during the run, or the file was edited): the run goes on with the "
                    f"{trust.dotted_path(type(live))}; the recipe, kept, builds a fine-tuning "
                    f"run's optimizer (set strategy.optimizer_configs[{name!r}] to change it)",
                    UserWarning,
                    stacklevel=4,
                )


def _names_other_class(recorded: str, live: type) -> bool:
    """Whether the dotted path ``recorded`` (as a recipe holds it: ``torch.optim.Adam`` or
    ``torch.optim.adam.Adam``, as the user spelled it) names a class other than ``live``.
    Resolved through modules already imported, never importing (``live``'s own module and
    packages are, so every spelling of it resolves); a path that cannot be resolved so names
    another class unless its last part is ``live``'s name."""
    if recorded == trust.dotted_path(live):
        return False
    parts = recorded.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        target: Any = sys.modules.get(".".join(parts[:cut]))
        if target is None:
            continue
        for attribute in parts[cut:]:
            target = getattr(target, attribute, None)
        if target is not None:
            return target is not live
        break
    return parts[-1] != live.__qualname__.rsplit(".", 1)[-1]


def _check_param_groups(optimizer: torch.optim.Optimizer, state: Any, where: str) -> None:
    """Check the saved optimizer state ``state`` (of file ``where``.json) against
    ``optimizer`` before the models are loaded, so that a mismatch changes nothing: its
    parameter groups must be well-formed, then
    :func:`~fastckpt.manager.stateful.check_optimizer_state` (the groups' layout, which
    ``load_state_dict`` checks first, and the saved state's fit to the live parameters, which
    it does not check).

    Raises:
        CheckpointFormatError: malformed parameter groups, naming the file.
        CheckpointMismatchError: naming the optimizer's file, the state path and both sides.
    """
    groups = state.get("param_groups") if isinstance(state, Mapping) else None
    if not isinstance(groups, list) or not all(
        isinstance(g, Mapping) and isinstance(g.get("params"), list) for g in groups
    ):
        raise CheckpointFormatError(f"{where}.json: field 'state.param_groups' is malformed")
    check_optimizer_state(optimizer, state, "", source=f"{where}.json")


@dataclass
class _Runtime:
    """The run state of a strategy checkpoint (counters, RNG, data position, scheduler and
    hook states), parsed and checked before any of it is applied."""

    counters: dict[str, int]
    rng: dict[str, Any]
    #: every CPU RNG as the epoch began (a torch state tensor: saved by an earlier fastckpt)
    epoch_start_rng: dict[str, Any] | torch.Tensor | None
    #: the loader's own generators' states at the epoch's start (None: none recorded)
    epoch_start_loader_rng: list[torch.Tensor] | None
    #: their states when the checkpoint was taken (None: saved by an earlier fastckpt)
    loader_rng: list[torch.Tensor] | None
    #: the settings of the loader the epoch position counts batches of (None: at an epoch's
    #: end, or saved by an earlier fastckpt)
    epoch_loader: dict[str, Any] | None
    #: every rank's RNG states, when they differed at the save (see _gather_rank_rng)
    rank_rng: list[dict[str, Any]] | None
    schedulers: dict[str, Any]
    hooks: list[dict[str, Any]]
    #: the run's hooks as recorded (see fastckpt.training.hooks.rebuild; None: not recorded,
    #: by an earlier fastckpt)
    hook_configs: list[dict[str, Any]] | None
    #: whether the epoch a resume starts or replays had its loader's persistent workers
    #: running as it began (see TrainingStrategy._iterate; None: saved by an earlier fastckpt)
    workers_kept: bool | None = None


@dataclass
class _Restore:
    """What :meth:`TrainingStrategy.restore_checkpoint` applies, read, verified and checked
    against the live strategy before any of it is."""

    reader: codec.IndexReader
    #: model name -> its saved tensors (views of the verified files)
    weights: dict[str, dict[str, torch.Tensor]]
    #: optimizer / scheduler name -> its saved ``state_dict()``
    optimizers: dict[str, Any]
    schedulers: dict[str, Any]
    runtime: _Runtime
    #: the entry's record of frozen parameters
    frozen: Mapping[str, Any]


def _check_model_fits(name: str, model: torch.nn.Module, reader: codec.IndexReader) -> None:
    """Refuse restoring model ``name``'s file of ``reader``'s index into ``model`` when their
    keys or shapes differ, from the file's header (and its references), before any tensor
    data is read: torch's ``load_state_dict`` copies every tensor that fits before it raises,
    which left the live model half overwritten. Dtypes may differ (the restore casts to the
    live model's, as ``load_state_dict``); torch's own exceptions are kept: a lazy (not yet
    materialized) parameter takes any shape, ``_extra_state`` any value, a 0-d tensor a 1-d
    one, batch norm's ``num_batches_tracked`` may be missing. A model whose loading is its
    own (:func:`~fastckpt.checkpoint.fill.loads_as_given` False: a load hook or an overridden
    loader may rename keys or reshape values, reading an older layout after a refactor) is
    left to its ``load_state_dict``, as torch does.

    Raises:
        CheckpointMismatchError: naming the file, the model, the keys and both shapes.
        ChecksumMismatchError / CheckpointFormatError: the file differs from its record (a
            damaged header is not taken for a model of another shape).
    """
    if not loads_as_given(model):
        return
    relpath = f"models/{name}.safetensors"
    where = f"{reader.directory}/{relpath}"
    entries = dict(reader.header(relpath))
    if REFS_FILE in reader.files:
        entries.update(reader.references.get(relpath) or {})
    saved = {
        key: torch_shape(f"{where}: tensor {key!r}", entry["dtype"], list(entry["shape"]))
        for key, entry in entries.items()
    }
    live = model.state_dict()
    optional = {  # torch supplies it when a state lacks it
        f"{path}.num_batches_tracked" if path else "num_batches_tracked"
        for path, module in model.named_modules()
        if isinstance(module, torch.nn.modules.batchnorm._NormBase)
    }
    problems = [
        repr(key) + " is in this model, not in the checkpoint"
        for key in live
        if key not in saved and key not in optional
    ]
    problems += [
        repr(key) + " is in the checkpoint, not in this model" for key in saved if key not in live
    ]
    for key, tensor in live.items():
        if (
            key not in saved
            or key.endswith("_extra_state")
            or not isinstance(tensor, torch.Tensor)
            or torch.nn.parameter.is_lazy(tensor)
        ):
            continue
        shape = list(tensor.shape)
        if shape != saved[key] and not (shape == [] and len(saved[key]) == 1):
            problems.append(f"{key!r} is saved with shape {saved[key]}, this model's is {shape}")
    if problems:
        reader.tensors(relpath, owned=False)  # a damaged header is damage, not a mismatch
        raise CheckpointMismatchError(
            f"{where}: model {name!r} does not fit the checkpoint ({len(problems)} "
            f"differences): {shown_names(problems)}; build the model as the checkpoint was "
            "saved, or load it whole with TrainingStrategy.load_checkpoint"
        )


def _check_frozen(models: Mapping[str, torch.nn.Module], frozen: Any, where: str) -> None:
    """Before a restore changes anything live: the recorded frozen parameters (``frozen``,
    model name -> parameter names) are a mapping naming parameters of ``models``.

    Raises:
        CheckpointFormatError: naming ``where`` and what is wrong.
    """
    if not isinstance(frozen, Mapping):
        raise CheckpointFormatError(f"{where}: must be an object")
    for name, model in models.items():
        target = codec.unwrap_model(model, sharded_ok=True)
        codec.frozen_record(target, frozen.get(name), f"{where}.{name}")


def _refreeze(models: Mapping[str, torch.nn.Module], frozen: Mapping[str, Any], where: str) -> None:
    """A restore into live models trains what the saved run trained: the parameters it had
    frozen (``frozen``, checked by :func:`_check_frozen`) are frozen again (before, only
    ``load_checkpoint``'s rebuilt models were, and a restored run trained a layer the saved
    run had frozen mid-run). A parameter frozen here that the saved run trained is left
    frozen, with a warning (frozen on purpose before the restore, or the run differs)."""
    for name, model in models.items():
        target = codec.unwrap_model(model, sharded_ok=True)
        recorded = set(codec.frozen_record(target, frozen.get(name), f"{where}.{name}"))
        codec.freeze(target, sorted(recorded), f"{where}.{name}")
        extra = sorted(set(codec.frozen_names(target)) - recorded)
        if extra:
            warnings.warn(
                f"model {name!r}: parameters {extra[:5]}{' ...' if len(extra) > 5 else ''} "
                "are frozen here but not recorded as frozen by the checkpoint (trained by the "
                "saved run, or saved by a fastckpt that did not record frozen parameters); "
                "they stay frozen (requires_grad_(True) them to continue the run as it was)",
                stacklevel=3,
            )


def _check_rng_state(state: Any) -> None:
    """Apply an RNG state to scratch generators: whatever they refuse, the process's own
    generators would refuse half-way."""
    if not isinstance(state, Mapping):
        raise TypeError(f"must be an object, got {type(state).__name__}")
    version, internal, gauss = state["python"]
    random.Random().setstate((version, tuple(int(x) for x in internal.tolist()), gauss))
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = state["numpy"]
    np.random.RandomState().set_state(
        (np_name, np_keys.numpy().astype(np.uint32), np_pos, np_has_gauss, np_gauss)
    )
    _check_torch_rng(state["torch"])
    if "cuda" in state:
        if not isinstance(state["cuda"], (list, tuple)):
            raise TypeError(f"'cuda' must be a list, got {type(state['cuda']).__name__}")
        for device_state in state["cuda"]:
            _check_cuda_rng(device_state)


def _refuse_a_scheduler_needing_a_metric(scheduler: Any) -> None:
    """The strategy steps a scheduler after every optimizer step with no argument: one whose
    ``step`` needs one (``ReduceLROnPlateau``'s metric) is refused when it is built."""
    try:
        parameters = inspect.signature(scheduler.step).parameters.values()
    except (TypeError, ValueError):
        return
    required = [
        p.name
        for p in parameters
        if p.default is inspect.Parameter.empty
        and p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    if required:
        raise TypeError(
            f"{type(scheduler).__name__}.step() needs {', '.join(required)}, and a "
            "TrainingStrategy steps its schedulers after each optimizer step without one; "
            "leave it out of OptimizerConfig and step it yourself in a hook (e.g. at "
            "AFTER_EPOCH with your validation loss)"
        )


def _set_loader_generators(
    loader: Any, saved: list[torch.Tensor] | None, what: str, *, stacklevel: int
) -> None:
    """Give the loader's own generators (see :func:`_loader_generators`) the recorded states
    ``saved``; a warning saying the checkpoint holds ``what`` of none or of other generators
    (a checkpoint of an earlier fastckpt, another loader setup)."""
    generators = _loader_generators(loader)
    if saved is not None and len(saved) == len(generators):
        for generator, state in zip(generators, saved, strict=True):
            generator.set_state(state)
        return
    if generators or saved:
        warnings.warn(
            f"the training loader has {len(generators)} generator(s) of its own "
            f"(DataLoader(generator=...), its sampler's), the checkpoint holds {what} of "
            f"{'none' if saved is None else len(saved)}: the resumed run may not read the data "
            "in the saved run's order (resume with the same loader setup; a checkpoint saved "
            "by this fastckpt records them)",
            stacklevel=stacklevel,
        )


def _loader_states(loader: Any) -> list[torch.Tensor]:
    """The states of the loader's own generators (see :func:`_loader_generators`) now."""
    return [generator.get_state() for generator in _loader_generators(loader)]


def _loader_generators(loader: Any) -> list[torch.Generator]:
    """The CPU generators a training loader draws its order from besides torch's global one:
    ``DataLoader(generator=...)`` (worker seeds; a ``RandomSampler`` it makes shuffles with
    it too), its sampler's, its batch sampler's sampler's; each once, in that order."""
    found: list[torch.Generator] = []
    sampler = getattr(loader, "sampler", None)
    inner = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
    for owner in (loader, sampler, inner):
        generator = getattr(owner, "generator", None)
        if (
            isinstance(generator, torch.Generator)
            and generator.device.type == "cpu"
            and all(generator is not seen for seen in found)
        ):
            found.append(generator)
    return found


#: The loader settings a checkpoint records with its epoch position (see
#: :func:`_loader_record`): name -> (whether a recorded value is valid, besides null; what it
#: must be, for the error naming an edited one).
_LOADER_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "batch_size": (_is_count, "an integer >= 0"),
    "drop_last": (lambda value: isinstance(value, bool), "a boolean"),
    "num_batches": (_is_count, "an integer >= 0"),
    "num_workers": (_is_count, "an integer >= 0"),
    "sampler": (lambda value: isinstance(value, str), "a string"),
}


def _loader_record(loader: Any) -> dict[str, Any]:
    """What the replay of a resumed epoch depends on besides the RNGs: the training loader's
    batch size and ``drop_last`` (its batch sampler's, else its own), number of batches,
    ``num_workers`` and sampler class (its batch sampler's sampler, else its own); each None
    where the loader has none (an iterable that is not a ``DataLoader``, one without a
    length)."""
    batcher = getattr(loader, "batch_sampler", None)
    sampler = getattr(batcher, "sampler", None)
    if sampler is None:
        sampler = getattr(loader, "sampler", None)
    batch_size = getattr(batcher, "batch_size", getattr(loader, "batch_size", None))
    drop_last = getattr(batcher, "drop_last", getattr(loader, "drop_last", None))
    num_workers = getattr(loader, "num_workers", None)
    return {
        "batch_size": batch_size if _is_count(batch_size) else None,
        "drop_last": drop_last if isinstance(drop_last, bool) else None,
        "num_batches": _num_batches(loader),
        "num_workers": num_workers if _is_count(num_workers) else None,
        "sampler": None
        if sampler is None
        else f"{type(sampler).__module__}.{type(sampler).__qualname__}",
    }


def _num_batches(loader: Any) -> int | None:
    """``len(loader)``; None when it has none. Not asked of a ``DataLoader`` over an
    ``IterableDataset``: its length is the dataset's own guess, and asking it makes torch warn
    later when the dataset yields more."""
    if isinstance(getattr(loader, "dataset", None), IterableDataset):
        return None
    try:
        length = len(loader)
    except (TypeError, NotImplementedError):  # no __len__ (a sampler's raising)
        return None
    return length if _is_count(length) else None


def _parse_epoch_loader(recipe: Mapping[str, Any], where: str) -> dict[str, Any] | None:
    """The ``epoch_loader`` field of a strategy.json (see :func:`_loader_record`): None when
    absent (an earlier fastckpt's) or null (saved at an epoch's end); its known settings.

    Raises:
        CheckpointFormatError: the field or one of its settings is malformed (named).
    """
    record = recipe.get("epoch_loader")
    if record is None:
        return None
    if not isinstance(record, dict):
        raise CheckpointFormatError(
            f"{where}: field 'epoch_loader' must be null or an object, got {type(record).__name__}"
        )
    for name, (valid, kind) in _LOADER_FIELDS.items():
        value = record.get(name)
        if value is not None and not valid(value):
            raise CheckpointFormatError(
                f"{where}: field 'epoch_loader.{name}' must be null or {kind}, got {value!r}"
            )
    # A setting a later fastckpt may add is not compared.
    return {name: record[name] for name in _LOADER_FIELDS if name in record}


def _warn_another_loader(
    recorded: Mapping[str, Any] | None, live: Mapping[str, Any], epoch: int, done: int
) -> None:
    """Warn, on a resume mid-epoch, when the loader differs from the one the checkpoint's
    epoch position counts batches of (``recorded``; None: not recorded, nothing said): the
    replay skips ``done`` batches of this loader, which are not the samples the saved run read
    (another batch size: some trained twice or skipped in this epoch). Not an error: a run
    may change its batch size on purpose."""
    if recorded is None:
        return
    changed = [name for name in live if name in recorded and recorded[name] != live[name]]
    if not changed:
        return
    settings = ", ".join(
        f"{name}={recorded[name]!r} in the checkpoint, {name}={live[name]!r} now"
        for name in changed
    )
    saved_size, size = recorded.get("batch_size"), live["batch_size"]
    if isinstance(saved_size, int) and isinstance(size, int) and saved_size != size:
        what = "trained twice" if size < saved_size else "skipped (not trained in it)"
        effect = (
            f"the replay skips {done} batches of {size} ({done * size} samples) where the "
            f"saved run had read {done * saved_size}: {abs(done * (saved_size - size))} "
            f"samples of this epoch are {what}"
        )
    elif "sampler" in changed or ("num_batches" in changed and "drop_last" not in changed):
        # another sampler, or a dataset of another length (a shuffle permutes other indices)
        effect = (
            f"the replay skips {done} batches of this loader, which need not be the batches "
            "the saved run read: samples of this epoch may be trained twice or skipped"
        )
    elif changed == ["num_workers"]:
        effect = (
            "the batches are the same, but random transforms inside worker processes draw "
            "other random streams than the saved run's"
        )
    else:  # drop_last (with the number of batches it changes): where the epoch ends
        effect = "the epoch's end differs from the saved run's (its last, partial batch)"
        if "num_workers" in changed:
            effect += ", and random transforms inside worker processes draw other streams"
    warnings.warn(
        f"resuming epoch {epoch} mid-epoch, after {done} batches, with another training loader "
        f"than the saved run's ({settings}): {effect}. To continue exactly, resume with the "
        "same loader settings; to change them, save at an epoch boundary (nothing is "
        "replayed there)",
        RuntimeWarning,
        stacklevel=5,
    )


def _persistent_workers_to_start(loader: Any) -> bool:
    """Whether ``loader`` is a DataLoader with persistent worker processes that this process
    has not started yet (its iterator, made at the first ``iter()``, is kept across epochs)."""
    return (
        isinstance(loader, torch.utils.data.DataLoader)
        and loader.num_workers > 0
        and bool(loader.persistent_workers)
        and getattr(loader, "_iterator", None) is None
    )


def _persistent_workers_kept(loader: Any) -> bool:
    """Whether ``loader`` is a DataLoader whose persistent worker processes are running (its
    iterator, kept across epochs, was made by an earlier ``iter()`` in this process)."""
    return (
        isinstance(loader, torch.utils.data.DataLoader)
        and loader.num_workers > 0
        and bool(loader.persistent_workers)
        and getattr(loader, "_iterator", None) is not None
    )


def _warn_unsaved_sampler_rngs(loader: Any) -> None:
    """Warn when the loader's sampler (or batch sampler) keeps a random generator of its own
    that a checkpoint does not save (see :func:`_loader_generators` for those it does): a
    resumed run would read the data in another order, without a word."""
    import random

    import numpy as np

    kinds = (torch.Generator, random.Random, np.random.Generator, np.random.RandomState)
    batch_sampler = getattr(loader, "batch_sampler", None)
    saved = {id(generator) for generator in _loader_generators(loader)}
    owners = [getattr(loader, "sampler", None), batch_sampler]
    owners.append(getattr(batch_sampler, "sampler", None))
    found = sorted(
        {
            f"{type(owner).__name__}.{name}"
            for owner in owners
            if owner is not None and hasattr(owner, "__dict__")
            for name, value in vars(owner).items()
            if isinstance(value, kinds) and id(value) not in saved
        }
    )
    if found:
        warnings.warn(
            f"the loader's sampler draws from {', '.join(found)}, a random generator of its "
            "own that checkpoints do not save: a run resumed from one reads its data in "
            "another order than the uninterrupted run. Keep it as the sampler's `generator` "
            "(a torch.Generator: saved and restored), or shuffle with torch's global RNG",
            UserWarning,
            stacklevel=3,
        )


def _check_run_rng(record: Mapping[str, Any], where: str, field: str) -> None:
    """Check the RNG states of a run-state record (the runtime's own, or one rank's, see
    :meth:`TrainingStrategy._run_rng`); ``field`` prefixes the field names in errors."""
    with _malformed(where, f"{field}rng"):
        _check_rng_state(record.get("rng"))
    for name, check in (
        ("epoch_start_rng", _check_epoch_start_rng),
        ("epoch_start_loader_rng", _check_loader_rng),
        ("loader_rng", _check_loader_rng),
    ):
        if record.get(name) is not None:
            with _malformed(where, f"{field}{name}"):
                check(record[name])


def _check_epoch_start_rng(state: Any) -> None:
    if isinstance(state, torch.Tensor):
        _check_torch_rng(state)  # recorded by an earlier fastckpt: torch's state alone
    else:
        _check_rng_state(state)


def _check_loader_rng(states: Any) -> None:
    if not isinstance(states, list):
        raise TypeError(f"must be a list of RNG states, got {type(states).__name__}")
    for state in states:
        _check_torch_rng(state)


def _same_state(a: Any, b: Any) -> bool:
    """Whether two RNG records (nests of tensors and plain values) are equal."""
    skeleton_a, tensors_a = tree.flatten(a)
    skeleton_b, tensors_b = tree.flatten(b)
    return (
        skeleton_a == skeleton_b
        and tensors_a.keys() == tensors_b.keys()
        and all(torch.equal(tensors_a[k], tensors_b[k]) for k in tensors_a)
    )


def _refuse_two_savers_on_one_root(hooks: Sequence[Any]) -> None:
    """Refuse two checkpoint-saving hooks writing into one root, one of them async: each
    orders only its own writes, so the root's newest index could hold the older step (one
    hook's slow write committing after the other's later one). Sync hooks commit in order.

    Raises:
        ValueError: naming the root and both hooks.
    """
    seen: dict[str, int] = {}
    for position, hook in enumerate(hooks):
        root = getattr(hook, "checkpoint_dir", None)
        if getattr(hook, "saves_checkpoints", False) is not True or root is None:
            continue
        key = root_key(root)
        if key in seen and (
            getattr(hook, "async_save", True) or getattr(hooks[seen[key]], "async_save", True)
        ):
            raise ValueError(
                f"hooks[{seen[key]}] and hooks[{position}] ({type(hook).__name__}) both save "
                f"into {display_path(root)}: their writes would commit out of order; give "
                "each its own checkpoint_dir, or use one hook"
            )
        seen[key] = position


def _own_rng(runtime: _Runtime) -> dict[str, Any]:
    """The RNG states this rank resumes with: its own when the checkpoint holds every rank's
    (ranks seeded apart) and the run has as many ranks, else the ones the checkpoint holds
    once (with a warning when per-rank streams cannot be given back)."""
    once = {
        "rng": runtime.rng,
        "epoch_start_rng": runtime.epoch_start_rng,
        "epoch_start_loader_rng": runtime.epoch_start_loader_rng,
        "loader_rng": runtime.loader_rng,
    }
    if runtime.rank_rng is None:
        return once
    rank, world = _world()
    if len(runtime.rank_rng) == world:
        return runtime.rank_rng[rank]
    warnings.warn(
        f"the checkpoint holds the RNG states of each of its {len(runtime.rank_rng)} ranks "
        "(they differed: ranks seeded apart, or each advancing its own GPU's generator); this "
        f"run has {world}: every rank resumes with rank 0's, so random draws (dropout, "
        "shuffles) do not repeat the saved run's",
        stacklevel=4,
    )
    return once


def _check_torch_rng(state: Any) -> None:
    if not isinstance(state, torch.Tensor):
        raise TypeError(f"a torch RNG state must be a tensor, got {type(state).__name__}")
    torch.Generator().set_state(state)


def _check_cuda_rng(state: Any) -> None:
    """A CUDA generator's state is not a CPU generator's (16 bytes: seed and offset, not
    5056): checked by a scratch CUDA generator where CUDA exists, by its form elsewhere (a
    machine without CUDA does not apply it, see :func:`_set_rng_state`)."""
    if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8 or state.dim() != 1:
        got = (
            f"{state.dim()}-D {state.dtype}"
            if isinstance(state, torch.Tensor)
            else type(state).__name__
        )
        raise TypeError(f"a CUDA RNG state must be a 1-D uint8 tensor, got {got}")
    if torch.cuda.is_available():
        torch.Generator(device="cuda").set_state(state)


def _parse_runtime(reader: codec.IndexReader, recipe: Mapping[str, Any]) -> _Runtime:
    """Read and check the run state of ``reader``'s index (``recipe``: its strategy.json).

    Raises:
        CheckpointFormatError: a field of strategy.json or hooks.json is malformed (named).
    """
    where = f"{reader.directory}/strategy.json"
    counters = recipe.get("counters", {})
    if not isinstance(counters, Mapping):
        raise CheckpointFormatError(f"{where}: field 'counters' must be an object")
    parsed: dict[str, int] = {}
    for name in COUNTERS:
        value = counters.get(name, 0)
        if not _is_count(value):
            raise CheckpointFormatError(
                f"{where}: field 'counters.{name}' must be an integer >= 0, got {value!r}"
            )
        parsed[name] = value
    tensors = reader.tensors("strategy.safetensors")
    with _malformed(where, "runtime"):
        runtime = tree.unflatten(recipe.get("runtime"), tensors, "runtime")
    if not isinstance(runtime, dict):
        raise CheckpointFormatError(f"{where}: field 'runtime' must be an object")
    _check_run_rng(runtime, where, "runtime.")
    rank_rng = runtime.get("rank_rng")
    if rank_rng is not None:
        if not isinstance(rank_rng, list) or not all(isinstance(e, dict) for e in rank_rng):
            raise CheckpointFormatError(
                f"{where}: field 'runtime.rank_rng' must be a list of objects"
            )
        for rank, entry in enumerate(rank_rng):
            _check_run_rng(entry, where, f"runtime.rank_rng[{rank}].")
    schedulers = runtime.get("schedulers") or {}
    if not isinstance(schedulers, dict):
        raise CheckpointFormatError(f"{where}: field 'runtime.schedulers' must be an object")
    hooks_where = f"{reader.directory}/hooks.json"
    hooks_doc = reader.json("hooks.json")
    if not isinstance(hooks_doc, Mapping):
        raise CheckpointFormatError(f"{hooks_where}: must be an object")
    hook_tensors = reader.tensors("hooks.safetensors")
    with _malformed(hooks_where, "hooks"):
        saved = tree.unflatten(hooks_doc.get("hooks", []), hook_tensors, "hooks")
    if not isinstance(saved, list):
        raise CheckpointFormatError(f"{hooks_where}: field 'hooks' must be a list")
    for i, item in enumerate(saved):
        if (
            not isinstance(item, dict)
            or not isinstance(item.get("class"), str)
            or not _is_count(item.get("occurrence"))
            or "state" not in item
        ):
            raise CheckpointFormatError(
                f"{hooks_where}: field 'hooks[{i}]' must be an object with 'class' (a string), "
                f"'occurrence' (an integer >= 0) and 'state'"
            )
    configs = parse_hook_configs(hooks_doc, hooks_where)
    return _Runtime(
        parsed,
        runtime["rng"],
        runtime.get("epoch_start_rng"),
        runtime.get("epoch_start_loader_rng"),
        runtime.get("loader_rng"),
        _parse_epoch_loader(recipe, where),
        rank_rng,
        schedulers,
        saved,
        configs,
        _parse_workers_kept(recipe, where),
    )


def _parse_workers_kept(recipe: Mapping[str, Any], where: str) -> bool | None:
    """The ``loader_workers_kept`` field of a strategy.json: a bool, or None when absent (an
    earlier fastckpt's).

    Raises:
        CheckpointFormatError: the field is not a bool (named).
    """
    value = recipe.get("loader_workers_kept")
    if value is None or isinstance(value, bool):
        return value
    raise CheckpointFormatError(
        f"{where}: field 'loader_workers_kept' must be true or false, got {value!r}"
    )


def _restore_hook_states(hooks: Sequence[Any], saved: Any, where: str = "hooks.json") -> None:
    """Give each checkpointable hook the state saved for its class and occurrence; a state
    the hook refuses is a :class:`CheckpointFormatError` naming ``where`` and the entry."""
    if not isinstance(saved, list):
        raise CheckpointFormatError(f"{where}: field 'hooks' must be a list")
    live: dict[tuple[str, int], Any] = {}
    occurrences: dict[str, int] = {}
    for hook in hooks:
        if isinstance(hook, CheckpointableHook):
            cls_path = current_path(trust.dotted_path(type(hook)))  # as the saved side
            occurrence = occurrences.get(cls_path, 0)
            occurrences[cls_path] = occurrence + 1
            live[(cls_path, occurrence)] = hook
    for i, item in enumerate(saved):
        recorded = item.get("class")
        # An earlier release's path (fastckpt.hooks.ema.EMAHook) names the same hook today.
        key = (
            current_path(recorded) if isinstance(recorded, str) else recorded,
            item.get("occurrence"),
        )
        hook = live.get(key)
        if hook is None:
            warnings.warn(
                f"checkpoint has state for hook {key[0]} (occurrence {key[1]}) but no matching "
                "hook was passed; its state is not restored",
                stacklevel=3,
            )
            continue
        try:
            hook.load_state_dict(item["state"])
        except CheckpointMismatchError as err:
            # The hook passed is configured otherwise than the one that saved: not damage.
            raise CheckpointMismatchError(f"{where}: hooks[{i}] ({key[0]}): {err}") from None
        except FastCkptError:
            raise
        except (*_MALFORMED, RuntimeError) as err:
            raise CheckpointFormatError(
                f"{where}: field 'hooks[{i}].state': {key[0]} refused it "
                f"({type(err).__name__}: {err})"
            ) from err


class FineTuningStrategy(TrainingStrategy):
    """A fresh strategy seeded with a checkpoint's model weights only.

    Attributes:
        fine_tuned_from: where the weights came from (path, index, load time), or None.
    """

    fine_tuned_from: dict[str, Any] | None = None

    @classmethod
    def from_pretrained_checkpoint(
        cls,
        checkpoint_dir: str | Path,
        *,
        checkpoint_index: int = -1,
        map_location: str | torch.device | None = None,
        use_original_loss: bool = False,
        use_original_opt_class: bool = False,
        optimizer_lr: float = 1e-5,
        trusted: Trusted = None,
        **strategy_kwargs: Any,
    ) -> FineTuningStrategy:
        """Build a fine-tuning strategy from a strategy checkpoint's models.

        No optimizer state, scheduler state, counters, hooks or run limits are carried over.

        Args:
            use_original_loss: reuse the recorded training function (dotted path, trust policy).
            use_original_opt_class: reuse the recorded optimizer class (and scheduler) with
                ``lr=optimizer_lr``; otherwise ``AdamW(lr=optimizer_lr)``.
            optimizer_lr: learning rate of the new optimizers.
            strategy_kwargs: other ``TrainingStrategy`` arguments (they win).
        """
        trusted = trust.frozen_trusted(trusted)

        def attempt() -> tuple[dict[str, Any], dict[str, Any]]:
            # Models and recipe from one snapshot: a save replacing the index meanwhile makes
            # both read again (as fastckpt.load_checkpoint).
            result = codec.load_components(
                checkpoint_dir, checkpoint_index, map_location, trusted=trusted
            )
            return result, _read_recipe(result["reader"])

        result, recipe = read_consistently(
            Path(checkpoint_dir) / MANIFEST, attempt, lock_root=Path(checkpoint_dir)
        )
        models = {name: record["model"] for name, record in result["models"].items()}
        kwargs: dict[str, Any] = dict(strategy_kwargs)
        if "optimizers" not in kwargs:
            configs = {}
            for name in models:
                original = recipe.get("optimizer_configs", {}).get(name)
                if use_original_opt_class and original is not None:
                    config = OptimizerConfig.from_json(original)
                    config.optimizer_kwargs = {**config.optimizer_kwargs, "lr": optimizer_lr}
                    config.optimizer_cls = trust.resolve_target(
                        str(config.optimizer_cls), "optimizer", trusted
                    )
                    if config.scheduler_cls is not None:
                        config.scheduler_cls = trust.resolve_target(
                            str(config.scheduler_cls), "scheduler", trusted
                        )
                else:
                    config = OptimizerConfig(torch.optim.AdamW, {"lr": optimizer_lr})
                configs[name] = config
            kwargs["optimizers"] = configs
        if "training_fn" not in kwargs and use_original_loss:
            kwargs["training_fn"] = _recorded_training_fn(recipe, trusted, models.values())
        strategy = cls(models if list(models) != ["main"] else models["main"], **kwargs)
        strategy.fine_tuned_from = {
            "path": str(Path(checkpoint_dir)),
            "checkpoint_index": result["checkpoint_index"],
            "loaded": _dt.datetime.now(_dt.UTC).isoformat(),
        }
        return strategy
