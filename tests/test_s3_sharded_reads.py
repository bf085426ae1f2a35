"""Sharded loads from ``s3://`` plan their reads (issue 23): the byte ranges a load needs are
coalesced per object and fetched together, so a 2-rank save loaded on 1 rank costs one ranged
GET per object, not one (or two) per item; every byte is still verified (a flipped byte inside
a coalesced range is a ``ChecksumMismatchError`` naming the object, and no template is
filled); a load larger than ``stage_bytes`` is fetched twice, batch by batch, with the same
result; and ranges far apart are not merged (a partial read fetches its rows, not the object).
Real moto server, real obstore requests, counted at the obstore call; no timing asserted."""

from __future__ import annotations

import io
import os
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import fastckpt
import fastckpt.dcp
from dcp_support import check_ok, launch, setup_rank
from fastckpt.container.sharded.chunks import OBJECT_STORE_GAP, ChunkFiles
from fastckpt.container.sharded.commit import read_record
from fastckpt.container.sharded.ranges import Range, coalesce, covered_bytes, windows
from fastckpt.container.sharded.reads import ReadPlan
from s3_support import S3Server, s3_server

__all__ = ["s3_server"]  # a fixture used by name below

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

BLOCK = 1024  # small verification blocks: every chunk has several
N_TENSORS = 24


def _full() -> dict[str, torch.Tensor]:
    """The saved tensors: shapes that split unevenly over 2 ranks, several blocks per chunk."""
    gen = torch.Generator().manual_seed(23)
    return {f"layer{i}.w": torch.randn(17 + 3 * i, 29, generator=gen) for i in range(N_TENSORS)}


def save_two_ranks() -> None:
    """Rank script (``dcp_support.launch``, URL as the 5th argument): the tensors of
    :func:`_full` as DTensors sharded on dim 0 over 2 ranks, plus two non-tensor values,
    saved with ``fastckpt.dcp.Writer``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from training_support import leave_process_group

    _, _, world = setup_rank()
    mesh = init_device_mesh("cpu", (world,))
    state: dict[str, Any] = {
        name: distribute_tensor(tensor, mesh, [Shard(0)]) for name, tensor in _full().items()
    }
    state["extra"] = {"step": 7, "blob": io.BytesIO(b"\x00abc\xff")}
    dcp.save(state, storage_writer=fastckpt.dcp.Writer(sys.argv[5], block_bytes=BLOCK))
    leave_process_group()


@pytest.fixture(scope="module")
def env(s3_server: S3Server) -> Iterator[dict[str, str]]:
    """The server reached through the AWS variables (inherited by the ranks)."""
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
) -> str:
    """The URL of a checkpoint saved by 2 gloo ranks (see :func:`save_two_ranks`)."""
    local = tmp_path_factory.mktemp("sharded-reads")
    url = s3_server.url(f"reads-{os.getpid()}-{time.time_ns()}")
    check_ok(launch("save_two_ranks", local / "ck", 2, url, ranks="test_s3_sharded_reads"))
    return url


def _templates() -> dict[str, Any]:
    state: dict[str, Any] = {name: torch.zeros_like(t) for name, t in _full().items()}
    state["extra"] = {"step": 0, "blob": io.BytesIO()}
    return state


def _count_gets(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, tuple[int, int]]]:
    """Record every ranged GET that goes through obstore: ``(key, (start, end))``."""
    import obstore

    calls: list[tuple[str, tuple[int, int]]] = []
    real_get, real_get_range = obstore.get, obstore.get_range

    def get(store: Any, path: str, *args: Any, **kwargs: Any) -> Any:
        byte_range = (kwargs.get("options") or {}).get("range")
        if byte_range is not None:
            calls.append((path, tuple(byte_range)))
        return real_get(store, path, *args, **kwargs)

    def get_range(store: Any, path: str, *args: Any, **kwargs: Any) -> Any:
        calls.append((path, (kwargs.get("start", -1), kwargs.get("end", -1))))
        return real_get_range(store, path, *args, **kwargs)

    monkeypatch.setattr(obstore, "get", get)
    monkeypatch.setattr(obstore, "get_range", get_range)
    return calls


def _data_files(url: str) -> set[str]:
    return {chunk.file for chunk in read_record(Path(url)).storage.values()}


def _check_loaded(state: dict[str, Any]) -> None:
    for name, tensor in _full().items():
        assert torch.equal(state[name], tensor), name
    assert state["extra"]["step"] == 7
    assert state["extra"]["blob"].getvalue() == b"\x00abc\xff"


def test_a_two_rank_save_loads_on_one_rank_with_one_ranged_get_per_object(
    saved: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = _data_files(saved)
    assert {"rank-00000.safetensors", "rank-00001.safetensors"} <= files
    items = 2 * N_TENSORS + 2  # every tensor has one chunk per saving rank; two values
    gets = _count_gets(monkeypatch)
    state = _templates()
    reader = fastckpt.dcp.Reader(saved)
    dcp.load(state, storage_reader=reader)
    _check_loaded(state)
    # One GET per data object (each < read_part_size), against one per item (twice) before.
    assert sorted(key.rsplit("/", 1)[1] for key, _ in gets) == sorted(files), gets
    assert items >= 15 * len(gets)
    assert 0 < reader.bytes_read <= reader.bytes_fetched


def test_a_load_larger_than_stage_bytes_is_fetched_twice_in_batches(
    saved: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = _data_files(saved)
    gets = _count_gets(monkeypatch)
    state = _templates()
    reader = fastckpt.dcp.Reader(saved, stage_bytes=BLOCK)  # every span a batch of its own
    dcp.load(state, storage_reader=reader)
    _check_loaded(state)
    assert len(gets) == 2 * len(files), gets  # verified, then read again into the targets
    assert reader.bytes_fetched == 2 * reader.bytes_read  # objects this small: no gaps


@pytest.mark.parametrize("stage_bytes", [None, BLOCK], ids=["held-whole", "in-batches"])
def test_a_flipped_byte_inside_a_coalesced_range_is_a_checksum_mismatch(
    s3_server: S3Server, saved: str, stage_bytes: int | None
) -> None:
    record = read_record(Path(saved))
    chunks = sorted(
        (c for c in record.storage.values() if c.file == "rank-00001.safetensors"),
        key=lambda c: c.offset,
    )
    victim = chunks[len(chunks) // 2]  # in the middle of the one range the load fetches
    assert victim.blocks is not None and len(victim.blocks) > 1
    key = f"{saved.split('/', 3)[3]}/{record.generation}/{victim.file}"
    client = s3_server.client()
    original = client.get_object(Bucket=s3_server.bucket, Key=key)["Body"].read()
    damaged = bytearray(original)
    damaged[victim.offset + victim.length // 2] ^= 0x10
    client.put_object(Bucket=s3_server.bucket, Key=key, Body=bytes(damaged))
    try:
        state = _templates()
        reader = fastckpt.dcp.Reader(saved, stage_bytes=stage_bytes)
        pattern = rf"rank-00001\.safetensors: tensor '{victim.name}' \(bytes \d+-\d+\)"
        with pytest.raises(fastckpt.ChecksumMismatchError, match=pattern):
            fastckpt.dcp.load_state(saved, into=state, reader=reader)
        with pytest.raises(CheckpointException) as raised:
            dcp.load(state, storage_reader=fastckpt.dcp.Reader(saved, stage_bytes=stage_bytes))
        error, _ = raised.value.failures[0]
        assert isinstance(error, fastckpt.ChecksumMismatchError)
        assert re.search(pattern, str(error)), error
        # nothing reached a template, not even the chunks before the damaged one
        assert all(not t.any() for name, t in state.items() if name != "extra")
        assert state["extra"]["step"] == 0
    finally:
        client.put_object(Bucket=s3_server.bucket, Key=key, Body=original)


def test_ranges_far_apart_are_fetched_apart(
    s3_server: S3Server, env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    url = s3_server.url(f"apart-{os.getpid()}-{time.time_ns()}")
    gen = torch.Generator().manual_seed(5)
    state = {name: torch.randn(2048, 1024, generator=gen) for name in ("a", "b")}  # 8 MiB each
    dcp.save(state, storage_writer=fastckpt.dcp.Writer(url, block_bytes=64 << 10))
    record = read_record(Path(url))
    files = ChunkFiles(Path(url) / record.generation)
    chunks = sorted(record.storage.values(), key=lambda c: c.offset)
    # The first eighth of the rows of each tensor: 1 MiB each, 7 MiB apart.
    wants = [files.want_box(c, [0, 0], [256, 1024]) for c in chunks]
    plan = ReadPlan(files, wants, None)
    gets = _count_gets(monkeypatch)
    ((spans, members),) = plan.batches
    views = plan.read((spans, members))
    assert len(spans) == 2 and len(gets) == 2, (spans, gets)
    assert files.bytes_read == plan.needed_bytes == 2 << 20
    for index, chunk in enumerate(chunks):
        rows = torch.from_numpy(views[index]).view(torch.float32).reshape(256, 1024)
        assert torch.equal(rows, state[str(chunk.name)][:256])
    files.close()


# ------------------------------------------------------------------------- range planning


def test_coalesce_merges_overlapping_and_close_ranges_of_one_file_only() -> None:
    ranges = [
        Range("b", 0, 10),
        Range("a", 100, 200),
        Range("a", 0, 50),
        Range("a", 40, 60),  # overlaps
        Range("a", 70, 80),  # 10 bytes after 60
        Range("a", 5, 5),  # empty: no span
        Range("b", 30, 40),  # 20 bytes after 10
    ]
    spans = coalesce(ranges, gap=10)
    assert [(s.file, s.start, s.stop, s.members) for s in spans] == [
        ("a", 0, 80, (2, 3, 4)),
        ("a", 100, 200, (1,)),
        ("b", 0, 10, (0,)),
        ("b", 30, 40, (6,)),
    ]
    assert [(s.start, s.stop) for s in coalesce(ranges, gap=0) if s.file == "a"] == [
        (0, 60),
        (70, 80),
        (100, 200),
    ]
    assert covered_bytes(ranges) == 60 + 10 + 100 + 10 + 10
    assert 1 << 20 <= OBJECT_STORE_GAP < 7 << 20  # a request costs about a round trip's bytes


def test_windows_bound_the_bytes_held_at_once() -> None:
    spans = coalesce([Range("a", 0, 40), Range("a", 100, 130), Range("b", 0, 50)], gap=0)
    assert [[s.nbytes for s in w] for w in windows(spans, 70)] == [[40, 30], [50]]
    assert [[s.nbytes for s in w] for w in windows(spans, 10)] == [[40], [30], [50]]
    assert [[s.nbytes for s in w] for w in windows(spans, None)] == [[40, 30, 50]]
    assert windows([], 10) == []
