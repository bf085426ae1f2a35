"""Stateful objects (``state_dict()`` / ``load_state_dict()``) in saved state and templates.

The first tests exercise :mod:`fastckpt.manager.stateful` directly; the ``test_manager_*`` tests go
through ``CheckpointManager``'s public API (``prepare_save`` in ``save``, ``check_template`` +
``restore`` in ``load``).
"""

from __future__ import annotations

import collections
import types
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import fastckpt
from fastckpt.errors import CheckpointMismatchError
from fastckpt.manager.stateful import check_template, is_stateful, prepare_save, restore


class Counter:
    """A user class following the convention."""

    def __init__(self) -> None:
        self.count = 0
        self.history = torch.zeros(3)

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count, "history": self.history}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count = state["count"]
        self.history = state["history"]


class SaveOnly:
    def state_dict(self) -> dict[str, Any]:
        return {}


def trained(seed: int = 0, steps: int = 3) -> tuple[Any, Any, Any, Counter]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    counter = Counter()
    for _ in range(steps):
        model(torch.randn(5, 4)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        counter.count += 1
        counter.history += 1
    return model, optimizer, scheduler, counter


# --------------------------------------------------------------------------- the module itself


def test_stateful_objects_are_recognized() -> None:
    model, optimizer, scheduler, counter = trained(steps=0)
    assert all(is_stateful(obj) for obj in (model, optimizer, scheduler, counter))
    for other in (torch.nn.Linear, {"a": 1}, torch.zeros(2), SaveOnly(), 3, None):
        assert not is_stateful(other)


def test_prepare_save_puts_state_dicts_in_place_of_objects() -> None:
    model, optimizer, _, counter = trained()
    prepared = prepare_save({"model": model, "nested": [optimizer, (counter, 5)]}, "")
    assert set(prepared["model"]) == set(model.state_dict())
    assert prepared["model"]["0.weight"].data_ptr() == model[0].weight.data_ptr()  # no copy
    assert prepared["nested"][0]["param_groups"][0]["lr"] == optimizer.param_groups[0]["lr"]
    assert prepared["nested"][1] == ({"count": 3, "history": counter.history}, 5)


class _Config(dict):  # type: ignore[type-arg]
    def lr(self) -> Any:
        return self["lr"]


class _History(list):  # type: ignore[type-arg]
    pass


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"layer": object()}, r"model\.layer: cannot checkpoint a builtins\.object; .*state_dict"),
        ({"sub": [1, SaveOnly()]}, r"model\.sub\.1: .*no load_state_dict"),
        ({"ok": {(1, 2): 3}}, r"model\.ok\.\(1, 2\): dict keys"),
        # before: saved, and back as a plain dict whose missing keys raise KeyError
        ({"counts": collections.defaultdict(int, a=1)}, r"model\.counts: .*defaultdict.*missing"),
        ({"seen": collections.Counter("aab")}, r"model\.seen: cannot checkpoint a Counter"),
    ],
)
def test_prepare_save_names_the_full_key_path(value: Any, message: str) -> None:
    with pytest.raises(TypeError, match=message):
        prepare_save(value, "model")


class _OddState:
    """A stateful object whose state is a dict subclass: it goes back to its own
    load_state_dict, which gets a plain dict (accepted)."""

    def state_dict(self) -> dict[str, Any]:
        return _Config(lr=0.5)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded = state


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (_Config(lr=0.1), r"model\.x: a .*_Config is saved as its items .*plain dict"),
        (_History([1]), r"model\.x: a .*_History is saved as its items .*plain list"),
        (types.MappingProxyType({"a": 1}), r"model\.x: a .*mappingproxy .*plain dict"),
    ],
)
def test_other_mappings_and_lists_load_back_plain_and_say_so_once(
    value: Any, message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: saved, and back as a plain dict / list (its methods and type gone) without a
    word, while an int subclass is refused for that reason. Refusing them broke common
    state (Lightning's AttributeDict hparams): they are saved, with a warning once per type."""
    from fastckpt.manager import stateful

    monkeypatch.setattr(stateful, "_WARNED_PLAIN", set())
    with pytest.warns(UserWarning, match=message):
        assert prepare_save({"x": value}, "model") == {
            "x": list(value) if isinstance(value, list) else dict(value)
        }
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once per type
        prepare_save({"x": value}, "model")


def test_an_ordered_dict_and_a_state_dicts_own_subclasses_are_saved_without_a_word() -> None:
    ordered = collections.OrderedDict(w=torch.ones(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert prepare_save({"m": ordered}, "") == {"m": {"w": ordered["w"]}}
        assert prepare_save({"o": _OddState()}, "") == {"o": {"lr": 0.5}}


def test_check_template_refuses_what_a_load_would_ignore() -> None:
    model, optimizer, _, counter = trained(steps=0)
    check_template({"m": model, "o": [optimizer, counter], "t": torch.zeros(1), "x": None})
    with pytest.raises(TypeError, match=r"run\.opt\.1: cannot load into a builtins\.object"):
        check_template({"opt": [optimizer, object()]}, "run")
    with pytest.raises(TypeError, match=r"run: .*no load_state_dict"):
        check_template(SaveOnly(), "run")


def test_restore_loads_objects_in_place_through_load_state_dict() -> None:
    source = trained(seed=1)
    target = trained(seed=2, steps=0)  # fresh: the optimizer has no state yet
    saved = prepare_save(list(source), "")
    saved = [tree_clone(item) for item in saved]
    result = restore(list(target), saved, "run", True)
    model, optimizer, scheduler, counter = result
    assert model is target[0] and optimizer is target[1]
    assert torch.equal(model[0].weight, source[0][0].weight)
    assert torch.equal(model[1].running_mean, source[0][1].running_mean)
    assert torch.equal(
        optimizer.state[model[0].weight]["exp_avg"],
        source[1].state[source[0][0].weight]["exp_avg"],
    )
    assert scheduler.last_epoch == 3 and counter.count == 3
    assert torch.equal(counter.history, torch.full((3,), 3.0))


def tree_clone(value: Any) -> Any:
    return fastckpt.io.tree.map_tensors(value, lambda tensor: tensor.clone())


def test_restore_refuses_mismatched_tensors_by_key_path() -> None:
    model = torch.nn.Linear(4, 2)
    state = tree_clone(prepare_save(torch.nn.Linear(4, 3), ""))
    with pytest.raises(CheckpointMismatchError, match=r"model\.weight: .*shape \(2, 4\)"):
        restore({"model": model}, {"model": state}, "", False)
    half = tree_clone(prepare_save(torch.nn.Linear(4, 2).half(), ""))
    with pytest.raises(CheckpointMismatchError, match=r"model\.weight: .*float16"):
        restore({"model": model}, {"model": half}, "", False)
    with pytest.raises(CheckpointMismatchError, match=r"(?s)model: .*load_state_dict.*Missing"):
        restore({"model": model}, {"model": {"weight": torch.zeros(2, 4)}}, "", False)


# --------------------------------------------------------------------------- through the manager


def manager(kind: str) -> fastckpt.CheckpointManager:
    config = (
        fastckpt.CheckpointManager.Config.with_sync_save()
        if kind == "sync"
        else fastckpt.CheckpointManager.Config.with_async_save()
    )
    return fastckpt.CheckpointManager(config)


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_manager_round_trips_module_optimizer_scheduler_and_user_class(
    kind: str, tmp_path: Path
) -> None:
    model, optimizer, scheduler, counter = trained(seed=1)
    with manager(kind) as mgr:
        saved = mgr.save(
            tmp_path / "ckpt",
            {"model": model, "optim": optimizer, "sched": scheduler, "counter": counter, "step": 3},
        )
        if saved is not None:
            saved.result()
        fresh = trained(seed=2, steps=0)
        loaded = mgr.load(
            tmp_path / "ckpt",
            into={"model": fresh[0], "optim": fresh[1], "sched": fresh[2], "counter": fresh[3]},
        )
    assert loaded["model"] is fresh[0] and loaded["counter"] is fresh[3]
    for name, tensor in model.state_dict().items():
        assert torch.equal(fresh[0].state_dict()[name], tensor), name
    assert fresh[2].last_epoch == scheduler.last_epoch
    assert fresh[1].param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]
    assert fresh[3].count == 3
    # one more identical step from each: bit-identical results (moments, step counts, lr)
    batch = torch.randn(5, 4)
    for m, o, s in ((model, optimizer, scheduler), fresh[:3]):
        m(batch).square().mean().backward()
        o.step()
        s.step()
    for name, tensor in model.state_dict().items():
        assert torch.equal(fresh[0].state_dict()[name], tensor), name


def test_manager_load_into_a_module_is_never_silently_ignored(tmp_path: Path) -> None:
    source, target = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    with manager("sync") as mgr:
        mgr.save(tmp_path / "ckpt", {"model": source})
        mgr.load(tmp_path / "ckpt", into={"model": target})
        assert torch.equal(target.weight, source.weight)
        with pytest.raises(TypeError, match=r"model\.head: cannot load into"):
            mgr.load(tmp_path / "ckpt", into={"model": {"head": object()}})
        with pytest.raises(CheckpointMismatchError, match=r"model\.weight"):
            mgr.load(tmp_path / "ckpt", into={"model": torch.nn.Linear(3, 5)})


def test_manager_save_names_the_key_path_of_what_it_cannot_store(tmp_path: Path) -> None:
    with manager("sync") as mgr, pytest.raises(TypeError, match=r"^model\.sub: .*state_dict"):
        mgr.save(tmp_path / "ckpt", {"model": {"sub": object()}})
    assert not (tmp_path / "ckpt").exists()


def test_enums_and_numpy_scalars_in_a_manager_state_are_refused_naming_the_key(
    tmp_path: Path,
) -> None:
    """A value or dict key of a subclass of int/float/str (an enum, a numpy scalar) is a
    ``TypeError`` naming its key path and the conversion, sync and async, nothing written.
    Before, it was stored as its base type and loaded back as a plain int/str/float."""
    import enum

    import numpy as np

    class Mode(enum.IntEnum):
        TRAIN = 1

    for value in ({"mode": Mode.TRAIN}, {"loss": np.float64(0.5)}, {"by_mode": {Mode.TRAIN: 1}}):
        for config in (
            fastckpt.CheckpointManager.Config.with_sync_save(),
            fastckpt.CheckpointManager.Config.with_async_save(),
        ):
            with (
                fastckpt.CheckpointManager(config) as manager,
                pytest.raises(TypeError, match=r"meta\.(mode|loss|by_mode)"),
            ):
                manager.save(tmp_path / "ckpt", {"meta": value})
            assert not (tmp_path / "ckpt").exists()


def test_an_item_nested_deeper_than_a_checkpoint_holds_is_refused_at_save(
    tmp_path: Path,
) -> None:
    """A skeleton nested past what loads read (MAX_JSON_DEPTH) would save and never load;
    refused at save naming the item (a deep nest: before, a bare RecursionError or a
    checkpoint that loads refuse)."""
    from fastckpt.manager.stateful import MAX_NESTING

    def nest(levels: int) -> Any:
        value: Any = torch.ones(1)
        for _ in range(levels):
            value = [value]
        return value

    with fastckpt.CheckpointManager(fastckpt.CheckpointManager.Config.with_sync_save()) as m:
        m.save(tmp_path / "ok", {"deep": nest(MAX_NESTING)})
        loaded = m.load(tmp_path / "ok")["deep"]
        for _ in range(MAX_NESTING):
            loaded = loaded[0]
        assert torch.equal(loaded, torch.ones(1))
        with pytest.raises(TypeError, match=rf"deep: .*more than {MAX_NESTING} levels"):
            m.save(tmp_path / "deeper", {"deep": nest(MAX_NESTING + 1)})
        # tuples take two levels each as stored: checked as stored, not as given (a review
        # found tuples 100 deep saved, verified, and refused at load)
        tuples: Any = torch.ones(1)
        for _ in range(100):
            tuples = (tuples,)
        with pytest.raises(TypeError, match=r"deep: .*nest too deeply .*as stored"):
            m.save(tmp_path / "tuples", {"deep": tuples})
    assert not (tmp_path / "deeper").exists() and not (tmp_path / "tuples").exists()
