"""The run controller is the one source of a run's state: its subscribers (the file store, the job
store, the alerts, any other) learn every change from it, a subscriber that fails stops none of the
others, and every subscriber gets the same root cause, put in words once."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from psflow.launch.controller import (
    RestartPolicy,
    RunController,
    TaskExited,
    TaskReported,
    TaskStarted,
)
from psflow.launch.runner import failure_in_words
from psflow.launch.runstore import FileRunStore
from psflow.launch.subscribers import RunOutcome, RunSubscriber, Subscribers, TaskChange
from psflow.rundir import RunDir

TASKS = ["ps:0", "worker:0", "worker:1"]


class Recorder(RunSubscriber):
    def __init__(self) -> None:
        self.changes: list[TaskChange] = []
        self.phases: list[str] = []
        self.outcomes: list[RunOutcome] = []

    def on_task_state(self, change: TaskChange) -> None:
        self.changes.append(change)

    def on_run_state(self, state: str, at: float) -> None:
        self.phases.append(state)

    def on_run_end(self, outcome: RunOutcome) -> None:
        self.outcomes.append(outcome)


class Broken(RunSubscriber):
    def __init__(self) -> None:
        self.calls = 0

    def on_task_state(self, change: TaskChange) -> None:
        self.calls += 1
        raise OSError("disk full")

    def on_run_end(self, outcome: RunOutcome) -> None:
        raise RuntimeError("webhook gone")


def _started(c: RunController) -> None:
    c.start(at=0.0)
    for i, t in enumerate(c.names):
        c.handle(TaskStarted(t, 0, at=0.1, handle=100 + i))


def test_every_state_change_comes_from_the_controller_in_the_order_it_made_them() -> None:
    rec = Recorder()
    c = RunController(TASKS, grace_s=5, ps_exit_timeout_s=60, policy=RestartPolicy("on-failure", max_restarts=1,
                                                                                     backoff_base_s=1.0),
                      subscriber=rec)
    _started(c)
    c.handle(TaskExited("worker:1", 0, -9, at=3.0))  # restarted: attempt 1 in 1 s
    c.handle(TaskStarted("worker:1", 1, at=4.1, handle=201))
    for t in TASKS:
        c.handle(TaskExited(t, c.records[t].attempt, 0, at=9.0))
    w1 = [(ch.state, ch.attempt) for ch in rec.changes if ch.task == "worker:1"]
    assert w1 == [("started", 0), ("exited", 0), ("restarting", 1), ("started", 1), ("exited", 1)]
    restart = next(ch for ch in rec.changes if ch.state == "restarting")
    assert (restart.after_s, restart.reason) == (1.0, "killed (SIGKILL)")
    exit0 = next(ch for ch in rec.changes if ch.task == "worker:1" and ch.state == "exited")
    assert exit0.exit is not None and exit0.exit.code == -9
    assert rec.phases == ["running", "draining", "finished"]


def test_a_subscriber_that_raises_stops_none_of_the_others_and_is_logged_and_warned_once(caplog) -> None:
    broken, rec, warned = Broken(), Recorder(), []
    subs = Subscribers([broken, rec], warn=warned.append)
    c = RunController(TASKS, grace_s=5, ps_exit_timeout_s=60, subscriber=subs)
    with caplog.at_level(logging.DEBUG, logger="psflow"):
        _started(c)  # three changes: each raises in the first subscriber
        subs.on_run_end(RunOutcome("succeeded", 0, None))
    assert broken.calls == 3 and len(rec.changes) == 3 and len(rec.outcomes) == 1
    assert len(warned) == 1 and "Broken" in warned[0] and "disk full" in warned[0]
    logged = [r for r in caplog.records if "Broken" in r.getMessage()]
    assert len(logged) == 4 and all(r.exc_info for r in logged)  # each failure, with its traceback
    assert [r.levelno for r in logged] == [logging.ERROR] + [logging.DEBUG] * 3  # loud once, then quiet
    assert c.phase == "running"  # the controller never saw it


def _failed_run(c: RunController) -> None:
    """worker:1 fails with a report (as the runner feeds it: the report first); the others are stopped."""
    _started(c)
    report = {"task": "worker:1", "exception": "ValueError", "message": "loss is nan at step 41",
              "traceback": 'Traceback (most recent call last):\n  File "train.py", line 9, in step\n'
                           "ValueError: loss is nan at step 41\n", "time_unix": 5.0}
    c.handle(TaskReported("worker:1", 0, report, at=5.0))
    c.handle(TaskExited("worker:1", 0, 1, at=5.0))
    c.handle(TaskExited("worker:0", 0, -15, at=5.5))
    c.handle(TaskExited("ps:0", 0, -15, at=5.6))


def test_every_subscriber_gets_the_same_root_cause_put_in_words_once(tmp_path: Path) -> None:
    from psflow.platform import views
    from psflow.platform.jobstore import JobStore
    from psflow.platform.runalerts import RunAlerts
    from psflow.platform.runfiles import root_cause_of
    from psflow.platform.sqlrunstore import SqliteRunStore

    run_dir = RunDir(tmp_path)
    files = FileRunStore(tmp_path, "run-1", TASKS)
    record = {"id": "run-1", "script": "x.py", "args": [], "logdir": str(tmp_path), "cluster": {"ps": ["ps:0"]},
              "mode": "async", "strategy": "ps", "backend": "local", "restart_policy": {}, "launcher": None,
              "created_unix": 1.0}
    jobs = SqliteRunStore(tmp_path / "jobs.db", record, TASKS, warn=print, close_timeout_s=30.0)
    sent: list[dict] = []
    alerts = RunAlerts("run-1", "http://127.0.0.1:9/hook", db_path=tmp_path / "jobs.db", home=tmp_path, warn=print,
                       send=lambda url, body: sent.append(json.loads(body)))
    rec = Recorder()
    subs = Subscribers([files, jobs, alerts, rec], warn=print)
    c = RunController(TASKS, grace_s=5, ps_exit_timeout_s=60, subscriber=subs)
    _failed_run(c)
    assert c.result is not None and c.result.root_cause == "worker:1"
    failure = failure_in_words(c, c.result.root_cause)
    # The errors/ file is not there: the words come from the controller's record, not a re-read.
    assert not run_dir.error_report("worker:1").exists()
    assert failure is not None and failure["text"] == "worker:1: ValueError: loss is nan at step 41"
    summary = {"run_id": "run-1", "status": "failed", "root_cause": "worker:1", "failure": failure, "tasks": []}
    subs.on_run_end(RunOutcome("failed", 1, "worker:1", failure, summary))

    status = json.loads(run_dir.status.read_text())
    assert status["state"] == "failed" and status["failure"] == failure
    assert views.status_of(views.find(str(tmp_path), path=tmp_path / "jobs.db"))["failure"] == failure  # psflow status LOGDIR
    assert json.loads(run_dir.summary.read_text())["failure"] == failure
    with JobStore(tmp_path / "jobs.db", read_only=True) as db:
        run = db.run("run-1")
    assert run is not None and run["state"] == "failed" and root_cause_of(run) == failure
    causes = {t: r.exits[-1].cause for t, r in c.records.items()}  # each exit's cause, as the controller put it
    assert {t: e["exits"][-1]["cause"] for t, e in status["tasks"].items()} == causes
    assert {t: e["exit_cause"] for t, e in run["tasks"].items()} == causes
    assert [a["kind"] for a in sent] == ["failed"] and sent[0]["text"].endswith(f"root cause: {failure['text']}")
    assert rec.outcomes[0].failure == failure
    exits = [json.loads(line) for line in run_dir.events.read_text().splitlines()]
    assert [e["task"] for e in exits if e["event"] == "task_exited"] == ["worker:1", "worker:0", "ps:0"]
