"""The root cause of a failed run: one pure rule over what the run recorded.

Inputs are data only (so the rule can be tested over recorded sequences, and moved into a run
controller later): the tasks' exits in the order the launcher saw them (code, time, whether the
launcher had already begun stopping the run), and the JSON error reports the tasks wrote.

The rule:

1. Every task shows its first sign of failure at a time: its error report's ``time_unix``, or, for a
   task that died without a report (SIGKILL, OOM), the time its non-zero exit was seen. A task the
   launcher stopped after the run had failed shows none by its exit alone.
2. The earliest of those is the first suspect.
3. A suspect whose error blames another task (it lost its connection to ``ps:0``; the ps says
   ``worker:1`` was lost or is missing from a sync step; ``worker:1`` is the slowest ssp clock) points
   at that task, which becomes the suspect, unless it exited cleanly. Repeat until a suspect blames
   nobody. So a survivor that failed *because* a peer was killed or stalled never takes the blame.

What blames whom (:func:`blamed_tasks`): a report's ``blame`` field when it has one (a task name or
a list of them), else the messages psflow itself writes for those cases (a lost or timed-out
connection names the peer; the ps's sync errors name the lost or missing workers; the ssp clock
error lists the clocks).

Called by :class:`psflow.launch.controller.RunController` once every task has exited.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

_TASK = r"(?:chief|ps|worker|evaluator):\d+(?!\d)"
# The ps's sync errors (psflow.ps.store): "worker:1 lost its connection to ps shard 0 ..." and
# "Sync step 7 ... missing worker:1, worker:2. ..."
_LOST_RE = re.compile(rf"((?:{_TASK}(?:, )?)+) lost its connection to ps shard")
_MISSING_RE = re.compile(rf"missing ((?:{_TASK}(?:, )?)+)")
# The ps's ssp error: "worker:0 at clock 12 waited 5.0 s for the slowest worker (clocks {0: 12, 1: 3}, ..."
_CLOCKS_RE = re.compile(r"slowest worker \(clocks \{([^}]*)\}")
# A RemoteError's message starts with the task that replied ("ps:0: ..."): that task relays the
# error, it is not blamed for it.
_RELAY_RE = re.compile(rf"^{_TASK}: ")
# Connection errors (psflow.wire.conn) name the peer: "ps:0 closed the connection", "Lost the
# connection to ps:0", "Timed out waiting for ps:0", "Cannot reach ps:0 at ...".
_CONNECTION_EXCEPTIONS = ("TransportError", "AuthError")


@dataclass(frozen=True)
class TaskExit:
    """One task's exit as the launcher saw it.

    Args:
        task: ``"worker:1"``.
        code: the exit code (negative: the signal that ended it).
        time_unix: when the launcher saw the exit.
        stopped: the launcher had already begun stopping the run (its exit is no sign of failure).
    """

    task: str
    code: int
    time_unix: float
    stopped: bool = False


def root_cause(tasks: Sequence[str], exits: Sequence[TaskExit], reports: Mapping[str, Mapping[str, Any]]) -> str | None:
    """The task that caused the run to fail, or None if no task failed.

    Args:
        tasks: every task of the run, in plan order (the tie-break).
        exits: the tasks' exits in the order they were seen.
        reports: each failed task's error report (``time_unix``, ``exception``, ``message``, optional ``blame``).

    Example:
        >>> root_cause(["ps:0", "worker:0", "worker:1"],
        ...            [TaskExit("worker:0", 1, 10.2), TaskExit("worker:1", -9, 10.3)],
        ...            {"worker:0": {"time_unix": 10.1, "exception": "RemoteError",
        ...                          "message": "ps:0: worker:1 lost its connection to ps shard 0 ..."}})
        'worker:1'
    """
    evidence = _failure_times(exits, reports)
    if not evidence:
        return None
    order = {t: i for i, t in enumerate(tasks)}
    suspect = min(evidence, key=lambda t: (evidence[t], order.get(t, len(order))))
    clean = {e.task for e in exits if e.code == 0}
    seen = {suspect}
    while True:
        blamed = [t for t in blamed_tasks(suspect, reports.get(suspect), tasks) if t not in seen and t not in clean]
        if not blamed:
            return suspect
        # Several blamed (two lost workers): the one that showed its failure first.
        suspect = min(blamed, key=lambda t: (evidence.get(t, math.inf), blamed.index(t)))
        seen.add(suspect)


def _failure_times(exits: Sequence[TaskExit], reports: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
    times: dict[str, float] = {}
    for e in exits:
        if e.code != 0 and not e.stopped:
            times.setdefault(e.task, e.time_unix)
    for task, report in reports.items():
        t = report.get("time_unix") if isinstance(report, Mapping) else None
        if isinstance(t, (int, float)) and not isinstance(t, bool):
            times[task] = min(times.get(task, math.inf), float(t))
    return times


def blamed_tasks(task: str, report: Mapping[str, Any] | None, tasks: Sequence[str]) -> list[str]:
    """The tasks ``task``'s error report says it failed because of (never ``task`` itself)."""
    if not report:
        return []
    known = [t for t in tasks if t != task]
    blame = report.get("blame")
    if blame:
        names = [blame] if isinstance(blame, str) else list(blame)
        return [t for t in names if t in known]
    message = _RELAY_RE.sub("", str(report.get("message", "")), count=1)
    found: list[str] = []
    for pattern in (_LOST_RE, _MISSING_RE):
        for m in pattern.finditer(message):
            found += re.findall(_TASK, m.group(1))
    clocks = _CLOCKS_RE.search(message)
    if clocks:
        found += _slowest(clocks.group(1), task, tasks)
    if not found and report.get("exception") in _CONNECTION_EXCEPTIONS:
        found = re.findall(_TASK, message)
    return [t for t in dict.fromkeys(found) if t in known]


def _slowest(clocks_text: str, task: str, tasks: Sequence[str]) -> list[str]:
    """The ssp replicas holding ``task`` back: those with no clock yet, then the lowest clock.

    The ps keys clocks by replica index: the chief (if the run has one) is replica 0, then the workers.
    """
    replicas = [t for t in tasks if t.startswith("chief:")] + [t for t in tasks if t.startswith("worker:")]
    clocks = {int(k): int(v) for k, v in re.findall(r"(\d+): (-?\d+)", clocks_text)}
    names = {i: t for i, t in enumerate(replicas)}
    absent = [t for i, t in names.items() if i not in clocks and t != task]
    live = sorted((c, i) for i, c in clocks.items() if i in names and names[i] != task)
    return absent + [names[i] for c, i in live if c == live[0][0]] if live else absent
