"""The dashboard's HTTP API against a real `psflow ui` (uvicorn on 127.0.0.1, port 0) and a real
SQLite job store: a real run started through the API, watched, its metrics and logs read, the
dashboard restarted mid-run, the run stopped; and what the API refuses (no token, a malformed form,
a path out of the run's directory), each with a clear message."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import time
from pathlib import Path

import pytest
from conftest import PSFLOW, ROOT, pid_alive, task_env
from dashboard import TOKEN, start_dashboard, wait_for

from psflow.platform.jobstore import JobStore
from psflow.platform.sqlrunstore import SqliteRunStore

pytestmark = pytest.mark.timeout(300)
TRAIN = {"script": "mnist_softmax.py", "args": ["--epochs", "300", "--init", "zeros", "--print_every", "50"],
         "ps": 1, "workers": 2, "mode": "async", "restart": "on-failure", "max_restarts": 2}


@pytest.fixture
def dashboard(tmp_path):
    ui = start_dashboard(tmp_path / "home", tmp_path / "runs")
    yield ui
    ui.stop()


def _run(client, run_id: str) -> dict:
    r = client.get(f"/api/runs/{run_id}")
    assert r.status_code == 200, r.text
    return r.json()


def test_a_run_started_through_the_api_is_watched_survives_a_dashboard_restart_and_is_stopped(tmp_path, dashboard):
    with dashboard.client() as api:
        started = api.post("/api/runs", json=TRAIN)
        assert started.status_code == 202 and started.json()["state"] == "starting", started.text
        run_id, logdir = started.json()["run_id"], started.json()["logdir"]
        assert logdir == str(tmp_path / "runs" / run_id)

        def context() -> str:
            launcher = os.path.join(logdir, "launcher.log")
            return open(launcher).read()[-3000:] if os.path.exists(launcher) else "(no launcher.log)"

        page = wait_for(lambda: _run(api, run_id),
                        lambda p: p["run"]["state"] == "running" and p["run"]["global_step"] > 0
                        and all(t["state"] == "running" for t in p["run"]["tasks"].values()),
                        what="the run training with every task running", context=context)
        run = page["run"]
        assert list(run["tasks"]) == ["ps:0", "worker:0", "worker:1"] and run["backend"] == "local"
        assert run["script"] == str(ROOT / "examples" / "mnist_softmax.py") and run["args"] == TRAIN["args"]
        assert run["restart_policy"]["kind"] == "on-failure" and run["restart_policy"]["max_restarts"] == 2
        assert "launcher" not in run and "launch" not in run
        assert {e["kind"] for e in page["events"]} >= {"run_started", "task_started", "task_registered"}

        listed = api.get("/api/runs", params={"state": "running", "q": "softmax"}).json()
        assert [r["id"] for r in listed["runs"]] == [run_id] and listed["total"] == 1
        assert api.get("/api/runs", params={"q": "no-such-script"}).json()["total"] == 0

        series = wait_for(lambda: api.get(f"/api/runs/{run_id}/metrics", params={"name": ["loss", "global_step"]}).json(),
                          lambda m: len(m["series"].get("worker:0", {}).get("loss", [])) >= 2,
                          what="loss points of worker:0", context=context)["series"]
        steps = [p[2] for p in series["worker:0"]["global_step"]]
        assert steps == sorted(steps) and set(series["worker:0"]) == {"loss", "global_step"}
        last_time = series["worker:0"]["loss"][-1][0]
        newer = wait_for(lambda: api.get(f"/api/runs/{run_id}/metrics", params={"name": "loss", "after": last_time}).json(),
                         lambda m: m["series"], what="loss points newer than the last one read")["series"]
        assert all(p[0] > last_time for per in newer.values() for p in per["loss"])

        tail = api.get(f"/api/runs/{run_id}/tasks/worker:1/log").json()
        assert tail["size"] > 0 and tail["next_offset"] == tail["offset"] + len(tail["text"].encode())
        head = api.get(f"/api/runs/{run_id}/tasks/worker:1/log", params={"offset": 0, "max_bytes": 40}).json()
        on_disk = open(os.path.join(logdir, "logs", "worker-1.log"), "rb").read()
        assert head["text"].encode() == on_disk[:40] and head["next_offset"] == 40
        follow = api.get(f"/api/runs/{run_id}/tasks/worker:1/log", params={"offset": 40, "max_bytes": 100}).json()
        assert follow["offset"] == 40 and follow["text"].encode() == on_disk[40:140]

        prom = api.get("/metrics")
        assert prom.status_code == 200 and 'psflow_runs{state="running"} 1.0' in prom.text
        assert f'psflow_task_global_step{{run="{run_id}",task="worker:0"}}' in prom.text
        assert f'psflow_task_up{{run="{run_id}",task="ps:0"}} 1.0' in prom.text

        # ps shard health: the ps times its pushes and pulls and reports rate and p50/p99 with its progress
        live = wait_for(lambda: api.get(f"/api/runs/{run_id}/ps").json(),
                        lambda h: (h["ps"]["ps:0"]["push_rate"] or 0) > 0 and h["ps"]["ps:0"]["push_p99_ms"] is not None,
                        what="ps:0's live push rate and p99", context=context)["ps"]["ps:0"]
        assert 0 < live["push_p50_ms"] <= live["push_p99_ms"] and live["pull_rate"] is not None
        prom = api.get("/metrics").text
        assert f'psflow_ps_requests_per_second{{op="push",run="{run_id}",task="ps:0"}}' in prom, prom[-3000:]
        assert f'psflow_ps_request_latency_ms{{op="push",quantile="0.99",run="{run_id}",task="ps:0"}}' in prom

    # The dashboard goes down mid-run: the run goes on, and a new dashboard shows its whole history.
    events_before = len(page["events"])
    points_before = len(series["worker:0"]["loss"])
    dashboard.stop()
    with JobStore(dashboard.home / "jobs.db") as db:
        step_then = db.run(run_id)["global_step"]
    wait_for(lambda: JobStore(dashboard.home / "jobs.db").run(run_id)["global_step"], lambda s: s > step_then,
             what="training going on with the dashboard down", context=context)
    again = start_dashboard(dashboard.home, tmp_path / "runs")
    try:
        with again.client() as api:
            page = _run(api, run_id)
            assert page["run"]["state"] == "running" and page["run"]["global_step"] > step_then
            assert len(page["events"]) >= events_before
            loss = api.get(f"/api/runs/{run_id}/metrics", params={"name": "loss"}).json()["series"]["worker:0"]["loss"]
            assert len(loss) > points_before

            stopped = api.post(f"/api/runs/{run_id}/stop")
            assert stopped.status_code == 202, stopped.text
            page = wait_for(lambda: _run(api, run_id), lambda p: p["run"]["state"] == "stopped",
                            what="the run stopped", context=context)
            assert [(c["kind"], c["source"], c["state"]) for c in page["controls"]] == [("stop", "api", "done")]
            assert all(not pid_alive(t["pid"]) for t in page["run"]["tasks"].values())
            again_stop = api.post(f"/api/runs/{run_id}/stop")
            assert again_stop.status_code == 409 and "has already ended (stopped)" in again_stop.json()["detail"]

            summary = wait_for(lambda: api.get(f"/api/runs/{run_id}/summary").json(), lambda s: s["summary"],
                               what="the summary")["summary"]
            assert summary["status"] == "stopped" and summary["run_id"] == run_id
            ps = api.get(f"/api/runs/{run_id}/ps").json()
            assert ps["final"] and ps["ps"]["ps:0"]["stats"]["pushes"] > 0 and ps["version"] > 0
            assert all(w["lag"] is not None and w["lag"] >= 0 for w in ps["workers"].values())
            ckpts = api.get(f"/api/runs/{run_id}/checkpoints").json()["checkpoints"]
            assert ckpts and ckpts[0]["ok"] and ckpts[0]["step"] > 0
            placement = api.get(f"/api/runs/{run_id}/placement").json()
            assert placement["checkpoint"] == ckpts[0]["name"] and {r["param"] for r in placement["rows"]} == {"w", "b"}
            assert placement["shards"] == [{"shard": 0, "bytes": 784 * 10 * 4 + 10 * 4, "pieces": 2, "share": 1.0}]
            export = api.get(f"/api/runs/{run_id}/checkpoints/{ckpts[0]['name']}/export")
            assert export.status_code == 200 and "attachment" in export.headers["content-disposition"]
            (n,) = struct.unpack("<Q", export.content[:8])  # safetensors: header length, then the JSON header
            header = json.loads(export.content[8:8 + n])
            assert {"w", "b"} <= set(header), header.keys()
    finally:
        again.stop()


def _fake_logdir_run(home, logdir, run_id: str = "run-x") -> None:
    """A run recorded in the store by the real run store, with a real logdir (no training needed)."""
    (logdir / "logs").mkdir(parents=True)
    (logdir / "logs" / "worker-0.log").write_text("hello from worker:0\n")
    record = {"id": run_id, "script": "x.py", "args": [], "logdir": str(logdir), "cluster": {"worker": ["worker:0"]},
              "mode": "async", "strategy": "ps", "backend": "local", "restart_policy": {}, "launcher": None,
              "created_unix": time.time()}
    store = SqliteRunStore(home / "jobs.db", record, ["worker:0"], warn=print)
    store.finished("succeeded")


def test_changes_need_the_token_and_bad_forms_and_paths_are_refused_clearly(tmp_path, dashboard):
    _fake_logdir_run(dashboard.home, tmp_path / "logdir")
    (tmp_path / "secret.txt").write_text("not yours")
    with dashboard.client(token=None) as anon, dashboard.client(token="wrong-token") as wrong, dashboard.client() as api:
        for client in (anon, wrong):
            for path in ("/api/runs", "/api/runs/run-x/stop", "/api/runs/run-x/restart"):
                r = client.post(path, json=TRAIN)
                assert r.status_code == 401, (path, r.text)
                assert "needs the dashboard's token" in r.json()["detail"]
        assert anon.get("/api/runs").status_code == 200  # reads on loopback need none

        bad = api.post("/api/runs", json={**TRAIN, "ps": -1, "mode": "fast", "shell": "rm -rf /"})
        assert bad.status_code == 422
        problems = {tuple(d["loc"]): d["msg"] for d in bad.json()["detail"]}
        assert problems[("body", "ps")] == "Input should be greater than or equal to 0"
        assert problems[("body", "mode")] == "Input should be 'async', 'sync' or 'ssp'"
        assert problems[("body", "shell")] == "Extra inputs are not permitted"
        for script, says in (("../src/psflow/cli/run.py", "is not under an allowed directory"),
                             ("/etc/passwd", "is not under an allowed directory"),
                             ("README.md", "is not a Python file"), ("missing.py", "does not exist")):
            r = api.post("/api/runs", json={**TRAIN, "script": script})
            assert r.status_code == 422 and says in r.json()["detail"][0]["msg"], (script, r.text)
        r = api.post("/api/runs", json={**TRAIN, "args": "--epochs 1; rm -rf /"})
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "args"]
        r = api.post("/api/runs", json={**TRAIN, "restart": "sometimes"})
        assert r.status_code == 422 and "'sometimes' is not a restart policy" in r.json()["detail"][0]["msg"]
        r = api.post("/api/runs", json={**TRAIN, "ps": 1, "strategy": "ps", "mode": "async", "workers": 0})
        assert r.status_code == 422 and "--workers must be at least 1" in r.json()["detail"][0]["msg"]
        # GPUs per worker: a whole number, 0 or more; more than this machine has is refused, saying what it has
        r = api.post("/api/runs", json={**TRAIN, "gpus_per_worker": -1})
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "gpus_per_worker"]
        from psflow.launch.gpus import gpu_count

        r = api.post("/api/runs", json={**TRAIN, "gpus_per_worker": gpu_count() + 1})
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "gpus_per_worker"], r.text
        assert (f"GPUs per worker {gpu_count() + 1} for 2 training task(s) needs {2 * gpu_count() + 2} GPU(s), but this "
                f"machine has {gpu_count()}") in r.json()["detail"][0]["msg"]
        r = api.post("/api/runs", json={**TRAIN, "gpus_per_worker": 1, "backend": "slurm"})
        assert r.status_code == 422 and "placed by psflow on local runs only" in r.json()["detail"][0]["msg"], r.text
        with JobStore(dashboard.home / "jobs.db") as db:
            assert [r["id"] for r in db.runs()] == ["run-x"]  # nothing refused was started

        assert api.get("/api/runs/run-x/tasks/worker:0/log").json()["text"] == "hello from worker:0\n"
        for task in ("..%2F..%2Fsecret.txt", "worker:0%2F..%2F..%2F..%2Fsecret.txt", "%2E%2E"):
            r = api.get(f"/api/runs/run-x/tasks/{task}/log")
            assert r.status_code == 404 and "not yours" not in r.text, (task, r.text)
        r = api.get("/api/runs/run-x/tasks/%2E%2E/log")  # reaches the endpoint as the task ".."
        assert "'..' is not a task of run run-x. Its tasks: worker:0." in r.json()["detail"]
        for name in ("..%2F..%2Fsecret.txt", "ckpt-1%2F..%2F..%2F..", "ckpt-0000000001"):
            r = api.get(f"/api/runs/run-x/checkpoints/{name}/export")
            assert r.status_code == 404 and "not yours" not in r.text, (name, r.text)
        # a symlink planted in the run's logs that leads out of its directory
        log = tmp_path / "logdir" / "logs" / "worker-0.log"
        log.unlink()
        log.symlink_to(tmp_path / "secret.txt")
        r = api.get("/api/runs/run-x/tasks/worker:0/log")
        assert r.status_code == 404 and "outside the run's directory" in r.json()["detail"] and "not yours" not in r.text
        assert api.get("/api/runs/nope").status_code == 404


def test_concurrent_reads_are_all_answered(tmp_path, dashboard):
    """A page polls several endpoints at once: each request's connection is opened on one worker
    thread and used on another (a regression: SQLite refused that, and every request failed with 500)."""
    from concurrent.futures import ThreadPoolExecutor

    _fake_logdir_run(dashboard.home, tmp_path / "logdir")
    paths = ["/api/runs", "/api/runs/run-x", "/api/runs/run-x/metrics", "/api/runs/run-x/tasks/worker:0/log",
             "/api/runs/run-x/checkpoints", "/api/summary", "/metrics"] * 6
    with dashboard.client() as api, ThreadPoolExecutor(12) as pool:
        codes = list(pool.map(lambda p: (p, api.get(p).status_code), paths))
    assert all(code == 200 for _, code in codes), [c for c in codes if c[1] != 200]


def test_the_openapi_schema_is_served_and_describes_the_api(dashboard):
    with dashboard.client(token=None) as anon:
        schema = anon.get("/openapi.json").json()
        assert anon.get("/docs").status_code == 404  # Swagger UI would load its scripts from a CDN
    assert schema["openapi"].startswith("3.") and schema["info"]["title"] == "psflow"
    paths = schema["paths"]
    for path, method in (("/api/runs", "get"), ("/api/runs", "post"), ("/api/runs/{run_id}", "get"),
                         ("/api/runs/{run_id}/metrics", "get"), ("/api/runs/{run_id}/tasks/{task}/log", "get"),
                         ("/api/runs/{run_id}/stop", "post"), ("/api/runs/{run_id}/restart", "post"),
                         ("/api/runs/{run_id}/checkpoints/{name}/export", "get"), ("/api/summary", "get")):
        assert method in paths.get(path, {}), (path, method)
    form = schema["components"]["schemas"]["StartRun"]
    assert form["required"] == ["script"] and form["additionalProperties"] is False
    assert form["properties"]["mode"]["enum"] == ["async", "sync", "ssp"]
    assert form["properties"]["args"]["type"] == "array"
    body = paths["/api/runs"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/StartRun"}


def test_a_request_naming_another_host_is_refused_on_every_route_dns_rebinding(tmp_path):
    ui = start_dashboard(tmp_path / "home", tmp_path / "runs", extra=("--allowed-host", "dash.example"))
    try:
        with ui.client() as api:  # the token is no way around it
            for path in ("/api/runs", "/api/health", "/", "/metrics", "/api/runs/r/checkpoints/c/export", "/openapi.json"):
                r = api.get(path, headers={"Host": "evil.example"})
                assert r.status_code == 400, (path, r.status_code)
                detail = r.json()["detail"]
                assert "does not answer to Host 'evil.example'" in detail and "DNS rebinding" in detail
                assert "localhost, 127.0.0.1, [::1]" in detail and "--allowed-host NAME" in detail
            port = ui.url.rstrip("/").rsplit(":", 1)[1]
            for host in (f"127.0.0.1:{port}", f"localhost:{port}", "dash.example", f"DASH.example:{port}"):
                assert api.get("/api/runs", headers={"Host": host}).status_code == 200, host
    finally:
        ui.stop()


def test_a_dashboard_off_loopback_needs_an_explicit_flag_and_a_token(tmp_path):
    env = task_env(PSFLOW_HOME=str(tmp_path))
    env.pop("PSFLOW_UI_TOKEN", None)
    r = subprocess.run([PSFLOW, "ui", "--host", "0.0.0.0", "--port", "0"], capture_output=True, text=True, env=env,
                       timeout=60, cwd=ROOT)
    assert r.returncode == 2 and "--host 0.0.0.0 is reachable from other machines" in r.stderr and "--allow-remote" in r.stderr
    r = subprocess.run([PSFLOW, "ui", "--host", "0.0.0.0", "--port", "0", "--allow-remote"], capture_output=True,
                       text=True, env=env, timeout=60, cwd=ROOT)
    assert r.returncode == 2 and "needs a token of your own: set PSFLOW_UI_TOKEN" in r.stderr
    assert TOKEN not in r.stderr


def test_psflow_run_prints_where_the_dashboard_shows_it(tmp_path, dashboard):
    from conftest import SOFTMAX

    r = subprocess.run([PSFLOW, "run", "--ps", "1", "--workers", "1", "--no-live", "--logdir", str(tmp_path / "run"),
                        SOFTMAX, "--", "--epochs", "1", "--init", "zeros"], capture_output=True, text=True, timeout=240,
                       env=task_env(PSFLOW_HOME=str(dashboard.home)), cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    with dashboard.client() as api:
        (run,) = api.get("/api/runs").json()["runs"]
    assert f"psflow: dashboard: {dashboard.url}#/run/{run['id']}" in r.stdout
    dashboard.stop()  # gone: a later run says nothing of it
    assert not (dashboard.home / "ui.json").exists()
    r = subprocess.run([PSFLOW, "run", "--ps", "1", "--workers", "1", "--no-live", "--logdir", str(tmp_path / "run2"),
                        SOFTMAX, "--", "--epochs", "1", "--init", "zeros"], capture_output=True, text=True, timeout=240,
                       env=task_env(PSFLOW_HOME=str(dashboard.home)), cwd=ROOT)
    assert r.returncode == 0 and "psflow: dashboard:" not in r.stdout


@pytest.mark.long  # three runs, stopped and restarted through the API, ~35 s: make test-long
def test_restart_through_the_api_stops_the_run_and_launches_its_plan_again(tmp_path, dashboard):
    with dashboard.client() as api:
        run_id = api.post("/api/runs", json=TRAIN).json()["run_id"]
        wait_for(lambda: _run(api, run_id)["run"], lambda r: r["state"] == "running" and r["global_step"] > 0,
                 what="the run training")
        answer = api.post(f"/api/runs/{run_id}/restart")
        assert answer.status_code == 202, answer.text
        new_id = answer.json()["run_id"]
        assert new_id != run_id and answer.json()["restarts"] == run_id
        new = wait_for(lambda: api.get(f"/api/runs/{new_id}"), lambda r: r.status_code == 200
                       and r.json()["run"]["state"] == "running" and r.json()["run"]["global_step"] > 0,
                       what="the restarted run training").json()["run"]
        old = _run(api, run_id)
        assert old["run"]["state"] == "stopped" and old["controls"][0]["source"] == "api"
        assert new["restarted_from"] == run_id and new["logdir"] == old["run"]["logdir"]
        assert (new["args"], new["cluster"], new["restart_policy"]) == (old["run"]["args"], old["run"]["cluster"],
                                                                        old["run"]["restart_policy"])
        assert new["global_step"] >= old["run"]["global_step"]  # resumed from the final checkpoint
        assert api.post(f"/api/runs/{new_id}/stop").status_code == 202
        wait_for(lambda: _run(api, new_id)["run"]["state"], lambda s: s == "stopped", what="the restarted run stopped")

        # "restore here": the oldest checkpoint of the shared logdir (a newer one exists), into a new run
        ckpts = api.get(f"/api/runs/{new_id}/checkpoints").json()["checkpoints"]
        assert len(ckpts) >= 2 and all(c["ok"] for c in ckpts), ckpts
        first = ckpts[-1]
        assert set(first["data_position"]) == {"worker:0", "worker:1"}
        assert {"epoch", "batch_index"} <= set(first["data_position"]["worker:0"])
        assert api.post(f"/api/runs/{new_id}/checkpoints/ckpt-9/restore").status_code == 404
        restored = api.post(f"/api/runs/{new_id}/checkpoints/{first['name']}/restore")
        assert restored.status_code == 202, restored.text
        third = restored.json()
        assert third["logdir"] == str(tmp_path / "runs" / third["run_id"]) and third["checkpoint"] == first["name"]
        log = Path(third["logdir"]) / "logs" / "worker-0.log"
        said = f"restored from {third['logdir']}/checkpoints/{first['name']} at step {first['step']}"
        wait_for(lambda: log.read_text() if log.exists() else "", lambda text: said in text,
                 what=f"worker:0 saying: {said}")
        assert api.post(f"/api/runs/{third['run_id']}/stop").status_code in (202, 409)  # 409: it may have ended
        wait_for(lambda: _run(api, third["run_id"])["run"]["state"], lambda s: s in ("stopped", "succeeded"),
                 what="the restored run ended")


def test_a_restart_goes_on_when_the_dashboard_dies_right_after_it_was_asked(tmp_path, dashboard):
    # The wait for the old run's end lives in the new run's launcher (its own session), not in the
    # dashboard: SIGKILL the dashboard the moment it has answered, and the new run still starts.
    from psflow.platform.runcontrol import ask_stop, wait_until_over

    db_path = dashboard.home / "jobs.db"
    with dashboard.client() as api:
        run_id = api.post("/api/runs", json=TRAIN).json()["run_id"]
        wait_for(lambda: _run(api, run_id)["run"], lambda r: r["state"] == "running" and r["global_step"] > 0,
                 what="the run training")
        answer = api.post(f"/api/runs/{run_id}/restart")
    os.killpg(dashboard.proc.pid, signal.SIGKILL)
    dashboard.proc.wait(timeout=10)
    assert answer.status_code == 202, answer.text
    new_id = answer.json()["run_id"]

    def record(rid):
        with JobStore(db_path) as db:
            return db.run(rid, metrics=False)

    new = wait_for(lambda: record(new_id), lambda r: r is not None and r["state"] == "running" and r["global_step"],
                   what="the restarted run training with no dashboard")
    assert record(run_id)["state"] == "stopped" and new["restarted_from"] == run_id
    with JobStore(db_path) as db:
        asked = ask_stop(db, new_id, source="test")
    assert wait_until_over(db_path, new_id, timeout_s=120, request_id=asked.request_id)["state"] == "stopped"


def test_a_slowed_worker_is_named_a_persistent_straggler(tmp_path, dashboard, procs):
    from conftest import SOFTMAX, log_tails

    logdir = tmp_path / "run"
    launcher = subprocess.Popen([PSFLOW, "run", "--ps", "1", "--workers", "3", "--no-live", "--slow", "worker:2=0.02s",
                                 "--logdir", str(logdir), SOFTMAX, "--", "--epochs", "300", "--init", "zeros"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=task_env(PSFLOW_HOME=str(dashboard.home)),
                                cwd=ROOT, start_new_session=True)
    procs.append(launcher)
    with dashboard.client() as api:
        run_id = wait_for(lambda: api.get("/api/runs", params={"state": "running"}).json()["runs"], lambda r: r,
                          what="the run listed", context=lambda: log_tails(logdir))[0]["id"]
        found = wait_for(lambda: api.get(f"/api/runs/{run_id}/stragglers", params={"windows": 4}).json(),
                         lambda s: s["windows"] >= 4 and s["kind"] == "persistent", what="a persistent straggler",
                         context=lambda: log_tails(logdir))
        assert found["slowest"] == "worker:2", found
        assert found["workers"]["worker:2"]["vs_median"] < 0.5 and found["verdict"].startswith("worker:2 runs at")
        assert {"worker:0", "worker:1"} <= set(found["workers"]) and found["workers"]["worker:0"]["slow_windows"] == 0
        assert api.post(f"/api/runs/{run_id}/stop").status_code == 202
    assert launcher.wait(timeout=120) == 130


@pytest.mark.long  # ~30 s: make test-long
def test_dump_all_tasks_reads_every_tasks_stacks_back_grouped(tmp_path, dashboard, procs):
    from conftest import SOFTMAX, log_tails

    logdir = tmp_path / "run"
    launcher = subprocess.Popen([PSFLOW, "run", "--ps", "1", "--workers", "2", "--no-live", "--fail-at",
                                 "worker:1@step=50:stall=120", "--logdir", str(logdir), SOFTMAX, "--", "--epochs", "300",
                                 "--init", "zeros"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                env=task_env(PSFLOW_HOME=str(dashboard.home)), cwd=ROOT, start_new_session=True)
    procs.append(launcher)
    with dashboard.client() as api, dashboard.client(token=None) as anon:
        run = wait_for(lambda: api.get("/api/runs", params={"state": "running"}).json()["runs"],
                       lambda r: r and r[0]["global_step"] > 60, what="the run past step 60",
                       context=lambda: log_tails(logdir))[0]
        assert anon.post(f"/api/runs/{run['id']}/dump").status_code == 401
        assert api.get(f"/api/runs/{run['id']}/stacks").status_code == 404  # none asked for yet
        asked = api.post(f"/api/runs/{run['id']}/dump")
        assert asked.status_code == 202, asked.text
        request_id = asked.json()["request_id"]
        stacks = wait_for(lambda: api.get(f"/api/runs/{run['id']}/stacks", params={"request": request_id}).json(),
                          lambda s: s["state"] == "done" and len(s["tasks"]) == 3 and not s["waiting_for"],
                          what="every task's stacks read back", context=lambda: log_tails(logdir))
        assert stacks["answer"] == "stacks of 3 task(s) dumped into their logs"
        mains = {t: v["threads"][-1]["frames"] for t, v in stacks["tasks"].items()}
        assert set(mains) == {"ps:0", "worker:0", "worker:1"} and all(mains.values())
        # worker:1 sleeps in its injected stall: its main thread stands in psflow/fault.py, under the script
        assert any(f["file"].endswith("psflow/fault.py") for f in mains["worker:1"]), mains["worker:1"]
        assert any(f["file"].endswith("mnist_softmax.py") for f in mains["worker:1"])
        assert sorted(t for g in stacks["groups"] for t in g["tasks"]) == ["ps:0", "worker:0", "worker:1"]
        assert api.post(f"/api/runs/{run['id']}/stop").status_code == 202
    assert launcher.wait(timeout=120) == 130


def _sse(response, deadline: float):
    """The (event, data) messages of a Server-Sent Events response, until ``deadline`` (monotonic)."""
    event, data = None, []
    for line in response.iter_lines():
        if time.monotonic() > deadline:
            raise AssertionError("the stream did not deliver what was awaited before its deadline")
        if line.startswith("event: "):
            event = line[7:]
        elif line.startswith("data: "):
            data.append(line[6:])
        elif line == "" and event is not None:
            yield event, json.loads("\n".join(data))
            event, data = None, []


def test_the_live_stream_pushes_a_real_runs_task_states_and_metric_points_and_ends_with_it(tmp_path, dashboard):
    with dashboard.client() as api:
        started = api.post("/api/runs", json=TRAIN)
        assert started.status_code == 202 and started.json()["state"] == "starting", started.text
        run_id = started.json()["run_id"]
        states_seen: list[dict[str, str]] = []
        loss_points = 0
        deadline = time.monotonic() + 150
        with api.stream("GET", f"/api/runs/{run_id}/stream", params={"name": ["loss"]}) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            for event, data in _sse(r, deadline):
                if event == "run":
                    states_seen.append({t: v["state"] for t, v in data["run"]["tasks"].items()})
                elif event == "metrics":
                    assert set(data["series"].get("worker:0", {"loss": []})) == {"loss"}  # only the names asked
                    loss_points += sum(len(per["loss"]) for per in data["series"].values())
                if loss_points >= 2 and any(s.get("worker:0") == "running" for s in states_seen):
                    break
        # worker:0 seen running (with the fork server its tasks may run before the stream opens, so the
        # state change that is certainly pushed is the stop below: asked after the stream opened)
        assert "running" in [s.get("worker:0") for s in states_seen], states_seen

        # a reconnect naming the last metrics message it got (its cursor) is sent only newer points, no
        # history; the stop is pushed, then `end`
        with api.stream("GET", f"/api/runs/{run_id}/stream", params={"name": ["loss"]},
                        headers={"Last-Event-ID": str(2 ** 62)}) as r:
            assert api.post(f"/api/runs/{run_id}/stop").status_code == 202
            events = []
            for event, data in _sse(r, time.monotonic() + 120):
                events.append((event, data))
                if event == "end":
                    break
        assert [e for e, _ in events if e == "metrics"] == []  # nothing after a cursor past every point
        assert events[-1] == ("end", {"state": "stopped"})
        assert [d["run"]["state"] for e, d in events if e == "run"][-1] == "stopped"

        anon_ok = dashboard.client(token=None).get(f"/api/runs/{run_id}/stream")  # reading is open on loopback
        assert anon_ok.status_code == 200 and "event: end" in anon_ok.text
    assert dashboard.client().get("/api/runs/no-such-run/stream").status_code == 404


def test_an_open_stream_of_a_live_run_does_not_hold_the_dashboard_up_at_shutdown(tmp_path, dashboard):
    record = {"id": "run-live", "script": "x.py", "args": [], "logdir": str(tmp_path / "l"), "cluster": {"worker": ["worker:0"]},
              "mode": "async", "strategy": "ps", "backend": "local", "restart_policy": {}, "launcher": None,
              "created_unix": time.time()}
    store = SqliteRunStore(dashboard.home / "jobs.db", record, ["worker:0"], warn=print)
    store.task_started("worker:0", 0, None)
    try:
        with dashboard.client() as api:
            wait_for(lambda: api.get("/api/runs/run-live").status_code, lambda c: c == 200, what="the run recorded")
            with api.stream("GET", "/api/runs/run-live/stream") as r:
                first = next(_sse(r, time.monotonic() + 30))
                assert first[0] == "run" and first[1]["run"]["state"] == "running"
                began = time.monotonic()
                dashboard.proc.send_signal(signal.SIGTERM)
                dashboard.proc.wait(timeout=15)  # would hang on the open stream without psflow ui's `closing`
                assert time.monotonic() - began < 15
    finally:
        store.finished("stopped")
