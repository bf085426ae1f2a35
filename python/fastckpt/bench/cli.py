"""Command line of ``python -m fastckpt.bench``."""

from __future__ import annotations

import argparse
import sys
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


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (options documented in ``--help``)."""
    parser = argparse.ArgumentParser(
        prog="python -m fastckpt.bench",
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
        "--out", type=Path, default=Path("benches/results"), help="output dir (benches/results)"
    )
    parser.add_argument("--tag", default=None, help="output file stem (default state-<size>gib)")
    parser.add_argument("--no-plot", action="store_true", help="do not write the PNG")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory children")
    parser.add_argument("--no-training", action="store_true", help="skip the training loop")
    parser.add_argument(
        "--warm", action="store_true", help="do not drop caches before reads even if allowed"
    )
    defaults = TrainingConfig()
    group = parser.add_argument_group("training loop")
    group.add_argument("--train-steps", type=int, default=defaults.steps)
    group.add_argument("--train-every", type=int, default=defaults.every)
    group.add_argument("--train-hidden", type=int, default=defaults.hidden)
    group.add_argument("--train-layers", type=int, default=defaults.layers)
    group.add_argument("--train-batch", type=int, default=defaults.batch)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the harness with command-line ``argv``; returns the exit status
    (``s3 ...``: the object-storage scenario, :mod:`fastckpt.bench.s3`)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["s3"]:
        from fastckpt.bench import s3

        return s3.main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.size_gib <= 0 or args.repeats < 1:
        print("--size-gib must be > 0 and --repeats >= 1", file=sys.stderr)
        return 2
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
        cold=not args.warm,
        log=lambda line: print(line, flush=True),
    )
    results = harness.run(config)
    paths = report.write_outputs(results, config.out, plot=config.plot)
    print()
    print(report.render_text(results))
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0
