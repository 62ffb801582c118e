"""A run's alerts have one path: the run's own subscriber (platform/runalerts.py) in whichever process
runs its launcher, to its launcher's webhook or to the dashboard's (found in PSFLOW_HOME/ui.json while
the dashboard runs); each alert is claimed in the job store before it is sent, so it is told once
however many senders see it. A real local HTTP server receives the POSTs; the runs go through the
Runner on the fake Kubernetes cluster (tests/unit/k8s_fake.py)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from k8s_fake import FakeCluster

from psflow.launch.k8s import K8sSettings
from psflow.launch.k8swatch import K8sBackend
from psflow.launch.plan import make_plan
from psflow.launch.restart import RestartPolicy
from psflow.launch.runner import Runner
from psflow.launch.subscribers import RunOutcome, TaskChange
from psflow.platform.jobstore import JobStore
from psflow.platform.recording import recorded_store
from psflow.platform.runalerts import RunAlerts
from psflow.platform.uifile import write_ui

DASHBOARD = "http://127.0.0.1:8899/"


def _failing_run(tmp_path: Path, monkeypatch, run_id: str) -> str:
    """worker:1 fails, is restarted once, fails again: the run fails. Recorded as psflow run records it."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("import psflow\n")
    policy = RestartPolicy.parse("on-failure", max_restarts=1, backoff_base_s=0)
    plan = replace(make_plan("train.py", num_ps=1, num_workers=2, logdir=f"runs/{run_id}", restart=policy), run_id=run_id)
    cluster = FakeCluster(exits={("worker:1", 0): 1, ("worker:1", 1): 1})
    b = K8sBackend(K8sSettings(image="train:1", volume_claim="psflow-logs"), core=cluster.core, batch=cluster.batch,
                   policy=cluster.policy, poll_s=0.001, echo=lambda line: None)
    result = Runner(b, store=lambda p: recorded_store(p, backend="k8s", warn=print)).run(plan)
    assert result.exit_code == 1 and result.root_cause == "worker:1", result.summary
    return run_id


def test_the_dashboards_webhook_is_told_by_the_runs_launcher_once_per_alert(tmp_path, monkeypatch, webhook_receiver) -> None:
    url, got = webhook_receiver
    home = tmp_path / "home"
    monkeypatch.setenv("PSFLOW_HOME", str(home))
    monkeypatch.delenv("PSFLOW_ALERT_WEBHOOK", raising=False)
    write_ui(home, DASHBOARD, alerts={"webhook": url, "stall_s": 300})  # a dashboard of this process: alive
    run_a = _failing_run(tmp_path, monkeypatch, "run-a")
    assert sorted(a["kind"] for a in got) == ["failed", "restarted"], got  # told before the run's end returned
    assert all(a["run_id"] == run_a and a["source"] == "launcher" and a["url"] == f"{DASHBOARD}#/run/{run_a}" for a in got)
    assert {a["kind"]: a.get("task") for a in got} == {"failed": "worker:1", "restarted": "worker:1"}

    # Another sender of the same run's alerts (a second watcher, a launcher started again for it): claimed, so silent.
    again = RunAlerts(run_a, url, db_path=home / "jobs.db", home=home, warn=print)
    again.on_task_state(TaskChange("worker:1", "restarting", 1, 0.0, after_s=0.0, reason="exit code 1"))
    again.on_run_end(RunOutcome("failed", 1, "worker:1", {"task": "worker:1", "text": "worker:1: exit code 1"}))
    assert sorted(a["kind"] for a in got) == ["failed", "restarted"], got
    with JobStore(home / "jobs.db", read_only=True) as db:
        claims = sorted((e["data"]["alert"], e["data"]["key"]) for e in db.events(run_a) if e["kind"] == "alert_sent")
    assert claims == [("failed", "run"), ("restarted", "worker:1@1")]

    # The launcher's own webhook and the dashboard's, both the receiver: still once each.
    got.clear()
    monkeypatch.setenv("PSFLOW_ALERT_WEBHOOK", url)
    run_b = _failing_run(tmp_path, monkeypatch, "run-b")
    assert sorted((a["run_id"], a["kind"]) for a in got) == [(run_b, "failed"), (run_b, "restarted")], got


def test_without_a_webhook_of_its_own_or_a_dashboards_nothing_is_told(tmp_path, monkeypatch, webhook_receiver) -> None:
    url, got = webhook_receiver
    home = tmp_path / "home"
    monkeypatch.setenv("PSFLOW_HOME", str(home))
    monkeypatch.delenv("PSFLOW_ALERT_WEBHOOK", raising=False)
    write_ui(home, DASHBOARD)  # a dashboard without --alert-webhook
    _failing_run(tmp_path, monkeypatch, "run-c")
    assert got == []
