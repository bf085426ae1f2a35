"""Reliability: corruption is detected, hostile input is refused, full disks and concurrent
writers leave every committed checkpoint intact. Real files, real processes, no mocks.

See RELIABILITY.md for the guarantees these tests back.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from checkpoint_support import (
    TYPED,
    Saved,
    altered,
    assert_intact,
    assert_same,
    detected,
    flip,
    mload,
    only_failure,
    symlink_outside,
)
from fastckpt import (
    _native,
    list_checkpoints,
    load_checkpoint,
    load_file,
    read_metadata,
)
from fastckpt.container.verify import CheckpointSkippedWarning, latest_intact, verify
from fastckpt.errors import (
    CheckpointFormatError,
    ChecksumMismatchError,
    FastCkptError,
    UntrustedTargetError,
)
from fastckpt.format.records import MANIFEST, Manifest, seal_manifest

#: What hostile input may raise; anything else (AttributeError, IndexError, RecursionError,
#: a crash) is a bug.
#: The ``saved`` fixture (two indices of a root and two manager checkpoints).
pytest_plugins = ["checkpoint_support"]

ALLOWED = (FastCkptError, ValueError, KeyError, TypeError, OSError)
CALLS: list[str] = []


def must_not_run(*args: Any, **kwargs: Any) -> Any:
    """A function a tampered spec could name; records every call."""
    CALLS.append("called")


# --------------------------------------------------------------------------- the verify API


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

    # The manifest checksums itself: every flip of every byte fails verify() and every load
    # (the latest, or an index named) with a typed error naming manifest.json.
    path = root / MANIFEST
    data = path.read_bytes()
    typed = (ChecksumMismatchError, CheckpointFormatError)
    for position in range(len(data)):
        damaged = flip(data, position, rng.randrange(8))
        with altered(path, damaged):
            with pytest.raises(typed):
                Manifest.load(root, verify_checksum=True)
            for index in (None, 0, 1):
                with pytest.raises(typed, match=re.escape(MANIFEST)):
                    load_checkpoint(root, index)
            if position % 7 == 0:
                report = verify(root)
                assert report.files[0].path == path and not report.files[0].ok, position

    # commit.json carries a crc32c of its own content: every flip of every byte fails the load
    # with a typed error naming the file and makes verify report the checkpoint not ok.
    directory = saved.manager_dirs["b"]
    path = directory / "commit.json"
    data = path.read_bytes()
    for position in range(len(data)):
        with altered(path, flip(data, position, rng.randrange(8))):
            with pytest.raises(typed, match=re.escape("commit.json")):
                mload(directory)
            if position % 5 == 0:
                report = verify(directory)
                blamed = [f.status for f in report.files if f.path == path]
                assert not report.ok and blamed == ["corrupt"], (position, report)


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
        (directory / "commit.json").write_text(json.dumps(seal_manifest(record)))
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
from fastckpt.container.verify import verify

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


@pytest.mark.parametrize("outside", ["elsewhere", "root_other", "root0"])
def test_load_checkpoint_refuses_symlinks_escaping_the_root(
    saved: Saved, tmp_path: Path, outside: str
) -> None:
    """A root's file linked to a copy outside the root is refused, in an unrelated folder
    and in a sibling whose name starts with the root's (``root_other``, ``root0``). The
    siblings were added in round 20: a containment check by string prefix without the
    trailing separator took them for inside the root and still passed this test."""
    link = saved.root / "1" / "models" / "main.safetensors"
    symlink_outside(link, tmp_path / outside / "main.safetensors")
    with pytest.raises(CheckpointFormatError, match="outside the checkpoint"):
        load_checkpoint(saved.root, 1)


@pytest.mark.parametrize(
    "outside", ["elsewhere", "mgr/a_other", "mgr/a0"], ids=["elsewhere", "a_other", "a0"]
)
def test_manager_load_refuses_symlinks_escaping_the_checkpoint(
    saved: Saved, tmp_path: Path, outside: str
) -> None:
    """A manager checkpoint's item file (``mgr/a``) linked to a copy outside it is refused,
    in an unrelated folder and in a sibling whose name starts with the checkpoint's
    (``mgr/a_other``; ``mgr/a0`` as ``step_10`` is to ``step_1``). The siblings were added in
    round 20: a containment check by string prefix without the trailing separator took
    them for inside the checkpoint and still passed this test."""
    link = saved.manager_dirs["a"] / "model.safetensors"
    symlink_outside(link, tmp_path / outside / "model.safetensors")
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


# --------------------------------------------------------------------------- concurrent writers


# --------------------------------------------------------------------------- repair paths


# --------------------------------------------------------------------------- special files


@contextlib.contextmanager
def _within(seconds: int) -> Any:
    """Fail (instead of hanging the suite) when the block takes longer than ``seconds``."""

    def expired(signum: int, frame: Any) -> None:
        raise AssertionError(f"still running after {seconds} s: a read blocks or does not end")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _replace_by(path: Path, kind: str, outside: Path) -> None:
    """Put a FIFO, a link to /dev/zero, or a link to an identical copy outside the checkpoint
    in place of ``path``."""
    if kind == "outside":
        symlink_outside(path, outside / path.name)
        return
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to("/dev/zero")


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "outside"])
@pytest.mark.parametrize(
    "relpath",
    [
        MANIFEST,
        "1/models/main.spec.json",
        "1/models/main.safetensors",
        "1/optimizers/adam.json",
        "mgr:commit.json",
        "mgr:model.json",
        "mgr:model.safetensors",
    ],
)
def test_special_files_in_a_checkpoint_are_refused_at_once(
    saved: Saved, tmp_path: Path, relpath: str, kind: str
) -> None:
    """Issue 14.2: a FIFO, a link to /dev/zero, or a link out of the checkpoint in place of a
    record, a JSON or a tensor file: load_checkpoint / CheckpointManager.load and verify end
    at once with a typed error (or a failed report) naming the file; nothing hangs or reads
    without bound."""
    manager = relpath.startswith("mgr:")
    base = saved.manager_dirs["a"] if manager else saved.root
    path = base / relpath.removeprefix("mgr:")
    _replace_by(path, kind, tmp_path / "outside")
    with _within(20):
        if manager:
            detected(lambda: mload(base), path.name)
        else:
            detected(lambda: load_checkpoint(saved.root, 1), path.name)
            if relpath == MANIFEST:
                detected(lambda: list_checkpoints(saved.root), path.name)
        report = verify(base)
    assert not report.ok
    assert any(path.name in f.message for f in report.files if not f.ok) or path.name in str(
        report
    ), report


# --------------------------------------------------------------------------- hostile JSON, typed


def test_resealed_strategy_hooks_and_item_json_raise_only_checkpoint_format_errors(
    saved: Saved, tmp_path: Path
) -> None:
    """Issue 14.7: strategy.json, hooks.json and CheckpointManager item JSON mutated (wrong
    types, missing or extra fields, bytes) with their checksums re-sealed: every load succeeds
    or raises a fastckpt typed error (CheckpointFormatError...) naming the file, never a bare
    AttributeError/KeyError/TypeError/ValueError."""
    import training_support as support
    from fastckpt import EMAHook

    strategy = support.new_strategy([EMAHook(model_key="main", decay=0.9)], num_steps=2)
    strategy.run(support.loader())
    source = tmp_path / "strategy"
    strategy.save_checkpoint(source)
    (index,) = Manifest.load(source).entries
    targets = ["strategy.json", "hooks.json", "mgr:model.json", "mgr:optim.json", "mgr:meta.json"]
    rng = random.Random(14)
    work = tmp_path / "fuzz"
    outcomes: dict[str, int] = {}
    problems: list[str] = []
    for iteration in range(300):
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(source, work / "root")
        shutil.copytree(saved.manager_dirs["b"], work / "mgr")
        target = targets[iteration % len(targets)]
        if target.startswith("mgr:"):
            _write_mutation(target, work / "root", work / "mgr", rng)
            load: Callable[[], Any] = lambda: mload(work / "mgr")  # noqa: E731
            name = target[4:]
        else:
            path = work / "root" / str(index) / target
            original = json.loads(path.read_bytes())
            data = (
                json.dumps(_mutate_value(rng, original)).encode()
                if rng.random() < 0.85
                else _mutate_bytes(rng, path.read_bytes())
            )
            path.write_bytes(data)
            document = json.loads((work / "root" / MANIFEST).read_bytes())
            _reseal(document["checkpoints"][str(index)]["files"], target, data)
            (work / "root" / MANIFEST).write_text(json.dumps(seal_manifest(document)))
            load = lambda: load_checkpoint(  # noqa: E731
                work / "root",
                hooks=[EMAHook(model_key="main", decay=0.9)],
                training_fn=support.training_fn,
            )
            name = target
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # unmatched hook states
                load()
            outcome = "ok"
        except UntrustedTargetError:
            outcome = "UntrustedTargetError"  # a mutated class path: names the target
        except FastCkptError as err:
            outcome = type(err).__name__
            if name not in str(err):
                problems.append(f"iteration {iteration} ({target}): file not named: {err}")
        except Exception as err:  # an untyped error is a bug
            outcome = "BUG"
            problems.append(f"iteration {iteration} ({target}): {type(err).__name__}: {err}")
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    assert problems == [], "\n".join(problems[:20])
    assert outcomes.get("ok", 0) < sum(outcomes.values()), outcomes


SIGBUS_SCRIPT = r"""
import sys
from pathlib import Path
import torch
import fastckpt

root, lone = Path(sys.argv[1]), Path(sys.argv[2])
model = torch.nn.Linear(64, 64)
fastckpt.save_file({"w": torch.arange(4096.0)}, lone)
mapped = fastckpt.load_file(lone)  # views of a file mapping
expected = mapped["w"].clone()
fastckpt.save_checkpoint(root, models={"m": (model, None)}, checkpoint_index=0, incremental=False)
weights = fastckpt.load_file(root / "0" / "models" / "m.safetensors")
kept = {k: v.clone() for k, v in weights.items()}
for _ in range(3):  # fastckpt rewrites both files while the views are alive
    fastckpt.save_file({"w": torch.zeros(1)}, lone)
    torch.nn.init.zeros_(model.weight)
    fastckpt.save_checkpoint(root, {"m": (model, None)}, checkpoint_index=0, incremental=False)
    fastckpt.save_checkpoint(root, {"m": (model, None)}, incremental=False)
    fastckpt.prune(root, keep_last=1)
assert torch.equal(mapped["w"], expected)  # every page still readable, unchanged
for name, value in weights.items():
    assert torch.equal(value, kept[name]), name
print("intact")
"""


def test_fastckpt_never_changes_a_file_whose_tensors_are_mapped(tmp_path: Path) -> None:
    """Issue 14.9 (SIGBUS): fastckpt replaces files by rename and deletes by unlink, never
    truncating or overwriting in place, so tensors mapped from a file survive save_file over
    it, a replacement of its index and a prune (a child process, so a SIGBUS cannot take the
    test runner down)."""
    result = subprocess.run(
        [sys.executable, "-c", SIGBUS_SCRIPT, str(tmp_path / "root"), str(tmp_path / "a.st")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0 and "intact" in result.stdout, (result.returncode, result.stderr)
