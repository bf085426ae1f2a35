"""Planning a load's reads: the byte ranges it needs, coalesced into few large reads.

A load needs, for each item of its plan, one contiguous byte range of one data file (the rows
of a chunk, rounded out to verification blocks). Read one by one, each range is a request of
its own: on an object store, a round trip per item. :func:`coalesce` merges the ranges of each
file that overlap or lie within ``gap`` bytes of each other into :class:`Span`\\ s, each read
into one buffer; :func:`windows` groups the spans so that no group holds more than a memory
budget.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Range", "Span", "coalesce", "covered_bytes", "windows"]


@dataclass(frozen=True)
class Range:
    """Bytes ``[start, stop)`` of the data file ``file`` that one read item needs."""

    file: str
    start: int
    stop: int


@dataclass(frozen=True)
class Span:
    """One read: bytes ``[start, stop)`` of ``file``, covering the ranges ``members`` (indices
    into the sequence given to :func:`coalesce`)."""

    file: str
    start: int
    stop: int
    members: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Bytes read."""
        return self.stop - self.start


def coalesce(ranges: Sequence[Range], gap: int) -> list[Span]:
    """The spans that read ``ranges``: per file, in offset order, a range that overlaps the
    current span or starts at most ``gap`` bytes after its end joins it (the bytes in between
    are read too). Empty ranges belong to no span."""
    order = sorted(
        (index for index, r in enumerate(ranges) if r.stop > r.start),
        key=lambda index: (ranges[index].file, ranges[index].start, ranges[index].stop),
    )
    spans: list[Span] = []
    members: list[int] = []
    file, start, stop = "", 0, 0
    for index in order:
        item = ranges[index]
        if members and item.file == file and item.start <= stop + gap:
            stop = max(stop, item.stop)
            members.append(index)
            continue
        if members:
            spans.append(Span(file, start, stop, tuple(members)))
        file, start, stop, members = item.file, item.start, item.stop, [index]
    if members:
        spans.append(Span(file, start, stop, tuple(members)))
    return spans


def covered_bytes(ranges: Sequence[Range]) -> int:
    """Bytes of the union of ``ranges`` (what the load needs, each byte once)."""
    return sum(span.nbytes for span in coalesce(ranges, 0))


def windows(spans: Sequence[Span], budget: int | None) -> list[list[Span]]:
    """``spans`` in consecutive groups of at most ``budget`` bytes each (a span larger than
    the budget is a group of its own; ``None``: one group). No spans: no group."""
    groups: list[list[Span]] = []
    held = 0
    for span in spans:
        if groups and (budget is None or held + span.nbytes <= budget):
            groups[-1].append(span)
            held += span.nbytes
        else:
            groups.append([span])
            held = span.nbytes
    return groups
