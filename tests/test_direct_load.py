"""load_checkpoint reads a plain model's weights straight into its parameters, leaving them
uninitialized until then (fastckpt.checkpoint.fill): every model that is not provably plain
keeps a real build and load_state_dict, and what either way loads is the saved state."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from torch import nn

from checkpoint_support import flip
from fastckpt.checkpoint.api import load_checkpoint, save_checkpoint
from fastckpt.checkpoint.fill import direct_targets, fully_restored_by
from fastckpt.errors import ChecksumMismatchError
from fastckpt.io.headers import read_metadata


class Counted(nn.Module):
    """Counts real (non-meta) constructions."""

    built: ClassVar[int] = 0

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.norm = nn.BatchNorm1d(width)
        if self.linear.weight.device.type != "meta":
            type(self).built += 1


class WithTable(nn.Module):
    """A non-persistent buffer: not in the checkpoint, so its constructor must run."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.register_buffer("table", torch.arange(width, dtype=torch.float32) * 3 + 1, False)


class WithScale(nn.Module):
    """A tensor in a plain attribute (neither parameter nor buffer)."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.scale = torch.tensor(2.5)


class Doubling(nn.Module):
    """A load_state_dict pre-hook that changes what is loaded: it must run."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self._register_load_state_dict_pre_hook(self._double)

    def _double(self, state: dict[str, Any], prefix: str, *args: Any) -> None:
        state[prefix + "linear.weight"] = state[prefix + "linear.weight"] * 2


class Tied(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.encode = nn.Linear(width, width, bias=False)
        self.decode = nn.Linear(width, width, bias=False)
        self.decode.weight = self.encode.weight


def _saved(root: Path, model: nn.Module) -> nn.Module:
    with torch.no_grad():
        for tensor in model.state_dict().values():
            if tensor.is_floating_point():
                tensor.copy_(torch.randn(tensor.shape))
    save_checkpoint(root, models={"m": (model, None)})
    loaded = load_checkpoint(root)["models"]["m"]["model"]
    assert isinstance(loaded, type(model))
    return loaded


def _same_state(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_a_plain_model_is_not_built_again_and_loads_bitwise(tmp_path: Path) -> None:
    model = Counted()
    model.norm.num_batches_tracked.fill_(7)
    Counted.built = 0
    loaded = _saved(tmp_path, model)
    assert Counted.built == 0  # only the meta build ran
    assert _same_state(model, loaded)
    assert int(loaded.norm.num_batches_tracked) == 7
    assert all(p.device.type == "cpu" for p in loaded.parameters())
    header = read_metadata(tmp_path / "0" / "models" / "m.safetensors")["tensors"]
    targets = direct_targets(loaded, header)
    assert targets is not None and set(targets) == set(header)


def test_a_non_persistent_buffer_is_built_for_real(tmp_path: Path) -> None:
    model = WithTable()
    loaded = _saved(tmp_path, model)
    assert torch.equal(loaded.table, torch.arange(8, dtype=torch.float32) * 3 + 1)
    assert _same_state(model, loaded)
    assert not fully_restored_by(WithTable(), model.state_dict())


def test_a_tensor_attribute_is_built_for_real(tmp_path: Path) -> None:
    loaded = _saved(tmp_path, WithScale())
    assert loaded.scale.device.type == "cpu" and float(loaded.scale) == 2.5


def test_a_load_state_dict_hook_still_runs(tmp_path: Path) -> None:
    model = Doubling()
    loaded = _saved(tmp_path, model)
    assert torch.equal(loaded.linear.weight, model.linear.weight * 2)
    assert torch.equal(loaded.linear.bias, model.linear.bias)
    header = read_metadata(tmp_path / "0" / "models" / "m.safetensors")["tensors"]
    assert direct_targets(loaded, header) is None


def test_tied_weights_stay_tied(tmp_path: Path) -> None:
    model = Tied()
    loaded = _saved(tmp_path, model)
    assert loaded.decode.weight is loaded.encode.weight
    assert _same_state(model, loaded)


def test_a_damaged_optimizer_file_read_directly_is_a_checksum_error(tmp_path: Path) -> None:
    model = nn.Linear(32, 32)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 32)).sum().backward()
    optimizer.step()
    save_checkpoint(tmp_path, models={"m": (model, None)}, optimizers={"o": (optimizer, None)})
    loaded = load_checkpoint(tmp_path)["models"]["m"]["optimizers"]["o"]["optimizer"]
    for key, value in optimizer.state_dict()["state"][0].items():
        assert torch.equal(loaded.state_dict()["state"][0][key], value), key
    path = tmp_path / "0" / "optimizers" / "o.safetensors"
    path.write_bytes(flip(path.read_bytes(), path.stat().st_size - 3, 0))
    with pytest.raises(ChecksumMismatchError, match=r"o\.safetensors"):
        load_checkpoint(tmp_path)


class KeepsDevice(nn.Module):
    """Takes ``device`` and keeps it, inside a config, for its forward: built with
    device="meta" on the meta device, so the meta-built model must not be the one returned."""

    def __init__(self, width: int = 8, device: Any = None) -> None:
        super().__init__()
        self.config = {"device": device}
        self.linear = nn.Linear(width, width, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + torch.ones(x.shape[-1], device=self.config["device"])


def test_a_model_that_takes_device_and_keeps_it_is_built_for_real(tmp_path: Path) -> None:
    model = KeepsDevice()
    save_checkpoint(tmp_path, models={"m": (model, None)})
    loaded = load_checkpoint(tmp_path, map_location="cpu")["models"]["m"]["model"]
    assert loaded.config["device"] == torch.device("cpu")
    x = torch.ones(2, 8)
    assert torch.equal(loaded(x), model.linear(x) + 1)


class ListTables(nn.Module):
    """A tensor in a list attribute: neither parameter nor buffer, so the load leaves it."""

    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.tables = [torch.arange(width, dtype=torch.float32)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + self.tables[0]


class NestedTables(nn.Module):
    """A tensor deep in nested containers, and a module kept outside the module tree."""

    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.config = {"scales": ({"first": [torch.full((width,), 2.0)]},), "width": width}
        self.helpers = [nn.Linear(width, width)]  # not registered: not in the state dict


class PlainContainers(nn.Module):
    """Containers without tensors (a cycle, a reference to a submodule): still plain."""

    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.sizes = [width, {"pair": (1, 2.5), "names": {"a", "b"}}]
        self.loop: list[Any] = []
        self.loop.append(self.loop)
        self.peers = [self.linear]


def test_a_tensor_inside_a_container_attribute_is_built_for_real(tmp_path: Path) -> None:
    """A tensor (or a module outside the tree) kept in a list, tuple or dict attribute, at
    any depth, takes the real build: the loaded model holds it on the CPU, as a real build
    does (before: it came back on the meta device and the forward failed)."""
    torch.manual_seed(0)
    model = ListTables()
    assert not fully_restored_by(model, model.state_dict())
    loaded = _saved(tmp_path / "list", model)
    assert isinstance(loaded, ListTables)
    assert loaded.tables[0].device.type == "cpu"
    assert torch.equal(loaded.tables[0], ListTables().tables[0])
    x = torch.randn(2, 4)
    assert torch.equal(loaded(x), model(x))

    nested = NestedTables()
    assert not fully_restored_by(nested, nested.state_dict())
    loaded_nested = _saved(tmp_path / "nested", nested)
    assert isinstance(loaded_nested, NestedTables)
    (scales,) = loaded_nested.config["scales"]
    assert scales["first"][0].device.type == "cpu"
    assert torch.equal(scales["first"][0], torch.full((4,), 2.0))
    assert all(p.device.type == "cpu" for p in loaded_nested.helpers[0].parameters())
    assert _same_state(nested, loaded_nested)

    plain = PlainContainers()
    assert fully_restored_by(plain, plain.state_dict())
