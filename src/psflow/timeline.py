"""The timeline: where a step's time goes, written as a Chrome trace (``psflow run --timeline``).

Owns the per-process recorder (:data:`ACTIVE`), the span categories, each task's trace file, the
merge of every task's file into one ``LOGDIR/timeline.json`` that Perfetto (ui.perfetto.dev) and
``chrome://tracing`` open, and each phase's share of the step for the summary.

Who records what (categories; a span's name says more, e.g. ``push ps:1``):

- a worker's main thread (:mod:`psflow.train.trainer`): ``step``, and in it ``forward``,
  ``backward`` (``compute`` with several devices), ``push`` (waiting for the last push to be out),
  ``wait`` (the sync quorum, the ssp bound, or in async mode the ps's reply until its first byte)
  and ``pull`` (the values' bytes, per shard); its push thread (:mod:`psflow.train.sender`):
  ``push`` per shard, beside backward when a shard's gradients are ready early;
- an all-reduce rank's main thread (:mod:`psflow.train.allreduce`): ``step``, ``forward``,
  ``backward``, ``allreduce`` and ``optimizer``; DDP's bucket all-reduces on a track of their own;
- a ps's connection threads (:mod:`psflow.server`, :mod:`psflow.ps.service`): ``receive``,
  ``apply``, ``wait`` (a sync push-pull waiting for its step) and ``send``.

Clocks: wall-clock microseconds (``time.time()`` once at :func:`start`, plus ``perf_counter`` since).
Each launched task estimates its clock's offset to the launcher's NTP-style over its coordinator
connection (:func:`estimate_offset`), and :func:`merge` shifts its spans by it
(``docs/design/timeline.md``). Off (the default), :data:`ACTIVE` is None and every hook is one
``if``; on, a span costs two clock reads and one dict appended to a list. Invariants: a trace file
is written once per process, at its end; the merged file has one trace process per task attempt
and one trace thread per OS thread, named.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from psflow.rundir import RunDir, task_of_stem

STEP_PHASES = ("forward", "backward", "compute", "push", "wait", "pull", "allreduce", "optimizer")  # a step (ps: push..pull; all-reduce: allreduce, optimizer)
PS_PHASES = ("receive", "apply", "wait", "send")  # a ps's work on a request

ACTIVE: Timeline | None = None  # this process's recorder; None: the timeline is off


class Timeline:
    """One process's spans, in memory until :meth:`write`.

    Args:
        task: the task's name (``worker:1``), the trace process's name.
        attempt: its restart count (a restarted task's spans go to a process of their own).
    """

    def __init__(self, task: str, attempt: int = 0, *, skew_us: float = 0.0) -> None:
        self.task, self.attempt = task, attempt
        self.events: list[dict[str, Any]] = []
        self.threads: dict[int, str] = {}
        self._tracks: dict[str, int] = {}  # named tracks (add(track=...)) -> their trace thread id
        self.clock: ClockOffset | None = None  # this clock's offset to the reference, once measured (align)
        self._wall0_us = time.time() * 1e6 + skew_us  # skew_us: a host whose clock is off (PSFLOW_CLOCK_SKEW, tests)
        self._perf0 = time.perf_counter()

    def now(self) -> float:
        """Wall-clock microseconds, read through the precise monotonic clock."""
        return self._wall0_us + (time.perf_counter() - self._perf0) * 1e6

    def add(self, cat: str, name: str, start_us: float, end_us: float, *, track: str | None = None,
            **args: Any) -> None:
        """A complete span (Chrome's ``ph: "X"``) on the calling thread, or on the named ``track`` (a
        trace thread of its own, for work that runs on whichever thread completes it)."""
        if track is None:
            tid = threading.get_native_id()
            if tid not in self.threads:
                self.threads[tid] = threading.current_thread().name
        else:
            tid = self._tracks.get(track, 0)
            if not tid:  # past any OS thread id (pid_max is at most 2**22)
                tid = self._tracks[track] = (1 << 30) + len(self._tracks)
                self.threads[tid] = track
        event: dict[str, Any] = {"name": name, "cat": cat, "ph": "X", "ts": round(start_us, 1),
                                 "dur": round(max(0.0, end_us - start_us), 1), "tid": tid}
        if args:
            event["args"] = args
        self.events.append(event)

    def shares(self) -> dict[str, Any]:
        """This process's figures for the summary: a worker's share of its step per phase, a ps's
        share of its busy time per phase (see :func:`step_shares`, :func:`busy_shares`)."""
        events = list(self.events)
        if any(e["cat"] == "step" for e in events):
            return step_shares(events)
        return busy_shares(events)

    def align(self, ask_reference_us: Callable[[], float], *, rounds: int = 16) -> ClockOffset:
        """Measure this clock's offset to a reference clock: ``rounds`` calls of ``ask_reference_us``
        (one round trip that returns the reference's :func:`clock_us`), timed on this clock; kept in
        :attr:`clock` and written with the spans. Raises what ``ask_reference_us`` raises."""
        samples = []
        for _ in range(rounds):
            sent = self.now()
            reference = ask_reference_us()
            samples.append((sent, reference, self.now()))
        self.clock = estimate_offset(samples)
        return self.clock

    def write(self, logdir: str | os.PathLike[str]) -> Path:
        """Write this process's spans to ``LOGDIR/timeline/<task>.<attempt>.json``; returns the path."""
        path = RunDir(logdir).timeline_of(self.task, self.attempt)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        clock = self.clock.to_dict() if self.clock is not None else None
        tmp.write_text(json.dumps({"task": self.task, "attempt": self.attempt, "os_pid": os.getpid(), "clock": clock,
                                   "threads": {str(k): v for k, v in self.threads.items()}, "events": list(self.events)}))
        tmp.replace(path)
        return path


def start(task: str, attempt: int = 0, *, skew_us: float = 0.0) -> Timeline:
    """Turn the timeline on in this process (before its connections are made); returns the recorder."""
    global ACTIVE
    ACTIVE = Timeline(task, attempt, skew_us=skew_us)
    return ACTIVE


def clock_us() -> float:
    """This process's timeline clock now (wall-clock microseconds; its recorder's when it has one):
    what a server answers a CLOCK request with."""
    tl = ACTIVE
    return tl.now() if tl is not None else time.time() * 1e6


# -- clock offsets (pure) --------------------------------------------------------------------

@dataclass(frozen=True)
class ClockOffset:
    """A clock's offset to the reference: reference time = local time + ``offset_us``, within
    ``error_us`` (half the round trip it was estimated from)."""

    offset_us: float
    rtt_us: float
    samples: int

    @property
    def error_us(self) -> float:
        return self.rtt_us / 2

    def to_dict(self) -> dict[str, float]:
        return {"offset_us": round(self.offset_us, 1), "rtt_us": round(self.rtt_us, 1), "samples": self.samples}


def estimate_offset(samples: Sequence[tuple[float, float, float]]) -> ClockOffset:
    """NTP's estimate from round trips ``(sent, reference, received)``: ``sent`` and ``received`` on
    the local clock around a request the reference answered at ``reference`` on its clock. The
    round trip with the shortest time is the least delayed by queueing, and the reference read its
    clock within it: offset = reference - (sent + received) / 2, off by at most half that round trip
    (exactly right when the two legs took equally long).

    Raises:
        ValueError: no sample, or none with ``received >= sent`` (a clock that went backwards).
    """
    valid = [(r - s, ref, s, r) for s, ref, r in samples if r >= s]
    if not valid:
        raise ValueError(f"No usable round trip to estimate a clock offset from: received {list(samples)!r}; "
                         "each sample is (sent, reference, received) with received >= sent.")
    rtt, ref, sent, received = min(valid)
    return ClockOffset(offset_us=ref - (sent + received) / 2, rtt_us=rtt, samples=len(valid))


def stop() -> None:
    """Turn it off (tests)."""
    global ACTIVE
    ACTIVE = None


# -- shares (pure) ---------------------------------------------------------------------------

def _exclusive(events: Sequence[Mapping[str, Any]], cats: Iterable[str]) -> dict[str, float]:
    """Per category, the spans' time not covered by a span nested in them (same thread): a push
    made during backward counts as push, not backward."""
    wanted = set(cats)
    spans = sorted((e for e in events if e["cat"] in wanted), key=lambda e: (e["tid"], e["ts"], -e["dur"]))
    out = dict.fromkeys(wanted, 0.0)
    open_: list[dict[str, Any]] = []  # the enclosing spans of the current one, outermost first
    for e in spans:
        while open_ and (open_[-1]["tid"] != e["tid"] or open_[-1]["ts"] + open_[-1]["dur"] <= e["ts"]):
            open_.pop()
        out[e["cat"]] += e["dur"]
        if open_:
            out[open_[-1]["cat"]] -= min(e["dur"], open_[-1]["ts"] + open_[-1]["dur"] - e["ts"])
        open_.append(e)
    return out


def step_shares(events: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """A worker's steps: ``steps``, ``step_s`` (their mean), and ``shares``: each phase's part of
    the step time (exclusive of the phases nested in it), and ``other`` (what no phase covers:
    the trainer's own bookkeeping). The shares sum to 1."""
    steps = [e for e in events if e["cat"] == "step"]
    total = sum(e["dur"] for e in steps)
    if not steps or total <= 0:
        return {"steps": 0, "step_s": 0.0, "shares": {}}
    inside = [e for e in events if e["cat"] in STEP_PHASES and any(
        s["tid"] == e["tid"] and s["ts"] <= e["ts"] and e["ts"] + e["dur"] <= s["ts"] + s["dur"] + 1 for s in steps)]
    excl = _exclusive(inside, STEP_PHASES)
    shares = {p: round(excl[p] / total, 4) for p in STEP_PHASES if excl[p] > 0}
    shares["other"] = round(max(0.0, 1.0 - sum(excl.values()) / total), 4)
    return {"steps": len(steps), "step_s": round(total / len(steps) / 1e6, 6), "shares": shares}


def busy_shares(events: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """A ps: ``busy_s`` (the time its threads spent on requests) and each phase's share of it."""
    excl = _exclusive(events, PS_PHASES)
    total = sum(excl.values())
    if total <= 0:
        return {"busy_s": 0.0, "shares": {}}
    return {"busy_s": round(total / 1e6, 6), "shares": {p: round(v / total, 4) for p, v in excl.items() if v > 0}}


# -- the merged trace ------------------------------------------------------------------------

def merge(files: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One Chrome trace of every task's file: a trace process per task attempt (in the given
    order, named ``worker:1`` or ``worker:1 (attempt 2)``), a named trace thread per OS thread,
    every span moved onto the reference clock by its file's ``clock.offset_us`` (see :meth:`Timeline.align`)."""
    events: list[dict[str, Any]] = []
    for pid, f in enumerate(files, start=1):
        name = f["task"] if not f.get("attempt") else f"{f['task']} (attempt {f['attempt']})"
        events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": name}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
        for tid, thread in f.get("threads", {}).items():
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": int(tid), "args": {"name": thread}})
        shift = float((f.get("clock") or {}).get("offset_us", 0.0))
        events.extend({**e, "pid": pid, "ts": round(e["ts"] + shift, 1)} if shift else {**e, "pid": pid}
                      for e in f["events"])
    offsets = {f"{f['task']}.{f.get('attempt', 0)}": f.get("clock") for f in files}
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"tasks": [f["task"] for f in files], "clock_offsets": offsets,
                          "clock": "wall-clock microseconds of the launcher (each task's spans shifted by the offset "
                                   "it measured; a task without one: its own wall clock)"}}


def _task_order(name: str) -> tuple[int, int, int]:
    job, _, rest = name.partition(":")
    index, _, attempt = rest.partition(".")
    rank = {"chief": 0, "worker": 1, "ps": 2, "evaluator": 3}.get(job, 4)
    return rank, int(index) if index.isdigit() else 0, int(attempt) if attempt.isdigit() else 0


def write_trace(logdir: str | os.PathLike[str]) -> Path | None:
    """Merge ``LOGDIR/timeline/*.json`` into ``LOGDIR/timeline.json``; None if no task wrote one.
    Called by the launcher once every task has exited."""
    run = RunDir(logdir)
    paths = sorted(run.timeline.glob("*.json"), key=lambda p: _task_order(task_of_stem(p.stem)))
    files = []
    for p in paths:
        try:
            files.append(json.loads(p.read_text()))
        except (OSError, ValueError):
            continue  # a task killed while writing: its spans are lost, the others' are not
    if not files:
        return None
    out = run.trace
    out.write_text(json.dumps(merge(files)))
    return out


def job_shares(reports: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The summary's ``timeline``: every task's figures, and the workers' step shares averaged
    (weighted by their steps) as ``step``."""
    per_task = {t: r["timeline"] for t, r in reports.items() if isinstance(r.get("timeline"), dict)}
    workers = [v for v in per_task.values() if v.get("steps")]
    steps = sum(v["steps"] for v in workers)
    step: dict[str, float] = {}
    for v in workers:
        for p, s in v["shares"].items():
            step[p] = step.get(p, 0.0) + s * v["steps"] / steps
    return {"step": {p: round(s, 4) for p, s in step.items()}, "tasks": per_task} if per_task else {}
