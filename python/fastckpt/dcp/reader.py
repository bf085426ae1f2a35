"""``fastckpt.dcp.Reader``: a ``torch.distributed.checkpoint`` storage reader on fastckpt.

```python
dcp.load(state, storage_reader=fastckpt.dcp.Reader("ckpt/step-100"))
```

The reader takes DCP's metadata from the JSON commit record (never a pickle), reads from each
file only the rows of each chunk that this rank's plan asks for (rounded out to verification
blocks), checks their crc32c, and copies them into DCP's target tensors. Resharding (a
different world size or mesh) is DCP's planning; the reader only serves byte ranges.

Nothing is handed to the planner before every byte of this rank's plan was read and verified:
the reads go to scratch tensors first (host memory for this rank's share of the load, freed
when the load ends), and only then are the targets filled and the values set. A damaged chunk
therefore leaves this rank's targets as they were. A planner that stages its targets itself
(attribute :data:`STAGES_READS` true, as :func:`fastckpt.dcp.load_state` uses, which fills
the templates only once every rank's reads verified) is read into directly.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from fastckpt.dcp.chunks import ChunkFiles
from fastckpt.dcp.commit import RECORD_NAME, new_generation, read_record
from fastckpt.dcp.metadata import Record, StoredChunk
from fastckpt.dcp.values import as_planner_bytes, decode_value
from fastckpt.errors import CheckpointFormatError, ChecksumMismatchError
from fastckpt.store.dispatch import require_local

__all__ = ["STAGES_READS", "Reader"]

#: Name of the planner attribute that says its resolved targets are scratch tensors already
#: (filled into the real state later), so the reader need not stage the reads itself.
STAGES_READS = "fastckpt_stages_reads"

#: What to use instead of an ``s3://`` URL (sharded checkpoints write through a filesystem).
_INSTEAD = (
    "load sharded (DCP) checkpoints from a shared filesystem path every rank can reach "
    "(object storage is not supported for them yet)"
)


class Reader(StorageReader):
    """A DCP ``StorageReader`` for checkpoints written by :class:`fastckpt.dcp.Writer`.

    Args:
        path: the checkpoint directory (the DCP checkpoint id).
        verify: check the crc32c of every byte read (default). A mismatch raises
            :class:`fastckpt.ChecksumMismatchError` naming the file and tensor, which DCP
            reports inside its ``CheckpointException``.

    Attributes:
        bytes_read: bytes this reader read from data files during the last load.
    """

    def __init__(self, path: str | os.PathLike[str], *, verify: bool = True) -> None:
        """Point the reader at ``path``; nothing is read until a load."""
        super().__init__()
        require_local(path, "fastckpt.dcp.Reader", _INSTEAD)
        self.path = Path(path)
        self.verify = verify
        self.bytes_read = 0
        self.load_id = new_generation()
        self._record: Record | None = None
        self._pinned: Record | None = None
        self._metadata_error: BaseException | None = None

    # ------------------------------------------------------------------ DCP protocol

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a new load, optionally from another checkpoint directory."""
        if checkpoint_id:
            require_local(checkpoint_id, "fastckpt.dcp.Reader", _INSTEAD)
            self.path = Path(checkpoint_id)
        self._record = None
        self._pinned = None
        self._metadata_error = None
        self.load_id = new_generation()

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
        """Read and verify every item of this rank's plan, then hand them all over (nothing
        reaches the planner's targets when a read fails)."""
        record = self._require_record()
        by_file: dict[str, list[tuple[ReadItem, StoredChunk]]] = {}
        for item in plan.items:
            chunk = record.storage.get(item.storage_index)
            if chunk is None:
                raise CheckpointFormatError(
                    f"{record.path}: no stored data for {item.storage_index.fqn!r} at "
                    f"{list(item.storage_index.offset or [])}"
                )
            by_file.setdefault(chunk.file, []).append((item, chunk))
        staged = bool(getattr(planner, STAGES_READS, False))
        handovers: list[Callable[[], None]] = []
        directory = self.path / record.generation
        with ChunkFiles(directory, verify=self.verify, within=self.path) as files:
            try:
                for file in sorted(by_file):
                    for item, chunk in sorted(by_file[file], key=lambda pair: pair[1].offset):
                        handovers.append(self._read_item(files, item, chunk, planner, staged))
            finally:
                self.bytes_read = files.bytes_read
        for handover in handovers:
            handover()
        future: Future[None] = Future()
        future.set_result(None)
        return future

    @property
    def checkpoint_id(self) -> str:
        """The checkpoint directory."""
        return str(self.path)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """A directory with a fastckpt commit record."""
        return (Path(checkpoint_id) / RECORD_NAME).is_file()

    # ------------------------------------------------------------------ reading

    def _require_record(self) -> Record:
        if self._record is None:
            raise RuntimeError("fastckpt.dcp.Reader: read_metadata() must come first")
        return self._record

    def _read_item(
        self,
        files: ChunkFiles,
        item: ReadItem,
        chunk: StoredChunk,
        planner: LoadPlanner,
        staged: bool,
    ) -> Callable[[], None]:
        """Read and verify one item; returns what hands it to the planner. Unless the planner
        stages (``staged``), a tensor is read into a scratch tensor, copied into its target
        by the hand-over."""
        if item.type == LoadItemType.BYTE_IO:
            if chunk.kind == "tensor":
                raise CheckpointFormatError(f"{item.storage_index.fqn}: stored as a tensor")
            payload = files.read_bytes(chunk).numpy().tobytes()
            where = f"{files.directory / chunk.file}: {item.storage_index.fqn!r}"
            value = decode_value(where, chunk.kind, payload)
            return lambda: planner.load_bytes(item, as_planner_bytes(value))
        if chunk.kind != "tensor":
            raise CheckpointFormatError(f"{item.storage_index.fqn}: stored as {chunk.kind}")
        target = planner.resolve_tensor(item).detach()
        destination = target if staged else torch.empty(target.size(), dtype=target.dtype)
        whole = list(item.storage_offsets) == [0] * len(item.lengths) and tuple(
            item.lengths
        ) == tuple(chunk.shape or ())
        if not (
            whole
            and destination.size() == tuple(item.lengths)
            and files.read_into(chunk, destination)
        ):
            source = files.read_box(chunk, item.storage_offsets, item.lengths)
            if destination.size() != source.size():
                raise CheckpointFormatError(
                    f"{item.storage_index.fqn}: the plan wants {list(destination.size())} but "
                    f"the stored chunk gives {list(source.size())}"
                )
            destination.copy_(source)

        def handover() -> None:
            if destination is not target:
                target.copy_(destination)
            planner.commit_tensor(item, target)

        return handover
