"""Costs that must not grow with a checkpoint's size: the work a load or a save repeats per
item or per index.

Timings are not asserted (the machine is shared); the repeated work is counted instead, with
spies on the real functions, over real saves and loads in real directories.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import fastckpt
from fastckpt.container import links
from fastckpt.format import records
from fastckpt.format.records import MANIFEST, Manifest, nesting_depth, seal_manifest
from fastckpt.manager import CheckpointManager
from fastckpt.storage.backend import ATOMIC_TEMP_INFIX

#: Items of the manager checkpoints below (each references one tensor of its base).
ITEMS = 40


def _state(items: int) -> dict[str, Any]:
    return {f"item{i}": {"w": torch.full((3,), float(i))} for i in range(items)}


@pytest.fixture
def incremental_checkpoint(tmp_path: Path) -> Path:
    """``b``: an incremental manager checkpoint of :data:`ITEMS` items, every tensor a
    reference to its base ``a`` (unchanged since)."""
    state = _state(ITEMS)
    with CheckpointManager(CheckpointManager.Config.with_sync_save()) as manager:
        manager.save(tmp_path / "a", state)
        manager.save(tmp_path / "b", state)
    refs = links.read_references(records.read_commit_record(tmp_path / "b"), "commit.json")
    assert sum(len(names) for names in refs.values()) == ITEMS  # every tensor referenced
    return tmp_path / "b"


@pytest.fixture
def validated(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The ``where`` of each reference validated (one ``check_fields`` call of
    :mod:`fastckpt.container.links` per reference)."""
    seen: list[str] = []
    original = links.check_fields

    def spy(record: Any, fields: Any, where: str) -> None:
        seen.append(where)
        original(record, fields, where)

    monkeypatch.setattr(links, "check_fields", spy)
    yield seen


@pytest.mark.parametrize("into", [False, True], ids=["mapped", "into-templates"])
def test_a_load_of_an_incremental_checkpoint_validates_each_reference_once(
    incremental_checkpoint: Path, validated: list[str], into: bool
) -> None:
    """Before, every item's read (``read_item``, and ``plan_direct_read`` for loads into
    templates) validated the whole record's references and kept its own entry: a load of K
    items validated K * K references (1000 items: 28 s, against 0.16 s for the same
    checkpoint written in full). Now each reference is validated once per load."""
    templates = {f"item{i}": {"w": torch.zeros(3)} for i in range(ITEMS)} if into else None
    with CheckpointManager(CheckpointManager.Config.with_sync_save()) as manager:
        loaded = manager.load(incremental_checkpoint, templates)
    assert len(validated) == ITEMS, f"{len(validated)} validations for {ITEMS} references"
    assert len(set(validated)) == ITEMS
    for i in range(ITEMS):
        assert torch.equal(loaded[f"item{i}"]["w"], torch.full((3,), float(i)))
        if templates is not None:
            assert loaded[f"item{i}"]["w"] is templates[f"item{i}"]["w"]


@pytest.mark.parametrize("into", [False, True], ids=["mapped", "into-templates"])
def test_a_hostile_reference_of_another_item_still_fails_the_load(
    incremental_checkpoint: Path, into: bool
) -> None:
    """Validating once per load keeps what validating per item did: a reference edited in
    any item's entry fails the load, naming the record, the entry and the field, even where
    the item it belongs to is read last."""
    path = incremental_checkpoint / "commit.json"
    record = json.loads(path.read_text())
    last = f"item{ITEMS - 1}.safetensors"
    record["refs"][last]["w"]["offsets"] = [8, 4]
    path.write_text(json.dumps(seal_manifest(record)))
    templates = {f"item{i}": {"w": torch.zeros(3)} for i in range(ITEMS)} if into else None
    with (
        CheckpointManager(CheckpointManager.Config.with_sync_save()) as manager,
        pytest.raises(fastckpt.CheckpointFormatError, match=r"\.offsets must be") as caught,
    ):
        manager.load(incremental_checkpoint, templates)
    assert "commit.json" in str(caught.value) and last in str(caught.value)


def test_a_changed_record_is_validated_again(incremental_checkpoint: Path) -> None:
    """The references validated once are those of one record object: another record (a
    reread after a commit) or a record whose ``refs`` were replaced is validated anew."""
    record = records.read_commit_record(incremental_checkpoint)
    where = str(incremental_checkpoint / "commit.json")
    assert set(links.item_references(record, where, "item0.safetensors")) == {"w"}
    hostile = json.loads(json.dumps(record["refs"]))
    hostile["item0.safetensors"]["w"]["nbytes"] = "12"
    record["refs"] = hostile
    with pytest.raises(fastckpt.CheckpointFormatError, match=r"\.nbytes must be int"):
        links.item_references(record, where, "item5.safetensors")
    other = records.read_commit_record(incremental_checkpoint)
    other["refs"]["item0.safetensors"]["w"]["file"] = "../elsewhere"
    with pytest.raises(fastckpt.CheckpointFormatError, match=r"\.file"):
        links.read_references(other, where)


# --------------------------------------------------------------------------- saves


@pytest.fixture
def manifest_parses(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Path]]:
    """The path of each manifest parsed (:meth:`Manifest.parse`: what every
    :meth:`Manifest.load` does)."""
    parsed: list[Path] = []
    original: Callable[..., Manifest] = Manifest.parse.__func__  # type: ignore[attr-defined]

    def spy(cls: type[Manifest], root: Path, path: Path, raw: bytes, **kw: Any) -> Manifest:
        parsed.append(path)
        return original(cls, root, path, raw, **kw)

    monkeypatch.setattr(Manifest, "parse", classmethod(spy))
    yield parsed


def _model(value: float) -> torch.nn.Linear:
    model = torch.nn.Linear(4, 2)
    with torch.no_grad():
        model.weight.fill_(value)
        model.bias.fill_(value)
    return model


@pytest.mark.parametrize("indices", [1, 25])
@pytest.mark.parametrize(
    "how",
    ["incremental", "full", "replacing"],
)
def test_a_save_parses_the_manifest_once_whatever_the_index_count(
    tmp_path: Path, manifest_parses: list[Path], indices: int, how: str
) -> None:
    """Before, one ``save_checkpoint`` parsed the root's manifest 6 times (before the lock,
    twice around the clean-up, once more after it, for the reference checks, and at the
    commit), each parse validating every index: a save into a root of 1000 indices spent
    0.91 s of its 1.16 s there. Now it is parsed once, under the root's lock, and that
    manifest is handed along (the lock keeps every other writer out until the commit)."""
    root = tmp_path / "root"
    for i in range(indices):
        fastckpt.save_checkpoint(root, models={"m": (_model(float(i % 3)), None)})
    manifest_parses.clear()
    value = float(indices % 3)  # "incremental": unchanged since the last save
    index = fastckpt.save_checkpoint(
        root,
        models={"m": (_model(value if how == "incremental" else 7.0), None)},
        incremental=how != "full",
        checkpoint_index=indices - 1 if how == "replacing" else None,
    )
    assert manifest_parses == [root / MANIFEST]
    assert index == (indices - 1 if how == "replacing" else indices)
    assert fastckpt.verify(root).ok
    loaded = fastckpt.load_checkpoint(root, checkpoint_index=index)["models"]["m"]["model"]
    expected = value if how == "incremental" else 7.0
    assert torch.equal(loaded.weight, torch.full((2, 4), expected))
    assert sorted(Manifest.load(root).entries) == list(range(max(index + 1, indices)))


def test_a_save_that_undoes_an_interrupted_replacement_commits_on_the_restored_manifest(
    tmp_path: Path,
) -> None:
    """The one read a save skips no longer: the clean-up under the lock puts back an index
    whose replacement was interrupted (its writer died between withdrawing it and
    committing the new one), which changes the manifest; the save then works on the
    manifest as restored, not the one read before (it would commit the index withdrawn)."""
    root = tmp_path / "root"
    fastckpt.save_checkpoint(root, models={"m": (_model(1.0), None)})
    fastckpt.save_checkpoint(root, models={"m": (_model(2.0), None)})
    # What _replace_local leaves when killed right after withdrawing index 0: the old
    # manifest kept as a hard link, index 0 withdrawn from the current one.
    old = root / f".{MANIFEST}{ATOMIC_TEMP_INFIX}old.dead"
    kept = Manifest.load(root)
    (root / MANIFEST).rename(old)
    withdrawn = Manifest(root, {1: kept.entries[1]})
    withdrawn.commit()
    assert sorted(Manifest.load(root).entries) == [1]
    assert fastckpt.save_checkpoint(root, models={"m": (_model(3.0), None)}) == 2
    assert sorted(Manifest.load(root).entries) == [0, 1, 2]
    assert fastckpt.verify(root).ok
    for index, value in enumerate((1.0, 2.0, 3.0)):
        loaded = fastckpt.load_checkpoint(root, checkpoint_index=index)["models"]["m"]["model"]
        assert torch.equal(loaded.weight, torch.full((2, 4), value))


@pytest.mark.parametrize(
    "value",
    [
        0,
        "x",
        [],
        {},
        [[[]]],
        {"a": {"b": [1, {"c": (2, 3)}]}, "d": [[[[]]]]},
        [{"a": 1}] * 50,
    ],
)
def test_nesting_depth_counts_containers_as_before(value: Any) -> None:
    """The nesting walk of every JSON document a checkpoint holds (the manifest included)
    visits containers only: the same depths as the walk of every value."""

    def reference(item: Any) -> int:
        if isinstance(item, dict):
            return 1 + max((reference(v) for v in item.values()), default=0)
        if isinstance(item, (list, tuple)):
            return 1 + max((reference(v) for v in item), default=0)
        return 0

    assert nesting_depth(value) == reference(value)


def test_nesting_depth_stops_past_its_limit() -> None:
    deep: Any = []
    for _ in range(1000):
        deep = [deep, 1]
    assert nesting_depth(deep, limit=10) == 11
    assert nesting_depth(deep) == records.MAX_JSON_DEPTH + 1


def test_nesting_depth_of_shared_or_cyclic_containers_is_bounded() -> None:
    """A container nested in itself, or shared down a 300-level chain, is walked once per
    level: the walk stops past the limit at once. Before the review of round 16, each level
    held every path to it (2**depth containers): a ``CheckpointManager.save`` of
    ``d = {"w": t}; d["a"] = d; d["b"] = d`` ran out of memory instead of refusing the nest."""
    cyclic: dict[str, Any] = {"w": 1}
    cyclic["a"] = cyclic
    cyclic["b"] = cyclic
    assert nesting_depth(cyclic) == records.MAX_JSON_DEPTH + 1
    shared: Any = {"a": 1}
    for _ in range(300):
        shared = {"left": shared, "right": shared}
    assert nesting_depth(shared) == records.MAX_JSON_DEPTH + 1
    assert nesting_depth(shared, limit=500) == 301


def test_a_load_with_an_optimizer_lists_each_models_parameters_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Round 21, scale finding 1: rebuilding an optimizer listed its model's parameters once
    per parameter reference, so ``load_checkpoint`` of a model + Adam grew with the square of
    the parameter count (103 s at 8000 parameters, most of it in ``named_parameters``).
    Now once per model."""
    model = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(50)])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    fastckpt.save_checkpoint(
        tmp_path, models={"m": (model, None)}, optimizers={"adam": (optimizer, None)}
    )
    calls: list[int] = []
    real = torch.nn.Module.named_parameters

    def counted(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        if self.__class__ is torch.nn.Sequential:
            calls.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "named_parameters", counted)
    loaded = fastckpt.load_checkpoint(tmp_path)
    rebuilt = loaded["models"]["m"]["optimizers"]["adam"]["optimizer"]
    assert len(rebuilt.param_groups[0]["params"]) == 100
    assert len(calls) < 10, len(calls)  # was one per parameter reference: 100 more


def test_the_recipe_check_resolves_each_class_of_a_container_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Round 21, scale finding 2: checking the recipe of an ``nn.Sequential`` of N
    submodules normalized a list of N allowed class paths once per submodule: O(N^2)
    (137 s at 8000 submodules, at the first save or ``TrainingStrategy`` set-up). Now each
    distinct class is listed once."""
    from fastckpt.checkpoint import build, trust

    model = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(200)])
    validated: list[str] = []
    real = trust.validate_dotted_path

    def counted(path: str) -> str:
        validated.append(path)
        return real(path)

    monkeypatch.setattr(trust, "validate_dotted_path", counted)
    build.check_recordable(model)
    # Before: 200 targets x 201 allowed paths validated each time (> 40,000 calls).
    assert len(validated) < 2000, len(validated)


def test_a_save_in_a_fresh_process_imports_neither_dynamo_nor_fsdp(tmp_path: Path) -> None:
    """Round 21: the first save of every process imported ``torch._dynamo`` (to ask whether
    the model was ``torch.compile``'d) and ``torch.distributed.fsdp`` (whether it was
    sharded): seconds of imports (7 s on the CI machine) for what no such process made. A
    model compiled or sharded in this process has them imported already."""
    import subprocess
    import sys

    script = (
        "import sys, torch, fastckpt\n"
        "model = torch.nn.Sequential(torch.nn.Linear(2, 2))\n"
        f"fastckpt.save_checkpoint({str(tmp_path)!r}, models={{'m': (model, None)}})\n"
        f"fastckpt.load_checkpoint({str(tmp_path)!r})\n"
        "heavy = ('torch._dynamo', 'torch.distributed.fsdp')\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=300
    )
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout + done.stderr


def test_a_root_manifest_is_written_by_jsons_c_encoder_one_line_per_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Round 22: ``manifest.json`` was dumped with ``indent=1``, which takes json's
    pure-Python encoder: rewriting a manifest of 2000 indices cost ~0.15 s at every save.
    Each line is now encoded by the C encoder (the pure-Python one must not run), one line per
    checkpoint, and the file reads back as the same manifest."""
    root = tmp_path / "root"
    for _ in range(3):
        fastckpt.save_checkpoint(root, models={"main": torch.nn.Linear(2, 2)})
    manifest = Manifest.load(root, verify_checksum=True)

    def pure_python_encoder(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("json's pure-Python encoder ran")

    monkeypatch.setattr(json.encoder, "_make_iterencode", pure_python_encoder)
    raw = manifest.to_json()
    lines = raw.decode().splitlines()
    assert [line.split(":")[0].strip() for line in lines if line.startswith("  ")] == [
        '"0"',
        '"1"',
        '"2"',
    ]
    # the braces, format, schema_version, latest, crc32c, "checkpoints": { and its }
    assert len(lines) == 3 + 8
    again = Manifest.parse(root, root / MANIFEST, raw, verify_checksum=True)
    assert again.entries == manifest.entries and json.loads(raw)["latest"] == 2
