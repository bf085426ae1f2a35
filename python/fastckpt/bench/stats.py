"""Summaries of repeated measurements: median and range."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

__all__ = ["summarize"]


def summarize(values: Sequence[float]) -> dict[str, float | None]:
    """``{"median", "min", "max"}`` of ``values`` (all None when there are none)."""
    if not values:
        return {"median": None, "min": None, "max": None}
    return {
        "median": float(statistics.median(values)),
        "min": float(min(values)),
        "max": float(max(values)),
    }
