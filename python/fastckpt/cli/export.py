"""``fastckpt export PATH --to FILE``: one model's weights as a plain safetensors file."""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from fastckpt._moved_paths import current_path
from fastckpt.checkpoint.components import IndexReader
from fastckpt.cli import sharded
from fastckpt.cli.common import (
    CHECKPOINT_RECORDS,
    EXIT_OK,
    TENSOR_SUFFIX,
    UserError,
    enclosing_checkpoint,
    locate,
    no_index,
    resolve_index,
)
from fastckpt.cli.render import (
    counted_progress,
    print_json,
)
from fastckpt.cli.text import printable
from fastckpt.container.kinds import (
    IndexContainer,
    KindVisitor,
    ManagerContainer,
    RootContainer,
    SavedContainer,
    ShardedContainer,
    TensorFile,
)
from fastckpt.container.links import read_item, read_references
from fastckpt.errors import FastCkptError
from fastckpt.format.records import Manifest, item_files, read_commit_record
from fastckpt.io import tree
from fastckpt.io.files import write_tensors
from fastckpt.io.paths import is_ascii_decimal
from fastckpt.io.progress import format_bytes
from fastckpt.storage.backend import explain_full_disk
from fastckpt.storage.registry import backend_for

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


def _manager_plan(directory: Path, model: str | None) -> _Export:
    """One item of a CheckpointManager checkpoint (``model`` by default)."""
    record = read_commit_record(directory)
    items = [str(key) for key in record["items"]]
    preferred = "model" if model is None and "model" in items else model
    key = _pick(items, preferred, "item", directory)
    relpath = item_files(record, key)[1]
    size = record["files"].get(relpath, {"size": 0})["size"]
    # An incremental checkpoint's unchanged tensors are in its linked files.
    linked = read_references(record, str(directory)).get(relpath, {})
    size += sum(ref["nbytes"] for ref in linked.values())
    return _Export(
        lambda: _manager_item_tensors(directory, key),
        size,
        {"fastckpt.source": str(directory), "fastckpt.item": key},
    )


def _index_plan(manifest: Manifest, chosen: int, model: str | None) -> _Export:
    """One model (or ``--model ema``: the EMA weights) of a save_checkpoint index."""
    entry = manifest.entries[chosen]
    names = [str(n) for n in entry.get("components", {}).get("models", [])]
    if model is not None and model.startswith(EMA) and model not in names:
        return _ema_plan(manifest, chosen, model)
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


def _sharded_models(manifest: Manifest, index: int) -> list[str]:
    """The FSDP2 models a strategy index keeps in its sharded part."""
    reader = IndexReader(manifest, index)
    recipe = reader.json("strategy.json") if "strategy.json" in reader.files else {}
    models = recipe.get("sharded", {}).get("models", {}) if isinstance(recipe, dict) else {}
    return [str(name) for name in models] if isinstance(models, dict) else []


def _export_sharded(args: argparse.Namespace, source: Path, out: Path, prefix: str | None) -> int:
    """Consolidate a sharded checkpoint (or one model of a strategy's sharded part)."""
    count = sharded.export(source, out, prefix)
    size = out.stat().st_size
    summary = {"source": str(source), "to": str(out), "tensors": count, "bytes": size}
    if args.json:
        print_json(summary)
    else:
        print(
            f"wrote {out}: {count} tensor(s), {format_bytes(size)} (consolidated "
            f"from the sharded checkpoint {source})"
        )
    return EXIT_OK


EMA = "ema"
_EMA_CLASS = "fastckpt.training.hooks.ema.EMAHook"
_HOOKS_JSON, _HOOKS_TENSORS = "hooks.json", "hooks.safetensors"


def _ema_plan(manifest: Manifest, index: int, model: str) -> _Export:
    """``--model ema`` (``ema1``, ... for a second EMAHook): the averaged weights an EMAHook
    saved with a strategy checkpoint, named like the model's parameters."""
    where = manifest.root / str(index)
    occurrence_text = model.removeprefix(EMA) or "0"
    if not is_ascii_decimal(occurrence_text):
        raise UserError(f"--model {model}: write 'ema' (or 'ema1' for a second EMAHook)")
    occurrence = int(occurrence_text)
    reader = IndexReader(manifest, index)
    if _HOOKS_JSON not in reader.files:
        raise UserError(f"{where} holds no hook states, so no EMA weights")
    document = reader.json(_HOOKS_JSON)
    skeleton = document.get("hooks", []) if isinstance(document, dict) else []
    emas = [
        i
        for i, hook in enumerate(skeleton)
        if isinstance(hook, dict)
        and isinstance(hook.get("class"), str)
        and current_path(hook["class"]) == _EMA_CLASS
    ]
    if occurrence >= len(emas):
        raise UserError(
            f"{where} has {len(emas)} EMAHook state(s); --model {model} needs {occurrence + 1}"
        )
    size = reader.files.get(_HOOKS_TENSORS, {"size": 0})["size"]

    def load() -> dict[str, torch.Tensor]:
        hooks = tree.unflatten(skeleton, reader.tensors(_HOOKS_TENSORS), "hooks")
        state = hooks[emas[occurrence]]["state"]
        return {str(name): tensor for name, tensor in dict(state["shadow"]).items()}

    state_skeleton = skeleton[emas[occurrence]].get("state")
    ema_of = state_skeleton.get("model_key") if isinstance(state_skeleton, dict) else None
    return _Export(
        load,
        size,
        {
            "fastckpt.source": str(manifest.root),
            "fastckpt.index": str(index),
            "fastckpt.model": model,
            "fastckpt.ema_of": str(ema_of),
        },
    )


def _manager_item_tensors(directory: Path, key: str) -> dict[str, torch.Tensor]:
    """The tensors of one CheckpointManager item, named by their key paths (verified)."""
    skeleton, tensors = read_item(directory, read_commit_record(directory), key)
    return tree.flatten(tree.unflatten(skeleton, tensors, key))[1]


class _Exporter(KindVisitor[int]):
    """``fastckpt export`` of each kind of container; each method returns the exit status."""

    def __init__(self, args: argparse.Namespace, out: Path) -> None:
        self.args = args
        self.out = out

    def sharded(self, container: ShardedContainer) -> int:
        # --model NAME: the tensors under the state dict's top-level key NAME (before, the
        # option was ignored and every tensor, optimizer state included, was written).
        prefix = None if self.args.model is None else f"{self.args.model}."
        return _export_sharded(self.args, container.path, self.out, prefix)

    def root(self, container: RootContainer) -> int:
        return self._saved(container)

    def index(self, container: IndexContainer) -> int:
        return self._saved(container)

    def manager(self, container: ManagerContainer) -> int:
        return _write(
            self.args, container.path, self.out, _manager_plan(container.path, self.args.model)
        )

    def file(self, container: TensorFile) -> int:
        try:
            backend_for(container.path).read_header(container.path)
        except (OSError, FastCkptError):
            raise UserError(
                f"{container.path} is not a fastckpt checkpoint nor a safetensors file "
                "(fastckpt inspect says what it is); nothing to export"
            ) from None
        raise UserError(f"{container.path} is already a single safetensors file")

    def _saved(self, container: SavedContainer) -> int:
        args = self.args
        manifest, chosen = resolve_index(container, args.index)
        part = sharded.strategy_part(manifest, chosen)
        if part is not None and (args.model is None or not args.model.startswith(EMA)):
            name = _pick(_sharded_models(manifest, chosen), args.model, "model", part)
            return _export_sharded(args, part, self.out, f"models.{name}.")
        return _write(args, container.path, self.out, _index_plan(manifest, chosen, args.model))


def _write(args: argparse.Namespace, source: Path, out: Path, plan: _Export) -> int:
    """Write what ``plan`` loads to ``out`` and say so."""
    # The bar counts the bytes the Rust writer writes (the read before it maps the file).
    with counted_progress(f"export {source}", plan.size) as counter:
        tensors = plan.load()
        if not tensors:
            what = ", ".join(f"{k.removeprefix('fastckpt.')} {v}" for k, v in plan.metadata.items())
            raise UserError(
                f"{what} holds no tensors: there is nothing to export (pick another with --model)"
            )
        write_tensors(tensors, out, metadata={"format": "pt", **plan.metadata}, progress=counter)
    size = out.stat().st_size
    summary = {
        "source": str(source),
        "to": str(out),
        "tensors": len(tensors),
        "bytes": size,
        "metadata": plan.metadata,
    }
    if args.json:
        print_json(summary)
    else:
        origin = ", ".join(f"{k.removeprefix('fastckpt.')} {v}" for k, v in plan.metadata.items())
        print(f"wrote {out}: {len(tensors)} tensor(s), {format_bytes(size)} ({printable(origin)})")
    return EXIT_OK


def refuse_inside_checkpoint(out: Path) -> None:
    """Refuse an export target inside a checkpoint (:func:`enclosing_checkpoint`): writing
    there would replace a committed file or record (``--force``), or leave a file a later
    save replaces or trips over (``ROOT/3``). ``--force`` only replaces an earlier export.

    Raises:
        UserError: names the target, the checkpoint and the record that makes it one.
    """
    resolved = Path(os.path.realpath(out))
    shown = str(out) if resolved == out else f"{out} (that is {resolved})"
    found = enclosing_checkpoint(resolved)
    if found is not None:
        directory, record = found
        raise UserError(
            f"--to {shown} is inside the checkpoint {directory} (it holds {record}); export "
            "never writes into a checkpoint (--force only replaces an earlier export): export "
            "to a file outside checkpoints"
        )
    if resolved.name in CHECKPOINT_RECORDS:
        raise UserError(
            f"--to {shown} is named like a checkpoint's record ({resolved.name}): it would make "
            f"{resolved.parent} look like a checkpoint; export to a file outside checkpoints, "
            "under another name"
        )


def cmd_export(args: argparse.Namespace) -> int:
    """``fastckpt export PATH [--index N] --to OUT [--model NAME] [--force]``."""
    container = locate(args.path)
    no_index(container, args.index)
    out = Path(args.to)
    refuse_inside_checkpoint(out)
    if out.is_dir():
        raise UserError(f"{out} is a directory; --to names the file to write")
    if not out.parent.is_dir():
        raise UserError(
            f"--to {out}: its folder {out.parent} does not exist (or is not a folder); "
            "create it first or export into an existing folder"
        )
    if out.exists() and not args.force:
        raise UserError(f"{out} already exists; pass --force to replace it")
    # A full disk: the target named, not the writer's hidden temporary file (before: the
    # bare "No space left on device (os error 28)"); the file is written whole or not at all.
    with explain_full_disk(
        out,
        doing="exporting to",
        kept=f"nothing was written ({out} is as it was)",
        again="export",
        filename=str(out),
    ):
        return container.accept(_Exporter(args, out))
