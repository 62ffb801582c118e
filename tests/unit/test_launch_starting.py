"""A run started from the dashboard is recorded before its launcher is up: ``pending`` with a
``launch_requested`` event at once; the launcher's own record takes the row over; a launcher that
ends before it recorded the run leaves the run ``failed`` with its last words as the root cause."""

from __future__ import annotations

import os

from psflow.platform.jobstore import JobStore
from psflow.platform.launching import LaunchSpec, plan_of, record_launch_failure, record_starting
from psflow.platform.sqlrunstore import SqliteRunStore, run_record


def _plan(tmp_path):  # noqa: ANN202
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    spec = LaunchSpec(script=str(script), args=("--epochs", "1"), num_ps=1, num_workers=2, run_id="run-new",
                      logdir=str(tmp_path / "run"))
    (tmp_path / "run").mkdir()
    return spec, plan_of(spec)


def test_a_started_run_is_pending_at_once_and_its_launcher_takes_the_record_over(tmp_path):
    spec, plan = _plan(tmp_path)
    db_path = tmp_path / "jobs.db"
    record_starting(db_path, plan, spec, os.getpid())
    with JobStore(db_path) as db:
        run = db.run("run-new")
        assert run["state"] == "pending" and list(run["tasks"]) == ["ps:0", "worker:0", "worker:1"]
        assert run["args"] == ["--epochs", "1"] and run["logdir"] == str(tmp_path / "run")
        assert [e["kind"] for e in db.events("run-new")] == ["launch_requested"]
    # the launcher records the same run: no duplicate, no error; its launch then counts as started
    store = SqliteRunStore(db_path, run_record(plan, backend="local"), plan.task_names(), warn=print)
    store.task_started("worker:0", 0, type("H", (), {"pid": os.getpid(), "scheduler_id": None})())
    store.close()
    assert store.failures == 0
    assert not record_launch_failure(db_path, "run-new", plan.logdir, 0)  # it recorded the run: not a launch failure
    with JobStore(db_path) as db:
        assert [e["kind"] for e in db.events("run-new")][:2] == ["launch_requested", "run_started"]
        assert len(db.runs()) == 1


def test_a_launcher_that_ends_before_it_recorded_the_run_leaves_it_failed_with_its_last_words(tmp_path):
    spec, plan = _plan(tmp_path)
    db_path = tmp_path / "jobs.db"
    record_starting(db_path, plan, spec, os.getpid())
    (tmp_path / "run" / "launcher.log").write_text(
        "some import noise\npsflow: Logdir /x is in use by run other-run (pid 7 on host h). Choose another --logdir.\n")
    assert record_launch_failure(db_path, "run-new", plan.logdir, 2)
    assert not record_launch_failure(db_path, "run-new", plan.logdir, 2)  # once
    with JobStore(db_path) as db:
        run = db.run("run-new")
        assert run["state"] == "failed" and run["ended_unix"] is not None
        assert run["root_cause"] == ("its launcher ended with exit code 2 before the run started: psflow: Logdir /x is "
                                     "in use by run other-run (pid 7 on host h). Choose another --logdir.")
        assert [e["kind"] for e in db.events("run-new")] == ["launch_requested", "launch_failed"]


def test_a_launcher_killed_before_it_recorded_the_run_is_a_failed_launch_not_an_abandoned_one(tmp_path):
    import subprocess
    import sys

    spec, plan = _plan(tmp_path)
    db_path = tmp_path / "jobs.db"
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    record_starting(db_path, plan, spec, proc.pid)
    proc.kill()
    code = proc.wait()
    with JobStore(db_path) as db:  # this process (the dashboard) answers for the run until its launcher records it
        assert db.run("run-new")["state"] == "pending"
    assert record_launch_failure(db_path, "run-new", plan.logdir, code)
    with JobStore(db_path) as db:
        run = db.run("run-new")
        assert run["state"] == "failed" and run["root_cause"] == (
            f"its launcher ended with exit code -9 before the run started (see {plan.logdir}/launcher.log)")


def test_with_the_dashboard_gone_a_starting_run_is_abandoned_until_its_launcher_records_it(tmp_path):
    import subprocess
    import sys

    spec, plan = _plan(tmp_path)
    db_path = tmp_path / "jobs.db"
    dashboard = (f"from pathlib import Path; from psflow.platform.launching import LaunchSpec, plan_of, record_starting; "
                 f"spec = LaunchSpec.from_json({spec.to_json()!r}); "
                 f"record_starting(Path({str(db_path)!r}), plan_of(spec), spec, 1)")
    subprocess.run([sys.executable, "-c", dashboard], check=True, timeout=60)  # it recorded the run, then went away
    with JobStore(db_path) as db:
        run = db.run("run-new")
        assert run["state"] == "abandoned" and run["note"].startswith("abandoned: launcher pid")
    store = SqliteRunStore(db_path, run_record(plan, backend="local"), plan.task_names(), warn=print)
    store.close()
    with JobStore(db_path) as db:  # the launcher, still starting, took its run over
        run = db.run("run-new")
        assert run["state"] == "pending" and run["note"] is None and store.failures == 0
