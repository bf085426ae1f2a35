"""The training-loop scenario: step throughput with and without periodic async checkpoints.

A small MLP is trained with AdamW on fixed random data for ``steps`` steps; every ``every``
steps (not at the last step) its weights and Adam moments are checkpointed asynchronously. If
the previous checkpoint is still in flight at the next one, the loop waits for it (that wait
counts as stall, as it would in training). With fastckpt, the optimizer step runs under
``CheckpointManager.lock()`` as the manager requires (it blocks while a snapshot is being
captured; that wait is recorded as ``lock_wait_seconds``). The clock runs from the first timed
step until the last checkpoint is durable, so an async writer cannot hide its tail after the
loop.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fastckpt.bench.writers import WriterUnavailable, open_async_manager, remove_path

__all__ = ["SCENARIOS", "TrainingConfig", "run_training"]

#: Scenarios in the order they run within a repetition.
SCENARIOS = ("none", "fastckpt-async", "dcp-async")


@dataclass(frozen=True)
class TrainingConfig:
    """Size of the training-loop scenario.

    Attributes:
        steps: timed optimizer steps per run.
        every: checkpoint every this many steps.
        hidden: MLP width.
        layers: hidden layers of the MLP.
        batch: rows per step.
        warmup: untimed steps before the clock starts (creates the Adam moments).
    """

    steps: int = 60
    every: int = 15
    hidden: int = 2048
    layers: int = 4
    batch: int = 64
    warmup: int = 2

    def as_dict(self) -> dict[str, Any]:
        """The config as plain JSON values."""
        return asdict(self)


def _model(config: TrainingConfig) -> nn.Module:
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for _ in range(config.layers):
        blocks += [nn.Linear(config.hidden, config.hidden), nn.GELU()]
    blocks.append(nn.Linear(config.hidden, 1))
    return nn.Sequential(*blocks)


def _flat_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        state[f"model.{name}"] = param.detach()
        moments = optimizer.state.get(param, {})
        for key in ("exp_avg", "exp_avg_sq"):
            if key in moments:
                state[f"optim.{name}.{key}"] = moments[key]
    return state


Checkpointer = Callable[[dict[str, torch.Tensor], Path], "Future[Any]"]


Guard = Callable[[], AbstractContextManager[Any]]


def _dcp_checkpointer() -> tuple[Checkpointer, Callable[[], None], Guard]:
    try:
        import torch.distributed.checkpoint as dcp
    except ImportError as err:
        raise WriterUnavailable(f"torch.distributed.checkpoint: {err}") from err

    def save(state: dict[str, torch.Tensor], path: Path) -> Future[Any]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            response: Any = dcp.async_save(
                state, storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True
            )
        future: Future[Any] = getattr(response, "upload_completion", response)
        return future

    return save, lambda: None, nullcontext


def _fastckpt_checkpointer() -> tuple[Checkpointer, Callable[[], None], Guard]:
    manager = open_async_manager()

    def save(state: dict[str, torch.Tensor], path: Path) -> Future[Any]:
        future: Future[Any] = manager.save(str(path), {"state": state})
        return future

    guard: Guard = getattr(manager, "lock", nullcontext)
    return save, manager.close, guard


def run_training(scenario: str, config: TrainingConfig, directory: Path) -> dict[str, Any]:
    """Run one scenario (``"none"``, ``"fastckpt-async"`` or ``"dcp-async"``) once.

    Returns:
        ``{"available", "reason", "seconds", "steps_per_s", "checkpoints", "checkpoint_mib",
        "stall_seconds", "lock_wait_seconds"}`` where ``stall_seconds`` lists, per checkpoint,
        how long the training thread was blocked (waiting for the previous one plus the save
        call itself) and ``lock_wait_seconds`` totals the waits to enter the manager's lock.

    Raises:
        ValueError: unknown scenario.
    """
    if scenario not in SCENARIOS:
        raise ValueError(f"unknown training scenario {scenario!r}; choose from {SCENARIOS}")
    checkpoint: Checkpointer | None = None
    close: Callable[[], None] = lambda: None  # noqa: E731
    guard: Guard = nullcontext
    try:
        if scenario == "fastckpt-async":
            checkpoint, close, guard = _fastckpt_checkpointer()
        elif scenario == "dcp-async":
            checkpoint, close, guard = _dcp_checkpointer()
    except WriterUnavailable as err:
        return {"available": False, "reason": str(err)}

    model = _model(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1)
    inputs = torch.randn(config.batch, config.hidden, generator=gen)
    targets = torch.randn(config.batch, 1, generator=gen)

    lock_wait = 0.0

    def step() -> None:
        nonlocal lock_wait
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        blocked = time.perf_counter()
        with guard():
            lock_wait += time.perf_counter() - blocked
            optimizer.step()

    for _ in range(config.warmup):
        step()
    state_bytes = sum(t.numel() * t.element_size() for t in _flat_state(model, optimizer).values())
    root = directory / f"train-{scenario}"
    root.mkdir(parents=True, exist_ok=True)
    pending: Future[Any] | None = None
    stalls: list[float] = []
    lock_wait = 0.0
    try:
        start = time.perf_counter()
        for index in range(1, config.steps + 1):
            step()
            due = index % config.every == 0 and index < config.steps
            if checkpoint is not None and due:
                blocked = time.perf_counter()
                if pending is not None:
                    pending.result()
                pending = checkpoint(_flat_state(model, optimizer), root / f"step-{index}")
                stalls.append(time.perf_counter() - blocked)
        if pending is not None:
            pending.result()
        seconds = time.perf_counter() - start
    finally:
        close()
        remove_path(root)
    return {
        "available": True,
        "reason": None,
        "seconds": seconds,
        "steps_per_s": config.steps / seconds,
        "checkpoints": len(stalls),
        "checkpoint_mib": state_bytes / 2**20,
        "stall_seconds": stalls,
        "lock_wait_seconds": lock_wait,
    }
