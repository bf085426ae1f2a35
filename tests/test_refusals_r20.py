"""Clearer refusals and warnings (round 20: interop finding 5, tools findings 2-3, knobs F3-F4).

* ``fastckpt.dcp.Reader`` / ``load_state`` on a checkpoint torch's ``FileSystemWriter`` wrote
  said "no committed sharded checkpoint ... Load another checkpoint or save again"; now a typed
  error names ``FileSystemReader``, as the write side already did.
* An older backup restored over a root (``cp -r backup/* root/``) made the next save replace
  a newer index folder the restored manifest does not name, without a word; it still does
  (a crash before a commit leaves the same picture), now with a logged warning naming it.
* ``load_checkpoint(ROOT/2)`` said only "no committed checkpoint here"; now it names
  ``load_checkpoint(ROOT, 2)``, and for an index folder copied without its root, says its
  records live in the root's ``manifest.json``.
* ``TiersConfig.keep_last``'s docstring said a checkpoint waiting for promotion is never
  deleted; the code spares the newest waiting one (and those being copied).
* ``fastckpt prune DIR --lock-timeout S`` on manager checkpoints accepted the flag and did
  nothing with it; now it is refused (exit 2), as ``promote --every`` is.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

import fastckpt
import fastckpt.dcp
from cli_support import Run, cli_runner
from fastckpt.errors import NotCommittedError
from fastckpt.manager import TiersConfig


@pytest.fixture()
def run(capsys: pytest.CaptureFixture[str]) -> Run:
    """``cli.main(args)``: (status, stdout, stderr)."""
    return cli_runner(capsys)


# --------------------------------------------------------------------------- a torch DCP checkpoint


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_reading_a_filesystemwriter_checkpoint_names_filesystemreader(tmp_path: Path) -> None:
    """Before: both load paths raised ``NotCommittedError: ... (fastckpt-dcp.json is
    missing). Load another checkpoint or save again.``: wrong advice for a checkpoint that
    is there, in torch's own format."""
    plain = tmp_path / "plain_dcp"
    dcp.save({"w": torch.ones(2)}, checkpoint_id=plain)  # torch's FileSystemWriter
    template = {"w": torch.zeros(2)}
    with pytest.raises(fastckpt.CheckpointFormatError) as caught:
        fastckpt.dcp.load_state(plain, into=template)
    message = str(caught.value)
    assert str(plain) in message and ".metadata" in message and "FileSystemReader" in message
    assert "save again" not in message
    assert not isinstance(caught.value, NotCommittedError)
    with pytest.raises(CheckpointException, match="FileSystemReader"):
        dcp.load(template, storage_reader=fastckpt.dcp.Reader(plain))
    assert torch.equal(template["w"], torch.zeros(2))
    dcp.load(template, storage_reader=dcp.FileSystemReader(plain))  # the advice works
    assert torch.equal(template["w"], torch.ones(2))


def test_an_empty_sharded_directory_still_says_not_committed(tmp_path: Path) -> None:
    """Without torch's ``.metadata`` nothing changes: no record is ``NotCommittedError``."""
    (tmp_path / "empty").mkdir()
    with pytest.raises(NotCommittedError, match="no committed sharded checkpoint"):
        fastckpt.dcp.load_state(tmp_path / "empty")


# --------------------------------------------------------------------------- a restored backup


def _save(root: Path, model: nn.Module, step: int) -> None:
    fastckpt.save_checkpoint(root, models={"m": (model, None)}, counters={"step": step})


def test_a_save_replacing_an_unnamed_newer_index_folder_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: after ``cp -r backup/* root/`` (the backup's manifest names 0..2, folders 3..5
    stay), the next save replaced folder 3, a committed and verified checkpoint until the
    restore, without a warning or a log line. It still replaces it; a warning names it."""
    root, backup = tmp_path / "root", tmp_path / "backup"
    model = nn.Linear(4, 2)
    for step in range(3):
        _save(root, model, step)
    shutil.copytree(root, backup)
    for step in range(3, 6):
        _save(root, model, step)
    subprocess.run(f"cp -r {backup}/* {root}/", shell=True, check=True)
    before = os.stat(root / "3" / "models" / "m.safetensors").st_ino
    with caplog.at_level(logging.WARNING, logger="fastckpt.container.commit"):
        _save(root, model, 99)
    assert os.stat(root / "3" / "models" / "m.safetensors").st_ino != before  # as before
    assert [row["index"] for row in fastckpt.list_checkpoints(root)] == [0, 1, 2, 3]
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1, warned
    assert str(root / "3") in warned[0] and "manifest.json" in warned[0]
    assert "replaces it" in warned[0] and "backup" in warned[0]


def test_a_crash_leftover_folder_is_replaced_with_an_info_line_not_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A save killed between putting its folder in place and committing the manifest leaves
    a folder written after the manifest's last commit: the next save replaces it (a routine
    crash recovery), logged at INFO. Review 1 of the first version: every preempted job got
    the backup-restore warning."""
    root = tmp_path / "root"
    model = nn.Linear(4, 2)
    _save(root, model, 0)
    _save(root, model, 1)
    os.utime(root / "manifest.json", ns=(1, 1))  # the last commit long before the crash
    shutil.copytree(root / "1", root / "2")  # written after it, never committed
    with caplog.at_level(logging.INFO, logger="fastckpt.container.commit"):
        _save(root, model, 2)
    assert [row["index"] for row in fastckpt.list_checkpoints(root)] == [0, 1, 2]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert any(
        r.levelno == logging.INFO and str(root / "2") in r.getMessage() for r in caplog.records
    )


def test_an_ordinary_save_logs_no_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The warning is for a folder already there, not for every new index."""
    model = nn.Linear(4, 2)
    with caplog.at_level(logging.WARNING, logger="fastckpt.container.commit"):
        for step in range(3):
            _save(tmp_path / "root", model, step)
        fastckpt.save_checkpoint(tmp_path / "root", models={"m": (model, None)}, checkpoint_index=1)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


# --------------------------------------------------------------------------- an index folder


def test_load_checkpoint_of_an_index_folder_names_the_root_and_index(tmp_path: Path) -> None:
    """Before: ``FileNotFoundError: ROOT/1/manifest.json: no committed checkpoint here``,
    while ``fastckpt ls``/``verify`` recognize the path as one index of the root."""
    root = tmp_path / "root"
    model = nn.Linear(4, 2)
    _save(root, model, 0)
    _save(root, model, 1)
    with pytest.raises(FileNotFoundError) as caught:
        fastckpt.load_checkpoint(root / "1")
    message = str(caught.value)
    assert "no committed checkpoint here" in message
    assert f"index 1 of the save_checkpoint root {root}" in message
    assert f"load_checkpoint({str(root)!r}, 1)" in message
    assert fastckpt.load_checkpoint(str(root), 1)["checkpoint_index"] == 1  # the advice works


def test_load_checkpoint_of_an_index_folder_copied_alone_says_where_its_records_are(
    tmp_path: Path,
) -> None:
    """Before: the same bare "no committed checkpoint here", for the folder itself and for
    the folder it was copied into; nothing said an index cannot be loaded without its root."""
    root = tmp_path / "root"
    model = nn.Linear(4, 2)
    _save(root, model, 0)
    _save(root, model, 1)
    shutil.copytree(root / "1", tmp_path / "other" / "1")  # "the newest checkpoint", alone
    for given in (tmp_path / "other" / "1", tmp_path / "other"):
        with pytest.raises(FileNotFoundError) as caught:
            fastckpt.load_checkpoint(given)
        message = str(caught.value)
        assert "no committed checkpoint here" in message, given
        assert "copied without its root" in message and "manifest.json" in message, given
        assert "fastckpt export" in message, given


def test_an_empty_folder_still_says_only_no_committed_checkpoint(tmp_path: Path) -> None:
    """No hint where there is nothing to hint at (a new root)."""
    (tmp_path / "new").mkdir()
    with pytest.raises(FileNotFoundError) as caught:
        fastckpt.load_checkpoint(tmp_path / "new")
    assert str(caught.value).endswith("no committed checkpoint here")


# --------------------------------------------------------------------------- tiers and prune


def test_tiers_keep_last_docstring_says_what_the_retention_spares() -> None:
    """Before: "A checkpoint still waiting for its promotion ... never deleted", while the
    retention spares only the newest waiting one and those the promotion copies (older ones
    still waiting are superseded: a lagging durable tier saw them deleted)."""
    doc = " ".join((TiersConfig.__doc__ or "").split())
    assert "A checkpoint still waiting for its promotion, and the newest one" not in doc
    assert "the newest checkpoint waiting for its promotion" in doc
    assert "older ones still waiting may be deleted" in doc


def _manager_checkpoints(directory: Path) -> None:
    config = fastckpt.CheckpointManager.Config.with_sync_save()
    with fastckpt.CheckpointManager(config) as manager:
        for step in (1, 2, 3):
            manager.save(directory / f"step_{step}", {"model": {"w": torch.full((2,), step)}})


def test_prune_refuses_lock_timeout_for_manager_checkpoints(run: Run, tmp_path: Path) -> None:
    """Before: accepted and ignored (manager checkpoints take no lock); now exit 2 naming the
    flag, nothing deleted, as ``promote --every`` is refused for them."""
    _manager_checkpoints(tmp_path / "mgr")
    for extra in ((), ("--dry-run",)):
        status, out, err = run(
            "prune", tmp_path / "mgr", "--keep-last", "1", "--lock-timeout", "0", *extra
        )
        assert status == 2 and not out, err
        assert "--lock-timeout" in err and "save_checkpoint roots" in err
    assert sorted(os.listdir(tmp_path / "mgr")) == ["step_1", "step_2", "step_3"]
    status, out, err = run("prune", tmp_path / "mgr", "--keep-last", "1")
    assert status == 0 and sorted(os.listdir(tmp_path / "mgr")) == ["step_3"], err
    status, out, _ = run("prune", "--help")
    assert "save_checkpoint roots only" in " ".join(out.split())
