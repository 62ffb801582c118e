"""The local backend's stack dump reaches a frozen task too: a task stopped by SIGSTOP (what the
watchdog calls frozen: no heartbeats) cannot run its SIGUSR1 handler, so ``dump_stacks`` resumes it,
and its stacks land in its log where the returned StackDump says."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from inproc import wait_until

from psflow.launch.local import LocalBackend
from psflow.launch.plan import make_plan

pytestmark = pytest.mark.timeout(60)

SCRIPT = """
import faulthandler, signal, sys, time
faulthandler.register(signal.SIGUSR1, all_threads=True)
print("ready", flush=True)
while True:
    time.sleep(0.05)
"""


def state_of(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_a_frozen_task_is_resumed_to_dump_its_stacks_into_its_log(tmp_path: Path) -> None:
    script = tmp_path / "sleeper.py"
    script.write_text(SCRIPT)
    plan = make_plan(str(script), num_ps=1, num_workers=1, logdir=str(tmp_path / "run"))
    task = next(t for t in plan.tasks if t.task == "worker:0")
    backend = LocalBackend(preload=False, live=False, echo=lambda line: None)
    backend.open(plan)
    try:
        pid = backend.start(task, 0, {})
        log = tmp_path / "run" / "logs" / f"{task.file_stem}.log"
        wait_until(lambda: log.exists() and "ready" in log.read_text(), 30, "the task's first line")
        os.kill(pid, signal.SIGSTOP)
        wait_until(lambda: state_of(pid) == "T", 10, "the task stopping")
        where = backend.dump_stacks("worker:0")
        assert where is not None and where.log == str(log)
        wait_until(lambda: "most recent call first" in log.read_text(), 10, "the frozen task's stacks in its log")
        dump = "".join(log.read_text().splitlines(keepends=True)[where.line - 1:])
        assert 'sleeper.py", line' in dump, dump
    finally:
        backend.stop(["worker:0"], grace_s=1.0)
        backend.close()
