"""Object storage against a real S3-compatible server (moto, started by tests/s3_support.py):
the client layer, tensor objects, and the guarantees of committing without rename, through
the front doors (``save_checkpoint`` / ``load_checkpoint`` / ``prune`` / ``fastckpt.verify`` on
an ``s3://`` root, ``CheckpointManager`` on an ``s3://`` id)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch

import fastckpt
from fastckpt import _native
from fastckpt.errors import ChecksumMismatchError
from fastckpt.format.records import read_commit_record
from fastckpt.storage.registry import configure_storage
from fastckpt.storage.s3.backend import S3Backend
from fastckpt.storage.s3.client import S3Client
from fastckpt.storage.s3.config import S3Options, S3Url, is_s3_url
from fastckpt.storage.s3.errors import (
    AccessDeniedError,
    BucketNotFoundError,
    CommitConflictError,
    EndpointUnreachableError,
    ObjectStoreError,
    translate,
)
from fastckpt.storage.s3.tensors import get_tensors, put_tensors
from s3_support import S3Server, no_aws_env, s3_root, s3_server
from test_files import counter_progress

__all__ = ["no_aws_env", "s3_root", "s3_server"]  # fixtures used by name below

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
    # Every field is checked by type and range, naming it (before: a NaN lease_ttl_s was
    # accepted and wrote a lease that never expired, so a killed writer locked the root for
    # good, as did 1e15 s; "8" for a count was a bare comparison TypeError; 2.5 or True a count).
    for key, value, error in [
        ("lease_ttl_s", float("nan"), ValueError),
        ("read_timeout_s", float("inf"), ValueError),
        ("lease_ttl_s", 1e15, ValueError),
        ("request_timeout_s", 86_401, ValueError),
        ("connect_timeout_s", 0, ValueError),
        ("lease_ttl_s", True, TypeError),
        ("concurrency", "8", TypeError),
        ("concurrency", 2.5, TypeError),
        ("concurrency", True, TypeError),
        ("concurrency", 0, ValueError),
        ("part_size", "33554432", TypeError),
        ("max_retries", 1.5, TypeError),
        ("region", 5, TypeError),
        ("allow_http", "yes", TypeError),
        ("unsigned_payload", None, TypeError),
        ("multipart_threshold", 1.0, TypeError),
    ]:
        with pytest.raises(error, match=f"{key}={value!r}"):
            S3Options.from_mapping({key: value})
        with pytest.raises(error, match=key):
            S3Options(**{key: value})
    assert S3Options.from_mapping({"lease_ttl_s": 2, "read_timeout_s": 0.5}).lease_ttl_s == 2
    assert S3Options(lease_ttl_s=86_400).lease_ttl_s == 86_400


def test_every_front_door_refuses_a_url_that_a_path_would_collapse(tmp_path: Path) -> None:
    """``s3://b/run//x/./y`` was refused with ``storage_options=`` but, with options from the
    environment, silently saved under ``run/x/y`` (``pathlib`` collapses the segments): the
    checkpoint was not where the caller named it. Now every front door refuses it before any
    request (no server here: nothing is reached)."""
    import fastckpt.dcp

    model = torch.nn.Linear(2, 2)
    calls = [
        lambda u: fastckpt.save_checkpoint(u, models={"m": model}),
        lambda u: fastckpt.load_checkpoint(u),
        lambda u: fastckpt.list_checkpoints(u),
        lambda u: fastckpt.prune(u, keep_last=1),
        lambda u: fastckpt.verify(u),
        lambda u: fastckpt.CheckpointManager().save(u, {"m": model}),
        lambda u: fastckpt.CheckpointManager().load(u),
        lambda u: fastckpt.CheckpointHook(u),
        lambda u: fastckpt.dcp.Writer(u),
        lambda u: fastckpt.dcp.Reader(u),
    ]
    for url in ("s3://b/run//x/./y", "s3://b/run/../y", "s3://b/./y/", "s3://b//run"):
        for call in calls:
            with pytest.raises(ValueError, match=r"segment, which would be collapsed.*use s3://b/"):
                call(url)
    assert fastckpt.storage.registry.check_url_spelling("s3://b/a/b/") is None  # a trailing /


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


# ------------------------------------------------------- the front doors' commit guarantees
#
# What the retired lower-level object-store root class was tested for, pinned through the
# calls users make: save_checkpoint / load_checkpoint / list_checkpoints / prune /
# fastckpt.verify on an s3:// root and CheckpointManager on an s3:// checkpoint id.


@contextlib.contextmanager
def _configured(url: str, options: dict[str, Any]) -> Iterator[None]:
    """``options`` registered for ``url``'s prefix for the block (then forgotten again)."""
    configure_storage(url, options)
    try:
        yield
    finally:
        configure_storage(url)


def _sync_manager() -> fastckpt.CheckpointManager:
    return fastckpt.CheckpointManager(fastckpt.CheckpointManager.Config.with_sync_save())


def _key(url: str) -> str:
    """The object key of an ``s3://`` URL (its prefix in the bucket)."""
    return S3Url.parse(url).prefix


def _top_level(server: S3Server, url: str) -> set[str]:
    """The first key segment of every object under ``url``."""
    prefix = _key(url) + "/"
    listing = server.client().list_objects_v2(Bucket=server.bucket, Prefix=prefix)
    return {item["Key"][len(prefix) :].split("/")[0] for item in listing.get("Contents", [])}


def _pending(server: S3Server, url: str) -> list[Any]:
    found = server.client().list_multipart_uploads(Bucket=server.bucket, Prefix=_key(url) + "/")
    return list(found.get("Uploads", []))


def _linear(value: float, rows: int = 32, columns: int = 64) -> torch.nn.Linear:
    model = torch.nn.Linear(columns, rows)
    with torch.no_grad():
        model.weight.fill_(value)
        model.bias.fill_(value)
    return model


def _loaded_model(root: str, index: int = -1) -> torch.nn.Module:
    model: torch.nn.Module = fastckpt.load_checkpoint(root, index)["models"]["main"]["model"]
    return model


def _same(model: torch.nn.Module, other: torch.nn.Module) -> bool:
    theirs = other.state_dict()
    return all(torch.equal(tensor, theirs[name]) for name, tensor in model.state_dict().items())


def _generation_file(checkpoint: str, suffix: str) -> str:
    """The object key of the committed file of manager checkpoint ``checkpoint`` whose name
    ends with ``suffix`` (its record names it under the generation prefix)."""
    (relpath,) = [p for p in read_commit_record(checkpoint)["files"] if p.endswith(suffix)]
    return f"{_key(checkpoint)}/{relpath}"


def test_front_doors_round_trip_tensors_values_and_older_indices(
    s3_server: S3Server, s3_root: str
) -> None:
    root, checkpoint = f"{s3_root}/root", f"{s3_root}/ids/ckpt"
    with _configured(s3_root, s3_server.options(**SMALL_PARTS)):
        with pytest.raises(FileNotFoundError, match=r"manifest\.json: no committed checkpoint"):
            fastckpt.load_checkpoint(root)
        with _sync_manager() as manager, pytest.raises(FileNotFoundError, match="commit"):
            manager.load(checkpoint)
        first, second = _linear(1.0), _linear(2.0)
        assert fastckpt.save_checkpoint(root, models={"main": first}, counters={"step": 1}) == 0
        assert fastckpt.save_checkpoint(root, models={"main": second}, counters={"step": 2}) == 1
        rows = fastckpt.list_checkpoints(root)
        assert [(row["index"], row["counters"]["step"]) for row in rows] == [(0, 1), (1, 2)]
        assert _same(_loaded_model(root, 0), first) and _same(_loaded_model(root), second)

        state = _state()  # every dtype, a 6 MiB multipart upload, empty and strided tensors
        with _sync_manager() as manager:
            manager.save(checkpoint, {"m": state, "meta": {"a": 1, "note": "hi"}})
            loaded = manager.load(checkpoint)
    assert loaded["meta"] == {"a": 1, "note": "hi"}
    for name, tensor in state.items():
        got = loaded["m"][name]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape
        assert torch.equal(got, tensor), name
    assert fastckpt.verify(root, storage_options=s3_server.options()).ok
    configure_storage(root)


@pytest.mark.parametrize("door", ["save_checkpoint", "manager"])
@pytest.mark.parametrize(
    "shapes",
    [{}, {"multipart_threshold": 64 << 20, "ranged_get_threshold": 64 << 20}],
    ids=["multipart-and-ranges", "one-put-and-one-get"],
)
def test_gil_is_released_while_saving_to_and_loading_from_s3(
    s3_server: S3Server, s3_root: str, shapes: dict[str, int], door: str
) -> None:
    model = torch.nn.Linear(2048, 3072)  # 24 MiB of weights
    state = {"w": torch.ones(24 << 20, dtype=torch.uint8), "v": torch.ones(2 << 20)}

    def save_checkpoint_round_trip() -> None:
        fastckpt.save_checkpoint(s3_root, models={"main": model}, incremental=False)
        assert _same(_loaded_model(s3_root), model)

    def manager_round_trip() -> None:
        with _sync_manager() as manager:
            manager.save(f"{s3_root}/ckpt", {"s": state})
            assert torch.equal(manager.load(f"{s3_root}/ckpt")["s"]["w"], state["w"])

    round_trip = save_checkpoint_round_trip if door == "save_checkpoint" else manager_round_trip
    with _configured(s3_root, s3_server.options(**SMALL_PARTS, **shapes)):
        progressed, elapsed = counter_progress(round_trip)
    assert progressed > 50 * elapsed / sys.getswitchinterval(), (progressed, elapsed)


def test_multipart_upload_of_one_gib_round_trips(s3_server: S3Server, s3_root: str) -> None:
    # 1 GiB in 64 MiB parts through CheckpointManager; read back in 4 large ranges (moto
    # reads a whole object per ranged GET, so few large ranges keep its memory in bounds).
    options = s3_server.options(part_size=64 << 20, read_part_size=256 << 20, concurrency=2)
    big = torch.empty(1 << 28, dtype=torch.int32)
    big.copy_(torch.arange(1 << 28, dtype=torch.int32) * 2654435761 % (1 << 31))
    state = {"big": big, "tail": torch.arange(5, dtype=torch.int16)}
    checkpoint = f"{s3_root}/ckpt"
    with _configured(s3_root, options), _sync_manager() as manager:
        manager.save(checkpoint, {"s": state})
        meta = S3Client(S3Url.parse(s3_root), options).head(
            _generation_file(checkpoint, "s.safetensors")
        )
        assert meta.size > (1 << 30) and str(meta.etag).strip('"').endswith("-17")
        loaded = manager.load(checkpoint)["s"]
    assert torch.equal(loaded["big"], big) and torch.equal(loaded["tail"], state["tail"])


def _flip_byte(server: S3Server, key: str, tensor: str) -> None:
    """Rewrite object ``key`` with one byte inside ``tensor``'s data flipped."""
    client = server.client()
    data = bytearray(client.get_object(Bucket=server.bucket, Key=key)["Body"].read())
    header_len = int.from_bytes(data[:8], "little")
    begin, end = json.loads(data[8 : 8 + header_len])[tensor]["data_offsets"]
    data[8 + header_len + (begin + end) // 2] ^= 0x01
    client.put_object(Bucket=server.bucket, Key=key, Body=bytes(data))


def test_flipped_byte_raises_checksum_mismatch_naming_object_and_tensor(
    s3_server: S3Server, s3_root: str
) -> None:
    root, checkpoint = f"{s3_root}/root", f"{s3_root}/ids/ckpt"
    with _configured(s3_root, s3_server.options(**SMALL_PARTS)):
        fastckpt.save_checkpoint(root, models={"main": torch.nn.Linear(1024, 1536)})
        with _sync_manager() as manager:
            manager.save(checkpoint, {"m": _state()})

            def load_manager() -> None:
                manager.load(checkpoint)

            def load_root() -> None:
                fastckpt.load_checkpoint(root)

            damaged = [
                (f"{_key(root)}/0/models/main.safetensors", "weight", load_root, root),
                (_generation_file(checkpoint, "m.safetensors"), "w", load_manager, checkpoint),
            ]
            for key, tensor, load, url in damaged:
                _flip_byte(s3_server, key, tensor)
                with pytest.raises(ChecksumMismatchError) as caught:
                    load()
                message = str(caught.value)
                assert f"{s3_server.bucket}/{key}" in message, message
                assert f"tensor `{tensor}`" in message, message
                assert not fastckpt.verify(url).ok


def test_changed_record_and_missing_object_are_typed_errors(
    s3_server: S3Server, s3_root: str
) -> None:
    root, checkpoint = f"{s3_root}/root", f"{s3_root}/ids/ckpt"
    client, bucket = s3_server.client(), s3_server.bucket
    with _configured(s3_root, s3_server.options(**SMALL_PARTS)):
        first = _linear(1.0)
        fastckpt.save_checkpoint(root, models={"main": first})
        fastckpt.save_checkpoint(root, models={"main": _linear(2.0)})
        # A missing object: the index naming it fails typed, the other one still loads.
        client.delete_object(Bucket=bucket, Key=f"{_key(root)}/1/models/main.safetensors")
        with pytest.raises(
            FileNotFoundError, match=r"1/models/main\.safetensors: missing \(listed in .*manifest"
        ):
            fastckpt.load_checkpoint(root)
        assert _same(_loaded_model(root, 0), first)
        with pytest.raises(KeyError, match="checkpoint index 5 is not in"):
            fastckpt.load_checkpoint(root, 5)
        # A changed record (a file's size edited, the record's crc32c not re-sealed).
        with _sync_manager() as manager:
            manager.save(checkpoint, {"x": torch.arange(10.0), "step": 1})
            for record_key in (f"{_key(root)}/manifest.json", f"{_key(checkpoint)}/commit.json"):
                raw = json.loads(client.get_object(Bucket=bucket, Key=record_key)["Body"].read())
                files = raw["files"] if "files" in raw else raw["checkpoints"]["0"]["files"]
                files[next(iter(files))]["size"] += 1
                client.put_object(Bucket=bucket, Key=record_key, Body=json.dumps(raw).encode())
            with pytest.raises(ChecksumMismatchError, match=r"manifest\.json: content crc32c"):
                fastckpt.load_checkpoint(root, 0)
            with pytest.raises(ChecksumMismatchError, match=r"commit\.json: content crc32c"):
                manager.load(checkpoint)


def test_bad_credentials_missing_bucket_and_dead_endpoint_fail_typed_and_fast(
    s3_server: S3Server, s3_root: str
) -> None:
    saved = {"main": torch.nn.Linear(2, 2)}
    bad_key, dead, no_bucket = f"{s3_root}/bad-key", f"{s3_root}/dead", "s3://no-such-bucket-here/x"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        dead_port = probe.getsockname()[1]  # nothing listens there once closed
    dead_options = s3_server.options(endpoint_url=f"http://127.0.0.1:{dead_port}", **QUICK_FAIL)
    try:
        wrong = s3_server.options(secret_access_key="wrong", **QUICK_FAIL)
        err = _run_bounded(
            lambda: fastckpt.save_checkpoint(bad_key, models=saved, storage_options=wrong)
        )
        assert isinstance(err, AccessDeniedError) and isinstance(err, PermissionError)
        assert bad_key in str(err) and "secret" in str(err)

        quick = s3_server.options(**QUICK_FAIL)
        err = _run_bounded(
            lambda: fastckpt.save_checkpoint(no_bucket, models=saved, storage_options=quick)
        )
        assert isinstance(err, BucketNotFoundError) and "no-such-bucket-here" in str(err)

        err = _run_bounded(lambda: fastckpt.list_checkpoints(dead, storage_options=dead_options))
        assert isinstance(err, EndpointUnreachableError) and str(dead_port) in str(err)
        config = fastckpt.CheckpointManager.Config.with_sync_save()
        config.storage_config = fastckpt.LocalFileSystemStorageConfig(storage_options=dead_options)

        def manager_save() -> None:
            with fastckpt.CheckpointManager(config) as manager:
                manager.save(f"{dead}/ckpt", {"x": torch.ones(3)})

        err = _run_bounded(manager_save)
        assert isinstance(err, EndpointUnreachableError) and str(dead_port) in str(err)
    finally:
        for url in (bad_key, dead, no_bucket, f"{dead}/ckpt"):
            configure_storage(url)


def test_config_from_environment_and_credentials_file_overridable_per_call(
    s3_server: S3Server, s3_root: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # never probe instance metadata
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_access_key)
    checkpoint = f"{s3_root}-ids/ckpt"
    saved = {"main": torch.nn.Linear(2, 2)}
    try:
        # Everything from the environment.
        assert fastckpt.save_checkpoint(s3_root, models=saved) == 0
        with _sync_manager() as manager:
            manager.save(checkpoint, {"x": torch.arange(3.0)})

        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
        with pytest.raises(AccessDeniedError):
            fastckpt.list_checkpoints(s3_root, storage_options=QUICK_FAIL)
        fixed = {"secret_access_key": s3_server.secret_access_key, **QUICK_FAIL}
        # The call's options win over the environment (and stay registered for the prefix).
        assert [row["index"] for row in fastckpt.list_checkpoints(s3_root, storage_options=fixed)]
        configure_storage(s3_root)

        monkeypatch.delenv("AWS_ACCESS_KEY_ID")
        monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
        credentials = tmp_path / "credentials"
        credentials.write_text(
            f"[ckpt]\naws_access_key_id = {s3_server.access_key_id}\n"
            f"aws_secret_access_key = {s3_server.secret_access_key}\n"
        )
        monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
        monkeypatch.setenv("AWS_PROFILE", "ckpt")
        # Credentials from the profile.
        assert [row["index"] for row in fastckpt.list_checkpoints(s3_root)] == [0]
        with _sync_manager() as manager:
            assert torch.equal(manager.load(checkpoint)["x"], torch.arange(3.0))
    finally:
        configure_storage(s3_root)
    assert not (tmp_path / "s3:").exists()


@pytest.mark.parametrize("existing", [False, True], ids=["first-save", "replacement"])
def test_conditional_put_lets_one_of_two_manager_saves_of_an_id_commit(
    s3_server: S3Server, s3_root: str, monkeypatch: pytest.MonkeyPatch, existing: bool
) -> None:
    """Saver A uploads its generation; just before A's commit, saver B saves the same id and
    commits. A's conditional put (If-Match the record version A read, or If-None-Match when
    it read none) fails with CommitConflictError: B's checkpoint stands, whole, and A's
    generation is gone."""
    checkpoint = f"{s3_root}/ckpt"
    real = S3Backend.put_record
    raced: list[Path] = []

    def racing(self: S3Backend, path: Path, data: bytes) -> None:
        if not raced:
            raced.append(path)
            with _sync_manager() as other:  # B, through its own backend, commits first
                other.save(checkpoint, {"x": torch.full((1000,), 2.0), "step": 2})
        real(self, path, data)

    with _configured(s3_root, s3_server.options(**SMALL_PARTS, **QUICK_FAIL)):
        with _sync_manager() as manager:
            if existing:
                manager.save(checkpoint, {"x": torch.zeros(1000), "step": 0})
            monkeypatch.setattr(S3Backend, "put_record", racing)
            with pytest.raises(CommitConflictError, match="another writer"):
                manager.save(checkpoint, {"x": torch.ones(1000), "step": 1})
            monkeypatch.undo()
            assert raced and raced[0].name == "commit.json"
            loaded = manager.load(checkpoint)
        assert loaded["step"] == 2 and torch.equal(loaded["x"], torch.full((1000,), 2.0))
        assert fastckpt.verify(checkpoint).ok
        generation = read_commit_record(checkpoint)["generation"]
        assert _top_level(s3_server, checkpoint) == {"commit.json", generation}


def test_prune_withdraws_indices_from_the_manifest_before_deleting_their_objects(
    s3_server: S3Server, s3_root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``prune`` commits the manifest without the pruned indices first, then deletes their
    objects; a prune that dies in between leaves only objects no record names, which the
    next save removes."""
    root = f"{s3_root}/root"
    models = [_linear(float(step)) for step in range(5)]
    events: list[tuple[str, str]] = []
    real_put, real_delete = S3Backend.put_record, S3Backend.delete

    def put_record(self: S3Backend, path: Path, data: bytes) -> None:
        events.append(("commit", Path(path).name))
        real_put(self, path, data)

    def delete(self: S3Backend, path: Path) -> None:
        events.append(("delete", Path(path).name))
        real_delete(self, path)

    with _configured(s3_root, s3_server.options(**SMALL_PARTS)):
        for model in models[:4]:
            fastckpt.save_checkpoint(root, models={"main": model}, incremental=False)
        monkeypatch.setattr(S3Backend, "put_record", put_record)
        monkeypatch.setattr(S3Backend, "delete", delete)
        assert fastckpt.prune(root, keep_last=3) == [0]
        assert events == [("commit", "manifest.json"), ("delete", "0")]

        # Killed right after its commit (here: the first delete fails).
        def dies(self: S3Backend, path: Path) -> None:
            raise ObjectStoreError(f"{path}: the pruning process died here")

        monkeypatch.setattr(S3Backend, "delete", dies)
        with pytest.raises(ObjectStoreError, match="died here"):
            fastckpt.prune(root, keep_last=1)
        monkeypatch.undo()
        assert [row["index"] for row in fastckpt.list_checkpoints(root)] == [3]
        assert _top_level(s3_server, root) == {"manifest.json", "1", "2", "3"}
        assert _same(_loaded_model(root), models[3])
        # The next save removes what no record names.
        assert fastckpt.save_checkpoint(root, models={"main": models[4]}, incremental=False) == 4
        assert _top_level(s3_server, root) == {"manifest.json", "3", "4"}
        assert _same(_loaded_model(root, 3), models[3]) and _same(_loaded_model(root), models[4])
        assert fastckpt.verify(root).ok


def test_a_prefix_with_a_space_saves_lists_prunes_replaces_and_loads(
    s3_server: S3Server, s3_root: str
) -> None:
    """obstore writes a space in a listing's query as ``+`` while SigV4 signs ``%20``: moto
    refused every listing under such a prefix (SignatureDoesNotMatch reported as
    AccessDeniedError) so a second save, ``list_checkpoints`` and ``prune`` failed there.
    Those listings go through boto3."""
    base = f"{s3_root}/my run"
    root, checkpoint = f"{base}/root", f"{base}/ids/step 1"
    models = [_linear(float(step)) for step in range(3)]
    with _configured(s3_root, s3_server.options(**SMALL_PARTS)):
        for model in models:
            fastckpt.save_checkpoint(root, models={"main": model}, incremental=False)
        assert [row["index"] for row in fastckpt.list_checkpoints(root)] == [0, 1, 2]
        assert fastckpt.prune(root, keep_last=1) == [0, 1]
        assert _top_level(s3_server, root) == {"manifest.json", "2"}
        assert _same(_loaded_model(root), models[2])
        with _sync_manager() as manager:
            for value in (1.0, 2.0):
                manager.save(checkpoint, {"w": torch.full((3,), value)})
            assert torch.equal(manager.load(checkpoint)["w"], torch.full((3,), 2.0))
        # The replaced generation was removed: one generation prefix and the record.
        kept = _top_level(s3_server, checkpoint)
        assert len(kept) == 2 and "commit.json" in kept, kept
        assert fastckpt.verify(root).ok and fastckpt.verify(checkpoint).ok


@pytest.mark.parametrize("door", ["save_checkpoint", "manager"])
def test_server_stopped_mid_save_is_a_typed_error_and_earlier_checkpoints_survive(
    s3_server: S3Server, s3_root: str, door: str
) -> None:
    options = s3_server.options(**SMALL_PARTS, **QUICK_FAIL)
    url = f"{s3_root}/root" if door == "save_checkpoint" else f"{s3_root}/ids/ckpt"
    earlier = _linear(1.0)

    def save(model: torch.nn.Module) -> None:
        if door == "save_checkpoint":
            fastckpt.save_checkpoint(url, models={"main": model}, incremental=False)
        else:
            with _sync_manager() as manager:
                manager.save(url, {"main": model.state_dict()})

    def latest() -> dict[str, torch.Tensor]:
        if door == "save_checkpoint":
            return _loaded_model(url).state_dict()
        with _sync_manager() as manager:
            loaded: dict[str, torch.Tensor] = manager.load(url)["main"]
            return loaded

    with _configured(s3_root, options):
        save(earlier)
        big = torch.nn.Linear(4096, 4096)  # 64 MiB in 5 MiB parts
        watcher = S3Client(S3Url.parse(url), options)
        outcome: list[BaseException | None] = []

        def saver() -> None:
            try:
                save(big)
                outcome.append(None)
            except BaseException as err:
                outcome.append(err)

        thread = threading.Thread(target=saver)
        thread.start()
        deadline = time.monotonic() + 60
        while not watcher.pending_uploads(_key(url) + "/") and time.monotonic() < deadline:
            time.sleep(0.02)
        s3_server.stop()
        try:
            thread.join(60)
            assert not thread.is_alive(), "the save hung after the server went away"
        finally:
            s3_server.start()
        err = outcome[0]
        assert isinstance(err, EndpointUnreachableError), repr(err)
        assert url in str(err), str(err)
        loaded = latest()
        assert all(torch.equal(loaded[k], v) for k, v in earlier.state_dict().items())
        last = _linear(3.0)
        save(last)  # the next save cleans up what the failed one left
        loaded = latest()
        assert all(torch.equal(loaded[k], v) for k, v in last.state_dict().items())
        assert not _pending(s3_server, url)
        if door == "save_checkpoint":
            assert [row["index"] for row in fastckpt.list_checkpoints(url)] == [0, 1]
            assert _top_level(s3_server, url) == {"manifest.json", "0", "1"}
        else:
            generation = read_commit_record(url)["generation"]
            assert _top_level(s3_server, url) == {"commit.json", generation}
        assert fastckpt.verify(url).ok


# The guarantee that a saver SIGKILLed at any moment never breaks a committed checkpoint is
# pinned through both front doors by tests/test_s3_frontend.py
# (test_sigkilled_front_door_saves_to_s3_never_break_the_committed_checkpoints).


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
    assert set(document["writers"]) == {
        "save_checkpoint",
        "manager",
        "boto3",
        "boto3-profile",
        "s3fs",
    }
    assert document["server"].startswith("moto")
    stall = document["async_stall"]
    assert stall["local"]["stall_s"]["median"] > 0 and stall["s3"]["total_s"]["median"] > 0
    assert "stall ratio s3 / local disk" in (tmp_path / "s3-8mib.md").read_text()


def test_the_region_comes_from_aws_region_then_aws_default_region(
    no_aws_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``AWS_REGION`` (the AWS SDKs' variable, documented here) was ignored before: botocore
    reads only ``AWS_DEFAULT_REGION``, so a bucket elsewhere got us-east-1."""
    from fastckpt.storage.s3.config import S3Options

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")

    def region(**options: Any) -> str:
        return S3Options(**options).resolved("s3://bucket/run").region

    assert region() == "us-east-1"
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-west-2")
    assert region() == "us-west-2"
    monkeypatch.setenv("AWS_REGION", "eu-west-3")
    assert region() == "eu-west-3"
    assert region(region="ap-south-1") == "ap-south-1"
