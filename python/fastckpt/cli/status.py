"""The ``fastckpt`` command's exit statuses (documented in :mod:`fastckpt.cli.main` and
docs/cli.md) and the error that means "exit 2 with this one line". Kept free of imports so
that ``--help``, ``--version`` and usage errors stay light (no torch)."""

from __future__ import annotations

__all__ = [
    "EXIT_BAD",
    "EXIT_ERROR",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_PIPE_CLOSED",
    "EXIT_UNCHECKED",
    "UserError",
]

#: Success: the checkpoint verified, the checkpoints are identical, the command did its work.
EXIT_OK = 0
#: The answer is "bad" or "different": ``verify`` found damage, ``diff`` found a difference.
EXIT_BAD = 1
#: The command could not run: usage error, missing path, unreadable checkpoint, lock timeout.
EXIT_ERROR = 2
#: ``verify`` found no damage but some bytes carry no checksum (a file written without
#: checksums and not listed in a commit record): they were read, not verified.
EXIT_UNCHECKED = 3
#: Interrupted (Ctrl-C).
EXIT_INTERRUPTED = 130
#: Stdout was closed before the whole answer was written (``fastckpt verify ... | head -1``),
#: as a process killed by SIGPIPE exits: the answer was not all delivered, so no status
#: may claim it (0 would call a damaged checkpoint verified).
EXIT_PIPE_CLOSED = 141


class UserError(Exception):
    """A problem with what the user asked for; printed as one line, exit status 2."""
