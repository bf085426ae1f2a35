"""Which storage backend holds a path: object storage for ``s3://`` URLs (also in their
``pathlib`` spelling ``s3:/...``), the local filesystem for everything else.

Kept apart from :mod:`fastckpt.store.backend` because the object-store backend builds on that
module (dispatching there would be an import cycle).
"""

from __future__ import annotations

import os

from fastckpt.store.backend import LOCAL, LocalFileSystem, StorageBackend

__all__ = ["backend_for", "is_local", "is_object_url"]


def is_object_url(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is an object-store URL (``s3://...`` or ``s3:/...``)."""
    return os.fspath(path).startswith("s3:/")


def backend_for(path: str | os.PathLike[str]) -> StorageBackend:
    """The backend that stores ``path`` (for ``s3://``: the options registered for its
    prefix with :func:`fastckpt.configure_storage`, else the AWS environment and config)."""
    if is_object_url(path):
        from fastckpt.store.s3backend import backend_for_url

        return backend_for_url(os.fspath(path))
    return LOCAL


def is_local(backend: StorageBackend) -> bool:
    """Whether ``backend`` is the local filesystem (rename, directories, fsync)."""
    return isinstance(backend, LocalFileSystem)
