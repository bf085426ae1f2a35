"""``python -m fastckpt.demo``: the whole story on a small embedded example.

1. Train a small model with a ``CheckpointHook`` (async saves every few steps) in a child
   process, and kill it with SIGKILL while a checkpoint is being written.
2. Show what the crash left behind, find the newest checkpoint that verifies, resume training
   from it in this process, and check that the resumed weights are the checkpointed ones.
3. Measure durable write throughput of fastckpt against ``torch.save`` (+fsync) on the same
   state, on this machine's disk.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import fastckpt
from fastckpt.bench.compare import same_bits
from fastckpt.container.verify import latest_intact, verify
from fastckpt.storage.backend import TEMP_PREFIX

TRAINING_FN = "fastckpt.demo.demo_training_fn"


class DemoModel(nn.Module):
    """A small MLP (about 48 MiB of weights + Adam state), big enough that a save takes time."""

    def __init__(self, width: int = 1024, depth: int = 4) -> None:
        """Build ``depth`` square layers of ``width``."""
        super().__init__()
        self.width = width
        self.depth = depth
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Residual MLP."""
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        return x


def demo_training_fn(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Learn to map a batch to half of itself."""
    return (model(batch) - 0.5 * batch).square().mean()


def demo_batches(width: int = 1024, count: int = 64) -> list[torch.Tensor]:
    """A fixed synthetic dataset."""
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(16, width, generator=gen) for _ in range(count)]


def child(root: str) -> None:
    """The training job that gets killed: saves every 3 steps, forever."""
    # Run as ``python -m fastckpt.demo`` this module is ``__main__``; checkpoints must record
    # the importable ``fastckpt.demo`` names instead.
    from fastckpt import demo

    torch.manual_seed(0)
    strategy = fastckpt.TrainingStrategy(
        demo.DemoModel(),
        fastckpt.OptimizerConfig(torch.optim.Adam, {"lr": 1e-4}),
        training_fn=demo.demo_training_fn,
        hooks=[fastckpt.CheckpointHook(root, step_interval=3, async_save=True)],
        num_steps=10**9,
    )
    strategy.run(demo_batches())


def wait_for(condition: Callable[[], bool], timeout: float) -> bool:
    """Poll ``condition`` until true or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.005)
    return False


def committed(root: Path) -> int:
    """Number of committed indices under ``root``."""
    try:
        return len(fastckpt.list_checkpoints(root))
    except (OSError, ValueError):
        return 0


def saving_now(root: Path) -> bool:
    """Whether an index is being written (its temporary directory exists)."""
    return root.is_dir() and any(p.name.startswith(TEMP_PREFIX) for p in root.iterdir())


def crash_and_resume(root: Path) -> bool:
    """Steps 1 and 2; returns whether the resumed state matches the checkpoint."""
    print("1. training in a child process, CheckpointHook(step_interval=3, async_save=True)")
    proc = subprocess.Popen([sys.executable, "-m", "fastckpt.demo", "--child", str(root)])
    try:
        if not wait_for(lambda: committed(root) >= 2, timeout=300):
            raise RuntimeError("the child did not commit two checkpoints in time")
        mid_save = wait_for(lambda: saving_now(root), timeout=60)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    leftovers = sorted(p.name for p in root.iterdir() if p.name.startswith("."))
    state = "while a checkpoint was being written" if mid_save else "between saves"
    print(f"   killed with SIGKILL {state}; left behind: {leftovers or 'nothing'}")

    print("2. resume from the newest checkpoint that verifies")
    index = latest_intact(root)
    if index is None:
        print("   no intact checkpoint found")
        return False
    report = verify(root, index=index)
    print(f"   index {index}: {len(report.files)} files verified ({'ok' if report.ok else 'BAD'})")
    restored = fastckpt.TrainingStrategy.load_checkpoint(root, index, trusted=[TRAINING_FN])
    print(f"   restored at step {restored.step_count} (epoch {restored.epoch_count})")
    saved = fastckpt.load_file(root / str(index) / "models" / "main.safetensors")
    live = restored.models["main"].state_dict()
    same = all(same_bits(live[name], tensor) for name, tensor in saved.items())
    restored.num_steps = restored.step_count + 3
    restored.hooks = [fastckpt.CheckpointHook(root, step_interval=3)]
    restored.run(demo_batches())
    after = sorted(p.name for p in root.iterdir() if p.name.startswith("."))
    print(
        f"   weights equal the checkpoint: {same}; trained 3 more steps and saved index "
        f"{restored.hooks[0].last_checkpoint_index}; leftovers now: {after or 'none'}"
    )
    return same and report.ok


def fsynced_torch_save(state: dict[str, torch.Tensor], path: Path) -> None:
    """torch.save made durable the same way fastckpt's writes are."""
    with open(path, "wb") as handle:
        torch.save(state, handle)
        handle.flush()
        os.fsync(handle.fileno())


def best_of(repeats: int, action: Callable[..., Any], *args: Any) -> float:
    """Fastest of ``repeats`` timed calls, in seconds."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        action(*args)
        times.append(time.perf_counter() - start)
    return min(times)


def throughput(root: Path, size_mib: int) -> None:
    """Step 3: durable writes of the same state, fastckpt vs torch.save."""
    gen = torch.Generator().manual_seed(0)
    count = max(1, size_mib // 4)
    state = {f"layer{i}.weight": torch.randn(1024, 1024, generator=gen) for i in range(count)}
    gib = sum(t.numel() * t.element_size() for t in state.values()) / 2**30
    ours, theirs = root / "state.safetensors", root / "state.pt"
    fastckpt.save_file(state, ours, direct_io=True)  # warm-up
    t_ours = best_of(3, lambda: fastckpt.save_file(state, ours, direct_io=True))
    t_theirs = best_of(3, fsynced_torch_save, state, theirs)
    print(f"3. durable write of {gib * 1024:.0f} MiB, best of 3 on this disk:")
    print(
        f"   fastckpt {gib / t_ours:.2f} GiB/s, torch.save+fsync {gib / t_theirs:.2f} GiB/s "
        f"({t_theirs / t_ours:.2f}x)"
    )


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns the process exit status."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size-mib", type=int, default=256, help="state size for step 3")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child)
        return 0
    if args.dir is not None and not Path(args.dir).is_dir():
        parser.error(f"--dir {args.dir}: no such folder (create it, or leave --dir out)")
    print(f"fastckpt {fastckpt.__version__}")
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="fastckpt-demo-") as tmp:
        ok = crash_and_resume(Path(tmp) / "checkpoints")
        throughput(Path(tmp), args.size_mib)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
