"""The collective side of :class:`~fastckpt.manager.CheckpointManager` under a process group.

Under ``torch.distributed`` with several ranks a manager save is collective: every rank stages
its own files, all of them join one gather per save (:class:`RankPart`, with a failure marker
when their part failed, so that no rank's gather pairs with another save), and rank 0 commits
once every part is in, then sends its outcome to all. This module holds what that protocol
needs apart from the manager's own state: the rank/world and the dedicated gloo group
(:class:`DistributedContext`), one save's turn (:class:`Turn`), the checks every rank makes on
the gathered parts (:func:`check_same_save`), what a rank whose collective failed can tell
about the commit (:func:`outcome_after`, :func:`record_names`) and the error it raises
(:func:`collective_failure`), and the rule for loading on another number of ranks
(:func:`check_world_size`).
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from fastckpt.container.background import committed_before
from fastckpt.errors import CheckpointMismatchError, FastCkptError, NotCommittedError
from fastckpt.format.records import GENERATION_PREFIX, read_commit_record, record_file
from fastckpt.storage.registry import display_path

__all__ = [
    "DistributedContext",
    "RankPart",
    "Turn",
    "check_same_save",
    "check_world_size",
    "collective_failure",
    "one_line",
    "outcome_after",
    "record_names",
]


@dataclass
class Turn:
    """One collective save (:attr:`DistributedContext.active`) of a manager.

    Attributes:
        number: how many saves this manager was asked for, this one included: ranks in step
            give the same number to the same save.
        may_join: this rank may take part in a collective of this save now (False until
            the previous background write, which may still be in a collective, is done).
        joined: this rank took part in the save's gather (with its files, or a failure).
    """

    number: int
    may_join: bool
    joined: bool = False


class RankPart(NamedTuple):
    """What one rank gives to the gather of a collective save."""

    number: int  # the save's :attr:`Turn.number` on that rank
    failure: str | None  # that rank's part failed: its error (nothing is committed)
    sharded: bool  # a sharded (DTensor) save
    payload: Any  # unsharded: (location, files, refs, final, items); sharded: digests


class DistributedContext:
    """This manager's rank and world, and the gloo group its collectives run on.

    The group is made at the first collective (:attr:`group`), never by the constructor:
    ``dist.new_group`` waits for every rank of the default group, and a manager built on one
    rank alone (the DDP pattern "only rank 0 saves") hung there, to save or to load. That is
    the manager's first collective save, on the thread calling ``save`` (every rank waits
    there for the others, up to ``checkpoint_write_barrier_timeout_sec``); nothing makes it
    earlier (``prewarm_staging`` is not collective: one rank may call it alone). A manager
    that is not ``collective`` (``Config.collective``) is used by this process alone: rank 0
    of a world of one, as without a process group, and it has no group.

    Attributes:
        active: collectives run (a collective manager under a group of several ranks).
        alone: not collective while the default group has other ranks.
        rank / world_size: this manager's (0 and 1 unless ``active``).
        timeout_secs: how long a collective waits for the other ranks.
    """

    def __init__(self, timeout_secs: float, *, collective: bool = True) -> None:
        """Read the default process group (nothing collective happens here)."""
        import torch.distributed as dist

        initialized = dist.is_available() and dist.is_initialized()
        several = initialized and dist.get_world_size() > 1
        self.active = several and collective
        self.alone = several and not collective
        self.rank = dist.get_rank() if self.active else 0
        self.world_size = dist.get_world_size() if self.active else 1
        self.timeout_secs = timeout_secs
        # Made on one rank too: DCP's async save needs a CPU backend, which a job on NCCL
        # alone (one GPU) lacks.
        self._wanted = initialized and not self.alone
        self._group: Any = None

    @property
    def group(self) -> Any:
        """The dedicated gloo group (None without a process group, or :attr:`alone`), so
        background-thread collectives never interleave with training's. Made at the first
        use, which waits for every rank of the default group (at most :attr:`timeout_secs`):
        make it on the thread that calls ``save`` (``new_group`` calls must come in the same
        order on every rank), never first on the writer thread."""
        if self._group is None and self._wanted:
            import torch.distributed as dist

            timeout = datetime.timedelta(seconds=self.timeout_secs)
            self._group = dist.new_group(backend="gloo", timeout=timeout)
        return self._group

    def barrier(self) -> None:
        """Wait for every rank (a no-op unless :attr:`active`)."""
        if self.active:
            import torch.distributed as dist

            dist.barrier(group=self.group)

    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order (``[value]`` unless :attr:`active`)."""
        if not self.active:
            return [value]
        import torch.distributed as dist

        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, value, group=self.group)
        return gathered

    def make_group(self) -> None:
        """Make :attr:`group` now, if it is wanted and not made yet."""
        self.group  # noqa: B018 (the property makes it)


def collective_failure(
    path: Path, err: BaseException, timeout_secs: float, committed: bool | None, detail: str
) -> RuntimeError:
    """The error of a manager save of ``path`` whose collective failed with ``err`` (gloo's
    "Connection reset by peer" when another rank died, a timeout when it never called save),
    saying whether this save was ``committed`` (None: unknown; ``detail``: why) and the fix."""
    status = {
        True: "was committed: it verifies and loads",
        False: "was not committed: the previous checkpoint stands",
        None: f"may have been committed: check it with `fastckpt verify {display_path(path)}`",
    }[committed]
    return RuntimeError(
        f"{display_path(path)}: CheckpointManager.save failed in a collective of "
        f"torch.distributed ({type(err).__name__}: {err}). Under a process group a save is "
        "collective: every rank calls save with the same checkpoint_id and rank 0 commits "
        "once every rank's files are in; another rank did not call save within "
        f"checkpoint_write_barrier_timeout_sec ({timeout_secs:g} s), died, or left the "
        f"process group. This save {status}{detail}. Call save on every rank, or, where one "
        "rank saves state every rank holds alike (DDP's), build that rank's manager with "
        "Config.collective=False."
    )


def outcome_after(
    error: BaseException, final: Path, files: Mapping[str, Mapping[str, Any]]
) -> bool | None:
    """Whether rank 0's commit of ``final`` that raised ``error`` committed it anyway, for the
    other ranks: True when ``error`` says so or the record there names this save's files;
    None (unknown: check it) when the record could not be read or ``error`` is an I/O error
    (one after the rename, or an object store's in-doubt put, may have committed); else
    False."""
    if committed_before(error):
        return True
    found, _ = record_names(final, files)
    if found:
        return True
    if found is None or isinstance(error, OSError):
        return None
    return False


def record_names(final: Path, files: Mapping[str, Mapping[str, Any]]) -> tuple[bool | None, str]:
    """Whether the commit record at ``final`` names every file of ``files`` (relpath ->
    ``{"size", "crc32c"}``: a save's, as its ranks staged them) with its size and checksum,
    that is, whether rank 0 committed that save (or one with the same content), with what
    this rank could not tell. Relpaths are compared without their generation prefix (on an
    object store each rank stages under its own)."""

    def unprefixed(relpath: str) -> str:
        head, _, tail = relpath.partition("/")
        return tail if tail and head.startswith(GENERATION_PREFIX) else relpath

    try:
        record = read_commit_record(final)
    except NotCommittedError:
        return False, ""
    except (OSError, FastCkptError) as err:
        return None, f" (its record could not be read: {err})"
    recorded = {
        unprefixed(relpath): (entry.get("size"), entry.get("crc32c"))
        for relpath, entry in record["files"].items()
        if isinstance(entry, Mapping)
    }
    named = all(
        recorded.get(unprefixed(relpath)) == (entry.get("size"), entry.get("crc32c"))
        for relpath, entry in files.items()
    )
    if named:
        return True, ""
    # Rank 0 commits only once every rank's files are in: one that is still running (slow,
    # not dead) may commit it yet.
    return False, " (when this rank looked; a rank 0 still running may commit it yet)"


def one_line(err: BaseException) -> str:
    """``err`` in one line of at most 500 characters, for the other ranks' messages."""
    text = f"{type(err).__name__}: {err}".replace("\n", " ")
    return text if len(text) <= 500 else text[:497] + "..."


def check_same_save(gathered: list[Any]) -> None:
    """Every rank of a collective save named the same checkpoint and the same items (each
    gathered entry ends with the rank's checkpoint path and sorted item names). Checked on
    every rank alike, before anything is committed: rank 0 committed every rank's files under
    its own id (the others' ids never existed), and a rank's item missing on rank 0 was lost.

    Raises:
        ValueError: names the ranks that differ from rank 0 and what they named.
    """
    final, items = gathered[0][-2:]
    for rank, entry in enumerate(gathered):
        if entry[-2] != final:
            raise ValueError(
                f"CheckpointManager.save under a process group: rank {rank} saves "
                f"{entry[-2]}, rank 0 {final}; every rank must pass the same checkpoint_id "
                "(nothing was committed)"
            )
        if entry[-1] != items:
            raise ValueError(
                f"CheckpointManager.save under a process group: rank {rank} saves the items "
                f"{entry[-1]}, rank 0 {items}; every rank must save the same items (per-rank "
                "values may differ; nothing was committed)"
            )


def check_world_size(
    directory: Path, record: Mapping[str, Any], world_size: int, keys: list[str]
) -> None:
    """A checkpoint saved by N > 1 ranks (each with its own files) loads on another number
    of ranks only for items every rank saved alike (replicated, as DDP's: each rank's files
    have rank 0's checksums), which any rank then reads from rank 0's files. An item whose
    ranks differ would give a rank state that is not its own, without a word.

    Raises:
        CheckpointMismatchError: names the items, both world sizes and the ways out.
    """
    saved = record.get("world_size", 1)
    if not isinstance(saved, int) or saved <= 1 or saved == world_size:
        return
    files = record["files"]

    def crc(name: str) -> Any:
        entry = files.get(record_file(record, name))
        return None if not isinstance(entry, Mapping) else entry.get("crc32c")

    # Ranks past the number of recorded files cannot all have files (an edited world_size of
    # 10**12 must not mean 10**12 lookups): one of them stands for the rest, as absent.
    ranks = range(min(saved, len(files) + 1))
    differing = []
    for key in keys:
        tensors = {crc(f"{key}.rank{r}.safetensors") for r in ranks}
        if saved > len(ranks):
            tensors.add(None)
        skeletons = {crc(f"{key}.json")} | {crc(f"{key}.rank{r}.json") for r in ranks[1:]}
        skeletons.discard(None)  # earlier versions wrote rank 0's skeleton only
        if len(tensors) > 1 or len(skeletons) > 1:
            differing.append(key)
    if differing:
        raise CheckpointMismatchError(
            f"{directory}: saved by {saved} ranks whose items {differing} differ from rank to "
            f"rank; it loads on {saved} ranks only (this is {world_size}). Replicated items "
            "(the same on every rank) load on any number; state saved as DTensors (FSDP2, "
            "tensor parallel) is resharded; one rank's files read with "
            f"fastckpt.safe_open({directory}/<item>.rank<r>.safetensors)"
        )
