"""Scale from the run page, in a real browser (Debian's Chromium, headless, Playwright): the Scale
control adds a worker to a running run (it shows running in the cluster) and retires it again (it
shows retired). Screenshots go to test-artifacts/dashboard/ (or $PSFLOW_TEST_ARTIFACTS)."""

from __future__ import annotations

import subprocess

import pytest
from conftest import PSFLOW, ROOT, SOFTMAX, log_tails, task_env
from dashboard import TOKEN, start_dashboard, wait_for
from test_dashboard_browser import artifacts, browser, chromium, desktop_page  # noqa: F401 (fixtures)

pytestmark = pytest.mark.timeout(300)


def test_the_scale_control_adds_then_retires_a_worker(tmp_path, browser, artifacts, procs):  # noqa: F811
    ui = start_dashboard(tmp_path / "home", tmp_path / "runs")
    logdir = tmp_path / "run"
    try:
        launcher = subprocess.Popen([PSFLOW, "run", "--ps", "1", "--workers", "1", "--no-live", "--logdir", str(logdir),
                                     SOFTMAX, "--", "--epochs", "300", "--init", "zeros"],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                    env=task_env(PSFLOW_HOME=str(ui.home)), cwd=ROOT, start_new_session=True)
        procs.append(launcher)
        with ui.client() as api:
            run = wait_for(lambda: api.get("/api/runs", params={"state": "running"}).json()["runs"],
                           lambda r: r and r[0]["global_step"] > 0, what="the run training",
                           context=lambda: log_tails(logdir))[0]
        page = desktop_page(browser, f"{ui.url}#token={TOKEN}")
        page.goto(f"{ui.url}#/run/{run['id']}")
        page.wait_for_selector('#cluster .task[data-task="worker:0"][data-state="running"]')
        assert page.input_value("#scale-n") == "1"  # the run's workers now

        page.fill("#scale-n", "0")
        page.click("#scale-btn")
        page.wait_for_selector('#toast:has-text("The number of workers must be an integer from 1 to 256")')

        page.fill("#scale-n", "2")
        page.click("#scale-btn")
        page.wait_for_selector('#cluster .task[data-task="worker:1"][data-state="running"]')
        page.screenshot(path=str(artifacts / "10-scaled-up.png"), full_page=True)

        page.fill("#scale-n", "1")
        page.click("#scale-btn")
        page.wait_for_selector('#cluster .task[data-task="worker:1"][data-state="retired"]')
        page.wait_for_selector('#cluster .task[data-task="worker:0"][data-state="running"]')
        page.screenshot(path=str(artifacts / "11-scaled-down.png"), full_page=True)
        with ui.client() as api:
            answers = [(c["kind"], c["source"], c["state"]) for c in api.get(f"/api/runs/{run['id']}").json()["controls"]]
            assert answers == [("scale", "api", "done"), ("scale", "api", "done")]
            assert api.post(f"/api/runs/{run['id']}/stop").status_code == 202
        assert launcher.wait(timeout=120) == 130
    finally:
        ui.stop()
