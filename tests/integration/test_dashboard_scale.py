"""`POST /api/runs/{run}/scale` against a real `psflow ui` and a real run: refused without the token,
refused with a clear message for a bad worker count or an ended run, carried out with the token (the
launcher adds the worker, the page's run shows it running, then retires it)."""

from __future__ import annotations

import subprocess

import pytest
from conftest import PSFLOW, ROOT, SOFTMAX, log_tails, task_env
from dashboard import start_dashboard, wait_for

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def dashboard(tmp_path):
    ui = start_dashboard(tmp_path / "home", tmp_path / "runs")
    yield ui
    ui.stop()


def test_scale_through_the_api_needs_the_token_checks_the_count_and_scales_the_run(tmp_path, dashboard, procs):
    logdir = tmp_path / "run"
    launcher = subprocess.Popen([PSFLOW, "run", "--ps", "1", "--workers", "1", "--no-live", "--logdir", str(logdir),
                                 SOFTMAX, "--", "--epochs", "300", "--init", "zeros"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                env=task_env(PSFLOW_HOME=str(dashboard.home)), cwd=ROOT, start_new_session=True)
    procs.append(launcher)
    with dashboard.client() as api, dashboard.client(token=None) as anon:
        run = wait_for(lambda: api.get("/api/runs", params={"state": "running"}).json()["runs"],
                       lambda r: r and r[0]["global_step"] > 0, what="the run training",
                       context=lambda: log_tails(logdir))[0]
        path = f"/api/runs/{run['id']}/scale"
        refused = anon.post(path, json={"workers": 2})
        assert refused.status_code == 401, refused.text
        for bad in (0, 1000):
            r = api.post(path, json={"workers": bad})
            assert r.status_code == 422, r.text
            (detail,) = r.json()["detail"]
            assert detail["loc"] == ["body", "workers"]
            assert f"The number of workers must be an integer from 1 to 256. Received: {bad}." in detail["msg"]
        assert api.post(path, json={"nodes": 2}).status_code == 422  # not a field of the request
        assert api.get(f"/api/runs/{run['id']}").json()["controls"] == []  # nothing was asked of the launcher

        asked = api.post(path, json={"workers": 2})
        assert asked.status_code == 202, asked.text
        assert asked.json()["workers"] == 2
        page = wait_for(lambda: api.get(f"/api/runs/{run['id']}").json(),
                        lambda p: (p["run"]["tasks"].get("worker:1") or {}).get("state") == "running",
                        what="worker:1 added and running", context=lambda: log_tails(logdir))
        assert [(c["kind"], c["source"], c["state"]) for c in page["controls"]] == [("scale", "api", "done")]
        assert page["controls"][0]["answer"] == "1 -> 2 workers: adding worker:1"

        assert api.post(path, json={"workers": 1}).status_code == 202
        wait_for(lambda: api.get(f"/api/runs/{run['id']}").json()["run"]["tasks"]["worker:1"]["state"],
                 lambda s: s == "retired", what="worker:1 retired", context=lambda: log_tails(logdir))

        assert api.post(f"/api/runs/{run['id']}/stop").status_code == 202
        assert launcher.wait(timeout=120) == 130
        ended = api.post(path, json={"workers": 2})
        assert ended.status_code == 409
        assert f"Run {run['id']} has already ended (stopped); only a running run can be scaled" in ended.json()["detail"]
