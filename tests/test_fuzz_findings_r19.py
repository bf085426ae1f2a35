"""Findings of round 19's fuzz tester: ``fastckpt diff`` reading JSON files it had not checked
against their record, ``fastckpt diff`` of a malformed ``__dict__`` key or entry, and an
optimizer record whose ``params`` field was re-sealed malformed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import fastckpt
from cli_support import cli_runner
from fastckpt import _native
from fastckpt.errors import CheckpointFormatError
from fastckpt.format.records import seal_manifest


def _record_of(data: bytes) -> dict[str, int]:
    return {"size": len(data), "crc32c": _native.crc32c(data)}


def _reseal_item(directory: Path, relpath: str, data: bytes) -> None:
    """Write ``data`` as ``relpath`` of a manager checkpoint and re-seal ``commit.json`` over
    it, like an attacker (or a buggy writer) would: only the content is wrong."""
    (directory / relpath).write_bytes(data)
    record = json.loads((directory / "commit.json").read_bytes())
    record["files"][relpath] = _record_of(data)
    (directory / "commit.json").write_text(json.dumps(seal_manifest(record)))


def _reseal_index(root: Path, index: int, relpath: str, data: bytes) -> None:
    """Write ``data`` as ``relpath`` of ``index`` and re-seal the root's manifest over it."""
    (root / str(index) / relpath).write_bytes(data)
    manifest = json.loads((root / "manifest.json").read_bytes())
    manifest["checkpoints"][str(index)]["files"][relpath] = _record_of(data)
    (root / "manifest.json").write_text(json.dumps(seal_manifest(manifest)))


def _one_line_error(status: int, err: str, *needles: str) -> None:
    assert status == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, (needle, err)


# --------------------------------------------------------------------------- diff: records


def test_diff_checks_a_manager_checkpoints_json_against_its_record(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: a plain value damaged in ``d.json`` (same size, ``commit.json`` untouched) was
    reported as a real change (``changed d:[3] "x" "y"``, exit 1) while ``verify`` and the
    load called the file corrupt; a flipped tensor byte was already an error (exit 2)."""
    with fastckpt.CheckpointManager() as manager:
        for name in ("a", "b"):
            manager.save(tmp_path / name, {"d": {3: "x"}, "w": torch.ones(2)})
    damaged = tmp_path / "b" / "d.json"
    damaged.write_bytes(damaged.read_bytes().replace(b'"x"', b'"y"'))
    status, _, err = cli_runner(capsys)("diff", tmp_path / "a", tmp_path / "b")
    _one_line_error(status, err, str(damaged), "crc32c", "commit.json")


def test_diff_checks_a_root_index_json_against_the_manifest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: an optimizer's ``lr`` damaged in index 1 (same size, manifest untouched) was
    reported as two changed plain values, exit 1, while ``load_checkpoint`` refused the file
    with a ``ChecksumMismatchError``."""
    root = tmp_path / "root"
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        fastckpt.save_checkpoint(
            root, models={"main": (model, None)}, optimizers={"sgd": (optimizer, None)}
        )
    damaged = root / "1" / "optimizers" / "sgd.json"
    data = damaged.read_bytes()
    assert b'"lr": 0.1' in data
    damaged.write_bytes(data.replace(b'"lr": 0.1', b'"lr": 0.9'))
    status, _, err = cli_runner(capsys)("diff", root / "0", root / "1")
    _one_line_error(status, err, str(damaged), "crc32c", "manifest.json")
    status, out, err = cli_runner(capsys)("diff", root / "0", root / "0")
    assert status == 0 and "identical" in out, out + err  # an intact index still compares


# --------------------------------------------------------------------------- diff: __dict__


@pytest.mark.parametrize(
    ("entry", "problem"),
    [
        ([{}, "x"], "bad float marker"),
        ([{"x": [1]}, "x"], "bad float marker"),
        ([{"__float__": "wat"}, "x"], "bad float marker"),
        ([[1], "x"], "bad dict key"),
        ([3], "bad dict entry"),
        ([3, {"__float__": "wat"}], "bad float marker"),
    ],
)
def test_diff_of_a_malformed_dict_entry_is_the_loads_format_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], entry: list[Any], problem: str
) -> None:
    """An item's ``{"__dict__": [[key, value]]}`` re-sealed with a key that is no float
    marker, a key that is a list, an entry that is no pair, a value that is a bad float
    marker: the load refuses each with a ``CheckpointFormatError``, and so does ``diff`` now,
    naming the file (exit 2). Before: the three marker keys killed the CLI with a traceback
    and exit 1 ("differences found"): ``StopIteration``, ``TypeError``, ``ValueError``; the
    list key, the lone entry and the bad value were compared as if they loaded (exit 1)."""
    with fastckpt.CheckpointManager() as manager:
        for name in ("a", "b"):
            manager.save(tmp_path / name, {"d": {3: "x"}})
    document = json.dumps({"skeleton": {"__dict__": [entry]}}).encode()
    _reseal_item(tmp_path / "b", "d.json", document)
    with fastckpt.CheckpointManager() as manager, pytest.raises(CheckpointFormatError) as load:
        manager.load(tmp_path / "b")
    assert problem in str(load.value)
    status, _, err = cli_runner(capsys)("diff", tmp_path / "a", tmp_path / "b")
    _one_line_error(status, err, str(tmp_path / "b" / "d.json"), problem)


def test_diff_still_reads_non_finite_float_keys_and_values(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The markers fastckpt writes (``nan``/``inf`` keys and values) still compare as the
    floats they load as."""
    with fastckpt.CheckpointManager() as manager:
        manager.save(tmp_path / "a", {"d": {float("inf"): 1.0, 2: float("nan")}})
        manager.save(tmp_path / "b", {"d": {float("inf"): 2.0, 2: float("nan")}})
    status, out, err = cli_runner(capsys)("diff", tmp_path / "a", tmp_path / "a")
    assert status == 0 and "identical" in out, out + err
    status, out, err = cli_runner(capsys)("diff", "--json", tmp_path / "a", tmp_path / "b")
    assert status == 1, out + err
    changed = json.loads(out)["values_changed"]
    assert changed == [{"name": "d:[inf]", "a": 1.0, "b": 2.0}], changed


class Tagged(torch.nn.Linear):
    """A layer whose recorded constructor argument is a dict keyed ``"__float__"``: its spec
    holds ``{"__dict__": {"__float__": ...}}``, the spec encoding of such a dict."""

    def __init__(self, tags: Any) -> None:
        super().__init__(2, 2)
        self.tags = tags


def test_diff_reads_a_spec_dict_keyed_like_a_marker_as_the_dict_it_loads_as(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A spec's ``{"__dict__": {"__float__": 5}}`` is the dict ``{"__float__": 5}``, not a
    float marker: it compares as that dict's entry, never refused as a bad marker (as the
    first version of this round's fix did). Before: read as the marker's payload, so
    ``tags={"__float__": 5}`` and ``tags=5`` were the same plain value ("0 plain value(s)
    differ"; the checkpoints identical when their weights were)."""
    root = tmp_path / "root"
    for tags in ({"__float__": 5}, {"__float__": 6}, 5):
        fastckpt.save_checkpoint(root, models={"main": (Tagged(tags), None)})
    status, out, err = cli_runner(capsys)("diff", root / "0", root / "0")
    assert status == 0 and "identical" in out, out + err
    status, out, err = cli_runner(capsys)("diff", "--json", root / "0", root / "1")
    assert status == 1, out + err
    changed = json.loads(out)["values_changed"]
    assert changed == [{"name": "models/main:kwargs.tags.__float__", "a": 5, "b": 6}], changed
    status, out, err = cli_runner(capsys)("diff", "--json", root / "0", root / "2")
    result = json.loads(out)
    assert status == 1 and result["values_added"] == [
        {"name": "models/main:kwargs.tags", "b": 5}
    ], out + err
    assert result["values_removed"] == [{"name": "models/main:kwargs.tags.__float__", "a": 5}]


# --------------------------------------------------------------------------- optimizer params


def _saved_root(tmp_path: Path) -> Path:
    """A root of one model ``main``, an SGD optimizer ``sgd`` over it and a StepLR ``s``."""
    root = tmp_path / "root"
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 2)
    fastckpt.save_checkpoint(
        root,
        models={"main": (model, None)},
        optimizers={"sgd": (optimizer, None)},
        schedulers={"s": (scheduler, None)},
    )
    return root


@pytest.mark.parametrize(
    "params",
    [
        7,
        [[["main"]]],
        [{"a": 1}],
        [["other_model", "weight"]],
        ["main"],
        [[]],
        None,
    ],
)
def test_a_resealed_malformed_optimizer_params_field_is_a_format_error(
    tmp_path: Path, params: Any
) -> None:
    """Before: ``7`` and ``[[["main"]]]`` raised a bare ``TypeError`` naming no file; the
    other malformed references loaded without a word and dropped the optimizer (and its
    scheduler) from the result, though the manifest lists it and associates it with the
    loaded model."""
    root = _saved_root(tmp_path)
    record = root / "0" / "optimizers" / "sgd.json"
    document = json.loads(record.read_bytes())
    document["params"] = params
    _reseal_index(root, 0, "optimizers/sgd.json", json.dumps(document).encode())
    with pytest.raises(CheckpointFormatError) as refused:
        fastckpt.load_checkpoint(root, 0)
    assert str(record) in str(refused.value) and "'params'" in str(refused.value)


def test_an_intact_optimizer_loads_and_one_of_a_model_not_requested_is_skipped(
    tmp_path: Path,
) -> None:
    """The check of ``params`` leaves the skip alone: an optimizer (and its scheduler) over a
    model that ``model_names=`` leaves out, or over two models one of which is left out, is
    not loaded and raises nothing."""
    root = _saved_root(tmp_path)
    main = fastckpt.load_checkpoint(root, 0)["models"]["main"]
    assert list(main["optimizers"]) == ["sgd"] and list(main["schedulers"]) == ["s"]

    both = tmp_path / "both"
    first, second = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    shared = torch.optim.SGD([*first.parameters(), *second.parameters()], lr=0.1)
    own = torch.optim.SGD(second.parameters(), lr=0.1)
    fastckpt.save_checkpoint(
        both,
        models={"first": (first, None), "second": (second, None)},
        optimizers={"shared": (shared, None), "own": (own, None)},
        schedulers={"s": (torch.optim.lr_scheduler.StepLR(own, 2), None)},
        associations={"optimizers": {"shared": "first", "own": "second"}},
    )
    models = fastckpt.load_checkpoint(both, 0, model_names=["first"])["models"]
    assert list(models) == ["first"]
    assert models["first"]["optimizers"] == {} and models["first"]["schedulers"] == {}
    models = fastckpt.load_checkpoint(both, 0)["models"]
    assert list(models["first"]["optimizers"]) == ["shared"]
    assert list(models["second"]["optimizers"]) == ["own"]
    assert list(models["second"]["schedulers"]) == ["s"]
