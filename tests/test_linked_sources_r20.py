"""An incremental save links an earlier index's file only once its bytes are proven.

Before, ``save_checkpoint`` hard-linked the earlier file holding unchanged tensors after
checking its size and the crc32c values in its header only: a file changed in place
(``dd conv=notrunc``, a byte flipped on disk) kept both, was linked into every later index,
and every save returned success while no checkpoint of the run loaded any more (the live
model held the intact weights all along). Now the linked inode is read back (size, crc32c)
unless this process wrote or read it in full and its size and modification time have not
moved since; a file found damaged is never linked: its tensors are written from memory.
"""

from __future__ import annotations

import logging
import os
import struct
import time
from pathlib import Path

import pytest
import torch

import fastckpt


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    model[0].requires_grad_(False)
    return model


def _save(root: Path, model: torch.nn.Module) -> None:
    with torch.no_grad():
        model[1].weight.add_(1.0)  # the trained layer changes, the frozen one does not
    fastckpt.save_checkpoint(root, models={"m": (model, None)})


def _flip_data_byte(path: Path) -> None:
    """Change one byte of the data section in place (same inode, same size, same header)."""
    time.sleep(0.02)  # past the filesystem's timestamp granularity
    with open(path, "r+b") as handle:
        header_len = struct.unpack("<Q", handle.read(8))[0]
        handle.seek(8 + header_len + 100)
        byte = handle.read(1)
        handle.seek(8 + header_len + 100)
        handle.write(bytes([byte[0] ^ 0x55]))
        handle.flush()
        os.fsync(handle.fileno())


def _loads_bitwise(root: Path, model: torch.nn.Module) -> None:
    loaded = fastckpt.load_checkpoint(root)["models"]["m"]["model"].state_dict()
    want = model.state_dict()
    assert all(torch.equal(loaded[k], want[k]) for k in want)


def test_a_file_changed_in_place_is_not_linked_into_the_next_index(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "root"
    model = _model()
    _save(root, model)
    _save(root, model)
    first = root / "0" / "models" / "m.safetensors"
    assert os.stat(first).st_nlink == 2  # index 1 links it (the frozen layer)
    _flip_data_byte(first)
    assert not fastckpt.verify(root, 1).ok  # the shared damage shows in both indices
    with caplog.at_level(logging.WARNING, logger="fastckpt"):
        _save(root, model)
    assert "changed in place or damaged" in caplog.text and str(root) in caplog.text
    assert fastckpt.verify(root, 2).ok
    _loads_bitwise(root, model)
    assert os.stat(first).st_nlink == 2  # not linked into index 2
    _save(root, model)  # the next save links index 2's intact copy again
    assert fastckpt.verify(root, 3).ok
    _loads_bitwise(root, model)


def test_an_intact_file_is_linked_without_a_copy(tmp_path: Path) -> None:
    root = tmp_path / "root"
    model = _model()
    for _ in range(3):
        _save(root, model)
    first = root / "0" / "models" / "m.safetensors"
    assert os.stat(first).st_nlink == 3  # indices 1 and 2 hold the very inode
    _loads_bitwise(root, model)


def test_a_file_changed_while_a_save_runs_is_read_back_by_the_next_save(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review 1 of the first version: ``publish`` recorded every file of the index as proven
    as it then was, so a change to the linked file between its proof and the publish (the
    write of the rest of the index) was never read again: every later save linked it."""
    from fastckpt.storage.backend import LocalStaging

    root = tmp_path / "root"
    model = _model()
    _save(root, model)
    _save(root, model)
    first = root / "0" / "models" / "m.safetensors"
    real_publish = LocalStaging.publish

    def publish_after_a_change(staging: LocalStaging) -> None:
        if staging.final.name == "2":
            _flip_data_byte(first)  # a `dd conv=notrunc` while save 2 writes its files
        real_publish(staging)

    monkeypatch.setattr(LocalStaging, "publish", publish_after_a_change)
    _save(root, model)  # index 2 shares the changed inode: damaged with it
    monkeypatch.undo()
    assert not fastckpt.verify(root, 2).ok
    with caplog.at_level(logging.WARNING, logger="fastckpt"):
        _save(root, model)
    assert "changed in place or damaged" in caplog.text
    assert fastckpt.verify(root, 3).ok
    _loads_bitwise(root, model)
    _save(root, model)
    assert fastckpt.verify(root, 4).ok
