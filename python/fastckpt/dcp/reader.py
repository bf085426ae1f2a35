"""``fastckpt.dcp.Reader``: a ``torch.distributed.checkpoint`` storage reader on fastckpt.

```python
dcp.load(state, storage_reader=fastckpt.dcp.Reader("ckpt/step-100"))
```

The reader takes DCP's metadata from the JSON commit record (never a pickle), reads from each
file only the rows of each chunk that this rank's plan asks for (rounded out to verification
blocks), checks their crc32c, and copies them into DCP's target tensors. A target of another
dtype than the saved one is refused (``CheckpointMismatchError``, before any target is
written), where torch's ``FileSystemReader`` casts. Resharding (a different world size or
mesh) is DCP's planning; the reader only serves byte ranges.

Nothing is handed to the planner before every byte of this rank's plan was read and verified.
How a load reads depends on where the files are:

* on an object store, it plans all of its reads first
  (:class:`~fastckpt.container.sharded.reads.ReadPlan`): the ranges of its items are coalesced
  per object (ranges up to 4 MiB apart share a request), every request is in flight together,
  each verification piece is checked once, and the targets are filled from the verified
  bytes. A share of at most ``stage_bytes`` (2 GiB by default) is fetched once and held until
  then; a larger one twice, in batches of ``stage_bytes`` (verified, then read into the
  targets and verified again);
* on a local disk, each item's range is verified in one reusable buffer (no more memory than
  the largest verification piece), then read again, from the page cache, straight into its
  target (verified again).

On node-local storage (each node's copy of the checkpoint holds its own ranks' files, see
``Writer(node_local=True)``) the ranges a rank needs of files its node lacks are sent to it by
the ranks whose nodes hold them (:mod:`fastckpt.dcp.peers`, planned with DCP's plans) and
verified on arrival like the disk's.

A damaged chunk therefore leaves this rank's targets as they were.
:func:`fastckpt.dcp.load_state` runs the verify and fill steps as two DCP loads, so that no
rank fills a target before every rank verified its share (see :attr:`Reader.passes`); on an
object store the bytes the first verified are kept for the second when they fit in
``stage_bytes``.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from fastckpt.container.sharded.chunks import ChunkFiles, Want, box_view
from fastckpt.container.sharded.commit import (
    RECORD_NAME,
    new_generation,
    read_record,
    refuse_torch_checkpoint,
)
from fastckpt.container.sharded.reads import DEFAULT_STAGE_BYTES, ReadPlan
from fastckpt.container.sharded.values import as_planner_bytes, decode_value
from fastckpt.dcp import peers
from fastckpt.errors import CheckpointFormatError, CheckpointMismatchError, ChecksumMismatchError
from fastckpt.format.sharded import Record, StoredChunk
from fastckpt.io.files import copy_values, dtype_from_name
from fastckpt.storage.registry import backend_for, check_url_spelling

__all__ = ["Passes", "Reader"]

#: Which passes a load runs: ``both`` (verify this rank's share, then read it into the
#: targets), ``verify`` (only check it; keep the files open, and the verified bytes when they
#: fit in ``stage_bytes``, for a ``fill`` load next) or ``fill`` (fill the targets from what a
#: ``verify`` load kept, or read them again, verified again).
Passes = Literal["both", "verify", "fill"]


@dataclass
class _Held:
    """What a ``verify`` load keeps for the ``fill`` load: the open files and, when the
    share was read in one batch, its verified bytes (for the plan of ``key``)."""

    files: ChunkFiles
    key: tuple[Any, ...] | None = None
    views: dict[int, np.ndarray] | None = None


class Reader(StorageReader):
    """A DCP ``StorageReader`` for checkpoints written by :class:`fastckpt.dcp.Writer`.

    Args:
        path: the checkpoint directory (the DCP checkpoint id).
        verify: check the crc32c of every byte read (default). A mismatch raises
            :class:`fastckpt.ChecksumMismatchError` naming the file and tensor, which DCP
            reports inside its ``CheckpointException``.
        stage_bytes: on an object store, the most bytes of verified data a load holds
            before it fills the targets (default 2 GiB): a rank's share up to this is fetched
            once, a larger one twice (verified in batches of this size, then read into the
            targets). None: no bound (every share fetched once, held whole).

    Attributes:
        bytes_read: bytes of the data files the last load needed (the byte ranges of its
            plan, rounded out to verification blocks, each byte counted once).
        bytes_fetched: bytes the last load fetched (with the gaps between coalesced ranges,
            and every byte of a share read twice; 0 for a ``fill`` load served from what its
            ``verify`` load kept).
        passes: what the next load does (see :data:`Passes`; ``both`` unless a caller that
            coordinates the ranks, :func:`fastckpt.dcp.load_state`, splits them).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        verify: bool = True,
        stage_bytes: int | None = DEFAULT_STAGE_BYTES,
    ) -> None:
        """Point the reader at ``path``; nothing is read until a load (on object storage the
        store's client is built here)."""
        super().__init__()
        if stage_bytes is not None and stage_bytes < 0:
            raise ValueError(f"stage_bytes={stage_bytes} must be >= 0 (or None)")
        check_url_spelling(path)
        self.path = Path(path)
        self.verify = verify
        self.stage_bytes = stage_bytes
        self.bytes_read = 0
        self.bytes_fetched = 0
        self.load_id = new_generation()
        self._record: Record | None = None
        self._pinned: Record | None = None
        self._metadata_error: BaseException | None = None
        self.passes: Passes = "both"
        self._held: _Held | None = None
        # The store's client (cached per process) is built now, not by the first load.
        backend_for(self.path)

    # ------------------------------------------------------------------ DCP protocol

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a new load, optionally from another checkpoint directory."""
        if checkpoint_id:
            check_url_spelling(checkpoint_id)
            self.path = Path(checkpoint_id)
            backend_for(self.path)
        self._record = None
        self._pinned = None
        self._metadata_error = None
        self.passes = "both"
        self.release()
        self.load_id = new_generation()

    def release(self) -> None:
        """Close the files a ``verify`` load kept open for the ``fill`` load (and drop the
        bytes it kept)."""
        if self._held is not None:
            self._held.files.close()
            self._held = None

    def use_record(self, record: Record) -> None:
        """Make the next load read ``record`` (already read and checked by the caller, e.g.
        against the templates) instead of reading the commit record again, so that what was
        checked is what is loaded even if a save commits in between."""
        self._pinned = record

    def read_metadata(self) -> Metadata:
        """DCP's metadata, decoded from the JSON commit record (or the record given to
        :meth:`use_record`).

        A record that cannot be read is not raised here: DCP would replace the error by an
        untyped ``AssertionError("metadata is None ...")``. It is raised by
        :meth:`set_up_storage_reader`, the next call, so that DCP's ``CheckpointException``
        carries the typed error (``NotCommittedError``, ``CheckpointFormatError``,
        ``ChecksumMismatchError``) as the rank's failure.
        """
        self._metadata_error = None
        try:
            self._record = self._pinned if self._pinned is not None else read_record(self.path)
            refuse_torch_checkpoint(self.path, "load")
        except (OSError, CheckpointFormatError, ChecksumMismatchError) as err:
            self._record = None
            self._metadata_error = err
            return Metadata(state_dict_metadata={})
        finally:
            self._pinned = None
        metadata = self._record.metadata
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        """Keep the storage index of the metadata DCP planned with.

        Raises:
            NotCommittedError, CheckpointFormatError, ChecksumMismatchError: the commit record
                could not be read (see :meth:`read_metadata`).
        """
        if self._metadata_error is not None:
            error, self._metadata_error = self._metadata_error, None
            raise error
        if self._record is None or self._record.metadata is not metadata:
            raise RuntimeError("fastckpt.dcp.Reader: read_metadata() must come first")

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Tag the plan with what the coordinator needs (:class:`~fastckpt.dcp.peers.Note`):
        the generation this rank read, the record's files this node holds, and the ranges
        this rank's items need of the files it does not (node-local storage)."""
        record = self._require_record()
        items = self._located(record, plan)
        files = self._files(record) if self._held is None else self._held.files
        try:
            ranges = [_want(files, item, chunk).range for item, chunk in items]
            found = peers.note(record, files, [chunk for _, chunk in items], ranges)
        finally:
            if self._held is None:
                files.close()
        return dataclasses.replace(plan, storage_data=found)

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Check that every rank read the same commit (a save may have committed between the
        ranks' reads), and plan the ranges that ranks read from other ranks' nodes
        (:func:`~fastckpt.dcp.peers.schedule`).

        Raises:
            CheckpointFormatError: ranks read different generations; load again.
            FileNotFoundError: a file some rank needs is on no rank's node.
        """
        notes = [plan.storage_data for plan in plans]
        generations = {note.generation for note in notes}
        if len(generations) > 1:
            raise CheckpointFormatError(
                f"{self.path}: ranks read different commits ({sorted(map(str, generations))}); "
                "a save committed during the load. Load again."
            )
        transfers = peers.schedule(notes, self.path / notes[0].generation)
        return [
            dataclasses.replace(plan, storage_data=peers.Schedule(note.generation, transfers))
            for plan, note in zip(plans, notes, strict=True)
        ]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read and verify every item of this rank's plan, then fill the planner's targets
        (see :attr:`passes`): nothing reaches a target while any byte is unverified.

        Raises:
            ChecksumMismatchError: a chunk's bytes differ from their crc32c (names the file
                and the tensor); no target was written.
            CheckpointMismatchError: a target's dtype is not the saved one (no cast is done;
                names the key, both dtypes and the fix); no target was written.
            CheckpointFormatError, FileNotFoundError: a data file is not what the record says.
        """
        record = self._require_record()
        items = self._located(record, plan)
        if self.passes != "verify":
            _check_target_dtypes(self.path, items, planner)
        held, self._held = self._held, None
        if held is None:
            held = _Held(self._files(record))
        files = held.files
        keep = self.passes == "verify"
        try:
            transfers = plan.storage_data.transfers if plan.storage_data is not None else ()
            chunks = {chunk.file: chunk for chunk in record.storage.values()}
            peers.exchange(transfers, files, chunks)
            fetched = files.bytes_read
            if files.local:
                self._read_each(files, items, planner)
                self._held = _Held(files) if keep else None
            else:
                self._held = self._read_planned(held, items, planner)
            self.bytes_fetched = files.bytes_read - fetched
        finally:
            if not keep:
                files.close()
        future: Future[None] = Future()
        future.set_result(None)
        return future

    @property
    def checkpoint_id(self) -> str:
        """The checkpoint directory."""
        return str(self.path)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """A directory (or ``s3://`` prefix) with a fastckpt commit record."""
        record = Path(checkpoint_id) / RECORD_NAME
        try:
            info = backend_for(record).stat(record)
        except (OSError, ValueError):
            return False
        return info.regular

    # ------------------------------------------------------------------ reading

    def _files(self, record: Record) -> ChunkFiles:
        """The data files of ``record``'s generation (opened as they are read)."""
        directory = self.path / record.generation
        return ChunkFiles(directory, verify=self.verify, within=self.path)

    def _require_record(self) -> Record:
        if self._record is None:
            raise RuntimeError("fastckpt.dcp.Reader: read_metadata() must come first")
        return self._record

    def _located(self, record: Record, plan: LoadPlan) -> list[tuple[ReadItem, StoredChunk]]:
        """The plan's items with their stored chunks, in file and offset order."""
        located = []
        for item in plan.items:
            chunk = record.storage.get(item.storage_index)
            if chunk is None:
                raise CheckpointFormatError(
                    f"{record.path}: no stored data for {item.storage_index.fqn!r} at "
                    f"{list(item.storage_index.offset or [])}"
                )
            located.append((item, chunk))
        return sorted(located, key=lambda pair: (pair[1].file, pair[1].offset))

    def _read_each(
        self, files: ChunkFiles, items: list[tuple[ReadItem, StoredChunk]], planner: LoadPlanner
    ) -> None:
        """A local disk's load, item by item: each item's range is verified in one reusable
        buffer, then read again straight into its target (verified again) when the target
        can take the whole chunk. The second read comes from the page cache, and costs less
        than holding the share in memory and copying it (measured: the same time, with
        more variance, for a share held whole)."""
        if self.passes != "fill" and self.verify:
            before = files.bytes_read
            for item, chunk in items:
                _check_item(files, item, chunk)
            self.bytes_read = files.bytes_read - before
        if self.passes != "verify":
            before = files.bytes_read
            for item, chunk in items:
                _fill_item(files, item, chunk, planner)
            if self.passes == "fill" or not self.verify:
                self.bytes_read = files.bytes_read - before

    def _read_planned(
        self, held: _Held, items: list[tuple[ReadItem, StoredChunk]], planner: LoadPlanner
    ) -> _Held | None:
        """An object store's load: every read planned first and coalesced, each batch fetched
        with its requests in flight together and verified once (see
        :class:`~fastckpt.container.sharded.reads.ReadPlan`); what a ``verify`` load keeps."""
        files = held.files
        reads = ReadPlan(files, [_want(files, i, c) for i, c in items], self.stage_bytes)
        self.bytes_read = reads.needed_bytes
        if self.passes == "fill" and held.views is not None and held.key == reads.key:
            self._fill(files, items, reads.wants, held.views, planner)
            return None
        if self.passes == "verify":
            return self._verify(files, items, reads)
        if self.passes == "both" and len(reads.batches) > 1:
            self._verify(files, items, reads)  # a first read, batch by batch
        for batch in reads.batches:
            self._fill(files, items, reads.wants, reads.read(batch), planner)
        return None

    def _verify(
        self, files: ChunkFiles, items: list[tuple[ReadItem, StoredChunk]], reads: ReadPlan
    ) -> _Held:
        """Read and verify every batch (values decoded too), touching no target; what a
        ``fill`` load may reuse: the verified bytes when they were one batch."""
        if not self.verify:
            return _Held(files)
        views: dict[int, np.ndarray] = {}
        for batch in reads.batches:
            views = reads.read(batch)
            _prepare(files.directory, items, reads.wants, views)
        if len(reads.batches) == 1:
            return _Held(files, reads.key, views)
        return _Held(files)

    def _fill(
        self,
        files: ChunkFiles,
        items: list[tuple[ReadItem, StoredChunk]],
        wants: list[Want],
        views: dict[int, np.ndarray],
        planner: LoadPlanner,
    ) -> None:
        """Hand the verified bytes of the items in ``views`` to the planner: every target is
        resolved and its size checked before the first one is written."""
        sources = _prepare(files.directory, items, wants, views)
        targets: list[tuple[ReadItem, torch.Tensor, torch.Tensor]] = []
        values: list[tuple[ReadItem, Any]] = []
        for index, source in sources.items():
            item = items[index][0]
            if item.type == LoadItemType.BYTE_IO:
                values.append((item, source))
                continue
            target = planner.resolve_tensor(item).detach()
            if target.size() != source.size():
                raise CheckpointFormatError(
                    f"{item.storage_index.fqn}: the plan wants {list(target.size())} but the "
                    f"stored chunk gives {list(source.size())}"
                )
            targets.append((item, target, source))
        for item, value in values:
            planner.load_bytes(item, as_planner_bytes(value))
        for item, target, source in targets:
            copy_values(target, source)
            planner.commit_tensor(item, target)


def _check_target_dtypes(
    path: Path, items: list[tuple[ReadItem, StoredChunk]], planner: LoadPlanner
) -> None:
    """Refuse, before any target is written, a target tensor whose dtype is not its stored
    chunk's: torch's ``copy_`` would cast (int64 ``2**40 + 3`` into float32 loses its low
    bits), and a checkpoint that loads must give back exactly what was saved.

    Raises:
        CheckpointMismatchError: names the key, both dtypes and the fix.
    """
    for item, chunk in items:
        if item.type == LoadItemType.BYTE_IO or chunk.kind != "tensor":
            continue  # a value; a chunk of another kind is refused by _want, typed
        stored = dtype_from_name(chunk.dtype or "")
        target = planner.resolve_tensor(item)
        if target.dtype != stored:
            raise CheckpointMismatchError(
                f"{item.storage_index.fqn}: checkpoint {path} holds it as {stored}, the "
                f"template is {target.dtype}; a load gives back exactly what was saved, so no "
                f"cast is done: load into a template of the saved dtype ({stored}), then cast "
                f"it (.to({target.dtype}))"
            )


def _want(files: ChunkFiles, item: ReadItem, chunk: StoredChunk) -> Want:
    """What one item needs of its stored chunk (checked against the chunk's kind and shape
    before anything is read)."""
    if item.type == LoadItemType.BYTE_IO:
        if chunk.kind == "tensor":
            raise CheckpointFormatError(f"{item.storage_index.fqn}: stored as a tensor")
        return files.want(chunk)
    if chunk.kind != "tensor":
        raise CheckpointFormatError(f"{item.storage_index.fqn}: stored as {chunk.kind}")
    return files.want_box(chunk, item.storage_offsets, item.lengths)


def _prepare(
    directory: Path,
    items: list[tuple[ReadItem, StoredChunk]],
    wants: list[Want],
    views: dict[int, np.ndarray],
) -> dict[int, Any]:
    """What each item in ``views`` hands over, from its verified bytes: the box of a tensor
    (a view of them) or a decoded non-tensor value; raises before any target is touched if
    a value does not decode."""
    sources: dict[int, Any] = {}
    for index, data in views.items():
        item, chunk = items[index]
        want = wants[index]
        if item.type == LoadItemType.BYTE_IO:
            where = f"{directory / chunk.file}: {item.storage_index.fqn!r}"
            sources[index] = decode_value(where, chunk.kind, data.tobytes())
        else:
            sources[index] = box_view(want, data, item.storage_offsets, item.lengths)
    return sources


def _fill_item(files: ChunkFiles, item: ReadItem, chunk: StoredChunk, planner: LoadPlanner) -> None:
    """Read one (verified) item into its target, checked again, and hand it over."""
    if item.type == LoadItemType.BYTE_IO:
        planner.load_bytes(item, as_planner_bytes(_value(files, item, chunk)))
        return
    _want(files, item, chunk)
    target = planner.resolve_tensor(item).detach()
    whole = (
        list(item.storage_offsets) == [0] * len(item.lengths)
        and tuple(item.lengths) == chunk.tensor_shape
    )
    if whole and target.size() == tuple(item.lengths) and files.read_into(chunk, target):
        planner.commit_tensor(item, target)
        return
    source = files.read_box(chunk, item.storage_offsets, item.lengths)
    if target.size() != source.size():
        raise CheckpointFormatError(
            f"{item.storage_index.fqn}: the plan wants {list(target.size())} but the stored "
            f"chunk gives {list(source.size())}"
        )
    copy_values(target, source)
    planner.commit_tensor(item, target)


def _value(files: ChunkFiles, item: ReadItem, chunk: StoredChunk) -> Any:
    """The verified, decoded non-tensor value of an item."""
    _want(files, item, chunk)
    payload = files.read_bytes(chunk).numpy().tobytes()
    where = f"{files.directory / chunk.file}: {item.storage_index.fqn!r}"
    return decode_value(where, chunk.kind, payload)


def _check_item(files: ChunkFiles, item: ReadItem, chunk: StoredChunk) -> None:
    """Read and verify what one item needs (into the reusable buffer), and check that it
    can be handed over, without touching any target."""
    if item.type == LoadItemType.BYTE_IO:
        _value(files, item, chunk)
        return
    _want(files, item, chunk)
    files.read_box(chunk, item.storage_offsets, item.lengths)
