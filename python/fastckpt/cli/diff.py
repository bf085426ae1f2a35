"""``fastckpt diff A B``: which tensors differ between two checkpoints."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from fastckpt.cli.common import (
    EXIT_BAD,
    EXIT_OK,
    TENSOR_SUFFIX,
    UserError,
    locate,
    resolve_index,
)
from fastckpt.cli.render import (
    print_json,
    shape_text,
    table,
)
from fastckpt.diff import TensorFiles, diff_checkpoints
from fastckpt.progress import io_progress
from fastckpt.store.paths import safe_join
from fastckpt.store.records import read_commit_record, record_file

# --------------------------------------------------------------------------- fastckpt diff


def _diff_side(text: str) -> TensorFiles:
    """The tensor files of the checkpoint ``text`` names (a root: its latest index)."""
    location = locate(text)
    if location.kind == "file":
        return TensorFiles(str(location.path), {"": location.path})
    if location.kind == "manager":
        record = read_commit_record(location.path)
        generation = record_file(record, "")  # object stores: "g-<hex>/"; locally ""
        files = {
            relpath.removeprefix(generation).removesuffix(TENSOR_SUFFIX): safe_join(
                location.path, relpath
            )
            for relpath in sorted(record["files"])
            if relpath.endswith(TENSOR_SUFFIX)
        }
        return TensorFiles(f"{location.path} (CheckpointManager checkpoint)", files)
    manifest, index = resolve_index(location, None)
    directory = manifest.root / str(index)
    files = {
        relpath.removesuffix(TENSOR_SUFFIX): safe_join(directory, relpath, within=manifest.root)
        for relpath in sorted(manifest.entries[index]["files"])
        if relpath.endswith(TENSOR_SUFFIX)
    }
    latest = ", latest" if index == manifest.latest else ""
    return TensorFiles(f"{directory} (index {index}{latest})", files)


def _diff_text(result: Mapping[str, Any]) -> str:
    lines = [f"a: {result['a']}", f"b: {result['b']}"]
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
                "nan" if biggest is None else f"{biggest:.6g}",
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
        lines.append(table(["CHANGE", "TENSOR", "DTYPE", "SHAPE", "DIFFERING", "MAX |A-B|"], rows))
    differ = len(result["changed"]) + len(result["mismatched"])
    if result["identical"]:
        lines.append(f"identical: {result['compared']} tensor(s) compared")
    else:
        lines.append(
            f"{differ} of {result['compared']} common tensor(s) differ, "
            f"{len(result['added'])} added, {len(result['removed'])} removed"
        )
    return "\n".join(lines)


def cmd_diff(args: argparse.Namespace) -> int:
    """``fastckpt diff A B``: exit 0 when identical, 1 when anything differs."""
    if args.atol < 0:
        raise UserError(f"--atol must be >= 0, got {args.atol}")
    a, b = _diff_side(args.a), _diff_side(args.b)
    total = sum(p.stat().st_size for side in (a, b) for p in side.files.values())
    with io_progress("diff", total):
        try:
            result = diff_checkpoints(a, b, args.atol)
        except TypeError as err:  # a dtype this torch build lacks
            raise UserError(str(err)) from None
    if args.json:
        print_json(result)
    else:
        print(_diff_text(result))
    return EXIT_OK if result["identical"] else EXIT_BAD
