"""Writers of an ``s3://`` root and their lease: a writer paused past its lease commits
nothing over the next writer's save, a failed save never leaves a lease that delays the next
one, and a server that accepts connections but never answers is a typed error within the
timeouts. Real processes (SIGSTOP / SIGCONT), the real moto server of ``tests/s3_support.py``
(stopped and started), and a real socket that never answers."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import fastckpt
from fastckpt.container import commit
from fastckpt.container.verify import verify
from fastckpt.format.records import Manifest
from fastckpt.storage.registry import configure_storage
from fastckpt.storage.s3.backend import S3Staging
from fastckpt.storage.s3.config import S3Options
from fastckpt.storage.s3.errors import (
    CommitConflictError,
    EndpointUnreachableError,
    LeaseLostError,
)
from s3_support import REGION, S3Server, no_aws_env, s3_root, s3_server

__all__ = ["no_aws_env", "s3_root", "s3_server"]  # fixtures used by name below

#: A short lease, so that a test can outlast it.
LEASE_TTL_S = 2.0

WRITER_A = r"""
import json, os, signal, sys
import torch
import fastckpt
from fastckpt.container import commit
from fastckpt.storage.s3 import backend as s3backend
from fastckpt.storage.registry import configure_storage

url, options, moment = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
configure_storage(url, options)

def pause_once(original):
    state = {"paused": False}
    def paused(*args, **kwargs):
        if not state["paused"]:
            state["paused"] = True
            print("paused", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)  # the parent SIGCONTs us past the lease
        return original(*args, **kwargs)
    return paused

if moment == "before_commit":
    commit.IndexWriter.commit_entry = pause_once(commit.IndexWriter.commit_entry)
else:
    s3backend.S3Staging.put_tensors = pause_once(s3backend.S3Staging.put_tensors)
model = torch.nn.Linear(256, 256)
with torch.no_grad():
    model.weight.fill_(1.0)
    model.bias.fill_(1.0)
try:
    index = fastckpt.save_checkpoint(url, models={"main": model})
    print("saved", index, flush=True)
except Exception as err:
    print("failed", type(err).__name__, str(err).replace("\n", " "), flush=True)
"""


def _model(value: float) -> torch.nn.Linear:
    model = torch.nn.Linear(256, 256)
    with torch.no_grad():
        model.weight.fill_(value)
        model.bias.fill_(value)
    return model


def _line(process: subprocess.Popen[str], timeout: float) -> str:
    assert process.stdout is not None
    ready, _, _ = select.select([process.stdout], [], [], timeout)
    assert ready, f"no output from the writer within {timeout} s"
    return process.stdout.readline().strip()


def _stopped(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] == "T"


def _assert_loads(root: str, index: int, model: torch.nn.Linear) -> None:
    loaded = fastckpt.load_checkpoint(root, index)["models"]["main"]["model"]
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), (index, name)


@pytest.fixture
def configured(s3_server: S3Server, s3_root: str) -> Iterator[dict[str, Any]]:
    """``s3_root`` configured with the server's options and a short lease."""
    options = s3_server.options(lease_ttl_s=LEASE_TTL_S)
    configure_storage(s3_root, options)
    yield options
    configure_storage(s3_root)


@pytest.mark.parametrize("moment", ["before_commit", "before_upload"])
def test_a_writer_paused_past_its_lease_commits_nothing_over_the_next_writers_save(
    s3_server: S3Server, s3_root: str, configured: dict[str, Any], moment: str
) -> None:
    """Writer A (a real process) is SIGSTOPped inside its save (before its manifest commit,
    or before its upload); its lease expires; writer B saves and is acknowledged; A is
    SIGCONTed: it fails with LeaseLostError, commits nothing, deletes nothing, and B's index
    loads bitwise and verifies. (Before the fix A's commit re-read the manifest and replaced
    it: B's index then named A's checksums over B's objects.)"""
    first = _model(0.0)
    assert fastckpt.save_checkpoint(s3_root, models={"main": first}) == 0
    writer_a = subprocess.Popen(
        [sys.executable, "-c", WRITER_A, s3_root, json.dumps(configured), moment],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert _line(writer_a, 120) == "paused"
        deadline = time.monotonic() + 30
        while not _stopped(writer_a.pid):
            assert time.monotonic() < deadline, "writer A did not stop"
            time.sleep(0.01)
        time.sleep(LEASE_TTL_S + 1.5)  # A's lease expires unrenewed
        second = _model(2.0)
        assert fastckpt.save_checkpoint(s3_root, models={"main": second}) == 1  # acknowledged
    finally:
        os.kill(writer_a.pid, signal.SIGCONT)
    outcome = _line(writer_a, 120)
    writer_a.wait(60)
    assert outcome.startswith("failed LeaseLostError"), outcome
    assert "lost its lease" in outcome and ".fastckpt.lock" in outcome, outcome
    assert sorted(Manifest.load(s3_root).entries) == [0, 1]
    report = verify(s3_root)
    assert report.ok, report.summary()
    _assert_loads(s3_root, 0, first)
    _assert_loads(s3_root, 1, second)
    # and the root goes on: A left no lease behind that blocks it (checked as an object, not
    # a wall-clock bound: a save on a busy machine may well take the lease's 2 s)
    prefix = s3_root.removeprefix(f"s3://{s3_server.bucket}/")
    listed = s3_server.client().list_objects_v2(Bucket=s3_server.bucket, Prefix=prefix)
    keys = [item["Key"] for item in listed.get("Contents", [])]
    assert f"{prefix}/.fastckpt.lock" not in keys, keys
    third = _model(3.0)
    assert fastckpt.save_checkpoint(s3_root, models={"main": third}) == 2
    _assert_loads(s3_root, 2, third)


def test_the_manifest_put_is_conditioned_on_the_version_first_read_under_the_lease(
    s3_server: S3Server, s3_root: str, configured: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The manifest is replaced behind a writer's back while it holds its lease (an operator
    restores an older ``manifest.json`` with a plain S3 client, which takes no lease): the
    lease still holds, so its renewal right before the commit succeeds, and only the
    condition on the version the writer first read under the lease stops it. The save fails
    with CommitConflictError (not LeaseLostError), commits nothing, and the restored
    manifest stays as it was put. (Added in round 20: the test above failed A through its
    lease renewal alone, so a commit conditioned on a fresh re-read of the manifest still
    passed it; such a commit here replaced the restored manifest by its own, naming
    indices 0, 1 and 2.)"""
    bucket, key = s3_server.bucket, s3_root.removeprefix(f"s3://{s3_server.bucket}/")
    raw = s3_server.client()
    first = _model(0.0)
    assert fastckpt.save_checkpoint(s3_root, models={"main": first}) == 0
    backup = raw.get_object(Bucket=bucket, Key=f"{key}/manifest.json")["Body"].read()
    assert fastckpt.save_checkpoint(s3_root, models={"main": _model(1.0)}) == 1
    real = commit.IndexWriter.commit_entry

    def restored_meanwhile(self: commit.IndexWriter, entry: dict[str, Any]) -> None:
        raw.put_object(Bucket=bucket, Key=f"{key}/manifest.json", Body=backup)
        real(self, entry)

    monkeypatch.setattr(commit.IndexWriter, "commit_entry", restored_meanwhile)
    with pytest.raises(CommitConflictError) as info:
        fastckpt.save_checkpoint(s3_root, models={"main": _model(2.0)})
    assert not isinstance(info.value, LeaseLostError), info.value
    assert f"{s3_root}/manifest.json" in str(info.value), info.value
    monkeypatch.undo()
    assert raw.get_object(Bucket=bucket, Key=f"{key}/manifest.json")["Body"].read() == backup
    assert sorted(Manifest.load(s3_root).entries) == [0]
    _assert_loads(s3_root, 0, first)
    report = verify(s3_root)
    assert report.ok, report.summary()


def test_a_save_failed_by_an_outage_leaves_no_lease_that_delays_the_next_one(
    s3_server: S3Server, s3_root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server goes down once the save holds its lease (its first upload): the save fails
    typed, its lease cannot be deleted. After the server is back, the next save of the same
    process takes its own abandoned lease over at once instead of waiting for it to expire
    (30 s by default; before the fix it waited ~28 s)."""
    options = s3_server.options(max_retries=1, retry_timeout_s=2.0, connect_timeout_s=2.0)
    configure_storage(s3_root, options)
    try:
        assert fastckpt.save_checkpoint(s3_root, models={"main": _model(0.0)}) == 0
        real = S3Staging.put_tensors

        def outage(self: S3Staging, *args: Any, **kwargs: Any) -> Any:
            s3_server.stop()
            return real(self, *args, **kwargs)

        monkeypatch.setattr(S3Staging, "put_tensors", outage)
        began = time.monotonic()
        try:
            with pytest.raises(EndpointUnreachableError, match=s3_root):
                fastckpt.save_checkpoint(s3_root, models={"main": _model(1.0)})
        finally:
            monkeypatch.undo()
            s3_server.start()
        assert time.monotonic() - began < 30
        model = _model(2.0)
        began = time.monotonic()
        assert fastckpt.save_checkpoint(s3_root, models={"main": model}) == 1
        assert time.monotonic() - began < 10, "the next save waited for a stale lease"
        _assert_loads(s3_root, 1, model)
        report = verify(s3_root)
        assert report.ok, report.summary()
    finally:
        configure_storage(s3_root)


class SilentServer:
    """A TCP server on 127.0.0.1 that accepts every connection and never answers."""

    def __init__(self) -> None:
        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", 0))
        self.socket.listen(128)
        self.held: list[socket.socket] = []
        self.endpoint = f"http://127.0.0.1:{self.socket.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self.socket.accept()
            except OSError:
                return
            self.held.append(connection)

    def close(self) -> None:
        for connection in self.held:
            connection.close()
        self.socket.close()


def _timed_save(url: str, options: dict[str, Any], limit: float) -> tuple[BaseException, float]:
    """Save into ``url`` on a thread; the error it raised and the seconds it took."""
    outcome: list[BaseException] = []

    def save() -> None:
        try:
            fastckpt.save_checkpoint(url, models={"main": _model(1.0)}, storage_options=options)
        except BaseException as err:
            outcome.append(err)

    began = time.monotonic()
    worker = threading.Thread(target=save, daemon=True)
    worker.start()
    worker.join(limit)
    assert not worker.is_alive(), f"the save still hangs after {limit} s"
    assert outcome, "the save against a silent server succeeded"
    return outcome[0], time.monotonic() - began


def test_a_server_that_accepts_and_never_answers_is_a_typed_error_within_the_timeouts(
    no_aws_env: None,
) -> None:
    server = SilentServer()
    url = "s3://silent-bucket/run"
    options: dict[str, Any] = {
        "endpoint_url": server.endpoint,
        "region": REGION,
        "access_key_id": "key",
        "secret_access_key": "secret",
    }
    try:
        quick = {**options, "read_timeout_s": 1.0, "retry_timeout_s": 2.0}
        err, seconds = _timed_save(url, quick, 30)
        assert isinstance(err, EndpointUnreachableError), repr(err)
        assert url in str(err) and "read_timeout_s" in str(err)
        assert seconds < 1.0 + 2.0 + 3.0, seconds
        # The defaults: seconds, not the 120 s of a whole-part request timeout.
        defaults = S3Options()
        assert defaults.read_timeout_s <= 10 and defaults.connect_timeout_s <= 10
        bound = defaults.read_timeout_s + defaults.retry_timeout_s + 5.0
        err, seconds = _timed_save(url, options, 60)
        assert isinstance(err, EndpointUnreachableError), repr(err)
        assert seconds < bound, seconds
    finally:
        configure_storage(url)
        server.close()
