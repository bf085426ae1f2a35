"""The one commit protocol (fastckpt.container.commit): generation names, the record written
last, what a commit removes, and that every writer of generations goes through it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from fastckpt.container import commit as protocol
from fastckpt.container.sharded import commit as sharded_commit
from fastckpt.format.records import GENERATION_PREFIX, generation_order, new_generation

RECORD = "record.json"


def _record(directory: Path, generation: str) -> bytes:
    return json.dumps({"generation": generation}).encode()


def _generation(directory: Path, name: str) -> Path:
    path = directory / name
    path.mkdir(parents=True)
    (path / "data.bin").write_bytes(b"x" * 16)
    return path


def test_new_generations_are_unique_and_sort_by_creation_time() -> None:
    first = new_generation()
    time.sleep(0.003)
    second = new_generation()
    assert first.startswith(GENERATION_PREFIX) and second.startswith(GENERATION_PREFIX)
    assert len({new_generation() for _ in range(1000)}) == 1000
    first_key, second_key = generation_order(first), generation_order(second)
    assert first_key is not None and second_key is not None
    assert first_key < second_key


def test_names_of_earlier_versions_are_generations_and_older_than_new_ones() -> None:
    manager_v1 = "g-" + "ab" * 16  # CheckpointManager on object stores, before this version
    sharded_v1 = "g1733000000000-0123abcd"  # sharded checkpoints, before this version
    fresh = new_generation()
    assert generation_order(manager_v1) == (0, manager_v1)
    assert generation_order(sharded_v1) == (1733000000000, sharded_v1)
    ordered = sorted([fresh, sharded_v1, manager_v1], key=lambda n: generation_order(n) or (0, n))
    assert ordered == [manager_v1, sharded_v1, fresh]


@pytest.mark.parametrize(
    "name",
    ["g-", "g-123", "g-1733000000000-xyz", "gen", "rank-00000.safetensors", ".tmp-g-1", "g1-ab"],
)
def test_other_names_are_not_generations(name: str) -> None:
    assert generation_order(name) is None


def test_commit_writes_the_record_then_removes_only_older_generations(tmp_path: Path) -> None:
    old = _generation(tmp_path, "g1733000000000-0123abcd")  # committed, earlier version
    (tmp_path / RECORD).write_bytes(_record(tmp_path, old.name))
    killed = _generation(tmp_path, new_generation())  # an interrupted save
    time.sleep(0.003)
    mine = _generation(tmp_path, new_generation())
    time.sleep(0.003)
    running = _generation(tmp_path, new_generation())  # a newer save still under way
    (tmp_path / "unrelated.txt").write_text("kept")

    removed = protocol.commit_generation(tmp_path, RECORD, _record(tmp_path, mine.name), mine.name)

    assert json.loads((tmp_path / RECORD).read_bytes()) == {"generation": mine.name}
    assert sorted(removed) == sorted([old, killed])
    assert not old.exists() and not killed.exists()
    assert mine.exists() and running.exists() and (tmp_path / "unrelated.txt").exists()
    assert protocol.generation_dirs(tmp_path) == [mine, running]


def test_an_older_save_never_replaces_a_newer_commit(tmp_path: Path) -> None:
    older = _generation(tmp_path, new_generation())
    time.sleep(0.003)
    newer = _generation(tmp_path, new_generation())
    protocol.commit_generation(tmp_path, RECORD, _record(tmp_path, newer.name), newer.name)
    checked: list[bool] = []

    with pytest.raises(RuntimeError, match=r"a newer save .* nothing was committed"):
        protocol.commit_generation(
            tmp_path,
            RECORD,
            _record(tmp_path, older.name),
            older.name,
            check=lambda: checked.append(True),
        )

    assert checked == []  # refused before the check and the put
    assert json.loads((tmp_path / RECORD).read_bytes()) == {"generation": newer.name}
    assert newer.exists()


_COMMIT_NEWER = """
import sys
from pathlib import Path
from fastckpt.container import commit as protocol
directory, record, generation, marker = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
Path(marker).write_text("at the commit")
data = ('{"generation": "%s"}' % generation).encode()
protocol.commit_generation(directory, record, data, generation)
"""


def test_a_commit_in_another_process_waits_and_the_newer_generation_wins(tmp_path: Path) -> None:
    """Two processes committing one local directory: while one reads, checks and writes the
    record, the other waits (the directory's lock file), so the newer generation's record
    is the one left, naming a generation that exists. Before, only threads of one process
    were serialized: the newer save committed during the older one's check and removed the
    older one's generation, then the older one put its record naming that removed
    generation, and the checkpoint could not be loaded at all."""
    older = _generation(tmp_path, new_generation())
    time.sleep(0.003)
    newer = _generation(tmp_path, new_generation())
    marker = tmp_path.parent / "b-at-commit"
    procs: list[subprocess.Popen[bytes]] = []

    def check() -> None:  # the newer save reaches its commit meanwhile
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    _COMMIT_NEWER,
                    str(tmp_path),
                    RECORD,
                    newer.name,
                    str(marker),
                ]
            )
        )
        deadline = time.monotonic() + 120
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        with contextlib.suppress(subprocess.TimeoutExpired):
            procs[0].wait(timeout=2.0)  # it finishes only if nothing holds it back

    protocol.commit_generation(
        tmp_path, RECORD, _record(tmp_path, older.name), older.name, check=check
    )
    assert procs[0].wait(timeout=120) == 0
    assert json.loads((tmp_path / RECORD).read_bytes()) == {"generation": newer.name}
    assert newer.exists() and not older.exists()
    assert not (tmp_path / ".fastckpt.lock").exists()


def test_a_failed_check_commits_nothing_and_removes_nothing(tmp_path: Path) -> None:
    old = _generation(tmp_path, new_generation())
    (tmp_path / RECORD).write_bytes(_record(tmp_path, old.name))
    time.sleep(0.003)
    mine = _generation(tmp_path, new_generation())

    def missing_files() -> None:
        raise FileNotFoundError("rank 1's file is missing")

    with pytest.raises(FileNotFoundError):
        protocol.commit_generation(
            tmp_path, RECORD, _record(tmp_path, mine.name), mine.name, check=missing_files
        )
    assert json.loads((tmp_path / RECORD).read_bytes()) == {"generation": old.name}
    assert old.exists() and mine.exists()


def test_sweep_all_keeps_only_the_record_and_the_committed_generation(tmp_path: Path) -> None:
    mine = _generation(tmp_path, new_generation())
    time.sleep(0.003)
    _generation(tmp_path, new_generation())
    (tmp_path / "model.safetensors").write_bytes(b"written in place by an earlier version")

    protocol.commit_generation(
        tmp_path, RECORD, _record(tmp_path, mine.name), mine.name, sweep_all=True
    )

    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([RECORD, mine.name])


def test_the_sharded_commit_is_the_protocol(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sharded commit runs fastckpt.container.commit's code (no second copy of it): a
    change there (here a spy on its cleanup step) is seen by a sharded commit."""
    seen: list[tuple[Path, str, str]] = []
    real = protocol.remove_superseded

    def spy(directory: Path, keep: str, record_name: str, **options: Any) -> list[Path]:
        seen.append((directory, keep, record_name))
        return real(directory, keep, record_name, **options)

    monkeypatch.setattr(protocol, "remove_superseded", spy)
    generation = sharded_commit.new_generation()
    sharded_commit.make_generation_dir(tmp_path, generation)
    sharded_commit.commit(tmp_path, generation, _record(tmp_path, generation), lambda: None)
    assert seen == [(tmp_path, generation, sharded_commit.RECORD_NAME)]
    assert Path(protocol.__file__).read_text().count(".put_record(") == 1


@pytest.mark.parametrize("first", [True, False], ids=["first-save", "later-save"])
def test_an_interruption_after_the_manifest_took_its_place_keeps_the_index_it_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, first: bool
) -> None:
    # Ctrl-C (SIGINT's KeyboardInterrupt) landing right after the new manifest was renamed
    # into place, before the write returned: the save is interrupted, but its index is
    # committed. Before, the clean-up deleted the index directory the manifest names
    # (load_checkpoint: FileNotFoundError; a first save left no loadable checkpoint at all).
    import torch

    import fastckpt
    from fastckpt import _native

    root = tmp_path / "root"
    model = torch.nn.Linear(8, 8)
    if not first:
        fastckpt.save_checkpoint(root, models={"m": model}, counters={"step": 1})
    with torch.no_grad():
        model.weight.add_(1.0)
    write = _native.write_bytes_atomic

    def write_then_interrupt(path: str, data: bytes, *args: Any) -> Any:
        result = write(path, data, *args)
        if path.endswith("manifest.json"):
            # What SIGINT's default handler raises (not the signal itself: an earlier test in
            # the same process may have installed another handler for it).
            raise KeyboardInterrupt
        return result

    monkeypatch.setattr(_native, "write_bytes_atomic", write_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        fastckpt.save_checkpoint(root, models={"m": model}, counters={"step": 2})
    monkeypatch.setattr(_native, "write_bytes_atomic", write)
    assert fastckpt.verify(root).ok
    loaded = fastckpt.load_checkpoint(root)
    assert loaded["manifest"]["counters"] == {"step": 2}
    assert torch.equal(loaded["models"]["m"]["model"].weight, model.weight)
    assert fastckpt.save_checkpoint(root, models={"m": model}) == (1 if first else 2)


def test_a_child_forked_during_a_commit_in_another_thread_commits_too(tmp_path: Path) -> None:
    """A thread of the parent inside a commit of ``tmp_path`` (holding this process's commit
    lock of that checkpoint) when another thread forks: before, the child's own commit of it
    waited forever for the lock the vanished thread held."""
    mine = _generation(tmp_path, new_generation())
    inside, release = threading.Event(), threading.Event()

    def committing() -> None:
        with protocol._commit_lock(tmp_path):
            inside.set()
            release.wait(30)

    thread = threading.Thread(target=committing)
    thread.start()
    inside.wait(10)
    pid = os.fork()
    if pid == 0:  # the child: commit on its one thread, then leave without the parent's cleanup
        code = 1
        try:
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            signal.alarm(20)  # a commit waiting forever ends the child by SIGALRM
            protocol.commit_generation(tmp_path, RECORD, _record(tmp_path, mine.name), mine.name)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    release.set()
    thread.join()
    assert os.waitstatus_to_exitcode(status) == 0, "the child's commit waited for the lock"
    assert json.loads((tmp_path / RECORD).read_bytes()) == {"generation": mine.name}
