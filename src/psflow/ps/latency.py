"""A ps shard's request latencies: push and pull, per report window (the ps card's rate and p50/p99).

:class:`LatencyBook` keeps each timed request's duration (seconds, measured around the handler on
the ps's server thread) in a per-op list until :meth:`LatencyBook.take` reads and empties it, about
once a second from the ps's main loop (:meth:`psflow.task.Task.join`), which sends the figures with
its progress report. The hot path is one ``list.append`` (atomic under the GIL, so the server's
threads need no lock); past ``cap`` samples in a window the rest are counted, not kept, so a ps
whose loop does not read the book (a benchmark's, a test's) holds at most ``cap`` floats per op.

A window's figures, per op: ``{op}_rate`` (requests per second over the window), and when the
window had requests ``{op}_p50_ms`` and ``{op}_p99_ms`` (nearest rank over the kept samples). A
window without requests reports its rate (0) only (the dashboard then shows no percentiles for it:
:mod:`psflow.platform.pshealth`).

Called by :mod:`psflow.ps.service` (record) and :mod:`psflow.task` (take).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

OPS = ("push", "pull")


def quantile(sorted_values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (0 < q <= 1) of ``sorted_values`` (ascending, not empty)."""
    rank = max(1, math.ceil(q * len(sorted_values)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


class LatencyBook:
    """Durations of the timed requests since the last :meth:`take`, per op (``push``, ``pull``).

    Args:
        started: the window's start (``time.monotonic()``), where the first rate counts from.
        cap: most samples kept per op and window (the rest are counted in the rate only).
    """

    def __init__(self, started: float, *, cap: int = 65536) -> None:
        self.cap = cap
        self._since = started
        self._samples: dict[str, list[float]] = {op: [] for op in OPS}
        self._overflow: dict[str, int] = dict.fromkeys(OPS, 0)

    def record(self, op: str, seconds: float) -> None:
        """One request of ``op`` took ``seconds`` (any thread)."""
        samples = self._samples[op]
        if len(samples) < self.cap:
            samples.append(seconds)
        else:
            self._overflow[op] += 1  # a racy count only past the cap: the rate is an estimate there

    def take(self, now: float) -> dict[str, float]:
        """The window since the last take (or the start) up to ``now``: rates and percentiles in ms;
        starts the next window."""
        elapsed = now - self._since
        self._since = now
        out: dict[str, float] = {}
        for op in OPS:
            # swap, then read: an append racing the swap lands in the old list, read just below or lost
            samples, self._samples[op] = self._samples[op], []
            overflow, self._overflow[op] = self._overflow[op], 0
            count = len(samples) + overflow
            out[f"{op}_rate"] = round(count / elapsed, 2) if elapsed > 0 else 0.0
            if samples:
                ordered = sorted(samples)
                out[f"{op}_p50_ms"] = round(quantile(ordered, 0.50) * 1e3, 3)
                out[f"{op}_p99_ms"] = round(quantile(ordered, 0.99) * 1e3, 3)
        return out
