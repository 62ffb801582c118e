"""A worker waiting for the reply of a frozen ps honours SIGTERM (issue 23 item 6).

A real ``psflow run`` (one ps, one worker: worker:0, the chief) trains the MNIST softmax slowly; its
requests wait up to PsClient's request_timeout_s (120 s) plus 15 s of margin. The test pauses the
launcher's fork server (SIGSTOP: the launcher learns of no exit, so it neither restarts nor stops
anything itself) and then the ps: its connection stays open, and nothing comes back. It waits until
the worker is blocked in a request, seen in the kernel's socket tables (the ps's end of the worker's
connection holds bytes it never read: the request), then sends the worker SIGTERM, as the launcher's
stop would. What is proven: the worker ends within 5 s, not at the request timeout, says why
(stopped while a ps was unreachable: nothing came from ps:0 within the stop's grace; no final
checkpoint), and exits with SIGTERM's status, 143.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import PSFLOW, ROOT, SOFTMAX, log_tails, pid_alive, read_summary, task_env
from test_reconnect_stop import GRACE_S, log_of, parent_of, task_state, wait_for

pytestmark = pytest.mark.timeout(300)


def socket_inodes(pid: int) -> set[str]:
    out = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            out.add(target[8:-1])
    return out


def tcp_sockets() -> dict[str, tuple[str, str, int]]:
    """inode -> (local address, remote address, bytes received and not read yet), IPv4 and IPv6."""
    out = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            out[f[9]] = (f[1], f[2], int(f[4].split(":")[1], 16))
    return out


def request_unread_by(ps_pid: int, worker_pid: int) -> int:
    """Bytes the worker sent the ps that the ps has not read (0: none, or no such connection)."""
    table = tcp_sockets()
    worker_ends = {table[i][0] for i in socket_inodes(worker_pid) if i in table}
    return sum(table[i][2] for i in socket_inodes(ps_pid) if i in table and table[i][1] in worker_ends)


def test_a_worker_waiting_for_a_frozen_ps_ends_within_the_grace_on_sigterm(tmp_path: Path, procs) -> None:  # noqa: ANN001
    logdir = tmp_path / "run"
    env = task_env()
    launcher = subprocess.Popen(
        [PSFLOW, "run", "--ps", "1", "--workers", "1", "--slow", "worker:0=0.02s", "--logdir", str(logdir), SOFTMAX,
         "--", "--epochs", "5", "--init", "zeros"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT, start_new_session=True)
    procs.append(launcher)

    def context() -> str:
        return f"{log_tails(logdir, 30)}\nstatus: {task_state(logdir)}"

    def training() -> dict | None:
        tasks = task_state(logdir)
        worker, ps = tasks.get("worker:0", {}), tasks.get("ps:0", {})
        steps = (worker.get("progress") or {}).get("global_step") or 0
        return tasks if steps > 20 and worker.get("pid") and ps.get("pid") else None

    tasks = wait_for(training, 180, "the worker trained 20 steps", context)
    ps_pid, worker_pid = tasks["ps:0"]["pid"], tasks["worker:0"]["pid"]
    forkserver = parent_of(ps_pid)
    assert forkserver not in (launcher.pid, 1) and parent_of(worker_pid) == forkserver, "the tasks are not forked"
    os.kill(forkserver, signal.SIGSTOP)
    os.kill(ps_pid, signal.SIGSTOP)
    try:
        unread = wait_for(lambda: request_unread_by(ps_pid, worker_pid), 60,
                          "the worker sent the frozen ps a request (bytes the ps did not read)", context)
        assert pid_alive(worker_pid), context()
        asked = time.monotonic()
        os.kill(worker_pid, signal.SIGTERM)
        wait_for(lambda: not pid_alive(worker_pid), 90, "the worker exited", context)  # a zombie: its parent is stopped
        took_s = time.monotonic() - asked
    finally:
        os.kill(ps_pid, signal.SIGCONT)
        os.kill(forkserver, signal.SIGCONT)
    out = launcher.communicate(timeout=120)[0]
    log = log_of(logdir, "worker:0")
    print(f"the worker ended {took_s:.2f} s after SIGTERM (its request of {unread} bytes unread by the frozen ps)")
    assert took_s < GRACE_S, f"the worker took {took_s:.1f} s to end after SIGTERM\n{context()}"
    assert "stopped by SIGTERM while a ps was unreachable (Stopped (SIGTERM) while waiting for ps:0: nothing came" in log, \
        log[-3000:]
    assert "no final one: the values live on the ps" in log and "exiting with status 143" in log, log[-3000:]
    summary = read_summary(logdir)
    worker = next(t for t in summary["tasks"] if t["task"] == "worker:0")
    assert worker["exit_code"] == 143, (worker, out[-3000:])
    assert not any(pid_alive(t["pid"]) for t in summary["tasks"] if t.get("pid")), summary["tasks"]
