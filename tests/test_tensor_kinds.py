"""Tensors and state keys a checkpoint cannot hold are refused at save(), typed and named,
through every front door (sync and async alike); the unusual ones it can hold round-trip."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from torch.testing._internal.two_tensor import TwoTensor

import fastckpt
from fastckpt.errors import CheckpointFormatError, InvalidInputError
from fastckpt.manager import CheckpointManager

UNSTORABLE: dict[str, tuple[Callable[[], torch.Tensor], str]] = {
    "sparse": (lambda: torch.eye(3).to_sparse(), "to_dense"),
    "quantized": (
        lambda: torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.quint8),
        "dequantize",
    ),
    "mkldnn": (lambda: torch.randn(2, 2).to_mkldnn(), "to_dense"),
    "meta": (lambda: torch.empty(3, device="meta"), "meta tensor"),
    "nested": (lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), "nested"),
    "zero": (lambda: torch._efficientzerotensor(3), "zeros_like"),
    "complex128": (lambda: torch.ones(2, dtype=torch.complex128), "complex128"),
    "uninitialized": (lambda: torch.nn.parameter.UninitializedParameter(), "forward pass"),
    # A __torch_dispatch__ wrapper (as torchao's quantized and float8 tensors): its storage
    # holds none of its values. Before, the async manager committed garbage and verify said ok.
    "wrapper subclass": (lambda: TwoTensor(torch.ones(3), torch.full((3,), 2.0)), "subclass"),
}


def _manager(mode: str) -> CheckpointManager:
    config = getattr(CheckpointManager.Config, f"with_{mode}_save")()
    return CheckpointManager(config)


@pytest.mark.parametrize("kind", sorted(UNSTORABLE))
def test_a_tensor_that_cannot_be_stored_is_refused_at_save_naming_its_key(
    tmp_path: Path, kind: str
) -> None:
    """Before: untyped RuntimeError/NotImplementedError (sync, save_file), or an error only at
    ``future.result()`` without the key (async), or a committed checkpoint of garbage."""
    make, fix = UNSTORABLE[kind]
    for mode in ("sync", "async"):
        with _manager(mode) as manager:
            manager.save(tmp_path / mode / "good", {"model": {"w": torch.ones(3)}})
            with pytest.raises(InvalidInputError, match=fix) as info:
                manager.save(tmp_path / mode / "bad", {"model": {"layer.weight": make()}})
            assert "model.layer.weight" in str(info.value), (mode, info.value)
            assert not (tmp_path / mode / "bad").exists()
            assert torch.equal(manager.load(tmp_path / mode / "good")["model"]["w"], torch.ones(3))
    with pytest.raises(InvalidInputError, match=fix) as info:
        fastckpt.save_file({"layer.weight": make()}, tmp_path / "f.safetensors")
    assert "layer.weight" in str(info.value)
    # save_checkpoint: in a model buffer and in an optimizer's state (before, a nested or a
    # zero tensor there raised torch's internal RuntimeError, without the key)
    root = tmp_path / "root"
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    fastckpt.save_checkpoint(root, models={"main": (model, None)})
    optimizer.state[model.weight]["k"] = make()
    with pytest.raises(InvalidInputError, match=fix) as info:
        fastckpt.save_checkpoint(
            root, models={"main": (model, None)}, optimizers={"sgd": (optimizer, None)}
        )
    assert "state.0.k" in str(info.value)
    if kind in ("nested", "zero"):  # (other kinds in a buffer meet the recipe check first)
        model.register_buffer("odd", make())
        with pytest.raises(InvalidInputError, match=fix) as info:
            fastckpt.save_checkpoint(root, models={"main": (model, None)})
        assert "odd" in str(info.value)
    assert [row["index"] for row in fastckpt.list_checkpoints(root)] == [0]
    assert fastckpt.verify(root).ok


def test_a_transposed_fp4_tensor_round_trips_through_sync_and_async_saves(
    tmp_path: Path,
) -> None:
    """torch has no copy kernel for ``float4_e2m1fn_x2``: a non-contiguous one is copied as
    bytes (before: NotImplementedError from ``.contiguous()`` / the stager's ``copy_``)."""
    bits = torch.randint(0, 256, (512, 512), dtype=torch.uint8, generator=torch.Generator())
    packed = bits.view(torch.float4_e2m1fn_x2).t()
    expected = bits.t().contiguous()
    for mode in ("sync", "async"):
        with _manager(mode) as manager:
            future = manager.save(tmp_path / mode, {"model": {"w": packed}})
            if future is not None:
                future.result()
            loaded = manager.load(tmp_path / mode)["model"]["w"]
        assert torch.equal(loaded.view(torch.uint8), expected), mode


@pytest.fixture
def deterministic_mode() -> Iterator[None]:
    """``torch.use_deterministic_algorithms(True)`` for one test (a Lightning
    ``Trainer(deterministic=True)`` leaves it on for the process)."""
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


def test_fp4_tensors_save_and_load_under_torchs_deterministic_mode(
    tmp_path: Path, deterministic_mode: None
) -> None:
    """Deterministic mode fills every new tensor and has no fill kernel for
    ``float4_e2m1fn_x2``: staging, loads, loads into templates, ``load_file`` and lazy reads
    allocate bytes and view them (before: NotImplementedError from each)."""
    bits = torch.randint(0, 256, (4, 6), dtype=torch.uint8, generator=torch.Generator())
    packed = bits.view(torch.float4_e2m1fn_x2)
    with CheckpointManager() as manager:
        future = manager.save(tmp_path / "ckpt", {"model": {"w": packed, "f": torch.ones(3)}})
        if future is not None:
            future.result()
        assert torch.equal(manager.load(tmp_path / "ckpt")["model"]["w"].view(torch.uint8), bits)
        into = {"w": torch.zeros(4, 6, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)}
        manager.load(tmp_path / "ckpt", into={"model": into})
        assert torch.equal(into["w"].view(torch.uint8), bits)
    path = tmp_path / "f.safetensors"
    fastckpt.save_file({"w": packed}, path)
    assert torch.equal(fastckpt.load_file(path)["w"].view(torch.uint8), bits)
    with fastckpt.safe_open(path, "pt") as lazy:
        assert torch.equal(lazy.get_tensor("w").view(torch.uint8), bits)
        assert torch.equal(lazy.get_slice("w")[1:3].view(torch.uint8), bits[1:3])


class _Packed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(2, 2)
        packed = torch.arange(12, dtype=torch.uint8).reshape(3, 4).view(torch.float4_e2m1fn_x2)
        self.register_buffer("packed", packed)


def test_incremental_indices_of_a_model_with_an_fp4_buffer_load_bitwise(tmp_path: Path) -> None:
    """An unchanged ``float4_e2m1fn_x2`` tensor is referenced by the next index; the
    reference records its safetensors shape (last dimension doubled). Before, every
    incremental index failed to load (shape [3, 4] vs the reference's [3, 8]) while verify
    passed, so ``keep_last=1`` left no loadable checkpoint."""
    model = _Packed()
    root = tmp_path / "root"
    for _ in range(3):
        fastckpt.save_checkpoint(root, models={"main": (model, None)})
    shutil.rmtree(root / "0")  # every index stays self-contained
    for index in (1, 2):
        loaded = fastckpt.load_checkpoint(root, index)["models"]["main"]["model"]
        assert torch.equal(loaded.packed.view(torch.uint8), model.packed.view(torch.uint8))
        assert torch.equal(loaded.linear.weight, model.linear.weight)


@pytest.mark.parametrize(
    ("key", "why"),
    [
        ("commit", "record"),  # commit.json: the checkpoint's own record
        ("fastckpt-dcp", "record"),  # fastckpt-dcp.json: a sharded checkpoint's record
        ("x.rank0", "rank 0's file of item 'x'"),
        ("emb_\udcff", "Unicode"),
        # before: a raw ENAMETOOLONG naming the staging folder, not the key
        ("x" * 201, "201 bytes long"),
        ("ü" * 101, "202 bytes long"),
    ],
)
def test_a_state_key_that_would_overwrite_a_record_or_another_item_is_refused(
    tmp_path: Path, key: str, why: str
) -> None:
    """Before: ``commit`` replaced the checkpoint's record with the item's skeleton (save
    reported success, the id then failed to load), ``x.rank0``'s tensors loaded as item
    ``x``'s, and a lone surrogate raised a bare UnicodeEncodeError while writing."""
    for mode in ("sync", "async"):
        path = tmp_path / mode
        with _manager(mode) as manager:
            manager.save(path, {"model": {"w": torch.zeros(3)}})
            state = {"x": {"t": torch.zeros(3)}, key: {"t": torch.ones(3)}}
            with pytest.raises(CheckpointFormatError, match=why):
                manager.save(path, state)
            assert torch.equal(manager.load(path)["model"]["w"], torch.zeros(3))
            with pytest.raises(TypeError, match="Unicode"):  # the same inside an item
                manager.save(path, {"model": {"emb_\udcff": torch.ones(2)}})
            assert fastckpt.verify(path).ok


ASYNC_COLLECTIVE = """
import os, sys, tempfile, torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
dist.init_process_group("gloo", rank=0, world_size=1)
import torch.distributed._functional_collectives as funcol
import fastckpt
result = funcol.all_reduce(torch.arange(4.0), "sum", dist.group.WORLD)
assert type(result).__name__ == "AsyncCollectiveTensor"
root = tempfile.mkdtemp()
fastckpt.save_file({"x": result}, root + "/a.safetensors")
with fastckpt.CheckpointManager(fastckpt.CheckpointManager.Config.with_sync_save()) as m:
    m.save(root + "/step_1", {"x": result})
    loaded = m.load(root + "/step_1")["x"]
assert torch.equal(fastckpt.load_file(root + "/a.safetensors")["x"], torch.arange(4.0))
assert torch.equal(loaded, torch.arange(4.0))
dist.destroy_process_group()
print("ok")
"""


def test_a_collective_s_pending_result_is_saved_once_waited_for(tmp_path: Path) -> None:
    """An ``AsyncCollectiveTensor`` (a functional collective's result, a dispatch subclass)
    is waited for and saved as the plain tensor it is, not refused with the wrapper
    subclasses whose storage holds none of their values."""
    import socket
    import subprocess
    import sys

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    done = subprocess.run(
        [sys.executable, "-c", ASYNC_COLLECTIVE, port], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_names_too_long_for_the_filesystem_are_refused_naming_them(tmp_path: Path) -> None:
    """A model name whose files would pass the 255-byte limit (before: a raw ENAMETOOLONG
    naming ``.tmp-...``); 200 bytes still save (a checkpoint folder's name is checked against
    its temporary sibling's: test_a_name_too_long_for_the_temporary_sibling_says_what_fits)."""
    model = torch.nn.Linear(2, 2)
    with pytest.raises(CheckpointFormatError, match=r"model name 'mmmm.*201 bytes long"):
        fastckpt.save_checkpoint(tmp_path / "root", models={"m" * 201: (model, None)})
    assert fastckpt.save_checkpoint(tmp_path / "root", models={"m" * 200: (model, None)}) == 0
    with _manager("sync") as manager:
        manager.save(tmp_path / "s", {"k" * 200: torch.ones(1)})
        assert torch.equal(manager.load(tmp_path / "s")["k" * 200], torch.ones(1))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["root", "s"]
