"""What a run leaves behind, through the real launcher: metrics as the script named them, one rate
everywhere (also for a stopped run), TensorBoard scalars for every worker without a Supervisor."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import PSFLOW, ROOT, log_tails, read_summary, run_psflow, task_env

pytestmark = pytest.mark.timeout(300)

REGRESSION = str(ROOT / "tests" / "integration" / "scripts" / "regression.py")


def _scalars(logdir: Path, task: str) -> dict[str, list]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir / "summaries" / task.replace(":", "-")))
    acc.Reload()
    return {tag: acc.Scalars(tag) for tag in acc.Tags()["scalars"]}


@pytest.fixture(scope="module")
def regression_run(tmp_path_factory):
    logdir = tmp_path_factory.mktemp("regression") / "run"
    r = run_psflow(["run", "--ps", "1", "--workers", "2", "--logdir", str(logdir), REGRESSION, "--", "--epochs", "3"])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:] + log_tails(logdir)
    return logdir, r, read_summary(logdir)


def test_a_regression_scripts_metrics_reach_the_summary_and_final_line_as_named(regression_run):
    logdir, r, s = regression_run
    assert s["status"] == "succeeded" and "test_accuracy" not in s
    assert set(s["metrics_by_task"]) == {"worker:0", "worker:1"}
    assert s["metrics"]["test_mse"] == s["metrics_by_task"]["worker:0"]["test_mse"] < 0.05  # it learned
    assert s["metrics"]["test_r2"] > 0.9
    final = r.stdout.strip().splitlines()[-2]
    assert final.startswith("psflow: succeeded: ") and "test_mse=" in final and "test_r2=" in final, final
    assert "test_accuracy" not in final
    shown = run_psflow(["summary", str(logdir)], timeout_s=60)
    assert re.search(r"^ +test_mse: [0-9.e-]+$", shown.stdout, re.MULTILINE), shown.stdout


def test_every_worker_writes_progress_scalars_and_the_scripts_own_without_a_supervisor(regression_run):
    logdir, _, s = regression_run
    for task in ("worker:0", "worker:1"):
        scalars = _scalars(logdir, task)
        assert {"progress/loss", "progress/examples_per_sec", "progress/global_step", "test_mse"} <= set(scalars), scalars
        assert all(e.value > 0 for e in scalars["progress/examples_per_sec"])
        steps = [e.value for e in scalars["progress/global_step"]]
        assert steps == sorted(steps) and 0 < steps[-1] <= s["global_step"]
        assert [e.step for e in scalars["progress/global_step"]] == [int(v) for v in steps]
        (mse,) = scalars["test_mse"]
        assert mse.value == pytest.approx(s["metrics_by_task"][task]["test_mse"], rel=1e-6)


def test_summary_status_and_final_line_give_the_same_rate(regression_run):
    logdir, r, s = regression_run
    status = json.loads((logdir / "status.json").read_text())
    assert s["examples"] == 2 * 3 * 1000  # every example of both shards, 3 epochs
    assert s["examples_per_sec"] > 0 and status["examples_per_sec"] == s["examples_per_sec"]
    assert f"examples/sec={s['examples_per_sec']}" in r.stdout
    # the headline is wall-clock, from the first step to the last: never above the rate inside the steps
    assert s["examples_per_sec"] <= s["step_examples_per_sec"] == status["step_examples_per_sec"]


def test_a_stopped_run_reports_the_rate_it_trained_at(tmp_path):
    logdir = tmp_path / "stopped"
    p = subprocess.Popen([PSFLOW, "run", "--ps", "1", "--workers", "2", "--logdir", str(logdir), REGRESSION, "--",
                          "--epochs", "100000"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=task_env(), cwd=ROOT)
    out = []
    try:
        deadline = time.monotonic() + 120
        for line in p.stdout:  # wait until both workers train
            out.append(line)
            if sum("training, loss=" in x for x in out) == 2 or time.monotonic() > deadline:
                break
        _wait_for_progress(logdir, deadline_s=30)
        p.send_signal(signal.SIGTERM)
        rest, _ = p.communicate(timeout=60)
        out.append(rest)
    finally:
        if p.poll() is None:
            p.kill()
    s = read_summary(logdir)
    status = json.loads((logdir / "status.json").read_text())
    assert s["status"] == "stopped" and s["global_step"] > 0, "".join(out)[-3000:]
    assert s["examples"] > 0 and s["examples_per_sec"] > 0, s
    assert status["examples_per_sec"] == s["examples_per_sec"]
    assert f"psflow: stopped: global_step={s['global_step']} examples/sec={s['examples_per_sec']}" in "".join(out)


def _wait_for_progress(logdir: Path, deadline_s: float) -> None:
    """Poll status.json (bounded by the deadline) until both workers have reported training time."""
    end = time.monotonic() + deadline_s
    state: dict = {}
    while time.monotonic() < end:
        try:
            state = json.loads((logdir / "status.json").read_text())
        except (OSError, ValueError):
            state = {}
        tasks = state.get("tasks", {})
        if all(tasks.get(w, {}).get("progress", {}).get("train_time_s", 0) > 0 for w in ("worker:0", "worker:1")):
            return
        time.sleep(0.05)  # polling a file another process writes, bounded by the deadline
    raise AssertionError(f"no progress from both workers within {deadline_s} s: {state}")
