"""Stragglers: which worker is slow, by how much, and whether it stays slow. Pure.

Input: each worker's ``local_step`` over time, as the job store records it from the progress reports
(one point a second or so). The run's recent span is cut into ``windows`` equal windows (fewer where a window would hold
under three reporting intervals); in each, a
worker's rate is its steps over the time between its first and last point in the window (a window
where it reported fewer than two points, or its step went back, a restart, does not count for it).
In each window the workers' rates are compared with their median: a worker whose steps take at least
``slow_factor`` (1.3) times the median worker's is slow in that window. A worker a little below the
median (0.9x, a busy core, a noisy window) is not slow: every run has a slowest worker.

A worker is a **persistent** straggler only when it is clearly and lastingly slower: slow in at least
``min_windows`` (3) windows, in at least ``persistent_share`` of the windows it was measured in, and
its median rate is at most 1 / ``slow_factor`` of the median worker's. So a worker restarted a window
ago, measured once, is never persistent yet. Slow in some windows but not so: **transient** (said,
and not a straggler); slow in none: no straggler. Only a persistent straggler is a warning (the
dashboard shows it in red); ``slowest`` is the worker slow in the most windows (ties: the lowest
median rate) whenever any was slow.

Called by :mod:`psflow.platform.api` (``GET /api/runs/{run}/stragglers``), which reads the points.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StragglerRules:
    """How slow counts as slow. ``windows``: how many windows the recent span is cut into;
    ``span_s``: how far back the span reaches (None: the whole run); ``slow_factor``: a worker whose
    step takes at least this many times the median worker's is slow in a window; ``min_windows``: the
    fewest slow windows that make a straggler; ``persistent_share``: the share of its windows it must
    be slow in."""

    windows: int = 10
    span_s: float | None = 300.0
    slow_factor: float = 1.3
    min_windows: int = 3
    persistent_share: float = 0.6


def find_stragglers(steps: Mapping[str, Sequence[tuple[float, float]]], rules: StragglerRules = StragglerRules()
                    ) -> dict[str, Any]:
    """Per worker: steps/sec (median over windows), step time, its rate against the median worker's,
    and the windows it was slow in; then the slowest worker and the verdict.

    Args:
        steps: worker -> its ``(time_unix, local_step)`` points, in time order.

    Example:
        >>> find_stragglers({"worker:0": [(0, 0), (10, 100)], "worker:1": [(0, 0), (10, 20)]},
        ...                 StragglerRules(windows=1, min_windows=1))["verdict"]
        'worker:1 runs at 0.33x the median worker (2.00 steps/s against 6.00), slow in 1 of 1 windows: a persistent straggler'
    """
    times = [t for pts in steps.values() for t, _ in pts]
    if len(steps) < 2 or not times:
        return {"workers": {}, "slowest": None, "kind": None, "windows": 0,
                "verdict": "Stragglers need two workers or more that have reported progress."}
    end = max(times)
    start = min(times) if rules.span_s is None else max(min(times), end - rules.span_s)
    # a window must hold a few reports of each worker (they come about once a second): no more
    # windows than that allows, so a short run is judged over fewer, wider windows
    gaps = [b[0] - a[0] for pts in steps.values() for a, b in zip(pts, pts[1:]) if b[0] > a[0]]
    least = 3 * statistics.median(gaps) if gaps else 0.0
    count = max(1, min(rules.windows, int((end - start) / least))) if least > 0 else rules.windows
    width = (end - start) / count if end > start else 0.0
    rates: dict[str, list[float | None]] = {w: [] for w in steps}
    for i in range(count if width else 0):
        lo, hi = start + i * width, start + (i + 1) * width
        for worker, pts in steps.items():
            inside = [(t, s) for t, s in pts if lo <= t <= hi]
            ok = len(inside) >= 2 and inside[-1][0] > inside[0][0] and inside[-1][1] >= inside[0][1]
            rates[worker].append((inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0]) if ok else None)
    slow: dict[str, int] = dict.fromkeys(steps, 0)
    measured: dict[str, int] = dict.fromkeys(steps, 0)
    for i in range(len(next(iter(rates.values())))):
        here = {w: r[i] for w, r in rates.items() if r[i] is not None}
        if len(here) < 2:
            continue
        mid = statistics.median(here.values())
        for w, r in here.items():
            measured[w] += 1
            slow[w] += int(mid > 0 and r * rules.slow_factor <= mid)
    med = {w: statistics.median([r for r in rs if r is not None]) for w, rs in rates.items() if any(r is not None for r in rs)}
    if len(med) < 2:
        return {"workers": {}, "slowest": None, "kind": None, "windows": 0,
                "verdict": "Not enough progress reports yet to compare the workers' speeds."}
    overall = statistics.median(med.values())
    workers = {w: {"steps_per_sec": round(r, 3), "step_time_s": round(1 / r, 4) if r > 0 else None,
                   "vs_median": round(r / overall, 3) if overall > 0 else None, "slow_windows": slow[w],
                   "windows": measured[w]} for w, r in sorted(med.items())}
    # the worker slow in the most windows (a spell shows there, not in a median), then the lowest rate
    slowest = min(med, key=lambda w: (-slow[w], med[w]))
    kind = _kind(slow[slowest], measured[slowest], med[slowest], overall, rules)
    info = workers[slowest]
    factor = f"{rules.slow_factor:g}x"
    if kind is None:
        verdict = f"No straggler: no worker's steps took {factor} the median worker's or more in any window."
    elif kind == "transient":
        verdict = (f"No straggler: {slowest} (at {info['vs_median']:.2f}x the median worker) took {factor} the median "
                   f"step time or more in {slow[slowest]} of {measured[slowest]} windows only; a straggler does in "
                   f"{rules.min_windows} windows or more, and in {rules.persistent_share:.0%} of them")
    else:
        verdict = (f"{slowest} runs at {info['vs_median']:.2f}x the median worker ({med[slowest]:.2f} steps/s against "
                   f"{overall:.2f}), slow in {slow[slowest]} of {measured[slowest]} windows: a persistent straggler")
    return {"workers": workers, "slowest": slowest if kind else None, "kind": kind,
            "windows": max(measured.values(), default=0), "verdict": verdict}


def _kind(slow: int, measured: int, rate: float, median: float, rules: StragglerRules) -> str | None:
    """``persistent`` (clearly and lastingly slower), ``transient`` (slow in some windows only) or None."""
    if slow == 0:
        return None
    lasting = slow >= rules.min_windows and slow >= rules.persistent_share * measured
    clearly = median > 0 and rate * rules.slow_factor <= median
    return "persistent" if lasting and clearly else "transient"
