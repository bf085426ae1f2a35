"""FSDP2-sharded models in :class:`~fastckpt.TrainingStrategy` checkpoints.

A strategy whose models are sharded with ``torch.distributed.fsdp.fully_shard`` keeps its
model and optimizer state in a sharded (DCP) checkpoint that every rank writes its own shards
to through :mod:`fastckpt.dcp` (optimizer state keyed by parameter name, as ``get_state_dict``
gives it, so it reshards onto any world size). Each save writes a fresh *part*,
``ROOT/sharded/<index>/<part>`` (see :mod:`fastckpt.container.sharded.parts`). The index itself
(``ROOT/<index>``, committed by rank 0 after the sharded part) holds what exists once: the
recipe with each model's spec, counters, RNG states, scheduler and hook states, and the name
of its part with the crc32c of the part's commit record. So the manifest commit of the index
is the one commit point: a replacement killed before it leaves the old index, and its part,
whole; readers see the old or the new index.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

import fastckpt.checkpoint.build as build
import fastckpt.checkpoint.specs as specs
from fastckpt import _native
from fastckpt.errors import ChecksumMismatchError
from fastckpt.format import records
from fastckpt.io.paths import is_ascii_decimal
from fastckpt.storage.registry import backend_for, is_local

if TYPE_CHECKING:  # importing fastckpt.dcp loads torch.distributed.checkpoint: deferred
    from fastckpt.container.sharded.parts import Part

__all__ = [
    "SHARDED_DIR",
    "SharedCommit",
    "async_save_sharded",
    "check_not_fsdp1",
    "check_recordable",
    "committed_part",
    "is_sharded_model",
    "load_sharded",
    "part_record",
    "remove_sharded",
    "save_sharded",
    "sharded_path",
    "share_commit",
    "sweep_parts",
    "unsharded_spec",
]

#: The subdirectory of a strategy root holding the sharded part of each index.
SHARDED_DIR = records.SHARDED_DIR


def is_sharded_model(model: torch.nn.Module) -> bool:
    """Whether ``model`` is FSDP2-sharded (``fully_shard`` applied to it)."""
    if "torch.distributed.fsdp" not in sys.modules:
        return False  # nothing sharded a module in this process (the import costs seconds)
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch built without distributed
        return False
    return isinstance(model, FSDPModule)


def check_not_fsdp1(name: str, model: torch.nn.Module) -> None:
    """Refuse FSDP1 (``FullyShardedDataParallel``) with the fix.

    Raises:
        ValueError: ``model`` is wrapped in ``FullyShardedDataParallel``.
    """
    if "torch.distributed.fsdp" not in sys.modules:
        return  # nothing wrapped a module in this process
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - torch built without distributed
        return
    if isinstance(model, FullyShardedDataParallel):
        raise ValueError(
            f"model {name!r} is wrapped in FullyShardedDataParallel (FSDP1), which "
            "TrainingStrategy does not checkpoint: shard it with "
            "torch.distributed.fsdp.fully_shard (FSDP2) instead; FSDP2 models are checkpointed "
            "sharded and resume on any number of ranks (load_checkpoint(..., parallelize=fn))"
        )


def sharded_path(root: str | Path, index: int, part: str | None = None) -> Path:
    """Where index ``index`` of ``root`` keeps the sharded part ``part`` (None: the
    directory of its parts, which indices written before parts used as their part)."""
    base = Path(root) / SHARDED_DIR / str(index)
    return base if part is None else base / part


def committed_part(root: str | Path, index: int, sharded: Any, where: str) -> Part:
    """The part the ``sharded`` record of index ``index``'s strategy.json (``where``) names
    (see :func:`fastckpt.container.sharded.parts.part_of`)."""
    from fastckpt.container.sharded.parts import part_of

    return part_of(root, index, sharded, where)


def sweep_parts(root: str | Path) -> list[Path]:
    """After a commit: under the root's lock, remove the sharded parts no committed index
    names (the one a replacement replaced, those of killed saves; see
    :func:`fastckpt.container.sharded.parts.sweep`). Returns them."""
    from fastckpt.container.sharded.parts import sweep
    from fastckpt.storage.registry import backend_for

    with backend_for(root).lock(Path(root)):
        return sweep(root, records.Manifest.load(root))


def part_record(path: Path) -> dict[str, Any]:
    """The fields an index's ``strategy.json`` records of its committed part ``path``: its
    name and the crc32c of its commit record (read back from disk)."""
    from fastckpt.container.sharded.commit import RECORD_NAME
    from fastckpt.container.sharded.parts import PART_CRC_FIELD, PART_FIELD

    data = records.read_record_bytes(path, RECORD_NAME)
    return {PART_FIELD: path.name, PART_CRC_FIELD: _native.crc32c(data)}


@contextlib.contextmanager
def _original_classes(model: torch.nn.Module) -> Iterator[None]:
    """Give every FSDP2 module its class from before ``fully_shard`` while the block runs
    (``fully_shard`` swaps in a generated subclass, which is not importable)."""
    from torch.distributed.fsdp import FSDPModule

    swapped: list[tuple[torch.nn.Module, type]] = []
    try:
        for module in model.modules():
            cls = type(module)
            if isinstance(module, FSDPModule):
                original = next(base for base in cls.__bases__ if not issubclass(base, FSDPModule))
                module.__class__ = original  # type: ignore[assignment]
                swapped.append((module, cls))
        yield
    finally:
        for module, cls in swapped:
            module.__class__ = cls


def unsharded_spec(model: torch.nn.Module) -> specs.BaseSpec:
    """The spec that rebuilds ``model`` unsharded (an attached spec wins, as always)."""
    with _original_classes(model):
        return specs.model_spec(model)


def check_recordable(name: str, model: torch.nn.Module) -> None:
    """:func:`fastckpt.checkpoint.build.check_recordable` for an FSDP2 model (its unsharded recipe;
    the
    parameters' global shapes)."""
    with _original_classes(model):
        build.check_recordable(model, name)


def _state(
    models: Mapping[str, torch.nn.Module], optimizers: Mapping[str, torch.optim.Optimizer]
) -> dict[str, Any]:
    """``{"models": {name: sharded state}, "optimizers": {name: state by parameter name}}``."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    state: dict[str, Any] = {"models": {}, "optimizers": {}}
    for name, model in models.items():
        optimizer = optimizers.get(name)
        if optimizer is None:
            state["models"][name] = get_model_state_dict(model)
        else:
            state["models"][name], state["optimizers"][name] = get_state_dict(model, optimizer)
    return {section: value for section, value in state.items() if value}


@contextlib.contextmanager
def _gradients_set_aside(models: Mapping[str, torch.nn.Module]) -> Iterator[None]:
    """Gradients set to None inside the block and put back after: DCP's ``get_state_dict``
    initializes an optimizer's empty state (the template a load fills) only when no parameter
    has one, so a restore after a backward pass (a warm-up, a sanity check) found no template
    for the saved moments."""
    kept = [(p, p.grad) for model in models.values() for p in model.parameters()]
    for parameter, _ in kept:
        parameter.grad = None
    try:
        yield
    finally:
        for parameter, grad in kept:
            parameter.grad = grad


def save_sharded(
    root: str | Path,
    index: int,
    part: str,
    models: Mapping[str, torch.nn.Module],
    optimizers: Mapping[str, torch.optim.Optimizer],
    *,
    node_local: bool = False,
) -> Path:
    """Write the models' and optimizers' shards as the part ``ROOT/sharded/<index>/<part>``;
    collective (every rank calls it with its own shards and the same ``part``). Returns the
    part's directory. ``node_local``: each rank's ``root`` may be its own node's disk (see
    :class:`fastckpt.dcp.Writer`); otherwise the commit is refused when it is."""
    from fastckpt.dcp.state import save_state

    path = sharded_path(root, index, part)
    save_state(path, _state(models, optimizers), node_local=node_local)
    return path


def async_save_sharded(
    root: str | Path,
    index: int,
    part: str,
    models: Mapping[str, torch.nn.Module],
    optimizers: Mapping[str, torch.optim.Optimizer],
    *,
    writer: Any,
    process_group: Any = None,
) -> tuple[dict[str, Any], Future[None]]:
    """:func:`save_sharded` in the background: returns once every rank's shards are staged
    into ``writer``'s (a :class:`fastckpt.dcp.Writer`, reused) buffers.

    Returns:
        The part's fields for the index's ``strategy.json`` (``part`` now; ``record_crc32c``
        filled in once the part is committed, before the future resolves) and the future of
        the upload and commit.
    """
    from torch.distributed.checkpoint.api import CheckpointException

    from fastckpt.container.sharded.parts import PART_FIELD
    from fastckpt.dcp.state import async_save_state, typed_dcp_error

    path = sharded_path(root, index, part)
    fields: dict[str, Any] = {PART_FIELD: part}
    uploaded = async_save_state(
        path, _state(models, optimizers), writer=writer, process_group=process_group
    )
    committed: Future[None] = Future()

    import torch.distributed as dist

    # Rank 0 names the part in the index it commits (another rank's root may not hold the
    # record: a node-local disk, see share_commit).
    commits = not dist.is_initialized() or dist.get_rank() == 0

    def done(future: Any) -> None:
        try:
            future.result()
            if commits:
                fields.update(part_record(path))
        except CheckpointException as err:  # a BaseException: raise what the rank raised
            committed.set_exception(typed_dcp_error(err))
            return
        except BaseException as err:
            committed.set_exception(err)
            return
        committed.set_result(None)

    uploaded.add_done_callback(done)
    return fields, committed


def _part_record(part: Part, record_bytes: bytes | None) -> Any:
    """The part's commit record (decoded from ``record_bytes`` when given: see
    :func:`load_sharded`), checked against the crc32c its index recorded.

    Raises:
        ChecksumMismatchError: the part's commit record is not the one its index recorded.
    """
    from fastckpt.container.sharded.commit import RECORD_NAME, read_record
    from fastckpt.format.sharded import decode_record

    if record_bytes is None:
        record = read_record(part.path)
    else:
        record = decode_record(part.path / RECORD_NAME, record_bytes)
    if part.record_crc32c is not None and record.file_crc32c != part.record_crc32c:
        raise ChecksumMismatchError(
            f"{record.path}: crc32c {record.file_crc32c:08x} differs from the "
            f"{part.record_crc32c:08x} that {part.source} records; the index's sharded part "
            "was replaced or damaged. Load another index"
        )
    return record


def saved_dtypes(
    part: Part, names: Iterable[str], record_bytes: bytes | None = None
) -> dict[str, dict[str, torch.dtype]]:
    """Model name (of ``names``) -> ``{tensor name: the dtype the part holds it in}``, from
    the part's DCP metadata. A model rebuilt from its spec takes these before it is sharded
    (:func:`fastckpt.checkpoint.fill.match_saved_dtypes`): its constructor's dtypes are not
    the saved ones when it was converted after construction (``.to(torch.bfloat16)``), and
    loading casts to the live dtypes. ``record_bytes``: as for :func:`load_sharded`.

    Raises:
        as :func:`load_sharded` for the commit record.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    entries = _part_record(part, record_bytes).metadata.state_dict_metadata
    dtypes: dict[str, dict[str, torch.dtype]] = {}
    for name in names:
        prefix = f"models.{name}."
        dtypes[name] = {
            fqn[len(prefix) :]: entry.properties.dtype
            for fqn, entry in entries.items()
            if fqn.startswith(prefix) and isinstance(entry, TensorStorageMetadata)
        }
    return dtypes


def load_sharded(
    part: Part,
    models: Mapping[str, torch.nn.Module],
    optimizers: Mapping[str, torch.optim.Optimizer],
    record_bytes: bytes | None = None,
) -> None:
    """Load a sharded part into live (sharded or plain) models and optimizers, resharding as
    their placements say; collective. Every tensor must be in the checkpoint (strict). Nothing
    live changes unless every rank read and verified all of it. ``record_bytes``: the part's
    commit record as rank 0 read it (a node that holds no copy of it, node-local tiers);
    files this node lacks are read from the ranks whose nodes hold them
    (:mod:`fastckpt.dcp.peers`).

    Raises:
        ChecksumMismatchError: the part's commit record is not the one its index recorded.
        NotCommittedError, CheckpointFormatError, CheckpointMismatchError, FileNotFoundError:
            as :func:`fastckpt.dcp.load_state`.
    """
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    from fastckpt.dcp.state import load_record_state

    record = _part_record(part, record_bytes)
    with _gradients_set_aside(models):  # DCP builds optimizer state only without them
        templates = _state(models, optimizers)
    loaded = load_record_state(record, templates, strict=True)
    for name, model in models.items():
        optimizer = optimizers.get(name)
        if optimizer is None:
            set_model_state_dict(model, loaded["models"][name])
        else:
            set_state_dict(
                model,
                optimizer,
                model_state_dict=loaded["models"][name],
                optim_state_dict=loaded["optimizers"][name],
            )


def remove_sharded(root: str | Path, indices: list[int]) -> None:
    """Delete the sharded parts of pruned indices (all their parts)."""
    backend = backend_for(root)
    for index in indices:
        if is_local(backend):
            shutil.rmtree(sharded_path(root, index), ignore_errors=True)
        else:
            backend.delete(sharded_path(root, index))


@dataclass(frozen=True)
class SharedCommit:
    """What every rank learns after rank 0 committed a sharded index (:func:`share_commit`).

    Attributes:
        node_local: this rank's root lacks files of the committed part that other ranks
            wrote: each node saves to its own disk (docs/tiers.md, node-local fast tiers).
        kept: the indices rank 0's root holds after its retention.
    """

    node_local: bool
    kept: tuple[int, ...]


def share_commit(
    root: str | Path,
    index: int,
    *,
    failure: BaseException | None = None,
    process_group: Any = None,
) -> SharedCommit:
    """After rank 0 committed index ``index`` of ``root`` (and applied its retention) or
    failed to (``failure``, on rank 0): tell every rank (collective, on ``process_group``).

    Rank 0 sends the committed part's name, its commit record and the indices it keeps. A
    rank whose ``root`` does not hold that record (each node its own disk) writes it into its
    node's copy of the part, whose files it wrote, so that the node can promote its shards
    (:class:`fastckpt.container.promote.RankPromoter`), and removes the sharded parts of the
    indices rank 0 no longer keeps.

    Raises:
        RuntimeError: rank 0 failed (on the other ranks; rank 0 raises ``failure`` itself).
    """
    import torch.distributed as dist

    from fastckpt.container.sharded.commit import RECORD_NAME
    from fastckpt.container.sharded.parts import committed_part
    from fastckpt.container.sharded.promote import held_elsewhere

    root = Path(root)
    world = dist.get_world_size(process_group) if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    message: list[Any] = [None]
    if rank == 0:
        try:
            if failure is not None:
                raise failure
            manifest = records.Manifest.load(root)
            part = committed_part(manifest, index)
            record = None if part is None else records.read_record_bytes(part.path, RECORD_NAME)
            name = None if part is None else part.name
            message[0] = ("ok", name, record, tuple(sorted(manifest.entries)))
        except BaseException as err:
            message[0] = ("failed", f"{type(err).__name__}: {err}")
            if world > 1:
                dist.broadcast_object_list(message, src=0, group=process_group)
            raise
    if world > 1:
        dist.broadcast_object_list(message, src=0, group=process_group)
    if message[0][0] != "ok":
        raise RuntimeError(f"rank 0 could not commit index {index} of {root}: {message[0][1]}")
    _, name, record, kept = message[0]
    if name is None or record is None or not is_local(backend_for(root)):
        return SharedCommit(False, kept)  # an object store is one store for every rank
    path = sharded_path(root, index, name)
    document = json.loads(record)
    generation = document["generation"]
    if rank != 0 and not (path / RECORD_NAME).is_file() and (path / generation).is_dir():
        from fastckpt.container.commit import commit_generation

        commit_generation(path, RECORD_NAME, record, generation)
    node_local = bool(held_elsewhere(path, generation, document["files"]))
    if node_local and rank != 0:
        _prune_node(root, kept, index)
    return SharedCommit(node_local, kept)


def _prune_node(root: Path, kept: tuple[int, ...], newest: int) -> None:
    """On a node-local root of a rank other than 0: remove the sharded parts of the indices
    up to ``newest`` that rank 0 no longer keeps (its retention decides for every node)."""
    base = Path(root) / SHARDED_DIR
    try:
        names = [name for name in base.iterdir() if is_ascii_decimal(name.name)]
    except (FileNotFoundError, NotADirectoryError):
        return
    for directory in names:
        index = int(directory.name)
        if index < newest and index not in kept and not directory.is_symlink():
            shutil.rmtree(directory, ignore_errors=True)


@dataclass(frozen=True)
class NodeLocalIndex:
    """A sharded index spread over node-local fast tiers, as one rank loads it
    (:func:`node_local_index`).

    Attributes:
        root: where this rank reads the index's own files (manifest, ``strategy.json``, run
            state): rank 0's fast root, or a private copy of them on another node.
        part_root: this rank's own fast root, whose copy of the part it reads.
        record: the part's commit record as rank 0's node holds it (None on rank 0).
    """

    root: Path
    part_root: Path
    record: bytes | None


@contextlib.contextmanager
def node_local_index(root: str | Path, index: int) -> Iterator[NodeLocalIndex]:
    """Collective: make index ``index`` of rank 0's node-local fast root readable on every
    rank. Rank 0 sends the manifest, the index's files (the strategy recipe, run state, hook
    configurations: small) and its part's commit record; every other rank writes them into a
    private temporary root (removed on exit) and keeps its own ``root`` (its node's copy,
    possibly empty) for the part. The shards stay where they are: each rank reads its node's
    and receives the rest from the ranks whose nodes hold them (:mod:`fastckpt.dcp.peers`).

    Raises:
        RuntimeError: rank 0 could not read the index (on the other ranks; rank 0 raises its
            own error).
    """
    import torch.distributed as dist

    from fastckpt.container.sharded.commit import RECORD_NAME
    from fastckpt.container.sharded.parts import committed_part

    root = Path(root)
    message: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            manifest = records.Manifest.load(root)
            files = {
                str(manifest.file_path(index, name).relative_to(root)): (
                    manifest.file_path(index, name).read_bytes()
                )
                for name in manifest.entries[index]["files"]
            }
            part = committed_part(manifest, index)
            record = None if part is None else records.read_record_bytes(part.path, RECORD_NAME)
            manifest_bytes = records.read_record_bytes(root, records.MANIFEST)
            message[0] = ("ok", manifest_bytes, files, record)
        except BaseException as err:
            message[0] = ("failed", f"{type(err).__name__}: {err}")
            dist.broadcast_object_list(message, src=0)
            raise
    dist.broadcast_object_list(message, src=0)
    if message[0][0] != "ok":
        raise RuntimeError(f"rank 0 could not read index {index} of {root}: {message[0][1]}")
    _, manifest_bytes, files, record = message[0]
    if dist.get_rank() == 0:
        yield NodeLocalIndex(root, root, None)
        return
    with tempfile.TemporaryDirectory(prefix="fastckpt-node-index-") as scratch:
        view = Path(scratch)
        (view / records.MANIFEST).write_bytes(manifest_bytes)
        for relpath, data in files.items():
            target = view / relpath
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
        yield NodeLocalIndex(view, root, record)
