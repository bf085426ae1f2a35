"""A run resumed mid-epoch with another training loader than the saved run's (another batch
size, ``drop_last``, number of batches, sampler kind or ``num_workers``). The replay that skips
the epoch's finished batches counts them in the new loader's batches: with another batch size
it skips other samples than the saved run read. Before, the resumed epoch trained some samples
twice (a smaller batch size) or never (a larger one), without a word: an adversarial tester
saved after 5 batches of 6 (30 samples read), resumed with ``batch_size=4``, and samples 20-29
were trained twice. Now the checkpoint records the loader its epoch position counts batches of,
and such a resume warns (a ``RuntimeWarning`` naming both settings, what the replay does and
the fix); it still resumes, since a user may change the batch size on purpose. At an epoch's
end nothing is replayed, so nothing is said; a checkpoint without the record (saved by an
earlier fastckpt) resumes as before, silently."""

from __future__ import annotations

import json
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fastckpt
from fastckpt.errors import CheckpointFormatError
from fastckpt.format.records import Manifest
from test_exit_and_errors import _reseal

SAMPLES = 48


def training_fn(model: nn.Module, batch: Any) -> torch.Tensor:
    """Mean squared error on an (x, y, sample id) batch."""
    x, y, _ = batch
    return (model(x) - y).square().mean()


class SampleLog:
    """The sample ids of every batch trained, per epoch."""

    def __init__(self) -> None:
        self.ids: dict[int, list[int]] = {}

    def __call__(self, ctx: fastckpt.TrainContext, stage: fastckpt.TrainingStage) -> None:
        if stage is fastckpt.TrainingStage.BEFORE_BATCH:
            self.ids.setdefault(ctx.epoch, []).extend(ctx.batch[2].tolist())


def loader(
    batch_size: int,
    num_workers: int = 0,
    shuffle: bool = True,
    samples: int = SAMPLES,
    drop_last: bool = False,
) -> DataLoader[Any]:
    """``samples`` (48) samples with their ids, shuffled by the loader's own generator."""
    x = torch.randn(samples, 4, generator=torch.Generator().manual_seed(0))
    dataset = TensorDataset(x, x.sum(dim=1, keepdim=True), torch.arange(samples))
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=shuffle,
        num_workers=num_workers,
        drop_last=drop_last,
        generator=torch.Generator().manual_seed(1),
    )


def saved_after(
    root: Path, log: SampleLog, data: DataLoader[Any], steps: int | None, epochs: int | None = None
) -> None:
    """Train ``steps`` steps (or ``epochs`` epochs) on ``data`` and save into ``root``."""
    torch.manual_seed(0)
    strategy = fastckpt.TrainingStrategy(
        nn.Linear(4, 1),
        fastckpt.OptimizerConfig(torch.optim.SGD, {"lr": 0.01}),
        training_fn=training_fn,
        hooks=[log],
        num_steps=steps,
        num_epochs=epochs,
    )
    strategy.run(data)
    strategy.save_checkpoint(root)


def resumed_warnings(
    root: Path, log: SampleLog, data: DataLoader[Any], steps: int
) -> list[warnings.WarningMessage]:
    """Resume from ``root`` and train to ``steps`` steps on ``data``; the warnings raised."""
    resumed = fastckpt.TrainingStrategy.load_checkpoint(root, hooks=[log], training_fn=training_fn)
    resumed.num_steps = steps
    resumed.num_epochs = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed.run(data)
    return [w for w in caught if issubclass(w.category, RuntimeWarning)]


def test_a_smaller_batch_size_mid_epoch_warns_which_samples_are_trained_twice(
    tmp_path: Path,
) -> None:
    """Saved after 5 batches of 6 (30 samples), resumed with batches of 4: the replay skips
    20 samples, so 10 are trained twice in that epoch (the log shows it). Before, no word."""
    log = SampleLog()
    saved_after(tmp_path / "run", log, loader(6), 5)
    caught = resumed_warnings(tmp_path / "run", log, loader(4), 5 + (SAMPLES - 20) // 4)
    (warning,) = caught
    message = str(warning.message)
    assert "after 5 batches" in message
    assert "batch_size=6 in the checkpoint, batch_size=4 now" in message
    assert "skips 5 batches of 4 (20 samples) where the saved run had read 30" in message
    assert "10 samples of this epoch are trained twice" in message
    assert "resume with the same loader settings" in message
    assert "save at an epoch boundary" in message
    assert warning.filename == __file__  # points at the run() call
    counts = Counter(log.ids[0])
    assert sorted(counts.values()).count(2) == 10  # what the warning says happened
    assert len(counts) == SAMPLES


def test_a_larger_batch_size_mid_epoch_warns_which_samples_are_skipped(tmp_path: Path) -> None:
    """Saved after 5 batches of 4 (20 samples), resumed with batches of 6: the replay skips
    30 samples, so 10 are never trained in that epoch. Before, no word."""
    log = SampleLog()
    saved_after(tmp_path / "run", log, loader(4), 5)
    (warning,) = resumed_warnings(tmp_path / "run", log, loader(6), 5 + (SAMPLES - 30) // 6)
    message = str(warning.message)
    assert "batch_size=4 in the checkpoint, batch_size=6 now" in message
    assert "skips 5 batches of 6 (30 samples) where the saved run had read 20" in message
    assert "10 samples of this epoch are skipped" in message
    assert len(set(log.ids[0])) == SAMPLES - 10


@pytest.mark.parametrize(
    ("saved", "resumed", "named", "effect"),
    [
        (
            loader(6),
            loader(6, num_workers=1),
            "num_workers=0 in the checkpoint, num_workers=1 now",
            "the batches are the same, but random transforms inside worker processes",
        ),
        (
            loader(6),
            loader(6, shuffle=False),
            "sampler='torch.utils.data.sampler.RandomSampler' in the checkpoint, "
            "sampler='torch.utils.data.sampler.SequentialSampler' now",
            "the replay skips 3 batches of this loader, which need not be the batches",
        ),
    ],
    ids=["num_workers", "sampler"],
)
def test_other_loader_settings_mid_epoch_warn_naming_both(
    tmp_path: Path, saved: DataLoader[Any], resumed: DataLoader[Any], named: str, effect: str
) -> None:
    """Worker processes draw the dataset's random augmentation from streams of their own
    (exact resume assumes ``num_workers=0`` as saved; the batches themselves are the same:
    the sampler runs in the main process), and another sampler replays another order.
    Before, both resumed without a word (a review found the first version of the warning
    predicting samples trained twice for a changed ``num_workers`` alone)."""
    log = SampleLog()
    saved_after(tmp_path / "run", log, saved, 3)
    (warning,) = resumed_warnings(tmp_path / "run", log, resumed, 5)
    message = str(warning.message)
    assert named in message
    assert effect in message
    assert "resume with the same loader settings" in message


def test_the_same_loader_settings_resume_without_a_warning(tmp_path: Path) -> None:
    """A rebuilt loader with the saved settings resumes exactly, without a word: the epoch
    reads every sample once."""
    log = SampleLog()
    saved_after(tmp_path / "run", log, loader(6), 5)
    assert resumed_warnings(tmp_path / "run", log, loader(6), 8) == []
    assert sorted(log.ids[0]) == list(range(SAMPLES))


def test_another_batch_size_at_an_epoch_boundary_resumes_without_a_warning(
    tmp_path: Path,
) -> None:
    """Saved at an epoch's end (after its 8 batches of 6 and its ``AFTER_EPOCH``), nothing is
    replayed: the next epoch reads batches of 4 from its start."""
    log = SampleLog()
    saved_after(tmp_path / "run", log, loader(6), None, epochs=1)
    assert resumed_warnings(tmp_path / "run", log, loader(4), 8 + SAMPLES // 4) == []
    assert sorted(log.ids[1]) == list(range(SAMPLES))


def test_a_checkpoint_without_the_loader_record_resumes_as_before(tmp_path: Path) -> None:
    """A checkpoint saved by an earlier fastckpt records no loader: it resumes as it did,
    silently (the record is taken out of ``strategy.json`` and the manifest re-sealed)."""
    log = SampleLog()
    root = tmp_path / "run"
    saved_after(root, log, loader(6), 5)
    (index,) = Manifest.load(root).entries
    recipe = json.loads((root / str(index) / "strategy.json").read_bytes())
    assert recipe["epoch_loader"]["batch_size"] == 6
    del recipe["epoch_loader"]
    _reseal(root, index, "strategy.json", json.dumps(recipe).encode())
    assert resumed_warnings(root, log, loader(4), 12) == []


@pytest.mark.parametrize(
    ("record", "field"),
    [
        ([6], "epoch_loader"),
        ({"batch_size": "6"}, "epoch_loader.batch_size"),
        ({"batch_size": -1}, "epoch_loader.batch_size"),
        ({"drop_last": 0}, "epoch_loader.drop_last"),
        ({"sampler": 3}, "epoch_loader.sampler"),
    ],
)
def test_a_malformed_loader_record_is_a_format_error_naming_the_field(
    tmp_path: Path, record: Any, field: str
) -> None:
    """An edited record is refused at load, naming the file and the field."""
    root = tmp_path / "run"
    saved_after(root, SampleLog(), loader(6), 5)
    (index,) = Manifest.load(root).entries
    recipe = json.loads((root / str(index) / "strategy.json").read_bytes())
    recipe["epoch_loader"] = record
    _reseal(root, index, "strategy.json", json.dumps(recipe).encode())
    with pytest.raises(CheckpointFormatError, match=rf"strategy.json: field '{field}'"):
        fastckpt.TrainingStrategy.load_checkpoint(root, training_fn=training_fn)


def test_a_dataset_of_another_length_mid_epoch_warns_of_samples_trained_twice_or_skipped(
    tmp_path: Path,
) -> None:
    """48 samples saved after 3 batches, resumed over 54: the shuffle permutes other indices,
    so the replay skips other samples (a review found a first wording saying only "the epoch's
    end differs" while 13 samples were trained twice)."""
    log = SampleLog()
    saved_after(tmp_path / "run", log, loader(6), 3)
    (warning,) = resumed_warnings(tmp_path / "run", log, loader(6, samples=54), 5)
    message = str(warning.message)
    assert "num_batches=8 in the checkpoint, num_batches=9 now" in message
    assert "may be trained twice or skipped" in message


def test_drop_last_alone_mid_epoch_warns_that_the_epochs_end_differs(tmp_path: Path) -> None:
    """50 samples in batches of 6 saved after 3 batches, resumed with ``drop_last=True``: the
    same order, one partial batch fewer at the epoch's end."""
    log = SampleLog()
    saved_after(tmp_path / "run", log, loader(6, samples=50), 3)
    (warning,) = resumed_warnings(tmp_path / "run", log, loader(6, samples=50, drop_last=True), 5)
    message = str(warning.message)
    assert "drop_last=False in the checkpoint, drop_last=True now" in message
    assert "the epoch's end differs from the saved run's" in message
    assert "trained twice" not in message
