"""Sharded (FSDP2/TP) checkpoints on ``s3://``: ``fastckpt.dcp.Writer``/``Reader`` through
``dcp.save``, ``dcp.async_save`` and ``CheckpointManager``, 2 gloo ranks saving to a real S3
server (moto, in its own process), loaded bitwise on 1 and 3 ranks (resharded); a flipped
byte in an object is a ``ChecksumMismatchError``; a save SIGKILLed on every rank mid-upload
leaves the previous checkpoint loadable and its leftovers are removed by the next save; no
object holds a pickle."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch

import fastckpt
import fastckpt.dcp
from dcp_support import check_ok, launch, spawn
from fastckpt.container.commit import prune_indices
from fastckpt.container.promote import promote, promote_index
from fastckpt.container.sharded.commit import RECORD_NAME
from fastckpt.container.sharded.promote import upload_rank_files
from fastckpt.container.verify import CheckpointSkippedWarning
from fastckpt.errors import CheckpointFormatError, ChecksumMismatchError
from fastckpt.format.records import Manifest
from fastckpt.storage.s3.config import S3Url
from fastckpt.storage.s3.errors import AccessDeniedError
from s3_support import S3Server, no_aws_env, s3_env, s3_root, s3_server

__all__ = ["no_aws_env", "s3_env", "s3_root", "s3_server"]  # fixtures used by name below

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def env(s3_server: S3Server) -> Iterator[dict[str, str]]:
    """The server reached through the AWS variables (inherited by every rank)."""
    values = {
        "AWS_ENDPOINT_URL": s3_server.endpoint,
        "AWS_REGION": "us-east-1",
        "AWS_ACCESS_KEY_ID": s3_server.access_key_id,
        "AWS_SECRET_ACCESS_KEY": s3_server.secret_access_key,
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    yield values
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="module")
def saved(
    s3_server: S3Server, env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, str]:
    """URL/sync, URL/async and URL/manager from a 2-rank FSDP2 run (see s3_dcp_ranks.save);
    the local scratch directory holds the reference states."""
    local = tmp_path_factory.mktemp("sharded-s3")
    url = s3_server.url(f"sharded-{os.getpid()}-{time.time_ns()}")
    check_ok(launch("save", local, 2, url, ranks="s3_dcp_ranks"))
    return local, url


def _keys(s3_server: S3Server, url: str) -> list[str]:
    prefix = url.split("/", 3)[3]
    client = s3_server.client()
    pages = client.get_paginator("list_objects_v2").paginate(
        Bucket=s3_server.bucket, Prefix=f"{prefix}/"
    )
    return sorted(item["Key"] for page in pages for item in page.get("Contents", []))


@pytest.mark.parametrize("world", [1, 3])
def test_a_two_rank_save_to_s3_loads_bitwise_resharded(
    s3_server: S3Server, saved: tuple[Path, str], world: int
) -> None:
    local, url = saved
    outputs = check_ok(launch("load", local, world, url, ranks="s3_dcp_ranks"))
    report: dict[str, Any] = json.loads(outputs[0])
    for name, step, blob in (("sync", 2, "\x00raw\xff"), ("async", 3, "three")):
        assert report[name]["bad"] == [], (name, report[name])
        assert report[name]["n"] > 10 and report[name]["tp_ok"], (name, report[name])
        assert (report[name]["step"], report[name]["blob"]) == (step, blob), name
    assert report["manager"]["bad"] == [] and report["manager"]["step"] == 3
    if world == 3:
        # Rank 0 fetched only the byte ranges of its own shards (rounded out to blocks).
        prefix = url.split("/", 3)[3]
        listing = s3_server.client().list_objects_v2(
            Bucket=s3_server.bucket, Prefix=f"{prefix}/sync/"
        )
        sizes = [o["Size"] for o in listing["Contents"] if o["Key"].endswith(".safetensors")]
        assert 0 < report["sync_bytes_read"] < sum(sizes) / 2, (report, sizes)


def test_every_rank_uploaded_its_own_objects_and_none_holds_a_pickle(
    s3_server: S3Server, saved: tuple[Path, str]
) -> None:
    _, url = saved
    keys = _keys(s3_server, url)
    for name in ("sync", "async", "manager"):
        ours = [k for k in keys if f"/{name}/" in k]
        assert any(k.endswith(f"/{name}/{RECORD_NAME}") for k in ours), ours
        assert {k.rsplit("/", 1)[1] for k in ours if k.endswith(".safetensors")} == {
            "rank-00000.safetensors",
            "rank-00001.safetensors",
        }, ours
    client = s3_server.client()
    for key in keys:
        body = client.get_object(Bucket=s3_server.bucket, Key=key)["Body"].read()
        assert not body.startswith(b"\x80"), f"{key} starts like a pickle"
        assert b"torch._utils" not in body and b"cpickle" not in body.lower(), key


def test_the_cli_verifies_and_inspects_sharded_checkpoints_on_s3(
    s3_server: S3Server, env: dict[str, str], saved: tuple[Path, str], tmp_path: Path
) -> None:
    """``fastckpt verify`` and ``inspect`` take a sharded checkpoint on ``s3://`` as they take
    one on disk, and a prefix of them as a directory of checkpoints (verify: each one; ls:
    all of them). Before, locating an object-store path knew no sharded record: both failed
    with "not a fastckpt checkpoint"."""
    _, url = saved

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-W", "ignore", "-m", "fastckpt", *args],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
        )

    checked = cli("verify", f"{url}/sync")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    shown = cli("inspect", f"{url}/sync")
    assert shown.returncode == 0 and "sharded checkpoint" in shown.stdout, shown.stderr
    every = cli("verify", url)
    assert every.returncode == 0, every.stdout + every.stderr
    for name in ("sync", "async", "manager"):
        assert f"{url}/{name}" in every.stdout, every.stdout
    listed = cli("ls", "--json", url)
    assert listed.returncode == 0, listed.stderr
    rows = json.loads(listed.stdout)["checkpoints"]
    assert sorted(row["name"] for row in rows) == ["async", "manager", "sync"]


def test_a_flipped_byte_in_a_sharded_object_is_a_checksum_mismatch(
    s3_server: S3Server, env: dict[str, str], tmp_path: Path
) -> None:
    url = s3_server.url(f"flip-{os.getpid()}-{time.time_ns()}")
    state = {"w": torch.randn(64, 33), "b": torch.arange(9.0)}
    fastckpt.dcp.save_state(f"{url}/c", state)
    (key,) = [k for k in _keys(s3_server, url) if k.endswith(".safetensors")]
    client = s3_server.client()
    data = bytearray(client.get_object(Bucket=s3_server.bucket, Key=key)["Body"].read())
    data[-5] ^= 0x01
    client.put_object(Bucket=s3_server.bucket, Key=key, Body=bytes(data))
    templates = {"w": torch.zeros(64, 33), "b": torch.full((9,), 7.0)}
    with pytest.raises(fastckpt.ChecksumMismatchError, match=r"rank-00000\.safetensors") as info:
        fastckpt.dcp.load_state(f"{url}/c", into=templates)
    assert torch.equal(templates["b"], torch.full((9,), 7.0))  # nothing filled
    assert str(info.value).startswith(f"{url}/c/")  # the URL as written (not s3:/bucket)


def test_a_save_killed_on_every_rank_mid_upload_leaves_the_previous_checkpoint(
    s3_server: S3Server, saved: tuple[Path, str], tmp_path: Path
) -> None:
    local, url = saved
    before = [k for k in _keys(s3_server, url) if "/sync/" in k]
    mark = tmp_path / "uploading"
    os.environ["FASTCKPT_TEST_MARK"] = str(mark)
    try:
        procs = spawn("save_and_hang", tmp_path / "ranks", 2, url, ranks="s3_dcp_ranks")
    finally:
        del os.environ["FASTCKPT_TEST_MARK"]
    client = s3_server.client()
    prefix = url.split("/", 3)[3]

    def pending() -> list[str]:
        uploads = client.list_multipart_uploads(Bucket=s3_server.bucket, Prefix=f"{prefix}/sync/")
        return [upload["Key"] for upload in uploads.get("Uploads", [])]

    try:
        deadline = time.monotonic() + 180
        while not (all(Path(f"{mark}.{r}").exists() for r in range(2)) and len(pending()) >= 2):
            assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
            assert time.monotonic() < deadline, "the ranks never got inside their uploads"
            time.sleep(0.05)
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGKILL)
            proc.communicate()
    killed = pending()
    assert {key.rsplit("/", 1)[1] for key in killed} >= {
        "rank-00000.safetensors",
        "rank-00001.safetensors",
    }, killed
    after = [k for k in _keys(s3_server, url) if "/sync/" in k]
    assert after == before  # the record and the objects it names, untouched
    # The previous checkpoint loads whole on one process.
    expected = safetensors.torch.load_file(local / "reference-sync.st")
    loaded = fastckpt.dcp.load_state(f"{url}/sync")
    assert torch.equal(loaded["model"]["0.weight"], expected["model.0.weight"])
    # The next save to the same id removes the killed ranks' unfinished uploads with every
    # other generation.
    fastckpt.dcp.save_state(f"{url}/sync", {"x": torch.ones(3)})
    assert pending() == [], killed
    generations = {k.split("/")[-2] for k in _keys(s3_server, url) if "/sync/g" in k}
    assert len(generations) == 1, generations


def test_a_rank_file_the_store_lost_before_the_commit_fails_the_save_and_keeps_the_last(
    s3_server: S3Server, env: dict[str, str], tmp_path: Path
) -> None:
    """Before, the coordinator checked only its own files on an object store, trusting the
    other ranks' results: a rank's object the store acknowledged and then did not hold was
    committed, both ranks reported success, and the previous generation was deleted after
    the commit (the id loaded nothing). Now every file is looked up before the commit."""
    url = s3_server.url(f"lost-{uuid.uuid4().hex[:8]}")
    outputs = check_ok(launch("save_losing_a_rank_file", tmp_path, 2, url, ranks="s3_dcp_ranks"))
    reports = [json.loads(out.strip().splitlines()[-1]) for out in outputs]
    for report in reports:  # DCP hands the coordinator's error to every rank
        assert "rank-00001.safetensors: missing at commit time" in report["outcome"], report
        assert report["loaded"] == 1.0, report  # the previous checkpoint, whole


@pytest.fixture(scope="module")
def trained(
    s3_server: S3Server, env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, str]:
    """URL/run: a 2-rank FSDP2 TrainingStrategy whose async CheckpointHook saved every 2
    steps (keep_last=2), see s3_dcp_ranks.strategy_train."""
    local = tmp_path_factory.mktemp("strategy-s3")
    url = s3_server.url(f"strategy-{os.getpid()}-{time.time_ns()}")
    outputs = check_ok(launch("strategy_train", local, 2, url, ranks="s3_dcp_ranks"))
    reports = [json.loads(out.strip().splitlines()[-1]) for out in outputs]
    assert reports[0]["losses"] == reports[1]["losses"]
    assert [r["last"] for r in reports] == [2, 2]
    return local, url


def test_a_strategy_hook_saves_fsdp2_state_to_s3_and_prunes_its_parts(
    s3_server: S3Server, trained: tuple[Path, str]
) -> None:
    _, url = trained
    assert [c["index"] for c in fastckpt.list_checkpoints(f"{url}/run")] == [1, 2]
    keys = _keys(s3_server, f"{url}/run")
    # keep_last=2 removed index 0 and its sharded part; each kept index names one part,
    # into which both ranks uploaded their shards.
    assert sorted({k.split("/sharded/")[1].split("/")[0] for k in keys if "/sharded/" in k}) == [
        "1",
        "2",
    ], keys
    for index in ("1", "2"):
        ours = [k for k in keys if f"/sharded/{index}/" in k]
        assert len({k.split(f"/sharded/{index}/")[1].split("/")[0] for k in ours}) == 1, ours
        assert len([k for k in ours if k.endswith(".safetensors")]) == 2, ours


def test_damaged_shards_on_s3_make_verify_prune_and_latest_intact_keep_the_intact_index(
    s3_server: S3Server, trained: tuple[Path, str]
) -> None:
    """Before, the shards of an ``s3://`` strategy root were never read by ``verify`` nor by
    what decides which index is intact: a flipped byte in index 2's shard left ``verify``
    saying ok, and ``prune(keep_last=1)`` deleted index 1, the only one that verified."""
    _, url = trained
    client, bucket = s3_server.client(), s3_server.bucket
    source, copy = S3Url.parse(f"{url}/run").prefix, S3Url.parse(f"{url}/damaged").prefix
    for key in _keys(s3_server, f"{url}/run"):
        client.copy_object(
            Bucket=bucket, Key=copy + key[len(source) :], CopySource={"Bucket": bucket, "Key": key}
        )
    (shard,) = [
        k
        for k in _keys(s3_server, f"{url}/damaged")
        if "/sharded/2/" in k and k.endswith("rank-00001.safetensors")
    ]
    data = bytearray(client.get_object(Bucket=bucket, Key=shard)["Body"].read())
    data[-3] ^= 0x01
    client.put_object(Bucket=bucket, Key=shard, Body=bytes(data))
    report = fastckpt.verify(f"{url}/damaged")
    assert not report.ok and any("rank-00001" in str(f.path) for f in report.failures)
    with pytest.warns(CheckpointSkippedWarning, match="index 2"):
        assert fastckpt.latest_intact(f"{url}/damaged") == 1
    assert fastckpt.prune(f"{url}/damaged", keep_last=1) == []
    assert [c["index"] for c in fastckpt.list_checkpoints(f"{url}/damaged")] == [1, 2]


@pytest.mark.parametrize("world", [1, 3])
def test_a_strategy_saved_on_s3_resumes_resharded(trained: tuple[Path, str], world: int) -> None:
    local, url = trained
    outputs = check_ok(launch("strategy_resume", local, world, url, ranks="s3_dcp_ranks"))
    report = json.loads(outputs[0].strip().splitlines()[-1])
    assert report["sharded"] and report["step"] == 4
    assert report["loaded_bad"] == [] and report["final_close"], report


# --------------------------------------------------------------------------- tiers


@pytest.fixture(scope="module")
def tiered(
    s3_server: S3Server, env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, str]:
    """A 2-rank FSDP2 run whose hook saves to a local fast root and promotes every index to
    URL/tiers (see s3_dcp_ranks.strategy_tiers_train); the fast root is then deleted."""
    local = tmp_path_factory.mktemp("strategy-tiers")
    url = s3_server.url(f"tiers-{os.getpid()}-{time.time_ns()}")
    outputs = check_ok(launch("strategy_tiers_train", local, 2, url, ranks="s3_dcp_ranks"))
    reports = [json.loads(out.strip().splitlines()[-1]) for out in outputs]
    assert reports[0]["losses"] == reports[1]["losses"]
    assert all(report["healthy"] for report in reports)
    # Every checkpoint went to the fast root (keep_last=2; an index a promotion was copying
    # when a later save pruned is kept too) and was promoted, each index with its sharded
    # part: both ranks' files, the part's record, then the manifest.
    fast = [c["index"] for c in fastckpt.list_checkpoints(local / "fast")]
    assert fast[-2:] == [1, 2] and set(fast) <= {0, 1, 2}, fast
    assert [c["index"] for c in fastckpt.list_checkpoints(f"{url}/tiers")] == [1, 2]
    assert fastckpt.verify(f"{url}/tiers").ok
    shutil.copytree(local / "fast", local / "fast-copy")  # tests below delete LOCAL/fast
    prune_indices(local / "fast-copy", keep_last=2)  # [1, 2], whatever a promotion held
    return local, url


def test_a_promoted_sharded_index_holds_every_ranks_shards_and_no_other_part(
    s3_server: S3Server, tiered: tuple[Path, str]
) -> None:
    _, url = tiered
    keys = _keys(s3_server, f"{url}/tiers")
    assert sorted({k.split("/sharded/")[1].split("/")[0] for k in keys if "/sharded/" in k}) == [
        "1",
        "2",
    ], keys
    for index in ("1", "2"):
        ours = [k for k in keys if f"/sharded/{index}/" in k]
        assert len([k for k in ours if k.endswith(".safetensors")]) == 2, ours
        assert len([k for k in ours if k.endswith(RECORD_NAME)]) == 1, ours


def test_sharded_parts_no_index_names_on_s3_go_with_the_next_promotion_and_prune(
    s3_server: S3Server, tiered: tuple[Path, str]
) -> None:
    """A promotion whose source index the fast tier's retention pruned under it, or that was
    killed, leaves files of a part that no committed index names on the durable tier: the
    next promotion (its clean-up) and every prune remove them, as on a local root."""
    local, url = tiered
    target = f"{url}/swept"
    assert promote(local / "fast-copy", target, every=1).promoted == [1, 2]
    prefix = target.split("/", 3)[3]
    client = s3_server.client()

    def plant() -> None:  # rank 1's shard of a promotion of index 0 that never committed
        key = f"{prefix}/sharded/0/part-left/gen/rank-00001.safetensors"
        client.put_object(Bucket=s3_server.bucket, Key=key, Body=b"left behind")

    def sharded_indices() -> list[str]:
        keys = _keys(s3_server, target)
        return sorted({k.split("/sharded/")[1].split("/")[0] for k in keys if "/sharded/" in k})

    plant()
    assert sharded_indices() == ["0", "1", "2"]
    assert promote(local / "fast-copy", target, every=1).promoted == []  # nothing new
    assert sharded_indices() == ["1", "2"]
    plant()
    assert prune_indices(Path(target), keep_last=1) == [1]
    assert sharded_indices() == ["2"]  # index 1's part went with it, the leftover too
    assert fastckpt.verify(target).ok


@pytest.mark.parametrize("world", [1, 3])
def test_a_sharded_run_restores_resharded_from_the_durable_tier_when_the_fast_one_is_gone(
    tiered: tuple[Path, str], world: int
) -> None:
    local, url = tiered
    shutil.rmtree(local / "fast", ignore_errors=True)  # a new node
    outputs = check_ok(launch("strategy_tiers_resume", local, world, url, ranks="s3_dcp_ranks"))
    report = json.loads(outputs[0].strip().splitlines()[-1])
    assert report["sharded"] and report["step"] == 4
    assert report["restored_from"].endswith("/tiers"), report
    assert report["loaded_bad"] == [] and report["final_close"], report


def test_the_ranks_of_a_sharded_resume_take_the_copy_rank_0_picked(
    tiered: tuple[Path, str],
) -> None:
    # Rank 1 would find index 1 on its own (as if it looked before index 2 was promoted, by
    # a detached promoter say): a sharded load of two copies fails, so rank 0 picks for all.
    local, url = tiered
    shutil.rmtree(local / "fast", ignore_errors=True)
    outputs = check_ok(launch("strategy_tiers_agreed_resume", local, 2, url, ranks="s3_dcp_ranks"))
    reports = [json.loads(out.strip().splitlines()[-1]) for out in outputs]
    assert [(r["index"], r["step"]) for r in reports] == [(2, 6), (2, 6)], reports


# --------------------------------------------------------------------------- node-local tiers


@pytest.fixture(scope="module")
def node_tiered(
    s3_server: S3Server, env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, str]:
    """A 2-rank FSDP2 run whose ranks save to their own fast roots (LOCAL/node0, LOCAL/node1:
    one simulated node each) and promote to URL/node-tiers (see
    s3_dcp_ranks.strategy_node_tiers_train)."""
    local = tmp_path_factory.mktemp("node-tiers")
    url = s3_server.url(f"node-tiers-{os.getpid()}-{time.time_ns()}")
    outputs = check_ok(launch("strategy_node_tiers_train", local, 2, url, ranks="s3_dcp_ranks"))
    reports = [json.loads(out.strip().splitlines()[-1]) for out in outputs]
    assert reports[0]["losses"] == reports[1]["losses"]
    assert all(report["healthy"] for report in reports), reports
    # Rank 0 committed (Promoter), rank 1 uploaded its own shards of each index (RankPromoter).
    assert [r["promoter"] for r in reports] == ["Promoter", "RankPromoter"], reports
    assert all(r["promoted"] == [0, 1, 2] for r in reports), reports
    return local, url


def test_node_local_fast_tiers_are_promoted_rank_by_rank(
    s3_server: S3Server, node_tiered: tuple[Path, str]
) -> None:
    local, url = node_tiered
    durable = f"{url}/node-tiers"
    assert [c["index"] for c in fastckpt.list_checkpoints(durable)] == [1, 2]
    assert fastckpt.verify(durable).ok
    keys = _keys(s3_server, durable)
    for index in ("1", "2"):
        ours = [k for k in keys if f"/sharded/{index}/" in k]
        names = sorted(k.rsplit("/", 1)[1] for k in ours if k.endswith(".safetensors"))
        assert names == ["rank-00000.safetensors", "rank-00001.safetensors"], ours
        assert len([k for k in ours if k.endswith(RECORD_NAME)]) == 1, ours
    # Node 0 holds the indices (keep_last=2) with rank 0's shards; node 1 only rank 1's shards
    # of the same indices (its retention follows rank 0's), each part with its record copied.
    node0, node1 = local / "node0", local / "node1"
    assert [c["index"] for c in fastckpt.list_checkpoints(node0)] == [1, 2]
    assert not (node1 / "manifest.json").exists()
    assert sorted(p.name for p in (node1 / "sharded").iterdir()) == ["1", "2"]
    for index in ("1", "2"):
        (part,) = (node1 / "sharded" / index).iterdir()
        assert (part / RECORD_NAME).is_file()
        assert sorted(f.name for f in part.glob("*/*.safetensors")) == ["rank-00001.safetensors"]
        (part0,) = (node0 / "sharded" / index).iterdir()
        assert (part0 / RECORD_NAME).read_bytes() == (part / RECORD_NAME).read_bytes()
        assert sorted(f.name for f in part0.glob("*/*.safetensors")) == ["rank-00000.safetensors"]


@pytest.mark.parametrize("world", [1, 3])
def test_node_local_fast_tiers_restore_resharded_from_the_durable_tier(
    node_tiered: tuple[Path, str], world: int
) -> None:
    # Node 0's copy of index 1 lacks rank 1's shards: the restore says so and reshards the
    # durable copy onto WORLD ranks, bitwise.
    local, url = node_tiered
    outputs = check_ok(
        launch("strategy_node_tiers_resume", local, world, url, ranks="s3_dcp_ranks")
    )
    report = json.loads(outputs[0].strip().splitlines()[-1])
    assert report["sharded"] and report["step"] == 4
    assert report["restored_from"].endswith("/node-tiers"), report
    assert report["loaded_bad"] == [] and report["final_close"], report


def test_a_node_local_part_is_committed_only_once_every_rank_uploaded_its_shards(
    node_tiered: tuple[Path, str], tmp_path: Path
) -> None:
    local, _ = node_tiered
    node0, node1, durable = local / "node0", local / "node1", tmp_path / "durable"
    # Node 0 alone cannot promote index 2 as a whole: rank 1's shards are on node 1.
    with pytest.raises(CheckpointFormatError, match=r"rank-00001\.safetensors"):
        promote_index(node0, durable, 2)
    # As rank 0 of node-local tiers it uploads its own and waits for rank 1's: in vain here,
    # so nothing is committed.
    with pytest.raises(TimeoutError, match=r"rank\(s\) \[1\]"):
        promote_index(node0, durable, 2, node_local=True, wait_s=0.3)
    assert not (durable / "manifest.json").exists()
    # Rank 1 uploads its shards of every due index its node holds; then the commit goes through
    # and the durable copy verifies, every rank's file proven against the part's record.
    assert upload_rank_files(node1, durable, 2, 1, set()) == [2]
    promote_index(node0, durable, 2, node_local=True, wait_s=0.3)
    assert [c["index"] for c in fastckpt.list_checkpoints(durable)] == [2]
    assert fastckpt.verify(durable).ok
    (part,) = (durable / "sharded" / "2").iterdir()
    names = sorted(f.name for f in part.glob("*/*.safetensors"))
    assert names == ["rank-00000.safetensors", "rank-00001.safetensors"]
    # A damaged shard on node 1 is refused by its rank's upload, naming it.
    (part1,) = (node1 / "sharded" / "2").iterdir()
    (shard,) = part1.glob("*/rank-00001.safetensors")
    damaged = tmp_path / "node1"
    shutil.copytree(node1, damaged)
    target = damaged / shard.relative_to(node1)
    data = bytearray(target.read_bytes())
    data[-1] ^= 0xFF
    target.write_bytes(bytes(data))
    with pytest.raises(ChecksumMismatchError, match=r"rank-00001\.safetensors"):
        upload_rank_files(damaged, tmp_path / "other", 1, 1, set())


@pytest.mark.parametrize("promoter", ["thread", "detached"])
def test_a_node_local_run_restarts_from_its_fast_tiers_and_saves_on(
    s3_server: S3Server, env: dict[str, str], tmp_path: Path, promoter: str
) -> None:
    # The fast tiers are ahead of the durable one (index 2's promotion "did not happen"): the
    # restart resumes from index 2 on both ranks, spread over the two nodes' fast roots (each
    # rank names its own), no rank refuses the fast tier's indices as another run's (rank 0
    # decides for all), index 2 is promoted by the restart, and the run's own save (index 3)
    # after it; so too when every rank's share of each promotion runs in a detached process
    # (rank 0's commits, rank 1's uploads).
    url = s3_server.url(f"node-restart-{os.getpid()}-{time.time_ns()}")
    check_ok(launch("strategy_node_tiers_train", tmp_path, 2, url, ranks="s3_dcp_ranks"))
    durable = f"{url}/node-tiers"
    manifest = Manifest.load(durable)
    del manifest.entries[2]
    manifest.commit()
    assert [c["index"] for c in fastckpt.list_checkpoints(durable)] == [1]
    extra = ["detached"] if promoter == "detached" else []
    outputs = check_ok(
        launch("strategy_node_tiers_restart", tmp_path, 2, url, *extra, ranks="s3_dcp_ranks")
    )
    reports = [json.loads(out.strip().splitlines()[-1]) for out in outputs]
    for rank, report in enumerate(reports):
        assert report["restored"] == [f"node{rank}", 2] and report["start"] == 6, report
        assert report["step"] == 8 and report["healthy"], report
        assert report["detached"] == (promoter == "detached"), report
        assert 3 in report["promoted"], report
    assert {2, 3} <= set(reports[0]["promoted"]), reports  # rank 0 commits
    listed = fastckpt.list_checkpoints(durable)
    assert [c["index"] for c in listed] == [2, 3], listed
    assert fastckpt.verify(durable).ok


def test_a_node_local_run_restarted_on_new_nodes_saves_past_the_durable_tier(
    s3_server: S3Server, env: dict[str, str], tmp_path: Path
) -> None:
    # Both nodes are replaced (their fast roots gone): the restart resumes the durable
    # index 2 (step 6) on both ranks, and its save at step 8 goes to index 3, not to the
    # fresh fast roots' index 0 (which the durable tier, holding index 2, would never take);
    # index 3 is promoted rank by rank, and the durable tier holds 2 and 3.
    url = s3_server.url(f"node-new-{os.getpid()}-{time.time_ns()}")
    check_ok(launch("strategy_node_tiers_train", tmp_path, 2, url, ranks="s3_dcp_ranks"))
    durable = f"{url}/node-tiers"
    assert [c["index"] for c in fastckpt.list_checkpoints(durable)] == [1, 2]
    for rank in (0, 1):
        shutil.rmtree(tmp_path / f"node{rank}")
    outputs = check_ok(
        launch("strategy_node_tiers_restart", tmp_path, 2, url, ranks="s3_dcp_ranks")
    )
    reports = [json.loads(out.strip().splitlines()[-1]) for out in outputs]
    for report in reports:
        assert report["restored"] == ["node-tiers", 2] and report["start"] == 6, report
        assert report["step"] == 8 and report["healthy"], report
    assert 3 in reports[0]["promoted"], reports  # rank 0 commits
    assert [c["index"] for c in fastckpt.list_checkpoints(tmp_path / "node0")] == [3]
    assert [c["index"] for c in fastckpt.list_checkpoints(durable)] == [2, 3]
    assert fastckpt.verify(durable).ok


def test_node_local_promotion_takes_the_newest_due_index_only(
    node_tiered: tuple[Path, str], tmp_path: Path
) -> None:
    # Index 1's rank-1 shards never come (say node 1 was replaced): promoting node 0's
    # indices does not wait for them; the newest due index is promoted, the older skipped.
    local, _ = node_tiered
    durable = tmp_path / "durable"
    assert upload_rank_files(local / "node1", durable, 1, 1, set()) == [2]
    report = promote(local / "node0", durable, every=1, node_local=True, wait_s=0.3)
    assert report.promoted == [2] and report.skipped == [1], report
    assert fastckpt.verify(durable).ok


def test_fastckpt_promote_on_each_node_finishes_a_node_local_promotion(
    node_tiered: tuple[Path, str], tmp_path: Path
) -> None:
    # After a crash, `fastckpt promote` by hand: run on rank 0's node alone it waits for the
    # other node's shards and gives up (exit 2, naming rank 1); run on node 1 it uploads that
    # node's shards, and then on node 0 it commits the newest index.
    local, _ = node_tiered
    durable = tmp_path / "durable"

    def promote_cli(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "fastckpt", "promote", *args]
        return subprocess.run(command, capture_output=True, text=True, timeout=300)

    alone = promote_cli(str(local / "node0"), str(durable), "--wait", "0.5")
    assert alone.returncode == 2 and "rank(s) [1]" in alone.stderr, alone.stderr
    assert not (durable / "manifest.json").exists()
    node1 = promote_cli(str(local / "node1"), str(durable), "--json")
    assert node1.returncode == 0, node1.stderr
    assert json.loads(node1.stdout)["uploaded"] == [2]
    node0 = promote_cli(str(local / "node0"), str(durable), "--json", "--wait", "30")
    assert node0.returncode == 0, node0.stderr
    assert json.loads(node0.stdout)["promoted"] == [2]
    assert fastckpt.verify(durable).ok


def test_a_sharded_writer_or_reader_without_credentials_fails_when_made(
    no_aws_env: None, s3_root: str
) -> None:
    """No credentials anywhere: making the writer (or reader) is the typed error naming the
    URL and the fix, before any training step or save."""
    with pytest.raises(AccessDeniedError, match=f"{s3_root}.*no AWS credentials"):
        fastckpt.dcp.Writer(f"{s3_root}/ckpt")
    with pytest.raises(AccessDeniedError, match=f"{s3_root}.*no AWS credentials"):
        fastckpt.dcp.Reader(f"{s3_root}/ckpt")


def test_the_first_sharded_save_and_load_set_up_no_client(
    s3_env: dict[str, str], s3_root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store's clients are built with the writer and the reader, so the first save and
    load stall no longer than later ones: with client construction made to fail after that,
    a save (commit and clean-up included) and a load still succeed, bitwise."""
    import boto3.session
    import obstore.store
    import torch.distributed.checkpoint as dcp

    url = f"{s3_root}/first"
    writer = fastckpt.dcp.Writer(url)
    reader = fastckpt.dcp.Reader(url)

    def no_new_client(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a client was built during the save or load")

    monkeypatch.setattr(boto3.session, "Session", no_new_client)
    monkeypatch.setattr(obstore.store, "S3Store", no_new_client)
    state = {"w": torch.arange(4096, dtype=torch.float32), "step": 7}
    dcp.save(state, storage_writer=writer)
    loaded = {"w": torch.zeros(4096), "step": 0}
    dcp.load(loaded, storage_reader=reader)
    assert torch.equal(loaded["w"], state["w"]) and loaded["step"] == 7


@pytest.mark.parametrize("where", ["s3", "local"])
def test_the_clean_up_before_replacing_an_older_index_keeps_its_uploaded_shards(
    where: str, s3_server: S3Server, s3_env: dict[str, str], s3_root: str, tmp_path: Path
) -> None:
    """A sharded save with ``checkpoint_index=2`` into a root holding 0, 3 and 5 uploads its
    shards to ``sharded/2/<part>`` before the index writer's clean-up runs: that clean-up
    (``clean_leftovers(writing=2)``) sweeps uncommitted older indices, but never the one being
    written, on S3 as on a local root. Before, on S3 it deleted the part, and index 2 was
    committed naming shards that no longer existed."""
    from fastckpt.container.commit import clean_leftovers
    from fastckpt.container.sharded.parts import new_part

    root = Path(s3_root) if where == "s3" else tmp_path / "root"
    for index in (0, 3, 5):
        fastckpt.save_checkpoint(root, {"m": (torch.nn.Linear(2, 2), None)}, checkpoint_index=index)
    shard = f"sharded/2/{new_part()}/g0000000000000-00000000/rank-00000.safetensors"
    stale = "sharded/1/p0000000000001-00000000.1.gone/g0000000000000-00000000/x.safetensors"
    if where == "s3":
        client, prefix = s3_server.client(), s3_root.split("/", 3)[3]
        for key in (shard, stale):
            client.put_object(Bucket=s3_server.bucket, Key=f"{prefix}/{key}", Body=b"shard")

        def held() -> list[str]:
            listed = client.list_objects_v2(Bucket=s3_server.bucket, Prefix=f"{prefix}/sharded/")
            return sorted(o["Key"][len(prefix) + 1 :] for o in listed.get("Contents", []))
    else:
        for key in (shard, stale):
            (root / key).parent.mkdir(parents=True, exist_ok=True)
            (root / key).write_bytes(b"shard")

        def held() -> list[str]:
            files = (root / "sharded").rglob("*")
            return sorted(str(p.relative_to(root)) for p in files if p.is_file())

    assert held() == sorted([shard, stale])
    clean_leftovers(root, writing=2)
    assert held() == [shard]  # uncommitted index 1's part went, index 2's stays
