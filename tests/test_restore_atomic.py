"""TrainingStrategy.restore_checkpoint is all or nothing, and strategy loads read one committed
version while another process replaces the index.

Before: a restore into a model of another shape (or with a key more or less) went through
torch's ``load_state_dict``, which copied every tensor that fitted before raising a bare
``RuntimeError``; a damaged later model file or scheduler file was found after the earlier
models and the optimizer state were overwritten; an ``EMAHook`` configured otherwise refused
its state after everything else was restored; and ``restore_checkpoint``,
``TrainingStrategy.load_checkpoint`` and ``FineTuningStrategy.from_pretrained_checkpoint``
read the component files outside the consistency retry, so a save replacing the index
meanwhile failed 1-4% of them with ``FileNotFoundError`` / ``ChecksumMismatchError``.
"""

from __future__ import annotations

import copy
import os
import random
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import fastckpt
from fastckpt.errors import InterruptedStepError
from fastckpt.training import FineTuningStrategy, TrainingStrategy

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))
import training_support as support  # noqa: E402


class WithExtraBuffer(support.DropoutMLP):
    """The reference model with one more persistent buffer than the checkpoint holds."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("extra", torch.zeros(3))


class WiderWithRotaryTable(support.DropoutMLP):
    """A wider first layer, and a non-persistent buffer (a rotary table, HF position ids):
    not in any state_dict, so no reason to leave the fit check to torch (a first version of
    the check skipped such models, which torch then half overwrote)."""

    def __init__(self) -> None:
        super().__init__(width=6)
        self.register_buffer("inv_freq", torch.ones(3), persistent=False)


class WithoutLastBias(support.DropoutMLP):
    """The reference model whose last layer lacks the bias the checkpoint holds."""

    def __init__(self) -> None:
        super().__init__()
        self.net[3] = nn.Linear(8, 1, bias=False)


def trained_live(model: nn.Module, hooks: list[Any] | None = None) -> TrainingStrategy:
    """A live strategy over ``model`` trained 3 steps (optimizer moments, a scheduler step,
    counters), with a seeded RNG: what a failed restore must leave as it was."""
    torch.manual_seed(7)
    strategy = TrainingStrategy(
        model,
        fastckpt.OptimizerConfig(
            torch.optim.Adam, {"lr": 1e-2}, torch.optim.lr_scheduler.StepLR, {"step_size": 5}
        ),
        training_fn=support.training_fn,
        hooks=hooks or [],
        num_steps=3,
    )
    strategy.run(support.loader(seed=3))
    return strategy


def live_state(strategy: TrainingStrategy) -> dict[str, Any]:
    """Everything a restore changes, copied: weights, optimizer and scheduler state,
    counters, the global RNGs and the hooks' states."""
    return copy.deepcopy(
        {
            "models": {n: m.state_dict() for n, m in strategy.models.items()},
            "optimizers": {n: o.state_dict() for n, o in strategy.optimizers.items()},
            "schedulers": {n: s.state_dict() for n, s in strategy.schedulers.items()},
            "counters": strategy.counters,
            "rng": (torch.get_rng_state(), random.getstate(), np.random.get_state()[1]),
            "hooks": [h.state_dict() for h in strategy.hooks if hasattr(h, "state_dict")],
        }
    )


def same(a: Any, b: Any) -> bool:
    """Deep equality, tensors and arrays bitwise."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return bool(np.array_equal(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def test_a_model_that_does_not_fit_is_refused_before_anything_changes(tmp_path: Path) -> None:
    """A live model of another layer shape, with a key more (a buffer) or a key less (no last
    bias): ``CheckpointMismatchError`` naming the model, the key and both shapes, and every
    live tensor, optimizer and scheduler state, counter and RNG as it was (before: a bare
    ``RuntimeError`` after torch had copied every tensor that fitted)."""
    saved = support.new_strategy([], num_steps=6)
    saved.run(support.loader())
    saved.save_checkpoint(tmp_path)
    cases = [
        (support.DropoutMLP(width=6), r"'net\.0\.weight'.* \[8, 4\].* \[6, 4\]"),
        (WithExtraBuffer(), r"'extra'.*not in the checkpoint"),
        (WiderWithRotaryTable(), r"'net\.0\.weight'.* \[8, 4\].* \[6, 4\]"),
        (WithoutLastBias(), r"'net\.3\.bias'.*not in this model"),
    ]
    for model, message in cases:
        live = trained_live(model)
        before = live_state(live)
        with pytest.raises(fastckpt.CheckpointMismatchError, match=r"model 'main'") as raised:
            live.restore_checkpoint(tmp_path)
        assert raised.match(message)
        assert same(live_state(live), before)


class _Old(nn.Module):
    """The layout before the rename."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 1)


class _Renamed(nn.Module):
    """A model whose layer ``fc`` became ``head``: a load pre-hook reads the old name, as
    torch's idiom for reading checkpoints of an older layout."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, 1)

        def rename(state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
            for key in list(state_dict):
                if key.startswith(prefix + "fc."):
                    state_dict[prefix + "head." + key[len(prefix + "fc.") :]] = state_dict.pop(key)

        self._register_load_state_dict_pre_hook(rename)


class _WithBatchNorm(nn.Module):
    def __init__(self, old_layout: bool = False) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(4)
        self.old_layout = old_layout

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        state = super().state_dict(*args, **kwargs)
        if self.old_layout:  # as torch < 0.4.1 saved batch norm
            state.pop("bn.num_batches_tracked", None)
        return state


def test_what_a_models_own_load_state_dict_accepts_still_restores(tmp_path: Path) -> None:
    """The fit check compares keys only for plain models: a first version refused a model
    whose load pre-hook renames an older layout's keys, and a batch norm checkpoint without
    ``num_batches_tracked``, both of which torch's strict ``load_state_dict`` loads."""

    def strategy(model: nn.Module) -> TrainingStrategy:
        return TrainingStrategy(
            model,
            fastckpt.OptimizerConfig(torch.optim.SGD, {"lr": 0.1}),
            training_fn=support.training_fn,
            num_steps=1,
        )

    old = _Old()
    strategy(old).save_checkpoint(tmp_path / "renamed")
    live = strategy(_Renamed())
    assert live.restore_checkpoint(tmp_path / "renamed") == 0
    assert torch.equal(live.models["main"].head.weight, old.fc.weight)
    saved = _WithBatchNorm(old_layout=True)
    with torch.no_grad():
        saved.bn.running_mean.fill_(0.5)
    strategy(saved).save_checkpoint(tmp_path / "bn")
    live = strategy(_WithBatchNorm())
    assert live.restore_checkpoint(tmp_path / "bn") == 0
    assert torch.equal(live.models["main"].bn.running_mean, torch.full((4,), 0.5))


def flip_last_byte(path: Path) -> None:
    """Flip one bit of the last data byte of safetensors file ``path``."""
    info = fastckpt.read_metadata(str(path))
    end = max(t["data_offsets"][1] for t in info["tensors"].values())
    with open(path, "r+b") as f:
        f.seek(info["data_start"] + end - 1)
        byte = f.read(1)[0]
        f.seek(info["data_start"] + end - 1)
        f.write(bytes([byte ^ 0x10]))


def two_models() -> dict[str, nn.Module]:
    return {"a": nn.Linear(4, 4), "b": nn.Linear(4, 1)}


def two_model_loss(models: dict[str, nn.Module], batch: Any) -> torch.Tensor:
    x, y = batch
    return (models["b"](models["a"](x)) - y).square().mean()


def two_model_strategy(seed: int) -> TrainingStrategy:
    torch.manual_seed(seed)
    strategy = TrainingStrategy(
        two_models(),
        fastckpt.OptimizerConfig(torch.optim.Adam, {"lr": 1e-2}),
        training_fn=two_model_loss,
        num_steps=2 + seed,
    )
    strategy.run(support.loader(seed=seed))
    return strategy


def test_a_damaged_later_file_or_a_refusing_hook_leaves_the_live_strategy_untouched(
    tmp_path: Path,
) -> None:
    """Damage in the second model's file, in the scheduler's file (read last), and an
    ``EMAHook`` configured otherwise than the saved one: the typed error, and nothing live
    changed (before: the first model, the optimizer state, the counters and the RNG were
    already restored when the error came)."""
    two = tmp_path / "two"
    two_model_strategy(0).save_checkpoint(two)
    flip_last_byte(two / "0" / "models" / "b.safetensors")
    live = two_model_strategy(1)
    before = live_state(live)
    with pytest.raises(fastckpt.ChecksumMismatchError, match=r"models/b\.safetensors"):
        live.restore_checkpoint(two)
    assert same(live_state(live), before)

    one = tmp_path / "one"
    ema = fastckpt.EMAHook(decay=0.9)
    saved = support.new_strategy([ema], num_steps=6)
    saved.run(support.loader())
    saved.save_checkpoint(one)
    # A hook configured otherwise refuses its state: nothing else restored either.
    live = trained_live(support.DropoutMLP(), [fastckpt.EMAHook(decay=0.5)])
    before = live_state(live)
    with pytest.raises(fastckpt.CheckpointMismatchError, match="decay"):
        live.restore_checkpoint(one)
    assert same(live_state(live), before)
    # The scheduler's file damaged (its step size 5 -> 7, same length).
    scheduler = one / "0" / "schedulers" / "main.json"
    data = scheduler.read_bytes()
    scheduler.write_bytes(data.replace(b'"step_size": 5', b'"step_size": 7'))
    assert scheduler.read_bytes() != data
    live = trained_live(support.DropoutMLP(), [fastckpt.EMAHook(decay=0.9)])
    before = live_state(live)
    with pytest.raises(fastckpt.ChecksumMismatchError, match=r"schedulers/main\.json"):
        live.restore_checkpoint(one)
    assert same(live_state(live), before)


@pytest.mark.parametrize("stop", [KeyboardInterrupt, ValueError], ids=["ctrl-c", "refusal"])
def test_a_restore_stopped_part_way_is_neither_saved_nor_trained_on_until_one_completes(
    tmp_path: Path, stop: type[BaseException]
) -> None:
    """Round 22 (helper: interrupts): a Ctrl-C (or a validator's refusal) after the first
    model's weights were applied left the second model, the optimizer and the counters of
    the live run; ``save_checkpoint`` and ``run()`` then took that mixed state, and the
    checkpoint verified (35 of 60 random SIGINTs during a restore were saved so). Now both
    refuse with ``InterruptedStepError`` until a restore completes; a refusal before anything
    changed (a mismatch) leaves the strategy saveable."""
    root = tmp_path / "root"
    saved = two_model_strategy(0)
    saved.save_checkpoint(root)
    live = two_model_strategy(1)  # another step count, other weights and optimizer moments
    assert live.step_count != saved.step_count

    def stop_after_the_first(model: nn.Module) -> None:
        if model is live.models["a"]:
            raise stop("stopped after model 'a' was loaded")

    with pytest.raises(stop) as info:
        live.restore_checkpoint(root, validators=[stop_after_the_first])
    assert "refuses to save or train" in "\n".join(info.value.__notes__)
    assert same(live.models["a"].state_dict(), saved.models["a"].state_dict())  # torn:
    assert not same(live.models["b"].state_dict(), saved.models["b"].state_dict())  # a, not b
    out = tmp_path / "out"
    with pytest.raises(InterruptedStepError, match=r"stopped part-way.*nothing was saved"):
        live.save_checkpoint(out)
    assert not out.exists()
    live.num_steps = live.step_count + 2
    with pytest.raises(InterruptedStepError, match="nothing was trained on"):
        live.run(support.loader(seed=1))
    # A refusal before anything is applied leaves it torn (and whole strategies saveable).
    with pytest.raises(fastckpt.CheckpointMismatchError):
        TrainingStrategy(
            {"a": nn.Linear(4, 5), "b": nn.Linear(4, 1)},
            fastckpt.OptimizerConfig(torch.optim.Adam, {"lr": 1e-2}),
            training_fn=two_model_loss,
        ).restore_checkpoint(root)
    with pytest.raises(InterruptedStepError):
        live.save_checkpoint(out)
    # A restore that completes clears it: what is saved then is the checkpoint's state.
    assert live.restore_checkpoint(root) == 0
    assert live.save_checkpoint(out) == 0
    again = TrainingStrategy.load_checkpoint(out, training_fn=two_model_loss)
    assert again.step_count == saved.step_count
    for name in ("a", "b"):
        assert same(again.models[name].state_dict(), saved.models[name].state_dict())
        assert same(
            again.optimizers[name].state_dict()["state"],
            saved.optimizers[name].state_dict()["state"],
        )


def test_a_refused_restore_that_changed_nothing_leaves_the_strategy_saveable(
    tmp_path: Path,
) -> None:
    """A restore refused by its checks (another model shape) changed nothing: the live
    strategy saves as before."""
    root = tmp_path / "root"
    two_model_strategy(0).save_checkpoint(root)
    live = TrainingStrategy(
        {"a": nn.Linear(4, 5), "b": nn.Linear(4, 1)},
        fastckpt.OptimizerConfig(torch.optim.Adam, {"lr": 1e-2}),
        training_fn=two_model_loss,
    )
    with pytest.raises(fastckpt.CheckpointMismatchError):
        live.restore_checkpoint(root)
    assert live.save_checkpoint(tmp_path / "out") == 0


WRITER = """
import sys, time, torch, fastckpt, training_support as s
from pathlib import Path
root, stop, started = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
strategy = fastckpt.TrainingStrategy(
    s.DropoutMLP(width=64), fastckpt.OptimizerConfig(torch.optim.SGD, {"lr": 0.1}),
    training_fn=s.training_fn, num_steps=10**9,
)
i, end = 1, time.monotonic() + 120  # a bound in case the test dies
while not stop.exists() and time.monotonic() < end:
    with torch.no_grad():
        for p in strategy.models["main"].parameters():
            p.fill_(float(i))
    strategy.step_count = i
    strategy.save_checkpoint(root, checkpoint_index=0, incremental=False)
    started.touch()
    i += 1
"""


def stamped_strategy() -> TrainingStrategy:
    """The writer's strategy with every parameter 0 and step 0."""
    strategy = TrainingStrategy(
        support.DropoutMLP(width=64),
        fastckpt.OptimizerConfig(torch.optim.SGD, {"lr": 0.1}),
        training_fn=support.training_fn,
        num_steps=10**9,
    )
    with torch.no_grad():
        for p in strategy.models["main"].parameters():
            p.fill_(0.0)
    return strategy


def whole(model: nn.Module, step: int) -> bool:
    """Whether every parameter of ``model`` holds the value the writer stamped at ``step``."""
    return all(bool((p == float(step)).all()) for p in model.parameters())


def test_strategy_reads_while_another_process_replaces_the_index_never_fail(
    tmp_path: Path,
) -> None:
    """A process saves index 0 again and again (``save_checkpoint(checkpoint_index=0)``) while
    this one restores it, loads it and fine-tunes from it, for a few seconds each: every call
    succeeds and returns one whole saved version (weights match the step count). Before, about
    1.5% of ``restore_checkpoint`` and 4% of ``TrainingStrategy.load_checkpoint`` calls failed
    with ``FileNotFoundError`` ("missing (listed in manifest)") or ``ChecksumMismatchError`` on
    an intact root."""
    root = tmp_path / "root"
    stamped_strategy().save_checkpoint(root, incremental=False)
    stop, started = tmp_path / "stop", tmp_path / "started"
    env = {**os.environ, "PYTHONPATH": str(TESTS)}
    writer = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(WRITER), str(root), str(stop), str(started)],
        env=env,
    )
    errors: list[str] = []
    seen: dict[str, set[int]] = {"restore": set(), "load": set(), "fine_tune": set()}
    live = stamped_strategy()
    try:
        while not started.exists() and writer.poll() is None:  # its imports take a while
            time.sleep(0.01)
        for mode in seen:
            end = time.monotonic() + 6
            while time.monotonic() < end:
                try:
                    if mode == "restore":
                        live.restore_checkpoint(root, checkpoint_index=0)
                        model, step = live.models["main"], live.step_count
                    elif mode == "load":
                        loaded = TrainingStrategy.load_checkpoint(
                            root, 0, training_fn=support.training_fn
                        )
                        model, step = loaded.models["main"], loaded.step_count
                    else:
                        tuned = FineTuningStrategy.from_pretrained_checkpoint(
                            root, checkpoint_index=0, training_fn=support.training_fn
                        )
                        model = tuned.models["main"]
                        step = int(next(model.parameters()).flatten()[0])
                except Exception as err:  # every failure is counted
                    errors.append(f"{mode}: {type(err).__name__}: {err}")
                    continue
                if not whole(model, step):
                    errors.append(f"{mode}: a mixed state at step {step}")
                seen[mode].add(step)
    finally:
        stop.touch()
        writer.wait(timeout=120)
    assert writer.returncode == 0
    failed = {mode: sum(e.startswith(f"{mode}:") for e in errors) for mode in seen}
    assert errors == [], f"failed {failed}: {errors[:3]}"
    assert all(len(steps) > 1 for steps in seen.values()), seen  # the writer saved meanwhile
