"""The ``fastckpt`` command: list, inspect, verify, diff, prune and export checkpoints.

Every subcommand prints a human-readable table by default and a JSON document with
``--json``. Exit status: 0 success, 1 the answer is "bad" or "different" (``verify`` found a
damaged file, ``diff`` found a difference), 2 the command could not run (missing path, bad
index, unreadable checkpoint, usage error). Errors are one line on stderr, never a traceback
(``--debug`` shows it). Long operations draw a progress bar on stderr when it is a terminal.

A checkpoint PATH may be:

* a :func:`fastckpt.save_checkpoint` root (holds ``manifest.json``),
* one index directory of such a root (``ROOT/<index>``),
* a :class:`fastckpt.CheckpointManager` checkpoint (a directory holding ``commit.json``),
* a single ``.safetensors`` file.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager, redirect_stdout
from pathlib import Path
from typing import Any, NoReturn, cast

import torch

from fastckpt import __version__, tree
from fastckpt.checkpoint import list_checkpoints, prune
from fastckpt.components import IndexReader
from fastckpt.errors import CheckpointFormatError, FastCkptError
from fastckpt.files import load_file, read_metadata, save_file
from fastckpt.progress import format_bytes, io_progress
from fastckpt.specs import BaseSpec
from fastckpt.store import locate as store_locate
from fastckpt.store.locate import KIND_NAMES, Location
from fastckpt.store.paths import safe_join
from fastckpt.store.records import COMMIT_RECORD, MANIFEST, Manifest, read_commit_record
from fastckpt.verify import VerifyReport, verify

__all__ = ["UserError", "build_parser", "main"]

TENSOR_SUFFIX = ".safetensors"
EXIT_OK, EXIT_BAD, EXIT_ERROR = 0, 1, 2


class UserError(Exception):
    """A problem with what the user asked for; printed as one line, exit status 2."""


# --------------------------------------------------------------------------- output helpers


def _one_line(text: str) -> str:
    return "; ".join(part.strip() for part in text.splitlines() if part.strip())


def _error_text(err: BaseException) -> str:
    """A one-line message for an exception (OSError without the ``[Errno N]`` noise)."""
    if isinstance(err, OSError) and err.strerror:
        message = err.strerror
        if err.filename is not None and str(err.filename) not in message:
            message = f"{err.filename}: {message}"
        return _one_line(message)
    if isinstance(err, KeyError) and err.args:
        return _one_line(str(err.args[0]))
    return _one_line(str(err) or type(err).__name__)


def _print_json(document: Any) -> None:
    print(json.dumps(document, indent=2, default=str))


def _table(headers: Sequence[str], rows: Iterable[Sequence[Any]], indent: str = "") -> str:
    """Left-aligned columns separated by two spaces."""
    cells = [[str(h) for h in headers], *([str(c) for c in row] for row in rows)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(indent + line.rstrip() for line in lines)


def _when(iso: str | None) -> str:
    """An ISO-8601 timestamp as ``YYYY-MM-DD HH:MM:SS`` in UTC (``-`` when absent)."""
    if not iso:
        return "-"
    try:
        moment = _dt.datetime.fromisoformat(iso.replace("Z", "+00:00"))
    except ValueError:
        return iso
    if moment.tzinfo is not None:
        moment = moment.astimezone(_dt.timezone.utc)
    return moment.strftime("%Y-%m-%d %H:%M:%S")


def _mtime_iso(path: Path) -> str:
    stamp = path.stat().st_mtime
    return _dt.datetime.fromtimestamp(stamp, _dt.timezone.utc).isoformat()


def _counter(counters: Mapping[str, Any], *names: str) -> Any:
    for name in names:
        if name in counters:
            return counters[name]
    return None


def _dash(value: Any) -> str:
    return "-" if value is None else str(value)


def _shape(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _short(value: Any, limit: int = 60) -> str:
    """A compact rendering of a decoded spec argument."""
    if isinstance(value, BaseSpec):
        text = f"{value.cls_path}({_kwargs_text(value.kwargs, limit)})"
    elif isinstance(value, torch.Tensor):
        text = f"tensor({str(value.dtype).removeprefix('torch.')}, {_shape(value.shape)})"
    elif isinstance(value, tuple):
        text = "(" + ", ".join(_short(v, limit) for v in value) + ("," if len(value) == 1 else "")
        text += ")"
    elif isinstance(value, list):
        text = "[" + ", ".join(_short(v, limit) for v in value) + "]"
    elif isinstance(value, dict):
        text = "{" + ", ".join(f"{k!r}: {_short(v, limit)}" for k, v in value.items()) + "}"
    else:
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _kwargs_text(kwargs: Mapping[str, Any], limit: int = 60) -> str:
    return ", ".join(f"{key}={_short(value, limit)}" for key, value in kwargs.items())


def _spec_text(document: Any, where: str) -> str:
    """``cls.path(kw=value, ...)`` for a stored spec document."""
    if not isinstance(document, Mapping):
        raise CheckpointFormatError(f"{where}: spec must be a JSON object")
    spec = BaseSpec.from_json(document, source=where)
    return f"{spec.cls_path}({_kwargs_text(spec.kwargs)})"


# --------------------------------------------------------------------------- locating checkpoints


def locate(text: str | os.PathLike[str]) -> Location:
    """Work out what kind of checkpoint ``text`` names.

    Raises:
        UserError: it does not exist or is not a fastckpt checkpoint.
    """
    try:
        return store_locate.locate(text)
    except FileNotFoundError as err:
        raise UserError(err.strerror) from None


def _resolve_index(location: Location, requested: int | None) -> tuple[Manifest, int]:
    """The manifest and the committed index a root/index location (plus ``--index``) means.

    Raises:
        UserError: not a root or index, empty root, index not committed or contradictory.
    """
    if location.root is None:
        raise UserError(
            f"{location.path} is a {KIND_NAMES[location.kind]}; this needs a save_checkpoint "
            "root or one of its index directories"
        )
    manifest = Manifest.load(location.root)
    if location.kind == "index":
        own = location.index
        assert own is not None
        if requested is not None and requested not in (-1, own):
            raise UserError(f"{location.path} is index {own}; --index {requested} contradicts it")
        if own not in manifest.entries:
            raise UserError(
                f"{location.path}: index {own} is not committed in {location.root / MANIFEST} "
                f"(committed: {sorted(manifest.entries)}); it may be a leftover of a crash"
            )
        return manifest, own
    if not manifest.entries:
        raise UserError(f"{location.root}: no committed checkpoint yet")
    try:
        return manifest, manifest.resolve(-1 if requested is None else requested)
    except KeyError as err:
        raise UserError(_error_text(err)) from None


def _no_index(location: Location, requested: int | None) -> None:
    if requested is not None and location.kind not in ("root", "index"):
        raise UserError(
            f"{location.path} is a {KIND_NAMES[location.kind]}; --index only applies to a "
            "save_checkpoint root"
        )


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointFormatError(f"{path}: not valid JSON ({err})") from None


def _manager_record(directory: Path) -> dict[str, Any]:
    """The commit record of a CheckpointManager checkpoint, checked."""
    return read_commit_record(directory)


def _tensor_list(header: Mapping[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for name, info in header["tensors"].items():
        start, end = info["data_offsets"]
        rows.append(
            {"name": name, "dtype": info["dtype"], "shape": info["shape"], "bytes": end - start}
        )
    return rows


def _describe_tensor_file(path: Path) -> dict[str, Any]:
    header = read_metadata(path)
    tensors = _tensor_list(header)
    return {
        "size": header["file_len"],
        "tensors": tensors,
        "tensor_bytes": sum(t["bytes"] for t in tensors),
        "checksums": all(i["crc32c"] is not None for i in header["tensors"].values()),
        "metadata": header["metadata"],
    }


# --------------------------------------------------------------------------- fastckpt ls


def _ls_root(root: Path) -> dict[str, Any]:
    return {"root": str(root), "kind": "root", "checkpoints": list_checkpoints(root)}


def _manager_item_value(directory: Path, record: Mapping[str, Any], item: str) -> Any:
    """The value of a scalar item (``step``, ``epoch``) of a manager checkpoint, or None."""
    if item not in record["items"] or f"{item}.json" not in record["files"]:
        return None
    try:
        document = _read_json(safe_join(directory, f"{item}.json"))
    except (OSError, FastCkptError):
        return None
    value = document.get("skeleton") if isinstance(document, dict) else None
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _ls_managers(parent: Path) -> dict[str, Any]:
    checkpoints: list[dict[str, Any]] = []
    for child in sorted(parent.iterdir()):
        if child.name.startswith(".") or not (child / COMMIT_RECORD).is_file():
            continue
        row: dict[str, Any] = {"name": child.name, "path": str(child)}
        try:
            record = _manager_record(child)
        except (OSError, FastCkptError) as err:
            row.update(committed=None, size=None, items=[], error=_error_text(err))
            checkpoints.append(row)
            continue
        row.update(
            committed=_mtime_iso(child / COMMIT_RECORD),
            size=sum(entry["size"] for entry in record["files"].values()),
            items=list(record["items"]),
            step=_manager_item_value(child, record, "step"),
            epoch=_manager_item_value(child, record, "epoch"),
        )
        checkpoints.append(row)
    if not checkpoints:
        raise UserError(
            f"{parent} holds no checkpoints: it is neither a save_checkpoint root (no "
            f"{MANIFEST}) nor a directory of CheckpointManager checkpoints"
        )
    dated = [row for row in checkpoints if row["committed"]]
    newest = max(dated, key=lambda row: row["committed"], default=None)
    for row in checkpoints:
        row["latest"] = row is newest
    return {"root": str(parent), "kind": "manager", "checkpoints": checkpoints}


def _ls_text(listing: Mapping[str, Any]) -> str:
    rows = listing["checkpoints"]
    if listing["kind"] == "root":
        if not rows:
            return f"{listing['root']}: no committed checkpoint yet"
        total = sum(row["size"] for row in rows)
        title = f"{listing['root']}: {len(rows)} committed index(es), {format_bytes(total)}"
        table = _table(
            ["", "INDEX", "CREATED (UTC)", "SIZE", "STEP", "EPOCH", "COMPONENTS"],
            (
                [
                    "*" if row["latest"] else "",
                    row["index"],
                    _when(row["created"]),
                    format_bytes(row["size"]),
                    _dash(_counter(row["counters"], "step_count", "step", "global_step")),
                    _dash(_counter(row["counters"], "epoch_count", "epoch")),
                    _components_text(row["components"]),
                ]
                for row in rows
            ),
        )
    else:
        title = f"{listing['root']}: {len(rows)} CheckpointManager checkpoint(s)"
        table = _table(
            ["", "NAME", "COMMITTED (UTC)", "SIZE", "STEP", "EPOCH", "ITEMS"],
            (
                [
                    "*" if row["latest"] else "",
                    row["name"],
                    _when(row["committed"]),
                    "?" if row["size"] is None else format_bytes(row["size"]),
                    _dash(row.get("step")),
                    _dash(row.get("epoch")),
                    row.get("error") or ", ".join(row["items"]),
                ]
                for row in rows
            ),
        )
    return f"{title}\n{table}\n(* = latest)"


def _components_text(components: Mapping[str, Sequence[str]]) -> str:
    parts = [f"{kind}: {', '.join(names)}" for kind, names in components.items() if names]
    return "; ".join(parts) or "-"


def cmd_ls(args: argparse.Namespace) -> int:
    """``fastckpt ls ROOT``."""
    path = Path(args.root)
    if not path.exists():
        raise UserError(f"{path}: no such file or directory")
    if not path.is_dir():
        raise UserError(f"{path} is a file; ls lists a checkpoint root (use fastckpt inspect)")
    if (path / MANIFEST).is_file():
        listing = _ls_root(path)
    elif (path / COMMIT_RECORD).is_file():
        raise UserError(
            f"{path} is one CheckpointManager checkpoint; list its parent directory, or use "
            f"fastckpt inspect {path}"
        )
    elif path.name.isdigit() and (path.parent / MANIFEST).is_file():
        raise UserError(
            f"{path} is one index of the root {path.parent}; list the root, or use "
            f"fastckpt inspect {path}"
        )
    else:
        listing = _ls_managers(path)
    if args.json:
        _print_json(listing)
    else:
        print(_ls_text(listing))
    return EXIT_OK


# --------------------------------------------------------------------------- fastckpt inspect


def _describe_index(manifest: Manifest, index: int) -> dict[str, Any]:
    entry = manifest.entries[index]
    directory = manifest.root / str(index)
    listed = entry["files"]

    def document(relpath: str) -> Any:
        return _read_json(safe_join(directory, relpath, within=manifest.root))

    files = []
    for relpath in sorted(listed):
        record = listed[relpath]
        item: dict[str, Any] = {
            "path": relpath,
            "size": record["size"],
            "crc32c": f"{record['crc32c']:08x}",
        }
        if relpath.endswith(TENSOR_SUFFIX):
            item.update(_describe_tensor_file(safe_join(directory, relpath, within=manifest.root)))
            item["size"] = record["size"]
        files.append(item)
    components = entry.get("components", {})
    specs: dict[str, Any] = {}
    for name in components.get("models", []):
        if f"models/{name}.spec.json" in listed:
            specs[f"models/{name}"] = document(f"models/{name}.spec.json")
    for kind in ("optimizers", "schedulers"):
        for name in components.get(kind, []):
            if f"{kind}/{name}.json" in listed:
                stored = document(f"{kind}/{name}.json")
                specs[f"{kind}/{name}"] = stored.get("spec") if isinstance(stored, dict) else None
    strategy = None
    if "strategy.json" in listed:
        recipe = document("strategy.json")
        if isinstance(recipe, dict):
            strategy = {k: v for k, v in recipe.items() if k != "runtime"}
    hooks = []
    if "hooks.json" in listed:
        saved = document("hooks.json")
        for hook in saved.get("hooks", []) if isinstance(saved, dict) else []:
            if isinstance(hook, dict):
                hooks.append({"class": hook.get("class"), "occurrence": hook.get("occurrence")})
    return {
        "kind": "index",
        "root": str(manifest.root),
        "path": str(directory),
        "index": index,
        "latest": index == manifest.latest,
        "indices": sorted(manifest.entries),
        "created": entry.get("created"),
        "counters": entry.get("counters", {}),
        "components": components,
        "associations": entry.get("associations", {}),
        "specs": specs,
        "strategy": strategy,
        "hooks": hooks,
        "size": sum(record["size"] for record in listed.values()),
        "files": files,
    }


class _TensorRef:
    """Stands in for a tensor while walking a manager item's skeleton."""

    def __init__(self, name: str) -> None:
        self.name = name


class _Refs(dict[str, _TensorRef]):
    """A tensor mapping for :func:`fastckpt.tree.unflatten` that has every name (as a ref)."""

    def __missing__(self, key: str) -> _TensorRef:
        return _TensorRef(key)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str)


def _leaves(value: Any, path: str, out: dict[str, Any]) -> None:
    """Collect the non-tensor leaves of a nested value by key path."""
    if isinstance(value, _TensorRef):
        return
    if isinstance(value, Mapping):
        for key, sub in value.items():
            _leaves(sub, tree.join_path(path, key), out)
    elif isinstance(value, (list, tuple)):
        for i, sub in enumerate(value):
            _leaves(sub, tree.join_path(path, i), out)
    else:
        out[path] = value


def _describe_manager(directory: Path) -> dict[str, Any]:
    record = _manager_record(directory)
    files = []
    for relpath in sorted(record["files"]):
        item: dict[str, Any] = {"path": relpath, "size": record["files"][relpath]["size"]}
        if relpath.endswith(TENSOR_SUFFIX):
            item.update(_describe_tensor_file(safe_join(directory, relpath)))
        files.append(item)
    items = []
    for key in record["items"]:
        values: dict[str, Any] = {}
        if f"{key}.json" in record["files"]:
            stored = _read_json(safe_join(directory, f"{key}.json"))
            skeleton = stored.get("skeleton") if isinstance(stored, dict) else None
            refs = cast(Mapping[str, torch.Tensor], _Refs())
            _leaves(tree.unflatten(skeleton, refs, str(key)), str(key), values)
        tensor_files = [
            f["path"]
            for f in files
            if f["path"] == f"{key}{TENSOR_SUFFIX}"
            or (f["path"].startswith(f"{key}.rank") and f["path"].endswith(TENSOR_SUFFIX))
        ]
        items.append({"name": key, "values": values, "tensor_files": tensor_files})
    return {
        "kind": "manager",
        "path": str(directory),
        "committed": _mtime_iso(directory / COMMIT_RECORD),
        "world_size": record.get("world_size", 1),
        "items": items,
        "size": sum(entry["size"] for entry in record["files"].values()),
        "files": files,
    }


def _describe_file(path: Path) -> dict[str, Any]:
    return {"kind": "file", "path": str(path), **_describe_tensor_file(path)}


def _tensor_table(tensors: Sequence[Mapping[str, Any]], indent: str) -> str:
    return _table(
        ["TENSOR", "DTYPE", "SHAPE", "BYTES"],
        ([t["name"], t["dtype"], _shape(t["shape"]), format_bytes(t["bytes"])] for t in tensors),
        indent,
    )


def _file_lines(files: Sequence[Mapping[str, Any]]) -> list[str]:
    lines = []
    for item in files:
        if "tensors" not in item:
            lines.append(f"{item['path']}  {format_bytes(item['size'])}")
            continue
        count = len(item["tensors"])
        lines.append(f"{item['path']}  {format_bytes(item['size'])}, {count} tensor(s)")
        if item["metadata"]:
            meta = ", ".join(f"{k}={v}" for k, v in item["metadata"].items())
            lines.append(f"  metadata: {meta}")
        if count:
            lines.append(_tensor_table(item["tensors"], "  "))
    return lines


def _index_text(info: Mapping[str, Any]) -> str:
    latest = " (latest)" if info["latest"] else ""
    lines = [
        f"{info['path']}: index {info['index']}{latest} of save_checkpoint root {info['root']} "
        f"(committed: {', '.join(str(i) for i in info['indices'])})"
    ]
    fields: list[tuple[str, str]] = [("created", f"{_when(info['created'])} UTC")]
    counters = " ".join(f"{k}={v}" for k, v in info["counters"].items())
    fields.append(("counters", counters or "-"))
    associations = info["associations"]
    specs = info["specs"]
    for kind in ("models", "optimizers", "schedulers"):
        for name in info["components"].get(kind, []):
            owner = associations.get(kind, {}).get(name) if kind != "models" else None
            tied = {"optimizers": f" (model {owner})", "schedulers": f" (optimizer {owner})"}
            label = name + (tied[kind] if owner else "")
            spec = specs.get(f"{kind}/{name}")
            text = _spec_text(spec, f"{kind}/{name}") if spec is not None else "(no spec)"
            fields.append((kind, f"{label}: {text}"))
    strategy = info["strategy"]
    if strategy is not None:
        run = f"num_steps={strategy.get('num_steps')} num_epochs={strategy.get('num_epochs')}"
        fn = strategy.get("training_fn")
        fields.append(("strategy", f"{strategy.get('strategy_cls')}  training_fn={fn}  {run}"))
    for hook in info["hooks"]:
        fields.append(("hook", f"{hook['class']} #{hook['occurrence']}"))
    fields.append(("size", f"{format_bytes(info['size'])} in {len(info['files'])} file(s)"))
    width = max(len(label) for label, _ in fields)
    lines += [f"{label.ljust(width)}  {text}" for label, text in fields]
    return "\n".join([*lines, "", *_file_lines(info["files"])])


_MAX_VALUES = 8  # non-tensor values shown per manager item (all of them with --json)


def _manager_text(info: Mapping[str, Any]) -> str:
    lines = [
        f"{info['path']}: CheckpointManager checkpoint, {len(info['items'])} item(s), "
        f"world size {info['world_size']}",
        f"committed  {_when(info['committed'])} UTC",
        f"size       {format_bytes(info['size'])} in {len(info['files'])} file(s)",
    ]
    counts = {f["path"]: len(f.get("tensors", [])) for f in info["files"]}
    for item in info["items"]:
        tensors = sum(counts.get(path, 0) for path in item["tensor_files"])
        lines.append(f"item {item['name']}: {tensors} tensor(s)")
        shown = list(item["values"].items())
        lines += [f"  {path} = {value!r}" for path, value in shown[:_MAX_VALUES]]
        if len(shown) > _MAX_VALUES:
            lines.append(f"  ... {len(shown) - _MAX_VALUES} more value(s) (see --json)")
    return "\n".join([*lines, "", *_file_lines(info["files"])])


def _file_text(info: Mapping[str, Any]) -> str:
    checks = "crc32c per tensor" if info["checksums"] else "no checksums (not written by fastckpt)"
    head = (
        f"{info['path']}: safetensors file, {format_bytes(info['size'])}, "
        f"{len(info['tensors'])} tensor(s), {format_bytes(info['tensor_bytes'])} of data, {checks}"
    )
    lines = [head]
    if info["metadata"]:
        lines.append("metadata: " + ", ".join(f"{k}={v}" for k, v in info["metadata"].items()))
    if info["tensors"]:
        lines.append(_tensor_table(info["tensors"], ""))
    return "\n".join(lines)


def cmd_inspect(args: argparse.Namespace) -> int:
    """``fastckpt inspect PATH [--index N]``."""
    location = locate(args.path)
    _no_index(location, args.index)
    try:
        if location.kind in ("root", "index"):
            manifest, index = _resolve_index(location, args.index)
            info = _describe_index(manifest, index)
            text = _index_text
        elif location.kind == "manager":
            info, text = _describe_manager(location.path), _manager_text
        else:
            info, text = _describe_file(location.path), _file_text
    except (OSError, FastCkptError) as err:
        raise UserError(
            f"{_error_text(err)} (fastckpt verify {location.path} checks every file)"
        ) from err
    if args.json:
        _print_json(info)
    else:
        print(text(info))
    return EXIT_OK


# --------------------------------------------------------------------------- fastckpt verify


def _expected_bytes(location: Location, index: int | None) -> int | None:
    """What verifying will read, for the progress bar (None when it cannot be told)."""
    try:
        if location.kind == "file":
            return location.path.stat().st_size
        if location.kind == "manager":
            record = _manager_record(location.path)
            return sum(entry["size"] for entry in record["files"].values())
        if location.root is None:
            return None
        manifest = Manifest.load(location.root)
        chosen = location.index if location.kind == "index" else index
        if chosen == -1:
            chosen = manifest.latest
        indices = sorted(manifest.entries) if chosen is None else [chosen]
        return sum(
            record["size"]
            for i in indices
            if i in manifest.entries
            for record in manifest.entries[i]["files"].values()
        )
    except (OSError, FastCkptError):
        return None


def _verify_json(report: VerifyReport, seconds: float) -> dict[str, Any]:
    return {
        "ok": report.ok,
        "failed_indices": report.failed_indices(),
        "bytes": sum(f.actual_size or 0 for f in report.files),
        "seconds": round(seconds, 6),
        **dataclasses.asdict(report),
    }


def _newest_intact(report: VerifyReport) -> int | None:
    intact = [i for i in report.indices if report.index_ok(i)]
    return max(intact) if intact else None


def _verify_text(report: VerifyReport, seconds: float) -> str:
    checked = sum(f.actual_size or 0 for f in report.files)
    scope = f"{len(report.files)} file(s)"
    if report.indices:
        scope += f" of index(es) {', '.join(str(i) for i in report.indices)}"
    rate = f"{format_bytes(checked / seconds)}/s" if seconds > 0 else "-"
    if report.ok:
        return (
            f"ok: {report.target}: {scope} verified, {format_bytes(checked)} in "
            f"{seconds:.2f} s ({rate})"
        )
    failures = report.failures
    lines = [f"BAD: {report.target}: {len(failures)} problem(s) in {scope}"]
    rows = [["-" if f.index is None else f.index, f.status, _one_line(f.message)] for f in failures]
    lines.append(_table(["INDEX", "STATUS", "PROBLEM"], rows, "  "))
    if report.indices:
        failed = report.failed_indices()
        newest = _newest_intact(report)
        resume = "none" if newest is None else str(newest)
        lines.append(
            f"damaged index(es): {', '.join(str(i) for i in failed) or '-'}; "
            f"newest intact index: {resume}"
        )
    return "\n".join(lines)


def cmd_verify(args: argparse.Namespace) -> int:
    """``fastckpt verify PATH [--index N]``: exit 0 when intact, 1 when anything is bad."""
    location = locate(args.path)
    _no_index(location, args.index)
    total = _expected_bytes(location, args.index)
    started = time.perf_counter()
    with io_progress(f"verify {location.path}", total):
        try:
            report = verify(location.path, args.index)
        except (KeyError, ValueError) as err:
            if isinstance(err, FastCkptError):
                raise
            raise UserError(_error_text(err)) from None
    seconds = time.perf_counter() - started
    if args.json:
        _print_json(_verify_json(report, seconds))
    else:
        print(_verify_text(report, seconds))
    return EXIT_OK if report.ok else EXIT_BAD


# --------------------------------------------------------------------------- fastckpt diff


@dataclasses.dataclass
class _Side:
    """One side of a diff: tensor files keyed by a prefix for tensor names."""

    label: str
    files: dict[str, Path]


def _diff_side(text: str) -> _Side:
    location = locate(text)
    if location.kind == "file":
        return _Side(str(location.path), {"": location.path})
    if location.kind == "manager":
        record = _manager_record(location.path)
        files = {
            relpath.removesuffix(TENSOR_SUFFIX): safe_join(location.path, relpath)
            for relpath in sorted(record["files"])
            if relpath.endswith(TENSOR_SUFFIX)
        }
        return _Side(f"{location.path} (CheckpointManager checkpoint)", files)
    manifest, index = _resolve_index(location, None)
    directory = manifest.root / str(index)
    files = {
        relpath.removesuffix(TENSOR_SUFFIX): safe_join(directory, relpath, within=manifest.root)
        for relpath in sorted(manifest.entries[index]["files"])
        if relpath.endswith(TENSOR_SUFFIX)
    }
    latest = ", latest" if index == manifest.latest else ""
    return _Side(f"{directory} (index {index}{latest})", files)


def _qualified(prefix: str, name: str) -> str:
    return f"{prefix}:{name}" if prefix else name


_INT_VIEWS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def compare_tensors(a: torch.Tensor, b: torch.Tensor) -> tuple[int, float]:
    """Compare two tensors of equal dtype and shape bit for bit.

    Returns:
        ``(differing elements, max |a - b| over them)``; NaN when a differing element is NaN.
    """
    view = _INT_VIEWS[a.element_size()]
    flat_a, flat_b = a.reshape(-1), b.reshape(-1)
    differ = flat_a.view(view) != flat_b.view(view)
    count = int(differ.sum())
    if count == 0:
        return 0, 0.0
    wide = torch.complex128 if a.is_complex() else torch.float64
    delta = (flat_a[differ].to(wide) - flat_b[differ].to(wide)).abs()
    return count, float(delta.max())


def _headers(side: _Side) -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = {}
    for prefix, path in side.files.items():
        for name, info in read_metadata(path)["tensors"].items():
            found[_qualified(prefix, name)] = {
                "prefix": prefix,
                "name": name,
                "dtype": info["dtype"],
                "shape": info["shape"],
            }
    return found


def _load(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(path)
    except TypeError as err:  # a dtype this torch build lacks
        raise UserError(f"{path}: {err}") from None


def diff_checkpoints(a: _Side, b: _Side, atol: float = 0.0) -> dict[str, Any]:
    """Compare every tensor of two sides (see ``fastckpt diff``)."""
    head_a, head_b = _headers(a), _headers(b)
    removed = [{"name": n, **_meta(head_a[n])} for n in head_a if n not in head_b]
    added = [{"name": n, **_meta(head_b[n])} for n in head_b if n not in head_a]
    common = [n for n in head_a if n in head_b]
    mismatched = [
        {"name": n, "a": _meta(head_a[n]), "b": _meta(head_b[n])}
        for n in common
        if _meta(head_a[n]) != _meta(head_b[n])
    ]
    comparable = [n for n in common if _meta(head_a[n]) == _meta(head_b[n])]
    changed: list[dict[str, Any]] = []
    same = 0
    by_pair: dict[tuple[str, str], list[str]] = {}
    for name in comparable:
        key = (head_a[name]["prefix"], head_b[name]["prefix"])
        by_pair.setdefault(key, []).append(name)
    for (prefix_a, prefix_b), names in by_pair.items():
        tensors_a, tensors_b = _load(a.files[prefix_a]), _load(b.files[prefix_b])
        for name in names:
            left = tensors_a[head_a[name]["name"]]
            right = tensors_b[head_b[name]["name"]]
            count, biggest = compare_tensors(left, right)
            if count == 0 or biggest <= atol:
                same += 1
                continue
            changed.append(
                {
                    "name": name,
                    **_meta(head_a[name]),
                    "differing": count,
                    "elements": left.numel(),
                    "max_abs_diff": None if math.isnan(biggest) else biggest,
                }
            )
        del tensors_a, tensors_b
    return {
        "a": a.label,
        "b": b.label,
        "atol": atol,
        "identical": not (changed or mismatched or added or removed),
        "compared": len(common),
        "same": same,
        "changed": changed,
        "mismatched": mismatched,
        "added": added,
        "removed": removed,
    }


def _meta(header: Mapping[str, Any]) -> dict[str, Any]:
    return {"dtype": header["dtype"], "shape": header["shape"]}


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
                _shape(item["shape"]),
                f"{item['differing']}/{item['elements']}",
                "nan" if biggest is None else f"{biggest:.6g}",
            ]
        )
    for item in result["mismatched"]:
        a, b = item["a"], item["b"]
        dtype = a["dtype"] if a["dtype"] == b["dtype"] else f"{a['dtype']} -> {b['dtype']}"
        shape = (
            _shape(a["shape"])
            if a["shape"] == b["shape"]
            else f"{_shape(a['shape'])} -> {_shape(b['shape'])}"
        )
        rows.append(["retyped", item["name"], dtype, shape, "-", "-"])
    for change, items in (("added", result["added"]), ("removed", result["removed"])):
        rows += [[change, t["name"], t["dtype"], _shape(t["shape"]), "-", "-"] for t in items]
    if rows:
        lines.append(_table(["CHANGE", "TENSOR", "DTYPE", "SHAPE", "DIFFERING", "MAX |A-B|"], rows))
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
        result = diff_checkpoints(a, b, args.atol)
    if args.json:
        _print_json(result)
    else:
        print(_diff_text(result))
    return EXIT_OK if result["identical"] else EXIT_BAD


# --------------------------------------------------------------------------- fastckpt prune


def cmd_prune(args: argparse.Namespace) -> int:
    """``fastckpt prune ROOT --keep-last N [--dry-run]``."""
    location = locate(args.root)
    if location.kind != "root":
        raise UserError(
            f"{location.path} is a {KIND_NAMES[location.kind]}; prune works on a "
            f"save_checkpoint root (a directory holding {MANIFEST})"
        )
    entries = list_checkpoints(location.path)
    sizes = {row["index"]: row["size"] for row in entries}
    indices = sorted(sizes)
    doomed = indices[: -args.keep_last] if len(indices) > args.keep_last else []
    if not args.dry_run and doomed:
        doomed = prune(location.path, keep_last=args.keep_last)
    kept = [i for i in indices if i not in doomed]
    freed = sum(sizes[i] for i in doomed)
    if args.json:
        _print_json(
            {
                "root": str(location.path),
                "keep_last": args.keep_last,
                "dry_run": args.dry_run,
                "deleted": doomed,
                "kept": kept,
                "freed_bytes": freed,
            }
        )
        return EXIT_OK
    kept_text = ", ".join(str(i) for i in kept) or "-"
    if not doomed:
        print(f"nothing to delete: {len(indices)} index(es), keeping the last {args.keep_last}")
    elif args.dry_run:
        print(
            f"would delete index(es) {', '.join(str(i) for i in doomed)} "
            f"({format_bytes(freed)}); would keep {kept_text}"
        )
    else:
        print(
            f"deleted index(es) {', '.join(str(i) for i in doomed)} "
            f"({format_bytes(freed)} freed); kept {kept_text}"
        )
    return EXIT_OK


# --------------------------------------------------------------------------- fastckpt export


def _pick(names: Sequence[str], wanted: str | None, what: str, where: Path) -> str:
    if wanted is not None:
        if wanted not in names:
            raise UserError(f"{where} has no {what} {wanted!r}; it has: {', '.join(names)}")
        return wanted
    if len(names) == 1:
        return names[0]
    if not names:
        raise UserError(f"{where} holds no {what}")
    raise UserError(f"{where} has several {what}s ({', '.join(names)}); choose one with --model")


@dataclasses.dataclass
class _Export:
    """What ``fastckpt export`` reads: a loader for the tensors, their file size, provenance."""

    load: Callable[[], dict[str, torch.Tensor]]
    size: int
    metadata: dict[str, str]


def _export_plan(location: Location, index: int | None, model: str | None) -> _Export:
    if location.kind == "manager":
        record = _manager_record(location.path)
        items = [str(key) for key in record["items"]]
        preferred = "model" if model is None and "model" in items else model
        key = _pick(items, preferred, "item", location.path)
        files = record["files"]
        size = sum(
            entry["size"]
            for relpath, entry in files.items()
            if relpath in (f"{key}{TENSOR_SUFFIX}", f"{key}.rank0{TENSOR_SUFFIX}")
        )
        return _Export(
            lambda: _manager_item_tensors(location.path, key),
            size,
            {"fastckpt.source": str(location.path), "fastckpt.item": key},
        )
    if location.kind == "file":
        raise UserError(f"{location.path} is already a single safetensors file")
    manifest, chosen = _resolve_index(location, index)
    entry = manifest.entries[chosen]
    names = [str(n) for n in entry.get("components", {}).get("models", [])]
    name = _pick(names, model, "model", manifest.root / str(chosen))
    relpath = f"models/{name}{TENSOR_SUFFIX}"
    record = entry["files"].get(relpath, {"size": 0})
    return _Export(
        lambda: IndexReader(manifest, chosen).tensors(relpath),
        record["size"],
        {
            "fastckpt.source": str(manifest.root),
            "fastckpt.index": str(chosen),
            "fastckpt.model": name,
        },
    )


def _manager_item_tensors(directory: Path, key: str) -> dict[str, torch.Tensor]:
    """The tensors of one CheckpointManager item, named by their key paths (verified)."""
    from fastckpt.manager import CheckpointManager

    manager = CheckpointManager(CheckpointManager.Config.with_sync_save())
    try:
        value = manager.load(directory, into={key: None})[key]
    finally:
        manager.close()
    return tree.flatten(value)[1]


def cmd_export(args: argparse.Namespace) -> int:
    """``fastckpt export PATH [--index N] --to OUT [--model NAME] [--force]``."""
    location = locate(args.path)
    _no_index(location, args.index)
    out = Path(args.to)
    if out.is_dir():
        raise UserError(f"{out} is a directory; --to names the file to write")
    if out.exists() and not args.force:
        raise UserError(f"{out} already exists; pass --force to replace it")
    plan = _export_plan(location, args.index, args.model)
    with io_progress(f"export {location.path}", 2 * plan.size):  # read it, then write it
        tensors = plan.load()
        save_file(tensors, out, metadata={"format": "pt", **plan.metadata})
    size = out.stat().st_size
    summary = {
        "source": str(location.path),
        "to": str(out),
        "tensors": len(tensors),
        "bytes": size,
        "metadata": plan.metadata,
    }
    if args.json:
        _print_json(summary)
    else:
        origin = ", ".join(f"{k.removeprefix('fastckpt.')} {v}" for k, v in plan.metadata.items())
        print(f"wrote {out}: {len(tensors)} tensor(s), {format_bytes(size)} ({origin})")
    return EXIT_OK


# --------------------------------------------------------------------------- fastckpt bench


def run_bench(argv: Sequence[str], *, as_json: bool) -> int:
    """Forward ``argv`` to the harness (``python -m fastckpt.bench``).

    With ``as_json`` the harness's progress goes to stderr and its result file
    (``<out>/<tag>.json``) is printed on stdout.
    """
    from fastckpt.bench import cli as bench_cli

    if not as_json:
        return bench_cli.main(list(argv))
    from fastckpt.bench.harness import default_tag

    options = bench_cli.build_parser().parse_args(list(argv))
    with redirect_stdout(sys.stderr):
        status = bench_cli.main(list(argv))
    if status == EXIT_OK:
        tag = options.tag or default_tag(options.size_gib)
        sys.stdout.write((Path(options.out) / f"{tag}.json").read_text())
    return status


# --------------------------------------------------------------------------- the parser


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line."""

    def error(self, message: str) -> NoReturn:
        """Print ``prog: error: message`` on one line and exit with status 2."""
        self.exit(EXIT_ERROR, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _index(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer index") from None
    if value < -1:
        raise argparse.ArgumentTypeError(f"must be >= 0 (or -1 for the latest), got {value}")
    return value


def _common(*, top: bool) -> _Parser:
    """Options accepted both before and after the subcommand."""
    parent = _Parser(add_help=False)
    default: Any = False if top else argparse.SUPPRESS
    parent.add_argument("--json", action="store_true", default=default, help="print JSON")
    parent.add_argument(
        "--debug", action="store_true", default=default, help="show tracebacks of errors"
    )
    parent.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        default=default,
        help="print the library's log (logger 'fastckpt', INFO) on stderr",
    )
    return parent


def build_parser() -> argparse.ArgumentParser:
    """The ``fastckpt`` argument parser (``fastckpt --help`` documents every option)."""
    parser = _Parser(
        prog="fastckpt",
        description="Inspect and maintain fastckpt checkpoints.",
        epilog="exit status: 0 ok, 1 verify found damage / diff found differences, 2 error",
        parents=[_common(top=True)],
    )
    parser.add_argument("--version", action="version", version=f"fastckpt {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    common = [_common(top=False)]

    ls = commands.add_parser(
        "ls", parents=common, help="list the committed indices of a root (or manager checkpoints)"
    )
    ls.add_argument("root", metavar="ROOT")
    ls.set_defaults(handler=cmd_ls)

    inspect = commands.add_parser(
        "inspect", parents=common, help="components, tensors, specs and metadata of a checkpoint"
    )
    inspect.add_argument("path", metavar="PATH")
    inspect.add_argument("--index", type=_index, help="index of a root (default: latest)")
    inspect.set_defaults(handler=cmd_inspect)

    verify = commands.add_parser(
        "verify", parents=common, help="check every file's size and crc32c; exit 1 if damaged"
    )
    verify.add_argument("path", metavar="PATH")
    verify.add_argument("--index", type=_index, help="only this index of a root (-1: latest)")
    verify.set_defaults(handler=cmd_verify)

    diff = commands.add_parser(
        "diff", parents=common, help="which tensors differ between two checkpoints; exit 1 if any"
    )
    diff.add_argument("a", metavar="A")
    diff.add_argument("b", metavar="B")
    diff.add_argument(
        "--atol", type=float, default=0.0, help="count tensors within this max |a-b| as equal"
    )
    diff.set_defaults(handler=cmd_diff)

    prune_cmd = commands.add_parser(
        "prune", parents=common, help="delete all but the newest N indices of a root"
    )
    prune_cmd.add_argument("root", metavar="ROOT")
    prune_cmd.add_argument("--keep-last", type=_positive, required=True, metavar="N")
    prune_cmd.add_argument("--dry-run", action="store_true", help="only say what would go")
    prune_cmd.set_defaults(handler=cmd_prune)

    export = commands.add_parser(
        "export", parents=common, help="write one model's weights as a plain safetensors file"
    )
    export.add_argument("path", metavar="PATH")
    export.add_argument("--to", required=True, metavar="FILE", help="the file to write")
    export.add_argument("--index", type=_index, help="index of a root (default: latest)")
    export.add_argument("--model", help="model name (or manager item); needed if several")
    export.add_argument("--force", action="store_true", help="replace FILE if it exists")
    export.set_defaults(handler=cmd_export)

    commands.add_parser(
        "bench",
        add_help=False,
        help="run the benchmark harness (arguments go to python -m fastckpt.bench)",
    )
    return parser


_GLOBAL_FLAGS = frozenset({"--json", "--debug", "-v", "--verbose"})


def _split_bench(argv: Sequence[str]) -> tuple[list[str], list[str]] | None:
    """``(global flags, harness args)`` when the subcommand is ``bench``, else None."""
    for position, token in enumerate(argv):
        if token in _GLOBAL_FLAGS:
            continue
        if token == "bench":
            return list(argv[:position]), list(argv[position + 1 :])
        return None
    return None


@contextmanager
def _broken_pipe_guard() -> Iterator[None]:
    """Exit quietly when stdout is closed early (``fastckpt ls ROOT | head -1``)."""
    try:
        yield
        sys.stdout.flush()
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        raise SystemExit(EXIT_OK) from None


def _configure_logging(verbose: bool) -> None:
    if verbose:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
        logger = logging.getLogger("fastckpt")
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``fastckpt`` command line; returns the exit status.

    Args:
        argv: the arguments (default ``sys.argv[1:]``).
    """
    arguments = list(sys.argv[1:] if argv is None else argv)
    bench = _split_bench(arguments)
    if bench is not None:
        flags, rest = bench
        _configure_logging("-v" in flags or "--verbose" in flags)
        as_json = "--json" in flags or "--json" in rest
        rest = [arg for arg in rest if arg != "--json"]
        return _run(lambda: run_bench(rest, as_json=as_json), "bench", "--debug" in flags)
    args = build_parser().parse_args(arguments)
    _configure_logging(args.verbose)
    handler: Callable[[argparse.Namespace], int] = args.handler
    return _run(lambda: handler(args), args.command, args.debug)


def _run(action: Callable[[], int], command: str, debug: bool) -> int:
    """Run a subcommand, turning user errors into one line on stderr and exit status 2."""
    try:
        with _broken_pipe_guard():
            return action()
    except (UserError, FastCkptError, OSError) as err:
        if debug:
            raise
        print(f"fastckpt {command}: error: {_error_text(err)}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"fastckpt {command}: interrupted", file=sys.stderr)
        return 130
