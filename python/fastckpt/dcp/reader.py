"""``fastckpt.dcp.Reader``: a ``torch.distributed.checkpoint`` storage reader on fastckpt.

```python
dcp.load(state, storage_reader=fastckpt.dcp.Reader("ckpt/step-100"))
```

The reader takes DCP's metadata from the JSON commit record (never a pickle), reads from each
file only the rows of each chunk that this rank's plan asks for (rounded out to verification
blocks), checks their crc32c, and copies them into DCP's target tensors. Resharding (a
different world size or mesh) is DCP's planning; the reader only serves byte ranges.

Nothing is handed to the planner before every byte of this rank's plan was read and verified:
a load reads each range twice, first to verify it (into one reusable buffer, so no more memory
than the largest verification piece), then into DCP's targets (verified again), with the files
opened once for both. A damaged chunk therefore leaves this rank's targets as they were, at the
cost of a second read of what the load needs (from the page cache when it fits there).
:func:`fastckpt.dcp.load_state` runs the two passes as two DCP loads, so that no rank fills a
target before every rank verified its share (see :attr:`Reader.passes`).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Literal

from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from fastckpt.container.sharded.chunks import ChunkFiles
from fastckpt.container.sharded.commit import RECORD_NAME, new_generation, read_record
from fastckpt.container.sharded.values import as_planner_bytes, decode_value
from fastckpt.errors import CheckpointFormatError, ChecksumMismatchError
from fastckpt.format.sharded import Record, StoredChunk
from fastckpt.storage.registry import backend_for

__all__ = ["Passes", "Reader"]

#: Which passes a load runs: ``both`` (verify this rank's share, then read it into the
#: targets), ``verify`` (only check it; keep the files open for a ``fill`` load next) or
#: ``fill`` (read it into the targets, verified again, from the files a ``verify`` load kept).
Passes = Literal["both", "verify", "fill"]


class Reader(StorageReader):
    """A DCP ``StorageReader`` for checkpoints written by :class:`fastckpt.dcp.Writer`.

    Args:
        path: the checkpoint directory (the DCP checkpoint id).
        verify: check the crc32c of every byte read (default). A mismatch raises
            :class:`fastckpt.ChecksumMismatchError` naming the file and tensor, which DCP
            reports inside its ``CheckpointException``.

    Attributes:
        bytes_read: bytes of the data files the last load needed (the byte ranges of its
            plan, rounded out to verification blocks; each range is read twice, verified and
            then into its target, and counted once).
        passes: what the next load does (see :data:`Passes`; ``both`` unless a caller that
            coordinates the ranks, :func:`fastckpt.dcp.load_state`, splits them).
    """

    def __init__(self, path: str | os.PathLike[str], *, verify: bool = True) -> None:
        """Point the reader at ``path``; nothing is read until a load."""
        super().__init__()
        self.path = Path(path)
        self.verify = verify
        self.bytes_read = 0
        self.load_id = new_generation()
        self._record: Record | None = None
        self._pinned: Record | None = None
        self._metadata_error: BaseException | None = None
        self.passes: Passes = "both"
        self._held: ChunkFiles | None = None

    # ------------------------------------------------------------------ DCP protocol

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a new load, optionally from another checkpoint directory."""
        if checkpoint_id:
            self.path = Path(checkpoint_id)
        self._record = None
        self._pinned = None
        self._metadata_error = None
        self.passes = "both"
        self.release()
        self.load_id = new_generation()

    def release(self) -> None:
        """Close the files a ``verify`` load kept open for the ``fill`` load."""
        if self._held is not None:
            self._held.close()
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
        """Tag the plan with the generation this rank read, for the coordinator to compare."""
        record = self._require_record()
        return dataclasses.replace(plan, storage_data=record.generation)

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Check that every rank read the same commit (a save may have committed between the
        ranks' reads).

        Raises:
            CheckpointFormatError: ranks read different generations; load again.
        """
        generations = {plan.storage_data for plan in plans}
        if len(generations) > 1:
            raise CheckpointFormatError(
                f"{self.path}: ranks read different commits ({sorted(map(str, generations))}); "
                "a save committed during the load. Load again."
            )
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Verify every item of this rank's plan, then read them into the planner's targets
        (see :attr:`passes`): nothing reaches a target while any byte is unverified.

        Raises:
            ChecksumMismatchError: a chunk's bytes differ from their crc32c (names the file
                and the tensor); no target was written.
            CheckpointFormatError, FileNotFoundError: a data file is not what the record says.
        """
        record = self._require_record()
        items = self._located(record, plan)
        files = self._held
        self._held = None
        if files is None:
            directory = self.path / record.generation
            files = ChunkFiles(directory, verify=self.verify, within=self.path)
        keep = False
        try:
            if self.passes != "fill" and self.verify:
                files.bytes_read = 0
                for item, chunk in items:
                    _check_item(files, item, chunk)
                self.bytes_read = files.bytes_read
            if self.passes == "verify":
                keep = True
            else:
                read_before = files.bytes_read
                for item, chunk in items:
                    self._fill_item(files, item, chunk, planner)
                if self.passes == "fill" or not self.verify:
                    self.bytes_read = files.bytes_read - read_before
        finally:
            if keep:
                self._held = files
            else:
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

    def _fill_item(
        self, files: ChunkFiles, item: ReadItem, chunk: StoredChunk, planner: LoadPlanner
    ) -> None:
        """Read one (verified) item into its target, checked again, and hand it over."""
        if item.type == LoadItemType.BYTE_IO:
            planner.load_bytes(item, as_planner_bytes(_value(files, item, chunk)))
            return
        _require_tensor(item, chunk)
        target = planner.resolve_tensor(item).detach()
        whole = list(item.storage_offsets) == [0] * len(item.lengths) and tuple(
            item.lengths
        ) == tuple(chunk.shape or ())
        if whole and target.size() == tuple(item.lengths) and files.read_into(chunk, target):
            planner.commit_tensor(item, target)
            return
        source = files.read_box(chunk, item.storage_offsets, item.lengths)
        if target.size() != source.size():
            raise CheckpointFormatError(
                f"{item.storage_index.fqn}: the plan wants {list(target.size())} but the stored "
                f"chunk gives {list(source.size())}"
            )
        target.copy_(source)
        planner.commit_tensor(item, target)


def _require_tensor(item: ReadItem, chunk: StoredChunk) -> None:
    if chunk.kind != "tensor":
        raise CheckpointFormatError(f"{item.storage_index.fqn}: stored as {chunk.kind}")


def _value(files: ChunkFiles, item: ReadItem, chunk: StoredChunk) -> Any:
    """The verified, decoded non-tensor value of an item."""
    if chunk.kind == "tensor":
        raise CheckpointFormatError(f"{item.storage_index.fqn}: stored as a tensor")
    payload = files.read_bytes(chunk).numpy().tobytes()
    where = f"{files.directory / chunk.file}: {item.storage_index.fqn!r}"
    return decode_value(where, chunk.kind, payload)


def _check_item(files: ChunkFiles, item: ReadItem, chunk: StoredChunk) -> None:
    """Read and verify what one item needs (into the reusable buffer), and check that it
    can be handed over, without touching any target."""
    if item.type == LoadItemType.BYTE_IO:
        _value(files, item, chunk)
        return
    _require_tensor(item, chunk)
    box = files.read_box(chunk, item.storage_offsets, item.lengths)
    if tuple(box.size()) != tuple(item.lengths):
        raise CheckpointFormatError(
            f"{item.storage_index.fqn}: the plan wants {list(item.lengths)} but the stored "
            f"chunk gives {list(box.size())}"
        )
