"""Running the ``fastckpt`` command line in-process, as the CLI tests do."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from fastckpt import cli

#: ``run(*args)`` -> (exit status, stdout, stderr).
Run = Callable[..., tuple[int, str, str]]


def cli_runner(capsys: pytest.CaptureFixture[str]) -> Run:
    """``cli.main(args)`` with each argument as text: (status, stdout, stderr); an argparse
    exit counts as its status."""

    def call(*args: object) -> tuple[int, str, str]:
        try:
            status = cli.main([str(a) for a in args])
        except SystemExit as exit_:  # argparse
            status = int(exit_.code or 0)
        out, err = capsys.readouterr()
        return status, out, err

    return call
