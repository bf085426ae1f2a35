"""``fastckpt.dcp.Writer``: a ``torch.distributed.checkpoint`` storage writer on fastckpt.

```python
import torch.distributed.checkpoint as dcp
import fastckpt.dcp

dcp.save(state, storage_writer=fastckpt.dcp.Writer("ckpt/step-100"))
future = dcp.async_save(state, storage_writer=fastckpt.dcp.Writer("ckpt/step-200"))
```

DCP plans (which rank writes which chunk, deduplication); the writer stores each rank's chunks
in safetensors files written by the Rust core (crc32c per entry, temp -> fsync -> rename; on
an ``s3://`` checkpoint id, each rank's own parallel multipart uploads, each tensor's crc32c
computed just before, for the header at the object's front), with
DCP's sharding offsets in the header (``DCP_SHARDING_INFO``, as torch's own safetensors
writer records them), non-tensor values without pickle, and commits with a JSON record written
last by the coordinator (see :mod:`fastckpt.container.sharded.commit`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from fastckpt import _native
from fastckpt.container.sharded.chunks import DEFAULT_BLOCK_BYTES, block_checksums
from fastckpt.container.sharded.commit import (
    RECORD_NAME,
    commit,
    data_file_name,
    make_generation_dir,
    new_generation,
    refuse_torch_checkpoint,
)
from fastckpt.container.sharded.values import encode_value, planner_object
from fastckpt.dcp.stager import DcpStager
from fastckpt.errors import CheckpointFormatError, InvalidInputError, NotACheckpointError
from fastckpt.format.records import COMMIT_RECORD, MANIFEST
from fastckpt.format.sharded import StoredChunk, decode_record, encode_record
from fastckpt.io.files import (
    DEFAULT_WRITE_THREADS,
    MAX_THREADS,
    byte_view,
    check_count,
    check_flag,
    host_tensor,
    read_metadata,
    write_tensors,
)
from fastckpt.io.staging import StagerOptions
from fastckpt.storage.backend import explain_full_disk, stored_sizes
from fastckpt.storage.registry import (
    backend_for,
    check_url_spelling,
    display_path,
    is_local,
    is_object_url,
)

__all__ = ["DCP_SHARDING_INFO_KEY", "Writer"]

#: safetensors metadata key under which DCP's safetensors support records chunk offsets.
DCP_SHARDING_INFO_KEY = "DCP_SHARDING_INFO"
_DCP_VERSION = "1.0.0"  # torch.distributed.checkpoint.filesystem.CURRENT_DCP_VERSION
_HF_DCP_VERSION = "1.0"  # torch's safetensors sharding-info version


@dataclasses.dataclass(frozen=True)
class _RankPlan:
    """What the coordinator tells each rank: the generation to write into, and its rank."""

    generation: str
    rank: int


def _check_arguments(
    threads: object,
    direct_io: object,
    fsync: object,
    block_bytes: object,
    node_local: object,
    replace_unsharded: object,
) -> None:
    """Refuse :class:`Writer`'s arguments of the wrong type or range when it is made: they
    were checked only by the save, after a generation folder (and with ``block_bytes=2.5`` a
    rank's tensor file) was written into the checkpoint directory.

    Raises:
        InvalidInputError: ``threads`` not an int from 1 to 65536 or None, a flag not a bool
            (``direct_io``: or None), ``block_bytes`` not an int (each a ``TypeError``).
        ValueError: ``block_bytes`` not positive.
    """
    where = "fastckpt.dcp.Writer"
    check_count(threads, f"{where}: threads", DEFAULT_WRITE_THREADS, 1, MAX_THREADS)
    check_flag(direct_io, "direct_io", where, none=True)
    for name, flag in (
        ("fsync", fsync),
        ("node_local", node_local),
        ("replace_unsharded", replace_unsharded),
    ):
        check_flag(flag, name, where)
    if isinstance(block_bytes, bool) or not isinstance(block_bytes, int):
        raise InvalidInputError(f"{where}: block_bytes must be an int (bytes), got {block_bytes!r}")
    if block_bytes <= 0:
        raise ValueError(f"{where}: block_bytes must be positive, got {block_bytes}")


class Writer(StorageWriter, DcpStager):
    """A DCP ``StorageWriter`` (and ``AsyncStager``) that saves through fastckpt.

    Args:
        path: the checkpoint directory (the DCP checkpoint id). Saving again to the same path
            replaces the checkpoint atomically.
        threads: writer threads per file (see :func:`fastckpt.save_file`).
        direct_io: O_DIRECT mode (None: chosen per file, see :func:`fastckpt.save_file`).
        fsync: make files durable before committing (turn off only for scratch runs).
        block_bytes: chunks larger than this also get one crc32c per block of this size, so a
            resharding load can verify partial reads.
        stager_options: how ``dcp.async_save`` stages CUDA tensors.
        node_local: each rank's ``path`` may be its own node's disk, holding only that rank's
            files (a :class:`~fastckpt.training.hooks.CheckpointHook` with a ``durable_dir``
            promotes every rank's files there, see docs/tiers.md): the coordinator checks only
            its own files at commit. Otherwise (the default) every rank's file must be in
            ``path`` as the coordinator sees it, or nothing is committed: a checkpoint whose
            shards are spread over node-local disks could not be restored.
        _extensions: DCP's stream transforms (``FileSystemWriter(_extensions=[ZStandard()])``)
            are refused when given (``ValueError`` naming the alternative): fastckpt stores
            each chunk as is, with a crc32c per block, so that a resharding load reads and
            verifies only its byte ranges; a compressed stream could not be read in ranges.
        replace_unsharded: a ``CheckpointManager`` checkpoint (``commit.json``) at the
            checkpoint id is this save's to replace (the manager's own writer: the manager
            removes that checkpoint once this save commits). Otherwise a save there is
            refused (``NotACheckpointError``, nothing written), as is one into a
            ``save_checkpoint`` root (``manifest.json``): a sharded record beside either
            leaves that checkpoint's own calls refusing the folder or loading the wrong one.

    A save staged by ``dcp.async_save`` runs only in the world (rank and number of ranks of
    the default process group) it was staged in: torch DCP's background save runs as a
    one-process save when the process group was destroyed meanwhile (a job ending without
    waiting for the future), and each rank would then commit its own shards alone. Such a
    save is refused (``RuntimeError``, nothing written or committed).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        threads: int | None = None,
        direct_io: bool | None = None,
        fsync: bool = True,
        block_bytes: int = DEFAULT_BLOCK_BYTES,
        stager_options: StagerOptions | None = None,
        node_local: bool = False,
        replace_unsharded: bool = False,
        _extensions: Sequence[Any] | None = None,
    ) -> None:
        """Point the writer at ``path``; nothing is written until a save. On object storage
        the store's clients are built here, not by the first save (which would stall that
        long longer)."""
        if _extensions:
            names = ", ".join(type(extension).__name__ for extension in _extensions)
            raise ValueError(
                f"fastckpt.dcp.Writer does not apply DCP stream transforms ({names}): it "
                "stores chunks as they are, with a crc32c per block, so resharded loads read "
                "and verify only their byte ranges. For compressed sharded checkpoints use "
                "torch.distributed.checkpoint.FileSystemWriter(path, _extensions=[...]) (and "
                "its FileSystemReader to load them)"
            )
        _check_arguments(threads, direct_io, fsync, block_bytes, node_local, replace_unsharded)
        StorageWriter.__init__(self)
        DcpStager.__init__(self, stager_options)
        check_url_spelling(path)
        self.path = Path(path)
        self.threads = threads
        self.direct_io = direct_io
        self.fsync = fsync
        self.block_bytes = block_bytes
        self.node_local = node_local
        self.replace_unsharded = replace_unsharded
        #: ``(rank, world size)`` of the default process group when ``dcp.async_save`` staged
        #: the save not yet set up (None: no staged save, e.g. a synchronous ``dcp.save``).
        self._staged_world: tuple[int, int] | None = None
        self.is_coordinator = False
        self.rank = 0
        self._generation: str | None = None
        #: The generation the save started by the last :meth:`reset` writes into, once this
        #: rank knows it (the coordinator when it plans, the others when they write).
        self.current_generation: str | None = None
        self.save_id = new_generation()
        backend_for(self.path).prepare_writer()

    # ------------------------------------------------------------------ DCP protocol

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a new save, optionally into another checkpoint directory."""
        if checkpoint_id:
            check_url_spelling(checkpoint_id)
            self.path = Path(checkpoint_id)
            backend_for(self.path).prepare_writer()
        self.save_id = new_generation()
        self.current_generation = None

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """:meth:`DcpStager.stage`, remembering the world the save is staged in (checked when
        the background save sets this writer up: :meth:`set_up_storage_writer`)."""
        self._staged_world = _world()
        return super().stage(state_dict)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Record this rank's role.

        Raises:
            ValueError: ``use_collectives=False`` (fastckpt commits through the coordinator).
            RuntimeError: a save staged by ``dcp.async_save`` runs in another world than it
                was staged in (the process group was destroyed or replaced meanwhile);
                nothing is written.
        """
        staged, self._staged_world = self._staged_world, None
        if staged is not None and staged != _world():
            self.release()
            raise RuntimeError(
                f"{display_path(self.path)}: this async save was staged on rank {staged[0]} "
                f"of {staged[1]} but runs as rank {_world()[0]} of {_world()[1]}: the process "
                "group was destroyed (or replaced) before the background save started, and a "
                "rank saving alone would commit only its own shards. Nothing of this save was "
                "written or committed; the checkpoint saved before is intact. Wait for the "
                "save's future (or close the CheckpointManager) before destroy_process_group"
            )
        if not kwargs.get("use_collectives", True):
            raise ValueError(
                "fastckpt.dcp.Writer commits through the coordinator rank; call dcp.save "
                "with use_collectives=True (the default)"
            )
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank") or 0)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Nothing to add locally."""
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Pick a fresh generation directory for this save and tell every rank.

        Raises:
            CheckpointFormatError: the directory holds a checkpoint of torch's
                ``FileSystemWriter`` (nothing is written).
            NotACheckpointError: the directory is a ``save_checkpoint`` root or (unless
                ``replace_unsharded``) a ``CheckpointManager`` checkpoint (nothing is written).
        """
        refuse_torch_checkpoint(self.path, "save into")
        self._refuse_other_checkpoint()
        generation = new_generation()
        self._generation = self.current_generation = generation
        return [
            dataclasses.replace(plan, storage_data=_RankPlan(generation, rank))
            for rank, plan in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write this rank's chunks and values into the generation directory, durably."""
        try:
            with explain_full_disk(self.path):
                results = self._write(plan, planner)
        finally:
            self.release()
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator: commit the record (after every rank's files are durable), then remove
        older generations."""
        storage: dict[MetadataIndex, StoredChunk] = {}
        for rank_results in results:
            for result in rank_results:
                storage[result.index] = result.storage_data
        # The results name their generation (a writer may run overlapping async saves).
        generations: set[str | None] = {chunk.generation for chunk in storage.values()}
        generations = generations or {self._generation}
        if len(generations) != 1 or None in generations:
            raise RuntimeError(f"fastckpt.dcp.Writer: inconsistent save results {generations}")
        (generation,) = generations
        assert generation is not None
        directory = self.path / generation
        metadata.version = _DCP_VERSION
        metadata.storage_data = storage
        metadata.storage_meta = self.storage_meta()
        record = encode_record(generation, metadata, storage)
        _refuse_unloadable(self.path, record)
        with explain_full_disk(self.path):
            make_generation_dir(self.path, generation)  # a save with no data at all
            commit(
                self.path,
                generation,
                record,
                lambda: _check_files_present(directory, storage, self.rank, self.node_local),
            )

    def _refuse_other_checkpoint(self) -> None:
        """Refuse to save into a ``save_checkpoint`` root or a ``CheckpointManager``
        checkpoint (see ``replace_unsharded``), before anything is written.

        Raises:
            NotACheckpointError: names the folder, its record and the fix.
        """
        backend = backend_for(self.path)
        shown = display_path(self.path)
        if backend.exists(self.path / MANIFEST):
            raise NotACheckpointError(
                f"{shown} holds {MANIFEST}: it is a save_checkpoint root, and a sharded "
                "checkpoint saved into it would leave the root refusing its next "
                "save_checkpoint and failing verify; nothing was written. Save the sharded "
                "checkpoint under another checkpoint id, beside the root (a CheckpointHook "
                "saves sharded state into its root's indices itself)"
            )
        if not self.replace_unsharded and backend.exists(self.path / COMMIT_RECORD):
            raise NotACheckpointError(
                f"{shown} holds {COMMIT_RECORD}: it is a CheckpointManager checkpoint, and a "
                "sharded checkpoint saved beside it would leave CheckpointManager.load "
                "reading one of the two; nothing was written. Save under another checkpoint "
                "id, or through CheckpointManager.save, which replaces its checkpoint"
            )

    def storage_meta(self) -> StorageMeta | None:
        """DCP's storage metadata: the checkpoint id and this save's id."""
        return StorageMeta(checkpoint_id=str(self.path), save_id=self.save_id)

    @property
    def checkpoint_id(self) -> str:
        """The checkpoint directory."""
        return str(self.path)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Any local path or ``s3://`` URL can be a checkpoint directory."""
        return isinstance(checkpoint_id, (str, os.PathLike))

    # ------------------------------------------------------------------ writing

    def _write(self, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        rank_plan = plan.storage_data
        if not isinstance(rank_plan, _RankPlan):
            raise RuntimeError(
                "fastckpt.dcp.Writer got a plan without its generation; plan caching "
                "(enable_plan_caching) is not supported"
            )
        self.current_generation = rank_plan.generation
        if not plan.items:
            return []
        directory = make_generation_dir(self.path, rank_plan.generation)
        tensor_items = [i for i in plan.items if i.type != WriteItemType.BYTE_IO]
        value_items = [i for i in plan.items if i.type == WriteItemType.BYTE_IO]
        results: list[WriteResult] = []
        for part, items in enumerate(_files_of(tensor_items)):
            name = data_file_name(rank_plan.rank, part, ".safetensors")
            results += self._write_tensors(directory, name, items, planner)
        if value_items:
            name = data_file_name(rank_plan.rank, 0, ".values")
            results += self._write_values(directory / name, name, value_items, planner)
        return results

    def _write_tensors(
        self, directory: Path, name: str, items: Sequence[WriteItem], planner: SavePlanner
    ) -> list[WriteResult]:
        tensors: dict[str, torch.Tensor] = {}
        sharding: dict[str, dict[str, list[int]]] = {}
        for item in items:
            fqn = item.index.fqn
            tensor = planner.resolve_data(item)
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"{fqn}: the planner resolved a tensor item to {type(tensor)}")
            tensors[fqn] = host_tensor(fqn, tensor)
            offsets = item.tensor_data.chunk.offsets if item.tensor_data else ()
            sharding[fqn] = {"saved_offsets": [int(o) for o in offsets]}
        path = directory / name
        metadata = {
            DCP_SHARDING_INFO_KEY: json.dumps(sharding),
            "DCP_VERSION": _HF_DCP_VERSION,
            "format": "pt",
        }
        backend = backend_for(path)
        if is_local(backend):
            report = write_tensors(
                tensors,
                path,
                metadata,
                threads=self.threads,
                direct_io=self.direct_io,
                fsync=self.fsync,
            )
            header = read_metadata(path)
        else:
            # This rank's own upload, under the generation's prefix (no rename to wait for:
            # the coordinator's record, written last, is the commit).
            staging = backend.stage(directory)
            record = staging.put_tensors(name, tensors, metadata=metadata)
            # The header this rank just uploaded (no read-back request).
            header = staging.written_header(name)
            report = {
                "file_len": record["size"],
                "file_crc32c": record["crc32c"],
                "checksums": {fqn: info["crc32c"] for fqn, info in header["tensors"].items()},
            }
        results = []
        for item in items:
            fqn = item.index.fqn
            entry = header["tensors"][fqn]
            begin, end = entry["data_offsets"]
            length = end - begin
            blocks = None
            if length > self.block_bytes:
                blocks = block_checksums(byte_view(tensors[fqn]), self.block_bytes)
            chunk = StoredChunk(
                file=name,
                kind="tensor",
                offset=header["data_start"] + begin,
                length=length,
                crc32c=int(report["checksums"][fqn]),
                name=fqn,
                dtype=entry["dtype"],
                shape=tuple(entry["shape"]),
                block_bytes=self.block_bytes if blocks is not None else None,
                blocks=blocks,
                file_len=int(report["file_len"]),
                file_crc32c=report.get("file_crc32c"),
                generation=directory.name,
            )
            results.append(WriteResult(index=item.index, size_in_bytes=length, storage_data=chunk))
        return results

    def _write_values(
        self, path: Path, name: str, items: Sequence[WriteItem], planner: SavePlanner
    ) -> list[WriteResult]:
        payloads = []
        offset = 0
        placed = []
        for item in items:
            kind, payload = encode_value(item.index.fqn, planner_object(planner, item))
            placed.append((item, kind, offset, payload))
            payloads.append(payload)
            offset += len(payload)
        data = b"".join(payloads)
        if is_object_url(path):
            backend_for(path).stage(path.parent).put_bytes(name, data)
        else:
            _native.write_bytes_atomic(str(path), data, self.fsync)
        file_crc = _native.crc32c(data)
        return [
            WriteResult(
                index=item.index,
                size_in_bytes=len(payload),
                storage_data=StoredChunk(
                    file=name,
                    kind=kind,
                    offset=start,
                    length=len(payload),
                    crc32c=_native.crc32c(payload),
                    file_len=len(data),
                    file_crc32c=file_crc,
                    generation=path.parent.name,
                ),
            )
            for item, kind, start, payload in placed
        ]


def _world() -> tuple[int, int]:
    """``(rank, world size)`` of this process in the default process group; ``(0, 1)``
    without one (a save in one process)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _refuse_unloadable(path: Path, record: bytes) -> None:
    """Refuse to commit a record of the checkpoint ``path`` that its reader would refuse (a
    tensor whose chunks do not cover it, ...): decoded as a load decodes it, so that no save
    replaces a checkpoint that loads with one that does not (the commit removes the previous
    generation).

    Raises:
        CheckpointFormatError: what the reader would say, with "nothing was committed".
    """
    try:
        decode_record(path / RECORD_NAME, record)
    except CheckpointFormatError as err:
        raise CheckpointFormatError(
            f"{display_path(path)}: the commit record of this save would not load ({err}); "
            "nothing was committed and the checkpoint saved before is intact. The ranks' "
            "results did not make up the state (did every rank of the job take part?); "
            "save again"
        ) from err


def _check_files_present(
    directory: Path, storage: dict[MetadataIndex, StoredChunk], rank: int, node_local: bool
) -> None:
    """Refuse to commit unless every file of the save is in ``directory`` with its size as the
    coordinator (rank ``rank``) sees it: a concurrent save's cleanup removes an older, still
    unfinished generation as a whole, and a rank whose directory is another disk (node-local
    storage) leaves a checkpoint no process can restore. With ``node_local`` (the ranks'
    files are promoted to a shared tier, see docs/tiers.md), only the coordinator's own
    files are checked (every file when it wrote none); the others are taken from their ranks'
    results, each rank having written its files durably before reporting them. On an object
    store every file is looked up (in parallel), as a rank's result proves only that the
    store answered its upload: an object acknowledged and then lost (a store that did not
    keep it, a lifecycle rule) was committed, and the previous generation deleted after the
    commit, with both ranks reporting success (an adversarial store found it)."""
    backend = backend_for(directory)
    sizes = {chunk.file: chunk.file_len for chunk in storage.values()}
    own = data_file_name(rank, 0, "")
    mine = {
        name: size
        for name, size in sizes.items()
        if name.startswith(own) and name[len(own) : len(own) + 1] in (".", "-")
    }
    only_mine = node_local and mine
    others = {} if only_mine else {n: s for n, s in sizes.items() if n not in mine}
    # The coordinator's own files first: missing too, they mean a concurrent save's cleanup.
    checked = [*sorted(mine.items()), *sorted(others.items())]
    found = stored_sizes(backend, directory, [name for name, _ in checked])
    for (name, size), actual in zip(checked, found, strict=True):
        path = directory / name
        if actual == size:
            continue
        if mine and name not in mine and actual is None and not is_local(backend):
            raise RuntimeError(
                f"{path}: missing at commit time although its rank reported it written (the "
                "store did not keep it, or another process removed it); nothing was "
                "committed and the previous checkpoint is intact: save again"
            )
        if mine and name not in mine and actual is None:
            raise RuntimeError(
                f"{path}: another rank's shard file is not in {directory.parent} as rank {rank} "
                "sees it: that directory is not one directory the ranks share (each rank's "
                "holds only its own node's shards), so a checkpoint committed there could not "
                "be restored; nothing was committed. Save to a directory every rank sees, or "
                "through a CheckpointHook with a durable_dir (a shared filesystem or s3://) "
                "that every rank promotes its shards to"
            )
        raise RuntimeError(
            f"{path}: {'missing' if actual is None else f'{actual} bytes, not {size}'} at "
            "commit time (a concurrent save to the same checkpoint removed this "
            "unfinished generation); nothing was committed, save again"
        )


def _files_of(items: Sequence[WriteItem]) -> list[list[WriteItem]]:
    """Split a rank's tensor items into files that hold each name at most once (a rank rarely
    owns two chunks of one tensor; safetensors names must be unique)."""
    files: list[list[WriteItem]] = []
    names: list[set[str]] = []
    for item in items:
        for bucket, seen in zip(files, names, strict=True):
            if item.index.fqn not in seen:
                bucket.append(item)
                seen.add(item.index.fqn)
                break
        else:
            files.append([item])
            names.append({item.index.fqn})
    return files
