"""Unit tests of the job store (psflow.platform.jobstore, schema, sqlrunstore) on real SQLite files."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from psflow.home import jobs_db_path, psflow_home
from psflow.launch.runstore import CompositeRunStore, RunStore
from psflow.platform.jobstore import JobStore, JobStoreError
from psflow.platform.schema import LATEST, MIGRATIONS
from psflow.platform.sqlrunstore import SqliteRunStore

SRC = Path(__file__).resolve().parents[2] / "src"
TASKS = ["ps:0", "worker:0", "worker:1"]


def _record(run_id: str = "run-1", *, launcher: dict | None = None) -> dict:
    from psflow.launch.liveness import process_identity

    return {"id": run_id, "script": "examples/mnist_softmax.py", "args": ["--epochs", "1"], "logdir": "/tmp/runs/x",
            "cluster": {"ps": ["ps:0"], "worker": ["worker:0", "worker:1"]}, "mode": "sync", "strategy": "ps",
            "backend": "local", "restart_policy": {"kind": "on-failure", "max_restarts": 3},
            "launcher": launcher or process_identity(os.getpid()), "created_unix": time.time()}


def _store(path: Path, run_id: str = "run-1", warnings: list[str] | None = None, **kw) -> SqliteRunStore:
    sink = warnings if warnings is not None else []
    return SqliteRunStore(path, _record(run_id, **kw), TASKS, warn=sink.append, close_timeout_s=30.0)


def _dead_identity() -> dict:
    """The identity of a real process that has exited (taken while it lived)."""
    from psflow.launch.liveness import process_identity

    p = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    identity = process_identity(p.pid)
    p.communicate(b"", timeout=30)
    return identity


# -- where it lives ------------------------------------------------------------------------------------
def test_psflow_home_defaults_to_dot_psflow_and_blank_means_unset():
    assert psflow_home({}) == Path.home() / ".psflow"
    assert psflow_home({"PSFLOW_HOME": "  "}) == Path.home() / ".psflow"
    assert jobs_db_path({"PSFLOW_HOME": "/srv/ps"}) == Path("/srv/ps/jobs.db")


# -- schema and migrations -------------------------------------------------------------------------------
def test_a_new_store_is_at_the_latest_schema_in_wal_mode(tmp_path):
    with JobStore(tmp_path / "home" / "jobs.db") as db:
        assert db.version == LATEST == MIGRATIONS[-1][0]
        assert db.conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        tables = {r[0] for r in db.conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        versions = [r[0] for r in db.conn.execute("SELECT version FROM schema_version ORDER BY version")]
    assert {"runs", "tasks", "attempts", "events", "metrics", "schema_version"} <= tables
    assert versions == [n for n, _, _ in MIGRATIONS]


def test_an_old_version_database_is_migrated_and_keeps_its_runs(tmp_path):
    path = tmp_path / "jobs.db"
    with JobStore(path, migrate_to=1) as old:
        assert old.version == 1
        assert not old.conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'metrics'").fetchone()
        with old.transaction():
            old.add_run(_record("old-run"), TASKS)
            old.finish_run("old-run", "succeeded", time.time())
    with JobStore(path) as db:  # opened by this psflow: migrated forward
        assert db.version == LATEST
        with db.transaction():
            db.task_progress("old-run", "worker:0", {"loss": 0.5}, time.time(), [("loss", 0.5, 3)])
        run = db.run("old-run")
    assert run["state"] == "succeeded" and list(run["tasks"]) == TASKS
    assert run["tasks"]["worker:0"]["metrics"] == {"loss": 0.5}


def test_two_processes_opening_an_old_database_at_once_migrate_it_once(tmp_path):
    path = tmp_path / "jobs.db"
    JobStore(path, migrate_to=1).close()
    code = f"import sys; sys.path.insert(0, {str(SRC)!r}); sys.stdin.read()\n" \
           f"from psflow.platform.jobstore import JobStore; print(JobStore({str(path)!r}).version)"
    procs = [subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate("go", timeout=60) for p in procs]  # both released together
    assert [p.returncode for p in procs] == [0, 0] and [o.strip() for o, _ in outs] == [str(LATEST)] * 2
    with JobStore(path) as db:
        assert [r[0] for r in db.conn.execute("SELECT version FROM schema_version ORDER BY version")] == list(range(1, LATEST + 1))


def test_a_database_from_a_newer_psflow_is_refused_by_name(tmp_path):
    path = tmp_path / "jobs.db"
    JobStore(path).close()
    with sqlite3.connect(path) as conn:
        conn.execute("INSERT INTO schema_version VALUES (?, 0)", (LATEST + 5,))
    with pytest.raises(JobStoreError, match=rf"{path}.*schema version {LATEST + 5}.*newer psflow"):
        JobStore(path)


def test_a_corrupt_database_gives_one_error_naming_the_file_and_what_to_do(tmp_path):
    path = tmp_path / "jobs.db"
    path.write_bytes(b"this is not sqlite at all " * 200)
    with pytest.raises(JobStoreError) as e:
        JobStore(path)
    assert str(path) in str(e.value) and f"mv {path} {path}.corrupt" in str(e.value)
    assert "not a readable SQLite database" in str(e.value)


# -- what a run records ------------------------------------------------------------------------------------
def test_a_run_records_its_shape_tasks_attempts_events_and_metrics(tmp_path):
    path = tmp_path / "jobs.db"
    warnings: list[str] = []
    store = _store(path, warnings=warnings)
    for i, t in enumerate(TASKS):
        store.task_started(t, 0, 1000 + i)
        store.task_registered(t, f"127.0.0.1:{5000 + i}")
    store.report("worker:1", {"progress": {"global_step": 10, "loss": 2.0, "examples_per_sec": 500.0,
                                           "examples": 1000, "train_time_s": 2.0}})
    store.report("worker:1", {"progress": {"global_step": 20, "loss": 1.5, "examples_per_sec": 600.0,
                                           "examples": 2000, "train_time_s": 3.0}})
    store.report("worker:0", {"test_accuracy": 0.91, "eval": {"accuracy": 0.9}})
    store.report("ps:0", {"global_step": 21})
    store.task_exited("worker:1", 0, -9, time.time())
    store.task_restarting("worker:1", 1, 1.0, "killed (SIGKILL)")
    store.task_started("worker:1", 1, 2001)
    for t in TASKS:
        store.task_exited(t, 1 if t == "worker:1" else 0, 0, time.time())
    store.summary({"run_id": "run-1", "status": "succeeded", "root_cause": None, "metrics": {"test_accuracy": 0.91}})
    store.finished("succeeded")

    with JobStore(path) as db:
        run = db.run("run-1")
        attempts = db.attempts("run-1")
        kinds = [e["kind"] for e in db.events("run-1")]
        losses = db.metrics("run-1", task="worker:1", name="loss")
    assert warnings == []
    assert (run["state"], run["script"], run["args"], run["backend"], run["mode"]) == (
        "succeeded", "examples/mnist_softmax.py", ["--epochs", "1"], "local", "sync")
    assert run["cluster"] == {"ps": ["ps:0"], "worker": ["worker:0", "worker:1"]}
    assert run["restart_policy"]["kind"] == "on-failure"
    assert run["started_unix"] <= run["ended_unix"] and run["metrics"] == {"test_accuracy": 0.91}
    w1 = run["tasks"]["worker:1"]
    assert (w1["state"], w1["attempt"], w1["pid"], w1["exit_code"], w1["address"]) == ("exited", 1, 2001, 0, None)
    assert w1["heartbeat_unix"] is not None and w1["metrics"]["loss"] == 1.5
    assert run["tasks"]["ps:0"]["address"] == "127.0.0.1:5000" and run["global_step"] == 21
    assert run["tasks"]["worker:0"]["metrics"] == {"test_accuracy": 0.91, "eval/accuracy": 0.9}
    assert [(a["task"], a["attempt"], a["exit_code"], a["restart_reason"]) for a in attempts if a["task"] == "worker:1"] == [
        ("worker:1", 0, -9, "killed (SIGKILL)"), ("worker:1", 1, 0, None)]
    assert [a["exit_cause"] for a in attempts if a["task"] == "worker:1"] == ["killed (SIGKILL)", "exit code 0"]
    assert [(x["attempt"], x["cause"], x["restarted"]) for x in w1["exits"]] == [
        (0, "killed (SIGKILL)", True), (1, "exit code 0", False)]
    assert kinds[0] == "run_started" and kinds[-1] == "run_finished"
    assert kinds.count("task_started") == 4 and "restart" in kinds and kinds.count("task_exited") == 4
    assert [(p["value"], p["step"]) for p in losses] == [(2.0, 10), (1.5, 20)]


def test_a_run_is_pending_until_its_first_task_starts(tmp_path):
    path = tmp_path / "jobs.db"
    store = _store(path)
    store.close()  # everything queued so far is written
    with JobStore(path) as db:
        assert db.run("run-1")["state"] == "pending"
        assert {t["state"] for t in db.run("run-1")["tasks"].values()} == {"pending"}


def test_runs_are_listed_newest_first_filtered_by_state_and_found_by_a_unique_prefix(tmp_path):
    path = tmp_path / "jobs.db"
    for run_id, state in (("20250101-aaa", "failed"), ("20250102-bbb", "succeeded"), ("20250102-bbc", "succeeded")):
        store = _store(path, run_id)
        store.task_started("ps:0", 0, os.getpid())
        store.finished(state)
    with JobStore(path) as db:
        assert [r["id"] for r in db.runs()] == ["20250102-bbc", "20250102-bbb", "20250101-aaa"]
        assert [r["id"] for r in db.runs(state="failed")] == ["20250101-aaa"]
        assert db.find_run("20250101") == "20250101-aaa" and db.find_run("bbc") == "20250102-bbc"
        assert db.find_run("nope") is None
        with pytest.raises(JobStoreError, match="ambiguous.*20250102-bb"):
            db.find_run("20250102-bb")


def test_a_run_whose_launcher_died_reads_abandoned_and_stays_so(tmp_path):
    path = tmp_path / "jobs.db"
    launcher, task = _dead_identity(), _dead_identity()
    store = _store(path, launcher=launcher)
    store.task_started("worker:0", 0, task["pid"])
    store.close()  # the launcher "dies": no finished()
    with JobStore(path) as db:
        run = db.run("run-1")
    assert run["state"] == "abandoned"
    assert f"launcher pid {launcher['pid']} is gone" in run["note"] and f"worker:0 (pid {task['pid']})" in run["note"]
    with sqlite3.connect(path) as conn:  # marked in the database, not only shown
        assert conn.execute("SELECT state FROM runs WHERE id = 'run-1'").fetchone()[0] == "abandoned"


def test_a_live_launchers_run_reads_running(tmp_path):
    path = tmp_path / "jobs.db"
    store = _store(path)
    store.task_started("worker:0", 0, os.getpid())
    store.tick()
    try:
        with JobStore(path) as db:
            deadline = time.monotonic() + 30
            while (run := db.run("run-1")) is None or run["state"] == "pending":
                assert time.monotonic() < deadline, "the run's start was not written within 30 s"
                time.sleep(0.01)
        assert run["state"] == "running" and not run.get("note")
    finally:
        store.finished("stopped")


# -- writers side by side; a store that cannot be written ---------------------------------------------------
_WRITER = """
import sys, time
sys.path.insert(0, {src!r})
from psflow.platform.jobstore import JobStore
run_id, n = sys.argv[1], int(sys.argv[2])
db = JobStore({path!r}, busy_timeout_s=30)
with db.transaction():
    db.add_run({{"id": run_id, "script": "s.py", "logdir": "/tmp", "created_unix": time.time()}}, ["worker:0"])
sys.stdin.read()  # the start gate: both writers go at once
for i in range(n):
    with db.transaction():
        db.task_progress(run_id, "worker:0", {{"global_step": i}}, time.time(), [("loss", 1.0 / (i + 1), i)])
        db.add_event(run_id, "tick", time.time(), {{"i": i}})
print("ok")
"""


def test_two_processes_writing_at_once_both_record_everything(tmp_path):
    path = tmp_path / "jobs.db"
    JobStore(path).close()
    code = _WRITER.format(src=str(SRC), path=str(path))
    n = 300
    procs = [subprocess.Popen([sys.executable, "-c", code, f"run-{k}", str(n)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for k in range(2)]
    for p in procs:
        p.stdin.write("go")
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    with JobStore(path) as db:
        for k in range(2):
            assert len(db.metrics(f"run-{k}", name="loss")) == n
            assert len(db.events(f"run-{k}")) == n
            assert db.run(f"run-{k}")["tasks"]["worker:0"]["progress"] == {"global_step": n - 1}
        assert db.conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


def test_a_locked_database_is_waited_for_and_then_written(tmp_path):
    path = tmp_path / "jobs.db"
    JobStore(path).close()
    blocker = sqlite3.connect(path, isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")  # another process's long write
    warnings: list[str] = []
    store = SqliteRunStore(path, _record(), TASKS, warn=warnings.append, busy_timeout_s=0.05, retry_s=60)
    store.task_started("ps:0", 0, os.getpid())
    deadline = time.monotonic() + 30
    while store.busy_retries == 0:
        assert time.monotonic() < deadline, "the writer never found the database locked"
        time.sleep(0.01)
    blocker.execute("ROLLBACK")
    blocker.close()
    store.finished("succeeded")
    assert warnings == [] and store.failures == 0
    with JobStore(path) as db:
        assert db.run("run-1")["state"] == "succeeded"


def test_a_run_started_while_the_store_stays_locked_is_recorded_whole_once_it_is_free(tmp_path):
    """Issue 23 item 2: locked past the writer's retries at the run's start, the run used to be lost
    (its row dropped, then every later record refused). Now every record waits, in order."""
    path = tmp_path / "jobs.db"
    JobStore(path).close()
    blocker = sqlite3.connect(path, isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")  # another process's write, longer than the retries
    warnings: list[str] = []
    store = SqliteRunStore(path, _record(), TASKS, warn=warnings.append, busy_timeout_s=0.05, retry_s=0.2)
    store.task_started("ps:0", 0, os.getpid())
    deadline = time.monotonic() + 30
    while not warnings:
        assert time.monotonic() < deadline, "the writer never gave a locked write up"
        time.sleep(0.01)
    store.report("worker:0", {"progress": {"global_step": 7}})
    store.event("note", text="while locked")
    time.sleep(0.5)  # more rounds of retries: still nothing dropped
    assert store.failures == 0  # nothing dropped: kept for the write once it is free
    blocker.execute("ROLLBACK")
    blocker.close()
    store.finished("succeeded")
    assert len(warnings) == 1 and "is recorded there once it is free (nothing is lost" in warnings[0], warnings
    with JobStore(path) as db:
        run = db.run("run-1")
        kinds = [e["kind"] for e in db.events("run-1")]
    assert run["state"] == "succeeded" and run["tasks"]["worker:0"]["progress"] == {"global_step": 7}
    assert kinds[:3] == ["run_started", "task_started", "note"] and kinds[-1] == "run_finished", kinds


def test_a_store_that_cannot_be_written_warns_once_and_the_run_goes_on(tmp_path):
    path = tmp_path / "jobs.db"
    path.write_bytes(b"garbage " * 1000)
    warnings: list[str] = []
    store = _store(path, warnings=warnings)
    for i in range(5):
        store.task_started("worker:0", i, os.getpid())
        store.report("worker:0", {"progress": {"global_step": i}})
        store.close() if i == 4 else store.tick()
    store.finished("succeeded")  # after close: ignored, no error
    assert len(warnings) == 1, warnings
    assert str(path) in warnings[0] and "The run goes on" in warnings[0] and f"mv {path}" in warnings[0]
    assert store.failures >= 1


class _Recording(RunStore):
    def __init__(self, fail: bool = False) -> None:
        self.calls: list[str] = []
        self.fail = fail

    def _do(self, name: str) -> None:
        self.calls.append(name)
        if self.fail:
            raise sqlite3.OperationalError("disk I/O error")

    def task_started(self, task, attempt, handle):
        self._do("task_started")

    def task_registered(self, task, address):
        self._do("task_registered")

    def report(self, task, metrics):
        self._do("report")

    def task_exited(self, task, attempt, code, at, *, oom_killed=False):
        self._do("task_exited")

    def task_restarting(self, task, attempt, after_s, reason):
        self._do("task_restarting")

    def event(self, kind, **data):
        self._do(kind)

    def finished(self, status):
        self._do("finished")

    def summary(self, summary):
        self._do("summary")

    def snapshot(self):
        return {"from": "primary" if not self.fail else "copy"}


def test_a_composite_store_keeps_the_run_going_when_a_copy_fails_and_warns_once():
    primary, broken = _Recording(), _Recording(fail=True)
    warnings: list[str] = []
    store = CompositeRunStore(primary, broken, warn=warnings.append)
    store.task_started("worker:0", 0, 1)
    store.report("worker:0", {})
    store.event("stop", tasks=["worker:0"])
    store.finished("stopped")
    assert primary.calls == broken.calls == ["task_started", "report", "stop", "finished"]  # the copy is still tried
    assert len(warnings) == 1 and "disk I/O error" in warnings[0] and "the run goes on" in warnings[0]
    assert store.snapshot() == {"from": "primary"}
