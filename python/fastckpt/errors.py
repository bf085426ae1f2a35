"""The exceptions fastckpt raises.

Every fastckpt-specific error derives from :class:`FastCkptError`. Errors that describe bad
data also derive from :class:`ValueError`, so code that already catches ``ValueError`` keeps
working. Operating-system failures keep their usual Python types (``FileNotFoundError``,
``PermissionError``, ``OSError`` with ``errno.ENOSPC``) and name the file they happened on.

The Rust extension raises these same classes (it looks them up in this module), so there is
exactly one hierarchy.

Relation to ``safetensors``: safetensors raises ``ValueError`` for arguments it cannot store
and ``safetensors.SafetensorError`` (an ``Exception``) for malformed files. fastckpt raises
:class:`InvalidInputError` (a ``ValueError`` and a ``TypeError``) for the former and
:class:`CheckpointFormatError` (a ``ValueError``) for the latter; fastckpt does not import
safetensors, so its errors are not ``SafetensorError`` subclasses: code that handles both
libraries catches ``(ValueError, SafetensorError)``.
"""

from __future__ import annotations

__all__ = [
    "CheckpointFormatError",
    "CheckpointMismatchError",
    "ChecksumMismatchError",
    "CommitNotDurableError",
    "ConcurrentSaveError",
    "DamagedSourceError",
    "FastCkptError",
    "IndexNotCommittedError",
    "InterruptedStepError",
    "InvalidInputError",
    "MissingDependencyError",
    "MixedRunError",
    "NotACheckpointError",
    "NotCommittedError",
    "PromotionError",
    "StateChangedError",
    "UnsupportedValueError",
    "UntrustedTargetError",
]


class FastCkptError(Exception):
    """Base class of every fastckpt-specific error."""


class ChecksumMismatchError(FastCkptError, ValueError):
    """Bytes on disk do not match the crc32c recorded when they were written.

    The message names the file and the tensor. The file is corrupt: restore it from a copy or
    load an older checkpoint.
    """


class CheckpointFormatError(FastCkptError, ValueError):
    """A file or manifest is malformed: bad header, lying offsets, truncation, bad JSON.

    The message names the file and the offending field.
    """


class InvalidInputError(FastCkptError, TypeError, ValueError):
    """An argument fastckpt cannot store or represent: not a mapping of ``str`` names to dense
    tensors, a dtype the safetensors format has no name for (or a file's dtype this torch has
    no type for), metadata that is not a ``str -> str`` mapping; or a call that cannot be
    right where it is made (a save by hand of DDP replicas on a rank other than 0).

    It is a ``TypeError`` (what fastckpt raised for these before) and a ``ValueError`` (what
    ``safetensors.torch.save_file`` raises), so either ``except`` keeps working. The message
    names the key and the fix.
    """


class CheckpointMismatchError(FastCkptError, ValueError):
    """A load target disagrees with the checkpoint (dtype or shape), named by key path; or a
    hook passed at resume is configured otherwise than the one that saved (an ``EMAHook``'s
    ``decay``): the checkpoint is not damaged, the caller's side differs."""


class MissingDependencyError(FastCkptError, ImportError):
    """An optional dependency a path or feature needs is not installed (``s3://`` paths
    without the ``s3`` extra). The message names the path, the missing packages and the
    ``pip install`` line that adds them; nothing was read or written."""


class MixedRunError(FastCkptError, ValueError):
    """A training run would save into a root whose newest committed checkpoint is further
    along (more steps) than the run: most likely the script was started again instead of
    resumed, and its checkpoints would interleave with the earlier run's.

    The message names the root, both step counts and the fixes: resume
    (``TrainingStrategy.load_checkpoint``), another root, or ``overwrite=True``.
    """


class UntrustedTargetError(FastCkptError):
    """A checkpoint names a dotted path the trust policy refuses to import or call.

    The message names the path and how to allow it (``trusted=`` at load, or a registration).
    """


# The two errors only a sharded (DCP) checkpoint can raise.


class NotACheckpointError(FastCkptError, FileExistsError):
    """A save would replace something that is not a checkpoint (a file, a folder of your data,
    a folder of checkpoints): a save replaces only a checkpoint, atomically. Save under another
    name, or move what is there first.
    """


class NotCommittedError(FastCkptError, FileNotFoundError):
    """The checkpoint directory has no commit record: nothing was ever committed there, or the
    only save into it was interrupted (its files are ignored and removed by the next save).

    Load an older checkpoint id, or save again.
    """


class PromotionError(FastCkptError):
    """Copying checkpoints from a fast tier to a durable one failed (the message names the
    tiers and the cause, which is chained). Training went on; the fast tier's checkpoints are
    intact, and the next promotion retries what is missing (``fastckpt promote FAST DURABLE``
    does it by hand).
    """


class DamagedSourceError(FastCkptError, ValueError):
    """A promotion passed over checkpoints of its fast tier that do not verify (a rotten or
    missing file) and promoted the later ones; the message names each and why. It is the
    cause of that promotion's :class:`PromotionError` (the promoter is unhealthy until a
    later promotion succeeds). Restore those checkpoints from a copy, or delete them.
    """


class IndexNotCommittedError(FastCkptError, KeyError):
    """A checkpoint index asked for is not committed in the root: never saved, or pruned
    (by this process or a live writer: retry with the newest, ``checkpoint_index=-1``). The
    message lists the committed ones. A ``KeyError``, as before it had a type of its own.
    """


class InterruptedStepError(FastCkptError, RuntimeError):
    """A ``TrainingStrategy`` was asked to save a state between two steps: an error (not
    Ctrl-C, which is held back until the step's update is done) was raised after the
    optimizer step began and before the counters moved, so the weights, optimizer, schedulers
    and counters belong to no one step, and a checkpoint of them would resume wrongly.
    Restore the last checkpoint and train on from there.
    """


class ConcurrentSaveError(FastCkptError, RuntimeError):
    """A save was asked for where it cannot be taken whole, and nothing was written: from
    another thread while ``TrainingStrategy.run()`` trains (the optimizer changes the weights
    while they are written: the counters of one step with the weights of another), or, on a
    thread already saving into or pruning the same root, by a signal handler that interrupted
    that save (it would wait for the root's lock its own thread holds, forever). Save from the
    training thread instead: a hook, or a flag a hook checks; ``run()`` holds SIGTERM/SIGINT
    until the step is done, so a handler there may save.
    """


class StateChangedError(FastCkptError, RuntimeError):
    """An async save was not committed: tensors it copies in the background (trainable
    parameters, which only the guarded optimizer step is expected to change) changed in
    place while they were copied, outside the optimizer step (``nn.Embedding(max_norm=...)``
    renormalizing its weight in forward, a weight decayed in forward). The message names
    them; later saves copy them when the save is taken, on the training thread.
    """


class CommitNotDurableError(FastCkptError, OSError):
    """A save's commit took effect (the new checkpoint is in place, and loads), but an
    ``fsync`` after it failed: the commit may not survive a machine crash or a power cut.

    The ``errno`` and ``filename`` are the failed ``fsync``'s (the folder it synced); the
    message names what was committed, what failed, and where a replaced checkpoint was
    kept. ``fastckpt verify`` tells what is committed; save again once the storage is
    healthy to have a durable checkpoint. It is an ``OSError`` (what these failures raised
    before), so ``except OSError`` keeps working.
    """

    @classmethod
    def after(
        cls, cause: OSError, committed: object, *, kept: object | None = None
    ) -> CommitNotDurableError:
        """The error for ``committed`` (a checkpoint path, named in the message) whose commit
        was followed by the failure ``cause``; ``kept``: where the checkpoint it replaced was
        left (not deleted: a power cut may bring it back)."""
        message = (
            f"{committed}: committed (the new checkpoint is in place and loads), but a later "
            f"fsync failed ({cause.strerror or cause}): it may not survive a machine crash "
            f"or power cut; `fastckpt verify` tells what is committed"
        )
        if kept is not None:
            message += f"; the checkpoint it replaced is kept at {kept} (delete it once verified)"
        return cls(cause.errno, message, cause.filename)


class UnsupportedValueError(FastCkptError, TypeError):
    """A non-tensor value that cannot be stored without pickle (the message names its key).

    Supported: ``io.BytesIO`` and ``bytes`` (stored raw), and nests of dicts/lists/tuples of
    None, bool, int, float and str (stored as JSON). Convert other objects to one of these (or
    to a tensor) before saving.
    """
