"""A load's reads, planned whole: every range it needs, read in few large verified pieces.

:class:`ReadPlan` takes the :class:`~fastckpt.container.sharded.chunks.Want`\\ s of a load (one
per item), coalesces their byte ranges per file (:func:`~fastckpt.container.sharded.ranges.
coalesce`, with the files' gap: touching ranges on a local disk, ranges up to
:data:`~fastckpt.container.sharded.chunks.OBJECT_STORE_GAP` apart on an object store) and groups
the spans into batches of at most ``stage_bytes``. :meth:`ReadPlan.read` fetches one batch (an
object store's requests all in flight together) and verifies every piece of it once, however
many items share it.

A load whose spans fit in one batch therefore reads each byte once, and holds that many bytes
(about its share of the checkpoint) until the targets are filled; a larger one is read in
batches, once to verify and again to fill, holding one batch at a time.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fastckpt.container.sharded.chunks import ChunkFiles, Want
from fastckpt.container.sharded.ranges import Span, coalesce, covered_bytes, windows

__all__ = ["DEFAULT_STAGE_BYTES", "Batch", "ReadPlan"]

#: The most bytes a load holds between reading and filling its targets, by default: a share
#: up to this is read once; a larger one twice, in batches of this size.
DEFAULT_STAGE_BYTES = 2 << 30

#: A batch: the spans read together and the wants (indices) they serve.
Batch = tuple[tuple[Span, ...], tuple[int, ...]]

_EMPTY = np.empty(0, dtype=np.uint8)


class ReadPlan:
    """The reads of one load (see the module docstring).

    Args:
        files: the generation's data files.
        wants: what each item of the load needs, in the load's order.
        stage_bytes: the most bytes one batch holds (None: no bound, one batch).

    Attributes:
        batches: the batches, in file and offset order; wants of no bytes come with the last
            one (there is one batch even then).
        needed_bytes: bytes of the files the wants cover, each byte once (no gaps).
        key: what the plan reads, to compare with another plan's.
    """

    def __init__(self, files: ChunkFiles, wants: Sequence[Want], stage_bytes: int | None) -> None:
        """Plan the reads; nothing is read yet."""
        self.files = files
        self.wants = list(wants)
        ranges = [want.range for want in self.wants]
        self.needed_bytes = covered_bytes(ranges)
        self.key = tuple(ranges)
        batches: list[Batch] = [
            (tuple(group), tuple(index for span in group for index in span.members))
            for group in windows(coalesce(ranges, files.gap), stage_bytes)
        ]
        empty = tuple(index for index, r in enumerate(ranges) if r.stop <= r.start)
        if empty or not batches:
            spans, members = batches.pop() if batches else ((), ())
            batches.append((spans, members + empty))
        self.batches = batches

    def read(self, batch: Batch) -> dict[int, np.ndarray]:
        """Fetch a batch and verify it: ``{want index: its bytes}`` (views of the batch's
        buffers).

        Raises:
            ChecksumMismatchError: a piece differs from its stored crc32c (names the file).
            CheckpointFormatError: a file is not the size the record says.
            ObjectStoreError: a request failed.
        """
        spans, members = batch
        chunks = [self.wants[span.members[0]].chunk for span in spans]
        buffers = self.files.read_spans(spans, chunks)
        views = dict.fromkeys(members, _EMPTY)
        checked: set[tuple[str, int]] = set()
        for span, buffer in zip(spans, buffers, strict=True):
            for index in span.members:
                want = self.wants[index]
                where = want.range
                data = buffer[where.start - span.start : where.stop - span.start]
                self.files.check(want, data, checked)
                views[index] = data
        return views
