"""A prune SIGKILLed at every one of its steps never costs a committed index its bytes.

Incremental indices hold their unchanged tensors' files as hard links to the index their
process saved first; roots written by earlier versions reference that index's files instead,
and pruning it keeps them as ``ROOT/.ref-<index>``. Both layouts are pruned here. The child
(``crash_harness.prune_at_kill_point``, a real process) makes four incremental saves, then
prunes to two indices with every filesystem mutation counted (links, renames, unlinks,
rmdirs, mkdirs, directory fsyncs, the manifest write) and SIGKILLs itself right before
mutation ``k``, for every ``k`` the prune makes. After each kill: every committed index
verifies and loads bitwise; then a save in another process (the next writer, which cleans up
what the prune left) and a prune; again every committed index verifies and the latest loads
bitwise.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from fastckpt import create_model_spec, load_checkpoint, prune, save_checkpoint
from fastckpt.container.verify import verify
from fastckpt.format.records import Manifest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import crash_harness

REFERENCE = crash_harness.Reference(frozen=crash_harness.PRUNE_FROZEN)


def _run_child(root: Path, kill_at: int, legacy: bool) -> tuple[int | None, Any]:
    """Run the child; returns ``(exit code, what it sent or None)``."""
    process, conn = crash_harness.start(
        crash_harness.prune_at_kill_point, str(root), kill_at, legacy
    )
    sent = None
    if conn.poll(120):
        try:
            sent = conn.recv()
        except EOFError:  # killed (or failed) before it sent anything
            sent = None
    process.join(120)
    conn.close()
    return process.exitcode, sent


def _assert_committed_indices_intact(root: Path, where: str) -> int:
    """Every committed index verifies and loads bitwise as the iteration it holds; returns
    the latest index."""
    report = verify(root)
    assert report.ok, f"{where}: {report.summary()}"
    manifest = Manifest.load(root)
    for index in sorted(manifest.entries):
        loaded = load_checkpoint(root, index)["models"]["main"]
        n = crash_harness.encoded(loaded["model"])
        assert n == index, f"{where}: index {index} holds iteration {n}"
        expected_model, expected_optimizer = REFERENCE.state(n)
        found = crash_harness.difference(expected_model, dict(loaded["model"].state_dict()))
        assert found is None, f"{where}: index {index} model: {found}"
        optimizer = loaded["optimizers"]["adam"]["optimizer"].state_dict()
        found = crash_harness.difference(expected_optimizer, optimizer)
        assert found is None, f"{where}: index {index} optimizer: {found}"
    assert manifest.latest is not None
    return manifest.latest


def _next_save(root: Path, latest: int) -> None:
    """What the next writer does: resume from the latest index, train one iteration, save
    (the save removes what the killed prune left), prune."""
    loaded = load_checkpoint(root)["models"]["main"]
    model, optimizer = loaded["model"], loaded["optimizers"]["adam"]["optimizer"]
    crash_harness.advance(model, optimizer, latest + 1)
    spec = create_model_spec(
        crash_harness.CrashNet,
        width=crash_harness.WIDTH,
        hidden=crash_harness.HIDDEN,
        frozen=crash_harness.PRUNE_FROZEN,
    )
    index = save_checkpoint(
        root,
        models={"main": (model, spec)},
        optimizers={"adam": (optimizer, None)},
        counters={"n": latest + 1},
    )
    assert index == latest + 1


@pytest.mark.parametrize("legacy", [False, True], ids=["self-contained", "legacy-refs"])
def test_a_prune_sigkilled_at_each_of_its_steps_keeps_every_committed_index(
    tmp_path: Path, legacy: bool
) -> None:
    torch.set_num_threads(1)
    code, mutations = _run_child(tmp_path / "dry", 0, legacy)
    assert code == 0 and isinstance(mutations, int) and mutations > 5, (code, mutations)
    assert sorted(Manifest.load(tmp_path / "dry").entries) == [2, 3]
    # Only an index written by an earlier version needs its pruned base's bytes retained.
    assert (tmp_path / "dry" / ".ref-0").is_dir() is legacy
    for kill_at in range(1, mutations + 1):
        root = tmp_path / f"kill{kill_at}"
        code, _ = _run_child(root, kill_at, legacy)
        assert code == -signal.SIGKILL, f"kill point {kill_at}: exit {code}"
        where = f"kill point {kill_at} of {mutations}"
        latest = _assert_committed_indices_intact(root, f"{where}, after the kill")
        assert latest == 3
        _next_save(root, latest)
        _assert_committed_indices_intact(root, f"{where}, after the next save")
        left = [
            name
            for name in os.listdir(root)
            if name.startswith((".tmp-", ".trash-", ".manifest"))
            or (name.isdigit() and int(name) not in Manifest.load(root).entries)
        ]
        assert not left, f"{where}: the next save left {left}"
        prune(root, keep_last=1)
        assert _assert_committed_indices_intact(root, f"{where}, after a prune") == 4
