"""The task: which role this process plays in the cluster, and its server (the seed's steps 1-3).

``init()`` resolves the cluster and this task's role from the first source that has them, in
:mod:`psflow.resolve`'s order: explicit arguments, the launcher's environment, the seeds' flags in
``sys.argv``, ``PSFLOW_CLUSTER`` with ``PSFLOW_TASK``, ``TF_CONFIG``, Slurm's environment. It
starts the task's Server (a ps also hosts its shard) and returns the :class:`Task`.

The ``PSFLOW_*`` environment variables are read here, through :class:`psflow.taskenv.TaskEnv`
(their list: ``psflow.taskenv.ENV``).

Launcher mode: the launcher sets ``PSFLOW_TASK`` and ``PSFLOW_COORDINATOR``; the task binds port 0,
registers the address it got with the launcher's coordinator and receives the whole cluster once
every task has registered. No free-port guessing, so no races. From then on it sends the launcher a
heartbeat every ``heartbeat_every_s`` from a thread of its own (:mod:`psflow.heartbeat`), saying
what its main thread waits for, if it waits for its peers (:meth:`Task.waiting`), and which ps it
is blocked on, if it is (:meth:`Task.heartbeat_payload`). Every task writes
all its threads' stacks into its log on SIGUSR1 (the launcher's watchdog asks so before it kills a
hung task).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

from psflow import errorreport, timeline
from psflow.cluster import ClusterSpec, TaskId, is_loopback_host, parse_address
from psflow.config import TrainConfig
from psflow.cpulimit import container_cpus
from psflow.errors import ConfigError, PsflowError
from psflow.fault import for_attempt
from psflow.heartbeat import Heartbeat, install_stack_dumps
from psflow.identity import TaskIdentity
from psflow.rendezvous import bind_rendezvous, check_exposure
from psflow.resolve.flags import parse_cluster_flags
from psflow.resolve.order import resolve_task
from psflow.server import Server
from psflow.taskenv import TaskEnv, clock_skew_us
from psflow.threads import apply_threads, choose_threads, host_cores
from psflow.wire.conn import connect
from psflow.wire.ops import Op
from psflow.wire.resolve import CoordinatorResolver

log = logging.getLogger("psflow")

_current: Task | None = None


class SupervisedTask(Protocol):
    """What the Supervisor (:mod:`psflow.supervisor`) uses of a task. :class:`Task` derives it, and a
    stand-in (a test's in-process task) defines each member too, so the Supervisor reads them
    directly and never asks a task what it has (as :class:`psflow.train.base.SupervisedTrainer`
    does for trainers)."""

    trainers: list[Any]  # the trainers made on this task; the Supervisor supervises the first unless given one
    logdir: str | None  # PSFLOW_LOGDIR: the Supervisor's logdir unless it names one
    checkpoint_dir: str | None  # PSFLOW_CHECKPOINT_DIR: where checkpoints go unless the Supervisor names it
    resume: bool | None  # PSFLOW_RESUME; None: the Supervisor decides (a named logdir resumes)
    attempt: int  # PSFLOW_ATTEMPT: 0 on the first start, n after the n-th restart
    coordinator: str | None  # the launcher's address; None: a task started by hand

    @property
    def task_id(self) -> TaskId: ...
    @property
    def cluster(self) -> ClusterSpec: ...
    @property
    def is_chief(self) -> bool: ...
    @property
    def num_replicas(self) -> int: ...
    def report(self, **metrics: Any) -> None: ...


class Task(SupervisedTask):
    """This process's place in the job (its :class:`~psflow.identity.TaskIdentity`) and what it runs
    there: its server, its trainers, its reports to the launcher. Created by :func:`init`."""

    def __init__(
        self,
        identity: TaskIdentity,
        *,
        secret: bytes,
        server: Server,
        config: TrainConfig,
        argv: list[str],
        coordinator: str | None,
        logdir: str | None,
        connect_timeout_s: float,
        fail_at: str | None = None,
        data_dir: str | None = None,
        rendezvous: Any = None,
        resume: bool | None = None,
        attempt: int = 0,
        checkpoint_dir: str | None = None,
    ) -> None:
        self.identity = identity
        task_id, cluster = identity.task_id, identity.cluster
        self.secret = secret
        self.server = server
        self.config = config
        self.argv = argv
        self.coordinator = coordinator
        # Where a peer listens now (it may restart on a new port): the launcher's address book; by hand, addresses are fixed.
        self.resolve = CoordinatorResolver(coordinator, secret=secret, task=str(task_id)) if coordinator else None
        self.logdir = logdir
        self.checkpoint_dir = checkpoint_dir  # PSFLOW_CHECKPOINT_DIR: a directory or URL; the Supervisor's default otherwise
        self.resume = resume  # PSFLOW_RESUME; the Supervisor decides what None means
        self.attempt = attempt  # PSFLOW_ATTEMPT: 0 on the first start, n after the n-th restart
        self.connect_timeout_s = connect_timeout_s
        self.fail_at = for_attempt(fail_at, attempt)  # PSFLOW_FAIL_AT: the faults of this attempt only
        self.data_dir = data_dir
        self.rendezvous = rendezvous  # all-reduce, replica 0 only: the TCPStore it serves (psflow.rendezvous)
        self.ps_service = None
        self.trainers: list[Any] = []
        self.reports: dict[str, Any] = {}
        self._finished = False
        self.failure: str | None = None  # the uncaught error this task stops on (set by its error report hook)
        self._co_conn = None
        self._co_lock = threading.Lock()
        self._hb_conn: Any = None  # the heartbeat thread's own connection: a report in flight never delays a beat
        self._heartbeat: Heartbeat | None = None
        self.waiting_for: str | None = None  # what the main thread waits for among its peers (heartbeats say it)
        self._report_error: Exception | None = None
        self._progress_warned = False
        self._writer: Any = None  # TensorBoard scalars (task.scalar, the trainer's progress), made on first use
        self._writer_lock = threading.Lock()
        self._writer_warned = False
        self._placement_warned = False
        self.summary_flush_s = 2.0  # a killed task loses at most this much of its scalars
        if self.is_ps:
            from psflow.fault import crashing_save, parse_faults, ps_step_kill
            from psflow.ps.authority import ViewClient
            from psflow.ps.saveroot import SaveRoot
            from psflow.ps.service import PsService, default_save

            # ps_replicas=2: the launcher's coordinator decides which copy of each shard serves (by hand there is none).
            authority = ViewClient(coordinator, secret=secret, task=str(task_id)) if coordinator else None
            self.ps_service = PsService(server, task_id.index, cluster, resolve=self.resolve,
                                        failover_s=config.backup_failover_s, attempt=attempt, replicas=config.ps_replicas,
                                        authority=authority)
            # PS_SAVE writes inside the run's checkpoint directory only (psflow.ps.saveroot)
            where = SaveRoot(str(task_id), checkpoint_dir=checkpoint_dir, logdir=logdir)
            self.ps_service.on_save = crashing_save(default_save(self.ps_service, where), parse_faults(self.fail_at),
                                                    str(task_id))
            self.ps_service.after_push = ps_step_kill(parse_faults(self.fail_at), str(task_id))
            if attempt >= 1 and config.ps_replicas == 2:
                self.ps_service.start_resync(config.ready_timeout_s)  # serves nothing until its copies are back
            # Until the chief's PS_INIT: its own lost_worker_timeout_s; by hand, nobody restarts a failed worker.
            self.ps_service.store.expect(config, by_hand=not coordinator)
            if coordinator:  # a ps started after a scale request counts the job's replicas as they are now
                self.ps_service.refresh_members()

    # -- roles: this task's identity (psflow.identity) ---------------------------------------
    task_id = property(lambda self: self.identity.task_id)
    cluster = property(lambda self: self.identity.cluster)
    data_shards = property(lambda self: self.identity.data_shards)
    job_name = property(lambda self: self.identity.job)
    task_index = property(lambda self: self.identity.index)
    is_ps = property(lambda self: self.identity.is_ps)
    is_worker = property(lambda self: self.identity.is_worker)
    is_evaluator = property(lambda self: self.identity.is_evaluator)
    is_chief = property(lambda self: self.identity.is_chief)
    num_ps = property(lambda self: self.identity.num_ps)
    num_workers = property(lambda self: self.identity.num_workers)
    num_replicas = property(lambda self: self.identity.num_replicas)
    replica_index = property(lambda self: self.identity.replica_index)
    num_shards = property(lambda self: self.identity.num_shards)
    shard_index = property(lambda self: self.identity.shard_index)

    def __repr__(self) -> str:
        return f"Task({self.task_id}, address={self.server.address}, chief={self.is_chief})"

    # -- lifecycle -------------------------------------------------------------------------
    def join(self, timeout_s: float | None = None, *, term_grace_s: float = 10.0) -> None:
        """A ps serves until every worker is done (then returns, so the process exits).

        On SIGTERM it keeps serving while workers are still connected, for up to ``term_grace_s``
        (less than the launcher's grace before SIGKILL), so that the chief, stopped by the same signal,
        can still write its final checkpoint; with no worker connected it exits at once.

        Raises:
            TrainingError: every worker is done except lost ones (connections closed without
                PS_DONE), and none came back within ``lost_worker_timeout_s``; names them.
        """
        if self.ps_service is None:
            raise ConfigError(f"join() is for ps tasks; {self.task_id} is a {self.job_name}.")
        service, server = self.ps_service, self.server

        def drain() -> None:
            deadline = time.monotonic() + term_grace_s
            while server.num_connections and time.monotonic() < deadline:
                service.join(0.05)  # returns early once every worker has said it is done
            service.stop()

        def on_term(signum: int, frame: Any) -> None:
            threading.Thread(target=drain, name=f"{self.task_id}-drain", daemon=True).start()

        in_main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGTERM, on_term) if in_main else None
        try:
            deadline = None if timeout_s is None else time.monotonic() + timeout_s
            # Serve; about once a second tell the launcher's live status where the job is.
            while not service.join(1.0 if deadline is None else max(0.0, min(1.0, deadline - time.monotonic()))):
                if deadline is not None and time.monotonic() >= deadline:
                    break
                store = service.store  # a restarted ps's own copy arrives with its re-sync
                if store.initialized:
                    # resyncing: some copy it holds still waits for its state, or a shard of its pairs is not
                    # synced (the launcher's view: a backup still catching up); psflow chaos reads it
                    self.report_progress(global_step=store.version, pushes=store.stats.pushes,
                                         stale_dropped=store.stats.stale_dropped,
                                         resyncing=any(r.value == "resyncing" for r in service.roles.values())
                                         or any(v.state.value != "synced" for v in service.views.values()),
                                         **service.latency.take(time.monotonic()))  # push/pull rate, p50, p99
                # Only lost workers left: say whom the ps waits for; past lost_worker_timeout_s, fail naming them.
                service.watch_lost_workers(time.monotonic())
                if self.coordinator:
                    service.refresh_members()  # psflow scale: sync quorums and ssp bounds follow the membership
            # The PS_DONE that ended the job may still be being answered: let the workers hang up
            # before the server stops, or the last one would read a closed connection, not its reply.
            deadline = time.monotonic() + 2.0
            while server.num_connections and time.monotonic() < deadline:
                time.sleep(0.01)
        finally:
            if in_main:
                signal.signal(signal.SIGTERM, previous)
        store = self.ps_service.store
        shards = self.ps_service.copies_report()  # ps_replicas=2: every shard copy it holds, and its role
        self.report(ps_stats=store.stats.to_dict(), global_step=store.version, lost_workers=sorted(store.lost_workers),
                    **({"shards": shards} if shards else {}))
        self.finish()

    def report(self, **metrics: Any) -> None:
        """Send metrics to the launcher (they reach the job summary); a no-op without a launcher.

        Example:
            >>> task.report(test_accuracy=0.9012)
        """
        self.reports.update(metrics)
        if self.coordinator and not self._send_report(metrics, timeout_s=30):
            log.warning("%s could not report to the launcher: %s", self.task_id, self._report_error)

    def report_progress(self, **progress: Any) -> None:
        """Live progress for the launcher's status table and ``status.json`` (trainers call it about
        once a second). Never raises; a launcher that does not answer within 2 s is warned about once.

        Example:
            >>> task.report_progress(global_step=1200, local_step=600, loss=0.41)
        """
        if not self.coordinator:
            return
        progress = {**progress, "attempt": self.attempt, "time_unix": round(time.time(), 3)}
        if not self._send_report({"progress": progress}, timeout_s=2.0):
            if not self._progress_warned:
                self._progress_warned = True
                log.warning("%s could not send progress to the launcher (%s); the run goes on, its live status may lag.",
                            self.task_id, self._report_error)

    @contextlib.contextmanager
    def waiting(self, what: str) -> Iterator[None]:
        """Mark a wait for the task's peers (a sync step's quorum, the ssp bound): the heartbeats say
        so, and the launcher's watchdog does not take this task for the hung one while it lasts.

        Example:
            >>> with task.waiting("the sync step's quorum"):
            ...     replies = client.recv_push_replies(...)
        """
        previous, self.waiting_for = self.waiting_for, what
        try:
            yield
        finally:
            self.waiting_for = previous

    def start_heartbeat(self, every_s: float) -> None:
        """Send the launcher a heartbeat every ``every_s`` from a daemon thread (once; no-op without a launcher)."""
        if not self.coordinator or self._heartbeat is not None:
            return
        self._heartbeat = Heartbeat(self._send_heartbeat, self.heartbeat_payload, every_s=every_s,
                                    name=f"{self.task_id}-heartbeat").start()

    def heartbeat_payload(self) -> dict[str, Any]:
        """What a heartbeat says: the attempt, what the main thread waits for among its peers
        (:meth:`waiting`), and the ps it is blocked on now (``"ps:1"``, marked by a trainer's client
        in every mode), so that the watchdog blames a frozen ps, not its workers."""
        on = None
        for t in self.trainers:
            on = getattr(getattr(t, "client", None), "awaiting", None)
            if on is not None:
                break
        return {"attempt": self.attempt, "waiting": self.waiting_for, "waiting_on": on}

    def _send_heartbeat(self, beat: dict[str, Any]) -> bool:
        """One heartbeat on the heartbeat thread's own connection (dropped when a request fails)."""
        try:
            if self._hb_conn is None:
                self._hb_conn = connect(self.coordinator, secret=self.secret, task=str(self.task_id), peer="launcher",
                                        deadline_s=2.0)
            self._hb_conn.request(Op.CO_REPORT, {"task": str(self.task_id), "metrics": {"heartbeat": beat}}, timeout_s=2.0)
            return True
        except PsflowError:
            if self._hb_conn is not None:
                self._hb_conn.close()
                self._hb_conn = None
            return False

    def scalar(self, name: str, value: float, step: int | None = None) -> None:
        """Write a TensorBoard scalar to ``LOGDIR/summaries/<task>`` (the run's logdir, ``task.logdir``).

        Args:
            name: the tag, e.g. ``"test_mse"`` or ``"eval/mse"``.
            value: a number (a one-element tensor is read with ``float()``).
            step: the x coordinate; default the global step of this task's trainer (0 without one).

        Without a logdir (started by hand with no ``PSFLOW_LOGDIR``) nothing is written; a warning
        says so once. Trainers write ``progress/loss``, ``progress/examples_per_sec`` (wall-clock),
        ``progress/step_examples_per_sec`` and ``progress/global_step`` this way about once a second.

        Example:
            >>> task.scalar("test_mse", 0.0123)                 # at the trainer's global step
            >>> task.scalar("lr", 0.01, step=200)
        """
        writer = self._event_writer()
        if writer is None:
            return
        if step is None:
            step = int(self.trainers[0].global_step) if self.trainers else 0
        writer.scalars(int(step), {name: float(value)})

    def _event_writer(self) -> Any:
        """This task's TensorBoard writer, created on first use; None without a logdir."""
        with self._writer_lock:
            if self._writer is None and self.logdir and not self._finished:
                from psflow.summary import EventWriter

                self._writer = EventWriter(self.logdir, self.task_id, flush_secs=self.summary_flush_s)
            elif not self.logdir and not self._writer_warned:
                self._writer_warned = True
                log.warning("%s has no logdir (set PSFLOW_LOGDIR or start it with `psflow run`): "
                            "its TensorBoard scalars are not written.", self.task_id)
            return self._writer

    def _send_report(self, metrics: dict[str, Any], *, timeout_s: float) -> bool:
        """One CO_REPORT request on the task's connection to the launcher. False (and the connection
        dropped, so that a late reply cannot be taken for the next one's) if it failed."""
        with self._co_lock:
            try:
                if self._co_conn is None:
                    self._co_conn = connect(
                        self.coordinator, secret=self.secret, task=str(self.task_id), peer="launcher",
                        deadline_s=5.0,  # the launcher is local and up, or it is gone: never hold up an exit
                    )
                self._co_conn.request(Op.CO_REPORT, {"task": str(self.task_id), "metrics": metrics}, timeout_s=timeout_s)
                return True
            except PsflowError as e:
                self._report_error = e
                if self._co_conn is not None:
                    self._co_conn.close()
                    self._co_conn = None
                return False

    def _attach_trainer(self, trainer: Any) -> None:
        self.trainers.append(trainer)
        self._warn_imbalance(trainer)

    def _warn_imbalance(self, trainer: Any) -> None:
        """On the chief, once: warn when the trainer's placement leaves one ps with most of the bytes."""
        placement = getattr(trainer, "placement", None)
        if not self.is_chief or self._placement_warned or placement is None:
            return
        from psflow.ps.placement import ImbalancedPlacementWarning, imbalance_message

        message = imbalance_message(placement, trainer.config.placement)
        if message is not None:
            self._placement_warned = True
            # stacklevel 4: the user's Trainer(...) line (via Trainer.__init__ and _attach_trainer)
            warnings.warn(f"{self.task_id}: {message}", ImbalancedPlacementWarning, stacklevel=4)

    def finish(self) -> None:
        """Close trainers (telling the ps this worker is done), report final stats, stop the server."""
        if self._finished:
            return
        self._finished = True
        for t in self.trainers:
            try:
                t.close(failed=self.failure)  # the ps learn it stopped on an error, not that it finished
            except PsflowError as e:
                log.warning("%s: closing the trainer failed: %s", self.task_id, e)
        if self.trainers:
            self.report(trainer=self.trainers[0].stats())
        self._write_timeline()
        if self._co_conn is not None:
            self._co_conn.close()
        if self._heartbeat is not None:
            self._heartbeat.stop()
            if self._hb_conn is not None:
                self._hb_conn.close()
        with self._writer_lock:
            if self._writer is not None:
                self._writer.close()
        self.server.stop()


    def _write_timeline(self) -> None:
        """psflow run --timeline: this task's spans to LOGDIR/timeline/, its phase shares to the summary."""
        tl = timeline.ACTIVE
        if tl is None:
            return
        self.report(timeline=tl.shares())
        with self._co_lock:
            if self._co_conn is not None:  # the connection the report used: the launcher is the reference clock
                conn = self._co_conn
                try:
                    tl.align(lambda: float(conn.request(Op.CLOCK, timeout_s=5.0).meta["now_us"]))
                except (PsflowError, KeyError, TypeError, ValueError) as e:
                    log.warning("%s could not measure its clock's offset to the launcher (its spans keep their own "
                                "clock in the merged timeline): %s", self.task_id, e)
        if self.logdir:
            try:
                tl.write(self.logdir)
            except OSError as e:
                log.warning("%s could not write its timeline under %s: %s", self.task_id, self.logdir, e)


def current_task() -> Task:
    if _current is None:
        raise ConfigError("No psflow task in this process. Call psflow.init() first (it returns the task).")
    return _current


def _read_secret(tenv: TaskEnv, secret_file: str | None) -> bytes:
    path = secret_file or tenv.secret_file
    if path:
        try:
            return Path(path).read_bytes().strip()
        except OSError as e:
            raise ConfigError(f"Cannot read the job secret file {path!r}: {e.strerror}. Check the path and permissions.") from e
    return (tenv.secret or "").encode()


def init(
    argv: Sequence[str] | None = None,
    *,
    cluster: ClusterSpec | dict | None = None,
    job_name: str | None = None,
    task_index: int = 0,
    secret: bytes | str | None = None,
    config: TrainConfig | None = None,
    env: dict[str, str] | None = None,
) -> Task:
    """Resolve this task's cluster and role, start its server, and return the :class:`Task`.

    Args:
        argv: the arguments to look for the seeds' flags in (default ``sys.argv[1:]``); the rest
            is kept in ``task.argv`` for the script's own parser.
        cluster, job_name, task_index: an explicit cluster, overriding flags and environment.
            Without one: the launcher's coordinator, the seeds' flags, ``PSFLOW_CLUSTER``,
            ``TF_CONFIG``, Slurm's environment, the first found.
        secret: the job secret, overriding ``PSFLOW_SECRET`` / ``--secret-file``.
        config: training settings, overriding ``PSFLOW_TRAIN_CONFIG``.

    Raises:
        ConfigError: no cluster found, a bad spec or flag, a busy port, a missing secret off loopback.

    Example:
        >>> task = psflow.init()     # python train.py --ps_hosts=localhost:9001 --worker_hosts=... --job_name=ps --task_index=0
        >>> if task.is_ps: task.join()
    """
    global _current
    _install_user_error_hook()
    install_stack_dumps()  # SIGUSR1: every thread's stack into the task's log (the watchdog asks before a kill)
    env = dict(os.environ if env is None else env)
    tenv = TaskEnv.parse(env)  # every PSFLOW_* variable, checked before anything starts
    args, secret_file = _take_secret_file(list(sys.argv[1:] if argv is None else argv))
    key = secret.encode() if isinstance(secret, str) else (secret if secret is not None else _read_secret(tenv, secret_file))
    cfg = config or tenv.train_config or TrainConfig()
    if tenv.allow_unauthenticated_allreduce:
        cfg = replace(cfg, allow_unauthenticated_allreduce=True)
    flags = parse_cluster_flags(args, require_ps=cfg.strategy == "ps")
    coordinator = tenv.coordinator if cluster is None else None
    spec, task_id = resolve_task(cluster=cluster, job_name=job_name, task_index=task_index, flags=flags, tenv=tenv,
                                 env=env, require_ps=cfg.strategy == "ps")
    _prepare_process(env, tenv, cfg, spec, task_id, launched=bool(coordinator))
    if coordinator:
        server, spec, rendezvous = _serve_launched(coordinator, task_id, key, cfg, tenv, env)
    else:
        assert spec is not None
        server, rendezvous = _serve_by_hand(spec, task_id, key, cfg, tenv, env)
    task = Task(
        TaskIdentity(task_id, spec, tenv.data_shards), secret=key, server=server, config=cfg, argv=flags.rest,
        coordinator=coordinator, logdir=tenv.logdir, connect_timeout_s=tenv.connect_timeout_s, fail_at=tenv.fail_at,
        data_dir=tenv.data_dir, rendezvous=rendezvous, resume=tenv.resume, attempt=tenv.attempt,
        checkpoint_dir=tenv.checkpoint_dir,
    )
    server.routes_ready()  # a ps: its service's routes are registered
    if tenv.chaos and task.ps_service is not None and threading.current_thread() is threading.main_thread():
        service = task.ps_service  # psflow chaos: SIGUSR2 cuts (and the next heals) its links to the other ps
        signal.signal(signal.SIGUSR2, lambda signum, frame: service.partition())
    _install_error_report(task, tenv.error_file)
    atexit.register(task.finish)
    task.start_heartbeat(cfg.heartbeat_every_s)
    _current = task
    return task


def _take_secret_file(args: list[str]) -> tuple[list[str], str | None]:
    """``--secret-file PATH`` (or ``=PATH``) taken out of ``args``: the rest, and the path."""
    for i, a in enumerate(list(args)):
        if a.startswith("--secret-file="):
            return [*args[:i], *args[i + 1:]], a.split("=", 1)[1]
        if a == "--secret-file" and i + 1 < len(args):
            return [*args[:i], *args[i + 2:]], args[i + 1]
    return args, None


def _prepare_process(env: dict[str, str], tenv: TaskEnv, cfg: TrainConfig, spec: ClusterSpec | None, task_id: TaskId,
                     *, launched: bool) -> None:
    """What this process sets up before its server starts: its threads, the slow imports and clients
    started in the background, the timeline, a quick exit."""
    _set_threads(env, tenv, spec, task_id, launched=launched)
    if tenv.checkpoint_dir and "://" in tenv.checkpoint_dir and (task_id.job != "worker" or task_id.index == 0):
        from psflow.checkpoint import remote

        remote.warm_up(tenv.checkpoint_dir)  # a ps writes its shard there, the chief commits, the evaluator reads
    if cfg.timeline:
        timeline.start(str(task_id), tenv.attempt, skew_us=clock_skew_us(tenv.clock_skew, task_id))  # before any connection
    if task_id.job == "ps":
        from psflow.ps.service import build_optimizers_without_dynamo

        build_optimizers_without_dynamo()  # PS_INIT's optimizer no longer waits for torch._dynamo's import
    atexit.register(_quick_interpreter_exit)


def _server_settings(tenv: TaskEnv) -> dict[str, Any]:
    return {k: v for k, v in (("handshake_timeout_s", tenv.handshake_timeout_s),
                              ("max_handshaking", tenv.max_handshaking)) if v is not None}


# All-reduce: replica 0's cluster address is the collective rendezvous, a TCPStore it serves
# (see psflow.rendezvous); its psflow server, which nothing contacts then, moves aside.
def _serve_launched(coordinator: str, task_id: TaskId, key: bytes, cfg: TrainConfig, tenv: TaskEnv,
                    env: dict[str, str]) -> tuple[Server, ClusterSpec, Any]:
    """A launched task: its server on port 0, registered with the launcher's coordinator, which
    answers with the whole cluster. Returns the server, the cluster and the rendezvous (or None)."""
    bind_host = "127.0.0.1" if tenv.bind_host is None else tenv.bind_host
    _check_secret(None, bind_host, key)
    _check_allreduce(cfg, [], bind_host, env)  # every task binds bind_host: the cluster's hosts will be those
    server = Server(str(task_id), host=bind_host, port=0, secret=key, **_server_settings(tenv))
    if task_id.job == "ps":
        server.expect_routes(cfg.ready_timeout_s)  # the ps service is made once the cluster is known
    address = server.start()
    rendezvous = None
    if cfg.strategy == "allreduce" and task_id in (TaskId("chief", 0), TaskId("worker", 0)):
        # Replica 0 is chief:0 if the run has one, else worker:0; only the cluster tells, so both bind.
        rendezvous = bind_rendezvous(bind_host, 0, timeout_s=cfg.ready_timeout_s)
        address = f"{parse_address(address)[0]}:{rendezvous.port}"
    spec = _register(coordinator, task_id, address, key, tenv.connect_timeout_s, cfg.strategy == "ps", tenv.attempt)
    if rendezvous is not None and spec.chief() != task_id:
        rendezvous = None
    return server, spec, rendezvous


def _serve_by_hand(spec: ClusterSpec, task_id: TaskId, key: bytes, cfg: TrainConfig, tenv: TaskEnv,
                   env: dict[str, str]) -> tuple[Server, Any]:
    """A task started by hand: its server on the cluster's address for it. Returns the server and
    the rendezvous (or None)."""
    spec.check_task(task_id)
    host, port = parse_address(spec.address(task_id))
    bind_host = host if tenv.bind_host is None else tenv.bind_host
    _check_secret(spec, bind_host, key)
    _check_allreduce(cfg, spec.hosts(), bind_host, env)
    rendezvous = None
    if cfg.strategy == "allreduce" and spec.chief() == task_id:
        rendezvous = bind_rendezvous(bind_host, port, timeout_s=cfg.ready_timeout_s)
        port = 0
    server = Server(str(task_id), host=bind_host, port=port, secret=key, **_server_settings(tenv))
    if task_id.job == "ps":
        server.expect_routes(cfg.ready_timeout_s)  # a worker may ask before the ps service is made
    server.start()
    return server, rendezvous


def _set_threads(env: dict[str, str], tenv: TaskEnv, spec: ClusterSpec | None, task_id: TaskId, *, launched: bool) -> None:
    """This task's torch threads (:mod:`psflow.threads`): a task started by hand gets its share of
    this host's cores unless the user chose, and says so in its first line (on stderr); a launched
    task keeps the launcher's share (the run's header prints it), capped to its container's CPU limit."""
    choice = choose_threads(env, task_id, cluster=spec, num_threads=tenv.num_threads, launched=launched,
                            cores=host_cores(), cpu_limit=container_cpus())
    apply_threads(choice)
    if launched:
        log.debug(choice.describe(task_id))
    else:
        print(f"psflow: {choice.describe(task_id)}", file=sys.stderr, flush=True)


def _quick_interpreter_exit() -> None:
    """Registered before the task's other exit handlers, so it runs after them: moves every object
    into the garbage collector's permanent generation, so that the interpreter's final collections
    skip them. With torch loaded, that cuts the exit from about 0.6-1.3 s to 0.3 s, per task. Objects
    are still released by reference counting; only cycles left at exit are not collected (their
    ``__del__`` would not be guaranteed to run at exit anyway)."""
    gc.freeze()


def _check_secret(spec: ClusterSpec | None, bind_host: str, key: bytes) -> None:
    """No secret is allowed only when every task is on loopback and this task listens on loopback."""
    if key:
        return
    off_loopback = sorted(h for h in (spec.hosts() if spec is not None else ()) if not is_loopback_host(h))
    if off_loopback:
        raise ConfigError(
            f"No job secret, and the cluster has tasks off loopback ({', '.join(off_loopback)}). "
            "Anyone who can reach those ports could join the job. Give every task the same secret: "
            "PSFLOW_SECRET=... or --secret-file=PATH."
        )
    if not is_loopback_host(bind_host):
        raise ConfigError(
            f"No job secret, and this task would listen on {bind_host or '(every interface)'!r} (PSFLOW_BIND_HOST), "
            "which is not loopback: anyone who can reach its port could join the job. Give every task the same "
            "secret (PSFLOW_SECRET=... or --secret-file=PATH), or keep it on loopback (unset PSFLOW_BIND_HOST)."
        )
    warnings.warn(
        "Running without a job secret (allowed because every task is on loopback). "
        "Set PSFLOW_SECRET or --secret-file to authenticate tasks.",
        stacklevel=3,
    )


def _check_allreduce(cfg: TrainConfig, hosts: Iterable[str], bind_host: str, env: dict[str, str]) -> None:
    """Before the all-reduce store is bound or joined: refuse unauthenticated traffic off loopback unless opted in."""
    if cfg.strategy != "allreduce":
        return
    check_exposure(hosts, bind_host=bind_host, gloo_ifname=env.get("GLOO_SOCKET_IFNAME"),
                   allowed=cfg.allow_unauthenticated_allreduce)


def _register(coordinator: str, task_id: TaskId, address: str, key: bytes, timeout_s: float, require_ps: bool,
              attempt: int = 0) -> ClusterSpec:
    conn = connect(coordinator, secret=key, task=str(task_id), peer="launcher", deadline_s=timeout_s)
    try:
        reply = conn.request(Op.CO_REGISTER, {"task": str(task_id), "address": address, "pid": os.getpid(), "attempt": attempt},
                             timeout_s=timeout_s + 30)
    finally:
        conn.close()
    return ClusterSpec.from_dict(reply.meta["cluster"], require_ps=require_ps)


def _install_user_error_hook() -> None:
    """An uncaught psflow error (a bad TF_CONFIG, a task index out of range, port 99999) is a user's
    mistake with a complete message: print that one line and exit 1, without a traceback. Installed
    first thing in :func:`init`, so that it covers the errors init itself raises; other exceptions
    keep Python's traceback. (Caught errors are untouched: ``init`` still raises ConfigError.)"""
    previous = sys.excepthook
    if getattr(previous, "psflow_user_errors", False):
        return

    def hook(exc_type, exc, tb):  # type: ignore[no-untyped-def]
        if issubclass(exc_type, PsflowError):
            print(f"psflow: error: {exc}", file=sys.stderr, flush=True)
        else:
            previous(exc_type, exc, tb)

    hook.psflow_user_errors = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def _install_error_report(task: Task, path: str | None) -> None:
    """On an uncaught exception: write {task, exception, message, traceback} as JSON where the
    launcher asked (``PSFLOW_ERROR_FILE``); a psflow error is shown as one clear line, not a traceback.
    From then on the task ignores SIGTERM and exits 1 by itself (see :func:`errorreport.ignore_stop_requests`)."""
    previous = sys.excepthook

    def hook(exc_type, exc, tb):  # type: ignore[no-untyped-def]
        errorreport.ignore_stop_requests()  # failing: it ends by itself, with its own exit code (1)
        task.failure = errorreport.one_line(exc)  # before atexit's finish(): its PS_DONE says so
        if path:
            errorreport.write(path, str(task.task_id), exc, tb)
        if issubclass(exc_type, PsflowError):
            print(f"psflow: {task.task_id} failed: {exc_type.__name__}: {exc}", file=sys.stderr, flush=True)
        else:
            previous(exc_type, exc, tb)

    hook.psflow_reports = True  # type: ignore[attr-defined]  # the fork server's child writes no second report
    sys.excepthook = hook
