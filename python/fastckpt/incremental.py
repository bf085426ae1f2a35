"""Incremental saves: which tensors are unchanged since the last save into a root.

Knowing that a tensor is unchanged must not cost a read of it. torch already tracks what is
needed: every in-place write to a tensor (``add_``, ``copy_``, an optimizer step,
``load_state_dict``) bumps its version counter (``tensor._version``), which its views and
``detach()``-ed aliases (what ``state_dict()`` returns) share; assigning ``param.data = t``
swaps its storage. So each save records, per tensor (file + name), a *fingerprint*: storage
address and size, storage offset, shape, stride, dtype, device and version counter, together
with where its bytes went (index, file, crc32c). At the next save into the same root a tensor
whose fingerprint is identical is recorded as a reference to those bytes
(:mod:`fastckpt.store.refs`) instead of being written again. Anything else, a new tensor at
the key, a different storage, a bumped version, is written. When in doubt, write.

One case torch cannot see: writing through ``param.data`` (``p.data.add_(x)``) does not bump
``p``'s version counter, because ``.data`` is a new alias with its own counter. Code that does
that must pass ``incremental=False`` (or call :func:`forget`).

Tensors the caller marks with :func:`mark_frozen` skip the version check: they are taken as
unchanged while they keep their storage and layout.

The tracker lives in this process, keyed by the root's absolute path; a new process starts
with a full save.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fastckpt.store.dispatch import backend_for, display_path, is_local, is_object_url
from fastckpt.store.records import Manifest, tensor_reference
from fastckpt.store.refs import REFS_FILE, Reference, index_references, matches, source_path

__all__ = ["Plan", "forget", "is_frozen", "mark_frozen", "plan", "record_saved"]

Fingerprint = tuple[Any, ...]
#: A fingerprint and the storage it was taken of. Holding the storage keeps its address from
#: being reused by a new tensor (which would otherwise look like the same one).
Tracked = tuple[Fingerprint, Any]

_LOCK = threading.Lock()
#: root -> {(relpath, name): (fingerprint, reference to the bytes on disk)}
_TRACKERS: dict[str, dict[tuple[str, str], tuple[Tracked, Reference]]] = {}
#: id of a frozen tensor -> (weak reference, storage address), see mark_frozen
_FROZEN: dict[tuple[str, int], weakref.ref[torch.Tensor]] = {}


def _key(root: str | os.PathLike[str]) -> str:
    if is_object_url(root):
        return display_path(root).rstrip("/")
    return os.path.abspath(os.fspath(root))


def mark_frozen(*tensors: torch.Tensor | torch.nn.Module) -> None:
    """Declare tensors (or all parameters and buffers of modules) frozen: incremental saves
    take them as unchanged while they keep their storage and layout, whatever their version
    counter says. Use it for weights written through ``.data`` that you know do not change;
    a tensor that does change after this must be unmarked (:func:`forget` the root or save
    with ``incremental=False``)."""
    for item in tensors:
        if isinstance(item, torch.nn.Module):
            mark_frozen(*item.parameters(), *item.buffers())
            continue
        if not isinstance(item, torch.Tensor):
            raise TypeError(f"mark_frozen takes tensors or modules, not {type(item).__name__}")
        with _LOCK:
            _FROZEN[_storage_key(item)] = weakref.ref(item)


def _storage_key(tensor: torch.Tensor) -> tuple[str, int]:
    return (str(tensor.device), tensor.untyped_storage().data_ptr())


def is_frozen(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` (or a tensor sharing its storage) was marked with
    :func:`mark_frozen` and that tensor is still alive."""
    with _LOCK:
        ref = _FROZEN.get(_storage_key(tensor))
    if ref is None:
        return False
    marked = ref()
    return marked is not None and marked.untyped_storage().data_ptr() == _storage_key(tensor)[1]


def fingerprint(tensor: torch.Tensor) -> Fingerprint | None:
    """What must be identical for ``tensor`` to be unchanged (None: never trusted, e.g.
    sparse, meta or tensor subclasses)."""
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter) or tensor.layout != torch.strided:
        return None
    if tensor.device.type == "meta" or tensor.is_neg() or tensor.is_conj():
        return None
    storage = tensor.untyped_storage()
    version = "frozen" if is_frozen(tensor) else tensor._version
    return (
        str(tensor.device),
        storage.data_ptr(),
        storage.nbytes(),
        tensor.storage_offset(),
        tuple(tensor.shape),
        tuple(tensor.stride()),
        tensor.dtype,
        version,
    )


def forget(root: str | os.PathLike[str] | None = None) -> None:
    """Drop what this process knows about ``root`` (all roots when None): its next save is
    full."""
    with _LOCK:
        if root is None:
            _TRACKERS.clear()
        else:
            _TRACKERS.pop(_key(root), None)


@dataclass
class Plan:
    """What an incremental save writes and references.

    Attributes:
        refs: relpath -> {tensor name: reference} of the tensors not written.
        live: relpath -> {tensor name: live tensor} of the referenced tensors (written after
            all if the referenced bytes went away before the commit and the tensor is still
            unchanged).
        fingerprints: relpath -> {tensor name: fingerprint} of the tensors written (taken
            before they are copied, so they can only be older than the bytes written).
    """

    refs: dict[str, dict[str, Reference]] = field(default_factory=dict)
    live: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    fingerprints: dict[str, dict[str, Tracked]] = field(default_factory=dict)
    referenced: dict[str, dict[str, Tracked]] = field(default_factory=dict)

    @property
    def referenced_bytes(self) -> int:
        """Bytes not written because they are referenced."""
        return sum(ref["nbytes"] for names in self.refs.values() for ref in names.values())


def plan(root: str | os.PathLike[str], tensor_files: dict[str, dict[str, torch.Tensor]]) -> Plan:
    """Split ``tensor_files`` (live tensors) into what to write and what to reference: the
    unchanged tensors are removed from ``tensor_files`` (in place) and listed in the plan
    (on an object store they are copied by the store instead: :mod:`fastckpt.store.s3copy`)."""
    result = Plan()
    with _LOCK:
        known = dict(_TRACKERS.get(_key(root), {}))
    for relpath, tensors in tensor_files.items():
        for name in list(tensors):
            tensor = tensors[name]
            print_ = fingerprint(tensor) if isinstance(tensor, torch.Tensor) else None
            if print_ is None:
                continue
            previous = known.get((relpath, name))
            tracked = (print_, tensor.untyped_storage())
            if previous is not None and previous[0][0] == print_:
                result.refs.setdefault(relpath, {})[name] = previous[1]
                result.live.setdefault(relpath, {})[name] = tensors.pop(name)
                result.referenced.setdefault(relpath, {})[name] = previous[0]
            else:
                result.fingerprints.setdefault(relpath, {})[name] = tracked
    return result


def check_plan(
    manifest: Manifest, result: Plan, *, replacing: int
) -> dict[str, dict[str, torch.Tensor]]:
    """Under the root's lock, before writing index ``replacing``: drop references whose bytes
    are no longer where they were (the root was pruned by another process, deleted and
    recreated, or the index replaced) or are in ``replacing`` itself. Returns the live
    tensors to write instead, which must still be unchanged.

    Raises:
        RuntimeError: a referenced tensor changed since it was planned and its old bytes are
            gone (cannot happen unless the state is mutated during an async capture).
    """
    restore: dict[str, dict[str, torch.Tensor]] = {}
    # Most references of a save point into the same few files: check each file once.
    there: dict[tuple[int, str, int, int], bool] = {}
    for relpath, names in list(result.refs.items()):
        for name, ref in list(names.items()):
            source = (ref["index"], ref["file"], ref["file_size"], ref["file_crc32c"])
            if source not in there:
                there[source] = _still_there(manifest, ref)
            if ref["index"] != replacing and there[source]:
                continue
            tensor = result.live[relpath].pop(name)
            tracked = result.referenced[relpath].pop(name)
            del names[name]
            if fingerprint(tensor) != tracked[0]:
                raise RuntimeError(
                    f"{relpath}:{name} was referenced but its bytes are gone and the tensor "
                    "changed meanwhile; save again"
                )
            result.fingerprints.setdefault(relpath, {})[name] = tracked
            restore.setdefault(relpath, {})[name] = tensor
        if not names:
            del result.refs[relpath]
    return restore


def _still_there(manifest: Manifest, ref: Reference) -> bool:
    index = ref["index"]
    entry = manifest.entries.get(index)
    if entry is not None and matches(entry["files"].get(ref["file"]), ref):
        return True
    path = source_path(manifest, ref)
    try:
        return os.stat(path).st_size == ref["file_size"]
    except OSError:
        return False


def record_saved(
    root: str | os.PathLike[str],
    index: int,
    result: Plan | None,
    files: Mapping[str, Mapping[str, int]],
) -> None:
    """After index ``index`` committed with the file records ``files``: remember the
    fingerprints of what it wrote (with the crc32c the files' headers hold) and keep those of
    what it referenced (on an object store, where the referenced tensors were copied into
    this index, remember them here too). ``result`` None (a full save with
    ``incremental=False``) forgets the root."""
    if result is None:
        forget(root)
        return
    backend = backend_for(root)
    copied = not is_local(backend)
    tracked: dict[tuple[str, str], tuple[Tracked, Reference]] = {}
    written = {relpath: dict(prints) for relpath, prints in result.fingerprints.items()}
    if copied:
        for relpath, prints in result.referenced.items():
            written.setdefault(relpath, {}).update(prints)
    for relpath, prints in written.items():
        record = files.get(relpath)
        if record is None:
            continue
        header = backend.read_header(Path(root) / str(index) / relpath)["tensors"]
        for name, fingerprint_and_storage in prints.items():
            info = header.get(name)
            if info is None or info["crc32c"] is None:
                continue
            tracked[(relpath, name)] = (
                fingerprint_and_storage,
                {
                    "index": index,
                    **tensor_reference(relpath, name, info),
                    "file_size": record["size"],
                    "file_crc32c": record["crc32c"],
                },
            )
    with _LOCK:
        previous = _TRACKERS.get(_key(root), {})
    for relpath, names in result.refs.items():
        for name in names:
            if (relpath, name) in previous and (relpath, name) not in tracked:
                tracked[(relpath, name)] = previous[(relpath, name)]
    with _LOCK:
        _TRACKERS[_key(root)] = tracked


def referenced_by_others(manifest: Manifest, index: int) -> list[int]:
    """Committed indices other than ``index`` whose references point into ``index``."""
    users = []
    for other in manifest.entries:
        if other == index or REFS_FILE not in manifest.entries[other]["files"]:
            continue
        refs = index_references(manifest, other)
        if any(ref["index"] == index for names in refs.values() for ref in names.values()):
            users.append(other)
    return users
