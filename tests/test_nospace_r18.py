"""Out of space, round 18: prunes, exports and promotions on a disk with no room (no page or
no inode free) keep every committed index loadable and explain the way out.

Each test mounts a small tmpfs (``size=16m``, a limited ``nr_inodes``) and skips where
mounting is not permitted. The SIGKILL test runs the prune kill points on a filesystem
without hard links (``os.link`` refused in the child, as on filesystems without them), where
a prune keeps a pruned index's bytes for older-layout references by renaming the folder.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
import torch

import fastckpt
from fastckpt import list_checkpoints, load_checkpoint, prune, save_checkpoint, verify
from fastckpt.format.records import Manifest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import crash_harness


def _mount(path: Path, inodes: int = 2000) -> None:
    """Mount a 16 MiB tmpfs of ``inodes`` inodes at ``path`` (skip where not permitted)."""
    path.mkdir(parents=True, exist_ok=True)
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size=16m,nr_inodes={inodes}", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.strip()}")


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Path]:
    """A 16 MiB tmpfs of 2000 inodes, mounted for the test."""
    mount = tmp_path / "disk"
    _mount(mount)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _use_inodes(disk: Path, leave: int) -> Path:
    """Create empty files until no inode is free, then delete ``leave`` of them; returns their
    folder (removing it frees the inodes)."""
    folder = disk / "inodes"
    folder.mkdir()
    made = 0
    while True:
        try:
            (folder / str(made)).touch()
        except OSError as err:
            assert err.errno == errno.ENOSPC, err
            break
        made += 1
    for number in range(made - leave, made):
        (folder / str(number)).unlink()
    return folder


def _legacy_root(root: Path) -> dict[str, torch.Tensor]:
    """Three saves as earlier fastckpt versions wrote them: indices 1 and 2 reference index
    0's file through ``refs.json`` (nothing hard-linked). Returns the saved state."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(128, 128)
    with crash_harness.legacy_references():
        for _ in range(3):
            save_checkpoint(root, models={"m": (layer, None)})
    return {name: value.clone() for name, value in layer.state_dict().items()}


def _assert_every_index_loads(root: Path, state: dict[str, torch.Tensor], where: str) -> None:
    report = verify(root)
    assert report.ok, f"{where}: {report.summary()}"
    for entry in list_checkpoints(root):
        loaded = load_checkpoint(root, entry["index"])["models"]["m"]["model"].state_dict()
        assert all(torch.equal(loaded[k], v) for k, v in state.items()), where


def test_a_prune_of_an_old_layout_root_out_of_inodes_keeps_every_committed_index(
    tmp_path: Path,
) -> None:
    """Before: with one inode free the prune could not hard-link ``.ref-0`` and renamed
    ``ROOT/0`` to ``ROOT/.ref-0`` before its manifest commit, which then failed (ENOSPC): the
    manifest still named index 0, whose folder was gone (verify failed, index 0 did not
    load), and the next save deleted ``.ref-0`` as garbage, so indices 1 and 2 never loaded
    again. Swept over 0..7 free inodes: after a failed prune every committed index verifies
    and loads, the advice names no folder that later indices read from, and after the inodes
    are freed the next save and prune keep them loading."""
    mount = tmp_path / "disk"
    for leave in range(8):
        _mount(mount)
        try:
            root = mount / "ckpt"
            state = _legacy_root(root)
            filler = _use_inodes(mount, leave)
            try:
                pruned = prune(root, 1)
            except OSError as err:
                assert err.errno == errno.ENOSPC, err
                message = str(err)
                assert "nothing was deleted" in message, message
                assert f"{root}/0 " not in message and f"{root}/0:" not in message, message
                if leave == 0:
                    assert "df -i" in message, message
                pruned = []
            where = f"{leave} inode(s) free"
            _assert_every_index_loads(root, state, f"{where}, after the prune")
            shutil.rmtree(filler)
            save_checkpoint(root, models={"m": (_module(state), None)})
            _assert_every_index_loads(root, state, f"{where}, after the next save")
            assert not pruned or [c["index"] for c in list_checkpoints(root)] == [2, 3]
            prune(root, 1)
            _assert_every_index_loads(root, state, f"{where}, after a prune with room")
        finally:
            subprocess.run(["umount", "-l", str(mount)], check=False)


def _module(state: dict[str, torch.Tensor]) -> torch.nn.Module:
    layer = torch.nn.Linear(128, 128)
    layer.load_state_dict(state)
    return layer


def test_a_root_left_by_an_earlier_failed_prune_gets_its_index_back(tmp_path: Path) -> None:
    """A root an earlier version's failed prune left (index 0 committed, its folder renamed
    to ``.ref-0``, later indices reading from it): before, the next save deleted ``.ref-0``
    as the retained copy of a committed index, and indices 0-2 never loaded again. Now the
    next save (under the root's lock) puts ``.ref-0`` back as ``ROOT/0``."""
    root = tmp_path / "ckpt"
    state = _legacy_root(root)
    os.rename(root / "0", root / ".ref-0")
    save_checkpoint(root, models={"m": (_module(state), None)})
    assert (root / "0").is_dir() and not (root / ".ref-0").exists()
    _assert_every_index_loads(root, state, "after the next save")


def _prune_without_links(root: str, kill_at: int, conn: Connection) -> None:
    """Child: the prune kill points on a filesystem without hard links (``os.link`` refused,
    as there), old-layout saves."""

    def refused(*args: Any, **kwargs: Any) -> None:
        raise PermissionError(errno.EPERM, "hard links not supported here (test)")

    os.link = refused  # type: ignore[assignment]
    crash_harness.prune_at_kill_point(root, kill_at, True, conn)


def _run_child(root: Path, kill_at: int) -> tuple[int | None, Any]:
    process, conn = crash_harness.start(_prune_without_links, str(root), kill_at)
    sent = None
    if conn.poll(120):
        try:
            sent = conn.recv()
        except EOFError:  # killed before it sent anything
            sent = None
    process.join(120)
    conn.close()
    return process.exitcode, sent


def _intact(root: Path, where: str) -> int:
    """Every committed index verifies and loads as the iteration it holds; the latest."""
    reference = crash_harness.Reference(frozen=crash_harness.PRUNE_FROZEN)
    report = verify(root)
    assert report.ok, f"{where}: {report.summary()}"
    manifest = Manifest.load(root)
    for index in sorted(manifest.entries):
        loaded = load_checkpoint(root, index)["models"]["main"]["model"]
        n = crash_harness.encoded(loaded)
        assert n == index, f"{where}: index {index} holds iteration {n}"
        found = crash_harness.difference(reference.state(n)[0], dict(loaded.state_dict()))
        assert found is None, f"{where}: index {index}: {found}"
    assert manifest.latest is not None
    return manifest.latest


def test_a_prune_without_hard_links_sigkilled_at_each_step_keeps_every_committed_index(
    tmp_path: Path,
) -> None:
    """Without hard links a prune of an old-layout root kept index 0's bytes by renaming
    ``ROOT/0`` to ``.ref-0`` before its commit: killed in between, index 0 was committed but
    did not load (verify: its files missing), and the next save deleted ``.ref-0``, breaking
    indices 2 and 3 for good. Now the folder is renamed after the commit (references of kept
    indices read ``ROOT/0`` until then): every committed index loads after each kill and
    after the next save and prune."""
    torch.set_num_threads(1)
    code, mutations = _run_child(tmp_path / "dry", 0)
    assert code == 0 and isinstance(mutations, int) and mutations > 3, (code, mutations)
    assert sorted(Manifest.load(tmp_path / "dry").entries) == [2, 3]
    assert (tmp_path / "dry" / ".ref-0").is_dir()
    for kill_at in range(1, mutations + 1):
        root = tmp_path / f"kill{kill_at}"
        code, _ = _run_child(root, kill_at)
        assert code == -signal.SIGKILL, f"kill point {kill_at}: exit {code}"
        where = f"kill point {kill_at} of {mutations}"
        assert _intact(root, f"{where}, after the kill") == 3
        loaded = load_checkpoint(root)["models"]["main"]
        model, optimizer = loaded["model"], loaded["optimizers"]["adam"]["optimizer"]
        crash_harness.advance(model, optimizer, 4)
        save_checkpoint(
            root, models={"main": (model, None)}, optimizers={"adam": (optimizer, None)}
        )
        _intact(root, f"{where}, after the next save")
        prune(root, keep_last=1)
        assert _intact(root, f"{where}, after a prune") == 4


def test_a_prune_with_no_inode_free_explains_the_way_out(tmp_path: Path) -> None:
    """Before: with no inode free the prune's lock file could not be created and the error
    was the bare "[Errno 28] .../.fastckpt.lock: No space left on device" (``fastckpt prune``:
    exit 2 with that text), while ``df -h`` showed free space. Now ``prune`` raises the prune's
    full-disk message: nothing was deleted, the folders to delete by hand, and inodes
    (``df -i``); so does the command."""
    mount = tmp_path / "disk"
    _mount(mount, inodes=200)
    try:
        root = mount / "ckpt"
        layer = torch.nn.Linear(64, 64)
        for _ in range(3):
            save_checkpoint(root, models={"m": (layer, None)})
        filler = _use_inodes(mount, 0)
        with pytest.raises(OSError) as caught:
            prune(root, 1)
        message = str(caught.value)
        assert caught.value.errno == errno.ENOSPC
        assert "nothing was deleted" in message and f"rm -rf {root}/0 {root}/1" in message
        assert "df -i" in message and ".fastckpt.lock:" not in message, message
        ran = subprocess.run(
            [sys.executable, "-m", "fastckpt", "prune", str(root), "--keep-last", "1"],
            capture_output=True,
            text=True,
        )
        # The command says what the prune says: the folders to delete by hand.
        assert ran.returncode != 0 and "nothing was deleted" in ran.stderr, ran.stderr
        assert f"rm -rf {root}/0 {root}/1" in ran.stderr and "df -i" in ran.stderr, ran.stderr
        assert not ran.stderr.startswith(f"fastckpt prune: error: {root}/.fastckpt.lock")
        assert [c["index"] for c in list_checkpoints(root)] == [0, 1, 2]
        shutil.rmtree(filler)
        assert prune(root, 1) == [0, 1]
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_export_and_promote_into_a_full_disk_explain_the_way_out(
    tmp_path: Path, disk: Path
) -> None:
    """Before: ``fastckpt export`` / ``fastckpt promote`` into a full disk printed the Rust
    writer's bare "No space left on device (os error 28)", for promote naming a hidden
    temporary path (``durable/.tmp-0~...``). Now each names its target, says nothing was
    written or promoted and what is kept, and the fix; no temporary path."""
    source = tmp_path / "src"
    save_checkpoint(source, models={"main": (torch.nn.Linear(256, 256), None)})
    stat = os.statvfs(disk)
    with open(disk / "filler", "wb") as filler:  # no page free
        os.posix_fallocate(filler.fileno(), 0, stat.f_bavail * stat.f_frsize)
    out, durable = disk / "w.safetensors", disk / "durable"
    for command, target, said in (
        (["export", str(source), "--to", str(out)], out, "nothing was written"),
        (["promote", str(source), str(durable)], durable, "nothing more was promoted"),
        (["promote", str(source), str(durable)], durable, "what it held is intact"),
    ):
        ran = subprocess.run(
            [sys.executable, "-m", "fastckpt", *command], capture_output=True, text=True
        )
        assert ran.returncode != 0, ran
        error = ran.stderr
        assert "No space left on device" in error and str(target) in error, error
        assert said in error and "free space" in error, error
        assert ".tmp-" not in error and "os error 28" not in error, error
    assert not out.exists()
    assert not durable.exists() or not list_checkpoints(durable)
    assert fastckpt.verify(source).ok


def test_a_save_out_of_inodes_with_space_to_spare_names_inodes(disk: Path) -> None:
    """Review: the inode advice counted the inodes free after the failed save had removed its
    files, and asked for fewer than 16: a save of 40 models with 20 inodes free (and most of
    the 16 MiB free) was told only to "free space", while ``df -h`` showed space."""
    models = {f"m{i}": (torch.nn.Linear(2, 2), None) for i in range(40)}
    _use_inodes(disk, 20)
    with pytest.raises(OSError) as caught:
        save_checkpoint(disk / "root", models=models)
    assert caught.value.errno == errno.ENOSPC
    assert "inodes (df -i)" in str(caught.value), caught.value


def test_a_prune_with_nothing_to_put_back_keeps_its_old_answer_on_a_damaged_manifest(
    tmp_path: Path,
) -> None:
    """Review 3: the check that a manifest is intact before a `.ref-<i>` is put back ran at
    every prune, so a prune with nothing due and nothing to put back raised on a damaged
    manifest where it returned [] before. It runs only when something is put back."""
    root = tmp_path / "root"
    save_checkpoint(root, models={"m": (torch.nn.Linear(2, 2), None)})
    manifest = root / "manifest.json"
    document = json.loads(manifest.read_text())
    document["checkpoints"]["0"]["counters"] = {"step": 999}  # edited by hand: the seal fails
    manifest.write_text(json.dumps(document))
    assert prune(root, 1) == []
