"""What the figures were measured on: versions, CPU, memory, and the target filesystem."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

import fastckpt
from fastckpt.bench.cache import meminfo_kib

__all__ = ["cpu_model", "describe", "filesystem_of", "load_average"]


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages (empty where unknown)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def cpu_model() -> str:
    """The CPU model name from ``/proc/cpuinfo`` (or the platform's guess)."""
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _unescape_mount(field: str) -> str:
    return (field.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n")).replace(
        "\\134", "\\"
    )


def filesystem_of(path: str | os.PathLike[str]) -> dict[str, str]:
    """Filesystem type, device and mount point holding ``path``.

    Uses the longest matching mount point in ``/proc/mounts``, else ``stat -f``.
    """
    target = os.path.realpath(path)
    best: dict[str, str] = {}
    try:
        with open("/proc/mounts") as handle:
            for line in handle:
                fields = line.split()
                if len(fields) < 3:
                    continue
                device, mount, fstype = (
                    _unescape_mount(fields[0]),
                    _unescape_mount(fields[1]),
                    fields[2],
                )
                inside = target == mount or target.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= len(best.get("mount", "")):
                    best = {"type": fstype, "device": device, "mount": mount}
    except OSError:
        pass
    if best:
        return best
    try:
        out = subprocess.run(
            ["stat", "-f", "-c", "%T", target], capture_output=True, text=True, check=True
        ).stdout.strip()
        return {"type": out, "device": "?", "mount": "?"}
    except (OSError, subprocess.CalledProcessError):
        return {"type": "unknown", "device": "?", "mount": "?"}


def _version(module: str) -> str:
    try:
        imported = __import__(module)
    except ImportError:
        return "not installed"
    return str(getattr(imported, "__version__", "unknown"))


def describe(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """Everything the JSON records about the machine and software."""
    mem_total = meminfo_kib("MemTotal")
    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "safetensors": _version("safetensors"),
        "numpy": np.__version__,
        "fastckpt": fastckpt.__version__,
        "platform": platform.platform(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        # OpenMP's wait policy decides how much CPU torch's idle intra-op threads burn
        # spinning, which changes step throughput on an oversubscribed machine.
        "openmp_env": {
            name: os.environ[name]
            for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")
            if name in os.environ
        },
        "memory_gib": round(mem_total / 2**20, 2) if mem_total else None,
        "filesystem": filesystem_of(directory),
        "dir": str(Path(directory).resolve()),
    }
