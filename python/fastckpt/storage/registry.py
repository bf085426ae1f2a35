"""Which storage backend holds a path, by URL scheme: one table, :data:`SCHEMES`.

A path whose scheme is in the table (``s3://bucket/key``, also in its ``pathlib`` spelling
``s3:/bucket/key``) is stored by that scheme's backend; every other path is on the local
filesystem. A backend is a module with two functions, imported on first use:

* ``backend_for_url(url) -> StorageBackend`` - the backend for a URL of the scheme, with the
  options registered for its prefix;
* ``register_storage_options(url, options)`` - options for every path under ``url``
  (``None`` removes them);
* ``registered_options(url) -> dict | None`` - the options registered for ``url``'s prefix,
  as a mapping ``register_storage_options`` takes again (a process of its own, such as the
  detached promoter, is handed them).

It may also name the packages it imports on use, ``REQUIRES`` (import names), and the extra
that installs them, ``EXTRA``: a path of the scheme is refused with
:class:`~fastckpt.errors.MissingDependencyError` naming the ``pip install`` line while one is
missing.

Adding a store (obstore also speaks GCS and Azure) is one new module under
:mod:`fastckpt.storage` and one line in :data:`SCHEMES` (or a call of
:func:`register_scheme`); the front doors, the container and the CLI need nothing new.

Kept apart from :mod:`fastckpt.storage.backend` because the object-store backends build on
that module (dispatching there would be an import cycle).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from importlib.util import find_spec
from pathlib import Path
from types import ModuleType
from typing import Any

from fastckpt.errors import MissingDependencyError
from fastckpt.storage.backend import LOCAL, LocalFileSystem, StorageBackend

__all__ = [
    "SCHEMES",
    "absolute",
    "backend_for",
    "check_path_argument",
    "check_url_spelling",
    "checked_paths",
    "configure_storage",
    "display_path",
    "is_local",
    "is_object_url",
    "register_scheme",
    "require_local",
    "storage_options_of",
    "use_storage_options",
]

#: URL scheme -> the module of its backend (see the module docstring).
SCHEMES: dict[str, str] = {"s3": "fastckpt.storage.s3.backend"}


def register_scheme(scheme: str, module: str) -> None:
    """Store paths ``<scheme>://...`` with the backend module ``module`` (a dotted path,
    imported on first use; see the module docstring for the two functions it provides)."""
    if not scheme.isidentifier() or len(scheme) < 2:
        raise ValueError(f"register_scheme({scheme!r}): a scheme is a name of 2+ letters")
    SCHEMES[scheme] = module


def _scheme(path: str | os.PathLike[str]) -> str | None:
    """The registered scheme of ``path`` (``s3://x`` or ``s3:/x``), or None for a local path."""
    text = os.fspath(path)
    scheme, colon, rest = text.partition(":")
    if colon and rest.startswith("/") and scheme in SCHEMES:
        return scheme
    return None


def _backend_module(path: str | os.PathLike[str]) -> ModuleType:
    scheme = _scheme(path)
    if scheme is None:
        raise ValueError(f"{os.fspath(path)}: not a URL of a registered scheme ({sorted(SCHEMES)})")
    module = importlib.import_module(SCHEMES[scheme])  # deferred: the store's client library
    _check_requirements(scheme, module, path)
    return module


def _check_requirements(scheme: str, module: ModuleType, path: str | os.PathLike[str]) -> None:
    """Refuse a path whose backend needs packages that are not installed (the module's
    ``REQUIRES``, installed by the extra ``EXTRA``), before anything is read or written:
    without it, the first use failed deep inside with a bare ``ModuleNotFoundError``."""
    if module in _READY:  # checked once per backend module: not a lookup per call
        return
    missing = [name for name in getattr(module, "REQUIRES", ()) if not _installed(name)]
    if missing:
        extra = getattr(module, "EXTRA", scheme)
        raise MissingDependencyError(
            f"{_url(path)}: {scheme}:// paths need {' and '.join(missing)}, which "
            f"{'is' if len(missing) == 1 else 'are'} not installed: "
            f"pip install 'fastckpt-io[{extra}]'"
        )
    _READY.add(module)


#: backend modules whose ``REQUIRES`` were found installed
_READY: set[ModuleType] = set()


def _installed(name: str) -> bool:
    """Whether the top-level package ``name`` can be imported (a module placed in
    ``sys.modules`` without a spec, as some test doubles are, counts as installed)."""
    try:
        return find_spec(name) is not None
    except ValueError:  # in sys.modules with __spec__ None
        return True


def configure_storage(
    url: str, storage_options: Mapping[str, Any] | None = None, **options: Any
) -> None:
    """Set the object-store client options for every path under ``url`` (``s3://bucket`` or
    ``s3://bucket/prefix``): endpoint, region, credentials, part size, concurrency, timeouts
    (for ``s3://``, the fields of :class:`fastckpt.storage.s3.config.S3Options`). Fields left
    out are resolved from the standard AWS environment variables and config files, as without
    a call.

    The longest configured prefix of a path wins, so one prefix can override its bucket's
    settings. ``configure_storage(url)`` with no options removes the setting.

    Example::

        fastckpt.configure_storage(
            "s3://ckpts", endpoint_url="http://127.0.0.1:9000", region="us-east-1"
        )

    Raises:
        ValueError: ``url`` is not an ``s3://`` URL, or an option is out of range.
        TypeError: an unknown option (the message lists the valid ones), or
            ``storage_options`` that is neither a mapping nor None.
    """
    if not is_object_url(url):
        schemes = ", ".join(f"{scheme}://" for scheme in sorted(SCHEMES))
        raise ValueError(f"configure_storage({url!r}): only {schemes} URLs take storage options")
    # A list (configure_storage(url, [])) was taken as "no options": the setting removed.
    if storage_options is not None and not isinstance(storage_options, Mapping):
        raise TypeError(
            f"configure_storage({url!r}): storage_options must be a mapping of option -> "
            f"value or None, got {type(storage_options).__name__} {storage_options!r}; pass "
            "them as keywords (configure_storage(url, region='...')) or as a dict"
        )
    merged = {**(storage_options or {}), **options}
    _backend_module(url).register_storage_options(_url(url), merged or None)


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
    check_path_argument(path, what)
    check_url_spelling(path)
    if storage_options is None:
        return
    if not is_object_url(path):
        from fastckpt.storage.s3.errors import StorageOptionsError

        raise StorageOptionsError(
            f"{os.fspath(path)}: {what}(storage_options=...) configures object storage, but "
            "this is a local path; drop storage_options or use an s3:// URL"
        )
    configure_storage(_url(path), storage_options)


def check_path_argument(path: Any, what: str) -> None:
    """Refuse what a front door (``what``) cannot take for a checkpoint's path: not a ``str``
    or ``os.PathLike`` (``None``, an int, a list, bytes), or the empty string, which
    ``pathlib`` reads as the current directory: a setting left unset
    (``os.environ.get("CKPT_DIR", "")``) saved into, listed and pruned wherever the job ran.

    Raises:
        TypeError: not a path (names the type and ``what``).
        ValueError: the empty string (names ``what`` and the fix).
    """
    if isinstance(path, bytes) or not isinstance(path, (str, os.PathLike)):
        raise TypeError(
            f"{what}: the checkpoint path must be a str or os.PathLike, got "
            f"{type(path).__name__} {path!r}"
        )
    if isinstance(path, str) and not path:
        raise ValueError(
            f"{what}: the checkpoint path is empty, which would mean the current directory "
            "(a setting left unset?); give the folder by name ('.' for the current one)"
        )


def checked_paths(paths: Any, argument: str, what: str) -> list[str | os.PathLike[str]]:
    """``paths`` (a front door's list of roots, such as ``fallback_dirs``) as a list, each
    checked by :func:`check_path_argument`; None is no roots.

    Raises:
        TypeError: one path given as a string or path instead of a list of them (a string
            was taken character by character: ``fallback_dirs="/data/ckpt"`` made ``/``,
            ``d``, ``a``... fallback roots, and a folder named like one in the working
            directory was loaded), or anything else not a list of paths.
        ValueError: an empty path among them.
    """
    if paths is None:
        return []
    if isinstance(paths, (str, bytes, os.PathLike)):
        raise TypeError(
            f"{what}: {argument} must be a list of paths, got one {type(paths).__name__} "
            f"{paths!r}; for one root write {argument}=[{paths!r}]"
        )
    try:
        roots = list(paths)
    except TypeError:
        raise TypeError(
            f"{what}: {argument} must be a list of paths, got {type(paths).__name__}"
        ) from None
    for root in roots:
        check_path_argument(root, f"{what} ({argument})")
    return roots


def check_url_spelling(path: str | os.PathLike[str]) -> None:
    """Refuse an object-store URL as a front door was given it (``s3://b/run//x/./y``) when
    its key has an empty, ``.`` or ``..`` segment: paths are handled as ``pathlib`` paths,
    which would collapse it (to ``run/x/y``), so the checkpoint would not be under the key
    the caller named, and only some routes noticed. Local paths and ``pathlib`` spellings
    (already collapsed) pass.

    Raises:
        ValueError: naming the URL and a valid spelling.
    """
    if not isinstance(path, str) or "://" not in path or not is_object_url(path):
        return
    scheme, _, rest = path.partition("://")
    bucket, _, key = rest.partition("/")
    parts = key.rstrip("/").split("/")  # a trailing "/" is a folder's spelling
    if key.rstrip("/") and any(part in ("", ".", "..") for part in parts):
        clean = "/".join(part for part in parts if part not in ("", ".", ".."))
        raise ValueError(
            f"{path!r}: the key has an empty, '.' or '..' segment, which would be collapsed "
            f"(the checkpoint would not be where you named it); use {scheme}://{bucket}/{clean}"
        )


def storage_options_of(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The object-store options in effect for ``path`` from :func:`configure_storage` (or a
    front door's ``storage_options=``), as a mapping ``configure_storage`` takes; None for a
    local path or when none are registered (the store's environment applies)."""
    if not is_object_url(path):
        return None
    options: dict[str, Any] | None = _backend_module(path).registered_options(_url(path))
    return options


def _url(path: str | os.PathLike[str]) -> str:
    """``s3://bucket/key`` for either spelling (``s3:/bucket/key`` from ``pathlib``)."""
    scheme, _, rest = os.fspath(path).partition(":")
    return f"{scheme}://" + rest.lstrip("/")


def display_path(path: str | os.PathLike[str]) -> str:
    """``path`` as users write it: ``s3://bucket/key`` for an object-store URL (``pathlib``
    collapses it to ``s3:/bucket/key``), the path itself otherwise."""
    return _url(path) if is_object_url(path) else os.fspath(path)


def absolute(path: str | os.PathLike[str]) -> Path:
    """``path`` as a ``Path`` that no later ``os.chdir`` changes: a local path made absolute
    against the current directory now (a save written in the background goes where its
    caller named it, not where the process is by then); an object-store URL as it is."""
    # Not abspath: it drops ``..`` as text, where the kernel goes up from a symlink's target.
    return Path(path) if is_object_url(path) else Path(path).absolute()


def is_object_url(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a URL of a registered scheme (``s3://...`` or ``s3:/...``)."""
    return _scheme(path) is not None


def backend_for(path: str | os.PathLike[str]) -> StorageBackend:
    """The backend that stores ``path``: its scheme's (with the options registered for its
    prefix with :func:`fastckpt.configure_storage`, else the store's environment and config),
    or the local filesystem."""
    if is_object_url(path):
        backend: StorageBackend = _backend_module(path).backend_for_url(os.fspath(path))
        return backend
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
