"""``s3://`` in the remaining places, against a real moto server: ``fastckpt diff`` between two
object-store roots, ``fastckpt.dcp`` refusing an ``s3://`` URL with a typed error (never a local
``s3:`` directory), ``fastckpt prune`` naming the holder of a root's lease, and per-call
``storage_options=`` on every front door with no AWS environment at all.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fastckpt
import training_support as ts
from fastckpt.storage.registry import backend_for, configure_storage
from fastckpt.storage.s3.backend import S3RootLock
from fastckpt.storage.s3.errors import (
    AccessDeniedError,
    StorageOptionsError,
)
from s3_support import S3Server, no_aws_env, s3_env, s3_root, s3_server

__all__ = ["no_aws_env", "s3_env", "s3_root", "s3_server"]  # fixtures used by name below


def _cli(env: dict[str, str], *command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fastckpt", *command],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=120,
    )


def test_cli_diff_between_two_s3_roots(s3_root: str, s3_env: dict[str, str]) -> None:
    """Equal tensors compare identical (exit 0); one changed weight is reported by name with
    its differing element count (exit 1) - all read from the server."""
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8)
    a, b, c = f"{s3_root}/a", f"{s3_root}/b", f"{s3_root}/c"
    fastckpt.save_checkpoint(a, models={"main": model})
    fastckpt.save_checkpoint(b, models={"main": model})
    with torch.no_grad():
        model.weight[0, :3] += 1.0
    fastckpt.save_checkpoint(c, models={"main": model})
    same = _cli(s3_env, "diff", a, b, "--json")
    assert same.returncode == 0, same.stderr
    report = json.loads(same.stdout)
    assert report["identical"] and report["compared"] >= 2 and report["same"] >= 2
    changed = _cli(s3_env, "diff", a, c, "--json")
    assert changed.returncode == 1, changed.stderr
    report = json.loads(changed.stdout)
    assert [(t["name"], t["differing"]) for t in report["changed"]] == [("models/main:weight", 3)]


def test_cli_prints_s3_urls_as_users_write_them(s3_root: str, s3_env: dict[str, str]) -> None:
    """pathlib collapses ``s3://`` to ``s3:/``; what the CLI prints must be the URL itself."""
    model = torch.nn.Linear(4, 2)
    a, b = f"{s3_root}/a", f"{s3_root}/b"
    fastckpt.save_checkpoint(a, models={"main": model})
    fastckpt.save_checkpoint(b, models={"main": model})
    outputs = {
        "diff": _cli(s3_env, "diff", a, b),
        "ls": _cli(s3_env, "ls", a, "--json"),
        "verify": _cli(s3_env, "verify", a),
        "inspect": _cli(s3_env, "inspect", a, "--json"),
    }
    for command, result in outputs.items():
        assert result.returncode == 0, (command, result.stderr)
        assert a in result.stdout, (command, result.stdout)
        assert re.search(r"s3:/[^/]", result.stdout + result.stderr) is None, command
    assert json.loads(outputs["ls"].stdout)["root"] == a
    assert str(fastckpt.verify(a)).startswith(a)


def test_fastckpt_dcp_takes_an_s3_url_and_writes_nothing_local(
    s3_root: str, s3_env: dict[str, str], tmp_path: Path
) -> None:
    """Writer, Reader (construction and a checkpoint_id reset) and the save/load helpers take
    an ``s3://`` URL like a path: the objects go to the server, no local ``s3:`` directory
    appears (fixture check); an id nothing was committed to is a typed NotCommittedError
    naming it (sharded saves and loads on 2 and 3 ranks: tests/test_sharded_s3.py)."""
    from fastckpt import dcp
    from fastckpt.dcp.state import is_sharded_checkpoint, load_state, save_state

    url = f"{s3_root}/sharded"
    assert not is_sharded_checkpoint(url)
    with pytest.raises(dcp.NotCommittedError, match=r"sharded: no committed"):
        load_state(url)
    writer = dcp.Writer(tmp_path / "local")
    writer.reset(url)
    assert writer.checkpoint_id == str(Path(url))
    save_state(url, {"x": torch.arange(4.0)}, writer=writer)
    assert is_sharded_checkpoint(url) and dcp.Reader.validate_checkpoint_id(url)
    reader = dcp.Reader(tmp_path / "local")
    reader.reset(url)
    assert torch.equal(load_state(url, reader=reader)["x"], torch.arange(4.0))
    names = backend_for(url).list_dir(Path(url))
    assert "fastckpt-dcp.json" in names and len(names) == 2, names  # the record, one generation


def test_cli_prune_on_s3_waits_for_the_lease_and_names_its_holder(
    s3_root: str, s3_env: dict[str, str]
) -> None:
    """While this process holds the root's lease, ``fastckpt prune`` says who holds it and
    gives up after --lock-timeout; once released, the same prune deletes the old index."""
    model = torch.nn.Linear(2, 2)
    fastckpt.save_checkpoint(s3_root, models={"main": model})
    fastckpt.save_checkpoint(s3_root, models={"main": model})
    lease = backend_for(s3_root).lock(Path(s3_root), timeout=5)
    assert isinstance(lease, S3RootLock)
    lease.acquire()
    try:
        blocked = _cli(s3_env, "prune", s3_root, "--keep-last", "1", "--lock-timeout", "1")
    finally:
        lease.release()
    assert blocked.returncode != 0
    assert f"locked by lease owner {lease.owner}" in blocked.stderr, blocked.stderr
    assert [c["index"] for c in fastckpt.list_checkpoints(s3_root)] == [0, 1]
    done = _cli(s3_env, "prune", s3_root, "--keep-last", "1")
    assert done.returncode == 0, done.stderr
    assert [c["index"] for c in fastckpt.list_checkpoints(s3_root)] == [1]


def test_storage_options_per_call_reach_the_server_with_no_aws_environment(
    s3_server: S3Server, s3_root: str, no_aws_env: None
) -> None:
    """Options given to each front door (no AWS variable or file exists) reach the server;
    a wrong key given per call is AccessDeniedError naming the URL; a local path refuses
    options with StorageOptionsError."""
    options = s3_server.options()
    root, ids, hooked = f"{s3_root}/root", f"{s3_root}/ids/ckpt", f"{s3_root}/hook"
    bad = f"{s3_root}/bad"
    try:
        model = torch.nn.Linear(8, 4)
        saved = {"main": model}
        assert fastckpt.save_checkpoint(root, models=saved, storage_options=options) == 0
        assert fastckpt.save_checkpoint(root, models=saved, storage_options=options) == 1
        listed = fastckpt.list_checkpoints(root, storage_options=options)
        assert [c["index"] for c in listed] == [0, 1]
        loaded = fastckpt.load_checkpoint(root, storage_options=options)["models"]["main"]
        assert torch.equal(loaded["model"].weight, model.weight)
        assert fastckpt.verify(root, storage_options=options).ok
        assert fastckpt.prune(root, keep_last=1, storage_options=options) == [0]

        config = fastckpt.CheckpointManager.Config.with_sync_save()
        config.storage_config = fastckpt.LocalFileSystemStorageConfig(storage_options=options)
        with fastckpt.CheckpointManager(config) as manager:
            manager.save(ids, {"x": torch.arange(5.0), "step": 3})
            assert torch.equal(manager.load(ids)["x"], torch.arange(5.0))

        hook = fastckpt.CheckpointHook(
            hooked, step_interval=2, async_save=True, storage_options=options
        )
        strategy = ts.new_strategy([hook], num_steps=4)
        strategy.run(ts.loader())
        restored = fastckpt.TrainingStrategy.load_checkpoint(
            hooked, training_fn=ts.training_fn, storage_options=options
        )
        assert restored.step_count == 4
        for name, tensor in strategy.models["main"].state_dict().items():
            assert torch.equal(restored.models["main"].state_dict()[name], tensor)

        wrong = s3_server.options(secret_access_key="wrong", max_retries=0)
        with pytest.raises(AccessDeniedError, match=bad):
            fastckpt.save_checkpoint(bad, models=saved, storage_options=wrong)
        with pytest.raises(AccessDeniedError, match=bad):
            fastckpt.list_checkpoints(bad, storage_options=wrong)
        with pytest.raises(StorageOptionsError, match="local path"):
            fastckpt.save_checkpoint("local-root", models=saved, storage_options=options)
        with pytest.raises(TypeError, match="valid keys"):
            fastckpt.list_checkpoints(root, storage_options={"endpont_url": "x"})
        assert not Path("local-root").exists()
    finally:
        for url in (root, ids, hooked, bad):
            configure_storage(url)


def test_configure_storage_is_a_public_name() -> None:
    assert fastckpt.configure_storage is configure_storage
    assert "configure_storage" in fastckpt.__all__


def test_storage_options_are_checked_and_refused_for_local_paths(tmp_path: Path) -> None:
    """A manager's storage_options are checked when configured; a local checkpoint id, hook
    root or verify path with options is a StorageOptionsError naming it (nothing written)."""
    with pytest.raises(TypeError, match="valid keys"):
        fastckpt.LocalFileSystemStorageConfig(storage_options={"endpont_url": "x"})
    with pytest.raises(TypeError, match="mapping"):
        fastckpt.LocalFileSystemStorageConfig(storage_options="us-east-1")  # type: ignore[arg-type]
    options = {"region": "us-east-1"}
    config = fastckpt.CheckpointManager.Config.with_sync_save()
    config.storage_config = fastckpt.LocalFileSystemStorageConfig(storage_options=options)
    local = tmp_path / "ckpt"
    with fastckpt.CheckpointManager(config) as manager:
        with pytest.raises(StorageOptionsError, match=re.escape(str(local))):
            manager.save(local, {"x": torch.zeros(2)})
        with pytest.raises(StorageOptionsError, match=re.escape(str(local))):
            manager.load(local)
    assert not local.exists()
    with pytest.raises(StorageOptionsError, match="CheckpointHook"):
        fastckpt.CheckpointHook(tmp_path / "hook", step_interval=1, storage_options=options)
    with pytest.raises(StorageOptionsError, match="verify"):
        fastckpt.verify(tmp_path, storage_options=options)
    with pytest.raises(StorageOptionsError, match=r"TrainingStrategy\.load_checkpoint"):
        fastckpt.TrainingStrategy.load_checkpoint(tmp_path, storage_options=options)


WITHOUT_OBSTORE = """
import sys
sys.modules["obstore"] = None  # as if the s3 extra were not installed
import torch, fastckpt
from fastckpt.cli.main import main
from fastckpt.errors import MissingDependencyError
try:
    fastckpt.save_checkpoint("s3://bucket/run", {"main": (torch.nn.Linear(2, 2), None)})
except MissingDependencyError as err:
    print("refused:", err)
sys.exit(main(["verify", "s3://bucket/run"]))
"""


def test_an_s3_path_without_obstore_is_refused_naming_the_extra() -> None:
    """The fast twin of test_wheel's clean-venv check: without obstore an ``s3://`` path is a
    ``MissingDependencyError`` naming the pip line, and ``fastckpt verify`` exits 2. Before, a
    bare ``ModuleNotFoundError`` from inside the client, and exit 1 ("damage found")."""
    result = subprocess.run(
        [sys.executable, "-c", WITHOUT_OBSTORE], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "refused: s3://bucket/run: s3:// paths need obstore" in result.stdout
    assert "pip install 'fastckpt-io[s3]'" in result.stdout
    assert "fastckpt-io[s3]" in result.stderr and "Traceback" not in result.stderr
