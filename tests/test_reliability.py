"""Reliability: corruption is detected, hostile input is refused, full disks and concurrent
writers leave every committed checkpoint intact. Real files, real processes, no mocks.

See RELIABILITY.md for the guarantees these tests back.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from fastckpt import (
    CheckpointManager,
    _native,
    create_model_spec,
    load_checkpoint,
    load_file,
    read_metadata,
    save_checkpoint,
)
from fastckpt.errors import (
    CheckpointFormatError,
    ChecksumMismatchError,
    FastCkptError,
    UntrustedTargetError,
)
from fastckpt.store import backend
from fastckpt.store.commit import RootLock
from fastckpt.store.paths import safe_join
from fastckpt.store.records import MANIFEST, Manifest, seal_manifest
from fastckpt.verify import CheckpointSkippedWarning, VerifyReport, latest_intact, verify

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import crash_harness

TYPED = (FastCkptError, OSError)
#: What hostile input may raise; anything else (AttributeError, IndexError, RecursionError,
#: a crash) is a bug.
ALLOWED = (FastCkptError, ValueError, KeyError, TypeError, OSError)
CALLS: list[str] = []


def must_not_run(*args: Any, **kwargs: Any) -> Any:
    """A function a tampered spec could name; records every call."""
    CALLS.append("called")


# --------------------------------------------------------------------------- fixtures


class Net(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.width = width
        self.a = nn.Linear(width, 16)
        self.b = nn.Linear(16, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


Trained = tuple[Net, torch.optim.Optimizer, Any]


def trained(seed: int, steps: int = 3) -> Trained:
    torch.manual_seed(seed)
    model = Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(4, 8)).square().mean().backward()
        optimizer.step()
        scheduler.step()
    return model, optimizer, scheduler


def save(root: Path, state: Trained) -> int:
    model, optimizer, scheduler = state
    return save_checkpoint(
        root,
        models={"main": (model, create_model_spec(Net, width=8))},
        optimizers={"adam": (optimizer, None)},
        schedulers={"sched": (scheduler, None)},
        counters={"step": 3},
    )


def states(state: Trained) -> dict[str, Any]:
    model, optimizer, scheduler = state
    return {
        "main": copy.deepcopy(model.state_dict()),
        "adam": copy.deepcopy(optimizer.state_dict()),
        "sched": copy.deepcopy(scheduler.state_dict()),
    }


def loaded_states(result: dict[str, Any]) -> dict[str, Any]:
    main = result["models"]["main"]
    return {
        "main": main["model"].state_dict(),
        "adam": main["optimizers"]["adam"]["optimizer"].state_dict(),
        "sched": main["schedulers"]["sched"]["scheduler"].state_dict(),
    }


@dataclass
class Saved:
    root: Path
    expected: dict[int, dict[str, Any]]
    manager_dirs: dict[str, Path]
    manager_expected: dict[str, dict[str, Any]]

    def files(self, index: int) -> list[str]:
        return sorted(Manifest.load(self.root).entries[index]["files"])


def manager_state(state: Trained) -> dict[str, Any]:
    model, optimizer, _ = state
    return {"model": model.state_dict(), "optim": optimizer.state_dict(), "meta": {"step": 3}}


@pytest.fixture
def saved(tmp_path: Path) -> Saved:
    root = tmp_path / "root"
    first, second = trained(1), trained(2)
    assert save(root, first) == 0
    assert save(root, second) == 1
    dirs = {"a": tmp_path / "mgr" / "a", "b": tmp_path / "mgr" / "b"}
    with CheckpointManager(CheckpointManager.Config.with_sync_save()) as writer:
        writer.save(dirs["a"], manager_state(first))
        writer.save(dirs["b"], manager_state(second))
    return Saved(
        root,
        {0: states(first), 1: states(second)},
        dirs,
        {"a": copy.deepcopy(manager_state(first)), "b": copy.deepcopy(manager_state(second))},
    )


def mload(directory: Path) -> dict[str, Any]:
    with CheckpointManager(CheckpointManager.Config.with_sync_save()) as reader:
        return reader.load(directory)


def assert_same(expected: Any, actual: Any) -> None:
    found = crash_harness.difference(expected, actual)
    assert found is None, found


def assert_intact(saved: Saved, index: int) -> None:
    assert_same(saved.expected[index], loaded_states(load_checkpoint(saved.root, index)))


def detected(load: Callable[[], Any], *names: str) -> BaseException:
    """``load`` must raise a typed error whose message names every one of ``names``."""
    try:
        load()
    except TYPED as err:
        for name in names:
            assert name in str(err), f"{name!r} not named in: {err!r}"
        return err
    raise AssertionError("damaged checkpoint loaded without an error")


def only_failure(report: VerifyReport, path: Path, status: str | None = None) -> None:
    assert [f.path for f in report.failures] == [path], report.summary()
    if status is not None:
        assert report.failures[0].status == status, report.summary()


@contextlib.contextmanager
def altered(path: Path, data: bytes) -> Iterator[None]:
    original = path.read_bytes()
    path.write_bytes(data)
    try:
        yield
    finally:
        path.write_bytes(original)


def flip(data: bytes, position: int, bit: int) -> bytes:
    changed = bytearray(data)
    changed[position] ^= 1 << bit
    return bytes(changed)


# --------------------------------------------------------------------------- the verify API


def test_verify_accepts_every_kind_of_target(saved: Saved, tmp_path: Path) -> None:
    root = saved.root
    report = verify(root)
    assert report.ok and report.kind == "root" and report.indices == [0, 1]
    assert report.files[0].path == root / MANIFEST
    assert report.files[0].expected_crc32c == report.files[0].actual_crc32c is not None
    assert len(report.files) == 1 + len(saved.files(0)) + len(saved.files(1))
    for record in report.files[1:]:
        assert record.expected_size == record.actual_size
        assert record.expected_crc32c == record.actual_crc32c
        assert record.index in (0, 1) and record.status == "ok"
    assert verify(root, 0).indices == [0]
    assert verify(root, -1).indices == [1]
    assert verify(root / MANIFEST).indices == [0, 1]
    index_report = verify(root / "1")
    assert index_report.kind == "index" and index_report.indices == [1] and index_report.ok
    lone = verify(root / "1" / "models" / "main.safetensors")
    assert lone.kind == "file" and lone.ok and lone.files[0].expected_crc32c is None
    assert lone.files[0].actual_crc32c == _native.crc32c(lone.files[0].path.read_bytes())
    manager_report = verify(saved.manager_dirs["a"])
    assert manager_report.kind == "manager" and manager_report.ok
    assert verify(saved.manager_dirs["a"] / "commit.json").kind == "manager"
    assert "ok" in str(report) and report.failed_indices() == []
    with pytest.raises(KeyError, match="available"):
        verify(root, 7)
    with pytest.raises(ValueError, match="index="):
        verify(saved.manager_dirs["a"], 0)
    with pytest.raises(FileNotFoundError, match="not a fastckpt checkpoint"):
        verify(tmp_path)
    with pytest.raises(FileNotFoundError):
        verify(tmp_path / "nothing-here")
    assert latest_intact(tmp_path / "nothing-here") is None


def test_latest_intact_warns_about_a_damaged_manifest_but_checks_every_index(
    saved: Saved,
) -> None:
    path = saved.root / MANIFEST
    document = json.loads(path.read_bytes())
    document["checkpoints"]["1"]["counters"]["step"] = 4  # the checksum no longer matches
    path.write_text(json.dumps(document))
    report = verify(saved.root)
    assert [f.path for f in report.failures] == [path]
    assert report.failures[0].status == "mismatch" and report.failed_indices() == [0, 1]
    with pytest.warns(CheckpointSkippedWarning, match="differs from the recorded"):
        assert latest_intact(saved.root) == 1


# --------------------------------------------------------------------------- corruption


def test_bit_flips_in_tensor_data_name_the_file_and_the_tensor(saved: Saved) -> None:
    root = saved.root
    checked = 0
    for relpath in ("models/main.safetensors", "optimizers/adam.safetensors"):
        path = root / "1" / relpath
        meta = read_metadata(path)
        data = path.read_bytes()
        for name, info in meta["tensors"].items():
            begin, end = info["data_offsets"]
            position = meta["data_start"] + (begin + end) // 2
            with altered(path, flip(data, position, checked % 8)):
                err = detected(lambda: load_checkpoint(root, 1), str(path), f"`{name}`")
                assert isinstance(err, ChecksumMismatchError)
                report = verify(root)
                only_failure(report, path, "corrupt")
                assert f"`{name}`" in report.failures[0].message
                assert report.failed_indices() == [1] and report.index_ok(0)
                with pytest.warns(CheckpointSkippedWarning, match=r"index 1\b.*" + name):
                    assert latest_intact(root) == 0
            checked += 1
    assert checked >= 10
    assert_intact(saved, 0)
    assert_intact(saved, 1)

    path = saved.manager_dirs["a"] / "model.safetensors"
    meta = read_metadata(path)
    data = path.read_bytes()
    for name, info in meta["tensors"].items():
        begin, end = info["data_offsets"]
        with altered(path, flip(data, meta["data_start"] + (begin + end) // 2, 3)):
            detected(lambda: mload(saved.manager_dirs["a"]), str(path), f"`{name}`")
            only_failure(verify(saved.manager_dirs["a"]), path, "corrupt")


def test_bit_flips_in_safetensors_headers_are_detected(saved: Saved, tmp_path: Path) -> None:
    root = saved.root
    path = root / "1" / "models" / "main.safetensors"
    data = path.read_bytes()
    header_end = read_metadata(path)["data_start"]
    original = load_file(path)
    lone = tmp_path / "lone.safetensors"
    rng = random.Random(1)
    for position in range(header_end):  # every byte of the 8-byte prefix and the JSON header
        damaged = flip(data, position, rng.randrange(8))
        with altered(path, damaged):
            only_failure(verify(root, 1), path)
            if position < 8 or position % 9 == 0:
                detected(lambda: load_checkpoint(root, 1), str(path))
        # Without a manifest, the file's own header checks still catch it (or, at worst, the
        # very same tensors load).
        lone.write_bytes(damaged)
        try:
            assert_same(original, load_file(lone))
        except TYPED as err:
            assert str(lone) in str(err)
    manager_file = saved.manager_dirs["b"] / "optim.safetensors"
    data = manager_file.read_bytes()
    for position in range(0, read_metadata(manager_file)["data_start"], 7):
        with altered(manager_file, flip(data, position, rng.randrange(8))):
            detected(lambda: mload(saved.manager_dirs["b"]), str(manager_file))
            only_failure(verify(saved.manager_dirs["b"]), manager_file)
    assert_intact(saved, 1)


def test_truncation_in_every_region_is_detected(saved: Saved, tmp_path: Path) -> None:
    root = saved.root
    path = root / "1" / "models" / "main.safetensors"
    data = path.read_bytes()
    start = read_metadata(path)["data_start"]
    lone = tmp_path / "lone.safetensors"
    for cut in range(len(data)):  # the core alone, at every length
        lone.write_bytes(data[:cut])
        with pytest.raises(CheckpointFormatError, match=r"lone\.safetensors"):
            _native.verify_file(str(lone), 2)
    regions = {
        "prefix": [0, 3, 7],
        "header": [8, start // 2, start - 1],
        "data": [start, (start + len(data)) // 2, len(data) - 1],
    }
    for cuts in regions.values():
        for cut in cuts:
            with altered(path, data[:cut]):
                err = detected(lambda: load_checkpoint(root, 1), str(path))
                assert isinstance(err, CheckpointFormatError), (cut, err)
                only_failure(verify(root), path, "mismatch")
                with pytest.warns(CheckpointSkippedWarning, match="index 1"):
                    assert latest_intact(root) == 0
    directory = saved.manager_dirs["a"]
    manager_file = directory / "model.safetensors"
    manager_data = manager_file.read_bytes()
    start, end = read_metadata(manager_file)["data_start"], len(manager_data)
    for cut in (0, 3, 7, 8, start // 2, start - 1, start, (start + end) // 2, end - 1):
        with altered(manager_file, manager_data[:cut]):
            detected(lambda: mload(directory), str(manager_file))
            only_failure(verify(directory), manager_file, "mismatch")
    for relpath in ("models/main.spec.json", "optimizers/adam.json", "schedulers/sched.json"):
        json_path = root / "1" / relpath
        content = json_path.read_bytes()
        with altered(json_path, content[: len(content) // 2]):
            detected(lambda: load_checkpoint(root, 1), str(json_path))
            only_failure(verify(root), json_path, "mismatch")
    for record_path, load in (
        (root / MANIFEST, lambda: load_checkpoint(root)),
        (saved.manager_dirs["a"] / "commit.json", lambda: mload(saved.manager_dirs["a"])),
    ):
        content = record_path.read_bytes()
        for cut in (0, 1, len(content) // 2, len(content) - 1):
            with altered(record_path, content[:cut]):
                err = detected(load, str(record_path))
                assert isinstance(err, CheckpointFormatError)
                report = verify(record_path.parent)
                assert report.failures[0].path == record_path
                assert report.failures[0].status == "corrupt"
    assert_intact(saved, 1)


def test_deleted_files_are_detected(saved: Saved) -> None:
    root = saved.root
    for relpath in saved.files(1):
        path = root / "1" / relpath
        aside = path.with_name(path.name + ".aside")
        path.rename(aside)
        try:
            err = detected(lambda: load_checkpoint(root, 1), str(path))
            assert isinstance(err, FileNotFoundError)
            only_failure(verify(root), path, "missing")
            with pytest.warns(CheckpointSkippedWarning, match="index 1"):
                assert latest_intact(root) == 0
        finally:
            aside.rename(path)
    (root / "1").rename(root / "gone")
    detected(lambda: load_checkpoint(root), str(root / "1"))
    report = verify(root)
    assert {f.status for f in report.failures} == {"missing"}
    assert report.failed_indices() == [1]
    with pytest.warns(CheckpointSkippedWarning):
        assert latest_intact(root) == 0
    assert_intact(saved, 0)

    directory = saved.manager_dirs["a"]
    for path in sorted(directory.iterdir()):
        aside = path.with_name(path.name + ".aside")
        path.rename(aside)
        try:
            detected(lambda: mload(directory), str(path))
            if path.name == "commit.json":
                with pytest.raises(FileNotFoundError, match="not a fastckpt checkpoint"):
                    verify(directory)
            else:
                only_failure(verify(directory), path, "missing")
        finally:
            aside.rename(path)
    assert_same(saved.manager_expected["a"], mload(directory))


def test_files_swapped_between_checkpoints_are_detected(saved: Saved) -> None:
    root = saved.root
    swapped = 0
    for relpath in saved.files(1):
        a, b = root / "0" / relpath, root / "1" / relpath
        a_bytes, b_bytes = a.read_bytes(), b.read_bytes()
        if a_bytes == b_bytes:
            continue  # identical content (e.g. the same spec): swapping changes nothing
        with altered(a, b_bytes), altered(b, a_bytes):
            detected(lambda: load_checkpoint(root, 0), str(a))
            detected(lambda: load_checkpoint(root, 1), str(b))
            report = verify(root)
            assert sorted(f.path for f in report.failures) == sorted([a, b]), report.summary()
            assert latest_intact_quiet(root) is None
        swapped += 1
    assert swapped >= 2  # the tensor files (specs and skeletons are identical)
    first, second = saved.manager_dirs["a"], saved.manager_dirs["b"]
    for name in ("model.safetensors", "optim.safetensors"):
        a, b = first / name, second / name
        a_bytes, b_bytes = a.read_bytes(), b.read_bytes()
        with altered(a, b_bytes), altered(b, a_bytes):
            detected(lambda: mload(first), str(a))
            detected(lambda: mload(second), str(b))
            assert [f.path for f in verify(first).failures] == [a]
    assert_intact(saved, 0)
    assert_intact(saved, 1)


def latest_intact_quiet(root: Path) -> int | None:
    with pytest.warns(CheckpointSkippedWarning):
        return latest_intact(root)


def test_bit_flips_in_json_files_are_detected(saved: Saved) -> None:
    root = saved.root
    rng = random.Random(2)
    for relpath in ("models/main.spec.json", "optimizers/adam.json", "schedulers/sched.json"):
        path = root / "1" / relpath
        data = path.read_bytes()
        # crc32c catches every single-bit error; every 5th byte shows verify() reports them.
        for position in range(0, len(data), 5):
            with altered(path, flip(data, position, rng.randrange(8))):
                only_failure(verify(root, 1), path, "mismatch")
                if position % 41 == 0:
                    err = detected(lambda: load_checkpoint(root, 1), str(path))
                    assert isinstance(err, ChecksumMismatchError)

    # The manifest checksums itself: verify() catches every flip. load_checkpoint catches
    # every flip that would change what is loaded (sizes, checksums, names, associations).
    path = root / MANIFEST
    data = path.read_bytes()
    pristine = Manifest.load(root).entries
    for position in range(len(data)):
        damaged = flip(data, position, rng.randrange(8))
        with altered(path, damaged):
            with pytest.raises((ChecksumMismatchError, CheckpointFormatError)):
                Manifest.load(root, verify_checksum=True)
            if position % 7 == 0:
                report = verify(root)
                assert report.files[0].path == path and not report.files[0].ok, position
            if position % 13 == 0:
                for index in (0, 1):
                    try:
                        result = load_checkpoint(root, index)
                    except ALLOWED:
                        continue
                    assert_same(saved.expected[index], loaded_states(result))
                    entry = pristine[index]
                    for field in ("components", "associations", "files"):
                        assert result["manifest"][field] == entry[field], (position, field)

    # commit.json has no checksum of its own: every flip must either fail the load with a
    # typed error or change nothing that is loaded.
    directory = saved.manager_dirs["b"]
    path = directory / "commit.json"
    data = path.read_bytes()
    silent = 0
    for position in range(len(data)):
        with altered(path, flip(data, position, rng.randrange(8))):
            try:
                loaded = mload(directory)
            except ALLOWED:
                continue
            assert_same(saved.manager_expected["b"], loaded)
            silent += 1
    assert silent < len(data) // 10


# --------------------------------------------------------------------------- hostile input

INTERESTING: list[Any] = [
    None,
    True,
    -1,
    0,
    2**63,
    2**64 + 7,
    10**400,
    1e308,
    -0.0,
    "",
    "..",
    "../../etc/passwd",
    "/etc/passwd",
    "models/../../x",
    "a\\b",
    "\x00",
    "x" * 5000,
    [],
    {},
    [[[[[]]]]],
    {"__tensor__": "nope"},
    {"__dict__": [[{"__float__": "nan"}, 1]]},
    {"__tuple__": 5},
    "os.system",
    "subprocess.Popen",
    "builtins.eval",
    "builtins.__import__",
    f"{__name__}.must_not_run",
    "torch.optim.Adam",
]


def _mutate_value(rng: random.Random, value: Any, depth: int = 0) -> Any:
    """Replace, drop or add one node somewhere inside ``value``."""
    if isinstance(value, dict) and value and rng.random() < 0.8 and depth < 12:
        key = rng.choice(list(value))
        action = rng.random()
        result = dict(value)
        if action < 0.15:
            del result[key]
        elif action < 0.25:
            result[rng.choice(["extra", "__tensor__", "spec", "0", key + "x"])] = rng.choice(
                INTERESTING
            )
        else:
            result[key] = _mutate_value(rng, value[key], depth + 1)
        return result
    if isinstance(value, list) and value and rng.random() < 0.8 and depth < 12:
        result_list = list(value)
        i = rng.randrange(len(value))
        if rng.random() < 0.15:
            del result_list[i]
        else:
            result_list[i] = _mutate_value(rng, value[i], depth + 1)
        return result_list
    if isinstance(value, str) and value and rng.random() < 0.3:
        i = rng.randrange(len(value))
        return value[:i] + rng.choice("./\\x0~ ") + value[i + 1 :]
    if isinstance(value, int) and not isinstance(value, bool) and rng.random() < 0.3:
        return value + rng.choice([-1, 1, 1 << 31, -(1 << 40)])
    return rng.choice(INTERESTING)


def _mutate_bytes(rng: random.Random, data: bytes) -> bytes:
    changed = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        action = rng.random()
        i = rng.randrange(len(changed) + 1)
        if action < 0.4 and i < len(changed):
            changed[i] = rng.randrange(256)
        elif action < 0.7:
            changed[i:i] = bytes(rng.choice([b'"', b"{", b"[", b"]", b"}", b",", b"\xff", b"9"]))
        else:
            del changed[i : i + rng.randint(1, 8)]
    return bytes(changed)


def _reseal(records: dict[str, Any], relpath: str, data: bytes) -> None:
    records[relpath] = {"size": len(data), "crc32c": _native.crc32c(data)}


def _write_mutation(target: str, root: Path, directory: Path, rng: random.Random) -> None:
    """Mutate one JSON input like an attacker would: if the file is covered by a commit
    record, the record is updated so that the damage reaches the parser."""
    if target == "manifest":
        path = root / MANIFEST  # sealed below when it still parses, to reach the checks behind
    elif target == "commit":
        path = directory / "commit.json"
    elif target.startswith("mgr:"):
        path = directory / target[4:]
    else:
        path = root / "1" / target
    original = path.read_bytes()
    if rng.random() < 0.04:
        data = b"[" * 100_000 + b"]" * 100_000  # nesting deeper than any parser recursion
    elif rng.random() < 0.6:
        data = json.dumps(_mutate_value(rng, json.loads(original))).encode()
    else:
        data = _mutate_bytes(rng, original)
    path.write_bytes(data)
    if target == "manifest":
        with contextlib.suppress(ValueError, RecursionError, TypeError, AttributeError):
            document = json.loads(data)
            path.write_text(json.dumps(seal_manifest(document)))
    if target.startswith("mgr:"):
        record = json.loads((directory / "commit.json").read_bytes())
        _reseal(record["files"], target[4:], data)
        (directory / "commit.json").write_text(json.dumps(record))
    elif target not in ("manifest", "commit"):
        document = json.loads((root / MANIFEST).read_bytes())
        _reseal(document["checkpoints"]["1"]["files"], target, data)
        (root / MANIFEST).write_text(json.dumps(seal_manifest(document)))


def _origin(err: BaseException) -> str:
    """The fastckpt module whose code raised ``err`` (deepest fastckpt frame)."""
    frames = [f for f in traceback.extract_tb(err.__traceback__) if "/fastckpt/" in f.filename]
    return Path(frames[-1].filename).name if frames else "?"


def test_fuzzed_json_inputs_raise_only_typed_errors(saved: Saved, tmp_path: Path) -> None:
    rng = random.Random(1234)
    targets = [
        "manifest",
        "models/main.spec.json",
        "optimizers/adam.json",
        "schedulers/sched.json",
        "commit",
        "mgr:model.json",
        "mgr:optim.json",
        "mgr:meta.json",
    ]
    work = tmp_path / "fuzz"
    outcomes: dict[str, int] = {}
    problems: list[str] = []
    CALLS.clear()
    for iteration in range(400):
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(saved.root, work / "root")
        shutil.copytree(saved.manager_dirs["b"], work / "mgr")
        target = targets[iteration % len(targets)]
        _write_mutation(target, work / "root", work / "mgr", rng)
        if target == "commit" or target.startswith("mgr:"):
            attempts: list[Callable[[], Any]] = [
                lambda: mload(work / "mgr"),
                lambda: verify(work / "mgr"),
            ]
        else:
            attempts = [
                lambda: load_checkpoint(work / "root", 1),
                lambda: verify(work / "root"),
                lambda: latest_intact(work / "root"),
            ]
        for attempt in attempts:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", CheckpointSkippedWarning)
                    attempt()
                outcome = "ok"
            except ALLOWED as err:
                outcome = type(err).__name__
            except Exception as err:  # anything else is a bug
                origin = _origin(err)
                described = f"{type(err).__name__} from {origin}"
                problems.append(f"iteration {iteration} ({target}): {described}: {err}")
                outcome = "BUG"
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
    assert CALLS == [], "a tampered checkpoint ran code"
    assert problems == [], "\n".join(problems[:20])
    assert outcomes.get("ok", 0) < sum(outcomes.values()), outcomes


HUGE_SCRIPT = r"""
import resource, sys
import fastckpt
from fastckpt import _native, load_file, read_metadata, load_checkpoint
from fastckpt.verify import verify

with open("/proc/self/status") as status:
    size = next(int(l.split()[1]) for l in status if l.startswith("VmSize")) * 1024
# No more than 1 GiB of new address space: allocating what a hostile header claims would fail.
resource.setrlimit(resource.RLIMIT_AS, (size + (1 << 30), resource.RLIM_INFINITY))
refused = 0
for path in sys.argv[2:]:
    for read in (load_file, read_metadata, lambda p: _native.verify_file(p, 4)):
        try:
            read(path)
        except (fastckpt.FastCkptError, OSError) as err:
            assert path in str(err), err
            refused += 1
        else:
            raise SystemExit(f"{path}: loaded")
    report = verify(path)
    assert not report.ok and path in report.failures[0].message, report
    refused += 1
for target in (lambda: load_checkpoint(sys.argv[1]), lambda: verify(sys.argv[1])):
    try:
        report = target()
    except (fastckpt.FastCkptError, OSError) as err:
        refused += 1
    else:
        assert not report.ok
        refused += 1
print("refused", refused)
"""


def _raw_safetensors(path: Path, header: bytes | None, prefix: int | None, data: bytes) -> None:
    header = header or b""
    length = len(header) if prefix is None else prefix
    path.write_bytes(length.to_bytes(8, "little") + header + data)


def test_headers_claiming_huge_sizes_do_not_allocate_them(saved: Saved, tmp_path: Path) -> None:
    hostile = []
    for name, header, prefix in [
        ("u64max", None, 2**64 - 1),
        ("i64max", None, 2**63),
        ("over-cap", None, 100 * 1024 * 1024 + 1),
        ("under-cap-but-beyond-file", None, 99 * 1024 * 1024),
        (
            "terabyte-tensor",
            json.dumps({"t": {"dtype": "F32", "shape": [1 << 38], "data_offsets": [0, 1 << 40]}}),
            None,
        ),
        (
            "overflowing-shape",
            json.dumps(
                {"t": {"dtype": "F64", "shape": [1 << 62, 1 << 62], "data_offsets": [0, 8]}}
            ),
            None,
        ),
    ]:
        path = tmp_path / f"{name}.safetensors"
        encoded = None if header is None else header.encode().ljust(8 * (len(header) // 8 + 1))
        _raw_safetensors(path, encoded, prefix, b"\0" * 64)
        hostile.append(str(path))
    # A manifest claiming an enormous file: the size check refuses it before any read.
    document = json.loads((saved.root / MANIFEST).read_bytes())
    document["checkpoints"]["1"]["files"]["models/main.safetensors"]["size"] = 1 << 60
    (saved.root / MANIFEST).write_text(json.dumps(seal_manifest(document)))
    environment = {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}
    result = subprocess.run(
        [sys.executable, "-c", HUGE_SCRIPT, str(saved.root), *hostile],
        capture_output=True,
        text=True,
        timeout=300,
        env=environment,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.split() == ["refused", str(4 * len(hostile) + 2)]


def test_path_traversal_and_absolute_paths_are_refused(saved: Saved) -> None:
    root = saved.root
    manifest_path = root / MANIFEST
    pristine = json.loads(manifest_path.read_bytes())
    for bad in ("../escape.json", "/etc/passwd", "models/../../x", "models//x", "models/.x"):
        document = copy.deepcopy(pristine)
        files = document["checkpoints"]["1"]["files"]
        files[bad] = files.pop("models/main.spec.json")
        manifest_path.write_text(json.dumps(seal_manifest(document)))
        detected(lambda: load_checkpoint(root, 1), repr(bad))
        report = verify(root)
        assert report.files[0].status == "corrupt" and repr(bad) in report.files[0].message
    for field, bad in (("models", "../../etc"), ("optimizers", "/abs"), ("schedulers", "a/b")):
        document = copy.deepcopy(pristine)
        document["checkpoints"]["1"]["components"][field] = [bad]
        manifest_path.write_text(json.dumps(seal_manifest(document)))
        err = detected(lambda: load_checkpoint(root, 1), repr(bad))
        assert isinstance(err, CheckpointFormatError)
    manifest_path.write_text(json.dumps(pristine))
    assert_intact(saved, 1)

    directory = saved.manager_dirs["a"]
    record_path = directory / "commit.json"
    record = json.loads(record_path.read_bytes())
    for bad in ("../b/model.json", "/etc/passwd"):
        changed = copy.deepcopy(record)
        changed["files"][bad] = changed["files"].pop("model.json")
        record_path.write_text(json.dumps(changed))
        detected(lambda: mload(directory), repr(bad))
        assert verify(directory).files[0].status == "corrupt"
    changed = copy.deepcopy(record)
    changed["items"] = ["../b/model"]
    record_path.write_text(json.dumps(changed))
    detected(lambda: mload(directory), "../b/model")
    record_path.write_text(json.dumps(record))
    with (
        CheckpointManager(CheckpointManager.Config.with_sync_save()) as writer,
        pytest.raises(CheckpointFormatError),
    ):
        writer.save(directory.parent / "..", {"x": torch.ones(1)})


def _symlink_outside(path: Path, outside: Path) -> None:
    outside.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(path, outside)  # identical bytes: only the location is wrong
    path.unlink()
    path.symlink_to(outside)


def test_symlinks_escaping_the_checkpoint_are_refused_by_verify(
    saved: Saved, tmp_path: Path
) -> None:
    root = saved.root
    link = root / "1" / "models" / "main.safetensors"
    _symlink_outside(link, tmp_path / "elsewhere" / "main.safetensors")
    report = verify(root)
    only_failure(report, link, "corrupt")
    assert "outside the checkpoint" in report.failures[0].message
    with pytest.raises(CheckpointFormatError, match="outside the checkpoint"):
        safe_join(root / "1", "models/main.safetensors", within=root)

    shutil.copytree(root / "0", tmp_path / "elsewhere" / "0")
    shutil.rmtree(root / "0")
    (root / "0").symlink_to(tmp_path / "elsewhere" / "0")
    assert set(verify(root).failed_indices()) == {0, 1}

    directory = saved.manager_dirs["a"]
    link = directory / "optim.safetensors"
    _symlink_outside(link, tmp_path / "elsewhere" / "optim.safetensors")
    only_failure(verify(directory), link, "corrupt")


def test_symlinks_inside_the_checkpoint_are_allowed(saved: Saved) -> None:
    root = saved.root
    spec = root / "1" / "models" / "main.spec.json"
    (root / "shared").mkdir()
    spec.rename(root / "shared" / "main.spec.json")
    spec.symlink_to(Path("..", "..", "shared", "main.spec.json"))
    assert verify(root).ok
    assert_intact(saved, 1)
    # A symlinked CheckpointManager checkpoint ("latest" -> a step directory) is fine too.
    latest = saved.manager_dirs["a"].parent / "latest"
    latest.symlink_to(saved.manager_dirs["b"].name)
    assert verify(latest).ok
    assert_same(saved.manager_expected["b"], mload(latest))


def test_load_checkpoint_refuses_symlinks_escaping_the_root(saved: Saved, tmp_path: Path) -> None:
    link = saved.root / "1" / "models" / "main.safetensors"
    _symlink_outside(link, tmp_path / "elsewhere" / "main.safetensors")
    with pytest.raises(CheckpointFormatError, match="outside the checkpoint"):
        load_checkpoint(saved.root, 1)


def test_manager_load_refuses_symlinks_escaping_the_checkpoint(
    saved: Saved, tmp_path: Path
) -> None:
    link = saved.manager_dirs["a"] / "model.safetensors"
    _symlink_outside(link, tmp_path / "elsewhere" / "model.safetensors")
    with pytest.raises(CheckpointFormatError, match="outside the checkpoint"):
        mload(saved.manager_dirs["a"])


@pytest.mark.parametrize(
    ("relpath", "field"),
    [
        ("optimizers/adam.json", "spec"),
        ("schedulers/sched.json", "spec"),
        ("models/main.spec.json", None),
    ],
)
@pytest.mark.parametrize(
    "target", ["os.system", "subprocess.Popen", "builtins.exec", f"{__name__}.must_not_run"]
)
def test_dotted_paths_outside_the_trust_policy_are_refused(
    saved: Saved, relpath: str, field: str | None, target: str
) -> None:
    root = saved.root
    path = root / "1" / relpath
    document = json.loads(path.read_bytes())
    spec = document if field is None else document[field]
    spec["cls_path"] = target
    data = json.dumps(document).encode()
    path.write_bytes(data)
    manifest = json.loads((root / MANIFEST).read_bytes())
    _reseal(manifest["checkpoints"]["1"]["files"], relpath, data)  # a consistent forgery
    (root / MANIFEST).write_text(json.dumps(seal_manifest(manifest)))
    CALLS.clear()
    with pytest.raises(UntrustedTargetError, match=target.replace(".", r"\.")) as info:
        load_checkpoint(root, 1)
    assert "trusted" in str(info.value)
    assert CALLS == []


# --------------------------------------------------------------------------- full disk


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir()
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
    )
    return result.returncode == 0


def _leave_free(disk: Path, pages: int) -> None:
    filler = disk / "filler"
    filler.unlink(missing_ok=True)
    info = os.statvfs(disk)
    size = max(0, (info.f_bavail - pages) * info.f_frsize)
    if size:
        with open(filler, "wb") as handle:
            os.posix_fallocate(handle.fileno(), 0, size)


def test_disk_full_at_every_point_of_a_save(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, "2m"):
        pytest.skip("cannot mount a size-limited tmpfs here (needs root and mount rights)")
    try:
        root = disk / "root"
        first, second = trained(1), trained(2)
        stages: set[str] = set()
        for free in range(40):
            shutil.rmtree(root, ignore_errors=True)
            (disk / "filler").unlink(missing_ok=True)
            save(root, first)
            before = (root / MANIFEST).read_bytes()
            _leave_free(disk, free)
            try:
                save(root, second)
            except OSError as err:
                assert err.errno == errno.ENOSPC, err
                named = Path(err.filename or "")
                assert named.name and named.name in str(err), err
                assert named.name.endswith((".safetensors", ".json")), err
                stages.add("manifest" if named.name == MANIFEST else named.suffix)
                assert (root / MANIFEST).read_bytes() == before
                assert sorted(p.name for p in root.iterdir()) == ["0", MANIFEST]
                assert verify(root).ok
                assert_same(states(first), loaded_states(load_checkpoint(root)))
                continue
            assert verify(root).ok
            assert_same(states(second), loaded_states(load_checkpoint(root, 1)))
            assert sorted(p.name for p in root.iterdir()) == ["0", "1", MANIFEST]
            break
        else:
            raise AssertionError("the save never fit")
        assert stages == {".safetensors", ".json", "manifest"}, stages
    finally:
        subprocess.run(["umount", str(disk)], check=False)


# --------------------------------------------------------------------------- concurrent writers


def test_root_lock_excludes_other_holders(tmp_path: Path) -> None:
    inside: list[int] = []
    errors: list[str] = []

    def worker(me: int) -> None:
        for _ in range(100):
            with RootLock(tmp_path):
                if inside:
                    errors.append(f"{me} entered while {inside} held the lock")
                inside.append(me)
                time.sleep(0.0001)
                inside.remove(me)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert not (tmp_path / ".fastckpt.lock").exists()


def test_root_lock_dies_with_its_holder(tmp_path: Path) -> None:
    process, conn = crash_harness.start(crash_harness.hold_root_lock, str(tmp_path))
    try:
        assert conn.poll(60) and conn.recv_bytes() == b"locked"
        with pytest.raises(TimeoutError, match="another process is saving"):
            RootLock(tmp_path, timeout=0.2).acquire()
        os.kill(process.pid, signal.SIGKILL)
        process.join()
        began = time.monotonic()
        with RootLock(tmp_path, timeout=5):
            assert time.monotonic() - began < 1
        save_checkpoint(tmp_path, models={"main": (nn.Linear(2, 2), None)})
        assert sorted(p.name for p in tmp_path.iterdir()) == ["0", MANIFEST]
    finally:
        if process.is_alive():
            process.kill()


def _lock_waiters(lock_file: Path) -> int:
    """How many processes/threads wait for an flock on ``lock_file`` (from /proc/locks)."""
    try:
        inode = os.stat(lock_file).st_ino
    except FileNotFoundError:
        return 0
    waiting = 0
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()
        at = fields.index("->") if "->" in fields else -1
        if at >= 0 and fields[at + 1] == "FLOCK" and int(fields[at + 5].split(":")[2]) == inode:
            waiting += 1
    return waiting


def test_next_index_is_chosen_under_the_lock(tmp_path: Path) -> None:
    root = tmp_path / "root"
    first, second = trained(1), trained(2)
    save(root, first)
    result: dict[str, Any] = {}
    lock = RootLock(root)
    lock.acquire()
    thread = threading.Thread(target=lambda: result.update(index=save(root, second)))
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while _lock_waiters(root / ".fastckpt.lock") == 0:  # the save now waits for us
            assert time.monotonic() < deadline, "save_checkpoint never waited for the lock"
            time.sleep(0.01)
        # Meanwhile "another writer" (we hold the lock) commits index 1.
        shutil.copytree(root / "0", root / "1")
        manifest = Manifest.load(root)
        manifest.entries[1] = copy.deepcopy(manifest.entries[0])
        manifest.commit()
    finally:
        lock.release()
        thread.join()
    assert result["index"] == 2
    assert sorted(Manifest.load(root).entries) == [0, 1, 2]
    assert verify(root).ok


def _run_writers(root: Path, api: str, writers: int = 2, count: int = 12) -> dict[int, list[int]]:
    started = [
        crash_harness.start(crash_harness.concurrent_saver, str(root), w, count, api)
        for w in range(writers)
    ]
    got: dict[int, list[int]] = {}
    for writer, (process, conn) in enumerate(started):
        assert conn.poll(300), "writer did not finish"
        status, payload = conn.recv()
        process.join(60)
        assert status == "ok", payload
        got[writer] = payload
    return got


def test_two_processes_with_index_writers_are_serialized(tmp_path: Path) -> None:
    root = tmp_path / "root"
    got = _run_writers(root, "index_writer")
    indices = [i for w in got.values() for i in w]
    assert sorted(indices) == list(range(len(indices)))  # distinct, no gaps
    manifest = Manifest.load(root, verify_checksum=True)
    assert sorted(manifest.entries) == sorted(indices)
    assert verify(root).ok
    for writer, mine in got.items():
        for i, index in enumerate(mine):
            assert manifest.entries[index]["counters"] == {"writer": writer, "i": i}
            marker = load_file(root / str(index) / "models" / "main.safetensors")["marker"]
            assert torch.equal(marker, torch.full((4,), float(1000 * writer + i)))
    assert not [p.name for p in root.iterdir() if p.name.startswith(".")]


def test_two_processes_saving_into_one_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    got = _run_writers(root, "save_checkpoint")
    indices = [i for w in got.values() for i in w]
    assert len(set(indices)) == len(indices), got
    assert verify(root).ok
    for writer, mine in got.items():
        for i, index in enumerate(mine):
            result = load_checkpoint(root, index)
            assert result["manifest"]["counters"] == {"writer": writer, "i": i}
            marker = result["models"]["main"]["model"].marker
            assert torch.equal(marker, torch.full((4,), float(1000 * writer + i)))


# --------------------------------------------------------------------------- repair paths


def _dead_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def test_interrupted_fallback_replace_is_repaired(tmp_path: Path) -> None:
    """Where the filesystem cannot exchange directories, replacing one takes two renames; a
    crash between them leaves the old checkpoint in a trash sibling. The next writer puts it
    back."""
    directory = tmp_path / "step_1"
    with CheckpointManager(CheckpointManager.Config.with_sync_save()) as writer:
        writer.save(directory, {"x": torch.arange(4.0)})
    host = backend._HOST
    trash = tmp_path / f".trash-step_1~{_dead_pid()}~{host}~0badcafe"
    directory.rename(trash)  # the crash: old checkpoint moved aside, new one not in place
    temp = tmp_path / f".tmp-step_1~{_dead_pid()}~{host}~0badcafe"
    temp.mkdir()
    (temp / "half-written").write_bytes(b"x")
    with CheckpointManager(CheckpointManager.Config.with_sync_save()) as writer:
        writer.save(tmp_path / "step_2", {"x": torch.ones(2)})
        assert torch.equal(writer.load(directory)["x"], torch.arange(4.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1", "step_2"]


def test_crash_while_replacing_a_committed_index_leaves_a_consistent_root(
    tmp_path: Path,
) -> None:
    """Replacing index 1 withdraws it from the manifest before the swap: a crash right after
    the swap (before the manifest records the new files) leaves a root that verifies."""
    root = tmp_path / "root"
    first, second, third = trained(1), trained(2), trained(3)
    save(root, first)
    save(root, second)
    process, conn = crash_harness.start(crash_harness.replace_index_and_die, str(root), 1)
    assert conn.poll(120) and conn.recv_bytes() == b"swapped"
    process.join(60)
    assert process.exitcode == -signal.SIGKILL
    assert sorted(Manifest.load(root).entries) == [0]
    assert verify(root).ok
    assert_same(states(first), loaded_states(load_checkpoint(root)))
    assert save(root, third) == 1
    assert verify(root).ok
    assert_same(states(third), loaded_states(load_checkpoint(root, 1)))
    assert sorted(p.name for p in root.iterdir()) == ["0", "1", MANIFEST]


def test_the_next_save_finishes_an_interrupted_prune(tmp_path: Path) -> None:
    """prune commits the manifest first, then deletes directories; a crash in between leaves
    directories nothing names. The next save (under the root lock) removes those older than
    the latest index, and leaves a newer one (an uncommitted next index) for that save."""
    root = tmp_path / "root"
    for seed in range(3):
        save(root, trained(seed))
    manifest = Manifest.load(root)
    del manifest.entries[0]
    manifest.commit()  # the crash: index 0 withdrawn, its directory still there
    (root / "9").mkdir()  # an uncommitted directory newer than the latest index
    assert save(root, trained(4)) == 3
    assert sorted(p.name for p in root.iterdir()) == ["1", "2", "3", "9", MANIFEST]
    assert verify(root).ok
