"""Sharded checkpoints on object storage: 2 FSDP2 ranks save to one local S3 server.

``python -m fastckpt.bench s3-sharded --size-mib 256 --repeat 3 --out benches/results`` starts
a local S3-compatible server on 127.0.0.1 (:func:`fastckpt.bench.s3.local_server`: moto in its
own process, or ``--server s3s`` for the Rust ``s3s-fs`` that ``make s3-server`` builds), and
spawns gloo ranks on CPU holding one FSDP2 state: a transformer-like model
(:func:`fastckpt.bench.state.plan_state`, the shapes and values of the other scenarios) whose
blocks and root are ``fully_shard``-ed, with its Adam ``exp_avg`` / ``exp_avg_sq``, all
DTensors sharded along dimension 0. Every writer saves and loads the same state through DCP:

* ``fastckpt``: ``fastckpt.dcp.Writer`` / ``Reader`` on an ``s3://bucket/prefix`` id (options
  from the AWS environment: the defaults a user gets, crc32c verified on load);
* ``s3torchconnector``: ``s3torchconnector.dcp.S3StorageWriter`` / ``S3StorageReader`` (AWS CRT,
  path-style addressing, the endpoint from ``AWS_ENDPOINT_URL``; its default DCP-optimized
  reader);
* ``fsspec``: DCP's ``FsspecWriter`` / ``FsspecReader`` on s3fs (endpoint and key given as
  storage options).

Measured, each a median over ``--repeat`` runs with the writer order rotated every repeat:

1. durable save: ``dcp.save`` on 2 ranks, the wall seconds from a barrier until every rank
   returned (a second barrier); throughput = state bytes / seconds;
2. resharded load: ``dcp.load`` of the last saved checkpoint onto 1 rank and onto 3 ranks
   (fresh processes, zeroed templates); after each timed load, outside the timed region,
   every local shard is compared bitwise with the values saved;
3. ``dcp.async_save`` on 2 ranks, after one untimed warm-up save with the same writer object:
   the seconds until the calling (training) thread may change the state again (``async_save``
   returned and the state is staged, :func:`fastckpt.bench.writers.dcp_staged`: every writer
   here stages before returning), and until its future completes (the slowest rank's
   figures). The peers stage through one
   ``DefaultStager(StagingOptions(False, False, False, False))`` each, kept across saves: its
   cached host copies are DCP's cheapest stall without CUDA (``cache_staged_state_dict=True``
   pins memory, which needs a GPU); fastckpt's writer is its own stager.

An S3 upload is durable when the PUT (or CompleteMultipartUpload) returns, which every writer
waits for. Client CPU (all ranks together) and server CPU seconds are recorded per operation:
on a small machine the server, not the client, often sets the pace. A writer that fails is
recorded as a row with its error text; its later operations are skipped.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from fastckpt.bench.environment import describe, load_average
from fastckpt.bench.s3 import local_server, process_cpu
from fastckpt.bench.state import build_state, plan_state
from fastckpt.bench.stats import summarize

__all__ = [
    "TARGETS",
    "WRITERS",
    "S3ShardedConfig",
    "build_parser",
    "main",
    "markdown",
    "ratios",
    "run",
]

#: The writers compared, in report order (fastckpt first).
WRITERS = ("fastckpt", "s3torchconnector", "fsspec")
#: fastckpt against the best peer: (figure, comparison, bound) from issue 23.
TARGETS = {
    "save_speedup": (">=", 1.5),
    "load_speedup_1_rank": (">=", 1.2),
    "load_speedup_3_ranks": (">=", 1.2),
    "stall_ratio": ("<=", 0.5),
}
BUCKET = "fastckpt-bench"
REGION = "us-east-1"
_KEY_ID = "bench"  # the key both local servers accept (s3s-fs only this one)
_SECRET = "bench-secret"
_LR = 0.00123  # the saved optimizer's learning rate (templates hold another one)


@dataclass
class S3ShardedConfig:
    """One run of the scenario.

    Attributes:
        size_mib: state size, all ranks together (weights + both Adam moments, fp32).
        repeats: measurements per writer and operation.
        save_world: ranks that save (and async-save).
        load_worlds: the rank counts the checkpoints are loaded onto (resharded).
        writers: a subset of :data:`WRITERS`.
        server: ``"moto"`` or ``"s3s"`` (see :func:`fastckpt.bench.s3.local_server`).
        peer_threads: ``thread_count`` of the two ``FileSystemWriter``-based peers.
        fastckpt_options: ``S3Options`` fields for fastckpt's checkpoints (each rank calls
            ``fastckpt.configure_storage`` on its prefix); empty: the defaults and the AWS
            environment, what a user gets.
        timeout_s: limit for each multi-rank launch (and the process groups' timeout).
    """

    size_mib: int = 256
    repeats: int = 3
    save_world: int = 2
    load_worlds: tuple[int, ...] = (1, 3)
    writers: tuple[str, ...] = WRITERS
    server: str = "moto"
    peer_threads: int = 1
    fastckpt_options: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 1800.0
    work_dir: Path = field(default_factory=lambda: Path(tempfile.gettempdir()))


# ------------------------------------------------------------------------------ orchestrator


@contextmanager
def _server(kind: str) -> Iterator[tuple[str, int, str]]:
    """``(endpoint, pid, label)`` of a fresh local server with the benchmark's bucket."""
    import boto3

    with tempfile.TemporaryDirectory(prefix="fastckpt-s3s-") as data:
        data_dir = Path(data) if kind == "s3s" else None
        with local_server(kind, data_dir) as (endpoint, pid):
            boto3.client(
                "s3",
                endpoint_url=endpoint,
                region_name=REGION,
                aws_access_key_id=_KEY_ID,
                aws_secret_access_key=_SECRET,
            ).create_bucket(Bucket=BUCKET)
            label = {"moto": "moto (Python)", "s3s": "s3s-fs (Rust)"}.get(kind, kind)
            yield endpoint, pid, f"{label}, local, 127.0.0.1"


def _versions() -> dict[str, str]:
    from importlib import metadata

    found = {}
    for name in ("s3torchconnector", "s3torchconnectorclient", "s3fs", "fsspec", "moto"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "not installed"
    return found


def _launch(world: int, settings: dict[str, Any], env: dict[str, str], root: Path) -> Any:
    """Run the worker as ranks ``0..world-1``; rank 0's report."""
    out = root / f"report-{settings['phase']}-{world}.json"
    settings = {**settings, "world": world, "rendezvous": str(root / f"rdzv-{world}")}
    procs = [
        subprocess.Popen(
            [
                *(sys.executable, "-m", "fastckpt.bench.s3_sharded", "--worker", str(rank)),
                *("--settings", json.dumps(settings), "--report", str(out)),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for rank in range(world)
    ]
    errors = []
    deadline = time.monotonic() + float(settings["timeout_s"])
    for rank, proc in enumerate(procs):
        try:
            _, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        if proc.returncode != 0:
            errors.append(f"rank {rank} exited {proc.returncode}: {err[-4000:]}")
    if errors:
        raise RuntimeError(
            f"s3-sharded {settings['phase']} on {world} ranks failed:\n" + "\n".join(errors)
        )
    return json.loads(out.read_text())


def run(config: S3ShardedConfig) -> dict[str, Any]:
    """Run the scenario; returns the JSON document (see :func:`markdown` for its table)."""
    unknown = [name for name in config.writers if name not in WRITERS]
    if unknown or not config.writers:
        raise ValueError(f"unknown writer(s) {unknown}; choose from {', '.join(WRITERS)}")
    spec = plan_state(config.size_mib / 1024)
    nbytes = spec.nbytes
    load_before = load_average()
    started = time.perf_counter()
    with (
        _server(config.server) as (endpoint, pid, label),
        tempfile.TemporaryDirectory(prefix="fastckpt-s3-sharded-", dir=config.work_dir) as tmp,
    ):
        env = {
            **os.environ,
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_REGION": REGION,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_ACCESS_KEY_ID": _KEY_ID,
            "AWS_SECRET_ACCESS_KEY": _SECRET,
            "AWS_EC2_METADATA_DISABLED": "true",
            "OMP_NUM_THREADS": "1",
        }
        env.pop("AWS_PROFILE", None)
        env.pop("AWS_SESSION_TOKEN", None)
        settings: dict[str, Any] = {
            "size_mib": config.size_mib,
            "repeats": config.repeats,
            "writers": list(config.writers),
            "endpoint": endpoint,
            "bucket": BUCKET,
            "prefix": f"bench-{uuid.uuid4().hex[:8]}",
            "server_pid": pid,
            "peer_threads": config.peer_threads,
            "fastckpt_options": config.fastckpt_options,
            "timeout_s": config.timeout_s,
        }
        root = Path(tmp)
        saved = _launch(config.save_world, {**settings, "phase": "save"}, env, root)
        loads = {}
        for world in config.load_worlds:
            loadable = [w for w in config.writers if saved["errors"].get(w) is None]
            loads[str(world)] = _launch(
                world, {**settings, "phase": "load", "loadable": loadable}, env, root
            )
    return _document(config, nbytes, label, saved, loads, load_before, started)


def _document(
    config: S3ShardedConfig,
    nbytes: int,
    label: str,
    saved: dict[str, Any],
    loads: dict[str, Any],
    load_before: list[float],
    started: float,
) -> dict[str, Any]:
    mib = nbytes / 2**20
    rows: dict[str, Any] = {}
    for name in config.writers:
        raw = saved["raw"][name]
        save = summarize(raw["save_s"])
        row: dict[str, Any] = {
            "error": saved["errors"].get(name),
            "save_s": save,
            "save_mib_s": mib / save["median"] if save["median"] else None,
            "save_client_cpu_s": summarize(raw["save_client_cpu_s"]),
            "save_server_cpu_s": summarize(raw["save_server_cpu_s"]),
            "async_stall_s": summarize(raw["stall_s"]),
            "async_total_s": summarize(raw["total_s"]),
            "async_error": saved["async_errors"].get(name),
            "loads": {},
            "raw": {"save": raw},
        }
        for world, report in loads.items():
            figures = report["raw"].get(name, {})
            load = summarize(figures.get("load_s", []))
            row["loads"][world] = {
                "load_s": load,
                "load_mib_s": mib / load["median"] if load["median"] else None,
                "client_cpu_s": summarize(figures.get("client_cpu_s", [])),
                "server_cpu_s": summarize(figures.get("server_cpu_s", [])),
                "verified": figures.get("verified", []),
                "needed_bytes": summarize(figures.get("needed_bytes", [])),
                "fetched_bytes": summarize(figures.get("fetched_bytes", [])),
                "error": report["errors"].get(name)
                or (None if name in report["loadable"] else "not saved (the save failed)"),
            }
            row["raw"][f"load_{world}"] = figures
        rows[name] = row
    after = load_average()
    cores = os.cpu_count() or 1
    return {
        "scenario": "s3-sharded",
        "server": label,
        "state_bytes": nbytes,
        "tensors": saved["tensors"],
        "save_world": config.save_world,
        "load_worlds": list(config.load_worlds),
        "repeats": config.repeats,
        "peer_threads": config.peer_threads,
        "fastckpt_options": config.fastckpt_options,
        "writers": rows,
        "ratios": ratios(rows, config.load_worlds),
        "targets": {name: {"op": op, "bound": bound} for name, (op, bound) in TARGETS.items()},
        "load_average": {"before": load_before, "after": after},
        "busy_machine": max([*load_before, *after, 0.0]) > 0.5 * cores,
        "wall_s": time.perf_counter() - started,
        "versions": _versions(),
        "environment": describe("."),
    }


def _median(summary: dict[str, Any]) -> float | None:
    value = summary.get("median")
    return float(value) if value else None


def ratios(rows: dict[str, Any], load_worlds: Sequence[int]) -> dict[str, Any]:
    """fastckpt against the best peer for each figure: ``{figure: {"value", "best_peer",
    "met"}}`` (``value`` None when fastckpt or every peer lacks the figure). Speedups are the
    peer's seconds over fastckpt's; the stall ratio is fastckpt's stall over the peer's."""

    def figure(name: str, key: str) -> float | None:
        row = rows[name]
        if key.startswith("load_"):
            load = row["loads"].get(key.removeprefix("load_"))
            return None if load is None or load["error"] else _median(load["load_s"])
        if row["error"] is not None:
            return None
        if key == "stall" and row["async_error"] is not None:
            return None
        return _median(row["save_s" if key == "save" else "async_stall_s"])

    keys = {"save_speedup": "save", "stall_ratio": "stall"}
    for world in load_worlds:
        keys[f"load_speedup_{world}_rank{'s' if world != 1 else ''}"] = f"load_{world}"
    peers = [name for name in rows if name != "fastckpt"]
    result: dict[str, Any] = {}
    for name, key in keys.items():
        ours = figure("fastckpt", key) if "fastckpt" in rows else None
        theirs = {peer: figure(peer, key) for peer in peers}
        known = {peer: value for peer, value in theirs.items() if value is not None}
        if ours is None or not known:
            result[name] = {"value": None, "best_peer": None, "met": None}
            continue
        best = min(known, key=lambda peer: known[peer])
        value = ours / known[best] if key == "stall" else known[best] / ours
        op, bound = TARGETS.get(name, (">=" if key != "stall" else "<=", float("nan")))
        met = value >= bound if op == ">=" else value <= bound
        result[name] = {"value": value, "best_peer": best, "met": met, "op": op, "bound": bound}
    return result


# ------------------------------------------------------------------------------ markdown


def _span(summary: dict[str, Any], scale: float = 1.0, pattern: str = "{:.2f}") -> str:
    if summary.get("median") is None:
        return "-"
    median, low, high = (scale * summary[k] for k in ("median", "min", "max"))
    return f"{pattern.format(median)} ({pattern.format(low)}-{pattern.format(high)})"


def _cell(row_error: str | None, text: str) -> str:
    return "failed" if row_error else text


def markdown(document: dict[str, Any]) -> str:
    """The results as markdown: the figures per writer, the ratios against the targets, the
    errors of failed writers, the load average."""
    mib = document["state_bytes"] / 2**20
    worlds = [str(w) for w in document["load_worlds"]]
    rows = document["writers"]
    load = document["load_average"]
    lines = [
        f"# Sharded checkpoints on object storage: {mib:.0f} MiB FSDP2 state, {document['server']}",
        "",
        f"{document['tensors']} tensors (weights + Adam exp_avg/exp_avg_sq, fp32, DTensors "
        f"sharded on dim 0), saved by {document['save_world']} gloo ranks on CPU, loaded "
        f"resharded onto {' and '.join(worlds)} rank(s); {document['repeats']} repeat(s), "
        "writer order rotated each repeat; median (min-max) seconds. Load average (1/5/15 "
        f"min) before {load['before']}, after {load['after']} on "
        f"{document['environment']['cpu_count']} CPUs.",
        "",
    ]
    if document.get("busy_machine"):
        lines += [
            "**The machine was busy**: its load average exceeded half its CPU count while this "
            "ran (other jobs shared the CPUs with the ranks and the server); absolute figures "
            "are low and noisy, the side-by-side ratios less so.",
            "",
        ]
    header = "| writer | save s | save MiB/s | " + " | ".join(
        f"load on {w} s | verified ({w})" for w in worlds
    )
    lines += [
        header + " | async_save stall s | async total s |",
        "|---|---|---|" + "---|---|" * len(worlds) + "---|---|",
    ]
    for name, row in rows.items():
        error = row["error"]
        cells = [
            _cell(error, _span(row["save_s"])),
            _cell(error, "-" if row["save_mib_s"] is None else f"{row['save_mib_s']:.1f}"),
        ]
        for world in worlds:
            entry = row["loads"][world]
            verified = entry["verified"]
            cells += [
                _cell(entry["error"], _span(entry["load_s"])),
                "-" if not verified else ("bitwise" if all(verified) else "MISMATCH"),
            ]
        async_error = error or row["async_error"]
        cells += [
            _cell(async_error, _span(row["async_stall_s"], pattern="{:.3f}")),
            _cell(async_error, _span(row["async_total_s"])),
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "CPU seconds per operation, median: client (all ranks together) / server.",
        "",
        "| writer | save | " + " | ".join(f"load on {w}" for w in worlds) + " |",
        "|---|---|" + "---|" * len(worlds),
    ]
    for name, row in rows.items():
        cells = [f"{_cpu(row['save_client_cpu_s'])} / {_cpu(row['save_server_cpu_s'])}"]
        for world in worlds:
            entry = row["loads"][world]
            cells.append(f"{_cpu(entry['client_cpu_s'])} / {_cpu(entry['server_cpu_s'])}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    fetched = [
        (world, rows["fastckpt"]["loads"][world])
        for world in worlds
        if "fastckpt" in rows and rows["fastckpt"]["loads"][world]["fetched_bytes"].get("median")
    ]
    if fetched:
        from fastckpt.container.sharded.chunks import OBJECT_STORE_GAP

        lines += [
            "",
            "fastckpt.dcp.Reader, all ranks together, per load: "
            + "; ".join(
                f"onto {world} rank(s) fetched {entry['fetched_bytes']['median'] / 2**20:.0f} "
                f"MiB for {entry['needed_bytes']['median'] / 2**20:.0f} MiB needed"
                for world, entry in fetched
            )
            + " (needed: the ranges of the plan rounded out to verification blocks; fetched: "
            f"with the gaps of up to {OBJECT_STORE_GAP >> 20} MiB that coalesced ranges share).",
        ]
    lines += [
        "",
        "fastckpt against the best peer (speedup: the peer's seconds / fastckpt's; stall "
        "ratio: fastckpt's stall / the peer's), against the targets of issue 23.",
        "",
        "| figure | fastckpt vs best peer | best peer | target | met |",
        "|---|---|---|---|---|",
    ]
    for name, entry in document["ratios"].items():
        if entry["value"] is None:
            lines.append(f"| {name} | - | - | - | n/a |")
            continue
        lines.append(
            f"| {name} | {entry['value']:.2f}x | {entry['best_peer']} | "
            f"{entry['op']} {entry['bound']}x | {'yes' if entry['met'] else 'no'} |"
        )
    failures = []
    for name, row in rows.items():
        for what, error in [
            ("save", row["error"]),
            ("async_save", row["async_error"]),
            *((f"load on {w}", row["loads"][w]["error"]) for w in worlds),
        ]:
            if error:
                failures.append(f"| {name} | {what} | {_one_line(error)} |")
    if failures:
        lines += ["", "Failures:", "", "| writer | operation | error |", "|---|---|---|"]
        lines += failures
    versions = ", ".join(f"{k} {v}" for k, v in document["versions"].items())
    env = document["environment"]
    lines += [
        "",
        f"torch {env['torch']}, fastckpt {env['fastckpt']}, {versions}; peers' "
        f"thread_count {document['peer_threads']}; fastckpt's S3 options: "
        f"{document['fastckpt_options'] or 'the defaults'}; {env['cpu_model']}, "
        f"{env['memory_gib']} GiB; the whole run took {document['wall_s']:.0f} s.",
    ]
    return "\n".join(lines) + "\n"


def _cpu(summary: dict[str, Any]) -> str:
    return "-" if summary.get("median") is None else f"{summary['median']:.2f}"


def _one_line(text: str, limit: int = 400) -> str:
    flat = " ".join(text.split()).replace("|", "\\|")
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


# ------------------------------------------------------------------------------ one rank


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class _Rank:
    """This process's place in the run: its process group, mesh, state and writers."""

    def __init__(self, rank: int, settings: dict[str, Any]) -> None:
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        self.rank = rank
        self.settings = settings
        self.world = int(settings["world"])
        self.writers: list[str] = list(settings["writers"])
        self.base = f"s3://{settings['bucket']}/{settings['prefix']}"
        torch.set_num_threads(1)
        timeout = timedelta(seconds=float(settings["timeout_s"]))
        dist.init_process_group(
            "gloo",
            init_method=f"file://{settings['rendezvous']}",
            rank=rank,
            world_size=self.world,
            timeout=timeout,
        )
        self.mesh = init_device_mesh("cpu", (self.world,))
        self.spec = plan_state(int(settings["size_mib"]) / 1024)
        self.server_pid = settings.get("server_pid")
        self.errors: dict[str, str | None] = dict.fromkeys(self.writers)
        if settings.get("fastckpt_options"):
            import fastckpt

            fastckpt.configure_storage(f"{self.base}/fastckpt", **settings["fastckpt_options"])

    # ---------------------------------------------------------------- state

    def fsdp_state(self, expected: dict[str, Any] | None) -> tuple[dict[str, Any], Any]:
        """``({"model", "optim"}, optimizer)`` of an FSDP2 model + Adam: the values of
        ``expected`` (the full flat state) in every local shard, or zeros (load templates)."""
        import torch
        from torch import nn
        from torch.distributed.checkpoint.state_dict import get_state_dict
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import DTensor

        shapes = self.spec.parameter_shapes()
        with torch.device("meta"):
            model = nn.Module()
            for name, shape in shapes.items():
                *path, leaf = name.split(".")
                owner = model
                for part in path:
                    if not hasattr(owner, part):
                        owner.add_module(part, nn.Module())
                    owner = getattr(owner, part)
                owner.register_parameter(leaf, nn.Parameter(torch.empty(shape)))
        layers = getattr(model, "layers", None)
        for block in layers.children() if layers is not None else ():
            fully_shard(block, mesh=self.mesh)
        fully_shard(model, mesh=self.mesh)
        model.to_empty(device="cpu")
        lr = _LR if expected is not None else 0.5
        optimizer = torch.optim.Adam(model.parameters(), lr=lr)
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, param in params.items():
                assert isinstance(param, DTensor)
                local = param.to_local()
                if expected is None:
                    local.zero_()
                else:
                    local.copy_(self._local(expected[f"model.{name}"]))
                moments = {}
                for moment in ("exp_avg", "exp_avg_sq"):
                    value = torch.zeros_like(local)
                    if expected is not None:
                        value.copy_(self._local(expected[f"optim.{name}.{moment}"]))
                    moments[moment] = DTensor.from_local(
                        value,
                        param.device_mesh,
                        param.placements,
                        run_check=False,
                        shape=param.shape,
                        stride=param.stride(),
                    )
                step = torch.tensor(1.0 if expected is not None else 0.0)
                optimizer.state[param] = {"step": step, **moments}
        msd, osd = get_state_dict(model, optimizer)
        return {"model": msd, "optim": osd}, optimizer

    def _local(self, full: Any) -> Any:
        """This rank's dim-0 shard of a full tensor (DTensor's split, no communication)."""
        from torch.distributed.tensor import Shard, distribute_tensor

        return distribute_tensor(full, self.mesh, [Shard(0)], src_data_rank=None).to_local()

    def mismatches(self, state: dict[str, Any], expected: dict[str, Any]) -> list[str]:
        """The names whose loaded local shard differs (bitwise) from the saved values."""
        from fastckpt.bench.compare import same_bits

        names = set(self.spec.parameter_shapes())
        bad = []
        if set(state["model"]) != names or set(state["optim"]["state"]) != names:
            bad.append("the loaded state does not hold every parameter")
        for name, tensor in state["model"].items():
            if not same_bits(tensor.to_local(), self._local(expected[f"model.{name}"])):
                bad.append(f"model.{name}")
        osd = state["optim"]
        for name, entry in osd["state"].items():
            for moment in ("exp_avg", "exp_avg_sq"):
                want = self._local(expected[f"optim.{name}.{moment}"])
                if not same_bits(entry[moment].to_local(), want):
                    bad.append(f"optim.{name}.{moment}")
            if float(entry["step"]) != 1.0:
                bad.append(f"optim.{name}.step")
        if [group["lr"] for group in osd["param_groups"]] != [_LR] * len(osd["param_groups"]):
            bad.append("optim.param_groups.lr")
        return bad

    @staticmethod
    def zero(state: dict[str, Any]) -> None:
        """Reset a template to zeros (a load that wrote nothing fails the check)."""
        import torch

        with torch.no_grad():
            for tensor in state["model"].values():
                tensor.to_local().zero_()
            for entry in state["optim"]["state"].values():
                for moment in ("exp_avg", "exp_avg_sq"):
                    entry[moment].to_local().zero_()
                entry["step"].zero_()
            for group in state["optim"]["param_groups"]:
                group["lr"] = 0.5

    # ---------------------------------------------------------------- writers

    def storage_options(self) -> dict[str, Any]:
        """s3fs options reaching the local server (FsspecWriter / FsspecReader kwargs)."""
        return {
            "endpoint_url": self.settings["endpoint"],
            "key": _KEY_ID,
            "secret": _SECRET,
            "client_kwargs": {"region_name": REGION},
        }

    def writer(self, name: str, path: str) -> Any:
        """A storage writer of ``name`` for checkpoint ``path``."""
        threads = int(self.settings["peer_threads"])
        if name == "fastckpt":
            import fastckpt.dcp

            return fastckpt.dcp.Writer(path)
        if name == "s3torchconnector":
            from s3torchconnector import S3ClientConfig
            from s3torchconnector.dcp import S3StorageWriter

            return S3StorageWriter(
                REGION,
                path,
                s3client_config=S3ClientConfig(force_path_style=True),
                thread_count=threads,
            )
        if name == "fsspec":
            try:  # exported in recent torch; 2.11, say, holds it in a module of its own
                from torch.distributed.checkpoint import FsspecWriter
            except ImportError:
                from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

            return FsspecWriter(path, thread_count=threads, **self.storage_options())
        raise ValueError(f"unknown writer {name!r}")

    def retarget(self, name: str, writer: Any, path: str) -> None:
        """Point a writer (kept for its warm staging buffers) at another checkpoint id."""
        if name == "fastckpt":
            writer.reset(path)
        elif name == "fsspec":
            writer.path = writer.fs.init_path(path, **self.storage_options())
        else:
            writer.path = writer.fs.init_path(path)

    def reader(self, name: str, path: str) -> Any:
        """A storage reader of ``name`` for checkpoint ``path``."""
        if name == "fastckpt":
            import fastckpt.dcp

            return fastckpt.dcp.Reader(path)
        if name == "s3torchconnector":
            from s3torchconnector import S3ClientConfig
            from s3torchconnector.dcp import S3StorageReader

            return S3StorageReader(
                REGION, path, s3client_config=S3ClientConfig(force_path_style=True)
            )
        if name == "fsspec":
            try:
                from torch.distributed.checkpoint import FsspecReader
            except ImportError:
                from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

            return FsspecReader(path, **self.storage_options())
        raise ValueError(f"unknown writer {name!r}")

    def remove(self, path: str) -> None:
        """Rank 0: delete every object under ``path`` (untimed, between barriers)."""
        import torch.distributed as dist

        if self.rank == 0:
            import boto3

            client = boto3.client(
                "s3",
                endpoint_url=self.settings["endpoint"],
                region_name=REGION,
                aws_access_key_id=_KEY_ID,
                aws_secret_access_key=_SECRET,
            )
            bucket, prefix = path.removeprefix("s3://").split("/", 1)
            pages = client.get_paginator("list_objects_v2").paginate(
                Bucket=bucket, Prefix=prefix + "/"
            )
            for page in pages:
                keys = [{"Key": item["Key"]} for item in page.get("Contents", [])]
                if keys:
                    client.delete_objects(Bucket=bucket, Delete={"Objects": keys})
        dist.barrier()

    # ---------------------------------------------------------------- timing

    def timed(self, action: Callable[[], Any]) -> tuple[float, float, float, str | None]:
        """``(seconds, client CPU s of all ranks, server CPU s, error)`` of one collective
        ``action`` between barriers; ``error``: the first rank's failure, as every rank
        sees it."""
        import torch
        import torch.distributed as dist

        dist.barrier()
        cpu, served = _cpu_seconds(), process_cpu(self.server_pid)
        start = time.perf_counter()
        error = None
        try:
            action()
        except Exception as exc:  # recorded as the writer's row
            error = f"{type(exc).__name__}: {exc}"[:4000]
        dist.barrier()
        seconds = time.perf_counter() - start
        server = process_cpu(self.server_pid) - served
        used = torch.tensor([_cpu_seconds() - cpu], dtype=torch.float64)
        dist.all_reduce(used)
        return seconds, float(used.item()), server, self.first_error(error)

    def first_error(self, error: str | None) -> str | None:
        import torch.distributed as dist

        gathered: list[str | None] = [None] * self.world
        dist.all_gather_object(gathered, error)
        for rank, text in enumerate(gathered):
            if text:
                return f"rank {rank}: {text}"
        return None

    def slowest(self, *values: float) -> list[float]:
        """Each figure's maximum over the ranks."""
        import torch
        import torch.distributed as dist

        tensor = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return [float(v) for v in tensor.tolist()]

    def total(self, *values: float) -> list[float]:
        """Each figure's sum over the ranks."""
        import torch
        import torch.distributed as dist

        tensor = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(tensor)
        return [float(v) for v in tensor.tolist()]

    def order(self, repeat: int, names: Sequence[str]) -> list[str]:
        shift = repeat % len(names) if names else 0
        return [*names[shift:], *names[:shift]]


def _save_phase(rank: _Rank) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from fastckpt.bench.writers import dcp_staged

    expected = build_state(rank.spec)
    state, _optimizer = rank.fsdp_state(expected)
    del expected
    repeats = int(rank.settings["repeats"])
    keys = ("save_s", "save_client_cpu_s", "save_server_cpu_s", "stall_s", "total_s")
    raw: dict[str, dict[str, list[float]]] = {
        name: {key: [] for key in keys} for name in rank.writers
    }
    async_errors: dict[str, str | None] = dict.fromkeys(rank.writers)
    for repeat in range(repeats):
        for name in rank.order(repeat, rank.writers):
            if rank.errors[name] is not None:
                continue
            path = f"{rank.base}/{name}/save-{repeat}"
            writer = rank.writer(name, path)
            save = functools.partial(dcp.save, state, storage_writer=writer)
            seconds, cpu, server, error = rank.timed(save)
            if error is not None:
                rank.errors[name] = error
                continue
            raw[name]["save_s"].append(seconds)
            raw[name]["save_client_cpu_s"].append(cpu)
            raw[name]["save_server_cpu_s"].append(server)
            if repeat:
                rank.remove(f"{rank.base}/{name}/save-{repeat - 1}")  # the loads use the last
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    group: Any = dist.new_group(backend="gloo")
    writers: dict[str, Any] = {}
    stagers: dict[str, Any] = {}
    for repeat in range(-1, repeats):  # -1: the untimed warm-up save of each writer
        for name in rank.order(max(repeat, 0), rank.writers):
            if rank.errors[name] is not None or async_errors[name] is not None:
                continue
            path = f"{rank.base}/{name}/async-{repeat + 1}"
            error = None
            stall = total = 0.0
            try:
                if name not in writers:
                    writers[name] = rank.writer(name, path)
                    if name != "fastckpt":
                        stagers[name] = DefaultStager(StagingOptions(False, False, False, False))
                writer = writers[name]
                rank.retarget(name, writer, path)
                dist.barrier()
                start = time.perf_counter()
                response = dcp.async_save(
                    state,
                    storage_writer=writer,
                    process_group=group,
                    async_stager=stagers.get(name),
                )
                upload = dcp_staged(response)
                stall = time.perf_counter() - start  # until the state may be changed (staged)
                upload.result()
                total = time.perf_counter() - start
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"[:4000]
            error = rank.first_error(error)
            if error is not None:
                async_errors[name] = error
                continue
            stall, total = rank.slowest(stall, total)
            if repeat >= 0:
                raw[name]["stall_s"].append(stall)
                raw[name]["total_s"].append(total)
            rank.remove(path)
    for stager in stagers.values():
        stager.close()
    return {
        "raw": raw,
        "errors": rank.errors,
        "async_errors": async_errors,
        "tensors": 3 * len(rank.spec.parameter_shapes()),
    }


def _load_phase(rank: _Rank) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    expected = build_state(rank.spec)
    templates, _optimizer = rank.fsdp_state(None)
    loadable = [name for name in rank.writers if name in rank.settings["loadable"]]
    last = int(rank.settings["repeats"]) - 1
    keys = ("load_s", "client_cpu_s", "server_cpu_s")
    raw: dict[str, dict[str, list[Any]]] = {
        name: {key: [] for key in (*keys, "verified", "mismatches")} for name in loadable
    }
    for repeat in range(int(rank.settings["repeats"])):
        for name in rank.order(repeat, loadable):
            if rank.errors[name] is not None:
                continue
            rank.zero(templates)
            reader = rank.reader(name, f"{rank.base}/{name}/save-{last}")
            load = functools.partial(dcp.load, templates, storage_reader=reader)
            seconds, cpu, server, error = rank.timed(load)
            if error is not None:
                rank.errors[name] = error
                continue
            bad = rank.mismatches(templates, expected)
            everywhere = rank.first_error(", ".join(bad[:20]) if bad else None)
            raw[name]["load_s"].append(seconds)
            raw[name]["client_cpu_s"].append(cpu)
            raw[name]["server_cpu_s"].append(server)
            raw[name]["verified"].append(everywhere is None)
            if everywhere is not None:
                raw[name]["mismatches"].append(everywhere)
            if name == "fastckpt":
                needed, fetched = rank.total(reader.bytes_read, reader.bytes_fetched)
                raw[name].setdefault("needed_bytes", []).append(needed)
                raw[name].setdefault("fetched_bytes", []).append(fetched)
    return {"raw": raw, "errors": rank.errors, "loadable": loadable}


def _worker(rank_index: int, settings: dict[str, Any], report: Path) -> None:
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    rank = _Rank(rank_index, settings)
    result = _save_phase(rank) if settings["phase"] == "save" else _load_phase(rank)
    if rank.rank == 0:
        report.write_text(json.dumps(result, indent=1))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo (and the CRT client's threads) may abort in interpreter teardown


# ------------------------------------------------------------------------------ command line


def _writer_list(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in WRITERS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown writer(s) {unknown or text!r}; choose from {','.join(WRITERS)}"
        )
    return names


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``python -m fastckpt.bench s3-sharded``."""
    parser = argparse.ArgumentParser(
        prog="python -m fastckpt.bench s3-sharded",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--size-mib", type=int, default=256, help="state size (default 256)")
    parser.add_argument(
        "--repeat", "--repeats", dest="repeats", type=int, default=3, help="default 3"
    )
    parser.add_argument("--writers", type=_writer_list, default=WRITERS)
    parser.add_argument("--server", choices=("moto", "s3s"), default="moto")
    parser.add_argument("--save-world", type=int, default=2, help="ranks that save (2)")
    parser.add_argument(
        "--load-worlds",
        type=lambda text: tuple(int(n) for n in text.split(",")),
        default=(1, 3),
        help="rank counts loaded onto, comma-separated (1,3)",
    )
    parser.add_argument("--peer-threads", type=int, default=1, help="peers' thread_count (1)")
    parser.add_argument(
        "--fastckpt-options",
        type=json.loads,
        default={},
        help="S3Options for fastckpt as JSON, e.g. '{\"multipart_threshold\": 5368709120}' "
        "(default: none, the defaults a user gets)",
    )
    parser.add_argument("--timeout-s", type=float, default=1800.0)
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="write s3-sharded-<size>mib-<server>[-tuned].json/.md here (-tuned: with "
        "--fastckpt-options)",
    )
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--settings", help=argparse.SUPPRESS)
    parser.add_argument("--report", type=Path, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the scenario, print the markdown, write ``s3-sharded-<size>mib-<server>[-tuned].json`` /
    ``.md`` to ``--out``."""
    args = build_parser().parse_args(argv)
    if args.worker is not None:
        _worker(args.worker, json.loads(args.settings), args.report)
        return 0
    if args.size_mib <= 0 or args.repeats < 1:
        print("--size-mib must be > 0 and --repeat >= 1", file=sys.stderr)
        return 2
    document = run(
        S3ShardedConfig(
            size_mib=args.size_mib,
            repeats=args.repeats,
            save_world=args.save_world,
            load_worlds=args.load_worlds,
            writers=args.writers,
            server=args.server,
            peer_threads=args.peer_threads,
            fastckpt_options=args.fastckpt_options,
            timeout_s=args.timeout_s,
        )
    )
    table = markdown(document)
    print(table)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        tuned = "-tuned" if args.fastckpt_options else ""  # never over the defaults' run
        stem = args.out / f"s3-sharded-{args.size_mib}mib-{args.server}{tuned}"
        stem.with_suffix(".json").write_text(json.dumps(document, indent=2) + "\n")
        stem.with_suffix(".md").write_text(table)
        print(f"wrote {stem}.json, {stem}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
