"""Ctrl-C during ``TrainingStrategy.run`` stops between two steps, and a state cut off inside
a step is never saved.

Before, a ``KeyboardInterrupt`` landed wherever the main thread was: after the optimizer step
and before the counters, the usual ``except KeyboardInterrupt: strategy.save_checkpoint(...)``
saved a checkpoint that verified and loaded, and whose resumed run trained the batch again
with the optimizer one step ahead (19 of 23 real interrupts at random moments diverged).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

import fastckpt
import training_support as support
from fastckpt.errors import ConcurrentSaveError, InterruptedStepError
from fastckpt.storage.lock import RootLock

STEPS = 12


@pytest.fixture(autouse=True)
def _ctrl_c_raises() -> Any:
    """SIGINT as an interactive Python has it (``KeyboardInterrupt``): a process started in
    the background by a shell (CI's, say) inherits it ignored, and Python then leaves it so."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def _fresh(hooks: list[Any], training_fn: Any = support.training_fn) -> fastckpt.TrainingStrategy:
    torch.manual_seed(0)
    return fastckpt.TrainingStrategy(
        support.DropoutMLP(),
        fastckpt.OptimizerConfig(
            torch.optim.AdamW, {"lr": 0.01}, torch.optim.lr_scheduler.StepLR, {"step_size": 3}
        ),
        training_fn=training_fn,
        hooks=hooks,
        num_steps=STEPS,
    )


def _interrupting_at(step: int, where: str, times: int = 1) -> Any:
    """A training function sending this process SIGINT ``times`` times during the forward
    pass of ``step`` (``where="forward"``), or right after its optimizer step (``"update"``,
    through torch's optimizer post-hook: between the optimizer and the counters)."""
    calls = {"n": 0}

    def send() -> None:
        for _ in range(times):
            os.kill(os.getpid(), signal.SIGINT)

    def training_fn(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        calls["n"] += 1
        if where == "forward" and calls["n"] == step:
            send()
        return support.training_fn(model, batch)

    if where == "update":

        def after_step(optimizer: Any, args: Any, kwargs: Any) -> None:
            if calls["n"] == step:
                send()

        handle = register_optimizer_step_post_hook(after_step)
        training_fn.remove = handle.remove  # type: ignore[attr-defined]
    return training_fn


def _weights(strategy: fastckpt.TrainingStrategy) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in strategy.models["main"].state_dict().items()}


@pytest.mark.parametrize("where", ["forward", "update"])
def test_ctrl_c_inside_a_step_stops_after_it_and_the_save_resumes_exactly(
    tmp_path: Path, where: str, capfd: pytest.CaptureFixture[str]
) -> None:
    straight = _fresh([])
    straight.run(support.loader())
    training_fn = _interrupting_at(5, where)
    interrupted = _fresh([], training_fn)
    try:
        with pytest.raises(KeyboardInterrupt):
            interrupted.run(support.loader())
    finally:
        getattr(training_fn, "remove", lambda: None)()
    assert "SIGINT received: training stops after the current step" in capfd.readouterr().err
    assert interrupted.step_count == 5  # the step the signal came in was finished
    assert interrupted.optimizers["main"].state_dict()["state"][0]["step"].item() == 5
    interrupted.save_checkpoint(tmp_path / "run")
    resumed = fastckpt.TrainingStrategy.load_checkpoint(
        tmp_path / "run", training_fn=support.training_fn
    )
    resumed.num_steps = STEPS
    resumed.run(support.loader())
    expected = _weights(straight)
    for name, tensor in _weights(resumed).items():
        assert torch.equal(tensor, expected[name]), name


@pytest.mark.parametrize("where", ["forward", "update"])
def test_a_second_ctrl_c_stops_at_once_and_that_state_is_not_saved(
    tmp_path: Path, where: str
) -> None:
    """Ctrl-C twice stops inside the step; the strategy is then between two steps, and a save
    (or training on) is an ``InterruptedStepError``, nothing written, until a restore puts a
    whole state back."""
    hook = fastckpt.CheckpointHook(tmp_path / "run", step_interval=2, async_save=False)
    # In the forward pass (the RNGs drawn from) or after the optimizer step (the weights
    # changed): either way the state is no step's.
    training_fn = _interrupting_at(5, where, times=2)
    interrupted = _fresh([hook], training_fn)
    try:
        with pytest.raises(KeyboardInterrupt):
            interrupted.run(support.loader())
    finally:
        getattr(training_fn, "remove", lambda: None)()
    assert interrupted.step_count == 4
    with pytest.raises(InterruptedStepError, match="step 5 was interrupted half-way"):
        interrupted.save_checkpoint(tmp_path / "run")
    # Training on from it would carry the cut-off state into every later checkpoint.
    with pytest.raises(InterruptedStepError, match="nothing was trained on"):
        interrupted.run(support.loader())
    assert [c["index"] for c in fastckpt.list_checkpoints(tmp_path / "run")] == [0, 1]
    interrupted.restore_checkpoint(tmp_path / "run")
    interrupted.save_checkpoint(tmp_path / "run")
    assert [c["index"] for c in fastckpt.list_checkpoints(tmp_path / "run")] == [0, 1, 2]


def test_an_error_inside_the_optimizer_step_leaves_a_state_no_save_takes(tmp_path: Path) -> None:
    """An error (not a signal) raised after the optimizer changed the weights and before the
    counters moved: before, that state saved and resumed a step behind its weights."""

    def fail(optimizer: Any, args: Any, kwargs: Any) -> None:
        raise RuntimeError("device lost")

    strategy = _fresh([])
    handle = register_optimizer_step_post_hook(fail)
    try:
        with pytest.raises(RuntimeError, match="device lost"):
            strategy.run(support.loader())
    finally:
        handle.remove()
    with pytest.raises(InterruptedStepError, match="step 1 was interrupted"):
        strategy.save_checkpoint(tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_an_error_before_the_optimizer_step_leaves_a_state_a_save_takes(tmp_path: Path) -> None:
    """An error in the forward pass (out of memory, a NaN guard) leaves the weights, optimizer
    and counters of the last finished step: a save takes them (the review of the first
    version found it refused, naming an update that had not begun)."""
    calls = {"n": 0}

    def failing(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("out of memory")
        return support.training_fn(model, batch)

    strategy = _fresh([], failing)
    with pytest.raises(RuntimeError, match="out of memory"):
        strategy.run(support.loader())
    assert strategy.step_count == 2
    strategy.save_checkpoint(tmp_path / "run")
    assert fastckpt.list_checkpoints(tmp_path / "run")[0]["counters"]["step_count"] == 2


def test_ctrl_c_in_an_epochs_last_hooks_stops_before_the_next_epoch(tmp_path: Path) -> None:
    """A signal during ``AFTER_EPOCH`` hooks (a validation pass) is delivered once they are
    done, not held through the next epoch's first step."""

    sent: list[int] = []

    def validate(ctx: fastckpt.TrainContext, stage: fastckpt.TrainingStage) -> None:
        if stage is fastckpt.TrainingStage.AFTER_EPOCH and not sent:
            sent.append(ctx.step_count)
            os.kill(os.getpid(), signal.SIGINT)

    strategy = _fresh([validate])
    with pytest.raises(KeyboardInterrupt):
        strategy.run(support.loader())
    assert (strategy.step_count, strategy.epoch_count, strategy.epoch_step_count) == (8, 1, 0)


def test_ctrl_c_in_a_run_inside_another_runs_hook_stops_both(tmp_path: Path) -> None:
    """A run started from a hook of another run shares its holder: a signal in the inner run
    stops it after its current step (before: the inner run trained to its end)."""
    inner_steps: list[int] = []

    def inner(ctx: fastckpt.TrainContext, stage: fastckpt.TrainingStage) -> None:
        if stage is fastckpt.TrainingStage.AFTER_BATCH and ctx.step_count == 2:
            nested = _fresh([], _interrupting_at(3, "forward"))
            try:
                nested.run(support.loader())
            finally:
                inner_steps.append(nested.step_count)

    outer = _fresh([inner])
    with pytest.raises(KeyboardInterrupt):
        outer.run(support.loader())
    assert inner_steps == [3] and outer.step_count == 2


def test_a_second_sigterm_whose_handler_exits_leaves_a_state_no_save_takes(
    tmp_path: Path,
) -> None:
    """The usual preemption handler (``sys.exit`` on SIGTERM), sent twice inside a step: the
    second one stops at once with ``SystemExit``. A review found that state unmarked (only
    ``KeyboardInterrupt`` was looked at), and saved."""
    previous = signal.signal(signal.SIGTERM, lambda *args: sys.exit(143))
    calls = {"n": 0}

    def twice(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        calls["n"] += 1
        loss = support.training_fn(model, batch)  # dropout has drawn from the RNG
        if calls["n"] == 3:
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)
        return loss

    strategy = _fresh([], twice)
    try:
        with pytest.raises(SystemExit):
            strategy.run(support.loader())
    finally:
        signal.signal(signal.SIGTERM, previous)
    with pytest.raises(InterruptedStepError, match="step 3 was interrupted"):
        strategy.save_checkpoint(tmp_path / "run")


def test_a_save_from_another_thread_while_run_trains_is_refused(tmp_path: Path) -> None:
    """A watchdog thread saving on a preemption notice while ``run()`` trained wrote the
    counters of one step with the weights of a later one (the optimizer moved them while
    they were written), and the checkpoint verified and resumed without a word. Now it is
    refused, typed, nothing written; the training thread's own saves (hooks) and a save
    from any thread once ``run()`` returned are taken as before."""
    root = tmp_path / "root"
    caught: list[BaseException] = []

    def watchdog() -> None:
        try:
            strategy.save_checkpoint(root)
        except BaseException as err:  # handed to the test thread
            caught.append(err)

    def at_step_3(ctx: fastckpt.TrainContext, stage: fastckpt.TrainingStage) -> None:
        if stage is fastckpt.TrainingStage.AFTER_BATCH and ctx.step_count == 3:
            thread = threading.Thread(target=watchdog)
            thread.start()
            thread.join()
            strategy.save_checkpoint(root)  # the training thread's own save

    strategy = _fresh([at_step_3])
    strategy.run(support.loader())
    assert len(caught) == 1 and isinstance(caught[0], ConcurrentSaveError), caught
    assert "while run() trains on thread" in str(caught[0])
    assert [c["index"] for c in fastckpt.list_checkpoints(root)] == [0]
    assert fastckpt.TrainingStrategy.load_checkpoint(root).step_count == 3
    after = threading.Thread(target=watchdog)
    after.start()
    after.join()
    assert len(caught) == 1
    assert [c["index"] for c in fastckpt.list_checkpoints(root)] == [0, 1]


_HANDLER_SAVES_INSIDE_A_SAVE = """
import os, signal, sys, torch, fastckpt
root = sys.argv[1]
torch.manual_seed(0)
strategy = fastckpt.TrainingStrategy(
    torch.nn.Linear(8, 8), fastckpt.OptimizerConfig(torch.optim.SGD, {"lr": 0.1}))
strategy.save_checkpoint(root)
def on_usr1(signum, frame):
    strategy.save_checkpoint(root)  # the preemption save, inside the save below
signal.signal(signal.SIGUSR1, on_usr1)
def signal_inside(manifest):  # runs under the root's lock, inside the save
    os.kill(os.getpid(), signal.SIGUSR1)
try:
    strategy.save_checkpoint(root, check_root=signal_inside)
except fastckpt.errors.ConcurrentSaveError as err:
    print("REFUSED", err)
"""


def test_a_signal_handler_saving_inside_a_save_into_the_same_root_is_refused_at_once(
    tmp_path: Path,
) -> None:
    """A SIGTERM/SIGUSR1 handler that saves, run while the save it interrupted holds the
    root's lock, waited for that lock forever (the warning named its own pid as the
    holder) until the scheduler's SIGKILL. Now it raises ``ConcurrentSaveError`` at once,
    the interrupted save is abandoned uncommitted, and the root keeps what it had."""
    root = tmp_path / "root"
    done = subprocess.run(
        [sys.executable, "-c", _HANDLER_SAVES_INSIDE_A_SAVE, str(root)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "REFUSED" in done.stdout and "this thread already holds the root's lock" in done.stdout
    assert [c["index"] for c in fastckpt.list_checkpoints(root)] == [0]
    assert fastckpt.verify(root).ok
    with RootLock(root), pytest.raises(ConcurrentSaveError, match="the caller holds"):
        fastckpt.save_checkpoint(root, models={"main": torch.nn.Linear(2, 2)})


def test_a_replaced_copy_whose_removal_was_interrupted_is_removed_by_the_next_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Round 22 (helper: interrupts): a Ctrl-C while a sync manager save removed the copy it
    replaced (the new checkpoint already committed) left that copy, checkpoint-sized, under
    its staging name for the rest of the process (2 of ~24 interrupted saves); only a later
    process's sweep removed it. The next save's sweep in this process removes it now, whether
    or not the interrupted save's objects were freed yet (no garbage collection here)."""
    from fastckpt.storage import backend

    config = fastckpt.CheckpointManager.Config.with_sync_save()
    with fastckpt.CheckpointManager(config) as manager:
        manager.save(tmp_path / "c0", {"model": {"w": torch.zeros(64)}})
        remove = backend._remove
        interrupted: list[Path] = []

        def ctrl_c_in_the_removal(path: Path) -> None:
            if not interrupted and path.name.startswith(".tmp-"):
                interrupted.append(path)
                raise KeyboardInterrupt
            remove(path)

        monkeypatch.setattr(backend, "_remove", ctrl_c_in_the_removal)
        with contextlib.suppress(KeyboardInterrupt):
            manager.save(tmp_path / "c0", {"model": {"w": torch.ones(64)}})
        monkeypatch.undo()
        assert interrupted and interrupted[0].exists()  # the replaced copy, left over
        assert manager.load(tmp_path / "c0")["model"]["w"].eq(1).all()  # committed anyway
        manager.save(tmp_path / "c1", {"model": {"w": torch.ones(64)}})
        assert sorted(p.name for p in tmp_path.iterdir()) == ["c0", "c1"]
