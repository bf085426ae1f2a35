"""The nested state codec: exact round trips through JSON, typed errors, no pickle."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from fastckpt.errors import CheckpointFormatError
from fastckpt.format.records import nesting_depth
from fastckpt.io import tree
from fastckpt.io.tree import flatten, unflatten


def through_json(state: object) -> object:
    skeleton, tensors = flatten(state)
    return unflatten(json.loads(json.dumps(skeleton, allow_nan=False)), tensors)


def same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)  # type: ignore[index]
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))  # type: ignore[arg-type]
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)  # type: ignore[arg-type]
    return a == b


def test_adam_and_scheduler_state_round_trip_exactly() -> None:
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.8, 0.9))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)
    for _ in range(3):
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        scheduler.step()
    for state in (optimizer.state_dict(), scheduler.state_dict()):
        restored = through_json(state)
        assert same(state, restored)
    restored = through_json(optimizer.state_dict())
    assert isinstance(restored, dict)
    assert isinstance(restored["param_groups"][0]["betas"], tuple)
    assert set(restored["state"]) == {0, 1}  # int keys stay ints
    assert restored["state"][0]["step"].dtype == torch.float32  # Adam's tensor step


def test_scalars_nested_and_special_values() -> None:
    state = {
        "ints": [1, -2, 2**62],
        "flags": (True, False, None),
        "floats": [0.5, float("nan"), float("inf"), float("-inf")],
        "nested": {"a": [{"b": (torch.zeros(2, dtype=torch.bfloat16),)}]},
        "text": "hello",
        "odd keys": {1: "x", 2.5: "y", None: "z", "__tensor__": "not a tensor"},
        "empty": {},
        "scalar": torch.tensor(7),
    }
    assert same(state, through_json(state))


def test_tensor_names_are_key_paths_and_unique() -> None:
    skeleton, tensors = flatten({"a": {"b": torch.ones(1)}, "a.b": torch.zeros(1)})
    assert set(tensors) == {"a.b", "a.b#1"}
    assert unflatten(skeleton, tensors)["a.b"].item() == 0.0


def test_unsupported_values_name_their_path() -> None:
    with pytest.raises(TypeError, match=r"opt\.groups\.1\.fn"):
        flatten({"opt": {"groups": [{}, {"fn": lambda: None}]}})
    with pytest.raises(TypeError, match="set"):
        flatten({"x": {1, 2}})
    with pytest.raises(TypeError, match="dict keys"):
        flatten({("a", "b"): 1})


@pytest.mark.parametrize(
    "skeleton",
    [
        {"__tensor__": "missing"},
        {"__tensor__": 3},
        {"__float__": "1e9"},
        {"__dict__": [[1]]},
        {"__dict__": [[[1], 2]]},
        {"__tuple__": [], "extra": 1},
    ],
)
def test_malformed_skeletons_are_format_errors(skeleton: object) -> None:
    with pytest.raises(CheckpointFormatError):
        unflatten(skeleton, {})


def _random_nest(rng: random.Random, depth: int) -> object:
    """A nest of every container kind flatten encodes differently (plain and non-str-keyed
    dicts, lists, tuples, empty ones) with tensors, non-finite floats and scalars."""
    if depth > 6 or rng.random() < 0.3:
        return rng.choice([1, 1.5, float("nan"), "s", None, True, torch.zeros(1)])
    kind = rng.choice(["dict", "list", "tuple", "keyed", "empty"])
    items = range(rng.randint(0, 3))
    if kind == "dict":
        return {f"k{i}": _random_nest(rng, depth + 1) for i in items}
    if kind == "list":
        return [_random_nest(rng, depth + 1) for _ in items]
    if kind == "tuple":
        return tuple(_random_nest(rng, depth + 1) for _ in items)
    if kind == "keyed":
        keys = [1, 2.5, float("inf"), None, "__tensor__"]
        return {rng.choice(keys): _random_nest(rng, depth + 1) for _ in items}
    return rng.choice([{}, [], ()])


def test_the_depth_flatten_measures_is_the_skeletons_own() -> None:
    """The manager refuses an item by the depth flatten_measured tracks while building the
    skeleton (instead of walking the skeleton again): it must be the skeleton's depth."""
    rng = random.Random(0)
    for _ in range(3000):
        skeleton, _, depth = tree.flatten_measured(_random_nest(rng, 0))
        assert depth == nesting_depth(skeleton), skeleton
