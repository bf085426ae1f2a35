"""How many threads a load reads with: one per CPU the process may use, within bounds (the
copy out of the page cache and the crc32c pass are bound by a core's speed)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import fastckpt
from fastckpt import _native
from fastckpt.io import headers


@pytest.mark.parametrize(("cpus", "threads"), [(1, 4), (2, 4), (6, 6), (8, 8), (64, 8)])
def test_load_threads_follow_the_cpus_this_process_may_use(
    monkeypatch: pytest.MonkeyPatch, cpus: int, threads: int
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)))
    assert headers.load_threads() == threads


def test_a_load_reads_with_load_threads_when_none_are_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = torch.nn.Linear(3, 2)
    fastckpt.save_checkpoint(tmp_path / "root", models={"main": (model, None)})
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(7)))
    used: list[int] = []
    real = _native.read_into

    def spy(path: str, tensors: object, threads: int, **kwargs: object) -> int:
        used.append(threads)
        return real(path, tensors, threads, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(_native, "read_into", spy)
    loaded = fastckpt.load_checkpoint(tmp_path / "root")["models"]["main"]["model"]
    assert torch.equal(loaded.weight, model.weight)
    assert used and set(used) == {7}
