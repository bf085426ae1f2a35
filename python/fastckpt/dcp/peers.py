"""Reads served by other ranks: a sharded load of files that lie on several nodes' own disks.

When each node saved its ranks' files to its own disk (``fastckpt.dcp.Writer(node_local=True)``,
node-local fast tiers, docs/tiers.md), a rank's load plan may need ranges of files that its
node does not hold: another rank's shards after a resharding, the values DCP deduplicated to
one rank, or everything, on a node that joined the job. The load then goes like this:

1. with its local plan, each rank reports which of the files it wrote or needs its node holds
   (present, with the size the commit record lists) and the byte ranges it needs of the others
   (:func:`note`);
2. the coordinator assigns each such range to a rank whose node holds the file (the rank that
   wrote it, when it does) and sends the whole schedule back with every plan
   (:func:`schedule`); a file no node holds is a ``FileNotFoundError`` naming it, before
   anything is read;
3. every rank runs the same schedule in the same order (:func:`exchange`): for each transfer
   the holder reads the range from its disk and sends it, the receiver receives it. A pair
   only ever waits on its own transfer, and the earliest unfinished transfer always has both
   of its ranks at it, so the schedule cannot deadlock.

The received bytes are held in memory (about the rank's share of other nodes' files) and
verified by the receiver like bytes read from its own disk: crc32c of every verification
piece, so a damaged shard on the holder's node is a ``ChecksumMismatchError`` on the
receiving rank. The transfers use a gloo group (CPU tensors, whatever the job's backend).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from fastckpt.container.sharded.chunks import ChunkFiles
from fastckpt.container.sharded.promote import rank_of
from fastckpt.container.sharded.ranges import Range, coalesce
from fastckpt.format.sharded import Record, StoredChunk

__all__ = [
    "Note",
    "Schedule",
    "Transfer",
    "exchange",
    "gloo_group",
    "held_files",
    "note",
    "schedule",
]


@dataclass(frozen=True)
class Note:
    """What one rank reports with its local plan.

    Attributes:
        generation: the commit it read (every rank must read the same one).
        rank: its rank in the default group (-1: no process group).
        world: the default group's size.
        held: of the record's files it wrote or needs, those its node holds with their
            recorded sizes.
        wants: ``(file, start, stop)``: the byte ranges its plan needs of files its node does
            not hold (coalesced, verification pieces whole).
    """

    generation: str
    rank: int
    world: int
    held: frozenset[str]
    wants: tuple[tuple[str, int, int], ...] = ()


@dataclass(frozen=True)
class Transfer:
    """Bytes ``[start, stop)`` of ``file``, read by rank ``source`` and sent to ``target``."""

    source: int
    target: int
    file: str
    start: int
    stop: int


@dataclass(frozen=True)
class Schedule:
    """What the coordinator sends back with every plan: the generation and every transfer of
    the load, in the order all ranks run them."""

    generation: str
    transfers: tuple[Transfer, ...] = ()


def held_files(directory: Path, files: Mapping[str, Mapping[str, Any]]) -> frozenset[str]:
    """The files of a commit record (``files``: name -> ``{"size", ...}``) that ``directory``
    (a generation directory on this node) holds with their recorded sizes."""
    held = set()
    for name, record in files.items():
        try:
            size = os.stat(directory / name).st_size
        except OSError:
            continue
        if size == int(record.get("size") or 0):
            held.add(name)
    return frozenset(held)


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return -1, 1


def note(
    record: Record, files: ChunkFiles, chunks: Sequence[StoredChunk], ranges: Sequence[Range]
) -> Note:
    """This rank's :class:`Note` for a load whose items lie in ``chunks`` and need ``ranges``
    of the data files (``ranges[i]`` of ``chunks[i]``); ranges ``files`` already received (a
    ``verify`` load's, kept for the ``fill`` load) are not asked for again."""
    rank, world = _world()
    if not files.local or world == 1:  # one store for every rank, or no other rank to ask
        return Note(record.generation, rank, world, frozenset(record.files))
    # Only the files this rank wrote (on node-local storage, its node holds them) and the
    # ones its plan needs are looked at: a rank does not stat every rank's files.
    needed_files = {chunk.file for chunk in chunks}
    looked_at = {
        name: entry
        for name, entry in record.files.items()
        if name in needed_files or rank_of(name) == rank
    }
    held = held_files(files.directory, looked_at)
    needed = [
        r
        for chunk, r in zip(chunks, ranges, strict=True)
        if chunk.file not in held and r.stop > r.start and not files.received(r)
    ]
    wants = tuple((span.file, span.start, span.stop) for span in coalesce(needed, 0))
    return Note(record.generation, rank, world, held, wants)


def schedule(notes: Sequence[Note], where: Path) -> tuple[Transfer, ...]:
    """The transfers that serve every rank's wants (see the module docstring), in the order
    every rank runs them.

    A load that does not run on the default process group (the ranks cannot be told apart)
    gets no transfers: its reads of files its node lacks fail as they would without this
    module (``FileNotFoundError`` naming the file).

    Raises:
        FileNotFoundError: a wanted file is on no rank's node (names it; restore from a copy
            that holds every rank's files, e.g. the durable tier).
    """
    if not any(n.wants for n in notes):
        return ()
    ranks = [n.rank for n in notes]
    if ranks != list(range(len(notes))) or any(n.world != len(notes) for n in notes):
        return ()
    transfers: list[Transfer] = []
    for receiver in notes:
        for file, start, stop in receiver.wants:
            holders = [n.rank for n in notes if file in n.held]
            if not holders:
                raise FileNotFoundError(
                    f"{where / file}: on no rank's node (node-local storage of a node that is "
                    "gone, or a deleted file); load a copy that holds every rank's files, such "
                    "as the durable tier"
                )
            writer = rank_of(file)
            source = writer if writer in holders else holders[0]
            transfers.append(Transfer(source, receiver.rank, file, start, stop))
    return tuple(transfers)


#: The gloo group made for transfers, with the default group it was made for.
_GLOO: dict[str, tuple[Any, Any]] = {}


def gloo_group() -> Any:
    """A gloo group over every rank: the default group when it has a gloo backend (CPU
    tensors go through it), else one created once per default group, by every rank at the
    same load (they all run the same schedule)."""
    if "gloo" in str(dist.get_backend()):
        return None
    world = dist.group.WORLD
    made = _GLOO.get("group")
    if made is None or made[0] is not world:
        made = (world, dist.new_group(backend="gloo"))
        _GLOO["group"] = made
    return made[1]


def exchange(
    transfers: Sequence[Transfer], files: ChunkFiles, chunks: Mapping[str, StoredChunk]
) -> None:
    """Run the schedule (collective: every rank calls it with the same ``transfers``): send
    the ranges this rank holds, receive into ``files`` the ranges it wants
    (``chunks``: a chunk of each data file, for its recorded size).

    A holder that cannot read a range tells its receiver instead of sending it; both finish
    the schedule (no rank is left waiting), then the holder raises its error and the receiver
    a ``FileNotFoundError`` naming the holder.
    """
    if not transfers:
        return
    rank, _ = _world()
    group = gloo_group()
    failure: BaseException | None = None
    for transfer in transfers:
        if transfer.source == rank:
            status = torch.zeros(1, dtype=torch.int64)
            try:
                data = files.read_raw(chunks[transfer.file], transfer.start, transfer.stop)
            except (OSError, ValueError) as err:
                failure = failure or err
                status[0] = 1
            dist.send(status, transfer.target, group=group)
            if status[0] == 0:
                dist.send(torch.from_numpy(data), transfer.target, group=group)
        elif transfer.target == rank:
            status = torch.zeros(1, dtype=torch.int64)
            dist.recv(status, transfer.source, group=group)
            if status[0] != 0:
                failure = failure or FileNotFoundError(
                    f"{files.directory / transfer.file}: rank {transfer.source}, whose node "
                    "holds it, could not read it"
                )
                continue
            buffer = np.empty(transfer.stop - transfer.start, dtype=np.uint8)
            dist.recv(torch.from_numpy(buffer), transfer.source, group=group)
            files.receive(transfer.file, transfer.start, buffer, transfer.source)
    if failure is not None:
        raise failure
