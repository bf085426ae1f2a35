"""The writer-thread settings reach async saves too.

Before, an async save (the manager's default, ``AsyncFastCheckpointIO``) wrote its staged
file image with one writing and one hashing thread whatever
``CheckpointWriterConfig.file_write_max_threads`` or ``threads=`` said: the setting was
accepted and ignored there (sync saves followed it). The image writer now runs that many
threads in all (``threads - 1`` writing chunks, one hashing; one thread writes, then hashes);
the Rust unit test ``an_image_writes_the_same_tensors_as_write_file`` checks the bytes for 1,
2 and 5 threads, and these tests that the settings arrive there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import fastckpt
from fastckpt import _native
from fastckpt.integrations.lightning import AsyncFastCheckpointIO
from fastckpt.manager import (
    AsyncCheckpointSaverConfig,
    CheckpointWriterConfig,
    LocalFileSystemStorageConfig,
)


@pytest.fixture
def image_threads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The ``threads`` of every file image written (a spy on the native writer)."""
    seen: list[int] = []
    real = _native.write_image

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs.get("threads", args[10] if len(args) > 10 else -1))
        return real(*args, **kwargs)

    monkeypatch.setattr(_native, "write_image", spy)
    return seen


STATE = {f"t{i}": torch.arange(1 << 16, dtype=torch.float32) + i for i in range(2)}


@pytest.mark.parametrize("threads", [1, 5])
def test_an_async_manager_writes_with_its_configured_threads(
    tmp_path: Path, image_threads: list[int], threads: int
) -> None:
    config = fastckpt.CheckpointManager.Config(
        save=AsyncCheckpointSaverConfig(
            writer_config=CheckpointWriterConfig(file_write_max_threads=threads)
        ),
        incremental=False,
        storage_config=LocalFileSystemStorageConfig(use_direct_io=True),
    )
    with fastckpt.CheckpointManager(config) as manager:
        future = manager.save(tmp_path / "a", {"m": STATE})
        assert future is not None
        future.result()
        loaded = manager.load(tmp_path / "a")
    assert image_threads and set(image_threads) == {threads}
    assert all(torch.equal(loaded["m"][k], v) for k, v in STATE.items())


def test_the_lightning_async_plugin_writes_with_its_threads(
    tmp_path: Path, image_threads: list[int]
) -> None:
    plugin = AsyncFastCheckpointIO(threads=3, direct_io=True)
    try:
        plugin.save_checkpoint({"state_dict": STATE, "epoch": 0}, tmp_path / "a.ckpt")
        plugin.wait()
    finally:
        plugin.teardown()
    assert image_threads and set(image_threads) == {3}
