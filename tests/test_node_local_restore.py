"""Restoring a sharded (FSDP2) run from node-local fast tiers: each simulated node's fast root
holds only its own ranks' shards, the nodes together hold the index whole. Real 2- and 3-rank
gloo runs; rank 0 decides from what every node reports, each rank reads its own node's shards
and receives the ranges it needs of other nodes' files from the ranks holding them, verified."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

import fastckpt
from dcp_support import check_ok, launch


def _reports(results: list[tuple[int, str, str]]) -> list[dict[str, Any]]:
    return [json.loads(out.strip().splitlines()[-1]) for _, out, _ in results]


@pytest.fixture(scope="module")
def node_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-rank run that saved to node0/ and node1/ (one directory per simulated node) every
    2 steps (indices 1 and 2 kept) with durable/ as its durable tier, and wrote the gathered
    step-4 and step-6 states as references."""
    base = tmp_path_factory.mktemp("node-local-restore")
    check_ok(launch("strategy_node_train", base / "run", 2, ranks="sharded_ranks"))
    assert not (base / "node1" / "manifest.json").exists()
    durable = [c["index"] for c in fastckpt.list_checkpoints(base / "durable")]
    assert durable == [0, 1, 2], durable  # every save promoted before the next
    return base


def _copy(node_run: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "nodes"
    shutil.copytree(node_run, copy, ignore=shutil.ignore_patterns("rendezvous*", "*.rdzv*"))
    shutil.rmtree(copy / "durable")  # only the fast tiers are left: they must do
    return copy


@pytest.mark.parametrize("world", [2, 3])
def test_a_sharded_run_restores_from_node_local_fast_tiers_bitwise(
    node_run: Path, tmp_path: Path, world: int
) -> None:
    # The durable tier is gone; node 0 holds the index with rank 0's shards, node 1 rank 1's.
    # On 2 ranks each rank reads its own node's shards (and the few values DCP kept in one
    # rank's file from that rank); on 3 ranks the third node holds nothing and receives all of
    # its share from ranks 0 and 1. Bitwise with the state the run had at step 4.
    nodes = _copy(node_run, tmp_path)
    reports = _reports(
        launch("strategy_node_local_resume", nodes / "run", world, ranks="sharded_ranks")
    )
    for rank, report in enumerate(reports):
        assert "error" not in report, report
        assert report["restored_from"] == str(nodes / f"node{rank}"), report
        assert report["node_local"] and report["step"] == 4, report
    assert reports[0]["loaded_bad"] == [] and reports[0]["final_close"], reports[0]


def test_a_node_local_restore_falls_back_when_a_node_lost_its_shards(
    node_run: Path, tmp_path: Path
) -> None:
    # Node 1 was replaced (its fast root is empty) and the durable tier holds index 1: the
    # nodes together no longer hold index 1, so every rank restores the durable copy.
    nodes = _copy(node_run, tmp_path)
    shutil.copytree(node_run / "durable", nodes / "durable")
    shutil.rmtree(nodes / "node1")
    reports = _reports(
        launch("strategy_node_local_resume", nodes / "run", 2, ranks="sharded_ranks")
    )
    for report in reports:
        assert "error" not in report, report
        assert report["restored_from"] == str(nodes / "durable"), report
        assert not report["node_local"] and report["step"] == 4, report
    assert reports[0]["loaded_bad"] == [], reports[0]


def test_a_damaged_shard_received_from_another_node_is_a_checksum_mismatch(
    node_run: Path, tmp_path: Path
) -> None:
    # On 3 ranks rank 2 receives part of rank 1's shards from node 1: a flipped byte there is
    # refused on the receiving rank like a damaged file on its own disk, and nothing loads.
    nodes = _copy(node_run, tmp_path)
    (part,) = (nodes / "node1" / "sharded" / "1").iterdir()
    (shard,) = part.glob("*/rank-00001.safetensors")
    data = bytearray(shard.read_bytes())
    data[-8] ^= 0xFF
    shard.write_bytes(bytes(data))
    reports = _reports(
        launch("strategy_node_local_resume", nodes / "run", 3, ranks="sharded_ranks")
    )
    errors = [report.get("error", "") for report in reports]
    assert all("ChecksumMismatchError" in error for error in errors), errors
    assert any("rank-00001.safetensors" in error for error in errors), errors
    assert any("received from the node of rank 1" in error for error in errors), errors


def test_resume_or_start_resumes_a_node_local_run_on_every_rank(
    node_run: Path, tmp_path: Path
) -> None:
    # Rank 1's node root holds no manifest (only its shards): on its own it would start afresh
    # while rank 0 resumes. Rank 0 decides for both, and both resume the newest index (2, at
    # step 6) from the fast tiers.
    nodes = _copy(node_run, tmp_path)
    reports = _reports(
        launch("strategy_node_local_resume_or_start", nodes / "run", 2, ranks="sharded_ranks")
    )
    for rank, report in enumerate(reports):
        assert report["step"] == 6, report
        assert report["restored_from"] == [str(nodes / f"node{rank}"), 2, True], report
