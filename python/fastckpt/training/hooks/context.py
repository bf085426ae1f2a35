"""What hooks see: the training stages, the context passed to each call, and the protocols."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["CheckpointableHook", "Hook", "MutationGuard", "TrainContext", "TrainingStage"]


class TrainingStage(enum.Enum):
    """The points of the training loop at which hooks are called, in firing order."""

    SETUP = "setup"
    BEFORE_TRAINING = "before_training"
    BEFORE_EPOCH = "before_epoch"
    BEFORE_BATCH = "before_batch"
    #: After ``backward``, before the optimizer step: the batch's gradients are whole (clip or
    #: scale them here; the loss of this batch is ``ctx.loss``).
    BEFORE_OPTIMIZER_STEP = "before_optimizer_step"
    AFTER_OPTIMIZER_STEP = "after_optimizer_step"
    AFTER_BATCH = "after_batch"
    AFTER_EPOCH = "after_epoch"
    AFTER_TRAINING = "after_training"


@dataclass
class TrainContext:
    """The strategy's state as hooks see it.

    Attributes:
        step_count: optimizer steps completed (persisted across checkpoints).
        global_step_count: optimizer steps summed over all ranks (``step_count x world``).
        batch_count: batches processed.
        epoch_step_count: batches processed in the current epoch.
        epoch: completed epochs.
        global_rank: this process's rank (0 without a process group).
        workflow: the running strategy.
        loss: the current batch's loss (a detached tensor) from BEFORE_OPTIMIZER_STEP on,
            else the last batch's, or None before the first.
        models / optimizers / schedulers: the strategy's live objects by model name.
        batch: the current batch (None outside a batch).
    """

    step_count: int = 0
    global_step_count: int = 0
    batch_count: int = 0
    epoch_step_count: int = 0
    epoch: int = 0
    global_rank: int = 0
    workflow: Any = None
    loss: torch.Tensor | None = None
    models: Mapping[str, torch.nn.Module] = field(default_factory=dict)
    optimizers: Mapping[str, torch.optim.Optimizer] = field(default_factory=dict)
    schedulers: Mapping[str, Any] = field(default_factory=dict)
    batch: Any = None


@runtime_checkable
class Hook(Protocol):
    """A training hook: called as ``hook(ctx, stage)`` at every stage.

    A hook may also be a context manager; the strategy enters it for the duration of
    ``run()`` (e.g. to start and flush a background writer).

    Hooks are called in list order, except that at the stages checkpoints are taken at
    (``AFTER_BATCH``, ``AFTER_EPOCH``, ``AFTER_TRAINING``) those whose class sets
    ``saves_checkpoints = True`` (:class:`~fastckpt.training.hooks.checkpoint.CheckpointHook`)
    are called after the others, in list order among themselves: a checkpoint taken at a
    stage then holds every other hook's work of that stage, which a resumed run does not
    replay.
    """

    def __call__(self, ctx: TrainContext, stage: TrainingStage) -> None:
        """React to ``stage``."""
        ...


@runtime_checkable
class CheckpointableHook(Protocol):
    """A hook whose runtime state is saved in strategy checkpoints and restored at load.

    Hooks are matched by class and occurrence order in the strategy's hook list.

    A checkpoint holds the state as it was when the save was taken, whatever the hook does
    afterwards: an async save copies the tensors of :meth:`state_dict` on the training thread
    when it is taken (with the model's buffers). A hook whose tensors change only at
    ``AFTER_OPTIMIZER_STEP`` may set the class attribute ``state_changes_in_optimizer_step =
    True``: its tensors are then copied in the background, overlapping the next
    forward/backward, as the model's parameters are (the optimizer step waits for that copy).
    :class:`~fastckpt.training.hooks.ema.EMAHook` does: its averaged weights are as large as
    the model.
    """

    def state_dict(self) -> dict[str, Any]:
        """Return the state (tensors and plain values) to checkpoint."""
        ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore state produced by :meth:`state_dict`."""
        ...


@runtime_checkable
class MutationGuard(Protocol):
    """A hook that must be waited on before the strategy mutates training state.

    The strategy wraps its optimizer step (and the BEFORE_OPTIMIZER_STEP and
    AFTER_OPTIMIZER_STEP hooks) in every guard's ``guard()``: an async checkpoint capture can
    then run during the next forward/backward instead of blocking the training thread.
    """

    def guard(self) -> Any:
        """A context manager held around the mutation."""
        ...
