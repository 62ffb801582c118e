"""Alert webhooks of `psflow ui --alert-webhook URL` and `psflow run --alert-webhook URL`: real runs (a
worker killed and restarted, a run that fails, a run whose global step stands still) and a real HTTP
receiver on 127.0.0.1 that records what each run's launcher POSTs (to its own webhook, or to the
dashboard's while one runs)."""

from __future__ import annotations

import subprocess

import pytest
from conftest import PSFLOW, ROOT, SOFTMAX, log_tails, task_env
from dashboard import start_dashboard, wait_for

pytestmark = [pytest.mark.timeout(300), pytest.mark.long]  # runs that restart, fail and stall for the alerts, 30-40 s each: make test-long


def _run(home, logdir, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([PSFLOW, "run", "--ps", "1", "--no-live", "--logdir", str(logdir), *flags, SOFTMAX, "--",
                           "--epochs", "2", "--init", "zeros"], capture_output=True, text=True, timeout=240,
                          env=task_env(PSFLOW_HOME=str(home)), cwd=ROOT)


def test_a_restart_a_failure_and_a_stall_reach_the_webhook(tmp_path, webhook_receiver):
    url, got = webhook_receiver
    ui = start_dashboard(tmp_path / "home", tmp_path / "runs", extra=("--alert-webhook", url, "--alert-stall", "2"))
    try:
        wait_for(lambda: "".join(ui.output), lambda out: f"alerts (failed, stalled for 2 s, restarted) go to {url}" in out,
                 what="psflow ui saying where alerts go", timeout_s=30)
        restarted = _run(ui.home, tmp_path / "a", "--workers", "2", "--restart", "on-failure",
                         "--fail-at", "worker:1@step=30:kill")
        assert restarted.returncode == 0, restarted.stdout[-2000:] + log_tails(tmp_path / "a")
        failed = _run(ui.home, tmp_path / "b", "--workers", "2", "--fail-at", "worker:1@step=30")
        assert failed.returncode == 1, failed.stdout[-2000:]
        stalled = _run(ui.home, tmp_path / "c", "--workers", "1", "--fail-at", "worker:0@step=50:stall=8")
        assert stalled.returncode == 0, stalled.stdout[-2000:] + log_tails(tmp_path / "c")
        kinds = wait_for(lambda: sorted({a["kind"] for a in got}), lambda k: k == ["failed", "restarted", "stalled"],
                         what="a restarted, a failed and a stalled alert", timeout_s=60)
        assert kinds
    finally:
        ui.stop()
    by_kind = {a["kind"]: a for a in got}
    assert all(a["path"] == "/hook" and a["type"] == "application/json" for a in got)
    from psflow.platform.jobstore import JobStore

    with JobStore(ui.home / "jobs.db") as db:
        ids = {r["logdir"].rsplit("/", 1)[-1]: r["id"] for r in db.runs()}
    r = by_kind["restarted"]
    assert (r["run_id"], r["task"]) == (ids["a"], "worker:1") and "worker:1 restarted as attempt 1" in r["text"]
    f = by_kind["failed"]
    assert f["run_id"] == ids["b"] and f["detail"]["root_cause"] == "worker:1" and "root cause: worker:1" in f["text"]
    # the 8 s stall of run c's only worker at its step 50 (a 2 s threshold may also catch a run's last
    # seconds, after its final step, while its tasks finish: those are not asserted either way)
    stalls = [a for a in got if a["kind"] == "stalled" and a["run_id"] == ids["c"] and a["detail"]["global_step"] < 100]
    assert stalls and all(a["detail"]["stalled_s"] >= 2 and "stalled: global step" in a["text"] for a in stalls), got
    assert len(stalls) == 1, stalls  # told once for that stall
    assert all(a["url"] == f"{ui.url}#/run/{a['run_id']}" for a in got)
    assert [a["kind"] for a in got].count("failed") == 1 and [a["kind"] for a in got].count("restarted") == 1


def test_the_launcher_alerts_with_no_dashboard_and_a_dashboard_beside_it_does_not_tell_twice(tmp_path, webhook_receiver):
    url, got = webhook_receiver
    home = tmp_path / "home"
    flaky = ("--workers", "2", "--restart", "on-failure", "--max-restarts", "1",
             "--fail-at", "worker:1@step=30,worker:1@step=5@attempt=1")  # fails, restarts once, fails again: the run fails
    alone = _run(home, tmp_path / "a", "--alert-webhook", url, *flaky)
    assert alone.returncode == 1, alone.stdout[-2000:] + alone.stderr[-2000:]
    # no dashboard ran: the launcher told the restart and the failure itself, before it exited
    assert sorted(a["kind"] for a in got) == ["failed", "restarted"], got
    from psflow.platform.jobstore import JobStore

    with JobStore(home / "jobs.db") as db:
        (run_a,) = [r["id"] for r in db.runs()]
        claimed = [e["data"] for e in db.events(run_a) if e["kind"] == "alert_sent"]
    by_kind = {a["kind"]: a for a in got}
    assert by_kind["restarted"]["run_id"] == run_a and by_kind["restarted"]["task"] == "worker:1"
    assert "worker:1 restarted as attempt 1" in by_kind["restarted"]["text"] and by_kind["restarted"]["source"] == "launcher"
    assert by_kind["failed"]["detail"]["root_cause"] == "worker:1" and "root cause: worker:1" in by_kind["failed"]["text"]
    assert sorted((c["alert"], c["key"], c["source"]) for c in claimed) == [
        ("failed", "run", "launcher"), ("restarted", "worker:1@1", "launcher")]

    # the same with a dashboard that alerts too: its webhook is the launcher's to tell (the one sender), each alert once
    got.clear()
    ui = start_dashboard(home, tmp_path / "runs", extra=("--alert-webhook", url, "--alert-stall", "300"))
    try:
        both = _run(home, tmp_path / "b", "--alert-webhook", url, *flaky)
        assert both.returncode == 1, both.stdout[-2000:]
        with JobStore(home / "jobs.db") as db:
            run_b = next(r["id"] for r in db.runs() if r["id"] != run_a)
    finally:
        ui.stop()
    assert sorted(a["kind"] for a in got if a["run_id"] == run_b) == ["failed", "restarted"], got
    assert all(a["source"] == "launcher" and a["url"] == f"{ui.url}#/run/{run_b}" for a in got)
