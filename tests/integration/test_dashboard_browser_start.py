"""The dashboard in a real browser (Debian's Chromium, Playwright): a run started from the form is
shown starting at once and a launch that fails is shown failed with its cause; leaving a page while
its refresh is answered writes nothing (no JavaScript error); the run page opens one live stream.
The ``browser`` fixture fails every test here on any console error or uncaught error."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest
from dashboard import TOKEN, start_dashboard
from test_dashboard_browser import artifacts, browser, chromium, desktop_page  # noqa: F401 (fixtures)

pytestmark = pytest.mark.timeout(300)
TASKS = ["ps:0", "worker:0", "worker:1"]


def _record(run_id: str, logdir: Path, created_unix: float) -> dict:
    return {"id": run_id, "script": "train.py", "args": [], "logdir": str(logdir), "cluster": {"ps": ["ps:0"],
            "worker": ["worker:0", "worker:1"]}, "mode": "async", "strategy": "ps", "backend": "local",
            "restart_policy": {}, "launcher": None, "created_unix": created_unix}


def _recorded_runs(db_path: Path, count: int, *, own_metric: bool = False) -> None:
    from psflow.platform.jobstore import JobStore

    start = time.time() - 1000
    with JobStore(db_path) as db, db.transaction():
        for r in range(count):
            run_id = f"run-{r:03d}"
            db.add_run(_record(run_id, db_path.parent / run_id, start + r), TASKS)
            for i in range(1, 11):
                points = [("loss", 2.0 / i, 10 * i), ("global_step", 10.0 * i, 10 * i)]
                points += [("lr", 0.1 * 0.9 ** i, 10 * i)] if own_metric else []
                db.task_progress(run_id, "worker:0", {"global_step": 10 * i}, start + r + i, points)
            db.finish_run(run_id, "succeeded", start + r + 20)


def test_a_run_started_from_the_form_shows_starting_at_once_and_a_failed_launch_its_cause(tmp_path, browser, artifacts):  # noqa: F811
    ui = start_dashboard(tmp_path / "home", tmp_path / "runs")
    launcher = None
    try:
        page = desktop_page(browser, f"{ui.url}#token={TOKEN}")
        page.click("#nav-new")
        page.fill("#f-script", "mnist_softmax.py")
        page.fill("#f-args", "--epochs 1 --init zeros")
        with page.expect_response(lambda r: r.url.endswith("/api/runs") and r.request.method == "POST") as answer:
            clicked = time.monotonic()
            page.click("#start-btn")
        started = answer.value.json()
        launcher = started["launcher_pid"]
        os.kill(launcher, signal.SIGSTOP)  # the launcher stands still: the page must say the run is starting
        answered_s = time.monotonic() - clicked
        assert answer.value.status == 202 and started["state"] == "starting", started
        assert answered_s < 5.0, f"the start took {answered_s:.1f} s to answer"  # it used to wait for the launcher
        run_id = started["run_id"]
        page.wait_for_url(f"**/#/run/{run_id}")
        page.wait_for_selector("#run-state .state.starting")
        assert f"its launcher (pid {launcher}) is setting the run up" in page.inner_text("#run-starting")
        assert page.inner_text("#run-logdir") == f"logdir {started['logdir']}"  # where its files go, said on its page
        page.wait_for_selector('#events td:has-text("launch_requested")')
        page.screenshot(path=str(artifacts / "30-run-starting.png"), full_page=True)

        os.kill(launcher, signal.SIGKILL)  # it dies before it recorded the run: the failure is recorded, not lost
        launcher = None
        page.wait_for_selector("#run-state .state.failed")
        page.wait_for_selector('#root-cause:has-text("its launcher ended with exit code -9 before the run started")')
        page.wait_for_selector('#events td:has-text("launch_failed")')
        page.screenshot(path=str(artifacts / "31-launch-failed.png"), full_page=True)
    finally:
        if launcher is not None:
            os.kill(launcher, signal.SIGKILL)
        ui.stop()


def test_leaving_the_runs_list_while_its_refresh_is_answered_writes_nothing_and_raises_nothing(tmp_path, browser):  # noqa: F811
    home = tmp_path / "home"
    home.mkdir()
    _recorded_runs(home / "jobs.db", 3)
    ui = start_dashboard(home, tmp_path / "runs")
    try:
        page = desktop_page(browser, f"{ui.url}#token={TOKEN}")
        page.wait_for_selector('#runs-table tr[data-run="run-002"]')
        held = []
        runs_list = re.compile(r".*/api/runs\?.*")
        page.route(runs_list, lambda route: held.append(route))  # the next refresh's answer waits
        with page.expect_request(lambda r: "/api/runs?" in r.url, timeout=10_000):
            pass  # the list refreshes every 1.5 s
        page.click("#nav-new")  # leave the list while that refresh is in flight
        page.wait_for_selector("#start-form")
        assert len(held) == 1
        with page.expect_response(lambda r: "/api/runs?" in r.url):
            held[0].continue_()
        page.unroute(runs_list)
        page.wait_for_timeout(1000)  # a window for the answer's callback to run (asserting that nothing happens)
        assert not page.is_visible("#toast.show"), page.inner_text("#toast")
        assert page.locator("#start-form").count() == 1
    finally:
        ui.stop()


def test_the_run_page_opens_one_live_stream_that_carries_the_scripts_own_metrics(tmp_path, browser):  # noqa: F811
    home = tmp_path / "home"
    home.mkdir()
    _recorded_runs(home / "jobs.db", 1, own_metric=True)
    ui = start_dashboard(home, tmp_path / "runs")
    try:
        page = desktop_page(browser, f"{ui.url}#token={TOKEN}")
        streams: list[str] = []
        page.on("request", lambda r: streams.append(r.url) if "/stream" in r.url else None)
        page.goto(f"{ui.url}#/run/run-000")
        page.wait_for_selector('[id="chart-lr"] canvas')  # the script's own metric, drawn unasked
        page.wait_for_function("Number(document.getElementById('chart-lr').dataset.points) === 10")
        page.wait_for_selector("#run-state .state.succeeded")
        assert len(streams) == 1 and "name=lr" in streams[0], streams
    finally:
        ui.stop()


def test_the_form_offers_each_backend_with_its_own_fields_and_a_run_page_says_why_it_cannot_scale(tmp_path, browser, artifacts):  # noqa: F811
    from psflow.launch.liveness import process_identity
    from psflow.platform.jobstore import JobStore

    home = tmp_path / "home"
    home.mkdir()
    with JobStore(home / "jobs.db") as db, db.transaction():  # a live Kubernetes run (this process stands for its launcher)
        db.add_run({**_record("run-k8s", tmp_path / "run-k8s", time.time()), "backend": "k8s",
                    "launcher": process_identity(os.getpid())}, TASKS)
        db.task_started("run-k8s", "worker:0", 0, time.time(), pid=None, scheduler_id="train-worker-0", identity=None)
    ui = start_dashboard(home, tmp_path / "runs")
    try:
        page = desktop_page(browser, f"{ui.url}#token={TOKEN}")
        page.click("#nav-new")
        assert page.locator("#f-backend option").all_inner_texts() == ["local", "slurm", "ssh", "k8s"]
        shown = {"local": ["#f-gpus"], "slurm": ["#f-nodes", "#f-coordinator"], "ssh": ["#f-hosts", "#f-coordinator"],
                 "k8s": ["#f-image", "#f-namespace", "#f-claim", "#f-gpus"]}
        every = sorted({f for fields in shown.values() for f in fields})
        for backend, fields in shown.items():
            page.select_option("#f-backend", backend)
            assert [f for f in every if page.is_visible(f)] == sorted(fields), backend
        page.fill("#f-script", "mnist_softmax.py")
        page.select_option("#f-backend", "ssh")
        page.click("#start-btn")  # the server says what the ssh backend needs, beside the field
        page.wait_for_selector('.field-error[data-for="hosts"]:has-text("The ssh backend needs hosts")')
        page.fill("#f-hosts", "node1:2")
        page.click("#start-btn")
        page.wait_for_selector('.field-error[data-for="hosts"]:has-text("--hosts gives 2 slot(s) (node1:2) for 3 tasks")')
        page.select_option("#f-backend", "k8s")
        page.click("#start-btn")
        page.wait_for_selector('.field-error[data-for="image"]:has-text("The k8s backend needs image")')
        page.screenshot(path=str(artifacts / "32-form-k8s.png"), full_page=True)

        page.goto(f"{ui.url}#/run/run-k8s")
        page.wait_for_selector("#run-state .state.running")
        page.wait_for_selector('#scale-why:has-text("cannot scale: it runs on the k8s backend")')
        assert not page.is_visible("#scale-btn") and page.is_visible("#stop-btn")
        page.screenshot(path=str(artifacts / "33-k8s-run-no-scale.png"), full_page=True)
    finally:
        ui.stop()
