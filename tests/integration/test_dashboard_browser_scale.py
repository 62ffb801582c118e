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


def test_the_heaviest_runs_page_draws_its_charts_bounded_and_a_zoom_asks_for_the_range(tmp_path, browser, artifacts):  # noqa: F811
    """A finished run of 200,000 metric points (2 workers x 5 metrics x 20,000 reports, a loss spike at
    60 %): its page draws each chart from at most 1,000 points per task, with the spike, in well under
    the deadline; dragging over the loss chart asks for that range at full resolution."""
    import json
    import random
    import time

    from psflow.platform import metricstore
    from psflow.platform.jobstore import JobStore

    home, rng, run_id = tmp_path / "home", random.Random(0), "20260101-000000-heavy"
    home.mkdir()
    with JobStore(home / "jobs.db") as db, db.transaction():
        db.add_run({"id": run_id, "script": "x.py", "logdir": str(tmp_path / "run"), "created_unix": 1.7e9},
                   ["ps:0", "worker:0", "worker:1"])
        for k in range(20_000):
            for task in ("worker:0", "worker:1"):
                metricstore.write(db.conn, run_id, task, 1.7e9 + k, [  # type: ignore[arg-type]
                    (name, 50.0 if name == "loss" and k == 12_000 else rng.random(), k * 10)
                    for name in ("loss", "accuracy", "examples_per_sec", "global_step", "local_step")])
        db.finish_run(run_id, "succeeded", 1.7e9 + 20_000)
    ui = start_dashboard(home, tmp_path / "runs")
    try:
        started = time.monotonic()  # a fresh page, straight to the run (reads are open on loopback)
        page = desktop_page(browser, f"{ui.url}#/run/{run_id}")
        page.wait_for_selector('#chart-loss[data-points]:not([data-points="0"]) canvas')
        page.wait_for_selector('#chart-examples_per_sec[data-points]:not([data-points="0"]) canvas')
        drawn_s = time.monotonic() - started
        (artifacts / "12-heavy-run.json").write_text(json.dumps({"load_to_charts_drawn_s": round(drawn_s, 3)}))
        page.screenshot(path=str(artifacts / "12-heavy-run.png"), full_page=True)
        assert 0 < int(page.get_attribute("#chart-loss", "data-points")) <= 2 * 1000
        assert drawn_s < 10, drawn_s  # under 1 s on a quiet machine (BENCHMARKS.md); this one is shared
        highest = page.evaluate("Math.max(...view.series.loss['worker:0'].map(p => p[2]))")
        assert highest == 50.0  # the spike survived the downsampling

        box = page.locator("#chart-loss .u-over").bounding_box()
        assert box is not None
        page.mouse.move(box["x"] + box["width"] * 0.55, box["y"] + box["height"] / 2)
        page.mouse.down()
        page.mouse.move(box["x"] + box["width"] * 0.57, box["y"] + box["height"] / 2, steps=5)
        page.mouse.up()
        page.wait_for_selector('#chart-loss[data-zoomed="1"]')
        zoom = page.evaluate("view.zoom.loss['worker:0']")
        gaps = {round(b[0] - a[0], 6) for a, b in zip(zoom, zoom[1:])}
        assert 10 < len(zoom) <= 1000 and gaps == {1.0}, (len(zoom), sorted(gaps)[:5])  # every point of the range
        page.dblclick("#chart-loss .u-over")
        page.wait_for_selector('#chart-loss[data-zoomed="0"]')
    finally:
        ui.stop()
