"""The object-store StorageBackend (fastckpt.storage.s3.backend) against a real moto server."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from fastckpt import _native
from fastckpt.errors import CheckpointFormatError, ChecksumMismatchError
from fastckpt.storage.s3.backend import (
    S3Backend,
    S3RootLock,
    backend_for_url,
    register_storage_options,
)
from fastckpt.storage.s3.client import S3Client
from fastckpt.storage.s3.config import S3Url
from fastckpt.storage.s3.errors import CommitConflictError, ObjectNotFoundError, ObjectStoreError
from s3_support import S3Server, s3_root, s3_server

__all__ = ["s3_root", "s3_server"]  # fixtures used by name below

PARTS = {"part_size": 5 << 20, "read_part_size": 4 << 20, "concurrency": 4}


def _backend(server: S3Server, url: str) -> S3Backend:
    return S3Backend(S3Client(S3Url.parse(url), server.options(**PARTS)))


def test_staged_files_records_and_directories(s3_server: S3Server, s3_root: str) -> None:
    backend = _backend(s3_server, s3_root)
    final = Path(f"{s3_root}/3")  # the pathlib spelling (s3:/bucket/...) is accepted
    staging = backend.stage(final)
    tensors = {"w": torch.randn(1024, 1536), "b": torch.arange(3, dtype=torch.int16)}
    record = staging.put_tensors("models/main.safetensors", tensors)
    small = staging.put_bytes("models/main.spec.json", b'{"a": 1}')
    staging.publish()
    assert small == {"size": 8, "crc32c": _native.crc32c(b'{"a": 1}')}
    assert set(staging.files) == {"models/main.safetensors", "models/main.spec.json"}
    backend.put_record(Path(f"{s3_root}/manifest.json"), b"{}")

    path = final / "models" / "main.safetensors"
    assert backend.stat(path).size == record["size"] and backend.stat(path).regular
    assert not backend.stat(final / "models").regular and backend.exists(final)
    assert backend.list_dir(Path(s3_root)) == ["3", "manifest.json"]
    assert backend.list_dir(final / "models") == ["main.safetensors", "main.spec.json"]
    assert backend.checksum(path) == (record["size"], record["crc32c"])
    assert backend.verify_tensors(path, 2) == (record["crc32c"], [])
    loaded, info = backend.open_tensors(path)
    assert info["file_crc32c"] == record["crc32c"]
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())
    assert backend.read_range(path, 0, 8) == backend.read_bytes(path)[:8]

    backend.delete(final)
    assert not backend.exists(final) and backend.list_dir(Path(s3_root)) == ["manifest.json"]
    with pytest.raises(ObjectNotFoundError, match=r"main\.safetensors"):
        backend.open_tensors(path)


def test_deleting_one_object_deletes_it_and_only_it(s3_server: S3Server, s3_root: str) -> None:
    """Before, ``delete`` of one object's path deleted nothing (its listing covered the
    ``key/`` folder only): a manager checkpoint removed from an object store lost its files
    before its commit record, and the record of an unsharded checkpoint a sharded save
    replaced stayed, naming deleted files."""
    backend = _backend(s3_server, s3_root)
    checkpoint = Path(f"{s3_root}/ckpt")
    staging = backend.stage(checkpoint)
    staging.put_bytes("a.bin", b"1")
    staging.put_bytes("commit.json.d/x", b"2")  # a folder whose name starts with the key's
    staging.publish()
    backend.put_record(checkpoint / "commit.json", b"{}")
    backend.delete(checkpoint / "commit.json")
    assert not backend.exists(checkpoint / "commit.json")
    assert backend.list_dir(checkpoint) == ["a.bin", "commit.json.d"]
    backend.delete(checkpoint / "missing.json")  # nothing there is fine
    backend.delete(checkpoint)
    assert not backend.exists(checkpoint)


def test_a_prefix_is_a_directory_asked_by_one_listing_without_a_head(
    s3_server: S3Server, s3_root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # s3s-fs answers a HEAD of a key that names a folder with HTTP 500 (retried three times),
    # which made retention's check of an incremental index on an s3:// tier fail there.
    backend = _backend(s3_server, s3_root)
    staging = backend.stage(Path(f"{s3_root}/2"))
    staging.put_bytes("models/main.spec.json", b"{}")
    staging.publish()

    def no_head(key: str) -> None:
        raise AssertionError(f"HEAD {key}")

    monkeypatch.setattr(backend.client, "head", no_head)
    assert backend.is_directory(Path(f"{s3_root}/2"))
    assert backend.is_directory(Path(f"{s3_root}/2/models"))
    assert not backend.is_directory(Path(f"{s3_root}/2/models/main.spec.json"))  # an object
    assert not backend.is_directory(Path(f"{s3_root}/3"))
    assert not backend.is_directory(Path(f"{s3_root}/2/model"))  # a prefix of a name only

    def head_fails(key: str) -> None:
        raise ObjectStoreError(f"{key}: HTTP 500")

    monkeypatch.setattr(backend.client, "head", head_fails)
    assert not backend.stat(Path(f"{s3_root}/2")).regular  # a folder, though HEAD failed
    with pytest.raises(ObjectStoreError, match="HTTP 500"):
        backend.stat(Path(f"{s3_root}/3"))  # nothing there: the HEAD's error stands


def test_the_written_header_is_the_stored_one_without_reading_it_back(
    s3_server: S3Server, s3_root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sharded rank learns its uploaded object's header (data offsets for the commit record)
    from the bytes it sent: the same header a read-back gives, and no GET is sent for it."""
    backend = _backend(s3_server, s3_root)
    staging = backend.stage(Path(f"{s3_root}/g"))
    tensors = {"w": torch.randn(1024, 1536), "b": torch.arange(3, dtype=torch.int16)}
    staging.put_tensors("rank-00000.safetensors", tensors, metadata={"k": "v"})
    gets: list[str] = []
    real_get_range = S3Client.get_range

    def counted(
        self: S3Client, key: str, start: int, end: int, if_match: str | None = None
    ) -> bytes:
        gets.append(key)
        return real_get_range(self, key, start, end, if_match)

    monkeypatch.setattr(S3Client, "get_range", counted)
    written = staging.written_header("rank-00000.safetensors")
    assert gets == []
    assert written == backend.read_header(Path(f"{s3_root}/g/rank-00000.safetensors"))
    assert gets  # the read-back did send requests: the count above is real
    assert written["metadata"]["k"] == "v" and set(written["tensors"]) == {"w", "b"}
    with pytest.raises(KeyError):
        staging.written_header("never-put.safetensors")


def test_corrupt_object_fails_verification(s3_server: S3Server, s3_root: str) -> None:
    backend = _backend(s3_server, s3_root)
    staging = backend.stage(Path(s3_root))
    staging.put_tensors("x.safetensors", {"x": torch.arange(1000.0)})
    key = S3Url.parse(s3_root).key("x.safetensors")
    client = s3_server.client()
    data = bytearray(client.get_object(Bucket=s3_server.bucket, Key=key)["Body"].read())
    data[-1] ^= 0x10
    client.put_object(Bucket=s3_server.bucket, Key=key, Body=bytes(data))
    with pytest.raises(ChecksumMismatchError, match="x"):
        backend.verify_tensors(Path(f"{s3_root}/x.safetensors"), 2)


def test_put_record_is_conditional_on_the_version_read(s3_server: S3Server, s3_root: str) -> None:
    record = Path(f"{s3_root}/manifest.json")
    first, second = _backend(s3_server, s3_root), _backend(s3_server, s3_root)
    for backend in (first, second):
        with pytest.raises(ObjectNotFoundError):
            backend.read_bytes(record)  # both see no record yet
    first.put_record(record, b"v1")
    with pytest.raises(CommitConflictError, match="another writer"):
        second.put_record(record, b"v1-from-second")  # it would create, but one exists
    assert second.read_bytes(record) == b"v1"
    second.put_record(record, b"v2")
    with pytest.raises(CommitConflictError):
        first.put_record(record, b"v2-from-first")  # first last saw v1
    assert first.read_bytes(record) == b"v2"
    first.put_record(record, b"v3")
    assert second.read_bytes(record) == b"v3"


def test_registered_options_reach_paths_opened_without_options(
    s3_server: S3Server, s3_root: str
) -> None:
    register_storage_options(s3_root, s3_server.options(**PARTS))
    try:
        backend = backend_for_url(Path(f"{s3_root}/sub/manifest.json"))
        backend.put_record(Path(f"{s3_root}/sub/manifest.json"), b"{}")
        assert backend.client.options.part_size == PARTS["part_size"]
        assert backend.list_dir(Path(f"{s3_root}/sub")) == ["manifest.json"]
    finally:
        register_storage_options(s3_root, None)


def test_lease_lock_excludes_and_is_taken_over_after_its_holder_is_killed(
    s3_server: S3Server, s3_root: str
) -> None:
    client = S3Client(S3Url.parse(s3_root), s3_server.options())
    first = S3RootLock(client, S3Url.parse(s3_root), ttl_s=3)
    second = S3RootLock(client, S3Url.parse(s3_root), timeout=1, ttl_s=3)
    # Another thread holds it (on this thread, a second acquire is ConcurrentSaveError).
    with _held_on_another_thread(first), pytest.raises(TimeoutError, match=r"\.fastckpt\.lock"):
        second.acquire()
    with second:  # released: free again
        assert second.held
    assert not second.held

    # A holder killed with SIGKILL stops renewing; its lease is taken over after expiry.
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                f"""
                import sys, time
                from fastckpt.storage.s3.client import S3Client
                from fastckpt.storage.s3.backend import S3RootLock
                from fastckpt.storage.s3.config import S3Url
                url = S3Url.parse({s3_root!r})
                lock = S3RootLock(S3Client(url, {s3_server.options()!r}), url, ttl_s=2)
                lock.acquire()
                print("held", flush=True)
                time.sleep(600)
                """
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        blocked = S3RootLock(client, S3Url.parse(s3_root), timeout=0.5)
        with pytest.raises(TimeoutError):
            blocked.acquire()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    taker = S3RootLock(client, S3Url.parse(s3_root), timeout=60)
    taker.acquire()
    lease = json.loads(client.get(S3Url.parse(s3_root).key(".fastckpt.lock"), limit=1 << 16)[0])
    assert lease["owner"] == taker.owner
    taker.release()


def test_a_lease_that_would_never_expire_is_refused_and_a_wait_names_the_expiry(
    s3_server: S3Server, s3_root: str
) -> None:
    """A lease recording a non-finite expiry (written by a version that accepted
    ``lease_ttl_s=nan``, or by hand) held every later writer until its timeout, forever
    without one: it is refused as not a fastckpt lease, naming the object. A writer that
    times out behind a live holder says when that holder's lease expires."""
    url = S3Url.parse(s3_root)
    client = S3Client(url, s3_server.options())
    key = url.key(".fastckpt.lock")
    client.put(key, b'{"owner": "gone:1:x", "expires": NaN}')
    with pytest.raises(CheckpointFormatError, match=r"\.fastckpt\.lock: not a fastckpt lease"):
        S3RootLock(client, url, timeout=5, ttl_s=3).acquire()
    client.delete([key])
    expires = r"its lease expires in (29|30)\.\d s unless"
    holder = S3RootLock(client, url, ttl_s=30)
    with _held_on_another_thread(holder), pytest.raises(TimeoutError, match=expires):
        S3RootLock(client, url, timeout=0.3, ttl_s=3).acquire()


@contextlib.contextmanager
def _held_on_another_thread(lock: S3RootLock) -> Iterator[None]:
    """``lock`` acquired on another thread (as another writer holds it), released after."""
    taker = threading.Thread(target=lock.acquire)
    taker.start()
    taker.join()
    assert lock.held
    try:
        yield
    finally:
        lock.release()


def test_require_local_refuses_an_s3_url_with_a_typed_error_naming_it() -> None:
    from fastckpt.storage.registry import require_local
    from fastckpt.storage.s3.errors import UnsupportedOnObjectStoreError

    require_local("/tmp/ckpt", "fastckpt.dcp.Writer", "use a shared filesystem")
    with pytest.raises(UnsupportedOnObjectStoreError, match=r"s3://b/run: fastckpt\.dcp\.Writer"):
        require_local(Path("s3://b/run"), "fastckpt.dcp.Writer", "use a shared filesystem")


_FORKED = """
import os, sys, time, torch, fastckpt
from fastckpt.storage.s3.errors import ForkedAfterUseError
root, used = sys.argv[1], sys.argv[2] == "used"
if used:
    fastckpt.save_checkpoint(root + "/parent", {"m": (torch.nn.Linear(2, 2), None)})
pid = os.fork()
if pid == 0:
    started = time.monotonic()
    try:
        fastckpt.save_checkpoint(root + "/child", {"m": (torch.nn.Linear(2, 2), None)})
        print("saved", flush=True)
    except ForkedAfterUseError as err:
        print("refused", round(time.monotonic() - started), err, flush=True)
    os._exit(0)
os.waitpid(pid, 0)
"""


@pytest.mark.parametrize("used", ["used", "unused"])
def test_a_process_forked_after_s3_requests_is_refused_not_hung(
    s3_server: S3Server, s3_root: str, tmp_path: Path, used: str
) -> None:
    """obstore's runtime (its threads) does not survive a fork: a child forked after its
    parent made object-store requests waited forever on its first one. It gets
    ``ForkedAfterUseError`` naming the fix (spawn / forkserver) at once instead; a child forked
    before any request saves normally."""
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("AWS_")},
        **s3_server.aws_env(),
    }
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", _FORKED, s3_root, used],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    if used == "used":
        assert done.stdout.startswith("refused 0 "), done.stdout + done.stderr
        assert "'spawn' or 'forkserver'" in done.stdout
    else:
        assert done.stdout.strip() == "saved", done.stdout + done.stderr
