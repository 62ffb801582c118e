"""Is the process a status file names still the one that wrote it? Live run or abandoned run.

A pid alone does not say: after a launcher dies its pid can be reused, and after a reboot every pid
is someone else's. A process is named by its *identity*: pid, start time (clock ticks since boot,
``/proc/<pid>/stat`` field 22), the machine's boot id and host name. The identity matches only while
that very process lives.

:func:`assess` is pure (the check of a process is passed in): it turns a ``status.json`` whose
launcher is gone from ``running`` into ``abandoned``, with a note naming the launcher and the tasks
whose processes are gone. Called by ``psflow status`` and ``psflow summary``; the launcher records
identities through :mod:`psflow.launch.status`.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Where liveness cannot be checked (another host, no /proc): a launcher whose heartbeat is older
# than this is taken for gone. The launcher writes status.json at least every few seconds.
STALE_HEARTBEAT_S = 60.0


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def _start_ticks(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces: count from its end.
    fields = stat[stat.rindex(")") + 2:].split()
    if fields[0] == "Z":  # a zombie has exited
        return None
    return int(fields[19])


def process_identity(pid: int) -> dict[str, Any]:
    """The identity of the live process ``pid`` on this machine (start ticks None where unknown)."""
    return {"pid": pid, "start_ticks": _start_ticks(pid), "boot_id": _boot_id(), "host": socket.gethostname()}


def is_alive(identity: dict[str, Any] | None) -> bool | None:
    """True while the process of ``identity`` lives; False once it is gone; None where this machine
    cannot tell (the process ran on another host)."""
    if not identity or not isinstance(identity.get("pid"), int):
        return None
    if identity.get("host") not in (None, socket.gethostname()):
        return None
    if identity.get("boot_id") and identity["boot_id"] != _boot_id():
        return False  # rebooted since
    try:
        os.kill(identity["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    ticks = _start_ticks(identity["pid"])
    if ticks is None:  # a zombie, or no /proc to ask (then kill(pid, 0) is all there is)
        return not Path("/proc").is_dir()
    return identity.get("start_ticks") in (None, ticks)


def assess(state: dict[str, Any], *, now_unix: float,
           alive: Callable[[dict[str, Any] | None], bool | None] = is_alive) -> dict[str, Any]:
    """``state`` (a status.json) as it stands now: a ``running`` run whose launcher is gone becomes
    ``abandoned`` with a ``note``; every task gets ``alive`` (True, False, or None: cannot tell).

    Example:
        >>> assess(read_status("runs/x"), now_unix=time.time())["state"]
        'abandoned'
    """
    out = {**state, "tasks": {name: dict(t) for name, t in (state.get("tasks") or {}).items()}}
    for t in out["tasks"].values():
        if t.get("exit_code") is None and isinstance(t.get("pid"), int):
            t["alive"] = alive(t.get("identity") or {**(state.get("launcher") or {}), "pid": t["pid"], "start_ticks": None})
    if out.get("state") != "running":
        return out
    launcher = state.get("launcher") or {}
    verdict = alive(launcher) if launcher else None
    heartbeat = state.get("heartbeat_unix", state.get("updated_unix"))
    if verdict is None and isinstance(heartbeat, (int, float)) and now_unix - heartbeat > STALE_HEARTBEAT_S:
        verdict = False
    if verdict is False:
        gone = [f"{n} (pid {t['pid']})" for n, t in out["tasks"].items() if t.get("alive") is False]
        live = [f"{n} (pid {t['pid']})" for n, t in out["tasks"].items() if t.get("alive")]
        note = f"abandoned: launcher pid {launcher.get('pid', '?')} is gone"
        note += f"; tasks gone: {', '.join(gone)}" if gone else ""
        note += f"; tasks still running (stop them: kill PID): {', '.join(live)}" if live else ""
        out["state"], out["note"] = "abandoned", note + "."
    return out
