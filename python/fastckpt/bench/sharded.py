"""The sharded scenario: fastckpt's DCP storage layer against ``dcp.FileSystemWriter``.

The same state (float32 DTensors sharded along dimension 0 over a CPU gloo mesh) is saved,
loaded with a different sharding (dimension 1: every rank needs part of every saved chunk),
and saved with ``dcp.async_save`` by each backend, side by side in one run:

* ``fastckpt``: ``fastckpt.dcp.Writer`` / ``Reader`` (durable, verified reads);
* ``dcp-1t`` and ``dcp-2t``: ``dcp.FileSystemWriter(thread_count=1 | 2)`` / ``FileSystemReader``.

Timings are the wall time of the collective call, measured on rank 0 between barriers; the
async *stall* is how long until the caller may change the state again: ``dcp.async_save``
returned and the state is staged (:func:`fastckpt.bench.writers.dcp_staged`; both backends
stage before returning, ``fastckpt.dcp.Writer`` as its own stager), after one warm-up save
with the same writer. Loads read from a dropped page cache where the process may drop it
(root on Linux) when asked (``--drop-caches``), and are labelled ``warm`` otherwise.

```bash
python -m fastckpt.bench.sharded --size-mib 1024 --repeats 3 --out benches/results/sharded-1gib.json
```
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from fastckpt.bench.cache import CacheControl
from fastckpt.bench.compare import same_bits
from fastckpt.bench.stats import summarize
from fastckpt.bench.writers import dcp_staged

__all__ = ["BACKENDS", "ShardedConfig", "main", "run_sharded"]

#: The backends compared, in report order.
BACKENDS = ("fastckpt", "dcp-1t", "dcp-2t")
_TENSORS = 8
_COLUMNS = 1024


@dataclass
class ShardedConfig:
    """One run of the sharded scenario.

    Attributes:
        size_mib: total size of the state (all ranks together).
        world: number of ranks (gloo on CPU).
        repeats: measurements per backend and operation.
        work_dir: where checkpoints are written (a temporary directory made inside it is
            removed at the end); the default, the current directory, keeps them off a tmpfs.
        cold: drop the page cache before loads where allowed.
        timeout_s: limit for the whole multi-rank run.
    """

    size_mib: int = 256
    world: int = 2
    repeats: int = 3
    work_dir: Path = field(default_factory=Path.cwd)
    cold: bool = True
    timeout_s: float = 1800.0


def run_sharded(config: ShardedConfig) -> dict[str, Any]:
    """Run the scenario on ``config.world`` spawned ranks; returns rank 0's report.

    Returns:
        ``{"config", "cache", "rows": {backend: {"save_s", "load_s", "stall_s"}: summaries},
        "ratios": {...}}``; ratios > 1 mean fastckpt is faster (``stall`` ratios: fastckpt's
        stall divided by the other's, lower is better).

    Raises:
        RuntimeError: a rank failed (its stderr is in the message).
    """
    with tempfile.TemporaryDirectory(prefix="fastckpt-sharded-", dir=config.work_dir) as tmp:
        root = Path(tmp)
        out = root / "report.json"
        settings = {**asdict(config), "work_dir": str(root)}
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        procs = [
            subprocess.Popen(
                [
                    *(sys.executable, "-m", "fastckpt.bench.sharded", "--worker", str(rank)),
                    *("--settings", json.dumps(settings), "--out", str(out)),
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
            for rank in range(config.world)
        ]
        errors = []
        for rank, proc in enumerate(procs):
            try:
                _, err = proc.communicate(timeout=config.timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                _, err = proc.communicate()
            if proc.returncode != 0:
                errors.append(f"rank {rank} exited {proc.returncode}: {err[-3000:]}")
        if errors:
            raise RuntimeError("sharded benchmark failed:\n" + "\n".join(errors))
        report: dict[str, Any] = json.loads(out.read_text())
        return report


# ------------------------------------------------------------------------------ one rank


def _state(world: int, size_mib: int, dim: int, fill: bool) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    rows = max(world, (size_mib << 20) // (_TENSORS * _COLUMNS * 4))
    state = {}
    for index in range(_TENSORS):
        if fill:
            full = torch.randn(rows, _COLUMNS, generator=torch.Generator().manual_seed(index))
        else:
            full = torch.zeros(rows, _COLUMNS)
        state[f"layer{index}.weight"] = distribute_tensor(full, mesh, [Shard(dim)])
    return {"model": state, "step": 1}


def _writer(backend: str, path: Path) -> Any:
    import torch.distributed.checkpoint as dcp

    import fastckpt.dcp

    if backend == "fastckpt":
        return fastckpt.dcp.Writer(path)
    return dcp.FileSystemWriter(path, thread_count=int(backend.split("-")[1][0]))


def _reader(backend: str, path: Path) -> Any:
    import torch.distributed.checkpoint as dcp

    import fastckpt.dcp

    if backend == "fastckpt":
        return fastckpt.dcp.Reader(path)
    return dcp.FileSystemReader(path)


def _timed(barrier: Callable[[], Any], action: Callable[[], Any]) -> float:
    """Seconds ``action`` takes, between barriers (the slowest rank's time)."""
    barrier()
    start = time.perf_counter()
    action()
    barrier()
    return time.perf_counter() - start


def _worker(rank: int, settings: dict[str, Any], out: Path) -> None:
    import warnings

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    warnings.filterwarnings("ignore")
    root = Path(settings["work_dir"])
    world = int(settings["world"])
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{root / 'rendezvous'}", rank=rank, world_size=world
    )
    cache = CacheControl.probe(bool(settings["cold"]))
    state = _state(world, int(settings["size_mib"]), 0, True)
    group: Any = dist.new_group(backend="gloo")
    times: dict[str, dict[str, list[float]]] = {
        backend: {"save_s": [], "load_s": [], "stall_s": []} for backend in BACKENDS
    }

    def drop_cache() -> None:
        dist.barrier()
        if rank == 0:
            cache.drop()
        dist.barrier()

    for repeat in range(int(settings["repeats"])):
        for backend in BACKENDS:
            path = root / f"{backend}-{repeat}"
            writer = _writer(backend, path)
            seconds = _timed(dist.barrier, partial(dcp.save, state, storage_writer=writer))
            times[backend]["save_s"].append(seconds)
        for backend in BACKENDS:
            target = _state(world, int(settings["size_mib"]), 1, False)
            drop_cache()
            path = root / f"{backend}-{repeat}"
            reader = _reader(backend, path)
            seconds = _timed(dist.barrier, partial(dcp.load, target, storage_reader=reader))
            times[backend]["load_s"].append(seconds)
            if repeat == 0:
                check = target["model"]["layer0.weight"].full_tensor()
                expected = torch.randn(check.shape, generator=torch.Generator().manual_seed(0))
                if not same_bits(check, expected):
                    raise RuntimeError(f"{backend}: resharded load returned other data")
        for backend in BACKENDS:
            path = root / f"async-{backend}-{repeat}"
            writer = _writer(backend, path)
            dcp.async_save(state, storage_writer=writer, process_group=group).result()  # type: ignore[union-attr]
            dist.barrier()
            start = time.perf_counter()
            future = dcp_staged(dcp.async_save(state, storage_writer=writer, process_group=group))
            stall = time.perf_counter() - start  # until the state may be changed (staged)
            future.result()
            times[backend]["stall_s"].append(stall)
        dist.barrier()
        for entry in root.iterdir():
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
    if rank == 0:
        rows = {
            backend: {op: summarize(values) for op, values in ops.items()}
            for backend, ops in times.items()
        }
        out.write_text(json.dumps(_report(settings, cache.label, rows), indent=1))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # torch 2.15's gloo sometimes aborts in interpreter teardown


def _report(settings: dict[str, Any], cache: str, rows: dict[str, Any]) -> dict[str, Any]:
    def median(backend: str, op: str) -> float:
        value = rows[backend][op]["median"]
        return float(value) if value else float("nan")

    ratios = {}
    for other in BACKENDS[1:]:
        ratios[f"save_speedup_vs_{other}"] = median(other, "save_s") / median("fastckpt", "save_s")
        ratios[f"load_speedup_vs_{other}"] = median(other, "load_s") / median("fastckpt", "load_s")
        ratios[f"stall_ratio_vs_{other}"] = median("fastckpt", "stall_s") / median(other, "stall_s")
    config = {k: v for k, v in settings.items() if k != "work_dir"}
    return {"scenario": "sharded", "config": config, "cache": cache, "rows": rows, "ratios": ratios}


def format_report(report: dict[str, Any]) -> str:
    """A plain-text table of a :func:`run_sharded` report."""
    config = report["config"]
    lines = [
        f"sharded: {config['size_mib']} MiB over {config['world']} ranks, "
        f"{config['repeats']} repeat(s), {report['cache']} loads (medians, seconds)",
        f"{'backend':10} {'save':>8} {'reshard-load':>13} {'async stall':>12}",
    ]
    for backend, row in report["rows"].items():
        cells = [row[op]["median"] for op in ("save_s", "load_s", "stall_s")]
        lines.append(
            f"{backend:10} {cells[0]:8.3f} {cells[1]:13.3f} {cells[2]:12.4f}"
            if None not in cells
            else f"{backend:10} (no data)"
        )
    lines += [f"{name}: {value:.2f}" for name, value in report["ratios"].items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Command line: run the scenario and print (and optionally save) the report."""
    parser = argparse.ArgumentParser(prog="python -m fastckpt.bench.sharded", description=__doc__)
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--work-dir", type=Path, default=Path.cwd())
    parser.add_argument(
        "--drop-caches",
        action="store_true",
        help="drop the system-wide page cache before each load (needs root); default: warm",
    )
    parser.add_argument(
        "--out", type=Path, help="write the JSON report here (and the table next to it, .md)"
    )
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--settings", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        _worker(args.worker, json.loads(args.settings), args.out)
        return 0
    report = run_sharded(
        ShardedConfig(
            size_mib=args.size_mib,
            world=args.world,
            repeats=args.repeats,
            work_dir=args.work_dir,
            cold=args.drop_caches,
        )
    )
    print(format_report(report))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
        args.out.with_suffix(".md").write_text(
            f"# Sharded scenario\n\n```text\n{format_report(report)}\n```\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
