"""A task's descendants end with the run, even one in a session of its own (issue 23 item 6): the
launcher signalled each task's process group, which a `setsid` helper leaves, so it outlived the run."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
from conftest import PSFLOW, ROOT, log_tails, pid_alive, task_env

pytestmark = pytest.mark.timeout(180)

LEAVES_A_CHILD = str(ROOT / "tests" / "integration" / "scripts" / "leaves_a_child.py")


def test_a_helper_a_task_started_in_its_own_session_ends_with_the_run(tmp_path: Path) -> None:
    logdir = tmp_path / "run"
    r = subprocess.run([PSFLOW, "run", "--ps", "1", "--workers", "2", "--no-live", "--logdir", str(logdir),
                        LEAVES_A_CHILD], capture_output=True, text=True, timeout=150, env=task_env(), cwd=ROOT)
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-2000:]}\n{log_tails(logdir)}"
    pids = [int(p.read_text()) for p in sorted(logdir.glob("child-*.pid"))]
    assert len(pids) == 2, list(logdir.iterdir())
    deadline = time.monotonic() + 10.0  # SIGKILLed by the launcher before it exited: gone, or a zombie of init's
    while any(pid_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = [pid for pid in pids if pid_alive(pid)]
    for pid in alive:  # do not leave them behind if the launcher did
        subprocess.run(["kill", "-9", str(pid)], check=False)
    assert not alive, f"the helpers {alive} outlived the run"
