"""`psflow scale RUN --workers N` on real runs: workers join a running job (they pull the current
parameters, the ps applies their pushes) and leave it (retired: never failed nor restarted); async,
sync and ssp jobs finish, a sync job without waiting out its sync timeout (the quorum follows the
membership). Scaling an ended run is refused with a clear message."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from conftest import PSFLOW, ROOT, SOFTMAX, log_tails, psflow_in, task_env, wait_for_run

from psflow.platform.jobstore import JobStore

pytestmark = pytest.mark.timeout(420)


def psflow(home: Path, *args: str, timeout_s: float = 150) -> subprocess.CompletedProcess:
    return psflow_in(home, *args, timeout_s=timeout_s)


def wait_for(db: Path, check, *, what: str, timeout_s: float = 150.0, context=lambda: "") -> dict:
    return wait_for_run(db, check, what=what, timeout_s=timeout_s, context=context)


def local_step(run: dict, task: str) -> int:
    return int(((run.get("tasks") or {}).get(task) or {}).get("progress", {}).get("local_step") or 0)


def launch(home: Path, logdir: Path, procs: list, *flags: str, epochs: int) -> subprocess.Popen:
    # Every worker's first attempt steps at 30 ms at least, worker:2 too once added: on a quiet machine too the
    # job outlasts its three scalings, and no worker runs out of data before it is retired. (Through the tasks'
    # own fault switch, inherited from the launcher: --slow refuses worker:2, which the launch plan lacks.)
    slow = ",".join(f"worker:{i}@step=0:delay=0.03" for i in range(3))
    p = subprocess.Popen([PSFLOW, "run", "--ps", "1", "--workers", "2", "--no-live", "--logdir", str(logdir), *flags,
                          SOFTMAX, "--", "--epochs", str(epochs), "--init", "zeros", "--print_every", "1"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=task_env(PSFLOW_HOME=str(home), PSFLOW_FAIL_AT=slow), cwd=ROOT, start_new_session=True)
    procs.append(p)
    return p


@pytest.mark.long  # a run scaled up and down, 35-65 s a mode: make test-long
@pytest.mark.parametrize("mode_flags,epochs", [
    ((), 6),
    (("--mode", "sync", "--sync-timeout", "600"), 3),
    (("--mode", "ssp", "--staleness", "2", "--sync-timeout", "600"), 3),
], ids=["async", "sync", "ssp"])
def test_a_running_job_scaled_up_then_down_finishes_with_the_added_workers_steps_applied(
        tmp_path, procs, mode_flags, epochs):
    home, logdir = tmp_path / "home", tmp_path / "run"
    db = home / "jobs.db"
    launcher = launch(home, logdir, procs, *mode_flags, epochs=epochs)
    run = wait_for(db, lambda r: r["state"] == "running" and local_step(r, "worker:0") > 0,
                   what="training", context=lambda: log_tails(logdir))

    up = psflow(home, "scale", str(logdir), "--workers", "3")  # named by its log directory
    assert up.returncode == 0, up.stdout + up.stderr + log_tails(logdir)
    assert f"run {run['id']}: 2 -> 3 workers: adding worker:2" in up.stdout
    wait_for(db, lambda r: r["id"] == run["id"] and local_step(r, "worker:2") >= 20,
             what="training on worker:2", context=lambda: log_tails(logdir))

    down = psflow(home, "scale", run["id"], "--workers", "1")
    assert down.returncode == 0, down.stdout + down.stderr + log_tails(logdir)
    assert "3 -> 1 workers: retiring worker:1, worker:2" in down.stdout
    back = not mode_flags  # async: worker:1 is added back, as its next attempt, and resumes its data
    if back:
        again = psflow(home, "scale", run["id"], "--workers", "2")
        assert again.returncode == 0, again.stdout + again.stderr + log_tails(logdir)
        assert "1 -> 2 workers: adding worker:1" in again.stdout

    out, _ = launcher.communicate(timeout=300)  # a sync job held for a retired worker would wait 600 s: a timeout here
    assert launcher.returncode == 0, out[-4000:]
    summary = json.loads((logdir / "summary.json").read_text())
    assert summary["status"] == "succeeded" and summary["restarts"] == 0
    exits = {t["task"]: t["exits"] for t in summary["tasks"]}
    assert len(exits["worker:2"]) == 1 and exits["worker:2"][0]["retired"] is True, exits["worker:2"]
    assert exits["worker:1"][0]["retired"] is True, exits["worker:1"]
    assert "retired" not in exits["worker:0"][0]
    if back:  # its second attempt trained to the end of its epochs, from where its first one's pushes stopped
        assert len(exits["worker:1"]) == 2 and exits["worker:1"][1]["code"] == 0 and "retired" not in exits["worker:1"][1]
        assert "worker:1: resuming its data at epoch" in (logdir / "logs" / "worker-1.log").read_text()
    else:
        assert len(exits["worker:1"]) == 1
    applied = summary["reports"]["ps:0"]["ps_stats"]["applied_by"]
    assert int(applied["2"]["0"]) >= 20, applied  # the added worker's gradients were applied
    assert "ps:0: shard 0 counts 3 training replicas now (was 2)" in out
    # (the shrink reaches the ps within a second, or not at all when the retired workers' PS_DONE and
    # worker:0's end come first: either way no step waits for a retired worker)
    with JobStore(db) as store:
        ended = store.run(run["id"])
        asked = store.controls(run["id"])
    assert ended["state"] == "succeeded"
    assert ended["tasks"]["worker:2"]["state"] == "retired"
    assert ended["tasks"]["worker:1"]["state"] == ("exited" if back else "retired")
    assert [(c["kind"], c["payload"], c["state"]) for c in asked] == [
        ("scale", {"workers": 3}, "done"), ("scale", {"workers": 1}, "done")] + ([("scale", {"workers": 2}, "done")] if back else [])

    late = psflow(home, "scale", run["id"], "--workers", "2")
    assert late.returncode == 1
    assert f"Run {run['id']} has already ended (succeeded); only a running run can be scaled" in late.stderr


def test_a_bad_worker_count_is_refused_before_anything_is_asked(tmp_path, procs):
    home, logdir = tmp_path / "home", tmp_path / "run"
    launcher = launch(home, logdir, procs, epochs=50)
    run = wait_for(home / "jobs.db", lambda r: r["state"] == "running", what="running", context=lambda: log_tails(logdir))
    bad = psflow(home, "scale", run["id"], "--workers", "0")
    assert bad.returncode == 1
    assert "The number of workers must be an integer from 1 to 256 (the run has 2 now). Received: 0." in bad.stderr
    with JobStore(home / "jobs.db") as store:
        assert store.controls(run["id"]) == []
    assert psflow(home, "stop", run["id"]).returncode == 0
    launcher.communicate(timeout=120)
