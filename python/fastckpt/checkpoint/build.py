"""Building a model from its spec safely (on the meta device first, checked against the
checkpoint), and checking before the first save that a model can be rebuilt.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import json
import math
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch.nn.utils.parametrize import type_before_parametrizations

import fastckpt.checkpoint.fill as fill
from fastckpt.checkpoint.specs import (
    _ATTACHED_SPEC,
    BaseSpec,
    _nested_specs,
    _recipe_advice,
    attach_spec,
    model_spec,
)
from fastckpt.checkpoint.trust import _is_trusted_path
from fastckpt.errors import CheckpointFormatError, UntrustedTargetError

__all__ = [
    "EXTRA_BUFFER_BYTES",
    "WRAPPER_SEGMENTS",
    "build_model",
    "canonical_name",
    "check_recordable",
    "has_lazy_tensors",
    "naming_file",
    "structural_differences",
]

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
    meta = torch.device("meta")
    overrides = {"device": meta} if accepts_device else {}
    with meta:
        return spec._build_with(targets, overrides, meta)


def _takes_device(target: Any) -> bool:
    """Whether ``target`` names a ``device`` parameter (keyword-passable). A ``**kwargs``
    catch-all does not count: fastckpt would hand ``device=`` to a constructor that passes
    its keywords on to one that refuses it (``class Wide(Base): __init__(self, **kw)``)."""
    try:
        parameter = inspect.signature(target).parameters.get("device")
    except (TypeError, ValueError):
        return False
    return parameter is not None and parameter.kind in (
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
        inspect.Parameter.KEYWORD_ONLY,
    )


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
    model_bytes = sum(_nbytes(t) for t in unique.values())  # a non-meta one too
    allowance = checkpoint_bytes + max(EXTRA_BUFFER_BYTES, checkpoint_bytes)
    if model_bytes > allowance:
        raise CheckpointFormatError(
            f"{where}: the model the spec builds would hold {model_bytes} bytes of tensors, far "
            f"more than the {checkpoint_bytes} bytes of the checkpoint's; it was not built"
        )


def _may_keep_its_device(target: Any, accepts_device: bool) -> bool:
    """Whether a target built with ``device="meta"`` may keep that device somewhere a later
    forward reads it (``self.device = device``, a config): one that takes ``device`` and is
    not torch's own (torch's modules use it for their tensors only)."""
    return accepts_device and not str(getattr(target, "__module__", "")).startswith("torch.")


def _all_meta(model: torch.nn.Module) -> bool:
    return all(t.device.type == "meta" for t in [*model.parameters(), *model.buffers()])


#: What a recorded class path that no longer resolves usually means.
GONE_CLASS_HINT = (
    "the class it records is not there (renamed, moved or removed since the save?): restore "
    "it under that name, or build the object yourself and load the state into it"
)


@contextlib.contextmanager
def naming_file(where: str) -> Iterator[None]:
    """Errors resolving a class path a checkpoint file records, naming the file ``where`` (as
    every format error does): a refusal of the trust policy, and a path that no longer
    resolves (a format error with :data:`GONE_CLASS_HINT`)."""
    try:
        yield
    except UntrustedTargetError as err:
        if where in str(err):
            raise
        raise UntrustedTargetError(f"{where}: {err}") from None
    except ImportError as err:
        raise CheckpointFormatError(f"{where}: {err}; {GONE_CLASS_HINT}") from err


def build_model(
    spec: BaseSpec,
    *,
    expected: Mapping[str, Any] | None = None,
    device: str | torch.device | None = None,
    trusted: Iterable[str | Callable[..., Any]] | None = None,
    where: str | None = None,
    uninitialized_if: Callable[[torch.nn.Module], bool] | None = None,
    dtypes: Mapping[str, torch.dtype] | None = None,
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
       With ``uninitialized_if``, when it holds for the meta-built model, all that
       model's tensors are on the meta device, and the root target does not take ``device``
       (or is torch's own: another may have kept ``device="meta"``), that model is given
       uninitialized memory
       instead (``to_empty``, on the device the real build would use), and its constructor
       is not run again (no initialization, no random draws): for a caller that is about to
       overwrite every tensor (see :func:`fastckpt.checkpoint.fill.fully_restored_by`).
    4. With ``dtypes``, each parameter and buffer they name takes that dtype
       (:func:`fastckpt.checkpoint.fill.match_saved_dtypes`): a model converted after
       construction (``.to(torch.bfloat16)``) is rebuilt in its saved dtypes, not its
       constructor's. The uninitialized memory of 3. is allocated in those dtypes already.

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
        uninitialized_if: Decides, on the meta-built model, whether the caller overwrites
            every tensor it holds (then the memory is left uninitialized, see 3.).
        dtypes: Tensor name -> the dtype the checkpoint holds it in
            (:func:`fastckpt.checkpoint.fill.saved_dtypes`), see 4.

    Returns:
        The model, with freshly initialized weights (or uninitialized memory, see 3.), its
        tensors in ``dtypes``.

    Raises:
        UntrustedTargetError: If the trust policy refuses a target.
        CheckpointFormatError: If the spec does not build a module, does not match
            ``expected``, cannot be checked on the meta device, or its constructor fails.
    """
    where = where or f"spec {spec.cls_path!r}"
    targets: dict[int, Any] = {}
    with naming_file(where):
        spec._resolve_tree(targets, "model", trusted, set())
    root = targets[id(spec)]
    # A spec that records a device passes it however the target takes it (``**kwargs``).
    accepts_device = _takes_device(root) or "device" in spec.kwargs
    probe_failed = False
    try:
        probe = _build_on_meta(spec, targets, accepts_device)
    except UntrustedTargetError:
        raise
    except Exception as err:
        probe_failed = True
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
        if (
            uninitialized_if is not None
            and _all_meta(probe)
            and not _may_keep_its_device(root, accepts_device)
            and uninitialized_if(probe)
        ):
            target = torch.device(device) if device is not None and accepts_device else None
            if dtypes is not None:
                fill.match_saved_dtypes(probe, dtypes)  # on the meta device: no memory yet
            # Where the real build would put tensors: the default device outside the meta block.
            probe.to_empty(device=target or torch.empty(()).device)
            object.__setattr__(probe, _REBUILT_SPEC, spec)
            _UNINITIALIZED.add(probe)
            return attach_spec(probe, spec)
    # Kept for the proof of the model's recipe at its saves (check_recordable): the same
    # recipe's build on the meta device, not made a second time.
    meta_build = probe if probe is not None and _all_on_meta(probe) else None
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
    if dtypes is not None:
        fill.match_saved_dtypes(model, dtypes)
    # Checkpoints of the rebuilt model record the recipe it was built from (proven again at
    # every save: the model may be changed after it was rebuilt), and what it built, for a
    # recipe that cannot be built on the meta device to be proven against.
    attach_spec(model, spec)
    object.__setattr__(model, _REBUILT_SPEC, spec)
    recipe = _recipe_key(spec)
    if meta_build is not None and recipe is not None:
        _PROBES[model] = (recipe, meta_build)
    if probe_failed:  # a save then proves the model against this build (check_recordable)
        object.__setattr__(model, _REBUILT_SHAPES, _tensor_shapes(model))
    return model


def _tensor_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` of every tensor of ``model``'s ``state_dict()``."""
    return {
        name: tuple(value.shape)
        for name, value in model.state_dict().items()
        if isinstance(value, torch.Tensor)
    }


#: Models :func:`build_model` made in uninitialized memory, not read into yet
#: (:func:`built_uninitialized`).
_UNINITIALIZED: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


def built_uninitialized(model: torch.nn.Module) -> bool:
    """Whether :func:`build_model` made ``model`` in uninitialized memory that nothing has
    touched yet (the caller reads the saved weights into it: its pages are mapped in one call
    per piece, see :func:`fastckpt.container.reader.read_tensor_file_into`); asked once."""
    try:
        _UNINITIALIZED.remove(model)
    except KeyError:
        return False
    return True


#: The attribute marking the spec :func:`build_model` attached to a model it rebuilt from a
#: checkpoint (for the advice when a save finds that the model no longer fits it).
_REBUILT_SPEC = "_fastckpt_rebuilt_from"
#: The attribute holding the tensor shapes of a model :func:`build_model` built for real: what
#: its recipe builds, where that recipe cannot be built on the meta device.
_REBUILT_SHAPES = "_fastckpt_rebuilt_shapes"

#: model -> (its recipe without creation times, the model that recipe built on the meta
#: device): a save of the same model with the same recipe compares the model with that
#: build again (tensors, submodule classes and settings, ties: cheap) instead of building it
#: again (0.14 s of a 0.39 s save of a 1000-parameter model). The comparison itself runs at
#: every save: a submodule swapped or weights tied after the first save are seen.
_PROBES: weakref.WeakKeyDictionary[torch.nn.Module, tuple[str, Any]] = weakref.WeakKeyDictionary()


def _all_on_meta(probe: Any) -> bool:
    """Whether ``probe`` (a recipe built on the meta device) is a module holding no memory:
    only such a build is kept. A constructor may still make real tensors (a buffer made with
    ``device="cpu"``, a ``torch.load``), which a kept build would hold for the whole run."""
    if not isinstance(probe, torch.nn.Module):
        return False
    tensors = [*probe.parameters(), *probe.buffers()]
    return all(tensor.is_meta for tensor in tensors)


def _recipe_key(spec: BaseSpec) -> str | None:
    """``spec``'s encoding without the times its specs were made (nested ones included),
    or None when it cannot be encoded (then nothing is cached)."""

    def without_times(encoded: Any) -> Any:
        if isinstance(encoded, dict):
            return {
                key: without_times(value)
                for key, value in encoded.items()
                if not (key == "timestamp" and "cls_path" in encoded)
            }
        if isinstance(encoded, list):
            return [without_times(value) for value in encoded]
        return encoded

    try:
        return json.dumps(without_times(spec.to_json()), sort_keys=True, default=str)
    except (TypeError, ValueError):
        return None


def has_lazy_tensors(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds a parameter or buffer that a lazy module (``nn.LazyLinear``)
    has not shaped yet: it has no recipe to prove and no values to save until its first
    forward pass."""
    return any(
        torch.nn.parameter.is_lazy(tensor)
        for tensor in itertools.chain(model.parameters(), model.buffers())
    )


def check_recordable(model: torch.nn.Module, name: str = "main") -> BaseSpec:
    """Fail now, not at the first checkpoint, if ``model``'s recipe cannot be recorded.

    Call it when a training run is set up (``TrainingStrategy`` does, for every model). The
    spec :func:`model_spec` derives is built on the meta device (no memory) with every
    target it names allowed, and its parameters and buffers must have the names and shapes
    of ``model``'s: otherwise a checkpoint would record a recipe that builds a different model.
    A spec attached to the instance (:func:`attach_spec`, or :func:`build_model` for a model
    it rebuilt from a checkpoint) is proven the same way, at every call: a model changed after
    its spec was attached (a submodule replaced after a resume) is refused before anything is
    written (before, a model rebuilt for real was taken as proven for good, and its next
    checkpoint was committed with a recipe its weights do not fit: it could not be loaded).

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
    found = vars(model).get(_ATTACHED_SPEC)
    attached: BaseSpec | None = found if isinstance(found, BaseSpec) else None
    if attached is not None:
        spec = attached  # the caller's, or the one it was rebuilt from: proven like any
    else:
        try:
            spec = model_spec(model)
        except TypeError as exc:
            raise TypeError(
                f"model {name!r} ({cls.__module__}.{cls.__qualname__}) cannot be checkpointed: "
                f"its recipe cannot be recorded: {exc}"
            ) from exc
    if attached is not None and vars(model).get(_REBUILT_SPEC) is spec:
        advice = (
            "the model was changed after load_checkpoint rebuilt it from that recipe (a "
            "submodule replaced or resized?): record the recipe that builds it now with "
            "fastckpt.checkpoint.specs.attach_spec(model, spec), or give its class a "
            "checkpoint_spec()"
        )
    elif attached is not None:
        advice = "the recipe given to attach_spec does not build this model: fix its arguments"
    else:
        advice = _recipe_advice(cls)
    recipe = _recipe_key(spec)
    cached = _PROBES.get(model)
    if recipe is not None and cached is not None and cached[0] == recipe:
        probe: Any = cached[1]  # the same recipe built before: compared again below
    else:
        probe = None
    try:
        if probe is None:
            # Each target once: every resolve normalizes the allowed list, so a container of
            # N submodules of one class listed N times took O(N^2) (137 s at 8000).
            paths = list(dict.fromkeys(_tree_paths(spec)))
            targets: dict[int, Any] = {}
            spec._resolve_tree(targets, "model", paths, set())
            root = targets[id(spec)]
            accepts_device = _takes_device(root) or "device" in spec.kwargs
            probe = _build_on_meta(spec, targets, accepts_device)
            if recipe is not None and _all_on_meta(probe):
                _PROBES[model] = (recipe, probe)
    except Exception as exc:
        built = vars(model).get(_REBUILT_SHAPES) if vars(model).get(_REBUILT_SPEC) is spec else None
        if isinstance(built, dict):
            # Rebuilt for real from this recipe (its constructor cannot run on the meta
            # device, and the load was trusted): proven against what that build made.
            _refuse_other_tensors(model, name, spec, _tensor_shapes(model), built, advice)
            return spec
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
    _refuse_other_tensors(model, name, spec, _tensor_shapes(model), _tensor_shapes(probe), advice)
    differences, settings = structural_differences(model, probe)
    if differences:
        raise TypeError(
            f"model {name!r} ({cls.__qualname__}) cannot be checkpointed: the recipe recorded "
            f"for it ({spec.cls_path}, with {spec.kwargs}) rebuilds a model that differs from "
            f"it (model vs rebuilt: {'; '.join(differences[:5])}): a constructor argument "
            "is not kept as an attribute of its own name, or the model was changed after it "
            f"was built; {advice}"
        )
    if settings:
        warnings.warn(
            f"model {name!r} ({cls.__qualname__}): a model rebuilt from its checkpoints "
            f"(TrainingStrategy.load_checkpoint) differs from it in attributes that are not "
            f"constructor arguments (model vs rebuilt: {'; '.join(settings[:5])}), set after "
            "it was built (gradient checkpointing, caches); set them again after loading, or "
            "build them into the recipe",
            stacklevel=2,
        )
    generators = [  # a module with an extra state of its own may keep their state there
        f"{path or '<root>'}.{attr}"
        for path, module in _canonical_modules(model).items()
        if not _has_own_extra_state(module)
        for attr, value in sorted(vars(module).items())
        if isinstance(value, torch.Generator)
    ]
    if generators:
        warnings.warn(
            f"model {name!r} ({cls.__qualname__}) holds random generators of its own "
            f"({', '.join(generators[:5])}): no checkpoint holds their state (fastckpt saves "
            "torch's, Python's and NumPy's global generators and the data loader's), so a "
            "resumed run restarts them as the constructor seeded them and differs from the "
            "uninterrupted one; draw from the global generator, or keep the generator's "
            "get_state() in a buffer (get_extra_state) to have it saved",
            stacklevel=2,
        )
    return spec


def _refuse_other_tensors(
    model: torch.nn.Module,
    name: str,
    spec: BaseSpec,
    live: Mapping[str, tuple[int, ...]],
    rebuilt: Mapping[str, tuple[int, ...]],
    advice: str,
) -> None:
    """Raise ``TypeError`` when the tensors ``model`` has (``live``) differ in names or shapes
    from those its recipe builds (``rebuilt``), naming the first differences and ``advice``."""
    if live == rebuilt:
        return
    diff = sorted(k for k in live.keys() | rebuilt.keys() if live.get(k) != rebuilt.get(k))
    details = ", ".join(f"{k}: {live.get(k)} vs {rebuilt.get(k)}" for k in diff[:5])
    raise TypeError(
        f"model {name!r} ({type(model).__qualname__}) cannot be checkpointed: the recipe "
        f"recorded for it ({spec.cls_path}) rebuilds a model with other tensors (model vs "
        f"rebuilt: {details}); {advice}"
    )


#: Name segments that wrappers insert into parameter and module names (activation
#: checkpointing, ``torch.compile``, FSDP1): DCP's names and a model rebuilt from its spec
#: have none.
WRAPPER_SEGMENTS = frozenset({"_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module"})


def canonical_name(name: str) -> str:
    """A parameter's or module's dotted name without :data:`WRAPPER_SEGMENTS`."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_SEGMENTS)


#: What every ``nn.Module`` keeps in its ``__dict__`` (mode, hook tables): not recipe state.
_MODULE_INTERNALS = frozenset(vars(torch.nn.Module()))


def structural_differences(
    model: torch.nn.Module, rebuilt: torch.nn.Module
) -> tuple[list[str], list[str]]:
    """How ``rebuilt`` (``model``'s recorded recipe, built on the meta device) differs from
    ``model`` beyond its tensors' names and shapes, which :func:`check_recordable` compares
    first, as ``(differences, settings)``. Differences: a submodule the rebuilt model has and
    ``model`` lacks, or of another class; a plain attribute both modules have (numbers,
    strings, booleans, None, and lists, tuples and dicts of them) that is named after one of
    the module's constructor parameters (``eps``, a dropout rate, ``_scale`` for ``scale``)
    and differs; which parameters are one tensor (tied weights). Settings: the other plain
    attributes that differ, set after the build (a gradient-checkpointing flag, a cache).

    What wrappers and parallelisms add to ``model`` after it was built is not a difference:
    wrapper segments in names (:func:`canonical_name`), subclasses of the rebuilt module's
    class (FSDP2's), attributes and parameterless submodules only ``model`` has. Nor is a
    string the rebuilt model holds as ``"meta"`` (its device, where a module keeps its name).
    A module parametrized in both (``register_parametrization``) is compared by the class
    torch derived its own parametrized class from.
    """
    found: list[str] = []
    settings: list[str] = []
    live_modules = _canonical_modules(model)
    rebuilt_modules = _canonical_modules(rebuilt)
    for path, theirs in rebuilt_modules.items():
        where = path or "<root>"
        mine = live_modules.get(path)
        # A parametrized module is of a class torch makes for it, one per module
        # (``ParametrizedLinear``): the two builds are compared by the class it derives from.
        cls = type_before_parametrizations(theirs)
        if mine is None or not isinstance(mine, cls):
            found.append(f"{where}: {_kind(mine)} vs {type(theirs).__qualname__}")
            continue
        arguments = _constructor_parameters(type(theirs))
        mine_plain, theirs_plain = _plain_attributes(mine), _plain_attributes(theirs)
        # A module's own get_extra_state() may hold such attributes (set_extra_state puts
        # them back at a load): said so, not replayed (that would run user code at a save).
        unless = (
            " (unless its own get_extra_state() keeps it)" if _has_own_extra_state(mine) else ""
        )
        for attr in sorted(mine_plain.keys() & theirs_plain.keys()):
            a, b = mine_plain[attr], theirs_plain[attr]
            if b == "meta" or _same_plain(a, b):
                continue
            if attr.strip("_") in arguments:
                found.append(f"{where}.{attr}: {a!r} vs {b!r}")
            else:
                settings.append(f"{where}.{attr}: {a!r} vs {b!r}{unless}")

    tied_live, tied_rebuilt = _tied(model), _tied(rebuilt)
    if tied_live != tied_rebuilt:
        shown_live = sorted(sorted(group) for group in tied_live)
        shown_rebuilt = sorted(sorted(group) for group in tied_rebuilt)
        found.append(f"tied parameters: {shown_live} vs {shown_rebuilt}")
    return found, settings


def _has_own_extra_state(module: torch.nn.Module) -> bool:
    return type(module).get_extra_state is not torch.nn.Module.get_extra_state


def _constructor_parameters(cls: type) -> frozenset[str]:
    """The names of ``cls``'s constructor parameters (empty when it cannot be inspected)."""
    try:
        return frozenset(inspect.signature(cls).parameters) - {"self"}
    except (TypeError, ValueError):
        return frozenset()


def _canonical_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """``model``'s submodules by canonical name; a wrapped module replaces its wrapper (it
    comes after it)."""
    return {
        canonical_name(name): module for name, module in model.named_modules(remove_duplicate=False)
    }


def _kind(module: torch.nn.Module | None) -> str:
    return "no module" if module is None else type(module).__qualname__


def _is_plain(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` is a plain recipe value (see :func:`structural_differences`)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if depth > 8:
        return False
    if isinstance(value, (list, tuple)):
        return all(_is_plain(item, depth + 1) for item in value)
    if isinstance(value, dict):
        return all(
            isinstance(key, str) and _is_plain(item, depth + 1) for key, item in value.items()
        )
    return False


def _plain_attributes(module: torch.nn.Module) -> dict[str, Any]:
    return {
        name: value
        for name, value in vars(module).items()
        if name not in _MODULE_INTERNALS and _is_plain(value)
    }


def _same_plain(a: Any, b: Any) -> bool:
    """Equality of plain values, NaN equal to NaN and a float equal to an equal int."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return (
            type(a) is type(b)
            and len(a) == len(b)
            and all(_same_plain(x, y) for x, y in zip(a, b, strict=True))
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_plain(a[k], b[k]) for k in a)
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (a, b))
    return (type(a) is type(b) or numbers) and bool(a == b)


def _tied(model: torch.nn.Module) -> set[frozenset[str]]:
    """The groups of parameter and buffer names that are one tensor (tied weights)."""
    groups: dict[int, set[str]] = {}
    for name, tensor in [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]:
        groups.setdefault(id(tensor), set()).add(canonical_name(name))
    return {frozenset(group) for group in groups.values() if len(group) > 1}
