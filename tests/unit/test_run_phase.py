"""A run's phase (running, draining, stopping, finished) is recorded by its stores as the controller
changes it: status.json's ``phase`` and an events.jsonl line, the job store's row and events; psflow
status (launch.status.render, its one renderer) says ``draining`` or ``stopping`` while the run is in it."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from rich.console import Console as RichConsole

from psflow.launch.controller import RunController, StopRequested, TaskExited, TaskStarted
from psflow.launch.liveness import process_identity
from psflow.launch.runstore import FileRunStore
from psflow.launch.status import render
from psflow.launch.subscribers import Subscribers
from psflow.platform import views
from psflow.platform.jobstore import JobStore, JobStoreError
from psflow.platform.sqlrunstore import SqliteRunStore
from psflow.rundir import RunDir

TASKS = ["ps:0", "worker:0", "worker:1"]
RECORD = {"id": "run-1", "script": "x.py", "args": [], "cluster": {"ps": ["ps:0"], "worker": ["worker:0", "worker:1"]},
          "mode": "async", "strategy": "ps", "backend": "local", "restart_policy": {},
          "launcher": process_identity(os.getpid()), "created_unix": 1.0}  # this process: a live run


def _text(state: dict) -> str:
    console = RichConsole(width=200, record=True, file=open("/dev/null", "w"))  # noqa: SIM115 (closed with the console)
    console.print(render(state))
    return console.export_text()


def _stores(tmp_path: Path) -> tuple[RunController, SqliteRunStore]:
    files = FileRunStore(tmp_path, "run-1", TASKS)
    jobs = SqliteRunStore(tmp_path / "jobs.db", {**RECORD, "logdir": str(tmp_path)}, TASKS, warn=print)
    c = RunController(TASKS, grace_s=5, ps_exit_timeout_s=60, subscriber=Subscribers([files, jobs], warn=print))
    c.start(at=0.0)
    for i, t in enumerate(TASKS):
        c.handle(TaskStarted(t, 0, at=0.1, handle=100 + i))
    return c, jobs


def _job_store_phase(tmp_path: Path, want: str) -> dict:
    """The run as the job store has it, once its writer thread recorded ``want`` (5 s at most)."""
    deadline = time.monotonic() + 5.0
    while True:
        try:
            with JobStore(tmp_path / "jobs.db", read_only=True) as db:
                run = db.run("run-1", metrics=False)
        except JobStoreError:  # its writer thread has not made it yet
            run = None
        if run is not None and run.get("phase") == want or time.monotonic() > deadline:
            return run or {}
        time.sleep(0.02)


def test_a_drain_is_recorded_by_every_store_and_said_by_psflow_status(tmp_path: Path) -> None:
    c, jobs = _stores(tmp_path)
    for t in ("worker:0", "worker:1"):
        c.handle(TaskExited(t, 0, 0, at=2.0))
    assert c.phase == "draining"  # the workers are done; the ps has ps_exit_timeout_s to exit
    status = json.loads(RunDir(tmp_path).status.read_text())
    assert (status["state"], status["phase"]) == ("running", "draining")
    assert "psflow run run-1 (draining, async)" in _text(views.status_of(views.find(str(tmp_path))))
    run = _job_store_phase(tmp_path, "draining")
    assert (run["state"], run["phase"]) == ("running", "draining")
    by_id = views.status_of(views.find("run-1", path=tmp_path / "jobs.db"))
    assert "psflow run run-1 (draining, async)" in _text(by_id)

    c.handle(TaskExited("ps:0", 0, 0, at=2.5))
    jobs.finished("succeeded")  # the run's end (waits for the writer)
    phases = [e["phase"] for e in map(json.loads, RunDir(tmp_path).events.read_text().splitlines())
              if e["event"] == "run_phase"]
    assert phases == ["running", "draining", "finished"]
    with JobStore(tmp_path / "jobs.db", read_only=True) as db:
        assert [e["data"]["phase"] for e in db.events("run-1") if e["kind"] == "run_phase"] == phases
        assert db.run("run-1", metrics=False)["phase"] == "finished"


def test_a_stop_is_said_stopping_until_the_run_has_ended(tmp_path: Path) -> None:
    c, jobs = _stores(tmp_path)
    c.handle(StopRequested("Ctrl-C", at=1.0))
    assert "psflow run run-1 (stopping, async)" in _text(views.status_of(views.find(str(tmp_path))))
    assert _job_store_phase(tmp_path, "stopping")["phase"] == "stopping"
    for t in TASKS:
        c.handle(TaskExited(t, 0, -15, at=1.5))
    jobs.finished("stopped")
    FileRunStore.finished(c.subscriber.subscribers[0], "stopped")
    text = _text(views.status_of(views.find(str(tmp_path))))
    assert "psflow run run-1 (stopped, async)" in text  # the phase says only while the run is live
