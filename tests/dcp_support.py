"""Importable pieces for the sharded (DCP) tests: the model, its flat full state, and an
N-rank launcher that reports each rank's exit (rank scripts live in ``dcp_ranks.py`` and
``sharded_ranks.py``, which start their process group with :func:`setup_rank`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import fastckpt

TESTS = Path(__file__).resolve().parent


def build_model() -> nn.Module:
    """A small MLP whose dimensions divide neither by 2 nor by 3; its last weight has one row,
    so FSDP2 on 2 or 3 ranks leaves some ranks an empty shard."""
    torch.manual_seed(7)
    return nn.Sequential(
        nn.Linear(37, 301), nn.ReLU(), nn.Linear(301, 5), nn.ReLU(), nn.Linear(5, 1)
    )


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same deterministic batch on every rank."""
    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randn(16, 37, generator=gen)
    return x, x[:, :1] * 2.0 - 1.0


def fsdp2_on(device_type: str) -> Callable[[nn.Module], nn.Module]:
    """The ``parallelize=`` function of FSDP2 over every rank of the default group on
    ``device_type`` ("cpu" or "cuda"): the model moved there, each Linear sharded, then the
    root."""

    def shard(model: nn.Module) -> nn.Module:
        mesh = init_device_mesh(device_type, (dist.get_world_size(),))
        model = model.to(device_type)
        for layer in model.modules():
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    return shard


def feature_batches(count: int) -> list[torch.Tensor]:
    """``count`` seeded CPU batches of 16 x 37 features for :func:`first_feature_loss`."""
    gen = torch.Generator().manual_seed(5)
    return [torch.randn(16, 37, generator=gen) for _ in range(count)]


def first_feature_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """A training function: the batch moved to the model's device, the mean squared
    distance of the output from the first feature."""
    x = batch.to(next(model.parameters()).device)
    return (model(x) - x[:, :1]).square().mean()


def hooked_strategy(
    shard: Callable[[nn.Module], nn.Module], root: Path
) -> fastckpt.TrainingStrategy:
    """A seeded FSDP2 + AdamW strategy trained 4 steps with an async ``CheckpointHook`` to
    ``root`` every 2 steps (so its last index holds the final state)."""
    torch.manual_seed(0)
    strategy = fastckpt.TrainingStrategy(
        shard(build_model()),
        fastckpt.OptimizerConfig(torch.optim.AdamW, {"lr": 1e-2}),
        training_fn=first_feature_loss,
        hooks=[fastckpt.CheckpointHook(root, step_interval=2)],
        num_steps=4,
    )
    strategy.run(feature_batches(4))
    return strategy


def row_tensors() -> dict[str, torch.Tensor]:
    """The full tensors that ``dcp_ranks.save_rows`` saves row-sharded (``model.w``,
    ``model.b``)."""
    return {
        "model.w": torch.arange(40 * 6, dtype=torch.float32).reshape(40, 6) / 3,
        "model.b": torch.arange(40, dtype=torch.float32) - 11,
    }


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> float:
    """One AdamW step on :func:`batch`; returns the loss."""
    x, y = batch(step)
    loss = (model(x) - y).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return float(loss.item())


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every model and optimizer tensor, gathered to full tensors on rank 0 (collective under a
    process group; other ranks get an empty dict)."""
    msd, osd = get_state_dict(
        model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    out = {f"model.{k}": v.detach().clone() for k, v in msd.items()}
    for fqn, state in osd.get("state", {}).items():
        for key, value in state.items():
            tensor = value if isinstance(value, torch.Tensor) else torch.tensor(value)
            out[f"optim.{fqn}.{key}"] = tensor.detach().clone()
    return out


def launch(
    function: str,
    checkpoint: Path,
    world: int,
    *args: str,
    ranks: str = "dcp_ranks",
    timeout: float = 240,
) -> list[tuple[int, str, str]]:
    """Run ``<ranks>.<function>`` (``ranks``: the rank-script module, ``dcp_ranks`` or
    ``sharded_ranks``) as ranks ``0..world-1`` (gloo, file rendezvous next to ``checkpoint``);
    returns ``(returncode, stdout, stderr)`` per rank, whatever they were."""
    procs = spawn(function, checkpoint, world, *args, ranks=ranks)
    results: list[tuple[int, str, str]] = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        results.append((proc.returncode, without_gloo_banners(out), err))
    return results


def without_gloo_banners(stdout: str) -> str:
    """A rank's stdout less the lines gloo itself prints there: torch 2.9 writes
    ``[Gloo] Rank N is connected to M peer ranks...`` when a process group forms."""
    return "".join(
        line for line in stdout.splitlines(keepends=True) if not line.startswith("[Gloo] ")
    )


def spawn(
    function: str, checkpoint: Path, world: int, *args: str, ranks: str = "dcp_ranks"
) -> list[subprocess.Popen[str]]:
    """Start ``<ranks>.<function>`` as ranks ``0..world-1`` (see :func:`launch`) and return the
    processes at once (stdout and stderr piped, text), for tests that kill or race them."""
    env = {**os.environ, "PYTHONPATH": str(TESTS), "OMP_NUM_THREADS": "1"}
    rendezvous = checkpoint.parent / f"rendezvous-{function}-{world}-{os.getpid()}"
    rendezvous.unlink(missing_ok=True)
    code = f"import {ranks}; {ranks}.{function}()"
    return [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                code,
                str(checkpoint),
                str(rank),
                str(rendezvous),
                str(world),
                *list(args),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for rank in range(world)
    ]


def setup_rank() -> tuple[Path, int, int]:
    """In a rank started by :func:`launch`: join the gloo process group named by the command
    line (``CHECKPOINT RANK RENDEZVOUS [WORLD]``, world 2 when absent); returns
    ``(checkpoint, rank, world)``."""
    root, rank, rendezvous = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    world = int(sys.argv[4]) if len(sys.argv) > 4 else 2
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{rendezvous}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    return root, rank, world


def script_report(script: str, *args: str, timeout: float = 300) -> dict[str, Any]:
    """Run ``script`` (Python source) in a new process with this directory importable and
    ``args`` as its arguments; returns the JSON object of its last stdout line, after
    failing with its stderr when it did not exit 0."""
    path = os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"},
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return report


def check_ok(results: list[tuple[int, str, str]]) -> list[str]:
    """Each rank's stdout; fails with the stderr of any rank that did not exit 0."""
    for rank, (code, _, err) in enumerate(results):
        assert code == 0, f"rank {rank} exited {code}:\n{err[-4000:]}"
    return [out for _, out, _ in results]


def compare(expected: dict[str, torch.Tensor], actual: dict[str, Any]) -> list[str]:
    """Names whose tensors differ (dtype, shape or any bit), or are missing/extra."""
    bad = sorted(set(expected) ^ set(actual))
    for name in sorted(set(expected) & set(actual)):
        a, b = expected[name], actual[name]
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(_bits(a), _bits(b)):
            bad.append(name)
    return bad


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().reshape(-1).contiguous().view(torch.uint8)
