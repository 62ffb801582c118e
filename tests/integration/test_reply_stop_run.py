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
from pathlib import Path

import pytest
from test_reconnect_stop import SlowRun, wait_for

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
    run = SlowRun(tmp_path, procs)
    os.kill(run.ps_pid, signal.SIGSTOP)
    try:
        unread = wait_for(lambda: request_unread_by(run.ps_pid, run.worker_pid), 60,
                          "the worker sent the frozen ps a request (bytes the ps did not read)", run.context)
        took_s = run.sigterm_worker()
    finally:
        os.kill(run.ps_pid, signal.SIGCONT)
        os.kill(run.forkserver, signal.SIGCONT)
    print(f"the worker ended {took_s:.2f} s after SIGTERM (its request of {unread} bytes unread by the frozen ps)")
    run.assert_stopped(took_s, "waiting for ps:0: nothing came")
