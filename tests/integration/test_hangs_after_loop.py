"""The hang watchdog and the end of training: a worker whose training loop is over (its Supervisor
closed, its trainer closed) and that then works for longer than --hang-timeout without a step (an
evaluation, a slow exit) is not taken for hung, killed or restarted. Found by the 30-minute
false-positive run of benchmarks/bench_hangs.py: under heavy load the chief's end (its final
checkpoint, its report, its exit) took more than the 3 s timeout, it was killed as hung after the
job's end, and its restarts could not reach the ps that had already exited.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import ROOT, log_tails, read_summary, run_psflow

pytestmark = pytest.mark.timeout(300)

SCRIPT = str(ROOT / "tests" / "integration" / "scripts" / "pause_after_loop.py")


def test_work_after_the_training_loop_longer_than_the_hang_timeout_is_not_a_hang(tmp_path: Path) -> None:
    logdir = tmp_path / "pause"
    r = run_psflow(["run", "--ps", "1", "--workers", "2", "--logdir", str(logdir), "--no-live", "--hang-timeout", "3",
                    "--restart", "on-failure", "--restart-backoff", "0", SCRIPT, "--", "--pause", "7"], timeout_s=180)
    out = f"{r.stdout[-4000:]}\n{r.stderr[-2000:]}\n{log_tails(logdir)}"
    assert r.returncode == 0, out
    s = read_summary(logdir)
    assert s["status"] == "succeeded" and s["restarts"] == 0, out
    assert all(t["attempts"] == 1 and t["exit_code"] == 0 for t in s["tasks"]), s["tasks"]
    events = [json.loads(line) for line in (logdir / "events.jsonl").read_text().splitlines()]
    assert [e for e in events if e["event"] == "task_hung"] == [], out
    assert "worker=0 done after its pause" in r.stdout and "worker=1 done after its pause" in r.stdout, out
