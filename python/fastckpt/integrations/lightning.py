"""PyTorch Lightning ``CheckpointIO`` plugins that write checkpoints through fastckpt.

```python
trainer = lightning.Trainer(plugins=[FastCheckpointIO()])        # or AsyncFastCheckpointIO()
trainer.fit(model, ckpt_path="checkpoints/last.ckpt")             # resumes as usual
```

Each checkpoint path Lightning asks for (``epoch=0-step=10.ckpt``) becomes a directory in
:class:`fastckpt.CheckpointManager`'s format, so every fastckpt tool reads it
(``CheckpointManager.load``, :func:`fastckpt.safe_open`, ``fastckpt verify``):

```
epoch=0-step=10.ckpt/
    commit.json               every file's size and crc32c; written last (the commit)
    checkpoint.json           Lightning's checkpoint dict without its tensors (JSON)
    checkpoint.safetensors    its tensors, each with a crc32c
    lightning.json/.safetensors   this plugin's format marker and the state_dict's metadata
    pickled.json/.safetensors     only with allow_pickle=True and values JSON cannot hold
```

The directory is written as a hidden temporary sibling, fsynced, and swapped into place in
one step: Lightning (and a crash) sees the previous checkpoint or the new one, never a mix.
Nothing is pickled unless ``allow_pickle=True``; see ``docs/lightning.md`` for what Lightning
content needs it and how loading it is guarded.
"""

from __future__ import annotations

import contextlib
import errno
import io
import logging
import os
import shutil
import warnings
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

try:
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
except ImportError as err:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "fastckpt.integrations.lightning needs PyTorch Lightning (the 'lightning' package): "
        "pip install 'fastckpt-io[lightning]'"
    ) from err

from fastckpt import _native
from fastckpt.container.background import BackgroundWriter
from fastckpt.container.commit import DirectoryWriter, refuse_to_replace
from fastckpt.container.links import read_item
from fastckpt.container.listing import saved_after_siblings
from fastckpt.errors import CheckpointFormatError, UntrustedTargetError
from fastckpt.format.records import (
    COMMIT_RECORD,
    MAX_JSON_DEPTH,
    commit_record,
    read_commit_record,
)
from fastckpt.io import tree
from fastckpt.io.staging import StagerOptions, make_image_pool, make_stager, stage_groups
from fastckpt.storage.backend import restore_replaced

__all__ = ["AsyncFastCheckpointIO", "FastCheckpointIO", "load_lightning_checkpoint"]

#: ``format`` of the ``lightning`` item; its ``version`` is the newest this code reads.
FORMAT = "fastckpt-lightning"
VERSION = 1
CHECKPOINT_ITEM = "checkpoint"
INFO_ITEM = "lightning"
PICKLED_ITEM = "pickled"
#: A value stored with ``torch.save`` is replaced in the JSON skeleton by
#: ``{PICKLED_MARKER: <position in the pickled item>}``; the key is reserved in saved dicts.
PICKLED_MARKER = "__fastckpt_pickled__"
_KEY_TYPES = (str, int, float, bool, type(None))

_LOG = logging.getLogger(__name__)


# --------------------------------------------------------------------------- planning a save


@dataclass
class Plan:
    """One checkpoint ready to write: per item its JSON skeleton and flat tensors.

    Attributes:
        items: item name -> ``(skeleton, {tensor name: tensor})``.
        pickled_paths: key paths of the values stored with ``torch.save``.
    """

    items: dict[str, tuple[Any, dict[str, torch.Tensor]]] = field(default_factory=dict)
    pickled_paths: list[str] = field(default_factory=list)


class _Splitter:
    """Copies a checkpoint nest, replacing what JSON + tensors cannot hold."""

    def __init__(self, allow_pickle: bool) -> None:
        self.allow_pickle = allow_pickle
        self.blobs: list[torch.Tensor] = []
        self.paths: list[str] = []

    def split(self, value: Any, path: str, level: int = 0) -> Any:
        """``value`` (at key path ``path``, ``level`` containers deep) with what JSON and
        tensors cannot hold replaced (pickled, or refused).

        Raises:
            TypeError: a value that cannot be held, or containers nested past what a load
                reads (named by its key path; counted here one level each, as stored: the
                deeper stored forms of tuples are checked after the split).
        """
        if isinstance(value, torch.Tensor) or value is None:
            return value
        if type(value) in (bool, int, float, str):  # exact: an enum or numpy scalar is pickled
            return value
        if isinstance(value, (Mapping, list, tuple)) and level >= _MAX_NESTING:
            _check_nesting(level + 1, path or "<root>")
        if isinstance(value, Mapping) and all(type(k) in _KEY_TYPES for k in value):
            if PICKLED_MARKER in value:
                raise TypeError(
                    f"{tree.join_path(path, PICKLED_MARKER)}: this dict key is reserved by "
                    "fastckpt's Lightning plugin; rename it"
                )
            return {k: self.split(v, tree.join_path(path, k), level + 1) for k, v in value.items()}
        if type(value) is tuple:
            return tuple(
                self.split(v, tree.join_path(path, i), level + 1) for i, v in enumerate(value)
            )
        if isinstance(value, list):
            return [self.split(v, tree.join_path(path, i), level + 1) for i, v in enumerate(value)]
        return self.pickle(value, path)

    def pickle(self, value: Any, path: str) -> Any:
        where = path or "<root>"
        kind = f"{type(value).__module__}.{type(value).__qualname__}"
        if not self.allow_pickle:
            raise TypeError(
                f"{where}: a {kind} cannot be stored without pickle. Convert it to tensors, "
                "numbers, strings, lists or dicts (e.g. in on_save_checkpoint or by saving "
                "plain hyperparameters), or use FastCheckpointIO(allow_pickle=True): it is "
                "then stored with torch.save and loaded through torch.load(weights_only=True)"
            )
        buffer = io.BytesIO()
        torch.save(value, buffer)
        self.blobs.append(torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8))
        self.paths.append(where)
        return {PICKLED_MARKER: len(self.blobs) - 1}


#: The deepest nesting of a checkpoint's dicts, lists and tuples (as stored) a save accepts:
#: what a load reads (``MAX_JSON_DEPTH``) less the levels of the document around it.
_MAX_NESTING = MAX_JSON_DEPTH - 10


def _check_nesting(depth: int, where: str | None) -> None:
    """Refuse a checkpoint nested ``depth`` levels deep (at its item ``where``, when known),
    past :data:`_MAX_NESTING`.

    Raises:
        TypeError: names the item and the fix.
    """
    if depth > _MAX_NESTING:
        raise TypeError(
            f"{'the checkpoint' if where is None else where}: its dicts, "
            "lists and tuples nest too deeply (more than "
            f"{_MAX_NESTING} levels as stored) to be loaded back; flatten the deepest values "
            "(hyperparameters, callback states), e.g. by joining inner keys into one"
        )


def plan_checkpoint(checkpoint: Mapping[str, Any], *, allow_pickle: bool = False) -> Plan:
    """Split Lightning's checkpoint dict into the items written to disk (no I/O).

    Raises:
        TypeError: a value JSON and tensors cannot hold (and ``allow_pickle`` is off), or a
            reserved key, named by its key path.
    """
    if not isinstance(checkpoint, Mapping):
        raise TypeError(f"checkpoint must be a dict, got {type(checkpoint).__name__}")
    splitter = _Splitter(allow_pickle)
    body = splitter.split(checkpoint, "")
    metadata = getattr(checkpoint.get("state_dict"), "_metadata", None)
    info = {
        "format": FORMAT,
        "version": VERSION,
        "state_dict_metadata": splitter.split(metadata, "state_dict._metadata"),
    }
    plan = Plan()
    skeleton, tensors, depth = tree.flatten_measured(body)
    _check_nesting(depth, None)  # as stored: a tuple takes two levels
    plan.items[CHECKPOINT_ITEM] = (skeleton, tensors)
    plan.items[INFO_ITEM] = tree.flatten(info)
    if splitter.blobs:
        plan.items[PICKLED_ITEM] = tree.flatten(splitter.blobs)
    plan.pickled_paths = splitter.paths
    return plan


def write_plan(
    path: str | Path, plan: Plan, *, direct_io: bool | None = None, threads: int | None = None
) -> None:
    """Write a planned checkpoint as directory ``path``, atomically and durably."""
    writer = DirectoryWriter(Path(path), direct_io=direct_io, threads=threads)
    try:
        for item, (skeleton, tensors) in plan.items.items():
            writer.add_tensors(f"{item}.safetensors", tensors)
            writer.add_json(f"{item}.json", {"skeleton": skeleton})
        saved = saved_after_siblings(writer.final)
        record = commit_record(list(plan.items), writer.files, 1, saved_ns=saved)
        writer.add_json(COMMIT_RECORD, record)
        writer.commit()
    except BaseException:
        writer.abort()
        raise


# --------------------------------------------------------------------------- loading


def _load_item(directory: Path, record: Mapping[str, Any], item: str) -> Any:
    # read_item follows the references of incremental CheckpointManager checkpoints.
    skeleton, tensors = read_item(directory, record, item)
    # Owned copies: views would keep the file mapped (and its disk space in use after
    # ModelCheckpoint removes it) for as long as the run keeps the optimizer state.
    owned = {name: tensor.clone() for name, tensor in tensors.items()}
    return tree.unflatten(skeleton, owned, item)


class _Unpickler:
    """Puts back the values stored with ``torch.save``, through the weights-only
    ``torch.load`` (never a general unpickler)."""

    def __init__(self, directory: Path, blobs: list[Any]) -> None:
        self.where = directory / f"{PICKLED_ITEM}.safetensors"
        self.blobs = blobs

    def restore(self, value: Any, path: str) -> Any:
        if isinstance(value, dict):
            if set(value) == {PICKLED_MARKER}:
                return self.load(value[PICKLED_MARKER], path)
            return {k: self.restore(v, tree.join_path(path, k)) for k, v in value.items()}
        if isinstance(value, list):
            return [self.restore(v, tree.join_path(path, i)) for i, v in enumerate(value)]
        if type(value) is tuple:
            return tuple(self.restore(v, tree.join_path(path, i)) for i, v in enumerate(value))
        return value

    def load(self, position: Any, path: str) -> Any:
        where = path or "<root>"
        if not (isinstance(position, int) and 0 <= position < len(self.blobs)):
            raise CheckpointFormatError(
                f"{self.where}: {where} refers to pickled value {position!r}, which is missing"
            )
        blob = self.blobs[position]
        if not isinstance(blob, torch.Tensor) or blob.dtype != torch.uint8:
            raise CheckpointFormatError(f"{self.where}: pickled value {position} is malformed")
        data = io.BytesIO(blob.numpy().tobytes())
        try:
            return torch.load(data, map_location="cpu", weights_only=True)
        except Exception as err:  # the bytes passed their crc32c: the unpickler refused them
            raise UntrustedTargetError(
                f"{self.where}: the value at {where} was stored with pickle and the "
                f"weights-only unpickler refused it ({err}). fastckpt never unpickles "
                "arbitrary objects: if you trust this checkpoint, allow the types it names "
                "with torch.serialization.add_safe_globals([...]) and load again"
            ) from err


def _put_back(path: Path) -> None:
    """Put back the checkpoint ``path`` when a replace killed between its two renames (where
    the filesystem cannot exchange two paths: NFS) left it aside under a hidden name, saying
    so: a run that resumed with ``ckpt_path="last"`` meanwhile did not see it."""
    if path.name in restore_replaced(path.parent):
        message = (
            f"{path}: put back; a replace killed between its two renames had left it aside "
            "under a hidden name (a run resumed with ckpt_path='last' meanwhile did not see it)"
        )
        _LOG.warning("%s", message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def load_lightning_checkpoint(path: str | Path, map_location: Any = None) -> dict[str, Any]:
    """Load a checkpoint directory written by :class:`FastCheckpointIO` as Lightning's dict.

    Every file is checked against ``commit.json`` (size, crc32c) and every tensor against its
    own crc32c. Values saved with ``allow_pickle=True`` are restored with
    ``torch.load(weights_only=True)``: only the types PyTorch's weights-only unpickler allows
    (plus those registered with ``torch.serialization.add_safe_globals``).

    Args:
        path: the checkpoint directory (the path Lightning saved to).
        map_location: a device (``"cpu"``, ``torch.device``) to move tensors to; other
            forms (callables, dicts) load on the CPU, where Lightning moves them itself.

    Raises:
        FileNotFoundError: no such checkpoint, or a recorded file is missing.
        CheckpointFormatError / ChecksumMismatchError: damaged files (named).
        UntrustedTargetError: a pickled value the weights-only unpickler refuses.
    """
    directory = Path(path)
    if not os.path.lexists(directory):
        _put_back(directory)
    try:
        record = read_commit_record(directory)
    except FileNotFoundError:
        _explain_missing(directory)
        raise
    items = record["items"]
    for item in (CHECKPOINT_ITEM, INFO_ITEM):
        if item not in items:
            raise CheckpointFormatError(
                f"{directory / COMMIT_RECORD}: item {item!r} is missing; this is not a "
                "checkpoint written by fastckpt's Lightning plugin"
            )
    info = _load_item(directory, record, INFO_ITEM)
    version = info.get("version") if isinstance(info, dict) else None
    if not isinstance(info, dict) or info.get("format") != FORMAT or not isinstance(version, int):
        raise CheckpointFormatError(f"{directory / INFO_ITEM}.json: not a {FORMAT} record")
    if version > VERSION:
        raise CheckpointFormatError(
            f"{directory}: written by a newer fastckpt ({FORMAT} version {version}, this one "
            f"reads up to {VERSION}); upgrade fastckpt"
        )
    checkpoint = _load_item(directory, record, CHECKPOINT_ITEM)
    if not isinstance(checkpoint, dict):
        raise CheckpointFormatError(f"{directory / CHECKPOINT_ITEM}.json: must hold a dict")
    metadata = info.get("state_dict_metadata")
    if PICKLED_ITEM in items:
        blobs = _load_item(directory, record, PICKLED_ITEM)
        unpickler = _Unpickler(directory, blobs)
        checkpoint = unpickler.restore(checkpoint, "")
        metadata = unpickler.restore(metadata, "state_dict._metadata")
    if isinstance(map_location, (str, torch.device)):
        device = torch.device(map_location)
        checkpoint = tree.map_tensors(checkpoint, lambda tensor: tensor.to(device))
    state_dict = checkpoint.get("state_dict")
    if isinstance(state_dict, dict):
        ordered: Any = OrderedDict(state_dict)
        if metadata is not None:
            ordered._metadata = metadata
        checkpoint["state_dict"] = ordered
    return checkpoint


def _remove(path: Path) -> None:
    """Remove a checkpoint: its commit record first (durably), so that an interrupted
    removal never leaves something that looks like a complete checkpoint."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        (path / COMMIT_RECORD).unlink(missing_ok=True)
        _native.fsync_dir(str(path))
        shutil.rmtree(path)
    else:
        return
    _native.fsync_dir(str(path.parent))


# --------------------------------------------------------------------------- the plugins


def _names_a_type(message: str) -> bool:
    """Whether ``torch.load(weights_only=True)`` refused a file for a type it would not
    build (the file may be fine: allow the type if it is trusted), not for its bytes."""
    return "Weights only load failed" in message and (
        "Unsupported global" in message or "not an allowed global" in message
    )


def _explain_missing(directory: Path) -> None:
    """Raise a ``FileNotFoundError`` saying what ``directory`` (which holds no commit record)
    is: nothing at all (a dangling ``last.ckpt`` link included), or the empty folder an async
    save reserved and a crash kept from being written, naming the newest committed checkpoint
    beside it (``ckpt_path="last"`` resolves to the interrupted one on every restart). Returns
    when it is neither (the caller raises the record's own error)."""
    if not os.path.exists(directory):
        link = (
            f" (a link to {os.readlink(directory)}, which is gone)"
            if directory.is_symlink()
            else ""
        )
        raise FileNotFoundError(
            errno.ENOENT, f"{directory}{link}: no such checkpoint", str(directory)
        )
    if not directory.is_dir() or any(not n.startswith(".") for n in os.listdir(directory)):
        return
    newest = _newest_committed(directory.resolve().parent)
    hint = (
        f"the newest committed checkpoint beside it is {newest}: resume with ckpt_path="
        f"{str(newest)!r}"
        if newest is not None
        else "no committed checkpoint is beside it"
    )
    raise FileNotFoundError(
        errno.ENOENT,
        f"{directory} is an empty folder, not a committed checkpoint: the async save that "
        f"reserved it was interrupted before its write committed (a crash); {hint}, and delete "
        "the empty folder (and a last.ckpt link to it) so that ckpt_path='last' finds it",
        str(directory),
    )


def _newest_committed(folder: Path) -> Path | None:
    """The checkpoint folder in ``folder`` whose commit record was written last (None: none);
    hidden folders (a save's staging or a replaced copy set aside, never in place) are not
    checkpoints Lightning lists, and the next save removes them."""
    found: list[tuple[int, str]] = []
    with contextlib.suppress(OSError):
        for name in os.listdir(folder):
            if name.startswith("."):
                continue
            record = folder / name / COMMIT_RECORD
            with contextlib.suppress(OSError):
                if not (folder / name).is_symlink():
                    found.append((record.stat().st_mtime_ns, name))
    return folder / max(found)[1] if found else None


def _reserve(target: Path) -> bool:
    """Make ``target`` exist (an empty folder) when nothing is there; whether it did (a path
    that cannot be made is left to the write, which reports why)."""
    try:
        target.mkdir(parents=True)
    except OSError:
        return False
    return True


def _local(path: Any) -> Path:
    """``path`` as a local path; URLs (``s3://``, ``gs://``...) are refused, not written to a
    local directory named after them."""
    text = str(path)
    if "://" in text:
        raise ValueError(
            f"{text}: fastckpt's Lightning plugin writes to local (or mounted) filesystems, not "
            "to URLs; give ModelCheckpoint a local dirpath"
        )
    return Path(text)


class FastCheckpointIO(CheckpointIO):
    """Lightning ``CheckpointIO`` writing checkpoints through fastckpt (see the module doc).

    Pass it to the trainer: ``Trainer(plugins=[FastCheckpointIO()])``. ``ModelCheckpoint``
    (``save_top_k``, ``save_last``), ``trainer.save_checkpoint`` and
    ``trainer.fit(ckpt_path=...)`` work unchanged; each checkpoint path is a directory.

    Args:
        allow_pickle: store values JSON and tensors cannot hold with ``torch.save`` instead of
            refusing them with a ``TypeError`` naming their key path.
        direct_io: write mode of the tensor files (None: fastckpt picks per file).
        threads: writer threads per tensor file (None: fastckpt's default).
    """

    def __init__(
        self,
        *,
        allow_pickle: bool = False,
        direct_io: bool | None = None,
        threads: int | None = None,
    ) -> None:
        """See the class docstring."""
        super().__init__()
        self.allow_pickle = allow_pickle
        self.direct_io = direct_io
        self.threads = threads

    def _plan(self, checkpoint: dict[str, Any], storage_options: Any) -> Plan:
        if storage_options is not None:
            raise TypeError(
                f"{type(self).__name__} takes no storage_options (got {storage_options!r}); "
                "configure it through its constructor"
            )
        return plan_checkpoint(checkpoint, allow_pickle=self.allow_pickle)

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        """Write ``checkpoint`` as directory ``path``; returns once it is durable.

        Raises:
            TypeError: a value that cannot be stored (key path named), or storage_options.
            NotACheckpointError: ``path`` is a folder of other files (a save replaces a
                checkpoint or a ``torch.save`` file there, nothing else).
            OSError: the write failed (``path`` keeps its previous content).
        """
        target = _local(path)
        refuse_to_replace(target, files=True)
        plan = self._plan(checkpoint, storage_options)
        write_plan(target, plan, direct_io=self.direct_io, threads=self.threads)

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Load a checkpoint: a directory this plugin wrote, or a ``torch.save`` file.

        Pickled content (values saved with ``allow_pickle=True``, and files written by
        Lightning's ``TorchCheckpointIO``, which load here so that a run can switch plugins)
        goes through ``torch.load(weights_only=True)`` only, whatever ``weights_only`` says:
        fastckpt never unpickles arbitrary objects. Allow more types with
        ``torch.serialization.add_safe_globals``.
        """
        del weights_only  # always weights-only, see above
        target = _local(path)
        if not os.path.lexists(target):
            _put_back(target)
        if target.is_file():
            location = map_location if isinstance(map_location, (str, torch.device)) else "cpu"
            try:
                loaded: dict[str, Any] = torch.load(
                    target, map_location=location, weights_only=True
                )
            except Exception as err:
                if _names_a_type(str(err)):
                    raise UntrustedTargetError(
                        f"{target}: torch.load(weights_only=True) refused this file ({err}); "
                        "if you trust it, allow the types it names with "
                        "torch.serialization.add_safe_globals([...]) and load again"
                    ) from err
                raise CheckpointFormatError(
                    f"{target}: cannot be read as a torch.save checkpoint "
                    f"({type(err).__name__}: {str(err) or 'no detail'}): the file is damaged "
                    "(truncated?) or is not a checkpoint; load another one"
                ) from err
            if not isinstance(loaded, dict):
                raise CheckpointFormatError(
                    f"{target}: holds a {type(loaded).__name__}, not a Lightning checkpoint "
                    "(a dict)"
                )
            return loaded
        return load_lightning_checkpoint(target, map_location)

    def remove_checkpoint(self, path: Any) -> None:
        """Remove a checkpoint directory (or a file / link at ``path``); absent is fine."""
        _remove(_local(path))


class AsyncFastCheckpointIO(FastCheckpointIO):
    """:class:`FastCheckpointIO` whose writes run on a background thread.

    ``save_checkpoint`` copies the checkpoint's tensors into staging buffers that are
    allocated once and reused by later saves (pinned memory and a side stream for CUDA
    tensors), then returns; the write runs at lowered priority with the GIL released, on the
    same engine as the ``CheckpointHook``'s and ``CheckpointManager``'s async saves
    (:class:`~fastckpt.container.background.BackgroundWriter`). One write is in flight at a time:
    the next
    save waits for it first (at most ``wait_timeout`` seconds: a ``TimeoutError`` names it,
    and it stays tracked), ``load_checkpoint`` waits for it, ``remove_checkpoint`` waits when
    it removes the path being written and otherwise puts the removal off until the write in
    flight is durable (keeping the checkpoint if that write fails), and ``teardown`` (end of
    ``fit``) waits for the last one however long it takes. A failed write is raised once, by
    the next of these calls, as a ``RuntimeError`` chained to its cause. A write still
    pending when the interpreter exits (no ``teardown``) is finished then, or named on
    stderr; a removal put off until it was durable is then not made (the checkpoint stays:
    a script that saves and removes by hand calls :meth:`teardown` or :meth:`wait`).

    The copy runs under the writer's capture lock: code on other threads that mutates the
    saved state can hold :meth:`guard` to keep it from being captured half-updated.
    """

    def __init__(
        self,
        *,
        allow_pickle: bool = False,
        direct_io: bool | None = None,
        threads: int | None = None,
        wait_timeout: float | None = None,
    ) -> None:
        """See :class:`FastCheckpointIO`; ``wait_timeout``: seconds a save, load or remove
        waits for the previous write (None: as long as it takes)."""
        super().__init__(allow_pickle=allow_pickle, direct_io=direct_io, threads=threads)
        cuda = torch.cuda.is_available()
        options = StagerOptions(pinned=cuda, non_blocking=cuda)
        self._stager = make_stager(options)
        # Each item's file is staged into one file image, written without a second copy.
        self._images = make_image_pool(options)
        self._writer: BackgroundWriter[None] = BackgroundWriter(
            "fastckpt-lightning", wait_timeout=wait_timeout
        )
        # Checkpoints Lightning removed while a write was in flight: removed once it is
        # durable (see remove_checkpoint).
        self._removals: list[Any] = []

    def wait(self) -> None:
        """Block until the write in flight (if any) is durable (at most ``wait_timeout``),
        then remove the checkpoints :meth:`remove_checkpoint` put off until then; when the
        write failed they are kept (the newest intact checkpoints), with a warning.

        Raises:
            RuntimeError: that write failed (chained to its error; raised once).
            TimeoutError: it is still running after ``wait_timeout`` seconds.
        """
        try:
            self._writer.collect()
        except TimeoutError:
            raise  # still running: the removals wait for it
        except BaseException:
            if self._removals:
                kept = ", ".join(str(_local(path)) for path in self._removals)
                _LOG.warning("the write in flight failed: kept %s, which it was to replace", kept)
            self._removals.clear()
            raise
        removals, self._removals = self._removals, []
        for path in removals:
            super().remove_checkpoint(path)

    def guard(self) -> contextlib.AbstractContextManager[None]:
        """Hold while mutating saved state from another thread: waits for a copy in
        progress, and keeps the next one from starting until the block ends."""
        return self._writer.guard()

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        """Snapshot ``checkpoint`` and write it in the background (see the class doc).

        ``path`` exists when this returns (an empty folder until the write commits, which
        loads refuse as not committed): ``ModelCheckpoint`` picks the name of its next save
        by whether a path exists, and would otherwise give this one's name to the next save,
        which then replaced this checkpoint (the best one, say) with a worse one.
        """
        self.wait()
        target = _local(path)
        refuse_to_replace(target, files=True)
        plan = self._plan(checkpoint, storage_options)
        groups = {item: tensors for item, (_, tensors) in plan.items.items()}
        # Lightning calls this from the training loop and mutates the state after it returns:
        # the copy is made here, before returning, under the capture lock.
        self._writer.capture(lambda: stage_groups(self._stager, groups, _every, self._images))
        placeholder = _reserve(target)

        def write() -> None:
            try:
                write_plan(target, plan, direct_io=self.direct_io, threads=self.threads)
            except BaseException:
                if placeholder:
                    with contextlib.suppress(OSError):
                        target.rmdir()  # still the empty placeholder: nothing was committed
                raise

        self._writer.submit(str(target.absolute()), write)

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Wait for the write in flight, then load (see :class:`FastCheckpointIO`)."""
        self.wait()
        return super().load_checkpoint(path, map_location, weights_only)

    def remove_checkpoint(self, path: Any) -> None:
        """Remove a checkpoint: at once when no write is in flight (waiting first if it is
        the one being written); otherwise once that write is durable (the next save, load or
        :meth:`teardown`), and not at all if it fails. ``ModelCheckpoint`` removes the
        previous checkpoint right after submitting the save that replaces it: removed at
        once, a crash during that write left no checkpoint at all."""
        in_flight = self._writer.in_flight
        if in_flight is None:
            super().remove_checkpoint(path)
        elif in_flight == str(_local(path).absolute()):
            self.wait()
            super().remove_checkpoint(path)
        else:
            self._removals.append(path)

    def teardown(self) -> None:
        """Wait for the last write however long it takes, report it, remove what was put
        off until then (see :meth:`remove_checkpoint`), and stop the background threads
        (called by Lightning)."""
        try:
            self._writer.close()
        except BaseException:
            self._removals.clear()  # the newest intact checkpoints: kept
            raise
        removals, self._removals = self._removals, []
        for path in removals:
            super().remove_checkpoint(path)


def _every(group: str, name: str) -> bool:
    """Stage every tensor (Lightning holds no lock around its updates)."""
    return True
