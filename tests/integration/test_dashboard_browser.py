"""The dashboard in a real browser: Debian's Chromium, headless, driven by Playwright (installed by
tools/chromium.sh; never `playwright install`). Open the dashboard, start a run from the form, see
its tasks become running and the loss chart gain points, open a worker's log, restart the dashboard
mid-run and find the run and its history, stop the run. Screenshots go to test-artifacts/dashboard/
(or $PSFLOW_TEST_ARTIFACTS)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from conftest import ROOT
from dashboard import TOKEN, WatchedBrowser, start_dashboard, wait_for

pytestmark = pytest.mark.timeout(300)
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--no-first-run"]
DEADLINE_MS = 120_000


@pytest.fixture(scope="module")
def chromium() -> str:
    r = subprocess.run(["bash", str(ROOT / "tools" / "chromium.sh")], capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        pytest.skip(f"no Chromium to drive (tools/chromium.sh: {r.stderr.strip() or r.returncode})")
    return r.stdout.strip()


@pytest.fixture
def browser(chromium: str):  # noqa: ANN201
    """A headless Chromium driven by Playwright, closed after the test; the test fails on any console
    error or uncaught error of its pages (a JavaScript error is a bug even where the page goes on)."""
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as pw:
        launched = WatchedBrowser(pw.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS, headless=True))
        try:
            yield launched
        finally:
            launched.close()
        assert not launched.errors, "JavaScript errors on the dashboard's pages:\n" + "\n".join(launched.errors)


def desktop_page(browser, url: str):  # noqa: ANN001, ANN201
    """A desktop-sized page with the tests' deadline, opened at ``url``."""
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.set_default_timeout(DEADLINE_MS)
    page.goto(url)
    return page


@pytest.fixture
def artifacts() -> Path:
    out = Path(os.environ.get("PSFLOW_TEST_ARTIFACTS", ROOT / "test-artifacts")) / "dashboard"
    out.mkdir(parents=True, exist_ok=True)
    return out


def test_start_watch_read_a_log_survive_a_dashboard_restart_and_stop_from_the_browser(tmp_path, browser, artifacts):
    ui = start_dashboard(tmp_path / "home", tmp_path / "runs")
    second = None
    try:
        page = desktop_page(browser, f"{ui.url}#token={TOKEN}")
        page.wait_for_selector("#runs-table")
        assert page.input_value("#token-input") == TOKEN and "token=" not in page.url  # kept, and out of the URL
        page.screenshot(path=str(artifacts / "01-runs-empty.png"))

        page.click("#nav-new")
        page.fill("#f-script", "../README.md")
        page.click("#start-btn")
        page.wait_for_selector('.field-error[data-for="script"]:has-text("is not under an allowed directory")')
        page.screenshot(path=str(artifacts / "02-form-refused.png"))

        page.fill("#f-script", "mnist_softmax.py")
        page.fill("#f-args", "--epochs 300 --init zeros --print_every 50")
        page.fill("#f-workers", "2")
        page.select_option("#f-mode", "async")
        page.fill("#f-restart", "on-failure")
        requests: list[str] = []
        page.on("request", lambda r: requests.append(r.url))
        page.click("#start-btn")
        page.wait_for_url("**/#/run/*")
        run_id = page.url.split("#/run/")[1]
        for task in ("ps:0", "worker:0", "worker:1"):
            page.wait_for_selector(f'#cluster .task[data-task="{task}"][data-state="running"]')
        page.wait_for_function("Number(document.querySelector('#chart-loss').dataset.points) >= 2")
        first = int(page.get_attribute("#chart-loss", "data-points"))
        page.wait_for_function(f"Number(document.querySelector('#chart-loss').dataset.points) > {first}")
        assert page.locator("#chart-loss canvas").count() >= 1  # uPlot drew it
        # the points were pushed over Server-Sent Events: the page opened the run's stream and never polled
        assert page.evaluate("document.body.dataset.live") == "sse"
        assert any(f"/api/runs/{run_id}/stream" in u for u in requests), requests
        polled = [u for u in requests if f"/api/runs/{run_id}/metrics" in u or u.endswith(f"/api/runs/{run_id}")]
        assert len(polled) <= 1, polled  # one look before the stream opens (the metrics it asks for), then none
        page.wait_for_selector("#straggler-verdict")
        # the ps card: ps:0's live push rate and p99 (pushed with the run page)
        page.wait_for_function("(() => { const r = document.querySelector('#ps-health tr[data-ps-requests=\"ps:0\"]');"
                               " return r && Number(r.cells[1].textContent) > 0 && r.cells[3].textContent !== ''; })()")
        page.screenshot(path=str(artifacts / "03-run-training.png"), full_page=True)

        # A click whose press and release straddle a live update still opens the task's log (the card is
        # updated in place, not replaced: a replaced one would lose the click).
        card = '#cluster .task[data-task="worker:1"]'
        box, before = page.locator(card).bounding_box(), page.locator(card).text_content()
        page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
        page.mouse.down()
        page.wait_for_function("([card, before]) => document.querySelector(card).textContent !== before", arg=[card, before])
        page.mouse.up()
        page.wait_for_selector('#log-view[data-task="worker:1"]')
        page.wait_for_function("document.querySelector('#log-view').textContent.includes('worker:1')")
        page.screenshot(path=str(artifacts / "04-worker-log.png"), full_page=True)

        page.click("#dump-btn")  # every task's stacks, grouped by where its main thread stands
        page.wait_for_selector('#stacks[data-tasks="3"] .stack-group')
        page.locator("#stacks").screenshot(path=str(artifacts / "04b-stacks.png"))

        # the dashboard goes down mid-run and comes back: the run and its history are there
        ui.stop()
        second = start_dashboard(ui.home, tmp_path / "runs")
        page.goto(f"{second.url}#token={TOKEN}")
        page.wait_for_selector(f'#runs-table tr[data-run="{run_id}"] .state.running')
        page.screenshot(path=str(artifacts / "05-runs-after-dashboard-restart.png"))
        page.click(f'#runs-table a[href="#/run/{run_id}"]')
        page.wait_for_function(f"Number(document.querySelector('#chart-loss').dataset.points) > {first}")
        page.wait_for_selector('#timeline .lane[data-lane="worker:0"] .bar')
        page.wait_for_selector('#events td:has-text("task_registered")')

        page.once("dialog", lambda d: d.accept())
        page.click("#stop-btn")
        page.wait_for_selector("#run-state .state.stopped")
        page.wait_for_selector('#summary dd:has-text("stopped")')
        page.wait_for_selector("#checkpoints button[data-ckpt]")  # the final checkpoint, to export
        page.wait_for_selector('#placement[data-rows="2"]')  # w and b on ps:0's shard
        page.screenshot(path=str(artifacts / "06-run-stopped.png"), full_page=True)

        phone = browser.new_page(viewport={"width": 390, "height": 844}, is_mobile=True)
        phone.goto(f"{second.url}#/run/{run_id}")
        phone.wait_for_selector("#run-state .state.stopped")
        overflow = phone.evaluate("document.documentElement.scrollWidth - window.innerWidth")
        assert overflow <= 1, f"the run page is {overflow} px wider than a phone's screen"
        phone.screenshot(path=str(artifacts / "07-phone-run.png"), full_page=True)
        with second.client() as api:
            wait_for(lambda: api.get(f"/api/runs/{run_id}").json()["run"]["state"], lambda s: s == "stopped",
                     what="the run stopped in the store")
    finally:
        ui.stop()
        if second is not None:
            second.stop()


def _recorded_run(home: Path, run_id: str, losses: list[float]) -> None:
    """A finished run written by the launcher's own job-store writer, with a loss per reported step."""
    import time

    from psflow.platform.sqlrunstore import SqliteRunStore

    record = {"id": run_id, "script": "examples/mnist_softmax.py", "args": ["--learning_rate", run_id[-3:]],
              "logdir": str(home / run_id), "cluster": {"ps": ["ps:0"], "worker": ["worker:0"]}, "mode": "async",
              "strategy": "ps", "backend": "local", "restart_policy": {}, "launcher": None, "created_unix": time.time()}
    store = SqliteRunStore(home / "jobs.db", record, ["ps:0", "worker:0"], warn=print)
    store.task_started("worker:0", 0, None)
    for step, loss in enumerate(losses):
        store.report("worker:0", {"progress": {"global_step": (step + 1) * 100, "loss": loss}})
        time.sleep(0.002)  # distinct report times (the store keys points by time): not a synchronisation
    store.task_exited("worker:0", 0, 0, time.time())
    store.finished("succeeded")


def test_two_runs_compared_overlay_their_loss_by_global_step(tmp_path, browser, artifacts):
    home = tmp_path / "home"
    _recorded_run(home, "run-lr-0.1", [2.0, 1.0, 0.6, 0.4, 0.3])
    _recorded_run(home, "run-lr-0.5", [2.0, 0.5, 0.9, 1.4, 2.1])
    ui = start_dashboard(home, tmp_path / "runs")
    try:
        page = desktop_page(browser, f"{ui.url}#token={TOKEN}")
        page.wait_for_selector('#runs-table tr[data-run="run-lr-0.5"]')
        assert page.is_disabled("#compare-btn")
        page.check('input[data-pick="run-lr-0.1"]')
        page.check('input[data-pick="run-lr-0.5"]')
        page.click("#compare-btn")
        page.wait_for_selector('#cmp-loss[data-series="2"][data-points="10"]')
        page.wait_for_selector('#compare-table a[href="#/run/run-lr-0.1"]')
        legend = page.inner_text("#cmp-loss")
        assert "run-lr-0.1" in legend and "run-lr-0.5" in legend
        page.screenshot(path=str(artifacts / "08-compare.png"), full_page=True)
    finally:
        ui.stop()


def test_the_runs_list_pages_filters_and_searches_many_runs(tmp_path, browser, artifacts):
    from psflow.platform.jobstore import JobStore

    home = tmp_path / "home"
    with JobStore(home / "jobs.db") as db, db.transaction():
        for i in range(230):
            run_id = f"20260101-{i:06d}-run{i:03d}"
            db.add_run({"id": run_id, "script": "examples/cnn.py" if i % 10 == 0 else "examples/mnist_softmax.py",
                        "args": [], "logdir": str(tmp_path / run_id), "cluster": {"worker": ["worker:0"]},
                        "created_unix": 1_700_000_000.0 + i}, ["worker:0"])
            db.finish_run(run_id, "failed" if i % 3 == 0 else "succeeded", 1_700_000_100.0 + i)
    ui = start_dashboard(home, tmp_path / "runs")
    try:
        page = desktop_page(browser, ui.url)
        page.wait_for_selector('#runs-count:has-text("1-100 of 230 runs")')
        assert page.is_disabled("#newer-btn") and page.locator("#runs-table tbody tr").count() == 100
        assert page.get_attribute("#runs-table tbody tr:first-child", "data-run") == "20260101-000229-run229"
        page.click("#older-btn")
        page.wait_for_selector('#runs-count:has-text("101-200 of 230 runs")')
        page.click("#older-btn")
        page.wait_for_selector('#runs-count:has-text("201-230 of 230 runs")')
        assert page.is_disabled("#older-btn")
        page.select_option("#state-filter", "failed")
        page.wait_for_selector('#runs-count:has-text("1-77 of 77 runs")')
        page.fill("#search", "cnn")
        page.wait_for_selector('#runs-count:has-text("of 8 runs")')  # i % 10 == 0 and i % 3 == 0
        page.screenshot(path=str(artifacts / "09-runs-filtered.png"))
    finally:
        ui.stop()
