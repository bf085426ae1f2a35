"""The header of a fastckpt file protects itself (issue 14, items 2, 6 and 7 for lone files).

- A bit flip anywhere in the header of a file fastckpt wrote is refused, including flips in
  the checksum keys themselves (a damaged key must not turn the file into an "unchecked" one).
- Duplicate JSON keys, edits of empty tensors' shapes and dtype edits are refused.
- A shape no framework can index is a CheckpointFormatError naming file and field in
  load_file, read_metadata and verify alike.
- FIFOs and devices (also behind a symbolic link) are refused at once, without blocking.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch

import fastckpt
from fastckpt import CheckpointFormatError, ChecksumMismatchError, _native

HEADER_CRC_KEY = "fastckpt.header_crc32c"
CHECKSUM_KEY = "fastckpt.crc32c"


def header_of(path: Path) -> tuple[int, dict[str, Any]]:
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    return length, json.loads(data[8 : 8 + length])


def replace_in_header(path: Path, old: bytes, new: bytes) -> None:
    """Replace bytes inside the JSON header in place (same length: offsets stay valid)."""
    assert len(old) == len(new)
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = data[8 : 8 + length]
    assert header.count(old) == 1, old
    path.write_bytes(data[:8] + header.replace(old, new) + data[8 + length :])


def write_raw(path: Path, header: dict[str, Any], data: bytes) -> None:
    """A safetensors file with exactly this header (what a hostile writer produces)."""
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)


def verify_error(path: Path) -> str:
    """fastckpt.verify's verdict on a lone file: its message when damaged, else ''."""
    report = fastckpt.verify(path)
    return "" if report.ok else report.files[0].message


READERS: list[tuple[str, Callable[[Path], object]]] = [
    ("load_file", fastckpt.load_file),
    ("read_metadata", fastckpt.read_metadata),
    ("verify_file", lambda path: _native.verify_file(str(path), 2)),
]


@pytest.fixture
def small(tmp_path: Path) -> Path:
    path = tmp_path / "small.safetensors"
    fastckpt.save_file(
        {
            "w": torch.arange(6, dtype=torch.float32).reshape(2, 3),
            "empty": torch.empty(0, 4),
            "step": torch.tensor(7),
        },
        path,
        metadata={"format": "pt"},
    )
    return path


def test_every_single_bit_flip_in_the_header_is_refused(small: Path) -> None:
    original = small.read_bytes()
    length, _ = header_of(small)
    missed = []
    for position in range(8 + length):
        for bit in range(8):
            damaged = bytearray(original)
            damaged[position] ^= 1 << bit
            small.write_bytes(bytes(damaged))
            try:
                fastckpt.read_metadata(small)
            except CheckpointFormatError as err:
                assert str(small) in str(err)
                continue
            missed.append((position, bit))
    assert missed == [], f"{len(missed)} flips went unnoticed, e.g. {missed[:5]}"


@pytest.mark.parametrize("damaged_key", ["fastckpt.crb32c", "fastckpt.crc32C"])
def test_a_damaged_checksum_key_does_not_make_the_file_unchecked(
    small: Path, damaged_key: str
) -> None:
    meta = fastckpt.read_metadata(small)
    begin = meta["tensors"]["w"]["data_offsets"][0]
    replace_in_header(small, CHECKSUM_KEY.encode(), damaged_key.encode())
    data = bytearray(small.read_bytes())
    data[meta["data_start"] + begin] ^= 0x10  # a second flip, in the data
    small.write_bytes(bytes(data))
    for name, read in READERS:
        with pytest.raises(CheckpointFormatError, match=damaged_key) as excinfo:
            read(small)
        assert str(small) in str(excinfo.value), name
    assert damaged_key in verify_error(small)


def test_a_damaged_header_checksum_key_is_refused(small: Path) -> None:
    replace_in_header(small, HEADER_CRC_KEY.encode(), b"fastckpt.header_crc32b")
    with pytest.raises(CheckpointFormatError, match="header_crc32b"):
        fastckpt.load_file(small)


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (b'"shape":[0,4]', b'"shape":[4,0]'),  # an empty tensor's shape: no bytes change
        (b'"w":{"dtype":"F32"', b'"w":{"dtype":"I32"'),  # same size: the data crc still holds
        (b'"format":"pt"', b'"format":"np"'),  # user metadata
    ],
)
def test_header_edits_a_data_checksum_cannot_see_are_refused(
    small: Path, old: bytes, new: bytes
) -> None:
    replace_in_header(small, old, new)
    for name, read in READERS:
        with pytest.raises(CheckpointFormatError, match=HEADER_CRC_KEY) as excinfo:
            read(small)
        assert str(small) in str(excinfo.value), name


def test_duplicate_keys_are_refused(small: Path, tmp_path: Path) -> None:
    # A second __metadata__ (the last one would win in a lenient parser) drops the checksums.
    length, header = header_of(small)
    data = small.read_bytes()[8 + length :]
    body = json.dumps(header, separators=(",", ":"))
    forged = '{"__metadata__":{},' + body[1:]
    encoded = forged.encode() + b" " * (-len(forged) % 8)
    small.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)
    with pytest.raises(CheckpointFormatError, match="duplicate key `__metadata__`"):
        fastckpt.load_file(small)
    # The same rule for files other writers produce, and inside the checksum table.
    plain = tmp_path / "plain.safetensors"
    entry = '{"dtype":"U8","shape":[1],"data_offsets":[0,1]}'
    raw = f'{{"a":{entry},"a":{entry}}}'
    plain.write_bytes(struct.pack("<Q", len(raw)) + raw.encode() + b"\x00")
    with pytest.raises(CheckpointFormatError, match="duplicate key `a`"):
        fastckpt.read_metadata(plain)
    table = tmp_path / "table.safetensors"
    write_raw(
        table,
        {
            "__metadata__": {CHECKSUM_KEY: '{"a":"00000000","a":"00000000"}'},
            "a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
        },
        b"\x00",
    )
    with pytest.raises(CheckpointFormatError, match="duplicate key `a`"):
        fastckpt.read_metadata(table)


def test_read_metadata_reports_the_verified_header_checksum(small: Path) -> None:
    _, header = header_of(small)
    stored = int(header["__metadata__"][HEADER_CRC_KEY], 16)
    meta = fastckpt.read_metadata(small)
    assert meta["header_crc32c"] == stored
    assert meta["metadata"] == {"format": "pt"}  # fastckpt's keys are not user metadata
    # What the stored value is, recomputed with the standard library (docs/on-disk-format.md).
    del header["__metadata__"][HEADER_CRC_KEY]
    canonical = json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    assert _native.crc32c(canonical.encode()) == stored


def test_files_without_a_header_checksum_still_load(tmp_path: Path) -> None:
    # safetensors' own files, and fastckpt files written before the header checksum existed.
    theirs = tmp_path / "theirs.safetensors"
    safetensors.torch.save_file({"a": torch.ones(3)}, str(theirs))
    assert torch.equal(fastckpt.load_file(theirs)["a"], torch.ones(3))
    assert fastckpt.read_metadata(theirs)["header_crc32c"] is None
    older = tmp_path / "older.safetensors"
    crc = _native.crc32c(b"\x07")
    write_raw(
        older,
        {
            "__metadata__": {CHECKSUM_KEY: json.dumps({"a": f"{crc:08x}"})},
            "a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
        },
        b"\x07",
    )
    assert fastckpt.read_metadata(older)["tensors"]["a"]["crc32c"] == crc
    write_raw(
        older,
        {
            "__metadata__": {CHECKSUM_KEY: json.dumps({"a": "00000000"})},
            "a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
        },
        b"\x07",
    )
    with pytest.raises(ChecksumMismatchError):
        fastckpt.load_file(older)


def test_reserved_and_look_alike_metadata_keys_are_refused_on_save(tmp_path: Path) -> None:
    path = tmp_path / "x.safetensors"
    for key in (CHECKSUM_KEY, HEADER_CRC_KEY, "fastckpt.crc32d", "FASTCKPT.CRC32C"):
        with pytest.raises(ValueError, match="rename it"):
            fastckpt.save_file({"a": torch.ones(1)}, path, metadata={key: "x"})
    assert not path.exists()
    fastckpt.save_file({"a": torch.ones(1)}, path, metadata={"fastckpt.source": "x"})
    assert fastckpt.read_metadata(path)["metadata"] == {"fastckpt.source": "x"}


def test_a_header_safetensors_could_not_read_is_refused_before_anything_is_written(
    tmp_path: Path,
) -> None:
    # safetensors reads headers up to 100,000,000 bytes. Before, a save with 100 MiB of
    # metadata committed a file that neither safetensors nor fastckpt itself would load
    # ("over the 104857600-byte limit ... corrupt").
    path = tmp_path / "x.safetensors"
    large = "x" * 100_000_000
    with pytest.raises(fastckpt.InvalidInputError, match="over the 100000000 bytes"):
        fastckpt.save_file({"a": torch.ones(2)}, path, metadata={"k": large})
    assert not path.exists() and not list(tmp_path.iterdir())
    fitting = "x" * 99_000_000  # just under the limit: written, and read by both
    fastckpt.save_file({"a": torch.ones(2)}, path, metadata={"k": fitting})
    del large
    assert torch.equal(fastckpt.load_file(path)["a"], torch.ones(2))
    assert torch.equal(safetensors.torch.load_file(path)["a"], torch.ones(2))


@pytest.mark.parametrize(
    ("call", "argument"),
    [
        (lambda path: fastckpt.save_file({"a": torch.ones(2)}, path, threads=-1), "threads"),
        (lambda path: fastckpt.save_file({"a": torch.ones(2)}, path, threads=2**70), "threads"),
        (lambda path: fastckpt.save_file({"a": torch.ones(2)}, path, threads=2.5), "threads"),
        (lambda path: fastckpt.save_file({"a": torch.ones(2)}, path, threads=True), "threads"),
        (lambda path: fastckpt.save_file({"a": torch.ones(2)}, path, chunk_size=-5), "chunk_size"),
        (lambda path: fastckpt.save_file({"a": torch.ones(2)}, path, chunk_size="8"), "chunk_size"),
        (
            lambda path: fastckpt.save_file({"a": torch.ones(2)}, path, chunk_size=1 << 31),
            "chunk_size",
        ),
        (lambda path: fastckpt.load_file(path, threads=-1), "threads"),
        (lambda path: fastckpt.load_file(path, threads=2**70), "threads"),
    ],
)
def test_thread_counts_and_chunk_sizes_out_of_range_are_typed_errors_naming_them(
    small: Path, call: Callable[[Path], Any], argument: str
) -> None:
    # Before: a bare OverflowError / TypeError from the extension's argument conversion.
    before = small.read_bytes()
    with pytest.raises(fastckpt.InvalidInputError, match=rf"^{argument} must be an int from"):
        call(small)
    assert small.read_bytes() == before


LARGE_CHUNK_CHILD = textwrap.dedent(
    """
    import resource, sys, torch, fastckpt
    from fastckpt.io.files import MAX_CHUNK_SIZE
    status = [line for line in open("/proc/self/status") if line.startswith("VmSize")]
    size = int(status[0].split()[1]) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (size + (512 << 20), resource.RLIM_INFINITY))
    value = torch.arange(1 << 20, dtype=torch.float32)
    fastckpt.save_file({"w": value}, sys.argv[1], chunk_size=MAX_CHUNK_SIZE, direct_io=True)
    assert torch.equal(fastckpt.load_file(sys.argv[1])["w"], value)
    print("saved")
    """
)


def test_the_largest_chunk_size_does_not_allocate_beyond_the_file(tmp_path: Path) -> None:
    """An O_DIRECT save's buffers are no longer than its longest chunk: the largest accepted
    ``chunk_size`` saves a 4 MiB file with 512 MiB of address space to spare. Before, every
    buffer (threads + 1 of them) had the chunk size: ``chunk_size=1 << 36`` (then accepted, up
    to 1 << 40) aborted the process ("memory allocation of 68719476736 bytes failed",
    SIGABRT) and left its temporary file."""
    path = tmp_path / "w.safetensors"
    result = subprocess.run(
        [sys.executable, "-c", LARGE_CHUNK_CHILD, str(path)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "saved"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.safetensors"]


NO_MEMORY_CHILD = textwrap.dedent(
    """
    import errno, os, resource, sys, torch, fastckpt
    value = torch.arange(16 << 20, dtype=torch.float32)  # 64 MiB
    status = [line for line in open("/proc/self/status") if line.startswith("VmSize")]
    size = int(status[0].split()[1]) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (size + (40 << 20), resource.RLIM_INFINITY))
    try:
        fastckpt.save_file({"w": value}, sys.argv[1], chunk_size=32 << 20, direct_io=True,
                           threads=4)
    except OSError as err:
        print(err.errno == errno.ENOMEM, err.filename)
    """
)


def test_write_buffers_that_cannot_be_allocated_are_an_error_naming_the_file(
    tmp_path: Path,
) -> None:
    """O_DIRECT write buffers that do not fit the address space: ``OSError(ENOMEM)`` naming
    the file, nothing left behind. Before, Rust's allocation-failure handler aborted the
    process (SIGABRT) and left its temporary file."""
    path = tmp_path / "w.safetensors"
    result = subprocess.run(
        [sys.executable, "-c", NO_MEMORY_CHILD, str(path)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["True", str(path)], result.stdout
    assert list(tmp_path.iterdir()) == []


POOL_CHILD = textwrap.dedent(
    """
    import resource, sys, torch, fastckpt
    big, small = {"w": torch.randn(32 << 20)}, {"s": torch.randn(300_000)}
    def save(state, name):
        fastckpt.save_file(state, f"{sys.argv[1]}/{name}", direct_io=True, threads=3)
    def faults(state, name):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        save(state, name)
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    save(big, "big")
    save(big, "big")
    counts = []
    for _ in range(3):
        save(small, "small")
        counts.append(faults(big, "big"))
    print(min(counts))
    """
)


def test_a_small_direct_save_keeps_the_pooled_chunk_buffers(tmp_path: Path) -> None:
    """An O_DIRECT save of a file smaller than a chunk reuses the pooled chunk-sized write
    buffers: the next large save faults none of its 16 MiB buffers in again (a count of page
    faults, not a time). Before, the small save's buffer size evicted the pool, and the next
    large save paged 3 x 16 MiB (~12,300 faults) in again."""
    result = subprocess.run(
        [sys.executable, "-c", POOL_CHILD, str(tmp_path)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert int(result.stdout) < 4096, result.stdout  # fewer than one 16 MiB buffer's pages


@pytest.mark.parametrize("shape", [[0, 2**64 - 1], [0, 2**62, 2], [2**63]])
def test_unindexable_shapes_are_format_errors_everywhere(tmp_path: Path, shape: list[int]) -> None:
    path = tmp_path / "huge.safetensors"
    write_raw(path, {"a": {"dtype": "U8", "shape": shape, "data_offsets": [0, 0]}}, b"")
    for name, read in READERS:
        with pytest.raises(CheckpointFormatError, match=r"a\.shape") as excinfo:
            read(path)
        assert str(path) in str(excinfo.value), name
    message = verify_error(path)
    assert "a.shape" in message and str(path) in message


def test_the_largest_indexable_empty_shape_still_loads(tmp_path: Path) -> None:
    path = tmp_path / "edge.safetensors"
    write_raw(path, {"a": {"dtype": "U8", "shape": [0, 2**63 - 1], "data_offsets": [0, 0]}}, b"")
    assert fastckpt.load_file(path)["a"].shape == (0, 2**63 - 1)


SPECIAL_FILES_CHILD = textwrap.dedent(
    """
    import json, os, sys
    import fastckpt
    from fastckpt import CheckpointFormatError, _native

    readers = {
        "load_file": fastckpt.load_file,
        "read_metadata": fastckpt.read_metadata,
        "verify_file": lambda p: _native.verify_file(p, 2),
    }
    results = {}
    for path in sys.argv[1:]:
        for name, read in readers.items():
            try:
                read(path)
                outcome = "read"
            except CheckpointFormatError as err:
                outcome = "refused" if path in str(err) else f"unnamed: {err}"
            except Exception as err:
                outcome = f"{type(err).__name__}: {err}"
            results[f"{name} {path}"] = outcome
    print(json.dumps(results))
    """
)


def test_fifos_and_devices_are_refused_at_once(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.safetensors"
    os.mkfifo(fifo)
    zero = tmp_path / "zero.safetensors"
    zero.symlink_to("/dev/zero")
    to_fifo = tmp_path / "to-pipe.safetensors"
    to_fifo.symlink_to(fifo)
    paths = [str(fifo), str(zero), str(to_fifo), "/dev/zero"]
    # A child process, so that a hang (the old behaviour: open() of a FIFO blocks forever, and
    # /dev/zero reads until MemoryError) fails the test through the timeout.
    child = subprocess.run(
        [sys.executable, "-c", SPECIAL_FILES_CHILD, *paths],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    results = json.loads(child.stdout)
    assert results and all(outcome == "refused" for outcome in results.values()), results


def test_a_symbolic_link_to_a_regular_file_is_followed_for_lone_files(small: Path) -> None:
    # Hugging Face caches store files as links to blobs; load_file follows them, as
    # safetensors does. The checkpoint readers refuse links with follow_symlinks=False.
    link = small.parent / "link.safetensors"
    link.symlink_to(small)
    assert set(fastckpt.load_file(link)) == {"w", "empty", "step"}
    with pytest.raises(CheckpointFormatError, match="symbolic link"):
        _native.read_header(str(link), follow_symlinks=False)
    fd = _native.open_regular(str(small), follow_symlinks=False)
    os.close(fd)
    with pytest.raises(IsADirectoryError):
        fastckpt.read_metadata(small.parent)
