"""Min/max buckets (psflow.platform.downsample): bounded, first and last kept, every bucket's extremes kept."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from psflow.platform.downsample import bucket_of, buckets, minmax

values = st.one_of(st.none(), st.floats(-1e6, 1e6, allow_nan=False))


@st.composite
def series(draw):
    """Points (x, step, value) sorted by x, x repeated at times, some values None."""
    xs = sorted(draw(st.lists(st.floats(0, 1e4, allow_nan=False), min_size=1, max_size=400)))
    return [(x, i, draw(values)) for i, x in enumerate(xs)]


@settings(max_examples=300, deadline=None)
@given(series(), st.integers(4, 120))
def test_the_output_is_bounded_in_order_and_keeps_the_ends_and_every_buckets_extremes(points, max_points):
    out = minmax(points, max_points)
    assert len(out) <= max_points
    assert out[0] is points[0] and out[-1] is points[-1]
    positions = [points.index(p) for p in out]  # each point is its own object: a subsequence, in order
    assert positions == sorted(set(positions))
    if len(points) <= max_points:
        assert out == points
        return
    n, lo, hi = buckets(max_points), points[0][0], points[-1][0]
    for b in {bucket_of(p[0], lo, hi, n) for p in points}:
        real = [p[2] for p in points if bucket_of(p[0], lo, hi, n) == b and p[2] is not None]
        kept = [p[2] for p in out if bucket_of(p[0], lo, hi, n) == b and p[2] is not None]
        if real:
            assert min(kept) == min(real) and max(kept) == max(real), b


@settings(max_examples=100, deadline=None)
@given(series(), st.integers(4, 60), st.floats(0, 5e3), st.floats(0, 5e3))
def test_a_range_asked_for_cuts_only_that_range(points, max_points, a, width):
    lo, hi = a, a + width
    inside = [p for p in points if lo <= p[0] <= hi]
    out = minmax(inside, max_points, lo=lo, hi=hi)
    assert len(out) <= max_points and all(lo <= p[0] <= hi for p in out)


def test_a_spike_of_one_point_in_a_long_series_is_kept():
    points = [(float(i), i, 1.0) for i in range(200_000)]
    points[123_457] = (123_457.0, 123_457, 50.0)
    points[7] = (7.0, 7, -3.0)
    out = minmax(points, 1000)
    assert len(out) <= 1000 and (123_457.0, 123_457, 50.0) in out and (7.0, 7, -3.0) in out


def test_the_bucket_of_an_x_is_clamped_to_the_range_and_a_bound_below_four_is_refused():
    assert [bucket_of(x, 0.0, 10.0, 5) for x in (-1.0, 0.0, 1.99, 2.0, 10.0, 11.0)] == [0, 0, 0, 1, 4, 4]
    assert bucket_of(3.0, 3.0, 3.0, 5) == 0
    with pytest.raises(ValueError, match="at least 4 points.*received 3"):
        minmax([(0, 0, 0)], 3)
