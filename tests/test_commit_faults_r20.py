"""Failures after a commit point are reported as what they are (round 20, faults).

System calls are failed for real in a child process by an ``LD_PRELOAD`` shim
(``tests/fault_shim.c``, compiled here with ``gcc``): it fails the Nth call of one libc
function (``fsync``, ``rename``, ``read``...) on one path with the errno asked for.

Before:

- an ``fsync`` of the folder that failed *after* the commit rename (a CheckpointManager's swap,
  ``manifest.json``'s rename) raised a bare ``OSError(5)`` although the new checkpoint was in
  place and loaded, and a CheckpointManager replacing an id then deleted the previous
  checkpoint (the staging folder its abort removed held it after the swap);
- ``save_checkpoint`` whose ``fsync`` of the root failed right after the index folder was
  renamed into place left that uncommitted ``ROOT/<i>``;
- a ``read`` of ``manifest.json`` failing with ``EIO`` gave an ``OSError`` naming no file;
- a prune whose rename of a dropped index to ``.tmp-gone-*`` failed after its manifest commit
  raised a bare ``OSError``, and later prunes left the dropped folders on disk;
- a failed ``fastckpt promote`` left its hidden ``.tmp-*`` staging folder in the durable root.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SHIM_SOURCE = Path(__file__).with_name("fault_shim.c")


@pytest.fixture(scope="module")
def shim(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fault shim, compiled for this run."""
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("gcc is needed to build the LD_PRELOAD fault shim (tests/fault_shim.c)")
    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        pytest.skip("the fault shim wraps glibc's functions through LD_PRELOAD (Linux, glibc)")
    built = tmp_path_factory.mktemp("shim") / "shim.so"
    compiled = subprocess.run(
        [gcc, "-O1", "-shared", "-fPIC", "-o", str(built), str(SHIM_SOURCE), "-ldl"],
        capture_output=True,
        text=True,
    )
    # On Linux with glibc the shim must build: a broken tests/fault_shim.c fails, never skips.
    assert compiled.returncode == 0, compiled.stderr
    return built


def run_child(
    code: str, *args: str, faults: dict[str, str] | None = None, shim: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """``code`` run by a fresh interpreter with ``args`` as ``sys.argv[1:]``; with ``faults``
    (the shim's ``FS_*`` settings) under the fault shim."""
    env = dict(os.environ)
    if faults:
        assert shim is not None
        env.update(faults, LD_PRELOAD=str(shim))
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


def ok(done: subprocess.CompletedProcess[str]) -> str:
    """The child's output, once it is known to have succeeded."""
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


SAVE_ROOT = """
import sys, torch, fastckpt
root, step = sys.argv[1], int(sys.argv[2])
lin = torch.nn.Linear(2, 2)
with torch.no_grad():
    lin.weight.fill_(step)
try:
    print("index", fastckpt.save_checkpoint(root, models={"m": (lin, None)}))
except OSError as err:
    print("raised", type(err).__name__, err.errno, err.filename)
    print("message", err)
"""

LOAD_ROOT = """
import sys, fastckpt
root = sys.argv[1]
state = fastckpt.load_checkpoint(root)
print(state["models"]["m"]["model"].weight.flatten()[0].item(),
      [c["index"] for c in fastckpt.list_checkpoints(root)])
"""


def test_a_manager_replacement_whose_folder_fsync_fails_says_committed_and_keeps_the_old(
    tmp_path: Path, shim: Path
) -> None:
    """The fsync of the parent folder after the swap of ``runs/ck`` fails. Before: a bare
    ``OSError(5)``, and the previous checkpoint (in the staging folder after the swap) was
    deleted by the abort. Now: :class:`CommitNotDurableError` (errno kept), the new checkpoint
    loads, the previous one is kept where the message says."""
    save = """
    import sys, torch, fastckpt
    path, step = sys.argv[1], int(sys.argv[2])
    m = fastckpt.CheckpointManager(fastckpt.CheckpointManager.Config.with_sync_save())
    try:
        m.save(path, {"w": torch.full((4,), float(step)), "step": step})
        print("saved")
    except OSError as err:
        print("raised", type(err).__name__, err.errno)
        print("message", err)
    m.close()
    """
    runs = tmp_path / "runs"
    assert "saved" in ok(run_child(save, str(runs / "ck"), "1"))
    faults = {"FS_CALL": "fsync", "FS_PATHEQ": str(runs), "FS_N": "1", "FS_ERR": "5"}
    out = ok(run_child(save, str(runs / "ck"), "2", faults=faults, shim=shim))
    assert "raised CommitNotDurableError 5" in out, out
    assert "fastckpt verify" in out and "power cut" in out, out
    load = """
    import sys, fastckpt
    m = fastckpt.CheckpointManager(fastckpt.CheckpointManager.Config.with_sync_save())
    print(m.load(sys.argv[1])["step"])
    m.close()
    """
    assert ok(run_child(load, str(runs / "ck"))).split() == ["2"]
    (kept,) = [p for p in runs.iterdir() if p.name != "ck"]  # the previous checkpoint, whole
    assert str(kept) in out, out
    assert ok(run_child(load, str(kept))).split() == ["1"]


def test_save_checkpoint_whose_manifest_fsync_fails_says_committed(
    tmp_path: Path, shim: Path
) -> None:
    """The second fsync of ROOT in a save (after ``manifest.json``'s rename) fails. Before: a
    bare ``OSError(5)`` (only a log line said "may have been applied"). Now:
    :class:`CommitNotDurableError` naming the folder, and index 1 is committed and latest."""
    root = tmp_path / "root"
    assert "index 0" in ok(run_child(SAVE_ROOT, str(root), "1"))
    faults = {"FS_CALL": "fsync", "FS_PATHEQ": str(root), "FS_N": "2", "FS_ERR": "5"}
    out = ok(run_child(SAVE_ROOT, str(root), "2", faults=faults, shim=shim))
    assert f"raised CommitNotDurableError 5 {root}" in out, out
    assert ok(run_child(LOAD_ROOT, str(root))).split() == ["2.0", "[0,", "1]"]


def test_save_checkpoint_whose_fsync_after_placing_the_index_fails_leaves_no_index(
    tmp_path: Path, shim: Path
) -> None:
    """The first fsync of ROOT in a save (right after ``ROOT/1`` is renamed into place, before
    the manifest names it) fails. Before: the uncommitted ``ROOT/1`` stayed. Now: a plain
    ``OSError`` (nothing was committed) and no ``ROOT/1``."""
    root = tmp_path / "root"
    assert "index 0" in ok(run_child(SAVE_ROOT, str(root), "1"))
    faults = {"FS_CALL": "fsync", "FS_PATHEQ": str(root), "FS_N": "1", "FS_ERR": "5"}
    out = ok(run_child(SAVE_ROOT, str(root), "2", faults=faults, shim=shim))
    assert "raised OSError 5" in out, out
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == [
        "0",
        "manifest.json",
    ]
    assert ok(run_child(LOAD_ROOT, str(root))).split() == ["1.0", "[0]"]


def test_an_unreadable_manifest_names_itself(tmp_path: Path, shim: Path) -> None:
    """Every ``read`` of ``manifest.json`` fails with EIO. Before: ``OSError(5)`` with
    ``filename`` None. Now the errno is kept and the file named."""
    root = tmp_path / "root"
    ok(run_child(SAVE_ROOT, str(root), "1"))
    load = """
    import sys, fastckpt
    try:
        fastckpt.load_checkpoint(sys.argv[1])
    except OSError as err:
        print(type(err).__name__, err.errno, err.filename)
    """
    faults = {
        "FS_CALL": "read",
        "FS_PATH": str(root / "manifest.json"),
        "FS_N": "1",
        "FS_M": "0",
        "FS_ERR": "5",
    }
    out = ok(run_child(load, str(root), faults=faults, shim=shim))
    assert out.split() == ["OSError", "5", str(root / "manifest.json")], out


def test_a_failed_promote_leaves_no_staging_folder(tmp_path: Path, shim: Path) -> None:
    """The 5th fsync under the promote's staging folder (``publish``'s fsync of its
    ``models/`` folder) fails. Before: exit 2 and the hidden ``.tmp-0~...`` folder stayed in
    the durable root. Now: exit 2 and nothing is left there."""
    fast, durable = tmp_path / "fast", tmp_path / "durable"
    ok(run_child(SAVE_ROOT, str(fast), "1"))
    durable.mkdir()
    faults = {"FS_CALL": "fsync", "FS_PATH": f"{durable}/.tmp-0", "FS_N": "5", "FS_ERR": "5"}
    env = {**os.environ, **faults, "LD_PRELOAD": str(shim)}
    done = subprocess.run(
        [sys.executable, "-m", "fastckpt", "promote", str(fast), str(durable)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Input/output error" in done.stderr, done.stderr
    assert sorted(os.listdir(durable)) == [], sorted(os.listdir(durable))


PRUNE_ROOT = """
import sys, warnings, fastckpt
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as seen:
    try:
        print("pruned", fastckpt.prune(sys.argv[1], keep_last=2))
    except OSError as err:
        print("raised", type(err).__name__, err)
for warning in seen:
    print("warned", warning.category.__name__, warning.message)
"""


def test_a_prune_whose_folder_cannot_be_moved_aside_after_its_commit_warns(
    tmp_path: Path, shim: Path
) -> None:
    """The prune's second rename (``ROOT/0`` to its hidden ``.tmp-gone-*`` name, after the
    manifest's rename) fails with EIO. Before: a bare ``OSError(5)`` not saying that indices 0
    and 1 were already pruned. Now the prune returns them, with a warning naming the folder
    left, and the next save removes it."""
    root = tmp_path / "root"
    for step in range(4):
        assert f"index {step}" in ok(run_child(SAVE_ROOT, str(root), str(step)))
    faults = {"FS_CALL": "rename", "FS_PATH": str(root), "FS_N": "2", "FS_ERR": "5"}
    out = ok(run_child(PRUNE_ROOT, str(root), faults=faults, shim=shim))
    assert "pruned [0, 1]" in out and "raised" not in out, out
    assert f"warned RuntimeWarning {root / '0'}: index 0 is pruned" in out, out
    assert (root / "0").is_dir()
    assert ok(run_child(LOAD_ROOT, str(root))).split() == ["3.0", "[2,", "3]"]
    assert "index 4" in ok(run_child(SAVE_ROOT, str(root), "4"))
    assert not (root / "0").exists() and not (root / "1").exists()
