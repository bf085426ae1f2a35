"""Dotted paths and the trust policy: what a checkpoint may name for fastckpt to import and call.

A checkpoint names code (a model class, an optimizer, a scheduler, a training function) by
dotted path. :func:`resolve_target` applies the policy before anything is called: by default a
model target must be an ``nn.Module`` subclass (or a classmethod/staticmethod of one), an
optimizer target a ``torch.optim.Optimizer`` subclass, a scheduler target an LR-scheduler
class, and any other callable must be trusted explicitly (``trusted=`` on the load call, or
:func:`register_trusted`). :func:`resolve_training_fn` does the same for a recorded training
function.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import inspect
import json
import site
import sys
import sysconfig
import types
import urllib.parse
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

import fastckpt.checkpoint.containers as containers
from fastckpt.checkpoint.values import _type_name
from fastckpt.errors import CheckpointFormatError, UntrustedTargetError

__all__ = [
    "TARGET_KINDS",
    "dotted_path",
    "frozen_trusted",
    "register_trusted",
    "resolve_target",
    "resolve_training_fn",
    "validate_dotted_path",
]

#: The kinds of target :func:`resolve_target` knows a default policy for.
TARGET_KINDS: frozenset[str] = frozenset({"model", "optimizer", "scheduler", "callable"})


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


def frozen_trusted(
    trusted: Iterable[str | Callable[..., Any]] | None,
) -> tuple[str | Callable[..., Any], ...] | None:
    """``trusted=`` as a tuple, taken once at a public entry point: an iterator or generator
    would otherwise be used up by the first target it is checked against (the next were
    refused while the caller had trusted them)."""
    if trusted is None:
        return None
    if isinstance(trusted, str):
        return (trusted,)
    if not isinstance(trusted, Iterable):
        raise TypeError(
            f"trusted= must be dotted paths or callables (a list of them), got {trusted!r}"
        )
    return tuple(trusted)


def _normalize_trusted(
    trusted: Iterable[str | Callable[..., Any]] | None,
) -> tuple[set[str], list[Any]]:
    paths = set(_TRUSTED_PATHS)
    objects = list(_TRUSTED_OBJECTS)
    if trusted is None:
        return paths, objects
    if isinstance(trusted, str):
        trusted = [trusted]
    if not isinstance(trusted, Iterable):
        raise TypeError(
            f"trusted= must be dotted paths or callables (a list of them), got {trusted!r}"
        )
    for entry in trusted:
        if isinstance(entry, str):
            paths.add(validate_dotted_path(entry))  # as register_trusted checks it
        else:
            paths.add(dotted_path(entry))
            objects.append(entry)
    return paths, objects


def _is_module_factory(parent: Any, attr: str) -> bool:
    """Whether ``parent.attr`` is a classmethod/staticmethod of an ``nn.Module`` subclass."""
    if not (isinstance(parent, type) and issubclass(parent, torch.nn.Module)):
        return False
    return isinstance(inspect.getattr_static(parent, attr, None), (classmethod, staticmethod))


def _installed_factory(func: Any) -> str | None:
    """Why a module factory is not the user's code (None: it is).

    A classmethod or staticmethod of an installed library (the standard library, torch,
    fastckpt, site-packages, or a distribution installed elsewhere: see
    :func:`_is_library_module`) may do anything with the arguments a checkpoint gives it: load
    a file the checkpoint names (``LightningModule.load_from_checkpoint`` unpickles one,
    ``from_pretrained`` may run remote code). Such a factory, inherited or not, needs trust.
    """
    module_name = getattr(getattr(func, "__func__", func), "__module__", None)
    if not isinstance(module_name, str):
        return "its defining module is unknown"
    if module_name == "__main__":
        return None  # the script, notebook or REPL that runs: the user's code
    package = _top_package(module_name)
    module = sys.modules.get(module_name)
    if (
        package in ("torch", "fastckpt", "builtins")
        or package in _stdlib_names()
        or module is None
        or _is_library_module(module)
    ):
        return (
            f"it is defined in {module_name}, an installed library, not your code (a library's "
            "factory may load files or run code the checkpoint names)"
        )
    return None


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
            return _may_return_module(obj, parent) and _installed_factory(obj) is None
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
    "staticmethod of one defined in your own code",
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
        f"fastckpt.checkpoint.trust.register_trusted({path!r}) before loading"
    )


_OWN_PACKAGE = __name__.split(".", 1)[0]
#: fastckpt modules that import third-party frameworks: never imported for a checkpoint.
_THIRD_PARTY_GLUE = (f"{_OWN_PACKAGE}.integrations.",)


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
    it is defined in the user's code (not the standard library, torch, fastckpt, a
    site-packages module or a package an installed distribution provides wherever it lives:
    a library's factory may load what the checkpoint names)
    and its return annotation (when it has one) names an ``nn.Module``;
    ``fastckpt.checkpoint.containers``'
    factories are model targets too. An untrusted path is decided without importing anything:
    it is looked up only through modules that are already imported (a tampered spec must not
    be able to run the import-time code of an installed module, or of a submodule of an
    imported package), and a path that needs a module not imported yet is refused (fastckpt's
    own modules excepted, but not ``fastckpt.integrations``, which import the frameworks they
    join). A trusted path is imported as needed. Nothing is called.

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
    if (
        obj is _MISSING
        and _top_package(path) == _OWN_PACKAGE
        and not path.startswith(_THIRD_PARTY_GLUE)
    ):
        # fastckpt's own modules (``fastckpt.demo`` run as a script, say) are this library's
        # code, which is already running: importing one is no new trust. Not its integrations:
        # importing one imports the framework it joins (Lightning and everything it loads).
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
    elif kind == "model" and _is_module_factory(parent, attr) and _may_return_module(obj, parent):
        found = str(_installed_factory(obj))
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


@functools.cache
def _distribution_packages() -> Mapping[str, tuple[str, ...]]:
    """Top-level package -> the installed distributions that provide it
    (``importlib.metadata``; computed once, and only when a factory or training function is
    judged: it reads every distribution's metadata). Unreadable metadata: none known."""
    try:
        found = importlib.metadata.packages_distributions()
    except Exception:  # a malformed dist-info somewhere: judged by file location alone
        return {}
    return {package: tuple(names) for package, names in found.items()}


@functools.lru_cache(maxsize=1024)
def _installed_by(distribution: str, filename: str) -> bool:
    """Whether ``filename`` is a file of the installed ``distribution``: under the directory
    its metadata lies in (``pip install --target``, a library on ``PYTHONPATH`` beside its
    dist-info), or under the source directory of its editable install (``direct_url.json``).
    A user's own ``tests`` package is not a file of a distribution that happens to install a
    top-level ``tests`` too."""
    try:
        dist = importlib.metadata.distribution(distribution)
        roots = [Path(str(dist.locate_file(""))).resolve()]
        direct = dist.read_text("direct_url.json")
        if direct:
            info = json.loads(direct)
            url = info.get("url", "")
            if (info.get("dir_info") or {}).get("editable") and url.startswith("file://"):
                roots.append(Path(urllib.parse.unquote(url[len("file://") :])).resolve())
    except Exception:  # unreadable metadata: not proven to be this distribution's file
        return False
    where = Path(filename).resolve()
    return any(where.is_relative_to(root) for root in roots)


def _is_library_module(module: types.ModuleType) -> bool:
    """True for a module of an installed library: :func:`_is_installed_module`, or one whose
    file an installed distribution provides wherever it lies (an editable install,
    ``pip install --target``, a library on ``PYTHONPATH`` with its dist-info)."""
    if _is_installed_module(module):
        return True
    filename = getattr(module, "__file__", None)
    names = _distribution_packages().get(_top_package(module.__name__), ())
    return isinstance(filename, str) and any(_installed_by(name, filename) for name in names)


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
        f"fastckpt.checkpoint.trust.register_trusted({path!r})"
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
      from an installed library (in site-packages, or a package an installed distribution
      provides wherever it lives: an editable install, a library on ``PYTHONPATH``) or in the
      same top-level package as one of ``models``' classes (the model classes the checkpoint
      rebuilt under the trust policy);
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
            "it was defined in the script that ran the training (__main__), and a loading "
            "script's __main__ may be another one (a notebook, a different entry point); a "
            "function recorded as __main__.<name> always has to be passed",
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
    if module is None or (_is_library_module(module) and package not in _model_packages(models)):
        raise _refuse_training_fn(
            path,
            f"{module_name} is an installed third-party module, and no model in the checkpoint "
            f"comes from the package {package!r}",
        )
    return obj
