"""Hostile inputs to the command line and the lazy reader (adversarial findings).

``fastckpt export --to`` a file inside a checkpoint; ``fastckpt promote`` from something that
is no folder of checkpoints, or into a folder of the other kind; references naming a tensor
their linked file lacks (``fastckpt diff``, ``fastckpt.safe_open``); ``prune --dry-run`` on a
root whose newest index is damaged; ``commit.json`` with an impossible ``schema_version``.
Each runs in-process through ``cli.main``.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import fastckpt
from cli_support import Run, cli_runner
from fastckpt import _native
from fastckpt.container.listing import committed_checkpoints
from fastckpt.errors import CheckpointFormatError
from fastckpt.format.records import read_commit_record, seal_manifest

# --------------------------------------------------------------------------- checkpoints


def save_root(root: Path, saves: int, *, change: bool) -> None:
    """``saves`` indices of a Linear(8, 8); its weight changes between saves when ``change``
    (else the later indices are incremental: every tensor is referenced)."""
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    for _ in range(saves):
        if change:
            with torch.no_grad():
                model.weight.add_(1)
        fastckpt.save_checkpoint(root, models={"m": (model, None)})


def save_manager(directory: Path) -> None:
    """``step_10`` and ``step_20`` of the same weights: ``step_20`` links ``step_10``'s."""
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    config = fastckpt.CheckpointManager.Config.with_sync_save()
    with fastckpt.CheckpointManager(config) as manager:
        for step in (10, 20):
            manager.save(directory / f"step_{step}", {"model": model.state_dict(), "step": step})


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A root of changing weights (``root``), one of unchanged weights (``inc``: indices 1
    and 2 reference index 0's tensors) and a directory of manager checkpoints (``mgr``)."""
    base = tmp_path_factory.mktemp("hostile")
    save_root(base / "root", 3, change=True)
    save_root(base / "inc", 2, change=False)
    save_manager(base / "mgr")
    return base


@pytest.fixture()
def work(made: Path, tmp_path: Path) -> Path:
    """A copy of the checkpoints this test may damage."""
    for name in ("root", "inc", "mgr"):
        shutil.copytree(made / name, tmp_path / name, symlinks=True)
    return tmp_path


@pytest.fixture()
def run(work: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Run:
    """``cli.main(args)`` in the work directory: (status, stdout, stderr)."""
    monkeypatch.chdir(work)
    return cli_runner(capsys)


def edit_json(path: Path, change: Callable[[dict[str, Any]], None]) -> None:
    """Edit a JSON document in place."""
    document = json.loads(path.read_text())
    change(document)
    path.write_text(json.dumps(document))


def file_record(path: Path) -> dict[str, int]:
    data = path.read_bytes()
    return {"size": len(data), "crc32c": _native.crc32c(data)}


def edit_refs(root: Path, index: int, change: Callable[[dict[str, Any]], None]) -> None:
    """Edit the references of ``index`` (``refs.json``) and re-seal the manifest over it, as
    a buggy writer that records its own output would: only the references are wrong."""
    refs = root / str(index) / "refs.json"
    edit_json(refs, lambda document: change(document["refs"]["models/m.safetensors"]))

    def reseal(manifest: dict[str, Any]) -> None:
        manifest["checkpoints"][str(index)]["files"]["refs.json"] = file_record(refs)
        seal_manifest(manifest)

    edit_json(root / "manifest.json", reseal)


def edit_commit(directory: Path, change: Callable[[dict[str, Any]], None]) -> None:
    """Edit a manager checkpoint's ``commit.json`` and re-seal it."""

    def edit(record: dict[str, Any]) -> None:
        change(record)
        seal_manifest(record)

    edit_json(directory / "commit.json", edit)


def one_line_error(status: int, err: str, *needles: str) -> None:
    assert status == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, (needle, err)


# --------------------------------------------------------------------------- fastckpt export


def test_export_never_writes_into_a_checkpoint(run: Run, work: Path) -> None:
    root, mgr = work / "root", work / "mgr"
    linked = next((mgr / "step_20" / "linked").iterdir())
    protected = [
        root / "manifest.json",
        root / "2" / "models" / "m.safetensors",
        mgr / "step_20" / "model.safetensors",
        mgr / "step_20" / "commit.json",
        linked,
    ]
    before = {path: path.read_bytes() for path in protected}
    for target in protected:
        status, _, err = run("export", root, "--index", "0", "--to", target, "--force")
        one_line_error(status, err, str(target), "outside checkpoints")
    # A new name in an index, or an index a later save would take: refused, not created.
    for target in (root / "3", root / "2" / "models" / "new.safetensors", root / ".ref-9"):
        status, _, err = run("export", root, "--to", target)
        one_line_error(status, err, str(target), f"inside the checkpoint {root}")
        assert not os.path.lexists(target)
    # Through a symlink, or relative to a directory inside the checkpoint.
    (work / "alias").symlink_to(root / "2")
    status, _, err = run("export", root, "--to", "alias/m.safetensors")
    one_line_error(status, err, f"that is {root / '2' / 'm.safetensors'}")
    os.chdir(root / "2" / "models")
    status, _, err = run("export", root, "--to", "m.safetensors", "--force")
    one_line_error(status, err, "m.safetensors", "outside checkpoints")
    os.chdir(work)
    # A record's name anywhere would make its folder look like a checkpoint.
    (work / "out").mkdir()
    status, _, err = run("export", root, "--to", work / "out" / "commit.json")
    one_line_error(status, err, "commit.json")
    assert list((work / "out").iterdir()) == []
    assert {path: path.read_bytes() for path in protected} == before
    assert fastckpt.verify(root).ok and fastckpt.verify(mgr / "step_20").ok
    assert sorted(p.name for p in root.iterdir()) == ["0", "1", "2", "manifest.json"]
    # Outside every checkpoint: written, and --force replaces an earlier export.
    target = work / "out" / "m.safetensors"
    assert run("export", root, "--to", target)[0] == 0
    assert run("export", root, "--to", target)[0] == 2
    assert run("export", mgr / "step_20", "--to", target, "--force")[0] == 0


# --------------------------------------------------------------------------- fastckpt promote


def test_promote_refuses_a_source_that_is_no_folder_of_checkpoints(run: Run, work: Path) -> None:
    (work / "empty").mkdir()
    (work / "file.txt").write_text("x")
    target = work / "target"
    for source in (
        work / "missing",
        work / "root" / "0",
        work / "empty",
        work / "file.txt",
        work / "mgr" / "step_10",
    ):
        status, out, err = run("promote", source, target)
        one_line_error(status, err, str(source), "save_checkpoint root", "CheckpointManager")
        assert out == "" and not target.exists()
    status, _, err = run("promote", work / "missing", target)
    assert "does not exist" in err
    assert run("promote", work / "root", target)[0] == 0
    assert fastckpt.verify(target).ok


def test_promote_never_mixes_roots_and_manager_checkpoints(run: Run, work: Path) -> None:
    root, mgr = work / "root", work / "mgr"
    status, _, err = run("promote", root, mgr)
    one_line_error(status, err, str(mgr), "holds CheckpointManager checkpoints")
    assert not (mgr / "manifest.json").exists()
    assert sorted(p.name for p in mgr.iterdir()) == ["step_10", "step_20"]
    status, _, err = run("promote", mgr, root)
    one_line_error(status, err, str(root), "save_checkpoint root")
    assert committed_checkpoints(root) == []
    assert sorted(p.name for p in root.iterdir()) == ["0", "1", "2", "manifest.json"]
    # Each into its own kind still works.
    assert run("promote", mgr, work / "tier")[0] == 0
    assert committed_checkpoints(work / "tier") == ["step_20"]


# --------------------------------------------------------------------------- references


def test_a_reference_to_a_tensor_the_file_lacks_is_a_format_error(run: Run, work: Path) -> None:
    inc = work / "inc"
    edit_refs(inc, 1, lambda refs: refs["weight"].update(name="nope"))
    status, _, err = run("diff", inc / "0", inc / "1")
    one_line_error(status, err, str(inc / "1" / "linked"), "'nope'", "'weight'")
    with pytest.raises(CheckpointFormatError, match=r"linked/.*has no tensor 'nope'.*'weight'"):
        fastckpt.safe_open(inc)
    with pytest.raises(CheckpointFormatError, match="'nope'"):
        fastckpt.safe_open(inc, part="models/m")


def test_a_manager_reference_to_a_tensor_the_file_lacks_is_a_format_error(
    run: Run, work: Path
) -> None:
    step = work / "mgr" / "step_20"
    record = read_commit_record(step)
    name = next(iter(record["refs"]["model.safetensors"]))
    edit_commit(step, lambda r: r["refs"]["model.safetensors"][name].update(name="nope"))
    status, _, err = run("diff", work / "mgr" / "step_10", step)
    one_line_error(status, err, str(step / "linked"), "'nope'", repr(name))
    with pytest.raises(CheckpointFormatError, match=f"has no tensor 'nope'.*{name!r}"):
        fastckpt.safe_open(step)


def test_safe_open_keeps_every_referenced_name(work: Path) -> None:
    inc = work / "inc"
    # Two names referencing one tensor: both are keys (neither replaces the other).
    edit_refs(inc, 1, lambda refs: refs.__setitem__("copy", dict(refs["weight"])))
    with fastckpt.safe_open(inc, index=1) as handle:
        assert handle.keys() == ["models/m/bias", "models/m/copy", "models/m/weight"]
        assert torch.equal(handle.get_tensor("models/m/copy"), handle.get_tensor("models/m/weight"))
    # A swapped name (weight -> the bias's tensor) no longer collapses two keys into one.
    edit_refs(inc, 1, lambda refs: refs["weight"].update(name="bias"))
    with pytest.raises(CheckpointFormatError, match=r"tensor 'bias' is F32 of 32 B.*'weight'"):
        fastckpt.safe_open(inc, index=1)


# --------------------------------------------------------------------------- fastckpt prune


def test_prune_dry_run_says_what_the_prune_does_when_the_newest_is_damaged(
    run: Run, work: Path
) -> None:
    root = work / "root"
    damaged = root / "2" / "models" / "m.safetensors"
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 1
    damaged.write_bytes(bytes(data))
    status, out, _ = run("--json", "prune", root, "--keep-last", "1", "--dry-run")
    assert status == 0
    planned = json.loads(out)
    assert (planned["deleted"], planned["kept"]) == ([0], [1, 2]), planned
    status, out, _ = run("prune", root, "--keep-last", "1", "--dry-run")
    assert status == 0 and "would delete index(es) 0 " in out and "would keep 1, 2" in out
    assert sorted(p.name for p in root.iterdir()) == ["0", "1", "2", "manifest.json"]
    status, out, _ = run("--json", "prune", root, "--keep-last", "1")
    done = json.loads(out)
    assert status == 0 and (done["deleted"], done["kept"]) == ([0], [1, 2]), done
    assert done["freed_bytes"] == planned["freed_bytes"]


# --------------------------------------------------------------------------- commit.json


@pytest.mark.parametrize("version", [0, -1, True, False, 3, "2", None])
def test_commit_record_schema_version_must_be_a_known_int(work: Path, version: Any) -> None:
    step = work / "mgr" / "step_10"
    assert read_commit_record(step)["schema_version"] == 1
    edit_commit(step, lambda record: record.__setitem__("schema_version", version))
    with pytest.raises(CheckpointFormatError, match=r"commit\.json: .*schema_version"):
        read_commit_record(step)
    assert not fastckpt.verify(step).ok


def test_promote_into_a_checkpoint_is_refused(tmp_path: Path) -> None:
    # fastckpt promote fast durable/3 wrote a manifest and index directories inside index 3.
    from fastckpt.cli.main import main as cli

    fast, durable = tmp_path / "fast", tmp_path / "durable"
    model = torch.nn.Linear(4, 4)
    for _ in range(2):
        fastckpt.save_checkpoint(fast, models={"main": (model, None)})
    assert cli(["promote", str(fast), str(durable)]) == 0
    before = sorted(p.relative_to(durable) for p in durable.rglob("*"))
    for inside in (durable / "1", durable / "1" / "models", fast / "0"):
        assert cli(["promote", str(fast), str(inside)]) == 2
    assert sorted(p.relative_to(durable) for p in durable.rglob("*")) == before
    assert fastckpt.verify(durable).ok


# --------------------------------------------------------------------------- re-sealed entries


@pytest.mark.parametrize("dropped", ["models/m.spec.json", "models/m.safetensors", "all"])
def test_an_entry_missing_a_components_files_is_refused_by_verify_load_and_prune(
    run: Run, work: Path, dropped: str
) -> None:
    """An entry re-sealed without the files one of its components needs (``"files": {}``, or
    one file dropped) verified OK before and no loader could read it, so ``prune`` kept it as
    the newest intact index and deleted the loadable ones. It is a format error now, naming
    the component, and nothing is pruned."""
    root = work / "root"

    def drop(manifest: dict[str, Any]) -> None:
        files = manifest["checkpoints"]["2"]["files"]
        if dropped == "all":
            files.clear()
        else:
            del files[dropped]
        seal_manifest(manifest)

    edit_json(root / "manifest.json", drop)
    status, out, err = run("verify", root)
    assert status != 0 and "components.models lists 'm'" in out + err, (out, err)
    with pytest.raises(CheckpointFormatError, match=r"components\.models lists 'm'"):
        fastckpt.load_checkpoint(root, checkpoint_index=0)
    status, out, err = run("prune", root, "--keep-last", "1")
    assert status != 0, (out, err)
    assert all((root / str(i)).is_dir() for i in (0, 1, 2))
