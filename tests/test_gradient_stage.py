"""TrainingStage.BEFORE_OPTIMIZER_STEP: a hook sees the batch's whole gradients before the
optimizer step uses them (gradient clipping).

Before, the loop fired nothing between ``backward`` and ``step``: clipping written inside
``training_fn`` ran before ``backward``, on no gradients, and had no effect without a word,
and no hook could reach the gradients at all.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

import fastckpt

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))
import training_support as support  # noqa: E402

MAX_NORM = 0.05


def clip(ctx: fastckpt.TrainContext, stage: fastckpt.TrainingStage) -> None:
    """Clips the main model's gradients to MAX_NORM before each optimizer step."""
    if stage is fastckpt.TrainingStage.BEFORE_OPTIMIZER_STEP:
        torch.nn.utils.clip_grad_norm_(ctx.models["main"].parameters(), max_norm=MAX_NORM)


def manual_run(num_steps: int, clip_norm: float | None) -> dict[str, torch.Tensor]:
    """The reference job's loop written by hand (same seeds, same data order)."""
    torch.manual_seed(1234)
    model = support.DropoutMLP()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5)
    steps = 0
    while steps < num_steps:
        for batch in support.loader():
            optimizer.zero_grad(set_to_none=True)
            support.training_fn(model, batch).backward()
            if clip_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=clip_norm)
            optimizer.step()
            scheduler.step()
            steps += 1
            if steps == num_steps:
                break
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_stages_fire_in_order_with_the_gradients_whole_before_the_step() -> None:
    seen: list[tuple[str, Any]] = []

    def record(ctx: fastckpt.TrainContext, stage: fastckpt.TrainingStage) -> None:
        if stage is fastckpt.TrainingStage.BEFORE_OPTIMIZER_STEP:
            grads = [p.grad for p in ctx.models["main"].parameters()]
            assert all(g is not None and g.abs().sum() > 0 for g in grads)
            seen.append((stage.name, ctx.loss))
        else:
            seen.append((stage.name, None))

    strategy = support.new_strategy([record], num_steps=1)
    strategy.run(support.loader())
    assert [name for name, _ in seen] == [
        "SETUP",
        "BEFORE_TRAINING",
        "BEFORE_EPOCH",
        "BEFORE_BATCH",
        "BEFORE_OPTIMIZER_STEP",
        "AFTER_OPTIMIZER_STEP",
        "AFTER_BATCH",
        "AFTER_TRAINING",
    ]
    loss_then = dict(seen)["BEFORE_OPTIMIZER_STEP"]
    assert loss_then is not None  # this batch's loss, not the previous batch's (None here)
    assert strategy._ctx.loss is not None and torch.equal(loss_then, strategy._ctx.loss)


def test_a_clipping_hook_trains_exactly_like_a_hand_written_loop_that_clips() -> None:
    strategy = support.new_strategy([clip], num_steps=6)
    strategy.run(support.loader())
    got = strategy.models["main"].state_dict()
    clipped = manual_run(6, MAX_NORM)
    unclipped = manual_run(6, None)
    assert all(torch.equal(got[k], clipped[k]) for k in clipped)
    assert not all(torch.equal(got[k], unclipped[k]) for k in unclipped)  # clipping acted


def test_a_run_resumed_with_its_clipping_hook_matches_the_uninterrupted_run(tmp_path: Path) -> None:
    whole = support.new_strategy([clip], num_steps=8)
    whole.run(support.loader())

    first = support.new_strategy([clip, fastckpt.CheckpointHook(tmp_path, step_interval=4)], 4)
    first.run(support.loader())
    resumed = fastckpt.TrainingStrategy.load_checkpoint(tmp_path, hooks=[clip])
    resumed.num_steps = 8
    resumed.run(support.loader())
    want = whole.models["main"].state_dict()
    got = resumed.models["main"].state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)


class _GuardSpy:
    """A :class:`fastckpt.MutationGuard` hook recording whether its guard is held when the
    BEFORE_OPTIMIZER_STEP hooks run (an async save's capture waits on the guard: a hook that
    changes weights there must run inside it)."""

    def __init__(self) -> None:
        self.held = False
        self.held_at_stage: list[bool] = []

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        self.held = True
        try:
            yield
        finally:
            self.held = False

    def __call__(self, ctx: fastckpt.TrainContext, stage: fastckpt.TrainingStage) -> None:
        if stage is fastckpt.TrainingStage.BEFORE_OPTIMIZER_STEP:
            self.held_at_stage.append(self.held)


def test_before_optimizer_step_hooks_run_under_the_mutation_guards() -> None:
    """Review 1: moving the stage outside the guards passed every other test here."""
    spy = _GuardSpy()
    strategy = support.new_strategy([spy], num_steps=3)
    strategy.run(support.loader())
    assert spy.held_at_stage == [True, True, True]
