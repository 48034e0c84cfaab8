"""The statistics every report shares: percentiles and Jain's fairness index."""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0 to 100), interpolated between the closest ranks; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def percentile_or_nan(values: Sequence[float], q: float) -> float:
    """For tables and ratios where a missing value should read as such rather than stop the report."""
    found = percentile(values, q)
    return math.nan if found is None else found


def jain_index(values: Sequence[float]) -> float | None:
    """(sum x)^2 / (n * sum x^2): 1 when all are equal, 1/n when one gets everything; None for fewer
    than two values or all zero."""
    if len(values) < 2:
        return None
    squares = sum(x * x for x in values)
    return sum(values) ** 2 / (len(values) * squares) if squares else None
