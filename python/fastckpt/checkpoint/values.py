"""Type serializers: how a spec argument of a non-JSON type is stored.

``torch.Tensor``, ``torch.dtype`` and ``torch.device`` are registered here; add other types
with :func:`register_type_serializer`. A registered value is stored as
``{"__type__": "<dotted type name>", "value": <serialized>}`` (see
:mod:`fastckpt.checkpoint.specs` for the whole encoding).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "register_type_serializer",
]

# --------------------------------------------------------------------------------------------
# Type serializers
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Serializer:
    type_: type
    serialize: Callable[[Any], Any]
    deserialize: Callable[[Any], Any]


_SERIALIZERS: dict[str, _Serializer] = {}

#: The types the spec encoder stores itself (JSON scalars, lists, tuples and dicts): a
#: serializer registered for one of them would never be called.
_SPEC_NATIVE_TYPES: tuple[type, ...] = (str, int, float, bool, type(None), list, tuple, dict)


def _type_name(type_: type) -> str:
    return f"{type_.__module__}.{type_.__qualname__}"


def register_type_serializer(
    type_: type, serialize: Callable[[Any], Any], deserialize: Callable[[Any], Any]
) -> None:
    """Teach specs to store values of ``type_`` as JSON.

    The registry is keyed by the type's dotted name (``module.QualName``); registering the same
    type again replaces the earlier pair. Subclasses of a registered type use the nearest
    registered base class (for example ``nn.Parameter`` is stored as a ``torch.Tensor``) and
    are rebuilt as that base type. The serializer's output is itself encoded like a keyword
    argument (so it may contain tuples or other registered values) and is decoded again before
    it is handed to ``deserialize``. Register the type in every process that loads the
    checkpoint, before loading.

    Args:
        type_: The class whose instances should become storable.
        serialize: Turns an instance into JSON-able data.
        deserialize: Turns that data back into an instance. It receives untrusted data read
            from a checkpoint, so it should validate it and must not import or call anything
            named by it.

    Raises:
        TypeError: If ``type_`` is not a class, is one the spec encoder stores itself
            (``str``, ``int``, ``float``, ``bool``, ``None``, ``list``, ``tuple``, ``dict``),
            or either function is not callable.
    """
    if not isinstance(type_, type):
        raise TypeError(f"register_type_serializer: type_ must be a class, got {type_!r}")
    if type_ in _SPEC_NATIVE_TYPES:
        # Accepted before, and never called: the spec encoder stores these itself.
        raise TypeError(
            f"register_type_serializer: specs store {type_.__name__} values themselves (as "
            "JSON), so a serializer for it would never be called; register a class of your "
            "own (a subclass, or a wrapper of the value) instead"
        )
    if not callable(serialize) or not callable(deserialize):
        raise TypeError("register_type_serializer: serialize and deserialize must be callable")
    _SERIALIZERS[_type_name(type_)] = _Serializer(type_, serialize, deserialize)


def _serializer_named(name: str) -> _Serializer | None:
    """The serializer registered under the dotted type name ``name``, if any."""
    return _SERIALIZERS.get(name)


def _find_serializer(value: Any) -> tuple[str, _Serializer] | None:
    for klass in type(value).__mro__:
        if klass is object:
            break
        entry = _SERIALIZERS.get(_type_name(klass))
        if entry is not None and entry.type_ is klass:
            return _type_name(klass), entry
    return None


def _dtype_table() -> dict[str, torch.dtype]:
    table: dict[str, torch.dtype] = {}
    for name, value in vars(torch).items():
        if isinstance(value, torch.dtype):
            table[f"torch.{name}"] = value
            table.setdefault(str(value), value)
    return table


_DTYPES: dict[str, torch.dtype] = _dtype_table()


def _dtype_from_name(name: Any) -> torch.dtype:
    """Look a dtype up by name ("torch.float32" or "float32"); only real torch dtypes."""
    if not isinstance(name, str):
        raise ValueError(f"dtype must be a string, got {type(name).__name__}")
    key = name if name.startswith("torch.") else f"torch.{name}"
    dtype = _DTYPES.get(key)
    if dtype is None:
        raise ValueError(f"unknown torch dtype {name!r}")
    return dtype


def _short_dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _serialize_tensor(tensor: torch.Tensor) -> dict[str, Any]:
    if tensor.layout != torch.strided:
        raise TypeError(
            f"only dense (strided) tensors can be stored in a spec, got {tensor.layout}"
        )
    data = tensor.detach().cpu()
    if data.is_complex():
        data = torch.view_as_real(data.resolve_conj())
    return {
        "dtype": _short_dtype_name(tensor.dtype),
        "shape": list(tensor.shape),
        "data": data.tolist(),
    }


def _deserialize_tensor(data: Any) -> torch.Tensor:
    if not isinstance(data, dict) or set(data) != {"dtype", "shape", "data"}:
        raise ValueError("a tensor must be an object with exactly 'dtype', 'shape' and 'data'")
    dtype = _dtype_from_name(data["dtype"])
    shape = data["shape"]
    if not isinstance(shape, list) or not all(
        isinstance(dim, int) and not isinstance(dim, bool) and dim >= 0 for dim in shape
    ):
        raise ValueError(f"tensor shape must be a list of non-negative integers, got {shape!r}")
    values = data["data"]
    if not isinstance(values, (list, int, float, bool)):
        raise ValueError("tensor data must be a (nested) list of numbers")
    if dtype.is_complex:
        real_dtype = torch.empty((), dtype=dtype).real.dtype
        flat = _tensor_from_values(values, real_dtype)
        if flat.numel() != 2 * math.prod(shape):
            raise ValueError(f"tensor data does not match shape {shape}")
        return torch.view_as_complex(flat.reshape([*shape, 2]).contiguous())
    result = _tensor_from_values(values, dtype)
    if result.numel() != math.prod(shape):
        raise ValueError(f"tensor data has {result.numel()} elements, shape {shape} needs more")
    return result.reshape(shape)


def _tensor_from_values(values: Any, dtype: torch.dtype) -> torch.Tensor:
    try:
        return torch.tensor(values, dtype=dtype)
    except (TypeError, RuntimeError):
        # Some dtypes (float8 variants, wide unsigned ints) cannot be built directly from
        # Python numbers; go through a wide type whose values convert exactly.
        wide = torch.float64 if dtype.is_floating_point else torch.int64
        return torch.tensor(values, dtype=wide).to(dtype)


def _serialize_dtype(dtype: torch.dtype) -> str:
    return str(dtype)


def _deserialize_dtype(data: Any) -> torch.dtype:
    return _dtype_from_name(data)


def _serialize_device(device: torch.device) -> str:
    return str(device)


def _deserialize_device(data: Any) -> torch.device:
    if not isinstance(data, str):
        raise ValueError(f"a device must be a string like 'cpu' or 'cuda:0', got {data!r}")
    return torch.device(data)


register_type_serializer(torch.Tensor, _serialize_tensor, _deserialize_tensor)
register_type_serializer(torch.dtype, _serialize_dtype, _deserialize_dtype)
register_type_serializer(torch.device, _serialize_device, _deserialize_device)
