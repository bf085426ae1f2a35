"""CheckpointManager incremental saves: unchanged tensors are hard links to the previous
sibling checkpoint's files (``linked/``), changed ones are written; every checkpoint stays
loadable after its base is deleted; crashes at any moment leave committed checkpoints whole.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import fastckpt
from fastckpt import ChecksumMismatchError
from fastckpt.container.incremental import mark_frozen, unmark_frozen
from fastckpt.container.links import (
    check_references,
    freed_bytes,
    read_references,
    reference_reports,
    referenced_sources,
)
from fastckpt.format.records import read_commit_record, seal_manifest
from fastckpt.io.files import read_metadata
from fastckpt.manager import CheckpointManager
from training_support import run_two_ranks

REPO = Path(__file__).resolve().parents[1]


def _model(seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    model[0].requires_grad_(False)  # the frozen backbone
    return model


def _linear(model: torch.nn.Sequential, index: int) -> torch.nn.Linear:
    layer = model[index]
    assert isinstance(layer, torch.nn.Linear)
    return layer


def _sync() -> CheckpointManager:
    return CheckpointManager(CheckpointManager.Config.with_sync_save())


def _async() -> CheckpointManager:
    return CheckpointManager(CheckpointManager.Config.with_async_save())


def _save(manager: CheckpointManager, path: Path, state: dict[str, object], **kw: object) -> None:
    future = manager.save(path, state, **kw)  # type: ignore[arg-type]
    if future is not None:
        future.result()


def _written(checkpoint: Path, item: str = "model") -> set[str]:
    """The tensors the checkpoint's own item file holds."""
    return set(read_metadata(checkpoint / f"{item}.safetensors")["tensors"])


def _referenced(checkpoint: Path, item: str = "model") -> set[str]:
    record = read_commit_record(checkpoint)
    return set(read_references(record, str(checkpoint)).get(f"{item}.safetensors", {}))


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


def _assert_bitwise(loaded: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert set(loaded) == set(expected)
    for name, tensor in expected.items():
        assert loaded[name].dtype == tensor.dtype, name
        assert torch.equal(loaded[name].view(torch.uint8), tensor.view(torch.uint8)), name


# --------------------------------------------------------------------------- what is written


def _in_place(model: torch.nn.Sequential) -> set[str]:
    with torch.no_grad():
        _linear(model, 1).weight.mul_(2)
    return {"1.weight"}


def _data_assignment(model: torch.nn.Sequential) -> set[str]:
    layer = _linear(model, 1)
    layer.weight.data = layer.weight.data.clone()  # same values, another storage
    return {"1.weight"}


def _optimizer_step(model: torch.nn.Sequential) -> set[str]:
    optimizer = torch.optim.SGD(model[1].parameters(), lr=0.1)
    model(torch.randn(4, 64)).square().mean().backward()
    optimizer.step()
    return {"1.weight", "1.bias"}


def _load_state_dict(model: torch.nn.Sequential) -> set[str]:
    model.load_state_dict(_snapshot(model))  # equal values, copied in place: all written
    return {"0.weight", "0.bias", "1.weight", "1.bias"}


def _new_tensor(model: torch.nn.Sequential) -> set[str]:
    _linear(model, 1).bias = torch.nn.Parameter(torch.zeros(8))
    return {"1.bias"}


CHANGES: dict[str, Callable[[torch.nn.Sequential], set[str]]] = {
    "in_place": _in_place,
    "data_assignment": _data_assignment,
    "optimizer_step": _optimizer_step,
    "load_state_dict": _load_state_dict,
    "new_tensor": _new_tensor,
}


@pytest.mark.parametrize("change", sorted(CHANGES))
@pytest.mark.parametrize("make", [_sync, _async], ids=["sync", "async"])
def test_changed_tensors_are_written_and_unchanged_ones_linked(
    change: str, make: Callable[[], CheckpointManager], tmp_path: Path
) -> None:
    model = _model()
    with make() as manager:
        _save(manager, tmp_path / "a", {"model": model})
        changed = CHANGES[change](model)
        expected = _snapshot(model)
        _save(manager, tmp_path / "b", {"model": model})
        unchanged = set(expected) - changed
        assert _written(tmp_path / "b") == changed
        assert _referenced(tmp_path / "b") == unchanged
        if unchanged:
            # The link is the base's file itself (same inode): no byte was copied.
            link = os.stat(tmp_path / "b" / "linked" / "model.0.safetensors")
            assert link.st_ino == os.stat(tmp_path / "a" / "model.safetensors").st_ino
        loaded = manager.load(tmp_path / "b")["model"]
    _assert_bitwise(loaded, expected)


def test_unchanged_state_writes_only_what_changed(tmp_path: Path) -> None:
    model = _model()
    optimizer = torch.optim.AdamW(model[1].parameters(), lr=1e-3)
    with _sync() as manager:
        for step in range(3):
            model(torch.randn(4, 64)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            _save(manager, tmp_path / f"step_{step}", {"model": model, "optim": optimizer})
        full = (tmp_path / "step_0" / "model.safetensors").stat().st_size
        own = (tmp_path / "step_2" / "model.safetensors").stat().st_size
        # The backbone is 64*64+64 of 64*64+64+64*8+8 floats: the rest is under 12 %.
        assert own < full * 0.15
        assert _referenced(tmp_path / "step_2") == {"0.weight", "0.bias"}
        # The optimizer's moments change at every step: written every time.
        assert _referenced(tmp_path / "step_2", "optim") == set()
        record = read_commit_record(tmp_path / "step_2")
        refs = read_references(record, "commit.json")["model.safetensors"]
        for name, ref in refs.items():
            assert ref["file"] == "linked/model.0.safetensors"
            assert ref["name"] == name and ref["nbytes"] == ref["offsets"][1] - ref["offsets"][0]
        assert record["files"]["linked/model.0.safetensors"]["size"] == full
        # A record with references says so in its schema version (an older fastckpt then asks
        # for an upgrade instead of missing tensors); a full one stays at version 1.
        assert record["schema_version"] == 2
        assert read_commit_record(tmp_path / "step_0")["schema_version"] == 1


def test_mark_frozen_skips_the_version_check(tmp_path: Path) -> None:
    model = _model()
    mark_frozen(model[0])
    with _sync() as manager:
        _save(manager, tmp_path / "a", {"model": model})
        with torch.no_grad():
            _linear(model, 0).weight.add_(0)  # bumps the version counter, same bytes
            _linear(model, 1).weight.add_(0)  # not marked: written
        _save(manager, tmp_path / "b", {"model": model})
    assert _written(tmp_path / "b") == {"1.weight"}
    assert _referenced(tmp_path / "b") == {"0.weight", "0.bias", "1.bias"}


def test_a_tensor_changed_while_unmarked_and_marked_again_is_saved_as_it_is_now(
    tmp_path: Path,
) -> None:
    """The manager's side of progressive unfreezing (see test_incremental's): before, the
    save after a re-mark linked the bytes of the save before the unmark."""
    model = _model()
    mark_frozen(model[0])
    with _sync() as manager:
        _save(manager, tmp_path / "a", {"model": model})
        unmark_frozen(model[0])
        with torch.no_grad():
            _linear(model, 0).weight.add_(1.0)  # changed while not marked
        mark_frozen(model[0])
        _save(manager, tmp_path / "b", {"model": model})
        assert "0.weight" in _written(tmp_path / "b")
        loaded = manager.load(tmp_path / "b")["model"]
        assert torch.equal(loaded["0.weight"], _linear(model, 0).weight.detach())
        _save(manager, tmp_path / "c", {"model": model})
        assert {"0.weight", "0.bias"} <= _referenced(tmp_path / "c")


def test_async_capture_stages_everything_and_links_what_the_staged_digest_proves(
    tmp_path: Path,
) -> None:
    model = _model()
    with _async() as manager:
        _save(manager, tmp_path / "a", {"model": model})
        full = manager._stager.nbytes
        with manager.lock(), torch.no_grad():
            _linear(model, 1).weight.add_(1)
        expected = _snapshot(model)
        future = manager.save(tmp_path / "b", {"model": model})
        # lock() waits for the capture: the checkpoint holds the state before this.
        with manager.lock(), torch.no_grad():
            _linear(model, 1).weight.add_(1)
            _linear(model, 0).weight.add_(1)
        assert future is not None
        future.result()
        # Every tensor was staged (the digest proving "unchanged" is of the staged copy,
        # taken off the training thread); the live edits after the capture do not matter.
        assert manager._stager.nbytes == full
        loaded = manager.load(tmp_path / "b")["model"]
    _assert_bitwise(loaded, expected)
    assert _referenced(tmp_path / "b") == {"0.weight", "0.bias", "1.bias"}


# --------------------------------------------------------------------------- loading


@pytest.mark.parametrize("make", [_sync, _async], ids=["sync", "async"])
def test_round_trip_after_the_bases_are_deleted(
    make: Callable[[], CheckpointManager], tmp_path: Path
) -> None:
    model = _model()
    optimizer = torch.optim.SGD(model[1].parameters(), lr=0.1, momentum=0.9)
    with make() as manager:
        for step in range(4):
            model(torch.randn(4, 64)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            state = {"model": model, "optim": optimizer, "step": step}
            _save(manager, tmp_path / f"step_{step}", state)
        expected = _snapshot(model)
        expected_optim = optimizer.state_dict()
        for step in range(3):
            shutil.rmtree(tmp_path / f"step_{step}")  # what users do: no retention API
        last = tmp_path / "step_3"
        assert _referenced(last) == {"0.weight", "0.bias"}
        assert fastckpt.verify(last).ok
        assert check_references(last, read_commit_record(last)) == []
        loaded = manager.load(last)
        _assert_bitwise(loaded["model"], expected)
        assert loaded["step"] == 3
        # into=: templates filled in place, stateful objects restored.
        fresh = _model(seed=1)
        fresh_optim = torch.optim.SGD(fresh[1].parameters(), lr=0.1, momentum=0.9)
        manager.load(last, into={"model": fresh, "optim": fresh_optim})
        _assert_bitwise(_snapshot(fresh), expected)
        buffers = fresh_optim.state_dict()["state"]
        for index, entry in expected_optim["state"].items():
            assert torch.equal(buffers[index]["momentum_buffer"], entry["momentum_buffer"])
        # A partial template: only the named tensors are read.
        part = {"0.weight": torch.empty(64, 64)}
        manager.load(last, into={"model": part})
        assert torch.equal(part["0.weight"], expected["0.weight"])
        moved = manager.load(last, map_location="cpu")["model"]
        _assert_bitwise(moved, expected)


def test_fastckpt_prune_of_the_bases_keeps_the_newest_loadable(tmp_path: Path) -> None:
    model = _model()
    root = tmp_path / "runs"
    with _sync() as manager:
        for step in range(3):
            with torch.no_grad():
                _linear(model, 1).bias.fill_(step)
            _save(manager, root / f"step_{step}", {"model": model})
            time.sleep(0.02)  # distinct commit times: prune keeps the newest by commit
        doomed, kept = [root / "step_0", root / "step_1"], [root / "step_2"]
        frozen_file = (root / "step_0" / "model.safetensors").stat().st_size
        own_files = sum((d / "model.safetensors").stat().st_size for d in doomed[1:])
        small = sum(p.stat().st_size for d in doomed for p in d.glob("*.json"))
        # step_0's file lives on in step_2's link: only the rest is freed.
        assert freed_bytes(doomed, kept) == own_files + small
        assert freed_bytes(doomed, kept) < frozen_file
        result = subprocess.run(
            [sys.executable, "-m", "fastckpt", "prune", str(root), "--keep-last", "1"],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(REPO / "python")},
        )
        assert result.returncode == 0, result.stderr
        assert sorted(os.listdir(root)) == ["step_2"]
        loaded = manager.load(root / "step_2")["model"]
    _assert_bitwise(loaded, _snapshot(model))
    assert fastckpt.verify(root / "step_2").ok


def test_copies_out_of_the_mapping_when_use_mmap_is_off(tmp_path: Path) -> None:
    config = CheckpointManager.Config.with_sync_save()
    config.load.use_mmap = False
    model = _model()
    with CheckpointManager(config) as manager:
        _save(manager, tmp_path / "a", {"model": model})
        _save(manager, tmp_path / "b", {"model": model})
        shutil.rmtree(tmp_path / "a")
        loaded = manager.load(tmp_path / "b")["model"]
    _assert_bitwise(loaded, _snapshot(model))


def test_saving_the_same_directory_again_is_incremental(tmp_path: Path) -> None:
    model = _model()
    with _sync() as manager:
        for value in range(3):
            with torch.no_grad():
                _linear(model, 1).bias.fill_(value)
            _save(manager, tmp_path / "latest", {"model": model})
            if value:
                assert _written(tmp_path / "latest") == {"1.bias"}
        loaded = manager.load(tmp_path / "latest")["model"]
    _assert_bitwise(loaded, _snapshot(model))
    assert sorted(os.listdir(tmp_path)) == ["latest"]


def test_corrupt_linked_bytes_raise_checksum_mismatch(tmp_path: Path) -> None:
    model = _model()
    with _sync() as manager:
        _save(manager, tmp_path / "a", {"model": model, "step": 0})
        with torch.no_grad():
            _linear(model, 1).weight.add_(1)
        _save(manager, tmp_path / "b", {"model": model, "step": 1})
        shutil.rmtree(tmp_path / "a")
        linked = tmp_path / "b" / "linked" / "model.0.safetensors"
        header = read_metadata(linked)
        begin = header["data_start"] + header["tensors"]["0.weight"]["data_offsets"][0]
        with open(linked, "r+b") as handle:
            handle.seek(begin + 10)
            byte = handle.read(1)
            handle.seek(begin + 10)
            handle.write(bytes([byte[0] ^ 0xFF]))
        with pytest.raises(ChecksumMismatchError, match=r"model\.0\.safetensors"):
            manager.load(tmp_path / "b")
        assert not fastckpt.verify(tmp_path / "b").ok
        # An item that does not reference it still loads.
        assert manager.load(tmp_path / "b", into={"step": None}) == {"step": 1}


def test_a_missing_link_names_the_file_and_the_fix(tmp_path: Path) -> None:
    model = _model()
    with _sync() as manager:
        _save(manager, tmp_path / "a", {"model": model})
        _save(manager, tmp_path / "b", {"model": model})
        (tmp_path / "b" / "linked" / "model.0.safetensors").unlink()
        with pytest.raises(
            FileNotFoundError, match=r"linked/model\.0\.safetensors: missing.*Restore"
        ):
            manager.load(tmp_path / "b")
        assert not fastckpt.verify(tmp_path / "b").ok
        assert "missing" in check_references(tmp_path / "b", read_commit_record(tmp_path / "b"))[0]


def test_a_reference_that_does_not_match_the_linked_header_is_refused(tmp_path: Path) -> None:
    model = _model()
    with _sync() as manager:
        _save(manager, tmp_path / "a", {"model": model})
        _save(manager, tmp_path / "b", {"model": model})
        path = tmp_path / "b" / "commit.json"
        record = json.loads(path.read_text())
        record["refs"]["model.safetensors"]["0.bias"]["crc32c"] ^= 1
        path.write_text(json.dumps(seal_manifest(record)))
        with pytest.raises(ChecksumMismatchError, match=r"'0\.bias'"):
            manager.load(tmp_path / "b")
        record = read_commit_record(tmp_path / "b")
        problems = check_references(tmp_path / "b", record)
        assert len(problems) == 1 and "0.bias" in problems[0]
        reports = reference_reports(tmp_path / "b", record)
        assert [report.status for report in reports] == ["corrupt"]
        sources = referenced_sources(tmp_path / "b", record)["model.safetensors"]
        linked = tmp_path / "b" / "linked" / "model.0.safetensors"
        assert sources["0.bias"][0] == linked and sources["0.bias"][1]["name"] == "0.bias"


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("nbytes", "24", r"\.nbytes must be int, got '24'"),
        ("crc32c", True, r"\.crc32c must be int, got True"),
        ("offsets", [8, 4], r"\.offsets must be \[begin, begin \+ nbytes\]"),
        ("file", "../../etc/passwd", r"\.file"),
        ("file", "linked/elsewhere.safetensors", r"is not listed in the record's files"),
    ],
)
def test_hostile_reference_fields_are_typed_errors(
    tmp_path: Path, field: str, value: object, message: str
) -> None:
    """A commit record whose references were edited is refused before any byte is read,
    naming the file, the tensor and the field."""
    model = _model()
    with _sync() as manager:
        _save(manager, tmp_path / "a", {"model": model})
        _save(manager, tmp_path / "b", {"model": model})
        path = tmp_path / "b" / "commit.json"
        record = json.loads(path.read_text())
        record["refs"]["model.safetensors"]["0.weight"][field] = value
        path.write_text(json.dumps(seal_manifest(record)))
        with pytest.raises(fastckpt.CheckpointFormatError, match=message) as caught:
            manager.load(tmp_path / "b")
        assert "commit.json" in str(caught.value) and "0.weight" in str(caught.value)
        assert not fastckpt.verify(tmp_path / "b").ok


# --------------------------------------------------------------------------- when it applies


def test_incremental_false_writes_everything(tmp_path: Path) -> None:
    config = CheckpointManager.Config.with_sync_save()
    config.incremental = False
    model = _model()
    with CheckpointManager(config) as manager:
        _save(manager, tmp_path / "a", {"model": model})
        _save(manager, tmp_path / "b", {"model": model})
        with pytest.raises(ValueError, match=r"Config\.incremental"):
            manager.save(tmp_path / "c", {"model": model}, base=tmp_path / "b")
    assert _written(tmp_path / "b") == set(model.state_dict())
    assert "refs" not in read_commit_record(tmp_path / "b")
    assert not (tmp_path / "b" / "linked").exists()
    with pytest.raises(TypeError, match="incremental must be a bool"):
        CheckpointManager.Config(incremental="yes")  # type: ignore[arg-type]


def test_only_siblings_or_an_explicit_base_are_referenced(tmp_path: Path) -> None:
    model = _model()
    with _sync() as manager:
        _save(manager, tmp_path / "one" / "a", {"model": model})
        _save(manager, tmp_path / "two" / "b", {"model": model})  # another parent: full
        assert _referenced(tmp_path / "two" / "b") == set()
        _save(manager, tmp_path / "three" / "c", {"model": model}, base=tmp_path / "two" / "b")
        assert _referenced(tmp_path / "three" / "c") == set(model.state_dict())
        with pytest.raises(ValueError, match="previous save"):
            manager.save(tmp_path / "three" / "d", {"model": model}, base=tmp_path / "one" / "a")
        shutil.rmtree(tmp_path / "one")
        shutil.rmtree(tmp_path / "two")
        loaded = manager.load(tmp_path / "three" / "c")["model"]
    _assert_bitwise(loaded, _snapshot(model))


def test_a_deleted_base_is_written_in_full(tmp_path: Path) -> None:
    model = _model()
    with _sync() as manager:
        _save(manager, tmp_path / "a", {"model": model})
        shutil.rmtree(tmp_path / "a")
        _save(manager, tmp_path / "b", {"model": model})
        assert _written(tmp_path / "b") == set(model.state_dict())
        # ... and the next save references that full one again.
        _save(manager, tmp_path / "c", {"model": model})
        assert _referenced(tmp_path / "c") == set(model.state_dict())


def _other_filesystem(tmp_path: Path) -> Path:
    shm = Path("/dev/shm")
    if not shm.is_dir() or os.stat(shm).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs /dev/shm on another filesystem than the temporary directory")
    return shm


@pytest.mark.parametrize("make", [_sync, _async], ids=["sync", "async"])
def test_no_links_across_filesystems_falls_back_to_a_full_write(
    make: Callable[[], CheckpointManager], tmp_path: Path
) -> None:
    other = _other_filesystem(tmp_path) / f"fastckpt-test-{os.getpid()}-{random.random()}"
    model = _model()
    try:
        with make() as manager:
            _save(manager, other / "a", {"model": model})
            with torch.no_grad():
                _linear(model, 1).bias.add_(1)
            _save(manager, tmp_path / "b", {"model": model}, base=other / "a")
            # The link failed (EXDEV): the unchanged tensors were read back from the base
            # (checked against their crc32c) and written.
            assert _written(tmp_path / "b") == set(model.state_dict())
            assert "refs" not in read_commit_record(tmp_path / "b")
            assert not (tmp_path / "b" / "linked").exists()
            shutil.rmtree(other)
            loaded = manager.load(tmp_path / "b")["model"]
            # The full one is the base of the next save, on this filesystem.
            _save(manager, tmp_path / "c", {"model": model})
            assert _referenced(tmp_path / "c") == set(model.state_dict())
    finally:
        shutil.rmtree(other, ignore_errors=True)
    _assert_bitwise(loaded, _snapshot(model))


def test_a_base_deleted_while_an_async_save_is_in_flight_is_still_read(tmp_path: Path) -> None:
    """The base's files are opened at capture: deleting the base before the write links
    them makes the write read the unchanged tensors back from the open files."""
    model = _model()
    big = {"big": torch.randn(4_000_000)}  # a first item that takes a while to write
    with _async() as manager:
        _save(manager, tmp_path / "a", {"big": big, "model": model})
        with manager.lock():
            big["big"] = torch.randn(4_000_000)
        future = manager.save(tmp_path / "b", {"big": big, "model": model})
        shutil.rmtree(tmp_path / "a")
        assert future is not None
        future.result()
        loaded = manager.load(tmp_path / "b")["model"]
    _assert_bitwise(loaded, _snapshot(model))
    # Linked before the deletion, or read back after it: never lost.
    assert _referenced(tmp_path / "b") | _written(tmp_path / "b") == set(model.state_dict())


# --------------------------------------------------------------------------- crashes

CHILD = textwrap.dedent(
    """
    import shutil, sys
    import torch
    from fastckpt import CheckpointManager

    root, step = sys.argv[1], int(sys.argv[2])
    generator = torch.Generator().manual_seed(0)
    frozen = torch.randn(512, 512, generator=generator)
    trainable = torch.zeros(128, 128)
    manager = CheckpointManager(CheckpointManager.Config.with_async_save())
    print("ready", flush=True)
    while True:
        with manager.lock():
            trainable.fill_(float(step))
        manager.save(
            f"{root}/step_{step:06d}",
            {"model": {"frozen": frozen, "trainable": trainable}, "step": step},
        )
        if step % 3 == 0:  # delete the base at once: linked, or read back from it
            shutil.rmtree(f"{root}/step_{step - 1:06d}", ignore_errors=True)
        shutil.rmtree(f"{root}/step_{step - 4:06d}", ignore_errors=True)
        step += 1
    """
)


def test_sigkill_during_incremental_saves_leaves_every_committed_checkpoint_whole(
    tmp_path: Path,
) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    rng = random.Random(15)
    frozen = torch.randn(512, 512, generator=torch.Generator().manual_seed(0))
    env = {**os.environ, "PYTHONPATH": str(REPO / "python")}
    kills, checked, incremental = 14, 0, 0
    step = 0
    with CheckpointManager(CheckpointManager.Config.with_sync_save()) as reader:
        for _ in range(kills):
            child = subprocess.Popen(
                [sys.executable, str(script), str(root), str(step)],
                stdout=subprocess.PIPE,
                env=env,
            )
            assert child.stdout is not None
            assert child.stdout.readline().strip() == b"ready"
            time.sleep(rng.uniform(0.05, 0.6))
            child.send_signal(signal.SIGKILL)
            child.wait()
            child.stdout.close()
            committed = sorted(
                path
                for path in root.iterdir()
                if path.name.startswith("step_") and (path / "commit.json").is_file()
            )
            for path in committed:
                number = int(path.name.removeprefix("step_"))
                loaded = reader.load(path)
                assert loaded["step"] == number
                assert torch.equal(loaded["model"]["frozen"], frozen), path
                expected = torch.full((128, 128), float(number))
                assert torch.equal(loaded["model"]["trainable"], expected), path
                incremental += bool(_referenced(path))
                assert fastckpt.verify(path).ok, path
                checked += 1
            numbers = [int(p.name.removeprefix("step_")) for p in committed]
            step = max(numbers, default=step) + 1
        # The next save next to them removes what the killed saves left (dead writers'
        # staging directories, with their links).
        reader.save(root / "after", {"step": step})
        assert not [name for name in os.listdir(root) if name.startswith(".")]
    assert checked >= kills
    assert incremental > 0  # the kills landed in runs of incremental saves


# --------------------------------------------------------------------------- process groups

TWO_RANKS = """
import shutil, sys, torch, torch.distributed as dist
from fastckpt import CheckpointManager
from training_support import leave_process_group
root, rank = sys.argv[1], int(sys.argv[2])
dist.init_process_group("gloo", init_method=f"file://{sys.argv[3]}", rank=rank, world_size=2)
frozen = torch.full((256,), float(rank))
head = torch.zeros(4)
with CheckpointManager(CheckpointManager.Config.with_async_save()) as manager:
    manager.save(f"{root}/a", {"model": {"frozen": frozen, "head": head}}).result()
    with manager.lock():
        head.add_(1 + rank)
    manager.save(f"{root}/b", {"model": {"frozen": frozen, "head": head}}).result()
    dist.barrier()
    if rank == 0:
        shutil.rmtree(f"{root}/a")
    dist.barrier()
    loaded = manager.load(f"{root}/b")["model"]
    assert torch.equal(loaded["frozen"], frozen) and torch.equal(loaded["head"], head), loaded
print("ok", rank)
leave_process_group()
"""


def test_each_rank_links_its_own_file_under_a_process_group(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    outputs = run_two_ranks(TWO_RANKS, root, tmp_path / "pg")
    assert [out.split() for out in outputs] == [["ok", "0"], ["ok", "1"]]
    record = read_commit_record(root / "b")
    refs = read_references(record, "commit.json")
    assert {relpath: sorted(names) for relpath, names in refs.items()} == {
        "model.rank0.safetensors": ["frozen"],
        "model.rank1.safetensors": ["frozen"],
    }
    assert refs["model.rank1.safetensors"]["frozen"]["file"] == "linked/model.rank1.0.safetensors"
    for rank in range(2):
        assert set(read_metadata(root / "b" / f"model.rank{rank}.safetensors")["tensors"]) == {
            "head"
        }
    assert fastckpt.verify(root / "b").ok
    assert check_references(root / "b", record) == []


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("make", [_sync, _async], ids=["sync", "async"])
def test_cuda_state_writes_only_the_changed_tensors(
    make: Callable[[], CheckpointManager], tmp_path: Path
) -> None:
    model = _model().cuda()
    with make() as manager:
        _save(manager, tmp_path / "a", {"model": model})
        with manager.lock(), torch.no_grad():
            _linear(model, 1).weight.add_(1)
        _save(manager, tmp_path / "b", {"model": model})
        # Every tensor went through the pinned staging pool: an unchanged one is proven so
        # by the digest of its staged bytes (docs/incremental.md); only the changed one is
        # written (below).
        state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        assert manager._stager.nbytes == state_bytes
        shutil.rmtree(tmp_path / "a")
        loaded = manager.load(tmp_path / "b", map_location="cuda")["model"]
    assert _written(tmp_path / "b") == {"1.weight"}
    expected = {name: tensor.cpu() for name, tensor in model.state_dict().items()}
    _assert_bitwise({name: tensor.cpu() for name, tensor in loaded.items()}, expected)


def test_a_write_cancelled_before_it_starts_closes_the_base_files_it_opened(
    tmp_path: Path,
) -> None:
    """With ``use_async_staging=False`` the capture (which opens the base files to link) runs
    in ``save``; a write cancelled before its thread starts it must still close them."""
    config = CheckpointManager.Config.with_async_save()
    config.save.staging_config.use_async_staging = False
    model = _model()
    with CheckpointManager(config) as manager:
        _save(manager, tmp_path / "a", {"model": model})
        writer = manager._writer
        assert writer is not None and writer._executor is not None
        release = threading.Event()
        blocker = writer._executor.submit(release.wait)  # the write thread is busy
        before = len(os.listdir("/proc/self/fd"))
        future = manager.save(tmp_path / "b", {"model": model})
        assert future is not None
        assert len(os.listdir("/proc/self/fd")) > before  # the base file is held open
        assert future.cancel()
        release.set()
        blocker.result()
        assert len(os.listdir("/proc/self/fd")) == before
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("make", [_sync, _async], ids=["sync", "async"])
def test_inference_tensors_are_always_written(
    make: Callable[[], CheckpointManager], tmp_path: Path
) -> None:
    """A tensor made under ``torch.inference_mode()`` has no version counter: an incremental
    save writes it every time (it raised ``RuntimeError`` reading the counter), and changes
    made to it in inference mode are saved."""
    with torch.inference_mode():
        stats = torch.zeros(64)
    model = _model()
    with make() as manager:
        _save(manager, tmp_path / "a", {"model": model, "stats": {"t": stats}})
        with torch.inference_mode():
            stats.add_(1)  # in place, no counter to move
        _save(manager, tmp_path / "b", {"model": model, "stats": {"t": stats}})
        assert _written(tmp_path / "b", "stats") == {"t"}
        assert _referenced(tmp_path / "b") == set(model.state_dict())
        loaded = manager.load(tmp_path / "b")
    assert torch.equal(loaded["stats"]["t"], torch.ones(64))
    _assert_bitwise(loaded["model"], _snapshot(model))


def test_another_process_saving_the_same_id_never_damages_this_managers_next_saves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two jobs save one id (RELIABILITY: not serialized, the last one wins). Job B's save of
    # the id lands between job A's commit and A's tracking of what it committed (here:
    # injected at that instant). Before, A took B's files for its own (stat after the
    # commit) and its next incremental save, of an id only A writes, linked B's file under
    # A's record: that checkpoint failed its checksum, and every later one built on it.
    from fastckpt.manager import incremental

    frozen = torch.randn(100_000)

    def state(value: int) -> dict[str, object]:
        return {"model": {"w": torch.full((1000,), float(value)), "frozen": frozen}, "step": value}

    job_a = CheckpointManager(CheckpointManager.Config.with_sync_save())
    job_b = CheckpointManager(CheckpointManager.Config.with_sync_save())
    record = incremental.Tracker.record
    raced: list[Path] = []

    def record_after_a_racing_save(self: incremental.Tracker, directory: Path, *args, **kw):
        if not raced and directory.name == "shared":
            raced.append(directory)
            job_b.save(tmp_path / "shared", state(2))
        return record(self, directory, *args, **kw)

    monkeypatch.setattr(incremental.Tracker, "record", record_after_a_racing_save)
    job_a.save(tmp_path / "shared", state(1))
    assert raced
    monkeypatch.setattr(incremental.Tracker, "record", record)
    for step in (3, 4):
        job_a.save(tmp_path / "own", state(step))
        assert fastckpt.verify(tmp_path / "own").ok
        loaded = job_a.load(tmp_path / "own")
        assert loaded["step"] == step
        assert torch.equal(loaded["model"]["frozen"], frozen)
    assert fastckpt.verify(tmp_path / "shared").ok
    assert job_a.load(tmp_path / "shared")["step"] == 2
    # Still incremental after the race: the second save of "own" links the frozen tensor.
    assert read_commit_record(tmp_path / "own").get("refs")
    job_a.close()
    job_b.close()
