"""Replacing a committed index of an ``s3://`` root (``checkpoint_index=k``) never loses the
old ``k``: the store copies its objects aside before they are rewritten in place, and a save
that fails or is killed before the new ``k`` is committed leaves the old one to be committed
again (by the failing save itself, or by the next save or prune of the root).

Before, the old objects were deleted and rewritten in place after ``k`` left the manifest: a
crash in between lost the old ``k`` for good."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fastckpt
from fastckpt.storage.registry import configure_storage
from fastckpt.storage.s3.backend import S3Staging
from s3_support import S3Server, s3_env, s3_root, s3_server

__all__ = ["s3_env", "s3_root", "s3_server"]  # fixtures used by name below

LEASE_TTL_S = 2.0


def _save(root: str, value: float, index: int = -1) -> int:
    model = torch.nn.Linear(64, 64)
    with torch.no_grad():
        for tensor in model.parameters():
            tensor.fill_(value)
    return fastckpt.save_checkpoint(
        root, models={"main": (model, None)}, checkpoint_index=index, incremental=False
    )


def _value(root: str, index: int) -> float:
    loaded = fastckpt.load_checkpoint(root, index)["models"]["main"]["model"]
    values = {float(t.flatten()[0]) for t in loaded.state_dict().values()}
    assert len(values) == 1 and all(
        torch.equal(t, torch.full_like(t, next(iter(values)))) for t in loaded.state_dict().values()
    )
    return values.pop()


def _top_level(server: S3Server, root: str) -> set[str]:
    prefix = root.split("/", 3)[3] + "/"
    listed = server.client().list_objects_v2(Bucket=server.bucket, Prefix=prefix)
    return {item["Key"][len(prefix) :].split("/")[0] for item in listed.get("Contents", [])}


KILLED_REPLACEMENT = """
import os, signal, sys, torch
import fastckpt
from fastckpt.container import commit
from fastckpt.storage.registry import configure_storage
from fastckpt.storage.s3 import backend
from test_s3_replace import LEASE_TTL_S, _save
root, point, endpoint_options = sys.argv[1], sys.argv[2], sys.argv[3:]
configure_storage(root, {"lease_ttl_s": LEASE_TTL_S})

def die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)

if point == "copied":  # the old objects copied aside, nothing withdrawn yet
    put_bytes = backend.S3Staging.put_bytes
    def record(self, relpath, data):
        if relpath == commit.REPLACED_MANIFEST:
            die()
        return put_bytes(self, relpath, data)
    backend.S3Staging.put_bytes = record
elif point == "withdrawn":  # withdrawn, the old objects deleted, the first new one due
    backend.S3Staging.put_tensors = die
else:  # "written": every new object written, the manifest commit due
    commit.IndexWriter.commit_entry = die
_save(root, 2.0, 1)
"""


@pytest.mark.parametrize("point", ["copied", "withdrawn", "written"])
def test_a_replacement_killed_before_its_commit_leaves_the_old_index_to_the_next_save(
    s3_root: str, s3_env: dict[str, str], point: str, caplog: pytest.LogCaptureFixture
) -> None:
    configure_storage(s3_root, {"lease_ttl_s": LEASE_TTL_S})
    assert _save(s3_root, 0.0) == 0 and _save(s3_root, 1.0) == 1
    env = {**os.environ, **s3_env, "PYTHONPATH": str(Path(__file__).parent)}
    child = subprocess.run(
        [sys.executable, "-c", KILLED_REPLACEMENT, s3_root, point],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr
    listed = [row["index"] for row in fastckpt.list_checkpoints(s3_root)]
    assert listed == ([0, 1] if point == "copied" else [0])  # withdrawn until the next writer
    with caplog.at_level(logging.WARNING, logger="fastckpt.container.commit"):
        assert _save(s3_root, 3.0) == 2  # the next save (after the killed one's lease expired)
    assert [row["index"] for row in fastckpt.list_checkpoints(s3_root)] == [0, 1, 2]
    assert [_value(s3_root, i) for i in (0, 1, 2)] == [0.0, 1.0, 3.0]  # before: 1 lost
    restored = "the old index 1 is committed again" in caplog.text
    assert restored == (point != "copied")
    assert fastckpt.verify(s3_root).ok
    assert not [name for name in _top_level_names(s3_root) if name.startswith(".trash-")]


def _top_level_names(root: str) -> list[str]:
    from fastckpt.storage.registry import backend_for

    return backend_for(Path(root)).list_dir(Path(root))


def test_a_replacement_that_fails_puts_the_old_index_back_at_once(
    s3_root: str, s3_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert _save(s3_root, 0.0) == 0 and _save(s3_root, 1.0) == 1

    def failing(*args: object, **kwargs: object) -> object:
        raise OSError("the upload failed")

    with monkeypatch.context() as patched, pytest.raises(OSError, match="the upload failed"):
        patched.setattr(S3Staging, "put_tensors", failing)
        _save(s3_root, 2.0, 1)
    # Committed again by the failing save itself: no other writer needed.
    assert [row["index"] for row in fastckpt.list_checkpoints(s3_root)] == [0, 1]
    assert _value(s3_root, 1) == 1.0
    assert not [name for name in _top_level_names(s3_root) if name.startswith(".trash-")]
    # A replacement that succeeds keeps no copy either.
    assert _save(s3_root, 2.0, 1) == 1 and _value(s3_root, 1) == 2.0
    assert not [name for name in _top_level_names(s3_root) if name.startswith(".trash-")]
    assert fastckpt.verify(s3_root).ok


def test_a_replacement_failing_at_its_commit_puts_the_old_index_back_under_the_lock(
    s3_root: str, s3_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure inside the commit (here the check that every object is stored, an object
    the store lost) put the old index back only after the root's lock was released, where
    another writer may have been replacing it meanwhile (a review finding); now before."""
    from fastckpt.container import commit

    assert _save(s3_root, 0.0) == 0 and _save(s3_root, 1.0) == 1
    real_put = S3Staging.put_tensors
    held: list[bool] = []
    real_restore = commit._restore_object_index

    def lost(self: S3Staging, relpath: str, *args: object, **kwargs: object) -> object:
        record = real_put(self, relpath, *args, **kwargs)  # type: ignore[arg-type]
        self.backend.client.delete([self.url.key(relpath)])
        return record

    def restore(root: Path, backend: object, index: int, aside: Path) -> None:
        held.append(_lease_held(root))
        real_restore(root, backend, index, aside)  # type: ignore[arg-type]

    with monkeypatch.context() as patched:
        patched.setattr(S3Staging, "put_tensors", lost)
        patched.setattr(commit, "_restore_object_index", restore)
        with pytest.raises(FileNotFoundError, match="missing after the store acknowledged"):
            _save(s3_root, 2.0, 1)
    assert held == [True]  # put back once, while this process held the root's lease
    assert [row["index"] for row in fastckpt.list_checkpoints(s3_root)] == [0, 1]
    assert _value(s3_root, 1) == 1.0
    assert fastckpt.verify(s3_root).ok


def _lease_held(root: Path) -> bool:
    from fastckpt.storage.s3.backend import held_lease
    from fastckpt.storage.s3.config import S3Url

    url = S3Url.parse(str(root))
    client = fastckpt.storage.registry.backend_for(root).client  # type: ignore[attr-defined]
    return held_lease(client, url.key("manifest.json")) is not None


def test_a_put_back_whose_reads_fail_keeps_the_copy_for_the_next_save(
    s3_root: str, s3_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The verification of the put-back index failing (here: reported unreadable, as a store
    not answering makes it) never deletes the copy (a review found it deleted, the old index
    lost for good): the next save puts the index back."""
    from fastckpt.container import commit

    assert _save(s3_root, 0.0) == 0 and _save(s3_root, 1.0) == 1

    def failing(*args: object, **kwargs: object) -> object:
        raise OSError("the upload failed")

    with monkeypatch.context() as patched, pytest.raises(OSError, match="the upload failed"):
        patched.setattr(S3Staging, "put_tensors", failing)
        patched.setattr(commit, "index_intact", lambda *a, **k: "cannot be read (timed out)")
        _save(s3_root, 2.0, 1)
    assert [row["index"] for row in fastckpt.list_checkpoints(s3_root)] == [0]  # withdrawn
    assert [name for name in _top_level_names(s3_root) if name.startswith(".trash-1.")]
    assert _save(s3_root, 3.0) == 2  # the next save puts it back first
    assert [_value(s3_root, i) for i in (0, 1, 2)] == [0.0, 1.0, 3.0]
    assert not [name for name in _top_level_names(s3_root) if name.startswith(".trash-")]


def test_an_index_missing_an_object_is_replaced_without_a_copy(
    s3_server: S3Server, s3_root: str, s3_env: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    """Saving a damaged index again is how it is repaired: an object of it already missing
    (or of another size) cannot be copied aside, so it is replaced in place, with a warning
    (before this check, the copy failed and no save of that index could be made)."""
    assert _save(s3_root, 0.0) == 0 and _save(s3_root, 1.0) == 1
    prefix = s3_root.split("/", 3)[3]
    server_client = s3_server.client()
    server_client.delete_object(Bucket=s3_server.bucket, Key=f"{prefix}/1/models/main.safetensors")
    with caplog.at_level(logging.WARNING, logger="fastckpt.container.commit"):
        assert _save(s3_root, 2.0, 1) == 1
    assert "is missing, so index 1 is replaced in place without a copy kept" in caplog.text
    assert _value(s3_root, 1) == 2.0 and fastckpt.verify(s3_root).ok
