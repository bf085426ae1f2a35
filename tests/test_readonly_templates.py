"""A load into a template whose memory cannot be written (a read-only file mapping).

Before, ``CheckpointManager.load(into=)`` with such a template raised the kernel's bare
``OSError: [Errno 14] Bad address`` naming only the checkpoint's file, which reads as damage
to the checkpoint. Now it is an ``InvalidInputError`` naming the file, the item's key and the
fix; the checkpoint is untouched and loads into a writable template.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import fastckpt


def _read_only_tensor(path: Path, count: int) -> torch.Tensor:
    np.zeros(count, dtype=np.float32).tofile(path)
    mapped = np.memmap(path, dtype=np.float32, mode="r")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that the array is not writable
        return torch.from_numpy(mapped)


def test_a_read_only_template_is_named_and_the_checkpoint_stays_loadable(tmp_path: Path) -> None:
    saved = torch.arange(1 << 18, dtype=torch.float32)
    with fastckpt.CheckpointManager() as manager:
        manager.save(tmp_path / "ckpt", {"model": {"weight": saved}, "step": 3})
        template = _read_only_tensor(tmp_path / "raw.bin", saved.numel())
        with pytest.raises(fastckpt.InvalidInputError) as caught:
            manager.load(tmp_path / "ckpt", into={"model": {"weight": template}})
        message = str(caught.value)
        assert "'model.weight'" in message and "cannot be written" in message
        assert "model.safetensors" in message or "ckpt" in message
        assert not isinstance(caught.value, OSError)

        writable = torch.zeros_like(saved)
        restored = manager.load(tmp_path / "ckpt", into={"model": {"weight": writable}})
    assert restored["model"]["weight"] is writable and torch.equal(writable, saved)
    assert fastckpt.verify(tmp_path / "ckpt").ok
