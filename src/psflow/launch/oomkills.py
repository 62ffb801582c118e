"""Evidence of out-of-memory kills for local tasks: the kernel's OOM-kill counter of the launcher's
memory cgroup (the tasks run in it too).

A task killed by SIGKILL may have been OOM-killed or killed by someone (a user, ``--fail-at ...:kill``,
a preemption). Linux counts the OOM kills in each memory cgroup: cgroup v2 in ``memory.events``, v1
in ``memory.oom_control`` (``oom_kill N``). :class:`OomKills` reads that counter when the run starts and
at each SIGKILL exit: an increase not yet claimed by an earlier exit is the evidence, and the exit's
cause reads ``killed (SIGKILL; out of memory?)``. Where the counter cannot be read (not Linux, no
permission), there is no evidence and nothing is claimed: the cause stays ``killed (SIGKILL)``.

Used by :class:`psflow.launch.local.LocalBackend`. Thread-safe (exits are seen by one thread each).
"""

from __future__ import annotations

import re
import threading
from pathlib import Path

_COUNTER_RE = re.compile(r"^oom_kill (\d+)$", re.MULTILINE)


def counter_file(proc_cgroup: str, root: Path = Path("/sys/fs/cgroup")) -> Path | None:
    """Where the OOM-kill counter of the cgroup in ``proc_cgroup`` (``/proc/self/cgroup``'s text) lies:
    the v1 memory controller's ``memory.oom_control`` if there is one, else v2's ``memory.events``."""
    v2 = None
    for line in proc_cgroup.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        rel = path.lstrip("/")
        if "memory" in controllers.split(","):
            return root / "memory" / rel / "memory.oom_control"
        if hierarchy == "0" and controllers == "":
            v2 = root / rel / "memory.events"
    return v2


def read_count(path: Path | None) -> int | None:
    """The ``oom_kill`` count in ``path``, or None where it cannot be read."""
    if path is None:
        return None
    try:
        m = _COUNTER_RE.search(path.read_text())
    except OSError:
        return None
    return int(m.group(1)) if m else None


class OomKills:
    """The OOM kills in this process's memory cgroup since the run started, claimed one per exit."""

    def __init__(self, path: Path | None = None) -> None:
        if path is None:
            try:
                path = counter_file(Path("/proc/self/cgroup").read_text())
            except OSError:
                path = None
        self.path = path
        self._lock = threading.Lock()
        self._base = read_count(path)
        self._claimed = 0

    def claim(self) -> bool:
        """For a task just seen killed by SIGKILL: True if an OOM kill happened since the run started
        that no earlier exit claimed (it is then this exit's)."""
        with self._lock:
            now = read_count(self.path)
            if self._base is None or now is None or now - self._base <= self._claimed:
                return False
            self._claimed += 1
            return True
