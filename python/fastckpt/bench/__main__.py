"""``python -m fastckpt.bench``: run the benchmark harness (see :mod:`fastckpt.bench.cli`)."""

from __future__ import annotations

from fastckpt.bench.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
