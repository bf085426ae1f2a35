"""Checkpoints in unusual but real environments (round 19): names the filesystem holds that
are not UTF-8, and other processes' staging folders."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
import torch

import fastckpt
from cli_support import cli_runner
from fastckpt.storage import identity
from fastckpt.storage.backend import (
    STALE_STAGING_SECONDS,
    TEMP_PREFIX,
    LocalStaging,
    _owner,
    clean_dead_siblings,
)
from fastckpt.storage.identity import HOST


def _latin1(name: bytes) -> str:
    """A name as ``os.listdir`` gives it for a non-UTF-8 filesystem name (surrogateescape)."""
    return os.fsdecode(name)


def test_non_utf8_names_in_a_manager_folder_and_its_fast_tier_are_handled(tmp_path: Path) -> None:
    """Before: a sibling named ``b"old_caf\\xe9"`` in the fast tier made every save (after it
    committed) raise a bare ``UnicodeEncodeError`` from the fast tier's retention, every
    promotion fail on it (the durable tier stayed behind), ``close()`` raise; a manager id with
    such a name was refused with the same bare error (``str.encode`` of a temporary name
    instead of ``os.fsencode``)."""
    fast, durable = tmp_path / "fast", tmp_path / "durable"
    fast.mkdir()
    durable.mkdir()
    model = torch.nn.Linear(4, 4)
    config = fastckpt.CheckpointManager.Config.with_sync_save()
    config.tiers = fastckpt.TiersConfig(fast=fast, durable=durable, keep_last=1)
    with fastckpt.CheckpointManager(config) as manager:
        manager.save("step_1", {"m": model})
    os.rename(fast / "step_1", fast / _latin1(b"old_caf\xe9"))
    with fastckpt.CheckpointManager(config) as manager:
        for step in (2, 3):
            manager.save(f"step_{step}", {"m": model})  # returns: committed and retained
    assert sorted(os.listdir(fast)) == ["step_3"]
    assert {"step_1", "step_2", "step_3"} <= set(os.listdir(durable))
    assert fastckpt.verify(durable / "step_3").ok

    named = tmp_path / _latin1(b"step_caf\xe9")
    for config in (
        fastckpt.CheckpointManager.Config.with_sync_save(),
        fastckpt.CheckpointManager.Config.with_async_save(),
    ):
        with fastckpt.CheckpointManager(config) as manager:
            future = manager.save(named, {"m": model})
            if future is not None:
                future.result()
            restored = torch.nn.Linear(4, 4)
            manager.load(named, into={"m": restored})
        assert torch.equal(restored.weight, model.weight)


def test_cli_prune_deletes_a_checkpoint_with_a_non_utf8_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: ``fastckpt prune --keep-last 1`` died with a ``UnicodeEncodeError`` traceback
    and deleted nothing (``--dry-run`` listed the names)."""
    model = torch.nn.Linear(4, 4)
    with fastckpt.CheckpointManager() as manager:
        for step in (1, 2, 3):
            manager.save(tmp_path / f"step_{step}", {"m": model})
    os.rename(tmp_path / "step_1", tmp_path / _latin1(b"caf\xe9_step_1"))
    code, out, err = cli_runner(capsys)("prune", tmp_path, "--keep-last", "1")
    assert code == 0, out + err
    assert sorted(os.listdir(tmp_path)) == ["step_3"]


def _staging_name(target: str, pid: int, tag: str) -> str:
    suffix = f".{tag}" if tag else ""
    return f"{TEMP_PREFIX}{target}~{pid}~{HOST}~0badc0de{suffix}"


def test_a_live_writers_staging_is_kept_however_old_and_a_reused_pids_is_not(
    tmp_path: Path,
) -> None:
    """A sibling save's sweep removed the staging folder of a live writer of this host once
    nothing in it had changed for 24 h by the wall clock (a writer stopped with SIGSTOP, a
    VM or job suspended a day, or a clock stepped forward): the writer's save then failed
    with a bare FileNotFoundError. Names now record the writer's start time and boot, so a
    writer proven alive keeps its staging, and a pid taken by another process is known
    gone at once."""
    writer = subprocess.Popen(["sleep", "60"])
    try:
        started = identity._started(writer.pid)
        assert started is not None
        boot = identity.writer_tag().split("-", 1)[1]
        day_ago = time.time() - 2 * STALE_STAGING_SECONDS
        names = {
            "alive": _staging_name("step_1", writer.pid, f"{started:x}-{boot}"),
            "reused": _staging_name("step_2", writer.pid, f"{started + 1:x}-{boot}"),
            "old_boot": _staging_name("step_3", writer.pid, f"{started:x}-00000000"),
            "untagged": _staging_name("step_4", writer.pid, ""),  # an earlier version's name
        }
        for key, name in names.items():
            folder = tmp_path / name
            folder.mkdir()
            (folder / "w.safetensors").write_bytes(b"x")
            if key != "reused":  # fresh: removed only because its writer is proven gone
                for path in (folder / "w.safetensors", folder):
                    os.utime(path, (day_ago, day_ago))
        removed = clean_dead_siblings(tmp_path)
        assert sorted(removed) == sorted([names["reused"], names["old_boot"], names["untagged"]])
        assert os.listdir(tmp_path) == [names["alive"]]
    finally:
        writer.kill()
        writer.wait()
    assert clean_dead_siblings(tmp_path) == [names["alive"]]  # its writer is gone now


def test_a_staging_name_records_this_writers_start_and_boot(tmp_path: Path) -> None:
    with fastckpt.CheckpointManager() as manager:
        staging = LocalStaging(tmp_path / "step_1")
        try:
            owner = _owner(staging.temp.name)
            assert owner is not None
            _, target, pid, host, tag = owner
            assert (target, pid, host) == ("step_1", os.getpid(), HOST)
            assert tag == identity.writer_tag() != ""
            assert identity.running(pid, host, tag) is True
        finally:
            staging.discard()
        manager.save(tmp_path / "step_1", {"x": torch.zeros(2)})
    assert os.listdir(tmp_path) == ["step_1"]


def test_a_backslash_in_a_manager_id_is_refused_for_what_it_is(tmp_path: Path) -> None:
    """Before: "use a name without path separators", although a backslash is none on Linux."""
    with (
        fastckpt.CheckpointManager() as manager,
        pytest.raises(fastckpt.CheckpointFormatError, match=r"backslash \(a separator on Windows"),
    ):
        manager.save(tmp_path / "run\\1", {"x": torch.zeros(1)})
    assert os.listdir(tmp_path) == []


def test_a_live_writer_whose_proc_entry_is_hidden_is_not_taken_for_gone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Review of the first version: with ``/proc`` mounted ``hidepid=2`` another user's
    ``/proc/<pid>/stat`` cannot be read, and ``running`` said False (gone): that user's live
    staging was deleted at once. The unreadable entry is simulated (remounting ``/proc``
    would change the whole machine); the writer is a real live process."""
    writer = subprocess.Popen(["sleep", "60"])
    try:
        started = identity._started(writer.pid)
        tag = f"{started:x}-{identity.writer_tag().split('-', 1)[1]}"
        assert identity.running(writer.pid, HOST, tag) is True
        monkeypatch.setattr(identity, "_started", lambda pid: None)
        assert identity.running(writer.pid, HOST, tag) is None  # alive, cannot be told
    finally:
        writer.kill()
        writer.wait()
    assert identity.running(writer.pid, HOST, tag) is False  # no process has the pid


def test_leftover_names_with_a_pid_no_kernel_has_are_left_alone(tmp_path: Path) -> None:
    """Review 2: names parsed with ``str.isdigit`` took "²" for a pid (int() then raised a
    bare ValueError from a save's sweep) and a 30-digit pid made ``os.kill`` raise
    OverflowError. Such names are no fastckpt leftovers: left alone."""
    for pid in ("²", "9" * 30):
        (tmp_path / f"{TEMP_PREFIX}step_1~{pid}~{HOST}~0badc0de").mkdir()
    assert clean_dead_siblings(tmp_path) == []
    with fastckpt.CheckpointManager() as manager:
        manager.save(tmp_path / "step_1", {"x": torch.zeros(1)})
    assert len(os.listdir(tmp_path)) == 3


@pytest.mark.parametrize("stray", ["²", ".ref-²", "٣"])
def test_a_stray_folder_named_with_a_non_ascii_digit_does_not_break_saves(
    tmp_path: Path, stray: str
) -> None:
    """Review 3: ``str.isdigit`` takes "²" for a digit and ``int()`` refuses it: a stray
    folder ``ROOT/²`` or ``ROOT/.ref-²`` made every later save_checkpoint raise a bare
    ValueError. Names are parsed as ASCII digits only; the stray folder is left alone."""
    model = torch.nn.Linear(2, 2)
    root = tmp_path / "root"
    fastckpt.save_checkpoint(root, models={"m": (model, None)})
    (root / stray).mkdir()
    fastckpt.save_checkpoint(root, models={"m": (model, None)})
    assert [entry["index"] for entry in fastckpt.list_checkpoints(root)] == [0, 1]
    assert fastckpt.verify(root).ok and (root / stray).is_dir()
