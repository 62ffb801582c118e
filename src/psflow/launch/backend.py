"""The launch-backend seam: how tasks are started, watched and stopped somewhere.

A backend does the I/O of one kind of place (local processes today; Slurm and Kubernetes next) and
no policy: it starts the attempts it is told to, reports exits as :class:`TaskExited` events, stops
the tasks it is told to, and hands over a task's error report. What to start, stop or restart, and
when the run is over, is decided by :class:`psflow.launch.controller.RunController`; the loop that
connects the two is :class:`psflow.launch.runner.Runner`.

Lifecycle: ``open(plan)`` -> ``start`` / ``poll`` / ``stop`` / ``dump_stacks`` / ``error_report`` /
``ended_by`` -> ``close()`` (always called, also after an error: nothing the backend started may outlive it).
``hurry()`` (a second Ctrl-C, from a signal handler) makes a stop under way, and every later one,
skip the rest of its grace: SIGKILL at once.

:class:`ProcessBackend` is the base of the backends whose every task attempt is a process this
launcher starts and waits on (the task itself, its srun client, its ssh session): it keeps their
bookkeeping (the current attempt of each task, every process started, their exits, a stop that asks
then forces, a close that leaves nothing behind); a subclass says how an attempt starts and how it is
signalled. No backend runs a plan itself: the runner drives it.
"""

from __future__ import annotations

import queue
import re
import subprocess
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from psflow import errorreport
from psflow.launch.console import Console
from psflow.launch.controller import TaskExited
from psflow.launch.plan import LaunchPlan, TaskPlan
from psflow.launch.restart import Backoff, RestartPolicy
from psflow.launch.watchdog import StackDump
from psflow.rundir import RunDir


@dataclass
class RunResult:
    exit_code: int
    summary: dict[str, Any] = field(default_factory=dict)
    root_cause: str | None = None


class Backend(ABC):
    """Starts, watches and stops the tasks of one run. ``console``: where their output goes."""

    def __init__(self, console: Console | None = None) -> None:
        self.console = console or Console()
        self._hurried = threading.Event()

    def hurry(self) -> None:
        """A stop under way, and every later one, skips the rest of its grace (SIGKILL now): the
        user asked twice. Called from a signal handler, so it only sets a flag that the waits read."""
        self._hurried.set()

    def wait_within(self, proc: Any, deadline: float) -> bool:
        """Wait for ``proc`` (a Popen, or anything whose ``wait(timeout)`` raises TimeoutExpired) to
        exit until ``deadline`` (``time.monotonic()``), or until :meth:`hurry`. True if it exited."""
        while True:
            left = 0.0 if self._hurried.is_set() else deadline - time.monotonic()
            try:
                proc.wait(timeout=max(0.0, min(left, 0.1)))
                return True
            except subprocess.TimeoutExpired:
                if left <= 0.1:
                    return False

    def open(self, plan: LaunchPlan) -> None:  # noqa: B027 (a hook: most backends need nothing here)
        """Prepare for ``plan`` before its first task starts."""

    def close(self) -> None:  # noqa: B027
        """Stop whatever is still running and release what :meth:`open` took."""

    def coordinator_host(self) -> str:
        """The address the launcher's coordinator listens on, asked after :meth:`open`: loopback (the
        default: the tasks run on this host), or one the tasks' hosts reach the launcher at (ssh).
        Off loopback the coordinator, like every task, admits only connections that prove the job secret."""
        return "127.0.0.1"

    def ended_by(self) -> str | None:
        """Why the place the tasks run in ended the run from outside (a scheduler job cancelled,
        out of time), once, or None. The runner takes it as a stop request, before the exits it
        caused. Default: never (local processes end only when the runner says)."""
        return None

    def failed_by(self) -> tuple[str, str] | None:
        """``(task, why)`` once, when the place the tasks run in failed the run from outside in a way
        no restart mends (a Slurm allocation lost with a node); ``task`` is blamed. Default: never."""
        return None

    def restart_backoff(self, policy: RestartPolicy) -> Backoff:
        """The wait before each restart, and who starts the task again after it: the policy's own (the
        launcher) unless the backend's place restarts tasks by its own rule (Kubernetes' Job controller).
        The run controller records and says this wait; the restart budgets stay the policy's."""
        return policy.backoff

    def scale_refusal(self, workers: int | None = None) -> str | None:
        """Why this backend cannot add or retire workers of a running run (``psflow scale``), or cannot
        give it ``workers`` workers, with what to do instead; None when it can (then :meth:`replan` gets
        the grown plan before a new task starts)."""
        return (f"the {type(self).__name__.removesuffix('Backend').lower()} backend cannot add or retire workers of a "
                "running run; stop it (psflow stop RUN) and start it again with --workers N")

    def replan(self, plan: LaunchPlan) -> None:  # noqa: B027 (a hook: backends that scale take the grown plan)
        """``plan`` is the run's plan now (``psflow scale`` added tasks to it)."""

    @abstractmethod
    def start(self, task: TaskPlan, attempt: int, env: Mapping[str, str]) -> Any:
        """Start attempt ``attempt`` of ``task`` with ``env`` added to its environment; return its
        handle (a pid for local processes)."""

    @abstractmethod
    def poll(self, timeout_s: float = 0.0) -> list[TaskExited]:
        """The exits seen since the last call, in the order they happened; waits up to ``timeout_s``
        for the first one."""

    @abstractmethod
    def stop(self, tasks: Sequence[str], grace_s: float) -> None:
        """Stop ``tasks``: ask them to exit (SIGTERM), force them after ``grace_s`` (SIGKILL). Their
        exits come through :meth:`poll`."""

    @abstractmethod
    def error_report(self, task: str) -> dict[str, Any] | None:
        """The error report ``task``'s last attempt wrote, or None."""

    def dump_stacks(self, task: str) -> StackDump | None:
        """Have ``task``'s running attempt write the stacks of all its threads into its log (SIGUSR1,
        which every psflow task answers with a stack dump, psflow.heartbeat); return where they go (the log and the line
        they start at or after), or None when the task has no running attempt.

        Raises:
            NotImplementedError: this backend cannot signal its tasks (the default); the message says so.
            OSError: the signal could not be sent.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot signal a task for its stacks")


    def take_notes(self) -> list[tuple[str, dict[str, Any]]]:
        """What the place the tasks run in said since the last call, oldest first, as ``(kind, data)``
        events for the run's history (a scheduler's job id, its queue state and pending reason: the job
        page shows them whatever the backend). Taken by the runner once its store exists, then every
        tick. Default: nothing."""
        return []

    def send_signal(self, task: str, signum: int) -> bool:
        """Send ``signum`` to ``task``'s running attempt (every process of it: SIGKILL, SIGSTOP and
        SIGCONT reach its children too), as ``psflow chaos`` does; True if sent, False when the task
        has no running attempt. The exit it causes comes through :meth:`poll`.

        Raises:
            NotImplementedError: this backend cannot signal its tasks (the default); the message says so.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot send signals to its tasks")


class ProcessBackend(Backend):
    """Each task attempt a process this launcher started and waits on: the task itself (local), its
    srun client (Slurm), its ssh session (ssh). Keeps the bookkeeping they share: each task's current
    attempt, every process of the run (for :meth:`close`), their exits (a thread per process,
    :meth:`poll`), a stop that asks (:meth:`_terminate`), waits out the grace and forces
    (:meth:`_kill`), stacks and signals sent only to a running attempt.

    A subclass supplies how an attempt starts (:meth:`_launch`) and how its process is signalled
    (:meth:`_terminate`, :meth:`_kill`, :meth:`_reap`; :meth:`_ask_stacks` and :meth:`_signal` where it
    can). ``keep_logs``: logs of earlier runs into the same logdir kept per task."""

    join_output = True  # an exit is told once the attempt's output is in its log (False: a child may hold the pipe)

    def __init__(self, console: Console | None = None, *, keep_logs: int = 5) -> None:
        super().__init__(console)
        if keep_logs < 0:
            raise ValueError(f"keep_logs must be >= 0; received {keep_logs}.")
        self.keep_logs = keep_logs
        self._plan: LaunchPlan | None = None
        self._procs: dict[str, Any] = {}  # task -> its current attempt's process
        self._started: list[Any] = []  # every process of the run, for close()
        self._exits: queue.Queue[TaskExited] = queue.Queue()

    # -- what a subclass supplies --------------------------------------------------------------------
    @abstractmethod
    def _launch(self, task: TaskPlan, attempt: int, env: Mapping[str, str]) -> tuple[Any, Any]:
        """Start the attempt's process; return it (a ``pid``, ``poll()`` and ``wait(timeout)``) and its
        output (an iterable of lines, for the console and the task's log)."""

    @abstractmethod
    def _terminate(self, task: str, p: Any) -> None:
        """Ask ``task``'s running process ``p`` to exit (SIGTERM or its like)."""

    @abstractmethod
    def _kill(self, task: str, p: Any) -> None:
        """Force ``p`` out, past its grace (SIGKILL or its like), and reap it."""

    def _reap(self, p: Any) -> None:  # noqa: B027 (a hook: what close() does to each process after the stop)
        """At :meth:`close`, after the stop: make sure ``p`` (any process of the run) is gone."""

    def _ask_stacks(self, task: str, p: Any) -> bool:
        """Have ``p`` dump its threads' stacks into its log; False when it cannot be reached now."""
        raise NotImplementedError(f"{type(self).__name__} cannot signal a task for its stacks")

    def _signal(self, task: str, p: Any, signum: int) -> bool:
        """Send ``signum`` to every process of ``task``'s running attempt ``p``; False if it is gone."""
        raise NotImplementedError(f"{type(self).__name__} cannot send signals to its tasks")

    def _exited(self, task: str, attempt: int, p: Any, code: int) -> TaskExited:
        """The exit of ``p`` as the runner sees it (a backend may read more into it: an OOM kill, a lost node)."""
        return TaskExited(task, attempt, code, time.time())

    # -- the Backend seam ----------------------------------------------------------------------------
    def open(self, plan: LaunchPlan) -> None:
        prepare_logdir(Path(plan.logdir), self.keep_logs)
        self._plan = plan
        self._procs, self._started, self._exits = {}, [], queue.Queue()

    def start(self, task: TaskPlan, attempt: int, env: Mapping[str, str]) -> int:
        plan = self._require_plan()
        if attempt > 0:  # the last attempt's report was read when it exited
            self.error_file(task.task).unlink(missing_ok=True)
        p, output = self._launch(task, attempt, env)
        self._procs[task.task] = p
        self._started.append(p)
        pump = self.console.follow(plan, task, attempt, output)
        threading.Thread(target=self._watch, args=(task.task, attempt, p, pump), daemon=True).start()
        return int(p.pid)

    def poll(self, timeout_s: float = 0.0) -> list[TaskExited]:
        return drain(self._exits, timeout_s)

    def stop(self, tasks: Sequence[str], grace_s: float) -> None:
        live = {t: p for t in tasks if (p := self.running(t)) is not None}
        for t, p in live.items():
            self._terminate(t, p)
        deadline = time.monotonic() + grace_s
        for t, p in live.items():
            if not self.wait_within(p, deadline):  # past the grace, or hurried (a second Ctrl-C)
                self._kill(t, p)

    def error_report(self, task: str) -> dict[str, Any] | None:
        return errorreport.read(self.error_file(task))

    def dump_stacks(self, task: str) -> StackDump | None:
        p = self.running(task)
        if p is None:
            return None
        log = self.log_file(task)
        where = StackDump(str(log), log_end(log))
        return where if self._ask_stacks(task, p) else None

    def send_signal(self, task: str, signum: int) -> bool:
        p = self.running(task)
        return False if p is None else self._signal(task, p, signum)

    def close(self) -> None:
        grace_s = self._plan.grace_s if self._plan is not None else 0.0
        try:
            self.stop(list(self._procs), grace_s)
        finally:
            for p in self._started:
                self._reap(p)

    # -- the bookkeeping -----------------------------------------------------------------------------
    def running(self, task: str) -> Any:
        """``task``'s current attempt's process while it runs, else None."""
        p = self._procs.get(task)
        return p if p is not None and p.poll() is None else None

    def log_file(self, task: str) -> Path:
        return RunDir(self._require_plan().logdir).log(task)

    def error_file(self, task: str) -> Path:
        return RunDir(self._require_plan().logdir).error_report(task)

    def _require_plan(self) -> LaunchPlan:
        if self._plan is None:
            raise RuntimeError(f"{type(self).__name__} used before open(plan).")
        return self._plan

    def _watch(self, task: str, attempt: int, p: Any, pump: threading.Thread) -> None:
        code = p.wait()
        if self.join_output:
            pump.join(timeout=10)  # the log (and what the process said last) is whole before the exit is seen
        self._exits.put(self._exited(task, attempt, p, code))


_ROTATED = re.compile(r"\.\d+\.log$")  # worker-0.1.log: an earlier run's (task names never end in .N)


def prepare_logdir(logdir: Path, keep_logs: int) -> None:
    """``logs/`` and ``errors/`` of a run about to start: the earlier runs' logs rotated (see
    :func:`rotate_logs`), their error reports gone. Called by a backend's ``open``."""
    run_dir = RunDir(logdir)
    run_dir.logs.mkdir(parents=True, exist_ok=True)
    rotate_logs(run_dir.logs, keep_logs)  # a rerun into this logdir keeps the earlier runs' logs
    run_dir.errors.mkdir(parents=True, exist_ok=True)
    for stale in run_dir.errors.glob("*.json*"):  # reports (and temporaries) of an earlier run
        stale.unlink()


def rotate_logs(logs: Path, keep: int) -> None:
    """Keep the logs of earlier runs into the same logdir, as logrotate does: ``worker-0.log`` becomes
    ``worker-0.1.log``, an older ``worker-0.1.log`` becomes ``worker-0.2.log``, and so on; beyond
    ``keep`` the oldest is deleted. Called once, before any task of the new run writes its log."""
    for current in sorted(logs.glob("*.log")):
        if _ROTATED.search(current.name):
            continue
        stem = current.name[: -len(".log")]
        for n in range(keep, 0, -1):
            older = logs / f"{stem}.{n}.log"
            if older.exists():
                if n == keep:
                    older.unlink()
                else:
                    older.replace(logs / f"{stem}.{n + 1}.log")
        if keep:
            current.replace(logs / f"{stem}.1.log")
        else:
            current.unlink()


def log_end(log: Path) -> int:
    """The line a dump written to ``log`` from now on starts at or after (1-based): its lines so far, plus one."""
    lines = 0
    try:
        with log.open("rb") as f:
            while chunk := f.read(1 << 20):
                lines += chunk.count(b"\n")
    except FileNotFoundError:
        pass
    return lines + 1


def drain(exits: queue.Queue[TaskExited], timeout_s: float) -> list[TaskExited]:
    """Every exit queued by a backend's watcher threads: waits up to ``timeout_s`` for the first
    (none: returns at once), then takes what else is there without waiting. ``Backend.poll``'s body."""
    try:
        first = exits.get(timeout=timeout_s) if timeout_s > 0 else exits.get_nowait()
    except queue.Empty:
        return []
    found = [first]
    while True:
        try:
            found.append(exits.get_nowait())
        except queue.Empty:
            return found
