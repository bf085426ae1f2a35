"""Incremental saves of :class:`fastckpt.CheckpointManager`: which tensors are unchanged
since the manager's previous save, and hard links that keep their bytes.

A manager checkpoint id is a directory its user deletes when they like (``rm -rf``), so a
reference into a sibling checkpoint would break silently. Instead, the unchanged tensors of a
save stay in a *hard link* to the previous checkpoint's file, made inside the new checkpoint's
staging directory before it is committed (see :mod:`fastckpt.container.links` for the format):
every checkpoint is self-contained by name, and deleting the previous one frees only what no
later checkpoint links.

Unchanged is *proven*, as for roots (:mod:`fastckpt.container.incremental`): a tensor whose
fingerprint (storage, layout, version counter) moved is written; one whose fingerprint did
not is a candidate, staged like the others, and is linked only if the BLAKE3 digest of the
staged bytes equals the digest of what the previous save wrote (:meth:`LinkPlan.confirm`,
just before the write); :func:`mark_frozen` tensors are trusted without the comparison. The
candidates are chosen when the state is captured (for async saves: under
:meth:`~fastckpt.CheckpointManager.lock`), and the base files holding them are opened then,
so the bytes stay reachable whatever happens to the previous checkpoint before the write.
Where a link cannot be made (another filesystem, links refused) the referenced tensors are
read back from the open file, checked against their crc32c, and written in full. The
tracker moves on only once the checkpoint is committed.

On an object store (``s3://`` ids) there are no links: the unchanged tensors are copied by the
store from the previous checkpoint's object into the new one (:mod:`fastckpt.storage.s3.copy`),
so each checkpoint is a complete set of objects and deleting the previous one is still safe.

Which checkpoint is the base: the manager's previous save, when it went to the same
directory or a sibling (same parent directory); ``save(..., base=...)`` names it explicitly
(any directory on the same filesystem). Only this process's saves can be bases: what a
tensor looked like before is known only by the process that saved it.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fastckpt.container.commit import DirectoryWriter
from fastckpt.container.incremental import Tracked, comparable, fingerprint, settle, track
from fastckpt.container.links import Reference, linked_relpath
from fastckpt.container.refs import take_distrust
from fastckpt.errors import FastCkptError
from fastckpt.format.records import tensor_reference
from fastckpt.io.files import read_metadata, read_tensors
from fastckpt.storage.backend import CopySource, LocalStaging
from fastckpt.storage.registry import backend_for, is_object_url

__all__ = ["LinkPlan", "SavedCheckpoint", "Tracker", "same_place"]

_LOG = logging.getLogger("fastckpt.manager")

#: ``(st_dev, st_ino, st_size, st_mtime_ns)``: a committed file, as it was committed.
Identity = tuple[int, int, int, int]


def _identity(info: os.stat_result) -> Identity:
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)


@dataclass
class SavedCheckpoint:
    """What one committed checkpoint holds, as the manager that saved it knows it.

    Attributes:
        directory: the checkpoint directory (absolute).
        files: relpath -> ``(file record {"size", "crc32c"}, identity)`` of its tensor files.
        tensors: ``(item, tensor name)`` -> ``(fingerprint at capture, relpath, reference)``:
            where each tracked tensor's bytes are in ``directory``.
    """

    directory: Path
    files: dict[str, tuple[dict[str, int], Identity]] = field(default_factory=dict)
    tensors: dict[tuple[str, str], tuple[Tracked, Reference]] = field(default_factory=dict)


@dataclass
class _Source:
    """A file of the base, opened at capture: its bytes stay reachable until the write."""

    relpath: str
    path: Path
    fd: int
    record: dict[str, int]


@dataclass
class LinkPlan:
    """What an incremental save references instead of writing (made at capture).

    Attributes:
        base: the checkpoint referenced (None: a full save that is still tracked).
        candidates: item -> tensor name -> (tracked now, tracked at the previous save,
            reference into ``base``) of the tensors whose fingerprint did not move: still in
            the state (staged like the others) until :meth:`confirm` compares digests.
        refs: item -> tensor name -> reference into ``base`` (``file`` is a relpath of base),
            filled by :meth:`confirm`.
        written: item -> tensor name -> tracked state of the tensors written (fingerprint at
            capture, digest of the bytes written).
        referenced: item -> tensor name -> tracked state of the tensors referenced.
        sources: relpath of base -> the opened file.
    """

    base: SavedCheckpoint | None = None
    candidates: dict[str, dict[str, tuple[Tracked, Tracked, Reference]]] = field(
        default_factory=dict
    )
    refs: dict[str, dict[str, Reference]] = field(default_factory=dict)
    written: dict[str, dict[str, Tracked]] = field(default_factory=dict)
    referenced: dict[str, dict[str, Tracked]] = field(default_factory=dict)
    sources: dict[str, _Source] = field(default_factory=dict)
    #: relpath in the new checkpoint -> relpath of base it links (filled while writing)
    linked: dict[str, str] = field(default_factory=dict)
    #: item -> tensor name -> the base's tensor an object store copies into the item's file
    #: (filled while writing, instead of links)
    copies: dict[str, dict[str, CopySource]] = field(default_factory=dict)
    #: item -> tensor name -> the bytes :meth:`confirm` proved unchanged (taken out of the
    #: written groups), written after all when their base object is gone (object stores)
    proven: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    #: whether :meth:`confirm` ran
    confirmed: bool = False

    @property
    def referenced_bytes(self) -> int:
        """Bytes this save does not write."""
        return sum(ref["nbytes"] for names in self.refs.values() for ref in names.values())

    def confirm(self, groups: dict[str, dict[str, torch.Tensor]]) -> None:
        """Just before the write, with ``groups`` holding the tensors as they will be
        written (staged copies for an async save): compute the digest of every tracked
        tensor (:func:`fastckpt.container.incremental.settle`); a candidate proven unchanged is
        taken
        out of ``groups`` (in place) and linked, the others are written. Idempotent."""
        if self.confirmed:
            return
        self.confirmed = True
        for key, name, tracked, ref in settle(self.written, self.candidates, groups):
            self.refs.setdefault(key, {})[name] = dict(ref)
            self.referenced.setdefault(key, {})[name] = tracked
            self.proven.setdefault(key, {})[name] = groups[key].pop(name)
        self.candidates = {}

    def close(self) -> None:
        """Close the base files opened at capture (idempotent)."""
        for source in self.sources.values():
            if source.fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(source.fd)
                source.fd = -1

    def link(
        self, writer: DirectoryWriter, key: str, tensors: dict[str, torch.Tensor], stem: str
    ) -> dict[str, Reference]:
        """Before item ``key``'s own file is written: hard-link the base files holding its
        referenced tensors into ``writer``'s staging directory (as
        ``linked/<stem>.<n>.safetensors``; the stem names the rank under a process group)
        and return the references (relpaths of the new checkpoint). A file that cannot be
        linked has its referenced tensors read back (verified) and added to ``tensors``, to
        be written in full."""
        refs = self.refs.get(key, {})
        if not refs:
            return {}
        if not isinstance(writer.staging, LocalStaging):
            # An object store copies the bytes into the item's own object (no links there):
            # the new checkpoint references nothing. A source object deleted since (the
            # previous checkpoint removed while this save was in flight) has its tensors
            # written instead, from the bytes whose digest was compared.
            backend = writer.backend
            there = {
                relpath: _object_there(backend, self.sources[relpath])
                for relpath in {ref["file"] for ref in refs.values()}
            }
            self.copies[key] = {}
            for name, ref in refs.items():
                if there[ref["file"]]:
                    self.copies[key][name] = CopySource(
                        self.sources[ref["file"]].path,
                        ref["name"],
                        ref["dtype"],
                        list(ref["shape"]),
                        ref["crc32c"],
                    )
                else:
                    tensors[name] = self.proven[key][name]
            return {}
        by_file: dict[str, list[str]] = {}
        for name, ref in refs.items():
            by_file.setdefault(ref["file"], []).append(name)
        result: dict[str, Reference] = {}
        for number, (relpath, names) in enumerate(sorted(by_file.items())):
            source = self.sources[relpath]
            target = linked_relpath(stem, number)
            if _link(writer, source, target):
                self.linked[target] = relpath
                for name in names:
                    result[name] = {**refs[name], "file": target}
            else:
                tensors.update(_read_back(source, {name: refs[name] for name in names}))
        return result


def _object_there(backend: Any, source: _Source) -> bool:
    """Whether the base object ``source`` is still in the store, as recorded (one HEAD)."""
    try:
        return bool(backend.stat(source.path).size == source.record["size"])
    except (OSError, FastCkptError):
        _LOG.info("%s: gone; its unchanged tensors are written in full", source.path)
        return False


def _link(writer: DirectoryWriter, source: _Source, target: str) -> bool:
    """Hard-link the opened ``source`` as ``target`` of the staging directory, recorded like
    a written file (the base's size and crc32c), only if the link is the very inode that was
    opened (a base replaced meanwhile is not linked). False when not possible."""
    if not isinstance(writer.staging, LocalStaging) or source.fd < 0:
        return False
    opened = os.fstat(source.fd)
    try:
        writer.staging.put_link(target, source.path, source.record, (opened.st_dev, opened.st_ino))
    except OSError as err:
        _LOG.info("%s: not linked (%s); its unchanged tensors are written in full", target, err)
        return False
    return True


def _read_back(source: _Source, refs: Mapping[str, Reference]) -> dict[str, torch.Tensor]:
    """The referenced tensors, read from the opened base file and checked against their
    crc32c (the fallback when the file cannot be linked)."""
    by_fd = f"/proc/self/fd/{source.fd}"
    path = by_fd if os.path.exists(by_fd) else str(source.path)
    tensors, _ = read_tensors(path, verify=True)
    header = read_metadata(path)["tensors"]
    result = {}
    for name, ref in refs.items():
        info = header.get(ref["name"])
        if info is None or info["crc32c"] != ref["crc32c"]:
            raise RuntimeError(
                f"{source.path}: tensor {ref['name']!r} is not the one the previous save "
                "wrote (the file was replaced while this save ran); save again"
            )
        result[name] = tensors[ref["name"]]
    return result


def same_place(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> bool:
    """Whether two checkpoint paths name the same directory (parents resolved)."""
    return _canonical(a) == _canonical(b)


def _canonical(path: str | os.PathLike[str]) -> Path:
    if is_object_url(path):
        return Path(os.fspath(path).rstrip("/"))  # pathlib's one spelling of an s3:// URL
    path = Path(os.fspath(path)).absolute()  # '..' kept: realpath resolves it as the kernel
    if path.name in ("", ".", ".."):
        return Path(os.path.realpath(path))
    return Path(os.path.realpath(path.parent)) / path.name


def _stored_identity(path: Path) -> Identity | None:
    """What :data:`Identity` a committed file has now (None: gone). On an object store only
    the size is known (an object replaced by one of the same size is caught by the header
    check of the copy)."""
    if is_object_url(path):
        try:
            info = backend_for(path).stat(path)
        except FileNotFoundError:
            return None
        return (0, 0, info.size, 0) if info.regular else None
    try:
        return _identity(os.stat(path, follow_symlinks=False))
    except OSError:
        return None


class Tracker:
    """The previous save of one manager (in this process), to reference at the next."""

    def __init__(self) -> None:
        """No checkpoint tracked: the next save is full."""
        self.last: SavedCheckpoint | None = None
        #: Forgotten because retention found the newest checkpoint damaged: the next save is
        #: full even when it names its ``base`` (which it may not reference).
        self.distrusted = False

    def forget(self) -> None:
        """Forget the previous save: the next one is full."""
        self.last = None

    def base_for(self, path: Path, base: str | os.PathLike[str] | None) -> SavedCheckpoint | None:
        """The checkpoint a save to ``path`` may reference (None: full write).

        Raises:
            ValueError: ``base`` is not the previous save of this manager.
        """
        last = self.last
        if last is None and self.distrusted:
            return None
        if last is not None and take_distrust(last.directory.parent):
            # Retention found the newest checkpoint there damaged: link nothing of it.
            _LOG.warning(
                "%s: the newest checkpoint there failed verification; this save writes every "
                "tensor instead of linking files that may be the damaged ones",
                last.directory.parent,
            )
            self.forget()
            self.distrusted = True
            return None
        if base is not None:
            if last is None or not same_place(base, last.directory):
                previous = "none" if last is None else str(last.directory)
                raise ValueError(
                    f"base={os.fspath(base)!r} is not this manager's previous save "
                    f"({previous}); only that one can be referenced (which tensors are "
                    "unchanged is known since the last save only): pass base=None"
                )
            return last
        if last is None:
            return None
        target = _canonical(path)
        if target == last.directory or target.parent == last.directory.parent:
            return last
        return None

    def plan(
        self,
        path: Path,
        base: str | os.PathLike[str] | None,
        groups: dict[str, dict[str, torch.Tensor]],
    ) -> LinkPlan:
        """At capture, before anything is staged: fingerprint every tensor of ``groups``,
        list as candidates those whose fingerprint equals the previous save's and open the
        base files holding them (:meth:`LinkPlan.confirm` decides at the write)."""
        plan = LinkPlan(base=self.base_for(path, base))
        known = {} if plan.base is None else plan.base.tensors
        candidates: dict[str, dict[str, tuple[Tracked, Tracked, Reference]]] = {}
        for key, tensors in groups.items():
            for name, tensor in tensors.items():
                print_ = fingerprint(tensor) if isinstance(tensor, torch.Tensor) else None
                if print_ is None:
                    continue
                previous = known.get((key, name))
                tracked = track(tensor, print_, None if previous is None else previous[0])
                if previous is not None and comparable(previous[0].fingerprint, print_):
                    candidates.setdefault(key, {})[name] = (tracked, *previous)
                else:
                    plan.written.setdefault(key, {})[name] = tracked
        try:
            usable = self._open_sources(plan, candidates)
        except BaseException:
            plan.close()
            raise
        for key, pending in candidates.items():
            for name, (now, before, ref) in pending.items():
                if ref["file"] in usable:
                    plan.candidates.setdefault(key, {})[name] = (now, before, ref)
                else:
                    plan.written.setdefault(key, {})[name] = now
        return plan

    @staticmethod
    def _open_sources(
        plan: LinkPlan, candidates: Mapping[str, Mapping[str, tuple[Tracked, Tracked, Reference]]]
    ) -> set[str]:
        """Open the base files the candidates are in; those still as committed are usable."""
        base = plan.base
        if base is None:
            return set()
        needed = {ref["file"] for names in candidates.values() for _, _, ref in names.values()}
        usable = set()
        for relpath in sorted(needed):
            record, identity = base.files[relpath]
            path = base.directory / relpath
            if is_object_url(path):
                # Nothing to hold open: the store copies from the object at write time.
                plan.sources[relpath] = _Source(relpath, path, -1, dict(record))
                if _stored_identity(path) == identity:
                    usable.add(relpath)
                continue
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
            except OSError:
                continue  # the base was deleted or replaced: write in full
            plan.sources[relpath] = _Source(relpath, path, fd, dict(record))
            if _identity(os.fstat(fd)) == identity:
                usable.add(relpath)
        return usable

    def record(
        self,
        directory: Path,
        plan: LinkPlan | None,
        files: Mapping[str, Mapping[str, int]],
        own_files: Mapping[str, str],
        refs: Mapping[str, Mapping[str, Reference]],
        identities: Mapping[str, Identity] | None = None,
    ) -> None:
        """After ``directory`` committed: track what it holds (or forget, ``plan`` None).

        Args:
            directory: the committed checkpoint.
            plan: the save's plan.
            files: its commit record's files.
            own_files: item -> the relpath of its own tensor file.
            refs: item -> tensor name -> reference (relpaths of ``directory``).
            identities: relpath -> :data:`Identity` of the files as this save committed
                them (:attr:`fastckpt.storage.backend.LocalStaging.identities`). Asked of
                ``directory`` after the commit instead, a file another process's save of
                the same id put there meanwhile was taken for this save's, and the next
                save linked it under this save's records (a damaged checkpoint).
        """
        self.distrusted = False  # a save committed after the damage: track it as usual
        if plan is None:
            self.forget()
            return
        saved = SavedCheckpoint(_canonical(directory))
        backend = backend_for(saved.directory)
        for key, relpath in own_files.items():
            self._track_file(saved, relpath, files, identities)
            header = backend.read_header(saved.directory / relpath)["tensors"]
            for name, info in header.items():
                tracked = plan.written.get(key, {}).get(name) or plan.referenced.get(key, {}).get(
                    name
                )
                if tracked is None or info["crc32c"] is None:
                    continue
                saved.tensors[(key, name)] = (tracked, _reference(relpath, name, info))
            for name, ref in refs.get(key, {}).items():
                self._track_file(saved, ref["file"], files, identities)
                saved.tensors[(key, name)] = (plan.referenced[key][name], dict(ref))
        self.last = saved

    @staticmethod
    def _track_file(
        saved: SavedCheckpoint,
        relpath: str,
        files: Mapping[str, Mapping[str, int]],
        identities: Mapping[str, Identity] | None,
    ) -> None:
        if relpath in saved.files:
            return
        if identities is not None and relpath in identities:
            identity: Identity | None = identities[relpath]
        else:
            identity = _stored_identity(saved.directory / relpath)
        if identity is None:
            raise FileNotFoundError(errno.ENOENT, "gone right after its commit", relpath)
        record = files[relpath]
        saved.files[relpath] = ({"size": record["size"], "crc32c": record["crc32c"]}, identity)


def _reference(relpath: str, name: str, info: Mapping[str, Any]) -> Reference:
    return {**tensor_reference(relpath, name, info), "offsets": list(info["data_offsets"])}
