"""The ``fastckpt`` command: list, inspect, verify, diff, prune and export checkpoints.

Every subcommand prints a human-readable table by default and a JSON document with
``--json``. Exit status: 0 success, 1 the answer is "bad" or "different" (``verify`` found a
damaged file, ``diff`` found a difference), 2 the command could not run (missing path, bad
index, unreadable checkpoint, usage error). Errors are one line on stderr, never a traceback
(``--debug`` shows it). Long operations draw a progress bar on stderr when it is a terminal.

A checkpoint PATH may be:

* a :func:`fastckpt.save_checkpoint` root (holds ``manifest.json``),
* one index directory of such a root (``ROOT/<index>``),
* a :class:`fastckpt.CheckpointManager` checkpoint (a directory holding ``commit.json``),
* a single ``.safetensors`` file.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NoReturn

from fastckpt import __version__
from fastckpt.cli.bench import run_bench
from fastckpt.cli.common import (
    EXIT_ERROR,
    EXIT_OK,
    UserError,
    error_text,
)
from fastckpt.cli.diff import cmd_diff
from fastckpt.cli.export import cmd_export
from fastckpt.cli.inspect import cmd_inspect
from fastckpt.cli.ls import cmd_ls
from fastckpt.cli.prune import cmd_prune
from fastckpt.cli.verify import cmd_verify
from fastckpt.errors import FastCkptError

# --------------------------------------------------------------------------- the parser


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line."""

    def error(self, message: str) -> NoReturn:
        """Print ``prog: error: message`` on one line and exit with status 2."""
        self.exit(EXIT_ERROR, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _index(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer index") from None
    if value < -1:
        raise argparse.ArgumentTypeError(f"must be >= 0 (or -1 for the latest), got {value}")
    return value


def _common(*, top: bool) -> _Parser:
    """Options accepted both before and after the subcommand."""
    parent = _Parser(add_help=False)
    default: Any = False if top else argparse.SUPPRESS
    parent.add_argument("--json", action="store_true", default=default, help="print JSON")
    parent.add_argument(
        "--debug", action="store_true", default=default, help="show tracebacks of errors"
    )
    parent.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        default=default,
        help="print the library's log (logger 'fastckpt', INFO) on stderr",
    )
    return parent


def build_parser() -> argparse.ArgumentParser:
    """The ``fastckpt`` argument parser (``fastckpt --help`` documents every option)."""
    parser = _Parser(
        prog="fastckpt",
        description="Inspect and maintain fastckpt checkpoints.",
        epilog="exit status: 0 ok, 1 verify found damage / diff found differences, 2 error",
        parents=[_common(top=True)],
    )
    parser.add_argument("--version", action="version", version=f"fastckpt {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    common = [_common(top=False)]

    ls = commands.add_parser(
        "ls", parents=common, help="list the committed indices of a root (or manager checkpoints)"
    )
    ls.add_argument("root", metavar="ROOT")
    ls.set_defaults(handler=cmd_ls)

    inspect = commands.add_parser(
        "inspect", parents=common, help="components, tensors, specs and metadata of a checkpoint"
    )
    inspect.add_argument("path", metavar="PATH")
    inspect.add_argument("--index", type=_index, help="index of a root (default: latest)")
    inspect.set_defaults(handler=cmd_inspect)

    verify = commands.add_parser(
        "verify", parents=common, help="check every file's size and crc32c; exit 1 if damaged"
    )
    verify.add_argument("path", metavar="PATH")
    verify.add_argument("--index", type=_index, help="only this index of a root (-1: latest)")
    verify.set_defaults(handler=cmd_verify)

    diff = commands.add_parser(
        "diff", parents=common, help="which tensors differ between two checkpoints; exit 1 if any"
    )
    diff.add_argument("a", metavar="A")
    diff.add_argument("b", metavar="B")
    diff.add_argument(
        "--atol", type=float, default=0.0, help="count tensors within this max |a-b| as equal"
    )
    diff.set_defaults(handler=cmd_diff)

    prune_cmd = commands.add_parser(
        "prune", parents=common, help="delete all but the newest N indices of a root"
    )
    prune_cmd.add_argument("root", metavar="ROOT")
    prune_cmd.add_argument("--keep-last", type=_positive, required=True, metavar="N")
    prune_cmd.add_argument("--dry-run", action="store_true", help="only say what would go")
    prune_cmd.set_defaults(handler=cmd_prune)

    export = commands.add_parser(
        "export", parents=common, help="write one model's weights as a plain safetensors file"
    )
    export.add_argument("path", metavar="PATH")
    export.add_argument("--to", required=True, metavar="FILE", help="the file to write")
    export.add_argument("--index", type=_index, help="index of a root (default: latest)")
    export.add_argument("--model", help="model name (or manager item); needed if several")
    export.add_argument("--force", action="store_true", help="replace FILE if it exists")
    export.set_defaults(handler=cmd_export)

    commands.add_parser(
        "bench",
        add_help=False,
        help="run the benchmark harness (arguments go to python -m fastckpt.bench)",
    )
    return parser


_GLOBAL_FLAGS = frozenset({"--json", "--debug", "-v", "--verbose"})


def _split_bench(argv: Sequence[str]) -> tuple[list[str], list[str]] | None:
    """``(global flags, harness args)`` when the subcommand is ``bench``, else None."""
    for position, token in enumerate(argv):
        if token in _GLOBAL_FLAGS:
            continue
        if token == "bench":
            return list(argv[:position]), list(argv[position + 1 :])
        return None
    return None


@contextmanager
def _broken_pipe_guard() -> Iterator[None]:
    """Exit quietly when stdout is closed early (``fastckpt ls ROOT | head -1``)."""
    try:
        yield
        sys.stdout.flush()
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        raise SystemExit(EXIT_OK) from None


def _configure_logging(verbose: bool) -> None:
    if verbose:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
        logger = logging.getLogger("fastckpt")
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``fastckpt`` command line; returns the exit status.

    Args:
        argv: the arguments (default ``sys.argv[1:]``).
    """
    arguments = list(sys.argv[1:] if argv is None else argv)
    bench = _split_bench(arguments)
    if bench is not None:
        flags, rest = bench
        _configure_logging("-v" in flags or "--verbose" in flags)
        as_json = "--json" in flags or "--json" in rest
        rest = [arg for arg in rest if arg != "--json"]
        return _run(lambda: run_bench(rest, as_json=as_json), "bench", "--debug" in flags)
    args = build_parser().parse_args(arguments)
    _configure_logging(args.verbose)
    handler: Callable[[argparse.Namespace], int] = args.handler
    return _run(lambda: handler(args), args.command, args.debug)


def _run(action: Callable[[], int], command: str, debug: bool) -> int:
    """Run a subcommand, turning user errors into one line on stderr and exit status 2."""
    try:
        with _broken_pipe_guard():
            return action()
    except (UserError, FastCkptError, OSError) as err:
        if debug:
            raise
        print(f"fastckpt {command}: error: {error_text(err)}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"fastckpt {command}: interrupted", file=sys.stderr)
        return 130
