"""Model reconstruction specs and the trust policy that guards them.

A *spec* is a recipe for rebuilding an object: an importable dotted path (``cls_path``) plus
keyword arguments. Checkpoints store specs as plain JSON, never as pickled objects, so loading a
checkpoint never deserializes live Python objects.

Keyword arguments may be plain JSON values (``str``, ``int``, ``float``, ``bool``, ``None``,
lists, and dicts with string keys), tuples, nested specs, or values of a registered type.
``torch.Tensor``, ``torch.dtype`` and ``torch.device`` are registered here; add other types with
:func:`register_type_serializer`.

JSON encoding of a keyword argument value:

* plain JSON values pass through unchanged;
* a tuple becomes ``{"__tuple__": [...]}``;
* a nested spec becomes ``{"__spec__": {...}}``;
* a registered value becomes ``{"__type__": "<dotted type name>", "value": <serialized>}``;
* a dict that happens to use one of those marker keys is wrapped as ``{"__dict__": {...}}``.

Because a checkpoint names code to import and call, :func:`resolve_target` applies a trust
policy before anything is called: by default a model target must be an ``nn.Module`` subclass
(or a classmethod/staticmethod of one), an optimizer target a ``torch.optim.Optimizer``
subclass, a scheduler target an LR-scheduler class, and any other callable must be trusted
explicitly (``trusted=`` on the load call, or :func:`register_trusted`).
"""

from __future__ import annotations

import datetime as _dt
import functools
import importlib
import importlib.util
import inspect
import math
import site
import sys
import sysconfig
import types
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import fastckpt.checkpoint.containers as containers
from fastckpt.errors import CheckpointFormatError, UntrustedTargetError

__all__ = [
    "EXTRA_BUFFER_BYTES",
    "TARGET_KINDS",
    "BaseSpec",
    "attach_spec",
    "build_model",
    "check_recordable",
    "create_model_spec",
    "decode_value",
    "dotted_path",
    "encode_value",
    "model_spec",
    "register_trusted",
    "register_type_serializer",
    "resolve_target",
    "resolve_training_fn",
    "validate_dotted_path",
]

#: The kinds of target :func:`resolve_target` knows a default policy for.
TARGET_KINDS: frozenset[str] = frozenset({"model", "optimizer", "scheduler", "callable"})

_TUPLE_KEY = "__tuple__"
_SPEC_KEY = "__spec__"
_TYPE_KEY = "__type__"
_DICT_KEY = "__dict__"
_RESERVED_KEYS = frozenset({_TUPLE_KEY, _SPEC_KEY, _TYPE_KEY, _DICT_KEY})

_PLAIN_SCALARS: tuple[type, ...] = (str, int, float, bool, type(None))

_FIX_HINT = (
    "register a serializer for its type with fastckpt.register_type_serializer(), or "
    "point the spec at a factory that takes plain (JSON-serializable) arguments"
)


# --------------------------------------------------------------------------------------------
# Type serializers
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Serializer:
    type_: type
    serialize: Callable[[Any], Any]
    deserialize: Callable[[Any], Any]


_SERIALIZERS: dict[str, _Serializer] = {}


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
        TypeError: If ``type_`` is not a class or either function is not callable.
    """
    if not isinstance(type_, type):
        raise TypeError(f"register_type_serializer: type_ must be a class, got {type_!r}")
    if not callable(serialize) or not callable(deserialize):
        raise TypeError("register_type_serializer: serialize and deserialize must be callable")
    _SERIALIZERS[_type_name(type_)] = _Serializer(type_, serialize, deserialize)


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


# --------------------------------------------------------------------------------------------
# Value encoding
# --------------------------------------------------------------------------------------------


def encode_value(value: Any, path: str = "kwargs") -> Any:
    """Encode a keyword-argument value as JSON-able data (see the module docstring).

    Args:
        value: The live value: a plain JSON value, tuple, :class:`BaseSpec`, or an instance of
            a registered type, arbitrarily nested in lists, tuples and string-keyed dicts.
        path: How to name ``value`` in error messages, e.g. ``"kwargs['layers']"``.

    Returns:
        Data that ``json.dumps`` accepts and :func:`decode_value` turns back into ``value``.

    Raises:
        TypeError: If some part of ``value`` cannot be stored; the message names its path
            (e.g. ``kwargs['layers'][2]``) and how to fix it.
    """
    return _encode(value, path, set())


def _encode(value: Any, path: str, active: set[int]) -> Any:
    if type(value) in _PLAIN_SCALARS:
        return value
    if isinstance(value, BaseSpec):
        return {_SPEC_KEY: value._to_json(path, active)}
    if type(value) in (list, tuple, dict):
        if id(value) in active:
            raise TypeError(f"{path}: the value contains itself (a reference cycle)")
        active.add(id(value))
        try:
            if isinstance(value, dict):
                return _encode_dict(value, path, active)
            items = [_encode(item, f"{path}[{i}]", active) for i, item in enumerate(value)]
            return {_TUPLE_KEY: items} if isinstance(value, tuple) else items
        finally:
            active.discard(id(value))
    found = _find_serializer(value)
    if found is None:
        raise TypeError(
            f"{path}: cannot store a value of type {_type_name(type(value))} in a spec; {_FIX_HINT}"
        )
    name, entry = found
    try:
        serialized = entry.serialize(value)
    except Exception as exc:
        raise TypeError(f"{path}: the serializer for {name} failed: {exc}") from exc
    return {_TYPE_KEY: name, "value": _encode(serialized, f"{path}.value", active)}


def _encode_dict(value: dict[Any, Any], path: str, active: set[int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, item in value.items():
        if type(key) is not str:
            raise TypeError(
                f"{path}: dict keys must be strings to be stored in a spec, got {key!r}; "
                "convert the keys, or " + _FIX_HINT
            )
        out[key] = _encode(item, f"{path}[{key!r}]", active)
    if _RESERVED_KEYS.intersection(out):
        return {_DICT_KEY: out}
    return out


def decode_value(data: Any, path: str = "kwargs") -> Any:
    """Decode data produced by :func:`encode_value` back into live values.

    Nothing is imported: registered types come from the in-process registry and nested specs
    are only parsed (see :meth:`BaseSpec.from_json`), not resolved.

    Args:
        data: Parsed JSON.
        path: How to name ``data`` in error messages.

    Returns:
        The live value: tuples, nested :class:`BaseSpec` objects and registered types restored.

    Raises:
        CheckpointFormatError: If ``data`` is malformed or names a type with no registered
            serializer; the message names the offending path.
    """
    if type(data) in _PLAIN_SCALARS:
        return data
    if isinstance(data, list):
        return [decode_value(item, f"{path}[{i}]") for i, item in enumerate(data)]
    if not isinstance(data, dict):
        raise CheckpointFormatError(f"{path}: expected a JSON value, found a {type(data).__name__}")
    for key in data:
        if not isinstance(key, str):
            raise CheckpointFormatError(f"{path}: object keys must be strings, found {key!r}")
    markers = _RESERVED_KEYS.intersection(data)
    if not markers:
        return {key: decode_value(item, f"{path}[{key!r}]") for key, item in data.items()}
    if set(data) == {_TUPLE_KEY}:
        items = data[_TUPLE_KEY]
        if not isinstance(items, list):
            raise CheckpointFormatError(f"{path}: '{_TUPLE_KEY}' must hold a list")
        return tuple(decode_value(item, f"{path}[{i}]") for i, item in enumerate(items))
    if set(data) == {_SPEC_KEY}:
        return BaseSpec._from_json(data[_SPEC_KEY], path)
    if set(data) == {_DICT_KEY}:
        inner = data[_DICT_KEY]
        if not isinstance(inner, dict):
            raise CheckpointFormatError(f"{path}: '{_DICT_KEY}' must hold an object")
        return {key: decode_value(item, f"{path}[{key!r}]") for key, item in inner.items()}
    if set(data) == {_TYPE_KEY, "value"}:
        return _decode_registered(data[_TYPE_KEY], data["value"], path)
    raise CheckpointFormatError(
        f"{path}: malformed encoded value; an object using the reserved key(s) "
        f"{sorted(markers)} must be exactly one of {{'{_TUPLE_KEY}': [...]}}, "
        f"{{'{_SPEC_KEY}': {{...}}}}, {{'{_DICT_KEY}': {{...}}}} or "
        f"{{'{_TYPE_KEY}': name, 'value': ...}}"
    )


def _decode_registered(name: Any, payload: Any, path: str) -> Any:
    if not isinstance(name, str):
        raise CheckpointFormatError(f"{path}: '{_TYPE_KEY}' must be a string, found {name!r}")
    entry = _SERIALIZERS.get(name)
    if entry is None:
        raise CheckpointFormatError(
            f"{path}: no serializer is registered for type {name!r}; call "
            "fastckpt.checkpoint.specs.register_type_serializer() for it before loading"
        )
    value = decode_value(payload, f"{path}.value")
    try:
        return entry.deserialize(value)
    except Exception as exc:
        raise CheckpointFormatError(f"{path}: cannot decode a {name} value: {exc}") from exc


# --------------------------------------------------------------------------------------------
# Dotted paths
# --------------------------------------------------------------------------------------------


def validate_dotted_path(path: Any) -> str:
    """Check that ``path`` is a syntactically acceptable dotted path, without importing it.

    Every dot-separated part must be a Python identifier, there must be at least two parts
    (a module and an attribute), and no part may be a dunder name such as ``__class__`` or
    ``__globals__`` (the first part may be ``__main__``, the module of a running script).

    Args:
        path: The candidate path.

    Returns:
        ``path`` itself.

    Raises:
        ValueError: With the reason, if the path is not acceptable.
    """
    if not isinstance(path, str):
        raise ValueError(f"a dotted path must be a string, got {type(path).__name__}")
    parts = path.split(".")
    if len(parts) < 2:
        raise ValueError(f"{path!r} is not a dotted path of the form 'module.attribute'")
    for index, part in enumerate(parts):
        if not part.isidentifier():
            raise ValueError(f"{path!r}: part {part!r} is not a Python identifier")
        if part.startswith("__") and not (index == 0 and part == "__main__"):
            raise ValueError(f"{path!r}: dunder/private part {part!r} is not allowed")
    return path


def _same_target(a: Any, b: Any) -> bool:
    if a is b:
        return True
    # Bound classmethods are created afresh on each attribute access; compare by value.
    return inspect.ismethod(a) and inspect.ismethod(b) and a == b


def dotted_path(obj: Any) -> str:
    """Return the importable dotted path of a class or function.

    Accepted: module-level classes and functions, and classmethods/staticmethods of module-level
    classes. The path is ``obj.__module__ + "." + obj.__qualname__``, checked by walking it
    back (through already-imported modules) to the same object.

    Args:
        obj: The class or function.

    Returns:
        Its dotted path, e.g. ``"torch.nn.modules.linear.Linear"``.

    Raises:
        TypeError: If ``obj`` is a lambda, a local/nested function or closure, a
            ``functools.partial``, a bound method of an instance, a callable instance, or
            otherwise cannot be found again by its path; the message says why.
    """
    if isinstance(obj, functools.partial):
        raise TypeError(
            f"{obj!r} is a functools.partial, which cannot be stored as a dotted path; "
            "write a module-level factory function that takes the bound arguments as keywords"
        )
    if isinstance(obj, (types.MethodType, types.BuiltinMethodType)):
        owner = getattr(obj, "__self__", None)
        if not isinstance(owner, (type, types.ModuleType)) and owner is not None:
            raise TypeError(
                f"{obj!r} is a method bound to a live {type(owner).__name__} instance, which "
                "cannot be stored as a dotted path; use the class, a classmethod or "
                "staticmethod, or a module-level function instead"
            )
    elif not isinstance(obj, type) and not inspect.isfunction(obj) and not inspect.isbuiltin(obj):
        raise TypeError(
            f"{obj!r} (a {type(obj).__name__}) is not a class or function; a spec target must "
            "be a module-level class or function, or a classmethod/staticmethod of one"
        )
    name = getattr(obj, "__name__", None)
    if name == "<lambda>":
        raise TypeError(
            "lambdas cannot be stored as a dotted path; define a module-level function instead"
        )
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str):
        raise TypeError(f"{obj!r} has no __module__/__qualname__, so it cannot be imported")
    if "<locals>" in qualname:
        raise TypeError(
            f"{module}.{qualname} is a local (nested) function, class or closure, which cannot "
            "be imported; move it to module level"
        )
    path = f"{module}.{qualname}"
    try:
        validate_dotted_path(path)
    except ValueError as exc:
        raise TypeError(f"{obj!r} cannot be stored as a dotted path: {exc}") from exc
    resolved = _resolve_loaded(path)
    if resolved is _MISSING:
        try:
            resolved = _import_path(path)
        except (ImportError, AttributeError) as exc:
            raise TypeError(f"{obj!r} is not importable as {path!r}: {exc}") from exc
    if not _same_target(resolved, obj):
        raise TypeError(
            f"{obj!r} is not importable: {path!r} resolves to a different object {resolved!r}"
        )
    return path


_MISSING: Any = object()


def _resolve_loaded(path: str) -> Any:
    """Walk ``path`` through modules that are already imported; never imports anything.

    Module attributes are read from the module's ``__dict__`` (a module-level ``__getattr__``
    may import lazily, so it is not called) and class attributes with
    ``inspect.getattr_static`` (only classmethods are bound, which runs no user code).
    """
    parts = path.split(".")
    for split in range(len(parts) - 1, 0, -1):
        module = sys.modules.get(".".join(parts[:split]))
        if module is not None:
            obj: Any = module
            for attr in parts[split:]:
                obj = _static_attr(obj, attr)
                if obj is _MISSING:
                    return _MISSING
            return obj
    return _MISSING


def _static_attr(obj: Any, attr: str) -> Any:
    if isinstance(obj, types.ModuleType):
        return vars(obj).get(attr, _MISSING)
    if isinstance(obj, type):
        raw = inspect.getattr_static(obj, attr, _MISSING)
        if isinstance(raw, classmethod):
            return types.MethodType(raw.__func__, obj)
        if isinstance(raw, staticmethod):
            return raw.__func__
        return raw
    return _MISSING


def _missing_attribute(path: str) -> ImportError:
    """The ImportError for a path whose module is imported but lacks the attribute."""
    parts = path.split(".")
    for split in range(len(parts) - 1, 0, -1):
        walked = ".".join(parts[:split])
        obj: Any = sys.modules.get(walked)
        if obj is None:
            continue
        for attr in parts[split:]:
            found = _static_attr(obj, attr)
            if found is _MISSING:
                return ImportError(f"cannot resolve {path!r}: {walked!r} has no attribute {attr!r}")
            obj, walked = found, f"{walked}.{attr}"
    return ImportError(f"cannot resolve {path!r}: no prefix of it is an imported module")


def _unimported_module(path: str) -> str | None:
    """The first module ``path`` names that is importable but not imported yet, if any.

    Only the finder runs (``importlib.util.find_spec`` with the parent package already
    imported): the module's own code does not.
    """
    parts = path.split(".")
    for split in range(len(parts) - 1, 0, -1):
        if ".".join(parts[:split]) in sys.modules:
            break
    else:
        return parts[0]
    parent = sys.modules[".".join(parts[:split])]
    if not isinstance(parent, types.ModuleType) or split >= len(parts):
        return None
    if parts[split] in vars(parent) or not hasattr(parent, "__path__"):
        return None  # an attribute of the module (or a plain module has no submodules)
    name = ".".join(parts[: split + 1])
    try:
        found = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    return name if found is not None else None


def _import_module_prefix(path: str) -> tuple[Any, list[str]]:
    """Import the longest importable module prefix of ``path``; return it and the rest."""
    parts = path.split(".")
    for split in range(len(parts) - 1, 0, -1):
        name = ".".join(parts[:split])
        try:
            return importlib.import_module(name), parts[split:]
        except ModuleNotFoundError as exc:
            missing = exc.name or ""
            if missing == name or name.startswith(missing + "."):
                continue
            raise
    raise ImportError(f"cannot resolve {path!r}: no prefix of it is an importable module")


def _import_path(path: str) -> Any:
    """Import the module part of ``path`` and walk the rest with getattr (calls nothing)."""
    obj, rest = _import_module_prefix(path)
    walked = obj.__name__
    for attr in rest:
        if not hasattr(obj, attr):
            raise ImportError(f"cannot resolve {path!r}: {walked!r} has no attribute {attr!r}")
        obj = getattr(obj, attr)
        walked = f"{walked}.{attr}"
    return obj


# --------------------------------------------------------------------------------------------
# Trust policy
# --------------------------------------------------------------------------------------------

_TRUSTED_PATHS: set[str] = set()
_TRUSTED_OBJECTS: list[Any] = []


def register_trusted(target: str | Callable[..., Any]) -> None:
    """Trust a dotted path (or an importable callable) for every later load in this process.

    Args:
        target: A dotted path such as ``"mypkg.models.make_model"``, or the callable itself
            (which must be importable, see :func:`dotted_path`).

    Raises:
        ValueError: If a string target is not a valid dotted path.
        TypeError: If a callable target is not importable.
    """
    if isinstance(target, str):
        _TRUSTED_PATHS.add(validate_dotted_path(target))
        return
    _TRUSTED_PATHS.add(dotted_path(target))
    _TRUSTED_OBJECTS.append(target)


def _normalize_trusted(
    trusted: Iterable[str | Callable[..., Any]] | None,
) -> tuple[set[str], list[Any]]:
    paths = set(_TRUSTED_PATHS)
    objects = list(_TRUSTED_OBJECTS)
    if trusted is None:
        return paths, objects
    if isinstance(trusted, str):
        trusted = [trusted]
    for entry in trusted:
        if isinstance(entry, str):
            paths.add(entry)
        else:
            paths.add(dotted_path(entry))
            objects.append(entry)
    return paths, objects


def _is_module_factory(parent: Any, attr: str) -> bool:
    """Whether ``parent.attr`` is a classmethod/staticmethod of an ``nn.Module`` subclass."""
    if not (isinstance(parent, type) and issubclass(parent, torch.nn.Module)):
        return False
    return isinstance(inspect.getattr_static(parent, attr, None), (classmethod, staticmethod))


def _annotation_text(func: Any) -> str:
    annotation = getattr(func, "__annotations__", {}).get("return", inspect.Parameter.empty)
    if isinstance(annotation, type):
        return _type_name(annotation)
    return repr(annotation)


def _may_return_module(func: Any, owner: type) -> bool:
    """False when ``func``'s return annotation names something other than a module.

    Unannotated (or unreadable) factories are admitted; :func:`build_model` then calls them on
    the meta device first and refuses a result that is not a module before any real memory is
    allocated. Annotation strings are looked up, never evaluated.
    """
    annotations = getattr(func, "__annotations__", None)
    if not isinstance(annotations, dict) or "return" not in annotations:
        return True
    annotation = annotations["return"]
    if annotation is None:
        return False  # "-> None"
    if isinstance(annotation, str):
        text = annotation.strip().strip("'\"")
        if text in {"Self", "typing.Self", "typing_extensions.Self", owner.__name__}:
            return True
        found = _resolve_loaded(text) if "." in text else _MISSING
        if found is _MISSING:
            namespace = getattr(func, "__globals__", {})
            found = namespace.get(text, _MISSING) if text.isidentifier() else _MISSING
        if found is _MISSING:
            return True  # e.g. "Optional[Net]": unknown, checked on the meta device
        annotation = found
    if isinstance(annotation, type):
        return issubclass(annotation, torch.nn.Module)
    return True


#: Container factories (``fastckpt.checkpoint.containers``) that the model policy admits by default.
_CONTAINER_FACTORIES: tuple[Any, ...] = (
    containers.sequential,
    containers.module_list,
    containers.module_dict,
)


def _policy_allows(kind: str, obj: Any, parent: Any, attr: str) -> bool:
    if kind == "model":
        if isinstance(obj, type) and issubclass(obj, torch.nn.Module):
            return True
        if any(obj is factory for factory in _CONTAINER_FACTORIES):
            return True
        if _is_module_factory(parent, attr):
            return _may_return_module(obj, parent)
        return False
    if kind == "optimizer":
        return isinstance(obj, type) and issubclass(obj, torch.optim.Optimizer)
    if kind == "scheduler":
        lr_scheduler = torch.optim.lr_scheduler
        bases = tuple(
            base
            for base in (
                getattr(lr_scheduler, "LRScheduler", None),
                getattr(lr_scheduler, "_LRScheduler", None),
                getattr(lr_scheduler, "ReduceLROnPlateau", None),
            )
            if isinstance(base, type)
        )
        return isinstance(obj, type) and issubclass(obj, bases)
    return False


_POLICY_TEXT = {
    "model": "a model target may only be a torch.nn.Module subclass or a classmethod/"
    "staticmethod of one",
    "optimizer": "an optimizer target may only be a torch.optim.Optimizer subclass",
    "scheduler": "a scheduler target may only be a torch.optim.lr_scheduler.LRScheduler "
    "subclass or ReduceLROnPlateau",
    "callable": "callable targets (factory functions, training functions) are never allowed",
}


def _refuse(path: str, kind: str, found: str) -> UntrustedTargetError:
    return UntrustedTargetError(
        f"refusing to use {path!r} as a {kind} target: {found}; by default "
        f"{_POLICY_TEXT[kind]}. If you trust this checkpoint, allow it with "
        f"trusted=[{path!r}] in the load call, or call "
        f"fastckpt.checkpoint.specs.register_trusted({path!r}) before loading"
    )


def resolve_target(
    path: str, kind: str, trusted: Iterable[str | Callable[..., Any]] | None = None
) -> Any:
    """Resolve a dotted path from a checkpoint to an object, applying the trust policy.

    The path is checked first (see :func:`validate_dotted_path`). A path listed in
    ``trusted`` or registered with :func:`register_trusted` is allowed. Otherwise the default
    policy for ``kind`` applies: ``"model"`` allows ``nn.Module`` subclasses and
    classmethods/staticmethods of them, ``"optimizer"`` allows ``torch.optim.Optimizer``
    subclasses, ``"scheduler"`` allows LR-scheduler classes (including ``ReduceLROnPlateau``),
    and ``"callable"`` allows nothing. A classmethod/staticmethod is a model target only if
    its return annotation (when it has one) names an ``nn.Module``;
    ``fastckpt.checkpoint.containers``'
    factories are model targets too. An untrusted path is decided without importing anything:
    it is looked up only through modules that are already imported (a tampered spec must not
    be able to run the import-time code of an installed module, or of a submodule of an
    imported package), and a path that needs a module not imported yet is refused (fastckpt's
    own modules excepted). A trusted path is imported as needed. Nothing is called.

    Args:
        path: The dotted path, e.g. ``"torch.nn.Linear"`` or ``"pkg.Model.from_config"``.
        kind: One of ``"model"``, ``"optimizer"``, ``"scheduler"``, ``"callable"``.
        trusted: Extra dotted paths or callables to allow for this call.

    Returns:
        The resolved class or function.

    Raises:
        ValueError: If ``kind`` is unknown.
        CheckpointFormatError: If ``path`` is not a valid dotted path.
        UntrustedTargetError: If the policy refuses the target; the message names the path,
            the kind and how to allow it.
        ImportError: If the module part cannot be imported or an attribute is missing.
    """
    if kind not in TARGET_KINDS:
        raise ValueError(f"unknown target kind {kind!r}; expected one of {sorted(TARGET_KINDS)}")
    try:
        validate_dotted_path(path)
    except ValueError as exc:
        raise CheckpointFormatError(f"invalid target path: {exc}") from exc
    paths, objects = _normalize_trusted(trusted)
    if path in paths:
        return _import_path(path)
    if kind == "callable":
        # No default allowance: decide without importing anything. A trusted callable may
        # still match under another (alias) path if its module is already loaded.
        loaded = _resolve_loaded(path) if objects else _MISSING
        if loaded is not _MISSING and any(_same_target(loaded, obj) for obj in objects):
            return loaded
        raise _refuse(path, kind, "it is not in the trusted list")
    obj = _resolve_loaded(path)
    if obj is _MISSING and _top_package(path) == __name__.split(".", 1)[0]:
        # fastckpt's own modules (``fastckpt.demo`` run as a script, say) are this library's
        # code, which is already running: importing one is no new trust.
        obj = _import_path(path)
    if obj is _MISSING:
        # Importing a module runs its code: a tampered spec must not be able to make us import
        # anything (an installed package, or a submodule of an imported one) before the check.
        missing = _unimported_module(path)
        if missing is None:
            raise _missing_attribute(path)
        raise _refuse(
            path,
            kind,
            f"the module {missing!r} is not imported in this process, and fastckpt does not "
            f"import modules a checkpoint names (import {missing} yourself before loading)",
        )
    if any(_same_target(obj, trusted_obj) for trusted_obj in objects):
        return obj
    parent_path, _, attr = path.rpartition(".")
    parent = _resolve_loaded(parent_path)
    if _policy_allows(kind, obj, parent, attr):
        return obj
    if isinstance(obj, type):
        found = f"it resolves to the class {_type_name(obj)!r}"
    elif kind == "model" and _is_module_factory(parent, attr):
        found = (
            f"it is annotated to return {_annotation_text(obj)}, not an nn.Module, so it is "
            "not a model constructor"
        )
    else:
        found = f"it resolves to a {type(obj).__name__}, not a class"
    raise _refuse(path, kind, found)


def _is_trusted_path(path: str, trusted: Iterable[str | Callable[..., Any]] | None) -> bool:
    """Whether the caller allowed ``path`` explicitly (``trusted=`` or registration)."""
    paths, objects = _normalize_trusted(trusted)
    if path in paths:
        return True
    loaded = _resolve_loaded(path) if objects else _MISSING
    return loaded is not _MISSING and any(_same_target(loaded, obj) for obj in objects)


#: Top-level packages whose functions are never restored as a training function by default.
_NEVER_TRAINING_FN_PACKAGES = frozenset({"torch", "fastckpt", "builtins", "__main__"})


@functools.cache
def _installed_roots() -> tuple[Path, ...]:
    """Directories of the standard library and of installed (site-packages) distributions
    (computed once: every save of a model asks, and resolving them took milliseconds)."""
    roots: set[str] = set()
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        value = sysconfig.get_paths().get(key)
        if value:
            roots.add(value)
    getsitepackages = getattr(site, "getsitepackages", None)
    if getsitepackages is not None:
        roots.update(getsitepackages())
    if site.ENABLE_USER_SITE and site.USER_SITE:
        roots.add(site.USER_SITE)
    return tuple(Path(root).resolve() for root in roots)


def _is_installed_module(module: types.ModuleType) -> bool:
    """True for standard-library, built-in and site-packages modules (not the user's code)."""
    filename = getattr(module, "__file__", None)
    if not isinstance(filename, str):
        return True  # built-in, frozen or namespace-only: not the user's source file
    return _is_installed_file(filename)


@functools.lru_cache(maxsize=1024)
def _is_installed_file(filename: str) -> bool:
    where = Path(filename).resolve()
    return any(where.is_relative_to(root) for root in _installed_roots())


def _top_package(module_name: str) -> str:
    return module_name.split(".", 1)[0]


def _model_packages(models: Iterable[Any]) -> set[str]:
    packages = set()
    for model in models:
        cls = model if isinstance(model, type) else type(model)
        if isinstance(cls, type) and issubclass(cls, torch.nn.Module):
            package = _top_package(cls.__module__)
            if package not in _NEVER_TRAINING_FN_PACKAGES and package not in _stdlib_names():
                packages.add(package)
    return packages


def _stdlib_names() -> frozenset[str]:
    return frozenset(getattr(sys, "stdlib_module_names", ())) | frozenset(sys.builtin_module_names)


def _refuse_training_fn(path: str, why: str) -> UntrustedTargetError:
    return UntrustedTargetError(
        f"cannot restore the training function {path!r} by itself: {why}. Pass "
        f"training_fn=<the function> to the load call; if you trust this checkpoint you can "
        f"instead allow the recorded path with trusted=[{path!r}] or "
        f"fastckpt.checkpoint.specs.register_trusted({path!r})"
    )


def resolve_training_fn(
    path: str,
    trusted: Iterable[str | Callable[..., Any]] | None = None,
    *,
    models: Iterable[Any] = (),
) -> Callable[..., Any]:
    """Resolve the training function a strategy checkpoint recorded, without importing.

    A path listed in ``trusted`` or registered with :func:`register_trusted` is allowed (and
    imported if needed). Otherwise the function is restored only when all of these hold:

    * its module is already imported in this process (nothing is imported to find it);
    * it is a plain Python function (``def``) defined at module level where the path says,
      not a builtin, class, method, ``functools.partial`` or callable object, and not a name
      re-exported from another module;
    * it is the user's code: not from the standard library, torch or fastckpt, and either not
      installed in site-packages or in the same top-level package as one of ``models``' classes
      (the model classes the checkpoint rebuilt under the trust policy);
    * it was not recorded as ``__main__.<name>``: the ``__main__`` of a loading process is a
      different script, so such a function must always be passed as ``training_fn=``.

    Args:
        path: The recorded dotted path, e.g. ``"mytrainer.losses.step"``.
        trusted: Extra dotted paths or callables to allow.
        models: The rebuilt models (or their classes) whose packages count as the user's.

    Returns:
        The function.

    Raises:
        CheckpointFormatError: If ``path`` is not a valid dotted path.
        UntrustedTargetError: If the function cannot be restored this way; the message says
            why and to pass ``training_fn=``.
    """
    try:
        validate_dotted_path(path)
    except ValueError as exc:
        raise CheckpointFormatError(f"invalid training function path: {exc}") from exc
    if _is_trusted_path(path, trusted):
        return resolve_target(path, "callable", trusted)
    module_name, _, name = path.rpartition(".")
    if _top_package(path) == "__main__":
        raise _refuse_training_fn(
            path,
            "it was defined in the script that ran the training (__main__), which is not the "
            "script loading it; a function recorded as __main__.<name> always has to be passed",
        )
    obj = _resolve_loaded(path)
    if obj is _MISSING:
        missing = _unimported_module(path)
        if missing is None:
            raise _refuse_training_fn(path, str(_missing_attribute(path)))
        raise _refuse_training_fn(
            path,
            f"the module {missing!r} is not imported in this process and fastckpt does not "
            f"import modules a checkpoint names (import {missing} before loading, or pass it)",
        )
    if not isinstance(obj, types.FunctionType):
        raise _refuse_training_fn(
            path, f"it is a {type(obj).__name__}, not a plain Python function defined with def"
        )
    if obj.__module__ != module_name or obj.__qualname__ != name:
        raise _refuse_training_fn(
            path,
            f"it is {obj.__module__}.{obj.__qualname__}, not a function defined at module level "
            f"in {module_name}",
        )
    package = _top_package(module_name)
    if package in _NEVER_TRAINING_FN_PACKAGES or package in _stdlib_names():
        raise _refuse_training_fn(
            path, f"functions of {package!r} (standard library, torch, fastckpt) are not restored"
        )
    module = sys.modules.get(module_name)
    if module is None or (_is_installed_module(module) and package not in _model_packages(models)):
        raise _refuse_training_fn(
            path,
            f"{module_name} is an installed third-party module, and no model in the checkpoint "
            f"comes from the package {package!r}",
        )
    return obj


# --------------------------------------------------------------------------------------------
# Specs
# --------------------------------------------------------------------------------------------


def _utc_now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat()


@dataclass(eq=False)
class BaseSpec:
    """A recipe for rebuilding an object: an importable dotted path plus keyword arguments.

    Attributes:
        cls_path: Importable dotted path of the target, e.g. ``"torch.nn.Linear"`` or
            ``"pkg.mod.Model.from_config"``.
        kwargs: Live keyword arguments; values may be nested specs (alone or inside lists,
            tuples and dicts), which :meth:`build` builds first.
        timestamp: ISO-8601 UTC time the spec was created.
    """

    cls_path: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    timestamp: str = field(default_factory=_utc_now)

    def __post_init__(self) -> None:
        validate_dotted_path(self.cls_path)
        if not isinstance(self.kwargs, dict) or not all(isinstance(k, str) for k in self.kwargs):
            raise TypeError("BaseSpec.kwargs must be a dict with string keys")
        if not isinstance(self.timestamp, str):
            raise TypeError("BaseSpec.timestamp must be an ISO-8601 string")

    def __eq__(self, other: object) -> bool:
        """Compare two specs by their JSON form (identity if either cannot be encoded).

        Args:
            other: The object to compare with.

        Returns:
            Whether both specs encode to the same JSON.
        """
        if not isinstance(other, BaseSpec):
            return NotImplemented
        try:
            return self.to_json() == other.to_json()
        except TypeError:
            return self is other

    __hash__ = None  # type: ignore[assignment]

    def resolve(
        self,
        *,
        trusted: Iterable[str | Callable[..., Any]] | None = None,
        kind: str = "model",
    ) -> Any:
        """Resolve this spec's target through the trust policy (nothing is called).

        Args:
            trusted: Extra dotted paths or callables to allow (see :func:`resolve_target`).
            kind: The target kind whose default policy applies.

        Returns:
            The target class or function.

        Raises:
            UntrustedTargetError: If the trust policy refuses the target.
            CheckpointFormatError: If ``cls_path`` is not a valid dotted path.
            ImportError: If the target cannot be imported.
        """
        return resolve_target(self.cls_path, kind, trusted)

    def build(
        self,
        *,
        trusted: Iterable[str | Callable[..., Any]] | None = None,
        kind: str = "model",
        **overrides: Any,
    ) -> Any:
        """Build the object: resolve every target, build nested specs, then call the target.

        All targets in the spec tree (this spec and nested ones, which use the same ``kind``)
        pass the trust policy before anything is called. The call is
        ``target(**{**kwargs, **overrides})``; overrides are passed as they are (nested
        specs in them are not built). A target keyword named ``trusted`` or ``kind`` cannot be
        overridden through this method; put it in ``kwargs`` instead.

        Args:
            trusted: Extra dotted paths or callables to allow (see :func:`resolve_target`).
            kind: The target kind whose default policy applies.
            **overrides: Keyword arguments that replace or extend ``kwargs``.

        Returns:
            Whatever the target returns.

        Raises:
            UntrustedTargetError: If the trust policy refuses any target in the tree.
            CheckpointFormatError: If a path is not a valid dotted path.
            ImportError: If a target cannot be imported.
            ValueError: If the spec tree contains itself.
        """
        targets: dict[int, Any] = {}
        self._resolve_tree(targets, kind, trusted, set())
        return self._build_with(targets, overrides)

    def _resolve_tree(
        self,
        targets: dict[int, Any],
        kind: str,
        trusted: Iterable[str | Callable[..., Any]] | None,
        active: set[int],
    ) -> None:
        if id(self) in active:
            raise ValueError(f"spec for {self.cls_path!r} contains itself")
        active.add(id(self))
        targets[id(self)] = resolve_target(self.cls_path, kind, trusted)
        for nested in _nested_specs(self.kwargs):
            nested._resolve_tree(targets, kind, trusted, active)
        active.discard(id(self))

    def _build_with(self, targets: dict[int, Any], overrides: Mapping[str, Any]) -> Any:
        kwargs = {key: _build_value(value, targets) for key, value in self.kwargs.items()}
        kwargs.update(overrides)
        return targets[id(self)](**kwargs)

    def accepts_kwarg(
        self,
        name: str,
        *,
        trusted: Iterable[str | Callable[..., Any]] | None = None,
        kind: str = "model",
    ) -> bool:
        """Tell whether the target accepts the keyword argument ``name``.

        The target is resolved through the trust policy first, since inspecting it means
        importing it.

        Args:
            name: The keyword, e.g. ``"device"``.
            trusted: Extra dotted paths or callables to allow (see :func:`resolve_target`).
            kind: The target kind whose default policy applies.

        Returns:
            True if the signature has that keyword parameter or a ``**kwargs`` catch-all;
            False otherwise, or if the signature cannot be inspected.

        Raises:
            UntrustedTargetError: If the trust policy refuses the target.
            ImportError: If the target cannot be imported.
        """
        target = resolve_target(self.cls_path, kind, trusted)
        try:
            signature = inspect.signature(target)
        except (TypeError, ValueError):
            return False
        return _signature_accepts(signature, name)

    def to_json(self) -> dict[str, Any]:
        """Encode the spec as JSON-able data.

        Returns:
            ``{"cls_path": ..., "kwargs": {name: encoded value}, "timestamp": ...}``; nested
            specs appear as ``{"__spec__": {...}}``.

        Raises:
            TypeError: If a keyword argument cannot be stored (the message names its path).
        """
        return self._to_json("kwargs", set())

    def _to_json(self, path: str, active: set[int]) -> dict[str, Any]:
        if id(self) in active:
            raise TypeError(f"{path}: the spec for {self.cls_path!r} contains itself")
        active.add(id(self))
        try:
            prefix = path if path == "kwargs" else f"{path}.kwargs"
            kwargs = {
                key: _encode(value, f"{prefix}[{key!r}]", active)
                for key, value in self.kwargs.items()
            }
        finally:
            active.discard(id(self))
        return {"cls_path": self.cls_path, "kwargs": kwargs, "timestamp": self.timestamp}

    @classmethod
    def from_json(cls, data: Mapping[str, Any], *, source: str | None = None) -> BaseSpec:
        """Parse a spec produced by :meth:`to_json`, validating it; nothing is imported.

        Args:
            data: The parsed JSON object.
            source: Optional name of the file the data came from, used in error messages.

        Returns:
            The spec, with keyword arguments decoded into live values.

        Raises:
            CheckpointFormatError: If a field is missing, has the wrong type, the path is not
                a valid dotted path, or a keyword argument is malformed; the message names the
                field (and ``source`` when given).
        """
        try:
            return cls._from_json(data, "spec")
        except CheckpointFormatError as exc:
            if source is None:
                raise
            raise CheckpointFormatError(f"{source}: {exc}") from exc

    @classmethod
    def _from_json(cls, data: Any, path: str) -> BaseSpec:
        if not isinstance(data, Mapping):
            raise CheckpointFormatError(
                f"{path}: a spec must be a JSON object, found {type(data).__name__}"
            )
        expected = {"cls_path", "kwargs", "timestamp"}
        missing = expected - set(data)
        if missing:
            raise CheckpointFormatError(f"{path}: missing field(s) {sorted(missing)}")
        extra = set(data) - expected
        if extra:
            raise CheckpointFormatError(f"{path}: unexpected field(s) {sorted(map(str, extra))}")
        cls_path = data["cls_path"]
        try:
            validate_dotted_path(cls_path)
        except ValueError as exc:
            raise CheckpointFormatError(f"{path}.cls_path: {exc}") from exc
        timestamp = data["timestamp"]
        if not isinstance(timestamp, str):
            raise CheckpointFormatError(f"{path}.timestamp: must be a string")
        try:
            _dt.datetime.fromisoformat(timestamp.replace("Z", "+00:00"))
        except ValueError as exc:
            raise CheckpointFormatError(
                f"{path}.timestamp: not an ISO-8601 time: {timestamp!r}"
            ) from exc
        raw_kwargs = data["kwargs"]
        if not isinstance(raw_kwargs, Mapping):
            raise CheckpointFormatError(f"{path}.kwargs: must be a JSON object")
        prefix = "kwargs" if path == "spec" else f"{path}.kwargs"
        kwargs: dict[str, Any] = {}
        for key, value in raw_kwargs.items():
            if not isinstance(key, str):
                raise CheckpointFormatError(f"{prefix}: keyword names must be strings")
            kwargs[key] = decode_value(value, f"{prefix}[{key!r}]")
        return cls(cls_path=cls_path, kwargs=kwargs, timestamp=timestamp)


def _nested_specs(value: Any) -> Iterable[BaseSpec]:
    if isinstance(value, BaseSpec):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _nested_specs(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _nested_specs(item)


def _build_value(value: Any, targets: dict[int, Any]) -> Any:
    if isinstance(value, BaseSpec):
        return value._build_with(targets, {})
    if type(value) is list:
        return [_build_value(item, targets) for item in value]
    if type(value) is tuple:
        return tuple(_build_value(item, targets) for item in value)
    if type(value) is dict:
        return {key: _build_value(item, targets) for key, item in value.items()}
    return value


def _signature_accepts(signature: inspect.Signature, name: str) -> bool:
    for param in signature.parameters.values():
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            return True
        if param.name == name and param.kind in (
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
            inspect.Parameter.KEYWORD_ONLY,
        ):
            return True
    return False


def create_model_spec(target: Callable[..., Any], **kwargs: Any) -> BaseSpec:
    """Create a spec that rebuilds an object by calling ``target(**kwargs)``.

    Everything that would make the spec unusable later is checked now, before anything is
    written: the target must be importable by its dotted path (see :func:`dotted_path`), must
    have no positional-only parameters, must accept every given keyword, and every value must
    be storable (see :func:`encode_value`).

    Args:
        target: A module-level class or function, or a classmethod/staticmethod of a
            module-level class.
        **kwargs: The keyword arguments to call it with.

    Returns:
        The spec (holding the live ``kwargs``).

    Raises:
        TypeError: If the target is a lambda, local function, closure, ``functools.partial``,
            bound method of an instance, non-importable builtin, has positional-only
            parameters, does not accept one of the keywords, or a value cannot be stored.
    """
    path = dotted_path(target)
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"cannot inspect the signature of {path!r} ({exc}); wrap it in a module-level "
            "factory function with keyword parameters"
        ) from exc
    positional_only = [
        p.name for p in signature.parameters.values() if p.kind is inspect.Parameter.POSITIONAL_ONLY
    ]
    if positional_only:
        raise TypeError(
            f"{path!r} has positional-only parameter(s) {positional_only}; a spec passes "
            "keyword arguments only, so wrap it in a factory with keyword parameters"
        )
    for name in kwargs:
        if not _signature_accepts(signature, name):
            accepted = [
                p.name
                for p in signature.parameters.values()
                if p.kind
                in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
            ]
            raise TypeError(
                f"{path!r} does not accept the keyword argument {name!r}; it accepts {accepted}"
            )
    spec = BaseSpec(cls_path=path, kwargs=dict(kwargs))
    spec.to_json()  # fail now, with the kwarg path, if a value cannot be stored
    return spec


_ATTACHED_SPEC = "_fastckpt_spec"


def attach_spec(model: torch.nn.Module, spec: BaseSpec) -> torch.nn.Module:
    """Record how to rebuild this one model instance, for classes you cannot (or would rather
    not) give a ``checkpoint_spec()`` method.

    :func:`model_spec`, and so every checkpoint of ``model`` (``TrainingStrategy``,
    ``CheckpointHook``, ``save_checkpoint(models={name: (model, None)})``), uses ``spec``.

    Args:
        model: The module.
        spec: A spec that builds a module with the same parameters and buffers, e.g.
            ``fastckpt.create_model_spec(make_model, width=512)``. A factory function needs
            ``trusted=[...]`` when loading; a class or a classmethod of an ``nn.Module`` does not.

    Returns:
        ``model`` itself.

    Raises:
        TypeError: If ``spec`` is not a :class:`BaseSpec` or cannot be stored.
    """
    if not isinstance(spec, BaseSpec):
        raise TypeError(f"attach_spec: spec must be a BaseSpec, got {type(spec).__name__}")
    spec.to_json()  # fail now if an argument cannot be stored
    object.__setattr__(model, _ATTACHED_SPEC, spec)
    return model


def _recipe_advice(cls: type) -> str:
    """How to make a model of class ``cls`` recordable (only fixes that work for it)."""
    name = cls.__qualname__
    attach = (
        "attach a recipe to the instance: fastckpt.checkpoint.specs.attach_spec(model, "
        "fastckpt.create_model_spec(<module-level class, classmethod or factory>, **kwargs))"
    )
    module = sys.modules.get(cls.__module__)
    if module is None or _is_installed_module(module):
        return attach  # a class from torch or another installed package cannot be edited
    return (
        f"give {name} a checkpoint_spec() method returning fastckpt.create_model_spec(...), "
        f"keep each constructor argument as an attribute of the same name, or {attach}"
    )


_CONTAINERS: dict[type, Callable[..., Any]] = {
    torch.nn.Sequential: containers.sequential,
    torch.nn.ModuleDict: containers.module_dict,
    torch.nn.ModuleList: containers.module_list,
}


def _container_spec(model: torch.nn.Module) -> BaseSpec:
    """Sequential / ModuleDict / ModuleList: one nested spec per child, in order."""
    cls = type(model)
    children: dict[str, BaseSpec] = {}
    for child_name, child in model.named_children():
        try:
            children[child_name] = model_spec(child)
        except TypeError as exc:
            raise TypeError(f"{cls.__name__} child {child_name!r}: {exc}") from exc
    factory = _CONTAINERS[cls]
    if factory is containers.module_list:
        expected = [str(i) for i in range(len(children))]
        if list(children) != expected:
            raise TypeError(f"ModuleList children are named {list(children)}, not {expected}")
        return create_model_spec(factory, children=list(children.values()))
    return create_model_spec(factory, children=children)


def model_spec(model: torch.nn.Module) -> BaseSpec:
    """Derive a spec that rebuilds ``model`` (with fresh weights).

    A spec attached with :func:`attach_spec` comes first. Then, if the model has a
    ``checkpoint_spec()`` method returning a :class:`BaseSpec`, that spec is used.
    ``nn.Sequential``, ``nn.ModuleList`` and ``nn.ModuleDict`` (exactly those classes) are
    recorded as calls to :mod:`fastckpt.checkpoint.containers` with the children's specs,
    recursively.
    Otherwise the constructor of ``type(model)`` is introspected: each parameter takes the
    value of the model attribute with the same name (a submodule becomes its own nested spec,
    recursively); a parameter with a ``bool`` default whose
    attribute is a tensor or ``None`` becomes ``attribute is not None`` (so
    ``nn.Linear(bias=...)`` works); a parameter without a matching attribute is omitted if it
    has a default.

    Args:
        model: The module.

    Returns:
        The spec.

    Raises:
        TypeError: If ``checkpoint_spec()`` returns something other than a spec or ``None``,
            or a constructor argument cannot be recovered from the model (the message names
            the class and parameter and the fixes that work for that class).
    """
    attached = vars(model).get(_ATTACHED_SPEC)
    if isinstance(attached, BaseSpec):
        return attached
    hook = getattr(model, "checkpoint_spec", None)
    if callable(hook):
        custom = hook()
        if isinstance(custom, BaseSpec):
            return custom
        if custom is not None:
            raise TypeError(
                f"{type(model).__name__}.checkpoint_spec() must return a BaseSpec or None, "
                f"got {type(custom).__name__}"
            )
    cls = type(model)
    if cls in _CONTAINERS:
        return _container_spec(model)
    name = cls.__qualname__
    advice = _recipe_advice(cls)
    init = cls.__init__
    if init is torch.nn.Module.__init__:
        return create_model_spec(cls)
    try:
        signature = inspect.signature(init)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"cannot inspect {name}.__init__ ({exc}); {advice}") from exc
    params = list(signature.parameters.values())[1:]  # drop self
    kwargs: dict[str, Any] = {}
    for param in params:
        if param.kind is inspect.Parameter.VAR_POSITIONAL:
            raise TypeError(
                f"{name} takes *{param.name} in its constructor, which cannot be recovered "
                f"from the instance; {advice}"
            )
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            continue
        if param.kind is inspect.Parameter.POSITIONAL_ONLY:
            raise TypeError(f"{name} has the positional-only parameter {param.name!r}; {advice}")
        has_default = param.default is not inspect.Parameter.empty
        if not hasattr(model, param.name):
            if has_default:
                continue
            raise TypeError(
                f"cannot recover constructor parameter {param.name!r} of {name}: the model has "
                f"no attribute of that name; {advice}"
            )
        value = getattr(model, param.name)
        if isinstance(param.default, bool) and (value is None or isinstance(value, torch.Tensor)):
            value = value is not None
        if isinstance(value, torch.nn.Module):
            # A submodule passed to the constructor (``Net(encoder=...)``): its own recipe.
            try:
                kwargs[param.name] = model_spec(value)
            except TypeError as exc:
                raise TypeError(f"{name}.{param.name}: {exc}") from exc
            continue
        try:
            encode_value(value, f"{name}.{param.name}")
        except TypeError as exc:
            raise TypeError(
                f"cannot recover constructor parameter {param.name!r} of {name}: {exc}; {advice}"
            ) from exc
        kwargs[param.name] = value
    return create_model_spec(cls, **kwargs)


# --------------------------------------------------------------------------------------------
# Building models safely, and checking a model can be rebuilt
# --------------------------------------------------------------------------------------------

#: Memory a model may hold beyond its checkpointed tensors (non-persistent buffers such as
#: attention masks or rotary tables): at most this, or as much as the checkpoint, if larger.
EXTRA_BUFFER_BYTES = 64 * 2**20


def _tree_paths(spec: BaseSpec) -> list[str]:
    paths = [spec.cls_path]
    for nested in _nested_specs(spec.kwargs):
        paths.extend(_tree_paths(nested))
    return paths


def _build_on_meta(spec: BaseSpec, targets: dict[int, Any], accepts_device: bool) -> Any:
    overrides = {"device": torch.device("meta")} if accepts_device else {}
    with torch.device("meta"):
        return spec._build_with(targets, overrides)


def _shape_of(value: Any) -> tuple[int, ...] | None:
    shape = getattr(value, "shape", None)
    if shape is None and isinstance(value, Mapping):
        shape = value.get("shape")
    if shape is None:
        return None
    try:
        return tuple(int(dim) for dim in shape)
    except (TypeError, ValueError):
        return None


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _compare_with_checkpoint(
    probe: torch.nn.Module, expected: Mapping[str, Any], where: str
) -> None:
    """Refuse a model whose tensors do not match the checkpoint's, before it is allocated."""
    state = {k: v for k, v in probe.state_dict().items() if isinstance(v, torch.Tensor)}
    missing = [key for key in state if key not in expected]
    unexpected = [key for key in expected if key not in state]
    if missing or unexpected:
        raise CheckpointFormatError(
            f"{where}: the model the spec builds does not match the checkpoint's tensors "
            f"(missing from the checkpoint: {missing[:5]}, not in the model: {unexpected[:5]}); "
            "it was not built"
        )
    checkpoint_bytes = 0
    for key, tensor in state.items():
        recorded = _shape_of(expected[key])
        if recorded != tuple(tensor.shape):
            raise CheckpointFormatError(
                f"{where}: tensor {key!r} of the model the spec builds has shape "
                f"{list(tensor.shape)}, the checkpoint holds {list(recorded or ())}; the spec "
                "and the weights do not belong together, so the model was not built"
            )
        checkpoint_bytes += math.prod(recorded) * tensor.element_size()
    unique = {id(t): t for t in [*probe.parameters(), *probe.buffers()]}
    model_bytes = sum(_nbytes(t) for t in unique.values() if t.device.type == "meta")
    allowance = checkpoint_bytes + max(EXTRA_BUFFER_BYTES, checkpoint_bytes)
    if model_bytes > allowance:
        raise CheckpointFormatError(
            f"{where}: the model the spec builds would hold {model_bytes} bytes of tensors, far "
            f"more than the {checkpoint_bytes} bytes of the checkpoint's; it was not built"
        )


def build_model(
    spec: BaseSpec,
    *,
    expected: Mapping[str, Any] | None = None,
    device: str | torch.device | None = None,
    trusted: Iterable[str | Callable[..., Any]] | None = None,
    where: str | None = None,
) -> torch.nn.Module:
    """Build the model a checkpoint's spec describes, checking it before memory is allocated.

    1. Every target in the spec tree passes the trust policy (kind ``"model"``); nothing is
       imported for an untrusted path and nothing is called yet.
    2. The spec is built once on the meta device (``with torch.device("meta")``, and
       ``device="meta"`` for targets that accept ``device``), which allocates no tensor
       memory. A result that is not an ``nn.Module`` is refused. With ``expected``, its
       ``state_dict`` must have exactly the checkpoint's tensor names and shapes, and all its
       parameters and buffers may exceed the checkpoint's bytes by at most
       ``max(EXTRA_BUFFER_BYTES, checkpoint bytes)``.
    3. Only then is it built for real (on ``device`` when the target accepts ``device``).

    If the meta build itself fails (a constructor that reads tensor values, say), the model is
    built for real only when the root target was trusted explicitly (``trusted=`` or
    :func:`register_trusted`); otherwise that is an error saying so.

    Args:
        spec: The model spec read from the checkpoint.
        expected: Tensor name -> the checkpoint's tensor (anything with ``.shape``, e.g. the
            mapped tensors of the weights file) or header entry (a mapping with ``"shape"``).
        device: Passed as ``device=`` to targets that accept it.
        trusted: Extra dotted paths or callables to allow (see :func:`resolve_target`).
        where: How to name the checkpoint file in messages.

    Returns:
        The model, with freshly initialized weights.

    Raises:
        UntrustedTargetError: If the trust policy refuses a target.
        CheckpointFormatError: If the spec does not build a module, does not match
            ``expected``, cannot be checked on the meta device, or its constructor fails.
    """
    where = where or f"spec {spec.cls_path!r}"
    targets: dict[int, Any] = {}
    spec._resolve_tree(targets, "model", trusted, set())
    root = targets[id(spec)]
    try:
        accepts_device = _signature_accepts(inspect.signature(root), "device")
    except (TypeError, ValueError):
        accepts_device = False
    try:
        probe = _build_on_meta(spec, targets, accepts_device)
    except UntrustedTargetError:
        raise
    except Exception as err:
        if not _is_trusted_path(spec.cls_path, trusted):
            raise CheckpointFormatError(
                f"{where}: {spec.cls_path!r} cannot be built on the meta device ({err}), so its "
                "size cannot be checked before memory is allocated; if you trust this "
                f"checkpoint, pass trusted=[{spec.cls_path!r}] to build it directly"
            ) from err
        probe = None
    if probe is not None:
        if not isinstance(probe, torch.nn.Module):
            raise CheckpointFormatError(
                f"{where}: {spec.cls_path!r} did not build an nn.Module (it returned a "
                f"{type(probe).__name__}); it was called on the meta device only"
            )
        if expected is not None:
            _compare_with_checkpoint(probe, expected, where)
        del probe
    overrides = {"device": torch.device(device)} if device is not None and accepts_device else {}
    try:
        model = spec._build_with(targets, overrides)
    except Exception as err:
        raise CheckpointFormatError(
            f"{where}: cannot build model {spec.cls_path!r}: {err}"
        ) from err
    if not isinstance(model, torch.nn.Module):
        raise CheckpointFormatError(f"{where}: {spec.cls_path!r} did not build an nn.Module")
    # Checkpoints of the rebuilt model record the recipe it was built from (already checked).
    return attach_spec(model, spec)


def check_recordable(model: torch.nn.Module, name: str = "main") -> BaseSpec:
    """Fail now, not at the first checkpoint, if ``model``'s recipe cannot be recorded.

    Call it when a training run is set up (``TrainingStrategy`` does, for every model). The
    spec :func:`model_spec` derives is built on the meta device (no memory) with every
    target it names allowed, and its parameters and buffers must have the names and shapes
    of ``model``'s: otherwise a checkpoint would record a recipe that builds a different model.
    A spec attached to the instance (:func:`attach_spec`, or by :func:`build_model` when the
    model was rebuilt from a checkpoint) is returned as it is.

    Args:
        model: The (unwrapped) model.
        name: Its name in the run, for messages.

    Returns:
        The spec checkpoints will record.

    Raises:
        TypeError: If no spec can be derived, or the derived spec builds a model with other
            tensors; the message says what to do for this class.
    """
    cls = type(model)
    attached = vars(model).get(_ATTACHED_SPEC)
    if isinstance(attached, BaseSpec):
        return attached  # given by the caller, or the checkpoint recipe it was built from
    try:
        spec = model_spec(model)
    except TypeError as exc:
        raise TypeError(
            f"model {name!r} ({cls.__module__}.{cls.__qualname__}) cannot be checkpointed: "
            f"its recipe cannot be recorded: {exc}"
        ) from exc
    advice = _recipe_advice(cls)
    paths = _tree_paths(spec)
    targets: dict[int, Any] = {}
    try:
        spec._resolve_tree(targets, "model", paths, set())
        root = targets[id(spec)]
        try:
            accepts_device = _signature_accepts(inspect.signature(root), "device")
        except (TypeError, ValueError):
            accepts_device = False
        probe = _build_on_meta(spec, targets, accepts_device)
    except Exception as exc:
        warnings.warn(
            f"model {name!r}: its recorded spec {spec.cls_path!r} could not be built on the "
            f"meta device ({exc}); loading its checkpoints will need "
            f"trusted=[{spec.cls_path!r}]",
            stacklevel=2,
        )
        return spec
    if not isinstance(probe, torch.nn.Module):
        raise TypeError(
            f"model {name!r}: its recorded spec {spec.cls_path!r} does not build an nn.Module "
            f"(it returned a {type(probe).__name__}); {advice}"
        )
    live = {k: tuple(v.shape) for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    rebuilt = {
        k: tuple(v.shape) for k, v in probe.state_dict().items() if isinstance(v, torch.Tensor)
    }
    if live != rebuilt:
        diff = sorted(k for k in live.keys() | rebuilt.keys() if live.get(k) != rebuilt.get(k))
        details = ", ".join(f"{k}: {live.get(k)} vs {rebuilt.get(k)}" for k in diff[:5])
        raise TypeError(
            f"model {name!r} ({cls.__qualname__}) cannot be checkpointed: the recipe recorded "
            f"for it ({spec.cls_path}) rebuilds a model with other tensors (model vs rebuilt: "
            f"{details}); {advice}"
        )
    return spec
