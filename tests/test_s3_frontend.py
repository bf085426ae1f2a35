"""``s3://`` through the public front doors: save_checkpoint / load_checkpoint /
list_checkpoints / prune, verify, CheckpointManager (sync, async, ``load(into=)``, replacement),
TrainingStrategy + CheckpointHook exact resume, and the CLI, against a real moto server.

``s3://`` paths reach :mod:`fastckpt.storage.s3.backend` through
:func:`fastckpt.storage.registry.backend_for`. Every test runs in a temporary working directory,
so a path that still went to the local filesystem could not write into the repository.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import fastckpt
import training_support as ts
from fastckpt.container.verify import verify
from fastckpt.errors import ChecksumMismatchError
from fastckpt.format.records import Manifest, read_commit_record
from fastckpt.io.files import load_file
from fastckpt.storage.registry import backend_for, configure_storage
from fastckpt.storage.s3.errors import AccessDeniedError
from s3_support import (
    FROZEN_WEIGHT,
    S3Server,
    SaverFactory,
    front_door_model,
    front_door_tensor,
    no_aws_env,
    s3_env,
    s3_root,
    s3_server,
)

__all__ = ["no_aws_env", "s3_env", "s3_root", "s3_server"]  # fixtures used by name below


def _keys(server: S3Server, url: str) -> list[str]:
    prefix = url.split("/", 3)[3] + "/"
    listing = server.client().list_objects_v2(Bucket=server.bucket, Prefix=prefix)
    return sorted(item["Key"][len(prefix) :] for item in listing.get("Contents", []))


def test_save_load_list_prune_and_verify_a_root_on_s3(
    s3_server: S3Server, s3_root: str, s3_env: dict[str, str]
) -> None:
    model = torch.nn.Linear(64, 32)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(3, 64)).sum().backward()
    optimizer.step()
    models, optimizers = {"main": model}, {"adam": optimizer}
    assert fastckpt.save_checkpoint(s3_root, models=models, optimizers=optimizers) == 0
    assert fastckpt.save_checkpoint(s3_root, models=models, optimizers=optimizers) == 1
    assert "manifest.json" in _keys(s3_server, s3_root)  # on the server, not on local disk
    assert [c["index"] for c in fastckpt.list_checkpoints(s3_root)] == [0, 1]
    loaded = fastckpt.load_checkpoint(s3_root)["models"]["main"]
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded["model"].state_dict()[name], tensor)
    assert fastckpt.prune(s3_root, keep_last=1) == [0]
    assert not any(key.startswith("0/") for key in _keys(s3_server, s3_root))
    assert verify(s3_root).ok


def test_checkpoint_manager_sync_async_into_and_replace_on_s3(
    s3_server: S3Server, s3_root: str, s3_env: dict[str, str]
) -> None:
    model = torch.nn.Linear(128, 128)
    checkpoint = f"{s3_root}/ckpt"
    with fastckpt.CheckpointManager(fastckpt.CheckpointManager.Config.with_async_save()) as mgr:
        future = mgr.save(checkpoint, {"model": model.state_dict(), "step": 1})
        assert future is not None
        future.result()
        target: dict[str, Any] = {"model": torch.nn.Linear(128, 128).state_dict(), "step": 0}
        loaded = mgr.load(checkpoint, into=target)
        assert torch.equal(target["model"]["weight"], model.weight.detach())  # in place
        assert loaded["step"] == 1
    with fastckpt.CheckpointManager(fastckpt.CheckpointManager.Config.with_sync_save()) as mgr:
        mgr.save(checkpoint, {"model": model.state_dict(), "step": 2})
        assert mgr.load(checkpoint)["step"] == 2
    assert "commit.json" in _keys(s3_server, checkpoint)


def test_training_strategy_and_hook_resume_exactly_from_s3(
    s3_server: S3Server, s3_root: str, s3_env: dict[str, str]
) -> None:
    hook = fastckpt.CheckpointHook(s3_root, step_interval=4, async_save=True)
    strategy = ts.new_strategy([hook], num_steps=8)
    strategy.run(ts.loader())
    restored = fastckpt.TrainingStrategy.load_checkpoint(s3_root, training_fn=ts.training_fn)
    assert restored.step_count == 8
    for name, tensor in strategy.models["main"].state_dict().items():
        assert torch.equal(restored.models["main"].state_dict()[name], tensor)
    assert "manifest.json" in _keys(s3_server, s3_root)


def test_cli_ls_verify_inspect_prune_export_on_s3(
    s3_server: S3Server, s3_root: str, s3_env: dict[str, str], tmp_path: Path
) -> None:
    model = torch.nn.Linear(4, 4)
    fastckpt.save_checkpoint(s3_root, models={"main": model})
    fastckpt.save_checkpoint(s3_root, models={"main": model})
    managers = f"{s3_root}-managers"
    with fastckpt.CheckpointManager(fastckpt.CheckpointManager.Config.with_sync_save()) as mgr:
        mgr.save(f"{managers}/a", {"x": torch.arange(6.0), "step": 7})
    assert "manifest.json" in _keys(s3_server, s3_root)
    env = {**os.environ, **s3_env}

    def cli(*command: str) -> str:
        result = subprocess.run(
            [sys.executable, "-m", "fastckpt", *command],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert result.returncode == 0, (command, result.stdout, result.stderr)
        return result.stdout

    assert "2 committed index(es)" in cli("ls", s3_root)
    cli("verify", s3_root)
    assert "main" in cli("inspect", s3_root)
    listing = cli("ls", managers)
    assert "a " in listing and " 7 " in listing  # the step read through the generation
    assert "item x: 1 tensor(s)" in cli("inspect", f"{managers}/a")
    cli("verify", f"{managers}/a")
    cli("export", s3_root, "--to", str(tmp_path / "main.safetensors"))
    exported = load_file(tmp_path / "main.safetensors")
    assert torch.equal(exported["weight"], model.weight.detach())
    cli("export", f"{managers}/a", "--model", "x", "--to", str(tmp_path / "x.safetensors"))
    assert torch.equal(load_file(tmp_path / "x.safetensors")["tensor"], torch.arange(6.0))
    cli("prune", s3_root, "--keep-last", "1")
    assert [c["index"] for c in fastckpt.list_checkpoints(s3_root)] == [1]
    assert not any(key.startswith("0/") for key in _keys(s3_server, s3_root))


def test_manager_replacement_on_s3_writes_a_new_generation_then_drops_the_old(
    s3_server: S3Server, s3_root: str, s3_env: dict[str, str]
) -> None:
    checkpoint = f"{s3_root}/ckpt"
    with fastckpt.CheckpointManager(fastckpt.CheckpointManager.Config.with_sync_save()) as mgr:
        mgr.save(checkpoint, {"x": torch.zeros(1000), "step": 1})
        first = {key.split("/")[0] for key in _keys(s3_server, checkpoint)}
        mgr.save(checkpoint, {"x": torch.ones(1000), "step": 2})
        second = {key.split("/")[0] for key in _keys(s3_server, checkpoint)}
        loaded = mgr.load(checkpoint)
    # One commit record and one generation prefix each time, never the same prefix twice.
    assert len(first) == len(second) == 2 and "commit.json" in first & second
    assert not (first & second) - {"commit.json"}
    record = read_commit_record(checkpoint)
    assert f"{record['generation']}" in second
    assert all(relpath.startswith(record["generation"] + "/") for relpath in record["files"])
    assert loaded["step"] == 2 and torch.equal(loaded["x"], torch.ones(1000))
    assert verify(checkpoint).ok


def _top_level(server: S3Server, url: str) -> set[str]:
    return {key.split("/")[0] for key in _keys(server, url)}


def _pending_uploads(server: S3Server, url: str) -> list[Any]:
    prefix = url.split("/", 3)[3] + "/"
    found = server.client().list_multipart_uploads(Bucket=server.bucket, Prefix=prefix)
    return list(found.get("Uploads", []))


def _committed_marker(url: str) -> Any:
    """What changes with every commit at ``url`` (a root: its newest index and step; a
    manager id: its record's generation), read from the manifest or record only (None:
    nothing committed)."""
    try:
        if url.endswith("/root"):
            rows = fastckpt.list_checkpoints(url)
            return (rows[-1]["index"], rows[-1]["counters"]["step"]) if rows else None
        return read_commit_record(url)["generation"]
    except FileNotFoundError:
        return None


def _complete(url: str, files: dict[str, Any], within: str) -> None:
    """Every object a committed record lists exists with its recorded size (a HEAD each)."""
    for relpath, record in files.items():
        path = Path(f"{within}/{relpath}")
        assert backend_for(path).stat(path).size == record["size"], (url, relpath)


def _check_root(url: str) -> int | None:
    """Every committed index of a save_checkpoint root names complete objects (their sizes;
    the crc32c of each is checked by the loads and the final verify), and the newest loads
    bitwise: every parameter equals the step its save recorded. Returns that step (None:
    nothing committed yet)."""
    try:
        manifest = Manifest.load(url)
    except FileNotFoundError:
        return None
    if manifest.latest is None:
        return None
    for index, entry in manifest.entries.items():
        _complete(url, entry["files"], f"{url}/{index}")
    rows = fastckpt.list_checkpoints(url)
    step = rows[-1]["counters"]["step"]
    loaded = fastckpt.load_checkpoint(url)
    assert loaded["checkpoint_index"] == rows[-1]["index"]
    model = loaded["models"]["main"]["model"]
    assert torch.equal(model.bias, torch.full_like(model.bias, float(step))), (url, step)
    # The weight is frozen: incremental saves take it from the previous index.
    assert torch.equal(model.weight, torch.full_like(model.weight, FROZEN_WEIGHT)), (url, step)
    return int(step)


def _check_manager_id(url: str) -> int | None:
    """The id's commit record names complete objects, and it loads bitwise (``x`` equals
    the ``step`` saved with it). Returns that step (None: nothing committed yet)."""
    try:
        record = read_commit_record(url)
    except FileNotFoundError:
        return None
    _complete(url, record["files"], url)
    with fastckpt.CheckpointManager(fastckpt.CheckpointManager.Config.with_sync_save()) as mgr:
        loaded = mgr.load(url)
    assert torch.equal(loaded["x"], front_door_tensor(loaded["step"])), (url, loaded["step"])
    return int(loaded["step"])


def test_sigkilled_front_door_saves_to_s3_never_break_the_committed_checkpoints(
    s3_server: S3Server, s3_root: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """50 savers, forked ready to run (no interpreter start per kill), each SIGKILLed at a
    random moment while saving in a loop through a front door: incremental ``save_checkpoint``
    (the frozen weight comes from the previous index) + ``prune`` into a root, and
    ``CheckpointManager.save`` replacing one checkpoint id, alternately.
    After every kill, every committed index/record names complete objects (verify) and the
    newest loads bitwise; a later save removes what the killed ones left (no stray data, no
    unfinished multipart upload)."""
    monkeypatch.chdir(tmp_path)
    root, checkpoint = f"{s3_root}/root", f"{s3_root}/ids/ckpt"
    # A killed saver's lease blocks the next saver of the root until it expires: a short
    # lease (renewed every third of it) keeps the test from waiting 30 s after most kills.
    options = s3_server.options(
        part_size=5 << 20, read_part_size=4 << 20, concurrency=4, lease_ttl_s=8.0
    )
    rng = random.Random(4321)
    kills = mid_upload = 0
    progress: dict[str, set[int | None]] = {"root": set(), "manager": set()}
    factory = SaverFactory()
    try:
        for url in (root, checkpoint):
            configure_storage(url, options)
        for round_ in range(50):
            door, url = ("save_checkpoint", root) if round_ % 2 == 0 else ("manager", checkpoint)
            before = _committed_marker(url)
            pid = factory.spawn(url, options, door)
            # Mostly short lives (kills land in uploads, commits, clean-ups); every fifth
            # saver of a door first commits once (however slow the machine), then dies at a
            # random moment of its next save, so both doors make progress.
            if round_ % 10 in (8, 9):
                deadline = time.monotonic() + 60
                while _committed_marker(url) == before and time.monotonic() < deadline:
                    time.sleep(0.05)
            if round_ % 10 in (4, 5):
                # Some savers die exactly inside a multipart upload, however long a save takes
                # to reach one on this machine (the lease, the proof of copied bytes).
                deadline = time.monotonic() + 60
                while not _pending_uploads(s3_server, url) and time.monotonic() < deadline:
                    time.sleep(0.02)
            else:
                time.sleep(rng.uniform(0.05, 0.7))
            os.kill(pid, signal.SIGKILL)
            kills += 1
            with contextlib.suppress(OSError):  # the zygote reaps it; wait until it is gone
                while True:
                    os.kill(pid, 0)
                    time.sleep(0.01)
            mid_upload += bool(_pending_uploads(s3_server, url))
            if door == "save_checkpoint":
                step = _check_root(root)
                progress["root"].add(step)
            else:
                step = _check_manager_id(checkpoint)
                progress["manager"].add(step)
        assert kills == 50
        assert mid_upload > 0, "no kill landed inside a multipart upload"
        assert len(progress["root"] - {None}) >= 3 and len(progress["manager"] - {None}) >= 3
        # The next saves (here, through the same doors) clean up what the killed ones left.
        model = front_door_model(-1)
        index = fastckpt.save_checkpoint(
            root, models={"main": model}, counters={"step": -1}, incremental=False
        )
        fastckpt.prune(root, keep_last=1)
        assert _check_root(root) == -1 and verify(root).ok
        assert _top_level(s3_server, root) == {"manifest.json", str(index)}
        with fastckpt.CheckpointManager(fastckpt.CheckpointManager.Config.with_sync_save()) as mgr:
            mgr.save(checkpoint, {"x": front_door_tensor(-1), "step": -1})
        assert _check_manager_id(checkpoint) == -1 and verify(checkpoint).ok
        assert len(_top_level(s3_server, checkpoint)) == 2  # commit.json + one generation
        assert not _pending_uploads(s3_server, root)
        assert not _pending_uploads(s3_server, checkpoint)
    finally:
        factory.close()
        for url in (root, checkpoint):
            configure_storage(url)
    assert not (tmp_path / "s3:").exists()


def test_configure_storage_options_for_a_prefix_override_the_environment(
    s3_server: S3Server, s3_root: str, no_aws_env: None, tmp_path: Path
) -> None:
    """With no AWS variables at all, options configured for the root's prefix reach the
    server; wrong credentials configured for a longer prefix are a typed error naming it."""
    options = s3_server.options()
    configure_storage(s3_root, endpoint_url=options["endpoint_url"], region="us-east-1")
    configure_storage(
        s3_root,
        {"endpoint_url": options["endpoint_url"], "region": "us-east-1"},
        access_key_id=options["access_key_id"],
        secret_access_key=options["secret_access_key"],
    )
    bad = f"{s3_root}/bad"
    configure_storage(
        bad,
        endpoint_url=options["endpoint_url"],
        access_key_id="AKIAWRONG",
        secret_access_key="wrong",
        max_retries=0,
    )
    try:
        fastckpt.save_checkpoint(s3_root, models={"main": torch.nn.Linear(2, 2)})
        assert [c["index"] for c in fastckpt.list_checkpoints(s3_root)] == [0]
        with pytest.raises(AccessDeniedError, match="bad"):
            fastckpt.save_checkpoint(bad, models={"main": torch.nn.Linear(2, 2)})
        with pytest.raises(TypeError, match="valid keys"):
            configure_storage(s3_root, endpont_url="x")
        with pytest.raises(ValueError, match="s3://"):
            configure_storage(str(tmp_path), region="us-east-1")
    finally:
        configure_storage(s3_root)
        configure_storage(bad)
    assert not (tmp_path / "s3:").exists()


def test_a_flipped_byte_or_a_missing_object_on_s3_is_a_typed_error(
    s3_server: S3Server, s3_root: str, s3_env: dict[str, str]
) -> None:
    model = torch.nn.Linear(32, 32)
    fastckpt.save_checkpoint(s3_root, models={"main": model})
    checkpoint = f"{s3_root}-mgr/ckpt"
    with fastckpt.CheckpointManager(fastckpt.CheckpointManager.Config.with_sync_save()) as mgr:
        mgr.save(checkpoint, {"x": torch.arange(4096.0)})
    client, bucket = s3_server.client(), s3_server.bucket
    root_key = s3_root.split("/", 3)[3]
    tensors = [k for k in _keys(s3_server, s3_root) if k.endswith(".safetensors")]
    assert tensors
    key = f"{root_key}/{tensors[0]}"
    body = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    body[-3] ^= 0x10  # in the tensor data, past the header
    client.put_object(Bucket=bucket, Key=key, Body=bytes(body))
    with pytest.raises(ChecksumMismatchError, match=tensors[0].rsplit("/", 1)[-1]):
        fastckpt.load_checkpoint(s3_root)
    assert not verify(s3_root).ok
    manager_key = checkpoint.split("/", 3)[3]
    data = [k for k in _keys(s3_server, checkpoint) if k.endswith("x.safetensors")]
    client.delete_object(Bucket=bucket, Key=f"{manager_key}/{data[0]}")
    with (
        fastckpt.CheckpointManager(fastckpt.CheckpointManager.Config.with_sync_save()) as mgr,
        pytest.raises(
            FileNotFoundError, match=r"x\.safetensors: missing \(listed in .*commit\.json"
        ),
    ):
        mgr.load(checkpoint)


def test_cli_ls_of_an_s3_root_never_heads_the_folder_name(
    s3_root: str,
    s3_env: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # s3s-fs answers a HEAD of a key naming a folder with HTTP 500: `fastckpt ls` of an s3://
    # root failed there. A folder is asked for with one listing.
    from fastckpt.cli.main import main as cli_main
    from fastckpt.storage.s3.client import S3Client
    from fastckpt.storage.s3.errors import ObjectStoreError

    for name, value in s3_env.items():
        monkeypatch.setenv(name, value)
    model = torch.nn.Linear(4, 4)
    fastckpt.save_checkpoint(s3_root, models={"main": model})
    real_head = S3Client.head
    folder = s3_root.split("/", 3)[3].rstrip("/")  # the root's key: s3://bucket/<folder>

    def head(self: S3Client, key: str) -> Any:
        if key.rstrip("/") == folder:
            raise ObjectStoreError(f"{key}: HTTP 500 (a folder's name)")
        return real_head(self, key)

    monkeypatch.setattr(S3Client, "head", head)
    assert cli_main(["ls", s3_root]) == 0
    assert "1 committed index(es)" in capsys.readouterr().out
    assert cli_main(["ls", f"{s3_root}/missing"]) == 2
    assert "no such file or directory" in capsys.readouterr().err


def test_a_manager_save_on_s3_never_replaces_a_folder_of_checkpoints(
    s3_server: S3Server, s3_root: str, s3_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # save("s3://.../mgr") (a missing /step_N) deleted every object of the checkpoints in it.
    from fastckpt.errors import NotACheckpointError

    for name, value in s3_env.items():
        monkeypatch.setenv(name, value)
    state = {"m": {"t": torch.arange(4.0)}, "step": 1}
    with fastckpt.CheckpointManager(fastckpt.CheckpointManager.Config.with_sync_save()) as mgr:
        mgr.save(f"{s3_root}/mgr/step_10", state)
        mgr.save(f"{s3_root}/mgr/step_20", state)
        with pytest.raises(NotACheckpointError, match="step_10, step_20"):
            mgr.save(f"{s3_root}/mgr", state)
        mgr.save(f"{s3_root}/mgr/step_20", state)  # replacing a checkpoint is fine
        assert torch.equal(mgr.load(f"{s3_root}/mgr/step_10")["m"]["t"], torch.arange(4.0))
    assert verify(f"{s3_root}/mgr/step_10").ok


def test_errors_about_s3_checkpoints_name_them_as_s3_urls(
    s3_server: S3Server, s3_root: str, s3_env: dict[str, str]
) -> None:
    """Every error and report about an ``s3://`` checkpoint names it ``s3://bucket/...``, the
    way the user wrote it and can paste it back: ``pathlib`` collapses the URL to
    ``s3:/bucket/...``, which messages printed before."""
    import re

    client, bucket = s3_server.client(), s3_server.bucket
    messages: list[str] = []

    def expect(error: type[BaseException], call: Any, *args: Any) -> None:
        with pytest.raises(error) as caught:
            call(*args)
        messages.append(f"{error.__name__}: {caught.value}")

    model = torch.nn.Linear(32, 32)
    fastckpt.save_checkpoint(s3_root, models={"main": model})
    root_key = s3_root.split("/", 3)[3]
    tensors = [k for k in _keys(s3_server, s3_root) if k.endswith(".safetensors")]
    key = f"{root_key}/{tensors[0]}"
    body = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    body[-3] ^= 0x10
    client.put_object(Bucket=bucket, Key=key, Body=bytes(body))
    expect(ChecksumMismatchError, fastckpt.load_checkpoint, s3_root)
    report = verify(s3_root)
    messages += [f"verify: {f.message}" for f in report.files if f.status != "ok"]
    client.delete_object(Bucket=bucket, Key=key)
    expect(FileNotFoundError, fastckpt.load_checkpoint, s3_root)
    client.put_object(Bucket=bucket, Key=f"{root_key}/manifest.json", Body=b"{not json")
    expect(fastckpt.CheckpointFormatError, fastckpt.load_checkpoint, s3_root)
    expect(FileNotFoundError, fastckpt.load_checkpoint, f"{s3_root}-none")
    # The bucket itself is a prefix, not a 0-byte object (its HEAD answers a size of 0):
    # verify reported it as a corrupt safetensors file "s3:/bucket".
    expect(FileNotFoundError, verify, f"s3://{bucket}")

    checkpoint = f"{s3_root}-mgr/ckpt"
    config = fastckpt.CheckpointManager.Config.with_sync_save()
    with fastckpt.CheckpointManager(config) as mgr:
        mgr.save(checkpoint, {"x": torch.arange(4096.0)})
        manager_key = checkpoint.split("/", 3)[3]
        data = [k for k in _keys(s3_server, checkpoint) if k.endswith("x.safetensors")]
        client.delete_object(Bucket=bucket, Key=f"{manager_key}/{data[0]}")
        expect(FileNotFoundError, mgr.load, checkpoint)
        expect(FileNotFoundError, mgr.load, f"{s3_root}-mgr/missing")
        client.delete_object(Bucket=bucket, Key=f"{manager_key}/commit.json")
        expect(FileNotFoundError, mgr.load, checkpoint)
    collapsed = [m for m in messages if re.search(r"s3:/(?!/)", m)]
    assert not collapsed, "\n".join(collapsed)
    assert all("s3://" in m for m in messages), "\n".join(messages)


def test_a_save_into_an_s3_root_whose_lease_this_thread_holds_is_refused_at_once(
    s3_server: S3Server, s3_root: str, s3_env: dict[str, str]
) -> None:
    """A signal handler saving into an ``s3://`` root while the save it interrupted holds
    the root's lease (here: the lease taken on this thread by hand) waited for itself: the
    held lease's own heartbeat kept renewing it, so the wait never ended (with a
    ``lock_timeout``: a ``TimeoutError`` naming this very process). Now
    ``ConcurrentSaveError`` at once, nothing written; the lease stays held."""
    from fastckpt.errors import ConcurrentSaveError
    from fastckpt.storage.registry import backend_for

    model = torch.nn.Linear(2, 2)
    fastckpt.save_checkpoint(s3_root, models={"main": (model, None)})
    lock = backend_for(s3_root).lock(Path(s3_root))
    lock.acquire()
    try:
        started = time.monotonic()
        with pytest.raises(ConcurrentSaveError, match="this thread already holds"):
            fastckpt.save_checkpoint(s3_root, models={"main": (model, None)}, lock_timeout=30)
        assert time.monotonic() - started < 10
        assert lock.held
    finally:
        lock.release()
    assert [c["index"] for c in fastckpt.list_checkpoints(s3_root)] == [0]
