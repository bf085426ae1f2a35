"""Runs the whole benchmark: one state, every writer and reader, memory, training loop, bar.

Order of a run: build the state; probe whether caches can be dropped; measure the memcpy rate;
writes (one untimed warm-up round, then ``repeats`` rounds, each running every writer once, so
drift hits all of them alike, the order rotated by one each round (:func:`rotated`, recorded
in the JSON's ``order``); each output deleted and the filesystem synced between runs); reads
(inputs written once, then ``repeats`` interleaved rounds in rotated order, caches dropped
before each read; where they cannot be, every input is first read once untimed, so that all
are warm, not only the ones their write left in the page cache); memory (one child process per
writer); the training loop (scenarios interleaved per repetition, each checkpointing run
compared with the baseline runs on both sides of it); the bar.
"""

from __future__ import annotations

import datetime
import gc
import os
import shutil
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

from fastckpt.bench import bar, environment, memory, training
from fastckpt.bench.cache import CacheControl
from fastckpt.bench.readers import Reader, make_readers
from fastckpt.bench.state import build_state, plan_state, state_bytes
from fastckpt.bench.stats import summarize
from fastckpt.bench.training import TrainingConfig
from fastckpt.bench.writers import (
    WRITERS,
    Writer,
    WriterUnavailable,
    fix_default_write_mode,
    make_writers,
    path_bytes,
    remove_path,
)

__all__ = ["SCHEMA_VERSION", "BenchConfig", "default_tag", "rotated", "run"]

#: Version of the JSON layout written by the harness. 2: ``stall_seconds`` of an async writer
#: lasts until the state may be changed again (``save()`` returned and ``lock()`` taken; for
#: DCP, staged), ``returned_seconds`` is when the save call returned; in 1 an async fastckpt
#: writer's stall was the save call's return (the state was still being captured).
SCHEMA_VERSION = 2

#: Saves in a row for the async-manager RSS figure.
ASYNC_REPEATED_SAVES = 10

GIB = 2**30


def default_tag(size_gib: float) -> str:
    """Output name for a state size: ``1.5`` -> ``"state-1.5gib"``."""
    return f"state-{size_gib:g}gib"


@dataclass
class BenchConfig:
    """What to run.

    Attributes:
        size_gib: state size in GiB.
        repeats: timed repetitions of every writer and reader.
        directory: where files are written (a temp dir is made inside it); None: a temp dir
            in the current working directory (so on its filesystem, not a tmpfs /tmp).
        writers: writer names (None: all).
        readers: reader names (None: all).
        out: where the JSON/markdown/PNG go.
        tag: output file stem (None: from the size).
        plot: write the PNG.
        memory: run the per-writer memory children.
        training: run the training-loop scenario.
        training_config: its size.
        cold: drop caches before reads when allowed.
        log: progress sink.
    """

    size_gib: float = 1.5
    repeats: int = 3
    directory: Path | None = None
    writers: list[str] | None = None
    readers: list[str] | None = None
    out: Path = Path("benches/results")
    tag: str | None = None
    plot: bool = True
    memory: bool = True
    training: bool = True
    training_config: TrainingConfig = field(default_factory=TrainingConfig)
    cold: bool = True
    log: Callable[[str], None] = print


@contextmanager
def _work_dir(config: BenchConfig) -> Iterator[Path]:
    parent = Path(config.directory) if config.directory is not None else Path.cwd()
    parent.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=".fastckpt-bench-", dir=parent))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _entry(label: str, status: str, reason: str | None) -> dict[str, Any]:
    return {
        "label": label,
        "status": status,
        "available": status == "ok",
        "reason": reason,
        "runs": [],
    }


def _error_text(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"


_T = TypeVar("_T")


def rotated(items: list[_T], rep: int) -> list[_T]:
    """``items`` rotated left by ``rep`` (modulo their count): the order of repetition ``rep``,
    so that no writer or reader always runs right after the same one (and its leftovers: dirty
    pages, a busy disk, a fragmented heap)."""
    shift = rep % len(items) if items else 0
    return [*items[shift:], *items[:shift]]


def _run_writes(
    writers: list[Writer],
    state: dict[str, torch.Tensor],
    nbytes: int,
    root: Path,
    config: BenchConfig,
) -> tuple[dict[str, Any], list[list[str]]]:
    """Every writer ``repeats`` times (after a warm-up round), in rotated order; returns the
    entries by writer name and the order each round ran in (round 0: the warm-up)."""
    results: dict[str, Any] = {}
    order: list[list[str]] = []
    active: list[Writer] = []
    for writer in writers:
        try:
            writer.open()
        except WriterUnavailable as err:
            results[writer.name] = _entry(writer.label, "not available", str(err))
            config.log(f"  {writer.name}: not available ({err})")
            continue
        results[writer.name] = _entry(writer.label, "ok", None)
        results[writer.name]["async"] = writer.is_async
        active.append(writer)

    def once(writer: Writer, rep: int, position: int) -> dict[str, Any]:
        target = writer.target(root)
        remove_path(target)
        os.sync()
        timing = writer.write(state, target)
        on_disk = path_bytes(target)
        remove_path(target)
        os.sync()
        returned = timing.returned_seconds
        return {
            "rep": rep,
            "position": position,
            "seconds": timing.seconds,
            "stall_seconds": timing.stall_seconds,
            "returned_seconds": timing.stall_seconds if returned is None else returned,
            "gib_per_s": nbytes / GIB / timing.seconds,
            "bytes_on_disk": on_disk,
            "details": timing.details,
        }

    try:
        for rep in range(config.repeats + 1):  # round 0 is the warm-up
            label = "warm-up" if rep == 0 else f"rep {rep}/{config.repeats}"
            this_round = rotated(list(active), rep)
            order.append([writer.name for writer in this_round])
            for position, writer in enumerate(this_round):
                entry = results[writer.name]
                try:
                    run = once(writer, rep, position)
                except Exception as err:  # a peer failing must not sink the run
                    entry.update(status="failed", available=False, reason=_error_text(err))
                    config.log(f"  {label} {writer.name}: FAILED {_error_text(err)}")
                    traceback.print_exc(file=sys.stderr)
                    active.remove(writer)
                    writer.close()
                    continue
                if rep == 0:
                    entry["warmup"] = run
                else:
                    entry["runs"].append(run)
                config.log(
                    f"  {label} {writer.name:18s} {run['seconds']:7.3f} s"
                    f"  {run['gib_per_s']:6.2f} GiB/s  stall {run['stall_seconds']:7.3f} s"
                )
    finally:
        for writer in active:
            writer.close()
    for entry in results.values():
        runs = entry["runs"]
        entry["async"] = entry.get("async", False)
        entry["warmup"] = entry.get("warmup")
        for key in ("seconds", "stall_seconds", "returned_seconds", "gib_per_s"):
            entry[key] = summarize([run[key] for run in runs])
        entry["details"] = runs[-1]["details"] if runs else {}
        entry["bytes_on_disk"] = runs[-1]["bytes_on_disk"] if runs else None
    return results, order


def _run_reads(
    readers: list[Reader],
    state: dict[str, torch.Tensor],
    nbytes: int,
    root: Path,
    cache: CacheControl,
    config: BenchConfig,
    order: list[list[str]] | None = None,
) -> dict[str, Any]:
    """Every reader ``repeats`` times in rotated order (appended to ``order``), from a dropped
    page cache where it can be dropped. Where it cannot, every input is first read once,
    untimed: a write leaves some inputs in the page cache (buffered writes) and not others
    (fastckpt's O_DIRECT from 64 MiB), and a warm figure should be warm for all."""
    results: dict[str, Any] = {}
    active: list[Reader] = []
    for reader in readers:
        try:
            reader.prepare(state, root)
        except WriterUnavailable as err:
            results[reader.name] = _entry(reader.label, "not available", str(err))
            config.log(f"  {reader.name}: not available ({err})")
            continue
        entry = _entry(reader.label, "ok", None)
        entry.update(cache=cache.label, verified=None, prewarmed=not cache.cold)
        results[reader.name] = entry
        active.append(reader)
    first = 1 if cache.cold else 0  # round 0 (warm cache only): every input read once, untimed
    try:
        for rep in range(first, config.repeats + 1):
            this_round = rotated(list(active), rep)
            if order is not None:
                order.append([reader.name for reader in this_round])
            for reader in this_round:
                entry = results[reader.name]
                try:
                    cache.drop()
                    timing, loaded = reader.read(state)
                    if entry["verified"] is None:
                        entry["verified"] = reader.check(state, loaded)
                    del loaded
                    memory.trim_allocator()
                except Exception as err:
                    entry.update(status="failed", available=False, reason=_error_text(err))
                    config.log(f"  rep {rep} {reader.name}: FAILED {_error_text(err)}")
                    traceback.print_exc(file=sys.stderr)
                    active.remove(reader)
                    continue
                if rep == 0:
                    config.log(f"  warm-up {reader.name:12s} read once, untimed (warm cache)")
                    continue
                entry["runs"].append(
                    {
                        "rep": rep,
                        "seconds": timing.seconds,
                        "gib_per_s": nbytes / GIB / timing.seconds,
                        "details": timing.details,
                    }
                )
                config.log(
                    f"  rep {rep}/{config.repeats} {reader.name:12s} {timing.seconds:7.3f} s"
                    f"  {nbytes / GIB / timing.seconds:6.2f} GiB/s ({cache.label})"
                )
    finally:
        for reader in readers:
            reader.cleanup()
    for entry in results.values():
        runs = entry["runs"]
        entry.setdefault("cache", cache.label)
        entry.setdefault("verified", None)
        entry.setdefault("prewarmed", False)
        for key in ("seconds", "gib_per_s"):
            entry[key] = summarize([run[key] for run in runs])
        if entry["verified"] is False:
            entry.update(status="failed", available=False, reason="loaded tensors differ")
    return results


def _run_memory(names: list[str], root: Path, config: BenchConfig) -> dict[str, Any]:
    per_writer: dict[str, Any] = {}
    for name in names:
        saves = ASYNC_REPEATED_SAVES if name == "fastckpt-async" else 1
        result = memory.measure_writer(name, config.size_gib, root, saves=saves)
        if result.get("available"):
            result["status"] = "ok"
            config.log(
                f"  {name:18s} peak extra RSS {result['peak_extra_mib']:8.1f} MiB"
                + (
                    f", growth over {saves} saves {result['growth_mib']:.1f} MiB"
                    if saves > 1
                    else ""
                )
            )
        else:
            reason = str(result.get("reason", ""))
            result["status"] = "failed" if "child failed" in reason else "not available"
            config.log(f"  {name}: {result['status']} ({reason})")
        per_writer[name] = result
    async_entry = per_writer.get("fastckpt-async", {})
    repeated: dict[str, Any] = {
        "saves": ASYNC_REPEATED_SAVES,
        "status": async_entry.get("status", "not run"),
        "available": bool(async_entry.get("available")),
        "reason": async_entry.get("reason"),
        "rss_after_saves_mib": async_entry.get("rss_after_saves_mib"),
        "growth_mib": async_entry.get("growth_mib"),
    }
    return {
        "method": (
            "one child process per writer rebuilding the same state; baseline VmRSS after "
            "gc + malloc_trim; peak = max(VmHWM after clear_refs reset, 5 ms VmRSS sampler)"
        ),
        "writers": per_writer,
        "async_repeated": repeated,
    }


def _training_once(
    name: str, entry: dict[str, Any], root: Path, config: BenchConfig
) -> dict[str, Any] | None:
    """One run of a training scenario; a failure or absence is recorded in ``entry``."""
    try:
        result = training.run_training(name, config.training_config, root)
    except Exception as err:
        entry.update(status="failed", available=False, reason=_error_text(err))
        traceback.print_exc(file=sys.stderr)
        return None
    if not result["available"]:
        entry.update(status="not available", available=False, reason=result["reason"])
        config.log(f"  {name}: not available ({result['reason']})")
        return None
    return result


def _paired_overheads(scenarios: dict[str, Any]) -> None:
    """Per run, the throughput loss against the mean of the baseline runs just before and just
    after it (the same repetition's ``none`` run and the next one, or the closing run), so
    that load drifting between repetitions cancels; stored per run and summarized."""
    baseline = scenarios["none"]
    by_rep = {run["rep"]: run["steps_per_s"] for run in baseline["runs"]}
    closing = baseline.get("closing")
    if closing is not None:
        by_rep[closing["rep"]] = closing["steps_per_s"]
    for name, entry in scenarios.items():
        losses = []
        for run in entry["runs"]:
            around = [by_rep[r] for r in (run["rep"], run["rep"] + 1) if r in by_rep]
            if name == "none" or not around:
                continue
            run["baseline_steps_per_s"] = sum(around) / len(around)
            run["overhead"] = 1.0 - run["steps_per_s"] / run["baseline_steps_per_s"]
            losses.append(run["overhead"])
        entry["overhead_per_run"] = summarize(losses)


def _run_training(root: Path, config: BenchConfig) -> dict[str, Any]:
    tc = config.training_config
    scenarios: dict[str, Any] = {name: _entry(name, "ok", None) for name in training.SCENARIOS}
    checkpointing = [name for name in training.SCENARIOS if name != "none"]
    for rep in range(config.repeats + 1):  # round 0 is the warm-up (code paths, page cache)
        # The baseline opens every repetition; the checkpointing scenarios rotate after it, so
        # none of them always runs right after the baseline (or after another's leftovers).
        shift = rep % len(checkpointing)
        for name in ["none", *checkpointing[shift:], *checkpointing[:shift]]:
            entry = scenarios[name]
            if not entry["available"]:
                continue
            result = _training_once(name, entry, root, config)
            if result is None:
                continue
            result["rep"] = rep
            if rep == 0:
                entry["warmup"] = result
            else:
                entry["runs"].append(result)
            label = "warm-up" if rep == 0 else f"rep {rep}/{config.repeats}"
            config.log(
                f"  {label} {name:15s} {result['steps_per_s']:7.2f} steps/s"
                f"  ({result['checkpoints']} checkpoints of {result['checkpoint_mib']:.0f} MiB)"
            )
    # A closing baseline run, so that the last repetition's checkpointing runs have a baseline
    # after them too.
    none = scenarios["none"]
    closing = _training_once("none", none, root, config) if none["available"] else None
    if closing is not None:
        closing["rep"] = config.repeats + 1
        config.log(f"  closing none           {closing['steps_per_s']:7.2f} steps/s")
    none["closing"] = closing
    baseline = summarize([r["steps_per_s"] for r in none["runs"]])["median"]
    _paired_overheads(scenarios)
    for entry in scenarios.values():
        runs = entry["runs"]
        entry.setdefault("warmup", None)
        entry.setdefault("closing", None)
        entry["steps_per_s"] = summarize([r["steps_per_s"] for r in runs])
        stalls = [s for r in runs for s in r["stall_seconds"]]
        entry["stall_seconds_per_checkpoint"] = summarize(stalls)
        entry["lock_wait_seconds"] = summarize([r["lock_wait_seconds"] for r in runs])
        in_run = [r["in_run_overhead"] for r in runs if r.get("in_run_overhead") is not None]
        entry["in_run_overhead"] = summarize(in_run)
        median = entry["steps_per_s"]["median"]
        paired = entry["overhead_per_run"]["median"]
        if entry["available"] and baseline and median:
            entry["ratio_vs_none"] = median / baseline
            entry["overhead_of_medians"] = 1.0 - median / baseline
            # The loss against the neighbouring baseline runs (0 for the baseline itself).
            entry["overhead"] = paired if paired is not None else 1.0 - median / baseline
        else:
            entry["ratio_vs_none"] = None
            entry["overhead_of_medians"] = None
            entry["overhead"] = None
    return {
        "config": tc.as_dict(),
        "method": (
            f"scenarios interleaved in every repetition ({', '.join(training.SCENARIOS)}; "
            "none first, the others rotated by one each repetition), plus a closing none run; "
            "overhead = median over runs of 1 - steps/s / mean(steps/s of the none runs just "
            "before and after it); overhead_of_medians = "
            "1 - median steps/s / median none steps/s; in_run_overhead = per run, the time the "
            "steps overlapping a checkpoint took beyond the median of the run's other steps, "
            "plus the stalls in the save calls, as a share of the run (summarized over runs)"
        ),
        "scenarios": scenarios,
    }


def run(config: BenchConfig) -> dict[str, Any]:
    """Run the benchmark described by ``config``; returns the results (the JSON's content).

    Raises:
        ValueError: unknown writer/reader names or a non-positive size/repeat count.
    """
    if config.repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {config.repeats}")
    with warnings.catch_warnings():
        # DCP without a process group warns on every call, from its worker threads too.
        warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled")
        return _run(config)


def _run(config: BenchConfig) -> dict[str, Any]:
    writers = make_writers(config.writers)
    readers = make_readers(config.readers)
    log = config.log
    started = time.time()
    spec = plan_state(config.size_gib)
    load_start = environment.load_average()
    with _work_dir(config) as root:
        env = environment.describe(root)
        env["load_average_start"] = load_start
        if load_start[0] > 0.5:
            log(
                f"warning: load average {load_start[0]:.2f} at start: other processes are "
                "running, figures will be noisy"
            )
        if env["filesystem"]["type"] in ("tmpfs", "ramfs"):
            log(f"warning: {root} is on {env['filesystem']['type']}; figures will not be disk's")
        log(f"building state: {config.size_gib:g} GiB ...")
        t0 = time.perf_counter()
        state = build_state(spec)
        nbytes = state_bytes(state)
        # Decide the default write mode once (it depends on the size only) so that every
        # repetition of "fastckpt" and "fastckpt-nocrc" runs the same mode.
        fix_default_write_mode(writers, nbytes)
        log(
            f"state: {len(state)} tensors, {nbytes / GIB:.3f} GiB "
            f"(hidden {spec.hidden}, {spec.layers} layers, vocab {spec.vocab}), "
            f"built in {time.perf_counter() - t0:.1f} s; files in {root} "
            f"({env['filesystem']['type']})"
        )
        cache = CacheControl.probe(config.cold)
        log(f"page cache for reads: {cache.label}" + (f" ({cache.reason})" if cache.reason else ""))
        memcpy_rate = memory.memcpy_gib_per_s(min(nbytes, 256 * memory.MIB))
        log(f"single-thread memcpy: {memcpy_rate:.2f} GiB/s")

        log(f"writes: {len(writers)} writers x {config.repeats} repetitions (+1 warm-up)")
        writes, write_order = _run_writes(writers, state, nbytes, root, config)
        gc.collect()
        log(f"reads: {len(readers)} readers x {config.repeats} repetitions ({cache.label})")
        read_order: list[list[str]] = []
        reads = _run_reads(readers, state, nbytes, root, cache, config, read_order)
        gc.collect()
        mem: dict[str, Any] = {"method": "skipped", "writers": {}, "async_repeated": {}}
        if config.memory:
            log("memory: one child process per writer")
            mem = _run_memory([w.name for w in writers], root, config)
        train: dict[str, Any] = {"config": config.training_config.as_dict(), "scenarios": {}}
        if config.training:
            log(f"training loop: {', '.join(training.SCENARIOS)} x {config.repeats}")
            train = _run_training(root, config)
        del state
    env["load_average_end"] = environment.load_average()
    results: dict[str, Any] = {
        "schema": SCHEMA_VERSION,
        "tag": config.tag or default_tag(config.size_gib),
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "duration_s": time.time() - started,
        "command": " ".join([Path(sys.executable).name, "-m", "fastckpt.bench", *sys.argv[1:]]),
        "config": {
            "size_gib": config.size_gib,
            "repeats": config.repeats,
            "writers": [w.name for w in writers],
            "readers": [r.name for r in readers],
            "all_writers": list(WRITERS),
        },
        "environment": env,
        "order": {
            "method": (
                "writers and readers rotated left by one each repetition; writes[0] is the "
                "warm-up round, reads[0] the untimed read of every input (warm cache only)"
            ),
            "writes": write_order,
            "reads": read_order,
        },
        "cache": {
            "cold": cache.cold,
            "label": cache.label,
            "reason": cache.reason,
            "prewarmed": not cache.cold,
            "cached_before_probe_kib": cache.cached_before_kib,
            "cached_after_probe_kib": cache.cached_after_kib,
        },
        "state": {
            "bytes": nbytes,
            "gib": nbytes / GIB,
            "tensors": len(spec.parameter_shapes()) * 3,
            "hidden": spec.hidden,
            "layers": spec.layers,
            "vocab": spec.vocab,
            "dtype": str(spec.dtype),
        },
        "memcpy": {"gib_per_s": memcpy_rate, "threads": 1},
        "writers": writes,
        "readers": reads,
        "memory": mem,
        "training": train,
    }
    results["bar"] = bar.evaluate(results)
    return results
