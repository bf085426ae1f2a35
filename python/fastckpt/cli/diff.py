"""``fastckpt diff A B``: which tensors differ between two checkpoints."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fastckpt.checkpoint.components import FROZEN_FIELD, MODES_FIELD, STRIDES_FIELD
from fastckpt.cli.common import (
    EXIT_BAD,
    EXIT_OK,
    TENSOR_SUFFIX,
    UserError,
    locate,
    resolve_index,
)
from fastckpt.cli.render import (
    counted_progress,
    print_json,
    shape_text,
    table,
)
from fastckpt.cli.text import printable
from fastckpt.container.diff import TensorFiles, diff_checkpoints
from fastckpt.container.kinds import (
    IndexContainer,
    KindVisitor,
    ManagerContainer,
    RootContainer,
    SavedContainer,
    ShardedContainer,
    TensorFile,
)
from fastckpt.container.links import is_linked_file, referenced_sources
from fastckpt.container.reader import read_json
from fastckpt.container.refs import REFS_FILE, index_references, source_path
from fastckpt.errors import CheckpointFormatError
from fastckpt.format.records import COMMIT_RECORD, read_commit_record, record_file
from fastckpt.io.paths import safe_join
from fastckpt.io.progress import counting
from fastckpt.io.tree import decode_float, decode_key
from fastckpt.storage.registry import backend_for, display_path

# --------------------------------------------------------------------------- fastckpt diff


@dataclasses.dataclass
class _Side:
    """One side of ``fastckpt diff``: its tensor files and its plain values (flattened)."""

    tensors: TensorFiles
    values: dict[str, Any]
    metadata: dict[str, str]
    #: A lone safetensors file: it holds no plain values or structure to compare.
    lone: bool = False


#: Recording times: they differ between any two saves and say nothing about the state.
_NOT_COMPARED = frozenset({"timestamp", "created"})


#: The markers of fastckpt's JSON encodings (fastckpt.io.tree, fastckpt.checkpoint.specs): a
#: tensor's
#: place (its bytes are compared as tensors), a tuple, a dict with non-string keys, a nested
#: spec, a non-finite float.
_TENSOR, _TUPLE, _DICT, _SPEC, _FLOAT = (
    "__tensor__",
    "__tuple__",
    "__dict__",
    "__spec__",
    "__float__",
)
#: The wrapper field of a CheckpointManager item's document: its values are the item's own.
_SKELETON = "skeleton"


def _flatten_values(prefix: str, value: Any, out: dict[str, Any]) -> None:
    """``{"a.b.0": leaf}`` for the plain values of a JSON document, at the key paths of the
    state the user saved: fastckpt's encodings are read back (a tuple is its items and a
    mark that it is one, a dict key that is no string is shown as ``[key]``, a nested spec is
    its fields, a non-finite float a float) and tensor places are left out (tensors are
    compared as tensors); what loads as different values differs here too."""

    def join(key: Any) -> str:
        if isinstance(key, str) and ("." in key or key.startswith("[")):
            return f"{prefix}[{key!r}]"  # "a.b" is not a's b
        return f"{prefix}.{key}" if prefix else str(key)

    if isinstance(value, Mapping) and len(value) == 1 and next(iter(value)) in _MARKERS:
        ((marker, inner),) = value.items()
        if marker == _TENSOR:
            out[prefix] = TENSOR_MARK  # its place: the bytes are compared as tensors
            return
        if marker == _FLOAT:  # decoded as loads decode it: a bad marker is refused
            out[prefix] = decode_float(value, _value_name(prefix))
            return
        if marker == _DICT and isinstance(inner, Mapping):  # a spec's dict of marker-like keys
            for key, sub in inner.items():  # its keys are the dict's own, never markers
                _flatten_values(join(key), sub, out)
            return
        if marker == _DICT and isinstance(inner, list):
            for pair in inner:
                if not (isinstance(pair, list) and len(pair) == 2):
                    raise CheckpointFormatError(f"{_value_name(prefix)}: bad dict entry {pair!r}")
                key = decode_key(pair[0], _value_name(prefix))  # a float marker: its float
                path = join(key) if isinstance(key, str) else f"{prefix}[{key!r}]"
                _flatten_values(path, pair[1], out)
            return
        if marker == _TUPLE and isinstance(inner, list):
            out[prefix] = TUPLE_MARK
            for i, sub in enumerate(inner):
                _flatten_values(join(i), sub, out)
            return
        _flatten_values(prefix, inner, out)  # a spec
        return
    if isinstance(value, Mapping) and value:
        for key, sub in value.items():
            if key in _NOT_COMPARED:
                continue
            _flatten_values(join(key), sub, out)
    elif isinstance(value, list) and value:
        out[prefix] = LIST_MARK  # a list is not a tuple, nor a dict keyed "0", "1", ...
        for i, sub in enumerate(value):
            _flatten_values(join(i), sub, out)
    else:
        out[prefix] = value


_MARKERS = frozenset({_TENSOR, _TUPLE, _DICT, _SPEC, _FLOAT})

#: The values :func:`_flatten_values` records at a tuple's, a list's and a tensor's path:
#: the structure of what loads is compared too, not only the leaves.
TUPLE_MARK = "(tuple)"
LIST_MARK = "(list)"
TENSOR_MARK = "(tensor)"
_STRUCTURE = frozenset({TUPLE_MARK, LIST_MARK, TENSOR_MARK})


def _same(a: Any, b: Any) -> bool:
    """Whether two plain values load as the same value: equal and of one type (``True``,
    ``1`` and ``1.0`` differ), NaN equal to NaN."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    if isinstance(a, float) and a == 0.0 == b:
        return math.copysign(1.0, a) == math.copysign(1.0, b)  # -0.0 loads as -0.0
    return bool(a == b)


def _value_name(prefix: str) -> str:
    """The name a value row shows for a :func:`_flatten_values` path (``d:.a`` -> ``d:a``,
    a document's root ``d:`` -> ``d``)."""
    return prefix.replace(":.", ":").removesuffix(":")


def _header(path: Path) -> dict[str, Any]:
    return backend_for(path).read_header(path)


def _json_values(
    directory: Path,
    records: Mapping[str, Mapping[str, int]],
    within: Path,
    source: Path,
    generation: str = "",
) -> dict[str, Any]:
    """The plain values of the JSON files among ``records`` (``{relpath: {"size",
    "crc32c"}}``, as ``source`` records them), each file checked against its record first
    as loads check it: damage is a ``ChecksumMismatchError`` naming the file, never a
    changed value. A value that cannot load (a malformed ``__dict__`` entry) is the loads'
    ``CheckpointFormatError``, naming the file."""
    values: dict[str, Any] = {}
    for relpath in sorted(records):
        if relpath.endswith(".json") and relpath != COMMIT_RECORD:
            path = safe_join(directory, relpath, within=within)
            document = read_json(path, records[relpath], source=str(source))
            # models/main.spec.json -> models/main; a manager item's {"skeleton": ...} -> item
            name = relpath.removeprefix(generation).removesuffix(".json").removesuffix(".spec")
            if isinstance(document, Mapping) and set(document) == {_SKELETON}:
                document = document[_SKELETON]
            try:
                _flatten_values(f"{name}:", document, values)
            except CheckpointFormatError as err:
                raise CheckpointFormatError(f"{display_path(path)}: {err}") from None
    return {_value_name(name): value for name, value in values.items()}


def _diff_side(text: str) -> _Side:
    """The tensor files and plain values of the checkpoint ``text`` names (a root: its
    latest index)."""
    return locate(text).accept(_SideOf())


class _SideOf(KindVisitor[_Side]):
    """One side of ``fastckpt diff`` for each kind of container."""

    def file(self, container: TensorFile) -> _Side:
        path = container.path
        metadata = _header(path)["metadata"] or {}
        return _Side(TensorFiles(display_path(path), {"": path}), {}, metadata, lone=True)

    def manager(self, container: ManagerContainer) -> _Side:
        directory = container.path
        record = read_commit_record(directory)
        generation = record_file(record, "")  # object stores: "g-<hex>/"; locally ""
        files = {
            relpath.removeprefix(generation).removesuffix(TENSOR_SUFFIX): safe_join(
                directory, relpath
            )
            for relpath in sorted(record["files"])
            if relpath.endswith(TENSOR_SUFFIX) and not is_linked_file(relpath)
        }
        # Incremental saves: unchanged tensors live in linked files (see fastckpt.container.links).
        linked = {
            relpath.removesuffix(TENSOR_SUFFIX): {
                name: (path, ref["name"]) for name, (path, ref) in names.items()
            }
            for relpath, names in referenced_sources(directory, record).items()
        }
        values = _json_values(
            directory, record["files"], directory, directory / COMMIT_RECORD, generation
        )
        label = f"{display_path(directory)} (CheckpointManager checkpoint)"
        return _Side(TensorFiles(label, files, linked), values, {})

    def sharded(self, container: ShardedContainer) -> _Side:
        where = display_path(container.path)
        raise UserError(
            f"{where} is a sharded (DCP) checkpoint, which diff does not compare shard by shard: "
            f"export its full tensors first (fastckpt export {where} --to FILE.safetensors) and "
            "diff the exported files"
        )

    def root(self, container: RootContainer) -> _Side:
        return self._index_side(container)

    def index(self, container: IndexContainer) -> _Side:
        return self._index_side(container)

    @staticmethod
    def _index_side(container: SavedContainer) -> _Side:
        manifest, index = resolve_index(container, None)
        directory = manifest.root / str(index)
        # refs.json (an incremental index) is where tensors are, not a value to compare.
        # Linked files hold referenced tensors (possibly stale ones too): read through the refs.
        listed = sorted(
            name
            for name in manifest.entries[index]["files"]
            if name != REFS_FILE and not is_linked_file(name)
        )
        files = {
            relpath.removesuffix(TENSOR_SUFFIX): safe_join(directory, relpath, within=manifest.root)
            for relpath in listed
            if relpath.endswith(TENSOR_SUFFIX)
        }
        references = {
            relpath.removesuffix(TENSOR_SUFFIX): {
                name: (source_path(manifest, ref), ref["name"]) for name, ref in names.items()
            }
            for relpath, names in index_references(manifest, index).items()
        }
        entry = manifest.entries[index]
        counters: dict[str, Any] = {}
        _flatten_values("counters:", entry.get("counters", {}), counters)
        plain = {name.replace(":.", ":"): value for name, value in counters.items()}
        plain.update(_frozen_values(entry.get(FROZEN_FIELD, {})))
        for field in (STRIDES_FIELD, MODES_FIELD):
            plain.update(_per_model_values(field, entry.get(field, {})))
        recorded = {name: entry["files"][name] for name in listed}
        plain.update(_json_values(directory, recorded, manifest.root, manifest.path))
        latest = ", latest" if index == manifest.latest else ""
        side = TensorFiles(f"{display_path(directory)} (index {index}{latest})", files, references)
        return _Side(side, plain, {})


def _per_model_values(field: str, record: Any) -> dict[str, Any]:
    """``{"<field>:<model>.<name>": value}`` for each entry of a manifest entry's per-model
    record ``field`` (:data:`~fastckpt.checkpoint.components.STRIDES_FIELD`: memory layouts,
    :data:`~fastckpt.checkpoint.components.MODES_FIELD`: training modes, which loads give
    back): a layout or mode changed between two indices is a changed plain value."""
    if not isinstance(record, Mapping):
        return {field: record}
    values: dict[str, Any] = {}
    for model, entries in record.items():
        if isinstance(entries, Mapping):
            values.update({f"{field}:{model}.{name}": value for name, value in entries.items()})
        else:
            values[f"{field}:{model}"] = entries
    return values


def _frozen_values(record: Any) -> dict[str, Any]:
    """``{"frozen:<model>.<parameter>": True}`` for each parameter a manifest entry records
    as frozen (its :data:`~fastckpt.checkpoint.components.FROZEN_FIELD`, which loads restore):
    a parameter frozen on one side only is a plain value added or removed. A record that is
    no list of names is one value, ``frozen:<model>`` (or ``frozen`` for the whole field)."""
    if not isinstance(record, Mapping):
        return {"frozen": record}
    values: dict[str, Any] = {}
    for model, names in record.items():
        if isinstance(names, list) and all(isinstance(n, str) for n in names):
            values.update({f"frozen:{model}.{name}": True for name in names})
        else:
            values[f"frozen:{model}"] = names
    return values


def _match_export(single: _Side, whole: _Side) -> str | None:
    """The prefix (``models/main``, a manager item) of ``whole`` that the lone file
    ``single`` holds: named by its export metadata, else the one sharing most tensor names."""
    prefixes = list(whole.tensors.files)
    named = [
        candidate
        for key, candidate in (
            ("fastckpt.model", f"models/{single.metadata.get('fastckpt.model')}"),
            ("fastckpt.item", str(single.metadata.get("fastckpt.item"))),
        )
        if key in single.metadata
    ]
    for candidate in named:
        for prefix in prefixes:
            if prefix == candidate or prefix.startswith(f"{candidate}.rank"):
                return prefix
    names = set(_header(single.tensors.files[""])["tensors"])
    referenced = whole.tensors.references
    overlap = {
        p: len(names & (set(_header(f)["tensors"]) | set(referenced.get(p, {}))))
        for p, f in whole.tensors.files.items()
    }
    best = max(overlap, key=lambda p: overlap[p], default=None)
    return best if best is not None and overlap[best] > 0 else None


def _align(a: _Side, b: _Side) -> tuple[TensorFiles, TensorFiles]:
    """Compare a lone file (an export) with the part of a checkpoint it came from."""
    lone_a, lone_b = set(a.tensors.files) == {""}, set(b.tensors.files) == {""}
    if lone_a == lone_b:
        return a.tensors, b.tensors
    single, whole = (a, b) if lone_a else (b, a)
    prefix = _match_export(single, whole)
    if prefix is None:
        return a.tensors, b.tensors
    narrowed = TensorFiles(
        f"{whole.tensors.label} [{prefix}]",
        {prefix: whole.tensors.files[prefix]},
        {prefix: whole.tensors.references.get(prefix, {})},
    )
    renamed = TensorFiles(single.tensors.label, {prefix: single.tensors.files[""]})
    return (renamed, narrowed) if lone_a else (narrowed, renamed)


def _diff_values(a: _Side, b: _Side) -> dict[str, list[dict[str, Any]]]:
    """Plain values (counters, steps, hyperparameters, hook settings) that differ."""
    if a.lone or b.lone:  # a lone file holds tensors only (an exported checkpoint, say)
        return {"values_changed": [], "values_added": [], "values_removed": []}
    return {
        "values_changed": [
            {"name": n, "a": a.values[n], "b": b.values[n]}
            for n in a.values
            if n in b.values and not _same(a.values[n], b.values[n])
        ],
        "values_added": [{"name": n, "b": b.values[n]} for n in b.values if n not in a.values],
        "values_removed": [{"name": n, "a": a.values[n]} for n in a.values if n not in b.values],
    }


def _limited(rows: list[list[Any]], limit: int) -> tuple[list[list[Any]], str | None]:
    """The first ``limit`` rows (all when ``limit`` is 0), and the line saying what was cut."""
    if not limit or len(rows) <= limit:
        return rows, None
    return rows[:limit], f"... and {len(rows) - limit} more (--limit 0 shows every row)"


def _diff_text(result: Mapping[str, Any], limit: int = 0) -> str:
    # The labels name a model or an item of the checkpoint (``ROOT [models/<name>]``).
    lines = [f"a: {printable(result['a'])}", f"b: {printable(result['b'])}", _summary(result)]
    rows: list[list[Any]] = []
    for item in result["changed"]:
        biggest = item["max_abs_diff"]
        rows.append(
            [
                "changed",
                item["name"],
                item["dtype"],
                shape_text(item["shape"]),
                f"{item['differing']}/{item['elements']}",
                _difference_text(biggest),
            ]
        )
    for item in result["mismatched"]:
        a, b = item["a"], item["b"]
        dtype = a["dtype"] if a["dtype"] == b["dtype"] else f"{a['dtype']} -> {b['dtype']}"
        shape = (
            shape_text(a["shape"])
            if a["shape"] == b["shape"]
            else f"{shape_text(a['shape'])} -> {shape_text(b['shape'])}"
        )
        rows.append(["retyped", item["name"], dtype, shape, "-", "-"])
    for change, items in (("added", result["added"]), ("removed", result["removed"])):
        rows += [[change, t["name"], t["dtype"], shape_text(t["shape"]), "-", "-"] for t in items]
    if rows:
        shown, cut = _limited(rows, limit)
        lines.append(table(["CHANGE", "TENSOR", "DTYPE", "SHAPE", "DIFFERING", "MAX |A-B|"], shown))
        lines += [cut] if cut else []
    value_rows = [
        ["changed", v["name"], _value_text(v["a"]), _value_text(v["b"])]
        for v in result["values_changed"]
    ]
    value_rows += [["added", v["name"], "-", _value_text(v["b"])] for v in result["values_added"]]
    value_rows += [
        ["removed", v["name"], _value_text(v["a"]), "-"] for v in result["values_removed"]
    ]
    if value_rows:
        shown, cut = _limited(value_rows, limit)
        lines.append(table(["CHANGE", "VALUE", "A", "B"], shown))
        lines += [cut] if cut else []
    return "\n".join(lines)


def _difference_text(biggest: int | float | None) -> str:
    """A MAX |A-B| cell: exact for integer tensors, 6 significant digits for floats."""
    if biggest is None:
        return "nan"
    return str(biggest) if isinstance(biggest, int) else f"{biggest:.6g}"


def _summary(result: Mapping[str, Any]) -> str:
    """The one line saying what differs (first in the report)."""
    if result["identical"]:
        return (
            f"identical: {result['compared']} tensor(s) and {result['values_compared']} "
            "plain value(s) compared"
        )
    differ = len(result["changed"]) + len(result["mismatched"])
    values = sum(len(result[k]) for k in ("values_changed", "values_added", "values_removed"))
    return (
        f"{differ} of {result['compared']} common tensor(s) differ, "
        f"{len(result['added'])} added, {len(result['removed'])} removed; "
        f"{values} plain value(s) differ"
    )


def _value_text(value: Any) -> str:
    text = json.dumps(value)  # a string in quotes: "1" and 1 differ
    return text if len(text) <= 40 else text[:37] + "..."


def cmd_diff(args: argparse.Namespace) -> int:
    """``fastckpt diff A B``: exit 0 when identical, 1 when anything differs."""
    if not args.atol >= 0:  # NaN too: no difference is within it
        raise UserError(f"--atol must be a number >= 0, got {args.atol}")
    if args.limit < 0:
        raise UserError(f"--limit must be >= 0, got {args.limit}")
    side_a, side_b = _diff_side(args.a), _diff_side(args.b)
    a, b = _align(side_a, side_b)
    total = sum(backend_for(p).stat(p).size for side in (a, b) for p in side.files.values())
    # Loads map the files, so the bar counts the bytes the core verifies, not read calls.
    with counted_progress("diff", total) as counter, counting(counter):
        try:
            result = diff_checkpoints(a, b, args.atol)
        except TypeError as err:  # a dtype this torch build lacks
            raise UserError(str(err)) from None
    values = _diff_values(side_a, side_b)
    result.update(values)
    result["values_compared"] = sum(
        1
        for name in set(side_a.values) & set(side_b.values)
        if not (isinstance(side_a.values[name], str) and side_a.values[name] in _STRUCTURE)
    )
    result["identical"] = result["identical"] and not any(values.values())
    if args.json:
        print_json(result)
    else:
        print(_diff_text(result, args.limit))
    return EXIT_OK if result["identical"] else EXIT_BAD
