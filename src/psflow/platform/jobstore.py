"""The job store: every run on this machine (or cluster head) in one SQLite database.

``$PSFLOW_HOME/jobs.db`` (:mod:`psflow.home`), schema in :mod:`psflow.platform.schema`.
What it holds, per run: its id, script and arguments, log directory, cluster shape (job -> tasks),
mode, strategy, backend and restart policy, state and times; each task's state, attempt, address,
pid or scheduler id, exit code and cause, last heartbeat and last progress; each attempt (started,
exited, why it was restarted); the run's events in order; and metrics over time per task.

Run states::

    pending --first task started--> running --the launcher's verdict--> succeeded | failed | stopped
    pending | running --the launcher is gone (read-time verdict, see below)--> abandoned

A :class:`JobStore` is one connection, for one thread. The database is in WAL mode, so readers
never block the writers and each other; every write is a short ``BEGIN IMMEDIATE`` transaction,
and a writer that finds the database locked waits (``busy_timeout``) instead of failing, so runs
launched side by side all record safely. Each run has one writer (its
:class:`psflow.platform.sqlrunstore.SqliteRunStore`), so two writers never touch the same rows.

A run whose launcher died (killed, the machine rebooted) stays ``running`` in the database; every
read passes running runs through :func:`psflow.launch.liveness.assess` (the launcher's process
identity, then its heartbeat) and marks the abandoned ones so, with a note naming what is gone.

Called by the run store (writes) and by ``psflow runs / status / logs`` (reads).
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from psflow.home import jobs_db_path
from psflow.launch.control import KINDS as CONTROL_KINDS
from psflow.launch.controller import signal_name
from psflow.launch.liveness import assess
from psflow.launch.status import headline
from psflow.platform import metricstore
from psflow.platform.schema import LATEST, JobStoreError, migrate

__all__ = ["FINAL_STATES", "RUN_STATES", "JobStore", "JobStoreError", "RunKey", "run_key"]

RUN_STATES = ("pending", "running", "succeeded", "failed", "stopped", "abandoned")
# A running run's phase, as its launcher's controller changes it (psflow.launch.controller): "running"
# trains; "draining": training is over and the ps are given their time to exit; "stopping": a failure or
# a stop request, every task is being stopped; "finished": every task has exited (its state follows).
RUN_PHASES = ("running", "draining", "stopping", "finished")
FINAL_STATES = ("succeeded", "failed", "stopped", "abandoned")
_RUN_JSON = ("args", "cluster", "restart_policy", "launcher", "summary", "launch")
_TASK_JSON = ("identity", "progress")
RunKey = tuple[float, str]  # a run's place in the runs list: (created_unix, id)


def run_key(run: dict[str, Any]) -> RunKey:
    """A run's place in the runs list (newest first): its creation time, then its id."""
    return float(run["created_unix"]), str(run["id"])


class JobStore:
    """One connection to the job store at ``path`` (default ``$PSFLOW_HOME/jobs.db``), created and
    migrated to the latest schema if need be. Use it from the thread that opened it.

    Args:
        path: the database file.
        busy_timeout_s: how long a statement waits for another process's write to finish.
        migrate_to: the schema version to bring the database to (tests build old databases with it).
        check_same_thread: False lets one thread hand the connection to another (the HTTP API opens it
            in one worker thread and answers the request in another; never two at once).
        read_only: only read (``psflow runs``, ``status``, ``logs``): nothing is created, migrated or
            written, so a store on a read-only disk or owned by another user still reads. Where SQLite
            cannot open the write-ahead log's index beside it, the file is read as it stands on disk
            (``immutable``: a snapshot).

    Raises:
        JobStoreError: the file is not a database, is newer than this psflow, or cannot be opened;
            the message names the file and what to do.

    Example:
        >>> with JobStore() as db:
        ...     [r["id"] for r in db.runs(state="running")]
        ['20250101-120000-ab12cd']
    """

    def __init__(self, path: str | Path | None = None, *, busy_timeout_s: float = 10.0, migrate_to: int = LATEST,
                 check_same_thread: bool = True, read_only: bool = False) -> None:
        self.path = Path(path) if path is not None else jobs_db_path()
        self.busy_timeout_s = busy_timeout_s
        self.conn: sqlite3.Connection | None = None
        self.read_only = read_only
        self.note: str | None = None  # what a reader should know about the store (an older schema read as it stands)
        if read_only:
            self._open_read_only(check_same_thread)
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise JobStoreError(f"Cannot create the job store's directory {self.path.parent} ({e}). "
                                f"Set PSFLOW_HOME to a directory you can write.") from e
        try:
            self.conn = sqlite3.connect(str(self.path), timeout=busy_timeout_s, isolation_level=None,
                                        check_same_thread=check_same_thread)
            self.conn.row_factory = sqlite3.Row
            self.conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000)}")
            self._set_wal(busy_timeout_s)
            self.conn.execute("PRAGMA synchronous = NORMAL")  # WAL: durable at checkpoints, never corrupt
            self.conn.execute("PRAGMA foreign_keys = ON")
            self.version = migrate(self.conn, str(self.path), upto=migrate_to)
        except sqlite3.Error as e:
            self.close()
            raise JobStoreError(explain(self.path, e, busy_timeout_s)) from e
        except JobStoreError:
            self.close()
            raise

    def _open_read_only(self, check_same_thread: bool) -> None:
        """Open for reading only (see ``read_only``); the schema must be this psflow's, as nothing migrates it."""
        from urllib.parse import quote

        uri = f"file:{quote(str(self.path.resolve()))}"
        last: sqlite3.Error | None = None
        for mode in ("?mode=ro", "?mode=ro&immutable=1"):  # immutable: no WAL index to open (a read-only directory)
            try:
                self.conn = sqlite3.connect(uri + mode, uri=True, timeout=self.busy_timeout_s, isolation_level=None,
                                            check_same_thread=check_same_thread)
                self.conn.row_factory = sqlite3.Row
                row = self.conn.execute("SELECT MAX(version) FROM schema_version").fetchone()
                self.version = int(row[0] or 0)
                break
            except sqlite3.Error as e:
                self.close()
                last = e
        if self.conn is None:
            assert last is not None
            raise JobStoreError(explain(self.path, last, self.busy_timeout_s, reading=True)) from last
        if self.version < LATEST and self._runs_readable():
            self.note = (f"the job store {self.path} has schema version {self.version} (this psflow's is {LATEST}); it "
                         "is read as it stands, and the next psflow that writes it (a run, the dashboard) upgrades it.")
        elif self.version != LATEST:
            self.close()
            what = ("cannot read a newer one: upgrade psflow" if self.version > LATEST else
                    "cannot bring an older one up to date without writing it: run psflow once with write access there")
            raise JobStoreError(f"The job store {self.path} has schema version {self.version}; this psflow reads version "
                                f"{LATEST}, and {what}, or point PSFLOW_HOME at another directory.")

    def _runs_readable(self) -> bool:
        """Whether the runs table reads (an older store's runs list then shows as it stands)."""
        try:
            self._db.execute("SELECT * FROM runs LIMIT 1").fetchall()
            return True
        except sqlite3.Error:
            return False

    def _set_wal(self, busy_timeout_s: float) -> None:
        """WAL mode. Two connections switching a new database's journal mode at once: one gets "locked"
        at once, with no busy wait (SQLite does not wait on that lock), so it tries again until the deadline."""
        assert self.conn is not None
        deadline = time.monotonic() + busy_timeout_s
        delay_s = 0.01
        while True:
            try:
                self.conn.execute("PRAGMA journal_mode = WAL")
                return
            except sqlite3.OperationalError as e:
                if "locked" not in str(e) or time.monotonic() + delay_s > deadline:
                    raise
                time.sleep(delay_s)  # a backoff between tries, not a synchronisation
                delay_s = min(delay_s * 2, 0.2)

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def __enter__(self) -> JobStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def _db(self) -> sqlite3.Connection:
        if self.conn is None:
            raise JobStoreError(f"The job store {self.path} was closed; open it again (JobStore(path)).")
        return self.conn

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        """One write transaction: taken at once (``BEGIN IMMEDIATE``), so it waits for another
        writer up front rather than failing halfway; committed on leaving, rolled back on error."""
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")

    # -- writes (inside transaction(); the run's own writer only) -----------------------------------
    def add_run(self, run: dict[str, Any], tasks: Sequence[str]) -> None:
        """A new run, ``pending``, with its tasks. ``run``: id, script, args, logdir, cluster, mode,
        strategy, backend, restart_policy, launcher, created_unix. A run the dashboard recorded while
        its launcher started (``pending``, or ``abandoned`` if the dashboard went away meanwhile) is
        taken over by the launcher's own record."""
        row = {**run, **{k: json.dumps(run.get(k)) for k in _RUN_JSON if k in run}, "state": "pending",
               "heartbeat_unix": run["created_unix"]}
        cols = ", ".join(row)
        update = ", ".join(f"{c} = excluded.{c}" for c in row if c != "id")
        self._db.execute(f"INSERT INTO runs ({cols}) VALUES ({', '.join(':' + c for c in row)}) ON CONFLICT(id) DO "
                         f"UPDATE SET {update}, note = NULL WHERE runs.state IN ('pending', 'abandoned')", row)
        self._db.executemany("INSERT OR IGNORE INTO tasks (run_id, name, position, state) VALUES (?, ?, ?, 'pending')",
                             [(run["id"], t, i) for i, t in enumerate(tasks)])

    def task_started(self, run_id: str, task: str, attempt: int, at: float, *, pid: int | None,
                     scheduler_id: str | None, identity: dict[str, Any] | None) -> None:
        """An attempt of ``task`` started; the run is ``running`` from its first start."""
        self._db.execute(
            "UPDATE tasks SET state = 'starting', attempt = ?, pid = ?, scheduler_id = ?, identity = ?, exit_code = NULL,"
            " exit_cause = NULL, address = CASE WHEN ? > 0 THEN NULL ELSE address END WHERE run_id = ? AND name = ?",
            (attempt, pid, scheduler_id, json.dumps(identity), attempt, run_id, task))
        self._db.execute("INSERT OR REPLACE INTO attempts (run_id, task, attempt, pid, scheduler_id, started_unix)"
                         " VALUES (?, ?, ?, ?, ?, ?)", (run_id, task, attempt, pid, scheduler_id, at))
        self._db.execute("UPDATE runs SET state = 'running', started_unix = ? WHERE id = ? AND state = 'pending'",
                         (at, run_id))

    def task_registered(self, run_id: str, task: str, address: str, at: float) -> None:
        self._db.execute("UPDATE tasks SET state = 'running', address = ?, heartbeat_unix = ? WHERE run_id = ? AND name = ?",
                         (address, at, run_id, task))

    def task_progress(self, run_id: str, task: str, progress: dict[str, Any], at: float,
                      points: Sequence[tuple[str, float, int | None]]) -> None:
        """``task`` was heard from: its last progress figures, and metric ``points`` (name, value, step)."""
        self._db.execute("UPDATE tasks SET progress = ?, heartbeat_unix = ? WHERE run_id = ? AND name = ?",
                         (json.dumps(progress), at, run_id, task))
        metricstore.write(self._db, run_id, task, at, points)

    def task_exited(self, run_id: str, task: str, attempt: int, at: float, code: int, cause: str) -> None:
        self._db.execute("UPDATE tasks SET state = 'exited', exit_code = ?, exit_cause = ? WHERE run_id = ? AND name = ?",
                         (code, cause, run_id, task))
        self._db.execute("UPDATE attempts SET exited_unix = ?, exit_code = ?, exit_cause = ?"
                         " WHERE run_id = ? AND task = ? AND attempt = ?", (at, code, cause, run_id, task, attempt))

    def add_tasks(self, run_id: str, tasks: Sequence[str]) -> None:
        """``psflow scale`` added ``tasks`` to a running run (a retired one added back keeps its row)."""
        (last,) = self._db.execute("SELECT COALESCE(MAX(position), -1) FROM tasks WHERE run_id = ?", (run_id,)).fetchone()
        self._db.executemany("INSERT OR IGNORE INTO tasks (run_id, name, position, state) VALUES (?, ?, ?, 'pending')",
                             [(run_id, t, last + 1 + i) for i, t in enumerate(tasks)])

    def task_retired(self, run_id: str, task: str) -> None:
        """``psflow scale`` retired ``task``: its state says so (its last exit is an expected end)."""
        self._db.execute("UPDATE tasks SET state = 'retired' WHERE run_id = ? AND name = ?", (run_id, task))

    def task_restarting(self, run_id: str, task: str, attempt: int, reason: str) -> None:
        """``task`` will start again as ``attempt``: the attempt before it is marked with ``reason``."""
        self._db.execute("UPDATE tasks SET state = 'restarting' WHERE run_id = ? AND name = ?", (run_id, task))
        self._db.execute("UPDATE attempts SET restart_reason = ? WHERE run_id = ? AND task = ? AND attempt = ?",
                         (reason, run_id, task, attempt - 1))

    def add_event(self, run_id: str, kind: str, at: float, data: dict[str, Any]) -> None:
        task = data.get("task")
        self._db.execute("INSERT INTO events (run_id, time_unix, kind, task, data) VALUES (?, ?, ?, ?, ?)",
                         (run_id, at, kind, task if isinstance(task, str) else None, json.dumps(data, default=str)))

    def claim_alert(self, run_id: str, alert: str, key: str, at: float, source: str) -> bool:
        """Whether this caller is the first to tell alert ``alert`` (failed, restarted, stalled) of
        ``run_id`` with ``key`` (e.g. the restarted task and attempt): the first claim records an
        ``alert_sent`` event and wins; later ones (the launcher's and the dashboard's watchers both
        look) lose. Its own transaction, so two processes never both win."""
        with self.transaction():
            seen = self._db.execute(
                "SELECT 1 FROM events WHERE run_id = ? AND kind = 'alert_sent' AND json_extract(data, '$.alert') = ?"
                " AND json_extract(data, '$.key') = ? LIMIT 1", (run_id, alert, key)).fetchone()
            if seen is not None:
                return False
            self.add_event(run_id, "alert_sent", at, {"alert": alert, "key": key, "source": source})
        return True

    def heartbeat(self, run_id: str, at: float) -> None:
        self._db.execute("UPDATE runs SET heartbeat_unix = ? WHERE id = ?", (at, run_id))

    def set_summary(self, run_id: str, summary: dict[str, Any]) -> None:
        self._db.execute("UPDATE runs SET summary = ?, root_cause = ? WHERE id = ?",
                         (json.dumps(summary, default=str), summary.get("root_cause"), run_id))

    def set_phase(self, run_id: str, phase: str) -> None:
        """Run ``run_id``'s launcher moved it to ``phase`` (see :data:`RUN_PHASES`); its state stays."""
        if phase not in RUN_PHASES:
            raise JobStoreError(f"Run phase {phase!r} is not one of {', '.join(RUN_PHASES)}.")
        self._db.execute("UPDATE runs SET phase = ? WHERE id = ?", (phase, run_id))

    def finish_run(self, run_id: str, state: str, at: float) -> None:
        if state not in RUN_STATES:
            raise JobStoreError(f"Run state {state!r} is not one of {', '.join(RUN_STATES)}.")
        self._db.execute("UPDATE runs SET state = ?, ended_unix = ?, heartbeat_unix = ? WHERE id = ?",
                         (state, at, at, run_id))

    # -- control requests (any process asks; the run's writer takes and answers) ---------------------
    def request_control(self, run_id: str, kind: str, *, source: str, payload: dict[str, Any] | None = None,
                        at: float | None = None) -> int:
        """Ask run ``run_id``'s launcher to ``stop`` (or ``scale``); return the request's id. The
        launcher takes it at its next tick (:mod:`psflow.launch.control`). Its own transaction.

        Raises:
            JobStoreError: an unknown kind, no such run, or a run that has already ended (its state named).
        """
        if kind not in CONTROL_KINDS:
            raise JobStoreError(f"Control request {kind!r} is not one of {', '.join(CONTROL_KINDS)}.")
        run = self.run(run_id, metrics=False)
        if run is None:
            raise JobStoreError(f"No run {run_id!r} in the job store {self.path}; `psflow runs` lists the runs.")
        if run["state"] not in ("pending", "running"):
            raise JobStoreError(f"Run {run_id} has already ended ({run['state']}); there is nothing to {kind}.")
        with self.transaction():
            cur = self._db.execute(
                "INSERT INTO control (run_id, kind, payload, source, state, requested_unix) VALUES (?, ?, ?, ?, 'pending', ?)",
                (run_id, kind, json.dumps(payload or {}), source, time.time() if at is None else at))
        return int(cur.lastrowid or 0)

    def take_control(self, run_id: str, at: float) -> list[dict[str, Any]]:
        """The run's pending requests, oldest first, marked ``taken`` (inside :meth:`transaction`)."""
        rows = [self._control_dict(r) for r in self._db.execute(
            "SELECT * FROM control WHERE run_id = ? AND state = 'pending' ORDER BY id", (run_id,))]
        if rows:
            self._db.execute("UPDATE control SET state = 'taken', taken_unix = ? WHERE run_id = ? AND state = 'pending'"
                             " AND id <= ?", (at, run_id, rows[-1]["id"]))
        return rows

    def answer_control(self, request_id: int, state: str, answer: str, at: float) -> None:
        """The launcher's answer to a request it took: ``done`` or ``refused``, and what it did or why not."""
        if state not in ("done", "refused"):
            raise JobStoreError(f"A control request is answered 'done' or 'refused'; received {state!r}.")
        self._db.execute("UPDATE control SET state = ?, answer = ?, answered_unix = ? WHERE id = ?",
                         (state, answer, at, request_id))

    def controls(self, run_id: str | None = None, *, request_id: int | None = None) -> list[dict[str, Any]]:
        """Control requests, oldest first: a run's, or the one with ``request_id``."""
        if request_id is not None:
            rows = self._db.execute("SELECT * FROM control WHERE id = ?", (request_id,))
        else:
            rows = self._db.execute("SELECT * FROM control WHERE run_id = ? ORDER BY id", (run_id,))
        return [self._control_dict(r) for r in rows]

    @staticmethod
    def _control_dict(r: sqlite3.Row) -> dict[str, Any]:
        return {**dict(r), "payload": json.loads(r["payload"] or "{}")}

    # -- reads --------------------------------------------------------------------------------------
    def runs(self, *, state: str | None = None, limit: int | None = None, metrics: bool = False) -> list[dict[str, Any]]:
        """Runs, newest first, each with its tasks and headline figures (and each task's latest
        metrics with ``metrics``); ``state`` keeps only runs in that state (after the liveness check)."""
        rows = self._db.execute("SELECT * FROM runs ORDER BY created_unix DESC, id").fetchall()
        tasks = self._tasks([r["id"] for r in rows] if len(rows) < 500 else None)
        out = []
        for r in rows:
            run = self._assessed(_run_dict(r), tasks.get(r["id"], {}))
            if state is not None and run["state"] != state:
                continue
            if metrics:
                self._add_metrics(run)
            out.append(run)
            if limit is not None and len(out) >= limit:
                break
        return out

    def run_page(self, *, state: str | None = None, search: str | None = None, limit: int = 50,
                 offset: int = 0, before: RunKey | None = None, after: RunKey | None = None,
                 metrics: bool = False) -> tuple[list[dict[str, Any]], int]:
        """One page of runs, newest first (by creation time, then id), and how many runs match in all:
        the HTTP API's runs list.

        ``state`` keeps the runs recorded in that state; ``search`` the runs whose id, script,
        arguments or backend hold it (case-insensitive). The page is the ``limit`` runs older than the
        key ``before`` (a run's :func:`run_key`), or newer than ``after``, or from ``offset``: the keys
        walk the index (runs_by_created_id), so every page costs the same however deep. Only the page's
        runs are read in full (tasks, the liveness check). Each task's last progress figures are in its
        ``progress``; ``metrics`` adds each task's latest value of every metric.
        """
        clause, args = self._run_filter(state, search)
        total = int(self._db.execute(f"SELECT COUNT(*) FROM runs{clause}", args).fetchone()[0])
        join = " AND " if clause else " WHERE "
        if after is not None:  # the page just newer than `after`: read upwards, shown newest first
            rows = self._db.execute(f"SELECT * FROM runs{clause}{join}(created_unix, id) > (?, ?)"
                                    " ORDER BY created_unix, id LIMIT ?", [*args, *after, limit]).fetchall()[::-1]
        elif before is not None:
            rows = self._db.execute(f"SELECT * FROM runs{clause}{join}(created_unix, id) < (?, ?)"
                                    " ORDER BY created_unix DESC, id DESC LIMIT ?", [*args, *before, limit]).fetchall()
        else:
            rows = self._db.execute(f"SELECT * FROM runs{clause} ORDER BY created_unix DESC, id DESC LIMIT ? OFFSET ?",
                                    [*args, limit, offset]).fetchall()
        tasks = self._tasks([r["id"] for r in rows])
        out = []
        for r in rows:
            run = self._assessed(_run_dict(r), tasks.get(r["id"], {}))
            if metrics:
                self._add_metrics(run)
            out.append(run)
        return out, total

    def runs_newer(self, key: RunKey, *, state: str | None = None, search: str | None = None) -> int:
        """How many runs (matching ``state`` and ``search``) are newer than the run with ``key``: a
        keyset page's place in the list."""
        clause, args = self._run_filter(state, search)
        join = " AND " if clause else " WHERE "
        return int(self._db.execute(f"SELECT COUNT(*) FROM runs{clause}{join}(created_unix, id) > (?, ?)",
                                    [*args, *key]).fetchone()[0])

    @staticmethod
    def _run_filter(state: str | None, search: str | None) -> tuple[str, list[Any]]:
        where: list[str] = []
        args: list[Any] = []
        if state is not None:
            where.append("state = ?")
            args.append(state)
        if search:
            pattern = "%" + search.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
            where.append("(id LIKE ? ESCAPE '\\' OR script LIKE ? ESCAPE '\\' OR args LIKE ? ESCAPE '\\'"
                         " OR backend LIKE ? ESCAPE '\\')")
            args += [pattern] * 4
        return (" WHERE " + " AND ".join(where)) if where else "", args

    def run(self, run_id: str, *, metrics: bool = True) -> dict[str, Any] | None:
        """One run (as :meth:`runs` gives them, with metrics by default), or None."""
        r = self._db.execute("SELECT * FROM runs WHERE id = ?", (run_id,)).fetchone()
        if r is None:
            return None
        run = self._assessed(_run_dict(r), self._tasks([run_id]).get(run_id, {}))
        if metrics:
            self._add_metrics(run)
        return run

    def find_run(self, ref: str) -> str | None:
        """The id of the run ``ref`` names: its id, or a prefix or suffix only one run's id has.

        Raises:
            JobStoreError: ``ref`` fits several runs (they are named).
        """
        if self._db.execute("SELECT 1 FROM runs WHERE id = ?", (ref,)).fetchone():
            return ref
        pattern = ref.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
        ids = [r[0] for r in self._db.execute(
            "SELECT id FROM runs WHERE id LIKE ? ESCAPE '\\' OR id LIKE ? ESCAPE '\\' ORDER BY created_unix DESC LIMIT 6",
            (pattern + "%", "%" + pattern))]
        if len(ids) > 1:
            more = ", ..." if len(ids) > 5 else ""
            raise JobStoreError(f"Run {ref!r} is ambiguous: it fits {', '.join(ids[:5])}{more}. Give more of the id.")
        return ids[0] if ids else None

    def attempts(self, run_id: str) -> list[dict[str, Any]]:
        return [dict(r) for r in self._db.execute(
            "SELECT * FROM attempts WHERE run_id = ? ORDER BY task, attempt", (run_id,))]

    def events(self, run_id: str, *, after_id: int = 0, last: int | None = None) -> list[dict[str, Any]]:
        """The run's events after event ``after_id``, oldest first (only the ``last`` ones, if given)."""
        if last is not None:
            rows = self._db.execute("SELECT * FROM events WHERE run_id = ? AND id > ? ORDER BY id DESC LIMIT ?",
                                    (run_id, after_id, last)).fetchall()[::-1]
        else:
            rows = self._db.execute("SELECT * FROM events WHERE run_id = ? AND id > ? ORDER BY id",
                                    (run_id, after_id)).fetchall()
        return [{**dict(r), "data": json.loads(r["data"])} for r in rows]

    def events_since(self, after_id: int, kinds: Sequence[str], *, limit: int = 1000) -> list[dict[str, Any]]:
        """Events of every run after event ``after_id``, of the given kinds, oldest first (alerts)."""
        marks = ", ".join("?" * len(kinds))
        return [{**dict(r), "data": json.loads(r["data"])} for r in self._db.execute(
            f"SELECT * FROM events WHERE id > ? AND kind IN ({marks}) ORDER BY id LIMIT ?", (after_id, *kinds, limit))]

    def last_event_id(self) -> int:
        return int(self._db.execute("SELECT COALESCE(MAX(id), 0) FROM events").fetchone()[0])

    def metrics(self, run_id: str, *, task: str | None = None, name: str | None = None, names: Sequence[str] | None = None,
                after_unix: float | None = None) -> list[dict[str, Any]]:
        """Metric points of a run, oldest first, optionally of one task, one name (or any of ``names``),
        and only those recorded after ``after_unix``: every point of those series (a chart reads
        :meth:`chart`, live updates :meth:`metrics_since`). One index range scan per series."""
        wanted = names if name is None else [n for n in (names or [name]) if n == name]
        if wanted is not None and not wanted:
            return []
        sql = "SELECT task, name, time_unix, step, value, rowid FROM metrics WHERE run_id = ? AND task = ? AND name = ?"
        rows: list[sqlite3.Row] = []
        with metricstore.snapshot(self._db):
            for t, n, _ in metricstore.series(self._db, run_id, task=task, names=wanted):
                if after_unix:
                    rows += self._db.execute(sql + " AND time_unix > ?", (run_id, t, n, after_unix)).fetchall()
                else:
                    rows += self._db.execute(sql, (run_id, t, n)).fetchall()
        rows.sort(key=lambda r: (r["time_unix"], r["rowid"]))
        return [{k: r[k] for k in ("task", "name", "time_unix", "step", "value")} for r in rows]

    def chart(self, run_id: str, *, names: Sequence[str] | None = None, task: str | None = None, x: str = "time",
              lo: float | None = None, hi: float | None = None, max_points: int = 1000) -> tuple[metricstore.Series, int]:
        """At most ``max_points`` points per series of the run for x (``time`` or ``step``) in ``[lo, hi]``
        (min/max buckets, :func:`psflow.platform.metricstore.chart`), and the cursor of the newest
        point then (:meth:`metrics_since` from it gets only what came after)."""
        if not self.read_only and not self._db.in_transaction:
            self.summarise(run_id, quietly=True)  # a run's first chart sums up the points that predate the summaries
        with metricstore.snapshot(self._db):
            return metricstore.chart(self._db, run_id, names=names, task=task, x=x, lo=lo, hi=hi,
                                     max_points=max_points), metricstore.top(self._db)

    def summarise(self, run_id: str, *, quietly: bool = False) -> bool:
        """Sum up run ``run_id``'s points that predate its summaries (a store migrated from before
        version 4), series by series, each in its own short write transaction: readers never wait, and
        a writer waits for one series at most. Returns whether the run is summed up now; ``quietly``:
        a locked or read-only store leaves it for later (its reads go to the points meanwhile)."""
        try:
            if not metricstore.pending(self._db, run_id):  # the common case: a read, no write lock taken
                return True
            while True:
                with self.transaction():
                    if metricstore.summarised(self._db, run_id):
                        return True
                    (task, name), *_ = metricstore.unsummarised(self._db, run_id)
                    metricstore.summarise_series(self._db, (run_id, task, name))
        except sqlite3.Error:
            if not quietly:
                raise
            return False

    def summarise_backlog(self, *, budget_s: float = 0.5) -> int:
        """Sum up runs of the backlog (:meth:`summarise`, newest first) for about ``budget_s`` (a run
        begun is finished, series by series): small batches in the background (the dashboard's).
        Returns how many runs are left."""
        deadline = time.monotonic() + budget_s
        left = metricstore.backlog(self._db)
        while left and time.monotonic() < deadline and self.summarise(left[0], quietly=True):
            left.pop(0)
        return len(left)

    def metrics_since(self, run_id: str, cursor: int, *, names: Sequence[str] | None = None,
                      limit: int = 50_000) -> tuple[list[dict[str, Any]], int]:
        """The run's points written after ``cursor`` (oldest first) and the cursor to ask from next."""
        return metricstore.since(self._db, run_id, cursor, names=names, limit=limit)

    def latest_time(self, run_id: str, name: str) -> float | None:
        """When the run's tasks last reported metric ``name`` (None: never)."""
        return metricstore.latest_time(self._db, run_id, name)

    def latest_metrics(self, run_id: str) -> dict[str, dict[str, float | None]]:
        """Each task's latest value of each metric: ``{"worker:0": {"loss": 0.31, ...}}``."""
        return metricstore.latest(self._db, run_id)

    # -- helpers ------------------------------------------------------------------------------------
    def _tasks(self, run_ids: Sequence[str] | None) -> dict[str, dict[str, dict[str, Any]]]:
        if run_ids is None:
            rows = self._db.execute("SELECT * FROM tasks ORDER BY run_id, position").fetchall()
        else:
            marks = ", ".join("?" * len(run_ids))
            rows = self._db.execute(f"SELECT * FROM tasks WHERE run_id IN ({marks}) ORDER BY run_id, position",
                                    list(run_ids)).fetchall() if run_ids else []
        out: dict[str, dict[str, dict[str, Any]]] = {}
        for r in rows:
            t = {k: (json.loads(r[k]) if k in _TASK_JSON and r[k] is not None else r[k]) for k in r.keys()}
            out.setdefault(t.pop("run_id"), {})[t.pop("name")] = {**t, "exits": []}
        ids = list(out)
        for i in range(0, len(ids), 500):  # one query per 500 runs, not one per run
            chunk = ids[i:i + 500]
            for a in self._db.execute(f"SELECT * FROM attempts WHERE run_id IN ({', '.join('?' * len(chunk))})"
                                      " AND exited_unix IS NOT NULL ORDER BY run_id, task, attempt", chunk):
                tasks = out[a["run_id"]]
                if a["task"] in tasks:
                    tasks[a["task"]]["exits"].append(_exit(dict(a)))
        return out

    def _add_metrics(self, run: dict[str, Any]) -> None:
        latest = self.latest_metrics(run["id"])
        for name, t in run["tasks"].items():
            t["metrics"] = latest.get(name, {})
        summary = run.get("summary") or {}
        run["metrics"] = summary.get("metrics", {})

    def _assessed(self, run: dict[str, Any], tasks: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """``run`` with its tasks and headline figures; a pending or running run whose launcher is gone
        becomes ``abandoned`` (persisted, best effort: a read-only reader still shows it)."""
        run["tasks"] = tasks
        run.update(headline(run))
        if run["state"] not in ("pending", "running"):
            return run
        seen = assess({**run, "state": "running"}, now_unix=time.time())
        for name, t in seen["tasks"].items():
            if "alive" in t:
                tasks[name]["alive"] = t["alive"]
        if seen["state"] == "abandoned":
            run["state"], run["note"] = "abandoned", seen["note"]
            with contextlib.suppress(sqlite3.Error):
                self._db.execute("UPDATE runs SET state = 'abandoned', note = ? WHERE id = ? AND state IN ('pending', 'running')"
                                 " AND heartbeat_unix IS ?", (run["note"], run["id"], run["heartbeat_unix"]))
        return run


def _exit(a: dict[str, Any]) -> dict[str, Any]:
    """An attempt's end, as ``status.json``'s ``exits`` hold them (for the status table)."""
    ran_s = a["exited_unix"] - a["started_unix"] if a["started_unix"] is not None else None
    return {"attempt": a["attempt"], "code": a["exit_code"], "signal": signal_name(a["exit_code"]),
            "cause": a["exit_cause"], "time_unix": a["exited_unix"], "ran_s": None if ran_s is None else round(ran_s, 3),
            "restarted": a["restart_reason"] is not None}


def _run_dict(r: sqlite3.Row) -> dict[str, Any]:
    return {k: (json.loads(r[k]) if k in _RUN_JSON and r[k] is not None else r[k]) for k in r.keys()}


def explain(path: Path, e: sqlite3.Error, busy_timeout_s: float, *, reading: bool = False) -> str:
    """What an SQLite error opening or using the job store at ``path`` means, and what to do
    (``reading``: it was opened read-only)."""
    text = str(e)
    if reading and ("unable to open" in text or "readonly" in text or "read-only" in text):
        return f"Cannot read the job store {path} ({text}). Check that it exists and that you may read it and its directory."
    if "locked" in text or "busy" in text:
        return (f"The job store {path} stayed locked for more than {busy_timeout_s:g} s ({text}): another process "
                f"holds a long write. Try again; if it persists, find that process (fuser {path}).")
    if "unable to open" in text or "readonly" in text or "read-only" in text:
        return (f"Cannot open the job store {path} for writing ({text}). Make it and its directory writable, or set "
                f"PSFLOW_HOME to a directory you can write.")
    return (f"The job store {path} is not a readable SQLite database ({text}). Move it aside "
            f"(mv {path} {path}.corrupt) and psflow starts a new, empty one; the runs' own files (status.json, "
            f"summary.json, logs/ in their logdirs) are not affected.")
