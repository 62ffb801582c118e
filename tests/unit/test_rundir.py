"""RunDir: one place names every path of a run's log directory, and the task-id-to-file-name rule."""

from __future__ import annotations

from pathlib import Path

import pytest

from psflow import errorreport
from psflow.launch.controller import TaskRecord
from psflow.launch.plan import make_plan
from psflow.launch.summary import task_entry
from psflow.rundir import RunDir, task_of_stem, task_stem
from psflow.summary import summary_dir
from psflow.train.ledger import PushLedger, read_ledgers


@pytest.mark.parametrize("task", ["worker:1", "ps:0", "chief:0", "evaluator:0", "worker:12"])
def test_a_task_id_and_its_file_name_convert_both_ways(task: str) -> None:
    assert ":" not in task_stem(task)
    assert task_of_stem(task_stem(task)) == task


def test_every_path_of_a_run(tmp_path: Path) -> None:
    d = RunDir(tmp_path)
    assert d == RunDir(str(tmp_path))  # a value: compared by its path
    assert d.status == tmp_path / "status.json"
    assert d.summary == tmp_path / "summary.json"
    assert d.events == tmp_path / "events.jsonl"
    assert d.secret == tmp_path / ".secret"
    assert d.done == tmp_path / "DONE"
    assert d.log("worker:1") == tmp_path / "logs" / "worker-1.log"
    assert d.error_report("ps:0") == tmp_path / "errors" / "ps-0.json"
    assert d.checkpoint("ckpt-0000000600") == tmp_path / "checkpoints" / "ckpt-0000000600"
    assert d.summaries_of("worker:0") == tmp_path / "summaries" / "worker-0"
    assert d.ledger_of("worker:2", 1) == tmp_path / "ledger" / "worker-2.1"
    assert d.timeline_of("chief:0", 3) == tmp_path / "timeline" / "chief-0.3.json"
    assert d.trace == tmp_path / "timeline.json"


def test_logged_tasks_are_read_back_from_the_log_names(tmp_path: Path) -> None:
    d = RunDir(tmp_path)
    assert d.logged_tasks() == []  # no logs/ yet
    d.logs.mkdir()
    for t in ("worker:1", "ps:0", "chief:0"):
        d.log(t).write_text("")
    (d.logs / "forkserver.log").write_text("")  # not a task's
    assert d.logged_tasks() == ["chief:0", "ps:0", "worker:1"]


def test_the_launcher_the_tasks_and_the_readers_agree_on_the_paths(tmp_path: Path) -> None:
    """Who writes a file and who reads it name it through RunDir: the plan's error file, the summary's
    log, the TensorBoard dir, the push ledger."""
    d = RunDir(tmp_path)
    script = tmp_path / "train.py"
    script.write_text("")
    plan = make_plan(str(script), num_ps=1, num_workers=2, logdir=str(tmp_path), python="python")
    env = dict(plan.tasks[1].env)
    assert env["PSFLOW_ERROR_FILE"] == str(d.error_report(plan.tasks[1].task))
    assert errorreport.path_for(d.errors, "worker:1") == d.error_report("worker:1")
    assert task_entry(plan, TaskRecord("worker:1"), None)["log"] == str(d.log("worker:1"))
    assert summary_dir(tmp_path, "worker:1") == d.summaries_of("worker:1")
    ledger = PushLedger(tmp_path, "worker:1", 1, 0)
    assert ledger.path == d.ledger_of("worker:1", 0)
    ledger.step_sent()
    ledger.close()
    assert [(e.task, e.attempt, e.sent) for e in read_ledgers(tmp_path)] == [("worker:1", 0, 1)]
