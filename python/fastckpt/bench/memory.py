"""Memory figures: peak extra RSS per writer, RSS over repeated async saves, memcpy rate.

Each writer is measured in a fresh child process that rebuilds the same state, so one writer's
freed-but-retained memory (allocator caches, staging buffers) cannot hide another's peak. In
the child: build the state, collect garbage and trim the allocator, reset the kernel's peak-RSS
counter (``/proc/self/clear_refs``), read the baseline ``VmRSS``, save, and take the peak as the
larger of the kernel's ``VmHWM`` and a 5 ms ``VmRSS`` sampler (the sampler alone where the peak
cannot be reset). Peak extra = peak - baseline: the memory a save adds on top of the state.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np

__all__ = [
    "RssSampler",
    "child_main",
    "measure_writer",
    "memcpy_gib_per_s",
    "reset_peak_rss",
    "status_bytes",
]

MIB = 2**20
_CHILD_MARK = "FASTCKPT-BENCH-MEMORY "


def status_bytes(field: str) -> int | None:
    """A size field of ``/proc/self/status`` (``"VmRSS"``, ``"VmHWM"``) in bytes, or None."""
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def reset_peak_rss() -> bool:
    """Reset ``VmHWM`` to the current RSS (Linux >= 4.0); returns whether it worked."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5\n")
    except OSError:
        return False
    hwm, rss = status_bytes("VmHWM"), status_bytes("VmRSS")
    return hwm is not None and rss is not None and hwm <= rss + 4 * MIB


def trim_allocator() -> None:
    """Collect garbage and hand free heap memory back to the OS (glibc ``malloc_trim``)."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class RssSampler:
    """Context manager sampling ``VmRSS`` every ``interval`` seconds in a background thread.

    Attributes:
        peak: the largest RSS seen, in bytes (starts at the RSS on entry).
    """

    def __init__(self, interval: float = 0.005) -> None:
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def _sample(self) -> None:
        rss = status_bytes("VmRSS")
        if rss is not None and rss > self.peak:
            self.peak = rss

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> RssSampler:
        self._sample()
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


def memcpy_gib_per_s(nbytes: int = 256 * MIB, repeats: int = 5) -> float:
    """Single-thread memcpy rate (numpy ``copyto`` between touched buffers), best of N."""
    nbytes = max(nbytes, 4 * MIB)
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 2**30


def _measure_here(writer_name: str, size_gib: float, directory: Path, saves: int) -> dict[str, Any]:
    """The child's side: build the state, save ``saves`` times, report RSS figures."""
    from fastckpt.bench.state import build_state, plan_state
    from fastckpt.bench.writers import WRITERS, WriterUnavailable, remove_path

    state = build_state(plan_state(size_gib))
    writer = WRITERS[writer_name]()
    try:
        writer.open()
    except WriterUnavailable as err:
        return {"available": False, "reason": str(err)}
    target = writer.target(directory)
    trim_allocator()
    peak_reset = reset_peak_rss()
    baseline = status_bytes("VmRSS") or 0
    rss_after: list[int] = []
    peak_first = 0
    with RssSampler() as sampler:
        for index in range(saves):
            writer.write(state, target)
            remove_path(target)
            rss_after.append(status_bytes("VmRSS") or 0)
            if index == 0:
                hwm = (status_bytes("VmHWM") or 0) if peak_reset else 0
                peak_first = max(sampler.peak, hwm)
    hwm = (status_bytes("VmHWM") or 0) if peak_reset else 0
    peak_all = max(sampler.peak, hwm)
    writer.close()
    return {
        "available": True,
        "reason": None,
        "saves": saves,
        "peak_reset": peak_reset,
        "baseline_mib": baseline / MIB,
        "peak_extra_mib": (peak_first - baseline) / MIB,
        "peak_extra_all_saves_mib": (peak_all - baseline) / MIB,
        "rss_after_saves_mib": [r / MIB for r in rss_after],
        "growth_mib": (rss_after[-1] - rss_after[0]) / MIB,
    }


def child_main(argv: list[str] | None = None) -> int:
    """Entry point of the measuring child; prints one marked JSON line."""
    parser = argparse.ArgumentParser(prog="fastckpt.bench.memory")
    parser.add_argument("--writer", required=True)
    parser.add_argument("--size-gib", type=float, required=True)
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--saves", type=int, default=1)
    args = parser.parse_args(argv)
    result = _measure_here(args.writer, args.size_gib, args.dir, args.saves)
    print(_CHILD_MARK + json.dumps(result), flush=True)
    return 0


def measure_writer(
    writer_name: str, size_gib: float, directory: Path, saves: int = 1, timeout: float = 1800
) -> dict[str, Any]:
    """Peak extra RSS (and RSS after each of ``saves`` saves) of one writer, in a child.

    Returns:
        the child's figures, or ``{"available": False, "reason": ...}`` when the writer is
        unavailable or the child failed (the reason carries its stderr tail).
    """
    code = (
        "import sys; from fastckpt.bench.memory import child_main; "
        "sys.exit(child_main(sys.argv[1:]))"
    )
    command = [
        sys.executable,
        "-c",
        code,
        "--writer",
        writer_name,
        "--size-gib",
        repr(size_gib),
        "--dir",
        str(directory),
        "--saves",
        str(saves),
    ]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"available": False, "reason": f"measuring child timed out after {timeout} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(_CHILD_MARK):
            result: dict[str, Any] = json.loads(line[len(_CHILD_MARK) :])
            return result
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
    return {
        "available": False,
        "reason": f"measuring child failed (exit {proc.returncode}): " + " | ".join(tail),
    }
