"""The runner: one run of a plan, as a loop around the controller.

The I/O shell of :class:`psflow.launch.controller.RunController`. It

1. writes the run's secret (a 0600 file in the log dir, read by every task) and starts the launcher's
   own server with the coordinator (rendezvous and reports, :mod:`psflow.launch.coordinator`);
2. turns the controller's decisions into backend actions: start an attempt (with the task's
   environment), stop tasks (warning the user where the controller says so);
3. feeds the controller what happens: the backend's exits (each failed task's error report first),
   the tasks' heartbeats and progress reports (from the coordinator's threads, through a queue the
   loop drains: the controller's watchdog), the passing time (every ``tick_s``), and Ctrl-C /
   SIGTERM, or the backend's place ending the run (``Backend.ended_by``: a cancelled Slurm job), or a
   ``stop`` control request from the job store (``psflow stop``, the API: :mod:`psflow.launch.control`), as a
   stop request; a ``scale`` request adds or retires workers (:meth:`RunController.scale`: the new
   tasks' plans, the coordinator's expected tasks and membership, which the ps read, and the run
   store follow), where the backend can (``Backend.scale_refusal``); a :class:`~psflow.launch.controller.DumpStacks` decision becomes the backend's
   ``dump_stacks`` (SIGUSR1), whose location goes back to the controller and into the run store;
4. makes the run store's members and the console's report (:mod:`psflow.launch.consolereport`) the
   controller's subscribers (:mod:`psflow.launch.subscribers`), which learn every state change from it; the runner records
   only the rest (registrations, progress, other events, control answers). Once the run is over it
   reads the ledger over every ps shard copy (:mod:`psflow.launch.copies`: copies that disagree fail
   a run whose tasks all succeeded), puts the root cause in words once and hands every subscriber
   the same :class:`~psflow.launch.subscribers.RunOutcome`.

Signals: the first Ctrl-C or SIGTERM asks the run to stop (every task gets SIGTERM, then SIGKILL
after the plan's ``grace_s``); a second one interrupts the launcher at once, and still nothing it
started outlives it (the backend is closed on the way out).

The only loop: every backend is driven by it; assembled by :func:`psflow.launch.assemble.assemble_run`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import secrets
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from psflow import errorreport
from psflow.launch.backend import Backend, RunResult
from psflow.launch.console import Console
from psflow.launch.consolereport import ConsoleReport
from psflow.launch.control import ControlRequest, check_workers
from psflow.launch.controller import (
    Decision,
    DumpStacks,
    Event,
    RunController,
    RunFailed,
    RunFinished,
    StacksDumped,
    StartTask,
    StopRequested,
    StopTasks,
    TaskExited,
    TaskHeartbeat,
    TaskProgressed,
    TaskReported,
    TaskStarted,
    TimeAdvanced,
)
from psflow.launch.coordinator import Coordinator
from psflow.launch.copies import Finding, backup_workers, check_copies, verdict
from psflow.launch.plan import LaunchPlan, TaskPlan, added_worker
from psflow.launch.restart import RestartPolicy, restart_group
from psflow.launch.runstore import RunStore, file_store
from psflow.launch.subscribers import RunOutcome, RunSubscriber, Subscribers
from psflow.launch.summary import build_summary
from psflow.logdirlock import hold_run
from psflow.ps.authority import ViewAuthority
from psflow.ps.views import ShardView, Sync
from psflow.rundir import RunDir
from psflow.server import Server
from psflow.taskenv import TaskEnv
from psflow.timeline import write_trace


class Runner:
    """Carry out plans on ``backend`` under the controller's rules.

    Args:
        backend: where the tasks run.
        register_timeout_s: how long the coordinator waits for every task to register.
        policy: when tasks are restarted; None (the default): the plan's (``plan.restart``).
        store: makes the run store for a plan (default: :func:`~psflow.launch.runstore.file_store`, the
            files only; the platform hands in one that also records the run: :mod:`psflow.platform.recording`).
        tick_s: how often time advances in the controller when nothing happens.
        on_tick: called by the loop with the controller, the run store and the time, after each turn
            (``psflow chaos`` injects its faults there, through the backend); it may read the
            controller, never step it.
        subscribers: who learns the run's state changes from the controller, given the plan, the run
            store and the restart policy (default: :func:`subscribers`, the store's members and the
            console's report).

    Example:
        >>> Runner(LocalBackend()).run(make_plan("train.py", num_ps=1, num_workers=2)).exit_code
        0
    """

    def __init__(self, backend: Backend, *, register_timeout_s: float = 120.0, policy: RestartPolicy | None = None,
                 store: Callable[[LaunchPlan], RunStore] | None = None, tick_s: float = 0.5,
                 on_tick: Callable[[RunController, RunStore, float], None] | None = None,
                 subscribers: Callable[[LaunchPlan, RunStore, RestartPolicy], list[RunSubscriber]] | None = None) -> None:
        self.backend = backend
        self.console = backend.console
        self.register_timeout_s = register_timeout_s
        self.policy = policy
        self.make_store = store
        self.tick_s = tick_s
        self._views: ViewAuthority | None = None  # ps_replicas=2: the authority over the shard copies (a run's)
        self.on_tick = on_tick
        self.subscribers = subscribers or (lambda plan, store, policy: default_subscribers(self.console, plan, store, policy))

    def run(self, plan: LaunchPlan) -> RunResult:
        """Run ``plan`` to its end; return its exit code (0, 1 failed, 130 stopped), summary and root cause.
        The run holds its logdir throughout (:mod:`psflow.logdirlock`).

        Raises:
            LogdirInUseError: another live run holds the plan's logdir; nothing was started.
        """
        with hold_run(plan.logdir, plan.logdir_url, plan.run_id, say=lambda m: self.console.echo(f"psflow: note: {m}")):
            return self._run(plan)

    def _run(self, plan: LaunchPlan) -> RunResult:
        logdir = Path(plan.logdir)
        logdir.mkdir(parents=True, exist_ok=True)
        t0 = time.time()
        server: Server | None = None
        try:
            store = (self.make_store or file_store)(plan)
            self._open(plan, store)
            secret_file = write_secret(logdir)
            server = Server("launcher", host=self.backend.coordinator_host(), secret=secret_file.read_bytes())
            _record_notes(self.backend, store)  # what the scheduler said while open() waited (job id, queue)
            signs: queue.Queue[Event] = queue.Queue()  # heartbeats and progress, for the controller's watchdog
            group = restart_group(plan.config.strategy, plan.config.ps_replicas, plan.task_names())
            # All-reduce ranks of a new attempt meet only once all have registered it (rank 0's store moved).
            rounds = group.members if group is not None and plan.config.strategy == "allreduce" else ()
            coord = Coordinator(server, plan.task_names(), register_timeout_s=self.register_timeout_s,
                                require_ps=plan.config.strategy == "ps", on_event=_to_store(store, signs), rounds=rounds)
            # ps_replicas=2: this launcher is the one authority over which copy of each shard serves.
            num_ps = sum(1 for t in plan.task_names() if t.startswith("ps:"))
            self._views = (ViewAuthority(server, num_ps, on_change=_view_event(store))
                           if plan.config.strategy == "ps" and plan.config.ps_replicas == 2 and num_ps >= 2 else None)
            address = server.start()
            policy = self.policy or plan.restart
            subscribers = Subscribers(self.subscribers(plan, store, policy), warn=self.console.warn)
            controller = RunController(plan.task_names(), grace_s=plan.grace_s, ps_exit_timeout_s=plan.ps_exit_timeout_s,
                                       policy=policy, hangs=plan.hangs, group=group, subscriber=subscribers,
                                       backoff=self.backend.restart_backoff(policy))
            launcher = TaskEnv(coordinator=address, secret_file=str(secret_file)).render()
            envs = {tp.task: {**dict(tp.env), **launcher} for tp in plan.tasks}
            self._scaling = _Scaling(plan, coord, envs, launcher)
            with self.console.live_table(store.snapshot), _stop_signals(getattr(self.backend, "hurry", None)) as stops:
                finished = self._loop(plan, controller, store, envs, stops, signs)
        finally:
            self.backend.close()
            if server is not None:
                server.stop()
        findings, finished = read_ledger(finished, coord.reports, self._scaling.plan)
        failure = failure_in_words(controller, finished.root_cause)
        summary = build_summary(self._scaling.plan, coord.reports, coord.addresses, controller.records, time.time() - t0,
                                finished.status, finished.root_cause, findings, failure=failure, backoff=controller.backoff)
        if plan.config.timeline:  # every task has exited: merge their spans into one trace
            write_trace(plan.logdir)
        subscribers.on_run_end(RunOutcome(finished.status, finished.exit_code, finished.root_cause, failure, summary))
        return RunResult(finished.exit_code, summary, finished.root_cause)

    def _open(self, plan: LaunchPlan, store: RunStore) -> None:
        """Open the backend for ``plan``; where it refuses (sbatch, the API server) the run is recorded failed."""
        try:
            self.backend.open(plan)
        except Exception as e:
            _record_notes(self.backend, store)
            store.event("launch_failed", error=str(e))
            store.finished("failed")
            raise

    # -- the loop ----------------------------------------------------------------------------------
    def _loop(self, plan: LaunchPlan, controller: RunController, store: RunStore, envs: Mapping[str, Mapping[str, str]],
              stops: _StopSignals, signs: queue.Queue[Event]) -> RunFinished:
        tasks = self._scaling.tasks
        pending: deque[Decision] = deque(controller.start(time.time()))
        while True:
            while pending:
                pending.extend(self._carry_out(pending.popleft(), tasks, controller, store, envs))
            if controller.result is not None:
                return controller.result
            reason = stops.take()
            if reason is not None:
                pending.extend(controller.handle(StopRequested(reason, time.time(), hurry=stops.hurried)))
                continue
            for request in store.control_requests():
                pending.extend(self._control(request, controller, store))
            exits = self.backend.poll(timeout_s=self.tick_s)
            _record_notes(self.backend, store)
            ended = self.backend.ended_by()  # before the exits it caused: they are then a stop's, not failures
            if ended is not None:
                pending.extend(controller.handle(StopRequested(ended, time.time())))
            failed = self.backend.failed_by()  # likewise: the exits it caused are its, not the tasks' own
            if failed is not None:
                pending.extend(controller.handle(RunFailed(failed[0], controller.records[failed[0]].attempt, failed[1],
                                                           time.time())))
            for exited in exits:
                pending.extend(self._exited(exited, controller))
            while True:
                try:
                    pending.extend(controller.handle(signs.get_nowait()))
                except queue.Empty:
                    break
            pending.extend(controller.handle(TimeAdvanced(time.time())))
            if self.on_tick is not None:
                self.on_tick(controller, store, time.time())
            store.tick()  # publish the last changes of a quiet spell

    def _control(self, request: ControlRequest, controller: RunController, store: RunStore) -> list[Decision]:
        """A request from outside the launcher (:mod:`psflow.launch.control`): carried out, or refused with why."""
        out: list[Decision] = []
        if request.kind == "stop":
            state, answer = "done", "every task is being stopped"
            self.console.warn(f"{request.describe()}: stopping every task.")
            out = controller.handle(StopRequested(request.describe(), time.time()))
        elif request.kind == "dump":
            state, answer = self._dump_all(request, controller, store)
        elif request.kind == "scale":
            state, answer, out = self._scale(request, controller, store)
        else:
            state, answer = "refused", (f"this launcher cannot {request.kind} a running run yet (only stop and dump); "
                                        f"stop it and start it again with the new shape")
        store.control_answered(request, state, answer)
        store.event("control", request=request.id, action=request.kind, source=request.source,
                    payload=dict(request.payload), state=state, answer=answer)
        return out

    def _scale(self, request: ControlRequest, controller: RunController, store: RunStore) -> tuple[str, str, list[Decision]]:
        """Add or retire workers (see :mod:`psflow.ps.membership` for what the job does with them)."""
        sc = self._scaling
        refusal = self.backend.scale_refusal()
        if refusal is None and sc.plan.config.strategy == "allreduce":
            refusal = ("all-reduce ranks cannot join or leave a running group (its ranks are fixed at its rendezvous); "
                       "stop the run and start it again with --workers N, or use --strategy ps")
        if refusal is not None:
            return "refused", refusal, []
        before = controller.workers()
        try:
            workers = check_workers(request.payload.get("workers"), current=len(before))
        except ValueError as e:
            return "refused", str(e), []
        refusal = self.backend.scale_refusal(workers)  # e.g. more workers than the ssh hosts have slots for
        if refusal is not None:
            return "refused", refusal, []
        try:
            decisions = controller.scale(workers, time.time())
        except ValueError as e:
            return "refused", str(e), []
        added = [d.task for d in decisions if isinstance(d, StartTask)]
        retired = before[workers:]
        sc.grow(added)
        self.backend.replan(sc.plan)
        # SIGTERM the retiring workers before the ps can learn of it: each then ends its step and says PS_DONE
        # (exit 0) rather than having its next push refused as a retired worker's.
        for d in decisions:
            if isinstance(d, StopTasks):
                self._carry_out(d, sc.tasks, controller, store, sc.envs)
        decisions = [d for d in decisions if not isinstance(d, StopTasks)]
        sc.coord.scale([t for t in controller.names if controller.records[t].state not in ("retired", "retiring")])
        what = (f"adding {', '.join(added)}" if added else "") + ("; " if added and retired else "") + \
               (f"retiring {', '.join(retired)}" if retired else "")
        self.console.warn(f"{request.describe()}: {len(before)} -> {workers} workers: {what or 'nothing to change'}.")
        return "done", f"{len(before)} -> {workers} workers" + (f": {what}" if what else " (already)"), decisions

    def _dump_all(self, request: ControlRequest, controller: RunController, store: RunStore) -> tuple[str, str]:
        """Every running task's stacks into its log; where each went into the run's history."""
        dumped, missing = [], []
        for task, rec in controller.records.items():
            if rec.state != "running":
                continue
            try:
                where = self.backend.dump_stacks(task)
            except (NotImplementedError, OSError) as e:
                missing.append(f"{task} ({e})")
                continue
            if where is None:
                missing.append(f"{task} (its process is gone)")
                continue
            dumped.append(task)
            store.event("stacks_dumped", task=task, attempt=rec.attempt, request=request.id, log=where.log, line=where.line)
        answer = f"stacks of {len(dumped)} task(s) dumped into their logs" + (f"; not: {', '.join(missing)}" if missing else "")
        return ("done" if dumped else "refused"), answer

    def _carry_out(self, d: Decision, tasks: Mapping[str, TaskPlan], controller: RunController, store: RunStore,
                   envs: Mapping[str, Mapping[str, str]]) -> list[Decision]:
        if isinstance(d, StartTask):
            env = {**envs[d.task], **TaskEnv(attempt=d.attempt).render()}  # PSFLOW_ATTEMPT from the first restart on
            handle = self.backend.start(tasks[d.task], d.attempt, env)
            return controller.handle(TaskStarted(d.task, d.attempt, time.time(), handle))
        if isinstance(d, StopTasks):
            if d.warning:
                self.console.warn(d.reason)
            store.event("stop", tasks=list(d.tasks), grace_s=d.grace_s, reason=d.reason)
            self.backend.stop(d.tasks, d.grace_s)
        elif isinstance(d, DumpStacks):
            return self._dump_stacks(d, controller)
        return []  # RestartTask: its StartTask follows once the backoff is over; the subscribers said it

    def _dump_stacks(self, d: DumpStacks, controller: RunController) -> list[Decision]:
        """Have the hung task write its stacks into its log; tell the controller where (its subscribers learn it)."""
        self.console.warn(d.reason)
        stacks, unavailable = None, None
        try:
            stacks = self.backend.dump_stacks(d.task)
            if stacks is None:
                unavailable = "its process is gone"
        except NotImplementedError as e:
            unavailable = str(e)
        except OSError as e:  # the process died between the decision and the signal
            unavailable = f"the signal failed: {e}"
        out = controller.handle(StacksDumped(d.task, d.attempt, time.time(), stacks, unavailable))
        hang = controller.records[d.task].hang
        if hang is not None and hang.attempt == d.attempt and stacks is not None:
            self.console.warn(f"{d.task}: stacks of every thread in {stacks}.")
        return out

    def _exited(self, e: TaskExited, controller: RunController) -> list[Decision]:
        out: list[Decision] = []
        if e.code != 0:  # the report first: the controller may finish the run on this exit
            report = self.backend.error_report(e.task)
            if report is not None:
                out += controller.handle(TaskReported(e.task, e.attempt, report, e.at))
        lost = self._views_after_exit(e)
        if lost is not None:  # a shard's copies are both gone: no restart brings its acknowledged updates back
            out += controller.handle(TaskReported(e.task, e.attempt, {"task": e.task, "exception": "ShardLost",
                                                                      "message": lost, "time_unix": e.at}, e.at))
        out += controller.handle(e)
        if lost is not None:
            out += controller.handle(RunFailed(e.task, e.attempt, lost, e.at))
        return out

    def _views_after_exit(self, e: TaskExited) -> str | None:
        """A ps that failed: its copies died with it, so the views move on at once (before any restart).
        Returns why the run cannot go on when a shard is left with no copy that holds its updates."""
        if self._views is None or not e.task.startswith("ps:") or e.code == 0:
            return None
        changed = self._views.ps_down(int(e.task.split(":")[1]), f"attempt {e.attempt} exited with code {e.code}")
        lost = [v.shard for v in changed if v.state is Sync.LOST]
        if not lost:
            return None
        return (f"ps shard{'s' if len(lost) > 1 else ''} {', '.join(map(str, lost))} lost: {e.task} (attempt {e.attempt}) "
                f"exited while it served {'them' if len(lost) > 1 else 'it'} and no synced copy existed (the other copy "
                "was dead, or still loading the state), so acknowledged updates are gone. Resume from the newest "
                "checkpoint (psflow restart RUN); two ps of one pair failing within a re-sync loses a shard.")


class _Scaling:
    """What a scale request changes beside the controller: the run's plan and task plans, the tasks'
    environments, the coordinator (its expected tasks: the ps read the membership there)."""

    def __init__(self, plan: LaunchPlan, coord: Coordinator, envs: dict[str, dict[str, str]],
                 launcher: Mapping[str, str]) -> None:
        self.plan, self.coord, self.envs, self.launcher = plan, coord, envs, dict(launcher)
        self.tasks = {tp.task: tp for tp in plan.tasks}

    def grow(self, added: list[str]) -> None:
        """Plans and environments for the workers ``added`` that the run never had."""
        new = [added_worker(self.plan, t) for t in added if t not in self.tasks]
        for tp in new:
            self.tasks[tp.task] = tp
            self.envs[tp.task] = {**dict(tp.env), **self.launcher}
        if new:
            self.plan = dataclasses.replace(self.plan, tasks=self.plan.tasks + tuple(new))


def default_subscribers(console: Console, plan: LaunchPlan, store: RunStore, policy: RestartPolicy) -> list[RunSubscriber]:
    """Who learns a run's state changes: each of the run store's members, then the console's report
    (last: it says the run's end once every store has recorded it)."""
    return [*store.members(), ConsoleReport(console, plan, snapshot=store.snapshot, max_restarts=policy.max_restarts)]


def read_ledger(finished: RunFinished, reports: Mapping[str, Mapping[str, Any]],
                plan: LaunchPlan) -> tuple[list[Finding], RunFinished]:
    """The ledger over every ps shard copy (:mod:`psflow.launch.copies`), and the run's verdict after
    it: a run whose tasks all succeeded fails when its copies or shards disagree, with that finding as
    its root cause (exit code 1)."""
    num_ps = sum(1 for t in plan.task_names() if t.startswith("ps:"))
    if not num_ps or not reports:  # no task reported anything (Kubernetes' pods report to no launcher)
        return [], finished
    replicas = sum(1 for t in plan.task_names() if t.split(":")[0] in ("chief", "worker"))
    backups = backup_workers(plan.config.mode, plan.config.replicas_to_aggregate, plan.config.total_num_replicas, replicas)
    findings = check_copies({"mode": plan.config.mode, "reports": reports, "backup_workers": backups}, num_shards=num_ps)
    status, root = verdict(finished.status, finished.root_cause, findings)
    if status == finished.status:
        return findings, finished
    return findings, dataclasses.replace(finished, status=status, root_cause=root, exit_code=1)


def failure_in_words(controller: RunController, root: str | None) -> dict[str, Any] | None:
    """The run's root cause in words (:func:`psflow.errorreport.describe_root_cause`), put once
    for every subscriber: the root task's last attempt's error report and how it ended, as the
    controller recorded them; a finding that failed the run as it is; None when nothing failed."""
    rec = controller.records.get(root) if root else None
    x = rec.exits[-1] if rec is not None and rec.exits else None
    return errorreport.describe_root_cause(root, x.report if x else None, x.cause if x else None)


def write_secret(logdir: Path) -> Path:
    """A fresh job secret in ``logdir/.secret`` (0600): every task proves it holds it."""
    secret_file = RunDir(logdir).secret
    secret_file.touch(mode=0o600)
    secret_file.write_bytes(secrets.token_hex(32).encode())
    return secret_file


def _view_event(store: RunStore) -> Callable[[str, ShardView], None]:
    """A change of a shard's view, into the run's history (the story of its copies)."""
    def on_change(cause: str, view: ShardView) -> None:
        store.event("view", **view.to_dict(), cause=cause)
    return on_change


def _to_store(store: RunStore, signs: queue.Queue[Event] | None = None) -> Callable[[str, dict[str, Any]], None]:
    """The coordinator's events into the run store (``registered``, ``report``; others, such as
    ``reregistered``, into the run's history), and heartbeats and progress into ``signs``, as the
    controller's events (timed by the launcher's clock: the tasks' clocks are not compared)."""
    def on_event(kind: str, data: dict[str, Any]) -> None:
        task = str(data.get("task"))
        if kind == "heartbeat":
            if signs is not None:
                on = data.get("waiting_on")
                signs.put(TaskHeartbeat(task, _int(data.get("attempt")), time.time(), waiting=bool(data.get("waiting")),
                                        waiting_on=on if isinstance(on, str) and on else None))
            return  # a sign of life, about once a second per task: not the run's history
        if kind == "registered":
            store.task_registered(task, str(data.get("address")))
        elif kind == "report":
            metrics = data.get("metrics") or {}
            store.report(task, metrics)
            progress = metrics.get("progress")
            if signs is not None and isinstance(progress, dict):
                step = progress.get("local_step")
                signs.put(TaskProgressed(task, _int(progress.get("attempt")), time.time(),
                                         step if isinstance(step, int) else None))
        else:
            store.event(f"task_{kind}", **data)
    return on_event


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


class _StopSignals:
    """Ctrl-C and SIGTERM, as a stop request the loop takes. The second one hurries it: every task is
    killed at once (``on_hurry``, the backend's :meth:`~psflow.launch.backend.Backend.hurry`, cuts a
    grace under way short), and the run still ends recorded as stopped. The third interrupts at once."""

    def __init__(self, on_hurry: Callable[[], None] | None = None) -> None:
        self._reason: str | None = None
        self._count = 0
        self.on_hurry = on_hurry

    @property
    def hurried(self) -> bool:
        return self._count > 1

    def take(self) -> str | None:
        reason, self._reason = self._reason, None
        return reason

    def handler(self, signum: int, frame: Any) -> None:
        # Only flags here: printing or writing the store from a handler could re-enter what it interrupted.
        self._count += 1
        if self._count > 2:
            raise KeyboardInterrupt
        name = "SIGTERM" if signum == signal.SIGTERM else "Ctrl-C"
        self._reason = name if self._count == 1 else f"{name} again"
        if self._count == 2 and self.on_hurry is not None:
            self.on_hurry()


@contextlib.contextmanager
def _stop_signals(on_hurry: Callable[[], None] | None = None) -> Iterator[_StopSignals]:
    stops = _StopSignals(on_hurry)
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield stops
        return
    old = {s: signal.signal(s, stops.handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stops
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _record_notes(backend: Backend, store: RunStore) -> None:
    """The backend's notes (:meth:`~psflow.launch.backend.Backend.take_notes`) into the run's history."""
    for kind, data in backend.take_notes():
        store.event(kind, **data)
