"""fastckpt.verify: what it accepts, what it reports, and latest_intact (the damage it detects
in every region of a checkpoint is tested in test_reliability.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from checkpoint_support import (
    Saved,
    only_failure,
    symlink_outside,
)
from fastckpt import (
    _native,
)
from fastckpt.container.verify import CheckpointSkippedWarning, latest_intact, verify
from fastckpt.errors import (
    CheckpointFormatError,
)
from fastckpt.format.records import MANIFEST
from fastckpt.io.paths import safe_join
from s3_support import S3Server, s3_env, s3_root, s3_server

__all__ = ["s3_env", "s3_root", "s3_server"]  # fixtures used by name below

#: The ``saved`` fixture (two indices of a root and two manager checkpoints).
pytest_plugins = ["checkpoint_support"]


def test_verify_accepts_every_kind_of_target(saved: Saved, tmp_path: Path) -> None:
    root = saved.root
    report = verify(root)
    assert report.ok and report.kind == "root" and report.indices == [0, 1]
    assert report.files[0].path == root / MANIFEST
    assert report.files[0].expected_crc32c == report.files[0].actual_crc32c is not None
    assert len(report.files) == 1 + len(saved.files(0)) + len(saved.files(1))
    for record in report.files[1:]:
        assert record.expected_size == record.actual_size
        assert record.expected_crc32c == record.actual_crc32c
        assert record.index in (0, 1) and record.status == "ok"
    assert verify(root, 0).indices == [0]
    assert verify(root, -1).indices == [1]
    assert verify(root / MANIFEST).indices == [0, 1]
    index_report = verify(root / "1")
    assert index_report.kind == "index" and index_report.indices == [1] and index_report.ok
    lone = verify(root / "1" / "models" / "main.safetensors")
    assert lone.kind == "file" and lone.ok and lone.files[0].expected_crc32c is None
    assert lone.files[0].actual_crc32c == _native.crc32c(lone.files[0].path.read_bytes())
    manager_report = verify(saved.manager_dirs["a"])
    assert manager_report.kind == "manager" and manager_report.ok
    assert verify(saved.manager_dirs["a"] / "commit.json").kind == "manager"
    assert "ok" in str(report) and report.failed_indices() == []
    with pytest.raises(KeyError, match="available"):
        verify(root, 7)
    with pytest.raises(ValueError, match="index="):
        verify(saved.manager_dirs["a"], 0)
    with pytest.raises(FileNotFoundError, match="not a fastckpt checkpoint"):
        verify(tmp_path)
    with pytest.raises(FileNotFoundError):
        verify(tmp_path / "nothing-here")
    assert latest_intact(tmp_path / "nothing-here") is None


def test_latest_intact_warns_about_a_damaged_manifest_but_checks_every_index(
    saved: Saved,
) -> None:
    path = saved.root / MANIFEST
    document = json.loads(path.read_bytes())
    document["checkpoints"]["1"]["counters"]["step"] = 4  # the checksum no longer matches
    path.write_text(json.dumps(document))
    report = verify(saved.root)
    assert [f.path for f in report.failures] == [path]
    assert report.failures[0].status == "mismatch" and report.failed_indices() == [0, 1]
    with pytest.warns(CheckpointSkippedWarning, match="differs from the recorded"):
        assert latest_intact(saved.root) == 1


@pytest.mark.parametrize("sibling", [None, "_other", "0"])
def test_symlinks_escaping_the_checkpoint_are_refused_by_verify(
    saved: Saved, tmp_path: Path, sibling: str | None
) -> None:
    """Files and index directories linked out of their checkpoint are ``corrupt``, whether
    the links point into an unrelated folder (``sibling`` None) or into a sibling whose
    name is the checkpoint's followed by ``sibling`` (``root_other``, ``mgr/a0`` as
    ``step_10`` is to ``step_1``). The siblings were added in round 20: a containment check
    by string prefix without the trailing separator took them for inside and still passed
    this test."""

    def outside(checkpoint: Path) -> Path:
        if sibling is None:
            return tmp_path / "elsewhere"
        return checkpoint.with_name(checkpoint.name + sibling)

    root = saved.root
    link = root / "1" / "models" / "main.safetensors"
    symlink_outside(link, outside(root) / "main.safetensors")
    report = verify(root)
    only_failure(report, link, "corrupt")
    assert "outside the checkpoint" in report.failures[0].message
    with pytest.raises(CheckpointFormatError, match="outside the checkpoint"):
        safe_join(root / "1", "models/main.safetensors", within=root)

    shutil.copytree(root / "0", outside(root) / "0")
    shutil.rmtree(root / "0")
    (root / "0").symlink_to(outside(root) / "0")
    assert set(verify(root).failed_indices()) == {0, 1}

    directory = saved.manager_dirs["a"]
    link = directory / "optim.safetensors"
    symlink_outside(link, outside(directory) / "optim.safetensors")
    only_failure(verify(directory), link, "corrupt")


def test_a_flipped_byte_in_a_file_verified_with_direct_reads_is_found(tmp_path: Path) -> None:
    """Files of DIRECT_IO_MIN_BYTES and more are read back with O_DIRECT where the
    filesystem allows (a verify, the read-back before a prune): a flipped byte is found
    there as everywhere, and the prune then keeps the older, intact index."""
    import torch

    import fastckpt
    from fastckpt.io.headers import DIRECT_IO_MIN_BYTES

    model = torch.nn.Linear(4096, DIRECT_IO_MIN_BYTES // (4 * 4096))  # weight alone: the size
    root = tmp_path / "root"
    fastckpt.save_checkpoint(root, {"m": (model, None)})
    first = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.add_(1)
    fastckpt.save_checkpoint(root, {"m": (model, None)})
    path = root / "1" / "models" / "m.safetensors"
    assert path.stat().st_size >= DIRECT_IO_MIN_BYTES
    assert verify(root).ok
    data = bytearray(path.read_bytes())
    data[len(data) - DIRECT_IO_MIN_BYTES // 3] ^= 0x04
    path.write_bytes(bytes(data))
    report = verify(root)
    assert [f.path for f in report.failures] == [path] and report.failed_indices() == [1]
    assert fastckpt.prune(root, keep_last=1) == []  # the newest intact index stays
    loaded = fastckpt.load_checkpoint(root, 0)["models"]["m"]["model"]
    assert torch.equal(loaded.weight, first)


def test_a_prune_or_a_resave_during_verify_is_not_reported_as_damage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: verify read the record once, so an index pruned, or a manager checkpoint
    saved again, while it read their files was reported ``missing`` / ``mismatch`` (the CLI
    exiting 1, "damage found"). Now it checks again when the record changed meanwhile; real
    damage is still reported."""
    import torch

    import fastckpt
    from fastckpt.container import verify as verifying

    root = tmp_path / "root"
    for width in (2, 3, 4):
        fastckpt.save_checkpoint(root, models={"main": (torch.nn.Linear(width, 2), None)})
    index_files = verifying._index_files
    pruned: list[int] = []

    def prune_meanwhile(manifest: Any, index: int, threads: int) -> Any:
        if not pruned:
            pruned.extend(fastckpt.prune(root, keep_last=1))  # the other process's prune
        return index_files(manifest, index, threads)

    monkeypatch.setattr(verifying, "_index_files", prune_meanwhile)
    report = verify(root)
    assert pruned == [0, 1] and report.ok and report.indices == [2], report
    monkeypatch.undo()

    directory = tmp_path / "step"
    with fastckpt.CheckpointManager(fastckpt.CheckpointManager.Config.with_sync_save()) as m:
        m.save(directory, {"x": torch.zeros(3)})
        check_recorded = verifying._check_recorded
        resaved: list[bool] = []

        def resave_meanwhile(*args: Any, **kwargs: Any) -> Any:
            if not resaved:
                resaved.append(True)
                m.save(directory, {"x": torch.ones(3)})  # replaced while verify reads it
            return check_recorded(*args, **kwargs)

        monkeypatch.setattr(verifying, "_check_recorded", resave_meanwhile)
        assert verify(directory).ok and resaved
    monkeypatch.undo()
    # damage no writer explains is still reported
    (root / "2" / "models" / "main.spec.json").write_text("{}")
    assert not verify(root).ok


def test_a_prune_during_verify_of_an_object_store_root_is_not_reported_as_damage(
    s3_server: S3Server, s3_root: str, s3_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same on ``s3://``: the record's fingerprint was None on an object store (it was
    taken with ``os.open``), so verify never looked again, and a live root whose writer
    pruned while verify read it was reported damaged ("missing ... listed in manifest.json",
    ``fastckpt verify`` exiting 1 and naming a wrong newest intact index). Now the record is
    fingerprinted by its size, time and entity tag, and the check runs again."""
    import torch

    import fastckpt
    from fastckpt.container import verify as verifying

    for width in (2, 3, 4):
        fastckpt.save_checkpoint(s3_root, models={"main": (torch.nn.Linear(width, 2), None)})
    index_files = verifying._index_files
    pruned: list[int] = []

    def prune_meanwhile(manifest: Any, index: int, threads: int) -> Any:
        if not pruned:
            pruned.extend(fastckpt.prune(s3_root, keep_last=1))  # the other process's prune
        return index_files(manifest, index, threads)

    monkeypatch.setattr(verifying, "_index_files", prune_meanwhile)
    report = verify(s3_root)
    assert pruned == [0, 1] and report.ok and report.indices == [2], report


def test_a_load_of_an_s3_index_pruned_while_it_is_read_says_it_is_not_committed(
    s3_server: S3Server, s3_root: str, s3_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load of a listed index that a live writer prunes after the manifest was read and
    before the files are: before, the record's fingerprint was None on an object store, so
    the load never looked again and raised ``FileNotFoundError ... missing (listed in
    manifest.json)``, naming the manifest that no longer lists it. Now it reads the manifest
    again and says the index is not committed (typed, a ``KeyError``)."""
    import torch

    import fastckpt
    from fastckpt.checkpoint import components
    from fastckpt.errors import IndexNotCommittedError

    for width in (2, 3, 4):
        fastckpt.save_checkpoint(s3_root, models={"main": (torch.nn.Linear(width, 2), None)})
    real = components.IndexReader
    pruned: list[int] = []

    def prune_then_read(*args: Any, **kwargs: Any) -> Any:
        if not pruned:
            pruned.extend(fastckpt.prune(s3_root, keep_last=1))  # the other process's prune
        return real(*args, **kwargs)

    monkeypatch.setattr(components, "IndexReader", prune_then_read)
    with pytest.raises(IndexNotCommittedError, match="index 0 is not in"):
        fastckpt.load_checkpoint(s3_root, 0)
    assert pruned == [0, 1]
