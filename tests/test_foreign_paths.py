"""What fastckpt did not write is never deleted, and a path means the folder it named.

Found by trying the filesystem's odd corners: a checkpoint saved inside another one (directly,
or through a symlink) was deleted by the outer one's prune; a prune deleted a user's notes
kept in a checkpoint folder; a save deleted a user's folder named like an old index; two tiers
that were one directory through a symlink were accepted; an async save after ``os.chdir``
went to the new directory; a dangling symlink root was a bare ``FileExistsError``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import fastckpt
import training_support as support
from fastckpt.errors import NotACheckpointError
from s3_support import S3Server, s3_env, s3_root, s3_server

__all__ = ["s3_env", "s3_root", "s3_server"]  # fixtures used by name below


def _sync() -> fastckpt.CheckpointManager:
    return fastckpt.CheckpointManager(fastckpt.CheckpointManager.Config.with_sync_save())


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3)


def test_a_root_is_never_saved_inside_another_checkpoint(tmp_path: Path) -> None:
    """``save_checkpoint`` and the hook accepted a root inside a manager checkpoint or inside
    a root's index folder, which the outer checkpoint's prune then deleted with it; the
    manager's own check was passed through a symlink. All are refused now, naming the
    enclosing checkpoint; a root beside a root's indices (``ROOT/durable``) is still fine."""
    model = _model()
    with _sync() as manager:
        manager.save(tmp_path / "mg" / "step_1", {"x": torch.ones(1)})
    fastckpt.save_checkpoint(tmp_path / "outer", models={"main": model})
    os.symlink(tmp_path / "outer" / "0", tmp_path / "alias")
    for inside, enclosing in [
        (tmp_path / "mg" / "step_1" / "inner", "mg/step_1 (it holds commit.json)"),
        (tmp_path / "outer" / "0" / "inner", "outer (it holds manifest.json)"),
        (tmp_path / "alias" / "inner", "outer (it holds manifest.json)"),
    ]:
        expected = f"inside the checkpoint {re.escape(str(tmp_path))}/{re.escape(enclosing)}"
        with pytest.raises(NotACheckpointError, match=expected):
            fastckpt.save_checkpoint(inside, models={"main": model})
        with pytest.raises(NotACheckpointError, match="inside the checkpoint"):
            fastckpt.TrainingStrategy(
                model, fastckpt.OptimizerConfig(torch.optim.SGD, {"lr": 0.1})
            ).save_checkpoint(inside)
        assert not inside.exists()
    with _sync() as manager, pytest.raises(NotACheckpointError, match=r"that is .*outer/0/s"):
        manager.save(tmp_path / "alias" / "step_1", {"x": torch.ones(1)})
    fastckpt.save_checkpoint(tmp_path / "outer" / "durable", models={"main": model})
    assert [c["index"] for c in fastckpt.list_checkpoints(tmp_path / "outer")] == [0]


def test_a_prune_never_deletes_files_a_checkpoint_folder_holds_beside_its_own(
    tmp_path: Path,
) -> None:
    """A user's notes in a root's index folder, or in a manager checkpoint (which a save
    refuses to replace for them), were deleted by ``prune`` / ``fastckpt prune``. Now the
    checkpoint is kept, with a warning naming the files; once they are moved out it goes."""
    model = _model()
    root = tmp_path / "root"
    fastckpt.save_checkpoint(root, models={"main": model})
    (root / "0" / "NOTES.md").write_text("eval results")
    fastckpt.save_checkpoint(root, models={"main": model})
    with pytest.warns(RuntimeWarning, match=r"0: not pruned: it also holds NOTES\.md"):
        assert fastckpt.prune(root, keep_last=1) == []
    assert (root / "0" / "NOTES.md").read_text() == "eval results"
    assert [c["index"] for c in fastckpt.list_checkpoints(root)] == [0, 1]
    assert fastckpt.verify(root, 0).ok
    (root / "0" / "NOTES.md").rename(tmp_path / "NOTES.md")
    assert fastckpt.prune(root, keep_last=1) == [0]

    folder = tmp_path / "mg"
    two = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    with _sync() as manager:
        manager.save(folder / "step_1", {"model": two})
        with torch.no_grad():
            two[1].weight.add_(1.0)
        manager.save(folder / "step_2", {"model": two})
    (folder / "step_1" / "NOTES.md").write_text("eval results")
    (folder / "step_1" / "inner").mkdir()
    listed = json.loads((folder / "step_2" / "commit.json").read_text())["files"]
    assert any(relpath.startswith("linked/") for relpath in listed)  # step_2 links step_1
    (folder / "step_2" / "linked" / "mine.txt").write_text("kept inside a listed folder")
    with _sync() as manager:
        manager.save(folder / "step_3", {"model": two})
    command = [sys.executable, "-m", "fastckpt", "prune", str(folder), "--keep-last", "1"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert "step_1: not pruned: it also holds NOTES.md, inner" in result.stderr
    assert "step_2: not pruned: it also holds linked/mine.txt" in result.stderr
    assert (folder / "step_1" / "NOTES.md").is_file() and (folder / "step_1" / "inner").is_dir()
    assert (folder / "step_2" / "linked" / "mine.txt").is_file()
    with _sync() as manager:
        assert torch.equal(manager.load(folder / "step_2")["model"]["1.weight"], two[1].weight)


def test_a_save_leaves_a_users_folder_named_like_an_old_index(tmp_path: Path) -> None:
    """An index-named folder below the latest that the manifest does not name is what a
    prune or replacement interrupted after its commit leaves, and the next save removes it;
    one holding files fastckpt never writes there (``results.csv``) is the user's: before, it
    was deleted too. Now it stays, with a warning; a leftover of fastckpt's files still goes."""
    model = _model()
    root = tmp_path / "root"
    fastckpt.save_checkpoint(root, models={"main": model}, checkpoint_index=5)
    (root / "3").mkdir()
    (root / "3" / "results.csv").write_text("precious")
    (root / "2" / "models").mkdir(parents=True)
    (root / "2" / "models" / "main.safetensors").write_bytes(b"left by a killed prune")
    with pytest.warns(RuntimeWarning, match=r"3: a folder named like an index .* results\.csv"):
        fastckpt.save_checkpoint(root, models={"main": model})
    assert (root / "3" / "results.csv").read_text() == "precious"
    assert not (root / "2").exists()
    assert [c["index"] for c in fastckpt.list_checkpoints(root)] == [5, 6]


def test_a_save_refuses_to_replace_a_users_folder_named_like_the_index_it_writes(
    tmp_path: Path,
) -> None:
    """A folder at the next index (``ROOT/1/results.csv``) or a user's file in a committed
    index replaced with ``checkpoint_index=`` (``ROOT/0/NOTES.md``): before, the save swapped
    the whole folder out and deleted them without a word. Now the save is refused, typed,
    naming the folder, the files and the fix, and nothing is written or deleted; a folder
    holding only what a killed save leaves (``.safetensors``/``.json``) is still replaced."""
    model = _model()
    root = tmp_path / "root"
    fastckpt.save_checkpoint(root, models={"main": model})
    (root / "1").mkdir()
    (root / "1" / "results.csv").write_text("precious")
    manifest = (root / "manifest.json").read_bytes()
    with pytest.raises(NotACheckpointError, match=r"1: a folder named like index 1 .*results\.csv"):
        fastckpt.save_checkpoint(root, models={"main": model})
    assert (root / "1" / "results.csv").read_text() == "precious"
    assert (root / "manifest.json").read_bytes() == manifest
    # Files named like fastckpt's kinds, at places no save writes them, are the user's too
    # (before the review: any .json or .safetensors file counted as a killed save's).
    (root / "1" / "results.csv").unlink()
    for users in ("eval_results.json", "export/model.safetensors", "models/notes.json"):
        (root / "1" / users).parent.mkdir(parents=True, exist_ok=True)
        (root / "1" / users).write_text("precious")
        with pytest.raises(NotACheckpointError, match=re.escape(users)):
            fastckpt.save_checkpoint(root, models={"main": model})
        assert (root / "1" / users).read_text() == "precious"
        (root / "1" / users).unlink()
    (root / "1" / "export").rmdir()
    (root / "1" / "models" / "main.safetensors").write_bytes(b"left by a killed save")
    assert fastckpt.save_checkpoint(root, models={"main": model}) == 1
    (root / "0" / "NOTES.md").write_text("why this run diverged")
    manifest = (root / "manifest.json").read_bytes()
    with pytest.raises(NotACheckpointError, match=r"0: committed index 0 .*NOTES\.md.*Move them"):
        fastckpt.save_checkpoint(root, models={"main": model}, checkpoint_index=0)
    assert (root / "0" / "NOTES.md").read_text() == "why this run diverged"
    assert (root / "manifest.json").read_bytes() == manifest
    assert fastckpt.verify(root).ok


def test_a_save_refuses_to_replace_a_users_object_under_the_next_index_prefix(
    s3_server: S3Server, s3_root: str, s3_env: dict[str, str]
) -> None:
    """The same on an object store: a save of index 1 deleted ``ROOT/1/results.csv``."""
    model = _model()
    fastckpt.save_checkpoint(s3_root, models={"main": model})
    prefix = s3_root.split("/", 3)[3]
    client = s3_server.client()
    key = f"{prefix}/1/results.csv"
    client.put_object(Bucket=s3_server.bucket, Key=key, Body=b"precious")
    with pytest.raises(NotACheckpointError, match=r"index 1 .*results\.csv"):
        fastckpt.save_checkpoint(s3_root, models={"main": model})
    assert client.get_object(Bucket=s3_server.bucket, Key=key)["Body"].read() == b"precious"
    assert [c["index"] for c in fastckpt.list_checkpoints(s3_root)] == [0]


def test_two_tiers_that_are_one_directory_are_refused_however_named(tmp_path: Path) -> None:
    """A durable tier reached through a symlink to the fast one was accepted: its retention
    was the fast tier's, and nothing was ever made durable (promotion_healthy True)."""
    (tmp_path / "fast").mkdir()
    os.symlink(tmp_path / "fast", tmp_path / "durable")
    with pytest.raises(ValueError, match=r"into itself: .*durable \(that is .*fast\)"):
        fastckpt.CheckpointHook(
            tmp_path / "fast", step_interval=2, durable_dir=tmp_path / "durable"
        )
    with pytest.raises(ValueError, match="fast and durable are both"):
        fastckpt.TiersConfig(fast=tmp_path / "fast", durable=tmp_path / "durable").roots()


def test_a_save_written_after_a_chdir_goes_where_it_was_asked_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A relative checkpoint path was resolved when the background write ran: an async
    manager save, or a hook's, made before ``os.chdir`` landed in the new directory (a resume
    from the first found nothing). Now the path is resolved when the save is asked for (the
    hook: when it is made), and the hook's record keeps the path as given."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    manager = fastckpt.CheckpointManager(fastckpt.CheckpointManager.Config.with_async_save())
    gate = threading.Event()
    write = manager._write

    def held(snapshot: Any) -> None:  # the background write starts after the chdir
        gate.wait(60)
        write(snapshot)

    manager._write = held  # type: ignore[method-assign]
    future = manager.save("ckpt/step_1", {"x": torch.arange(1000.0)})
    os.chdir(tmp_path / "b")
    gate.set()
    future.result()
    os.chdir(tmp_path / "a")
    gate.clear()
    future = manager.save("ckpt/step_2", {"x": torch.arange(1000.0)}, base="ckpt/step_1")
    os.chdir(tmp_path / "b")  # base= too is what it named when asked (review finding)
    gate.set()
    future.result()
    manager.close()
    assert (tmp_path / "a" / "ckpt" / "step_1" / "commit.json").is_file()
    assert (tmp_path / "a" / "ckpt" / "step_2" / "commit.json").is_file()
    assert not (tmp_path / "b" / "ckpt").exists()

    os.chdir(tmp_path / "a")
    hook = fastckpt.CheckpointHook("run", step_interval=2)

    def move_on(ctx: fastckpt.TrainContext, stage: fastckpt.TrainingStage) -> None:
        if stage is fastckpt.TrainingStage.AFTER_BATCH and ctx.step_count == 3:
            os.chdir(tmp_path / "b")

    strategy = support.new_strategy([hook, move_on], num_steps=6)
    strategy.run(support.loader())
    assert [c["index"] for c in fastckpt.list_checkpoints(tmp_path / "a" / "run")] == [0, 1, 2]
    assert not (tmp_path / "b" / "run").exists()
    assert hook.hook_config()["checkpoint_dir"] == "run"


def test_dot_dot_after_a_symlink_goes_where_the_kernel_goes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``a/link/../ck`` with ``a/link -> b/sub`` is ``b/ck`` to the kernel. The review of the
    fix above found the resolution dropping ``..`` as text (``a/ck``): the save went to one
    folder and a load of the same string read another."""
    (tmp_path / "b" / "sub").mkdir(parents=True)
    (tmp_path / "a").mkdir()
    os.symlink(tmp_path / "b" / "sub", tmp_path / "a" / "link")
    monkeypatch.chdir(tmp_path)
    with _sync() as manager:
        manager.save("a/link/../ck", {"x": torch.ones(2)})
        assert torch.equal(manager.load("a/link/../ck")["x"], torch.ones(2))
    assert (tmp_path / "b" / "ck" / "commit.json").is_file()
    assert not (tmp_path / "a" / "ck").exists()


def test_a_root_that_is_a_dangling_symlink_is_named_with_its_target(tmp_path: Path) -> None:
    os.symlink("/nonexistent-mount/run1", tmp_path / "ckpt")
    expected = r"ckpt is a symlink to /nonexistent-mount/run1, which does not exist"
    with pytest.raises(FileNotFoundError, match=expected):
        fastckpt.save_checkpoint(tmp_path / "ckpt", models={"main": _model()})
    with _sync() as manager, pytest.raises(FileNotFoundError, match=expected):
        manager.save(tmp_path / "ckpt" / "step_1", {"x": torch.ones(1)})
