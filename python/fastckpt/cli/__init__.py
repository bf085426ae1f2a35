"""The ``fastckpt`` command line: ``main`` parses and dispatches (:mod:`fastckpt.cli.main`);
one module per command (``ls``, ``inspect``, ``verify``, ``diff``, ``prune``, ``export``,
``bench``), with what they share in :mod:`fastckpt.cli.common` and :mod:`fastckpt.cli.render`.
"""

from fastckpt.cli.main import build_parser, main
from fastckpt.cli.status import UserError

__all__ = ["UserError", "build_parser", "main"]
