"""How many threads a load reads with: one per CPU the process may use, within bounds (the
copy out of the page cache and the crc32c pass are bound by a core's speed)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

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


def test_a_load_marks_only_the_memory_it_allocated_as_fresh(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fresh memory (allocated by the load, a model rebuilt in uninitialized memory included)
    has its pages mapped in one call per piece before it is read into; a template's memory,
    in use already, is not walked again (that cost 3.5-5.6 ms per 257 MiB for nothing).
    Either way the bytes are the saved ones."""
    model = torch.nn.Linear(8, 4)
    fastckpt.save_checkpoint(tmp_path / "root", models={"main": (model, None)})
    calls: list[tuple[set[str], set[str]]] = []
    real = _native.read_into

    def spy(path: str, tensors: Any, threads: int, **kwargs: Any) -> int:
        calls.append(({t[0] for t in tensors}, set(kwargs.get("fresh") or ())))
        return real(path, tensors, threads, **kwargs)

    monkeypatch.setattr(_native, "read_into", spy)
    loaded = fastckpt.load_checkpoint(tmp_path / "root")["models"]["main"]["model"]
    assert torch.equal(loaded.weight, model.weight) and torch.equal(loaded.bias, model.bias)
    # The model is rebuilt in uninitialized memory and read straight into: fresh too.
    assert ({"weight", "bias"}, {"weight", "bias"}) in calls, calls
    live = torch.nn.Linear(8, 4)
    with fastckpt.CheckpointManager(fastckpt.CheckpointManager.Config.with_sync_save()) as mgr:
        mgr.save(tmp_path / "ids" / "a", {"w": model.weight.detach(), "b": model.bias.detach()})
        calls.clear()
        # "b" a strided view: not read into directly (fresh memory, then copied into it)
        into = {"w": live.weight.detach(), "b": torch.zeros(8)[::2]}
        got = mgr.load(tmp_path / "ids" / "a", into=into)
    assert torch.equal(got["w"], model.weight) and got["w"] is into["w"]
    assert torch.equal(got["b"], model.bias)
    (names, fresh), *_ = calls
    assert fresh == {name for name in names if name.endswith("b")}, calls
