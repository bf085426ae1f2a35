"""Linked files of incremental CheckpointManager checkpoints: the ``refs`` of ``commit.json``,
reading an item with its referenced tensors, and checking the references.

A manager checkpoint saved incrementally keeps every tensor that did not change since the
checkpoint it is based on in a *hard link* to that checkpoint's file, inside its own
directory, and writes only the changed tensors into its own item file::

    CKPT/commit.json                 lists every file (linked ones too) and the references
    CKPT/model.json                  the item's structure
    CKPT/model.safetensors           the tensors that changed
    CKPT/linked/model.0.safetensors  a hard link to the base's file (no byte copied)

Since the link is a name of the same inode, deleting the base checkpoint (``rm -rf``) frees
nothing the incremental one needs: every manager checkpoint stays self-contained. The
references live in ``commit.json`` under ``refs``::

    "refs": {"model.safetensors": {"0.weight": {
        "file": "linked/model.0.safetensors", "name": "0.weight", "crc32c": 123,
        "nbytes": 24, "dtype": "F32", "shape": [2, 3], "offsets": [0, 24]}}}

keyed by the item's tensor file, then by tensor name. ``file`` is a file of the same
checkpoint, listed in ``files`` (so its size and crc32c are checked like any other file);
``name``, ``offsets``, ``dtype``, ``shape`` and ``crc32c`` are checked against its header.
Loads verify the linked file's bytes (every tensor's crc32c and the file's own) before using
them.
"""

from __future__ import annotations

import contextlib
import errno
import stat
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastckpt.container.reader import (
    FileReport,
    read_manager_item,
    read_tensor_file,
)
from fastckpt.errors import CheckpointFormatError, ChecksumMismatchError
from fastckpt.format.records import (
    COMMIT_RECORD,
    MANAGER_REFS,
    TENSOR_REFERENCE_FIELDS,
    check_fields,
    item_files,
)
from fastckpt.io.paths import check_name, check_relpath, safe_join
from fastckpt.storage.registry import backend_for

if TYPE_CHECKING:
    import torch

__all__ = [
    "LINKED_DIR",
    "REFS_FIELD",
    "Reference",
    "check_against_header",
    "check_references",
    "file_inodes",
    "freed_bytes",
    "is_linked_file",
    "item_references",
    "linked_relpath",
    "read_item",
    "read_references",
    "reference_reports",
    "referenced_sources",
    "split_sizes",
]

#: The folder of a checkpoint holding the files hard-linked from its base.
LINKED_DIR = "linked"
#: The ``commit.json`` field listing the references.
REFS_FIELD = MANAGER_REFS

#: One reference: ``file``, ``name``, ``crc32c``, ``nbytes``, ``dtype``, ``shape``, ``offsets``.
Reference = dict[str, Any]

_FIELDS: dict[str, type] = {**TENSOR_REFERENCE_FIELDS, "offsets": list}


def linked_relpath(stem: str, number: int) -> str:
    """The relpath of the ``number``-th file an item links from its base:
    ``linked/<stem>.<number>.safetensors``, the stem being the item's key, or
    ``<key>.rank<r>`` under a process group (a folder, so no item's own file can collide)."""
    return f"{LINKED_DIR}/{check_name(stem, 'state key')}.{number}.safetensors"


def is_linked_file(relpath: str) -> bool:
    """Whether ``relpath`` of a commit record is a linked file (holds referenced tensors, and
    possibly stale ones no reference names: not an item's tensor file)."""
    return relpath.startswith(f"{LINKED_DIR}/")


def split_sizes(files: Mapping[str, Mapping[str, Any]]) -> tuple[int, int]:
    """``(written, linked)`` bytes of a checkpoint's file records: what its save wrote, and
    what it holds in files hard-linked from earlier checkpoints (``linked/``, no byte
    written; freed only with the last checkpoint holding them). The one definition of a
    checkpoint's size: ``fastckpt ls`` and ``list_checkpoints`` show ``written``."""
    linked = sum(record["size"] for relpath, record in files.items() if is_linked_file(relpath))
    return sum(record["size"] for record in files.values()) - linked, linked


def read_references(record: Mapping[str, Any], where: str) -> dict[str, dict[str, Reference]]:
    """The validated ``refs`` of a commit record (empty for a checkpoint written in full): a
    copy the caller may change.

    Args:
        record: the commit record (:func:`fastckpt.format.records.read_commit_record`).
        where: the record's path, for messages.

    Raises:
        CheckpointFormatError: malformed references, or one naming a file the record does not
            list (names the field).
    """
    return {
        relpath: {name: dict(ref) for name, ref in names.items()}
        for relpath, names in _validated(record, where).items()
    }


def item_references(record: Mapping[str, Any], where: str, relpath: str) -> dict[str, Reference]:
    """The references of the item whose tensor file is ``relpath`` (tensor name -> its
    reference; empty when none): ``read_references(record, where).get(relpath, {})``, but
    the whole record's references are validated once for all of its items, not once per
    item (a load reads each item with the same record).

    Raises:
        what :func:`read_references` raises: for a malformed reference of any item.
    """
    return {name: dict(ref) for name, ref in _validated(record, where).get(relpath, {}).items()}


#: The record whose references were validated last: ``(record, its refs, its files, the
#: validated references)``. A load reads every item with one record; validating the whole
#: record's references once per item made it quadratic in the item count (1000 items: 28 s,
#: the same checkpoint written in full: 0.2 s). Another record, or one whose ``refs`` or
#: ``files`` were replaced, is validated anew; a record read from disk is not changed in place.
_last_validated: (
    tuple[Mapping[str, Any], object, object, dict[str, dict[str, Reference]]] | None
) = None


def _validated(record: Mapping[str, Any], where: str) -> dict[str, dict[str, Reference]]:
    """:func:`read_references` without the copy: shared, not to be changed."""
    global _last_validated
    refs = record.get(REFS_FIELD)
    if refs is None:
        return {}
    files = record["files"]
    last = _last_validated
    if last is not None and last[0] is record and last[1] is refs and last[2] is files:
        return last[3]
    parsed = _check_references_field(refs, files, where)
    _last_validated = (record, refs, files, parsed)
    return parsed


def _check_references_field(
    refs: object, files: Mapping[str, Any], where: str
) -> dict[str, dict[str, Reference]]:
    """The ``refs`` field of the record at ``where``, validated (see :func:`read_references`)."""
    if not isinstance(refs, Mapping):
        raise CheckpointFormatError(f"{where}: field {REFS_FIELD!r} must be an object")
    parsed: dict[str, dict[str, Reference]] = {}
    for relpath, names in refs.items():
        check_relpath(relpath, f"{where}: {REFS_FIELD} entry")
        if not isinstance(names, Mapping):
            raise CheckpointFormatError(f"{where}: {REFS_FIELD}[{relpath!r}] must be an object")
        for name, ref in names.items():
            at = f"{where}: {REFS_FIELD}[{relpath!r}][{name!r}]"
            if not isinstance(ref, Mapping):
                raise CheckpointFormatError(f"{at} must be an object")
            check_fields(ref, _FIELDS, at)
            offsets = ref["offsets"]
            if not (
                len(offsets) == 2
                and all(isinstance(v, int) and not isinstance(v, bool) for v in offsets)
                and 0 <= offsets[0] <= offsets[1]
                and offsets[1] - offsets[0] == ref["nbytes"]
            ):
                raise CheckpointFormatError(f"{at}.offsets must be [begin, begin + nbytes]")
            check_relpath(ref["file"], f"{at}.file")
            if ref["file"] not in files:
                raise CheckpointFormatError(
                    f"{at}.file {ref['file']!r} is not listed in the record's files"
                )
        parsed[str(relpath)] = {str(name): dict(ref) for name, ref in names.items()}
    return parsed


def check_against_header(
    path: Path, ref: Reference, header: Mapping[str, Any], referenced_as: str
) -> None:
    """Raise :class:`CheckpointFormatError` when the header of the linked file at ``path``
    disagrees with ``ref`` (no such tensor, other offsets, dtype or shape); ``referenced_as``
    names the tensor that references it, for the message."""
    info = header.get(ref["name"])
    if info is None:
        raise CheckpointFormatError(
            f"{path}: has no tensor {ref['name']!r}, which {referenced_as!r} references; the "
            "linked file was replaced: save the checkpoint again"
        )
    begin, end = info["data_offsets"]
    if (
        [begin, end] != ref["offsets"]
        or list(info["shape"]) != ref["shape"]
        or info["dtype"] != ref["dtype"]
    ):
        raise CheckpointFormatError(
            f"{path}: tensor {ref['name']!r} is {info['dtype']} {list(info['shape'])} at "
            f"[{begin}, {end}], the reference of {referenced_as!r} says {ref['dtype']} "
            f"{ref['shape']} at {ref['offsets']}; the linked file was replaced"
        )
    if info["crc32c"] != ref["crc32c"]:
        found = "none" if info["crc32c"] is None else f"{info['crc32c']:08x}"
        raise ChecksumMismatchError(
            f"{path}: tensor {ref['name']!r} has crc32c {found}, the reference of "
            f"{referenced_as!r} says {ref['crc32c']:08x}; the linked file was replaced or "
            "damaged: restore the checkpoint from a copy or save it again"
        )


def _group(refs: Mapping[str, Reference]) -> dict[str, list[tuple[str, Reference]]]:
    by_file: dict[str, list[tuple[str, Reference]]] = {}
    for name, ref in refs.items():
        by_file.setdefault(ref["file"], []).append((name, ref))
    return by_file


def read_item(
    directory: Path, record: Mapping[str, Any], key: str, rank: int = 0
) -> tuple[Any, dict[str, torch.Tensor]]:
    """:func:`fastckpt.container.reader.read_manager_item` that also reads the referenced tensors
    of an incremental checkpoint from its linked files (each verified whole: size, crc32c and
    every tensor's checksum, then each reference against the header).

    Raises:
        FileNotFoundError: a linked file is missing (the message names it and the fix).
        ChecksumMismatchError / CheckpointFormatError: damaged or replaced files or records.
    """
    skeleton, tensors = read_manager_item(directory, record, key, rank)
    where = str(directory / COMMIT_RECORD)
    relpath = item_files(record, key, rank)[1]
    refs = item_references(record, where, relpath)
    for file, pairs in _group(refs).items():
        path = safe_join(directory, file)
        try:
            source = read_tensor_file(path, record["files"][file], source=where)
        except FileNotFoundError:
            raise FileNotFoundError(
                errno.ENOENT,
                f"{path}: missing; it holds the unchanged tensors of item {key!r} (a hard link "
                f"to the checkpoint this one was saved after, listed in {where}). Restore the "
                "file from a copy of the checkpoint, or load an older checkpoint",
                str(path),
            ) from None
        described = backend_for(path).read_header(path)["tensors"]
        for name, ref in pairs:
            check_against_header(path, ref, described, name)
            if name in tensors:
                raise CheckpointFormatError(
                    f"{where}: {name!r} of item {key!r} is both written and referenced"
                )
            tensors[name] = source[ref["name"]]
    return skeleton, tensors


def referenced_sources(
    directory: Path, record: Mapping[str, Any]
) -> dict[str, dict[str, tuple[Path, Reference]]]:
    """Where the referenced tensors of a manager checkpoint are, for tools that open tensor
    files themselves (lazy reads, diff): item tensor file relpath -> tensor name -> (linked
    file, its reference: the tensor's ``name`` in that file, ``crc32c``, ...). Such tools
    must skip the linked files themselves (:func:`is_linked_file`): they can hold stale
    tensors no reference names.

    Raises:
        CheckpointFormatError: malformed references, or a path escaping the checkpoint.
    """
    refs = read_references(record, str(directory / COMMIT_RECORD))
    return {
        relpath: {name: (safe_join(directory, ref["file"]), ref) for name, ref in names.items()}
        for relpath, names in refs.items()
    }


def file_inodes(directory: Path) -> dict[tuple[int, int], int]:
    """``(st_dev, st_ino) -> size`` of every regular file under ``directory`` (empty when
    it is gone): what :func:`freed_bytes` counts."""
    found = {}
    for path in directory.rglob("*"):
        with contextlib.suppress(OSError):
            info = path.lstat()
            if stat.S_ISREG(info.st_mode):
                found[(info.st_dev, info.st_ino)] = info.st_size
    return found


def freed_bytes(
    doomed: Iterable[Path | Mapping[tuple[int, int], int]],
    kept: Iterable[Path | Mapping[tuple[int, int], int]],
) -> int:
    """Bytes that deleting the ``doomed`` local checkpoint directories frees while the
    ``kept`` ones stay (each a directory, or its :func:`file_inodes` taken earlier): files
    hard-linked into a kept checkpoint (incremental saves), or linked twice among the doomed,
    are counted once and only when no kept one holds them."""

    def inodes(where: Path | Mapping[tuple[int, int], int]) -> Mapping[tuple[int, int], int]:
        return file_inodes(where) if isinstance(where, Path) else where

    held: set[tuple[int, int]] = set()
    for directory in kept:
        held.update(inodes(directory))
    freed: dict[tuple[int, int], int] = {}
    for directory in doomed:
        freed.update(inodes(directory))
    return sum(size for inode, size in freed.items() if inode not in held)


def check_references(directory: Path, record: Mapping[str, Any]) -> list[str]:
    """Why the references of a manager checkpoint do not resolve (empty: they do). Reads the
    linked files' headers only (their bytes are checked as the recorded files they are)."""
    where = str(directory / COMMIT_RECORD)
    try:
        refs = read_references(record, where)
    except CheckpointFormatError as err:
        return [str(err)]
    problems = []
    for relpath, names in refs.items():
        for file, pairs in _group(names).items():
            try:
                path = safe_join(directory, file)
                described = backend_for(path).read_header(path)["tensors"]
            except FileNotFoundError:
                problems.append(
                    f"{directory / file}: missing; {relpath} references it (restore it from "
                    "a copy of the checkpoint)"
                )
                continue
            except (CheckpointFormatError, OSError) as err:
                problems.append(f"{directory / file}: {err}")
                continue
            for name, ref in pairs:
                try:
                    check_against_header(path, ref, described, f"{relpath}:{name}")
                except (CheckpointFormatError, ChecksumMismatchError) as err:
                    problems.append(str(err))
    return problems


def reference_reports(directory: Path, record: Mapping[str, Any]) -> list[FileReport]:
    """:func:`check_references` as ``fastckpt.verify`` reports: one ``corrupt`` report per
    problem (none when every reference resolves)."""
    return [
        FileReport(directory / COMMIT_RECORD, "corrupt", message=problem)
        for problem in check_references(directory, record)
    ]
