"""fastckpt.save_file / load_file as a drop-in for safetensors.torch (issue 16, "safetensors
users"), checked against the real safetensors package: every dtype both write, files moving
both ways, the call shapes (``filename=``, ``backend=``), CPU tensors under a default device,
what ``safe_open(...).metadata()`` shows, error types, and the documented differences.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
import safetensors.torch
import torch
from safetensors import SafetensorError, safe_open

import fastckpt
from fastckpt import CheckpointFormatError
from fastckpt.errors import InvalidInputError

#: The dtypes safetensors 0.8 added beyond fastckpt's first set, where this torch has them.
NEWER_DTYPES = [
    getattr(torch, name)
    for name in ("float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2")
    if hasattr(torch, name)
]


def patterned(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Every byte value reinterpreted as ``dtype`` (byte-sized dtypes only)."""
    numel = 1
    for dim in shape:
        numel *= dim
    raw = (torch.arange(numel, dtype=torch.int64) * 37 + seed) % 256
    return raw.to(torch.uint8).view(dtype).reshape(shape)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


def test_newer_dtypes_exist_in_this_torch() -> None:
    # The dtype tests below would pass vacuously on a torch without them.
    assert len(NEWER_DTYPES) == 4, NEWER_DTYPES


@pytest.mark.parametrize("dtype", NEWER_DTYPES, ids=str)
def test_newer_dtypes_move_both_ways(tmp_path: Path, dtype: torch.dtype) -> None:
    tensors = {"x": patterned(dtype, (3, 4), 1), "y": patterned(dtype, (1, 2), 2)}
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    fastckpt.save_file(tensors, ours)
    safetensors.torch.save_file(tensors, str(theirs))
    for path in (ours, theirs):
        for loaded in (fastckpt.load_file(path), safetensors.torch.load_file(str(path))):
            assert all(same_bits(loaded[k], tensors[k]) for k in tensors), (path, loaded)
    # Both record the same header entry (F4 counts 4-bit elements: the last dim doubles).
    ours_meta, theirs_meta = fastckpt.read_metadata(ours), fastckpt.read_metadata(theirs)
    for name in tensors:
        for field in ("dtype", "shape", "data_offsets"):
            assert ours_meta["tensors"][name][field] == theirs_meta["tensors"][name][field]
    assert ours_meta["tensors"]["x"]["crc32c"] is not None


def test_a_packed_f4_tensor_with_an_odd_element_count_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "odd.safetensors"
    header = json.dumps({"q": {"dtype": "F4", "shape": [2, 3], "data_offsets": [0, 3]}}).encode()
    header += b" " * (-len(header) % 8)
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\x00" * 3)
    with pytest.raises(InvalidInputError, match=r"'q'.*last dimension must be even"):
        fastckpt.load_file(path)
    with pytest.raises(InvalidInputError, match="reshape it"):
        fastckpt.save_file({"s": torch.zeros((), dtype=torch.uint8).view(NEWER_DTYPES[-1])}, path)


@pytest.fixture
def default_device_meta() -> Iterator[None]:
    previous = torch.get_default_device()
    torch.set_default_device("meta")
    try:
        yield
    finally:
        torch.set_default_device(previous)


def test_load_file_returns_cpu_tensors_under_a_device_context(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    tensors = {"w": torch.randn(4, 3), "e": torch.empty(0, 2)}
    fastckpt.save_file(tensors, path)
    with torch.device("meta"):
        ours = fastckpt.load_file(path)
        theirs = safetensors.torch.load_file(str(path))
    for loaded in (ours, theirs):
        assert {t.device.type for t in loaded.values()} == {"cpu"}
    assert torch.equal(ours["w"], tensors["w"])


@pytest.mark.usefixtures("default_device_meta")
@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_load_file_returns_cpu_tensors_after_set_default_device(
    tmp_path: Path, backend: str
) -> None:
    path = tmp_path / "w.safetensors"
    fastckpt.save_file({"w": torch.ones(5, device="cpu")}, path)
    loaded = fastckpt.load_file(path, backend=backend)
    assert loaded["w"].device.type == "cpu"
    assert torch.equal(loaded["w"], torch.ones(5, device="cpu"))


def test_filename_and_backend_keywords(tmp_path: Path) -> None:
    path = tmp_path / "k.safetensors"
    tensors = {"a": torch.arange(6.0)}
    fastckpt.save_file(tensors=tensors, filename=path, metadata={"m": "1"})
    for backend in ("mmap", "pread"):
        assert torch.equal(fastckpt.load_file(filename=path, backend=backend)["a"], tensors["a"])
        assert torch.equal(
            safetensors.torch.load_file(filename=str(path), backend=backend)["a"], tensors["a"]
        )
    # fastckpt's earlier keyword keeps working; one of the two is required, not both.
    fastckpt.save_file(tensors, path=path)
    assert torch.equal(fastckpt.load_file(path=path)["a"], tensors["a"])
    with pytest.raises(TypeError, match="not both"):
        fastckpt.load_file(path, path=path)
    with pytest.raises(TypeError, match="missing the file"):
        fastckpt.load_file()
    with pytest.raises(ValueError, match="backend"):
        fastckpt.load_file(path, backend="zzz")
    with pytest.raises(SafetensorError, match="backend"):
        safetensors.torch.load_file(str(path), backend="zzz")


def test_pread_backend_tensors_do_not_depend_on_the_file(tmp_path: Path) -> None:
    path = tmp_path / "p.safetensors"
    fastckpt.save_file({"a": torch.arange(4096.0)}, path)
    loaded = fastckpt.load_file(path, backend="pread")
    os.truncate(path, 0)  # a mapped tensor would now fault (SIGBUS) on first touch
    assert float(loaded["a"].sum()) == float(torch.arange(4096.0).sum())


def test_metadata_as_safetensors_reads_it(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    fastckpt.save_file({"a": torch.ones(2)}, path, metadata={"format": "pt"})
    with safe_open(str(path), "pt") as handle:
        shown = handle.metadata()
    # The user's keys plus exactly fastckpt's two checksum keys (docs/migrating.md).
    assert set(shown) == {"format", "fastckpt.crc32c", "fastckpt.header_crc32c"}
    assert shown["format"] == "pt"
    assert json.loads(shown["fastckpt.crc32c"]) == {
        "a": f"{fastckpt.read_metadata(path)['tensors']['a']['crc32c']:08x}"
    }
    assert fastckpt.read_metadata(path)["metadata"] == {"format": "pt"}
    # Without metadata and checksums there is no __metadata__ at all: None, as safetensors.
    bare, theirs = tmp_path / "bare.safetensors", tmp_path / "theirs.safetensors"
    fastckpt.save_file({"a": torch.ones(2)}, bare, checksums=False)
    safetensors.torch.save_file({"a": torch.ones(2)}, str(theirs))
    for written in (bare, theirs):
        with safe_open(str(written), "pt") as handle:
            assert handle.metadata() is None


def test_metadata_copied_from_a_fastckpt_file_still_verifies(tmp_path: Path) -> None:
    # A tool that re-saves the tensors with safetensors and the metadata it read keeps a
    # valid, checked file: the header checksum covers content, not byte layout.
    ours, copy = tmp_path / "ours.safetensors", tmp_path / "copy.safetensors"
    tensors = {"w": torch.randn(3, 2), "b": torch.zeros(2, dtype=torch.int64)}
    fastckpt.save_file(tensors, ours, metadata={"origin": "x"})
    with safe_open(str(ours), "pt") as handle:
        metadata = handle.metadata()
        reloaded = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
    safetensors.torch.save_file(reloaded, str(copy), metadata=metadata)
    assert all(torch.equal(fastckpt.load_file(copy)[k], tensors[k]) for k in tensors)
    assert fastckpt.read_metadata(copy)["tensors"]["w"]["crc32c"] is not None


#: Every dtype both libraries store, several per element size (safetensors orders one size's
#: dtypes its own way: U64, I64, F64, C64, then F32, U32, I32, ...).
EVERY_DTYPE = [
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.uint16, torch.float16,
    torch.bfloat16, torch.int32, torch.uint32, torch.float32, torch.float64, torch.int64,
    torch.uint64, torch.complex64, torch.float8_e5m2, torch.float8_e4m3fn, *NEWER_DTYPES,
]  # fmt: skip


def test_a_file_of_mixed_dtypes_resaved_by_safetensors_keeps_its_layout_and_verifies(
    tmp_path: Path,
) -> None:
    # Before: fastckpt ordered one element size's dtypes by name (f32 + i32, f16 + bf16,
    # f64 + i64), safetensors by its own dtype order: the re-saved file's offsets moved, its
    # header checksum failed and an intact file was called corrupt.
    tensors = {
        # names in the reverse of every dtype order, so that no name order hides the dtype's
        f"t{len(EVERY_DTYPE) - i:02d}": patterned(torch.uint8, (2, 8), i).view(dtype)
        for i, dtype in enumerate(EVERY_DTYPE)
    }
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    fastckpt.save_file(tensors, ours)
    safetensors.torch.save_file(tensors, str(theirs))
    offsets = [
        {
            name: entry["data_offsets"]
            for name, entry in fastckpt.read_metadata(p)["tensors"].items()
        }
        for p in (ours, theirs)
    ]
    assert offsets[0] == offsets[1]
    with safe_open(str(ours), "pt") as handle:
        metadata = handle.metadata()
    copy = tmp_path / "copy.safetensors"
    safetensors.torch.save_file(
        safetensors.torch.load_file(str(ours)), str(copy), metadata=metadata
    )
    loaded = fastckpt.load_file(copy)
    assert all(same_bits(loaded[k], tensors[k]) for k in tensors)
    assert fastckpt.verify(copy).ok


@pytest.mark.parametrize(
    ("tensors", "metadata"),
    [
        ("notadict", None),
        ({"test": {"some": "thing"}}, None),
        ({"s": torch.eye(2).to_sparse()}, None),
        ({1: torch.ones(1)}, None),
        ({"a": torch.ones(1)}, ["not", "a", "dict"]),
        ({"a": torch.ones(1)}, {"k": 1}),
    ],
    ids=["not-a-dict", "not-a-tensor", "sparse", "int-name", "list-metadata", "int-value"],
)
def test_bad_input_is_a_value_error_like_safetensors(
    tmp_path: Path, tensors: object, metadata: object
) -> None:
    path = tmp_path / "bad.safetensors"
    with pytest.raises(InvalidInputError) as ours:
        fastckpt.save_file(tensors, path, metadata)  # type: ignore[arg-type]
    assert isinstance(ours.value, ValueError) and isinstance(ours.value, TypeError)
    # safetensors raises ValueError or TypeError for each; fastckpt's error is both.
    with pytest.raises((ValueError, TypeError)):
        safetensors.torch.save_file(tensors, str(path), metadata)  # type: ignore[arg-type]
    assert not path.exists()


def test_malformed_files_raise_a_value_error_where_safetensors_raises_safetensor_error(
    tmp_path: Path,
) -> None:
    path = tmp_path / "broken.safetensors"
    path.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(CheckpointFormatError) as ours:
        fastckpt.load_file(path)
    assert isinstance(ours.value, ValueError) and str(path) in str(ours.value)
    with pytest.raises(SafetensorError):
        safetensors.torch.load_file(str(path))
    # One handler for both libraries (docs/migrating.md):
    for load in (fastckpt.load_file, safetensors.torch.load_file):
        try:
            load(str(path))
        except (ValueError, SafetensorError):
            pass
        else:  # pragma: no cover - the file is malformed
            raise AssertionError(load)


def test_differences_by_design(tmp_path: Path) -> None:
    path = tmp_path / "d.safetensors"
    base = torch.arange(12.0).reshape(3, 4)
    aliased = {"a": base, "a_view": base[0], "t": base.t()}
    # safetensors refuses tensors sharing memory and non-contiguous tensors...
    with pytest.raises(RuntimeError, match="share memory"):
        safetensors.torch.save_file({"a": base, "a_view": base[0]}, str(path))
    with pytest.raises(ValueError, match="contiguous"):
        safetensors.torch.save_file({"t": base.t()}, str(path))
    # ...fastckpt saves each as its own contiguous copy: loaded tensors no longer alias.
    fastckpt.save_file(aliased, path)
    loaded = fastckpt.load_file(path)
    assert all(torch.equal(loaded[k], aliased[k]) for k in aliased)
    assert loaded["t"].is_contiguous()
    loaded["a"][0, 0] = -1.0
    assert float(loaded["a_view"][0]) == 0.0
    # Every file safetensors reads back is the same data (readers ignore the checksum keys).
    theirs = safetensors.torch.load_file(str(path))
    assert all(torch.equal(theirs[k], aliased[k]) for k in aliased)


def test_safe_open_takes_the_calls_safetensors_code_makes(tmp_path: Path) -> None:
    """The gaps safetensors' own torch tests found (issue 25): ``backend=``, ``get_tensors()``,
    ``metadata()`` of a file saved without metadata, an empty-list index, and the error a
    closed handle raises; each compared with safetensors on the same file."""
    plain = tmp_path / "plain.safetensors"
    tensors = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.arange(3, dtype=torch.int64)}
    safetensors.torch.save_file(tensors, str(plain))  # no metadata
    ours_file = tmp_path / "ours.safetensors"
    fastckpt.save_file(tensors, ours_file)  # only fastckpt's own checksum entries
    for backend in ("mmap", "pread"):
        with (
            safe_open(str(plain), "pt", backend=backend) as theirs,
            fastckpt.safe_open(plain, "pt", backend=backend) as ours,
        ):
            assert ours.metadata() is None and theirs.metadata() is None
            got, expected = ours.get_tensors(), theirs.get_tensors()
            assert list(got) == list(expected) == ours.offset_keys()
            assert all(torch.equal(got[k], expected[k]) for k in expected)
            assert ours.get_slice("w")[[]].shape == theirs.get_slice("w")[[]].shape
            for key in ([], (slice(None), []), (1, [])):  # as torch selects them
                assert ours.get_slice("w")[key].shape == tensors["w"][key].shape, key
    with fastckpt.safe_open(ours_file) as ours:
        assert ours.metadata() is None  # fastckpt's checksum entries are not metadata
    with pytest.raises(InvalidInputError, match="backend 'gds' is not supported"):
        fastckpt.safe_open(plain, backend="gds")
    handle = fastckpt.safe_open(plain)
    handle.close()
    with pytest.raises(SafetensorError, match="closed") as caught:
        handle.keys()
    assert isinstance(caught.value, fastckpt.FastCkptError)
    assert isinstance(caught.value, ValueError)  # what fastckpt raised before, still caught
