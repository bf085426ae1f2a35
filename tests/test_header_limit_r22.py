"""A file whose header would exceed what safetensors readers accept (100,000,000 bytes) is
refused naming the file it was for, and nothing already saved is touched.

Before, the refusal named no file, item or object ("the header (tensor names, shapes and
metadata) would take N bytes ...") and advised only about metadata the caller never gave:
a checkpoint of many tensors with long names could not tell which item to split.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import fastckpt
from fastckpt.errors import InvalidInputError
from s3_support import s3_env, s3_root, s3_server

__all__ = ["s3_env", "s3_root", "s3_server"]  # fixtures used by name below

LIMIT = "over the 100000000 bytes safetensors readers accept"


def _too_many_names() -> dict[str, torch.Tensor]:
    """200 one-element tensors whose names (300 kB each) make a 120 MB header."""
    return {f"t{i:03d}" + "x" * 300_000: torch.zeros(1) for i in range(200)}


def _fix_named(message: str) -> None:
    assert LIMIT in message, message
    assert "200 tensor names" in message and "split the tensors across files" in message


def test_save_file_names_the_file_and_leaves_the_one_there(tmp_path: Path) -> None:
    path = tmp_path / "weights.safetensors"
    fastckpt.save_file({"w": torch.ones(3)}, path)
    with pytest.raises(InvalidInputError) as info:
        fastckpt.save_file(_too_many_names(), path)
    assert str(info.value).startswith(f"{path}: the header"), info.value
    _fix_named(str(info.value))
    assert fastckpt.load_file(path)["w"].eq(1).all()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["weights.safetensors"]


def test_a_manager_save_names_the_items_file_not_its_staging_folder(tmp_path: Path) -> None:
    with fastckpt.CheckpointManager(fastckpt.CheckpointManager.Config.with_sync_save()) as manager:
        manager.save(tmp_path / "a", {"small": {"w": torch.ones(2)}})
        with pytest.raises(InvalidInputError) as info:
            manager.save(tmp_path / "a", {"small": {"w": torch.zeros(2)}, "big": _too_many_names()})
        message = str(info.value)
        assert message.startswith(f"{tmp_path / 'a' / 'big.safetensors'}: the header"), message
        assert ".tmp-" not in message
        _fix_named(message)
        assert manager.load(tmp_path / "a")["small"]["w"].eq(1).all()  # the saved one stays


class _LongNames(torch.nn.Module):
    """A model whose parameters have the names of :func:`_too_many_names`."""

    def __init__(self) -> None:
        super().__init__()
        for name, tensor in _too_many_names().items():
            self.register_parameter(name, torch.nn.Parameter(tensor))


def test_a_root_save_names_the_file_of_the_model(tmp_path: Path) -> None:
    root = tmp_path / "root"
    fastckpt.save_checkpoint(root, models={"main": torch.nn.Linear(2, 2)})
    with pytest.raises(InvalidInputError) as info:
        fastckpt.save_checkpoint(root, models={"main": _LongNames()})
    message = str(info.value)
    assert message.startswith(f"{root / '1' / 'models' / 'main.safetensors'}: "), message
    _fix_named(message)
    assert [c["index"] for c in fastckpt.list_checkpoints(root)] == [0]


def test_an_s3_save_names_the_object(s3_root: str, s3_env: dict[str, str]) -> None:
    config = fastckpt.CheckpointManager.Config.with_sync_save()
    with fastckpt.CheckpointManager(config) as manager, pytest.raises(InvalidInputError) as info:
        manager.save(f"{s3_root}/a", {"big": _too_many_names()})
    message = str(info.value)
    assert message.startswith(f"{s3_root}/a/"), message
    assert "big.safetensors: the header" in message, message
    _fix_named(message)
