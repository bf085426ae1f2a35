"""Sharded (DCP) checkpoints in fastckpt.verify and the command line: verify, ls, inspect and
export understand them without a process group (issue 12, part 4)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import fastckpt
import fastckpt.dcp


def fastckpt_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fastckpt", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A one-process DCP checkpoint written through fastckpt.dcp.Writer, among manager ones."""
    runs = tmp_path_factory.mktemp("runs")
    torch.manual_seed(0)
    state = {"model": {"w": torch.randn(7, 5), "b": torch.zeros(5)}, "step": torch.tensor(3)}
    with pytest.warns(UserWarning, match="single process"):
        dcp.save(state, storage_writer=fastckpt.dcp.Writer(runs / "step_3"))
    with fastckpt.CheckpointManager(fastckpt.CheckpointManager.Config.with_sync_save()) as m:
        m.save(runs / "step_1", {"model": {"w": torch.ones(2)}, "step": 1})
    flat = {"model.w": state["model"]["w"], "model.b": state["model"]["b"], "step": state["step"]}
    return runs / "step_3", flat


def test_verify_reports_a_sharded_checkpoint_and_its_damage(
    sharded: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    checkpoint, _ = sharded
    report = fastckpt.verify(checkpoint)
    assert report.ok and report.kind == "sharded"
    names = [f.path.name for f in report.files]
    assert names[0] == "fastckpt-dcp.json" and "rank-00000.safetensors" in names
    done = fastckpt_cli("verify", str(checkpoint), cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr

    damaged = tmp_path / "damaged"
    subprocess.run(["cp", "-r", str(checkpoint), str(damaged)], check=True)
    (rank_file,) = damaged.glob("g*/rank-00000.safetensors")
    data = bytearray(rank_file.read_bytes())
    data[-3] ^= 0x40
    rank_file.write_bytes(bytes(data))
    report = fastckpt.verify(damaged)
    assert not report.ok
    assert [f.path.name for f in report.failures] == ["rank-00000.safetensors"]
    assert not fastckpt.dcp.verify_sharded(damaged).ok  # the same check
    done = fastckpt_cli("verify", str(damaged), cwd=tmp_path)
    assert done.returncode == 1 and "rank-00000.safetensors" in done.stdout + done.stderr


def test_inspect_and_ls_show_global_shapes_and_list_it(
    sharded: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    checkpoint, _ = sharded
    done = fastckpt_cli("inspect", str(checkpoint), "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)
    assert info["kind"] == "sharded"
    assert info["tensors"]["model.w"] == {"dtype": "float32", "shape": [7, 5], "chunks": 1}
    text = fastckpt_cli("inspect", str(checkpoint), cwd=tmp_path).stdout
    assert "sharded checkpoint (DCP)" in text and "model.w" in text and "[7, 5]" in text

    listing = fastckpt_cli("ls", str(checkpoint.parent), "--json", cwd=tmp_path)
    assert listing.returncode == 0, listing.stderr
    rows = {row["name"]: row for row in json.loads(listing.stdout)["checkpoints"]}
    assert set(rows) == {"step_1", "step_3"}
    assert rows["step_3"]["sharded"] and rows["step_3"]["items"] == ["model", "step"]
    one = fastckpt_cli("ls", str(checkpoint), cwd=tmp_path)
    assert one.returncode == 2 and "one sharded checkpoint" in one.stderr


def test_export_consolidates_full_tensors(
    sharded: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    checkpoint, expected = sharded
    out = tmp_path / "full.safetensors"
    done = fastckpt_cli("export", str(checkpoint), "--to", str(out), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    exported = fastckpt.load_file(out)
    assert set(exported) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(exported[name], tensor), name
    # diff compares exports, and says so when given the sharded checkpoint itself.
    refused = fastckpt_cli("diff", str(checkpoint), str(out), cwd=tmp_path)
    assert refused.returncode == 2 and "sharded (DCP) checkpoint" in refused.stderr
    assert f"fastckpt export {checkpoint} --to" in refused.stderr
    same = fastckpt_cli("diff", str(out), str(out), cwd=tmp_path)
    assert same.returncode == 0, same.stdout + same.stderr


def test_export_model_takes_one_top_level_key_of_a_sharded_checkpoint(
    sharded: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    """Before, ``--model`` was accepted and ignored for a sharded checkpoint: any name, one
    it does not hold too, exported every tensor (optimizer state included) with status 0."""
    checkpoint, expected = sharded
    out = tmp_path / "model.safetensors"
    done = fastckpt_cli(
        "export", str(checkpoint), "--model", "model", "--to", str(out), cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    exported = fastckpt.load_file(out)
    assert sorted(exported) == ["b", "w"]
    assert torch.equal(exported["w"], expected["model.w"])
    missing = tmp_path / "missing.safetensors"
    refused = fastckpt_cli(
        "export", str(checkpoint), "--model", "nope", "--to", str(missing), cwd=tmp_path
    )
    assert refused.returncode == 2 and "no tensor under 'nope.'" in refused.stderr
    assert not missing.exists()


def test_a_directory_of_sharded_checkpoints_only_is_listed_verified_inspected_and_pruned(
    tmp_path: Path,
) -> None:
    """A directory holding only sharded checkpoints (a manager's or a hook's of FSDP2 state, or
    DCP saves through fastckpt.dcp.Writer) is a directory of checkpoints to every command:
    ``verify`` checks each, ``inspect`` shows the newest, ``prune --keep-last 1`` deletes the
    older. Before, only directories holding a ``commit.json`` checkpoint counted: verify,
    inspect and prune refused it as "not a fastckpt checkpoint"."""
    runs = tmp_path / "runs"
    for step in (1, 2):
        state = {"w": torch.full((4, 3), float(step)), "step": torch.tensor(step)}
        with pytest.warns(UserWarning, match="single process"):
            dcp.save(state, storage_writer=fastckpt.dcp.Writer(runs / f"step_{step}"))
    listed = fastckpt_cli("ls", "--json", str(runs), cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert [row["name"] for row in json.loads(listed.stdout)["checkpoints"]] == [
        "step_1",
        "step_2",
    ]
    checked = fastckpt_cli("verify", str(runs), cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "step_1" in checked.stdout and "step_2" in checked.stdout
    shown = fastckpt_cli("inspect", str(runs), cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert "newest of 2" in shown.stdout and "step_2" in shown.stdout
    pruned = fastckpt_cli("prune", "--json", str(runs), "--keep-last", "1", cwd=tmp_path)
    assert pruned.returncode == 0, pruned.stderr
    assert json.loads(pruned.stdout)["deleted"] == ["step_1"]
    assert sorted(p.name for p in runs.iterdir()) == ["step_2"]
    loaded = {"w": torch.zeros(4, 3), "step": torch.tensor(0)}
    dcp.load(loaded, storage_reader=fastckpt.dcp.Reader(runs / "step_2"))
    assert torch.equal(loaded["w"], torch.full((4, 3), 2.0)) and int(loaded["step"]) == 2


def test_the_parts_directory_of_a_strategy_root_is_not_pruned_as_checkpoints(
    tmp_path: Path,
) -> None:
    """``ROOT/sharded/<i>`` holds the parts of index i (each with a sharded record; the
    manifest names the committed one), not a directory of checkpoints: ``prune`` refuses it and
    deletes nothing (keeping the newest part could delete the committed one)."""
    root = tmp_path / "root"
    fastckpt.save_checkpoint(root, {"m": (torch.nn.Linear(2, 2), None)})
    parts = root / "sharded" / "0"
    for part in ("p1764540000000-00000000.1.host", "p1764540099999-00000000.2.host"):
        with pytest.warns(UserWarning, match="single process"):
            dcp.save({"w": torch.ones(3)}, storage_writer=fastckpt.dcp.Writer(parts / part))
    for path in (parts, root / "sharded"):
        pruned = fastckpt_cli("prune", str(path), "--keep-last", "1", cwd=tmp_path)
        assert pruned.returncode == 2, pruned.stdout + pruned.stderr
    assert len(list(parts.iterdir())) == 2
