"""``fastckpt bench ...``: the benchmark harness behind the command line."""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Sequence
from contextlib import redirect_stdout
from pathlib import Path

from fastckpt.cli.common import (
    EXIT_OK,
)

# --------------------------------------------------------------------------- fastckpt bench


def run_bench(argv: Sequence[str], *, as_json: bool) -> int:
    """Forward ``argv`` to the harness (``python -m fastckpt.bench``).

    With ``as_json`` the harness's progress goes to stderr and its result file
    (``<out>/<tag>.json``) is printed on stdout.
    """
    from fastckpt.bench import cli as bench_cli

    if not as_json:
        return bench_cli.main(list(argv))
    if list(argv[:1]) == ["s3"]:
        return _run_s3_json(list(argv[1:]))
    from fastckpt.bench.harness import default_tag

    options = bench_cli.build_parser().parse_args(list(argv))
    if options.out is None:
        options.out = bench_cli.fresh_output_dir()
        argv = [*argv, "--out", str(options.out)]
    with redirect_stdout(sys.stderr):
        status = bench_cli.main(list(argv))
    if status == EXIT_OK:
        tag = options.tag or default_tag(options.size_gib)
        sys.stdout.write((Path(options.out) / f"{tag}.json").read_text())
    return status


def _run_s3_json(argv: list[str]) -> int:
    """``fastckpt bench s3 ... --json``: run the object-storage scenario
    (:mod:`fastckpt.bench.s3`, its own options) with its table on stderr, then print the
    result document it wrote (to ``--out``, or a scratch directory when none is given)."""
    from fastckpt.bench import s3

    wanted = argparse.ArgumentParser(add_help=False)
    wanted.add_argument("--out", type=Path, default=None)
    wanted.add_argument("--size-mib", type=int, default=256)
    known, _ = wanted.parse_known_args(argv)
    with tempfile.TemporaryDirectory(prefix="fastckpt-bench-s3-") as scratch:
        out = known.out if known.out is not None else Path(scratch)
        forwarded = argv if known.out is not None else [*argv, "--out", str(out)]
        with redirect_stdout(sys.stderr):
            status = s3.main(forwarded)
        if status == EXIT_OK:
            sys.stdout.write((out / f"s3-{known.size_mib}mib.json").read_text())
    return status
