"""The ``fastckpt`` command: list, inspect, verify, diff, prune, promote and export checkpoints.

Every subcommand prints a human-readable table by default and a JSON document with
``--json``. Errors are one line on stderr, never a traceback (``--debug`` shows it); with
``--json`` they are a JSON document on stdout (``{"error": ..., "command": ...,
"exit_status": 2}``). Long operations draw a progress bar on stderr when it is a terminal.

Exit statuses (:mod:`fastckpt.cli.status`):

* 0 (``EXIT_OK``): success; ``verify``: every byte checked against a checksum;
* 1 (``EXIT_BAD``): ``verify`` found damage, ``diff`` found a difference;
* 2 (``EXIT_ERROR``): the command could not run (usage error, missing path, bad index,
  unreadable checkpoint, ``prune --lock-timeout`` elapsed);
* 3 (``EXIT_UNCHECKED``): ``verify`` found no damage, but some bytes have no checksum (a
  file written without checksums, outside any commit record): read, not verified;
* 130 (``EXIT_INTERRUPTED``): interrupted;
* 141 (``EXIT_PIPE_CLOSED``): stdout closed before the whole answer was written.

``--help``, ``--version`` and usage errors do not import torch: the subcommands' modules are
imported only to run them.

A checkpoint PATH may be:

* a :func:`fastckpt.save_checkpoint` root (holds ``manifest.json``),
* one index directory of such a root (``ROOT/<index>``),
* a :class:`fastckpt.CheckpointManager` checkpoint (a directory holding ``commit.json``),
* a single ``.safetensors`` file,
* for ``verify``, ``inspect`` and ``prune``: a directory of CheckpointManager checkpoints (what
  ``fastckpt ls`` lists there).
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NoReturn

from fastckpt.cli.status import (
    EXIT_BAD,
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_PIPE_CLOSED,
    EXIT_UNCHECKED,
    UserError,
)
from fastckpt.cli.text import printable

__all__ = [
    "EXIT_BAD",
    "EXIT_ERROR",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_PIPE_CLOSED",
    "EXIT_UNCHECKED",
    "build_parser",
    "main",
]


def _path_text(text: str) -> str:
    """A path argument as given, refused when empty: ``''`` (a shell variable left unset)
    would be the current directory, saved into, pruned or promoted into by mistake."""
    if not text:
        raise argparse.ArgumentTypeError(
            "an empty path (a variable left unset?); the current directory is '.'"
        )
    return text


def _version() -> str:
    """The installed distribution's version, read without importing fastckpt's modules."""
    from importlib.metadata import PackageNotFoundError, packages_distributions, version

    try:  # the distribution's name: one lookup (a scan of every distribution costs 0.4 s)
        return version("fastckpt-io")
    except PackageNotFoundError:
        pass
    # Installed under another name: the distribution that holds the package.
    for name in packages_distributions().get("fastckpt") or ["fastckpt"]:
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return "0.0.0"


class _VersionAction(argparse.Action):
    """``--version``: print and exit, reading the version only when asked."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        print(f"fastckpt {_version()}")
        parser.exit(EXIT_OK)


# --------------------------------------------------------------------------- the parser


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line."""

    json_errors = False

    def error(self, message: str) -> NoReturn:
        """Print ``prog: error: message`` on one line (JSON with ``--json``), exit status 2."""
        if _Parser.json_errors:
            print(_error_json(self.prog, f"{message} (see {self.prog} --help)"))
            self.exit(EXIT_ERROR)
        self.exit(EXIT_ERROR, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _error_json(command: str, message: str) -> str:
    return json.dumps({"error": message, "command": command, "exit_status": EXIT_ERROR})


def _number(convert: Callable[[str], Any], what: str, low: float, rule: str) -> Any:
    """An argparse type: ``convert(text)``, refused with ``rule`` below ``low``."""

    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not value >= low:
            raise argparse.ArgumentTypeError(f"{rule}, got {text}")
        return value

    return parse


_positive = _number(int, "an integer", 1, "must be >= 1")
_index = _number(int, "an integer index", -1, "must be >= 0 (or -1 for the latest)")
_seconds = _number(float, "a number of seconds", 0, "must be >= 0")


def _handler(module: str, function: str) -> Callable[[argparse.Namespace], int]:
    """A subcommand's handler, imported when it runs (so ``--help`` stays light)."""

    def run(args: argparse.Namespace) -> int:
        command: Callable[[argparse.Namespace], int] = getattr(
            importlib.import_module(f"fastckpt.cli.{module}"), function
        )
        return command(args)

    return run


_PATH_HELP = (
    "a save_checkpoint root, one of its index directories, a CheckpointManager checkpoint "
    "or a .safetensors file"
)
_DIR_HELP = "; or a directory of CheckpointManager checkpoints"


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
        epilog=(
            "exit status: 0 ok, 1 verify found damage / diff found differences, 2 error, "
            "3 verify found bytes without checksums (unchecked), 130 interrupted"
        ),
        parents=[_common(top=True)],
    )
    parser.add_argument("--version", action=_VersionAction, help="print the version and exit")
    commands = parser.add_subparsers(
        dest="command",
        metavar="COMMAND",
        required=True,
        help="what to do (fastckpt COMMAND --help describes its arguments)",
    )
    common = [_common(top=False)]

    ls = commands.add_parser(
        "ls", parents=common, help="list the committed indices of a root (or manager checkpoints)"
    )
    ls.add_argument(
        "root",
        metavar="ROOT",
        type=_path_text,
        help="a save_checkpoint root, or a directory of CheckpointManager checkpoints",
    )
    ls.set_defaults(handler=_handler("ls", "cmd_ls"))

    inspect = commands.add_parser(
        "inspect", parents=common, help="components, tensors, specs and metadata of a checkpoint"
    )
    inspect.add_argument(
        "path",
        metavar="PATH",
        type=_path_text,
        help=_PATH_HELP + _DIR_HELP + " (its newest is inspected)",
    )
    inspect.add_argument("--index", type=_index, help="index of a root (default: latest)")
    inspect.set_defaults(handler=_handler("inspect", "cmd_inspect"))

    verify = commands.add_parser(
        "verify",
        parents=common,
        help="check every file's size and crc32c; exit 1 if damaged, 3 if bytes are unchecked",
    )
    verify.add_argument(
        "path", metavar="PATH", type=_path_text, help=_PATH_HELP + _DIR_HELP + " (all of them)"
    )
    verify.add_argument("--index", type=_index, help="only this index of a root (-1: latest)")
    verify.set_defaults(handler=_handler("verify", "cmd_verify"))

    diff = commands.add_parser(
        "diff", parents=common, help="which tensors differ between two checkpoints; exit 1 if any"
    )
    diff.add_argument("a", metavar="A", type=_path_text, help="the first checkpoint: " + _PATH_HELP)
    diff.add_argument(
        "b",
        metavar="B",
        type=_path_text,
        help="the second checkpoint (a file exported from A is compared with that model)",
    )
    diff.add_argument(
        "--atol",
        type=float,
        default=0.0,
        help="count tensors within this max |a-b| as equal (default 0: only identical bits)",
    )
    diff.add_argument(
        "--limit",
        type=int,
        default=20,
        help="rows shown per table (default 20; 0: all; --json always lists all)",
    )
    diff.set_defaults(handler=_handler("diff", "cmd_diff"))

    prune_cmd = commands.add_parser(
        "prune",
        parents=common,
        help="delete all but the newest N indices of a root (or manager checkpoints)",
    )
    prune_cmd.add_argument(
        "root",
        metavar="ROOT",
        type=_path_text,
        help="a save_checkpoint root" + _DIR_HELP + " (newest by commit time are kept)",
    )
    prune_cmd.add_argument(
        "--keep-last",
        type=_positive,
        required=True,
        metavar="N",
        help="how many of the newest checkpoints to keep (>= 1; the latest is never deleted)",
    )
    prune_cmd.add_argument("--dry-run", action="store_true", help="only say what would go")
    prune_cmd.add_argument(
        "--lock-timeout",
        type=_seconds,
        default=None,
        metavar="SECONDS",
        help="give up (exit 2) if another process holds the root's lock this long "
        "(default: wait, saying who holds it); save_checkpoint roots only",
    )
    prune_cmd.set_defaults(handler=_handler("prune", "cmd_prune"))

    promote_cmd = commands.add_parser(
        "promote",
        parents=common,
        help="copy a root's committed indices (or a tier's newest CheckpointManager "
        "checkpoint) to another root (a durable tier), verified, commit last",
    )
    promote_cmd.add_argument(
        "source",
        metavar="SOURCE",
        type=_path_text,
        help="a save_checkpoint root, or a tier root of CheckpointManager checkpoints",
    )
    promote_cmd.add_argument(
        "target",
        metavar="TARGET",
        type=_path_text,
        help="the root to copy into (a directory or s3:// URL)",
    )
    promote_cmd.add_argument(
        "--every",
        type=_positive,
        default=1,
        metavar="N",
        help="promote only indices that are multiples of N (and always the newest); "
        "save_checkpoint roots only",
    )
    promote_cmd.add_argument(
        "--wait",
        type=_seconds,
        default=600.0,
        metavar="SECONDS",
        help="a sharded run's node-local fast root: how long rank 0's node waits for the "
        "other nodes' shards (run fastckpt promote on each node) before giving up with exit 2 "
        "(default 600)",
    )
    promote_cmd.set_defaults(handler=_handler("promote", "cmd_promote"))

    export = commands.add_parser(
        "export", parents=common, help="write one model's weights as a plain safetensors file"
    )
    export.add_argument(
        "path",
        metavar="PATH",
        type=_path_text,
        help="a save_checkpoint root, one of its index directories, or a CheckpointManager "
        "checkpoint",
    )
    export.add_argument(
        "--to", required=True, metavar="FILE", type=_path_text, help="the file to write"
    )
    export.add_argument("--index", type=_index, help="index of a root (default: latest)")
    export.add_argument(
        "--model",
        help="model name (or manager item); needed if several; 'ema' exports the EMAHook's "
        "averaged weights",
    )
    export.add_argument("--force", action="store_true", help="replace FILE if it exists")
    export.set_defaults(handler=_handler("export", "cmd_export"))

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
    """Exit quietly when stdout is closed early (``fastckpt ls ROOT | head -1``), with
    :data:`EXIT_PIPE_CLOSED` (before: 0, which under ``set -o pipefail`` called a damaged
    checkpoint verified)."""
    try:
        yield
        sys.stdout.flush()
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        raise SystemExit(EXIT_PIPE_CLOSED) from None


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
    _printable_names()
    bench = _split_bench(arguments)
    if bench is not None:
        flags, rest = bench
        _configure_logging("-v" in flags or "--verbose" in flags)
        as_json = "--json" in flags or "--json" in rest
        rest = [arg for arg in rest if arg != "--json"]

        def run_bench() -> int:
            from fastckpt.cli.bench import run_bench

            return run_bench(rest, as_json=as_json)

        return _run(run_bench, "bench", "--debug" in flags, as_json)
    _Parser.json_errors = "--json" in arguments
    try:
        args = build_parser().parse_args(arguments)
    finally:
        _Parser.json_errors = False
    _configure_logging(args.verbose)
    handler: Callable[[argparse.Namespace], int] = args.handler
    return _run(lambda: handler(args), args.command, args.debug, args.json)


def _printable_names() -> None:
    """Let stdout and stderr print any name a filesystem holds: one that is not UTF-8 (the
    byte 0xE9 of a Latin-1 name, a lone surrogate in Python) is shown with a backslash escape,
    where a strict stream raised ``UnicodeEncodeError`` in the middle of an answer
    (``fastckpt prune`` had deleted the checkpoints it then failed to list)."""
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None and getattr(stream, "errors", None) == "strict":
            reconfigure(errors="backslashreplace")


def _run(action: Callable[[], int], command: str, debug: bool, as_json: bool = False) -> int:
    """Run a subcommand, turning user errors into one line on stderr (a JSON document on
    stdout with ``--json``) and exit status 2."""
    try:
        with _broken_pipe_guard():
            return action()
    except (UserError, OSError) as err:
        return _report(err, command, debug, as_json)
    except Exception as err:
        from fastckpt.errors import FastCkptError

        if isinstance(err, FastCkptError):
            return _report(err, command, debug, as_json)
        if debug or not _raised_by_an_interrupt(err):
            raise
        return _interrupted(command)
    except KeyboardInterrupt:
        if debug:
            raise
        return _interrupted(command)


def _interrupted(command: str) -> int:
    print(f"fastckpt {command}: interrupted", file=sys.stderr)
    return EXIT_INTERRUPTED


def _raised_by_an_interrupt(err: BaseException) -> bool:
    """Whether a ``KeyboardInterrupt`` caused ``err``: Python wraps one that lands in some
    places (a class body's ``__set_name__`` while a module is imported) in a
    ``RuntimeError``, which exited 1 with a traceback, the status ``verify`` gives damage
    (round 22)."""
    seen: set[int] = set()
    cause: BaseException | None = err
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, KeyboardInterrupt):
            return True
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return False


def _report(err: Exception, command: str, debug: bool, as_json: bool) -> int:
    if debug:
        raise err
    from fastckpt.cli.common import error_text

    if as_json:
        print(_error_json(f"fastckpt {command}", error_text(err)))
    else:
        # A message may quote a name read from a file (a tensor's, a folder's): escaped.
        print(f"fastckpt {command}: error: {printable(error_text(err))}", file=sys.stderr)
    return EXIT_ERROR
