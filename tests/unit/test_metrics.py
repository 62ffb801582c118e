"""Unit tests of psflow.launch.metrics: one definition of the rate, the script's metrics as named."""

from __future__ import annotations

from psflow.launch.controller import ExitRecord, TaskRecord
from psflow.launch.metrics import (
    final_line,
    job_rate,
    run_metrics,
    task_metrics,
    trainer_figures,
)
from psflow.launch.plan import make_plan
from psflow.launch.status import RunStatus
from psflow.launch.summary import build_summary

TASKS = ["ps:0", "worker:0", "worker:1"]


def _summary(tmp_path, reports: dict, *, stopped_by: str | None = None) -> dict:
    (tmp_path / "train.py").write_text("")
    plan = make_plan(str(tmp_path / "train.py"), num_ps=1, num_workers=2, logdir=str(tmp_path))
    records = {t: TaskRecord(t, state="exited", handle=100 + i, exits=[ExitRecord(0, 0, 9.0, stopped=False)])
               for i, t in enumerate(TASKS)}
    return build_summary(plan, reports, {}, records, 9.0, "stopped" if stopped_by else "succeeded", None)


def _replay(tmp_path, events: list[tuple[str, dict]]) -> tuple[dict, dict]:
    """The same reports, seen by the live status and merged as the coordinator merges them."""
    status = RunStatus("run-1", TASKS, tmp_path / "status")
    (tmp_path / "status").mkdir()
    reports: dict[str, dict] = {}
    for task, metrics in events:
        status.on_event("report", {"task": task, "metrics": metrics})
        reports.setdefault(task, {}).update(metrics)
    return status.snapshot(), reports


def test_job_rate_is_every_tasks_examples_over_the_longest_time():
    assert job_rate([{"examples": 3000, "wall_time_s": 2.0}, {"examples": 2000, "wall_time_s": 2.5}]) == 2000.0
    assert job_rate([{"global_step": 5}, {"examples": 10, "wall_time_s": 0.0}]) == 0.0  # nothing trained yet
    assert job_rate([]) == 0.0
    # the headline takes the wall-clock time, the step rate the time inside the steps
    figures = [{"examples": 3000, "train_time_s": 1.0, "wall_time_s": 2.0}, {"examples": 3000, "train_time_s": 1.5, "wall_time_s": 2.5}]
    assert (job_rate(figures), job_rate(figures, "train_time_s")) == (2400.0, 4000.0)


def test_status_headline_and_summary_give_the_same_rate_for_the_same_run(tmp_path):
    # Two workers at different speeds: summing their own rates (old headline) gave 1,500 + 800 = 2,300.
    events = [
        ("worker:0", {"progress": {"global_step": 10, "examples": 1500, "train_time_s": 0.5, "wall_time_s": 1.0,
                                   "examples_per_sec": 1500.0}}),
        ("worker:1", {"progress": {"global_step": 12, "examples": 1600, "train_time_s": 1.0, "wall_time_s": 2.0,
                                   "examples_per_sec": 800.0}}),
        ("worker:0", {"trainer": {"global_step": 40, "examples": 3000, "train_time_s": 1.0, "wall_time_s": 2.0,
                                  "examples_per_sec": 1500.0}}),
        ("worker:1", {"trainer": {"global_step": 40, "examples": 3000, "train_time_s": 1.5, "wall_time_s": 3.75,
                                  "examples_per_sec": 800.0}}),
        ("ps:0", {"global_step": 40, "ps_stats": {"pushes": 60}}),
    ]
    snapshot, reports = _replay(tmp_path, events)
    summary = _summary(tmp_path, reports)
    assert summary["examples_per_sec"] == snapshot["examples_per_sec"] == 1600.0  # 6,000 examples / 3.75 s of wall clock
    assert summary["step_examples_per_sec"] == snapshot["step_examples_per_sec"] == 4000.0  # / 1.5 s inside the steps
    assert summary["examples"] == 6000
    assert "examples/sec=1600.0" in final_line(summary)


def test_a_stopped_run_reports_the_rate_it_trained_at_from_the_last_progress(tmp_path):
    # Ctrl-C / SIGTERM: the workers died without their final report.
    events = [
        ("worker:0", {"progress": {"global_step": 22000, "examples": 1_100_000, "train_time_s": 5.0, "wall_time_s": 10.0}}),
        ("worker:1", {"progress": {"global_step": 21990, "examples": 1_099_000, "train_time_s": 5.0, "wall_time_s": 10.0}}),
    ]
    snapshot, reports = _replay(tmp_path, events)
    summary = _summary(tmp_path, reports, stopped_by="SIGTERM")
    assert summary["status"] == "stopped" and summary["global_step"] == 22000
    assert summary["examples_per_sec"] == snapshot["examples_per_sec"] == 219900.0
    assert summary["examples"] == 2_199_000


def test_final_report_wins_over_progress():
    reports = {"worker:0": {"progress": {"examples": 5, "train_time_s": 1.0},
                            "trainer": {"examples": 50, "train_time_s": 2.0}},
               "ps:0": {"progress": {"global_step": 3}}}
    assert trainer_figures(reports) == {"worker:0": {"examples": 50, "train_time_s": 2.0}}


def test_the_scripts_metrics_keep_their_names_and_psflows_reports_are_not_metrics():
    report = {"test_mse": 0.0123, "r2": 0.97, "epochs": 3, "nan_metric": float("nan"),
              "trainer": {"examples": 5}, "global_step": 9, "supervisor": {"x": 1}, "note": "text", "ok": True,
              "params": [1.0, 2.0], "eval": {"step": 200, "accuracy": 0.91}}
    m = task_metrics(report)
    assert set(m) == {"test_mse", "r2", "epochs", "nan_metric", "eval/step", "eval/accuracy"}
    assert m["test_mse"] == 0.0123 and m["eval/accuracy"] == 0.91


def test_run_metrics_are_the_chiefs_then_names_only_others_reported():
    by_task = {"worker:1": {"test_mse": 0.5, "extra": 1}, "worker:0": {"test_mse": 0.1},
               "evaluator:0": {"eval/mse": 0.2}}
    assert run_metrics(by_task, "worker:0") == {"test_mse": 0.1, "eval/mse": 0.2, "extra": 1}
    assert run_metrics({}, "worker:0") == {}


def test_summary_and_final_line_carry_a_regression_scripts_metrics_not_test_accuracy(tmp_path):
    reports = {"worker:0": {"test_mse": 0.012345678, "trainer": {"examples": 100, "train_time_s": 1.0}},
               "worker:1": {"test_mse": 0.02, "trainer": {"examples": 100, "train_time_s": 1.0}}}
    s = _summary(tmp_path, reports)
    assert s["metrics"] == {"test_mse": 0.012345678}
    assert s["metrics_by_task"] == {"worker:0": {"test_mse": 0.012345678}, "worker:1": {"test_mse": 0.02}}
    assert "test_accuracy" not in s
    line = final_line(s)
    assert "test_mse=0.0123457" in line and "test_accuracy" not in line


def test_a_classifier_keeps_test_accuracy(tmp_path):
    reports = {"worker:1": {"test_accuracy": 0.91}, "worker:0": {"test_accuracy": 0.92}}
    s = _summary(tmp_path, reports)
    assert s["test_accuracy"] == 0.92 and s["test_accuracy_by_task"] == {"worker:1": 0.91, "worker:0": 0.92}
    assert "test_accuracy=0.92 " in final_line(s)


def test_a_run_that_succeeded_without_a_training_step_says_it_trained_0_steps(tmp_path):
    """Issue 23 item 6: a script that exits 0 without a step (a loop over no data) read as a success."""
    s = _summary(tmp_path, {"worker:0": {"trainer": {"local_step": 0, "examples": 0, "train_time_s": 0.0}},
                            "ps:0": {"global_step": 0}})
    assert s["trained_steps"] == 0
    assert final_line(s).startswith("psflow: succeeded: trained 0 steps (no task took a training step: see its log) "
                                    "global_step=0 ")
    trained = _summary(tmp_path, {"worker:0": {"trainer": {"local_step": 3, "examples": 30, "train_time_s": 1.0}}})
    assert trained["trained_steps"] == 3 and "trained 0 steps" not in final_line(trained)


def test_a_run_whose_tasks_reported_nothing_to_the_launcher_says_so_not_0_steps(tmp_path):
    """On Kubernetes the pods report to no coordinator: the launcher has no figures, which is not "trained 0 steps"."""
    s = _summary(tmp_path, {})
    assert s["trained_steps"] is None
    line = final_line(s)
    assert "trained 0 steps" not in line and "no task's figures reached the launcher" in line, line

