"""Incremental saves: which tensors are unchanged since the last save into a root.

A tensor is skipped only when it is *proven* unchanged: its bytes have the same 256-bit
BLAKE3 digest (:func:`digest_tensors`, Rust threads, GIL released) as the bytes the last
save wrote or referenced for it. torch's version counter (``tensor._version``) cannot prove
that: fused and foreach optimizers (``Adam(fused=True)``...), writes through ``.data``, numpy
views, DLPack, ``untyped_storage()`` or ctypes change the bytes without moving it. So the
counter is used only the other way round, as a cheap *changed* signal:

* each save records, per tensor (file + name), a *fingerprint* (storage address and size,
  storage offset, shape, stride, dtype, device and version counter) and the digest of what
  it saved, with where its bytes went (index, file, crc32c);
* at the next save, a tensor whose fingerprint differs (moved counter, new storage, new
  layout, a new tensor at the key) is written without a digest comparison;
* a tensor whose fingerprint is identical is a *candidate*: it is staged like any other,
  and just before the write (:func:`confirm`) the digest of the staged bytes is compared
  with the recorded one; equal, it becomes a reference to the bytes on disk
  (:mod:`fastckpt.container.refs`), otherwise it is written.

The digest of a written tensor is computed in the same step (what the next save compares
with), except for a tensor *seen moving*: the same tensor (storage, layout) whose version
counter moved since the last save and had moved before it too, i.e. one written in place
between saves again and again, as training does to every parameter and moment. It is expected
to move again, so hashing it would read its bytes for nothing; if it does not, its next save
writes it whatever its bytes (no digest to compare with) and records the digest then.
Skipping a digest can only cost a write, never reference stale bytes; a tensor that moves at
every other save only is still hashed each time it moves. Candidates are always hashed (the
proof itself; :func:`mark_frozen` tensors aside): a save reads their bytes once more in
memory, the price of soundness, measured in docs/incremental.md.

Tensors the caller marks with :func:`mark_frozen` are the documented opt-in to trust
without proof: while they keep their storage, layout and version counter they are
referenced without a digest comparison, whatever their bytes.

The tracker lives in this process, keyed by the root's absolute path; a new process starts
with a full save.
"""

from __future__ import annotations

import itertools
import logging
import os
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fastckpt import _native
from fastckpt.container.refs import (
    REFS_FILE,
    Reference,
    index_references,
    matches,
    root_key,
    source_path,
    take_distrust,
)
from fastckpt.errors import FastCkptError
from fastckpt.format.records import Manifest, tensor_reference
from fastckpt.io.files import byte_view, host_tensor
from fastckpt.io.forksafe import ForkSafeLock
from fastckpt.storage.registry import backend_for, display_path, is_local

__all__ = [
    "Plan",
    "Tracked",
    "comparable",
    "confirm",
    "digest_groups",
    "forget",
    "is_frozen",
    "mark_frozen",
    "plan",
    "record_saved",
    "settle",
    "track",
    "unmark_frozen",
    "unreference",
]

Fingerprint = tuple[Any, ...]

#: Threads that compute digests (memory-bound: a few are enough).
DIGEST_THREADS = max(1, min(8, os.cpu_count() or 1))

_LOG = logging.getLogger(__name__)


@dataclass
class Tracked:
    """What a save knows of one tensor it saved.

    Attributes:
        fingerprint: :func:`fingerprint` of the live tensor, taken before it was staged.
        storage: the live tensor's storage; holding it keeps its address from being reused
            by a new tensor (which would otherwise look like the same one).
        digest: BLAKE3 of the bytes saved (None until :func:`confirm` computed it, and for
            a tensor written while ``moving``; a tracked tensor without one is never
            referenced).
    """

    fingerprint: Fingerprint
    storage: Any
    digest: bytes | None = None
    #: the same tensor as at the last save, its version counter moved since
    moved: bool = False
    #: moved since the last save and before it: written without a digest (see the module
    #: docstring)
    moving: bool = False


#: group (a file, or a manager item) -> tensor name -> (tracked now, tracked at the last save,
#: reference to the last save's bytes): the tensors whose fingerprint did not move.
Candidates = dict[str, dict[str, tuple[Tracked, Tracked, Reference]]]


def digest_groups(
    groups: Mapping[str, Mapping[str, torch.Tensor]], keys: Sequence[tuple[str, str]]
) -> dict[tuple[str, str], bytes]:
    """The BLAKE3 digest of ``groups[group][name]`` for each ``(group, name)`` of ``keys``:
    of its bytes as a file would hold them (contiguous, on the host). Device tensors are
    copied to the host one group (one file) at a time, and the copies dropped after: a save
    never holds more than one file's worth of extra host memory for them."""
    by_group: dict[str, list[str]] = {}
    for group, name in keys:
        by_group.setdefault(group, []).append(name)
    result: dict[tuple[str, str], bytes] = {}
    for group, names in by_group.items():
        hosts = [host_tensor(f"{group}:{name}", groups[group][name]) for name in names]
        values = _native.digests([byte_view(host) for host in hosts], DIGEST_THREADS)
        result.update(((group, name), value) for name, value in zip(names, values, strict=True))
    return result


_LOCK = ForkSafeLock()
#: root -> {(relpath, name): (fingerprint, reference to the bytes on disk)}
_TRACKERS: dict[str, dict[tuple[str, str], tuple[Tracked, Reference]]] = {}
#: the view a mark_frozen tensor was marked with (see _view_key) -> (that tensor, the mark's
#: number: a tensor marked again after :func:`unmark_frozen` carries a new promise, from then
#: on, and must not match what a save under the old one recorded)
_FROZEN: dict[Any, tuple[weakref.ref[torch.Tensor], int]] = {}
_MARKS = itertools.count()


def _key(root: str | os.PathLike[str]) -> str:
    return root_key(root)


def mark_frozen(*tensors: torch.Tensor | torch.nn.Module) -> None:
    """Promise that tensors (or all parameters and buffers of modules) never change: while
    they keep their storage, layout and version counter, incremental saves reference them
    without comparing their digest (no read of their bytes). This is the one case where
    fastckpt trusts instead of proving: a marked tensor whose bytes change without moving its
    counter (a NumPy or ``ctypes`` write) is saved with its old bytes; one whose counter moved
    (``load_state_dict`` into it, an in-place op) is proven by its digest, as unmarked
    candidates are (referenced when its bytes are the same, written otherwise). The promise
    covers the marked view only (its storage, offset, shape, strides and dtype), not other
    tensors sharing its storage (a flat parameter buffer's other views). A mark lasts as
    long as the marked tensor object: mark the module or its parameters themselves, not a
    temporary such as ``p.detach()`` or a ``state_dict()`` value, whose mark lapses when it
    is freed (the tensors are then proven by their digest, as unmarked ones). To undo it,
    :func:`unmark_frozen` the tensors or :func:`forget` (every mark)."""
    for item in _frozen_targets(tensors, "mark_frozen"):
        key = _view_key(item)
        with _LOCK:
            if _mark(key) is None:  # a mark in force stays as it is (the promise holds on)
                _FROZEN[key] = (weakref.ref(item), next(_MARKS))


def unmark_frozen(*tensors: torch.Tensor | torch.nn.Module) -> None:
    """Withdraw :func:`mark_frozen` for these tensors (or all parameters and buffers of
    these modules): their next incremental saves prove them unchanged by their digest again
    (or write them). Marked again later, a tensor is written once more by the next save (what
    it became while unmarked is not trusted to be what the last marked save held).
    :func:`forget` withdraws every mark."""
    for item in _frozen_targets(tensors, "unmark_frozen"):
        with _LOCK:
            _FROZEN.pop(_view_key(item), None)


def _frozen_targets(
    items: tuple[torch.Tensor | torch.nn.Module, ...], caller: str
) -> list[torch.Tensor]:
    """The tensors ``items`` name: tensors, and every parameter and buffer of modules."""
    found: list[torch.Tensor] = []
    for item in items:
        if isinstance(item, torch.nn.Module):
            found += [*item.parameters(), *item.buffers()]
        elif isinstance(item, torch.Tensor):
            found.append(item)
        else:
            raise TypeError(f"{caller} takes tensors or modules, not {type(item).__name__}")
    return found


def track(tensor: torch.Tensor, print_: Fingerprint, previous: Tracked | None) -> Tracked:
    """What a save records of ``tensor`` (fingerprint ``print_``), given what the last save
    recorded of the tensor at its key: ``moved`` when only the version counter moved since,
    ``moving`` when it had moved at the last save too."""
    moved = (
        previous is not None
        and previous.fingerprint[:-1] == print_[:-1]
        and previous.fingerprint[-1] != print_[-1]
    )
    moving = moved and previous is not None and previous.moved
    return Tracked(print_, tensor.untyped_storage(), moved=moved, moving=moving)


#: What identifies a view for :func:`mark_frozen`: device, storage address, offset, shape,
#: strides, dtype.
_ViewKey = tuple[str, int, int, tuple[int, ...], tuple[int, ...], torch.dtype]


def _view_key(tensor: torch.Tensor) -> _ViewKey:
    return (
        str(tensor.device),
        tensor.untyped_storage().data_ptr(),
        int(tensor.storage_offset()),
        tuple(tensor.shape),
        tuple(tensor.stride()),
        tensor.dtype,
    )


def is_frozen(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a view :func:`mark_frozen` marked (the same storage, offset,
    shape, strides and dtype; ``state_dict()``'s detached copies of a marked parameter are)
    and the marked tensor is still alive with that view."""
    with _LOCK:
        return _mark(_view_key(tensor)) is not None


def _mark(key: _ViewKey) -> int | None:
    """The number of the mark in force on the view ``key`` (None: none). Under ``_LOCK``."""
    entry = _FROZEN.get(key)
    if entry is None:
        return None
    marked = entry[0]()
    return entry[1] if marked is not None and _view_key(marked) == key else None


def fingerprint(tensor: torch.Tensor) -> Fingerprint | None:
    """What must be identical for ``tensor`` to be unchanged (None: never trusted, e.g.
    sparse, meta or tensor subclasses, and inference tensors, which have no version counter)."""
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter) or tensor.layout != torch.strided:
        return None
    if tensor.is_inference():
        return None
    if tensor.device.type == "meta" or tensor.is_neg() or tensor.is_conj():
        return None
    storage = tensor.untyped_storage()
    try:
        address = storage.data_ptr()
    except RuntimeError:  # no memory of its own (a functional tensor): the write refuses it
        return None
    with _LOCK:
        mark = _mark(_view_key(tensor))
    # A marked tensor keeps its counter in the fingerprint too: after a change torch sees (a
    # ``load_state_dict`` into a frozen backbone) its bytes are proven by digest (see
    # :func:`comparable`); the mark only spares the digest of bytes whose counter did not move.
    version = tensor._version if mark is None else ("frozen", mark, tensor._version)
    return (
        str(tensor.device),
        address,
        storage.nbytes(),
        tensor.storage_offset(),
        tuple(tensor.shape),
        tuple(tensor.stride()),
        tensor.dtype,
        version,
    )


def forget(root: str | os.PathLike[str] | None = None) -> None:
    """Drop what this process knows about ``root`` (all roots when None): its next save is
    full. Every :func:`mark_frozen` mark is withdrawn too (the promise is the process's, not
    a root's)."""
    with _LOCK:
        if root is None:
            _TRACKERS.clear()
        else:
            _TRACKERS.pop(_key(root), None)
        _FROZEN.clear()


@dataclass
class Plan:
    """What an incremental save writes and references.

    Attributes:
        candidates: relpath -> {tensor name: (tracked now, tracked at the last save,
            reference to its bytes)} of the tensors whose fingerprint did not change: still
            in the snapshot (staged like the others) until :func:`confirm` compares digests.
        refs: relpath -> {tensor name: reference} of the tensors not written (filled by
            :func:`confirm`).
        live: relpath -> {tensor name: tensor} of the referenced tensors, as they were
            confirmed (written after all if the referenced bytes went away before the
            commit).
        fingerprints: relpath -> {tensor name: tracked} of the tensors written (fingerprint
            taken before they were staged, digest of the bytes written).
        referenced: relpath -> {tensor name: tracked} of the referenced tensors.
        confirmed: whether :func:`confirm` ran.
    """

    candidates: Candidates = field(default_factory=dict)
    refs: dict[str, dict[str, Reference]] = field(default_factory=dict)
    live: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    fingerprints: dict[str, dict[str, Tracked]] = field(default_factory=dict)
    referenced: dict[str, dict[str, Tracked]] = field(default_factory=dict)
    confirmed: bool = False

    @property
    def referenced_bytes(self) -> int:
        """Bytes not written because they are referenced."""
        return sum(ref["nbytes"] for names in self.refs.values() for ref in names.values())


def plan(root: str | os.PathLike[str], tensor_files: dict[str, dict[str, torch.Tensor]]) -> Plan:
    """Fingerprint the live tensors of ``tensor_files`` before they are staged, and list
    as candidates those whose fingerprint equals the last save's into ``root``. Nothing is
    taken out of ``tensor_files`` yet: :func:`confirm` does that once the digests of the
    bytes to write are known."""
    result = Plan()
    if take_distrust(root):
        forget(root)
        _LOG.warning(
            "%s: its newest index failed verification; this save writes every tensor "
            "instead of referencing files that may be the damaged ones",
            display_path(root),
        )
    with _LOCK:
        known = dict(_TRACKERS.get(_key(root), {}))
    for relpath, tensors in tensor_files.items():
        for name, tensor in tensors.items():
            print_ = fingerprint(tensor) if isinstance(tensor, torch.Tensor) else None
            if print_ is None:
                continue
            previous = known.get((relpath, name))
            tracked = track(tensor, print_, None if previous is None else previous[0])
            if previous is not None and comparable(previous[0].fingerprint, print_):
                result.candidates.setdefault(relpath, {})[name] = (tracked, *previous)
            else:
                result.fingerprints.setdefault(relpath, {})[name] = tracked
    return result


def settle(
    written: dict[str, dict[str, Tracked]],
    candidates: Candidates,
    groups: Mapping[str, Mapping[str, torch.Tensor]],
) -> list[tuple[str, str, Tracked, Reference]]:
    """The content proof, shared by roots and the manager. With ``groups`` holding the
    tensors as they will be written (staged copies for an async save): give every tracked
    tensor of ``written`` (but those ``moving``) and ``candidates`` the digest of its bytes,
    move the candidates whose digest differs from the one recorded at the last save into
    ``written``, and return the others, proven unchanged, as ``(group, name, tracked,
    reference)`` (frozen ones, :func:`mark_frozen`, without a comparison). ``groups`` is not
    changed."""
    keys = [
        (group, name)
        for group, names in written.items()
        for name, seen in names.items()
        if name in groups.get(group, {}) and not seen.moving
    ]
    keys += [
        (group, name)
        for group, pending in candidates.items()
        for name, (now, before, _) in pending.items()
        if not _trusted(now, before) and name in groups.get(group, {})
    ]
    digests = digest_groups(groups, keys)
    for group, tracked_files in written.items():
        for name, seen in tracked_files.items():
            seen.digest = digests.get((group, name), seen.digest)
    unchanged = []
    for group, pending in candidates.items():
        for name, (tracked, previous, ref) in pending.items():
            if name not in groups.get(group, {}):
                continue
            if _trusted(tracked, previous):
                tracked.digest = previous.digest
                same = True
            else:
                tracked.digest = digests[(group, name)]
                same = previous.digest is not None and tracked.digest == previous.digest
            if same:
                unchanged.append((group, name, tracked, ref))
            else:
                written.setdefault(group, {})[name] = tracked
    return unchanged


def confirm(result: Plan, tensor_files: dict[str, dict[str, torch.Tensor]]) -> None:
    """Just before writing ``tensor_files`` (the tensors as they will be written: staged
    copies for an async save): :func:`settle` the plan, then take the tensors proven
    unchanged out of ``tensor_files`` (in place) as references. Idempotent."""
    if result.confirmed:
        return
    result.confirmed = True
    for relpath, name, tracked, ref in settle(result.fingerprints, result.candidates, tensor_files):
        result.refs.setdefault(relpath, {})[name] = ref
        result.live.setdefault(relpath, {})[name] = tensor_files[relpath].pop(name)
        result.referenced.setdefault(relpath, {})[name] = tracked
    result.candidates = {}


def _is_frozen_print(print_: Fingerprint) -> bool:
    return isinstance(print_[-1], tuple)  # ("frozen", the mark's number, the counter)


def comparable(before: Fingerprint, now: Fingerprint) -> bool:
    """Whether a tensor fingerprinted ``now`` is a candidate for being the bytes fingerprinted
    ``before`` at the last save: the same fingerprint, or a :func:`mark_frozen` tensor (under
    the same mark) whose version counter alone moved (a ``load_state_dict`` into a frozen
    module): proven by its digest then, not trusted."""
    if before == now:
        return True
    return (
        _is_frozen_print(before)
        and _is_frozen_print(now)
        and before[:-1] == now[:-1]
        and before[-1][:2] == now[-1][:2]
    )


def _trusted(now: Tracked, before: Tracked) -> bool:
    """A candidate referenced without a digest comparison: a marked tensor whose fingerprint,
    version counter included, is the last save's."""
    return _is_frozen_print(now.fingerprint) and now.fingerprint == before.fingerprint


def check_plan(
    manifest: Manifest, result: Plan, *, replacing: int
) -> dict[str, dict[str, torch.Tensor]]:
    """Under the root's lock, before writing index ``replacing``: drop references whose bytes
    are no longer where they were (the root was pruned by another process, deleted and
    recreated, or the index replaced) or are in ``replacing`` itself. Returns the confirmed
    tensors to write instead (the very bytes whose digest was compared)."""
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
            for group, tensors in unreference(result, [(relpath, name)]).items():
                restore.setdefault(group, {}).update(tensors)
    return restore


def unreference(
    result: Plan, keys: Sequence[tuple[str, str]]
) -> dict[str, dict[str, torch.Tensor]]:
    """Take the references ``(relpath, name)`` out of the plan: those tensors are written
    after all. Returns them ``{relpath: {name: tensor}}`` (the very bytes whose digest was
    compared), for the caller to put back into the files it writes."""
    restore: dict[str, dict[str, torch.Tensor]] = {}
    for relpath, name in keys:
        restore.setdefault(relpath, {})[name] = result.live[relpath].pop(name)
        tracked = result.referenced[relpath].pop(name)
        result.fingerprints.setdefault(relpath, {})[name] = tracked
        del result.refs[relpath][name]
        if not result.refs[relpath]:
            del result.refs[relpath]
    return restore


def _still_there(manifest: Manifest, ref: Reference) -> bool:
    index = ref["index"]
    entry = manifest.entries.get(index)
    path = source_path(manifest, ref)
    if not is_local(manifest.backend):
        # An object store has no links: the store copies from that object, which must still
        # be there (an ``s3 rm --recursive`` of the index leaves its manifest entry).
        if entry is not None and not matches(entry["files"].get(ref["file"]), ref):
            return False
        try:
            return bool(manifest.backend.stat(path).size == ref["file_size"])
        except (OSError, FastCkptError):
            return False
    if entry is not None and matches(entry["files"].get(ref["file"]), ref):
        return True
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
        for name, seen in prints.items():
            info = header.get(name)
            if info is None or info["crc32c"] is None:
                continue
            tracked[(relpath, name)] = (
                seen,
                {
                    "index": index,
                    **tensor_reference(relpath, name, info),
                    "file_size": record["size"],
                    "file_crc32c": record["crc32c"],
                },
            )
    for relpath, names in result.refs.items():
        for name, ref in names.items():
            if (relpath, name) not in tracked:
                # What it is now (the same fingerprint and digest, the live storage) is what
                # the next save sees; its bytes are where this index's reference says (a
                # file linked into this index, see fastckpt.container.refs.link_into).
                tracked[(relpath, name)] = (result.referenced[relpath][name], dict(ref))
    with _LOCK:
        _TRACKERS[_key(root)] = tracked


def referenced_by_others(manifest: Manifest, index: int) -> list[int]:
    """Committed indices other than ``index`` whose references point into ``index``; an
    index whose directory was deleted (``rm -rf ROOT/<i>``) references nothing."""
    users = []
    for other in manifest.entries:
        if other == index or REFS_FILE not in manifest.entries[other]["files"]:
            continue
        if not backend_for(manifest.root).is_directory(manifest.root / str(other)):
            continue
        refs = index_references(manifest, other)
        if any(ref["index"] == index for names in refs.values() for ref in names.values()):
            users.append(other)
    return users
