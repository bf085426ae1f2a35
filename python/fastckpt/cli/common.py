"""What every command shares: exit statuses, user errors, and finding the checkpoint a PATH
names.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fastckpt.cli.status import EXIT_BAD, EXIT_ERROR, EXIT_OK, EXIT_UNCHECKED, UserError
from fastckpt.container.kinds import Container, SavedContainer, open_container
from fastckpt.container.listing import committed_checkpoints
from fastckpt.container.snapshot import read_consistently
from fastckpt.format.records import (
    COMMIT_RECORD,
    MANIFEST,
    SHARDED_RECORD,
    Manifest,
    load_json,
)
from fastckpt.storage.registry import backend_for, is_local

__all__ = ["EXIT_BAD", "EXIT_ERROR", "EXIT_OK", "EXIT_UNCHECKED", "UserError", "locate"]

TENSOR_SUFFIX = ".safetensors"


def one_line(text: str) -> str:
    """The non-empty lines of ``text`` joined into one."""
    return "; ".join(part.strip() for part in text.splitlines() if part.strip())


def error_text(err: BaseException) -> str:
    """A one-line message for an exception (OSError without the ``[Errno N]`` noise)."""
    if isinstance(err, OSError) and err.strerror:
        message = err.strerror
        if err.filename is not None and str(err.filename) not in message:
            message = f"{err.filename}: {message}"
        return one_line(message)
    if isinstance(err, KeyError) and err.args:
        return one_line(str(err.args[0]))
    return one_line(str(err) or type(err).__name__)


# --------------------------------------------------------------------------- locating checkpoints


def locate(text: str | os.PathLike[str]) -> Container:
    """The container (of its kind, :mod:`fastckpt.container.kinds`) ``text`` names.

    Raises:
        UserError: it does not exist or is not a fastckpt checkpoint.
    """
    try:
        return open_container(text)
    except FileNotFoundError as err:
        raise UserError(err.strerror) from None


def manager_children(text: str | os.PathLike[str]) -> list[Path]:
    """The CheckpointManager checkpoints directly inside ``text`` (what ``fastckpt ls`` lists
    there; of sharded state too), oldest first as the manager orders them
    (:func:`fastckpt.container.listing.committed_checkpoints`); empty when ``text`` is itself
    a checkpoint or no local directory."""
    path = Path(text)
    backend = backend_for(path)
    local = is_local(backend)
    if local and not path.is_dir():
        return []
    if any(backend.exists(path / r) for r in (MANIFEST, COMMIT_RECORD, SHARDED_RECORD)):
        return []
    # Inside a save_checkpoint root (an index directory, ROOT/sharded, ROOT/sharded/<i>
    # whose parts each hold a sharded record): the root's, not a directory of checkpoints.
    # (On an object store, nothing above the bucket.)
    above = [p for p in (path.parent, path.parent.parent) if local or len(p.parts) > 1]
    if any(backend.exists(p / MANIFEST) for p in above):
        return []
    return [path / name for name in committed_checkpoints(path)]


#: The records whose directory is a checkpoint: a save_checkpoint root, a CheckpointManager
#: checkpoint, a sharded (DCP) checkpoint.
CHECKPOINT_RECORDS = (MANIFEST, COMMIT_RECORD, SHARDED_RECORD)


def enclosing_checkpoint(path: str | os.PathLike[str]) -> tuple[Path, str] | None:
    """``(directory, record)`` when the local ``path``, resolved (symlinks and a relative
    path: :func:`os.path.realpath`), is inside a checkpoint: the nearest directory above it,
    up to the filesystem root, that holds one of :data:`CHECKPOINT_RECORDS` (at any depth: a
    file of an index, of a linked folder, of a root's sharded part; the record itself), and
    that record. None: outside every checkpoint."""
    resolved = Path(os.path.realpath(path))
    for directory in resolved.parents:
        for record in CHECKPOINT_RECORDS:
            if os.path.lexists(directory / record):
                return directory, record
    return None


def needs_root(container: Container) -> UserError:
    """The error for a container that is not a save_checkpoint root or one of its indices, where
    the command needs one."""
    return UserError(
        f"{container.path} is a {container.name}; this needs a save_checkpoint root or one of "
        "its index directories"
    )


def resolve_index(container: Container, requested: int | None) -> tuple[Manifest, int]:
    """The manifest and the committed index a root/index container (plus ``--index``) means.

    The manifest is checked as every load checks it (its own crc32c too: a hand-edited one is
    refused, not acted on), and read under
    :func:`~fastckpt.container.snapshot.read_consistently`: an index another process is
    replacing (withdrawn from the manifest meanwhile) is waited for, not reported missing.

    Raises:
        UserError: not a root or index, empty root, index not committed or contradictory.
        CheckpointFormatError / ChecksumMismatchError: the manifest is damaged or edited.
    """
    if not isinstance(container, SavedContainer):
        raise needs_root(container)
    own = container.own_index
    if own is not None and requested is not None and requested not in (-1, own):
        raise UserError(f"{container.path} is index {own}; --index {requested} contradicts it")
    wanted = own if own is not None else -1 if requested is None else requested

    def read() -> tuple[Manifest, int]:
        # KeyError (an index missing, maybe for the moment of a replacement) is retried.
        manifest = Manifest.load(container.root, verify_checksum=True)
        if own is not None and own not in manifest.entries:
            raise KeyError(
                f"{container.path}: index {own} is not committed in {container.root / MANIFEST} "
                f"(committed: {sorted(manifest.entries)}); it may be a leftover of a crash"
            )
        if not manifest.entries:
            raise KeyError(f"{container.root}: no committed checkpoint yet")
        return manifest, manifest.resolve(wanted)

    try:
        return read_consistently(container.root / MANIFEST, read, lock_root=container.root)
    except KeyError as err:
        raise UserError(error_text(err)) from None


def no_index(container: Container, requested: int | None) -> None:
    """Refuse ``--index`` for anything but a root or one of its indices."""
    if requested is not None and not container.takes_index:
        raise UserError(
            f"{container.path} is a {container.name}; --index only applies to a "
            "save_checkpoint root"
        )


def read_document(path: Path) -> Any:
    """A JSON document of a checkpoint, parsed by the store (not checked against a record:
    ``fastckpt verify`` does that)."""
    return load_json(path, backend_for(path).read_bytes(path))


def _tensor_list(header: Mapping[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for name, info in header["tensors"].items():
        start, end = info["data_offsets"]
        rows.append(
            {"name": name, "dtype": info["dtype"], "shape": info["shape"], "bytes": end - start}
        )
    return rows


def describe_tensor_file(path: Path) -> dict[str, Any]:
    """Size, tensors, checksum presence and metadata of a safetensors file (header only)."""
    header = backend_for(path).read_header(path)
    tensors = _tensor_list(header)
    return {
        "size": header["file_len"],
        "tensors": tensors,
        "tensor_bytes": sum(t["bytes"] for t in tensors),
        "checksums": all(i["crc32c"] is not None for i in header["tensors"].values()),
        "metadata": header["metadata"],
    }
