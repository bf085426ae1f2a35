"""The CLI start-up scenario: how long ``fastckpt ls``/``inspect``/``verify`` take on a small
root, against the time it takes just to import torch.

Listing, inspecting and verifying read JSON records and safetensors headers and check crc32c
in the Rust core, so these commands never import torch (``tests/test_cli.py`` pins that). This
scenario measures each command as a user runs it: a new ``python -m fastckpt`` process per
run, wall time from start to exit, on a ``save_checkpoint`` root of two indices (a small model
and its optimizer, the second save incremental) and on a directory of two
``CheckpointManager`` checkpoints. ``import torch`` in a new process is the reference: it is what
every command paid before.

```bash
python -m fastckpt.bench.startup --repeats 7 --out benches/results
```
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fastckpt.bench.stats import summarize

__all__ = ["COMMANDS", "build_fixture", "main", "measure", "render"]

#: What is measured: a name and the arguments after ``python -m fastckpt`` (``{root}`` and
#: ``{managers}`` are the fixture's two directories; None: ``python -c "import torch"``).
COMMANDS: tuple[tuple[str, list[str] | None], ...] = (
    ("import torch (reference)", None),
    ("fastckpt --version", ["--version"]),
    ("fastckpt ls ROOT", ["ls", "{root}"]),
    ("fastckpt inspect ROOT", ["inspect", "{root}"]),
    ("fastckpt verify ROOT", ["verify", "{root}"]),
    ("fastckpt ls MANAGER_DIR", ["ls", "{managers}"]),
    ("fastckpt verify MANAGER_DIR", ["verify", "{managers}"]),
)


def build_fixture(directory: Path) -> dict[str, Path]:
    """A small ``save_checkpoint`` root (two indices) and a directory of two manager
    checkpoints under ``directory``; returns ``{"root": ..., "managers": ...}``."""
    import torch  # the fixture is written once, by this process; the commands run without it

    import fastckpt

    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 256)).sum().backward()
    optimizer.step()
    root = directory / "root"
    managers = directory / "managers"
    for step in (1, 2):
        fastckpt.save_checkpoint(root, models={"net": model}, optimizers={"adamw": optimizer})
        with fastckpt.CheckpointManager() as manager:
            manager.save(
                str(managers / f"step_{step}"), {"model": model.state_dict(), "step": step}
            )
    return {"root": root, "managers": managers}


def _argv(args: list[str] | None, fixture: dict[str, Path]) -> list[str]:
    if args is None:
        return [sys.executable, "-c", "import torch"]
    paths = {name: str(path) for name, path in fixture.items()}
    return [sys.executable, "-m", "fastckpt", *(arg.format(**paths) for arg in args)]


def measure(fixture: dict[str, Path], repeats: int) -> list[dict[str, Any]]:
    """Each command run ``repeats`` times in a new process (one unmeasured run first, so every
    measured run finds the interpreter and the files in the page cache); one row per command
    with its wall-time summary in seconds."""
    rows = []
    for name, args in COMMANDS:
        argv = _argv(args, fixture)
        subprocess.run(argv, check=True, capture_output=True)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            subprocess.run(argv, check=True, capture_output=True)
            times.append(time.perf_counter() - start)
        rows.append({"command": name, "argv": argv[1:], "seconds": summarize(times)})
    return rows


def render(rows: Sequence[dict[str, Any]]) -> str:
    """A Markdown table of the rows (median and min, milliseconds)."""
    lines = ["| command | median (ms) | min (ms) |", "|---|---:|---:|"]
    for row in rows:
        seconds = row["seconds"]
        lines.append(
            f"| `{row['command']}` | {seconds['median'] * 1e3:.0f} | {seconds['min'] * 1e3:.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Measure and print the table; with ``--out DIR`` also write ``cli-startup.json`` and
    ``cli-startup.md`` there."""
    parser = argparse.ArgumentParser(prog="python -m fastckpt.bench.startup")
    parser.add_argument("--repeats", type=int, default=7, help="runs per command (default 7)")
    parser.add_argument("--out", type=Path, help="directory for cli-startup.{json,md}")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    with tempfile.TemporaryDirectory(prefix="fastckpt-startup-") as scratch:
        rows = measure(build_fixture(Path(scratch)), args.repeats)
    table = render(rows)
    print(table)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        document = {
            "scenario": "cli-startup",
            "repeats": args.repeats,
            "python": platform.python_version(),
            "machine": platform.machine(),
            "rows": rows,
        }
        (args.out / "cli-startup.json").write_text(json.dumps(document, indent=1) + "\n")
        header = (
            f"# CLI start-up, {args.repeats} runs per command (a new process each), "
            f"Python {platform.python_version()}\n\n"
        )
        (args.out / "cli-startup.md").write_text(header + table + "\n")
        print(f"wrote {args.out / 'cli-startup.json'} and cli-startup.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
