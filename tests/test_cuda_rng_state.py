"""A run checkpointed on a CUDA machine records its CUDA generators' states (16 bytes each:
seed and offset). The loader checks them as CUDA states; it once checked them with a CPU
generator, which refuses every real CUDA state, so no run saved on a GPU could resume (found
by tools/gpu_check.py on an H200). These tests run without CUDA: the state is the one a CUDA
generator records, and a machine without CUDA checks its form and does not apply it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import fastckpt
import training_support as support
from fastckpt.training import strategy as strategy_module


def _saved_with_cuda_states(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cuda: list[Any]
) -> Path:
    """A strategy checkpoint whose recorded RNG state holds ``cuda`` as the CUDA states."""
    recorded = strategy_module._rng_state

    def with_cuda() -> dict[str, Any]:
        return {**recorded(), "cuda": cuda}

    monkeypatch.setattr(strategy_module, "_rng_state", with_cuda)
    strategy = support.new_strategy([], num_steps=2)
    strategy.run(support.loader())
    strategy.save_checkpoint(tmp_path / "run")
    monkeypatch.setattr(strategy_module, "_rng_state", recorded)
    return tmp_path / "run"


def test_a_checkpoint_with_cuda_generator_states_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seed_and_offset = torch.tensor(
        [7, 0, 0, 0, 0, 0, 0, 0, 4, 0, 0, 0, 0, 0, 0, 0], dtype=torch.uint8
    )
    root = _saved_with_cuda_states(tmp_path, monkeypatch, [seed_and_offset])
    resumed = fastckpt.TrainingStrategy.load_checkpoint(root, training_fn=support.training_fn)
    assert resumed.step_count == 2


@pytest.mark.parametrize(
    "cuda", [[torch.zeros(16)], [torch.zeros(2, 8, dtype=torch.uint8)], ["seed"]]
)
def test_a_malformed_cuda_generator_state_is_a_format_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cuda: list[Any]
) -> None:
    root = _saved_with_cuda_states(tmp_path, monkeypatch, cuda)
    with pytest.raises(fastckpt.CheckpointFormatError, match=r"runtime\.rng.*CUDA RNG state"):
        fastckpt.TrainingStrategy.load_checkpoint(root, training_fn=support.training_fn)
