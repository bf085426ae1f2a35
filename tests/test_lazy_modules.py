"""Models with lazy modules (``nn.LazyLinear``): shaped by their first forward pass.

Before, ``TrainingStrategy`` proved every model's recipe when it was made, which for a lazy
model raised torch's raw "Can't access the shape of an uninitialized parameter": a run with a
lazy model could not be set up at all. Now its recipe is proven at every save, once it has
shapes, and a save before its first forward pass is refused with a typed error.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import fastckpt
from fastckpt.checkpoint.build import has_lazy_tensors


def _loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return (model(batch) - 1.0).square().mean()


@pytest.mark.parametrize("async_save", [False, True])
def test_a_lazy_model_trains_checkpoints_and_resumes_bitwise(
    tmp_path: Path, async_save: bool
) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.LazyLinear(4), torch.nn.ReLU(), torch.nn.LazyLinear(1))
    strategy = fastckpt.TrainingStrategy(
        model,
        fastckpt.OptimizerConfig(torch.optim.AdamW, {"lr": 1e-2}),
        training_fn=_loss,
        hooks=[fastckpt.CheckpointHook(tmp_path / "run", step_interval=1, async_save=async_save)],
        num_steps=3,
    )
    strategy.run([torch.randn(2, 8) for _ in range(3)])

    resumed = fastckpt.TrainingStrategy.load_checkpoint(tmp_path / "run", training_fn=_loss)
    rebuilt = resumed.models["main"]
    assert resumed.step_count == 3
    assert isinstance(rebuilt[0], torch.nn.Linear) and rebuilt[0].in_features == 8
    for key, value in model.state_dict().items():
        assert torch.equal(rebuilt.state_dict()[key], value), key
    assert fastckpt.verify(tmp_path / "run").ok


def test_a_lazy_model_saved_before_its_first_forward_pass_is_refused(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.LazyLinear(4))
    strategy = fastckpt.TrainingStrategy(model, training_fn=_loss)  # setting up is fine
    assert has_lazy_tensors(model)
    with pytest.raises(fastckpt.InvalidInputError, match="run a forward pass"):
        strategy.save_checkpoint(tmp_path / "run")
    assert not (tmp_path / "run").exists()
