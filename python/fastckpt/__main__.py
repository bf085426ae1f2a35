"""``python -m fastckpt``: the ``fastckpt`` command line (see :mod:`fastckpt.cli`)."""

from __future__ import annotations

from fastckpt.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
