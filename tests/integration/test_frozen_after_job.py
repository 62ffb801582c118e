"""A worker frozen after its training, through `psflow run`: worker:1 sends its PS_DONE, then SIGSTOPs
itself. The chief and the ps finish the job (every worker said done); the watchdog sees worker:1 frozen
and kills it. Whichever the launcher sees first, the ps's exit or the kill, the run trained every step
and succeeds: worker:1 is not restarted into a job that is gone (or its restart is stopped at once),
and its end does not fail the run. Found by benchmarks/bench_hangs.py's detection part under load: the
restarted worker waited 60 s for the ps that had exited, and the run ended "failed".
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import ROOT, log_tails, read_summary, run_psflow

pytestmark = pytest.mark.timeout(300)

SCRIPT = str(ROOT / "tests" / "integration" / "scripts" / "freeze_after_loop.py")


def test_a_worker_frozen_after_its_ps_done_does_not_fail_the_run_that_trained_every_step(tmp_path: Path) -> None:
    logdir = tmp_path / "frozen"
    r = run_psflow(["run", "--ps", "1", "--workers", "2", "--logdir", str(logdir), "--no-live", "--hang-timeout", "3",
                    "--heartbeat-timeout", "3", "--restart", "on-failure", "--restart-backoff", "0", SCRIPT], timeout_s=180)
    out = f"{r.stdout[-4000:]}\n{r.stderr[-2000:]}\n{log_tails(logdir)}"
    assert "worker=1 freezing after its PS_DONE" in r.stdout, out
    s = read_summary(logdir)
    assert r.returncode == 0 and s["status"] == "succeeded", out
    tasks = {t["task"]: t for t in s["tasks"]}
    assert tasks["ps:0"]["exit_code"] == 0 and tasks["worker:0"]["exit_code"] == 0, tasks
    exits = tasks["worker:1"]["exits"]
    assert exits[0]["hang"]["kind"] == "frozen" and exits[0]["code"] == -9, exits
    # Not restarted (the ps's exit came first), or restarted and stopped once the ps ended the job.
    assert len(exits) in (1, 2) and exits[-1]["job_done"], exits
    assert exits[0]["restarted"] == (len(exits) == 2), exits
    # Nothing waited for the ps that was gone (a restarted worker retries for 60 s before it fails).
    assert s["wall_s"] < 55, (s["wall_s"], out)
    events = [json.loads(line) for line in (logdir / "events.jsonl").read_text().splitlines()]
    assert [e["task"] for e in events if e["event"] == "task_hung"] == ["worker:1"], out
