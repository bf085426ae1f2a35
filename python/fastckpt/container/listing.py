"""The committed indices of a ``save_checkpoint`` root, read from its manifest alone.

Listing needs neither torch nor the tensor files (``fastckpt ls`` starts without importing
torch); :func:`fastckpt.list_checkpoints` is this function.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from fastckpt.container.links import split_sizes
from fastckpt.format.records import Manifest
from fastckpt.storage.registry import use_storage_options

__all__ = ["list_checkpoints"]


def list_checkpoints(
    root: str | os.PathLike[str], *, storage_options: Mapping[str, Any] | None = None
) -> list[dict[str, Any]]:
    """Committed indices of a root, oldest first.

    Args:
        root: checkpoint root.
        storage_options: object-store client options for an ``s3://`` root (endpoint_url,
            region, access_key_id, ... as for :func:`fastckpt.configure_storage`), over the
            AWS environment; they are registered for ``root``'s prefix (as
            ``configure_storage(root, storage_options)``) and stay in effect for it. A local
            ``root`` refuses them (``StorageOptionsError``).

    Returns:
        One dict per index: ``index``, ``created``, ``size`` (the bytes its save wrote),
        ``linked_size`` (the bytes of unchanged tensors' files it holds as hard links to an
        earlier index's, written by that one), ``counters``, ``components``, ``latest``
        (bool).

    Raises:
        CheckpointFormatError / ChecksumMismatchError: the manifest is damaged (the same
            checks as :func:`load_checkpoint`, its own crc32c included).
    """
    use_storage_options(root, storage_options, "list_checkpoints")
    manifest = Manifest.load(root, verify_checksum=True)
    rows = []
    for index, entry in sorted(manifest.entries.items()):
        written, linked = split_sizes(entry["files"])
        rows.append(
            {
                "index": index,
                "created": entry.get("created"),
                "size": written,
                "linked_size": linked,
                "counters": entry.get("counters", {}),
                "components": entry.get("components", {}),
                "latest": index == manifest.latest,
            }
        )
    return rows
