"""Stack dumps of every task, read back and grouped: "dump all tasks" on the dashboard. Pure.

A ``dump`` control request makes the run's launcher send SIGUSR1 to each running task
(:mod:`psflow.launch.control`); each task writes every thread's stack into its log (psflow.heartbeat), and
the launcher records where (a ``stacks_dumped`` event: the log and the line the dump starts at or
after). Here: :func:`parse_dump` reads that text, in faulthandler's format, from there (``Thread 0x... (most recent
call first):`` then ``  File "...", line N in func`` lines; the main thread, the oldest, comes last),
and :func:`group_stacks` puts tasks whose main threads stand at the same frames in one group, largest
first, and names the **odd one out** of a job: where every other task of the job shares one stack
and one task's stands elsewhere, that task is the likely one the others wait on (a hint read from the
stacks alone, said as such).

Called by :mod:`psflow.platform.api` (``GET /api/runs/{run}/stacks``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
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


def group_stacks(stacks: Mapping[str, Sequence[Mapping[str, Any]]]) -> dict[str, Any]:
    """Tasks grouped by their main thread's frames (``task -> frames``), and the odd ones out per job."""
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
                odd.append({"task": lone, "job": job,
                            "why": f"every other {job} stands in {top}(); {lone}'s main thread is elsewhere: if they "
                                   f"wait, it is likely the one they wait on"})
                break
    return {"groups": out_groups, "odd_ones_out": odd}
