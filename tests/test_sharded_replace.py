"""Replacing and pruning indices of an FSDP2 TrainingStrategy root (issue 22.4 and 22.13):
the index's manifest commit is the one commit point of a replacement (its sharded part is
written where no other save writes and named by the index itself), readers see the old or the
new index whole, and prune deletes the sharded parts too.

Real 2-rank gloo saves killed with SIGKILL, a real writer process racing this one's loads.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch

import fastckpt
from dcp_support import TESTS, check_ok, compare, full_state, launch, spawn
from fastckpt.format.records import Manifest, seal_manifest
from sharded_ranks import training_fn

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _loaded(root: Path, index: int) -> tuple[int, dict[str, torch.Tensor]]:
    """Step count and gathered model/optimizer state of ``index``, loaded unsharded here."""
    strategy = fastckpt.TrainingStrategy.load_checkpoint(root, index, training_fn=training_fn)
    return strategy.step_count, full_state(strategy.models["main"], strategy.optimizers["main"])


def _reference(root: Path, step: int) -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(root.parent / f"reference-step{step}.safetensors")


def test_a_replacement_killed_before_its_manifest_commit_keeps_the_old_index_whole(
    tmp_path: Path,
) -> None:
    """Issue 22.4 (a): 2 ranks replace index 0 (step 2) with step 4; rank 0 is SIGKILLed right
    after the sharded part committed, before the manifest commit. Index 0 then loads the old
    state whole (step count and every weight and optimizer tensor) and verifies; the unfinished
    part is removed by the next prune."""
    root = tmp_path / "run"
    procs = spawn("replace_killed", root, 2, ranks="sharded_ranks")
    try:
        out, err = procs[0].communicate(timeout=240)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()
    assert procs[0].returncode == -9, err[-3000:]
    assert "replacing" in out and "replaced" not in out
    step, state = _loaded(root, 0)
    assert step == 2
    assert compare(_reference(root, 2), state) == []
    report = fastckpt.verify(root)
    assert report.ok, report.summary()
    parts = sorted(p.name for p in (root / "sharded" / "0").iterdir())
    assert len(parts) == 2, parts  # the committed part and the killed save's
    fastckpt.prune(root, keep_last=1)
    assert len(list((root / "sharded" / "0").iterdir())) == 1
    assert _loaded(root, 0)[0] == 2 and fastckpt.verify(root).ok


def _start_writer(root: Path, iterations: int) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(TESTS), "OMP_NUM_THREADS": "1"}
    code = "import sharded_ranks; sharded_ranks.replace_loop()"
    rendezvous = root.parent / "rendezvous-writer"
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            code,
            str(root),
            "0",
            str(rendezvous),
            "1",
            "index",
            str(iterations),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def test_loads_during_index_replacements_see_the_old_or_the_new_whole(tmp_path: Path) -> None:
    """Issue 22.4 (b): a process replaces index 0 of an FSDP2 strategy root in a loop,
    alternating the states of steps 2 and 4; every TrainingStrategy.load_checkpoint here
    meanwhile returns one of them whole (its step count with its own weights and optimizer
    state), none raises."""
    root = tmp_path / "run"
    writer = _start_writer(root, 40)
    loads = 0
    steps: dict[int, int] = {}
    try:
        ready = Path(f"{root}.ready")
        deadline = time.monotonic() + 240
        while not ready.exists():
            assert writer.poll() is None, writer.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the writer never got ready"
            time.sleep(0.05)
        expected = {step: _reference(root, step) for step in (2, 4)}
        while writer.poll() is None or loads < 5:
            step, state = _loaded(root, 0)
            assert step in expected, step
            assert compare(expected[step], state) == [], f"load {loads}: step {step} is torn"
            steps[step] = steps.get(step, 0) + 1
            loads += 1
    finally:
        if writer.poll() is None:
            writer.kill()
        _, err = writer.communicate()
    assert writer.returncode == 0, err[-3000:]
    assert loads >= 5 and len(steps) == 2, steps  # both states were seen
    assert fastckpt.verify(root).ok
    assert len(list((root / "sharded" / "0").iterdir())) == 1  # replaced parts are gone


@pytest.fixture(scope="module")
def three_indices(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Indices 0, 1, 2 (steps 1, 2, 3) of an FSDP2 strategy root saved by 2 gloo ranks."""
    root = tmp_path_factory.mktemp("indices") / "run"
    check_ok(launch("save_indices", root, 2, ranks="sharded_ranks"))
    return root


def test_prune_deletes_the_sharded_parts_of_the_indices_it_prunes(
    three_indices: Path, tmp_path: Path
) -> None:
    """Issue 22.13: prune(keep_last=1) deletes ROOT/sharded/0 and ROOT/sharded/1 with their
    indices; the kept index loads and verifies."""
    root = tmp_path / "run"
    shutil.copytree(three_indices, root)
    assert sorted(p.name for p in (root / "sharded").iterdir()) == ["0", "1", "2"]
    assert fastckpt.prune(root, keep_last=1) == [0, 1]
    assert sorted(p.name for p in (root / "sharded").iterdir()) == ["2"]
    assert _loaded(root, 2)[0] == 3 and fastckpt.verify(root).ok


_KILLED_PRUNE = """
import os, signal, sys
from fastckpt.format import records
commit = records.Manifest.commit
def commit_and_die(self):
    commit(self)
    os.kill(os.getpid(), signal.SIGKILL)
records.Manifest.commit = commit_and_die
import fastckpt
fastckpt.prune(sys.argv[1], keep_last=1)
"""


@pytest.mark.parametrize("next_step", ["prune", "save"])
def test_a_prune_killed_after_its_commit_leaves_sharded_parts_the_next_one_removes(
    three_indices: Path, tmp_path: Path, next_step: str
) -> None:
    """Issue 22.13: a prune SIGKILLed right after its manifest commit leaves the pruned
    indices' sharded parts (and directories) behind; the next prune, or the next save into
    the root, removes them, and the kept index still loads."""
    root = tmp_path / "run"
    shutil.copytree(three_indices, root)
    done = subprocess.run([sys.executable, "-c", _KILLED_PRUNE, str(root)], timeout=120)
    assert done.returncode == -9
    assert sorted(Manifest.load(root).entries) == [2]
    assert sorted(p.name for p in (root / "sharded").iterdir()) == ["0", "1", "2"]
    if next_step == "prune":
        assert fastckpt.prune(root, keep_last=1) == []
    else:
        fastckpt.save_checkpoint(root, models={"extra": torch.nn.Linear(2, 1)})
    assert sorted(p.name for p in (root / "sharded").iterdir()) == ["2"]
    assert _loaded(root, 2)[0] == 3 and fastckpt.verify(root).ok
    assert json.loads((root / "2" / "strategy.json").read_text())["sharded"]


def _to_layout_before_parts(root: Path, index: int) -> None:
    """Rewrite ``index`` as fastckpt wrote it before parts: its DCP checkpoint directly in
    ROOT/sharded/<index>, and no part named in its strategy.json (manifest resealed)."""
    directory = root / "sharded" / str(index)
    (part,) = directory.iterdir()
    for entry in part.iterdir():
        entry.rename(directory / entry.name)
    part.rmdir()
    recipe_path = root / str(index) / "strategy.json"
    recipe = json.loads(recipe_path.read_text())
    del recipe["sharded"]["part"], recipe["sharded"]["record_crc32c"]
    data = json.dumps(recipe, indent=1).encode()
    recipe_path.write_bytes(data)
    document = json.loads((root / "manifest.json").read_text())
    document["checkpoints"][str(index)]["files"]["strategy.json"] = {
        "size": len(data),
        "crc32c": fastckpt._native.crc32c(data),
    }
    (root / "manifest.json").write_text(json.dumps(seal_manifest(document), indent=1))


def test_an_index_written_before_parts_loads_verifies_and_is_left_alone(
    three_indices: Path, tmp_path: Path
) -> None:
    """Compatibility: an index whose sharded checkpoint is ROOT/sharded/<i> itself (written
    before parts) loads, verifies, exports; sweeps leave it alone; prune deletes it."""
    root = tmp_path / "run"
    shutil.copytree(three_indices, root)
    _to_layout_before_parts(root, 1)
    assert (root / "sharded" / "1" / "fastckpt-dcp.json").is_file()
    step, state = _loaded(root, 1)
    assert step == 2
    assert compare(_loaded(three_indices, 1)[1], state) == []
    report = fastckpt.verify(root)
    assert report.ok, report.summary()
    assert any(f.path.parent.parent.name == "1" for f in report.files if "sharded" in f.path.parts)
    out = tmp_path / "model.safetensors"
    done = subprocess.run(
        [sys.executable, "-m", "fastckpt", "export", str(root), "--index", "1", "--to", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert set(fastckpt.load_file(out)) == {
        k.removeprefix("model.") for k in state if k.startswith("model.")
    }
    fastckpt.save_checkpoint(root, models={"extra": torch.nn.Linear(2, 1)})  # sweeps
    assert (root / "sharded" / "1" / "fastckpt-dcp.json").is_file()
    assert fastckpt.prune(root, keep_last=2) == [0, 1]
    assert sorted(p.name for p in (root / "sharded").iterdir()) == ["2"]


def test_a_damaged_or_swapped_part_record_is_refused_by_load_and_verify(
    three_indices: Path, tmp_path: Path
) -> None:
    """The record of the part an index names must be the one the index recorded: a part
    record swapped with another index's (each valid on its own) is a ChecksumMismatchError on
    load and a mismatch in verify."""
    root = tmp_path / "run"
    shutil.copytree(three_indices, root)
    (one,) = (root / "sharded" / "1").iterdir()
    (two,) = (root / "sharded" / "2").iterdir()
    shutil.rmtree(one)
    shutil.copytree(two, one)  # index 1's part now holds index 2's (valid) checkpoint
    with pytest.raises(fastckpt.ChecksumMismatchError, match=r"strategy\.json"):
        _loaded(root, 1)
    report = fastckpt.verify(root)
    assert not report.ok and report.failed_indices() == [1], report.summary()


def test_the_sweep_keeps_an_earlier_part_that_a_live_writer_may_still_be_writing(
    tmp_path: Path,
) -> None:
    """Part names sort by the writer's clock: an earlier-named part of a live process (a
    replacement under way whose clock is behind) is kept; this process's own earlier parts,
    dead writers' parts and other hosts' parts older than the grace period go."""
    from fastckpt.container.sharded import parts

    host = parts.HOST
    named = f"p{2_000_000_000_000:013d}-00000000~{os.getpid()}~{host}"
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    names = {
        "live_other_process": f"p{1_999_999_999_000:013d}-11111111~{os.getppid()}~{host}",
        "own_earlier": f"p{1_999_999_999_500:013d}-22222222~{os.getpid()}~{host}",
        "dead_writer": f"p{1_999_999_999_600:013d}-33333333~{int(dead.stdout)}~{host}",
        "foreign_recent": f"p{1_999_999_999_700:013d}-44444444~123~elsewhere",
        "foreign_old": f"p{1_000_000_000_000:013d}-55555555~123~elsewhere",
    }
    for name in (*names.values(), named):
        (tmp_path / name).mkdir()
    doomed = {path.name for path in parts._doomed_entries(tmp_path, named)}
    assert doomed == {names["own_earlier"], names["dead_writer"], names["foreign_old"]}
