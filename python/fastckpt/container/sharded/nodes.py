"""What each node's copy of a sharded root holds: restoring from node-local fast tiers.

On node-local fast tiers (each node's ranks save to their own disk) no single node holds a
sharded index whole: rank 0's node holds the index, the manifest and its own ranks' files, the
other nodes their own ranks' files and a copy of the part's commit record
(:func:`fastckpt.training.sharded.share_commit`). Together they may still hold every file of
the part: such an index can be restored from the fast tiers, each rank reading its shards from
its own node and the ranges it needs of other nodes' files from the ranks that hold them
(:mod:`fastckpt.dcp.peers`).

Rank 0 looks first on its own: when its copy of a part newer than what it would restore lacks
files, it asks every rank what its node holds of those parts (:func:`node_holdings`, gathered
by the caller) and decides again (:func:`fastckpt.container.promote.nearest_intact` with
``elsewhere``): a file missing from its own copy counts as held when another rank's node holds
it in the same part (same part name, same commit record crc32c) with its recorded size. The
bytes are verified as they are loaded, as for any sharded load.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from fastckpt import _native
from fastckpt.format.records import SHARDED_DIR, SHARDED_RECORD
from fastckpt.io.paths import check_name
from fastckpt.storage.registry import backend_for, is_local

__all__ = ["Holding", "NodeHoldings", "PartKey", "held_by_others", "node_holdings"]

#: The most bytes of a part record this module reads (records are small JSON documents).
_MAX_RECORD = 64 << 20


@dataclass(frozen=True)
class Holding:
    """One node's copy of one sharded part.

    Attributes:
        record_crc32c: crc32c of the part's commit record on that node.
        files: the data files of the record's generation present there: name -> size.
    """

    record_crc32c: int
    files: dict[str, int] = field(default_factory=dict)


#: ``(tier position, index, part name)``: one part of one tier, as every rank names it (each
#: rank passes its tiers in the same order).
PartKey = tuple[int, int, str]

#: ``PartKey -> Holding``: what one rank's node holds.
NodeHoldings = dict[PartKey, Holding]


def node_holdings(tiers: Sequence[str | os.PathLike[str]], keys: Iterable[PartKey]) -> NodeHoldings:
    """What this node's copies of ``tiers`` hold of the parts ``keys`` (local tiers only: an
    object store is one store for every rank): each part's record crc32c, files and sizes.
    A part this node has no readable record of is left out (it is not evidence of anything).
    """
    holdings: NodeHoldings = {}
    for position, index, name in keys:
        if not 0 <= position < len(tiers) or not is_local(backend_for(tiers[position])):
            continue
        part = Path(tiers[position]) / SHARDED_DIR / str(index) / name
        holding = _holding(part)
        if holding is not None:
            holdings[(position, index, name)] = holding
    return holdings


def _holding(part: Path) -> Holding | None:
    """This node's copy of the part directory ``part`` (None: no readable record)."""
    try:
        with open(part / SHARDED_RECORD, "rb") as handle:
            raw = handle.read(_MAX_RECORD)
        # a plain name (CheckpointFormatError, a ValueError, if not): ``..`` or a path would
        # list a directory outside the part as its files
        generation = check_name(json.loads(raw)["generation"], "generation")
        names = os.listdir(part / generation)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    files = {}
    for name in names:
        try:
            files[name] = os.stat(part / generation / name).st_size
        except OSError:
            continue
    return Holding(_native.crc32c(raw), files)


def held_by_others(
    elsewhere: Sequence[NodeHoldings],
    position: int,
    index: int,
    part: str,
    record_crc32c: int,
    missing: Mapping[str, int],
) -> bool:
    """Whether every file of ``missing`` (name -> recorded size) is held, with that size, by
    some other node's copy of the same part (same name and commit record) of tier
    ``position``."""
    for name, size in missing.items():
        if not any(
            (holding := other.get((position, index, part))) is not None
            and holding.record_crc32c == record_crc32c
            and holding.files.get(name) == size
            for other in elsewhere
        ):
            return False
    return True
