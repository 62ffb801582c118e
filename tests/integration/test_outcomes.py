"""Every outcome recorded (issue 23 item 2): a run stopped twice over, or started while the job store
is locked, still ends with its summary and its row in the store."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import PSFLOW, ROOT, log_tails, pid_alive, task_env

pytestmark = pytest.mark.timeout(180)

IGNORES_SIGTERM = str(ROOT / "tests" / "integration" / "scripts" / "ignores_sigterm.py")


def wait_for(pred, timeout_s: float, what: str, context=lambda: "") -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout_s} s\n{context()}")
        time.sleep(0.1)


def test_a_second_ctrl_c_kills_the_tasks_at_once_and_the_run_is_recorded_stopped(tmp_path: Path, procs) -> None:  # noqa: ANN001
    logdir = tmp_path / "run"
    launcher = subprocess.Popen([PSFLOW, "run", "--ps", "1", "--workers", "1", "--no-live", "--logdir", str(logdir),
                                 IGNORES_SIGTERM], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=task_env(), cwd=ROOT, start_new_session=True)
    procs.append(launcher)
    worker_log = logdir / "logs" / "worker-0.log"
    wait_for(lambda: worker_log.exists() and "training (SIGTERM ignored)" in worker_log.read_text(), 90,
             "the worker's training", lambda: log_tails(logdir))
    launcher.send_signal(signal.SIGINT)
    time.sleep(1.0)
    assert launcher.poll() is None  # the worker ignores SIGTERM: the stop waits its grace (20 s)
    asked = time.monotonic()
    launcher.send_signal(signal.SIGINT)
    out, _ = launcher.communicate(timeout=60)
    assert time.monotonic() - asked < 10.0, out[-3000:]  # killed at once, not after the grace
    assert launcher.returncode == 130, out[-3000:]
    assert "Ctrl-C again: killing every task now (SIGKILL)" in out, out[-3000:]
    summary = json.loads((logdir / "summary.json").read_text())
    assert summary["status"] == "stopped", summary
    assert not any(pid_alive(t["pid"]) for t in summary["tasks"]), summary["tasks"]
    worker = next(t for t in summary["tasks"] if t["task"] == "worker:0")
    assert worker["exits"][-1]["signal"] == "SIGKILL", worker
