"""Locks a forked child may need, and a save asked while the interpreter exits.

Round 18: ``container/commit.py``'s ``_COMMITTED_LOCK`` was a plain ``threading.Lock`` taken
by every local commit; a child forked while a parent thread was inside it (a writer thread
committing: about 1 fork in 100 while a thread saved in a loop) waited forever in its own
first save, into any root. And a thread saving while the exit hooks ran (the main thread still
counted as alive) got concurrent.futures' bare "cannot schedule new futures after interpreter
shutdown" instead of fastckpt's explanation.
"""

from __future__ import annotations

import _thread
import importlib
import pkgutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import fastckpt

#: Module-level plain locks allowed: each is taken by the forking thread itself around the
#: fork (``os.register_at_fork(before=...)``), so a child never inherits it held by another.
TAKEN_AROUND_THE_FORK = {("fastckpt.storage.lock", "_GUARD")}

#: Modules that import optional packages (skipped when those are missing).
OPTIONAL = ("fastckpt.integrations.lightning",)


def test_no_module_keeps_a_lock_a_forked_child_could_inherit_held() -> None:
    """Every module-wide lock is a ForkSafeLock (made anew in a child) or taken around the
    fork; before, five were plain locks (the commit record's, the background writers'
    registry's, and three of the S3 backend's)."""
    plain = (type(_thread.allocate_lock()), type(_thread.RLock()))
    found = []
    for info in pkgutil.walk_packages(fastckpt.__path__, "fastckpt."):
        try:
            module = importlib.import_module(info.name)
        except ImportError:
            if info.name in OPTIONAL:
                continue
            raise
        for name, value in vars(module).items():
            if isinstance(value, plain) and (info.name, name) not in TAKEN_AROUND_THE_FORK:
                found.append(f"{info.name}.{name}")
    assert found == []


def _run_script(tmp_path: Path, text: str, root: Path) -> subprocess.CompletedProcess[str]:
    """Run ``text`` as a child Python script with ``root`` as its argument."""
    script = tmp_path / "child.py"
    script.write_text(text)
    return subprocess.run(
        [sys.executable, str(script), str(root)], capture_output=True, text=True, timeout=120
    )


FORK_DURING_COMMIT = textwrap.dedent(
    """
    import os, sys, threading, time
    import torch, fastckpt
    from fastckpt.container import commit

    root = sys.argv[1]
    model = torch.nn.Linear(4, 2)
    fastckpt.save_checkpoint(root, models={"m": (model, None)})
    held, release = threading.Event(), threading.Event()

    def committing():  # a writer thread inside a commit at the moment of the fork
        with commit._COMMITTED_LOCK:
            held.set()
            release.wait(60)

    thread = threading.Thread(target=committing)
    thread.start()
    held.wait()
    pid = os.fork()
    if pid == 0:
        fastckpt.save_checkpoint(root + "-child", models={"m": (model, None)})
        os._exit(0)
    deadline = time.monotonic() + 30
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            print("child exit", os.waitstatus_to_exitcode(status), flush=True)
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            print("child hung", flush=True)
            break
        time.sleep(0.05)
    release.set()
    thread.join()
    fastckpt.save_checkpoint(root, models={"m": (model, None)})
    print("parent indices", [c["index"] for c in fastckpt.list_checkpoints(root)], flush=True)
    """
)


def test_a_child_forked_inside_a_parent_threads_commit_saves(tmp_path: Path) -> None:
    root = tmp_path / "root"
    result = _run_script(tmp_path, FORK_DURING_COMMIT, root)
    assert "child exit 0" in result.stdout, result.stdout + result.stderr
    assert "parent indices [0, 1]" in result.stdout, result.stdout + result.stderr
    assert [c["index"] for c in fastckpt.list_checkpoints(tmp_path / "root-child")] == [0]


SAVE_DURING_EXIT_HOOKS = textwrap.dedent(
    """
    import concurrent.futures.thread as pools
    import sys, threading, time
    from concurrent.futures import ThreadPoolExecutor
    import torch
    from fastckpt import CheckpointManager

    root = sys.argv[1]
    manager = CheckpointManager(CheckpointManager.Config.with_async_save())
    manager.save(f"{root}/early", {"w": torch.ones(4)}).result()

    def late() -> None:
        while not pools._shutdown:  # concurrent.futures' exit hook ran: exit hooks are running
            time.sleep(0.001)
        print("main alive while saving:", threading.main_thread().is_alive(), flush=True)
        try:
            manager.save(f"{root}/late", {"w": torch.zeros(4)})
        except RuntimeError as err:
            print("late save:", err, flush=True)

    threading.Thread(target=late).start()
    # A pool task still running at exit: concurrent.futures' exit hook joins it for a second,
    # with its "no more work" flag set and the main thread not yet stopped.
    ThreadPoolExecutor(1).submit(time.sleep, 1.0)
    """
)


def test_a_save_while_the_exit_hooks_run_says_why_it_cannot(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    result = _run_script(tmp_path, SAVE_DURING_EXIT_HOOKS, root)
    out = result.stdout + result.stderr
    if "main alive while saving: False" in result.stdout:
        pytest.skip(f"this Python stops the main thread before the exit hooks: {out}")
    assert "late save: cannot save" in result.stdout, out
    assert "the interpreter is exiting" in result.stdout, out
    assert not (root / "late").exists()
    assert (root / "early" / "commit.json").is_file()
