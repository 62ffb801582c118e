"""Metric points in the job store (psflow.platform.metricstore): bounded charts that keep the spikes,
the live cursor, the blocks the migration fills, and the indexes every read walks (EXPLAIN QUERY PLAN)."""

from __future__ import annotations

import random
import sqlite3
from pathlib import Path

import pytest

from psflow.platform import metricstore
from psflow.platform.downsample import bucket_of, buckets, minmax
from psflow.platform.jobstore import JobStore

RUN = "run-big"


def _store(path: Path, runs: tuple[str, ...] = (RUN,), *, version: int | None = None) -> JobStore:
    db = JobStore(path) if version is None else JobStore(path, migrate_to=version)
    with db.transaction():
        for i, run_id in enumerate(runs):
            db.add_run({"id": run_id, "script": "x.py", "logdir": "/tmp/x", "created_unix": 1000.0 + i},
                       ["worker:0", "worker:1"])
    return db


def _series(n: int, seed: int = 0, *, spike_at: int | None = None) -> list[tuple[float, int, float]]:
    rng = random.Random(seed)
    out = [(1000.0 + k, k * 10, float(rng.randint(0, 50))) for k in range(n)]  # ties among the values
    if spike_at is not None:
        out[spike_at] = (out[spike_at][0], out[spike_at][1], 1e6)
    return out


def _write(db: JobStore, points: list[tuple[float, int, float]], task: str = "worker:0", run_id: str = RUN) -> None:
    with db.transaction():
        for t, s, v in points:
            db.task_progress(run_id, task, {}, t, [("loss", v, s)])


def test_a_range_of_a_few_thousand_points_is_cut_in_sqlite_as_the_pure_downsampler_cuts_it(tmp_path):
    points = _series(5000, seed=3)
    with _store(tmp_path / "jobs.db") as db:
        _write(db, points)
        for x, xi in (("time", 0), ("step", 1)):
            got = db.chart(RUN, names=["loss"], x=x, max_points=1000)[0]["worker:0"]["loss"]
            want = minmax(points, 1000, x=xi)
            assert len(got) <= 1000 and got[0] == list(points[0]) and got[-1] == list(points[-1])
            n, lo, hi = buckets(1000), points[0][xi], points[-1][xi]
            for b in range(n):  # the same extremes in every bucket (ties may pick another point of equal value)
                mine = [p[2] for p in got if bucket_of(p[xi], lo, hi, n) == b]
                theirs = [p[2] for p in want if bucket_of(p[xi], lo, hi, n) == b]
                assert (min(mine), max(mine)) == (min(theirs), max(theirs)), (x, b)


def test_a_long_series_is_drawn_from_its_blocks_bounded_and_with_its_spike(tmp_path):
    points = _series(40_000, seed=5, spike_at=23_456)
    with _store(tmp_path / "jobs.db") as db:
        _write(db, points)
        _write(db, _series(300, seed=6), task="worker:1")
        chart, cursor = db.chart(RUN, names=["loss"], max_points=1000)
        got = chart["worker:0"]["loss"]
        assert len(got) <= 1000 and list(points[23_456]) in got
        assert got[0] == list(points[0]) and got[-1] == list(points[-1])
        assert [p[0] for p in got] == sorted(p[0] for p in got)
        assert chart["worker:1"]["loss"] == [list(p) for p in _series(300, seed=6)]  # short: whole
        assert cursor == db.conn.execute("SELECT MAX(rowid) FROM metrics").fetchone()[0]
        # zoomed in by step to 900 points: every one of them, as written
        zoom = db.chart(RUN, names=["loss"], task="worker:0", x="step", lo=100_000, hi=108_990)[0]["worker:0"]["loss"]
        assert zoom == [list(p) for p in points[10_000:10_900]]
        # zoomed to 20,000 points by time: bounded, its ends and the spike in it kept
        part = db.chart(RUN, names=["loss"], task="worker:0", lo=1000.0 + 15_000, hi=1000.0 + 34_999.5)[0]["worker:0"]["loss"]
        assert len(part) <= 1000 and list(points[23_456]) in part
        assert part[0] == list(points[15_000]) and part[-1] == list(points[34_999])


def test_the_live_cursor_returns_only_the_points_written_after_it(tmp_path):
    with _store(tmp_path / "jobs.db", (RUN, "run-other")) as db:
        _write(db, _series(50))
        _, cursor = db.chart(RUN)
        assert db.metrics_since(RUN, cursor) == ([], cursor)
        _write(db, [(2000.0, 999, 0.5)], run_id="run-other")
        _write(db, [(2001.0, 1000, 0.25), (2002.0, 1010, 0.125)], task="worker:1")
        points, after = db.metrics_since(RUN, cursor)
        assert [(p["task"], p["time_unix"], p["value"]) for p in points] == [("worker:1", 2001.0, 0.25),
                                                                              ("worker:1", 2002.0, 0.125)]
        assert after > cursor and db.metrics_since(RUN, after) == ([], after)
        assert db.metrics_since(RUN, cursor, names=["accuracy"])[0] == []
        first, mid = db.metrics_since(RUN, cursor, limit=1)  # a long gap: read in pieces, none skipped
        assert [p["time_unix"] for p in first] == [2001.0] and db.metrics_since(RUN, mid)[0][0]["time_unix"] == 2002.0


def test_the_migration_sums_up_old_points_as_the_writer_does(tmp_path):
    points = _series(1000, seed=9, spike_at=500)
    with _store(tmp_path / "old.db", version=3) as old:
        with old.transaction():
            old.conn.executemany("INSERT INTO metrics (run_id, task, name, time_unix, step, value) VALUES (?, ?, ?, ?, ?, ?)",
                                 [(RUN, "worker:0", "loss", t, s, v) for t, s, v in points])
    with JobStore(tmp_path / "old.db") as migrated, _store(tmp_path / "new.db") as new:
        _write(new, points)
        assert migrated.summarise(RUN)  # later than the migration, its own transactions (test_metric_backlog.py)
        for table in ("metric_series", "metric_blocks"):
            rows = [sorted(tuple(r) for r in db.conn.execute(f"SELECT * FROM {table}")) for db in (migrated, new)]
            assert rows[0] == rows[1] and rows[0], table
        assert migrated.latest_metrics(RUN) == {"worker:0": {"loss": points[-1][2]}}


def _plans(db: JobStore, read) -> list[str]:
    """The query plan of every statement ``read(db)`` runs."""
    statements: list[str] = []
    db.conn.set_trace_callback(statements.append)
    try:
        read(db)
    finally:
        db.conn.set_trace_callback(None)
    plans = []
    for sql in statements:
        if sql.lstrip().upper().startswith("SELECT"):
            plans.append(" | ".join(r[3] for r in db.conn.execute("EXPLAIN QUERY PLAN " + sql)))
    return plans


READS = {
    "chart by time": (lambda db: db.chart(RUN, max_points=100), "metrics_by_series"),
    "chart by step": (lambda db: db.chart(RUN, x="step", lo=0, hi=5000, max_points=100), "metrics_by_step"),
    "points by time": (lambda db: db.metrics(RUN, after_unix=1500.0), "metrics_by_series"),
    "runs list, keyset": (lambda db: db.run_page(limit=2, before=(1001.5, "run-z")), "runs_by_created_id"),
    "runs list, a state": (lambda db: db.run_page(state="pending", limit=2, after=(1000.5, "")), "runs_by_state_created_id"),
}


@pytest.mark.parametrize("read", list(READS))
def test_each_read_walks_its_index_and_a_dropped_index_is_seen(tmp_path, read):
    fn, index = READS[read]
    with _store(tmp_path / "jobs.db", (RUN, "run-b", "run-c")) as db:
        _write(db, _series(3000, seed=1))
        plans = _plans(db, fn)
        # no read goes through every point; counting the runs may go through an index of them
        assert plans and not [p for p in plans if "SCAN metrics" in p or "SCAN runs |" in p + " |"], plans
        assert any(index in p for p in plans), plans
    with sqlite3.connect(tmp_path / "jobs.db") as conn:
        conn.execute(f"DROP INDEX {index}")
    with JobStore(tmp_path / "jobs.db") as db:
        assert not any(index in p for p in _plans(db, fn))


def test_the_live_cursor_reads_a_rowid_range_not_the_runs_history(tmp_path):
    with _store(tmp_path / "jobs.db") as db:
        _write(db, _series(3000))
        plans = _plans(db, lambda d: d.metrics_since(RUN, 2990))
        assert any("INTEGER PRIMARY KEY (rowid>? AND rowid<?)" in p for p in plans), plans
        assert not any("INDEX" in p for p in plans), plans  # the run's index would read its whole history


def test_a_long_series_chart_costs_about_what_a_short_one_costs(tmp_path):
    """64,000 points in one series against 4,000: its chart runs about as many SQLite instructions (it
    reads the extremes of coarser blocks, not points), and a live look from a cursor reads only what is new."""
    with _store(tmp_path / "jobs.db") as db:
        with db.transaction():
            for n, task in ((4_000, "worker:1"), (64_000, "worker:0")):
                rng = random.Random(n)
                for k in range(n):
                    metricstore.write(db.conn, RUN, task, 1000.0 + k, [("loss", rng.random(), k)])  # type: ignore[arg-type]
        cost = {t: _instructions(db, lambda d, t=t: d.chart(RUN, task=t, max_points=10)) for t in ("worker:1", "worker:0")}
        assert _instructions(db, lambda d: d.metrics_since(RUN, 0)) > 50 * cost["worker:0"]  # reading every point
        assert cost["worker:0"] < 2 * cost["worker:1"] + 5, cost
        _, cursor = db.chart(RUN, max_points=10)
        _write(db, [(200_000.0, 0, 1.0)])
        assert _instructions(db, lambda d: d.metrics_since(RUN, cursor)) < 5


def _instructions(db: JobStore, read) -> int:
    """SQLite virtual-machine instructions ``read(db)`` runs (in hundreds): the work, not the clock."""
    count = [0]

    def tick() -> int:
        count[0] += 1
        return 0

    db.conn.set_progress_handler(tick, 100)
    try:
        read(db)
    finally:
        db.conn.set_progress_handler(None, 100)
    return count[0]
