"""The training-loop scenario: step throughput with and without periodic async checkpoints.

A small MLP is trained with AdamW on fixed random data for ``steps`` steps; every ``every``
steps (not at the last step) its weights and Adam moments are checkpointed asynchronously. If
the previous checkpoint is still in flight at the next one, the loop waits for it (that wait
counts as stall, as it would in training). Scenarios: ``none`` (no checkpoints),
``fastckpt-async`` (``CheckpointManager`` with async saves of the flat state, its staging
buffers allocated by ``prewarm_staging`` before the clock starts),
``fastckpt-hook`` (``CheckpointHook(async_save=True)`` saving the ``TrainingStrategy`` that
owns the model and optimizer: what a strategy's training loop runs; the loop calls
``hook.save(strategy.context)`` at the same steps, and the hook's staging buffers are
allocated before the clock starts, as the hook does at ``BEFORE_TRAINING``) and
``dcp-async`` (``torch.distributed.checkpoint.async_save``). With fastckpt, the optimizer
step runs under ``CheckpointManager.lock()`` / ``CheckpointHook.guard()`` as they require
(it blocks while a snapshot is being captured; that wait is recorded as
``lock_wait_seconds``, and counts in the stall of the checkpoint before it: a checkpoint's
stall is the save call plus the lock waits until the next one). The clock runs from the first timed
step until the last checkpoint is durable, so an async writer cannot hide its tail after the
loop.
"""

from __future__ import annotations

import statistics
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

from fastckpt.bench.writers import (
    WriterUnavailable,
    dcp_staged,
    open_async_manager,
    remove_path,
)

__all__ = ["SCENARIOS", "TrainingConfig", "run_training", "with_lock_waits"]

#: Scenarios in the order they run within a repetition.
SCENARIOS = ("none", "fastckpt-async", "fastckpt-hook", "dcp-async")


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
#: Called once with the state after the warm-up steps, before the clock starts.
Prepare = Callable[[dict[str, torch.Tensor]], None]


def _dcp_checkpointer() -> tuple[Checkpointer, Callable[[], None], Guard, Prepare]:
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
        return dcp_staged(response)  # the next step may change the state once it is staged

    return save, lambda: None, nullcontext, lambda state: None


def _fastckpt_checkpointer() -> tuple[Checkpointer, Callable[[], None], Guard, Prepare]:
    manager = open_async_manager()

    def save(state: dict[str, torch.Tensor], path: Path) -> Future[Any]:
        future: Future[Any] = manager.save(str(path), {"state": state})
        return future

    def prepare(state: dict[str, torch.Tensor]) -> None:
        # The manager's documented way to allocate its staging buffers before the first save.
        if hasattr(manager, "prewarm_staging"):
            manager.prewarm_staging({"state": state})

    guard: Guard = getattr(manager, "lock", nullcontext)
    return save, manager.close, guard, prepare


class _HookCheckpointer:
    """``CheckpointHook(async_save=True)`` on a ``TrainingStrategy`` owning the model and
    optimizer; :meth:`save` is what the hook does at a cadence step."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        from fastckpt.training.hooks import CheckpointHook
        from fastckpt.training.strategy import TrainingStrategy

        self.strategy = TrainingStrategy(model, optimizer, num_steps=1)
        self.hook: Any = None
        self.hook_class = CheckpointHook

    def open(self, root: Path) -> None:
        self.hook = self.hook_class(root, step_interval=1, async_save=True, save_last=False)
        self.hook.__enter__()
        self.hook.prewarm_staging(self.strategy)

    def save(self, step: int) -> Future[Any]:
        self.strategy.step_count = step
        self.hook.save(self.strategy.context)
        done: Future[Any] = Future()
        done.set_result(None)  # the hook's next save (or close) waits for this one itself
        return done

    def busy(self) -> bool:
        return self.hook is not None and bool(self.hook.writing)

    def guard(self) -> AbstractContextManager[Any]:
        return self.hook.guard() if self.hook is not None else nullcontext()

    def close(self) -> None:
        if self.hook is not None:
            self.hook.close()


def with_lock_waits(calls: list[float], marks: list[float], total: float) -> list[float]:
    """Per checkpoint, what the training thread waited for it: its save call plus the lock
    waits from that call to the next checkpoint's (or to the end of the run).

    Args:
        calls: seconds of each save call.
        marks: the running total of lock waits when each save call returned.
        total: the running total at the end of the run.
    """
    if not calls:
        return []
    ends = [*marks[1:], total]
    return [call + end - mark for call, mark, end in zip(calls, marks, ends, strict=True)]


def _in_run_overhead(
    step_seconds: list[float], overlapped: list[bool], seconds: float, stalls: list[float]
) -> dict[str, Any]:
    """What checkpointing cost the run, measured against the run itself: the time the steps
    that overlapped a checkpoint in flight took beyond the median of the run's other steps,
    plus the time the training thread was blocked in the save calls (``stalls``, spent
    between steps), as a share of the run. Both sides come from the same seconds of the same
    run, so the speed swings between runs (on this VM the same loop without checkpoints
    varies by +-20 % from one 5-second run to the next) cancel; what it does not count is a
    slowdown of steps that overlap no checkpoint (the throughput comparison with the baseline
    runs does)."""
    quiet = [t for t, busy in zip(step_seconds, overlapped, strict=True) if not busy]
    loud = [t for t, busy in zip(step_seconds, overlapped, strict=True) if busy]
    if not quiet or not loud:
        return {"overlapped_steps": len(loud), "in_run_overhead": None}
    typical = statistics.median(quiet)
    extra = sum(t - typical for t in loud) + sum(stalls)
    return {
        "overlapped_steps": len(loud),
        "quiet_step_seconds": typical,
        "overlapped_step_seconds": statistics.median(loud),
        "in_run_overhead": extra / seconds,
    }


def run_training(scenario: str, config: TrainingConfig, directory: Path) -> dict[str, Any]:
    """Run one scenario (``"none"``, ``"fastckpt-async"`` or ``"dcp-async"``) once.

    Returns:
        ``{"available", "reason", "seconds", "steps_per_s", "checkpoints", "checkpoint_mib",
        "stall_seconds", "lock_wait_seconds", "overlapped_steps", "in_run_overhead", ...}``
        where ``stall_seconds`` lists, per checkpoint, how long the training thread waited
        for it: the save call (waiting for the previous one plus the call itself,
        ``save_call_seconds``) and the waits to enter the manager's lock (or the hook's
        guard) in the steps until the next checkpoint (the snapshot being captured);
        ``lock_wait_seconds`` totals the lock waits, and ``in_run_overhead`` is the extra
        time of the steps that overlapped a checkpoint (lock waits included), plus the save
        calls, as a share of the run (see ``_in_run_overhead``; None without checkpoints).

    Raises:
        ValueError: unknown scenario.
    """
    if scenario not in SCENARIOS:
        raise ValueError(f"unknown training scenario {scenario!r}; choose from {SCENARIOS}")
    checkpoint: Checkpointer | None = None
    close: Callable[[], None] = lambda: None  # noqa: E731
    guard: Guard = nullcontext
    prepare: Prepare = lambda state: None  # noqa: E731
    try:
        if scenario == "fastckpt-async":
            checkpoint, close, guard, prepare = _fastckpt_checkpointer()
        elif scenario == "dcp-async":
            checkpoint, close, guard, prepare = _dcp_checkpointer()
    except WriterUnavailable as err:
        return {"available": False, "reason": str(err)}

    model = _model(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    hooked: _HookCheckpointer | None = None
    if scenario == "fastckpt-hook":
        try:
            hooked = _HookCheckpointer(model, optimizer)
        except Exception as err:  # ImportError, or a strategy refusing this model
            return {"available": False, "reason": f"CheckpointHook: {err!r}"}
        guard = hooked.guard
        close = hooked.close
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
    if hooked is not None:
        hooked.open(root)  # allocates the staging buffers, before the clock
    prepare(_flat_state(model, optimizer))
    pending: Future[Any] | None = None
    stalls: list[float] = []  # the save calls
    lock_marks: list[float] = []  # lock_wait when each save call returned
    lock_wait = 0.0

    def busy() -> bool:
        """Whether a checkpoint is being captured or written right now."""
        if hooked is not None:
            return hooked.busy()
        return pending is not None and not pending.done()

    step_seconds: list[float] = []
    overlapped: list[bool] = []
    try:
        start = time.perf_counter()
        for index in range(1, config.steps + 1):
            during = busy()
            began = time.perf_counter()
            step()
            step_seconds.append(time.perf_counter() - began)
            overlapped.append(during or busy())
            due = index % config.every == 0 and index < config.steps
            if checkpoint is not None and due:
                blocked = time.perf_counter()
                if pending is not None:
                    pending.result()
                pending = checkpoint(_flat_state(model, optimizer), root / f"step-{index}")
                stalls.append(time.perf_counter() - blocked)
                lock_marks.append(lock_wait)
            elif hooked is not None and due:
                blocked = time.perf_counter()
                hooked.save(index)  # waits for the previous write itself
                stalls.append(time.perf_counter() - blocked)
                lock_marks.append(lock_wait)
        if pending is not None:
            pending.result()
        if hooked is not None:
            hooked.close()  # the last checkpoint is durable
        seconds = time.perf_counter() - start
    finally:
        close()
        remove_path(root)
    return {
        "available": True,
        "reason": None,
        **_in_run_overhead(step_seconds, overlapped, seconds, stalls),
        "seconds": seconds,
        "steps_per_s": config.steps / seconds,
        "checkpoints": len(stalls),
        "checkpoint_mib": state_bytes / 2**20,
        "stall_seconds": with_lock_waits(stalls, lock_marks, lock_wait),
        "save_call_seconds": stalls,
        "lock_wait_seconds": lock_wait,
    }
