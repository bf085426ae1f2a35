"""The CLI on roots holding incremental saves: ``prune`` reports the bytes it keeps for kept
checkpoints' references as kept, not freed."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import fastckpt
from fastckpt import cli
from fastckpt.container import incremental

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import crash_harness


@pytest.fixture(autouse=True)
def _fresh_trackers() -> None:
    incremental.forget()


def _save_four(root: Path, *, legacy: bool = False) -> nn.Module:
    """Four saves; ``legacy``: as earlier versions wrote them (references into index 0's own
    file, see crash_harness.legacy_references)."""
    with crash_harness.legacy_references() if legacy else contextlib.nullcontext():
        return _save_four_now(root)


def _save_four_now(root: Path) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 2))
    model[0].requires_grad_(False)  # the frozen part: index 0 holds its bytes
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    for _ in range(4):
        optimizer.zero_grad()
        model(torch.randn(4, 256)).sum().backward()
        optimizer.step()
        fastckpt.save_checkpoint(root, models={"m": (model, None)})
    return model


def _bytes_on_disk(root: Path) -> int:
    """The bytes of the indices' files, each hard-linked file once (the manifest left out)."""
    sizes = {}
    for path in root.rglob("*"):
        if path.is_file() and path != root / "manifest.json":
            info = path.stat()
            sizes[(info.st_dev, info.st_ino)] = info.st_size
    return sum(sizes.values())


def test_prune_counts_linked_bytes_as_kept(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Index 3 holds a hard link to index 0's file of the frozen layer: deleting 0, 1 and 2
    frees only what no kept file shares, and nothing is retained as ``.ref-<i>``."""
    root = tmp_path / "run"
    _save_four(root)
    frozen = (root / "0" / "models" / "m.safetensors").stat().st_size
    assert (root / "3" / "linked" / "0.safetensors").stat().st_size == frozen
    before = _bytes_on_disk(root)
    sizes = {row["index"]: row["size"] for row in fastckpt.list_checkpoints(root)}
    assert cli.main(["prune", str(root), "--keep-last", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["deleted"] == [0, 1, 2]
    assert report["retained_for_references"] == []
    # list_checkpoints' sizes are what each save wrote (indices 1 and 2 link that file):
    # everything they wrote is freed, but index 0's file, which index 3 holds.
    assert report["freed_bytes"] == sum(sizes[i] for i in (0, 1, 2)) - frozen
    assert sorted(os.listdir(root)) == ["3", "manifest.json"]
    assert _bytes_on_disk(root) == before - report["freed_bytes"]
    assert fastckpt.verify(root).ok


def test_prune_counts_retained_bytes_as_kept(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "run"
    _save_four(root, legacy=True)
    sizes = {row["index"]: row["size"] for row in fastckpt.list_checkpoints(root)}
    assert cli.main(["prune", str(root), "--keep-last", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["deleted"] == [0, 1, 2]
    # Index 3 references the frozen layer's bytes in index 0: they are retained, not freed.
    assert report["retained_for_references"] == [0]
    assert report["freed_bytes"] == sizes[1] + sizes[2]
    assert ".ref-0" in os.listdir(root)
    assert fastckpt.verify(root).ok


def test_prune_text_names_the_retained_index(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "run"
    _save_four(root, legacy=True)
    assert cli.main(["prune", str(root), "--keep-last", "1", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("would delete index(es) 0, 1, 2 (")
    assert "index(es) 0 stay as references of kept incremental saves" in out


def test_prune_retains_only_pruned_bases_and_stale_copies_are_cleaned(tmp_path: Path) -> None:
    """Bytes of a kept index stay in the index itself: a prune makes no ``.ref-<i>`` copy of
    it; a copy left by a prune killed before its commit (the index still committed) is
    removed by the next save; loads stay bitwise."""
    root = tmp_path / "run"
    model = _save_four(root, legacy=True)  # 1, 2 and 3 reference index 0
    # What a kill between the retained copy and the manifest commit leaves: a copy of an
    # index that is still committed (and referenced).
    shutil.copytree(root / "0", root / ".ref-0")
    fastckpt.save_checkpoint(root, models={"m": (model, None)}, incremental=False)  # 4: full
    assert not [n for n in os.listdir(root) if n.startswith(".")]
    with crash_harness.legacy_references():
        fastckpt.save_checkpoint(root, models={"m": (model, None)})  # 5 references 4
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    assert fastckpt.prune(root, keep_last=3) == [0, 1, 2]  # keeps 3 (-> 0), 4, 5 (-> 4)
    assert sorted(n for n in os.listdir(root) if n.startswith(".")) == [".ref-0"]
    loaded = fastckpt.load_checkpoint(root)["models"]["m"]["model"].state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in expected.items())
    assert fastckpt.verify(root).ok


def _cli_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, object]:
    cli.main([*args, "--json"])
    return json.loads(capsys.readouterr().out)


def test_ls_inspect_and_verify_show_one_size(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One definition of a checkpoint's size (the bytes its save wrote, and the bytes it holds
    as links to files an earlier save wrote), the same in ls, inspect and verify, as JSON and
    as text; verify reports the bytes it read besides."""
    root = tmp_path / "run"
    _save_four(root)
    rows = _cli_json(capsys, "ls", str(root))["checkpoints"]
    assert isinstance(rows, list)
    by_index = {row["index"]: (row["size"], row["linked_size"]) for row in rows}
    assert by_index[0][1] == 0 and by_index[3][1] > 0  # index 3 links index 0's frozen layer
    assert by_index == {
        row["index"]: (row["size"], row["linked_size"]) for row in fastckpt.list_checkpoints(root)
    }
    for index, (size, linked) in by_index.items():
        shown = _cli_json(capsys, "inspect", str(root / str(index)))
        assert (shown["size"], shown["linked_size"]) == (size, linked)
        checked = _cli_json(capsys, "verify", str(root), "--index", str(index))
        assert (checked["size"], checked["linked_size"]) == (size, linked)
        assert checked["bytes"] >= size + linked  # the record is read too
    whole = _cli_json(capsys, "verify", str(root))
    assert whole["size"] == sum(s for s, _ in by_index.values())
    assert whole["linked_size"] == sum(linked for _, linked in by_index.values())

    size, linked = by_index[3]
    text = (
        fastckpt.io.progress.format_bytes(size) + " + " + fastckpt.io.progress.format_bytes(linked)
    )
    for args in (
        ["ls", str(root)],
        ["inspect", str(root / "3")],
        ["verify", str(root), "--index", "3"],
    ):
        cli.main(args)
        assert f"{text} linked" in capsys.readouterr().out, args


def test_manager_sizes_agree_between_ls_inspect_and_verify(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    parent = tmp_path / "ckpts"
    with fastckpt.CheckpointManager() as manager:
        for step in (1, 2):
            manager.save(str(parent / f"step_{step}"), {"model": model.state_dict(), "step": step})
    rows = _cli_json(capsys, "ls", str(parent))["checkpoints"]
    assert isinstance(rows, list) and len(rows) == 2
    for row in rows:
        shown = _cli_json(capsys, "inspect", row["path"])
        checked = _cli_json(capsys, "verify", row["path"])
        assert shown["size"] == checked["size"] == row["size"] > 0
        assert shown["linked_size"] == checked["linked_size"] == row["linked_size"]


def test_inspect_counts_every_tensor_of_an_incremental_manager_item(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An incremental manager checkpoint's item holds the tensors its own file has and those
    it references: ``inspect`` counts them all, as ``load`` returns them. Before, it counted
    its own file's only ("item model: 1 tensor(s)" for a weight and a bias)."""
    model = nn.Linear(4, 4)
    with fastckpt.CheckpointManager(fastckpt.CheckpointManager.Config.with_sync_save()) as m:
        m.save(tmp_path / "s1", {"model": model.state_dict()})
        with torch.no_grad():
            model.weight.add_(1)  # the bias is unchanged: referenced, not written
        m.save(tmp_path / "s2", {"model": model.state_dict()})
        assert sorted(m.load(tmp_path / "s2")["model"]) == ["bias", "weight"]
    assert cli.main(["--json", "inspect", str(tmp_path / "s2")]) == 0
    (item,) = json.loads(capsys.readouterr().out)["items"]
    assert item["tensors"] == 2, item
    assert cli.main(["inspect", str(tmp_path / "s2")]) == 0
    assert "item model: 2 tensor(s)" in capsys.readouterr().out
