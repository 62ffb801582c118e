"""Min/max buckets: a chart's series cut down to a bounded number of points that keeps its spikes.

The x range ``[lo, hi]`` is cut into ``buckets(max_points)`` equal buckets; of the points in each
bucket the one with the lowest and the one with the highest value are kept (the first of equal
ones), and the series' first and last points. So a series of any length is drawn with at most
``max_points`` points, and no spike, up or down, is lost (an average or a stride would lose them).

Invariants (tests/unit/test_downsample.py checks them with hypothesis): the output is a subsequence
of the input, in its order; it has at most ``max_points`` points; it keeps the first and the last
point; it keeps, in every bucket, a point with the bucket's lowest value and one with its highest.
A series of at most ``max_points`` points is returned whole. Points whose value is None are drawn
only as a series' first or last point.

Pure; called by :mod:`psflow.platform.metricstore` (on raw points, or on each block's extremes).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

P = TypeVar("P", bound=Sequence[Any])

LEAST = 4  # the fewest points a bound may ask for: the first, the last, one bucket's low and high


def buckets(max_points: int) -> int:
    """How many buckets a bound of ``max_points`` leaves room for (two points each, plus first and last)."""
    if max_points < LEAST:
        raise ValueError(f"A chart needs a bound of at least {LEAST} points (first, last, a bucket's low and high); "
                         f"received {max_points}.")
    return (max_points - 2) // 2


def bucket_of(x: float, lo: float, hi: float, n: int) -> int:
    """The bucket (0 .. n-1) of ``x`` when ``[lo, hi]`` is cut into ``n`` equal buckets (clamped at the ends)."""
    if hi <= lo:
        return 0
    return min(n - 1, max(0, int((x - lo) * n / (hi - lo))))


def minmax(points: Sequence[P], max_points: int, *, x: int = 0, value: int = 2,
           lo: float | None = None, hi: float | None = None) -> list[P]:
    """At most ``max_points`` of ``points`` (sorted by ``point[x]``): each bucket's lowest and highest
    ``point[value]``, and the first and last point. ``lo``/``hi``: the range cut into buckets
    (default: the first and last point's x).

    Example:
        >>> minmax([(i, None, 0.0) for i in range(10)] + [(10, None, 9.0)], 4)
        [(0, None, 0.0), (10, None, 9.0)]
    """
    n = buckets(max_points)
    if len(points) <= max_points:
        return list(points)
    lo = points[0][x] if lo is None else lo
    hi = points[-1][x] if hi is None else hi
    low: dict[int, int] = {}
    high: dict[int, int] = {}
    for i, p in enumerate(points):
        v = p[value]
        if v is None:
            continue
        b = bucket_of(p[x], lo, hi, n)
        if b not in low:
            low[b] = high[b] = i
        elif v < points[low[b]][value]:
            low[b] = i
        elif v > points[high[b]][value]:
            high[b] = i
    keep = sorted({0, len(points) - 1, *low.values(), *high.values()})
    return [points[i] for i in keep]
