"""Whole training states with sharded (DTensor / FSDP2) values, saved and loaded through DCP.

This is what :class:`fastckpt.CheckpointManager` needs for sharded state: a checkpoint id is
one DCP checkpoint directory written by :class:`~fastckpt.dcp.Writer`, each top-level key of
the state one subtree of it.

* :func:`save_state` / :func:`async_save_state`: every rank calls them with its own shards.
* :func:`load_state`: load into templates (DTensors are filled in place and resharded when the
  world size or mesh changed); keys and shapes are checked against the checkpoint first, so a
  mismatch raises :class:`fastckpt.CheckpointMismatchError` naming the key path instead of a
  raw DCP error. A ``None`` template loads an item as full, unsharded tensors.

A load never leaves templates half-filled: it runs as two DCP loads of the same commit record
with the files opened once. In the first every rank reads and verifies its share (into one
reusable buffer: no copy of the state is held); DCP gathers every rank's outcome, so a damaged
chunk on any rank raises on every rank with every template as it was. Only then does the
second read the same ranges into the templates (verified again) and set the plain values. The
cost is a second read of each rank's share (from the page cache when it fits there) and a
second round of DCP planning, not memory. DCP's ``CheckpointException`` (a ``BaseException``)
is raised as the typed error a rank hit (:func:`typed_dcp_errors`). In one process, a load that
races a save replacing the checkpoint is read again (the record changed:
:func:`fastckpt.container.snapshot.read_consistently`), so it returns the old or the new state,
whole.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict, unflatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from fastckpt.container.commit import record_names_generation
from fastckpt.container.sharded.commit import RECORD_NAME, read_record
from fastckpt.container.snapshot import read_consistently
from fastckpt.container.templates import (
    check_disjoint_templates,
    check_strict,
    check_tensor_template,
    is_dtensor,
)
from fastckpt.dcp.reader import Passes, Reader
from fastckpt.dcp.writer import Writer
from fastckpt.errors import (
    CheckpointFormatError,
    CheckpointMismatchError,
    FastCkptError,
    InvalidInputError,
)
from fastckpt.format.sharded import Record, StoredChunk
from fastckpt.io.files import empty_tensor
from fastckpt.storage.registry import display_path

__all__ = [
    "async_save_state",
    "contains_dtensors",
    "differing_entries",
    "is_sharded_checkpoint",
    "load_record_state",
    "load_state",
    "replicated_digests",
    "save_state",
    "single_process",
    "typed_dcp_error",
    "typed_dcp_errors",
]


def contains_dtensors(state: Any) -> bool:
    """Whether a nest of mappings/lists/tuples holds a ``DTensor`` (FSDP2, TP) anywhere."""
    if isinstance(state, DTensor):
        return True
    if isinstance(state, Mapping):
        return any(contains_dtensors(value) for value in state.values())
    if isinstance(state, (list, tuple)):
        return any(contains_dtensors(value) for value in state)
    return False


def is_sharded_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a committed sharded (DCP) checkpoint directory (or ``s3://``
    prefix)."""
    return Reader.validate_checkpoint_id(path)


def single_process(process_group: Any = None) -> bool:
    """Whether DCP runs in this process alone (no process group, or a group of one rank):
    then a load may be retried on its own, without the other ranks."""
    if not (dist.is_available() and dist.is_initialized()):
        return True
    return bool(dist.get_world_size(process_group) == 1)


def typed_dcp_error(error: CheckpointException) -> BaseException:
    """The error to raise for DCP's ``CheckpointException``: the first fastckpt error a rank
    raised (``ChecksumMismatchError`` naming the file, ``CheckpointFormatError``...), else the
    first ``OSError`` (a missing file, named), else the first ``Exception``; ``error`` itself
    when no rank raised an ``Exception``. DCP gathers the failures of every rank, so every rank
    picks the same one."""
    failures = [failure for _, (failure, _) in sorted(error.failures.items())]
    for kind in (FastCkptError, OSError, Exception):
        for failure in failures:
            if isinstance(failure, kind):
                return failure
    return error


@contextlib.contextmanager
def typed_dcp_errors() -> Iterator[None]:
    """Re-raise DCP's ``CheckpointException`` (a ``BaseException`` that ``except Exception``
    misses) as :func:`typed_dcp_error` picks it, with the ``CheckpointException`` as its
    cause."""
    try:
        yield
    except CheckpointException as err:
        failure = typed_dcp_error(err)
        if failure is err:
            raise
        raise failure from err


def save_state(
    path: str | os.PathLike[str],
    state: Mapping[str, Any],
    *,
    writer: Writer | None = None,
    process_group: Any = None,
    node_local: bool = False,
) -> None:
    """Save ``state`` (this rank's shards) as the sharded checkpoint ``path``; collective.

    Args:
        path: the checkpoint directory (replaced atomically).
        state: ``{key: nest of tensors, DTensors and plain values}``.
        writer: a writer to reuse (its options and staging buffers); one is made otherwise.
        process_group: the group DCP coordinates on (default: the default group, if any).
        node_local: for a writer made here: ``path`` may be each node's own disk (see
            :class:`~fastckpt.dcp.Writer`).
    """
    _check_mapping(state, "fastckpt.dcp.save_state: state")
    warn_of_key_types(state)
    writer = writer or Writer(path, node_local=node_local)
    writer.reset(path)
    with typed_dcp_errors(), _collective_failure_explained(writer):
        dcp.save(dict(state), storage_writer=writer, process_group=process_group)


@contextlib.contextmanager
def _collective_failure_explained(writer: Writer) -> Iterator[None]:
    """A ``RuntimeError`` of torch.distributed during a save (gloo's "Connection closed by
    peer" when another rank died) says which checkpoint it was and whether this save was
    committed: the coordinator may have committed it before the collective that failed."""
    try:
        yield
    except FastCkptError:
        raise
    except RuntimeError as err:
        if not dist.is_initialized() or dist.get_world_size() < 2:
            raise  # no peer to lose: not a collective's failure
        generation = writer.current_generation
        if generation is None:
            status = "was not committed (it never got its generation): the previous one stands"
        else:
            committed = record_names_generation(writer.path, RECORD_NAME, generation)
            status = {
                True: f"was committed ({generation}): it verifies and loads",
                False: f"was not committed ({generation}): the previous one stands",
                None: f"may have been committed ({generation}): verify it",
            }[committed]
        raise RuntimeError(
            f"{display_path(writer.path)}: the sharded save failed in a collective of "
            f"torch.distributed ({type(err).__name__}: {err}); when another rank died or "
            f"left the process group, its failure shows here. This save {status}."
        ) from err


def async_save_state(
    path: str | os.PathLike[str],
    state: Mapping[str, Any],
    *,
    writer: Writer,
    process_group: Any = None,
) -> Future[Any]:
    """:func:`save_state` in the background; returns once ``state`` is staged.

    Training may change the state as soon as this returns. Reuse one ``writer`` across saves
    so its staging buffers are reused, and pass a ``process_group`` dedicated to checkpoints
    (gloo), so the background collectives never interleave with training's.

    Returns:
        A future resolved when the checkpoint is committed; it raises what :func:`save_state`
        raises (DCP's ``CheckpointException``, a ``BaseException`` that ``except Exception``
        misses, as :func:`typed_dcp_error` picks it, with the ``CheckpointException`` as its
        cause: a full disk is the ``OSError`` naming the checkpoint and the fix).
    """
    _check_mapping(state, "fastckpt.dcp.async_save_state: state")
    warn_of_key_types(state)
    writer.reset(path)
    # The writer stages (it returns the staged state, not a future): DCP returns a Future.
    uploaded = cast(
        "Future[Any]",
        dcp.async_save(dict(state), storage_writer=writer, process_group=process_group),
    )
    committed: Future[Any] = Future()
    committed.set_running_or_notify_cancel()  # as DCP's: it cannot be cancelled

    def done(future: Future[Any]) -> None:
        try:
            committed.set_result(future.result())
        except CheckpointException as err:
            failure = typed_dcp_error(err)
            if failure is not err:
                failure.__cause__ = err
            committed.set_exception(failure)
        except BaseException as err:
            committed.set_exception(err)

    uploaded.add_done_callback(done)
    return committed


def _check_mapping(value: Any, what: str) -> None:
    """Refuse a state (or templates) that is not a ``{key: ...}`` mapping, naming ``what``
    (before: ``save_state(path, None)`` raised Python's bare "'NoneType' object is not
    iterable")."""
    if not isinstance(value, Mapping):
        raise InvalidInputError(
            f"{what} is a {type(value).__name__}, not a mapping; pass {{key: value}}, e.g. "
            '{"model": model.state_dict(), "optimizer": optimizer.state_dict()}'
        )


def _key_of_another_type(value: Any, path: str) -> str | None:
    """The key path of the first mapping key in ``value`` that is not a ``str``, or None."""
    if isinstance(value, Mapping):
        for key, item in value.items():
            where = f"{path}.{key}" if path else str(key)
            if not isinstance(key, str):
                return where
            found = _key_of_another_type(item, where)
            if found is not None:
                return found
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            found = _key_of_another_type(item, f"{path}.{index}")
            if found is not None:
                return found
    return None


def replicated_digests(state: Mapping[str, Any]) -> dict[str, int]:
    """A crc32c of every entry of ``state`` that is not a ``DTensor`` (plain tensors with
    their dtype and shape, bytes as they are, other values by their ``repr``; one whose
    ``repr`` names its address cannot be compared and is left out), by key path. DCP keeps
    one copy of each such entry for all ranks (its planner de-duplicates them as
    replicated): compare the ranks' digests (:func:`differing_entries`) before a save that
    must not lose theirs."""
    import io

    from fastckpt import _native
    from fastckpt.io.files import byte_view

    flat, _ = flatten_state_dict(dict(state))
    digests: dict[str, int] = {}
    for fqn, value in flat.items():
        if isinstance(value, DTensor):
            continue
        if isinstance(value, torch.Tensor):
            tensor = value.detach().to("cpu").contiguous()
            head = f"{tensor.dtype}{tuple(tensor.shape)}".encode()
            digests[fqn] = _native.crc32c(byte_view(tensor), _native.crc32c(head))
            continue
        if isinstance(value, io.BytesIO):
            data = value.getvalue()
        elif isinstance(value, bytes | bytearray):
            data = bytes(value)
        else:
            text = repr(value)
            if " at 0x" in text:
                continue  # an object's default repr: not comparable across processes
            data = text.encode("utf-8", "surrogatepass")
        digests[fqn] = _native.crc32c(data)
    return digests


def differing_entries(gathered: list[dict[str, int]]) -> list[str]:
    """The key paths whose digests (:func:`replicated_digests`, one dict per rank) differ
    between the ranks holding them (a key only one rank holds is saved from that rank)."""
    keys = set().union(*gathered)
    return sorted(k for k in keys if len({d[k] for d in gathered if k in d}) > 1)


def warn_of_key_types(state: Mapping[str, Any]) -> None:
    """Warn when ``state`` holds a mapping key that is not a ``str`` (a plain
    ``optimizer.state_dict()``'s parameter numbers): DCP names every entry by its key path
    as text, so a load without templates (:func:`load_state` with no ``into``,
    ``CheckpointManager.load`` without ``into=``) gives those keys back as strings, and
    ``optimizer.load_state_dict`` then silently drops the state filed under them. Loads into
    templates (the optimizer object, or ``get_optimizer_state_dict``'s names) are exact."""
    found = _key_of_another_type(state, "")
    if found is not None:
        warnings.warn(
            f"sharded checkpoint: the key at {found!r} is not a str; DCP stores key paths as "
            "text, so a load without templates gives it back as a string (load into the "
            "optimizer object or a template, or save get_optimizer_state_dict(model, "
            "optimizer), whose keys are parameter names)",
            UserWarning,
            stacklevel=3,
        )


def _describe(value: Any) -> str:
    return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"


def _check_templates(
    path: Path,
    metadata: Metadata,
    templates: Mapping[str, Any],
    strict: bool,
    modules: Mapping[str, torch.nn.Module] | None = None,
) -> None:
    """Refuse templates that do not fit the checkpoint, before anything is read.

    Checked, at any strictness: each tensor template can hold its values, the structure (a
    template mapping where the checkpoint has a tensor or value, a template leaf where it has
    a mapping or list), that an item's template names at least one of the item's saved
    tensors (else nothing would be loaded into it), the key set of each module of
    ``modules`` (``{item key: module}``, whose ``state_dict()`` the item's template is), as
    its strict ``load_state_dict`` would, and each tensor's kind, dtype and shape. Under
    ``strict`` also: template keys the checkpoint lacks, and saved tensors left out.

    Raises:
        TypeError: a tensor template that cannot hold its values (by key path).
        CheckpointMismatchError: a template that does not fit (by key path, with the fix).
    """
    flat, mapping = flatten_state_dict(dict(templates))
    stored = metadata.state_dict_metadata
    stored_paths = _paths(metadata, path)
    for fqn, value in flat.items():
        if isinstance(value, torch.Tensor):
            # memory of its own, checked before any template is filled (a meta tensor, an
            # expanded one: DCP's copy fails once the templates before it are filled)
            local = value.to_local() if is_dtensor(value) else value  # type: ignore[attr-defined]
            check_tensor_template(local, fqn)
    _check_structure(path, flat, mapping, stored, stored_paths)
    for key in templates:
        _check_something_loads(path, key, flat, mapping, stored, stored_paths)
    for key, module in (modules or {}).items():
        _check_module_keys(path, key, module, mapping, stored_paths)
    for fqn, value in flat.items():
        entry = stored.get(fqn)
        if entry is None:
            if strict:
                raise CheckpointMismatchError(f"{fqn}: not in checkpoint {path}")
            continue
        if not isinstance(value, torch.Tensor):
            if isinstance(entry, TensorStorageMetadata):
                raise CheckpointMismatchError(
                    f"{fqn}: the checkpoint has a tensor ({_describe_entry(entry)}), the "
                    f"template a {type(value).__name__}"
                )
            continue
        if not isinstance(entry, TensorStorageMetadata):
            raise CheckpointMismatchError(
                f"{fqn}: the checkpoint has a non-tensor value, the template a tensor"
            )
        if value.dtype != entry.properties.dtype or tuple(value.shape) != tuple(entry.size):
            raise CheckpointMismatchError(
                f"{fqn}: checkpoint has {_describe_entry(entry)}, template has "
                f"{_describe(value)} (a DTensor template is compared by its global shape)"
            )
    ties = check_disjoint_templates(templates)
    if ties:
        chunks = _chunks_by_fqn(metadata)
        for paths in ties:
            _check_tied(path, chunks, paths)
    if strict:
        _check_nothing_left_out(path, metadata, templates, mapping.values())


def _text_path(path: Iterable[Any]) -> tuple[str, ...]:
    """A key path with every key as text (DCP names entries by their keys as text)."""
    return tuple(str(part) for part in path)


def _shown(names: Iterable[str], limit: int = 5) -> str:
    """The first ``limit`` names (repr), and "..." when there are more."""
    listed = list(names)
    return ", ".join(repr(name) for name in listed[:limit]) + (
        ", ..." if len(listed) > limit else ""
    )


def _check_structure(
    path: Path,
    flat: Mapping[str, Any],
    mapping: Mapping[str, Any],
    stored: Mapping[str, Any],
    stored_paths: Mapping[str, tuple[Any, ...]],
) -> None:
    """Refuse a template whose structure is not the checkpoint's: a mapping or list where the
    checkpoint has a tensor or value, or a tensor or value (not None) where it has a mapping or
    list. DCP matches leaves by key path, so either loaded nothing there, silently (or, under
    ``strict``, was reported as a key "not in checkpoint", which it is, as another kind).

    Raises:
        CheckpointMismatchError: names the key path, what the checkpoint and the template hold
            there, and the fix.
    """
    leaves = {_text_path(saved_path): fqn for fqn, saved_path in stored_paths.items()}
    containers: dict[tuple[str, ...], list[str]] = {}  # every proper prefix: entries under it
    for fqn, saved_path in stored_paths.items():
        for end in range(1, len(saved_path)):
            containers.setdefault(_text_path(saved_path[:end]), []).append(fqn)
    kinds = {True: "a list", False: "a mapping"}
    for fqn, value in flat.items():
        if fqn in stored:
            continue
        wanted = tuple(mapping[fqn])
        text = _text_path(wanted)
        for end in range(1, len(text)):
            saved = leaves.get(text[:end])
            if saved is not None:
                raise CheckpointMismatchError(
                    f"{saved}: the checkpoint has {_stored_kind(stored[saved])} there, the "
                    f"template {kinds[isinstance(wanted[end], int)]} (holding {fqn!r}); "
                    "nothing was loaded: give the template the saved structure, or load the "
                    "item as saved (a None template)"
                )
        under = containers.get(text)
        if under is not None and value is not None:
            inner = stored_paths[under[0]][len(text)]
            what = "a tensor" if isinstance(value, torch.Tensor) else f"a {type(value).__name__}"
            raise CheckpointMismatchError(
                f"{fqn}: the checkpoint has {kinds[isinstance(inner, int)]} there "
                f"({len(under)} entr{'y' if len(under) == 1 else 'ies'} under it: "
                f"{_shown(sorted(under))}), the template {what}; nothing was loaded: give the "
                "template the saved structure, or load the item as saved (a None template)"
            )


def _stored_kind(entry: Any) -> str:
    """What a stored entry is, for messages: a tensor (its dtype and shape) or a value."""
    if isinstance(entry, TensorStorageMetadata):
        return f"a tensor ({_describe_entry(entry)})"
    return "a value"


def _check_something_loads(
    path: Path,
    key: str,
    flat: Mapping[str, Any],
    mapping: Mapping[str, Any],
    stored: Mapping[str, Any],
    stored_paths: Mapping[str, tuple[Any, ...]],
) -> None:
    """Refuse the template of item ``key`` when it holds tensors, the checkpoint holds tensors
    under ``key``, and none of the template's is among them: DCP would load nothing into it
    (a model under a wrapper: every name with a ``module.`` prefix), while its plain values
    (a step count) would load, at any strictness.

    Raises:
        CheckpointMismatchError: names the item, both sets of names (the first few) and the fix.
    """
    wanted = sorted(
        fqn
        for fqn, value in flat.items()
        if str(mapping[fqn][0]) == key and isinstance(value, torch.Tensor)
    )
    held = sorted(
        fqn
        for fqn, stored_path in stored_paths.items()
        if str(stored_path[0]) == key and isinstance(stored[fqn], TensorStorageMetadata)
    )
    if wanted and held and not any(fqn in stored for fqn in wanted):
        count = f"{len(wanted)} tensor{'' if len(wanted) == 1 else 's'}"
        raise CheckpointMismatchError(
            f"{key}: none of the template's {count} ({_shown(wanted)}) is in checkpoint "
            f"{path}, which holds {len(held)} under {key!r} ({_shown(held)}); nothing was "
            "loaded: give the template the saved names (a model under a wrapper such as DDP's "
            "has a 'module.' prefix: load into the wrapped module), or load the item as saved "
            "(a None template) and rename its keys"
        )


def _check_module_keys(
    path: Path,
    key: str,
    module: torch.nn.Module,
    mapping: Mapping[str, Any],
    stored_paths: Mapping[str, tuple[Any, ...]],
) -> None:
    """Refuse the checkpoint's item ``key`` for ``module`` (whose ``state_dict()`` is the
    item's template) when the module's strict ``load_state_dict`` would refuse it: a key of
    the module the checkpoint lacks, or an entry the module lacks (batch norm's
    ``num_batches_tracked``, which torch supplies, may be missing). At any strictness, as the
    unsharded ``CheckpointManager.load``: else the checkpoint loaded in part, the rest of the
    module left at its values, without a word.

    Raises:
        CheckpointMismatchError: names the module's class, the keys and the fix.
    """
    own = {_text_path(p)[1:]: fqn for fqn, p in mapping.items() if str(p[0]) == key}
    held = {_text_path(p)[1:]: fqn for fqn, p in stored_paths.items() if str(p[0]) == key}
    missing = [
        ".".join(name) for name in own if name not in held and name[-1:] != ("num_batches_tracked",)
    ]
    unexpected = [".".join(name) for name in held if name not in own]
    if not missing and not unexpected:
        return
    found = [
        f"{label} [{_shown(sorted(names), 10)}]"
        for label, names in (("Missing key(s):", missing), ("Unexpected key(s):", unexpected))
        if names
    ]
    kind = f"{type(module).__module__}.{type(module).__qualname__}"
    raise CheckpointMismatchError(
        f"{key}: {kind}.load_state_dict() would refuse the state in checkpoint {path} "
        f"({'; '.join(found)}), so nothing was loaded: build the module as it was saved, or "
        "load the item as saved (a None template) and call load_state_dict(state, "
        "strict=False) yourself"
    )


def _chunks_by_fqn(metadata: Metadata) -> dict[str, list[tuple[Any, ...]]]:
    """Each stored entry's chunks (offsets, dtype, shape, crc32c), sorted, by key path."""
    storage = metadata.storage_data if isinstance(metadata.storage_data, Mapping) else {}
    found: dict[str, list[tuple[Any, ...]]] = {}
    for index, chunk in storage.items():
        if isinstance(chunk, StoredChunk):
            found.setdefault(index.fqn, []).append(
                (tuple(index.offset or ()), chunk.dtype, tuple(chunk.shape or ()), chunk.crc32c)
            )
    for entries in found.values():
        entries.sort()
    return found


def _check_tied(path: Path, chunks: Mapping[str, list[tuple[Any, ...]]], paths: list[str]) -> None:
    """Refuse one template tensor given at several key paths (tied weights: a module's
    ``state_dict()`` lists them under each name) unless the checkpoint holds the same chunks
    at each (offsets, dtypes, shapes, crc32c): else the copy made last would win, and the
    tensor would hold one saved value where the caller asked for two (an untied checkpoint
    loaded into a tied model). A path the checkpoint lacks loads nothing, and is not
    compared.

    Raises:
        CheckpointMismatchError: names the key paths and the fix (nothing loaded yet).
    """
    prints = [chunks[fqn] for fqn in paths if chunks.get(fqn)]
    if any(p != prints[0] for p in prints):
        raise CheckpointMismatchError(
            f"{', '.join(paths)}: one template tensor is given for each (tied weights), but "
            f"checkpoint {path} holds other values at each, so one would be loaded over the "
            "other; nothing was loaded: untie them (or give each its own tensor) to load the "
            "checkpoint as saved"
        )


def _check_nothing_left_out(
    path: Path, metadata: Metadata, templates: Mapping[str, Any], covered: Iterable[Any]
) -> None:
    """Under ``strict``, refuse templates that leave out tensors the checkpoint holds under
    their keys (a fresh optimizer's empty state would load nothing there, silently): every
    stored tensor's path must be a template path, under one, or above one. Plain values and
    an optimizer's ``param_groups`` (hyper-parameters: a scheduler's ``initial_lr``, a tensor
    when the learning rate is one) may be left out, as torch's strict concerns state."""
    reached = [tuple(p) for p in covered]
    entries = metadata.state_dict_metadata
    missing = sorted(
        fqn
        for fqn, stored in _paths(metadata, path).items()
        if str(stored[0]) in templates
        and isinstance(entries[fqn], TensorStorageMetadata)  # plain values may be left out
        and "param_groups" not in [str(part) for part in stored]  # so may hyper-parameters
        and not any(stored[: len(p)] == p or p[: len(stored)] == stored for p in reached if p)
    )
    if missing:
        shown = ", ".join(repr(fqn) for fqn in missing[:5]) + (", ..." if len(missing) > 5 else "")
        raise CheckpointMismatchError(
            f"{path}: the checkpoint holds {len(missing)} tensor"
            f"{'' if len(missing) == 1 else 's'} the templates lack ({shown}); strict=True "
            "loads every saved tensor of a requested key: add them to the template (a fresh "
            "optimizer's state is empty until it steps: use DCP's get_state_dict), put None "
            "there to load them as saved, or load with strict=False"
        )


def _describe_entry(entry: TensorStorageMetadata) -> str:
    return f"{str(entry.properties.dtype).removeprefix('torch.')}{list(entry.size)}"


def _paths(metadata: Metadata, where: Path) -> dict[str, tuple[Any, ...]]:
    """The state-dict path of every stored entry (DCP's flattening map, saved as planner
    data; dotted names split when a planner saved none).

    Raises:
        CheckpointFormatError: a path that is not a sequence of str/int keys spelling its
            entry's name (``where``: the record, for the message). An edited path put a
            tensor elsewhere, left unfilled (uninitialized memory), or failed untyped.
    """
    mappings = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    paths: dict[str, tuple[Any, ...]] = {}
    for fqn in metadata.state_dict_metadata:
        path = mappings.get(fqn)
        if path is None:
            paths[fqn] = tuple(fqn.split("."))
            continue
        # The record's decoder proved every tuple of str/int keys spells its entry's name
        # (format.sharded._check_consistent); anything else is a custom planner's data.
        if not isinstance(path, tuple) or not all(type(part) in (str, int) for part in path):
            raise CheckpointFormatError(
                f"{where}: the planner data of {fqn!r} is {path!r}, not the key path of that "
                "entry; the record was edited or is damaged"
            )
        paths[fqn] = tuple(path)
    return paths


def _full_template(metadata: Metadata, key: str, where: Path) -> Any:
    """Plain full-size tensors (and placeholders for values) for every entry under ``key``."""
    flat: dict[str, Any] = {}
    paths: dict[str, Any] = {}
    for fqn, path in _paths(metadata, where).items():
        entry = metadata.state_dict_metadata[fqn]
        if str(path[0]) != key:
            continue
        if isinstance(entry, TensorStorageMetadata):
            flat[fqn] = empty_tensor(entry.size, entry.properties.dtype)
        else:
            flat[fqn] = None
        paths[fqn] = path
    return unflatten_state_dict(flat, paths).get(key)


def stored_items(path: str | os.PathLike[str]) -> list[str]:
    """The top-level keys (items) the sharded checkpoint ``path`` holds, from its record.

    Raises:
        NotCommittedError, CheckpointFormatError: no or a damaged commit record.
    """
    record = read_record(Path(path))
    return sorted({str(p[0]) for p in _paths(record.metadata, record.path).values()})


def load_state(
    path: str | os.PathLike[str],
    into: Mapping[str, Any] | None = None,
    *,
    strict: bool = False,
    process_group: Any = None,
    reader: Reader | None = None,
) -> dict[str, Any]:
    """Load a sharded checkpoint, optionally into templates; collective.

    Templates are filled only once every rank read and verified all of its share (see the
    module docstring); on any error they are as they were. In one process (no process group,
    or a group of one) a load that races a save replacing ``path`` is read again, so it returns
    the old or the new checkpoint, whole.

    Args:
        path: the checkpoint directory.
        into: ``{key: template}``. Tensor and DTensor leaves are filled in place (resharded as
            the template's placements say); plain values are replaced; objects with
            ``state_dict()``/``load_state_dict()`` get their state loaded (a module's key set
            must be the checkpoint's, at any strictness, as its strict ``load_state_dict``
            wants); a ``None`` template loads that item as full tensors. ``None`` loads every
            item that way.
        strict: raise on template keys the checkpoint lacks (otherwise they keep their value).
        process_group: the group DCP coordinates on.
        reader: a reader to use (e.g. ``Reader(path, verify=False)``).

    Returns:
        ``{key: value}`` for each requested item.

    Raises:
        CheckpointMismatchError: by key path, before anything is read: a dtype/shape
            mismatch, another structure (a mapping where a tensor was saved, or the reverse),
            an item's template none of whose tensors the checkpoint holds, a module's key set,
            or (strict) a missing key.
        NotCommittedError, CheckpointFormatError, ChecksumMismatchError: no or a damaged commit
            record, a damaged or missing data file (named, with the tensor), on every rank.
        FileNotFoundError: a data file is missing (named).
    """
    check_strict(strict, "fastckpt.dcp.load_state")
    if into is not None:
        _check_mapping(into, "fastckpt.dcp.load_state: into")
    root = Path(path)

    def attempt() -> dict[str, Any]:
        return load_record_state(
            read_record(root), into, strict=strict, process_group=process_group, reader=reader
        )

    if not single_process(process_group):
        return attempt()  # ranks cannot retry one by one: a retry would hang the others
    return read_consistently(root / RECORD_NAME, attempt)


def load_record_state(
    record: Record,
    into: Mapping[str, Any] | None = None,
    *,
    strict: bool = False,
    process_group: Any = None,
    reader: Reader | None = None,
) -> dict[str, Any]:
    """:func:`load_state` of an already read commit record (no retry): what is loaded is what
    ``record`` names, even if a save commits meanwhile (its files then vanish: an error)."""
    root = record.path.parent
    metadata = record.metadata
    stored_keys = {str(path[0]) for path in _paths(metadata, record.path).values()}
    keys = sorted(stored_keys) if into is None else list(into)
    state: dict[str, Any] = {}
    result: dict[str, Any] = {}
    stateful: dict[str, Any] = {}
    modules: dict[str, torch.nn.Module] = {}
    for key in keys:
        template = None if into is None else into[key]
        if key not in stored_keys:
            if strict:
                raise CheckpointMismatchError(f"{key}: not in checkpoint {root}")
            result[key] = template
            continue
        if template is None:
            state[key] = _full_template(metadata, key, record.path)
        elif isinstance(template, Stateful):
            stateful[key] = template
            state[key] = template.state_dict()
            if isinstance(template, torch.nn.Module):
                modules[key] = template
        else:
            state[key] = template
    _check_templates(root, metadata, state, strict, modules)
    if state:
        reader = reader or Reader(root)
        reader.reset(root)
        try:
            # every rank verifies its share; DCP raises everywhere if one rank failed ...
            passes: tuple[Passes, ...] = ("verify", "fill") if reader.verify else ("fill",)
            for which in passes:
                reader.use_record(record)
                reader.passes = which
                planner = DefaultLoadPlanner(allow_partial_load=not strict)
                with typed_dcp_errors():
                    dcp.load(
                        state, storage_reader=reader, planner=planner, process_group=process_group
                    )
            # ... and only then are the templates filled (the second pass)
        finally:
            reader.release()
            reader.passes = "both"
        for key, template in stateful.items():
            template.load_state_dict(state[key])
            state[key] = template
    result.update(state)
    return {key: result[key] for key in keys}
