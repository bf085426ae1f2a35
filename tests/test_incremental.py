"""Incremental saves: unchanged tensors are references to bytes already on disk.

Every way torch changes a tensor (in-place edits, ``.data`` assignment, optimizer steps,
``load_state_dict``, a new tensor at the same key) must be rewritten; unchanged ones are
referenced, load transparently and bitwise, survive pruning of the index that holds them, are
checked by ``verify``, exported whole, and a SIGKILL at any moment leaves the newest committed
checkpoint loadable.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import fastckpt
import training_support as support

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import crash_harness

from fastckpt.io.headers import read_metadata
from fastckpt.training import CheckpointHook

FROZEN_WIDTH = 128


class Tuned(nn.Module):
    """A frozen backbone (most bytes) and a small trainable head."""

    scale: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Linear(FROZEN_WIDTH, FROZEN_WIDTH)
        self.head = nn.Linear(FROZEN_WIDTH, 2)
        self.register_buffer("scale", torch.ones(FROZEN_WIDTH))
        self.backbone.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.backbone(x * self.scale)))


def _setup() -> tuple[Tuned, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Tuned()
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return model, optimizer


def _step(model: Tuned, optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad()
    model(torch.randn(4, FROZEN_WIDTH)).square().mean().backward()
    optimizer.step()


def _save(root: Path, model: nn.Module, optimizer: Any = None, **kwargs: Any) -> int:
    optimizers = {} if optimizer is None else {"adam": (optimizer, None)}
    return fastckpt.save_checkpoint(
        root, models={"m": (model, None)}, optimizers=optimizers, **kwargs
    )


def _refs(root: Path, index: int) -> dict[str, dict[str, Any]]:
    path = root / str(index) / "refs.json"
    if not path.exists():
        return {}
    return json.loads(path.read_text())["refs"]


def _referenced(root: Path, index: int, relpath: str = "models/m.safetensors") -> set[str]:
    return set(_refs(root, index).get(relpath, {}))


def _loaded(root: Path, index: int = -1) -> dict[str, torch.Tensor]:
    result = fastckpt.load_checkpoint(root, index)
    return dict(result["models"]["m"]["model"].state_dict())


def _assert_bitwise(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> None:
    assert set(expected) == set(actual)
    for name, tensor in expected.items():
        assert torch.equal(tensor, actual[name]), name


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


@pytest.fixture(autouse=True)
def _fresh_trackers() -> Any:
    fastckpt.container.incremental.forget()
    yield
    fastckpt.container.incremental.forget()


def test_unchanged_tensors_are_referenced_and_load_bitwise(tmp_path: Path) -> None:
    model, optimizer = _setup()
    _step(model, optimizer)
    assert _save(tmp_path, model, optimizer) == 0
    assert _refs(tmp_path, 0) == {}  # the first save is full
    _step(model, optimizer)
    assert _save(tmp_path, model, optimizer) == 1
    # The frozen backbone and the untouched buffer are referenced; the head and Adam's
    # moments (stepped) were written.
    assert _referenced(tmp_path, 1) == {"backbone.weight", "backbone.bias", "scale"}
    assert _referenced(tmp_path, 1, "optimizers/adam.safetensors") == set()
    written = fastckpt.read_metadata(tmp_path / "1" / "models" / "m.safetensors")["tensors"]
    assert set(written) == {"head.weight", "head.bias"}
    ref = _refs(tmp_path, 1)["models/m.safetensors"]["backbone.weight"]
    # The reference points into index 1 itself: index 0's file, hard-linked in (the same
    # inode, no byte copied), so that index 1 is self-contained.
    assert (ref["index"], ref["file"], ref["name"]) == (
        1,
        "linked/0.safetensors",
        "backbone.weight",
    )
    assert ref["nbytes"] == FROZEN_WIDTH * FROZEN_WIDTH * 4
    linked = os.stat(tmp_path / "1" / "linked" / "0.safetensors")
    assert linked.st_ino == os.stat(tmp_path / "0" / "models" / "m.safetensors").st_ino
    # A third save links the same file again, from index 1 (no chain of references).
    _step(model, optimizer)
    _save(tmp_path, model, optimizer)
    third = _refs(tmp_path, 2)["models/m.safetensors"].values()
    assert {(ref["index"], ref["file"]) for ref in third} == {(2, "linked/0.safetensors")}
    assert os.stat(tmp_path / "2" / "linked" / "0.safetensors").st_ino == linked.st_ino
    _assert_bitwise(_snapshot(model), _loaded(tmp_path))
    result = fastckpt.load_checkpoint(tmp_path)
    restored = result["models"]["m"]["optimizers"]["adam"]["optimizer"].state_dict()["state"]
    for key, state in optimizer.state_dict()["state"].items():
        for name, value in state.items():
            assert torch.equal(value, restored[key][name]), (key, name)
    assert fastckpt.verify(tmp_path).ok


def test_in_place_edit_of_a_frozen_parameter_is_rewritten(tmp_path: Path) -> None:
    model, _ = _setup()
    _save(tmp_path, model)
    with torch.no_grad():
        model.backbone.weight.mul_(2)  # requires_grad=False does not mean unchanged
    _save(tmp_path, model)
    assert "backbone.weight" not in _referenced(tmp_path, 1)
    assert "backbone.bias" in _referenced(tmp_path, 1)
    _assert_bitwise(_snapshot(model), _loaded(tmp_path))


def test_in_place_edit_through_a_view_is_rewritten(tmp_path: Path) -> None:
    model, _ = _setup()
    _save(tmp_path, model)
    model.scale[3:5] = 7.0  # a view shares the version counter
    _save(tmp_path, model)
    assert "scale" not in _referenced(tmp_path, 1)
    _assert_bitwise(_snapshot(model), _loaded(tmp_path))


def test_data_assignment_is_rewritten(tmp_path: Path) -> None:
    model, _ = _setup()
    _save(tmp_path, model)
    model.backbone.weight.data = torch.zeros_like(model.backbone.weight)  # a new storage
    _save(tmp_path, model)
    assert "backbone.weight" not in _referenced(tmp_path, 1)
    _assert_bitwise(_snapshot(model), _loaded(tmp_path))


def test_optimizer_steps_are_rewritten(tmp_path: Path) -> None:
    model, optimizer = _setup()
    model.backbone.requires_grad_(True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _step(model, optimizer)
    _save(tmp_path, model, optimizer)
    _step(model, optimizer)
    _save(tmp_path, model, optimizer)
    assert _referenced(tmp_path, 1) == {"scale"}
    assert _referenced(tmp_path, 1, "optimizers/adam.safetensors") == set()
    _assert_bitwise(_snapshot(model), _loaded(tmp_path))


def test_a_tensor_seen_moving_is_written_without_hashing_then_proven_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tensor whose version counter moved since the last save and before it (optimizer
    steps between saves) is written without its BLAKE3 digest; when it stops moving it is
    written once more, hashed, and referenced from the save after. One that moves between
    every other save only is hashed when it moves, so its unchanged saves reference it.
    Candidates are always hashed."""
    hashed: list[set[str]] = []
    digest_groups = fastckpt.container.incremental.digest_groups

    def spy(groups: Any, keys: Any) -> Any:
        hashed.append({name for _, name in keys})
        return digest_groups(groups, keys)

    monkeypatch.setattr(fastckpt.container.incremental, "digest_groups", spy)
    model, optimizer = _setup()
    frozen = {"backbone.weight", "backbone.bias", "scale"}
    head = {"head.weight", "head.bias"}
    moments = {f"state.{i}.{name}" for i in (0, 1) for name in ("exp_avg", "exp_avg_sq", "step")}
    _step(model, optimizer)
    _save(tmp_path, model, optimizer)
    assert hashed[-1] == set(model.state_dict()) | moments  # a first save hashes everything
    _step(model, optimizer)
    _save(tmp_path, model, optimizer)
    assert hashed[-1] == set(model.state_dict()) | moments  # moved once: still hashed
    _step(model, optimizer)
    _save(tmp_path, model, optimizer)
    # The head and moments moved again: written, not hashed; the rest hashed (candidates).
    assert hashed[-1] == frozen
    assert _referenced(tmp_path, 2) == frozen
    # No step: the head did not move this time, but has no digest from index 2 to compare
    # with, so it is written (and hashed) once more ...
    _save(tmp_path, model, optimizer)
    assert head <= hashed[-1]
    assert _referenced(tmp_path, 3) == frozen
    # ... and referenced from the next save on.
    _save(tmp_path, model, optimizer)
    assert _referenced(tmp_path, 4) == set(model.state_dict())
    assert _referenced(tmp_path, 4, "optimizers/adam.safetensors") == moments
    _assert_bitwise(_snapshot(model), _loaded(tmp_path))
    # Steps between every other save: hashed when they move, referenced when they do not.
    for index in range(5, 9):
        if index % 2:
            _step(model, optimizer)
        _save(tmp_path, model, optimizer)
        if index % 2:
            assert head <= hashed[-1] and _referenced(tmp_path, index) == frozen
        else:
            assert _referenced(tmp_path, index) == set(model.state_dict())
    _assert_bitwise(_snapshot(model), _loaded(tmp_path))


def test_load_state_dict_is_rewritten_even_with_equal_values(tmp_path: Path) -> None:
    model, _ = _setup()
    _save(tmp_path, model)
    other = Tuned()
    model.load_state_dict(other.state_dict())  # copy_ bumps every version counter
    _save(tmp_path, model)
    assert _referenced(tmp_path, 1) == set()
    _assert_bitwise(_snapshot(model), _loaded(tmp_path))
    model.load_state_dict(_snapshot(model))  # the same values again: still rewritten
    _save(tmp_path, model)
    assert _referenced(tmp_path, 2) == set()


def test_a_new_tensor_at_the_same_key_is_rewritten(tmp_path: Path) -> None:
    model, _ = _setup()
    _save(tmp_path, model)
    for _ in range(5):  # freed and reallocated: the address may come back, the tensor differs
        model.scale = torch.full((FROZEN_WIDTH,), 3.0)
        model.backbone.bias = nn.Parameter(torch.randn(FROZEN_WIDTH), requires_grad=False)
        index = _save(tmp_path, model)
        assert "scale" not in _referenced(tmp_path, index)
        assert "backbone.bias" not in _referenced(tmp_path, index)
        assert "backbone.weight" in _referenced(tmp_path, index)
        _assert_bitwise(_snapshot(model), _loaded(tmp_path))


def test_mark_frozen_skips_the_version_check(tmp_path: Path) -> None:
    model, _ = _setup()
    fastckpt.mark_frozen(model.backbone)
    _save(tmp_path, model)
    model.backbone.weight.requires_grad_(False)
    with torch.no_grad():
        model.backbone.weight.add_(0)  # bumps the version; the caller vouched for it
    _save(tmp_path, model)
    assert {"backbone.weight", "backbone.bias"} <= _referenced(tmp_path, 1)
    model.backbone.weight = nn.Parameter(torch.ones_like(model.backbone.weight))
    _save(tmp_path, model)  # a new storage is never taken as frozen
    assert "backbone.weight" not in _referenced(tmp_path, 2)
    _assert_bitwise(_snapshot(model), _loaded(tmp_path))


class _FlatPair(nn.Module):
    """Two parameters that are views into one flat buffer (a flat-parameter layout)."""

    def __init__(self) -> None:
        super().__init__()
        flat = torch.zeros(8)
        self.frozen = nn.Parameter(flat[:4], requires_grad=False)
        self.trained = nn.Parameter(flat[4:])


def test_mark_frozen_covers_the_marked_view_only_and_is_withdrawn_by_unmark_or_forget(
    tmp_path: Path,
) -> None:
    """The promise of ``mark_frozen`` covers the marked tensor's view only: another view of
    the same storage (a flat parameter buffer's trained half) is proven by its digest as
    ever. ``unmark_frozen`` withdraws it, and ``forget`` (as a save with
    ``incremental=False`` does) withdraws every mark. Before, marks were keyed by storage,
    so the trained half was referenced with its first save's bytes, and neither documented
    undo outlasted one save. The undos are shown by changes torch's counter does not see
    (NumPy writes) made after a save that fingerprinted the tensors again: a change the
    counter sees is proven by digest even under a mark, so it cannot tell. Before round 20
    this test made only such changes, and ``forget`` was never called: a ``forget`` that
    kept the marks passed it."""
    model = _FlatPair()
    fastckpt.mark_frozen(model.frozen)
    _save(tmp_path, model)
    with torch.no_grad():
        model.trained.add_(1.0)
    _save(tmp_path, model)
    assert _referenced(tmp_path, 1) == {"frozen"}
    _assert_bitwise(_snapshot(model), _loaded(tmp_path))
    # The promise itself: a marked tensor changed where torch's counter does not see it is
    # referenced whatever its bytes (a change the counter sees is proven by its digest:
    # test_change_detection's test_a_marked_tensor_whose_counter_moved_is_written).
    model.frozen.detach().numpy()[0] += 1.0
    _save(tmp_path, model)
    assert "frozen" in _referenced(tmp_path, 2)
    fastckpt.unmark_frozen(model.frozen)
    _save(tmp_path, model)
    _assert_bitwise(_snapshot(model), _loaded(tmp_path))
    # A save with incremental=False, or forget(), withdraws every mark, for the saves after
    # it too. The save right after either is full (nothing is tracked), so the change made
    # after the second one is what shows whether the marks were withdrawn.
    for undo in ("incremental=False", "forget()"):
        fastckpt.mark_frozen(model)
        if undo == "forget()":
            _save(tmp_path, model)
            fastckpt.container.incremental.forget()
        else:
            _save(tmp_path, model, incremental=False)
        for _ in range(2):
            model.frozen.detach().numpy()[0] += 1.0  # unseen by torch's counter
            index = _save(tmp_path, model)
            _assert_bitwise(_snapshot(model), _loaded(tmp_path, index))
        assert "frozen" not in _referenced(tmp_path, index), undo


def test_a_tensor_changed_while_unmarked_and_marked_again_is_saved_as_it_is_now(
    tmp_path: Path,
) -> None:
    """Progressive unfreezing: a backbone marked frozen is saved, unmarked, trained, marked
    again, and saved. The new mark promises "no change from now on", not "the bytes of the
    last marked save": before, the second save referenced the first one's bytes (the
    fingerprint said "frozen" at both), a checkpoint that verified and loaded the old
    weights. Now a tensor marked again is written once, then referenced under its new mark;
    marking a tensor already marked keeps its mark."""
    model, _ = _setup()
    fastckpt.mark_frozen(model.backbone)
    _save(tmp_path, model)
    fastckpt.unmark_frozen(model.backbone)
    with torch.no_grad():
        model.backbone.weight.add_(1.0)  # trained while not marked
    fastckpt.mark_frozen(model.backbone)
    _save(tmp_path, model)
    assert "backbone.weight" not in _referenced(tmp_path, 1)
    _assert_bitwise(_snapshot(model), _loaded(tmp_path))
    fastckpt.mark_frozen(model.backbone)  # already marked: the same promise
    _save(tmp_path, model)
    assert {"backbone.weight", "backbone.bias"} <= _referenced(tmp_path, 2)
    _assert_bitwise(_snapshot(model), _loaded(tmp_path))


def test_replacing_an_index_after_rm_rf_of_an_incremental_one_works(tmp_path: Path) -> None:
    """``rm -rf ROOT/1`` of an incremental index, then replacing another index: the deleted
    index references nothing. Before, the replace raised FileNotFoundError naming the
    deleted index's refs.json."""
    model, optimizer = _setup()
    for _ in range(3):
        _save(tmp_path, model, optimizer)
        _step(model, optimizer)
    shutil.rmtree(tmp_path / "1")
    assert fastckpt.verify(tmp_path, 2).ok
    for index in (2, 0):
        assert _save(tmp_path, model, optimizer, checkpoint_index=index) == index
        _assert_bitwise(_snapshot(model), _loaded(tmp_path, index))


@pytest.mark.parametrize("lost", [3, 2])
def test_prune_works_when_a_kept_incremental_index_is_lost(tmp_path: Path, lost: int) -> None:
    """``rm -rf`` of a kept incremental index (the newest, or one in the middle): its
    references cannot be read, so the bytes of every older index are kept for it. Before,
    every prune of the root failed (FileNotFoundError naming its refs.json) until the
    manifest was edited by hand."""
    model, optimizer = _setup()
    states = []
    for _ in range(4):
        _save(tmp_path, model, optimizer)
        states.append(_snapshot(model))
        _step(model, optimizer)
    shutil.rmtree(tmp_path / str(lost))
    keep = 1 if lost == 3 else 2
    assert fastckpt.prune(tmp_path, keep_last=keep) == [0, 1]
    survivor = 2 if lost == 3 else 3
    _assert_bitwise(states[survivor], _loaded(tmp_path, survivor))
    assert fastckpt.verify(tmp_path, survivor).ok


@pytest.mark.parametrize("value", ["false", None, 0.0, "0"])
def test_incremental_must_be_a_bool(tmp_path: Path, value: Any) -> None:
    """``incremental="false"`` was taken as true (and saved incrementally)."""
    model, _ = _setup()
    with pytest.raises(TypeError, match="incremental must be a bool"):
        fastckpt.save_checkpoint(tmp_path, models={"m": (model, None)}, incremental=value)
    with pytest.raises(TypeError, match="incremental must be a bool"):
        CheckpointHook(tmp_path, step_interval=1, incremental=value)
    strategy = support.new_strategy([], num_steps=1)
    with pytest.raises(TypeError, match="incremental must be a bool"):
        strategy.save_checkpoint(tmp_path, incremental=value)
    assert not tmp_path.exists() or not os.listdir(tmp_path)


def test_incremental_false_writes_everything(tmp_path: Path) -> None:
    model, _ = _setup()
    _save(tmp_path, model)
    _save(tmp_path, model, incremental=False)
    assert not (tmp_path / "1" / "refs.json").exists()
    # The next incremental save starts over from a full one.
    _save(tmp_path, model)
    assert _refs(tmp_path, 2) == {}
    _save(tmp_path, model)
    assert {ref["index"] for ref in _refs(tmp_path, 3)["models/m.safetensors"].values()} == {3}
    linked = os.stat(tmp_path / "3" / "linked" / "0.safetensors").st_ino
    assert linked == os.stat(tmp_path / "2" / "models" / "m.safetensors").st_ino


@pytest.mark.parametrize("how", ["rm -rf", "prune"])
def test_deleting_every_earlier_index_leaves_the_newest_loading_bitwise(
    tmp_path: Path, how: str
) -> None:
    """Every index is self-contained: ``rm -rf`` of the earlier ones (or a prune) breaks
    nothing, leaves no ``.ref-<i>`` copy, and the unchanged bytes were still not written."""
    model, optimizer = _setup()
    for _ in range(4):
        _step(model, optimizer)
        _save(tmp_path, model, optimizer)
    expected = _snapshot(model)

    # Bytes index 3 wrote itself against a full save: a file sharing an inode with index 0
    # (a hard link, not a copy) wrote nothing.
    def inodes(index: int) -> dict[Path, tuple[int, int]]:
        files = (tmp_path / str(index)).rglob("*")
        return {f: (f.stat().st_dev, f.stat().st_ino) for f in files if f.is_file()}

    base = set(inodes(0).values())
    linked = [f for f, inode in inodes(3).items() if inode in base]
    assert linked and all("linked" in f.parts for f in linked), linked

    def written(index: int) -> int:
        mine = inodes(index).items()
        return sum(f.stat().st_size for f, inode in mine if index == 0 or inode not in base)

    assert written(3) < written(0) / 2
    if how == "rm -rf":
        for index in range(3):
            shutil.rmtree(tmp_path / str(index))
    else:
        assert fastckpt.prune(tmp_path, keep_last=1) == [0, 1, 2]
        assert sorted(os.listdir(tmp_path)) == ["3", "manifest.json"]
    _assert_bitwise(expected, _loaded(tmp_path, 3))
    report = fastckpt.verify(tmp_path, 3)
    assert report.ok, report


def test_pruning_the_base_of_an_earlier_versions_index_keeps_its_bytes(tmp_path: Path) -> None:
    """Roots written before every index was self-contained reference the earlier index's
    own file: a prune keeps those bytes as ``.ref-<index>`` and the kept index loads."""
    model, optimizer = _setup()
    with crash_harness.legacy_references():
        for _ in range(4):
            _step(model, optimizer)
            _save(tmp_path, model, optimizer)
    assert {ref["index"] for ref in _refs(tmp_path, 3)["models/m.safetensors"].values()} == {0}
    expected = _snapshot(model)
    assert fastckpt.prune(tmp_path, keep_last=1) == [0, 1, 2]
    assert [c["index"] for c in fastckpt.list_checkpoints(tmp_path)] == [3]
    names = sorted(os.listdir(tmp_path))
    assert ".ref-0" in names and "0" not in names and "1" not in names and "2" not in names
    _assert_bitwise(expected, _loaded(tmp_path))
    assert fastckpt.verify(tmp_path).ok
    # Once nothing references the retained bytes, the next prune deletes them.
    _save(tmp_path, model, optimizer, incremental=False)
    fastckpt.prune(tmp_path, keep_last=1)
    assert ".ref-0" not in os.listdir(tmp_path)
    _assert_bitwise(expected, _loaded(tmp_path))


def test_deleting_the_base_of_an_earlier_versions_index_by_hand_names_the_file_and_the_fix(
    tmp_path: Path,
) -> None:
    """Before, the load named ``ROOT/refs.json`` (no such file) and ``ROOT/.ref-0/...``
    (never there) and no fix; a review of checkpoints of the 2026-11-30 version found it."""
    model, _ = _setup()
    with crash_harness.legacy_references():
        _save(tmp_path, model)
        _save(tmp_path, model)
    shutil.rmtree(tmp_path / "0")
    with pytest.raises(FileNotFoundError) as caught:
        _loaded(tmp_path, 1)
    message = str(caught.value)
    assert f"{tmp_path}/0/models/m.safetensors: missing" in message
    assert "earlier fastckpt version" in message and "fastckpt prune" in message
    assert "backup" in message


@pytest.mark.parametrize("legacy", [False, True], ids=["linked", "earlier-version-retained"])
def test_verify_and_load_catch_damaged_referenced_bytes(tmp_path: Path, legacy: bool) -> None:
    """The referenced bytes live in the index's own linked file, or (roots of an earlier
    version) in the pruned base's retained ``.ref-0``: damaged or gone, verify and load say
    so and name it."""
    model, _ = _setup()
    with crash_harness.legacy_references() if legacy else contextlib.nullcontext():
        _save(tmp_path, model)
        _save(tmp_path, model)
    fastckpt.prune(tmp_path, keep_last=1)
    relpath = ".ref-0/models/m.safetensors" if legacy else "1/linked/0.safetensors"
    target, named = tmp_path / relpath, re.escape(relpath)
    data = bytearray(target.read_bytes())
    data[-10] ^= 0x40
    target.write_bytes(bytes(data))
    report = fastckpt.verify(tmp_path)
    assert not report.ok
    assert any(str(failure.path).endswith(relpath) for failure in report.failures)
    with pytest.raises(fastckpt.ChecksumMismatchError, match=named):
        fastckpt.load_checkpoint(tmp_path)
    target.unlink()
    assert any(f.status == "missing" for f in fastckpt.verify(tmp_path).failures)
    with pytest.raises(FileNotFoundError, match=named):
        fastckpt.load_checkpoint(tmp_path)


def test_replacing_an_earlier_index_leaves_the_later_ones_whole(tmp_path: Path) -> None:
    """A later index holds its own link to the bytes: replacing the index they came from
    (``checkpoint_index=``) changes nothing it loads."""
    model, _ = _setup()
    _save(tmp_path, model)
    _save(tmp_path, model)
    expected = _snapshot(model)
    with torch.no_grad():
        model.backbone.weight.add_(1)
    _save(tmp_path, model, checkpoint_index=0)
    _assert_bitwise(expected, _loaded(tmp_path, 1))
    _assert_bitwise(_snapshot(model), _loaded(tmp_path, 0))
    assert fastckpt.verify(tmp_path).ok


def test_replacing_an_index_an_earlier_versions_index_references_is_refused(
    tmp_path: Path,
) -> None:
    model, _ = _setup()
    with crash_harness.legacy_references():
        _save(tmp_path, model)
        _save(tmp_path, model)
    with pytest.raises(ValueError, match=r"index 0 holds tensors that indices \[1\]"):
        _save(tmp_path, model, checkpoint_index=0)
    _assert_bitwise(_snapshot(model), _loaded(tmp_path, 0))
    # Nor is saving again at the number of a pruned index whose bytes are still referenced.
    with crash_harness.legacy_references():
        _save(tmp_path, model)
    fastckpt.prune(tmp_path, keep_last=2)
    assert ".ref-0" in os.listdir(tmp_path)
    with pytest.raises(ValueError, match=r"index 0 holds tensors that indices \[1, 2\]"):
        _save(tmp_path, model, checkpoint_index=0)
    # Replacing the latest index (referenced by nobody) never references itself.
    with crash_harness.legacy_references():
        _save(tmp_path, model, checkpoint_index=2)
    assert {ref["index"] for ref in _refs(tmp_path, 2)["models/m.safetensors"].values()} == {0}
    _save(tmp_path, model, checkpoint_index=2)
    _assert_bitwise(_snapshot(model), _loaded(tmp_path))


def test_a_recreated_root_is_written_in_full(tmp_path: Path) -> None:
    model, _ = _setup()
    _save(tmp_path / "r", model)
    shutil.rmtree(tmp_path / "r")
    _save(tmp_path / "r", model)  # the tracker still knows the tensors; their bytes are gone
    assert _refs(tmp_path / "r", 0) == {}
    _assert_bitwise(_snapshot(model), _loaded(tmp_path / "r"))


def test_export_writes_a_self_contained_file(tmp_path: Path) -> None:
    model, optimizer = _setup()
    _save(tmp_path / "root", model, optimizer)
    _step(model, optimizer)
    _save(tmp_path / "root", model, optimizer)
    fastckpt.prune(tmp_path / "root", keep_last=1)
    out = tmp_path / "m.safetensors"
    subprocess.run(
        [sys.executable, "-m", "fastckpt", "export", str(tmp_path / "root"), "--to", str(out)],
        check=True,
        capture_output=True,
    )
    shutil.rmtree(tmp_path / "root")
    _assert_bitwise(_snapshot(model), fastckpt.load_file(out))


def test_diff_sees_referenced_tensors(tmp_path: Path) -> None:
    model, optimizer = _setup()
    _save(tmp_path / "root", model, optimizer)
    with torch.no_grad():
        model.head.bias.add_(1)
    _save(tmp_path / "root", model, optimizer)
    out = tmp_path / "m.safetensors"

    def cli(*args: str) -> dict[str, Any]:
        done = subprocess.run(
            [sys.executable, "-m", "fastckpt", *args, "--json"], capture_output=True, text=True
        )
        assert done.returncode in (0, 1), done.stderr
        return dict(json.loads(done.stdout))

    result = cli("diff", str(tmp_path / "root" / "0"), str(tmp_path / "root" / "1"))
    assert [row["name"] for row in result["changed"]] == ["models/m:head.bias"]
    assert result["added"] == [] and result["removed"] == []
    assert result["compared"] == len(model.state_dict())  # none left out as "removed"
    cli("export", str(tmp_path / "root"), "--to", str(out))
    assert cli("diff", str(tmp_path / "root"), str(out))["identical"]


def test_safe_open_reads_referenced_tensors(tmp_path: Path) -> None:
    model, _ = _setup()
    _save(tmp_path, model)
    with torch.no_grad():
        model.head.bias.add_(1)
    _save(tmp_path, model)
    fastckpt.prune(tmp_path, keep_last=1)
    expected = _snapshot(model)
    with fastckpt.safe_open(tmp_path, framework="pt") as handle:
        assert handle.keys() == sorted(f"models/m/{name}" for name in expected)
        for name, tensor in expected.items():
            assert torch.equal(handle.get_tensor(f"models/m/{name}"), tensor), name
        assert torch.equal(
            handle.get_slice("models/m/backbone.weight")[2:4], expected["backbone.weight"][2:4]
        )
    with fastckpt.safe_open(tmp_path, framework="pt", part="models/m") as handle:
        assert handle.keys() == sorted(expected)


@pytest.mark.parametrize("async_save", [False, True])
def test_checkpoint_hook_saves_incrementally_and_keeps_referenced_bytes(
    tmp_path: Path, async_save: bool
) -> None:
    hook = CheckpointHook(tmp_path, step_interval=2, async_save=async_save, keep_last=2)
    strategy = support.new_strategy([hook], num_steps=8)
    model: Any = strategy.models["main"]
    model.net[0].requires_grad_(False)  # the frozen first layer
    strategy.run(support.loader())
    indices = [c["index"] for c in fastckpt.list_checkpoints(tmp_path)]
    assert indices == [2, 3]
    for index in indices:
        assert _referenced(tmp_path, index, "models/main.safetensors") == {
            "net.0.weight",
            "net.0.bias",
        }
    # Each kept index holds its own link: the pruned ones left nothing behind.
    assert sorted(os.listdir(tmp_path)) == ["2", "3", "manifest.json"]
    assert fastckpt.verify(tmp_path).ok
    loaded = fastckpt.load_checkpoint(tmp_path)["models"]["main"]["model"].state_dict()
    _assert_bitwise(dict(strategy.models["main"].state_dict()), dict(loaded))
    # And `rm -rf` of the other kept one breaks nothing either.
    shutil.rmtree(tmp_path / "2")
    loaded = fastckpt.load_checkpoint(tmp_path, 3)["models"]["main"]["model"].state_dict()
    _assert_bitwise(dict(strategy.models["main"].state_dict()), dict(loaded))
    assert fastckpt.verify(tmp_path, 3).ok


def test_fine_tuning_strategy_saves_incrementally(tmp_path: Path) -> None:
    source = support.new_strategy([], num_steps=1)
    source.save_checkpoint(tmp_path / "pre")
    tuned = fastckpt.FineTuningStrategy.from_pretrained_checkpoint(
        tmp_path / "pre", training_fn=support.training_fn, num_steps=2
    )
    model: Any = tuned.models["main"]
    model.net[0].requires_grad_(False)
    tuned.run(support.loader())
    tuned.save_checkpoint(tmp_path / "ft")
    tuned.run(support.loader())
    tuned.num_steps = 4
    tuned.run(support.loader())
    tuned.save_checkpoint(tmp_path / "ft")
    assert _referenced(tmp_path / "ft", 1, "models/main.safetensors") == {
        "net.0.weight",
        "net.0.bias",
    }
    loaded = fastckpt.load_checkpoint(tmp_path / "ft")["models"]["main"]["model"].state_dict()
    _assert_bitwise(dict(tuned.models["main"].state_dict()), dict(loaded))
    tuned.save_checkpoint(tmp_path / "ft", incremental=False)
    assert _refs(tmp_path / "ft", 2) == {}


# --------------------------------------------------------------------------- SIGKILL

_CHILD = r"""
import sys, torch, fastckpt
from torch import nn
root, start = sys.argv[1], int(sys.argv[2])
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 4))
model[0].requires_grad_(False)
if start > 0:
    model.load_state_dict(fastckpt.load_checkpoint(root)["models"]["m"]["model"].state_dict())
    # load_state_dict bumped every version: the first save of this process is full
for n in range(start, start + 10**6):
    with torch.no_grad():
        model[1].weight.fill_(n)
        model[1].bias.fill_(n)
    print(f"saving {n}", flush=True)
    fastckpt.save_checkpoint(root, models={"m": (model, None)}, counters={"n": n})
    fastckpt.prune(root, keep_last=2)
    print(f"saved {n}", flush=True)
"""


def test_sigkill_during_incremental_saves_and_prunes_leaves_the_latest_loadable(
    tmp_path: Path,
) -> None:
    """A child saves a model with a frozen layer after every step and prunes to 2 indices
    (so base indices are retained, referenced and garbage collected all the time); it is
    SIGKILLed at random moments. After every kill the latest committed index verifies and
    loads bitwise, never older than the last acknowledged save."""
    torch.manual_seed(0)
    frozen = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 4))[0].state_dict()
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    root = tmp_path / "root"
    rng = random.Random(11)
    acknowledged = -1
    kills = 0
    start = 0
    while kills < 12:
        child = subprocess.Popen(
            [sys.executable, str(script), str(root), str(start)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert child.stdout is not None
        lines = 0
        target = rng.randint(1, 6)
        while True:
            line = child.stdout.readline()
            assert line, "the child died on its own"
            if line.startswith("saved "):
                acknowledged = int(line.split()[1])
            lines += 1
            if lines >= target:
                break
        time.sleep(rng.random() * 0.05)
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        kills += 1
        assert fastckpt.verify(root).ok, str(fastckpt.verify(root))
        result = fastckpt.load_checkpoint(root)
        n = result["manifest"]["counters"]["n"]
        assert n >= acknowledged
        state = result["models"]["m"]["model"].state_dict()
        assert torch.equal(state["1.weight"], torch.full_like(state["1.weight"], n))
        assert torch.equal(state["1.bias"], torch.full_like(state["1.bias"], n))
        for name, tensor in frozen.items():
            assert torch.equal(state[f"0.{name}"], tensor), name
        start = n + 1
    assert any(_refs(root, c["index"]) for c in fastckpt.list_checkpoints(root))


_HOOK_CHILD = r"""
import sys
sys.path.insert(0, sys.argv[2])
import fastckpt
import training_support as support
from fastckpt.training import CheckpointHook

# Each child starts a fresh run (step 0) into the root the killed one left: overwrite=True,
# or the hook refuses to mix two runs in one root (MixedRunError).
hook = CheckpointHook(sys.argv[1], step_interval=1, keep_last=2, async_save=True, overwrite=True)


def report(ctx, stage):
    if stage is fastckpt.TrainingStage.AFTER_BATCH:
        print(f"acknowledged {hook.last_checkpoint_index}", flush=True)


strategy = support.new_strategy([hook, report], num_steps=10**6)
strategy.models["main"].net[0].requires_grad_(False)
strategy.run(support.loader())
"""


def test_sigkill_during_async_incremental_hook_saves_leaves_the_latest_loadable(
    tmp_path: Path,
) -> None:
    """A TrainingStrategy with a frozen layer and an async CheckpointHook (every step,
    keep_last=2) is SIGKILLed at random moments; each time the latest index verifies, loads,
    is not older than the last index the hook acknowledged, and holds the frozen layer."""
    frozen = support.new_strategy([], num_steps=1).models["main"].state_dict()
    script = tmp_path / "child.py"
    script.write_text(_HOOK_CHILD)
    root = tmp_path / "root"
    rng = random.Random(5)
    for _ in range(6):
        child = subprocess.Popen(
            [sys.executable, str(script), str(root), str(Path(__file__).parent)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert child.stdout is not None
        acknowledged = -1
        for _ in range(rng.randint(3, 12)):
            line = child.stdout.readline()
            assert line, "the child died on its own"
            value = line.split()[1]
            acknowledged = -1 if value == "None" else int(value)
        time.sleep(rng.random() * 0.05)
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        assert fastckpt.verify(root).ok, str(fastckpt.verify(root))
        result = fastckpt.load_checkpoint(root)
        assert result["checkpoint_index"] >= acknowledged
        state = result["models"]["main"]["model"].state_dict()
        for name in ("net.0.weight", "net.0.bias"):
            assert torch.equal(state[name], frozen[name]), name
    assert any(_refs(root, c["index"]) for c in fastckpt.list_checkpoints(root))


def test_a_file_that_fails_in_the_background_fails_the_save_and_leaves_nothing(
    tmp_path: Path,
) -> None:
    """An index's files are written on background threads: a write error still fails the
    save with its own type, commits nothing, leaves no staging directory, and releases the
    root (the next save works)."""
    root = tmp_path / "root"
    good = nn.Linear(4, 4)
    fastckpt.save_checkpoint(root, models={"main": (good, None)})
    bad = nn.Linear(4, 4)
    # Refused by the tensor lane's own check (a meta tensor is refused earlier now, before
    # the root is touched: it no longer reaches the background).
    bad.register_buffer("ghost", torch.zeros(3).to_sparse())
    spec = fastckpt.create_model_spec(nn.Linear, in_features=4, out_features=4)  # as given
    with pytest.raises(fastckpt.errors.InvalidInputError, match=r"'ghost': torch\.sparse_coo"):
        fastckpt.save_checkpoint(root, models={"main": (bad, spec)}, incremental=False)
    assert [row["index"] for row in fastckpt.list_checkpoints(root)] == [0]
    assert sorted(os.listdir(root)) == ["0", "manifest.json"]
    with torch.no_grad():
        good.weight.add_(1.0)
    assert fastckpt.save_checkpoint(root, models={"main": (good, None)}, lock_timeout=5) == 1
    loaded = fastckpt.load_checkpoint(root)["models"]["main"]["model"]
    assert torch.equal(loaded.weight, good.weight)


class _FlipLinkedByte:
    """A hook flipping one byte of the frozen layer's data in the file the newest index
    links (bit rot on the fast tier) after step ``step``'s batch, before its checkpoint."""

    def __init__(self, root: Path, step: int) -> None:
        self.root, self.step = root, step
        self.flipped: Path | None = None

    def __call__(self, ctx: Any, stage: fastckpt.TrainingStage) -> None:
        if stage is not fastckpt.TrainingStage.AFTER_BATCH or ctx.step_count != self.step:
            return
        newest = max(int(p.name) for p in self.root.iterdir() if p.name.isdigit())
        linked = sorted((self.root / str(newest) / "linked").glob("*.safetensors"))
        headers = {path: read_metadata(path) for path in linked}
        (path,) = [path for path, header in headers.items() if "0.weight" in header["tensors"]]
        header = headers[path]
        start = header["data_start"] + header["tensors"]["0.weight"]["data_offsets"][0]
        before = path.stat()
        with open(path, "r+b") as file:
            file.seek(start + 100)
            byte = file.read(1)
            file.seek(start + 100)
            file.write(bytes([byte[0] ^ 1]))
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))  # as the device did it
        self.flipped = path


def test_a_damaged_file_found_by_retention_is_not_linked_into_later_saves(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Incremental saves linked the damaged file again and again (only its size and header
    # checksums are checked at the link): no later index verified, keep_last could delete
    # nothing, and the run never recovered although the live model was intact.
    root = tmp_path / "fast"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 4))
    model[0].requires_grad_(False)
    flip = _FlipLinkedByte(root, 5)
    strategy = fastckpt.TrainingStrategy(
        model,
        fastckpt.OptimizerConfig(torch.optim.AdamW, {"lr": 1e-2}),
        training_fn=lambda m, b: (m(b) - 1).square().mean(),
        hooks=[flip, CheckpointHook(root, step_interval=1, async_save=False, keep_last=3)],
        num_steps=10,
    )
    with caplog.at_level("WARNING", logger="fastckpt"):
        strategy.run([torch.randn(8, 256) for _ in range(10)])
    assert flip.flipped is not None
    assert "this save writes every tensor" in caplog.text
    assert [c["index"] for c in fastckpt.list_checkpoints(root)] == [7, 8, 9]
    assert fastckpt.verify(root).ok
    restored = fastckpt.load_checkpoint(root)["models"]["main"]["model"]
    assert all(torch.equal(restored.state_dict()[k], v) for k, v in model.state_dict().items())
