"""Importable pieces for strategy tests (subprocesses import this module by name)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fastckpt


class DropoutMLP(nn.Module):
    """A small model with dropout, so resuming must restore the RNG exactly."""

    def __init__(self, width: int = 8, p: float = 0.2) -> None:
        super().__init__()
        self.width = width
        self.p = p
        self.net = nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Dropout(p), nn.Linear(width, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def training_fn(model: nn.Module, batch: Any) -> torch.Tensor:
    """Mean squared error on an (x, y) batch."""
    x, y = batch
    return (model(x) - y).square().mean()


def loader(seed: int = 0) -> DataLoader:
    """64 samples, batches of 8, shuffled by the global torch RNG."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 4, generator=gen)
    y = x.sum(dim=1, keepdim=True)
    return DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True, num_workers=0)


class LossRecorder:
    """Records every batch loss (exact float32 values)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def __call__(self, ctx: fastckpt.TrainContext, stage: fastckpt.TrainingStage) -> None:
        if stage is fastckpt.TrainingStage.AFTER_BATCH and ctx.loss is not None:
            self.losses.append(ctx.loss.item())


def new_strategy(hooks: list[Any], num_steps: int) -> fastckpt.TrainingStrategy:
    """The reference job: DropoutMLP + Adam + StepLR, seeded."""
    torch.manual_seed(1234)
    return fastckpt.TrainingStrategy(
        DropoutMLP(),
        fastckpt.OptimizerConfig(
            torch.optim.Adam,
            {"lr": 1e-2},
            torch.optim.lr_scheduler.StepLR,
            {"step_size": 5, "gamma": 0.5},
        ),
        training_fn=training_fn,
        hooks=hooks,
        num_steps=num_steps,
    )


def final_state(strategy: fastckpt.TrainingStrategy, ema: Any) -> dict[str, torch.Tensor]:
    """Parameters, optimizer tensors and EMA weights, flat, for bitwise comparison."""
    out = {f"param.{k}": v for k, v in strategy.models["main"].state_dict().items()}
    for index, state in strategy.optimizers["main"].state_dict()["state"].items():
        for key, value in state.items():
            out[f"optim.{index}.{key}"] = value
    out.update({f"ema.{k}": v for k, v in ema.shadow.items()})
    return out


def run_two_ranks(script: str, checkpoint: Path, rendezvous: Path) -> list[str]:
    """Run ``script`` as ranks 0 and 1 (argv: checkpoint, rank, rendezvous file); returns each
    rank's stdout and fails with its stderr if a rank exits non-zero."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(checkpoint), str(rank), str(rendezvous)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for rank in range(2)
    ]
    outputs = [proc.communicate(timeout=300) for proc in procs]
    for proc, (_, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, err
    return [without_gloo_banners(out) for out, _ in outputs]


def without_gloo_banners(stdout: str) -> str:
    """A rank's stdout less the lines gloo itself prints there: torch 2.9 writes
    ``[Gloo] Rank N is connected to M peer ranks...`` when a process group forms."""
    return "".join(
        line for line in stdout.splitlines(keepends=True) if not line.startswith("[Gloo] ")
    )


def leave_process_group() -> NoReturn:
    """End a distributed test script: destroy the process group, flush output, exit 0 at once.

    torch 2.15's gloo backend aborts ("terminate called without an active exception") in about
    one interpreter teardown in twenty after ``destroy_process_group``, with or without fastckpt
    (seen with a plain DDP loop, 3 aborts in 60 two-rank runs). Skipping the teardown keeps the
    two-rank tests about fastckpt; everything they check is on disk or printed before this.
    """
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@contextlib.contextmanager
def held_by_another_thread(guard: Callable[[], Any]) -> Iterator[None]:
    """Hold ``guard()`` (a manager's ``lock``, a hook's ``guard``) on another thread while the
    block runs: a training step that keeps a background snapshot waiting, so that a save in
    the block outwaits its timeout (the block's own thread holding it would be refused)."""
    entered, release = threading.Event(), threading.Event()

    def hold() -> None:
        with guard():
            entered.set()
            release.wait()

    holder = threading.Thread(target=hold, name="holds-the-guard")
    holder.start()
    assert entered.wait(10), "the guard was not taken"
    try:
        yield
    finally:
        release.set()
        holder.join()
