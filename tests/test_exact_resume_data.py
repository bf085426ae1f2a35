"""Exact resume mid-epoch with the data pipelines training runs use: a dataset augmenting
with Python's and NumPy's RNGs, a ``DistributedSampler`` whose epoch a ``BEFORE_EPOCH`` hook
sets. A run stopped at step k and resumed from its checkpoint in this process (its RNGs
scrambled first, as a new process has them) must match the uninterrupted run bitwise."""

from __future__ import annotations

import random
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    RandomSampler,
    TensorDataset,
)

import fastckpt
import training_support as support

STEPS = 10


class NoisyDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """32 samples of 4 features, each read with Python and NumPy noise added (augmentation
    drawing from the global RNGs, as ``__getitem__`` often does)."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(5)
        self.x = torch.randn(32, 4, generator=gen)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        noise = float(np.random.normal()) + random.random()
        x = self.x[i] + noise
        return x, x.sum(dim=0, keepdim=True)


def noisy_loader() -> DataLoader[Any]:
    """8 batches of 4 per epoch, shuffled by torch's RNG."""
    return DataLoader(NoisyDataset(), batch_size=4, shuffle=True)


class SetEpoch:
    """The usual recipe: ``sampler.set_epoch(ctx.epoch)`` when an epoch begins."""

    def __init__(self, sampler: DistributedSampler[Any]) -> None:
        self.sampler = sampler

    def __call__(self, ctx: fastckpt.TrainContext, stage: fastckpt.TrainingStage) -> None:
        if stage is fastckpt.TrainingStage.BEFORE_EPOCH:
            self.sampler.set_epoch(ctx.epoch)


def sampled_loader() -> tuple[DataLoader[Any], SetEpoch]:
    """4 batches of 8 per epoch from a DistributedSampler (1 replica), and its hook."""
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(32, 4, generator=gen)
    dataset = TensorDataset(x, x.sum(dim=1, keepdim=True))
    sampler: DistributedSampler[Any] = DistributedSampler(
        dataset, num_replicas=1, rank=0, shuffle=True, seed=11
    )
    return DataLoader(dataset, batch_size=8, sampler=sampler), SetEpoch(sampler)


def seeded(hooks: list[Any], steps: int) -> fastckpt.TrainingStrategy:
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    return fastckpt.TrainingStrategy(
        support.DropoutMLP(),
        fastckpt.OptimizerConfig(torch.optim.SGD, {"lr": 0.01, "momentum": 0.9}),
        training_fn=support.training_fn,
        hooks=hooks,
        num_steps=steps,
    )


def resume_matches(
    tmp_path: Path, data: Callable[[], tuple[DataLoader[Any], list[Any]]], stop: int
) -> None:
    """Train STEPS steps straight; train ``stop`` steps saving at the last, scramble the RNGs,
    resume from that checkpoint to STEPS; the losses and weights must be the same."""
    straight_log = support.LossRecorder()
    loader, extra = data()
    straight = seeded([*extra, straight_log], STEPS)
    straight.run(loader)

    first_log = support.LossRecorder()
    loader, extra = data()
    hook = fastckpt.CheckpointHook(tmp_path / "run", step_interval=stop, async_save=False)
    seeded([*extra, first_log, hook], stop).run(loader)

    torch.manual_seed(123)
    np.random.seed(123)
    random.seed(123)
    resumed_log = support.LossRecorder()
    loader, extra = data()
    resumed = fastckpt.TrainingStrategy.load_checkpoint(
        tmp_path / "run", hooks=[*extra, resumed_log], training_fn=support.training_fn
    )
    assert resumed.step_count == stop
    resumed.num_steps = STEPS
    resumed.run(loader)
    assert first_log.losses + resumed_log.losses == straight_log.losses
    for name, tensor in straight.models["main"].state_dict().items():
        assert torch.equal(resumed.models["main"].state_dict()[name], tensor), name


@pytest.mark.parametrize("stop", [4, 8], ids=["mid-epoch", "epoch-end"])
def test_a_dataset_drawing_from_python_and_numpy_rngs_resumes_exactly(
    tmp_path: Path, stop: int
) -> None:
    """The replay that skips the epoch's finished batches reads them through the dataset,
    drawing from Python's and NumPy's RNGs: every RNG is put back after it. Before, the
    resumed batches drew from advanced states and the run diverged at its first step."""
    resume_matches(tmp_path, lambda: (noisy_loader(), []), stop)


class GlobalRngSampler(torch.utils.data.Sampler[int]):
    """A sampler shuffling with NumPy's or Python's global RNG in ``__iter__`` (bucketing and
    length-grouped samplers often do)."""

    def __init__(self, size: int, source: str) -> None:
        self.size = size
        self.source = source

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Any:
        if self.source == "numpy":
            return iter(np.random.permutation(self.size).tolist())
        order = list(range(self.size))
        random.shuffle(order)
        return iter(order)


@pytest.mark.parametrize("source", ["numpy", "python"])
def test_a_sampler_shuffling_with_numpy_or_python_rngs_resumes_exactly(
    tmp_path: Path, source: str
) -> None:
    """The replay of the resumed epoch starts from every CPU RNG as the epoch began. Before,
    only torch's was put back: a sampler drawing its order from NumPy's or Python's drew it
    from the checkpoint's mid-epoch state, and the resumed run read other batches (its losses
    diverged at the first resumed step, with no warning)."""

    def data() -> tuple[DataLoader[Any], list[Any]]:
        gen = torch.Generator().manual_seed(6)
        x = torch.randn(32, 4, generator=gen)
        dataset = TensorDataset(x, x.sum(dim=1, keepdim=True))
        return DataLoader(dataset, batch_size=4, sampler=GlobalRngSampler(32, source)), []

    resume_matches(tmp_path, data, 5)


def test_a_checkpoint_recording_only_torchs_epoch_start_rng_still_resumes_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Checkpoints of an earlier fastckpt hold torch's epoch-start state alone (a tensor):
    they still load, and a loader shuffled by torch's RNG resumes exactly from them."""
    from fastckpt.training import strategy as strategy_module

    straight_log = support.LossRecorder()
    seeded([straight_log], STEPS).run(noisy_loader())
    with monkeypatch.context() as earlier:
        earlier.setattr(strategy_module, "_cpu_rng_state", torch.get_rng_state)
        first_log = support.LossRecorder()
        hook = fastckpt.CheckpointHook(tmp_path / "run", step_interval=5, async_save=False)
        seeded([first_log, hook], 5).run(noisy_loader())
    torch.manual_seed(123)
    np.random.seed(123)
    random.seed(123)
    resumed_log = support.LossRecorder()
    resumed = fastckpt.TrainingStrategy.load_checkpoint(
        tmp_path / "run", hooks=[resumed_log], training_fn=support.training_fn
    )
    assert isinstance(resumed._epoch_start_rng, torch.Tensor)
    resumed.num_steps = STEPS
    resumed.run(noisy_loader())
    assert first_log.losses + resumed_log.losses == straight_log.losses


def test_a_distributed_sampler_set_by_a_before_epoch_hook_resumes_exactly(
    tmp_path: Path,
) -> None:
    """A run resumed mid-epoch fires BEFORE_EPOCH again before replaying the epoch, so
    ``sampler.set_epoch`` applies to it. Before, the resumed epoch 1 was read in epoch 0's
    order."""

    def data() -> tuple[DataLoader[Any], list[Any]]:
        loader, hook = sampled_loader()
        return loader, [hook]

    resume_matches(tmp_path, data, 6)


class RandomScale:
    """A random per-epoch setting drawn when the epoch begins (an input scale)."""

    def __init__(self, dataset: NoisyDataset) -> None:
        self.dataset = dataset

    def __call__(self, ctx: fastckpt.TrainContext, stage: fastckpt.TrainingStage) -> None:
        if stage is fastckpt.TrainingStage.BEFORE_EPOCH:
            self.dataset.scale = 0.5 + random.random() + float(torch.rand(()))


def test_a_random_per_epoch_setting_drawn_at_before_epoch_resumes_exactly(
    tmp_path: Path,
) -> None:
    """The epoch's setup on a resume draws what it drew when the epoch began. Before, it
    fired under the checkpoint's RNG state: the resumed epoch ran with another setting."""

    class Scaled(NoisyDataset):
        scale = 1.0

        def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
            x, y = super().__getitem__(i)
            return x * self.scale, y

    def data() -> tuple[DataLoader[Any], list[Any]]:
        dataset = Scaled()
        return DataLoader(dataset, batch_size=4, shuffle=True), [RandomScale(dataset)]

    resume_matches(tmp_path, data, 6)


def test_before_epoch_fires_again_on_a_resume_mid_epoch(tmp_path: Path) -> None:
    """Hooks tell the two apart by ``epoch_step_count``: 0 when the epoch starts, the
    batches already done when a resumed run sets it up again."""
    seen: list[tuple[int, int]] = []

    def record(ctx: fastckpt.TrainContext, stage: fastckpt.TrainingStage) -> None:
        if stage is fastckpt.TrainingStage.BEFORE_EPOCH:
            seen.append((ctx.epoch, ctx.epoch_step_count))

    hook = fastckpt.CheckpointHook(tmp_path / "run", step_interval=11, async_save=False)
    seeded([hook], 11).run(support.loader())  # 8 batches per epoch: stops at 3 of epoch 1
    resumed = fastckpt.TrainingStrategy.load_checkpoint(
        tmp_path / "run", hooks=[record], training_fn=support.training_fn
    )
    resumed.num_steps = 17
    resumed.run(support.loader())
    assert seen == [(1, 3), (2, 0)]


@pytest.mark.parametrize("stop", [6, 4], ids=["mid-epoch", "epoch-end"])
def test_a_loader_shuffling_with_its_own_generator_resumes_exactly(
    tmp_path: Path, stop: int
) -> None:
    """``DataLoader(generator=...)`` shuffles with its own generator, not torch's global
    one: its state at the epoch's start is saved and given back before the replay. Before,
    the resumed epoch 1 was read in epoch 0's order."""

    def data() -> tuple[DataLoader[Any], list[Any]]:
        gen = torch.Generator().manual_seed(6)
        x = torch.randn(16, 4, generator=gen)
        dataset = TensorDataset(x, x.sum(dim=1, keepdim=True))
        own = torch.Generator().manual_seed(42)
        return DataLoader(dataset, batch_size=4, shuffle=True, generator=own), []

    resume_matches(tmp_path, data, stop)


def test_a_loader_with_other_generators_than_the_checkpoint_is_warned_about(
    tmp_path: Path,
) -> None:
    """A resume mid-epoch whose loader has generators the checkpoint holds no state for
    cannot replay the saved order: said in a warning, not left to diverge silently."""
    hook = fastckpt.CheckpointHook(tmp_path / "run", step_interval=3, async_save=False)
    seeded([hook], 3).run(support.loader())  # torch's global generator only
    resumed = fastckpt.TrainingStrategy.load_checkpoint(
        tmp_path / "run", training_fn=support.training_fn
    )
    resumed.num_steps = 4
    x = torch.randn(64, 4)
    own = DataLoader(
        TensorDataset(x, x.sum(dim=1, keepdim=True)),
        batch_size=8,
        shuffle=True,
        generator=torch.Generator().manual_seed(1),
    )
    with pytest.warns(
        UserWarning, match=r"1 generator\(s\) of its own .* holds the epoch-start state of 0"
    ):
        resumed.run(own)


@pytest.mark.parametrize("how", ["hook", "after-run"])
@pytest.mark.parametrize("kind", ["loader-generator", "batch-sampler"])
def test_a_resume_at_an_epoch_boundary_shuffles_as_the_saved_run(
    tmp_path: Path, kind: str, how: str
) -> None:
    """A checkpoint taken at an epoch's end (``epoch_interval``, or the end of a run on
    ``num_epochs``) records the loader's own generators as they are then; the resumed run's
    next epoch starts from them, not from the rebuilt loader's seed. Before, the resumed
    epoch 2 was read in epoch 0's order, without a warning."""

    def data() -> DataLoader[Any]:
        gen = torch.Generator().manual_seed(6)
        x = torch.randn(16, 4, generator=gen)
        dataset = TensorDataset(x, x.sum(dim=1, keepdim=True))
        own = torch.Generator().manual_seed(42)
        if kind == "loader-generator":
            return DataLoader(dataset, batch_size=4, shuffle=True, generator=own)
        sampler = BatchSampler(RandomSampler(dataset, generator=own), 4, drop_last=False)
        return DataLoader(dataset, batch_sampler=sampler)

    def by_epochs(hooks: list[Any], epochs: int) -> fastckpt.TrainingStrategy:
        strategy = seeded(hooks, 1)
        strategy.num_steps, strategy.num_epochs = None, epochs
        return strategy

    straight_log, first_log, resumed_log = (support.LossRecorder() for _ in range(3))
    straight = by_epochs([straight_log], 4)
    straight.run(data())
    if how == "hook":
        hook = fastckpt.CheckpointHook(tmp_path / "run", epoch_interval=1, async_save=False)
        by_epochs([first_log, hook], 2).run(data())
    else:  # a finished run saved by hand, to be resumed for more epochs
        first = by_epochs([first_log], 2)
        first.run(data())
        first.save_checkpoint(tmp_path / "run")
    torch.manual_seed(123)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about
        resumed = fastckpt.TrainingStrategy.load_checkpoint(
            tmp_path / "run", hooks=[resumed_log], training_fn=support.training_fn
        )
        assert (resumed.epoch_count, resumed.epoch_step_count) == (2, 0)
        resumed.num_epochs = 4
        resumed.run(data())
    assert first_log.losses + resumed_log.losses == straight_log.losses
    for name, tensor in straight.models["main"].state_dict().items():
        assert torch.equal(resumed.models["main"].state_dict()[name], tensor), name


def test_a_sampler_with_a_generator_checkpoints_do_not_save_is_warned_of(
    tmp_path: Path,
) -> None:
    """Only ``generator`` attributes are saved: a sampler shuffling with its own generator
    under another name resumed in another order without a word (README's limits say exact
    resume needs the order from torch's RNG or the loader's generators)."""

    class OwnGenerator(torch.utils.data.Sampler[int]):
        def __init__(self, n: int) -> None:
            self.n, self.rng = n, torch.Generator().manual_seed(5)

        def __len__(self) -> int:
            return self.n

        def __iter__(self) -> Any:
            return iter(torch.randperm(self.n, generator=self.rng).tolist())

    x = torch.randn(32, 4)
    dataset = TensorDataset(x, x.sum(1, keepdim=True))
    hook = fastckpt.CheckpointHook(tmp_path / "a", step_interval=2, async_save=False)
    with pytest.warns(UserWarning, match=r"OwnGenerator\.rng, a random generator of its own"):
        seeded([hook], 2).run(DataLoader(dataset, batch_size=8, sampler=OwnGenerator(32)))
    saved = RandomSampler(dataset, generator=torch.Generator().manual_seed(5))
    hook = fastckpt.CheckpointHook(tmp_path / "b", step_interval=2, async_save=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        seeded([hook], 2).run(DataLoader(dataset, batch_size=8, sampler=saved))
