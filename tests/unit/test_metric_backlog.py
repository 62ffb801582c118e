"""A store from before the metric summaries (schema 3) is migrated without reading its points (the
migration's write transaction stays short however many there are); its runs are summed up later,
series by series, each in its own transaction; charts are right before and after; and a read-only
``psflow runs`` lists an old store's runs instead of refusing it. Real SQLite files."""

from __future__ import annotations

import random
import sqlite3
import threading
from pathlib import Path

from psflow.platform import metricstore
from psflow.platform.downsample import bucket_of, buckets, minmax
from psflow.platform.jobstore import JobStore
from psflow.platform.schema import LATEST, migrate

RUNS = ("run-a", "run-b", "run-c")
TASKS = ("worker:0", "worker:1")


def _points(run: str, task: str, name: str, n: int) -> list[tuple[float, int, float]]:
    rng = random.Random(f"{run}{task}{name}")
    return [(1000.0 + k, k * 10, float(rng.randint(0, 50))) for k in range(n)]


SIZES = {"run-a": 12_000, "run-b": 600, "run-c": 0}  # points per series; run-c has none


def _old_store(path: Path) -> None:
    """A schema-3 store (as psflow wrote it before the summaries), its points in the order written."""
    with JobStore(path, migrate_to=3) as db, db.transaction():
        for i, run in enumerate(RUNS):
            db.add_run({"id": run, "script": "x.py", "logdir": f"/tmp/{run}", "created_unix": 1000.0 + i}, list(TASKS))
            series = {(task, name): _points(run, task, name, SIZES[run]) for task in TASKS for name in ("loss", "acc")}
            rows = [(run, task, name, *series[task, name][k]) for k in range(SIZES[run]) for task, name in series]
            db.conn.executemany("INSERT INTO metrics (run_id, task, name, time_unix, step, value) VALUES (?, ?, ?, ?, ?, ?)",
                                rows)


def _extremes(points: list[list], xi: int, lo: float, hi: float) -> dict[int, tuple[float, float]]:
    """Each min/max bucket's lowest and highest value."""
    n, out = buckets(1000), {}
    for p in points:
        b = bucket_of(p[xi], lo, hi, n)
        low, high = out.get(b, (p[2], p[2]))
        out[b] = (min(low, p[2]), max(high, p[2]))
    return out


def _check_chart(db: JobStore, written: JobStore | None = None) -> None:
    """``db``'s charts are right: each bucket's extremes those of every point (a series not summed up
    is read from its points), or (``written``) the very charts of a store the writer kept summed up
    all along (a long series is read from its blocks, whose extremes stand for it)."""
    for x, xi in (("time", 0), ("step", 1)):
        chart, _ = db.chart("run-a", x=x, max_points=1000)
        assert set(chart) == set(TASKS) and all(set(chart[t]) == {"loss", "acc"} for t in TASKS)
        if written is not None:
            assert chart == written.chart("run-a", x=x, max_points=1000)[0]
            continue
        for task in TASKS:
            want = _points("run-a", task, "loss", SIZES["run-a"])
            got = chart[task]["loss"]
            assert len(got) <= 1000 and got[0] == list(want[0]) and got[-1] == list(want[-1])
            lo, hi = want[0][xi], want[-1][xi]
            theirs = minmax(want, 1000, x=xi)  # the pure downsampler's cut of every point
            assert _extremes(got, xi, lo, hi) == _extremes([list(p) for p in theirs], xi, lo, hi), (x, task)
    short = db.chart("run-b", max_points=1000)[0]
    assert short["worker:1"]["acc"] == [list(p) for p in _points("run-b", "worker:1", "acc", SIZES["run-b"])]
    assert db.latest_metrics("run-a") == {t: {n: _points("run-a", t, n, SIZES["run-a"])[-1][2] for n in ("loss", "acc")}
                                          for t in TASKS}
    assert db.latest_time("run-a", "loss") == 1000.0 + SIZES["run-a"] - 1
    assert db.chart("run-c")[0] == {} and db.latest_metrics("run-c") == {}


def test_the_migration_reads_no_point_and_the_runs_are_summed_up_later_series_by_series(tmp_path):
    path = tmp_path / "jobs.db"
    _old_store(path)
    conn = sqlite3.connect(path, isolation_level=None)
    statements: list[str] = []
    conn.set_trace_callback(statements.append)
    assert migrate(conn, str(path)) == LATEST
    conn.set_trace_callback(None)
    # of the migration's statements, only the step index's build and one probe per run touch the points
    on_points = [" ".join(s.split()) for s in statements if " metrics" in " ".join(s.split()).replace("(", " ")
                 and "CREATE TABLE" not in s]
    assert on_points == ["CREATE INDEX metrics_by_step ON metrics (run_id, task, name, step)",
                         "INSERT INTO metric_backlog SELECT id FROM runs WHERE EXISTS (SELECT 1 FROM metrics WHERE "
                         "metrics.run_id = runs.id) AND NOT EXISTS (SELECT 1 FROM metric_series WHERE "
                         "metric_series.run_id = runs.id)"], statements
    plan = " | ".join(r[3] for r in conn.execute("EXPLAIN QUERY PLAN " + on_points[1].split(" ", 3)[3]))
    assert "SCAN metrics" not in plan and "SEARCH metrics USING COVERING INDEX" in plan, plan
    assert [r[0] for r in conn.execute("SELECT run_id FROM metric_backlog ORDER BY run_id")] == ["run-a", "run-b"]
    assert conn.execute("SELECT COUNT(*) FROM metric_series").fetchone()[0] == 0
    conn.close()

    with JobStore(path, read_only=True) as reader:  # not summed up yet: read from the points, right
        _check_chart(reader)
    with JobStore(path) as db, JobStore(tmp_path / "new.db") as written:
        _old_store_written(written)
        # a live writer meanwhile: a point of an old series (not summed up: the points only) and of a new one
        with db.transaction():
            db.task_progress("run-b", "worker:0", {}, 5000.0, [("loss", 7.0, 99_990), ("eval/acc", 0.5, 99_990)])
        assert db.conn.execute("SELECT COUNT(*) FROM metric_series").fetchone()[0] == 0
        transactions: list[int] = []
        db.conn.set_trace_callback(lambda s: transactions.append(1) if s.startswith("BEGIN IMMEDIATE") else None)
        db.chart("run-a")  # the first chart of run-a sums it up: one transaction per series, and one to say so
        db.chart("run-a", x="step")  # ... and no later one takes the write lock
        db.conn.set_trace_callback(None)
        assert len(transactions) == 2 * len(TASKS) + 1
        assert metricstore.backlog(db.conn) == ["run-b"] and db.summarise_backlog(budget_s=60) == 0  # the background's
        _check_chart(db, written)
        assert db.latest_metrics("run-b")["worker:0"] == {"loss": 7.0, "acc": _points("run-b", "worker:0", "acc", 600)[-1][2],
                                                          "eval/acc": 0.5}
        for table in ("metric_series", "metric_blocks"):  # exactly what the writer keeps, point by point
            rows = [sorted(tuple(r) for r in d.conn.execute(f"SELECT * FROM {table}")) for d in (db, written)]
            assert rows[0] == rows[1] and rows[0], table


def _old_store_written(db: JobStore) -> None:
    with db.transaction():
        for i, run in enumerate(RUNS):
            db.add_run({"id": run, "script": "x.py", "logdir": f"/tmp/{run}", "created_unix": 1000.0 + i}, list(TASKS))
            series = {(task, name): _points(run, task, name, SIZES[run]) for task in TASKS for name in ("loss", "acc")}
            for k in range(SIZES[run]):
                for (task, name), points in series.items():
                    t, s, v = points[k]
                    db.task_progress(run, task, {}, t, [(name, v, s)])
        db.task_progress("run-b", "worker:0", {}, 5000.0, [("loss", 7.0, 99_990), ("eval/acc", 0.5, 99_990)])


def test_psflow_runs_lists_an_old_stores_runs_read_only_and_says_it_will_be_upgraded(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from psflow.cli import main

    _old_store(tmp_path / "jobs.db")
    monkeypatch.setenv("PSFLOW_HOME", str(tmp_path))
    for args in (["runs"], ["runs", "--json"]):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 0, result.output
        assert all(run in result.stdout for run in RUNS), result.stdout
        assert "schema version 3" in result.stderr and "next psflow that writes it" in result.stderr
    with JobStore(tmp_path / "jobs.db", read_only=True) as db:  # the metrics of an old store, from its points
        _check_chart(db)
        assert db.version == 3

    # the next writer (here the dashboard's background summing up) upgrades it, and sums it all up
    from psflow.platform.uiserver import summarise_backlog

    summarise_backlog(tmp_path / "jobs.db", threading.Event(), pause_s=0.01)
    with JobStore(tmp_path / "jobs.db") as db:
        assert db.version == LATEST and metricstore.backlog(db.conn) == [] and not metricstore.pending(db.conn, "run-a")
        assert db.conn.execute("SELECT SUM(n) FROM metric_series").fetchone()[0] == 4 * (SIZES["run-a"] + SIZES["run-b"])
    result = CliRunner().invoke(main, ["runs"])
    assert result.exit_code == 0 and "schema version" not in result.stderr
