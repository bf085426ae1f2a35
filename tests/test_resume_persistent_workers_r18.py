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
