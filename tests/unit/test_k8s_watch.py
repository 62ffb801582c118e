"""K8sBackend against a fake API server and Job controller (tests/unit/k8s_fake.py: the CoreV1Api and
BatchV1Api methods it calls, answering with the real client's models; no API server can run here).
Submit, watch, restarts made by Kubernetes under the rendered policy, the run store's record, stop."""

from __future__ import annotations

import json
import sqlite3
import threading
from dataclasses import replace
from pathlib import Path

import pytest
from k8s_fake import FakeCluster

from psflow.errors import ClusterError
from psflow.launch.k8s import POD_FAILURE_BACKOFF, K8sSettings
from psflow.launch.k8swatch import K8sBackend, PodTracker, PodView, load_clients, outcome, parse_report
from psflow.launch.plan import make_plan
from psflow.launch.restart import RestartPolicy
from psflow.launch.runner import Runner
from psflow.launch.runstore import file_store
from psflow.platform.sqlrunstore import SqliteRunStore, run_record

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = K8sSettings(image="train:1", volume_claim="psflow-logs")
NAME = "psflow-20260101-120000-abc123"


def make(tmp_path, monkeypatch, restart="never", **kw):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("import psflow\n")
    plan = make_plan("train.py", num_ps=1, num_workers=2, logdir="runs/k", restart=RestartPolicy.parse(restart, max_restarts=2, backoff_base_s=0)
                     if restart != "never" else None, **kw)
    return replace(plan, run_id="20260101-120000-abc123")


# The fake Job controller's back-off is counted in listings, not seconds: the launcher need not wait 10 s for it.
FAST = replace(POD_FAILURE_BACKOFF, base_s=0.0, max_s=0.0)


def backend(cluster, **kw):
    return K8sBackend(SETTINGS, core=cluster.core, batch=cluster.batch, policy=cluster.policy, poll_s=0.001,
                      echo=kw.pop("echo", lambda s: None), pod_backoff=kw.pop("pod_backoff", FAST), **kw)


def run(b, plan, store=file_store):
    """The plan through the runner, the one loop every backend is driven by."""
    return Runner(b, store=store).run(plan)


def status_of(tmp_path):
    return json.loads((tmp_path / "runs/k/status.json").read_text())


def events_of(tmp_path):
    return [json.loads(line) for line in (tmp_path / "runs/k/events.jsonl").read_text().splitlines()]


def test_a_clean_run_succeeds_and_leaves_only_the_jobs_for_their_ttl(tmp_path, monkeypatch):
    plan = make(tmp_path, monkeypatch)
    cluster = FakeCluster()
    result = run(backend(cluster), plan)
    assert result.exit_code == 0 and result.summary["status"] == "succeeded"
    assert set(cluster.objects["Job"]) == {f"{NAME}-ps", f"{NAME}-worker"}  # kept: ttlSecondsAfterFinished removes them
    assert cluster.deleted == [("PodDisruptionBudget", f"{NAME}-ps"), ("PodDisruptionBudget", f"{NAME}-chief"),
                               ("Service", NAME), ("Secret", f"{NAME}-secret")]
    tasks = status_of(tmp_path)["tasks"]
    assert {t: (v["state"], v["attempt"] + 1) for t, v in tasks.items()} == {
        "ps:0": ("exited", 1), "worker:0": ("exited", 1), "worker:1": ("exited", 1)}
    assert (tmp_path / "runs/k/logs/worker-1.log").read_text().startswith("--- psflow: worker:1 attempt 0, pod ")


def test_a_failed_pod_is_restarted_by_kubernetes_per_policy_and_the_run_store_records_it(tmp_path, monkeypatch):
    plan = make(tmp_path, monkeypatch, restart="on-failure")
    cluster = FakeCluster(exits={("worker:1", 0): 1}, messages={("worker:1", 0): json.dumps(
        {"task": "worker:1", "exception": "RuntimeError", "message": "boom"})})
    said: list[str] = []
    result = run(backend(cluster, echo=said.append, pod_backoff=replace(POD_FAILURE_BACKOFF, base_s=0.05)), plan)
    assert result.exit_code == 0, result.summary
    pods = sorted((cluster.task_of(p), p["attempt"], p["phase"]) for p in cluster.pods.values())
    assert ("worker:1", 0, "Failed") in pods and ("worker:1", 1, "Succeeded") in pods
    tasks = status_of(tmp_path)["tasks"]
    assert tasks["worker:1"]["attempt"] == 1 and tasks["worker:0"]["attempt"] == 0
    restarts = [e for e in events_of(tmp_path) if e["event"] == "restart"]
    assert [(e["task"], e["attempt"], e["reason"]) for e in restarts] == [("worker:1", 1, "exit code 1")]
    assert [e["after_s"] for e in restarts] == [0.05]  # Kubernetes' back-off, not the policy's (0 here)
    assert any("Kubernetes' Job controller replaces it as attempt 1 in ~0.05 s (its own back-off; restart 1 of 2" in line
               for line in said), said
    assert not any("restarting it as attempt" in line for line in said), said
    exits = [(e["task"], e["attempt"], e["code"]) for e in events_of(tmp_path) if e["event"] == "task_exited"]
    assert ("worker:1", 0, 1) in exits and ("worker:1", 1, 0) in exits
    report = json.loads((tmp_path / "runs/k/errors/worker-1.json").read_text())
    assert report["message"] == "boom"  # the termination message: the task's error report


def test_without_restarts_a_failed_task_fails_the_run_names_it_and_deletes_every_object(tmp_path, monkeypatch):
    plan = make(tmp_path, monkeypatch)
    cluster = FakeCluster(exits={("worker:0", 0): 3})
    result = run(backend(cluster), plan)
    assert result.exit_code == 1 and result.root_cause == "worker:0"
    assert result.summary["status"] == "failed" and result.summary["failure"]["task"] == "worker:0"
    assert not cluster.objects["Job"] and not cluster.objects["Service"] and not cluster.objects["Secret"]
    assert not cluster.pods  # the Jobs went with their pods (propagation policy)
    assert status_of(tmp_path)["state"] == "failed"


def test_exit_code_policy_retries_a_sigkill_but_not_exit_code_2(tmp_path, monkeypatch):
    plan = make(tmp_path, monkeypatch, restart="exit-code")
    cluster = FakeCluster(exits={("worker:0", 0): 137, ("worker:1", 0): 2})
    result = run(backend(cluster), plan)
    assert result.exit_code == 1 and result.root_cause == "worker:1"
    exits = {(e["task"], e["attempt"]): e for e in events_of(tmp_path) if e["event"] == "task_exited"}
    assert exits[("worker:0", 0)]["cause"] == "killed (SIGKILL)"  # 137 in the container: -9, as a local task
    assert ("worker:1", 1) not in exits and not any(p["attempt"] == 1 and cluster.task_of(p) == "worker:1"
                                                    for p in cluster.pods.values())


def test_restart_budget_per_task_is_kubernetes_backoff_limit_per_index(tmp_path, monkeypatch):
    plan = make(tmp_path, monkeypatch, restart="on-failure")  # max_restarts=2
    cluster = FakeCluster(exits={("worker:1", a): 1 for a in range(5)})
    result = run(backend(cluster), plan)
    assert result.exit_code == 1 and result.root_cause == "worker:1"
    assert status_of(tmp_path)["tasks"]["worker:1"]["attempt"] == 2


def test_the_runners_restart_budget_holds_across_jobs_and_fails_the_run_past_it(tmp_path, monkeypatch):
    # Each Job's backoffLimit (2, per job type) alone would let these three failures be restarted (one in the ps
    # Job, two in the worker Job): the run's budget, the runner's as for every backend, allows 2 in all.
    from psflow.config import TrainConfig

    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("import psflow\n")
    policy = RestartPolicy.parse("on-failure", max_restarts=5, max_restarts_per_run=2, backoff_base_s=0)
    plan = replace(make_plan("train.py", num_ps=2, num_workers=2, logdir="runs/k", restart=policy,
                             config=TrainConfig(ps_replicas=2)), run_id="20260101-120000-abc123")  # no restart group
    cluster = FakeCluster(exits={("ps:0", 0): 1, ("worker:0", 0): 1, ("worker:1", 0): 1})
    said: list[str] = []
    result = run(backend(cluster, echo=said.append), plan)
    assert result.exit_code == 1, result.summary
    assert result.root_cause in ("ps:0", "worker:0", "worker:1")  # the third failure, whichever task had it
    told = [line for line in said if "not restarted: the run's restart budget is spent (2 of 2 per run" in line]
    assert len(told) == 1 and f"{result.root_cause} (attempt 0)" in told[0], said
    restarts = [e["task"] for e in events_of(tmp_path) if e["event"] == "restart"]
    assert len(restarts) == 2 and result.root_cause not in restarts
    assert not cluster.objects["Job"]  # the launcher deleted the run's Jobs
    assert status_of(tmp_path)["state"] == "failed"


def test_stop_deletes_the_run_and_records_it_stopped(tmp_path, monkeypatch):
    plan = make(tmp_path, monkeypatch)
    cluster = FakeCluster()
    cluster.advance = lambda: None  # the pods stay Pending: the run would never end by itself
    b = backend(cluster)
    threading.Timer(0.2, b.request_stop, args=("Ctrl-C",)).start()
    result = run(b, plan)
    assert result.exit_code == 130
    assert sorted(k for k, _ in cluster.deleted if k != "Pod") == ["Job", "Job", *["PodDisruptionBudget"] * 2, "Secret",
                                                                  "Service"]
    assert status_of(tmp_path)["state"] == "stopped"
    assert any(e["event"] == "stop" and "Ctrl-C" in e["reason"] for e in events_of(tmp_path))


def test_an_object_the_api_server_refuses_is_an_error_with_its_message(tmp_path, monkeypatch):
    plan = make(tmp_path, monkeypatch)
    cluster = FakeCluster()
    cluster.objects["Service"][NAME] = {}  # left from an earlier run of the same name
    with pytest.raises(ClusterError, match=rf'refused Service {NAME} in namespace default: services "{NAME}" already exists'):
        run(backend(cluster), plan)
    assert cluster.deleted == [("Secret", f"{NAME}-secret")]  # what it created before the refusal, not the other's
    assert status_of(tmp_path)["state"] == "failed"


def test_the_job_store_records_the_kubernetes_run_its_pods_and_the_restart(tmp_path, monkeypatch):
    plan = make(tmp_path, monkeypatch, restart="on-failure")
    db = tmp_path / "jobs.db"
    cluster = FakeCluster(exits={("worker:0", 0): 137})
    store = SqliteRunStore(db, run_record(plan, backend="k8s", restart_policy=plan.restart), plan.task_names(), warn=print)
    assert run(backend(cluster), plan, store=lambda p: store).exit_code == 0  # finished() writes what is queued and closes the store
    with sqlite3.connect(db) as c:
        assert c.execute("SELECT backend, state FROM runs").fetchall() == [("k8s", "succeeded")]
        attempts = c.execute("SELECT attempt, scheduler_id, exit_code, exit_cause, restart_reason FROM attempts "
                             "WHERE task = 'worker:0' ORDER BY attempt").fetchall()
    assert [(a, code, cause, why) for a, _, code, cause, why in attempts] == [
        (0, -9, "killed (SIGKILL)", "killed (SIGKILL)"), (1, 0, "exit code 0", None)]
    # the pod, as the backend's handle; a restart's pod comes after Kubernetes' back-off: the index's name until then
    assert attempts[0][1].startswith(f"{NAME}-worker-0-") and attempts[1][1].startswith(f"{NAME}-worker-0")


def test_tracker_says_each_start_restart_and_exit_once_in_order():
    t = PodTracker()
    a0 = PodView("p0", "worker:0", 0, "Running", created=1.0)
    assert [type(c).__name__ for c in t.update([a0])] == ["Started"]
    assert t.update([a0]) == []
    a0x = replace(a0, phase="Failed", exit_code=-9, reason="OOMKilled")
    a1 = PodView("p1", "worker:0", 1, "Pending", created=2.0)
    changes = t.update([a1, a0x])  # listed in any order: told in creation order
    assert [type(c).__name__ for c in changes] == ["Exited", "Restarted", "Started"]
    assert changes[0].oom_killed and changes[1].cause == "killed (SIGKILL; out of memory?)"
    assert t.last_failure() is None  # it was started again
    assert t.update([replace(a1, phase="Failed", exit_code=1)])[0].code == 1
    assert t.last_failure() == ("worker:0", 1, 1)


def test_outcome_takes_the_job_controllers_interim_verdict_before_complete_or_failed():
    from kubernetes.client import V1Job, V1JobCondition, V1JobStatus, V1ObjectMeta

    def job(name, *types):
        return V1Job(metadata=V1ObjectMeta(name=name), status=V1JobStatus(conditions=[
            V1JobCondition(type=t, status="True", reason="FailedIndexes" if "F" in t else None) for t in types] or None))

    # a real controller sets SuccessCriteriaMet/FailureTarget first, Complete/Failed once every pod is terminal
    assert outcome([job("ps", "SuccessCriteriaMet"), job("worker", "SuccessCriteriaMet", "Complete")])[0] == "succeeded"
    assert outcome([job("ps"), job("worker", "FailureTarget")]) == ("failed", "Job worker failed (FailedIndexes)")
    assert outcome([job("ps", "SuccessCriteriaMet"), job("worker")]) == (None, "")


def test_a_termination_message_that_is_not_json_is_kept_as_the_message():
    assert parse_report('{"exception": "ValueError", "message": "bad"}') == {"exception": "ValueError", "message": "bad"}
    assert parse_report("Traceback ...\nValueError: bad\n")["message"].endswith("ValueError: bad")
    assert parse_report("  ") is None


def test_a_pod_whose_image_cannot_be_pulled_is_told_once_and_the_run_can_be_stopped(tmp_path, monkeypatch):
    plan = make(tmp_path, monkeypatch)
    cluster = FakeCluster(waiting={("worker:1", 0): ("ErrImagePull", 'pull access denied for "train:1"')})
    said: list[str] = []
    b = backend(cluster, echo=said.append, run_timeout_s=1.0)
    result = run(b, plan)
    assert result.exit_code == 130 and any("did not end within 1 s" in line for line in said)
    told = [line for line in said if "worker:1 (attempt 0) is not running yet" in line]
    assert len(told) == 1 and 'ErrImagePull: pull access denied for "train:1"' in told[0], said
    waiting = [e for e in events_of(tmp_path) if e["event"] == "task_waiting"]
    assert [(e["task"], e["reason"].split(":")[0]) for e in waiting] == [("worker:1", "ErrImagePull")]


def test_without_a_cluster_configured_the_error_says_where_config_is_read_and_offers_dry_run(tmp_path, monkeypatch):
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-such-kubeconfig"))
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(ClusterError, match=r"No Kubernetes cluster configured.*KUBECONFIG.*--dry-run"):
        load_clients()


def test_psflow_run_backend_k8s_submits_follows_and_exits_with_the_runs_code(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from psflow.cli import main
    from psflow.launch import k8swatch

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PSFLOW_HOME", str(tmp_path / "home"))
    (tmp_path / "train.py").write_text("import psflow\n")
    cluster = FakeCluster(exits={("worker:0", 0): 1})
    monkeypatch.setattr(k8swatch, "load_clients", lambda: (cluster.core, cluster.batch, cluster.policy))
    monkeypatch.setattr(K8sBackend, "__init__", _fast_init(K8sBackend.__init__))
    r = CliRunner().invoke(main, ["run", "--backend", "k8s", "--image", "train:1", "--volume-claim", "logs", "--restart",
                                  "on-failure", "--restart-backoff", "5", "--logdir", "runs/cli", "train.py"])
    assert r.exit_code == 0, r.output
    assert "Kubernetes restarted it as attempt 1 (attempt 0: exit code 1)" in r.output
    # --restart-backoff is the launcher's: said not to apply, and the banner and each restart give Kubernetes' own
    assert "--restart-backoff and --restart-backoff-max are not applied on --backend k8s: Kubernetes' Job controller" in r.output
    assert "up to 3 restarts per task, Kubernetes' Job controller's backoff: 0.05 s doubling to 600 s" in r.output
    assert "Kubernetes' Job controller replaces it as attempt 1 in ~0.05 s" in r.output
    helped = " ".join(CliRunner().invoke(main, ["run", "--help"]).output.split())
    assert "Not on --backend k8s: Kubernetes' Job controller replaces a failed pod after its own back-off" in helped
    assert f"created Job {next(iter(cluster.objects['Job']))}" in r.output
    assert json.loads((tmp_path / "runs/cli/summary.json").read_text())["status"] == "succeeded"


def _fast_init(init):
    def fast(self, settings, **kw):
        init(self, settings, **{**kw, "poll_s": 0.001, "pod_backoff": replace(POD_FAILURE_BACKOFF, base_s=0.05)})
    return fast


def rollback_plan(tmp_path, monkeypatch, max_restarts=2, **config):
    from psflow.config import TrainConfig

    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("import psflow\n")
    plan = make_plan("train.py", num_ps=2, num_workers=2, logdir="runs/k", config=TrainConfig(**config),
                     restart=RestartPolicy.parse("on-failure", max_restarts=max_restarts, backoff_base_s=0))
    return replace(plan, run_id="20260101-120000-abc123")


def final_attempts(cluster):
    out = {}
    for p in cluster.pods.values():
        out[cluster.task_of(p)] = max(out.get(cluster.task_of(p), 0), p["attempt"])
    return out


def test_a_ps_restarted_with_one_copy_rolls_every_task_back_to_the_checkpoint_as_locally(tmp_path, monkeypatch):
    # ps:1 is killed while the workers train: Kubernetes restarts it empty; the launcher then deletes every
    # other member's pod, so each starts again as its next attempt (the chief restores the newest checkpoint
    # on every shard), as the local controller's restart group does. Without it the workers finish on attempt 0.
    plan = rollback_plan(tmp_path, monkeypatch)
    cluster = FakeCluster(exits={("ps:1", 0): 137}, runs_for={"worker": 6})
    result = run(backend(cluster), plan)
    assert result.exit_code == 0, result.summary
    assert final_attempts(cluster) == {"ps:0": 1, "ps:1": 1, "worker:0": 1, "worker:1": 1}
    first = {cluster.task_of(p): p for p in cluster.pods.values() if p["attempt"] == 0}
    assert first["worker:0"]["code"] == first["worker:1"]["code"] == first["ps:0"]["code"] == 143  # deleted, not finished
    assert sorted(n for k, n in cluster.deleted if k == "Pod") == sorted(first[t]["name"] for t in ("ps:0", "worker:0", "worker:1"))
    for p in cluster.pods.values():  # PSFLOW_ATTEMPT of the second pods: the Job controller's failure count, 1
        assert p["annotations"]["batch.kubernetes.io/job-index-failure-count"] == str(p["attempt"])
    (group,) = [e for e in events_of(tmp_path) if e["event"] == "stop"]  # the runner's, as for local tasks
    assert group["reason"].startswith("ps:1 (attempt 0) killed (SIGKILL): restarting the job (every shard back")
    assert sorted(group["tasks"]) == ["ps:0", "worker:0", "worker:1"]
    restarts = {e["task"]: e["reason"] for e in events_of(tmp_path) if e["event"] == "restart"}
    assert restarts == {"ps:1": "killed (SIGKILL)", "ps:0": "killed (SIGTERM)", "worker:0": "killed (SIGTERM)",
                        "worker:1": "killed (SIGTERM)"}
    assert {t: v["attempt"] for t, v in status_of(tmp_path)["tasks"].items()} == final_attempts(cluster)


def test_with_a_backup_of_each_shard_a_restarted_ps_restarts_alone(tmp_path, monkeypatch):
    plan = rollback_plan(tmp_path, monkeypatch, ps_replicas=2)
    cluster = FakeCluster(exits={("ps:1", 0): 137}, runs_for={"worker": 6})
    result = run(backend(cluster), plan)
    assert result.exit_code == 0, result.summary
    assert final_attempts(cluster) == {"ps:0": 0, "ps:1": 1, "worker:0": 0, "worker:1": 0}
    assert not [k for k, _ in cluster.deleted if k == "Pod"]


def test_a_group_rollback_past_a_tasks_budget_fails_the_run_naming_the_ps(tmp_path, monkeypatch):
    plan = rollback_plan(tmp_path, monkeypatch, max_restarts=1)
    cluster = FakeCluster(exits={("ps:0", 0): 1, ("ps:0", 1): 1}, runs_for={"worker": 6})
    said: list[str] = []
    result = run(backend(cluster, echo=said.append), plan)
    assert result.exit_code == 1 and result.root_cause == "ps:0", result.summary
    assert any("ps:0 (attempt 1)" in line and "not restarted" in line for line in said), said
    assert not cluster.objects["Job"] and status_of(tmp_path)["state"] == "failed"


def test_a_disrupted_worker_is_replaced_without_spending_a_restart_under_restart_never(tmp_path, monkeypatch):
    # backoffLimit 0 (never): without the podFailurePolicy's Ignore rule the preemption would fail the run.
    plan = make(tmp_path, monkeypatch)
    cluster = FakeCluster(disrupts={("worker:1", 0)})
    result = run(backend(cluster), plan)
    assert result.exit_code == 0, result.summary
    worker1 = [p for p in cluster.pods.values() if cluster.task_of(p) == "worker:1"]
    assert [(p["attempt"], p["phase"]) for p in worker1] == [(0, "Failed"), (0, "Succeeded")]
    assert not [e for e in events_of(tmp_path) if e["event"] == "restart"]
    replaced = [(e["task"], e["attempt"], e["reason"]) for e in events_of(tmp_path) if e["event"] == "task_replaced"]
    assert replaced == [("worker:1", 0, "killed (SIGKILL) (PreemptionByScheduler); Kubernetes replaced the pod (no restart spent)")]
    assert status_of(tmp_path)["tasks"]["worker:1"]["state"] == "exited"


def test_a_disrupted_ps_with_one_copy_rolls_the_job_back_and_under_never_fails_the_run_saying_why(tmp_path, monkeypatch):
    # Kubernetes replaces a preempted ps whatever the policy, empty: the group rolls back where it may restart.
    plan = rollback_plan(tmp_path, monkeypatch)
    cluster = FakeCluster(disrupts={("ps:0", 0)}, runs_for={"worker": 6})
    assert run(backend(cluster), plan).exit_code == 0
    assert final_attempts(cluster) == {"ps:0": 0, "ps:1": 1, "worker:0": 1, "worker:1": 1}  # ps:0 replaced, uncounted
    (group,) = [e for e in events_of(tmp_path) if e["event"] == "stop"]
    assert group["reason"].startswith("ps:0 (attempt 0) killed (SIGKILL): restarting the job")

    never = replace(plan, restart=RestartPolicy.parse("never"))
    cluster = FakeCluster(disrupts={("ps:0", 0)}, runs_for={"worker": 6})
    said: list[str] = []
    result = run(backend(cluster, echo=said.append), never)
    assert result.exit_code == 1 and result.root_cause == "ps:0", result.summary
    (stop,) = [e for e in events_of(tmp_path) if e["event"] == "stop"]
    assert stop["reason"].startswith("ps:0 failed (exit code -9 (SIGKILL))")  # the runner's rule: never restarts it
    assert not cluster.objects["Job"]


def test_an_allreduce_ranks_restart_restarts_every_rank_as_locally(tmp_path, monkeypatch):
    from psflow.config import TrainConfig

    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("import psflow\n")
    plan = replace(make_plan("train.py", num_ps=0, num_workers=3, logdir="runs/k", config=TrainConfig(strategy="allreduce"),
                             restart=RestartPolicy.parse("on-failure", max_restarts=2, backoff_base_s=0)), run_id="20260101-120000-abc123")
    cluster = FakeCluster(exits={("worker:2", 0): 1}, runs_for={"worker": 6, "worker:2": 2})
    result = run(backend(cluster), plan)
    assert result.exit_code == 0, result.summary
    assert final_attempts(cluster) == {"worker:0": 1, "worker:1": 1, "worker:2": 1}  # a rank cannot rejoin a running group
    (group,) = [e for e in events_of(tmp_path) if e["event"] == "stop"]
    assert "the all-reduce group" in group["reason"] and sorted(group["tasks"]) == ["worker:0", "worker:1"]
