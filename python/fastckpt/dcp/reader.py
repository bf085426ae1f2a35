"""``fastckpt.dcp.Reader``: a ``torch.distributed.checkpoint`` storage reader on fastckpt.

```python
dcp.load(state, storage_reader=fastckpt.dcp.Reader("ckpt/step-100"))
```

The reader takes DCP's metadata from the JSON commit record (never a pickle), reads from each
file only the rows of each chunk that this rank's plan asks for (rounded out to verification
blocks), checks their crc32c, and copies them into DCP's target tensors. Resharding (a
different world size or mesh) is DCP's planning; the reader only serves byte ranges.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from fastckpt.dcp.chunks import ChunkFiles
from fastckpt.dcp.commit import RECORD_NAME, new_generation, read_record
from fastckpt.dcp.metadata import Record, StoredChunk
from fastckpt.dcp.values import as_planner_bytes, decode_value
from fastckpt.errors import CheckpointFormatError
from fastckpt.store.dispatch import require_local

__all__ = ["Reader"]

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

    # ------------------------------------------------------------------ DCP protocol

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a new load, optionally from another checkpoint directory."""
        if checkpoint_id:
            require_local(checkpoint_id, "fastckpt.dcp.Reader", _INSTEAD)
            self.path = Path(checkpoint_id)
        self._record = None
        self.load_id = new_generation()

    def read_metadata(self) -> Metadata:
        """DCP's metadata, decoded from the JSON commit record.

        Raises:
            NotCommittedError: the directory has no committed checkpoint.
            CheckpointFormatError: the record is not a valid JSON record (e.g. a pickle).
        """
        self._record = read_record(self.path)
        metadata = self._record.metadata
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        """Keep the storage index of the metadata DCP planned with."""
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
        """Read, verify and hand over every item of this rank's plan."""
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
        with ChunkFiles(self.path / record.generation, verify=self.verify) as files:
            try:
                for file in sorted(by_file):
                    for item, chunk in sorted(by_file[file], key=lambda pair: pair[1].offset):
                        self._read_item(files, item, chunk, planner)
            finally:
                self.bytes_read = files.bytes_read
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
        self, files: ChunkFiles, item: ReadItem, chunk: StoredChunk, planner: LoadPlanner
    ) -> None:
        if item.type == LoadItemType.BYTE_IO:
            if chunk.kind == "tensor":
                raise CheckpointFormatError(f"{item.storage_index.fqn}: stored as a tensor")
            payload = files.read_bytes(chunk).numpy().tobytes()
            where = f"{files.directory / chunk.file}: {item.storage_index.fqn!r}"
            planner.load_bytes(item, as_planner_bytes(decode_value(where, chunk.kind, payload)))
            return
        if chunk.kind != "tensor":
            raise CheckpointFormatError(f"{item.storage_index.fqn}: stored as {chunk.kind}")
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
