"""Issue 22, findings 5 and 6: ``safe_open`` selections are exactly torch's (shape and values,
empty ones included), and ``fastckpt verify`` decides what a lone file is from its content,
never saying ok about bytes it did not check."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch

import fastckpt
from fastckpt.container.lazy import safe_open
from fastckpt.container.verify import verify
from fastckpt.errors import ChecksumMismatchError, FastCkptError

# --------------------------------------------------------------------------- finding 5: slices

#: Shapes with and without zero-size dimensions, 0-d included.
SHAPES: list[tuple[int, ...]] = [
    (),
    (0,),
    (1,),
    (7,),
    (0, 4),
    (3, 0),
    (5, 6),
    (1, 9),
    (2, 3, 4),
    (3, 0, 2),
    (4, 1, 5),
    (2, 2, 2, 3),
]
DTYPES = [torch.float32, torch.int64, torch.bfloat16, torch.uint8, torch.float16]


def _tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(22)
    tensors: dict[str, torch.Tensor] = {}
    for number, shape in enumerate(SHAPES):
        for dtype in DTYPES:
            values = torch.randint(0, 250, shape, generator=generator)
            tensors[f"t{number}_{str(dtype).removeprefix('torch.')}"] = values.to(dtype)
    return tensors


def _bound(rng: random.Random, size: int) -> int | None:
    """A slice start/stop: None, in range, negative, or out of range either way."""
    if rng.random() < 0.2:
        return None
    return rng.randint(-size - 3, size + 3)


def _random_key(rng: random.Random, shape: tuple[int, ...]) -> Any:
    """A random index for ``shape``: ints (negative and out of range too), slices with any
    start, stop and step (zero and negative steps, rarely), an Ellipsis, and sometimes one
    index too many; a bare item or a tuple."""
    count = rng.randint(0, len(shape) + (1 if rng.random() < 0.1 else 0))
    items: list[Any] = []
    for axis in range(count):
        size = shape[axis] if axis < len(shape) else 3
        roll = rng.random()
        if roll < 0.25:
            items.append(rng.randint(-size - 1, size))  # out of range at both ends too
        else:
            step: int | None = rng.choice([None, 1, 1, 2, 3, 4, 5, 7])
            if rng.random() < 0.03:
                step = rng.choice([0, -1, -2])
            items.append(slice(_bound(rng, size), _bound(rng, size), step))
    if rng.random() < 0.2:
        items.insert(rng.randint(0, len(items)), Ellipsis)
    if len(items) == 1 and rng.random() < 0.5:
        return items[0]
    return tuple(items)


def _torch_result(tensor: torch.Tensor, key: Any) -> torch.Tensor | BaseException:
    try:
        return tensor[key]
    except (IndexError, ValueError, TypeError) as err:
        return err


@pytest.mark.parametrize(
    ("writer", "verify_slices"),
    [("fastckpt", False), ("fastckpt", True), ("safetensors", False)],
)
def test_every_selection_is_torchs_own_shape_and_values(
    tmp_path: Path, writer: str, verify_slices: bool
) -> None:
    """Thousands of seeded random selections over shapes with 0-size dimensions: each one has
    exactly the shape and values of torch indexing the same tensor, with and without
    ``verify_slices`` and for files with and without checksums; what torch refuses is a typed
    error of the same kind naming the file and the tensor."""
    tensors = _tensors()
    path = tmp_path / "shapes.safetensors"
    if writer == "fastckpt":
        fastckpt.save_file(tensors, path)
    else:
        safetensors.torch.save_file(tensors, str(path))
    rng = random.Random(f"issue-22-{writer}-{verify_slices}")
    refused = checked = 0
    with safe_open(path, verify_slices=verify_slices) as handle:
        for name, tensor in tensors.items():
            lazy = handle.get_slice(name)
            for _ in range(100):
                key = _random_key(rng, tuple(tensor.shape))
                expected = _torch_result(tensor, key)
                if isinstance(expected, BaseException):
                    with pytest.raises(type(expected)) as caught:
                        lazy[key]
                    assert name in str(caught.value) and str(path) in str(caught.value), key
                    if isinstance(expected, ValueError):
                        assert isinstance(caught.value, FastCkptError), (name, key)
                    refused += 1
                    continue
                got = lazy[key]
                assert got.shape == expected.shape, (name, key, got.shape, expected.shape)
                assert got.dtype == expected.dtype, (name, key)
                assert torch.equal(got, expected), (name, key)
                checked += 1
    assert checked > 5000 and refused > 100, (checked, refused)


def test_the_reported_empty_selections_are_empty(tmp_path: Path) -> None:
    """The issue's cases: ``w[0:0:3]`` and friends select nothing, with ``verify_slices`` and
    on tensors with no elements."""
    w = torch.arange(20.0).reshape(10, 2)
    empty = torch.zeros(0, 4)
    path = tmp_path / "w.safetensors"
    fastckpt.save_file({"w": w, "empty": empty}, path)
    for verify_slices in (False, True):
        with safe_open(path, verify_slices=verify_slices) as handle:
            for key in [slice(0, 0, 3), slice(1, 1, 2), slice(5, 2, 4), (slice(0, 0, 2), 1)]:
                assert handle.get_slice("w")[key].shape == w[key].shape == (0, *w[key].shape[1:])
            assert handle.get_slice("empty")[0:0:3].shape == (0, 4)
            assert handle.get_slice("empty")[:, 1:3:2].shape == empty[:, 1:3:2].shape
            assert handle.get_slice("empty")[:, ::5].shape == (0, 1)


def test_steps_torch_refuses_are_typed_errors(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    fastckpt.save_file({"w": torch.zeros(4, 3)}, path)
    with safe_open(path) as handle:
        lazy = handle.get_slice("w")
        for key in [slice(None, None, 0), slice(None, None, -1), (slice(None), slice(3, 0, -2))]:
            with pytest.raises(ValueError) as caught:
                lazy[key]
            assert isinstance(caught.value, FastCkptError)
            assert "'w'" in str(caught.value) and str(path) in str(caught.value)
            assert "step" in str(caught.value)
        with pytest.raises(TypeError, match="not supported") as unsupported:
            lazy[slice(0.5, 2)]
        assert "'w'" in str(unsupported.value)


# --------------------------------------------------------------------------- finding 6: verify


def _flip_tensor_byte(path: Path, tensor: str) -> None:
    info = fastckpt.read_metadata(path)
    begin, _ = info["tensors"][tensor]["data_offsets"]
    with open(path, "r+b") as handle:
        handle.seek(info["data_start"] + begin + 2)
        byte = handle.read(1)
        handle.seek(info["data_start"] + begin + 2)
        handle.write(bytes([byte[0] ^ 0x04]))


@pytest.fixture()
def lone_files(tmp_path: Path) -> dict[str, Path]:
    """Lone files under every kind of name: intact and corrupt safetensors files, a file
    without checksums, random bytes, text, and fastckpt records out of their directories."""
    files: dict[str, Path] = {}
    good = tmp_path / "good.safetensors"
    fastckpt.save_file({"weight": torch.randn(32, 8), "bias": torch.randn(8)}, good)
    bad = tmp_path / "bad.safetensors"
    shutil.copy(good, bad)
    _flip_tensor_byte(bad, "weight")
    files["bad.safetensors"] = bad
    for name in ("bad.st", "bad.txt", "bad"):
        files[name] = tmp_path / name
        shutil.copy(bad, files[name])
    for name in ("good.st", "good"):
        files[name] = tmp_path / name
        shutil.copy(good, files[name])
    plain = tmp_path / "plain.bin"
    safetensors.torch.save_file({"x": torch.arange(6.0)}, str(plain))
    files["plain.bin"] = plain
    files["random.bin"] = tmp_path / "random.bin"
    files["random.bin"].write_bytes(random.Random(6).randbytes(4096))
    files["random.safetensors"] = tmp_path / "random.safetensors"
    files["random.safetensors"].write_bytes(random.Random(7).randbytes(4096))
    files["notes.txt"] = tmp_path / "notes.txt"
    files["notes.txt"].write_text("these are not tensors\n" * 20)
    files["empty.st"] = tmp_path / "empty.st"
    files["empty.st"].write_bytes(b"")
    files["list.json"] = tmp_path / "list.json"
    files["list.json"].write_text("[1, 2, 3]")
    root = tmp_path / "root"
    fastckpt.save_checkpoint(root, models={"main": torch.nn.Linear(2, 2)})
    files["manifest.bak"] = tmp_path / "manifest.bak"
    shutil.copy(root / "manifest.json", files["manifest.bak"])
    document = json.loads((root / "manifest.json").read_text())
    document["checkpoints"]["0"]["counters"]["step"] = 999  # edited, checksum left stale
    files["edited-manifest.json"] = tmp_path / "edited-manifest.json"
    files["edited-manifest.json"].write_text(json.dumps(document))
    manager = tmp_path / "mgr" / "step_3"
    with fastckpt.CheckpointManager(fastckpt.CheckpointManager.Config.with_sync_save()) as writer:
        writer.save(manager, {"model": {"w": torch.zeros(2)}})
    files["skeleton.json"] = tmp_path / "skeleton.json"
    shutil.copy(manager / "model.json", files["skeleton.json"])
    files["commit.bak"] = tmp_path / "commit.bak"
    shutil.copy(manager / "commit.json", files["commit.bak"])
    return files


#: What verify must say of each lone file: the status of its one file report, and the words
#: its message must contain (besides the file's path).
EXPECTED: dict[str, tuple[str, tuple[str, ...]]] = {
    "bad.safetensors": ("corrupt", ("checksum mismatch", "weight")),
    "bad.st": ("corrupt", ("checksum mismatch", "weight")),
    "bad.txt": ("corrupt", ("checksum mismatch", "weight")),
    "bad": ("corrupt", ("checksum mismatch", "weight")),
    "random.bin": ("corrupt", ("not a safetensors file", "not verified")),
    "random.safetensors": ("corrupt", ()),
    "notes.txt": ("corrupt", ("not a safetensors file", "not verified")),
    "empty.st": ("corrupt", ("not a safetensors file",)),
    "list.json": ("corrupt", ("nor a JSON fastckpt record", "not verified")),
    "skeleton.json": ("corrupt", ("JSON but not a fastckpt record", "not verified")),
    "edited-manifest.json": ("corrupt", ("manifest", "crc32c")),
    "commit.bak": ("corrupt", ("commit record", "were not verified here")),
}


def test_verify_decides_what_a_lone_file_is_from_its_content(lone_files: dict[str, Path]) -> None:
    """A corrupt safetensors file is corrupt, naming the tensor, under any name; bytes that
    cannot be identified or checked are never ok."""
    for name, (status, words) in EXPECTED.items():
        path = lone_files[name]
        report = verify(path)
        assert report.kind == "file" and not report.ok, name
        assert [f.status for f in report.files] == [status], (name, report)
        message = report.files[0].message
        assert str(path) in message, (name, message)
        for word in words:
            assert word in message, (name, word, message)
    for name in ("bad.st", "bad.txt", "bad"):
        with pytest.raises(ChecksumMismatchError, match="weight"):
            fastckpt.load_file(lone_files[name])  # what verify says matches what load does
    for name in ("good.st", "good", "manifest.bak"):
        report = verify(lone_files[name])
        assert report.ok and report.files[0].status == "ok", (name, report)
        assert not report.files[0].unchecked_tensors
    plain = verify(lone_files["plain.bin"])  # no checksums: read, not verified (exit 3)
    assert not plain.ok and plain.files[0].status == "unchecked", plain
    assert plain.files[0].unchecked_tensors == ["x"] and "unchecked" in plain.summary()
    assert "not verified" in plain.files[0].message and "verified)" not in plain.summary()


def test_a_damaged_file_without_checksums_is_never_called_verified(tmp_path: Path) -> None:
    """A byte flipped in a file the safetensors package wrote (no checksums to catch it) is
    not ``ok``: ``verify`` says ``unchecked`` (the CLI exits 3), never "verified"."""
    path = tmp_path / "plain.safetensors"
    safetensors.torch.save_file({"w": torch.arange(16, dtype=torch.float32)}, str(path))
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    report = verify(path)
    assert not report.ok and [f.status for f in report.files] == ["unchecked"], report
    assert str(path) in report.files[0].message and "w" in report.files[0].message
    assert run_cli(["verify", str(path)], tmp_path).returncode == 3


def run_cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """``python -m fastckpt ARGS`` in ``cwd``, stdout and stderr captured."""
    return subprocess.run(
        [sys.executable, "-m", "fastckpt", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "400"},
    )


def test_the_cli_never_says_ok_about_a_lone_file_it_did_not_check(
    lone_files: dict[str, Path],
) -> None:
    """The real command, in subprocesses: the exit status and the ``--json`` status of a
    corrupt file are the same under every name, and unidentified bytes are not ok."""
    cases: dict[str, tuple[int, str]] = {
        "bad.safetensors": (1, "bad"),
        "bad.st": (1, "bad"),
        "bad.txt": (1, "bad"),
        "bad": (1, "bad"),
        "random.bin": (1, "bad"),
        "notes.txt": (1, "bad"),
        "commit.bak": (1, "bad"),
        "good.st": (0, "ok"),
        "plain.bin": (3, "unchecked"),
    }
    cwd = lone_files["bad"].parent
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(run_cli, ["--json", "verify", name], cwd) for name in cases}
        futures["bad.st text"] = pool.submit(run_cli, ["verify", "bad.st"], cwd)
        results = {name: future.result() for name, future in futures.items()}
    for name, (code, status) in cases.items():
        result = results[name]
        assert result.returncode == code, (name, result)
        document = json.loads(result.stdout)
        assert document["status"] == status and document["ok"] is (code == 0), (name, document)
        assert document["kind"] == "file"
        if code == 1:
            assert document["files"][0]["status"] == "corrupt", (name, document)
            assert name in document["files"][0]["message"], (name, document)
        if name.startswith("bad"):
            assert "weight" in document["files"][0]["message"], (name, document)
    text = results["bad.st text"]
    assert text.returncode == 1 and text.stdout.startswith("BAD: bad.st"), text
    assert "weight" in text.stdout and "ok" not in text.stdout.split()[0]


def test_the_sharded_record_format_verify_knows_is_dcps() -> None:
    import importlib

    from fastckpt.format.sharded import FORMAT

    assert importlib.import_module("fastckpt.verify").SHARDED_FORMAT == FORMAT
