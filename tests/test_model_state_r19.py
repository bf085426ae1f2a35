"""State of a model besides its tensors (round 19's global-state tester).

Training modes of submodules (``module.training``) set after construction come back with
a rebuilt model.

Before, a model rebuilt from its checkpoint had every module in training mode: a frozen
BatchNorm backbone (``model.backbone[1].eval()``, a common fine-tuning setup), a Dropout
switched off or a whole model in evaluation mode was resumed in training mode, so the
resumed run updated those statistics, dropped those activations and differed from the
uninterrupted one, without a word. A model state a component checkpoint cannot store is
refused before the first step, by sync hooks too.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import fastckpt
from cli_support import cli_runner
from fastckpt.checkpoint.modes import apply_modes, recorded_modes
from fastckpt.errors import CheckpointFormatError
from fastckpt.format.records import seal_manifest


class Backbone(nn.Module):
    """A small network with a batch norm and a dropout."""

    def __init__(self, hidden: int = 8) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(4, hidden), nn.BatchNorm1d(hidden), nn.Tanh())
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(self.backbone(x)))


def mse(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return (model(batch) - batch.sum(1, keepdim=True)).square().mean()


def _batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(8, 4, generator=generator) for _ in range(8)]


def _strategy(num_steps: int, hooks: list[object]) -> fastckpt.TrainingStrategy:
    torch.manual_seed(0)
    model = Backbone()
    model.backbone[1].eval()  # frozen batch norm statistics
    model.drop.eval()  # dropout off
    return fastckpt.TrainingStrategy(
        model,
        fastckpt.OptimizerConfig(torch.optim.SGD, {"lr": 0.05}),
        training_fn=mse,
        hooks=hooks,
        num_steps=num_steps,
    )


@pytest.mark.parametrize("async_save", [False, True])
def test_a_run_with_frozen_submodules_resumes_in_their_modes_bit_for_bit(
    tmp_path: Path, async_save: bool
) -> None:
    batches = _batches()
    uninterrupted = _strategy(8, [])
    uninterrupted.run(batches)
    _strategy(4, [fastckpt.CheckpointHook(tmp_path, step_interval=4, async_save=async_save)]).run(
        batches
    )
    resumed = fastckpt.TrainingStrategy.load_checkpoint(tmp_path, training_fn=mse)
    model = resumed.models["main"]
    assert model.training and model.backbone.training and model.head.training
    assert not model.backbone[1].training and not model.drop.training
    resumed.num_steps = 8
    resumed.run(batches)
    expected = uninterrupted.models["main"].state_dict()
    for name, value in model.state_dict().items():
        assert torch.equal(value, expected[name]), name


def test_only_modes_that_differ_from_the_parents_are_recorded(tmp_path: Path) -> None:
    model = Backbone()
    assert recorded_modes(model) == {}
    model.eval()
    assert recorded_modes(model) == {"": False}
    model.head.train()
    assert recorded_modes(model) == {"": False, "head": True}
    fastckpt.save_checkpoint(tmp_path, models={"main": model}, incremental=False)
    entry = json.loads((tmp_path / "manifest.json").read_text())["checkpoints"]["0"]
    assert entry["modes"] == {"main": {"": False, "head": True}}
    rebuilt = fastckpt.load_checkpoint(tmp_path, trusted=[Backbone])["models"]["main"]["model"]
    assert {name: m.training for name, m in rebuilt.named_modules()} == {
        name: m.training for name, m in model.named_modules()
    }


def test_a_recorded_mode_that_is_no_bool_is_refused(tmp_path: Path) -> None:
    model = Backbone().eval()
    fastckpt.save_checkpoint(tmp_path, models={"main": model}, incremental=False)
    manifest = tmp_path / "manifest.json"
    for modes in ({"": "no"}, ["", False]):
        document = json.loads(manifest.read_text())
        document["checkpoints"]["0"]["modes"]["main"] = modes
        seal_manifest(document)
        manifest.write_text(json.dumps(document))
        with pytest.raises(CheckpointFormatError, match=r"modes.main"):
            fastckpt.load_checkpoint(tmp_path, trusted=[Backbone])


def test_a_module_added_after_construction_keeps_the_checkpoint_loadable(tmp_path: Path) -> None:
    """Review of the first version: a mode (or layout) recorded for a module the recipe does
    not build (``model.extra = nn.Dropout().eval()``, attached after construction, which the
    recipe proof allows) made every rebuild refuse the committed checkpoint ("names modules
    ['extra'], which the model does not have"). Now it loads, with a warning naming it."""
    model = Backbone()
    model.backbone[1].eval()
    model.extra = nn.Dropout().eval()
    model.register_buffer("cache", torch.zeros(3, 5).t(), persistent=False)
    fastckpt.save_checkpoint(tmp_path, models={"main": model}, incremental=False)
    with pytest.warns(UserWarning, match=r"modes.main: records the training mode of modules"):
        loaded = fastckpt.load_checkpoint(tmp_path, trusted=[Backbone])
    rebuilt = loaded["models"]["main"]["model"]
    assert not rebuilt.backbone[1].training and rebuilt.backbone[0].training
    assert not hasattr(rebuilt, "extra")
    with pytest.warns(UserWarning, match="which the rebuilt model does not have"):
        apply_modes(Backbone(), {"nothing.here": False}, "manifest.json: modes.main")


def test_a_mode_changed_between_two_checkpoints_is_a_difference(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = Backbone()
    fastckpt.save_checkpoint(tmp_path / "a", models={"main": (model, None)})
    model.backbone[1].eval()
    fastckpt.save_checkpoint(tmp_path / "b", models={"main": (model, None)})
    code, out, _ = cli_runner(capsys)("diff", tmp_path / "a", tmp_path / "b")
    assert code == 1 and "modes:main.backbone.1" in out


@pytest.mark.parametrize("async_save", [False, True])
def test_a_model_state_a_checkpoint_cannot_store_is_refused_before_the_first_step(
    tmp_path: Path, async_save: bool
) -> None:
    """Before: the sync hook trained ``step_interval`` steps, then the run died at its first
    save (the async hook's staging prewarm refused it before the first step)."""
    trained: list[int] = []
    strategy = fastckpt.TrainingStrategy(
        DictExtraState(),
        fastckpt.OptimizerConfig(torch.optim.SGD, {"lr": 0.01}),
        training_fn=mse,
        num_steps=10,
        hooks=[
            lambda ctx, stage: stage is fastckpt.TrainingStage.AFTER_BATCH and trained.append(1),
            fastckpt.CheckpointHook(tmp_path, step_interval=5, async_save=async_save),
        ],
    )
    with pytest.raises(TypeError, match="'_extra_state' is a dict"):
        strategy.run(_batches())
    assert trained == []


class CountedInExtraState(nn.Module):
    """A counter set in forward, saved and put back through a tensor extra state."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.seen = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen += 1
        return self.lin(x)

    def get_extra_state(self) -> torch.Tensor:
        return torch.tensor([self.seen])

    def set_extra_state(self, state: torch.Tensor) -> None:
        self.seen = int(state[0])


class DictExtraState(CountedInExtraState):
    """The same counter in a dict extra state (not storable in a component file)."""

    def get_extra_state(self) -> dict[str, int]:  # type: ignore[override]
        return {"seen": self.seen}

    def set_extra_state(self, state: dict[str, int]) -> None:  # type: ignore[override]
        self.seen = state["seen"]


class OwnGenerator(nn.Module):
    """Noise drawn from a generator the module holds."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.gen = torch.Generator().manual_seed(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x + 0.1 * torch.randn(x.shape, generator=self.gen))


def _run_collecting_warnings(tmp_path: Path, model: nn.Module) -> list[str]:
    with pytest.warns() as caught:
        warnings.warn("sentinel", UserWarning, stacklevel=1)
        fastckpt.TrainingStrategy(
            model,
            fastckpt.OptimizerConfig(torch.optim.SGD, {"lr": 0.01}),
            training_fn=mse,
            num_steps=4,
            hooks=[fastckpt.CheckpointHook(tmp_path, step_interval=4, async_save=False)],
        ).run(_batches())
    return [str(w.message) for w in caught if str(w.message) != "sentinel"]


def test_attributes_a_module_may_keep_in_its_extra_state_are_warned_about_as_such(
    tmp_path: Path,
) -> None:
    """Before: a counter saved and put back through get_extra_state()/set_extra_state() was
    reported lost, with advice to set it again after loading that overwrote correct state.
    fastckpt cannot tell what an extra state holds without running the module's own code at
    every save (review 3 of a version that replayed it: side effects such as reseeding the
    global RNG, and 2.5x the proof's time), so such attributes are named as kept unless the
    extra state holds them."""
    messages = [m for m in _run_collecting_warnings(tmp_path, CountedInExtraState()) if "seen" in m]
    assert messages and all("unless its own get_extra_state() keeps it" in m for m in messages)
    rebuilt = fastckpt.TrainingStrategy.load_checkpoint(tmp_path, training_fn=mse)
    assert rebuilt.models["main"].seen == 4


def test_a_module_holding_its_own_random_generator_is_warned_about(tmp_path: Path) -> None:
    """Before: a module's own torch.Generator restarted from its seed on resume (the resumed
    run differed) without a word; fastckpt saves the global generators only."""
    messages = _run_collecting_warnings(tmp_path, OwnGenerator())
    assert any("random generators of its own (<root>.gen)" in m for m in messages), messages


def test_a_wrapped_modules_mode_is_recorded_not_its_wrappers() -> None:
    """Review of the first version: a wrapper and the module it wraps share a canonical name,
    and the wrapper's mode was recorded: ``checkpoint_wrapper(block).eval()`` with the block
    itself training came back in evaluation mode."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = Backbone()
    model.backbone = checkpoint_wrapper(model.backbone)
    model.backbone.training = False  # the wrapper only: the wrapped block trains
    assert recorded_modes(model) == {}
    model.backbone._checkpoint_wrapped_module[1].eval()
    assert recorded_modes(model) == {"backbone.1": False}


class GeneratorInExtraState(OwnGenerator):
    """Keeps its generator's state in its extra state, as the warning advises."""

    def get_extra_state(self) -> torch.Tensor:
        return self.gen.get_state()

    def set_extra_state(self, state: torch.Tensor) -> None:
        self.gen.set_state(state)


def test_a_generator_kept_in_the_extra_state_is_not_warned_about(tmp_path: Path) -> None:
    messages = _run_collecting_warnings(tmp_path, GeneratorInExtraState())
    assert not [m for m in messages if "random generators" in m], messages
