"""Filling a rebuilt model's tensors straight from its weights file.

``load_checkpoint`` rebuilds each model from its spec and then loads the saved weights. The
plain way, ``model.load_state_dict(mapped_tensors)``, initializes every parameter (random
draws) only to overwrite it, and moves each byte twice (file -> mapping -> parameter). For a
*plain* model the same result is reached with neither:

* :func:`plain_state` proves that the model's ``state_dict`` is exactly its parameters and
  buffers, saved and loaded by ``torch.nn.Module``'s own code (no module overrides how its
  state is saved or loaded, other than torch's batch norm, whose override only adds a missing
  ``num_batches_tracked``; no state-dict hooks; no extra state; no non-persistent buffers),
  with the checkpoint's tensor names. ``load_state_dict`` of such a model copies each saved
  tensor into its parameter or buffer and does nothing else.
* :func:`fully_restored_by` adds that no tensor is tied to two names (``to_empty`` would
  untie them), that no parameter or buffer carries anything ``to_empty`` would drop (a
  gradient hook such as the constructor's ``p.register_hook(clip)``, a Python attribute, a
  subclass, a buffer's ``requires_grad``), and the module tree keeps no tensor outside its
  parameters and buffers, not even inside a list, tuple or dict attribute (nor the meta device
  it was built on): then every tensor the model holds is overwritten by the load, and the
  model can be materialized from its meta-device build in uninitialized memory (``to_empty``)
  instead of being built and initialized again (:func:`fastckpt.checkpoint.build.build_model`).
* :func:`direct_targets` maps each saved tensor to the parameter or buffer whose memory can
  take its bytes as they are (:func:`fastckpt.container.reader.takes_direct_read`, no two
  sharing memory); the file is then read into them in one verified pass.

A model that is not plain keeps the plain way, in full.

Either way the rebuilt model first takes the saved dtypes (:func:`match_saved_dtypes`): its
constructor builds it in the default dtype, while the saved model may have been converted
after construction (``model.to(torch.bfloat16)``, some layers only); ``load_state_dict``
would cast the saved tensors to the constructor's dtypes, so the load would not return the
state that was saved.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

import torch
from torch.nn.modules.batchnorm import _NormBase

from fastckpt.container.reader import takes_direct_read
from fastckpt.errors import InvalidInputError
from fastckpt.io.files import dtype_from_name, torch_shape

__all__ = [
    "direct_targets",
    "fully_restored_by",
    "loads_as_given",
    "match_saved_dtypes",
    "plain_state",
    "saved_dtypes",
]

#: ``_load_from_state_dict`` implementations that load exactly what ``state_dict`` saved: the
#: default, and batch norm's (it only supplies a ``num_batches_tracked`` that old checkpoints
#: lack, which a checkpoint holding every tensor of the model does not).
_PLAIN_LOADERS = (
    torch.nn.Module._load_from_state_dict,
    _NormBase._load_from_state_dict,
)

#: Methods a module must not override for its state_dict to be its parameters and buffers.
_PLAIN_METHODS = ("state_dict", "_save_to_state_dict", "load_state_dict", "get_extra_state")

#: The hook tables ``state_dict`` / ``load_state_dict`` run.
_HOOK_TABLES = (
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


def _plain_module(module: torch.nn.Module) -> bool:
    cls = type(module)
    if cls._load_from_state_dict not in _PLAIN_LOADERS:
        return False
    if any(getattr(cls, name) is not getattr(torch.nn.Module, name) for name in _PLAIN_METHODS):
        return False
    if any(getattr(module, table, None) for table in _HOOK_TABLES):
        return False
    return not module._non_persistent_buffers_set


def loads_as_given(model: torch.nn.Module) -> bool:
    """Whether ``model``'s ``load_state_dict`` takes each key as given: no module has a
    load hook or its own ``_load_from_state_dict``/``load_state_dict`` (which may rename keys
    or reshape values: reading an older layout after a refactor). Batch norm's loader counts
    (it only supplies a missing ``num_batches_tracked``); non-persistent buffers and
    ``state_dict`` overrides do not matter here."""
    for module in model.modules():
        cls = type(module)
        if cls._load_from_state_dict not in _PLAIN_LOADERS:
            return False
        if cls.load_state_dict is not torch.nn.Module.load_state_dict:
            return False
        if module._load_state_dict_pre_hooks or module._load_state_dict_post_hooks:
            return False
    return True


def plain_state(model: torch.nn.Module, names: Mapping[str, Any]) -> dict[str, torch.Tensor] | None:
    """The model's ``state_dict`` (its parameters and buffers themselves, ``keep_vars``) when
    the model is plain (see the module docstring) and its keys are exactly ``names``; else
    None."""
    if not all(_plain_module(module) for module in model.modules()):
        return None
    state = model.state_dict(keep_vars=True)
    if set(state) != set(names) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        return None
    return state


def fully_restored_by(model: torch.nn.Module, names: Mapping[str, Any]) -> bool:
    """Whether loading a state dict with keys ``names`` overwrites every tensor ``model``
    holds: it is plain with those keys, every parameter and buffer is in its ``state_dict``,
    and no module keeps a tensor in a plain attribute, or in a list, tuple, set or dict one
    holds at any depth (which a load would not touch). Each parameter and buffer must also be
    bare (no gradient hook, Python attribute, gradient or subclass; a buffer not requiring
    grad): ``to_empty`` would replace it with a tensor that lacks them, so the rebuilt model
    would differ from a real build in more than its values."""
    state = plain_state(model, names)
    if state is None:
        return False
    held = {id(t) for t in [*model.parameters(), *model.buffers()]}
    saved = {id(t) for t in state.values()}
    if held - saved:
        return False
    if len(saved) < len(state):
        return False  # tied tensors: to_empty would give each name a parameter of its own
    if not all(_bare(p, torch.nn.Parameter) for p in model.parameters()):
        return False
    if not all(not b.requires_grad and _bare(b, torch.Tensor) for b in model.buffers()):
        return False
    # Parameters and buffers live in their tables: a tensor in an attribute, or in a list,
    # tuple, set or dict an attribute holds, is one the load does not reach (its own, or an
    # alias of a buffer that to_empty would leave on the meta device).
    registered = {id(module) for module in model.modules()}
    return not any(_keeps_unloaded(module, registered) for module in model.modules())


def _bare(tensor: torch.Tensor, cls: type[torch.Tensor]) -> bool:
    """Whether ``tensor`` is a ``cls`` with nothing on it but its values and
    ``requires_grad``: no gradient hook (``register_hook``,
    ``register_post_accumulate_grad_hook``), no Python attribute, no gradient, not a subclass.
    ``to_empty`` replaces each parameter with a new ``Parameter`` (each buffer with a new
    tensor) that keeps none of these; a hook's function may also hold the tensor it was
    registered on, which would stay the meta one. A real build gives them to the real tensors.
    """
    return (
        type(tensor) is cls
        and not vars(tensor)
        and not tensor._backward_hooks
        and not tensor._post_accumulate_grad_hooks
        and tensor.grad is None
    )


#: A module's own tables (in ``vars(module)``) of what ``state_dict`` and ``modules()`` reach.
_TABLES = frozenset({"_parameters", "_buffers", "_modules"})

#: Containers :func:`_keeps_unloaded` looks inside (subclasses too: a namedtuple, an OrderedDict).
_CONTAINERS = (list, tuple, set, frozenset, dict)


def _keeps_unloaded(module: torch.nn.Module, registered: set[int]) -> bool:
    """Whether ``module``'s attributes (other than its parameter, buffer and submodule
    tables), or the lists, tuples, sets and dicts among them at any depth, hold what a load
    does not overwrite: a tensor, a module outside the model's tree (``registered``: the
    ids of ``model.modules()``), or the meta device (``torch.device("meta")`` or ``"meta"``:
    the meta build's device, kept where a real build keeps its own).

    Walks without recursion (any depth) and visits each container once (cycles end).
    """
    pending = [value for name, value in vars(module).items() if name not in _TABLES]
    seen: set[int] = set()
    while pending:
        value = pending.pop()
        if isinstance(value, torch.Tensor):
            return True
        if isinstance(value, torch.nn.Module) and id(value) not in registered:
            return True
        if isinstance(value, torch.device) and value.type == "meta":
            return True
        if isinstance(value, str) and value == "meta":
            return True
        if isinstance(value, _CONTAINERS) and id(value) not in seen:
            seen.add(id(value))
            if isinstance(value, dict):
                pending.extend(value.keys())
                pending.extend(value.values())
            else:
                pending.extend(value)
    return False


def direct_targets(
    model: torch.nn.Module, header: Mapping[str, Mapping[str, Any]]
) -> dict[str, torch.Tensor] | None:
    """``{saved tensor name: the parameter or buffer it is read into}`` when the model is plain
    with the header's tensor names and every one of those tensors takes its bytes directly
    (same dtype and shape, CPU, contiguous, no two sharing memory); else None.

    Args:
        model: the rebuilt model.
        header: the weights file's tensors (``read_metadata(path)["tensors"]``).
    """
    state = plain_state(model, header)
    if state is None:
        return None
    targets: dict[str, torch.Tensor] = {}
    spans: list[tuple[int, int]] = []
    for name, tensor in state.items():
        entry = header[name]
        shape = torch_shape(f"tensor {name!r}", entry["dtype"], list(entry["shape"]))
        if not takes_direct_read(tensor, dtype_from_name(entry["dtype"]), shape):
            return None
        start = tensor.data_ptr()
        spans.append((start, start + tensor.numel() * tensor.element_size()))
        targets[name] = tensor.detach()
    spans.sort()
    if any(begin < end for (_, end), (begin, _) in itertools.pairwise(spans)):
        return None  # tied or overlapping tensors: load_state_dict's order decides
    return targets


def saved_dtypes(saved: Mapping[str, Any]) -> dict[str, torch.dtype]:
    """``{tensor name: dtype}`` of a model's saved tensors.

    Args:
        saved: the weights file's tensors (name -> tensor), or its header (name -> entry with
            a safetensors ``"dtype"`` name). A header dtype this torch has no type for is
            left out (reading that tensor fails later, naming it).
    """
    dtypes: dict[str, torch.dtype] = {}
    for name, value in saved.items():
        if isinstance(value, torch.Tensor):
            dtypes[name] = value.dtype
            continue
        dtype = value.get("dtype") if isinstance(value, Mapping) else None
        if isinstance(dtype, str):
            try:
                dtypes[name] = dtype_from_name(dtype)
            except InvalidInputError:
                continue
    return dtypes


def match_saved_dtypes(model: torch.nn.Module, dtypes: Mapping[str, torch.dtype]) -> None:
    """Give each parameter and buffer of ``model`` named in ``dtypes`` that dtype, in place.

    The tensor objects stay the same (their ``.data`` is replaced, as ``Module.to`` does):
    a ``Parameter`` stays a ``Parameter`` with its ``requires_grad``, tied names stay tied,
    and whatever already references them (an optimizer built over the model) still does.
    The values are cast (``load_state_dict`` then overwrites them with the saved ones); on
    the meta device nothing is allocated. A parameter given an integer or bool dtype stops
    requiring grad: torch allows no other, and the saved parameter had that dtype, so it did
    not require grad either.

    Args:
        model: the model rebuilt from its spec (real or on the meta device).
        dtypes: tensor name (as in ``state_dict``) -> the dtype it was saved with
            (:func:`saved_dtypes`).
    """
    tensors = itertools.chain(
        model.named_parameters(remove_duplicate=False),
        model.named_buffers(remove_duplicate=False),
    )
    for name, tensor in tensors:
        dtype = dtypes.get(name)
        if dtype is None or tensor.dtype == dtype:
            continue
        if tensor.requires_grad and not (dtype.is_floating_point or dtype.is_complex):
            tensor.requires_grad_(False)
        tensor.data = tensor.detach().to(dtype)
