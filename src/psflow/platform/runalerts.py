"""The launcher's own alerts: a run store that tells a webhook when its run fails, stalls or restarts
a task, whether or not a dashboard runs (``psflow run --alert-webhook URL`` or ``PSFLOW_ALERT_WEBHOOK``).

:class:`AlertingRunStore` is one more copy in the launcher's :class:`~psflow.launch.runstore.CompositeRunStore`:
it sees what the runner records as it happens and decides with the dashboard's rules
(:class:`psflow.platform.alerts.AlertBook`): a restart decided (``task_restarting``), the run
finished ``failed`` (with the root cause in words the runner put once: the exception, its message
and its traceback's tail), the global step standing still for ``stall_s``
(looked at on the runner's ticks, about once a second). Alerts go out from a thread of its own, so the
run loop never waits on the network; at the run's end the queue is given ``flush_s`` to drain.

Each alert goes out through an :class:`~psflow.platform.alerts.AlertSender`, as the dashboard's
watcher's do: claimed in the job store first, so a run watched by both is told once.

Made by :func:`alerting_store` for :func:`psflow.launch.runner.recorded_store` and
:mod:`psflow.platform.launching`.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from psflow.launch.runstore import RunStore
from psflow.launch.subscribers import RunOutcome
from psflow.platform.alerts import Alert, AlertBook, AlertSender, check_webhook
from psflow.rundir import RunDir


class AlertingRunStore(RunStore):
    """Decides and sends one run's alerts (see the module docstring).

    Args:
        run_id: the run.
        url: the webhook.
        db_path: the job store where alerts are claimed (None: ``$PSFLOW_HOME/jobs.db``).
        stall_s: how long the global step may stand still while the run trains.
        warn: says that a webhook could not be reached (the launcher's console).
        send: posts one JSON body (default: urllib, 5 s timeout).
        flush_s: how long the run's end waits for alerts still queued.
    """

    def __init__(self, run_id: str, url: str, *, db_path: Path | None = None, stall_s: float = 300.0,
                 warn: Callable[[str], None] = print, send: Callable[[str, bytes], None] | None = None,
                 flush_s: float = 15.0) -> None:
        self.run_id, self.url, self.db_path = run_id, check_webhook(url), db_path
        self.book = AlertBook(stall_s=stall_s)
        self.warn, self.flush_s = warn, flush_s
        self.sender = AlertSender(url, db_path=db_path, source="launcher", send=send,
                                  warn=lambda m: warn(f"psflow: alerts: {m}"))
        self._step = 0
        self._root_cause: dict[str, Any] | None = None
        self._last_look = -float("inf")
        self._queue: queue.Queue[Alert | None] = queue.Queue()
        self._thread = threading.Thread(target=self._send_loop, name=f"psflow-alerts-{run_id}", daemon=True)
        self._thread.start()

    # -- what the runner records ----------------------------------------------------------------------
    def task_restarting(self, task: str, attempt: int, after_s: float, reason: str) -> None:
        event = {"kind": "restart", "run_id": self.run_id, "data": {"task": task, "attempt": attempt, "reason": reason}}
        self._queue_all(self.book.on_events([event], {}))

    def report(self, task: str, metrics: dict[str, Any]) -> None:
        progress = metrics.get("progress")
        step = progress.get("global_step") if isinstance(progress, dict) else metrics.get("global_step")
        if isinstance(step, int) and not isinstance(step, bool) and step > self._step:
            self._step = step

    def tick(self) -> None:
        now = time.monotonic()
        if now - self._last_look < 1.0:
            return
        self._last_look = now
        self._queue_all(self.book.on_look({self.run_id: self._step}, now))

    def summary(self, summary: dict[str, Any]) -> None:
        self._root_cause = root_cause_in_summary(summary)

    def on_run_end(self, outcome: RunOutcome) -> None:
        self._root_cause = dict(outcome.failure) if outcome.failure is not None else None  # the launcher's, put once
        self.finished(outcome.status)

    def finished(self, status: str) -> None:
        event = {"kind": "run_finished", "run_id": self.run_id, "data": {"status": status}}
        self._queue_all(self.book.on_events([event], {self.run_id: self._root_cause}))
        self._queue.put(None)
        self._thread.join(self.flush_s)
        if self._thread.is_alive():
            self.warn(f"psflow: alerts: the webhook {self.url} did not take every alert within {self.flush_s:g} s; "
                      "the rest are lost.")

    def task_started(self, task: str, attempt: int, handle: Any) -> None:
        pass

    def task_registered(self, task: str, address: str) -> None:
        pass

    def task_exited(self, task: str, attempt: int, code: int, at: float, *, oom_killed: bool = False,
                    hang: dict[str, Any] | None = None, cause: str | None = None) -> None:
        pass

    def task_hung(self, task: str, hang: dict[str, Any]) -> None:
        pass

    def event(self, kind: str, **data: Any) -> None:
        pass

    def snapshot(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "tasks": {}}

    # -- sending ---------------------------------------------------------------------------------------
    def _queue_all(self, alerts: list[Alert]) -> None:
        for alert in alerts:
            self._queue.put(alert)

    def _send_loop(self) -> None:
        while (alert := self._queue.get()) is not None:
            self.sender.tell(alert)  # skipped where the dashboard told it already


def root_cause_in_summary(summary: dict[str, Any]) -> dict[str, Any] | None:
    """The root cause in words from a run's summary: as the launcher put it (``failure``); for a
    summary without it, from the root task's error report (its entry names its log,
    ``LOGDIR/logs/worker-1.log``, so the run's directory) and its last exit's cause."""
    from psflow.launch import errorreport

    if (stored := errorreport.recorded_failure(summary)) is not None:
        return stored
    root = summary.get("root_cause")
    entry = next((t for t in summary.get("tasks") or [] if isinstance(t, dict) and t.get("task") == root), None)
    if not isinstance(root, str) or entry is None or not entry.get("log"):
        return errorreport.describe_root_cause(root if isinstance(root, str) else None)
    return errorreport.failure_from_files(RunDir(Path(str(entry["log"])).parent.parent), root, entry.get("cause"))


def alerting_store(run_id: str, *, warn: Callable[[str], None], env: dict[str, str] | None = None,
                   db_path: Path | None = None) -> list[RunStore]:
    """``[AlertingRunStore]`` when ``PSFLOW_ALERT_WEBHOOK`` is set, else ``[]`` (a composite store's extra copies).

    Raises:
        ConfigError: a webhook that is not an http(s) URL, or a bad ``PSFLOW_ALERT_STALL_S``.
    """
    from psflow.home import alert_settings

    url, stall_s = alert_settings(env)
    return [AlertingRunStore(run_id, url, db_path=db_path, stall_s=stall_s, warn=warn)] if url else []
