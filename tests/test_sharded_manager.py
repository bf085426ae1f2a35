"""CheckpointManager on sharded (FSDP2 / DTensor) state: saved on 2 gloo ranks through
``fastckpt.dcp`` (sync and async managers), loaded on 1 rank (plain templates, in this process)
and on 3 ranks (DTensor templates, resharded in place), bitwise."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import fastckpt
from dcp_support import build_model, check_ok, compare, full_state, launch, train_step
from fastckpt.dcp import RECORD_NAME, is_sharded_checkpoint


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    root = tmp_path_factory.mktemp("sharded-manager") / "ckpt"
    root.mkdir()
    outputs = check_ok(launch("manager_save", root, 2, ranks="sharded_ranks"))
    return root, json.loads(outputs[0].strip().splitlines()[-1])


def test_sharded_saves_are_dcp_checkpoints_and_strict_schema_applies(
    saved: tuple[Path, dict[str, Any]],
) -> None:
    root, report = saved
    for name in ("sync", "async", "async-2", "module"):
        assert is_sharded_checkpoint(root / name), name
        assert not (root / name / "commit.json").exists()
    assert "'lr'" in report["strict"] and "strict mode" in report["strict"]
    assert not (root / "refused").exists()
    assert report["second_done"]


def _load_plain(root: Path, name: str) -> tuple[torch.nn.Module, Any, dict[str, Any]]:
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    msd, osd = get_state_dict(model, optimizer)
    with fastckpt.CheckpointManager() as manager:
        loaded = manager.load(root / name, into={"model": msd, "optim": osd, "step": 0})
    set_state_dict(
        model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"]
    )
    return model, optimizer, loaded


@pytest.mark.parametrize(("name", "step"), [("sync", 2), ("async", 3), ("async-2", 4)])
def test_sharded_manager_checkpoint_loads_on_one_rank_bitwise(
    saved: tuple[Path, dict[str, Any]], name: str, step: int
) -> None:
    root, report = saved
    model, optimizer, loaded = _load_plain(root, name)
    expected = safetensors.torch.load_file(root / f"reference-{name}.safetensors")
    assert compare(expected, full_state(model, optimizer)) == []
    assert loaded["step"] == step
    if step < len(report["losses"]):  # training goes on as the 2-rank run did
        assert train_step(model, optimizer, step) == pytest.approx(report["losses"][step], 1e-5)


def test_sharded_manager_checkpoint_loads_whole_without_templates(
    saved: tuple[Path, dict[str, Any]],
) -> None:
    root, _ = saved
    with fastckpt.CheckpointManager() as manager:
        everything = manager.load(root / "sync")
    assert sorted(everything) == ["model", "optim", "step"]
    expected = safetensors.torch.load_file(root / "reference-sync.safetensors")
    for name, tensor in everything["model"].items():
        assert torch.equal(tensor, expected[f"model.{name}"]), name
    assert everything["step"] == 2


def test_sharded_manager_checkpoint_loads_on_three_ranks_resharded(
    saved: tuple[Path, dict[str, Any]],
) -> None:
    root, report = saved
    reports = [
        json.loads(out.strip().splitlines()[-1])
        for out in check_ok(launch("manager_load", root, 3, ranks="sharded_ranks"))
    ]
    rank0 = reports[0]
    assert rank0["sync_bad"] == [] and rank0["async_bad"] == []
    assert all(r["sync_step"] == 2 and r["async_step"] == 3 for r in reports)
    assert rank0["sync_loss"] == pytest.approx(report["losses"][2], rel=1e-5)
    assert rank0["async_loss"] == pytest.approx(report["losses"][3], rel=1e-5)
    # an FSDP2 module saved and loaded as a stateful object: restored in place, resharded
    assert all(r["module_is_template"] for r in reports)
    assert rank0["module_bad"] == []
    errors = rank0["errors"]
    assert errors["shape"].startswith("CheckpointMismatchError: model.0.weight")
    assert "[301, 38]" in errors["shape"]
    assert errors["strict"].startswith("CheckpointMismatchError: epoch: not in checkpoint")
    assert errors["template"].startswith("TypeError: model.0.weight: cannot load into")


def test_damaged_sharded_checkpoint_is_refused_by_the_manager(
    saved: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    root, _ = saved
    record = json.loads((root / "sync" / RECORD_NAME).read_text())
    copy = tmp_path / "copy"
    shutil.copytree(root / "sync", copy)
    shard = max((copy / record["generation"]).glob("*.safetensors"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[-7] ^= 0x40
    shard.write_bytes(data)
    with (
        fastckpt.CheckpointManager() as manager,
        pytest.raises(fastckpt.ChecksumMismatchError, match=shard.name),
    ):
        manager.load(copy)


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_sharded_manager_checkpoints_are_promoted_and_restore_from_the_durable_tier(
    tmp_path: Path, kind: str
) -> None:
    # Tiers for DTensor state: each save (a DCP container written by both ranks) is promoted
    # with every rank's files and its record; each tier keeps its newest 2; with the fast
    # tier gone (a new node) load_latest restores from the durable copy, resharded on 1 rank
    # (here) and on 3 ranks, bitwise.
    from fastckpt.container.promote_checkpoints import committed_checkpoints
    from fastckpt.format.records import read_record_bytes

    outputs = check_ok(launch("manager_tiers_save", tmp_path, 2, kind, ranks="sharded_ranks"))
    reports = [json.loads(out.strip().splitlines()[-1]) for out in outputs]
    assert all(r["healthy"] for r in reports), reports
    assert reports[0]["promoted"] == ["step_1", "step_2", "step_3"], reports
    fast, durable = tmp_path / "fast", tmp_path / "durable"
    assert committed_checkpoints(fast) == committed_checkpoints(durable) == ["step_2", "step_3"]
    for name in ("step_2", "step_3"):
        assert is_sharded_checkpoint(durable / name)
        assert read_record_bytes(durable / name, RECORD_NAME) == read_record_bytes(
            fast / name, RECORD_NAME
        )
        assert fastckpt.verify(durable / name).ok
    shutil.rmtree(fast)
    config = fastckpt.CheckpointManager.Config.with_sync_save()
    config.tiers = fastckpt.TiersConfig(fast=fast, durable=durable)
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    msd, osd = get_state_dict(model, optimizer)
    with fastckpt.CheckpointManager(config) as manager:
        loaded = manager.load_latest(into={"model": msd, "optim": osd, "step": 0})
        assert manager.restored_from is not None
        assert manager.restored_from.path == durable / "step_3"
    set_state_dict(
        model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"]
    )
    expected = safetensors.torch.load_file(tmp_path / "reference-tiers.safetensors")
    assert compare(expected, full_state(model, optimizer)) == []
    if kind == "async":
        return  # the resharded load does not depend on how the save ran
    loads = check_ok(launch("manager_tiers_load", tmp_path, 3, ranks="sharded_ranks"))
    for out in loads:
        report = json.loads(out.strip().splitlines()[-1])
        assert report["restored"] == ["durable", "step_3"] and report["step"] == 3, report
        assert report.get("bad", []) == [], report


def test_load_latest_loads_one_checkpoint_on_every_rank_when_their_tiers_disagree(
    tmp_path: Path,
) -> None:
    # Rank 0 sees step_3 as the newest intact checkpoint, rank 1 (another durable tier,
    # without step_3) step_2: loading each rank's own latest would mix two checkpoints'
    # shards into one state. Both ranks load step_2, the one both hold, and say that step_3
    # was passed over; the state is step_2's, bitwise.
    check_ok(launch("manager_tiers_save", tmp_path, 2, "sync", ranks="sharded_ranks"))
    shutil.rmtree(tmp_path / "fast")
    shutil.copytree(tmp_path / "durable", tmp_path / "durable-old")
    shutil.rmtree(tmp_path / "durable-old" / "step_3")
    outputs = check_ok(launch("manager_tiers_load_disagree", tmp_path, 2, ranks="sharded_ranks"))
    reports = [json.loads(out.strip().splitlines()[-1]) for out in outputs]
    assert [r["restored"] for r in reports] == [["durable", "step_2"], ["durable-old", "step_2"]]
    assert all(r["step"] == 2 for r in reports), reports
    assert any("step_3: not intact on every rank" in s for s in reports[0]["skipped"]), reports
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    msd, osd = get_state_dict(model, optimizer)
    loaded = fastckpt.CheckpointManager().load(
        tmp_path / "durable" / "step_2", into={"model": msd, "optim": osd, "step": 0}
    )
    set_state_dict(
        model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"]
    )
    agreed = safetensors.torch.load_file(tmp_path / "gathered-agreed.safetensors")
    assert compare(full_state(model, optimizer), agreed) == []


def test_ranks_holding_different_plain_values_beside_dtensors_are_refused_not_collapsed(
    tmp_path: Path,
) -> None:
    """DCP keeps one copy of every entry that is not a DTensor: before, a manager save of
    DTensor state gave every rank rank 1's loader position on load, without a word. Such a
    save is refused on every rank; values under each rank's own key load back per rank."""
    outputs = check_ok(launch("manager_per_rank_values", tmp_path, 2, ranks="sharded_ranks"))
    reports = [json.loads(out.strip().splitlines()[-1]) for out in outputs]
    for report in reports:
        assert "ranks hold different values at loader.position" in report["refused"]
        assert not report["mixed_exists"]
        assert report["loaded"] == [100 + report["rank"], 3]


def test_a_sharded_save_over_an_unsharded_checkpoint_replaces_it(tmp_path: Path) -> None:
    """A sharded save to the id of an unsharded checkpoint left that checkpoint's commit.json
    and files beside the sharded one: ``verify`` checked the stale files (ok, with the sharded
    rank file damaged) while loads read the sharded checkpoint, and the next unsharded save
    refused the id. Now the sharded commit removes them; a folder holding both records is
    refused by every reader."""
    from fastckpt.errors import CheckpointFormatError

    outputs = check_ok(launch("manager_unsharded_then_sharded", tmp_path, 2, ranks="sharded_ranks"))
    names = json.loads(outputs[0].strip().splitlines()[-1])
    last = tmp_path / "last"
    assert "commit.json" not in names and "fastckpt-dcp.json" in names
    assert [n for n in names if not n.startswith("g-")] == ["fastckpt-dcp.json"]
    assert fastckpt.verify(last).ok
    (rank_file,) = last.glob("g-*/rank-00000.safetensors")
    data = bytearray(rank_file.read_bytes())
    data[-3] ^= 0x40
    rank_file.write_bytes(bytes(data))
    assert not fastckpt.verify(last).ok
    # An unsharded save replaces the sharded one whole (it took its files for the user's).
    with fastckpt.CheckpointManager(fastckpt.CheckpointManager.Config.with_sync_save()) as m:
        m.save(last, {"w": torch.zeros(2), "step": 3})
        assert m.load(last)["step"] == 3
    assert sorted(p.name for p in last.iterdir()) == [
        "commit.json",
        "step.json",
        "step.safetensors",
        "w.json",
        "w.safetensors",
    ]
    (last / "fastckpt-dcp.json").write_text("{}")
    report = fastckpt.verify(last)
    assert not report.ok and "both commit.json" in report.failures[0].message
    with pytest.raises(CheckpointFormatError, match=r"both commit\.json"):
        fastckpt.safe_open(last)


def test_what_a_killed_sharded_save_left_of_the_unsharded_checkpoint_is_replaced(
    tmp_path: Path,
) -> None:
    # A sharded save over an unsharded checkpoint removes that one's commit.json, then its
    # files: killed in between, the files stayed beside the sharded record, and the next
    # unsharded save refused the id (NotACheckpointError: files its record does not name).
    from fastckpt.errors import NotACheckpointError

    old = tmp_path / "old"
    with fastckpt.CheckpointManager(fastckpt.CheckpointManager.Config.with_sync_save()) as m:
        m.save(old, {"w": torch.ones(3), "step": 1})
    target = tmp_path / "step"
    fastckpt.dcp.save_state(target, {"w": torch.full((3,), 2.0)})
    for name in ("w.safetensors", "w.json", "step.json"):  # the kill's leftovers
        shutil.copy(old / name, target / name)
    with fastckpt.CheckpointManager(fastckpt.CheckpointManager.Config.with_sync_save()) as m:
        m.save(target, {"w": torch.zeros(3), "step": 3})
        assert m.load(target)["step"] == 3
    assert fastckpt.verify(target).ok
    # A file an unsharded checkpoint never writes is still the user's, and refused.
    fastckpt.dcp.save_state(tmp_path / "other", {"w": torch.full((3,), 2.0)})
    (tmp_path / "other" / "notes.txt").write_text("mine")
    config = fastckpt.CheckpointManager.Config.with_sync_save()
    with (
        fastckpt.CheckpointManager(config) as m,
        pytest.raises(NotACheckpointError, match=r"notes\.txt"),
    ):
        m.save(tmp_path / "other", {"w": torch.zeros(3)})
    assert (tmp_path / "other" / "notes.txt").read_text() == "mine"
