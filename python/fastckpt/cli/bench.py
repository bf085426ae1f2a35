"""``fastckpt bench ...``: the benchmark harness behind the command line."""

from __future__ import annotations

import sys
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
    from fastckpt.bench.harness import default_tag

    options = bench_cli.build_parser().parse_args(list(argv))
    with redirect_stdout(sys.stderr):
        status = bench_cli.main(list(argv))
    if status == EXIT_OK:
        tag = options.tag or default_tag(options.size_gib)
        sys.stdout.write((Path(options.out) / f"{tag}.json").read_text())
    return status
