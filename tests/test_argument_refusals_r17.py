"""Front-door arguments that were taken for something else than asked are refused, typed,
naming the argument, before anything is written (round 17's hostile-argument findings)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

import fastckpt
import fastckpt.dcp
import training_support as support
from cli_support import cli_runner

__all__ = ["cli_runner"]  # a fixture used by name below

cli_runner = pytest.fixture(cli_runner)


def _model() -> torch.nn.Module:
    return torch.nn.Linear(2, 2)


def test_one_fallback_root_given_as_a_string_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: ``fallback_dirs="/.../data"`` was taken character by character, and with the
    root missing, a folder ``a`` in the working directory was loaded instead of ``data``."""
    monkeypatch.chdir(tmp_path)
    fastckpt.save_checkpoint("a", models={"m": (_model(), None)})  # an unrelated ./a
    data = str(tmp_path / "data")
    fastckpt.save_checkpoint(data, models={"m": (_model(), None)})
    missing = str(tmp_path / "missing")
    with pytest.raises(TypeError, match=r"fallback_dirs must be a list of paths.*\[.*data"):
        fastckpt.load_checkpoint(missing, fallback_dirs=data)
    for call in (
        fastckpt.TrainingStrategy.load_checkpoint,
        fastckpt.TrainingStrategy.resume_or_start,
    ):
        args: tuple[Any, ...] = (
            (missing,)
            if call is fastckpt.TrainingStrategy.load_checkpoint
            else (missing, lambda: None)
        )
        with pytest.raises(TypeError, match="fallback_dirs must be a list of paths"):
            call(*args, fallback_dirs=data)
    assert fastckpt.load_checkpoint(missing, fallback_dirs=[data])["restored_from"]["path"] == data


def test_an_empty_checkpoint_path_is_refused_not_taken_for_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: ``""`` (a setting left unset) saved into, listed and pruned the working
    directory: ``prune("", 1)`` deleted index 0 of a root the job happened to run in."""
    monkeypatch.chdir(tmp_path)
    fastckpt.save_checkpoint(".", models={"m": (_model(), None)})
    fastckpt.save_checkpoint(".", models={"m": (_model(), None)})
    before = sorted(os.listdir(tmp_path))
    strategy = support.new_strategy([], 1)
    calls = {
        "save_checkpoint": lambda: fastckpt.save_checkpoint("", models={"m": (_model(), None)}),
        "load_checkpoint": lambda: fastckpt.load_checkpoint(""),
        "prune": lambda: fastckpt.prune("", 1),
        "list_checkpoints": lambda: fastckpt.list_checkpoints(""),
        "verify": lambda: fastckpt.verify(""),
        "CheckpointHook": lambda: fastckpt.CheckpointHook("", step_interval=1),
        "TrainingStrategy.save_checkpoint": lambda: strategy.save_checkpoint(""),
        "CheckpointManager.save": lambda: fastckpt.CheckpointManager(
            fastckpt.CheckpointManager.Config.with_sync_save()
        ).save("", {"x": torch.ones(1)}),
        "CheckpointManager.load": lambda: fastckpt.CheckpointManager().load(""),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match=f"{name}: the checkpoint path is empty"):
            call()
    for bad in (None, 3, ["x"], b"x"):
        with pytest.raises(TypeError, match="save_checkpoint: the checkpoint path must be"):
            fastckpt.save_checkpoint(bad, models={"m": (_model(), None)})  # type: ignore[arg-type]
    assert sorted(os.listdir(tmp_path)) == before
    assert [c["index"] for c in fastckpt.list_checkpoints(".")] == [0, 1]


def test_scheduler_kwargs_without_a_scheduler_class_are_refused() -> None:
    """Before: accepted, and no scheduler was built (the learning rate never moved)."""
    with pytest.raises(ValueError, match=r"scheduler_kwargs .* without scheduler_cls"):
        fastckpt.OptimizerConfig(torch.optim.SGD, {"lr": 0.1}, None, {"step_size": 1})
    with pytest.raises(TypeError, match=r"OptimizerConfig.optimizer_cls must be a class"):
        fastckpt.OptimizerConfig(None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"OptimizerConfig.optimizer_kwargs must be a dict"):
        fastckpt.OptimizerConfig(torch.optim.SGD, [("lr", 0.1)])  # type: ignore[arg-type]
    fastckpt.OptimizerConfig(torch.optim.SGD, {"lr": 0.1}, None, {})  # no kwargs: fine


def test_strict_that_is_not_a_bool_is_refused(tmp_path: Path) -> None:
    """Before: ``strict="no"`` acted as strict and ``strict=0`` / None as lenient."""
    manager = fastckpt.CheckpointManager(fastckpt.CheckpointManager.Config.with_sync_save())
    manager.save(tmp_path / "c0", {"step": 3})
    for value in ("no", 0, None):
        with pytest.raises(TypeError, match=r"CheckpointManager.load: strict must be a bool"):
            manager.load(tmp_path / "c0", {"step": 0}, strict=value)  # type: ignore[arg-type]
    manager.close()
    fastckpt.dcp.save_state(tmp_path / "s", {"x": torch.ones(2)})
    with pytest.raises(TypeError, match="load_state: strict must be a bool"):
        fastckpt.dcp.load_state(tmp_path / "s", {"x": torch.zeros(2)}, strict="no")  # type: ignore[arg-type]


def test_strategy_arguments_of_the_wrong_kind_are_refused_naming_them(tmp_path: Path) -> None:
    """Before: ``'NoneType' object is not iterable`` and the like, naming nothing."""
    config = fastckpt.OptimizerConfig(torch.optim.SGD, {"lr": 0.1})
    cases: dict[str, Any] = {
        "models must be an nn.Module": lambda: fastckpt.TrainingStrategy(None, config),
        "models: 1 -> Linear": lambda: fastckpt.TrainingStrategy({1: _model()}, config),
        "optimizers must be": lambda: fastckpt.TrainingStrategy(_model(), "SGD"),
        "hooks must be a list": lambda: fastckpt.TrainingStrategy(_model(), config, hooks=None),
    }
    for message, call in cases.items():
        with pytest.raises(TypeError, match=message):
            call()
    strategy = support.new_strategy([], 1)
    with pytest.raises(TypeError, match="node_local must be a bool"):
        strategy.save_checkpoint(tmp_path / "root", node_local="no")  # type: ignore[arg-type]
    assert not (tmp_path / "root").exists()


def test_the_cli_refuses_an_empty_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cli_runner: Any
) -> None:
    """Before: ``fastckpt promote root ''`` promoted into the working directory ("promoted
    index(es) 0, 1 of root to .")."""
    root = tmp_path / "root"
    fastckpt.save_checkpoint(root, models={"m": (_model(), None)})
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    for argv in (("promote", root, ""), ("prune", "", "--keep-last", "1"), ("verify", "")):
        status, _, err = cli_runner(*argv)
        assert status == 2 and "an empty path" in err, (argv, err)
    assert os.listdir(work) == []


def test_a_recipe_recorded_with_scheduler_kwargs_and_no_scheduler_still_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Earlier versions accepted ``OptimizerConfig(cls, kwargs, None, scheduler_kwargs)`` and
    recorded it. Review: the first version of the refusal made such a checkpoint fail to
    load ("strategy.json ... malformed"): an intact checkpoint reported damaged. It loads,
    as it did: no scheduler (none was ever built)."""
    from fastckpt.training.strategy import OptimizerConfig

    monkeypatch.setattr(OptimizerConfig, "__post_init__", lambda self: None)  # earlier code
    config = OptimizerConfig(torch.optim.SGD, {"lr": 0.1}, None, {"step_size": 1})
    strategy = fastckpt.TrainingStrategy(
        support.DropoutMLP(p=0.0), config, training_fn=support.training_fn, num_steps=1
    )
    strategy.save_checkpoint(tmp_path / "root")
    monkeypatch.undo()
    loaded = fastckpt.load_checkpoint(tmp_path / "root")
    assert loaded["strategy"] is not None and loaded["strategy"].schedulers == {}
    resumed = fastckpt.TrainingStrategy.load_checkpoint(
        tmp_path / "root", training_fn=support.training_fn
    )
    assert resumed.optimizer_configs["main"].scheduler_kwargs is None


def test_fallback_dirs_given_as_an_iterator_are_not_used_up_by_their_check(
    tmp_path: Path,
) -> None:
    """Review: the check of ``fallback_dirs`` used up an iterator (``map(Path, dirs)``), and
    ``resume_or_start`` then started afresh beside the durable tier's committed checkpoint."""
    durable = tmp_path / "durable"
    strategy = support.new_strategy([], 1)
    strategy.save_checkpoint(durable)
    fast = tmp_path / "fast-gone"
    resumed = fastckpt.TrainingStrategy.resume_or_start(
        fast,
        lambda: "fresh",
        fallback_dirs=iter([durable]),
        training_fn=support.training_fn,
    )
    assert resumed != "fresh" and resumed.restored_from.index == 0
    loaded = fastckpt.TrainingStrategy.load_checkpoint(
        fast, fallback_dirs=map(Path, [durable]), training_fn=support.training_fn
    )
    assert loaded.restored_from is not None and loaded.restored_from.index == 0


@pytest.mark.parametrize("state", [None, [torch.ones(2)], torch.ones(2)])
def test_a_sharded_state_that_is_not_a_mapping_is_refused_naming_the_argument(
    tmp_path: Path, state: Any
) -> None:
    """Before: ``save_state(path, None)`` raised Python's bare "'NoneType' object is not
    iterable", a list DCP's own flattening error; ``load_state(into=[...])`` an AttributeError."""
    with pytest.raises(fastckpt.InvalidInputError, match=r"save_state: state is a \w+, not a"):
        fastckpt.dcp.save_state(tmp_path / "s", state)
    assert not (tmp_path / "s").exists()
    fastckpt.dcp.save_state(tmp_path / "s", {"x": torch.ones(2)})
    with pytest.raises(fastckpt.InvalidInputError, match="load_state: into is a"):
        fastckpt.dcp.load_state(tmp_path / "s", into=state if state is not None else [1])
    assert torch.equal(fastckpt.dcp.load_state(tmp_path / "s")["x"], torch.ones(2))
