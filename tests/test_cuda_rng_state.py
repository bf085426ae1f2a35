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


def test_a_device_count_change_is_named_in_the_warning() -> None:
    assert strategy_module._cuda_rng_mismatch(2, 2) is None
    fewer = strategy_module._cuda_rng_mismatch(4, 2)
    assert fewer is not None and "4 device(s)" in fewer and "devices 2..3 are dropped" in fewer
    more = strategy_module._cuda_rng_mismatch(1, 3)
    assert more is not None and "devices 1..2 keep their current state" in more


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_run_saved_on_more_gpus_resumes_with_the_states_of_the_gpus_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Saved where one more GPU was visible than here: the visible devices get their recorded
    states, the extra one is dropped with a warning naming it (``set_rng_state_all`` raised an
    untyped error on the missing device)."""
    visible = torch.cuda.device_count()
    generator = torch.Generator(device="cuda")
    states = []
    for seed in range(visible + 1):
        generator.manual_seed(1000 + seed)
        states.append(generator.get_state())
    root = _saved_with_cuda_states(tmp_path, monkeypatch, states)
    torch.cuda.manual_seed_all(0)
    with pytest.warns(UserWarning, match=rf"states of devices {visible}\.\.{visible} are dropped"):
        fastckpt.TrainingStrategy.load_checkpoint(root, training_fn=support.training_fn)
    for device in range(visible):
        assert torch.equal(torch.cuda.get_rng_state(device), states[device])
