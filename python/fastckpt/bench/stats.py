"""Summaries of repeated measurements: median, 90th percentile and range.

A median alone hides a bimodal measurement (a writer fast in half its runs and slow in the
other half can still show a good median), so every summary carries the 90th percentile and the
spread (max - min) next to it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

__all__ = ["SUMMARY_KEYS", "percentile", "summarize"]

#: The keys of every :func:`summarize` result.
SUMMARY_KEYS = ("median", "p90", "min", "max", "spread")


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values``, linearly interpolated between the two
    nearest ranks (numpy's default method), so with 5 values p90 lies between the 4th and the
    5th smallest.

    Raises:
        ValueError: ``values`` is empty or ``q`` is outside 0-100.
    """
    if not values:
        raise ValueError("percentile of no values")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile must be within 0-100, got {q}")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarize(values: Sequence[float]) -> dict[str, float | None]:
    """``{"median", "p90", "min", "max", "spread"}`` of ``values`` (``spread`` = max - min;
    all None when there are none)."""
    if not values:
        return dict.fromkeys(SUMMARY_KEYS)
    low, high = float(min(values)), float(max(values))
    return {
        "median": float(statistics.median(values)),
        "p90": float(percentile(values, 90.0)),
        "min": low,
        "max": high,
        "spread": high - low,
    }
