"""Nested training state <-> a JSON skeleton plus one flat dict of tensors. No pickle.

Optimizer and scheduler ``state_dict()``s are nests of dicts (with int keys), lists, tuples,
tensors and plain scalars. :func:`flatten` turns such a nest into

* a JSON-able *skeleton* with the structure and every non-tensor leaf, where each tensor is
  replaced by ``{"__tensor__": "<name>"}``, and
* a flat ``{name: tensor}`` dict that the Rust core writes as one safetensors file.

:func:`unflatten` reverses it exactly: tuples stay tuples, int keys stay ints, ints stay ints,
NaN/inf floats survive, tensors keep dtype and shape. Anything else raises ``TypeError`` naming
the key path, so unsupported objects fail before anything is written.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from fastckpt.errors import CheckpointFormatError

if TYPE_CHECKING:
    import torch

__all__ = ["ROOT_TENSOR", "flatten", "flatten_measured", "join_path", "map_tensors", "unflatten"]

#: The name :func:`flatten` gives a state that is one tensor (it has no key path).
ROOT_TENSOR = "tensor"

_TENSOR = "__tensor__"
_TUPLE = "__tuple__"
_DICT = "__dict__"
_FLOAT = "__float__"
_MARKERS = frozenset({_TENSOR, _TUPLE, _DICT, _FLOAT})
_KEY_TYPES = (str, int, float, bool, type(None))


def join_path(path: str, key: object) -> str:
    """Key path used in error messages and tensor names: ``state.0.exp_avg``."""
    return f"{path}.{key}" if path else str(key)


def _encode_float(value: float) -> Any:
    if math.isfinite(value):
        return value
    return {_FLOAT: repr(value)}  # 'nan', 'inf', '-inf'


def _plain_dict(mapping: Mapping[Any, Any]) -> bool:
    """Whether a dict can be a plain JSON object (string keys that are not our markers)."""
    return all(isinstance(k, str) and k not in _MARKERS for k in mapping)


class _Flattener:
    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        #: How deep the skeleton's lists and objects nest (as ``format.records.nesting_depth``
        #: counts: a container at the top is level 1), tracked while it is built.
        self.depth = 0

    def name_for(self, path: str) -> str:
        name = path or ROOT_TENSOR
        suffix = 1
        while name in self.tensors:
            name = f"{path}#{suffix}"
            suffix += 1
        return name

    def encode(self, value: Any, path: str, level: int = 1) -> Any:
        """The skeleton of ``value``, whose own list or object (if any) sits at ``level``."""
        import torch  # deferred: only flattening meets tensors; unflatten (inspect) needs none

        if isinstance(value, torch.Tensor):
            name = self.name_for(path)
            self.tensors[name] = value
            self.depth = max(self.depth, level)
            return {_TENSOR: name}
        # Exact types: a subclass (an enum, a numpy scalar) would come back as its base type.
        if value is None or type(value) in (bool, int, str):
            return value
        if type(value) is float:
            encoded = _encode_float(value)
            if encoded is not value:
                self.depth = max(self.depth, level)  # a marker object
            return encoded
        self.depth = max(self.depth, level)
        if isinstance(value, Mapping):
            return self.encode_mapping(value, path, level)
        if isinstance(value, tuple) and type(value) is tuple:
            # {"__tuple__": [...]}: the items two levels down
            items = [self.encode(v, join_path(path, i), level + 2) for i, v in enumerate(value)]
            self.depth = max(self.depth, level + 1)
            return {_TUPLE: items}
        if isinstance(value, list):
            return [self.encode(v, join_path(path, i), level + 1) for i, v in enumerate(value)]
        raise TypeError(
            f"{path or '<root>'}: cannot checkpoint a {type(value).__module__}."
            f"{type(value).__qualname__}; supported values are tensors, None, bool, int, float, "
            "str and dicts/lists/tuples of them (convert it, e.g. to a tensor or a list)"
        )

    def encode_mapping(self, mapping: Mapping[Any, Any], path: str, level: int) -> Any:
        for key in mapping:
            if type(key) not in _KEY_TYPES:
                raise TypeError(
                    f"{join_path(path, key)}: dict keys must be str, int, float, bool or None, "
                    f"got {type(key).__name__}"
                )
        if _plain_dict(mapping):
            return {k: self.encode(v, join_path(path, k), level + 1) for k, v in mapping.items()}
        # {"__dict__": [[key, value], ...]}: keys and values three levels down
        pairs = []
        for k, v in mapping.items():
            key = _encode_float(k) if isinstance(k, float) else k
            if isinstance(key, dict):
                self.depth = max(self.depth, level + 3)  # a float key's marker object
            pairs.append([key, self.encode(v, join_path(path, k), level + 3)])
        self.depth = max(self.depth, level + (2 if pairs else 1))
        return {_DICT: pairs}


def flatten(state: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """Split ``state`` into a JSON-able skeleton and ``{name: tensor}``.

    Args:
        state: a nest of dicts/lists/tuples of tensors, None, bool, int, float and str.

    Returns:
        ``(skeleton, tensors)``; tensor names are their key paths (``state.0.exp_avg``).

    Raises:
        TypeError: an unsupported value or dict key, named by its key path.
    """
    skeleton, tensors, _ = flatten_measured(state)
    return skeleton, tensors


def flatten_measured(state: Any) -> tuple[Any, dict[str, torch.Tensor], int]:
    """:func:`flatten`, and how deep the skeleton's lists and objects nest (counted as
    :func:`fastckpt.format.records.nesting_depth` counts, without walking it again)."""
    flattener = _Flattener()
    skeleton = flattener.encode(state, "")
    return skeleton, flattener.tensors, flattener.depth


def decode_float(data: Any, path: str) -> float:
    """The float a ``{"__float__": "nan" | "inf" | "-inf"}`` marker at ``path`` stands for.

    Raises:
        CheckpointFormatError: any other marker.
    """
    text = data.get(_FLOAT)
    if text not in ("nan", "inf", "-inf"):
        raise CheckpointFormatError(f"{path or '<root>'}: bad float marker {data!r}")
    return float(text)


def decode_key(key: Any, path: str) -> Any:
    """A dict key as :func:`flatten` stored it at ``path`` (a float marker: its float).

    Raises:
        CheckpointFormatError: a key of a type :func:`flatten` never stores.
    """
    if isinstance(key, dict):
        return decode_float(key, path)
    if not isinstance(key, _KEY_TYPES):
        raise CheckpointFormatError(f"{path or '<root>'}: bad dict key {key!r}")
    return key


def unflatten(skeleton: Any, tensors: Mapping[str, torch.Tensor], path: str = "") -> Any:
    """Rebuild the state :func:`flatten` split.

    Args:
        skeleton: the JSON skeleton (as loaded from JSON).
        tensors: the flat tensor dict (as loaded from the safetensors file).
        path: key path of ``skeleton`` inside a larger state, for error messages.

    Raises:
        CheckpointFormatError: the skeleton is malformed or names a missing tensor.
    """
    if skeleton is None or isinstance(skeleton, (bool, int, float, str)):
        return skeleton
    if isinstance(skeleton, list):
        return [unflatten(v, tensors, join_path(path, i)) for i, v in enumerate(skeleton)]
    if not isinstance(skeleton, dict):
        raise CheckpointFormatError(f"{path or '<root>'}: unexpected {type(skeleton).__name__}")
    if len(skeleton) == 1:
        (marker, payload), *_ = skeleton.items()
        if marker == _TENSOR:
            if not isinstance(payload, str) or payload not in tensors:
                raise CheckpointFormatError(
                    f"{path or '<root>'}: tensor {payload!r} is missing from the tensor file"
                )
            return tensors[payload]
        if marker == _TUPLE and isinstance(payload, list):
            return tuple(unflatten(v, tensors, join_path(path, i)) for i, v in enumerate(payload))
        if marker == _FLOAT:
            return decode_float(skeleton, path)
        if marker == _DICT and isinstance(payload, list):
            result: dict[Any, Any] = {}
            for item in payload:
                if not (isinstance(item, list) and len(item) == 2):
                    raise CheckpointFormatError(f"{path or '<root>'}: bad dict entry {item!r}")
                key = decode_key(item[0], path)
                result[key] = unflatten(item[1], tensors, join_path(path, key))
            return result
    if any(key in _MARKERS for key in skeleton):
        raise CheckpointFormatError(f"{path or '<root>'}: malformed marker object {skeleton!r}")
    return {k: unflatten(v, tensors, join_path(path, k)) for k, v in skeleton.items()}


def map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Apply ``fn`` to every tensor in a nest of mappings/lists/tuples; other leaves are kept.

    Mappings become dicts; lists, tuples and named tuples keep their type.
    """
    import torch  # deferred: this module's readers (inspect) start without torch

    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, Mapping):
        return {key: map_tensors(item, fn) for key, item in value.items()}
    if isinstance(value, list):
        return [map_tensors(item, fn) for item in value]
    if isinstance(value, tuple):
        items = [map_tensors(item, fn) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return value
