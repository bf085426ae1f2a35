"""Stateful objects in saved state and load templates (the DCP / torchsnapshot convention).

An object with ``state_dict()`` and ``load_state_dict()`` - a module, an optimizer, a
scheduler, a user class - may stand anywhere in a saved state or in a load template:

* :func:`prepare_save` replaces each one by its ``state_dict()`` (called at save time, so an
  async save snapshots that moment), and checks every other value, raising ``TypeError``
  naming its full key path (``model.layer``) for anything that cannot be checkpointed;
* :func:`check_template` refuses, before anything is read, template values that a load
  would otherwise silently ignore;
* :func:`restore` loads a value into a template: each stateful object gets
  ``load_state_dict()`` with the loaded state, tensors elsewhere in the template are filled in
  place, mappings and sequences are walked (the manager's one template merge);
* :func:`check_restore`, which :func:`restore` runs first, raises every mismatch
  :func:`restore` would meet (dtypes, shapes, structure, keys missing under ``strict``, the
  tensors a stateful object holds, a plain module's key set, an optimizer's state against
  its parameters: :func:`check_optimizer_state`) from metadata alone, so a
  refused load leaves the template untouched. The manager's direct reads run it on the
  checkpoint's headers before any byte is read into a template.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch
from torch.nn.modules.batchnorm import _NormBase
from torch.nn.parameter import is_lazy

from fastckpt.checkpoint.fill import plain_state
from fastckpt.container.templates import check_tensor_template, is_dtensor
from fastckpt.errors import CheckpointMismatchError
from fastckpt.format.records import MAX_JSON_DEPTH, nesting_depth
from fastckpt.io import tree
from fastckpt.io.files import check_storable
from fastckpt.io.paths import is_text

__all__ = [
    "PARAMETER_SHAPED_OPTIMIZERS",
    "PARAMETER_SHAPED_STATE",
    "Stateful",
    "check_depth",
    "check_nesting",
    "check_optimizer_state",
    "check_restore",
    "check_template",
    "contains_stateful",
    "is_stateful",
    "prepare_save",
    "restore",
]

_SCALARS = (bool, int, float, str, type(None))
_KEY_TYPES = (str, int, float, bool, type(None))


@runtime_checkable
class Stateful(Protocol):
    """What :func:`is_stateful` accepts: ``state_dict()`` and ``load_state_dict(state)``."""

    def state_dict(self) -> Any:
        """The object's state: a nest of tensors and plain values."""

    def load_state_dict(self, state_dict: Any) -> Any:
        """Restore the object from a state its ``state_dict()`` returned."""


def is_stateful(value: Any) -> bool:
    """Whether ``value`` is an object (not a class, a mapping or a tensor) with callable
    ``state_dict`` and ``load_state_dict``."""
    if isinstance(value, (type, Mapping, torch.Tensor)):
        return False
    return callable(getattr(value, "state_dict", None)) and callable(
        getattr(value, "load_state_dict", None)
    )


def contains_stateful(value: Any) -> bool:
    """Whether a stateful object stands anywhere in a nest of mappings, lists and tuples."""
    if is_stateful(value):
        return True
    if isinstance(value, Mapping):
        return any(contains_stateful(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return any(contains_stateful(item) for item in value)
    return False


def _describe(value: Any) -> str:
    return f"{type(value).__module__}.{type(value).__qualname__}"


def _unsupported(value: Any, path: str, action: str) -> TypeError:
    where = path or "<root>"
    base = next((t for t in (bool, int, float, str) if isinstance(value, t)), None)
    if base is not None:
        name = base.__name__
        return TypeError(
            f"{where}: cannot {action} a {_describe(value)}: it would load back as a plain "
            f"{name}; store {name}(value) (an enum's .value) and convert it back after loading"
        )
    if callable(getattr(value, "state_dict", None)):
        hint = (
            "it has state_dict() but no load_state_dict(); pass value.state_dict() "
            "(a plain state) or give it a load_state_dict()"
        )
    else:
        hint = (
            "supported are tensors, None, bool, int, float, str, dicts/lists/tuples of them, "
            "and objects with state_dict() and load_state_dict() (modules, optimizers, "
            "schedulers, your own classes); convert it, e.g. to a tensor or a list"
        )
    return TypeError(f"{where}: cannot {action} a {_describe(value)}; {hint}")


#: The deepest nesting of a saved item's dicts, lists and tuples: its skeleton (with a
#: level or two of markers) must stay within what loads read (``MAX_JSON_DEPTH``).
MAX_NESTING = MAX_JSON_DEPTH - 10


def check_nesting(value: Any, key: str, limit: int = MAX_NESTING) -> None:
    """Refuse an item nested too deeply to be loaded back: its value before it is encoded
    (:data:`MAX_NESTING`; the encoded skeleton: :func:`check_depth`).

    Raises:
        TypeError: names the item and the limit.
    """
    check_depth(nesting_depth(value, limit), key, limit)


def check_depth(depth: int, key: str, limit: int) -> None:
    """Refuse an item whose lists and objects nest ``depth`` levels deep, past ``limit``: its
    encoded skeleton's depth (from :func:`fastckpt.io.tree.flatten_measured`; a tuple takes
    two levels), against the levels a load reads (``MAX_JSON_DEPTH``) less the document's own.

    Raises:
        TypeError: names the item and the limit.
    """
    if depth > limit:
        raise TypeError(
            f"{key}: its dicts, lists and tuples nest too deeply (more than {limit} levels "
            "as stored) for a checkpoint to hold; flatten it (e.g. join the inner keys "
            "into one)"
        )


_WARNED_PLAIN: set[type] = set()


def _warn_plain(value: Any, path: str, plain: str) -> None:
    """Say once per type that a mapping or list of another type loads back as a plain one
    (a Lightning ``AttributeDict``, a config class with methods, a ``UserDict``)."""
    if type(value) in _WARNED_PLAIN:
        return
    _WARNED_PLAIN.add(type(value))
    warnings.warn(
        f"{path or '<root>'}: a {_describe(value)} is saved as its items and loads back as a "
        f"plain {plain} (its type and methods are not stored); rebuild it after loading, or "
        "give it state_dict() and load_state_dict() (said once per type)",
        UserWarning,
        stacklevel=4,
    )


def prepare_save(value: Any, path: str = "", *, check: bool = True, given: bool = True) -> Any:
    """``value`` with every stateful object replaced by its ``state_dict()``, checked.

    Containers are rebuilt (mappings become dicts; lists and plain tuples keep their type);
    tensors and plain values are kept as they are (not copied).

    Args:
        value: a saved item (or the whole state).
        path: its key path, for messages (the item key at the top level).
        given: ``value`` is the caller's own (not inside what a ``state_dict()`` returned,
            which goes back to its ``load_state_dict``): a mapping or list of another type
            than ``dict``, ``OrderedDict`` and ``list`` there is warned of (once per type), as
            it loads back as a plain dict or list (an ``OrderedDict`` loads back as a dict, in
            the same order).

    Raises:
        TypeError: a value that cannot be checkpointed, or a dict key that cannot, named by
            its full key path (with the fix: ``state_dict()`` objects are accepted); a tensor
            whose bytes cannot be stored (``InvalidInputError``, see
            :func:`~fastckpt.io.files.check_storable`; not checked with ``check`` False, for
            load templates).
    """
    if isinstance(value, torch.Tensor):
        if is_dtensor(value) or not check:  # a DTensor is saved sharded (fastckpt.dcp)
            return value
        return check_storable(path, value)
    if type(value) in _SCALARS:  # exact: an enum or numpy scalar would lose its type
        return value
    if is_stateful(value):
        return prepare_save(value.state_dict(), path, check=check, given=False)
    if isinstance(value, Mapping):
        if check and hasattr(type(value), "__missing__"):
            raise TypeError(
                f"{path or '<root>'}: cannot checkpoint a {type(value).__name__}: it would load "
                "back as a plain dict, without its default for missing keys; store "
                "dict(value) and rebuild it after loading"
            )
        if check and given and type(value) not in (dict, OrderedDict):
            _warn_plain(value, path, "dict")
        for key in value:
            if type(key) not in _KEY_TYPES:
                raise TypeError(
                    f"{tree.join_path(path, key)}: dict keys must be str, int, float, bool or "
                    f"None, got {type(key).__name__}"
                )
            if isinstance(key, str) and not is_text(key):
                raise TypeError(
                    f"{tree.join_path(path, key)!r}: a dict key must be valid Unicode text "
                    "(this one holds a lone surrogate, e.g. from a file name decoded with "
                    "surrogateescape); decode it properly or use another key"
                )
        return {
            key: prepare_save(item, tree.join_path(path, key), check=check, given=given)
            for key, item in value.items()
        }
    if type(value) is tuple:
        return tuple(
            prepare_save(item, tree.join_path(path, i), check=check, given=given)
            for i, item in enumerate(value)
        )
    if isinstance(value, list):
        if check and given and type(value) is not list:
            _warn_plain(value, path, "list")
        return [
            prepare_save(item, tree.join_path(path, i), check=check, given=given)
            for i, item in enumerate(value)
        ]
    raise _unsupported(value, path, "checkpoint")


def check_template(template: Any, path: str = "") -> None:
    """Refuse template values a load could not apply, before anything is read.

    Accepted: ``None`` (load the value as saved), tensors (filled in place; not a meta
    tensor, nor one whose elements share memory), plain values (replaced), stateful objects
    (``load_state_dict``), and mappings, lists and tuples of these.

    Raises:
        TypeError: any other template value, named by its key path.
    """
    if isinstance(template, torch.Tensor):
        check_tensor_template(template, path)
        return
    if template is None or isinstance(template, _SCALARS):
        return
    if is_stateful(template):
        return
    if isinstance(template, Mapping):
        for key, item in template.items():
            check_template(item, tree.join_path(path, key))
        return
    if isinstance(template, (list, tuple)):
        for i, item in enumerate(template):
            check_template(item, tree.join_path(path, i))
        return
    raise _unsupported(template, path, "load into")


def _check_tensors(current: Any, loaded: Any, path: str) -> None:
    """Compare the tensors an object holds with the loaded ones at the same key paths."""
    if isinstance(current, torch.Tensor):
        if not isinstance(loaded, torch.Tensor):
            raise CheckpointMismatchError(
                f"{path}: the object holds a tensor here, the checkpoint has a "
                f"{type(loaded).__name__}"
            )
        if current.dtype != loaded.dtype or current.shape != loaded.shape:
            raise CheckpointMismatchError(
                f"{path}: the object holds dtype {current.dtype} shape {tuple(current.shape)}, "
                f"the checkpoint has dtype {loaded.dtype} shape {tuple(loaded.shape)}; no "
                "implicit cast or broadcast is done: fix the object or convert after loading"
            )
        return
    if isinstance(current, Mapping) and isinstance(loaded, Mapping):
        for key, item in current.items():
            if key in loaded:
                _check_tensors(item, loaded[key], tree.join_path(path, key))
    elif isinstance(current, (list, tuple)) and isinstance(loaded, (list, tuple)):
        for i, (item, other) in enumerate(zip(current, loaded, strict=False)):
            _check_tensors(item, other, tree.join_path(path, i))


def _owned(value: Any) -> Any:
    """Tensors copied out of the file mapping: an object keeps what it is given (an
    optimizer keeps its moments), and views would keep the checkpoint file mapped."""
    return tree.map_tensors(value, lambda tensor: tensor.clone())


def _load_into(obj: Any, value: Any, path: str) -> Any:
    """``obj.load_state_dict`` with (copies of) the loaded state; checked by
    :func:`check_restore` beforehand."""
    where = path or "<root>"
    try:
        obj.load_state_dict(_owned(value))
    except (RuntimeError, KeyError, ValueError, TypeError) as err:
        raise CheckpointMismatchError(
            f"{where}: {_describe(obj)}.load_state_dict() refused the checkpoint's state: {err}"
        ) from err
    return obj


def _check_module_keys(
    module: torch.nn.Module, current: Mapping[str, Any], loaded: Any, path: str
) -> None:
    """Refuse a loaded state whose keys are not the module's own when the module is plain
    (:func:`fastckpt.checkpoint.fill.plain_state`: torch's own state-dict code throughout, no
    hooks): its ``load_state_dict`` (strict) would copy every matching tensor and only then
    raise on the missing or unexpected keys. Batch norm's ``num_batches_tracked``, which
    torch supplies when a state lacks it, may be missing. Other modules are left to their
    ``load_state_dict`` (their hooks may rename keys)."""
    if not isinstance(loaded, Mapping) or plain_state(module, current) is None:
        return
    optional = {
        f"{name}.num_batches_tracked" if name else "num_batches_tracked"
        for name, sub in module.named_modules()
        if isinstance(sub, _NormBase)
    }
    missing = [key for key in current if key not in loaded and key not in optional]
    unexpected = [key for key in loaded if key not in current]
    if missing or unexpected:
        found = [
            f"{label} {keys}"
            for label, keys in (("Missing key(s):", missing), ("Unexpected key(s):", unexpected))
            if keys
        ]
        raise CheckpointMismatchError(
            f"{path}: {_describe(module)}.load_state_dict() would refuse the checkpoint's state "
            f"after copying part of it ({'; '.join(found)}), so nothing was loaded: build the "
            "module as it was saved, or load the item as saved (a None template) and call "
            "load_state_dict(state, strict=False) yourself"
        )


#: The ``torch.optim`` classes each of whose per-parameter state tensors of one or more
#: dimensions has its parameter's shape (``tests/test_partial_loads.py`` checks each). Not
#: ``LBFGS`` (flat state of all parameters, kept under the first) nor ``Adafactor`` (factored
#: moments: ``row_var`` of an (m, n) parameter is (m, 1)); not subclasses, which may keep more.
PARAMETER_SHAPED_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = tuple(
    getattr(torch.optim, name)
    for name in (
        "ASGD",
        "Adadelta",
        "Adagrad",
        "Adam",
        "AdamW",
        "Adamax",
        "Muon",
        "NAdam",
        "RAdam",
        "RMSprop",
        "Rprop",
        "SGD",
        "SparseAdam",
    )
    if hasattr(torch.optim, name)  # Muon: torch >= 2.9
)

#: The per-parameter state keys the classes of :data:`PARAMETER_SHAPED_OPTIMIZERS` keep in
#: their parameter's shape (torch's sources: Adam/AdamW/RAdam/NAdam/SparseAdam ``exp_avg``,
#: ``exp_avg_sq``, Adam/AdamW ``max_exp_avg_sq``, Adamax ``exp_inf``, SGD/RMSprop/Muon
#: ``momentum_buffer``, RMSprop ``square_avg`` and ``grad_avg``, Adadelta ``square_avg`` and
#: ``acc_delta``, Adagrad ``sum``, ASGD ``ax``, Rprop ``prev`` and ``step_size``). Their
#: other keys hold scalars of any shape: ``step`` (a (1,) tensor in torch 1.12/1.13 Adam and
#: AdamW with ``capturable=True``), ASGD's ``eta`` and ``mu``, NAdam's ``mu_product``.
PARAMETER_SHAPED_STATE: frozenset[str] = frozenset(
    {
        "acc_delta",
        "ax",
        "exp_avg",
        "exp_avg_sq",
        "exp_inf",
        "grad_avg",
        "max_exp_avg_sq",
        "momentum_buffer",
        "prev",
        "square_avg",
        "step_size",
        "sum",
    }
)


def check_optimizer_state(
    optimizer: torch.optim.Optimizer, saved: Any, path: str, source: str = ""
) -> None:
    """Refuse a saved optimizer state that ``optimizer.load_state_dict(saved)`` would refuse
    only part-way through a load, or would load into the wrong parameters without a word.
    Only metadata is read: ``saved``'s tensors may be meta tensors (a checkpoint's headers).

    * Parameter groups laid out otherwise (how many groups, how many parameters in each):
      torch refuses them too, but only when its ``load_state_dict`` runs, after the other
      items of the load (a model read into directly) were written.
    * For the classes of :data:`PARAMETER_SHAPED_OPTIMIZERS`: a saved per-parameter state
      tensor of a key they keep in their parameter's shape (:data:`PARAMETER_SHAPED_STATE`:
      never ``step``) whose shape is not that of the live parameter it would be loaded
      into. torch pairs saved and live parameters by position only, so parameters passed
      in another order, or another model's, took other parameters' state (a bare torch
      error at the first ``step()``, or swapped moments where the shapes agree).
    * ``param_names`` (torch records them for an optimizer built from ``named_parameters()``),
      saved and live, that put a live parameter where the saved run had another one of the
      group's names: it would take that one's state. Names that differ otherwise (a
      ``module.`` prefix a wrapper adds) are not judged.

    A state that is not an optimizer's (no list of parameter groups) is left to
    ``load_state_dict``; so are the parameter checks of an optimizer with a
    ``load_state_dict`` pre-hook, which may rename or reorder the state.

    Args:
        optimizer: the live optimizer the state would be loaded into.
        saved: its saved ``state_dict()`` (tensors may be meta tensors).
        path: the key path of the optimizer's state (``opt``), for messages ("": none).
        source: the file holding the state, for messages ("": none).

    Raises:
        CheckpointMismatchError: naming the state path, both sides and the fix; nothing was
            loaded.
    """

    def where(at: str) -> str:
        """The place ``at`` within the state (the whole state: "")."""
        inner = tree.join_path(path, at) if at else path
        return f"{source}: {inner}" if source and inner else source or inner or "<root>"

    groups = saved.get("param_groups") if isinstance(saved, Mapping) else None
    if not isinstance(groups, (list, tuple)) or not all(
        isinstance(g, Mapping) and isinstance(g.get("params"), (list, tuple)) for g in groups
    ):
        return  # not an optimizer's state dict: its load_state_dict judges it
    kind = type(optimizer).__name__
    saved_sizes = [len(g["params"]) for g in groups]
    live_sizes = [len(g["params"]) for g in optimizer.param_groups]
    if saved_sizes != live_sizes:
        raise CheckpointMismatchError(
            f"{where('')}: the checkpoint's optimizer has {len(saved_sizes)} parameter group(s) "
            f"of {saved_sizes} parameters, this {kind} {len(live_sizes)} of {live_sizes}; "
            "nothing was loaded: build the optimizer with the parameter groups it was saved "
            "with"
        )
    if getattr(optimizer, "_optimizer_load_state_dict_pre_hooks", None):
        return  # a pre-hook may rename or reorder the saved state before torch pairs it
    fix = (
        "the optimizer's parameters were passed in another order than when it was saved, or "
        "are another model's; nothing was loaded: build the optimizer from the same "
        "parameters in the same order as when saved"
    )
    for g, (group, live) in enumerate(zip(groups, optimizer.param_groups, strict=True)):
        names, live_names = group.get("param_names"), live.get("param_names")
        if not isinstance(names, list) or not isinstance(live_names, list):
            continue
        for i, (name, live_name) in enumerate(zip(names, live_names, strict=False)):
            if name != live_name and live_name in names:
                raise CheckpointMismatchError(
                    f"{where(f'param_groups.{g}.param_names.{i}')}: the saved optimizer's "
                    f"parameter {i} of group {g} is {name!r}, this {kind}'s is {live_name!r} "
                    f"(saved at position {names.index(live_name)}): it would take the state "
                    f"of {name!r}; {fix}"
                )
    state = saved.get("state")
    if type(optimizer) not in PARAMETER_SHAPED_OPTIMIZERS or not isinstance(state, Mapping):
        return
    for g, (group, live) in enumerate(zip(groups, optimizer.param_groups, strict=True)):
        for i, (index, param) in enumerate(zip(group["params"], live["params"], strict=True)):
            entry = state.get(index) if isinstance(index, (int, str)) else None
            if not isinstance(entry, Mapping) or is_lazy(param):
                continue  # no state saved for it, or a parameter of any shape yet
            for name, value in entry.items():
                if name not in PARAMETER_SHAPED_STATE or not isinstance(value, torch.Tensor):
                    continue  # a step count or another scalar: no parameter's shape
                if value.shape != param.shape:
                    raise CheckpointMismatchError(
                        f"{where(f'state.{index}.{name}')}: the saved tensor has shape "
                        f"{tuple(value.shape)}, the parameter it would be loaded into "
                        f"(parameter {i} of group {g} of this {kind}) has shape "
                        f"{tuple(param.shape)}: {fix}"
                    )


def check_restore(template: Any, value: Any, path: str, strict: bool) -> bool:
    """Raise every :class:`~fastckpt.errors.CheckpointMismatchError` that
    ``restore(template, value, path, strict)`` would raise, changing nothing.

    Only metadata is compared: ``value``'s tensors may be meta tensors (the dtypes and shapes
    of a checkpoint's headers). Checked are the structure (a mapping, a sequence or a tensor
    where the template has one), each tensor template's dtype and shape, template keys and
    indices the checkpoint lacks (under ``strict``), the tensors a stateful object holds
    (dtype and shape, by key path), the key set of a plain module (see
    ``_check_module_keys``), and an optimizer's saved state against its parameters (see
    :func:`check_optimizer_state`). What a non-plain ``load_state_dict`` refuses is only
    known when it runs.

    Args:
        template: the template (checked with :func:`check_template` beforehand).
        value: the loaded value, or its skeleton with meta tensors.
        path: key path of ``template``, for messages.
        strict: raise on template keys the checkpoint lacks.

    Returns:
        Whether the checkpoint has every key and index of the template (always True when
        ``strict``: it raises instead).

    Raises:
        CheckpointMismatchError: what :func:`restore` would raise before
            ``load_state_dict``, by key path.
    """
    where = path or "<root>"
    if value is template or template is None:
        return True
    if is_stateful(template):
        if isinstance(template, torch.optim.Optimizer):
            check_optimizer_state(template, value, path)
        current = template.state_dict()
        _check_tensors(current, value, where)
        if isinstance(template, torch.nn.Module):
            _check_module_keys(template, current, value, where)
        return True
    if isinstance(template, torch.Tensor):
        _check_tensor(template, value, where)
        return True
    complete = True
    if isinstance(template, Mapping):
        if not isinstance(value, Mapping):
            raise CheckpointMismatchError(
                f"{where}: expected a mapping, found {type(value).__name__}"
            )
        for key, sub in template.items():
            at = tree.join_path(path, key)
            if key in value:
                complete = check_restore(sub, value[key], at, strict) and complete
            elif strict:
                raise CheckpointMismatchError(f"{at}: missing in checkpoint")
            else:
                complete = False
        extra = [key for key in value if key not in template and _holds_tensor(value[key])]
        if _HYPER_PARAMETERS in path.split("."):
            extra = []  # hyper-parameters (a scheduler's initial_lr, a tensor lr's too)
        if extra and strict:
            raise CheckpointMismatchError(_not_in_template(where, extra))
        if extra and not template:
            warnings.warn(
                f"{where}: the template is empty, so none of the {len(extra)} saved entries "
                "holding tensors there is loaded; put None there to load them as saved, or "
                "load with strict=True to refuse templates that leave saved tensors out",
                stacklevel=2,
            )
        return complete
    if not isinstance(template, (list, tuple)):
        return True  # a plain value: replaced
    if not isinstance(value, (list, tuple)):
        raise CheckpointMismatchError(f"{where}: expected a sequence, found {type(value).__name__}")
    for i, sub in enumerate(template):
        if i < len(value):
            complete = check_restore(sub, value[i], tree.join_path(path, i), strict) and complete
        elif strict:
            raise CheckpointMismatchError(f"{tree.join_path(path, i)}: missing in checkpoint")
        else:
            complete = False
    extra = [i for i in range(len(template), len(value)) if _holds_tensor(value[i])]
    if strict and extra:
        raise CheckpointMismatchError(_not_in_template(where, extra))
    return complete


#: The part of an optimizer's state_dict holding hyper-parameters, which strict loads may
#: leave out (a scheduler adds ``initial_lr`` there, a tensor when the learning rate is one).
_HYPER_PARAMETERS = "param_groups"


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, Mapping):
        return any(_holds_tensor(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_tensor(item) for item in value)
    return False


def _not_in_template(where: str, extra: list[Any]) -> str:
    """The message of a strict load whose template leaves saved entries out."""
    shown = ", ".join(repr(key) for key in extra[:5]) + (", ..." if len(extra) > 5 else "")
    return (
        f"{where}: the checkpoint holds {len(extra)} entr{'y' if len(extra) == 1 else 'ies'} "
        f"with tensors the template lacks ({shown}); strict=True loads every saved tensor: add "
        "them to the template, put None where a value should load as saved (e.g. a fresh "
        "optimizer's empty state), pass the stateful object itself, or load with strict=False "
        "to load only the template's entries"
    )


def restore(template: Any, value: Any, path: str, strict: bool) -> Any:
    """Load ``value`` into ``template`` (see the module docstring).

    A ``None`` template takes the loaded value; a tensor template gets the loaded tensor
    copied in (same dtype and shape, no implicit cast or broadcast); mappings, lists and
    tuples are walked key by key; any other template value is replaced by the loaded one.
    Every mismatch :func:`check_restore` finds is raised before anything is changed.

    Args:
        template: the template (checked with :func:`check_template` beforehand).
        value: the loaded value (as :func:`fastckpt.io.tree.unflatten` returns it).
        path: key path of ``template``, for messages.
        strict: raise on template keys the checkpoint lacks.

    Returns:
        The template, updated (the same stateful objects, tensors, dicts and lists, restored
        in place).

    Raises:
        CheckpointMismatchError: a dtype/shape mismatch, a structure mismatch, a key missing
            under ``strict``, or a plain module's key set, by key path, with the template
            untouched; or a ``load_state_dict`` that refused the state (it may have loaded
            part of it: torch's optimizers check first, a non-plain module may not).
    """
    check_restore(template, value, path, strict)
    return _restore(template, value, path)


def _restore(template: Any, value: Any, path: str) -> Any:
    """:func:`restore` after :func:`check_restore` passed."""
    if value is template:
        return template  # restored in place already (a module read directly, manager.load)
    if is_stateful(template):
        return _load_into(template, value, path)
    if template is None:
        return value
    if isinstance(template, torch.Tensor):
        with torch.no_grad():
            template.copy_(value)
        return template
    if isinstance(template, Mapping):
        merged = dict(template)
        for key, sub in template.items():
            if key in value:
                merged[key] = _restore(sub, value[key], tree.join_path(path, key))
        if isinstance(template, dict):
            template.update(merged)
            return template
        return merged
    if not isinstance(template, (list, tuple)):
        return value
    items = [
        _restore(sub, value[i], tree.join_path(path, i)) if i < len(value) else sub
        for i, sub in enumerate(template)
    ]
    if isinstance(template, list):
        template[:] = items
        return template
    return tuple(items)


def _check_tensor(template: torch.Tensor, value: Any, where: str) -> None:
    """Refuse a loaded value that a tensor template cannot take as it is: not a tensor, or of
    another dtype or shape."""
    if not isinstance(value, torch.Tensor):
        raise CheckpointMismatchError(f"{where}: expected a tensor, found {type(value).__name__}")
    if template.dtype != value.dtype or template.shape != value.shape:
        raise CheckpointMismatchError(
            f"{where}: template has dtype {template.dtype} shape "
            f"{tuple(template.shape)}, checkpoint has dtype {value.dtype} shape "
            f"{tuple(value.shape)}; no implicit cast or broadcast is done: fix the template "
            "or convert after loading"
        )
