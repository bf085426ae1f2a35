"""Adversarial findings of round 14 on the command line, each run in-process through
``cli.main`` on real checkpoints.

* A hand-edited ``manifest.json`` (its own crc32c stale): ``export``, ``inspect`` and ``diff``
  acted on it (export wrote weights that were never saved, exit 0) while loads, ``ls`` and
  ``verify`` refused it.
* ``prune --dry-run`` reported deleting an index holding a user's file, which the real prune
  keeps; the real prune then said only "nothing to delete ... keeping the last 2".
* ``inspect --index 0`` while another process re-saves index 0 sometimes exited 2 ("index 0
  is not in ...", "no committed checkpoint yet"): the manifest was read once, mid-replacement.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch
from torch import nn

import fastckpt
from cli_support import Run, cli_runner
from fastckpt import _native


@pytest.fixture()
def run(capsys: pytest.CaptureFixture[str]) -> Run:
    """``cli.main(args)``: (status, stdout, stderr)."""
    return cli_runner(capsys)


def test_a_hand_edited_manifest_is_refused_by_export_inspect_and_diff(
    run: Run, tmp_path: Path
) -> None:
    """Before: export exited 0 and wrote the swapped-in 666.0 weights (never saved); inspect
    and diff showed the edited record. Now all three refuse it as load does (exit 2)."""
    root = tmp_path / "root"
    model = nn.Linear(4, 2)
    fastckpt.save_checkpoint(root, models={"main": (model, None)}, counters={"step": 1})
    tensors = root / "0" / "models" / "main.safetensors"
    swapped = {"weight": torch.full((2, 4), 666.0), "bias": torch.zeros(2)}
    safetensors.torch.save_file(swapped, str(tensors))
    data = tensors.read_bytes()
    manifest = json.loads((root / "manifest.json").read_text())
    record = {"size": len(data), "crc32c": _native.crc32c(data)}
    manifest["checkpoints"]["0"]["files"]["models/main.safetensors"] = record
    (root / "manifest.json").write_text(json.dumps(manifest))  # its own crc32c left stale
    out = tmp_path / "out.safetensors"
    other = tmp_path / "other.safetensors"
    safetensors.torch.save_file(swapped, str(other))
    for args in (
        ("export", root, "--to", out),
        ("inspect", root),
        ("inspect", root / "0"),
        ("diff", root, other),
    ):
        status, stdout, err = run(*args)
        assert status == 2, (args, stdout, err)
        assert "manifest.json" in err and "crc32c" in err, (args, err)
    assert not out.exists()


def save_three_with_notes(root: Path) -> None:
    """Indices 0, 1, 2 of a changing Linear; index 0's folder also holds a user's NOTES.md."""
    model = nn.Linear(8, 4)
    for step in range(3):
        with torch.no_grad():
            model.weight.add_(1)
        fastckpt.save_checkpoint(root, models={"main": (model, None)}, counters={"step": step})
    (root / "0" / "NOTES.md").write_text("my notes\n")


def test_prune_dry_run_keeps_an_index_holding_a_users_file_as_prune_does(
    run: Run, tmp_path: Path
) -> None:
    """Before: ``--dry-run`` said it would delete index 0 (deleted: [0]); the real prune kept
    it (a RuntimeWarning) and said only "nothing to delete: 3 index(es), keeping the last 2"."""
    root = tmp_path / "root"
    save_three_with_notes(root)
    with pytest.warns(RuntimeWarning, match="NOTES.md"):
        status, dry_text, _ = run("prune", root, "--keep-last", "2", "--dry-run")
    assert status == 0
    with pytest.warns(RuntimeWarning, match="NOTES.md"):
        status, dry_json, _ = run("--json", "prune", root, "--keep-last", "2", "--dry-run")
    assert status == 0
    with pytest.warns(RuntimeWarning, match="NOTES.md"):
        status, real_text, err = run("prune", root, "--keep-last", "2")
    assert status == 0
    assert json.loads(dry_json)["deleted"] == []
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["0", "1", "2"]
    assert dry_text == real_text
    assert "nothing to delete" in real_text and "index(es) 0 despite --keep-last 2" in real_text
    assert "is locked" not in err  # nothing was due: no lock to announce


def test_prune_dry_run_deletes_what_prune_deletes(run: Run, tmp_path: Path) -> None:
    """Without foreign files, the dry run and the prune name the same index (0)."""
    root = tmp_path / "root"
    save_three_with_notes(root)
    (root / "0" / "NOTES.md").unlink()
    status, dry_json, _ = run("--json", "prune", root, "--keep-last", "2", "--dry-run")
    assert status == 0
    status, real_json, _ = run("--json", "prune", root, "--keep-last", "2")
    assert status == 0
    assert json.loads(dry_json)["deleted"] == json.loads(real_json)["deleted"] == [0]


WRITER = """
import sys, torch, fastckpt
model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
for _ in range(int(sys.argv[2])):
    fastckpt.save_checkpoint(sys.argv[1], models={"main": (model, None)}, checkpoint_index=0)
print("done", flush=True)
"""


def test_inspect_an_index_another_process_replaces(run: Run, tmp_path: Path) -> None:
    """Before: ``inspect ROOT --index 0`` during a re-save of index 0 sometimes exited 2
    ("checkpoint index 0 is not in ...; available: [1]"); now it waits the replacement out."""
    root = tmp_path / "root"
    model = nn.Linear(4, 4)
    for _ in range(2):
        fastckpt.save_checkpoint(root, models={"main": (model, None)})
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(root), "60"], stdout=subprocess.PIPE, text=True
    )
    try:
        while not (root / ".fastckpt.lock").exists() and writer.poll() is None:
            time.sleep(0.001)  # the writer's first save has begun
        failures = []
        calls = 0
        while writer.poll() is None:
            calls += 1
            status, _, err = run("inspect", root, "--index", "0")
            if status != 0:
                failures.append(err)
        assert writer.wait() == 0
        assert calls > 0
        assert failures == []
    finally:
        writer.kill()
        writer.wait()
