"""OS resource limits give typed errors or go on, never a Rust panic (round 20, limits).

- A thread the Rust core could not start (a container's pids limit, ``ulimit -u``,
  ``ulimit -v``: ``pthread_create`` fails with ``EAGAIN``) became
  ``pyo3_runtime.PanicException``, a ``BaseException``: ``load_file``, ``save_file``,
  incremental and async saves, loads and ``fastckpt verify`` all raised it. A
  ``CheckpointHook(strict_saves=False)`` run was stopped by it, ``verify`` called an intact
  checkpoint damaged (exit 1). The core now goes on with the threads it could start (the
  calling thread does the work alone if it must).
- ``save_file(direct_io=False)`` over a file of 64 MiB or more raised that panic after the
  new file was committed (the old one's deferred deletion could not start its thread), and
  left a hidden ``.fastckpt-trash`` link as large as the old file.
- A load out of file descriptors raised an ``OSError`` with ``errno`` None (``load_file``) or
  naming ``/proc/self/fd/N`` (``safe_open``).
- A save under ``ulimit -f`` raised ``EFBIG`` naming a staging temp file, nothing about the
  limit.

Thread limits are reached for real in a child process: ``RUST_MIN_STACK`` (read by Rust's std
at its first thread) asks for a 100 TiB stack, so every thread the Rust core starts fails in
``pthread_create`` with ``EAGAIN``, as at a pids limit, while Python's and torch's threads
start as usual; where the cgroup v1 pids controller is writable (root), a pids limit too.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

#: Every thread the Rust core starts fails with EAGAIN (Rust std reads this at its first spawn).
NO_RUST_THREADS = {"RUST_MIN_STACK": str(100 << 40), "RUST_BACKTRACE": "0"}
#: The cgroup v1 pids controller, where a root process may make a group with a thread limit.
PIDS_CGROUP = Path("/sys/fs/cgroup/pids")


def run_child(
    code: str, *args: str, env: dict[str, str] | None = None, timeout: float = 240
) -> subprocess.CompletedProcess[str]:
    """``code`` run by a fresh interpreter with ``args`` as ``sys.argv[1:]`` and ``env`` added
    to the environment."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def assert_no_panic(done: subprocess.CompletedProcess[str]) -> None:
    """The child succeeded and no Rust panic reached it."""
    output = done.stdout + done.stderr
    assert "PanicException" not in output and "panicked" not in output, output
    assert done.returncode == 0, output
    assert done.stdout.strip().endswith("ok"), output


FILES = """
    import sys, torch, fastckpt
    from fastckpt.container.lazy import safe_open
    folder = sys.argv[1]
    tensors = {f"t{i}": torch.randn(1 << 18) for i in range(6)}
    for direct_io in (True, False):
        path = f"{folder}/f{int(direct_io)}.safetensors"
        fastckpt.save_file(tensors, path, threads=4, direct_io=direct_io)
        for backend in ("mmap", "pread"):
            loaded = fastckpt.load_file(path, threads=4, backend=backend)
            assert all(torch.equal(loaded[k], v) for k, v in tensors.items()), backend
        with safe_open(path, framework="pt") as f:
            assert torch.equal(f.get_tensor("t3"), tensors["t3"])
    print("ok")
"""


def test_files_save_and_load_when_no_rust_thread_can_start(tmp_path: Path) -> None:
    """Before: ``save_file(threads=4)`` (O_DIRECT preparers) and ``load_file(threads=4)``
    (reader threads) raised ``PanicException: failed to spawn thread``."""
    assert_no_panic(run_child(FILES, str(tmp_path), env=NO_RUST_THREADS))


CHECKPOINTS = """
    import sys, torch, fastckpt
    root = sys.argv[1]
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    fastckpt.save_checkpoint(root, models={"m": (model, None)}, incremental=True)
    with torch.no_grad():
        model[0].weight.add_(1)
    fastckpt.save_checkpoint(root, models={"m": (model, None)}, incremental=True)
    loaded = fastckpt.load_checkpoint(root)["models"]["m"]["model"].state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())
    print("ok")
"""


def test_incremental_checkpoints_save_and_load_when_no_rust_thread_can_start(
    tmp_path: Path,
) -> None:
    """Before: the second (incremental) save's digest threads, and the load's reader threads,
    raised ``PanicException``."""
    root = tmp_path / "root"
    assert_no_panic(run_child(CHECKPOINTS, str(root), env=NO_RUST_THREADS))
    verified = subprocess.run(
        [sys.executable, "-m", "fastckpt", "verify", str(root)],
        env={**os.environ, **NO_RUST_THREADS},
        capture_output=True,
        text=True,
        timeout=240,
    )
    # Before: exit 1 ("verify found damage") with a Rust panic, on an intact root.
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert "PanicException" not in verified.stderr


ASYNC = """
    import sys, torch, fastckpt
    from fastckpt.manager import (
        AsyncCheckpointSaverConfig, CheckpointWriterConfig, LocalFileSystemStorageConfig)
    folder = sys.argv[1]
    state = {f"t{i}": torch.randn(1 << 18) for i in range(4)}
    for threads in (2, 5):
        config = fastckpt.CheckpointManager.Config(
            save=AsyncCheckpointSaverConfig(
                writer_config=CheckpointWriterConfig(file_write_max_threads=threads)),
            incremental=False,
            storage_config=LocalFileSystemStorageConfig(use_direct_io=True),
        )
        with fastckpt.CheckpointManager(config) as manager:
            manager.save(f"{folder}/a{threads}", {"m": state}).result()
            loaded = manager.load(f"{folder}/a{threads}")
        assert all(torch.equal(loaded["m"][k], v) for k, v in state.items()), threads
    print("ok")
"""


def test_async_image_saves_write_when_no_rust_thread_can_start(tmp_path: Path) -> None:
    """Before: the file-image writer's hashing thread (and its chunk writers with more
    threads) raised ``PanicException`` out of the manager's save future."""
    assert_no_panic(run_child(ASYNC, str(tmp_path), env=NO_RUST_THREADS))


HOOK = """
    import sys, torch, fastckpt
    root = sys.argv[1]

    def training_fn(model, batch):
        return (model(batch) - 1.0).square().mean()

    errors = []
    hook = fastckpt.CheckpointHook(root, step_interval=1, async_save=True,
                                   strict_saves=False, on_save_error=errors.append)
    strategy = fastckpt.TrainingStrategy(
        torch.nn.Linear(16, 1), fastckpt.OptimizerConfig(torch.optim.AdamW, {"lr": 1e-3}),
        training_fn=training_fn, hooks=[hook], num_steps=4)
    strategy.run([torch.randn(8, 16) for _ in range(4)])
    assert strategy.step_count == 4 and not errors, (strategy.step_count, errors)
    print("ok")
"""


def test_a_training_run_with_a_checkpoint_hook_goes_on_when_no_rust_thread_can_start(
    tmp_path: Path,
) -> None:
    """Before: the run stopped at step 2 with ``PanicException`` (not an ``Exception``, so
    ``strict_saves=False`` did not tolerate it and ``on_save_error`` was never called)."""
    assert_no_panic(run_child(HOOK, str(tmp_path / "run"), env=NO_RUST_THREADS))


REPLACE = """
    import os, sys, torch, fastckpt
    folder = sys.argv[1]
    path = f"{folder}/big.safetensors"
    # 80 MiB, buffered: the next save over it deletes it on a thread of its own.
    fastckpt.save_file({"w": torch.zeros(20 << 20)}, path, direct_io=False)
    fastckpt.save_file({"w": torch.ones(20 << 20)}, path, direct_io=False)
    assert torch.equal(fastckpt.load_file(path, threads=1)["w"], torch.ones(20 << 20))
    print("ok")
"""


def test_replacing_a_large_file_when_no_thread_can_start_returns_and_leaves_no_trash(
    tmp_path: Path,
) -> None:
    """Before: ``save_file(direct_io=False)`` over an 80 MiB file committed the new file, then
    raised ``PanicException`` (the old file's deferred deletion could not start its thread)
    and left an 80 MiB ``.big.safetensors.fastckpt-tmp.<pid>.<n>.fastckpt-trash`` link."""
    assert_no_panic(run_child(REPLACE, str(tmp_path), env=NO_RUST_THREADS))
    assert sorted(os.listdir(tmp_path)) == ["big.safetensors"]


def in_pids_cgroup(group: Path) -> None:
    """Moves the calling (forked, not yet exec'd) child into the pids cgroup ``group``."""
    (group / "cgroup.procs").write_text(str(os.getpid()))


@pytest.mark.skipif(
    not os.access(PIDS_CGROUP, os.W_OK), reason="needs a writable cgroup v1 pids controller"
)
def test_verify_of_an_intact_root_passes_at_a_container_pids_limit(tmp_path: Path) -> None:
    """``fastckpt verify`` in a pids cgroup that allows two tasks (a container's
    ``--pids-limit``): before, exit 1 ("verify found damage") with a Rust panic on an intact
    root, and nothing on stdout with ``--json``."""
    root = tmp_path / "root"
    made = run_child(
        "import sys, torch, fastckpt\n"
        "fastckpt.save_checkpoint(sys.argv[1], "
        "models={'m': (torch.nn.Linear(2048, 2048), None)})\n"
        "print('ok')\n",
        str(root),
    )
    assert_no_panic(made)
    group = PIDS_CGROUP / f"fastckpt_test_limits_{os.getpid()}"
    group.mkdir()
    try:
        (group / "pids.max").write_text("2")
        verified = subprocess.run(
            [sys.executable, "-m", "fastckpt", "--json", "verify", str(root)],
            env={**os.environ, "RUST_BACKTRACE": "0"},
            capture_output=True,
            text=True,
            timeout=240,
            preexec_fn=lambda: in_pids_cgroup(group),
        )
    finally:
        group.rmdir()
    assert "PanicException" not in verified.stderr, verified.stderr
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert '"indices"' in verified.stdout


NO_DESCRIPTOR = """
    import json, os, resource, sys, torch, fastckpt
    from fastckpt.container.lazy import safe_open
    path = sys.argv[1]
    fastckpt.save_file({"w": torch.ones(1 << 20)}, path)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    taken = []
    try:
        while True:
            taken.append(os.open("/dev/null", os.O_RDONLY))
    except OSError:
        pass
    os.close(taken.pop())  # exactly one descriptor free: the load opens the file, no more
    seen = {}
    for door, load in [("load_file", lambda: fastckpt.load_file(path)),
                       ("safe_open", lambda: safe_open(path, framework="pt").__enter__())]:
        try:
            load()
            seen[door] = None
        except OSError as err:
            seen[door] = [err.errno, err.filename, str(err)]
    print(json.dumps(seen))
"""


@pytest.mark.parametrize("cpp_stacktraces", ["0", "1"])
def test_a_load_out_of_file_descriptors_keeps_emfile_and_names_the_file(
    tmp_path: Path, cpp_stacktraces: str
) -> None:
    """Before: ``load_file`` raised an ``OSError`` with ``errno`` None (callers could not test
    for ``EMFILE``) whose text named ``</proc/self/fd/N>``; ``safe_open``'s named
    ``/proc/self/fd/N`` as its ``filename`` instead of the file. With
    ``TORCH_SHOW_CPP_STACKTRACES=1`` torch's message goes on past the errno (review 2 of the
    first version: the errno was lost there)."""
    import json

    path = tmp_path / "a.safetensors"
    done = run_child(NO_DESCRIPTOR, str(path), env={"TORCH_SHOW_CPP_STACKTRACES": cpp_stacktraces})
    assert done.returncode == 0, done.stdout + done.stderr
    seen = json.loads(done.stdout.splitlines()[-1])
    for door in ("load_file", "safe_open"):
        assert seen[door] is not None, door
        code, filename, message = seen[door]
        assert code == errno.EMFILE, (door, seen[door])
        assert filename == str(path), (door, seen[door])
        assert "/proc/self/fd" not in message and "ulimit -n" in message, (door, message)


FILE_SIZE_LIMIT = """
    import json, resource, sys, torch, fastckpt
    root = sys.argv[1]
    model = torch.nn.Linear(1024, 1024)
    fastckpt.save_checkpoint(root, models={"m": (model, None)})
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))  # ulimit -f 1024
    try:
        fastckpt.save_checkpoint(root, models={"m": (model, None)}, incremental=False)
        print(json.dumps(None))
    except OSError as err:
        print(json.dumps([err.errno, str(err)]))
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY,) * 2)
    print(json.dumps([c["index"] for c in fastckpt.list_checkpoints(root)]))
"""


def test_a_save_past_the_file_size_limit_names_the_checkpoint_and_the_limit(
    tmp_path: Path,
) -> None:
    """Before: ``[Errno 27] File too large`` naming a staging temp file
    (``ROOT/.tmp-1~<pid>~.../models/m.safetensors``, gone by then), nothing about the
    process's file-size limit (``ulimit -f``) or the fix; a full disk was explained."""
    import json

    root = tmp_path / "root"
    done = run_child(FILE_SIZE_LIMIT, str(root))
    assert done.returncode == 0, done.stdout + done.stderr
    error, indices = (json.loads(line) for line in done.stdout.splitlines()[-2:])
    assert error is not None and error[0] == errno.EFBIG, error
    message = error[1]
    assert f"while saving {root}:" in message, message
    assert "ulimit -f" in message and str(1 << 20) in message, message
    assert indices == [0]
