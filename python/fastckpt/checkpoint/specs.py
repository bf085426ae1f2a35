"""Model reconstruction specs: a recipe (dotted path + keyword arguments) for rebuilding an object.

A *spec* is an importable dotted path (``cls_path``) plus keyword arguments. Checkpoints store
specs as plain JSON, never as pickled objects, so loading a checkpoint never deserializes live
Python objects.

Keyword arguments may be plain JSON values (``str``, ``int``, ``float``, ``bool``, ``None``,
lists, and dicts with string keys), tuples, nested specs, or values of a registered type
(:mod:`fastckpt.checkpoint.values`). JSON encoding of a keyword argument value:

* plain JSON values pass through unchanged;
* a tuple becomes ``{"__tuple__": [...]}``;
* a nested spec becomes ``{"__spec__": {...}}``;
* a registered value becomes ``{"__type__": "<dotted type name>", "value": <serialized>}``;
* a dict that happens to use one of those marker keys is wrapped as ``{"__dict__": {...}}``.

Because a checkpoint names code to import and call, the targets are resolved through the
trust policy (:mod:`fastckpt.checkpoint.trust`); models are built and checked by
:mod:`fastckpt.checkpoint.build`. The public names of those two modules are reachable here
too, where earlier releases defined them.
"""

from __future__ import annotations

import datetime as _dt
import inspect
import math
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

import fastckpt.checkpoint.containers as containers
from fastckpt.checkpoint.trust import (
    TARGET_KINDS,
    _is_installed_module,
    dotted_path,
    register_trusted,
    resolve_target,
    resolve_training_fn,
    validate_dotted_path,
)
from fastckpt.checkpoint.values import (
    _find_serializer,
    _serializer_named,
    _type_name,
    register_type_serializer,
)
from fastckpt.errors import CheckpointFormatError
from fastckpt.format.records import unexpected_fields

__all__ = [
    "TARGET_KINDS",
    "BaseSpec",
    "attach_spec",
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

_TUPLE_KEY = "__tuple__"
_SPEC_KEY = "__spec__"
_TYPE_KEY = "__type__"
_DICT_KEY = "__dict__"
#: A float JSON cannot hold (``inf``, ``-inf``, ``nan``: ``Hardtanh(min_val=-inf)``), as its repr.
_FLOAT_KEY = "__float__"
_RESERVED_KEYS = frozenset({_TUPLE_KEY, _SPEC_KEY, _TYPE_KEY, _DICT_KEY, _FLOAT_KEY})

_PLAIN_SCALARS: tuple[type, ...] = (str, int, float, bool, type(None))

_FIX_HINT = (
    "register a serializer for its type with fastckpt.register_type_serializer(), or "
    "point the spec at a factory that takes plain (JSON-serializable) arguments"
)


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
    if type(value) is float and not math.isfinite(value):
        return {_FLOAT_KEY: repr(value)}  # 'inf', '-inf', 'nan'
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
    if set(data) == {_FLOAT_KEY}:
        if data[_FLOAT_KEY] not in ("inf", "-inf", "nan"):
            raise CheckpointFormatError(
                f"{path}: '{_FLOAT_KEY}' must be 'inf', '-inf' or 'nan', got {data[_FLOAT_KEY]!r}"
            )
        return float(data[_FLOAT_KEY])
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
        f"{{'{_SPEC_KEY}': {{...}}}}, {{'{_DICT_KEY}': {{...}}}}, {{'{_FLOAT_KEY}': 'inf'}} or "
        f"{{'{_TYPE_KEY}': name, 'value': ...}}"
    )


def _decode_registered(name: Any, payload: Any, path: str) -> Any:
    if not isinstance(name, str):
        raise CheckpointFormatError(f"{path}: '{_TYPE_KEY}' must be a string, found {name!r}")
    entry = _serializer_named(name)
    if entry is None:
        raise CheckpointFormatError(
            f"{path}: no serializer is registered for type {name!r}; call "
            "fastckpt.checkpoint.values.register_type_serializer() for it before loading"
        )
    value = decode_value(payload, f"{path}.value")
    try:
        return entry.deserialize(value)
    except Exception as exc:
        raise CheckpointFormatError(f"{path}: cannot decode a {name} value: {exc}") from exc


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

    def _build_with(
        self,
        targets: dict[int, Any],
        overrides: Mapping[str, Any],
        device: torch.device | None = None,
    ) -> Any:
        """Call the resolved target (``targets[id(self)]``) with the built keyword arguments
        and ``overrides``; ``device``: given as ``device=`` to every nested spec that records
        a ``device`` of its own (the meta build: a recorded ``device="cpu"`` beats the
        ``torch.device("meta")`` context, and would allocate what the probe must not)."""
        kwargs = {key: _build_value(value, targets, device) for key, value in self.kwargs.items()}
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
            raise unexpected_fields(str(path), sorted(map(str, extra)))
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


def _build_value(value: Any, targets: dict[int, Any], device: torch.device | None = None) -> Any:
    if isinstance(value, BaseSpec):
        pinned = {"device": device} if device is not None and "device" in value.kwargs else {}
        return value._build_with(targets, pinned, device)
    if type(value) is list:
        return [_build_value(item, targets, device) for item in value]
    if type(value) is tuple:
        return tuple(_build_value(item, targets, device) for item in value)
    if type(value) is dict:
        return {key: _build_value(item, targets, device) for key, item in value.items()}
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
    have no positional-only parameters, must accept every given keyword and be given every
    parameter without a default, and every value must be storable (see :func:`encode_value`).

    Args:
        target: A module-level class or function, or a classmethod/staticmethod of a
            module-level class.
        **kwargs: The keyword arguments to call it with.

    Returns:
        The spec (holding the live ``kwargs``).

    Raises:
        TypeError: If the target is a lambda, local function, closure, ``functools.partial``,
            bound method of an instance, non-importable builtin, has positional-only
            parameters, does not accept one of the keywords, needs one not given, or a value
            cannot be stored.
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
    missing = [
        p.name
        for p in signature.parameters.values()
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        and p.default is inspect.Parameter.empty
        and p.name not in kwargs
    ]
    if missing:
        raise TypeError(
            f"{path!r} needs the argument(s) {missing}, which the spec does not give: a load "
            "could not rebuild it; pass them to create_model_spec"
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
    recursively, unless the parameter has a default that is neither None nor a module: then
    the module was made from the argument, which is omitted); a parameter with a ``bool``
    default whose attribute is a tensor, a module or ``None`` becomes ``attribute is not
    None`` (so ``nn.Linear(bias=...)`` works); a parameter without a matching attribute is
    omitted if it has a default. An omitted parameter takes its default at rebuild:
    :func:`~fastckpt.checkpoint.build.check_recordable` proves the rebuilt model equal, or
    refuses it.

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
        if inspect.ismethod(value) and value.__self__ is model:
            # A method of the class, not the argument kept (``ParameterDict(parameters=)``
            # against ``Module.parameters``): as if there were no attribute of that name.
            if has_default:
                continue
            raise TypeError(
                f"cannot recover constructor parameter {param.name!r} of {name}: "
                f"{name}.{param.name} is a method, not the argument kept; {advice}"
            )
        if isinstance(param.default, bool) and (
            value is None or isinstance(value, (torch.Tensor, torch.nn.Module))
        ):
            value = value is not None  # ``bias=True``, ``norm=True`` -> ``self.norm = LayerNorm``
        if isinstance(value, torch.nn.Module):
            if has_default and not (
                param.default is None or isinstance(param.default, torch.nn.Module)
            ):
                # ``self.dropout = nn.Dropout(dropout)``, ``self.act = GELU() if act ==
                # "gelu" else ...``: the module was made from the argument, it is not the
                # argument (passing it back would build another model). The default is
                # recorded; check_recordable proves the rebuilt model equal (or refuses).
                continue
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
