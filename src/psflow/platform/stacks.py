"""Stack dumps of every task, read back and grouped: "dump all tasks" on the dashboard. Pure.

A ``dump`` control request makes the run's launcher send SIGUSR1 to each running task
(:mod:`psflow.launch.control`); each task writes every thread's stack into its log (psflow.heartbeat), and
the launcher records where (a ``stacks_dumped`` event: the log and the line the dump starts at or
after). Here: :func:`parse_dump` reads that text, in faulthandler's format, from there (``Thread 0x... (most recent
call first):`` then ``  File "...", line N in func`` lines; the main thread, the oldest, comes last),
and :func:`group_stacks` puts tasks whose main threads stand at the same frames in one group, largest
first, and names the **odd one out** of a job: where every other task of the job shares one stack
and one task's stands elsewhere. That task is called the likely one the others wait on only when it
was not making progress at the dump (:func:`making_progress`: its step stood still around then): a
healthy async chief, whose main thread is in a checkpoint or a summary while every other worker
pushes, is odd but moving, and is said to be so, never blamed. Where its progress is unknown (it never
reported any), the hint is said as a guess from the stacks alone.

Called by :mod:`psflow.platform.api` (``GET /api/runs/{run}/stacks``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

_HEADER = re.compile(r"^(Current thread|Thread) (0x[0-9a-fA-F]+) \(most recent call first\):\s*$")
_FRAME = re.compile(r'^  File "(.*)", line (\d+|\?\?\?) in (.*)$')  # ???: a frame faulthandler caught in flux


def parse_dump(lines: Sequence[str]) -> list[dict[str, Any]]:
    """The threads of the first faulthandler dump in ``lines``: ``{"thread", "current", "frames"}``,
    frames innermost first (``{"file", "line", "function"}``), in faulthandler's order (main thread last)."""
    threads: list[dict[str, Any]] = []
    started = False
    for raw in lines:
        line = raw.rstrip("\n")
        header = _HEADER.match(line)
        if header:
            started = True
            threads.append({"thread": header.group(2), "current": header.group(1) == "Current thread", "frames": []})
            continue
        if not started:
            continue
        frame = _FRAME.match(line)
        if frame and threads:
            line_no = int(frame.group(2)) if frame.group(2).isdigit() else 0
            threads[-1]["frames"].append({"file": frame.group(1), "line": line_no, "function": frame.group(3)})
        elif line.strip() in ("", "<no Python frame>") or line.startswith("  ..."):
            continue
        else:
            break  # the task's own output again: the dump ended
    return threads


def main_stack(threads: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The main thread's frames (faulthandler lists it last: the oldest thread)."""
    return list(threads[-1]["frames"]) if threads else []


# What moves while a task makes progress: a trainer's own step, a ps's version and pushes.
PROGRESS_NAMES = ("local_step", "global_step", "pushes")


def making_progress(points: Iterable[Mapping[str, Any]], at: Mapping[str, float], *, reported: Iterable[str] = (),
                    before_s: float = 15.0, after_s: float = 5.0) -> dict[str, bool]:
    """Whether each task was making progress at its dump: one of its :data:`PROGRESS_NAMES` series rose
    between ``before_s`` before the dump and ``after_s`` after it.

    Args:
        points: the job store's metric rows (``task``, ``name``, ``time_unix``, ``value``).
        at: task -> when its stacks were dumped.
        reported: tasks known to have reported progress at some time (``points`` may hold only
            the last minutes): one with no point near its dump went quiet, it did not move.

    Returns:
        task -> True (it moved) or False (it reported, and stood still or went quiet there); a task
        that never reported progress is left out (unknown).

    Example:
        >>> making_progress([{"task": "worker:0", "name": "local_step", "time_unix": t, "value": t} for t in (1, 2)],
        ...                 {"worker:0": 3.0, "worker:1": 3.0})
        {'worker:0': True}
    """
    seen: dict[str, bool] = {t: False for t in reported if t in at}
    near: dict[tuple[str, str], list[float]] = {}
    for p in points:
        task, when = str(p["task"]), p["time_unix"]
        if p["name"] not in PROGRESS_NAMES or task not in at or p["value"] is None:
            continue
        seen.setdefault(task, False)
        if at[task] - before_s <= when <= at[task] + after_s:
            near.setdefault((task, str(p["name"])), []).append(float(p["value"]))
    for (task, _), values in near.items():
        if any(b > a for a, b in zip(values, values[1:])):  # a restart's step goes back, then moves again
            seen[task] = True
    return seen


def group_stacks(stacks: Mapping[str, Sequence[Mapping[str, Any]]],
                 progress: Mapping[str, bool] | None = None) -> dict[str, Any]:
    """Tasks grouped by their main thread's frames (``task -> frames``), and the odd ones out per job.

    ``progress``: task -> whether it was making progress at the dump (:func:`making_progress`). An
    odd one out is ``blamed`` (likely the one the others wait on) only when it was not; one that was
    moving is named as odd, and said to be making progress; unknown: a hedged hint.
    """
    progress = progress or {}
    groups: dict[tuple[tuple[str, int, str], ...], list[str]] = {}
    for task, frames in stacks.items():
        key = tuple((str(f["file"]), int(f["line"]), str(f["function"])) for f in frames)
        groups.setdefault(key, []).append(task)
    ordered = sorted(groups.items(), key=lambda kv: (-len(kv[1]), sorted(kv[1])))
    out_groups = [{"tasks": sorted(tasks), "frames": [{"file": f, "line": n, "function": fn} for f, n, fn in key]}
                  for key, tasks in ordered]
    odd = []
    jobs: dict[str, list[str]] = {}
    for task in stacks:
        jobs.setdefault(task.split(":")[0], []).append(task)
    for job, tasks in jobs.items():
        if len(tasks) < 3:
            continue  # two tasks apart: neither is the odd one
        for group in out_groups:
            inside = [t for t in group["tasks"] if t.split(":")[0] == job]
            if len(inside) == len(tasks) - 1:
                (lone,) = set(tasks) - set(inside)
                top = (group["frames"] or [{}])[0].get("function", "?")
                odd.append(_odd_one(lone, job, top, progress.get(lone)))
                break
    return {"groups": out_groups, "odd_ones_out": odd}


def _odd_one(task: str, job: str, top: str, moving: bool | None) -> dict[str, Any]:
    """The odd one out of ``job``, blamed only when it was not making progress."""
    where = f"every other {job} stands in {top}(); {task}'s main thread is elsewhere"
    if moving:
        why = f"{where}, but it was making progress at the dump (its step moved): not what they wait on"
    elif moving is False:
        why = f"{where}, and it made no progress at the dump: likely the one they wait on"
    else:
        why = f"{where} (its progress is unknown): if they wait, it may be the one they wait on"
    return {"task": task, "job": job, "blamed": moving is False, "making_progress": moving, "why": why}
