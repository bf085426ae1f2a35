"""fastckpt.safe_open: lazy, sliced, verified reads of files and checkpoints.

Bytes read are counted with the kernel's own per-process counter (``rchar`` in
``/proc/self/io``: every byte that read/pread system calls returned), so the tests see what
the process really read, whatever code path did it.
"""

from __future__ import annotations

import json
import os
import signal
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from safetensors import safe_open as st_safe_open

import fastckpt
from fastckpt import _native
from fastckpt.container import lazy
from fastckpt.container.lazy import safe_open
from fastckpt.errors import CheckpointFormatError, ChecksumMismatchError

GIB = 1 << 30


class ReadCounter:
    """Bytes this process read through read-like system calls (``rchar``), excluding the
    reads of ``/proc/self/io`` that measure it."""

    def __init__(self) -> None:
        self._last, self._own = self._sample()

    @staticmethod
    def _sample() -> tuple[int, int]:
        text = Path("/proc/self/io").read_bytes()
        for line in text.decode().splitlines():
            if line.startswith("rchar:"):
                return int(line.split()[1]), len(text)
        raise AssertionError("/proc/self/io has no rchar line")

    def delta(self) -> int:
        """Bytes read since the previous call (or since creation)."""
        value, own = self._sample()
        delta = value - self._last - self._own
        self._last, self._own = value, own
        return delta


def raw(tensor: torch.Tensor) -> bytes:
    """A tensor's bytes (any dtype, any rank)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def zeros_crc32c(nbytes: int) -> int:
    chunk = bytes(64 << 20)
    crc = 0
    for at in range(0, nbytes, len(chunk)):
        crc = _native.crc32c(chunk[: min(len(chunk), nbytes - at)], crc)
    return crc


@pytest.fixture(scope="module")
def big_file(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A 1 GiB fastckpt-format file: small tensors, then one 1 GiB zero tensor left sparse
    (written as a header plus a few KiB, then extended with ftruncate, so making it is fast).
    fastckpt's own parser and the safetensors package both accept it (checked in the test)."""
    path = tmp_path_factory.mktemp("big") / "big.safetensors"
    small = torch.tensor([3.25], dtype=torch.float32)
    rows = torch.arange(4096 * 8, dtype=torch.int32).reshape(4096, 8)
    payload = [("small", small), ("rows", rows)]
    header: dict[str, Any] = {}
    crcs: dict[str, str] = {}
    offset = 0
    for name, tensor in payload:
        data = tensor.numpy().tobytes()
        header[name] = {
            "dtype": fastckpt.io.files.dtype_name(tensor.dtype),
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        crcs[name] = f"{_native.crc32c(data):08x}"
        offset += len(data)
    header["big"] = {"dtype": "F32", "shape": [GIB // 4], "data_offsets": [offset, offset + GIB]}
    crcs["big"] = f"{zeros_crc32c(GIB):08x}"
    header["__metadata__"] = {"fastckpt.crc32c": json.dumps(crcs), "note": "sparse"}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(text)) + text)
        for _, tensor in payload:
            handle.write(tensor.numpy().tobytes())
        handle.truncate(8 + len(text) + offset + GIB)
    yield {"path": path, "header_bytes": 8 + len(text), "small": small, "rows": rows}
    path.unlink()


def test_one_tensor_and_slices_of_a_1gib_file_read_only_their_bytes(
    big_file: dict[str, Any],
) -> None:
    path = big_file["path"]
    assert path.stat().st_size > GIB
    with safe_open(path) as handle:  # first use: imports and caches warmed
        handle.get_tensor("small")
    expected = st_safe_open(str(path), framework="pt")

    counter = ReadCounter()
    with safe_open(path, framework="pt") as handle:
        opened = counter.delta()
        small = handle.get_tensor("small")
        small_read = counter.delta()
        rows = handle.get_slice("rows")[100:110]
        rows_read = counter.delta()
        strip = handle.get_slice("big")[1000:1016]
        strip_read = counter.delta()
        column = handle.get_slice("rows")[7:9, 3]
        column_read = counter.delta()

    assert opened == big_file["header_bytes"]  # the header, nothing else
    assert small_read == 4
    assert rows_read == 10 * 8 * 4
    assert strip_read == 16 * 4
    # two 4-byte elements one row (32 bytes) apart: read as one 36-byte span
    assert column_read == 36

    assert torch.equal(small, big_file["small"])
    for ours, theirs in [
        (small, expected.get_tensor("small")),
        (rows, expected.get_slice("rows")[100:110]),
        (strip, expected.get_slice("big")[1000:1016]),
        (column, expected.get_slice("rows")[7:9, 3]),
    ]:
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
        assert raw(ours) == raw(theirs)
    assert torch.equal(rows, big_file["rows"][100:110])


def test_the_1gib_file_header_is_exposed(big_file: dict[str, Any]) -> None:
    with safe_open(big_file["path"]) as handle:
        assert handle.metadata() == {"note": "sparse"}
        assert handle.keys() == ["big", "rows", "small"]
        assert handle.offset_keys() == ["small", "rows", "big"]
        assert handle.get_slice("big").get_shape() == [GIB // 4]
        assert handle.get_slice("big").get_dtype() == "F32"
        assert handle.info("big")["crc32c"] == zeros_crc32c(GIB)


def test_a_tensor_read_in_several_chunks_is_verified_across_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lazy, "READ_CHUNK", 4096)  # a 40 KiB tensor takes 10 reads
    path = tmp_path / "chunks.safetensors"
    tensor = torch.randn(10, 1024)
    fastckpt.save_file({"t": tensor}, path)
    with safe_open(path) as handle:
        assert torch.equal(handle.get_tensor("t"), tensor)
        assert torch.equal(handle.get_slice("t")[2:9], tensor[2:9])  # 7 reads into the result
    with safe_open(path, verify=False) as handle:
        assert torch.equal(handle.get_tensor("t"), tensor)
    info = fastckpt.read_metadata(path)
    begin, _ = info["tensors"]["t"]["data_offsets"]
    with open(path, "r+b") as handle:  # damage the last chunk only
        handle.seek(info["data_start"] + begin + 9 * 4096 + 100)
        handle.write(b"\xff\xfe")
    with safe_open(path) as handle, pytest.raises(ChecksumMismatchError, match="'t'"):
        handle.get_tensor("t")


def _mixed() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return {
        "f32": torch.randn(9, 6, 5, generator=generator),
        "bf16": torch.randn(33, 17, generator=generator).to(torch.bfloat16),
        "f16": torch.randn(8, 4, generator=generator).to(torch.float16),
        "i8": torch.randint(-100, 100, (50,), generator=generator, dtype=torch.int8),
        "i64": torch.randint(0, 1 << 40, (4, 3), generator=generator),
        "bool": torch.rand(6, 7, generator=generator) > 0.5,
        "f64": torch.randn(3, 2, 2, generator=generator, dtype=torch.float64),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
        "wide": torch.randn(64, 2048, generator=generator),
    }


SLICES: list[Any] = [
    ...,
    (),
    0,
    -1,
    slice(1, 3),
    slice(None, None, 2),
    (slice(None), 1),
    (..., slice(1, 3)),
    (slice(2, 5), ..., 0),
    (slice(0, 0),),
    (slice(1, None, 3), slice(None, None, 2)),
    (slice(-3, None), slice(None, -1)),
]


@pytest.mark.parametrize("writer", ["fastckpt", "safetensors"])
def test_whole_tensors_and_slices_match_safetensors_and_torch(tmp_path: Path, writer: str) -> None:
    tensors = _mixed()
    path = tmp_path / "mixed.safetensors"
    if writer == "fastckpt":
        fastckpt.save_file(tensors, path, metadata={"who": "test"})
    else:
        safetensors.torch.save_file(tensors, str(path), metadata={"who": "test"})
    theirs = st_safe_open(str(path), framework="pt")
    with safe_open(path) as ours:
        assert ours.keys() == theirs.keys()
        assert ours.metadata() == {"who": "test"}
        names = ours.keys()
        for name in names:
            tensor = ours.get_tensor(name)
            assert tensor.dtype == tensors[name].dtype
            assert raw(tensor) == raw(theirs.get_tensor(name))
            lazy = ours.get_slice(name)
            assert lazy.get_shape() == theirs.get_slice(name).get_shape()
            assert lazy.get_dtype() == theirs.get_slice(name).get_dtype()
            for key in SLICES:
                if tensors[name].dim() == 0 and key not in (..., ()):
                    continue
                try:
                    reference = tensors[name][key]
                except IndexError:
                    with pytest.raises(IndexError):
                        lazy[key]
                    continue
                got = lazy[key]
                assert got.shape == reference.shape, (name, key)
                assert torch.equal(got, reference), (name, key)
        # the strided column of a wide tensor: one read per row group, same values
        assert torch.equal(ours.get_slice("wide")[:, 5], tensors["wide"][:, 5])
        assert torch.equal(ours.get_slice("wide")[::7, 100:900:9], tensors["wide"][::7, 100:900:9])


def _corrupt(path: Path, tensor: str) -> None:
    info = fastckpt.read_metadata(path)
    begin, _ = info["tensors"][tensor]["data_offsets"]
    with open(path, "r+b") as handle:
        handle.seek(info["data_start"] + begin + 1)
        byte = handle.read(1)
        handle.seek(info["data_start"] + begin + 1)
        handle.write(bytes([byte[0] ^ 0x10]))


def test_a_corrupted_tensor_raises_naming_file_and_tensor(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    weight = torch.randn(64, 16)
    fastckpt.save_file({"weight": weight, "bias": torch.randn(16)}, path)
    _corrupt(path, "weight")
    with safe_open(path) as handle:
        with pytest.raises(ChecksumMismatchError, match="weight") as caught:
            handle.get_tensor("weight")
        assert str(path) in str(caught.value)
        handle.get_tensor("bias")  # the intact tensor still reads
        with pytest.raises(ChecksumMismatchError, match="weight"):
            handle.get_slice("weight")[...]  # a slice of every element is a whole read
        # a partial slice cannot be checked against the whole tensor's crc32c: returned as is
        part = handle.get_slice("weight")[10:12]
        assert torch.equal(part, weight[10:12])
    with (
        safe_open(path, verify_slices=True) as handle,
        pytest.raises(ChecksumMismatchError, match="weight"),
    ):
        handle.get_slice("weight")[10:12]
    with safe_open(path, verify=False) as handle:
        assert handle.get_tensor("weight").shape == (64, 16)


def test_a_checkpoint_root_index_reads_lazily(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 3)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    root = tmp_path / "root"
    fastckpt.save_checkpoint(root, models={"main": (model, None)}, optimizers={"adam": optimizer})
    with torch.no_grad():
        model.weight.add_(1)
    fastckpt.save_checkpoint(root, models={"main": (model, None)}, optimizers={"adam": optimizer})

    with safe_open(root, index=0) as handle:
        names = handle.keys()
        assert "models/main/weight" in names
        assert "optimizers/adam/state.0.exp_avg" in names
        assert handle.metadata() is None  # several files
        first = handle.get_tensor("models/main/weight")
        exp_avg = handle.get_tensor("optimizers/adam/state.0.exp_avg")
    assert torch.equal(first + 1, model.weight.detach())
    assert torch.equal(exp_avg, optimizer.state[model.weight]["exp_avg"])
    for target in ({"path": root}, {"path": root, "index": 1}, {"path": root / "1"}):
        with safe_open(target.pop("path"), part="models/main", **target) as handle:
            assert handle.keys() == ["bias", "weight"]
            assert torch.equal(handle.get_tensor("weight"), model.weight.detach())
            assert torch.equal(handle.get_slice("weight")[1], model.weight.detach()[1])
    with pytest.raises(KeyError, match="available"):
        safe_open(root, index=5)
    with pytest.raises(KeyError, match="models/main"):
        safe_open(root, part="models/nope")
    with pytest.raises(ValueError, match="index 1"):
        safe_open(root / "1", index=0)


def test_a_manager_checkpoint_item_reads_lazily(tmp_path: Path) -> None:
    state = {"w": torch.randn(5, 5), "nested": {"b": torch.arange(6)}}
    directory = tmp_path / "step_3"
    with fastckpt.CheckpointManager(fastckpt.CheckpointManager.Config.with_sync_save()) as mgr:
        mgr.save(directory, {"model": state, "step": 3})
    with safe_open(directory, part="model") as handle:
        assert handle.keys() == ["nested.b", "w"]
        assert torch.equal(handle.get_tensor("nested.b"), state["nested"]["b"])
        assert torch.equal(handle.get_slice("w")[:, 2:4], state["w"][:, 2:4])
    with safe_open(directory) as handle:
        assert torch.equal(handle.get_tensor("model/w"), state["w"])
    with pytest.raises(ValueError, match="index"):
        safe_open(directory, index=0)


def test_a_file_whose_size_differs_from_the_record_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    with fastckpt.CheckpointManager(fastckpt.CheckpointManager.Config.with_sync_save()) as mgr:
        mgr.save(directory, {"model": {"w": torch.randn(4)}})
    with open(directory / "model.safetensors", "ab") as handle:
        handle.write(b"\0" * 8)
    with pytest.raises(CheckpointFormatError, match=r"model\.safetensors.*size"):
        safe_open(directory)


def test_a_record_naming_a_file_outside_the_checkpoint_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    with fastckpt.CheckpointManager(fastckpt.CheckpointManager.Config.with_sync_save()) as mgr:
        mgr.save(directory, {"model": {"w": torch.randn(4)}})
    outside = tmp_path / "outside.safetensors"
    (directory / "model.safetensors").rename(outside)
    (directory / "model.safetensors").symlink_to(outside)
    with pytest.raises(CheckpointFormatError, match="outside"):
        safe_open(directory)


def test_fifos_and_other_non_files_are_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.safetensors"
    os.mkfifo(fifo)

    def hung(*_: object) -> None:
        raise AssertionError("safe_open blocked on a FIFO")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(10)
    try:
        with pytest.raises(CheckpointFormatError, match=r"not a regular file \(a FIFO"):
            safe_open(fifo)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    with pytest.raises(FileNotFoundError, match="not a fastckpt checkpoint"):
        safe_open(tmp_path)
    with pytest.raises(FileNotFoundError):
        safe_open(tmp_path / "missing.safetensors")


def test_bad_arguments_are_typed_errors(tmp_path: Path) -> None:
    path = tmp_path / "x.safetensors"
    fastckpt.save_file({"a": torch.zeros(3, 4)}, path)
    with pytest.raises(ValueError, match="framework"):
        safe_open(path, framework="np")
    with pytest.raises(ValueError, match="single file"):
        safe_open(path, index=0)
    handle = safe_open(path)
    lazy = handle.get_slice("a")
    with pytest.raises(ValueError, match="step must be positive"):
        lazy[::-1]
    with pytest.raises(IndexError, match="too many indices"):
        lazy[0, 0, 0]
    with pytest.raises(IndexError, match="out of bounds"):
        lazy[3]
    with pytest.raises(TypeError, match="not supported"):
        lazy[torch.tensor([0, 1])]
    with pytest.raises(KeyError, match="'a'"):
        handle.get_tensor("b")
    handle.close()
    with pytest.raises(ValueError, match="closed"):
        handle.get_tensor("a")


def test_a_malformed_header_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", 10) + b"{not json}")
    with pytest.raises(CheckpointFormatError) as caught:
        safe_open(path)
    assert str(path) in str(caught.value) and "/proc/self/fd" not in str(caught.value)


def test_an_edited_header_is_refused_when_opening(tmp_path: Path) -> None:
    path = tmp_path / "x.safetensors"
    fastckpt.save_file({"a": torch.zeros(4)}, path)
    raw = bytearray(path.read_bytes())
    at = raw.index(b'"F32"')
    raw[at : at + 5] = b'"I32"'  # same length: only the header's own crc32c can tell
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointFormatError, match="header_crc32c") as caught:
        safe_open(path)
    assert str(path) in str(caught.value)


def test_a_symlink_you_pass_is_followed_once(tmp_path: Path) -> None:
    real = tmp_path / "blobs" / "abc123"
    real.parent.mkdir()
    fastckpt.save_file({"a": torch.arange(3)}, real)
    link = tmp_path / "model.safetensors"  # the layout of a download cache
    link.symlink_to(real)
    with safe_open(link) as handle:
        assert torch.equal(handle.get_tensor("a"), torch.arange(3))
        assert handle.info("a")["file"] == str(real)


def test_f4_tensors_read_whole_and_by_leading_dimensions(tmp_path: Path) -> None:
    if not hasattr(torch, "float4_e2m1fn_x2"):
        pytest.skip("this torch has no float4_e2m1fn_x2")
    packed = torch.randint(0, 255, (4, 6), dtype=torch.uint8, generator=torch.Generator())
    tensor = packed.view(torch.float4_e2m1fn_x2)
    path = tmp_path / "f4.safetensors"
    fastckpt.save_file({"f4": tensor}, path)
    theirs = st_safe_open(str(path), framework="pt")
    with safe_open(path) as handle:
        lazy = handle.get_slice("f4")
        assert lazy.get_shape() == theirs.get_slice("f4").get_shape() == [4, 12]  # 4-bit values
        whole = handle.get_tensor("f4")
        assert whole.dtype == tensor.dtype and whole.shape == (4, 6)
        assert raw(whole) == raw(tensor) == raw(theirs.get_tensor("f4"))
        assert raw(lazy[1:3]) == raw(tensor[1:3])
        with pytest.raises(ValueError, match="two values per byte"):
            lazy[:, 1:3]


def test_an_open_handle_keeps_reading_the_file_it_opened(tmp_path: Path) -> None:
    path = tmp_path / "x.safetensors"
    fastckpt.save_file({"a": torch.zeros(1000)}, path)
    with safe_open(path) as handle:
        fastckpt.save_file({"a": torch.ones(1000)}, path)  # atomic replacement meanwhile
        assert not handle.get_tensor("a").any()
        assert not handle.get_slice("a")[10:20].any()
    with safe_open(path) as handle:
        assert handle.get_tensor("a").all()
