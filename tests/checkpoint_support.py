"""Checkpoints for the reliability, verify and store tests: a small model trained a few steps,
saved as two indices of a root and as two CheckpointManager checkpoints, and the helpers that
damage them and check what was detected."""

from __future__ import annotations

import contextlib
import copy
import shutil
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from fastckpt import (
    CheckpointManager,
    create_model_spec,
    load_checkpoint,
    save_checkpoint,
)
from fastckpt.container.verify import VerifyReport
from fastckpt.errors import (
    FastCkptError,
)
from fastckpt.format.records import Manifest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import crash_harness

TYPED = (FastCkptError, OSError)


class Net(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.width = width
        self.a = nn.Linear(width, 16)
        self.b = nn.Linear(16, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


Trained = tuple[Net, torch.optim.Optimizer, Any]


def trained(seed: int, steps: int = 3) -> Trained:
    torch.manual_seed(seed)
    model = Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(4, 8)).square().mean().backward()
        optimizer.step()
        scheduler.step()
    return model, optimizer, scheduler


def save(root: Path, state: Trained) -> int:
    model, optimizer, scheduler = state
    return save_checkpoint(
        root,
        models={"main": (model, create_model_spec(Net, width=8))},
        optimizers={"adam": (optimizer, None)},
        schedulers={"sched": (scheduler, None)},
        counters={"step": 3},
    )


def states(state: Trained) -> dict[str, Any]:
    model, optimizer, scheduler = state
    return {
        "main": copy.deepcopy(model.state_dict()),
        "adam": copy.deepcopy(optimizer.state_dict()),
        "sched": copy.deepcopy(scheduler.state_dict()),
    }


def loaded_states(result: dict[str, Any]) -> dict[str, Any]:
    main = result["models"]["main"]
    return {
        "main": main["model"].state_dict(),
        "adam": main["optimizers"]["adam"]["optimizer"].state_dict(),
        "sched": main["schedulers"]["sched"]["scheduler"].state_dict(),
    }


@dataclass
class Saved:
    root: Path
    expected: dict[int, dict[str, Any]]
    manager_dirs: dict[str, Path]
    manager_expected: dict[str, dict[str, Any]]

    def files(self, index: int) -> list[str]:
        return sorted(Manifest.load(self.root).entries[index]["files"])


def manager_state(state: Trained) -> dict[str, Any]:
    model, optimizer, _ = state
    return {"model": model.state_dict(), "optim": optimizer.state_dict(), "meta": {"step": 3}}


@pytest.fixture
def saved(tmp_path: Path) -> Saved:
    root = tmp_path / "root"
    first, second = trained(1), trained(2)
    assert save(root, first) == 0
    assert save(root, second) == 1
    dirs = {"a": tmp_path / "mgr" / "a", "b": tmp_path / "mgr" / "b"}
    with CheckpointManager(CheckpointManager.Config.with_sync_save()) as writer:
        writer.save(dirs["a"], manager_state(first))
        writer.save(dirs["b"], manager_state(second))
    return Saved(
        root,
        {0: states(first), 1: states(second)},
        dirs,
        {"a": copy.deepcopy(manager_state(first)), "b": copy.deepcopy(manager_state(second))},
    )


def mload(directory: Path) -> dict[str, Any]:
    with CheckpointManager(CheckpointManager.Config.with_sync_save()) as reader:
        return reader.load(directory)


def assert_same(expected: Any, actual: Any) -> None:
    found = crash_harness.difference(expected, actual)
    assert found is None, found


def assert_intact(saved: Saved, index: int) -> None:
    assert_same(saved.expected[index], loaded_states(load_checkpoint(saved.root, index)))


def detected(load: Callable[[], Any], *names: str) -> BaseException:
    """``load`` must raise a typed error whose message names every one of ``names``."""
    try:
        load()
    except TYPED as err:
        for name in names:
            assert name in str(err), f"{name!r} not named in: {err!r}"
        return err
    raise AssertionError("damaged checkpoint loaded without an error")


def only_failure(report: VerifyReport, path: Path, status: str | None = None) -> None:
    assert [f.path for f in report.failures] == [path], report.summary()
    if status is not None:
        assert report.failures[0].status == status, report.summary()


@contextlib.contextmanager
def altered(path: Path, data: bytes) -> Iterator[None]:
    original = path.read_bytes()
    path.write_bytes(data)
    try:
        yield
    finally:
        path.write_bytes(original)


def flip(data: bytes, position: int, bit: int) -> bytes:
    changed = bytearray(data)
    changed[position] ^= 1 << bit
    return bytes(changed)


def symlink_outside(path: Path, outside: Path) -> None:
    outside.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(path, outside)  # identical bytes: only the location is wrong
    path.unlink()
    path.symlink_to(outside)
