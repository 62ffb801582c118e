"""Metric points in the job store, written and read so that a read costs what it shows, not the run's length.

Each point is a row of ``metrics`` (run, task, name, time, step, value). Beside them, kept by the
same write (schema version 4):

- ``metric_series``: per series (run, task, name) its number of points and its latest point: a
  run's latest metrics and its series are read without touching its points;
- ``metric_blocks``: per block of 16, 256 and 4096 points of a series (in the order written; levels
  0, 1, 2) their time and step range and where their lowest and highest value lie: a chart of a
  long series is drawn from the extremes of the finest blocks of which its range holds at most
  ``BLOCKS_PER_POINT`` x ``max_points``, each block's min and max kept. So a chart reads a bounded
  number of rows whatever the series' length (up to 4096 x that bound: tens of millions of points).

Points from before version 4 are summed up later, not by the migration: ``metric_backlog`` lists
their runs; :func:`summarise_series` sums up one series, in its own short transaction
(:meth:`psflow.platform.jobstore.JobStore.summarise`). Until then that series is read from its
points (as is an older store read as it stands), and the writer adds its points to ``metrics`` only.

Reads:

- :func:`chart`: a bounded number of points per series for a range of x (time or step), min/max
  buckets (:mod:`psflow.platform.downsample`): a range with few points is read whole (index range
  scans), a longer one from its blocks (whole blocks by their extremes, the two blocks at its ends
  point by point);
- :func:`since`: the points written after a cursor (the ``metrics`` rowid, which grows in commit
  order with one writer per run), for live updates: a rowid range scan, so it costs what is new;
- :func:`latest`, :func:`series`.

Called by :class:`psflow.platform.jobstore.JobStore`.
"""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Iterator, Sequence
from typing import Any

from psflow.platform.downsample import buckets, minmax

LEVELS = 3  # blocks of 16 ** (level + 1) points: a block's extremes stand for it in a long chart
RAW_FACTOR = 8  # a range of up to RAW_FACTOR x max_points points is read point by point
BLOCKS_PER_POINT = 8  # ... a longer one from the finest blocks of which it holds at most this x max_points
X_COLUMNS = {"time": "time_unix", "step": "step"}
Series = dict[str, dict[str, list[list[Any]]]]  # task -> name -> [[time, step, value], ...]

_UPSERT_SERIES = """INSERT INTO metric_series (run_id, task, name, n, time_unix, step, value) VALUES (?, ?, ?, 1, ?, ?, ?)
    ON CONFLICT (run_id, task, name) DO UPDATE SET n = n + 1, time_unix = excluded.time_unix, step = excluded.step,
    value = excluded.value"""
_LOWER = "excluded.vmin IS NOT NULL AND (vmin IS NULL OR excluded.vmin < vmin)"
_HIGHER = "excluded.vmax IS NOT NULL AND (vmax IS NULL OR excluded.vmax > vmax)"
_UPSERT_BLOCK = f"""INSERT INTO metric_blocks VALUES (?, ?, ?, ?, ?, 1, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
    ON CONFLICT (run_id, task, name, level, block) DO UPDATE SET n = n + 1,
    t0 = MIN(t0, excluded.t0), t1 = MAX(t1, excluded.t1),
    s0 = COALESCE(MIN(s0, excluded.s0), s0, excluded.s0), s1 = COALESCE(MAX(s1, excluded.s1), s1, excluded.s1),
    tmin = CASE WHEN {_LOWER} THEN excluded.tmin ELSE tmin END,
    smin = CASE WHEN {_LOWER} THEN excluded.smin ELSE smin END,
    vmin = CASE WHEN {_LOWER} THEN excluded.vmin ELSE vmin END,
    tmax = CASE WHEN {_HIGHER} THEN excluded.tmax ELSE tmax END,
    smax = CASE WHEN {_HIGHER} THEN excluded.smax ELSE smax END,
    vmax = CASE WHEN {_HIGHER} THEN excluded.vmax ELSE vmax END"""


def write(conn: sqlite3.Connection, run_id: str, task: str, at: float,
          points: Sequence[tuple[str, float | None, int | None]]) -> None:
    """Record ``points`` (name, value, step) of ``task`` at time ``at``, with their series and blocks
    (inside the caller's transaction; the run's one writer)."""
    for name, value, step in points:
        row = conn.execute("SELECT n FROM metric_series WHERE run_id = ? AND task = ? AND name = ?",
                           (run_id, task, name)).fetchone()
        n = int(row[0]) if row else 0
        conn.execute("INSERT INTO metrics (run_id, task, name, time_unix, step, value) VALUES (?, ?, ?, ?, ?, ?)",
                     (run_id, task, name, at, step, value))
        if row is None and _state(conn, run_id) != SUMMARISED:
            continue  # a series with points from before the summaries: summarise_series counts this one with them
        conn.execute(_UPSERT_SERIES, (run_id, task, name, at, step, value))
        for level in range(LEVELS):
            conn.execute(_UPSERT_BLOCK, (run_id, task, name, level, n // _size(level), at, at, step, step, value, at, step,
                                         value, at, step))


def _size(level: int) -> int:
    """Points per block at ``level``."""
    return 16 ** (level + 1)


@contextlib.contextmanager
def snapshot(conn: sqlite3.Connection) -> Iterator[None]:
    """Every read inside sees the same state of the store (one read transaction; WAL)."""
    if conn.in_transaction:
        yield
        return
    conn.execute("BEGIN")
    try:
        yield
    finally:
        conn.execute("COMMIT")


# a run's summaries (_state): all there; some of its series not summed up yet; none in this store (older schema)
SUMMARISED, PENDING, NO_SUMMARIES = "summarised", "pending", "none"


def _state(conn: sqlite3.Connection, run_id: str) -> str:
    """Whether ``run_id``'s series are all summed up (:data:`SUMMARISED`), not all yet (:data:`PENDING`),
    or the store has no summaries (:data:`NO_SUMMARIES`: an older schema read as it stands)."""
    try:
        row = conn.execute("SELECT 1 FROM metric_backlog WHERE run_id = ?", (run_id,)).fetchone()
    except sqlite3.OperationalError:  # no such table: a store older than version 5, read-only
        has = conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'metric_series'").fetchone()
        return PENDING if has else NO_SUMMARIES
    return SUMMARISED if row is None else PENDING


def series(conn: sqlite3.Connection, run_id: str, *, task: str | None = None,
           names: Sequence[str] | None = None) -> list[tuple[str, str, int]]:
    """The run's series (task, name, number of points), optionally of one task and some names."""
    return [(t, n, count) for t, n, count, _ in _series(conn, run_id, task, names)]


def _series(conn: sqlite3.Connection, run_id: str, task: str | None,
            names: Sequence[str] | None) -> list[tuple[str, str, int, bool]]:
    """:func:`series`, each with whether it is summed up (its blocks can stand for its points)."""
    state = _state(conn, run_id)
    out: list[tuple[str, str, int, bool]] = []
    if state != NO_SUMMARIES:
        sql, args = "SELECT task, name, n FROM metric_series WHERE run_id = ?", [run_id]
        if task is not None:
            sql += " AND task = ?"
            args.append(task)
        if names:
            sql += f" AND name IN ({', '.join('?' * len(names))})"
            args += list(names)
        out = [(r[0], r[1], int(r[2]), True) for r in conn.execute(sql + " ORDER BY task, name", args)]
    if state == SUMMARISED:
        return out
    have = {(t, n) for t, n, _, _ in out}
    for t, n in unsummarised(conn, run_id, task=task, have=have):
        if not names or n in names:
            count = conn.execute("SELECT COUNT(*) FROM metrics WHERE run_id = ? AND task = ? AND name = ?",
                                 (run_id, t, n)).fetchone()[0]
            out.append((t, n, int(count), False))
    return sorted(out)


def unsummarised(conn: sqlite3.Connection, run_id: str, *, task: str | None = None,
                 have: set[tuple[str, str]] | None = None) -> list[tuple[str, str]]:
    """The run's series with points but no summary (``have``: the summed-up ones, if read already):
    one index probe per series, not a read of its points."""
    if have is None:
        have = set() if _state(conn, run_id) == NO_SUMMARIES else {
            (r[0], r[1]) for r in conn.execute("SELECT task, name FROM metric_series WHERE run_id = ?", (run_id,))}
    sql = "SELECT task, name FROM metrics WHERE run_id = ? AND (task, name) > (?, ?)" + (" AND task = ?" if task else "")
    out, last = [], ("", "")
    try:
        while (row := conn.execute(sql + " ORDER BY task, name LIMIT 1", (run_id, *last, *([task] if task else [])))
               .fetchone()) is not None:
            last = (row[0], row[1])
            if last not in have:
                out.append(last)
    except sqlite3.OperationalError:  # no metrics table: a store older than version 2, read-only
        return []
    return out


def summarise_series(conn: sqlite3.Connection, key: tuple[str, str, str]) -> int:
    """Sum up the points of series ``key`` (run, task, name) as the writer would have (its
    ``metric_series`` row, its blocks), inside the caller's transaction; return its number of points.
    A series already summed up is left as it is (0)."""
    if conn.execute("SELECT 1 FROM metric_series WHERE run_id = ? AND task = ? AND name = ?", key).fetchone():
        return 0
    points = conn.execute("SELECT time_unix, step, value FROM metrics WHERE run_id = ? AND task = ? AND name = ?"
                          " ORDER BY rowid", key).fetchall()
    if not points:
        return 0
    t, s, v = points[-1]
    conn.execute("INSERT INTO metric_series (run_id, task, name, n, time_unix, step, value) VALUES (?, ?, ?, ?, ?, ?, ?)",
                 (*key, len(points), t, s, v))
    blocks = [(1, t, t, s, s, v, t, s, v, t, s) for t, s, v in points]  # each point a block of one
    for level in range(LEVELS):  # a level's block: 16 consecutive blocks of the level below, in the order written
        blocks = [_merged(blocks[i:i + 16]) for i in range(0, len(blocks), 16)]
        conn.executemany("INSERT INTO metric_blocks VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                         [(*key, level, b, *block) for b, block in enumerate(blocks)])
    return len(points)


def _merged(parts: list[tuple[Any, ...]]) -> tuple[Any, ...]:
    """One block of consecutive ``parts`` (n, t0, t1, s0, s1, vmin, tmin, smin, vmax, tmax, smax), as the
    writer's upserts leave it: the first lowest and the first highest value kept."""
    steps = [s for p in parts for s in (p[3], p[4]) if s is not None]
    low = high = None
    for p in parts:
        if p[5] is not None and (low is None or p[5] < low[5]):
            low = p
        if p[8] is not None and (high is None or p[8] > high[8]):
            high = p
    return (sum(p[0] for p in parts), min(p[1] for p in parts), max(p[2] for p in parts),
            min(steps, default=None), max(steps, default=None),
            *((low[5], low[6], low[7]) if low else (None, None, None)),
            *((high[8], high[9], high[10]) if high else (None, None, None)))


def pending(conn: sqlite3.Connection, run_id: str) -> bool:
    """Whether ``run_id`` has points not summed up yet (it is in the backlog); a read, no lock."""
    return _state(conn, run_id) == PENDING


def summarised(conn: sqlite3.Connection, run_id: str) -> bool:
    """Whether every series of ``run_id`` is summed up; if so, the run leaves the backlog (the caller's
    transaction)."""
    if _state(conn, run_id) == SUMMARISED:
        return True
    if unsummarised(conn, run_id):
        return False
    conn.execute("DELETE FROM metric_backlog WHERE run_id = ?", (run_id,))
    return True


def backlog(conn: sqlite3.Connection) -> list[str]:
    """Runs whose points are not all summed up yet, newest first (the ones looked at soonest)."""
    return [r[0] for r in conn.execute("SELECT b.run_id FROM metric_backlog AS b JOIN runs ON runs.id = b.run_id"
                                       " ORDER BY runs.created_unix DESC")]


def latest(conn: sqlite3.Connection, run_id: str) -> dict[str, dict[str, float | None]]:
    """Each task's latest value of each metric: ``{"worker:0": {"loss": 0.31, ...}}``."""
    out: dict[str, dict[str, float | None]] = {}
    state = _state(conn, run_id)
    if state != NO_SUMMARIES:
        for task, name, value in conn.execute("SELECT task, name, value FROM metric_series WHERE run_id = ?", (run_id,)):
            out.setdefault(task, {})[name] = value
    if state != SUMMARISED:
        for task, name in unsummarised(conn, run_id):
            out.setdefault(task, {})[name] = _last(conn, (run_id, task, name))[1]
    return out


def _last(conn: sqlite3.Connection, key: tuple[str, str, str]) -> tuple[float, float | None]:
    """The time and value of the latest point of series ``key`` (by its index: time, then the order written)."""
    return conn.execute("SELECT time_unix, value FROM metrics WHERE run_id = ? AND task = ? AND name = ?"
                        " ORDER BY time_unix DESC, rowid DESC LIMIT 1", key).fetchone()


def latest_time(conn: sqlite3.Connection, run_id: str, name: str) -> float | None:
    """The time of the run's latest point of metric ``name``, any task (None: none)."""
    state = _state(conn, run_id)
    times = []
    if state != NO_SUMMARIES:
        times.append(conn.execute("SELECT MAX(time_unix) FROM metric_series WHERE run_id = ? AND name = ?",
                                  (run_id, name)).fetchone()[0])
    if state != SUMMARISED:
        times += [_last(conn, (run_id, t, n))[0] for t, n in unsummarised(conn, run_id) if n == name]
    times = [t for t in times if t is not None]
    return float(max(times)) if times else None


def top(conn: sqlite3.Connection) -> int:
    """The cursor of the newest point in the store (0: none)."""
    return int(conn.execute("SELECT COALESCE(MAX(rowid), 0) FROM metrics").fetchone()[0])


def since(conn: sqlite3.Connection, run_id: str, cursor: int, *, names: Sequence[str] | None = None,
          limit: int = 50_000) -> tuple[list[dict[str, Any]], int]:
    """The run's points written after ``cursor`` (oldest first, at most ``limit``) and the cursor to ask
    from next. A rowid range scan (``+run_id``: not the run's index, which would read its whole history)."""
    with snapshot(conn):
        newest = top(conn)
        sql = ("SELECT rowid, task, name, time_unix, step, value FROM metrics WHERE rowid > ? AND rowid <= ?"
               " AND +run_id = ?")
        args: list[Any] = [cursor, newest, run_id]
        if names:
            sql += f" AND +name IN ({', '.join('?' * len(names))})"
            args += list(names)
        rows = conn.execute(sql + " ORDER BY rowid LIMIT ?", [*args, limit]).fetchall()
    if len(rows) == limit:
        newest = int(rows[-1][0])
    return [{"task": r[1], "name": r[2], "time_unix": r[3], "step": r[4], "value": r[5]} for r in rows], max(cursor, newest)


def chart(conn: sqlite3.Connection, run_id: str, *, names: Sequence[str] | None = None, task: str | None = None,
          x: str = "time", lo: float | None = None, hi: float | None = None, max_points: int = 1000) -> Series:
    """At most ``max_points`` points of each series of the run (of ``task``, of ``names``) with x
    (``time`` or ``step``) in ``[lo, hi]`` (default: the whole series): min/max buckets of the range."""
    if x not in X_COLUMNS:
        raise ValueError(f"A chart's x is 'time' or 'step'; received {x!r}.")
    out: Series = {}
    with snapshot(conn):
        for t, name, n, blocks in _series(conn, run_id, task, names):
            points = _one_series(conn, (run_id, t, name), n, X_COLUMNS[x], lo, hi, max_points, blocks=blocks)
            if points:
                out.setdefault(t, {})[name] = points
    return out


def _one_series(conn: sqlite3.Connection, key: tuple[str, str, str], n: int, xcol: str, lo: float | None,
                hi: float | None, max_points: int, *, blocks: bool = True) -> list[list[Any]]:
    """:func:`chart` of one series (``blocks``: it is summed up, so a long range is read from its blocks)."""
    xi = 0 if xcol == "time_unix" else 1
    if lo is None and hi is None and n <= max_points:
        return _raw(conn, key, xcol, None, None)
    lo = _end(conn, key, xcol, "ASC") if lo is None else lo
    hi = _end(conn, key, xcol, "DESC") if hi is None else hi
    if lo is None or hi is None or hi < lo:
        return []
    where = f"run_id = ? AND task = ? AND name = ? AND {xcol} BETWEEN ? AND ?"
    whole = xcol == "time_unix" and (lo, hi) == (_end(conn, key, xcol, "ASC"), _end(conn, key, xcol, "DESC"))
    count = n if whole else conn.execute(f"SELECT COUNT(*) FROM metrics WHERE {where}", (*key, lo, hi)).fetchone()[0]
    if count <= max_points:
        return _raw(conn, key, xcol, lo, hi)
    cut = (buckets(max_points), lo, hi)
    if count <= RAW_FACTOR * max_points or not blocks:  # each bucket's extremes among the points themselves
        found = _extremes(conn, "metrics", key, xcol, ("time_unix", "step", "value"), f"{xcol} BETWEEN ? AND ?", cut)
    else:  # ... among the extremes of the blocks inside the range, and the points of those at its ends
        level = next((lv for lv in range(LEVELS) if count // _size(lv) <= BLOCKS_PER_POINT * max_points), LEVELS - 1)
        x0, x1 = ("t0", "t1") if xi == 0 else ("s0", "s1")
        inside = f"level = {level} AND {x0} >= ? AND {x1} <= ?"
        found = [*_extremes(conn, "metric_blocks", key, ("tmin", "smin")[xi], ("tmin", "smin", "vmin"), inside, cut, "MIN"),
                 *_extremes(conn, "metric_blocks", key, ("tmax", "smax")[xi], ("tmax", "smax", "vmax"), inside, cut, "MAX")]
        for b0, b1 in conn.execute(f"SELECT {x0}, {x1} FROM metric_blocks WHERE run_id = ? AND task = ? AND name = ?"
                                   f" AND level = {level} AND {x1} >= ? AND {x0} <= ? AND NOT ({inside})",
                                   (*key, lo, hi, lo, hi)):
            found += [tuple(p) for p in _raw(conn, key, xcol, max(lo, b0), min(hi, b1))]
    for end in ("ASC", "DESC"):  # the range's first and last points
        row = conn.execute(f"SELECT time_unix, step, value FROM metrics WHERE {where} ORDER BY {xcol} {end}, rowid {end}"
                           " LIMIT 1", (*key, lo, hi)).fetchone()
        if row is not None:
            found.append(tuple(row))
    ordered = sorted(set(found), key=lambda p: (p[xi], p[0]))
    return [list(p) for p in minmax(ordered, max_points, x=xi, lo=lo, hi=hi)]


def _extremes(conn: sqlite3.Connection, table: str, key: tuple[str, str, str], xcol: str, point: tuple[str, str, str],
              inside: str, cut: tuple[int, float, float], *aggs: str) -> list[tuple[Any, ...]]:
    """Of the rows of ``table`` (``point``: their time, step and value columns) that are ``inside``
    the range, the lowest and the highest value of each bucket (:func:`psflow.platform.downsample.bucket_of`,
    computed alike by SQLite), as points (``aggs``: only the lowest, ``MIN``, or the highest, ``MAX``)."""
    n, lo, hi = cut
    t, s, v = point
    bucket = f"CAST(({xcol} - ?) * ? / ? AS INTEGER)"
    cut_args = (float(lo), n, float(hi - lo) or 1.0)  # floats: SQLite divides integers as integers
    out: list[tuple[Any, ...]] = []
    for agg in aggs or ("MIN", "MAX"):  # SQLite takes the bare columns of a lone MIN() or MAX() from the row holding it
        out += [tuple(r[2:]) for r in conn.execute(
            f"SELECT {bucket} AS b, {agg}({v}), {t}, {s}, {v} FROM {table} WHERE run_id = ? AND task = ? AND name = ?"
            f" AND {inside} AND {xcol} IS NOT NULL AND {v} IS NOT NULL GROUP BY b", (*cut_args, *key, lo, hi))]
    return out


def _raw(conn: sqlite3.Connection, key: tuple[str, str, str], xcol: str, lo: float | None,
         hi: float | None) -> list[list[Any]]:
    """A series' points, in x order (those with x in ``[lo, hi]``, or all with an x)."""
    sql = f"SELECT time_unix, step, value FROM metrics WHERE run_id = ? AND task = ? AND name = ? AND {xcol} "
    if lo is None or hi is None:
        rows = conn.execute(sql + f"IS NOT NULL ORDER BY {xcol}, rowid", key)
    else:
        rows = conn.execute(sql + f"BETWEEN ? AND ? ORDER BY {xcol}, rowid", (*key, lo, hi))
    return [list(r) for r in rows]


def _end(conn: sqlite3.Connection, key: tuple[str, str, str], xcol: str, order: str) -> float | None:
    row = conn.execute(f"SELECT {xcol} FROM metrics WHERE run_id = ? AND task = ? AND name = ? AND {xcol} IS NOT NULL"
                       f" ORDER BY {xcol} {order} LIMIT 1", key).fetchone()
    return None if row is None else row[0]
