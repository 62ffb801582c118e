"""Which processes belong to a task of a local run, and ending all of them.

A task is stopped by signalling its process group, which misses a descendant that started its own
session (``setsid``, ``start_new_session=True``: a data server, a daemonized helper): it would
outlive the run. So the launcher tags every task it starts with ``PSFLOW_PROCESS_TAG``
(``<launcher pid>/<run id>/<task>/<attempt>``), which every process the task executes inherits
whatever its session, and, when it stops the task or the run, ends the processes whose initial
environment (``/proc/PID/environ``) carries the tag, and the descendants still linked to them
(``/proc/PID/task/*/children``: a child forked without an exec carries its parent's tag only in
memory). The approach of Jenkins' process tree killer; cgroups would catch a process that cleared its
environment too, but need a delegated hierarchy that containers rarely give.

Invariants: only processes of this user are read (others' environments are not readable); the
launcher's own process and its ancestors are never signalled. Linux only: elsewhere nothing is found.

Called by :class:`psflow.launch.local.LocalBackend`; this module is the one place that names the variable.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterable, Iterator, MutableMapping
from pathlib import Path

TAG = "PSFLOW_PROCESS_TAG"  # set by the launcher on each task it starts; read by nobody but this module
_PROC = Path("/proc")


def tag(run_id: str, task: str = "", attempt: int | None = None) -> str:
    """The tag of ``task``'s ``attempt`` of run ``run_id`` started by this launcher; with fewer parts,
    the prefix every tag of that task (or of the whole run) starts with.

    Example:
        >>> tag("r1", "worker:1", 0).split("/", 1)[1]
        'r1/worker:1/0'
    """
    parts = [str(os.getpid()), run_id] + ([task] if task else []) + ([str(attempt)] if attempt is not None else [])
    return "/".join(parts) + ("" if attempt is not None else "/")


def mark(env: MutableMapping[str, str], value: str) -> None:
    """Tag the environment a task starts with."""
    env[TAG] = value


def tagged(prefix: str, *, roots: Iterable[int] = (), proc: Path = _PROC) -> list[int]:
    """The pids of this user's processes whose initial environment holds a tag starting with ``prefix``,
    and the descendants of those and of ``roots`` (the tasks' own pids: a task forked by the fork
    server carries its tag in memory only); never this process or its ancestors."""
    needle = f"{TAG}={prefix}".encode()
    found: set[int] = set()
    for pid in _pids(proc):
        try:
            environ = (proc / str(pid) / "environ").read_bytes()
        except OSError:  # gone, or another user's
            continue
        if any(entry.startswith(needle) for entry in environ.split(b"\0")):
            found.add(pid)
    for pid in found | set(roots):
        found = found | _descendants(pid, proc)
    return sorted(found - _ancestors(os.getpid(), proc))


def kill(pids: Iterable[int]) -> list[int]:
    """SIGKILL each of ``pids`` still there (never this process); returns the pids signalled."""
    killed = []
    for pid in sorted(set(pids) - {os.getpid()}):
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except (ProcessLookupError, PermissionError):
            pass
    return killed


def _pids(proc: Path) -> Iterator[int]:
    try:
        names = os.listdir(proc)
    except OSError:
        return
    for name in names:
        if name.isdigit():
            yield int(name)


def _descendants(pid: int, proc: Path) -> set[int]:
    out: set[int] = set()
    stack = [pid]
    while stack:
        for child in _children(stack.pop(), proc):
            if child not in out:
                out.add(child)
                stack.append(child)
    return out


def _children(pid: int, proc: Path) -> list[int]:
    out: list[int] = []
    try:
        threads = os.listdir(proc / str(pid) / "task")
    except OSError:
        return out
    for tid in threads:
        try:
            out += [int(c) for c in (proc / str(pid) / "task" / tid / "children").read_text().split()]
        except (OSError, ValueError):
            continue
    return out


def _ancestors(pid: int, proc: Path) -> set[int]:
    out = {pid}
    while pid > 1:
        try:
            stat = (proc / str(pid) / "stat").read_text()
            pid = int(stat.rsplit(")", 1)[1].split()[1])  # the field after the state: the parent pid
        except (OSError, ValueError, IndexError):
            break
        out.add(pid)
    return out
