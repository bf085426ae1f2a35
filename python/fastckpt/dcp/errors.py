"""The typed errors of the sharded (DCP) backend, on top of :mod:`fastckpt.errors`.

Corrupt bytes raise :class:`fastckpt.ChecksumMismatchError` and malformed records
:class:`fastckpt.CheckpointFormatError`, as everywhere in fastckpt; the two classes here cover
what only a sharded checkpoint can get wrong.
"""

from __future__ import annotations

from fastckpt.errors import FastCkptError

__all__ = ["NotCommittedError", "UnsupportedValueError"]


class NotCommittedError(FastCkptError, FileNotFoundError):
    """The checkpoint directory has no commit record: nothing was ever committed there, or the
    only save into it was interrupted (its files are ignored and removed by the next save).

    Load an older checkpoint id, or save again.
    """


class UnsupportedValueError(FastCkptError, TypeError):
    """A non-tensor value that cannot be stored without pickle (the message names its key).

    Supported: ``io.BytesIO`` and ``bytes`` (stored raw), and nests of dicts/lists/tuples of
    None, bool, int, float and str (stored as JSON). Convert other objects to one of these (or
    to a tensor) before saving.
    """
