"""One script that proves fastckpt's CUDA path on a machine with a GPU.

Run it whenever a CUDA machine is available (``python tools/gpu_check.py --out
benches/results/gpu-check.json``). It

a. runs the CUDA-marked tests (``pytest -m cuda``);
b. measures device-to-host staging throughput of ``CudaStager`` against a plain pinned
   ``copy_(non_blocking=True)`` of the same bytes, cold (first stage, which allocates the
   pinned buffers) and warm;
c. measures the training-thread stall of ``CheckpointManager`` async saves and of
   ``CheckpointHook(async_save=True)`` on a GPU model (>= 2 GiB of state with AdamW) against
   ``torch.distributed.checkpoint.async_save`` on the same state, plus the sync save;
d. checks exact resume with CUDA RNG (dropout on the GPU): 10 steps, save, scramble every RNG,
   restore, 10 more steps must equal 20 straight steps bitwise.

Without CUDA it prints why it skipped and exits 0 (``--device cpu`` runs the same
measurements on the CPU with a small state, which is how the test suite keeps it working).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))  # training_support: the reference resume job

GIB = 1024**3


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


# --------------------------------------------------------------------------- (a) tests


def run_cuda_tests() -> dict[str, Any]:
    """Run the CUDA-marked tests in a subprocess; return its exit code and summary line."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-m", "cuda", str(REPO / "tests")],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=900,
    )
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    return {"returncode": proc.returncode, "summary": lines[-1] if lines else proc.stderr[-500:]}


# --------------------------------------------------------------------------- (b) staging


def make_tensors(device: torch.device, total_bytes: int, count: int) -> dict[str, torch.Tensor]:
    """``count`` float32 tensors on ``device`` adding up to about ``total_bytes``."""
    per = max(1, total_bytes // count // 4)
    return {f"t{i}": torch.randn(per, device=device) for i in range(count)}


def measure_staging(device: torch.device, total_bytes: int, repeats: int) -> dict[str, Any]:
    """Staging throughput of fastckpt's stager vs a plain (pinned) ``copy_`` of the same bytes."""
    from fastckpt.io.staging import StagerOptions, make_stager

    tensors = make_tensors(device, total_bytes, 32)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    pinned = device.type == "cuda"
    stager = make_stager(StagerOptions(pinned=pinned, non_blocking=pinned))
    _sync(device)
    cold, _ = _timed(lambda: stager.stage(tensors))
    warm = [_timed(lambda: stager.stage(tensors))[0] for _ in range(repeats)]

    buffers = {n: torch.empty_like(t, device="cpu", pin_memory=pinned) for n, t in tensors.items()}

    def plain_copy() -> None:
        for name, tensor in tensors.items():
            buffers[name].copy_(tensor, non_blocking=pinned)
        _sync(device)

    plain_copy()  # first touch of the baseline's buffers is not part of its figure
    plain = [_timed(plain_copy)[0] for _ in range(repeats)]
    staged_gbps = nbytes / _median(warm) / 1e9
    plain_gbps = nbytes / _median(plain) / 1e9
    return {
        "bytes": nbytes,
        "first_stage_s": cold,
        "stager_warm_median_s": _median(warm),
        "plain_copy_median_s": _median(plain),
        "stager_gbps": staged_gbps,
        "plain_copy_gbps": plain_gbps,
        "ratio_vs_plain": staged_gbps / plain_gbps,
        "target": ">= 0.8",
    }


# --------------------------------------------------------------------------- (c) stalls


class LinearStack(nn.Module):
    """``layers`` x Linear(width, width): the stall job's model (its recipe is recordable)."""

    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.width = width
        self.layers = layers
        self.stack = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.stack:
            x = layer(x)
        return x


def stall_model(
    device: torch.device, state_bytes: int
) -> tuple[LinearStack, torch.optim.Optimizer]:
    """Linear(4096, 4096) layers + AdamW: parameters plus two moments ~= ``state_bytes``."""
    width = 4096 if state_bytes >= 256 * 1024**2 else 256
    per_layer = (width * width + width) * 4 * 3
    layers = max(1, round(state_bytes / per_layer))
    model = LinearStack(width, layers).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    _train_step(model, optimizer, width, device)  # AdamW creates its moments on the first step
    return model, optimizer


def _train_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, width: int, device: torch.device
) -> None:
    loss = model(torch.randn(64, width, device=device)).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": optimizer.state_dict()}


def _perturb(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Change every tensor of the state (weights and optimizer moments) in place, so that
    the next save writes all of it: fastckpt saves into a directory incrementally, and an
    unchanged state would be proven unchanged and linked instead of written."""
    with torch.no_grad():
        for tensor in list(model.state_dict().values()):
            if tensor.is_floating_point():
                tensor.add_(1e-3)
        for per_param in optimizer.state.values():
            for value in per_param.values():
                if torch.is_tensor(value) and value.is_floating_point() and value.dim():
                    value.add_(1e-3)


def _state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    for per_param in optimizer.state_dict()["state"].values():
        total += sum(v.numel() * v.element_size() for v in per_param.values() if torch.is_tensor(v))
    return total


def measure_manager(
    model: nn.Module, optimizer: torch.optim.Optimizer, root: Path, repeats: int
) -> dict[str, Any]:
    """Stall (until the state may be changed again: ``save()`` returned and ``lock()``, which an
    optimizer step holds, taken), the save call alone, and durable time of async saves; time
    of a sync save. ``dcp.async_save`` returns once staged, so its return is its stall."""
    from fastckpt import CheckpointManager

    stalls, calls, totals = [], [], []
    with CheckpointManager(CheckpointManager.Config.with_async_save()) as manager:
        for i in range(repeats):
            _perturb(model, optimizer)
            start = time.perf_counter()
            future = manager.save(root / f"async_{i}", _state(model, optimizer))
            calls.append(time.perf_counter() - start)
            with manager.lock():
                stalls.append(time.perf_counter() - start)
            if future is not None:
                future.result()
            totals.append(time.perf_counter() - start)
    sync_times = []
    with CheckpointManager(CheckpointManager.Config.with_sync_save()) as manager:
        for i in range(repeats):
            _perturb(model, optimizer)
            start = time.perf_counter()
            manager.save(root / f"sync_{i}", _state(model, optimizer))
            sync_times.append(time.perf_counter() - start)
    return {
        "async_stall_s": stalls,
        "async_save_call_s": calls,
        "async_durable_s": totals,
        "sync_save_s": sync_times,
        "stall_median_s": _median(stalls),
    }


def measure_dcp(
    model: nn.Module, optimizer: torch.optim.Optimizer, root: Path, repeats: int
) -> dict[str, Any]:
    """Stall and durable time of ``dcp.async_save`` (one-rank gloo group) on the same state."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    created = False
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        dist.init_process_group("gloo", rank=0, world_size=1)
        created = True
    stalls, totals = [], []
    try:
        for i in range(repeats):
            start = time.perf_counter()
            future = dcp.async_save(_state(model, optimizer), checkpoint_id=str(root / f"dcp_{i}"))
            stalls.append(time.perf_counter() - start)
            future.result()  # type: ignore[union-attr]  # a Future without a stager config
            totals.append(time.perf_counter() - start)
    finally:
        if created:
            dist.destroy_process_group()
    return {"async_stall_s": stalls, "async_durable_s": totals, "stall_median_s": _median(stalls)}


def measure_hook(device: torch.device, state_bytes: int, root: Path, saves: int) -> dict[str, Any]:
    """Stall of ``CheckpointHook(async_save=True)`` inside a ``TrainingStrategy`` loop. The
    loop's few steps take milliseconds on a GPU, far less than a write of the state: a save
    would wait for the previous one's write (one write in flight). That wait is measured
    apart (``waited_for_previous_s``), so that ``stall_s`` is the time the save call itself
    blocks training when checkpoints are spaced further apart than one write. It is the call
    only: the next optimizer step also waits until the background capture of the trainable
    parameters is done (the forward and backward passes overlap it), which is not counted
    here (the harness's training loop counts it, ``fastckpt.bench.training``)."""
    import fastckpt

    stalls: list[float] = []
    waits: list[float] = []

    class TimedHook(fastckpt.CheckpointHook):
        """Records how long the training thread spends in the hook at each save."""

        def save(self, ctx: fastckpt.TrainContext) -> None:
            start = time.perf_counter()
            while self.writing:
                time.sleep(0.001)
            waits.append(time.perf_counter() - start)
            start = time.perf_counter()
            super().save(ctx)
            stalls.append(time.perf_counter() - start)

    model, _ = stall_model(device, state_bytes)
    width = model.width
    interval = 5
    hook = TimedHook(root, step_interval=interval, async_save=True, keep_last=2)
    strategy = fastckpt.TrainingStrategy(
        model,
        fastckpt.OptimizerConfig(torch.optim.AdamW, {"lr": 1e-4}),
        training_fn=_square_loss,
        hooks=[hook],
        num_steps=interval * saves,
        device=device,
    )
    batches = [torch.randn(64, width) for _ in range(interval * saves)]
    elapsed, _ = _timed(lambda: strategy.run(batches))
    return {
        "stall_s": stalls,
        "stall_median_s": _median(stalls),
        "waited_for_previous_s": waits,
        "loop_s": elapsed,
    }


def _square_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """The stall job's loss: mean square of the output."""
    return model(batch).square().mean()


# --------------------------------------------------------------------------- (d) resume


def check_exact_resume(device: torch.device, root: Path) -> dict[str, Any]:
    """10 steps + save + scrambled RNG + restore + 10 steps == 20 straight steps, bitwise."""
    import fastckpt
    import training_support as support

    def strategy(steps: int) -> fastckpt.TrainingStrategy:
        torch.manual_seed(1234)  # the same seed as training_support.new_strategy
        return fastckpt.TrainingStrategy(
            support.DropoutMLP(),
            fastckpt.OptimizerConfig(
                torch.optim.Adam,
                {"lr": 1e-2},
                torch.optim.lr_scheduler.StepLR,
                {"step_size": 5, "gamma": 0.5},
            ),
            training_fn=support.training_fn,
            num_steps=steps,
            device=device,
        )

    straight = strategy(20)
    straight.run(support.loader())
    first = strategy(10)
    first.run(support.loader())
    first.save_checkpoint(root)
    torch.manual_seed(999)
    if device.type == "cuda":
        torch.cuda.manual_seed_all(999)
    resumed = fastckpt.TrainingStrategy.load_checkpoint(
        root, map_location=device, trusted=["training_support.training_fn"]
    )
    resumed.num_steps = 20
    resumed.run(support.loader())
    expected = straight.models["main"].state_dict()
    got = resumed.models["main"].state_dict()
    mismatched = [k for k in expected if not torch.equal(expected[k].cpu(), got[k].cpu())]
    return {"bitwise_equal": not mismatched, "mismatched": mismatched, "device": str(device)}


# --------------------------------------------------------------------------- driver


def environment(device: torch.device) -> dict[str, Any]:
    """What the figures were measured on."""
    info: dict[str, Any] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "device": str(device),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every check, in order; returns the report."""
    device = torch.device(args.device)
    state_bytes = int(args.state_gib * GIB)
    report: dict[str, Any] = {"environment": environment(device)}
    if device.type == "cuda" and not args.skip_tests:
        report["cuda_tests"] = run_cuda_tests()
    report["staging"] = measure_staging(device, state_bytes, args.repeats)
    with tempfile.TemporaryDirectory(dir=args.scratch) as scratch:
        root = Path(scratch)
        model, optimizer = stall_model(device, state_bytes)
        report["stall_state_bytes"] = _state_bytes(model, optimizer)
        report["manager"] = measure_manager(model, optimizer, root / "manager", args.repeats)
        report["dcp"] = measure_dcp(model, optimizer, root / "dcp", args.repeats)
        del model, optimizer
        report["hook"] = measure_hook(device, state_bytes, root / "hook", args.repeats)
        report["stall_ratio_vs_dcp"] = {
            "manager": report["manager"]["stall_median_s"] / report["dcp"]["stall_median_s"],
            "hook": report["hook"]["stall_median_s"] / report["dcp"]["stall_median_s"],
            "target": "<= 0.5",
        }
        report["exact_resume"] = check_exact_resume(device, root / "resume")
    return report


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (a smoke run)")
    parser.add_argument("--state-gib", type=float, default=2.0, help="state size (default 2)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per measurement")
    parser.add_argument("--out", type=Path, help="write the report as JSON here")
    parser.add_argument("--scratch", default=None, help="directory for checkpoints (a disk)")
    parser.add_argument("--skip-tests", action="store_true", help="skip (a), the CUDA tests")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the checks; 0 when every check passed or CUDA is absent (skipped), 1 otherwise."""
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: skipped: no CUDA device (torch.cuda.is_available() is False)")
        return 0
    report = run(args)
    text = json.dumps(report, indent=2, default=str)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    failed = not report["exact_resume"]["bitwise_equal"]
    failed |= report.get("cuda_tests", {}).get("returncode", 0) != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
