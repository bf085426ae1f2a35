"""save_file / load_file / read_metadata: round trips, safetensors compatibility, corruption,
GIL release and failure cleanup."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import safetensors.torch
import torch
from safetensors import safe_open

import fastckpt
from fastckpt import CheckpointFormatError, ChecksumMismatchError, _native
from fastckpt.io.files import byte_view, dtype_name, header_shape, read_tensors, write_tensors

ALL_DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.complex64,
]


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Random bytes reinterpreted as `dtype` (covers NaN payloads and every bit pattern)."""
    gen = torch.Generator().manual_seed(seed)
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = 1
    for dim in shape:
        numel *= dim
    raw = torch.randint(0, 256, (numel * itemsize,), dtype=torch.uint8, generator=gen)
    if dtype is torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


def test_every_dtype_round_trips_bitwise(tmp_path: Path) -> None:
    tensors = {str(d): random_tensor(d, (3, 5), seed=i) for i, d in enumerate(ALL_DTYPES)}
    path = tmp_path / "all.safetensors"
    fastckpt.save_file(tensors, path)
    loaded = fastckpt.load_file(path)
    assert set(loaded) == set(tensors)
    for name, tensor in tensors.items():
        assert bitwise_equal(loaded[name], tensor), name


def test_scalars_empty_and_noncontiguous(tmp_path: Path) -> None:
    base = torch.arange(48, dtype=torch.float32).reshape(6, 8)
    tensors = {
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.empty(0, 7),
        "empty3d": torch.empty(2, 0, 3, dtype=torch.int16),
        "transposed": base.t(),
        "strided": base[::2, 1::3],
        "expanded": torch.arange(4).expand(3, 4),
        "requires_grad": torch.ones(3, requires_grad=True),
        "conj": torch.complex(torch.ones(2), torch.ones(2)).conj(),
    }
    path = tmp_path / "shapes.safetensors"
    fastckpt.save_file(tensors, path)
    loaded = fastckpt.load_file(path)
    for name, tensor in tensors.items():
        want = tensor.detach().resolve_conj()
        assert loaded[name].shape == want.shape, name
        assert torch.equal(loaded[name], want), name
    assert loaded["scalar"].dim() == 0


def test_loaded_tensors_are_private_views_of_the_file(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    fastckpt.save_file({"w": torch.arange(1000.0), "rng": torch.get_rng_state()}, path)
    loaded = fastckpt.load_file(path)
    # Each tensor owns a storage that starts at its first byte: torch.set_rng_state ignores
    # storage offsets and crashed on views into one file-wide storage.
    assert all(t.storage_offset() == 0 for t in loaded.values())
    torch.set_rng_state(loaded["rng"])
    # Writing to a loaded tensor changes this process's copy only, never the file.
    loaded["w"].zero_()
    again = fastckpt.load_file(path)
    assert torch.equal(again["w"], torch.arange(1000.0))
    # Replacing the file (atomic rename) leaves tensors loaded from the old one intact.
    fastckpt.save_file({"w": torch.ones(1000), "rng": torch.get_rng_state()}, path)
    del loaded
    assert torch.equal(again["w"], torch.arange(1000.0))
    assert torch.equal(fastckpt.load_file(path)["w"], torch.ones(1000))


def test_tensors_not_aligned_to_their_element_size_load(tmp_path: Path) -> None:
    # The format allows any byte offset; writers (ours, safetensors) sort by alignment, but a
    # hand-made file may put a float64 right after 3 bytes.
    tensors = {"a": torch.tensor([1, 2, 3], dtype=torch.uint8), "b": torch.arange(5.0).double()}
    header = {
        "a": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
        "b": {"dtype": "F64", "shape": [5], "data_offsets": [3, 43]},
    }
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path = tmp_path / "odd.safetensors"
    data = tensors["a"].numpy().tobytes() + tensors["b"].numpy().tobytes()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    loaded = fastckpt.load_file(path)
    assert torch.equal(loaded["a"], tensors["a"]) and torch.equal(loaded["b"], tensors["b"])


def counter_progress(action: Callable[[], None]) -> tuple[int, float]:
    """Run ``action`` while another thread counts as fast as it can; returns the count it
    reached and the seconds ``action`` took. The counter increments ~10^6-10^7 times per second
    while it holds the GIL; if ``action`` held the GIL throughout, the counter would only run
    in a few switch intervals."""
    counts = {"during": 0}
    done = threading.Event()
    started = threading.Event()

    def count() -> None:
        started.set()
        while not done.is_set():
            counts["during"] += 1

    counter = threading.Thread(target=count)
    counter.start()
    started.wait()
    before = counts["during"]
    start = time.perf_counter()
    try:
        action()
    finally:
        elapsed = time.perf_counter() - start
        progressed = counts["during"] - before
        done.set()
        counter.join()
    return progressed, elapsed


def test_gil_is_released_while_a_load_verifies(tmp_path: Path) -> None:
    path = tmp_path / "gil.safetensors"
    fastckpt.save_file({"w": torch.ones(64 << 20, dtype=torch.uint8)}, path)

    def load_repeatedly() -> None:
        start = time.perf_counter()
        for _ in range(3):
            fastckpt.load_file(path, verify=True)
        while time.perf_counter() - start < 0.5:
            fastckpt.load_file(path, verify=True)

    progressed, elapsed = counter_progress(load_repeatedly)
    assert progressed > 50 * elapsed / sys.getswitchinterval(), (progressed, elapsed)


def test_many_small_tensors(tmp_path: Path) -> None:
    tensors = {f"layer{i}.bias": torch.full((i % 7,), float(i)) for i in range(2000)}
    path = tmp_path / "many.safetensors"
    fastckpt.save_file(tensors, path, threads=3, chunk_size=1 << 16)
    loaded = fastckpt.load_file(path, threads=3)
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())


@pytest.mark.parametrize("direct_io", [False, True])
def test_large_tensor_round_trip(tmp_path: Path, direct_io: bool) -> None:
    big = random_tensor(torch.float32, (64 << 20,), seed=7)  # 256 MiB
    tensors = {"big": big, "tail": torch.arange(3, dtype=torch.int8)}
    path = tmp_path / "big.safetensors"
    fastckpt.save_file(tensors, path, direct_io=direct_io)
    loaded = fastckpt.load_file(path)
    assert bitwise_equal(loaded["big"], big)
    assert torch.equal(loaded["tail"], tensors["tail"])


def test_default_write_mode_is_o_direct_from_the_threshold(tmp_path: Path) -> None:
    from fastckpt.io import files

    limit = files.DIRECT_IO_MIN_BYTES
    assert files.choose_direct_io(limit - 1) is False
    assert files.choose_direct_io(limit) is True
    assert files.choose_direct_io(100 << 30) is True  # no size where buffered comes back
    small = {"w": torch.arange(1 << 20, dtype=torch.float32)}  # 4 MiB: buffered
    assert files.write_tensors(small, tmp_path / "a.safetensors")["direct_io"] is False
    # A file at the threshold goes through O_DIRECT where the filesystem allows it (tmp_path
    # is on a disk filesystem in CI; on tmpfs the writer falls back to buffered by itself, as
    # the forced run shows), with the header and the unaligned tail written correctly.
    large = {
        "w": random_tensor(torch.float32, (limit // 4,), seed=3),
        "tail": torch.arange(7, dtype=torch.int8),
    }
    report = files.write_tensors(large, tmp_path / "b.safetensors")
    forced = files.write_tensors(large, tmp_path / "c.safetensors", direct_io=True)
    assert report["direct_io"] is forced["direct_io"]
    assert report["file_crc32c"] == forced["file_crc32c"]
    buffered = files.write_tensors(large, tmp_path / "d.safetensors", direct_io=False)
    assert buffered["direct_io"] is False
    assert buffered["file_crc32c"] == report["file_crc32c"]
    assert torch.equal(fastckpt.load_file(tmp_path / "a.safetensors")["w"], small["w"])
    for name in "bcd":
        loaded = fastckpt.load_file(tmp_path / f"{name}.safetensors")
        assert bitwise_equal(loaded["w"], large["w"])
        assert torch.equal(loaded["tail"], large["tail"])


def test_files_open_with_safetensors_and_back(tmp_path: Path) -> None:
    tensors = {f"t{i}": random_tensor(d, (4, 2), seed=i) for i, d in enumerate(ALL_DTYPES)}
    ours = tmp_path / "ours.safetensors"
    fastckpt.save_file(tensors, ours, metadata={"format": "pt", "step": "7"})
    theirs_loaded = safetensors.torch.load_file(ours)
    for name, tensor in tensors.items():
        assert bitwise_equal(theirs_loaded[name], tensor)
    with safe_open(ours, framework="pt") as handle:
        metadata = handle.metadata()
        assert metadata["step"] == "7"
        assert bitwise_equal(handle.get_tensor("t3"), tensors["t3"])

    theirs = tmp_path / "theirs.safetensors"
    safetensors.torch.save_file(tensors, theirs, metadata={"k": "v"})
    loaded = fastckpt.load_file(theirs)
    for name, tensor in tensors.items():
        assert bitwise_equal(loaded[name], tensor)
    meta = fastckpt.read_metadata(theirs)
    assert meta["metadata"] == {"k": "v"}
    assert all(entry["crc32c"] is None for entry in meta["tensors"].values())


def test_read_metadata_reports_layout_and_checksums(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    fastckpt.save_file({"w": torch.zeros(2, 3), "b": torch.ones(3, dtype=torch.int64)}, path)
    meta = fastckpt.read_metadata(path)
    assert meta["tensors"]["w"]["dtype"] == "F32"
    assert meta["tensors"]["w"]["shape"] == [2, 3]
    assert meta["tensors"]["b"]["data_offsets"] == [0, 24]  # 8-byte dtypes first
    assert all(isinstance(e["crc32c"], int) for e in meta["tensors"].values())
    assert meta["file_len"] == path.stat().st_size
    assert meta["data_start"] % 8 == 0


def corrupt(path: Path, offset: int, xor: int = 0x01) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= xor
    path.write_bytes(bytes(data))


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    path = tmp_path / "c.safetensors"
    fastckpt.save_file({"alpha": torch.arange(1000.0), "beta": torch.arange(10)}, path)
    return path


def test_flipped_tensor_byte_names_file_and_tensor(saved: Path) -> None:
    meta = fastckpt.read_metadata(saved)
    begin = meta["tensors"]["alpha"]["data_offsets"][0]
    corrupt(saved, meta["data_start"] + begin + 123)
    with pytest.raises(ChecksumMismatchError) as excinfo:
        fastckpt.load_file(saved)
    assert "alpha" in str(excinfo.value) and str(saved) in str(excinfo.value)
    # Without verification the (wrong) bytes load: proves the check is what caught it.
    assert "alpha" in fastckpt.load_file(saved, verify=False)


def test_truncated_file_is_a_format_error(saved: Path) -> None:
    data = saved.read_bytes()
    for cut in (0, 3, 8, 50, len(data) - 1):
        saved.write_bytes(data[:cut])
        with pytest.raises(CheckpointFormatError) as excinfo:
            fastckpt.load_file(saved)
        assert str(saved) in str(excinfo.value)


def rewrite_header(path: Path, edit: dict) -> None:
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    header.update(edit)
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data[8 + length :])


def test_header_lying_about_offsets_is_a_format_error(saved: Path) -> None:
    lie = {"beta": {"dtype": "I64", "shape": [10], "data_offsets": [8, 88]}}
    original = saved.read_bytes()
    # fastckpt's header checksum reports any edit of its own files first...
    rewrite_header(saved, lie)
    with pytest.raises(CheckpointFormatError, match=r"fastckpt\.header_crc32c"):
        fastckpt.load_file(saved)
    # ...and without it (files of other writers) the layout check names the field.
    saved.write_bytes(original)
    rewrite_header(saved, {**lie, "__metadata__": {}})
    with pytest.raises(CheckpointFormatError, match=r"beta\.data_offsets"):
        fastckpt.load_file(saved)


def test_huge_declared_header_length_is_a_format_error(saved: Path) -> None:
    data = saved.read_bytes()
    saved.write_bytes(struct.pack("<Q", 1 << 62) + data[8:])
    with pytest.raises(CheckpointFormatError, match="header_length"):
        fastckpt.load_file(saved)


def test_bad_inputs_are_clear_errors(tmp_path: Path) -> None:
    path = tmp_path / "x.safetensors"
    with pytest.raises(TypeError, match="'a'"):
        fastckpt.save_file({"a": [1, 2]}, path)  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="to_dense"):
        fastckpt.save_file({"s": torch.eye(2).to_sparse()}, path)
    with pytest.raises(TypeError, match="metadata"):
        fastckpt.save_file({"a": torch.ones(1)}, path, metadata={"k": 1})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="reserved"):
        fastckpt.save_file({"__metadata__": torch.ones(1)}, path)
    with pytest.raises(FileNotFoundError):
        fastckpt.load_file(tmp_path / "missing.safetensors")
    with pytest.raises(TypeError, match="complex128"):
        dtype_name(torch.complex128)
    assert not path.exists()


def test_gil_is_released_during_save(tmp_path: Path) -> None:
    big = {"w": torch.ones(96 << 20, dtype=torch.uint8), "v": torch.ones(32 << 20)}
    progressed, elapsed = counter_progress(
        lambda: fastckpt.save_file(big, tmp_path / "gil.safetensors")
    )
    assert progressed > 50 * elapsed / sys.getswitchinterval(), (progressed, elapsed)


def test_failed_save_leaves_nothing(tmp_path: Path) -> None:
    tensors = {"a": torch.ones(10)}
    with pytest.raises(FileNotFoundError) as excinfo:
        fastckpt.save_file(tensors, tmp_path / "no" / "dir" / "x.safetensors")
    assert "x.safetensors" in str(excinfo.value)
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(NotADirectoryError):
        fastckpt.save_file(tensors, blocker / "x.safetensors")
    assert sorted(os.listdir(tmp_path)) == ["file"]


MIDWAY_FAILURE = """
import resource, signal, sys, torch, fastckpt
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG instead of being killed
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
try:
    fastckpt.save_file(
        {"w": torch.ones(4 << 20)}, sys.argv[1], chunk_size=1 << 16, direct_io=sys.argv[2] == "1"
    )
except OSError as err:
    print("OSError", err.errno, err.filename)
    sys.exit(0)
sys.exit("save unexpectedly succeeded")
"""


@pytest.mark.parametrize("direct_io", [False, True])
def test_save_failing_midway_leaves_old_file_and_no_temp(tmp_path: Path, direct_io: bool) -> None:
    path = tmp_path / "ckpt.safetensors"
    fastckpt.save_file({"old": torch.zeros(4)}, path)
    result = subprocess.run(
        [sys.executable, "-c", MIDWAY_FAILURE, str(path), "1" if direct_io else "0"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert result.stdout.startswith("OSError 27"), result.stdout  # EFBIG
    assert str(path) in result.stdout
    assert os.listdir(tmp_path) == ["ckpt.safetensors"]
    assert torch.equal(fastckpt.load_file(path)["old"], torch.zeros(4))


TRUNCATED_WHILE_MAPPED = """
import os, sys, torch, fastckpt
from fastckpt import _native
from fastckpt.io.files import byte_view
path = sys.argv[1]
fastckpt.save_file({"w": torch.ones(4 << 20)}, path)
storage = torch.UntypedStorage.from_file(path, shared=False, nbytes=os.path.getsize(path))
os.truncate(path, 8192)
flat = torch.empty(0, dtype=torch.uint8).set_(storage)
try:
    _native.check_mapped(path, byte_view(flat), True, 2)
except OSError as err:
    print("OSError:", err)
"""


def test_file_truncated_after_mapping_is_an_error_not_a_crash(tmp_path: Path) -> None:
    # Another program shrinking a file while it loads: the pages past the new end are faulted
    # in up front (MADV_POPULATE_READ), so this is an OSError naming the file, not a SIGBUS
    # (run in a child so that a SIGBUS fails this test instead of killing the session).
    path = tmp_path / "shrinks.safetensors"
    result = subprocess.run(
        [sys.executable, "-c", TRUNCATED_WHILE_MAPPED, str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, (result.returncode, result.stderr)
    assert "OSError:" in result.stdout and "shrinks.safetensors" in result.stdout, result.stdout
    assert "truncated while loading" in result.stdout, result.stdout


def test_the_exported_header_encoder_writes_what_save_file_writes(tmp_path: Path) -> None:
    # Object storage builds its files from these pieces; they must be save_file's bytes.
    tensors = {
        "w": torch.randn(3, 4),
        "b": torch.arange(5, dtype=torch.int16),
        "q": torch.zeros(2, 4, dtype=torch.uint8).view(torch.float4_e2m1fn_x2),
    }
    path = tmp_path / "ref.safetensors"
    written = write_tensors(tensors, path, {"m": "1"})
    described = [(name, dtype_name(t.dtype), header_shape(name, t)) for name, t in tensors.items()]
    header, ranges = _native.encode_header(described, {"m": "1"}, written["checksums"])
    data = b"".join(byte_view(tensors[name]).tobytes() for name, _, _ in ranges)
    assert header + data == path.read_bytes()
    assert [end - begin for _, begin, end in ranges] == [
        tensors[name].nbytes for name, _, _ in ranges
    ]
    unchecked, _ = _native.encode_header(described, {})
    assert b"fastckpt" not in unchecked
    with pytest.raises(ValueError, match="no checksum given for tensor `b`"):
        _native.encode_header(described, {}, {"w": 1, "q": 2})


def test_crc32c_takes_any_buffer_and_combines() -> None:
    data = bytes(range(256)) * 40
    whole = _native.crc32c(data)
    assert _native.crc32c(memoryview(data)) == whole
    assert _native.crc32c(bytearray(data)) == whole
    assert _native.crc32c(torch.frombuffer(bytearray(data), dtype=torch.uint8).numpy()) == whole
    head, tail = data[:1000], data[1000:]
    assert _native.crc32c(tail, _native.crc32c(head)) == whole
    assert _native.crc32c_combine(_native.crc32c(head), _native.crc32c(tail), len(tail)) == whole


def observed_progress(counter: _native.ByteCounter, action: Callable[[], object]) -> list[int]:
    """Run ``action`` while another thread samples ``counter.value``; returns the samples."""
    samples: list[int] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            samples.append(counter.value)
            time.sleep(0.0005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        action()
    finally:
        done.set()
        sampler.join()
    return samples


@pytest.mark.parametrize("direct_io", [False, True])
def test_progress_is_counted_by_the_core_while_it_works(tmp_path: Path, direct_io: bool) -> None:
    path = tmp_path / "progress.safetensors"
    tensors = {"big": torch.ones(48 << 20), "small": torch.arange(10)}
    total = sum(t.nbytes for t in tensors.values())
    written = _native.ByteCounter()
    during_save = observed_progress(
        written,
        lambda: write_tensors(
            tensors, path, chunk_size=1 << 20, direct_io=direct_io, progress=written
        ),
    )
    loaded = _native.ByteCounter()
    during_load = observed_progress(loaded, lambda: read_tensors(path, threads=2, progress=loaded))
    verified = _native.ByteCounter()
    _native.verify_file(str(path), 2, progress=verified)
    assert written.value == loaded.value == verified.value == total
    for samples in (during_save, during_load):
        assert samples == sorted(samples), "the count only grows"
        # The count moves while the work runs (the GIL is released), not only at the end.
        assert any(0 < value < total for value in samples), samples[:: max(1, len(samples) // 20)]
    unverified = _native.ByteCounter()
    read_tensors(path, verify=False, progress=unverified)
    assert unverified.value == 0  # nothing is read until the tensors are touched
