"""The root cause in words (issue 25, item 2): a failed run's exception, message and the tail of its
traceback, read from the root task's error report (``LOGDIR/errors/worker-1.json``), on the run
page (``GET /api/runs/{run}``'s ``failure``), in the alerts (each run's launcher tells them) and
in ``psflow status``; a task that left no report is said by its exit. A real job store throughout."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

from rich.console import Console

from psflow import errorreport


def _innermost(value: float) -> float:
    raise ValueError(f"loss is nan at step 41 (value {value})")


def _middle(value: float) -> float:
    return _innermost(value) * 2


def _outermost() -> BaseException:
    try:
        _middle(float("nan"))
    except ValueError as e:
        return e
    raise AssertionError("no exception")


def _report(task: str = "worker:1") -> dict:
    return errorreport.build(task, _outermost())


def test_the_root_cause_in_words_is_the_exception_its_message_and_its_tracebacks_innermost_frames():
    words = errorreport.describe_root_cause("worker:1", _report(), "exit code 1")
    assert words["task"] == "worker:1" and words["exception"] == "ValueError"
    assert words["message"] == "loss is nan at step 41 (value nan)"
    assert words["text"] == "worker:1: ValueError: loss is nan at step 41 (value nan)"
    tail = words["traceback_tail"]
    assert "in _innermost" in tail and "in _middle" in tail and tail.endswith("ValueError: loss is nan at step 41 (value nan)")
    assert "Traceback (most recent call last)" not in tail  # the tail, not the whole


def test_a_task_without_a_report_is_said_by_its_exit_and_a_finding_is_said_as_it_is():
    killed = errorreport.describe_root_cause("worker:1", None, "killed (SIGKILL)")
    assert killed["exception"] is None and killed["text"].startswith("worker:1: killed (SIGKILL); it left no error report")
    finding = "ps shard 1's copies disagree: version 40 against 41"
    assert errorreport.describe_root_cause(finding) == {"task": None, "exception": None, "message": finding,
                                                        "traceback_tail": "", "text": finding}
    assert errorreport.describe_root_cause(None) is None
    chained = "Traceback (most recent call last):\n  File \"a.py\", line 1, in f\nKeyError: 'x'\n\nDuring handling " \
              "of the above exception, another exception occurred:\n\nTraceback (most recent call last):\n" \
              "  File \"a.py\", line 9, in g\n    raise ValueError('y')\nValueError: y\n"
    assert errorreport.traceback_tail(chained, frames=1) == "  File \"a.py\", line 9, in g\n    raise ValueError('y')\nValueError: y"


def _failed_run(tmp_path: Path, *, report: bool = True) -> Path:
    """A run recorded as the launcher records it: worker:1 failed (its report in LOGDIR/errors), worker:0 stopped."""
    from psflow.platform.sqlrunstore import SqliteRunStore

    logdir = tmp_path / "run"
    (logdir / "logs").mkdir(parents=True)
    tasks = ["ps:0", "worker:0", "worker:1"]
    for t in tasks:
        (logdir / "logs" / f"{t.replace(':', '-')}.log").write_text(f"{t} log\n")
    if report:
        errorreport.write(errorreport.path_for(logdir / "errors", "worker:1"), "worker:1", _outermost())
    record = {"id": "run-x", "script": "x.py", "args": [], "logdir": str(logdir), "cluster": {"ps": ["ps:0"],
              "worker": ["worker:0", "worker:1"]}, "mode": "async", "strategy": "ps", "backend": "local",
              "restart_policy": {}, "launcher": None, "created_unix": 1.0}
    store = SqliteRunStore(tmp_path / "jobs.db", record, tasks, warn=print)
    for t in tasks:
        store.task_started(t, 0, 100)
    now = time.time()
    store.task_exited("worker:1", 0, 1 if report else -9, now)
    store.task_exited("worker:0", 0, -15, now + 0.1)
    store.task_exited("ps:0", 0, -15, now + 0.1)
    store.summary({"status": "failed", "root_cause": "worker:1", "tasks": []})
    store.finished("failed")
    return logdir


def test_the_run_page_says_the_root_causes_exception_message_and_traceback(tmp_path):
    from fastapi.testclient import TestClient

    from psflow.platform.api import UiSettings, create_app

    _failed_run(tmp_path)
    client = TestClient(create_app(UiSettings(home=tmp_path, token="t")), base_url="http://127.0.0.1")
    run = client.get("/api/runs/run-x").json()["run"]
    failure = run["failure"]
    assert failure["task"] == "worker:1" and failure["exception"] == "ValueError", failure
    assert failure["message"] == "loss is nan at step 41 (value nan)" and "in _innermost" in failure["traceback_tail"]
    stream = client.get("/api/runs/run-x/stream").text  # the live page carries it too
    assert '"exception":"ValueError"' in stream.split("event: run\n", 1)[1].split("\n\n")[0]


def test_the_run_page_says_how_a_task_without_a_report_ended_and_never_reads_outside_the_run(tmp_path):
    from fastapi.testclient import TestClient

    from psflow.platform.api import UiSettings, create_app

    logdir = _failed_run(tmp_path, report=False)
    client = TestClient(create_app(UiSettings(home=tmp_path, token="t")), base_url="http://127.0.0.1")
    failure = client.get("/api/runs/run-x").json()["run"]["failure"]
    assert failure["exception"] is None and failure["text"].startswith("worker:1: killed (SIGKILL)"), failure
    outside = tmp_path / "secret.json"
    outside.write_text(json.dumps({"exception": "Secret", "message": "not the run's"}))
    (logdir / "errors").mkdir()
    (logdir / "errors" / "worker-1.json").symlink_to(outside)  # planted: leads out of the run's directory
    assert client.get("/api/runs/run-x").json()["run"]["failure"]["exception"] is None


def test_the_launchers_failure_alert_says_the_exception(tmp_path):
    from psflow.platform.runalerts import RunAlerts

    logdir = tmp_path / "run"
    errorreport.write(errorreport.path_for(logdir / "errors", "worker:1"), "worker:1", _outermost())
    sent: list[dict] = []
    store = RunAlerts("run-y", "http://127.0.0.1:9/hook", db_path=tmp_path / "jobs.db", home=tmp_path,
                      warn=lambda m: None, send=lambda url, body: sent.append(json.loads(body)))  # run-y is in no store: told anyway
    store.summary({"root_cause": "worker:1", "tasks": [{"task": "worker:1", "cause": "exit code 1",
                                                         "log": str(logdir / "logs" / "worker-1.log")}]})
    store.finished("failed")
    assert [b["text"] for b in sent] == ["psflow: run run-y failed; root cause: worker:1: ValueError: loss is nan at step 41 (value nan)"]
    assert sent[0]["detail"]["exception"] == "ValueError" and "in _innermost" in sent[0]["detail"]["traceback_tail"]
    assert sent[0]["task"] == "worker:1" and sent[0]["detail"]["root_cause"] == "worker:1"


def _printed(state: dict) -> str:
    from psflow.launch.status import render

    buf = io.StringIO()
    Console(file=buf, width=160, color_system=None).print(render(state))
    return buf.getvalue()


def test_psflow_status_says_the_root_cause_in_words_by_run_id_and_by_logdir(tmp_path, monkeypatch):
    from psflow.platform import views

    logdir = _failed_run(tmp_path)
    out = _printed(views.status_of(views.find("run-x", path=tmp_path / "jobs.db")))
    assert "root cause: worker:1: ValueError: loss is nan at step 41 (value nan)" in out, out
    assert "in _innermost" in out
    # by its logdir: status.json for the tasks, summary.json for the root cause
    (logdir / "status.json").write_text(json.dumps({"run_id": "run-x", "state": "failed", "mode": "async", "tasks": {
        "worker:1": {"state": "exited", "exit_code": 1, "exits": [{"attempt": 0, "code": 1, "cause": "exit code 1"}]}}}))
    (logdir / "summary.json").write_text(json.dumps({"status": "failed", "root_cause": "worker:1"}))
    out = _printed(views.status_of(views.find(str(logdir), path=tmp_path / "jobs.db")))
    assert "root cause: worker:1: ValueError: loss is nan at step 41 (value nan)" in out and "in _innermost" in out
    (logdir / "summary.json").unlink()  # still running, or no summary: no root cause line
    assert "root cause" not in _printed(views.status_of(views.find(str(logdir), path=tmp_path / "jobs.db")))
