"""The detached-promoter scenario: what a promotion in a process of its own costs, and how soon
the durable tier holds the checkpoint after the trainer is killed.

A fast root holds one index of ``--size-mib`` of float32 weights (random, so nothing is
reused); every run promotes it into a fresh durable root on the same filesystem. Measured,
medians of ``--repeats`` runs:

* **promotion**: :meth:`Promoter.submit` to :meth:`Promoter.wait`, on the trainer's thread
  (``detached=False``) and in a detached process (``detached=True``); the difference is what
  the process start costs a promotion;
* **after a kill**: a trainer process submits the promotion and is SIGKILLed (its whole process
  group) as soon as the promotion started. Detached, the durable root holds the index without
  any other process: the time from the kill until it is committed. On a thread, the promotion
  dies with the trainer, and the durable tier gets the index only when a next process finishes
  it: the time of ``fastckpt promote FAST DURABLE`` run right after the kill, a lower bound
  (a real restart first waits for the scheduler, and a restarted trainer first loads).

```bash
python -m fastckpt.bench.detached --size-mib 256 --repeats 3 --out benches/results
```
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from fastckpt.bench.stats import summarize

__all__ = ["build_fast_root", "main", "measure", "render"]

_MIB = 1 << 20
_POLL_S = 0.005

#: The trainer of the "after a kill" runs: promotes FAST to DURABLE (detached when the third
#: argument is "1"), prints a line once the promotion has started, then waits to be killed.
_TRAINER = """
import sys, time
from fastckpt.container.promote import Promoter
promoter = Promoter(sys.argv[1], sys.argv[2], detached=sys.argv[3] == "1")
promoter.submit()
deadline = time.monotonic() + 60
while not promoter.busy or (promoter.detached and promoter.detached_pid is None):
    if time.monotonic() > deadline:
        print("never started", flush=True)
        sys.exit(1)
    time.sleep(0.001)
print("started", flush=True)
time.sleep(3600)
"""


def build_fast_root(directory: Path, size_mib: float) -> Path:
    """A ``save_checkpoint`` root under ``directory`` holding one index of about ``size_mib``
    of random float32 weights (4 MiB layers); returns it."""
    import torch

    import fastckpt

    root = directory / "fast"
    torch.manual_seed(0)
    layers = max(1, round(size_mib / 4))  # 4 MiB of float32 weights per layer
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(layers)])
    fastckpt.save_checkpoint(root, models={"main": model}, incremental=False)
    return root


def _committed(root: Path) -> bool:
    return (root / "manifest.json").exists()


def _promotion(fast: Path, durable: Path, detached: bool) -> float:
    from fastckpt.container.promote import Promoter

    promoter = Promoter(fast, durable, detached=detached)
    start = time.perf_counter()
    promoter.submit()
    promoter.close()
    seconds = time.perf_counter() - start
    if promoter.promoted != [0]:
        raise RuntimeError(f"the promotion did not happen: {promoter.promoted}")
    return seconds


def _after_kill(fast: Path, durable: Path, detached: bool) -> float:
    """Seconds from the trainer's SIGKILL until ``durable`` holds the index (see the module
    docstring for what is timed on a thread)."""
    trainer = subprocess.Popen(
        [sys.executable, "-c", _TRAINER, str(fast), str(durable), "1" if detached else "0"],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert trainer.stdout is not None
        if trainer.stdout.readline().strip() != "started":
            raise RuntimeError("the trainer did not start its promotion")
    finally:
        os.killpg(trainer.pid, signal.SIGKILL)
        trainer.wait()
    start = time.perf_counter()
    if not detached:
        command = [sys.executable, "-m", "fastckpt", "promote", str(fast), str(durable)]
        subprocess.run(command, check=True, capture_output=True)
    deadline = start + 600
    while not _committed(durable):
        if time.perf_counter() > deadline:
            raise RuntimeError(f"{durable}: nothing committed 600 s after the kill")
        time.sleep(_POLL_S)
    return time.perf_counter() - start


def measure(fast: Path, scratch: Path, repeats: int) -> list[dict[str, Any]]:
    """Each (what, detached) case ``repeats`` times after one unmeasured run, into a fresh
    durable root under ``scratch`` each time; one row per case with its seconds summary."""
    rows = []
    cases = [
        ("promotion", False, _promotion),
        ("promotion", True, _promotion),
        ("after a kill", False, _after_kill),
        ("after a kill", True, _after_kill),
    ]
    for what, detached, run in cases:
        times = []
        for attempt in range(repeats + 1):
            durable = scratch / f"durable-{what.replace(' ', '-')}-{int(detached)}-{attempt}"
            seconds = run(fast, durable, detached)
            shutil.rmtree(durable, ignore_errors=True)
            if attempt:
                times.append(seconds)
        rows.append(
            {
                "what": what,
                "promoter": "detached process" if detached else "trainer thread",
                "seconds": summarize(times),
            }
        )
    return rows


def render(rows: list[dict[str, Any]], size_mib: float) -> str:
    """A Markdown table of the rows (median and min, seconds)."""
    lines = [
        f"| {size_mib:g} MiB index | promoter | median (s) | min (s) |",
        "|---|---|---:|---:|",
    ]
    for row in rows:
        seconds = row["seconds"]
        lines.append(
            f"| {row['what']} | {row['promoter']} | {seconds['median']:.3f} | "
            f"{seconds['min']:.3f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Measure and print the table; with ``--out DIR`` also write
    ``detached-<size>mib.json`` and ``.md`` there."""
    parser = argparse.ArgumentParser(prog="python -m fastckpt.bench.detached")
    parser.add_argument("--size-mib", type=float, default=256, help="index size (default 256)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per case (default 3)")
    parser.add_argument("--dir", type=Path, help="where the roots go (default: a temp dir)")
    parser.add_argument("--out", type=Path, help="directory for the results")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if not args.size_mib > 0:
        parser.error("--size-mib must be positive")
    with tempfile.TemporaryDirectory(prefix="fastckpt-detached-", dir=args.dir) as scratch:
        fast = build_fast_root(Path(scratch), args.size_mib)
        rows = measure(fast, Path(scratch), args.repeats)
    table = render(rows, args.size_mib)
    print(table)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        name = f"detached-{args.size_mib:g}mib"
        document = {
            "scenario": "detached-promoter",
            "size_mib": args.size_mib,
            "repeats": args.repeats,
            "python": platform.python_version(),
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "rows": rows,
        }
        (args.out / f"{name}.json").write_text(json.dumps(document, indent=1) + "\n")
        header = (
            f"# Detached promoter, {args.size_mib:g} MiB index, medians of {args.repeats} "
            f"runs, {os.cpu_count()} CPUs (`python -m fastckpt.bench.detached`)\n\n"
            "Promotion: submit to done. After a kill: from the trainer's SIGKILL until the "
            "durable root holds the index (trainer thread: `fastckpt promote` run at once by "
            "a next process, a lower bound).\n\n"
        )
        (args.out / f"{name}.md").write_text(header + table + "\n")
        print(f"wrote {args.out / name}.json and .md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
