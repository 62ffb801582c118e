"""The dashboard's API over a long run (issue 25 item 1): its chart data is bounded and keeps the
spike, zooms come at full resolution, live reads return only what is new, the runs list pages by keys."""

from __future__ import annotations

import json
import random
import time

import pytest

from psflow.platform import metricstore
from psflow.platform.jobstore import JobStore

HEAVY = "run-heavy"
SPIKE = 13_337


@pytest.fixture()
def client(tmp_path):
    from fastapi.testclient import TestClient

    from psflow.platform.api import UiSettings, create_app

    rng = random.Random(1)
    with JobStore(tmp_path / "jobs.db") as db, db.transaction():
        for i in range(30):
            run_id = HEAVY if i == 29 else f"run-{i:02d}"
            db.add_run({"id": run_id, "script": "x.py", "logdir": str(tmp_path / run_id), "created_unix": 1000.0 + i // 2},
                       ["worker:0", "worker:1"])  # two runs per second: ties in time, told apart by id
        for k in range(20_000):
            value = 99.0 if k == SPIKE else rng.random()
            metricstore.write(db.conn, HEAVY, "worker:0", 2000.0 + k, [("loss", value, k), ("accuracy", rng.random(), k)])
        db.finish_run(HEAVY, "succeeded", time.time())
    return TestClient(create_app(UiSettings(home=tmp_path, token="t")), base_url="http://127.0.0.1")


def test_the_heavy_runs_chart_data_is_bounded_and_keeps_the_spike(client):
    answer = client.get(f"/api/runs/{HEAVY}/metrics", params={"name": ["loss", "accuracy"]}).json()
    loss = answer["series"]["worker:0"]["loss"]
    assert len(loss) <= 1000 and len(answer["series"]["worker:0"]["accuracy"]) <= 1000
    assert [2000.0 + SPIKE, SPIKE, 99.0] in loss
    assert loss[0][1] == 0 and loss[-1][1] == 19_999 and answer["x"] == "time"
    few = client.get(f"/api/runs/{HEAVY}/metrics", params={"name": "loss", "max_points": 50}).json()
    assert len(few["series"]["worker:0"]["loss"]) <= 50 and [2000.0 + SPIKE, SPIKE, 99.0] in few["series"]["worker:0"]["loss"]
    # zoomed in by step: every point of the range, up to the bound
    zoom = client.get(f"/api/runs/{HEAVY}/metrics", params={"name": "loss", "x": "step", "lo": 13_000, "hi": 13_799}).json()
    assert [p[1] for p in zoom["series"]["worker:0"]["loss"]] == list(range(13_000, 13_800))
    assert client.get(f"/api/runs/{HEAVY}/metrics", params={"x": "epoch"}).status_code == 422


def test_a_live_read_from_the_cursor_returns_only_the_new_points(client, tmp_path):
    cursor = client.get(f"/api/runs/{HEAVY}/metrics", params={"name": "loss"}).json()["cursor"]
    assert client.get(f"/api/runs/{HEAVY}/metrics", params={"cursor": cursor}).json()["series"] == {}
    with JobStore(tmp_path / "jobs.db") as db, db.transaction():
        db.task_progress(HEAVY, "worker:1", {}, 90_000.0, [("loss", 0.5, 60_000), ("accuracy", 0.75, 60_000)])
        db.task_progress("run-03", "worker:0", {}, 90_001.0, [("loss", 0.1, 1)])  # another run's: not this one's
    new = client.get(f"/api/runs/{HEAVY}/metrics", params={"cursor": cursor, "name": "loss"}).json()
    assert new["series"] == {"worker:1": {"loss": [[90_000.0, 60_000, 0.5]]}} and new["cursor"] > cursor
    assert client.get(f"/api/runs/{HEAVY}/metrics", params={"cursor": new["cursor"]}).json()["series"] == {}


def test_the_stream_of_a_long_run_sends_its_history_bounded_with_its_cursor(client):
    text = client.get(f"/api/runs/{HEAVY}/stream", params={"name": "loss"}).text
    events = {}
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if not line.startswith(":"))
        events[lines["event"]] = (lines.get("id"), json.loads(lines["data"]))
    cursor, metrics = events["metrics"]
    assert metrics["history"] is True and cursor == str(metrics["cursor"]) and int(cursor) > 0
    assert len(metrics["series"]["worker:0"]["loss"]) <= 1000 and [2000.0 + SPIKE, SPIKE, 99.0] in metrics["series"]["worker:0"]["loss"]
    assert events["end"][1] == {"state": "succeeded"}


def test_the_runs_list_pages_by_keys_older_and_newer_without_losing_or_repeating_a_run(client):
    seen, page, offsets = [], client.get("/api/runs", params={"limit": 7}).json(), []
    while True:
        seen += [r["id"] for r in page["runs"]]
        offsets.append(page["offset"])
        if page["older"] is None:
            break
        page = client.get("/api/runs", params={"limit": 7, "before": page["older"]}).json()
    assert len(seen) == len(set(seen)) == 30 == page["total"] and seen[0] == HEAVY
    assert offsets == [0, 7, 14, 21, 28]
    back = client.get("/api/runs", params={"limit": 7, "after": page["newer"]}).json()
    assert [r["id"] for r in back["runs"]] == seen[21:28] and back["offset"] == 21
    failed = client.get("/api/runs", params={"limit": 7, "state": "succeeded"}).json()
    assert [r["id"] for r in failed["runs"]] == [HEAVY] and failed["older"] is None and failed["newer"] is None
    bad = client.get("/api/runs", params={"before": "yesterday:run-1"})
    assert bad.status_code == 422 and "CREATED:ID" in bad.text


def test_stragglers_read_only_the_span_they_judge_and_judge_it_as_over_every_point(tmp_path, monkeypatch):
    from fastapi.testclient import TestClient

    from psflow.platform.api import UiSettings, create_app
    from psflow.platform.stragglers import StragglerRules, find_stragglers

    steps: dict[str, list[tuple[float, float]]] = {"worker:0": [], "worker:1": []}
    with JobStore(tmp_path / "jobs.db") as db, db.transaction():
        db.add_run({"id": "run-s", "script": "x.py", "logdir": str(tmp_path), "created_unix": 1.0}, ["worker:0", "worker:1"])
        for k in range(3000):  # worker:1 at half speed for the first 2,500 s, then as fast as worker:0
            for task, step in (("worker:0", 10 * k), ("worker:1", 5 * k if k < 2500 else 12_500 + 10 * (k - 2500))):
                db.task_progress("run-s", task, {}, 100.0 + k, [("local_step", step, None)])
                steps[task].append((100.0 + k, float(step)))
    client = TestClient(create_app(UiSettings(home=tmp_path, token="t")), base_url="http://127.0.0.1")
    read, metrics = [], JobStore.metrics

    def counted(self, *args, **kw):
        points = metrics(self, *args, **kw)
        read.append(len(points))
        return points

    monkeypatch.setattr(JobStore, "metrics", counted)
    for span in (300.0, 1000.0):
        answer = client.get("/api/runs/run-s/stragglers", params={"windows": 5, "span_s": span}).json()
        assert {k: v for k, v in answer.items() if k != "run_id"} == find_stragglers(steps, StragglerRules(windows=5, span_s=span))
    assert read == [2 * 301, 2 * 1001]  # the span, of each worker: not its 6,000 points
    assert client.get("/api/runs/run-s/stragglers", params={"windows": 5, "span_s": 1000.0}).json()["slowest"] == "worker:1"
