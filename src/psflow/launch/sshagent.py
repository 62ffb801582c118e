"""The ssh backend's remote half: ``python -m psflow.launch.sshagent``, started by ssh on a task's host.

:class:`psflow.launch.ssh.SshBackend` starts one agent per task attempt and talks to it over the ssh
session's stdin and stdout. The protocol, one line each:

- launcher -> agent, first: the task as JSON ``{"argv": [...], "env": {...}, "cwd": "...", "secret": "..."}``.
  The job secret travels here, inside the encrypted session, and reaches the task as ``PSFLOW_SECRET``
  in its environment (``/proc/PID/environ`` is readable by its owner only): never on a command line
  (``ps`` shows those to every user) nor in a file.
- launcher -> agent, later: ``TERM``, ``KILL`` or ``USR1``: that signal to the task's process group
  (``USR1`` to the task alone: its stack dumper (psflow.heartbeat) writes every thread's stack into its output).
- agent -> launcher: the task's output (stdout and stderr, as they come), then, once it exited,
  ``<RS>psflow-agent report {json}`` (its error report, if it wrote one) and ``<RS>psflow-agent exit N``
  (negative: killed by signal -N), RS being the ASCII record separator. ssh's own exit status cannot
  tell a signal from an exit code, hence the last line.

If the session ends (the launcher died, the network went), stdin reaches its end: the agent sends
the task SIGTERM, and SIGKILL after ``_ORPHAN_GRACE_S``, so nothing outlives its launcher.

Light: the standard library only (it runs before anything of the task is imported).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from typing import Any

MARK = "\x1epsflow-agent "
_SIGNALS = {"TERM": signal.SIGTERM, "KILL": signal.SIGKILL, "USR1": signal.SIGUSR1}
_ORPHAN_GRACE_S = 5.0


def task_env(base: dict[str, str], env: dict[str, str], secret: str, error_file: str) -> dict[str, str]:
    """The task's environment on this host: the host's, the launcher's variables for it, the secret
    (replacing the launcher's secret file, which is not on this host) and a private error file."""
    out = {**base, **env, "PSFLOW_SECRET": secret, "PSFLOW_ERROR_FILE": error_file}
    out.pop("PSFLOW_SECRET_FILE", None)
    return out


def _signal(p: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if sig == signal.SIGUSR1:
            os.kill(p.pid, sig)  # the task alone: a child without psflow's handler would die of it
            os.kill(p.pid, signal.SIGCONT)  # a frozen task runs its handler only once resumed
        else:
            os.killpg(p.pid, sig)


def _commands(p: subprocess.Popen[bytes]) -> None:
    """Carry out the launcher's commands until the session ends; then end the task."""
    for line in sys.stdin:
        sig = _SIGNALS.get(line.strip())
        if sig is not None:
            _signal(p, sig)
    if p.poll() is None:  # the launcher is gone
        _signal(p, signal.SIGTERM)
        try:
            p.wait(timeout=_ORPHAN_GRACE_S)
        except subprocess.TimeoutExpired:
            _signal(p, signal.SIGKILL)


def main() -> int:
    header: dict[str, Any] = json.loads(sys.stdin.readline() or "{}")
    private = tempfile.mkdtemp(prefix="psflow-agent-")  # 0700: the error report is the task's own
    error_file = os.path.join(private, "error.json")
    try:
        env = task_env(dict(os.environ), header["env"], header["secret"], error_file)
        try:
            p = subprocess.Popen(header["argv"], cwd=header.get("cwd") or None, env=env, stdin=subprocess.DEVNULL,
                                 stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as e:
            print(f"psflow-agent: cannot start {header['argv'][0]!r} in {header.get('cwd')!r}: {e}", flush=True)
            print(f"{MARK}exit 127", flush=True)
            return 127
        threading.Thread(target=_commands, args=(p,), daemon=True).start()
        code = p.wait()
        with contextlib.suppress(OSError, ValueError):
            with open(error_file) as f:
                report = json.load(f)
            print(f"{MARK}report {json.dumps(report)}", flush=True)
        print(f"{MARK}exit {code}", flush=True)
        return code if code >= 0 else 128 - code
    finally:
        shutil.rmtree(private, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
