"""Writers in another PID namespace (a container sharing the host's name and disk: a pod's
sidecar running ``fastckpt prune``, a restarted container) are never taken for dead.

A pid says nothing outside its namespace: before, a writer whose pid did not exist in the
cleaning process's namespace had its live staging deleted by another process's save, and its
sharded part swept by a prune (its save then committed an index that no longer loaded). The
writers here run under ``unshare --pid`` (root), with a pid chosen free in this namespace.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import fastckpt
from fastckpt.storage import backend as backend_module
from fastckpt.storage import identity

TESTS = Path(__file__).resolve().parent


def _free_pid() -> int:
    """A pid no process of this namespace has (the writer gets it in its own)."""
    limit = int(Path("/proc/sys/kernel/pid_max").read_text())
    for pid in range(limit - 2, limit // 2, -1):
        if not Path(f"/proc/{pid}").exists():
            return pid
    raise AssertionError("no free pid")


def _in_new_pid_namespace(script: str, *args: str) -> subprocess.Popen[str]:
    """Run ``script`` as pid :func:`_free_pid` of a new PID namespace (skips without one)."""
    probe = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True, check=False
    )
    if probe.returncode != 0:
        pytest.skip(f"no new PID namespace here (needs root): {probe.stderr.decode().strip()}")
    pid = _free_pid()
    path = os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))
    command = (
        f"echo {pid - 1} > /proc/sys/kernel/ns_last_pid && "
        '"$0" -c "$1" "${@:2}"; exit $?'  # forked (not exec'd): its pid is the one written
    )
    return subprocess.Popen(
        [
            "unshare",
            "--pid",
            "--fork",
            "--kill-child",  # its namespace (the writer too) dies with it: kill() is enough
            "--mount-proc",
            "bash",
            "-c",
            command,
            sys.executable,
            script,
            *args,
        ],
        env={**os.environ, "PYTHONPATH": path},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for(path: Path, process: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 120
    while not path.exists():
        if process.poll() is not None:
            raise AssertionError(f"the writer exited first: {process.communicate()}")
        assert time.monotonic() < deadline, "the writer never got there"
        time.sleep(0.05)


MANAGER_WRITER = textwrap.dedent(
    """
    import os, sys, time, torch, fastckpt
    from fastckpt.storage import backend
    directory, flag = sys.argv[1], sys.argv[2]
    publish = backend.LocalStaging.publish
    def paused(self):  # the writer is descheduled with its staging written, not yet published
        open(flag, "w").close()
        while not os.path.exists(flag + ".go"):
            time.sleep(0.02)
        return publish(self)
    backend.LocalStaging.publish = paused
    with fastckpt.CheckpointManager(fastckpt.CheckpointManager.Config.with_sync_save()) as m:
        m.save(os.path.join(directory, "ckpt_w"), {"w": torch.arange(1000.0)})
    print("saved", os.getpid())
    """
)


def test_a_save_never_deletes_the_staging_of_a_writer_in_another_pid_namespace(
    tmp_path: Path,
) -> None:
    flag = tmp_path / "paused"
    writer = _in_new_pid_namespace(MANAGER_WRITER, str(tmp_path), str(flag))
    try:
        _wait_for(flag, writer)
        staged = [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-ckpt_w")]
        assert len(staged) == 1, staged
        # Its pid, free here, reads as a dead process of this host to a pid check alone.
        with fastckpt.CheckpointManager(fastckpt.CheckpointManager.Config.with_sync_save()) as m:
            m.save(tmp_path / "ckpt_c", {"x": torch.zeros(4)})  # cleans dead writers' leftovers
        assert (tmp_path / staged[0]).is_dir()  # before: deleted, the writer's save failed
        (tmp_path / "paused.go").touch()
        out, err = writer.communicate(timeout=120)
    finally:
        writer.kill()
    assert writer.returncode == 0, err
    _, pid, host, _ = staged[0].rsplit("~", 3)
    assert int(pid) == int(out.split()[1]) and not Path(f"/proc/{pid}").exists()
    assert host.startswith(identity.HOST[:20]) and ".pidns" in host  # its namespace named
    with fastckpt.CheckpointManager() as m:
        assert torch.equal(m.load(tmp_path / "ckpt_w")["w"], torch.arange(1000.0))


def _leftover(parent: Path, name: str, *, age: float, fresh_file: bool = False) -> Path:
    """A staging directory ``name`` holding one file, everything in it modified ``age``
    seconds ago (but for a file just written when ``fresh_file``)."""
    staging = parent / name
    (staging / "models").mkdir(parents=True)
    (staging / "models" / "main.safetensors").write_bytes(b"x" * 64)
    then = time.time() - age
    for path in (staging / "models" / "main.safetensors", staging / "models", staging):
        os.utime(path, (then, then))
    if fresh_file:
        (staging / "models" / "main.safetensors").touch()
    return staging


def test_the_staging_a_killed_writer_of_another_namespace_left_is_removed_once_stale(
    tmp_path: Path,
) -> None:
    # A container restarted after a kill runs in a new PID namespace: the killed save's
    # staging names a writer no pid check can declare dead (nor can a pid since reused by a
    # live process: pid 1 here). Before, such staging stayed next to the checkpoints for good.
    day = backend_module.STALE_STAGING_SECONDS
    other = f"{identity.HOST[:20]}.pidns4026532999"
    stale = [
        _leftover(tmp_path, f".tmp-ckpt_a~4242~{other}~0a0a0a0a", age=day + 60),
        _leftover(tmp_path, f".tmp-ckpt_b~1~{identity.HOST}~0b0b0b0b", age=day + 60),
        _leftover(tmp_path, ".tmp-ckpt_c~4242~node-7~0c0c0c0c", age=day + 60),
    ]
    live = [  # a writer that may still be at work: something in its staging changed lately
        _leftover(tmp_path, f".tmp-ckpt_d~4242~{other}~0d0d0d0d", age=day - 600),
        _leftover(tmp_path, f".tmp-ckpt_e~4242~{other}~0e0e0e0e", age=day + 60, fresh_file=True),
    ]
    # A replace's copy aside holds a committed checkpoint: never removed for its age.
    aside = _leftover(tmp_path, f".trash-ckpt_f~4242~{other}~0f0f0f0f", age=day + 60)
    (aside / "commit.json").write_text("{}")
    with fastckpt.CheckpointManager(fastckpt.CheckpointManager.Config.with_sync_save()) as m:
        m.save(tmp_path / "ckpt_x", {"x": torch.zeros(4)})
    assert [p.name for p in stale if p.exists()] == []
    assert all(p.is_dir() for p in live)
    assert (tmp_path / "ckpt_f" / "commit.json").is_file()  # put back, as another host's is


#: One rank of a gloo group (``rendezvous``) training nothing: an FSDP2 strategy whose index 0
#: of ``root`` is saved; the scripts below then save index 1 their own way.
ONE_RANK_STRATEGY = """
import os, shutil, sys, time, torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
import fastckpt
import fastckpt.checkpoint.components as components
dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=0, world_size=1)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
fully_shard(model)
strategy = fastckpt.TrainingStrategy(
    model, fastckpt.OptimizerConfig(torch.optim.SGD, {"lr": 0.1}),
    training_fn=lambda m, batch: m(batch).square().mean())
strategy.save_checkpoint(root)
commit = components.write_snapshot
"""

SHARDED_WRITER = (
    "import sys\nroot, flag, rendezvous = sys.argv[1], sys.argv[2], sys.argv[3]\n"
    + ONE_RANK_STRATEGY
    + textwrap.dedent(
        """
        def paused(*args, **kwargs):  # its part written, before the commit takes the lock
            open(flag, "w").close()
            while not os.path.exists(flag + ".go"):
                time.sleep(0.02)
            return commit(*args, **kwargs)
        components.write_snapshot = paused
        print("saved", strategy.save_checkpoint(root))
        dist.destroy_process_group()
        """
    )
)


def test_a_prune_never_sweeps_the_sharded_part_of_a_writer_in_another_pid_namespace(
    tmp_path: Path,
) -> None:
    root, flag = tmp_path / "root", tmp_path / "paused"
    writer = _in_new_pid_namespace(
        SHARDED_WRITER, str(root), str(flag), str(tmp_path / "rendezvous")
    )
    try:
        _wait_for(flag, writer)
        part = root / "sharded" / "1"
        (written,) = [p.name for p in part.iterdir()]
        assert fastckpt.prune(root, keep_last=5) == []
        assert (part / written).is_dir()  # before: swept as a dead writer's
        (tmp_path / "paused.go").touch()
        out, err = writer.communicate(timeout=240)
    finally:
        writer.kill()
    assert writer.returncode == 0, err
    assert out.split()[-1] == "1"
    report = fastckpt.verify(root)
    assert report.ok, report  # before: index 1 committed naming the swept part


PART_REMOVED = (
    "import sys\nroot, rendezvous = sys.argv[1], sys.argv[2]\n"
    + ONE_RANK_STRATEGY
    + textwrap.dedent(
        """
        def removed_first(*args, **kwargs):  # another process removes it before the commit
            shutil.rmtree(f"{root}/sharded/1")
            return commit(*args, **kwargs)
        components.write_snapshot = removed_first
        try:
            strategy.save_checkpoint(root)
        except Exception as err:
            print(type(err).__name__, err)
        dist.destroy_process_group()
        """
    )
)


def test_a_sharded_save_whose_part_was_removed_before_its_commit_commits_nothing(
    tmp_path: Path,
) -> None:
    """Whatever removed it (a sweep that took its writer for dead, a hand): the commit checks
    under the root's lock that the part it names is there with its record (before: index 1
    was committed naming the missing part, and the save returned 1)."""
    root = tmp_path / "root"
    proc = subprocess.run(
        [sys.executable, "-c", PART_REMOVED, str(root), str(tmp_path / "rendezvous")],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "PYTHONPATH": str(TESTS)},
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("FileNotFoundError"), proc.stdout
    assert "sharded part this save wrote is gone" in proc.stdout
    assert "index 1 was not committed" in proc.stdout
    assert [row["index"] for row in fastckpt.list_checkpoints(root)] == [0]
    assert fastckpt.verify(root).ok
