"""Every example of the reference training-checkpoints guide, with ``nvalchemi.training``
replaced by ``fastckpt.training`` and the guide's ``...`` filled with a small real job.

One deliberate difference (SPEC §5): a recorded training-function path is code named by a
file, so loading it needs a registration (``register_trusted``) or ``trusted=``; the examples
that reload without ``training_fn=`` register it first.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from fastckpt.checkpoint.specs import register_trusted
from fastckpt.training import (
    CheckpointHook,
    EMAHook,
    OptimizerConfig,
    TrainingStrategy,
    create_model_spec,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
import training_support as support

train_loader = support.loader()
training_fn = support.training_fn


def job(hooks: list[Any] = (), num_steps: int = 4) -> dict[str, Any]:  # type: ignore[assignment]
    """The guide's ``TrainingStrategy(...)`` arguments."""
    return {
        "models": support.DropoutMLP(),
        "optimizers": OptimizerConfig(torch.optim.Adam, {"lr": 1e-2}),
        "training_fn": training_fn,
        "hooks": list(hooks),
        "num_steps": num_steps,
    }


@pytest.fixture
def registered(monkeypatch: pytest.MonkeyPatch) -> None:
    import fastckpt.checkpoint.trust as trust

    monkeypatch.setattr(trust, "_TRUSTED_PATHS", set(trust._TRUSTED_PATHS))
    monkeypatch.setattr(trust, "_TRUSTED_OBJECTS", list(trust._TRUSTED_OBJECTS))
    register_trusted(training_fn)


def test_manual_save_and_restart(tmp_path: Path) -> None:
    checkpoint_dir = str(tmp_path / "runs/example/checkpoints")
    strategy = TrainingStrategy(**job())
    strategy.run(train_loader)
    checkpoint_index = strategy.save_checkpoint(checkpoint_dir)
    assert checkpoint_index == 0

    strategy = TrainingStrategy.load_checkpoint(
        checkpoint_dir, map_location="cpu", training_fn=training_fn
    )
    strategy.num_steps = 8
    strategy.run(train_loader)
    assert strategy.save_checkpoint(checkpoint_dir) == 1
    assert strategy.step_count == 8


def test_restart_from_an_older_index(tmp_path: Path, registered: None) -> None:
    strategy = TrainingStrategy(**job(num_steps=1))
    for steps in range(1, 6):
        strategy.num_steps = steps
        strategy.run(train_loader)
        strategy.save_checkpoint(tmp_path)
    strategy = TrainingStrategy.load_checkpoint(tmp_path, checkpoint_index=3)
    assert strategy.step_count == 4


def test_importable_training_function_is_not_passed_again(tmp_path: Path, registered: None) -> None:
    supervised_step = support.training_fn  # lives in an importable module
    strategy = TrainingStrategy(**{**job(), "training_fn": supervised_step})
    strategy.save_checkpoint(tmp_path)
    restored = TrainingStrategy.load_checkpoint(tmp_path)
    assert restored.training_fn is supervised_step


def test_closure_training_function_is_supplied_at_load(tmp_path: Path) -> None:
    def build_loss(scale: float) -> Any:
        def training_fn(model: nn.Module, batch: Any) -> torch.Tensor:
            return scale * support.training_fn(model, batch)

        return training_fn

    TrainingStrategy(**{**job(), "training_fn": build_loss(1.0)}).save_checkpoint(tmp_path)
    restored = TrainingStrategy.load_checkpoint(tmp_path, training_fn=build_loss(scale=0.5))
    restored.num_steps = 2
    restored.run(train_loader)


def test_hooks_are_supplied_at_load(tmp_path: Path) -> None:
    checkpoint_dir = tmp_path / "ckpt"
    first = TrainingStrategy(**job())
    first.run(train_loader)
    first.save_checkpoint(checkpoint_dir)
    strategy = TrainingStrategy.load_checkpoint(
        checkpoint_dir,
        training_fn=training_fn,
        hooks=[CheckpointHook(checkpoint_dir, step_interval=2)],
    )
    strategy.num_steps = 8
    strategy.run(train_loader)
    assert strategy.hooks[0].last_checkpoint_index == 2  # steps 6 and 8 -> indices 1, 2


def test_restartable_hook_state(tmp_path: Path) -> None:
    checkpoint_dir = str(tmp_path)
    ema = EMAHook(model_key="main", decay=0.999)
    strategy = TrainingStrategy(**job([ema, CheckpointHook(checkpoint_dir, step_interval=2)]))
    strategy.run(train_loader)

    restored_ema = EMAHook(model_key="main", decay=0.999)
    restored = TrainingStrategy.load_checkpoint(
        checkpoint_dir,
        training_fn=training_fn,
        hooks=[restored_ema, CheckpointHook(checkpoint_dir, step_interval=2)],
    )
    assert restored.step_count == 4
    assert all(torch.equal(restored_ema.shadow[k], v) for k, v in ema.shadow.items())

    # In place, into a strategy the script already built.
    in_place_ema = EMAHook(model_key="main", decay=0.999)
    restored = TrainingStrategy(
        **job([in_place_ema, CheckpointHook(checkpoint_dir, step_interval=2)])
    )
    restored.restore_checkpoint(checkpoint_dir)
    assert all(torch.equal(in_place_ema.shadow[k], v) for k, v in ema.shadow.items())


def test_periodic_checkpoint_hook(tmp_path: Path) -> None:
    strategy = TrainingStrategy(**job([CheckpointHook(tmp_path, step_interval=1)]))
    strategy.run(train_loader)
    assert (tmp_path / "manifest.json").exists()


def test_model_reconstruction_spec() -> None:
    spec = create_model_spec(torch.nn.Linear, in_features=16, out_features=1)
    model = spec.build()
    assert isinstance(model, nn.Linear) and model.in_features == 16


class FactoryWrapper(nn.Module):
    """Stands in for the guide's MACEWrapper: built by a factory that takes ``device``."""

    calls: list[dict[str, Any]] = []  # noqa: RUF012

    def __init__(self, width: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    @classmethod
    def from_checkpoint(
        cls,
        checkpoint_path: str,
        device: torch.device | None = None,
        dtype: torch.dtype = torch.float32,
        enable_cueq: bool = False,
    ) -> FactoryWrapper:
        cls.calls.append({"path": checkpoint_path, "device": device, "cueq": enable_cueq})
        model = cls(width=4, dtype=dtype).to(device or "cpu")
        model._spec = create_model_spec(
            cls.from_checkpoint,
            checkpoint_path=checkpoint_path,
            dtype=dtype,
            enable_cueq=enable_cueq,
        )
        return model

    def checkpoint_spec(self) -> Any:
        return self._spec


def test_factory_model_pattern(tmp_path: Path) -> None:
    model = FactoryWrapper.from_checkpoint(
        "small-0b", device=torch.device("cpu"), dtype=torch.float32, enable_cueq=True
    )
    ema = EMAHook(model_key="main", decay=0.999)
    strategy = TrainingStrategy(**{**job([ema]), "models": model})
    strategy.run(train_loader)
    strategy.save_checkpoint(tmp_path)

    FactoryWrapper.calls.clear()
    restored_ema = EMAHook(model_key="main", decay=0.999)
    restored = TrainingStrategy.load_checkpoint(
        tmp_path, map_location=torch.device("cpu"), hooks=[restored_ema], training_fn=training_fn
    )
    assert FactoryWrapper.calls == [  # checked on the meta device first, then built
        {"path": "small-0b", "device": torch.device("meta"), "cueq": True},
        {"path": "small-0b", "device": torch.device("cpu"), "cueq": True},
    ]
    assert torch.equal(restored.models["main"].net.weight, model.net.weight)
    assert restored_ema.num_updates == ema.num_updates
