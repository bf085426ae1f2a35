"""Safetensors files other tools write, and lazy slices, read as safetensors and torch read
them (round 20, interop findings 1-3 and knobs finding F2).

- MLX's ``mx.save_safetensors`` writes ``"__metadata__": null`` when it is given no metadata;
  safetensors reads that as "no metadata", fastckpt refused it as malformed and ``fastckpt
  verify`` called the file corrupt.
- A fastckpt file re-saved by safetensors with ``metadata=f.metadata()`` and other tensors
  carries stale fastckpt checksums; it is still refused, and the error now names the copied
  keys and how to load the file.
- ``get_slice(name)[[], []]`` (two or more list indices) returned other shapes than torch; it
  is refused as non-empty lists are.
- ``safe_open(verify=False, verify_slices=True)`` skipped slice verification without a word;
  the pair is refused.
"""

from __future__ import annotations

import itertools
import os
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import safetensors
import safetensors.torch
import torch

import fastckpt
from fastckpt import CheckpointFormatError, ChecksumMismatchError, InvalidInputError

#: The exact header ``mlx.core.save_safetensors`` (mlx 0.32.4) wrote for three tensors saved
#: without metadata: ``"__metadata__":null``, unpadded, tensors in name order.
MLX_HEADER = (
    b'{"__metadata__":null,"b":{"data_offsets":[4,7],"dtype":"I8","shape":[3]},'
    b'"h":{"data_offsets":[0,4],"dtype":"BF16","shape":[2]},'
    b'"w":{"data_offsets":[7,31],"dtype":"F32","shape":[2,3]}}'
)
MLX_DATA = b"\x00\x3f\xc0\x3f" + bytes([1, 2, 3]) + struct.pack("<6f", 0, 1, 2, 3, 4, 5)
MLX_TENSORS = {
    "h": torch.tensor([0.5, 1.5], dtype=torch.bfloat16),
    "b": torch.tensor([1, 2, 3], dtype=torch.int8),
    "w": torch.arange(6, dtype=torch.float32).reshape(2, 3),
}
STALE_KEYS = ("fastckpt.crc32c", "fastckpt.header_crc32c")


def write_file(path: Path, header: bytes, data: bytes) -> Path:
    """A safetensors file with exactly these header bytes."""
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    return path


def cli_verify(path: Path) -> tuple[int, str]:
    """``fastckpt verify PATH`` in a subprocess, run from the file's folder: (status, stdout)."""
    done = subprocess.run(
        [sys.executable, "-m", "fastckpt", "verify", path.name],
        cwd=path.parent,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    return done.returncode, done.stdout


def assert_same_tensors(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def test_an_mlx_file_with_null_metadata_loads_unchecked_as_one_without_metadata(
    tmp_path: Path,
) -> None:
    """Before: load_file, safe_open and read_metadata raised ``CheckpointFormatError:
    malformed header field __metadata__: must be a str -> str mapping`` and ``fastckpt verify``
    reported the file ``corrupt`` (exit status 1), while safetensors loads it."""
    mlx = write_file(tmp_path / "mlx.safetensors", MLX_HEADER, MLX_DATA)
    assert_same_tensors(safetensors.torch.load_file(str(mlx)), MLX_TENSORS)
    assert_same_tensors(fastckpt.load_file(mlx), MLX_TENSORS)
    with fastckpt.safe_open(mlx) as handle:
        assert handle.keys() == ["b", "h", "w"]
        assert handle.metadata() is None  # as safetensors says of it
        assert_same_tensors(handle.get_tensors(), MLX_TENSORS)
        assert torch.equal(handle.get_slice("w")[1:, ::2], MLX_TENSORS["w"][1:, ::2])
    meta = fastckpt.read_metadata(mlx)
    assert meta["metadata"] == {} and meta["header_crc32c"] is None
    assert all(entry["crc32c"] is None for entry in meta["tensors"].values())
    # Exactly what the same header without its "__metadata__" entry gets: unchecked, status 3.
    plain_dir = tmp_path / "plain"
    plain_dir.mkdir()
    without = MLX_HEADER.replace(b'"__metadata__":null,', b"")
    plain = write_file(plain_dir / "mlx.safetensors", without, MLX_DATA)
    status, out = cli_verify(mlx)
    assert (status, out) == cli_verify(plain)
    assert status == 3 and out.startswith("UNCHECKED: mlx.safetensors: no damage found"), out
    assert "3 tensor(s) unchecked: h, b, w" in out and "corrupt" not in out
    assert fastckpt.verify(mlx).files[0].status == "unchecked"


@pytest.mark.parametrize("value", [b"[]", b'"x"', b"1", b"false", b'{"k":null}'])
def test_metadata_that_is_neither_null_nor_a_mapping_of_strings_is_still_refused(
    tmp_path: Path, value: bytes
) -> None:
    """Only ``null`` means "no metadata" (safetensors refuses these too)."""
    header = MLX_HEADER.replace(b'"__metadata__":null', b'"__metadata__":' + value)
    path = write_file(tmp_path / "odd.safetensors", header, MLX_DATA)
    with pytest.raises(CheckpointFormatError, match="__metadata__"):
        fastckpt.load_file(path)
    with pytest.raises(Exception):  # noqa: B017 - safetensors' own error type
        safetensors.torch.load_file(str(path))


EDITS: dict[str, tuple[Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]], type]] = {
    "scaled": (lambda t: {k: v * 0.5 for k, v in t.items()}, ChecksumMismatchError),
    "dropped": (lambda t: {"w": t["w"]}, CheckpointFormatError),
    "added": (lambda t: {**t, "extra": torch.ones(2)}, CheckpointFormatError),
    "half": (lambda t: {k: v.half() for k, v in t.items()}, CheckpointFormatError),
}


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_a_file_rewritten_with_copied_fastckpt_metadata_is_refused_naming_the_keys(
    tmp_path: Path, edit: str
) -> None:
    """The common script idiom ``save_file(new_tensors, out, metadata=f.metadata())`` on a
    fastckpt file copies its checksum keys, now stale. Still refused (the bytes cannot be
    told from damage), but before, the error only said "the file is corrupt: restore it";
    it now names the copied keys and that dropping them loads the file unchecked."""
    torch.manual_seed(0)
    source = tmp_path / "src.safetensors"
    fastckpt.save_file(
        {"w": torch.randn(4, 4), "b": torch.randn(4)}, source, metadata={"format": "pt"}
    )
    with safetensors.safe_open(str(source), "pt") as f:
        metadata = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    assert set(STALE_KEYS) <= set(metadata)
    change, error = EDITS[edit]
    edited = change(tensors)
    out = tmp_path / f"{edit}.safetensors"
    safetensors.torch.save_file(edited, str(out), metadata=metadata)
    assert_same_tensors(safetensors.torch.load_file(str(out)), edited)

    def refusal(read: Callable[[], Any]) -> str:
        with pytest.raises(error) as caught:
            read()
        return str(caught.value)

    def read_lazily() -> None:
        with fastckpt.safe_open(out) as handle:
            handle.get_tensors()

    messages = [
        refusal(lambda: fastckpt.load_file(out)),
        refusal(read_lazily),
        fastckpt.verify(out).files[0].message,
    ]
    for message in messages:
        assert str(out) in message and "corrupt" in message, message
        assert "rewrote" in message and "another tool" in message, message
        assert all(f"`{key}`" in message for key in STALE_KEYS), message
        assert "drop both keys" in message and "load it unchecked" in message, message
    # The fix the message gives: without the two keys the file loads, unchecked.
    kept = {k: v for k, v in metadata.items() if k not in STALE_KEYS}
    safetensors.torch.save_file(edited, str(out), metadata=kept)
    assert_same_tensors(fastckpt.load_file(out), edited)
    assert fastckpt.verify(out).files[0].status == "unchecked"


#: One dimension's index: what torch takes and fastckpt's slices support, with empty lists.
ATOMS: list[Any] = [[], 0, -1, slice(None), slice(1, 3), slice(None, None, 2), Ellipsis]


def keys_up_to(length: int) -> list[tuple[Any, ...]]:
    """Every tuple of up to ``length`` atoms with at most one ``...``."""
    keys = []
    for n in range(1, length + 1):
        for key in itertools.product(ATOMS, repeat=n):
            if sum(item is Ellipsis for item in key) <= 1:
                keys.append(key)
    return keys


def test_two_list_indices_are_refused_and_one_selects_as_torch(tmp_path: Path) -> None:
    """Before: ``[[], []]`` gave (0, 0, 3) where torch gives (0, 3), ``[:2, [], []]`` (2, 0, 0)
    for (2, 0), ``[[], -1, ..., []]`` (0, 0) for (0,): each empty list kept a dimension of its
    own, while torch merges its list indices into one. Two or more lists are now refused with
    the ``InvalidInputError`` a non-empty list gets; every key with one list or none is still
    torch's own shape and values."""
    w = torch.arange(60, dtype=torch.float32).reshape(5, 4, 3)
    path = tmp_path / "w.safetensors"
    fastckpt.save_file({"w": w}, path)
    refused = 0
    with fastckpt.safe_open(path) as handle:
        sliced = handle.get_slice("w")
        with pytest.raises(InvalidInputError, match="is not supported") as non_empty:
            sliced[[0, 1]]
        assert isinstance(non_empty.value, TypeError)
        for key in keys_up_to(4):
            lists = sum(isinstance(item, list) for item in key)
            try:
                expected = w[key]
            except IndexError:
                with pytest.raises(IndexError):
                    sliced[key]
                continue
            if lists >= 2:
                with pytest.raises(InvalidInputError, match="is not supported") as caught:
                    sliced[key]
                assert isinstance(caught.value, TypeError), key
                assert "a second list index" in str(caught.value) and str(path) in str(caught.value)
                refused += 1
                continue
            got = sliced[key]
            assert got.shape == expected.shape and torch.equal(got, expected), key
    assert refused > 0
    for key in [([], []), (slice(None, 2), [], []), ([], -1, Ellipsis, [])]:  # the finding's
        with fastckpt.safe_open(path) as handle, pytest.raises(InvalidInputError):
            handle.get_slice("w")[key]


def test_verify_slices_without_verify_is_refused(tmp_path: Path) -> None:
    """Before: ``safe_open(verify=False, verify_slices=True)`` was accepted and verified
    nothing: a slice of a damaged tensor came back without a word. The pair is refused,
    naming both; each other combination still opens."""
    path = tmp_path / "a.safetensors"
    fastckpt.save_file({"t": torch.arange(1000, dtype=torch.float32)}, path)
    with open(path, "r+b") as f:  # flip a bit of the last element
        f.seek(os.path.getsize(path) - 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))
    with pytest.raises(ValueError, match="verify_slices=True needs verify=True") as caught:
        fastckpt.safe_open(path, verify=False, verify_slices=True)
    assert "verify=False" in str(caught.value)
    with (
        fastckpt.safe_open(path, verify=True, verify_slices=True) as handle,
        pytest.raises(ChecksumMismatchError),
    ):
        handle.get_slice("t")[990:]
    with fastckpt.safe_open(path, verify=False, verify_slices=False) as handle:
        assert handle.get_slice("t")[990:].shape == (10,)
