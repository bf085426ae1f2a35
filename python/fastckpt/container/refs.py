"""Tensor references of incremental saves: ``refs.json``, where referenced bytes live, and
which indices retention must keep.

An index written incrementally writes only the tensors that changed; each unchanged tensor
is a *reference*, listed in the index's ``refs.json`` (itself a recorded file of the index,
so its size and crc32c are in the manifest)::

    {"format": "fastckpt-refs", "schema_version": 1,
     "refs": {"<relpath of the tensor file>": {"<tensor name>": {
         "index": 3, "file": "linked/0.safetensors", "name": "weight",
         "crc32c": 123, "nbytes": 24, "dtype": "F32", "shape": [2, 3],
         "file_size": 280, "file_crc32c": 456}}}}

**Every index is self-contained** (:func:`link_into`): the earlier files holding its
unchanged bytes are hard-linked into the index itself, as ``linked/<n>.safetensors`` (listed
in its manifest entry like any file), and its references name the index itself. Deleting any
other index (``rm -rf ROOT/<i>``, a prune) frees nothing it needs. Where a link is not
possible, the unchanged tensors are written in full.

Roots written by earlier versions have references naming the earlier index that holds the
bytes (never another reference). That file is ``ROOT/<index>/<file>`` while the index is
committed, and ``ROOT/.ref-<index>/<file>`` once a prune removed the index but a kept index
still references it (see :func:`retain_for_references`); such roots keep loading and pruning.
Loads check the referenced file against ``file_size``/``file_crc32c`` and the tensor against
``crc32c``. A reference no fastckpt wrote (naming an index not older than its own, other than
a file linked into it; or a committed index whose record of the file differs, with no retained
copy) is a :class:`~fastckpt.errors.CheckpointFormatError` naming ``<index>/refs.json`` and
the reference; a ``refs.json`` of an unknown ``schema_version`` is one too.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastckpt import _native
from fastckpt.container.links import LINKED_DIR
from fastckpt.container.reader import (
    FileReport,
    check_recorded,
    read_json,
    read_tensor_file,
    verify_content,
)
from fastckpt.errors import CheckpointFormatError, ChecksumMismatchError
from fastckpt.format.records import (
    TENSOR_REFERENCE_FIELDS,
    Manifest,
    check_fields,
    check_schema_version,
)
from fastckpt.io.forksafe import ForkSafeLock
from fastckpt.io.paths import is_ascii_decimal, safe_join
from fastckpt.storage.backend import TEMP_PREFIX, LocalStaging, remove_tree
from fastckpt.storage.backend import _sibling as temp_sibling
from fastckpt.storage.registry import backend_for, display_path, is_local, is_object_url

if TYPE_CHECKING:
    import torch

__all__ = [
    "REFS_FILE",
    "REFS_SCHEMA_VERSION",
    "RETAINED_PREFIX",
    "Reference",
    "check_reference",
    "collect_garbage",
    "distrust",
    "index_references",
    "link_into",
    "linked_file",
    "matches",
    "reference_reports",
    "referenced_indices",
    "refs_document",
    "remove_directory",
    "resolve_references",
    "restore_committed",
    "retain_for_references",
    "root_key",
    "set_aside_committed",
    "source_path",
    "take_distrust",
    "write_retained",
]

_LOG = logging.getLogger(__name__)

#: The file of an index listing its references.
REFS_FILE = "refs.json"
#: The newest ``refs.json`` schema this fastckpt reads (and the one it writes).
REFS_SCHEMA_VERSION = 1
#: A pruned index still referenced by a kept one lives on as ``ROOT/.ref-<index>/``.
RETAINED_PREFIX = ".ref-"

_DISTRUSTED_LOCK = ForkSafeLock()

#: Roots (:func:`root_key`) whose newest index failed verification in a prune: the next
#: incremental save into one references nothing (see :func:`distrust`).
_DISTRUSTED: set[str] = set()


def root_key(root: str | os.PathLike[str]) -> str:
    """``root`` as this process's registries key it: the absolute path, or the URL."""
    if is_object_url(root):
        return display_path(root).rstrip("/")
    return os.path.abspath(os.fspath(root))


def distrust(root: str | os.PathLike[str]) -> None:
    """The newest index of ``root`` failed verification: the next incremental save into it
    writes every tensor instead of referencing (linking, copying) bytes of earlier indices,
    which may be the damaged ones; else every later index linked the damaged file again and
    none verified (see :func:`fastckpt.container.incremental.plan`)."""
    with _DISTRUSTED_LOCK:
        _DISTRUSTED.add(root_key(root))


def take_distrust(root: str | os.PathLike[str]) -> bool:
    """Whether :func:`distrust` was called for ``root`` since the last call (clears it)."""
    key = root_key(root)
    with _DISTRUSTED_LOCK:
        found = key in _DISTRUSTED
        _DISTRUSTED.discard(key)
    return found


#: One reference (see the module docstring for the fields).
Reference = dict[str, Any]

_FIELDS = {"index": int, **TENSOR_REFERENCE_FIELDS, "file_size": int, "file_crc32c": int}


def refs_document(refs: Mapping[str, Mapping[str, Reference]]) -> dict[str, Any]:
    """The ``refs.json`` document for ``{relpath: {tensor name: reference}}``."""
    return {
        "format": "fastckpt-refs",
        "schema_version": REFS_SCHEMA_VERSION,
        "refs": {relpath: dict(names) for relpath, names in refs.items()},
    }


def _parse(document: Any, where: str) -> dict[str, dict[str, Reference]]:
    if not isinstance(document, Mapping) or document.get("format") != "fastckpt-refs":
        raise CheckpointFormatError(f"{where}: not a fastckpt refs.json")
    check_schema_version(document.get("schema_version"), REFS_SCHEMA_VERSION, where)
    refs = document.get("refs")
    if not isinstance(refs, Mapping):
        raise CheckpointFormatError(f"{where}: field 'refs' must be an object")
    parsed: dict[str, dict[str, Reference]] = {}
    for relpath, names in refs.items():
        if not isinstance(names, Mapping):
            raise CheckpointFormatError(f"{where}: refs[{relpath!r}] must be an object")
        for name, ref in names.items():
            if not isinstance(ref, Mapping):
                raise CheckpointFormatError(f"{where}: refs[{relpath!r}][{name!r}] not an object")
            check_fields(ref, _FIELDS, f"{where}: refs[{relpath!r}][{name!r}]")
            if ref["index"] < 0:
                raise CheckpointFormatError(f"{where}: refs[{relpath!r}][{name!r}].index < 0")
        parsed[str(relpath)] = {str(name): dict(ref) for name, ref in names.items()}
    return parsed


def index_references(manifest: Manifest, index: int) -> dict[str, dict[str, Reference]]:
    """The verified references of committed index ``index`` (empty for a full index).

    Raises:
        CheckpointFormatError / ChecksumMismatchError: a damaged ``refs.json``.
    """
    record = manifest.entries[index]["files"].get(REFS_FILE)
    if record is None:
        return {}
    path = manifest.file_path(index, REFS_FILE)
    parsed = _parse(read_json(path, record, source=str(manifest.path)), str(path))
    for relpath, names in parsed.items():
        for name, ref in names.items():
            problem = _reference_problem(manifest, index, ref)
            if problem is not None:
                raise CheckpointFormatError(
                    f"{path}: refs[{relpath!r}][{name!r}] (tensor {ref['name']!r} of index "
                    f"{ref['index']}'s {ref['file']}) {problem}; the index cannot be loaded "
                    "from this root (restore it from another copy)"
                )
    return parsed


def _reference_problem(manifest: Manifest, index: int, ref: Reference) -> str | None:
    """Why ``ref``, a reference of committed index ``index``, is none a fastckpt wrote (None:
    it may be): it names an index not older than its own (other than a file of its own,
    recorded as the reference says: a linked file), or a committed index whose record of the
    file differs from the reference's, with no retained copy beside it. A reference to an
    index that is gone is not a problem here: reading it says the file is missing."""
    named = ref["index"]
    if named == index:
        if matches(manifest.entries[index]["files"].get(ref["file"]), ref):
            return None  # a file linked into the index itself
        return (
            f"names index {index}, not older than its own, and not a file it records with "
            f"the reference's size {ref['file_size']} and crc32c {ref['file_crc32c']:08x} "
            "(a linked file)"
        )
    if named > index:
        return (
            f"names index {named}, not older than its own ({index}): no fastckpt references "
            "bytes of a later index"
        )
    entry = manifest.entries.get(named)
    if entry is None:
        return None
    record = entry["files"].get(ref["file"])
    if matches(record, ref):
        return None
    retained = safe_join(manifest.root / f"{RETAINED_PREFIX}{named}", ref["file"])
    if backend_for(retained).exists(retained):
        return None  # the bytes kept for it, checked as they are read
    recorded = (
        "does not record that file"
        if record is None
        else f"records it with size {record['size']} and crc32c {record['crc32c']:08x}"
    )
    return (
        f"says the file has size {ref['file_size']} and crc32c {ref['file_crc32c']:08x}, "
        f"but committed index {named} {recorded} (a record mismatch), and no copy of the "
        f"referenced bytes is kept ({display_path(retained)})"
    )


def source_path(manifest: Manifest, ref: Reference) -> Path:
    """Where the bytes of ``ref`` live: the committed index's directory, else the retained
    copy of a pruned one (which may not exist: the caller checks)."""
    index = ref["index"]
    committed = manifest.root / str(index)
    entry = manifest.entries.get(index)
    record = None if entry is None else entry["files"].get(ref["file"])
    if matches(record, ref) and _is_directory(committed):
        return safe_join(committed, ref["file"])
    retained = safe_join(manifest.root / f"{RETAINED_PREFIX}{index}", ref["file"])
    if entry is None and not backend_for(retained).exists(retained):
        # A prune committed without the index and renames it to its retained copy right
        # after (a kill in between leaves that to the next save): until then the bytes are
        # in ROOT/<index>, checked against the reference as they are read.
        pruned = safe_join(committed, ref["file"])
        if backend_for(pruned).exists(pruned):
            return pruned
    return retained


def _is_directory(path: Path) -> bool:
    """A directory on a filesystem; on an object store, a prefix with objects under it (an
    index promoted there keeps its links as files inside itself)."""
    return backend_for(path).is_directory(path)


def matches(record: Mapping[str, int] | None, ref: Reference) -> bool:
    """Whether a manifest file record is the file ``ref`` was taken from."""
    return (
        record is not None
        and record.get("size") == ref["file_size"]
        and record.get("crc32c") == ref["file_crc32c"]
    )


def _read_source(manifest: Manifest, ref: Reference) -> dict[str, torch.Tensor]:
    path = source_path(manifest, ref)
    record = {"size": ref["file_size"], "crc32c": ref["file_crc32c"]}
    index = ref["index"]
    source = f"a {REFS_FILE} reference to index {index}"
    legacy = not ref["file"].startswith(f"{LINKED_DIR}/")  # into an older index's own file
    if legacy and not backend_for(path).exists(path):
        committed = manifest.root / str(index) / ref["file"]
        raise FileNotFoundError(
            errno.ENOENT,
            f"{display_path(committed)}: missing, and no copy kept by prune "
            f"({display_path(path)}); an index of this "
            f"root written by an earlier fastckpt version reads unchanged tensors from index "
            f"{index}'s file through {REFS_FILE}, so deleting that index by hand broke it. "
            f"Put index {index} back from a backup; remove such indices with fastckpt prune "
            "(it keeps the bytes later indices reference)",
            display_path(committed),
        )
    return read_tensor_file(path, record, source=source)


def _check_tensor(ref: Reference, tensor: torch.Tensor, header_crc: int | None, where: str) -> None:
    from fastckpt.io.files import header_shape  # torch is loaded: a tensor was read

    nbytes = tensor.numel() * tensor.element_size()
    shape = header_shape(ref["name"], tensor)  # as the reference records it (F4: elements)
    if nbytes != ref["nbytes"] or shape != ref["shape"]:
        raise CheckpointFormatError(
            f"{where}: referenced tensor {ref['name']!r} has shape {shape} "
            f"({nbytes} B), the reference says {ref['shape']} ({ref['nbytes']} B)"
        )
    if header_crc is not None and header_crc != ref["crc32c"]:
        raise ChecksumMismatchError(
            f"{where}: referenced tensor {ref['name']!r} has crc32c {header_crc:08x}, the "
            f"reference says {ref['crc32c']:08x}; the referenced checkpoint was replaced"
        )


def resolve_references(
    manifest: Manifest, refs: Mapping[str, Reference], *, owned: bool
) -> dict[str, torch.Tensor]:
    """Read the referenced tensors ``{name: reference}`` of one tensor file (each referenced
    file read, and verified, once).

    Raises:
        FileNotFoundError: a referenced file is gone.
        CheckpointFormatError / ChecksumMismatchError: it does not match the reference.
    """
    by_source: dict[tuple[int, str], list[tuple[str, Reference]]] = {}
    for name, ref in refs.items():
        by_source.setdefault((ref["index"], ref["file"]), []).append((name, ref))
    tensors: dict[str, torch.Tensor] = {}
    for pairs in by_source.values():
        path = source_path(manifest, pairs[0][1])
        source = _read_source(manifest, pairs[0][1])
        checksums = _header_checksums(path)
        for name, ref in pairs:
            tensor = source.get(ref["name"])
            if tensor is None:
                raise CheckpointFormatError(
                    f"{path}: has no tensor {ref['name']!r}, which {name!r} references"
                )
            _check_tensor(ref, tensor, checksums.get(ref["name"]), str(path))
            tensors[name] = tensor.clone() if owned else tensor
    return tensors


def linked_file(number: int) -> str:
    """The relpath of the ``number``-th file an index hard-links from earlier indices."""
    return f"{LINKED_DIR}/{number}.safetensors"


def link_into(
    staging: LocalStaging,
    manifest: Manifest,
    index: int,
    refs: Mapping[str, Mapping[str, Reference]],
) -> tuple[dict[str, dict[str, Reference]], list[tuple[str, str]]]:
    """Make the index being written (``index``, staged in ``staging``) self-contained: every
    file holding bytes it references is hard-linked into it as ``linked/<n>.safetensors``
    (recorded with the file's size and crc32c) and the references are rewritten to point
    there. Deleting the earlier index (``rm -rf``, prune) then frees nothing it needs.
    Called under the root's lock; each source is checked (size, header crc32c of every
    referenced tensor) and linked by inode only once its bytes are proven to be the recorded
    ones (:meth:`~fastckpt.storage.backend.LocalStaging.put_proven_link`: written or read back
    by this process and unchanged since, or read back now), so a file changed in place is
    never carried into the new index.

    Returns:
        The rewritten references ``{relpath: {name: reference}}``, and the ``(relpath,
        name)`` of the tensors whose file could not be linked here (no hard links on this
        filesystem, or it is no longer the referenced file): the caller writes those in full.
    """
    by_source: dict[tuple[int, str, int, int], list[tuple[str, str]]] = {}
    for relpath, names in refs.items():
        for name, ref in names.items():
            key = (ref["index"], ref["file"], ref["file_size"], ref["file_crc32c"])
            by_source.setdefault(key, []).append((relpath, name))
    linked: dict[str, dict[str, Reference]] = {}
    unlinked: list[tuple[str, str]] = []
    for number, members in enumerate(by_source[key] for key in sorted(by_source)):
        first = refs[members[0][0]][members[0][1]]
        target = linked_file(number)
        try:
            path = source_path(manifest, first)
            problem = _source_problem(path, [refs[r][n] for r, n in members])
            if problem is not None:
                raise FileNotFoundError(problem)
            record = {"size": first["file_size"], "crc32c": first["file_crc32c"]}
            if not staging.put_proven_link(target, path, record):
                raise FileNotFoundError(f"{display_path(path)}: not linked (see the log)")
        except (OSError, CheckpointFormatError) as err:
            _LOG.info("%s: not linked (%s); its tensors are written in full", target, err)
            unlinked.extend(members)
            continue
        for relpath, name in members:
            linked.setdefault(relpath, {})[name] = {
                **refs[relpath][name],
                "index": index,
                "file": target,
            }
    return linked, unlinked


def _header_checksums(path: Path) -> dict[str, int | None]:
    backend = backend_for(path)
    if is_local(backend):
        return dict(_native.read_header(os.fspath(path))["checksums"])
    tensors = backend.read_header(path)["tensors"]
    return {name: info.get("crc32c") for name, info in tensors.items()}


def check_reference(manifest: Manifest, refs: Sequence[Reference]) -> str | None:
    """Why the references ``refs`` (into one file: the same index, file, size and crc32c)
    do not resolve in ``manifest``'s root (None: they do). Reads only the referenced file's
    size and header (verification of its bytes is the loader's/verify's file check)."""
    return _source_problem(source_path(manifest, refs[0]), refs)


def write_retained(root: Path, index: int, relpath: str, data: bytes) -> Path:
    """Write ``data`` as file ``relpath`` of the retained copy of index ``index`` in the
    local root ``root`` (``ROOT/.ref-<index>/<relpath>``, where references of an earlier
    version's layout find the bytes of an index the root does not hold), durably and whole or
    absent (a temporary file, fsynced, renamed; every directory made for it fsynced in its
    parent). A retained copy no committed index references is removed by the next save or
    prune (:func:`collect_garbage`). Returns its path."""
    path = safe_join(root / f"{RETAINED_PREFIX}{index}", relpath, within=root)
    made: list[Path] = []
    parent = path.parent
    while not parent.is_dir():
        made.append(parent)
        parent = parent.parent
    for directory in reversed(made):
        directory.mkdir()
    _native.write_bytes_atomic(os.fspath(path), data, True)
    for directory in made:
        _native.fsync_dir(os.fspath(directory.parent))
    return path


def _source_problem(path: Path, refs: Sequence[Reference]) -> str | None:
    """Why the file at ``path`` is not the one ``refs`` (references into that one file) were
    taken from (None: it is): its size, and each tensor's crc32c in its header, read once."""
    shown = display_path(path)
    try:
        size = backend_for(path).stat(path).size
    except FileNotFoundError:
        return f"{shown}: missing (referenced by a kept index)"
    for ref in refs:
        if size != ref["file_size"]:
            return f"{shown}: size {size} differs from the referenced {ref['file_size']}"
    try:
        checksums = _header_checksums(path)
    except (CheckpointFormatError, OSError) as err:
        return f"{shown}: {err}"
    for ref in refs:
        if checksums.get(ref["name"]) != ref["crc32c"]:
            return f"{shown}: tensor {ref['name']!r} is not the referenced one (crc32c differs)"
    return None


def reference_reports(manifest: Manifest, index: int, threads: int) -> list[FileReport]:
    """``fastckpt.verify``'s check of the references of committed index ``index``: each
    referenced file verified whole (size, crc32c, every tensor's checksum), and each
    referenced tensor matched against the file's header. One report per referenced file."""
    try:
        refs = index_references(manifest, index)
    except ChecksumMismatchError as err:  # a damaged refs.json is a finding, not an error
        path = manifest.file_path(index, REFS_FILE)
        return [FileReport(path, "mismatch", message=str(err), index=index)]
    except (CheckpointFormatError, OSError) as err:
        path = manifest.file_path(index, REFS_FILE)
        return [FileReport(path, "corrupt", message=str(err), index=index)]
    by_source: dict[tuple[int, str], list[Reference]] = {}
    for names in refs.values():
        for ref in names.values():
            by_source.setdefault((ref["index"], ref["file"]), []).append(ref)
    reports = []
    own_files = manifest.entries[index]["files"]
    for group in by_source.values():
        try:
            path = source_path(manifest, group[0])
        except (CheckpointFormatError, OSError) as err:
            reports.append(FileReport(manifest.root, "corrupt", message=str(err), index=index))
            continue
        if group[0]["index"] == index and matches(own_files.get(group[0]["file"]), group[0]):
            # A file linked into this index: its bytes are checked as one of the index's
            # own files; here only that it holds the referenced tensors.
            problem = _source_problem(path, group) if os.path.lexists(path) else None
            if problem is not None:
                reports.append(FileReport(path, "corrupt", message=problem, index=index))
            continue
        record = {"size": group[0]["file_size"], "crc32c": group[0]["file_crc32c"]}
        checked = check_recorded(
            path,
            record,
            verify_content(threads),
            source=f"{manifest.file_path(index, REFS_FILE)}",
            index=index,
        )
        report = checked.report
        if report.ok:
            problem = _source_problem(path, group)
            if problem is not None:
                report.status, report.message = "corrupt", problem
        elif report.status == "missing":
            report.message = f"{report.message}; index {index} references it"
        reports.append(report)
    return reports


#: refs.json path, size and crc32c -> (the file's identity when read, the indices it
#: references). Committed files are never modified in place (an index is replaced by a new
#: directory), so a file with the same identity need not be read and parsed again at every
#: save and prune; anything else (a new inode, size or mtime) is read again.
_REFERENCED: dict[tuple[str, int, int], tuple[tuple[int, int, int, int], frozenset[int]]] = {}
_REFERENCED_MAX = 256


def referenced_indices(manifest: Manifest, indices: Iterable[int]) -> set[int]:
    """The indices whose bytes the given committed indices reference."""
    found: set[int] = set()
    for index in indices:
        record = manifest.entries[index]["files"].get(REFS_FILE)
        if record is None:
            continue
        path = manifest.file_path(index, REFS_FILE)
        key = (os.fspath(path), record["size"], record["crc32c"])
        try:
            info = os.stat(path)
        except OSError:
            info = None
        identity = (
            None if info is None else (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)
        )
        cached = _REFERENCED.get(key)
        if identity is not None and cached is not None and cached[0] == identity:
            found.update(cached[1])
            continue
        try:
            mine = frozenset(
                ref["index"]
                for names in index_references(manifest, index).values()
                for ref in names.values()
            )
        except (OSError, CheckpointFormatError, ChecksumMismatchError) as err:
            # Unreadable (a lost or damaged index): which bytes it references is unknown, so
            # every older index's are kept for it (retained copies; a prune that later drops
            # this index frees them). Before, every prune of the root failed until the
            # manifest was edited by hand.
            _LOG.warning(
                "%s: the references of index %d cannot be read (%s); the bytes of every "
                "older index are kept for it",
                display_path(manifest.root),
                index,
                err,
            )
            found.update(i for i in manifest.entries if i < index)
            continue
        if identity is not None:
            if len(_REFERENCED) >= _REFERENCED_MAX:
                _REFERENCED.clear()
            _REFERENCED[key] = (identity, mine)
        found.update(mine)
    return found


def remove_directory(root: Path, directory: Path) -> None:
    """Delete ``directory`` of ``root`` so that, under its own name, it is whole or absent at
    every instant: it is renamed to a hidden temporary name (``.tmp-<name>~<pid>~<host>~...``,
    durably) and deleted there. A kill during the deletion leaves that temporary directory,
    which the next save into the root removes; never a partial index or retained copy."""
    aside = temp_sibling(TEMP_PREFIX, root / f"gone-{directory.name}")
    try:
        os.rename(directory, aside)
    except FileNotFoundError:
        return
    _native.fsync_dir(str(root))
    remove_tree(aside)


def retain_for_references(root: Path, index: int) -> None:
    """Keep the bytes of index ``index`` (pruned, or about to be) for the kept indices that
    reference them: ``ROOT/<index>`` is renamed to ``ROOT/.ref-<index>`` (no copy).

    An existing ``ROOT/.ref-<index>`` is never replaced. A prune's retained copy appears whole
    (one rename of a durable directory, made before the prune's commit) and goes only by a
    rename (:func:`remove_directory`), while ``ROOT/<index>`` next to it is what a killed
    prune was deleting after its commit (possibly partly). A promotion's retained copy holds
    only the files one promoted index referenced (:func:`write_retained`): the files of
    ``ROOT/<index>`` it lacks are moved into it first. Then ``ROOT/<index>`` is removed."""
    directory = root / str(index)
    retained = root / f"{RETAINED_PREFIX}{index}"
    if not os.path.isdir(directory) or os.path.islink(directory):
        return
    if os.path.lexists(retained):
        _move_missing(directory, retained)
        remove_directory(root, directory)
        return
    os.rename(directory, retained)
    _native.fsync_dir(str(root))


def _move_missing(directory: Path, retained: Path) -> None:
    """Move every file of ``directory`` that ``retained`` lacks (same relative path) into it,
    durably (each directory it changed fsynced)."""
    changed: set[str] = set()
    for folder, _, names in os.walk(directory):
        relative = os.path.relpath(folder, directory)
        into = retained if relative == "." else retained / relative
        for name in names:
            if os.path.lexists(into / name):
                continue
            if not os.path.isdir(into):
                os.makedirs(into)
                changed.add(str(into.parent))
            os.rename(os.path.join(folder, name), into / name)
            changed.update((str(into), folder))
    for folder in sorted(changed, key=len, reverse=True):
        _native.fsync_dir(folder)


def _retained_indices(root: Path) -> list[int]:
    """The indices of the retained directories (``ROOT/.ref-<index>``) of local ``root``."""
    names = sorted(os.listdir(root)) if os.path.isdir(root) else []
    tails = (name[len(RETAINED_PREFIX) :] for name in names if name.startswith(RETAINED_PREFIX))
    return [int(tail) for tail in tails if is_ascii_decimal(tail)]


def set_aside_committed(root: Path, committed: Collection[int]) -> list[int]:
    """The indices of ``committed`` whose folder is gone while ``ROOT/.ref-<index>`` is
    there: what :func:`restore_committed` puts back."""
    return [
        index
        for index in _retained_indices(root)
        if index in committed and not os.path.lexists(root / str(index))
    ]


def restore_committed(root: Path, committed: Collection[int]) -> list[int]:
    """Put back ``ROOT/.ref-<index>`` as ``ROOT/<index>`` (one rename, durable) for every
    ``index`` of ``committed`` whose folder is gone: what an earlier version's prune left when
    its commit failed (or it was killed) after it had renamed the index aside. The index is
    then whole again, and so are the indices reading from it; deleting that folder as garbage
    lost them all for good. Returns the indices put back (each logged)."""
    restored = set_aside_committed(root, committed)
    for index in restored:
        os.rename(root / f"{RETAINED_PREFIX}{index}", root / str(index))
        _native.fsync_dir(str(root))
        _LOG.warning(
            "%s: committed index %d was in %s%d (set aside by a prune that did not commit); "
            "put back",
            display_path(root),
            index,
            RETAINED_PREFIX,
            index,
        )
    return restored


def collect_garbage(root: Path, referenced: set[int], committed: Collection[int]) -> list[str]:
    """Delete retained directories (``ROOT/.ref-<index>``) no committed index references
    (each by :func:`remove_directory`: a kill never leaves a partial retained copy), except
    that of a ``committed`` index whose own folder is gone, which is put back instead
    (:func:`restore_committed`)."""
    restore_committed(root, committed)
    removed = []
    for index in _retained_indices(root):
        if index not in referenced:
            name = f"{RETAINED_PREFIX}{index}"
            remove_directory(root, root / name)
            removed.append(name)
    return removed
