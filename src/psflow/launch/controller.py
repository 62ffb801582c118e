"""RunController: the launcher's rules for one run, as a pure state machine.

Events go in (:class:`TaskStarted`, :class:`TaskExited`, :class:`TaskReported`, :class:`TaskHeartbeat`,
:class:`TaskProgressed`, :class:`StacksDumped`, :class:`HeartbeatMissed`, :class:`StopRequested`,
:class:`RunFailed`, :class:`TimeAdvanced`), each with its unix time; decisions come out (:class:`StartTask`,
:class:`StopTasks`, :class:`RestartTask`, :class:`DumpStacks`, :class:`RunFinished`). No I/O and no
clock: a test steps a whole run by hand; :mod:`psflow.launch.runner` feeds it what the backend saw
and carries out what it decides. It is the one source of the run's state: each change it makes goes
to its subscriber (the stores, the alerts: :mod:`psflow.launch.subscribers`). The rules (failures and the root cause, draining, stops, restarts
and restart groups, hangs, scaling), each with its reason: ``docs/design/run-controller.md``.

Run phases::

    running  --every training task exited 0------------------------------> draining
    running  --a task failed for good | StopRequested---------------------> stopping
    draining --deadline passed with tasks left (warning) | failed | stop--> stopping
    any      --every task exited, none waiting for a restart--------------> finished (RunFinished)

Task states::

    starting --TaskStarted--> running --TaskExited--> exited
    exited   --policy restarts (RestartTask)--> backoff --after_s passed (StartTask)--> starting
    backoff  --stop, failure or draining: the restart is cancelled--> exited
    starting --StopRequested before TaskStarted--> cancelled (never ran; nothing to wait for)
    running  --deadline missed (DumpStacks)--> running, hung --dump_wait_s passed (StopTasks, no grace)--> exited
    running or starting --scale retires it (StopTasks)--> retiring --TaskExited--> retired
    backoff or exited --scale retires it--> retired;  retired --scale adds it (StartTask, next attempt)--> starting
    group member: exited (a trigger's restart) --others stopped and exited--> backoff (RestartTask) --> starting
"""

from __future__ import annotations

import dataclasses
import math
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from psflow.launch.restart import TRAINING_JOBS, Backoff, RestartGroup, RestartPolicy
from psflow.launch.rootcause import TaskExit, root_cause
from psflow.launch.subscribers import RunSubscriber, TaskChange
from psflow.launch.watchdog import Hang, HangPolicy, StackDump, Watchdog

# ------------------------------------------------------------------------------------------ events


@dataclass(frozen=True)
class TaskStarted:
    """The backend started ``task``'s attempt ``attempt``; ``handle`` is its own id for it (a pid)."""

    task: str
    attempt: int
    at: float
    handle: Any = None


@dataclass(frozen=True)
class TaskExited:
    """``task``'s attempt ended: ``code`` is its exit code, negative for the signal that ended it;
    ``oom_killed``: the backend has evidence that the kernel killed it for memory."""

    task: str
    attempt: int
    code: int
    at: float
    oom_killed: bool = False


@dataclass(frozen=True)
class TaskReported:
    """``task``'s attempt left an error report (exception, message, ``time_unix``, optional ``blame``)."""

    task: str
    attempt: int
    report: Mapping[str, Any]
    at: float


@dataclass(frozen=True)
class HeartbeatMissed:
    """``task`` has not been heard from in time, by a watcher outside the controller. Counted; with the
    watchdog on, the task is taken for frozen at once (its stacks are asked for, then it is killed)."""

    task: str
    at: float


@dataclass(frozen=True)
class TaskHeartbeat:
    """``task``'s attempt is alive; ``waiting``: its main thread waits for its peers (a sync quorum);
    ``waiting_on``: the task its main thread is blocked on (``"ps:1"``: a reply, a connection)."""

    task: str
    attempt: int
    at: float
    waiting: bool = False
    waiting_on: str | None = None


@dataclass(frozen=True)
class TaskProgressed:
    """``task``'s attempt reported progress; ``step``: its local step (None: not a trainer's report)."""

    task: str
    attempt: int
    at: float
    step: int | None = None


@dataclass(frozen=True)
class StacksDumped:
    """The stacks :class:`DumpStacks` asked for go to ``stacks`` (None: they could not be asked for,
    ``unavailable`` says why)."""

    task: str
    attempt: int
    at: float
    stacks: StackDump | None = None
    unavailable: str | None = None


@dataclass(frozen=True)
class StopRequested:
    """Someone asked the run to stop; ``reason`` names who (``"Ctrl-C"``, ``"SIGTERM"``). ``hurry``:
    asked again (a second Ctrl-C): every task is killed now, without the rest of its grace."""

    reason: str
    at: float
    hurry: bool = False


@dataclass(frozen=True)
class RunFailed:
    """Something no restart mends ended the run, found outside the task's own exit (a ps shard whose
    copies are both gone: the launcher's views recorded it lost); ``task`` is blamed, ``reason`` says why."""

    task: str
    attempt: int
    reason: str
    at: float


@dataclass(frozen=True)
class TimeAdvanced:
    """Time passed with nothing else happening (the runner's tick): deadlines and backoffs fall due."""

    at: float


Event = (TaskStarted | TaskExited | TaskReported | TaskHeartbeat | TaskProgressed | StacksDumped | HeartbeatMissed
         | StopRequested | RunFailed | TimeAdvanced)


# --------------------------------------------------------------------------------------- decisions


@dataclass(frozen=True)
class StartTask:
    """Start ``task``'s attempt ``attempt`` now."""

    task: str
    attempt: int


@dataclass(frozen=True)
class StopTasks:
    """Stop ``tasks`` (SIGTERM, then SIGKILL after ``grace_s``). ``warning``: show ``reason`` to the user."""

    tasks: tuple[str, ...]
    grace_s: float
    reason: str
    warning: bool = False


@dataclass(frozen=True)
class RestartTask:
    """``task`` will be started again as attempt ``attempt`` in ``after_s`` (a :class:`StartTask` follows)."""

    task: str
    attempt: int
    after_s: float
    reason: str
    group: str | None = None  # restarted with its restart group (named): ``reason`` says why the group restarts


@dataclass(frozen=True)
class DumpStacks:
    """``task``'s attempt ``attempt`` missed a deadline (``reason``): have it write every thread's stack
    into its log (SIGUSR1), and answer with :class:`StacksDumped`. It is killed ``dump_wait_s`` later."""

    task: str
    attempt: int
    reason: str


@dataclass(frozen=True)
class RunFinished:
    """Every task has exited: ``status`` is ``succeeded``, ``failed`` or ``stopped``."""

    status: str
    root_cause: str | None
    exit_code: int


Decision = StartTask | StopTasks | RestartTask | DumpStacks | RunFinished


# ------------------------------------------------------------------------------------------- books


def signal_name(code: int | None) -> str | None:
    """``"SIGKILL"`` for exit code -9; None for a normal exit."""
    if code is None or code >= 0:
        return None
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def describe_exit(code: int) -> str:
    """``"exit code 1"``, ``"exit code -9 (SIGKILL)"``."""
    name = signal_name(code)
    return f"exit code {code}" + (f" ({name})" if name else "")


def exit_cause(code: int, oom_killed: bool = False) -> str:
    """Why an attempt ended, in words: ``"exit code 1"``, ``"killed (SIGKILL)"``, and
    ``"killed (SIGKILL; out of memory?)"`` only where the backend saw evidence of an OOM kill."""
    name = signal_name(code)
    if name is None:
        return f"exit code {code}"
    return f"killed ({name}; out of memory?)" if oom_killed else f"killed ({name})"


def attempt_cause(code: int, oom_killed: bool = False, hang: Mapping[str, Any] | None = None) -> str:
    """Why an attempt ended, for a record that has only its exit (:attr:`ExitRecord.cause` for one
    the controller kept): the watchdog's hang (``hang["cause"]``) where it killed it, else :func:`exit_cause`."""
    return str(hang["cause"]) if hang else exit_cause(code, oom_killed)


@dataclass
class ExitRecord:
    """One attempt's end, as the controller recorded it."""

    attempt: int
    code: int
    at: float
    stopped: bool  # seen after the run had begun stopping
    report: Mapping[str, Any] | None = None  # the attempt's error report, if it left one
    restarted: bool = False  # a later attempt replaced it
    started_at: float | None = None  # when the attempt started (None: its start was not seen)
    oom_killed: bool = False  # the backend saw evidence of an OOM kill
    not_restarted: str | None = None  # why the policy would have restarted it but did not (a budget spent)
    hang: Hang | None = None  # the watchdog caught it: the hang is the cause, whatever the exit code
    retired: bool = False  # a scale request retired the task: an expected end, whatever its code

    @property
    def cause(self) -> str:
        """``"exit code 1"``, ``"killed (SIGKILL)"`` (see :func:`exit_cause`); for an attempt the
        watchdog killed, the hang: ``"hung: no progress for 3.1 s; stacks in LOG from line 57"``."""
        return self.hang.cause if self.hang is not None else exit_cause(self.code, self.oom_killed)

    @property
    def ran_s(self) -> float | None:
        """How long the attempt ran, from its start to its exit."""
        return None if self.started_at is None else max(0.0, self.at - self.started_at)


@dataclass
class TaskRecord:
    """The controller's book on one task."""

    task: str
    state: str = "starting"  # starting | running | exited | backoff | cancelled | retiring | retired
    attempt: int = 0
    handle: Any = None
    restart_due: float | None = None
    started_at: float | None = None  # when the current attempt started
    exits: list[ExitRecord] = field(default_factory=list)
    hang: Hang | None = None  # the current attempt missed a deadline: stacks asked for, kill due

    @property
    def job(self) -> str:
        return self.task.split(":")[0]

    @property
    def started(self) -> bool:
        return self.handle is not None or bool(self.exits)

    @property
    def attempts(self) -> int:
        """How many attempts were started (0 for a task that never ran)."""
        return self.attempt + 1 if self.started else 0


# ------------------------------------------------------------------------------------- the machine


class RunController:
    """The rules of one run over ``tasks`` (plan order: the root-cause tie-break). ``backoff``: the wait
    before each restart where it is not the policy's own (the backend's place restarts the tasks by its
    rule: :meth:`psflow.launch.backend.Backend.restart_backoff`); the budgets are the policy's either way.

    Example:
        >>> c = RunController(["ps:0", "worker:0"], grace_s=5, ps_exit_timeout_s=60)
        >>> c.start(at=0.0)
        [StartTask(task='ps:0', attempt=0), StartTask(task='worker:0', attempt=0)]
        >>> c.handle(TaskStarted("ps:0", 0, at=0.1, handle=11)) + c.handle(TaskStarted("worker:0", 0, at=0.1, handle=12))
        []
        >>> c.handle(TaskExited("worker:0", 0, code=0, at=5.0))  # the ps gets ps_exit_timeout_s to exit
        []
        >>> c.handle(TaskExited("ps:0", 0, code=0, at=5.2))
        [RunFinished(status='succeeded', root_cause=None, exit_code=0)]
    """

    def __init__(self, tasks: Sequence[str], *, grace_s: float, ps_exit_timeout_s: float,
                 policy: RestartPolicy | None = None, hangs: HangPolicy | None = None,
                 group: RestartGroup | None = None, subscriber: RunSubscriber | None = None,
                 backoff: Backoff | None = None) -> None:
        if not tasks:
            raise ValueError("A run needs at least one task; received none.")
        self.names = list(tasks)
        self.subscriber = subscriber or RunSubscriber()  # told every state change (psflow.launch.subscribers)
        self.grace_s = grace_s
        self.ps_exit_timeout_s = ps_exit_timeout_s
        self.policy = policy or RestartPolicy()
        self.backoff = backoff or self.policy.backoff
        self.records = {t: TaskRecord(t) for t in self.names}
        self.phase = "new"  # new | running | draining | stopping | finished
        self.now = -math.inf
        self.first_failure: str | None = None
        self.stopped_by: str | None = None
        self.restarts = 0  # restarts of every task together, for the per-run budget
        self.heartbeats_missed: dict[str, int] = {}
        self.hangs = hangs or HangPolicy()
        self.watchdog = Watchdog(self.hangs, training={t for t in self.names if t.split(":")[0] in TRAINING_JOBS})
        self.result: RunFinished | None = None
        self.group = group
        for t in (*group.members, *group.triggers) if group else ():
            self._record(t)
        self._regroup: str | None = None  # a group restart under way: its cause, until every member has exited
        self._drain_deadline: float | None = None
        self._exit_order: list[tuple[str, ExitRecord]] = []  # every exit, in the order seen
        self._reports: dict[tuple[str, int], Mapping[str, Any]] = {}

    # -- entry points ------------------------------------------------------------------------------
    def start(self, at: float) -> list[Decision]:
        """The first decisions of the run: start every task, attempt 0."""
        if self.phase != "new":
            raise RuntimeError(f"RunController.start called twice (the run is {self.phase}).")
        self.now = at
        self._set_phase("running")
        return [StartTask(t, 0) for t in self.names]

    def handle(self, event: Event) -> list[Decision]:
        """Take one event; return what to do now (possibly nothing)."""
        if self.phase == "new":
            raise RuntimeError(f"RunController got {event!r} before start().")
        self.now = max(self.now, event.at)
        if self.result is not None:
            return []
        if isinstance(event, TaskStarted):
            out = self._on_started(event)
        elif isinstance(event, TaskExited):
            out = self._on_exited(event)
        elif isinstance(event, TaskReported):
            self._reports[(event.task, event.attempt)] = dict(event.report)
            out = []
        elif isinstance(event, HeartbeatMissed):
            self.heartbeats_missed[event.task] = self.heartbeats_missed.get(event.task, 0) + 1
            out = self._on_heartbeat_missed(event)
        elif isinstance(event, TaskHeartbeat):
            self.watchdog.heartbeat(event.task, event.attempt, event.at, waiting=event.waiting,
                                    waiting_on=event.waiting_on)
            out = []
        elif isinstance(event, TaskProgressed):
            self.watchdog.progressed(event.task, event.attempt, event.at, event.step)
            out = []
        elif isinstance(event, StacksDumped):
            out = self._on_stacks_dumped(event)
        elif isinstance(event, StopRequested):
            out = self._on_stop_requested(event)
        elif isinstance(event, RunFailed):
            out = self._fail(event.task, 1, event.reason) if self.phase in ("running", "draining") else []
        elif isinstance(event, TimeAdvanced):
            out = []
        else:
            raise TypeError(f"RunController cannot handle {event!r}; expected one of the events in {__name__}.")
        return out + self._hangs() + self._due_restarts() + self._drain_deadline_passed() + self._finish_if_done()

    # -- events ------------------------------------------------------------------------------------
    def _on_started(self, e: TaskStarted) -> list[Decision]:
        rec = self._record(e.task)
        if e.attempt != rec.attempt:
            return []  # a late notice of an attempt already replaced
        self._tell(TaskChange(e.task, "started", e.attempt, e.at, handle=e.handle))
        if rec.state == "retiring":  # retired by a scale request while it was being started
            rec.handle, rec.started_at = e.handle, e.at
            return [StopTasks((e.task,), self.grace_s, f"{e.task} is retired by a scale request")] + self._finish_if_done()
        rec.state, rec.handle, rec.started_at, rec.hang = "running", e.handle, e.at, None
        self.watchdog.started(e.task, e.attempt)
        if self.phase == "stopping":  # it was being started when the run began to stop
            return [StopTasks((e.task,), self.grace_s, "the run is stopping")]
        if self._regroup is not None and self.group is not None and e.task in self.group.members:
            grace_s = self.grace_s if self.group.grace_s is None else self.group.grace_s
            return [StopTasks((e.task,), grace_s, f"{self.group.what} restarts ({self._regroup})")]
        return []

    def _on_exited(self, e: TaskExited) -> list[Decision]:
        rec = self._record(e.task)
        if e.attempt != rec.attempt or rec.state not in ("running", "starting", "cancelled", "retiring"):
            return []  # a stale or repeated notice
        if rec.state == "retiring":
            exit_ = ExitRecord(e.attempt, e.code, e.at, True, self._reports.get((e.task, e.attempt)),
                               started_at=rec.started_at, oom_killed=e.oom_killed, retired=True)
            rec.exits.append(exit_)
            rec.state, rec.hang = "retired", None
            self._exit_order.append((e.task, exit_))
            self._tell(TaskChange(e.task, "exited", e.attempt, e.at, exit=exit_))
            self._tell(TaskChange(e.task, "retired", e.attempt, e.at))
            return self._maybe_drain(e.at)
        # Killed by the watchdog: the hang is its cause (one that ended by itself after the dump has its own).
        hang = rec.hang if rec.hang is not None and rec.hang.attempt == e.attempt and rec.hang.killed else None
        stopped = self.phase == "stopping" and hang is None  # a hung task's kill is its failure, not a stop's
        code = e.code
        exit_ = ExitRecord(e.attempt, code, e.at, stopped, self._reports.get((e.task, e.attempt)),
                           started_at=rec.started_at, oom_killed=e.oom_killed, hang=hang)
        rec.exits.append(exit_)
        rec.state, rec.hang = "exited", None
        self.watchdog.forget(e.task)
        self._exit_order.append((e.task, exit_))
        self._tell(TaskChange(e.task, "exited", e.attempt, e.at, exit=exit_, hang=None if hang is None else hang.to_dict()))
        if stopped or (hang is not None and self.phase == "stopping"):
            return []
        if self._regroup is not None and self.group is not None and e.task in self.group.members:
            exit_.stopped = True  # stopped for the group's restart (or ended by it): never a failure
            return self._regroup_when_exited()
        if self.phase == "running" and self.policy.is_retryable(rec.job, code):
            if self.group is not None and e.task in self.group.triggers:
                regroup = self._begin_regroup(rec, exit_)
                if regroup is not None:
                    return regroup
            else:
                restart = self._schedule_restart(rec, exit_)
                if restart is not None:
                    return [restart]
        if code != 0:
            return self._fail(e.task, code, exit_.cause if hang is not None else None)
        return self._maybe_drain(e.at)

    def _maybe_drain(self, at: float) -> list[Decision]:
        """Every training task exited 0 (or was retired): the others get ``ps_exit_timeout_s`` to exit."""
        training = [r for r in self.records.values() if r.job in TRAINING_JOBS and r.state != "retired"]
        if self.phase == "running" and all(self._exited_cleanly(r) for r in training):
            self._set_phase("draining")
            self._drain_deadline = at + self.ps_exit_timeout_s
            self._cancel_restarts()  # training is over: a ps waiting for its restart is not needed
        return []

    # -- scaling -----------------------------------------------------------------------------------
    def workers(self) -> list[str]:
        """The run's worker tasks now (not retired nor retiring), in index order."""
        tasks = [t for t, r in self.records.items() if r.job == "worker" and r.state not in ("retired", "retiring")]
        return sorted(tasks, key=lambda t: int(t.split(":")[1]))

    def scale(self, workers: int, at: float) -> list[Decision]:
        """Have ``workers`` worker tasks from now on: start the missing ``worker:K`` (new, or the next
        attempt of a retired one), retire the highest ones (see the module docstring).

        Raises:
            ValueError: the run is not running (finishing, stopping, or a group restart under way), or
                ``workers`` is below one; the message says why and what to do.
        """
        self.now = max(self.now, at)
        if self.phase != "running":
            raise ValueError(f"the run is {self.phase}, not running: only a running run can be scaled.")
        if self._regroup is not None:
            raise ValueError(f"{self.group.what if self.group else 'a group'} is restarting ({self._regroup}); "
                             "ask again once it runs.")
        if workers < 1:
            raise ValueError(f"a run needs at least one worker; received {workers}.")
        now = self.workers()
        out: list[Decision] = []
        for k in range(len(now), workers):
            task = f"worker:{k}"
            rec = self.records.get(task)
            if rec is None:
                self.records[task] = rec = TaskRecord(task)
                self.names.append(task)
            else:
                rec.attempt, rec.handle, rec.hang = rec.attempt + 1, None, None
            rec.state, rec.started_at = "starting", None
            self._tell(TaskChange(task, "added", rec.attempt, self.now))
            out.append(StartTask(task, rec.attempt))
        retire = now[workers:]
        for task in retire:
            rec = self.records[task]
            self.watchdog.forget(task)
            if rec.state == "running":
                rec.state = "retiring"
            elif rec.state == "starting":
                rec.state, rec.started_at = "retiring", None  # stopped once its start is seen
            else:  # exited (finished or failed for good), or waiting for a restart: nothing runs
                if rec.state == "backoff":
                    rec.state, rec.attempt, rec.restart_due = "exited", rec.attempt - 1, None
                    rec.exits[-1].restarted = False
                    self.restarts -= 1
                rec.state = "retired"
                self._tell(TaskChange(task, "retired", rec.attempt, self.now))
        live = tuple(t for t in retire if self.records[t].state == "retiring" and self.records[t].started_at is not None)
        if live:
            out.append(StopTasks(live, self.grace_s, f"retiring {', '.join(live)} (a scale request to {workers} workers)",
                                 warning=True))
        self.watchdog.training = frozenset(self.watchdog.training) | {t for t in self.workers()}
        if self.group is not None and set(self.group.members) & {t for t, r in self.records.items() if r.job == "worker"}:
            kept = tuple(t for t in self.group.members if t not in retire)
            self.group = dataclasses.replace(self.group, members=kept + tuple(t for t in self.workers() if t not in kept))
        return out + self._maybe_drain(at) + self._finish_if_done()

    def _on_stop_requested(self, e: StopRequested) -> list[Decision]:
        self.stopped_by = self.stopped_by or e.reason
        self._set_phase("stopping")
        self._cancel_regroup()
        self._cancel_restarts()
        for rec in self.records.values():
            if rec.state == "starting":
                rec.state = "cancelled"  # never started (or its start is unknown): nothing to wait for
        live = self._live()
        if not live:
            return []
        if e.hurry:
            return [StopTasks(live, 0.0, f"{e.reason}: killing every task now (SIGKILL); the run is recorded as "
                                         "stopped. Once more leaves at once, with nothing recorded", warning=True)]
        return [StopTasks(live, self.grace_s, f"{e.reason}: stopping every task (SIGTERM, then SIGKILL after "
                                              f"{self.grace_s:.0f} s; Ctrl-C again kills them now)", warning=True)]

    def _on_heartbeat_missed(self, e: HeartbeatMissed) -> list[Decision]:
        rec = self._record(e.task)
        if not self.hangs.enabled or self.phase != "running" or rec.state != "running" or rec.hang is not None:
            return []
        quiet = self.now - (rec.started_at if rec.started_at is not None else self.now)
        return [self._dump(Hang(e.task, rec.attempt, "frozen", quiet, self.now, self.now + self.hangs.dump_wait_s))]

    def _on_stacks_dumped(self, e: StacksDumped) -> list[Decision]:
        rec = self._record(e.task)
        if rec.hang is not None and rec.hang.attempt == e.attempt:
            rec.hang.stacks, rec.hang.unavailable = e.stacks, e.unavailable
            self._tell(TaskChange(e.task, "hung", e.attempt, e.at, hang=rec.hang.to_dict()))
        return []

    # -- rules -------------------------------------------------------------------------------------
    def _hangs(self) -> list[Decision]:
        """Deadlines missed now: ask for the stacks; dumps whose wait is over: kill the task."""
        if self.phase != "running":
            return []
        out: list[Decision] = []
        for hang in self.watchdog.overdue(self.now):
            rec = self.records[hang.task]
            if rec.state == "running" and rec.attempt == hang.attempt and rec.hang is None:
                out.append(self._dump(hang))
        for rec in self.records.values():
            h = rec.hang
            if h is not None and not h.killed and rec.state == "running" and self.now >= h.kill_at:
                h.killed = True
                out.append(StopTasks((rec.task,), 0.0, f"{rec.task} (attempt {h.attempt}) {h.cause}; killing it",
                                     warning=True))
        return out

    def _dump(self, hang: Hang) -> DumpStacks:
        self.records[hang.task].hang = hang
        what = "made no progress" if hang.kind == "hung" else "sent no heartbeat"
        blocked = ""
        if hang.awaited_by:  # why the others make no progress either (a frozen ps stops its workers)
            *rest, last = hang.awaited_by
            names = f"{', '.join(rest)} and {last} are" if rest else f"{last} is"
            blocked = f"; {names} blocked on it"
        return DumpStacks(hang.task, hang.attempt, f"{hang.task} (attempt {hang.attempt}) {what} for "
                                                   f"{hang.quiet_s:.1f} s ({hang.kind}{blocked}); dumping its stacks "
                                                   "into its log")

    def _schedule_restart(self, rec: TaskRecord, exit_: ExitRecord) -> RestartTask | None:
        """A RestartTask if the budgets allow it; None when they are spent."""
        finished_ps = [r.task for r in self.records.values() if r.job == "ps" and self._exited_cleanly(r)]
        if rec.job in TRAINING_JOBS and finished_ps:
            return self._not_restarted(rec, exit_, f"the ps finished the job ({', '.join(finished_ps)} exited 0): a "
                                                   f"restarted {rec.task} would find no parameter server to train with")
        done = rec.attempt  # restarts of this task so far
        if done >= self.policy.max_restarts:
            return self._not_restarted(rec, exit_, f"its restart budget is spent ({done} of {self.policy.max_restarts} "
                                                   "per task)")
        if self.policy.max_restarts_per_run is not None and self.restarts >= self.policy.max_restarts_per_run:
            return self._not_restarted(rec, exit_, f"the run's restart budget is spent ({self.restarts} of "
                                                   f"{self.policy.max_restarts_per_run} per run)")
        after_s = self.backoff.wait_s(self._quick_exits(rec) if self.backoff.resets else rec.attempt + 1)
        exit_.restarted = True
        self.restarts += 1
        rec.state, rec.attempt, rec.restart_due = "backoff", rec.attempt + 1, self.now + after_s
        self._tell(TaskChange(rec.task, "restarting", rec.attempt, self.now, after_s=after_s, reason=exit_.cause,
                              by=self.backoff.by))
        return RestartTask(rec.task, rec.attempt, after_s, describe_exit(exit_.code))

    def _quick_exits(self, rec: TaskRecord) -> int:
        """The backoff's exponent: this is the n-th restart since ``rec``'s last healthy attempt (one
        that ran at least the longest wait; one whose start was not seen counts as quick). So the
        restart of a healthy attempt waits the first backoff again, and the quick deaths after it double it."""
        n = 0
        for x in reversed(rec.exits):
            n += 1
            if x.ran_s is not None and x.ran_s >= self.backoff.max_s:
                break
        return max(1, n)

    def _begin_regroup(self, rec: TaskRecord, exit_: ExitRecord) -> list[Decision] | None:
        """A trigger of the restart group exited and the policy restarts it: stop the other members
        (their restarts follow once all have exited); None when a budget does not allow it."""
        assert self.group is not None
        members = [self.records[t] for t in self.group.members]
        spent = max(members, key=lambda r: r.attempt)
        if spent.attempt >= self.policy.max_restarts:
            return self._not_restarted(rec, exit_, f"{self.group.what} restarts together and {spent.task}'s restart "
                                                   f"budget is spent ({spent.attempt} of {self.policy.max_restarts} per task)")
        cap = self.policy.max_restarts_per_run
        if cap is not None and self.restarts + len(members) > cap:
            return self._not_restarted(rec, exit_, f"the run's restart budget is spent ({self.restarts} of {cap} per run; "
                                                   f"{self.group.what} restarts {len(members)} tasks)")
        exit_.restarted = True  # for now: a failure or a stop before the others exit cancels it
        self._regroup = f"{rec.task} (attempt {exit_.attempt}) {exit_.cause}"
        live = tuple(r.task for r in members if r.state == "running")
        out: list[Decision] = []
        if live:
            grace_s = self.grace_s if self.group.grace_s is None else self.group.grace_s
            out.append(StopTasks(live, grace_s, f"{self._regroup}: restarting {self.group.what} from its newest "
                                                     f"checkpoint; stopping {', '.join(live)}", warning=True))
        return out + self._regroup_when_exited()

    def _not_restarted(self, rec: TaskRecord, exit_: ExitRecord, why: str) -> None:
        """The policy would restart ``rec``'s exit ``exit_`` but a budget does not allow it (``why``)."""
        exit_.not_restarted = why
        self._tell(TaskChange(rec.task, "not_restarted", exit_.attempt, self.now, exit=exit_, reason=why))

    def _regroup_when_exited(self) -> list[Decision]:
        """Once every member of the group has exited: restart each as its next attempt."""
        if self._regroup is None or self.group is None:
            return []
        members = [self.records[t] for t in self.group.members]
        if any(r.state in ("running", "starting") for r in members):
            return []
        cause, self._regroup = self._regroup, None
        out: list[Decision] = []
        for rec in members:
            if rec.state != "exited":
                continue  # waiting for its own restart already (a worker's), or never started
            after_s = self.backoff.wait_s(rec.attempt + 1)
            rec.exits[-1].restarted = True
            self.restarts += 1
            rec.state, rec.attempt, rec.restart_due = "backoff", rec.attempt + 1, self.now + after_s
            self._tell(TaskChange(rec.task, "restarting", rec.attempt, self.now, after_s=after_s,
                                  reason=rec.exits[-1].cause, group=self.group.what, trigger=cause, by=self.backoff.by))
            out.append(RestartTask(rec.task, rec.attempt, after_s, cause, group=self.group.what))
        return out

    def _cancel_regroup(self) -> None:
        if self._regroup is None or self.group is None:
            return
        self._regroup = None
        for t in self.group.members:  # the trigger's exit was marked restarted for now: it stands again
            rec = self.records[t]
            if rec.state == "exited" and rec.exits and rec.exits[-1].restarted:
                rec.exits[-1].restarted = False

    def _fail(self, task: str, code: int, cause: str | None = None) -> list[Decision]:
        self.first_failure = self.first_failure or task
        self._set_phase("stopping")
        self._cancel_regroup()
        self._cancel_restarts()
        live = self._live()
        if not live:
            return []
        return [StopTasks(live, self.grace_s, f"{task} failed ({cause or describe_exit(code)}); stopping the others")]

    def _due_restarts(self) -> list[Decision]:
        out: list[Decision] = []
        for rec in self.records.values():
            if rec.state == "backoff" and rec.restart_due is not None and self.now >= rec.restart_due:
                rec.state, rec.restart_due = "starting", None
                out.append(StartTask(rec.task, rec.attempt))
        return out

    def _drain_deadline_passed(self) -> list[Decision]:
        if self.phase != "draining" or self._drain_deadline is None or self.now < self._drain_deadline:
            return []
        self._set_phase("stopping")
        left = self._live()
        if not left:
            return []
        return [StopTasks(left, self.grace_s, f"{', '.join(left)} did not exit {self.ps_exit_timeout_s:.0f} s after "
                                              "the workers finished; stopping them.", warning=True)]

    def _finish_if_done(self) -> list[Decision]:
        if any(r.state in ("starting", "running", "backoff", "retiring") for r in self.records.values()):
            return []
        if self.stopped_by:
            status, code = "stopped", 130
        elif self.first_failure:
            status, code = "failed", 1
        else:
            status, code = "succeeded", 0
        self.result = RunFinished(status, self.root_cause() if self.first_failure else None, code)
        self._set_phase("finished")
        return [self.result]

    def root_cause(self) -> str | None:
        """The rule of :mod:`psflow.launch.rootcause` over each task's last attempt: its exits in
        the order seen, and its error reports. Falls back on the first task that failed."""
        final = self.final_exits()
        exits = [TaskExit(t, x.code, x.at, stopped=x.stopped) for t, x in final]
        reports = {t: x.report for t, x in final if x.report is not None}
        return root_cause(self.names, exits, reports) or self.first_failure

    def killed_hang(self, task: str, attempt: int) -> Hang | None:
        """The hang for which the controller killed ``task``'s ``attempt``, if it did (its exit's cause)."""
        h = self._record(task).hang
        return h if h is not None and h.attempt == attempt and h.killed else None

    def final_exits(self) -> list[tuple[str, ExitRecord]]:
        """The exits that ended a task for good (not followed by a restart), in the order seen."""
        return [(t, x) for t, x in self._exit_order if not x.restarted]

    # -- helpers -----------------------------------------------------------------------------------
    def _tell(self, change: TaskChange) -> None:
        self.subscriber.on_task_state(change)

    def _set_phase(self, phase: str) -> None:
        if phase != self.phase:
            self.phase = phase
            self.subscriber.on_run_state(phase, self.now)

    def _record(self, task: str) -> TaskRecord:
        rec = self.records.get(task)
        if rec is None:
            raise ValueError(f"Task {task!r} is not part of this run; its tasks are {', '.join(self.names)}.")
        return rec

    def _live(self) -> tuple[str, ...]:
        return tuple(t for t, r in self.records.items()
                     if r.state == "running" or (r.state == "retiring" and r.started_at is not None))

    def _cancel_restarts(self) -> None:
        for rec in self.records.values():
            if rec.state == "backoff":
                # Its last exit stands (it counts for the root cause again); the attempt never started.
                rec.state, rec.attempt, rec.restart_due = "exited", rec.attempt - 1, None
                rec.exits[-1].restarted = False
                self.restarts -= 1

    @staticmethod
    def _exited_cleanly(rec: TaskRecord) -> bool:
        return rec.state == "exited" and rec.exits[-1].code == 0
