"""Incremental saves never record stale bytes: "unchanged" is proven from content.

torch's version counter does not move for fused optimizers, ``.data`` writes, numpy views,
DLPack, storage writes or ctypes, so a save that trusted it recorded the previous save's
bytes (issue 22, finding 1: a resumed run reported step 6 with step-2 weights, and the
checkpoint verified). Here every way of changing a tensor is applied between two saves of a
root (``save_checkpoint``), of a sync and an async ``CheckpointManager`` and of a
``TrainingStrategy`` with an async ``CheckpointHook``; the second checkpoint must load
bitwise equal to the state at the second save, and the tensors no way touched must still be
referenced, not rewritten (the byte saving stays).
"""

from __future__ import annotations

import copy
import ctypes
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import fastckpt
import training_support as support
from fastckpt import CheckpointManager
from fastckpt.container.links import read_references
from fastckpt.format.records import read_commit_record
from fastckpt.training import CheckpointHook


class Pair(nn.Module):
    """``moving`` is what each way changes; ``still`` (most bytes) is never touched."""

    def __init__(self) -> None:
        super().__init__()
        self.moving = nn.Linear(16, 16)
        self.still = nn.Linear(64, 64)
        self.still.requires_grad_(False)


def _optimizer(model: Pair, name: str) -> torch.optim.Optimizer:
    params = list(model.moving.parameters())
    factories: dict[str, Callable[[], torch.optim.Optimizer]] = {
        "adam_fused": lambda: torch.optim.Adam(params, lr=0.1, fused=True),
        "adamw_fused": lambda: torch.optim.AdamW(params, lr=0.1, fused=True),
        "sgd_fused": lambda: torch.optim.SGD(params, lr=0.1, momentum=0.9, fused=True),
        "adam_foreach": lambda: torch.optim.Adam(params, lr=0.1, foreach=True),
        "adamw_plain": lambda: torch.optim.AdamW(params, lr=0.1, foreach=False),
        "sgd_plain": lambda: torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=False),
    }
    return factories.get(name, factories["sgd_plain"])()


def _step(model: Pair, optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad()
    model.moving(torch.randn(4, 16)).square().mean().backward()
    optimizer.step()


def _weight(model: Pair) -> torch.Tensor:
    return model.moving.weight


def _numpy(model: Pair, _: Any) -> None:
    _weight(model).detach().numpy()[0, 0] += 1.0


def _dlpack(model: Pair, _: Any) -> None:
    view = np.from_dlpack(_weight(model).detach())
    view[1, 1] = -7.5


def _storage(model: Pair, _: Any) -> None:
    _weight(model).untyped_storage()[0:4] = 0x41


def _ctypes(model: Pair, _: Any) -> None:
    ctypes.memset(_weight(model).data_ptr() + 8, 0x3F, 4)


def _data_in_place(model: Pair, _: Any) -> None:
    _weight(model).data.mul_(2)


def _in_place(model: Pair, _: Any) -> None:
    with torch.no_grad():
        _weight(model).add_(1)


def _copy(model: Pair, _: Any) -> None:
    with torch.no_grad():
        _weight(model).copy_(torch.full_like(_weight(model), 0.25))


def _load_state_dict(model: Pair, _: Any) -> None:
    state = {k: v.clone() + 1 for k, v in model.moving.state_dict().items()}
    model.moving.load_state_dict(state)


def _data_assignment(model: Pair, _: Any) -> None:
    _weight(model).data = torch.randn(16, 16)


def _new_tensor(model: Pair, optimizer: torch.optim.Optimizer) -> None:
    old = model.moving.weight
    new = nn.Parameter(torch.randn(16, 16))
    model.moving.weight = new
    for group in optimizer.param_groups:
        group["params"] = [new if p is old else p for p in group["params"]]
    if old in optimizer.state:
        optimizer.state[new] = optimizer.state.pop(old)


def _same_bytes_again(model: Pair, _: Any) -> None:
    """A bumped counter, identical bytes: rewritten or referenced, either is right."""
    with torch.no_grad():
        _weight(model).add_(0)


def _nothing(model: Pair, _: Any) -> None:
    """No change at all: must be referenced."""


def _optimizer_step(model: Pair, optimizer: torch.optim.Optimizer) -> None:
    _step(model, optimizer)


OPTIMIZERS = ["adam_fused", "adamw_fused", "sgd_fused", "adam_foreach", "adamw_plain", "sgd_plain"]

#: way -> (change, whether ``moving.weight`` must differ from the first save)
WAYS: dict[str, tuple[Callable[[Pair, Any], None], bool]] = {
    **{name: (_optimizer_step, True) for name in OPTIMIZERS},
    "data_in_place": (_data_in_place, True),
    "numpy_view": (_numpy, True),
    "dlpack": (_dlpack, True),
    "untyped_storage": (_storage, True),
    "ctypes": (_ctypes, True),
    "in_place": (_in_place, True),
    "copy_": (_copy, True),
    "load_state_dict": (_load_state_dict, True),
    "data_assignment": (_data_assignment, True),
    "new_tensor_at_key": (_new_tensor, True),
    "same_bytes_again": (_same_bytes_again, False),
    "nothing": (_nothing, False),
}


def _setup(way: str) -> tuple[Pair, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Pair()
    optimizer = _optimizer(model, way)
    _step(model, optimizer)  # optimizer state exists before the first save
    return model, optimizer


def _expected(model: Pair, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "optimizer": copy.deepcopy(optimizer.state_dict()),
    }


def _assert_same_tree(actual: Any, expected: Any, where: str) -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), where
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, where
        assert torch.equal(
            actual.view(-1).view(torch.uint8), expected.view(-1).view(torch.uint8)
        ), f"{where}: the checkpoint holds other bytes than the state at its save"
    elif isinstance(expected, dict):
        assert set(actual) == set(expected), where
        for key in expected:
            _assert_same_tree(actual[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, list | tuple):
        assert len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            _assert_same_tree(a, e, f"{where}[{i}]")
    else:
        assert actual == expected, where


def _check_change_happened(way: str, first: dict[str, Any], second: dict[str, Any]) -> None:
    if WAYS[way][1]:
        assert not torch.equal(first["model"]["moving.weight"], second["model"]["moving.weight"])


@pytest.mark.parametrize("way", sorted(WAYS))
def test_a_root_records_every_change(tmp_path: Path, way: str) -> None:
    model, optimizer = _setup(way)
    save = lambda: fastckpt.save_checkpoint(  # noqa: E731
        tmp_path, models={"m": (model, None)}, optimizers={"o": (optimizer, None)}
    )
    first = _expected(model, optimizer)
    save()
    WAYS[way][0](model, optimizer)
    second = _expected(model, optimizer)
    _check_change_happened(way, first, second)
    index = save()
    loaded = fastckpt.load_checkpoint(tmp_path, index)
    _assert_same_tree(loaded["models"]["m"]["model"].state_dict(), second["model"], "model")
    _assert_same_tree(
        loaded["models"]["m"]["optimizers"]["o"]["optimizer"].state_dict()["state"],
        second["optimizer"]["state"],
        "optimizer",
    )
    refs = json.loads((tmp_path / str(index) / "refs.json").read_text())["refs"]
    assert {"still.weight", "still.bias"} <= set(refs["models/m.safetensors"])
    if WAYS[way][1]:
        assert "moving.weight" not in refs["models/m.safetensors"]
    assert fastckpt.verify(tmp_path).ok


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("way", sorted(WAYS))
def test_a_manager_records_every_change(tmp_path: Path, way: str, mode: str) -> None:
    config = (
        CheckpointManager.Config.with_sync_save()
        if mode == "sync"
        else CheckpointManager.Config.with_async_save()
    )
    model, optimizer = _setup(way)
    with CheckpointManager(config) as manager:

        def save(name: str) -> None:
            future = manager.save(tmp_path / name, {"model": model, "optim": optimizer})
            if future is not None:
                future.result()

        first = _expected(model, optimizer)
        save("a")
        with manager.lock():
            WAYS[way][0](model, optimizer)
        second = _expected(model, optimizer)
        _check_change_happened(way, first, second)
        save("b")
        loaded = manager.load(tmp_path / "b")
    _assert_same_tree(loaded["model"], second["model"], "model")
    _assert_same_tree(loaded["optim"]["state"], second["optimizer"]["state"], "optimizer")
    record = read_commit_record(tmp_path / "b")
    linked = set(read_references(record, str(tmp_path / "b")).get("model.safetensors", {}))
    assert {"still.weight", "still.bias"} <= linked
    if WAYS[way][1]:
        assert "moving.weight" not in linked


def test_a_resumed_strategy_with_fused_adamw_holds_the_weights_of_its_step(
    tmp_path: Path,
) -> None:
    """The finding as users met it: an async CheckpointHook saving every 2 steps of a
    strategy trained with fused AdamW; every index must hold its own step's weights."""
    torch.manual_seed(1234)
    seen: dict[int, dict[str, torch.Tensor]] = {}

    def remember(ctx: fastckpt.TrainContext, stage: fastckpt.TrainingStage) -> None:
        if stage is fastckpt.TrainingStage.AFTER_BATCH:
            state = strategy.models["main"].state_dict()
            seen[ctx.step_count] = {k: v.clone() for k, v in state.items()}

    strategy = fastckpt.TrainingStrategy(
        support.DropoutMLP(),
        fastckpt.OptimizerConfig(torch.optim.AdamW, {"lr": 1e-2, "fused": True}),
        training_fn=support.training_fn,
        hooks=[remember, CheckpointHook(tmp_path, step_interval=2, async_save=True)],
        num_steps=6,
    )
    strategy.run(support.loader())
    rows = fastckpt.list_checkpoints(tmp_path)
    assert len(rows) >= 3
    for row in rows:
        resumed = fastckpt.TrainingStrategy.load_checkpoint(tmp_path, row["index"])
        step = resumed.step_count
        weights = resumed.models["main"].state_dict()
        _assert_same_tree(weights, seen[step], f"index {row['index']} (step {step})")


def test_mark_frozen_is_the_one_opt_in_to_trust(tmp_path: Path) -> None:
    """Documented: a marked tensor is referenced without reading its bytes, so a change the
    counter does not see is not saved (the caller promised there would be none); an
    unmarked neighbour changed the same way is saved."""
    torch.manual_seed(0)
    model = Pair()
    fastckpt.mark_frozen(model.still.weight)
    fastckpt.save_checkpoint(tmp_path, models={"m": (model, None)})
    before = model.still.weight.detach().clone()
    model.still.weight.detach().numpy()[0, 0] += 1.0  # breaks the promise
    model.moving.weight.detach().numpy()[0, 0] += 1.0
    index = fastckpt.save_checkpoint(tmp_path, models={"m": (model, None)})
    loaded = fastckpt.load_checkpoint(tmp_path, index)["models"]["m"]["model"].state_dict()
    assert torch.equal(loaded["still.weight"], before)
    assert torch.equal(loaded["moving.weight"], model.moving.weight)


@pytest.mark.parametrize("door", ["root", "manager"])
def test_a_marked_tensor_whose_counter_moved_is_written(tmp_path: Path, door: str) -> None:
    """A frozen backbone swapped for other weights with ``load_state_dict`` (its counter
    moves). Before, the mark was trusted whatever the counter said: the next checkpoint
    referenced the first backbone's bytes, loaded and verified, and held a backbone that was
    no longer the model's. Now the counter is part of the marked tensor's fingerprint."""
    torch.manual_seed(0)
    model = Pair()
    fastckpt.mark_frozen(model.still)
    torch.manual_seed(1)
    other = Pair()

    def save_and_load() -> tuple[dict[str, torch.Tensor], set[str]]:
        """The saved state as loaded, and the names the save referenced (did not write)."""
        if door == "root":
            root = tmp_path / "root"
            index = fastckpt.save_checkpoint(root, models={"m": (model, None)})
            refs = root / str(index) / "refs.json"
            linked = json.loads(refs.read_text())["refs"] if refs.exists() else {}
            state = fastckpt.load_checkpoint(root, index)["models"]["m"]["model"].state_dict()
            return state, set(linked.get("models/m.safetensors", {}))
        path = tmp_path / f"step-{len(list(tmp_path.glob('step-*')))}"
        manager.save(path, {"model": model})
        record = read_commit_record(path)
        linked = read_references(record, str(path)).get("model.safetensors", {})
        return manager.load(path)["model"], set(linked)

    manager = CheckpointManager(CheckpointManager.Config.with_sync_save())
    save_and_load()
    model.still.load_state_dict(other.still.state_dict())
    loaded, referenced = save_and_load()
    for key, value in model.state_dict().items():
        assert torch.equal(loaded[key], value), key
    assert "still.weight" not in referenced
    # An in-place op that leaves the bytes as they were moves the counter too: proven equal
    # by its digest, referenced.
    with torch.no_grad():
        model.still.weight.mul_(1.0)
    loaded, referenced = save_and_load()
    assert {"still.weight", "still.bias"} <= referenced
    # A later save, the backbone untouched since: trusted again, the swapped-in weights.
    model.moving.weight.detach().numpy()[0, 0] += 1.0
    loaded, referenced = save_and_load()
    assert torch.equal(loaded["still.weight"], other.still.weight)
    assert torch.equal(loaded["moving.weight"], model.moving.weight)
    assert {"still.weight", "still.bias"} <= referenced
    manager.close()
