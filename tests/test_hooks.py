"""CheckpointHook and EMAHook: cadence, background writes, failures and timeouts."""

from __future__ import annotations

import errno
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import fastckpt
import training_support as support
from fastckpt.training import (
    CheckpointHook,
    EMAHook,
    OptimizerConfig,
    TrainingStrategy,
)
from fastckpt.training.hooks import CheckpointHook as SeedPathHook
from fastckpt.training.hooks import TrainingStage


def test_a_timed_out_hook_write_stays_tracked_and_its_failure_is_raised_once(
    tmp_path: Path,
) -> None:
    """While the strategy holds the hook's guard (its optimizer step), a background capture
    cannot run: a save waiting longer than ``wait_timeout_secs`` says which write is still in
    flight, and that write's failure is still reported, once, when the hook closes."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    root = blocker / "ckpt"
    hook = CheckpointHook(root, step_interval=1, wait_timeout_secs=0.2)
    strategy = support.new_strategy([hook], num_steps=1)
    with hook:
        with support.held_by_another_thread(hook.guard):
            hook.save(strategy.context)
            with pytest.raises(TimeoutError, match=r"ckpt.*still running") as timeout:
                hook.save(strategy.context)
            assert timeout.value.errno == errno.ETIMEDOUT
        with pytest.raises(NotADirectoryError) as info:  # its own type, as a sync save's
            hook.close()
        assert "background checkpoint write" in "\n".join(info.value.__notes__)
        assert hook.last_checkpoint_index is None
    hook.close()  # reported once


def test_a_hook_write_that_outlasts_one_wait_is_collected_by_the_next_save(
    tmp_path: Path,
) -> None:
    hook = CheckpointHook(tmp_path, step_interval=1, wait_timeout_secs=0.2)
    strategy = support.new_strategy([hook], num_steps=1)
    with hook:
        with support.held_by_another_thread(hook.guard):
            hook.save(strategy.context)
            with pytest.raises(TimeoutError):
                hook.save(strategy.context)
        hook.save(strategy.context)  # the first write finished: this one starts
        assert hook.last_checkpoint_index == 0
    assert hook.last_checkpoint_index == 1
    assert [row["index"] for row in fastckpt.list_checkpoints(tmp_path)] == [0, 1]
    loaded = fastckpt.load_checkpoint(tmp_path, 1, training_fn=support.training_fn)
    for name, tensor in strategy.models["main"].state_dict().items():
        assert torch.equal(loaded["models"]["main"]["model"].state_dict()[name], tensor)


def test_a_lenient_hook_skips_a_save_while_the_previous_write_outlasts_its_wait(
    tmp_path: Path,
) -> None:
    """``strict_saves=False`` (the default with a ``durable_dir``): a save finding the
    previous write still running after ``wait_timeout_secs`` is reported and skipped, and
    training goes on. Before, the same save then raised an untyped RuntimeError ("still
    tracked") and stopped the run the hook had just said would go on."""
    hook = CheckpointHook(tmp_path, step_interval=1, wait_timeout_secs=0.2, strict_saves=False)
    strategy = support.new_strategy([hook], num_steps=1)
    with hook:
        with support.held_by_another_thread(hook.guard):
            hook.save(strategy.context)
            with pytest.warns(RuntimeWarning, match="still running.*training goes on"):
                hook.save(strategy.context)  # reported and skipped, not raised
            assert isinstance(hook.save_error, TimeoutError)
        hook.save(strategy.context)  # the first write finished: this one starts
    assert [row["index"] for row in fastckpt.list_checkpoints(tmp_path)] == [0, 1]


def test_a_lenient_hook_never_skips_the_last_save_of_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cadence save skipped because the previous write outlasts ``wait_timeout_secs`` is
    taken at the end of the run (``save_last``), which waits for the write in flight however
    long it takes: the run's last state is saved. Before the wait, the end-of-run save was
    skipped too and the run ended healthy with its last steps in no checkpoint."""
    write = CheckpointHook._write

    def slow_write(self: CheckpointHook, snapshot: Any, index: int = -1) -> int:
        time.sleep(0.6)
        return write(self, snapshot, index)

    monkeypatch.setattr(CheckpointHook, "_write", slow_write)
    hook = CheckpointHook(tmp_path, step_interval=1, wait_timeout_secs=0.1, strict_saves=False)
    strategy = support.new_strategy([hook], num_steps=2)
    with pytest.warns(RuntimeWarning, match="still running"):
        strategy.run(support.loader())
    steps = [row["counters"]["step_count"] for row in fastckpt.list_checkpoints(tmp_path)]
    assert steps == [1, 2]


def test_two_hooks_saving_into_one_root_are_refused(tmp_path: Path) -> None:
    """Each hook orders only its own writes: two async hooks on one root (every step and
    every epoch) committed out of order, and the root's newest index held the older step
    (a resume went back three steps without a word)."""
    hooks = [
        CheckpointHook(tmp_path / "run", step_interval=1),
        EMAHook(decay=0.5),
        CheckpointHook(str(tmp_path / "run") + "/", epoch_interval=1),
    ]
    strategy = support.new_strategy(hooks, num_steps=2)
    with pytest.raises(ValueError, match=r"hooks\[0\] and hooks\[2\].*both save into"):
        strategy.run(support.loader())
    assert not (tmp_path / "run").exists()


def test_a_pending_write_that_fails_while_training_raises_is_named_on_the_error(
    tmp_path: Path,
) -> None:
    """An exception leaving the run while the hook's last write fails too: the training
    error propagates, with a note naming the failed write (and a log line). Before, the
    write's failure vanished without a trace."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    hook = CheckpointHook(blocker / "ckpt", step_interval=1)
    strategy = support.new_strategy([hook], num_steps=1)
    with pytest.raises(KeyError, match="training") as caught, hook:
        hook.save(strategy.context)  # fails on the writer thread
        raise KeyError("training")
    assert any("was not saved" in note for note in caught.value.__notes__)


def test_wait_timeout_is_validated() -> None:
    with pytest.raises(ValueError, match="wait_timeout_secs"):
        CheckpointHook("x", step_interval=1, wait_timeout_secs=0)


# --------------------------------------------------------------------------- CheckpointHook


@pytest.mark.parametrize("async_save", [True, False])
def test_step_cadence_writes_the_right_indices(tmp_path: Path, async_save: bool) -> None:
    hook = CheckpointHook(tmp_path, step_interval=2, async_save=async_save, save_last=False)
    support.new_strategy([hook], num_steps=7).run(support.loader())
    listing = fastckpt.list_checkpoints(tmp_path)
    assert [c["counters"]["step_count"] for c in listing] == [2, 4, 6]
    assert [c["index"] for c in listing] == [0, 1, 2]
    assert hook.last_checkpoint_index == 2


def test_epoch_cadence_and_keep_last(tmp_path: Path) -> None:
    hook = CheckpointHook(checkpoint_dir=tmp_path, epoch_interval=1, keep_last=2)
    strategy = support.new_strategy([hook], num_steps=1000)
    strategy.num_steps, strategy.num_epochs = None, 3
    strategy.run(support.loader())
    listing = fastckpt.list_checkpoints(tmp_path)
    assert [c["counters"]["epoch_count"] for c in listing] == [2, 3]
    assert [c["counters"]["step_count"] for c in listing] == [16, 24]


def test_cadence_validation() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        CheckpointHook("x")
    with pytest.raises(ValueError, match="exactly one"):
        CheckpointHook("x", step_interval=1, epoch_interval=1)
    with pytest.raises(ValueError, match="positive"):
        CheckpointHook("x", step_interval=0)
    with pytest.raises(TypeError, match="multiple values"):
        CheckpointHook("x", checkpoint_dir="y", step_interval=1)  # type: ignore[misc]
    assert SeedPathHook is CheckpointHook


def tensors_of(root: Path, index: int) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted((root / str(index)).rglob("*.safetensors")):
        if path.name == "strategy.safetensors":
            continue  # RNG states are identical too, but compared via the loss check elsewhere
        for name, tensor in fastckpt.load_file(path).items():
            out[f"{path.relative_to(root / str(index))}:{name}"] = tensor
    return out


def test_async_and_sync_write_identical_tensors(tmp_path: Path) -> None:
    for mode in ("async", "sync"):
        hook = CheckpointHook(tmp_path / mode, step_interval=3, async_save=mode == "async")
        support.new_strategy([hook, EMAHook(decay=0.5)], num_steps=9).run(support.loader())
    for index in range(3):
        a, b = tensors_of(tmp_path / "async", index), tensors_of(tmp_path / "sync", index)
        assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a), index


class SlowWriteModel(nn.Module):
    """Big enough that writing takes much longer than staging."""

    def __init__(self, width: int = 2048) -> None:
        super().__init__()
        self.width = width
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(6))  # ~100 MiB

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def slow_training_fn(model: nn.Module, batch: Any) -> torch.Tensor:
    return model(batch).square().mean()


def test_training_keeps_running_while_writing(tmp_path: Path) -> None:
    """The hook call returns while the background write is still held (no wall-clock figure:
    the write waits on an event the test sets only after training went on past the save)."""
    hook = CheckpointHook(tmp_path, step_interval=2)
    release = threading.Event()
    held: list[bool] = []
    write = hook._write

    def gated_write(*args: Any, **kwargs: Any) -> int:
        held.append(release.wait(timeout=60))
        return write(*args, **kwargs)

    hook._write = gated_write  # type: ignore[method-assign]
    went_on: list[tuple[int, bool, bool]] = []

    def after_the_save(ctx: Any, stage: TrainingStage) -> None:
        if stage is TrainingStage.AFTER_BATCH and ctx.step_count == 3:
            # a training step after the save's, taken while its write waits
            went_on.append((ctx.step_count, hook.writing, (tmp_path / "manifest.json").exists()))
            release.set()

    model = SlowWriteModel()
    strategy = TrainingStrategy(
        model,
        OptimizerConfig(torch.optim.SGD, {"lr": 1e-6}),
        training_fn=slow_training_fn,
        hooks=[hook, after_the_save],
        num_steps=3,
    )
    strategy.run([torch.randn(2, 2048) for _ in range(4)])
    assert went_on == [(3, True, False)]  # step 3 ran while step 2's write had not committed
    assert held == [True, True]  # ... and that write went through (then the final save's)
    loaded = TrainingStrategy.load_checkpoint(tmp_path, 0, training_fn=slow_training_fn)
    assert loaded.step_count == 2


def test_failed_background_write_surfaces_once(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    hook = CheckpointHook(blocker / "ckpt", step_interval=1)
    strategy = support.new_strategy([hook], num_steps=3)
    with pytest.raises(NotADirectoryError) as info:  # its own type, as a sync save's
        strategy.run(support.loader())
    assert "background checkpoint write" in "\n".join(info.value.__notes__)
    hook.close()  # raised once: closing again is quiet


def saved_steps(root: Path) -> list[int]:
    """The step count recorded by each committed index of a root, oldest first."""
    return [entry["counters"]["step_count"] for entry in fastckpt.list_checkpoints(root)]


@pytest.mark.parametrize("async_save", [True, False])
def test_the_final_step_is_saved_when_the_cadence_misses_it(
    tmp_path: Path, async_save: bool
) -> None:
    """num_steps=10, step_interval=3: steps 3, 6, 9 on the cadence, then 10 at the end."""
    hook = CheckpointHook(tmp_path, step_interval=3, async_save=async_save)
    strategy = support.new_strategy([hook], num_steps=10)
    strategy.run(support.loader())
    assert saved_steps(tmp_path) == [3, 6, 9, 10]
    assert hook.last_checkpoint_index == fastckpt.list_checkpoints(tmp_path)[-1]["index"]
    restored = support.new_strategy([], num_steps=10)
    restored.restore_checkpoint(tmp_path)
    for name, value in strategy.models["main"].state_dict().items():
        assert torch.equal(restored.models["main"].state_dict()[name], value), name


def test_the_final_save_is_not_repeated_when_the_cadence_saved_it(tmp_path: Path) -> None:
    hook = CheckpointHook(tmp_path, step_interval=3)
    support.new_strategy([hook], num_steps=9).run(support.loader())
    assert saved_steps(tmp_path) == [3, 6, 9]


def test_save_last_false_saves_only_on_the_cadence(tmp_path: Path) -> None:
    hook = CheckpointHook(tmp_path, step_interval=3, save_last=False)
    support.new_strategy([hook], num_steps=10).run(support.loader())
    assert saved_steps(tmp_path) == [3, 6, 9]


def test_the_final_save_respects_keep_last(tmp_path: Path) -> None:
    hook = CheckpointHook(tmp_path, step_interval=3, keep_last=2)
    support.new_strategy([hook], num_steps=10).run(support.loader())
    assert saved_steps(tmp_path) == [9, 10]


def test_the_final_save_after_epochs_and_a_resume_with_nothing_left(tmp_path: Path) -> None:
    """Epoch cadence (8 batches an epoch): 20 steps end mid-epoch 3, saved at the end. Rerunning
    the restored strategy to the same total trains nothing and saves nothing new."""
    hook = CheckpointHook(tmp_path, epoch_interval=1)
    support.new_strategy([hook], num_steps=20).run(support.loader())
    assert saved_steps(tmp_path) == [8, 16, 20]
    resumed = support.new_strategy([CheckpointHook(tmp_path, epoch_interval=1)], num_steps=20)
    resumed.restore_checkpoint(tmp_path)
    resumed.run(support.loader())
    assert saved_steps(tmp_path) == [8, 16, 20]


def test_save_last_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="save_last"):
        CheckpointHook("x", step_interval=1, save_last="yes")  # type: ignore[arg-type]


def test_ema_hook_arguments_are_checked_when_it_is_made() -> None:
    """EMAHook(0.9) passes the decay as the model name: refused at once, with the fix."""
    with pytest.raises(TypeError, match=r"model_key.*0\.9.*EMAHook\(decay=0\.9\)"):
        EMAHook(0.9)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="model_key"):
        EMAHook("")
    with pytest.raises(TypeError, match="decay"):
        EMAHook(decay="0.9")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="decay"):
        EMAHook(decay=1.0)
    with pytest.raises(TypeError, match="update_every"):
        EMAHook(update_every=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="update_every"):
        EMAHook(update_every=0)
    assert EMAHook("main", 0.9).decay == 0.9


# --------------------------------------------------------------------------- staging prewarm


class _AllocationProbe:
    """Records the checkpoint hook's staging allocations at each stage (runs after it: listed
    after it among the hooks that save, which run after the others)."""

    saves_checkpoints = True

    def __init__(self, hook: CheckpointHook) -> None:
        self.hook = hook
        self.seen: list[tuple[str, int, int]] = []

    def __call__(self, ctx: fastckpt.TrainContext, stage: TrainingStage) -> None:
        if stage not in (TrainingStage.BEFORE_TRAINING, TrainingStage.AFTER_BATCH):
            return  # (AFTER_OPTIMIZER_STEP fires under the guard already)
        with self.hook.guard():  # a capture in progress finishes first
            self.seen.append((stage.value, ctx.step_count, self.hook.staging_allocations))


def test_async_hook_allocates_its_staging_buffers_before_the_first_save(tmp_path: Path) -> None:
    """The buffers of the model exist before training starts, those of Adam's moments (made
    by the first optimizer step) right after it, and no save allocates any."""
    hook = CheckpointHook(tmp_path, step_interval=3, async_save=True)
    probe = _AllocationProbe(hook)
    strategy = support.new_strategy([hook, probe], num_steps=7)
    strategy.run(support.loader())
    before = [n for stage, _, n in probe.seen if stage == TrainingStage.BEFORE_TRAINING.value]
    after_batch = {step: n for stage, step, n in probe.seen if stage == "after_batch"}
    model_tensors = len(strategy.models["main"].state_dict())
    assert len(before) == 1 and before[0] >= model_tensors  # model (+ RNG) state, no Adam yet
    assert after_batch[1] > before[0]  # the moments (and step counters) of the first step
    # Saves at steps 3 and 6 (their captures finished before the probe read the count), 7.
    assert after_batch[3] == after_batch[6] == after_batch[7] == after_batch[1]
    assert hook.staging_allocations == after_batch[1]  # nor did the final save (step 7)
    assert [row["index"] for row in fastckpt.list_checkpoints(tmp_path)] == [0, 1, 2]
    loaded = fastckpt.load_checkpoint(tmp_path, training_fn=support.training_fn)
    for name, tensor in strategy.models["main"].state_dict().items():
        assert torch.equal(loaded["models"]["main"]["model"].state_dict()[name], tensor)


def test_prewarm_staging_of_a_sync_hook_allocates_nothing(tmp_path: Path) -> None:
    hook = CheckpointHook(tmp_path, step_interval=1, async_save=False)
    strategy = support.new_strategy([hook], num_steps=1)
    assert hook.prewarm_staging(strategy) == 0
    assert hook.staging_allocations == 0


class _BatchesSeen:
    """Checkpointable: a tensor counting batch starts and ends, changed in place outside the
    optimizer step (when a batch begins, and after the CheckpointHook when it ends)."""

    def __init__(self) -> None:
        self.seen = torch.zeros((), dtype=torch.int64)

    def __call__(self, ctx: fastckpt.TrainContext, stage: TrainingStage) -> None:
        if stage in (TrainingStage.BEFORE_BATCH, TrainingStage.AFTER_BATCH):
            self.seen += 1

    def state_dict(self) -> dict[str, Any]:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seen = state["seen"].clone()


def _slow_background_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make an async save's background copy lag behind the training thread."""
    stage = CheckpointHook._stage

    def slow_stage(self: CheckpointHook, snapshot: Any, *, only_volatile: bool) -> None:
        if not only_volatile:
            time.sleep(0.05)
        stage(self, snapshot, only_volatile=only_volatile)

    monkeypatch.setattr(CheckpointHook, "_stage", slow_stage)


def _after_each_batch(
    pick: Callable[[Any], torch.Tensor],
) -> tuple[dict[int, torch.Tensor], Callable[[Any, TrainingStage], None]]:
    """A hook recording ``pick(model)`` after every batch, and what it recorded, by step."""
    seen: dict[int, torch.Tensor] = {}

    def record(ctx: Any, when: TrainingStage) -> None:
        if when is TrainingStage.AFTER_BATCH:
            seen[ctx.step_count] = pick(ctx.models["main"]).detach().clone()

    return seen, record


class _MomentumEncoder(nn.Module):
    """A trained layer and a frozen copy updated in forward (a MoCo/BYOL momentum encoder):
    frozen parameters changing outside the optimizer step."""

    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.width = width
        self.online = nn.Linear(width, 1)
        self.target = nn.Linear(width, 1)
        self.target.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            for online, target in zip(
                self.online.parameters(), self.target.parameters(), strict=True
            ):
                target.mul_(0.5).add_(online, alpha=0.5)
        return self.online(x) - self.target(x)


def test_an_async_save_holds_frozen_parameters_of_when_it_was_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Frozen parameters are copied when an async save is taken, like buffers: a momentum
    encoder updated in the next forward does not reach the checkpoint, however slow the
    background copy. Before, every parameter was copied in the background (only the
    optimizer step waits for it), and the checkpoints held the next step's frozen weights."""
    _slow_background_copy(monkeypatch)
    seen, record = _after_each_batch(lambda model: model.target.weight)

    root = tmp_path / "run"
    torch.manual_seed(0)
    strategy = TrainingStrategy(
        _MomentumEncoder(),
        OptimizerConfig(torch.optim.SGD, {"lr": 0.1}),
        training_fn=support.training_fn,
        hooks=[record, CheckpointHook(root, step_interval=1, incremental=False)],
        num_steps=6,
    )
    strategy.run(support.loader())
    rows = fastckpt.list_checkpoints(root)
    assert len(rows) == 6
    for row in rows:
        loaded = fastckpt.load_checkpoint(root, row["index"])["models"]["main"]["model"]
        step = row["counters"]["step_count"]
        assert torch.equal(loaded.target.weight, seen[step]), step


class _DecayedInForward(nn.Module):
    """A trainable weight decayed in place in forward, outside the optimizer step (as
    ``nn.Embedding(max_norm=...)`` renormalizes its weight)."""

    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.width = width
        self.layer = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.layer.weight.mul_(0.9)
        return self.layer(x)


def test_an_async_save_whose_trainable_state_changes_in_forward_is_not_committed_stale(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Trainable parameters are copied in the background before the next optimizer step;
    one changed in place by the next forward meanwhile is caught by its version counter: that
    save is not committed (a ``StateChangedError`` reported as a warning, training goes on)
    and later saves copy the parameter when they are taken. Every committed checkpoint holds
    the weights of its step. Before, the checkpoints held the next forward's weights, loaded
    and verified, and a resume from them diverged."""
    _slow_background_copy(monkeypatch)
    seen, record = _after_each_batch(lambda model: model.layer.weight)

    root = tmp_path / "run"
    torch.manual_seed(0)
    hook = CheckpointHook(root, step_interval=1, incremental=False)
    strategy = TrainingStrategy(
        _DecayedInForward(),
        OptimizerConfig(torch.optim.SGD, {"lr": 0.1}),
        training_fn=support.training_fn,
        hooks=[record, hook],
        num_steps=6,
    )
    with pytest.warns(RuntimeWarning, match="StateChangedError.*layer.weight"):
        strategy.run(support.loader())
    rows = fastckpt.list_checkpoints(root)
    assert len(rows) == 5  # the first save was caught; the others copied it when taken
    for row in rows:
        loaded = fastckpt.load_checkpoint(root, row["index"])["models"]["main"]["model"]
        step = row["counters"]["step_count"]
        assert torch.equal(loaded.layer.weight, seen[step]), step
    assert hook.save_error is None


def test_an_async_save_holds_the_hook_state_of_when_it_was_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hook's tensors are copied when an async save is taken: a hook changing them after
    (at the next batch's start) does not reach the checkpoint,
    however slow the background copy. Before, they were copied with the parameters in the
    background, and 10 of 12 checkpoints of such a run held the next batch's count."""
    _slow_background_copy(monkeypatch)
    root = tmp_path / "run"
    counter = _BatchesSeen()
    hook = CheckpointHook(root, step_interval=1, incremental=False)
    strategy = support.new_strategy([hook, counter, EMAHook(decay=0.5)], num_steps=6)
    strategy.run(support.loader())
    for row in fastckpt.list_checkpoints(root):
        loaded = _BatchesSeen()
        resumed = TrainingStrategy.load_checkpoint(
            root, row["index"], hooks=[loaded, EMAHook(decay=0.5)], training_fn=support.training_fn
        )
        # saved at the end of step k (after the other hooks' AFTER_BATCH): k starts, k ends
        assert int(loaded.seen) == 2 * resumed.step_count, row["index"]
