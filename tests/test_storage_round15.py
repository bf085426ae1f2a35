"""The local store's edges found in round 15: a root's lock inherited by a forked child, a
CheckpointManager id that is a symlink to another disk, and a save that ran out of file
descriptors.

Before: a child forked while a thread of its parent held a root's lock waited for that lock
forever in its own save (it held the parent's ``flock`` itself, through the inherited
descriptor); a manager save to ``ckpt -> /big/disk/ckpt`` staged beside the link, swapped the
link away and from then on kept the checkpoint on the link's disk; a save failing with EMFILE
left its staging folder without a word, and the next sweep told the user to fix permissions.
"""

from __future__ import annotations

import errno
import fcntl
import json
import multiprocessing
import os
import queue
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

import fastckpt
from fastckpt.storage.lock import LOCK_FILE, RootLock, lock_holder


def _sync() -> fastckpt.CheckpointManager:
    return fastckpt.CheckpointManager(fastckpt.CheckpointManager.Config.with_sync_save())


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3)


def _locked_by_someone(root: Path) -> bool:
    """Whether a process (this one included, through another open file) holds ``root``'s lock."""
    fd = os.open(root / LOCK_FILE, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def _child_saves(root: str, report: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    """In the forked child: what it sees of the parent's lock, then a save into the root
    (waiting for the lock as long as it takes: the parent kills a child that never gets it)."""
    report.put(
        {
            "held": [lock.held for lock in _INHERITED],
            "holder": lock_holder(root),
            "still_locked": _locked_by_someone(Path(root)),
        }
    )
    fastckpt.save_checkpoint(root, models={"child": _model()})
    report.put("saved")


def _waits_for_a_flock(pid: int) -> bool:
    """Whether process ``pid`` is blocked in ``flock`` (a ``->`` line of ``/proc/locks``)."""
    lines = Path("/proc/locks").read_text().splitlines()
    return any("->" in line and "FLOCK" in line and line.split()[-4] == str(pid) for line in lines)


#: The parent's RootLock objects, as the forked child inherits them.
_INHERITED: list[RootLock] = []


def test_a_child_forked_while_a_thread_holds_the_root_lock_saves_once_it_is_released(
    tmp_path: Path,
) -> None:
    """A thread of the parent holds the root's lock (as inside ``save_checkpoint``) when the
    main thread forks. The child does not hold that lock (no thread of it is inside the
    locked section): its inherited ``RootLock`` says so, the lock stays the parent's while
    the parent holds it, and the child's own save waits for the parent's release, then
    commits. Before, the inherited descriptor carried the parent's ``flock`` into the child,
    which then waited for itself: its save timed out (forever without a timeout) even after
    the parent released the lock."""
    root = tmp_path / "root"
    fastckpt.save_checkpoint(root, models={"main": _model()})
    taken, release = threading.Event(), threading.Event()

    def hold() -> None:
        with RootLock(root) as lock:
            _INHERITED.append(lock)
            taken.set()
            release.wait()

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert taken.wait(10)
        context = multiprocessing.get_context("fork")
        report = context.Queue()
        child = context.Process(target=_child_saves, args=(str(root), report))
        child.start()
        seen = report.get(timeout=20)  # what the child saw while the parent held the lock
        assert _locked_by_someone(root)  # still the parent's
        assert child.pid is not None
        deadline = time.monotonic() + 30
        while not _waits_for_a_flock(child.pid) and time.monotonic() < deadline:
            time.sleep(0.05)  # the child waits for the lock (after logging who holds it)
        assert _waits_for_a_flock(child.pid)
    finally:
        release.set()
        holder.join()
        _INHERITED.clear()
    try:
        result = report.get(timeout=30)
    except queue.Empty:
        result = "still waiting for the lock 30 s after the parent released it"
    child.join(30)
    if child.is_alive():
        child.kill()
        child.join()
    assert (result, seen["held"]) == ("saved", [False])
    assert seen["holder"].startswith(f"pid {os.getpid()} on host ")
    assert seen["still_locked"] is True  # the child's close did not release the parent's lock
    assert child.exitcode == 0
    assert [entry["index"] for entry in fastckpt.list_checkpoints(root)] == [0, 1]


def _manager(async_save: bool, staged_at: list[str]) -> fastckpt.CheckpointManager:
    """A manager whose pre-finalize callback records where each save staged its files."""
    config = (
        fastckpt.CheckpointManager.Config.with_async_save()
        if async_save
        else fastckpt.CheckpointManager.Config.with_sync_save()
    )
    config.pre_finalize_callback = lambda args: staged_at.append(args.path)
    return config.build()


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_manager_id_that_is_a_symlink_is_written_through_the_link(
    tmp_path: Path, async_save: bool
) -> None:
    """``ckpt -> big/ckpt`` (a user pointing the id at a bigger disk): each save stages
    beside the target, swaps the new checkpoint in there and keeps the link, so the
    checkpoint and every later one live on the target's disk. Before, the save staged beside
    the link, exchanged the staging folder with the link itself and deleted the link as the
    old checkpoint: from then on the checkpoint lived on the link's disk (there, the second,
    larger save ran out of space) and nothing went to the target."""
    (tmp_path / "small").mkdir()
    target, link = tmp_path / "big" / "ckpt", tmp_path / "small" / "ckpt"
    target.mkdir(parents=True)
    os.symlink(target, link)
    staged_at: list[str] = []
    with _manager(async_save, staged_at) as manager:
        for value in (1.0, 2.0):
            future = manager.save(link, {"x": torch.full((1000,), value)})
            if future is not None:
                future.result()
            assert os.readlink(link) == str(target)
            assert "commit.json" in os.listdir(target)
        loaded = manager.load(link)
    assert torch.equal(loaded["x"], torch.full((1000,), 2.0))
    assert sorted(os.listdir(tmp_path / "small")) == ["ckpt"]
    assert sorted(os.listdir(tmp_path / "big")) == ["ckpt"]  # the replaced one is gone
    assert len(staged_at) == 2
    assert all(Path(where).parent == tmp_path / "big" for where in staged_at), staged_at
    assert fastckpt.verify(link).ok


def test_a_save_through_an_alias_is_refused_and_both_names_stay(tmp_path: Path) -> None:
    """``latest -> step_20`` beside it (an alias): a save to ``latest`` would now write through
    the link and overwrite step_20 with another state under step_20's name. Refused instead,
    naming the alias and the fix; step_20 and the alias stay as they were."""
    root = tmp_path / "mgr"
    with _manager(False, []) as manager:
        manager.save(root / "step_20", {"x": torch.full((4,), 20.0)})
        os.symlink("step_20", root / "latest")
        with pytest.raises(fastckpt.NotACheckpointError, match=r"latest is an alias of step_20"):
            manager.save(root / "latest", {"x": torch.full((4,), 21.0)})
        assert torch.equal(manager.load(root / "step_20")["x"], torch.full((4,), 20.0))
    assert os.readlink(root / "latest") == "step_20"
    assert sorted(os.listdir(root)) == ["latest", "step_20"]


def test_a_save_through_a_link_to_nothing_names_the_link_and_its_target(tmp_path: Path) -> None:
    """``ckpt -> /mnt/big/ckpt`` with the disk not mounted. Before: "ckpt is a file, not a
    checkpoint" (NotACheckpointError), which named neither the link nor the fix."""
    link = tmp_path / "ckpt"
    os.symlink(tmp_path / "unmounted" / "ckpt", link)
    with (
        _manager(False, []) as manager,
        pytest.raises(FileNotFoundError, match=r"is a symlink to .*unmounted/ckpt, which"),
    ):
        manager.save(link, {"x": torch.ones(4)})
    assert os.path.islink(link) and not (tmp_path / "unmounted").exists()


def test_prune_of_a_checkpoint_saved_through_a_link_frees_its_target(tmp_path: Path) -> None:
    """Checkpoints of a tier root each saved through a link to another disk
    (``mgr/step_1 -> big/step_1``): a prune deletes the target's bytes and then the link.
    Before the write-through, the links had been replaced by real folders; after it, a prune
    deleted only the link and reported bytes freed that stayed on the other disk."""
    from fastckpt.container.promote_checkpoints import prune_checkpoints

    root, big = tmp_path / "mgr", tmp_path / "big"
    root.mkdir()
    with _manager(False, []) as manager:
        for step in (1, 2, 3):
            (big / f"step_{step}").mkdir(parents=True)
            os.symlink(big / f"step_{step}", root / f"step_{step}")
            manager.save(root / f"step_{step}", {"x": torch.full((4,), float(step))})
            time.sleep(0.01)  # distinct save times: the listing orders by them
    assert prune_checkpoints(root, 1) == ["step_1", "step_2"]
    assert sorted(os.listdir(root)) == ["step_3"]
    assert sorted(os.listdir(big)) == ["step_3"]
    assert fastckpt.verify(root / "step_3").ok


_OUT_OF_DESCRIPTORS = textwrap.dedent(
    """
    import json, os, sys, warnings
    import torch, fastckpt

    root = sys.argv[1]
    models = {f"m{i}": (torch.nn.Linear(8, 8), None) for i in range(3)}
    fastckpt.save_checkpoint(root, models=models)

    def exhaust(free):
        held = []
        while True:
            try:
                held.append(os.open("/dev/null", os.O_RDONLY))
            except OSError:
                break
        for _ in range(free):
            os.close(held.pop())
        return held

    attempts = []
    for free in range(60):  # each save fails at another step, until one has enough
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            held = exhaust(free)
            try:
                fastckpt.save_checkpoint(root, models=models)
                error = None
            except OSError as err:
                error = err.errno
            finally:
                for fd in held:
                    os.close(fd)
        leftovers = sorted(n for n in os.listdir(root) if n.startswith(".tmp-"))
        messages = [str(warning.message) for warning in caught]
        attempts.append({"error": error, "leftovers": leftovers, "warnings": messages})
        if error is None:
            break
    print(json.dumps({"attempts": attempts, "verified": fastckpt.verify(root).ok}))
    """
)


def test_a_save_out_of_file_descriptors_names_its_leftover_and_the_cause(tmp_path: Path) -> None:
    """Saves into a root with only ``free`` descriptors left (0, 1, 2, ...): each fails with
    EMFILE at another step until one has enough. A staging folder a failed save could not
    remove (its removal needs descriptors too) is named in a warning that says descriptors
    ran out and that a later save removes it, which the next one that can does. Before, the
    save's clean-up dropped it without a word (``rmtree(ignore_errors=True)``) and the next
    save's sweep, out of descriptors too, said "fix its permissions first"."""
    root = tmp_path / "root"
    done = subprocess.run(
        [sys.executable, "-c", _OUT_OF_DESCRIPTORS, str(root)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.splitlines()[-1])
    attempts = report["attempts"]
    assert attempts[-1]["error"] is None and report["verified"]
    assert attempts[-1]["leftovers"] == []  # the save that could removed every leftover
    failed = attempts[:-1]
    assert failed and all(attempt["error"] == errno.EMFILE for attempt in failed)
    assert any(attempt["leftovers"] for attempt in failed)  # the case this test is about
    for attempt in failed:
        for name in attempt["leftovers"]:
            said = [message for message in attempt["warnings"] if name in message]
            assert said, (name, attempt)
            assert all("file descriptor" in message for message in said), said
    assert not any("permissions" in m for attempt in attempts for m in attempt["warnings"])
