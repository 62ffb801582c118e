"""A training task that is reconnecting to a ps that is down honours SIGTERM (issue 23 item 6).

A real ``psflow run`` (one ps, one worker: worker:0, the chief) trains the MNIST softmax slowly. The
test pauses the launcher's fork server (SIGSTOP: the launcher's coordinator still answers, but the
launcher learns of no exit, so it neither restarts the job nor stops the worker itself), SIGKILLs the
ps, and waits until the chief's log says it is reconnecting (it retries for ``connect_timeout_s``,
60 s by default, well past a launcher's grace). Then it sends the chief SIGTERM, as the launcher's
stop would. What is proven: the chief ends within 5 s, says why and that no final checkpoint could
be written (the values live on the ps), and exits with SIGTERM's status, 143, which the launcher
records as its exit once the fork server goes on.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import PSFLOW, ROOT, SOFTMAX, log_tails, pid_alive, read_summary, task_env

pytestmark = pytest.mark.timeout(300)

GRACE_S = 5.0


def wait_for(pred, timeout_s: float, what: str, context=lambda: "") -> object:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.05)  # polling a file or a process, not a synchronisation
    raise AssertionError(f"{what} within {timeout_s} s\n{context()}")


def task_state(logdir: Path) -> dict:
    try:
        return json.loads((logdir / "status.json").read_text()).get("tasks", {})
    except (OSError, ValueError):
        return {}


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def log_of(logdir: Path, task: str) -> str:
    logs = sorted((logdir / "logs").glob(f"{task.replace(':', '-')}*.log"))
    return "".join(p.read_text(errors="replace") for p in logs)


class SlowRun:
    """The slow softmax run both stop tests start: one ps and worker:0, trained 20 steps, then the
    launcher's fork server paused (so that the launcher restarts nothing and stops nothing itself)."""

    def __init__(self, tmp_path: Path, procs: list) -> None:
        self.logdir = tmp_path / "run"
        self.launcher = subprocess.Popen(
            [PSFLOW, "run", "--ps", "1", "--workers", "1", "--slow", "worker:0=0.02s", "--logdir", str(self.logdir),
             SOFTMAX, "--", "--epochs", "5", "--init", "zeros"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=task_env(), cwd=ROOT, start_new_session=True)
        procs.append(self.launcher)
        tasks = wait_for(self.training, 180, "the worker trained 20 steps", self.context)
        self.ps_pid, self.worker_pid = tasks["ps:0"]["pid"], tasks["worker:0"]["pid"]
        self.forkserver = parent_of(self.ps_pid)
        assert self.forkserver not in (self.launcher.pid, 1) and parent_of(self.worker_pid) == self.forkserver, \
            "the tasks are not forked"
        os.kill(self.forkserver, signal.SIGSTOP)

    def context(self) -> str:
        return f"{log_tails(self.logdir, 30)}\nstatus: {task_state(self.logdir)}"

    def training(self) -> dict | None:
        tasks = task_state(self.logdir)
        worker, ps = tasks.get("worker:0", {}), tasks.get("ps:0", {})
        steps = (worker.get("progress") or {}).get("global_step") or 0
        return tasks if steps > 20 and worker.get("pid") and ps.get("pid") else None

    def sigterm_worker(self) -> float:
        """SIGTERM worker:0; the seconds until it exited (a zombie: its parent, the fork server, is stopped)."""
        assert pid_alive(self.worker_pid), self.context()
        asked = time.monotonic()
        os.kill(self.worker_pid, signal.SIGTERM)
        wait_for(lambda: not pid_alive(self.worker_pid), 90, "the worker exited", self.context)
        return time.monotonic() - asked

    def assert_stopped(self, took_s: float, why: str) -> None:
        """The worker ended within the grace, said ``why`` and that no final checkpoint could be
        written, and the launcher recorded its exit as 143, with no task left alive."""
        out = self.launcher.communicate(timeout=120)[0]
        log = log_of(self.logdir, "worker:0")
        assert took_s < GRACE_S, f"the worker took {took_s:.1f} s to end after SIGTERM\n{self.context()}"
        assert f"stopped by SIGTERM while a ps was unreachable (Stopped (SIGTERM) while {why}" in log, log[-3000:]
        assert "no final one: the values live on the ps" in log and "exiting with status 143" in log, log[-3000:]
        summary = read_summary(self.logdir)
        worker = next(t for t in summary["tasks"] if t["task"] == "worker:0")
        assert worker["exit_code"] == 143, (worker, out[-3000:])
        assert not any(pid_alive(t["pid"]) for t in summary["tasks"] if t.get("pid")), summary["tasks"]


def test_a_chief_reconnecting_to_a_dead_ps_ends_within_the_grace_on_sigterm(tmp_path: Path, procs) -> None:  # noqa: ANN001
    run = SlowRun(tmp_path, procs)
    try:
        os.kill(run.ps_pid, signal.SIGKILL)
        wait_for(lambda: "reconnecting to ps:0" in log_of(run.logdir, "worker:0"), 60,
                 "the worker said it is reconnecting to ps:0", run.context)
        took_s = run.sigterm_worker()
    finally:
        os.kill(run.forkserver, signal.SIGCONT)
    print(f"the worker ended {took_s:.2f} s after SIGTERM")
    run.assert_stopped(took_s, "reconnecting to ps:0")
