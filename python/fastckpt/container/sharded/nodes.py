"""What each node's copy of a sharded root holds: restoring from node-local fast tiers.

On node-local fast tiers (each node's ranks save to their own disk) no single node holds a
sharded index whole: rank 0's node holds the index, the manifest and its own ranks' files, the
other nodes their own ranks' files and a copy of the part's commit record
(:func:`fastckpt.training.sharded.share_commit`). Together they may still hold every file of
the part: such an index can be restored from the fast tiers, each rank reading its shards from
its own node and the ranges it needs of other nodes' files from the ranks that hold them
(:mod:`fastckpt.dcp.peers`).

Every rank reports what its node holds (:func:`node_holdings`, gathered by the caller); rank 0
decides (:func:`fastckpt.container.promote.nearest_intact` with ``elsewhere``): a file missing
from its own copy counts as held when another rank's node holds it in the same part (same part
name, same commit record crc32c) with its recorded size. The bytes are verified as they are
loaded, as for any sharded load.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from fastckpt import _native
from fastckpt.format.records import SHARDED_DIR, SHARDED_RECORD
from fastckpt.storage.registry import backend_for, is_local

__all__ = ["Holding", "NodeHoldings", "held_by_others", "node_holdings"]

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


#: ``(tier position, index, part name) -> Holding``: what one rank's node holds, per tier.
NodeHoldings = dict[tuple[int, int, str], Holding]


def node_holdings(tiers: Sequence[str | os.PathLike[str]]) -> NodeHoldings:
    """The sharded parts this node's copies of ``tiers`` hold (local tiers only: an object
    store is one store for every rank), with their files and sizes. Unreadable entries are
    left out (they are not evidence of anything)."""
    holdings: NodeHoldings = {}
    for position, tier in enumerate(Path(t) for t in tiers):
        if not is_local(backend_for(tier)):
            continue
        base = tier / SHARDED_DIR
        try:
            indices = [entry for entry in base.iterdir() if entry.name.isdigit()]
        except OSError:
            continue
        for index_dir in indices:
            try:
                parts = list(index_dir.iterdir())
            except OSError:
                continue
            for part in parts:
                holding = _holding(part)
                if holding is not None:
                    holdings[(position, int(index_dir.name), part.name)] = holding
    return holdings


def _holding(part: Path) -> Holding | None:
    """This node's copy of the part directory ``part`` (None: no readable record)."""
    try:
        with open(part / SHARDED_RECORD, "rb") as handle:
            raw = handle.read(_MAX_RECORD)
        generation = json.loads(raw)["generation"]
        names = os.listdir(part / generation) if isinstance(generation, str) else []
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
