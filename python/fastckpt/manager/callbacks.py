"""The callbacks a :class:`~fastckpt.CheckpointManager` calls around a commit.

``Config.pre_finalize_callback`` and ``Config.finalize_callback`` take either form that
torch_checkpointing's users write:

* ``fn(args)``: one argument, a :class:`CallbackArgs` (``path``, ``storage``,
  ``event_logger``), as torch_checkpointing 0.1.1 calls them;
* ``fn(checkpoint_id, logger)``: two arguments, as its earlier releases (and fastckpt before
  this module) called them.

The form is read from the callable's signature when it is called: exactly one required
positional parameter (and no ``*args``) is the one-argument form; anything else is called with
two arguments.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["CallbackArgs", "callable_as_callback", "run_callback", "takes_callback_args"]


@dataclass(frozen=True)
class CallbackArgs:
    """What a one-argument commit callback receives.

    Attributes:
        path: for ``finalize_callback``, the committed checkpoint's path; for
            ``pre_finalize_callback``, where this rank's files of the checkpoint were written
            (the hidden staging directory on a local disk, not yet visible at the checkpoint's
            path; on an object store, the generation prefix under it).
        storage: the :class:`fastckpt.storage.backend.StorageBackend` that holds them
            (``storage.list_dir``, ``storage.stat``, ``storage.read_range``, ...).
        event_logger: the ``logging.Logger`` ``"fastckpt.manager"`` (torch_checkpointing
            passes its ``EventLogger`` here).
    """

    path: str
    storage: Any
    event_logger: logging.Logger


def takes_callback_args(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` is called as ``fn(CallbackArgs)``: it has exactly one required
    positional parameter and no ``*args``. Callables whose signature cannot be read (some
    builtins) are called with two arguments."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if any(p.kind is p.VAR_POSITIONAL for p in parameters):
        return False
    required = [p for p in positional if p.default is p.empty]
    return len(required) == 1 and len(positional) == 1


def callable_as_callback(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` can be called in one of the two forms :func:`run_callback` uses:
    ``fn(args)`` or ``fn(checkpoint_id, logger)`` (True when its signature cannot be read)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return True
    for arguments in ((None,), (None, None)):
        try:
            signature.bind(*arguments)
        except TypeError:
            continue
        return True
    return False


def run_callback(
    fn: Callable[..., Any],
    *,
    checkpoint_id: str,
    path: str,
    storage: Any,
    logger: logging.Logger,
) -> None:
    """Call ``fn`` in its form: ``fn(CallbackArgs(path, storage, logger))`` or
    ``fn(checkpoint_id, logger)``."""
    if takes_callback_args(fn):
        fn(CallbackArgs(path=path, storage=storage, event_logger=logger))
    else:
        fn(checkpoint_id, logger)
