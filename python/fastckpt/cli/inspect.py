"""``fastckpt inspect PATH``: components, tensors, specs and metadata of a checkpoint."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from fastckpt.cli import sharded
from fastckpt.cli.common import (
    EXIT_OK,
    TENSOR_SUFFIX,
    UserError,
    describe_tensor_file,
    error_text,
    locate,
    manager_children,
    no_index,
    read_document,
    resolve_index,
)
from fastckpt.cli.render import (
    file_lines,
    metadata_text,
    mtime_iso,
    print_json,
    size_text,
    spec_text,
    tensor_table,
    when,
)
from fastckpt.cli.text import printable
from fastckpt.container.kinds import (
    Container,
    IndexContainer,
    KindVisitor,
    ManagerContainer,
    RootContainer,
    SavedContainer,
    ShardedContainer,
    TensorFile,
)
from fastckpt.container.links import split_sizes
from fastckpt.container.snapshot import read_consistently
from fastckpt.errors import FastCkptError
from fastckpt.format.records import (
    COMMIT_RECORD,
    MANIFEST,
    Manifest,
    read_commit_record,
    record_file,
)
from fastckpt.io import tree
from fastckpt.io.paths import safe_join
from fastckpt.io.progress import format_bytes
from fastckpt.storage.registry import display_path

if TYPE_CHECKING:
    import torch

# --------------------------------------------------------------------------- fastckpt inspect


def _describe_index(manifest: Manifest, index: int) -> dict[str, Any]:
    entry = manifest.entries[index]
    directory = manifest.root / str(index)
    listed = entry["files"]

    def document(relpath: str) -> Any:
        return read_document(safe_join(directory, relpath, within=manifest.root))

    files = []
    for relpath in sorted(listed):
        record = listed[relpath]
        item: dict[str, Any] = {
            "path": relpath,
            "size": record["size"],
            "crc32c": f"{record['crc32c']:08x}",
        }
        if relpath.endswith(TENSOR_SUFFIX):
            item.update(describe_tensor_file(safe_join(directory, relpath, within=manifest.root)))
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
        "root": display_path(manifest.root),
        "path": display_path(directory),
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
        **_sizes(listed),
        "files": files,
    }


def _sizes(files: Mapping[str, Mapping[str, Any]]) -> dict[str, int]:
    """``size`` and ``linked_size`` of a checkpoint's file records, as ``ls`` shows them."""
    size, linked_size = split_sizes(files)
    return {"size": size, "linked_size": linked_size}


def _size_line(info: Mapping[str, Any]) -> str:
    return f"{size_text(info['size'], info['linked_size'])} in {len(info['files'])} file(s)"


class _TensorRef:
    """Stands in for a tensor while walking a manager item's skeleton."""

    def __init__(self, name: str) -> None:
        self.name = name


class _Refs(dict[str, _TensorRef]):
    """A tensor mapping for :func:`fastckpt.io.tree.unflatten` that has every name (as a ref)."""

    def __init__(self) -> None:
        super().__init__()
        #: The tensor names the skeleton asked for (its tensors, wherever their bytes are).
        self.asked: set[str] = set()

    def __missing__(self, key: str) -> _TensorRef:
        self.asked.add(key)
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
    record = read_commit_record(directory)
    files = []
    for relpath in sorted(record["files"]):
        item: dict[str, Any] = {"path": relpath, "size": record["files"][relpath]["size"]}
        if relpath.endswith(TENSOR_SUFFIX):
            item.update(describe_tensor_file(safe_join(directory, relpath)))
        files.append(item)
    items = []
    for key in record["items"]:
        values: dict[str, Any] = {}
        skeleton_file = record_file(record, f"{key}.json")  # object stores: g-<hex>/...
        named = _Refs()
        if skeleton_file in record["files"]:
            stored = read_document(safe_join(directory, skeleton_file))
            skeleton = stored.get("skeleton") if isinstance(stored, dict) else None
            refs = cast("Mapping[str, torch.Tensor]", named)
            _leaves(tree.unflatten(skeleton, refs, str(key)), str(key), values)
        tensor_files = [
            f["path"]
            for f in files
            if f["path"] == record_file(record, f"{key}{TENSOR_SUFFIX}")
            or (
                f["path"].startswith(record_file(record, f"{key}.rank"))
                and f["path"].endswith(TENSOR_SUFFIX)
            )
        ]
        items.append(
            {
                "name": key,
                "values": values,
                "tensor_files": tensor_files,
                # every tensor the item holds, those an incremental save references included
                "tensors": len(named.asked),
            }
        )
    return {
        "kind": "manager",
        "path": display_path(directory),
        "committed": mtime_iso(directory / COMMIT_RECORD),
        "world_size": record.get("world_size", 1),
        "items": items,
        **_sizes(record["files"]),
        "files": files,
    }


def _describe_file(path: Path) -> dict[str, Any]:
    return {"kind": "file", "path": display_path(path), **describe_tensor_file(path)}


def _index_text(info: Mapping[str, Any]) -> str:
    latest = " (latest)" if info["latest"] else ""
    lines = [
        f"{info['path']}: index {info['index']}{latest} of save_checkpoint root {info['root']} "
        f"(committed: {', '.join(str(i) for i in info['indices'])})"
    ]
    fields: list[tuple[str, str]] = [("created", f"{when(info['created'])} UTC")]
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
            text = spec_text(spec, f"{kind}/{name}") if spec is not None else "(no spec)"
            fields.append((kind, f"{label}: {text}"))
    strategy = info["strategy"]
    if strategy is not None:
        run = f"num_steps={strategy.get('num_steps')} num_epochs={strategy.get('num_epochs')}"
        fn = strategy.get("training_fn")
        fields.append(("strategy", f"{strategy.get('strategy_cls')}  training_fn={fn}  {run}"))
    for hook in info["hooks"]:
        fields.append(("hook", f"{hook['class']} #{hook['occurrence']}"))
    fields.append(("size", _size_line(info)))
    width = max(len(label) for label, _ in fields)
    # Names, counters, specs: as the manifest and the index's documents hold them.
    lines += [f"{label.ljust(width)}  {printable(text)}" for label, text in fields]
    return "\n".join([*lines, "", *file_lines(info["files"])])


_MAX_VALUES = 8  # non-tensor values shown per manager item (all of them with --json)


def _manager_text(info: Mapping[str, Any]) -> str:
    lines = [
        f"{info['path']}: CheckpointManager checkpoint, {len(info['items'])} item(s), "
        f"world size {info['world_size']}",
        f"committed  {when(info['committed'])} UTC",
        f"size       {_size_line(info)}",
    ]
    counts = {f["path"]: len(f.get("tensors", [])) for f in info["files"]}
    for item in info["items"]:
        in_files = sum(counts.get(path, 0) for path in item["tensor_files"])
        # Under a process group each rank's file holds its own; else the skeleton counts all
        # (an incremental save's unchanged tensors live in linked files of earlier saves).
        tensors = in_files if info["world_size"] > 1 else item["tensors"]
        lines.append(f"item {printable(item['name'])}: {tensors} tensor(s)")
        shown = list(item["values"].items())
        lines += [f"  {printable(path)} = {value!r}" for path, value in shown[:_MAX_VALUES]]
        if len(shown) > _MAX_VALUES:
            lines.append(f"  ... {len(shown) - _MAX_VALUES} more value(s) (see --json)")
    return "\n".join([*lines, "", *file_lines(info["files"])])


def _file_text(info: Mapping[str, Any]) -> str:
    checks = "crc32c per tensor" if info["checksums"] else "no checksums (not written by fastckpt)"
    head = (
        f"{info['path']}: safetensors file, {format_bytes(info['size'])}, "
        f"{len(info['tensors'])} tensor(s), {format_bytes(info['tensor_bytes'])} of data, {checks}"
    )
    lines = [head]
    if info["metadata"]:
        lines.append(f"metadata: {metadata_text(info['metadata'])}")
    if info["tensors"]:
        lines.append(tensor_table(info["tensors"], ""))
    return "\n".join(lines)


#: A described container and how to show it as text.
_View = tuple[dict[str, Any], Callable[[Mapping[str, Any]], str]]


class _Describer(KindVisitor[_View]):
    """``fastckpt inspect`` of each kind of container: its description and its text view."""

    def __init__(self, index: int | None) -> None:
        self.requested = index

    def root(self, container: RootContainer) -> _View:
        return self._saved(container)

    def index(self, container: IndexContainer) -> _View:
        return self._saved(container)

    def manager(self, container: ManagerContainer) -> _View:
        return _describe_manager(container.path), _manager_text

    def sharded(self, container: ShardedContainer) -> _View:
        return sharded.describe(container.path), sharded.text

    def file(self, container: TensorFile) -> _View:
        return _describe_file(container.path), _file_text

    def _saved(self, container: SavedContainer) -> _View:
        def describe() -> dict[str, Any]:
            manifest, index = resolve_index(container, self.requested)
            return _describe_index(manifest, index)

        # An index another process replaces meanwhile: its files may vanish under the read.
        root = container.root
        return read_consistently(root / MANIFEST, describe, lock_root=root), _index_text


def cmd_inspect(args: argparse.Namespace) -> int:
    """``fastckpt inspect PATH [--index N]`` (a directory of manager checkpoints: its newest)."""
    children = manager_children(args.path)
    note = None
    if children:
        newest = children[-1]
        note = (
            f"newest of {len(children)} CheckpointManager checkpoint(s) in {args.path}: "
            f"{printable(newest.name)} (fastckpt ls {args.path} lists them)"
        )
        container: Container = locate(newest)  # a manager checkpoint, or of sharded state
    else:
        container = locate(args.path)
    no_index(container, args.index)
    try:
        info, text = container.accept(_Describer(args.index))
    except (OSError, FastCkptError) as err:
        raise UserError(
            f"{error_text(err)} (fastckpt verify {display_path(container.path)} checks every file)"
        ) from err
    if args.json:
        print_json(info if note is None else {**info, "selected": note})
    else:
        print(text(info) if note is None else f"{note}\n{text(info)}")
    return EXIT_OK
