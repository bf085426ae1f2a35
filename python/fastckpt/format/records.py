"""The two commit records, defined once: names, schema versions, parsing and serialization.

```
ROOT/manifest.json     save_checkpoint root: schema_version, latest, one entry per index
ROOT/<index>/          the files of one committed index (named by its manifest entry)
CKPT/commit.json       CheckpointManager checkpoint: format, world_size, items, files
```

Each record names every file of its checkpoint with ``{"size", "crc32c"}``; nothing it says is
trusted: names are checked before they touch the filesystem, and every field a loader relies
on is type-checked here, so damage fails with a :class:`~fastckpt.errors.CheckpointFormatError`
naming the file and the field.
"""

from __future__ import annotations

import errno
import json
import math
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastckpt import _native
from fastckpt.errors import CheckpointFormatError, ChecksumMismatchError, IndexNotCommittedError
from fastckpt.io.paths import (
    check_name,
    check_name_length,
    check_relpath,
    is_ascii_decimal,
    is_text,
    safe_join,
)
from fastckpt.storage.access import read_refused
from fastckpt.storage.backend import MAX_RECORD_BYTES, FileRecord, StorageBackend, read_by_size
from fastckpt.storage.registry import backend_for, display_path, is_local

__all__ = [
    "APPLIED_ENTRY_FIELDS",
    "COMMIT_RECORD",
    "COMPONENT_SUFFIXES",
    "ENTRY_FIELDS",
    "FROZEN_FIELD",
    "GENERATION_PREFIX",
    "MANAGER_FORMAT",
    "MANAGER_REFS",
    "MANAGER_SCHEMA_VERSION",
    "MANIFEST",
    "MANIFEST_CRC_FIELD",
    "MAX_INDEX",
    "MAX_JSON_DEPTH",
    "MODES_FIELD",
    "REPLACED_MANIFEST",
    "SAVED_NOW",
    "SAVED_NS",
    "SCHEMA_VERSION",
    "SHARDED_DIR",
    "SHARDED_RECORD",
    "STRIDES_FIELD",
    "TENSOR_REFERENCE_FIELDS",
    "Manifest",
    "by_commit_time",
    "check_fields",
    "check_item_key",
    "check_schema_version",
    "check_seal",
    "commit_record",
    "component_files",
    "generation_order",
    "item_files",
    "json_bytes",
    "load_json",
    "nesting_depth",
    "new_generation",
    "now_ns",
    "read_by_size",
    "read_commit_record",
    "read_record_bytes",
    "record_file",
    "save_dated",
    "saved_seconds",
    "seal_manifest",
    "tensor_reference",
    "unexpected_fields",
]

#: The largest checkpoint index a manifest holds (18 decimal digits): saves refuse larger ones.
MAX_INDEX = 10**18 - 1

#: The commit record of a save_checkpoint root.
MANIFEST = "manifest.json"
#: The commit record of a CheckpointManager checkpoint.
COMMIT_RECORD = "commit.json"
#: The commit record of a sharded (:mod:`fastckpt.dcp`) checkpoint.
SHARDED_RECORD = "fastckpt-dcp.json"
#: On an object store, the manifest a replacement of index ``k`` withdrew ``k`` from, kept
#: with a copy of ``k``'s objects under ``ROOT/.trash-<k>.<tag>/`` until the new ``k`` is
#: committed (see :mod:`fastckpt.container.commit`).
REPLACED_MANIFEST = "replaced-manifest.json"
#: Where a save_checkpoint root keeps the sharded part of index ``i``: ``ROOT/sharded/<i>``.
SHARDED_DIR = "sharded"
#: The manifest entry field naming each model's frozen parameters (``requires_grad`` False
#: when saved): a model rebuilt from its spec has every parameter requiring grad, as its
#: constructor made them, and the load gives the recorded ones back. Absent: none.
FROZEN_FIELD = "frozen"
#: The manifest entry field giving each model's parameters and buffers laid out densely but
#: not contiguously when saved (``channels_last``): ``{model: {tensor name: strides}}``
#: (:mod:`fastckpt.checkpoint.layouts`), which a rebuilt model takes back. Absent: all
#: contiguous.
STRIDES_FIELD = "strides"
#: The manifest entry field giving each model's modules whose training mode
#: (``module.training``) differs from their parent's when saved: ``{model: {module name:
#: bool}}`` (:mod:`fastckpt.checkpoint.modes`), which a rebuilt model takes back. Absent: all
#: in training mode.
MODES_FIELD = "modes"
#: Entry fields a load must apply to rebuild what was saved: a reader that ignored them would
#: load a different model without a word (train/eval modes, layouts, frozen parameters).
APPLIED_ENTRY_FIELDS = (FROZEN_FIELD, STRIDES_FIELD, MODES_FIELD)
#: Manifest schemas: 1, entries without :data:`APPLIED_ENTRY_FIELDS`; 2, some entry carries
#: one. A manifest is written as 1 whenever it can be (an earlier fastckpt reads it whole) and
#: as 2 only when it must: an earlier fastckpt, which reads schema 1 and skips entry fields it
#: does not know, then says "written by a newer fastckpt, upgrade" instead of loading a
#: BatchNorm frozen in eval mode back in training mode, a ``channels_last`` model contiguous,
#: or a frozen parameter trainable. The newest schema this fastckpt reads.
SCHEMA_VERSION = 2
#: ``format`` field of a CheckpointManager commit record.
MANAGER_FORMAT = "fastckpt-manager"
#: CheckpointManager commit-record schema: 1 for a checkpoint written in full, 2 for one with
#: references to hard-linked files (field :data:`MANAGER_REFS`, see
#: :mod:`fastckpt.container.links`), so that a fastckpt that cannot follow them says "upgrade"
#: instead of missing tensors. The newest this fastckpt reads.
MANAGER_SCHEMA_VERSION = 2
#: The commit-record field listing an incremental checkpoint's references.
MANAGER_REFS = "refs"
#: A *generation* is the directory (a key prefix on an object store) that holds one save's
#: data under a name no other save uses: ``g-<creation time in ms, 13 digits>-<64 random
#: bits, hex>``, so names sort by creation time. The commit record written after the data
#: names it in its field ``generation`` (see :mod:`fastckpt.container.commit`). Every sharded
#: checkpoint and every CheckpointManager checkpoint on an object store is written this way.
GENERATION_PREFIX = "g-"
#: Top-level manifest field holding the crc32c of the rest of the document (see Manifest).
MANIFEST_CRC_FIELD = "crc32c"
_MANIFEST_FIELDS = frozenset(
    {"format", "schema_version", "latest", "checkpoints", MANIFEST_CRC_FIELD}
)
#: Fields every manifest entry has (written by fastckpt.checkpoint.components.write_snapshot).
ENTRY_FIELDS = ("created", "counters", "components", "associations", "files")
#: The files (relative to the index directory) each component kind saves per name, besides
#: the tensors: ``models/NAME.safetensors`` and ``models/NAME.spec.json``, and so on.
COMPONENT_SUFFIXES = {
    "models": (".safetensors", ".spec.json"),
    "optimizers": (".safetensors", ".json"),
    "schedulers": (".safetensors", ".json"),
}


def component_files(kind: str, name: str) -> tuple[str, ...]:
    """The relpaths an index holds for component ``name`` of ``kind`` (none for a kind
    fastckpt does not write)."""
    return tuple(f"{kind}/{name}{suffix}" for suffix in COMPONENT_SUFFIXES.get(kind, ()))


# --------------------------------------------------------------------------- JSON


def json_bytes(document: Any) -> bytes:
    """Canonical JSON encoding of a checkpoint document (NaN refused: it is not JSON)."""
    return json.dumps(document, indent=1, allow_nan=False).encode()


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """The object of ``pairs``, refusing a key given twice (the first one repeated is named).
    Built by ``dict`` at once: this runs for every object of every document read."""
    document = dict(pairs)
    if len(document) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise CheckpointFormatError(f"duplicate key {key!r}")
            seen.add(key)
    return document


def _no_constant(name: str) -> Any:
    raise CheckpointFormatError(
        f"holds {name}, which is not JSON (fastckpt writes non-finite floats as markers)"
    )


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise CheckpointFormatError(f"holds the number {text[:40]}, which no float can hold")
    return value


#: The deepest nesting of lists and objects a checkpoint JSON document may hold: readers
#: walk documents recursively, and a document edited to nest far deeper would exhaust
#: Python's stack (a bare ``RecursionError``) instead of failing as a format error.
MAX_JSON_DEPTH = 200


#: The types of JSON's scalars: what :func:`nesting_depth` does not look into.
_SCALARS = frozenset({str, int, float, bool, type(None)})


def nesting_depth(value: Any, limit: int = MAX_JSON_DEPTH) -> int:
    """How deep lists, tuples and mappings nest in ``value`` (a scalar: 0), counted up to
    ``limit + 1`` (then the walk stops), without recursion.

    Walked one level at a time, keeping only the containers of the next level: every
    document fastckpt reads is walked once (a manifest of 1000 indices holds some 50,000
    values, most of them scalars), so each scalar costs one type lookup, no more.
    """
    depth = 0
    level = [value]
    while level:
        below: list[Any] = []
        containers = False
        for item in level:
            if isinstance(item, (dict, Mapping)):  # dict first: no abstract-class check
                below.extend(item.values())
            elif isinstance(item, (list, tuple)):
                below.extend(item)
            else:
                continue
            containers = True
        if not containers:
            break
        depth += 1
        if depth > limit:
            break
        # Each container once per level: a container shared or nested in itself (a cycle)
        # would otherwise multiply the next level (the depth is the longest path either way).
        level = list({id(item): item for item in below if type(item) not in _SCALARS}.values())
    return depth


def load_json(path: str | os.PathLike[str], raw: bytes) -> Any:
    """Parse a checkpoint JSON document: invalid UTF-8/JSON, absurd nesting or numbers,
    ``NaN``/``Infinity`` (not JSON; fastckpt never writes them: a non-finite float is a
    marker), numbers beyond a float's range, and duplicate keys (which JSON parsers silently
    resolve) are all format errors naming the file."""
    shown = display_path(path)
    try:
        document = json.loads(
            raw,
            object_pairs_hook=_unique_keys,
            parse_constant=_no_constant,
            parse_float=_finite_float,
        )
    except CheckpointFormatError as err:
        raise CheckpointFormatError(f"{shown}: {err}") from None
    except (ValueError, RecursionError) as err:  # JSONDecodeError, UnicodeDecodeError, ...
        raise CheckpointFormatError(f"{shown}: not valid JSON ({err})") from None
    if nesting_depth(document) > MAX_JSON_DEPTH:
        raise CheckpointFormatError(
            f"{shown}: lists and objects nested more than {MAX_JSON_DEPTH} levels deep; "
            "fastckpt never writes such a document (it was edited or damaged): restore the "
            "checkpoint from a copy"
        )
    return document


def read_record_bytes(directory: str | os.PathLike[str], name: str) -> bytes:
    """The bytes of the record ``name`` of ``directory`` (``manifest.json``, ``commit.json``).

    Locally the record must be a regular file inside ``directory``, itself not a symlink: it
    is opened with ``O_NOFOLLOW | O_NONBLOCK`` and checked with ``fstat`` before any read, and
    read up to :data:`~fastckpt.storage.backend.MAX_RECORD_BYTES`, so a FIFO, a device, or a link
    (to ``/dev/zero``, out of the checkpoint) is a typed error naming the file, at once.

    Raises:
        FileNotFoundError: no record. IsADirectoryError: a directory in its place.
        NotADirectoryError: ``directory`` is a file, or lies below one (the message names
            the file and what reads it).
        PermissionError: this user may not read the record or search ``directory`` (the
            message names which, its owner and the fix).
        CheckpointFormatError: anything else that is not a small regular file.
    """
    backend = backend_for(directory)
    path = Path(directory) / name
    if not is_local(backend):
        return backend.read_bytes(path)
    try:
        fd = _native.open_regular(str(path), False)
    except NotADirectoryError as err:
        raise _not_a_folder(Path(directory), name) from err
    except PermissionError as err:
        # The record itself, or (when it cannot even be looked at) its folder.
        raise read_refused(path if os.path.lexists(path) else directory, err) from err
    shown = display_path(path)
    with os.fdopen(fd, "rb") as handle:
        size = os.fstat(fd).st_size
        if size > MAX_RECORD_BYTES:
            raise CheckpointFormatError(
                f"{shown}: {size} bytes, more than the {MAX_RECORD_BYTES} a record may have"
            )
        data = read_by_size(handle, size, MAX_RECORD_BYTES, path)
    if len(data) > MAX_RECORD_BYTES:
        raise CheckpointFormatError(
            f"{shown}: grew past the {MAX_RECORD_BYTES} bytes a record may have"
        )
    return data


def _not_a_folder(directory: Path, name: str) -> NotADirectoryError:
    """The error for a record ``name`` looked for in ``directory``, which is a file or lies
    below one (before: a bare ``Not a directory`` naming ``FILE/manifest.json``)."""
    file = next((p for p in (directory, *directory.parents) if p.is_file()), directory)
    what = (
        f"{file} is a file, not a checkpoint directory (which holds {name})"
        if file == directory
        else f"{file} is a file, so {directory} below it is no checkpoint directory"
    )
    return NotADirectoryError(
        errno.ENOTDIR,
        f"{what}: read a safetensors file with fastckpt.load_file(path) (or safetensors' "
        "safe_open), a .pt / .pth file with torch.load; fastckpt.verify(path) checks a "
        "safetensors file",
        str(file),
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


#: The fields every reference to a tensor stored elsewhere has (``refs.json`` of an incremental
#: index, the ``refs`` of an incremental manager checkpoint), with their types.
TENSOR_REFERENCE_FIELDS: dict[str, type] = {
    "file": str,
    "name": str,
    "crc32c": int,
    "nbytes": int,
    "dtype": str,
    "shape": list,
}


def tensor_reference(relpath: str, name: str, info: Mapping[str, Any]) -> dict[str, Any]:
    """The :data:`TENSOR_REFERENCE_FIELDS` of tensor ``name`` of file ``relpath``, from its
    header entry ``info`` (``dtype``, ``shape``, ``data_offsets``, ``crc32c``)."""
    begin, end = info["data_offsets"]
    return {
        "file": relpath,
        "name": name,
        "crc32c": info["crc32c"],
        "nbytes": end - begin,
        "dtype": info["dtype"],
        "shape": list(info["shape"]),
    }


def check_fields(record: Mapping[str, Any], fields: Mapping[str, type], where: str) -> None:
    """Check that ``record`` has every field of ``fields`` with its type (bools are not ints).

    Raises:
        CheckpointFormatError: names ``where``, the field, the expected type and the value.
    """
    for name, kind in fields.items():
        value = record.get(name)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise CheckpointFormatError(f"{where}.{name} must be {kind.__name__}, got {value!r}")


def _check_files(where: str, files: Any) -> dict[str, FileRecord]:
    """Check a ``files`` object: relpath -> ``{"size": int >= 0, "crc32c": 32-bit int}``."""
    if not isinstance(files, dict):
        raise CheckpointFormatError(f"{where}.files must be an object")
    for relpath, record in files.items():
        check_relpath(relpath, f"{where}.files entry")
        if not (
            isinstance(record, dict)
            and _is_int(record.get("size"))
            and _is_int(record.get("crc32c"))
            and record["size"] >= 0
            and 0 <= record["crc32c"] <= 0xFFFFFFFF
        ):
            raise CheckpointFormatError(
                f"{where}.files[{relpath!r}] needs int size >= 0 and a 32-bit crc32c"
            )
    return files


# --------------------------------------------------------------------------- the manifest


def _canonical(document: Mapping[str, Any]) -> bytes:
    """The bytes the manifest checksum covers: the document without the checksum field, in a
    canonical encoding (so indentation does not matter, every value does)."""
    body = {k: v for k, v in document.items() if k != MANIFEST_CRC_FIELD}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def _one_line_per_checkpoint(document: Mapping[str, Any]) -> bytes:
    """``document`` (a root manifest) as JSON with one line per field and per checkpoint.

    Each line is encoded by json's C encoder: an indented dump takes the pure-Python one, which
    made rewriting a manifest of 2000 checkpoints cost ~0.15 s at every save (round 21).
    """
    lines = []
    for key, value in document.items():
        if key == "checkpoints" and value:
            entries = ",\n".join(
                f"  {json.dumps(index)}: {json.dumps(entry, allow_nan=False)}"
                for index, entry in value.items()
            )
            lines.append(f" {json.dumps(key)}: {{\n{entries}\n }}")
        else:
            lines.append(f" {json.dumps(key)}: {json.dumps(value, allow_nan=False)}")
    return ("{\n" + ",\n".join(lines) + "\n}").encode()


def seal_manifest(document: dict[str, Any]) -> dict[str, Any]:
    """Set the ``crc32c`` field of a record document (``manifest.json``, ``commit.json``,
    ``fastckpt-dcp.json``) to the crc32c of its canonical content.

    Every record is sealed so when it is written; tools and tests that edit a record on
    purpose call it too. Returns ``document``.
    """
    document[MANIFEST_CRC_FIELD] = _native.crc32c(_canonical(document))
    return document


def check_seal(path: str | os.PathLike[str], document: Mapping[str, Any]) -> bool:
    """Check a record's own ``crc32c`` field against its canonical content.

    Returns:
        Whether the record is sealed (False: written by a fastckpt that did not seal it).

    Raises:
        CheckpointFormatError: the field is not an int.
        ChecksumMismatchError: the content differs from the field (names the file).
    """
    stored = document.get(MANIFEST_CRC_FIELD)
    if stored is None:
        return False
    shown = display_path(path)
    if not _is_int(stored):
        raise CheckpointFormatError(f"{shown}: field {MANIFEST_CRC_FIELD!r} must be an int")
    actual = _native.crc32c(_canonical(document))
    if actual != stored:
        raise ChecksumMismatchError(
            f"{shown}: content crc32c {actual:08x} differs from the recorded {stored:08x} "
            f"(field {MANIFEST_CRC_FIELD!r}); the record is corrupt or was edited: restore it "
            "from a copy, or save the checkpoint again"
        )
    return True


def other_kind(root: str | os.PathLike[str]) -> str | None:
    """What a folder holding no root manifest is instead, for messages: another kind of
    checkpoint (its record), or a folder of CheckpointManager checkpoints (local, its first
    names); None when neither (an empty or a new root)."""
    path = Path(root)
    backend = backend_for(path)
    if backend.exists(path / COMMIT_RECORD):
        return "a CheckpointManager checkpoint: load it with CheckpointManager().load(path)"
    if backend.exists(path / SHARDED_RECORD):
        return "a sharded checkpoint: load it with fastckpt.dcp.load_state(path) or dcp.load"
    if not is_local(backend) or not path.is_dir():
        return None
    with os.scandir(path) as entries:
        held = sorted(e.name for e in entries if os.path.lexists(path / e.name / COMMIT_RECORD))
    if not held:
        return None
    shown = ", ".join(held[:3]) + (", ..." if len(held) > 3 else "")
    return (
        f"a folder of {len(held)} CheckpointManager checkpoint(s) ({shown}): list and prune "
        "them with `fastckpt ls` / `fastckpt prune --keep-last N`, load one with "
        "CheckpointManager().load(path / name)"
    )


def refuse_other_kind(root: str | os.PathLike[str], call: str) -> None:
    """Raise when ``root``, which holds no root manifest, is another kind of checkpoint or a
    folder of them (:func:`other_kind`): ``call`` works on ``save_checkpoint`` roots and
    would find nothing there.

    Raises:
        FileNotFoundError: names the folder, what it is, and the call to use instead.
    """
    kind = other_kind(root)
    if kind is not None:
        raise FileNotFoundError(
            errno.ENOENT,
            f"{display_path(root)}: no {MANIFEST} (not a save_checkpoint root, which {call} "
            f"reads); it is {kind}",
            display_path(root),
        )


def _index_folder_hint(root: Path) -> str:
    """What a folder holding no committed checkpoint is, when it is an index folder, for the
    message of :meth:`Manifest.resolve` ("" when it is none): ``ROOT/2``, an index of the root
    beside it, loaded as ``load_checkpoint(ROOT, 2)``; or a folder named like an index that
    holds a component's folder (``models/``...), or a folder holding such folders, copied
    without its root: an index's records are in its root's manifest, so it cannot be loaded
    alone. Before, both said only "no committed checkpoint here"."""
    backend = backend_for(root)
    shown = display_path(root)
    if is_ascii_decimal(root.name) and backend.exists(root.parent / MANIFEST):
        index, parent = int(root.name), display_path(root.parent)
        try:
            named = index in Manifest.load(root.parent).entries
        except (CheckpointFormatError, OSError):
            named = True  # a load of the root says what is wrong with its manifest
        if not named:
            return (
                f"{shown} is a folder named like index {index} of the save_checkpoint root "
                f"{parent}, whose {MANIFEST} does not name it (never committed, or pruned)"
            )
        return (
            f"{shown} is index {index} of the save_checkpoint root {parent}: load it with "
            f"load_checkpoint({parent!r}, {index})"
        )
    if not is_local(backend):
        return ""

    def copied_index(folder: Path) -> bool:
        return is_ascii_decimal(folder.name) and any(
            (folder / kind).is_dir() for kind in COMPONENT_SUFFIXES
        )

    try:
        copied = [root] if copied_index(root) else sorted(filter(copied_index, root.iterdir()))
    except OSError:  # not a folder, or one this user may not list
        return ""
    if not copied:
        return ""
    what = (
        f"{shown} is an index folder"
        if copied == [root]
        else f"{shown} holds index folder(s) ({', '.join(f.name for f in copied)})"
    )
    return (
        f"{what} of a save_checkpoint root, copied without its root: an index's records (its "
        f"files' sizes and checksums, counters, components) are in the root's {MANIFEST}, "
        f"and no index loads without them. Copy the whole root (or its {MANIFEST} with it), "
        "or write a stand-alone weights file from the root with `fastckpt export ROOT --index "
        "N --to FILE`"
    )


@dataclass
class Manifest:
    """The commit record of a checkpoint root.

    The serialized manifest carries a ``crc32c`` of its own canonical content, so damage to
    the fields no other check covers (counters, associations, timestamps) is detectable:
    :meth:`load` with ``verify_checksum=True`` (what :func:`fastckpt.container.verify.verify` uses)
    refuses a manifest whose checksum does not match.

    Attributes:
        root: the checkpoint root directory.
        entries: index -> entry (``created``, ``counters``, ``components``, ``files``...).
        stored_crc32c: the checksum read from disk (None: absent, or not loaded from disk).
        actual_crc32c: the checksum of what was read (None when not loaded from disk).
        size: bytes read from disk (None when not loaded from disk).
    """

    root: Path
    entries: dict[int, dict[str, Any]] = field(default_factory=dict)
    stored_crc32c: int | None = None
    actual_crc32c: int | None = None
    size: int | None = None

    @property
    def path(self) -> Path:
        """``ROOT/manifest.json``."""
        return self.root / MANIFEST

    @property
    def latest(self) -> int | None:
        """The newest committed index, or None for an empty root."""
        return max(self.entries) if self.entries else None

    @property
    def backend(self) -> StorageBackend:
        """Where the root lives."""
        return backend_for(self.root)

    @classmethod
    def load(cls, root: str | os.PathLike[str], *, verify_checksum: bool = False) -> Manifest:
        """Read and validate ``ROOT/manifest.json``; an absent manifest is an empty root.

        Args:
            root: the checkpoint root.
            verify_checksum: also require the manifest's own crc32c to match its content
                (manifests written before the checksum existed have none and pass).

        Raises:
            CheckpointFormatError: malformed JSON, unknown schema, invalid names or fields.
            ChecksumMismatchError: ``verify_checksum`` and the content does not match.
        """
        root = Path(root)
        path = root / MANIFEST
        shown = display_path(path)
        try:
            raw = read_record_bytes(root, MANIFEST)
        except FileNotFoundError:
            return cls(root)
        except IsADirectoryError:
            raise CheckpointFormatError(f"{shown}: is a directory, not a manifest") from None
        return cls.parse(root, path, raw, verify_checksum=verify_checksum)

    @classmethod
    def parse(
        cls, root: Path, path: Path, raw: bytes, *, verify_checksum: bool = False
    ) -> Manifest:
        """The manifest of ``root`` whose bytes ``raw`` were read from ``path`` (its own file,
        or a copy of it); validated as :meth:`load` validates.

        Raises:
            what :meth:`load` raises.
        """
        shown = display_path(path)
        data = load_json(path, raw)
        entries = _parse_entries(path, data)
        stored = data.get(MANIFEST_CRC_FIELD)
        if stored is not None and not _is_int(stored):
            raise CheckpointFormatError(f"{shown}: field {MANIFEST_CRC_FIELD!r} must be an int")
        actual = _native.crc32c(_canonical(data))
        manifest = cls(root, entries, stored, actual, len(raw))
        if verify_checksum:
            unknown = sorted(set(data) - _MANIFEST_FIELDS)
            if unknown:
                raise unexpected_fields(shown, unknown)
            if stored is not None and stored != actual:
                raise ChecksumMismatchError(
                    f"{shown}: content crc32c {actual:08x} differs from the recorded "
                    f"{stored:08x} (field {MANIFEST_CRC_FIELD!r}); the manifest is corrupt or "
                    "was edited: restore it from a copy"
                )
        return manifest

    def to_json(self) -> bytes:
        """Serialized manifest (with its own checksum)."""
        applied = any(entry.get(f) for entry in self.entries.values() for f in APPLIED_ENTRY_FIELDS)
        document: dict[str, Any] = {
            "format": "fastckpt",
            "schema_version": 2 if applied else 1,
            "latest": self.latest,
            "checkpoints": {str(i): self.entries[i] for i in sorted(self.entries)},
        }
        return _one_line_per_checkpoint(seal_manifest(document))

    def commit(self) -> None:
        """Replace ``manifest.json`` atomically and durably.

        Raises:
            ChecksumMismatchError: this manifest was read from a ``manifest.json`` whose
                content did not match its own crc32c: writing it back would seal the damage
                (an edited counter or file record) as if fastckpt had written it.
        """
        self.refuse_if_damaged()
        self.backend.put_record(self.path, self.to_json())

    def commit_anew(self) -> None:
        """Put the manifest again in bytes other than the stored ones (the same document,
        a trailing newline toggled): an object store's conditional put still in flight,
        conditioned on the stored version (its etag, a digest of the bytes), can then no
        longer land. Raises what :meth:`commit` raises."""
        self.refuse_if_damaged()
        data = self.to_json()
        if self.size is not None and len(data) != self.size:
            self.backend.put_record(self.path, data)  # the stored bytes had the newline
        else:
            self.backend.put_record(self.path, data + b"\n")

    def refuse_if_damaged(self) -> None:
        """Refuse to act on a manifest read from a file whose content did not match its own
        crc32c (what :meth:`commit` checks; call it before changing anything else).

        Raises:
            ChecksumMismatchError: names the manifest and the fix.
        """
        if self.stored_crc32c is not None and self.stored_crc32c != self.actual_crc32c:
            raise ChecksumMismatchError(
                f"{display_path(self.path)}: content crc32c {self.actual_crc32c:08x} differs "
                f"from the recorded {self.stored_crc32c:08x} (field {MANIFEST_CRC_FIELD!r}); "
                "the manifest is corrupt or was edited, and is not rewritten (that would seal "
                "the damage): restore it from a copy (another tier's), or save into a new root"
            )

    def directory(self, index: int) -> Path:
        """``ROOT/<index>``."""
        return self.root / str(index)

    def file_path(self, index: int, relpath: str) -> Path:
        """Where file ``relpath`` of ``index`` is, checked to stay inside the root."""
        return safe_join(self.directory(index), relpath, within=self.root)

    def resolve(self, index: int) -> int:
        """Map ``-1`` to the latest index and check that ``index`` is committed.

        Raises:
            FileNotFoundError: the root has no committed checkpoint (names what the folder is
                instead: another kind of checkpoint, an index folder of a root, one copied
                without its root).
            IndexNotCommittedError: ``index`` is not committed (a ``KeyError``; lists the
                available ones).
        """
        shown_path = display_path(self.path)
        if not self.entries:
            refuse_other_kind(self.root, "this call")
            hint = _index_folder_hint(self.root)
            raise FileNotFoundError(
                f"{shown_path}: no committed checkpoint here" + (f"; {hint}" if hint else "")
            )
        if index == -1:
            return self.latest  # type: ignore[return-value]
        if index not in self.entries:
            raise IndexNotCommittedError(
                f"checkpoint index {index} is not in {shown_path} (never saved, or pruned); "
                f"available: {sorted(self.entries)}"
            )
        return index


def unexpected_fields(where: str, unknown: list[str]) -> CheckpointFormatError:
    """The error for a record holding fields this fastckpt does not know (``unknown``,
    sorted): a newer fastckpt wrote them (a rolled-back install, another node), or the record
    was edited; the message says both and the fix, never "damaged" alone."""
    return CheckpointFormatError(
        f"{where}: unexpected field(s) {unknown}: written by a newer fastckpt (upgrade fastckpt "
        "to read it), or the record was edited or damaged (restore it from a copy)"
    )


def check_schema_version(version: Any, newest: int, where: str) -> None:
    """Refuse a record's ``schema_version`` this fastckpt cannot read: missing or not an int,
    below 1, or above ``newest`` (written by a newer fastckpt: the message says to upgrade).

    Raises:
        CheckpointFormatError: naming ``where``.
    """
    if not isinstance(version, int) or isinstance(version, bool):
        raise CheckpointFormatError(f"{where}: field 'schema_version' missing or not an int")
    if version > newest:
        raise CheckpointFormatError(
            f"{where}: schema_version {version} was written by a newer fastckpt (this one reads "
            f"up to {newest}); upgrade fastckpt to load it"
        )
    if version < 1:
        raise CheckpointFormatError(f"{where}: schema_version {version} does not exist")


def _parse_entries(path: Path, data: Any) -> dict[int, dict[str, Any]]:
    shown = display_path(path)
    if not isinstance(data, dict):
        raise CheckpointFormatError(f"{shown}: manifest must be a JSON object")
    check_schema_version(data.get("schema_version"), SCHEMA_VERSION, shown)
    if data.get("format", "fastckpt") != "fastckpt":
        raise CheckpointFormatError(f"{shown}: field 'format' must be \"fastckpt\"")
    checkpoints = data.get("checkpoints")
    if not isinstance(checkpoints, dict):
        raise CheckpointFormatError(f"{shown}: field 'checkpoints' must be an object")
    entries: dict[int, dict[str, Any]] = {}
    for key, entry in checkpoints.items():
        if not (is_ascii_decimal(key) and len(key) <= len(str(MAX_INDEX)) and str(int(key)) == key):
            raise CheckpointFormatError(
                f"{shown}: checkpoint index {key!r} is not an integer from 0 to {MAX_INDEX}"
            )
        where = f"{shown}: checkpoints.{key}"
        if not isinstance(entry, dict):
            raise CheckpointFormatError(f"{where}.files must be an object")
        _check_files(where, entry.get("files"))
        _check_entry_fields(where, entry)
        entries[int(key)] = entry
    latest = data.get("latest", max(entries, default=None))
    if latest != max(entries, default=None) or isinstance(latest, bool):
        raise CheckpointFormatError(
            f"{shown}: field 'latest' ({latest!r}) is not the newest committed index "
            f"({max(entries, default=None)!r})"
        )
    return entries


def _check_entry_fields(where: str, entry: dict[str, Any]) -> None:
    """Check the entry fields loaders rely on, types and cross-references, so that a damaged
    or hostile manifest fails here with a typed error instead of deep inside a loader, or,
    worse, loading less than was saved (a renamed ``associations`` key would silently drop
    optimizers)."""
    missing = [name for name in ENTRY_FIELDS if name not in entry]
    if missing:
        raise CheckpointFormatError(f"{where}: missing field(s) {missing}")
    if not isinstance(entry["created"], str):
        raise CheckpointFormatError(f"{where}.created must be a string")
    if not isinstance(entry["counters"], dict):
        raise CheckpointFormatError(f"{where}.counters must be an object")
    components = entry["components"]
    if not isinstance(components, dict):
        raise CheckpointFormatError(f"{where}.components must be an object")
    names: dict[str, set[str]] = {}
    for kind, listed in components.items():
        if not isinstance(listed, list):
            raise CheckpointFormatError(f"{where}.components.{kind} must be a list of names")
        names[kind] = {check_name(name, f"{where}.components.{kind} entry") for name in listed}
        if len(names[kind]) != len(listed):
            raise CheckpointFormatError(f"{where}.components.{kind} lists a name twice")
        for name in listed:
            missing = [f for f in component_files(kind, name) if f not in entry["files"]]
            if missing:
                # verify would otherwise pass an index no loader can read (and retention
                # would keep it as the newest intact one, deleting older loadable ones)
                raise CheckpointFormatError(
                    f"{where}.components.{kind} lists {name!r}, but its file(s) {missing} "
                    f"are not in {where}.files: the manifest was edited or the index is "
                    "incomplete; load an older index (checkpoint_index=...) or restore the "
                    "manifest"
                )
    frozen = entry.get(FROZEN_FIELD, {})  # model -> frozen parameter names
    if not isinstance(frozen, dict) or not set(frozen) <= names.get("models", set()):
        raise CheckpointFormatError(
            f"{where}.frozen must be an object keyed by names of components.models"
        )
    for per_model in (STRIDES_FIELD, MODES_FIELD):  # layouts / training modes
        value = entry.get(per_model, {})
        if not isinstance(value, dict) or not set(value) <= names.get("models", set()):
            raise CheckpointFormatError(
                f"{where}.{per_model} must be an object keyed by names of components.models"
            )
    associations = entry["associations"]
    if not isinstance(associations, dict):
        raise CheckpointFormatError(f"{where}.associations must be an object")
    # optimizer -> its model (or null), scheduler -> its optimizer
    for kind, target_kind in (("optimizers", "models"), ("schedulers", "optimizers")):
        mapping = associations.get(kind, {})
        if not isinstance(mapping, dict):
            raise CheckpointFormatError(f"{where}.associations.{kind} must be an object")
        if set(mapping) != names.get(kind, set()):
            raise CheckpointFormatError(
                f"{where}.associations.{kind} names {sorted(mapping)} but components.{kind} "
                f"lists {sorted(names.get(kind, set()))}"
            )
        for name, target in mapping.items():
            allowed_none = kind == "optimizers"
            if not (
                (target is None and allowed_none)
                or (isinstance(target, str) and target in names.get(target_kind, set()))
            ):
                raise CheckpointFormatError(
                    f"{where}.associations.{kind}.{name} = {target!r} is not one of "
                    f"components.{target_kind}"
                )


# --------------------------------------------------------------------------- commit.json


#: The commit-record field that says when the save that made the checkpoint built its commit
#: record (nanoseconds since the epoch, the saving host's clock); a promotion carries it to
#: the copy, so a checkpoint dates the same on every tier (:func:`saved_seconds`).
SAVED_NS = "saved_ns"
#: :func:`commit_record`'s ``saved_ns`` default: now.
SAVED_NOW = -1

#: Every top-level field a ``commit.json`` may have.
_COMMIT_FIELDS = frozenset(
    {
        "format",
        "schema_version",
        "world_size",
        "items",
        "files",
        MANAGER_REFS,
        "generation",
        SAVED_NS,
        MANIFEST_CRC_FIELD,
    }
)


def commit_record(
    items: list[str],
    files: Mapping[str, Mapping[str, int]],
    world_size: int,
    refs: Mapping[str, Mapping[str, Mapping[str, Any]]] | None = None,
    *,
    saved_ns: int | None = SAVED_NOW,
) -> dict[str, Any]:
    """The ``commit.json`` document of a CheckpointManager checkpoint (``refs``: the
    references of an incremental one, relpath -> tensor name -> reference; ``saved_ns``:
    when it was saved, see :data:`SAVED_NS`: now by default, a promotion passes the source's,
    None where the source has none). Unsealed: the writer seals it (:func:`seal_manifest`)
    once every field is set."""
    record: dict[str, Any] = {
        "format": MANAGER_FORMAT,
        "schema_version": MANAGER_SCHEMA_VERSION if refs else 1,
        "world_size": world_size,
        "items": items,
        "files": {relpath: dict(record) for relpath, record in files.items()},
    }
    if refs:
        record[MANAGER_REFS] = {
            relpath: {name: dict(ref) for name, ref in names.items()}
            for relpath, names in refs.items()
        }
    if saved_ns == SAVED_NOW:
        saved_ns = now_ns()
    if saved_ns is not None:
        record[SAVED_NS] = saved_ns
    return record


def now_ns() -> int:
    """The clock of fastckpt's records: the wall clock in ns since the epoch (what
    :data:`SAVED_NS` holds when a save dates itself)."""
    return time.time_ns()


def new_generation() -> str:
    """A fresh generation name (see :data:`GENERATION_PREFIX`): later calls sort after
    earlier ones (to the millisecond), two calls never give the same name."""
    return f"{GENERATION_PREFIX}{time.time_ns() // 1_000_000:013d}-{os.urandom(8).hex()}"


def _is_hex(text: str, lengths: tuple[int, ...]) -> bool:
    return len(text) in lengths and all(c in "0123456789abcdef" for c in text)


def generation_order(name: str) -> tuple[int, str] | None:
    """Sort key of the generation ``name`` (creation time first), None when ``name`` is not
    a generation. Names written by earlier fastckpt versions are generations too:
    ``g-<32 hex>`` (CheckpointManager on object stores; no time, so older than any other)
    and ``g<13 digits>-<8 hex>`` (sharded checkpoints)."""
    if name.startswith(GENERATION_PREFIX):
        millis, _, tail = name[len(GENERATION_PREFIX) :].partition("-")
        if len(millis) == 13 and is_ascii_decimal(millis) and _is_hex(tail, (16,)):
            return int(millis), name
        if not tail and _is_hex(millis, (32,)):
            return 0, name
        return None
    millis, _, tail = name[1:].partition("-")
    if (
        name.startswith("g")
        and len(millis) == 13
        and is_ascii_decimal(millis)
        and _is_hex(tail, (8,))
    ):
        return int(millis), name
    return None


def save_dated(
    root: str | os.PathLike[str], found: Mapping[str, tuple[float, str]]
) -> tuple[dict[str, tuple[float, str]], list[str], list[str]]:
    """The checkpoints ``found`` in ``root`` (name -> (when the store dates its commit record;
    the record's file name)) dated by when each was saved where its record says
    (:func:`saved_seconds`, one read of each record); the names whose record does not (an
    earlier version's); and those whose record cannot be read (damaged). Both keep the
    store's date."""
    dated: dict[str, tuple[float, str]] = {}
    undated: list[str] = []
    unreadable: list[str] = []
    for name, (stored, record) in found.items():
        saved, readable = _save_time(Path(root) / name, record)
        if saved is None:
            (undated if readable else unreadable).append(name)
        dated[name] = (stored if saved is None else saved, record)
    return dated, undated, unreadable


def by_commit_time(
    root: str | os.PathLike[str], found: Mapping[str, tuple[float, str]]
) -> list[str]:
    """The checkpoints ``found`` in ``root`` (name -> (its date: when it was saved, see
    :func:`save_dated`, or when the store dated its commit record; the record's file name)),
    oldest first. Where two date alike (S3 dates objects to the second), they go by the
    generations their records name (to the millisecond, see :func:`generation_order`), then by
    name."""
    ties: dict[float, int] = {}
    for modified, _ in found.values():
        ties[modified] = ties.get(modified, 0) + 1

    def order(name: str) -> tuple[float, int, str]:
        modified, record = found[name]
        if ties[modified] < 2:
            return modified, 0, name
        return modified, _generation_millis(Path(root) / name, record), name

    return sorted(found, key=order)


def _generation_millis(directory: Path, record: str) -> int:
    """When the commit record ``directory/record`` was made, in milliseconds, from the
    generation it names; 0 (older than any other) for a record that names none (a local
    one, or one of an earlier fastckpt version) or cannot be read."""
    return _named_millis(directory, record) or 0


def _named_millis(directory: Path, record: str) -> int | None:
    """:func:`_generation_millis`, but None for a record that cannot be read."""
    try:
        generation = json.loads(read_record_bytes(directory, record)).get("generation")
    except (OSError, ValueError, AttributeError, CheckpointFormatError):
        return None
    found = generation_order(generation) if isinstance(generation, str) else None
    return 0 if found is None else found[0]


def record_file(record: Mapping[str, Any], name: str) -> str:
    """The relpath under which a commit record lists its file ``name`` (prefixed by the
    record's generation on object stores, see :data:`GENERATION_PREFIX`)."""
    generation = record.get("generation")
    return f"{generation}/{name}" if isinstance(generation, str) else name


def read_commit_record(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and validate ``CKPT/commit.json`` of a CheckpointManager checkpoint.

    Returns:
        The record: ``format``, ``schema_version``, ``world_size``, ``items`` (checked names),
        ``files`` (relpath -> ``{"size", "crc32c"}``, checked).

    Raises:
        FileNotFoundError: no commit record (not a committed checkpoint).
        CheckpointFormatError: malformed record (names the file and the field).
    """
    directory = Path(directory)
    path = safe_join(directory, COMMIT_RECORD)
    shown = display_path(path)
    shown_directory = display_path(directory)
    try:
        data = read_record_bytes(directory, COMMIT_RECORD)
    except FileNotFoundError:
        raise FileNotFoundError(
            errno.ENOENT,
            f"{shown_directory} is not a committed fastckpt checkpoint (no {COMMIT_RECORD})",
            shown,
        ) from None
    except IsADirectoryError:
        raise CheckpointFormatError(f"{shown}: is a directory, not a commit record") from None
    record = load_json(path, data)
    if not isinstance(record, dict) or record.get("format") != MANAGER_FORMAT:
        raise CheckpointFormatError(f"{shown}: not a {MANAGER_FORMAT} commit record")
    # A flipped bit anywhere (a field name included) is caught: unknown fields are refused,
    # and the record's own crc32c covers every value (records of earlier versions have none).
    unknown = sorted(set(record) - _COMMIT_FIELDS)
    if unknown:
        raise unexpected_fields(shown, unknown)
    check_seal(path, record)
    # Checked as the manifest's is (_parse_entries): an int (not a bool), from 1 up to the
    # newest this fastckpt writes.
    version = record.get("schema_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise CheckpointFormatError(f"{shown}: field 'schema_version' missing or not an int")
    if version > MANAGER_SCHEMA_VERSION:
        raise CheckpointFormatError(
            f"{shown}: schema_version {version!r} is unknown to this fastckpt; upgrade it"
        )
    if version < 1:
        raise CheckpointFormatError(f"{shown}: schema_version {version} does not exist")
    items = record.get("items")
    if not isinstance(items, list) or not isinstance(record.get("files"), dict):
        raise CheckpointFormatError(f"{shown}: 'items' and 'files' are required")
    for key in items:
        check_name(key, f"{shown}: item")
    _check_files(str(path), record["files"])
    world_size = record.get("world_size", 1)
    if not isinstance(world_size, int) or world_size < 1:
        raise CheckpointFormatError(f"{shown}: field 'world_size' must be an int >= 1")
    generation = record.get("generation")
    if generation is not None and not (
        isinstance(generation, str) and generation.startswith(GENERATION_PREFIX)
    ):
        raise CheckpointFormatError(
            f"{shown}: field 'generation' must be a string starting with {GENERATION_PREFIX!r}"
        )
    if generation is not None:
        check_name(generation, f"{shown}: generation")
    saved = record.get(SAVED_NS)
    if saved is not None and (type(saved) is not int or saved < 0):
        raise CheckpointFormatError(f"{shown}: field {SAVED_NS!r} must be an int >= 0")
    return record


def saved_seconds(directory: str | os.PathLike[str], record: str) -> float | None:
    """When the checkpoint ``directory`` (whose commit record is the file ``record``) was
    saved, in seconds since the epoch: its CheckpointManager record's :data:`SAVED_NS`, or
    the time in the generation its sharded record names (to the millisecond); the same on
    every tier it was promoted to. None for a record of an earlier version, one that names
    neither, or one that cannot be read (damaged: verification says so)."""
    return _save_time(Path(directory), record)[0]


def _save_time(directory: Path, record: str) -> tuple[float | None, bool]:
    """:func:`saved_seconds`, and whether the record could be read at all."""
    if record == COMMIT_RECORD:
        try:
            saved = read_commit_record(directory).get(SAVED_NS)
        except (OSError, ValueError, AttributeError, CheckpointFormatError):
            return None, False
        return (None if saved is None else saved / 1e9), True
    millis = _named_millis(directory, record)
    return (None if not millis else millis / 1e3), millis is not None


def check_item_key(key: object) -> str:
    """A CheckpointManager state key that can name an item's files (see :func:`item_files`).

    Raises:
        CheckpointFormatError: not a plain name (see :func:`~fastckpt.io.paths.check_name`),
            not encodable as UTF-8 (a lone surrogate), or a name whose files would be another
            item's or a record's: ``<key>.json`` is ``commit.json``, ``fastckpt-dcp.json`` or
            ``manifest.json`` (a root's), or ``<key>`` ends in ``.rank<N>`` (the per-rank
            files of item ``<key minus it>``).
    """
    name = check_name_length(check_name(key, "state key"), "state key")
    if not is_text(name):
        raise CheckpointFormatError(
            f"state key {name!r} cannot be stored: it is not valid Unicode text (a lone "
            "surrogate); use a key made of characters"
        )
    if f"{name}.json" in (COMMIT_RECORD, SHARDED_RECORD, MANIFEST):
        raise CheckpointFormatError(
            f"state key {name!r} is reserved: its file {name}.json would be the checkpoint's "
            "own record; rename the item"
        )
    stem, dot, rank = name.rpartition(".rank")
    if dot and stem and is_ascii_decimal(rank):
        raise CheckpointFormatError(
            f"state key {name!r} is reserved: its file would be rank {rank}'s file of item "
            f"{stem!r}; rename the item"
        )
    return name


def item_files(record: Mapping[str, Any], key: str, rank: int = 0) -> tuple[str, str]:
    """``(skeleton JSON, tensor file)`` relpaths of item ``key`` for ``rank``.

    An item is ``<key>.json`` plus ``<key>.safetensors``; saved under a process group, each
    rank has its ``<key>.rank<r>.safetensors``, and ranks other than 0 their
    ``<key>.rank<r>.json`` (checkpoints of earlier versions have rank 0's only: the others
    read it). A rank without its own tensor file reads rank 0's.
    """
    files = record["files"]
    skeleton = record_file(record, f"{key}.json")
    if rank:
        own = record_file(record, f"{key}.rank{rank}.json")
        skeleton = own if own in files else skeleton
    for name in (f"{key}.rank{rank}.safetensors", f"{key}.rank0.safetensors"):
        tensors = record_file(record, name)
        if tensors in files:
            return skeleton, tensors
    return skeleton, record_file(record, f"{key}.safetensors")
