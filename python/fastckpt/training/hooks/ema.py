"""Exponential moving average of a model's weights, kept across checkpoints."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from fastckpt.checkpoint.components import unwrap_model
from fastckpt.errors import CheckpointMismatchError
from fastckpt.training.hooks.context import TrainContext, TrainingStage

__all__ = ["EMAHook"]

#: What DDP (``module.``) and ``torch.compile`` (``_orig_mod.``) put before their module's
#: parameter names; shadows an earlier fastckpt saved from a wrapped model carry them.
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")

#: How many names of each kind a mismatch lists.
_SHOWN = 5


class EMAHook:
    """Keeps ``shadow = decay * shadow + (1 - decay) * param`` after every optimizer step.

    The averaged weights are checkpointable hook state: saved with strategy checkpoints and
    restored into the matching ``EMAHook`` passed at load. They are keyed by the parameter
    names of the model unwrapped from DDP and ``torch.compile`` (as fastckpt saves and
    rebuilds the model itself), so a run resumes with its average whichever side is wrapped;
    a shadow saved with the wrappers' ``module.`` / ``_orig_mod.`` prefixes (by an earlier
    fastckpt) is mapped to the names the model has. Only parameters are averaged: buffers
    (batch-norm statistics) are the model's own.

    A shadow that does not fit the model (other names or shapes) is a
    :class:`~fastckpt.errors.CheckpointMismatchError`: at ``load_state_dict`` when the hook has
    met its model (it has run), otherwise when the run starts (``BEFORE_TRAINING``, before the
    first optimizer step), at ``update`` or at ``copy_to``.

    Args:
        model_key: which of the strategy's models to average (``"main"`` for a single model).
        decay: the EMA decay in ``[0, 1)``.
        update_every: update after every N-th optimizer step.

    Raises:
        TypeError: ``model_key`` is not a non-empty string (``EMAHook(0.9)`` passes the decay
            as the model name: write ``EMAHook(decay=0.9)``), or a non-numeric decay or
            non-integer ``update_every``.
        ValueError: decay outside ``[0, 1)`` or ``update_every < 1``.
    """

    #: The averaged weights change only at AFTER_OPTIMIZER_STEP (inside the strategy's
    #: mutation guard): an async save copies them in the background (see
    #: :class:`~fastckpt.training.hooks.context.CheckpointableHook`).
    state_changes_in_optimizer_step = True

    def __init__(
        self, model_key: str = "main", decay: float = 0.999, update_every: int = 1
    ) -> None:
        """Configure the hook; the shadow weights are created at the first update."""
        if not isinstance(model_key, str) or not model_key:
            hint = (
                f"; did you mean EMAHook(decay={model_key!r})?"
                if isinstance(model_key, float)
                else ""
            )
            raise TypeError(
                f"EMAHook model_key must be a model name (a non-empty str such as 'main'), "
                f"got {model_key!r}{hint}"
            )
        if isinstance(decay, bool) or not isinstance(decay, (int, float)):
            raise TypeError(f"EMAHook decay must be a number in [0, 1), got {decay!r}")
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"EMAHook decay must be in [0, 1), got {decay}")
        if isinstance(update_every, bool) or not isinstance(update_every, int):
            raise TypeError(f"EMAHook update_every must be an int >= 1, got {update_every!r}")
        if update_every < 1:
            raise ValueError(f"EMAHook update_every must be >= 1, got {update_every}")
        self.model_key = model_key
        self.decay = float(decay)
        self.update_every = update_every
        self.num_updates = 0
        self.shadow: dict[str, torch.Tensor] = {}
        # The names and shapes of the parameters of the model last averaged or copied to:
        # what a loaded shadow is checked against (None: no model met yet).
        self._shapes: dict[str, torch.Size] | None = None
        # the shadow dict last fitted to ``_shapes`` (see _parameters)
        self._fitted_shadow: dict[str, torch.Tensor] | None = None

    def _model(self, ctx: TrainContext) -> torch.nn.Module:
        if self.model_key not in ctx.models:
            raise KeyError(
                f"EMAHook(model_key={self.model_key!r}): no such model; the strategy has "
                f"{sorted(ctx.models)}"
            )
        return ctx.models[self.model_key]

    def __call__(self, ctx: TrainContext, stage: TrainingStage) -> None:
        """Initialize at BEFORE_TRAINING, update at AFTER_OPTIMIZER_STEP."""
        if stage is TrainingStage.BEFORE_TRAINING:
            if self.shadow:
                self._parameters(self._model(ctx))  # a loaded shadow must fit: checked now
            else:
                self._reset(self._model(ctx))
        elif (
            stage is TrainingStage.AFTER_OPTIMIZER_STEP and ctx.step_count % self.update_every == 0
        ):
            self.update(self._model(ctx))

    def _reset(self, model: torch.nn.Module) -> None:
        self.shadow = {
            name: param.detach().clone() for name, param in self._parameters(model).items()
        }

    def _parameters(self, model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
        """``model``'s parameters by their unwrapped names (remembered, with their shapes, to
        check a shadow loaded later); the shadow, if any, mapped to those names.

        Raises:
            CheckpointMismatchError: the shadow does not fit ``model``.
        """
        params = dict(unwrap_model(model, sharded_ok=True).named_parameters())
        shapes = {name: param.shape for name, param in params.items()}
        # A shadow already fitted to these names and shapes is not fitted again at every
        # update (only a new shadow object, or another model, is).
        if self.shadow and not (self.shadow is self._fitted_shadow and shapes == self._shapes):
            self.shadow = self._fitted(self.shadow, shapes)
            self._fitted_shadow = self.shadow
        self._shapes = shapes  # only once it fits: a refused model is not remembered
        return params

    def _fitted(
        self, shadow: Mapping[str, torch.Tensor], shapes: Mapping[str, torch.Size]
    ) -> dict[str, torch.Tensor]:
        """``shadow`` keyed by the model's parameter names (``shapes``), in their order. A
        shadow whose every key carries the same wrapper prefixes, and which is exactly the
        model's names and shapes without them, is taken without them (an earlier fastckpt's
        shadow of a wrapped model that has a submodule named ``module``); otherwise a key the
        model lacks is taken without its wrapper prefixes when that name is the model's.

        Raises:
            CheckpointMismatchError: names missing or left over, or shapes that differ.
        """
        stripped = _without_common_prefixes(shadow, shapes)
        if stripped is not None:
            return {name: stripped[name] for name in shapes}
        fitted = {name: tensor for name, tensor in shadow.items() if name in shapes}
        unexpected: list[str] = []
        for key, tensor in shadow.items():
            if key in shapes:
                continue
            name = _unwrapped_name(key, shapes)
            if name is None or name in fitted:
                unexpected.append(key)
            else:
                fitted[name] = tensor
        missing = [name for name in shapes if name not in fitted]
        misshapen = [
            f"{name} {list(fitted[name].shape)} (model {list(shape)})"
            for name, shape in shapes.items()
            if name in fitted and fitted[name].shape != shape
        ]
        found = [
            f"{kind} {_few(names)}"
            for kind, names in (
                ("missing", missing),
                ("unexpected", unexpected),
                ("other shapes", misshapen),
            )
            if names
        ]
        if found:
            raise CheckpointMismatchError(
                f"EMAHook(model_key={self.model_key!r}): the averaged weights do not fit the "
                f"model's parameters: {', '.join(found)}; fix: restore a checkpoint whose EMA "
                "was taken over this model, or start the average afresh from the model's "
                "weights (a new EMAHook, its state not restored, or hook.shadow.clear())"
            )
        return {name: fitted[name] for name in shapes}

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        """Fold the model's current parameters into the average.

        Raises:
            CheckpointMismatchError: the shadow (a loaded one) does not fit ``model``.
        """
        if not self.shadow:
            self._reset(model)
        for name, param in self._parameters(model).items():
            self.shadow[name].mul_(self.decay).add_(param.detach(), alpha=1.0 - self.decay)
        self.num_updates += 1

    @torch.no_grad()
    def copy_to(self, model: torch.nn.Module) -> None:
        """Load the averaged weights into ``model`` (e.g. for evaluation; wrapped or not).

        Raises:
            CheckpointMismatchError: the shadow does not fit ``model`` (nothing copied).
        """
        for name, param in self._parameters(model).items():
            param.copy_(self.shadow[name])

    def hook_config(self) -> dict[str, Any]:
        """How this hook was configured (what a strategy checkpoint records to rebuild it,
        see :mod:`fastckpt.training.hooks.rebuild`)."""
        return {"model_key": self.model_key, "decay": self.decay, "update_every": self.update_every}

    def state_dict(self) -> dict[str, Any]:
        """The averaged weights and the configuration they were made with."""
        return {
            "model_key": self.model_key,
            "decay": self.decay,
            "update_every": self.update_every,
            "num_updates": self.num_updates,
            "shadow": dict(self.shadow),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore averaged weights saved by a hook with the same configuration.

        A hook that has met its model (it has run) checks the shadow against it here;
        otherwise the check comes when it meets the model (see the class docstring).

        Raises:
            CheckpointMismatchError: the saved configuration differs from this hook's, or the
                shadow does not fit the model (named keys); nothing changed.
        """
        for key in ("model_key", "decay", "update_every"):
            if state.get(key) != getattr(self, key):
                raise CheckpointMismatchError(
                    f"EMAHook config conflict: checkpoint has {key}={state.get(key)!r}, this "
                    f"hook has {key}={getattr(self, key)!r}; pass an EMAHook configured like "
                    "the one that wrote the checkpoint"
                )
        shadow = dict(state["shadow"])
        if shadow and self._shapes is not None:
            shadow = self._fitted(shadow, self._shapes)
        self.num_updates = int(state["num_updates"])
        self.shadow = {name: t.clone() for name, t in shadow.items()}


def _without_common_prefixes(
    shadow: Mapping[str, torch.Tensor], shapes: Mapping[str, torch.Size]
) -> dict[str, torch.Tensor] | None:
    """``shadow`` less the wrapper prefixes all its keys share (as many levels as it takes)
    when that is exactly the names of ``shapes``, each tensor of its shape; None otherwise."""
    current = dict(shadow)
    while current:
        prefix = next(
            (p for p in _WRAPPER_PREFIXES if all(key.startswith(p) for key in current)), None
        )
        if prefix is None:
            return None
        current = {key[len(prefix) :]: tensor for key, tensor in current.items()}
        if current.keys() == shapes.keys() and all(
            tensor.shape == shapes[name] for name, tensor in current.items()
        ):
            return current
    return None


def _unwrapped_name(key: str, names: Mapping[str, object]) -> str | None:
    """``key`` less leading wrapper prefixes (as many as it takes) when that is one of
    ``names``; None if no such name."""
    while True:
        prefix = next((p for p in _WRAPPER_PREFIXES if key.startswith(p)), None)
        if prefix is None:
            return None
        key = key[len(prefix) :]
        if key in names:
            return key


def _few(names: list[str]) -> str:
    """The first :data:`_SHOWN` of ``names``, and how many there are beyond them."""
    more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return f"{names[:_SHOWN]}{more}"
