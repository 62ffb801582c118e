"""`psflow stop RUN` and `psflow restart RUN` on a real run: the request goes through the job store,
the launcher (another process) takes it and stops every task; a restart launches the same plan
again in the same logdir, which resumes from the stopped run's final checkpoint."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
from conftest import PSFLOW, ROOT, SOFTMAX, log_tails, pid_alive, psflow_in, task_env, wait_for_run

from psflow.platform.jobstore import JobStore

pytestmark = pytest.mark.timeout(300)


def psflow(home: Path, *args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    return psflow_in(home, *args, timeout_s=timeout_s)


@pytest.mark.long  # a run stopped and started again, ~28 s: make test-long
def test_stop_then_restart_a_real_run_through_the_job_store(tmp_path, procs):
    home, logdir = tmp_path / "home", tmp_path / "run"
    db = home / "jobs.db"
    launcher = subprocess.Popen([PSFLOW, "run", "--ps", "1", "--workers", "2", "--no-live", "--logdir", str(logdir),
                                 SOFTMAX, "--", "--epochs", "500", "--init", "zeros", "--print_every", "50"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=task_env(PSFLOW_HOME=str(home)), cwd=ROOT, start_new_session=True)
    procs.append(launcher)
    run = wait_for_run(db, lambda r: r["state"] == "running" and (r.get("global_step") or 0) > 0,
                       what="training", context=lambda: log_tails(logdir))

    stopped = psflow(home, "stop", run["id"][-6:])
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert f"asked run {run['id']} to stop (request 1)" in stopped.stdout
    assert f"run {run['id']} is stopped" in stopped.stdout
    out, _ = launcher.communicate(timeout=60)
    assert launcher.returncode == 130, out[-3000:]
    assert "stop requested through the cli (request 1): stopping every task" in out
    with JobStore(db) as store:
        ended = store.run(run["id"])
        control = store.controls(run["id"])
        events = [e for e in store.events(run["id"]) if e["kind"] == "control"]
    assert ended["state"] == "stopped" and all(not pid_alive(t["pid"]) for t in ended["tasks"].values())
    assert [(c["kind"], c["source"], c["state"]) for c in control] == [("stop", "cli", "done")]
    assert events and events[0]["data"]["state"] == "done"
    step_at_stop = ended["global_step"]
    assert step_at_stop > 0

    again = psflow(home, "stop", run["id"])  # an ended run: nothing to do, said so
    assert again.returncode == 0 and "has already ended (stopped); nothing to stop" in again.stdout

    restarted = psflow(home, "restart", run["id"], "--detach")
    assert restarted.returncode == 0, restarted.stdout + restarted.stderr
    new = wait_for_run(db, lambda r: r.get("restarted_from") == run["id"] and (r.get("global_step") or 0) > 0,
                       what="restarted and training", context=lambda: log_tails(logdir))
    assert f"run {new['id']} restarts {run['id']}" in restarted.stdout
    assert (new["script"], new["args"], new["cluster"], new["logdir"]) == (run["script"], run["args"], run["cluster"],
                                                                           run["logdir"])
    with JobStore(db) as store:
        steps = [m["value"] for m in store.metrics(new["id"], name="global_step")]
    # it resumed from the stopped run's final checkpoint: its first global step is past it
    assert steps and min(steps) >= step_at_stop, (steps[:5], step_at_stop)

    # restart --detach of a running run: the command asks the stop and returns; the new run's launcher
    # waits for the old run's end, then starts
    third_ask = psflow(home, "restart", new["id"], "--detach")
    assert third_ask.returncode == 0, third_ask.stdout + third_ask.stderr
    assert f"stopping run {new['id']} (request " in third_ask.stdout
    third = wait_for_run(db, lambda r: r.get("restarted_from") == new["id"] and (r.get("global_step") or 0) > 0,
                         what="the second restart training", context=lambda: log_tails(logdir))
    with JobStore(db) as store:
        assert store.run(new["id"])["state"] == "stopped"
    assert f"waits for run {new['id']} to stop before it starts" in (logdir / "launcher.log").read_text()
    launcher_log = (logdir / "launcher.log").read_text()

    stopped = psflow(home, "stop", third["id"])
    assert stopped.returncode == 0 and f"run {third['id']} is stopped" in stopped.stdout, stopped.stdout + stopped.stderr
    for pid in (new["launcher"]["pid"], third["launcher"]["pid"]):
        deadline = time.monotonic() + 60
        while pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not pid_alive(pid), launcher_log
