"""The run store: where a run's state is kept while it goes on and after it ended.

One interface (:class:`RunStore`), read by ``psflow status`` / ``psflow summary`` and the dashboard.
A store subscribes to the run controller's state changes (a :class:`~psflow.launch.subscribers.RunSubscriber`:
tasks started, exited, hung, restarting, added, retired; the run's end with its outcome) and is
written by the runner (:mod:`psflow.launch.runner`) and the coordinator's callbacks (from the
launcher server's threads: implementations are thread-safe) for the rest: registrations, progress
reports, the history's other events, control requests. What it records:

- each attempt of each task: started (pid), registered (address), its progress reports, a hang the
  watchdog caught (kind, how long it was quiet, where its stacks were dumped: log and line), its exit
  (code, signal name, cause: ``killed (SIGKILL)``, or the hang's), and the restart that followed it;
- the run's events in order (starts, exits, stops and restarts decided, the run's phases, the end);
- the run's end state, and its summary.

:class:`FileRunStore` is the file layout of a local run: ``status.json`` (the live state, see
:mod:`psflow.launch.status`), ``events.jsonl`` (one JSON object per line, appended as they happen),
``summary.json`` (written once, at the end); :func:`file_store` makes it, the Runner's default. The
job store (SQLite, :class:`psflow.platform.sqlrunstore.SqliteRunStore`) implements the same
interface, and the platform hands the Runner a :class:`CompositeRunStore` that writes a run to both
(:mod:`psflow.platform.recording`; launch/ never imports it): the files are the run's own record (its
live table); a store that fails is warned about once and never stops the run.
"""

from __future__ import annotations

import json
import os
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from psflow.launch.control import ControlRequest
from psflow.launch.controller import attempt_cause, signal_name
from psflow.launch.plan import LaunchPlan
from psflow.launch.status import RunStatus
from psflow.launch.subscribers import RunOutcome, RunSubscriber, TaskChange
from psflow.rundir import RunDir


class RunStore(RunSubscriber, ABC):
    """A run's state: written as it happens, read by the CLI and the dashboard. As a subscriber, each
    state change the controller makes goes to the method that records it (:meth:`on_task_state`)."""

    def on_task_state(self, change: TaskChange) -> None:
        c = change
        if c.state == "started":
            self.task_started(c.task, c.attempt, c.handle)
        elif c.state == "exited" and c.exit is not None:
            x = c.exit
            hang = dict(c.hang) if c.hang is not None else (x.hang.to_dict() if x.hang is not None else None)
            self.task_exited(c.task, c.attempt, x.code, x.at, oom_killed=x.oom_killed, hang=hang, cause=x.cause)
        elif c.state == "hung" and c.hang is not None:
            self.task_hung(c.task, dict(c.hang))
        elif c.state == "restarting":
            self.task_restarting(c.task, c.attempt, c.after_s or 0.0, c.reason or "")
        elif c.state == "added":
            self.tasks_added([c.task])
        elif c.state == "retired":
            self.task_retired(c.task)

    def on_run_end(self, outcome: RunOutcome) -> None:
        """The summary, then the end state: the run's last word to this store."""
        self.summary(dict(outcome.summary))
        self.finished(outcome.status)

    def members(self) -> list[RunStore]:
        """The stores this one writes to (itself; a composite: each of its own), each a subscriber."""
        return [self]

    @abstractmethod
    def task_started(self, task: str, attempt: int, handle: Any) -> None:
        """Attempt ``attempt`` of ``task`` started; ``handle`` is the backend's (a pid for local tasks)."""

    @abstractmethod
    def task_registered(self, task: str, address: str) -> None:
        """``task`` registered with the coordinator: it is up, at ``address``."""

    @abstractmethod
    def report(self, task: str, metrics: dict[str, Any]) -> None:
        """``task`` reported metrics (live progress, or its final figures)."""

    @abstractmethod
    def task_exited(self, task: str, attempt: int, code: int, at: float, *, oom_killed: bool = False,
                    hang: dict[str, Any] | None = None, cause: str | None = None) -> None:
        """Attempt ``attempt`` of ``task`` ended with exit code ``code`` (negative: the signal);
        ``oom_killed``: the backend saw evidence of an OOM kill; ``hang``: the watchdog killed it
        (:meth:`psflow.launch.watchdog.Hang.to_dict`, its ``cause`` is the exit's); ``cause``: why it
        ended, as the controller recorded it (None: :func:`~psflow.launch.controller.attempt_cause`)."""

    def task_hung(self, task: str, hang: dict[str, Any]) -> None:
        """The watchdog caught ``task`` (:meth:`psflow.launch.watchdog.Hang.to_dict`: kind, quiet
        time, where its stacks went); it is killed next. Default: into the run's history."""
        self.event("task_hung", task=task, attempt=hang.get("attempt"), hang=hang)

    @abstractmethod
    def task_restarting(self, task: str, attempt: int, after_s: float, reason: str) -> None:
        """``task`` exited (``reason``) and will start again as attempt ``attempt`` in ``after_s`` s."""

    @abstractmethod
    def event(self, kind: str, **data: Any) -> None:
        """Something else worth keeping in the run's history (a stop or a restart decided, ...)."""

    @abstractmethod
    def finished(self, status: str) -> None:
        """The run ended: ``succeeded``, ``failed`` or ``stopped``."""

    @abstractmethod
    def summary(self, summary: dict[str, Any]) -> None:
        """The run's summary (see :func:`psflow.launch.summary.build_summary`)."""

    @abstractmethod
    def snapshot(self) -> dict[str, Any]:
        """The live state, as ``status.json`` holds it (for the live table)."""

    def tick(self) -> None:  # noqa: B027 (a hook: stores that write at once need nothing)
        """Called every so often: publish what a quiet spell left unpublished."""

    def tasks_added(self, tasks: list[str]) -> None:  # noqa: B027 (a hook)
        """``psflow scale`` added ``tasks`` to the run (they start next)."""

    def task_retired(self, task: str) -> None:  # noqa: B027 (a hook)
        """``task`` was retired by ``psflow scale``: its last exit is an expected end, not a failure."""

    def control_requests(self) -> list[ControlRequest]:
        """Requests from outside the launcher (stop, scale) that arrived since the last call, oldest
        first; never blocks. Default: none (a store nobody else can write to)."""
        return []

    def control_answered(self, request: ControlRequest, state: str, answer: str) -> None:  # noqa: B027 (a hook)
        """The runner carried out ``request`` (``state`` ``done``) or could not (``refused``): ``answer`` says what."""


def file_store(plan: LaunchPlan) -> RunStore:
    """A run's own record, the Runner's default store: its files in the plan's log dir."""
    return FileRunStore(plan.logdir, plan.run_id, plan.task_names(), mode=plan.config.mode, strategy=plan.config.strategy)


class FileRunStore(RunStore):
    """``status.json``, ``events.jsonl`` and ``summary.json`` in ``logdir`` (an earlier run's are replaced)."""

    def __init__(self, logdir: str | os.PathLike[str], run_id: str, tasks: Sequence[str], *, mode: str = "async",
                 strategy: str = "ps") -> None:
        self.logdir = Path(logdir)
        self.status = RunStatus(run_id, tasks, logdir, mode=mode, strategy=strategy)
        self._lock = threading.Lock()
        self._events = RunDir(logdir).events
        self._events.write_text("")
        self.event("run_started", run_id=run_id, tasks=list(tasks))

    def task_started(self, task: str, attempt: int, handle: Any) -> None:
        pid = handle if isinstance(handle, int) else None
        self.status.started(task, pid, attempt)  # type: ignore[arg-type]
        self.event("task_started", task=task, attempt=attempt, pid=pid)

    def task_registered(self, task: str, address: str) -> None:
        self.status.on_event("registered", {"task": task, "address": address})
        self.event("task_registered", task=task, address=address)

    def report(self, task: str, metrics: dict[str, Any]) -> None:
        # Progress comes about once a second per task: the live state only, not the history.
        self.status.on_event("report", {"task": task, "metrics": metrics})

    def task_exited(self, task: str, attempt: int, code: int, at: float, *, oom_killed: bool = False,
                    hang: dict[str, Any] | None = None, cause: str | None = None) -> None:
        cause = cause or attempt_cause(code, oom_killed, hang)
        self.status.exited(task, code, attempt=attempt, at=at, hang=hang, cause=cause)
        self.event("task_exited", task=task, attempt=attempt, code=code, signal=signal_name(code), cause=cause,
                   time_unix=at)

    def task_hung(self, task: str, hang: dict[str, Any]) -> None:
        self.status.hung(task, hang)
        super().task_hung(task, hang)

    def task_restarting(self, task: str, attempt: int, after_s: float, reason: str) -> None:
        self.status.restarting(task, attempt, after_s)
        self.event("restart", task=task, attempt=attempt, after_s=after_s, reason=reason)

    def event(self, kind: str, **data: Any) -> None:
        line = json.dumps({"time_unix": round(time.time(), 3), "event": kind, **data}, default=str)
        with self._lock:
            try:
                with self._events.open("a") as f:
                    f.write(line + "\n")
            except OSError:
                pass  # the log directory went away: the run's own output still shows it

    def on_run_state(self, state: str, at: float) -> None:
        self.status.phase(state)
        self.event("run_phase", phase=state)

    def finished(self, status: str) -> None:
        self.event("run_finished", status=status)
        self.status.finished(status)

    def on_run_end(self, outcome: RunOutcome) -> None:
        self.summary(dict(outcome.summary))
        self.event("run_finished", status=outcome.status)
        self.status.finished(outcome.status, failure=outcome.failure)

    def summary(self, summary: dict[str, Any]) -> None:
        RunDir(self.logdir).summary.write_text(json.dumps(summary, indent=1))

    def snapshot(self) -> dict[str, Any]:
        return self.status.snapshot()

    def tick(self) -> None:
        self.status.write()

    def tasks_added(self, tasks: list[str]) -> None:
        self.status.add_tasks(tasks)
        self.event("tasks_added", tasks=list(tasks))

    def task_retired(self, task: str) -> None:
        self.status.retired(task)
        self.event("task_retired", task=task)


class CompositeRunStore(RunStore):
    """One run written to several stores: ``primary`` first, then each of ``copies``.

    The primary is the run's own record: the live table shows its :meth:`snapshot`, and its errors
    are the run's. A copy (the job store) that raises is warned about once (``warn``) and still
    called afterwards, so it records again as soon as it can; the run never stops for it. The runner
    makes each of its :meth:`members` a subscriber of the controller on its own
    (:class:`~psflow.launch.subscribers.Subscribers`: one failing stops none of the others).
    """

    def __init__(self, primary: RunStore, *copies: RunStore, warn: Callable[[str], None]) -> None:
        self.primary = primary
        self.copies = copies
        self.warn = warn
        self._warned: set[int] = set()

    def members(self) -> list[RunStore]:
        return [self.primary, *self.copies]

    def on_task_state(self, change: TaskChange) -> None:
        self._all("on_task_state", change)

    def on_run_state(self, state: str, at: float) -> None:
        self._all("on_run_state", state, at)

    def on_run_end(self, outcome: RunOutcome) -> None:
        self._all("on_run_end", outcome)

    def _all(self, method: str, *args: Any, **kwargs: Any) -> None:
        getattr(self.primary, method)(*args, **kwargs)
        for i, store in enumerate(self.copies):
            try:
                getattr(store, method)(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 (a copy's failure, whatever it is, must not end the run)
                if i not in self._warned:
                    self._warned.add(i)
                    self.warn(f"cannot record the run in {type(store).__name__} ({type(e).__name__}: {e}); "
                              f"the run goes on, and its files in the logdir are complete.")

    def task_started(self, task: str, attempt: int, handle: Any) -> None:
        self._all("task_started", task, attempt, handle)

    def task_registered(self, task: str, address: str) -> None:
        self._all("task_registered", task, address)

    def report(self, task: str, metrics: dict[str, Any]) -> None:
        self._all("report", task, metrics)

    def task_exited(self, task: str, attempt: int, code: int, at: float, *, oom_killed: bool = False,
                    hang: dict[str, Any] | None = None, cause: str | None = None) -> None:
        self._all("task_exited", task, attempt, code, at, oom_killed=oom_killed, hang=hang, cause=cause)

    def task_hung(self, task: str, hang: dict[str, Any]) -> None:
        self._all("task_hung", task, hang)

    def task_restarting(self, task: str, attempt: int, after_s: float, reason: str) -> None:
        self._all("task_restarting", task, attempt, after_s, reason)

    def event(self, kind: str, **data: Any) -> None:
        self._all("event", kind, **data)

    def finished(self, status: str) -> None:
        self._all("finished", status)

    def summary(self, summary: dict[str, Any]) -> None:
        self._all("summary", summary)

    def snapshot(self) -> dict[str, Any]:
        return self.primary.snapshot()

    def tick(self) -> None:
        self._all("tick")

    def tasks_added(self, tasks: list[str]) -> None:
        self._all("tasks_added", tasks)

    def task_retired(self, task: str) -> None:
        self._all("task_retired", task)

    def control_requests(self) -> list[ControlRequest]:
        out: list[ControlRequest] = []
        for store in (self.primary, *self.copies):
            try:
                out += store.control_requests()
            except Exception as e:  # noqa: BLE001 (a copy's failure must not end the run)
                self.warn(f"cannot read control requests from {type(store).__name__} ({type(e).__name__}: {e}).")
        return out

    def control_answered(self, request: ControlRequest, state: str, answer: str) -> None:
        self._all("control_answered", request, state, answer)
