"""Scale requests through the job store (psflow.platform.runcontrol.ask_scale): a bad count, an
ended run, and a backend whose tasks are fixed are refused by name before anything is asked; a good
one is written for the launcher; added and retired tasks are recorded. Real SQLite files."""

from __future__ import annotations

import os
import time

import pytest

from psflow.launch.liveness import process_identity
from psflow.platform.jobstore import JobStore
from psflow.platform.runcontrol import ScaleRefused, ask_scale
from psflow.platform.sqlrunstore import SqliteRunStore

TASKS = ["ps:0", "worker:0", "worker:1"]


def _store(path, backend: str = "local") -> SqliteRunStore:
    record = {"id": "run-1", "script": "examples/mnist_softmax.py", "args": [], "logdir": "/tmp/runs/x",
              "cluster": {"ps": ["ps:0"], "worker": ["worker:0", "worker:1"]}, "mode": "async", "strategy": "ps",
              "backend": backend, "restart_policy": {}, "launcher": process_identity(os.getpid()),
              "created_unix": time.time()}
    store = SqliteRunStore(path, record, TASKS, warn=print, control_poll_s=0.05)
    end = time.monotonic() + 20
    while time.monotonic() < end:  # the run's row is written by the store's own thread
        with JobStore(path) as db:
            if db.run("run-1", metrics=False) is not None:
                return store
        time.sleep(0.02)
    raise AssertionError("the run's row was not written within 20 s")


def _until(check, what: str, deadline_s: float = 20.0):
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        value = check()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"{what} not within {deadline_s} s")


def test_a_good_count_is_asked_and_bad_ones_are_refused_by_name(tmp_path):
    path = tmp_path / "jobs.db"
    store = _store(path)
    try:
        store.task_started("worker:0", 0, None)
        with JobStore(path) as db:
            for bad in (0, 257, "3", True):
                with pytest.raises(ScaleRefused, match=rf"integer from 1 to 256 \(the run has 2 now\)\. Received: {bad!r}"):
                    ask_scale(db, "run-1", bad, source="cli")
            assert db.controls("run-1") == []
            rid = ask_scale(db, "run-1", 3, source="api")
        (taken,) = _until(store.control_requests, "the request taken")
        assert (taken.id, taken.kind, dict(taken.payload), taken.source) == (rid, "scale", {"workers": 3}, "api")
        store.tasks_added(["worker:2"])
        store.task_retired("worker:1")
        tasks = _until(lambda: _tasks(path) if "worker:2" in _tasks(path) and _tasks(path)["worker:1"] == "retired" else None,
                       "the added and retired tasks recorded")
        assert tasks == {"ps:0": "pending", "worker:0": "starting", "worker:1": "retired", "worker:2": "pending"}
    finally:
        store.finished("succeeded")
    with JobStore(path) as db, pytest.raises(ScaleRefused, match="has already ended .*only a running run can be scaled"):
        ask_scale(db, "run-1", 2, source="cli")


@pytest.mark.parametrize("backend,why", [("k8s", "replica counts are fixed")])
def test_a_backend_that_cannot_scale_is_refused_saying_why_and_what_to_do(tmp_path, backend, why):
    path = tmp_path / "jobs.db"
    store = _store(path, backend)
    try:
        store.task_started("worker:0", 0, None)
        with JobStore(path) as db, pytest.raises(ScaleRefused) as e:
            ask_scale(db, "run-1", 3, source="cli")
        assert why in str(e.value) and "Stop it (`psflow stop run-1`) and start it again with --workers 3" in str(e.value)
    finally:
        store.finished("stopped")


def _tasks(path) -> dict[str, str]:
    with JobStore(path) as db:
        run = db.run("run-1", metrics=False)
    return {t: v["state"] for t, v in run["tasks"].items()}
