"""Paths fastckpt cannot use as asked: a checkpoint another user may not read, a root another
user owns or a read-only filesystem holds, a file given as a root, a root path past PATH_MAX.
Each is a typed error (or, in ``verify``, a status) that names the path and says what is wrong
and the fix; none is reported as damage, and nothing committed changes.

The other user is ``nobody`` (``setpriv``, as root); those tests skip where that cannot be."""

from __future__ import annotations

import errno
import grp
import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import fastckpt
from fastckpt import list_checkpoints, load_checkpoint, prune, save_checkpoint, verify
from fastckpt.format.records import MANIFEST
from fastckpt.storage.lock import LOCK_FILE

#: Runs a script as ``nobody`` with no supplementary groups.
AS_NOBODY = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]


def _can_act_as_nobody() -> str | None:
    """Why a test cannot act as another user (None: it can)."""
    if os.geteuid() != 0:
        return "acting as another user needs root"
    if shutil.which("setpriv") is None:
        return "setpriv is not installed"
    try:
        pwd.getpwnam("nobody")
        grp.getgrnam("nogroup")
    except KeyError:
        return "no user nobody / group nogroup here"
    return None


@pytest.fixture
def shared() -> Iterator[Path]:
    """A folder ``nobody`` can reach (pytest's ``tmp_path`` lies under a folder of root's
    that only root may enter)."""
    why = _can_act_as_nobody()
    if why is not None:
        pytest.skip(why)
    folder = Path(tempfile.mkdtemp(prefix="fastckpt-r17-"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


#: Run by ``nobody``: each call named on the command line, printed as one JSON line each
#: (``{"call", "error", "errno", "filename", "message"}``, or ``"report"`` for verify).
_PROBE = """
import json, sys
import torch, fastckpt
root, calls = sys.argv[1], sys.argv[2:]
model = torch.nn.Linear(4, 4)
run = {
    "verify": lambda: fastckpt.verify(root),
    "load": lambda: fastckpt.load_checkpoint(root),
    "save": lambda: fastckpt.save_checkpoint(root, models={"m": (model, None)}),
    "prune": lambda: fastckpt.prune(root, keep_last=1),
    "latest_intact": lambda: fastckpt.latest_intact(root),
}
for call in calls:
    out = {"call": call}
    try:
        result = run[call]()
        if call == "verify":
            out["ok"] = result.ok
            out["files"] = [[f.path.name, f.status, f.message] for f in result.files]
    except Exception as err:
        out.update(error=type(err).__name__, errno=getattr(err, "errno", None),
                   filename=str(getattr(err, "filename", None)), message=str(err))
    print(json.dumps(out), flush=True)
"""


def as_nobody(root: Path, *calls: str) -> dict[str, dict[str, Any]]:
    """Run ``calls`` of :data:`_PROBE` on ``root`` as ``nobody``; their outcomes by name."""
    result = subprocess.run(
        [*AS_NOBODY, sys.executable, "-c", _PROBE, str(root), *calls],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    return {line["call"]: line for line in lines}


def cli_as_nobody(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m fastckpt ARGS`` as ``nobody``."""
    return subprocess.run(
        [*AS_NOBODY, sys.executable, "-m", "fastckpt", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def saved_root(root: Path, indices: int = 1) -> Path:
    """A save_checkpoint root of ``indices`` indices of a small model."""
    model = torch.nn.Linear(4, 4)
    for _ in range(indices):
        save_checkpoint(root, models={"m": (model, None)})
    return root


def chmod_tree(root: Path, folders: int, files: int) -> None:
    """Set the mode of every folder and file under ``root`` (``root`` included)."""
    root.chmod(folders)
    for directory, subdirs, names in os.walk(root):
        for name in subdirs:
            (Path(directory) / name).chmod(folders)
        for name in names:
            (Path(directory) / name).chmod(files)


# --------------------------------------------------------------------------- reading


def test_a_root_another_user_may_not_enter_is_a_permission_error_naming_it(
    shared: Path,
) -> None:
    """A root written under ``umask 077`` (folders 0700, files 0600), read by another user.
    Before, ``verify`` said ``FileNotFoundError: ... is not a fastckpt checkpoint: no
    manifest.json ...`` (the manifest is there; ``os.path.lexists`` is False on ``EACCES``),
    and the CLI printed a bare "Permission denied"."""
    root = saved_root(shared / "root")
    chmod_tree(root, 0o700, 0o600)
    found = as_nobody(root, "verify", "load", "latest_intact")
    for call in ("verify", "load", "latest_intact"):
        outcome = found[call]
        assert outcome.get("error") == "PermissionError", outcome
        assert outcome["errno"] == errno.EACCES, outcome
        assert str(root) in outcome["message"], outcome
        assert "not a fastckpt checkpoint" not in outcome["message"], outcome
        assert "belongs to root (uid 0)" in outcome["message"], outcome
        assert "runs as nobody" in outcome["message"], outcome
        assert "read access" in outcome["message"], outcome
    cli = cli_as_nobody("verify", str(root))
    assert cli.returncode == 2, cli
    assert "permission" in cli.stderr.lower() and "nobody" in cli.stderr, cli.stderr
    assert verify(root).ok  # its owner still reads it


def test_files_another_user_may_not_read_are_unreadable_not_corrupt(shared: Path) -> None:
    """Folders 0755, files 0600 (the manifest too, or only the index's files). Before, every
    such file was ``corrupt`` and ``fastckpt verify`` printed ``BAD ... corrupt`` with exit 1,
    as for damage: an operator could delete a good checkpoint. Now they are ``unreadable``,
    the message names the permission problem, and the CLI exits 2 (could not check)."""
    root = saved_root(shared / "root")
    chmod_tree(root, 0o755, 0o600)
    outcome = as_nobody(root, "verify")["verify"]
    assert outcome["ok"] is False, outcome
    assert [f[:2] for f in outcome["files"]] == [[MANIFEST, "unreadable"]], outcome
    assert "permission" in outcome["files"][0][2].lower(), outcome
    cli = cli_as_nobody("verify", str(root))
    assert cli.returncode == 2, cli
    assert "corrupt" not in cli.stdout and "BAD" not in cli.stdout, cli.stdout
    assert "unreadable" in cli.stdout.lower(), cli.stdout

    (root / MANIFEST).chmod(0o644)  # the manifest readable, the tensor files not
    outcome = as_nobody(root, "verify")["verify"]
    statuses = {name: status for name, status, _ in outcome["files"]}
    assert statuses[MANIFEST] == "ok", outcome
    assert set(statuses) - {MANIFEST} and {
        status for name, status in statuses.items() if name != MANIFEST
    } <= {"unreadable", "ok"}, outcome
    assert "unreadable" in statuses.values(), outcome
    cli = cli_as_nobody("verify", str(root))
    assert cli.returncode == 2 and "corrupt" not in cli.stdout, cli
    assert verify(root).ok


# --------------------------------------------------------------------------- writing


def test_saving_into_or_pruning_a_root_another_user_owns_says_so(shared: Path) -> None:
    """A root saved by root (umask 022), then saved into and pruned by another user. Before,
    both raised a bare ``PermissionError: [Errno 13] Permission denied: ROOT/.fastckpt.lock``.
    Now the error names the root, says it is not writable by this user, that nothing was
    saved or deleted, and the fix; both indices stay committed."""
    root = saved_root(shared / "root", indices=2)
    found = as_nobody(root, "save", "prune")
    for call in ("save", "prune"):
        outcome = found[call]
        assert outcome.get("error") == "PermissionError", outcome
        assert outcome["errno"] == errno.EACCES and outcome["filename"] == str(root), outcome
        message = outcome["message"]
        assert "nobody" in message and "may not write" in message, message
        assert "nothing was saved" in message and "intact" in message, message
        assert "write access" in message, message
    assert [c["index"] for c in list_checkpoints(root)] == [0, 1]
    assert verify(root).ok and not (root / LOCK_FILE).exists()


def test_a_prune_on_a_read_only_filesystem_is_explained(tmp_path: Path) -> None:
    """Before, ``prune`` of a root on a filesystem remounted read-only raised a bare
    ``OSError: [Errno 30] Read-only file system: ROOT/.fastckpt.lock`` (a save already said
    nothing was committed and how out)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(disk)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root and mount rights)")
    try:
        root = saved_root(disk / "root", indices=2)
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        with pytest.raises(OSError) as caught:
            prune(root, keep_last=1)
        assert caught.value.errno == errno.EROFS and caught.value.filename == str(root)
        message = str(caught.value)
        assert "read-only filesystem" in message and "nothing was saved" in message, message
        assert "remount it read-write" in message, message
        assert [c["index"] for c in list_checkpoints(root)] == [0, 1] and verify(root).ok
    finally:
        subprocess.run(["umount", str(disk)], check=False)


# --------------------------------------------------------------------------- wrong kind


def test_a_file_given_as_a_root_says_it_is_a_file_and_what_reads_it(tmp_path: Path) -> None:
    """Before, ``load_checkpoint`` / ``list_checkpoints`` of a ``.safetensors`` file raised a
    bare ``NotADirectoryError`` naming ``FILE/manifest.json``; now the error names the file,
    says it is a file, not a root, and which reader to use."""
    path = tmp_path / "model.safetensors"
    fastckpt.save_file({"w": torch.zeros(3)}, path)
    for call in (lambda: load_checkpoint(path), lambda: list_checkpoints(path)):
        with pytest.raises(NotADirectoryError) as caught:
            call()
        message = str(caught.value)
        assert caught.value.filename == str(path), message
        assert f"{path} is a file" in message and "fastckpt.load_file" in message, message
        assert "torch.load" in message and f"{MANIFEST}'" not in message, message
    below = path / "run"  # a root asked for below a file
    with pytest.raises(NotADirectoryError, match=f"{path} is a file"):
        load_checkpoint(below)


# --------------------------------------------------------------------------- long paths


def test_a_root_path_past_path_max_says_nothing_was_committed(tmp_path: Path) -> None:
    """A root whose path is a few bytes under PATH_MAX (4096): the files of an index under it
    pass the limit. Before: a bare ``OSError: [Errno 36] File name too long`` naming a
    temporary path; now the message names the root, the limit, that nothing was committed
    and the fix, and nothing is left behind."""
    deep = tmp_path
    while len(str(deep)) < 4096 - 40:
        deep = deep / ("d" * min(200, 4096 - 40 - len(str(deep)) - 1))
    with pytest.raises(OSError) as caught:
        saved_root(deep)
    assert caught.value.errno == errno.ENAMETOOLONG
    message = str(caught.value)
    assert f"while saving {deep}" in message and "nothing of this save" in message, message
    assert "4096" in message and "shorter path" in message, message
    left = [name for _, dirs, files in os.walk(tmp_path) for name in dirs + files]
    assert all(set(name) == {"d"} for name in left), left


def test_the_unreadable_text_counts_unreadable_files_and_still_names_unchecked_ones() -> None:
    """A report holding unreadable files and files whose bytes carry no checksums: the text
    counted every failure as unreadable (the unchecked ones too), and then (review 3) left
    the unchecked files unsaid. Now it counts the unreadable ones and says how many are
    unchecked."""
    from fastckpt.cli.verify import _verify_text
    from fastckpt.container.reader import FileReport
    from fastckpt.container.report import VerifyReport

    report = VerifyReport(
        Path("/ckpt"),
        "file",
        files=[
            FileReport(Path("/ckpt/a"), "unreadable", message="/ckpt/a: Permission denied"),
            FileReport(Path("/ckpt/b"), "unreadable", message="/ckpt/b: Permission denied"),
            FileReport(Path("/ckpt/c"), "unchecked", unchecked_tensors=["w"]),
        ],
    )
    text = _verify_text(report, 1.0, None)
    assert text.startswith("UNREADABLE: /ckpt: 2 of 3 file(s) may not be read"), text
    assert "/ckpt/c" not in text.splitlines()[1]
    assert "and 1 file(s) have tensors without checksums" in text, text


@pytest.mark.parametrize("folders", [0o755, 0o711])
def test_a_prune_that_could_commit_but_not_delete_is_refused_before_its_commit(
    shared: Path, folders: int
) -> None:
    """A root folder every user may write (mode 0777) holding index folders of root's
    (umask 022), pruned by another user (round 19). Before, the prune committed (the indices
    no longer listed), could not delete their folders, and returned them as deleted: their
    bytes stayed, renamed aside, with a warning. Now it is refused before its commit, naming
    the folder and who owns it; every index stays committed."""
    root = saved_root(shared / "root", indices=3)
    for index in range(3):  # a folder nobody may not list (0711): review of the first version
        for folder, _, _ in os.walk(root / str(index)):
            Path(folder).chmod(folders)
    root.chmod(0o777)
    outcome = as_nobody(root, "prune")["prune"]
    assert outcome.get("error") == "PermissionError", outcome
    assert outcome["errno"] == errno.EACCES, outcome
    message = outcome["message"]
    assert outcome["filename"] in message and "may not delete" in message, message
    assert "root (uid 0)" in message and "nothing was deleted" in message, message
    assert [c["index"] for c in list_checkpoints(root)] == [0, 1, 2]
    assert sorted(p.name for p in root.iterdir() if p.name.startswith(".tmp")) == []
    chmod_tree(root, 0o755, 0o644)
    assert verify(root).ok
