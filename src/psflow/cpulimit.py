"""The CPU limit of this process's container: the cgroup's CFS quota (Kubernetes' ``limits.cpu``).

A container limited to 2 CPUs on a 64-core node still sees 64 cores in its CPU affinity: the limit
is a quota of CPU time per period, enforced by throttling. Torch threads sized from the affinity then
run 64 threads in 2 CPUs' time, and every one of them stalls at each period's end. So a task's cores
are the smaller of its affinity and this limit (:func:`psflow.threads.host_cores`).

Where the limit lives:

- cgroup v2: ``cpu.max`` (``"200000 100000"``: 2 CPUs; ``"max 100000"``: none) in the process's
  cgroup and in each ancestor up to the mount (a parent's limit binds its children too);
- cgroup v1: ``cpu.cfs_quota_us`` (``-1``: none) over ``cpu.cfs_period_us``, in the ``cpu``
  controller's hierarchy, likewise.

The process's cgroup is read from ``/proc/self/cgroup``, the hierarchies' mount points from
``/proc/self/mountinfo`` (``/sys/fs/cgroup`` on a v2 host, ``/sys/fs/cgroup/unified`` and
``/sys/fs/cgroup/cpu,cpuacct`` on a hybrid one). In a container the cgroup's path may be the host's
(``/kubepods/...``) while the mount shows the container's own cgroup at its root: then the mount's
root is the cgroup. The smallest limit found wins.

Everything is pure (:func:`parse_cpu_max`, :func:`parse_cfs_quota`, :func:`cgroup_cpu_limit` take
the files' text or a reader) except :func:`container_cpus`, which reads ``/proc`` and ``/sys``.
Called by :mod:`psflow.threads`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path


def parse_cpu_max(text: str) -> float | None:
    """CPUs allowed by a cgroup v2 ``cpu.max``: quota / period; None for ``max`` or unreadable text.

    Example:
        >>> parse_cpu_max("150000 100000")
        1.5
    """
    fields = text.split()
    if not fields or fields[0] == "max":
        return None
    period = fields[1] if len(fields) > 1 else "100000"  # the kernel's default period
    return _ratio(fields[0], period)


def parse_cfs_quota(quota: str, period: str) -> float | None:
    """CPUs allowed by cgroup v1's ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``; None for ``-1`` (no limit).

    Example:
        >>> parse_cfs_quota("200000", "100000")
        2.0
    """
    return _ratio(quota.strip(), period.strip())


def _ratio(quota: str, period: str) -> float | None:
    if not (quota.isdigit() and period.isdigit()) or int(quota) <= 0 or int(period) <= 0:
        return None  # "-1" (v1's none), or text this module does not know: no limit rather than a wrong one
    return int(quota) / int(period)


def _mounts(mountinfo: str) -> list[tuple[str, str, str, set[str]]]:
    """(fstype, root, mount point, super options) of every cgroup mount in ``/proc/self/mountinfo``."""
    found = []
    for line in mountinfo.splitlines():
        pre, sep, post = line.partition(" - ")
        fields, tail = pre.split(), post.split()
        if sep and len(fields) >= 5 and len(tail) >= 3 and tail[0] in ("cgroup", "cgroup2"):
            found.append((tail[0], _unescape(fields[3]), _unescape(fields[4]), set(tail[2].split(","))))
    return found


def _unescape(field: str) -> str:
    """mountinfo writes a space as ``\\040`` (and tab, newline, backslash likewise, in octal)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), field)


def _dirs(mount_point: str, root: str, path: str) -> list[str]:
    """The directories of cgroup ``path`` and of its ancestors, inside a mount of ``root`` at ``mount_point``."""
    root = root.rstrip("/")
    rel = path[len(root):] if path == root or path.startswith(root + "/") else ""  # a container's own mount: its root
    parts = [p for p in rel.split("/") if p]
    return [str(Path(mount_point, *parts[:k])) for k in range(len(parts), -1, -1)]


def cgroup_cpu_limit(cgroup: str, mountinfo: str, read: Callable[[str], str | None]) -> float | None:
    """The CPUs this process's cgroups allow (the smallest quota of its cgroup and their ancestors), or None.

    Args:
        cgroup: the text of ``/proc/self/cgroup`` (``0::/path`` for v2, ``N:cpu,cpuacct:/path`` for v1).
        mountinfo: the text of ``/proc/self/mountinfo``.
        read: a file's text by path, None where it cannot be read.

    Example:
        >>> files = {"/sys/fs/cgroup/cpu.max": "250000 100000"}
        >>> cgroup_cpu_limit("0::/", "30 1 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw", files.get)
        2.5
    """
    paths: dict[str, str] = {}  # "v2" or "v1" -> the process's cgroup path there
    for line in cgroup.splitlines():
        hid, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hid == "0" and controllers == "":
            paths["cgroup2"] = path
        elif "cpu" in controllers.split(","):
            paths["cgroup"] = path
    limits = []
    for fstype, root, mount_point, options in _mounts(mountinfo):
        if fstype not in paths or (fstype == "cgroup" and "cpu" not in options):
            continue
        for d in _dirs(mount_point, root, paths[fstype]):
            if fstype == "cgroup2":
                limit = parse_cpu_max(read(f"{d}/cpu.max") or "")
            else:
                limit = parse_cfs_quota(read(f"{d}/cpu.cfs_quota_us") or "", read(f"{d}/cpu.cfs_period_us") or "")
            if limit is not None:
                limits.append(limit)
    return min(limits, default=None)


def cpus_from_limit(limit: float) -> int:
    """Whole CPUs for threads under a quota of ``limit`` CPUs: rounded down (a thread more would be
    throttled), at least one.

    Example:
        >>> cpus_from_limit(2.5), cpus_from_limit(0.5)
        (2, 1)
    """
    return max(1, math.floor(limit + 1e-9))


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


def container_cpus() -> int | None:
    """The whole CPUs this process's cgroup CPU limit allows (:func:`cpus_from_limit`), None where it has none
    (or the files are not there: not Linux)."""
    cgroup, mountinfo = _read("/proc/self/cgroup"), _read("/proc/self/mountinfo")
    if cgroup is None or mountinfo is None:
        return None
    limit = cgroup_cpu_limit(cgroup, mountinfo, _read)
    return None if limit is None else cpus_from_limit(limit)
