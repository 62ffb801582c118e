"""`psflow runs`, `psflow status RUN` and `psflow logs RUN` over a real job store (runs written by the
run store, as the launcher writes them)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from click.testing import CliRunner

from psflow.cli import main
from psflow.launch.liveness import process_identity
from psflow.platform.sqlrunstore import SqliteRunStore
from psflow.platform.views import follow

TASKS = ["ps:0", "worker:0", "worker:1"]


def _run(home: Path, run_id: str, state: str | None, *, logdir: Path, step: int = 40) -> None:
    """Record a run in ``home``'s job store, with task logs in ``logdir``; ``state`` None: still running."""
    (logdir / "logs").mkdir(parents=True, exist_ok=True)
    for t in TASKS:
        (logdir / "logs" / f"{t.replace(':', '-')}.log").write_text(f"{t} line 1\n{t} line 2\n")
    record = {"id": run_id, "script": "examples/mnist_softmax.py", "args": ["--epochs", "1"], "logdir": str(logdir),
              "cluster": {"ps": ["ps:0"], "worker": ["worker:0", "worker:1"]}, "mode": "async", "strategy": "ps",
              "backend": "local", "restart_policy": {"kind": "never"}, "launcher": process_identity(os.getpid()),
              "created_unix": time.time()}
    store = SqliteRunStore(home / "jobs.db", record, TASKS, warn=lambda m: None)
    for t in TASKS:
        store.task_started(t, 0, os.getpid())
        store.task_registered(t, "127.0.0.1:1")
    for w in ("worker:0", "worker:1"):
        store.report(w, {"progress": {"global_step": step, "loss": 0.25, "examples": 4000, "train_time_s": 1.0, "wall_time_s": 2.0,
                                      "examples_per_sec": 2000.0}})
    if state is None:
        store.close()
        return
    for t in TASKS:
        store.task_exited(t, 0, 0, time.time())
    store.summary({"run_id": run_id, "status": state, "root_cause": None, "metrics": {"test_accuracy": 0.9}})
    store.finished(state)


def _cli(home: Path, *args: str):
    return CliRunner().invoke(main, list(args), env={"PSFLOW_HOME": str(home), "COLUMNS": "200"})


def test_runs_lists_the_recorded_runs_as_a_table_and_as_json(tmp_path):
    _run(tmp_path, "20250101-000000-aaaaaa", "failed", logdir=tmp_path / "a")
    _run(tmp_path, "20250102-000000-bbbbbb", "succeeded", logdir=tmp_path / "b", step=80)
    r = _cli(tmp_path, "runs")
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    b_row = next(line for line in lines if "20250102-000000-bbbbbb" in line)
    assert "succeeded" in b_row and "step 80" in b_row and "4,000" in b_row and "mnist_softmax.py --epochs 1" in b_row
    assert r.output.index("bbbbbb") < r.output.index("aaaaaa")  # newest first
    r = _cli(tmp_path, "runs", "--json", "--state", "succeeded")
    assert r.exit_code == 0, r.output
    runs = json.loads(r.output)
    assert [x["id"] for x in runs] == ["20250102-000000-bbbbbb"]
    assert runs[0]["state"] == "succeeded" and list(runs[0]["tasks"]) == TASKS
    assert runs[0]["tasks"]["worker:1"]["metrics"]["loss"] == 0.25 and runs[0]["metrics"] == {"test_accuracy": 0.9}


def test_runs_on_a_machine_without_a_job_store_says_there_are_none(tmp_path):
    r = _cli(tmp_path / "fresh", "runs")
    assert r.exit_code == 0 and "no runs recorded" in r.output
    assert not (tmp_path / "fresh").exists()  # reading creates nothing


def test_runs_with_a_corrupt_store_is_one_clear_error(tmp_path):
    (tmp_path / "jobs.db").write_bytes(b"\x00garbage" * 500)
    r = _cli(tmp_path, "runs")
    assert r.exit_code == 1
    assert f"{tmp_path / 'jobs.db'} is not a readable SQLite database" in r.output and "mv " in r.output
    assert "Traceback" not in r.output


def test_status_takes_a_run_id_or_a_unique_part_of_it(tmp_path):
    _run(tmp_path, "20250101-000000-aaaaaa", "succeeded", logdir=tmp_path / "a")
    for ref in ("20250101-000000-aaaaaa", "aaaaaa"):
        r = _cli(tmp_path, "status", ref)
        assert r.exit_code == 0, r.output
        assert "psflow run 20250101-000000-aaaaaa (succeeded, async)" in r.output
        assert all(t in r.output for t in TASKS) and "done" in r.output


def test_status_of_an_unknown_run_says_where_it_looked(tmp_path):
    r = _cli(tmp_path, "status", "no-such-run")
    assert r.exit_code == 1
    assert "No run 'no-such-run'" in r.output and str(tmp_path / "jobs.db") in r.output and "psflow runs" in r.output


def test_logs_prints_one_tasks_log_or_every_tasks_prefixed(tmp_path):
    _run(tmp_path, "20250101-000000-aaaaaa", "succeeded", logdir=tmp_path / "a")
    r = _cli(tmp_path, "logs", "aaaaaa", "--task", "worker:1")
    assert r.exit_code == 0, r.output
    assert r.output == "worker:1 line 1\nworker:1 line 2\n"
    r = _cli(tmp_path, "logs", "aaaaaa")
    assert r.exit_code == 0, r.output
    assert "ps:0 | ps:0 line 1" in r.output and "worker:0 | worker:0 line 2" in r.output


def test_logs_of_a_task_the_run_does_not_have_names_its_tasks(tmp_path):
    _run(tmp_path, "20250101-000000-aaaaaa", "succeeded", logdir=tmp_path / "a")
    r = _cli(tmp_path, "logs", "aaaaaa", "--task", "worker:7")
    assert r.exit_code == 1 and "worker:7" in r.output and "ps:0, worker:0, worker:1" in r.output


def test_logs_follow_of_an_ended_run_prints_the_log_and_returns(tmp_path):
    _run(tmp_path, "20250101-000000-aaaaaa", "stopped", logdir=tmp_path / "a")
    r = _cli(tmp_path, "logs", "aaaaaa", "--task", "ps:0", "-f")
    assert r.exit_code == 0, r.output
    assert r.output == "ps:0 line 1\nps:0 line 2\n"


def test_follow_prints_what_comes_until_the_run_ends_and_then_the_rest(tmp_path):
    log = tmp_path / "worker-0.log"
    log.write_text("first\nhalf")
    checks = []

    def over() -> bool:  # the run writes more between polls, then ends (its last line unfinished)
        checks.append(1)
        if len(checks) == 2:
            with log.open("a") as f:
                f.write(" a line\nlast words")
        return len(checks) >= 3

    out: list[str] = []
    follow([("worker:0", log)], over, out.append, prefix=False, poll_s=0.0)
    assert out == ["first", "half a line", "last words"] and len(checks) == 3


def test_status_by_id_shows_each_restart_as_the_launchers_status_does(tmp_path):
    logdir = tmp_path / "a"
    (logdir / "logs").mkdir(parents=True)
    record = {"id": "20250101-000000-cccccc", "script": "s.py", "logdir": str(logdir), "mode": "async",
              "launcher": process_identity(os.getpid()), "created_unix": time.time()}
    store = SqliteRunStore(tmp_path / "jobs.db", record, TASKS, warn=lambda m: None)
    for t in TASKS:
        store.task_started(t, 0, os.getpid())
    store.task_exited("worker:1", 0, -9, time.time())
    store.task_restarting("worker:1", 1, 0.5, "killed (SIGKILL)")
    store.task_started("worker:1", 1, os.getpid())
    for t in TASKS:
        store.task_exited(t, 1 if t == "worker:1" else 0, 0, time.time())
    store.finished("succeeded")
    r = _cli(tmp_path, "status", "cccccc")
    assert r.exit_code == 0, r.output
    assert "attempt" in r.output and "worker:1 attempt 0: killed (SIGKILL) after" in r.output and "; restarted" in r.output


def test_the_runs_table_folds_only_the_script_to_a_terminals_width_and_keeps_whole_rows_when_piped():
    from psflow.platform.views import runs_text

    runs = [{"id": f"2026-run-{i}", "state": "succeeded", "global_step": 1200 * i, "examples_per_sec": 51234.5,
             "created_unix": 1.7e9, "script": "examples/a_script_with_a_rather_long_name.py", "args": ["--epochs", "3"]}
            for i in range(3)]
    piped = runs_text(runs).splitlines()
    assert len(piped) == 2 + 3 and piped[0].split() == ["id", "state", "progress", "examples/s", "started", "script"]
    assert piped[2].split()[:5] == ["2026-run-0", "succeeded", "step", "0", "51,234"]
    assert piped[4].endswith("examples/a_script_with_a_rather_long_name.py --epochs 3")
    narrow = runs_text(runs, width=100).splitlines()
    assert max(len(line) for line in narrow) <= 100 and len(narrow) > 5
    start = piped[0].index("script")
    folded = "".join(line[start:] for line in narrow[2:2 + (len(narrow) - 2) // 3])
    assert folded == "examples/a_script_with_a_rather_long_name.py --epochs 3"
