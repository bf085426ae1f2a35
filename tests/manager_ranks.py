"""Rank scripts of ``test_manager_ranks.py``: ``CheckpointManager`` under a real gloo process
group, run by ``dcp_support.launch(..., ranks="manager_ranks")`` as ``python -c "import
manager_ranks; manager_ranks.NAME()" ROOT RANK RENDEZVOUS WORLD [ARGS...]``. Each prints one
JSON report on its last stdout line."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import fastckpt
from dcp_support import setup_rank
from fastckpt.container.background import committed_before
from training_support import leave_process_group

CM = fastckpt.CheckpointManager

#: the manager's collective timeout in these scripts (a rank that never joins fails the save
#: after this long, not after the default 600 s)
BARRIER_TIMEOUT_SECS = 4.0


def replicated_state(value: float) -> dict[str, Any]:
    """State every rank holds alike (as DDP's), saved as ``value`` everywhere."""
    return {"model": {"w": torch.full((1000,), value)}, "step": int(value)}


def config(kind: str = "sync", *, collective: bool = True) -> Any:
    """A manager config (``kind``: "sync" or "async") with a short barrier timeout."""
    built = CM.Config.with_sync_save() if kind == "sync" else CM.Config.with_async_save()
    built.save.writer_config.checkpoint_write_barrier_timeout_sec = BARRIER_TIMEOUT_SECS
    if not collective:
        built.collective = False
    return built


def _first(manager: Any, checkpoint: Path) -> float:
    """The first weight of ``checkpoint`` as ``manager`` loads it."""
    return float(manager.load(checkpoint)["model"]["w"][0])


def _save(manager: Any, checkpoint: Path, value: float) -> None:
    """Save :func:`replicated_state` ``value``, waiting for an async save's Future."""
    future = manager.save(checkpoint, replicated_state(value))
    if future is not None:
        future.result()


def _failure(err: BaseException) -> dict[str, Any]:
    return {
        "type": type(err).__name__,
        "message": str(err),
        "cause": type(err.__cause__).__name__ if err.__cause__ else None,
        "marked_committed": committed_before(err),
    }


def rank_zero_alone() -> None:
    """Rank 0 alone (rank 1 waits at a barrier of the default group, as a DDP job's next step
    would): builds a (collective) manager, saves with one built with ``collective=False``,
    loads with the first, then saves with the first, whose collective rank 1 never joins.
    Afterwards both ranks load the checkpoint with collective managers, and save DTensor
    state with managers built with ``collective=False``."""
    root, rank, _ = setup_rank()
    checkpoint = root / "c"
    report: dict[str, Any] = {}
    if rank == 0:
        start = time.monotonic()
        manager = CM(config())
        report["built_s"] = time.monotonic() - start
        with CM(config(collective=False)) as alone:
            _save(alone, checkpoint, 1.0)
        report["loaded"] = _first(manager, checkpoint)
        start = time.monotonic()
        try:
            _save(manager, checkpoint, 2.0)
            report["error"] = None
        except BaseException as err:
            report["error"] = _failure(err)
        report["failed_after_s"] = time.monotonic() - start
        report["after"] = _first(manager, checkpoint)
        report["left"] = sorted(p.name for p in root.iterdir() if p.name.startswith(".tmp-"))
        manager.close()
    dist.barrier()
    with CM(config()) as manager:
        report["both_load"] = _first(manager, checkpoint)
    # DTensor state is every rank's together: a manager of one rank refuses it.
    mesh = init_device_mesh("cpu", (2,))
    sharded = {"w": distribute_tensor(torch.arange(4.0), mesh, [Shard(0)])}
    with CM(config(collective=False)) as alone:
        try:
            alone.save(root / f"sharded{rank}", sharded)
            report["dtensor"] = None
        except ValueError as err:
            report["dtensor"] = str(err)
    print(json.dumps(report))
    leave_process_group()


def rank_zero_alone_after_a_joint_save() -> None:
    """Both ranks save one checkpoint (the manager's group is made), then rank 0 alone saves
    again with the same manager (argv: "sync" or "async"): its collective waits for rank 1,
    which waits at a barrier of the default group."""
    root, rank, _ = setup_rank()
    kind = sys.argv[5]
    checkpoint = root / "c"
    report: dict[str, Any] = {}
    with CM(config(kind)) as manager:
        _save(manager, checkpoint, 1.0)
        dist.barrier()
        if rank == 0:
            try:
                _save(manager, checkpoint, 2.0)
                report["error"] = None
            except BaseException as err:
                report["error"] = _failure(err)
            report["after"] = _first(manager, checkpoint)
            report["left"] = sorted(p.name for p in root.iterdir() if p.name.startswith(".tmp-"))
        dist.barrier()
    print(json.dumps(report))
    leave_process_group()


def _kill_when_committed(checkpoint: Path) -> None:
    """SIGKILL this process the moment a new ``commit.json`` appears in ``checkpoint`` (rank
    0's commit of the save under way), from a watcher thread."""
    before = os.stat(checkpoint / "commit.json").st_ino

    def watch() -> None:
        while True:
            try:
                if os.stat(checkpoint / "commit.json").st_ino != before:
                    os.kill(os.getpid(), signal.SIGKILL)
            except FileNotFoundError:
                pass

    threading.Thread(target=watch, daemon=True).start()


def peer_killed() -> None:
    """Both ranks save ``c`` (value 1), then save it again (value 2) while rank ``victim``
    is SIGKILLed ``when`` ("before_gather": once its files are written, from its
    pre-finalize callback; "after_commit": the moment rank 0's new record is visible). argv:
    victim, when, "sync" or "async", and "same" to save value 1 again (files byte-identical
    to the committed ones). The survivor reports how its save ended."""
    root, rank, _ = setup_rank()
    victim, when, kind = int(sys.argv[5]), sys.argv[6], sys.argv[7]
    again = 1.0 if sys.argv[8:] == ["same"] else 2.0
    checkpoint = root / "c"
    built = config(kind)
    if rank == victim and when == "before_gather":
        saves: list[Any] = []

        def die(args: Any) -> None:
            saves.append(args)
            if len(saves) == 2:  # the second save's files are written
                os.kill(os.getpid(), signal.SIGKILL)

        built.pre_finalize_callback = die
    manager = CM(built)
    _save(manager, checkpoint, 1.0)
    dist.barrier()
    if rank == victim and when == "after_commit":
        _kill_when_committed(checkpoint)
    report: dict[str, Any] = {}
    try:
        _save(manager, checkpoint, again)
        report["error"] = None
    except BaseException as err:
        report["error"] = _failure(err)
    print(json.dumps(report))
    sys.stdout.flush()
    os._exit(0)  # the process group lost a rank: no orderly teardown


def _outcome(manager: Any, checkpoint: Path, value: float) -> Any:
    """Save :func:`replicated_state` ``value``: None, or how the save failed."""
    try:
        _save(manager, checkpoint, value)
    except BaseException as err:
        return _failure(err)
    return None


def one_rank_write_fails() -> None:
    """Both ranks save values 1 to 4 with one manager (argv: "sync" or "async", and "fixed":
    every save to ``c``, or "steps": to ``step_N``); rank 1's second save fails on its own
    (its pre_finalize_callback raises ENOSPC, as a full disk would). Each rank then loads
    the last checkpoint (its own files) and reports what each save did."""
    root, rank, _ = setup_rank()
    kind, ids = sys.argv[5], sys.argv[6]
    built = config(kind)
    calls: list[Any] = []

    def full_disk(args: Any) -> None:
        calls.append(args)
        if rank == 1 and len(calls) == 2:
            raise OSError(28, "No space left on device (simulated)")

    built.pre_finalize_callback = full_disk
    report: dict[str, Any] = {"saves": []}
    with CM(built) as manager:
        for value in (1.0, 2.0, 3.0, 4.0):
            checkpoint = root / ("c" if ids == "fixed" else f"step_{int(value)}")
            report["saves"].append(_outcome(manager, checkpoint, value))
        report["last"] = _first(manager, checkpoint)
    # Every rank is done: rank 1 removes its emptied staging folder after rank 0's commit.
    dist.barrier()
    report["committed"] = sorted(p.name for p in root.iterdir() if (p / "commit.json").exists())
    report["left"] = sorted(p.name for p in root.iterdir() if p.name.startswith(".tmp-"))
    print(json.dumps(report))
    leave_process_group()


def _wait_for(flag: Path) -> None:
    """Wait (at most 60 s) until another rank writes ``flag``."""
    deadline = time.monotonic() + 60
    while not flag.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def saves_after_a_failed_collective() -> None:
    """Both ranks save ``c`` (value 1); rank 0 alone saves again (value 2: its collective
    times out, rank 1 never joins); then both save with the same manager (value 3), and
    then with a new manager each (value 4). argv: "sync" or "async"."""
    root, rank, _ = setup_rank()
    kind = sys.argv[5]
    checkpoint = root / "c"
    report: dict[str, Any] = {}
    manager = CM(config(kind))
    _save(manager, checkpoint, 1.0)
    dist.barrier()
    if rank == 0:
        report["alone"] = _outcome(manager, checkpoint, 2.0)
        (root / "alone-done").write_text("")
    else:
        _wait_for(root / "alone-done")
    start = time.monotonic()
    report["same_manager"] = _outcome(manager, checkpoint, 3.0)
    report["same_manager_s"] = time.monotonic() - start
    report["after_same"] = _first(manager, checkpoint)
    with contextlib.suppress(BaseException):
        manager.close()
    with CM(config(kind)) as fresh:
        report["new_manager"] = _outcome(fresh, checkpoint, 4.0)
        report["after_new"] = _first(fresh, checkpoint)
    dist.barrier()  # every rank is done (see one_rank_write_fails)
    report["left"] = sorted(p.name for p in root.iterdir() if p.name.startswith(".tmp-"))
    print(json.dumps(report))
    sys.stdout.flush()
    os._exit(0)  # the first manager's group failed: no orderly teardown


def sharded_load_alone() -> None:
    """Both ranks save a sharded (DTensor) checkpoint; then rank 0 alone loads it with a
    manager built with ``collective=False`` while rank 1 waits for a file (no collective)."""
    root, rank, _ = setup_rank()
    mesh = init_device_mesh("cpu", (2,))
    with CM(config()) as manager:
        manager.save(
            root / "s", {"model": {"w": distribute_tensor(torch.arange(8.0), mesh, [Shard(0)])}}
        )
    dist.barrier()
    report: dict[str, Any] = {}
    if rank == 0:
        start = time.monotonic()
        with CM(config(collective=False)) as alone:
            try:
                alone.load(root / "s")
                report["error"] = None
            except BaseException as err:
                report["error"] = _failure(err)
        report["secs"] = time.monotonic() - start
        (root / "done").write_text("")
    else:
        _wait_for(root / "done")
    print(json.dumps(report))
    sys.stdout.flush()
    os._exit(0)
