"""Exponential moving average of a model's weights, kept across checkpoints."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from fastckpt.errors import CheckpointMismatchError
from fastckpt.training.hooks.context import TrainContext, TrainingStage

__all__ = ["EMAHook"]


class EMAHook:
    """Keeps ``shadow = decay * shadow + (1 - decay) * param`` after every optimizer step.

    The averaged weights are checkpointable hook state: saved with strategy checkpoints and
    restored into the matching ``EMAHook`` passed at load.

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

    def _model(self, ctx: TrainContext) -> torch.nn.Module:
        if self.model_key not in ctx.models:
            raise KeyError(
                f"EMAHook(model_key={self.model_key!r}): no such model; the strategy has "
                f"{sorted(ctx.models)}"
            )
        return ctx.models[self.model_key]

    def __call__(self, ctx: TrainContext, stage: TrainingStage) -> None:
        """Initialize at BEFORE_TRAINING, update at AFTER_OPTIMIZER_STEP."""
        if stage is TrainingStage.BEFORE_TRAINING and not self.shadow:
            self._reset(self._model(ctx))
        elif (
            stage is TrainingStage.AFTER_OPTIMIZER_STEP and ctx.step_count % self.update_every == 0
        ):
            self.update(self._model(ctx))

    def _reset(self, model: torch.nn.Module) -> None:
        self.shadow = {name: param.detach().clone() for name, param in model.named_parameters()}

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        """Fold the model's current parameters into the average."""
        if not self.shadow:
            self._reset(model)
        for name, param in model.named_parameters():
            self.shadow[name].mul_(self.decay).add_(param.detach(), alpha=1.0 - self.decay)
        self.num_updates += 1

    @torch.no_grad()
    def copy_to(self, model: torch.nn.Module) -> None:
        """Load the averaged weights into ``model`` (e.g. for evaluation)."""
        for name, param in model.named_parameters():
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

        Raises:
            ValueError: the saved configuration differs from this hook's.
        """
        for key in ("model_key", "decay", "update_every"):
            if state.get(key) != getattr(self, key):
                raise CheckpointMismatchError(
                    f"EMAHook config conflict: checkpoint has {key}={state.get(key)!r}, this "
                    f"hook has {key}={getattr(self, key)!r}; pass an EMAHook configured like "
                    "the one that wrote the checkpoint"
                )
        self.num_updates = int(state["num_updates"])
        self.shadow = {name: t.clone() for name, t in dict(state["shadow"]).items()}
