"""Which storage backend holds a path: object storage for ``s3://`` URLs (also in their
``pathlib`` spelling ``s3:/...``), the local filesystem for everything else.

Kept apart from :mod:`fastckpt.storage.backend` because the object-store backend builds on that
module (dispatching there would be an import cycle).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from fastckpt.storage.backend import LOCAL, LocalFileSystem, StorageBackend

__all__ = [
    "backend_for",
    "configure_storage",
    "display_path",
    "is_local",
    "is_object_url",
    "require_local",
    "use_storage_options",
]


def configure_storage(
    url: str, storage_options: Mapping[str, Any] | None = None, **options: Any
) -> None:
    """Set the object-store client options for every path under ``url`` (``s3://bucket`` or
    ``s3://bucket/prefix``): endpoint, region, credentials, part size, concurrency, timeouts
    (the fields of :class:`fastckpt.storage.s3.config.S3Options`). Fields left out are resolved
    from the standard AWS environment variables and config files, as without a call.

    The longest configured prefix of a path wins, so one prefix can override its bucket's
    settings. ``configure_storage(url)`` with no options removes the setting.

    Example::

        fastckpt.storage.registry.configure_storage(
            "s3://ckpts", endpoint_url="http://127.0.0.1:9000", region="us-east-1"
        )

    Raises:
        ValueError: ``url`` is not an ``s3://`` URL, or an option is out of range.
        TypeError: an unknown option (the message lists the valid ones).
    """
    from fastckpt.storage.s3.backend import register_storage_options

    if not is_object_url(url):
        raise ValueError(f"configure_storage({url!r}): only s3:// URLs take storage options")
    merged = {**(storage_options or {}), **options}
    register_storage_options(url, merged or None)


def use_storage_options(
    path: str | os.PathLike[str], storage_options: Mapping[str, Any] | None, what: str
) -> None:
    """Apply the ``storage_options=`` a front door (``what``, e.g. ``save_checkpoint``) was
    given for ``path``: they are registered for ``path``'s prefix exactly as
    :func:`configure_storage` would, so every backend opened under ``path`` (in this call and
    in background saves it starts) uses them; they stay in effect for that prefix afterwards,
    until replaced (by another call's options or ``configure_storage``). None does nothing.

    Raises:
        StorageOptionsError: options given for a local path (they configure object stores).
        TypeError / ValueError: an unknown option or a value out of range.
    """
    if storage_options is None:
        return
    if not is_object_url(path):
        from fastckpt.storage.s3.errors import StorageOptionsError

        raise StorageOptionsError(
            f"{os.fspath(path)}: {what}(storage_options=...) configures object storage, but "
            "this is a local path; drop storage_options or use an s3:// URL"
        )
    configure_storage(_url(path), storage_options)


def _url(path: str | os.PathLike[str]) -> str:
    """``s3://bucket/key`` for either spelling (``s3:/bucket/key`` from ``pathlib``)."""
    return "s3://" + os.fspath(path)[len("s3:/") :].lstrip("/")


def display_path(path: str | os.PathLike[str]) -> str:
    """``path`` as users write it: ``s3://bucket/key`` for an object-store URL (``pathlib``
    collapses it to ``s3:/bucket/key``), the path itself otherwise."""
    return _url(path) if is_object_url(path) else os.fspath(path)


def is_object_url(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is an object-store URL (``s3://...`` or ``s3:/...``)."""
    return os.fspath(path).startswith("s3:/")


def backend_for(path: str | os.PathLike[str]) -> StorageBackend:
    """The backend that stores ``path`` (for ``s3://``: the options registered for its
    prefix with :func:`fastckpt.configure_storage`, else the AWS environment and config)."""
    if is_object_url(path):
        from fastckpt.storage.s3.backend import backend_for_url

        return backend_for_url(os.fspath(path))
    return LOCAL


def require_local(path: str | os.PathLike[str], what: str, instead: str) -> None:
    """Refuse an object-store URL for a feature that writes through a filesystem (so it never
    lands in a local directory named ``s3:``).

    Raises:
        UnsupportedOnObjectStoreError: ``path`` is an ``s3://`` URL; the message names it,
            ``what`` refused it and ``instead`` (what to use).
    """
    if is_object_url(path):
        from fastckpt.storage.s3.errors import UnsupportedOnObjectStoreError

        url = _url(path)
        raise UnsupportedOnObjectStoreError(
            f"{url}: {what} needs a filesystem path, not object storage; {instead}"
        )


def is_local(backend: StorageBackend) -> bool:
    """Whether ``backend`` is the local filesystem (rename, directories, fsync)."""
    return isinstance(backend, LocalFileSystem)
