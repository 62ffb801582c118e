"""The run page tells the truth, in a real browser (Debian's Chromium, headless, Playwright), over a
real `psflow ui` and a job store written as launchers write it (no training: the runs are recorded):

- a failed run's page says its root cause in words (worker:1: ValueError, the message, the
  traceback's tail) and its log panel opens worker:1, the failed task, not worker:0 (issue 25 item 2);
- a worker a little below the median, with a noisy window now and then, is no straggler, and
  nothing on its card is red; a worker clearly and lastingly slower is one, in red (item 3);
- every metric the tasks report is charted (the script's own and its eval/ ones unasked, counters on
  request), by time or step, smoothed, on a log scale, the settings kept (item 4).

Screenshots go to test-artifacts/dashboard/ (or $PSFLOW_TEST_ARTIFACTS)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from dashboard import TOKEN, start_dashboard
from test_dashboard_browser import artifacts, browser, chromium, desktop_page  # noqa: F401 (fixtures)

from psflow import errorreport

pytestmark = pytest.mark.timeout(300)
TASKS = ["ps:0", "worker:0", "worker:1", "worker:2"]


def _record(run_id: str, logdir: Path) -> dict:
    return {"id": run_id, "script": "train.py", "args": [], "logdir": str(logdir), "cluster": {}, "mode": "async",
            "strategy": "ps", "backend": "local", "restart_policy": {}, "launcher": None, "created_unix": time.time() - 600}


def _failed_run(db_path: Path, logdir: Path) -> None:
    from psflow.platform.sqlrunstore import SqliteRunStore

    (logdir / "logs").mkdir(parents=True)
    for t in TASKS:
        (logdir / "logs" / f"{t.replace(':', '-')}.log").write_text(f"{t}: training\n")

    def diverge() -> None:
        raise ValueError("loss is nan at step 41")

    try:
        diverge()
    except ValueError as e:
        errorreport.write(errorreport.path_for(logdir / "errors", "worker:1"), "worker:1", e)
    store = SqliteRunStore(db_path, _record("run-failed", logdir), TASKS, warn=print)
    for t in TASKS:
        store.task_started(t, 0, 100)
    store.task_exited("worker:1", 0, 1, time.time())
    for t in ("ps:0", "worker:0", "worker:2"):
        store.task_exited(t, 0, -15, time.time())
    store.summary({"status": "failed", "root_cause": "worker:1", "tasks": []})
    store.finished("failed")


def _timed_run(db_path: Path, run_id: str, rates: dict[str, list[float]]) -> None:
    """A run whose workers reported local_step once a second at ``rates[w][i]`` steps/s through window i (30 s)."""
    from psflow.platform.jobstore import JobStore

    start = time.time() - 400
    with JobStore(db_path) as db, db.transaction():
        db.add_run(_record(run_id, db_path.parent / run_id), TASKS)
        for w, per_window in rates.items():
            step, t = 0.0, start
            for rate in per_window:
                for _ in range(30):
                    t, step = t + 1, step + rate
                    db.task_progress(run_id, w, {"local_step": int(step)}, t, [("local_step", step, None)])
        db.finish_run(run_id, "succeeded", start + 400)


def test_the_run_page_says_the_root_cause_in_words_and_warns_only_of_a_real_straggler(tmp_path, browser, artifacts):  # noqa: F811
    home = tmp_path / "home"
    home.mkdir()
    _failed_run(home / "jobs.db", tmp_path / "runs" / "run-failed")
    noisy = [75.0 if i % 4 == 1 else 105.0 for i in range(10)]  # 0.98x the others, a dip one window in four
    _timed_run(home / "jobs.db", "run-noisy", {"worker:0": [100.0] * 10, "worker:1": [100.0] * 10, "worker:2": noisy})
    _timed_run(home / "jobs.db", "run-slow", {"worker:0": [100.0] * 10, "worker:1": [100.0] * 10, "worker:2": [60.0] * 10})
    ui = start_dashboard(home, tmp_path / "runs")
    try:
        page = desktop_page(browser, f"{ui.url}#token={TOKEN}")
        page.goto(f"{ui.url}#/run/run-failed")
        cause = page.wait_for_selector('#root-cause[data-task="worker:1"]')
        assert "ValueError: loss is nan at step 41" in cause.inner_text()
        assert "in diverge" in page.inner_text("#root-cause pre.traceback")
        page.wait_for_selector('#log-view[data-task="worker:1"]')  # the failed task's log, not worker:0's
        assert page.inner_text("#log-view").startswith("worker:1: training")
        assert page.get_attribute('#cluster .task[data-task="worker:1"]', "class").split().count("selected") == 1
        page.screenshot(path=str(artifacts / "20-root-cause.png"), full_page=True)
        page.click('#cluster .task[data-task="worker:0"]')  # the user's choice stands over the next refreshes
        page.wait_for_selector('#log-view[data-task="worker:0"]')

        page.goto(f"{ui.url}#/run/run-noisy")
        verdict = page.wait_for_selector("#stragglers #straggler-verdict")
        assert verdict.inner_text().startswith("No straggler"), verdict.inner_text()
        assert page.locator("#stragglers .errors").count() == 0  # nothing red
        page.locator("#stragglers").screenshot(path=str(artifacts / "21-no-straggler.png"))

        page.goto(f"{ui.url}#/run/run-slow")
        page.wait_for_selector('#stragglers[data-kind="persistent"] p.errors#straggler-verdict')
        assert page.inner_text("#straggler-verdict").startswith("worker:2 runs at 0.60x the median worker")
        assert page.locator('#stragglers tr.errors[data-worker="worker:2"]').count() == 1
    finally:
        ui.stop()


def _run_with_own_metrics(db_path: Path) -> None:
    """A run whose two workers reported loss (from 2.0 down), their own lr and, every 10 steps, an
    evaluation metric, at global steps 10, 20, ... (reports once a second)."""
    from psflow.platform.jobstore import JobStore

    start = time.time() - 200
    with JobStore(db_path) as db, db.transaction():
        db.add_run(_record("run-charts", db_path.parent / "run-charts"), TASKS)
        for i in range(1, 61):
            for k, w in enumerate(("worker:0", "worker:1")):
                step = 10 * i + k  # the workers' steps differ by one: x by step has both
                points = [("loss", 2.0 / i + (0.3 if i % 2 else 0.0), step), ("global_step", float(step), step),
                          ("lr", 0.1 * 0.95 ** i, step)]
                points += [("eval/accuracy", 0.5 + i / 200, step)] if i % 10 == 0 else []
                db.task_progress("run-charts", w, {"global_step": step}, start + i + k / 10, points)
        db.finish_run("run-charts", "succeeded", start + 100)


def test_every_metric_a_task_reports_is_charted_by_time_or_step_smoothed_and_on_a_log_scale(tmp_path, browser, artifacts):  # noqa: F811
    home = tmp_path / "home"
    home.mkdir()
    _run_with_own_metrics(home / "jobs.db")
    ui = start_dashboard(home, tmp_path / "runs")
    try:
        page = desktop_page(browser, f"{ui.url}#token={TOKEN}")
        page.goto(f"{ui.url}#/run/run-charts")
        for name in ("loss", "lr", "eval/accuracy"):  # the script's own and its evaluation metric, drawn unasked
            page.wait_for_selector(f'[id="chart-{name}"] canvas')
        assert page.get_attribute('[id="chart-eval/accuracy"]', "data-points") == "12"
        assert page.is_checked('#metric-picker input[data-metric="lr"]')
        assert not page.is_checked('#metric-picker input[data-metric="global_step"]')  # offered, not drawn

        page.select_option("#chart-x", "step")
        page.wait_for_selector('#chart-loss[data-x="step"] canvas')
        xs = page.evaluate("view.charts.loss.data[0]")
        assert xs[:4] == [10, 11, 20, 21] and xs[-1] == 601
        page.check("#chart-log")
        assert page.evaluate("view.charts.loss.scales.y.distr") == 3
        page.fill("#chart-smoothing", "0.9")
        page.dispatch_event("#chart-smoothing", "input")
        page.wait_for_selector('#chart-loss[data-smoothing="0.9"]')
        data = page.evaluate("view.charts.loss.data")
        assert len(data) == 1 + 2 * 2  # each worker: its raw line and its smoothed one
        raw = [v for v in data[1] if v is not None]
        smoothed = [v for v in data[2] if v is not None]
        assert len(smoothed) == len(raw) == 60 and max(smoothed) - min(smoothed) < max(raw) - min(raw)
        assert page.evaluate("smooth([1, 1, 1], 0.9)") == [1, 1, 1]  # debiased: no pull towards 0
        assert page.evaluate("smooth([0, 10, null], 0.5)") == [0, 20 / 3, None]
        page.screenshot(path=str(artifacts / "22-charts.png"), full_page=True)

        page.check('#metric-picker input[data-metric="global_step"]')  # asked for: drawn, its points fetched
        page.wait_for_function("Number(document.getElementById('chart-global_step')?.dataset.points) === 120")
        page.uncheck('#metric-picker input[data-metric="lr"]')
        page.wait_for_selector('[id="chart-lr"]', state="detached")

        page.reload()  # the settings are kept
        page.wait_for_selector('#chart-loss[data-x="step"][data-log="1"] canvas')
        assert page.input_value("#chart-x") == "step" and page.is_checked("#chart-log")
    finally:
        ui.stop()
