"""A run's alerts: the run subscriber that tells a webhook when its run fails, stalls or restarts a task.

Every run the platform records (``psflow run``, ``psflow restart``, the dashboard's launcher, ``psflow
chaos``: :mod:`psflow.platform.recording`) has one :class:`RunAlerts` among its run stores: the one
path a run's alerts take, whichever process runs its launcher. Its webhook (:func:`find_webhook`) is
the launcher's own (``psflow run --alert-webhook URL``, ``PSFLOW_ALERT_WEBHOOK``), else that of the
dashboard serving this psflow home (``psflow ui --alert-webhook URL``: its ``ui.json``,
:mod:`psflow.platform.uifile`, looked at every ``look_s``, so a dashboard started during the run is
heard; each alert then links to the run's page). With neither, nothing is told.

It decides with the rules of :class:`psflow.platform.alerts.AlertBook`: a restart the controller
decided (its ``restarting`` change), the run finished ``failed`` (with the outcome's root cause in
words: the exception, its message and its traceback's tail), the global step standing still for
``stall_s`` (looked at on the runner's ticks, about once a second). Alerts go out from a thread of
its own, so the run loop never waits on the network; at the run's end the queue is given ``flush_s``.
Each goes out through an :class:`~psflow.platform.alerts.AlertSender`: claimed in the job store
first, so each alert of a run is told at most once, however many senders see it.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from psflow.launch.runstore import RunStore
from psflow.launch.subscribers import RunOutcome, TaskChange
from psflow.platform.alerts import Alert, AlertBook, AlertSender, check_webhook
from psflow.rundir import RunDir


@dataclass(frozen=True)
class Webhook:
    """Where a run's alerts go: ``url``; ``stall_s``: how long its global step may stand still;
    ``dashboard``: the URL of the dashboard serving the run's psflow home, for a link to its page."""

    url: str
    stall_s: float = 300.0
    dashboard: str | None = None


def find_webhook(own: Webhook | None, home: Path | None = None) -> Webhook | None:
    """``own`` (the launcher's webhook), with a link to the dashboard serving ``home`` if one runs; else
    that dashboard's webhook (``psflow ui --alert-webhook``); else None."""
    from psflow.platform.uifile import running_dashboard

    ui = running_dashboard(home)
    dashboard = str(ui["url"]) if ui is not None else None
    if own is not None:
        return Webhook(own.url, own.stall_s, dashboard)
    alerts = ui.get("alerts") if ui is not None else None
    if isinstance(alerts, dict) and isinstance(alerts.get("webhook"), str):
        stall_s = alerts.get("stall_s")
        return Webhook(alerts["webhook"], float(stall_s) if isinstance(stall_s, (int, float)) else 300.0, dashboard)
    return None


class RunAlerts(RunStore):
    """Decides and sends one run's alerts (see the module docstring).

    Args:
        run_id: the run.
        url: the launcher's own webhook (None: the dashboard's, if one runs with one).
        db_path: the job store where alerts are claimed (None: ``$PSFLOW_HOME/jobs.db``).
        home: the psflow home whose dashboard is looked for (None: ``$PSFLOW_HOME``).
        stall_s: with ``url``: how long the global step may stand still while the run trains.
        warn: says that a webhook could not be reached (the launcher's console).
        send: posts one JSON body (default: urllib, 5 s timeout).
        flush_s: how long the run's end waits for alerts still queued.
        look_s: how often the dashboard's ``ui.json`` is read.
    """

    def __init__(self, run_id: str, url: str | None = None, *, db_path: Path | None = None, home: Path | None = None,
                 stall_s: float = 300.0, warn: Callable[[str], None] = print,
                 send: Callable[[str, bytes], None] | None = None, flush_s: float = 15.0, look_s: float = 2.0) -> None:
        self.run_id, self.db_path, self.home = run_id, db_path, home
        self.own = Webhook(check_webhook(url), stall_s) if url else None
        self.book = AlertBook(stall_s=stall_s)
        self.warn, self.send, self.flush_s, self.look_s = warn, send, flush_s, look_s
        self._webhook: Webhook | None = None
        self._looked = -float("inf")
        self._step = 0
        self._root_cause: dict[str, Any] | None = None
        self._last_look = -float("inf")
        self._queue: queue.Queue[tuple[Alert, Webhook] | None] = queue.Queue()
        self._thread: threading.Thread | None = None

    def webhook(self) -> Webhook | None:
        """Where the alerts go now (:func:`find_webhook`, read again every ``look_s``)."""
        now = time.monotonic()
        if now - self._looked >= self.look_s:
            self._looked = now
            self._webhook = find_webhook(self.own, self.home)
            if self._webhook is not None:
                self.book.stall_s = self._webhook.stall_s
        return self._webhook

    # -- what the run tells it ------------------------------------------------------------------------
    def on_task_state(self, change: TaskChange) -> None:
        if change.state == "restarting":
            self.task_restarting(change.task, change.attempt, change.after_s or 0.0, change.reason or "")

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
        self.webhook()  # its stall_s, before the look
        self._queue_all(self.book.on_look({self.run_id: self._step}, now))

    def summary(self, summary: dict[str, Any]) -> None:
        self._root_cause = root_cause_in_summary(summary)

    def on_run_end(self, outcome: RunOutcome) -> None:
        self._root_cause = dict(outcome.failure) if outcome.failure is not None else None  # the launcher's, put once
        self.finished(outcome.status)

    def finished(self, status: str) -> None:
        event = {"kind": "run_finished", "run_id": self.run_id, "data": {"status": status}}
        self._queue_all(self.book.on_events([event], {self.run_id: self._root_cause}))
        if self._thread is None:
            return
        self._queue.put(None)
        self._thread.join(self.flush_s)
        if self._thread.is_alive():
            self.warn(f"psflow: alerts: the webhook did not take every alert within {self.flush_s:g} s; the rest are lost.")

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
        hook = self.webhook() if alerts else None
        if hook is None:
            return  # no webhook to tell (the book still keeps its count: a stall is told once)
        if self._thread is None:
            self._thread = threading.Thread(target=self._send_loop, name=f"psflow-alerts-{self.run_id}", daemon=True)
            self._thread.start()
        for alert in alerts:
            self._queue.put((alert, hook))

    def _send_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            alert, hook = item
            link = (lambda run_id, base=hook.dashboard: f"{base}#/run/{run_id}") if hook.dashboard else None
            sender = AlertSender(hook.url, db_path=self.db_path, source="launcher", send=self.send, link=link,
                                 warn=lambda m: self.warn(f"psflow: alerts: {m}"))
            sender.tell(alert)  # skipped where another sender claimed it already


def root_cause_in_summary(summary: dict[str, Any]) -> dict[str, Any] | None:
    """The root cause in words from a run's summary: as the launcher put it (``failure``); for a
    summary without it, from the root task's error report (its entry names its log,
    ``LOGDIR/logs/worker-1.log``, so the run's directory) and its last exit's cause."""
    from psflow import errorreport

    if (stored := errorreport.recorded_failure(summary)) is not None:
        return stored
    root = summary.get("root_cause")
    entry = next((t for t in summary.get("tasks") or [] if isinstance(t, dict) and t.get("task") == root), None)
    if not isinstance(root, str) or entry is None or not entry.get("log"):
        return errorreport.describe_root_cause(root if isinstance(root, str) else None)
    return errorreport.failure_from_files(RunDir(Path(str(entry["log"])).parent.parent), root, entry.get("cause"))


def run_alerts(run_id: str, *, warn: Callable[[str], None], env: dict[str, str] | None = None,
               db_path: Path | None = None, home: Path | None = None) -> RunAlerts:
    """The alerts of run ``run_id``: to ``PSFLOW_ALERT_WEBHOOK`` (its stall ``PSFLOW_ALERT_STALL_S``)
    when set, else to the webhook of the dashboard serving ``home``, if any.

    Raises:
        ConfigError: a webhook that is not an http(s) URL, or a bad ``PSFLOW_ALERT_STALL_S``.
    """
    from psflow.home import alert_settings

    url, stall_s = alert_settings(env)
    return RunAlerts(run_id, url, db_path=db_path, home=home, stall_s=stall_s, warn=warn)
