"""Command line of ``python -m fastckpt.bench`` (also ``fastckpt bench``)."""

from __future__ import annotations

import argparse
import shlex
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

from fastckpt.bench import harness, report
from fastckpt.bench.readers import READERS
from fastckpt.bench.training import TrainingConfig
from fastckpt.bench.writers import WRITERS

__all__ = ["build_parser", "main"]


def _name_list(kind: str, known: list[str]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        unknown = [n for n in names if n not in known]
        if unknown or not names:
            raise argparse.ArgumentTypeError(
                f"unknown {kind}(s) {unknown or text!r}; choose from {','.join(known)}"
            )
        return names

    return parse


def _started_by_fastckpt_cli() -> str | None:
    """``fastckpt`` or ``python -m fastckpt`` when this process is the ``fastckpt`` command
    (so the harness runs as ``fastckpt bench``), else None."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name == "fastckpt.__main__":
        return "python -m fastckpt"
    if spec is None and Path(sys.argv[0]).name == "fastckpt":
        return "fastckpt"
    return None


def _command(argv: list[str]) -> str:
    """The command line recorded with the results, as the user typed it: ``fastckpt bench
    ...`` through the ``fastckpt`` command, ``python -m fastckpt.bench ...`` otherwise."""
    cli = _started_by_fastckpt_cli()
    if cli == "fastckpt":
        return shlex.join(["fastckpt", *sys.argv[1:]])
    python = Path(sys.executable).name
    if cli is not None:
        return shlex.join([python, "-m", "fastckpt", *sys.argv[1:]])
    return shlex.join([python, "-m", "fastckpt.bench", *argv])


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (options documented in ``--help``)."""
    cli = _started_by_fastckpt_cli()
    parser = argparse.ArgumentParser(
        prog="python -m fastckpt.bench" if cli is None else f"{cli} bench",
        description=(
            "Durable save / load throughput, stall, memory and training-loop overhead of "
            "fastckpt and its peers on one state, side by side, with the bar of "
            "docs/performance.md."
        ),
    )
    parser.add_argument("--size-gib", type=float, default=1.5, help="state size (default 1.5)")
    parser.add_argument("--repeats", type=int, default=3, help="timed repetitions (default 3)")
    parser.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="where files are written (a temp dir is made inside and removed); default: a temp "
        "dir in the current directory, i.e. on its filesystem",
    )
    parser.add_argument(
        "--writers",
        type=_name_list("writer", list(WRITERS)),
        default=None,
        help=f"comma-separated subset of {','.join(WRITERS)} (default all)",
    )
    parser.add_argument(
        "--readers",
        type=_name_list("reader", list(READERS)),
        default=None,
        help=f"comma-separated subset of {','.join(READERS)} (default all)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="output dir (default: a fresh fastckpt-bench-<time> directory in the current "
        "directory, named on the first line; `make bench` writes benches/results)",
    )
    parser.add_argument("--tag", default=None, help="output file stem (default state-<size>gib)")
    parser.add_argument("--no-plot", action="store_true", help="do not write the PNG")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory children")
    parser.add_argument("--no-training", action="store_true", help="skip the training loop")
    parser.add_argument(
        "--drop-caches",
        action="store_true",
        help="drop the system-wide page cache before each timed read, for cold reads (needs "
        "root; slows everything else on the machine); default: reads are labelled warm",
    )
    defaults = TrainingConfig()
    group = parser.add_argument_group("training loop")
    group.add_argument("--train-steps", type=int, default=defaults.steps)
    group.add_argument("--train-every", type=int, default=defaults.every)
    group.add_argument("--train-hidden", type=int, default=defaults.hidden)
    group.add_argument("--train-layers", type=int, default=defaults.layers)
    group.add_argument("--train-batch", type=int, default=defaults.batch)
    return parser


def fresh_output_dir(parent: Path | None = None) -> Path:
    """A new ``fastckpt-bench-<UTC time>[-<n>]`` directory under ``parent`` (default: the
    current directory): a run never overwrites results, committed ones included."""
    parent = Path.cwd() if parent is None else parent
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    for n in range(1000):
        candidate = parent / (f"fastckpt-bench-{stamp}" + (f"-{n}" if n else ""))
        try:
            candidate.mkdir(parents=True)
        except FileExistsError:
            continue
        return candidate
    raise FileExistsError(f"{parent}: no free fastckpt-bench-{stamp}-<n> name")


def main(argv: list[str] | None = None) -> int:
    """Run the harness with command-line ``argv``; returns the exit status
    (``s3 ...``: the object-storage scenario, :mod:`fastckpt.bench.s3`; ``s3-sharded ...``:
    sharded checkpoints on object storage, :mod:`fastckpt.bench.s3_sharded`; ``tiers ...``: a
    fast tier promoted to durable storage vs straight to it, :mod:`fastckpt.bench.tiers`)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["s3"]:
        from fastckpt.bench import s3

        return s3.main(argv[1:])
    if argv[:1] == ["s3-sharded"]:
        from fastckpt.bench import s3_sharded

        return s3_sharded.main(argv[1:])
    if argv[:1] == ["tiers"]:
        from fastckpt.bench import tiers

        return tiers.main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.size_gib <= 0 or args.repeats < 1:
        print("--size-gib must be > 0 and --repeats >= 1", file=sys.stderr)
        return 2
    if args.out is None:
        args.out = fresh_output_dir()
    print(f"writing results to {args.out}", flush=True)
    config = harness.BenchConfig(
        size_gib=args.size_gib,
        repeats=args.repeats,
        directory=args.dir,
        writers=args.writers,
        readers=args.readers,
        out=args.out,
        tag=args.tag,
        plot=not args.no_plot,
        memory=not args.no_memory,
        training=not args.no_training,
        training_config=TrainingConfig(
            steps=args.train_steps,
            every=args.train_every,
            hidden=args.train_hidden,
            layers=args.train_layers,
            batch=args.train_batch,
        ),
        cold=args.drop_caches,
        log=_print_wrapped,
    )
    results = harness.run(config)
    results["command"] = _command(argv)
    paths = report.write_outputs(results, config.out, plot=config.plot)
    print()
    print(report.render_text(results))
    _print_wrapped("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


def _print_wrapped(line: str) -> None:
    """A progress line, wrapped to the terminal report's width."""
    for piece in textwrap.wrap(line, report.TEXT_WIDTH, subsequent_indent="  ") or [""]:
        print(piece, flush=True)
