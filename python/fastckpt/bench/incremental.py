"""Benchmark scenario: fine-tuning with 90 % of the model's bytes frozen, 10 checkpoints.

Each writer trains the same seeded model (a frozen backbone of square linear layers holding
``frozen`` of the model's bytes, and a trainable head holding the rest, with AdamW, fused
AdamW or SGD)
and checkpoints after every step, durably. Measured per save: wall time and bytes written.

Writers: ``fastckpt`` (``save_checkpoint``, incremental by default), ``fastckpt-full``
(``incremental=False``; both save the same training run after every step, interleaved, so
the ratio compares saves made under the same load), and the peers of
:mod:`fastckpt.bench.writers` (torch.save + fsync, safetensors + fsync, DCP), which save the
whole state every time. fastckpt roots are pruned
to the last 2 indices after each save (outside the timed region), the peers' previous output
is deleted, so the run needs about 3 states of disk.

Run ``python -m fastckpt.bench.incremental --model-mib 256 --repeats 3 --out
benches/results/incremental`` (writes ``<out>.json`` and ``<out>.md``; the machine's load
average is recorded at start and end). Targets (issue 15): each save after the first
writes <= 15 % of the bytes, and takes <= 20 % of the time, of a full fastckpt save.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import fastckpt
from fastckpt.bench.environment import describe, load_average
from fastckpt.bench.stats import percentile
from fastckpt.bench.writers import (
    DcpWriter,
    SafetensorsWriter,
    TorchSaveWriter,
    Writer,
    WriterUnavailable,
    path_bytes,
    remove_path,
)
from fastckpt.container import incremental
from fastckpt.io import tree

__all__ = ["PAIR", "build", "main", "measure", "measure_fastckpt", "render_markdown", "run"]

MIB = 1 << 20
WIDTH = 1024  # one frozen layer: WIDTH**2 float32 = 4 MiB


class Tuned(nn.Module):
    """A frozen backbone and a trainable head (sizes in bytes of float32 weights)."""

    def __init__(self, frozen_bytes: int, trainable_bytes: int) -> None:
        """Build ``frozen_bytes`` of frozen square layers and a head of ``trainable_bytes``."""
        super().__init__()
        self.frozen_bytes = frozen_bytes
        self.trainable_bytes = trainable_bytes
        layers = max(1, round(frozen_bytes / (WIDTH * WIDTH * 4)))
        self.backbone = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(layers)))
        self.backbone.requires_grad_(False)
        outputs = max(1, trainable_bytes // (WIDTH * 4))
        self.head = nn.Linear(WIDTH, outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Backbone, then head."""
        return self.head(torch.tanh(self.backbone(x)))


def build(model_mib: float, frozen: float, optimizer: str) -> tuple[Tuned, torch.optim.Optimizer]:
    """The seeded model and its optimizer (``adamw``, ``adamw-fused`` or ``sgd``) over the
    head."""
    torch.manual_seed(0)
    total = int(model_mib * MIB)
    model = Tuned(int(total * frozen), int(total * (1 - frozen)))
    params = list(model.head.parameters())
    factories: dict[str, Callable[[], torch.optim.Optimizer]] = {
        "adamw": lambda: torch.optim.AdamW(params, lr=1e-4),
        # The fast path trainers select: it updates weights and moments without moving their
        # version counters, so only the content digests can tell what changed.
        "adamw-fused": lambda: torch.optim.AdamW(params, lr=1e-4, fused=True),
        "sgd": lambda: torch.optim.SGD(params, lr=1e-3),
    }
    return model, factories[optimizer]()


def _train_step(model: Tuned, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad(set_to_none=True)
    model(torch.randn(8, WIDTH)).square().mean().backward()
    opt.step()


def _flat_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    _, tensors = tree.flatten(opt.state_dict())
    state = {f"model.{key}": value for key, value in model.state_dict().items()}
    state.update({f"optim.{key}": value.contiguous() for key, value in tensors.items()})
    return state


def _fastckpt_saver(root: Path, inc: bool) -> Callable[[Tuned, Any, int], tuple[float, int]]:
    incremental.forget(root)

    def save(model: Tuned, opt: Any, step: int) -> tuple[float, int]:
        start = time.perf_counter()
        index = fastckpt.save_checkpoint(
            root,
            models={"main": (model, None)},
            optimizers={"opt": (opt, None)},
            counters={"step": step},
            incremental=inc,
        )
        seconds = time.perf_counter() - start
        # What the save wrote (list_checkpoints' size: its files hard-linked from an earlier
        # index are not written again).
        (written,) = [r["size"] for r in fastckpt.list_checkpoints(root) if r["index"] == index]
        fastckpt.prune(root, keep_last=2)
        return seconds, written

    return save


def _peer_saver(writer: Writer, directory: Path) -> Callable[[Tuned, Any, int], tuple[float, int]]:
    writer.open()
    previous: list[Path] = []

    def save(model: Tuned, opt: Any, step: int) -> tuple[float, int]:
        target = directory / f"{step}-{writer.target(directory).name}"
        timing = writer.write(_flat_state(model, opt), target)
        written = path_bytes(target)
        for old in previous:
            remove_path(old)
        previous[:] = [target]
        return timing.seconds, written

    return save


#: The two fastckpt writers, measured together (see :func:`measure_fastckpt`).
PAIR = ("fastckpt", "fastckpt-full")


def measure_fastckpt(
    directory: Path, model_mib: float, frozen: float, optimizer: str, saves: int
) -> dict[str, dict[str, Any]]:
    """The incremental and the full fastckpt save of the same training run, interleaved.

    After each training step the state is saved twice, incrementally into one root and in
    full (``incremental=False``) into another, alternating which goes first, so both see
    the same state, the same machine load and the same disk history.
    """
    model, opt = build(model_mib, frozen, optimizer)
    directory.mkdir(parents=True, exist_ok=True)
    savers = {
        "fastckpt": _fastckpt_saver(directory / "incremental", True),
        "fastckpt-full": _fastckpt_saver(directory / "full", False),
    }
    rows: dict[str, dict[str, Any]] = {name: {"seconds": [], "bytes": []} for name in PAIR}
    for step in range(saves):
        _train_step(model, opt)
        for name in PAIR if step % 2 == 0 else PAIR[::-1]:
            took, nbytes = savers[name](model, opt, step)
            rows[name]["seconds"].append(took)
            rows[name]["bytes"].append(nbytes)
    remove_path(directory)
    return rows


def measure(
    name: str, directory: Path, model_mib: float, frozen: float, optimizer: str, saves: int
) -> dict[str, Any]:
    """Run one peer writer (or one fastckpt writer alone): ``saves`` checkpoints, one after
    each training step."""
    model, opt = build(model_mib, frozen, optimizer)
    directory.mkdir(parents=True, exist_ok=True)
    peers: dict[str, type[Writer]] = {
        "torch.save": TorchSaveWriter,
        "safetensors": SafetensorsWriter,
        "dcp": DcpWriter,
    }
    if name in PAIR:
        save = _fastckpt_saver(directory / "root", name == "fastckpt")
    else:
        save = _peer_saver(peers[name](), directory)
    seconds, written = [], []
    for step in range(saves):
        _train_step(model, opt)
        took, nbytes = save(model, opt, step)
        seconds.append(took)
        written.append(nbytes)
    remove_path(directory)
    return {"seconds": seconds, "bytes": written}


def _later(row: dict[str, Any], key: str) -> list[float]:
    """Saves 2..N of every run of ``row``."""
    return [value for run in row["runs"] for value in run[key][1:]]


def _summary(row: dict[str, Any], full: dict[str, Any]) -> dict[str, Any]:
    later_s = _later(row, "seconds")
    later_b = _later(row, "bytes")
    full_s = statistics.median(_later(full, "seconds"))
    full_b = statistics.median(_later(full, "bytes"))
    summary = {
        "first_seconds": statistics.median(run["seconds"][0] for run in row["runs"]),
        "first_bytes": row["runs"][0]["bytes"][0],
        "later_median_seconds": statistics.median(later_s),
        "later_p90_seconds": percentile(later_s, 90),
        "later_max_seconds": max(later_s),
        "later_median_bytes": statistics.median(later_b),
        "later_max_bytes": max(later_b),
        "bytes_vs_full_fastckpt": max(later_b) / full_b,
        "time_vs_full_fastckpt": statistics.median(later_s) / full_s,
        "runs_time_vs_full_fastckpt": [
            statistics.median(run["seconds"][1:]) / statistics.median(other["seconds"][1:])
            for run, other in zip(row["runs"], full["runs"], strict=False)
        ],
    }
    if row is not full and len(row["runs"]) == len(full["runs"]) and "paired" in row:
        # The two saves after the same training step, one ratio per step.
        ratios = [
            mine / theirs
            for run, other in zip(row["runs"], full["runs"], strict=True)
            for mine, theirs in zip(run["seconds"][1:], other["seconds"][1:], strict=True)
        ]
        summary["paired_time_vs_full_fastckpt"] = statistics.median(ratios)
    return summary


def run(
    model_mib: float,
    frozen: float,
    optimizer: str,
    saves: int,
    writers: list[str],
    work: Path,
    repeats: int = 1,
) -> dict[str, Any]:
    """Measure every writer ``repeats`` times (writers interleaved within each repetition;
    ``fastckpt`` and ``fastckpt-full`` together, see :func:`measure_fastckpt`);
    ``fastckpt-full`` is the reference of the ratios."""
    rows: dict[str, Any] = {name: {"runs": []} for name in writers}
    load_before = load_average()
    started = time.perf_counter()
    for _ in range(repeats):
        if all(name in writers for name in PAIR):
            pair = measure_fastckpt(work / "fastckpt", model_mib, frozen, optimizer, saves)
            for name in PAIR:
                rows[name]["runs"].append(pair[name])
                rows[name]["paired"] = True
        for name in writers:
            if name in PAIR and rows[name].get("paired"):
                continue
            if "skipped" in rows[name]:
                continue
            try:
                rows[name]["runs"].append(
                    measure(name, work / name, model_mib, frozen, optimizer, saves)
                )
            except WriterUnavailable as err:
                rows[name] = {"skipped": str(err)}
    full = rows.get("fastckpt-full")
    if full and full.get("runs"):
        for row in rows.values():
            if row.get("runs"):
                row["summary"] = _summary(row, full)
    mine = rows.get("fastckpt", {}).get("summary")
    return {
        "scenario": {
            "model_mib": model_mib,
            "frozen_fraction": frozen,
            "optimizer": optimizer,
            "saves": saves,
            "repeats": repeats,
            "durable": True,
        },
        "environment": {
            **describe(work),
            "load_average_before": load_before,
            "load_average_after": load_average(),
            "seconds": time.perf_counter() - started,
        },
        "writers": rows,
        "targets": None
        if mine is None
        else {
            "bytes_at_most_15pct": mine["bytes_vs_full_fastckpt"] <= 0.15,
            "time_at_most_20pct": mine["time_vs_full_fastckpt"] <= 0.20,
        },
    }


def render_markdown(results: dict[str, Any]) -> str:
    """The results as a Markdown table."""
    scenario = results["scenario"]
    env = results["environment"]
    load = "/".join(f"{x:.2f}" for x in env.get("load_average_before", []))
    load_after = "/".join(f"{x:.2f}" for x in env.get("load_average_after", []))
    lines = [
        f"# Incremental saves: {scenario['model_mib']} MiB model, "
        f"{scenario['frozen_fraction']:.0%} of its bytes frozen, {scenario['optimizer']}, "
        f"{scenario['saves']} durable saves x {scenario.get('repeats', 1)} runs",
        "",
        "Saves 2..N of every run against a full fastckpt save (`save_checkpoint("
        "incremental=False)`, median of its saves 2..N). `fastckpt` and `fastckpt-full` save "
        "the same training run after every step, interleaved (alternating which goes first); "
        "the peers run on their own. Bytes: the most any later save wrote. Paired: median "
        "over steps of the incremental save's time / the full save's time after the same step.",
        "",
        f"Load average (1/5/15 min) {load} at start, {load_after} at end; "
        f"{env.get('seconds', 0):.0f} s.",
        "",
        "| writer | 1st save s | 1st save MiB | later median s | later p90 s | later max MiB "
        "| bytes vs full | time vs full | per run | paired |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in results["writers"].items():
        if "summary" not in row:
            lines.append(f"| {name} | skipped: {row.get('skipped', '?')} | | | | | | | | |")
            continue
        s = row["summary"]
        runs = ", ".join(f"{x:.1%}" for x in s["runs_time_vs_full_fastckpt"])
        paired = s.get("paired_time_vs_full_fastckpt")
        lines.append(
            f"| {name} | {s['first_seconds']:.3f} | {s['first_bytes'] / MIB:.1f} "
            f"| {s['later_median_seconds']:.3f} | {s['later_p90_seconds']:.3f} "
            f"| {s['later_max_bytes'] / MIB:.1f} "
            f"| {s['bytes_vs_full_fastckpt']:.1%} | {s['time_vs_full_fastckpt']:.1%} "
            f"| {runs} | {'' if paired is None else f'{paired:.1%}'} |"
        )
    targets = results.get("targets")
    if targets:
        lines += [
            "",
            f"Targets: bytes <= 15 %: {'met' if targets['bytes_at_most_15pct'] else 'missed'}; "
            f"time <= 20 % (later median / full median): "
            f"{'met' if targets['time_at_most_20pct'] else 'missed'}.",
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Command line: see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-mib", type=float, default=256.0)
    parser.add_argument("--frozen", type=float, default=0.9)
    parser.add_argument("--optimizer", choices=("adamw", "adamw-fused", "sgd"), default="adamw")
    parser.add_argument("--saves", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3, help="runs per writer (default 3)")
    parser.add_argument("--writers", default="fastckpt-full,fastckpt,torch.save,safetensors,dcp")
    parser.add_argument("--dir", help="work directory (default: a temporary one)")
    parser.add_argument("--out", help="write <out>.json and <out>.md")
    args = parser.parse_args(argv)
    if args.saves < 2:
        parser.error("--saves must be >= 2")
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    writers = [name for name in args.writers.split(",") if name]
    with tempfile.TemporaryDirectory(dir=args.dir) as work:
        results = run(
            args.model_mib,
            args.frozen,
            args.optimizer,
            args.saves,
            writers,
            Path(work),
            repeats=args.repeats,
        )
    text = render_markdown(results)
    print(text)
    if args.out:
        Path(f"{args.out}.json").write_text(json.dumps(results, indent=1) + "\n")
        Path(f"{args.out}.md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
