"""A real `psflow run` is recorded in the job store ($PSFLOW_HOME/jobs.db), and `psflow runs`,
`psflow status RUN` and `psflow logs RUN` read it back."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from conftest import PSFLOW, ROOT, SOFTMAX, log_tails, read_summary, task_env

pytestmark = pytest.mark.timeout(300)


def psflow(home: Path, *args: str, timeout_s: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([PSFLOW, *args], capture_output=True, text=True, timeout=timeout_s,
                          env=task_env(PSFLOW_HOME=str(home), COLUMNS="200"), cwd=ROOT)


def test_a_run_is_recorded_with_its_tasks_metrics_and_logs(tmp_path):
    home, logdir = tmp_path / "home", tmp_path / "run"
    r = psflow(home, "run", "--ps", "1", "--workers", "2", "--logdir", str(logdir), SOFTMAX, "--",
               "--epochs", "1", "--init", "zeros")
    context = f"{r.stdout[-3000:]}\n{r.stderr[-2000:]}\n{log_tails(logdir)}"
    assert r.returncode == 0, context
    assert "job store" not in r.stdout + r.stderr, context  # no warning: every record was written
    summary = read_summary(logdir)

    listed = psflow(home, "runs", "--json", timeout_s=60)
    assert listed.returncode == 0, listed.stderr
    runs = json.loads(listed.stdout)
    assert [x["id"] for x in runs] == [summary["run_id"]]
    run = runs[0]
    assert run["state"] == "succeeded" and run["script"] == SOFTMAX and run["args"] == ["--epochs", "1", "--init", "zeros"]
    assert run["cluster"] == {"ps": ["ps:0"], "worker": ["worker:0", "worker:1"]} and run["backend"] == "local"
    assert run["logdir"] == str(logdir) and run["ended_unix"] >= run["started_unix"]
    assert list(run["tasks"]) == ["ps:0", "worker:0", "worker:1"]
    for name, task in run["tasks"].items():
        assert (task["state"], task["exit_code"], task["attempt"]) == ("exited", 0, 0), (name, task)
        assert task["address"].startswith("127.0.0.1:") and isinstance(task["pid"], int)
    for w in ("worker:0", "worker:1"):
        metrics = run["tasks"][w]["metrics"]
        assert {"loss", "global_step", "examples_per_sec"} <= set(metrics), metrics
    assert run["global_step"] == summary["global_step"]
    assert run["metrics"] == summary["metrics"] and "test_accuracy" in run["metrics"]

    shown = psflow(home, "status", run["id"][-6:], timeout_s=60)
    assert shown.returncode == 0 and f"psflow run {run['id']} (succeeded" in shown.stdout, shown.stdout + shown.stderr

    log = psflow(home, "logs", run["id"], "--task", "worker:1", timeout_s=60)
    assert log.returncode == 0, log.stderr
    assert log.stdout == (logdir / "logs" / "worker-1.log").read_text() and log.stdout.strip()


def _without_write_access(argv: list[str]) -> list[str]:
    """``argv`` as a user who cannot write a file its mode forbids: root keeps CAP_DAC_OVERRIDE, so as
    root it runs without it (setpriv); any other user is bound by the modes already."""
    import os
    import shutil

    if os.geteuid() != 0:
        return argv
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without setpriv: a read-only file is writable here")
    return [setpriv, "--bounding-set=-dac_override,-dac_read_search", *argv]


def test_psflow_runs_and_status_read_a_store_they_may_not_write(tmp_path):
    """Issue 23 item 2: `psflow runs` opened the store for writing (WAL mode, migrations) and failed on
    a read-only one ('attempt to write a readonly database'): another user's store, a read-only disk."""
    from psflow.platform.sqlrunstore import SqliteRunStore

    home = tmp_path / "home"
    home.mkdir()
    record = {"id": "20260101-000000-abcdef", "script": "train.py", "args": [], "logdir": str(tmp_path), "cluster": {},
              "mode": "async", "strategy": "ps", "backend": "local", "restart_policy": {}, "launcher": None,
              "created_unix": 1.0, "launch": {}}
    store = SqliteRunStore(home / "jobs.db", record, ["worker:0"], warn=print)
    store.finished("succeeded")
    for f in home.iterdir():
        f.chmod(0o444)
    home.chmod(0o555)
    try:
        env = task_env(PSFLOW_HOME=str(home), COLUMNS="200")
        listed = subprocess.run(_without_write_access([PSFLOW, "runs", "--json"]), capture_output=True, text=True,
                                timeout=60, env=env, cwd=ROOT)
        assert listed.returncode == 0, listed.stdout + listed.stderr
        assert [r["id"] for r in json.loads(listed.stdout)] == [record["id"]]
        shown = subprocess.run(_without_write_access([PSFLOW, "status", "abcdef"]), capture_output=True, text=True,
                               timeout=60, env=env, cwd=ROOT)
        assert shown.returncode == 0 and "succeeded" in shown.stdout, shown.stdout + shown.stderr
        assert sorted(p.name for p in home.iterdir()) == ["jobs.db"]  # nothing written beside it
    finally:
        home.chmod(0o755)
