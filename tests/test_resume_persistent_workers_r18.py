"""Exact resume with a DataLoader whose workers persist across epochs (round 18).

torch makes such a loader's worker iterator once, in its first epoch, drawing the workers'
base seed from the RNG before the sampler's shuffle seed; later epochs reuse it and draw the
shuffle seed alone. A run resumed past its first epoch made the iterator anew and drew one
number early: the resumed epoch read its batches in another order, without a word, and the
final weights differed from the uninterrupted run's.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import fastckpt


class _Data(Dataset[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]):
    def __init__(self) -> None:
        self.x = torch.randn(32, 6, generator=torch.Generator().manual_seed(5))

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return torch.tensor(i), self.x[i], self.x[i].sum(0, keepdim=True)


def _loss(model: nn.Module, batch: Any) -> torch.Tensor:
    _, x, y = batch
    return nn.functional.mse_loss(model(x), y)


class _Ids:
    """Records the sample ids of every batch trained on."""

    def __init__(self) -> None:
        self.ids: list[list[int]] = []

    def __call__(self, ctx: Any, stage: Any) -> None:
        if stage is fastckpt.TrainingStage.AFTER_BATCH:
            self.ids.append(ctx.batch[0].tolist())


def _loader() -> DataLoader[Any]:
    return DataLoader(_Data(), batch_size=4, shuffle=True, num_workers=2, persistent_workers=True)


def _strategy(hooks: list[Any], steps: int) -> fastckpt.TrainingStrategy:
    return fastckpt.TrainingStrategy(
        nn.Linear(6, 1),
        fastckpt.OptimizerConfig(torch.optim.SGD, {"lr": 0.05}),
        training_fn=_loss,
        hooks=hooks,
        num_steps=steps,
    )


@pytest.mark.parametrize("save_step", [10, 16])  # mid-epoch 1; the end of epoch 1
def test_a_run_with_persistent_workers_resumed_past_its_first_epoch_is_exact(
    tmp_path: Path, save_step: int
) -> None:
    torch.manual_seed(0)
    seen = _Ids()
    uninterrupted = _strategy([seen], 24)
    uninterrupted.run(_loader())

    torch.manual_seed(0)
    hook = fastckpt.CheckpointHook(tmp_path, step_interval=save_step, async_save=False)
    _strategy([hook], save_step).run(_loader())

    torch.manual_seed(1234)  # a new process's RNG
    resumed_seen = _Ids()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = fastckpt.TrainingStrategy.load_checkpoint(tmp_path, hooks=[resumed_seen])
        resumed.num_steps = 24
        resumed.run(_loader())  # a fresh loader, as a restarted script builds it
    assert resumed_seen.ids == seen.ids[save_step:]
    for name, value in uninterrupted.models["main"].state_dict().items():
        assert torch.equal(value, resumed.models["main"].state_dict()[name]), name
    said = [str(w.message) for w in caught if "persistent workers start anew" in str(w.message)]
    assert len(said) == 1 and "random numbers drawn inside the workers" in said[0], said


class _Noisy(_Data):
    """Augments in the workers: every sample draws from the worker's torch RNG."""

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        index, x, y = super().__getitem__(i)
        return index, x + 0.01 * torch.rand(x.shape), y


def _per_epoch_run(root: Path | None, epochs: range, strategy: fastckpt.TrainingStrategy) -> None:
    """A loop that calls ``run()`` once per epoch with a new loader (persistent workers, which
    then live one epoch each): every epoch seeds its workers from the run's RNG."""
    for epoch in epochs:
        strategy.num_steps = None
        strategy.num_epochs = epoch + 1
        loader = DataLoader(
            _Noisy(), batch_size=4, shuffle=True, num_workers=2, persistent_workers=True
        )
        strategy.run(loader)


def test_a_loop_with_a_new_persistent_loader_every_epoch_stays_exact_and_quiet(
    tmp_path: Path,
) -> None:
    """Review: the first version took every first iterator past epoch 0 for a resumed one:
    such a loop, never interrupted, drew its workers' seeds from os.urandom (two runs with one
    seed differed) and warned at every epoch. Now only a restore whose checkpoint says the
    saved run's workers were running takes that path; this loop is exact, uninterrupted and
    resumed at an epoch's end, and says nothing."""

    def fresh(hooks: list[Any]) -> fastckpt.TrainingStrategy:
        torch.manual_seed(0)
        strategy = _strategy(hooks, 0)
        return strategy

    finals = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            strategy = fresh([])
            _per_epoch_run(None, range(3), strategy)
            finals.append(strategy.models["main"].state_dict())
        hook = fastckpt.CheckpointHook(tmp_path, epoch_interval=1, async_save=False)
        _per_epoch_run(tmp_path, range(2), fresh([hook]))
        torch.manual_seed(1234)
        resumed = fastckpt.TrainingStrategy.load_checkpoint(tmp_path, hooks=[])
        _per_epoch_run(tmp_path, range(2, 3), resumed)
    for name, value in finals[0].items():
        assert torch.equal(value, finals[1][name]), name
        assert torch.equal(value, resumed.models["main"].state_dict()[name]), name
