"""File images: async saves stage each file into one aligned buffer laid out as the file, and
the Rust core writes it without a second copy. The files must be the same tensors, checksums
and format as ``save_file`` writes; anything that is not exactly an image's views is written
the ordinary way."""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fastckpt
from fastckpt import _native
from fastckpt.io.images import ALIGN, IMAGE_MIN_BYTES, FileImage, ImagePool, find_image
from fastckpt.io.images import write_image as write_file_image
from fastckpt.io.staging import CpuStager, reserve_groups, stage_groups
from fastckpt.storage.backend import LocalStaging

ALL = lambda group, name: True  # noqa: E731


def big_state(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(300, 257, generator=gen),  # ~300 KiB, above IMAGE_MIN_BYTES
        "half": torch.randn(33, 7, generator=gen).half(),
        "flags": torch.rand(13, generator=gen) > 0.5,
        "steps": torch.arange(5, dtype=torch.int64),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.zeros(0, 4),
        "strided": torch.randn(40, 30, generator=gen).t(),  # not contiguous
    }


def data_start(path: Path) -> int:
    with open(path, "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


def test_an_image_file_holds_the_same_tensors_as_save_file_and_opens_everywhere(
    tmp_path: Path,
) -> None:
    state = big_state()
    groups = {"file": dict(state)}
    pool = ImagePool(pinned=False)
    stage_groups(CpuStager(), groups, ALL, pool)
    image = find_image(groups["file"])
    assert image is not None
    assert image.buffer.data_ptr() % ALIGN == 0 and image.data_start % ALIGN == 0
    ours = tmp_path / "image.safetensors"
    report = write_file_image(image, ours)
    plain = tmp_path / "plain.safetensors"
    fastckpt.save_file(state, plain)

    assert data_start(ours) == image.data_start  # the header is padded to the aligned start
    assert os.path.getsize(ours) == report["file_len"]
    for loaded in (fastckpt.load_file(ours), safetensors.torch.load_file(str(ours))):
        assert set(loaded) == set(state)
        for name, tensor in state.items():
            assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name
    # Same per-tensor checksums as save_file; the whole-file checksum is the file's.
    theirs = _native.read_header(str(plain))
    mine = _native.read_header(str(ours))
    assert mine["checksums"] == theirs["checksums"]
    assert report["file_crc32c"] == _native.crc32c(ours.read_bytes())
    assert fastckpt.verify(ours).ok


def test_find_image_accepts_only_exactly_the_image_views() -> None:
    groups = {"file": big_state()}
    pool = ImagePool(pinned=False)
    stage_groups(CpuStager(), groups, ALL, pool)
    views = groups["file"]
    image = find_image(views)
    assert image is not None and image is pool.images["file"]
    assert find_image({**views, "extra": torch.ones(2)}) is None  # a tensor added later
    assert find_image({k: v for k, v in views.items() if k != "w"}) is None  # one missing
    assert find_image({**views, "w": views["w"].clone()}) is None  # equal bytes, not the view
    assert find_image({}) is None


def test_the_pool_reuses_an_image_and_replaces_it_when_the_file_changes() -> None:
    pool = ImagePool(pinned=False)
    stager = CpuStager()
    first = {"file": big_state(0)}
    stage_groups(stager, first, ALL, pool)
    second = {"file": big_state(1)}
    stage_groups(stager, second, ALL, pool)
    assert pool.allocations == 1
    assert second["file"]["w"].data_ptr() == first["file"]["w"].data_ptr()
    assert torch.equal(second["file"]["w"], big_state(1)["w"])
    assert stager.nbytes == 0  # image tensors hold no per-tensor buffer
    grown = big_state(2)
    grown["w"] = torch.randn(301, 257)
    stage_groups(stager, {"file": grown}, ALL, pool)
    assert pool.allocations == 2
    # A file that is gone from the state drops its image; a small file gets none.
    stage_groups(stager, {"other": {"tiny": torch.ones(3)}}, ALL, pool)
    assert pool.images == {} and stager.nbytes == 12


def test_a_group_with_nothing_selected_gets_no_image_and_a_split_save_fills_one() -> None:
    pool = ImagePool(pinned=False)
    groups = {"model": big_state(), "opt": {"m": torch.randn(300, 300)}}
    stage_groups(CpuStager(), groups, lambda group, name: group == "model" and name == "w", pool)
    assert set(pool.images) == {"model"}
    assert find_image(groups["model"]) is None  # half staged: the writer must not use it
    stage_groups(CpuStager(), groups, lambda group, name: group == "model" and name != "w", pool)
    assert find_image(groups["model"]) is pool.images["model"]


def test_a_tensor_no_file_can_lay_out_is_refused_while_staging(tmp_path: Path) -> None:
    # A 0-d float4 tensor has no safetensors layout: refused while staging, before any image
    # or file, under its group and key (it was refused only by the writer, under its key in
    # the file: a manager item's name was missing from the message).
    state = {**big_state(), "packed": torch.empty((), dtype=torch.float4_e2m1fn_x2)}
    groups = {"file": dict(state)}
    pool = ImagePool(pinned=False)
    with pytest.raises(TypeError, match=r"'file/packed'.*reshape it to"):
        stage_groups(CpuStager(), groups, ALL, pool)
    assert pool.images == {} and find_image(groups["file"]) is None
    staging = LocalStaging(tmp_path / "ckpt")
    with pytest.raises(TypeError, match="packed"):
        staging.put_tensors("file.safetensors", groups["file"])
    staging.discard()


def test_reserve_allocates_and_touches_the_images_once() -> None:
    pool = ImagePool(pinned=False)
    stager = CpuStager()
    groups = {"file": big_state()}
    allocated = reserve_groups(stager, groups, ALL, pool)
    assert allocated == pool.images["file"].nbytes > IMAGE_MIN_BYTES
    assert reserve_groups(stager, groups, ALL, pool) == 0
    stage_groups(stager, groups, ALL, pool)
    assert pool.allocations == 1 and stager.allocations == 0


def test_the_store_writes_image_views_from_the_image_and_anything_else_as_before(
    tmp_path: Path,
) -> None:
    groups = {"file": big_state()}
    pool = ImagePool(pinned=False)  # owns the image while it is written, as a hook's does
    stage_groups(CpuStager(), groups, ALL, pool)
    staging = LocalStaging(tmp_path / "ckpt")
    staging.put_tensors("imaged.safetensors", groups["file"])
    changed = {**groups["file"], "late": torch.ones(3)}
    staging.put_tensors("plain.safetensors", changed)
    staging.publish()
    assert data_start(tmp_path / "ckpt" / "imaged.safetensors") == 4096
    assert data_start(tmp_path / "ckpt" / "plain.safetensors") % 4096 != 0
    loaded = fastckpt.load_file(tmp_path / "ckpt" / "plain.safetensors")
    assert torch.equal(loaded["late"], torch.ones(3)) and torch.equal(loaded["w"], big_state()["w"])


def test_the_native_writer_refuses_bad_images_naming_the_file(tmp_path: Path) -> None:
    state = {"w": torch.randn(100_000)}
    image = FileImage(state, pinned=False)
    target = tmp_path / "x.safetensors"
    args: list[Any] = [image.descriptions, None, image.data_start, {}, 1 << 20, False, True]

    def write(buffer: Any, start: int = image.data_start) -> None:
        call = list(args)
        call[1], call[2] = buffer, start
        _native.write_image(str(target), *call)

    with pytest.raises(ValueError, match="layout needs"):
        write(image.buffer[:-1].numpy())
    misaligned = torch.empty(image.nbytes + ALIGN + 1, dtype=torch.uint8)
    offset = (-misaligned.data_ptr() % ALIGN) + 1
    with pytest.raises(ValueError, match="boundary"):
        write(misaligned[offset : offset + image.nbytes].numpy())
    with pytest.raises(ValueError, match="image_layout"):
        write(image.buffer.numpy(), image.data_start + ALIGN)
    readonly = image.buffer.numpy()
    readonly.flags.writeable = False
    with pytest.raises(ValueError, match="writable"):
        write(readonly)
    assert list(tmp_path.iterdir()) == []  # nothing written, no temporary file left


class NormNet(nn.Module):
    """Parameters plus BatchNorm statistics (buffers the hook stages apart, first)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 512)
        self.norm = nn.BatchNorm1d(512)
        self.out = nn.Linear(512, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.norm(self.inp(x))))


def norm_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    (x,) = batch
    return model(x).square().mean()


def run_norm_job(root: Path, *, async_save: bool) -> fastckpt.TrainingStrategy:
    torch.manual_seed(7)
    hook = fastckpt.CheckpointHook(root, step_interval=2, async_save=async_save)
    strategy = fastckpt.TrainingStrategy(
        NormNet(),
        fastckpt.OptimizerConfig(torch.optim.AdamW, {"lr": 1e-3}),
        training_fn=norm_loss,
        hooks=[hook],
        num_steps=6,
    )
    x = torch.randn(48, 16, generator=torch.Generator().manual_seed(3))
    strategy.run(DataLoader(TensorDataset(x), batch_size=8))
    return strategy


def test_hook_async_saves_go_through_images_and_equal_sync_saves(tmp_path: Path) -> None:
    run_norm_job(tmp_path / "async", async_save=True)
    run_norm_job(tmp_path / "sync", async_save=False)
    for index in range(3):
        for relpath in ("models/main.safetensors", "optimizers/main.safetensors"):
            ours = tmp_path / "async" / str(index) / relpath
            plain = tmp_path / "sync" / str(index) / relpath
            assert data_start(ours) == 4096, (index, relpath)  # written from the image
            a, b = fastckpt.load_file(ours), fastckpt.load_file(plain)
            assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a), relpath
    assert fastckpt.verify(tmp_path / "async").ok


def test_manager_async_saves_write_each_checkpoint_from_its_image(tmp_path: Path) -> None:
    state = {"w": torch.randn(400, 300), "b": torch.zeros(300)}
    manager = fastckpt.CheckpointManager(
        fastckpt.CheckpointManager.Config(save=fastckpt.AsyncCheckpointSaverConfig())
    )
    try:
        expected = []
        for step in range(3):
            with manager.lock():
                state["w"].add_(1.0)
                state["b"][step] = step + 1
            expected.append({k: v.clone() for k, v in state.items()})
            manager.save(str(tmp_path / f"step{step}"), {"state": state})
    finally:
        manager.close()
    for step, tensors in enumerate(expected):
        path = tmp_path / f"step{step}" / "state.safetensors"
        assert data_start(path) == 4096
        loaded = fastckpt.load_file(path)
        assert all(torch.equal(loaded[k], v) for k, v in tensors.items()), step
    assert manager._images.allocations == 1
