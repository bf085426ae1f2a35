"""The component codec: models, optimizers and schedulers to and from checkpoint files.

:func:`create_snapshot` turns live components into what an index holds (tensor files, JSON
documents, the manifest entry) without copying or writing anything; :func:`write_snapshot`
commits a snapshot as an index of a root. :func:`load_components` rebuilds the components of
an index (models from their specs through the trust policy, optimizers and schedulers from
their recorded state), reading every file through an :class:`IndexReader`, which checks it
against the manifest. :mod:`fastckpt.checkpoint.api` is the front door built on this module, and
:mod:`fastckpt.training.strategy` builds strategy checkpoints on it.
"""

from __future__ import annotations

import datetime as _dt
import errno
import inspect
import os
import sys
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

import fastckpt.checkpoint.build as build
import fastckpt.checkpoint.fill as fill
import fastckpt.checkpoint.layouts as layouts
import fastckpt.checkpoint.modes as module_modes
import fastckpt.checkpoint.specs as specs
import fastckpt.checkpoint.trust as trust
from fastckpt import _native
from fastckpt.container import incremental
from fastckpt.container.commit import IndexWriter
from fastckpt.container.reader import read_json, read_tensor_file, read_tensor_file_into
from fastckpt.container.refs import (
    REFS_FILE,
    RETAINED_PREFIX,
    Reference,
    index_references,
    link_into,
    refs_document,
    resolve_references,
)
from fastckpt.container.sharded.parts import part_of
from fastckpt.container.verify import checked_index
from fastckpt.errors import (
    CheckpointFormatError,
    ChecksumMismatchError,
    FastCkptError,
    InvalidInputError,
)
from fastckpt.format.records import (
    FROZEN_FIELD,
    MAX_INDEX,
    MODES_FIELD,
    SHARDED_RECORD,
    STRIDES_FIELD,
    Manifest,
    read_record_bytes,
)
from fastckpt.io import tree
from fastckpt.io.files import check_storable, torch_shape
from fastckpt.io.headers import read_metadata
from fastckpt.io.paths import check_name, check_name_length, is_text
from fastckpt.io.progress import log_throughput
from fastckpt.storage.backend import CopySource, LocalStaging, explain_full_disk
from fastckpt.storage.registry import backend_for, is_local

__all__ = [
    "KINDS",
    "LOAD_INDEX",
    "SAVE_INDEX",
    "Components",
    "IndexReader",
    "Snapshot",
    "Trusted",
    "accepted_kwargs",
    "check_incremental",
    "check_tensor_state",
    "check_validators",
    "checked_model_names",
    "create_snapshot",
    "is_compiled",
    "load_components",
    "load_optimizer_state",
    "load_scheduler_state",
    "plan_incremental",
    "run_validators",
    "scheduler_spec",
    "unwrap_model",
    "write_snapshot",
]

Components = Mapping[str, Any]
Trusted = Iterable[str | Callable[..., Any]] | None
KINDS = ("models", "optimizers", "schedulers")

#: What the ``checkpoint_index`` of a load accepts (the ``accepted`` of
#: :func:`~fastckpt.container.verify.checked_index`).
LOAD_INDEX = "an int (a committed index, -1: the latest) or None (the latest)"
#: What the ``checkpoint_index`` of a save accepts.
SAVE_INDEX = "an int (the index to write, -1: the next one) or None (the next one)"


def checked_model_names(value: Any, argument: str = "model_names") -> list[str] | None:
    """``value`` as a list of model names, or None (every model).

    A single string is refused rather than taken for one name: iterating it would mean one
    name per character, and guessing either way hides the mistake.

    Args:
        value: what the caller passed.
        argument: the argument's name, for the message.

    Returns:
        The names as a list, or None.

    Raises:
        TypeError: ``value`` is a string (or bytes), not iterable, or holds a name that is
            not a string; the message says what to pass.
    """
    if value is None:
        return None
    if isinstance(value, str | bytes):
        raise TypeError(
            f"{argument} must be a list of model names or None (every model), not the "
            f"{type(value).__name__} {value!r}; for one model pass [{value!r}]"
        )
    if not isinstance(value, Iterable):
        raise TypeError(
            f"{argument} must be a list of model names or None (every model), not "
            f"{type(value).__name__} {value!r}"
        )
    names = list(value)
    wrong = [name for name in names if not isinstance(name, str)]
    if wrong:
        raise TypeError(
            f"{argument} must hold model names (str), not {wrong[:3]!r}; pass e.g. ['main']"
        )
    return names


# --------------------------------------------------------------------------- save


# FROZEN_FIELD, STRIDES_FIELD, MODES_FIELD: the manifest entry fields a load applies
# (defined with the rest of the on-disk names in fastckpt.format.records).


def canonical_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """``model``'s parameters by name without wrapper segments (see
    :func:`~fastckpt.checkpoint.build.canonical_name`), tied ones under each of their names:
    the names a record of parameters uses, so that it applies to the rebuilt model before or
    after a ``parallelize`` that wraps it."""
    return {
        build.canonical_name(name): parameter
        for name, parameter in model.named_parameters(remove_duplicate=False)
    }


def frozen_names(model: torch.nn.Module) -> list[str]:
    """The (canonical) names of ``model``'s parameters that do not require grad, sorted."""
    return sorted(
        name
        for name, parameter in canonical_parameters(model).items()
        if not parameter.requires_grad
    )


def frozen_record(model: torch.nn.Module, names: Any, where: str) -> list[str]:
    """The parameter names a recorded :data:`FROZEN_FIELD` list (None: none) gives, checked
    against ``model``'s parameters.

    Raises:
        CheckpointFormatError: ``names`` is not a list of names of ``model``'s parameters
            (``where`` names the record and field).
    """
    if names is None:
        return []
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise CheckpointFormatError(f"{where}: must be a list of parameter names")
    unknown = sorted(set(names) - set(canonical_parameters(model)))
    if unknown:
        raise CheckpointFormatError(f"{where}: names {unknown}, which the model does not have")
    return list(names)


def freeze(model: torch.nn.Module, names: Any, where: str) -> None:
    """Give the parameters ``names`` (a recorded :data:`FROZEN_FIELD` list, or None: none)
    of ``model`` ``requires_grad=False``.

    Raises:
        CheckpointFormatError: see :func:`frozen_record`.
    """
    parameters = canonical_parameters(model)
    for name in frozen_record(model, names, where):
        parameters[name].requires_grad_(False)


def unwrap_model(model: torch.nn.Module, *, sharded_ok: bool = False) -> torch.nn.Module:
    """Return the module to checkpoint whole: DDP and ``torch.compile``'s wrapper unwrapped
    (the compiled module's own module is saved and rebuilt, uncompiled: compile it again
    after a load); FSDP/FSDP2 refused (``sharded_ok``: returned as they are, for what
    works on shards, e.g. parameters' ``requires_grad``).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: FSDP/FSDP2-wrapped models (they are checkpointed sharded, see
            :mod:`fastckpt.training.sharded`).
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"expected an nn.Module, got {type(model).__name__}")
    if _is_fsdp(model):
        if sharded_ok:
            return model
        raise ValueError(
            f"{type(model).__name__} is FSDP/FSDP2-sharded: each rank holds only a shard, so a "
            "whole-model component file would be incomplete. Checkpoint FSDP2 (fully_shard) "
            "models sharded: TrainingStrategy + CheckpointHook, CheckpointManager, or "
            "torch.distributed.checkpoint with fastckpt.dcp.Writer (FSDP1 is not supported: "
            "shard with torch.distributed.fsdp.fully_shard)."
        )
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return unwrap_model(model.module, sharded_ok=sharded_ok)
    if is_compiled(model):
        compiled = model._orig_mod
        assert isinstance(compiled, torch.nn.Module)
        return unwrap_model(compiled, sharded_ok=sharded_ok)
    return model


def is_compiled(model: torch.nn.Module) -> bool:
    """Whether ``model`` is the wrapper ``torch.compile(module)`` returns."""
    # sys.modules, not ``torch._dynamo``: that attribute imports dynamo (seconds, at the first
    # save of every process); a model compiled in this process has it imported already.
    compiled = sys.modules.get("torch._dynamo.eval_frame")
    wrapper = getattr(compiled, "OptimizedModule", None)
    return wrapper is not None and isinstance(model, wrapper)


def _is_fsdp(model: torch.nn.Module) -> bool:
    if "torch.distributed.fsdp" not in sys.modules:
        return False  # nothing made an FSDP module in this process (importing it costs ~0.5 s)
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - torch built without distributed
        return False
    if isinstance(model, FullyShardedDataParallel):
        return True
    fsdp2 = getattr(torch.distributed.fsdp, "FSDPModule", None)
    return fsdp2 is not None and isinstance(model, fsdp2)


def _split(component: Any, what: str, name: str) -> tuple[Any, specs.BaseSpec | None]:
    """Accept ``obj`` or ``(obj, spec)`` with spec a BaseSpec or None."""
    if isinstance(component, tuple):
        if len(component) != 2:
            raise TypeError(f"{what} {name!r}: expected (object, spec), got {len(component)} items")
        obj, spec = component
    else:
        obj, spec = component, None
    if spec is not None and not isinstance(spec, specs.BaseSpec):
        raise TypeError(f"{what} {name!r}: spec must be a BaseSpec or None, not {type(spec)}")
    return obj, spec


def _constructor_kwargs(obj: Any, state: Mapping[str, Any], skip: int) -> dict[str, Any]:
    """Keyword arguments to rebuild a scheduler: constructor parameters found in its state."""
    import inspect

    kwargs: dict[str, Any] = {}
    parameters = list(inspect.signature(type(obj).__init__).parameters.values())[1 + skip :]
    for parameter in parameters:
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        if parameter.name in state:
            kwargs[parameter.name] = state[parameter.name]
        elif parameter.default is parameter.empty:
            raise TypeError(
                f"cannot rebuild {type(obj).__qualname__}: constructor argument "
                f"{parameter.name!r} is not in its state_dict(); pass an explicit spec "
                "(fastckpt.create_model_spec) for it"
            )
    return kwargs


def accepted_kwargs(cls: type, values: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of ``values`` that ``cls.__init__`` accepts (all of them with ``**kwargs``).

    ``Optimizer.defaults`` may hold entries the constructor does not take (e.g. AdamW's
    ``decoupled_weight_decay``); rebuilding with them would fail.
    """
    import inspect

    parameters = inspect.signature(cls).parameters
    if any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        return dict(values)
    return {key: value for key, value in values.items() if key in parameters}


def _infer_optimizer_owner(
    optimizer: torch.optim.Optimizer, models: Mapping[str, torch.nn.Module]
) -> tuple[str | None, list[list[str]]]:
    """The model owning most of the optimizer's parameters, and a ``[model, param]`` ref per
    optimizer parameter in state_dict order."""
    owners: dict[int, tuple[str, str]] = {}
    for model_name, model in models.items():
        for param_name, param in model.named_parameters(remove_duplicate=False):
            owners.setdefault(id(param), (model_name, param_name))
    refs: list[list[str]] = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            if id(param) not in owners:
                raise ValueError(
                    "an optimizer parameter belongs to none of the saved models; save the model "
                    "that owns it in the same checkpoint"
                )
            refs.append(list(owners[id(param)]))
    counts: dict[str, int] = {}
    for model_name, _ in refs:
        counts[model_name] = counts.get(model_name, 0) + 1
    owner = max(counts, key=lambda name: counts[name]) if counts else None
    return owner, refs


def _association_for(associations: Mapping[str, Any] | None, kind: str, name: str) -> str | None:
    if not associations:
        return None
    nested = associations.get(kind)
    if isinstance(nested, Mapping) and name in nested:
        return str(nested[name])
    value = associations.get(name)
    return None if value is None or isinstance(value, Mapping) else str(value)


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat()


class Snapshot:
    """Everything to write for one index, computed before any file is touched.

    Attributes:
        tensor_files: relpath -> ``{name: tensor}`` (live tensors, or staged copies).
        json_files: relpath -> JSON document (already detached from live objects).
        volatile: ``(relpath, name)`` of tensors that may change outside the optimizer step
            (model buffers such as BatchNorm statistics, frozen parameters, run and hook
            state): an async capture copies these when the save is taken.
        entry: the manifest entry (created, counters, components, associations).
        incremental: write only what changed since the last save into the root (see
            :mod:`fastckpt.container.incremental`); False writes every tensor.
        plan: the incremental plan, once :func:`plan_incremental` made it.
    """

    def __init__(self) -> None:
        """An empty snapshot."""
        self.tensor_files: dict[str, dict[str, torch.Tensor]] = {}
        self.json_files: dict[str, Any] = {}
        self.volatile: set[tuple[str, str]] = set()
        self.names: dict[str, list[str]] = {kind: [] for kind in KINDS}
        self.associations: dict[str, dict[str, str | None]] = {
            "optimizers": {},
            "schedulers": {},
        }
        self.counters: dict[str, int] = {}
        #: model name -> its frozen parameters' names (only models that have some)
        self.frozen: dict[str, list[str]] = {}
        #: model name -> its non-contiguous tensors' strides (only models that have some)
        self.strides: dict[str, dict[str, list[int]]] = {}
        #: model name -> its modules' training modes where they differ from their parent's
        self.modes: dict[str, dict[str, bool]] = {}
        self.incremental = True
        self.plan: incremental.Plan | None = None

    @property
    def entry(self) -> dict[str, Any]:
        """The manifest entry for this snapshot (without the files record)."""
        return {
            "created": _now(),
            "counters": dict(self.counters),
            "components": {kind: sorted(self.names[kind]) for kind in KINDS},
            "associations": self.associations,
            **({FROZEN_FIELD: self.frozen} if self.frozen else {}),
            **({STRIDES_FIELD: self.strides} if self.strides else {}),
            **({MODES_FIELD: self.modes} if self.modes else {}),
        }


def create_snapshot(
    models: Components | None = None,
    optimizers: Components | None = None,
    schedulers: Components | None = None,
    associations: Mapping[str, Any] | None = None,
    counters: Mapping[str, int] | None = None,
) -> Snapshot:
    """Validate components and collect what :func:`write_snapshot` writes (no copies, no I/O).

    Raises:
        TypeError / ValueError / CheckpointFormatError: invalid components or names.
    """
    models = _component_map("models", models)
    optimizers = _component_map("optimizers", optimizers)
    schedulers = _component_map("schedulers", schedulers)
    for kind, components in zip(KINDS, (models, optimizers, schedulers), strict=True):
        for name in components:
            what = f"{kind[:-1]} name"
            check_name_length(_text_name(check_name(name, what), what), what)
    _check_associations(associations, optimizers, schedulers)
    snapshot = _plan_components(models, optimizers, schedulers, associations)
    snapshot.counters = _checked_counters(counters)
    return snapshot


def _text_name(name: str, what: str) -> str:
    """``name`` if it can be written as UTF-8, else an :class:`InvalidInputError` naming it
    (a lone surrogate, as ``surrogateescape`` decoding leaves: a bare ``UnicodeEncodeError``
    from the file writer before, after the root was made)."""
    if not is_text(name):
        raise InvalidInputError(
            f"{what} {name!r} is not valid Unicode text (a lone surrogate); a checkpoint's "
            "names are UTF-8: rename it"
        )
    return name


def _component_map(kind: str, value: Any) -> dict[str, Any]:
    """``models`` / ``optimizers`` / ``schedulers`` as a dict (None: none), else a
    ``TypeError`` saying how to pass them (a bare module or optimizer is the usual slip)."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise TypeError(
            f"{kind} must be a mapping of name -> ({kind[:-1]}, spec or None), got "
            f"{type(value).__name__}: pass {kind}={{'main': (your_{kind[:-1]}, None)}}"
        )
    return dict(value)


def _check_associations(
    associations: Any, optimizers: Mapping[str, Any], schedulers: Mapping[str, Any]
) -> None:
    """Refuse ``associations`` that name no saved component (they would be dropped without
    a word): a mapping ``{"optimizers": {optimizer: model}, "schedulers": {scheduler:
    optimizer}}`` or ``{component: target}``, naming saved optimizers and schedulers."""
    if associations is None:
        return
    shape = (
        "{'optimizers': {optimizer: model}, 'schedulers': {scheduler: optimizer}} or "
        "{optimizer_or_scheduler: target}"
    )
    if not isinstance(associations, Mapping):
        raise TypeError(f"associations must be a mapping {shape}, got {associations!r}")
    saved = {"optimizers": set(optimizers), "schedulers": set(schedulers)}
    for key, value in associations.items():
        if key in saved and isinstance(value, Mapping):
            named = set(value)
            if named - saved[key]:
                raise KeyError(
                    f"associations[{key!r}] names {sorted(named - saved[key])}, which are not "
                    f"among the saved {key} ({sorted(saved[key])})"
                )
        elif key not in saved["optimizers"] | saved["schedulers"]:
            raise KeyError(
                f"associations names {key!r}, which is no saved optimizer or scheduler "
                f"(optimizers {sorted(saved['optimizers'])}, schedulers "
                f"{sorted(saved['schedulers'])}); the shape is {shape}"
            )


def _checked_counters(counters: Mapping[str, int] | None) -> dict[str, int]:
    """``counters`` as a dict, refused unless it maps ``str`` names to ``int`` values (not
    ``bool``: a manifest records whole numbers, JSON has none for NaN)."""
    if counters is None:
        return {}
    if not isinstance(counters, Mapping):
        raise TypeError(f"counters must be a mapping of str to int, got {type(counters).__name__}")
    for name, value in counters.items():
        if not isinstance(name, str) or isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(
                f"counters[{name!r}] = {value!r}: counters are whole numbers (step, epoch, ...) "
                "named by str; record other values elsewhere (e.g. a CheckpointHook's state)"
            )
    return dict(counters)


def check_incremental(incremental: object, where: str) -> bool:
    """``incremental`` when it is a bool (a save's ``incremental=`` argument).

    Raises:
        TypeError: naming ``where``: ``incremental="false"`` would be true.
    """
    if not isinstance(incremental, bool):
        raise TypeError(f"{where}: incremental must be a bool, got {incremental!r}")
    return incremental


def plan_incremental(root: str | os.PathLike[str], snapshot: Snapshot) -> None:
    """Take the tensors of ``snapshot`` that are unchanged since the last save into ``root``
    out of it, as references (no-op when ``snapshot.incremental`` is False or it was planned
    already). Call it before staging copies: it looks at the live tensors."""
    if snapshot.incremental and snapshot.plan is None:
        snapshot.plan = incremental.plan(root, snapshot.tensor_files)


def write_snapshot(
    root: str | os.PathLike[str],
    snapshot: Snapshot,
    checkpoint_index: int | None = -1,
    *,
    lock_timeout: float | None = None,
    check_root: Callable[[Manifest], None] | None = None,
) -> int:
    """Write a snapshot as a committed index of ``root`` (see :func:`save_checkpoint`);
    incrementally unless ``snapshot.incremental`` is False. ``lock_timeout``: give up waiting
    for another process's save or prune of ``root`` after that many seconds (TimeoutError
    naming it; None waits, logging who holds the lock after a second). ``check_root`` is
    called with the root's manifest once the root's lock is held (it cannot change until the
    commit), before anything is written; what it raises aborts the save.

    Returns:
        The committed index.

    Raises:
        TypeError: ``checkpoint_index`` is not an ``int`` or None (the next index).
        ValueError: ``checkpoint_index`` names a committed index that later ones reference.
    """
    requested = checked_index(checkpoint_index, "checkpoint_index", SAVE_INDEX)
    checkpoint_index = -1 if requested is None else requested
    root = Path(root)
    # The manifest is read once, under the root's lock (IndexWriter): the next index is
    # chosen there (and refused there past MAX_INDEX).
    if not -1 <= checkpoint_index <= MAX_INDEX:
        raise ValueError(
            f"checkpoint_index must be -1 (the next) or from 0 to {MAX_INDEX}, got "
            f"{checkpoint_index}"
        )
    plan_incremental(root, snapshot)
    if snapshot.plan is not None:
        # The content proof: digests of the bytes about to be written (outside the lock).
        incremental.confirm(snapshot.plan, snapshot.tensor_files)
    start = time.perf_counter()
    with explain_full_disk(root):

        def check(manifest: Manifest, chosen: int) -> None:
            # Under the lock, before anything changes (an index this save replaces is still
            # committed: on an object store the writer withdraws it next).
            _check_sharded_part(root, chosen, snapshot)
            if check_root is not None:
                check_root(manifest)

        writer = IndexWriter(
            root,
            None if checkpoint_index == -1 else checkpoint_index,
            lock_timeout=lock_timeout,
            check=check,
        )
        index = writer.index
        copies: dict[str, dict[str, CopySource]] = {}
        try:
            refs = _check_references(writer, snapshot)
            if not is_local(backend_for(root)):
                copies = _copy_sources(root, refs)
            for relpath, tensors in snapshot.tensor_files.items():
                writer.add_tensors(relpath, tensors, copies.get(relpath))
            for relpath, document in snapshot.json_files.items():
                writer.add_json(relpath, document)
            if refs and not copies:
                writer.add_json(REFS_FILE, refs_document(refs))
            writer.commit_entry(snapshot.entry)
        except BaseException:
            writer.abort()
            if copies:
                # A copy failed (or something after it): what the next save could have the store
                # copy is unsure now, so it is written in full.
                incremental.forget(root)
            raise
    incremental.record_saved(root, index, snapshot.plan, writer.files)
    log_throughput("saved", f"{root}/{index}", writer.files.values(), start)
    return index


def _check_sharded_part(root: Path, index: int, snapshot: Snapshot) -> None:
    """Under the root's lock, before a sharded index is committed: the part its
    ``strategy.json`` names is there with the commit record its save wrote. Its ranks wrote it
    before the lock was taken; a sweep by a process that took its writer for dead, or a hand,
    may have removed it since, and the index would then be committed naming nothing (a review
    found a prune in another PID namespace doing so, the save reporting success).

    Raises:
        FileNotFoundError / ChecksumMismatchError: naming the part; nothing is committed.
    """
    recipe = snapshot.json_files.get("strategy.json")
    sharded = recipe.get("sharded") if isinstance(recipe, Mapping) else None
    if sharded is None:
        return
    part = part_of(root, index, sharded, f"{root}/{index}/strategy.json")
    if part.name is None or part.record_crc32c is None:
        return  # the layout from before parts: nothing recorded to check against
    try:
        data = read_record_bytes(part.path, SHARDED_RECORD)
    except FileNotFoundError:
        raise FileNotFoundError(
            errno.ENOENT,
            f"{part.path}: the sharded part this save wrote is gone (removed by another "
            f"process before the commit); index {index} was not committed, save again",
            str(part.path),
        ) from None
    if _native.crc32c(data) != part.record_crc32c:
        raise ChecksumMismatchError(
            f"{part.path}/{SHARDED_RECORD}: not the commit record this save wrote (replaced by "
            f"another process before the commit); index {index} was not committed, save again"
        )


def _copy_sources(
    root: Path, refs: dict[str, dict[str, Reference]]
) -> dict[str, dict[str, CopySource]]:
    """On an object store, the referenced tensors of each file as tensors the store copies
    from the committed objects that hold them (every object stays self-contained)."""
    return {
        relpath: {
            name: CopySource(
                Path(root) / str(ref["index"]) / ref["file"],
                ref["name"],
                ref["dtype"],
                list(ref["shape"]),
                ref["crc32c"],
            )
            for name, ref in names.items()
        }
        for relpath, names in refs.items()
    }


def _check_references(writer: IndexWriter, snapshot: Snapshot) -> dict[str, dict[str, Reference]]:
    """Under the root's lock: refuse to replace an index others reference, and write the
    tensors whose referenced bytes are gone (or are in the index being replaced)."""
    manifest = writer.manifest  # read under the lock, which is held until the commit
    retained = writer.root / f"{RETAINED_PREFIX}{writer.index}"  # a pruned, referenced index
    if writer.index in manifest.entries or os.path.lexists(retained):
        users = incremental.referenced_by_others(manifest, writer.index)
        if users:
            raise ValueError(
                f"{writer.root}: index {writer.index} holds tensors that indices {users} "
                "reference; save a new index instead (checkpoint_index=-1), or prune those"
            )
    plan = snapshot.plan
    if plan is None:
        return {}
    restore = incremental.check_plan(manifest, plan, replacing=writer.index)
    if plan.refs and isinstance(writer.staging, LocalStaging):
        # Every index self-contained: the files holding the referenced bytes are linked in.
        linked, unlinked = link_into(writer.staging, manifest, writer.index, plan.refs)
        for relpath, tensors in incremental.unreference(plan, unlinked).items():
            restore.setdefault(relpath, {}).update(tensors)
        plan.refs = linked
    for relpath, tensors in restore.items():
        snapshot.tensor_files[relpath].update(tensors)
    return plan.refs


def check_tensor_state(name: str, state: Mapping[str, Any]) -> None:
    """Refuse a model state (``model.state_dict()`` of model ``name``) holding a value that
    is not a tensor (``get_extra_state()`` returning a dict, ...): component checkpoints store
    model state as tensors only.

    Raises:
        TypeError: naming the model, the entry and the fix.
    """
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"model {name!r}: its state_dict entry {key!r} is a {type(value).__name__}, "
                "not a tensor; a component checkpoint stores model state as tensors only. "
                "Save this model with CheckpointManager (which stores such values), or make "
                "get_extra_state() return a tensor"
            )


def _refuse_shapeless(relpath: str, tensors: Mapping[str, Any]) -> None:
    """Refuse nested, zero and meta tensors among ``tensors`` (for file ``relpath``), and
    names that are no UTF-8, the way every save does (:func:`check_storable`), before the
    plan touches their shapes or storages, which raise torch's internal errors for them, and
    before the root is made (the writer refused a meta tensor or a lone surrogate only after
    it had made a new root, left behind empty). The other checks come when the tensors are
    written."""
    for key, value in tensors.items():
        if isinstance(key, str):
            _text_name(key, f"{relpath}: tensor name")
        if not isinstance(value, torch.Tensor):
            continue
        try:
            shapeless = value.is_nested or value._is_zerotensor() or value.is_meta
        except ValueError:  # an uninitialized (lazy) parameter
            shapeless = True
        if shapeless:
            check_storable(f"{relpath}:{key}", value)


def _plan_components(
    models: dict[str, Any],
    optimizers: dict[str, Any],
    schedulers: dict[str, Any],
    associations: Mapping[str, Any] | None,
) -> Snapshot:
    plan = Snapshot()
    live_models: dict[str, torch.nn.Module] = {}
    for name, component in models.items():
        model, spec = _split(component, "model", name)
        model = unwrap_model(model)
        state = dict(model.state_dict())
        _refuse_shapeless(f"models/{name}.safetensors", state)
        # Proven at every save (the meta build of a recipe is kept: check_recordable).
        spec = spec or build.check_recordable(model, name)
        live_models[name] = model
        relpath = f"models/{name}.safetensors"
        plan.tensor_files[relpath] = state
        check_tensor_state(name, state)
        # Only trainable parameters change in the optimizer step alone (which an async save's
        # background copy is guarded against); buffers and frozen parameters (a momentum
        # encoder updated in forward) may change anywhere: copied when the save is taken.
        trainable = {
            n for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad
        }
        plan.volatile.update(
            (relpath, key) for key in plan.tensor_files[relpath] if key not in trainable
        )
        plan.json_files[f"models/{name}.spec.json"] = spec.to_json()
        plan.names["models"].append(name)
        frozen = frozen_names(model)
        if frozen:
            plan.frozen[name] = frozen
        strides = layouts.recorded_strides(model)
        if strides:
            plan.strides[name] = strides
        modes = module_modes.recorded_modes(model)
        if modes:
            plan.modes[name] = modes

    optimizer_names: dict[int, str] = {}
    for name, component in optimizers.items():
        optimizer, spec = _split(component, "optimizer", name)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer {name!r}: expected a torch.optim.Optimizer")
        owner, refs = _infer_optimizer_owner(optimizer, live_models)
        owner = _association_for(associations, "optimizers", name) or owner
        if owner is not None and owner not in live_models:
            raise KeyError(f"optimizer {name!r} is associated with unknown model {owner!r}")
        if spec is None:
            spec = specs.BaseSpec(
                cls_path=trust.dotted_path(type(optimizer)),
                kwargs=accepted_kwargs(type(optimizer), optimizer.defaults),
                timestamp=_now(),
            )
        skeleton, tensors = tree.flatten(optimizer.state_dict())
        _refuse_shapeless(f"optimizers/{name}.safetensors", tensors)
        plan.tensor_files[f"optimizers/{name}.safetensors"] = tensors
        plan.json_files[f"optimizers/{name}.json"] = {
            "spec": spec.to_json(),
            "params": refs,
            "state": skeleton,
        }
        plan.associations["optimizers"][name] = owner
        plan.names["optimizers"].append(name)
        optimizer_names[id(optimizer)] = name

    for name, component in schedulers.items():
        scheduler, spec = _split(component, "scheduler", name)
        if not callable(getattr(scheduler, "state_dict", None)):  # a bare AttributeError before
            raise TypeError(
                f"scheduler {name!r}: expected an LR scheduler (a "
                "torch.optim.lr_scheduler.LRScheduler, or an object with state_dict()), got "
                f"{type(scheduler).__name__} {scheduler!r}; drop the entry for no scheduler"
            )
        state = scheduler.state_dict()
        target = _association_for(associations, "schedulers", name) or optimizer_names.get(
            id(getattr(scheduler, "optimizer", None))
        )
        if target is None or target not in optimizers:
            raise ValueError(
                f"scheduler {name!r}: its optimizer is not among the saved optimizers "
                f"{sorted(optimizers)}; save it too or pass associations"
            )
        if spec is None:
            spec = scheduler_spec(scheduler, state)
        skeleton, tensors = tree.flatten(state)
        _refuse_shapeless(f"schedulers/{name}.safetensors", tensors)
        plan.tensor_files[f"schedulers/{name}.safetensors"] = tensors
        plan.json_files[f"schedulers/{name}.json"] = {"spec": spec.to_json(), "state": skeleton}
        plan.associations["schedulers"][name] = target
        plan.names["schedulers"].append(name)
    return plan


def scheduler_spec(scheduler: Any, state: Mapping[str, Any] | None = None) -> specs.BaseSpec:
    """The recipe a checkpoint records for a scheduler given without one: its class and the
    constructor arguments found in its ``state_dict()`` (``state``, read when None).

    Raises:
        TypeError: an argument the state does not hold (``SequentialLR``'s schedulers,
            ``LambdaLR``'s function) or a value a recipe cannot store.
    """
    first = _first_parameter(type(scheduler))
    if first is not None and first != "optimizer" and _takes_optimizer_later(type(scheduler)):
        raise TypeError(
            f"{type(scheduler).__name__}'s constructor takes {first!r} first, not the "
            "optimizer: a checkpoint rebuilds a scheduler as cls(optimizer, **arguments), "
            "so this one cannot be recorded (ChainedScheduler takes its schedulers)"
        )
    return specs.BaseSpec(
        cls_path=trust.dotted_path(type(scheduler)),
        kwargs=_constructor_kwargs(
            scheduler, scheduler.state_dict() if state is None else state, skip=1
        ),
        timestamp=_now(),
    )


def _takes_optimizer_later(cls: type) -> bool:
    """Whether ``cls``'s constructor has an ``optimizer`` parameter after its first (a
    custom scheduler naming its first parameter ``opt`` takes the optimizer there)."""
    try:
        return "optimizer" in list(inspect.signature(cls).parameters)[1:]
    except (TypeError, ValueError):
        return False


def _first_parameter(cls: type) -> str | None:
    """The name of the first parameter of ``cls``'s constructor after ``self`` (None: none,
    or no signature)."""
    try:
        parameters = list(inspect.signature(cls).parameters)  # without self
    except (TypeError, ValueError):
        return None
    return parameters[0] if parameters else None


class IndexReader:
    """Reads files of one committed index, checking each against the manifest.

    Attributes:
        directory: the index directory.
        files: relpath -> ``{"size", "crc32c"}`` from the manifest.
    """

    def __init__(self, manifest: Manifest, index: int) -> None:
        """Read index ``index`` of ``manifest`` (which must be committed)."""
        self.manifest = manifest
        self.index = index
        self.root = manifest.root
        self.directory = manifest.directory(index)
        self.files: dict[str, dict[str, int]] = manifest.entries[index]["files"]
        self._refs: dict[str, dict[str, Reference]] | None = None

    @property
    def references(self) -> dict[str, dict[str, Reference]]:
        """relpath -> {tensor name: reference} of an incremental index (empty otherwise)."""
        if self._refs is None:
            self._refs = index_references(self.manifest, self.index)
        return self._refs

    def _record(self, relpath: str) -> tuple[Path, dict[str, int]]:
        record = self.files.get(relpath)
        if record is None:
            raise CheckpointFormatError(
                f"{self.directory / relpath}: not listed in the manifest; the checkpoint is "
                "incomplete or the manifest was edited"
            )
        return self.manifest.file_path(self.index, relpath), record

    def component_state(self, kind: str, name: str, map_location: Any = None) -> Any:
        """The ``state_dict()`` saved for optimizer/scheduler ``name`` (kind: "optimizers" or
        "schedulers"), tensors moved to ``map_location``."""
        check_name(name, f"{kind[:-1]} name")
        document = self.json(f"{kind}/{name}.json")
        if not isinstance(document, Mapping):
            raise CheckpointFormatError(f"{self.directory}/{kind}/{name}.json must be an object")
        state = tree.unflatten(
            document.get("state"), self.tensors(f"{kind}/{name}.safetensors"), name
        )
        return state if map_location is None else _move_tensors(state, map_location)

    def json(self, relpath: str) -> Any:
        """The verified JSON document ``relpath``."""
        path, record = self._record(relpath)
        return read_json(path, record, source=str(self.manifest.path))

    def tensors(self, relpath: str, *, owned: bool = True) -> dict[str, torch.Tensor]:
        """The verified tensors of ``relpath``. ``owned`` (default) returns tensors in memory of
        their own, for state a training run keeps (optimizer moments, EMA weights, RNG): views
        would keep the file, and its disk space after a prune, alive for the whole run.
        ``owned=False`` returns views of the file mapping, for weights that
        ``load_state_dict`` copies. Owned tensors of a local file that references no other
        index are read into their memory directly (:meth:`read_into`), else copied out of
        the mapping."""
        if owned and self.reads_directly(relpath):
            return self.read_into(relpath)
        path, record = self._record(relpath)
        tensors = read_tensor_file(path, record, source=str(self.manifest.path))
        if owned:
            tensors = {name: tensor.clone() for name, tensor in tensors.items()}
        refs = self.references.get(relpath) if REFS_FILE in self.files else None
        if refs:
            tensors.update(resolve_references(self.manifest, refs, owned=owned))
        return tensors

    def reads_directly(self, relpath: str) -> bool:
        """Whether :meth:`read_into` can read ``relpath``: a file on the local filesystem
        whose tensors are all in it (no references to earlier indices)."""
        if not is_local(backend_for(self.directory)):
            return False
        return not (REFS_FILE in self.files and self.references.get(relpath))

    def read_into(
        self,
        relpath: str,
        targets: Mapping[str, torch.Tensor] | None = None,
        *,
        fresh_targets: bool = False,
    ) -> dict[str, torch.Tensor]:
        """The verified tensors of ``relpath`` read in one pass, those named in ``targets``
        into those tensors (``fresh_targets``: memory allocated for this load, never touched),
        the others into fresh memory (:func:`fastckpt.container.reader.read_tensor_file_into`);
        only for a file :meth:`reads_directly` accepts."""
        path, record = self._record(relpath)
        return read_tensor_file_into(
            path,
            record,
            targets,
            source=str(self.manifest.path),
            fresh_targets=fresh_targets,
        )

    def header(self, relpath: str) -> dict[str, dict[str, Any]]:
        """``{tensor name: {"dtype", "shape", ...}}`` of ``relpath``'s header (no tensor data
        read; the bytes are checked when they are read)."""
        path, _ = self._record(relpath)
        return read_metadata(path)["tensors"]


def _load_model(
    reader: IndexReader,
    name: str,
    spec: specs.BaseSpec,
    map_location: str | torch.device | None,
    trusted: Trusted,
) -> torch.nn.Module:
    """Build model ``name`` from ``spec`` and load its weights. A local weights file of a plain
    model (:mod:`fastckpt.checkpoint.fill`) is read straight into the parameters, which are
    left uninitialized until then; otherwise the model is built and initialized, and the
    mapped weights go through ``load_state_dict``. Either way every parameter and buffer the
    file holds ends in the dtype it was saved in (not the constructor's: a model converted
    after construction, ``.to(torch.bfloat16)``, loads in bfloat16), with the saved bits."""
    relpath = f"models/{name}.safetensors"
    where = f"{reader.directory}/models/{name}.spec.json"
    if reader.reads_directly(relpath):
        header = reader.header(relpath)
        shapes = {  # torch shapes: a header counts F4 elements, torch pairs of them
            name: {"shape": torch_shape(f"{relpath}: tensor {name!r}", e["dtype"], e["shape"])}
            for name, e in header.items()
        }
        model = build.build_model(
            spec,
            expected=shapes,
            device=map_location,
            trusted=trusted,
            where=where,
            uninitialized_if=lambda probe: fill.fully_restored_by(probe, header),
            dtypes=fill.saved_dtypes(header),
        )
        fresh = build.built_uninitialized(model)
        targets = fill.direct_targets(model, header)
        if targets is not None:
            reader.read_into(relpath, targets, fresh_targets=fresh)
            return model
        weights = reader.tensors(relpath, owned=False)
    else:
        weights = reader.tensors(relpath, owned=False)
        model = build.build_model(
            spec,
            expected=weights,
            device=map_location,
            trusted=trusted,
            where=where,
            dtypes=fill.saved_dtypes(weights),
        )
    try:
        model.load_state_dict(weights)
    except RuntimeError as err:
        raise CheckpointFormatError(
            f"{reader.directory}/{relpath} does not fit the model its spec builds: {err}"
        ) from err
    return model


def _spec_from(document: Any, where: str) -> specs.BaseSpec:
    if not isinstance(document, Mapping):
        raise CheckpointFormatError(f"{where}: spec must be an object")
    return specs.BaseSpec.from_json(document, source=where)


def _rebuild_optimizer(
    document: Mapping[str, Any],
    state: Any,
    loaded_models: Mapping[str, torch.nn.Module],
    trusted: Trusted,
    where: str,
) -> tuple[torch.optim.Optimizer, specs.BaseSpec]:
    spec = _spec_from(document.get("spec"), where)
    with build.naming_file(where):
        cls = trust.resolve_target(spec.cls_path, "optimizer", trusted)
    refs = document.get("params")
    if not isinstance(refs, list) or not isinstance(state, dict):
        raise CheckpointFormatError(f"{where}: 'params' and 'state' are required")
    params = []
    by_model: dict[str, dict[str, torch.nn.Parameter]] = {}  # once per model, not per ref
    for ref in refs:
        if not (isinstance(ref, list) and len(ref) == 2 and ref[0] in loaded_models):
            raise CheckpointFormatError(f"{where}: bad parameter reference {ref!r}")
        named = by_model.get(ref[0])
        if named is None:
            named = dict(loaded_models[ref[0]].named_parameters(remove_duplicate=False))
            by_model[ref[0]] = named
        if not isinstance(ref[1], str) or ref[1] not in named:
            raise CheckpointFormatError(f"{where}: model {ref[0]!r} has no parameter {ref[1]!r}")
        params.append(named[ref[1]])
    groups = []
    for group in state.get("param_groups", []):
        indices = group.get("params", [])
        groups.append({"params": [params[i] for i in indices]})
    optimizer = cls(groups or params, **spec.kwargs)
    load_optimizer_state(optimizer, state)
    return optimizer, spec


def load_scheduler_state(scheduler: Any, state: Any, where: str) -> None:
    """``scheduler.load_state_dict(state)``, refusing state that would replace one of the
    scheduler's own attributes rather than saved state: torch's ``load_state_dict`` updates
    ``__dict__`` with whatever it is given, so an edited record holding ``"optimizer"`` or
    ``"step"`` loaded silently and broke the scheduler at its first step (a bare
    ``AttributeError`` from inside torch). Keys the scheduler does not have at all (state of
    another torch version) are kept, as torch keeps them.

    Raises:
        CheckpointFormatError: names ``where`` and the keys.
    """
    if not isinstance(state, Mapping):
        raise CheckpointFormatError(f"{where}: a scheduler's state must be an object")
    own = scheduler.state_dict()
    shadowing = sorted(
        repr(key)
        for key in state
        if not isinstance(key, str)
        or (key not in own and (key.startswith("__") or hasattr(scheduler, key)))
    )
    if shadowing:
        raise CheckpointFormatError(
            f"{where}: the scheduler's state has {', '.join(shadowing)}, which would replace "
            f"the {type(scheduler).__name__}'s own attributes (its optimizer, its methods), "
            "not saved state; the record was edited: load another checkpoint"
        )
    scheduler.load_state_dict(state)


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: Mapping[str, Any]) -> None:
    """``optimizer.load_state_dict(state)``, keeping the saved dtype of every per-parameter
    state tensor.

    torch's ``Optimizer.load_state_dict`` casts each floating-point state tensor (but
    ``step``) to its parameter's dtype; state saved in another dtype (float32 moments of a
    bfloat16 parameter, a master copy) would come back rounded. Such a tensor is put back as
    it was saved (on the device torch moved it to), so the optimizer holds the saved state
    bitwise (a copy, as torch's own cast is).

    Args:
        optimizer: the rebuilt optimizer, over the loaded model's parameters.
        state: the saved ``state_dict()`` (``"state"`` keyed by parameter number,
            ``"param_groups"`` listing them).
    """
    optimizer.load_state_dict(state)  # type: ignore[arg-type]
    saved_numbers = [n for group in state.get("param_groups", []) for n in group["params"]]
    live_params = [p for group in optimizer.param_groups for p in group["params"]]
    by_number = dict(zip(saved_numbers, live_params, strict=False))
    for number, saved in dict(state.get("state", {})).items():
        param = by_number.get(number)
        live = optimizer.state.get(param) if param is not None else None
        if not isinstance(saved, Mapping) or not isinstance(live, dict):
            continue
        for key, value in saved.items():
            current = live.get(key)
            if (
                isinstance(value, torch.Tensor)
                and isinstance(current, torch.Tensor)
                and current.dtype != value.dtype
            ):
                # A copy: ``value`` may be a view of the file's mapping, which training state
                # never keeps (a later prune frees the disk space; RELIABILITY, known gaps).
                live[key] = value.to(device=current.device, copy=True)


def check_validators(validators: Any) -> None:
    """Refuse ``validators`` of a shape :func:`run_validators` cannot use, before anything is
    loaded: ``3`` and ``{"m": 3}`` failed with "'int' object is not iterable", and ``"x"``
    was run letter by letter, blaming the model ("validator 'x' rejected model 'm'").

    Raises:
        TypeError: not None, a callable ``validator(model)``, a list (tuple, set) of them, or
            a mapping of model name -> one of those (names the entry and the fix).
    """
    if isinstance(validators, Mapping):
        for name, selected in validators.items():
            if not isinstance(name, str):
                raise TypeError(
                    f"validators must map model names (str) to validators, got the key {name!r}"
                )
            _validator_list(selected, f"validators[{name!r}]")
    elif validators is not None:
        _validator_list(validators, "validators")


def _validator_list(selected: Any, what: str) -> list[Callable[[torch.nn.Module], Any]]:
    """``selected`` (a callable or a collection of callables) as a list, else a
    ``TypeError`` naming ``what``."""
    if callable(selected):
        return [selected]
    valid = isinstance(selected, Collection) and not isinstance(selected, (str, bytes, Mapping))
    if not valid or not all(callable(item) for item in selected):
        raise TypeError(
            f"{what} must be a callable validator(model) or a list of them "
            f"(or {{model_name: [validators]}}), got {selected!r} (a generator would be used "
            "up by the first model: pass a list)"
        )
    return list(selected)


def run_validators(validators: Any, model_name: str, model: torch.nn.Module) -> None:
    """Run the validators selected for ``model_name`` on ``model``; a failure raises
    ``ValueError`` naming both, a malformed ``validators`` a ``TypeError``
    (:func:`check_validators`)."""
    check_validators(validators)
    if validators is None:
        return
    selected = validators.get(model_name, ()) if isinstance(validators, Mapping) else validators
    for validator in _validator_list(selected, "validators"):
        try:
            validator(model)
        except Exception as err:
            label = getattr(validator, "__qualname__", repr(validator))
            raise ValueError(f"validator {label} rejected model {model_name!r}: {err}") from err


def _refuse_a_sharded_index(reader: IndexReader, available: list[str]) -> None:
    """Raise when the index holds its models as an FSDP2 strategy's shards (none in the
    index's own files): before, ``load_checkpoint`` returned no model and no strategy
    without a word, and ``model_names=`` raised a bare ``KeyError``."""
    if available or "strategy.json" not in reader.files:
        return
    recipe = reader.json("strategy.json")
    if isinstance(recipe, Mapping) and recipe.get("sharded") is not None:
        raise ValueError(
            f"{reader.directory}: this index holds FSDP2-sharded models (their shards are "
            "under the root's sharded/ directory); load it with "
            "fastckpt.TrainingStrategy.load_checkpoint(root, ..., parallelize=...) (without "
            "parallelize= it loads whole in one process), or write the full tensors with "
            "fastckpt export"
        )


def load_components(
    root: str | os.PathLike[str],
    checkpoint_index: int | None = -1,
    map_location: str | torch.device | None = None,
    model_names: Sequence[str] | None = None,
    *,
    validators: Any = None,
    trusted: Trusted = None,
) -> dict[str, Any]:
    """:func:`load_checkpoint` without restoring a strategy (no RNG or hook side effects).

    ``checkpoint_index`` and ``model_names`` are checked as there (``TypeError`` for an index
    that is not an ``int`` or None, or a string ``model_names``).

    Returns:
        The same dict with ``strategy`` None, plus ``reader``: the :class:`IndexReader` of
        the loaded index.
    """
    start = time.perf_counter()
    trusted = trust.frozen_trusted(trusted)
    check_validators(validators)
    requested = checked_index(checkpoint_index, "checkpoint_index", LOAD_INDEX)
    model_names = checked_model_names(model_names)
    manifest = Manifest.load(root, verify_checksum=True)
    index = manifest.resolve(-1 if requested is None else requested)
    entry = manifest.entries[index]
    reader = IndexReader(manifest, index)
    components = entry.get("components", {})
    available = [check_name(n, "model name") for n in components.get("models", [])]
    _refuse_a_sharded_index(reader, available)
    wanted = list(available if model_names is None else model_names)
    unknown = [name for name in wanted if name not in available]
    if unknown:
        raise KeyError(f"unknown model names {unknown}; this checkpoint has {available}")

    models: dict[str, dict[str, Any]] = {}
    for name in wanted:
        where = f"models/{name}.spec.json"
        spec = _spec_from(reader.json(where), where)
        model = _load_model(reader, name, spec, map_location, trusted)
        freeze(
            model, entry.get(FROZEN_FIELD, {}).get(name), f"{manifest.path}: {FROZEN_FIELD}.{name}"
        )
        layouts.apply_strides(
            model,
            entry.get(STRIDES_FIELD, {}).get(name),
            f"{manifest.path}: {STRIDES_FIELD}.{name}",
        )
        module_modes.apply_modes(
            model, entry.get(MODES_FIELD, {}).get(name), f"{manifest.path}: {MODES_FIELD}.{name}"
        )
        if map_location is not None:
            model.to(map_location)
        run_validators(validators, name, model)
        models[name] = {
            "model": model,
            "spec": spec,
            "optimizers": {},
            "schedulers": {},
            "metadata": {"associations": entry.get("associations", {})},
        }

    loaded = {name: record["model"] for name, record in models.items()}
    associations = entry.get("associations", {})
    optimizer_owner: dict[str, str] = {}
    optimizer_states: dict[str, Any] = {}
    for name in components.get("optimizers", []):
        check_name(name, "optimizer name")
        owner = associations.get("optimizers", {}).get(name)
        where = f"optimizers/{name}.json"
        document = reader.json(where)
        if not isinstance(document, Mapping):
            raise CheckpointFormatError(f"{where}: must be an object")
        # Each reference is [model, parameter], its model one of this index's: checked before
        # the skip below, which a malformed reference must not reach (it dropped the optimizer
        # and its schedulers without a word, or raised a bare TypeError).
        params = document.get("params")
        refs: list[Any] = params if isinstance(params, list) else [params]  # 7: "found 7"
        malformed = [
            ref
            for ref in refs
            if not (
                isinstance(ref, list)
                and len(ref) == 2
                and all(isinstance(part, str) for part in ref)
                and ref[0] in available
            )
        ]
        if malformed:
            raise CheckpointFormatError(
                f"{reader.directory / where}: field 'params' must be a list of [model, "
                f"parameter] references to this index's models {available}, found "
                f"{malformed[0]!r}; the record was edited or damaged: load another checkpoint"
            )
        if owner not in loaded or any(model not in loaded for model, _ in refs):
            continue  # its model (or one of its models) was not requested
        state = tree.unflatten(
            document.get("state"), reader.tensors(f"optimizers/{name}.safetensors"), name
        )
        if map_location is not None:
            state = _move_tensors(state, map_location)
        try:
            optimizer, spec = _rebuild_optimizer(
                document, state, loaded, trusted, str(reader.directory / where)
            )
        except FastCkptError:
            raise
        except Exception as err:
            raise CheckpointFormatError(
                f"{reader.directory / where}: cannot rebuild the optimizer: {err}"
            ) from err
        models[owner]["optimizers"][name] = {"optimizer": optimizer, "spec": spec}
        optimizer_owner[name] = owner
        optimizer_states[name] = state

    for name in components.get("schedulers", []):
        check_name(name, "scheduler name")
        target = associations.get("schedulers", {}).get(name)
        if target not in optimizer_owner:
            continue
        where = f"schedulers/{name}.json"
        document = reader.json(where)
        if not isinstance(document, Mapping):
            raise CheckpointFormatError(f"{where}: must be an object")
        spec = _spec_from(document.get("spec"), where)
        owner = optimizer_owner[target]
        optimizer = models[owner]["optimizers"][target]["optimizer"]
        state = tree.unflatten(
            document.get("state"), reader.tensors(f"schedulers/{name}.safetensors"), name
        )
        try:
            with build.naming_file(str(reader.directory / where)):
                cls = trust.resolve_target(spec.cls_path, "scheduler", trusted)
            # Constructing a scheduler steps it once and rewrites the optimizer's learning
            # rates; reloading the saved optimizer state and then the scheduler's restores both.
            scheduler = cls(optimizer, **spec.kwargs)
            load_optimizer_state(optimizer, optimizer_states[target])
            load_scheduler_state(scheduler, state, f"{reader.directory / where}")
        except FastCkptError:
            raise
        except Exception as err:
            raise CheckpointFormatError(
                f"{reader.directory / where}: cannot rebuild the scheduler: {err}"
            ) from err
        models[owner]["schedulers"][name] = {"scheduler": scheduler, "spec": spec}

    log_throughput("loaded", str(reader.directory), reader.files.values(), start)
    return {
        "checkpoint_index": index,
        "manifest": entry,
        "strategy": None,
        "reader": reader,
        "source": {"format": "fastckpt", "path": str(manifest.root / str(index))},
        "models": models,
    }


def _move_tensors(value: Any, device: str | torch.device) -> Any:
    return tree.map_tensors(value, lambda tensor: tensor.to(device))
