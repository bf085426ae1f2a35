"""SIGKILL during promotions of sharded (FSDP2) strategy indices: each index brings its part
(every rank's shards, the part's record) before the index and the durable manifest. Fast roots
come from real 2-rank gloo runs: one root the ranks share, and node-local roots (one directory
per simulated node, rank 1's shards uploaded by its rank's share of the promotion)."""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
from pathlib import Path

import pytest

import fastckpt
from dcp_support import check_ok, launch
from fastckpt.container.promote import promote
from fastckpt.container.sharded.parts import committed_part
from fastckpt.container.sharded.promote import upload_rank_files
from fastckpt.format.records import Manifest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import crash_harness

#: Kills of a promoting process per layout (each checked); FASTCKPT_CRASH_KILLS_SCALE scales it.
KILLS = round(100 * float(os.environ.get("FASTCKPT_CRASH_KILLS_SCALE", "1")))


@pytest.fixture(scope="module")
def fast_roots(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``shared``: a root both ranks saved to (indices 1 and 2, keep_last=2); ``node0`` /
    ``node1``: the same run saved to one root per rank."""
    base = tmp_path_factory.mktemp("sharded-promote-crash")
    check_ok(launch("strategy_train", base / "shared", 2, ranks="sharded_ranks"))
    nodes = base / "nodes"
    nodes.mkdir()
    check_ok(launch("strategy_node_train", nodes / "run", 2, ranks="sharded_ranks"))
    roots = {"shared": base / "shared", "node0": nodes / "node0", "node1": nodes / "node1"}
    assert [c["index"] for c in fastckpt.list_checkpoints(roots["shared"])] == [1, 2]
    assert [c["index"] for c in fastckpt.list_checkpoints(roots["node0"])] == [1, 2]
    assert not (roots["node1"] / "manifest.json").exists()
    return roots


def _entry_files(root: Path, index: int) -> dict[str, tuple[int, int]]:
    files = Manifest.load(root).entries[index]["files"]
    return {name: (int(r["size"]), int(r["crc32c"])) for name, r in files.items()}


@pytest.mark.parametrize("layout", ["shared", "node-local"])
def test_sigkill_during_sharded_promotions_never_leaves_a_partial_index(
    fast_roots: dict[str, Path], tmp_path: Path, layout: str
) -> None:
    """A process promoting sharded indices is killed ``KILLS`` times at random moments. After
    every kill the durable root verifies (every committed index with its part: every rank's
    shard, the record the index names) and holds exactly the source's files; the next
    promotion finishes the job and leaves no part that no index names."""
    node_local = layout == "node-local"
    source = fast_roots["node0" if node_local else "shared"]
    durable = tmp_path / "durable"
    rng = random.Random(23)
    kills = inside = completed = 0
    uploaded: set[str] = set()
    # Promotions run to their end first (a first one and a replacement, the slower): the
    # kills then land anywhere in one, and some after its end.
    timing = tmp_path / "timing"
    if node_local:
        upload_rank_files(fast_roots["node1"], timing, 2, 1, set())
    span = 0.0
    for _ in range(2):
        process, conn = crash_harness.start(
            crash_harness.promote_part_and_report, str(source), str(timing), 2, node_local
        )
        assert conn.poll(60) and conn.recv() == "started"
        began = time.monotonic()
        assert conn.poll(60) and conn.recv() == "promoted"
        span = max(span, time.monotonic() - began)
        process.join(30)
    while kills < KILLS:
        index = 2 if node_local else rng.choice([1, 2])
        if node_local:  # rank 1's share (re-uploaded when a sweep removed it)
            upload_rank_files(fast_roots["node1"], durable, 2, 1, uploaded)
        ended = crash_harness.kill_after(
            crash_harness.promote_part_and_report,
            (str(source), str(durable), index, node_local),
            rng.uniform(0.0, 1.5 * span),
        )
        kills += ended.killed
        if ended.promoted:
            completed += 1
        elif ended.exitcode == -signal.SIGKILL:
            inside += 1
        else:
            pytest.fail(f"the child failed (exit code {ended.exitcode})")
        manifest = Manifest.load(durable)
        for committed in manifest.entries:
            assert _entry_files(durable, committed) == _entry_files(source, committed)
        if manifest.entries:
            report = fastckpt.verify(durable)
            assert report.ok, (kills, report)
    print(f"{layout}: {kills} kills, {inside} inside a promotion, {completed} completed")
    assert inside >= KILLS // 3 and completed >= 1, (inside, completed)
    if node_local:
        upload_rank_files(fast_roots["node1"], durable, 2, 1, uploaded)
    every = 2 if node_local else 1
    report = promote(source, durable, every=every, node_local=node_local, wait_s=60)
    manifest = Manifest.load(durable)
    assert manifest.latest == 2 and _entry_files(durable, 2) == _entry_files(source, 2), report
    assert fastckpt.verify(durable).ok
    # What killed promotions left is gone: each index directory under sharded/ holds exactly
    # the part its committed index names.
    for name in os.listdir(durable / "sharded"):
        part = committed_part(manifest, int(name)) if int(name) in manifest.entries else None
        assert part is not None, name
        assert os.listdir(durable / "sharded" / name) == [part.name]


def test_node_local_checkpoint_dirs_without_a_durable_tier_are_refused_on_every_rank(
    tmp_path: Path,
) -> None:
    # Each rank's checkpoint_dir its own (node-local) directory and nothing to promote to: the
    # first save cannot ever be restored, and every rank says so instead of training on.
    outputs = check_ok(
        launch("strategy_node_train", tmp_path / "run", 2, "refused", ranks="sharded_ranks")
    )
    errors = [json.loads(out.strip().splitlines()[-1])["error"] for out in outputs]
    assert all("not one directory the ranks share" in error for error in errors), errors
    assert all("durable_dir" in error for error in errors), errors
    # Refused at the commit: nothing was committed on either node.
    assert fastckpt.list_checkpoints(tmp_path / "node0") == []
    assert not (tmp_path / "node1" / "manifest.json").exists()


def test_a_direct_save_to_node_local_directories_is_refused_unless_asked_for(
    tmp_path: Path,
) -> None:
    # TrainingStrategy.save_checkpoint on each node's own disk: rank 0 does not see rank 1's
    # shards, so the commit is refused on every rank (nothing committed, instead of an index
    # no process could restore); node_local=True (a caller promoting every rank's shards, as
    # the hook does) commits it.
    outputs = check_ok(
        launch("strategy_node_direct_save", tmp_path / "run", 2, ranks="sharded_ranks")
    )
    results = [json.loads(out.strip().splitlines()[-1]) for out in outputs]
    for result in results:
        assert "not one directory the ranks share" in result["error"], result
        assert result["index"] == 0, result
    assert [c["index"] for c in fastckpt.list_checkpoints(tmp_path / "node0")] == [0]
