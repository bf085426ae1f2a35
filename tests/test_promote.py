"""Promotion of committed indices from one root to another (the first piece of tiers).

Real files with fsync, real SIGKILLed processes (forked warm from the crash harness's
forkserver), a real moto server for ``s3://`` targets, a fresh process for the bitwise load.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import fastckpt
from fastckpt.container.promote import Promoter, forget_promoted, promote, promote_index
from fastckpt.errors import (
    CheckpointFormatError,
    ChecksumMismatchError,
    DamagedSourceError,
    MixedRunError,
    NotCommittedError,
    PromotionError,
)
from fastckpt.format.records import Manifest
from s3_support import S3Server, s3_server

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import crash_harness

import training_support

__all__ = ["s3_server"]  # a fixture used by name below

#: Kills of a promoting process (each checked); FASTCKPT_CRASH_KILLS_SCALE scales it.
KILLS = round(100 * float(os.environ.get("FASTCKPT_CRASH_KILLS_SCALE", "1")))


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.Linear(1024, 256))


def _source(root: Path, saves: int = 3) -> list[dict[str, torch.Tensor]]:
    """``saves`` indices of a training run in ``root`` (incremental: the first layer frozen,
    so later indices hold it as a link inside themselves); returns each index's weights."""
    model = _model(0)
    model[0].requires_grad_(False)
    optimizer = torch.optim.SGD(model[1].parameters(), lr=0.1)
    states = []
    for step in range(saves):
        model(torch.randn(4, 512)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        fastckpt.save_checkpoint(
            root,
            models={"main": (model, None)},
            optimizers={"sgd": (optimizer, None)},
            counters={"step": step},
        )
        states.append({k: v.clone() for k, v in model.state_dict().items()})
    return states


def _source_more(root: Path) -> None:
    """One more index in ``root`` (a fresh model, saved in full)."""
    fastckpt.save_checkpoint(root, models={"main": (_model(1), None)}, incremental=False)


def _files(root: str | Path, index: int) -> dict[str, tuple[int, int]]:
    entry = Manifest.load(root).entries[index]
    return {name: (r["size"], r["crc32c"]) for name, r in entry["files"].items()}


def test_a_promoted_root_loads_bitwise_in_a_fresh_process(tmp_path: Path) -> None:
    fast, durable = tmp_path / "fast", tmp_path / "durable"
    states = _source(fast)
    report = promote(fast, durable)
    assert report.promoted == [0, 1, 2] and report.skipped == []
    assert report.bytes_copied > 0
    for index in range(3):
        assert _files(durable, index) == _files(fast, index)
        assert Manifest.load(durable).entries[index]["counters"] == {"step": index}
    again = promote(fast, durable)
    assert again.promoted == [] and again.skipped == [0, 1, 2] and again.bytes_copied == 0
    # Self-contained: the fast tier gone, the durable copy loads and verifies on its own.
    for path in sorted(fast.rglob("*"), reverse=True):
        path.unlink() if path.is_file() else path.rmdir()
    torch.save(states[2], tmp_path / "expected.pt")
    script = (
        "import sys, torch, fastckpt\n"
        "expected = torch.load(sys.argv[2])\n"
        "assert fastckpt.verify(sys.argv[1]).ok\n"
        "got = fastckpt.load_checkpoint(sys.argv[1])['models']['main']['model'].state_dict()\n"
        "assert set(got) == set(expected)\n"
        "assert all(torch.equal(got[k], v) for k, v in expected.items())\n"
        "print('bitwise')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(durable), str(tmp_path / "expected.pt")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and done.stdout.strip() == "bitwise", done.stderr


def test_every_and_the_newest_and_the_command_line(tmp_path: Path) -> None:
    fast, durable = tmp_path / "fast", tmp_path / "durable"
    _source(fast, saves=5)
    assert promote(fast, durable, every=2).promoted == [0, 2, 4]
    assert promote(tmp_path / "fast", tmp_path / "other", every=3).promoted == [0, 3, 4]
    report = promote(fast, tmp_path / "cadence", every=2, newest=False)
    assert report.promoted == [0, 2, 4]
    # Only what is newer than the target's newest index is copied: 1 and 3 are not due
    # there any more (a target pruned by its own retention does not get old indices back).
    _source_more(fast)
    command = [sys.executable, "-m", "fastckpt", "promote", str(fast), str(durable), "--json"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    assert answer["promoted"] == [5] and answer["skipped"] == [0, 1, 2, 3, 4]
    assert answer["bytes_copied"] == sum(size for size, _ in _files(fast, 5).values())
    same = subprocess.run(
        [sys.executable, "-m", "fastckpt", "promote", str(fast), str(fast)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert same.returncode == 2 and "into itself" in same.stderr, same.stderr
    assert "Traceback" not in same.stderr


def test_a_rerun_that_promotes_nothing_names_the_indices_the_target_lacks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A target holding the source's newest index but not every older one is not said to
    hold every index: the message names what it lacks and why they are not promoted.
    Before: "already holds every index" (and a passed-over index was never mentioned)."""
    from fastckpt.cli.main import main as cli

    fast, durable = tmp_path / "fast", tmp_path / "durable"
    _source(fast, saves=5)
    assert promote(fast, durable, every=2).promoted == [0, 2, 4]
    assert cli(["promote", str(fast), str(durable)]) == 0
    said = capsys.readouterr().out
    assert "lacks 1, 3" in said and "every index" not in said, said
    assert promote(fast, tmp_path / "all").promoted == [0, 1, 2, 3, 4]
    assert cli(["promote", str(fast), str(tmp_path / "all")]) == 0
    assert "already holds every index" in capsys.readouterr().out
    plain = tmp_path / "plain.safetensors"
    fastckpt.save_file({"x": torch.ones(1)}, plain)
    assert cli(["promote", str(fast), str(plain)]) == 2  # before: a raw "Not a directory"
    assert "is a file, not a folder" in capsys.readouterr().err


def test_a_target_newest_index_from_another_run_is_kept_not_replaced(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Node 1's stale fast root promoted into a durable root whose newest index (same number)
    came from node 2, where the run went on (saved later): before, the verifying newest
    checkpoint was replaced by node 1's older state (exit 0, "promoted index(es) 2"). Now it
    is kept and named (exit 1); a damaged copy there is still repaired, and a source index
    re-saved later in place still replaces its copy."""
    from fastckpt.cli.main import main as cli

    node1, node2, durable = tmp_path / "node1", tmp_path / "node2", tmp_path / "durable"
    _source(node1, saves=3)
    assert promote(node1, durable, within={0, 1}).promoted == [0, 1]
    shutil.copytree(durable, node2)
    _source_more(node2)  # node 2's index 2: another state
    assert promote(node2, durable).promoted == [2]
    newest = _files(durable, 2)
    assert cli(["promote", str(node1), str(durable)]) == 1
    said = capsys.readouterr()
    assert "holds another checkpoint as its index 2" in said.err
    assert "every index" not in said.out
    assert _files(durable, 2) == newest and fastckpt.verify(durable, 2).ok
    report = promote(node1, durable)
    assert report.conflicting == [2] and report.promoted == []
    # A copy there that does not verify is another matter: the source's replaces it.
    victim = next(p for p in (durable / "2").rglob("*.safetensors") if p.stat().st_nlink == 1)
    with open(victim, "r+b") as handle:
        handle.seek(-1, os.SEEK_END)
        byte = handle.read(1)
        handle.seek(-1, os.SEEK_END)
        handle.write(bytes([byte[0] ^ 0xFF]))
    assert promote(node1, durable).promoted == [2]
    assert _files(durable, 2) == _files(node1, 2) and fastckpt.verify(durable, 2).ok
    # An index re-saved in place (checkpoint_index=) after its promotion is newer than the
    # copy there: promoted again, as before.
    fastckpt.save_checkpoint(node1, models={"main": (_model(7), None)}, checkpoint_index=2)
    assert promote(node1, durable).promoted == [2]
    assert _files(durable, 2) == _files(node1, 2)


def test_a_damaged_source_file_is_refused_and_the_target_is_untouched(tmp_path: Path) -> None:
    fast, durable = tmp_path / "fast", tmp_path / "durable"
    _source(fast)
    promote_index(fast, durable, 0)
    before = (durable / "manifest.json").read_bytes()
    weights = fast / "1" / "models" / "main.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x10
    weights.write_bytes(bytes(data))
    with pytest.raises(ChecksumMismatchError, match=r"1/models/main\.safetensors"):
        promote_index(fast, durable, 1)
    assert (durable / "manifest.json").read_bytes() == before
    assert sorted(os.listdir(durable)) == ["0", "manifest.json"]
    (fast / "2" / "refs.json").unlink()
    with pytest.raises(CheckpointFormatError, match=r"2/refs\.json: missing"):
        promote_index(fast, durable, 2)
    with pytest.raises(NotCommittedError, match="no committed index 7"):
        promote_index(fast, durable, 7)
    assert fastckpt.verify(durable).ok


def _damage_index(root: Path, index: int) -> None:
    """Flip one byte of index ``index``'s weights in ``root`` (a rotten sector)."""
    weights = root / str(index) / "models" / "main.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x10
    weights.write_bytes(bytes(data))


def test_a_damaged_due_index_is_passed_over_and_the_later_ones_are_promoted(
    tmp_path: Path,
) -> None:
    """A due fast index that rotted before its promotion (the trainer killed first) can never
    be promoted: the promoter passes over it for the later ones, in the same run, and reports
    it (a PromotionError caused by DamagedSourceError naming it); the next run is healthy.
    Before, it was retried first at every run and the durable tier never advanced again;
    ``fastckpt promote`` likewise promotes past it and exits 1 naming it."""
    fast, durable = tmp_path / "fast", tmp_path / "durable"
    model = torch.nn.Linear(64, 4)

    def save(step: int) -> None:
        with torch.no_grad():
            model.weight.fill_(float(step))
        fastckpt.save_checkpoint(fast, models={"main": (model, None)}, incremental=False)

    for step in range(3):
        save(step)
    promote_index(fast, durable, 0)
    _damage_index(fast, 2)  # due (every=2), never promoted
    promoter = Promoter(fast, durable, every=2)
    save(3)
    save(4)
    promoter.submit()
    promoter.wait()
    assert sorted(Manifest.load(durable).entries) == [0, 4]
    assert not promoter.healthy and promoter.error is not None
    cause = promoter.error.__cause__
    assert isinstance(cause, DamagedSourceError), cause
    assert "index 2: ChecksumMismatchError" in str(cause)
    assert "main.safetensors" in str(cause)
    save(5)
    save(6)
    promoter.submit()
    promoter.close()  # the last run succeeded: nothing raised
    assert sorted(Manifest.load(durable).entries) == [0, 4, 6]
    assert fastckpt.verify(durable).ok
    # The command line: index 2 passed over, 6 (newer than the target's) promoted.
    other = tmp_path / "other"
    promote_index(fast, other, 0)
    run = subprocess.run(
        [sys.executable, "-m", "fastckpt", "promote", str(fast), str(other), "--every", "2"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 1, run.stderr
    assert "index 2" in run.stderr and "does not verify" in run.stderr, run.stderr
    assert sorted(Manifest.load(other).entries) == [0, 4, 6]
    # The newest due index damaged: an error, nothing passed over silently.
    _damage_index(fast, 6)
    with pytest.raises(ChecksumMismatchError, match=r"6/models/main\.safetensors"):
        promote(fast, tmp_path / "third", every=2)


def test_sigkill_at_random_moments_of_promotions_never_leaves_a_partial_index(
    tmp_path: Path,
) -> None:
    """A promoting process is killed ``KILLS`` times at random moments (replacing indices the
    target already holds too). After every kill the target verifies, and every index its
    manifest names has exactly the source's files; the next promotion finishes the job and
    leaves no leftovers."""
    fast, durable = tmp_path / "fast", tmp_path / "durable"
    _source(fast)
    rng = random.Random(26)
    kills = inside = completed = 0
    while kills < KILLS:
        index = rng.randrange(3)
        ended = crash_harness.kill_after(
            crash_harness.promote_and_report, (str(fast), str(durable), index), rng.uniform(0, 0.04)
        )
        kills += ended.killed
        if ended.promoted:
            completed += 1
        elif ended.exitcode == -signal.SIGKILL:
            inside += 1
        else:
            pytest.fail(f"the child failed (exit code {ended.exitcode})")
        manifest = Manifest.load(durable)
        for committed in manifest.entries:
            assert _files(durable, committed) == _files(fast, committed), (kills, committed)
        if manifest.entries:
            report = fastckpt.verify(durable)
            assert report.ok, (kills, report)
    print(f"{kills} kills, {inside} inside a promotion, {completed} promotions completed")
    assert inside >= KILLS // 3, (inside, completed)
    report = promote(fast, durable)  # finishes the job: the newest index is there, whole
    assert sorted(report.promoted + report.skipped) == [0, 1, 2]
    assert Manifest.load(durable).latest == 2 and _files(durable, 2) == _files(fast, 2)
    left = set(os.listdir(durable))  # what killed promotions left was removed
    assert left <= {"0", "1", "2", "manifest.json"} and {"2", "manifest.json"} <= left, left
    assert fastckpt.verify(durable).ok


def test_promotion_to_s3_and_back(s3_server: S3Server, tmp_path: Path) -> None:
    fast = tmp_path / "fast"
    states = _source(fast)
    durable = s3_server.url("durable")
    fastckpt.configure_storage(durable, s3_server.options())
    assert promote(fast, durable).promoted == [0, 1, 2]
    assert fastckpt.verify(durable).ok
    got = fastckpt.load_checkpoint(durable)["models"]["main"]["model"].state_dict()
    assert all(torch.equal(got[k], v) for k, v in states[2].items())
    # A new node: the fast tier restored from the durable one.
    restored = tmp_path / "restored"
    assert promote(durable, restored).promoted == [0, 1, 2]
    loaded: Any = fastckpt.load_checkpoint(restored, 1)["models"]["main"]["model"]
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in states[1].items())


# --------------------------------------------------------------------------- unchanged files


def _inode(path: Path) -> int:
    return os.stat(path).st_ino


def test_unchanged_files_are_linked_not_copied_and_each_index_stays_self_contained(
    tmp_path: Path,
) -> None:
    fast, durable = tmp_path / "fast", tmp_path / "durable"
    forget_promoted()
    states = _source(fast, saves=4)  # the first layer frozen: linked/ in indices 1..3
    frozen = _files(fast, 0)["models/main.safetensors"][0]
    report = promote(fast, durable, every=2)
    assert report.promoted == [0, 2, 3]
    # Index 2's linked file is index 0's tensor file, proven by its digest: a hard link in
    # the durable tier, not a second copy (and so for index 3).
    for index in (2, 3):
        assert _inode(durable / str(index) / "linked" / "0.safetensors") == _inode(
            durable / "0" / "models" / "main.safetensors"
        )
    assert report.bytes_reused >= 2 * frozen
    total = sum(sum(size for size, _ in _files(fast, i).values()) for i in (0, 2, 3))
    assert report.bytes_copied + report.bytes_reused == total
    # Deleting the durable tier's older indices leaves the newest loading bitwise.
    shutil.rmtree(durable / "0")
    shutil.rmtree(durable / "2")
    manifest = Manifest.load(durable)
    del manifest.entries[0], manifest.entries[2]
    manifest.commit()
    got = fastckpt.load_checkpoint(durable)["models"]["main"]["model"].state_dict()
    assert all(torch.equal(got[k], v) for k, v in states[3].items())
    assert fastckpt.verify(durable).ok


def test_a_target_file_replaced_since_it_was_promoted_is_not_reused(tmp_path: Path) -> None:
    fast, durable = tmp_path / "fast", tmp_path / "durable"
    forget_promoted()
    _source(fast, saves=2)
    promote_index(fast, durable, 0)
    # Someone rewrites durable/0's tensor file (same bytes, another inode): what this process
    # wrote is no longer what is there, so nothing is linked from it. (A link to the old
    # inode is kept so that the new file cannot be given its number.)
    weights = durable / "0" / "models" / "main.safetensors"
    os.link(weights, tmp_path / "old-inode")
    data = weights.read_bytes()
    weights.unlink()
    weights.write_bytes(data)
    done = promote_index(fast, durable, 1)
    assert _inode(durable / "1" / "linked" / "0.safetensors") != _inode(weights)
    # Only the untouched file (the optimizer's tensors, unchanged) was linked.
    assert done.reused == _files(fast, 1)["optimizers/sgd.safetensors"][0]
    assert done.copied + done.reused == sum(size for size, _ in _files(fast, 1).values())
    # A new process knows nothing: full copies (forget_promoted stands in for it).
    forget_promoted()
    assert promote_index(fast, durable, 1).reused == 0
    assert fastckpt.verify(durable).ok


def test_a_target_file_rewritten_in_place_is_not_linked(tmp_path: Path) -> None:
    # Same inode, same size, other bytes (rewritten in place, or a deleted file's inode number
    # handed to a new one): the inode proves nothing, the linked bytes are read back and the
    # link dropped for a full copy.
    fast, durable = tmp_path / "fast", tmp_path / "durable"
    forget_promoted()
    states = _source(fast, saves=2)
    promote_index(fast, durable, 0)
    weights = durable / "0" / "models" / "main.safetensors"
    before = os.stat(weights)
    with open(weights, "r+b") as handle:
        handle.seek(before.st_size - 4)
        handle.write(b"\xde\xad\xbe\xef")
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert _inode(weights) == before.st_ino
    done = promote_index(fast, durable, 1)
    linked = durable / "1" / "linked" / "0.safetensors"
    assert _inode(linked) != _inode(weights)
    assert done.reused == _files(fast, 1)["optimizers/sgd.safetensors"][0]
    assert done.copied + done.reused == sum(size for size, _ in _files(fast, 1).values())
    got = fastckpt.load_checkpoint(durable, 1)["models"]["main"]["model"].state_dict()
    assert all(torch.equal(got[k], v) for k, v in states[1].items())
    # The damaged index fails verification; the newest one is intact.
    assert not fastckpt.verify(durable, 0).ok
    assert fastckpt.verify(durable, 1).ok


def test_unchanged_files_are_copied_by_the_s3_server(s3_server: S3Server, tmp_path: Path) -> None:
    fast = tmp_path / "fast"
    forget_promoted()
    states = _source(fast, saves=3)
    durable = s3_server.url("incremental")
    fastckpt.configure_storage(durable, s3_server.options())
    report = promote(fast, durable, every=2)
    assert report.promoted == [0, 2]
    assert report.bytes_reused >= _files(fast, 0)["models/main.safetensors"][0]
    # Index 0 deleted from the bucket: index 2 holds its own copy of the frozen tensors.
    fastckpt.prune(durable, keep_last=1)
    assert [c["index"] for c in fastckpt.list_checkpoints(durable)] == [2]
    got = fastckpt.load_checkpoint(durable)["models"]["main"]["model"].state_dict()
    assert all(torch.equal(got[k], v) for k, v in states[2].items())
    assert fastckpt.verify(durable).ok


def test_a_replaced_s3_object_is_not_copied_even_by_a_store_ignoring_the_condition(
    s3_server: S3Server, tmp_path: Path
) -> None:
    # moto copies a replaced source although the copy is conditional on the etag that was
    # written: the promotion committed a file that did not verify.
    import boto3

    fast = tmp_path / "fast"
    forget_promoted()
    model = _model(0)
    model[0].requires_grad_(False)  # its file is linked into every index, reused on S3

    def save() -> None:
        with torch.no_grad():
            model[1].weight.add_(1.0)
        fastckpt.save_checkpoint(fast, models={"main": (model, None)})

    for _ in range(3):
        save()
    durable = s3_server.url("replaced")
    fastckpt.configure_storage(durable, s3_server.options())
    assert promote(fast, durable).promoted == [0, 1, 2]
    bucket, prefix = durable[len("s3://") :].split("/", 1)
    options = s3_server.options()
    client = boto3.client(
        "s3",
        endpoint_url=options["endpoint_url"],
        region_name=options.get("region", "us-east-1"),
        aws_access_key_id=options["access_key_id"],
        aws_secret_access_key=options["secret_access_key"],
    )
    listed = client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/2/linked/")["Contents"]
    assert listed
    for item in listed:  # same size, other bytes: what the next promotion would copy
        body = bytearray(client.get_object(Bucket=bucket, Key=item["Key"])["Body"].read())
        body[-1] ^= 0xFF
        client.put_object(Bucket=bucket, Key=item["Key"], Body=bytes(body))
    save()
    report = promote(fast, durable)
    assert report.promoted == [3] and report.bytes_reused == 0, report
    got = fastckpt.load_checkpoint(durable, checkpoint_index=3)["models"]["main"]["model"]
    assert all(torch.equal(got.state_dict()[k], v) for k, v in model.state_dict().items())
    assert fastckpt.verify(durable, index=3).ok


# --------------------------------------------------------------------------- the hook's tiers


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_hook_promotes_every_nth_checkpoint_and_resumes_from_the_durable_tier(
    tmp_path: Path, async_save: bool
) -> None:
    fast, durable = tmp_path / "fast", tmp_path / "durable"
    hook = fastckpt.CheckpointHook(
        fast,
        step_interval=1,
        async_save=async_save,
        durable_dir=durable,
        promote_every=2,
        durable_keep_last=2,
    )
    strategy = training_support.new_strategy([hook], num_steps=8)
    strategy.run(training_support.loader())
    assert hook.promotion_healthy
    assert [c["index"] for c in fastckpt.list_checkpoints(fast)] == list(range(8))
    # Multiples of 2 were promoted; the durable tier keeps its newest 2.
    assert [c["index"] for c in fastckpt.list_checkpoints(durable)] == [4, 6]
    assert hook.promoter is not None and hook.promoter.promoted[-1] == 6
    for index in (4, 6):
        assert _files(durable, index) == _files(fast, index)
    assert fastckpt.verify(durable).ok
    # The fast tier lost (a new node): resume from the durable one, bitwise.
    shutil.rmtree(fast)
    resumed = fastckpt.TrainingStrategy.load_checkpoint(
        durable, training_fn=training_support.training_fn
    )
    assert resumed.step_count == 7
    reference = training_support.new_strategy([], num_steps=7)
    reference.run(training_support.loader())
    got, want = resumed.models["main"].state_dict(), reference.models["main"].state_dict()
    assert all(torch.equal(got[k], v) for k, v in want.items())


def test_a_failing_durable_tier_does_not_stop_training_and_is_raised_at_close(
    tmp_path: Path,
) -> None:
    fast = tmp_path / "fast"
    (tmp_path / "file").write_text("not a directory")
    durable = tmp_path / "file" / "durable"  # every promotion fails: its parent is a file
    hook = fastckpt.CheckpointHook(
        fast, step_interval=2, async_save=False, durable_dir=durable, save_last=False
    )
    strategy = training_support.new_strategy([hook], num_steps=6)
    with (
        pytest.warns(RuntimeWarning, match="training goes on"),
        pytest.raises(PromotionError, match="durable") as raised,
    ):
        strategy.run(training_support.loader())
    assert isinstance(raised.value.__cause__, OSError)
    # Every checkpoint of the fast tier was taken and is intact: training went on.
    assert strategy.step_count == 6
    assert [c["index"] for c in fastckpt.list_checkpoints(fast)] == [0, 1, 2]
    assert fastckpt.verify(fast).ok
    # Raised once, and still reported after it (before: promotion_healthy read True again).
    assert not hook.promotion_healthy and not hook.healthy
    hook.close()


def test_a_failed_save_raised_at_close_keeps_the_hook_unhealthy(tmp_path: Path) -> None:
    blocker = tmp_path / "node"
    blocker.write_text("the disk is gone")  # every save under it fails
    hook = fastckpt.CheckpointHook(
        blocker / "ckpt", step_interval=2, async_save=True, strict_saves=False
    )
    strategy = training_support.new_strategy([hook], num_steps=3)
    with pytest.warns(RuntimeWarning, match="training goes on"), pytest.raises(OSError):
        strategy.run(training_support.loader())  # the failed save of step 2, at close
    assert strategy.step_count == 3
    assert not hook.healthy and hook.save_error is not None  # before: True, None
    hook.close()  # raised once


def test_a_stopped_durable_server_spares_the_unpromoted_index_and_the_next_run_promotes_it(
    s3_server: S3Server, tmp_path: Path
) -> None:
    fast, durable = tmp_path / "fast", s3_server.url("stopped")
    options = s3_server.options(max_retries=0, retry_timeout_s=1.0, connect_timeout_s=1.0)
    fastckpt.configure_storage(durable, options)
    errors: list[tuple[PromotionError, bool]] = []
    hook = fastckpt.CheckpointHook(
        fast,
        step_interval=1,
        async_save=False,
        keep_last=1,
        durable_dir=durable,
        promote_every=2,
        save_last=False,
        on_promotion_error=lambda error: errors.append((error, hook.promotion_healthy)),
    )
    strategy = training_support.new_strategy([hook], num_steps=4)
    s3_server.stop()
    try:
        with (
            pytest.warns(RuntimeWarning, match="training goes on"),
            pytest.raises(PromotionError, match="stopped"),
        ):
            strategy.run(training_support.loader())
        assert strategy.step_count == 4  # training went on
        # Each failure went to the callback while the hook reported itself unhealthy.
        assert errors and all(isinstance(e, PromotionError) and not ok for e, ok in errors)
        # keep_last=1, yet index 2 (due for promotion, never promoted) is kept with the
        # newest: the fast tier's retention does not lose what the durable tier lacks.
        assert [c["index"] for c in fastckpt.list_checkpoints(fast)] == [2, 3]
    finally:
        s3_server.start()
    assert fastckpt.list_checkpoints(durable) == []
    # The next process that opens the tiers finishes the promotion before it saves anything.
    resumed = fastckpt.TrainingStrategy.load_checkpoint(
        fast, training_fn=training_support.training_fn
    )
    resumed.run(training_support.loader())  # already at num_steps: no step, no save
    assert resumed.step_count == 4
    assert [c["index"] for c in fastckpt.list_checkpoints(durable)] == [2]
    got = fastckpt.load_checkpoint(durable)["models"]["main"]["model"].state_dict()
    want = fastckpt.load_checkpoint(fast, 2)["models"]["main"]["model"].state_dict()
    assert all(torch.equal(got[k], v) for k, v in want.items())


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_failing_fast_tier_does_not_stop_a_two_tier_run_and_the_next_save_retries(
    tmp_path: Path, async_save: bool
) -> None:
    blocker = tmp_path / "node"
    blocker.write_text("the fast tier's disk is gone")  # saves under it fail
    fast, durable = blocker / "fast", tmp_path / "durable"
    failures: list[tuple[BaseException, bool]] = []

    def on_save_error(error: BaseException) -> None:
        failures.append((error, hook.healthy))
        if blocker.is_file():  # the disk comes back
            blocker.unlink()
            blocker.mkdir()

    hook = fastckpt.CheckpointHook(
        fast,
        step_interval=2,
        async_save=async_save,
        durable_dir=durable,
        save_last=False,
        on_save_error=on_save_error,
    )
    strategy = training_support.new_strategy([hook], num_steps=6)
    with pytest.warns(RuntimeWarning, match="training goes on"):
        strategy.run(training_support.loader())  # closes the hook: nothing raised
    assert strategy.step_count == 6
    assert len(failures) == 1 and isinstance(failures[0][0], OSError) and not failures[0][1]
    assert hook.healthy and hook.save_error is None
    # The saves after the failure were written and promoted.
    assert [c["index"] for c in fastckpt.list_checkpoints(fast)] == [0, 1]
    assert [c["index"] for c in fastckpt.list_checkpoints(durable)] == [0, 1]


def test_a_fast_tier_failing_to_the_end_is_raised_at_close_and_strict_saves_raise_at_once(
    tmp_path: Path,
) -> None:
    (tmp_path / "node").write_text("no disk")
    fast, durable = tmp_path / "node" / "fast", tmp_path / "durable"
    hook = fastckpt.CheckpointHook(
        fast, step_interval=2, async_save=False, durable_dir=durable, save_last=False
    )
    strategy = training_support.new_strategy([hook], num_steps=6)
    with pytest.warns(RuntimeWarning), pytest.raises(OSError):
        strategy.run(training_support.loader())
    assert strategy.step_count == 6  # every save failed, training went on to the end
    strict = fastckpt.CheckpointHook(
        fast,
        step_interval=2,
        async_save=False,
        durable_dir=durable,
        save_last=False,
        strict_saves=True,
    )
    strategy = training_support.new_strategy([strict], num_steps=6)
    with pytest.raises(OSError):
        strategy.run(training_support.loader())
    assert strategy.step_count == 2  # stopped at the first save


def test_a_strict_hook_stops_at_the_save_after_a_failed_promotion(tmp_path: Path) -> None:
    fast = tmp_path / "fast"
    (tmp_path / "file").write_text("not a directory")
    hook = fastckpt.CheckpointHook(
        fast,
        step_interval=2,
        async_save=False,
        durable_dir=tmp_path / "file" / "durable",
        strict_promotion=True,
        save_last=False,
    )
    strategy = training_support.new_strategy([hook], num_steps=10)
    with pytest.warns(RuntimeWarning), pytest.raises(PromotionError, match="strict promotion"):
        strategy.run(training_support.loader())
    # Raised at the first save, once it was committed to the fast tier (before, it was raised
    # before the write: the run stopped with no checkpoint anywhere, its message saying that
    # training goes on).
    assert strategy.step_count == 2
    assert [c["index"] for c in fastckpt.list_checkpoints(fast)] == [0]
    # The durable tier back, the same hook entered again for the resumed run promotes (a
    # review found the error it had raised raised again at every submission, for good).
    (tmp_path / "file").unlink()
    resumed = fastckpt.TrainingStrategy.load_checkpoint(
        fast, hooks=[hook], training_fn=training_support.training_fn
    )
    resumed.num_steps = 4
    resumed.run(training_support.loader())
    assert [c["index"] for c in fastckpt.list_checkpoints(tmp_path / "file" / "durable")] == [0, 1]


# --------------------------------------------------------------------------- restore


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_load_takes_the_newest_intact_copy_across_tiers_and_says_which(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fast, durable = tmp_path / "fast", tmp_path / "durable"
    states = _source(fast)
    promote(fast, durable)
    # Both tiers intact: the fast one is read.
    loaded = fastckpt.load_checkpoint(fast, fallback_dirs=[durable])
    assert loaded["restored_from"] == {"path": str(fast), "index": 2, "skipped": []}
    # The fast tier's newest copy rots: the durable copy of the same index is loaded.
    _flip_last_byte(fast / "2" / "models" / "main.safetensors")
    with caplog.at_level("WARNING", logger="fastckpt"):
        loaded = fastckpt.load_checkpoint(fast, fallback_dirs=[durable])
    where = loaded["restored_from"]
    assert where["path"] == str(durable) and where["index"] == 2
    assert len(where["skipped"]) == 1 and "fast index 2" in where["skipped"][0]
    assert "checksum" in where["skipped"][0] and "skipped" in caplog.text
    got = loaded["models"]["main"]["model"].state_dict()
    assert all(torch.equal(got[k], v) for k, v in states[2].items())
    # The durable copy rots too: the newest intact one left is index 1, on the fast tier.
    _flip_last_byte(durable / "2" / "models" / "main.safetensors")
    loaded = fastckpt.load_checkpoint(fast, fallback_dirs=[durable])
    assert loaded["restored_from"]["path"] == str(fast)
    assert loaded["restored_from"]["index"] == 1 and len(loaded["restored_from"]["skipped"]) == 2
    got = loaded["models"]["main"]["model"].state_dict()
    assert all(torch.equal(got[k], v) for k, v in states[1].items())
    # An explicit index comes from the first tier holding it intact.
    assert fastckpt.load_checkpoint(fast, 0, fallback_dirs=[durable])["restored_from"] == {
        "path": str(fast),
        "index": 0,
        "skipped": [],
    }
    # Nothing intact anywhere: a typed error naming what was passed over.
    with pytest.raises(NotCommittedError, match="no intact copy of index 2"):
        fastckpt.load_checkpoint(fast, 2, fallback_dirs=[durable])


def test_a_run_resumes_from_the_durable_tier_when_the_fast_one_is_gone(tmp_path: Path) -> None:
    fast, durable = tmp_path / "fast", tmp_path / "durable"
    hook = fastckpt.CheckpointHook(fast, step_interval=2, durable_dir=durable)
    strategy = training_support.new_strategy([hook], num_steps=6)
    strategy.run(training_support.loader())
    shutil.rmtree(fast)  # a new node
    resumed = fastckpt.TrainingStrategy.load_checkpoint(
        fast, training_fn=training_support.training_fn, fallback_dirs=[durable]
    )
    assert resumed.restored_from is not None
    assert resumed.restored_from.root == durable and resumed.restored_from.index == 2
    assert resumed.restored_from.skipped == [f"{fast}: no committed index (gone, or never written)"]
    assert resumed.step_count == 6
    got, want = resumed.models["main"].state_dict(), strategy.models["main"].state_dict()
    assert all(torch.equal(got[k], v) for k, v in want.items())


def test_a_run_resumed_from_the_durable_tier_numbers_its_saves_past_it(tmp_path: Path) -> None:
    """A new node: its fast tier is empty, the run resumes from the durable index 2 (step 6)
    and goes on to step 10. Its saves are numbered 3 and 4 and promoted; a restore with both
    tiers takes step 10. Before, the fast root numbered them 0 and 1 again: the durable tier,
    holding index 2, never took them, and a restore with both tiers resumed the durable step 6
    silently, with the fast tier's step 10 intact."""
    fast, durable = tmp_path / "fast", tmp_path / "durable"
    hook = fastckpt.CheckpointHook(fast, step_interval=2, durable_dir=durable)
    training_support.new_strategy([hook], num_steps=6).run(training_support.loader())
    shutil.rmtree(fast)  # a new node, same paths
    resumed = fastckpt.TrainingStrategy.load_checkpoint(
        fast, training_fn=training_support.training_fn, fallback_dirs=[durable]
    )
    assert resumed.restored_from is not None and resumed.restored_from.root == durable
    resumed.num_steps = 10
    resumed.run(training_support.loader())
    assert [c["index"] for c in fastckpt.list_checkpoints(fast)] == [3, 4]
    assert [c["index"] for c in fastckpt.list_checkpoints(durable)] == [0, 1, 2, 3, 4]
    for tiers in ([fast, durable], [tmp_path / "another-node", durable]):
        again = fastckpt.TrainingStrategy.load_checkpoint(
            tiers[0], training_fn=training_support.training_fn, fallback_dirs=tiers[1:]
        )
        assert again.step_count == 10
        assert again.restored_from is not None and again.restored_from.index == 4
        got, want = again.models["main"].state_dict(), resumed.models["main"].state_dict()
        assert all(torch.equal(got[k], v) for k, v in want.items())


def test_a_promoter_closed_after_one_run_promotes_again_in_the_next(tmp_path: Path) -> None:
    fast, durable = tmp_path / "fast", tmp_path / "durable"
    _source(fast, saves=1)
    promoter = Promoter(fast, durable)
    promoter.submit()
    promoter.close()
    _source_more(fast)  # a second run of the same hook
    promoter.submit()
    promoter.close()
    assert promoter.promoted == [0, 1] and promoter.healthy
    assert [c["index"] for c in fastckpt.list_checkpoints(durable)] == [0, 1]


def test_a_promoters_prune_leaves_a_newer_index_part_of_a_gone_trainer(tmp_path: Path) -> None:
    """A durable root on a shared filesystem: after a restart, other ranks upload into a
    newer index's part named after the trainer that is gone (node-local promotion), so the
    prune a promoter runs there (``promoting=True``) sweeps only uncommitted indices older
    than the latest; a trainer's own prune also removes a newer index's part whose writer
    died on this host."""
    root = tmp_path / "durable"
    for index in (0, 1, 2):
        fastckpt.save_checkpoint(root, {"m": (torch.nn.Linear(2, 2), None)}, checkpoint_index=index)
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    from fastckpt.container.commit import prune_indices
    from fastckpt.container.sharded.parts import new_part

    mine = new_part()
    dead_part = mine.replace(f".{os.getpid()}.", f".{gone}.")
    shard = root / "sharded" / "3" / dead_part / "g0000000000000-00000000" / "rank-00001.bin"
    shard.parent.mkdir(parents=True)
    shard.write_bytes(b"rank 1's upload")
    assert prune_indices(root, 2, promoting=True) == [0]
    assert shard.is_file()
    assert prune_indices(root, 1) == [1]
    assert not shard.exists()


def test_a_promotion_slower_than_the_saves_keeps_its_index_and_completes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # keep_last=1 spared only the index due next: a promotion outlasting one save interval
    # had its index pruned under it ("pruned before it was promoted") at every run, so the
    # durable tier fell behind for good while the promoter reported itself healthy.
    import fastckpt.container.promote as promote_module

    fast, durable = tmp_path / "fast", tmp_path / "durable"
    real = promote_module.promote_index
    slowed: list[int] = []

    def slow_promote_index(source: Any, target: Any, index: int, **kwargs: Any) -> Any:
        if not slowed:  # the first promotion lasts until three more saves committed
            slowed.append(index)
            deadline = time.monotonic() + 60
            while Manifest.load(fast).latest < index + 3 and time.monotonic() < deadline:
                time.sleep(0.01)
        return real(source, target, index, **kwargs)

    monkeypatch.setattr(promote_module, "promote_index", slow_promote_index)
    hook = fastckpt.CheckpointHook(
        fast, step_interval=1, async_save=False, durable_dir=durable, keep_last=1
    )
    strategy = training_support.new_strategy([hook], num_steps=6)
    strategy.run(training_support.loader())
    assert hook.promoter is not None and hook.promotion_healthy
    assert slowed == [0] and hook.promoter.promoted[0] == 0, hook.promoter.promoted
    assert hook.promoter.promoted[-1] == 5
    # What the slow promotion held is released once it is done, and close() applied
    # keep_last once more: the fast tier holds keep_last=1 index (before: one extra).
    assert [c["index"] for c in fastckpt.list_checkpoints(fast)] == [5]
    assert fastckpt.verify(durable).ok


def test_a_promotion_never_chooses_between_a_retentions_decision_and_its_deletions(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The hook computed what keep_last spares, then pruned: a promotion run starting in
    between read the fast tier first, chose an index the prune then deleted, and lost it
    ("pruned before it was promoted", twice in 40 saves under load, promotion_healthy True).
    A run now decides what it copies before the retention decides, or after it deleted."""
    import threading

    from fastckpt.container.commit import prune_indices

    fast, durable = tmp_path / "fast", tmp_path / "durable"
    model = torch.nn.Linear(4, 4)
    for _ in range(3):
        fastckpt.save_checkpoint(fast, models={"m": (model, None)}, incremental=False)
    promoter = Promoter(fast, durable, every=1)
    decided = threading.Event()
    pruned: list[int] = []

    def retention() -> None:
        with promoter.retention():
            spare = promoter.spared(2)  # no run yet: the index due next
            decided.set()
            time.sleep(0.5)  # the promotion submitted meanwhile must not choose now
            pruned.extend(prune_indices(fast, 1, spare=spare))

    caplog.set_level("WARNING", logger="fastckpt")
    thread = threading.Thread(target=retention)
    thread.start()
    decided.wait(10)
    promoter.submit()
    thread.join(30)
    promoter.wait()
    promoter.close()
    assert pruned == [0, 1]
    assert "pruned before it was promoted" not in caplog.text
    assert promoter.promoted == [2] and promoter.healthy
    assert [c["index"] for c in fastckpt.list_checkpoints(durable)] == [2]


def test_a_new_processs_first_promotion_spares_only_what_the_durable_tier_lacks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new process (a resumed run) did not know what the durable tier held: its first run
    counted every due index of the fast tier as in flight, so keep_last spared all of them
    until it ended (seven indices kept with keep_last=2 after a resume)."""
    import threading

    import fastckpt.container.promote as promote_module

    fast, durable = tmp_path / "fast", tmp_path / "durable"
    model = torch.nn.Linear(4, 4)
    for _ in range(5):
        fastckpt.save_checkpoint(fast, models={"m": (model, None)}, incremental=False)
    for index in range(3):
        promote_index(fast, durable, index)
    real = promote_module.promote_index
    copying, release = threading.Event(), threading.Event()

    def held_promote_index(source: Any, target: Any, index: int, **kwargs: Any) -> Any:
        copying.set()
        release.wait(30)
        return real(source, target, index, **kwargs)

    monkeypatch.setattr(promote_module, "promote_index", held_promote_index)
    promoter = Promoter(fast, durable, every=1)
    promoter.submit()
    try:
        assert copying.wait(30)
        # The durable tier's newest (2) may be copied again (a re-saved source index).
        assert promoter.in_flight() == {2, 3, 4}
        assert promoter.spared(4) == (2, 3, 4)
    finally:
        release.set()
        promoter.wait()
        promoter.close()
    assert [c["index"] for c in fastckpt.list_checkpoints(durable)][-1] == 4


def test_a_new_processs_promoter_replaces_the_durable_copy_of_a_re_saved_index(
    tmp_path: Path,
) -> None:
    """A source index re-saved after it was promoted replaces its durable copy, also when a
    new process's promoter first reads the durable tier's newest (a first version of that
    read left the newest out of the run: the durable copy stayed stale)."""
    fast, durable = tmp_path / "fast", tmp_path / "durable"
    model = torch.nn.Linear(4, 4)
    for _ in range(3):
        fastckpt.save_checkpoint(fast, models={"m": (model, None)}, incremental=False)
    for index in range(3):
        promote_index(fast, durable, index)
    with torch.no_grad():
        model.weight.add_(1)
    fastckpt.save_checkpoint(fast, models={"m": (model, None)}, checkpoint_index=2)
    promoter = Promoter(fast, durable, every=1)
    promoter.submit()
    promoter.wait()
    promoter.close()
    assert promoter.promoted == [2]
    assert Manifest.load(durable).entries[2]["files"] == Manifest.load(fast).entries[2]["files"]


class _WipeFastTier:
    """A hook wiping the fast tier (``/dev/shm`` cleared, a node-local disk reclaimed) after
    step ``step``'s batch, before that step's checkpoint."""

    def __init__(self, fast: Path, step: int) -> None:
        self.fast, self.step = fast, step
        self.hook: Any = None

    def __call__(self, ctx: Any, stage: fastckpt.TrainingStage) -> None:
        if stage is fastckpt.TrainingStage.AFTER_BATCH and ctx.step_count == self.step:
            self.hook.promoter.wait()
            shutil.rmtree(self.fast)


def test_a_fast_tier_wiped_mid_run_numbers_its_next_saves_past_the_durable_tier(
    tmp_path: Path,
) -> None:
    # The next saves restarted at index 0, below the durable tier's newest: never promoted,
    # and a restore took the durable tier's older index over the run's newest.
    fast, durable = tmp_path / "fast", tmp_path / "durable"
    wipe = _WipeFastTier(fast, 4)
    hook = fastckpt.CheckpointHook(
        fast, step_interval=1, async_save=False, durable_dir=durable, promote_every=2
    )
    wipe.hook = hook
    strategy = training_support.new_strategy([wipe, hook], num_steps=6)
    strategy.run(training_support.loader())
    assert hook.promotion_healthy
    assert [c["index"] for c in fastckpt.list_checkpoints(fast)] == [3, 4, 5]
    assert [c["index"] for c in fastckpt.list_checkpoints(durable)] == [0, 2, 4]
    restored = fastckpt.TrainingStrategy.load_checkpoint(
        fast, training_fn=training_support.training_fn, fallback_dirs=[durable], hooks=[]
    )
    assert restored.step_count == strategy.step_count
    assert restored.restored_from is not None and restored.restored_from.index == 5
    got, want = restored.models["main"].state_dict(), strategy.models["main"].state_dict()
    assert all(torch.equal(got[k], v) for k, v in want.items())


def _keep_two_hook(fast: Path, durable: Any, **kwargs: Any) -> fastckpt.CheckpointHook:
    """A sync hook saving every step to ``fast``, promoting every 2nd to ``durable``, which
    keeps 2."""
    return fastckpt.CheckpointHook(
        fast,
        step_interval=1,
        async_save=False,
        durable_dir=durable,
        promote_every=2,
        durable_keep_last=2,
        **kwargs,
    )


def test_a_fresh_run_on_a_new_node_is_refused_another_runs_durable_tier(tmp_path: Path) -> None:
    # Only checkpoint_dir was checked: a run started afresh with an empty fast tier promoted
    # into the durable tier of another run, whose retention then deleted that run's indices.
    durable = tmp_path / "durable"

    def hook(fast: Path, **kwargs: Any) -> fastckpt.CheckpointHook:
        return _keep_two_hook(fast, durable, **kwargs)

    first = training_support.new_strategy([hook(tmp_path / "node-a")], num_steps=6)
    first.run(training_support.loader())
    held = _files(durable, 4), _files(durable, 2)
    assert [c["index"] for c in fastckpt.list_checkpoints(durable)] == [2, 4]
    fresh = training_support.new_strategy([hook(tmp_path / "node-b")], num_steps=6)
    with pytest.raises(MixedRunError, match=r"durable.*index 4\) is at step 5.*durable_dir"):
        fresh.run(training_support.loader())
    assert (_files(durable, 4), _files(durable, 2)) == held
    assert not (tmp_path / "node-b").exists() or not fastckpt.list_checkpoints(tmp_path / "node-b")
    # Resuming from the durable tier on the new node continues that run.
    resumed = fastckpt.TrainingStrategy.load_checkpoint(
        tmp_path / "node-b",
        training_fn=training_support.training_fn,
        fallback_dirs=[durable],
        hooks=[hook(tmp_path / "node-b")],
    )
    assert resumed.step_count == 5
    resumed.run(training_support.loader())  # not refused: the same run goes on
    assert [c["index"] for c in fastckpt.list_checkpoints(tmp_path / "node-b")] == [5]
    # overwrite=True saves there anyway, on purpose.
    forced = training_support.new_strategy([hook(tmp_path / "node-c", overwrite=True)], 2)
    forced.run(training_support.loader())


def test_a_fresh_run_started_while_the_durable_tier_is_down_never_promotes_into_another_run(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """The durable tier (a stopped S3 server) cannot be read when a fresh run starts on a new
    node, so whether it holds another run's later checkpoints is unknown: nothing is promoted
    until a save reads it, and when it does hold them the promotions stop for good, reported
    (PromotionError caused by MixedRunError naming durable_dir, raised at the end of the run)
    while training goes on. Before, the check was skipped: once the server was back the fresh
    run promoted past the other run's newest index and durable_keep_last deleted its
    checkpoints."""
    durable = s3_server.url("down-at-start")
    fastckpt.configure_storage(
        durable, s3_server.options(max_retries=0, retry_timeout_s=1.0, connect_timeout_s=1.0)
    )

    def hook(fast: Path) -> fastckpt.CheckpointHook:
        return _keep_two_hook(fast, durable)

    training_support.new_strategy([hook(tmp_path / "node-a")], num_steps=6).run(
        training_support.loader()
    )
    held = [(c["index"], c["counters"]["step_count"]) for c in fastckpt.list_checkpoints(durable)]
    assert held == [(2, 3), (4, 5)]

    def server_back(ctx: Any, stage: Any) -> None:
        if stage is fastckpt.TrainingStage.AFTER_BATCH and ctx.step_count == 2:
            s3_server.start()

    fresh = training_support.new_strategy([hook(tmp_path / "node-b"), server_back], num_steps=6)
    s3_server.stop()
    try:
        with (
            pytest.warns(RuntimeWarning, match="training goes on"),
            pytest.raises(
                PromotionError, match=r"not promoting.*index 4\) is at step 5.*durable_dir"
            ) as caught,
        ):
            fresh.run(training_support.loader())
    finally:
        s3_server.start()
    assert isinstance(caught.value.__cause__, MixedRunError)
    assert fresh.step_count == 6  # training went on, on the fast tier
    after = [(c["index"], c["counters"]["step_count"]) for c in fastckpt.list_checkpoints(durable)]
    assert after == held


def test_a_hook_used_for_a_second_run_checks_a_durable_tier_it_could_not_read_at_its_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hook entered again for another run whose durable tier cannot be read at that run's
    start (a transient store error) reads it at the run's first save and promotes on.
    Before, the durable tier was read once per hook: the second run never checked it again
    and silently promoted nothing, reporting itself healthy."""
    from fastckpt.format.records import Manifest
    from fastckpt.training.hooks import checkpoint as hook_module

    fast, durable = tmp_path / "fast", tmp_path / "durable"
    hook = fastckpt.CheckpointHook(fast, step_interval=2, durable_dir=durable, async_save=False)
    strategy = training_support.new_strategy([hook], num_steps=4)
    strategy.run(training_support.loader())
    load = Manifest.load.__func__  # type: ignore[attr-defined]
    failures = [OSError("store down (transient)")]

    def flaky(cls: type[Manifest], root: Any, *args: Any, **kwargs: Any) -> Manifest:
        if Path(root) == durable and failures:
            raise failures.pop()
        return load(cls, root, *args, **kwargs)

    monkeypatch.setattr(hook_module.Manifest, "load", classmethod(flaky))
    strategy.num_steps = 10
    strategy.run(training_support.loader())
    steps = [c["counters"]["step_count"] for c in fastckpt.list_checkpoints(durable)]
    assert steps == [2, 4, 6, 8, 10] and hook.promotion_healthy


def test_a_run_resumed_past_a_damaged_newest_index_trains_on(tmp_path: Path) -> None:
    # The restore took the fast tier's previous index (the newest was damaged), as documented;
    # training on was then refused with MixedRunError, whose advice was that very resume.
    fast, durable = tmp_path / "fast", tmp_path / "durable"
    hook = fastckpt.CheckpointHook(
        fast, step_interval=1, async_save=False, durable_dir=durable, promote_every=2
    )
    strategy = training_support.new_strategy([hook], num_steps=6)
    strategy.run(training_support.loader())
    _flip_last_byte(fast / "5" / "models" / "main.safetensors")
    resumed = fastckpt.TrainingStrategy.load_checkpoint(
        fast, training_fn=training_support.training_fn, fallback_dirs=[durable]
    )
    assert resumed.restored_from is not None and resumed.restored_from.index == 4
    assert resumed.restored_from.passed(fast, 5)
    resumed.num_steps = 7
    resumed.run(training_support.loader())
    assert resumed.step_count == 7
    assert [c["index"] for c in fastckpt.list_checkpoints(fast)][-2:] == [6, 7]


def test_fastckpt_promote_repairs_a_damaged_newest_copy_in_the_target(tmp_path: Path) -> None:
    # The repair command said "already holds every index" (the records match) and left the
    # target's newest copy damaged although the source's was intact.
    from fastckpt.cli.main import main as cli

    fast, durable = tmp_path / "fast", tmp_path / "durable"
    _source(fast, saves=3)
    promote(fast, durable)
    _flip_last_byte(durable / "2" / "models" / "main.safetensors")
    assert not fastckpt.verify(durable, index=2).ok
    assert promote(fast, durable).promoted == []  # a background run does not read it back
    assert cli(["promote", str(fast), str(durable)]) == 0
    assert fastckpt.verify(durable, index=2).ok
    assert _files(durable, 2) == _files(fast, 2)


def test_an_edited_manifest_is_never_resealed_and_restores_fall_back(tmp_path: Path) -> None:
    """A fast manifest edited without its seal (a counter changed) was promoted and sealed
    into the durable tier (``verify`` then said ok, and a resume there refused the run), a
    save into that root re-sealed the edit too, and a restore picked the fast tier and failed
    instead of falling back. Now the damage stays where it is: promotion and the save refuse
    it, naming the manifest, and a restore takes the durable copy and says why."""
    fast, durable = tmp_path / "fast", tmp_path / "durable"
    states = _source(fast, saves=2)
    promote(fast, durable)
    manifest = json.loads((fast / "manifest.json").read_text())
    manifest["checkpoints"]["1"]["counters"]["step"] = 4000
    (fast / "manifest.json").write_text(json.dumps(manifest))
    edited = (fast / "manifest.json").read_bytes()
    before = (durable / "manifest.json").read_bytes()
    with pytest.raises(ChecksumMismatchError, match=r"manifest\.json"):
        promote(fast, durable)
    with pytest.raises(ChecksumMismatchError, match=r"manifest\.json"):
        promote_index(fast, durable, 1)
    with pytest.raises(ChecksumMismatchError, match="not rewritten"):
        fastckpt.save_checkpoint(fast, models={"main": (_model(2), None)})
    with pytest.raises(ChecksumMismatchError, match="not rewritten"):  # a replaced index too
        fastckpt.save_checkpoint(fast, models={"main": (_model(2), None)}, checkpoint_index=0)
    with pytest.raises(ChecksumMismatchError, match="not rewritten"):
        fastckpt.prune(fast, keep_last=1)
    assert sorted(p.name for p in fast.iterdir() if not p.name.startswith(".")) == [
        "0",
        "1",
        "manifest.json",
    ]
    assert (fast / "manifest.json").read_bytes() == edited
    assert (durable / "manifest.json").read_bytes() == before
    assert fastckpt.verify(durable).ok
    loaded = fastckpt.load_checkpoint(fast, fallback_dirs=[durable])
    assert loaded["checkpoint_index"] == 1 and loaded["manifest"]["counters"]["step"] == 1
    copy = loaded["restored_from"]
    assert Path(copy["path"]) == durable and "manifest.json" in copy["skipped"][0]
    got = loaded["models"]["main"]["model"].state_dict()
    assert all(torch.equal(got[k], v) for k, v in states[1].items())


def test_a_damaged_refs_json_in_the_newest_fast_index_falls_back_to_the_durable_copy(
    tmp_path: Path,
) -> None:
    """Before: a flipped byte in the newest fast index's ``refs.json`` made the restore raise
    ``ChecksumMismatchError`` instead of taking the intact durable copy (and ``verify`` and
    ``prune`` of that root stopped at it, exit 2)."""
    fast, durable = tmp_path / "fast", tmp_path / "durable"
    model = _model(2)
    for step in range(3):
        with torch.no_grad():
            model[1].weight.add_(1.0)  # the first layer stays: referenced incrementally
        fastckpt.save_checkpoint(fast, models={"main": (model, None)}, counters={"s": step})
    promote(fast, durable)
    refs_json = fast / "2" / "refs.json"
    assert refs_json.exists()
    data = bytearray(refs_json.read_bytes())
    data[len(data) // 2] ^= 1
    refs_json.write_bytes(bytes(data))
    loaded = fastckpt.load_checkpoint(fast, fallback_dirs=[durable])
    copy = loaded["restored_from"]
    assert copy["path"] == str(durable) and copy["index"] == 2
    assert any("refs.json" in why for why in copy["skipped"]), copy
    expected = fastckpt.load_checkpoint(durable, 2)["models"]["main"]["model"].state_dict()
    for name, tensor in loaded["models"]["main"]["model"].state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    report = fastckpt.verify(fast)
    assert not report.ok and any(f.path == refs_json and not f.ok for f in report.files)


def test_a_run_started_together_with_another_on_one_durable_tier_stops_promoting(
    tmp_path: Path,
) -> None:
    """Runs A and B start while their shared durable tier is empty; A promotes before B's
    first save. Before: B promoted past A's indices without a word and its retention deleted
    every one of them (A's resume on a new node then took B's weights). Now B's first save
    reads the tier again: its promotions stop, reported (PromotionError caused by
    MixedRunError at close), and A's checkpoints stay."""
    from fastckpt.training.hooks.context import TrainingStage

    durable = tmp_path / "durable"
    data = [torch.randn(8, 16) for _ in range(8)]

    def run(fast: str, seed: int, hooks: list[Any]) -> fastckpt.TrainingStrategy:
        torch.manual_seed(seed)
        return fastckpt.TrainingStrategy(
            torch.nn.Linear(16, 1),
            fastckpt.OptimizerConfig(torch.optim.AdamW, {"lr": 1e-2}),
            training_fn=lambda model, batch: (model(batch) - 1.0).square().mean(),
            hooks=hooks,
            num_steps=4,
        )

    def hook(fast: str) -> fastckpt.CheckpointHook:
        return fastckpt.CheckpointHook(
            tmp_path / fast,
            step_interval=1,
            async_save=False,
            durable_dir=durable,
            durable_keep_last=3,
        )

    run_a = run("a", 0, [hook("a")])

    def start_a_inside_b(ctx: Any, stage: TrainingStage) -> None:
        if stage is TrainingStage.BEFORE_BATCH and ctx.step_count == 0 and not run_a.step_count:
            run_a.run(data)

    hook_b = hook("b")
    run_b = run("b", 7, [start_a_inside_b, hook_b])
    a_indices = [row["index"] for row in fastckpt.list_checkpoints(durable)]
    with pytest.raises(PromotionError) as caught, pytest.warns(RuntimeWarning):
        run_b.run(data)
    assert isinstance(caught.value.__cause__, fastckpt.MixedRunError)
    assert a_indices == [] and [row["index"] for row in fastckpt.list_checkpoints(durable)] == [
        1,
        2,
        3,
    ]
    restored = fastckpt.load_checkpoint(durable)["models"]["main"]["model"]
    assert torch.equal(restored.weight, run_a.models["main"].weight)  # A's, not B's


def test_a_failed_promotion_names_what_it_committed_before_failing(tmp_path: Path) -> None:
    """Before: with the newest index damaged, ``fastckpt promote`` exited 2 saying "nothing
    was written to the target" while the target held the older indices it had committed."""
    fast, durable = tmp_path / "fast", tmp_path / "durable"
    model = _model(3)
    for _ in range(3):
        fastckpt.save_checkpoint(fast, models={"main": (model, None)}, incremental=False)
    path = fast / "2" / "models" / "main.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(
        ChecksumMismatchError, match=r"committed in .*durable before it: index 0, index 1"
    ):
        promote(fast, durable)
    assert [row["index"] for row in fastckpt.list_checkpoints(durable)] == [0, 1]


def test_a_durable_tier_that_cannot_be_read_is_read_again_off_the_training_thread(
    s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A review found every save of a two-tier hook reading the durable tier's manifest on
    the training thread while it could not be read: with a store that does not answer, each
    save stalled for the client's timeouts and retries (15 s with the default options).
    Now the training thread reads it once (the run start's check; had that read succeeded,
    the first save's too); once a read failed, the next ones run in the background, and a
    run still promotes once the store is back."""
    import threading

    import fastckpt.training.hooks.checkpoint as checkpoint_hook

    fast, durable = tmp_path / "fast", s3_server.url("unanswered")
    fastckpt.configure_storage(
        durable, s3_server.options(max_retries=0, retry_timeout_s=1.0, connect_timeout_s=1.0)
    )
    reads: list[str] = []
    load = Manifest.load

    def recorded(root: Any, *args: Any, **kwargs: Any) -> Manifest:
        if str(root).startswith("s3:"):
            reads.append(threading.current_thread().name)
        return load(root, *args, **kwargs)

    monkeypatch.setattr(checkpoint_hook.Manifest, "load", staticmethod(recorded))
    hook = fastckpt.CheckpointHook(
        fast, step_interval=1, async_save=False, durable_dir=durable, save_last=False
    )
    strategy = training_support.new_strategy([hook], num_steps=6)
    s3_server.stop()
    try:
        with pytest.warns(RuntimeWarning), pytest.raises(PromotionError):
            strategy.run(training_support.loader())
    finally:
        s3_server.start()
    assert strategy.step_count == 6
    on_training_thread = [name for name in reads if name == threading.main_thread().name]
    assert len(on_training_thread) == 1, reads  # the start's check (before: one per save)
    assert any(name.startswith("fastckpt-durable-read") for name in reads), reads
    # The store back: the next run reads it at its first save and promotes.
    again = fastckpt.TrainingStrategy.load_checkpoint(
        fast, hooks=[hook], training_fn=training_support.training_fn
    )
    again.num_steps = 7
    again.run(training_support.loader())
    assert fastckpt.list_checkpoints(durable)[-1]["index"] == 6


def test_a_durable_tier_unmounted_under_the_promoter_is_not_refilled_in_its_place(
    tmp_path: Path,
) -> None:
    """A durable tier (a real bind mount) lazily unmounted under a running promoter leaves
    the bare folder beneath its mount point. Before, the next promotion committed into that
    folder, on the training node's own disk, and reported success: the run believed it had
    durable checkpoints. Now that run is refused and reported, the folder stays empty, and
    the first checkpoint after the tier is mounted again is promoted there."""
    fast, durable, store = tmp_path / "fast", tmp_path / "durable", tmp_path / "store"
    durable.mkdir()
    store.mkdir()
    bind = subprocess.run(["mount", "--bind", str(store), str(durable)], capture_output=True)
    if bind.returncode != 0:
        pytest.skip("cannot bind-mount here (needs root and mount rights)")
    try:
        _source(fast, saves=1)
        promoter = Promoter(fast, durable)
        promoter.submit()
        promoter.wait()
        assert promoter.promoted == [0] and promoter.healthy
        subprocess.run(["umount", "--lazy", str(durable)], check=True)
        _source_more(fast)
        with pytest.warns(RuntimeWarning, match="unmounted, replaced or deleted"):
            promoter.submit()
            promoter.wait()
        assert not promoter.healthy and promoter.promoted == [0]
        assert list(durable.iterdir()) == []  # nothing committed into the bare folder
        subprocess.run(["mount", "--bind", str(store), str(durable)], check=True)
        _source_more(fast)
        promoter.submit()
        promoter.close()
        assert promoter.healthy and promoter.promoted == [0, 1, 2]
        assert [c["index"] for c in fastckpt.list_checkpoints(durable)] == [0, 1, 2]
    finally:
        subprocess.run(["umount", "--lazy", str(durable)], check=False)
    assert [c["index"] for c in fastckpt.list_checkpoints(store)] == [0, 1, 2]


def test_a_durable_tier_deleted_under_the_promoter_is_not_made_again(tmp_path: Path) -> None:
    """The deleted case of the test above: the durable root removed (``rm -rf``) under a
    promoter that promoted into it. Before, the next promotion made it again and committed
    there as if nothing had happened."""
    fast, durable = tmp_path / "fast", tmp_path / "durable"
    _source(fast, saves=1)
    promoter = Promoter(fast, durable)
    promoter.submit()
    promoter.wait()
    assert promoter.promoted == [0]
    shutil.rmtree(durable)
    _source_more(fast)
    with pytest.warns(RuntimeWarning, match="unmounted, replaced or deleted"):
        promoter.submit()
        promoter.wait()
    assert not promoter.healthy and not durable.exists()
    with pytest.raises(PromotionError):
        promoter.close()


def test_close_applies_the_fast_tiers_keep_last_once_the_last_promotion_is_done(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The retention after the run's last save spares the index the running promotion
    copies; before, nothing applied keep_last after that promotion ended, so a run with
    ``keep_last=1`` left two indices on the fast tier (round-20 note). Now the hook's
    close() prunes once more when the promotions succeeded. The order is made explicit:
    save 5 starts only once the promotion of index 4 runs, which lasts until save 5's
    retention is done."""
    import threading

    import fastckpt.container.promote as promote_module
    import fastckpt.training.hooks.checkpoint as hook_module

    fast, durable = tmp_path / "fast", tmp_path / "durable"
    real_promote, real_prune = promote_module.promote_index, hook_module.prune_indices
    real_write = hook_module.write_snapshot
    pruned_after: list[list[int]] = []
    copying_4 = threading.Event()

    def recorded_prune(root: Any, keep_last: int, **kwargs: Any) -> Any:
        result = real_prune(root, keep_last, **kwargs)
        pruned_after.append(sorted(Manifest.load(Path(root)).entries))
        return result

    def slow_promote_index(source: Any, target: Any, index: int, **kwargs: Any) -> Any:
        if index == 4:  # held until the last save's retention ran
            copying_4.set()
            deadline = time.monotonic() + 60
            while not any(5 in indices for indices in pruned_after):
                assert time.monotonic() < deadline, pruned_after
                time.sleep(0.01)
        return real_promote(source, target, index, **kwargs)

    def ordered_write(root: Any, *args: Any, **kwargs: Any) -> Any:
        if Manifest.load(Path(root)).latest == 4:  # save 5 waits for index 4's promotion
            assert copying_4.wait(60)
        return real_write(root, *args, **kwargs)

    monkeypatch.setattr(promote_module, "promote_index", slow_promote_index)
    monkeypatch.setattr(hook_module, "prune_indices", recorded_prune)
    monkeypatch.setattr(hook_module, "write_snapshot", ordered_write)
    hook = fastckpt.CheckpointHook(
        fast, step_interval=1, async_save=False, durable_dir=durable, keep_last=1
    )
    strategy = training_support.new_strategy([hook], num_steps=6)
    strategy.run(training_support.loader())
    assert 4 in pruned_after[5] and 5 in pruned_after[5]  # spared: being promoted
    assert hook.promoter is not None and hook.promotion_healthy
    assert hook.promoter.promoted[-2:] == [4, 5]
    assert [c["index"] for c in fastckpt.list_checkpoints(fast)] == [5]
    assert fastckpt.verify(durable).ok
