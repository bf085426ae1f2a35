"""Object storage against a real S3-compatible server (moto, started by tests/s3_support.py):
the client layer, tensor objects, and the commit protocol without rename."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch

import fastckpt
from fastckpt import _native
from fastckpt.container.s3root import S3Root
from fastckpt.errors import ChecksumMismatchError
from fastckpt.storage.s3.client import S3Client
from fastckpt.storage.s3.config import S3Options, S3Url, is_s3_url
from fastckpt.storage.s3.errors import (
    AccessDeniedError,
    BucketNotFoundError,
    CommitConflictError,
    EndpointUnreachableError,
    ObjectNotFoundError,
    ObjectStoreError,
    translate,
)
from fastckpt.storage.s3.tensors import get_tensors, put_tensors
from s3_support import S3Server, SaverFactory, s3_root, s3_server, saver_state
from test_files import counter_progress

__all__ = ["s3_root", "s3_server"]  # fixtures used by name below

SMALL_PARTS = {"part_size": 5 << 20, "read_part_size": 4 << 20, "concurrency": 4}
QUICK_FAIL = {"max_retries": 1, "retry_timeout_s": 2.0, "connect_timeout_s": 2.0}


def _state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return {
        "w": torch.randn(1024, 1536, generator=gen),  # 6 MiB: a multipart upload
        "bf16": torch.randn(33, 7, generator=gen).to(torch.bfloat16),
        "i8": torch.randint(-128, 127, (1001,), dtype=torch.int8, generator=gen),
        "flag": torch.tensor(True),
        "empty": torch.empty(0, 3),
        "t": torch.arange(12, dtype=torch.float64).reshape(3, 4).t(),  # non-contiguous
    }


def _run_bounded(fn: Any, bound_s: float = 60.0) -> BaseException | None:
    """Run ``fn`` in a thread; fail the test if it hangs past ``bound_s`` (a hang guard, not
    a performance check). Returns what it raised."""
    raised: list[BaseException | None] = [None]

    def target() -> None:
        try:
            fn()
        except BaseException as err:
            raised[0] = err

    worker = threading.Thread(target=target, daemon=True)
    worker.start()
    worker.join(bound_s)
    assert not worker.is_alive(), f"the call hung for more than {bound_s} s"
    return raised[0]


# ---------------------------------------------------------------------------- without server


def test_url_parsing_and_options_validation() -> None:
    url = S3Url.parse("s3://bucket/a/b/")
    assert (url.bucket, url.prefix, str(url)) == ("bucket", "a/b", "s3://bucket/a/b")
    assert url.key("x", "y") == "a/b/x/y"
    assert S3Url.parse(Path("s3://bucket/a")) == S3Url("bucket", "a")  # Path collapses '//'
    assert is_s3_url("s3://b/x") and is_s3_url(Path("s3://b/x")) and not is_s3_url("/tmp/x")
    for bad in ("/tmp/x", "s3://", "s3:///x", "s3://b/a//c", "s3://b/../c"):
        with pytest.raises(ValueError, match="s3://"):
            S3Url.parse(bad)
    with pytest.raises(TypeError, match="endpoint_url"):
        S3Options.from_mapping({"endpoint": "http://x"})
    with pytest.raises(ValueError, match="5 MiB"):
        S3Options.from_mapping({"part_size": 1 << 20})
    defaults = S3Options.from_mapping({"part_size": 6 << 20, "read_part_size": 3 << 20})
    assert (defaults.single_put_max, defaults.single_get_max) == (6 << 20, 3 << 20)
    with pytest.raises(ValueError, match="5 GiB"):
        S3Options.from_mapping({"multipart_threshold": 6 << 30})
    with pytest.raises(ValueError, match="ranged_get_threshold"):
        S3Options.from_mapping({"ranged_get_threshold": -1})


def test_translate_keeps_a_server_answer_apart_from_an_unreachable_endpoint() -> None:
    """obstore's message after retries names its ``retry_timeout`` setting; a server that
    answered (HTTP 500) is not an unreachable endpoint."""
    import obstore.exceptions

    answered = obstore.exceptions.GenericError(
        "Generic S3 error: Error performing POST http://127.0.0.1:1/b?delete in 3ms, after 3 "
        "retries, max_retries: 3, retry_timeout: 15s - Server returned non-2xx status code: "
        "500 Internal Server Error: <Error><Code>InternalError</Code></Error>"
    )
    failed = translate(answered, "s3://b/k", "http://127.0.0.1:1")
    assert type(failed) is ObjectStoreError
    assert "HTTP 500" in str(failed) and "s3://b/k" in str(failed)
    refused = obstore.exceptions.GenericError(
        "Generic S3 error: error sending request: Connection refused (os error 111), "
        "retry_timeout: 15s"
    )
    assert isinstance(translate(refused, "s3://b/k", None), EndpointUnreachableError)


# ------------------------------------------------------------------------------ with server


def test_tensor_object_round_trip_is_bitwise_and_a_safetensors_file(
    s3_server: S3Server, s3_root: str, tmp_path: Path
) -> None:
    url = S3Url.parse(s3_root)
    client = S3Client(url, s3_server.options(**SMALL_PARTS))
    state = _state()
    key = url.key("model.safetensors")
    record = put_tensors(client, key, state, {"note": "hi"})
    raw = client.get_range(key, 0, record["size"])
    assert len(raw) == record["size"] and _native.crc32c(raw) == record["crc32c"]
    # The object is byte for byte the file save_file writes, and the reference package reads it.
    local = tmp_path / "model.safetensors"
    fastckpt.save_file(state, local, {"note": "hi"})
    assert local.read_bytes() == raw
    reference = safetensors.torch.load(raw)
    assert set(reference) == set(state)
    loaded, info = get_tensors(client, key, size=record["size"], crc32c=record["crc32c"])
    assert info["metadata"] == {"note": "hi"}
    for name, tensor in state.items():
        assert loaded[name].dtype == tensor.dtype and loaded[name].shape == tensor.shape
        assert torch.equal(loaded[name], tensor) and torch.equal(reference[name], tensor)
    # 6 MiB with 5 MiB parts went up as a multipart upload (its ETag counts the parts).
    assert str(client.head(key).etag).strip('"').endswith("-2")


def test_request_shapes_follow_the_thresholds(s3_server: S3Server, s3_root: str) -> None:
    """``multipart_threshold`` above the object: one PUT (a plain ETag, no part count);
    ``ranged_get_threshold`` below it: ranged GETs, and at or above it one GET; every shape
    round-trips bitwise and verified."""
    url = S3Url.parse(s3_root)
    state = _state()  # ~6 MiB
    shapes: dict[str, dict[str, int | None]] = {
        "one-put": {"multipart_threshold": 8 << 20, "ranged_get_threshold": 0},
        "multipart": {"multipart_threshold": None, "ranged_get_threshold": 1 << 40},
    }
    for name, thresholds in shapes.items():
        client = S3Client(url, s3_server.options(**SMALL_PARTS, **thresholds))
        key = url.key(f"{name}.safetensors")
        record = put_tensors(client, key, state)
        etag = str(client.head(key).etag).strip('"')
        assert etag.endswith("-2") == (name == "multipart"), etag
        loaded, _ = get_tensors(client, key, size=record["size"], crc32c=record["crc32c"])
        assert all(torch.equal(loaded[k], v) for k, v in state.items())


def test_root_round_trip_bytes_and_tensors(s3_server: S3Server, s3_root: str) -> None:
    root = S3Root(s3_root, s3_server.options(**SMALL_PARTS))
    assert root.latest() is None
    with pytest.raises(ObjectNotFoundError, match=s3_root):
        root.load()
    state = _state()
    first = root.save({"m/model.safetensors": state, "meta.json": b'{"a": 1}'}, metadata={"k": 1})
    second = root.save({"m/model.safetensors": {"x": torch.ones(3)}, "meta.json": b"{}"})
    assert (first, second, root.indices()) == (0, 1, [0, 1])
    loaded = root.load(0)
    assert loaded.record["metadata"] == {"k": 1} and loaded.files["meta.json"] == b'{"a": 1}'
    for name, tensor in state.items():
        assert torch.equal(loaded.files["m/model.safetensors"][name], tensor)
    assert torch.equal(root.load().files["m/model.safetensors"]["x"], torch.ones(3))
    assert not root.leftovers()


@pytest.mark.parametrize(
    "shapes",
    [{}, {"multipart_threshold": 64 << 20, "ranged_get_threshold": 64 << 20}],
    ids=["multipart-and-ranges", "one-put-and-one-get"],
)
def test_gil_is_released_while_saving_to_and_loading_from_s3(
    s3_server: S3Server, s3_root: str, shapes: dict[str, int]
) -> None:
    root = S3Root(s3_root, s3_server.options(**SMALL_PARTS, **shapes))
    state = {"w": torch.ones(24 << 20, dtype=torch.uint8), "v": torch.ones(2 << 20)}

    def round_trip() -> None:
        root.load(root.save({"s.safetensors": state}))

    progressed, elapsed = counter_progress(round_trip)
    assert progressed > 50 * elapsed / sys.getswitchinterval(), (progressed, elapsed)


def test_multipart_upload_of_one_gib_round_trips(s3_server: S3Server, s3_root: str) -> None:
    # 1 GiB in 64 MiB parts; read back in 4 large ranges (moto reads a whole object per
    # ranged GET, so few large ranges keep the server's memory in bounds).
    options = s3_server.options(part_size=64 << 20, read_part_size=256 << 20, concurrency=2)
    root = S3Root(s3_root, options)
    big = torch.empty(1 << 28, dtype=torch.int32)
    big.copy_(torch.arange(1 << 28, dtype=torch.int32) * 2654435761 % (1 << 31))
    state = {"big": big, "tail": torch.arange(5, dtype=torch.int16)}
    index = root.save({"big.safetensors": state})
    record = root.read_record(index)
    key = f"{root.data_prefix(index, record['generation'])}/big.safetensors"
    meta = root.client.head(key)
    assert meta.size > (1 << 30) and str(meta.etag).strip('"').endswith("-17")
    loaded = root.load(index).files["big.safetensors"]
    assert torch.equal(loaded["big"], big) and torch.equal(loaded["tail"], state["tail"])


def test_flipped_byte_raises_checksum_mismatch_naming_object_and_tensor(
    s3_server: S3Server, s3_root: str
) -> None:
    root = S3Root(s3_root, s3_server.options(**SMALL_PARTS))
    index = root.save({"model.safetensors": _state()})
    record = root.read_record(index)
    key = f"{root.data_prefix(index, record['generation'])}/model.safetensors"
    client = s3_server.client()
    data = bytearray(client.get_object(Bucket=s3_server.bucket, Key=key)["Body"].read())
    header_len = int.from_bytes(data[:8], "little")
    data[8 + header_len + 1000] ^= 0x01  # a byte inside tensor "w" (first in the layout)
    client.put_object(Bucket=s3_server.bucket, Key=key, Body=bytes(data))
    with pytest.raises(ChecksumMismatchError) as caught:
        root.load(index)
    assert f"s3://{s3_server.bucket}/{key}" in str(caught.value) and "w" in str(caught.value)


def test_changed_record_and_missing_object_are_typed_errors(
    s3_server: S3Server, s3_root: str
) -> None:
    root = S3Root(s3_root, s3_server.options(**SMALL_PARTS))
    index = root.save({"a.safetensors": {"x": torch.ones(4)}, "b.json": b"{}"})
    record = root.read_record(index)
    key = f"{root.data_prefix(index, record['generation'])}/a.safetensors"
    client = s3_server.client()
    client.delete_object(Bucket=s3_server.bucket, Key=key)
    with pytest.raises(ObjectNotFoundError, match=key):
        root.load(index)
    raw = json.loads(
        client.get_object(Bucket=s3_server.bucket, Key=root.record_key(index))["Body"].read()
    )
    raw["files"]["b.json"]["size"] = 3
    client.put_object(
        Bucket=s3_server.bucket, Key=root.record_key(index), Body=json.dumps(raw).encode()
    )
    with pytest.raises(ChecksumMismatchError, match="record fails its crc32c"):
        root.load(index)
    with pytest.raises(ObjectNotFoundError):
        root.read_record(index + 1)


def test_bad_credentials_missing_bucket_and_dead_endpoint_fail_typed_and_fast(
    s3_server: S3Server, s3_root: str
) -> None:
    bad_key = S3Root(s3_root, s3_server.options(secret_access_key="wrong", **QUICK_FAIL))
    err = _run_bounded(lambda: bad_key.save({"x.json": b"{}"}))
    assert isinstance(err, AccessDeniedError) and isinstance(err, PermissionError)
    assert s3_root in str(err) and "secret" in str(err)

    no_bucket = S3Root("s3://no-such-bucket-here/x", s3_server.options(**QUICK_FAIL))
    err = _run_bounded(lambda: no_bucket.save({"x.json": b"{}"}))
    assert isinstance(err, BucketNotFoundError) and "no-such-bucket-here" in str(err)

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        dead_port = probe.getsockname()[1]  # nothing listens there once closed
    dead = S3Root(
        s3_root, s3_server.options(endpoint_url=f"http://127.0.0.1:{dead_port}", **QUICK_FAIL)
    )
    err = _run_bounded(lambda: dead.latest())
    assert isinstance(err, EndpointUnreachableError) and str(dead_port) in str(err)


def test_config_from_environment_and_credentials_file_overridable_per_call(
    s3_server: S3Server, s3_root: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # never probe instance metadata
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_access_key)
    assert S3Root(s3_root).save({"a.json": b"1"}) == 0  # everything from the environment

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    with pytest.raises(AccessDeniedError):
        S3Root(s3_root, QUICK_FAIL).latest()
    fixed = {"secret_access_key": s3_server.secret_access_key, **QUICK_FAIL}
    assert S3Root(s3_root, fixed).latest() == 0  # the call's options win over the environment

    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    credentials = tmp_path / "credentials"
    credentials.write_text(
        f"[ckpt]\naws_access_key_id = {s3_server.access_key_id}\n"
        f"aws_secret_access_key = {s3_server.secret_access_key}\n"
    )
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    monkeypatch.setenv("AWS_PROFILE", "ckpt")
    assert S3Root(s3_root, QUICK_FAIL).latest() == 0  # credentials from the profile


def test_conditional_put_lets_one_writer_commit_an_index(s3_server: S3Server, s3_root: str) -> None:
    first = S3Root(s3_root, s3_server.options(**SMALL_PARTS))
    second = S3Root(s3_root, s3_server.options(concurrency=3, **QUICK_FAIL))
    assert first.save({"a.json": b"first"}, index=0) == 0
    with pytest.raises(CommitConflictError, match="another writer"):
        second.save({"a.json": b"second"}, index=0)
    assert first.load(0).files["a.json"] == b"first"
    assert not first.leftovers()  # the loser removed its objects


def test_prune_removes_records_first_then_data(s3_server: S3Server, s3_root: str) -> None:
    root = S3Root(s3_root, s3_server.options(**SMALL_PARTS))
    for step in range(4):
        root.save({"s.safetensors": {"x": torch.full((3,), float(step))}})
    assert root.prune(keep_last=2) == [0, 1]
    assert root.indices() == [2, 3] and not root.leftovers()
    data = root.client.list_objects(root.url.key("data") + "/")
    assert {m.key.split("/")[-2].split(".")[0] for m in data} == {"000000000002", "000000000003"}
    assert torch.equal(root.load(2).files["s.safetensors"]["x"], torch.full((3,), 2.0))


def test_server_stopped_mid_save_is_a_typed_error_and_earlier_checkpoints_survive(
    s3_server: S3Server, s3_root: str
) -> None:
    options = s3_server.options(**SMALL_PARTS, **QUICK_FAIL)
    root = S3Root(s3_root, options)
    earlier = root.save({"s.safetensors": {"x": torch.arange(10.0)}})
    big = {"big": torch.randn(16 << 20)}  # 64 MiB in 5 MiB parts
    url = S3Url.parse(s3_root)
    watcher = S3Client(url, options)
    outcome: list[BaseException | None] = []

    def save() -> None:
        try:
            root.save({"big.safetensors": big})
            outcome.append(None)
        except BaseException as err:
            outcome.append(err)

    saver = threading.Thread(target=save)
    saver.start()
    deadline = time.monotonic() + 60
    while not watcher.pending_uploads(url.key("data") + "/") and time.monotonic() < deadline:
        time.sleep(0.02)
    s3_server.stop()
    try:
        saver.join(60)
        assert not saver.is_alive(), "the save hung after the server went away"
    finally:
        s3_server.start()
    err = outcome[0]
    assert isinstance(err, EndpointUnreachableError), repr(err)
    assert s3_root in str(err)
    assert root.latest() == earlier
    assert torch.equal(root.load().files["s.safetensors"]["x"], torch.arange(10.0))
    root.save({"s.safetensors": {"x": torch.ones(2)}})  # the next save cleans up
    assert not root.leftovers()
    assert not watcher.pending_uploads(url.key("data") + "/")


def test_sigkilled_savers_never_break_the_committed_checkpoints(
    s3_server: S3Server, s3_root: str
) -> None:
    options = s3_server.options(**SMALL_PARTS)
    root = S3Root(s3_root, options)
    factory = SaverFactory()
    rng = random.Random(1234)
    kills = killed_mid_upload = 0
    try:
        for round_ in range(50):
            pid = factory.spawn(s3_root, options)
            # Mostly short lives (kills land in uploads, commits, clean-ups); every tenth saver
            # lives long enough to commit, so the run makes progress on a slow machine too.
            time.sleep(rng.uniform(1.5, 2.5) if round_ % 10 == 9 else rng.uniform(0.05, 0.9))
            os.kill(pid, signal.SIGKILL)
            kills += 1
            killed_mid_upload += bool(root.client.pending_uploads(root.url.key("data") + "/"))
            committed = root.indices()
            if not committed:
                continue
            # Every committed record names complete objects, and the newest loads.
            for index in committed:
                loaded = root.load(index)
                weights = loaded.files["state.safetensors"]["weights"]
                assert loaded.files["meta.json"] == saver_state(index)["meta.json"]
                assert int(loaded.files["state.safetensors"]["step"]) == index
                assert bool((weights == float(index)).all())
    finally:
        factory.close()
    assert kills == 50
    assert killed_mid_upload > 0, "no kill landed inside a multipart upload"
    latest = root.latest()
    assert latest is not None and latest >= 3, "the savers made too little progress"
    assert root.save(saver_state(latest + 1)) == latest + 1
    assert not root.leftovers()  # every killed save's objects and uploads are gone


def test_fastckpt_bench_s3_runs_every_writer_and_the_async_stall(tmp_path: Path) -> None:
    """``fastckpt bench s3 --json`` on a tiny state: every writer round-trips the state (the
    scenario checks each download bitwise), the stall rows for local disk and s3:// are there,
    and the result document printed on stdout is the one written to ``--out``."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "fastckpt",
            "bench",
            "s3",
            *("--size-mib", "8", "--repeats", "1"),
            *("--part-mib", "5", "--out", str(tmp_path)),
            *("--server", "moto"),  # s3s-fs is built by `make bench` only
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    document = json.loads((tmp_path / "s3-8mib.json").read_text())
    assert json.loads(result.stdout) == document  # the table went to stderr
    assert set(document["writers"]) >= {"save_checkpoint", "manager", "fastckpt", "boto3", "s3fs"}
    assert document["server"].startswith("moto")
    stall = document["async_stall"]
    assert stall["local"]["stall_s"]["median"] > 0 and stall["s3"]["total_s"]["median"] > 0
    assert "stall ratio s3 / local disk" in (tmp_path / "s3-8mib.md").read_text()
