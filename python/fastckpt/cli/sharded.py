"""Sharded (DCP) checkpoints in the commands: a listing row, the inspect view, the export.

Everything here reads through :mod:`fastckpt.dcp` without a process group: the commit record
(``fastckpt-dcp.json``) for the listing and the view, every rank's chunks for the export.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fastckpt.cli.common import UserError
from fastckpt.cli.render import mtime_iso, table
from fastckpt.cli.text import printable
from fastckpt.format.records import SHARDED_DIR, SHARDED_RECORD, Manifest
from fastckpt.io.progress import format_bytes
from fastckpt.storage.registry import display_path

__all__ = ["describe", "export", "listing_row", "strategy_part", "text"]


def describe(directory: Path) -> dict[str, Any]:
    """``fastckpt inspect`` of a sharded checkpoint: record, tensors (global shapes, chunks)."""
    from fastckpt.dcp import describe_sharded

    info = describe_sharded(directory)
    return {
        "kind": "sharded",
        "path": display_path(directory),
        "committed": mtime_iso(directory / SHARDED_RECORD),
        "generation": info["generation"],
        "uncommitted": info["uncommitted"],
        "size": sum(int(entry["size"] or 0) for entry in info["files"].values()),
        "files": info["files"],
        "tensors": info["tensors"],
        "values": info["values"],
    }


def text(info: Mapping[str, Any]) -> str:
    """The inspect view as text."""
    head = (
        f"{info['path']}: sharded checkpoint (DCP), generation {info['generation']}, "
        f"{len(info['files'])} file(s), {format_bytes(info['size'])}, committed "
        f"{info['committed'] or '?'}"
    )
    rows = [
        (fqn, entry["dtype"], entry["shape"], entry["chunks"])
        for fqn, entry in sorted(info["tensors"].items())
    ]
    lines = [head, table(["TENSOR", "DTYPE", "GLOBAL SHAPE", "CHUNKS"], rows)]
    if info["values"]:
        lines.append("values: " + ", ".join(printable(name) for name in info["values"]))
    if info["uncommitted"]:
        lines.append(
            "uncommitted generations (an interrupted save; the next save removes them): "
            + ", ".join(printable(name) for name in info["uncommitted"])
        )
    return "\n".join(lines)


def listing_row(directory: Path) -> dict[str, Any]:
    """A ``fastckpt ls`` row for a sharded checkpoint among manager checkpoints."""
    info = describe(directory)
    items = sorted({fqn.split(".", 1)[0] for fqn in [*info["tensors"], *info["values"]]})
    return {
        "name": directory.name,
        "path": display_path(directory),
        "committed": info["committed"],
        "size": info["size"],
        "linked_size": 0,
        "items": items,
        "sharded": True,
    }


def strategy_part(manifest: Manifest, index: int) -> Path | None:
    """The sharded part of a strategy index (FSDP2 models), if it has one: the part its
    strategy.json names (see :mod:`fastckpt.container.sharded.parts`)."""
    from fastckpt.container.sharded.parts import committed_part

    if not (manifest.root / SHARDED_DIR).is_dir():
        return None
    part = committed_part(manifest, index)
    return None if part is None else part.path


def export(directory: Path, out: Path, prefix: str | None = None) -> int:
    """Consolidate ``directory`` into the safetensors file ``out`` (full tensors, no process
    group); with ``prefix``, only the tensors under it, named without it. Returns the number of
    tensors written."""
    # deferred: torch.distributed.checkpoint, for export only
    from fastckpt.container.sharded.consolidate import consolidate
    from fastckpt.io.files import load_file, write_tensors  # deferred: torch, for export only

    if prefix is None:
        return int(consolidate(directory, out)["tensors"])
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".tmp-export-") as scratch:
        whole = Path(scratch) / "all.safetensors"
        consolidate(directory, whole)
        tensors = {
            name.removeprefix(prefix): tensor
            for name, tensor in load_file(whole, backend="pread").items()
            if name.startswith(prefix)
        }
        if not tensors:
            raise UserError(f"{directory} holds no tensor under {prefix!r}")
        write_tensors(tensors, out, metadata={"format": "pt", "fastckpt.source": str(directory)})
    return len(tensors)
