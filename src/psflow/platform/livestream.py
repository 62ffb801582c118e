"""Live updates of one run as Server-Sent Events (``GET /api/runs/{run}/stream``), for the run page.

The launcher writes the job store from its own process, so the dashboard learns of changes by reading
it: one look every ``poll_s`` per open stream (a thread-pool read), and a message only for what is new:

- ``run``: the run page (what ``GET /api/runs/{run}`` answers: the run, its tasks' states and
  attempts, events, controls), sent when it changed since the last one sent;
- ``metrics``: metric points (``{"series": {task: {name: [[time, step, value], ...]}}, "cursor": N}``,
  the shape of ``GET /api/runs/{run}/metrics``): the first carries each series' history as a bounded
  chart (min/max buckets; ``"history": true``), the later ones only the points written since the last
  one, read from its cursor (a rowid range scan: what is new, not the run's length). Each carries
  ``id:`` = its cursor, so a browser that reconnects (``Last-Event-ID``) gets only what came after;
- ``end``: the run is over and its last state and points were sent; the stream closes (a browser's
  EventSource must close too, or it would reconnect).

A comment line every ``keepalive_s`` keeps proxies from closing a quiet stream. The stream also ends
when the client leaves or the dashboard shuts down (``closing``). Reads are open as the other GET
endpoints are (the token too with a non-loopback bind: a browser's EventSource cannot send it, so the
page falls back to polling there).

:func:`frame` and :func:`new_points` are pure; :func:`run_stream` is the shell. Called by
:mod:`psflow.platform.api`.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from typing import Any

END_STATES = ("succeeded", "failed", "stopped", "abandoned")


def frame(event: str, data: Any, event_id: str | None = None) -> str:
    """One SSE message: ``event:``, an optional ``id:``, and ``data:`` as one line of JSON."""
    head = f"event: {event}\n" + (f"id: {event_id}\n" if event_id is not None else "")
    return f"{head}data: {json.dumps(data, default=str, separators=(',', ':'))}\n\n"


Series = dict[str, dict[str, list[list[Any]]]]
Look = tuple[dict[str, Any] | None, Series, int]  # the run page (None: gone), metric points, the cursor after them


def new_points(points: Iterable[Mapping[str, Any]]) -> Series:
    """``points`` (the store's rows, in order) as series per task and name."""
    series: Series = {}
    for p in points:
        series.setdefault(p["task"], {}).setdefault(p["name"], []).append([p["time_unix"], p["step"], p["value"]])
    return series


async def run_stream(look: Callable[[int | None], Look], *, cursor: int | None, is_disconnected: Callable[[], Any],
                     closing: threading.Event, poll_s: float = 1.0, keepalive_s: float = 15.0) -> AsyncIterator[str]:
    """The stream's messages. ``look(cursor)`` (run on a thread) returns the run page (None: the run is
    gone), the metric points written after ``cursor`` (None: the history, bounded) and the cursor
    after them."""
    from starlette.concurrency import run_in_threadpool

    sent_page: str | None = None
    last_sent = time.monotonic()
    while not closing.is_set() and not await is_disconnected():
        history = cursor is None
        page, series, cursor = await run_in_threadpool(look, cursor)
        out = []
        if page is not None:
            text = json.dumps(page, default=str, sort_keys=True)
            if text != sent_page:
                sent_page = text
                out.append(frame("run", page))
        if series or history:
            out.append(frame("metrics", {"series": series, "cursor": cursor, "history": history}, event_id=str(cursor)))
        over = page is None or page["run"]["state"] in END_STATES
        if over:
            out.append(frame("end", {"state": None if page is None else page["run"]["state"]}))
        if not out and time.monotonic() - last_sent >= keepalive_s:
            out.append(": keepalive\n\n")
        if out:
            last_sent = time.monotonic()
            yield "".join(out)
        if over:
            return
        await asyncio.sleep(poll_s)
