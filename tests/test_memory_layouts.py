"""A model converted after construction to another memory layout (``channels_last``) is
rebuilt in that layout, so a resumed run continues the saved one bit for bit.

Before, a rebuilt model came back in its constructor's contiguous layout: convolutions then
ran other kernels, whose results differ in the last bits (1.5e-8 on a conv weight after four
more steps), and a run resumed from a checkpoint did not match the uninterrupted one.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import fastckpt
from fastckpt.checkpoint.layouts import apply_strides, recorded_strides
from fastckpt.errors import CheckpointFormatError
from fastckpt.format.records import seal_manifest


class MixedConvs(torch.nn.Module):
    """A 1x1 conv, a depthwise conv and a 3x3 conv: channels_last weights of the first two
    are what torch calls contiguous (size-1 dimensions), with other strides."""

    def __init__(self) -> None:
        super().__init__()
        self.pointwise = torch.nn.Conv2d(3, 8, 1)
        self.depthwise = torch.nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.conv = torch.nn.Conv2d(8, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(self.depthwise(self.pointwise(x)))


class Wrapped(torch.nn.Module):
    """A conv block wrapped in activation checkpointing (a wrapper segment in its names)."""

    def __init__(self) -> None:
        super().__init__()
        self.block = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3))
        self.head = torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x).mean((2, 3)))


class SparseMask(torch.nn.Module):
    """A linear layer with a sparse CSR mask buffer (which no checkpoint stores)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.register_buffer("mask", torch.eye(3).to_sparse_csr())


class ConvNet(torch.nn.Module):
    """Two convolutions and a head, small enough for a test."""

    def __init__(self, channels: int = 8) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, channels, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(channels, channels, 3, padding=1)
        self.head = torch.nn.Linear(channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.conv2(torch.relu(self.conv(x))))
        return self.head(hidden.mean((2, 3)))


def conv_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).square().mean()


def _batches(count: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(4, 3, 16, 16, generator=generator) for _ in range(count)]


def _strategy(num_steps: int, hooks: list[object]) -> fastckpt.TrainingStrategy:
    torch.manual_seed(0)
    model = ConvNet().to(memory_format=torch.channels_last)
    return fastckpt.TrainingStrategy(
        model,
        fastckpt.OptimizerConfig(torch.optim.Adam, {"lr": 0.01}),
        training_fn=conv_loss,
        hooks=hooks,
        num_steps=num_steps,
    )


@pytest.mark.parametrize("async_save", [False, True])
def test_a_channels_last_run_resumes_in_its_layout_bit_for_bit(
    tmp_path: Path, async_save: bool
) -> None:
    batches = _batches(8)
    uninterrupted = _strategy(8, [])
    uninterrupted.run(batches)

    first_half = _strategy(
        4, [fastckpt.CheckpointHook(tmp_path, step_interval=4, async_save=async_save)]
    )
    first_half.run(batches)  # stops after 4 steps, mid-epoch
    resumed = fastckpt.TrainingStrategy.load_checkpoint(tmp_path, training_fn=conv_loss)
    weight = resumed.models["main"].conv2.weight
    assert weight.is_contiguous(memory_format=torch.channels_last) and not weight.is_contiguous()
    assert isinstance(weight, torch.nn.Parameter) and weight.requires_grad
    resumed.num_steps = 8
    resumed.run(batches)

    expected = dict(uninterrupted.models["main"].named_parameters())
    for name, parameter in resumed.models["main"].named_parameters():
        assert torch.equal(parameter, expected[name]), name


def test_load_checkpoint_rebuilds_the_saved_layouts(tmp_path: Path) -> None:
    model = ConvNet().to(memory_format=torch.channels_last)
    recorded = recorded_strides(model)
    assert set(recorded) == {"conv.weight", "conv2.weight"}

    fastckpt.save_checkpoint(tmp_path, models={"main": model}, incremental=False)
    entry = json.loads((tmp_path / "manifest.json").read_text())["checkpoints"]["0"]
    assert entry["strides"]["main"] == recorded
    rebuilt = fastckpt.load_checkpoint(tmp_path, trusted=[ConvNet])["models"]["main"]["model"]
    for name, tensor in model.state_dict().items():
        loaded = rebuilt.state_dict()[name]
        assert torch.equal(loaded, tensor), name
        assert loaded.stride() == tensor.stride(), name


def test_pointwise_and_depthwise_channels_last_weights_keep_their_layout(tmp_path: Path) -> None:
    """Review of the first version: it recorded only tensors torch calls non-contiguous, so
    1x1 and depthwise channels_last weights (size-1 dimensions) came back in other strides,
    and the rebuilt model's output differed from the saved one's."""
    torch.manual_seed(0)
    model = MixedConvs().to(memory_format=torch.channels_last)
    fastckpt.save_checkpoint(tmp_path, models={"main": model}, incremental=False)
    rebuilt = fastckpt.load_checkpoint(tmp_path, trusted=[MixedConvs])["models"]["main"]["model"]
    for name, tensor in model.state_dict().items():
        assert rebuilt.state_dict()[name].stride() == tensor.stride(), name
    batch = torch.randn(2, 3, 8, 8)
    assert torch.equal(rebuilt(batch), model(batch))


def test_a_wrapped_submodules_layout_is_recorded_by_the_name_the_rebuild_has(
    tmp_path: Path,
) -> None:
    """Review of the first version: strides were recorded under names with wrapper segments
    (``block._checkpoint_wrapped_module.0.weight``), which the rebuilt model does not have:
    the committed checkpoint could never be loaded ("names ..., which the model does not
    have")."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = Wrapped().to(memory_format=torch.channels_last)
    model.block = checkpoint_wrapper(model.block)
    fastckpt.save_checkpoint(tmp_path, models={"main": model}, incremental=False)
    entry = json.loads((tmp_path / "manifest.json").read_text())["checkpoints"]["0"]
    assert set(entry["strides"]["main"]) == {"block.0.weight"}
    rebuilt = fastckpt.load_checkpoint(tmp_path, trusted=[Wrapped])["models"]["main"]["model"]
    assert rebuilt.block[0].weight.stride() == model.block[0].weight.stride()


def test_only_dense_layouts_other_than_contiguous_are_recorded() -> None:
    module = torch.nn.Module()
    module.transposed = torch.nn.Parameter(torch.randn(3, 5).t())  # dense: recorded
    module.register_buffer("spread", torch.zeros(4, 1).expand(4, 6))  # stride 0: not dense
    module.register_buffer("stepped", torch.zeros(4, 6)[:, ::2])  # gaps: not dense
    module.register_buffer("plain", torch.zeros(4, 6))  # contiguous: the constructor's
    assert recorded_strides(module) == {"transposed": [1, 5]}


def test_a_recorded_layout_that_is_no_dense_layout_of_its_tensor_is_refused(
    tmp_path: Path,
) -> None:
    """A hostile (re-sealed) manifest asking for strides that would reach past the tensor's
    elements is refused naming the record, before memory is allocated for it."""
    model = ConvNet().to(memory_format=torch.channels_last)
    fastckpt.save_checkpoint(tmp_path, models={"main": model}, incremental=False)
    manifest = tmp_path / "manifest.json"
    bad = ([1 << 40, 1, 1, 1], [72, 1, 24], "channels_last", [1 << 70, 1, 24, 8], [-72, 1, 24, 8])
    for strides in bad:
        document = json.loads(manifest.read_text())
        document["checkpoints"]["0"]["strides"]["main"]["conv.weight"] = strides
        seal_manifest(document)
        manifest.write_text(json.dumps(document))
        with pytest.raises(CheckpointFormatError, match=r"strides.main.conv.weight"):
            fastckpt.load_checkpoint(tmp_path, trusted=[ConvNet])


def test_a_huge_stride_on_a_size_one_dimension_is_refused() -> None:
    """Review of the first version: a size-1 dimension's stride was not checked, so an edited
    stride of 2**63 reached torch.empty_strided as a bare TypeError, 2**63-1 was applied."""
    conv = torch.nn.Conv2d(3, 8, 1)
    for stride in ([3, 1, (1 << 63) - 1, 3], [3, 1, 1 << 63, 3]):
        with pytest.raises(CheckpointFormatError, match="no dense layout"):
            apply_strides(conv, {"weight": stride}, "manifest.json: strides.main")
    apply_strides(conv, {"weight": [3, 1, 3, 3]}, "manifest.json: strides.main")
    assert conv.weight.stride() == (3, 1, 3, 3)


def test_a_sparse_buffer_is_refused_by_the_save_not_by_the_layout_record(tmp_path: Path) -> None:
    """Review 3: the layout record's fast path asked a sparse CSR buffer is_contiguous(),
    which torch refuses with a bare RuntimeError, before the save's typed refusal."""
    model = SparseMask()
    with pytest.raises(fastckpt.InvalidInputError, match="sparse_csr"):
        fastckpt.save_checkpoint(tmp_path / "run", models={"main": (model, None)})
