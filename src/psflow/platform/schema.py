"""The job store's schema: numbered, forward-only migrations and the ``schema_version`` table.

A database's version is the highest number in ``schema_version`` (0 for a new, empty file).
:func:`migrate` applies every migration above it, in order, each in its own ``BEGIN IMMEDIATE``
transaction that also records its number, so two processes opening an old database at once apply
each migration once (the second finds it applied and skips it), and a crash mid-migration leaves the
database at the previous version. A migration is never edited once released: a change is a new one.

A database newer than this psflow (a version it has no migration for) is refused with
:class:`JobStoreError` rather than read with the wrong shape.

Called by :class:`psflow.platform.jobstore.JobStore` when it opens a database.
"""

from __future__ import annotations

import sqlite3
import time

from psflow.errors import PsflowError


class JobStoreError(PsflowError):
    """The job store cannot be opened, read or written (corrupt, newer than this psflow, no access)."""


# (version, what it does, its statements). Never edit a released one: add the next.
MIGRATIONS: tuple[tuple[int, str, tuple[str, ...]], ...] = (
    (1, "runs, tasks, attempts and events", (
        """CREATE TABLE runs (
            id TEXT PRIMARY KEY,
            script TEXT NOT NULL,
            args TEXT NOT NULL DEFAULT '[]',          -- JSON list
            logdir TEXT NOT NULL,
            cluster TEXT NOT NULL DEFAULT '{}',       -- JSON: job -> task names
            mode TEXT,
            strategy TEXT,
            backend TEXT,
            restart_policy TEXT NOT NULL DEFAULT '{}', -- JSON
            state TEXT NOT NULL,                      -- pending running succeeded failed stopped abandoned
            note TEXT,
            launcher TEXT,                            -- JSON: the launcher's process identity (liveness)
            created_unix REAL NOT NULL,
            started_unix REAL,
            ended_unix REAL,
            heartbeat_unix REAL,
            root_cause TEXT,
            summary TEXT                              -- JSON, once the run ended
        )""",
        "CREATE INDEX runs_by_created ON runs (created_unix)",
        """CREATE TABLE tasks (
            run_id TEXT NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
            name TEXT NOT NULL,                       -- worker:1
            position INTEGER NOT NULL,                -- the plan's order
            state TEXT NOT NULL,                      -- pending starting running restarting exited
            attempt INTEGER NOT NULL DEFAULT 0,
            address TEXT,
            pid INTEGER,
            scheduler_id TEXT,                        -- a Slurm step, a pod: the backend's handle
            identity TEXT,                            -- JSON: the process identity (liveness)
            exit_code INTEGER,
            exit_cause TEXT,
            heartbeat_unix REAL,                      -- the last time the task was heard from
            progress TEXT NOT NULL DEFAULT '{}',      -- JSON: the last progress figures
            PRIMARY KEY (run_id, name)
        )""",
        """CREATE TABLE attempts (
            run_id TEXT NOT NULL,
            task TEXT NOT NULL,
            attempt INTEGER NOT NULL,
            pid INTEGER,
            scheduler_id TEXT,
            started_unix REAL NOT NULL,
            exited_unix REAL,
            exit_code INTEGER,
            exit_cause TEXT,
            restart_reason TEXT,                      -- why it was restarted, when it was
            PRIMARY KEY (run_id, task, attempt),
            FOREIGN KEY (run_id, task) REFERENCES tasks (run_id, name) ON DELETE CASCADE
        )""",
        """CREATE TABLE events (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            run_id TEXT NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
            time_unix REAL NOT NULL,
            kind TEXT NOT NULL,                       -- task_started task_exited restart stop run_finished ...
            task TEXT,
            data TEXT NOT NULL DEFAULT '{}'           -- JSON
        )""",
        "CREATE INDEX events_by_run ON events (run_id, id)",
    )),
    (2, "metrics over time, per task", (
        """CREATE TABLE metrics (
            run_id TEXT NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
            task TEXT NOT NULL,
            name TEXT NOT NULL,                       -- loss, examples_per_sec, global_step, test_accuracy, eval/...
            time_unix REAL NOT NULL,
            step INTEGER,                             -- the job's global step when reported, if known
            value REAL
        )""",
        "CREATE INDEX metrics_by_series ON metrics (run_id, task, name, time_unix)",
    )),
    (3, "control requests (stop, scale) from the CLI, the API or the dashboard; what relaunches a run", (
        """CREATE TABLE control (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            run_id TEXT NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
            kind TEXT NOT NULL,                       -- stop, scale, ...
            payload TEXT NOT NULL DEFAULT '{}',       -- JSON: what the kind needs ({"workers": 4} for scale)
            source TEXT NOT NULL,                     -- who asked: cli, api, dashboard
            state TEXT NOT NULL,                      -- pending taken done refused
            requested_unix REAL NOT NULL,
            taken_unix REAL,
            answered_unix REAL,
            answer TEXT                               -- what the launcher did, or why it refused
        )""",
        "CREATE INDEX control_pending ON control (run_id, state, id)",
        "CREATE INDEX runs_by_state ON runs (state, created_unix)",
        "ALTER TABLE runs ADD COLUMN launch TEXT",  # JSON: what launches the same plan again (restart)
        "ALTER TABLE runs ADD COLUMN restarted_from TEXT",  # the run this one restarted, if any
    )),
    (4, "what keeps the dashboard fast at any size: the runs list's keyset indexes, each series' count and latest "
        "point, the extremes of each block of 16, 256 and 4096 points (psflow.platform.metricstore), reads by step", (
        "CREATE INDEX runs_by_created_id ON runs (created_unix, id)",
        "CREATE INDEX runs_by_state_created_id ON runs (state, created_unix, id)",
        "CREATE INDEX metrics_by_step ON metrics (run_id, task, name, step)",
        """CREATE TABLE metric_series (
            run_id TEXT NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
            task TEXT NOT NULL,
            name TEXT NOT NULL,
            n INTEGER NOT NULL,                       -- its points so far
            time_unix REAL NOT NULL,                  -- its latest point
            step INTEGER,
            value REAL,
            PRIMARY KEY (run_id, task, name)
        ) WITHOUT ROWID""",
        """CREATE TABLE metric_blocks (
            run_id TEXT NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
            task TEXT NOT NULL,
            name TEXT NOT NULL,
            level INTEGER NOT NULL,                   -- 0, 1, 2: blocks of 16, 256, 4096 points (16 ** (level + 1))
            block INTEGER NOT NULL,                   -- the series' points size*block .. size*(block+1)-1, as written
            n INTEGER NOT NULL,
            t0 REAL NOT NULL, t1 REAL NOT NULL,       -- its points' earliest and latest time
            s0 INTEGER, s1 INTEGER,                   -- ... lowest and highest step
            vmin REAL, tmin REAL, smin INTEGER,       -- its lowest value, where
            vmax REAL, tmax REAL, smax INTEGER,       -- its highest value, where
            PRIMARY KEY (run_id, task, name, level, block)
        ) WITHOUT ROWID""",  # stored in key order: a series' blocks lie together
        # the points recorded before this version are summed up later, run by run (version 5)
    )),
    (5, "the runs whose points predate their summaries (metric_series, metric_blocks): each is summed up later, "
        "series by series, each its own short transaction (psflow.platform.metricstore), not inside the migration", (
        """CREATE TABLE metric_backlog (
            run_id TEXT PRIMARY KEY REFERENCES runs (id) ON DELETE CASCADE
        ) WITHOUT ROWID""",
        # one index probe per run: no point is read here
        """INSERT INTO metric_backlog SELECT id FROM runs WHERE EXISTS (SELECT 1 FROM metrics WHERE metrics.run_id = runs.id)
            AND NOT EXISTS (SELECT 1 FROM metric_series WHERE metric_series.run_id = runs.id)""",
    )),
    (6, "a live run's phase (running, draining, stopping, finished), as its launcher's controller changes it", (
        "ALTER TABLE runs ADD COLUMN phase TEXT",  # None: a run recorded before, or not started yet
    )),
)

LATEST = MIGRATIONS[-1][0]


def version(conn: sqlite3.Connection) -> int:
    """The database's schema version (0: no schema yet)."""
    conn.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER PRIMARY KEY, applied_unix REAL NOT NULL)")
    row = conn.execute("SELECT MAX(version) FROM schema_version").fetchone()
    return int(row[0] or 0)


def migrate(conn: sqlite3.Connection, path: str, *, upto: int = LATEST) -> int:
    """Bring the database to version ``upto`` (default: the latest); return the version it is at.

    ``conn`` must be in autocommit mode (``isolation_level=None``): each migration is its own
    transaction.

    Raises:
        JobStoreError: the database is newer than this psflow knows.
    """
    current = version(conn)
    if current > LATEST:
        raise JobStoreError(
            f"The job store {path} has schema version {current}; this psflow knows versions up to {LATEST}. "
            f"It was written by a newer psflow: upgrade psflow, or point PSFLOW_HOME at another directory.")
    for number, _what, statements in MIGRATIONS:
        if number <= current or number > upto:
            continue
        conn.execute("BEGIN IMMEDIATE")
        try:
            if version(conn) >= number:  # another process applied it while we waited for the lock
                conn.execute("ROLLBACK")
                continue
            for sql in statements:
                conn.execute(sql)
            conn.execute("INSERT INTO schema_version (version, applied_unix) VALUES (?, ?)", (number, time.time()))
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
    return version(conn)
