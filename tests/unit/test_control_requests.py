"""Control requests through the job store (psflow.launch.control, JobStore.request_control, the
run's SqliteRunStore taking them): real SQLite files, a real writer thread."""

from __future__ import annotations

import os
import time

import pytest

from psflow.errors import ConfigError
from psflow.launch.control import ControlRequest
from psflow.launch.liveness import process_identity
from psflow.platform.jobstore import JobStore, JobStoreError
from psflow.platform.launching import LaunchSpec, plan_of, spec_of_run
from psflow.platform.sqlrunstore import SqliteRunStore

TASKS = ["ps:0", "worker:0", "worker:1"]


def _record(run_id: str = "run-1") -> dict:
    return {"id": run_id, "script": "examples/mnist_softmax.py", "args": ["--epochs", "1"], "logdir": "/tmp/runs/x",
            "cluster": {"ps": ["ps:0"], "worker": ["worker:0", "worker:1"]}, "mode": "async", "strategy": "ps",
            "backend": "local", "restart_policy": {"kind": "on-failure", "max_restarts": 2},
            "launcher": process_identity(os.getpid()), "created_unix": time.time(),
            "launch": {"config": {"mode": "async", "strategy": "ps", "staleness": 4}, "hangs": {}, "threads": 1}}


def _take(store: SqliteRunStore, deadline_s: float = 20.0) -> list[ControlRequest]:
    """What the store's writer thread has taken, waiting for it at most ``deadline_s``."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        got = store.control_requests()
        if got:
            return got
        time.sleep(0.02)
    return []


def _opened(path, run_id: str = "run-1") -> SqliteRunStore:
    store = SqliteRunStore(path, _record(run_id), TASKS, warn=print, control_poll_s=0.05)
    end = time.monotonic() + 20
    while time.monotonic() < end:  # the run's row is written by the store's own thread
        with JobStore(path) as db:
            if db.run(run_id, metrics=False) is not None:
                return store
        time.sleep(0.02)
    raise AssertionError("the run was never written")


def test_a_stop_request_reaches_the_runs_store_once_and_its_answer_is_kept(tmp_path):
    path = tmp_path / "jobs.db"
    store = _opened(path)
    try:
        with JobStore(path) as db:
            rid = db.request_control("run-1", "stop", source="api")
            assert db.controls("run-1")[0]["state"] == "pending"
        taken = _take(store)
        assert [(r.id, r.kind, r.source) for r in taken] == [(rid, "stop", "api")]
        assert "stop requested through the api" in taken[0].describe()
        with JobStore(path) as db:
            assert db.controls(request_id=rid)[0]["state"] == "taken"
        time.sleep(0.3)  # several polls later (0.05 s each): nothing handed out a second time
        assert store.control_requests() == []
        store.control_answered(taken[0], "done", "every task is being stopped")
        store.task_started("worker:0", 0, None)
    finally:
        store.finished("stopped")
    with JobStore(path) as db:
        row = db.controls(request_id=rid)[0]
    assert (row["state"], row["answer"]) == ("done", "every task is being stopped")


def test_requests_of_other_runs_are_not_taken(tmp_path):
    path = tmp_path / "jobs.db"
    one, two = _opened(path, "run-1"), _opened(path, "run-2")
    try:
        with JobStore(path) as db:
            rid = db.request_control("run-2", "scale", source="cli", payload={"workers": 4})
        got = _take(two)
        assert [(r.id, dict(r.payload)) for r in got] == [(rid, {"workers": 4})]
        assert one.control_requests() == []
    finally:
        one.finished("stopped")
        two.finished("stopped")


def test_a_request_to_an_ended_run_an_unknown_run_or_kind_is_refused_by_name(tmp_path):
    path = tmp_path / "jobs.db"
    store = _opened(path)
    store.finished("succeeded")
    with JobStore(path) as db:
        with pytest.raises(JobStoreError, match=r"run-1 has already ended \(succeeded\); there is nothing to stop"):
            db.request_control("run-1", "stop", source="cli")
        with pytest.raises(JobStoreError, match="No run 'nope'"):
            db.request_control("nope", "stop", source="cli")
        with pytest.raises(JobStoreError, match="'reboot' is not one of stop, dump, scale"):
            db.request_control("run-1", "reboot", source="cli")
        with pytest.raises(JobStoreError, match="answered 'done' or 'refused'"):
            db.answer_control(1, "maybe", "", time.time())


def test_a_recorded_run_gives_the_same_plan_again_as_a_new_run_in_its_logdir(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    run = {**_record(), "script": str(script), "logdir": str(tmp_path / "run"),
           "restart_policy": {"kind": "never", "max_restarts": 3, "max_restarts_per_run": None, "backoff_base_s": 1.0,
                              "backoff_max_s": 60.0, "by_job": [["worker", "on-failure"]]}}
    spec = spec_of_run(run)
    assert (spec.num_ps, spec.num_workers, spec.chief, spec.restarted_from) == (1, 2, False, "run-1")
    assert spec.run_id != "run-1" and spec.logdir == run["logdir"] and spec.args == ("--epochs", "1")
    plan = plan_of(spec)
    assert plan.run_id == spec.run_id and plan.logdir == run["logdir"] and plan.task_names() == TASKS
    assert plan.restart.kind_for("worker") == "on-failure" and plan.restart.kind_for("ps") == "never"
    assert plan.tasks[1].argv[-3:] == (str(script), "--epochs", "1")
    assert LaunchSpec.from_json(spec.to_json()) == spec
    relative = spec_of_run({**run, "script": "train.py", "launch": {**run["launch"], "cwd": str(tmp_path)}})
    assert relative.script == str(script)  # relative to where it was launched, whatever the cwd now


@pytest.mark.parametrize("policy, said", [
    ({"kind": "on-failure", "max_restart": 2}, "RestartPolicy has no setting 'max_restart' (received 2). Known: kind, "
                                               "max_restarts, max_restarts_per_run, backoff_base_s, backoff_max_s, by_job."),
    ({"kind": "sometimes"}, "kind must be 'never', 'on-failure', 'always' or 'exit-code'; received 'sometimes'"),
    ({"max_restarts": -1}, "max_restarts must be >= 0; received -1 (restarts allowed per task)"),
    ({"max_restarts": "3"}, "max_restarts must be a valid integer; received '3'"),
    ({"backoff_base_s": 30.0, "backoff_max_s": 10.0}, "received backoff_base_s=30.0, backoff_max_s=10.0"),
    ({"by_job": [["launcher", "never"]]}, "Restart policy for job 'launcher': no such job"),
])
def test_a_bad_recorded_restart_policy_is_refused_naming_the_field_the_value_and_what_to_do(tmp_path, policy, said):
    script = tmp_path / "train.py"
    script.write_text("")
    spec = spec_of_run({**_record(), "script": str(script), "logdir": str(tmp_path / "run"), "restart_policy": policy})
    with pytest.raises(ConfigError) as e:
        plan_of(spec)
    message = str(e.value)
    assert message.startswith("The launch's restart_policy: ") and said in message, message
    assert "start the run again with psflow run --restart SPEC" in message, message


def test_a_spec_that_psflow_run_would_refuse_is_refused_before_anything_starts(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    with pytest.raises(ConfigError, match="does not exist"):
        plan_of(LaunchSpec(script=str(tmp_path / "missing.py")))
    with pytest.raises(ConfigError, match="--ps-replicas 2"):
        plan_of(LaunchSpec(script=str(script), num_ps=1, config={"ps_replicas": 2}))
    with pytest.raises(ConfigError, match="LaunchSpec: backend must be 'local', 'slurm', 'ssh' or 'k8s'; received 'mesos'"):
        plan_of(LaunchSpec(script=str(script), backend="mesos"))
    # each backend's own needs, checked before anything starts or is reached
    with pytest.raises(ConfigError, match="The ssh backend needs hosts: HOST:SLOTS"):
        plan_of(LaunchSpec(script=str(script), backend="ssh"))
    with pytest.raises(ConfigError, match=r"--hosts gives 2 slot\(s\) \(node1:2\) for 3 tasks"):
        plan_of(LaunchSpec(script=str(script), backend="ssh", hosts="node1:2"))
    assert plan_of(LaunchSpec(script=str(script), backend="ssh", hosts="node1:2,node2")).task_names() == [
        "ps:0", "worker:0", "worker:1"]
    with pytest.raises(ConfigError, match="--backend k8s needs --image IMAGE"):
        plan_of(LaunchSpec(script=str(script), backend="k8s"))
    plan_of(LaunchSpec(script=str(script), backend="k8s", k8s={"image": "me/train:1", "namespace": "ml"}))
    with pytest.raises(ConfigError, match="--nodes' if|--nodes is for --backend slurm"):
        plan_of(LaunchSpec(script=str(script), backend="local", nodes=2))
    plan_of(LaunchSpec(script=str(script), backend="slurm", nodes=2))
    with pytest.raises(ConfigError, match="RestartPolicy: kind must be .*; received 'sometimes'"):
        plan_of(LaunchSpec(script=str(script), restart_policy={"kind": "sometimes"}))


def test_psflow_stop_names_what_it_cannot_stop(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from psflow.cli import main

    monkeypatch.setenv("PSFLOW_HOME", str(tmp_path / "home"))
    logdir = tmp_path / "logdir"
    logdir.mkdir()
    r = CliRunner().invoke(main, ["stop", str(logdir)])
    assert r.exit_code == 1 and "psflow stop needs a run id from the job store" in r.output and str(logdir) in r.output
    r = CliRunner().invoke(main, ["stop", "nope"])
    assert r.exit_code == 1 and "No run 'nope'" in r.output
    store = _opened(tmp_path / "home" / "jobs.db")
    store.finished("failed")
    r = CliRunner().invoke(main, ["stop", "run-1"])
    assert r.exit_code == 0 and "run run-1 has already ended (failed); nothing to stop." in r.output
    with JobStore(tmp_path / "home" / "jobs.db") as db:
        assert db.controls("run-1") == []  # nothing asked of an ended run


def test_a_stop_nobody_takes_times_out_saying_so(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from psflow.cli import main

    monkeypatch.setenv("PSFLOW_HOME", str(tmp_path / "home"))
    # a live run (its launcher: this process) whose store no longer polls: an older launcher, or a stuck one
    store = _opened(tmp_path / "home" / "jobs.db")
    store.close()
    r = CliRunner().invoke(main, ["stop", "run-1", "--timeout", "0.5"])
    assert r.exit_code == 1, r.output
    assert "asked run run-1 to stop (request 1)" in r.output
    assert "is still pending after 0.5 s: its launcher has not taken the stop request" in r.output


def test_a_final_report_gives_the_tasks_last_loss(tmp_path):
    store = _opened(tmp_path / "jobs.db")
    store.report("worker:0", {"progress": {"global_step": 2, "local_step": 1, "loss": 2.30}})
    store.report("worker:0", {"trainer": {"global_step": 600, "local_step": 300}, "test_accuracy": 0.85,
                              "supervisor": {"first_loss": 2.30, "last_loss": 0.84, "global_step": 600}})
    store.finished("succeeded")
    with JobStore(tmp_path / "jobs.db") as db:
        task = db.run("run-1")["tasks"]["worker:0"]
        losses = [p["value"] for p in db.metrics("run-1", task="worker:0", name="loss")]
    assert task["progress"]["loss"] == 0.84 and task["progress"]["global_step"] == 600
    assert losses == [2.30, 0.84]
