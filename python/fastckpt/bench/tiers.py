"""Tiers: a fast tier promoted to durable storage in the background, against checkpointing
straight to the durable storage (issue 26, item 7).

``python -m fastckpt.bench tiers --size-mib 256 --repeats 3 --out benches/results`` starts a
local S3-compatible server (:func:`fastckpt.bench.s3.local_server`: the Rust ``s3s-fs`` when
``make s3-server`` built it, else moto; ``--server``), and trains the harness's training-loop
model (:mod:`fastckpt.bench.training`: an MLP of ``layers`` x ``hidden`` trained with AdamW,
batch 64; ``hidden`` chosen so that weights + both Adam moments make ``--size-mib``) with a
``CheckpointHook`` (async saves, the default) checkpointing every N steps, for each N of
``--intervals``, in these configurations:

* ``fast``: the fast tier alone (a local directory), the reference for what the tier costs;
* ``fast+s3``: every checkpoint to the fast tier, every ``promote_every``-th promoted in the
  background to ``s3://`` on the local server;
* ``s3``: every checkpoint straight to ``s3://``;
* ``throttled``: every checkpoint straight to a *throttled directory*, a local directory
  behind a bandwidth cap standing in for a shared filesystem (:mod:`fastckpt.bench.throttled`,
  ``--throttle-write-mib-s`` / ``--throttle-read-mib-s``);
* ``fast+throttled``: the fast tier promoted to the throttled directory.

``promote_every`` is ``max(1, durable_every_steps // N)``: the durable tier receives a
checkpoint every ``--durable-every-steps`` training steps (default 50), whatever N is. At the
2-5 s a step of a large model takes, that is a durable checkpoint every few minutes; with this
loop's short steps it is a much heavier durable load than production's.

**One run** (per configuration, interval and repeat; the same model and optimizer go on
training from run to run, each run with a new hook and new roots) trains ``lead_in`` quiet
steps, then ``c`` checkpoints N steps apart; after the last one it trains until that
checkpoint's work (write, promotion) is done, at most N steps, then waits inside the clock
until every write and promotion the run started is done (``hook.close()``), then trains
``quiet_tail`` more steps. With promotion, ``c`` is ``promote_every``, at most
``--max-checkpoints``, so a tiered run holds promotions in the proportion of the steady state
(its first index is promoted; the next promoted one would be the next run's first) unless the
cap cuts it (the short intervals: their promotion share is then overstated); without, ``c`` is
at most ``--single-checkpoints`` (2: a write that queues behind the previous one is seen
once, the rest is the same cost again). The run's **cost per
checkpoint** is its time beyond what its steps take without checkpoints, divided by ``c``;
the **overhead at interval N** is that cost over N steps' time: the step-throughput loss of
a loop that checkpoints every N steps forever. A write longer than N steps queues (the next
save waits for it), and the last one's remainder after N steps is waited for, so it counts in
full, as in the steady state. Two references for "what the steps take":

* *vs baseline*: the mean step time of the runs without checkpoints (two per repeat, at its
  start and end), the step-throughput comparison;
* *in-run*: each step that overlapped no checkpoint work counts as itself, each overlapped one
  is compared with the mean of those quiet steps of the same run; run-to-run drift (other jobs
  on the machine) cancels, a slowdown of quiet steps is not counted.

Restore: one checkpoint of the same model and optimizer is saved to a RAM tier (``/dev/shm``),
the local disk, ``s3://`` and the throttled directory, and ``fastckpt.load_checkpoint`` of
the newest index (model and optimizer rebuilt, every file verified against its crc32c) is
timed from each, then compared bitwise with what was saved, outside the clock; its speed is
set against a plain memcpy (``numpy.copyto`` between touched buffers) of the state's bytes.
Also timed there: the verified read of the index's tensor files alone, into tensors allocated
beforehand (straight into them on local tiers: a restore into a model that exists), and one
retention prune
(``keep_last=2`` with three indices: the newest is read whole and verified before the oldest
goes, after every save of a hook with ``keep_last``).

Targets (issue 26): a checkpoint every 10 steps under 1 % overhead (``fast+s3``, the tiered
configuration; the others are reported with it); restore from the RAM tier at >= 0.8x memcpy.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from fastckpt.bench import throttled
from fastckpt.bench.cache import CacheControl
from fastckpt.bench.compare import same_bits
from fastckpt.bench.environment import describe, load_average
from fastckpt.bench.memory import trim_allocator
from fastckpt.bench.s3 import local_server, process_cpu, resolve_server, s3s_fs_binary
from fastckpt.bench.stats import summarize
from fastckpt.bench.training import TrainingConfig, _model, with_lock_waits

__all__ = [
    "CONFIGS",
    "RESTORE_TIERS",
    "TARGETS",
    "TiersBenchConfig",
    "build_parser",
    "hidden_for",
    "main",
    "markdown",
    "promote_every",
    "run",
]

#: The checkpointing configurations, in report order.
CONFIGS = ("fast", "fast+s3", "s3", "throttled", "fast+throttled")
#: The tiers restored from, in report order.
RESTORE_TIERS = ("ram", "disk", "s3", "throttled")
#: The issue's targets: (figure, comparison, bound).
TARGETS = {
    "overhead_every_10_steps": ("<", 0.01),
    "ram_restore_vs_memcpy": (">=", 0.8),
}
#: The configuration the overhead target is judged on.
TARGET_CONFIG = "fast+s3"
TARGET_INTERVAL = 10
BUCKET = "fastckpt-bench"
REGION = "us-east-1"
_KEY_ID = "bench"  # the key both local servers accept (s3s-fs only this one)
_SECRET = "bench-secret"
_MIB = 1 << 20
_WARMUP_STEPS = 2  # untimed steps before each run: Adam's moments exist
_SETTLE_STEPS = 2  # untimed steps after the hook allocated its staging buffers


@dataclass
class TiersBenchConfig:
    """One run of the scenario (see the module docstring).

    Attributes:
        size_mib: state size (weights + Adam moments, fp32); picks the MLP's width.
        repeats: measurements per configuration and interval (and per restore tier).
        intervals: checkpoint every N steps, for each N.
        configs: a subset of :data:`CONFIGS`.
        restore_tiers: a subset of :data:`RESTORE_TIERS`.
        server: ``"auto"`` (s3s-fs when installed), ``"s3s"`` or ``"moto"``.
        throttle_write_mib_s / throttle_read_mib_s: the throttled directory's caps.
        durable_every_steps: the durable tier gets a checkpoint every this many steps.
        keep_last: the fast tier's retention (and the one tier's, without promotion);
            None: keep every index.
        durable_keep_last: the durable tier's retention (None: keep every index).
        max_checkpoints: checkpoints per run with promotion at most (``promote_every``
            otherwise).
        single_checkpoints: checkpoints per run without promotion at most.
        lead_in: quiet steps before a run's first checkpoint.
        quiet_tail: steps after a run's checkpoint work is all done.
        baseline_steps: steps of each run without checkpoints.
        layers / batch: of the MLP (the harness's training loop).
        directory: where the local roots go (default: a temporary directory in the current
            directory, i.e. on its filesystem).
        drop_caches: drop the page cache before each timed restore (root).
        detached_promotion: promote in detached processes
            (``CheckpointHook(detached_promotion=True)``) instead of the hook's thread.
    """

    size_mib: float = 256.0
    repeats: int = 3
    intervals: tuple[int, ...] = (1, 2, 5, 10, 20, 50)
    configs: tuple[str, ...] = CONFIGS
    restore_tiers: tuple[str, ...] = RESTORE_TIERS
    server: str = "auto"
    throttle_write_mib_s: float = 100.0
    throttle_read_mib_s: float = 100.0
    durable_every_steps: int = 50
    keep_last: int | None = 2
    durable_keep_last: int | None = 2
    max_checkpoints: int = 5
    single_checkpoints: int = 2
    lead_in: int = 6
    quiet_tail: int = 4
    baseline_steps: int = 30
    layers: int = TrainingConfig.layers
    batch: int = TrainingConfig.batch
    directory: Path | None = None
    drop_caches: bool = False
    detached_promotion: bool = False
    log: Callable[[str], None] = field(default=print, repr=False)

    def as_dict(self) -> dict[str, Any]:
        """The settings as JSON values."""
        document = asdict(self)
        document.pop("log")
        document["directory"] = None if self.directory is None else str(self.directory)
        return document


def hidden_for(size_mib: float, layers: int) -> int:
    """The MLP width (a multiple of 16, at least 16) whose weights and two Adam moments in
    fp32 come closest to ``size_mib``: ``12 * layers * hidden**2`` bytes, roughly."""
    width = math.sqrt(size_mib * _MIB / (12 * layers))
    return max(16, round(width / 16) * 16)


def promote_every(interval: int, durable_every_steps: int) -> int:
    """The hook's ``promote_every`` that gives the durable tier a checkpoint every
    ``durable_every_steps`` steps when the fast tier gets one every ``interval`` steps."""
    return max(1, durable_every_steps // interval)


def checkpoints_per_run(config: TiersBenchConfig, kind: str, interval: int) -> int:
    """How many checkpoints a run of ``kind`` at ``interval`` holds (module docstring)."""
    every = promote_every(interval, config.durable_every_steps)
    cap = config.max_checkpoints if "+" in kind else config.single_checkpoints
    return max(1, min(every, cap))


# ------------------------------------------------------------------------------ the roots


@dataclass
class _Places:
    """Where one repeat's runs put their checkpoints."""

    work: Path  # local directory: fast tiers
    share: Path  # the throttled directory's local side
    s3_prefix: str  # s3://bucket/prefix
    client: Any  # boto3, to clear prefixes between runs
    s3_data: Path | None  # s3s-fs's directory (it keeps the parts of finished uploads)

    def fresh(self, kind: str, label: str) -> tuple[str, str | None]:
        """``(checkpoint_dir, durable_dir)`` for a new run of ``kind``."""
        tag = f"{label}-{uuid.uuid4().hex[:6]}"
        fast = str(self.work / f"fast-{tag}")
        s3 = f"{self.s3_prefix}/{tag}"
        share = throttled.url_for(self.share / tag)
        return {
            "fast": (fast, None),
            "fast+s3": (fast, s3),
            "s3": (s3, None),
            "throttled": (share, None),
            "fast+throttled": (fast, share),
        }[kind]

    def remove(self, root: str | None) -> None:
        """Delete a root (untimed)."""
        if root is None:
            return
        if root.startswith("s3://"):
            bucket, prefix = root.removeprefix("s3://").split("/", 1)
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=bucket, Prefix=prefix + "/"
            )
            for page in pages:
                keys = [{"Key": item["Key"]} for item in page.get("Contents", [])]
                if keys:
                    self.client.delete_objects(Bucket=bucket, Delete={"Objects": keys})
            if self.s3_data is not None:
                # s3s-fs leaks the part files of completed multipart uploads; between runs no
                # upload is in flight, so every part file is a finished one.
                for pattern in (".upload_id-*.part-*", ".upload-*.json"):
                    for leaked in self.s3_data.rglob(pattern):
                        leaked.unlink(missing_ok=True)
        elif root.startswith(f"{throttled.SCHEME}:"):
            shutil.rmtree(throttled.local_path(root), ignore_errors=True)
        else:
            shutil.rmtree(root, ignore_errors=True)


@contextmanager
def _s3(kind: str, nbytes: int) -> Iterator[tuple[str, int, str, Any, Path | None]]:
    """``(endpoint, server pid, label, boto3 client, s3s-fs data directory)`` of a fresh
    local server holding the benchmark's bucket; fastckpt configured for it."""
    import boto3

    import fastckpt

    with ExitStack() as stack:
        data_dir: Path | None = None
        where = ""
        if kind == "s3s":
            parent = _scratch_parent(nbytes)
            data_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(dir=parent)))
            where = ", objects in memory (/dev/shm)" if parent else ", objects on disk"
        endpoint, pid = stack.enter_context(local_server(kind, data_dir))
        client = boto3.client(
            "s3",
            endpoint_url=endpoint,
            region_name=REGION,
            aws_access_key_id=_KEY_ID,
            aws_secret_access_key=_SECRET,
        )
        client.create_bucket(Bucket=BUCKET)
        fastckpt.configure_storage(
            f"s3://{BUCKET}",
            endpoint_url=endpoint,
            region=REGION,
            access_key_id=_KEY_ID,
            secret_access_key=_SECRET,
        )
        label = {"moto": "moto (Python)", "s3s": "s3s-fs (Rust)"}.get(kind, kind)
        try:
            yield endpoint, pid, f"{label}, local, 127.0.0.1{where}", client, data_dir
        finally:
            fastckpt.configure_storage(f"s3://{BUCKET}")


def _scratch_parent(nbytes: int) -> str | None:
    """``/dev/shm`` for the s3s-fs objects when it has room for a few checkpoints and the
    RAM tier (the durable store then does not share the fast tier's disk), else None."""
    try:
        stats = os.statvfs("/dev/shm")
    except OSError:
        return None
    return "/dev/shm" if stats.f_bavail * stats.f_frsize > 12 * nbytes + (2 << 30) else None


# ------------------------------------------------------------------------------ training


class _Loop:
    """The model, optimizer and strategy of one run, after the warm-up steps."""

    def __init__(self, train: TrainingConfig) -> None:
        from fastckpt.training.strategy import TrainingStrategy

        self.config = train
        self.model = _model(train)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        gen = torch.Generator().manual_seed(1)
        self.inputs = torch.randn(train.batch, train.hidden, generator=gen)
        self.targets = torch.randn(train.batch, 1, generator=gen)
        self.strategy = TrainingStrategy(self.model, self.optimizer, num_steps=1)
        self.guard: Callable[[], AbstractContextManager[Any]] = nullcontext
        #: Seconds the optimizer steps waited to enter ``guard`` (a snapshot being captured).
        self.lock_wait = 0.0
        for _ in range(_WARMUP_STEPS):
            self.step()

    def step(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(self.model(self.inputs), self.targets)
        loss.backward()
        blocked = time.perf_counter()
        with self.guard():
            self.lock_wait += time.perf_counter() - blocked
            self.optimizer.step()
        self.strategy.step_count += 1

    def state_bytes(self) -> int:
        total = sum(p.numel() * p.element_size() for p in self.model.parameters())
        for moments in self.optimizer.state.values():
            for value in moments.values():
                if isinstance(value, torch.Tensor):
                    total += value.numel() * value.element_size()
        return total


class _Warnings(logging.Handler):
    """Collects the ``fastckpt`` logger's warnings during a run."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage()[:500])


def _run(
    kind: str,
    interval: int,
    config: TiersBenchConfig,
    loop: _Loop,
    places: _Places,
    server_pid: int | None,
) -> dict[str, Any]:
    """One run on ``loop`` (``kind`` ``"none"``: no checkpoints, ``config.baseline_steps``
    steps); see the module docstring for its shape."""
    from fastckpt.errors import PromotionError
    from fastckpt.training.hooks import CheckpointHook

    hook: Any = None
    root: str | None = None
    durable: str | None = None
    every = promote_every(interval, config.durable_every_steps)
    count = 0 if kind == "none" else checkpoints_per_run(config, kind, interval)
    if kind != "none":
        root, durable = places.fresh(kind, f"{kind.replace('+', '-')}-{interval}")
        options: dict[str, Any] = {"keep_last": config.keep_last}
        if durable is not None:
            options.update(
                durable_dir=durable,
                promote_every=every,
                durable_keep_last=config.durable_keep_last,
                detached_promotion=config.detached_promotion,
            )
        hook = CheckpointHook(root, step_interval=interval, save_last=False, **options)
        hook.__enter__()
        hook.prewarm_staging(loop.strategy)  # what the hook does at BEFORE_TRAINING
        loop.guard = hook.guard

    def busy() -> bool:
        if hook is None:
            return False
        promoter = hook.promoter
        return bool(hook.writing) or (promoter is not None and bool(promoter.busy))

    for _ in range(_SETTLE_STEPS):  # untimed: caches settle after the staging allocation
        loop.step()
    saves_at = {config.lead_in + k * interval for k in range(count)}
    last_save = max(saves_at, default=0)
    step_seconds: list[float] = []
    overlapped: list[bool] = []
    stalls: list[float] = []  # the save calls
    lock_marks: list[float] = []  # loop.lock_wait when each save call returned
    error: str | None = None
    caught = _Warnings()
    logging.getLogger("fastckpt").addHandler(caught)
    served = process_cpu(server_pid)

    def step() -> None:
        during = busy()
        began = time.perf_counter()
        loop.step()
        step_seconds.append(time.perf_counter() - began)
        overlapped.append(during or busy())

    gc.collect()
    try:
        with warnings.catch_warnings(record=True) as raised:
            warnings.simplefilter("always")
            start = time.perf_counter()
            if hook is None:
                for _ in range(config.baseline_steps):
                    step()
            else:
                for index in range(1, last_save + 1):
                    step()
                    if index in saves_at:
                        blocked = time.perf_counter()
                        hook.save(loop.strategy.context)
                        stalls.append(time.perf_counter() - blocked)
                        lock_marks.append(loop.lock_wait)
                # The last checkpoint's steps: up to N, fewer when its work is done sooner
                # (the steps after that are quiet ones, they change nothing but the run's
                # length); what is still running after N steps is waited for, as the next
                # save would.
                for _ in range(interval):
                    step()
                    if not busy():
                        break
            waited = time.perf_counter()
            if hook is not None:
                try:
                    hook.close()  # the last write durable, every promotion done
                except PromotionError as err:
                    error = f"{type(err).__name__}: {err}"[:2000]
                finally:
                    loop.guard = nullcontext
            tail = time.perf_counter() - waited
            if hook is not None:
                for _ in range(config.quiet_tail):
                    step()
            seconds = time.perf_counter() - start
    finally:
        logging.getLogger("fastckpt").removeHandler(caught)
    promoted = list(hook.promoter.promoted) if hook is not None and hook.promoter else []
    healthy = True if hook is None else bool(hook.promotion_healthy)
    if hook is not None:
        places.remove(root)
        places.remove(durable)
    quiet = [t for t, busy_step in zip(step_seconds, overlapped, strict=True) if not busy_step]
    return {
        "kind": kind,
        "interval": interval,
        "promote_every": every if durable is not None else None,
        "checkpoints": count,
        "steps": len(step_seconds),
        "seconds": seconds,
        "tail_wait_s": tail,
        "steps_seconds_sum": sum(step_seconds),
        "quiet_steps": len(quiet),
        "quiet_step_mean_s": statistics.fmean(quiet) if quiet else None,
        "quiet_step_median_s": statistics.median(quiet) if quiet else None,
        "overlapped_steps": len(step_seconds) - len(quiet),
        "overlapped_seconds_sum": sum(
            t for t, busy_step in zip(step_seconds, overlapped, strict=True) if busy_step
        ),
        "stall_s": with_lock_waits(stalls, lock_marks, loop.lock_wait),
        "save_call_s": stalls,
        "promoted": promoted,
        "promotion_healthy": healthy,
        "error": error,
        "warnings": sorted({str(w.message)[:500] for w in raised} | set(caught.messages)),
        "server_cpu_s": process_cpu(server_pid) - served if server_pid else None,
    }


def _in_run_overhead(row: dict[str, Any]) -> float | None:
    """The run's overhead per checkpoint over N quiet steps (module docstring)."""
    mean = row["quiet_step_mean_s"]
    if not row["checkpoints"] or not mean:
        return None
    extra = row["seconds"] - row["steps_seconds_sum"] + row["overlapped_seconds_sum"]
    extra -= row["overlapped_steps"] * mean
    return extra / row["checkpoints"] / (row["interval"] * mean)


def _baseline_overhead(row: dict[str, Any], step_s: float | None) -> float | None:
    """The run's overhead per checkpoint over N baseline steps."""
    if not row["checkpoints"] or not step_s:
        return None
    extra = row["seconds"] - row["steps"] * step_s
    return extra / row["checkpoints"] / (row["interval"] * step_s)


def _training(
    config: TiersBenchConfig, loop: _Loop, places: _Places, server_pid: int | None
) -> dict[str, Any]:
    """Every configuration at every interval, ``repeats`` times; the baselines around each
    repeat. Returns ``{"baselines": [...], "runs": [...]}`` (raw rows, each with both
    overheads)."""
    baselines: list[dict[str, Any]] = []
    runs: list[dict[str, Any]] = []
    for repeat in range(config.repeats):
        around = [_run("none", 1, config, loop, places, server_pid)]
        config.log(
            f"repeat {repeat + 1}/{config.repeats}: baseline "
            f"{around[0]['steps'] / around[0]['seconds']:.2f} steps/s"
        )
        mine: list[dict[str, Any]] = []
        for position, interval in enumerate(config.intervals):
            shift = (repeat + position) % len(config.configs)
            for kind in (*config.configs[shift:], *config.configs[:shift]):
                row = _run(kind, interval, config, loop, places, server_pid)
                gc.collect()
                trim_allocator()
                row["repeat"] = repeat
                row["in_run_overhead"] = _in_run_overhead(row)
                mine.append(row)
                config.log(
                    f"  {kind:>15} every {interval:>3}: {row['checkpoints']} checkpoints, "
                    f"{row['steps']} steps in {row['seconds']:.2f} s, in-run overhead "
                    f"{_percent(row['in_run_overhead'])}"
                    + (f" ERROR {row['error'][:200]}" if row["error"] else "")
                )
        around.append(_run("none", 1, config, loop, places, server_pid))
        step_s = statistics.fmean(b["seconds"] / b["steps"] for b in around)
        for row in around:
            row["repeat"] = repeat
        for row in mine:
            row["baseline_step_s"] = step_s
            row["baseline_overhead"] = _baseline_overhead(row, step_s)
        baselines += around
        runs += mine
    return {"baselines": baselines, "runs": runs}


def _summaries(config: TiersBenchConfig, training: dict[str, Any]) -> dict[str, Any]:
    """Per configuration: per interval the median (min-max) of both overheads, and the
    shortest interval whose median stays under 1 %."""
    result: dict[str, Any] = {}
    for kind in config.configs:
        per: dict[str, Any] = {}
        for interval in config.intervals:
            rows = [r for r in training["runs"] if r["kind"] == kind and r["interval"] == interval]
            per[str(interval)] = {
                "promote_every": rows[0]["promote_every"] if rows else None,
                "checkpoints_per_run": rows[0]["checkpoints"] if rows else None,
                "baseline_overhead": summarize(
                    [r["baseline_overhead"] for r in rows if r["baseline_overhead"] is not None]
                ),
                "in_run_overhead": summarize(
                    [r["in_run_overhead"] for r in rows if r["in_run_overhead"] is not None]
                ),
                "stall_s": summarize([s for r in rows for s in r["stall_s"]]),
                "tail_wait_s": summarize([r["tail_wait_s"] for r in rows]),
                "server_cpu_s": summarize(
                    [r["server_cpu_s"] for r in rows if r["server_cpu_s"] is not None]
                ),
                "errors": [r["error"] for r in rows if r["error"]],
                "promoted_per_run": [len(r["promoted"]) for r in rows],
                "warnings": sorted({w for r in rows for w in r["warnings"]}),
            }
        result[kind] = {
            "intervals": per,
            "shortest_under_1pct": {
                measure: _shortest(per, measure)
                for measure in ("baseline_overhead", "in_run_overhead")
            },
        }
    return result


def _shortest(per: dict[str, Any], measure: str) -> int | None:
    """The shortest interval whose median overhead is under 1 % and stays so at every
    longer interval measured (None: none)."""
    found = None
    for interval in sorted(per, key=int, reverse=True):
        median = per[interval][measure]["median"]
        if median is None or median >= 0.01 or per[interval]["errors"]:
            break
        found = int(interval)
    return found


# ------------------------------------------------------------------------------ restore


def _expected(loop: _Loop) -> dict[str, torch.Tensor]:
    """A copy of everything the checkpoint holds that a restore must give back bitwise."""
    expected = {f"model.{k}": v.detach().clone() for k, v in loop.model.state_dict().items()}
    for index, moments in loop.optimizer.state_dict()["state"].items():
        for key, value in moments.items():
            if isinstance(value, torch.Tensor):
                expected[f"optim.{index}.{key}"] = value.detach().clone()
    return expected


def _mismatches(loaded: dict[str, Any], expected: dict[str, torch.Tensor]) -> list[str]:
    """Names whose loaded values differ from ``expected`` (missing ones included)."""
    model = loaded["models"]["main"]["model"]
    optimizer = next(iter(loaded["models"]["main"]["optimizers"].values()))["optimizer"]
    got = {f"model.{k}": v for k, v in model.state_dict().items()}
    for index, moments in optimizer.state_dict()["state"].items():
        for key, value in moments.items():
            if isinstance(value, torch.Tensor):
                got[f"optim.{index}.{key}"] = value
    bad = [name for name, value in expected.items() if name not in got]
    bad += [
        name for name, value in expected.items() if name in got and not same_bits(got[name], value)
    ]
    return bad + [name for name in got if name not in expected]


def _memcpy_s(nbytes: int, repeats: int = 5) -> dict[str, Any]:
    """A plain memcpy of ``nbytes``: ``numpy.copyto`` between touched buffers (seconds of
    each repeat), and once into fresh memory (allocation and first touch included)."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty(nbytes, dtype=np.uint8)
    dst.fill(0)  # touched: no page fault inside the timed copies
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - start)
    del dst
    start = time.perf_counter()
    fresh = src.copy()
    first_touch = time.perf_counter() - start
    del fresh, src
    return {"seconds": times, "fresh_seconds": first_touch}


def _read_index(root: str, dest: dict[tuple[str, str], torch.Tensor]) -> int:
    """Read every tensor file of ``root``'s newest index, verified (crc32c, each file against
    the manifest), into the preallocated tensors ``dest`` (filled with fresh ones on the
    first call): straight into them on a local root (what ``CheckpointManager.load(into=)``
    does), else through the backend's reads and a copy; returns the bytes read."""
    from fastckpt.container.reader import read_tensor_file_into
    from fastckpt.format.records import Manifest
    from fastckpt.storage.registry import backend_for, is_local

    manifest = Manifest.load(Path(root))
    index = manifest.latest
    assert index is not None
    copied = 0
    for relpath, record in manifest.entries[index]["files"].items():
        if not relpath.endswith(".safetensors"):
            continue
        path = Path(root) / str(index) / relpath
        if is_local(backend_for(path)):
            targets = {name: t for (file, name), t in dest.items() if file == relpath}
            tensors = read_tensor_file_into(path, record, targets, source=root)
            for name, tensor in tensors.items():
                dest.setdefault((relpath, name), tensor)
                copied += tensor.numel() * tensor.element_size()
            continue
        tensors, _ = backend_for(path).open_tensors(path, verify=True)
        for name, tensor in tensors.items():
            target = dest.get((relpath, name))
            if target is None:
                target = dest[(relpath, name)] = torch.zeros_like(tensor)
            target.copy_(tensor)
            copied += tensor.numel() * tensor.element_size()
        del tensors
    return copied


def _prune_cost(root: str, loop: _Loop) -> float:
    """Seconds of ``prune_indices(root, keep_last=2)`` once ``root`` holds three indices
    (two more saved here, the state changed before each): what a hook's ``keep_last`` does
    after every save, verifying the newest index (reading it whole) before deleting the
    oldest."""
    from fastckpt.container.commit import prune_indices
    from fastckpt.training.hooks import CheckpointHook

    for _ in range(2):
        loop.step()
        with CheckpointHook(root, step_interval=1, save_last=False, async_save=False) as hook:
            hook.save(loop.strategy.context)
    start = time.perf_counter()
    pruned = prune_indices(Path(root), 2)
    seconds = time.perf_counter() - start
    if not pruned:
        raise RuntimeError(f"{root}: prune deleted nothing")
    return seconds


def _restore(
    config: TiersBenchConfig, loop: _Loop, places: _Places, caches: CacheControl
) -> dict[str, Any]:
    """Save one checkpoint to each tier, then time ``load_checkpoint`` (and the verified
    read of its tensor files alone) from each; then the cost of a retention prune there."""
    import fastckpt
    from fastckpt.training.hooks import CheckpointHook

    nbytes = loop.state_bytes()
    expected = _expected(loop)
    train = loop.config
    ram_parent = Path("/dev/shm") if Path("/dev/shm").is_dir() else places.work
    ram = Path(tempfile.mkdtemp(prefix="fastckpt-tiers-ram-", dir=ram_parent))
    roots = {
        "ram": str(ram / "root"),
        "disk": str(places.work / "restore-disk"),
        "s3": f"{places.s3_prefix}/restore",
        "throttled": throttled.url_for(places.share / "restore"),
    }
    roots = {tier: roots[tier] for tier in config.restore_tiers}
    rows: dict[str, Any] = {}
    rebuild: list[float] = []
    try:
        for tier, root in roots.items():
            with CheckpointHook(root, step_interval=1, save_last=False, async_save=False) as hook:
                hook.save(loop.strategy.context)
            rows[tier] = {
                "root": root,
                "seconds": [],
                "read_seconds": [],
                "verified": [],
                "mismatches": [],
            }
        dest: dict[tuple[str, str], torch.Tensor] = {}
        _read_index(roots[next(iter(roots))], dest)  # allocates and touches the targets
        gc.collect()
        for repeat in range(config.repeats):
            start = time.perf_counter()
            model = _model(train)
            torch.optim.AdamW(model.parameters(), lr=1e-4)
            rebuild.append(time.perf_counter() - start)
            del model
            order = list(roots)
            shift = repeat % len(order)
            for tier in (*order[shift:], *order[:shift]):
                caches.drop()
                start = time.perf_counter()
                loaded = fastckpt.load_checkpoint(roots[tier])
                seconds = time.perf_counter() - start
                bad = _mismatches(loaded, expected)
                rows[tier]["seconds"].append(seconds)
                rows[tier]["verified"].append(not bad)
                if bad:
                    rows[tier]["mismatches"].append(bad[:20])
                del loaded
                gc.collect()
                caches.drop()
                start = time.perf_counter()
                _read_index(roots[tier], dest)
                rows[tier]["read_seconds"].append(time.perf_counter() - start)
                config.log(
                    f"restore {repeat + 1}/{config.repeats} from {tier}: load_checkpoint "
                    f"{seconds:.3f} s, verified read {rows[tier]['read_seconds'][-1]:.3f} s"
                    + ("" if not bad else f" MISMATCH {bad[:3]}")
                )
        del dest
        for tier, root in roots.items():
            rows[tier]["prune_s"] = _prune_cost(root, loop)
            config.log(f"prune (keep_last=2) on {tier}: {rows[tier]['prune_s']:.3f} s")
    finally:
        for root in roots.values():
            places.remove(root)
        shutil.rmtree(ram, ignore_errors=True)
    memcpy = _memcpy_s(nbytes)
    copy_s = statistics.median(memcpy["seconds"])
    for row in rows.values():
        seconds = statistics.median(row["seconds"])
        read = statistics.median(row["read_seconds"])
        row["summary"] = summarize(row["seconds"])
        row["read_summary"] = summarize(row["read_seconds"])
        row["gib_s"] = nbytes / seconds / 2**30
        row["vs_memcpy"] = copy_s / seconds
        row["read_gib_s"] = nbytes / read / 2**30
        row["read_vs_memcpy"] = copy_s / read
    return {
        "state_bytes": nbytes,
        "tiers": rows,
        "memcpy": {
            **memcpy,
            "summary": summarize(memcpy["seconds"]),
            "gib_s": nbytes / copy_s / 2**30,
        },
        "model_rebuild_s": summarize(rebuild),
        "cache": caches.label,
        "cache_note": caches.reason,
    }


# ------------------------------------------------------------------------------ the run


def run(config: TiersBenchConfig) -> dict[str, Any]:
    """Run the scenario; returns the JSON document (see :func:`markdown` for its tables)."""
    unknown = [c for c in config.configs if c not in CONFIGS]
    unknown += [t for t in config.restore_tiers if t not in RESTORE_TIERS]
    if unknown or not config.configs or not config.intervals:
        raise ValueError(f"unknown configuration(s) or tier(s) {unknown}")
    if any(n < 1 for n in config.intervals) or config.repeats < 1:
        raise ValueError("intervals must be >= 1 and repeats >= 1")
    throttled.register()
    hidden = hidden_for(config.size_mib, config.layers)
    train = TrainingConfig(hidden=hidden, layers=config.layers, batch=config.batch)
    kind = resolve_server(config.server)
    nbytes = 12 * config.layers * hidden * hidden
    load_before = load_average()
    started = time.perf_counter()
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime())
    caches = CacheControl.probe(config.drop_caches)
    with (
        tempfile.TemporaryDirectory(prefix="fastckpt-tiers-", dir=config.directory or ".") as tmp,
        _s3(kind, nbytes) as (_endpoint, pid, label, client, s3_data),
    ):
        work = Path(tmp).resolve()
        share = work / "share"
        share.mkdir()
        import fastckpt

        share_url = throttled.url_for(share)
        fastckpt.configure_storage(
            share_url,
            read_mib_s=config.throttle_read_mib_s,
            write_mib_s=config.throttle_write_mib_s,
        )
        prefix = f"s3://{BUCKET}/tiers-{uuid.uuid4().hex[:8]}"
        places = _Places(work, share, prefix, client, s3_data)
        try:
            config.log(
                f"tiers: MLP {config.layers}x{hidden}, batch {config.batch}, "
                f"~{nbytes / _MIB:.0f} MiB state; S3 server: {label}; throttled directory "
                f"{config.throttle_write_mib_s:g}/{config.throttle_read_mib_s:g} MiB/s "
                "(write/read)"
            )
            loop = _Loop(train)
            training = _training(config, loop, places, pid)
            restore = _restore(config, loop, places, caches)
            environment = describe(work)
        finally:
            fastckpt.configure_storage(share_url)
    summaries = _summaries(config, training)
    return {
        "scenario": "tiers",
        "run_at": stamp,
        "settings": config.as_dict(),
        "model": {
            "layers": config.layers,
            "hidden": hidden,
            "batch": config.batch,
            "state_bytes": restore["state_bytes"],
        },
        "server": label,
        "server_kind": kind,
        "throttled": {
            "write_mib_s": config.throttle_write_mib_s,
            "read_mib_s": config.throttle_read_mib_s,
            "mechanism": "bench-only storage backend (fastckpt.bench.throttled): a local "
            "directory, every byte read or written paced by a token bucket per direction",
        },
        "promote_every": {
            str(n): promote_every(n, config.durable_every_steps) for n in config.intervals
        },
        "baseline_step_s": summarize([b["seconds"] / b["steps"] for b in training["baselines"]]),
        "configs": summaries,
        "restore": restore,
        "targets": _targets(summaries, restore),
        "raw": training,
        "load_average": {"before": load_before, "after": load_average()},
        "wall_s": time.perf_counter() - started,
        "versions": _versions(kind),
        "environment": environment,
    }


def _targets(summaries: dict[str, Any], restore: dict[str, Any]) -> dict[str, Any]:
    """Met / missed for the issue's two targets."""
    targets: dict[str, Any] = {}
    op, bound = TARGETS["overhead_every_10_steps"]
    entry = summaries.get(TARGET_CONFIG, {}).get("intervals", {}).get(str(TARGET_INTERVAL))
    if entry is None:
        targets["overhead_every_10_steps"] = {
            "config": TARGET_CONFIG,
            "op": op,
            "bound": bound,
            "verdict": "not measured",
        }
    else:
        base = entry["baseline_overhead"]["median"]
        inrun = entry["in_run_overhead"]["median"]
        met = [v is not None and v < bound for v in (base, inrun)]
        verdict = "met" if all(met) else "missed" if not any(met) else "inconclusive"
        targets["overhead_every_10_steps"] = {
            "config": TARGET_CONFIG,
            "op": op,
            "bound": bound,
            "baseline_overhead": base,
            "in_run_overhead": inrun,
            "verdict": verdict,
        }
    op, bound = TARGETS["ram_restore_vs_memcpy"]
    ram = restore["tiers"].get("ram")
    value = None if ram is None else ram["vs_memcpy"]
    verified = ram is not None and all(ram["verified"])
    targets["ram_restore_vs_memcpy"] = {
        "op": op,
        "bound": bound,
        "value": value,
        "verdict": "not measured"
        if value is None
        else ("met" if value >= bound and verified else "missed"),
    }
    return targets


def _versions(kind: str) -> dict[str, str]:
    from importlib import metadata

    found = {}
    for name in ("boto3", "moto", "obstore"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "not installed"
    if kind == "s3s":
        binary = s3s_fs_binary()
        found["s3s-fs"] = str(binary) if binary else "not installed"
    return found


# ------------------------------------------------------------------------------ markdown


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:+.1f} %"


def _span_percent(summary: dict[str, Any]) -> str:
    if summary.get("median") is None:
        return "-"
    return (
        f"{100 * summary['median']:+.1f} % "
        f"({100 * summary['min']:+.1f} to {100 * summary['max']:+.1f})"
    )


def _seconds(summary: dict[str, Any]) -> str:
    if summary.get("median") is None:
        return "-"
    return f"{summary['median']:.3f} ({summary['min']:.3f}-{summary['max']:.3f})"


def markdown(document: dict[str, Any]) -> str:
    """The results as markdown tables."""
    settings = document["settings"]
    model = document["model"]
    env = document["environment"]
    mib = model["state_bytes"] / _MIB
    intervals = [str(n) for n in settings["intervals"]]
    load = document["load_average"]
    lines = [
        f"# Tiers: {mib:.0f} MiB state, fast tier + background promotion vs straight to "
        "durable storage",
        "",
        f"Training loop: MLP {model['layers']} x {model['hidden']} (the harness's training "
        f"loop, widened to the state size), AdamW, batch {model['batch']}; `CheckpointHook` "
        "async saves (the default). Baseline "
        f"{_seconds(document['baseline_step_s'])} s per step. "
        f"{settings['repeats']} repeats, median (min-max).",
        "",
        f"Machine: {env['cpu_model']}, {env['cpu_count']} CPUs, {env['memory_gib']} GiB RAM; "
        f"local roots on {env['filesystem']['mount']} ({env['filesystem']['type']}); "
        f"torch {env['torch']} ({env['torch_threads']} threads), fastckpt {env['fastckpt']}, "
        f"python {env['python']}. Run {document['run_at']} ({document['wall_s']:.0f} s); load "
        f"average {'/'.join(map(str, load['before']))} before, "
        f"{'/'.join(map(str, load['after']))} after.",
        "",
        f"Tiers: fast = a local directory; s3 = `s3://` on {document['server']} (on the same "
        "CPUs as the training: its CPU time is part of the overhead here, not on a real "
        f"store); throttled = a local directory capped at {settings['throttle_write_mib_s']:g} "
        f"MiB/s write / {settings['throttle_read_mib_s']:g} MiB/s read, a stand-in for a "
        "shared filesystem (see the notes). Retention: fast tier (and single tiers) keep_last "
        f"{settings['keep_last']}, durable tier keep_last {settings['durable_keep_last']}."
        + (
            " Promotions run in detached processes (`detached_promotion=True`)."
            if settings.get("detached_promotion")
            else ""
        ),
        "",
        f"promote_every = max(1, {settings['durable_every_steps']} // N): the durable tier "
        f"gets a checkpoint every {settings['durable_every_steps']} steps "
        "(every few minutes at the 2-5 s per step of a large model; far more often here).",
        "",
        "## Step-throughput overhead per checkpoint interval N",
        "",
        "Time a run takes beyond its steps, per checkpoint, over N steps: the throughput lost "
        "by checkpointing every N steps. vs baseline: steps timed by the runs without "
        "checkpoints; in-run: by the same run's steps that overlapped no checkpoint work.",
        "",
        "| configuration | measure | "
        + " | ".join(f"N={n}" for n in intervals)
        + " | shortest N < 1 % |",
        "|---|---|" + "---|" * len(intervals) + "---|",
        "| (promote_every) | | "
        + " | ".join(str(document["promote_every"][n]) for n in intervals)
        + " | |",
    ]
    for kind, summary in document["configs"].items():
        for measure, name in (("baseline_overhead", "vs baseline"), ("in_run_overhead", "in-run")):
            cells = []
            for n in intervals:
                entry = summary["intervals"][n]
                cells.append("failed" if entry["errors"] else _span_percent(entry[measure]))
            shortest = summary["shortest_under_1pct"][measure]
            lines.append(f"| {kind} | {name} | " + " | ".join(cells) + f" | {shortest or 'none'} |")
    lines += [
        "",
        "Stall of the training thread per save (median s: the hook.save() call plus the "
        "optimizer steps' waits for the hook's guard until the next save, while the snapshot "
        "is captured) and wait at the end of a run for the last write and promotions "
        "(median s):",
        "",
        "| configuration | " + " | ".join(f"N={n} stall / end wait" for n in intervals) + " |",
        "|---|" + "---|" * len(intervals),
    ]
    for kind, summary in document["configs"].items():
        cells = []
        for n in intervals:
            entry = summary["intervals"][n]
            stall, tail = entry["stall_s"]["median"], entry["tail_wait_s"]["median"]
            cells.append("-" if stall is None else f"{stall:.3f} / {tail:.2f}")
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    served = [kind for kind in document["configs"] if "s3" in kind]
    if served:
        lines += [
            "",
            "CPU seconds the local S3 server spent per run (median; the runs' checkpoints and "
            "promotions, retention's verifying downloads included), taken from the same cores "
            "as the training:",
            "",
            "| configuration | " + " | ".join(f"N={n}" for n in intervals) + " |",
            "|---|" + "---|" * len(intervals),
        ]
        for kind in served:
            cells = []
            for n in intervals:
                entry = document["configs"][kind]["intervals"][n]
                cpu, count = entry["server_cpu_s"]["median"], entry["checkpoints_per_run"]
                cells.append("-" if cpu is None else f"{cpu:.2f} ({count} ckpt)")
            lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    restore = document["restore"]
    lines += [
        "",
        "## Restore of the newest checkpoint",
        "",
        f"`fastckpt.load_checkpoint(root)`: model and optimizer rebuilt, every file verified "
        f"(crc32c), then compared bitwise with what was saved (outside the clock); "
        f"{restore['state_bytes'] / _MIB:.0f} MiB of tensors; page cache {restore['cache']}"
        f"{' (' + restore['cache_note'] + ')' if restore['cache_note'] else ''}. Verified "
        "read: the index's tensor files alone (crc32c checked) into tensors allocated "
        "beforehand, read straight into them on local tiers (as `CheckpointManager.load(into=)` "
        "does), through the backend and copied elsewhere: a restore into a model that exists. "
        "memcpy: numpy.copyto of as many bytes between touched buffers. Building the model "
        "and optimizer for real, initialization included (which the load skips for a plain "
        "model, reading into uninitialized memory): "
        f"{_seconds(restore['model_rebuild_s'])} s. Prune: `prune_indices(root, keep_last=2)` "
        "with 3 indices there (what `keep_last` runs after every save: the newest index is "
        "read whole and verified before the oldest is deleted), one measurement.",
        "",
        "| tier | load_checkpoint s | GiB/s | x memcpy | bitwise | verified read s | GiB/s "
        "| x memcpy | prune s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for tier, row in restore["tiers"].items():
        verified = "yes" if all(row["verified"]) else "MISMATCH"
        lines.append(
            f"| {tier} | {_seconds(row['summary'])} | {row['gib_s']:.2f} | "
            f"{row['vs_memcpy']:.2f}x | {verified} | {_seconds(row['read_summary'])} | "
            f"{row['read_gib_s']:.2f} | {row['read_vs_memcpy']:.2f}x | "
            f"{row.get('prune_s', float('nan')):.3f} |"
        )
    memcpy = restore["memcpy"]
    lines += [
        f"| memcpy | {_seconds(memcpy['summary'])} | {memcpy['gib_s']:.2f} | 1.00x | - | - "
        "| - | - | - |",
        "",
        f"(memcpy into fresh memory, first touch included: {memcpy['fresh_seconds']:.3f} s.)",
        "",
        "## Targets (issue 26)",
        "",
        "| target | value | verdict |",
        "|---|---|---|",
    ]
    overhead = document["targets"]["overhead_every_10_steps"]
    value = (
        f"{_percent(overhead.get('baseline_overhead'))} vs baseline, "
        f"{_percent(overhead.get('in_run_overhead'))} in-run"
    )
    lines.append(
        f"| a checkpoint every {TARGET_INTERVAL} steps ({overhead['config']}) < 1 % overhead "
        f"| {value} | {overhead['verdict']} |"
    )
    ram = document["targets"]["ram_restore_vs_memcpy"]
    ram_value = "-" if ram["value"] is None else f"{ram['value']:.2f}x"
    lines.append(f"| restore from the RAM tier >= 0.8x memcpy | {ram_value} | {ram['verdict']} |")
    lines += [
        "",
        "A verdict is met when both overhead measures are under the bound, missed when "
        "neither is, inconclusive otherwise.",
        "",
        "## Notes",
        "",
        "- The throttled directory is a stand-in for a shared filesystem: a bench-only storage "
        "backend (`fastckpt.bench.throttled`) that stores files in a local directory and paces "
        "every byte read or written with a token bucket per direction. It models bandwidth "
        "only (no latency, no metadata cost, no client CPU: the pacing sleeps), and being a "
        "URL scheme it is written with fastckpt's object-store protocol (files in place, "
        "manifest last), not the local-filesystem one a real mount would get.",
        "- The S3 server runs on this machine, on the same cores as the training loop: the CPU "
        "it spends receiving checkpoints slows training here, which a remote store would not.",
        "- A run holds a few checkpoints (`checkpoints_per_run` in the JSON): the overhead at N "
        "is derived per checkpoint. Where promote_every exceeds the checkpoints a run holds "
        f"(capped at {settings['max_checkpoints']}), a tiered run promotes more often than the "
        "steady state: its promotion share is overstated (the short intervals only).",
    ]
    warned = sorted(
        {
            w
            for summary in document["configs"].values()
            for entry in summary["intervals"].values()
            for w in entry["warnings"]
        }
    )
    if warned:
        lines += ["- Warnings logged during the runs (deduplicated):"]
        lines += [f"  - `{w[:300]}`" for w in warned[:12]]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------ command line


def _names(known: Sequence[str]) -> Callable[[str], tuple[str, ...]]:
    def parse(text: str) -> tuple[str, ...]:
        names = tuple(n.strip() for n in text.split(",") if n.strip())
        unknown = [n for n in names if n not in known]
        if unknown or not names:
            raise argparse.ArgumentTypeError(
                f"unknown name(s) {unknown or text!r}; choose from {','.join(known)}"
            )
        return names

    return parse


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(n) for n in text.split(",") if n.strip())
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated integers") from err
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: integers >= 1")
    return values


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``python -m fastckpt.bench tiers``."""
    defaults = TiersBenchConfig()
    parser = argparse.ArgumentParser(
        prog="python -m fastckpt.bench tiers",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--size-mib", type=float, default=defaults.size_mib)
    parser.add_argument("--repeats", "--repeat", type=int, default=defaults.repeats)
    parser.add_argument(
        "--intervals", type=_ints, default=defaults.intervals, help="checkpoint every N steps"
    )
    parser.add_argument("--configs", type=_names(CONFIGS), default=defaults.configs)
    parser.add_argument(
        "--restore-tiers", type=_names(RESTORE_TIERS), default=defaults.restore_tiers
    )
    parser.add_argument("--server", choices=("auto", "s3s", "moto"), default=defaults.server)
    parser.add_argument("--throttle-write-mib-s", type=float, default=defaults.throttle_write_mib_s)
    parser.add_argument("--throttle-read-mib-s", type=float, default=defaults.throttle_read_mib_s)
    parser.add_argument("--durable-every-steps", type=int, default=defaults.durable_every_steps)
    parser.add_argument(
        "--keep-last", type=int, default=defaults.keep_last, help="0: keep every index"
    )
    parser.add_argument(
        "--durable-keep-last",
        type=int,
        default=defaults.durable_keep_last,
        help="0: keep every index",
    )
    parser.add_argument("--max-checkpoints", type=int, default=defaults.max_checkpoints)
    parser.add_argument("--single-checkpoints", type=int, default=defaults.single_checkpoints)
    parser.add_argument("--quiet-tail", type=int, default=defaults.quiet_tail)
    parser.add_argument("--lead-in", type=int, default=defaults.lead_in)
    parser.add_argument("--baseline-steps", type=int, default=defaults.baseline_steps)
    parser.add_argument("--layers", type=int, default=defaults.layers)
    parser.add_argument("--batch", type=int, default=defaults.batch)
    parser.add_argument("--dir", type=Path, default=None, help="where local roots go")
    parser.add_argument(
        "--drop-caches", action="store_true", help="cold restores (root; drops the page cache)"
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="write tiers-<size>mib-<server>.json/.md here"
    )
    parser.add_argument("--tag", default=None, help="output file stem instead")
    parser.add_argument(
        "--detached-promotion", action="store_true", help="promote in detached processes"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the scenario, print the markdown, write ``tiers-<size>mib-<server>.json`` /
    ``.md`` to ``--out``."""
    args = build_parser().parse_args(argv)
    # A terminated run still stops its S3 server and removes its scratch roots.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.size_mib <= 0 or args.repeats < 1 or args.lead_in < 1 or args.baseline_steps < 2:
        print("need --size-mib > 0, --repeats, --lead-in >= 1, --baseline-steps >= 2")
        return 2
    config = TiersBenchConfig(
        size_mib=args.size_mib,
        repeats=args.repeats,
        intervals=args.intervals,
        configs=args.configs,
        restore_tiers=args.restore_tiers,
        server=args.server,
        throttle_write_mib_s=args.throttle_write_mib_s,
        throttle_read_mib_s=args.throttle_read_mib_s,
        durable_every_steps=args.durable_every_steps,
        keep_last=args.keep_last or None,
        durable_keep_last=args.durable_keep_last or None,
        max_checkpoints=args.max_checkpoints,
        single_checkpoints=args.single_checkpoints,
        quiet_tail=args.quiet_tail,
        lead_in=args.lead_in,
        baseline_steps=args.baseline_steps,
        layers=args.layers,
        batch=args.batch,
        directory=args.dir,
        drop_caches=args.drop_caches,
        detached_promotion=args.detached_promotion,
        log=lambda line: print(line, flush=True),
    )
    document = run(config)
    table = markdown(document)
    print(table)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        stem = args.out / (args.tag or f"tiers-{args.size_mib:g}mib-{document['server_kind']}")
        stem.with_suffix(".json").write_text(json.dumps(document, indent=2) + "\n")
        stem.with_suffix(".md").write_text(table)
        print(f"wrote {stem}.json, {stem}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
