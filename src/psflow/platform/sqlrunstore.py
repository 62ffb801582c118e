"""SqliteRunStore: a run recorded in the job store, behind the run store's interface.

The launcher's side of :mod:`psflow.platform.jobstore`. Every call of the
:class:`psflow.launch.runstore.RunStore` interface (from the runner's loop and the coordinator's
threads) turns into a write that is queued, never done on the caller's thread: one writer thread
per run owns the run's connection, takes whatever has queued, and writes it in one transaction. So
a task's report is never held up by the database, and the run has exactly one writer.

A database locked by another process (past ``retry_s`` of retries) loses nothing: the batch is
kept, in order, and written with the next ones once the lock is gone (a run started while the store
was locked is recorded then: its row first). When the database cannot be written otherwise (corrupt,
the disk full or gone) the run goes on: the batch is dropped, the launcher is warned once (``warn``),
and later batches are tried again (the file store keeps the whole record meanwhile).
:meth:`SqliteRunStore.finished`, the run's last word, waits (at most ``close_timeout_s``) for
everything queued to be written.

Writer states::

    open --a batch written (with the ones kept before it)--> open
    open --the database stayed locked (warned once)--> open, the batch kept for the next write
    open --a batch failed otherwise (warned once)--> open (the next batch is tried afresh)
    open --finished() written or close_timeout_s passed--> closed (later calls are ignored)
"""

from __future__ import annotations

import math
import os
import queue
import re
import sqlite3
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, is_dataclass
from typing import Any

from psflow.home import jobs_db_path
from psflow.launch.control import ControlRequest
from psflow.launch.controller import attempt_cause, signal_name
from psflow.launch.liveness import process_identity
from psflow.launch.metrics import task_metrics
from psflow.launch.plan import LaunchPlan
from psflow.launch.runstore import RunStore
from psflow.platform.jobstore import JobStore, JobStoreError, explain

# Progress figures kept as metrics over time (besides the script's own scalars and eval/...).
PROGRESS_METRICS = ("loss", "accuracy", "examples_per_sec", "step_examples_per_sec", "global_step", "local_step",
                    "examples", "pushes", "stale_dropped")
_CLOSE = object()


class _StillLocked(Exception):
    """The database stayed locked through a write's retries: its batch is kept for the next write."""

Op = Callable[[JobStore], None]


def run_record(plan: LaunchPlan, *, backend: str, restart_policy: Any = None,
               settings: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """What the job store keeps about a run before it starts: the ``runs`` row of ``plan``.

    The script and its arguments are read from the first task's command (``python -u SCRIPT ARGS``).
    ``settings``: the backend's (``hosts``, ``nodes``, ``coordinator_host``, ``k8s``), kept as
    :func:`recordable_settings` keeps them, so a restart goes to the same hosts, nodes or cluster.
    """
    argv = list(plan.tasks[0].argv) if plan.tasks else []
    rest = argv[1:]
    while rest and rest[0].startswith("-"):  # the interpreter's own options
        rest = rest[1:]
    cluster: dict[str, list[str]] = {}
    for t in plan.task_names():
        cluster.setdefault(t.split(":")[0], []).append(t)
    policy = asdict(restart_policy) if is_dataclass(restart_policy) and not isinstance(restart_policy, type) else {}
    return {
        "id": plan.run_id, "script": rest[0] if rest else "", "args": rest[1:], "logdir": os.path.abspath(plan.logdir),
        "cluster": cluster, "mode": plan.config.mode, "strategy": plan.config.strategy, "backend": backend,
        "restart_policy": policy, "launcher": process_identity(os.getpid()), "created_unix": time.time(),
        # what psflow.platform.launching needs to launch the same plan again (fault injection left out)
        "launch": {"config": plan.config.to_dict(), "hangs": asdict(plan.hangs), "threads": plan.threads,
                   "grace_s": plan.grace_s, "cwd": os.getcwd(),  # cwd: what a relative script path is relative to
                   "gpus_per_worker": _gpus_per_worker(plan), "backend_settings": recordable_settings(settings or {}),
                   **({"logdir_url": plan.logdir_url} if plan.logdir_url else {})},  # logdir: its staging dir
    }


BACKEND_SETTINGS = ("hosts", "nodes", "coordinator_host", "k8s", "sbatch_args")
_CREDENTIAL_LIKE = re.compile(r"secret|token|password|passwd|credential|auth", re.IGNORECASE)


def recordable_settings(settings: Mapping[str, Any]) -> dict[str, Any]:
    """The backend ``settings`` a run's record keeps: those of :data:`BACKEND_SETTINGS` that are set,
    the Kubernetes ones less any that names a secret or credential (``env_secret``,
    ``image_pull_secrets``: a restart asked of the dashboard never carries them), and Slurm's
    ``sbatch_args`` less any that does (``--export=...,API_TOKEN=...``).

    Example:
        >>> recordable_settings({"hosts": "n1:2", "nodes": None, "k8s": {"image": "i", "env_secret": "s"}})
        {'hosts': 'n1:2', 'k8s': {'image': 'i'}}
    """
    out = {k: settings[k] for k in BACKEND_SETTINGS if k not in ("k8s", "sbatch_args") and settings.get(k) not in (None, "")}
    sbatch_args = [a for a in settings.get("sbatch_args") or () if not _CREDENTIAL_LIKE.search(a)]
    if sbatch_args:
        out["sbatch_args"] = sbatch_args
    k8s = {k: v for k, v in dict(settings.get("k8s") or {}).items()
           if not _CREDENTIAL_LIKE.search(k) and v not in (None, "", ())}
    if k8s:
        out["k8s"] = k8s
    return out


def _gpus_per_worker(plan: LaunchPlan) -> int:
    """The GPUs each trainer of ``plan`` was given (:mod:`psflow.launch.gpus`; 0: none), for a restart to ask again."""
    from psflow.launch.gpus import VISIBLE, is_trainer

    for t in plan.tasks:
        visible = dict(t.env).get(VISIBLE)
        if is_trainer(t.task) and visible:
            return len(visible.split(","))
    return 0


class SqliteRunStore(RunStore):
    """The run ``run`` (see :func:`run_record`) recorded in the job store at ``path``.

    Args:
        path: the database file (default ``$PSFLOW_HOME/jobs.db``).
        run: the run's row; its ``id`` names the run.
        tasks: the run's tasks, in the plan's order.
        warn: how the launcher tells its user (once) that the store cannot be written.
        heartbeat_s: how often the run's heartbeat is written (readers take a run whose heartbeat
            stands still, and whose launcher they cannot see, for abandoned).
        retry_s: how long a batch is retried while the database is locked.
        close_timeout_s: how long :meth:`finished` waits for the queue to be written.
    """

    def __init__(self, path: str | os.PathLike[str] | None, run: dict[str, Any], tasks: list[str], *,
                 warn: Callable[[str], None], heartbeat_s: float = 5.0, retry_s: float = 30.0,
                 close_timeout_s: float = 30.0, busy_timeout_s: float = 5.0, control_poll_s: float = 0.5) -> None:
        self.path = path
        self.run_id = str(run["id"])
        self.warn = warn
        self.heartbeat_s, self.retry_s, self.close_timeout_s = heartbeat_s, retry_s, close_timeout_s
        self.busy_timeout_s = busy_timeout_s
        self.control_poll_s = control_poll_s
        self._inbox: queue.SimpleQueue[ControlRequest] = queue.SimpleQueue()  # taken control requests, for the runner
        self._last_poll = -math.inf
        self.failures = 0  # batches that could not be written
        self.busy_retries = 0  # times a batch found the database locked and was tried again
        self.kept = 0  # records waiting for the lock to go (written with the next batch)
        self._warned = False
        self._closed = False
        self._ops: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._progress: dict[str, dict[str, Any]] = {t: {} for t in tasks}
        self._last_beat = time.monotonic()
        self._lock = threading.Lock()  # the progress book (reports come from the coordinator's threads)
        self._put(lambda db: db.add_run(run, tasks))
        self._put(self._event_op("run_started", {"run_id": self.run_id, "tasks": tasks}))
        self._thread = threading.Thread(target=self._write_loop, name=f"psflow-jobstore-{self.run_id}", daemon=True)
        self._thread.start()

    # -- the RunStore interface (any thread; never blocks on the database) ---------------------------
    def task_started(self, task: str, attempt: int, handle: Any) -> None:
        at = time.time()
        pid = handle if isinstance(handle, int) else None
        scheduler_id = None if pid is not None or handle is None else str(handle)
        identity = process_identity(pid) if pid is not None else None
        self._put(lambda db: db.task_started(self.run_id, task, attempt, at, pid=pid, scheduler_id=scheduler_id,
                                             identity=identity))
        self._put(self._event_op("task_started", {"task": task, "attempt": attempt, "pid": pid,
                                                  "scheduler_id": scheduler_id}, at))

    def task_registered(self, task: str, address: str) -> None:
        at = time.time()
        self._put(lambda db: db.task_registered(self.run_id, task, address, at))
        self._put(self._event_op("task_registered", {"task": task, "address": address}, at))

    def report(self, task: str, metrics: dict[str, Any]) -> None:
        at = time.time()
        figures = _progress_figures(metrics)
        with self._lock:
            if task not in self._progress:
                return  # not one of the run's tasks (the coordinator refuses those; belt and braces)
            progress = self._progress[task]
            progress.update(figures)
            snapshot = dict(progress)
        step = snapshot.get("global_step") if isinstance(snapshot.get("global_step"), int) else None
        points = [(k, float(v), step) for k, v in figures.items() if k in PROGRESS_METRICS and _is_real(v)]
        points += [(k, float(v), step) for k, v in task_metrics(metrics).items()]
        self._put(lambda db: db.task_progress(self.run_id, task, snapshot, at, points))

    def task_exited(self, task: str, attempt: int, code: int, at: float, *, oom_killed: bool = False,
                    hang: dict[str, Any] | None = None, cause: str | None = None) -> None:
        cause = cause or attempt_cause(code, oom_killed, hang)
        self._put(lambda db: db.task_exited(self.run_id, task, attempt, at, code, cause))
        self._put(self._event_op("task_exited", {"task": task, "attempt": attempt, "code": code,
                                                 "signal": signal_name(code), "cause": cause,
                                                 **({"hang": hang} if hang else {})}, at))

    def task_restarting(self, task: str, attempt: int, after_s: float, reason: str) -> None:
        self._put(lambda db: db.task_restarting(self.run_id, task, attempt, reason))
        self._put(self._event_op("restart", {"task": task, "attempt": attempt, "after_s": after_s, "reason": reason}))

    def event(self, kind: str, **data: Any) -> None:
        self._put(self._event_op(kind, data))

    def tasks_added(self, tasks: list[str]) -> None:
        with self._lock:
            for t in tasks:
                self._progress.setdefault(t, {})
        self._put(lambda db: db.add_tasks(self.run_id, tasks))
        self._put(self._event_op("tasks_added", {"tasks": list(tasks)}))

    def task_retired(self, task: str) -> None:
        self._put(lambda db: db.task_retired(self.run_id, task))
        self._put(self._event_op("task_retired", {"task": task}))

    def on_run_state(self, state: str, at: float) -> None:
        self._put(lambda db: db.set_phase(self.run_id, state))
        self._put(self._event_op("run_phase", {"phase": state}, at))

    def finished(self, status: str) -> None:
        at = time.time()
        self._put(self._event_op("run_finished", {"status": status}, at))
        self._put(lambda db: db.finish_run(self.run_id, status, at))
        self.close()

    def summary(self, summary: dict[str, Any]) -> None:
        self._put(lambda db: db.set_summary(self.run_id, summary))

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"run_id": self.run_id, "tasks": {t: {"progress": dict(p)} for t, p in self._progress.items()}}

    def tick(self) -> None:
        now = time.monotonic()
        if now - self._last_beat >= self.heartbeat_s:
            self._last_beat = now
            at = time.time()
            self._put(lambda db: db.heartbeat(self.run_id, at))

    def control_requests(self) -> list[ControlRequest]:
        out = []
        while True:
            try:
                out.append(self._inbox.get_nowait())
            except queue.Empty:
                return out

    def control_answered(self, request: ControlRequest, state: str, answer: str) -> None:
        at = time.time()
        self._put(lambda db: db.answer_control(request.id, state, answer, at))

    def close(self) -> None:
        """Write what is queued (at most ``close_timeout_s``), then stop the writer."""
        if self._closed:
            return
        self._ops.put(_CLOSE)
        self._thread.join(self.close_timeout_s)
        self._closed = True
        if self._thread.is_alive():
            self._warn_once(f"the job store {self._where()} did not take the run's last records within "
                            f"{self.close_timeout_s:g} s; the run's files in its logdir have them.")

    # -- the writer thread ----------------------------------------------------------------------------
    def _put(self, op: Op) -> None:
        if not self._closed:
            self._ops.put(op)

    def _event_op(self, kind: str, data: Mapping[str, Any], at: float | None = None) -> Op:
        when = time.time() if at is None else at
        return lambda db: db.add_event(self.run_id, kind, when, dict(data))

    def _write_loop(self) -> None:
        db: JobStore | None = None
        kept: list[Op] = []  # written before anything newer: the store stayed locked when they came
        try:
            while True:
                try:  # wakes at least every control_poll_s: control requests are polled from here
                    batch = [self._ops.get(timeout=self.control_poll_s)]
                except queue.Empty:
                    batch = []
                while True:
                    try:
                        batch.append(self._ops.get_nowait())
                    except queue.Empty:
                        break
                stop = any(op is _CLOSE for op in batch)
                kept += [op for op in batch if op is not _CLOSE]
                if kept:
                    try:
                        db = self._write(db, kept, keep_if_locked=True)
                        kept = []
                    except _StillLocked as e:
                        db = None
                        self._warn_once(f"the job store {self._where()} stays locked by another process ({e}); run "
                                        f"{self.run_id} is recorded there once it is free (nothing is lost: its "
                                        "records wait in order). Its files in the logdir are complete meanwhile.")
                    self.kept = len(kept)
                if stop:
                    return
                if not kept:  # a locked store has nothing to hand out
                    db = self._poll_control(db)
        finally:
            if db is not None:
                db.close()

    def _poll_control(self, db: JobStore | None) -> JobStore | None:
        """Take the run's pending control requests (every ``control_poll_s``) into the runner's inbox,
        once their transaction committed (a request is never handed out twice)."""
        now = time.monotonic()
        if now - self._last_poll < self.control_poll_s:
            return db
        self._last_poll = now
        taken: list[dict[str, Any]] = []
        at = time.time()

        def take(d: JobStore) -> None:
            taken[:] = d.take_control(self.run_id, at)  # replaced, not extended: a retried transaction runs again
        db = self._write(db, [take])
        if db is None:
            return None
        for r in taken:
            self._inbox.put(ControlRequest(int(r["id"]), str(r["kind"]), str(r["source"]), float(r["requested_unix"]),
                                           dict(r["payload"])))
        return db

    def _write(self, db: JobStore | None, batch: list[Op], *, keep_if_locked: bool = False) -> JobStore | None:
        """Write ``batch`` in one transaction, retrying while the database is locked; on any other
        failure drop it and warn (once). Returns the connection to use next (None: open afresh).

        Raises:
            _StillLocked: with ``keep_if_locked``, the database stayed locked for ``retry_s``: the
                batch was not written, and the caller keeps it (the connection is closed).
        """
        deadline = time.monotonic() + self.retry_s
        delay_s = 0.05
        while True:
            try:
                if db is None:
                    db = JobStore(self.path, busy_timeout_s=self.busy_timeout_s)
                with db.transaction():
                    for op in batch:
                        op(db)
                return db
            except (sqlite3.OperationalError, JobStoreError) as e:
                if _is_busy(e) and time.monotonic() + delay_s < deadline:
                    self.busy_retries += 1
                    time.sleep(delay_s)  # a backoff between retries, not a synchronisation
                    delay_s = min(delay_s * 2, 1.0)
                    continue
                if _is_busy(e) and keep_if_locked:
                    if db is not None:
                        db.close()
                    raise _StillLocked(str(e)) from e
                return self._failed(db, e)
            except (sqlite3.Error, OSError) as e:
                return self._failed(db, e)

    def _failed(self, db: JobStore | None, e: Exception) -> JobStore | None:
        self.failures += 1
        why = str(e) if isinstance(e, JobStoreError) else explain(self._path(db), e, self.busy_timeout_s) \
            if isinstance(e, sqlite3.Error) else f"{type(e).__name__}: {e}"
        self._warn_once(f"cannot record run {self.run_id} in the job store: {why} The run goes on; its files "
                        f"(status.json, events.jsonl, summary.json) in its logdir are complete.")
        if db is not None:
            db.close()
        return None

    def _warn_once(self, message: str) -> None:
        if self._warned:
            return
        self._warned = True
        try:
            self.warn(message)
        except Exception:  # noqa: BLE001 (a console gone at exit: the warning is all that is lost)
            pass

    def _path(self, db: JobStore | None) -> Any:
        return db.path if db is not None else (self.path or jobs_db_path())

    def _where(self) -> str:
        return str(self._path(None))


def _progress_figures(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """A report's progress figures (live ``progress``, final ``trainer`` stats and the supervisor's last
    loss, a ps's ``global_step``)."""
    out: dict[str, Any] = {}
    for key in ("progress", "trainer"):
        if isinstance(metrics.get(key), Mapping):
            out.update({k: v for k, v in metrics[key].items() if _is_real(v)})
    if isinstance(metrics.get("global_step"), int) and not isinstance(metrics.get("global_step"), bool):
        out["global_step"] = metrics["global_step"]
    supervisor = metrics.get("supervisor")
    if isinstance(supervisor, Mapping) and _is_real(supervisor.get("last_loss")):
        out["loss"] = supervisor["last_loss"]  # the final report's: newer than the last live progress
    return out


def _is_real(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _is_busy(e: Exception) -> bool:
    text = str(e)
    return "locked" in text or "busy" in text
